"""The users' benchmark of mamba_cp (README "Tests and benchmark").

    python bench.py                               one device: the three measurements below
    torchrun --nproc_per_node=N bench.py          every CP path side by side (--entry mixer: the mixer entry)
    python bench.py --model                       each path's modelled communication time, W = 2 to 1024
    python bench.py --conv                        the conv alone: plain, with a halo, document ids, both
    python bench.py --hybrid attention|step ...   examples/hybrid_bench.py (transformers hybrids, GPU)

One device: (1) the bytes each CP path receives per rank and layer call, from mamba_cp.comm_bytes,
the model summary_exchange="auto" decides by (computed; nothing runs). (2) mamba_chunk_scan_combined,
forward and forward+backward, beside the copy floor: one device copy of the bytes its forward
must move (x, B, C, dt read, y written); a copy reads and writes each byte, so the memory floor
is half of it. (3) In a world of one (one rank's work): mamba_conv1d_ssd_cp, conv included,
against the unfused layer (conv1d, then the SSD) and the SSD alone; the mixer entry
mamba_split_conv1d_scan_combined with the z gate against the core followed by the gate in torch.

torchrun: forward+backward of conv1d + SSD + exchanges at each global length (L/W tokens a rank,
L divisible by 2W) on each path: a2a (mamba_conv1d_ssd_a2a, the head-parallel baseline, fed the
zigzag shard a Megatron trainer hands the mixer), none (contiguous shards), permute_p2p and
permute_a2a (the zigzag shard made contiguous by sends or one all_to_all, and back), virtual (the
zigzag halves as two segments); "+scan": summaries by prefix scan, not all-gather. speedup = a2a
/ path. A path that raises is reported and the others run; a failure on some ranks only ends at
--timeout.

Timing: eager = a synchronize (under torchrun a barrier) outside, CUDA events around one call,
p50 over --iters after --warmup (under torchrun of each iteration's slowest rank): what a training
step sees, host latency included. graph = the call captured once into a CUDA graph (collectives
included) and its replays timed alike: the GPU alone. Peak memory: over one call, inputs included.
On CPU the kernels run in the Triton interpreter at a small float32 shape, by wall clock, without
graphs, copy floor or peak memory: that checks the script, not a GPU. Tables go to stdout, each
after its `RESULT {json}` line, progress to stderr. --launch and --kernel-chunk time a variant of
the Tuning in use. Developer instruments (per-kernel times, SASS counts, a revision against this
tree) are in tools/.
"""

import argparse
import collections
import dataclasses
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mamba_cp  # before anything that imports triton: it picks the interpreter when CUDA is absent

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DISTRIBUTED = int(os.environ.get("WORLD_SIZE", "1")) > 1     # torchrun with 2 or more ranks
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_REPS = 10  # back-to-back copies per timed sample of the copy floor
MIB = 2 ** 20
# "a2a" first: the speedup baseline. A state-passing path is its load_balancing with summaries and
# halos all-gathered; "+scan" sends them by prefix scan and between neighbours (summary_exchange="scan")
PATHS = ("a2a", "none", "permute_p2p", "permute_a2a", "virtual", "none+scan", "virtual+scan")

# the shape of record on a GPU; a small one for the interpreter
GPU_DEFAULTS = dict(lengths=[4096, 16384, 65536], iters=20, warmup=5, dtype="bf16", nheads=64, headdim=64,
                    ngroups=8, dstate=128, d_conv=4, chunk=128, local_length=[4096, 16384, 65536])
CPU_DEFAULTS = dict(lengths=[64, 128], iters=2, warmup=1, dtype="fp32", nheads=4, headdim=16, ngroups=2,
                    dstate=16, d_conv=4, chunk=16, local_length=[64])
CP_LENGTHS = dict(gpu=[8192, 32768, 131072], cpu=[256])   # global lengths under torchrun
COMM_WORLDS = (2, 4, 8, 16, 32, 64)
COMM_LENGTHS = (8192, 32768, 131072, 1048576)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


Shape = collections.namedtuple("Shape", "nheads headdim ngroups dstate d_conv")   # the mixer core's
RECORD_SHAPE = Shape(nheads=64, headdim=64, ngroups=8, dstate=128, d_conv=4)
RECORD_DTYPE = "bf16"


def shape_of(args):
    return Shape(args.nheads, args.headdim, args.ngroups, args.dstate, args.d_conv)


def conv_dim(s):
    """Channels of xBC = [x | B | C]."""
    return s.nheads * s.headdim + 2 * s.ngroups * s.dstate


def header(args, world=1):
    """The first line of a run: where, the versions, the shape, the timing and the tuning."""
    shape = " ".join(f"{k}={getattr(args, k)}" for k in (*Shape._fields, "chunk", "batch", "dtype"))
    where = (torch.cuda.get_device_name() if CUDA else "CPU: Triton interpreter, wall-clock times, NOT a GPU's")
    where += f", {world} ranks" if world > 1 else ""
    tuned = f"; TUNING {json.dumps(args.tuning)}" if args.tuning else ""
    return (f"# {where}; torch {torch.__version__}, triton {mamba_cp.triton.__version__}; {shape}; p50 of "
            f"{args.iters} iters after {args.warmup} warm-up{tuned}")


def config(args):
    """The fields every timed RESULT line carries."""
    return dict(batch=args.batch, dtype=args.dtype, **shape_of(args)._asdict(), chunk=args.chunk,
                iters=args.iters, warmup=args.warmup, timing=("cuda_events" if CUDA else "wall_clock_interpreter"),
                device=torch.cuda.get_device_name() if CUDA else "cpu (triton interpreter)",
                **({"tuning": args.tuning} if args.tuning else {}))


def fmt(v, spec=".3f", unit=""):
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def graphed(v, spec=".3f", unit=""):
    """The graph's figure beside an eager one, on a GPU; nothing on CPU, which has no graphs."""
    return f" (graph {fmt(v, spec, unit)})" if CUDA else ""


