"""mamba_cp: state-passing context parallelism for Mamba2's SSD, in one readable module.

The SSD recurrence, per batch row and head (README walkthrough a):

    dt'_t = clamp(softplus(dt_t + dt_bias), *dt_limit)   a_t = exp(dt'_t * A)
    S_t   = a_t * S_{t-1} + dt'_t * x_t B_t^T            y_t = S_t C_t + D * x_t   (then * silu(z_t))

Chunked form (README walkthrough b). Cut the sequence into chunks of Q tokens; cs_i is the cumulative
sum of dt'*A inside a chunk. A chunk entered with state S_in produces

    y_i   = sum_{j<=i} (C_i . B_j) exp(cs_i - cs_j) dt'_j x_j   +   exp(cs_i) S_in C_i
    S_out = exp(cs_last) S_in  +  sum_j exp(cs_last - cs_j) dt'_j x_j B_j^T

so a chunk (and, the same way, a whole shard of the sequence) maps its entry state to its exit
state affinely: S_out = a * S_in + S_ext. That is what makes context parallelism cheap: each
rank summarises its shard as (S_ext, a), the summaries are exchanged (all-gathered, or by a
prefix scan over the ranks in log2 W rounds), and an exclusive scan over them gives every rank
its true entry state (README walkthrough c, d).

The same method in about fifty lines of plain torch, W ranks simulated in one process, is
reference_ssd.state_passing_reference: the shortest way to see it.

The file has two parts. Part I is the method, in the order it runs, and is complete on its own:
a reader can stop at its end. Part II holds what production adds; each of its sections depends
on Part I only, never the reverse (a test holds both parts to this, and this list to the section
headers below):

  Part I, the method
   1. Shared kernel pieces: dt processing and the decays of one chunk
   2. The launch plan
   3. The forward: state pass (both ways), segment scan, outputs; Summary
   4. The backward: GradPass (the state pass reversed), chunk gradients
   5. Layouts
   6. The exchange: summaries, their gradients and the conv halo, by all-gather
   7. The causal conv1d
   8. The fused Conv1d + SSD with state-passing CP
   9. A worked example
  Part II, the production extras
  10. The prefix-scan exchange and the model that chooses
  11. Input checks and the ranks' agreement
  12. The permute layouts
  13. The compile layer and the public CP function: mamba_conv1d_ssd_cp
  14. The gate and the gated RMSNorm
  15. The single-device function: mamba_chunk_scan_combined, and the packed documents' states
  16. The mixer entry: mamba_split_conv1d_scan_combined
  17. The all-to-all baseline

Numerics. Decays are exponentials of sums of dt'*A. A difference of two large cumulative sums
loses the small difference between them in float32 (exp(cs_i - cs_j) where both are near
-1000), so cumulative sums are formed in float64 and split into a float32 (hi, lo) pair: the
difference of the hi parts is exact wherever it matters (Sterbenz), and the lo parts carry what
float32 rounded away. Exponents may have either sign (growth when A > 0; the clamp, always
applied as in mamba_ssm's kernels, keeps dt' >= 0 even at the default dt_limit): masked
ones are removed by selection before exp, never multiplied by 0, so no inf * 0 appears.

On a machine without a GPU the same kernels run in the Triton interpreter
(TRITON_INTERPRET=1 is set below when CUDA is absent), so the code can be stepped through.
Under torch.compile the forward and backward of each autograd function, and every collective,
are opaque custom ops (mamba_cp::...): section 13 says why.
"""

import collections
import dataclasses
import os
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

if not torch.cuda.is_available():  # must precede the triton import: the interpreter is chosen then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# =============================================================================================
# PART I. THE METHOD
# Sections 1 to 9: what a newcomer reads. Nothing here uses a name from Part II.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# 1. Shared kernel pieces: dt processing and the decays of one chunk
# ---------------------------------------------------------------------------------------------


# What the kernels are given. A caller's tensor comes with its strides as one named tuple
# (Triton kernels take tuples and specialise their fields as they do scalars: a unit stride
# still vectorises). The buffers the module allocates itself are contiguous, and the kernels
# compute their offsets from the sizes (_state_tile, _row_head).

# Strides by name: x, y and their gradients (batch, token, head, headdim); B, C and theirs
# (batch, token, group, dstate); dt (batch, token, head); seq_idx (batch, token); D (head,
# headdim; a (nheads,) D broadcasts over headdim with p = 0); the conv's xBC, halo and their
# gradients (batch, token, channel); the conv weight (channel, tap).
_BLHP = collections.namedtuple("_BLHP", "b l h p")
_BLGN = collections.namedtuple("_BLGN", "b l g n")
_BLH = collections.namedtuple("_BLH", "b l h")
_BL = collections.namedtuple("_BL", "b l")
_HP = collections.namedtuple("_HP", "h p")
_BLC = collections.namedtuple("_BLC", "b l c")
_CK = collections.namedtuple("_CK", "c k")


def _strides_of(t, record):
    """t's strides as `record`; zeros for an absent tensor, which the kernels never read."""
    return record(*((0,) * len(record._fields) if t is None else t.stride()))


class _ChunkEdge(NamedTuple):
    """The buffers that give every chunk's true entry state (or exit gradient), chunk c of
    segment s being  stored(c) + decay(c) * segment(s)  (README walkthrough c, e): what a state
    pass stored from a zero segment entry (exit), (b, nchunks, h, p, n); the decay from the
    segment's entry to c's (from c's exit to the segment's), (b, nchunks, h) fp32; and the
    segments' entry states (exit gradients), (b, nseg, h, p, n) fp32, or a stand-in where zero."""
    stored: Tensor
    decay: Tensor
    segment: Tensor


@triton.jit
def _tile_ptrs(ptr, stride, b64, t64, i, offs):
    """Pointers to a (rows, channels) tile of a (batch, length, heads or groups, channels) tensor:
    batch b64, token rows t64 (R,) int64, head or group i, channels offs (C,); stride its record."""
    return ptr + b64 * stride[0] + t64[:, None] * stride[1] + i * stride[2] + offs[None, :] * stride[3]


@triton.jit
def _load_tile(ptr, stride, b64, t64, i, offs, mask):
    """The (rows, channels) tile at _tile_ptrs, zeros where masked off."""
    return tl.load(_tile_ptrs(ptr, stride, b64, t64, i, offs), mask=mask, other=0.0)


@triton.jit
def _state_tile(row, h, offs_p, offs_n, nheads, headdim, dstate):
    """int64 offsets of head h's (p, n) tile in a contiguous (rows, nheads, headdim, dstate)
    buffer: row = b * nchunks + c for chunk states, b * nseg + s for segment states."""
    return ((row.to(tl.int64) * nheads + h) * headdim + offs_p[:, None]) * dstate + offs_n[None, :]


@triton.jit
def _row_head(row, h, nheads):
    """int64 offset of (row, head) in a contiguous (rows, nheads) buffer: gamma, rho, a, partials."""
    return row.to(tl.int64) * nheads + h


@triton.jit
def _chunk_rows(b, c, seqlen, chunks_per_seg, Q: tl.constexpr):
    """Chunk c of batch row b as a row of the chunk buffers (b * nchunks + c) and of the
    segment buffers (b * nseg + the segment holding c)."""
    nchunks = tl.cdiv(seqlen, Q)
    b64 = b.to(tl.int64)
    return b64 * nchunks + c, b64 * tl.cdiv(nchunks, chunks_per_seg) + c // chunks_per_seg


@triton.jit
def _softplus(v):
    # log(1 + exp(v)) without losing exp(v) when it is tiny, linear above 20 like torch
    u = tl.exp(-tl.abs(v))
    log1p_u = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)


@triton.jit
def _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen, stride_dt, Q: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
              DT_SOFTPLUS: tl.constexpr, dt_min, dt_max):
    """dt', dt'*A and d dt'/d dt_raw (the softplus slope, zero where dt_limit clamps) of one
    chunk of one head, (Q,) float32 each; zero past the sequence end. Kernels that do not use
    the slope do not pay for it (dead code is removed)."""
    t = start + tl.arange(0, Q)
    valid = t < seqlen
    dt = tl.load(dt_ptr + b.to(tl.int64) * stride_dt.b + t.to(tl.int64) * stride_dt.l + h * stride_dt.h,
                 mask=valid, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    slope = tl.full((Q,), 1.0, tl.float32)
    if DT_SOFTPLUS:
        slope = tl.where(dt > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-dt)))
        dt = _softplus(dt)
    # always clamped, as mamba_ssm's kernels do: the default (0, inf) turns a negative dt' into 0
    slope = tl.where((dt >= dt_min) & (dt <= dt_max), slope, 0.0)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(valid, dt, 0.0)
    return dt, dt * tl.load(A_ptr + h).to(tl.float32), tl.where(valid, slope, 0.0)


@triton.jit
def _cumsum_hi_lo(dA):
    """Inclusive cumsum of (Q,) dt'*A as a float32 pair hi + lo, exact to float64 rounding."""
    cs = tl.cumsum(dA.to(tl.float64), axis=0)
    hi = cs.to(tl.float32)
    lo = (cs - hi.to(tl.float64)).to(tl.float32)
    return hi, lo


@triton.jit
def _pair_decay(hi, lo, mask):
    """(Q, Q) exp(cs_i - cs_j) where mask (i >= j and same document), else 0. The masked pairs
    are removed by selection before exp, so their exponent (of either sign, and infinite for
    pairs far apart under growth) never meets a multiplication."""
    seg = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
    return tl.exp(tl.where(mask, seg, float("-inf")))


@triton.jit
def _selected_exp(keep, log_v):
    """exp(log_v) where keep, else exactly 0: a decay cut by a document start, chosen rather than
    multiplied by 0 (a growth's exp may be inf there, and inf * 0 is NaN)."""
    return tl.where(keep, tl.exp(log_v.to(tl.float32)), 0.0)


@triton.jit
def _seq_ids(seq_ptr, b, start, seqlen, stride_seq, Q: tl.constexpr):
    """Document ids of one chunk: per token (Q,), the last valid token's, and the token's
    before the chunk (for chunk 0, the first token's: initial_states reach the first document)."""
    t = start + tl.arange(0, Q)
    base = seq_ptr + b.to(tl.int64) * stride_seq.b
    seq = tl.load(base + t.to(tl.int64) * stride_seq.l, mask=t < seqlen, other=-1)
    last = tl.load(base + tl.cast(tl.minimum(start + Q, seqlen) - 1, tl.int64) * stride_seq.l)
    prev = tl.load(base + tl.cast(tl.maximum(start - 1, 0), tl.int64) * stride_seq.l)
    return seq, last, prev


@triton.jit
def _state_program(nheads, heads_per_group, n_p_tiles, n_n_tiles):
    """Which (segment, state tile, batch, head, group) a state-pass program serves: axis 0
    enumerates segments x p-tiles x n-tiles, axis 1 batch x heads."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_tiles = n_p_tiles * n_n_tiles
    h = pid_bh % nheads
    return (pid // n_tiles, (pid % n_tiles) // n_n_tiles, pid % n_n_tiles, pid_bh // nheads, h,
            h // heads_per_group)


@triton.jit
def _entry_term(edge, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate):
    """decay(c) * segment(s) as a (BP, BN) float32 tile: what the segment's entry state adds to
    chunk c's entry state (forward), or what the gradient at the segment's exit adds to chunk
    c's exit gradient (backward); edge is a _ChunkEdge."""
    decay = tl.load(edge.decay + _row_head(chunk_row, h, nheads))
    S = tl.load(edge.segment + _state_tile(seg_row, h, offs_p, offs_n, nheads, headdim, dstate), mask=mask_pn,
                other=0.0)
    return decay * S.to(tl.float32)


@triton.jit
def _true_chunk_edge(edge, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                     HAS_SEG: tl.constexpr):
    """A (BP, BN) float32 tile of chunk c's true entry state (or exit gradient): the stored
    value, plus, with HAS_SEG, the segment's term."""
    v = tl.load(edge.stored + _state_tile(chunk_row, h, offs_p, offs_n, nheads, headdim, dstate),
                mask=mask_pn, other=0.0).to(tl.float32)
    if HAS_SEG:
        v += _entry_term(edge, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate)
    return v


# ---------------------------------------------------------------------------------------------
# 2. The launch plan
#    Sizes and tiles, and the choices that differ between a GPU and the interpreter.
# ---------------------------------------------------------------------------------------------


# Host-side integer helpers. triton.cdiv and triton.next_power_of_2 do the same, but through
# Triton's constexpr machinery, which costs microseconds a call: these run on every launch.
def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(v):
    return 1 << max(0, v - 1).bit_length()


def _pow2(v, lo=16):
    return max(lo, _next_pow2(v))


def _stand_in(t, placeholder):
    """t, or a stand-in for an absent tensor: the kernels form its pointers but never dereference them."""
    return placeholder if t is None else t


# Every bad argument gets a ValueError naming it, what was seen, and what was expected.

def _expect(cond, name, seen, expected):
    if not cond:
        raise ValueError(f"{name}: got {seen}, expected {expected}")


