"""Depthwise causal conv1d + bias + SiLU with a halo, forward and backward (DESIGN.md section 4).

    out[b, t, c] = silu(bias[c] + sum_{k<d} weight[c, k] * u[b, t - (d-1) + k, c])

u is the shard's pre-conv xBC, preceded by the halo: the last d-1 pre-conv tokens of the
previous segment, received from their owner (zeros for the first segment). With seq_idx a tap
whose token belongs to another document than token t contributes 0, in the halo too.

Backward. g = dout * silu'(pre), with the pre-activation recomputed (it is as large as xBC, so
it is not kept). With m_j(s) = 1 when s and s+j are in one document (the forward's tap mask):
    du[s, c]        = sum_j weight[c, d-1-j] * m_j(s) g[s+j, c]
    dweight[c, d-1-j] = sum_s u[s, c] * m_j(s) g[s+j, c]          dbias[c] = sum_t g[t, c]
so one pass over rows s of [halo, xBC] gives all three; du at s < 0 is the halo's gradient,
which the caller sends back to the halo's owner. A tile needs g at d-1 rows past its end, and a
register tile cannot be shifted by rows: each program computes g for its tile and the d-1
rows after it once, parks them in its own scratch slot (fp32, reused tile after tile, so it
stays in L2) and reads them back shifted. No atomics: dweight and dbias are per-(batch,
token-group) partial sums, summed by torch in a fixed order.

Offsets that multiply a batch, token or channel index by a stride are int64: sequences reach
2^20 tokens x 8k channels, and xBC may come in any layout.
"""

import os

import mamba_cp  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU, before triton loads)
import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (tokens, channels) per program. The interpreter pays per program, so it gets bigger tiles.
_GPU_BLOCKS = (32, 128)
_INTERP_BLOCKS = (128, 64)
_NUM_WARPS = 4
# Backward: about as many programs as a GPU keeps resident. Longer sequences fold several token
# blocks into one program, which bounds the dweight/dbias partials and keeps the scratch slots
# (one (BT + d-1) x BC fp32 tile per program, 18 MiB in all) in L2.
_BWD_PROGRAMS = 1024


# ---------------------------------------------------------------------------------------------
# 1. Shared pieces: document ids, one tap tile, the pre-activation and its gradient
# ---------------------------------------------------------------------------------------------


@triton.jit
def _doc(s_row0, stride_s_l, hs_row0, stride_hs_l, r0, seqlen,
         R: tl.constexpr, HALO: tl.constexpr, HAS_HALO_SEQ: tl.constexpr):
    """Document id (R,) of token rows r0 + [0, R); -1 where there is none (those rows hold zeros)."""
    rows = r0 + tl.arange(0, R)
    r = rows.to(tl.int64)
    doc = tl.load(s_row0 + r * stride_s_l, mask=(rows >= 0) & (rows < seqlen), other=-1)
    if HAS_HALO_SEQ:
        in_h = (rows < 0) & (rows >= -HALO)
        doc = tl.where(in_h, tl.load(hs_row0 + (r + HALO) * stride_hs_l, mask=in_h, other=-1), doc)
    return doc