def ratio(a, b):
    return None if a is None or b is None else a / b


def short_error(e):
    """Exception type, and its message's first and last lines (where CUDA and Triton put the cause)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' | '.join(dict.fromkeys(lines[:1] + lines[-1:]))}"[:400]


def free():
    gc.collect()  # reference cycles (a failed call's traceback) hold tensors
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- inputs: random, seeded, never zeros; activations in --dtype, dt (raw) and parameters in fp32 -----------


def make_full(args, L):
    """The whole sequence's xBC, dt and gradient of y, and the parameters, from one generator
    seeded with --seed: the same on every rank."""
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    dtype, s = DTYPES[args.dtype], shape_of(args)

    def randn(*size, dt=torch.float32):
        return torch.randn(size, generator=gen, device=DEVICE, dtype=dt)

    def rand(*size):
        return torch.rand(size, generator=gen, device=DEVICE)

    seq = dict(xBC=randn(args.batch, L, conv_dim(s), dt=dtype), dt=randn(args.batch, L, s.nheads) * 0.5,
               grad=randn(args.batch, L, s.nheads, s.headdim, dt=dtype))
    params = dict(conv_weight=randn(conv_dim(s), s.d_conv) * s.d_conv ** -0.5, conv_bias=0.1 * randn(conv_dim(s)),
                  dt_bias=torch.log(torch.expm1(1e-3 + (1e-1 - 1e-3) * rand(s.nheads))),
                  A=-torch.exp(2.7 * rand(s.nheads)), D=1.0 + 0.1 * randn(s.nheads))
    return seq, params


def requiring_grad(leaves, grad):
    for t in leaves.values():
        t.requires_grad_(True)
    return leaves, grad


def split_xBC(xBC, args):
    """x (b, l, h, p), B and C (b, l, g, n): the channels of xBC = [x | B | C]."""
    hp, gn = args.nheads * args.headdim, args.ngroups * args.dstate
    x, B, C = xBC.split([hp, gn, gn], dim=-1)
    return (x.unflatten(-1, (args.nheads, args.headdim)), B.unflatten(-1, (args.ngroups, args.dstate)),
            C.unflatten(-1, (args.ngroups, args.dstate)))


def make_ssd_inputs(args, L):
    """The SSD's x, B, C (xBC's channels; B and C scaled by dstate^-1/2), dt, A, D, dt_bias, and
    the gradient of y."""
    seq, params = make_full(args, L)
    x, B, C = split_xBC(seq["xBC"], args)
    leaves = dict(x=x.contiguous(), dt=seq["dt"], A=params["A"], B=B * args.dstate ** -0.5,
                  C=C * args.dstate ** -0.5, D=params["D"], dt_bias=params["dt_bias"])
    return requiring_grad(leaves, seq["grad"])


def make_cp_local(args, L, rank=0, world=1, layout="none"):
    """This rank's xBC, dt and parameters in `layout` (the whole sequence freed), and its gradient of y."""
    seq, params = make_full(args, L)
    local = {k: mamba_cp.shard(v, rank, world, layout).contiguous() for k, v in seq.items()}
    del seq
    grad = local.pop("grad")
    return requiring_grad(dict(local, **params), grad)


def make_gated_local(args, L, rank=0, world=1, layout="none", separate=False):
    """This rank's zxbcdt = [z | xBC | dt] in --dtype (with `separate`, the same values as contiguous
    z, xBC and fp32 dt instead), the parameters, and the gradient of the gated output."""
    seq, params = make_full(args, L)
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed + 1)
    dtype, dim = DTYPES[args.dtype], args.nheads * args.headdim
    z, grad = (torch.randn(args.batch, L, dim, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
    z, xBC, dt, grad = (mamba_cp.shard(t, rank, world, layout).contiguous() for t in (z, seq["xBC"], seq["dt"], grad))
    del seq
    if separate:
        return requiring_grad(dict(z=z, xBC=xBC, dt=dt, **params), grad)
    return requiring_grad(dict(zxbcdt=torch.cat([z, xBC, dt.to(dtype)], dim=-1), **params), grad)


# ---- the calls under test: call(leaves, args, group) -> y ---------------------------------------------------


def layout_of(path):
    """(load_balancing, summary_exchange) of a path; a2a's load_balancing is its input's."""
    layout, _, scan = path.partition("+")
    return ("virtual" if layout == "a2a" else layout), ("scan" if scan else "all_gather")


def input_layout(path):
    """The layout of the shard a path is fed: contiguous for "none", zigzag otherwise."""
    return "none" if layout_of(path)[0] == "none" else "virtual"


def ssd_call(t, args, group=None):
    return mamba_cp.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], args.chunk, D=t["D"],
                                              dt_bias=t["dt_bias"], dt_softplus=True)


def core_call(t, args, group=None, path="none"):
    """The fused core (conv1d + SSD + exchanges) by `path`."""
    layout, exchange = layout_of(path)
    inputs = (t["xBC"], t["dt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"], t["D"], args.chunk)
    kw = dict(headdim=args.headdim, ngroups=args.ngroups, cp_group=group, load_balancing=layout)
    if path == "a2a":
        return mamba_cp.mamba_conv1d_ssd_a2a(*inputs, **kw)
    return mamba_cp.mamba_conv1d_ssd_cp(*inputs, summary_exchange=exchange, **kw)


