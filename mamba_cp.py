"""mamba_cp: state-passing context parallelism for Mamba2's SSD, in one readable module.

The SSD recurrence, per batch row and head (DESIGN.md section 1):

    dt'_t = clamp(softplus(dt_t + dt_bias))          a_t = exp(dt'_t * A)
    S_t   = a_t * S_{t-1} + dt'_t * x_t B_t^T         y_t = S_t C_t + D * x_t   (then * silu(z_t))

Chunked form (section 2). Cut the sequence into chunks of Q tokens; cs_i is the cumulative
sum of dt'*A inside a chunk. A chunk entered with state S_in produces

    y_i   = sum_{j<=i} (C_i . B_j) exp(cs_i - cs_j) dt'_j x_j   +   exp(cs_i) S_in C_i
    S_out = exp(cs_last) S_in  +  sum_j exp(cs_last - cs_j) dt'_j x_j B_j^T

so a chunk (and, the same way, a whole shard of the sequence) maps its entry state to its exit
state affinely: S_out = a * S_in + S_ext. That is what makes context parallelism cheap: each
rank summarises its shard as (S_ext, a), the summaries are all-gathered, and an exclusive scan
over them gives every rank its true entry state (section 3).

Reading order, which is also the order data flows:
  1. Triton kernels, forward: the state pass (chunk states + their sequential combination) and
     the output pass (intra-chunk products plus the entry-state term).
  2. Triton kernels, backward: the reverse state pass and one fused chunk backward.
  3. Input checks and the single-device autograd function `mamba_chunk_scan_combined`.

Numerics. Decays are exponentials of sums of dt'*A. A difference of two large cumulative sums
loses the small difference between them in float32 (exp(cs_i - cs_j) where both are near
-1000), so cumulative sums are formed in float64 and split into a float32 (hi, lo) pair: the
difference of the hi parts is exact wherever it matters (Sterbenz), and the lo parts carry what
float32 rounded away. Every exponent is masked before exp and clamped at 0: no inf * 0.

On a machine without a GPU the same kernels run in the Triton interpreter
(TRITON_INTERPRET=1 is set below when CUDA is absent), so the code can be stepped through.
"""

import os

import torch

if not torch.cuda.is_available():  # must precede the triton import: the interpreter is chosen then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------
# 1. Shared pieces of the kernels: dt processing and the decays of one chunk
# ---------------------------------------------------------------------------------------------


@triton.jit
def _softplus(v):
    # log(1 + exp(v)) without losing exp(v) when it is tiny, linear above 20 like torch
    u = tl.exp(-tl.abs(v))
    log1p_u = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)


@triton.jit
def _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen,
              stride_dt_b, stride_dt_l, stride_dt_h,
              Q: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
              HAS_DT_LIMIT: tl.constexpr, dt_min, dt_max):
    """dt' and dt'*A of one chunk of one head, (Q,) float32 each; zero past the sequence end."""
    t = start + tl.arange(0, Q)
    valid = t < seqlen
    dt = tl.load(dt_ptr + b.to(tl.int64) * stride_dt_b + t.to(tl.int64) * stride_dt_l + h * stride_dt_h,
                 mask=valid, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(valid, dt, 0.0)
    return dt, dt * tl.load(A_ptr + h).to(tl.float32)


@triton.jit
def _chunk_dt_grad_factor(dt_ptr, dt_bias_ptr, b, h, start, seqlen,
                          stride_dt_b, stride_dt_l, stride_dt_h,
                          Q: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                          HAS_DT_LIMIT: tl.constexpr, dt_min, dt_max):
    """d dt' / d dt_raw of one chunk, (Q,): the softplus slope, zero where dt_limit clamps."""
    t = start + tl.arange(0, Q)
    valid = t < seqlen
    v = tl.load(dt_ptr + b.to(tl.int64) * stride_dt_b + t.to(tl.int64) * stride_dt_l + h * stride_dt_h,
                mask=valid, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        v += tl.load(dt_bias_ptr + h).to(tl.float32)
    slope = tl.full((Q,), 1.0, tl.float32)
    if DT_SOFTPLUS:
        slope = tl.where(v > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-v)))
        v = _softplus(v)
    if HAS_DT_LIMIT:
        slope = tl.where((v >= dt_min) & (v <= dt_max), slope, 0.0)
    return tl.where(valid, slope, 0.0)


@triton.jit
def _cumsum_hi_lo(dA):
    """Inclusive cumsum of (Q,) dt'*A as a float32 pair hi + lo, exact to float64 rounding."""
    cs = tl.cumsum(dA.to(tl.float64), axis=0)
    hi = cs.to(tl.float32)
    lo = (cs - hi.to(tl.float64)).to(tl.float32)
    return hi, lo


@triton.jit
def _pair_decay(hi, lo, mask):
    """(Q, Q) exp(cs_i - cs_j) where mask (i >= j and same document), else 0."""
    seg = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
    seg = tl.where(mask, seg, float("-inf"))
    return tl.exp(tl.minimum(seg, 0.0))


@triton.jit
def _seq_ids(seq_ptr, b, start, seqlen, stride_seq_b, stride_seq_l, Q: tl.constexpr):
    """Document ids of one chunk: per token (Q,), the last valid token's, and the token's
    before the chunk (for chunk 0, the first token's: initial_states reach the first document)."""
    t = start + tl.arange(0, Q)
    base = seq_ptr + b.to(tl.int64) * stride_seq_b
    seq = tl.load(base + t.to(tl.int64) * stride_seq_l, mask=t < seqlen, other=-1)
    last = tl.load(base + tl.cast(tl.minimum(start + Q, seqlen) - 1, tl.int64) * stride_seq_l)
    prev = tl.load(base + tl.cast(tl.maximum(start - 1, 0), tl.int64) * stride_seq_l)
    return seq, last, prev


