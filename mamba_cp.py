"""mamba_cp: state-passing context parallelism for Mamba2's SSD, in one readable module.

The SSD recurrence, per batch row and head (README "The recurrence"):

    dt'_t = clamp(softplus(dt_t + dt_bias), *dt_limit)   a_t = exp(dt'_t * A)
    S_t   = a_t * S_{t-1} + dt'_t * x_t B_t^T            y_t = S_t C_t + D * x_t   (then * silu(z_t))

Any causal piece of the sequence maps the state entering it to the state leaving it affinely,
S_out = a * S_in + S_ext, with S_ext its exit state from a zero entry and a its decay. So each
rank summarises its segment as (S_ext, a), the summaries travel between ranks, an exclusive scan over
them gives every rank the true state entering its segment, and each rank computes its outputs
from that state. Only the summaries, whose size does not grow with the sequence, and a conv
halo of d_conv - 1 tokens cross between ranks (README "The affine state summary").

reference_ssd.state_passing_reference is the same method in about fifty lines of float64 torch,
W ranks simulated in one process. Its steps, and where each runs here (method_forward and
method_backward, section 1, call them in this order):

  listing step                                      runs in (section)
  (1) rank r holds a causal segment; its conv       receive_halo (6), _conv1d_fwd (2)
      needs the d_conv - 1 tokens before it
  (2) each segment's summary (a, S_ext)             ssd_tensors (3), Summary (4)
  (3) the exclusive scan over the segments          AllGatherExchange.entry_states (6), scan_summaries (4)
  (4) each segment's outputs from its entry state   ssd_output (4)
  the backward: the same steps in reverse           GradPass, ssd_grads (5), exit_grads (6), _conv1d_bwd (2)
  all of it, differentiable                         StatePassingFn (1), which every public entry runs

The file has two parts. Part I is the method, complete on its own (a test runs it alone, against
the oracle): a reader can stop at its end. Part II holds what production adds; it depends on
Part I, never the reverse, and changes nothing of it.

  Part I, the method
   1. The method, at the scale of functions
   2. The causal conv1d
   3. dt and the decays of one chunk
   4. The forward: state pass, summary scan, outputs
   5. The backward: the state pass reversed, chunk gradients
   6. Segments, and their exchange by all-gather
   7. Launch plumbing: tiles, tuning, the plan
  Part II, the production extras
   8. The prefix-scan exchange and the model that chooses
   9. Input checks and the ranks' agreement
  10. Shard, unshard, and the permute layouts
  11. The compile layer and the public CP function: mamba_conv1d_ssd_cp
  12. The gate and the gated RMSNorm
  13. The single-device function: mamba_chunk_scan_combined
  14. The mixer entry: mamba_split_conv1d_scan_combined
  15. The all-to-all baseline, and the bytes every path moves
  16. A worked example

Words, one meaning each:
  chunk     Q consecutive tokens, the kernels' tile: Q is the smaller of the caller's chunk_size
            and the tuning's chunk length (any Q computes the same recurrence); a last partial
            chunk is masked, not padded.
  run       consecutive chunks one state-pass program walks in order. A sequence's runs go in
            parallel and are joined by the same scan that joins segments.
  segment   a causal piece of the global sequence that a rank holds: one, or two halves with
            load_balancing="virtual". The method sees each as one batch row.
  summary   (S_ext, a) of a run or a segment: its exit state from a zero entry, and its decay.
  decay     exp of the sum of dt'*A over a span of tokens (a chunk, a run, a segment, or from a
            run's entry to a chunk's: gamma), 0 where a document starts inside the span.
  entry     the state entering a chunk, run or segment; backward, its exit gradient is the
            gradient arriving at its end.
  slot      a chunk's, run's or segment's index in the buffers of each: b * nchunks + c, b * nruns + r, ...
  ids       document ids: seq_idx's values, one per token, non-decreasing along the global row.
  exchange  how summaries, their gradients and halos travel between ranks: an object with three
            methods, AllGatherExchange (section 6) or PrefixScanExchange (section 8), chosen per
            call by the option summary_exchange.
  halo      the last d_conv - 1 pre-conv tokens of the segment before, which a segment's conv reads.
  strip     tokens one conv program walks in order; u, the conv's input rows: the halo, then the shard.
  plan      what a call derives once from its shapes, options and group (Plan, LaunchPlan).

Numerics (README "Numerics"): decays are exponentials of sums of dt'*A, formed in float64 and
kept as float32 (hi, lo) pairs, so the difference of two large sums keeps its small part; masked
exponents, of either sign (A > 0 is growth), are removed by selection before exp, never multiplied
by 0; the gradient of a decay sums the pairs that span its token directly.

Without a GPU the same kernels run in the Triton interpreter (set below, whatever was imported
first), so the code can be stepped through on a CPU.
"""

import collections
import dataclasses
import functools
import math
import os
import sys
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

if not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):  # no GPU: Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpret_triton_language():
    """Triton decorates its own @triton.jit functions (tl.cumsum, tl.sigmoid, ...) when it is
    imported, for the interpreter only if TRITON_INTERPRET was set by then. If something imported
    triton before this module (transformers does), they were made for a GPU and fail inside
    interpreted kernels: hand them to the interpreter, so that import order never matters."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    for name, module in list(sys.modules.items()):
        if name.startswith("triton.language") and module is not None:
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))


if INTERPRET:
    _interpret_triton_language()


class _Launched:
    """A @triton.jit kernel, launched as Triton launches it, `kernel[grid](*args, **constexprs)`,
    for less host time: eager callers pay the host for each of a call's twenty launches. Triton
    binds and specializes every argument, builds a cache key and runs its launch hooks each time.
    Here a signature seen before (each argument's type and value, a tensor's only by its dtype,
    device kind and 16-byte alignment: all Triton specializes a tensor on) goes straight to the
    launcher of the kernel Triton compiled for it at its first launch, pointers as integers. The
    interpreter, launch hooks and new signatures take Triton's own path."""

    direct = not INTERPRET          # tools/sass.py turns it off: it compiles without launching
    most = 4096                     # signatures kept per kernel (lengths that vary call to call add one each)

    def __init__(self, jit):
        self.jit, self.compiled = jit, {}

    def __getattr__(self, name):    # the JITFunction's own attributes (fn, arg_names, ...)
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **constexprs):
        if not self.direct:
            return self.jit[grid](*args, **constexprs)
        device = torch.cuda.current_device()
        key, flat = _launch_signature(device, args, constexprs)
        hit = self.compiled.get(key)
        if hit is None or _launch_hooks(self.jit):
            compiled = self.jit[grid](*args, **constexprs)
            if all(p.is_constexpr for p in self.jit.params[len(args):]):   # the launcher's tail: ignored
                if len(self.compiled) >= self.most:
                    self.compiled.clear()
                tail = (None,) * (len(self.jit.params) - len(args))
                # compiled itself is kept too: while it lives, its module stays loaded and `function` valid
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail, compiled)
            return compiled
        run, function, metadata, tail, _ = hit
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], _stream_reader()(device), function, metadata, None, None, None, *flat, *tail)


def _launch_signature(device, args, constexprs):
    """(key, flat): a launch's signature on `device`, and its arguments as the launcher takes them."""
    key, flat = [device, *constexprs.items()], []
    _launch_key(args, key, flat)
    return tuple(key), flat


def _launch_key(args, key, flat):
    """Appends the arguments, one pass, to key as Triton specializes on them and to flat as the
    launcher takes them: a tensor is (dtype, is_cuda, 16-byte aligned) in key and its address in
    flat; a tuple that may hold tensors, its type and length, then the same inside; an int or a
    tuple of strides, itself in both; anything else, its type and itself in key (True is not 1)."""
    for a in args:
        kind = type(a)
        if kind is int or kind in _STRIDES:
            key.append(a)
            flat.append(a)
        elif isinstance(a, Tensor):
            ptr = a.data_ptr()
            key += (a.dtype, a.is_cuda, ptr % 16 == 0)
            flat.append(ptr)
        elif isinstance(a, tuple):
            inner = []
            key += (kind, len(a))
            _launch_key(a, key, inner)
            flat.append(tuple(inner))
        else:
            key += (kind, a)
            flat.append(a)


def _launch_hooks(jit, runtime=triton.knobs.runtime):
    """Whether anything hooks Triton's launches (a profiler such as proton): then Triton launches."""
    return bool(jit.pre_run_hooks) or any(getattr(h, "calls", h) for h in (runtime.launch_enter_hook,
                                                                           runtime.launch_exit_hook))


@functools.lru_cache(maxsize=None)
def _stream_reader():
    """Triton's reader of a device's current stream (torch's), looked up once."""
    from triton.runtime import driver
    return driver.active.get_current_stream


# =============================================================================================
# PART I. THE METHOD
# Sections 1 to 7: what a newcomer reads. Nothing here uses a name from Part II.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# 1. The method, at the scale of functions
#    The listing's steps, forward and backward, each a call of a function defined below; and
#    the one autograd function that every public entry runs.
# ---------------------------------------------------------------------------------------------


class Call(NamedTuple):
    """The tensors of one call of the fused conv1d + SSD, one causal segment per batch row:
    rows = batch * segments per rank, s tokens each. A call's gradients come back as a Call too."""
    xBC: Tensor                        # (rows, s, conv_dim) pre-conv channels [x | B | C]
    dt: Tensor                         # (rows, s, h) raw: dt_bias, softplus and dt_limit inside
    conv_weight: Tensor                # (conv_dim, d_conv)
    conv_bias: Optional[Tensor]        # (conv_dim,)
    dt_bias: Optional[Tensor]          # (h,)
    A: Tensor                          # (h,)
    D: Optional[Tensor]                # (h,) or (h, p)
    initial_states: Optional[Tensor]   # (batch, h, p, n): the global sequence's
    seq_idx: Optional[Tensor]          # (rows, s) int32 document ids, global


class Kept(NamedTuple):
    """What the forward keeps for the backward, besides the Call; none of it grows with the
    sequence. None where absent: a single segment in all sends nothing and keeps nothing."""
    halo: Optional[Tensor]             # (rows, d_conv - 1, conv_dim) the tokens before each segment
    halo_seq: Optional[Tensor]         # (rows, d_conv - 1) their document ids
    entries: Optional[Tensor]          # (rows, h, p, n) fp32: each segment's true entry state
    a: Optional[Tensor]                # the segments' decays, as the exchange keeps them
    cont: Optional[Tensor]             # where documents continue across segments, likewise


def method_forward(call, plan, gate=None):
    """The forward of a Call under its Plan: y (rows, s, h, p), the global sequence's final state
    (batch, h, p, n) fp32, and Kept. gate None, or (z, out), both (rows, s, h, p): y silu(z) is
    written into out too, in the output kernel's pass over y."""
    alone = plan.segments.count == 1     # a world of one, contiguous: nothing before it, nothing to send
    halo, halo_seq = (None, None) if alone else receive_halo(call.xBC, call.seq_idx, plan)          # (1)
    conv_out = _conv1d_fwd(call.xBC, call.conv_weight, call.conv_bias, halo, call.seq_idx, halo_seq,
                           silu=plan.silu)                                                          # (1)
    ssd = ssd_tensors(*split_xBC(conv_out, plan.fwd), call, plan.fwd)   # x, B, C; dt' and cs formed once
    summary = Summary(ssd, plan.fwd)                                    # (2) the state pass from a zero entry
    if alone:                            # the entry is the initial state, the exit the final state
        y, final = ssd_output(ssd, summary, call.initial_states, need_exit=True, gate=gate)        # (4)
        return y, final, Kept(None, None, None, None, None)
    entries, final, a, cont = plan.exchange.entry_states(*summary.affine(), call.seq_idx, call.initial_states,
                                                         plan)                                      # (3)
    y, _ = ssd_output(ssd, summary, entries, gate=gate)                                             # (4)
    return y, final, Kept(halo, halo_seq, entries, a, cont)


def method_backward(dy, dfinal, call, kept, plan, dxBC=None, ddt=None):
    """The gradients of method_forward, as a Call (None where an input is None). dy (rows, s, h, p);
    dfinal (batch, h, p, n) or None. dxBC (rows, s, conv_dim) and ddt (rows, s, h): views of the
    caller's buffers to write those gradients into, or None.

    The conv and the state passes are recomputed, not kept (they grow with the sequence); the
    backward state pass gives G, the pull of a segment's outputs on its entry, which is known
    before the gradient at its exit; G travels while the forward state pass is
    recomputed; one chunk backward writes dx, dB, dC straight into the conv backward's input."""
    alone = plan.segments.count == 1
    conv_out = _conv1d_fwd(call.xBC, call.conv_weight, call.conv_bias, kept.halo, call.seq_idx, kept.halo_seq,
                           silu=plan.silu)
    ssd = ssd_tensors(*split_xBC(conv_out, plan.bwd), call, plan.bwd)
    grad_pass = GradPass(dy, ssd, plan.bwd)                                    # (4) reversed: G
    if alone:
        dexit, states = dfinal, chunk_states(ssd, plan.bwd, call.initial_states)
    else:                                                                      # (3) reversed, and (2) again
        dexit, dinit, states = plan.exchange.exit_grads(grad_pass.G, dfinal, kept.a, kept.cont, plan,
                                                        lambda: chunk_states(ssd, plan.bwd, kept.entries))
    dconv_out = torch.empty_like(conv_out)
    dx, dB, dC, ddt, dA, dD, ddt_bias, dentry = ssd_grads(ssd, states, grad_pass, dy, dexit,
                                                          *split_xBC(dconv_out, plan.bwd), ddt)
    if alone:
        dinit = dentry
    dxBC, dhalo, dweight, dbias = _conv1d_bwd(dconv_out, call.xBC, call.conv_weight, call.conv_bias, kept.halo,
                                              call.seq_idx, kept.halo_seq, silu=plan.silu, dx=dxBC)
    if dhalo is not None:                                                      # (1) reversed
        return_halo_grad(dxBC, dhalo, plan)
    if not plan.holds_first:                       # initial_states reach segment 0 alone
        dinit = torch.zeros_like(dinit)
    return Call(dxBC, ddt, _as(dweight, call.conv_weight), _as(dbias, call.conv_bias), _as(ddt_bias, call.dt_bias),
                _as(dA, call.A), _as(dD, call.D), _as(dinit, call.initial_states), None)


def _as(grad, like):
    """grad in like's dtype, or None where like is None."""
    return None if like is None else grad if grad.dtype == like.dtype else grad.to(like.dtype)


class Steps(NamedTuple):
    """A forward and its backward, for StatePassingFn: forward(arg, *tensors) -> (outputs, kept
    tensors); backward(arg, the outputs' gradients, tensors, kept) -> a gradient or None per tensor.
    arg is what they share: a plan, or (compiled) the options it is built from."""
    forward: Callable
    backward: Callable


class StatePassingFn(torch.autograd.Function):
    """The method, differentiable: the module's one autograd function. The backward has the
    inputs and what `steps.forward` kept (nothing that grows with the sequence) and recomputes
    the rest. Every public entry runs it: the fused core with METHOD (below), the mixer entry and
    the single-device SSD with steps that add their own work around the method's (sections 13,
    14), and each of them compiled with the same steps wrapped as opaque ops (section 11)."""

    @staticmethod
    def forward(ctx, steps, arg, *tensors):
        outputs, kept = steps.forward(arg, *tensors)
        ctx.save_for_backward(*tensors, *kept)
        ctx.steps, ctx.arg, ctx.inputs = steps, arg, len(tensors)
        ctx.set_materialize_grads(False)          # an unused output's gradient stays None
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        return None, None, *ctx.steps.backward(ctx.arg, grads, saved[:ctx.inputs], saved[ctx.inputs:])


def _method_forward_step(plan, *call):
    y, final, kept = method_forward(Call(*call), plan)
    return (y, final), kept


def _method_backward_step(plan, grads, call, kept):
    dy, dfinal = grads
    call = Call(*call)
    if dy is None:                                 # only the final state reached the loss
        dy = call.xBC.new_zeros((*call.dt.shape, plan.headdim))
    return method_backward(dy, dfinal, call, Kept(*kept), plan)


# The fused core: StatePassingFn.apply(METHOD, plan, *call) -> (y, final state)
METHOD = Steps(_method_forward_step, _method_backward_step)


# ---------------------------------------------------------------------------------------------
# 2. The causal conv1d
#    Step (1): each segment's depthwise causal conv1d + bias + SiLU, its halo before it
#    (README "The conv halo"). Each kernel is followed by its launcher.
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
# so one pass over tokens s of [halo, xBC] gives all three; du at s < 0 is the halo's gradient,
# which the caller sends back to the halo's owner.
#
# Both kernels walk the tokens in order, one per step: a register tile cannot be shifted by
# tokens, so the u of the d-1 tokens before (the window) and, backward, their partial du are
# carried from step to step. A program walks one strip on a GPU, many side by side as one tile in
# the interpreter (which pays per step). On a GPU a step is bound by the instructions it issues,
# not its bytes, so: only a strip's first steps can reach the halo, and they run apart, so that
# the rest load neither the halo nor its ids; and each tap's document mask is applied once, to the
# window, whose masked taps serve the pre-activation and, backward, dweight. No atomics: dweight
# and dbias are per-program partial sums, summed by torch in a fixed order. Offsets are int64. The
# conv is a pass of its own: the chunk kernels load each x, B and C tile more than once (B and C
# per head), and a conv in their loads, repeated for each, measured slower (README "The conv halo").
# ---------------------------------------------------------------------------------------------

# A conv kernel gathers its operands once into tuples: xs, u's two sources (the shard, then the
# halo: base pointer, channel offsets, token stride of each); w, the taps; seqs, the ids of both.


