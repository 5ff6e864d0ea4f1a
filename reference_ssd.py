"""Float64 oracle for the mamba-cp tests (README walkthrough a, b and f).

`ssd_reference` is the naive token-by-token Mamba2 SSD recurrence; every test compares
against it. `ssd_reference_chunked` computes the same thing in the chunked form, for
shapes too long for a Python loop over tokens. `state_passing_reference` is the method of
state-passing context parallelism (walkthrough c and d) in plain torch, W ranks simulated in one
process: the shortest listing of it. `causal_conv1d_reference` and
`conv1d_ssd_reference` add the depthwise causal conv of the fused Mamba2 core.
Everything is computed in float64 and stays differentiable: inputs are cast with
`.double()`, never detached, so gradients reach the caller's tensors.
"""

import torch
import torch.nn.functional as F

_NO_LIMIT = (0.0, float("inf"))


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=_NO_LIMIT):
    """dt' = clamp(softplus(dt + dt_bias), *dt_limit); float64 (b, l, h).

    The clamp always applies, as in mamba_ssm's Triton kernels and transformers' torch path: the
    default limit (0, inf) turns a negative dt' (dt_softplus=False) into 0. torch.clamp's gradient
    is zero strictly outside the limit and passes at its ends, as mamba_ssm's clamp mask does.
    (mamba_ssm's slow torch reference alone skips the clamp for the default limit.)"""
    v = dt.double()  # (b, l, h)
    if dt_bias is not None:
        v = v + dt_bias.double()  # (h,) broadcasts over (b, l)
    if dt_softplus:
        v = F.softplus(v)  # torch default threshold 20 (linear above), like the kernels
    return torch.clamp(v, dt_limit[0], dt_limit[1])