@triton.jit
def _entry_term(entry_ptr, gamma_ptr, b, c, h, offs_p, offs_n, mask_pn, chunks_per_seg,
                stride_en_b, stride_en_s, stride_en_h, stride_en_p, stride_en_n,
                stride_ga_b, stride_ga_c, stride_ga_h):
    """gamma(c) * S_entry[b, segment of c, h] as a (BP, BN) float32 tile: what the segment's
    entry state adds to chunk c's entry state (forward), or, with rho for gamma and dS_exit for
    S_entry, what the gradient at the segment's exit adds to chunk c's exit gradient."""
    gamma = tl.load(gamma_ptr + b.to(tl.int64) * stride_ga_b + tl.cast(c, tl.int64) * stride_ga_c + h * stride_ga_h)
    seg = tl.cast(c // chunks_per_seg, tl.int64)
    S = tl.load(entry_ptr + b.to(tl.int64) * stride_en_b + seg * stride_en_s + h * stride_en_h
                + offs_p[:, None] * stride_en_p + offs_n[None, :] * stride_en_n, mask=mask_pn, other=0.0)
    return gamma * S.to(tl.float32)


# ---------------------------------------------------------------------------------------------
# 2. Forward kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _state_fwd_kernel(
    x_ptr, B_ptr, dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, states_ptr, gamma_ptr, a_ptr, ext_ptr,
    seqlen, nheads, headdim, dstate, nchunks, chunks_per_seg, n_p_tiles, n_n_tiles, heads_per_group,
    dt_min, dt_max,
    stride_x_b, stride_x_l, stride_x_h, stride_x_p,
    stride_B_b, stride_B_l, stride_B_g, stride_B_n,
    stride_dt_b, stride_dt_l, stride_dt_h,
    stride_seq_b, stride_seq_l,
    stride_st_b, stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_ga_b, stride_ga_c, stride_ga_h,
    stride_a_b, stride_a_s, stride_a_h,
    stride_ext_b, stride_ext_s, stride_ext_h, stride_ext_p, stride_ext_n,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One segment (chunks_per_seg chunks) of one (batch, head, state tile), from a zero entry:
    walk its chunks in order carrying S, store each chunk's entry state, then
        S <- exp(cs_last) S + sum_j exp(cs_last - cs_j) dt'_j x_j B_j^T.
    Also store gamma(c), the decay from the segment's start to chunk c's entry (0 once a
    document has started in between), and the segment's affine summary: its exit state S_ext
    and decay a. Segments run in parallel; a scan over their summaries supplies each one's true
    entry state S_entry, and chunk c's true entry state is states(c) + gamma(c) S_entry."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_tiles = n_p_tiles * n_n_tiles
    seg = pid // n_tiles
    pid_p = (pid % n_tiles) // n_n_tiles
    pid_n = pid % n_n_tiles
    b = pid_bh // nheads
    h = pid_bh % nheads
    g = h // heads_per_group
    b64 = b.to(tl.int64)
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)

    x_base = x_ptr + b64 * stride_x_b + h * stride_x_h + offs_p[None, :] * stride_x_p
    B_base = B_ptr + b64 * stride_B_b + g * stride_B_g + offs_n[None, :] * stride_B_n
    st_base = (states_ptr + b64 * stride_st_b + h * stride_st_h
               + offs_p[:, None] * stride_st_p + offs_n[None, :] * stride_st_n)
    ga_base = gamma_ptr + b64 * stride_ga_b + h * stride_ga_h
    first_tile = (pid_p == 0) & (pid_n == 0)          # one program per head writes the decays

    S = tl.zeros((BP, BN), dtype=tl.float32)                                      # (BP, BN)
    log_gamma = tl.zeros((), dtype=tl.float64)
    alive = tl.full((), 1.0, tl.float32)              # 0 once a document starts in the segment
    c_end = tl.minimum((seg + 1) * chunks_per_seg, nchunks)
    for c in range(seg * chunks_per_seg, c_end):
        start = c * Q
        tl.store(st_base + tl.cast(c, tl.int64) * stride_st_c, S.to(states_ptr.dtype.element_ty), mask=mask_pn)
        tl.store(ga_base + tl.cast(c, tl.int64) * stride_ga_c, alive * tl.exp(log_gamma.to(tl.float32)),
                 mask=first_tile)
        dt, dA = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen,
                           stride_dt_b, stride_dt_l, stride_dt_h,
                           Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
        cs = tl.cumsum(dA.to(tl.float64), axis=0)                                 # (Q,) float64
        total = tl.sum(dA.to(tl.float64), axis=0)
        w = tl.exp((total - cs).to(tl.float32)) * dt                              # (Q,) weight of token j
        decay = tl.exp(total.to(tl.float32))
        log_gamma += total
        if HAS_SEQ:
            seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq_b, stride_seq_l, Q)
            w = tl.where(seq == last, w, 0.0)          # only the last document reaches the exit
            decay = tl.where(last == prev, decay, 0.0)  # a document starts inside: entry is cut off
            alive = tl.where(last == prev, alive, 0.0)
        t = start + offs_q
        valid = t < seqlen
        x = tl.load(x_base + t.to(tl.int64)[:, None] * stride_x_l,
                    mask=valid[:, None] & (offs_p[None, :] < headdim), other=0.0)  # (Q, BP)
        Bm = tl.load(B_base + t.to(tl.int64)[:, None] * stride_B_l,
                     mask=valid[:, None] & (offs_n[None, :] < dstate), other=0.0)  # (Q, BN)
        xw = (x.to(tl.float32) * w[:, None]).to(x.dtype)
        S = decay * S + tl.dot(tl.trans(xw), Bm, input_precision=DOT_PRECISION)  # (BP, BN)

    tl.store(a_ptr + b64 * stride_a_b + tl.cast(seg, tl.int64) * stride_a_s + h * stride_a_h,
             alive * tl.exp(log_gamma.to(tl.float32)), mask=first_tile)
    tl.store(ext_ptr + b64 * stride_ext_b + tl.cast(seg, tl.int64) * stride_ext_s + h * stride_ext_h
             + offs_p[:, None] * stride_ext_p + offs_n[None, :] * stride_ext_n, S, mask=mask_pn)


