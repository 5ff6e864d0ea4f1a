"""Oracle tests for mamba_cp: every result against the float64 loop of reference_ssd.py.

    pytest -q test_mamba_cp.py            # CPU: Triton interpreter, float32, bound 1e-5
                                          # GPU: the same cases, plus bf16 at the record shape
                                          #      and one 2^20-token call

    torchrun --nproc_per_node=N test_mamba_cp.py   # the distributed checks in place (last section)

Criterion (README "Tests and benchmark"): relative RMS error rms(got - want) / rms(want), per tensor,
for the output, the final state and every gradient.

Reading order (the section headers below): the helpers, the oracle's self-tests, then the
tests in the order of mamba_cp.py's sections, the torchrun mode last.
    Helpers: the criterion, and the verdict on a check's errors (failures)
    Helpers: the inputs (draw, the one input factory, and what arranges its draws)
    Helpers: one call against the oracle
    Helpers: the process harness (@check, world_check; main runs the same checks)
    The oracle checks itself
    mamba_cp sections 3-5, 7 and 13: the single-device SSD, forward and backward
    mamba_cp section 9: bad input
    mamba_cp sections 6, 8 and 10: layouts and communication
    mamba_cp section 2: the causal conv1d
    mamba_cp sections 1, 11 and 15: the fused conv1d + SSD under CP, and the all-to-all baseline
    mamba_cp sections 12 and 14: mamba_split_conv1d_scan_combined
    torch.compile
    Vendoring: a tiny mixer trained under CP; Hugging Face transformers
    GPU only
    The module reads in the order the method runs; Part I runs alone; the worked example
    torchrun --nproc_per_node=N test_mamba_cp.py
    Training under CP: checkpointing, accumulation, FSDP2 bf16, and examples/train_cp.py
"""

import dataclasses
import datetime
import functools
import importlib.util
import inspect
import itertools
import json
import math
import os
import statistics
import sys
import queue as queue_module
import socket
import subprocess
import time
import traceback
import types
from typing import Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import mamba_cp
import reference_ssd as ref
from reference_ssd import (causal_conv1d_reference, conv1d_ssd_reference, process_dt,
                           ssd_reference, ssd_reference_chunked)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # without CUDA the kernels run in the Triton interpreter
FP32_BOUND = 1e-5
BF16_BOUND = 1e-2
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (these shapes are too large for the interpreter)")
# torch.compile imports torch.utils.mkldnn, whose @torch.jit.script_method's torch itself deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
# growth past float32 in lanes the kernels then discard by selection (the interpreter computes them in numpy)
past_float32 = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _interpreter_patches_language_once():
    """A third of the CPU tests' time, saved (on 2 cores, 45 to 29 CPU minutes; one fused forward
    and backward at the CP test shape, 22.5 to 10.0 s). The Triton interpreter swaps
    triton.language's functions for interpreted ones at each launch and back after it, but it
    also swaps them again at every call of a @triton.jit helper inside the kernel
    (inspect.getmembers over the whole language, about 1.4 ms; the kernels call their helpers
    thousands of times a launch), replacing what is already replaced. Here each launch does it
    once per module of functions (the project's; the language's own helpers, such as tl.sum,
    swap their module on their first call as before): what the kernels compute is unchanged,
    bit for bit. Where this Triton's interpreter lacks the hook (another version), nothing is
    changed."""
    try:
        from triton.runtime import interpreter
        patch_lang, no_patch = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    patched = []                                  # the __globals__ swapped for in the launch under way

    def once_per_launch(fn):
        if any(g is fn.__globals__ for g in patched):
            return no_patch()
        scope = patch_lang(fn)
        patched.append(fn.__globals__)
        if len(patched) == 1:                     # the launch's own swap: its end ends the launch
            restore = scope.restore

            def end_launch():
                patched.clear()
                restore()
            scope.restore = end_launch
        return scope
    interpreter._patch_lang = once_per_launch


def _interpreter_remembers_types():
    """A third of an interpreted forward and backward's time, saved (the CP tests' case "virtual
    all options" in a world of one: 10.9 to 7.0 s on 2 cores), with what the kernels compute
    unchanged, bit for bit. The Triton interpreter runs every operation of a kernel through
    Triton's front end, which describes each value it makes anew: its block type (shape checked,
    name formatted), the tensor's shape as constexprs, and its NumPy dtype (a dict of every dtype
    built at each call). Those descriptions depend only on the element type and the shape, so
    here each is made once and reused: the block type's checked shape, element count and name;
    the tensor's shape and element count; the NumPy dtype of each scalar type (pointers: uint64,
    as the interpreter's own map gives). Where this Triton's front end builds those objects
    otherwise (another version: other attributes), nothing is changed."""
    try:
        from triton.runtime import interpreter
        tl, np_dtype_of = interpreter.tl, interpreter._get_np_dtype
        block_init, tensor_init = tl.block_type.__init__, tl.tensor.__init__
        probe = tl.block_type(tl.float32, [2, 4])
        if (set(vars(probe)) != {"element_ty", "shape", "numel", "name"}
                or set(vars(tl.tensor(None, probe))) != {"handle", "shape", "numel", "type", "dtype"}):
            return
    except (ImportError, AttributeError, TypeError):
        return
    blocks, tensors, np_dtypes = {}, {}, {}
    address = np_dtype_of(tl.pointer_type(tl.float32))

    def block_type(self, element_ty, shape):
        key = (str(element_ty), tuple(shape)) if all(type(d) is int for d in shape) else None
        known = blocks.get(key) if key else None
        if known is None:
            block_init(self, element_ty, shape)
            if key:
                blocks[key] = self.shape, self.numel, self.name
        else:
            self.element_ty = element_ty
            self.shape, self.numel, self.name = known

    def tensor(self, handle, type):
        shape = type.shape if type.is_block() else ()
        known = tensors.get(shape)
        if known is None:
            tensor_init(self, handle, type)
            tensors[shape] = self.numel, self.shape
        else:
            self.handle, self.type, self.dtype = handle, type, type.scalar
            self.numel, self.shape = known

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return address
        known = np_dtypes.get(scalar)
        if known is None:
            known = np_dtypes[scalar] = np_dtype_of(scalar)
        return known

    tl.block_type.__init__, tl.tensor.__init__, interpreter._get_np_dtype = block_type, tensor, np_dtype


def _interpreter_skips_unasserted_overflow_checks():
    """A quarter of an interpreted case's time, saved (CP cases in a world of one on 2 cores: 3.4 to
    2.5 s, 4.0 to 3.0, 3.9 to 2.9), with what the kernels compute unchanged. Triton's front end
    follows each int32 add, sub and mul with an overflow check: both operands cast to int64, the
    operation again, two comparisons and a device_assert. device_assert does nothing without the
    debug option, and the interpreter's options never set it, so the interpreter computed the
    check and dropped it. Here its options ask for no check: the same asserts (none) for less
    work. Where this Triton's interpreter has no such options (another version), nothing is
    changed."""
    try:
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        if builder.options.debug:                  # with the debug option the checks assert: keep them
            return
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        return


if mamba_cp.INTERPRET:
    _interpreter_patches_language_once()
    _interpreter_remembers_types()
    _interpreter_skips_unasserted_overflow_checks()


# ---------------------------------------------------------------------------------------------
# Helpers: the criterion, and the verdict on a check's errors (the pytest tests and the
# torchrun mode both judge by failures)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tuned():
    """Run a test under another mamba_cp.Tuning (a name in TUNINGS, or a Tuning), restored after."""
    previous = []
    yield lambda t: previous.append(mamba_cp.set_tuning(t))
    if previous:
        mamba_cp.set_tuning(previous[0])


def rel_rms(got, want):
    """rms(got - want) / rms(want), accumulated in float64 over slices (a 2^32-element tensor
    must not be copied whole to float64); inf if got holds a NaN or inf."""
    got, want = got.detach().reshape(-1), want.detach().reshape(-1)
    err = scale = 0.0
    for start in range(0, got.numel(), 1 << 26):         # want may wait on the host: a slice at a time comes over
        g = got[start:start + (1 << 26)].double()
        w = want[start:start + (1 << 26)].to(g.device).double()
        if not torch.isfinite(g).all():
            return float("inf")
        err += (g - w).pow(2).sum().item()
        scale += w.pow(2).sum().item()
    return (err / scale) ** 0.5 if scale > 0 else err ** 0.5


class Skipped(NamedTuple):
    """A check's entry for a case it does not run here (this world size, this machine), with the
    reason: neither a pass nor a failure, and counted apart."""
    reason: str


def measured(results):
    """The cases of a check's results that ran: {case: {quantity: error}}, without the Skipped."""
    return {case: errs for case, errs in results.items() if not isinstance(errs, Skipped)}


def failures(results, bound):
    """The verdict on a check's results {case: {quantity: error} or Skipped}: the errors above
    bound (NaN included), {case: {quantity: error}}; empty where every case that ran passed. A
    case that measured nothing fails."""
    bad = {}
    for case, errs in measured(results).items():
        if not errs:
            bad[case] = {"nothing measured": float("inf")}
        for quantity, err in errs.items():
            if not err <= bound:
                bad.setdefault(case, {})[quantity] = err
    return bad


def largest(results):
    """{quantity: its largest error over the cases that ran} of a check's results."""
    worst = {}
    for errs in measured(results).values():
        for quantity, err in errs.items():
            worst[quantity] = max(worst.get(quantity, 0.0), err)
    return worst


def expect(results, bound, label="relative RMS"):
    """Assert that a check's results {case: {quantity: error}} pass bound."""
    bad = failures(results, bound)
    assert not bad, f"{label}: above {bound:g}: {bad} (all: {results})"
    return results


def assert_close(pairs, bound):
    """Assert rel_rms(got, want) <= bound for each {name: (got, want)}; returns the errors."""
    errs = {k: rel_rms(a, b) for k, (a, b) in pairs.items()}
    expect({"relative RMS": errs}, bound)
    return errs


# ---------------------------------------------------------------------------------------------
# Helpers: the inputs. One factory, draw, makes every random tensor of these tests from one
# seeded generator; the functions after it only arrange what it drew into an entry point's
# arguments (xBC = [x | B | C], zxbcdt = [z0 | x0 | z | xBC | dt]).
# ---------------------------------------------------------------------------------------------

class Shape(NamedTuple):
    """The sizes of one set of inputs. seqlen is the whole sequence; the CP cases give what one
    rank holds (two pieces of seqlen / 2 tokens) and multiply it by W (per_world)."""
    batch: int
    seqlen: int
    nheads: int = 4
    headdim: int = 8
    ngroups: int = 2
    dstate: int = 8
    chunk: int = 16
    d_conv: int = 4
    d_nonssm: int = 0     # the SwiGLU channels z0, x0 in front of zxbcdt

    @property
    def conv_dim(self):
        return self.nheads * self.headdim + 2 * self.ngroups * self.dstate

    def per_world(self, world):
        return self._replace(seqlen=world * self.seqlen)