def _heads(B, nheads):
    """(b, l, g, n) -> float64 (b, l, nheads, n); head hh reads group hh // (nheads // g)."""
    g = B.shape[2]
    if nheads % g:
        raise ValueError(f"nheads={nheads} is not divisible by ngroups={g}")
    return B.double().repeat_interleave(nheads // g, dim=2)


def _epilogue(y, x, D, z):
    """y + D * x, then gate with silu(z). y, x, z: (b, l, h, p); D: (h,) or (h, p)."""
    if D is not None:
        Dd = D.double()
        Dd = Dd[:, None] if Dd.dim() == 1 else Dd  # (h, p)
        y = y + x.double() * Dd
    if z is not None:
        y = y * F.silu(z.double())
    return y


def ssd_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                  seq_idx=None, dt_softplus=False, dt_limit=_NO_LIMIT):
    """Sequential SSD loop over tokens. Returns y (b, l, h, p) and final state (b, h, p, n)."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    xd = x.double()  # (b, l, h, p)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    a = torch.exp(dtp * A.double())  # (b, l, h) per-token decay
    Bh, Ch = _heads(B, h), _heads(C, h)  # (b, l, h, n)
    if initial_states is None:
        S = xd.new_zeros(b, h, p, n)
    else:
        S = initial_states.double()  # (b, h, p, n)
    ys = []
    for t in range(l):
        if seq_idx is not None and t > 0:
            # a new document starts at t: reset the state before token t
            keep = (seq_idx[:, t] == seq_idx[:, t - 1])[:, None, None, None]  # (b, 1, 1, 1)
            S = torch.where(keep, S, torch.zeros_like(S))
        inp = (dtp[:, t, :, None, None] * xd[:, t, :, :, None]
               * Bh[:, t, :, None, :])  # (b, h, p, n) = dt' x B^T
        S = a[:, t, :, None, None] * S + inp
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))  # (b, h, p)
    y = torch.stack(ys, dim=1)  # (b, l, h, p)
    return _epilogue(y, x, D, z), S


def summary_scan_reference(a, S_ext, first, last, initial_states):
    """The exclusive scan over segment summaries (README walkthrough d) as one float64 loop in
    sequence order: segment k's state map is S_exit = a_k * S_entry + S_ext_k, a (b, K, h) and
    S_ext (b, K, h, p, n), with a_k already zero where a document starts inside segment k;
    first, last (b, K) are the document ids of each segment's first and last token. The state
    reaches segment k only if its first token continues the previous segment's last document
    (cont (b, K), 1 or 0; segment 0 gets initial_states (b, h, p, n)). Returns the entry state
    of every segment (b, K, h, p, n), the final state (b, h, p, n) and cont."""
    cont = torch.ones(a.shape[:2], dtype=torch.float64, device=a.device)
    cont[:, 1:] = (first[:, 1:] == last[:, :-1]).double()
    E, entries = initial_states.double(), []
    for k in range(a.shape[1]):
        entries.append(cont[:, k, None, None, None] * E)
        E = a[:, k, :, None, None].double() * entries[-1] + S_ext[:, k].double()
    return torch.stack(entries, dim=1), E, cont


def state_passing_reference(x, dt, A, B, C, world, D=None, dt_bias=None, dt_softplus=False,
                            seq_idx=None, initial_states=None, dt_limit=_NO_LIMIT):
    """State-passing CP (README walkthrough c and d) with `world` ranks simulated in one process.

    A shard's exit state is affine in its entry state, S_exit = a_r * S_entry + S_ext_r, so each
    rank summarises its shard alone, an exclusive scan over the W summaries hands every rank its
    true entry state, and each rank then runs its shard from it. Same results as `ssd_reference`
    (y (b, l, h, p), final state (b, h, p, n)), so the method can be read, and checked, apart
    from the kernels."""
    b, l, h, p = x.shape
    if not 1 <= world <= l:
        raise ValueError(f"world={world} must be in [1, seqlen={l}]")
    seq = seq_idx if seq_idx is not None else torch.zeros(b, l, dtype=torch.long, device=x.device)
    dA = process_dt(dt, dt_bias, dt_softplus, dt_limit) * A.double()  # (b, l, h) log per-token decay

    def shard(t):  # 1. rank r holds the r-th contiguous piece of the sequence; lengths may differ
        return torch.tensor_split(t, world, dim=1)
    xs, dts, Bs, Cs, dAs, seqs = map(shard, (x, dt, B, C, dA, seq))
    kw = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)

    # 2. every rank alone: the summary (a_r, S_ext_r) of its shard's state map
    a, S_ext = [], []
    for r in range(world):
        # the entry state survives the shard only if no document starts inside it (one starting at
        # its first token cuts the entry state itself: step 3 sees that from the document ids)
        inside = (seqs[r][:, 1:] != seqs[r][:, :-1]).any(1)  # (b,)
        a.append(torch.exp(dAs[r].sum(1)).masked_fill(inside[:, None], 0.0))  # (b, h)
        S_ext.append(ssd_reference(xs[r], dts[r], A, Bs[r], Cs[r], seq_idx=seqs[r],
                                   **kw)[1])  # (b, h, p, n): the exit state from a zero entry

    # 3. the exclusive scan over ranks (in the real thing: an all-gather of the W summaries, then
    #    this tiny scan on every rank); besides the summaries a rank needs only the document ids of
    #    its neighbour's last token, to tell whether its first token continues that document
    first = torch.stack([s[:, 0] for s in seqs], dim=1)  # (b, W)
    last = torch.stack([s[:, -1] for s in seqs], dim=1)  # (b, W)
    init = x.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states  # (b, h, p, n)
    entries, final, _ = summary_scan_reference(torch.stack(a, 1), torch.stack(S_ext, 1), first, last, init)

    # 4. every rank: its outputs from its true entry state (b, h, p, n)
    ys = [ssd_reference(xs[r], dts[r], A, Bs[r], Cs[r], D=D, initial_states=entries[:, r], seq_idx=seqs[r],
                        **kw)[0] for r in range(world)]  # (b, l_r, h, p), D skip included
    return torch.cat(ys, dim=1), final


def _segsum(v):
    """out[..., i, j] = sum_{j<k<=i} v[..., k] for i >= j, -inf above the diagonal.

    Computed as a masked cumsum (not cs_i - cs_j) so no cancellation can occur.
    v: (..., Q) -> (..., Q, Q).
    """
    Q = v.shape[-1]
    vr = v[..., :, None].expand(*v.shape, Q)  # (..., Q, Q): vr[..., k, j] = v[k]
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=v.device), -1)  # k > j
    out = torch.cumsum(vr.masked_fill(~strict, 0.0), dim=-2)  # sum over j < k <= i
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=v.device))  # i >= j
    return out.masked_fill(~causal, float("-inf"))


def ssd_reference_chunked(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                          seq_idx=None, dt_softplus=False, dt_limit=_NO_LIMIT, chunk_size=64):
    """Chunked SSD (README walkthrough b), vectorised; same results as `ssd_reference`."""
    b, l, h, p = x.shape
    Q = chunk_size
    pad = (-l) % Q
    nc = (l + pad) // Q
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    xd, Bh, Ch = x.double(), _heads(B, h), _heads(C, h)
    seq = seq_idx if seq_idx is not None else torch.zeros(b, l, dtype=torch.long, device=x.device)
    if pad:
        # pad dt' (not raw dt) with zeros: decay 1 and no contribution; padding joins the
        # last document so the final state is the state after token l-1
        xd = F.pad(xd, (0, 0, 0, 0, 0, pad))
        Bh, Ch = F.pad(Bh, (0, 0, 0, 0, 0, pad)), F.pad(Ch, (0, 0, 0, 0, 0, pad))
        dtp = F.pad(dtp, (0, 0, 0, pad))
        seq = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1)
    xd = xd.reshape(b, nc, Q, h, p)
    Bh, Ch = Bh.reshape(b, nc, Q, h, -1), Ch.reshape(b, nc, Q, h, -1)  # (b, c, Q, h, n)
    dtp = dtp.reshape(b, nc, Q, h)
    seq = seq.reshape(b, nc, Q)
    xdt = xd * dtp[..., None]  # (b, c, Q, h, p) = dt' x
    dA = (dtp * A.double()).permute(0, 3, 1, 2)  # (b, h, c, Q)

    # 1. intra-chunk: tokens i >= j of the same document interact
    same = (seq[..., :, None] == seq[..., None, :])[:, None]  # (b, 1, c, Q, Q)
    Lm = torch.exp(_segsum(dA).masked_fill(~same, float("-inf")))  # (b, h, c, Q, Q)
    CB = torch.einsum("bclhn,bcshn->bhcls", Ch, Bh)  # (b, h, c, Q, Q)
    y_diag = torch.einsum("bhcls,bcshp->bclhp", CB * Lm, xdt)  # (b, c, Q, h, p)

    # 2. chunk states with zero entry: only tokens of the chunk's last document survive
    decay_states = Lm[..., -1, :]  # (b, h, c, Q) = exp(cs_last - cs_j), doc-masked
    # pairwise contractions in a fixed order: never form per-token (p, n) states
    xdt_decayed = xdt * decay_states.permute(0, 2, 3, 1)[..., None]  # (b, c, Q, h, p)
    states = torch.einsum("bclhn,bclhp->bchpn", Bh, xdt_decayed)  # (b, c, h, p, n)

    # 3. state passing; the entry state reaches tokens of the document of the token just
    #    before the chunk (for chunk 0: the document of token 0, which initial_states feeds)
    prev_seq = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], dim=1)  # (b, c)
    reach = (seq == prev_seq[..., None])[:, None]  # (b, 1, c, Q)
    whole = reach[..., -1]  # (b, 1, c): no document starts inside the chunk
    carry = torch.exp(dA.sum(-1).masked_fill(~whole, float("-inf")))  # (b, h, c)
    S = xd.new_zeros(b, h, p, Bh.shape[-1]) if initial_states is None else initial_states.double()
    entry = []
    for c in range(nc):  # sequential over chunks only
        entry.append(S)
        S = carry[:, :, c, None, None] * S + states[:, c]
    S_in = torch.stack(entry, dim=1)  # (b, c, h, p, n)

    # 4. inter-chunk output: exp(cs_i) * S_in C_i
    in_decay = torch.exp(torch.cumsum(dA, -1).masked_fill(~reach, float("-inf")))  # (b, h, c, Q)
    y_off = torch.einsum("bclhn,bchpn->bclhp", Ch, S_in) * in_decay.permute(0, 2, 3, 1)[..., None]

    y = (y_diag + y_off).reshape(b, nc * Q, h, p)[:, :l]  # (b, l, h, p)
    return _epilogue(y, x, D, z), S


def causal_conv1d_reference(xBC, weight, bias=None, seq_idx=None, silu=True):
    """Depthwise causal conv + SiLU (or the conv alone). xBC (b, l, dim); weight (dim, d_conv);
    bias (dim,)."""
    b, l, dim = xBC.shape
    K = weight.shape[1]
    xp = F.pad(xBC.double(), (0, 0, K - 1, 0))  # (b, l+K-1, dim): zeros for s < 0
    w = weight.double()
    if seq_idx is not None:
        # padded positions hold zeros anyway; any id works for them
        seqp = torch.cat([seq_idx[:, :1].expand(b, K - 1), seq_idx], dim=1)  # (b, l+K-1)
    out = xp.new_zeros(b, l, dim) if bias is None else bias.double().expand(b, l, dim)
    for k in range(K):
        tap = xp[:, k:k + l]  # (b, l, dim): position s = t - (K-1) + k
        if seq_idx is not None:  # a tap never crosses a document boundary
            tap = torch.where((seqp[:, k:k + l] == seq_idx)[..., None], tap, torch.zeros_like(tap))
        out = out + w[:, k] * tap
    return F.silu(out) if silu else out


def conv1d_ssd_reference(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, *, headdim, ngroups,
                         seq_idx=None, initial_states=None, dt_limit=_NO_LIMIT, chunked=False,
                         chunk_size=64, activation="silu"):
    """Fused Mamba2 core: conv over [x | B | C] (SiLU unless activation is None), then SSD with
    softplus(dt + dt_bias)."""
    b, l, dim = xBC.shape
    nheads = dt.shape[-1]
    d_x = nheads * headdim
    rest = dim - d_x  # 2 * ngroups * dstate
    if rest <= 0 or rest % (2 * ngroups):
        raise ValueError(f"xBC has {dim} channels; expected nheads*headdim ({d_x}) + "
                         f"2*ngroups*dstate with ngroups={ngroups}")
    if conv_weight.shape[0] != dim:
        raise ValueError(f"conv_weight has shape {tuple(conv_weight.shape)}; expected ({dim}, d_conv)")
    dstate = rest // (2 * ngroups)
    u = causal_conv1d_reference(xBC, conv_weight, conv_bias, seq_idx, silu=activation is not None)  # (b, l, dim)
    x, B, C = torch.split(u, [d_x, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(b, l, nheads, headdim)
    B = B.reshape(b, l, ngroups, dstate)
    C = C.reshape(b, l, ngroups, dstate)
    kw = dict(D=D, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
              dt_softplus=True, dt_limit=dt_limit)
    if chunked:
        return ssd_reference_chunked(x, dt, A, B, C, chunk_size=chunk_size, **kw)
    return ssd_reference(x, dt, A, B, C, **kw)


def gated_rmsnorm_reference(y, z, weight, eps, group_size, norm_before_gate=True):
    """mamba_ssm's gated RMSNorm over groups of `group_size` channels of the last dim: with
    norm_before_gate rmsnorm(y) * weight * silu(z), else rmsnorm(y * silu(z)) * weight. float64."""
    y, z = y.double(), z.double()
    if not norm_before_gate:
        y = y * F.silu(z)
    g = y.unflatten(-1, (-1, group_size))                          # (..., groups, group_size)
    n = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    out = n * weight.double()
    return out * F.silu(z) if norm_before_gate else out


def split_conv1d_scan_reference(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, *, headdim, ngroups,
                                initial_states=None, seq_idx=None, dt_limit=_NO_LIMIT, activation="silu",
                                rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                                norm_before_gate=True, chunked=False, chunk_size=64):
    """mamba_ssm's mamba_split_conv1d_scan_combined in float64: zxbcdt = [z0 | x0 | z | xBC | dt]
    (widths d_nonssm, d_nonssm, dim, conv_dim, nheads); conv + SSD on xBC and dt; then y * silu(z)
    or the gated RMSNorm (groups of dim / ngroups); silu(z0) * x0 in front; the out projection."""
    nheads = dt_bias.shape[0] if dt_bias is not None else A.shape[0]
    dim, conv_dim = nheads * headdim, conv1d_weight.shape[0]
    d_nonssm = (zxbcdt.shape[-1] - dim - conv_dim - nheads) // 2
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_nonssm, d_nonssm, dim, conv_dim, nheads], dim=-1)
    y, final = conv1d_ssd_reference(xBC, dt, conv1d_weight, conv1d_bias, dt_bias, A, D, headdim=headdim,
                                    ngroups=ngroups, seq_idx=seq_idx, initial_states=initial_states,
                                    dt_limit=dt_limit, chunked=chunked, chunk_size=chunk_size, activation=activation)
    y = y.flatten(-2)                                               # (b, l, dim)
    if rmsnorm_weight is None:
        out = y * F.silu(z.double())
    else:
        out = gated_rmsnorm_reference(y, z, rmsnorm_weight, rmsnorm_eps, dim // ngroups, norm_before_gate)
    if d_nonssm:
        out = torch.cat([F.silu(z0.double()) * x0.double(), out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight.double(), None if outproj_bias is None else outproj_bias.double())
    return out, final