class ConvLaunch(NamedTuple):
    """A conv program walks `runs` runs of `rows` consecutive tokens side by side (one tile) over
    `channels` channels with `warps` warps, loading `unroll` rows of each run per step so that
    their loads are in flight together. On a GPU one run a program: registers bound the loads in
    flight. In the interpreter, which pays per step, many."""
    runs: int
    channels: int
    rows: int
    unroll: int
    warps: int


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Every choice that differs between a GPU and the Triton interpreter, in one place. The
    GPU's are the fastest measured on an H200 at the record shape (BENCHMARKS.md, "Where the
    time goes", "The launch choices"); the interpreter pays per program, and its choices make the
    CPU tests walk every loop (several segments, state tiles, head blocks).
    `TUNINGS` holds them by name; `set_tuning` picks the one the launches use (the interpreter's
    wherever the interpreter runs, else the GPU's)."""

    name: str
    # Kernel chunk lengths: the chunked form computes the same recurrence for any chunk length,
    # so the kernels may use a shorter chunk than the caller's (their (Q, Q) tiles live in
    # registers).
    chunk_fwd: int
    chunk_bwd: int
    # Segments of this many chunks run the sequential state pass in parallel (the affine
    # summary of README walkthrough c, applied within one GPU); tiny ones on CPUs, so that the
    # tests exercise the segment scan.
    chunks_per_segment: int
    # The state passes' (p, n) tile is split across programs at this width (None: whole).
    state_tile: Optional[int]
    # The n tile of the three chunk-backward kernels (group, BC, x).
    bwd_state_tiles: tuple
    # Heads per output program (None: a whole group, which shares the group's C.B; one head per
    # program runs more programs, which hides latency better).
    heads_per_output: Optional[int]
    # Launch options per chunk kernel (GPU only). These kernels are latency-bound chains of
    # small products: what pays is programs per SM, hence 4 warps and, where it buys a program
    # without costing more in spills, a register cap (maxnreg).
    launch: dict
    # The segment scan's slice of the p*n state per program (None: the whole state).
    scan_block: Optional[int]
    # The conv's launches (ConvLaunch): forward and backward.
    conv_fwd: ConvLaunch
    conv_bwd: ConvLaunch
    # The gate and gated RMSNorm (Part II): elements per tile, and programs of the backward.
    gate_tile: int
    gate_programs: int


_KERNELS = ("state", "output", "bwd_group", "bwd_bc", "bwd_x")     # the chunk kernels that take launch options
TUNINGS = {
    "gpu": Tuning("gpu", chunk_fwd=64, chunk_bwd=64, chunks_per_segment=16, state_tile=64,
                  bwd_state_tiles=(64, 64, 64), heads_per_output=1,
                  launch=dict(state=dict(num_warps=4, num_stages=2, maxnreg=128),
                              output=dict(num_warps=4, num_stages=1, maxnreg=168),
                              bwd_group=dict(num_warps=4, num_stages=2), bwd_bc=dict(num_warps=4, num_stages=2),
                              bwd_x=dict(num_warps=4, num_stages=1, maxnreg=128)),
                  scan_block=1024, conv_fwd=ConvLaunch(1, 256, 128, 8, 2), conv_bwd=ConvLaunch(1, 128, 256, 8, 1),
                  gate_tile=4096, gate_programs=4096),
    "interpreter": Tuning("interpreter", chunk_fwd=64, chunk_bwd=64, chunks_per_segment=2, state_tile=None,
                          bwd_state_tiles=(16, 16, 16), heads_per_output=None, launch={}, scan_block=None,
                          conv_fwd=ConvLaunch(32, 64, 64, 1, 4), conv_bwd=ConvLaunch(32, 64, 64, 1, 1),
                          gate_tile=64, gate_programs=4096),
}
_TUNING = [TUNINGS["interpreter" if INTERPRET else "gpu"]]


def set_tuning(choice):
    """Make `choice` (a Tuning, or a name in TUNINGS) the one every launch uses; returns the
    previous one. Tests pick the GPU's in the interpreter this way; bench.py its variants."""
    if isinstance(choice, str) and choice not in TUNINGS or not isinstance(choice, (str, Tuning)):
        raise ValueError(f"set_tuning: got {choice!r}, expected a Tuning or one of {sorted(TUNINGS)}")
    previous = _TUNING[0]
    _TUNING[0] = TUNINGS[choice] if isinstance(choice, str) else choice
    return previous


def tuning():
    """The Tuning the launches use now."""
    return _TUNING[0]


class _SSDInputs(NamedTuple):
    """The tensors of one SSD call, which travel together from launcher to launcher: x
    (b, l, h, p); dt (b, l, h) raw (dt_bias, softplus and dt_limit as the _LaunchPlan says); A
    (h,); B and C (b, l, g, n); D (h,), (h, p) or None; dt_bias (h,) or None; seq_idx (b, l)
    int32 or None. C may be None while only the state pass has run."""
    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Optional[Tensor]
    D: Optional[Tensor]
    dt_bias: Optional[Tensor]
    seq_idx: Optional[Tensor]


class _LaunchPlan:
    """Everything the kernels need that is derived once per call: sizes, tile shapes, flags."""

    def __init__(self, x, B, chunk, dt_bias, dt_softplus, dt_limit, seq_idx, state_dtype=None):
        t = self.tuning = tuning()
        self.batch, self.seqlen, self.nheads, self.headdim = x.shape
        self.ngroups, self.dstate = B.shape[2], B.shape[3]
        self.heads_per_group = self.nheads // self.ngroups
        self.Q = chunk
        self.nchunks = _cdiv(self.seqlen, chunk)
        self.chunks_per_seg = t.chunks_per_segment
        self.nseg = _cdiv(self.nchunks, self.chunks_per_seg)
        self.BP = _pow2(self.headdim)
        self.BN = _pow2(self.dstate)
        self.BP_state = min(self.BP, t.state_tile or self.BP)
        self.BN_state = min(self.BN, t.state_tile or self.BN)
        self.n_p_tiles = _cdiv(self.headdim, self.BP_state)
        self.n_n_tiles = _cdiv(self.dstate, self.BN_state)
        self.dt_min, self.dt_max = float(dt_limit[0]), float(dt_limit[1])
        self.flags = dict(HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
                          HAS_SEQ=seq_idx is not None)
        self.precision = "ieee" if x.dtype == torch.float32 else "tf32"
        # the chunk entry states (and, in backward, exit gradients) as stored between kernels;
        # the kernels carry them in float32 and read them back to float32
        self.state_dtype = state_dtype or (torch.float32 if x.dtype == torch.float32 else x.dtype)
        self.BN_group, self.BN_bc, self.BN_x = (min(self.BN, n) for n in t.bwd_state_tiles)
        self.heads_per_output = t.heads_per_output or self.heads_per_group    # a divisor of heads_per_group
        # launch options exist on a GPU only: the interpreter takes none
        self.launch = {name: ({} if INTERPRET else t.launch.get(name, {})) for name in _KERNELS}

    def state_grid(self):
        return (self.nseg * self.n_p_tiles * self.n_n_tiles, self.batch * self.nheads)


# ---------------------------------------------------------------------------------------------
# 3. The forward: state pass (both ways), segment scan, outputs; Summary
#    README walkthrough b, c. Each kernel is followed by its launcher; Summary runs them.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _state_pass_kernel(
    u_ptr, v_ptr, dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, chunk_ptr, decay_ptr, sum_ptr, a_ptr,
    seqlen, nheads, headdim, dstate, nchunks, chunks_per_seg, n_p_tiles, n_n_tiles, heads_per_group,
    dt_min, dt_max, stride_u, stride_v, stride_dt, stride_seq,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr, REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One segment (chunks_per_seg chunks) of one (batch, head, state tile), from zero: walk its
    chunks carrying a (BP, BN) value V, store V as each chunk meets it, then
        V <- exp(cs_last) V + sum_j w_j u_j v_j^T.
    Forward (u = x, v = B): chunks in order, V is the state entering a chunk, and
    w_j = exp(cs_last - cs_j) dt'_j weighs token j's way to the chunk's exit. REVERSE (u = dy,
    v = C): chunks last to first, V is the gradient arriving at a chunk's exit, and
    w_i = exp(cs_i) weighs the entry's way to token i. Either way, also store per chunk the decay
    between the segment's edge and the chunk (gamma(c) from the segment's entry to c's entry;
    rho(c) from c's exit to the segment's exit; 0 once a document starts in between), and at the
    end what is left (S_ext, the segment's exit state; G, the pull of its outputs on its entry)
    and the segment's decay a. Segments run in parallel; a scan over the summaries supplies each
    one's true entry state S_entry (exit gradient dS_exit), and chunk c's true entry state is
    states(c) + gamma(c) S_entry (its exit gradient dstates(c) + rho(c) dS_exit)."""
    seg, pid_p, pid_n, b, h, g = _state_program(nheads, heads_per_group, n_p_tiles, n_n_tiles)
    b64 = b.to(tl.int64)
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
    first_tile = (pid_p == 0) & (pid_n == 0)          # one program per head writes the decays

    V = tl.zeros((BP, BN), dtype=tl.float32)                                      # (BP, BN)
    log_decay = tl.zeros((), dtype=tl.float64)
    alive = tl.full((), 1, tl.int1)                   # False once a document starts in between
    c_first = seg * chunks_per_seg
    c_end = tl.minimum(c_first + chunks_per_seg, nchunks)
    for i in range(c_end - c_first):
        c = c_end - 1 - i if REVERSE else c_first + i
        start = c * Q
        tl.store(chunk_ptr + _state_tile(b64 * nchunks + c, h, offs_p, offs_n, nheads, headdim, dstate),
                 V.to(chunk_ptr.dtype.element_ty), mask=mask_pn)
        tl.store(decay_ptr + _row_head(b64 * nchunks + c, h, nheads), _selected_exp(alive, log_decay),
                 mask=first_tile)
        dt, dA, slope = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen, stride_dt,
                                  Q, HAS_DT_BIAS, DT_SOFTPLUS, dt_min, dt_max)
        total = tl.sum(dA.to(tl.float64), axis=0)
        if REVERSE:
            hi, lo = _cumsum_hi_lo(dA)
            w = tl.exp(hi + lo)                                                   # (Q,) exp(cs_i)
        else:
            w = tl.exp((total - tl.cumsum(dA.to(tl.float64), axis=0)).to(tl.float32)) * dt
        decay = tl.exp(total.to(tl.float32))
        log_decay += total
        if HAS_SEQ:
            seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq, Q)
            if REVERSE:
                w = tl.where(seq == prev, w, 0.0)      # the entry reaches only the first document
            else:
                w = tl.where(seq == last, w, 0.0)      # only the last document reaches the exit
            decay = tl.where(last == prev, decay, 0.0)  # a document starts inside: the chunk cuts through
            alive = alive & (last == prev)
        t64 = (start + offs_q).to(tl.int64)
        valid = start + offs_q < seqlen
        u = tl.load(_tile_ptrs(u_ptr, stride_u, b64, t64, h, offs_p), mask=valid[:, None] & (offs_p[None, :] < headdim),
                    other=0.0)                                                     # (Q, BP)
        v = tl.load(_tile_ptrs(v_ptr, stride_v, b64, t64, g, offs_n), mask=valid[:, None] & (offs_n[None, :] < dstate),
                    other=0.0)                                                     # (Q, BN)
        uw = (u.to(tl.float32) * w[:, None]).to(v.dtype)
        V = decay * V + tl.dot(tl.trans(uw), v, input_precision=DOT_PRECISION)    # (BP, BN)

    seg_row = b64 * tl.cdiv(nchunks, chunks_per_seg) + seg
    tl.store(a_ptr + _row_head(seg_row, h, nheads), _selected_exp(alive, log_decay), mask=first_tile)
    tl.store(sum_ptr + _state_tile(seg_row, h, offs_p, offs_n, nheads, headdim, dstate), V, mask=mask_pn)


def _state_pass(u, v, dt, A, dt_bias, seq_idx, plan, reverse):
    """Every segment from zero, forward (u = x, v = B) or reverse (u = dy, v = C): per chunk the
    carried value (b, nchunks, h, p, n) and decay (b, nchunks, h); per segment what is left
    (b, nseg, h, p, n) and its decay a (b, nseg, h)."""
    dev = u.device
    per_chunk = torch.empty(plan.batch, plan.nchunks, plan.nheads, plan.headdim, plan.dstate, device=dev,
                            dtype=plan.state_dtype)
    decay = torch.empty(plan.batch, plan.nchunks, plan.nheads, device=dev, dtype=torch.float32)
    left = torch.empty(plan.batch, plan.nseg, plan.nheads, plan.headdim, plan.dstate, device=dev, dtype=torch.float32)
    a = torch.empty(plan.batch, plan.nseg, plan.nheads, device=dev, dtype=torch.float32)
    _state_pass_kernel[plan.state_grid()](
        u, v, dt, dt_bias, A, seq_idx, per_chunk, decay, left, a,
        plan.seqlen, plan.nheads, plan.headdim, plan.dstate, plan.nchunks, plan.chunks_per_seg, plan.n_p_tiles,
        plan.n_n_tiles, plan.heads_per_group, plan.dt_min, plan.dt_max,
        _BLHP(*u.stride()), _BLGN(*v.stride()), _BLH(*dt.stride()), _strides_of(seq_idx, _BL),
        Q=plan.Q, BP=plan.BP_state, BN=plan.BN_state, REVERSE=reverse, DOT_PRECISION=plan.precision,
        **plan.launch["state"], **plan.flags)
    return per_chunk, decay, left, a


@triton.jit
def _segment_scan_kernel(
    src_ptr, a_ptr, cont_ptr, start_ptr, out_ptr, end_ptr, nseg, nheads, size,
    BLOCK: tl.constexpr, HAS_CONT: tl.constexpr, HAS_START: tl.constexpr, REVERSE: tl.constexpr,
):
    """The exclusive scan over segment summaries, for one (batch, head, slice of the p*n state).
    Forward (src = S_ext), from S_entry(0) = initial:
        S_entry(k+1) = cont_{k+1} (a_k S_entry(k) + S_ext(k))
    Reverse (src = G, the pull of each segment's own outputs on its entry), from the final
    state's gradient, the gradient arriving at each segment's exit:
        dS_exit(k-1) = cont_k (G(k) + a_k dS_exit(k))
    cont_k = 0 where segment k starts a new document (cont_0 = 1). Stores every S_entry(k) (dS_exit(k))
    and what is left at the end: the exit of the last segment (the initial state's gradient).
    Every buffer is contiguous: states (b, nseg, h, size), a (b, nseg, h), cont (b, nseg), start
    and end (b, h, size)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    if HAS_START:
        S = tl.load(start_ptr + _row_head(b, h, nheads) * size + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(nseg):
        row = b * nseg + (nseg - 1 - i if REVERSE else i)
        if HAS_CONT and not REVERSE:
            S *= tl.load(cont_ptr + row)
        tl.store(out_ptr + _row_head(row, h, nheads) * size + offs, S, mask=mask)
        a = tl.load(a_ptr + _row_head(row, h, nheads))
        S = a * S + tl.load(src_ptr + _row_head(row, h, nheads) * size + offs, mask=mask)
        if HAS_CONT and REVERSE:
            S *= tl.load(cont_ptr + row)
    tl.store(end_ptr + _row_head(b, h, nheads) * size + offs, S, mask=mask)


def _scan_block(size):
    return min(tuning().scan_block or _next_pow2(size), _next_pow2(size))


def _f32_contiguous(t):
    return None if t is None else t.float().contiguous()


def _scan(src, a, start, cont, reverse):
    b, K, h, p, n = src.shape
    src, a, start, cont = (_f32_contiguous(t) for t in (src, a, start, cont))
    out = torch.empty_like(src)
    end = torch.empty(b, h, p, n, device=src.device, dtype=torch.float32)
    BLOCK = _scan_block(p * n)
    _segment_scan_kernel[(_cdiv(p * n, BLOCK), b * h)](
        src, a, cont, start, out, end, K, h, p * n,
        BLOCK=BLOCK, HAS_CONT=cont is not None, HAS_START=start is not None, REVERSE=reverse)
    return out, end


def scan_segments(S_ext, a, initial=None, cont=None):
    """Exclusive scan over segment summaries: the entry state of every segment (b, K, h, p, n)
    and the exit state of the last (b, h, p, n), all fp32. S_ext (b, K, h, p, n) and a (b, K, h);
    initial (b, h, p, n) or None; cont (b, K) fp32 document-continuation flags or None."""
    return _scan(S_ext, a, initial, cont, reverse=False)


def scan_segments_bwd(G, a, dfinal=None, cont=None):
    """Reverse exclusive scan: the gradient arriving at every segment's exit (b, K, h, p, n) and
    the gradient of the initial state (b, h, p, n), all fp32."""
    return _scan(G, a, dfinal, cont, reverse=True)


@triton.jit
def _output_fwd_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dt_bias_ptr, A_ptr, D_ptr, seq_ptr, y_ptr, entries,
    seqlen, headdim, dstate, heads_per_group, heads_per_program, nheads, batch, chunks_per_seg, dt_min, dt_max,
    stride_x, stride_B, stride_C, stride_dt, stride_D, stride_seq, stride_y,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_ENTRY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Outputs of one (chunk, batch, block of heads_per_program heads of one group, p-block):
    C.B is formed once and reused by the block's heads; then per head
    y = (C.B * decay * dt') x + exp(cs) C S_in (+ D x), with
    S_in = states(c) + gamma(c) S_entry (entries, a _ChunkEdge): the segment's entry state is
    folded in here."""
    # heads_per_program heads of one group (a divisor of heads_per_group) per program; head
    # blocks vary fastest in the grid, so the programs running at once share a chunk's B and C
    pid = tl.program_id(0)
    pid_p = tl.program_id(1)
    n_blocks = nheads // heads_per_program
    h0 = (pid % n_blocks) * heads_per_program
    b = (pid // n_blocks) % batch
    c = pid // (n_blocks * batch)
    g = h0 // heads_per_group
    start = c * Q
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    t = start + offs_q
    valid = t < seqlen
    mask_qp = valid[:, None] & (offs_p[None, :] < headdim)
    mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
    t64 = t.to(tl.int64)
    b64 = b.to(tl.int64)
    chunk_row, seg_row = _chunk_rows(b, c, seqlen, chunks_per_seg, Q)

    Bm = _load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn)          # (Q, BN)
    Cm = _load_tile(C_ptr, stride_C, b64, t64, g, offs_n, mask_qn)          # (Q, BN)
    CB = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION)                   # (Q, Q)

    causal = offs_q[:, None] >= offs_q[None, :]
    entry = tl.full((Q,), 1, tl.int1)
    if HAS_SEQ:
        seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq, Q)
        causal = causal & (seq[:, None] == seq[None, :])
        entry = seq == prev                  # the entry state reaches only the continuing document

    for hh in range(heads_per_program):
        h = h0 + hh
        dt, dA, slope = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen, stride_dt,
                                  Q, HAS_DT_BIAS, DT_SOFTPLUS, dt_min, dt_max)
        hi, lo = _cumsum_hi_lo(dA)
        M = CB * _pair_decay(hi, lo, causal) * dt[None, :]                          # (Q, Q)
        x = _load_tile(x_ptr, stride_x, b64, t64, h, offs_p, mask_qp)        # (Q, BP)
        y = tl.dot(M.to(x.dtype), x, input_precision=DOT_PRECISION)                # (Q, BP)

        mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
        S_in = tl.load(entries.stored + _state_tile(chunk_row, h, offs_p, offs_n, nheads, headdim, dstate),
                       mask=mask_pn, other=0.0)                                    # (BP, BN)
        if HAS_ENTRY:
            S_in = S_in.to(tl.float32) + _entry_term(entries, chunk_row, seg_row, h, offs_p, offs_n, mask_pn,
                                                     nheads, headdim, dstate)
        e = tl.where(entry, tl.exp(hi + lo), 0.0)                                  # (Q,)
        y += e[:, None] * tl.dot(Cm, tl.trans(S_in.to(Cm.dtype)), input_precision=DOT_PRECISION)

        if HAS_D:
            Dv = tl.load(D_ptr + h * stride_D.h + offs_p * stride_D.p, mask=offs_p < headdim, other=0.0)
            y += Dv.to(tl.float32)[None, :] * x.to(tl.float32)
        tl.store(_tile_ptrs(y_ptr, stride_y, b64, t64, h, offs_p), y.to(y_ptr.dtype.element_ty), mask=mask_qp)


def _D_strides(D):
    """D's strides as (h, p): a (h,) D broadcasts over p with a zero stride."""
    if D is None:
        return _HP(0, 0)
    return _HP(D.stride(0), 0 if D.dim() == 1 else D.stride(1))


def _output_fwd(inp, states, gamma, entry, plan, y=None):
    """y (b, l, h, p) of the _SSDInputs inp; entry (b, nseg, h, p, n) fp32: each segment's entry
    state, or None for zero."""
    x, dt, A, B, C, D, dt_bias, seq_idx = inp
    if y is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    grid = (plan.nchunks * plan.batch * (plan.nheads // plan.heads_per_output), _cdiv(plan.headdim, plan.BP))
    _output_fwd_kernel[grid](
        x, B, C, dt, dt_bias, A, D, seq_idx, y, _ChunkEdge(states, gamma, _stand_in(entry, gamma)),
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.heads_per_output, plan.nheads, plan.batch,
        plan.chunks_per_seg, plan.dt_min, plan.dt_max,
        _BLHP(*x.stride()), _BLGN(*B.stride()), _BLGN(*C.stride()), _BLH(*dt.stride()), _D_strides(D),
        _strides_of(seq_idx, _BL), _BLHP(*y.stride()),
        Q=plan.Q, BP=plan.BP, BN=plan.BN, HAS_D=D is not None,
        HAS_ENTRY=entry is not None, DOT_PRECISION=plan.precision, **plan.launch["output"], **plan.flags)
    return y


class Summary:
    """A sequence's (or CP shard's) state pass from a zero entry: what its outputs need besides
    the entry state. Its affine summary S_out = a * S_entry + S_ext (fp32) is `affine()`."""

    def __init__(self, inp, plan):
        self.states, self.gamma, self.seg_ext, self.seg_a = _state_pass(inp.x, inp.B, inp.dt, inp.A, inp.dt_bias,
                                                                        inp.seq_idx, plan, False)
        self.plan = plan

    def affine(self):
        """(S_ext (b, h, p, n), a (b, h)): the internal segments composed."""
        if self.plan.nseg == 1:
            return self.seg_ext[:, 0], self.seg_a[:, 0]
        return scan_segments(self.seg_ext, self.seg_a)[1], self.seg_a.prod(dim=1)

    def segment_entries(self, entry, need_exit=False):
        """Each internal segment's entry state (b, nseg, h, p, n), given the sequence's entry
        (or None for zero), and with need_exit the sequence's exit state (b, h, p, n)."""
        entry = _f32_contiguous(entry)        # the kernels read it as a (b, nseg, h, p, n) buffer
        if self.plan.nseg == 1:
            seg_entry = None if entry is None else entry[:, None]
            if not need_exit:
                return seg_entry, None
            S_ext, a = self.affine()
            return seg_entry, (S_ext if entry is None else S_ext + a[:, :, None, None] * entry)
        return scan_segments(self.seg_ext, self.seg_a, entry)  # later segments start where earlier end


def ssd_output(inp, summary, entry=None, y=None, need_exit=False):
    """The outputs of a summarised sequence (_SSDInputs inp) entered with state `entry`
    (b, h, p, n) or zero; with need_exit also its exit state (else None)."""
    seg_entry, exit_ = summary.segment_entries(entry, need_exit)
    y = _output_fwd(inp, summary.states, summary.gamma, seg_entry, summary.plan, y)
    return y, exit_


# ---------------------------------------------------------------------------------------------
# 4. The backward: GradPass (the state pass reversed), chunk gradients
#    README walkthrough e. Each kernel is followed by its launcher.
# ---------------------------------------------------------------------------------------------


class GradPass:
    """A sequence's reverse state pass from a zero gradient at its exit: the chunks' exit
    gradients, and G (b, h, p, n), the pull of its outputs on its entry state. G is known
    before the gradient at the exit is (it is what a CP rank all-gathers in backward)."""

    def __init__(self, dy, inp, plan):
        self.dstates, self.rho, self.seg_G, self.seg_a = _state_pass(dy, inp.C, inp.dt, inp.A, inp.dt_bias,
                                                                     inp.seq_idx, plan, True)
        self.plan = plan

    @property
    def G(self):
        """The internal segments' pulls composed (one reverse scan); only CP needs it alone."""
        return self.seg_G[:, 0] if self.plan.nseg == 1 else scan_segments_bwd(self.seg_G, self.seg_a)[1]

    def exits_and_entry(self, dexit):
        """Given the gradient at the sequence's exit (b, h, p, n) or None: the gradient arriving
        at each internal segment's exit (b, nseg, h, p, n) or None, and the gradient at the
        sequence's entry, G + a dexit (b, h, p, n), both from one reverse scan."""
        dexit = _f32_contiguous(dexit)        # the kernels read it as a (b, nseg, h, p, n) buffer
        if self.plan.nseg == 1:
            G = self.seg_G[:, 0]
            if dexit is None:
                return None, G
            return dexit[:, None], G + self.seg_a[:, 0, :, None, None] * dexit
        return scan_segments_bwd(self.seg_G, self.seg_a, dexit)


@triton.jit
def _chunk_vector_decays(dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, b, h, start, seqlen, stride_dt, stride_seq,
                         Q: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                         HAS_SEQ: tl.constexpr, dt_min, dt_max):
    """The per-token decays of one chunk of one head, for the backward:
      dt', slope     (Q,) the processed dt and d dt'/d dt_raw
      e              (Q,) exp(cs_i), the entry state's decay to token i (0 for a new document)
      w_dec          (Q,) exp(cs_last - cs_j), token j's decay to the exit (0 if it never gets there)
      decay          ()   exp(cs_last), the entry's decay to the exit (0 across a document start)
    and the cumulative sums (hi, lo) and document ids that the pair decays are cut from."""
    dt, dA, slope = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, b, h, start, seqlen, stride_dt,
                              Q, HAS_DT_BIAS, DT_SOFTPLUS, dt_min, dt_max)
    hi, lo = _cumsum_hi_lo(dA)
    cs64 = tl.cumsum(dA.to(tl.float64), axis=0)
    total = tl.sum(dA.to(tl.float64), axis=0)
    e = tl.exp(hi + lo)
    w_dec = tl.exp((total - cs64).to(tl.float32))
    decay = tl.exp(total.to(tl.float32))
    seq = tl.zeros((Q,), dtype=tl.int32)
    if HAS_SEQ:
        seq, last, prev = _seq_ids(seq_ptr, b, start, seqlen, stride_seq, Q)
        e = tl.where(seq == prev, e, 0.0)
        w_dec = tl.where(seq == last, w_dec, 0.0)
        decay = tl.where(last == prev, decay, 0.0)
    return dt, slope, e, w_dec, decay, hi, lo, seq


@triton.jit
def _tf32_split(a):
    """a float32 = hi + lo exactly: hi keeps the 11 leading significant bits, all that tf32
    holds (the low 13 mantissa bits cleared), and |lo| < 2^-10 |a|."""
    hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, a - hi


@triton.jit
def _exact_dot(a, b01, PRECISION: tl.constexpr):
    """a (M, K) float32 times b01 (K, N), a matrix of 0s and 1s, keeping float32's accuracy
    whatever the kernel's precision: exact with "ieee"; with "tf32" (the products' precision for
    bf16 and fp16 inputs), two tensor-core products of a's split (b01 is exact in tf32,
    hi too, and lo loses at most 2^-11 of itself), each term then within 2^-20 of itself. Every
    term keeps its own relative accuracy: nothing cancels that the exact sum would not cancel."""
    if PRECISION == "ieee":
        return tl.dot(a, b01, input_precision="ieee")
    hi, lo = _tf32_split(a)
    return tl.dot(hi, b01, input_precision="tf32") + tl.dot(lo, b01, input_precision="tf32")


@triton.jit
def _document_pair_decay(hi, lo, seq, Q: tl.constexpr, HAS_SEQ: tl.constexpr):
    """L (Q, Q) of one chunk: exp(cs_i - cs_j) over its causal pairs i >= j of one document, else 0."""
    offs_q = tl.arange(0, Q)
    causal = offs_q[:, None] >= offs_q[None, :]
    if HAS_SEQ:
        causal = causal & (seq[:, None] == seq[None, :])
    return _pair_decay(hi, lo, causal)


@triton.jit
def _chunk_tokens(c, seqlen, headdim, Q: tl.constexpr, BP: tl.constexpr):
    """Chunk c's first token, its token offsets (Q,) and headdim offsets (BP,), the tokens' int64
    positions, which of them exist, and the (Q, BP) mask of a head tile."""
    start = c * Q
    offs_q = tl.arange(0, Q)
    offs_p = tl.arange(0, BP)
    valid = start + offs_q < seqlen
    return start, offs_q, offs_p, (start + offs_q).to(tl.int64), valid, valid[:, None] & (offs_p[None, :] < headdim)


@triton.jit
def _pair_tile(chunk_row, g, ngroups, Q: tl.constexpr):
    """int64 offsets of group g's (Q, Q) tile in a contiguous (b * nchunks, ngroups, Q, Q) buffer."""
    offs_q = tl.arange(0, Q)
    return (chunk_row * ngroups + g) * (Q * Q) + offs_q[:, None] * Q + offs_q[None, :]


# The chunk backward in three kernels, each one job: what a group's heads share (C.B and the
# pull dCB of all its heads on it, computed once per chunk and group), the group's dB and dC, and
# each head's dx and dt. Per chunk, with M_ij = (C_i . B_j) exp(cs_i - cs_j) over the causal
# pairs of one document, w_j = exp(cs_last - cs_j) dt'_j, e_i = exp(cs_i), S_in and dS_out the
# chunk's true entry state and exit gradient:
#     dx_j  = dt'_j sum_i M_ij dy_i + w_j dS_out B_j + D dy_j
#     dC_i  = sum_j dCB_ij B_j + sum_h e_i S_in^T dy_i      dCB_ij = sum_h (dy_i . x_j) exp(cs_i - cs_j) dt'_j
#     dB_j  = sum_i dCB_ij C_i + sum_h w_j dS_out^T x_j
#     dt'_j = sum_i (dy_i . x_j) M_ij + exp(cs_last - cs_j) x_j . (dS_out B_j)
#     d(dt'_k A) collects every decay exponent whose span holds token k: the pairs i >= k > j,
#            the entry decays e_i with i >= k, the exit decays with j < k, and exp(cs_last).
# The first kernel sums the pairs' share directly over the pairs that span k, never as a
# difference of running sums (README walkthrough b, rule 3). The states' shares come from the
# products the BC kernel forms for dB and dC: the entry's C_i . (e_i S_in^T dy_i), the exit's
# B_j . (x_j^T dS_out) (the pull on w_j), the carry <dS_out, S_in>; so the x kernel reads neither x
# nor the entry states, and sums those shares.

@triton.jit
def _chunk_bwd_group_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, dout_ptr,
    CB_ptr, dCB_ptr, ddt_pairs_ptr, ddA_pairs_ptr, dD_part_ptr,
    seqlen, headdim, dstate, heads_per_group, ngroups, batch, dt_min, dt_max,
    stride_x, stride_B, stride_C, stride_dt, stride_seq, stride_do,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (chunk, batch, group): C.B and dCB for the buffers the other two kernels read, and
    for each of the group's heads its pairs' share of dt' and of d(dt'A) (Q,) and its dD partial.
    CB (b * nchunks, g, Q, Q) fp32, dCB the same in the input dtype, the head vectors
    (b * nchunks, h, Q) fp32, dD (b * nchunks, h, p) fp32."""
    # groups vary fastest: the programs running at once share a chunk's x and dy in L2
    pid = tl.program_id(0)
    g = pid % ngroups
    b = (pid // ngroups) % batch
    c = pid // (ngroups * batch)
    start, offs_q, offs_p, t64, valid, mask_qp = _chunk_tokens(c, seqlen, headdim, Q, BP)
    b64 = b.to(tl.int64)
    nheads = heads_per_group * ngroups
    chunk_row = b64 * tl.cdiv(seqlen, Q) + c

    CB = tl.zeros((Q, Q), dtype=tl.float32)                                        # C_i . B_j
    for n0 in range(0, dstate, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
        Cm = _load_tile(C_ptr, stride_C, b64, t64, g, offs_n, mask_qn)
        Bm = _load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn)
        CB += tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION)
    tl.store(CB_ptr + _pair_tile(chunk_row, g, ngroups, Q), CB)

    before = (offs_q[:, None] < offs_q[None, :]).to(tl.float32)                   # (Q, Q) [j < k]
    dCB = tl.zeros((Q, Q), dtype=tl.float32)
    for hh in range(heads_per_group):
        h = g * heads_per_group + hh
        dt, slope, e, w_dec, decay, hi, lo, seq = _chunk_vector_decays(
            dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, b, h, start, seqlen, stride_dt, stride_seq,
            Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_SEQ, dt_min, dt_max)
        L = _document_pair_decay(hi, lo, seq, Q, HAS_SEQ)
        x = _load_tile(x_ptr, stride_x, b64, t64, h, offs_p, mask_qp)              # (Q, BP)
        dy = _load_tile(dout_ptr, stride_do, b64, t64, h, offs_p, mask_qp).to(x.dtype)
        dxyL = tl.dot(dy, tl.trans(x), input_precision=DOT_PRECISION) * L          # (Q, Q) (dy_i . x_j) L_ij
        dCB += dxyL * dt[None, :]                                                  # this head's pull on C.B
        dxyM = dxyL * CB
        row = _row_head(chunk_row, h, nheads) * Q + offs_q
        tl.store(ddt_pairs_ptr + row, tl.sum(dxyM, axis=0))
        # d(dt'_k A) from the pairs i >= k > j that span k: a sum along j < k, as a product with
        # the 0/1 matrix `before` on the tensor cores (in place of a scan along j), then a sum
        # over i >= k. L is 0 off the causal pairs of one document, so V needs no mask, and the
        # diagonal j = i never meets j < k <= i.
        V = dxyM * dt[None, :]                                                     # (Q, Q) pair (i, j)
        spans = _exact_dot(V, before, DOT_PRECISION)                     # [i, k]: sum_{j<k} V_ij
        tl.store(ddA_pairs_ptr + row, tl.sum(tl.where(offs_q[:, None] >= offs_q[None, :], spans, 0.0), axis=0))
        if HAS_D and D_PER_CHANNEL:        # (h, p): sum over tokens of dy x, per channel
            tl.store(dD_part_ptr + _row_head(chunk_row, h, nheads) * headdim + offs_p,
                     tl.sum(dy.to(tl.float32) * x.to(tl.float32), axis=0), mask=offs_p < headdim)
        elif HAS_D:                        # (h,): the trace of dy x^T, which dxyL holds (L_ii = 1)
            tl.store(dD_part_ptr + _row_head(chunk_row, h, nheads),
                     tl.sum(tl.sum(tl.where(offs_q[:, None] == offs_q[None, :], dxyL, 0.0), axis=1), axis=0))
    tl.store(dCB_ptr + _pair_tile(chunk_row, g, ngroups, Q), dCB.to(dCB_ptr.dtype.element_ty))


@triton.jit
def _chunk_bwd_BC_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, entries, exits, dout_ptr, dCB_ptr,
    dB_ptr, dC_ptr, ddA_entry_part_ptr, dw_part_ptr, carry_part_ptr,
    seqlen, headdim, dstate, heads_per_group, ngroups, batch, n_n_tiles, chunks_per_seg, dt_min, dt_max,
    stride_x, stride_B, stride_C, stride_dt, stride_seq, stride_do, stride_dB, stride_dC,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr,
    HAS_ENTRY: tl.constexpr, HAS_EXIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dB and dC of one (chunk, batch, group, state tile), the group's heads summed in registers
    (each written once: no atomics), and per head, over this tile, what the x kernel needs of the
    states: the entry's share of d(dt'A), C_i . (e_i S_in^T dy_i) (Q,); the exit's pull on token
    j's weight w_j, B_j . (x_j^T dS_out) (Q,); and <dS_out, S_in> (). The partials are
    (b * nchunks, h, n_n_tiles, Q), twice, and (b * nchunks, h, n_n_tiles) fp32."""
    # state tiles vary fastest, then groups: the programs running at once share x and dy
    pid = tl.program_id(0)
    pid_n = pid % n_n_tiles
    g = (pid // n_n_tiles) % ngroups
    b = (pid // (n_n_tiles * ngroups)) % batch
    c = pid // (n_n_tiles * ngroups * batch)
    start, offs_q, offs_p, t64, valid, mask_qp = _chunk_tokens(c, seqlen, headdim, Q, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
    b64 = b.to(tl.int64)
    nheads = heads_per_group * ngroups
    chunk_row, seg_row = _chunk_rows(b, c, seqlen, chunks_per_seg, Q)

    Bm = _load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn)                # (Q, BN)
    Cm = _load_tile(C_ptr, stride_C, b64, t64, g, offs_n, mask_qn)                # (Q, BN)
    dCB = tl.load(dCB_ptr + _pair_tile(chunk_row, g, ngroups, Q)).to(Cm.dtype)     # (Q, Q)
    dC = tl.dot(dCB, Bm, input_precision=DOT_PRECISION)                            # (Q, BN)
    dB = tl.dot(tl.trans(dCB), Cm, input_precision=DOT_PRECISION)
    for hh in range(heads_per_group):
        h = g * heads_per_group + hh
        dt, slope, e, w_dec, decay, hi, lo, seq = _chunk_vector_decays(
            dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, b, h, start, seqlen, stride_dt, stride_seq,
            Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_SEQ, dt_min, dt_max)
        x = _load_tile(x_ptr, stride_x, b64, t64, h, offs_p, mask_qp)              # (Q, BP)
        dy = _load_tile(dout_ptr, stride_do, b64, t64, h, offs_p, mask_qp)
        # the states in the products' operand dtype, as the forward's products take them
        S_in = _true_chunk_edge(entries, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                                HAS_ENTRY).to(x.dtype)                             # (BP, BN)
        dS_out = _true_chunk_edge(exits, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                                  HAS_EXIT).to(x.dtype)                            # (BP, BN)
        part = _row_head(chunk_row, h, nheads) * n_n_tiles + pid_n
        tl.store(carry_part_ptr + part, tl.sum(tl.sum(dS_out.to(tl.float32) * S_in.to(tl.float32), axis=1), axis=0))
        xdS = tl.dot(x, dS_out, input_precision=DOT_PRECISION)                     # (Q, BN) x_j^T dS_out
        dB += (w_dec * dt)[:, None] * xdS
        tl.store(dw_part_ptr + part * Q + offs_q, tl.sum(Bm.to(tl.float32) * xdS, axis=1))
        from_entry = tl.dot((dy.to(tl.float32) * e[:, None]).to(x.dtype), S_in, input_precision=DOT_PRECISION)
        dC += from_entry                                                           # (Q, BN)
        tl.store(ddA_entry_part_ptr + part * Q + offs_q, tl.sum(Cm.to(tl.float32) * from_entry, axis=1))
    tl.store(_tile_ptrs(dB_ptr, stride_dB, b64, t64, g, offs_n), dB.to(dB_ptr.dtype.element_ty), mask=mask_qn)
    tl.store(_tile_ptrs(dC_ptr, stride_dC, b64, t64, g, offs_n), dC.to(dC_ptr.dtype.element_ty), mask=mask_qn)


@triton.jit
def _chunk_bwd_x_kernel(
    B_ptr, dt_ptr, dt_bias_ptr, A_ptr, D_ptr, seq_ptr, exits, dout_ptr, CB_ptr,
    ddt_pairs_ptr, ddA_pairs_ptr, ddA_entry_part_ptr, dw_part_ptr, carry_part_ptr, dx_ptr, ddt_ptr, dA_part_ptr,
    seqlen, headdim, dstate, heads_per_group, nheads, batch, chunks_per_seg, n_bc_tiles, dt_min, dt_max,
    stride_B, stride_dt, stride_D, stride_seq, stride_do, stride_dx,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_SEQ: tl.constexpr,
    HAS_EXIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dx and dt of one (chunk, batch, head), and the chunk's partial dA: dx from the group
    kernel's C.B and the exit gradient; dt from the group kernel's pair shares and the BC kernel's
    entry, exit and state shares. ddt (b, l, h) and the partials (b * nchunks, h) fp32."""
    # heads vary fastest: the programs running at once share a chunk, so its B stays in L2
    pid = tl.program_id(0)
    h = pid % nheads
    b = (pid // nheads) % batch
    c = pid // (nheads * batch)
    g = h // heads_per_group
    start, offs_q, offs_p, t64, valid, mask_qp = _chunk_tokens(c, seqlen, headdim, Q, BP)
    b64 = b.to(tl.int64)
    chunk_row, seg_row = _chunk_rows(b, c, seqlen, chunks_per_seg, Q)

    dt, slope, e, w_dec, decay, hi, lo, seq = _chunk_vector_decays(
        dt_ptr, dt_bias_ptr, A_ptr, seq_ptr, b, h, start, seqlen, stride_dt, stride_seq,
        Q, HAS_DT_BIAS, DT_SOFTPLUS, HAS_SEQ, dt_min, dt_max)
    L = _document_pair_decay(hi, lo, seq, Q, HAS_SEQ)
    CB = tl.load(CB_ptr + _pair_tile(chunk_row, g, nheads // heads_per_group, Q))
    dy = _load_tile(dout_ptr, stride_do, b64, t64, h, offs_p, mask_qp)              # (Q, BP)
    Mdt = (CB * L * dt[None, :]).to(dy.dtype)                                      # (Q, Q)
    dx = tl.dot(tl.trans(Mdt), dy, input_precision=DOT_PRECISION)                  # (Q, BP)
    if HAS_D:
        Dv = tl.load(D_ptr + h * stride_D.h + offs_p * stride_D.p, mask=offs_p < headdim, other=0.0)
        dx += Dv.to(tl.float32)[None, :] * dy.to(tl.float32)
    # the exit's share, a state tile at a time: dx_j += w_j dS_out B_j
    w = w_dec * dt                                                                 # (Q,)
    for n0 in range(0, dstate, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
        mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
        # w folded into B before the product, rounded to the operand dtype as the state pass folds its own
        Bw = (_load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn).to(tl.float32) * w[:, None]).to(dy.dtype)
        dS_out = _true_chunk_edge(exits, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                                  HAS_EXIT).to(dy.dtype)                           # (BP, BN)
        dx = tl.dot(Bw, tl.trans(dS_out), acc=dx, input_precision=DOT_PRECISION)   # (Q, BP)
    tl.store(_tile_ptrs(dx_ptr, stride_dx, b64, t64, h, offs_p), dx.to(dx_ptr.dtype.element_ty), mask=mask_qp)

    row = _row_head(chunk_row, h, nheads)
    entry_share = tl.zeros((Q,), dtype=tl.float32)
    dw = tl.zeros((Q,), dtype=tl.float32)                                         # d w_j = x_j . dS_out B_j
    carry = tl.zeros((), dtype=tl.float32)
    for i in range(n_bc_tiles):
        entry_share += tl.load(ddA_entry_part_ptr + (row * n_bc_tiles + i) * Q + offs_q)
        dw += tl.load(dw_part_ptr + (row * n_bc_tiles + i) * Q + offs_q)
        carry += tl.load(carry_part_ptr + row * n_bc_tiles + i)
    d_entry = tl.cumsum(entry_share, axis=0, reverse=True)                         # exp(cs_i), i >= k
    sw = (dw * w).to(tl.float64)
    d_exit = (tl.cumsum(sw, axis=0) - sw).to(tl.float32)                           # exp(cs_last-cs_j), j < k
    ddA = tl.load(ddA_pairs_ptr + row * Q + offs_q) + d_entry + d_exit + decay * carry
    ddt = tl.load(ddt_pairs_ptr + row * Q + offs_q) + dw * w_dec + ddA * tl.load(A_ptr + h).to(tl.float32)
    tl.store(dA_part_ptr + row, tl.sum(ddA * dt, axis=0))
    tl.store(ddt_ptr + _row_head(b64 * seqlen + t64, h, nheads), ddt * slope, mask=valid)


def _chunk_bwd(inp, states, gamma, entry, dstates, rho, dexit, dout, plan, dx=None, dB=None, dC=None):
    """Every gradient of the chunks of the _SSDInputs inp, given each segment's entry state and
    the gradient at its exit (b, nseg, h, p, n) fp32 (either may be None for zero). dx, dB, dC
    may be views into one buffer (the conv backward's input)."""
    x, dt, A, B, C, D, dt_bias, seq_idx = inp
    dev, rows, Q = x.device, plan.batch * plan.nchunks, plan.Q
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if dx is None else dx
    dB = torch.empty_like(B, memory_format=torch.contiguous_format) if dB is None else dB
    dC = torch.empty_like(C, memory_format=torch.contiguous_format) if dC is None else dC
    ddt = torch.empty(dt.shape, device=dev, dtype=torch.float32)
    CB = torch.empty(rows, plan.ngroups, Q, Q, device=dev, dtype=torch.float32)
    dCB = torch.empty(rows, plan.ngroups, Q, Q, device=dev, dtype=x.dtype)
    ddt_pairs, ddA_pairs = (torch.empty(rows, plan.nheads, Q, device=dev, dtype=torch.float32) for _ in range(2))
    n_bc_tiles = _cdiv(plan.dstate, plan.BN_bc)
    ddA_entry_part, dw_part = (torch.empty(rows, plan.nheads, n_bc_tiles, Q, device=dev, dtype=torch.float32)
                               for _ in range(2))
    carry_part = torch.empty(rows, plan.nheads, n_bc_tiles, device=dev, dtype=torch.float32)
    dA_part = torch.empty(rows, plan.nheads, device=dev, dtype=torch.float32)
    d_width = plan.headdim if D is not None and D.dim() == 2 else 1
    dD_part = torch.empty(rows, plan.nheads, d_width, device=dev, dtype=torch.float32) if D is not None else None
    entries = _ChunkEdge(states, gamma, _stand_in(entry, gamma))
    exits = _ChunkEdge(dstates, rho, _stand_in(dexit, rho))
    s_x, s_B, s_C, s_dt = _BLHP(*x.stride()), _BLGN(*B.stride()), _BLGN(*C.stride()), _BLH(*dt.stride())
    s_seq, s_do = _strides_of(seq_idx, _BL), _BLHP(*dout.stride())
    flags = dict(DOT_PRECISION=plan.precision, **plan.flags)
    _chunk_bwd_group_kernel[(plan.nchunks * plan.batch * plan.ngroups,)](
        x, B, C, dt, dt_bias, A, seq_idx, dout, CB, dCB, ddt_pairs, ddA_pairs, _stand_in(dD_part, ddt_pairs),
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.ngroups, plan.batch,
        plan.dt_min, plan.dt_max, s_x, s_B, s_C, s_dt, s_seq, s_do,
        Q=Q, BP=plan.BP, BN=plan.BN_group, HAS_D=D is not None, D_PER_CHANNEL=d_width > 1,
        **plan.launch["bwd_group"], **flags)
    _chunk_bwd_BC_kernel[(plan.nchunks * plan.batch * plan.ngroups * n_bc_tiles,)](
        x, B, C, dt, dt_bias, A, seq_idx, entries, exits, dout, dCB, dB, dC, ddA_entry_part, dw_part, carry_part,
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.ngroups, plan.batch, n_bc_tiles,
        plan.chunks_per_seg, plan.dt_min, plan.dt_max, s_x, s_B, s_C, s_dt, s_seq, s_do,
        _BLGN(*dB.stride()), _BLGN(*dC.stride()),
        Q=Q, BP=plan.BP, BN=plan.BN_bc, HAS_ENTRY=entry is not None, HAS_EXIT=dexit is not None,
        **plan.launch["bwd_bc"], **flags)
    _chunk_bwd_x_kernel[(plan.nchunks * plan.batch * plan.nheads,)](
        B, dt, dt_bias, A, D, seq_idx, exits, dout, CB, ddt_pairs, ddA_pairs, ddA_entry_part, dw_part, carry_part,
        dx, ddt, dA_part,
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.nheads, plan.batch, plan.chunks_per_seg,
        n_bc_tiles, plan.dt_min, plan.dt_max, s_B, s_dt, _D_strides(D), s_seq, s_do, _BLHP(*dx.stride()),
        Q=Q, BP=plan.BP, BN=plan.BN_x, HAS_D=D is not None, HAS_EXIT=dexit is not None,
        **plan.launch["bwd_x"], **flags)
    dA = dA_part.sum(dim=0)                                                         # (h,)
    dD = None
    if D is not None:
        dD = dD_part.sum(dim=0)                                                     # (h, p)
        dD = dD.sum(-1) if D.dim() == 1 else dD
    return dx, dB, dC, ddt, dA, dD


def ssd_grads(inp, summary, grad_pass, dy, entry=None, dexit=None, dx=None, dB=None, dC=None):
    """Every gradient of a sequence (_SSDInputs inp) entered with state `entry` whose exit
    receives gradient `dexit` (either (b, h, p, n) or None). dx, dB, dC may be given as output
    views. Returns (dx, dB, dC, ddt (fp32, w.r.t. raw dt), dA, dD, d entry)."""
    seg_exits, dentry = grad_pass.exits_and_entry(dexit)
    grads = _chunk_bwd(inp, summary.states, summary.gamma, summary.segment_entries(entry)[0], grad_pass.dstates,
                       grad_pass.rho, seg_exits, dy, summary.plan, dx, dB, dC)
    return (*grads, dentry)


# ---------------------------------------------------------------------------------------------
# 5. Layouts
#    README walkthrough g: which causal segments of the global sequence a rank holds.
# ---------------------------------------------------------------------------------------------


LAYOUTS = ("none", "virtual", "permute_p2p", "permute_a2a")


def _check_layout(load_balancing):
    _expect(load_balancing in LAYOUTS, "load_balancing", repr(load_balancing), f"one of {LAYOUTS}")


def _pieces(rank, world, load_balancing):
    """Pieces of the sequence a rank holds, in local order, and how many pieces there are: one
    contiguous piece of W ("none"), or pieces r and 2W-1-r of 2W (the zigzag layouts)."""
    if load_balancing == "none":
        return [rank], world
    return [rank, 2 * world - 1 - rank], 2 * world


def shard(x_full, rank, world, load_balancing="none", dim=1):
    """This rank's local shard of a full-sequence tensor, in the given layout."""
    _check_layout(load_balancing)
    held, count = _pieces(rank, world, load_balancing)
    L = x_full.shape[dim]
    _expect(L % count == 0, "x_full", f"length {L} along dim {dim}",
            f"a multiple of {count} (the number of pieces for load_balancing={load_balancing!r}, W={world})")
    pieces = x_full.chunk(count, dim=dim)
    return torch.cat([pieces[i] for i in held], dim=dim)


def unshard(shards, load_balancing="none", dim=1):
    """The full-sequence tensor from every rank's shard (a list indexed by rank)."""
    _check_layout(load_balancing)
    world = len(shards)
    count = _pieces(0, world, load_balancing)[1]
    pieces = [None] * count
    for rank, local in enumerate(shards):
        held = _pieces(rank, world, load_balancing)[0]
        for i, piece in zip(held, local.chunk(len(held), dim=dim)):
            pieces[i] = piece
    return torch.cat(pieces, dim=dim)


class _Segments:
    """How the fused function sees a rank's shard: `per_row` causal segments of equal length per
    batch row, with global segment ids `ids` (in local order) out of `count`. "virtual" runs the
    zigzag halves as two segments; the permute layouts are first made contiguous ("none")."""

    def __init__(self, rank, world, load_balancing):
        compute = "virtual" if load_balancing == "virtual" else "none"
        self.ids, self.count = _pieces(rank, world, compute)
        self.per_row = len(self.ids)
        self.rank, self.world = rank, world
        # where each global segment lives: (rank, local index)
        self.where = {}
        for r in range(world):
            for j, k in enumerate(_pieces(r, world, compute)[0]):
                self.where[k] = (r, j)

    def to_rows(self, t):
        """(b, per_row * s, ...) -> (b * per_row, s, ...): one row per segment."""
        return t.reshape(t.shape[0] * self.per_row, t.shape[1] // self.per_row, *t.shape[2:])

    def from_rows(self, t, batch):
        return t.reshape(batch, t.shape[0] // batch * t.shape[1], *t.shape[2:])

    def gather_order(self, gathered, batch):
        """Stack per-rank, per-local-segment tensors (world, batch * per_row, ...) into global
        segment order (batch, count, ...)."""
        per_rank = gathered.reshape(self.world, batch, self.per_row, *gathered.shape[2:])
        order = [self.where[k] for k in range(self.count)]
        return torch.stack([per_rank[r, :, j] for r, j in order], dim=1)

    def own(self, t_global):
        """This rank's segments of a (batch, count, ...) tensor, as rows (batch * per_row, ...)."""
        own = torch.stack([t_global[:, k] for k in self.ids], dim=1)  # no index tensor: graph-capturable
        return own.reshape(own.shape[0] * own.shape[1], *own.shape[2:])


# ---------------------------------------------------------------------------------------------
# 6. The exchange: summaries, their gradients and the conv halo, by all-gather
#    README walkthrough d.
# ---------------------------------------------------------------------------------------------


# Under torch.compile every collective runs inside a custom op (section 13 says why): the compiler
# records the call, and the op's own code runs the NCCL or gloo calls, which the compiler never
# traces. A group travels to an op, and to the plain functions the ops wrap, by its handle.

def _group_name(group):
    """The handle the custom ops take for a process group: its name and its size ("" for none).
    The size is part of it because some fake outputs depend on it (an all-gather's, the CP ops'
    per-segment buffers), and inductor caches a compiled graph on disk under its arguments: by
    name alone (the world is "0" at every size) a graph traced at W = 2 would be reused at W = 3."""
    return "" if group is None else f"{group.group_name}:{dist.get_world_size(group)}"


def _resolve_group(handle):
    return None if handle == "" else dist.distributed_c10d._resolve_process_group(handle.rsplit(":", 1)[0])


def _all_gather(t, cp_group, async_op=False):
    """All-gather of a contiguous tensor into (world, *t.shape); with async_op the Work too."""
    world = dist.get_world_size(cp_group)
    out = torch.empty((world, *t.shape), dtype=t.dtype, device=t.device)
    work = dist.all_gather(list(out.unbind(0)), t.contiguous(), group=cp_group, async_op=async_op)
    return (out, work) if async_op else out


def _pack(rows, *tensors):
    """One (rows, total) fp32 buffer from tensors that share their leading dim (integer tensors
    travel bit-for-bit, as int32 viewed as fp32)."""
    flat = [t.to(torch.int32).view(torch.float32).reshape(rows, -1) if not t.is_floating_point()
            else t.float().reshape(rows, -1) for t in tensors]
    return torch.cat(flat, dim=1)


def _unpack(buf, shapes_dtypes):
    """Inverse of _pack along the last dim of buf (..., total)."""
    out, at = [], 0
    for shape, dtype in shapes_dtypes:
        n = 1
        for s in shape:
            n *= s
        part = buf[..., at:at + n]
        at += n
        part = part.contiguous().view(torch.int32) if dtype == torch.int32 else part
        out.append(part.reshape(*buf.shape[:-1], *shape))
    return out


def _neighbours_by_all_gather(blocks, cfg, later):
    """Each segment's row of blocks (rows, numel) handed to the segment after it (later) or before
    it in the global sequence, zeros at the sequence's ends: every rank gathers every segment's
    block and keeps its neighbours'. Returns (rows, numel)."""
    every = _all_gather(blocks, cfg.group) if cfg.world > 1 else blocks[None]
    glob = cfg.segs.gather_order(every, cfg.batch)                                 # (b, K, numel)
    zero = torch.zeros_like(glob[:, :1])
    glob = torch.cat([zero, glob[:, :-1]] if later else [glob[:, 1:], zero], dim=1)  # k gets k-1's (or k+1's)
    return cfg.segs.own(glob)


def _exchange_halo(xBC, seq_idx, cfg):
    """Each segment's conv halo: the last d_conv-1 pre-conv tokens of the segment before it in
    the global sequence (zeros before segment 0), and their document ids. xBC (rows, s, dim).
    Returns halo (rows, d-1, dim) and halo_seq (rows, d-1) int32 or None."""
    d1 = cfg.d_conv - 1
    tail = xBC[:, xBC.shape[1] - d1:]                                              # (rows, d-1, dim)
    parts = [tail]
    if seq_idx is not None:
        parts.append(seq_idx[:, seq_idx.shape[1] - d1:])
    buf = _pack(xBC.shape[0], *parts)                                              # (rows, numel)
    before = cfg.exchange.neighbours(buf, cfg, later=True)                         # (rows, numel)
    shapes = [((d1, xBC.shape[2]), torch.float32)] + ([((d1,), torch.int32)] if seq_idx is not None else [])
    halo, *halo_seq = _unpack(before, shapes)
    return halo.to(xBC.dtype), (halo_seq[0] if halo_seq else None)


def _return_halo_grad(dxBC, dhalo, cfg):
    """Send each halo's gradient back to the segment it came from, which adds it to the
    gradient of its last d_conv-1 tokens. dxBC (rows, s, dim) is updated in place."""
    d1 = cfg.d_conv - 1
    buf = dhalo.float().reshape(dhalo.shape[0], -1)
    after = cfg.exchange.neighbours(buf, cfg, later=False)                         # (rows, numel)
    own = after.reshape(dxBC.shape[0], d1, dxBC.shape[2])
    dxBC[:, dxBC.shape[1] - d1:] += own.to(dxBC.dtype)


def _document_flags(first, last):
    """cont (b, K) fp32: 0 where segment k starts a new document (its first id differs from segment
    k-1's last), 1 elsewhere and for segment 0 (initial_states reach the first document)."""
    cont = torch.ones(first.shape, device=first.device, dtype=torch.float32)
    cont[:, 1:] = (first[:, 1:] == last[:, :-1]).float()
    return cont


def _gather_summaries(S_ext, a, seq_idx, cfg):
    """Start the forward all-gather of every segment's summary: S_ext (rows, h, p, n), a
    (rows, h) and, with documents, its first and last document ids, packed in one fp32 buffer.
    Returns (buffer, work); work is None in a world of one."""
    parts = [S_ext, a] + ([seq_idx[:, :1], seq_idx[:, -1:]] if seq_idx is not None else [])
    buf = _pack(S_ext.shape[0], *parts)
    if cfg.world == 1:
        return buf[None], None
    return _all_gather(buf, cfg.group, async_op=True)


def _entries_from_gathered(every, initial_states, has_seq, cfg):
    """Finish forward state passing once the gather is done: the exclusive scan in global
    segment order. Returns this rank's segment entry states (rows, h, p, n), the final state of
    the whole sequence (b, h, p, n), and what backward needs: a and cont in global order."""
    h, p, n = cfg.state_shape
    shapes = [((h, p, n), torch.float32), ((h,), torch.float32)]
    shapes += [((1,), torch.int32), ((1,), torch.int32)] if has_seq else []
    S_all, a_all, *ids = _unpack(cfg.segs.gather_order(every, cfg.batch), shapes)  # (b, K, ...)
    cont = _document_flags(ids[0][..., 0], ids[1][..., 0]) if ids else None
    entries, final = scan_segments(S_all.contiguous(), a_all.contiguous(), initial_states, cont)
    return cfg.segs.own(entries), final, a_all.contiguous(), cont


def _gather_G(G, dfinal, cfg):
    """Start the backward all-gather: every segment's G (the pull of its own outputs on its
    entry state, (rows, h, p, n)) and each rank's gradient of its copy of the final state (the
    copies' gradients add up). Returns (buffer, work); work is None in a world of one."""
    if dfinal is None:
        dfinal = torch.zeros((cfg.batch, *G.shape[1:]), device=G.device)
    buf = torch.cat([G.reshape(-1), dfinal.float().reshape(-1)])
    if cfg.world == 1:
        return buf[None], None
    return _all_gather(buf, cfg.group, async_op=True)


def _exit_grads_from_gathered(every, a_all, cont, cfg):
    """Finish backward state passing once the gather is done: the reverse exclusive scan.
    Returns the gradient arriving at this rank's segment exits (rows, h, p, n) and that of
    initial_states (b, h, p, n)."""
    rows = cfg.batch * cfg.segs.per_row
    h, p, n = cfg.state_shape
    G_part, dfin = every[:, :rows * h * p * n], every[:, rows * h * p * n:]
    G_all = cfg.segs.gather_order(G_part.reshape(cfg.world, rows, h, p, n), cfg.batch)  # (b, K, h, p, n)
    dfinal = dfin.reshape(cfg.world, cfg.batch, h, p, n).sum(dim=0)
    dexit_all, dinit = scan_segments_bwd(G_all.contiguous(), a_all, dfinal, cont)
    return cfg.segs.own(dexit_all), dinit


class _AllGatherExchange:
    """summary_exchange="all_gather": every rank receives every segment's summary (and, in the
    backward, every G) and scans them itself. `meanwhile` is work that runs while the gather is
    in flight; its result comes back last. Part II adds the prefix scan over ranks (its
    _PrefixScanExchange has the same three methods) to EXCHANGES."""

    neighbours = staticmethod(_neighbours_by_all_gather)
    overlaps = True             # meanwhile runs while the gather is in flight

    @staticmethod
    def entry_states(S_ext, a, seq_idx, initial_states, cfg, meanwhile):
        """(entries (rows, h, p, n), final (b, h, p, n), a and cont as the backward needs them,
        meanwhile's result)."""
        every, work = _gather_summaries(S_ext, a, seq_idx, cfg)
        done = meanwhile()
        if work is not None:
            work.wait()
        return (*_entries_from_gathered(every, initial_states, seq_idx is not None, cfg), done)

    @staticmethod
    def exit_grads(G, dfinal, a_kept, cont, cfg, meanwhile):
        """(the gradient at this rank's segment exits (rows, h, p, n), that of initial_states
        (b, h, p, n), meanwhile's result)."""
        every, work = _gather_G(G, dfinal, cfg)
        done = meanwhile()
        if work is not None:
            work.wait()
        return (*_exit_grads_from_gathered(every, a_kept, cont, cfg), done)


EXCHANGES = {"all_gather": _AllGatherExchange}     # by summary_exchange name


# ---------------------------------------------------------------------------------------------
# 7. The causal conv1d
#    README walkthrough f. Each kernel is followed by its launcher.
#
# Depthwise causal conv1d + bias + SiLU with a halo, forward and backward.
#
#     out[b, t, c] = silu(bias[c] + sum_{k<d} weight[c, k] * u[b, t - (d-1) + k, c])
#
# u is the shard's pre-conv xBC, preceded by the halo: the last d-1 pre-conv tokens of the
# previous segment, received from their owner (zeros for the first segment). With seq_idx a tap
# whose token belongs to another document than token t contributes 0, in the halo too.
#
# Backward. g = dout * silu'(pre), with the pre-activation recomputed (it is as large as xBC, so
# it is not kept). With m_j(s) = 1 when s and s+j are in one document (the forward's tap mask):
#     du[s, c]        = sum_j weight[c, d-1-j] * m_j(s) g[s+j, c]
#     dweight[c, d-1-j] = sum_s u[s, c] * m_j(s) g[s+j, c]          dbias[c] = sum_t g[t, c]
# so one pass over rows s of [halo, xBC] gives all three; du at s < 0 is the halo's gradient,
# which the caller sends back to the halo's owner.
#
# Both kernels walk the rows in order, one row per step. A register tile cannot be shifted by
# rows, so what a row needs from its neighbours is carried from step to step instead: the u of
# the d-1 rows before it (the window) and, backward, the partial du of those rows, each of which
# row t's g adds its share to; the oldest is then complete and stored. So u and dout are loaded
# once and g computed once per row, except d-1 rows at each end of a run of rows: the window's
# fill before it, and the g past its end that complete its last du. A program walks one run of
# rows on a GPU (as many as registers allow in flight: a step loads several rows first), or many
# side by side as one tile in the interpreter, which pays per step. No atomics: dweight and dbias
# are per-(batch, program) partial sums, summed by torch in a fixed order.
#
# Offsets that multiply a batch, token or channel index by a stride are int64: sequences reach
# 2^20 tokens x 8k channels, and xBC may come in any layout.
# ---------------------------------------------------------------------------------------------


# Conv pieces: a program's channels and operands, document ids and u of a step's rows, the
# pre-activation. A kernel gathers its operands once into tuples: xs, u's rows (the shard, then
# the halo before it: row pointer, channel offsets, row stride of each); w, the channels' tap
# weights; seqs, the document ids of both.


@triton.jit
def _conv_program(x_ptr, stride_x, halo_ptr, stride_h, w_ptr, stride_w, bias_ptr, stride_bias, seq_ptr, stride_s,
                  hseq_ptr, stride_hs, dim, BC: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """This program's batch row bb and channels offs_c (int64, (BC,)) with their mask, and its
    operands: xs, w (a tuple of TAPS (1, BC) fp32 rows, tap 0, the oldest token, first), bias
    ((BC,) fp32, zeros without one), seqs."""
    bb = tl.program_id(2).to(tl.int64)
    offs_c = (tl.program_id(1) * BC + tl.arange(0, BC)).to(tl.int64)
    mask_c = offs_c < dim
    xs = (x_ptr + bb * stride_x.b, offs_c * stride_x.c, stride_x.l, halo_ptr + bb * stride_h.b,
          offs_c * stride_h.c, stride_h.l)
    w = ()
    for k in tl.static_range(TAPS):
        wk = tl.load(w_ptr + offs_c * stride_w.c + k * stride_w.k, mask=mask_c, other=0.0).to(tl.float32)
        w = w + (wk[None, :],)
    bias = tl.zeros((BC,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c * stride_bias, mask=mask_c, other=0.0).to(tl.float32)
    seqs = (seq_ptr + bb * stride_s.b, stride_s.l, hseq_ptr + bb * stride_hs.b, stride_hs.l)
    return bb, offs_c, mask_c, xs, w, bias, seqs


@triton.jit
def _doc(seqs, t, seqlen, HALO: tl.constexpr, HAS_HALO_SEQ: tl.constexpr):
    """Document id (M,) int64 of token rows t (M,); -1 where there is none (those rows hold zeros)."""
    s_row0, stride_s_l, hs_row0, stride_hs_l = seqs
    r = t.to(tl.int64)
    doc = tl.load(s_row0 + r * stride_s_l, mask=(t >= 0) & (t < seqlen), other=-1)
    if HAS_HALO_SEQ:
        in_h = (t < 0) & (t >= -HALO)
        doc = tl.where(in_h, tl.load(hs_row0 + (r + HALO) * stride_hs_l, mask=in_h, other=-1), doc)
    return doc.to(tl.int64)


@triton.jit
def _u_rows(xs, t, mask_c, seqlen, HALO: tl.constexpr, HAS_HALO: tl.constexpr):
    """u at token rows t (M,) as an (M, BC) fp32 tile, zero outside [-HALO, seqlen). Rows < 0
    come from the halo."""
    x_row0, x_col, stride_x_l, h_row0, h_col, stride_h_l = xs
    r = t.to(tl.int64)
    in_x = (t >= 0) & (t < seqlen)
    u = tl.load(x_row0 + r[:, None] * stride_x_l + x_col[None, :],
                mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    if HAS_HALO:   # a second masked load, not a branch: a branch would keep the loads apart
        in_h = (t < 0) & (t >= -HALO)
        u += tl.load(h_row0 + (r + HALO)[:, None] * stride_h_l + h_col[None, :],
                     mask=in_h[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    return u


@triton.jit
def _preact(w, bias, win, docs, u, doc, TAPS: tl.constexpr, HAS_SEQ: tl.constexpr):
    """Pre-activation (M, BC) of rows t: bias + sum_k w_k u[t-(TAPS-1)+k], from the window
    (u and ids of rows t-TAPS+1 .. t-1) and row t itself; a tap from another document dropped."""
    acc = bias[None, :] + w[TAPS - 1] * u
    for k in tl.static_range(TAPS - 1):
        uk = win[k]
        if HAS_SEQ:
            uk = tl.where((docs[k] == doc)[:, None], uk, 0.0)
        acc += w[k] * uk
    return acc


@triton.jit
def _conv_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, halo_ptr, seq_ptr, hseq_ptr, out_ptr,
    seqlen, dim, S, stride_x, stride_w, stride_bias, stride_h, stride_s, stride_hs, stride_o,
    TAPS: tl.constexpr, M: tl.constexpr, BC: tl.constexpr, U: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr,
    SILU: tl.constexpr,
):
    """M runs of S output rows each (this program's), BC channels, one batch row: out =
    silu(pre-activation), or the pre-activation itself without SILU. A step loads U rows of
    every run, then convolves them one by one with the window of the d-1 rows before."""
    bb, offs_c, mask_c, xs, w, bias, seqs = _conv_program(
        x_ptr, stride_x, halo_ptr, stride_h, w_ptr, stride_w, bias_ptr, stride_bias, seq_ptr, stride_s, hseq_ptr,
        stride_hs, dim, BC, TAPS, HAS_BIAS)
    o_row0, o_col = out_ptr + bb * stride_o.b, offs_c * stride_o.c
    first = (tl.program_id(0) * M + tl.arange(0, M)) * S       # (M,) each run's first row
    win = (tl.zeros((M, BC), dtype=tl.float32),) * (TAPS - 1)  # u of the TAPS-1 rows before
    docs = (tl.full((M,), -1, tl.int64),) * (TAPS - 1)           # and their documents
    for i0 in range(-(TAPS - 1), S, U):     # the first TAPS-1 steps only fill the window
        ahead = ()
        for k in tl.static_range(U):
            t = first + (i0 + k)
            doc = _doc(seqs, t, seqlen, TAPS - 1, HAS_HALO_SEQ) if HAS_SEQ else t.to(tl.int64)
            ahead = ahead + ((_u_rows(xs, t, mask_c, seqlen, TAPS - 1, HAS_HALO), doc),)
        for k in tl.static_range(U):
            t = first + (i0 + k)
            u, doc = ahead[k]
            p = _preact(w, bias, win, docs, u, doc, TAPS, HAS_SEQ)              # (M, BC)
            out = p * tl.sigmoid(p) if SILU else p
            tl.store(o_row0 + t.to(tl.int64)[:, None] * stride_o.l + o_col[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=((t >= first) & (t < first + S) & (t < seqlen))[:, None] & mask_c[None, :])
            win = win[1:] + (u,)
            docs = docs[1:] + (doc,)


def _conv_flags(bias, halo, seq_idx, silu):
    has_seq = seq_idx is not None
    return dict(HAS_BIAS=bias is not None, HAS_HALO=halo is not None, HAS_SEQ=has_seq,
                HAS_HALO_SEQ=has_seq and halo is not None, SILU=bool(silu))  # without a halo its ids don't matter


def _conv_runs(rows, dim, launch):
    """(runs M, rows per run S, channels BC, programs per batch row) of a conv launch over `rows`
    token rows: the tuning's, no larger than the tensor needs."""
    M, BC = launch.runs, min(launch.channels, max(16, _next_pow2(dim)))
    S = max(1, min(launch.rows, _cdiv(rows, M)))
    return M, S, BC, _cdiv(rows, M * S)


def _conv1d_fwd(xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, out=None, silu=True):
    """silu(causal depthwise conv(xBC) + bias), (b, l, dim) in xBC's dtype, or written into out.
    The arguments as conv1d_fwd (section 11) takes and checks them."""
    (b, l, dim), d = xBC.shape, weight.shape[1]
    flags = _conv_flags(bias, halo, seq_idx, silu)
    halo_seq = halo_seq.to(seq_idx.dtype) if flags["HAS_HALO_SEQ"] else None   # one id type in the kernel
    if out is None:
        out = torch.empty((b, l, dim), device=xBC.device, dtype=xBC.dtype)
    launch = tuning().conv_fwd
    M, S, BC, n_t = _conv_runs(l, dim, launch)
    _conv_fwd_kernel[(n_t, _cdiv(dim, BC), b)](
        xBC, weight, _stand_in(bias, xBC), _stand_in(halo, xBC), _stand_in(seq_idx, xBC), _stand_in(halo_seq, xBC),
        out, l, dim, S, _BLC(*xBC.stride()), _CK(*weight.stride()), 0 if bias is None else bias.stride(0),
        _strides_of(halo, _BLC), _strides_of(seq_idx, _BL), _strides_of(halo_seq, _BL), _BLC(*out.stride()),
        TAPS=d, M=M, BC=BC, U=launch.unroll, num_warps=launch.warps, **flags)
    return out


@triton.jit
def _conv_bwd_kernel(
    dout_ptr, x_ptr, w_ptr, bias_ptr, halo_ptr, seq_ptr, hseq_ptr,
    dx_ptr, dhalo_ptr, dw_part_ptr, db_part_ptr,
    seqlen, dim, S, stride_do, stride_x, stride_w, stride_bias, stride_h, stride_s, stride_hs, stride_dx,
    TAPS: tl.constexpr, M: tl.constexpr, BC: tl.constexpr, U: tl.constexpr, SHIFT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr,
    NEED_DHALO: tl.constexpr, SILU: tl.constexpr,
):
    """M runs of S du rows each (this program's) of rows s of [halo, xBC] (from s = -SHIFT;
    SHIFT is TAPS-1 with a halo), BC channels, one batch row: du per row (into dx, or dhalo for
    s < 0), and dweight, dbias of the g rows it owns summed into this program's partial slot.
    dhalo (b, TAPS-1, dim), the partials (b, programs, TAPS, dim) and (b, programs, dim) are
    contiguous.

    Step t computes g[t] and hands its share to the du of rows t-TAPS+1 .. t: the oldest of them
    is then complete and stored, the others stay partial in registers (`part`). A run's steps
    go from TAPS-1 rows before its first du row (to fill the window) to TAPS-1 rows past its
    last (whose g complete it); those extra g rows count in the next run's dweight."""
    bb, offs_c, mask_c, xs, w, bias, seqs = _conv_program(
        x_ptr, stride_x, halo_ptr, stride_h, w_ptr, stride_w, bias_ptr, stride_bias, seq_ptr, stride_s, hseq_ptr,
        stride_hs, dim, BC, TAPS, HAS_BIAS)
    do_row0, do_col = dout_ptr + bb * stride_do.b, offs_c * stride_do.c
    dx_row0, dx_col = dx_ptr + bb * stride_dx.b, offs_c * stride_dx.c

    first = (tl.program_id(0) * M + tl.arange(0, M)) * S - SHIFT   # (M,) each run's first du row
    zero = tl.zeros((M, BC), dtype=tl.float32)
    win = (zero,) * (TAPS - 1)                          # u of rows t-TAPS+1 .. t-1
    docs = (tl.full((M,), -1, tl.int64),) * (TAPS - 1)  # their documents
    part = (zero,) * (TAPS - 1)                         # du of rows t-TAPS+1 .. t-1, so far
    dw = (zero,) * TAPS                                 # dweight per tap, per run
    db = zero
    for i0 in range(-(TAPS - 1), S + TAPS - 1, U):
        ahead = ()
        for k in tl.static_range(U):
            t = first + (i0 + k)
            has_g = (t >= first) & (t >= 0) & (t < seqlen)      # g = 0 off [0, seqlen) and before the window fills
            do = tl.load(do_row0 + t.to(tl.int64)[:, None] * stride_do.l + do_col[None, :],
                         mask=has_g[:, None] & mask_c[None, :], other=0.0)
            doc = _doc(seqs, t, seqlen, TAPS - 1, HAS_HALO_SEQ) if HAS_SEQ else t.to(tl.int64)
            ahead = ahead + ((_u_rows(xs, t, mask_c, seqlen, TAPS - 1, HAS_HALO), do, doc),)
        for k in tl.static_range(U):
            t = first + (i0 + k)
            u, do, doc = ahead[k]
            g = do.to(tl.float32)
            if SILU:
                p = _preact(w, bias, win, docs, u, doc, TAPS, HAS_SEQ)
                sig = tl.sigmoid(p)
                g = g * sig * (1.0 + p * (1.0 - sig))     # silu'(p) = sig(p) (1 + p (1 - sig(p)))
            # g[t]'s share of du at row t-TAPS+1+j (weight j): zero across a document boundary
            share = ()
            for j in tl.static_range(TAPS - 1):
                gj = tl.where((docs[j] == doc)[:, None], g, 0.0) if HAS_SEQ else g
                share = share + (gj,)
            s = t - (TAPS - 1)                                  # the du row g[t] completes
            du = part[0] + w[0] * share[0]
            keep = (s >= first) & (s < first + S) & (s < seqlen)
            tl.store(dx_row0 + s.to(tl.int64)[:, None] * stride_dx.l + dx_col[None, :], du.to(dx_ptr.dtype.element_ty),
                     mask=(keep & (s >= 0))[:, None] & mask_c[None, :])
            if NEED_DHALO:
                tl.store(dhalo_ptr + (bb * (TAPS - 1) + s.to(tl.int64) + (TAPS - 1))[:, None] * dim + offs_c[None, :],
                         du, mask=(keep & (s < 0))[:, None] & mask_c[None, :])
            nxt = ()
            for j in tl.static_range(1, TAPS - 1):
                nxt = nxt + (part[j] + w[j] * share[j],)
            part = nxt + (w[TAPS - 1] * g,)
            # dweight and dbias count the g rows this run owns
            own = ((t >= first) & (t < first + S))[:, None]
            sums = ()
            for j in tl.static_range(TAPS - 1):
                sums = sums + (dw[j] + tl.where(own, win[j] * share[j], 0.0),)
            dw = sums + (dw[TAPS - 1] + tl.where(own, u * g, 0.0),)
            db += tl.where(own, g, 0.0)
            win = win[1:] + (u,)
            docs = docs[1:] + (doc,)

    prow = bb * tl.num_programs(0) + tl.program_id(0)              # this program's partial row
    for j in tl.static_range(TAPS):
        tl.store(dw_part_ptr + (prow * TAPS + j) * dim + offs_c, tl.sum(dw[j], axis=0), mask=mask_c)
    if HAS_BIAS:
        tl.store(db_part_ptr + prow * dim + offs_c, tl.sum(db, axis=0), mask=mask_c)


def _conv1d_bwd(dout, xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, need_dhalo=True, silu=True,
                dx=None):
    """Gradients of _conv1d_fwd: (dxBC, dhalo, dweight, dbias), as conv1d_bwd (section 11) says."""
    (b, l, dim), d = xBC.shape, weight.shape[1]
    flags = _conv_flags(bias, halo, seq_idx, silu)
    halo_seq = halo_seq.to(seq_idx.dtype) if flags["HAS_HALO_SEQ"] else None   # one id type in the kernel
    need_dhalo = bool(need_dhalo) and halo is not None
    shift = d - 1 if halo is not None else 0    # du rows start at the halo's
    launch = tuning().conv_bwd
    M, S, BC, n_t = _conv_runs(shift + l, dim, launch)

    if dx is None:
        dx = torch.empty((b, l, dim), device=xBC.device, dtype=xBC.dtype)
    dhalo = torch.empty((b, d - 1, dim), device=xBC.device, dtype=torch.float32) if need_dhalo else None
    dw_part = torch.empty((b, n_t, d, dim), device=xBC.device, dtype=torch.float32)
    db_part = torch.empty((b, n_t, dim), device=xBC.device, dtype=torch.float32) if bias is not None else None
    _conv_bwd_kernel[(n_t, _cdiv(dim, BC), b)](
        dout, xBC, weight, _stand_in(bias, xBC), _stand_in(halo, xBC), _stand_in(seq_idx, xBC),
        _stand_in(halo_seq, xBC),
        dx, _stand_in(dhalo, dw_part), dw_part, _stand_in(db_part, dw_part),
        l, dim, S, _BLC(*dout.stride()), _BLC(*xBC.stride()), _CK(*weight.stride()),
        0 if bias is None else bias.stride(0), _strides_of(halo, _BLC), _strides_of(seq_idx, _BL),
        _strides_of(halo_seq, _BL), _BLC(*dx.stride()),
        TAPS=d, M=M, BC=BC, U=launch.unroll, SHIFT=shift, NEED_DHALO=need_dhalo, num_warps=launch.warps, **flags)
    dweight = dw_part.sum(dim=(0, 1)).t().contiguous()                          # (dim, d)
    dbias = db_part.sum(dim=(0, 1)) if bias is not None else None               # (dim,)
    return dx, dhalo, dweight, dbias


# ---------------------------------------------------------------------------------------------
# 8. The fused Conv1d + SSD with state-passing CP
#    Plain functions for the forward and the backward, and one autograd function over them.
# ---------------------------------------------------------------------------------------------


def _none_if_empty(t):
    return None if t is None or t.numel() == 0 else t


def _conv_channels(xBC, conv_weight, conv_bias, halo, seq_idx, halo_seq, ch, silu):
    """The conv of channels `ch` (a slice) alone, (rows, s, channels)."""
    return _conv1d_fwd(xBC[..., ch], conv_weight[ch], None if conv_bias is None else conv_bias[ch],
                      None if halo is None else halo[..., ch], seq_idx, halo_seq, silu=silu)


def _split_xBC(u, cfg):
    """Views of the conv output (rows, s, conv_dim) as x (rows, s, h, p), B and C (rows, s, g, n)."""
    rows, s, _ = u.shape
    hp, gn = cfg.nheads * cfg.headdim, cfg.ngroups * cfg.dstate
    x = u[..., :hp].unflatten(-1, (cfg.nheads, cfg.headdim))
    B = u[..., hp:hp + gn].unflatten(-1, (cfg.ngroups, cfg.dstate))
    C = u[..., hp + gn:].unflatten(-1, (cfg.ngroups, cfg.dstate))
    return x, B, C


def _state_shape(xBC, dt, headdim, ngroups):
    """(h, p, n) of the state, from xBC (rows, s, h*p + 2*g*n) and dt (rows, s, h)."""
    h = dt.shape[2]
    return h, headdim, (xBC.shape[2] - h * headdim) // (2 * ngroups)


class _CPConfig:
    """What the CP function derives once per call from its arguments and the group."""

    def __init__(self, xBC, dt, conv_weight, chunk_size, headdim, ngroups, cp_group, rank, world,
                 load_balancing, dt_limit, batch=None, exchange="all_gather"):
        self.group, self.rank, self.world = cp_group, rank, world
        self.load_balancing = load_balancing
        self.exchange = EXCHANGES[exchange]         # how the summaries and halos travel
        self.segs = _Segments(rank, world, load_balancing)
        self.holds_first = 0 in self.segs.ids
        self.batch = xBC.shape[0] if batch is None else batch
        self.d_conv = conv_weight.shape[1]
        self.chunk = chunk_size
        self.nheads, self.headdim, self.ngroups = dt.shape[2], headdim, ngroups
        self.state_shape = _state_shape(xBC, dt, headdim, ngroups)
        self.dstate = self.state_shape[2]
        self.dt_limit = tuple(dt_limit)


def _rank_and_world(group):
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _cp_config(xBC, dt, conv_weight, group_name, load_balancing, exchange, batch, chunk_size, headdim, ngroups,
               dt_limit):
    """The _CPConfig of a call of the plain functions below: xBC and dt hold one segment per row."""
    group = _resolve_group(group_name)
    rank, world = _rank_and_world(group)
    return _CPConfig(xBC, dt, conv_weight, chunk_size, headdim, ngroups, group, rank, world, load_balancing,
                     dt_limit, batch=batch, exchange=exchange)


def _conv1d_ssd_cp_forward(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, group_name,
                           load_balancing, exchange, batch, chunk_size, headdim, ngroups, dt_min, dt_max, silu,
                           state_dtype):
    """Forward of one causal segment per row: xBC (rows, s, conv_dim), dt (rows, s, h), seq_idx
    (rows, s). Returns [y, final state, and what backward needs: halo, halo_seq, entries, a_kept,
    cont] (absent ones empty, so that an op can return the list): a and cont of every segment
    (b, K, h) and (b, K) with the all-gather exchange, of this rank's (rows, h) and (rows,) with
    the scan.

    Halo exchange, conv of the x and B channels, the state pass from a zero entry (the segment's
    summary), the summary exchange (overlapped with the conv of the C channels, which the
    summary does not need; in a world of one all channels are convolved at once) and exclusive
    scan (true entry states and the global final state), the outputs with the entry state folded
    in. Nothing kept for backward grows with length beyond the inputs."""
    cfg = _cp_config(xBC, dt, conv_weight, group_name, load_balancing, exchange, batch, chunk_size, headdim, ngroups,
                     (dt_min, dt_max))
    # a single segment in all (a world of one, contiguous) has nothing before it: no halo,
    # which spares every conv step the halo's masked loads
    halo, halo_seq = _exchange_halo(xBC, seq_idx, cfg) if cfg.segs.count > 1 else (None, None)
    x_ch, B_ch = cfg.nheads * cfg.headdim, cfg.ngroups * cfg.dstate
    overlap = cfg.world > 1 and cfg.exchange.overlaps
    if overlap:   # the summaries need x and B only: C's conv runs while they travel
        uxB = _conv_channels(xBC, conv_weight, conv_bias, halo, seq_idx, halo_seq, slice(0, x_ch + B_ch), silu)
        x = uxB[..., :x_ch].unflatten(-1, (cfg.nheads, cfg.headdim))
        B = uxB[..., x_ch:].unflatten(-1, (cfg.ngroups, cfg.dstate))
    else:
        u = _conv1d_fwd(xBC, conv_weight, conv_bias, halo, seq_idx, halo_seq, silu=silu)  # (rows, s, conv_dim)
        x, B, C = _split_xBC(u, cfg)
    plan = _LaunchPlan(x, B, min(cfg.chunk, tuning().chunk_fwd), dt_bias, True, cfg.dt_limit, seq_idx, state_dtype)
    inp = _SSDInputs(x, dt, A, B, None if overlap else C, D, dt_bias, seq_idx)
    summary = Summary(inp, plan)
    S_ext, a = summary.affine()                                                 # (rows, h, p, n), (rows, h)

    def conv_of_C():
        return _conv_channels(xBC, conv_weight, conv_bias, halo, seq_idx, halo_seq, slice(x_ch + B_ch, None), silu)
    entries, final, a_kept, cont, C_late = cfg.exchange.entry_states(S_ext, a, seq_idx, initial_states, cfg,
                                                                     conv_of_C if overlap else lambda: None)
    if overlap:
        inp = inp._replace(C=C_late.unflatten(-1, (cfg.ngroups, cfg.dstate)))
    y, _ = ssd_output(inp, summary, entries)
    f32 = dict(device=xBC.device, dtype=torch.float32)
    rows = xBC.shape[0]
    return [y, final, xBC.new_empty((rows, 0, xBC.shape[2])) if halo is None else halo.clone(),
            torch.empty((rows, 0) if seq_idx is not None else 0, device=xBC.device, dtype=torch.int32)
            if halo_seq is None else halo_seq.clone(),
            entries.contiguous(), a_kept.clone(), torch.empty(0, **f32) if cont is None else cont]


def _conv1d_ssd_cp_backward(dy, dfinal, xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx,
                            halo, halo_seq, entries, a_kept, cont, group_name, load_balancing, exchange, batch,
                            chunk_size, headdim, ngroups, dt_min, dt_max, silu, state_dtype, dxBC_into=None,
                            ddt_into=None):
    """The backward: [dxBC, ddt, dconv_weight, dconv_bias, ddt_bias, dA, dD,
    dinitial_states], None where absent. Given dxBC_into (rows, s, conv_dim) and ddt_into (rows,
    s, h), views into the caller's gradient buffer, dxBC and ddt are written there.

    Recompute the conv; the reverse state pass from a zero exit gradient gives G; its all-gather
    runs while the forward state pass is recomputed; the reverse scan gives each segment's exit
    gradient; one fused chunk backward writes dx, dB, dC straight into the conv backward's input;
    the halo's gradient goes back to its owner."""
    cfg = _cp_config(xBC, dt, conv_weight, group_name, load_balancing, exchange, batch, chunk_size, headdim, ngroups,
                     (dt_min, dt_max))
    halo, halo_seq, cont = _none_if_empty(halo), _none_if_empty(halo_seq), _none_if_empty(cont)
    u = _conv1d_fwd(xBC, conv_weight, conv_bias, halo, seq_idx, halo_seq, silu=silu)
    x, B, C = _split_xBC(u, cfg)
    plan = _LaunchPlan(x, B, min(cfg.chunk, tuning().chunk_bwd), dt_bias, True, cfg.dt_limit, seq_idx, state_dtype)
    inp = _SSDInputs(x, dt, A, B, C, D, dt_bias, seq_idx)
    grad_pass = GradPass(dy, inp, plan)
    dexit, dinit, summary = cfg.exchange.exit_grads(grad_pass.G, dfinal, a_kept, cont, cfg,
                                                    lambda: Summary(inp, plan))

    du = torch.empty_like(u)
    dx, dB, dC = _split_xBC(du, cfg)
    _, _, _, ddt, dA, dD, _ = ssd_grads(inp, summary, grad_pass, dy, entries, dexit, dx=dx, dB=dB, dC=dC)  # ddt fp32
    dxBC, dhalo, dweight, dbias = _conv1d_bwd(du, xBC, conv_weight, conv_bias, halo, seq_idx, halo_seq, silu=silu,
                                             dx=dxBC_into)
    if dhalo is not None:
        _return_halo_grad(dxBC, dhalo, cfg)
    dinit = dinit if cfg.holds_first else torch.zeros_like(dinit)               # one rank contributes it
    return [dxBC, ddt.to(dt.dtype) if ddt_into is None else ddt_into.copy_(ddt), dweight.to(conv_weight.dtype),
            None if conv_bias is None else dbias.to(conv_bias.dtype),
            None if dt_bias is None else ddt.sum(dim=(0, 1)).to(dt_bias.dtype), dA.to(A.dtype),
            None if D is None else dD.to(D.dtype), None if initial_states is None else dinit.to(initial_states.dtype)]


class _CoreOptions(NamedTuple):
    """The fused core's scalar options; core_args puts them, with the group and the exchange, in
    the order that ends the argument lists of _conv1d_ssd_cp_forward and its backward."""
    batch: int
    chunk: int
    headdim: int
    ngroups: int
    dt_min: float
    dt_max: float
    silu: bool

    def core_args(self, group_name, load_balancing, exchange, state_dtype):
        return (group_name, load_balancing, exchange, self.batch, self.chunk, self.headdim, self.ngroups, self.dt_min,
                self.dt_max, self.silu, state_dtype)


class _CoreImpl(NamedTuple):
    """What runs the forward and the backward: the plain functions above (_PLAIN), or Part II's
    custom ops around the same functions (for torch.compile)."""
    forward: Callable
    backward: Callable


_PLAIN = _CoreImpl(_conv1d_ssd_cp_forward, _conv1d_ssd_cp_backward)


class _Conv1dSSDCPFn(torch.autograd.Function):
    """The fused conv1d + SSD with state-passing CP, one causal segment per row."""

    @staticmethod
    def forward(ctx, xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, opts, impl):
        """opts: _CoreOptions.core_args."""
        y, final, *kept = impl.forward(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, *opts)
        ctx.save_for_backward(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, *kept)
        ctx.opts, ctx.impl = opts, impl
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        grads = ctx.impl.backward(dy, dfinal, *ctx.saved_tensors, *ctx.opts)
        return (*(_none_if_empty(g) for g in grads), None, None, None)


def _conv1d_ssd_cp(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups, cp_group,
                   load_balancing="none", seq_idx=None, initial_states=None, dt_limit=(0.0, float("inf")), silu=True,
                   state_dtype=None, exchange="all_gather", impl=_PLAIN):
    """The method end to end: y (b, l_local, h, p) in the layout `load_balancing` ("none" or
    "virtual") and the fp32 final state (b, h, p, n), differentiable. The local tensors become
    rows of causal segments for the autograd function and come back. mamba_conv1d_ssd_cp
    (section 13) is this with its inputs checked on every rank, the exchange chosen, the permute
    layouts, and the compile layer's ops as impl."""
    rank, world = _rank_and_world(cp_group)
    cfg = _CPConfig(xBC, dt, conv_weight, chunk_size, headdim, ngroups, cp_group, rank, world, load_balancing,
                    dt_limit)
    rows = cfg.segs.to_rows
    core = _CoreOptions(cfg.batch, chunk_size, headdim, ngroups, dt_limit[0], dt_limit[1], silu)
    y, final = _Conv1dSSDCPFn.apply(
        rows(xBC), rows(dt), conv_weight, conv_bias, dt_bias, A, D, initial_states,
        None if seq_idx is None else rows(seq_idx.to(torch.int32)).contiguous(),
        core.core_args(_group_name(cp_group), load_balancing, exchange, state_dtype), impl)
    return cfg.segs.from_rows(y, cfg.batch), final


# ---------------------------------------------------------------------------------------------
# 9. A worked example
#    `python mamba_cp.py` runs two gloo ranks on this machine over a handful of tokens and
#    prints each step of state passing, checked against the float64 oracle.
# ---------------------------------------------------------------------------------------------


def _worked_example(rank, world, port):
    import reference_ssd  # the oracle lives beside this file in the repository

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_printoptions(precision=4, sci_mode=False)
    say = (lambda *a: print(f"[rank {rank}]", *a, flush=True))
    g = torch.Generator().manual_seed(0)
    b, L, h, p, n, d_conv = 1, 12, 1, 2, 2, 2                       # one head: x (p=2), state 2x2
    conv_dim = h * p + 2 * n
    xBC = torch.randn(b, L, conv_dim, generator=g)
    dt = torch.randn(b, L, h, generator=g) - 1.0
    w, bias = torch.randn(conv_dim, d_conv, generator=g) * 0.5, torch.zeros(conv_dim)
    dt_bias, A, D = torch.zeros(h), -torch.ones(h), torch.ones(h)
    cfg = _CPConfig(xBC, dt, w, 16, p, 1, dist.group.WORLD, rank, world, "none", (0.0, float("inf")))
    x_loc, dt_loc = shard(xBC, rank, world), shard(dt, rank, world)    # 6 tokens each

    # 1. the conv, fed by the halo: the last d_conv - 1 pre-conv tokens of the previous rank
    halo, _ = _exchange_halo(x_loc, None, cfg)
    u = _conv1d_fwd(x_loc, w, bias, halo)
    x, B, C = _split_xBC(u, cfg)
    # 2. this rank's summary, from a zero entry state: S_out = a * S_in + S_ext
    plan = _LaunchPlan(x, B, 16, dt_bias, True, (0.0, float("inf")), None)
    inp = _SSDInputs(x, dt_loc, A, B, C, D, dt_bias, None)
    summary = Summary(inp, plan)
    S_ext, a = summary.affine()
    say(f"summary: a = {a.flatten().tolist()}, S_ext =\n{S_ext[0, 0]}")
    # 3. all-gather the summaries and scan: S_in(0) = 0, S_in(1) = a_0 S_in(0) + S_ext(0)
    every, work = _gather_summaries(S_ext, a, None, cfg)
    work.wait()
    entries, final, _, _ = _entries_from_gathered(every, None, False, cfg)
    say(f"entry state after the scan =\n{entries[0, 0]}")
    # 4. the outputs with the entry state folded in, against the oracle on the whole sequence
    y, _ = ssd_output(inp, summary, entries)
    y_ref, final_ref = reference_ssd.conv1d_ssd_reference(xBC, dt, w, bias, dt_bias, A, D, headdim=p, ngroups=1)
    err = (y - shard(y_ref, rank, world)).abs().max().item()
    say(f"y (this rank's 6 tokens) = {y.flatten(1).tolist()[0][:4]}...; max |y - oracle| = {err:.1e}; "
        f"max |final - oracle| = {(final - final_ref).abs().max().item():.1e}")
    # 5. the fused function does all of the above (and the backward); mamba_conv1d_ssd_cp is it with
    #    the production extras of Part II
    y_fused, _ = _conv1d_ssd_cp(x_loc, dt_loc, w, bias, dt_bias, A, D, 16, p, 1, dist.group.WORLD)
    say(f"_conv1d_ssd_cp gives the same y: {torch.equal(y_fused, y)}")
    dist.destroy_process_group()


# =============================================================================================
# PART II. THE EXTRAS
# Sections 10 to 17: what production adds. Each depends on Part I only, never the reverse.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# 10. The prefix-scan exchange and the model that chooses
#    summary_exchange="scan" and "auto".
# ---------------------------------------------------------------------------------------------


def _global_rank(group, r):
    """Rank r of the group as point-to-point calls and broadcast sources name it."""
    return r if group is None else dist.get_global_rank(group, r)


def _send(t, to, group):
    """An isend of t to rank `to` of the group, for _run_p2p."""
    return dist.P2POp(dist.isend, t, _global_rank(group, to), group)


def _recv(t, frm, group):
    """An irecv into t from rank `frm` of the group, for _run_p2p."""
    return dist.P2POp(dist.irecv, t, _global_rank(group, frm), group)


def _run_p2p(ops):
    """Post point-to-point operations together (a rank sends what the others receive) and wait."""
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


# The summaries by prefix scan over ranks (summary_exchange="scan"). The all-gather above hands
# every rank all K summaries: (W-1) * per_row of them received per rank, which grows with W.
# The composition of summaries is associative, so a rank can instead form the composition of
# everything before its segments in ceil(log2 W) rounds of one point-to-point message per
# chain (Kogge-Stone), and receive the totals it needs by broadcast. The conv halo then comes
# from the neighbouring segment alone. Nothing a rank receives grows with W beyond log2 W
# summaries; the rounds cost latency, which is why "auto" (below) keeps the all-gather for
# small worlds.

class _RunMap(NamedTuple):
    """The affine map E -> a * E + S that a run of consecutive segments applies to the state
    entering it, per batch row: a (b, h), S (b, h, p, n) fp32. first and last (b,) int32: the
    document ids at the run's two ends (None without documents); the run carries the state in
    only where its first id is the last id before it."""
    a: Tensor
    S: Tensor
    first: Optional[Tensor] = None
    last: Optional[Tensor] = None


def _then(earlier, later):
    """The map of `earlier` followed by `later`, (a2, S2) o (a1, S1) = (a2 c a1, a2 c S1 + S2),
    where c = 0 for the rows whose state does not continue (later starts a new document)."""
    a2 = later.a
    if later.first is not None:
        a2 = a2 * (later.first == earlier.last).to(a2.dtype)[:, None]
    return _RunMap(a2 * earlier.a, a2[..., None, None] * earlier.S + later.S, earlier.first, later.last)


def _applied(m, E):
    """m applied to the state E (b, h, p, n) entering it (E None: zero)."""
    return m.S if E is None else m.a[..., None, None] * E + m.S


def _packed_map(m):
    return _pack(m.a.shape[0], *(t for t in m if t is not None))


def _unpacked_map(buf, like):
    fields = [t for t in like if t is not None]
    parts = iter(_unpack(buf, [(tuple(t.shape[1:]), t.dtype) for t in fields]))
    return _RunMap(*(None if t is None else next(parts) for t in like))


def _prefix_over_ranks(chains, cfg):
    """Exclusive and inclusive prefix compositions along chains of ranks. chains: a list of
    (this rank's map, order), order listing every rank of the group in chain order; two chains
    run in opposite directions, so no two messages of a round share sender and receiver. In
    round d each rank sends its inclusive prefix d places down its chain and composes in what
    arrives from d places up: ceil(log2 W) rounds. Returns [exclusive (None at the chain's
    head), inclusive] per chain."""
    me, world, group = cfg.rank, cfg.world, cfg.group
    state = [[None, m] for m, _ in chains]
    d = 1
    while d < world:
        ops, landing = [], []
        for i, (_, order) in enumerate(chains):
            pos = order.index(me)
            sent = _packed_map(state[i][1])
            if pos + d < world:
                ops.append(_send(sent, order[pos + d], group))
            if pos - d >= 0:
                landing.append((i, torch.empty_like(sent)))
                ops.append(_recv(landing[-1][1], order[pos - d], group))
        _run_p2p(ops)
        for i, buf in landing:
            got = _unpacked_map(buf, state[i][1])
            excl, incl = state[i]
            state[i] = [got if excl is None else _then(got, excl), _then(got, incl)]
        d *= 2
    return state


def _broadcast_map(m, src, cfg):
    """The map held by rank src, on every rank (m: this rank's, of the same shapes)."""
    if cfg.world == 1:
        return m
    buf = _packed_map(m)
    dist.broadcast(buf, _global_rank(cfg.group, src), group=cfg.group)
    return _unpacked_map(buf, m)


def _own_maps(a, S, seq_idx, cfg):
    """This rank's segment maps by local index j: (rows, ...) tensors as per_row (b, ...) maps."""
    per = cfg.segs.per_row

    def j_of(t, j):
        return None if t is None else t.reshape(cfg.batch, per, *t.shape[1:])[:, j]

    first, last = (None, None) if seq_idx is None else (seq_idx[:, 0], seq_idx[:, -1])
    return [_RunMap(j_of(a, j), j_of(S, j), j_of(first, j), j_of(last, j)) for j in range(per)]


def _chains(cfg, backward):
    """Rank orders of the chains, by local segment index: "none" runs one chain over the ranks
    in order; "virtual" a second one back down, for the second halves (segment 2W-1-r on rank
    r). The backward walks each the other way, second halves first."""
    up, down = list(range(cfg.world)), list(range(cfg.world - 1, -1, -1))
    if cfg.segs.per_row == 1:
        return [down if backward else up]
    return [down, up] if backward else [up, down]


def _rows(per_segment, cfg):
    """Per-local-segment (b, ...) tensors as (rows, ...), rows in (batch, segment) order."""
    return torch.stack(per_segment, dim=1).reshape(cfg.batch * len(per_segment), *per_segment[0].shape[1:])


def _entries_by_prefix_scan(S_ext, a, seq_idx, initial_states, cfg):
    """Forward state passing by prefix scan. S_ext (rows, h, p, n) and a (rows, h) this rank's
    summaries, seq_idx (rows, s) or None. Returns the entry states of this rank's segments
    (rows, h, p, n), the final state of the whole sequence (b, h, p, n), identical on every
    rank, and what backward needs: a (rows, h) and cont (rows,) of this rank's segments (cont
    None without documents)."""
    own = _own_maps(a, S_ext, seq_idx, cfg)
    (excl0, incl0), *second = _prefix_over_ranks(list(zip(own, _chains(cfg, False))), cfg)
    first_half = _broadcast_map(incl0, cfg.world - 1, cfg)                       # segments 0..W-1
    prefixes = [excl0]
    total = first_half
    if second:     # "virtual": the second halves follow the first, from rank W-1 back to rank 0
        excl1, incl1 = second[0]
        prefixes.append(first_half if excl1 is None else _then(first_half, excl1))
        total = _then(first_half, _broadcast_map(incl1, 0, cfg))
    init = None if initial_states is None else initial_states.float()
    entries, conts = [], []
    for m, prefix in zip(own, prefixes):
        if prefix is None:                                       # segment 0: the initial state
            entries.append(torch.zeros_like(m.S) if init is None else init.clone())
            conts.append(torch.ones(cfg.batch, device=m.S.device))
            continue
        cont = (torch.ones(cfg.batch, device=m.S.device) if m.first is None
                else (m.first == prefix.last).float())
        entries.append(cont[:, None, None, None] * _applied(prefix, init))
        conts.append(cont)
    return _rows(entries, cfg), _applied(total, init), a, None if seq_idx is None else _rows(conts, cfg)


def _exit_grads_by_prefix_scan(G, dfinal, a, cont, cfg):
    """Backward state passing by prefix scan, the reverse of _entries_by_prefix_scan: each segment maps
    the gradient at its exit to that at the exit before it, dE -> cont (a dE + G). G (rows, h, p,
    n); dfinal (b, h, p, n) this rank's copy's gradient or None; a (rows, h) and cont (rows,) or
    None as _entries_by_prefix_scan returned them. Returns the gradient arriving at this rank's segment exits
    (rows, h, p, n) and that of the initial state (b, h, p, n; zeros but on the rank holding
    segment 0)."""
    h, p, n = cfg.state_shape
    dfin = torch.zeros((cfg.batch, h, p, n), device=G.device) if dfinal is None else dfinal.float().clone()
    if cfg.world > 1:
        dist.all_reduce(dfin, group=cfg.group)                    # every copy of the final state
    cont = torch.ones(a.shape[0], device=a.device) if cont is None else cont
    own = _own_maps(cont[:, None] * a, cont[:, None, None, None] * G, None, cfg)
    (excl0, incl0), *second = _prefix_over_ranks(list(zip(own, _chains(cfg, True))), cfg)
    if not second:
        after, everything = [excl0], incl0                  # what follows each segment; all of it
    else:          # "virtual": the second halves come first, from rank 0 up to rank W-1
        excl1, incl1 = second[0]
        second_halves = _broadcast_map(incl1, cfg.world - 1, cfg)
        after = [second_halves if excl0 is None else _then(second_halves, excl0), excl1]
        everything = _then(second_halves, incl0)
    dexits = [dfin if m is None else _applied(m, dfin) for m in after]
    dinit = _applied(everything, dfin) if cfg.holds_first else torch.zeros_like(dfin)
    return _rows(dexits, cfg), dinit


def _from_neighbours(blocks, cfg, later):
    """Point-to-point: each of this rank's segments sends its row of blocks (rows, numel) to the
    segment after it (later) or before it in the global sequence, and gets the same from the
    other side (zeros at the sequence's ends). A rank sends at most one block to each other rank.
    Returns (rows, numel)."""
    step = 1 if later else -1
    mine = blocks.reshape(cfg.batch, cfg.segs.per_row, -1)
    got = torch.zeros_like(mine)
    ops, landing = [], []
    for j, k in enumerate(cfg.segs.ids):
        if 0 <= k + step < cfg.segs.count and cfg.segs.where[k + step][0] != cfg.rank:
            ops.append(_send(mine[:, j].contiguous(), cfg.segs.where[k + step][0], cfg.group))
        if 0 <= k - step < cfg.segs.count:
            frm, i = cfg.segs.where[k - step]
            if frm == cfg.rank:
                got[:, j] = mine[:, i]
            else:
                landing.append((j, torch.empty_like(mine[:, j])))
                ops.append(_recv(landing[-1][1], frm, cfg.group))
    _run_p2p(ops)
    for j, buf in landing:
        got[:, j] = buf
    return got.reshape(blocks.shape)


class _PrefixScanExchange:
    """summary_exchange="scan": the summaries and G by prefix scan over the ranks, the halos from
    the neighbouring segments alone. The methods of _AllGatherExchange (section 6); what runs
    `meanwhile` there runs here after the (blocking) rounds."""

    neighbours = staticmethod(_from_neighbours)
    overlaps = False            # the rounds block: nothing to overlap, the conv runs whole

    @staticmethod
    def entry_states(S_ext, a, seq_idx, initial_states, cfg, meanwhile):
        return (*_entries_by_prefix_scan(S_ext, a, seq_idx, initial_states, cfg), meanwhile())

    @staticmethod
    def exit_grads(G, dfinal, a_kept, cont, cfg, meanwhile):
        return (*_exit_grads_by_prefix_scan(G, dfinal, a_kept, cont, cfg), meanwhile())


EXCHANGES["scan"] = _PrefixScanExchange


# Which exchange: a latency-bandwidth model of the link. A message of m bytes costs alpha +
# beta * m. The all-gather is W - 1 ring steps of the per-rank block; the scan ceil(log2 W)
# rounds of one block plus a broadcast of the totals (a pipelined tree: log2 W latencies, the
# bytes once). Per layer call, forward and backward, with s the bytes of one segment's summary
# and k segments per rank:
#     all_gather  (W-1)(alpha + k s beta) + (W-1)(alpha + (k+1) s beta)
#     scan        2 ceil(log2 W)(alpha + k s beta) + the broadcasts and the final gradient's
#                 all-reduce, about (k + 2) (ceil(log2 W) alpha + s beta)
# (and the halos, small either way). At the record shape (a 2 MiB summary, batch 1) with the
# figures of LINKS below, the scan is the faster from W = 4 with "none" (k = 1), and with
# "virtual" (k = 2) from W = 6 on NVLink, W = 4 between nodes; at W = 2 the all-gather takes
# half the scan's time (bench.py --model prints the table). The all-gather also holds W k s
# bytes of summaries per rank: 4 GiB at W = 1024 with "virtual".

SUMMARY_EXCHANGES = ("auto", "all_gather", "scan")


def _log2_rounds(world):
    return max(0, world - 1).bit_length()            # ceil(log2 W)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A link's cost model: one message of m bytes takes alpha + beta * m seconds."""

    alpha: float      # seconds per message
    beta: float       # seconds per byte

    def p2p(self, m):
        return self.alpha + self.beta * m

    def all_gather(self, m, world):
        return (world - 1) * self.p2p(m)

    def broadcast(self, m, world):
        return _log2_rounds(world) * self.alpha + self.beta * m

    def all_reduce(self, m, world):
        return 2 * self.broadcast(m, world)


# Assumed figures, not measured here (one GPU was lent): NVLink 4 as NCCL reaches it between
# two H100/H200 (about 350 GB/s of the 450 each way, about 10 us a message), and an inter-node
# link of one 400 Gb/s NIC per GPU (about 45 GB/s, 20 us). bench.py --model measures alpha and
# beta on the group it runs on.
LINKS = {"nvlink": LinkModel(alpha=10e-6, beta=1 / 350e9), "inter_node": LinkModel(alpha=20e-6, beta=1 / 45e9)}
_LINK = [LINKS["nvlink"]]


def set_link_model(link):
    """Make `link` (a LinkModel, or a name in LINKS) the one summary_exchange="auto" decides by;
    returns the previous one. Every rank of a group must set the same."""
    if isinstance(link, str) and link not in LINKS or not isinstance(link, (str, LinkModel)):
        raise ValueError(f"set_link_model: got {link!r}, expected a LinkModel or one of {sorted(LINKS)}")
    previous = _LINK[0]
    _LINK[0] = LINKS[link] if isinstance(link, str) else link
    return previous


def exchange_seconds(exchange, world, per_row, summary_bytes, halo_bytes, link=None):
    """The model's time of one layer call's exchanges, forward plus backward: `exchange`
    "all_gather" or "scan", per_row segments per rank, summary_bytes and halo_bytes those of one
    segment (all batch rows), link a LinkModel (default: the one set_link_model chose)."""
    link = link or _LINK[0]
    if world == 1:
        return 0.0
    m, rounds = per_row * summary_bytes, _log2_rounds(world)
    if exchange == "all_gather":    # summaries; G with the final state's gradient; halos both ways
        return (link.all_gather(m, world) + link.all_gather(m + summary_bytes, world)
                + 2 * link.all_gather(per_row * halo_bytes, world))
    forward = rounds * link.p2p(m) + per_row * link.broadcast(summary_bytes, world)
    backward = (link.all_reduce(summary_bytes, world) + rounds * link.p2p(m)
                + (per_row - 1) * link.broadcast(summary_bytes, world))
    return forward + backward + 2 * link.p2p(per_row * halo_bytes)


def _segment_bytes(batch, state_shape, conv_dim, d_conv):
    """(summary, halo) bytes of one segment as they travel: fp32, with their document ids."""
    h, p, n = state_shape
    return batch * (h * p * n + h + 2) * 4, batch * (d_conv - 1) * (conv_dim + 1) * 4


def _chosen_exchange(choice, world, load_balancing, batch, state_shape, conv_dim, d_conv):
    """summary_exchange resolved: "auto" takes the faster by the model (the all-gather on a tie)."""
    if choice != "auto":
        return choice
    per_row = 2 if load_balancing == "virtual" else 1
    s, halo = _segment_bytes(batch, state_shape, conv_dim, d_conv)
    scan, gather = (exchange_seconds(e, world, per_row, s, halo) for e in ("scan", "all_gather"))
    return "scan" if scan < gather else "all_gather"


# ---------------------------------------------------------------------------------------------
# 11. Input checks and the ranks' agreement
#    Every bad input gets a ValueError naming the argument, what was seen, and what was expected.
#    The public conv launchers, conv1d_fwd and conv1d_bwd, are section 7's with their inputs checked.
# ---------------------------------------------------------------------------------------------


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


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


def _check_conv_inputs(xBC, weight, bias, halo, seq_idx, halo_seq):
    _expect(isinstance(xBC, torch.Tensor) and xBC.dim() == 3, "xBC",
            tuple(xBC.shape) if isinstance(xBC, torch.Tensor) else type(xBC).__name__,
            "a 3-dim tensor (batch, seqlen, dim)")
    _check_tensor(xBC, "xBC", (None, None, None), xBC, dtypes=_FLOATS)
    b, l, dim = xBC.shape
    _expect(l >= 1 and dim >= 1 and b >= 1, "xBC", f"shape {tuple(xBC.shape)}", "no empty dimension")
    _check_tensor(weight, "weight", (dim, None), xBC, dtypes=_FLOATS, allow_none=False)
    d = weight.shape[1]
    _expect(2 <= d <= 8, "weight", f"d_conv {d}", "2 <= d_conv <= 8")
    _check_tensor(bias, "bias", (dim,), xBC, dtypes=_FLOATS)
    _check_tensor(halo, "halo", (b, d - 1, dim), xBC, dtypes=_FLOATS)
    _check_tensor(seq_idx, "seq_idx", (b, l), xBC, dtypes=_INTS)
    _check_tensor(halo_seq, "halo_seq", (b, d - 1), xBC, dtypes=_INTS)
    _expect(halo_seq is None or seq_idx is not None, "halo_seq", "a tensor with seq_idx=None",
            "None when seq_idx is None")
    _expect(halo is None or seq_idx is None or halo_seq is not None, "halo_seq", "None",
            "the halo's document ids (b, d_conv-1) when both halo and seq_idx are given")
    return b, l, dim, d


def conv1d_fwd(xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, out=None, silu=True):
    """silu(causal depthwise conv(xBC) + bias) (without silu: the conv alone), (b, l, dim) in
    xBC's dtype (contiguous, or written into `out`, any strides: a channel slice of a larger
    buffer, say).

    xBC (b, l, dim) any strides; weight (dim, d_conv); bias (dim,); halo (b, d_conv-1, dim): the
    d_conv-1 pre-conv tokens before the shard, None for zeros; seq_idx (b, l) and halo_seq
    (b, d_conv-1) integer document ids (halo_seq needed when both halo and seq_idx are given).
    """
    b, l, dim, _ = _check_conv_inputs(xBC, weight, bias, halo, seq_idx, halo_seq)
    _check_tensor(out, "out", (b, l, dim), xBC, dtypes=(xBC.dtype,))
    return _conv1d_fwd(xBC, weight, bias, halo, seq_idx, halo_seq, out, silu)


def conv1d_bwd(dout, xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, need_dhalo=True, silu=True,
               dx=None):
    """Gradients of conv1d_fwd: (dxBC, dhalo, dweight, dbias).

    dxBC (b, l, dim) in xBC's dtype (or written into `dx`, any strides: a channel slice of the
    caller's gradient buffer, say); dhalo (b, d_conv-1, dim) fp32, None without a halo or with
    need_dhalo=False; dweight (dim, d_conv) fp32; dbias (dim,) fp32, None without bias.
    Deterministic: no atomics, partial sums are reduced by torch in a fixed order.
    """
    b, l, dim, _ = _check_conv_inputs(xBC, weight, bias, halo, seq_idx, halo_seq)
    _check_tensor(dout, "dout", (b, l, dim), xBC, dtypes=_FLOATS, allow_none=False)
    _check_tensor(dx, "dx", (b, l, dim), xBC, dtypes=(xBC.dtype,))
    return _conv1d_bwd(dout, xBC, weight, bias, halo, seq_idx, halo_seq, need_dhalo, silu, dx)


def _capturing(t):
    """True while a CUDA graph is being captured: checks that read device values on the host
    (a synchronisation) are skipped then; the eager calls before capture have run them."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_document_values(seq_idx, cu_seqlens=None):
    """The checks that read device values on the host (a synchronisation): seq_idx non-decreasing,
    and cu_seqlens bounding the documents that seq_idx marks (shapes checked before). They run
    where the values are used, so under torch.compile too, but not while a CUDA graph is captured
    (the eager calls before capture have run them)."""
    if seq_idx is None or _capturing(seq_idx):
        return
    _expect(bool((seq_idx[:, 1:] >= seq_idx[:, :-1]).all()), "seq_idx", "a decreasing step",
            "non-decreasing document ids along each row")
    if cu_seqlens is None:
        return
    l = seq_idx.shape[1]
    cu = cu_seqlens.tolist()
    _expect(cu[0] == 0 and cu[-1] == l, "cu_seqlens", f"bounds from {cu[0]} to {cu[-1]}", f"from 0 to seqlen = {l}")
    _expect(all(a < b for a, b in zip(cu, cu[1:])), "cu_seqlens", "bounds that do not increase",
            "strictly increasing bounds (every document holds a token)")
    starts = torch.zeros(l, dtype=torch.bool, device=seq_idx.device)
    starts[cu_seqlens[1:-1].long()] = True
    _expect(torch.equal(seq_idx[0, 1:] != seq_idx[0, :-1], starts[1:]), "cu_seqlens", "document bounds that differ "
            "from seq_idx's", "the positions where seq_idx changes, and no others")


def _check_options(chunk_size, seq_idx, dt_limit, tokens, ref):
    """The checks the single-device and CP entry points share; tokens = (batch, seqlen)."""
    _expect(isinstance(chunk_size, int) and chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0,
            "chunk_size", chunk_size, "a power of two >= 16")
    if seq_idx is not None:
        _check_tensor(seq_idx, "seq_idx", tokens, ref, dtypes=(torch.int32, torch.int64))
    _expect(isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1],
            "dt_limit", dt_limit, "a pair (dt_min, dt_max) with dt_min <= dt_max")


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
    _expect(l >= 1, "x", f"seqlen {l}", "at least one token")
    _expect(n <= 256, "B", f"dstate {n}", "dstate <= 256 (one register tile per state row)")
    _expect(p <= 256, "x", f"headdim {p}", "headdim <= 256 (one register tile per head)")
    if D is not None:
        _check_tensor(D, "D", (h,) if D.dim() == 1 else (h, p), x)
    _check_tensor(z, "z", (b, l, h, p), x, dtypes=(x.dtype,))
    _check_tensor(dt_bias, "dt_bias", (h,), x)
    _check_tensor(initial_states, "initial_states", (b, h, p, n), x)
    _check_options(chunk_size, seq_idx, dt_limit, (b, l), x)


_STATE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)


def _signature(**tensors_and_options):
    """A fixed-length integer description of every argument (-1 where absent), for _agree."""
    values, names = [], []
    for name, v in tensors_and_options.items():
        if isinstance(v, torch.Tensor) or v is None:
            shape = list(v.shape) if v is not None else []
            dims = ([v.dim()] if v is not None else [-1]) + (shape + [-1] * 5)[:5]
            code = _DTYPES.index(v.dtype) if v is not None and v.dtype in _DTYPES else -1
            values += dims + [code]
            names += [f"{name} rank"] + [f"{name}.shape[{i}]" for i in range(5)] + [f"{name} dtype"]
        else:
            values.append(int(v))
            names.append(name)
    return values, names


def _op_signature(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, chunk_size, headdim,
                  ngroups):
    """What the ranks of a compiled call agree on inside the forward op (rows of segments)."""
    return dict(xBC=xBC, dt=dt, conv_weight=conv_weight, conv_bias=conv_bias, dt_bias=dt_bias, A=A, D=D,
                seq_idx=seq_idx, initial_states=initial_states, chunk_size=chunk_size, headdim=headdim,
                ngroups=ngroups)


def _call_signature(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups, seq_idx,
                    initial_states, load_balancing, return_final_states, summary_exchange="auto"):
    def t(v):
        return v if isinstance(v, torch.Tensor) else None

    def i(v):
        return v if isinstance(v, int) else -1

    return dict(xBC=t(xBC), dt=t(dt), conv_weight=t(conv_weight), conv_bias=t(conv_bias), dt_bias=t(dt_bias),
                A=t(A), D=t(D), seq_idx=t(seq_idx), initial_states=t(initial_states), chunk_size=i(chunk_size),
                headdim=i(headdim), ngroups=i(ngroups),
                load_balancing=LAYOUTS.index(load_balancing) if load_balancing in LAYOUTS else -1,
                return_final_states=bool(return_final_states),
                summary_exchange=(SUMMARY_EXCHANGES.index(summary_exchange) if isinstance(summary_exchange, str)
                                  and summary_exchange in SUMMARY_EXCHANGES else -1))


def _group_info(cp_group, ref):
    """(rank, world) in the CP group; a ValueError if the group cannot serve these tensors."""
    if cp_group is None or not dist.is_available() or not dist.is_initialized():
        _expect(cp_group is None, "cp_group", "a group", "None when torch.distributed is not initialised")
        return 0, 1
    _expect(isinstance(cp_group, dist.ProcessGroup), "cp_group", type(cp_group).__name__,
            "a torch.distributed ProcessGroup, or None for a single device")
    rank = dist.get_rank(cp_group)
    _expect(rank >= 0, "cp_group", "a group this process is not a member of", "a group containing this rank")
    world = dist.get_world_size(cp_group)
    backend = str(dist.get_backend(cp_group)).lower()
    if "nccl" in backend:
        _expect(ref.is_cuda, "cp_group", f"an NCCL group with tensors on {ref.device}", "CUDA tensors for NCCL")
    return rank, world


def _agree(signature, names, local_error, cp_group, device):
    """Every rank checks that all ranks called with the same shapes and options, and that none
    rejected its own inputs: one all-gather of a fixed-size integer signature, so a mismatch
    cannot hang. A difference raises the same ValueError on every rank; a rank that rejected
    its inputs raises its own error and the others say which rank stopped them."""
    mine = torch.tensor(signature + [local_error is not None], dtype=torch.int64, device=device)
    world = dist.get_world_size(cp_group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=cp_group)
    every = torch.stack(every).cpu()
    for i, name in enumerate(names):
        values = every[:, i].tolist()
        if len(set(values)) > 1:
            raise ValueError(f"{name}: got {values} across the ranks of cp_group, expected the same on every rank")
    rejected = [r for r, flag in enumerate(every[:, -1].tolist()) if flag]
    if local_error is not None:
        raise local_error
    if rejected:
        raise ValueError(f"inputs: got a ValueError on rank(s) {rejected} of cp_group, expected valid inputs "
                         "on every rank (all ranks stop before any collective that could hang)")


def _validate_everywhere(check, cp_group, world, ref, **signature_args):
    """Run the local checks, then (in a world of several, outside CUDA-graph capture) agree
    with the other ranks before anything else is sent. While torch.compile traces, the check
    sees shapes only: the CP forward op agrees when it runs."""
    try:
        check()
        local_error = None
    except ValueError as e:
        local_error = e
    if world > 1 and not _capturing(ref) and not torch.compiler.is_compiling():
        values, names = _signature(**signature_args)
        _agree(values, names, local_error, cp_group, ref.device)
    elif local_error is not None:
        raise local_error


def _agreement_ints():
    """How many int64 values each rank all-gathers when the public CP functions agree on their
    inputs (the signature and the verdict): the count bench.py's volume model uses."""
    values, _ = _signature(**_call_signature(*([None] * 12), "none", False))
    return len(values) + 1


_ACTIVATIONS = ("silu", "swish", None)


def _check_cp_inputs(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups,
                     seq_idx, initial_states, load_balancing, dt_limit, activation="silu", state_dtype=None,
                     summary_exchange="auto"):
    _check_layout(load_balancing)
    _expect(isinstance(summary_exchange, str) and summary_exchange in SUMMARY_EXCHANGES, "summary_exchange",
            repr(summary_exchange), f"one of {SUMMARY_EXCHANGES}")
    _expect(activation in _ACTIVATIONS, "activation", repr(activation), f"one of {_ACTIVATIONS}")
    _expect(state_dtype in _STATE_DTYPES, "state_dtype", state_dtype, f"one of {_STATE_DTYPES}")
    per_row = 1 if load_balancing == "none" else 2
    _expect(isinstance(xBC, torch.Tensor) and xBC.dim() == 3, "xBC",
            tuple(xBC.shape) if isinstance(xBC, torch.Tensor) else type(xBC).__name__,
            "a 3-dim tensor (batch, seqlen_local, nheads*headdim + 2*ngroups*dstate)")
    _check_tensor(xBC, "xBC", (None, None, None), xBC, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    b, l, conv_dim = xBC.shape
    _expect(isinstance(dt, torch.Tensor) and dt.dim() == 3, "dt",
            tuple(dt.shape) if isinstance(dt, torch.Tensor) else type(dt).__name__, f"({b}, {l}, nheads)")
    h = dt.shape[2]
    _check_tensor(dt, "dt", (b, l, h), xBC)
    _expect(isinstance(headdim, int) and headdim >= 1, "headdim", headdim, "a positive int")
    _expect(isinstance(ngroups, int) and ngroups >= 1 and h % ngroups == 0, "ngroups", ngroups,
            f"a positive divisor of nheads={h}")
    rest = conv_dim - h * headdim
    _expect(rest > 0 and rest % (2 * ngroups) == 0, "xBC", f"{conv_dim} channels",
            f"nheads*headdim + 2*ngroups*dstate = {h}*{headdim} + 2*{ngroups}*dstate channels")
    n = rest // (2 * ngroups)
    _expect(isinstance(conv_weight, torch.Tensor) and conv_weight.dim() == 2, "conv_weight",
            tuple(conv_weight.shape) if isinstance(conv_weight, torch.Tensor) else type(conv_weight).__name__,
            f"({conv_dim}, d_conv)")
    _check_tensor(conv_weight, "conv_weight", (conv_dim, None), xBC)
    d_conv = conv_weight.shape[1]
    _expect(2 <= d_conv <= 8, "conv_weight", f"d_conv={d_conv}", "2 <= d_conv <= 8")
    _check_tensor(conv_bias, "conv_bias", (conv_dim,), xBC)
    _check_tensor(dt_bias, "dt_bias", (h,), xBC)
    _check_tensor(A, "A", (h,), xBC, allow_none=False)
    if D is not None:
        _check_tensor(D, "D", (h,) if D.dim() == 1 else (h, headdim), xBC)
    _expect(n <= 256 and headdim <= 256, "xBC", f"headdim {headdim}, dstate {n}", "headdim and dstate <= 256")
    _check_tensor(initial_states, "initial_states", (b, h, headdim, n), xBC)
    _check_options(chunk_size, seq_idx, dt_limit, (b, l), xBC)
    if not torch.compiler.is_compiling():   # compiled, the forward op checks them when it runs
        _check_document_values(seq_idx)
    _expect(l % per_row == 0, "xBC", f"local length {l}",
            f"a multiple of {per_row} (load_balancing={load_balancing!r} holds {per_row} equal pieces)")
    seg = l // 2 if load_balancing == "virtual" else l     # the permute layouts compute one segment
    _expect(seg >= max(1, d_conv - 1), "xBC", f"segments of {seg} tokens",
            f"at least d_conv - 1 = {d_conv - 1} tokens per segment (the conv halo comes from one neighbour)")


# ---------------------------------------------------------------------------------------------
# 12. The permute layouts
#    load_balancing="permute_p2p" and "permute_a2a": tokens moved to the contiguous layout and back.
# ---------------------------------------------------------------------------------------------


def _zigzag_and_contiguous(world):
    """For each of the 2W pieces: (rank, slot) in the zigzag layout and in the contiguous one."""
    zig, con = {}, {}
    for r in range(world):
        for slot, piece in enumerate((r, 2 * world - 1 - r)):
            zig[piece] = (r, slot)
        for slot, piece in enumerate((2 * r, 2 * r + 1)):
            con[piece] = (r, slot)
    return zig, con


def _permute(t, group, load_balancing, to_contiguous):
    """Move the two pieces of a (b, 2s, ...) shard between the zigzag and contiguous layouts,
    with point-to-point sends ("permute_p2p") or one all_to_all_single ("permute_a2a")."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return t.clone()
    zig, con = _zigzag_and_contiguous(world)
    src, dst = (zig, con) if to_contiguous else (con, zig)
    mine = {src_slot: piece for piece, (r, src_slot) in src.items() if r == me}   # slot -> piece
    wanted = {dst[piece][1]: piece for piece in src if dst[piece][0] == me}       # slot -> piece
    pieces = t.chunk(2, dim=1)
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    out_pieces = out.chunk(2, dim=1)
    if load_balancing == "permute_p2p":
        ops, landing = [], []
        for slot, piece in mine.items():
            to = dst[piece][0]
            if to == me:
                out_pieces[dst[piece][1]].copy_(pieces[slot])
            else:
                ops.append(_send(pieces[slot].contiguous(), to, group))
        for slot, piece in wanted.items():
            frm = src[piece][0]
            if frm != me:
                buf = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
                ops.append(_recv(buf, frm, group))
                landing.append((slot, buf))
        _run_p2p(ops)
        for slot, buf in landing:
            out_pieces[slot].copy_(buf)
        return out
    # all_to_all_single moves blocks of dim 0: put the sequence first
    s = t.shape[1] // 2
    send_order = sorted(mine.items(), key=lambda kv: dst[kv[1]])                  # by (dst rank, dst slot)
    send = torch.cat([pieces[slot].transpose(0, 1) for slot, _ in send_order]).contiguous()
    counts_to = [sum(1 for _, piece in send_order if dst[piece][0] == r) for r in range(world)]
    recv_order = sorted(wanted.items(), key=lambda kv: (src[kv[1]][0], kv[0]))   # by src rank, then slot
    counts_from = [sum(1 for _, piece in recv_order if src[piece][0] == r) for r in range(world)]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, [c * s for c in counts_from], [c * s for c in counts_to], group=group)
    for i, (slot, _) in enumerate(recv_order):
        out_pieces[slot].copy_(recv[i * s:(i + 1) * s].transpose(0, 1))
    return out


@torch.library.custom_op("mamba_cp::permute", mutates_args=())
def _permute_op(t: Tensor, group_name: str, load_balancing: str, to_contiguous: bool) -> Tensor:
    return _permute(t, _resolve_group(group_name), load_balancing, to_contiguous)


@_permute_op.register_fake
def _(t, group_name, load_balancing, to_contiguous):
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


class _PermuteFn(torch.autograd.Function):
    """Zigzag <-> contiguous, autograd-aware: the gradient travels the inverse permutation."""

    @staticmethod
    def forward(ctx, t, group, load_balancing, to_contiguous):
        ctx.args = (_group_name(group), load_balancing, to_contiguous)
        return _permute_op(t, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        group, load_balancing, to_contiguous = ctx.args
        return _permute_op(grad, group, load_balancing, not to_contiguous), None, None, None


# ---------------------------------------------------------------------------------------------
# 13. The compile layer and the public CP function: mamba_conv1d_ssd_cp
# ---------------------------------------------------------------------------------------------


# torch.compile. The forward and the backward are each one opaque custom op (torch.library):
# the compiler records the call and its output shapes (from the fake functions below), and the
# kernels run as they do eagerly, on the tensors they were given. Traced instead, a kernel's
# writes into views (the fused backward writes dx, dB, dC into channel slices of one buffer)
# become inductor's copies of those views and back, and at torch 2.11 such a copy read past its
# source: the illegal memory access of README "torch.compile". In the interpreter the compiler
# would trace NumPy. Absent outputs are empty tensors (an op returns tensors only), and so are
# absent gradients. The ops wrap section 8's plain functions, and _Conv1dSSDCPFn runs them as
# its impl (_COMPILABLE), eager calls too.


def _empty_if_none(t, ref, dtype=None):
    return ref.new_empty(0, dtype=dtype or ref.dtype) if t is None else t


@torch.library.custom_op("mamba_cp::conv1d_ssd_cp_fwd", mutates_args=())
def _conv1d_ssd_cp_fwd_op(xBC: Tensor, dt: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                          dt_bias: Optional[Tensor], A: Tensor, D: Optional[Tensor], initial_states: Optional[Tensor],
                          seq_idx: Optional[Tensor], group_name: str, load_balancing: str, exchange: str, batch: int,
                          chunk_size: int, headdim: int, ngroups: int, dt_min: float, dt_max: float, silu: bool,
                          state_dtype: Optional[torch.dtype], agree: bool) -> list[Tensor]:
    """_conv1d_ssd_cp_forward as one op. With agree (a compiled call in a world of several), the
    checks that read device values and the ranks' agreement run here first, where an eager call
    has run them before."""
    if agree:
        group = _resolve_group(group_name)
        _validate_everywhere(lambda: _check_document_values(seq_idx), group, _rank_and_world(group)[1], xBC,
                             **_op_signature(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx,
                                             chunk_size, headdim, ngroups))
    return _conv1d_ssd_cp_forward(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, group_name,
                                  load_balancing, exchange, batch, chunk_size, headdim, ngroups, dt_min, dt_max, silu,
                                  state_dtype)


@_conv1d_ssd_cp_fwd_op.register_fake
def _conv1d_ssd_cp_fwd_fake(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, group_name,
                            load_balancing, exchange, batch, chunk_size, headdim, ngroups, dt_min, dt_max, silu,
                            state_dtype, agree):
    cfg = _cp_config(xBC, dt, conv_weight, group_name, load_balancing, exchange, batch, chunk_size, headdim, ngroups,
                     (dt_min, dt_max))
    rows, s, conv_dim = xBC.shape
    h, p, n = cfg.state_shape
    K, scan = cfg.segs.count, exchange == "scan"
    halo_rows = cfg.d_conv - 1 if K > 1 else 0      # (rows, 0, ...): no halo (a single segment)
    f32 = dict(device=xBC.device, dtype=torch.float32)
    return [torch.empty((rows, s, h, p), device=xBC.device, dtype=xBC.dtype), torch.empty((batch, h, p, n), **f32),
            torch.empty((rows, halo_rows, conv_dim), device=xBC.device, dtype=xBC.dtype),
            torch.empty((rows, halo_rows) if seq_idx is not None else 0, device=xBC.device, dtype=torch.int32),
            torch.empty((rows, h, p, n), **f32), torch.empty((rows, h) if scan else (batch, K, h), **f32),
            torch.empty(((rows,) if scan else (batch, K)) if seq_idx is not None else 0, **f32)]


@torch.library.custom_op("mamba_cp::conv1d_ssd_cp_bwd", mutates_args=())
def _conv1d_ssd_cp_bwd_op(dy: Tensor, dfinal: Optional[Tensor], xBC: Tensor, dt: Tensor, conv_weight: Tensor,
                          conv_bias: Optional[Tensor], dt_bias: Optional[Tensor], A: Tensor, D: Optional[Tensor],
                          initial_states: Optional[Tensor], seq_idx: Optional[Tensor], halo: Tensor, halo_seq: Tensor,
                          entries: Tensor, a_kept: Tensor, cont: Tensor, group_name: str, load_balancing: str,
                          exchange: str, batch: int, chunk_size: int, headdim: int, ngroups: int, dt_min: float,
                          dt_max: float, silu: bool, state_dtype: Optional[torch.dtype]) -> list[Tensor]:
    """_conv1d_ssd_cp_backward as one op: [dxBC, ddt, dconv_weight, dconv_bias, ddt_bias, dA, dD,
    dinitial_states] (absent ones empty)."""
    grads = _conv1d_ssd_cp_backward(dy, dfinal, xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states,
                                    seq_idx, halo, halo_seq, entries, a_kept, cont, group_name, load_balancing,
                                    exchange, batch, chunk_size, headdim, ngroups, dt_min, dt_max, silu, state_dtype)
    return [_empty_if_none(g, xBC) for g in grads]


@_conv1d_ssd_cp_bwd_op.register_fake
def _(dy, dfinal, xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx, halo, halo_seq, entries,
      a_kept, cont, group_name, load_balancing, exchange, batch, chunk_size, headdim, ngroups, dt_min, dt_max, silu,
      state_dtype):
    like = (xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states)
    return [xBC.new_empty(0) if t is None else torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in like]


def _world_of(group_name):
    """The group's size, from its handle (_group_name)."""
    return int(group_name.rsplit(":", 1)[1]) if group_name else 1


def _conv1d_ssd_cp_fwd_agreeing(*args):
    """The forward op; a call being compiled in a world of several agrees inside it (the eager
    call has agreed before)."""
    return _conv1d_ssd_cp_fwd_op(*args, torch.compiler.is_compiling() and _world_of(args[9]) > 1)


_COMPILABLE = _CoreImpl(_conv1d_ssd_cp_fwd_agreeing, _conv1d_ssd_cp_bwd_op)


def _core_numbers(core):
    """A _CoreOptions as one list of numbers, as the split entry's ops take it (an op schema takes
    no mixed lists); _core_of reads it back."""
    return [float(v) for v in core]


def _core_of(numbers):
    b, chunk, p, g, dt_min, dt_max, silu = numbers
    return _CoreOptions(int(b), int(chunk), int(p), int(g), dt_min, dt_max, bool(silu))


def mamba_conv1d_ssd_cp(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, *, headdim, ngroups,
                        cp_group=None, load_balancing="none", seq_idx=None, initial_states=None,
                        dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                        state_dtype=None, summary_exchange="auto"):
    """Mamba2's post-projection core, conv1d + SSD, with state-passing context parallelism.

    xBC (b, l_local, nheads*headdim + 2*ngroups*dstate) pre-conv; dt (b, l_local, nheads) raw
    (dt_bias and softplus are applied inside); conv_weight (conv_dim, d_conv); conv_bias
    (conv_dim,); dt_bias, A (nheads,); D (nheads,) or (nheads, headdim) or None; seq_idx
    (b, l_local) global document ids of the local tokens; initial_states (b, h, p, n) of the
    global sequence. Local tensors are in the layout `load_balancing` (see `shard`).
    Returns y (b, l_local, nheads, headdim) in the same layout, and with return_final_states
    the fp32 state after the whole global sequence, identical on every rank.
    Parameter and initial_states gradients are this rank's contribution (sum them over the
    group, as over data parallelism); the final state's gradients from every rank add up.
    activation: "silu" (or "swish") after the conv, or None; state_dtype as in
    mamba_chunk_scan_combined. summary_exchange: how the summaries and halos travel,
    "all_gather" (every rank receives every segment's), "scan" (a prefix scan over ranks in
    ceil(log2 W) point-to-point rounds; halos from the neighbours) or "auto" (the faster by the
    link model of set_link_model); the results agree to float32 rounding."""
    ref = xBC if isinstance(xBC, torch.Tensor) else torch.empty(0)
    rank, world = _group_info(cp_group, ref)
    _validate_everywhere(
        lambda: _check_cp_inputs(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups,
                                 seq_idx, initial_states, load_balancing, dt_limit, activation, state_dtype,
                                 summary_exchange),
        cp_group, world, ref, **_call_signature(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim,
                                                ngroups, seq_idx, initial_states, load_balancing, return_final_states,
                                                summary_exchange))
    exchange = _chosen_exchange(summary_exchange, world, load_balancing, xBC.shape[0],
                                _state_shape(xBC, dt, headdim, ngroups), xBC.shape[2], conv_weight.shape[1])
    permuted = load_balancing.startswith("permute") and world > 1
    if permuted:
        xBC, dt = (_PermuteFn.apply(t, cp_group, load_balancing, True) for t in (xBC, dt))
        seq_idx = None if seq_idx is None else _permute_op(seq_idx.to(torch.int32), _group_name(cp_group),
                                                           load_balancing, True)
    y, final = _conv1d_ssd_cp(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups, cp_group,
                              load_balancing, seq_idx, initial_states, dt_limit, activation is not None, state_dtype,
                              exchange, _COMPILABLE)
    if permuted:
        y = _PermuteFn.apply(y, cp_group, load_balancing, False)
    return (y, final) if return_final_states else y


# ---------------------------------------------------------------------------------------------
# 14. The gate and the gated RMSNorm
#    y * silu(z), or the gated RMSNorm, as the mixer entry and the single-device function apply it.
#
# Gated RMSNorm over groups of c = dim / ngroups channels, r = (mean_group(v^2) + eps)^-1/2:
#     norm_before_gate: out = (y r) w silu(z)          else: v = y silu(z), out = (v r) w
# and its gradient through n = v r:  dv = r (dn - n mean_group(n dn)).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_norm_tile(y_ptr, z_ptr, w_ptr, b, t, cols, mask, col_mask, stride_y_b, stride_y_l, stride_z_b, stride_z_l,
                    group_size, eps, NORM: tl.constexpr, BEFORE: tl.constexpr):
    """A (BR rows, BG channels) tile: y, z, silu(z), and with NORM the weight w (BG,), the
    normalised input v (y, or y silu(z) after the gate), n = v r and r (BR,), all float32; masked
    entries are 0."""
    y = tl.load(y_ptr + b[:, None] * stride_y_b + t[:, None] * stride_y_l + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + b[:, None] * stride_z_b + t[:, None] * stride_z_l + cols[None, :], mask=mask, other=0.0)
    y, z = y.to(tl.float32), z.to(tl.float32)
    gate = z * tl.sigmoid(z)
    w = tl.zeros_like(cols.to(tl.float32))
    n = y
    r = tl.zeros_like(b.to(tl.float32))
    if NORM:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        v = y if BEFORE else y * gate
        r = tl.rsqrt(tl.sum(v * v, axis=1) / group_size + eps)
        n = v * r[:, None]
    return y, z, gate, w[None, :], n, r


@triton.jit
def _gate_norm_fwd_kernel(y_ptr, z_ptr, w_ptr, out_ptr, n_rows, seqlen, dim, group_size, eps,
                          stride_y_b, stride_y_l, stride_z_b, stride_z_l, stride_o_b, stride_o_l,
                          BR: tl.constexpr, BG: tl.constexpr, NORM: tl.constexpr, BEFORE: tl.constexpr):
    """out = y silu(z), or the gated RMSNorm of one group of channels, for BR token rows."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * group_size + tl.arange(0, BG)
    col_mask = (tl.arange(0, BG) < group_size) & (cols < dim)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    b, t = (rows // seqlen).to(tl.int64), (rows % seqlen).to(tl.int64)
    y, z, gate, w, n, r = _gate_norm_tile(y_ptr, z_ptr, w_ptr, b, t, cols, mask, col_mask, stride_y_b, stride_y_l,
                                          stride_z_b, stride_z_l, group_size, eps, NORM, BEFORE)
    o = y * gate
    if NORM:
        o = n * w * gate if BEFORE else n * w
    tl.store(out_ptr + b[:, None] * stride_o_b + t[:, None] * stride_o_l + cols[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_norm_bwd_kernel(do_ptr, y_ptr, z_ptr, w_ptr, dy_ptr, dz_ptr, dw_part_ptr, n_rows, seqlen, dim, group_size,
                          eps, n_inner, stride_do_b, stride_do_l, stride_y_b, stride_y_l, stride_z_b, stride_z_l,
                          stride_dy_b, stride_dy_l, stride_dz_b, stride_dz_l, stride_dw_r,
                          BR: tl.constexpr, BG: tl.constexpr, NORM: tl.constexpr, BEFORE: tl.constexpr):
    """dy and dz of n_inner blocks of BR token rows, one group of channels; the norm weight's
    gradient summed over those rows into this program's own partial row (no atomics).
    Through n = v r:  dv = r (dn - n mean_group(n dn))."""
    cols = tl.program_id(1) * group_size + tl.arange(0, BG)
    in_group = (tl.arange(0, BG) < group_size) & (cols < dim)
    dw = tl.zeros((BG,), dtype=tl.float32)
    for i in range(n_inner):
        rows = (tl.program_id(0) * n_inner + i) * BR + tl.arange(0, BR)
        mask = (rows < n_rows)[:, None] & in_group[None, :]
        b, t = (rows // seqlen).to(tl.int64), (rows % seqlen).to(tl.int64)
        y, z, gate, w, n, r = _gate_norm_tile(y_ptr, z_ptr, w_ptr, b, t, cols, mask, in_group, stride_y_b,
                                              stride_y_l, stride_z_b, stride_z_l, group_size, eps, NORM, BEFORE)
        do = tl.load(do_ptr + b[:, None] * stride_do_b + t[:, None] * stride_do_l + cols[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        dy = do * gate
        dgate = do * y
        if NORM:
            dn = do * w * gate if BEFORE else do * w
            dw += tl.sum(do * n * gate if BEFORE else do * n, axis=0)
            dv = r[:, None] * (dn - n * (tl.sum(n * dn, axis=1) / group_size)[:, None])
            dy = dv if BEFORE else dv * gate
            dgate = do * n * w if BEFORE else dv * y
        sig = tl.sigmoid(z)
        dz = dgate * sig * (1.0 + z * (1.0 - sig))
        tl.store(dy_ptr + b[:, None] * stride_dy_b + t[:, None] * stride_dy_l + cols[None, :],
                 dy.to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + b[:, None] * stride_dz_b + t[:, None] * stride_dz_l + cols[None, :],
                 dz.to(dz_ptr.dtype.element_ty), mask=mask)
    if NORM:
        tl.store(dw_part_ptr + tl.program_id(0).to(tl.int64) * stride_dw_r + cols, dw, mask=in_group)


class _GateNorm:
    """The gate y * silu(z), or the gated RMSNorm, over (b, l, dim) tensors (any strides with a
    unit channel stride), and its gradient; launches the two kernels above."""

    def __init__(self, rmsnorm_weight, eps, group_size, norm_before_gate):
        self.w, self.eps, self.group_size, self.before = rmsnorm_weight, eps, group_size, norm_before_gate
        self.norm = rmsnorm_weight is not None

    def tiles(self, dim):
        """(channels per program: one norm group, else up to 1024; their power-of-two tile;
        token rows per program, about the tuning's gate_tile elements a tile)."""
        gs = self.group_size if self.norm else min(dim, 1024)
        BG = _next_pow2(gs)
        return gs, BG, max(1, tuning().gate_tile // BG)

    def forward(self, y, z, out):
        """Writes the gated output into out (b, l, dim), a view."""
        b, l, dim = y.shape
        gs, BG, BR = self.tiles(dim)
        grid = (_cdiv(b * l, BR), _cdiv(dim, gs))
        _gate_norm_fwd_kernel[grid](y, z, self.w if self.norm else y, out, b * l, l, dim, gs, self.eps,
                                    y.stride(0), y.stride(1), z.stride(0), z.stride(1), out.stride(0), out.stride(1),
                                    BR=BR, BG=BG, NORM=self.norm, BEFORE=self.before)

    def backward(self, do, y, z, dz):
        """dy (b, l, dim) in y's dtype, dz written into dz (a view), and drmsnorm_weight (fp32)."""
        b, l, dim = y.shape
        gs, BG, BR = self.tiles(dim)
        n_blocks, n_cols = _cdiv(b * l, BR), _cdiv(dim, gs)
        n_inner = max(1, _cdiv(n_blocks * n_cols, tuning().gate_programs))
        n_row_progs = _cdiv(n_blocks, n_inner)
        dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
        dw_part = torch.empty((n_row_progs, dim), device=y.device, dtype=torch.float32) if self.norm else None
        _gate_norm_bwd_kernel[(n_row_progs, n_cols)](
            do, y, z, self.w if self.norm else y, dy, dz, dw_part if self.norm else dy, b * l, l, dim, gs, self.eps,
            n_inner, do.stride(0), do.stride(1), y.stride(0), y.stride(1), z.stride(0), z.stride(1),
            dy.stride(0), dy.stride(1), dz.stride(0), dz.stride(1), dw_part.stride(0) if self.norm else 0,
            BR=BR, BG=BG, NORM=self.norm, BEFORE=self.before)
        return dy, (dw_part.sum(0) if self.norm else None)



_Z_GATE = _GateNorm(None, 0.0, 0, True)   # the plain gate y * silu(z), also mamba_chunk_scan_combined's


# ---------------------------------------------------------------------------------------------
# 15. The single-device function: mamba_chunk_scan_combined, and the packed documents' states
# ---------------------------------------------------------------------------------------------


@triton.jit
def _document_end_state_kernel(
    x_ptr, B_ptr, dt_ptr, dt_bias_ptr, A_ptr, cu_ptr, entries, out_ptr,
    seqlen, nheads, headdim, dstate, heads_per_group, chunks_per_seg, n_n_tiles, dt_min, dt_max,
    stride_x, stride_B, stride_dt,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_ENTRY: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The state after the last token e of one packed document (batch row 0), for one (head,
    state tile): the chunk c holding e is entered with S_in (its stored state from a zero segment
    entry, plus gamma(c) times the segment's entry state), so
        S_e = exp(cs_e) S_in [if it reaches e]  +  sum_j exp(cs_e - cs_j) dt'_j x_j B_j^T
    over the document's tokens j <= e of chunk c. The same arithmetic as the state pass, stopped
    at e. out is (num_docs, nheads, headdim, dstate), contiguous."""
    d = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2) // n_n_tiles
    pid_n = tl.program_id(2) % n_n_tiles
    g = h // heads_per_group
    zero = tl.zeros((), dtype=tl.int32)                                          # batch row 0
    first = tl.load(cu_ptr + d).to(tl.int32)
    last = tl.load(cu_ptr + d + 1).to(tl.int32) - 1
    c = last // Q
    start = c * Q
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)

    dt, dA, slope = _chunk_dt(dt_ptr, dt_bias_ptr, A_ptr, zero, h, start, seqlen, stride_dt,
                              Q, HAS_DT_BIAS, DT_SOFTPLUS, dt_min, dt_max)
    cs = tl.cumsum(dA.to(tl.float64), axis=0)                                    # (Q,) float64
    cs_e = tl.sum(tl.where(offs_q == last - start, cs, 0.0), axis=0)
    t = start + offs_q
    mine = (t >= first) & (t <= last)                                            # the document's tokens in c
    w = tl.where(mine, tl.exp((cs_e - cs).to(tl.float32)) * dt, 0.0)             # (Q,)
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64[:, None] * stride_x.l + h * stride_x.h + offs_p[None, :] * stride_x.p,
                mask=mine[:, None] & (offs_p[None, :] < headdim), other=0.0)    # (Q, BP)
    Bm = tl.load(B_ptr + t64[:, None] * stride_B.l + g * stride_B.g + offs_n[None, :] * stride_B.n,
                 mask=mine[:, None] & (offs_n[None, :] < dstate), other=0.0)    # (Q, BN)
    xw = (x.to(tl.float32) * w[:, None]).to(x.dtype)
    S = tl.dot(tl.trans(xw), Bm, input_precision=DOT_PRECISION)                 # (BP, BN)
    if (first < start) | (first == 0):   # c's entry state reaches e (initial_states reach document 0)
        chunk_row, seg_row = _chunk_rows(zero, c, seqlen, chunks_per_seg, Q)
        S_in = _true_chunk_edge(entries, chunk_row, seg_row, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                                HAS_ENTRY)
        S += tl.exp(cs_e.to(tl.float32)) * S_in
    tl.store(out_ptr + _state_tile(d, h, offs_p, offs_n, nheads, headdim, dstate), S, mask=mask_pn)


def document_end_states(inp, summary, cu_seqlens, entry=None):
    """The float32 state after each packed document of batch row 0, (num_docs, h, p, n), given
    the documents' bounds cu_seqlens (num_docs + 1,) and the sequence's entry state (or None)."""
    x, dt, A, B, dt_bias = inp.x, inp.dt, inp.A, inp.B, inp.dt_bias
    plan = summary.plan
    seg_entry, _ = summary.segment_entries(entry)
    ndocs = cu_seqlens.shape[0] - 1
    out = torch.empty(ndocs, plan.nheads, plan.headdim, plan.dstate, device=x.device, dtype=torch.float32)
    gamma = summary.gamma
    _document_end_state_kernel[(ndocs, plan.nheads, plan.n_p_tiles * plan.n_n_tiles)](
        x, B, dt, dt_bias, A, cu_seqlens, _ChunkEdge(summary.states, gamma, _stand_in(seg_entry, gamma)), out,
        plan.seqlen, plan.nheads, plan.headdim, plan.dstate, plan.heads_per_group, plan.chunks_per_seg,
        plan.n_n_tiles, plan.dt_min, plan.dt_max,
        _BLHP(*x.stride()), _BLGN(*B.stride()), _BLH(*dt.stride()),
        Q=plan.Q, BP=plan.BP_state, BN=plan.BN_state, HAS_ENTRY=seg_entry is not None, DOT_PRECISION=plan.precision,
        **{f: v for f, v in plan.flags.items() if f != "HAS_SEQ"})
    return out


def _flat_heads(t):
    """(b, l, h, p) as (b, l, h*p) with a unit channel stride, as the gate's kernels read it (a
    view where the strides allow one)."""
    return (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()).flatten(-2)


@torch.library.custom_op("mamba_cp::chunk_scan_fwd", mutates_args=())
def _chunk_scan_fwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Optional[Tensor],
                    z: Optional[Tensor], dt_bias: Optional[Tensor], initial_states: Optional[Tensor],
                    seq_idx: Optional[Tensor], dt_softplus: bool, dt_min: float, dt_max: float, need_final: bool,
                    state_dtype: Optional[torch.dtype], cu_seqlens: Optional[Tensor],
                    need_doc_states: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The output (gated with z), the final state (empty unless need_final), each packed
    document's end state (empty unless need_doc_states), and y before the gate (empty without z).

    The gate y * silu(z) runs as its own kernel (section 14's) on y, which is kept for the
    backward, as mamba_ssm keeps it: folded into the SSD kernels it cost less in the forward but
    more in the backward, which had to load z in three kernels and recompute y in one
    (BENCHMARKS.md, "The launch choices")."""
    _check_document_values(seq_idx, cu_seqlens)
    plan = _LaunchPlan(x, B, min(chunk_size, tuning().chunk_fwd), dt_bias, dt_softplus, (dt_min, dt_max), seq_idx,
                       state_dtype)
    entry = None if initial_states is None else initial_states.float()
    inp = _SSDInputs(x, dt, A, B, C, D, dt_bias, seq_idx)
    summary = Summary(inp, plan)
    y, final = ssd_output(inp, summary, entry, need_exit=need_final)
    doc_states = document_end_states(inp, summary, cu_seqlens, entry) if need_doc_states else None
    out, y_kept = y, y.new_empty(0)
    if z is not None:
        out, y_kept = torch.empty_like(y), y
        _Z_GATE.forward(_flat_heads(y), _flat_heads(z), out.flatten(-2))
    return out, _empty_if_none(final, y, torch.float32), _empty_if_none(doc_states, y, torch.float32), y_kept


@_chunk_scan_fwd.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_min, dt_max, need_final,
      state_dtype, cu_seqlens, need_doc_states):
    b, _, h, p = x.shape
    n = B.shape[3]
    f32 = dict(device=x.device, dtype=torch.float32)
    return (torch.empty(x.shape, device=x.device, dtype=x.dtype), torch.empty((b, h, p, n) if need_final else 0, **f32),
            torch.empty((cu_seqlens.shape[0] - 1, h, p, n) if need_doc_states else 0, **f32),
            torch.empty(x.shape if z is not None else 0, device=x.device, dtype=x.dtype))


@torch.library.custom_op("mamba_cp::chunk_scan_bwd", mutates_args=())
def _chunk_scan_bwd(dout: Tensor, dfinal: Optional[Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                    chunk_size: int, D: Optional[Tensor], z: Optional[Tensor], y: Tensor, dt_bias: Optional[Tensor],
                    initial_states: Optional[Tensor], seq_idx: Optional[Tensor], dt_softplus: bool, dt_min: float,
                    dt_max: float, state_dtype: Optional[torch.dtype]) -> list[Tensor]:
    """[dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states], absent ones empty. y: the
    output before the gate (empty without z)."""
    dy, dz = dout, None
    if z is not None:                                  # through the gate first
        dz = torch.empty(z.shape, device=z.device, dtype=z.dtype)
        dy, _ = _Z_GATE.backward(_flat_heads(dout), _flat_heads(y), _flat_heads(z), dz.flatten(-2))
        dy = dy.unflatten(-1, x.shape[2:])
    plan = _LaunchPlan(x, B, min(chunk_size, tuning().chunk_bwd), dt_bias, dt_softplus, (dt_min, dt_max), seq_idx,
                       state_dtype)
    entry = None if initial_states is None else initial_states.float()
    inp = _SSDInputs(x, dt, A, B, C, D, dt_bias, seq_idx)
    grad_pass = GradPass(dy, inp, plan)
    summary = Summary(inp, plan)
    dx, dB, dC, ddt, dA, dD, dinit = ssd_grads(inp, summary, grad_pass, dy, entry, dfinal)
    ddt_bias = ddt.sum(dim=(0, 1)).to(dt_bias.dtype) if dt_bias is not None else None
    grads = [dx, ddt.to(dt.dtype), dA.to(A.dtype), dB, dC, None if D is None else dD.to(D.dtype), dz, ddt_bias,
             None if initial_states is None else dinit.to(initial_states.dtype)]
    return [_empty_if_none(g, x) for g in grads]


@_chunk_scan_bwd.register_fake
def _(dout, dfinal, x, dt, A, B, C, chunk_size, D, z, y, dt_bias, initial_states, seq_idx, dt_softplus, dt_min,
      dt_max, state_dtype):
    like = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [x.new_empty(0) if t is None else torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in like]


class _ChunkScanFn(torch.autograd.Function):
    """Single device: the whole sequence is one CP shard whose entry state is initial_states.
    Backward recomputes the chunk states (they are as large as x, so they are not kept); with
    z it reads y before the gate, kept by the forward.
    Parameter gradients are per-chunk partials summed in fixed order: two identical calls give
    bitwise identical results. The packed documents' end states (with cu_seqlens) are forward
    only, as in mamba_ssm: a gradient arriving at them is an error, not silently dropped."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
                need_final, state_dtype, cu_seqlens, need_doc_states):
        out, final, doc_states, y = _chunk_scan_fwd(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                                                    seq_idx, dt_softplus, dt_limit[0], dt_limit[1], need_final,
                                                    state_dtype, cu_seqlens, need_doc_states)
        ctx.save_for_backward(x, dt, A, B, C, D, z, y, dt_bias, initial_states, seq_idx)
        ctx.args = (chunk_size, dt_softplus, dt_limit, state_dtype)
        ctx.set_materialize_grads(False)      # an unused output's gradient stays None
        return out, final, doc_states

    @staticmethod
    def backward(ctx, dout, dfinal, ddoc_states):
        if _none_if_empty(ddoc_states) is not None:   # compiled, an absent output's gradient is empty, not None
            raise RuntimeError("mamba_chunk_scan_combined: the states returned with return_varlen_states=True have "
                               "no backward (as in mamba_ssm); detach them before they reach the loss")
        x, dt, A, B, C, D, z, y, dt_bias, initial_states, seq_idx = ctx.saved_tensors
        chunk_size, dt_softplus, dt_limit, state_dtype = ctx.args
        dout = torch.zeros_like(x) if dout is None else dout
        grads = _chunk_scan_bwd(dout, _none_if_empty(dfinal), x, dt, A, B, C, chunk_size, D, z, y, dt_bias,
                                initial_states, seq_idx, dt_softplus, dt_limit[0], dt_limit[1], state_dtype)
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = (_none_if_empty(g) for g in grads)
        return (dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dinit, None, None, None, None, None, None, None)


def _check_varlen(cu_seqlens, return_varlen_states, seq_idx, x):
    """cu_seqlens (num_docs + 1,) in one batch row, with seq_idx (their values: in the op)."""
    _expect(cu_seqlens is not None or not return_varlen_states, "cu_seqlens", "None with return_varlen_states=True",
            "the packed documents' bounds, an integer tensor (num_docs + 1,)")
    if cu_seqlens is None:
        return
    _check_tensor(cu_seqlens, "cu_seqlens", (None,), x, dtypes=_INTS)
    _expect(cu_seqlens.shape[0] >= 2, "cu_seqlens", f"shape {tuple(cu_seqlens.shape)}", "(num_docs + 1,), num_docs >= 1")
    _expect(x.shape[0] == 1, "x", f"batch {x.shape[0]} with cu_seqlens", "batch 1 (cu_seqlens packs the documents "
            "into one row)")
    _expect(seq_idx is not None, "seq_idx", "None with cu_seqlens", "the documents of cu_seqlens as ids (1, seqlen)")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False, state_dtype=None):
    """Single-device chunked SSD, a drop-in for mamba_ssm's function of the same name.

    x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n); D (h,) or (h, p); z like x;
    dt_bias (h,); initial_states (b, h, p, n); seq_idx (b, l) integer document ids.
    Returns y like x; with return_final_states also the fp32 final state (b, h, p, n); with
    return_varlen_states (batch 1, cu_seqlens (num_docs + 1,) bounding the documents that seq_idx
    marks) also the fp32 state after each document (num_docs, h, p, n), forward only. Return
    order as in mamba_ssm: y, then final states, then varlen states.
    state_dtype: the dtype of the chunk entry states stored between kernels (default: x's dtype;
    float32 for float32 x). float32 with bf16 inputs doubles that buffer for a little accuracy.
    """
    _check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit)
    _expect(state_dtype in _STATE_DTYPES, "state_dtype", state_dtype, f"one of {_STATE_DTYPES}")
    _check_varlen(cu_seqlens, return_varlen_states, seq_idx, x)
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    y, final, doc_states = _ChunkScanFn.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                              dt_softplus, tuple(dt_limit), return_final_states, state_dtype,
                                              cu_seqlens, return_varlen_states)
    out = (y,) + ((final,) if return_final_states else ()) + ((doc_states,) if return_varlen_states else ())
    return out[0] if len(out) == 1 else out


# ---------------------------------------------------------------------------------------------
# 16. The mixer entry: mamba_split_conv1d_scan_combined
#    mamba_ssm's fused entry, the one Mamba2 mixers call.
#
# zxbcdt = [z0 | x0 | z | xBC | dt] (widths d_nonssm, d_nonssm, dim, conv_dim, nheads). The core
# (conv + SSD, with CP) runs on the xBC and dt channels; everything else is per token and stays
# local: the gate y * silu(z) or the gated RMSNorm, the SwiGLU channels silu(z0) * x0 in front,
# the out projection. One autograd function for all of it, so the gradient of zxbcdt is one
# buffer whose channel slices are filled in place (autograd would otherwise add a zxbcdt-sized
# zero buffer per slice).
# ---------------------------------------------------------------------------------------------


def _swiglu(z0, x0):
    return (z0.float() * torch.sigmoid(z0.float()) * x0.float())


def _swiglu_grad(ds, z0, x0):
    z0f, x0f = z0.float(), x0.float()
    sig = torch.sigmoid(z0f)
    return ds * x0f * sig * (1.0 + z0f * (1.0 - sig)), ds * z0f * sig


def _split_output(y, z, z0, x0, gate_norm, widths):
    """[silu(z0) x0 | the gate or the gated RMSNorm of y], (b, l, d_nonssm + dim) in y's dtype."""
    d_nonssm = widths[0]
    out = torch.empty((*y.shape[:2], d_nonssm + y.shape[2]), device=y.device, dtype=y.dtype)
    if d_nonssm:
        out[..., :d_nonssm] = _swiglu(z0, x0)
    gate_norm.forward(y, z, out[..., d_nonssm:])
    return out


def _rows_view(segs, t):
    """segs.to_rows(t) as a view of t (writes into it land in t), or None where strides forbid one."""
    try:
        return t.view(t.shape[0] * segs.per_row, t.shape[1] // segs.per_row, *t.shape[2:])
    except RuntimeError:
        return None


@torch.library.custom_op("mamba_cp::split_conv1d_scan_fwd", mutates_args=())
def _split_conv1d_scan_fwd(zxbcdt: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], dt_bias: Optional[Tensor],
                           A: Tensor, D: Optional[Tensor], initial_states: Optional[Tensor],
                           rmsnorm_weight: Optional[Tensor], outproj_weight: Optional[Tensor],
                           outproj_bias: Optional[Tensor], seq_idx: Optional[Tensor], widths: list[int],
                           core_opts: list[float], group_name: str, load_balancing: str, exchange: str,
                           state_dtype: Optional[torch.dtype], agree: bool, eps: float, group_size: int, norm_before_gate: bool,
                           permute: bool) -> list[Tensor]:
    """[out, final state, y (b, l, dim) before the gate, the permuted xBC and dt rows (empty
    unless permute), and the core's saved tensors]. core_opts: _core_numbers."""
    core = _core_of(core_opts)
    z0, x0, z, xBC, dt = zxbcdt.split(widths, dim=-1)
    rows = _Segments(*_rank_and_world(_resolve_group(group_name)), load_balancing).to_rows
    if permute:
        xBC, dt = (_permute(t, _resolve_group(group_name), load_balancing, True) for t in (xBC, dt))
    y, final, *saved = _conv1d_ssd_cp_fwd_op(rows(xBC), rows(dt), conv_weight, conv_bias, dt_bias, A, D, initial_states,
                                          seq_idx, *core.core_args(group_name, load_balancing, exchange, state_dtype), agree)
    y = y.reshape(core.batch, -1, y.shape[2] * y.shape[3])                      # (b, l, dim)
    if permute:
        y = _permute(y, _resolve_group(group_name), load_balancing, False)
    out = _split_output(y, z, z0, x0, _GateNorm(rmsnorm_weight, eps, group_size, norm_before_gate), widths)
    if outproj_weight is not None:
        out = F.linear(out.to(outproj_weight.dtype), outproj_weight, outproj_bias)
    kept = (rows(xBC), rows(dt)) if permute else (zxbcdt.new_empty(0), zxbcdt.new_empty(0))
    return [out, final, y, *kept, *saved]


@_split_conv1d_scan_fwd.register_fake
def _(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight, outproj_bias,
      seq_idx, widths, core_opts, group_name, load_balancing, exchange, state_dtype, agree, eps, group_size, norm_before_gate,
      permute):
    core = _core_of(core_opts)
    segs = _Segments(*_rank_and_world(_resolve_group(group_name)), load_balancing)
    b, l, _ = zxbcdt.shape
    xBC, dt = (segs.to_rows(torch.empty((b, l, w), device=zxbcdt.device, dtype=zxbcdt.dtype)) for w in widths[3:])
    y, final, *saved = _conv1d_ssd_cp_fwd_fake(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx,
                                               *core.core_args(group_name, load_balancing, exchange, state_dtype), agree)
    d_out = outproj_weight.shape[0] if outproj_weight is not None else widths[0] + widths[2]
    out_dtype = outproj_weight.dtype if outproj_weight is not None else zxbcdt.dtype
    kept = (xBC, dt) if permute else (zxbcdt.new_empty(0), zxbcdt.new_empty(0))
    return [torch.empty((b, l, d_out), device=zxbcdt.device, dtype=out_dtype), final,
            torch.empty((b, l, widths[2]), device=zxbcdt.device, dtype=zxbcdt.dtype), *kept, *saved]


@torch.library.custom_op("mamba_cp::split_conv1d_scan_bwd", mutates_args=())
def _split_conv1d_scan_bwd(dout: Tensor, dfinal: Optional[Tensor], zxbcdt: Tensor, conv_weight: Tensor,
                           conv_bias: Optional[Tensor], dt_bias: Optional[Tensor], A: Tensor, D: Optional[Tensor],
                           initial_states: Optional[Tensor], rmsnorm_weight: Optional[Tensor],
                           outproj_weight: Optional[Tensor], outproj_bias: Optional[Tensor], seq_idx: Optional[Tensor],
                           y: Tensor, xBC_rows: Tensor, dt_rows: Tensor, halo: Tensor, halo_seq: Tensor,
                           entries: Tensor, a_kept: Tensor, cont: Tensor, widths: list[int], core_opts: list[float],
                           group_name: str, load_balancing: str, exchange: str, state_dtype: Optional[torch.dtype], eps: float,
                           group_size: int, norm_before_gate: bool, permute: bool) -> list[Tensor]:
    """[dzxbcdt, dconv_weight, dconv_bias, ddt_bias, dA, dD, dinitial_states, drmsnorm_weight,
    doutproj_weight, doutproj_bias] (absent ones empty); dzxbcdt is one buffer, its channel
    slices written in place (the gate's kernel writes dz there directly)."""
    core = _core_of(core_opts)
    segs = _Segments(*_rank_and_world(_resolve_group(group_name)), load_balancing)
    dout = dout.contiguous()                       # the gate's kernels take unit channel strides
    z0, x0, z, xBC, dt = zxbcdt.split(widths, dim=-1)
    if not permute:
        xBC_rows, dt_rows = segs.to_rows(xBC), segs.to_rows(dt)
    gate_norm = _GateNorm(rmsnorm_weight, eps, group_size, norm_before_gate)
    dW = db = None
    if outproj_weight is not None:
        pre = _split_output(y, z, z0, x0, gate_norm, widths).to(outproj_weight.dtype)
        dW = dout.flatten(0, 1).t().mm(pre.flatten(0, 1)).to(outproj_weight.dtype)
        db = None if outproj_bias is None else dout.sum(dim=(0, 1)).to(outproj_bias.dtype)
        dout = dout.matmul(outproj_weight)
    dzxbcdt = torch.empty(zxbcdt.shape, device=zxbcdt.device, dtype=zxbcdt.dtype)
    dz0, dx0, dz, dxBC_out, ddt_out = dzxbcdt.split(widths, dim=-1)
    d_nonssm = widths[0]
    if d_nonssm:
        for part, g in zip((dz0, dx0), _swiglu_grad(dout[..., :d_nonssm].float(), z0, x0)):
            part.copy_(g)
    dy, dw = gate_norm.backward(dout[..., d_nonssm:], y, z, dz)                # dz written into dzxbcdt
    if permute:
        dy = _permute(dy, _resolve_group(group_name), load_balancing, True)
    dy = segs.to_rows(dy.unflatten(-1, (widths[4], -1)))
    # the core writes dxBC and ddt into dzxbcdt, unless the rows travel (permute) or its
    # strides allow no per-segment view: then they are copied in once
    into = (None, None) if permute else (_rows_view(segs, dxBC_out), _rows_view(segs, ddt_out))
    grads = _conv1d_ssd_cp_backward(dy, dfinal, xBC_rows, dt_rows, conv_weight, conv_bias, dt_bias, A, D,
                                    initial_states, seq_idx, halo, halo_seq, entries, a_kept, cont,
                                    *core.core_args(group_name, load_balancing, exchange, state_dtype),
                                    dxBC_into=into[0], ddt_into=into[1])
    dxBC, ddt, dconv_w, dconv_b, ddt_bias, dA, dD, dinit = grads
    for rows_grad, view, out in ((dxBC, into[0], dxBC_out), (ddt, into[1], ddt_out)):
        if view is None:
            full = segs.from_rows(rows_grad, core.batch)
            out.copy_(_permute(full, _resolve_group(group_name), load_balancing, False) if permute else full)
    return [dzxbcdt, *(_empty_if_none(g, zxbcdt) for g in (dconv_w, dconv_b, ddt_bias, dA, dD, dinit)),
            _empty_if_none(None if dw is None else dw.to(rmsnorm_weight.dtype), zxbcdt),
            _empty_if_none(dW, zxbcdt), _empty_if_none(db, zxbcdt)]


@_split_conv1d_scan_bwd.register_fake
def _(dout, dfinal, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
      outproj_bias, seq_idx, y, xBC_rows, dt_rows, halo, halo_seq, entries, a_kept, cont, widths, core_opts, group_name,
      load_balancing, exchange, state_dtype, eps, group_size, norm_before_gate, permute):
    like = (zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight, outproj_bias)
    return [zxbcdt.new_empty(0) if t is None else torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in like]


class _SplitConv1dScanFn(torch.autograd.Function):
    """zxbcdt (b, l, width) -> out (b, l, d_out), the final state (the two ops above)."""

    @staticmethod
    def forward(ctx, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
                outproj_bias, seq_idx, widths, core_opts, names, agree, epilogue_opts, permute):
        out, final, *saved = _split_conv1d_scan_fwd(
            zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
            outproj_bias, seq_idx, widths, core_opts, *names, agree, *epilogue_opts, permute)
        ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
                              outproj_weight, outproj_bias, seq_idx, *saved)
        ctx.args = (widths, core_opts, names, epilogue_opts, permute)
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        widths, core_opts, names, epilogue_opts, permute = ctx.args
        grads = _split_conv1d_scan_bwd(dout, dfinal, *ctx.saved_tensors, widths, core_opts, *names, *epilogue_opts,
                                       permute)
        return (*(_none_if_empty(g) for g in grads), *([None] * 7))


def _split_widths(zxbcdt, conv1d_weight, A, D, headdim, ngroups):
    """(d_nonssm, d_nonssm, dim, conv_dim, nheads), headdim and dstate of a call, checked."""
    _expect(isinstance(zxbcdt, torch.Tensor) and zxbcdt.dim() == 3, "zxbcdt",
            tuple(zxbcdt.shape) if isinstance(zxbcdt, torch.Tensor) else type(zxbcdt).__name__,
            "a 3-dim tensor (batch, seqlen_local, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads)")
    _expect(isinstance(A, torch.Tensor) and A.dim() == 1, "A", tuple(A.shape) if isinstance(A, torch.Tensor)
            else type(A).__name__, "(nheads,)")
    nheads = A.shape[0]
    if D is not None and D.dim() == 2:
        _expect(headdim is None or headdim == D.shape[1], "headdim", headdim, f"None or D.shape[1] = {D.shape[1]}")
        headdim = D.shape[1]
    _expect(isinstance(headdim, int) and headdim >= 1, "headdim", headdim,
            "a positive int (or None with D of shape (nheads, headdim))")
    _expect(isinstance(conv1d_weight, torch.Tensor) and conv1d_weight.dim() == 2, "conv1d_weight",
            tuple(conv1d_weight.shape) if isinstance(conv1d_weight, torch.Tensor) else type(conv1d_weight).__name__,
            "(conv_dim, d_conv)")
    dim, conv_dim = nheads * headdim, conv1d_weight.shape[0]
    _expect(isinstance(ngroups, int) and ngroups >= 1 and (conv_dim - dim) > 0 and (conv_dim - dim) % (2 * ngroups) == 0,
            "conv1d_weight", f"{conv_dim} channels with ngroups={ngroups}", f"dim + 2*ngroups*dstate, dim = {dim}")
    rest = zxbcdt.shape[2] - dim - conv_dim - nheads
    _expect(rest >= 0 and rest % 2 == 0, "zxbcdt", f"width {zxbcdt.shape[2]}",
            f"2*d_nonssm + dim + conv_dim + nheads = 2*d_nonssm + {dim} + {conv_dim} + {nheads}, d_nonssm >= 0")
    return (rest // 2, rest // 2, dim, conv_dim, nheads), headdim


def _check_split_options(widths, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, ngroups, ref):
    d_nonssm, _, dim = widths[:3]
    _expect(activation in _ACTIVATIONS, "activation", repr(activation), f"one of {_ACTIVATIONS}")
    if rmsnorm_weight is not None:
        _check_tensor(rmsnorm_weight, "rmsnorm_weight", (dim,), ref)
        _expect(dim % ngroups == 0, "ngroups", ngroups, f"a divisor of dim = {dim} (the norm's groups)")
        _expect(float(rmsnorm_eps) > 0, "rmsnorm_eps", rmsnorm_eps, "a positive float")
    if outproj_weight is not None:
        _check_tensor(outproj_weight, "outproj_weight", (None, d_nonssm + dim), ref)
        _check_tensor(outproj_bias, "outproj_bias", (outproj_weight.shape[0],), ref)
    else:
        _expect(outproj_bias is None, "outproj_bias", "a tensor with outproj_weight=None", "None")


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None, *, cp_group=None,
                                     load_balancing="none", summary_exchange="auto"):
    """mamba_ssm's fused Mamba2 entry, with state-passing CP; the same signature and results.

    zxbcdt (b, l_local, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads) = [z0 | x0 | z | xBC | dt],
    dim = nheads*headdim (headdim from D when D is (nheads, headdim)); conv1d_weight (conv_dim,
    d_conv); dt raw (dt_bias, softplus and dt_limit inside). Returns out (b, l_local, d_nonssm +
    dim), or out_features with outproj_weight, in the layout `load_balancing`: silu(z0) * x0,
    then y * silu(z) or the gated RMSNorm (groups of dim / ngroups channels); with
    return_final_states also the fp32 state after the whole global sequence. Gradient ownership
    and summary_exchange as in mamba_conv1d_ssd_cp: parameters get this rank's contribution."""
    ref = zxbcdt if isinstance(zxbcdt, torch.Tensor) else torch.empty(0)
    rank, world = _group_info(cp_group, ref)
    found = {}

    def check():
        widths, found["headdim"] = _split_widths(zxbcdt, conv1d_weight, A, D, headdim, ngroups)
        found["widths"] = widths
        _check_split_options(widths, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias,
                             ngroups, zxbcdt)
        _, _, z, xBC, dt = zxbcdt.split(widths, dim=-1)
        _check_cp_inputs(xBC, dt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, found["headdim"], ngroups,
                         seq_idx, initial_states, load_balancing, dt_limit, activation, state_dtype,
                         summary_exchange)

    _validate_everywhere(check, cp_group, world, ref, **_call_signature(
        zxbcdt, None, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, headdim, ngroups, seq_idx,
        initial_states, load_balancing, return_final_states, summary_exchange))
    widths, p = found["widths"], found["headdim"]
    dstate = (widths[3] - widths[2]) // (2 * ngroups)
    exchange = _chosen_exchange(summary_exchange, world, load_balancing, zxbcdt.shape[0],
                                (widths[4], p, dstate), widths[3], conv1d_weight.shape[1])
    if zxbcdt.stride(-1) != 1:                     # the gate's kernels take unit channel strides
        zxbcdt = zxbcdt.contiguous()
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    permute = load_balancing.startswith("permute") and world > 1
    segs = _Segments(rank, world, load_balancing)
    if permute:
        seq_idx = None if seq_idx is None else _permute_op(seq_idx, _group_name(cp_group), load_balancing, True)
    core_opts = _core_numbers(_CoreOptions(zxbcdt.shape[0], chunk_size, p, ngroups, dt_limit[0], dt_limit[1],
                                           activation is not None))
    out, final = _SplitConv1dScanFn.apply(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
        outproj_bias, None if seq_idx is None else segs.to_rows(seq_idx).contiguous(), list(widths), core_opts,
        (_group_name(cp_group), load_balancing, exchange, state_dtype), world > 1 and torch.compiler.is_compiling(),
        (float(rmsnorm_eps), widths[2] // ngroups, bool(norm_before_gate)), permute)
    return (out, final) if return_final_states else out


# ---------------------------------------------------------------------------------------------
# 17. The all-to-all baseline
#    The head-parallel CP it replaces.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("mamba_cp::all_to_all", mutates_args=())
def _all_to_all_op(t: Tensor, group_name: str) -> Tensor:
    """Equal-block all_to_all_single along dim 0."""
    out = torch.empty(t.shape, device=t.device, dtype=t.dtype)
    dist.all_to_all_single(out, t.contiguous(), group=_resolve_group(group_name))
    return out


@_all_to_all_op.register_fake
def _(t, group_name):
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


@torch.library.custom_op("mamba_cp::all_gather", mutates_args=())
def _all_gather_op(t: Tensor, group_name: str) -> Tensor:
    return _all_gather(t, _resolve_group(group_name))


@_all_gather_op.register_fake
def _(t, group_name):
    return t.new_empty((dist.get_world_size(_resolve_group(group_name)), *t.shape))


@torch.library.custom_op("mamba_cp::all_reduce", mutates_args=())
def _all_reduce_op(t: Tensor, group_name: str) -> Tensor:
    out = t.contiguous().clone()
    dist.all_reduce(out, group=_resolve_group(group_name))
    return out


@_all_reduce_op.register_fake
def _(t, group_name):
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


class _AllToAllFn(torch.autograd.Function):
    """Equal-block all_to_all_single along dim 0 (W blocks); its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group_name = _group_name(group)
        return _all_to_all_op(t, ctx.group_name)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_op(grad, ctx.group_name), None


class _GatherHeadsFn(torch.autograd.Function):
    """All-gather of per-rank head blocks into the replicated (b, h, p, n) final state; every
    rank's copy receives gradient, so backward sums them and keeps this rank's block."""

    @staticmethod
    def forward(ctx, block, group, rank):
        ctx.group_name, ctx.rank, ctx.world = _group_name(group), rank, dist.get_world_size(group)
        every = _all_gather_op(block, ctx.group_name)                                   # (W, b, hW, p, n)
        return torch.cat(list(every.unbind(0)), dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_op(grad, ctx.group_name).chunk(ctx.world, dim=1)[ctx.rank], None, None


def _a2a_heads(nheads, ngroups, world, rank):
    """Heads of `rank` and, per local head, the group it reads. Groups are split across ranks
    when W divides ngroups; when W splits a group, the rank's heads share one replicated group;
    otherwise each local head gets its own copy of its group (uniform blocks on every rank)."""
    hw = nheads // world
    hpg = nheads // ngroups
    heads = list(range(rank * hw, (rank + 1) * hw))
    if ngroups % world == 0:
        groups = list(range(rank * ngroups // world, (rank + 1) * ngroups // world))
    elif hpg % hw == 0:
        groups = [heads[0] // hpg]
    else:
        groups = [hh // hpg for hh in heads]
    return heads, groups


def _a2a_channels(cfg, heads, groups):
    """Indices into the conv_dim channels [x | B | C] for these heads and (replicated) groups."""
    p, n = cfg.headdim, cfg.dstate
    hp, gn = cfg.nheads * p, cfg.ngroups * n
    x = [hh * p + i for hh in heads for i in range(p)]
    Bc = [hp + g * n + i for g in groups for i in range(n)]
    Cc = [hp + gn + g * n + i for g in groups for i in range(n)]
    return x + Bc + Cc


# The channel indices of each rank's block, per (shape, world, device): built once, on the first
# (eager) call, so that later calls copy nothing from the host and can be captured in a CUDA graph.
_A2A_CHANNELS = {}


def _a2a_channel_index(cfg, head_split, device):
    key = (cfg.nheads, cfg.headdim, cfg.ngroups, cfg.dstate, cfg.world, str(device))
    if key not in _A2A_CHANNELS:
        _A2A_CHANNELS[key] = [torch.tensor(_a2a_channels(cfg, *heads_groups), device=device)
                              for heads_groups in head_split]
    return _A2A_CHANNELS[key]


def _to_global_order(blocks, cfg):
    """blocks (W, b, l_local, ...): every rank's local tokens -> (b, L, ...) in sequence order."""
    layout = "none" if cfg.load_balancing == "none" else "virtual"                # input layouts
    return unshard(list(blocks.unbind(0)), layout, dim=1)


def _to_local_order(full, cfg):
    """(b, L, ...) -> (W, b, l_local, ...): each rank's local tokens, in its layout."""
    layout = "none" if cfg.load_balancing == "none" else "virtual"
    return torch.stack([shard(full, r, cfg.world, layout, dim=1) for r in range(cfg.world)])


def mamba_conv1d_ssd_a2a(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, *, headdim, ngroups,
                         cp_group=None, load_balancing="none", seq_idx=None, initial_states=None,
                         dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                         state_dtype=None):
    """The same arguments and results as mamba_conv1d_ssd_cp, computed the usual way: an
    all-to-all gives every rank the whole sequence for nheads/W heads, it runs the single-device
    conv + SSD, and a second all-to-all returns the outputs to their tokens. Exists to be
    compared against. Requires nheads divisible by W."""
    ref = xBC if isinstance(xBC, torch.Tensor) else torch.empty(0)
    rank, world = _group_info(cp_group, ref)

    def check():
        _check_cp_inputs(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups,
                         seq_idx, initial_states, load_balancing, dt_limit, activation, state_dtype)
        _expect(dt.shape[2] % world == 0, "dt", f"nheads={dt.shape[2]} with W={world}",
                "nheads divisible by the CP world size (the all-to-all baseline splits heads)")

    _validate_everywhere(check, cp_group, world, ref, **_call_signature(
        xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim, ngroups, seq_idx, initial_states,
        load_balancing, return_final_states))
    nheads = dt.shape[2]
    cfg = _CPConfig(xBC, dt, conv_weight, chunk_size, headdim, ngroups, cp_group, rank, world,
                    load_balancing, dt_limit)
    if world == 1:
        return mamba_conv1d_ssd_cp(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim=headdim,
                                   ngroups=ngroups, seq_idx=seq_idx, initial_states=initial_states,
                                   dt_limit=dt_limit, return_final_states=return_final_states,
                                   activation=activation, state_dtype=state_dtype)

    # forward all-to-all: block j of what this rank sends holds rank j's channels of its tokens
    head_split = [_a2a_heads(nheads, ngroups, world, r) for r in range(world)]
    chan = _a2a_channel_index(cfg, head_split, xBC.device)
    send_x = torch.stack([xBC.index_select(2, chan[r]) for r in range(world)])     # (W, b, l, c_loc)
    send_dt = torch.stack([dt[..., head_split[r][0][0]:head_split[r][0][-1] + 1] for r in range(world)])
    xBC_mine = _to_global_order(_AllToAllFn.apply(send_x, cp_group), cfg)        # (b, L, c_loc)
    dt_mine = _to_global_order(_AllToAllFn.apply(send_dt, cp_group), cfg)        # (b, L, hW)
    seq_full = None if seq_idx is None else _to_global_order(_all_gather_op(seq_idx.to(torch.int32),
                                                                            _group_name(cp_group)), cfg)

    heads, groups = head_split[rank]
    h0, h1 = heads[0], heads[-1] + 1
    D_mine = None if D is None else D[h0:h1]
    init_mine = None if initial_states is None else initial_states[:, h0:h1]
    y_mine, final_mine = mamba_conv1d_ssd_cp(
        xBC_mine, dt_mine, conv_weight.index_select(0, chan[rank]),
        None if conv_bias is None else conv_bias.index_select(0, chan[rank]),
        None if dt_bias is None else dt_bias[h0:h1], A[h0:h1], D_mine, chunk_size, headdim=headdim,
        ngroups=len(groups), seq_idx=seq_full, initial_states=init_mine, dt_limit=dt_limit, return_final_states=True,
        activation=activation, state_dtype=state_dtype)

    # backward all-to-all: block j of what this rank sends holds rank j's tokens of its heads
    y = _AllToAllFn.apply(_to_local_order(y_mine, cfg), cp_group)                # (W, b, l, hW, p)
    y = torch.cat(list(y.unbind(0)), dim=2)                                        # (b, l, h, p)
    if not return_final_states:
        return y
    return y, _GatherHeadsFn.apply(final_mine.contiguous(), cp_group, rank)


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    os.environ["TRITON_INTERPRET"] = "1"  # the example runs on CPUs, kernels in the interpreter
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_worked_example, args=(2, free_port), nprocs=2)