def draw(shape, seed=0, *, dtype=torch.float32, device=DEVICE, D=None, z=False, dt_bias=False, dt_softplus=False,
         initial_states=False, seq_idx=None, extreme=False, growth=None, negative_dt=False, conv_weight=False,
         conv_bias=False, halo=False, rmsnorm_weight=False, outproj=None, summaries=False, features=None, vocab=None,
         weights=None):
    """Every random input of these tests, drawn in this order from one generator seeded with
    `seed`: {name: tensor} on `device`. Options named as in mamba_chunk_scan_combined.

    With a shape, always x (b, l, h, p), B and C (b, l, g, n), dt (b, l, h) and A (h,) in
    (-1.65, -0.37), and z0, x0 (b, l, d_nonssm) where shape.d_nonssm > 0. Then, if asked:
      D: None, "h" or "hp" (shapes (h,), (h, p)); z (b, l, h, p); dt_bias (h,); initial_states
        (b, h, p, n).
      dt_softplus: dt raw, for a softplus inside (about N(-1, 0.7)); otherwise already positive,
        in (0.02, 0.32).
      extreme: True (5% of entries at random) or a list of token positions (every row and head):
        dt'*A = -1000 there, among decays ten times smaller.
      growth: None (decay: dt'*A < 0), "pos_A" (A > 0), "pos_A_e8" (A > 0 scaled to the length:
        the state grows by about e^8 over the whole sequence, however long), or a number: A > 0
        and dt'*A equal to it at every token. (dt' itself is never negative: the clamp.)
      negative_dt: raw dt in (-0.2, 0.3), 40% of it below zero and a tenth exactly 0, for
        dt_softplus=False: the default dt_limit (0, inf) clamps the negative ones to 0 (and their
        gradient), as mamba_ssm's kernels do, and lets a gradient through at 0 itself.
      seq_idx: document starts (int32 ids (b, l)), one list for every row (row 1 then starts one
        more document at l // 2, so that rows differ) or a list per row. With a halo, positions
        count in the shard, negative ones inside the halo (a start at its first token changes
        nothing), and halo_seq (b, d_conv - 1) comes with seq_idx.
      conv_weight (conv_dim, d_conv), conv_bias (conv_dim,), halo (b, d_conv - 1, conv_dim).
      rmsnorm_weight (h p,) about 1; outproj: None, "weight" (outproj_weight (5, d_nonssm + h p))
        or "bias" (and outproj_bias (5,)).
      summaries: one shard summary per position of seqlen: a (b, l, h) in (0, 1.3) (some grow),
        S_ext (b, l, h, p, n), first_id and last_id (b, l): document ids that rise by 0 or 1
        inside every segment and at its end.
      features: u and target (b, l, features), a model's input and regression target.
      vocab: input_ids (b, l), token ids below vocab.
    weights: {name: size}, standard normal output weights (the dy a gradient check pulls back);
    drawn with or without a shape.
    dtype: that of the activations (x, B, C, z, z0, x0, halo) and of the weights; every other
    floating tensor is float32, or float64 where dtype is."""
    g = torch.Generator().manual_seed(seed)
    param = torch.float64 if dtype == torch.float64 else torch.float32
    out = {}

    def normal(*size, scale=1.0, shift=0.0, to=param):
        t = torch.randn(size, generator=g)                 # size may be () (a 0-d output's weight)
        if scale != 1.0:
            t.mul_(scale)
        if shift:
            t.add_(shift)
        return t.to(to)

    def uniform(*size, low=0.0, high=1.0):
        return (torch.rand(size, generator=g) * (high - low) + low).to(param)

    if shape is not None:
        b, l, h, p, ng, n = shape.batch, shape.seqlen, shape.nheads, shape.headdim, shape.ngroups, shape.dstate
        d_conv, conv_dim, d_nonssm = shape.d_conv, shape.conv_dim, shape.d_nonssm
        A = -torch.exp(uniform(h, low=-1.0, high=0.5))
        dt = normal(b, l, h, scale=0.7, shift=-1.0) if dt_softplus else uniform(b, l, h, low=0.02, high=0.32)
        if extreme is True:
            big = uniform(b, l, h) < 0.05
        elif extreme:
            big = torch.zeros(1, l, 1, dtype=torch.bool)
            big[:, list(extreme)] = True
        if extreme is not False:
            dt = torch.where(big, 1000.0 / -A, dt * 0.1)
        if negative_dt:  # what a caller's raw dt can hold with dt_softplus=False
            dt = uniform(b, l, h, low=-0.2, high=0.3)
            dt = torch.where(uniform(b, l, h) < 0.1, 0.0, dt)
        if growth == "pos_A":
            A = -0.5 * A
        elif growth == "pos_A_e8":
            A = uniform(h, low=0.75, high=1.25) * (20.0 / l)
        elif growth is not None:
            A = -A
            dt = (growth / A).expand(b, l, h).contiguous()
        out.update(x=normal(b, l, h, p, to=dtype), dt=dt, A=A, B=normal(b, l, ng, n, to=dtype),
                   C=normal(b, l, ng, n, to=dtype))
        if d_nonssm:
            out.update(z0=normal(b, l, d_nonssm, to=dtype), x0=normal(b, l, d_nonssm, to=dtype))
        if D == "h":
            out["D"] = normal(h)
        elif D == "hp":
            out["D"] = normal(h, p)
        if z:
            out["z"] = normal(b, l, h, p, to=dtype)
        if dt_bias:
            out["dt_bias"] = normal(h, scale=0.5)
        if initial_states:
            out["initial_states"] = normal(b, h, p, n)
        if seq_idx is not None:
            per_row = len(seq_idx) > 0 and isinstance(seq_idx[0], (list, tuple))
            rows = seq_idx if per_row else [list(seq_idx) + ([l // 2] if r == 1 else []) for r in range(b)]
            lead = d_conv - 1 if halo else 0
            ids = torch.zeros(b, lead + l, dtype=torch.int32)
            for r, starts in enumerate(rows):
                for s in starts:
                    if -lead < s < l:
                        ids[r, lead + s:] += 1
            out["seq_idx"] = ids[:, lead:].contiguous()
            if halo:
                out["halo_seq"] = ids[:, :lead].contiguous()
        if conv_weight:
            out["conv_weight"] = normal(conv_dim, d_conv, scale=0.5)
        if conv_bias:
            out["conv_bias"] = normal(conv_dim, scale=0.5)
        if halo:
            out["halo"] = normal(b, d_conv - 1, conv_dim, to=dtype)
        if rmsnorm_weight:
            out["rmsnorm_weight"] = normal(h * p, scale=0.5, shift=1.0)
        if outproj:
            out["outproj_weight"] = normal(5, d_nonssm + h * p, scale=0.2)
        if outproj == "bias":
            out["outproj_bias"] = normal(5)
        if summaries:
            ids = torch.cumsum(torch.randint(0, 2, (b, 2 * l), generator=g), dim=1).to(torch.int32)
            out.update(a=uniform(b, l, h, high=1.3), S_ext=normal(b, l, h, p, n), first_id=ids[:, 0::2],
                       last_id=ids[:, 1::2])
        if features:
            out.update(u=normal(b, l, features), target=normal(b, l, features))
        if vocab:
            out["input_ids"] = torch.randint(0, vocab, (b, l), generator=g)
    for name, size in (weights or {}).items():
        out[name] = normal(*size, to=dtype)
    return {k: v.to(device) for k, v in out.items()}


SMALL = Shape(batch=2, seqlen=77, nheads=4, headdim=24, ngroups=2, dstate=20, chunk=16)
CP_SMALL = Shape(batch=2, seqlen=74, nheads=4, headdim=8, ngroups=2, dstate=8, chunk=16, d_conv=4)   # per rank
SPLIT_SMALL = CP_SMALL._replace(seqlen=38, d_nonssm=3)                                              # per rank
CONV_SMALL = Shape(batch=2, seqlen=77, nheads=4, headdim=6, ngroups=2, dstate=4)                    # 40 channels
# GPU only, bf16: the shape of record, per rank
CP_RECORD = Shape(batch=1, seqlen=2000, nheads=64, headdim=64, ngroups=8, dstate=128, chunk=128, d_conv=4)
SPLIT_RECORD = CP_RECORD._replace(d_nonssm=3)


def ssd_inputs(shape, seed, *, dt_limit=(0.0, float("inf")), **options):
    """The arguments of mamba_chunk_scan_combined: draw's tensors, chunk_size, dt_softplus, dt_limit."""
    return dict(draw(shape, seed, **options), chunk_size=shape.chunk, dt_softplus=options.get("dt_softplus", False),
                dt_limit=dt_limit)


def xbc(drawn):
    """The conv's input (b, l, conv_dim): x, B and C side by side, as the fused core splits it."""
    return torch.cat([drawn[k].flatten(2) for k in ("x", "B", "C")], dim=-1)


def conv_inputs(shape, seed=0, *, halo, bias, starts, strided=False):
    """conv1d_fwd's arguments (d_conv taps) and a dout. starts: document starts per row, in shard
    positions (negative: inside the halo). strided: xBC a view into a wider buffer."""
    b, l, dim = shape.batch, shape.seqlen, shape.conv_dim
    drawn = draw(shape, seed, conv_weight=True, conv_bias=bias, halo=halo, seq_idx=starts,
                 weights=dict(dout=(b, l, dim)))
    xBC = xbc(drawn)
    if strided:
        wide = torch.zeros(b, l, dim + 13, device=xBC.device)
        wide[..., 5:5 + dim] = xBC
        xBC = wide[..., 5:5 + dim]
    inp = dict(xBC=xBC, weight=drawn["conv_weight"], bias=drawn.get("conv_bias"), halo=drawn.get("halo"),
               seq_idx=drawn.get("seq_idx"), halo_seq=drawn.get("halo_seq"))
    return inp, drawn["dout"]


def fused_inputs(shape, seed=0, *, D="hp", initial_states=True, seq_idx=None, growth=None,
                 dt_limit=(0.0, float("inf")), activation="silu", dtype=torch.float32, device="cpu"):
    """The full-sequence arguments of mamba_conv1d_ssd_cp (the same on every rank: one seed) and
    its options. seq_idx: None or document starts in the global sequence."""
    drawn = draw(shape, seed, dtype=dtype, device=device, D=D, dt_bias=True, dt_softplus=True,
                 initial_states=initial_states, seq_idx=seq_idx, growth=growth, conv_weight=True, conv_bias=True)
    full = dict(xBC=xbc(drawn), dt=drawn["dt"], conv_weight=drawn["conv_weight"], conv_bias=drawn["conv_bias"],
                dt_bias=drawn["dt_bias"], A=drawn["A"], D=drawn.get("D"), initial_states=drawn.get("initial_states"),
                seq_idx=drawn.get("seq_idx"))
    opts = dict(chunk_size=shape.chunk, headdim=shape.headdim, ngroups=shape.ngroups, dt_limit=dt_limit,
                activation=activation)
    return full, opts


def split_inputs(shape, seed=0, *, activation="silu", norm=False, norm_before_gate=True, D="hp", outproj=None,
                 initial_states=True, seq_idx=None, dt_limit=(0.0, float("inf")), dtype=torch.float32, device="cpu"):
    """The full-sequence arguments of mamba_split_conv1d_scan_combined and its options: zxbcdt
    packs [z0 | x0 | z | xBC | dt]. outproj: None, "weight" or "bias"; seq_idx: None or global
    document starts."""
    drawn = draw(shape, seed, dtype=dtype, device=device, D=D, z=True, dt_bias=True, dt_softplus=True,
                 initial_states=initial_states, seq_idx=seq_idx, conv_weight=True, conv_bias=True,
                 rmsnorm_weight=norm, outproj=outproj)
    swiglu = [drawn["z0"], drawn["x0"]] if shape.d_nonssm else []
    full = dict(zxbcdt=torch.cat(swiglu + [drawn["z"].flatten(2), xbc(drawn), drawn["dt"].to(dtype)], dim=-1),
                conv1d_weight=drawn["conv_weight"], conv1d_bias=drawn["conv_bias"], dt_bias=drawn["dt_bias"],
                A=drawn["A"], D=drawn["D"], initial_states=drawn.get("initial_states"),
                rmsnorm_weight=drawn.get("rmsnorm_weight"), outproj_weight=drawn.get("outproj_weight"),
                outproj_bias=drawn.get("outproj_bias"), seq_idx=drawn.get("seq_idx"))
    opts = dict(chunk_size=shape.chunk, headdim=None if D == "hp" else shape.headdim, ngroups=shape.ngroups,
                dt_limit=dt_limit, activation=activation, norm_before_gate=norm_before_gate)
    return full, opts


# ---------------------------------------------------------------------------------------------
# Helpers: one call against the oracle (the SSD alone; the fused core and the mixer entry
# rank by rank, each rank's shard of the full-sequence oracle)
# ---------------------------------------------------------------------------------------------

DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def run_both(inputs, oracle_inputs=None, chunked=False):
    """Output, final state and every gradient from the kernels (inputs["fn"], by default
    mamba_cp's mamba_chunk_scan_combined) and from the oracle, under the same random output
    weights. Returns {name: (got, want)}."""
    fn = inputs.get("fn", mamba_cp.mamba_chunk_scan_combined)
    inputs = {k: (v.detach().clone().requires_grad_(True) if k in DIFFERENTIABLE else v)
              for k, v in inputs.items() if k != "fn"}
    oracle_inputs = inputs if oracle_inputs is None else {
        k: (v.detach().clone().requires_grad_(True) if k in DIFFERENTIABLE else v) for k, v in oracle_inputs.items()}
    leaves = [k for k in DIFFERENTIABLE if k in inputs]

    y, final = fn(**inputs, return_final_states=True)
    w = draw(None, 1234, device=y.device, weights=dict(y=y.shape, final_states=final.shape))
    wy, wf = w["y"], w["final_states"]
    grads = torch.autograd.grad((y.float() * wy).sum() + (final * wf).sum(), [inputs[k] for k in leaves])

    oracle_kw = {k: v for k, v in oracle_inputs.items() if k not in ("chunk_size", "state_dtype")}
    if chunked:
        yr, fr = ref.ssd_reference_chunked(**oracle_kw, chunk_size=inputs["chunk_size"])
    else:
        yr, fr = ref.ssd_reference(**oracle_kw)
    grads_r = torch.autograd.grad((yr * wy.double()).sum() + (fr * wf.double()).sum(),
                                  [oracle_inputs[k] for k in leaves])
    out = {"y": (y, yr), "final_states": (final, fr)}
    out.update({"d" + k: (a, b) for k, a, b in zip(leaves, grads, grads_r)})
    return out


CP_ACTIVATIONS = ("xBC", "dt")
SPLIT_LEAVES = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "initial_states", "rmsnorm_weight",
                "outproj_weight", "outproj_bias")


CASE_KEYS = ("name", "shape", "seed", "layout", "path", "exchange")


def case_inputs(case, world, arrange, device):
    """A CP case's full-sequence inputs and options: arrange (fused_inputs or split_inputs) of
    its shape with W times one rank's tokens, its seed, and its other entries as options."""
    options = {k: v for k, v in case.items() if k not in CASE_KEYS}
    return arrange(case["shape"].per_world(world), case.get("seed", 0), device=device, **options)


def cp_case_errors(case, rank, world, group, device):
    """Relative RMS errors of one CP case on this rank, against the oracle on the full sequence.
    case: shape (one rank's), layout, and optionally seed, path ("cp", "a2a", or a function with
    mamba_conv1d_ssd_cp's signature), exchange and fused_inputs' options."""
    full, opts = case_inputs(case, world, fused_inputs, device)
    layout, path = case["layout"], case.get("path", "cp")
    fn = path if callable(path) else mamba_cp.mamba_conv1d_ssd_cp if path == "cp" else mamba_cp.mamba_conv1d_ssd_a2a
    exchange = dict(summary_exchange=case["exchange"]) if "exchange" in case else {}
    b, L = full["xBC"].shape[:2]
    h, p, n = case["shape"].nheads, case["shape"].headdim, case["shape"].dstate
    w = draw(None, 99, device=device, weights=dict(y=(b, L, h, p), final_states=(world, b, h, p, n)))
    wy_full, wf_all = w["y"], w["final_states"]                                   # one final weight per rank

    # the oracle, float64, on the full sequence
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in full.items()
              if v is not None and v.is_floating_point()}
    ref_kw = {k: leaves.get(k, full[k]) for k in full}
    y_ref, f_ref = ref.conv1d_ssd_reference(
        ref_kw["xBC"], ref_kw["dt"], ref_kw["conv_weight"], ref_kw["conv_bias"], ref_kw["dt_bias"],
        ref_kw["A"], ref_kw["D"], headdim=opts["headdim"], ngroups=opts["ngroups"], seq_idx=full["seq_idx"],
        initial_states=ref_kw["initial_states"], dt_limit=opts["dt_limit"],
        chunked=device != "cpu", chunk_size=64,                  # the loop is too slow at GPU shapes
        activation=opts["activation"])
    loss = (y_ref * wy_full.double()).sum() + (f_ref * wf_all.sum(0).double()).sum()
    g_ref = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    # this rank
    local = {k: (mamba_cp.shard(v, rank, world, layout) if k in CP_ACTIVATIONS + ("seq_idx",) and v is not None
                 else v) for k, v in full.items()}
    mine = {k: v.detach().clone().requires_grad_(True) for k, v in local.items()
            if v is not None and v.is_floating_point()}
    kw = {k: mine.get(k, local[k]) for k in local}
    y, f = fn(kw["xBC"], kw["dt"], kw["conv_weight"], kw["conv_bias"], kw["dt_bias"], kw["A"], kw["D"],
              opts["chunk_size"], headdim=opts["headdim"], ngroups=opts["ngroups"], cp_group=group,
              load_balancing=layout, seq_idx=kw["seq_idx"], initial_states=kw["initial_states"],
              dt_limit=opts["dt_limit"], return_final_states=True, activation=opts["activation"], **exchange)
    wy = mamba_cp.shard(wy_full, rank, world, layout)
    grads = dict(zip(mine, torch.autograd.grad((y.float() * wy).sum() + (f * wf_all[rank]).sum(),
                                               list(mine.values()))))
    return shard_errors({"y": (y, y_ref)}, (f, f_ref), grads, g_ref, CP_ACTIVATIONS, rank, world, group, layout)


def shard_errors(outputs, final, grads, g_ref, per_token, rank, world, group, layout):
    """Relative RMS errors of this rank: its shard of each output and of each per-token input's
    gradient, the final state, and the parameter gradients summed over the group (each rank
    holds its contribution)."""
    errs = {k: rel_rms(got, mamba_cp.shard(want.detach(), rank, world, layout)) for k, (got, want) in outputs.items()}
    errs["final_states"] = rel_rms(final[0], final[1].detach())
    for k, gk in grads.items():
        if k in per_token:
            errs["d" + k] = rel_rms(gk, mamba_cp.shard(g_ref[k], rank, world, layout))
        else:
            total = gk.detach().clone().float()
            if world > 1:
                dist.all_reduce(total, group=group)
            errs["d" + k] = rel_rms(total, g_ref[k])
    return errs


def split_case_errors(case, rank, world, group, device):
    """Relative RMS errors of one mamba_split_conv1d_scan_combined case on this rank (case "path":
    a function with its signature in its place)."""
    full, opts = case_inputs(case, world, split_inputs, device)
    entry = case.get("path", mamba_cp.mamba_split_conv1d_scan_combined)
    layout = case["layout"]
    per_token = ("zxbcdt", "seq_idx")
    leaves = {k: full[k].detach().clone().requires_grad_(True) for k in SPLIT_LEAVES if full[k] is not None}
    ref_kw = {k: leaves.get(k, full[k]) for k in full}
    p = opts["headdim"] or full["D"].shape[1]
    out_ref, f_ref = ref.split_conv1d_scan_reference(
        **{k: v for k, v in ref_kw.items() if k not in ("seq_idx",)}, seq_idx=full["seq_idx"], headdim=p,
        ngroups=opts["ngroups"], dt_limit=opts["dt_limit"], activation=opts["activation"],
        norm_before_gate=opts["norm_before_gate"], chunked=device != "cpu", chunk_size=64)
    w = draw(None, 98, device=device, weights=dict(out=out_ref.shape, final_states=(world, *f_ref.shape)))
    w_full, wf_all = w["out"], w["final_states"]
    g_ref = dict(zip(leaves, torch.autograd.grad((out_ref * w_full.double()).sum()
                                                 + (f_ref * wf_all.sum(0).double()).sum(), list(leaves.values()))))

    local = {k: mamba_cp.shard(v, rank, world, layout) if k in per_token and v is not None else v
             for k, v in full.items()}
    mine = {k: local[k].detach().clone().requires_grad_(True) for k in leaves}
    out, f = entry(
        **{**local, **mine}, **opts, return_final_states=True, cp_group=group, load_balancing=layout,
        summary_exchange=case.get("exchange", "auto"))
    w = mamba_cp.shard(w_full, rank, world, layout)
    grads = dict(zip(mine, torch.autograd.grad((out.float() * w).sum() + (f * wf_all[rank]).sum(),
                                               list(mine.values()))))
    return shard_errors({"out": (out, out_ref)}, (f, f_ref), grads, g_ref, per_token, rank, world, group, layout)


# ---------------------------------------------------------------------------------------------
# Helpers: the process harness. A distributed check, registered with @check and its bound, runs
# on every rank as run(rank, world, group, device, gpu), evaluates all its errors, then one
# all_reduce(MAX) (errors_everywhere) gives every rank the same verdict. The same checks run
# under pytest (world_check: gloo processes spawned here, each world with a timeout) and under
# torchrun (main, the last section), both judged by failures.
# ---------------------------------------------------------------------------------------------

class Check(NamedTuple):
    """A distributed check: run(rank, world, group, device, gpu=False) returns {case: {quantity:
    error}, or Skipped for a case it cannot run there}, every error already reduced (MAX) over
    the group; it passes where no error exceeds bound (gpu_bound under torchrun on GPUs, where
    some checks run bf16 at the record shape). alone: torchrun runs it again in a world of one on
    each rank; skipped(): why it cannot run on this machine at all, or ''."""
    label: str
    run: Callable
    bound: float
    gpu_bound: float
    alone: bool
    skipped: Callable


CHECKS = []   # in the order of this file, which is the order torchrun runs them


def check(label, bound, gpu_bound=None, alone=False, skipped=lambda: ""):
    """Register a distributed check (the decorated function) with its bound."""
    def register(run):
        run.check = Check(label, run, bound, bound if gpu_bound is None else gpu_bound, alone, skipped)
        CHECKS.append(run.check)
        return run
    return register


def guarded(run, *args, **kwargs):
    """run(*args, **kwargs), or where it raises, an error entry that fails every bound: a failure
    on one rank must still reach the reduction."""
    try:
        return run(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return {"exception: " + repr(e)[:300]: float("inf")}


def errors_everywhere(results, world, group, device):
    """{case: {tensor: error}} with every error replaced by its MAX over the group, so every
    rank reaches the same verdict (a rank whose entries differ, an exception's, keeps its own).
    Skipped cases stay as they are: every rank skips them for the same reason."""
    names = sorted((c, t) for c, errs in measured(results).items() for t in errs)
    vec = torch.tensor([results[c][t] for c, t in names], dtype=torch.float64, device=device)
    if world > 1:
        # exceptions differ across ranks: reduce only if every rank holds as many entries (the
        # largest count and the smallest agree), a decision every rank takes alike
        count = torch.tensor([len(names), -len(names)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        if count[0].item() == -count[1].item():
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    for (c, t), v in zip(names, vec.tolist()):
        results[c][t] = v
    return results


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_entry(rank, world, port, fn_name, args, queue):
    torch.set_num_threads(1)                      # W ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        result = globals()[fn_name](rank, world, dist.group.WORLD, "cpu", *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report anything, including a hang's timeout error
        queue.put((rank, "error", traceback.format_exc()[-3000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_INTERPRETER_PROBE = """
import torch, mamba_cp
assert mamba_cp.INTERPRET
x = torch.linspace(-1, 1, 640).reshape(1, 40, 2, 8)
y = mamba_cp.mamba_chunk_scan_combined(x, torch.full((1, 40, 2), 0.05), -torch.ones(2),
                                       (x[:, :, :1] * 0.5).contiguous(), x[:, :, 1:].contiguous(), 16)
assert torch.isfinite(y).all()
"""


@functools.lru_cache(maxsize=None)
def _interpreter_fails_here():
    """Why the Triton interpreter cannot run our kernels in this environment, or '' if it can.
    The gloo ranks hold CPU tensors, so they need it even on a machine with CUDA; some releases'
    interpreters (triton 3.6) reject a loop bound that is a kernel argument."""
    if not CUDA:
        return ""  # this process already runs the kernels in the interpreter
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    return "" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["no output"])[-1]


def on_cpu(test):
    """A test whose tensors stay on the CPU in this process (a transformers model against its own
    torch path). Where CUDA is present mamba_cp compiled its kernels for the GPU, which cannot read
    CPU tensors: the test runs again in a process without CUDA, whose kernels take the interpreter,
    its verdict this one's; skipped where the interpreter fails (CI runs it)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if not CUDA:
            return test(*args, **kwargs)
        why = _interpreter_fails_here()
        if why:
            pytest.skip(f"its CPU tensors need the Triton {mamba_cp.triton.__version__} interpreter, which fails "
                        f"here: {why}")
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], env=env,
                              capture_output=True, text=True, timeout=900, cwd=here)
        assert done.returncode == 0, f"{node} without CUDA:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    return run


def spawn_world(world, fn_name, *args, timeout=600):
    """Run globals()[fn_name](rank, world, group, 'cpu', *args) on W gloo processes; returns
    the results by rank. A world that does not finish within `timeout` seconds fails. Where
    the interpreter cannot run (a GPU machine with triton 3.6) the test is skipped: CI runs it,
    and `torchrun test_mamba_cp.py` checks the same cases on the GPUs."""
    why = _interpreter_fails_here()
    if why:
        pytest.skip(f"gloo ranks need the Triton {mamba_cp.triton.__version__} interpreter, which fails here: {why}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_world_entry, args=(r, world, port, fn_name, args, queue), daemon=True)
             for r in range(world)]
    # gloo ranks hold CPU tensors, so their kernels run in the interpreter even where CUDA is
    # present; a spawned process reads the variable when it imports triton
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for proc in procs:
            proc.start()
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"world of {world} timed out after {timeout} s; ranks done: {sorted(results)}")
            try:
                rank, status, value = queue.get(timeout=min(left, 5.0))
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(results) < world and all(p.exitcode is not None for p in procs):
                    raise AssertionError(f"ranks exited without a result: {[p.exitcode for p in procs]}")
                continue
            results[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world)]


def world_results(world, fn_name, *args, timeout=600):
    """spawn_world, failing unless every rank returned: the results, by rank."""
    per_rank = spawn_world(world, fn_name, *args, timeout=timeout)
    errors = [v for status, v in per_rank if status != "ok"]
    assert not errors, errors[0]
    return [v for _, v in per_rank]


def world_verdict(world, fn_name, *args, timeout=600):
    """world_results of a check whose errors the ranks reduced together: the one verdict, which
    every rank must have reached."""
    results = world_results(world, fn_name, *args, timeout=timeout)
    same = lambda errs: errs if errs is None or isinstance(errs, Skipped) else sorted(   # noqa: E731 (NaN too)
        (q, repr(e)) for q, e in errs.items())
    differ = sorted({c for r in results for c in r if same(r.get(c)) != same(results[0].get(c))})
    assert not differ, f"ranks reached different verdicts: {[{c: r.get(c) for c in differ} for r in results]}"
    return results[0]


def world_check(world, run, timeout=600):
    """A registered check on W gloo ranks: its one verdict, asserted to pass the check's bound
    (the cases it skipped are printed, not passed)."""
    verdict = world_verdict(world, run.__name__, timeout=timeout)
    assert measured(verdict), f"W={world} {run.check.label}: no case ran: {verdict}"
    expect(verdict, run.check.bound, f"W={world} {run.check.label}")
    for case, errs in verdict.items():
        if isinstance(errs, Skipped):
            print(f"W={world} {run.check.label}: skipped {case}: {errs.reason}")
    return verdict


# ---------------------------------------------------------------------------------------------
# The oracle checks itself: a hand-computed case, and its chunked float64 form and causal conv
# against the token loop and torch (so the chunked form may stand in for the loop on the GPU)
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------- hand-computed case

def test_oracle_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)
    dt = torch.tensor([0.5, 1.0, 0.25]).view(1, 3, 1)
    A = torch.tensor([-1.0])
    B = torch.tensor([1.0, 1.0, 2.0]).view(1, 3, 1, 1)
    C = torch.tensor([2.0, 1.0, 1.0]).view(1, 3, 1, 1)
    D = torch.tensor([0.5])
    z = torch.tensor([0.0, 1.0, -2.0]).view(1, 3, 1, 1)

    s0 = 0.5 * 1 * 1
    s1 = math.exp(-1.0) * s0 + 1.0 * 2 * 1
    s2 = math.exp(-0.25) * s1 + 0.25 * 3 * 2
    want = [s0 * 2 + 0.5 * 1, s1 * 1 + 0.5 * 2, s2 * 1 + 0.5 * 3]
    y, S = ssd_reference(x, dt, A, B, C, D=D)
    assert y.dtype == torch.float64 and S.shape == (1, 1, 1, 1)
    torch.testing.assert_close(y.flatten(), torch.tensor(want, dtype=torch.float64))
    assert S.item() == pytest.approx(s2, rel=1e-14)

    # gate: y *= silu(z)
    silu = lambda v: v / (1 + math.exp(-v))
    y, _ = ssd_reference(x, dt, A, B, C, D=D, z=z)
    gated = [w * silu(v) for w, v in zip(want, [0.0, 1.0, -2.0])]
    torch.testing.assert_close(y.flatten(), torch.tensor(gated, dtype=torch.float64))

    # initial state 1 reaches the first document only; a new document starts at t = 2
    init = torch.ones(1, 1, 1, 1)
    seq = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    i0 = math.exp(-0.5) * 1.0 + 0.5
    i1 = math.exp(-1.0) * i0 + 2.0
    i2 = 0.0 + 1.5
    y, S = ssd_reference(x, dt, A, B, C, initial_states=init, seq_idx=seq)
    want = [i0 * 2, i1 * 1, i2 * 1]
    torch.testing.assert_close(y.flatten(), torch.tensor(want, dtype=torch.float64))
    assert S.item() == pytest.approx(i2, rel=1e-14)


def test_oracle_process_dt():
    dt = torch.tensor([[[-1.0, 0.3, 30.0]]])
    assert torch.equal(process_dt(dt), torch.tensor([[[0.0, 0.3, 30.0]]]).double())  # the default (0, inf) clamps
    sp = process_dt(dt, dt_softplus=True)
    torch.testing.assert_close(sp, F.softplus(dt.double()))
    assert sp[0, 0, 2].item() == 30.0  # linear above threshold 20
    cl = process_dt(dt, dt_bias=torch.tensor([0.0, 0.1, 0.0]), dt_limit=(0.0, 1.0))
    torch.testing.assert_close(cl, torch.tensor([[[0.0, 0.4, 1.0]]], dtype=torch.float64))


# ---------------------------------------------------------------- chunked == sequential

def oracle_leaves(shape, seed, **options):
    """draw's tensors in float64 on the CPU, every floating one a leaf that requires grad."""
    drawn = draw(shape, seed, dtype=torch.float64, device="cpu", **options)
    return {k: v.requires_grad_(True) if v.is_floating_point() else v for k, v in drawn.items()}


def check_chunked(inp, chunk_size, seed, **kw):
    y1, s1 = ssd_reference(**inp, **kw)
    y2, s2 = ssd_reference_chunked(**inp, **kw, chunk_size=chunk_size)
    assert rel_rms(y2, y1) < 1e-10
    assert rel_rms(s2, s1) < 1e-10
    w = draw(None, seed, dtype=torch.float64, device="cpu", weights=dict(y=y1.shape, final_states=s1.shape))
    wy, ws = w["y"], w["final_states"]
    leaves = {k: v for k, v in inp.items() if torch.is_tensor(v) and v.requires_grad}
    g1 = torch.autograd.grad((y1 * wy).sum() + (s1 * ws).sum(), list(leaves.values()))
    g2 = torch.autograd.grad((y2 * wy).sum() + (s2 * ws).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, g1, g2):
        assert rel_rms(b, a) < 1e-10, (name, rel_rms(b, a))


ORACLE_SMALL = Shape(batch=2, seqlen=37, nheads=4, headdim=3, ngroups=2, dstate=5)


def test_oracle_chunked_all_options():
    # row 0: documents start at 10, 16 (a chunk boundary), 30 and a 1-token document at 31;
    # row 1: documents start at 5 and 32 (a chunk boundary). Raw dt, softplus inside.
    inp = oracle_leaves(ORACLE_SMALL, 0, D="hp", z=True, dt_bias=True, dt_softplus=True, initial_states=True,
                        seq_idx=[[10, 16, 30, 31], [5, 32]])
    limit = (0.25, 0.6)
    dtp = process_dt(inp["dt"], inp["dt_bias"], True, limit)
    low, high = (dtp == limit[0]).float().mean(), (dtp == limit[1]).float().mean()
    assert 0.05 < low < 0.5 and 0.05 < high < 0.5  # the limit really clamps, on both sides
    check_chunked(inp, 16, 100, dt_softplus=True, dt_limit=limit)


@pytest.mark.parametrize("l,chunk", [(64, 16), (37, 16), (37, 64), (16, 16), (1, 8)])
def test_oracle_chunked_lengths(l, chunk):
    inp = oracle_leaves(ORACLE_SMALL._replace(seqlen=l, ngroups=1, dstate=4), l * 100 + chunk, initial_states=True)
    check_chunked(inp, chunk, 101)


@pytest.mark.parametrize("D", ["h", "hp"])
def test_oracle_chunked_D_and_groups(D):
    inp = oracle_leaves(ORACLE_SMALL._replace(batch=1), 1, D=D, z=True)
    check_chunked(inp, 16, 102)


def test_oracle_chunked_seq_idx_no_init():
    inp = oracle_leaves(Shape(batch=2, seqlen=40, nheads=4, headdim=2, ngroups=4, dstate=3), 2, dt_softplus=True,
                        seq_idx=[[1, 8, 9, 24], [20]])
    check_chunked(inp, 8, 103, dt_softplus=True)


def test_oracle_chunked_extreme_decay():
    # dt' * A = -1000 at tokens 0, 7, 16 (a chunk boundary) and 33, every row and head
    inp = oracle_leaves(ORACLE_SMALL, 3, D="h", initial_states=True, seq_idx=[[20], [3]], extreme=[0, 7, 16, 33])
    dA = process_dt(inp["dt"]) * inp["A"]
    assert torch.isclose(dA, torch.tensor(-1000.0, dtype=torch.float64)).sum() == 4 * 2 * 4
    check_chunked(inp, 16, 104)


# ---------------------------------------------------------------- causal conv1d

def test_oracle_conv_matches_torch():
    shape = Shape(batch=2, seqlen=11, nheads=1, headdim=2, ngroups=1, dstate=2, d_conv=4)      # 6 channels
    l, dim, K = shape.seqlen, shape.conv_dim, shape.d_conv
    drawn = draw(shape, 4, dtype=torch.float64, device="cpu", conv_weight=True, conv_bias=True)
    x, w, bias = xbc(drawn), drawn["conv_weight"], drawn["conv_bias"]
    want = F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], bias, padding=K - 1,
                           groups=dim)[..., :l].transpose(1, 2))
    torch.testing.assert_close(causal_conv1d_reference(x, w, bias), want, rtol=1e-13, atol=1e-13)
    want0 = F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], None, padding=K - 1,
                            groups=dim)[..., :l].transpose(1, 2))
    torch.testing.assert_close(causal_conv1d_reference(x, w), want0, rtol=1e-13, atol=1e-13)


def test_oracle_conv_seq_idx():
    shape = Shape(batch=2, seqlen=12, nheads=1, headdim=1, ngroups=1, dstate=2, d_conv=4)      # 5 channels
    b, l = shape.batch, shape.seqlen
    starts = [[4, 6, 7], [9]]
    drawn = draw(shape, 5, dtype=torch.float64, device="cpu", conv_weight=True, conv_bias=True, seq_idx=starts)
    x, w, bias, seq = xbc(drawn).requires_grad_(True), drawn["conv_weight"], drawn["conv_bias"], drawn["seq_idx"]
    out = causal_conv1d_reference(x, w, bias, seq)
    # every document convolved on its own
    for row in range(b):
        edges = [0] + starts[row] + [l]
        for s, e in zip(edges[:-1], edges[1:]):
            torch.testing.assert_close(out[row, s:e], causal_conv1d_reference(x[row:row + 1, s:e], w, bias)[0],
                                       rtol=1e-13, atol=1e-13)
    # output at a document's first token has exactly zero gradient w.r.t. earlier tokens
    for row in range(b):
        for st in starts[row]:
            (gx,) = torch.autograd.grad(out[row, st].sum(), x, retain_graph=True)
            assert torch.all(gx[row, :st] == 0)
            assert torch.all(gx[1 - row] == 0)
            assert torch.any(gx[row, st] != 0)


# ---------------------------------------------------------------- fused conv + SSD

def test_oracle_conv1d_ssd():
    """The fused core's oracle on convs whose output is known without a conv: the tap of the
    token itself (no bias, no activation) hands the x, B and C drawn to the SSD unchanged; the tap
    of the token before, with a bias and SiLU, hands silu(bias + that token), silu(bias) at a
    document's first token. Each against ssd_reference on what the conv hands over; the chunked
    form against the loop; a channel count that fits no split refused."""
    shape = Shape(batch=2, seqlen=21, nheads=4, headdim=3, ngroups=2, dstate=5)
    b, l, h, p, g, n, d = shape.batch, shape.seqlen, shape.nheads, shape.headdim, shape.ngroups, shape.dstate, 4
    drawn = draw(shape, 6, dtype=torch.float64, device="cpu", D="h", dt_bias=True, dt_softplus=True,
                 seq_idx=[[8], [3, 16]], conv_bias=True)
    xBC, seq, bias = xbc(drawn), drawn["seq_idx"], drawn["conv_bias"]
    args = (drawn["dt"], None, None, drawn["dt_bias"], drawn["A"], drawn["D"])   # conv weight and bias: below
    kw = dict(headdim=p, ngroups=g, seq_idx=seq, dt_limit=(0.0, 2.0))

    def ssd(x, B, C):
        return ssd_reference(x, drawn["dt"], drawn["A"], B, C, D=drawn["D"], dt_bias=drawn["dt_bias"], seq_idx=seq,
                             dt_softplus=True, dt_limit=(0.0, 2.0))

    def taps(k):
        w = torch.zeros(shape.conv_dim, d, dtype=torch.float64)
        w[:, d - 1 - k] = 1.0                                        # the token k before
        return w

    y, S = conv1d_ssd_reference(xBC, args[0], taps(0), None, *args[3:], activation=None, **kw)
    y_want, S_want = ssd(drawn["x"], drawn["B"], drawn["C"])
    assert rel_rms(y, y_want) < 1e-14 and rel_rms(S, S_want) < 1e-14

    first = torch.ones(b, l, 1, dtype=torch.bool)
    first[:, 1:, 0] = seq[:, 1:] != seq[:, :-1]                      # a document's first token
    before = F.pad(xBC, (0, 0, 1, 0))[:, :l].masked_fill(first, 0.0)
    u = F.silu(bias + before)                                        # (b, l, conv_dim) = [x | B | C]
    x_, B_, C_ = torch.split(u, [h * p, g * n, g * n], dim=-1)
    y, S = conv1d_ssd_reference(xBC, args[0], taps(1), bias, *args[3:], **kw)
    y_want, S_want = ssd(x_.reshape(b, l, h, p), B_.reshape(b, l, g, n), C_.reshape(b, l, g, n))
    assert rel_rms(y, y_want) < 1e-14 and rel_rms(S, S_want) < 1e-14

    y3, S3 = conv1d_ssd_reference(xBC, args[0], taps(1), bias, *args[3:], chunked=True, chunk_size=8, **kw)
    assert rel_rms(y3, y) < 1e-10 and rel_rms(S3, S) < 1e-10
    with pytest.raises(ValueError, match="xBC has 31 channels"):
        conv1d_ssd_reference(xBC[..., :-1], args[0], taps(0)[:-1], None, *args[3:], **kw)


# ---------------------------------------------------------------- state passing == sequential

SP_STARTS = [[5, 11], [12, 16]]   # document starts, row 0 and row 1


@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_state_passing_reference(world, documents):
    """The method in plain torch (W ranks in one process) against the token loop, forward and
    backward. l = 23 divides by no W; tensor_split's shard boundaries are 12 (W=2), 8, 16 (W=3),
    6, 12, 18 (W=4), 5, 10, 15, 19 (W=5), so a document starts exactly on a boundary for every
    W > 1 (12 for W=2 and 4, 16 for W=3, 5 for W=5; for W=3 and 5 it is the only start in its
    shard, so a_r must see it), and row 0's document from 11 and row 1's first one (fed by
    initial_states) span several shards. Without documents: no seq_idx and no initial_states."""
    shape = Shape(batch=2, seqlen=23, nheads=4, headdim=3, ngroups=2, dstate=5)
    opts = dict(seq_idx=SP_STARTS, initial_states=True) if documents else {}
    inp = oracle_leaves(shape, 7, D="hp", dt_bias=True, dt_softplus=True, **opts)
    if documents and world > 1:
        bounds = {int(s[0]) for s in torch.tensor_split(torch.arange(shape.seqlen), world)[1:]}
        assert bounds & {s for row in SP_STARTS for s in row}   # a start on a shard boundary
    y1, s1 = ssd_reference(**inp, dt_softplus=True)
    y2, s2 = ref.state_passing_reference(**inp, world=world, dt_softplus=True)
    assert y2.dtype == s2.dtype == torch.float64 and y2.shape == y1.shape and s2.shape == s1.shape
    assert rel_rms(y2, y1) < 1e-10 and rel_rms(s2, s1) < 1e-10
    w = draw(None, 105, dtype=torch.float64, device="cpu", weights=dict(y=y1.shape, final_states=s1.shape))
    leaves = {k: v for k, v in inp.items() if torch.is_tensor(v) and v.requires_grad}
    assert {"x", "dt", "A", "B", "C", "D", "dt_bias"} <= set(leaves) and ("initial_states" in leaves) == documents
    g1 = torch.autograd.grad((y1 * w["y"]).sum() + (s1 * w["final_states"]).sum(), list(leaves.values()))
    g2 = torch.autograd.grad((y2 * w["y"]).sum() + (s2 * w["final_states"]).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, g1, g2):
        assert rel_rms(b, a) < 1e-10, (name, rel_rms(b, a))


def test_state_passing_reference_world_range():
    inp = oracle_leaves(Shape(batch=1, seqlen=6, nheads=2, headdim=2, ngroups=1, dstate=2), 8)
    for world in (0, 7):   # 1 <= world <= l
        with pytest.raises(ValueError, match=f"world={world}"):
            ref.state_passing_reference(**inp, world=world)


# ---------------------------------------------------------------------------------------------
# mamba_cp sections 3-5, 7 and 13: the single-device SSD against the oracle, forward and backward
# (section 7's tuning too)
# ---------------------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "D_h": dict(D="h"),
    "D_hp": dict(D="hp"),
    "z": dict(z=True),
    "dt_bias": dict(dt_bias=True),
    "dt_softplus": dict(dt_softplus=True),
    "initial_states": dict(initial_states=True),
    "seq_idx": dict(seq_idx=[16, 40, 41]),
    "dt_limit": dict(dt_softplus=True, dt_bias=True, dt_limit=(0.25, 0.6)),
    "all": dict(D="hp", z=True, dt_bias=True, dt_softplus=True, initial_states=True,
                seq_idx=[16, 40, 41], dt_limit=(0.05, 1.5)),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_against_oracle(name):
    assert_close(run_both(ssd_inputs(SMALL, 1, **OPTIONS[name])), FP32_BOUND)


@pytest.mark.parametrize("shape", [
    Shape(batch=1, seqlen=100, nheads=3, headdim=8, ngroups=1, dstate=16, chunk=64),   # partial chunk
    Shape(batch=2, seqlen=33, nheads=6, headdim=24, ngroups=3, dstate=20, chunk=16),  # odd sizes
    Shape(batch=1, seqlen=5, nheads=2, headdim=8, ngroups=2, dstate=8, chunk=16),     # shorter than a chunk
    Shape(batch=1, seqlen=64, nheads=2, headdim=32, ngroups=1, dstate=32, chunk=32),  # exact chunks
], ids=["l100_q64", "g3_p24_n20", "l5", "exact"])
def test_awkward_shapes(shape):
    assert_close(run_both(ssd_inputs(shape, 2, D="h", z=True, dt_bias=True, dt_softplus=True, initial_states=True)),
                 FP32_BOUND)