@triton.jit
def _conv_program(x_ptr, stride_x, halo_ptr, stride_h, w_ptr, stride_w, bias_ptr, stride_bias, seq_ptr, stride_s,
                  hseq_ptr, stride_hs, dim, BC: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """This program's batch row bb and channels offs_c (int64, (BC,)) with their mask, and its
    operands: xs, w (a tuple of TAPS (1, BC) fp32 tiles, tap 0, the oldest token, first), bias
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
    """Document id (M,) int64 of tokens t (M,); -1 where there is none (those tokens hold zeros)."""
    s_row0, stride_s_l, hs_row0, stride_hs_l = seqs
    r = t.to(tl.int64)
    doc = tl.load(s_row0 + r * stride_s_l, mask=(t >= 0) & (t < seqlen), other=-1)
    if HAS_HALO_SEQ:
        in_h = (t < 0) & (t >= -HALO)
        doc = tl.where(in_h, tl.load(hs_row0 + (r + HALO) * stride_hs_l, mask=in_h, other=-1), doc)
    return doc.to(tl.int64)


@triton.jit
def _u_at(xs, t, mask_c, seqlen, HALO: tl.constexpr, HAS_HALO: tl.constexpr):
    """u at tokens t (M,) as an (M, BC) fp32 tile, zero outside [-HALO, seqlen). Tokens < 0
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
def _in_document(vs, docs, doc, HAS_SEQ: tl.constexpr):
    """vs (TAPS-1 (M, BC) tiles, one a window token) with those of a token of another document
    than token t (docs, their ids; doc, t's) zeroed."""
    if not HAS_SEQ:
        return vs
    out = ()
    for k in tl.static_range(len(vs)):
        out = out + (tl.where((docs[k] == doc)[:, None], vs[k], 0.0),)
    return out


@triton.jit
def _preact(w, bias, taps, u, TAPS: tl.constexpr):
    """Pre-activation (M, BC) of tokens t: bias + sum_k w_k u[t-(TAPS-1)+k], from the taps (u of
    tokens t-TAPS+1 .. t-1, those of another document zeroed) and token t itself."""
    acc = bias[None, :] + w[TAPS - 1] * u
    for k in tl.static_range(TAPS - 1):
        acc += w[k] * taps[k]
    return acc


@triton.jit
def _sigmoid(p, FAST: tl.constexpr):
    """sigmoid(p), float32. FAST (compiled only: the interpreter runs no PTX): the GPU's approximate
    2^x and 1/x, a few ulp off: four instructions for tl.sigmoid's eleven, in issue-bound kernels."""
    if FAST:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [p * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [e + 1.0],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.sigmoid(p)


@triton.jit
def _conv_fwd_steps(i0, win, docs, first, xs, w, bias, seqs, mask_c, o_row0, o_col, stride_o_l, seqlen, S,
                    TAPS: tl.constexpr, U: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr,
                    HAS_HALO_SEQ: tl.constexpr, SILU: tl.constexpr, FAST: tl.constexpr):
    """U steps from token first + i0 of each strip: their u loaded first, then each convolved with
    the window. Returns the window (u and ids of the TAPS-1 tokens last convolved)."""
    ahead = ()
    for k in tl.static_range(U):
        t = first + (i0 + k)
        doc = _doc(seqs, t, seqlen, TAPS - 1, HAS_HALO_SEQ) if HAS_SEQ else t.to(tl.int64)
        ahead = ahead + ((_u_at(xs, t, mask_c, seqlen, TAPS - 1, HAS_HALO), doc),)
    for k in tl.static_range(U):
        t = first + (i0 + k)
        u, doc = ahead[k]
        p = _preact(w, bias, _in_document(win, docs, doc, HAS_SEQ), u, TAPS)   # (M, BC)
        out = p * _sigmoid(p, FAST) if SILU else p
        tl.store(o_row0 + t.to(tl.int64)[:, None] * stride_o_l + o_col[None, :], out.to(o_row0.dtype.element_ty),
                 mask=((t >= first) & (t < first + S) & (t < seqlen))[:, None] & mask_c[None, :])
        win = win[1:] + (u,)
        docs = docs[1:] + (doc,)
    return win, docs


@_Launched
@triton.jit
def _conv_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, halo_ptr, seq_ptr, hseq_ptr, out_ptr,
    seqlen, dim, S, stride_x, stride_w, stride_bias, stride_h, stride_s, stride_hs, stride_o,
    TAPS: tl.constexpr, M: tl.constexpr, BC: tl.constexpr, U: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr,
    SILU: tl.constexpr, FAST: tl.constexpr,
):
    """M strips of S output tokens each (this program's), BC channels, one batch row: out =
    silu(pre-activation), or the pre-activation itself without SILU. A step loads U tokens of
    every strip, then convolves them one by one with the window of the d-1 tokens before. Only
    the first steps can reach a token before the shard (the halo's): they run apart, so that the
    rest load neither the halo nor its ids."""
    bb, offs_c, mask_c, xs, w, bias, seqs = _conv_program(
        x_ptr, stride_x, halo_ptr, stride_h, w_ptr, stride_w, bias_ptr, stride_bias, seq_ptr, stride_s, hseq_ptr,
        stride_hs, dim, BC, TAPS, HAS_BIAS)
    o_row0, o_col = out_ptr + bb * stride_o.b, offs_c * stride_o.c
    first = (tl.program_id(0) * M + tl.arange(0, M)) * S       # (M,) each strip's first token
    win = (tl.zeros((M, BC), dtype=tl.float32),) * (TAPS - 1)  # u of the TAPS-1 tokens before
    docs = (tl.full((M,), -1, tl.int64),) * (TAPS - 1)           # and their documents
    # the steps up to the last that reads a halo token (t < 0); the first TAPS-1 only fill the window
    FIRST_STEPS: tl.constexpr = U * ((TAPS - 1 + U - 1) // U) if HAS_HALO else 0
    for i0 in tl.static_range(-(TAPS - 1), -(TAPS - 1) + FIRST_STEPS, U):
        win, docs = _conv_fwd_steps(i0, win, docs, first, xs, w, bias, seqs, mask_c, o_row0, o_col, stride_o.l,
                                    seqlen, S, TAPS, U, HAS_HALO, HAS_SEQ, HAS_HALO_SEQ, SILU, FAST)
    for i0 in range(-(TAPS - 1) + FIRST_STEPS, S, U):
        win, docs = _conv_fwd_steps(i0, win, docs, first, xs, w, bias, seqs, mask_c, o_row0, o_col, stride_o.l,
                                    seqlen, S, TAPS, U, False, HAS_SEQ, False, SILU, FAST)


@functools.lru_cache(maxsize=None)
def _conv_launch(tokens, dim, batch, launch, has_bias, has_halo, has_seq, silu):
    """A conv launch over `tokens` tokens of `dim` channels (launch: a ConvLaunch): its grid, tokens
    per strip S, and constexprs, no larger than the tensor needs. Cached: it runs every launch."""
    M, BC = launch.strips, min(launch.channels, max(16, _next_pow2(dim)))
    S = launch.tokens
    while S > launch.unroll and _cdiv(tokens, M * S) * _cdiv(dim, BC) * batch < launch.programs:
        S //= 2
    S = max(1, min(S, _cdiv(tokens, M)))
    flags = dict(M=M, BC=BC, U=launch.unroll, num_warps=launch.warps, HAS_BIAS=has_bias, HAS_HALO=has_halo,
                 HAS_SEQ=has_seq, HAS_HALO_SEQ=has_seq and has_halo,     # without a halo its ids don't matter
                 SILU=silu, FAST=not INTERPRET)
    return (_cdiv(tokens, M * S), _cdiv(dim, BC), batch), S, flags


def _conv1d_fwd(xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, out=None, silu=True):
    """silu(causal depthwise conv(xBC) + bias) (without silu the conv alone), (b, l, dim) in xBC's
    dtype, or written into out. xBC (b, l, dim); weight (dim, d); bias (dim,); halo (b, d-1, dim),
    the tokens before the shard (None: zeros); seq_idx (b, l), halo_seq (b, d-1) document ids."""
    (b, l, dim), d = xBC.shape, weight.shape[1]
    grid, S, flags = _conv_launch(l, dim, b, tuning().conv_fwd, bias is not None, halo is not None,
                                  seq_idx is not None, silu)
    halo_seq = halo_seq.to(seq_idx.dtype) if flags["HAS_HALO_SEQ"] else None   # one id type in the kernel
    if out is None:
        out = torch.empty((b, l, dim), device=xBC.device, dtype=xBC.dtype)
    _conv_fwd_kernel[grid](
        xBC, weight, xBC if bias is None else bias, xBC if halo is None else halo, xBC if seq_idx is None else seq_idx,
        xBC if halo_seq is None else halo_seq, out, l, dim, S, _BLC(*xBC.stride()), _CK(*weight.stride()),
        0 if bias is None else bias.stride(0), _ZERO_BLC if halo is None else _BLC(*halo.stride()),
        _ZERO_BL if seq_idx is None else _BL(*seq_idx.stride()),
        _ZERO_BL if halo_seq is None else _BL(*halo_seq.stride()),
        _BLC(*out.stride()), TAPS=d, **flags)
    return out


@triton.jit
def _conv_bwd_steps(i0, win, docs, part, dw, db, first, xs, w, bias, seqs, mask_c, do_row0, do_col, stride_do_l,
                    dx_row0, dx_col, stride_dx_l, dhalo_ptr, bb, offs_c, dim, seqlen, S,
                    TAPS: tl.constexpr, U: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr,
                    HAS_HALO_SEQ: tl.constexpr, NEED_DHALO: tl.constexpr, SILU: tl.constexpr, FAST: tl.constexpr):
    """U steps from token first + i0 of each strip: their dout and u loaded first, then each
    step's g handed to the du of the tokens before it. Returns what the steps carry: the window,
    the partial du, and the partial dweight and dbias."""
    ahead = ()
    for k in tl.static_range(U):
        t = first + (i0 + k)
        has_g = (t >= first) & (t >= 0) & (t < seqlen)      # g = 0 off [0, seqlen) and before the window fills
        do = tl.load(do_row0 + t.to(tl.int64)[:, None] * stride_do_l + do_col[None, :],
                     mask=has_g[:, None] & mask_c[None, :], other=0.0)
        doc = _doc(seqs, t, seqlen, TAPS - 1, HAS_HALO_SEQ) if HAS_SEQ else t.to(tl.int64)
        ahead = ahead + ((_u_at(xs, t, mask_c, seqlen, TAPS - 1, HAS_HALO), do, doc),)
    for k in tl.static_range(U):
        t = first + (i0 + k)
        u, do, doc = ahead[k]
        taps = _in_document(win, docs, doc, HAS_SEQ)
        g = do.to(tl.float32)
        if SILU:
            p = _preact(w, bias, taps, u, TAPS)
            sig = _sigmoid(p, FAST)
            g = g * sig * (1.0 + p * (1.0 - sig))     # silu'(p) = sig(p) (1 + p (1 - sig(p)))
        # g[t]'s share of du at token t-TAPS+1+j (weight j): zero across a document boundary
        share = _in_document((g,) * (TAPS - 1), docs, doc, HAS_SEQ)
        s = t - (TAPS - 1)                                  # the du token g[t] completes
        du = part[0] + w[0] * share[0]
        keep = (s >= first) & (s < first + S) & (s < seqlen)
        tl.store(dx_row0 + s.to(tl.int64)[:, None] * stride_dx_l + dx_col[None, :], du.to(dx_row0.dtype.element_ty),
                 mask=(keep & (s >= 0))[:, None] & mask_c[None, :])
        if NEED_DHALO:
            tl.store(dhalo_ptr + (bb * (TAPS - 1) + s.to(tl.int64) + (TAPS - 1))[:, None] * dim + offs_c[None, :],
                     du, mask=(keep & (s < 0))[:, None] & mask_c[None, :])
        nxt = ()
        for j in tl.static_range(1, TAPS - 1):
            nxt = nxt + (part[j] + w[j] * share[j],)
        part = nxt + (w[TAPS - 1] * g,)
        # dweight and dbias count the g tokens this strip owns: one select, then FMAs
        g_own = tl.where(((t >= first) & (t < first + S))[:, None], g, 0.0)
        sums = ()
        for j in tl.static_range(TAPS - 1):                # the taps' masks are g's
            sums = sums + (dw[j] + taps[j] * g_own,)
        dw = sums + (dw[TAPS - 1] + u * g_own,)
        db += g_own
        win = win[1:] + (u,)
        docs = docs[1:] + (doc,)
    return win, docs, part, dw, db


@_Launched
@triton.jit
def _conv_bwd_kernel(
    dout_ptr, x_ptr, w_ptr, bias_ptr, halo_ptr, seq_ptr, hseq_ptr,
    dx_ptr, dhalo_ptr, dw_part_ptr,
    seqlen, dim, S, stride_do, stride_x, stride_w, stride_bias, stride_h, stride_s, stride_hs, stride_dx,
    TAPS: tl.constexpr, M: tl.constexpr, BC: tl.constexpr, U: tl.constexpr, SHIFT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_HALO_SEQ: tl.constexpr,
    NEED_DHALO: tl.constexpr, SILU: tl.constexpr, FAST: tl.constexpr,
):
    """M strips of S du tokens each of tokens s of [halo, xBC] (from s = -SHIFT; SHIFT is TAPS-1
    with a halo), BC channels, one batch row: du per token (into dx, or dhalo for s < 0), and the
    dweight, dbias of the g tokens it owns in this program's partial rows. Step t computes g[t]
    and hands its share to the du of tokens t-TAPS+1 .. t (`part`), the oldest then complete; a
    strip's steps run from TAPS-1 tokens before its first du token to TAPS-1 past its last. As
    forward, the first steps, which alone can reach the halo, run apart from the rest."""
    bb, offs_c, mask_c, xs, w, bias, seqs = _conv_program(
        x_ptr, stride_x, halo_ptr, stride_h, w_ptr, stride_w, bias_ptr, stride_bias, seq_ptr, stride_s, hseq_ptr,
        stride_hs, dim, BC, TAPS, HAS_BIAS)
    do_row0, do_col = dout_ptr + bb * stride_do.b, offs_c * stride_do.c
    dx_row0, dx_col = dx_ptr + bb * stride_dx.b, offs_c * stride_dx.c

    first = (tl.program_id(0) * M + tl.arange(0, M)) * S - SHIFT   # (M,) each strip's first du token
    zero = tl.zeros((M, BC), dtype=tl.float32)
    win = (zero,) * (TAPS - 1)                          # u of tokens t-TAPS+1 .. t-1
    docs = (tl.full((M,), -1, tl.int64),) * (TAPS - 1)  # their documents
    part = (zero,) * (TAPS - 1)                         # du of tokens t-TAPS+1 .. t-1, so far
    dw = (zero,) * TAPS                                 # dweight per tap, per strip
    db = zero
    # the steps up to the last that reads a halo token (t < 0); the halo's du, whose tokens
    # complete TAPS-1 steps after they are read, may still be stored after them. With ids and no
    # halo they run apart too: the loop left compiles to fewer instructions (README "The conv halo")
    FIRST_STEPS: tl.constexpr = U * ((SHIFT + TAPS - 1 + U - 1) // U) if HAS_HALO or HAS_SEQ else 0
    for i0 in tl.static_range(-(TAPS - 1), -(TAPS - 1) + FIRST_STEPS, U):
        win, docs, part, dw, db = _conv_bwd_steps(
            i0, win, docs, part, dw, db, first, xs, w, bias, seqs, mask_c, do_row0, do_col, stride_do.l, dx_row0,
            dx_col, stride_dx.l, dhalo_ptr, bb, offs_c, dim, seqlen, S, TAPS, U, HAS_HALO, HAS_SEQ, HAS_HALO_SEQ,
            NEED_DHALO, SILU, FAST)
    for i0 in range(-(TAPS - 1) + FIRST_STEPS, S + TAPS - 1, U):
        win, docs, part, dw, db = _conv_bwd_steps(
            i0, win, docs, part, dw, db, first, xs, w, bias, seqs, mask_c, do_row0, do_col, stride_do.l, dx_row0,
            dx_col, stride_dx.l, dhalo_ptr, bb, offs_c, dim, seqlen, S, TAPS, U, False, HAS_SEQ, False,
            NEED_DHALO, SILU, FAST)

    # this program's partials: dweight's (dim, TAPS) as the weight lies, then dbias's (dim,)
    at = (bb * tl.num_programs(0) + tl.program_id(0)) * (TAPS + HAS_BIAS) * dim
    for j in tl.static_range(TAPS):
        tl.store(dw_part_ptr + at + offs_c * TAPS + j, tl.sum(dw[j], axis=0), mask=mask_c)
    if HAS_BIAS:
        tl.store(dw_part_ptr + at + TAPS * dim + offs_c, tl.sum(db, axis=0), mask=mask_c)


def _conv1d_bwd(dout, xBC, weight, bias=None, halo=None, seq_idx=None, halo_seq=None, need_dhalo=True, silu=True,
                dx=None):
    """Gradients of _conv1d_fwd: dxBC (into dx if given), dhalo (b, d-1, dim) fp32 (None without
    need_dhalo or a halo), dweight (dim, d), dbias (dim,) or None."""
    (b, l, dim), d = xBC.shape, weight.shape[1]
    shift = d - 1 if halo is not None else 0    # du tokens start at the halo's
    grid, S, flags = _conv_launch(shift + l, dim, b, tuning().conv_bwd, bias is not None, halo is not None,
                                  seq_idx is not None, silu)
    halo_seq = halo_seq.to(seq_idx.dtype) if flags["HAS_HALO_SEQ"] else None   # one id type in the kernel
    need_dhalo = bool(need_dhalo) and halo is not None
    if dx is None:
        dx = torch.empty((b, l, dim), device=xBC.device, dtype=xBC.dtype)
    dhalo = torch.empty((b, d - 1, dim), device=xBC.device, dtype=torch.float32) if need_dhalo else None
    # dweight's and dbias's per-program partials in one buffer: one sum gives both, in their layouts
    parts = torch.empty((b * grid[0], (d + (bias is not None)) * dim), device=xBC.device, dtype=torch.float32)
    _conv_bwd_kernel[grid](
        dout, xBC, weight, xBC if bias is None else bias, xBC if halo is None else halo,
        xBC if seq_idx is None else seq_idx, xBC if halo_seq is None else halo_seq,
        dx, parts if dhalo is None else dhalo, parts,
        l, dim, S, _BLC(*dout.stride()), _BLC(*xBC.stride()), _CK(*weight.stride()),
        0 if bias is None else bias.stride(0), _ZERO_BLC if halo is None else _BLC(*halo.stride()),
        _ZERO_BL if seq_idx is None else _BL(*seq_idx.stride()),
        _ZERO_BL if halo_seq is None else _BL(*halo_seq.stride()),
        _BLC(*dx.stride()), TAPS=d, SHIFT=shift, NEED_DHALO=need_dhalo, **flags)
    sums = parts.sum(dim=0)                                                      # ((d [+ 1]) dim,)
    if bias is None:
        return dx, dhalo, sums.view(dim, d), None
    dweight, dbias = sums.split_with_sizes((dim * d, dim))                       # (dim * d,), (dim,)
    return dx, dhalo, dweight.view(dim, d), dbias


# ---------------------------------------------------------------------------------------------
# 3. dt and the decays of one chunk
#    The SSD's tensors; dt' and the chunks' cumulative sums, formed once per call; and the
#    decays every kernel reads from them, for one chunk of one head (README "The chunked form").
# ---------------------------------------------------------------------------------------------


class SSD(NamedTuple):
    """The tensors of one SSD call as its kernels read them."""
    x: Tensor                          # (b, l, h, p)
    dt: Tensor                         # (b, l, h) raw: dt_bias, softplus and dt_limit as the plan says
    A: Tensor                          # (h,)
    B: Tensor                          # (b, l, g, n)
    C: Tensor                          # (b, l, g, n)
    D: Optional[Tensor]                # (h,) or (h, p)
    dt_bias: Optional[Tensor]          # (h,)
    seq_idx: Optional[Tensor]          # (b, l) int32 document ids
    cums: Tensor                       # (b * nchunks, h, 3, Q) fp32: dt', cs hi, cs lo (_dt_cumsums)


def split_xBC(conv_out, plan):
    """Views of a (rows, s, conv_dim) tensor's channels [x | B | C] as x (rows, s, h, p) and B, C
    (rows, s, g, n): the conv's output, or its gradient's buffer."""
    (rows, s, _), (s_r, s_s, _), at = conv_out.shape, conv_out.stride(), conv_out.storage_offset()
    h, p, g, n = plan.nheads, plan.headdim, plan.ngroups, plan.dstate
    # one as_strided a view (a slice, then unflatten, would cost the host two ops); channels unit-strided
    return (conv_out.as_strided((rows, s, h, p), (s_r, s_s, p, 1), at),
            conv_out.as_strided((rows, s, g, n), (s_r, s_s, n, 1), at + h * p),
            conv_out.as_strided((rows, s, g, n), (s_r, s_s, n, 1), at + h * p + g * n))


def ssd_tensors(x, B, C, call, plan):
    """The SSD of x, B, C and the call's dt, A, D, dt_bias and seq_idx (call: any structure with
    those fields), with dt' and the chunks' cumulative sums formed once: every kernel reads them."""
    return SSD(x, call.dt, call.A, B, C, call.D, call.dt_bias, call.seq_idx,
               _dt_cumsums(call.dt, call.dt_bias, call.A, plan))


@triton.jit
def _softplus(v):
    # log(1 + exp(v)) without losing exp(v) when it is tiny, linear above 20 like torch
    u = tl.exp(-tl.abs(v))
    log1p_u = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)


# What a kernel needs to form dt', as one flat tuple (Triton takes tuples; triton 3.6 cannot read
# a tuple nested in one): raw dt (b, l, h) and its strides, dt_bias (h,) (a stand-in when
# absent), A (h,), and dt_limit's bounds.
_DtArgs = collections.namedtuple("_DtArgs", "dt stride_b stride_l stride_h dt_bias A dt_min dt_max")


@triton.jit
def _chunk_dt(dts, b, h, t, seqlen, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """dt', dt'*A and d dt'/d dt_raw (the softplus slope, zero where dt_limit clamps) at tokens t
    of heads h of batch row b, float32; zero past the sequence end. t and h broadcast: a chunk's
    (Q,) tokens of one head, or (Q, 1) tokens of (1, BH) heads. dts is a _DtArgs."""
    valid = t < seqlen
    dt = tl.load(dts.dt + b.to(tl.int64) * dts.stride_b + t.to(tl.int64) * dts.stride_l + h * dts.stride_h,
                 mask=valid, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dts.dt_bias + h).to(tl.float32)
    slope = tl.full(dt.shape, 1.0, tl.float32)
    if DT_SOFTPLUS:
        slope = tl.where(dt > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-dt)))
        dt = _softplus(dt)
    # always clamped, as mamba_ssm's kernels do: the default (0, inf) turns a negative dt' into 0
    slope = tl.where((dt >= dts.dt_min) & (dt <= dts.dt_max), slope, 0.0)
    dt = tl.minimum(tl.maximum(dt, dts.dt_min), dts.dt_max)
    dt = tl.where(valid, dt, 0.0)
    return dt, dt * tl.load(dts.A + h).to(tl.float32), tl.where(valid, slope, 0.0)


# dt' and cs (the cumsum of dt'*A) are formed once per call, into a buffer every chunk kernel
# reads: formed in each, they would be repeated per head and program, on replicated vectors.

@triton.jit
def _cums_row(cums, slot, h, nheads, Q: tl.constexpr):
    """The start of chunk slot `slot`'s (b * nchunks + c, int64) rows dt', cs hi, cs lo of head
    h in the buffer."""
    return cums + (slot * nheads + h) * (3 * Q)


@_Launched
@triton.jit
def _dt_cumsum_kernel(dts, out_ptr, seqlen, nheads: tl.constexpr, Q: tl.constexpr, BH: tl.constexpr,
                      HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """dt' and cs of one (batch row, chunk) for BH heads, (Q, BH) tiles, cs summed in float64
    along the tokens and kept as a float32 (hi, lo) pair. A block of heads a program: a token's
    heads are neighbours in dt, so each row of the tile is one read."""
    pid = tl.program_id(0)
    hb, slot = pid % (nheads // BH), (pid // (nheads // BH)).to(tl.int64)
    nchunks = tl.cdiv(seqlen, Q)
    offs_q = tl.arange(0, Q)[:, None]                                                  # (Q, 1)
    h = hb * BH + tl.arange(0, BH)[None, :]                                            # (1, BH)
    dt, dA, _ = _chunk_dt(dts, slot // nchunks, h, (slot % nchunks) * Q + offs_q, seqlen, HAS_DT_BIAS, DT_SOFTPLUS)
    cs = tl.cumsum(dA.to(tl.float64), axis=0)
    hi = cs.to(tl.float32)
    base = _cums_row(out_ptr, slot, h, nheads, Q) + offs_q
    tl.store(base, dt)
    tl.store(base + Q, hi)
    tl.store(base + 2 * Q, (cs - hi.to(tl.float64)).to(tl.float32))


def _dt_cumsums(dt, dt_bias, A, plan):
    """The call's (b * nchunks, h, 3, Q) float32 buffer: rows dt', cs hi, cs lo."""
    out = torch.empty(plan.batch * plan.nchunks, plan.nheads, 3, plan.Q, device=dt.device, dtype=torch.float32)
    _dt_cumsum_kernel[(plan.batch * plan.nchunks * (plan.nheads // plan.cumsum_heads),)](
        plan.dts(dt, dt_bias, A), out, plan.seqlen, plan.nheads, Q=plan.Q, BH=plan.cumsum_heads,
        **plan.launch.get("cumsum", {}), **plan.dt_flags)
    return out


@triton.jit
def _seq_ids(seq_ptr, stride_seq, b, start, seqlen, Q: tl.constexpr):
    """Document ids of one chunk: per token (Q,), the last valid token's, and the token's
    before the chunk (for chunk 0, the first token's: initial_states reach the first document)."""
    t = start + tl.arange(0, Q)
    base = seq_ptr + b.to(tl.int64) * stride_seq.b
    seq = tl.load(base + t.to(tl.int64) * stride_seq.l, mask=t < seqlen, other=-1)
    last = tl.load(base + tl.cast(tl.minimum(start + Q, seqlen) - 1, tl.int64) * stride_seq.l)
    prev = tl.load(base + tl.cast(tl.maximum(start - 1, 0), tl.int64) * stride_seq.l)
    return seq, last, prev


@triton.jit
def _chunk_last(cums, b, h, c, seqlen, nheads, Q: tl.constexpr):
    """Chunk c's cs at its last token, its whole sum, as the float32 pair (hi, lo): past the
    sequence's end dt' = 0 and cs stays."""
    base = _cums_row(cums, b.to(tl.int64) * tl.cdiv(seqlen, Q) + c, h, nheads, Q)
    return tl.load(base + 2 * Q - 1), tl.load(base + 3 * Q - 1)


@triton.jit
def _chunk_decays(cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q: tl.constexpr, HAS_SEQ: tl.constexpr,
                  last=None):
    """Every decay of chunk c of one head, from the call's dt' and cs (cums, _dt_cumsum_kernel's
    buffer), with `last` its _chunk_last where the caller read it ahead (else None); a kernel's
    unused ones are removed as dead code:
      dt'            (Q,) the processed dt
      e              (Q,) exp(cs_i), the entry state's decay to token i (0 for a new document)
      w_dec          (Q,) exp(cs_last - cs_j), token j's decay to the exit (0 if it never gets there)
      decay          ()   exp(cs_last), the entry's decay to the exit (0 across a document start)
      hi, lo         (Q,) cs as a float32 pair, exact to float64 rounding (the pairs' decays)
      seq            (Q,) the tokens' document ids (zeros without documents)
      total          ()   cs_last in float64
      continues      ()   whether the chunk's last token continues the document it was entered in"""
    base = _cums_row(cums, b.to(tl.int64) * tl.cdiv(seqlen, Q) + c, h, nheads, Q)
    offs_q = tl.arange(0, Q)
    dt = tl.load(base + offs_q)
    hi, lo = tl.load(base + Q + offs_q), tl.load(base + 2 * Q + offs_q)
    if last is None:
        last = _chunk_last(cums, b, h, c, seqlen, nheads, Q)
    hi_last, lo_last = last
    e = tl.exp(hi + lo)
    w_dec = tl.exp((hi_last - hi) + (lo_last - lo))
    decay = tl.exp(hi_last + lo_last)
    seq = tl.zeros((Q,), dtype=tl.int32)
    continues = tl.full((), 1, tl.int1)
    if HAS_SEQ:
        seq, last, prev = _seq_ids(seq_ptr, stride_seq, b, c * Q, seqlen, Q)
        e = tl.where(seq == prev, e, 0.0)               # the entry reaches only its own document
        w_dec = tl.where(seq == last, w_dec, 0.0)       # only the last document reaches the exit
        continues = last == prev
        decay = tl.where(continues, decay, 0.0)         # a document starts inside: the chunk cuts through
    return dt, e, w_dec, decay, hi, lo, seq, hi_last.to(tl.float64) + lo_last.to(tl.float64), continues


@triton.jit
def _pair_decay(hi, lo, seq, Q: tl.constexpr, HAS_SEQ: tl.constexpr):
    """L (Q, Q) of one chunk: exp(cs_i - cs_j) over its causal pairs i >= j of one document, else
    0. The other pairs are removed by selection before exp, so their exponent (of either sign,
    and infinite for pairs far apart under growth) never meets a multiplication."""
    offs_q = tl.arange(0, Q)
    causal = offs_q[:, None] >= offs_q[None, :]
    if HAS_SEQ:
        causal = causal & (seq[:, None] == seq[None, :])
    diff = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
    # 2^x flushing subnormals (ex2.approx.ftz: 2 instructions an element where tl.exp takes 5, in
    # kernels bound by their instruction issue): a decay below 2^-126 is exactly 0, where tl.exp
    # and mamba_ssm keep it as a subnormal
    return tl.math.exp2(tl.where(causal, diff, float("-inf")) * 1.4426950408889634)


@triton.jit
def _selected_exp(keep, log_v):
    """exp(log_v) where keep, else exactly 0: a decay cut by a document start, chosen rather than
    multiplied by 0 (a growth's exp may be inf there, and inf * 0 is NaN)."""
    return tl.where(keep, tl.exp(log_v.to(tl.float32)), 0.0)


# ---------------------------------------------------------------------------------------------
# 4. The forward: state pass, summary scan, outputs
#    Steps (2) to (4) on one GPU (README "The chunked form", "The affine state summary"). Each
#    kernel is followed by its launcher; Summary and ssd_output run them.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _run_program(nheads, headdim, dstate, n_p_tiles, n_n_tiles, heads_per_group, BP: tl.constexpr,
                 BN: tl.constexpr):
    """A state-pass (or run-summary) program's run, batch row, head and group, and its (BP, BN)
    tile of the state: the grid is (runs x p-tiles x n-tiles, batch x heads)."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    n_tiles = n_p_tiles * n_n_tiles
    run, pid_p, pid_n = pid // n_tiles, (pid % n_tiles) // n_n_tiles, pid % n_n_tiles
    b, h = pid_bh // nheads, pid_bh % nheads
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
    return run, b, h, h // heads_per_group, offs_p, offs_n, mask_pn, (pid_p == 0) & (pid_n == 0)


@triton.jit
def _run_chunks(run, nchunks, chunks_per_run):
    """A run's chunks c_first .. c_end - 1, and how many (the last run may be short)."""
    c_first = run * chunks_per_run
    c_end = tl.minimum(c_first + chunks_per_run, nchunks)
    return c_first, c_end, c_end - c_first


@triton.jit
def _walk_chunk(i, c_first, c_end, FROM_END: tl.constexpr):
    """The chunk of step i of a walk over the run's chunks c_first .. c_end - 1: in order, or
    FROM_END from the last to the first."""
    return c_end - 1 - i if FROM_END else c_first + i


@triton.jit
def _chunk_tile(ptr, stride, b, i, c, seqlen, offs, dim, Q: tl.constexpr):
    """Chunk c's (Q, C) tile of head or group i, channels offs (C,) of dim, zeros past the end."""
    _, _, t64, valid = _chunk_rows(c, seqlen, Q)
    return _load_tile(ptr, stride, b.to(tl.int64), t64, i, offs, valid[:, None] & (offs[None, :] < dim))


@triton.jit
def _register_loads(head_ptr, stride_head, cums, b, h, c, seqlen, offs_p, headdim, nheads, Q: tl.constexpr):
    """What a walk's step on chunk c loads into registers: the head's tile h (Q, BP) and the
    chunk's _chunk_last. The state pass loads them a step early: the compiler copies a step's
    other loads (the group's tile, the cs rows) ahead by itself, into shared memory, but issues
    these late in the step before, so that each step waited on them. The run summaries load their
    own step's: reading ahead there held more registers and ran slower (measured on an H100)."""
    return (_chunk_tile(head_ptr, stride_head, b, h, c, seqlen, offs_p, headdim, Q),
            _chunk_last(cums, b, h, c, seqlen, nheads, Q))


@triton.jit
def _weighted_operands(ht, group_ptr, stride_group, b, g, c, w, seqlen, offs_n, dstate, Q: tl.constexpr):
    """Chunk c's operands of a state-pass step, hw (Q, BP) and g (Q, BN), whose product hw^T g
    is sum_j w_j h_j g_j^T: h the per-head tile ht weighted by w (Q,), rounded to g's dtype."""
    gt = _chunk_tile(group_ptr, stride_group, b, g, c, seqlen, offs_n, dstate, Q)
    return (ht.to(tl.float32) * w[:, None]).to(gt.dtype), gt


@_Launched
@triton.jit
def _state_pass_kernel(
    head_ptr, group_ptr, cums, seq_ptr, edge_ptr, chunk_ptr, decay_ptr, sum_ptr, a_ptr,
    seqlen, nheads: tl.constexpr, headdim: tl.constexpr, dstate: tl.constexpr, nchunks, chunks_per_run,
    n_p_tiles: tl.constexpr, n_n_tiles: tl.constexpr, heads_per_group: tl.constexpr,
    stride_head, stride_group, stride_seq,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_SEQ: tl.constexpr, REVERSE: tl.constexpr, HAS_EDGE: tl.constexpr, STORE_GAMMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One run of one (batch, head, state tile), from zero, or with HAS_EDGE from the value at the
    run's edge (edge_ptr): walk its chunks carrying a (BP, BN) value V, store V as each chunk
    meets it, then  V <- decay V + sum_j w_j h_j g_j^T  (h the per-head operand, g the per-group
    one). Forward (x, B): chunks in order, V the state entering a chunk, w_j = w_dec_j dt'_j.
    REVERSE (dy, C): chunks last to first, V the gradient arriving at a chunk's exit, w_i = e_i.
    Also store what is left at the run's far edge (from zero: its summary S_ext, or G, the pull
    of its outputs on its entry) and its decay a; with STORE_GAMMA (the forward's pass from
    zero), per chunk the decay from the run's entry to the chunk's, gamma(c): from zero, chunk
    c's true entry state is states(c) + gamma(c) S_entry."""
    # first_tile: one program per head writes the decays
    run, b, h, g, offs_p, offs_n, mask_pn, first_tile = _run_program(nheads, headdim, dstate, n_p_tiles, n_n_tiles,
                                                                     heads_per_group, BP, BN)
    run_slot = _run_slot(b, run, nchunks, chunks_per_run)

    V = tl.zeros((BP, BN), dtype=tl.float32)                                      # (BP, BN)
    if HAS_EDGE:
        V = tl.load(edge_ptr + _state_tile(run_slot, h, offs_p, offs_n, nheads, headdim, dstate), mask=mask_pn,
                    other=0.0)
    log_decay = tl.zeros((), dtype=tl.float64)
    alive = tl.full((), 1, tl.int1)                   # False once a document starts in between
    c_first, c_end, steps = _run_chunks(run, nchunks, chunks_per_run)
    ahead = _register_loads(head_ptr, stride_head, cums, b, h, _walk_chunk(0, c_first, c_end, REVERSE), seqlen,
                            offs_p, headdim, nheads, Q)
    for i in range(steps):
        c = _walk_chunk(i, c_first, c_end, REVERSE)
        ht, last = ahead
        ahead = _register_loads(head_ptr, stride_head, cums, b, h,                # the last step re-reads its own
                                _walk_chunk(tl.minimum(i + 1, steps - 1), c_first, c_end, REVERSE), seqlen, offs_p,
                                headdim, nheads, Q)
        chunk_slot = _chunk_slot(b, c, seqlen, Q)
        tl.store(chunk_ptr + _state_tile(chunk_slot, h, offs_p, offs_n, nheads, headdim, dstate),
                 V.to(chunk_ptr.dtype.element_ty), mask=mask_pn)
        if STORE_GAMMA:
            tl.store(decay_ptr + _slot_head(chunk_slot, h, nheads), _selected_exp(alive, log_decay),
                     mask=first_tile)
        dt, e, w_dec, decay, hi, lo, seq, total, continues = _chunk_decays(
            cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q, HAS_SEQ, last)
        w = e if REVERSE else w_dec * dt                                           # (Q,)
        log_decay += total
        alive = alive & continues
        hw, gt = _weighted_operands(ht, group_ptr, stride_group, b, g, c, w, seqlen, offs_n, dstate, Q)  # (Q, BP), (Q, BN)
        V = decay * V + tl.dot(tl.trans(hw), gt, input_precision=DOT_PRECISION)   # (BP, BN)

    tl.store(a_ptr + _slot_head(run_slot, h, nheads), _selected_exp(alive, log_decay), mask=first_tile)
    tl.store(sum_ptr + _state_tile(run_slot, h, offs_p, offs_n, nheads, headdim, dstate), V, mask=mask_pn)


def _per_run(plan, dev):
    """Empty buffers of a state value (b, nruns, h, p, n) and a decay (b, nruns, h) per run, fp32."""
    return (torch.empty(plan.batch, plan.nruns, plan.nheads, plan.headdim, plan.dstate, device=dev,
                        dtype=torch.float32),
            torch.empty(plan.batch, plan.nruns, plan.nheads, device=dev, dtype=torch.float32))


def _state_pass(head_in, group_in, ssd, plan, reverse, run_edge=None, gamma=False):
    """Every run from zero, or from its edge value run_edge (b, nruns, h, p, n) fp32, forward
    (head_in = x, group_in = B) or reverse (dy, C): per chunk the carried value
    (b, nchunks, h, p, n) and, with gamma, its decay from the run's entry (b, nchunks, h), else
    None; per run what is left (b, nruns, h, p, n) and its decay a (b, nruns, h)."""
    dev = head_in.device
    per_chunk = torch.empty(plan.batch, plan.nchunks, plan.nheads, plan.headdim, plan.dstate, device=dev,
                            dtype=plan.state_dtype)
    decay = torch.empty(plan.batch, plan.nchunks, plan.nheads, device=dev, dtype=torch.float32) if gamma else None
    left, a = _per_run(plan, dev)
    # a pointer the kernel never touches (no edge to read, no gamma to store) gets a buffer of this call
    _state_pass_kernel[(plan.nruns * plan.n_p_tiles * plan.n_n_tiles, plan.batch * plan.nheads)](
        head_in, group_in, ssd.cums, ssd.seq_idx, left if run_edge is None else run_edge, per_chunk,
        a if decay is None else decay, left, a,
        plan.seqlen, plan.nheads, plan.headdim, plan.dstate, plan.nchunks, plan.chunks_per_run, plan.n_p_tiles,
        plan.n_n_tiles, plan.heads_per_group, _BLHP(*head_in.stride()), _BLGN(*group_in.stride()),
        _ZERO_BL if ssd.seq_idx is None else _BL(*ssd.seq_idx.stride()),
        Q=plan.Q, BP=plan.BP_state, BN=plan.BN_state, REVERSE=reverse, HAS_EDGE=run_edge is not None,
        STORE_GAMMA=gamma, DOT_PRECISION=plan.state_precision, **plan.launch.get("state", {}), **plan.flags)
    return per_chunk, decay, left, a


@_Launched
@triton.jit
def _summary_scan_kernel(
    src_ptr, a_ptr, cont_ptr, start_ptr, out_ptr, end_ptr, count, nheads, size,
    BLOCK: tl.constexpr, HAS_CONT: tl.constexpr, HAS_START: tl.constexpr, REVERSE: tl.constexpr,
):
    """The exclusive scan over `count` summaries (of runs, or of segments), for one (batch, head,
    slice of the p*n state): forward from S_entry(0) = start, reverse from dS_exit(last) = start,
        S_entry(k+1) = cont_{k+1} (a_k S_entry(k) + S_ext(k))
        dS_exit(k-1) = cont_k (G(k) + a_k dS_exit(k))
    cont_k = 0 where k starts a new document. Stores every S_entry(k) (dS_exit(k)) and, in end,
    the last's exit (the initial state's gradient). Buffers contiguous: (b, count, h, size)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    if HAS_START:
        S = tl.load(start_ptr + _slot_head(b, h, nheads) * size + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(count):
        slot = b * count + (count - 1 - i if REVERSE else i)
        if HAS_CONT and not REVERSE:
            S *= tl.load(cont_ptr + slot)
        tl.store(out_ptr + _slot_head(slot, h, nheads) * size + offs, S.to(out_ptr.dtype.element_ty), mask=mask)
        a = tl.load(a_ptr + _slot_head(slot, h, nheads))
        S = a * S + tl.load(src_ptr + _slot_head(slot, h, nheads) * size + offs, mask=mask)
        if HAS_CONT and REVERSE:
            S *= tl.load(cont_ptr + slot)
    tl.store(end_ptr + _slot_head(b, h, nheads) * size + offs, S, mask=mask)


def _f32(t):
    """t as a contiguous float32 tensor; t itself (no op on the host) where it is one, None stays None."""
    return t if t is None or t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def scan_summaries(src, a, start=None, cont=None, reverse=False, out_dtype=torch.float32):
    """The exclusive scan over K summaries, in fp32. Forward (src = S_ext (b, K, h, p, n), a
    (b, K, h), start the initial state (b, h, p, n) or None): the entry state of each
    (b, K, h, p, n), stored in out_dtype, and the exit state of the last (b, h, p, n) fp32.
    Reverse (src = G, start the final state's gradient): the gradient arriving at each one's exit
    and the initial state's gradient. cont (b, K) fp32 document-continuation flags or None."""
    b, K, h, p, n = src.shape
    src, a, start, cont = _f32(src), _f32(a), _f32(start), _f32(cont)
    out = torch.empty_like(src, dtype=out_dtype)
    end = torch.empty(b, h, p, n, device=src.device, dtype=torch.float32)
    whole = _next_pow2(p * n)
    BLOCK = min(tuning().scan_block or whole, whole)
    _summary_scan_kernel[(_cdiv(p * n, BLOCK), b * h)](
        src, a, cont, start, out, end, K, h, p * n,
        BLOCK=BLOCK, HAS_CONT=cont is not None, HAS_START=start is not None, REVERSE=reverse)
    return out, end


# What gives every chunk's true entry state in the forward, stored(c) + gamma(c) * run(r): what
# the state pass stored from a zero run entry, (b, nchunks, h, p, n); gamma, (b, nchunks, h) fp32;
# the runs' entry states, (b, nruns, h, p, n) in the state dtype (fp32 where given as one run's
# entry), or a stand-in. (The backward, which reads each state twice and with its exit gradient
# too, walks the runs again from their true edges instead: section 5.)
_ChunkEdge = collections.namedtuple("_ChunkEdge", "stored decay run")


@triton.jit
def _true_chunk_edge(edge, chunk_slot, run_slot, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                     HAS_RUN: tl.constexpr):
    """A (BP, BN) float32 tile of chunk c's true entry state, edge a _ChunkEdge: the stored
    value, plus, with HAS_RUN, gamma(c) * run(r), what the run's entry state adds."""
    v = tl.load(edge.stored + _state_tile(chunk_slot, h, offs_p, offs_n, nheads, headdim, dstate),
                mask=mask_pn, other=0.0).to(tl.float32)
    if HAS_RUN:
        decay = tl.load(edge.decay + _slot_head(chunk_slot, h, nheads))
        S = tl.load(edge.run + _state_tile(run_slot, h, offs_p, offs_n, nheads, headdim, dstate), mask=mask_pn,
                    other=0.0)
        v += decay * S.to(tl.float32)
    return v


@_Launched
@triton.jit
def _output_fwd_kernel(
    x_ptr, B_ptr, C_ptr, cums, D_ptr, seq_ptr, y_ptr, in_edge, z_ptr, out_ptr,
    seqlen, headdim: tl.constexpr, dstate: tl.constexpr, heads_per_group: tl.constexpr, heads_per_program,
    nheads: tl.constexpr, batch, chunks_per_run,
    stride_x, stride_B, stride_C, stride_D, stride_seq, stride_y, stride_z, stride_out,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_ENTRY: tl.constexpr, HAS_Z: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST: tl.constexpr,
):
    """Outputs of one (chunk, batch, block of heads_per_program heads of one group, p-block):
    C.B is formed once and reused by the block's heads; then per head
        y = (C.B * L * dt') x + e C S_in (+ D x)
    with L the chunk's pair decays, e the entry's decays, and S_in = states(c) + gamma(c) S_entry
    (in_edge, a _ChunkEdge): the run's entry state is folded in here."""
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
    mask_pn = (offs_p[:, None] < headdim) & (offs_n[None, :] < dstate)
    t64 = t.to(tl.int64)
    b64 = b.to(tl.int64)
    chunk_slot, run_slot = _chunk_slots(b, c, seqlen, chunks_per_run, Q)

    Bm = _load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn)          # (Q, BN)
    Cm = _load_tile(C_ptr, stride_C, b64, t64, g, offs_n, mask_qn)          # (Q, BN)
    CB = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION)                   # (Q, Q)
    for hh in range(heads_per_program):
        h = h0 + hh
        dt, e, w_dec, decay, hi, lo, seq, total, continues = _chunk_decays(
            cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q, HAS_SEQ)
        M = CB * _pair_decay(hi, lo, seq, Q, HAS_SEQ) * dt[None, :]                 # (Q, Q)
        x = _load_tile(x_ptr, stride_x, b64, t64, h, offs_p, mask_qp)              # (Q, BP)
        y = tl.dot(M.to(x.dtype), x, input_precision=DOT_PRECISION)                # (Q, BP)
        S_in = _true_chunk_edge(in_edge, chunk_slot, run_slot, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                                HAS_ENTRY)                                         # (BP, BN)
        y += e[:, None] * tl.dot(Cm, tl.trans(S_in.to(Cm.dtype)), input_precision=DOT_PRECISION)
        if HAS_D:
            Dv = tl.load(D_ptr + h * stride_D.h + offs_p * stride_D.p, mask=offs_p < headdim, other=0.0)
            y += Dv.to(tl.float32)[None, :] * x.to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(_tile_ptrs(y_ptr, stride_y, b64, t64, h, offs_p), y, mask=mask_qp)
        if HAS_Z:           # the mixer's gate y silu(z) on the stored y, as a kernel after this one would
            z = _load_tile(z_ptr, stride_z, b64, t64, h, offs_p, mask_qp).to(tl.float32)
            tl.store(_tile_ptrs(out_ptr, stride_out, b64, t64, h, offs_p),
                     (y.to(tl.float32) * (z * _sigmoid(z, FAST))).to(out_ptr.dtype.element_ty), mask=mask_qp)


def _D_strides(D):
    """D's strides as (h, p): a (h,) D broadcasts over p with a zero stride."""
    if D is None:
        return _HP(0, 0)
    return _HP(D.stride(0), 0 if D.dim() == 1 else D.stride(1))


def _output_fwd(ssd, states, gamma, run_entry, plan, y=None, gate=None):
    """y (b, l, h, p) of the SSD; run_entry (b, nruns, h, p, n): each run's entry state, or
    None for zero. gate: None, or (z, out), both (b, l, h, p): out = y silu(z) too."""
    x, B, C, D = ssd.x, ssd.B, ssd.C, ssd.D
    if y is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    z, out = (y, y) if gate is None else gate
    _output_fwd_kernel[(plan.nchunks * plan.batch * (plan.nheads // plan.heads_per_output), plan.n_p_blocks)](
        x, B, C, ssd.cums, D, ssd.seq_idx, y, _ChunkEdge(states, gamma, gamma if run_entry is None else run_entry),
        z, out, plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.heads_per_output, plan.nheads,
        plan.batch, plan.chunks_per_run,
        _BLHP(*x.stride()), _BLGN(*B.stride()), _BLGN(*C.stride()), _D_strides(D),
        _ZERO_BL if ssd.seq_idx is None else _BL(*ssd.seq_idx.stride()),
        _BLHP(*y.stride()), _BLHP(*z.stride()), _BLHP(*out.stride()),
        Q=plan.Q, BP=plan.BP, BN=plan.BN, HAS_D=D is not None, HAS_ENTRY=run_entry is not None, HAS_Z=gate is not None,
        DOT_PRECISION=plan.precision, FAST=not INTERPRET, **plan.launch.get("output", {}), **plan.flags)
    return y


class Summary:
    """A sequence's (or segment's) state pass from a zero entry: what its outputs need besides
    the entry state. Its affine summary S_out = a * S_entry + S_ext (fp32) is `affine()`."""

    def __init__(self, ssd, plan):
        self.states, self.gamma, self.run_ext, self.run_a = _state_pass(ssd.x, ssd.B, ssd, plan, False, gamma=True)
        self.plan = plan

    def affine(self):
        """(S_ext (b, h, p, n), a (b, h)): its runs composed."""
        if self.plan.nruns == 1:
            return self.run_ext[:, 0], self.run_a[:, 0]
        return scan_summaries(self.run_ext, self.run_a)[1], self.run_a.prod(dim=1)

    def run_entries(self, entry, need_exit=False):
        """Each run's entry state (b, nruns, h, p, n) or None for zero, given the sequence's entry
        (or None), and with need_exit the sequence's exit state (b, h, p, n) fp32. The scan stores
        the entries in the state dtype, as the chunk states are: every output program reads one,
        and in bf16 their half of the bytes made the forward faster (BENCHMARKS.md)."""
        if entry is not None:                 # the kernels read it as a (b, nruns, h, p, n) buffer
            entry = _f32(entry)
        if self.plan.nruns > 1:
            return scan_summaries(self.run_ext, self.run_a, entry,      # later runs start where earlier end
                                  out_dtype=self.plan.state_dtype)
        run_entry = None if entry is None else entry[:, None]     # one run: no scan; absent stays absent
        if not need_exit:
            return run_entry, None
        S_ext, a = self.affine()
        return run_entry, (S_ext if entry is None else S_ext + a[:, :, None, None] * entry)


def ssd_output(ssd, summary, entry=None, y=None, need_exit=False, gate=None):
    """The outputs of a summarised sequence entered with state `entry` (b, h, p, n) or zero; with
    need_exit also its exit state (else None). gate (z, out): the mixer's y silu(z) written into
    out as well, in the same pass over y."""
    run_entry, exit_ = summary.run_entries(entry, need_exit)
    y = _output_fwd(ssd, summary.states, summary.gamma, run_entry, summary.plan, y, gate)
    return y, exit_


# ---------------------------------------------------------------------------------------------
# 5. The backward: the state pass reversed, chunk gradients
#    README "Backward". Each kernel is followed by its launcher; chunk_states, GradPass and
#    ssd_grads run them.
# ---------------------------------------------------------------------------------------------


# The backward reads every chunk's entry state and exit gradient in two kernels (BC, x), with
# both edges at once: folding a run's edge into each of them there cost more than one more pass
# over the run's tokens (BENCHMARKS.md). So the backward gives its kernels the true values: each
# run's summary first, as one product over its tokens with no chunk states stored; the scan then
# gives each run's true edge; the state pass walks the runs from those and stores true values.
# One run, entered (or left) with a known value, needs neither summary nor scan.

@_Launched
@triton.jit
def _run_summary_kernel(
    head_ptr, group_ptr, cums, seq_ptr, sum_ptr, a_ptr,
    seqlen, nheads: tl.constexpr, headdim: tl.constexpr, dstate: tl.constexpr, nchunks, chunks_per_run,
    n_p_tiles: tl.constexpr, n_n_tiles: tl.constexpr, heads_per_group: tl.constexpr,
    stride_head, stride_group, stride_seq,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_SEQ: tl.constexpr, REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One run's summary for one (batch, head, state tile): what _state_pass_kernel leaves at the
    run's far edge from zero, and the run's decay a, without its chunk states. Each token's term
    is weighted by its decay to the far edge,
        S_ext = sum_j decay(j -> run exit) dt'_j x_j B_j^T      G = sum_i decay(run entry -> i) dy_i C_i^T
    (h and g as in the state pass), so the walk, from the far edge inward, accumulates products
    and never rescales what it has summed: the tensor cores pipeline it."""
    run, b, h, g, offs_p, offs_n, mask_pn, first_tile = _run_program(nheads, headdim, dstate, n_p_tiles, n_n_tiles,
                                                                     heads_per_group, BP, BN)

    S = tl.zeros((BP, BN), dtype=tl.float32)                                      # (BP, BN)
    log_far = tl.zeros((), dtype=tl.float64)          # from this chunk's far edge to the run's
    alive = tl.full((), 1, tl.int1)                   # False once a document starts in between
    c_first, c_end, steps = _run_chunks(run, nchunks, chunks_per_run)
    FROM_END: tl.constexpr = not REVERSE              # from the run's far edge inward
    for i in range(steps):
        c = _walk_chunk(i, c_first, c_end, FROM_END)
        ht, last = _register_loads(head_ptr, stride_head, cums, b, h, c, seqlen, offs_p, headdim, nheads, Q)
        dt, e, w_dec, decay, hi, lo, seq, total, continues = _chunk_decays(
            cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q, HAS_SEQ, last)
        w = e if REVERSE else w_dec * dt                                           # (Q,) to c's far edge
        w = tl.where(w != 0.0, w * _selected_exp(alive, log_far), 0.0)            # to the run's
        log_far += total
        alive = alive & continues
        hw, gt = _weighted_operands(ht, group_ptr, stride_group, b, g, c, w, seqlen, offs_n, dstate, Q)  # (Q, BP), (Q, BN)
        S = tl.dot(tl.trans(hw), gt, acc=S, input_precision=DOT_PRECISION)        # (BP, BN)

    run_slot = _run_slot(b, run, nchunks, chunks_per_run)
    tl.store(a_ptr + _slot_head(run_slot, h, nheads), _selected_exp(alive, log_far), mask=first_tile)
    tl.store(sum_ptr + _state_tile(run_slot, h, offs_p, offs_n, nheads, headdim, dstate), S, mask=mask_pn)


def _run_summaries(head_in, group_in, ssd, plan, reverse):
    """Every run's summary, forward (x, B: S_ext) or reverse (dy, C: G), (b, nruns, h, p, n)
    fp32, and its decay a (b, nruns, h)."""
    left, a = _per_run(plan, head_in.device)
    n_p, n_n = _cdiv(plan.headdim, plan.BP_summary), _cdiv(plan.dstate, plan.BN_summary)
    _run_summary_kernel[(plan.nruns * n_p * n_n, plan.batch * plan.nheads)](
        head_in, group_in, ssd.cums, ssd.seq_idx, left, a,
        plan.seqlen, plan.nheads, plan.headdim, plan.dstate, plan.nchunks, plan.chunks_per_run, n_p, n_n,
        plan.heads_per_group, _BLHP(*head_in.stride()), _BLGN(*group_in.stride()),
        _ZERO_BL if ssd.seq_idx is None else _BL(*ssd.seq_idx.stride()),
        Q=plan.Q, BP=plan.BP_summary, BN=plan.BN_summary, REVERSE=reverse, DOT_PRECISION=plan.state_precision,
        **plan.launch.get("summary", {}), **plan.flags)
    return left, a


def chunk_states(ssd, plan, entry=None):
    """Every chunk's true entry state (b, nchunks, h, p, n), in the state dtype, of a sequence
    entered with `entry` (b, h, p, n) or zero."""
    entry = _f32(entry)
    if plan.nruns == 1:
        run_entry = None if entry is None else entry[:, None]
    else:
        run_entry, _ = scan_summaries(*_run_summaries(ssd.x, ssd.B, ssd, plan, False), entry)
    return _state_pass(ssd.x, ssd.B, ssd, plan, False, run_entry)[0]


class GradPass:
    """A sequence's pass in reverse: G (b, h, p, n), the pull of its outputs on its entry state
    with zero gradient at its exit, which is known before that gradient is (it is what a CP rank
    sends in backward); then, given it, every chunk's true exit gradient."""

    def __init__(self, dy, ssd, plan):
        self.dy, self.ssd, self.plan, self._runs = dy, ssd, plan, None

    def runs(self):
        """The runs' G and decays a (the reverse summaries), computed once."""
        if self._runs is None:
            self._runs = _run_summaries(self.dy, self.ssd.C, self.ssd, self.plan, True)
        return self._runs

    @property
    def G(self):
        """Its runs' pulls composed (one reverse scan); only CP needs it alone."""
        run_G, run_a = self.runs()
        return run_G[:, 0] if self.plan.nruns == 1 else scan_summaries(run_G, run_a, reverse=True)[1]

    def exit_grads(self, dexit):
        """Given the gradient at the sequence's exit (b, h, p, n) or None: every chunk's true exit
        gradient (b, nchunks, h, p, n) in the state dtype, and the gradient at the sequence's
        entry, G + a dexit (b, h, p, n)."""
        dexit = _f32(dexit)
        if self.plan.nruns == 1:
            run_dexit = None if dexit is None else dexit[:, None]
        else:
            run_dexit, dentry = scan_summaries(*self.runs(), dexit, reverse=True)
        dstates, _, left, _ = _state_pass(self.dy, self.ssd.C, self.ssd, self.plan, True, run_dexit)
        return dstates, (left[:, 0] if self.plan.nruns == 1 else dentry)


@triton.jit
def _tf32_split(a):
    """a float32 = hi + lo exactly: hi keeps the 11 leading significant bits, all that tf32
    holds (the low 13 mantissa bits cleared), and |lo| < 2^-10 |a|."""
    hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, a - hi


@triton.jit
def _operand_column(r):
    """Which column of a (M, K) accumulator tile _exact_dot reads as its operand's column r: in
    each 8 columns, a thread's accumulator holds columns 2l and 2l+1 and its tf32 operand
    columns l and l+4 (the mma's register layouts), so reading them in that order moves nothing."""
    return (r // 8) * 8 + (r % 4) * 2 + (r % 8) // 4


@triton.jit
def _exact_dot(a, b01):
    """a (M, K) float32 times b01 (K, N), a matrix of 0s and 1s, at float32's accuracy whatever
    the kernel's precision: two tensor-core products of a's split (b01 and hi are exact in tf32,
    lo loses at most 2^-11 of itself), each term within 2^-20 of itself: nothing cancels that the
    exact sum would not cancel. a's columns are read in the operand's order: b01's row r must be
    the row for a's column _operand_column(r)."""
    M: tl.constexpr = a.shape[0]
    K: tl.constexpr = a.shape[1]
    a = tl.reshape(tl.permute(tl.reshape(a, (M, K // 8, 4, 2)), (0, 1, 3, 2)), (M, K))
    hi, lo = _tf32_split(a)
    return tl.dot(hi, b01, input_precision="tf32") + tl.dot(lo, b01, input_precision="tf32")


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

@_Launched
@triton.jit
def _chunk_bwd_group_kernel(
    x_ptr, B_ptr, C_ptr, cums, seq_ptr, dout_ptr,
    CB_ptr, dCB_ptr, ddt_pairs_ptr, ddA_pairs_ptr, part_ptr,
    seqlen, headdim: tl.constexpr, dstate: tl.constexpr, heads_per_group: tl.constexpr, ngroups: tl.constexpr, batch,
    part_row, stride_x, stride_B, stride_C, stride_seq, stride_do,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
    HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (chunk, batch, group, split of the group's heads): C.B (the first split stores it) and
    the split's share of dCB for the other two kernels, and for each of its heads its pairs'
    share of dt' and of d(dt'A) (Q,) and its dD partial (in the chunk's row of the partials,
    after the x kernel's 2 * nheads: _chunk_bwd). A group's heads are split (SPLITS > 1) only
    where chunks and groups are too few to fill the GPU: one group of many heads, short sequences."""
    # groups and their splits vary fastest: the programs running at once share a chunk's x and dy in L2
    pid = tl.program_id(0)
    split = pid % (ngroups * SPLITS)                                     # g * SPLITS + s
    g, s = split // SPLITS, split % SPLITS
    b = (pid // (ngroups * SPLITS)) % batch
    c = pid // (ngroups * SPLITS * batch)
    start, offs_q, offs_p, t64, valid, mask_qp = _chunk_tokens(c, seqlen, headdim, Q, BP)
    b64 = b.to(tl.int64)
    nheads = heads_per_group * ngroups
    chunk_slot = _chunk_slot(b, c, seqlen, Q)

    # Every (Q, Q) tile here holds the pair (i, j) at [j, i], a row per earlier token: a head's
    # dt' shares then sum along rows, within threads. The tiles are stored as the other kernels read them.
    CB = tl.zeros((Q, Q), dtype=tl.float32)                                        # [j, i]: C_i . B_j
    for n0 in range(0, dstate, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_qn = valid[:, None] & (offs_n[None, :] < dstate)
        Cm = _load_tile(C_ptr, stride_C, b64, t64, g, offs_n, mask_qn)
        Bm = _load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn)
        CB += tl.dot(Bm, tl.trans(Cm), input_precision=DOT_PRECISION)
    if s == 0:
        tl.store(CB_ptr + _pair_tile(chunk_slot, g, ngroups, Q), tl.trans(CB))

    after = (_operand_column(offs_q)[:, None] >= offs_q[None, :]).to(tl.float32)  # (Q, Q) [i >= k], _exact_dot's rows
    dCB = tl.zeros((Q, Q), dtype=tl.float32)
    for hh in range(heads_per_group // SPLITS):
        h = g * heads_per_group + s * (heads_per_group // SPLITS) + hh
        dt, e, w_dec, decay, hi, lo, seq, total, continues = _chunk_decays(
            cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q, HAS_SEQ)
        L = tl.trans(_pair_decay(hi, lo, seq, Q, HAS_SEQ))                          # [j, i]
        x = _load_tile(x_ptr, stride_x, b64, t64, h, offs_p, mask_qp)              # (Q, BP)
        dy = _load_tile(dout_ptr, stride_do, b64, t64, h, offs_p, mask_qp).to(x.dtype)
        dxyL = tl.dot(x, tl.trans(dy), input_precision=DOT_PRECISION) * L          # [j, i]: (dy_i . x_j) L_ij
        dCB += dxyL * dt[:, None]                                                  # this head's pull on C.B
        dxyM = dxyL * CB
        at = _slot_head(chunk_slot, h, nheads) * Q + offs_q                            # this head's (Q,) slot
        tl.store(ddt_pairs_ptr + at, tl.sum(dxyM, axis=1))
        # d(dt'_k A) from the pairs i >= k > j that span k: a sum along i >= k, as a product with
        # the 0/1 matrix `after` on the tensor cores (in place of a scan along i), then a sum
        # over j < k. L is 0 off the causal pairs of one document, so V needs no mask, and the
        # diagonal j = i never meets j < k <= i.
        V = dxyM * dt[:, None]                                                     # [j, i]: pair (i, j)
        spans = _exact_dot(V, after)                                     # [j, k]: sum_{i>=k} V_ij
        tl.store(ddA_pairs_ptr + at, tl.sum(tl.where(offs_q[:, None] < offs_q[None, :], spans, 0.0), axis=0))
        dD_at = part_ptr + chunk_slot * part_row + 2 * nheads
        if HAS_D and D_PER_CHANNEL:        # (h, p): sum over tokens of dy x, per channel
            tl.store(dD_at + h * headdim + offs_p,
                     tl.sum(dy.to(tl.float32) * x.to(tl.float32), axis=0), mask=offs_p < headdim)
        elif HAS_D:                        # (h,): the trace of dy x^T, which dxyL holds (L_ii = 1)
            tl.store(dD_at + h,
                     tl.sum(tl.sum(tl.where(offs_q[:, None] == offs_q[None, :], dxyL, 0.0), axis=1), axis=0))
    tl.store(dCB_ptr + _pair_tile(chunk_slot, split, ngroups * SPLITS, Q), tl.trans(dCB).to(dCB_ptr.dtype.element_ty))


@_Launched
@triton.jit
def _chunk_bwd_BC_kernel(
    x_ptr, B_ptr, C_ptr, cums, seq_ptr, states_ptr, dstates_ptr, dout_ptr, dCB_ptr,
    dB_ptr, dC_ptr, ddA_entry_part_ptr, dw_part_ptr, carry_part_ptr,
    seqlen, headdim: tl.constexpr, dstate: tl.constexpr, heads_per_group: tl.constexpr, ngroups: tl.constexpr, batch,
    n_n_tiles: tl.constexpr,
    stride_x, stride_B, stride_C, stride_seq, stride_do, stride_dB, stride_dC,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
    HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dB and dC of one (chunk, batch, group, state tile), the group's heads summed in registers
    (each written once: no atomics), and per head, over this tile, what the x kernel needs of the
    states: the entry's share of d(dt'A), C_i . (e_i S_in^T dy_i) (Q,); the exit's pull on token
    j's weight w_j, B_j . (x_j^T dS_out) (Q,); and <dS_out, S_in> ()."""
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
    chunk_slot = _chunk_slot(b, c, seqlen, Q)

    Bm = _load_tile(B_ptr, stride_B, b64, t64, g, offs_n, mask_qn)                # (Q, BN)
    Cm = _load_tile(C_ptr, stride_C, b64, t64, g, offs_n, mask_qn)                # (Q, BN)
    if SPLITS == 1:
        dCB = tl.load(dCB_ptr + _pair_tile(chunk_slot, g, ngroups, Q)).to(Cm.dtype)     # (Q, Q)
    else:                           # the splits' float32 shares, summed in their order
        dCB_sum = tl.zeros((Q, Q), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            dCB_sum += tl.load(dCB_ptr + _pair_tile(chunk_slot, g * SPLITS + s, ngroups * SPLITS, Q))
        dCB = dCB_sum.to(Cm.dtype)
    dC = tl.dot(dCB, Bm, input_precision=DOT_PRECISION)                            # (Q, BN)
    dB = tl.dot(tl.trans(dCB), Cm, input_precision=DOT_PRECISION)
    for hh in range(heads_per_group):
        h = g * heads_per_group + hh
        dt, e, w_dec, decay, hi, lo, seq, total, continues = _chunk_decays(
            cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q, HAS_SEQ)
        x = _load_tile(x_ptr, stride_x, b64, t64, h, offs_p, mask_qp)              # (Q, BP)
        dy = _load_tile(dout_ptr, stride_do, b64, t64, h, offs_p, mask_qp)
        # the states in the products' operand dtype, as the forward's products take them
        at_state = _state_tile(chunk_slot, h, offs_p, offs_n, nheads, headdim, dstate)
        S_in = tl.load(states_ptr + at_state, mask=mask_pn, other=0.0).to(x.dtype)      # (BP, BN)
        dS_out = tl.load(dstates_ptr + at_state, mask=mask_pn, other=0.0).to(x.dtype)  # (BP, BN)
        part = _slot_head(chunk_slot, h, nheads) * n_n_tiles + pid_n
        tl.store(carry_part_ptr + part, tl.sum(tl.sum(dS_out.to(tl.float32) * S_in.to(tl.float32), axis=1), axis=0))
        xdS = tl.dot(x, dS_out, input_precision=DOT_PRECISION)                     # (Q, BN) x_j^T dS_out
        dB += (w_dec * dt)[:, None] * xdS
        tl.store(dw_part_ptr + part * Q + offs_q, tl.sum(Bm.to(tl.float32) * xdS, axis=1))
        # e scales the product's rows, as the output kernel scales C S_in: one rounding of dy fewer
        from_entry = e[:, None] * tl.dot(dy.to(x.dtype), S_in, input_precision=DOT_PRECISION)  # (Q, BN)
        dC += from_entry
        tl.store(ddA_entry_part_ptr + part * Q + offs_q, tl.sum(Cm.to(tl.float32) * from_entry, axis=1))
    tl.store(_tile_ptrs(dB_ptr, stride_dB, b64, t64, g, offs_n), dB.to(dB_ptr.dtype.element_ty), mask=mask_qn)
    tl.store(_tile_ptrs(dC_ptr, stride_dC, b64, t64, g, offs_n), dC.to(dC_ptr.dtype.element_ty), mask=mask_qn)


@_Launched
@triton.jit
def _chunk_bwd_x_kernel(
    B_ptr, dts, cums, D_ptr, seq_ptr, dstates_ptr, dout_ptr, CB_ptr,
    ddt_pairs_ptr, ddA_pairs_ptr, ddA_entry_part_ptr, dw_part_ptr, carry_part_ptr, dx_ptr, ddt_ptr, part_ptr,
    seqlen, headdim: tl.constexpr, dstate: tl.constexpr, heads_per_group: tl.constexpr, nheads: tl.constexpr, batch,
    n_bc_tiles: tl.constexpr, part_row,
    stride_B, stride_D, stride_seq, stride_do, stride_dx, stride_ddt,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_SEQ: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dx and dt of one (chunk, batch, head), and the chunk's partials of dA and of dt_bias's
    gradient (the sum of raw dt's): dx from the group kernel's C.B and the exit gradient; dt from
    the group kernel's pair shares and the BC kernel's entry, exit and state shares. ddt (b, l, h)
    in its buffer's dtype; the partials (b * nchunks, part_row) fp32: dA's (h,), then dt_bias's
    (h,), in the chunk's row (the group kernel's dD partials follow)."""
    # heads vary fastest: the programs running at once share a chunk, so its B stays in L2
    pid = tl.program_id(0)
    h = pid % nheads
    b = (pid // nheads) % batch
    c = pid // (nheads * batch)
    g = h // heads_per_group
    start, offs_q, offs_p, t64, valid, mask_qp = _chunk_tokens(c, seqlen, headdim, Q, BP)
    b64 = b.to(tl.int64)
    chunk_slot = _chunk_slot(b, c, seqlen, Q)

    dt, e, w_dec, decay, hi, lo, seq, total, continues = _chunk_decays(
        cums, seq_ptr, stride_seq, b, h, c, seqlen, nheads, Q, HAS_SEQ)
    _, _, slope = _chunk_dt(dts, b, h, start + offs_q, seqlen, HAS_DT_BIAS, DT_SOFTPLUS)   # d dt'/d dt_raw
    L = _pair_decay(hi, lo, seq, Q, HAS_SEQ)
    CB = tl.load(CB_ptr + _pair_tile(chunk_slot, g, nheads // heads_per_group, Q))
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
        dS_out = tl.load(dstates_ptr + _state_tile(chunk_slot, h, offs_p, offs_n, nheads, headdim, dstate),
                         mask=mask_pn, other=0.0).to(dy.dtype)                     # (BP, BN)
        dx = tl.dot(Bw, tl.trans(dS_out), acc=dx, input_precision=DOT_PRECISION)   # (Q, BP)
    tl.store(_tile_ptrs(dx_ptr, stride_dx, b64, t64, h, offs_p), dx.to(dx_ptr.dtype.element_ty), mask=mask_qp)

    at = _slot_head(chunk_slot, h, nheads)
    entry_share = tl.zeros((Q,), dtype=tl.float32)
    dw = tl.zeros((Q,), dtype=tl.float32)                                         # d w_j = x_j . dS_out B_j
    carry = tl.zeros((), dtype=tl.float32)
    for i in range(n_bc_tiles):
        entry_share += tl.load(ddA_entry_part_ptr + (at * n_bc_tiles + i) * Q + offs_q)
        dw += tl.load(dw_part_ptr + (at * n_bc_tiles + i) * Q + offs_q)
        carry += tl.load(carry_part_ptr + at * n_bc_tiles + i)
    d_entry = tl.cumsum(entry_share, axis=0, reverse=True)                         # exp(cs_i), i >= k
    sw = (dw * w).to(tl.float64)
    d_exit = (tl.cumsum(sw, axis=0) - sw).to(tl.float32)                           # exp(cs_last-cs_j), j < k
    ddA = tl.load(ddA_pairs_ptr + at * Q + offs_q) + d_entry + d_exit + decay * carry
    ddt = tl.load(ddt_pairs_ptr + at * Q + offs_q) + dw * w_dec + ddA * tl.load(dts.A + h).to(tl.float32)
    ddt_raw = tl.where(valid, ddt * slope, 0.0)
    tl.store(part_ptr + chunk_slot * part_row + h, tl.sum(ddA * dt, axis=0))
    tl.store(part_ptr + chunk_slot * part_row + nheads + h, tl.sum(ddt_raw, axis=0))
    tl.store(ddt_ptr + b64 * stride_ddt.b + t64 * stride_ddt.l + h * stride_ddt.h,
             ddt_raw.to(ddt_ptr.dtype.element_ty), mask=valid)


def _chunk_bwd(ssd, states, dstates, dout, plan, dx=None, dB=None, dC=None, ddt=None):
    """Every gradient of the SSD's chunks, given every chunk's true entry state and exit gradient
    (b, nchunks, h, p, n) (chunk_states, GradPass.exit_grads). dx, dB, dC may be views into one
    buffer (the conv backward's input), ddt (b, l, h) a view too. Returns (dx, dB, dC, ddt in dt's
    dtype, dA, dD, d dt_bias), fp32 but the first four."""
    x, dt, B, C, D, seq_idx, cums = ssd.x, ssd.dt, ssd.B, ssd.C, ssd.D, ssd.seq_idx, ssd.cums
    dev, slots, Q = x.device, plan.batch * plan.nchunks, plan.Q
    dB = torch.empty_like(B, memory_format=torch.contiguous_format) if dB is None else dB
    dC = torch.empty_like(C, memory_format=torch.contiguous_format) if dC is None else dC
    CB = torch.empty(slots, plan.ngroups, Q, Q, device=dev, dtype=torch.float32)
    splits = plan.group_splits                  # a group's heads split: their shares of dCB in float32
    dCB = torch.empty(slots, plan.ngroups * splits, Q, Q, device=dev, dtype=x.dtype if splits == 1 else torch.float32)
    ddt_pairs = torch.empty(slots, plan.nheads, Q, device=dev, dtype=torch.float32)
    ddA_pairs = torch.empty(slots, plan.nheads, Q, device=dev, dtype=torch.float32)
    n_bc_tiles = plan.n_bc_tiles
    ddA_entry_part = torch.empty(slots, plan.nheads, n_bc_tiles, Q, device=dev, dtype=torch.float32)
    dw_part = torch.empty(slots, plan.nheads, n_bc_tiles, Q, device=dev, dtype=torch.float32)
    carry_part = torch.empty(slots, plan.nheads, n_bc_tiles, device=dev, dtype=torch.float32)
    # per chunk, the partials of dA (h,), of dt_bias's gradient (h,) and of dD (h,) or (h, p) in
    # one buffer: one sum gives all three
    d_width = 0 if D is None else plan.headdim if D.dim() == 2 else 1
    part = torch.empty(slots, (2 + d_width) * plan.nheads, device=dev, dtype=torch.float32)
    s_x, s_B, s_C = _BLHP(*x.stride()), _BLGN(*B.stride()), _BLGN(*C.stride())
    s_seq, s_do = _ZERO_BL if seq_idx is None else _BL(*seq_idx.stride()), _BLHP(*dout.stride())
    _chunk_bwd_group_kernel[(plan.nchunks * plan.batch * plan.ngroups * splits,)](
        x, B, C, cums, seq_idx, dout, CB, dCB, ddt_pairs, ddA_pairs, part,
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.ngroups, plan.batch, part.shape[1],
        s_x, s_B, s_C, s_seq, s_do,
        Q=Q, BP=plan.BP, BN=plan.BN_group, SPLITS=splits, HAS_D=D is not None, D_PER_CHANNEL=d_width > 1,
        DOT_PRECISION=plan.precision, **plan.launch.get("bwd_group", {}), **plan.flags)
    _chunk_bwd_BC_kernel[(plan.nchunks * plan.batch * plan.ngroups * n_bc_tiles,)](
        x, B, C, cums, seq_idx, states, dstates, dout, dCB, dB, dC, ddA_entry_part, dw_part, carry_part,
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.ngroups, plan.batch, n_bc_tiles,
        s_x, s_B, s_C, s_seq, s_do, _BLGN(*dB.stride()), _BLGN(*dC.stride()),
        Q=Q, BP=plan.BP, BN=plan.BN_bc, SPLITS=splits, DOT_PRECISION=plan.precision, **plan.launch.get("bwd_bc", {}),
        **plan.flags)
    del dCB                     # the x kernel's outputs take its place: the backward's peak is lower
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if dx is None else dx
    ddt = torch.empty(dt.shape, device=dev, dtype=dt.dtype) if ddt is None else ddt
    _chunk_bwd_x_kernel[(plan.nchunks * plan.batch * plan.nheads,)](
        B, plan.dts(dt, ssd.dt_bias, ssd.A), cums, D, seq_idx, dstates, dout, CB, ddt_pairs, ddA_pairs,
        ddA_entry_part, dw_part, carry_part, dx, ddt, part,
        plan.seqlen, plan.headdim, plan.dstate, plan.heads_per_group, plan.nheads, plan.batch,
        n_bc_tiles, part.shape[1], s_B, _D_strides(D), s_seq, s_do, _BLHP(*dx.stride()), _BLH(*ddt.stride()),
        Q=Q, BP=plan.BP, BN=plan.BN_x, HAS_D=D is not None,
        DOT_PRECISION=plan.precision, **plan.launch.get("bwd_x", {}), **plan.dt_flags, **plan.flags)
    h = plan.nheads
    dA, ddt_bias, dD = part.sum(dim=0).split_with_sizes((h, h, part.shape[1] - 2 * h))
    dD = None if D is None else dD if D.dim() == 1 else dD.view(D.shape)              # (h,) or (h, p)
    return dx, dB, dC, ddt, dA, dD, ddt_bias


def ssd_grads(ssd, states, grad_pass, dy, dexit=None, dx=None, dB=None, dC=None, ddt=None):
    """Every gradient of a sequence whose chunks' true entry states are `states`
    (chunk_states) and whose exit receives gradient `dexit` ((b, h, p, n) or None). dx, dB, dC,
    ddt may be given as output views. Returns (dx, dB, dC, ddt (in dt's dtype, w.r.t. raw dt),
    dA, dD, d dt_bias (the sum of raw dt's gradient, whether or not a dt_bias was added), d entry)."""
    dstates, dentry = grad_pass.exit_grads(dexit)
    grads = _chunk_bwd(ssd, states, dstates, dy, grad_pass.plan, dx, dB, dC, ddt)
    return (*grads, dentry)


# ---------------------------------------------------------------------------------------------
# 6. Segments, and their exchange by all-gather
#    Which causal segments of the global sequence a rank holds (README "Layouts"), and how the
#    conv halos, the summaries and their gradients travel between them: steps (1) and (3)
#    (README "The exclusive scan over summaries").
# ---------------------------------------------------------------------------------------------


def _pieces(rank, world, load_balancing):
    """Pieces of the sequence a rank holds, in local order, and how many pieces there are: one
    contiguous piece of W ("none"), or pieces r and 2W-1-r of 2W (the zigzag layouts). A world of
    one holds the whole sequence in order, one piece, in any layout (of any length)."""
    if load_balancing == "none" or world == 1:
        return [rank], world
    return [rank, 2 * world - 1 - rank], 2 * world


class Segments:
    """How the method sees a rank's shard: `per_row` causal segments of equal length per batch
    row, at global positions `held` (in local order) out of `count`. "virtual" takes the zigzag
    halves as two segments; the permute layouts are made contiguous first ("none")."""

    def __init__(self, rank, world, load_balancing):
        layout = "virtual" if load_balancing == "virtual" else "none"
        self.held, self.count = _pieces(rank, world, layout)
        self.per_row = len(self.held)
        self.rank, self.world = rank, world
        self.where = {k: (r, j) for r in range(world) for j, k in enumerate(_pieces(r, world, layout)[0])}
        self.order = [self.where[k] for k in range(self.count)]        # (rank, local index) by position

    def gather_order(self, gathered, batch):
        """Stack per-rank, per-local-segment tensors (world, batch * per_row, ...) into global
        segment order (batch, count, ...)."""
        per_rank = gathered.reshape(self.world, batch, self.per_row, *gathered.shape[2:])
        return torch.stack([per_rank[r, :, j] for r, j in self.order], dim=1)

    def own(self, t_global):
        """This rank's segments of a (batch, count, ...) tensor, as rows (batch * per_row, ...)."""
        own = torch.stack([t_global[:, k] for k in self.held], dim=1)  # no index tensor: graph-capturable
        return own.reshape(own.shape[0] * own.shape[1], *own.shape[2:])


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


def receive_halo(xBC, seq_idx, plan):
    """Each segment's conv halo: the last d_conv-1 pre-conv tokens of the segment before it in
    the global sequence (zeros before segment 0), and their document ids. xBC (rows, s, dim).
    Returns halo (rows, d-1, dim) and halo_seq (rows, d-1) int32 or None."""
    d1 = plan.d_conv - 1
    tail = xBC[:, xBC.shape[1] - d1:]                                              # (rows, d-1, dim)
    parts = (tail,) if seq_idx is None else (tail, seq_idx[:, seq_idx.shape[1] - d1:])
    buf = _pack(xBC.shape[0], *parts)
    before = plan.exchange.neighbours(buf, plan, later=True)                       # (rows, numel)
    if seq_idx is None:
        return before.reshape(xBC.shape[0], d1, xBC.shape[2]).to(xBC.dtype), None
    halo, halo_seq = _unpack(before, [((d1, xBC.shape[2]), torch.float32), ((d1,), torch.int32)])
    return halo.to(xBC.dtype), halo_seq


def return_halo_grad(dxBC, dhalo, plan):
    """Send each halo's gradient back to the segment it came from, which adds it to the
    gradient of its last d_conv-1 tokens. dxBC (rows, s, dim) is updated in place."""
    d1 = plan.d_conv - 1
    after = plan.exchange.neighbours(dhalo.float().reshape(dhalo.shape[0], -1), plan, later=False)   # (rows, numel)
    dxBC[:, dxBC.shape[1] - d1:] += after.reshape(dxBC.shape[0], d1, dxBC.shape[2]).to(dxBC.dtype)


def _document_flags(first, last):
    """cont (b, K) fp32: 0 where segment k starts a new document (its first id differs from segment
    k-1's last), 1 elsewhere and for segment 0 (initial_states reach the first document)."""
    cont = torch.ones(first.shape, device=first.device, dtype=torch.float32)
    cont[:, 1:] = (first[:, 1:] == last[:, :-1]).float()
    return cont


class AllGatherExchange:
    """summary_exchange="all_gather": every rank receives every segment's summary (backward, every
    G) and scans them itself; halos come from an all-gather too. PrefixScanExchange (section 8)
    has the same three methods."""

    @staticmethod
    def neighbours(blocks, plan, later):
        """Each segment's row of blocks (rows, numel) handed to the segment after it (later) or
        before it, zeros at the sequence's ends: every rank gathers all and keeps its neighbours'."""
        every = _all_gather(blocks, plan.group) if plan.world > 1 else blocks[None]
        glob = plan.segments.gather_order(every, plan.batch)                          # (b, K, numel)
        zero = torch.zeros_like(glob[:, :1])
        glob = torch.cat([zero, glob[:, :-1]] if later else [glob[:, 1:], zero], dim=1)  # k gets k-1's (or k+1's)
        return plan.segments.own(glob)

    @staticmethod
    def entry_states(S_ext, a, seq_idx, initial_states, plan):
        """Every segment's summary (S_ext (rows, h, p, n), a (rows, h), with documents its first
        and last ids) all-gathered in one fp32 buffer, then the scan in global segment order: this
        rank's segment entry states (rows, h, p, n), the final state (b, h, p, n), and what the
        backward needs: a and cont (b, K), cont None without documents."""
        parts = (S_ext, a) if seq_idx is None else (S_ext, a, seq_idx[:, :1], seq_idx[:, -1:])
        buf = _pack(S_ext.shape[0], *parts)
        every = _all_gather(buf, plan.group) if plan.world > 1 else buf[None]
        h, p, n = plan.state_shape
        shapes = [((h, p, n), torch.float32), ((h,), torch.float32)]
        if seq_idx is not None:
            shapes += [((1,), torch.int32), ((1,), torch.int32)]
        S_all, a_all, *ids = _unpack(plan.segments.gather_order(every, plan.batch), shapes)  # (b, K, ...)
        cont = _document_flags(ids[0][..., 0], ids[1][..., 0]) if ids else None
        a_all = a_all.contiguous()
        entries, final = scan_summaries(S_all.contiguous(), a_all, initial_states, cont)
        return plan.segments.own(entries), final, a_all, cont

    @staticmethod
    def exit_grads(G, dfinal, a_all, cont, plan, meanwhile):
        """Every segment's G (rows, h, p, n) and each rank's gradient of its copy of the final
        state (the copies' add up) all-gathered, `meanwhile` run while they travel, then the
        reverse scan: the gradient at this rank's segment exits (rows, h, p, n), initial_states'
        (b, h, p, n), and meanwhile's result."""
        rows = plan.batch * plan.segments.per_row
        h, p, n = plan.state_shape
        if dfinal is None:
            dfinal = torch.zeros((plan.batch, h, p, n), device=G.device)
        buf = torch.cat([G.reshape(-1), dfinal.float().reshape(-1)])
        every, work = _all_gather(buf, plan.group, async_op=True) if plan.world > 1 else (buf[None], None)
        done = meanwhile()
        if work is not None:
            work.wait()
        G_part, dfin = every[:, :rows * h * p * n], every[:, rows * h * p * n:]
        G_all = plan.segments.gather_order(G_part.reshape(plan.world, rows, h, p, n), plan.batch)  # (b, K, h, p, n)
        dfinal = dfin.reshape(plan.world, plan.batch, h, p, n).sum(dim=0)
        dexit_all, dinit = scan_summaries(G_all.contiguous(), a_all, dfinal, cont, reverse=True)
        return plan.segments.own(dexit_all), dinit, done


# ---------------------------------------------------------------------------------------------
# 7. Launch plumbing: tiles, tuning, the plan
#    Where a kernel's tiles live in memory; the launch choices; what a call derives once.
# ---------------------------------------------------------------------------------------------


# A caller's tensor comes with its strides as one named tuple (Triton specialises a tuple's
# fields like scalars: a unit stride still vectorises), by its dims: batch, token, head, headdim,
# group, dstate, channel, tap; an absent tensor's are zeros (its pointer, a stand-in, is never
# read). The module's own buffers are contiguous: the kernels compute their offsets from sizes.
# The model's sizes are constexprs in the chunk kernels (whole tiles lose their masks, indexing
# its divisions); the call's batch, length, chunks and runs stay run-time values.
_BLHP = collections.namedtuple("_BLHP", "b l h p")
_BLGN = collections.namedtuple("_BLGN", "b l g n")
_BL = collections.namedtuple("_BL", "b l")
_BLH = collections.namedtuple("_BLH", "b l h")
_HP = collections.namedtuple("_HP", "h p")
_BLC = collections.namedtuple("_BLC", "b l c")
_CK = collections.namedtuple("_CK", "c k")
_ZERO_BL, _ZERO_BLC = _BL(0, 0), _BLC(0, 0, 0)
_STRIDES = frozenset((_BLHP, _BLGN, _BL, _BLH, _HP, _BLC, _CK))     # integers only: _Launched keys them as they are


@triton.jit
def _tile_ptrs(ptr, stride, b64, t64, i, offs):
    """Pointers to a (tokens, channels) tile of a (batch, length, heads or groups, channels)
    tensor: batch b64, tokens t64 (T,) int64, head or group i, channels offs (C,); stride its record."""
    return ptr + b64 * stride[0] + t64[:, None] * stride[1] + i * stride[2] + offs[None, :] * stride[3]


@triton.jit
def _load_tile(ptr, stride, b64, t64, i, offs, mask):
    """The (tokens, channels) tile at _tile_ptrs, zeros where masked off."""
    return tl.load(_tile_ptrs(ptr, stride, b64, t64, i, offs), mask=mask, other=0.0)


@triton.jit
def _chunk_rows(c, seqlen, Q: tl.constexpr):
    """Chunk c's first token, its token offsets (Q,), the tokens' int64 positions and which of
    them exist."""
    start = c * Q
    offs_q = tl.arange(0, Q)
    return start, offs_q, (start + offs_q).to(tl.int64), start + offs_q < seqlen


@triton.jit
def _chunk_tokens(c, seqlen, headdim, Q: tl.constexpr, BP: tl.constexpr):
    """_chunk_rows, with the headdim offsets (BP,) and the (Q, BP) mask of a head tile."""
    start, offs_q, t64, valid = _chunk_rows(c, seqlen, Q)
    offs_p = tl.arange(0, BP)
    return start, offs_q, offs_p, t64, valid, valid[:, None] & (offs_p[None, :] < headdim)


# The per-chunk and per-run buffers are indexed by *slot*: b * nchunks + c for chunk c of batch
# row b, b * nruns + r for its run r.

@triton.jit
def _chunk_slot(b, c, seqlen, Q: tl.constexpr):
    """Chunk c of batch row b: its slot in the chunk buffers."""
    return b.to(tl.int64) * tl.cdiv(seqlen, Q) + c


@triton.jit
def _chunk_slots(b, c, seqlen, chunks_per_run, Q: tl.constexpr):
    """Chunk c of batch row b: its slot in the chunk buffers and its run's in the run buffers."""
    return _chunk_slot(b, c, seqlen, Q), _run_slot(b, c // chunks_per_run, tl.cdiv(seqlen, Q), chunks_per_run)


@triton.jit
def _run_slot(b, run, nchunks, chunks_per_run):
    """Run `run` of batch row b: its slot in the run buffers."""
    return b.to(tl.int64) * tl.cdiv(nchunks, chunks_per_run) + run


@triton.jit
def _state_tile(slot, h, offs_p, offs_n, nheads, headdim, dstate):
    """int64 offsets of head h's (p, n) tile in a contiguous (slots, nheads, headdim, dstate) buffer."""
    return ((slot.to(tl.int64) * nheads + h) * headdim + offs_p[:, None]) * dstate + offs_n[None, :]


@triton.jit
def _slot_head(slot, h, nheads):
    """int64 offset of (slot, head) in a contiguous (slots, nheads) buffer: gamma, a, partials."""
    return slot.to(tl.int64) * nheads + h


@triton.jit
def _pair_tile(slot, g, ngroups, Q: tl.constexpr):
    """int64 offsets of group g's (Q, Q) tile in a contiguous (b * nchunks, ngroups, Q, Q) buffer."""
    offs_q = tl.arange(0, Q)
    return (slot * ngroups + g) * (Q * Q) + offs_q[:, None] * Q + offs_q[None, :]


# Host-side integer helpers. triton.cdiv and triton.next_power_of_2 do the same, but through
# Triton's constexpr machinery, which costs microseconds a call.
def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(v):
    return 1 << max(0, v - 1).bit_length()


def _pow2(v, lo=16):
    return max(lo, _next_pow2(v))


# A conv program walks `strips` strips of `tokens` consecutive tokens side by side (one tile)
# over `channels` channels with `warps` warps, loading `unroll` tokens of each strip per step.
# Strips are halved (down to `unroll` tokens) while the launch has fewer than `programs` programs:
# a short sequence's conv would otherwise be one thin wave of long chains of loads.
ConvLaunch = collections.namedtuple("ConvLaunch", "strips channels tokens unroll warps programs", defaults=(1,))
# The gated RMSNorm's backward: `rows` token rows a tile, `warps` warps, about `programs` programs,
# but at most `partials` along the tokens: each writes its own row of the weight's gradient (dim
# floats), summed after; one norm group of all channels would otherwise write one row a token.
NormLaunch = collections.namedtuple("NormLaunch", "rows warps programs partials")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The launch choices: the same results under any of them, up to rounding (on a GPU, conv
    strips side by side with document ids round a few bf16 values of dxBC the other way)."""
    name: str
    chunk_fwd: int                      # kernel chunk lengths (may be shorter than the caller's)
    chunk_bwd: int
    chunks_per_run: int                 # chunks a state-pass program walks in order: this many,
    longest_run: int                    # doubled up to this many while the state pass keeps
    state_wave: int                     # this many programs
    state_tile: Optional[int]           # the state passes' (p, n) tile width (None: whole)
    bwd_one_run_tile: Optional[int]     # a backward's, where that makes one run of several (None: never)
    summary_tile: Optional[tuple]       # the run summaries' (p, n) tile (None: whole)
    bwd_state_tiles: tuple              # the n tile of the chunk-backward kernels (group, BC, x)
    group_wave: int                     # below this many programs the group kernel splits a group's heads
    heads_per_output: Optional[int]     # heads per output program (None: a whole group)
    launch: dict                        # per chunk kernel: num_warps, num_stages, maxnreg (GPU only)
    scan_block: Optional[int]           # the summary scan's slice of the p*n state (None: whole)
    conv_fwd: ConvLaunch
    conv_bwd: ConvLaunch
    gate_tile: int                      # the gate and gated RMSNorm: elements per tile,
    gate_programs: int                  # and programs of the gate's backward
    norm_bwd: NormLaunch                # the gated RMSNorm's backward


# The interpreter's choices are small, so that CPU tests walk every loop (tiny runs: the runs'
# scan too). The GPU's were the fastest measured on an H200 at the record shape (BENCHMARKS.md,
# "The launch choices"): the chunk kernels are latency-bound chains of small products, so what
# pays is programs per SM (4 warps, one head per output program, register caps where they buy a
# program); runs of 16 chunks, doubled up to 64 while the state pass keeps 512 programs, and a
# backward of at most 64 chunks as one run on tiles of 32 where those keep 512, the run
# summaries on (64, 128) tiles, and 3 stages in them, in the state pass (whose loads into
# registers are read a step ahead: _register_loads) and in the group and BC kernels (measured on an
# H100); a group's heads split over 2, 4, ... group-kernel programs while chunks x groups fall
# short of 256 (one group of many heads at a few thousand tokens: granite-4.0-h's 48); the conv's
# strips shortened below 768 and 1536 programs (at 2k and 4k tokens), and at most 1024 rows of the
# gated RMSNorm's weight-gradient partials (measured on an H100).
TUNED_KERNELS = ("cumsum", "state", "summary", "output", "bwd_group", "bwd_bc", "bwd_x")  # with launch options
TUNINGS = {
    "interpreter": Tuning("interpreter", chunk_fwd=64, chunk_bwd=64, chunks_per_run=2, longest_run=2, state_wave=1,
                          state_tile=None, bwd_one_run_tile=None, summary_tile=None, bwd_state_tiles=(16, 16, 16),
                          group_wave=16, heads_per_output=None, launch={}, scan_block=None,
                          conv_fwd=ConvLaunch(32, 64, 64, 1, 4), conv_bwd=ConvLaunch(32, 64, 64, 1, 1), gate_tile=64,
                          gate_programs=4096, norm_bwd=NormLaunch(4, 4, 4096, 4096)),
    "gpu": Tuning("gpu", chunk_fwd=64, chunk_bwd=64, chunks_per_run=16, longest_run=64, state_wave=512,
                  state_tile=64, bwd_one_run_tile=32, summary_tile=(64, 128), bwd_state_tiles=(64, 64, 64),
                  group_wave=256, heads_per_output=1,
                  launch=dict(cumsum=dict(num_warps=1), state=dict(num_warps=4, num_stages=3),
                              summary=dict(num_warps=4, num_stages=3),
                              output=dict(num_warps=4, num_stages=1, maxnreg=168),
                              bwd_group=dict(num_warps=4, num_stages=3), bwd_bc=dict(num_warps=4, num_stages=3),
                              bwd_x=dict(num_warps=4, num_stages=1, maxnreg=128)),
                  scan_block=1024, conv_fwd=ConvLaunch(1, 256, 128, 8, 2, programs=768),
                  conv_bwd=ConvLaunch(1, 128, 256, 8, 1, programs=1536),
                  gate_tile=4096, gate_programs=4096, norm_bwd=NormLaunch(1, 4, 16384, 1024)),
}
_TUNING = [TUNINGS["interpreter" if INTERPRET else "gpu"]]      # the one in use: where the kernels run


def tuning():
    """The Tuning the launches use now."""
    return _TUNING[0]


def set_tuning(choice):
    """Make `choice` (a Tuning, or a name in TUNINGS) the one every launch uses; returns the
    previous one. Tests pick the GPU's in the interpreter this way; bench.py its variants."""
    if isinstance(choice, str) and choice not in TUNINGS or not isinstance(choice, (str, Tuning)):
        raise ValueError(f"set_tuning: got {choice!r}, expected a Tuning or one of {sorted(TUNINGS)}")
    previous = _TUNING[0]
    _TUNING[0] = TUNINGS[choice] if isinstance(choice, str) else choice
    return previous


class LaunchPlan:
    """The sizes, tiles and flags of one SSD's launches: shape (b, l, h, p, g, n), x's dtype, the
    chunk length Q; dt_bias and seq_idx only by whether they are given."""

    def __init__(self, shape, dtype, chunk, dt_bias, dt_softplus, dt_limit, seq_idx, state_dtype=None,
                 backward=False):
        t = tuning()
        self.batch, self.seqlen, self.nheads, self.headdim, self.ngroups, self.dstate = shape
        self.heads_per_group = self.nheads // self.ngroups
        self.Q = chunk
        self.nchunks = _cdiv(self.seqlen, chunk)
        self.BP, self.BN = _pow2(self.headdim), _pow2(self.dstate)
        self.n_p_blocks = _cdiv(self.headdim, self.BP)
        def run_length(tile):
            """Chunks a run on (tile, tile) state tiles: doubled from chunks_per_run while the
            state pass keeps state_wave programs (fewer runs, fewer summaries to store and scan)."""
            programs = self.batch * self.nheads * _cdiv(self.headdim, min(self.BP, tile or self.BP)) * _cdiv(
                self.dstate, min(self.BN, tile or self.BN))
            n = t.chunks_per_run
            while 2 * n <= t.longest_run and programs * _cdiv(self.nchunks, 2 * n) >= t.state_wave:
                n *= 2
            return n
        tile, self.chunks_per_run = t.state_tile, run_length(t.state_tile)
        # a backward its tiles would cut into several runs, and narrower ones into one, takes the
        # narrower: no run summaries to form (two more passes over the tokens) and scan. Its state
        # passes then walk the whole sequence; a forward, with one state pass, loses by that
        # (BENCHMARKS.md).
        if backward and t.bwd_one_run_tile and self.nchunks > self.chunks_per_run:
            narrower = run_length(t.bwd_one_run_tile)
            if self.nchunks <= narrower:
                tile, self.chunks_per_run = t.bwd_one_run_tile, narrower
        self.BP_state, self.BN_state = min(self.BP, tile or self.BP), min(self.BN, tile or self.BN)
        self.n_p_tiles, self.n_n_tiles = _cdiv(self.headdim, self.BP_state), _cdiv(self.dstate, self.BN_state)
        self.nruns = _cdiv(self.nchunks, self.chunks_per_run)
        self.BP_summary, self.BN_summary = (min(d, w) for d, w in zip((self.BP, self.BN), t.summary_tile or (
            self.BP, self.BN)))
        self.BN_group, self.BN_bc, self.BN_x = (min(self.BN, n) for n in t.bwd_state_tiles)
        self.group_splits = 1                      # a power of two dividing heads_per_group
        while (self.nchunks * self.batch * self.ngroups * self.group_splits < t.group_wave
               and self.heads_per_group % (2 * self.group_splits) == 0):
            self.group_splits *= 2
        self.n_bc_tiles = _cdiv(self.dstate, self.BN_bc)
        self.heads_per_output = t.heads_per_output or self.heads_per_group    # a divisor of heads_per_group
        self.cumsum_heads = min(8, self.nheads & -self.nheads)   # the largest power of two dividing nheads, up to 8
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.dt_flags = dict(HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus))
        self.flags = dict(HAS_SEQ=seq_idx is not None)
        # float32 products: as three tf32 tensor-core products (each operand split hi + lo, lo.lo
        # dropped: within about 2^-21 of each term) where that is faster than IEEE's CUDA-core
        # FMAs, everywhere but the state pass (measured: BENCHMARKS.md)
        self.precision = "tf32x3" if dtype == torch.float32 else "tf32"
        self.state_precision = "ieee" if dtype == torch.float32 else "tf32"
        # the chunk and run entry states (and, in backward, exit gradients) as stored between
        # kernels; the kernels carry them in float32 and read them back to float32
        self.state_dtype = state_dtype or (torch.float32 if dtype == torch.float32 else dtype)
        self.launch = {} if INTERPRET else t.launch        # per kernel; the interpreter takes no launch options

    def dts(self, dt, dt_bias, A):
        """The _DtArgs of dt (b, l, h), dt_bias (or None) and A."""
        return _DtArgs(dt, *dt.stride(), A if dt_bias is None else dt_bias, A, *self.dt_limit)


def _rank_and_world(group):
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


class Plan:
    """What the method derives once from a Call's shapes, its options and its CP group: the
    segments and the exchange, the sizes, and the SSD's launch plans forward and backward.
    Built once per call signature and carried from the forward to the backward."""

    def __init__(self, call, batch, chunk_size, headdim, ngroups, dt_limit=(0.0, math.inf), silu=True,
                 state_dtype=None, group=None, load_balancing="none", exchange=AllGatherExchange):
        self.group = group
        self.rank, self.world = _rank_and_world(group)
        self.segments = Segments(self.rank, self.world, load_balancing)
        self.holds_first = 0 in self.segments.held
        self.exchange, self.batch, self.silu = exchange, batch, bool(silu)
        rows, s, conv_dim = call.xBC.shape
        self.d_conv = call.conv_weight.shape[1]
        self.nheads, self.headdim, self.ngroups = call.dt.shape[2], headdim, ngroups
        self.dstate = (conv_dim - self.nheads * headdim) // (2 * ngroups)
        self.state_shape = (self.nheads, headdim, self.dstate)
        t, shape = tuning(), (rows, s, self.nheads, headdim, ngroups, self.dstate)
        self.fwd = LaunchPlan(shape, call.xBC.dtype, min(chunk_size, t.chunk_fwd), call.dt_bias, True, dt_limit,
                              call.seq_idx, state_dtype)
        self.bwd = LaunchPlan(shape, call.xBC.dtype, min(chunk_size, t.chunk_bwd), call.dt_bias, True, dt_limit,
                              call.seq_idx, state_dtype, backward=True)


# =============================================================================================
# PART II. THE EXTRAS
# Sections 8 to 16: what production adds, and a worked example. Each depends on Part I and
# changes nothing of it.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# 8. The prefix-scan exchange and the model that chooses
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

class _SummaryMap(NamedTuple):
    """The summary of consecutive segments as the affine map E -> a * E + S they apply to the
    state entering them, per batch row: a (b, h), S (b, h, p, n) fp32. first and last (b,) int32:
    the document ids at their two ends (None without documents); they carry the state in only
    where their first id is the last id before them."""
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
    return _SummaryMap(a2 * earlier.a, a2[..., None, None] * earlier.S + later.S, earlier.first, later.last)


def _applied(m, E):
    """m applied to the state E (b, h, p, n) entering it (E None: zero)."""
    return m.S if E is None else m.a[..., None, None] * E + m.S


def _packed_map(m):
    return _pack(m.a.shape[0], *(t for t in m if t is not None))


def _unpacked_map(buf, like):
    fields = [t for t in like if t is not None]
    parts = iter(_unpack(buf, [(tuple(t.shape[1:]), t.dtype) for t in fields]))
    return _SummaryMap(*(None if t is None else next(parts) for t in like))


def _prefix_over_ranks(chains, plan):
    """Exclusive and inclusive prefix compositions along chains of ranks. chains: a list of
    (this rank's map, order), order listing every rank of the group in chain order; two chains
    run in opposite directions, so no two messages of a round share sender and receiver. In
    round d each rank sends its inclusive prefix d places down its chain and composes in what
    arrives from d places up: ceil(log2 W) rounds. Returns [exclusive (None at the chain's
    head), inclusive] per chain."""
    me, world, group = plan.rank, plan.world, plan.group
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


def _broadcast_map(m, src, plan):
    """The map held by rank src, on every rank (m: this rank's, of the same shapes)."""
    if plan.world == 1:
        return m
    buf = _packed_map(m)
    dist.broadcast(buf, _global_rank(plan.group, src), group=plan.group)
    return _unpacked_map(buf, m)


def _own_maps(a, S, seq_idx, plan):
    """This rank's segment maps by local index j: (rows, ...) tensors as per_row (b, ...) maps."""
    per = plan.segments.per_row

    def j_of(t, j):
        return None if t is None else t.reshape(plan.batch, per, *t.shape[1:])[:, j]

    first, last = (None, None) if seq_idx is None else (seq_idx[:, 0], seq_idx[:, -1])
    return [_SummaryMap(j_of(a, j), j_of(S, j), j_of(first, j), j_of(last, j)) for j in range(per)]


def _chains(plan, backward):
    """Rank orders of the chains, by local segment index: "none" runs one chain over the ranks
    in order; "virtual" a second one back down, for the second halves (segment 2W-1-r on rank
    r). The backward walks each the other way, second halves first."""
    up, down = list(range(plan.world)), list(range(plan.world - 1, -1, -1))
    if plan.segments.per_row == 1:
        return [down if backward else up]
    return [down, up] if backward else [up, down]


def _stacked_rows(per_segment, plan):
    """Per-local-segment (b, ...) tensors as (rows, ...), rows in (batch, segment) order."""
    return torch.stack(per_segment, dim=1).reshape(plan.batch * len(per_segment), *per_segment[0].shape[1:])


def _entries_by_prefix_scan(S_ext, a, seq_idx, initial_states, plan):
    """Forward state passing by prefix scan. S_ext (rows, h, p, n) and a (rows, h) this rank's
    summaries, seq_idx (rows, s) or None. Returns the entry states of this rank's segments
    (rows, h, p, n), the final state of the whole sequence (b, h, p, n), identical on every
    rank, and what backward needs: a (rows, h) and cont (rows,) of this rank's segments (cont
    None without documents)."""
    own = _own_maps(a, S_ext, seq_idx, plan)
    (excl0, incl0), *second = _prefix_over_ranks(list(zip(own, _chains(plan, False))), plan)
    first_half = _broadcast_map(incl0, plan.world - 1, plan)                       # segments 0..W-1
    prefixes = [excl0]
    total = first_half
    if second:     # "virtual": the second halves follow the first, from rank W-1 back to rank 0
        excl1, incl1 = second[0]
        prefixes.append(first_half if excl1 is None else _then(first_half, excl1))
        total = _then(first_half, _broadcast_map(incl1, 0, plan))
    init = None if initial_states is None else initial_states.float()
    entries, conts = [], []
    for m, prefix in zip(own, prefixes):
        if prefix is None:                                       # segment 0: the initial state
            entries.append(torch.zeros_like(m.S) if init is None else init.clone())
            conts.append(torch.ones(plan.batch, device=m.S.device))
            continue
        cont = (torch.ones(plan.batch, device=m.S.device) if m.first is None
                else (m.first == prefix.last).float())
        entries.append(cont[:, None, None, None] * _applied(prefix, init))
        conts.append(cont)
    conts = None if seq_idx is None else _stacked_rows(conts, plan)
    return _stacked_rows(entries, plan), _applied(total, init), a, conts


def _exit_grads_by_prefix_scan(G, dfinal, a, cont, plan):
    """Backward state passing by prefix scan, the reverse of _entries_by_prefix_scan: each segment maps
    the gradient at its exit to that at the exit before it, dE -> cont (a dE + G). G (rows, h, p,
    n); dfinal (b, h, p, n) this rank's copy's gradient or None; a (rows, h) and cont (rows,) or
    None as _entries_by_prefix_scan returned them. Returns the gradient arriving at this rank's segment exits
    (rows, h, p, n) and that of the initial state (b, h, p, n; zeros but on the rank holding
    segment 0)."""
    h, p, n = plan.state_shape
    dfin = torch.zeros((plan.batch, h, p, n), device=G.device) if dfinal is None else dfinal.float().clone()
    if plan.world > 1:
        dist.all_reduce(dfin, group=plan.group)                    # every copy of the final state
    cont = torch.ones(a.shape[0], device=a.device) if cont is None else cont
    own = _own_maps(cont[:, None] * a, cont[:, None, None, None] * G, None, plan)
    (excl0, incl0), *second = _prefix_over_ranks(list(zip(own, _chains(plan, True))), plan)
    if not second:
        after, everything = [excl0], incl0                  # what follows each segment; all of it
    else:          # "virtual": the second halves come first, from rank 0 up to rank W-1
        excl1, incl1 = second[0]
        second_halves = _broadcast_map(incl1, plan.world - 1, plan)
        after = [second_halves if excl0 is None else _then(second_halves, excl0), excl1]
        everything = _then(second_halves, incl0)
    dexits = [dfin if m is None else _applied(m, dfin) for m in after]
    dinit = _applied(everything, dfin) if plan.holds_first else torch.zeros_like(dfin)
    return _stacked_rows(dexits, plan), dinit


def _from_neighbours(blocks, plan, later):
    """Point-to-point: each of this rank's segments sends its row of blocks (rows, numel) to the
    segment after it (later) or before it in the global sequence, and gets the same from the
    other side (zeros at the sequence's ends). A rank sends at most one block to each other rank.
    Returns (rows, numel)."""
    step = 1 if later else -1
    mine = blocks.reshape(plan.batch, plan.segments.per_row, -1)
    got = torch.zeros_like(mine)
    ops, landing = [], []
    for j, k in enumerate(plan.segments.held):
        if 0 <= k + step < plan.segments.count and plan.segments.where[k + step][0] != plan.rank:
            ops.append(_send(mine[:, j].contiguous(), plan.segments.where[k + step][0], plan.group))
        if 0 <= k - step < plan.segments.count:
            frm, i = plan.segments.where[k - step]
            if frm == plan.rank:
                got[:, j] = mine[:, i]
            else:
                landing.append((j, torch.empty_like(mine[:, j])))
                ops.append(_recv(landing[-1][1], frm, plan.group))
    _run_p2p(ops)
    for j, buf in landing:
        got[:, j] = buf
    return got.reshape(blocks.shape)


class PrefixScanExchange:
    """summary_exchange="scan": the summaries and G by prefix scan over the ranks, the halos from
    the neighbouring segments alone. The methods of AllGatherExchange (section 6); what runs
    `meanwhile` there runs here after the (blocking) rounds."""

    neighbours = staticmethod(_from_neighbours)

    @staticmethod
    def entry_states(S_ext, a, seq_idx, initial_states, plan):
        return _entries_by_prefix_scan(S_ext, a, seq_idx, initial_states, plan)

    @staticmethod
    def exit_grads(G, dfinal, a_kept, cont, plan, meanwhile):
        return (*_exit_grads_by_prefix_scan(G, dfinal, a_kept, cont, plan), meanwhile())


# Which exchange: a latency-bandwidth model of the link, one cost model for every path. A message
# of m bytes costs alpha + beta * m; a cost is a list of terms, each its bytes and its messages
# in sequence (an all-gather W - 1 ring steps, a prefix round or a neighbour's message 1, a
# broadcast ceil(log2 W): a pipelined tree, the bytes once), and modelled_seconds sums them.
# comm_bytes (section 15, after the all-to-all's head split it needs) gives every path's terms
# and their notation; _exchange_terms below the exchange's own, which are what "auto" compares
# (chosen_exchange). Per layer call, forward and backward, with s the bytes of one segment's
# summary, k segments per rank and R = ceil(log2 W):
#     all_gather  four all-gathers, W - 1 messages each: the summaries (k s), G with the final
#                 state's gradient (about (k + 1) s), the halos and their gradients
#     scan        2 R rounds of k s (the summaries, then G), the totals' broadcasts (k s, k R
#                 messages), the final gradient's all-reduce (2 (W-1)/W s, 2 R), with "virtual"
#                 one more broadcast backward (s, R), and the halos to and from the neighbours
# At the record shape (a 2 MiB summary, batch 1) with the figures of LINKS below, the scan is
# the faster from W = 4 with "none" (k = 1), and with "virtual" (k = 2) from W = 6 on NVLink,
# W = 4 between nodes; at W = 2 the all-gather takes 0.5 to 0.7 of the scan's time (bench.py
# --model prints the table). The all-gather also holds W k s bytes of summaries per rank: 4 GiB
# at W = 1024 with "virtual".

SUMMARY_EXCHANGES = ("auto", "all_gather", "scan")


def _log2_rounds(world):
    return max(0, world - 1).bit_length()            # ceil(log2 W)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A link's cost model: one message of m bytes takes alpha + beta * m seconds."""

    alpha: float      # seconds per message
    beta: float       # seconds per byte


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


def _exchange_terms(exchange, world, k, batch, nheads, headdim, dstate, d_conv, conv_dim, documents):
    """The terms of one layer call's summary and halo exchanges, k segments per rank, as
    comm_bytes states them (its docstring has the notation): [(side, name, bytes, messages in
    sequence)], side "fwd" or "bwd". Every summary and halo travels as fp32 (_pack), whatever the
    input dtype. In a world of one nothing moves: every term is 0."""
    o, R, docs, f4 = world - 1, _log2_rounds(world), int(documents), 4
    rows, h, state, d1, cd = batch * k, nheads, nheads * headdim * dstate, d_conv - 1, conv_dim
    if exchange == "all_gather":
        terms = [("fwd", "halo all-gather", o * rows * d1 * (cd + docs) * f4, o),
                 ("fwd", "summary all-gather", o * rows * (state + h + 2 * docs) * f4, o),
                 ("bwd", "G all-gather", o * (rows + batch) * state * f4, o),
                 ("bwd", "halo-gradient all-gather", o * rows * d1 * cd * f4, o)]
    else:
        terms = [("fwd", "halos from the neighbours", rows * d1 * (cd + docs) * f4, 1),
                 ("fwd", "summary prefix rounds", R * rows * (state + h + 2 * docs) * f4, R),
                 ("fwd", "totals broadcast", rows * (state + h + 2 * docs) * f4, k * R),
                 ("bwd", "final-gradient all-reduce", 2 * o * batch * state * f4 // world, 2 * R),
                 ("bwd", "gradient prefix rounds", R * rows * (state + h) * f4, R)]
        if k == 2:
            terms.append(("bwd", "second halves broadcast", batch * (state + h) * f4, R))
        terms.append(("bwd", "halo gradients to the neighbours", rows * d1 * cd * f4, 1))
    return [(side, name, 0, 0) for side, name, _, _ in terms] if world == 1 else terms


def _cost(terms):
    """A cost as comm_bytes returns it, from [(side, name, bytes, messages)]: the forward's
    terms first, each side's in their order."""
    terms = sorted(terms, key=lambda t: t[0] != "fwd")                  # stable
    return dict(fwd=sum(t[2] for t in terms if t[0] == "fwd"), bwd=sum(t[2] for t in terms if t[0] == "bwd"),
                terms={f"{side}: {name}": nbytes for side, name, nbytes, _ in terms},
                latencies={f"{side}: {name}": messages for side, name, _, messages in terms})


def modelled_seconds(cost, link=None):
    """The model's time of a cost (comm_bytes' dict) on `link`, a LinkModel (default: the one
    set_link_model chose): each term's messages in sequence times alpha plus its bytes times
    beta, summed over the terms, forward and backward (no overlap with compute)."""
    link = link or _LINK[0]
    return sum(cost["latencies"][name] * link.alpha + nbytes * link.beta for name, nbytes in cost["terms"].items())


def chosen_exchange(choice, world, load_balancing, batch, state_shape, conv_dim, d_conv):
    """summary_exchange resolved: `choice` unless it is "auto", which takes the exchange whose own
    terms (those in which "all_gather" and "scan" differ; without document ids) have the
    smaller modelled_seconds on the link of set_link_model, the all-gather on a tie and in a
    world of one. state_shape is (nheads, headdim, dstate)."""
    if choice != "auto":
        return choice
    k = 2 if load_balancing == "virtual" else 1
    scan, gather = (modelled_seconds(_cost(_exchange_terms(e, world, k, batch, *state_shape, d_conv, conv_dim, False)))
                    for e in ("scan", "all_gather"))
    return "scan" if scan < gather else "all_gather"

# The exchanges by summary_exchange name ("auto" is resolved by chosen_exchange)
EXCHANGES = {"all_gather": AllGatherExchange, "scan": PrefixScanExchange}


# ---------------------------------------------------------------------------------------------
# 9. Input checks and the ranks' agreement
#    Every bad input gets a ValueError naming the argument, what was seen, and what was
#    expected, on every rank, before any collective that could hang. The public conv launchers,
#    conv1d_fwd and conv1d_bwd, are section 2's with their inputs checked.
# ---------------------------------------------------------------------------------------------


def _expect(cond, name, seen, expected):
    if not cond:
        raise ValueError(f"{name}: got {seen}, expected {expected}")


def _check_layout(load_balancing):
    _expect(load_balancing in LAYOUTS, "load_balancing", repr(load_balancing), f"one of {LAYOUTS}")


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)
_CPU_TENSORS_OK = INTERPRET     # the interpreter's kernels read CPU tensors, the GPU's cannot (tools/sass.py
                                # compiles the GPU's from CPU tensors, launching nothing: it sets this)


def _check_tensor(t, name, shape, ref, *, dtypes=None, allow_none=True):
    """Shape (None entries are free), device of `ref`, floating dtype (or one of `dtypes`); on a
    device the kernels can read (with CUDA present they were compiled for the GPU)."""
    if t is None:
        _expect(allow_none, name, "None", "a tensor")
        return
    _expect(isinstance(t, torch.Tensor), name, type(t).__name__, "a torch.Tensor")
    _expect(t.dim() == len(shape), name, f"shape {tuple(t.shape)} ({t.dim()} dims)",
            f"{len(shape)} dims {tuple('*' if s is None else s for s in shape)}")
    ok = all(s is None or s == d for s, d in zip(shape, t.shape))
    _expect(ok, name, f"shape {tuple(t.shape)}", f"shape {tuple('*' if s is None else s for s in shape)}")
    _expect(t.device == ref.device, name, f"device {t.device}", f"device {ref.device} (like x)")
    _expect(_CPU_TENSORS_OK or t.is_cuda, name, f"a tensor on {t.device}", "a CUDA tensor: mamba_cp compiled its kernels "
            "for the GPU (for CPU tensors set TRITON_INTERPRET=1 before importing mamba_cp: Triton's interpreter)")
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


def _check_document_values(seq_idx, cu_seqlens=None):
    """The checks that read device values on the host (a synchronisation): seq_idx non-decreasing,
    and cu_seqlens bounding the documents that seq_idx marks (shapes checked before). They run
    where the values are used, so under torch.compile too, but not while a CUDA graph is captured
    (the eager calls before capture have run them)."""
    if seq_idx is None or (seq_idx.is_cuda and torch.cuda.is_current_stream_capturing()):
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


def _check_ssd_inputs(call, chunk_size, dt_limit):
    """The local checks of a single-device call (a ScanCall, any values at all)."""
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, _ = call
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
_ACTIVATIONS = ("silu", "swish", None)


def _check_cp_inputs(call, chunk_size, headdim, ngroups, load_balancing, world, dt_limit, activation="silu",
                     state_dtype=None, summary_exchange="auto"):
    """The local checks of a CP call (a Call in the caller's layout, any values at all) in a CP
    group of `world` ranks."""
    xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx = call
    _check_layout(load_balancing)
    _expect(isinstance(summary_exchange, str) and summary_exchange in SUMMARY_EXCHANGES, "summary_exchange",
            repr(summary_exchange), f"one of {SUMMARY_EXCHANGES}")
    _expect(activation in _ACTIVATIONS, "activation", repr(activation), f"one of {_ACTIVATIONS}")
    _expect(state_dtype in _STATE_DTYPES, "state_dtype", state_dtype, f"one of {_STATE_DTYPES}")
    per_row = len(_pieces(0, world, load_balancing)[0])          # pieces a rank holds: 1, or 2 (zigzag)
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
    _expect(l % per_row == 0, "xBC", f"local length {l}",
            f"a multiple of {per_row} (load_balancing={load_balancing!r} holds {per_row} equal pieces)")
    seg = l // per_row if load_balancing == "virtual" else l     # the permute layouts compute one segment
    _expect(seg >= max(1, d_conv - 1), "xBC", f"segments of {seg} tokens",
            f"at least d_conv - 1 = {d_conv - 1} tokens per segment (the conv halo comes from one neighbour)")


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


def _call_signature(call, chunk_size, headdim, ngroups, load_balancing, return_final_states, summary_exchange="auto"):
    """What the ranks agree on (for _signature): a Call's tensors, any values at all, and the options."""
    xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx = call

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
    if cp_group is None:
        return 0, 1
    found = _GROUPS.get((cp_group, ref.is_cuda))
    if found is not None:
        return found
    _expect(dist.is_available() and dist.is_initialized(), "cp_group", "a group",
            "None when torch.distributed is not initialised")
    _expect(isinstance(cp_group, dist.ProcessGroup), "cp_group", type(cp_group).__name__,
            "a torch.distributed ProcessGroup, or None for a single device")
    rank = dist.get_rank(cp_group)
    _expect(rank >= 0, "cp_group", "a group this process is not a member of", "a group containing this rank")
    world = dist.get_world_size(cp_group)
    backend = str(dist.get_backend(cp_group)).lower()
    if "nccl" in backend:
        _expect(ref.is_cuda, "cp_group", f"an NCCL group with tensors on {ref.device}", "CUDA tensors for NCCL")
    _GROUPS[(cp_group, ref.is_cuda)] = rank, world
    return rank, world


# When the verdict is read. Reading the gathered vector on the host waits for the GPU, and an
# eager caller that never waits keeps the GPU fed. So each rank reads it on the first call of
# each signature (per group), when every rank that was called alike reads it too: a clear
# ValueError on every rank. On later calls of a signature already agreed, a device-side assert
# checks the same vector: a mismatch then stops every rank's stream (a RuntimeError at its next
# synchronisation, the CUDA context lost, as with any device assert) before any later
# collective can run. set_input_checks("always") reads it on every call.
_CHECKS = {"mode": "first", "world_of_one": False}    # world_of_one: gather in a world of one too (tests)
_AGREED = {}                                          # call key -> what every rank sends when all is well
_PREPARED = {}                                        # call key -> its first call's results (_prepared)
_GROUPS = {}                                          # (group, on a GPU) -> (rank, world), checked
_PIECE_ORDERS = {}                                    # (world, layout, device) -> _piece_order's


def set_input_checks(mode):
    """When the CP entries read the ranks' agreement (shapes, dtypes and options alike on every
    rank, and seq_idx non-decreasing) on the host: "first" (the default) on the first call of
    each signature, checking later calls on the device without waiting for it; "always" on every
    call, one synchronisation each. Returns the previous mode. Every rank of a group must set the
    same."""
    _expect(mode in ("first", "always"), "mode", repr(mode), "'first' or 'always'")
    previous, _CHECKS["mode"] = _CHECKS["mode"], mode
    return previous


def _raise_disagreement(every, names, local_error, group):
    """The host's reading of the gathered (world, len(names) + 2) verdicts."""
    for i, name in enumerate(names):
        values = every[:, i].tolist()
        if len(set(values)) > 1:
            raise ValueError(f"{name}: got {values} across the ranks of cp_group, expected the same on every rank")
    if local_error is not None:
        raise local_error
    rejected = [r for r, flag in enumerate(every[:, -2].tolist()) if flag]
    if rejected:
        raise ValueError(f"inputs: got a ValueError on rank(s) {rejected} of cp_group, expected valid inputs "
                         "on every rank (all ranks stop before any collective that could hang)")
    decreasing = [r for r, flag in enumerate(every[:, -1].tolist()) if flag]
    where = "" if group is None else f" on rank(s) {decreasing} of cp_group"
    _expect(not decreasing, "seq_idx", "a decreasing step" + where, "non-decreasing document ids along each row")


def _piece_order(world, layout, device):
    """Segments' global order of the caller's pieces (the permute layouts' are zigzag, as
    "virtual"'s), and as an index into the ranks' pieces stacked rank by rank: one index_select
    on later calls (cached) where Segments.gather_order would make a slice per piece."""
    found = _PIECE_ORDERS.get((world, layout, device))
    if found is None:
        segments = Segments(0, world, "none" if layout == "none" else "virtual")
        found = _PIECE_ORDERS[(world, layout, device)] = (segments.order, torch.tensor(
            [r * segments.per_row + j for r, j in segments.order], device=device))
    return found


def _boundary_steps(seq_idx, layout, group):
    """Whether seq_idx steps down where one piece of the sequence ends and the next begins:
    (b, pieces - 1) bool in global order, the same on every rank, with each piece's first and
    last ids (b, pieces, 2) and its (rank, local piece). seq_idx (b, l) in the layout. A rank
    alone cannot see its neighbours' ids, so each sends the ends of its pieces. None where the
    sequence is one piece."""
    world = 1 if group is None else dist.get_world_size(group)
    pieces = _pieces(0, world, layout)[1] // world                     # per rank: 1, or 2 (zigzag)
    if pieces * world == 1:
        return None
    s = seq_idx.reshape(seq_idx.shape[0], pieces, -1)                  # (b, pieces, l / pieces)
    ends = (s[..., ::s.shape[-1] - 1] if s.shape[-1] > 1 else torch.cat([s, s], dim=-1)).to(torch.int64)
    every = _all_gather(ends, group) if world > 1 else ends[None]     # (W, b, pieces, 2)
    order, index = _piece_order(world, layout, every.device)
    glob = every.transpose(0, 1).reshape(ends.shape[0], -1, 2).index_select(1, index)   # (b, pieces * W, 2)
    return glob[:, 1:, 0] < glob[:, :-1, 1], glob, order


def _raise_boundary_step(down, glob, order):
    """The host's reading of _boundary_steps: a ValueError naming the first step down."""
    if not bool(down.any()):
        return
    row, k = (int(i) for i in down.nonzero()[0])
    (a, _), (b, _) = order[k], order[k + 1]
    between = f"ranks {a} and {b} of cp_group" if a != b else f"the two pieces held by rank {a}"
    raise ValueError(f"seq_idx: got a decreasing step where the sequence passes between {between} (row {row}: "
                     f"document {int(glob[row, k, 1])}, then {int(glob[row, k + 1, 0])}), expected document ids "
                     "numbered over the whole sequence, non-decreasing across the ranks (shard the global "
                     "ids, as shard_batch does; ids counted per shard mean other documents)")


def _agree(key, signature, local_error, seq_idx, layout, group, device):
    """Every rank checks that all ranks called with the same shapes and options, that none
    rejected its own inputs, and that no seq_idx steps down: one all-gather of a fixed-size
    integer vector (signature()'s values, then those two verdicts), so a mismatch cannot hang,
    and, with seq_idx over several pieces, a second of each piece's first and last ids, sent
    only once the first has agreed on their shapes. A difference raises the same ValueError on
    every rank (on a key's first call; later, the device-side assert above); a rank that
    rejected its inputs raises its own error and the others say which rank stopped them. group
    None: a world of one, nothing gathered."""
    expected = _AGREED.get(key) if key is not None else None       # what every rank sends when all is well
    read = _CHECKS["mode"] == "always" or local_error is not None or expected is None
    if read:
        values, names = signature()
        mine = torch.tensor(values + [local_error is not None, 0], dtype=torch.int64, device=device)
    else:
        mine = expected
    if seq_idx is not None and seq_idx.shape[1] > 1:
        mine = mine.clone()
        mine[-1:] = (seq_idx[:, 1:] < seq_idx[:, :-1]).any()
    every = _all_gather(mine, group) if group is not None else mine[None]   # (world, len(names) + 2)
    if read:
        _raise_disagreement(every.cpu(), names, local_error, group)
    else:
        torch._assert_async((every == expected).all(),
                            "mamba_cp: the ranks of cp_group were called with different shapes or options, "
                            "or a seq_idx steps down (set_input_checks('always') names it)")
    steps = None if seq_idx is None else _boundary_steps(seq_idx, layout, group)   # the shapes now agree
    if steps is not None and read:
        _raise_boundary_step(steps[0].cpu(), steps[1].cpu(), steps[2])
    elif steps is not None:
        torch._assert_async(~steps[0].any(), "mamba_cp: seq_idx steps down between two ranks' pieces of the "
                            "sequence (set_input_checks('always') names them)")
    if read and key is not None:
        if len(_AGREED) >= 1024:
            _AGREED.clear()
        _AGREED[key] = torch.tensor(values + [0, 0], dtype=torch.int64, device=device)


def _call_key(*args):
    """A call's arguments as a dict key: tensors by shape, dtype and device (what the checks
    read), lists as tuples; None where an argument cannot be hashed (nothing is then cached)."""
    key = tuple([(a.shape, a.dtype, a.device) if isinstance(a, Tensor) else tuple(a) if isinstance(a, list) else a
                 for a in args])
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _prepared(key, prepare, cp_group, world, ref, seq_idx, layout, signature):
    """What prepare() derives from a call: it runs the call's local checks (a ValueError on bad
    input) and returns what the call needs (its plan, its options). It runs on the first call of
    a key and is looked up after (under the same tuning and link model): checks that passed for a
    key cannot fail for it again. Then, outside CUDA-graph capture and compilation, every rank
    agrees with the others (_agree) before anything else is sent; a world of one checks only
    seq_idx's order. seq_idx (b, l) in the layout `layout`; signature(): _signature's (values,
    names), asked for only where read."""
    hit = _PREPARED.get(key) if key is not None else None
    found, error = None, None
    if hit is not None and hit[1] is tuning() and hit[2] is _LINK[0]:
        found = hit[0]
    else:
        try:
            found = prepare()
        except ValueError as e:
            error = e
    if not (ref.is_cuda and torch.cuda.is_current_stream_capturing()) and not torch.compiler.is_compiling():
        group = cp_group if world > 1 or (_CHECKS["world_of_one"] and cp_group is not None) else None
        seq = seq_idx if error is None else None
        if group is not None or seq is not None:    # a world of one without documents: nothing to agree
            _agree(key, signature, error, seq, layout, group, ref.device)
    if error is not None:
        raise error
    if key is not None and (hit is None or hit[0] is not found):
        if len(_PREPARED) >= 1024:
            _PREPARED.clear()
        _PREPARED[key] = (found, tuning(), _LINK[0])
    return found


def _agreement_ints():
    """How many int64 values each rank all-gathers when the public CP functions agree on their
    inputs (the signature and two verdicts): the count the volume model uses."""
    values, _ = _signature(**_call_signature(Call(*([None] * 9)), None, None, None, "none", False))
    return len(values) + 2


# ---------------------------------------------------------------------------------------------
# 10. Shard, unshard, and the permute layouts
#    A full sequence's shards in a layout, and load_balancing="permute_p2p" and "permute_a2a": tokens
#    moved to the contiguous layout and back.
# ---------------------------------------------------------------------------------------------


LAYOUTS = ("none", "virtual", "permute_p2p", "permute_a2a")


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


# Under torch.compile every collective runs inside a custom op (section 11 says why): the compiler
# records the call, and the op's own code runs the NCCL or gloo calls, which the compiler never
# traces. A group travels to an op by its handle.

def _group_name(group):
    """The handle the custom ops take for a process group: its name and its size ("" for none).
    The size is part of it because some fake outputs depend on it (an all-gather's, the CP ops'
    per-segment buffers), and inductor caches a compiled graph on disk under its arguments: by
    name alone (the world is "0" at every size) a graph traced at W = 2 would be reused at W = 3."""
    return "" if group is None else f"{group.group_name}:{dist.get_world_size(group)}"


def _resolve_group(handle):
    return None if handle == "" else dist.distributed_c10d._resolve_process_group(handle.rsplit(":", 1)[0])


def _zigzag_and_contiguous(world):
    """For each of the 2W pieces: (rank, half) in the zigzag layout and in the contiguous one."""
    zig, con = {}, {}
    for r in range(world):
        for half, piece in enumerate((r, 2 * world - 1 - r)):
            zig[piece] = (r, half)
        for half, piece in enumerate((2 * r, 2 * r + 1)):
            con[piece] = (r, half)
    return zig, con


def _permute(t, group, load_balancing, to_contiguous):
    """Move the two pieces of a (b, 2s, ...) shard between the zigzag and contiguous layouts,
    with point-to-point sends ("permute_p2p") or one all_to_all_single ("permute_a2a")."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return t.clone()
    zig, con = _zigzag_and_contiguous(world)
    src, dst = (zig, con) if to_contiguous else (con, zig)
    mine = {src_half: piece for piece, (r, src_half) in src.items() if r == me}   # half -> piece
    wanted = {dst[piece][1]: piece for piece in src if dst[piece][0] == me}       # half -> piece
    pieces = t.chunk(2, dim=1)
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    out_pieces = out.chunk(2, dim=1)
    if load_balancing == "permute_p2p":
        ops, landing = [], []
        for half, piece in mine.items():
            to = dst[piece][0]
            if to == me:
                out_pieces[dst[piece][1]].copy_(pieces[half])
            else:
                ops.append(_send(pieces[half].contiguous(), to, group))
        for half, piece in wanted.items():
            frm = src[piece][0]
            if frm != me:
                buf = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
                ops.append(_recv(buf, frm, group))
                landing.append((half, buf))
        _run_p2p(ops)
        for half, buf in landing:
            out_pieces[half].copy_(buf)
        return out
    # all_to_all_single moves blocks of dim 0: put the sequence first
    s = t.shape[1] // 2
    send_order = sorted(mine.items(), key=lambda kv: dst[kv[1]])                  # by (dst rank, dst half)
    send = torch.cat([pieces[half].transpose(0, 1) for half, _ in send_order]).contiguous()
    counts_to = [sum(1 for _, piece in send_order if dst[piece][0] == r) for r in range(world)]
    recv_order = sorted(wanted.items(), key=lambda kv: (src[kv[1]][0], kv[0]))   # by src rank, then half
    counts_from = [sum(1 for _, piece in recv_order if src[piece][0] == r) for r in range(world)]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, [c * s for c in counts_from], [c * s for c in counts_to], group=group)
    for i, (half, _) in enumerate(recv_order):
        out_pieces[half].copy_(recv[i * s:(i + 1) * s].transpose(0, 1))
    return out


@torch.library.custom_op("mamba_cp::permute", mutates_args=())
def _permute_op(t: Tensor, group_name: str, load_balancing: str, to_contiguous: bool) -> Tensor:
    """_permute as an op; its gradient travels the inverse permutation."""
    return _permute(t, _resolve_group(group_name), load_balancing, to_contiguous)


@_permute_op.register_fake
def _permute_fake(t, group_name, load_balancing, to_contiguous):
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


def _permute_keep(ctx, inputs, output):
    ctx.args = inputs[1:]


def _permute_backward(ctx, grad):
    group_name, load_balancing, to_contiguous = ctx.args
    return _permute_op(grad, group_name, load_balancing, not to_contiguous), None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_keep)


# ---------------------------------------------------------------------------------------------
# 11. The compile layer and the public CP function: mamba_conv1d_ssd_cp
# ---------------------------------------------------------------------------------------------


# torch.compile. While compiling, an entry runs the same StatePassingFn with the same steps, its
# forward and its backward each wrapped as one opaque custom op (torch.library): the compiler
# records the call and its output shapes (from a fake function), and the kernels run as they do
# eagerly, on the tensors they were given. Traced instead, a kernel's writes into views (the
# fused backward writes dx, dB, dC into channel slices of one buffer) become inductor's copies
# of those views and back, and at torch 2.11 such a copy read past its source (README
# "torch.compile"); in the interpreter the compiler would trace NumPy. An op takes plain values
# (an options tuple of numbers and strings, the group as its handle) and returns tensors only:
# absent outputs and gradients travel as empty tensors. Eager calls run the steps themselves.


def _none_if_empty(t):
    return None if t is None or t.numel() == 0 else t


def _empty_if_none(t, ref):
    return ref.new_empty(0) if t is None else t


def _unshared(ts):
    """ts, each one whose storage an earlier one uses copied: an op's outputs may share none, and
    the backward's small gradients (dA, dt_bias's, dD; the conv's dweight and dbias) are views of
    one sum each."""
    seen, out = set(), []
    for t in ts:
        key = t.untyped_storage()._cdata
        out.append(t.clone() if key in seen else t)
        seen.add(key)
    return out


_SCHEMA = {int: "int", float: "float", bool: "bool", str: "str", tuple: "int[]", Optional[torch.dtype]: "ScalarType?"}


def _as_ops(name, steps, options, plan_of, outputs, fake_forward, agree):
    """`steps` (whose arg is a plan) as Steps whose arg is an `options` tuple, each direction one
    custom op, mamba_cp::{name}_fwd and _bwd, taking the options' fields. Inside, plan_of(tensors,
    options) builds the plan; agree(options, tensors) first runs the ranks' agreement, which an
    eager call makes before. `outputs` counts the forward's outputs, the rest is what it keeps;
    fake_forward(options, *tensors) gives both as empty contiguous tensors of their shapes. A
    gradient is absent (empty) where its tensor is absent or not floating."""
    fields = ", ".join(f"{_SCHEMA[kind]} {field}" for field, kind in options.__annotations__.items())

    def forward(tensors, *opts):
        opts = options(*opts)
        agree(opts, tensors)
        out, kept = steps.forward(plan_of(tensors, opts), *tensors)
        # contiguous, as the fakes make them (a kept view may have other strides, or share a buffer)
        return [_empty_if_none(t, tensors[0]).contiguous() for t in (*out, *kept)]

    def backward(grads, tensors, kept, *opts):
        opts = options(*opts)
        grads = steps.backward(plan_of(tensors, opts), [_none_if_empty(g) for g in grads], tensors,
                               [_none_if_empty(k) for k in kept])
        return _unshared([_empty_if_none(g, tensors[0]) for g in grads])

    def forward_fake(tensors, *opts):
        return fake_forward(options(*opts), *tensors)

    def backward_fake(grads, tensors, kept, *opts):
        return [torch.empty_like(t) if t is not None and t.is_floating_point() else tensors[0].new_empty(0)
                for t in tensors]

    fwd = torch.library.custom_op(f"mamba_cp::{name}_fwd", forward, mutates_args=(),
                                  schema=f"(Tensor?[] tensors, {fields}) -> Tensor[]")
    bwd = torch.library.custom_op(f"mamba_cp::{name}_bwd", backward, mutates_args=(),
                                  schema=f"(Tensor?[] grads, Tensor?[] tensors, Tensor[] kept, {fields}) -> Tensor[]")
    fwd.register_fake(forward_fake)
    bwd.register_fake(backward_fake)

    def op_forward(opts, *tensors):
        out = fwd(list(tensors), *opts)
        return tuple(out[:outputs]), tuple(out[outputs:])

    def op_backward(opts, grads, tensors, kept):
        return [_none_if_empty(g) for g in bwd(list(grads), list(tensors), list(kept), *opts)]

    return Steps(op_forward, op_backward)


class CoreOptions(NamedTuple):
    """The fused core's options as plain values: what its ops take, and, with the call's shapes
    and group, what its Plan is built from."""
    batch: int                          # batch rows, before each segment became a row
    chunk_size: int
    headdim: int
    ngroups: int
    dt_min: float
    dt_max: float
    silu: bool
    state_dtype: Optional[torch.dtype]
    group: str                          # the CP group's handle (_group_name)
    load_balancing: str                 # the layout the method computes: "none" or "virtual"
    summary_exchange: str               # "all_gather" or "scan"


def _core_options(batch, nheads, conv_dim, d_conv, chunk_size, headdim, ngroups, dt_limit, activation, state_dtype,
                  cp_group, world, load_balancing, summary_exchange):
    """A checked call's CoreOptions: summary_exchange resolved ("auto" by the link model)."""
    dstate = (conv_dim - nheads * headdim) // (2 * ngroups)
    # the computed layout: two segments a row where a rank holds two pieces of the zigzag (_pieces:
    # a world of one holds one); the permute layouts move the tokens first and compute one
    two = load_balancing == "virtual" and len(_pieces(0, world, load_balancing)[0]) == 2
    layout = "virtual" if two else "none"
    exchange = chosen_exchange(summary_exchange, world, layout, batch, (nheads, headdim, dstate), conv_dim, d_conv)
    return CoreOptions(batch, chunk_size, headdim, ngroups, float(dt_limit[0]), float(dt_limit[1]),
                       activation is not None, state_dtype, _group_name(cp_group), layout, exchange)


def _core_plan(tensors, o, group=None):
    """The Plan of a fused-core call (a Call's tensors, one segment per row) under CoreOptions o."""
    return Plan(Call(*tensors), o.batch, o.chunk_size, o.headdim, o.ngroups, (o.dt_min, o.dt_max), o.silu,
                o.state_dtype, group if group is not None else _resolve_group(o.group), o.load_balancing,
                EXCHANGES[o.summary_exchange])


def _world_of(group_name):
    """The group's size, from its handle (_group_name)."""
    return int(group_name.rsplit(":", 1)[1]) if group_name else 1


def _core_fake(o, xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx):
    """The core's forward outputs and Kept as empty tensors of their shapes (METHOD's)."""
    rows, s, conv_dim = xBC.shape
    h, p = dt.shape[2], o.headdim
    n = (conv_dim - h * p) // (2 * o.ngroups)
    count = _per_row(o) * _world_of(o.group)
    f32 = dict(device=xBC.device, dtype=torch.float32)
    kept = [xBC.new_empty(0) for _ in range(5)]     # a single segment keeps nothing
    if count > 1:
        scan, docs = o.summary_exchange == "scan", seq_idx is not None
        kept = [xBC.new_empty((rows, conv_weight.shape[1] - 1, conv_dim)),
                torch.empty((rows, conv_weight.shape[1] - 1), device=xBC.device, dtype=torch.int32) if docs
                else xBC.new_empty(0),
                torch.empty((rows, h, p, n), **f32), torch.empty((rows, h) if scan else (o.batch, count, h), **f32),
                torch.empty((rows,) if scan else (o.batch, count), **f32) if docs else xBC.new_empty(0)]
    return [xBC.new_empty((rows, s, h, p)), torch.empty((o.batch, h, p, n), **f32), *kept]


def _core_agrees(o, tensors):
    """The ranks' agreement on a compiled core call, inside its forward op."""
    call = Call(*tensors)
    group = _resolve_group(o.group)
    seq_idx = None if call.seq_idx is None else call.seq_idx.reshape(o.batch, -1)   # the rows back to (b, l)
    _prepared(_call_key(o, *tensors), lambda: None, group, _world_of(o.group), call.xBC, seq_idx, o.load_balancing,
              lambda: _signature(**_call_signature(call, o.chunk_size, o.headdim, o.ngroups, o.load_balancing, False,
                                                   o.summary_exchange)))


CORE_OPS = _as_ops("core", METHOD, CoreOptions, _core_plan, 2, _core_fake, _core_agrees)


def _per_row(o):
    """Segments a row of the caller's tensors holds under options o (their computed layout): a
    rank's two zigzag pieces under "virtual", else one."""
    return 2 if o.load_balancing == "virtual" else 1


def _rows(t, per_row):
    """(b, per_row * s, ...) -> (b * per_row, s, ...): one causal segment per row."""
    if per_row == 1:                    # t itself: a view costs the host an op
        return t
    return t.reshape(t.shape[0] * per_row, t.shape[1] // per_row, *t.shape[2:])


def _segment_rows(call, per_row):
    """A Call in the caller's layout as the method takes it: one causal segment per batch row,
    seq_idx int32 and contiguous."""
    seq_idx = None if call.seq_idx is None else _rows(call.seq_idx.to(torch.int32), per_row).contiguous()
    return Call(_rows(call.xBC, per_row), _rows(call.dt, per_row), *call[2:8], seq_idx)


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
    call = Call(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx)
    ref = xBC if isinstance(xBC, Tensor) else torch.empty(0)
    rank, world = _group_info(cp_group, ref)

    def options():                      # the local checks, then the call's options
        _check_cp_inputs(call, chunk_size, headdim, ngroups, load_balancing, world, dt_limit, activation,
                         state_dtype, summary_exchange)
        return _core_options(xBC.shape[0], dt.shape[2], xBC.shape[2], conv_weight.shape[1], chunk_size, headdim,
                             ngroups, dt_limit, activation, state_dtype, cp_group, world, load_balancing,
                             summary_exchange)

    if torch.compiler.is_compiling():   # the ranks agree inside the forward op, when it runs
        o = options()
        steps, arg = CORE_OPS, o
    else:
        def prepare():
            o = options()
            return o, _core_plan(_segment_rows(call, _per_row(o)), o, cp_group)
        key = _call_key(cp_group, *call, chunk_size, headdim, ngroups, load_balancing, dt_limit, return_final_states,
                        activation, state_dtype, summary_exchange)
        o, plan = _prepared(key, prepare, cp_group, world, ref, seq_idx, load_balancing,
                            lambda: _signature(**_call_signature(call, chunk_size, headdim, ngroups, load_balancing,
                                                                 return_final_states, summary_exchange)))
        steps, arg = METHOD, plan
    permuted = load_balancing.startswith("permute") and world > 1
    if permuted:
        xBC, dt = _permute_op(xBC, o.group, load_balancing, True), _permute_op(dt, o.group, load_balancing, True)
        seq_idx = None if seq_idx is None else _permute_op(seq_idx.to(torch.int32), o.group, load_balancing, True)
        call = Call(xBC, dt, *call[2:8], seq_idx)
    y, final = StatePassingFn.apply(steps, arg, *_segment_rows(call, _per_row(o)))
    y = y.reshape(o.batch, -1, *y.shape[2:])                                     # the rows back to (b, l, h, p)
    if permuted:
        y = _permute_op(y, o.group, load_balancing, False)
    return (y, final) if return_final_states else y


# ---------------------------------------------------------------------------------------------
# 12. The gate and the gated RMSNorm
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


@_Launched
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


@_Launched
@triton.jit
def _gate_norm_bwd_kernel(do_ptr, y_ptr, z_ptr, w_ptr, dy_ptr, dz_ptr, dw_part_ptr, out_ptr, n_rows, seqlen, dim,
                          group_size, eps, n_inner, stride_do_b, stride_do_l, stride_y_b, stride_y_l, stride_z_b,
                          stride_z_l, stride_dy_b, stride_dy_l, stride_dz_b, stride_dz_l, stride_dw_r, stride_o_b,
                          stride_o_l, BR: tl.constexpr, BG: tl.constexpr, NORM: tl.constexpr, BEFORE: tl.constexpr,
                          HAS_OUT: tl.constexpr):
    """dy and dz of n_inner blocks of BR token rows, one group of channels; the norm weight's
    gradient summed over those rows into this program's own partial row (no atomics).
    Through n = v r:  dv = r (dn - n mean_group(n dn)). HAS_OUT: the forward's output again,
    for an out projection's weight gradient, from the values this pass holds anyway."""
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
        if HAS_OUT:
            o = y * gate
            if NORM:
                o = n * w * gate if BEFORE else n * w
            tl.store(out_ptr + b[:, None] * stride_o_b + t[:, None] * stride_o_l + cols[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=mask)
        sig = tl.sigmoid(z)
        dz = dgate * sig * (1.0 + z * (1.0 - sig))
        tl.store(dy_ptr + b[:, None] * stride_dy_b + t[:, None] * stride_dy_l + cols[None, :],
                 dy.to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + b[:, None] * stride_dz_b + t[:, None] * stride_dz_l + cols[None, :],
                 dz.to(dz_ptr.dtype.element_ty), mask=mask)
    if NORM:
        tl.store(dw_part_ptr + tl.program_id(0).to(tl.int64) * stride_dw_r + cols, dw, mask=in_group)


class _GateNorm(NamedTuple):
    """The gate y * silu(z) (norm False), or the gated RMSNorm, over (b, l, dim) tensors (any
    strides with a unit channel stride), and its gradient; launches the two kernels above."""
    norm: bool
    eps: float
    group_size: int
    before: bool                            # norm_before_gate

    def tiles(self, dim):
        """(channels per program: one norm group, else up to 1024; their power-of-two tile;
        token rows per program, about the tuning's gate_tile elements a tile)."""
        gs = self.group_size if self.norm else min(dim, 1024)
        BG = _next_pow2(gs)
        return gs, BG, max(1, tuning().gate_tile // BG)

    def forward(self, y, z, w, out):
        """Writes the gated output into out (b, l, dim), a view; w the norm's weight (or None)."""
        b, l, dim = y.shape
        gs, BG, BR = self.tiles(dim)
        _gate_norm_fwd_kernel[(_cdiv(b * l, BR), _cdiv(dim, gs))](
            y, z, y if w is None else w, out, b * l, l, dim, gs, self.eps, y.stride(0), y.stride(1), z.stride(0),
            z.stride(1), out.stride(0), out.stride(1), BR=BR, BG=BG, NORM=self.norm, BEFORE=self.before)

    def backward(self, do, y, z, w, dz, out=None):
        """dy (b, l, dim) in y's dtype, dz written into dz (a view), and the norm weight's
        gradient (fp32, None without a norm); where out (a view) is given, the forward's output
        written into it again."""
        b, l, dim = y.shape
        gs, BG, BR = self.tiles(dim)
        programs, warps = tuning().gate_programs, 4
        if self.norm:        # it holds several tiles of a row's group at once and sums each row twice
            BR, warps, programs, partials = tuning().norm_bwd
        n_blocks, n_cols = _cdiv(b * l, BR), _cdiv(dim, gs)
        n_inner = max(1, _cdiv(n_blocks * n_cols, programs))
        if self.norm:        # at most `partials` rows of the weight's partial gradient
            n_inner = max(n_inner, _cdiv(n_blocks, partials))
        n_row_progs = _cdiv(n_blocks, n_inner)
        dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
        dw_part = torch.empty((n_row_progs, dim), device=y.device, dtype=torch.float32) if self.norm else None
        _gate_norm_bwd_kernel[(n_row_progs, n_cols)](
            do, y, z, y if w is None else w, dy, dz, dy if dw_part is None else dw_part, dy if out is None else out,
            b * l, l, dim, gs, self.eps, n_inner, do.stride(0), do.stride(1), y.stride(0), y.stride(1), z.stride(0),
            z.stride(1), dy.stride(0), dy.stride(1), dz.stride(0), dz.stride(1),
            0 if dw_part is None else dw_part.stride(0), *((0, 0) if out is None else out.stride()[:2]),
            BR=BR, BG=BG, NORM=self.norm, BEFORE=self.before, HAS_OUT=out is not None, num_warps=warps)
        return dy, (dw_part.sum(0) if self.norm else None)


_Z_GATE = _GateNorm(False, 0.0, 0, True)   # the plain gate y * silu(z), also mamba_chunk_scan_combined's


# ---------------------------------------------------------------------------------------------
# 13. The single-device function: mamba_chunk_scan_combined
#    The SSD of a whole sequence on one device: section 4's and 5's steps with no exchange (its
#    entry is initial_states), the z gate, and the packed documents' end states.
# ---------------------------------------------------------------------------------------------

@_Launched
@triton.jit
def _document_end_state_kernel(
    x_ptr, B_ptr, dts, cu_ptr, in_edge, out_ptr,
    seqlen, nheads: tl.constexpr, headdim: tl.constexpr, dstate: tl.constexpr, heads_per_group: tl.constexpr,
    chunks_per_run, n_n_tiles: tl.constexpr,
    stride_x, stride_B,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_ENTRY: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The state after the last token e of one packed document (batch row 0), for one (head,
    state tile): the chunk c holding e is entered with S_in (its stored state from a zero run
    entry, plus gamma(c) times the run's entry state), so
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

    dt, dA, slope = _chunk_dt(dts, zero, h, start + offs_q, seqlen, HAS_DT_BIAS, DT_SOFTPLUS)
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
        chunk_slot, run_slot = _chunk_slots(zero, c, seqlen, chunks_per_run, Q)
        S_in = _true_chunk_edge(in_edge, chunk_slot, run_slot, h, offs_p, offs_n, mask_pn, nheads, headdim, dstate,
                                HAS_ENTRY)
        S += tl.exp(cs_e.to(tl.float32)) * S_in
    tl.store(out_ptr + _state_tile(d, h, offs_p, offs_n, nheads, headdim, dstate), S, mask=mask_pn)


def document_end_states(ssd, summary, cu_seqlens, entry=None):
    """The float32 state after each packed document of batch row 0, (num_docs, h, p, n), given
    the documents' bounds cu_seqlens (num_docs + 1,) and the sequence's entry state (or None)."""
    x, B, plan = ssd.x, ssd.B, summary.plan
    run_entry, _ = summary.run_entries(entry)
    ndocs = cu_seqlens.shape[0] - 1
    out = torch.empty(ndocs, plan.nheads, plan.headdim, plan.dstate, device=x.device, dtype=torch.float32)
    gamma = summary.gamma
    _document_end_state_kernel[(ndocs, plan.nheads, plan.n_p_tiles * plan.n_n_tiles)](
        x, B, plan.dts(ssd.dt, ssd.dt_bias, ssd.A), cu_seqlens,
        _ChunkEdge(summary.states, gamma, gamma if run_entry is None else run_entry), out,
        plan.seqlen, plan.nheads, plan.headdim, plan.dstate, plan.heads_per_group, plan.chunks_per_run,
        plan.n_n_tiles, _BLHP(*x.stride()), _BLGN(*B.stride()),
        Q=plan.Q, BP=plan.BP_state, BN=plan.BN_state, HAS_ENTRY=run_entry is not None,
        DOT_PRECISION=plan.state_precision,
        **plan.dt_flags)
    return out


def _flat_heads(t):
    """(b, l, h, p) as (b, l, h*p) with a unit channel stride, as the gate's kernels read it (a
    view where the strides allow one)."""
    return (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()).flatten(-2)


class ScanCall(NamedTuple):
    """The tensors of one mamba_chunk_scan_combined call (shapes in its docstring)."""
    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Optional[Tensor]
    z: Optional[Tensor]
    dt_bias: Optional[Tensor]
    initial_states: Optional[Tensor]
    seq_idx: Optional[Tensor]           # int32
    cu_seqlens: Optional[Tensor]


class ScanOptions(NamedTuple):
    """mamba_chunk_scan_combined's options as plain values."""
    chunk_size: int
    dt_softplus: bool
    dt_min: float
    dt_max: float
    need_final: bool
    need_doc_states: bool
    state_dtype: Optional[torch.dtype]


class _ScanPlan(NamedTuple):
    options: ScanOptions
    fwd: LaunchPlan
    bwd: LaunchPlan


def _scan_plan(tensors, o):
    call, t = ScanCall(*tensors), tuning()
    shape = (*call.x.shape, *call.B.shape[2:])
    fwd, bwd = (LaunchPlan(shape, call.x.dtype, min(o.chunk_size, q), call.dt_bias, o.dt_softplus, (o.dt_min, o.dt_max),
                           call.seq_idx, o.state_dtype, backward) for q, backward in ((t.chunk_fwd, False),
                                                                                     (t.chunk_bwd, True)))
    return _ScanPlan(o, fwd, bwd)


def _scan_forward(plan, *tensors):
    """(out: y, or y silu(z) with z; the final state or None; each packed document's end state
    or None), and what the backward keeps: y before the gate, with z. The gate is written by the
    output kernel beside y, which is kept, as mamba_ssm keeps it; the backward runs the gate's own
    kernel first (folded into the chunk backward it cost more: BENCHMARKS.md)."""
    call = ScanCall(*tensors)
    _check_document_values(call.seq_idx, call.cu_seqlens)
    ssd = ssd_tensors(call.x, call.B, call.C, call, plan.fwd)
    summary = Summary(ssd, plan.fwd)
    gate = None if call.z is None else (call.z, torch.empty(call.x.shape, device=call.x.device, dtype=call.x.dtype))
    y, final = ssd_output(ssd, summary, call.initial_states, need_exit=plan.options.need_final, gate=gate)
    docs = document_end_states(ssd, summary, call.cu_seqlens, call.initial_states) if plan.options.need_doc_states \
        else None
    return ((y, final, docs), ()) if gate is None else ((gate[1], final, docs), (y,))


def _scan_backward(plan, grads, tensors, kept):
    """The gradients of _scan_forward, as a ScanCall. Backward recomputes the chunk states (they
    are as large as x, so they are not kept). The packed documents' end states are forward only,
    as in mamba_ssm: a gradient arriving at them is an error, not silently dropped."""
    dout, dfinal, ddocs = grads
    if ddocs is not None and bool(ddocs.ne(0).any()):   # compiled, an unused output's gradient is zeros
        raise RuntimeError("mamba_chunk_scan_combined: the states returned with return_varlen_states=True have "
                           "no backward (as in mamba_ssm); detach them before they reach the loss")
    call = ScanCall(*tensors)
    dy = torch.zeros_like(call.x) if dout is None else dout
    dz = None
    if call.z is not None:                          # through the gate first
        dz = torch.empty(call.z.shape, device=call.z.device, dtype=call.z.dtype)
        dy, _ = _Z_GATE.backward(_flat_heads(dy), _flat_heads(kept[0]), _flat_heads(call.z), None, dz.flatten(-2))
        dy = dy.unflatten(-1, call.x.shape[2:])
    ssd = ssd_tensors(call.x, call.B, call.C, call, plan.bwd)
    grad_pass = GradPass(dy, ssd, plan.bwd)
    dx, dB, dC, ddt, dA, dD, ddt_bias, dinit = ssd_grads(ssd, chunk_states(ssd, plan.bwd, call.initial_states),
                                                         grad_pass, dy, dfinal)
    return ScanCall(dx, ddt, dA.to(call.A.dtype), dB, dC, _as(dD, call.D), dz, _as(ddt_bias, call.dt_bias),
                    _as(dinit, call.initial_states), None, None)


def _scan_fake(o, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens):
    b, _, h, p = x.shape
    f32 = dict(device=x.device, dtype=torch.float32)
    return [torch.empty_like(x), torch.empty((b, h, p, B.shape[3]), **f32) if o.need_final else x.new_empty(0),
            torch.empty((cu_seqlens.shape[0] - 1, h, p, B.shape[3]), **f32) if o.need_doc_states else x.new_empty(0),
            *([] if z is None else [torch.empty_like(x)])]


# Parameter gradients are per-chunk partials summed in a fixed order: two identical calls give
# bitwise identical results.
SCAN = Steps(_scan_forward, _scan_backward)
SCAN_OPS = _as_ops("chunk_scan", SCAN, ScanOptions, _scan_plan, 3, _scan_fake, lambda o, tensors: None)


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
    state_dtype: the dtype of the chunk and run entry states stored between kernels (default: x's
    dtype; float32 for float32 x). float32 with bf16 inputs doubles them for a little accuracy.
    """
    call = ScanCall(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens)

    def options():
        _check_ssd_inputs(call, chunk_size, dt_limit)
        _expect(state_dtype in _STATE_DTYPES, "state_dtype", state_dtype, f"one of {_STATE_DTYPES}")
        _check_varlen(cu_seqlens, return_varlen_states, seq_idx, x)
        return ScanOptions(chunk_size, bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]),
                           bool(return_final_states), bool(return_varlen_states), state_dtype)

    if torch.compiler.is_compiling():
        steps, arg = SCAN_OPS, options()
    else:
        key = _call_key(*call, chunk_size, dt_softplus, dt_limit, return_final_states, return_varlen_states,
                        state_dtype)
        steps, arg = SCAN, _prepared(key, lambda: _scan_plan(call, options()), None, 1,
                                     x if isinstance(x, Tensor) else torch.empty(0), None, "none", None)
    if seq_idx is not None:
        call = call._replace(seq_idx=seq_idx.to(torch.int32))
    y, final, doc_states = StatePassingFn.apply(steps, arg, *call)
    out = (y,) + ((final,) if return_final_states else ()) + ((doc_states,) if return_varlen_states else ())
    return out[0] if len(out) == 1 else out


# ---------------------------------------------------------------------------------------------
# 14. The mixer entry: mamba_split_conv1d_scan_combined
#    mamba_ssm's fused entry, the one Mamba2 mixers call.
#
# zxbcdt = [z0 | x0 | z | xBC | dt] (widths d_nonssm, d_nonssm, dim, conv_dim, nheads). The core
# (conv + SSD, with CP) runs on the xBC and dt channels, by section 1's method_forward and
# method_backward; everything else is per token and stays local: the gate y * silu(z) or the
# gated RMSNorm, the SwiGLU channels silu(z0) * x0 in front, the out projection. All of it is one
# StatePassingFn call, so the gradient of zxbcdt is one buffer whose channel slices are filled in
# place (autograd would otherwise add a zxbcdt-sized zero buffer per slice).
# ---------------------------------------------------------------------------------------------

def _swiglu(z0, x0):
    return (z0.float() * torch.sigmoid(z0.float()) * x0.float())


def _swiglu_grad(ds, z0, x0):
    z0f, x0f = z0.float(), x0.float()
    sig = torch.sigmoid(z0f)
    return ds * x0f * sig * (1.0 + z0f * (1.0 - sig)), ds * z0f * sig


def _swiglu_part(y, z0, x0, widths):
    """(b, l, d_nonssm + dim) in y's dtype, silu(z0) x0 written in its first d_nonssm channels;
    the gate's kernels write the rest."""
    d_nonssm = widths[0]
    out = torch.empty((*y.shape[:2], d_nonssm + y.shape[2]), device=y.device, dtype=y.dtype)
    if d_nonssm:
        out[..., :d_nonssm] = _swiglu(z0, x0)
    return out


def _split_output(y, z, z0, x0, gate_norm, w, widths):
    """[silu(z0) x0 | the gate or the gated RMSNorm of y], (b, l, d_nonssm + dim) in y's dtype."""
    out = _swiglu_part(y, z0, x0, widths)
    gate_norm.forward(y, z, w, out[..., widths[0]:])
    return out


def _rows_view(t, per_row):
    """_rows(t, per_row) as a view of t (writes into it land in t), or None where strides forbid one."""
    if per_row == 1:
        return t
    try:
        return t.view(t.shape[0] * per_row, t.shape[1] // per_row, *t.shape[2:])
    except RuntimeError:
        return None


class MixerCall(NamedTuple):
    """The tensors of one mamba_split_conv1d_scan_combined call, as its steps take them."""
    zxbcdt: Tensor                      # (b, l, width) [z0 | x0 | z | xBC | dt], unit channel stride
    conv_weight: Tensor                 # (conv_dim, d_conv)
    conv_bias: Optional[Tensor]
    dt_bias: Optional[Tensor]
    A: Tensor
    D: Optional[Tensor]
    initial_states: Optional[Tensor]
    rmsnorm_weight: Optional[Tensor]    # (dim,)
    outproj_weight: Optional[Tensor]    # (d_out, d_nonssm + dim)
    outproj_bias: Optional[Tensor]
    seq_idx: Optional[Tensor]           # (rows, s) int32, one segment a row, in the computed layout


# CoreOptions' fields, then zxbcdt's five widths, the norm's eps and group size, norm_before_gate,
# and the caller's load_balancing (a permute layout moves the tokens first)
MixerOptions = NamedTuple("MixerOptions", [*CoreOptions.__annotations__.items(), ("widths", tuple), ("eps", float),
                                           ("group_size", int), ("norm_before_gate", bool), ("layout", str)])


class _MixerPlan(NamedTuple):
    options: MixerOptions
    core: Plan
    gate_norm: _GateNorm
    permute: bool                       # the layout is a permute one, in a world of more than one
    gate_in_output: bool                # the plain gate rides on the output kernel's pass over y


def _mixer_plan(tensors, o, group=None):
    m = MixerCall(*tensors)
    per_row = _per_row(o)
    xBC, dt = m.zxbcdt.split_with_sizes(o.widths, -1)[3:]
    core = _core_plan(Call(_rows(xBC, per_row), _rows(dt, per_row), *m[1:7], m.seq_idx),
                      CoreOptions(*o[:len(CoreOptions._fields)]), group)
    norm, permute = m.rmsnorm_weight is not None, o.layout.startswith("permute") and core.world > 1
    return _MixerPlan(o, core, _GateNorm(norm, o.eps, o.group_size, o.norm_before_gate), permute,
                      not norm and o.widths[0] == 0 and not permute)


def _mixer_forward(plan, *tensors):
    """(out, the final state), and what the backward keeps: y (b, l, dim) before the gate, the
    permuted xBC and dt rows (None unless permuted), and the core's Kept."""
    m, o, core = MixerCall(*tensors), plan.options, plan.core
    per_row = core.segments.per_row
    z0, x0, z, xBC, dt = m.zxbcdt.split_with_sizes(o.widths, -1)
    if plan.permute:
        xBC, dt = _permute(xBC, core.group, o.layout, True), _permute(dt, core.group, o.layout, True)
    call = Call(_rows(xBC, per_row), _rows(dt, per_row), *m[1:7], m.seq_idx)
    gate = None
    z_rows = _rows_view(z, per_row) if plan.gate_in_output else None
    if z_rows is not None:      # the gate written beside y by the output kernel: one kernel and one read of y less
        z_rows = z_rows.view(*z_rows.shape[:2], core.nheads, -1)          # (rows, s, h, p)
        gate = (z_rows, torch.empty(z_rows.shape, device=z.device, dtype=xBC.dtype))
    y, final, kept = method_forward(call, core, gate)
    y = y.reshape(o.batch, -1, y.shape[2] * y.shape[3])                       # (b, l, dim)
    if plan.permute:
        y = _permute(y, core.group, o.layout, False)
    if gate is not None:
        out = gate[1].reshape(y.shape)
    else:
        out = _split_output(y, z, z0, x0, plan.gate_norm, m.rmsnorm_weight, o.widths)
    if m.outproj_weight is not None:
        out = F.linear(out.to(m.outproj_weight.dtype), m.outproj_weight, m.outproj_bias)
    return (out, final), (y, *((call.xBC, call.dt) if plan.permute else (None, None)), *kept)


def _mixer_backward(plan, grads, tensors, kept):
    """The gradients of _mixer_forward, as a MixerCall; dzxbcdt is one buffer, its channel
    slices written in place (the gate's kernel writes dz there directly, the core dxBC and ddt)."""
    dout, dfinal = grads
    m, o, core = MixerCall(*tensors), plan.options, plan.core
    y, xBC_rows, dt_rows, *core_kept = kept
    per_row, w = core.segments.per_row, m.outproj_weight
    z0, x0, z, xBC, dt = m.zxbcdt.split_with_sizes(o.widths, -1)
    if dout is None:                                # only the final state reached the loss
        width = o.widths[0] + o.widths[2] if w is None else w.shape[0]
        dout = torch.zeros((*y.shape[:2], width), device=y.device, dtype=y.dtype if w is None else w.dtype)
    dout = dout.contiguous()                        # the gate's kernels take unit channel strides
    if not plan.permute:
        xBC_rows, dt_rows = _rows(xBC, per_row), _rows(dt, per_row)
    dW = db = pre = None
    d_nonssm = o.widths[0]
    if w is not None:           # the out projection's input again: the gate's backward writes it
        dproj, dout = dout, dout.matmul(w)
        pre = _swiglu_part(y, z0, x0, o.widths)
    dzxbcdt = torch.empty(m.zxbcdt.shape, device=m.zxbcdt.device, dtype=m.zxbcdt.dtype)
    dz0, dx0, dz, dxBC_out, ddt_out = dzxbcdt.split_with_sizes(o.widths, -1)
    if d_nonssm:
        dz0_, dx0_ = _swiglu_grad(dout[..., :d_nonssm].float(), z0, x0)
        dz0.copy_(dz0_)
        dx0.copy_(dx0_)
    dy, dw = plan.gate_norm.backward(dout[..., d_nonssm:], y, z, m.rmsnorm_weight, dz,    # dz written into dzxbcdt
                                     None if pre is None else pre[..., d_nonssm:])
    if w is not None:
        dW = dproj.flatten(0, 1).t().mm(_as(pre, w).flatten(0, 1)).to(w.dtype)
        db = None if m.outproj_bias is None else dproj.sum(dim=(0, 1)).to(m.outproj_bias.dtype)
        del pre, dproj          # before the core's backward, where the peak is
    if plan.permute:
        dy = _permute(dy, core.group, o.layout, True)
    dy = _rows(dy.view(*dy.shape[:2], core.nheads, -1), per_row)
    # the core writes dxBC and ddt into dzxbcdt, unless the rows travel (permute) or its
    # strides allow no per-segment view: then they are copied in once
    into = (None, None) if plan.permute else (_rows_view(dxBC_out, per_row), _rows_view(ddt_out, per_row))
    g = method_backward(dy, dfinal, Call(xBC_rows, dt_rows, *m[1:7], m.seq_idx), Kept(*core_kept), core,
                        dxBC=into[0], ddt=into[1])
    for rows_grad, view, out in ((g.xBC, into[0], dxBC_out), (g.dt, into[1], ddt_out)):
        if view is None:
            full = rows_grad.reshape(o.batch, -1, *rows_grad.shape[2:])
            out.copy_(_permute(full, core.group, o.layout, False) if plan.permute else full)
    return MixerCall(dzxbcdt, g.conv_weight, g.conv_bias, g.dt_bias, g.A, g.D, g.initial_states,
                     _as(dw, m.rmsnorm_weight), dW, db, None)


def _mixer_fake(o, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
                outproj_bias, seq_idx):
    b, l, _ = zxbcdt.shape
    per_row = _per_row(o)
    xBC, dt = (zxbcdt.new_empty((b * per_row, l // per_row, width)) for width in o.widths[3:])
    y, final, *kept = _core_fake(CoreOptions(*o[:len(CoreOptions._fields)]), xBC, dt, conv_weight, conv_bias, dt_bias,
                                 A, D, initial_states, seq_idx)
    width = outproj_weight.shape[0] if outproj_weight is not None else o.widths[0] + o.widths[2]
    out = torch.empty((b, l, width), device=zxbcdt.device,
                      dtype=outproj_weight.dtype if outproj_weight is not None else zxbcdt.dtype)
    permuted = o.layout.startswith("permute") and _world_of(o.group) > 1
    rows = [xBC, dt] if permuted else [zxbcdt.new_empty(0), zxbcdt.new_empty(0)]
    return [out, final, zxbcdt.new_empty((b, l, o.widths[2])), *rows, *kept]


def _mixer_agrees(o, tensors):
    """The ranks' agreement on a compiled mixer call, inside its forward op."""
    m = MixerCall(*tensors)
    seq_idx = None if m.seq_idx is None else m.seq_idx.reshape(o.batch, -1)          # the rows back to (b, l)
    _prepared(_call_key(o, *tensors), lambda: None, _resolve_group(o.group), _world_of(o.group), m.zxbcdt, seq_idx,
              o.load_balancing, lambda: _signature(**_call_signature(
                  Call(m.zxbcdt, None, *m[1:7], m.seq_idx), o.chunk_size, o.headdim, o.ngroups, o.load_balancing,
                  False, o.summary_exchange)))


MIXER = Steps(_mixer_forward, _mixer_backward)
MIXER_OPS = _as_ops("mixer", MIXER, MixerOptions, _mixer_plan, 2, _mixer_fake, _mixer_agrees)


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
    _check_tensor(ref, "zxbcdt", (None, None, None), ref, dtypes=_FLOATS)
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
    ref = zxbcdt if isinstance(zxbcdt, Tensor) else torch.empty(0)
    rank, world = _group_info(cp_group, ref)
    m = MixerCall(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight, outproj_weight,
                  outproj_bias, seq_idx)

    def options():                      # the local checks, then the call's options
        widths, p = _split_widths(zxbcdt, conv1d_weight, A, D, headdim, ngroups)
        _check_split_options(widths, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias,
                             ngroups, zxbcdt)
        _, _, _, xBC, dt = zxbcdt.split(widths, dim=-1)
        _check_cp_inputs(Call(xBC, dt, *m[1:7], seq_idx), chunk_size, p, ngroups, load_balancing, world, dt_limit,
                         activation, state_dtype, summary_exchange)
        core = _core_options(zxbcdt.shape[0], widths[4], widths[3], conv1d_weight.shape[1], chunk_size, p, ngroups,
                             dt_limit, activation, state_dtype, cp_group, world, load_balancing, summary_exchange)
        return MixerOptions(*core, tuple(widths), float(rmsnorm_eps), widths[2] // ngroups, bool(norm_before_gate),
                            load_balancing)

    if torch.compiler.is_compiling():   # the ranks agree inside the forward op, when it runs
        o = options()
        steps, arg = MIXER_OPS, o
    else:
        key = _call_key(cp_group, *m, chunk_size, dt_limit, return_final_states, activation, rmsnorm_eps, headdim,
                        ngroups, norm_before_gate, state_dtype, load_balancing, summary_exchange)
        arg = _prepared(key, lambda: _mixer_plan(m, options(), cp_group), cp_group, world, ref, seq_idx,
                        load_balancing, lambda: _signature(**_call_signature(
                            Call(zxbcdt, None, *m[1:7], seq_idx), chunk_size, headdim, ngroups, load_balancing,
                            return_final_states, summary_exchange)))
        o, steps = arg.options, MIXER
    if zxbcdt.stride(-1) != 1:                     # the gate's kernels take unit channel strides
        zxbcdt = zxbcdt.contiguous()
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
        if o.layout.startswith("permute") and world > 1:
            seq_idx = _permute_op(seq_idx, o.group, o.layout, True)
        seq_idx = _rows(seq_idx, _per_row(o)).contiguous()
    out, final = StatePassingFn.apply(steps, arg, zxbcdt, *m[1:10], seq_idx)
    return (out, final) if return_final_states else out


# ---------------------------------------------------------------------------------------------
# 15. The all-to-all baseline, and the bytes every path moves
#    The head-parallel CP state passing replaces, and comm_bytes, the cost model's terms.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("mamba_cp::all_to_all", mutates_args=())
def _all_to_all_op(t: Tensor, group_name: str) -> Tensor:
    """Equal-block all_to_all_single along dim 0 (W blocks); its gradient is the same all-to-all."""
    out = torch.empty(t.shape, device=t.device, dtype=t.dtype)
    dist.all_to_all_single(out, t.contiguous(), group=_resolve_group(group_name))
    return out


@_all_to_all_op.register_fake
def _all_to_all_fake(t, group_name):
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


def _keep_group(ctx, inputs, output):
    ctx.group_name = inputs[1]


_all_to_all_op.register_autograd(lambda ctx, grad: (_all_to_all_op(grad, ctx.group_name), None),
                                 setup_context=_keep_group)


@torch.library.custom_op("mamba_cp::all_gather", mutates_args=())
def _all_gather_op(t: Tensor, group_name: str) -> Tensor:
    return _all_gather(t, _resolve_group(group_name))


@_all_gather_op.register_fake
def _all_gather_fake(t, group_name):
    return t.new_empty((_world_of(group_name), *t.shape))


@torch.library.custom_op("mamba_cp::all_reduce", mutates_args=())
def _all_reduce_op(t: Tensor, group_name: str) -> Tensor:
    out = t.contiguous().clone()
    dist.all_reduce(out, group=_resolve_group(group_name))
    return out


@_all_reduce_op.register_fake
def _all_reduce_fake(t, group_name):
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


@torch.library.custom_op("mamba_cp::gather_heads", mutates_args=())
def _gather_heads_op(block: Tensor, group_name: str) -> Tensor:
    """All-gather of per-rank head blocks (b, hW, p, n) into the replicated (b, h, p, n) final
    state; every rank's copy receives gradient, so its gradient sums them and keeps this rank's block."""
    return torch.cat(list(_all_gather(block.contiguous(), _resolve_group(group_name)).unbind(0)), dim=1)


@_gather_heads_op.register_fake
def _gather_heads_fake(block, group_name):
    b, hw, p, n = block.shape
    return block.new_empty((b, hw * _world_of(group_name), p, n))


def _gather_heads_backward(ctx, grad):
    world = _world_of(ctx.group_name)
    rank = dist.get_rank(_resolve_group(ctx.group_name))
    return _all_reduce_op(grad, ctx.group_name).chunk(world, dim=1)[rank], None


_gather_heads_op.register_autograd(_gather_heads_backward, setup_context=_keep_group)


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


# The bytes every path moves: the cost model's terms (section 8 says how they become time).
# They live here, after the head split above, because the baseline's terms follow it.

def _permuted_pieces(world):
    """Pieces of L/(2W) tokens that the busiest rank moves in one zigzag <-> contiguous
    permutation: rank r holds pieces {r, 2W-1-r} zigzag (_pieces) and {2r, 2r+1} contiguous; the
    pieces in both sets stay. It sends as many as it receives. 1 for W = 2, 2 for W >= 3 (rank 1
    moves both), 0 in a world of one."""
    return max(2 - len(set(_pieces(r, world, "virtual")[0]) & {2 * r, 2 * r + 1}) for r in range(world))


def comm_bytes(path, world, L, batch, *, nheads, headdim, dstate, ngroups, d_conv, dtype_bytes,
               summary_exchange="all_gather", documents=False):
    """Bytes one rank receives from the other ranks, per layer call, forward and backward, as
    this module moves them (on every path here a rank sends as much as it receives; where
    ranks differ, the busiest rank). path: "a2a" (mamba_conv1d_ssd_a2a) or the load_balancing of
    mamba_conv1d_ssd_cp, whose summaries go by summary_exchange ("all_gather" or "scan"); world
    W, global length L. Returns dict(fwd=, bwd=, terms={name: bytes}, latencies={name: messages
    in sequence}), names "fwd: ..." and "bwd: ...", or None when the path cannot run (a2a with
    nheads not divisible by W; L not divisible by 2W). modelled_seconds turns the two into time.

    Notation: b batch, h nheads, p headdim, n dstate, g ngroups, d1 = d_conv - 1, conv_dim =
    h*p + 2*g*n, e = dtype_bytes (xBC, y and their gradients), dt and its gradient fp32 (4 bytes),
    l = L/W tokens per rank, s = L/(2W) tokens per zigzag piece, R = ceil(log2 W). An all-gather
    of a block of B bytes per rank makes each rank receive (W-1) * B, in W-1 ring steps.
    `documents` adds the seq_idx terms (int32 ids). In a world of one every term is 0.

    Every path, forward: the input check's all-gather ("validation") of the int64 values each rank
    contributes to the agreement on the inputs (_agreement_ints of them): (W-1) * _agreement_ints() * 8;
    with documents a second, of the first and last id of each of the caller's k pieces per row
    (int64): (W-1) * b * k * 2 * 8 (k = 2 for the zigzag layouts, 1 for "none" and "a2a").

    State passing, "none" (k = 1 segment per rank) and "virtual" (k = 2), rows = b*k, with the
    summaries all-gathered:
      fwd  conv halo all-gather: (W-1) * rows * d1 * conv_dim * 4 (the halo travels packed as
           fp32 whatever the input dtype) [+ (W-1) * rows * d1 * 4 ids]
      fwd  summary all-gather, fp32: (W-1) * rows * (h*p*n + h [+ 2 ids]) * 4
      bwd  G all-gather, fp32: (W-1) * (rows * h*p*n + b*h*p*n) * 4 (G of every segment plus the
           rank's final-state gradient, sent even when zero)
      bwd  halo-gradient all-gather, fp32: (W-1) * rows * d1 * conv_dim * 4
    summary_exchange="scan", the same quantities point to point:
      fwd  halos from the neighbours: rows * d1 * conv_dim * 4 [+ rows * d1 * 4 ids]; 1 message
      fwd  R prefix rounds of one map per segment: R * rows * (h*p*n + h [+ 2 ids]) * 4; R
      fwd  the totals' broadcasts, one per chain: rows * (h*p*n + h [+ 2 ids]) * 4; k * R
      bwd  the final-state gradient's all-reduce: 2 (W-1)/W * b*h*p*n * 4; 2R
      bwd  R rounds of the gradient maps: R * rows * (h*p*n + h) * 4; R
      bwd  "virtual": the second halves' total, broadcast: b * (h*p*n + h) * 4; R
      bwd  halo gradients to the neighbours: rows * d1 * conv_dim * 4; 1

    "permute_p2p" / "permute_a2a": the state passing of "none" plus the zigzag <-> contiguous
    moves of the activations, P = _permuted_pieces(W) pieces per direction (both variants move
    the same bytes; pieces a rank keeps do not count; p2p in 1 message time, a2a in W-1):
      fwd  xBC and dt to contiguous: P * b * s * (conv_dim*e + h*4) [+ P * b * s * 4 ids]
      fwd  y back to zigzag: P * b * s * h*p*e
      bwd  dy to contiguous: P * b * s * h*p*e
      bwd  dxBC and ddt back to zigzag: P * b * s * (conv_dim*e + h*4)

    "a2a" (head-parallel; needs h % W == 0; hw = h/W heads per rank; gr = groups of B and C a
    rank needs, as _a2a_heads splits them: g/W when W divides g, else 1 when its heads share one
    group, else one copy per head, hw): every rank sends each other rank that rank's channels of
    its l local tokens (its own block stays), W-1 messages each:
      fwd  xBC all-to-all: (W-1) * b * l * (hw*p + 2*gr*n) * e
      fwd  dt all-to-all: (W-1) * b * l * hw * 4
      fwd  y all-to-all back: (W-1) * b * l * hw*p * e
           [+ seq_idx all-gather (W-1) * b * l * 4]
      bwd  the same three all-to-alls for dy, dxBC, ddt: the same bytes (not the seq_idx term).
    The final-state gather (return_final_states) is not counted."""
    _expect(path == "a2a" or path in LAYOUTS, "path", repr(path), f"'a2a' or one of {LAYOUTS}")
    _expect(summary_exchange in ("all_gather", "scan"), "summary_exchange", repr(summary_exchange),
            "'all_gather' or 'scan' (what chosen_exchange resolves 'auto' to)")
    h, p, n, g, e, f4 = nheads, headdim, dstate, ngroups, dtype_bytes, 4
    if L % (2 * world) or (path == "a2a" and h % world):
        return None
    o, ids, cd = world - 1, int(documents), h * p + 2 * g * n
    terms = [("fwd", "validation all-gather", o * _agreement_ints() * 8, o)]
    if documents:
        pieces = 1 if path in ("none", "a2a") else 2
        terms.append(("fwd", "seq_idx ends all-gather", o * batch * pieces * 2 * 8, o))
    if path == "a2a":
        hw, gr, l = h // world, len(_a2a_heads(h, g, world, 0)[1]), L // world
        for side, d in (("fwd", ""), ("bwd", "d")):
            terms += [(side, f"{d}xBC all-to-all", o * batch * l * (hw * p + 2 * gr * n) * e, o),
                      (side, f"{d}dt all-to-all", o * batch * l * hw * f4, o),
                      (side, f"{d}y all-to-all", o * batch * l * hw * p * e, o)]
        if documents:
            terms.append(("fwd", "seq_idx all-gather", o * batch * l * 4, o))
        return _cost(terms)
    k = 2 if path == "virtual" else 1
    terms += _exchange_terms(summary_exchange, world, k, batch, h, p, n, d_conv, cd, documents)
    if path.startswith("permute"):
        P, s, m = _permuted_pieces(world), L // (2 * world), 1 if path == "permute_p2p" else o
        terms += [("fwd", "xBC, dt to contiguous", P * batch * s * (cd * e + h * f4 + 4 * ids), m),
                  ("fwd", "y to zigzag", P * batch * s * h * p * e, m),
                  ("bwd", "dy to contiguous", P * batch * s * h * p * e, m),
                  ("bwd", "dxBC, ddt to zigzag", P * batch * s * (cd * e + h * f4), m)]
    return _cost(terms)


def _a2a_channels(shape, heads, groups):
    """Indices into the conv_dim channels [x | B | C] for these heads and (replicated) groups;
    shape (nheads, headdim, ngroups, dstate)."""
    nheads, p, ngroups, n = shape
    hp, gn = nheads * p, ngroups * n
    x = [hh * p + i for hh in heads for i in range(p)]
    Bc = [hp + g * n + i for g in groups for i in range(n)]
    Cc = [hp + gn + g * n + i for g in groups for i in range(n)]
    return x + Bc + Cc


# The channel indices of each rank's block, per (shape, world, device): built once, on the first
# (eager) call, so that later calls copy nothing from the host and can be captured in a CUDA graph.
_A2A_CHANNELS = {}


def _a2a_channel_index(shape, head_split, device):
    key = (shape, len(head_split), str(device))
    if key not in _A2A_CHANNELS:
        _A2A_CHANNELS[key] = [torch.tensor(_a2a_channels(shape, *heads_groups), device=device)
                              for heads_groups in head_split]
    return _A2A_CHANNELS[key]


def _to_global_order(blocks, layout):
    """blocks (W, b, l_local, ...): every rank's local tokens -> (b, L, ...) in sequence order.
    layout: the caller's ("none", or a zigzag one)."""
    return unshard(list(blocks.unbind(0)), "none" if layout == "none" else "virtual", dim=1)


def _to_local_order(full, world, layout):
    """(b, L, ...) -> (W, b, l_local, ...): each rank's local tokens, in its layout."""
    layout = "none" if layout == "none" else "virtual"
    return torch.stack([shard(full, r, world, layout, dim=1) for r in range(world)])


def mamba_conv1d_ssd_a2a(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, *, headdim, ngroups,
                         cp_group=None, load_balancing="none", seq_idx=None, initial_states=None,
                         dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                         state_dtype=None):
    """The same arguments and results as mamba_conv1d_ssd_cp, computed the usual way: an
    all-to-all gives every rank the whole sequence for nheads/W heads, it runs the single-device
    conv + SSD, and a second all-to-all returns the outputs to their tokens. Exists to be
    compared against. Requires nheads divisible by W."""
    call = Call(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, initial_states, seq_idx)
    ref = xBC if isinstance(xBC, Tensor) else torch.empty(0)
    rank, world = _group_info(cp_group, ref)

    def check():
        _check_cp_inputs(call, chunk_size, headdim, ngroups, load_balancing, world, dt_limit, activation, state_dtype)
        _expect(dt.shape[2] % world == 0, "dt", f"nheads={dt.shape[2]} with W={world}",
                "nheads divisible by the CP world size (the all-to-all baseline splits heads)")

    if torch.compiler.is_compiling():   # the shapes alone; the ranks do not agree here
        check()
    else:
        key = _call_key("a2a", cp_group, *call, chunk_size, headdim, ngroups, load_balancing, dt_limit,
                        return_final_states, activation, state_dtype)
        _prepared(key, check, cp_group, world, ref, seq_idx, load_balancing,
                  lambda: _signature(**_call_signature(call, chunk_size, headdim, ngroups, load_balancing,
                                                       return_final_states)))
    if world == 1:
        return mamba_conv1d_ssd_cp(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, headdim=headdim,
                                   ngroups=ngroups, seq_idx=seq_idx, initial_states=initial_states,
                                   dt_limit=dt_limit, return_final_states=return_final_states,
                                   activation=activation, state_dtype=state_dtype)

    # forward all-to-all: block j of what this rank sends holds rank j's channels of its tokens
    nheads, group_name = dt.shape[2], _group_name(cp_group)
    shape = (nheads, headdim, ngroups, (xBC.shape[2] - nheads * headdim) // (2 * ngroups))
    head_split = [_a2a_heads(nheads, ngroups, world, r) for r in range(world)]
    chan = _a2a_channel_index(shape, head_split, xBC.device)
    send_x = torch.stack([xBC.index_select(2, chan[r]) for r in range(world)])     # (W, b, l, c_loc)
    send_dt = torch.stack([dt[..., head_split[r][0][0]:head_split[r][0][-1] + 1] for r in range(world)])
    xBC_mine = _to_global_order(_all_to_all_op(send_x, group_name), load_balancing)      # (b, L, c_loc)
    dt_mine = _to_global_order(_all_to_all_op(send_dt, group_name), load_balancing)      # (b, L, hW)
    seq_full = None if seq_idx is None else _to_global_order(_all_gather_op(seq_idx.to(torch.int32), group_name),
                                                             load_balancing)

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
    y = _all_to_all_op(_to_local_order(y_mine, world, load_balancing), group_name)  # (W, b, l, hW, p)
    y = torch.cat(list(y.unbind(0)), dim=2)                                        # (b, l, h, p)
    if not return_final_states:
        return y
    return y, _gather_heads_op(final_mine.contiguous(), group_name)


# ---------------------------------------------------------------------------------------------
# 16. A worked example
#    `python mamba_cp.py` runs two gloo ranks on this machine over a handful of tokens and
#    prints each step of state passing, checked against the float64 oracle.
# ---------------------------------------------------------------------------------------------


def worked_example(group, say=print):
    """Part I's steps by hand on this rank of a two-rank group (gloo, CPU tensors), then the same as
    one differentiable call; returns {step: largest difference from the float64 oracle}."""
    import reference_ssd  # the oracle lives beside this file in the repository

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(0)
    b, L, h, p, n, d_conv = 1, 12, 1, 2, 2, 2                       # one head: x (p=2), state 2x2
    conv_dim = h * p + 2 * n
    xBC = torch.randn(b, L, conv_dim, generator=g)
    dt = torch.randn(b, L, h, generator=g) - 1.0
    w, bias = torch.randn(conv_dim, d_conv, generator=g) * 0.5, torch.zeros(conv_dim)
    dt_bias, A, D = torch.zeros(h), -torch.ones(h), torch.ones(h)
    call = Call(shard(xBC, rank, world), shard(dt, rank, world), w, bias, dt_bias, A, D, None, None)  # 6 tokens each
    plan = Plan(call, b, 16, p, 1, group=group)
    y_ref, final_ref = reference_ssd.conv1d_ssd_reference(xBC, dt, w, bias, dt_bias, A, D, headdim=p, ngroups=1)

    # (1) the conv, fed by the halo: the last d_conv - 1 pre-conv tokens of the previous rank
    halo, _ = receive_halo(call.xBC, None, plan)
    conv_out = _conv1d_fwd(call.xBC, w, bias, halo)
    ssd = ssd_tensors(*split_xBC(conv_out, plan.fwd), call, plan.fwd)
    # (2) this rank's summary, from a zero entry state: S_out = a * S_in + S_ext
    summary = Summary(ssd, plan.fwd)
    S_ext, a = summary.affine()
    say(f"summary: a = {a.flatten().tolist()}, S_ext =\n{S_ext[0, 0]}")
    # (3) all-gather the summaries and scan: S_in(0) = 0, S_in(1) = a_0 S_in(0) + S_ext(0)
    entries, final, _, _ = plan.exchange.entry_states(S_ext, a, None, None, plan)
    say(f"entry state after the scan =\n{entries[0, 0]}")
    # (4) the outputs with the entry state folded in, against the oracle on the whole sequence
    y, _ = ssd_output(ssd, summary, entries)
    errors = {"y by hand": (y - shard(y_ref, rank, world)).abs().max().item(),
              "final state": (final - final_ref).abs().max().item()}
    say(f"y (this rank's 6 tokens) = {y.flatten(1).tolist()[0][:4]}...; max |y - oracle| = {errors['y by hand']:.1e}; "
        f"max |final - oracle| = {errors['final state']:.1e}")
    # all of it, and the backward, is one call of StatePassingFn, as every public entry runs it
    y_fused, _ = StatePassingFn.apply(METHOD, plan, *call)
    errors["y of StatePassingFn"] = (y_fused - shard(y_ref, rank, world)).abs().max().item()
    say(f"StatePassingFn gives the same y: {torch.equal(y_fused, y)}")
    return errors


def _worked_example_rank(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_printoptions(precision=4, sci_mode=False)
    worked_example(dist.group.WORLD, say=lambda *a: print(f"[rank {rank}]", *a, flush=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    os.environ["TRITON_INTERPRET"] = "1"  # the example runs on CPUs, kernels in the interpreter
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_worked_example_rank, args=(2, free_port), nprocs=2)