@triton.jit
def _segment_scan_kernel(
    ext_ptr, a_ptr, e_ptr, init_ptr, entry_ptr, exit_ptr,
    nseg, nheads, size,
    stride_ext_b, stride_ext_s, stride_ext_h,
    stride_a_b, stride_a_s, stride_a_h,
    stride_e_b, stride_e_s,
    stride_init_b, stride_init_h,
    stride_en_b, stride_en_s, stride_en_h,
    stride_exit_b, stride_exit_h,
    BLOCK: tl.constexpr, HAS_E: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """The exclusive scan over segment summaries, for one (batch, head, slice of the p*n state):
        S_entry(0) = initial;  S_entry(k+1) = e_{k+1} (a_k S_entry(k) + S_ext(k))
    where e_k = 0 when segment k starts a new document (only needed when that is not already in
    a_k). Stores every S_entry(k) and the exit of the last segment. States are contiguous in p*n."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    if HAS_INIT:
        S = tl.load(init_ptr + b * stride_init_b + h * stride_init_h + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(nseg):
        k64 = tl.cast(k, tl.int64)
        if HAS_E:
            S *= tl.load(e_ptr + b * stride_e_b + k64 * stride_e_s)
        tl.store(entry_ptr + b * stride_en_b + k64 * stride_en_s + h * stride_en_h + offs, S, mask=mask)
        a = tl.load(a_ptr + b * stride_a_b + k64 * stride_a_s + h * stride_a_h)
        S = a * S + tl.load(ext_ptr + b * stride_ext_b + k64 * stride_ext_s + h * stride_ext_h + offs, mask=mask)
    tl.store(exit_ptr + b * stride_exit_b + h * stride_exit_h + offs, S, mask=mask)


@triton.jit
def _segment_scan_bwd_kernel(
    G_ptr, a_ptr, e_ptr, dfinal_ptr, dexit_ptr, dinit_ptr,
    nseg, nheads, size,
    stride_G_b, stride_G_s, stride_G_h,
    stride_a_b, stride_a_s, stride_a_h,
    stride_e_b, stride_e_s,
    stride_df_b, stride_df_h,
    stride_dex_b, stride_dex_s, stride_dex_h,
    stride_di_b, stride_di_h,
    BLOCK: tl.constexpr, HAS_E: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    """The reverse exclusive scan: the gradient arriving at each segment's exit,
        dS_exit(K-1) = d final;  dS_exit(k-1) = e_k (G(k) + a_k dS_exit(k)),
    G(k) being the pull of segment k's own outputs on its entry state. The gradient of the
    initial state is G(0) + a_0 dS_exit(0)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + b * stride_df_b + h * stride_df_h + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(nseg):
        k64 = tl.cast(nseg - 1 - i, tl.int64)
        tl.store(dexit_ptr + b * stride_dex_b + k64 * stride_dex_s + h * stride_dex_h + offs, dS, mask=mask)
        a = tl.load(a_ptr + b * stride_a_b + k64 * stride_a_s + h * stride_a_h)
        dS = a * dS + tl.load(G_ptr + b * stride_G_b + k64 * stride_G_s + h * stride_G_h + offs, mask=mask)
        if HAS_E:  # e_0 = 1: the initial state always reaches the first document
            dS *= tl.load(e_ptr + b * stride_e_b + k64 * stride_e_s)
    tl.store(dinit_ptr + b * stride_di_b + h * stride_di_h + offs, dS, mask=mask)


@triton.jit
def _output_fwd_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dt_bias_ptr, A_ptr, D_ptr, z_ptr, seq_ptr, states_ptr, y_ptr,
    entry_ptr, gamma_ptr,
    seqlen, headdim, dstate, heads_per_group, chunks_per_seg, dt_min, dt_max,
    stride_x_b, stride_x_l, stride_x_h, stride_x_p,
    stride_B_b, stride_B_l, stride_B_g, stride_B_n,
    stride_C_b, stride_C_l, stride_C_g, stride_C_n,
    stride_dt_b, stride_dt_l, stride_dt_h,
    stride_D_h, stride_D_p,
    stride_z_b, stride_z_l, stride_z_h, stride_z_p,
    stride_seq_b, stride_seq_l,
    stride_st_b, stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_y_b, stride_y_l, stride_y_h, stride_y_p,
    stride_en_b, stride_en_s, stride_en_h, stride_en_p, stride_en_n,
    stride_ga_b, stride_ga_c, stride_ga_h,
    ngroups,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_ENTRY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Outputs of one (chunk, batch, group, p-block): C.B is formed once and reused by every
    head of the group; then per head y = (C.B * decay * dt') x + exp(cs) C S_in (+ D x, * silu z),
    with S_in = states(c) + gamma(c) S_entry: the segment's entry state is folded in here."""
    c = tl.program_id(0)
    pid_bg = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = pid_bg // ngroups
    g = pid_bg % ngroups
    start = c * Q
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    t = start + offs_q
    valid = t < seqlen
    mask_qp = valid[:, None] & (offs_p[None, :] < headdim)
    mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
    t64 = t.to(tl.int64)

    Bm = tl.load(B_ptr + b.to(tl.int64) * stride_B_b + t64[:, None] * stride_B_l + g * stride_B_g
                 + offs_n[None, :] * stride_B_n, mask=mask_qn, other=0.0)          # (Q, BN)
    Cm = tl.load(C_ptr + b.to(tl.int64) * stride_C_b + t64[:, None] * stride_C_l + g * stride_C_g
                 + offs_n[None, :] * stride_C_n, mask=mask_qn, other=0.0)          # (Q, BN)
    CB = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION)                   # (Q, Q)

    causal = offs_q[:, None] >= offs_q[None, :]
    entry = tl.full((Q,), 1, tl.int1)
    if HAS_SEQ:
        seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq_b, stride_seq_l, Q)
        causal = causal & (seq[:, None] == seq[None, :])
        entry = seq == prev                  # the entry state reaches only the continuing document

    for hh in range(heads_per_group):
        h = g * heads_per_group + hh
        dt, dA = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen,
                           stride_dt_b, stride_dt_l, stride_dt_h,
                           Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
        hi, lo = _cumsum_hi_lo(dA)
        M = CB * _pair_decay(hi, lo, causal) * dt[None, :]                          # (Q, Q)
        x = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + t64[:, None] * stride_x_l + h * stride_x_h
                    + offs_p[None, :] * stride_x_p, mask=mask_qp, other=0.0)        # (Q, BP)
        y = tl.dot(M.to(x.dtype), x, input_precision=DOT_PRECISION)                # (Q, BP)

        mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
        S_in = tl.load(states_ptr + b.to(tl.int64) * stride_st_b + tl.cast(c, tl.int64) * stride_st_c
                       + h * stride_st_h + offs_p[:, None] * stride_st_p + offs_n[None, :] * stride_st_n,
                       mask=mask_pn, other=0.0)                                    # (BP, BN)
        if HAS_ENTRY:
            S_in = S_in.to(tl.float32) + _entry_term(entry_ptr, gamma_ptr, b, c, h, offs_p, offs_n, mask_pn,
                                                     chunks_per_seg, stride_en_b, stride_en_s, stride_en_h,
                                                     stride_en_p, stride_en_n, stride_ga_b, stride_ga_c, stride_ga_h)
        e = tl.where(entry, tl.exp(hi + lo), 0.0)                                  # (Q,)
        y += e[:, None] * tl.dot(Cm, tl.trans(S_in.to(Cm.dtype)), input_precision=DOT_PRECISION)

        if HAS_D:
            Dv = tl.load(D_ptr + h * stride_D_h + offs_p * stride_D_p, mask=offs_p < headdim, other=0.0)
            y += Dv.to(tl.float32)[None, :] * x.to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + b.to(tl.int64) * stride_z_b + t64[:, None] * stride_z_l + h * stride_z_h
                        + offs_p[None, :] * stride_z_p, mask=mask_qp, other=0.0).to(tl.float32)
            y *= z * tl.sigmoid(z)
        tl.store(y_ptr + b.to(tl.int64) * stride_y_b + t64[:, None] * stride_y_l + h * stride_y_h
                 + offs_p[None, :] * stride_y_p, y.to(y_ptr.dtype.element_ty), mask=mask_qp)