_TRITON_FIRST = """
import triton  # first, as transformers' model classes import it
import torch, mamba_cp, reference_ssd
assert mamba_cp.INTERPRET
g = torch.Generator().manual_seed(0)
x, dt = torch.randn(1, 40, 2, 8, generator=g), torch.rand(1, 40, 2, generator=g) * 0.2
A, B, C = -torch.rand(2, generator=g), torch.randn(1, 40, 1, 8, generator=g), torch.randn(1, 40, 1, 8, generator=g)
y = mamba_cp.mamba_chunk_scan_combined(x, dt, A, B, C, 16)
want = reference_ssd.ssd_reference(x, dt, A, B, C)[0]
assert ((y.double() - want).norm() / want.norm()).item() < 1e-5
"""


@pytest.mark.skipif(CUDA, reason="the interpreter is chosen only where CUDA is absent")
def test_import_order_does_not_matter():
    """Triton imported before mamba_cp on a machine without CUDA: the kernels still run in the
    interpreter (triton's own @jit functions are handed to it), against the oracle."""
    run = subprocess.run([sys.executable, "-c", _TRITON_FIRST], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.abspath(__file__)),
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stderr[-2000:]


def test_set_tuning_refuses_unknown_names():
    with pytest.raises(ValueError, match="expected a Tuning or one of"):
        mamba_cp.set_tuning("h100")
    assert mamba_cp.tuning() is mamba_cp.TUNINGS["gpu" if CUDA else "interpreter"]


def test_gpu_program_shapes(tuned):
    """The GPU's tuning of the SSD kernels in the interpreter: one head per output program, the
    whole state as one tile in both chunk-backward kernels, the GPU's launch options; its runs
    lengthened as on a GPU, here from 1 chunk to 4 of the 5 (test_runs_lengthen_...). (The conv's
    and the gate's GPU tiles: test_conv_gpu_tiles, test_split_gpu_tiles.)"""
    tuned(dataclasses.replace(mamba_cp.TUNINGS["gpu"], chunks_per_run=1, longest_run=4, state_wave=16))
    assert_close(run_both(ssd_inputs(SMALL, 1, **OPTIONS["all"])), FP32_BOUND)


def test_group_split(tuned):
    """A group's heads split over group-kernel programs, each summing its share of dCB, the BC
    kernel summing the shares (the GPU splits where chunks x groups are too few: one group of 48
    heads at a few thousand tokens): 4 heads a group in 4 splits, with documents and every option."""
    tuned(dataclasses.replace(mamba_cp.tuning(), group_wave=10 ** 6))
    shape = SMALL._replace(nheads=8, headdim=8, seqlen=45)
    plan = mamba_cp.LaunchPlan((shape.batch, shape.seqlen, shape.nheads, shape.headdim, shape.ngroups, shape.dstate),
                               torch.float32, shape.chunk, None, True, (0.0, math.inf), None)
    assert plan.group_splits == 4
    assert_close(run_both(ssd_inputs(shape, 4, **OPTIONS["all"])), FP32_BOUND)


def test_runs_lengthen_while_the_gpu_stays_busy(tuned):
    """The state pass's runs double from chunks_per_run up to longest_run while the state pass
    keeps state_wave programs: 8 a run at SMALL (2 rows of 4 heads, one state tile), 5 chunks."""
    x, B = (torch.empty(SMALL.batch, SMALL.seqlen, n, d) for n, d in ((SMALL.nheads, SMALL.headdim),
                                                                      (SMALL.ngroups, SMALL.dstate)))
    for wave, want in ((25, 1), (24, 2), (16, 4)):        # 5, 3 and 2 runs of 8 programs
        tuned(dataclasses.replace(mamba_cp.TUNINGS["interpreter"], chunks_per_run=1, longest_run=4,
                                  state_wave=wave))
        plan = mamba_cp.LaunchPlan((*x.shape, *B.shape[2:]), x.dtype, SMALL.chunk, None, True, (0.0, math.inf), None)
        assert plan.chunks_per_run == want, (wave, plan.chunks_per_run)


def test_a_short_backward_runs_once_on_smaller_tiles(tuned):
    """A backward over at most longest_run chunks whose state passes would take several runs takes
    one on bwd_one_run_tile's tiles where those still give state_wave programs; the forward keeps
    its tiles and runs. At SMALL (5 chunks): 8 programs a run on whole (32, 32) tiles, 32 on 16s;
    the gradients of such a call, with documents and every option, against the oracle."""
    x, B = (torch.empty(SMALL.batch, SMALL.seqlen, n, d) for n, d in ((SMALL.nheads, SMALL.headdim),
                                                                      (SMALL.ngroups, SMALL.dstate)))
    for wave, longest, want_tile, want_runs in ((32, 8, 16, 1), (33, 8, 32, 5), (32, 4, 32, 5)):
        tuned(dataclasses.replace(mamba_cp.TUNINGS["interpreter"], chunks_per_run=1, longest_run=longest,
                                  state_wave=wave, bwd_one_run_tile=16))
        fwd, bwd = (mamba_cp.LaunchPlan((*x.shape, *B.shape[2:]), x.dtype, SMALL.chunk, None, True, (0.0, math.inf),
                                        None, backward=backward) for backward in (False, True))
        assert (bwd.BP_state, bwd.BN_state, bwd.nruns) == (want_tile, want_tile, want_runs), (wave, longest)
        assert (fwd.BP_state, fwd.BN_state, fwd.nruns) == (32, 32, 5), (wave, longest)
        if want_runs == 1:              # a backward on other tiles and runs than its forward's, against the oracle
            assert_close(run_both(ssd_inputs(SMALL, 5, **OPTIONS["all"])), FP32_BOUND)


def test_run_summaries_against_oracle(tuned):
    """Each run's summary, as the backward forms it in one product over the run's tokens
    (_run_summary_kernel), against the token loop on the run's tokens alone: S_ext, the exit
    state from a zero entry; G, the pull of the run's outputs on its entry (the gradient of
    sum(y dy) with respect to initial_states); a, the run's decay. Runs of 2 chunks of 16 over
    150 tokens (on a GPU too: the interpreter's tuning with runs of 2), the last one partial;
    documents start mid-chunk, at a run's first token (whose entry then reaches nothing: G = 0,
    a = 0) and at a chunk's first token inside a run."""
    tuned(dataclasses.replace(mamba_cp.TUNINGS["interpreter"], chunks_per_run=2, longest_run=2))
    shape = Shape(batch=2, seqlen=150, nheads=4, headdim=8, ngroups=2, dstate=16, chunk=16)
    inputs = ssd_inputs(shape, 21, seq_idx=[20, 64, 80, 131], dt_softplus=True, dt_bias=True)
    x, dt, A, B, C, dt_bias, seq = (inputs[k] for k in ("x", "dt", "A", "B", "C", "dt_bias", "seq_idx"))
    dy = draw(None, 22, device=x.device, weights=dict(dy=x.shape))["dy"]
    plan = mamba_cp.LaunchPlan((*x.shape, *B.shape[2:]), x.dtype, shape.chunk, dt_bias, True, (0.0, math.inf), seq)
    span = plan.chunks_per_run * plan.Q
    assert plan.nruns == 5 and span == 32, (plan.nruns, span)
    ssd = mamba_cp.SSD(x, dt, A, B, C, None, dt_bias, seq, mamba_cp._dt_cumsums(dt, dt_bias, A, plan))
    S_ext, a = mamba_cp._run_summaries(x, B, ssd, plan, False)
    G, a_rev = mamba_cp._run_summaries(dy, C, ssd, plan, True)
    dtp = ref.process_dt(dt, dt_bias, True)                                       # (b, l, h) float64
    errs = {}
    for r in range(plan.nruns):
        t = slice(r * span, min((r + 1) * span, shape.seqlen))
        entry = torch.zeros(shape.batch, shape.nheads, shape.headdim, shape.dstate, dtype=torch.float64,
                            device=x.device, requires_grad=True)
        y, final = ref.ssd_reference(x[:, t], dt[:, t], A, B[:, t], C[:, t], dt_bias=dt_bias, initial_states=entry,
                                     seq_idx=seq[:, t], dt_softplus=True)
        pull, = torch.autograd.grad((y * dy[:, t].double()).sum(), entry)
        # the entry reaches the run's first token unless a document starts there, and its exit
        # (a != 0) unless a document starts anywhere in it
        before = seq[:, t.start - 1] if r else seq[:, 0]
        enters = (seq[:, t.start] == before)[:, None, None, None]                # (b, 1, 1, 1)
        crosses = (seq[:, t] == before[:, None]).all(dim=1)                       # (b,)
        decay = torch.where(crosses[:, None], torch.exp((dtp[:, t] * A.double()).sum(dim=1)), 0.0)   # (b, h)
        errs[f"S_ext {r}"] = rel_rms(S_ext[:, r], final)
        errs[f"G {r}"] = rel_rms(G[:, r], pull * enters)
        errs[f"a {r}"] = max((a[:, r] - decay).abs().max().item(), (a_rev[:, r] - decay).abs().max().item())
    expect({"runs": errs}, FP32_BOUND)


def test_every_kernel_compiles_for_the_gpu():
    """The interpreter runs code the GPU's compiler would refuse: `tools/sass.py` compiles every
    kernel of the SSD and of the mixer entry (z gate; and gated RMSNorm with out projection),
    forward and backward, and the conv with document ids, with a halo (the CP path's, with packed
    documents) and without (a world of one's): its first steps apart, and the masks; for sm_90
    under the GPU's tuning, on this machine, at an awkward bf16 shape (6 heads of 24 in 3 groups,
    dstate 20, 1100 tokens: masked tiles, two runs, so the summary scan too), and reads each
    one's registers."""
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, os.path.join(here, "tools", "sass.py"), "--lengths", "1100", "--nheads",
                          "6", "--headdim", "24", "--ngroups", "3", "--dstate", "20", "--calls",
                          "ssd,entry,mixer,conv_ids,conv_halo_ids"], cwd=here, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = {(r["call"], r["kernel"]): r for r in
            (json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines() if line.startswith("RESULT "))}
    chunk_kernels = ("_dt_cumsum_kernel", "_state_pass_kernel", "_run_summary_kernel", "_summary_scan_kernel",
                     "_output_fwd_kernel", "_chunk_bwd_group_kernel", "_chunk_bwd_BC_kernel", "_chunk_bwd_x_kernel")
    want = {("ssd", k) for k in chunk_kernels} | {("entry", k) for k in chunk_kernels + (
        "_conv_fwd_kernel", "_conv_bwd_kernel", "_gate_norm_bwd_kernel")} | {
        ("mixer", "_gate_norm_fwd_kernel"), ("mixer", "_gate_norm_bwd_kernel")} | {
        (case, k) for case in ("conv_ids", "conv_halo_ids") for k in ("_conv_fwd_kernel", "_conv_bwd_kernel")}
    assert want <= set(seen), sorted(want - set(seen))
    assert all(0 < r["registers"] <= 255 and r["instructions"] > 0 for r in seen.values()), seen
    assert all(seen[case, k]["loop_instructions"] > 0 for case in ("conv_ids", "conv_halo_ids")
               for k in ("_conv_fwd_kernel", "_conv_bwd_kernel"))


def test_dt_limit_clamps():
    inputs = ssd_inputs(SMALL, 3, dt_softplus=True, dt_bias=True, dt_limit=(0.25, 0.6))
    v = ref.process_dt(inputs["dt"], inputs["dt_bias"], True)
    low, high = (v < 0.25).float().mean().item(), (v > 0.6).float().mean().item()
    assert low > 0.05 and high > 0.05, f"the limit must clamp on both sides (got {low:.2f}, {high:.2f})"
    assert_close(run_both(inputs), FP32_BOUND)


def test_seq_idx_documents():
    """Several documents, one starting exactly at a chunk boundary (32), a one-token document
    (47), and rows that split differently; with initial states that reach only the first."""
    inputs = ssd_inputs(SMALL._replace(seqlen=90), 4, seq_idx=[32, 47, 48, 70], initial_states=True, D="h", z=True)
    assert inputs["seq_idx"][0, 31] != inputs["seq_idx"][0, 32]
    assert_close(run_both(inputs), FP32_BOUND)


@pytest.mark.parametrize("chunk", [64, 128])
def test_extreme_decay(chunk):
    inputs = ssd_inputs(Shape(batch=2, seqlen=300, nheads=4, headdim=16, ngroups=2, dstate=16, chunk=chunk), 5,
                        extreme=True, D="hp", initial_states=True, seq_idx=[150])
    frac = (inputs["dt"] * inputs["A"] <= -999).float().mean().item()
    assert 0.02 < frac < 0.1
    assert_close(run_both(inputs), FP32_BOUND)


def test_tf32_split():
    """On a GPU the backward's sums over spanning pairs (README walkthrough b, rule 3) run on the
    tensor cores as two tf32 products of a float32 tile's split a = hi + lo (_exact_dot); their
    accuracy rests on the split: exact, hi within tf32's 11 significant bits, |lo| < 2^-10 |a|.
    Values over 60 binades, both signs, zeros and a subnormal (split exactly, its bound aside)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(a_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        hi, lo = mamba_cp._tf32_split(tl.load(a_ptr + offs))
        tl.store(hi_ptr + offs, hi)
        tl.store(lo_ptr + offs, lo)

    g = torch.Generator().manual_seed(13)
    a = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-30, 30, (4096,), generator=g).float())
    a[:3] = torch.tensor([0.0, -0.0, 1e-40])
    a = a.to(DEVICE)
    hi, lo = torch.empty_like(a), torch.empty_like(a)
    split_kernel[(1,)](a, hi, lo, N=a.numel())
    assert torch.equal(hi + lo, a)
    assert not (hi.view(torch.int32) & 0x1FFF).any()
    normal = a.abs() >= torch.finfo(torch.float32).tiny   # a subnormal's leading bits are fewer
    assert (lo.abs() <= a.abs() * 2.0 ** -10)[normal].all()
    assert (lo != 0).float().mean() > 0.9   # the split did cut: a plain copy would pass the rest


# The default dt_limit (0, inf) clamps, as mamba_ssm's Triton kernels do: a negative raw dt
# (dt_softplus=False) becomes dt' = 0 (the token neither decays nor writes the state) and gets no
# gradient; dt = 0 itself is inside the limit and keeps its gradient (mamba_ssm's clamp mask).
CLAMPED = {
    "negative_dt": dict(negative_dt=True),
    "negative_dt_all": dict(negative_dt=True, D="hp", z=True, initial_states=True, seq_idx=[16, 40, 41]),
}


@pytest.mark.parametrize("name", list(CLAMPED))
def test_default_dt_limit_clamps_negative_dt(name):
    inputs = ssd_inputs(SMALL, 11, **CLAMPED[name])
    dt = inputs["dt"]
    assert 0.2 < (dt < 0).float().mean() < 0.6 and 0.05 < (dt == 0).float().mean() < 0.2
    pairs = run_both(inputs)
    assert_close(pairs, FP32_BOUND)
    ddt = pairs["ddt"][0]
    assert torch.all(ddt[dt < 0] == 0), "no gradient where clamped"
    assert (ddt[dt == 0] != 0).float().mean() > 0.9, "dt = 0 is inside the limit: its gradient passes"


# Growth: dt'*A > 0 (A > 0), where the per-token factors exceed 1. The lengths keep the true values
# finite in float32; "strong" grows by e^3 a token, with a document every 10 tokens, so that
# exponents spanning documents overflow (they must be selected away, never multiplied by 0).
GROWTH = {
    "pos_A": dict(growth="pos_A"),
    "pos_A_all": dict(growth="pos_A", D="hp", z=True, initial_states=True, seq_idx=[16, 40, 41]),
    "pos_A_softplus": dict(growth="pos_A", D="h", dt_bias=True, dt_softplus=True, initial_states=True),
    "strong_documents": dict(growth=3.0, seq_idx=list(range(5, 77, 10)), initial_states=True, D="h"),
}


@past_float32
@pytest.mark.parametrize("name", list(GROWTH))
def test_growth_against_oracle(name):
    inputs = ssd_inputs(SMALL, 11, **GROWTH[name])
    dtp = process_dt(inputs["dt"], inputs.get("dt_bias"), inputs["dt_softplus"])
    assert (dtp * inputs["A"] > 0).float().mean() > 0.9
    assert_close(run_both(inputs), FP32_BOUND)


@past_float32
@pytest.mark.parametrize("opts", [OPTIONS["all"], GROWTH["strong_documents"]], ids=["decay", "growth"])
def test_deterministic(opts):
    inputs = ssd_inputs(SMALL, 6, **opts)
    runs = []
    for _ in range(2):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items() if k in DIFFERENTIABLE}
        y, f = mamba_cp.mamba_chunk_scan_combined(**{**inputs, **leaves}, return_final_states=True)
        grads = torch.autograd.grad(y.sum() + f.pow(2).sum(), list(leaves.values()))
        runs.append([y, f, *grads])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_returns_like_mamba_ssm():
    inputs = ssd_inputs(SMALL, 7)
    y = mamba_cp.mamba_chunk_scan_combined(**inputs)
    assert isinstance(y, torch.Tensor) and y.shape == inputs["x"].shape and y.dtype == inputs["x"].dtype
    y2, final = mamba_cp.mamba_chunk_scan_combined(**inputs, return_final_states=True)
    assert final.dtype == torch.float32 and final.shape == (2, 4, 24, 20)
    assert torch.equal(y, y2)


def test_state_dtype():
    """Chunk states stored in float32 are what float32 inputs get anyway (bitwise); stored in
    bf16 or fp16 they cost accuracy, which shows the argument is honoured. The bounds are within
    a few of each dtype's unit roundoff (2^-8, 2^-11): the backward stores every chunk's whole
    state in that dtype, as mamba_ssm stores its chunk states."""
    inputs = ssd_inputs(SMALL, 12, **OPTIONS["all"])
    default = run_both(inputs)
    fp32 = run_both(dict(inputs, state_dtype=torch.float32))
    assert all(torch.equal(fp32[k][0], default[k][0]) for k in default)
    assert_close(fp32, FP32_BOUND)
    for dtype, lowest, highest in ((torch.bfloat16, 1e-4, 3e-3), (torch.float16, 5e-6, 1e-3)):
        errs = assert_close(run_both(dict(inputs, state_dtype=dtype)), highest)
        assert errs["y"] > lowest, f"state_dtype={dtype}: y {errs['y']:.1e}, as exact as float32 states"


def document_end_oracle(inputs, cu):
    """The float64 state after each packed document: the oracle run on each document alone,
    with initial_states for the first one only."""
    per_token = ("x", "dt", "B", "C", "z")
    states = []
    for d in range(cu.numel() - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        kw = {k: v for k, v in inputs.items() if k not in ("chunk_size", "seq_idx", "state_dtype")}
        kw.update({k: inputs[k][:, a:b] for k in per_token if k in inputs})
        if d > 0:
            kw["initial_states"] = None
        states.append(ssd_reference(**kw)[1][0])
    return torch.stack(states)                                                # (num_docs, h, p, n)


@pytest.mark.parametrize("opts", [dict(initial_states=True, D="hp", z=True, dt_bias=True, dt_softplus=True),
                                  dict(growth="pos_A", negative_dt=True)], ids=["decay", "growth_clamped"])
def test_varlen_states(opts):
    """Documents of 1, 31 and 33 tokens (the second ends at a kernel-chunk boundary, 32), one of
    15 inside a chunk and one of 40 across three chunks; both return orders."""
    lens = [1, 31, 33, 15, 40]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    inputs = ssd_inputs(Shape(batch=1, seqlen=int(cu[-1]), nheads=4, headdim=8, ngroups=2, dstate=16, chunk=16), 13,
                        seq_idx=cu[1:-1].tolist(), **opts)
    cu = cu.to(DEVICE)
    y, final, states = mamba_cp.mamba_chunk_scan_combined(**inputs, cu_seqlens=cu, return_final_states=True,
                                                          return_varlen_states=True)
    assert states.shape == (5, 4, 8, 16) and states.dtype == torch.float32
    want = document_end_oracle(inputs, cu)
    assert_close({"varlen_states": (states, want), "last = final": (states[-1:], final)}, FP32_BOUND)
    y2, states2 = mamba_cp.mamba_chunk_scan_combined(**inputs, cu_seqlens=cu, return_varlen_states=True)
    assert torch.equal(y2, y) and torch.equal(states2, states)


def test_varlen_states_have_no_backward():
    """As in mamba_ssm: gradients flow through y (and the final state), not the varlen states."""
    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    inputs = ssd_inputs(Shape(batch=1, seqlen=45, nheads=2, headdim=8, ngroups=1, dstate=8, chunk=16), 14, seq_idx=[20])
    x = inputs["x"].clone().requires_grad_(True)
    y, states = mamba_cp.mamba_chunk_scan_combined(**dict(inputs, x=x), cu_seqlens=cu.to(DEVICE),
                                                   return_varlen_states=True)
    (dx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    plain = mamba_cp.mamba_chunk_scan_combined(**dict(inputs, x=x))
    assert torch.equal(dx, torch.autograd.grad(plain.sum(), x)[0])
    with pytest.raises(RuntimeError, match="return_varlen_states=True have no backward"):
        torch.autograd.grad((y.sum() + states.sum()), x)


# ---------------------------------------------------------------------------------------------
# mamba_cp section 9: bad input, a ValueError naming the argument
# ---------------------------------------------------------------------------------------------

def _bad_cases():
    drawn = ssd_inputs(Shape(batch=1, seqlen=20, nheads=4, headdim=8, ngroups=2, dstate=8, chunk=16), 8, device=DEVICE,
                       D="h", z=True, dt_bias=True, initial_states=True)
    ok = {k: v for k, v in drawn.items() if k not in ("D", "z", "dt_bias", "initial_states")}
    x, B = ok["x"], ok["B"]
    on = functools.partial(torch.tensor, device=DEVICE)     # where the kernels run: each case bad one way only
    seq = on([[0] * 8 + [1] * 12], dtype=torch.int32)               # documents [0, 8) and [8, 20)
    return {
        "x_rank": ("x", dict(x=x[0])),
        "dt_shape": ("dt", dict(dt=ok["dt"][:, :10])),
        "A_shape": ("A", dict(A=ok["A"][:3])),
        "B_rank": ("B", dict(B=B[0])),
        "C_shape": ("C", dict(C=ok["C"][..., :4])),
        "ngroups": ("B", dict(B=torch.cat([B, B[:, :, :1]], 2), C=torch.cat([ok["C"], ok["C"][:, :, :1]], 2))),
        "D_shape": ("D", dict(D=torch.cat([drawn["D"], drawn["D"][:1]]))),                    # (5,)
        "z_shape": ("z", dict(z=drawn["z"][..., :7])),                                        # (1, 20, 4, 7)
        "dt_bias_shape": ("dt_bias", dict(dt_bias=drawn["dt_bias"][:, None])),                # (4, 1)
        "init_shape": ("initial_states", dict(initial_states=F.pad(drawn["initial_states"], (0, 1)))),  # n = 9
        "seq_float": ("seq_idx", dict(seq_idx=torch.zeros(1, 20, device=DEVICE))),
        "seq_decreasing": ("seq_idx", dict(seq_idx=on([[1] * 10 + [0] * 10], dtype=torch.int32))),
        "chunk_not_pow2": ("chunk_size", dict(chunk_size=48)),
        "chunk_small": ("chunk_size", dict(chunk_size=8)),
        "dtype_mismatch": ("B", dict(B=B.double())),
        "device_mismatch": ("A", dict(A=ok["A"].to("meta"))),
        "state_dtype": ("state_dtype", dict(state_dtype=torch.float64)),
        "varlen_without_cu_seqlens": ("cu_seqlens", dict(return_varlen_states=True)),
        "cu_seqlens_without_seq_idx": ("seq_idx", dict(cu_seqlens=on([0, 8, 20]))),
        "cu_seqlens_float": ("cu_seqlens", dict(seq_idx=seq, cu_seqlens=on([0.0, 8.0, 20.0]))),
        "cu_seqlens_not_increasing": ("cu_seqlens", dict(seq_idx=seq, cu_seqlens=on([0, 8, 8, 20]))),
        "cu_seqlens_not_ending_at_L": ("cu_seqlens", dict(seq_idx=seq, cu_seqlens=on([0, 8, 19]))),
        "cu_seqlens_disagree_with_seq_idx": ("cu_seqlens", dict(seq_idx=seq, cu_seqlens=on([0, 9, 20]),
                                                                return_varlen_states=True)),
        "cu_seqlens_batch_2": ("x", dict(x=torch.cat([x, x]), dt=torch.cat([ok["dt"]] * 2),
                                         B=torch.cat([B, B]), C=torch.cat([ok["C"]] * 2),
                                         seq_idx=torch.cat([seq, seq]), cu_seqlens=on([0, 8, 20]))),
    }, ok


def test_bad_input_control():
    """The arguments the bad cases change, unchanged, run (so each case fails for its own change)."""
    cases, ok = _bad_cases()
    ok = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in ok.items()}
    seq = torch.tensor([[0] * 8 + [1] * 12], dtype=torch.int32, device=DEVICE)
    mamba_cp.mamba_chunk_scan_combined(**ok)
    mamba_cp.mamba_chunk_scan_combined(**ok, seq_idx=seq, cu_seqlens=torch.tensor([0, 8, 20], device=DEVICE),
                                       return_varlen_states=True)


@pytest.mark.parametrize("case", list(_bad_cases()[0]))
def test_bad_input_raises(case):
    cases, ok = _bad_cases()
    name, change = cases[case]
    with pytest.raises(ValueError, match=rf"^{name}: got .*, expected "):
        mamba_cp.mamba_chunk_scan_combined(**{**ok, **change})


def test_cpu_tensors_refused_where_kernels_are_for_the_gpu(monkeypatch):
    """With CUDA present mamba_cp compiles its kernels for the GPU, which cannot read CPU tensors:
    each entry refuses them with a ValueError naming its first tensor and the way to the
    interpreter (here the module is told it compiled for the GPU; shapes no other test uses, so
    that no signature's checks were passed before)."""
    monkeypatch.setattr(mamba_cp, "_CPU_TENSORS_OK", False)
    fix = r": got a tensor on cpu, expected a CUDA tensor: .*TRITON_INTERPRET=1"
    ssd = ssd_inputs(Shape(batch=1, seqlen=21, nheads=2, headdim=8, ngroups=1, dstate=8, chunk=16), 9, device="cpu")
    with pytest.raises(ValueError, match="^x" + fix):
        mamba_cp.mamba_chunk_scan_combined(**ssd)
    inp, _ = conv_inputs(CONV_SMALL._replace(seqlen=11), halo=False, bias=True, starts=None)
    with pytest.raises(ValueError, match="^xBC" + fix):
        mamba_cp.conv1d_fwd(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in inp.items()})
    shape = SPLIT_SMALL._replace(seqlen=19)
    full, opts = fused_inputs(shape, 0, device="cpu")
    with pytest.raises(ValueError, match="^xBC" + fix):
        mamba_cp.mamba_conv1d_ssd_cp(**full, **opts)
    split, opts = split_inputs(shape, 0, norm=True, device="cpu")
    with pytest.raises(ValueError, match="^zxbcdt" + fix):
        mamba_cp.mamba_split_conv1d_scan_combined(**split, **opts)


# ---------------------------------------------------------------------------------------------
# mamba_cp sections 6, 8 and 10: layouts and communication. The layouts by hand; the zigzag
# permutation each way; the prefix scan over ranks (summary_exchange="scan") alone, on random
# summaries of every global segment, against the float64 recurrence (forward) and its autograd
# (backward); the cost model against bytes worked by hand. Then the whole fused core with both
# exchanges, every layout, each against the oracle; and bad calls refused on every rank.
# ---------------------------------------------------------------------------------------------

def test_layouts_by_hand():
    """shard and unshard against token positions written out (W = 3, 12 tokens): contiguous
    quarters for "none", and for the zigzag layouts pieces r and 2W - 1 - r of 2W."""
    full = torch.arange(12)[None]                                                       # (1, 12)
    want = {"none": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]],
            "zigzag": [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]}
    for layout in mamba_cp.LAYOUTS:
        shards = [mamba_cp.shard(full, r, 3, layout) for r in range(3)]
        assert [t[0].tolist() for t in shards] == want["none" if layout == "none" else "zigzag"], layout
        assert torch.equal(mamba_cp.unshard(shards, layout), full), layout