def entry_call(t, args, group=None, path="none"):
    """The entry Mamba2 mixers call, on zxbcdt with the z gate; the a2a baseline has none: its core
    on views of zxbcdt, then the gate in torch."""
    if path == "a2a":
        dim = args.nheads * args.headdim
        z, xBC, dt = t["zxbcdt"].split([dim, t["zxbcdt"].shape[2] - dim - args.nheads, args.nheads], dim=-1)
        return core_call(dict(t, xBC=xBC, dt=dt), args, group, path).flatten(-2) * F.silu(z)
    layout, exchange = layout_of(path)
    return mamba_cp.mamba_split_conv1d_scan_combined(
        t["zxbcdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"], t["D"], args.chunk, headdim=args.headdim,
        ngroups=args.ngroups, cp_group=group, load_balancing=layout, summary_exchange=exchange)


def core_gate_call(t, args, group=None):
    """The core on a contiguous xBC, then the gate in torch: what the entry fuses."""
    return core_call(t, args, group).flatten(-2) * F.silu(t["z"])


class ConvFn(torch.autograd.Function):
    """mamba_cp's conv1d kernels as a plain autograd function: the unfused layer's conv."""

    @staticmethod
    def forward(ctx, xBC, weight, bias):
        ctx.save_for_backward(xBC, weight, bias)
        return mamba_cp.conv1d_fwd(xBC, weight, bias)

    @staticmethod
    def backward(ctx, du):
        xBC, weight, bias = ctx.saved_tensors
        dxBC, _, dweight, dbias = mamba_cp.conv1d_bwd(du.contiguous(), xBC, weight, bias)
        return dxBC, dweight.to(weight.dtype), dbias.to(bias.dtype)


def unfused_call(t, args, group=None):
    """The layer without CP and without fusion: conv1d, then the SSD on the split channels."""
    x, B, C = split_xBC(ConvFn.apply(t["xBC"], t["conv_weight"], t["conv_bias"]), args)
    return ssd_call(dict(t, x=x, B=B, C=C), args)


def make_steps(call, leaves, grad, args, group=None):
    """(forward under no_grad, forward+backward by autograd.grad into every leaf) as closures."""
    def fwd():
        with torch.no_grad():
            return call(leaves, args, group)

    def fwdbwd():
        return torch.autograd.grad(call(leaves, args, group), list(leaves.values()), grad)

    return fwd, fwdbwd


# ---- timers and memory --------------------------------------------------------------------------------------