# ---------------------------------------------------------------------------------------------
# 3. Backward kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _state_bwd_kernel(
    dout_ptr, z_ptr, C_ptr, dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, dstates_ptr, rho_ptr, G_ptr, a_ptr,
    seqlen, nheads, headdim, dstate, nchunks, chunks_per_seg, n_p_tiles, n_n_tiles, heads_per_group,
    dt_min, dt_max,
    stride_do_b, stride_do_l, stride_do_h, stride_do_p,
    stride_z_b, stride_z_l, stride_z_h, stride_z_p,
    stride_C_b, stride_C_l, stride_C_g, stride_C_n,
    stride_dt_b, stride_dt_l, stride_dt_h,
    stride_seq_b, stride_seq_l,
    stride_ds_b, stride_ds_c, stride_ds_h, stride_ds_p, stride_ds_n,
    stride_rho_b, stride_rho_c, stride_rho_h,
    stride_G_b, stride_G_s, stride_G_h, stride_G_p, stride_G_n,
    stride_a_b, stride_a_s, stride_a_h,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The forward state pass run backwards over one segment, from a zero gradient at its exit:
    walk its chunks last to first carrying dS, the gradient arriving at a chunk's exit; store it
    per chunk, then dS <- exp(cs_last) dS + sum_i exp(cs_i) dy_i C_i^T. What is left at the
    segment's start is G, the pull of its own outputs on its entry state. Also store rho(c), the
    decay from chunk c's exit to the segment's exit: once the reverse scan has found the gradient
    dS_exit arriving at the segment's exit, chunk c's exit gradient is dstates(c) + rho(c) dS_exit.
    The segment's decay a (as in the forward pass) comes out too, so G can be scanned at once."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_tiles = n_p_tiles * n_n_tiles
    seg = pid // n_tiles
    pid_p = (pid % n_tiles) // n_n_tiles
    pid_n = pid % n_n_tiles
    b = pid_bh // nheads
    h = pid_bh % nheads
    g = h // heads_per_group
    b64 = b.to(tl.int64)
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)

    ds_base = (dstates_ptr + b64 * stride_ds_b + h * stride_ds_h
               + offs_p[:, None] * stride_ds_p + offs_n[None, :] * stride_ds_n)
    rho_base = rho_ptr + b64 * stride_rho_b + h * stride_rho_h
    first_tile = (pid_p == 0) & (pid_n == 0)
    dS = tl.zeros((BP, BN), dtype=tl.float32)                                     # (BP, BN)
    log_rho = tl.zeros((), dtype=tl.float64)
    alive = tl.full((), 1.0, tl.float32)
    c_first = seg * chunks_per_seg
    c_end = tl.minimum(c_first + chunks_per_seg, nchunks)
    for i in range(c_end - c_first):
        c = c_end - 1 - i
        start = c * Q
        tl.store(ds_base + tl.cast(c, tl.int64) * stride_ds_c, dS.to(dstates_ptr.dtype.element_ty), mask=mask_pn)
        tl.store(rho_base + tl.cast(c, tl.int64) * stride_rho_c, alive * tl.exp(log_rho.to(tl.float32)),
                 mask=first_tile)
        dt, dA = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen,
                           stride_dt_b, stride_dt_l, stride_dt_h,
                           Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
        hi, lo = _cumsum_hi_lo(dA)
        total = tl.sum(dA.to(tl.float64), axis=0)
        e = tl.exp(hi + lo)                                                       # (Q,)
        decay = tl.exp(total.to(tl.float32))
        log_rho += total
        if HAS_SEQ:
            seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq_b, stride_seq_l, Q)
            e = tl.where(seq == prev, e, 0.0)
            decay = tl.where(last == prev, decay, 0.0)
            alive = tl.where(last == prev, alive, 0.0)
        t = start + offs_q
        t64 = t.to(tl.int64)
        valid = t < seqlen
        mask_qp = valid[:, None] & (offs_p[None, :] < headdim)
        dy = tl.load(dout_ptr + b64 * stride_do_b + t64[:, None] * stride_do_l + h * stride_do_h
                     + offs_p[None, :] * stride_do_p, mask=mask_qp, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + b64 * stride_z_b + t64[:, None] * stride_z_l + h * stride_z_h
                        + offs_p[None, :] * stride_z_p, mask=mask_qp, other=0.0).to(tl.float32)
            dy *= z * tl.sigmoid(z)
        Cm = tl.load(C_ptr + b64 * stride_C_b + t64[:, None] * stride_C_l + g * stride_C_g
                     + offs_n[None, :] * stride_C_n, mask=valid[:, None] & (offs_n[None, :] < dstate), other=0.0)
        dye = (dy * e[:, None]).to(Cm.dtype)
        dS = decay * dS + tl.dot(tl.trans(dye), Cm, input_precision=DOT_PRECISION)  # (BP, BN)

    tl.store(G_ptr + b64 * stride_G_b + tl.cast(seg, tl.int64) * stride_G_s + h * stride_G_h
             + offs_p[:, None] * stride_G_p + offs_n[None, :] * stride_G_n, dS, mask=mask_pn)
    tl.store(a_ptr + b64 * stride_a_b + tl.cast(seg, tl.int64) * stride_a_s + h * stride_a_h,
             alive * tl.exp(log_rho.to(tl.float32)), mask=first_tile)