def cp_permutation_errors(rank, world, group, device):
    """Zigzag -> contiguous and contiguous -> zigzag, each direction on its own, both backends:
    bitwise the other layout's shard, and the gradient reaching the input bitwise the input
    layout's shard of the gradient sent in (the inverse permutation). Skipped in a world of one."""
    if world == 1:
        return Skipped("a world of one holds the whole sequence: nothing to permute")
    L = 12 * world
    drawn = draw(Shape(batch=2, seqlen=L, nheads=1, headdim=3), 5, device=device, weights=dict(w=(2, L, 3)))
    full, w = drawn["x"].flatten(2), drawn["w"]
    exact = lambda got, want: 0.0 if torch.equal(got, want) else float("inf")       # noqa: E731
    errs = {}
    for backend in ("permute_p2p", "permute_a2a"):
        for to_contiguous, src, dst in ((True, "virtual", "none"), (False, "none", "virtual")):
            x = mamba_cp.shard(full, rank, world, src).requires_grad_(True)
            moved = mamba_cp._permute_op(x, mamba_cp._group_name(group), backend, to_contiguous)
            (g,) = torch.autograd.grad((moved * mamba_cp.shard(w, rank, world, dst)).sum(), x)
            errs[f"{backend} {src} to {dst}"] = exact(moved, mamba_cp.shard(full, rank, world, dst))
            errs[f"{backend} {src} to {dst}, backward"] = exact(g, mamba_cp.shard(w, rank, world, src))
    return errs


def random_summaries(world, layout, seed=7):
    """Every global segment's (a, S_ext, first id, last id), initial state, G, and one dfinal
    per rank (draw's summaries, a segment per position). Decays a in (0, 1.3): some segments
    grow. Document ids rise by 0 or 1 at each segment end and inside segments, so documents
    start at boundaries, inside segments, and span several."""
    K = mamba_cp._pieces(0, world, layout)[1]
    shape = Shape(batch=2, seqlen=K, nheads=3, headdim=4, ngroups=1, dstate=5)
    b, h, p, n = shape.batch, shape.nheads, shape.headdim, shape.dstate
    drawn = draw(shape, seed, device="cpu", summaries=True, initial_states=True,
                 weights=dict(G=(b, K, h, p, n), dfinal=(world, b, h, p, n)))
    return dict(a=drawn["a"], S=drawn["S_ext"], first=drawn["first_id"], last=drawn["last_id"],
                init=drawn["initial_states"], G=drawn["G"], dfinal=drawn["dfinal"])


def sequential_summaries(s):
    """The oracle's float64 scan over segments in global order (reference_ssd.summary_scan_reference):
    entries, final, cont; and, by autograd through it, the gradients of sum_k <G_k, entry_k> +
    <sum of dfinal, final> w.r.t. S_ext (the gradient at each segment's exit) and the initial state."""
    S = s["S"].double().requires_grad_(True)
    init = s["init"].double().requires_grad_(True)
    entries, E, cont = ref.summary_scan_reference(s["a"], S, s["first"], s["last"], init)
    loss = (entries * s["G"].double()).sum() + (E * s["dfinal"].double().sum(0)).sum()
    dexit, dinit = torch.autograd.grad(loss, [S, init])
    return dict(entries=entries.detach(), final=E.detach(), cont=cont, dexit=dexit, dinit=dinit)


def scan_plan(world, rank, group, layout, s):
    """The Plan of a call whose segments carry the summaries s (only their sizes matter)."""
    b, _, h, p, n = s["S"].shape
    per_row = 2 if layout == "virtual" else 1
    call = mamba_cp.Call(torch.zeros(b * per_row, 2, h * p + 2 * n), torch.zeros(b * per_row, 2, h),
                         torch.zeros(h * p + 2 * n, 4), None, None, torch.zeros(h), None, None, None)
    return mamba_cp.Plan(call, b, 16, p, 1, group=group, load_balancing=layout, exchange=mamba_cp.PrefixScanExchange)


@check("summary scan alone", 1e-6)
def scan_helper_errors(rank, world, group, device, gpu=False):
    """_entries_by_prefix_scan and _exit_grads_by_prefix_scan on random summaries, both layouts,
    with documents: within float32 (1e-6) of the oracle's float64 scan (summary_scan_reference)
    and its gradient, and the final state bitwise the same on every rank."""
    results = {}
    for layout in ("none", "virtual"):
        s = random_summaries(world, layout)
        want = {k: v.to(device) for k, v in sequential_summaries(s).items()}
        s = {k: v.to(device) for k, v in s.items()}
        plan = scan_plan(world, rank, group, layout, s)
        held = plan.segments.held
        rows = lambda t: t[:, held].reshape(-1, *t.shape[2:])                  # noqa: E731
        seq = torch.stack([rows(s["first"]), rows(s["last"])], dim=1)          # (rows, 2): first, last
        entries, final, a, cont = mamba_cp._entries_by_prefix_scan(rows(s["S"]), rows(s["a"]), seq, s["init"], plan)
        dexit, dinit = mamba_cp._exit_grads_by_prefix_scan(rows(s["G"]), s["dfinal"][rank], a, cont, plan)
        errs = {"entries": rel_rms(entries, rows(want["entries"])), "final": rel_rms(final, want["final"]),
                "cont": float((cont.double() != rows(want["cont"])).sum()), "dexit": rel_rms(dexit, rows(want["dexit"])),
                "dinit": rel_rms(dinit, want["dinit"]) if plan.holds_first else float(dinit.abs().max())}
        finals = [torch.empty_like(final) for _ in range(world)]
        dist.all_gather(finals, final, group=group)
        errs["final identical on every rank"] = 0.0 if all(torch.equal(f, final) for f in finals) else float("inf")
        results[layout] = errs
    return errors_everywhere(results, world, group, device)


@pytest.mark.parametrize("world", [2, 5, 16])
def test_summary_scan_alone(world):
    """The prefix scan over W gloo ranks on random summaries (no kernels): within float32 of the
    oracle's float64 scan and its gradient."""
    world_check(world, scan_helper_errors, timeout=300)


@check("summary exchanges", FP32_BOUND)
def exchange_world_check(rank, world, group, device, gpu=False):
    """Every layout with both summary exchanges, documents across ranks, initial and final
    states, each against the oracle."""
    piece = 16
    base = dict(shape=CP_SMALL._replace(batch=1, seqlen=2 * piece), seed=1, dt_limit=(0.05, 2.0),
                seq_idx=[3, 9, 10, piece, piece + 5, 4 * piece + 7])
    results = {}
    # the all-gather also runs in test_cp_against_oracle (W = 2 to 4): here past it, at W = 8
    for exchange in ("all_gather", "scan") if world == 8 else ("scan",):
        for layout in mamba_cp.LAYOUTS:
            results[f"{layout} {exchange}"] = guarded(cp_case_errors, dict(base, layout=layout, exchange=exchange),
                                                      rank, world, group, device)
    return errors_everywhere(results, world, group, device)


@pytest.mark.parametrize("world", [3, 5, 8])
def test_cp_summary_exchanges(world):
    """summary_exchange="scan" on W gloo ranks (an odd W, one past a power of two, and one of
    three full rounds), every layout; "all_gather" too at W = 8. W = 2's scan runs in
    test_split_conv1d_scan_cp."""
    verdict = world_check(world, exchange_world_check)
    print({case: max(errs.values()) for case, errs in verdict.items()})