def call_ms(fn):
    """One call of fn: a synchronize, then CUDA events around it; wall clock on CPU."""
    if not CUDA:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def p50_ms(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    return statistics.median([call_ms(fn) for _ in range(iters)])


def capture_graph(fn, warmup):
    """fn captured into a CUDA graph after warm-up calls on a side stream (as torch.cuda.graph's
    docs prescribe); the inputs are static tensors each replay reads in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(name, fn, args, errors):
    """p50 of fn's CUDA-graph replays; a failure goes to `errors` and gives None."""
    try:
        return p50_ms(capture_graph(fn, args.warmup).replay, args.iters, args.warmup)
    except Exception as e:  # noqa: BLE001 - report, do not end the sweep
        errors.append(f"{name}: {short_error(e)}")
        return None


def peak_mib(fn):
    """Peak allocated memory over one call (inputs included) and the allocation before it, MiB."""
    free()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / MIB, base / MIB


def copy_floor_ms(nbytes, iters, warmup):
    """p50 time of one device-to-device copy of nbytes, COPY_REPS back-to-back a sample so that
    launch gaps do not count."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)

    def copies():
        for _ in range(COPY_REPS):
            dst.copy_(src)

    return p50_ms(copies, iters, max(1, warmup)) / COPY_REPS


# ---- one device: the SSD, then the CP core and the mixer entry in a world of one ----------------------------


def bench_ssd(args, L):
    """The SSD at L tokens: forward and forward+backward, eager and graphed, the peak memory of
    forward+backward (or of the forward alone), and the copy floor. Returns the RESULT dict."""
    inp, grad = make_ssd_inputs(args, L)
    fwd, fwdbwd = make_steps(ssd_call, inp, grad, args)
    steps = {"fwd": fwd} if args.fwd_only else {"fwd": fwd, "fwdbwd": fwdbwd}
    r = dict(bench="ssd_single_device", L=L, **config(args), **dict.fromkeys((
        "fwd_ms", "fwdbwd_ms", "fwd_graph_ms", "fwdbwd_graph_ms", "peak_mib", "base_mib", "peak_of")))
    r["copy_bytes"] = sum(inp[k].nbytes for k in ("x", "B", "C", "dt", "x"))   # x, B, C, dt read, y written
    errors, graph_errors = [], []
    for phase, step in steps.items():
        try:
            r[f"{phase}_ms"] = p50_ms(step, args.iters, args.warmup)
            if CUDA:
                r["peak_mib"], r["base_mib"], r["peak_of"] = *peak_mib(step), phase
        except Exception as e:  # noqa: BLE001 - a failing backward must not hide the forward's numbers
            errors.append(f"{phase}: {short_error(e)}")
            log(f"SSD L={L}: {errors[-1]}")
    for phase, step in steps.items():    # after the peaks: a graph's memory pool would count in them
        if CUDA and not args.no_graph and r[f"{phase}_ms"] is not None:
            r[f"{phase}_graph_ms"] = graph_ms(phase, step, args, graph_errors)
    r["error"], r["graph_error"] = "; ".join(errors) or None, "; ".join(graph_errors) or None
    r["copy_floor_ms"] = copy_floor_ms(r["copy_bytes"], args.iters, args.warmup) if CUDA else None
    r["fwd_over_floor"] = ratio(r["fwd_ms"], r["copy_floor_ms"])
    r["fwd_graph_over_floor"] = ratio(r["fwd_graph_ms"], r["copy_floor_ms"])
    return r


def human_ssd(r):
    line = (f"L={r['L']:>7}: fwd {fmt(r['fwd_ms'])}{graphed(r['fwd_graph_ms'])}, "
            f"fwd+bwd {fmt(r['fwdbwd_ms'])}{graphed(r['fwdbwd_graph_ms'])}")
    if CUDA:
        line += (f"; copy floor {fmt(r['copy_floor_ms'])} for {r['copy_bytes'] / MIB:.1f} MiB, fwd / floor "
                 f"{fmt(r['fwd_over_floor'], '.2f', 'x')}{graphed(r['fwd_graph_over_floor'], '.2f', 'x')}; "
                 f"peak {fmt(r['peak_mib'], '.0f', ' MiB')} ({r['peak_of']})")
    return line + "".join(f"  [{k}: {r[k]}]" for k in ("error", "graph_error") if r[k])


# name, what it is, its inputs, its call: the per-rank work of one layer in a world of one
LOCAL_CALLS = (
    ("cp", "mamba_conv1d_ssd_cp, conv1d included (the CP path)", make_cp_local, core_call),
    ("unfused", "conv1d, then mamba_chunk_scan_combined (no CP, no state passing)", make_cp_local, unfused_call),
    ("ssd", "mamba_chunk_scan_combined alone (no conv)", make_ssd_inputs, ssd_call),
    ("split", "mamba_split_conv1d_scan_combined on zxbcdt, z gate", make_gated_local, entry_call),
    ("core_gate", "mamba_conv1d_ssd_cp on a contiguous xBC, then y * silu(z) in torch",
     functools.partial(make_gated_local, separate=True), core_gate_call),
)
LOCAL_RATIOS = (("cp", "unfused"), ("unfused", "ssd"), ("cp", "ssd"), ("split", "core_gate"))


def measure_call(name, call, inputs, args, graph_errors):
    """(eager ms, graph ms, peak MiB) of call on inputs: forward+backward, or the forward with
    --fwd-only. The peak is taken before the graph exists: its memory pool would count."""
    fwd, fwdbwd = make_steps(call, *inputs, args)
    step = fwd if args.fwd_only else fwdbwd
    ms = p50_ms(step, args.iters, args.warmup)
    if not CUDA:
        return ms, None, None
    peak = peak_mib(step)[0]
    return ms, None if args.no_graph else graph_ms(name, step, args, graph_errors), peak


def bench_local(args, L, sweep):
    """LOCAL_CALLS at L tokens; the SSD's figures come from `sweep` (bench_ssd's RESULT dicts)
    where it measured this length. Returns the RESULT dict."""
    phase = "fwd" if args.fwd_only else "fwdbwd"
    r = dict(bench="cp_local_vs_ssd", L_local=L, phase=phase, **config(args), ssd_source="measured here")
    errors, graph_errors = [], []
    same = [s for s in sweep if s["L"] == L and s[f"{phase}_ms"] is not None]
    for name, what, make, call in LOCAL_CALLS:
        keys = (f"{name}_ms", f"{name}_graph_ms", f"{name}_peak_mib")
        if name == "ssd" and same:
            r.update(zip(keys, (same[0][f"{phase}_ms"], same[0][f"{phase}_graph_ms"], same[0]["peak_mib"])))
            r["ssd_source"] = "the SSD above"
            continue
        log(f"[world of one] {what}, L={L}: {phase} ...")
        r.update(dict.fromkeys(keys))
        try:
            r.update(zip(keys, measure_call(name, call, make(args, L), args, graph_errors)))
        except Exception as e:  # noqa: BLE001 - report, time the others
            errors.append(f"{name}: {short_error(e)}")
        free()
    for a, b in LOCAL_RATIOS:
        r[f"{a}_over_{b}"] = ratio(r[f"{a}_ms"], r[f"{b}_ms"])
        r[f"{a}_over_{b}_graph"] = ratio(r[f"{a}_graph_ms"], r[f"{b}_graph_ms"])
    r["error"], r["graph_error"] = "; ".join(errors) or None, "; ".join(graph_errors) or None
    return r


def human_local(r):
    out = [f"\n# In a world of one (one rank's work), {r['L_local']} tokens, {r['phase']}, ms p50"
           + (" eager (graph)" if CUDA else "")]
    for name, what, _, _ in LOCAL_CALLS:
        source = f" [{r['ssd_source']}]" if name == "ssd" else ""
        out.append(f"  {fmt(r[f'{name}_ms']):>10}{graphed(r[f'{name}_graph_ms'])}  {what}{source}"
                   + (f", peak {fmt(r[f'{name}_peak_mib'], '.0f', ' MiB')}" if CUDA else ""))
    out.append("  " + ", ".join(f"{a} / {b} {fmt(r[f'{a}_over_{b}'], '.2f', 'x')}"
                                f"{graphed(r[f'{a}_over_{b}_graph'], '.2f', 'x')}" for a, b in LOCAL_RATIOS))
    out += [f"  [{k}: {r[k]}]" for k in ("error", "graph_error") if r[k]]
    return "\n".join(out)


# ---- communication: bytes from the shapes, and the exchange model's times -----------------------------------


def path_bytes(path, W, L, batch, shape, dtype):
    """mamba_cp.comm_bytes of a path (its docstring states every term); None where the path
    cannot run (a2a with nheads not divisible by W; L not divisible by 2W)."""
    layout, exchange = layout_of(path)
    return mamba_cp.comm_bytes("a2a" if path == "a2a" else layout, W, L, batch, dtype_bytes=DTYPES[dtype].itemsize,
                               summary_exchange=exchange, **shape._asdict())


def fmt_bytes(nbytes):
    if nbytes is None:
        return "n/a"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            v = nbytes / size
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{nbytes} B"


def report_comm_table(args):
    """The bytes-per-rank table, one block per W, and one RESULT line for all of it; at the run's
    shape or, with --comm-shape record, the record shape."""
    record = args.comm_shape == "record"
    shape, dtype, batch = (RECORD_SHAPE, RECORD_DTYPE, 1) if record else (shape_of(args), args.dtype, args.batch)
    costs = {(path, W, L): path_bytes(path, W, L, batch, shape, dtype)
             for W in COMM_WORLDS for L in COMM_LENGTHS for path in args.paths}
    print("RESULT " + json.dumps(dict(bench="comm_bytes", batch=batch, dtype=dtype, **shape._asdict(),
                                      columns=["path", "W", "L", "fwd_bytes", "bwd_bytes"],
                                      rows=[[*key, c and c["fwd"], c and c["bwd"]] for key, c in costs.items()])))
    print(f"\n# Bytes each rank receives per layer call, forward / backward, on the busiest rank: computed from "
          f"the shapes by comm_bytes(), not measured.\n# {' '.join(f'{k}={v}' for k, v in shape._asdict().items())} "
          f"batch={batch} {dtype}, no seq_idx. a2a: all-to-all of xBC, dt, y; none, virtual: fp32 summaries and "
          f"halos;\n# permute_*: none's exchanges plus the zigzag pieces that change rank; +scan: by prefix scan.")
    for W in COMM_WORLDS:
        print(f"W={W:<4} L{'':<8}" + "".join(f"{p:>23}" for p in args.paths))
        for L in COMM_LENGTHS:
            cells = [fmt_bytes(None) if c is None else f"{fmt_bytes(c['fwd'])} / {fmt_bytes(c['bwd'])}"
                     for c in (costs[path, W, L] for path in args.paths)]
            print(f"{'':<6} {L:<9}" + "".join(f"{cell:>23}" for cell in cells))
    if None in costs.values():
        print(f"n/a: that path cannot run at that W and L: a2a splits the {shape.nheads} heads over the W ranks "
              f"(nheads % W must be 0), and every path cuts L into 2W pieces (L % 2W must be 0)")
    sys.stdout.flush()


MODEL_WORLDS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MODEL_PATHS = ("a2a", "none", "none+scan", "virtual", "virtual+scan")


def measure_link(device, sizes=(8, 64 * MIB), iters=20):
    """alpha and beta between ranks 0 and 1 by ping-pong: half a round trip's p50 at a small and
    a large message (the other ranks wait). Returns a LinkModel, on every rank."""
    rank, half = dist.get_rank(), []
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        times = []
        for i in range(iters + 3):
            sync_barrier(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if CUDA:
                torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) / 2)
        half.append(statistics.median(times))
    t = torch.tensor(half, dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    (t_small, t_large), (small, large) = t.tolist(), sizes
    beta = max(t_large - t_small, 1e-15) / (large - small)
    return mamba_cp.LinkModel(alpha=max(t_small - beta * small, 0.0), beta=beta)


def report_model_table(links, local_length):
    """Per link, each path's modelled communication time per layer call (forward+backward, ms)
    at the record shape and local_length tokens a rank, and the exchange "auto" picks for "virtual"."""
    shape, dtype, batch = RECORD_SHAPE, RECORD_DTYPE, 1
    state = (shape.nheads, shape.headdim, shape.dstate)
    print(f"# Modelled communication per layer call, forward+backward, ms (comm_bytes' terms: messages x alpha + "
          f"bytes x beta, no overlap with compute): record shape, {dtype}, batch {batch}, {local_length} tokens a "
          f"rank (L = W x {local_length}); n/a: a2a needs nheads % W == 0")
    for name, link in links.items():
        previous, rows = mamba_cp.set_link_model(link), []
        try:
            for W in MODEL_WORLDS:
                costs = [path_bytes(p, W, W * local_length, batch, shape, dtype) for p in MODEL_PATHS]
                ms = [None if c is None else mamba_cp.modelled_seconds(c, link) * 1e3 for c in costs]
                rows.append((W, ms, mamba_cp.chosen_exchange("auto", W, "virtual", batch, state, conv_dim(shape),
                                                             shape.d_conv)))
        finally:
            mamba_cp.set_link_model(previous)
        print("RESULT " + json.dumps(dict(bench="exchange_model", link=name, alpha_s=link.alpha,
                                          beta_s_per_byte=link.beta, batch=batch, dtype=dtype, L_local=local_length,
                                          paths=MODEL_PATHS, rows=[dict(W=W, ms=ms, auto_virtual=a)
                                                                   for W, ms, a in rows])))
        print(f"\nlink {name}: alpha {link.alpha * 1e6:.2f} us, beta {1 / link.beta / 1e9:.1f} GB/s")
        print(f"{'W':>6}" + "".join(f"{p:>14}" for p in MODEL_PATHS) + f"{'auto (virtual)':>16}")
        for W, ms, auto in rows:
            print(f"{W:>6}" + "".join(f"{fmt(v):>14}" for v in ms) + f"{auto:>16}")
    sys.stdout.flush()


def main_model(args):
    """--model: the link measured where run with W >= 2 (torchrun), then the table for it and for
    mamba_cp.LINKS' assumed ones."""
    links = {}
    if DISTRIBUTED:
        rank, _, device = init_distributed(args)
        links[f"measured ({'NCCL' if CUDA else 'gloo'}, ranks 0-1)"] = measure_link(device)
        sync_barrier(device)
        dist.destroy_process_group()
        if rank != 0:
            return
    if not links:
        print("# link not measured: one process (run under torchrun with 2 or more ranks to measure it)")
    links.update({f"{name} (assumed)": link for name, link in mamba_cp.LINKS.items()})
    report_model_table(links, args.model_local_length)