@triton.jit
def _chunk_bwd_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dt_bias_ptr, A_ptr, D_ptr, z_ptr, seq_ptr, states_ptr, dstates_ptr,
    entry_ptr, gamma_ptr, dexit_ptr, rho_ptr,
    dout_ptr, dx_ptr, dB_ptr, dC_ptr, ddt_ptr, dz_ptr, dA_part_ptr, dD_part_ptr,
    seqlen, headdim, dstate, heads_per_group, ngroups, nheads, chunks_per_seg, dt_min, dt_max,
    stride_x_b, stride_x_l, stride_x_h, stride_x_p,
    stride_B_b, stride_B_l, stride_B_g, stride_B_n,
    stride_C_b, stride_C_l, stride_C_g, stride_C_n,
    stride_dt_b, stride_dt_l, stride_dt_h,
    stride_D_h, stride_D_p,
    stride_z_b, stride_z_l, stride_z_h, stride_z_p,
    stride_seq_b, stride_seq_l,
    stride_st_b, stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_ds_b, stride_ds_c, stride_ds_h, stride_ds_p, stride_ds_n,
    stride_en_b, stride_en_s, stride_en_h, stride_en_p, stride_en_n,
    stride_ga_b, stride_ga_c, stride_ga_h,
    stride_dex_b, stride_dex_s, stride_dex_h, stride_dex_p, stride_dex_n,
    stride_rho_b, stride_rho_c, stride_rho_h,
    stride_do_b, stride_do_l, stride_do_h, stride_do_p,
    stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
    stride_dB_b, stride_dB_l, stride_dB_g, stride_dB_n,
    stride_dC_b, stride_dC_l, stride_dC_g, stride_dC_n,
    stride_ddt_b, stride_ddt_l, stride_ddt_h,
    stride_dz_b, stride_dz_l, stride_dz_h, stride_dz_p,
    stride_dAp_b, stride_dAp_c, stride_dAp_h,
    stride_dDp_b, stride_dDp_c, stride_dDp_h, stride_dDp_p,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_SEQ: tl.constexpr,
    HAS_ENTRY: tl.constexpr, HAS_EXIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Every gradient of one (chunk, batch, group), given the chunk's entry state S_in and the
    gradient dS_out arriving at its exit. C.B is formed once for the group; the heads' pulls on
    C.B, B and C are summed in registers, so dB and dC are written once, without atomics.

    Per head, with M_ij = (C_i.B_j) exp(cs_i - cs_j) masked, w_j = exp(cs_last - cs_j) dt'_j:
      dx_j  = dt'_j sum_i M_ij dy_i + w_j dS_out B_j + D dy_j
      d(dt'_k A) collects every decay exponent whose span contains token k: the pairs
              i >= k > j, the entry decays exp(cs_i) with i >= k, the exit decays
              exp(cs_last - cs_j) with j < k, and the chunk's own decay exp(cs_last)."""
    c = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // ngroups
    g = pid_bg % ngroups
    start = c * Q
    offs_q = tl.arange(0, Q)
    offs_p = tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    t = start + offs_q
    t64 = t.to(tl.int64)
    valid = t < seqlen
    mask_qp = valid[:, None] & (offs_p[None, :] < headdim)
    mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
    b64 = b.to(tl.int64)
    c64 = tl.cast(c, tl.int64)

    Bm = tl.load(B_ptr + b64 * stride_B_b + t64[:, None] * stride_B_l + g * stride_B_g
                 + offs_n[None, :] * stride_B_n, mask=mask_qn, other=0.0)          # (Q, BN)
    Cm = tl.load(C_ptr + b64 * stride_C_b + t64[:, None] * stride_C_l + g * stride_C_g
                 + offs_n[None, :] * stride_C_n, mask=mask_qn, other=0.0)          # (Q, BN)
    CB = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION)                   # (Q, Q)

    causal = offs_q[:, None] >= offs_q[None, :]
    entry = tl.full((Q,), 1, tl.int1)
    to_exit = tl.full((Q,), 1, tl.int1)
    carry = True
    if HAS_SEQ:
        seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq_b, stride_seq_l, Q)
        causal = causal & (seq[:, None] == seq[None, :])
        entry = seq == prev
        to_exit = seq == last
        carry = last == prev
    strict = causal & (offs_q[:, None] > offs_q[None, :])
    causal_k = offs_q[:, None] >= offs_q[None, :]
    before = (offs_q[:, None] < offs_q[None, :]).to(tl.float32)                     # (Q, Q) j < k

    dCB = tl.zeros((Q, Q), dtype=tl.float32)
    dB = tl.zeros((Q, BN), dtype=tl.float32)
    dC = tl.zeros((Q, BN), dtype=tl.float32)
    for hh in range(heads_per_group):
        h = g * heads_per_group + hh
        dt, dA = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen,
                           stride_dt_b, stride_dt_l, stride_dt_h,
                           Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
        hi, lo = _cumsum_hi_lo(dA)
        cs64 = tl.cumsum(dA.to(tl.float64), axis=0)
        total = tl.sum(dA.to(tl.float64), axis=0)
        e = tl.where(entry, tl.exp(hi + lo), 0.0)                                  # (Q,) entry decay
        w_dec = tl.where(to_exit, tl.exp((total - cs64).to(tl.float32)), 0.0)      # (Q,) decay to exit
        w = w_dec * dt
        decay = tl.where(carry, tl.exp(total.to(tl.float32)), 0.0)
        L = _pair_decay(hi, lo, causal)                                            # (Q, Q)
        M = CB * L
        Mdt = M * dt[None, :]

        x = tl.load(x_ptr + b64 * stride_x_b + t64[:, None] * stride_x_l + h * stride_x_h
                    + offs_p[None, :] * stride_x_p, mask=mask_qp, other=0.0)        # (Q, BP)
        dout = tl.load(dout_ptr + b64 * stride_do_b + t64[:, None] * stride_do_l + h * stride_do_h
                       + offs_p[None, :] * stride_do_p, mask=mask_qp, other=0.0).to(tl.float32)
        st_off = b64 * stride_st_b + c64 * stride_st_c + h * stride_st_h
        S_in = tl.load(states_ptr + st_off + offs_p[:, None] * stride_st_p + offs_n[None, :] * stride_st_n,
                       mask=mask_pn, other=0.0)                                    # (BP, BN)
        dS_out = tl.load(dstates_ptr + b64 * stride_ds_b + c64 * stride_ds_c + h * stride_ds_h
                         + offs_p[:, None] * stride_ds_p + offs_n[None, :] * stride_ds_n,
                         mask=mask_pn, other=0.0)                                  # (BP, BN)
        if HAS_ENTRY:
            S_in = S_in.to(tl.float32) + _entry_term(entry_ptr, gamma_ptr, b, c, h, offs_p, offs_n, mask_pn,
                                                     chunks_per_seg, stride_en_b, stride_en_s, stride_en_h,
                                                     stride_en_p, stride_en_n, stride_ga_b, stride_ga_c, stride_ga_h)
        if HAS_EXIT:
            dS_out = dS_out.to(tl.float32) + _entry_term(dexit_ptr, rho_ptr, b, c, h, offs_p, offs_n, mask_pn,
                                                         chunks_per_seg, stride_dex_b, stride_dex_s, stride_dex_h,
                                                         stride_dex_p, stride_dex_n, stride_rho_b, stride_rho_c,
                                                         stride_rho_h)
        y_entry = e[:, None] * tl.dot(Cm, tl.trans(S_in.to(Cm.dtype)), input_precision=DOT_PRECISION)
        Dv = tl.zeros((BP,), dtype=tl.float32)
        if HAS_D:
            Dv = tl.load(D_ptr + h * stride_D_h + offs_p * stride_D_p, mask=offs_p < headdim, other=0.0).to(tl.float32)
        dy = dout
        if HAS_Z:
            # the gate needs the pre-gate output: recompute it rather than save it
            z = tl.load(z_ptr + b64 * stride_z_b + t64[:, None] * stride_z_l + h * stride_z_h
                        + offs_p[None, :] * stride_z_p, mask=mask_qp, other=0.0).to(tl.float32)
            y = tl.dot(Mdt.to(x.dtype), x, input_precision=DOT_PRECISION) + y_entry + Dv[None, :] * x.to(tl.float32)
            sz = tl.sigmoid(z)
            dy = dout * z * sz
            dz = dout * y * sz * (1.0 + z * (1.0 - sz))
            tl.store(dz_ptr + b64 * stride_dz_b + t64[:, None] * stride_dz_l + h * stride_dz_h
                     + offs_p[None, :] * stride_dz_p, dz.to(dz_ptr.dtype.element_ty), mask=mask_qp)

        # dx: through the intra-chunk products, the chunk state, and D
        dy_c = dy.to(x.dtype)
        BdS = tl.dot(Bm, tl.trans(dS_out.to(Bm.dtype)), input_precision=DOT_PRECISION)  # (Q, BP)
        dx = tl.dot(tl.trans(Mdt.to(x.dtype)), dy_c, input_precision=DOT_PRECISION) + w[:, None] * BdS
        dx += Dv[None, :] * dy
        tl.store(dx_ptr + b64 * stride_dx_b + t64[:, None] * stride_dx_l + h * stride_dx_h
                 + offs_p[None, :] * stride_dx_p, dx.to(dx_ptr.dtype.element_ty), mask=mask_qp)
        if HAS_D:
            tl.store(dD_part_ptr + b64 * stride_dDp_b + c64 * stride_dDp_c + h * stride_dDp_h
                     + offs_p * stride_dDp_p, tl.sum(dy * x.to(tl.float32), axis=0), mask=offs_p < headdim)

        # dt' and d(dt'*A)
        dxy = tl.dot(dy_c, tl.trans(x), input_precision=DOT_PRECISION)             # (Q, Q) dy_i . x_j
        dw = tl.sum(x.to(tl.float32) * BdS, axis=1)                                # (Q,) d w_j
        ddt = tl.sum(dxy * M, axis=0) + dw * w_dec
        # d(dt'_k A): every decay that spans token k. Each is summed directly over the pairs that
        # span k (i >= k > j), never as a difference of running sums that would cancel.
        V = tl.where(strict, dxy * Mdt, 0.0)                                       # (Q, Q) pair (i, j)
        spans = tl.dot(V, before, input_precision=DOT_PRECISION)                   # sum_{j<k} V_ij
        d_intra = tl.sum(tl.where(causal_k, spans, 0.0), axis=0)                   # sum_{i>=k}
        d_entry = tl.cumsum(tl.sum(dy * y_entry, axis=1), axis=0, reverse=True)     # exp(cs_i), i >= k
        sw = (dw * w).to(tl.float64)
        d_exit = (tl.cumsum(sw, axis=0) - sw).to(tl.float32)                       # exp(cs_last-cs_j), j < k
        d_carry = decay * tl.sum(tl.sum(dS_out.to(tl.float32) * S_in.to(tl.float32), axis=1), axis=0)
        ddA = d_intra + d_entry + d_exit + d_carry
        A_h = tl.load(A_ptr + h).to(tl.float32)
        ddt += ddA * A_h
        tl.store(dA_part_ptr + b64 * stride_dAp_b + c64 * stride_dAp_c + h * stride_dAp_h, tl.sum(ddA * dt, axis=0))
        slope = _chunk_dt_grad_factor(dt_ptr, dt_bias_ptr, b, h, start, seqlen,
                                      stride_dt_b, stride_dt_l, stride_dt_h,
                                      Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
        tl.store(ddt_ptr + b64 * stride_ddt_b + t64 * stride_ddt_l + h * stride_ddt_h, ddt * slope, mask=valid)

        # this head's pull on C.B, B and C, summed over the group
        dCB += dxy * L * dt[None, :]
        dB += w[:, None] * tl.dot(x, dS_out.to(x.dtype), input_precision=DOT_PRECISION)
        dC += tl.dot((dy * e[:, None]).to(x.dtype), S_in.to(x.dtype), input_precision=DOT_PRECISION)

    dCB_c = dCB.to(Cm.dtype)
    dC += tl.dot(dCB_c, Bm, input_precision=DOT_PRECISION)
    dB += tl.dot(tl.trans(dCB_c), Cm, input_precision=DOT_PRECISION)
    tl.store(dB_ptr + b64 * stride_dB_b + t64[:, None] * stride_dB_l + g * stride_dB_g
             + offs_n[None, :] * stride_dB_n, dB.to(dB_ptr.dtype.element_ty), mask=mask_qn)
    tl.store(dC_ptr + b64 * stride_dC_b + t64[:, None] * stride_dC_l + g * stride_dC_g
             + offs_n[None, :] * stride_dC_n, dC.to(dC_ptr.dtype.element_ty), mask=mask_qn)


# ---------------------------------------------------------------------------------------------
# 4. Input checks: every bad input gets a ValueError naming the argument, what was seen, and
#    what was expected, before any kernel (or, for CP, any collective) runs.
# ---------------------------------------------------------------------------------------------


def _expect(cond, name, seen, expected):
    if not cond:
        raise ValueError(f"{name}: got {seen}, expected {expected}")


def _check_tensor(t, name, shape, ref, *, dtypes=None, allow_none=True):
    """Shape (None entries are free), device of `ref`, floating dtype (or one of `dtypes`)."""
    if t is None:
        _expect(allow_none, name, "None", "a tensor")
        return
    _expect(isinstance(t, torch.Tensor), name, type(t).__name__, "a torch.Tensor")
    _expect(t.dim() == len(shape), name, f"shape {tuple(t.shape)} ({t.dim()} dims)",
            f"{len(shape)} dims {tuple('*' if s is None else s for s in shape)}")
    ok = all(s is None or s == d for s, d in zip(shape, t.shape))
    _expect(ok, name, f"shape {tuple(t.shape)}", f"shape {tuple('*' if s is None else s for s in shape)}")
    _expect(t.device == ref.device, name, f"device {t.device}", f"device {ref.device} (like x)")
    if dtypes is None:
        _expect(t.is_floating_point(), name, f"dtype {t.dtype}", "a floating dtype")
    else:
        _expect(t.dtype in dtypes, name, f"dtype {t.dtype}", f"one of {[str(d) for d in dtypes]}")


def _check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit):
    _expect(isinstance(x, torch.Tensor) and x.dim() == 4, "x",
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}",
            "a 4-dim tensor (batch, seqlen, nheads, headdim)")
    _check_tensor(x, "x", (None, None, None, None), x, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    b, l, h, p = x.shape
    _expect(isinstance(B, torch.Tensor) and B.dim() == 4, "B",
            f"{tuple(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__}",
            f"a 4-dim tensor ({b}, {l}, ngroups, dstate)")
    g, n = B.shape[2], B.shape[3]
    _check_tensor(dt, "dt", (b, l, h), x, allow_none=False)
    _check_tensor(A, "A", (h,), x, allow_none=False)
    _check_tensor(B, "B", (b, l, g, n), x, dtypes=(x.dtype,))
    _check_tensor(C, "C", (b, l, g, n), x, dtypes=(x.dtype,), allow_none=False)
    _expect(g >= 1 and h % g == 0, "B", f"ngroups={g} with nheads={h}", "ngroups dividing nheads")
    _expect(isinstance(chunk_size, int) and chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0,
            "chunk_size", chunk_size, "a power of two >= 16")
    _expect(l >= 1, "x", f"seqlen {l}", "at least one token")
    _expect(n <= 256, "B", f"dstate {n}", "dstate <= 256 (one register tile per state row)")
    _expect(p <= 256, "x", f"headdim {p}", "headdim <= 256 (one register tile per head)")
    if D is not None:
        _check_tensor(D, "D", (h,) if D.dim() == 1 else (h, p), x)
    _check_tensor(z, "z", (b, l, h, p), x, dtypes=(x.dtype,))
    _check_tensor(dt_bias, "dt_bias", (h,), x)
    _check_tensor(initial_states, "initial_states", (b, h, p, n), x)
    if seq_idx is not None:
        _check_tensor(seq_idx, "seq_idx", (b, l), x, dtypes=(torch.int32, torch.int64))
        _expect(bool((seq_idx[:, 1:] >= seq_idx[:, :-1]).all()), "seq_idx",
                "a decreasing step", "non-decreasing document ids along each row")
    _expect(isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1],
            "dt_limit", dt_limit, "a pair (dt_min, dt_max) with dt_min <= dt_max")