def test_exchange_cost_model():
    """The cost model (comm_bytes, modelled_seconds, chosen_exchange) against numbers worked by
    hand: a tiny shape (h = p = n = 2, g = 1, d_conv = 2, so conv_dim 8; batch 1, bf16, L = 16)
    term by term, a hand cost on a hand link, and "auto"'s choice at the record shape for W = 1 to
    1024 against the model's time written out here. Pure arithmetic: no kernel runs."""
    tiny = dict(nheads=2, headdim=2, dstate=2, ngroups=1, d_conv=2, dtype_bytes=2)
    bill = lambda path, W, **kw: mamba_cp.comm_bytes(path, W, 16, 1, **tiny, **kw)  # noqa: E731
    want = {   # (path, W, summary_exchange): {term: (bytes, messages)}, the agreement's all-gather apart
        ("none", 4, "all_gather"): {"fwd: halo all-gather": (3 * 8 * 4, 3), "fwd: summary all-gather": (3 * 10 * 4, 3),
                                    "bwd: G all-gather": (3 * 2 * 8 * 4, 3),
                                    "bwd: halo-gradient all-gather": (3 * 8 * 4, 3)},
        ("virtual", 4, "scan"): {"fwd: halos from the neighbours": (2 * 8 * 4, 1),
                                 "fwd: summary prefix rounds": (2 * 2 * 10 * 4, 2), "fwd: totals broadcast": (80, 4),
                                 "bwd: final-gradient all-reduce": (2 * 8 * 4 * 3 // 4, 4),
                                 "bwd: gradient prefix rounds": (160, 2), "bwd: second halves broadcast": (40, 2),
                                 "bwd: halo gradients to the neighbours": (64, 1)},
        ("a2a", 2, "all_gather"): {f"{s}: {d}{t} all-to-all": (nbytes, 1) for s, d in (("fwd", ""), ("bwd", "d"))
                                   for t, nbytes in (("xBC", 8 * (2 + 2 * 2) * 2), ("dt", 8 * 4), ("y", 8 * 2 * 2))},
        ("permute_p2p", 4, "all_gather"): {"fwd: xBC, dt to contiguous": (2 * 2 * (8 * 2 + 2 * 4), 1),
                                           "fwd: y to zigzag": (2 * 2 * 4 * 2, 1), "bwd: dy to contiguous": (32, 1),
                                           "bwd: dxBC, ddt to zigzag": (96, 1)},
    }
    for (path, W, exchange), terms in want.items():
        c = bill(path, W, summary_exchange=exchange)
        check = "fwd: validation all-gather"
        assert (c["terms"].pop(check), c["latencies"].pop(check)) == ((W - 1) * 8 * mamba_cp._agreement_ints(), W - 1)
        if path == "permute_p2p":     # the state passing of "none", then the pieces that move
            terms = dict(terms, **want[("none", 4, "all_gather")])
        assert {k: (v, c["latencies"][k]) for k, v in c["terms"].items()} == terms, (path, c)
        assert c["fwd"] + c["bwd"] == sum(v for v, _ in terms.values()) + (W - 1) * 8 * mamba_cp._agreement_ints()
    for path, pieces in (("none", 1), ("virtual", 2), ("a2a", 1)):          # documents: their ends gathered too
        c = bill(path, 2, documents=True)
        assert (c["terms"]["fwd: seq_idx ends all-gather"], c["latencies"]["fwd: seq_idx ends all-gather"]) == \
            (pieces * 2 * 8, 1), (path, c)
    assert bill("a2a", 4) is None and mamba_cp.comm_bytes("none", 4, 12, 1, **tiny) is None   # h % W, L % 2W
    cost = dict(terms={"fwd: a": 100, "bwd: b": 10}, latencies={"fwd: a": 3, "bwd: b": 1})
    assert mamba_cp.modelled_seconds(cost, mamba_cp.LinkModel(alpha=1.0, beta=0.5)) == 3 + 50 + 1 + 5
    # "auto" against the model's time written out here from comm_bytes' docstring, at the record
    # shape without documents: the exchange of the smaller time, the all-gather on a tie
    record = dict(b=1, h=64, p=64, n=128, d1=3, cd=64 * 64 + 2 * 8 * 128)

    def seconds(exchange, W, k, link, b, h, p, n, d1, cd):
        o, R, rows, S = W - 1, (W - 1).bit_length(), b * k, h * p * n
        if exchange == "all_gather":
            terms = [(o * rows * d1 * cd * 4, o), (o * rows * (S + h) * 4, o), (o * (rows + b) * S * 4, o),
                     (o * rows * d1 * cd * 4, o)]
        else:
            terms = [(rows * d1 * cd * 4, 1), (R * rows * (S + h) * 4, R), (rows * (S + h) * 4, k * R),
                     (2 * o * b * S * 4 // W, 2 * R), (R * rows * (S + h) * 4, R), (rows * d1 * cd * 4, 1)]
            terms += [(b * (S + h) * 4, R)] if k == 2 else []
        return sum(m * link.alpha + nbytes * link.beta for nbytes, m in terms)

    previous = mamba_cp.set_link_model("nvlink")
    try:
        first_scan = {}
        for link, layout in itertools.product(("nvlink", "inter_node"), ("none", "virtual")):
            mamba_cp.set_link_model(link)
            k, model = (2 if layout == "virtual" else 1), mamba_cp.LINKS[link]
            want = ["scan" if seconds("scan", W, k, model, **record) < seconds("all_gather", W, k, model, **record)
                    else "all_gather" for W in range(1, 1025)]
            picks = [mamba_cp.chosen_exchange("auto", W, layout, 1, (64, 64, 128), record["cd"], 4) for W in range(1, 1025)]
            assert picks == want, (link, layout)
            first_scan[link, layout] = want.index("scan") + 1
        # the crossovers the module's comment states, from this derivation
        assert first_scan == {("nvlink", "none"): 4, ("nvlink", "virtual"): 6, ("inter_node", "none"): 4,
                              ("inter_node", "virtual"): 4}, first_scan
        assert mamba_cp.chosen_exchange("all_gather", 64, "none", 1, (64, 64, 128), 6144, 4) == "all_gather"
    finally:
        mamba_cp.set_link_model(previous)


def cp_bad_input_messages(rank, world, group, device):
    """Each bad call must raise a ValueError on every rank, before any collective that could hang;
    once a signature is agreed, a bad later call of it raises on every rank too (a device-side
    assert: RuntimeError here), and a named ValueError under set_input_checks("always").
    Returns {case: (the argument to name, message or 'no error')} for this rank."""
    mamba_cp._AGREED.clear()                               # every case below is a signature's first call
    full, opts = fused_inputs(CP_SMALL._replace(seqlen=12).per_world(world), 0)
    local = {k: (mamba_cp.shard(v, rank, world, "none") if k in CP_ACTIVATIONS + ("seq_idx",) and v is not None
                 else v) for k, v in full.items()}

    def call(fn=mamba_cp.mamba_conv1d_ssd_cp, layout="none", exchange=None, **change):
        kw = dict(local, **change)
        return fn(kw["xBC"], kw["dt"], kw["conv_weight"], kw["conv_bias"], kw["dt_bias"], kw["A"], kw["D"],
                  opts["chunk_size"], headdim=opts["headdim"], ngroups=opts["ngroups"],
                  cp_group=kw.get("cp_group", group), load_balancing=layout, seq_idx=kw["seq_idx"],
                  initial_states=kw["initial_states"], **({} if exchange is None else dict(summary_exchange=exchange)))

    xBC, dt = local["xBC"], local["dt"]
    per_shard = (torch.arange(xBC.shape[1]) // 5).int().expand(2, -1)          # documents 0, 0, ... 2 on every rank
    split, split_opts = split_inputs(SPLIT_SMALL._replace(seqlen=12).per_world(world), 0, norm=True)
    split = {k: mamba_cp.shard(v, rank, world, "virtual") if k == "zxbcdt" else v for k, v in split.items()}

    def split_call(seq_idx):
        return mamba_cp.mamba_split_conv1d_scan_combined(**dict(split, seq_idx=seq_idx), **split_opts,
                                                         cp_group=group, load_balancing="virtual")
    per_shard_calls = {"none": lambda: call(seq_idx=per_shard), "virtual": lambda: call(layout="virtual",
                                                                                       seq_idx=per_shard),
                       "mixer entry, virtual": lambda: split_call(per_shard)}
    cases = {   # case: (the argument the message must name, the call)
        # rank 0 holds one token more than the others
        "shapes differ across ranks": ("xBC.shape[1]", lambda: call(xBC=xBC if rank else torch.cat([xBC, xBC[:, :1]], 1),
                                                           dt=dt if rank else torch.cat([dt, dt[:, :1]], 1))),
        "segment shorter than d_conv - 1": ("xBC", lambda: call(xBC=xBC[:, :2], dt=dt[:, :2])),
        "virtual segment shorter than d_conv - 1": ("xBC", lambda: call(layout="virtual", xBC=xBC[:, :4],
                                                                        dt=dt[:, :4])),
        "unknown load_balancing": ("load_balancing", lambda: call(layout="zigzag")),
        "unknown summary_exchange": ("summary_exchange", lambda: call(exchange="ring")),
        "summary_exchange differs across ranks": ("summary_exchange",
                                                  lambda: call(exchange="scan" if rank else "all_gather")),
        "cp_group is not a process group": ("cp_group", lambda: call(cp_group="world")),
        "a2a: nheads not divisible by W": ("dt", lambda: call(fn=mamba_cp.mamba_conv1d_ssd_a2a)),
        # every rank learns of rank 0's decreasing ids in the agreement step
        "seq_idx decreasing on one rank": ("seq_idx", lambda: call(seq_idx=bad_seq)),
        # ids numbered per shard (the usual mistake): non-decreasing on each rank, stepping down
        # where one rank's piece of the sequence ends and the next rank's begins
        **{f"seq_idx per shard, {where}": ("seq_idx", fn) for where, fn in per_shard_calls.items()},
    }
    good_seq = torch.zeros_like(xBC[..., 0], dtype=torch.int32)
    bad_seq = good_seq if rank else -torch.arange(xBC.shape[1], dtype=torch.int32).expand(2, -1)
    steady = {  # after a good call of each signature: the device-side check (ValueError on a rank whose signature is new)
        "later call: shapes differ across ranks": cases["shapes differ across ranks"],
        "later call: seq_idx decreasing on one rank": ("seq_idx", lambda: call(seq_idx=bad_seq)),
        **{f"later call: seq_idx per shard, {where}": ("seq_idx", fn) for where, fn in per_shard_calls.items()},
    }
    def run(fn):
        try:
            fn()
            return "no error"
        except ValueError as e:
            return "ValueError: " + str(e)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"[:300]

    out = {name: (argument, run(fn)) for name, (argument, fn) in cases.items()}
    try:                                                   # the control: these arguments unchanged run
        call()
        call(seq_idx=good_seq)
        call(layout="virtual", seq_idx=good_seq)
        split_call(good_seq)
        out["a good call"] = ("", "no error")
    except Exception as e:  # noqa: BLE001
        out["a good call"] = ("", f"{type(e).__name__}: {e}"[:300])
    for name, (argument, fn) in steady.items():
        out[name] = (argument, run(fn))
    previous = mamba_cp.set_input_checks("always")
    try:
        out["always: seq_idx decreasing on one rank"] = ("seq_idx", run(steady["later call: seq_idx decreasing on "
                                                                              "one rank"][1]))
    finally:
        mamba_cp.set_input_checks(previous)
    return out


def test_cp_bad_input_raises_on_every_rank():
    """W = 3 (nheads 4 is not divisible by 3 for the baseline): every bad call raises the same
    ValueError, naming the argument at fault, on every rank, and promptly (a hang would trip the
    spawn's timeout); the same call with good arguments runs. A bad later call of an agreed
    signature raises on every rank: a device-side assert on the ranks whose signature is agreed
    (RuntimeError), a ValueError where it is new; under set_input_checks("always") the
    ValueError everywhere."""
    messages = world_results(3, "cp_bad_input_messages", timeout=240)
    for case in messages[0]:
        seen = [m[case][1] for m in messages]
        if case == "a good call":
            assert all(m == "no error" for m in seen), seen
            continue
        if "per shard" in case:              # named on the first call, on the device later, on every rank
            want = "RuntimeError: mamba_cp: seq_idx steps down between two ranks' pieces" if case.startswith(
                "later") else "ValueError: seq_idx: got a decreasing step where the sequence passes between ranks 0 and 1"
            assert all(m.startswith(want) for m in seen), f"{case}: {seen}"
            continue
        if case.startswith("later call"):
            assert all(m.startswith(("RuntimeError: mamba_cp: the ranks", f"ValueError: {argument}: got "))
                       for argument, m in (r[case] for r in messages)), f"{case}: {seen}"
            assert any(m.startswith("RuntimeError") for m in seen), f"{case}: no rank checked on the device: {seen}"
            continue
        assert all(m.startswith(f"ValueError: {argument}: got ") for argument, m in (r[case] for r in messages)), \
            f"{case}: {seen}"
        assert len(set(seen)) == 1, f"{case}: ranks disagree: {seen}"


@gpu
def test_eager_cp_calls_make_no_host_sync_gpu():
    """A later eager call of every CP entry, forward and backward, never waits for the GPU: a world
    of one over NCCL with the agreement's all-gather forced on (a world of one skips it), under
    torch.cuda.set_sync_debug_mode("error"), with documents, both layouts and both exchanges. The
    first call of each signature reads the verdict on the host (a sync, before the check). The
    control: under set_input_checks("always") the same call is caught synchronising."""
    shape = CP_SMALL._replace(seqlen=128, d_nonssm=8)
    fused, fopts = fused_inputs(shape, 0, seq_idx=[50], device="cuda")
    split, sopts = split_inputs(shape, 0, norm=True, outproj="bias", seq_idx=[50], device="cuda")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    mamba_cp._CHECKS["world_of_one"] = True

    def call(fn, layout, **kw):
        if fn is mamba_cp.mamba_split_conv1d_scan_combined:
            kw = dict(split, **sopts, **kw, zxbcdt=split["zxbcdt"].detach().clone().requires_grad_(True))
            leaf = kw["zxbcdt"]
        else:
            kw = dict(fused, **fopts, **kw, xBC=fused["xBC"].detach().clone().requires_grad_(True))
            leaf = kw["xBC"]
        out = fn(**kw, cp_group=dist.group.WORLD, load_balancing=layout)
        out.float().square().sum().backward()
        return leaf.grad

    calls = {f"{fn.__name__} {layout} {kw}": (fn, layout, kw)
             for fn, kws in ((mamba_cp.mamba_conv1d_ssd_cp, [{"summary_exchange": "all_gather"},
                                                            {"summary_exchange": "scan"}]),
                             (mamba_cp.mamba_split_conv1d_scan_combined, [{}]), (mamba_cp.mamba_conv1d_ssd_a2a, [{}]))
             for layout in ("none", "virtual") for kw in kws}
    seen = {}
    try:
        for name, (fn, layout, kw) in list(calls.items()) + [("control", calls[next(iter(calls))])]:
            call(fn, layout, **kw)                                  # the signature's first call
            torch.cuda.synchronize()
            mamba_cp.set_input_checks("always" if name == "control" else "first")
            torch.cuda.set_sync_debug_mode("error")
            try:
                call(fn, layout, **kw)
                seen[name] = "no sync"
            except RuntimeError as e:
                seen[name] = str(e)[:200]
            finally:
                torch.cuda.set_sync_debug_mode("default")
                mamba_cp.set_input_checks("first")
        torch.cuda.synchronize()
    finally:
        mamba_cp._CHECKS["world_of_one"] = False
        dist.destroy_process_group()
    control = seen.pop("control")
    assert "synchroniz" in control, f"the control was not caught: {control}"
    assert all(v == "no sync" for v in seen.values()), seen


# ---------------------------------------------------------------------------------------------
# mamba_cp section 2: the causal conv1d with its halo, against causal_conv1d_reference. The
# reference has no halo: it runs on [halo, xBC] (ids [halo_seq, seq_idx]) and its first d-1
# outputs are dropped; the halo's gradient is the gradient w.r.t. those first d-1 rows.
# ---------------------------------------------------------------------------------------------

def conv_reference(inp, dout):
    """float64 output and gradients (dxBC, dhalo, dweight, dbias) of sum(out * dout)."""
    d = inp["weight"].shape[1]
    x = inp["xBC"].detach().double().requires_grad_()
    w = inp["weight"].detach().double().requires_grad_()
    bias = inp["bias"].detach().double().requires_grad_() if inp["bias"] is not None else None
    seq = inp["seq_idx"]
    if inp["halo"] is not None:
        h = inp["halo"].detach().double().requires_grad_()
        full = torch.cat([h, x], dim=1)                                   # (b, d-1+l, dim)
        seq_full = torch.cat([inp["halo_seq"], seq], dim=1) if seq is not None else None
        out = causal_conv1d_reference(full, w, bias, seq_full)[:, d - 1:]
    else:
        h = None
        out = causal_conv1d_reference(x, w, bias, seq)
    leaves = [t for t in (x, h, w, bias) if t is not None]
    grads = iter(torch.autograd.grad((out * dout.double()).sum(), leaves))
    return out, tuple(next(grads) if t is not None else None for t in (x, h, w, bias))


def conv_check(inp, dout):
    out = mamba_cp.conv1d_fwd(**inp)
    got = mamba_cp.conv1d_bwd(dout, **inp)
    want_out, want = conv_reference(inp, dout)
    assert out.dtype == inp["xBC"].dtype and out.is_contiguous()
    errs = {"out": rel_rms(out, want_out)}
    for name, g, w in zip(("dxBC", "dhalo", "dweight", "dbias"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.shape == w.shape, name
            errs[name] = rel_rms(g, w)
    assert got[0].dtype == inp["xBC"].dtype
    assert all(e < FP32_BOUND for e in errs.values()), errs
    return out, got


# Document starts per batch row, in shard positions (negative: inside the halo; starts past the
# shard's end are dropped). "mixed": a start inside the halo, a one-token document at 4, and a
# start at 1 so that taps straddle it; "mixed2": a start exactly at 0, and starts at 2 and 3 (a
# one-token document at 2); "one-doc": ids given, a single document everywhere.
CONV_STARTS = {
    "none": None,
    "one-doc": [[], []],
    "mixed": [[-1, 4, 5], [1]],
    "mixed2": [[0], [2, 3]],
}


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("halo", [False, True])
@pytest.mark.parametrize("l,starts", [(1, "mixed"), (3, "mixed"), (3, "mixed2"), (50, "mixed"),
                                      (50, "mixed2"), (77, "mixed"), (77, "mixed2")])
def test_conv_matches_reference(d, l, halo, starts):
    bias = (d + l + halo + len(starts)) % 2 == 1   # half the cases with bias, spread over the grid
    inp, dout = conv_inputs(CONV_SMALL._replace(seqlen=l, d_conv=d), d * 100 + l, halo=halo, bias=bias,
                            starts=CONV_STARTS[starts])
    conv_check(inp, dout)


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("halo", [False, True])
def test_conv_without_documents(d, halo):
    bias = (d + halo) % 2 == 1      # each of halo / no halo seen with and without bias
    inp, dout = conv_inputs(CONV_SMALL._replace(d_conv=d), d, halo=halo, bias=bias, starts=None)
    conv_check(inp, dout)


@pytest.mark.parametrize("starts", [[[-2], [-1]], [[0], [0]], [[1], [2]], [[3, 4], [1, 2]], [[], []]],
                         ids=["in-halo", "at-0", "at-1-2", "one-token", "one-doc"])
def test_conv_document_boundaries(starts):
    """Each kind of boundary alone, d=4 with a halo: the halo's own ids matter."""
    inp, dout = conv_inputs(CONV_SMALL._replace(seqlen=50), 5, halo=True, bias=True, starts=starts)
    conv_check(inp, dout)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_conv_non_contiguous(d):
    inp, dout = conv_inputs(CONV_SMALL._replace(d_conv=d), halo=True, bias=True, starts=CONV_STARTS["mixed"],
                            strided=True)
    assert not inp["xBC"].is_contiguous()
    inp["halo"] = inp["halo"].transpose(1, 2).contiguous().transpose(1, 2)   # channel-strided halo
    inp["weight"] = inp["weight"].t().contiguous().t()                          # tap-major weight
    dout = dout.transpose(0, 1).contiguous().transpose(0, 1)
    inp["seq_idx"] = inp["seq_idx"].long()                                      # int64 ids, int32 halo ids
    conv_check(inp, dout)


def test_conv_small_tiles_many_programs(tuned):
    """Two runs a program, five programs a row, channel tiles smaller than the channels, and an
    unroll that does not divide a run's steps: windows and partial du cross run and program
    edges, channel masks, the extra steps masked, partial sums folded across programs."""
    launch = mamba_cp.ConvLaunch(strips=2, channels=32, tokens=9, unroll=2, warps=1)
    tuned(dataclasses.replace(mamba_cp.tuning(), conv_fwd=launch, conv_bwd=launch))
    assert mamba_cp._conv_launch(3 + 77, 40, 1, launch, True, True, True, True)[0][0] == 5   # programs a row
    inp, dout = conv_inputs(CONV_SMALL, 3, halo=True, bias=True, starts=CONV_STARTS["mixed"])
    conv_check(inp, dout)


def test_conv_gpu_tiles(tuned):
    """The GPU's conv launches (one strip a program, its channel tile and unroll) in the
    interpreter. So few programs would be one thin wave on a GPU: the strips halve down to the
    unroll, 8 tokens, and a row of 77 tokens and a halo spans 10 programs each way."""
    tuned("gpu")
    for launch, tokens in ((mamba_cp.tuning().conv_fwd, 77), (mamba_cp.tuning().conv_bwd, 3 + 77)):
        grid, strip, _ = mamba_cp._conv_launch(tokens, 40, 1, launch, True, True, True, True)
        assert (grid, strip) == ((10, 1, 1), 8)
    inp, dout = conv_inputs(CONV_SMALL, 3, halo=True, bias=True, starts=CONV_STARTS["mixed"])
    conv_check(inp, dout)


def test_conv_documents_at_program_edges(tuned):
    """Strips of 8 tokens, one a program, and documents that start where a program's reads
    cross its edges: just before a forward strip (token 7: the window of the strip from 8),
    just past a backward strip's last du token (30 and 21: the g it reads ahead), and inside
    the halo: each program's own tokens are of one document, the tokens it reads are not."""
    launch = mamba_cp.ConvLaunch(strips=1, channels=32, tokens=8, unroll=2, warps=1)
    tuned(dataclasses.replace(mamba_cp.tuning(), conv_fwd=launch, conv_bwd=launch))
    inp, dout = conv_inputs(CONV_SMALL._replace(seqlen=40), 7, halo=True, bias=True, starts=[[7, 30], [-2, 21]])
    conv_check(inp, dout)


def test_conv_deterministic(tuned):
    """Two calls, bitwise alike, with four runs a program and several programs a row. On a GPU
    programs run at once; in the interpreter, one at a time, this catches reads of memory that
    no program wrote (the partial sums are torch.empty)."""
    launch = mamba_cp.ConvLaunch(strips=4, channels=16, tokens=5, unroll=2, warps=1)
    tuned(dataclasses.replace(mamba_cp.tuning(), conv_fwd=launch, conv_bwd=launch))
    inp, dout = conv_inputs(CONV_SMALL, 11, halo=True, bias=True, starts=CONV_STARTS["mixed"])
    a, b = mamba_cp.conv1d_bwd(dout, **inp), mamba_cp.conv1d_bwd(dout, **inp)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(mamba_cp.conv1d_fwd(**inp), mamba_cp.conv1d_fwd(**inp))


def test_conv_need_dhalo_false():
    inp, dout = conv_inputs(CONV_SMALL._replace(seqlen=50), halo=True, bias=False, starts=None)
    dx, dhalo, dw, db = mamba_cp.conv1d_bwd(dout, **inp, need_dhalo=False)
    assert dhalo is None and db is None
    _, want = conv_reference(inp, dout)
    assert rel_rms(dx, want[0]) < FP32_BOUND and rel_rms(dw, want[2]) < FP32_BOUND


def test_conv_bad_inputs():
    """Each bad argument is refused with a ValueError that names it; the call unchanged runs."""
    inp, dout = conv_inputs(CONV_SMALL._replace(seqlen=10), halo=True, bias=True, starts=CONV_STARTS["mixed"])
    mamba_cp.conv1d_bwd(dout, **inp)                                  # the control
    bad = [
        ("weight", dict(weight=inp["weight"][:, :1])),                # d_conv 1
        ("weight", dict(weight=inp["weight"][:30])),                  # wrong dim
        ("halo", dict(halo=inp["halo"][:, :2])),                      # halo not d-1 rows
        ("halo_seq", dict(halo_seq=None)),                            # halo + seq_idx need halo_seq
        ("seq_idx", dict(seq_idx=inp["seq_idx"].float())),            # ids must be integers
        ("halo_seq", dict(seq_idx=None)),                             # halo_seq without seq_idx
        ("xBC", dict(xBC=inp["xBC"][0])),                             # 2 dims
        ("bias", dict(bias=inp["bias"][:5])),
    ]
    for name, change in bad:
        with pytest.raises(ValueError, match=rf"^{name}: got .*, expected "):
            mamba_cp.conv1d_fwd(**{**inp, **change})
    with pytest.raises(ValueError, match="^dout: got"):
        mamba_cp.conv1d_bwd(dout[:, :5], **inp)


# ---------------------------------------------------------------------------------------------
# mamba_cp sections 1, 11 and 15: the fused conv1d + SSD with context parallelism, and the
# all-to-all baseline, rank by rank against the oracle on the full sequence. Every rank builds
# the full inputs from one seed, runs the float64 oracle on the whole sequence, and compares
# its local output shard, its local input gradients, and the parameter gradients summed over
# the group.
# ---------------------------------------------------------------------------------------------

def a2a_shape(shape, world):
    """shape with its heads rounded up to a multiple of W (the baseline splits the heads over the
    ranks) and as many groups as both head counts share."""
    nheads = -(-shape.nheads // world) * world
    return shape._replace(nheads=nheads, ngroups=math.gcd(nheads, shape.ngroups))


def straddling_shape(shape, world):
    """shape with the fewest heads, and a number of groups, for which the baseline hands some rank
    heads of more than one group but not whole groups, so each local head gets its own copy of its
    group (the last branch of mamba_cp._a2a_heads); None in a world of one, where none can."""
    for nheads in range(world, 8 * world + 1, world):
        for ngroups in range(1, nheads + 1):
            if nheads % ngroups == 0 and ngroups % world and (nheads // ngroups) % (nheads // world):
                return shape._replace(nheads=nheads, ngroups=ngroups)
    return None


def cp_cases(world, gpu=False):
    """The CP checks for a world of W ranks: every layout with every option (documents that
    cross rank boundaries, initial and final states, dt_limit, ragged lengths), plain runs, and
    the all-to-all baseline (its heads a multiple of W: a2a_shape). A case that cannot be built
    at this W is Skipped."""
    # in the interpreter a case's time grows with W (every rank runs its kernels on one CPU):
    # batch rows are independent of W, so two rows up to W = 2, one beyond
    base = (dict(shape=CP_RECORD, dtype=torch.bfloat16) if gpu else
            dict(shape=CP_SMALL if world <= 2 else CP_SMALL._replace(batch=1)))
    piece = base["shape"].seqlen // 2
    # document starts: exactly at a segment boundary (piece), many short documents inside the
    # first piece, one document spanning three pieces (from piece + 5 to past 3 * piece)
    docs = [3, 9, 10, piece, piece + 5, 4 * piece + 7] if world > 1 else [3, 9, 10, piece, piece + 5]
    # On CPUs at W = 2 to 4 (the pytest worlds; CI's time) what does not depend on W runs at one
    # W only: the plain runs and the conv without activation at W = 2, growth at W = 4; the
    # permute layouts, which compute as "none" once permuted (the permutation itself is checked
    # at every W, below), both at W = 2 and one each at W = 3 and 4. Other worlds (torchrun) run
    # every case. On GPUs every case compiles its own kernel variants: the full ones.
    permuted = {2: ("permute_p2p", "permute_a2a"), 3: ("permute_p2p",), 4: ("permute_a2a",)}
    cases = []
    for layout in mamba_cp.LAYOUTS:
        if not gpu and layout.startswith("permute") and layout not in permuted.get(world, mamba_cp.LAYOUTS):
            continue
        # plain runs (no D per channel, no initial state) for the two layouts that compute apart
        if not gpu and world not in (3, 4) and layout in ("none", "virtual"):
            cases.append(dict(base, name=f"{layout} plain", layout=layout, D="h", initial_states=False))
        cases.append(dict(base, name=f"{layout} all options", layout=layout, seq_idx=docs,
                          dt_limit=(0.05, 2.0), seed=1))
        if layout in ("none", "virtual"):   # the baseline reads every zigzag layout alike
            cases.append(dict(base, name=f"a2a {layout}", layout=layout, path="a2a", seq_idx=docs, seed=2,
                              shape=a2a_shape(base["shape"], world), dt_limit=(0.05, 2.0)))
    # growth (A > 0): exponents of positive sign through the summaries and the scan
    if gpu or world not in (2, 3):
        cases.append(dict(base, name="virtual growth", layout="virtual", seq_idx=docs, growth="pos_A_e8", seed=4))
    if not gpu and world not in (3, 4):  # the conv without its SiLU (activation=None)
        cases.append(dict(base, name="none, conv without activation", layout="none", seq_idx=docs, activation=None,
                          seed=5))
    straddling = straddling_shape(base["shape"], world)
    cases.append(dict(base, name="a2a none, heads straddle groups", layout="none", path="a2a", shape=straddling,
                      seed=3) if straddling else
                 dict(name="a2a none, heads straddle groups", skipped="a world of one holds every head"))
    return cases


@check("CP against the oracle", FP32_BOUND, BF16_BOUND, alone=True)
def cp_world_check(rank, world, group, device, gpu=False):
    """Run every CP case on this rank; returns {case: {tensor: error}} with errors already
    reduced (MAX) over the group, so every rank reaches the same verdict."""
    results = {case["name"]: Skipped(case["skipped"]) if "skipped" in case else
               guarded(cp_case_errors, case, rank, world, group, device) for case in cp_cases(world, gpu)}
    results["zigzag permutation"] = guarded(cp_permutation_errors, rank, world, group, device)
    return errors_everywhere(results, world, group, device)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_against_oracle(world):
    """Every layout, the baseline, documents across rank boundaries, initial and final states,
    ragged lengths, and the zigzag permutation each way, for W ranks on gloo (cp_cases: which
    cases run at which W). (A world of one:
    torchrun runs this check again in one on each rank; here the single-device, mixer-entry,
    loss-parity and compile tests call the CP entries without a group.)"""
    verdict = world_check(world, cp_world_check)
    print(f"W={world}: largest relative RMS per tensor: {largest(verdict)}")


# ---------------------------------------------------------------------------------------------
# mamba_cp sections 12 and 14: mamba_split_conv1d_scan_combined. zxbcdt = [z0 | x0 | z | xBC | dt] in,
# the gated (or gated-RMSNorm'd, optionally out-projected) output out, against the float64
# oracle on the whole sequence, rank by rank.
# ---------------------------------------------------------------------------------------------

SPLIT_OPTIONS = {
    "gate": dict(),
    "norm": dict(norm=True),
    "norm_after_gate": dict(norm=True, norm_before_gate=False),
    "no_swiglu_no_activation_D_h": dict(shape=SPLIT_SMALL._replace(d_nonssm=0), activation=None, D="h"),
    "outproj_bias_documents": dict(norm=True, outproj="bias", seq_idx=[5, 30]),
    "outproj_dt_limit_no_init": dict(outproj="weight", dt_limit=(0.05, 2.0), initial_states=False),
    # the transformers example's default layout in a world of one: the whole sequence one piece,
    # computed as one segment, of any length (odd here)
    "virtual_documents": dict(layout="virtual", norm=True, seq_idx=[5, 30], shape=SPLIT_SMALL._replace(seqlen=37)),
}


@pytest.mark.parametrize("name", list(SPLIT_OPTIONS))
def test_split_conv1d_scan_single_device(name):
    errs = split_case_errors(dict(shape=SPLIT_SMALL, layout="none", seed=1) | SPLIT_OPTIONS[name], 0, 1, None, DEVICE)
    expect({name: errs}, FP32_BOUND)


def graphed_by_torch(checkpointed=False, **call):
    """mamba_split_conv1d_scan_combined(**call) as a trainer runs a layer it graphed with
    torch.cuda.make_graphed_callables (README "CUDA graphs"): captured, after torch's eager
    warm-up calls, on copies of the tensors, then replayed with the call's own (so their values
    are copied in, and the gradients flow back to them); checkpointed: inside torch.utils.checkpoint
    (not reentrant), as examples/train_cp.py wraps each decoder layer."""
    names = [k for k, v in call.items() if isinstance(v, torch.Tensor)]
    options = {k: v for k, v in call.items() if k not in names}

    def layer(*tensors):
        return tuple(mamba_cp.mamba_split_conv1d_scan_combined(**dict(zip(names, tensors)), **options))

    copies = tuple(call[k].detach().clone().requires_grad_(call[k].requires_grad) for k in names)
    graphed, tensors = torch.cuda.make_graphed_callables(layer, copies), [call[k] for k in names]
    if checkpointed:
        return torch.utils.checkpoint.checkpoint(graphed, *tensors, use_reentrant=False)
    return graphed(*tensors)


@gpu
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("name", ["gate", "outproj_bias_documents"])
def test_split_graphed_by_torch_gpu(name, checkpointed):
    """The mixer entry inside torch.cuda.make_graphed_callables, with and without activation
    checkpointing around it: the replays, fed new inputs, match the oracle, gradients included."""
    path = functools.partial(graphed_by_torch, checkpointed=checkpointed)
    errs = split_case_errors(dict(shape=SPLIT_SMALL, layout="none", seed=8, path=path) | SPLIT_OPTIONS[name],
                             0, 1, None, DEVICE)
    expect({f"{name}, checkpointed {checkpointed}": errs}, FP32_BOUND)


@pytest.mark.parametrize("launch", [dict(programs=2), dict(partials=3)])
def test_split_gate_norm_programs_loop(tuned, launch):
    """Few programs, or few rows of the norm weight's partial gradients, so each program walks
    several row blocks and sums that gradient over them (the GPU's plan at long sequences, and
    with one norm group of all channels)."""
    tuned(dataclasses.replace(mamba_cp.tuning(), norm_bwd=mamba_cp.tuning().norm_bwd._replace(**launch)))
    errs = split_case_errors(dict(shape=SPLIT_SMALL, layout="none", seed=6, norm=True), 0, 1, None, DEVICE)
    expect({f"norm, {launch}": errs}, FP32_BOUND)


def test_split_gpu_tiles(tuned):
    """The GPU's tuning in the interpreter for the whole mixer entry: its conv, SSD and gated
    RMSNorm tiles (its forward 4096 elements a tile: rows of several tokens; its backward one
    token row a tile)."""
    tuned("gpu")
    errs = split_case_errors(dict(shape=SPLIT_SMALL, layout="none", seed=7, norm=True), 0, 1, None, DEVICE)
    expect({"GPU tuning, norm": errs}, FP32_BOUND)


@check("mamba_split_conv1d_scan_combined", FP32_BOUND, BF16_BOUND)
def split_world_check(rank, world, group, device, gpu=False):
    """Every layout with every option combined (documents across rank boundaries), and the z gate
    alone (no SwiGLU channels: the output kernel writes it) without the conv's activation (CPU);
    errors reduced (MAX) over the group. gpu: bf16 at the shape of record."""
    base = dict(shape=SPLIT_RECORD, dtype=torch.bfloat16) if gpu else dict(shape=SPLIT_SMALL)
    piece = base["shape"].seqlen // 2
    everything = dict(norm=True, norm_before_gate=False, outproj="bias", D="h",
                      seq_idx=[3, piece, piece + 5, 3 * piece + 2], dt_limit=(0.05, 2.0))
    cases = [dict(base, layout=layout, seed=2, name=f"{layout} all options", **everything)
             for layout in mamba_cp.LAYOUTS]
    cases.append(dict(base, layout="virtual", seed=2, name="virtual all options, scan exchange", exchange="scan",
                      **everything))
    if not gpu:
        cases.append(dict(base, shape=SPLIT_SMALL._replace(d_nonssm=0), layout="virtual", seed=3,
                          name="virtual gate folded, no activation", activation=None))
    results = {case["name"]: guarded(split_case_errors, case, rank, world, group, device) for case in cases}
    return errors_everywhere(results, world, group, device)


@pytest.mark.parametrize("world", [2, 3])
def test_split_conv1d_scan_cp(world):
    world_check(world, split_world_check)


def test_split_conv1d_scan_bad_inputs():
    """Each bad argument is refused with a ValueError that names it; the call unchanged runs."""
    full, opts = split_inputs(SPLIT_SMALL, 0, norm=True, outproj="bias", device=DEVICE)
    call = dict(full, **opts)
    mamba_cp.mamba_split_conv1d_scan_combined(**call)                  # the control
    cases = {
        "zxbcdt": dict(zxbcdt=full["zxbcdt"][..., 1:]),                         # no d_nonssm fits
        "rmsnorm_weight": dict(rmsnorm_weight=full["rmsnorm_weight"][:-1]),
        "conv1d_weight": dict(ngroups=3),          # (the norm's groups always divide dim: ngroups divides nheads)
        "outproj_weight": dict(outproj_weight=full["outproj_weight"][:, 1:]),
        "outproj_bias": dict(outproj_weight=None),
        "activation": dict(activation="gelu"),
        "headdim": dict(D=full["D"][:, 0], headdim=None),
        "summary_exchange": dict(summary_exchange="ring"),
    }
    for name, change in cases.items():
        with pytest.raises(ValueError, match=rf"^{name}: got .*, expected "):
            mamba_cp.mamba_split_conv1d_scan_combined(**dict(call, **change))
    l = full["zxbcdt"].shape[1]                      # a single device has no cp_group to blame
    for layout in ("none", "virtual"):               # virtual: the step down where the two halves meet
        with pytest.raises(ValueError, match=r"^seq_idx: got a decreasing step, expected non-decreasing"):
            mamba_cp.mamba_split_conv1d_scan_combined(**dict(call, seq_idx=(torch.arange(l, device=DEVICE) < l // 2)
                                                             .int().expand(2, -1).contiguous(),
                                                             load_balancing=layout))


# ---------------------------------------------------------------------------------------------
# torch.compile: every public entry point, default and fullgraph=True, forward and backward,
# against the same call eager. The kernels run inside opaque custom ops, so on CPUs the
# compiler runs them in the interpreter too; results must be bitwise those of eager (but for
# the gradients of the bf16 GPU case, whose loss is compiled too).
# ---------------------------------------------------------------------------------------------

def outputs_and_grads(fn, leaves, seed=0):
    """{"output i" or "gradient j": tensor} of fn on fresh copies of leaves: its outputs, and the
    gradients of every leaf under the same random weights of every output."""
    ins = [t.detach().clone().requires_grad_(True) for t in leaves]
    outs = fn(*ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    w = draw(None, seed, device=outs[0].device, weights={str(i): o.shape for i, o in enumerate(outs)})
    weights = [w[str(i)].to(o.dtype) for i, o in enumerate(outs)]
    pulled = [(o, w) for o, w in zip(outs, weights) if o.requires_grad]
    outs_pulled, weights_pulled = zip(*pulled)
    grads = torch.autograd.grad(outs_pulled, ins, weights_pulled)
    return {**{f"output {i}": o.detach() for i, o in enumerate(outs)},
            **{f"gradient {j}": g for j, g in enumerate(grads)}}


def compiled_vs_eager(fn, leaves, fullgraph, seed=0, eager=None):
    """{"output i" or "gradient j": error} of fn compiled (inductor, the default) against fn
    eager (outputs_and_grads; eager: those results, if already computed), 0.0 where bitwise
    equal, else the relative RMS."""
    eager = outputs_and_grads(fn, leaves, seed) if eager is None else eager
    compiled = outputs_and_grads(torch.compile(fn, fullgraph=fullgraph), leaves, seed)
    assert eager.keys() == compiled.keys()
    return {k: 0.0 if torch.equal(eager[k], compiled[k]) else rel_rms(compiled[k], eager[k]) for k in eager}


def compile_cases(device, world=1, group=None, rank=0):
    """(name, fn, leaves) for each entry point: the single-device SSD with every option and
    varlen states, and the fused core on every layout and the all-to-all baseline."""
    # a short one (three chunks, two segments): the cases check that compiling changes no bit
    inputs = ssd_inputs(SMALL._replace(seqlen=45, headdim=8, dstate=8), 15, **OPTIONS["all"], device=device)
    seq, chunk = inputs["seq_idx"], inputs["chunk_size"]
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

    def ssd(x, dt, A, B, C, D, z, dt_bias, init):
        return mamba_cp.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias,
                                                  initial_states=init, seq_idx=seq, dt_softplus=True,
                                                  dt_limit=(0.05, 1.5), return_final_states=True)

    cases = [("mamba_chunk_scan_combined", ssd, [inputs[k] for k in names])] if world == 1 else []
    if world == 1:
        v = ssd_inputs(Shape(batch=1, seqlen=45, nheads=2, headdim=8, ngroups=1, dstate=8, chunk=16), 16,
                       seq_idx=[20], device=device)
        cu = torch.tensor([0, 20, 45], dtype=torch.int32, device=device)

        def varlen(x, dt, B, C):
            y, states = mamba_cp.mamba_chunk_scan_combined(x, dt, v["A"], B, C, 16, seq_idx=v["seq_idx"],
                                                           cu_seqlens=cu, return_varlen_states=True)
            return y, states.detach()

        cases.append(("mamba_chunk_scan_combined varlen", varlen, [v[k] for k in ("x", "dt", "B", "C")]))
    starts = [3, 40, 74] if world > 1 else [3, 40, 73]          # 74: the first rank boundary (of 74 W tokens)
    cp_names = ("xBC", "dt", "conv_weight", "conv_bias", "dt_bias", "A", "D", "initial_states")
    paths = [("cp", layout) for layout in mamba_cp.LAYOUTS] if world > 1 else [("cp", "none")]
    paths.append(("a2a", "none"))
    for path, layout in paths:
        shape = a2a_shape(CP_SMALL, world) if path == "a2a" else CP_SMALL
        full, opts = fused_inputs(shape.per_world(world), 17, seq_idx=starts, device=device)
        local = {k: mamba_cp.shard(v, rank, world, layout) if k in CP_ACTIVATIONS + ("seq_idx",) else v
                 for k, v in full.items()}
        entry = mamba_cp.mamba_conv1d_ssd_cp if path == "cp" else mamba_cp.mamba_conv1d_ssd_a2a

        def core(xBC, dt, w, b, dt_bias, A, D, init, entry=entry, layout=layout, seq=local["seq_idx"], opts=opts):
            return entry(xBC, dt, w, b, dt_bias, A, D, opts["chunk_size"], headdim=opts["headdim"],
                         ngroups=opts["ngroups"], cp_group=group, load_balancing=layout, seq_idx=seq,
                         initial_states=init, return_final_states=True)

        cases.append((f"{'mamba_conv1d_ssd_' + path} {layout}", core, [local[k] for k in cp_names]))
    split, sopts = split_inputs(SPLIT_SMALL.per_world(world), 20, norm=True, outproj="bias",
                                seq_idx=[3, 40] if world > 1 else [3, 30],
                                device=device)
    for layout in ("none", "virtual") if world > 1 else ("none",):
        local = {k: mamba_cp.shard(v, rank, world, layout) if k in ("zxbcdt", "seq_idx") else v
                 for k, v in split.items()}

        def mixer(*leaves, layout=layout, seq=local["seq_idx"]):
            return mamba_cp.mamba_split_conv1d_scan_combined(
                *leaves[:6], initial_states=leaves[6], rmsnorm_weight=leaves[7], outproj_weight=leaves[8],
                outproj_bias=leaves[9], seq_idx=seq, return_final_states=True, cp_group=group, load_balancing=layout,
                **sopts)

        cases.append((f"mamba_split_conv1d_scan_combined {layout}", mixer, [local[k] for k in SPLIT_LEAVES]))
    return cases


def compile_errors(device, world=1, group=None, rank=0):
    """{case: {index: error}} of every compile case, default and fullgraph=True (on CPUs several
    ranks compile fullgraph=True alone: both modes trace the same graph where nothing breaks it,
    and one process runs both)."""
    errs = {}
    for name, fn, leaves in compile_cases(device, world, group, rank):
        try:                                           # eager once, against both compilations
            eager, failed = outputs_and_grads(fn, leaves), None
        except Exception as e:  # noqa: BLE001
            eager, failed = None, {"exception (eager): " + repr(e)[:300]: float("inf")}
        for fullgraph in (False, True) if world == 1 or device != "cpu" else (True,):
            errs[f"{name}, fullgraph={fullgraph}"] = failed or guarded(compiled_vs_eager, fn, leaves, fullgraph,
                                                                       eager=eager)
    return errs


def test_torch_compile_single_process():
    """Every entry point in one process (the fused core and the baseline without a group)."""
    expect(compile_errors(DEVICE), compile_world_check.check.bound, "compiled against eager")


@gpu
def test_torch_compile_fused_core_bf16():
    """The call that crashed under inductor (an illegal memory access): the fused core in a world
    of one, bf16 (1, 2048, 768), a loss computed inside the compiled function. The output must be
    bitwise eager's; the gradients pass through that loss, which inductor computes in an order of
    its own, so they are held to the bf16 bound instead."""
    p, ng = 64, 2
    full, _ = fused_inputs(Shape(batch=1, seqlen=2048, nheads=8, headdim=p, ngroups=ng, dstate=64, chunk=128), 18,
                           D="h", initial_states=False, dtype=torch.bfloat16, device="cuda")
    leaves = [full["xBC"], full["dt"].bfloat16()] + [full[k] for k in ("conv_weight", "conv_bias", "dt_bias", "A", "D")]

    def step(xBC, dt, w, b, dt_bias, A, D):
        y = mamba_cp.mamba_conv1d_ssd_cp(xBC, dt, w, b, dt_bias, A, D, 128, headdim=p, ngroups=ng)
        return y, y.float().square().mean()

    for fullgraph in (False, True):
        errs = compiled_vs_eager(step, leaves, fullgraph)
        print(f"fullgraph={fullgraph}: {errs}")
        assert errs["output 0"] == 0.0 and all(e <= BF16_BOUND for e in errs.values()), errs


# bound 0: bitwise. Everything the entry points compute runs inside their custom ops.
@check("torch.compile", 0.0)
def compile_world_check(rank, world, group, device, gpu=False):
    """The compile cases of a world of ranks, the errors reduced (MAX) over the group."""
    return errors_everywhere(compile_errors(device, world, group, rank), world, group, device)


def test_torch_compile_two_ranks():
    """Every layout of the fused core and the baseline, compiled on two gloo ranks."""
    world_check(2, compile_world_check, timeout=900)


# ---------------------------------------------------------------------------------------------
# Vendoring, run: a tiny Mamba2 mixer built around the fused CP core trains a few steps with
# W = 2 and with W = 1 from the same seed and data; the losses must agree step by step (the
# loss-parity check a training user runs before trusting CP).
# ---------------------------------------------------------------------------------------------


class TinyMamba2Mixer(torch.nn.Module):
    """Input projection -> fused conv1d + SSD (state-passing CP) -> gated RMSNorm -> output
    projection, as in a Mamba2 block. Everything but the core is per token, so it needs no CP."""

    def __init__(self, d_model=16, nheads=4, headdim=8, ngroups=2, dstate=8, d_conv=4, chunk=16):
        super().__init__()
        self.nheads, self.headdim, self.ngroups, self.chunk = nheads, headdim, ngroups, chunk
        d_inner, conv_dim = nheads * headdim, nheads * headdim + 2 * ngroups * dstate
        self.in_proj = torch.nn.Linear(d_model, d_inner + conv_dim + nheads, bias=False)   # [z | xBC | dt]
        self.conv_weight = torch.nn.Parameter(torch.randn(conv_dim, d_conv) * 0.3)
        self.conv_bias = torch.nn.Parameter(torch.zeros(conv_dim))
        self.dt_bias = torch.nn.Parameter(torch.log(torch.expm1(torch.rand(nheads) * 0.1 + 0.01)))
        self.A_log = torch.nn.Parameter(torch.log(torch.rand(nheads) * 3 + 1))
        self.D = torch.nn.Parameter(torch.ones(nheads))
        self.norm_weight = torch.nn.Parameter(torch.ones(d_inner))
        self.out_proj = torch.nn.Linear(d_inner, d_model, bias=False)

    def forward(self, u, cp_group=None, load_balancing="none"):
        d_inner = self.nheads * self.headdim
        z, xBC, dt = self.in_proj(u).split([d_inner, self.conv_weight.shape[0], self.nheads], dim=-1)
        y = mamba_cp.mamba_conv1d_ssd_cp(xBC, dt, self.conv_weight, self.conv_bias, self.dt_bias,
                                         -torch.exp(self.A_log), self.D, self.chunk, headdim=self.headdim,
                                         ngroups=self.ngroups, cp_group=cp_group, load_balancing=load_balancing)
        y = y.flatten(-2) * torch.nn.functional.silu(z)                            # gated RMSNorm
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm_weight
        return self.out_proj(y)


def train_losses(rank, world, group, layout, L=48, device="cpu", steps=3):
    """Mean squared error per step of a few AdamW steps on one fixed batch of L tokens; with a
    group the sequence is sharded and the parameter gradients are summed over it, as a trainer
    does. L must split into 2 W pieces of at least d_conv - 1 tokens."""
    torch.manual_seed(0)
    model = TinyMamba2Mixer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = draw(Shape(batch=2, seqlen=L), 1, device=device, features=16)
    u, target = data["u"], data["target"]
    if group is not None:
        u, target = (mamba_cp.shard(t, rank, world, layout) for t in (u, target))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        local = (model(u, group, layout) - target).pow(2).sum() / (2 * L * 16)      # this rank's share
        local.backward()
        loss = local.detach().clone()
        if group is not None:
            dist.all_reduce(loss, group=group)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        losses.append(loss.item())
        opt.step()
    return losses


MIXER_LAYOUTS = ("none", "virtual")
MIXER_BOUND = 1e-5  # relative, per step


def mixer_parity_errors(rank, world, group, device, layout, single, L):
    """One layout's losses on W ranks against those of one process on the whole sequence: the
    relative difference at each step, and whether training lowers the loss."""
    cp = train_losses(rank, world, group, layout, L, device)
    errs = {f"loss step {i}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(cp, single))}
    errs["the loss falls"] = 0.0 if cp[-1] < cp[0] else float("inf")
    return errs


@check("mixer loss parity", MIXER_BOUND)
def mixer_parity_check(rank, world, group, device, gpu=False):
    """Per layout, the losses of W ranks (24 W tokens) against one process's, step by step."""
    L = 24 * world
    single = train_losses(0, 1, None, "none", L, device)
    results = {layout: guarded(mixer_parity_errors, rank, world, group, device, layout, single, L)
               for layout in MIXER_LAYOUTS}
    return errors_everywhere(results, world, group, device)


def test_mixer_loss_parity():
    verdict = world_check(2, mixer_parity_check, timeout=600)
    assert set(verdict) == set(MIXER_LAYOUTS), verdict
    assert all(sum(q.startswith("loss step") for q in errs) == 3 for errs in verdict.values()), verdict


# ---------------------------------------------------------------------------------------------
# Vendoring into Hugging Face transformers (examples/transformers_cp.py): Mamba2ForCausalLM and
# two hybrids trained on gloo ranks (and under FSDP2) against the unsharded model on
# transformers' own code path
# ---------------------------------------------------------------------------------------------

# transformers is optional (these tests skip without it) and imported where used: every gloo
# rank imports this file, and importing transformers costs each 0.7 s
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (optional: pip install transformers)")
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples")
HF_LAYOUTS = ("virtual", "none")
HF_BOUND = 1e-5  # relative: losses and all parameters against the unsharded model, each against its float64 run


# The models trained under CP, from tiny configs (random init, no download): Mamba2ForCausalLM
# with two layers of 8 heads of 8 channels in 2 groups, state 8, chunk 16; the hybrids a Mamba2
# layer like those then an attention layer (grouped-query, rotary), GraniteMoeHybrid's with a
# mixture of experts beside each
HF_TRAINED = {
    "Mamba2ForCausalLM": ("Mamba2Config", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, expand=2, num_heads=8, head_dim=8, n_groups=2,
        state_size=8, conv_kernel=4, chunk_size=16, use_cache=False, tie_word_embeddings=False)),
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=2, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16, tie_word_embeddings=False)),
    "BambaForCausalLM": ("BambaConfig", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16, tie_word_embeddings=False)),
    # NVIDIA's hybrid: no position embedding in its attention, a gated norm always per B/C group
    "NemotronHForCausalLM": ("NemotronHConfig", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, hybrid_override_pattern="M*", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
        conv_kernel=4, chunk_size=16, use_cache=False, tie_word_embeddings=False)),
    # TII's hybrid: one layer of attention and a Mamba2 mixer side by side, every muP multiplier
    # away from 1 (the mixer's input and its projection's z, x, B, C and dt blocks, the
    # attention's input, key and output, the mixer's output, the MLP's, the embeddings', the LM
    # head's); the mixer's gated norm per B/C group, before the gate (the config's default). The
    # larger init gives the mixer's output weight beside the attention's (without the norm
    # y * silu(z) is otherwise ~1e-4)
    "FalconH1ForCausalLM": ("FalconH1Config", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=True, initializer_range=0.1,
        ssm_multipliers=[1.5, 0.75, 1.25, 0.8, 0.6], ssm_in_multiplier=1.3, ssm_out_multiplier=2.0,
        attention_in_multiplier=1.1, attention_out_multiplier=0.8, key_multiplier=1.25, mlp_multipliers=[0.9, 1.1],
        embedding_multiplier=2.0, lm_head_multiplier=0.7, tie_word_embeddings=False)),
    # Zyphra's hybrid: two hybrid layers, each a shared transformer block (attention, rotary, on
    # the hidden states concatenated with the embeddings; an MLP; per-layer LoRA adapters on q, k,
    # v and the MLP; as many KV heads as query heads, which the adapters need) then a Mamba2
    # mixer; one block shared by both (num_mem_blocks=1, its weights tied across the layers as
    # the embeddings and the LM head are)
    "Zamba2ForCausalLM": ("Zamba2Config", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layers_block_type=["hybrid", "hybrid"], num_attention_heads=4, num_key_value_heads=4, mamba_expand=1,
        n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4, chunk_size=16,
        use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, num_mem_blocks=1,
        tie_word_embeddings=True)),
}
# documents packed in the 2 x 44 batch (starts per row): the rank boundaries (11, 22 and 33 in
# the virtual layout at W = 2, 22 contiguous) fall inside documents
HF_PACKED_STARTS = ([17, 30], [5])


def tiny_model(name, dtype=torch.float32, seed=0, changes=None):
    """HF_TRAINED's model `name`, its config with `changes` (a dict, or None)."""
    import transformers
    config_name, options = HF_TRAINED[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**dict(options, **(changes or {})))
    model = getattr(transformers, name)(config).to(dtype)
    if hasattr(model, "set_experts_implementation") and "num_local_experts" in options:
        model.set_experts_implementation("eager")   # the grouped matmul takes no float64
    return model


def hf_batch(vocab, packed, L=44, rows=2):
    """input_ids (rows, L), and position_ids restarting at each packed document's start (or
    None); rows 1: the first row alone."""
    ids = draw(Shape(batch=2, seqlen=L), 5, device="cpu", vocab=vocab)["input_ids"][:rows]
    if not packed:
        return ids, None
    positions = torch.arange(L).repeat(rows, 1)
    for row, starts in enumerate(HF_PACKED_STARTS[:rows]):
        for s in starts:
            positions[row, s:] = torch.arange(L - s)
    return ids, positions


def hf_documents(ids, positions):
    """(row, start, end) of every document of the batch."""
    if positions is None:
        return [(row, 0, ids.shape[1]) for row in range(ids.shape[0])]
    docs = []
    for row in range(ids.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        docs += [(row, a, b) for a, b in zip(starts, starts[1:])]
    return docs


def hf_reference(name, packed, dtype, steps=3, changes=None, rows=2):
    """The unsharded model on transformers' own code path: each document alone (as packing with
    documents kept apart computes), its loss the sum over its tokens divided by the batch's count
    of predicted tokens. Losses per step, the first step's gradients and the parameters after
    the last."""
    model = tiny_model(name, dtype, changes=changes)
    return unsharded_training(model, *hf_batch(model.config.vocab_size, packed, rows=rows), steps)


def unsharded_training(model, ids, positions, steps, cast=None):
    """hf_reference's arithmetic on a given model and batch, AdamW; with cast (a dtype), each
    step's forward and backward run on a copy of the parameters in that dtype, the gradients
    returned in float32, as FSDP2's param_dtype does."""
    import copy
    docs = hf_documents(ids, positions)
    items = sum(b - a - 1 for _, a, b in docs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        run = model if cast is None else copy.deepcopy(model).to(cast)
        total = 0.0
        for row, a, b in docs:
            doc = ids[row:row + 1, a:b]
            loss = run(input_ids=doc, labels=doc, num_items_in_batch=items).loss
            loss.backward()
            total += loss.item()
        if cast is not None:
            for p, q in zip(model.parameters(), run.parameters()):
                p.grad = q.grad.float()
        if not losses:
            grads = _grads(model)
        losses.append(total)
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model):
    """Every parameter's gradient, whole (an FSDP2 shard's gathered), flattened into one vector."""
    return torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().flatten().double()
                      for p in model.parameters() if p.grad is not None])


def hf_cp_train(name, packed, rank, world, group, layout, steps=3, mesh=None, changes=None, rows=2):
    """enable_cp and shard_batch on this rank's share; with mesh (dp, cp) FSDP2 over all its
    ranks, each dp rank holding one row of the batch. Global losses, the first step's
    gradients and the full parameters."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import transformers_cp
    model = tiny_model(name, changes=changes)
    ids, positions = hf_batch(model.config.vocab_size, packed, rows=rows)
    scale, cp_rank, cp_world = 1.0, rank, world
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        group, cp_rank, cp_world = mesh.get_group("cp"), mesh.get_local_rank("cp"), mesh.size(1)
        everyone = init_device_mesh("cpu", (mesh.size(),))
        model = transformers_cp.enable_cp(model, group, layout)
        for layer in model.model.layers:
            fully_shard(layer, mesh=everyone)
        fully_shard(model, mesh=everyone)
        scale = float(mesh.size())            # FSDP averages over dp x cp; the shares must add
        row = mesh.get_local_rank("dp")
        items = sum(b - a - 1 for _, a, b in hf_documents(ids, positions))
        ids, positions = ids[row:row + 1], None if positions is None else positions[row:row + 1]
    else:
        model = transformers_cp.enable_cp(model, group, layout)
    batch = transformers_cp.shard_batch(ids, ids, cp_rank, cp_world, layout, position_ids=positions)
    if mesh is None:
        items = batch["num_items"]
    # Mamba2ForCausalLM takes no positions and hands its mixers no keywords (no documents)
    documents = ({} if name == "Mamba2ForCausalLM" else
                 dict(position_ids=batch["position_ids"], seq_idx=batch["seq_idx"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=batch["input_ids"], labels=batch["shift_labels"], shift_labels=batch["shift_labels"],
                     num_items_in_batch=items, **documents).loss
        (loss * scale).backward()
        if mesh is None:
            transformers_cp.all_reduce_grads(model, group)
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total)            # every rank's share, over dp x cp
        if not losses:
            grads = _grads(model)
        losses.append(total.item())
        opt.step()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return losses, grads, params


def hf_compare(cp, cp_grads, cp_params, name, packed, changes=None, rows=2):
    """The CP run against the unsharded one in float32 (losses, the first step's gradients, all
    parameters together) and float64 (each parameter, with the float32 run's own error beside
    it). The gradients catch a wrong normalisation that Adam's steps would hide."""
    single, single_grads, single_params = hf_reference(name, packed, torch.float32, changes=changes, rows=rows)
    _, _, exact = hf_reference(name, packed, torch.float64, changes=changes, rows=rows)
    joint = rel_rms(torch.cat([cp_params[n].flatten() for n in exact]),
                    torch.cat([single_params[n].flatten() for n in exact]))
    return dict(cp=cp, single=single, joint=joint, grads=rel_rms(cp_grads, single_grads),
                params={n: (rel_rms(cp_params[n], exact[n]), rel_rms(single_params[n], exact[n])) for n in exact})


def hf_parity(rank, world, group, device):
    """Mamba2ForCausalLM through enable_cp, per layout: hf_compare on rank 0 (the ranks' losses
    and parameters are the same, all-reduced). Then enable_mamba_cp's own promises: a group of
    one is a world of one (every mixer patched, transformers' own logits), a model without
    mixers is refused."""
    out = {}
    for layout in HF_LAYOUTS:
        trained = hf_cp_train("Mamba2ForCausalLM", False, rank, world, group, layout)
        if rank == 0:
            out[layout] = hf_compare(*trained, "Mamba2ForCausalLM", False)
    import transformers_cp
    singles = [dist.new_group([r]) for r in range(world)]            # collective: every rank makes each
    model = tiny_model("Mamba2ForCausalLM")
    ids = hf_batch(model.config.vocab_size, False)[0]
    want = model(input_ids=ids).logits                               # transformers' own path
    patched = transformers_cp.enable_mamba_cp(model, singles[rank]) is model and all(
        "forward" in vars(m) for m in transformers_cp._mamba2_mixers(model))
    group_of_one = patched and rel_rms(model(input_ids=ids).logits, want) <= HF_BOUND   # a world of one
    try:
        transformers_cp.enable_mamba_cp(torch.nn.Linear(2, 2), group)
        refused = False
    except ValueError as e:
        refused = "no Mamba2 mixer" in str(e)
    return out, dict(group_of_one_is_a_world_of_one=group_of_one, model_without_mixers_refused=refused)


class HFCase(NamedTuple):
    layout: str
    packed: bool                 # documents packed (HF_PACKED_STARTS), or one per row
    changes: dict = None         # to the model's config
    rows: int = 2                # 1: hf_batch's first row alone, half the work


HF_CASES = {"virtual": HFCase("virtual", False), "none": HFCase("none", False),
            "packed_virtual": HFCase("virtual", True),
            # one row of 3 documents (starts 17 and 30: every rank boundary falls inside one)
            "one_row_packed_virtual": HFCase("virtual", True, rows=1),
            "one_row_packed_none": HFCase("none", True, rows=1),
            "one_row_packed_none_no_mixer_norm": HFCase("none", True, dict(mamba_rms_norm=False), rows=1)}


def hf_hybrid_parity(rank, world, group, device, name, cases):
    """Per case (HF_CASES): hf_compare, on rank 0 (the ranks' losses and parameters are the
    same, all-reduced). Then what the CP model refuses, each raised on every rank before any
    collective: a keyword that describes documents otherwise, and a cache in evaluation; and
    how many mixer configurations enable_cp checked against their own forward."""
    out = {}
    for case, c in ((case, HF_CASES[case]) for case in cases):
        trained = hf_cp_train(name, c.packed, rank, world, group, c.layout, changes=c.changes, rows=c.rows)
        if rank == 0:                         # every rank holds the same losses and parameters
            out[case] = hf_compare(*trained, name, c.packed, c.changes, c.rows)
    import transformers_cp
    model = transformers_cp.enable_cp(tiny_model(name), group, "virtual")
    ids = transformers_cp.shard_batch(*(2 * [hf_batch(model.config.vocab_size, False)[0]]), rank, world)["input_ids"]
    # document ids counted on each rank's shard alone (shard_batch handed the shard as a whole
    # sequence: the usual mistake), each rank's non-decreasing, stepping down between the ranks
    packed, positions = hf_batch(model.config.vocab_size, True)
    mine = transformers_cp.shard_batch(packed, packed, rank, world, "virtual", position_ids=positions)
    per_shard = transformers_cp.shard_batch(mine["input_ids"], mine["input_ids"], 0, 1, "none",
                                            position_ids=mine["position_ids"])["seq_idx"]
    refusals = {}
    for what, call in (("cu_seq_lens_q", lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, ids.shape[1]]))),
                       ("seq_idx per shard", lambda: model(input_ids=mine["input_ids"], seq_idx=per_shard,
                                                           position_ids=mine["position_ids"])),
                       ("cache in evaluation", lambda: model.eval()(input_ids=ids, use_cache=True))):
        try:
            call()
            refusals[what] = "accepted"
        except (ValueError, RuntimeError) as e:      # RuntimeError: the device-side check of a later call
            refusals[what] = f"{type(e).__name__}: {e}"
    return out, refusals, len(transformers_cp._CHECKED)