# ---- torchrun: every CP path side by side -------------------------------------------------------------------


def init_distributed(args):
    """The process group from torchrun's environment (NCCL with CUDA, gloo on CPU). Returns
    (rank, world, device)."""
    device = "cpu"
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if CUDA else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    return dist.get_rank(), dist.get_world_size(), device


def sync_barrier(device):
    """All ranks line up, outside any timed region."""
    if CUDA:
        torch.cuda.synchronize()
    dist.barrier(device_ids=[torch.cuda.current_device()] if CUDA else None)
    if CUDA:
        torch.cuda.synchronize()


def agreed_error(error, device):
    """Every rank's error, agreed on: None where no rank failed, else one string naming the ranks.
    Every rank must call it at the same point."""
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() == 0:
        return None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    ranks_of = {}
    for r, m in enumerate(every):
        if m:
            ranks_of.setdefault(m, []).append(str(r))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(rs)}: {m}" for m, rs in ranks_of.items())


def time_distributed(step, args, device, label, rank):
    """--warmup then --iters calls of step. Per iteration: barrier outside the timed region, CUDA
    events (wall clock on CPU) around the call, then one all_reduce(MAX) of [ms, failed]: the
    slowest rank's time, and a stop on every rank at once when any raised. Returns (times, error)."""
    error, times = None, []
    for i in range(args.warmup + args.iters):
        if rank == 0 and i == 0:
            log(f"[rank 0] {label}: {args.warmup} warm-up and {args.iters} timed calls ...")
        sync_barrier(device)
        try:
            ms = call_ms(step)
        except Exception as e:  # noqa: BLE001 - agreed on below, reported in RESULT
            error, ms = short_error(e), 0.0
        agreed = torch.tensor([ms, 0.0 if error is None else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if agreed[1].item() > 0:
            return times, agreed_error(error, device)
        if i >= args.warmup:
            times.append(agreed[0].item())
    return times, None


FUNCTIONS = dict(core=("mamba_conv1d_ssd_a2a", "mamba_conv1d_ssd_cp"),   # by --entry: (a2a's, the others')
                 mixer=("mamba_conv1d_ssd_a2a then y * silu(z)", "mamba_split_conv1d_scan_combined"))


def bench_cp_path(args, path, L, rank, world, device):
    """One path at global length L on every rank; returns the RESULT dict (rank 0's is printed)."""
    c = path_bytes(path, world, L, args.batch, shape_of(args), args.dtype)
    r = dict(bench="cp_paths", path=path, input_layout="contiguous" if input_layout(path) == "none" else "zigzag",
             load_balancing=layout_of(path)[0], summary_exchange=None if path == "a2a" else layout_of(path)[1],
             function=FUNCTIONS[args.entry][path != "a2a"], entry=args.entry, W=world, L=L, L_local=L // world,
             **config(args), phase="fwd" if args.fwd_only else "fwdbwd", backend=dist.get_backend(),
             comm_fwd_bytes=c and c["fwd"], comm_bwd_bytes=c and c["bwd"], **dict.fromkeys((
                 "p50_ms", "min_ms", "max_ms", "speedup_vs_a2a", "peak_mib", "base_mib", "graph_p50_ms",
                 "graph_speedup_vs_a2a", "graph_error", "error")))
    r["timing"] += "_rank_max"
    label, step, error = f"{path} L={L}", None, None
    try:
        make, call = ((make_gated_local, entry_call) if args.entry == "mixer" else (make_cp_local, core_call))
        steps = make_steps(functools.partial(call, path=path), *make(args, L, rank, world, input_layout(path)),
                           args, dist.group.WORLD)
        step = steps[0] if args.fwd_only else steps[1]
    except Exception as e:  # noqa: BLE001 - input errors: agreed on, reported in RESULT
        error = short_error(e)
    r["error"] = agreed_error(error, device)
    if r["error"] is None:
        if CUDA:
            free()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times, r["error"] = time_distributed(step, args, device, label, rank)
        if times and r["error"] is None:
            r["p50_ms"], r["min_ms"], r["max_ms"] = statistics.median(times), min(times), max(times)
        if CUDA:
            mem = torch.tensor([torch.cuda.max_memory_allocated(), base], dtype=torch.float64, device=device)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            r["peak_mib"], r["base_mib"] = mem[0].item() / MIB, mem[1].item() / MIB
        if rank == 0:
            log(f"[rank 0] {label}: " + (f"p50 {r['p50_ms']:.3f} ms" if r["error"] is None else f"error: {r['error']}"))
        if CUDA and not args.no_graph and r["error"] is None:   # one graph on every rank, collectives included
            try:
                graph, error = capture_graph(step, args.warmup), None
            except Exception as e:  # noqa: BLE001 - agreed on below, reported in RESULT
                error = "graph capture: " + short_error(e)
            r["graph_error"] = agreed_error(error, device)
            if r["graph_error"] is None:
                times, r["graph_error"] = time_distributed(graph.replay, args, device, label + " (graph)", rank)
                r["graph_p50_ms"] = statistics.median(times) if times and r["graph_error"] is None else None
    del step
    free()
    return r


def human_cp_table(rows, world, args):
    """The side-by-side table of one length."""
    L = rows[0]["L"]
    out = [f"\nL={L} global, {L // world} tokens a rank, W={world}: {'fwd' if args.fwd_only else 'fwd+bwd'} of "
           f"conv1d + SSD + exchange, ms p50 of the rank maximum, eager and CUDA-graph replay (the GPUs alone)",
           f"{'path':<13}{'input':<12}{'p50 ms':>11}{'vs a2a':>9}{'graph ms':>10}{'vs a2a':>9}{'peak MiB':>10}"
           f"{'comm fwd / bwd per rank':>28}  note"]
    for r in rows:
        comm = "n/a" if r["comm_fwd_bytes"] is None else \
            f"{fmt_bytes(r['comm_fwd_bytes'])} / {fmt_bytes(r['comm_bwd_bytes'])}"
        notes = [f"ERROR: {r['error']}"] * bool(r["error"]) + [f"graph: {r['graph_error']}"] * bool(r["graph_error"])
        out.append(f"{r['path']:<13}{r['input_layout']:<12}{fmt(r['p50_ms']):>11}"
                   f"{fmt(r['speedup_vs_a2a'], '.2f', 'x'):>9}{fmt(r['graph_p50_ms']):>10}"
                   f"{fmt(r['graph_speedup_vs_a2a'], '.2f', 'x'):>9}{fmt(r['peak_mib'], '.0f'):>10}{comm:>28}  "
                   + "; ".join(notes))
    if any(r["comm_fwd_bytes"] is None for r in rows):
        out.append(f"comm n/a: the path cannot run at W={world} (a2a needs nheads % W == 0)")
    return "\n".join(out)


def main_distributed(args):
    rank, world, device = init_distributed(args)
    if rank == 0:
        print(header(args, world) + f", {dist.get_backend()}")
        print(f"# the CP paths {','.join(args.paths)}: {FUNCTIONS[args.entry][1]} (a2a: {FUNCTIONS[args.entry][0]}, "
              f"fed the zigzag shard); speedup = a2a p50 / path p50", flush=True)
    bad = [L for L in args.lengths if L % (2 * world)]
    if bad and rank == 0:
        print(f"# WARNING: lengths {bad} skipped: not divisible by 2W = {2 * world} (the zigzag layouts cut L into "
              f"2W pieces)", flush=True)
    for L in (L for L in args.lengths if L not in bad):
        rows = [bench_cp_path(args, path, L, rank, world, device) for path in args.paths]
        for key, speedup in (("p50_ms", "speedup_vs_a2a"), ("graph_p50_ms", "graph_speedup_vs_a2a")):
            base = next((r[key] for r in rows if r["path"] == "a2a"), None)
            for r in rows:
                r[speedup] = ratio(base, r[key])
        if rank == 0:
            for r in rows:
                print("RESULT " + json.dumps(r))
            print(human_cp_table(rows, world, args), flush=True)
    sync_barrier(device)
    dist.destroy_process_group()


# ---- --conv: the conv alone ---------------------------------------------------------------------------------

CONV_CASES = ("plain", "halo", "ids", "halo_ids")


def bench_conv(args, L):
    """conv1d_fwd and conv1d_bwd on xBC, forward and forward+backward, eager and graphed, as the CP
    path runs them: plain (a world of one), with a halo (a later segment), with document ids, and
    with both (packed documents under CP)."""
    torch.manual_seed(args.seed)
    dim, d1, dtype = conv_dim(shape_of(args)), args.d_conv - 1, DTYPES[args.dtype]
    xBC = torch.randn(args.batch, L, dim, device=DEVICE, dtype=dtype)
    w, bias = torch.randn(dim, args.d_conv, device=DEVICE) * 0.3, torch.randn(dim, device=DEVICE) * 0.1
    dout = torch.randn_like(xBC)
    halo = torch.randn(args.batch, d1, dim, device=DEVICE, dtype=dtype)
    seq = (torch.arange(L, device=DEVICE) // 1000).to(torch.int32).expand(args.batch, L).contiguous()  # 1k-token docs
    halo_seq = torch.zeros(args.batch, d1, device=DEVICE, dtype=torch.int32)
    r, errors = dict(bench="conv", L=L, dim=dim, **config(args)), []
    for name in CONV_CASES:
        kw = dict(halo=halo if "halo" in name else None, seq_idx=seq if "ids" in name else None,
                  halo_seq=halo_seq if name == "halo_ids" else None)
        fwd = functools.partial(mamba_cp.conv1d_fwd, xBC, w, bias, **kw)

        def fwdbwd(fwd=fwd, kw=kw):
            fwd()
            return mamba_cp.conv1d_bwd(dout, xBC, w, bias, **kw)[0]

        for phase, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            r[f"{name}_{phase}_ms"] = p50_ms(fn, args.iters, args.warmup)
            if CUDA and not args.no_graph:
                r[f"{name}_{phase}_graph_ms"] = graph_ms(f"{name} {phase}", fn, args, errors)
    r["graph_error"] = "; ".join(errors) or None
    return r


def main_conv(args):
    print(header(args) + f"\n# the conv alone on xBC of {conv_dim(shape_of(args))} channels, ms" +
          (", eager (graphed)" if CUDA else ""))
    for L in args.lengths:
        r = bench_conv(args, L)
        print("RESULT " + json.dumps(r))
        for phase in ("fwd", "fwdbwd"):
            cells = [f"{n} {fmt(r[f'{n}_{phase}_ms'])}{graphed(r.get(f'{n}_{phase}_graph_ms'))}" for n in CONV_CASES]
            print(f"L={L:>7} {phase:>6}: " + ", ".join(cells), flush=True)


# ---- the modes, their flags, and main -----------------------------------------------------------------------


def main_single(args):
    """One device: the communication table (computed), then the SSD at each --lengths, then the
    world of one at each --local-length; each RESULT line before its human lines."""
    print(header(args), flush=True)
    report_comm_table(args)
    print("\n# The SSD, mamba_chunk_scan_combined, ms p50" + (" eager (graph)" if CUDA else ""))
    sweep = []
    for L in args.lengths:
        log(f"[SSD] L={L} ...")
        sweep.append(bench_ssd(args, L))
        free()
        print("RESULT " + json.dumps(sweep[-1]))
        print(human_ssd(sweep[-1]), flush=True)
    for L in args.local_length:
        r = bench_local(args, L, sweep)
        print("RESULT " + json.dumps(r))
        print(human_local(r), flush=True)


def main_hybrid(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))
    import hybrid_bench
    hybrid_bench.main(args.hybrid or ["step"])


# by args.mode: --model, --conv or --hybrid picks its own; else torchrun with 2 or more ranks picks "cp"
MODES = dict(model=main_model, conv=main_conv, hybrid=main_hybrid, cp=main_distributed, single=main_single)


def add_tuning_flags(ap):
    """The flags apply_tuning reads (bench.py's, and tools/sass.py's and tools/against.py's)."""
    ap.add_argument("--launch", metavar="JSON", help="tuning: kernels' launch options, e.g. "
                    f"'{{\"bwd_x\": {{\"num_warps\": 4}}}}' (kernels: {', '.join(mamba_cp.TUNED_KERNELS)}; GPU only)")
    ap.add_argument("--kernel-chunk", dest="kernel_chunk", type=int, help="tuning: the kernels' chunk length, forward "
                    f"and backward (default {mamba_cp.tuning().chunk_fwd}; a power of two from 16)")
    ap.add_argument("--tuning-fields", dest="tuning_fields", metavar="JSON", help="tuning: any of its fields, e.g. "
                    "'{\"state_tile\": 32}' (a list for a tuple field)")


def apply_tuning(ap, args):
    """--launch, --kernel-chunk and --tuning-fields: a variant of mamba_cp's Tuning for this
    process, so that a tuning run needs no edit of mamba_cp.py; args.tuning records what changed."""
    base, changes, args.tuning = mamba_cp.tuning(), {}, {}
    if args.tuning_fields:
        try:
            fields = json.loads(args.tuning_fields)
        except json.JSONDecodeError:
            fields = None
        names = sorted(f.name for f in dataclasses.fields(base) if f.name != "name")
        if not isinstance(fields, dict) or not set(fields) <= set(names):
            ap.error(f"--tuning-fields: got {args.tuning_fields!r}, expected a JSON object of some of "
                     f"{', '.join(names)}")
        for k, v in fields.items():
            was = getattr(base, k)
            changes[k] = (was._make(v) if hasattr(was, "_make") else tuple(v)) if isinstance(was, tuple) else v
        args.tuning.update(fields)
    if args.launch:
        try:
            launch = json.loads(args.launch)
        except json.JSONDecodeError:
            launch = None
        if not isinstance(launch, dict) or any(k not in mamba_cp.TUNED_KERNELS or not isinstance(v, dict)
                                               for k, v in launch.items()):
            ap.error(f"--launch: got {args.launch!r}, expected a JSON object mapping some of "
                     f"{', '.join(mamba_cp.TUNED_KERNELS)} to option objects")
        changes["launch"], args.tuning["launch"] = {**base.launch, **launch}, launch
    if args.kernel_chunk is not None:
        q = args.tuning["kernel_chunk"] = args.kernel_chunk
        if q < 16 or q & (q - 1):
            ap.error(f"--kernel-chunk: got {q}, expected a power of two from 16")
        changes.update(chunk_fwd=q, chunk_bwd=q)
    if changes:
        mamba_cp.set_tuning(dataclasses.replace(base, name=base.name + " (bench flags)", **changes))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--model", action="store_true", help="each path's modelled communication time per layer for "
                      "W = 2..1024 (alpha and beta measured under torchrun with 2 or more ranks, and mamba_cp.LINKS')")
    mode.add_argument("--conv", action="store_true", help="the conv alone: plain, with a halo, document ids, both")
    mode.add_argument("--hybrid", nargs=argparse.REMAINDER, metavar="{attention,step} ...",
                      help="run examples/hybrid_bench.py with the arguments that follow (GPU, transformers): a hybrid "
                           "under examples/transformers_cp.py; `--hybrid step --help` for its options")
    ints = (lambda text: [int(v) for v in text.split(",") if v.strip()])      # noqa: E731 - a comma-separated list
    ap.add_argument("--lengths", type=ints, help="comma-separated sequence lengths, global under torchrun (default "
                    f"{GPU_DEFAULTS['lengths']} GPU, {CPU_DEFAULTS['lengths']} CPU; under torchrun "
                    f"{CP_LENGTHS['gpu']} GPU, {CP_LENGTHS['cpu']} CPU)")
    ap.add_argument("--local-length", "--local_length", dest="local_length", type=ints, help="one device: "
                    f"tokens of the world of one (default {GPU_DEFAULTS['local_length']} GPU, "
                    f"{CPU_DEFAULTS['local_length']} CPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, help="timed iterations (default 20 GPU, 2 CPU)")
    ap.add_argument("--warmup", type=int, help="untimed calls first (default 5 GPU, 1 CPU)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of x, B, C / xBC (default bf16 GPU, fp32 CPU)")
    for name in ("nheads", "headdim", "ngroups", "dstate", "d_conv", "chunk"):
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        ap.add_argument(*flags, dest=name, type=int, help=f"default {GPU_DEFAULTS[name]} GPU, {CPU_DEFAULTS[name]} CPU")
    ap.add_argument("--entry", choices=("core", "mixer"), default="core", help="torchrun: the fused core "
                    "(mamba_conv1d_ssd_cp on xBC, dt) or the mixer entry (mamba_split_conv1d_scan_combined on zxbcdt, "
                    "z gate; a2a: its core on views, then the gate in torch)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated CP paths, of {','.join(PATHS)}")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replays")
    ap.add_argument("--comm-shape", choices=("run", "record"), default="run", help="the bytes table's shape")
    ap.add_argument("--model-local-length", type=int, default=16384, help="--model: tokens a rank")
    ap.add_argument("--timeout", type=int, default=600, help="torchrun: the process group's timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    add_tuning_flags(ap)
    args = ap.parse_args(argv)
    apply_tuning(ap, args)
    flagged = [m for m in ("model", "conv", "hybrid") if getattr(args, m) not in (None, False)]
    args.mode = flagged[0] if flagged else "cp" if DISTRIBUTED else "single"
    defaults = dict(GPU_DEFAULTS if CUDA else CPU_DEFAULTS)
    if args.mode == "cp":
        defaults["lengths"] = CP_LENGTHS["gpu" if CUDA else "cpu"]
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        ap.error(f"--paths: got {unknown or 'nothing'}, expected some of {','.join(PATHS)}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