# ---------------------------------------------------------------------------------------------
# 5. Launch wrappers and the single-device autograd function
# ---------------------------------------------------------------------------------------------


def _pow2(v, lo=16):
    return max(lo, triton.next_power_of_2(v))


def _strides(t, ndim):
    """Strides of an optional tensor (zeros when absent), so one kernel serves every option."""
    return tuple(t.stride()) if t is not None else (0,) * ndim


# Kernel chunk lengths. The chunked form computes the same recurrence for any chunk length, so
# the kernels may use a shorter chunk than the caller's chunk_size: the fused backward keeps its
# group accumulators in registers only up to 64 tokens. Segments of CHUNKS_PER_SEGMENT chunks
# run the sequential state pass in parallel (section 3 of DESIGN.md, applied within one GPU);
# the interpreter uses tiny segments so that CPU tests exercise the segment scan.
MAX_CHUNK_FWD = 128
MAX_CHUNK_BWD = 64
CHUNKS_PER_SEGMENT = 2 if INTERPRET else 16


class _Launch:
    """Everything the kernels need that is derived once per call: sizes, tile shapes, flags."""

    def __init__(self, x, B, chunk, dt_bias, dt_softplus, dt_limit, D, z, seq_idx):
        self.batch, self.seqlen, self.nheads, self.headdim = x.shape
        self.ngroups, self.dstate = B.shape[2], B.shape[3]
        self.heads_per_group = self.nheads // self.ngroups
        self.Q = chunk
        self.nchunks = triton.cdiv(self.seqlen, chunk)
        self.chunks_per_seg = CHUNKS_PER_SEGMENT
        self.nseg = triton.cdiv(self.nchunks, self.chunks_per_seg)
        self.BP = _pow2(self.headdim)
        self.BN = _pow2(self.dstate)
        # the state pass walks chunks sequentially: split the state tile across programs
        self.BP_state = self.BP if INTERPRET else min(self.BP, 64)
        self.BN_state = self.BN if INTERPRET else min(self.BN, 64)
        self.n_p_tiles = triton.cdiv(self.headdim, self.BP_state)
        self.n_n_tiles = triton.cdiv(self.dstate, self.BN_state)
        self.dt_min, self.dt_max = float(dt_limit[0]), float(dt_limit[1])
        self.flags = dict(HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
                          HAS_DT_LIMIT=tuple(dt_limit) != (0.0, float("inf")), HAS_SEQ=seq_idx is not None)
        self.precision = "ieee" if x.dtype == torch.float32 else "tf32"
        self.state_dtype = torch.float32 if x.dtype == torch.float32 else x.dtype
        self.warps = 4 if INTERPRET else 8

    def state_grid(self):
        return (self.nseg * self.n_p_tiles * self.n_n_tiles, self.batch * self.nheads)


def _state_fwd(x, dt, A, B, dt_bias, seq_idx, k):
    """Every segment from a zero entry: chunk entry states (b, nchunks, h, p, n), gamma
    (b, nchunks, h), and the segments' summaries a (b, nseg, h) and S_ext (b, nseg, h, p, n)."""
    dev = x.device
    states = torch.empty(k.batch, k.nchunks, k.nheads, k.headdim, k.dstate, device=dev, dtype=k.state_dtype)
    gamma = torch.empty(k.batch, k.nchunks, k.nheads, device=dev, dtype=torch.float32)
    a = torch.empty(k.batch, k.nseg, k.nheads, device=dev, dtype=torch.float32)
    S_ext = torch.empty(k.batch, k.nseg, k.nheads, k.headdim, k.dstate, device=dev, dtype=torch.float32)
    _state_fwd_kernel[k.state_grid()](
        x, B, dt, dt_bias, A, seq_idx, states, gamma, a, S_ext,
        k.seqlen, k.nheads, k.headdim, k.dstate, k.nchunks, k.chunks_per_seg, k.n_p_tiles, k.n_n_tiles,
        k.heads_per_group, k.dt_min, k.dt_max,
        *x.stride(), *B.stride(), *dt.stride(), *_strides(seq_idx, 2),
        *states.stride(), *gamma.stride(), *a.stride(), *S_ext.stride(),
        Q=k.Q, BP=k.BP_state, BN=k.BN_state, DOT_PRECISION=k.precision, num_warps=4, **k.flags)
    return states, gamma, a, S_ext