@triton.jit
def _tap(x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l, r0, keep, mask_c, seqlen,
         R: tl.constexpr, HALO: tl.constexpr, HAS_HALO: tl.constexpr):
    """u at token rows r0 + [0, R) as an (R, BC) fp32 tile, zero where keep (R,) is false and
    outside [-HALO, seqlen). Rows < 0 come from the halo."""
    rows = r0 + tl.arange(0, R)
    r = rows.to(tl.int64)
    in_x = keep & (rows >= 0) & (rows < seqlen)
    u = tl.load(x_row0 + r[:, None] * stride_x_l + x_col[None, :],
                mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    if HAS_HALO:   # a second masked load, not a branch: a branch would split the taps' loads apart
        in_h = keep & (rows < 0) & (rows >= -HALO)
        u += tl.load(h_row0 + (r + HALO)[:, None] * stride_h_l + h_col[None, :],
                     mask=in_h[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    return u


@triton.jit
def _preact(x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l, w_col, stride_w_k, bias,
            s_row0, stride_s_l, hs_row0, stride_hs_l, r0, mask_c, seqlen,
            R: tl.constexpr, BC: tl.constexpr, D: tl.constexpr,
            HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr):
    """Pre-activation (R, BC) fp32 of output rows r0 + [0, R): bias + sum_k w_k u[row-(D-1)+k],
    a tap from another document dropped (it is masked out of the load)."""
    acc = tl.zeros((R, BC), dtype=tl.float32) + bias[None, :]
    rows = r0 + tl.arange(0, R)
    if HAS_SEQ:
        doc_t = _doc(s_row0, stride_s_l, hs_row0, stride_hs_l, r0, seqlen, R, D - 1, HAS_HALO_SEQ)
    for k in tl.static_range(D):
        src0 = r0 - (D - 1) + k
        if HAS_SEQ:
            keep = _doc(s_row0, stride_s_l, hs_row0, stride_hs_l, src0, seqlen, R, D - 1, HAS_HALO_SEQ) == doc_t
        else:
            keep = rows < seqlen          # an output past the end needs no input
        u = _tap(x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l, src0, keep, mask_c, seqlen,
                 R, D - 1, HAS_HALO)
        w = tl.load(w_col + k * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)   # (BC,)
        acc += w[None, :] * u
    return acc


@triton.jit
def _dpre(do_row0, do_col, stride_do_l,
          x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l, w_col, stride_w_k, bias,
          s_row0, stride_s_l, hs_row0, stride_hs_l, r0, mask_c, seqlen,
          R: tl.constexpr, BC: tl.constexpr, D: tl.constexpr,
          HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr):
    """g = dL/dpre (R, BC) fp32 at output rows r0 + [0, R): dout * silu'(pre); 0 off [0, seqlen)."""
    p = _preact(x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l, w_col, stride_w_k, bias,
                s_row0, stride_s_l, hs_row0, stride_hs_l, r0, mask_c, seqlen,
                R, BC, D, HAS_HALO, HAS_SEQ, HAS_HALO_SEQ)
    rows = r0 + tl.arange(0, R)
    valid = (rows >= 0) & (rows < seqlen)
    do = tl.load(do_row0 + rows.to(tl.int64)[:, None] * stride_do_l + do_col[None, :],
                 mask=valid[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    sig = tl.sigmoid(p)
    return do * sig * (1.0 + p * (1.0 - sig))      # silu'(p) = sig(p) (1 + p (1 - sig(p)))


# ---------------------------------------------------------------------------------------------
# 2. Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _conv_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, halo_ptr, seq_ptr, hseq_ptr, out_ptr,
    seqlen, dim,
    stride_x_b, stride_x_l, stride_x_c,
    stride_w_c, stride_w_k, stride_bias,
    stride_h_b, stride_h_l, stride_h_c,
    stride_s_b, stride_s_l,
    stride_hs_b, stride_hs_l,
    stride_o_b, stride_o_l, stride_o_c,
    D: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr,
):
    """One (BT tokens, BC channels) tile of one batch row: out = silu(pre-activation)."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    t0 = pid_t * BT
    rows = t0 + tl.arange(0, BT)                                                # (BT,)
    offs_c = (pid_c * BC + tl.arange(0, BC)).to(tl.int64)                       # (BC,)
    mask_c = offs_c < dim
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c * stride_bias, mask=mask_c, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BC,), dtype=tl.float32)

    p = _preact(x_ptr + bb * stride_x_b, offs_c * stride_x_c, stride_x_l,
                halo_ptr + bb * stride_h_b, offs_c * stride_h_c, stride_h_l,
                w_ptr + offs_c * stride_w_c, stride_w_k, bias,
                seq_ptr + bb * stride_s_b, stride_s_l, hseq_ptr + bb * stride_hs_b, stride_hs_l,
                t0, mask_c, seqlen, BT, BC, D, HAS_HALO, HAS_SEQ, HAS_HALO_SEQ)  # (BT, BC)
    out = p * tl.sigmoid(p)
    tl.store(out_ptr + bb * stride_o_b + rows.to(tl.int64)[:, None] * stride_o_l + offs_c[None, :] * stride_o_c,
             out.to(out_ptr.dtype.element_ty), mask=(rows < seqlen)[:, None] & mask_c[None, :])


@triton.jit
def _conv_bwd_kernel(
    dout_ptr, x_ptr, w_ptr, bias_ptr, halo_ptr, seq_ptr, hseq_ptr,
    dx_ptr, dhalo_ptr, dw_part_ptr, db_part_ptr, scratch_ptr,
    seqlen, dim, n_inner,
    stride_do_b, stride_do_l, stride_do_c,
    stride_x_b, stride_x_l, stride_x_c,
    stride_w_c, stride_w_k, stride_bias,
    stride_h_b, stride_h_l, stride_h_c,
    stride_s_b, stride_s_l,
    stride_hs_b, stride_hs_l,
    stride_dx_b, stride_dx_l, stride_dx_c,
    stride_dh_b, stride_dh_l, stride_dh_c,
    stride_dw_b, stride_dw_g, stride_dw_k, stride_dw_c,
    stride_db_b, stride_db_g, stride_db_c,
    D: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HB: tl.constexpr, DP: tl.constexpr,
    SHIFT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr,
    NEED_DHALO: tl.constexpr,
):
    """n_inner consecutive (BT, BC) tiles of rows s of [halo, xBC] (starting at s = -SHIFT; SHIFT
    is D-1 with a halo) in one batch row: du per tile (into dx, or dhalo for s < 0), and
    dweight, dbias summed over the tiles into this program's own partial slot."""
    pid_g = tl.program_id(0)
    pid_c = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    offs_c = (pid_c * BC + tl.arange(0, BC)).to(tl.int64)                       # (BC,)
    mask_c = offs_c < dim
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c * stride_bias, mask=mask_c, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BC,), dtype=tl.float32)

    do_row0 = dout_ptr + bb * stride_do_b
    do_col = offs_c * stride_do_c
    x_row0 = x_ptr + bb * stride_x_b
    x_col = offs_c * stride_x_c
    h_row0 = halo_ptr + bb * stride_h_b
    h_col = offs_c * stride_h_c
    w_col = w_ptr + offs_c * stride_w_c
    s_row0 = seq_ptr + bb * stride_s_b
    hs_row0 = hseq_ptr + bb * stride_hs_b

    # this program's scratch slot: g of its tile (rows 0..BT-1) and of the HB rows after it
    prog = (bb * tl.num_programs(0) + pid_g) * tl.num_programs(1) + pid_c
    slot = scratch_ptr + prog * ((BT + HB) * BC)
    sl_r = tl.arange(0, BT)
    sl_c = tl.arange(0, BC)

    kk = tl.arange(0, DP)                                                       # tap index, padded
    dw_acc = tl.zeros((DP, BC), dtype=tl.float32)
    db_acc = tl.zeros((BC,), dtype=tl.float32)
    for i in range(n_inner):
        s0 = (pid_g * n_inner + i) * BT - SHIFT
        g = _dpre(do_row0, do_col, stride_do_l, x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l,
                  w_col, stride_w_k, bias, s_row0, stride_s_l, hs_row0, stride_hs_l, s0, mask_c, seqlen,
                  BT, BC, D, HAS_HALO, HAS_SEQ, HAS_HALO_SEQ)                   # (BT, BC)
        g_next = _dpre(do_row0, do_col, stride_do_l, x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l,
                       w_col, stride_w_k, bias, s_row0, stride_s_l, hs_row0, stride_hs_l, s0 + BT, mask_c,
                       seqlen, HB, BC, D, HAS_HALO, HAS_SEQ, HAS_HALO_SEQ)      # (HB, BC): outputs past the tile
        db_acc += tl.sum(g, axis=0)
        tl.debug_barrier()       # every thread is done reading the previous tile's g
        tl.store(slot + sl_r[:, None] * BC + sl_c[None, :], g)
        tl.store(slot + (BT + tl.arange(0, HB))[:, None] * BC + sl_c[None, :], g_next)
        tl.debug_barrier()       # ... and this tile's g is visible to all of them

        if HAS_SEQ:
            doc_s = _doc(s_row0, stride_s_l, hs_row0, stride_hs_l, s0, seqlen, BT, D - 1, HAS_HALO_SEQ)
        u = _tap(x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l, s0, sl_r < BT, mask_c, seqlen,
                 BT, D - 1, HAS_HALO)                                           # (BT, BC)
        w = tl.load(w_col + (D - 1) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
        du = w[None, :] * g                                                     # j = 0: the row itself
        dw_acc += tl.where(kk[:, None] == D - 1, tl.sum(u * g, axis=0)[None, :], 0.0)
        for j in tl.static_range(1, D):
            gj = tl.load(slot + (sl_r + j)[:, None] * BC + sl_c[None, :])       # g[s + j]
            if HAS_SEQ:   # mirrors the forward: output s+j reads row s only within one document
                same = _doc(s_row0, stride_s_l, hs_row0, stride_hs_l, s0 + j, seqlen, BT, D - 1, HAS_HALO_SEQ) == doc_s
                gj = tl.where(same[:, None], gj, 0.0)
            w = tl.load(w_col + (D - 1 - j) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
            du += w[None, :] * gj
            dw_acc += tl.where(kk[:, None] == D - 1 - j, tl.sum(u * gj, axis=0)[None, :], 0.0)

        rows = s0 + sl_r
        r64 = rows.to(tl.int64)
        tl.store(dx_ptr + bb * stride_dx_b + r64[:, None] * stride_dx_l + offs_c[None, :] * stride_dx_c,
                 du.to(dx_ptr.dtype.element_ty), mask=((rows >= 0) & (rows < seqlen))[:, None] & mask_c[None, :])
        if NEED_DHALO:
            if s0 < 0:
                tl.store(dhalo_ptr + bb * stride_dh_b + (r64 + (D - 1))[:, None] * stride_dh_l
                         + offs_c[None, :] * stride_dh_c, du, mask=(rows < 0)[:, None] & mask_c[None, :])

    part = bb * stride_dw_b + pid_g.to(tl.int64) * stride_dw_g
    tl.store(dw_part_ptr + part + kk.to(tl.int64)[:, None] * stride_dw_k + offs_c[None, :] * stride_dw_c,
             dw_acc, mask=(kk < D)[:, None] & mask_c[None, :])
    if HAS_BIAS:
        tl.store(db_part_ptr + bb * stride_db_b + pid_g.to(tl.int64) * stride_db_g + offs_c * stride_db_c,
                 db_acc, mask=mask_c)


# ---------------------------------------------------------------------------------------------
# 3. Input checks and the wrappers
# ---------------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _expect(cond, name, seen, expected):
    if not cond:
        raise ValueError(f"{name}: got {seen}, expected {expected}")


def _check(t, name, shape, ref, dtypes, allow_none=True):
    """Shape (None entries are free), device of `ref`, dtype one of `dtypes`."""
    if t is None:
        _expect(allow_none, name, "None", "a tensor")
        return
    want = tuple("*" if s is None else s for s in shape)
    _expect(isinstance(t, torch.Tensor), name, type(t).__name__, "a torch.Tensor")
    _expect(t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape)),
            name, f"shape {tuple(t.shape)}", f"shape {want}")
    _expect(t.device == ref.device, name, f"device {t.device}", f"device {ref.device} (like xBC)")
    _expect(t.dtype in dtypes, name, f"dtype {t.dtype}", f"one of {[str(d) for d in dtypes]}")


def _check_inputs(xBC, weight, bias, halo, seq_idx, halo_seq):
    _expect(isinstance(xBC, torch.Tensor) and xBC.dim() == 3, "xBC",
            tuple(xBC.shape) if isinstance(xBC, torch.Tensor) else type(xBC).__name__,
            "a 3-dim tensor (batch, seqlen, dim)")
    _check(xBC, "xBC", (None, None, None), xBC, _FLOATS)
    b, l, dim = xBC.shape
    _expect(l >= 1 and dim >= 1 and b >= 1, "xBC", f"shape {tuple(xBC.shape)}", "no empty dimension")
    _check(weight, "weight", (dim, None), xBC, _FLOATS, allow_none=False)
    d = weight.shape[1]
    _expect(2 <= d <= 8, "weight", f"d_conv {d}", "2 <= d_conv <= 8")
    _check(bias, "bias", (dim,), xBC, _FLOATS)
    _check(halo, "halo", (b, d - 1, dim), xBC, _FLOATS)
    _check(seq_idx, "seq_idx", (b, l), xBC, _INTS)
    _check(halo_seq, "halo_seq", (b, d - 1), xBC, _INTS)
    _expect(halo_seq is None or seq_idx is not None, "halo_seq", "a tensor with seq_idx=None",
            "None when seq_idx is None")
    _expect(halo is None or seq_idx is None or halo_seq is not None, "halo_seq", "None",
            "the halo's document ids (b, d_conv-1) when both halo and seq_idx are given")
    return b, l, dim, d


def _blocks(l, dim):
    BT, BC = _INTERP_BLOCKS if INTERPRET else _GPU_BLOCKS
    return min(BT, max(16, triton.next_power_of_2(l))), min(BC, max(16, triton.next_power_of_2(dim)))


def _strides(t, ndim):
    """Strides of an optional tensor (zeros when absent), so one kernel serves every option."""
    return tuple(t.stride()) if t is not None else (0,) * ndim


def _or(t, placeholder):
    """A placeholder for an absent tensor: the kernels form its pointers but never dereference them."""
    return placeholder if t is None else t


def _flags(bias, halo, seq_idx):
    has_seq = seq_idx is not None
    return dict(HAS_BIAS=bias is not None, HAS_HALO=halo is not None, HAS_SEQ=has_seq,
                HAS_HALO_SEQ=has_seq and halo is not None)   # without a halo its ids don't matter


def conv1d_fwd(xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None):
    """silu(causal depthwise conv(xBC) + bias), (b, l, dim) contiguous in xBC's dtype.

    xBC (b, l, dim) any strides; weight (dim, d_conv); bias (dim,); halo (b, d_conv-1, dim): the
    d_conv-1 pre-conv tokens before the shard, None for zeros; seq_idx (b, l) and halo_seq
    (b, d_conv-1) integer document ids (halo_seq needed when both halo and seq_idx are given).
    """
    b, l, dim, d = _check_inputs(xBC, weight, bias, halo, seq_idx, halo_seq)
    flags = _flags(bias, halo, seq_idx)
    halo_seq = halo_seq.to(seq_idx.dtype) if flags["HAS_HALO_SEQ"] else None   # one id type in the kernel
    out = torch.empty((b, l, dim), device=xBC.device, dtype=xBC.dtype)
    BT, BC = _blocks(l, dim)
    grid = (triton.cdiv(l, BT), triton.cdiv(dim, BC), b)
    _conv_fwd_kernel[grid](
        xBC, weight, _or(bias, xBC), _or(halo, xBC), _or(seq_idx, xBC), _or(halo_seq, xBC), out, l, dim,
        *xBC.stride(), *weight.stride(), *_strides(bias, 1), *_strides(halo, 3),
        *_strides(seq_idx, 2), *_strides(halo_seq, 2), *out.stride(),
        D=d, BT=BT, BC=BC, num_warps=_NUM_WARPS, **flags)
    return out


def conv1d_bwd(dout, xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, need_dhalo=True):
    """Gradients of conv1d_fwd: (dxBC, dhalo, dweight, dbias).

    dxBC (b, l, dim) in xBC's dtype; dhalo (b, d_conv-1, dim) fp32, None without a halo or with
    need_dhalo=False; dweight (dim, d_conv) fp32; dbias (dim,) fp32, None without bias.
    Deterministic: no atomics, partial sums are reduced by torch in a fixed order.
    """
    b, l, dim, d = _check_inputs(xBC, weight, bias, halo, seq_idx, halo_seq)
    _check(dout, "dout", (b, l, dim), xBC, _FLOATS, allow_none=False)
    flags = _flags(bias, halo, seq_idx)
    halo_seq = halo_seq.to(seq_idx.dtype) if flags["HAS_HALO_SEQ"] else None   # one id type in the kernel
    need_dhalo = bool(need_dhalo) and halo is not None
    shift = d - 1 if halo is not None else 0    # tiles start at the halo: its rows feed dweight
    BT, BC = _blocks(shift + l, dim)
    HB = max(2, triton.next_power_of_2(d - 1))  # rows of g past a tile that the tile needs
    n_tb, n_cb = triton.cdiv(shift + l, BT), triton.cdiv(dim, BC)
    n_inner = min(n_tb, max(1, triton.cdiv(n_tb * n_cb * b, _BWD_PROGRAMS)))   # token blocks per program
    n_groups = triton.cdiv(n_tb, n_inner)

    dx = torch.empty((b, l, dim), device=xBC.device, dtype=xBC.dtype)
    dhalo = torch.empty((b, d - 1, dim), device=xBC.device, dtype=torch.float32) if need_dhalo else None
    dw_part = torch.empty((b, n_groups, d, dim), device=xBC.device, dtype=torch.float32)
    db_part = torch.empty((b, n_groups, dim), device=xBC.device, dtype=torch.float32) \
        if bias is not None else None
    scratch = torch.empty((b, n_groups, n_cb, BT + HB, BC), device=xBC.device, dtype=torch.float32)
    grid = (n_groups, n_cb, b)
    _conv_bwd_kernel[grid](
        dout, xBC, weight, _or(bias, xBC), _or(halo, xBC), _or(seq_idx, xBC), _or(halo_seq, xBC),
        dx, _or(dhalo, dw_part), dw_part, _or(db_part, dw_part), scratch,
        l, dim, n_inner,
        *dout.stride(), *xBC.stride(), *weight.stride(), *_strides(bias, 1), *_strides(halo, 3),
        *_strides(seq_idx, 2), *_strides(halo_seq, 2), *dx.stride(), *_strides(dhalo, 3),
        *dw_part.stride(), *_strides(db_part, 3),
        D=d, BT=BT, BC=BC, HB=HB, DP=triton.next_power_of_2(d), SHIFT=shift,
        NEED_DHALO=need_dhalo, num_warps=_NUM_WARPS, **flags)
    dweight = dw_part.sum(dim=(0, 1)).t().contiguous()                          # (dim, d)
    dbias = db_part.sum(dim=(0, 1)) if bias is not None else None               # (dim,)
    return dx, dhalo, dweight, dbias