def hf_fsdp_parity(rank, world, group, device, name):
    """dp 2 x cp 2: FSDP2 over all four ranks, CP over each dp rank's pair."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    trained = hf_cp_train(name, True, rank, world, group, "virtual", mesh=mesh)
    return {"fsdp_dp2_cp2_packed_virtual": hf_compare(*trained, name, True)} if rank == 0 else {}


def assert_hf_cases(result):
    for case, r in result.items():
        worst = max(r["params"], key=lambda n: r["params"][n][0])
        print(f"{case}: CP losses {r['cp']}, unsharded {r['single']}; first gradients {r['grads']:.1e} and all "
              f"parameters {r['joint']:.1e} against the unsharded model's; largest parameter error against "
              f"float64 {r['params'][worst][0]:.1e} ({worst}; unsharded float32 {r['params'][worst][1]:.1e})")
        assert len(r["cp"]) == 3 and r["cp"][-1] < r["cp"][0], f"{case}: the loss must fall ({r['cp']})"
        steps = [abs(a - b) / abs(b) for a, b in zip(r["cp"], r["single"])]
        assert max(steps) <= HF_BOUND, f"{case}: losses {r['cp']} against unsharded {r['single']}"
        assert r["grads"] <= HF_BOUND, f"{case}: first gradients {r['grads']:.2e} from the unsharded model's"
        assert r["joint"] <= HF_BOUND, f"{case}: parameters {r['joint']:.2e} from the unsharded model's"
        bad = {n: e for n, e in r["params"].items() if not e[0] <= HF_BOUND}
        assert not bad, f"{case}: parameters (CP, unsharded float32) against float64: {bad}"


@needs_transformers
def test_transformers_mamba2_cp_parity():
    """W = 2, both layouts: losses per step, the first step's gradients and the parameters after 3
    AdamW steps against transformers' own unsharded code."""
    ranks = world_results(2, "hf_parity", timeout=900)
    assert set(ranks[0][0]) == set(HF_LAYOUTS), ranks[0][0]
    for result, checks in ranks:
        assert all(checks.values()), checks
        assert_hf_cases(result)


# which cases each hybrid trains at W = 2 (GraniteMoeHybrid's packed case runs under FSDP2 below)
HF_HYBRID_CASES = {"GraniteMoeHybridForCausalLM": ("virtual", "none"),
                   "BambaForCausalLM": ("virtual", "none", "packed_virtual"),
                   "NemotronHForCausalLM": ("packed_virtual",),
                   "FalconH1ForCausalLM": ("one_row_packed_virtual", "one_row_packed_none_no_mixer_norm"),
                   "Zamba2ForCausalLM": ("one_row_packed_virtual", "one_row_packed_none")}


@needs_transformers
@pytest.mark.parametrize("name", list(HF_HYBRID_CASES))
def test_transformers_hybrid_cp_parity(name):
    """W = 2, HF_HYBRID_CASES (the layouts, and packed documents across the rank boundaries):
    losses per step, the first step's gradients and the parameters after 3 AdamW steps against
    transformers' own unsharded code."""
    cases = HF_HYBRID_CASES[name]
    ranks = world_results(2, "hf_hybrid_parity", name, cases, timeout=900)
    assert set(ranks[0][0]) == set(cases), ranks[0][0]
    for result, refusals, checked in ranks:
        assert_hf_cases(result)
        assert refusals["cu_seq_lens_q"].startswith("ValueError") and \
            "cannot honour ['cu_seq_lens_q']" in refusals["cu_seq_lens_q"], refusals
        assert refusals["cache in evaluation"].startswith("ValueError") and \
            "a cache" in refusals["cache in evaluation"], refusals
        # a first call names the step (ValueError); a signature already agreed stops on the device
        assert refusals["seq_idx per shard"].startswith((
            "ValueError: seq_idx: got a decreasing step where the sequence passes between ranks",
            "RuntimeError: mamba_cp: seq_idx steps down between two ranks' pieces")), refusals
        assert checked >= 1, "enable_cp patched the mixers without checking them against their own forward"


@needs_transformers
def test_transformers_fsdp2_cp_parity():
    """FSDP2 over dp 2 x cp 2, each dp rank its own packed row, against the unsharded model on
    the whole global batch."""
    ranks = world_results(4, "hf_fsdp_parity", "GraniteMoeHybridForCausalLM", timeout=900)
    assert list(ranks[0]) == ["fsdp_dp2_cp2_packed_virtual"], ranks[0]
    for result in ranks:
        assert_hf_cases(result)


def _example():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import transformers_cp
    return transformers_cp


@pytest.mark.parametrize("layout, world, l", [("none", 1, 300), ("none", 3, 200), ("virtual", 2, 384),
                                              ("virtual", 3, 130), ("permute_p2p", 2, 320)])
def test_cp_block_mask(layout, world, l):
    """The example's attention mask of every rank, from global positions and documents (5 of
    random lengths on one row, 2 on the other, starts on rank boundaries and inside tiles),
    against the mask written out element by element from the whole sequence: every visible
    pair lies in a tile the mask lists, every tile listed as full holds visible pairs only, and
    cp_attention's arithmetic (masked_attention, grouped-query) gives dense attention's output.
    On a GPU the fused kernel reads only the listed tiles; the CPU's eager form ignores the
    tiles, hence their own check."""
    cp = _example()
    L, tile = world * l, cp.BLOCK
    g = torch.Generator().manual_seed(world * l)
    docs = torch.zeros(2, L, dtype=torch.int32)
    for s in torch.randperm(L - 1, generator=g)[:4].tolist() + [l]:
        docs[0, s + 1:] += 1
    docs[1, L // 3:] += 1
    pieces = lambda r: [r] if layout == "none" else [r, 2 * world - 1 - r]          # noqa: E731 (README layouts)
    size = L // len(pieces(0)) // world
    order = torch.tensor([p * size + i for r in range(world) for p in pieces(r) for i in range(size)])   # keys
    assert torch.equal(cp.key_positions(l, world, layout, "cpu"), order)
    kinds = torch.zeros(2, dtype=torch.long)                               # full tiles, masked tiles
    for rank in range(world):
        queries = order[rank * l:(rank + 1) * l]
        for documents in (False, True):
            qd, kd = (docs[:, queries], docs[:, order]) if documents else (None, None)
            mask = cp.cp_block_mask(queries, order, qd, kd)
            seen = (order[None, :] <= queries[:, None])[None]                           # (1, l, L)
            if documents:
                seen = seen & (qd[:, :, None] == kd[:, None, :])                       # (2, l, L)
            Q, K = -(-l // tile), -(-L // tile)
            padded = torch.zeros(seen.shape[0], Q * tile, K * tile, dtype=torch.bool)
            padded[:, :l, :L] = seen
            tiles = padded.unflatten(1, (Q, tile)).unflatten(3, (K, tile))            # (B, Q, t, K, t)
            listed = mask.to_dense()[:, 0].bool()                                      # partial or full
            full = torch.zeros_like(listed)
            for b, q in itertools.product(range(full.shape[0]), range(Q)):
                full[b, q, mask.full_kv_indices[b, 0, q, :mask.full_kv_num_blocks[b, 0, q]].long()] = True
            assert bool((tiles.any(4).any(2) <= listed).all()), (rank, documents, "a visible pair in a skipped tile")
            inside = torch.zeros_like(padded)
            inside[:, :l, :L] = True
            all_seen = (tiles | ~inside.unflatten(1, (Q, tile)).unflatten(3, (K, tile))).all(4).all(2)
            assert bool((full <= all_seen).all()), (rank, documents, "a hidden pair in a full tile")
            kinds += torch.stack([full.sum(), (listed & ~full).sum()])
            q, k, v = (torch.randn(seen.shape[0], h, n, 8, generator=g) for h, n in ((4, l), (2, L), (2, L)))
            got = cp.masked_attention(q, k, v, mask)                                   # (B, l, 4, 8)
            want = F.scaled_dot_product_attention(q.double(), *(t.double().repeat_interleave(2, 1) for t in (k, v)),
                                                  attn_mask=seen[:, None]).transpose(1, 2)
            assert rel_rms(got, want) <= FP32_BOUND, (rank, documents)
    assert kinds.min() > 0, f"full and masked tiles both met: {kinds.tolist()}"


HF_HYBRIDS = {   # tiny configs: one Mamba2 layer, one attention layer
    "BambaForCausalLM": ("BambaConfig", dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                                             mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16)),
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", dict(
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8,
        mamba_expand=2, mamba_chunk_size=16, num_local_experts=2, num_experts_per_tok=1)),
    "NemotronHForCausalLM": ("NemotronHConfig", dict(hybrid_override_pattern="M*", mamba_num_heads=8, mamba_head_dim=8,
                                                     n_groups=2, ssm_state_size=8, expand=2, chunk_size=16)),
}


@needs_transformers
@pytest.mark.parametrize("name", list(HF_HYBRIDS))
def test_transformers_hybrid_mixers_found(name):
    """enable_mamba_cp's duck typing finds the Mamba2 mixer of each hybrid, and nothing else;
    enable_cp's census of layer kinds accepts the hybrid and refuses a kind it does not know, or
    a count of modules that differs from the declared kinds'."""
    import transformers
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import transformers_cp
    config_name, mamba = HF_HYBRIDS[name]
    config = getattr(transformers, config_name)(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                **mamba)
    model = getattr(transformers, name)(config)
    mixers = transformers_cp._mamba2_mixers(model)
    assert len(mixers) == 1, [type(m).__name__ for m in mixers]
    assert [len(found) for found in transformers_cp._layers_to_patch(model)] == [1, 1]    # enable_cp's census
    declared = list(getattr(config, "layers_block_type", None) or config.layer_types)
    for changed, message in ((declared[:-1] + ["cross_attention"], r"kind \['cross_attention'\]"),
                             (declared + ["full_attention"], "declares 2 layers of kind 'full_attention' but holds 1")):
        model.config = types.SimpleNamespace(layer_types=changed)      # a config declaring other layers
        with pytest.raises(ValueError, match=message):
            transformers_cp._layers_to_patch(model)
    model.config = config
    if name == "NemotronHForCausalLM":       # the one whose config has a window: a hybrid made with one
        config.sliding_window = 16
        with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=\[16\]\)"):
            transformers_cp.enable_cp(model, None)
    m = mixers[0]
    # transformers 5.23 on: the norm's groups are the B/C groups; 5.17 to 5.22: one group over all channels
    width = 32 if hasattr(m.norm, "group_size") else 64
    assert transformers_cp._mixer_sizes(m) == (8, 2, width)


@needs_transformers
@on_cpu
def test_transformers_world_of_one():
    """cp_group None: the same path on the whole sequence, in one process with no process group
    (mixers on mamba_cp's kernels, attention through flex_attention's mask), trained against
    transformers' own code as the CP runs are (Bamba, packed documents); a layout that does not
    exist is refused."""
    cp = _example()
    assert_hf_cases({"world_of_one_packed": hf_compare(*hf_cp_train("BambaForCausalLM", True, 0, 1, None, "none"),
                                                       "BambaForCausalLM", True)})
    model = tiny_model("Mamba2ForCausalLM")
    assert cp.enable_cp(model, None) is model and all("forward" in vars(m) for m in cp._mamba2_mixers(model))
    with pytest.raises(ValueError, match="load_balancing"):
        cp.enable_mamba_cp(model, None, load_balancing="zigzag")