def _scan_block(size):
    return triton.next_power_of_2(size) if INTERPRET else min(1024, triton.next_power_of_2(size))


def scan_segments(S_ext, a, initial=None, e=None):
    """Exclusive scan over segment summaries: the entry state of every segment (b, K, h, p, n)
    and the exit state of the last (b, h, p, n), all fp32. S_ext (b, K, h, p, n) and a (b, K, h)
    contiguous; initial (b, h, p, n) or None; e (b, K) fp32 document-continuation flags or None."""
    b, K, h, p, n = S_ext.shape
    entry = torch.empty_like(S_ext)
    exit_ = torch.empty(b, h, p, n, device=S_ext.device, dtype=torch.float32)
    initial = None if initial is None else initial.float().contiguous()
    BLOCK = _scan_block(p * n)
    _segment_scan_kernel[(triton.cdiv(p * n, BLOCK), b * h)](
        S_ext, a, e, initial, entry, exit_, K, h, p * n,
        *S_ext.stride()[:3], *a.stride(), *_strides(e, 2), *(initial.stride()[:2] if initial is not None else (0, 0)),
        *entry.stride()[:3], *exit_.stride()[:2],
        BLOCK=BLOCK, HAS_E=e is not None, HAS_INIT=initial is not None)
    return entry, exit_


def scan_segments_bwd(G, a, dfinal=None, e=None):
    """Reverse exclusive scan: the gradient arriving at every segment's exit (b, K, h, p, n) and
    the gradient of the initial state (b, h, p, n), all fp32."""
    b, K, h, p, n = G.shape
    dexit = torch.empty_like(G)
    dinit = torch.empty(b, h, p, n, device=G.device, dtype=torch.float32)
    dfinal = None if dfinal is None else dfinal.float().contiguous()
    BLOCK = _scan_block(p * n)
    _segment_scan_bwd_kernel[(triton.cdiv(p * n, BLOCK), b * h)](
        G, a, e, dfinal, dexit, dinit, K, h, p * n,
        *G.stride()[:3], *a.stride(), *_strides(e, 2), *(dfinal.stride()[:2] if dfinal is not None else (0, 0)),
        *dexit.stride()[:3], *dinit.stride()[:2],
        BLOCK=BLOCK, HAS_E=e is not None, HAS_DFINAL=dfinal is not None)
    return dexit, dinit


def _D_view(D):
    """D as (h, p) strides: (h,) broadcasts over p with a zero stride."""
    if D is None:
        return None, (0, 0)
    return D, (D.stride(0), 0 if D.dim() == 1 else D.stride(1))


def _output_fwd(x, dt, A, B, C, D, z, dt_bias, seq_idx, states, gamma, entry, k, y=None):
    """y (b, l, h, p); entry (b, nseg, h, p, n) fp32: each segment's entry state, or None for zero."""
    if y is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    D, D_strides = _D_view(D)
    grid = (k.nchunks, k.batch * k.ngroups, triton.cdiv(k.headdim, k.BP))
    _output_fwd_kernel[grid](
        x, B, C, dt, dt_bias, A, D, z, seq_idx, states, y, entry, gamma,
        k.seqlen, k.headdim, k.dstate, k.heads_per_group, k.chunks_per_seg, k.dt_min, k.dt_max,
        *x.stride(), *B.stride(), *C.stride(), *dt.stride(), *D_strides, *_strides(z, 4),
        *_strides(seq_idx, 2), *states.stride(), *y.stride(), *_strides(entry, 5), *gamma.stride(),
        k.ngroups, Q=k.Q, BP=k.BP, BN=k.BN, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_ENTRY=entry is not None, DOT_PRECISION=k.precision, num_warps=k.warps, **k.flags)
    return y


def _state_bwd(dout, z, C, dt, A, dt_bias, seq_idx, k):
    """Every segment from a zero gradient at its exit: chunk exit gradients (b, nchunks, h, p, n),
    rho (b, nchunks, h), G (b, nseg, h, p, n), the outputs' pull on each segment's entry, and
    each segment's decay a (b, nseg, h)."""
    dev = dout.device
    dstates = torch.empty(k.batch, k.nchunks, k.nheads, k.headdim, k.dstate, device=dev, dtype=k.state_dtype)
    rho = torch.empty(k.batch, k.nchunks, k.nheads, device=dev, dtype=torch.float32)
    G = torch.empty(k.batch, k.nseg, k.nheads, k.headdim, k.dstate, device=dev, dtype=torch.float32)
    a = torch.empty(k.batch, k.nseg, k.nheads, device=dev, dtype=torch.float32)
    _state_bwd_kernel[k.state_grid()](
        dout, z, C, dt, dt_bias, A, seq_idx, dstates, rho, G, a,
        k.seqlen, k.nheads, k.headdim, k.dstate, k.nchunks, k.chunks_per_seg, k.n_p_tiles, k.n_n_tiles,
        k.heads_per_group, k.dt_min, k.dt_max,
        *dout.stride(), *_strides(z, 4), *C.stride(), *dt.stride(), *_strides(seq_idx, 2),
        *dstates.stride(), *rho.stride(), *G.stride(), *a.stride(),
        Q=k.Q, BP=k.BP_state, BN=k.BN_state, HAS_Z=z is not None, DOT_PRECISION=k.precision,
        num_warps=4, **k.flags)
    return dstates, rho, G, a


def _chunk_bwd(x, dt, A, B, C, D, z, dt_bias, seq_idx, states, gamma, entry, dstates, rho, dexit, dout, k,
               dx=None, dB=None, dC=None):
    """Every gradient of the chunks, given each segment's entry state and the gradient at its
    exit (b, nseg, h, p, n) fp32 (either may be None for zero). dx, dB, dC may be views into
    one buffer (the conv backward's input)."""
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if dx is None else dx
    dB = torch.empty_like(B, memory_format=torch.contiguous_format) if dB is None else dB
    dC = torch.empty_like(C, memory_format=torch.contiguous_format) if dC is None else dC
    ddt = torch.empty(dt.shape, device=dt.device, dtype=torch.float32)
    dz = torch.empty_like(z, memory_format=torch.contiguous_format) if z is not None else None
    dA_part = torch.empty(k.batch, k.nchunks, k.nheads, device=x.device, dtype=torch.float32)
    dD_part = torch.empty(k.batch, k.nchunks, k.nheads, k.headdim, device=x.device, dtype=torch.float32) \
        if D is not None else None
    Dv, D_strides = _D_view(D)
    grid = (k.nchunks, k.batch * k.ngroups)
    _chunk_bwd_kernel[grid](
        x, B, C, dt, dt_bias, A, Dv, z, seq_idx, states, dstates, entry, gamma, dexit, rho,
        dout, dx, dB, dC, ddt, dz, dA_part, dD_part,
        k.seqlen, k.headdim, k.dstate, k.heads_per_group, k.ngroups, k.nheads, k.chunks_per_seg,
        k.dt_min, k.dt_max,
        *x.stride(), *B.stride(), *C.stride(), *dt.stride(), *D_strides, *_strides(z, 4),
        *_strides(seq_idx, 2), *states.stride(), *dstates.stride(),
        *_strides(entry, 5), *gamma.stride(), *_strides(dexit, 5), *rho.stride(), *dout.stride(),
        *dx.stride(), *dB.stride(), *dC.stride(), *ddt.stride(), *_strides(dz, 4),
        *dA_part.stride(), *_strides(dD_part, 4),
        Q=k.Q, BP=k.BP, BN=k.BN, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_ENTRY=entry is not None, HAS_EXIT=dexit is not None,
        DOT_PRECISION=k.precision, num_warps=k.warps, num_stages=1, **k.flags)  # pipelining overflows smem
    dA = dA_part.sum(dim=(0, 1))                                                    # (h,)
    dD = None
    if D is not None:
        dD = dD_part.sum(dim=(0, 1))                                                # (h, p)
        dD = dD.sum(-1) if D.dim() == 1 else dD
    return dx, dB, dC, ddt, dz, dA, dD


class Summary:
    """A sequence's (or CP shard's) state pass from a zero entry: what its outputs need besides
    the entry state. Its affine summary S_out = a * S_entry + S_ext (fp32) is `affine()`."""

    def __init__(self, x, dt, A, B, dt_bias, seq_idx, k):
        self.states, self.gamma, self.seg_a, self.seg_ext = _state_fwd(x, dt, A, B, dt_bias, seq_idx, k)
        self.k = k

    def affine(self):
        """(S_ext (b, h, p, n), a (b, h)): the internal segments composed."""
        if self.k.nseg == 1:
            return self.seg_ext[:, 0], self.seg_a[:, 0]
        return scan_segments(self.seg_ext, self.seg_a)[1], self.seg_a.prod(dim=1)

    def segment_entries(self, entry, need_exit=False):
        """Each internal segment's entry state (b, nseg, h, p, n), given the sequence's entry
        (or None for zero), and with need_exit the sequence's exit state (b, h, p, n)."""
        if self.k.nseg == 1:
            seg_entry = None if entry is None else entry[:, None]
            if not need_exit:
                return seg_entry, None
            S_ext, a = self.affine()
            return seg_entry, (S_ext if entry is None else S_ext + a[:, :, None, None] * entry)
        return scan_segments(self.seg_ext, self.seg_a, entry)  # later segments start where earlier end


def ssd_output(x, dt, A, B, C, D, z, dt_bias, seq_idx, summary, entry=None, y=None, need_exit=False):
    """The outputs of a summarised sequence entered with state `entry` (b, h, p, n) or zero;
    with need_exit also its exit state (else None)."""
    seg_entry, exit_ = summary.segment_entries(entry, need_exit)
    y = _output_fwd(x, dt, A, B, C, D, z, dt_bias, seq_idx, summary.states, summary.gamma, seg_entry,
                    summary.k, y)
    return y, exit_


class GradPass:
    """A sequence's reverse state pass from a zero gradient at its exit: the chunks' exit
    gradients, and G (b, h, p, n), the pull of its outputs on its entry state. G is known
    before the gradient at the exit is (it is what a CP rank all-gathers in backward)."""

    def __init__(self, dy, z, C, dt, A, dt_bias, seq_idx, k):
        self.dstates, self.rho, self.seg_G, self.seg_a = _state_bwd(dy, z, C, dt, A, dt_bias, seq_idx, k)
        self.k = k
        self.a = self.seg_a.prod(dim=1)                                             # (b, h)
        self.G = self.seg_G[:, 0] if k.nseg == 1 else scan_segments_bwd(self.seg_G, self.seg_a)[1]

    def segment_exits(self, dexit):
        """The gradient arriving at each internal segment's exit, given the sequence's."""
        if self.k.nseg == 1:
            return None if dexit is None else dexit[:, None]
        return scan_segments_bwd(self.seg_G, self.seg_a, dexit)[0]


def ssd_grads(x, dt, A, B, C, D, z, dt_bias, seq_idx, summary, grad_pass, dy, entry=None, dexit=None,
              dx=None, dB=None, dC=None):
    """Every gradient of a sequence entered with state `entry` whose exit receives gradient
    `dexit` (either (b, h, p, n) or None). dx, dB, dC may be given as output views.
    Returns (dx, dB, dC, ddt (fp32, w.r.t. raw dt), dz, dA, dD, d entry)."""
    grads = _chunk_bwd(x, dt, A, B, C, D, z, dt_bias, seq_idx, summary.states, summary.gamma,
                       summary.segment_entries(entry)[0], grad_pass.dstates, grad_pass.rho,
                       grad_pass.segment_exits(dexit), dy, summary.k, dx, dB, dC)
    dentry = grad_pass.G if dexit is None else grad_pass.G + grad_pass.a[:, :, None, None] * dexit
    return (*grads, dentry)


class _ChunkScanFn(torch.autograd.Function):
    """Single device: the whole sequence is one CP shard whose entry state is initial_states.
    Backward recomputes the chunk states (they are as large as x, so they are not kept).
    Parameter gradients are per-chunk partials summed in fixed order: two identical calls give
    bitwise identical results."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
                need_final):
        k = _Launch(x, B, min(chunk_size, MAX_CHUNK_FWD), dt_bias, dt_softplus, dt_limit, D, z, seq_idx)
        entry = None if initial_states is None else initial_states.float()
        summary = Summary(x, dt, A, B, dt_bias, seq_idx, k)
        y, final = ssd_output(x, dt, A, B, C, D, z, dt_bias, seq_idx, summary, entry, need_exit=need_final)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
        ctx.args = (chunk_size, dt_softplus, dt_limit)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = ctx.saved_tensors
        chunk_size, dt_softplus, dt_limit = ctx.args
        k = _Launch(x, B, min(chunk_size, MAX_CHUNK_BWD), dt_bias, dt_softplus, dt_limit, D, z, seq_idx)
        entry = None if initial_states is None else initial_states.float()
        grad_pass = GradPass(dy, z, C, dt, A, dt_bias, seq_idx, k)
        summary = Summary(x, dt, A, B, dt_bias, seq_idx, k)
        dx, dB, dC, ddt, dz, dA, dD, dinit = ssd_grads(x, dt, A, B, C, D, z, dt_bias, seq_idx, summary,
                                                       grad_pass, dy, entry, dfinal)
        ddt_bias = ddt.sum(dim=(0, 1)).to(dt_bias.dtype) if dt_bias is not None else None
        return (dx, ddt.to(dt.dtype), dA.to(A.dtype), dB, dC, None, None if dD is None else dD.to(D.dtype),
                dz, ddt_bias, None if initial_states is None else dinit.to(initial_states.dtype),
                None, None, None, None)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False):
    """Single-device chunked SSD, a drop-in for mamba_ssm's function of the same name.

    x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n); D (h,) or (h, p); z like x;
    dt_bias (h,); initial_states (b, h, p, n); seq_idx (b, l) integer document ids.
    Returns y like x, and with return_final_states also the fp32 final state (b, h, p, n).
    """
    _expect(cu_seqlens is None, "cu_seqlens", "a tensor", "None (pack documents with seq_idx instead)")
    _expect(not return_varlen_states, "return_varlen_states", return_varlen_states, "False (not supported)")
    _check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit)
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    y, final = _ChunkScanFn.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                  dt_softplus, tuple(dt_limit), return_final_states)
    return (y, final) if return_final_states else y