@needs_transformers
@pytest.mark.parametrize("release", ["5.17", "5.23", "5.24"])
@on_cpu
def test_transformers_calling_conventions(release):
    """A patched mixer called as each transformers release calls it, against the mixer's own
    forward on its torch path: 5.17 to 5.23 hand it the cache as cache_params, 5.24 on as
    cache, with the keywords a CausalLM forward hands on (always present, None or not); 5.17 to
    5.22's gated RMSNorm has no group_size and normalises all channels at once (with two B/C
    groups: the torch norm after mamba_cp's gate), 5.23 on per B/C group (fused). In evaluation
    with a cache the patched mixer hands the cache back to transformers' forward under the name
    that forward takes."""
    cp = _example()
    model = tiny_model("BambaForCausalLM")
    mixer = cp._mamba2_mixers(model)[0]
    dim = mixer.out_proj.in_features
    # the norm of one group: transformers 5.17's arithmetic, and every release's where the one installed
    # has no group_size (5.17 to 5.22: the calling conventions are then checked with it)
    whole = release == "5.17" or not hasattr(mixer.norm, "group_size")
    if whole:
        mixer.norm.group_size = dim
    assert cp._mixer_sizes(mixer)[2] == (dim if whole else dim // 2)
    hidden = torch.randn(2, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    want = mixer.eval()(hidden, cache=None, attention_mask=None)     # transformers' torch path (no mamba_ssm)
    cache_name = "cache" if release == "5.24" else "cache_params"
    seen, own = {}, mixer.forward

    def release_forward(hidden_states, attention_mask=None, **kwargs):   # stands for that release's forward
        if kwargs.get(cache_name) is None:      # its arithmetic (enable_cp checks the patch against it)
            return own(hidden_states, attention_mask=attention_mask)
        seen.update(kwargs)
        return "transformers' own path"
    release_forward.__signature__ = inspect.Signature([
        inspect.Parameter("hidden_states", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(cache_name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("attention_mask", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)])
    mixer.forward = release_forward
    cp.enable_cp(model, None)
    keywords = dict(attention_mask=None, num_items_in_batch=7, shift_labels=None, output_router_logits=False,
                    output_hidden_states=False, output_attentions=False, **{cache_name: None})
    got = mixer.train()(hidden_states=hidden, seq_idx=torch.zeros(2, 40, dtype=torch.int32), **keywords)
    assert rel_rms(got, want) <= HF_BOUND
    assert mixer.eval()(hidden, **dict(keywords, **{cache_name: "a cache"})) == "transformers' own path"
    assert seen[cache_name] == "a cache" and not ({"cache", "cache_params"} - {cache_name}) & set(seen)


@needs_transformers
@on_cpu
def test_transformers_mixer_self_check(monkeypatch):
    """enable_cp and enable_mamba_cp patch no mixer that computes otherwise than its own
    forward: each distinct mixer configuration is run both ways once per process (float32, 36
    tokens: two chunk boundaries) and refused, naming the class and the difference, above
    CHECK_BOUND, with nothing patched. Refused: a subclass whose forward scales its output by
    1.001, and a Falcon-H1 mixer monkeypatched to restart its state every chunk (it agrees
    with the file on the first chunk). A bf16 mixer is checked in float32 and handed back as
    it was; on the meta device a mixer of a known class passes unchecked and a subclass is
    refused; a model of two identical mixers is checked once, and not again; Falcon-H1 with its
    norm after the gate (the parity tests train it before, and without) passes; Falcon-H1 with a
    conv activation mamba_cp has not (hidden_act) is refused by name."""
    cp = _example()
    calls = []
    check = cp._check_mixer
    monkeypatch.setattr(cp, "_check_mixer", lambda *args: calls.append(type(args[0]).__name__) or check(*args))
    monkeypatch.setattr(cp, "_CHECKED", set())
    cp.enable_mamba_cp(tiny_model("Mamba2ForCausalLM"), None)
    cp.enable_mamba_cp(tiny_model("Mamba2ForCausalLM"), None)
    assert calls == ["Mamba2Mixer"], calls                         # two layers, two models: one check

    def scaled(base):
        class Scaled(base):
            def forward(self, hidden_states, *args, **kwargs):
                return 1.001 * super().forward(hidden_states, *args, **kwargs)
        Scaled.__name__ = "Scaled" + base.__name__
        return Scaled

    bamba = tiny_model("BambaForCausalLM")
    mixer = cp._mamba2_mixers(bamba)[0]
    mixer.__class__ = scaled(type(mixer))
    with pytest.raises(ValueError, match=r"ScaledBambaMixer's own forward and this file's differ: relative RMS "
                                         r"difference 1\.0e-03 \(bound 1e-04\)"):
        cp.enable_cp(bamba, None)
    assert "forward" not in vars(mixer) and not any(hasattr(m, "mamba_cp") for m in bamba.modules())

    falcon = tiny_model("FalconH1ForCausalLM")
    mixer = cp._mamba2_mixers(falcon)[0]
    own = mixer.forward

    def per_chunk(hidden_states, **kwargs):
        return torch.cat([own(h, **kwargs) for h in hidden_states.split(mixer.chunk_size, 1)], 1)
    mixer.forward = per_chunk
    with pytest.raises(ValueError, match="FalconH1Mixer's own forward and this file's differ") as refused:
        cp.enable_mamba_cp(falcon, None)
    print(refused.value)
    assert mixer.forward is per_chunk

    bf16 = cp._mamba2_mixers(tiny_model("BambaForCausalLM", torch.bfloat16))[0].train()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in bf16.named_parameters()}
    assert cp._check_mixer(bf16, bf16.forward, "virtual")
    assert bf16.training and all(p.dtype == torch.bfloat16 and p.data_ptr() == before[n][0]
                                 and torch.equal(p, before[n][1]) for n, p in bf16.named_parameters())

    with torch.device("meta"):
        meta = tiny_model("BambaForCausalLM")
    cp.enable_mamba_cp(meta, None)                                  # known: trusted, not run
    mixer = cp._mamba2_mixers(tiny_model("BambaForCausalLM").to("meta"))[0]
    mixer.__class__ = scaled(type(mixer))
    with pytest.raises(ValueError, match="cannot check ScaledBambaMixer against its own forward"):
        cp.enable_mamba_cp(mixer, None)
    assert calls == ["Mamba2Mixer", "ScaledBambaMixer", "FalconH1Mixer", "BambaMixer", "BambaMixer",
                     "ScaledBambaMixer"], calls
    after = cp._mamba2_mixers(tiny_model("FalconH1ForCausalLM", changes=dict(mamba_norm_before_gate=False)))[0]
    assert cp._check_mixer(after, after.forward, "none")
    with pytest.raises(ValueError, match="FalconH1Mixer applies 'gelu' after its conv"):
        cp.enable_mamba_cp(tiny_model("FalconH1ForCausalLM", changes=dict(hidden_act="gelu")), None)


@needs_transformers
def test_transformers_hybrid_layers_found():
    """Falcon-H1's and Zamba2's layers of kind 'hybrid' each hold one mixer and one attention:
    enable_cp's census finds Falcon-H1's (side by side in its one layer) and Zamba2's (a
    shared transformer block then a mixer, in each of two layers) and refuses a count of
    modules other than the declared kinds'."""
    cp = _example()
    for name, found in (("FalconH1ForCausalLM", [1, 1]), ("Zamba2ForCausalLM", [2, 2])):
        model = tiny_model(name)
        assert [len(modules) for modules in cp._layers_to_patch(model)] == found, name
        config, model.config = model.config, types.SimpleNamespace(layer_types=["hybrid", "linear_attention"] * 2)
        with pytest.raises(ValueError, match="declares 4 layers of kind 'linear_attention' or 'hybrid' but holds"):
            cp._layers_to_patch(model)
        model.config = config


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cp_attention_kernel_gpu(dtype):
    """The fused kernel the example runs on a GPU (flex_attention, compiled, reading only the
    tiles the mask lists) against the arithmetic CI tests on CPUs (SDPA under dense_mask, the
    same mask written out), both against float64 attention under the mask written out element
    by element: output and the gradients of q, k and v, for every rank of W = 3 (virtual, 1,000
    tokens a rank, 8 documents crossing rank boundaries; 8 query heads on 2 KV heads of 64).
    The kernel's error is at most twice dense SDPA's in the same dtype (plus 1e-6)."""
    cp = _example()
    world, l, g = 3, 1000, torch.Generator().manual_seed(11)
    keys = cp.key_positions(l, world, "virtual", "cuda")                      # (L,) gathered order
    L = world * l
    docs = torch.zeros(1, L, dtype=torch.int32)
    docs[0, torch.randperm(L - 1, generator=g)[:7] + 1] = 1
    docs = torch.cumsum(docs, 1).to(torch.int32).cuda()[:, keys]             # (1, L) gathered order
    worst = {}
    for rank in range(world):
        queries = keys[rank * l:(rank + 1) * l]
        mask = cp.cp_block_mask(queries, keys, docs[:, rank * l:(rank + 1) * l], docs)
        seen = (keys[None, :] <= queries[:, None]) & (docs[0, rank * l:(rank + 1) * l, None] == docs[0, None, :])
        q, k, v = (torch.randn(1, h, n, 64, generator=g).cuda() for h, n in ((8, l), (2, L), (2, L)))
        dout = torch.randn(1, l, 8, 64, generator=g).cuda()

        def run(attend, dt):
            leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
            out = attend(*leaves)
            return [out] + list(torch.autograd.grad(out, leaves, dout.to(dt)))

        exact = run(lambda *t: F.scaled_dot_product_attention(
            t[0], *(x.repeat_interleave(4, 1) for x in t[1:]), attn_mask=seen, scale=0.125).transpose(1, 2),
            torch.float64)
        fused = run(lambda *t: cp.masked_attention(*t, mask, 0.125), dtype)
        cpu_form = run(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=cp.dense_mask(mask), scale=0.125,
                                                                 enable_gqa=True).transpose(1, 2), dtype)
        for name, a, b, e in zip(("out", "dq", "dk", "dv"), fused, cpu_form, exact):
            err, dense = rel_rms(a, e), rel_rms(b, e)
            print(f"rank {rank} {name}: fused {err:.2e}, dense SDPA {dense:.2e}")
            assert err <= 2 * dense + 1e-6, (rank, name, err, dense)
            worst[name] = max(worst.get(name, 0.0), err)
    assert max(worst.values()) <= (FP32_BOUND if dtype == torch.float32 else BF16_BOUND), worst


def granite_tiny_sized(layers, dtype, seed=0):
    """GraniteMoeHybrid of granite-4.0-h-tiny's widths, heads and experts (examples/hybrid_bench.py),
    its first `layers` layers."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import hybrid_bench
    return hybrid_bench.granite_tiny(layers, "cuda", dtype=dtype, seed=seed)


def transformers_torch_path(monkeypatch, model):
    """Send `model`'s Mamba2 mixers down transformers' own torch path. Where mamba_ssm is
    importable when the model's module is first imported (as after _peer() below), transformers
    runs its kernels instead, whose float32 products round in tf32: no float32 reference. Its
    module-level kernel functions (5.2x: a wrapper round each torch function) go back to the torch
    functions they wrap, and its fast-path flag (older releases) to False."""
    module = sys.modules[type(model).__module__]
    if hasattr(module, "is_fast_path_available"):
        monkeypatch.setattr(module, "is_fast_path_available", False)
    for name, fn in list(vars(module).items()):
        if name.startswith(("mamba2_", "causal_conv1d")) and getattr(fn, "__wrapped__", None) is not None:
            monkeypatch.setattr(module, name, fn.__wrapped__)


@gpu
@needs_transformers
def test_transformers_hybrid_world_of_one_gpu(monkeypatch):
    """The example's hybrid in a world of one on a GPU against transformers' torch path for the
    same model (never mamba_ssm's kernels: transformers_torch_path): a GraniteMoeHybrid of
    granite-4.0-h-tiny's size class, its first 6 layers (5 Mamba2, 1 attention, 64 experts),
    one forward+backward of 2,048 tokens, every run from the same bf16-rounded weights.
    float32: ours against transformers', the loss and every parameter's gradient within 1e-4
    (both round in float32). bf16, ours and transformers' against transformers' float32: the
    loss within 1e-3; every gradient of ours within twice the largest error transformers' bf16
    path makes on any gradient of the model (bf16's bound here: its routers' gradients are off
    by about 0.17, most weights' by 0.08), and the median over parameters of ours' error over
    transformers' within 1.25. Per gradient ours is not held to transformers' error: its torch
    path runs the SSD in float32 after the conv, our kernels (as mamba_ssm's) in bf16, which
    shows on A_log's gradient, a sum over every token (up to 3.4x transformers' error there in
    BENCHMARKS.md's runs)."""
    cp = _example()
    ids = torch.randint(0, 100352, (1, 2048), generator=torch.Generator().manual_seed(0)).cuda()

    def step(ours, dtype):
        model = granite_tiny_sized(6, torch.bfloat16).to(dtype)
        if ours:
            cp.enable_cp(model, None)
        else:
            transformers_torch_path(monkeypatch, model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    def errors(got, want):
        assert set(got[1]) == set(want[1])
        return abs(got[0] - want[0]) / abs(want[0]), {n: rel_rms(got[1][n], w) for n, w in want[1].items()}

    exact = step(False, torch.float32)
    loss32, grads32 = errors(step(True, torch.float32), exact)
    loss_ours, ours = errors(step(True, torch.bfloat16), exact)
    loss_theirs, theirs = errors(step(False, torch.bfloat16), exact)
    bf16_bound = max(theirs.values())
    worst32, worst = max(grads32, key=grads32.get), max(ours, key=ours.get)
    print(f"float32: loss {loss32:.1e}, largest gradient error {grads32[worst32]:.1e} ({worst32}); bf16: loss ours "
          f"{loss_ours:.1e}, transformers {loss_theirs:.1e}; largest gradient error ours {ours[worst]:.2e} ({worst}), "
          f"transformers {bf16_bound:.2e}")
    ratio = statistics.median(ours[n] / theirs[n] for n in ours)
    print(f"median over parameters of ours' bf16 gradient error over transformers': {ratio:.3f}")
    assert loss32 <= 1e-4 and grads32[worst32] <= 1e-4, (loss32, worst32, grads32[worst32])
    assert loss_ours <= 1e-3 and loss_theirs <= 1e-3, (loss_ours, loss_theirs)
    bad = {n: (e, theirs[n]) for n, e in ours.items() if not e <= 2 * bf16_bound}
    assert not bad, f"gradients (ours, transformers bf16) against float32 beyond {2 * bf16_bound:.2e}: {bad}"
    assert ratio <= 1.25, ratio


# ---------------------------------------------------------------------------------------------
# GPU only: bf16 at the record shape, 2^20 tokens in one call, and the CP path captured in one
# CUDA graph (graph_capture_check also runs under torchrun)
# ---------------------------------------------------------------------------------------------

RECORD = dict(nheads=64, headdim=64, ngroups=8, dstate=128, chunk=128)


@gpu
@pytest.mark.parametrize("opts", [dict(), OPTIONS["all"], dict(OPTIONS["all"], state_dtype=torch.float32),
                                  dict(growth=0.02, D="hp", z=True, initial_states=True, seq_idx=[16, 40, 41])],
                         ids=["plain", "all", "all_fp32_states", "growth"])
def test_bf16_record_shape(opts):
    """bf16 kernels against the oracle fed the same bf16-rounded values (chunked float64 form)."""
    opts = dict(opts)
    state_dtype = opts.pop("state_dtype", None)
    inputs = dict(ssd_inputs(Shape(batch=2, seqlen=1000, **RECORD), 9, dtype=torch.bfloat16, **opts),
                  state_dtype=state_dtype)
    oracle_inputs = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
                     for k, v in inputs.items()}
    assert_close(run_both(inputs, oracle_inputs, chunked=True), BF16_BOUND)


@gpu
def test_varlen_states_bf16_record_shape():
    """Documents of 1, 127, 129 and 743 tokens (one ending at a kernel-chunk boundary, 128)."""
    cu = torch.tensor([0, 1, 128, 257, 1000], dtype=torch.int32)
    inputs = ssd_inputs(Shape(batch=1, seqlen=1000, **RECORD), 19, dtype=torch.bfloat16, seq_idx=cu[1:-1].tolist(),
                        initial_states=True, dt_bias=True, dt_softplus=True)
    _, states = mamba_cp.mamba_chunk_scan_combined(**inputs, cu_seqlens=cu.cuda(), return_varlen_states=True)
    oracle = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
              for k, v in inputs.items()}
    assert_close({"varlen_states": (states, document_end_oracle(oracle, cu))}, BF16_BOUND)


@gpu
def test_split_conv1d_scan_bf16_record_shape():
    """The fused entry in a world of one, bf16 at the shape of record: the gated RMSNorm, SwiGLU
    channels, an out projection with bias, documents and a dt_limit."""
    case = dict(shape=SPLIT_RECORD, dtype=torch.bfloat16, layout="none", seed=4, norm=True, outproj="bias",
                seq_idx=[3, 700], dt_limit=(0.05, 2.0))
    errs = split_case_errors(case, 0, 1, None, "cuda")
    print(errs)
    expect({"record shape, norm, out projection, documents, dt_limit": errs}, BF16_BOUND)


def _peer(name, conv=False):
    """mamba_ssm's own function `name` (of ops/triton/ssd_combined) where it can be imported
    (../shared/peer lays it out in .peer/; conv: causal_conv1d's CUDA conv, built into .peer/lib,
    is needed too), else None."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, ".peer"), os.path.join(here, ".peer", "lib")):
        if os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)
    try:
        from mamba_ssm.ops.triton import ssd_combined
        if conv:
            import causal_conv1d_cuda  # noqa: F401 - the peer's conv; without it the peer cannot run
    except ImportError:
        return None
    return getattr(ssd_combined, name)


@gpu
@pytest.mark.parametrize("every_option", [False, True], ids=["plain", "every_option"])
def test_chunk_scan_matches_mamba_ssm_default_clamp(every_option, monkeypatch):
    """A raw dt largely below zero with the default dt_limit and no softplus (batch 1, 50 tokens, 4
    heads of 8, one group, state 16, chunk 32), float32: mamba_ssm's kernels clamp dt' to 0 and so
    must ours. Output, final state and every gradient of each within 1e-5 of the float64 oracle
    and of each other. mamba_ssm's dots run in IEEE float32 here (by default Triton rounds their
    float32 inputs to tf32, 1e-3 off; ours choose tf32x3 for float32 themselves)."""
    peer = _peer("mamba_chunk_scan_combined")
    if peer is None:
        pytest.skip("mamba_ssm's mamba_chunk_scan_combined is not importable")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    shape = Shape(batch=1, seqlen=50, nheads=4, headdim=8, ngroups=1, dstate=16, chunk=32)
    opts = dict(D="h", z=True, dt_bias=True, initial_states=True, seq_idx=[20]) if every_option else {}
    inputs = ssd_inputs(shape, 23, negative_dt=True, **opts)
    inputs["dt"] = inputs["dt"] - 0.1                                # a third and more below zero
    assert (inputs["dt"] + inputs.get("dt_bias", 0) < 0).float().mean() > 0.3
    ours = run_both(inputs)
    theirs = run_both({**inputs, "fn": peer})
    pairs = {k: ours[k] for k in ours}
    pairs.update({f"mamba_ssm {k}": theirs[k] for k in theirs})
    pairs.update({f"ours vs mamba_ssm {k}": (ours[k][0], theirs[k][0]) for k in ours})
    print({k: f"{e:.1e}" for k, e in assert_close(pairs, FP32_BOUND).items()})


@gpu
@pytest.mark.parametrize("norm", [False, True], ids=["gate", "rmsnorm"])
def test_split_conv1d_scan_matches_mamba_ssm(norm):
    """Differential: the same inputs through mamba_ssm's function, output and every gradient
    within the bf16 criterion (a check beside the oracle's, for users switching over)."""
    peer = _peer("mamba_split_conv1d_scan_combined", conv=True)
    if peer is None:
        pytest.skip("mamba_ssm's mamba_split_conv1d_scan_combined (with causal_conv1d's CUDA conv) is not importable")
    # SwiGLU channels only with the norm: mamba_ssm 2.3.2.post1's own backward fails with SwiGLU
    # channels, the z gate (no norm) and an out projection together (an out-projection gradient
    # d_nonssm columns short: "got [5, 4096] but expected shape compatible with [5, 4099]")
    full, opts = split_inputs(SPLIT_RECORD._replace(seqlen=4096, d_nonssm=3 if norm else 0), 21, norm=norm,
                              outproj="bias", D="h", dtype=torch.bfloat16, device="cuda")
    for k in ("outproj_weight", "outproj_bias"):       # a bf16 model's projection (mamba_ssm needs one dtype)
        full[k] = full[k].bfloat16()
    leaves = [k for k in SPLIT_LEAVES if full[k] is not None]
    results = []
    for fn in (mamba_cp.mamba_split_conv1d_scan_combined, peer):
        mine = {k: full[k].detach().clone().requires_grad_(True) for k in leaves}
        out, f = fn(**{**full, **mine}, **opts, return_final_states=True)
        w = draw(None, 5, dtype=out.dtype, device="cuda", weights=dict(out=out.shape))["out"]   # the same for both
        results.append([out.detach(), f.detach(), *torch.autograd.grad([out, f], list(mine.values()),
                                                                        [w, torch.ones_like(f)])])
    names = ["out", "final_states"] + ["d" + k for k in leaves]
    errs = {n: rel_rms(a, b) for n, a, b in zip(names, *results)}
    print(errs)
    assert all(e <= BF16_BOUND for e in errs.values()), errs


@gpu
def test_two_to_the_twenty_tokens():
    """x holds 2^32 elements: every offset must be int64. Checked against the same sequence
    run as two halves joined through initial_states (each half's x holds 2^31). Memory, to fit
    an 80 GB card: one set of inputs, shared by both runs; x itself weights the outputs (random,
    and no second 8 GiB); the gradients come from torch.autograd.grad, nothing accumulates; and
    the whole run's results wait on the host while the halves run."""
    L = 1 << 20
    inputs = ssd_inputs(Shape(batch=1, seqlen=L, **RECORD), 10, dtype=torch.bfloat16, D="h", dt_bias=True,
                        dt_softplus=True)
    assert inputs["x"].numel() == 1 << 32
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if k in DIFFERENTIABLE}
    wy = inputs["x"].detach()
    wf = draw(None, 12, device="cuda", weights=dict(final_states=(1, 64, 64, 128)))["final_states"]

    y, f = mamba_cp.mamba_chunk_scan_combined(**inputs, return_final_states=True)
    g_full = torch.autograd.grad([y, f], list(leaves.values()), [wy, wf])  # no (y * wy) products in memory
    y_full, f_full, g_full = y.detach().cpu(), f.detach(), [g.cpu() for g in g_full]
    del y, f
    peak_full = torch.cuda.max_memory_allocated()

    h = L // 2
    per_token = ("x", "dt", "B", "C")
    first = {**inputs, **{k: inputs[k][:, :h] for k in per_token}}
    second = {**inputs, **{k: inputs[k][:, h:] for k in per_token}}
    y1, f1 = mamba_cp.mamba_chunk_scan_combined(**first, return_final_states=True)
    y2, f2 = mamba_cp.mamba_chunk_scan_combined(**second, initial_states=f1, return_final_states=True)
    g_half = torch.autograd.grad([y1, y2, f2], list(leaves.values()), [wy[:, :h], wy[:, h:], wf])
    pairs = {"y, first half": (y1.detach(), y_full[:, :h]), "y, second half": (y2.detach(), y_full[:, h:]),
             "final_states": (f2.detach(), f_full)}
    pairs.update({"d" + k: (b, a) for k, a, b in zip(leaves, g_full, g_half)})
    peak_test = torch.cuda.max_memory_allocated()
    print({k: f"{rel_rms(a, b):.1e}" for k, (a, b) in pairs.items()},
          f"peak {peak_full / 2**30:.1f} GiB (the whole run), {peak_test / 2**30:.1f} GiB (the test)")
    assert_close(pairs, BF16_BOUND)


@check("CUDA graph", 0.0, skipped=lambda: "" if CUDA else "needs CUDA (graph capture)")
def graph_capture_check(rank, world, group, device, gpu=False, layout="virtual"):
    """Forward and backward of the CP path, collectives included, captured in one CUDA graph (the
    gradients of xBC, dt, the conv weight, dt_bias, A and D): the replay must equal eager bit for
    bit, and new inputs copied into the captured buffers
    must change the output and again equal eager (0 where so, inf where not)."""
    shape = CP_SMALL._replace(seqlen=600, nheads=8, headdim=32, dstate=32, chunk=64)
    full, opts = fused_inputs(shape.per_world(world), 7, dtype=torch.bfloat16, device=device)
    local = {k: (mamba_cp.shard(v, rank, world, layout) if k in CP_ACTIVATIONS and v is not None else v)
             for k, v in full.items()}
    static = {k: v.detach().clone().requires_grad_(v.is_floating_point()) if v is not None else None
              for k, v in local.items()}
    grad_of = [k for k in ("xBC", "dt", "conv_weight", "dt_bias", "A", "D") if static[k] is not None]
    dy = draw(None, 8, dtype=torch.bfloat16, device=device, weights=dict(dy=(*local["xBC"].shape[:2], 8, 32)))["dy"]

    def step():
        y = mamba_cp.mamba_conv1d_ssd_cp(
            static["xBC"], static["dt"], static["conv_weight"], static["conv_bias"], static["dt_bias"],
            static["A"], static["D"], opts["chunk_size"], headdim=opts["headdim"], ngroups=opts["ngroups"],
            cp_group=group, load_balancing=layout, initial_states=static["initial_states"])
        return (y, *torch.autograd.grad(y, [static[k] for k in grad_of], dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warm-up: compile, and create NCCL communicators
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    eager = step()
    checks = {"replay equals eager": all(torch.equal(a, b) for a, b in zip(captured, eager))}
    before = captured[0].clone()
    with torch.no_grad():
        static["xBC"].copy_(static["xBC"].flip(1))     # new inputs, same buffers
    graph.replay()
    eager = step()
    checks["new inputs change the output"] = not torch.equal(captured[0], before)
    checks["replay equals eager on new inputs"] = all(torch.equal(a, b) for a, b in zip(captured, eager))
    torch.cuda.synchronize()
    results = {f"{layout} forward and backward": {k: 0.0 if ok else float("inf") for k, ok in checks.items()}}
    return errors_everywhere(results, world, group, device)


def test_launch_keys_tell_triton_specializations_apart():
    """_Launched sends a launch whose key it has seen to the kernel compiled for that key, so the
    key must differ wherever Triton compiles differently: a tensor's dtype and 16-byte alignment,
    an integer's value (1, multiples of 16, 64-bit ones are specialized), inside tuples too; and
    the launcher gets addresses wherever an argument holds a tensor."""
    buf = torch.zeros(64)
    a, b, shifted = buf[:16], buf[16:32], buf[1:17]           # 0, 64 and 4 bytes past buf's start
    key = lambda *args: mamba_cp._launch_signature(0, args, {})[0]  # noqa: E731
    strides = mamba_cp._BL(16, 1)
    assert key(a, 3, strides, None) == key(b, 3, strides, None)
    different = [(a, 3, strides, None), (shifted, 3, strides, None), (a.double(), 3, strides, None),
                 (a, 1, strides, None), (a, 16, strides, None), (a, 2 ** 31, strides, None),
                 (a, 3, mamba_cp._BL(16, 2), None), (a, 3, strides, a), (a, 3, strides, 2.0), (a, True, strides, None)]
    assert len({key(*args) for args in different}) == len(different)
    edge = mamba_cp._ChunkEdge(a, b, None)
    assert key(edge) != key(mamba_cp._ChunkEdge(a, shifted, None))
    assert mamba_cp._launch_signature(0, (a, edge, strides, 7), {})[1] == [
        a.data_ptr(), (a.data_ptr(), b.data_ptr(), None), strides, 7]


@gpu
def test_known_launch_signatures_follow_their_inputs_gpu():
    """After a kernel's first launch for an argument signature, the next ones skip Triton's
    binding and go to its compiled launcher (_Launched). Repeated calls, then the same call with
    x and C at addresses 4 bytes past 16-byte alignment (Triton specializes on alignment: the
    kernels compiled for aligned ones must not run), all match the oracle, gradients too."""
    inputs = ssd_inputs(SMALL, 21, device="cuda", D="hp", dt_softplus=True, dt_bias=True, initial_states=True)
    for _ in range(3):
        assert_close(run_both(inputs), FP32_BOUND)
    assert all(k.compiled for k in (mamba_cp._state_pass_kernel, mamba_cp._output_fwd_kernel,
                                    mamba_cp._chunk_bwd_BC_kernel))
    bufs = {k: torch.zeros(inputs[k].numel() + 1, device="cuda", requires_grad=True) for k in ("x", "C")}
    for _ in range(2):
        shifted = {k: b[1:].view_as(inputs[k]) for k, b in bufs.items()}
        assert all(t.data_ptr() % 16 for t in shifted.values())
        with torch.no_grad():
            for k, t in shifted.items():
                t.copy_(inputs[k])
        call = {k: v for k, v in inputs.items() if k not in ("x", "C")}
        y, final = mamba_cp.mamba_chunk_scan_combined(**shifted, **call, return_final_states=True)
        oracle = {k: (v.detach().clone().requires_grad_(True) if k in ("x", "C") else v) for k, v in inputs.items()
                  if k != "chunk_size"}
        yr, fr = ref.ssd_reference(**oracle)
        w = torch.randn_like(yr)
        got = torch.autograd.grad((y * w.float()).sum() + final.sum(), list(bufs.values()))
        want = torch.autograd.grad((yr * w).sum() + fr.sum(), [oracle["x"], oracle["C"]])
        assert_close({"y": (y, yr), "final_states": (final, fr), "dx": (got[0][1:].view_as(y), want[0]),
                      "dC": (got[1][1:].view_as(inputs["C"]), want[1])}, FP32_BOUND)


@gpu
def test_cuda_graph_capture_single_device():
    """The fused function in a world of one (no group) is captured and replayed."""
    expect(graph_capture_check(0, 1, None, "cuda"), graph_capture_check.check.bound, "CUDA graph")


# ---------------------------------------------------------------------------------------------
# The module reads in the order the method runs; Part I runs alone; the worked example
# ---------------------------------------------------------------------------------------------


def _reading_order():
    """(module docstring map, section headers) of mamba_cp.py, as [(number, title)] each."""
    import re
    doc = [(int(n), t.strip()) for n, t in re.findall(r"^ {2,3}(\d+)\. (.+)$", mamba_cp.__doc__, flags=re.M)]
    with open(mamba_cp.__file__) as f:
        headers = [(int(n), t.strip()) for n, t in re.findall(r"^# -{20,}\n# (\d+)\. (.+)$", f.read(), flags=re.M)]
    return doc, headers


def test_module_map_is_the_section_list():
    """The module docstring's reading order is the list of section headers, in order."""
    doc, headers = _reading_order()
    assert len(headers) >= 10 and [n for n, _ in headers] == list(range(1, len(headers) + 1)), headers
    assert doc == headers, f"docstring map {doc} differs from the section headers {headers}"


def _top_level(src):
    """[(node, names it binds, names it reads anywhere, names it reads when the module is
    imported)] for the top-level statements of a module's source. Import time is everything but
    the bodies of functions (decorators, defaults and annotations are read then; a function's
    body reads its names when called, so it may name what the module defines below it)."""
    import ast

    def reads(*trees):
        return {n.id for t in trees if t is not None for n in ast.walk(t)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    def at_import(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [x for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None]
            return reads(*node.decorator_list, *a.defaults, *a.kw_defaults, node.returns,
                         *(x.annotation for x in params))
        if isinstance(node, ast.ClassDef):
            return reads(*node.decorator_list, *node.bases, *(k.value for k in node.keywords)).union(
                *(at_import(stmt) for stmt in node.body))
        return reads(node)

    out = []
    for node in ast.parse(src).body:
        bound = {node.name} if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else set()
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, (ast.Name, ast.Tuple)):
                    bound |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
        out.append((node, bound, reads(node), at_import(node)))
    return out


def _boundary_violations(src):
    """Part I's uses of names that only Part II defines, Part II's rebinding of a Part I name, and
    every name read at import time above its definition: [(line, user, name)]."""
    split = src[:src.index("\n# PART II.")].count("\n") + 1
    nodes = _top_level(src)
    part_one = set().union(*(b for n, b, _, _ in nodes if n.lineno < split))
    part_two = set().union(*(b for n, b, _, _ in nodes if n.lineno > split)) - part_one
    first_line = {}
    for node, bound, _, _ in nodes:
        for name in bound:
            first_line.setdefault(name, node.lineno)
    bad = []
    for node, bound, read, early in nodes:
        who = getattr(node, "name", None) or sorted(bound) or node.lineno
        for name in sorted(read - bound):
            if node.lineno < split and name in part_two:
                bad.append((node.lineno, who, f"{name} (Part II) in Part I"))
        for name in sorted(bound & part_one if node.lineno > split else ()):
            bad.append((node.lineno, who, f"{name} (Part I) bound again in Part II"))
        for name in sorted(early - bound):
            if first_line.get(name, 0) > node.lineno:
                bad.append((node.lineno, who, f"{name} before its definition (line {first_line[name]})"))
    return bad


def test_part_one_stands_alone():
    """Part I of mamba_cp.py (the method) uses no name that Part II defines, Part II binds none of
    Part I's names again, and nothing is read at import time above its definition. The probes
    show each check failing: a Part I function given a use of _check_cp_inputs (Part II), a
    default argument naming a class defined below it, and a Part II assignment to TUNINGS."""
    with open(mamba_cp.__file__) as f:
        src = f.read()
    assert "\n# PART I. THE METHOD" in src and "\n# PART II." in src
    assert _boundary_violations(src) == []
    part_one_end = src.index("\n# PART II.")
    probes = [("def _rank_and_world(group):\n", "def _rank_and_world(group):\n    _check_cp_inputs\n",
               "_check_cp_inputs (Part II) in Part I"),
              ("def method_forward(call, plan, gate=None):", "def method_forward(call, plan, gate=LaunchPlan):",
               "LaunchPlan before its definition"),
              ("\nCORE_OPS = ", "\nTUNINGS = {}\nCORE_OPS = ", "TUNINGS (Part I) bound again in Part II")]
    for old, new, want in probes:
        probe = src.replace(old, new, 1)
        assert probe != src, old
        assert [v[2] for v in _boundary_violations(probe)][0].startswith(want), (want, _boundary_violations(probe))
    assert src.index("def _rank_and_world") < part_one_end < src.index("\nCORE_OPS = ")


def part_one_alone():
    """Part I of mamba_cp.py run alone, as a module of its own (compiled under the file's name,
    so its kernels' source lines are the file's)."""
    with open(mamba_cp.__file__) as f:
        src = f.read()
    module = types.ModuleType("mamba_cp_part_one")
    module.__file__ = mamba_cp.__file__
    exec(compile(src[:src.index("\n# PART II.")], mamba_cp.__file__, "exec"), module.__dict__)
    return module


def part_one_entry(module):
    """mamba_conv1d_ssd_cp's arguments and results, computed by a Part I module alone: its Plan,
    and its StatePassingFn with METHOD, on the layouts "none" and "virtual"."""
    def fn(xBC, dt, conv_weight, conv_bias, dt_bias, A, D, chunk_size, *, headdim, ngroups, cp_group=None,
           load_balancing="none", seq_idx=None, initial_states=None, dt_limit=(0.0, math.inf),
           return_final_states=False, activation="silu"):
        per_row = 2 if load_balancing == "virtual" else 1
        rows = lambda t: t.reshape(t.shape[0] * per_row, t.shape[1] // per_row, *t.shape[2:])   # noqa: E731
        call = module.Call(rows(xBC), rows(dt), conv_weight, conv_bias, dt_bias, A, D, initial_states,
                           None if seq_idx is None else rows(seq_idx.to(torch.int32)).contiguous())
        plan = module.Plan(call, xBC.shape[0], chunk_size, headdim, ngroups, dt_limit, activation is not None,
                           group=cp_group, load_balancing=load_balancing)
        y, final = module.StatePassingFn.apply(module.METHOD, plan, *call)
        return y.reshape(xBC.shape[0], -1, *y.shape[2:]), final
    return fn


@check("Part I alone", FP32_BOUND, gpu_bound=1e-4, alone=True)
def part_one_errors(rank, world, group, device, gpu=False):
    """Part I executed without Part II, its StatePassingFn against the oracle: documents across
    ranks and initial states, both layouts Part I holds; and Part II's import changes none of
    Part I's values (the tunings, the default tuning)."""
    module = part_one_alone()
    results = {}
    case = dict(shape=CP_SMALL._replace(batch=1), seed=3, path=part_one_entry(module), dt_limit=(0.05, 2.0),
                seq_idx=[5, 9 * world, 9 * world + 2])
    for layout in ("none", "virtual"):
        results[layout] = guarded(cp_case_errors, dict(case, layout=layout), rank, world, group, device)
    same = all(repr(getattr(module, name)) == repr(getattr(mamba_cp, name))      # each module its own classes
               for name in ("TUNINGS", "TUNED_KERNELS", "INTERPRET")) and repr(module.tuning()) == repr(
        mamba_cp.TUNINGS["gpu" if CUDA else "interpreter"])
    results["Part II changes nothing of Part I"] = {"values differ": 0.0 if same else float("inf")}
    return errors_everywhere(results, world, group, device)


def test_part_one_runs_alone():
    """Part I of mamba_cp.py executed alone, on two gloo ranks, against the oracle."""
    world_check(2, part_one_errors)


@check("worked example", FP32_BOUND, skipped=lambda: "its tensors are on the CPU (gloo)" if CUDA else "")
def worked_example_errors(rank, world, group, device, gpu=False):
    """`python mamba_cp.py`'s worked example (section 16) on two ranks: each step it prints,
    against the float64 oracle (largest absolute differences; its values are of order 1)."""
    if world != 2:
        return {"two ranks": Skipped("the worked example runs on two ranks")}
    errs = mamba_cp.worked_example(group, say=lambda *a: None)
    return errors_everywhere({"steps": errs}, world, group, device)


def test_worked_example():
    world_check(2, worked_example_errors)


# ---------------------------------------------------------------------------------------------
# torchrun --nproc_per_node=N test_mamba_cp.py: the CP checks in place, NCCL on GPUs (bf16 at the
# record shape, against the chunked oracle fed the same bf16 values), gloo on CPUs; then the
# same checks in a world of one on each rank's device. One line per rank and case, and a
# closing "N passed, N failed, N skipped" line (lines summed over the ranks).
# ---------------------------------------------------------------------------------------------


def _say(line):
    """One line to stdout in one write: the ranks share the terminal, and print's separate writes
    of the text and its newline let their lines run into one another."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _report(rank, label, results, bound):
    """One line per case of a check's results, PASS or FAIL by the verdict the pytest tests
    assert (failures), SKIP with its reason; returns (passed, failed, skipped)."""
    bad = failures(results, bound)
    for case, errs in results.items():
        if isinstance(errs, Skipped):
            _say(f"[rank {rank}] SKIP {label} {case}: {errs.reason}")
            continue
        worst = max(errs, key=lambda q: errs[q] if errs[q] == errs[q] else math.inf, default=None)
        _say(f"[rank {rank}] {'FAIL' if case in bad else 'PASS'} {label} {case}: "
             + (f"largest error {errs[worst]:.2e} ({worst})" if worst is not None else "nothing measured")
             + (f", above {bound:g}: {bad[case]}" if case in bad else ""))
    ran = measured(results)
    return len(ran) - len(bad), len(bad), len(results) - len(ran)


def main():
    """Every registered check (CHECKS, in this file's order) on the torchrun world, judged as
    the pytest tests judge them; the CP check again in a world of one on each rank."""
    backend = "nccl" if CUDA else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu"
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{torch.cuda.current_device()}"
    group = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)] if world > 1 else None   # collective: every rank makes each
    counts = [0, 0, 0]                                                              # passed, failed, skipped
    for chk in CHECKS:
        why = chk.skipped()
        if why:
            _say(f"[rank {rank}] SKIP W={world} {chk.label}: {why}")
            counts[2] += 1
            continue
        runs = [(f"W={world}", rank, world, group)]
        if chk.alone and world > 1:
            runs.append(("W=1", 0, 1, singles[rank]))
        for label, r, w, g in runs:
            results = chk.run(r, w, g, device, gpu=CUDA)
            counts = [c + n for c, n in zip(counts, _report(rank, f"{label} {chk.label}", results,
                                                            chk.gpu_bound if CUDA else chk.bound))]
            if chk.run is cp_world_check and w == world and rank == 0:
                _say(f"[rank 0] largest relative RMS per tensor, W={world}: "
                     + ", ".join(f"{t} {e:.2e}" for t, e in sorted(largest(results).items())))
    totals = torch.tensor(counts, device=device)
    dist.all_reduce(totals, group=group)
    dist.barrier()
    passed, failed, skipped = totals.tolist()
    if rank == 0:
        _say(f"{passed} passed, {failed} failed, {skipped} skipped")
    dist.destroy_process_group()
    sys.exit(1 if failed or not passed else 0)



# ---------------------------------------------------------------------------------------------
# Training under CP: checkpointing, accumulation, FSDP2 bf16, and examples/train_cp.py. What a
# trainer adds around enable_cp, each at W = 2 on gloo against transformers' unsharded model
# (hf_reference's arithmetic: each packed document alone, the batch's count of predicted tokens
# as divisor); then the example trainer, its cp 2 losses against its own cp 1 run and a resumed
# run against an uninterrupted one, through torchrun.
# ---------------------------------------------------------------------------------------------

# HF_TRAINED's Bamba (a Mamba2 layer, then a grouped-query rotary attention layer) with its mixer
# in 2 heads of 32 channels and one B/C group: half the interpreter's time of 8 heads of 8 (a
# forward and backward of 2 x 22 tokens, 4.8 to 2.4 s; the sections above train the 8 heads)
TRAINED = ("BambaForCausalLM", "BambaConfig", dict(HF_TRAINED["BambaForCausalLM"][1], mamba_n_heads=2,
                                                   mamba_d_head=32, mamba_n_groups=1))
TRAIN_STEPS = 2
# what each case adds to enable_cp: the checkpointing (transformers' switch, reentrant or not;
# torch.utils.checkpoint around each decoder layer's forward), FSDP2 over the 2 ranks (dp 1 x
# cp 2), the micro-batches of each optimizer step (each a row of the batch), a bf16 policy
TRAIN_CASES = {
    "hf_checkpointing_reentrant": dict(checkpointing="hf_reentrant"),
    "hf_checkpointing": dict(checkpointing="hf"),
    "fsdp2_layer_checkpoint_accumulation": dict(fsdp=True, checkpointing="layer", micro_batches=2),
    "fsdp2_bf16": dict(fsdp=True, bf16=True),
}


def trained_model():
    import transformers
    name, config_name, options = TRAINED
    torch.manual_seed(0)
    return getattr(transformers, name)(getattr(transformers, config_name)(**options))


def training_reference(cast=None, steps=TRAIN_STEPS):
    """transformers' own path on the whole packed batch (unsharded_training), float32 parameters
    and AdamW; with cast, FSDP2's param_dtype imitated. Losses per step, the first step's
    gradients, the parameters after the last."""
    model = trained_model()
    return unsharded_training(model, *hf_batch(model.config.vocab_size, True), steps, cast)


def _float32_kernels(kernel):
    """mamba_cp's fused mixer call with its bf16 tensors handed over in float32 and its output
    returned in the input's dtype. On a CPU the Triton interpreter holds bf16 values as 16-bit
    integers (numpy uint16): its loads, stores and conversions to and from float32 are right, but
    its adds, multiplies and tl.dot compute on those integers (through this policy, gradients
    1e22 off). So the bf16 case's kernels see float32 there; the rest of the model runs in bf16."""
    def call(*args, **kwargs):
        up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t   # noqa: E731
        return kernel(*map(up, args), **{k: up(v) for k, v in kwargs.items()}).to(args[0].dtype)
    return call


def training_run(rank, world, group, case, meshes, steps=TRAIN_STEPS):
    """One case of TRAIN_CASES on this rank: enable_cp ("virtual"), the case's additions, AdamW
    over the packed 2 x 44 batch. Global losses per step, the first step's gradients, the full
    parameters after the last, and for the bf16 case what the policy did."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    cp = _example()
    opts = TRAIN_CASES[case]
    model = trained_model()
    ids, positions = hf_batch(model.config.vocab_size, True)
    items = sum(b - a - 1 for _, a, b in hf_documents(ids, positions))
    cp_group = meshes[0].get_group("cp") if opts.get("fsdp") else group
    model = cp.enable_cp(model, cp_group, "virtual")
    ckpt = opts.get("checkpointing")
    if ckpt in ("hf", "hf_reentrant"):
        reentrant = {"use_reentrant": ckpt == "hf_reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):   # the switch's newer name (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
    elif ckpt == "layer":
        for layer in model.model.layers:
            layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    policy = {}
    if opts.get("bf16"):
        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if opts.get("fsdp"):
        for layer in model.model.layers:
            fully_shard(layer, mesh=meshes[1], **policy)
        fully_shard(model, mesh=meshes[1], **policy)
    seen = {}

    def dtypes_in_forward(module, args):          # after FSDP2's own hook: the parameters the layer computes with
        seen.setdefault("forward_dtypes", sorted({str(p.dtype) for p in module.parameters()}))
    model.model.layers[0].register_forward_pre_hook(dtypes_in_forward)
    calls = [0]                                   # the mixer's forwards: one per micro-batch, two when recomputed
    cp._mamba2_mixers(model)[0].register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    micro = opts.get("micro_batches", 1)
    rows = [slice(i * 2 // micro, (i + 1) * 2 // micro) for i in range(micro)]
    batches = [cp.shard_batch(ids[r], ids[r], rank, world, "virtual", position_ids=positions[r]) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    kernel = mamba_cp.mamba_split_conv1d_scan_combined
    if opts.get("bf16") and mamba_cp.INTERPRET:
        mamba_cp.mamba_split_conv1d_scan_combined = _float32_kernels(kernel)
    try:
        for _ in range(steps):
            opt.zero_grad()
            total = torch.zeros(())
            for i, batch in enumerate(batches):
                if opts.get("fsdp"):
                    model.set_requires_gradient_sync(i == micro - 1)     # reduce-scatter once per step
                loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], seq_idx=batch["seq_idx"],
                             labels=batch["shift_labels"], shift_labels=batch["shift_labels"],
                             num_items_in_batch=items, use_cache=False).loss   # a cache would be refilled on recompute
                (loss * (world if opts.get("fsdp") else 1)).backward()   # FSDP2 averages over its 2 ranks
                total += loss.detach().float()
            if not opts.get("fsdp"):
                cp.all_reduce_grads(model, group)
            dist.all_reduce(total, group=group)
            if not losses:
                grads = _grads(model)
                if opts.get("bf16"):
                    whole = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
                    seen["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
                    # summed in float32: a sum of the ranks' bf16 gradients is mostly not a bf16 number
                    seen["grads_off_bf16"] = (whole != whole.bfloat16().float()).double().mean().item()
            losses.append(total.item())
            opt.step()
    finally:
        mamba_cp.mamba_split_conv1d_scan_combined = kernel
    seen["mixer_calls_per_micro_batch"] = calls[0] / (steps * micro)
    if opts.get("bf16"):
        seen["master_dtypes"] = sorted({str(p.dtype) for p in model.parameters()}
                                       | {str(s["exp_avg"].dtype) for s in opt.state.values()})
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return losses, grads, params, seen


def training_figures(run, want):
    """(losses, first gradients, parameters) of a run against another's: relative errors."""
    (losses, grads, params), (w_losses, w_grads, w_params) = run, want
    return dict(losses=[abs(a - b) / abs(b) for a, b in zip(losses, w_losses)], grads=rel_rms(grads, w_grads),
                params=rel_rms(torch.cat([params[n].flatten() for n in w_params]),
                               torch.cat([w_params[n].flatten() for n in w_params])))


def training_features(rank, world, group, device):
    """Every case of TRAIN_CASES at W = 2; rank 0 computes the float32 reference while rank 1
    computes the bf16-cast one, and each hands its to the other. Per case, on every rank (the
    runs' losses are all-reduced and their gradients and parameters gathered whole): the run's
    figures, their errors against the float32 reference, and for the bf16 case also against the
    bf16-cast reference, whose own errors against float32 stand beside them."""
    from torch.distributed.device_mesh import init_device_mesh
    meshes = (init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp")), init_device_mesh("cpu", (world,)))
    out = {}
    for case in TRAIN_CASES:
        started = time.process_time()
        losses, grads, params, seen = training_run(rank, world, group, case, meshes)
        out[case] = dict(losses=losses, grads=grads, params=params, seen=seen, seconds=time.process_time() - started)
    refs = [training_reference(None if rank == 0 else torch.bfloat16)]
    got = [None, None]
    for src in (0, 1):
        box = refs if rank == src else [None]
        dist.broadcast_object_list(box, src=src, group=group)
        got[src] = box[0]
    single, cast = got
    result = {}
    for case, r in out.items():
        run = (r["losses"], r["grads"], r["params"])
        figures = dict(cp=r["losses"], single=single[0], seconds=r["seconds"], seen=r["seen"],
                       against_single=training_figures(run, single))
        if TRAIN_CASES[case].get("bf16"):
            figures.update(cast=cast[0], against_cast=training_figures(run, cast),
                           cast_against_single=training_figures(cast, single))
        result[case] = figures
    return result


def assert_training(result):
    """training_features' figures of one rank: printed, then each case within its bound."""
    for case, r in result.items():
        errs = r["against_single"]
        print(f"{case}: CP losses {r['cp']}, unsharded {r['single']}; against the unsharded float32 run: losses "
              f"{max(errs['losses']):.1e}, first gradients {errs['grads']:.1e}, parameters {errs['params']:.1e}; "
              f"{r['seen']}; {r['seconds']:.1f} CPU s on this rank")
        assert len(r["cp"]) == TRAIN_STEPS and r["cp"][-1] < r["cp"][0], f"{case}: the loss must fall ({r['cp']})"
        opts = TRAIN_CASES[case]
        recomputed = 2.0 if opts.get("checkpointing") else 1.0
        assert r["seen"]["mixer_calls_per_micro_batch"] == recomputed, f"{case}: {r['seen']}"
        if not opts.get("bf16"):
            assert max(errs["losses"]) <= HF_BOUND and errs["grads"] <= HF_BOUND and errs["params"] <= HF_BOUND, \
                f"{case}: {errs}"
            continue
        cast, own = r["against_cast"], r["cast_against_single"]
        print(f"{case}: against the unsharded model under the same bf16 cast: losses {max(cast['losses']):.1e}, "
              f"first gradients {cast['grads']:.1e}, parameters {cast['params']:.1e}; that run against float32: "
              f"losses {max(own['losses']):.1e}, first gradients {own['grads']:.1e}, parameters {own['params']:.1e}")
        assert max(cast["losses"]) <= BF16_BOUND and cast["grads"] <= BF16_BOUND and cast["params"] <= BF16_BOUND, \
            f"{case}: against the bf16-cast unsharded run {cast}"
        assert errs["grads"] <= 2 * own["grads"], f"{case}: CP's bf16 gradients {errs['grads']:.2e} from float32's, " \
            f"transformers' own bf16 {own['grads']:.2e}"
        seen = r["seen"]
        assert seen["forward_dtypes"] == ["torch.bfloat16"], seen          # param_dtype: bf16 compute
        assert seen["grad_dtypes"] == seen["master_dtypes"] == ["torch.float32"], seen   # float32 shards, AdamW
        assert seen["grads_off_bf16"] > 0.25, seen                          # reduce_dtype: summed in float32


@needs_transformers
def test_training_under_cp():
    """W = 2, Bamba (TRAINED) on the packed 2 x 44 batch, 2 AdamW steps per case (TRAIN_CASES):
    transformers' activation checkpointing switch, reentrant and not; torch.utils.checkpoint
    around each decoder layer under FSDP2 with two micro-batches per step; FSDP2 with a bf16
    MixedPrecisionPolicy. Losses per step, the first step's gradients and the parameters after
    the last against transformers' unsharded model: float32 cases within HF_BOUND; the bf16
    case within BF16_BOUND of the unsharded model run under the same bf16 cast (bf16 keeps 8
    significant bits: 2^-8 = 3.9e-3 per rounding; that run's own gradients are ~7e-3 from
    float32's), its gradients no further from float32's than twice that run's, and the policy
    seen at work: bf16 parameters in the forward, float32 shards, AdamW state and reduction
    (the gradients the reduce-scatter sums from the ranks' bf16 ones are mostly not bf16
    numbers). The checkpointed cases run each mixer twice per micro-batch (the recompute)."""
    ranks = world_results(2, "training_features", timeout=900)
    assert set(ranks[0]) == set(TRAIN_CASES), ranks[0]
    for result in ranks:
        assert_training(result)



# the trainer on the tests' size: 2 steps of 2 rows of 32 tokens (synthetic documents of 8 to 48
# tokens, so rows and rank boundaries cut through them), a save after every step
TRAINER = os.path.join(EXAMPLES, "train_cp.py")
TRAINER_ARGS = ("--config", "tiny", "--cp", "2", "--steps", "2", "--seq-len", "32", "--batch", "2", "--save-every", "1")


# each rank imports this file first, for its interpreter patch (_interpreter_patches_language_once:
# the same arithmetic, bit for bit, in half the time), then runs the trainer as torchrun would
_TRAINER_RANK = """
import runpy, sys
sys.path[:0] = [{root!r}, {examples!r}]
import test_mamba_cp
sys.argv = [{trainer!r}] + sys.argv[1:]
runpy.run_path({trainer!r}, run_name="__main__")
"""


def run_trainer(*args, timeout=600):
    """torchrun --nproc_per_node=2 examples/train_cp.py *args on CPUs (gloo), its process group
    killed past `timeout` seconds: its stdout."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")   # gloo ranks: the interpreter
    rank = _TRAINER_RANK.format(root=os.path.dirname(EXAMPLES), examples=EXAMPLES, trainer=TRAINER)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "--no-python", sys.executable, "-c", rank, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"train_cp.py {' '.join(args)}: timed out after {timeout} s\n{out[-2000:]}{err[-2000:]}")
    assert proc.returncode == 0, f"train_cp.py {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    print(out)
    return out


def _saved(path):
    """A torch.distributed.checkpoint save, read whole in this process: {name: value}, the
    model's and optimizer's tensors by their names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path + ".pt")
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value
    walk("", torch.load(path + ".pt", weights_only=False))
    return flat


@needs_transformers
def test_train_cp_parity_and_resume(tmp_path):
    """examples/train_cp.py through torchrun on 2 gloo ranks (tiny GraniteMoeHybrid, synthetic
    packed documents, per-layer activation checkpointing, FSDP2, AdamW): --parity's cp 2 losses
    against its cp 1 run (dp 2) on the same data within HF_BOUND at each step; then a run
    resumed from the save after step 1 prints step 2's loss as the uninterrupted run did (9
    digits: float32's every bit), and its save after step 2 (model, AdamW state, step and data
    position) equals the uninterrupted run's, bit for bit."""
    why = _interpreter_fails_here()
    if why:
        pytest.skip(f"the gloo ranks need the Triton interpreter, which fails here: {why}")
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    out = run_trainer(*TRAINER_ARGS, "--parity", "--checkpoint-dir", first)
    parity = [line.split(" | ") for line in out.splitlines() if line.startswith("parity: ") and "|" in line][1:]
    assert [int(row[0].split()[-1]) for row in parity] == [1, 2], out
    for step, cp2, cp1, _ in parity:
        assert abs(float(cp2) - float(cp1)) <= HF_BOUND * abs(float(cp1)), (step, cp2, cp1)
    resumed = run_trainer(*TRAINER_ARGS, "--checkpoint-dir", again, "--resume", os.path.join(first, "step-000001"))
    steps = [line.split(" | ")[:2] for line in resumed.splitlines() if line.startswith("step ")]
    assert steps == [["step 2/2", f"loss {parity[1][1]}"]], (steps, parity)
    want, got = _saved(os.path.join(first, "step-000002")), _saved(os.path.join(again, "step-000002"))
    assert set(got) == set(want) and {"step", "data"} <= {k.strip(".") for k in want}, sorted(want)
    differ = [k for k in want if not (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                                      else got[k] == want[k])]
    assert not differ, f"the resumed run's save differs from the uninterrupted run's: {differ}"
    print(f"resumed step 2: {steps[0][1]}, uninterrupted {parity[1][1]}; {len(want)} saved values identical")


if __name__ == "__main__":
    main()
