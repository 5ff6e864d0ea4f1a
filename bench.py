"""Benchmark of mamba_cp (README "Tests and benchmark"): the single-device SSD, the context-parallel
paths side by side, and the bytes each path communicates.

It reaches no internal of mamba_cp, only public names: the functions it times; the module's
one cost model of the communication (comm_bytes, modelled_seconds, LinkModel, LINKS,
set_link_model, and chosen_exchange, what summary_exchange="auto" picks by that model), so the
bytes and times printed here are the ones "auto" decides by; and, for the tuning flags,
TUNED_KERNELS (the chunk kernels that take launch options) and the Tuning fields set_tuning takes.

Three measurements, dispatched by main() (and four more: `python bench.py --conv` times the conv
alone, plain, with a halo, with document ids and with both; `python bench.py --against REV` times
this tree's SSD and mixer entry against mamba_cp.py as committed at git revision REV, imported
beside it, in one process on the same inputs (before/after, "speedup" = before / after);
`python bench.py --hybrid attention|step ...` runs examples/hybrid_bench.py, transformers hybrids
under examples/transformers_cp.py; `python bench.py --sass [ARCH]` runs nothing: on any machine, a
GPU's or not, it compiles every kernel of the SSD and of the mixer entry, forward and backward, for
compute capability ARCH (default 90) at the record shape, and prints each one's registers, stack
bytes (spills) and SASS instructions, with --against REV REV's beside; it reaches into Triton's
runtime to do so, a stand-in driver and launches turned into compiles):

1. `python bench.py` (one device, no torchrun): the single-device chunked SSD.
   What is timed: `mamba_cp.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias,
   dt_softplus=True)` at batch 1 (flag --batch) for each sequence length L in --lengths:

     fwd       the forward alone (under torch.no_grad: no autograd record).
     fwdbwd    forward, then torch.autograd.grad of y with a fixed random grad_y into every input
               (x, dt, A, B, C, D, dt_bias).

   Each is timed two ways, side by side:

     eager     what a user's training step sees, host (Python, launch) overhead included: per
               iteration, torch.cuda.synchronize() outside the timed region, then CUDA events
               around the call. --warmup untimed calls first; the p50 over --iters is reported.
     graph     the GPU alone: the same call captured once into a CUDA graph (warm-up on a side
               stream, then torch.cuda.graph capture, inputs being static tensors the graph reads
               in place), and CUDA events around each g.replay(); p50 again. At short lengths the
               two differ by several times. A capture failure is reported in "graph_error"; a
               failing eager fwd+bwd in "error" (the forward numbers are still reported).

   Copy floor: the p50 time of one device-to-device copy (dst.copy_(src), uint8) of as many bytes
   as the forward must move at the least: x, B, C, dt read plus y written. Copies are run
   back-to-back between two events and the time divided by their number, so launch gaps do not
   count. A copy reads and writes every byte, so the true memory floor of the forward is half the
   copy floor; fwd_over_floor = fwd_ms / copy_floor_ms.

   Peak memory: torch.cuda.max_memory_allocated() over one eager fwd+bwd (fwd with --fwd-only),
   after reset_peak_memory_stats; it includes the inputs and grad_y (reported also as base_mib).

   Then, still on one device:
   (a) CP compute in a world of one ("bench": "cp_local_vs_ssd"): `mamba_conv1d_ssd_cp` with
       cp_group=None at each of the --local-length tokens (what one rank computes when each
       holds that many), forward+backward, eager and graphed (as above), against the conv-free
       `mamba_chunk_scan_combined` at the same length and shape. The CP side INCLUDES the causal
       conv1d (forward, recompute and backward); the SSD side has no conv. The SSD times are
       taken from the sweep above when the length is one of --lengths (the same call, the same
       timers), else measured here. Beside them, the
       unfused layer: conv1d, then `mamba_chunk_scan_combined` on the split channels, no CP and
       no state passing (unfused_ms): fused CP / unfused is what the CP machinery and the fusion
       cost together, unfused / SSD alone what the conv costs. Then the mixer entry
       `mamba_split_conv1d_scan_combined` on zxbcdt = [z | xBC | dt] with the z gate (split_ms)
       beside `mamba_conv1d_ssd_cp` on a contiguous xBC followed by y * silu(z) in torch
       (core_gate_ms). On CPU these calls get no warm-up unless --warmup is given (the
       interpreter compiles nothing; this keeps the CPU default short).
   (b) Communication volume ("bench": "comm_bytes"): bytes each path moves per rank per layer,
       forward and backward, computed from the shapes by mamba_cp.comm_bytes (its docstring states
       every term), for W in 2..64 and global L in 8192..1048576, at this run's shape (--comm-shape
       record: the record shape). Nothing is run; also on CPU.

2. `torchrun --nproc_per_node=N bench.py` (WORLD_SIZE > 1, or --cp): every CP path of the fused
   core (conv1d + SSD + the exchanges), forward+backward, side by side at each global length L
   in --lengths (each rank holds L/W tokens; L must be divisible by 2W):

     a2a          mamba_conv1d_ssd_a2a, the head-parallel all-to-all baseline, fed the zigzag
                  shard (load_balancing="virtual"), the layout a Megatron trainer hands the mixer
     none         mamba_conv1d_ssd_cp on a contiguous shard (state passing, one segment per rank)
     permute_p2p  zigzag shard, made contiguous by point-to-point sends, and back
     permute_a2a  zigzag shard, made contiguous by one all_to_all_single, and back
     virtual      zigzag shard, its two halves run as two causal segments (no activation moves)

   With --entry mixer every path but a2a calls `mamba_split_conv1d_scan_combined` on zxbcdt with
   the z gate instead, and a2a its core on views of zxbcdt followed by the gate in torch.

   Inputs: the full sequence is drawn on every rank's device from one seeded generator (the same
   on every rank, never zeros) and cut with mamba_cp.shard; the full tensors are freed before
   timing. Per iteration: dist.barrier() (and torch.cuda.synchronize()) outside the timed region;
   CUDA events around forward+backward (wall clock on CPU); then one all_reduce(MAX) of the time,
   so each iteration counts at its slowest rank. The timed call includes everything a training
   step pays, the library's per-call cross-rank input check (a small all-gather read back on the
   host) included. Then the same step captured in one CUDA graph on every rank, collectives
   included (warm-up on a side stream first; the input check is skipped under capture), and
   its replays timed the same way: the GPUs alone (graph_p50_ms, graph_speedup_vs_a2a; a
   capture failure on any rank goes to "graph_error"). Reported: p50 over --iters after --warmup, peak
   allocated memory over the path's iterations (max over ranks, inputs included), speedup =
   a2a_p50 / path_p50, and the path's computed communication bytes. One `RESULT {json}` line
   per path and L ("bench": "cp_paths"), printed by rank 0, and a table. A path that raises is
   reported in its RESULT line ("error") and the others still run: input errors (mamba_cp
   validates on every rank before any collective, e.g. a2a with nheads not divisible by W) and
   errors every rank hits. A failure on some ranks only (an OOM on one GPU) leaves the others
   inside a collective; the run then ends at the process-group timeout (--timeout).

3. --plot FILE.png (needs matplotlib, optional): left, time vs L per path (the CP paths under
   torchrun, the single-device kernel times otherwise); right, communicated bytes per rank vs L
   per path at W = --plot-world; log-log.

Progress goes to stderr; results to stdout.

Without CUDA the kernels run in the Triton interpreter (mamba_cp sets TRITON_INTERPRET=1):
a small float32 shape, wall-clock timing (time.perf_counter), no graphs, no copy floor and no
peak memory (null); ranks are processes on gloo. Those times say nothing about a GPU; the run
only checks the script.
"""

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

if any(a.startswith("--sass") for a in sys.argv[1:]):  # a compile for a GPU, on any machine: never the interpreter
    os.environ["TRITON_INTERPRET"] = "0"
import mamba_cp  # noqa: E402 - before anything triton-related: it picks the interpreter when CUDA is absent

CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
COPY_REPS = 10  # back-to-back copies per timed sample of the copy floor
MIB = 2 ** 20
# "a2a" first: the speedup baseline. A state-passing path is its load_balancing, with the summaries
# and halos all-gathered; "+scan" sends them by prefix scan and from the neighbours instead
# (summary_exchange="scan"; the library's default "auto" picks one of the two by its link model)
PATHS = ("a2a", "none", "permute_p2p", "permute_a2a", "virtual", "none+scan", "virtual+scan")

# shape of record on a GPU; a small shape for the CPU interpreter
GPU_DEFAULTS = dict(lengths="4096,16384,65536", iters=20, warmup=5, dtype="bf16",
                    nheads=64, headdim=64, ngroups=8, dstate=128, d_conv=4, chunk=128, local_length="4096,16384,65536")
CPU_DEFAULTS = dict(lengths="64,128", iters=2, warmup=1, dtype="fp32",
                    nheads=4, headdim=16, ngroups=2, dstate=16, d_conv=4, chunk=16, local_length="128")
CP_LENGTHS = dict(gpu="8192,32768,131072", cpu="256")   # global lengths of the CP paths under torchrun

# the communication table: world sizes and global lengths
COMM_WORLDS = (2, 4, 8, 16, 32, 64)
COMM_LENGTHS = (8192, 32768, 131072, 1048576)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Shape:
    """The mixer core's shape (README "Tests and benchmark"); conv_dim = channels of xBC = [x | B | C]."""
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    d_conv: int

    @property
    def conv_dim(self):
        return self.nheads * self.headdim + 2 * self.ngroups * self.dstate


RECORD_SHAPE = Shape(nheads=64, headdim=64, ngroups=8, dstate=128, d_conv=4)
RECORD_DTYPE = "bf16"


def shape_of(args):
    return Shape(args.nheads, args.headdim, args.ngroups, args.dstate, args.d_conv)


# ---------------------------------------------------------------------------------------------
# single-device SSD: inputs and the call under test
# ---------------------------------------------------------------------------------------------


def make_inputs(args, L, device):
    """Random, seeded inputs (never zeros), created directly in their final dtype on the device.
    x, B, C in --dtype; dt, A, D, dt_bias in fp32. All require grad."""
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    b, h, p, g, n = args.batch, args.nheads, args.headdim, args.ngroups, args.dstate
    f32 = dict(device=device, dtype=torch.float32)
    x = torch.randn(b, L, h, p, device=device, dtype=dtype)
    B = torch.randn(b, L, g, n, device=device, dtype=dtype) * n ** -0.5
    C = torch.randn(b, L, g, n, device=device, dtype=dtype) * n ** -0.5
    dt = torch.randn(b, L, h, **f32) * 0.5                                       # raw, pre-softplus
    A = -torch.exp(torch.empty(h, **f32).uniform_(0.0, 2.7))                     # in (-15, -1)
    D = 1.0 + 0.1 * torch.randn(h, **f32)
    dt_bias = torch.log(torch.expm1(torch.empty(h, **f32).uniform_(1e-3, 1e-1)))  # softplus^-1
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    for t in inputs.values():
        t.requires_grad_(True)
    grad_y = torch.randn(b, L, h, p, device=device, dtype=dtype)
    return inputs, grad_y


def ssd(inp, chunk, module=mamba_cp):
    return module.mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                                            D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)


def make_fns(inp, grad_y, chunk, call=ssd):
    """The two calls of call(inp, chunk) under test (forward; forward+backward into every leaf of
    inp), as argument-free closures over static tensors."""
    leaves = list(inp.values())

    def fwd():
        with torch.no_grad():
            return call(inp, chunk)

    def fwdbwd():
        y = call(inp, chunk)
        return torch.autograd.grad(y, leaves, grad_y)

    return fwd, fwdbwd


def compulsory_bytes(inp):
    """Bytes the forward must move at the least: x, B, C, dt read, y (as large as x) written."""
    return sum(inp[k].nbytes for k in ("x", "B", "C", "dt")) + inp["x"].nbytes


# ---------------------------------------------------------------------------------------------
# timers: each returns the p50 in milliseconds
# ---------------------------------------------------------------------------------------------


def time_cuda(fn, iters, warmup):
    """Eager: barrier, then CUDA events around one call; p50 over iters."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_wall(fn, iters, warmup):
    """CPU (interpreter): wall clock around one call; p50 over iters."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def capture_graph(fn, warmup):
    """fn captured into a CUDA graph, after warm-up calls on a side stream (as the
    torch.cuda.graph docs prescribe). Returns (graph, captured output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()                     # static output: overwritten in place by every replay
    return graph, out


def time_graph(fn, iters, warmup):
    """Capture fn into a CUDA graph and time replays; returns (p50 ms, captured output, graph)."""
    graph, out = capture_graph(fn, warmup)
    return time_cuda(graph.replay, iters, warmup), out, graph


def short_error(e):
    """Exception type, and its message's first and last lines (where CUDA and Triton put the cause)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = " | ".join(dict.fromkeys(lines[:1] + lines[-1:]))
    return f"{type(e).__name__}: {msg}"[:400]


def try_graph(name, fn, iters, warmup, errors):
    """time_graph, but a failure becomes an entry in `errors` and a None time."""
    try:
        ms, out, graph = time_graph(fn, iters, warmup)
        return ms, out, graph
    except Exception as e:  # noqa: BLE001 - report, do not crash the whole sweep
        errors.append(f"{name}: {short_error(e)}")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None, None, None


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------


def measure_peak_mib(fn):
    """Peak allocated memory over one call (inputs included) and the allocation before it, MiB."""
    gc.collect()  # tensors held by reference cycles (e.g. a failed call's traceback) would count
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak / MIB, base / MIB


def measure_copy_floor_ms(nbytes, iters, warmup):
    """p50 time of one device-to-device copy of nbytes (COPY_REPS back-to-back per sample)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(max(1, warmup)):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(COPY_REPS):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / COPY_REPS)
    del src, dst
    return statistics.median(times)


def ratio(a, b):
    return None if a is None or b is None else a / b


def bench_single_device(args, L):
    """All measurements of the single-device SSD at one length; returns the RESULT dict."""
    device = "cuda" if CUDA else "cpu"
    inp, grad_y = make_inputs(args, L, device)
    fwd, fwdbwd = make_fns(inp, grad_y, args.chunk)
    timer = time_cuda if CUDA else time_wall
    r = dict(bench="ssd_single_device", L=L, batch=args.batch, dtype=args.dtype,
             nheads=args.nheads, headdim=args.headdim, ngroups=args.ngroups, dstate=args.dstate,
             chunk=args.chunk, iters=args.iters, warmup=args.warmup,
             timing="cuda_events_p50" if CUDA else "wall_clock_p50_interpreter",
             fwd_ms=None, fwdbwd_ms=None, fwd_graph_ms=None, fwdbwd_graph_ms=None,
             copy_floor_ms=None, copy_bytes=compulsory_bytes(inp), fwd_over_floor=None,
             fwd_graph_over_floor=None, peak_mib=None, base_mib=None,
             peak_of="fwd" if args.fwd_only else "fwdbwd", fwd_graph_matches_eager=None,
             graph_error=None, error=None,
             device=torch.cuda.get_device_name() if CUDA else "cpu (triton interpreter)")

    r["fwd_ms"] = timer(fwd, args.iters, args.warmup)
    do_bwd = not args.fwd_only
    if do_bwd:
        try:
            r["fwdbwd_ms"] = timer(fwdbwd, args.iters, args.warmup)
        except Exception as e:  # noqa: BLE001 - a failing backward must not hide the forward numbers
            r["error"] = "fwdbwd: " + short_error(e)
            log(f"L={L}: fwd+bwd failed, continuing with the forward only: {r['error']}")
            do_bwd, r["peak_of"] = False, "fwd"
        gc.collect()  # the traceback's frames hold the failed backward's buffers

    if CUDA:
        # peak before any graph exists: graph memory pools would count in the allocation
        r["peak_mib"], r["base_mib"] = measure_peak_mib(fwdbwd if do_bwd else fwd)

        if not args.no_graph:
            errors = []
            r["fwd_graph_ms"], y_graph, graph = try_graph("fwd", fwd, args.iters, args.warmup, errors)
            if y_graph is not None:
                r["fwd_graph_matches_eager"] = bool(torch.equal(y_graph, fwd()))
            del y_graph, graph
            if do_bwd:
                r["fwdbwd_graph_ms"], grads, graph = try_graph("fwdbwd", fwdbwd, args.iters, args.warmup, errors)
                del grads, graph
            r["graph_error"] = "; ".join(errors) or None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

        r["copy_floor_ms"] = measure_copy_floor_ms(r["copy_bytes"], args.iters, args.warmup)
        r["fwd_over_floor"] = ratio(r["fwd_ms"], r["copy_floor_ms"])
        r["fwd_graph_over_floor"] = ratio(r["fwd_graph_ms"], r["copy_floor_ms"])

    del inp, grad_y, fwd, fwdbwd
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return r


def profile_kernels(args, L, iters=5):
    """Per-kernel GPU time of one forward and one forward+backward (torch.profiler, CUDA
    activity), averaged over iters after a warm-up; returns {phase: [(kernel, calls, ms), ...]}."""
    from torch.profiler import ProfilerActivity, profile

    inp, grad_y = make_inputs(args, L, "cuda")
    fwd, fwdbwd = make_fns(inp, grad_y, args.chunk)
    tables = {}
    for phase, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        rows = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                calls, us = rows.get(ev.name, (0, 0.0))
                rows[ev.name] = (calls + 1, us + ev.device_time)
        tables[phase] = sorted(((name[:60], calls / iters, us / iters / 1e3) for name, (calls, us) in rows.items()),
                               key=lambda r: -r[2])
    del inp, grad_y, fwd, fwdbwd
    gc.collect()
    torch.cuda.empty_cache()
    return tables


# ---------------------------------------------------------------------------------------------
# the fused CP core: inputs and the call under test
# ---------------------------------------------------------------------------------------------


def make_cp_full(args, L, device):
    """Full-sequence inputs of the fused conv1d + SSD core, drawn on `device` from one generator
    seeded with --seed: the same on every rank (never zeros). xBC and grad_y in --dtype; dt (raw,
    pre-softplus), conv weight and bias, dt_bias, A, D in fp32 (as in test_mamba_cp.py)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    s = shape_of(args)
    b, h, p = args.batch, s.nheads, s.headdim

    def randn(*size, dt=torch.float32):
        return torch.randn(size, generator=gen, device=device, dtype=dt)

    def rand(*size):
        return torch.rand(size, generator=gen, device=device)

    seq = dict(xBC=randn(b, L, s.conv_dim, dt=dtype),
               dt=randn(b, L, h) * 0.5,
               grad_y=randn(b, L, h, p, dt=dtype))
    params = dict(conv_weight=randn(s.conv_dim, s.d_conv) * s.d_conv ** -0.5,
                  conv_bias=0.1 * randn(s.conv_dim),
                  dt_bias=torch.log(torch.expm1(1e-3 + (1e-1 - 1e-3) * rand(h))),    # softplus^-1
                  A=-torch.exp(2.7 * rand(h)),                                         # in (-15, -1)
                  D=1.0 + 0.1 * randn(h))
    return seq, params


def make_cp_local(args, L, rank, world, layout, device):
    """This rank's inputs in `layout` ("none": contiguous, else the zigzag shard); the full
    sequence is freed before returning. Returns (leaves dict, grad_y shard)."""
    seq, params = make_cp_full(args, L, device)
    local = {k: mamba_cp.shard(v, rank, world, layout).contiguous() for k, v in seq.items()}
    del seq
    grad_y = local.pop("grad_y")
    leaves = dict(xBC=local["xBC"], dt=local["dt"], **params)
    for t in leaves.values():
        t.requires_grad_(True)
    return leaves, grad_y


def make_mixer_local(args, L, rank, world, layout, device):
    """torchrun --entry mixer: this rank's zxbcdt = [z | xBC | dt] (in --dtype) in `layout`, the
    parameters, and the gradient of the gated output shard."""
    seq, params = make_cp_full(args, L, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1)
    dim = args.nheads * args.headdim
    z = torch.randn(args.batch, L, dim, generator=gen, device=device).to(DTYPES[args.dtype])
    grad = torch.randn(args.batch, L, dim, generator=gen, device=device).to(DTYPES[args.dtype])
    zxbcdt = torch.cat([z, seq["xBC"], seq["dt"].to(z.dtype)], dim=-1)
    del seq, z
    leaves = dict(zxbcdt=mamba_cp.shard(zxbcdt, rank, world, layout).contiguous(), **params)
    for t in leaves.values():
        t.requires_grad_(True)
    return leaves, mamba_cp.shard(grad, rank, world, layout).contiguous()


def make_gate_local(args, L, device):
    """Inputs of the two gated entries in a world of one: zxbcdt = [z | xBC | dt] in --dtype (for
    "split") and the same values as separate contiguous z, xBC, dt (for "core_gate"); the
    gradient of the gated output (b, L, nheads*headdim)."""
    leaves, _ = make_cp_local(args, L, 0, 1, "none", device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1)
    dim = args.nheads * args.headdim
    z = torch.randn(args.batch, L, dim, generator=gen, device=device).to(DTYPES[args.dtype])
    grad = torch.randn(args.batch, L, dim, generator=gen, device=device).to(DTYPES[args.dtype])
    params = {k: v for k, v in leaves.items() if k not in ("xBC", "dt")}
    zxbcdt = torch.cat([z, leaves["xBC"].detach(), leaves["dt"].detach().to(z.dtype)], dim=-1).requires_grad_(True)
    split = dict(zxbcdt=zxbcdt, **params)
    separate = dict(z=z.requires_grad_(True), xBC=leaves["xBC"], dt=leaves["dt"], **params)
    return split, separate, grad


def layout_of(path):
    """(load_balancing, summary_exchange) of a path; a2a's load_balancing is its input's."""
    layout, _, scan = path.partition("+")
    return ("virtual" if layout == "a2a" else layout), ("scan" if scan else "all_gather")


def input_layout(path):
    """The load_balancing of the shard a path is fed: contiguous for "none", zigzag otherwise."""
    return "none" if layout_of(path)[0] == "none" else "virtual"


def split_entry(t, args, group=None, module=mamba_cp):
    """The mixer entry on t's zxbcdt = [z | xBC | dt], z gate included."""
    return module.mamba_split_conv1d_scan_combined(
        t["zxbcdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"], t["D"], args.chunk,
        headdim=args.headdim, ngroups=args.ngroups, cp_group=group)


def cp_call(path, t, args, group):
    """One call of the fused core by `path`; a2a is fed the zigzag shard (load_balancing="virtual");
    "unfused" is conv1d then the single-device SSD, no CP."""
    if path == "unfused":
        return unfused_call(t, args)
    if path.startswith("mixer:"):   # torchrun --entry mixer: the entry Mamba2 mixers call, z gate included
        layout = path.split(":")[1]
        if layout.startswith("a2a"):          # the baseline has no mixer entry: its core on views, the gate in torch
            dim = args.nheads * args.headdim
            z, xBC, dt = t["zxbcdt"].split([dim, t["zxbcdt"].shape[2] - dim - args.nheads, args.nheads], dim=-1)
            y = mamba_cp.mamba_conv1d_ssd_a2a(xBC, dt, t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"], t["D"],
                                              args.chunk, headdim=args.headdim, ngroups=args.ngroups, cp_group=group,
                                              load_balancing="virtual")
            return y.flatten(-2) * torch.nn.functional.silu(z)
        layout, exchange = layout_of(layout)
        return mamba_cp.mamba_split_conv1d_scan_combined(
            t["zxbcdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"], t["D"], args.chunk,
            headdim=args.headdim, ngroups=args.ngroups, cp_group=group, load_balancing=layout,
            summary_exchange=exchange)
    if path == "split":        # the entry Mamba2 mixers call, z gate included
        return split_entry(t, args, group)
    if path == "core_gate":    # the same from the core on a contiguous xBC, then the gate in torch
        y = mamba_cp.mamba_conv1d_ssd_cp(t["xBC"], t["dt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"],
                                         t["D"], args.chunk, headdim=args.headdim, ngroups=args.ngroups, cp_group=group)
        return y.flatten(-2) * torch.nn.functional.silu(t["z"])
    layout, exchange = layout_of(path)
    common = (t["xBC"], t["dt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], t["A"], t["D"], args.chunk)
    if path == "a2a":
        return mamba_cp.mamba_conv1d_ssd_a2a(*common, headdim=args.headdim, ngroups=args.ngroups, cp_group=group,
                                             load_balancing=layout)
    return mamba_cp.mamba_conv1d_ssd_cp(*common, headdim=args.headdim, ngroups=args.ngroups, cp_group=group,
                                        load_balancing=layout, summary_exchange=exchange)


class ConvFn(torch.autograd.Function):
    """mamba_cp's conv1d kernels as a plain autograd function: the unfused baseline's conv."""

    @staticmethod
    def forward(ctx, xBC, weight, bias):
        ctx.save_for_backward(xBC, weight, bias)
        return mamba_cp.conv1d_fwd(xBC, weight, bias)

    @staticmethod
    def backward(ctx, du):
        dxBC, _, dweight, dbias = mamba_cp.conv1d_bwd(du.contiguous(), *ctx.saved_tensors)
        return dxBC, dweight.to(ctx.saved_tensors[1].dtype), dbias.to(ctx.saved_tensors[2].dtype)


def unfused_call(t, args):
    """The same layer without CP and without fusion: conv1d, then mamba_chunk_scan_combined on
    the split channels (state passing skipped altogether)."""
    u = ConvFn.apply(t["xBC"], t["conv_weight"], t["conv_bias"])
    hp, gn = args.nheads * args.headdim, args.ngroups * args.dstate
    x, B, C = u.split([hp, gn, gn], dim=-1)
    x = x.unflatten(-1, (args.nheads, args.headdim))
    B, C = (t.unflatten(-1, (args.ngroups, args.dstate)) for t in (B, C))
    return mamba_cp.mamba_chunk_scan_combined(x, t["dt"], t["A"], B, C, args.chunk, D=t["D"],
                                              dt_bias=t["dt_bias"], dt_softplus=True)


def make_cp_step(path, leaves, grad_y, args, group):
    """The timed step as an argument-free closure: forward+backward (autograd.grad into every
    leaf), or the forward alone under no_grad with --fwd-only."""
    inputs = list(leaves.values())

    def step():
        if args.fwd_only:
            with torch.no_grad():
                return cp_call(path, leaves, args, group)
        y = cp_call(path, leaves, args, group)
        return torch.autograd.grad(y, inputs, grad_y)

    return step


# ---------------------------------------------------------------------------------------------
# communication volume, from the shapes
# ---------------------------------------------------------------------------------------------

def path_bytes(path, W, L, batch, shape, dtype_bytes):
    """mamba_cp.comm_bytes (the module's cost model; its docstring states every term) of one of
    PATHS at a Shape: a2a, or a load_balancing, "+scan" for summary_exchange="scan". None where
    the path cannot run (a2a with nheads not divisible by W; L not divisible by 2W)."""
    layout, exchange = layout_of(path)
    return mamba_cp.comm_bytes("a2a" if path == "a2a" else layout, W, L, batch, dtype_bytes=dtype_bytes,
                               summary_exchange=exchange, **dataclasses.asdict(shape))


def fmt_bytes(nbytes):
    if nbytes is None:
        return "n/a"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            v = nbytes / size
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{nbytes} B"


def comm_shape(args):
    """(shape, dtype name, batch) of the communication table: the run's, or the record shape."""
    if args.comm_shape == "record":
        return RECORD_SHAPE, RECORD_DTYPE, 1
    return shape_of(args), args.dtype, args.batch


def report_comm_table(args):
    """Print the bytes-per-rank table (one block per W) and one RESULT line per (path, W, L)."""
    shape, dtype, batch = comm_shape(args)
    paths = args.paths
    print(f"\n# Bytes each rank receives per layer call, forward / backward (busiest rank; computed from "
          f"the shapes by comm_bytes(), not measured): nheads={shape.nheads} headdim={shape.headdim} "
          f"ngroups={shape.ngroups} dstate={shape.dstate} d_conv={shape.d_conv} batch={batch} {dtype} "
          f"activations, no seq_idx. a2a: all-to-all of xBC, dt, y; none/virtual: fp32 summaries and "
          f"halos; permute_*: none's exchanges plus the zigzag pieces that change rank.")
    width = 23
    for W in COMM_WORLDS:
        print(f"W={W:<4} L{'':<8}" + "".join(f"{p:>{width}}" for p in paths))
        for L in COMM_LENGTHS:
            cells = []
            for path in paths:
                c = path_bytes(path, W, L, batch, shape, DTYPE_BYTES[dtype])
                cells.append("n/a" if c is None else f"{fmt_bytes(c['fwd'])} / {fmt_bytes(c['bwd'])}")
            print(f"{'':<6} {L:<9}" + "".join(f"{cell:>{width}}" for cell in cells))
    for W in COMM_WORLDS:
        for L in COMM_LENGTHS:
            for path in paths:
                c = path_bytes(path, W, L, batch, shape, DTYPE_BYTES[dtype])
                r = dict(bench="comm_bytes", path=path, W=W, L=L, batch=batch, dtype=dtype,
                         nheads=shape.nheads, headdim=shape.headdim, ngroups=shape.ngroups,
                         dstate=shape.dstate, d_conv=shape.d_conv,
                         fwd_bytes=None if c is None else c["fwd"], bwd_bytes=None if c is None else c["bwd"],
                         terms=None if c is None else c["terms"],
                         error=None if c is not None else "not runnable (nheads % W or L % 2W)")
                print("RESULT " + json.dumps(r))
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# the exchange model: each path's communication time per layer from alpha and beta
# ---------------------------------------------------------------------------------------------

MODEL_WORLDS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MODEL_PATHS = ("a2a", "none", "none+scan", "virtual", "virtual+scan")


def measure_link(device, sizes=(8, 64 * MIB), iters=20):
    """alpha and beta between ranks 0 and 1 of the WORLD group, by ping-pong: the p50 of half a
    round trip at a small and a large message; the other ranks wait. Returns a LinkModel on every rank."""
    rank = dist.get_rank()
    half = []
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


def report_model_table(args, links, local_length):
    """Per link, each path's modelled communication time per layer call (forward+backward, ms)
    at the record shape, local_length tokens per rank, W = 2 to 1024; and the exchange
    summary_exchange="auto" picks there for "virtual" (from mamba_cp's own model)."""
    shape, dtype = RECORD_SHAPE, RECORD_DTYPE
    batch = 1
    print(f"\n# Modelled communication per layer call, forward+backward, ms (comm_bytes' terms: messages x "
          f"alpha + bytes x beta, no overlap with compute): record shape, {dtype}, batch {batch}, "
          f"{local_length} tokens per rank (L = W x {local_length}); a2a needs nheads % W == 0")
    for name, link in links.items():
        print(f"link {name}: alpha {link.alpha * 1e6:.2f} us, beta {1 / link.beta / 1e9:.1f} GB/s")
        print(f"{'W':>6}" + "".join(f"{p:>14}" for p in MODEL_PATHS) + f"{'auto (virtual)':>16}")
        previous, rows = mamba_cp.set_link_model(link), []
        try:
            for W in MODEL_WORLDS:
                L = W * local_length
                cells, r = [], dict(bench="exchange_model", link=name, alpha_s=link.alpha, beta_s_per_byte=link.beta,
                                    W=W, L=L, batch=batch, dtype=dtype, ms={})
                for path in MODEL_PATHS:
                    c = path_bytes(path, W, L, batch, shape, DTYPE_BYTES[dtype])
                    ms = None if c is None else mamba_cp.modelled_seconds(c, link) * 1e3
                    r["ms"][path] = ms
                    cells.append(fmt(ms, ".3f"))
                r["auto_virtual"] = mamba_cp.chosen_exchange("auto", W, "virtual", batch, (shape.nheads, shape.headdim,
                                                             shape.dstate), shape.conv_dim, shape.d_conv)
                print(f"{W:>6}" + "".join(f"{cell:>14}" for cell in cells) + f"{r['auto_virtual']:>16}")
                rows.append(r)
        finally:
            mamba_cp.set_link_model(previous)
        for r in rows:
            print("RESULT " + json.dumps(r))
    sys.stdout.flush()


def main_model(args):
    """--model: measure alpha and beta where run with W >= 2 (torchrun), then the table for that
    link and for mamba_cp.LINKS' assumed ones."""
    links = {}
    if is_distributed(args):
        rank, world, device = init_distributed(args)
        if world >= 2:
            link = measure_link(device)
            links[f"measured ({'NCCL' if CUDA else 'gloo'}, ranks 0-1)"] = link
        sync_barrier(device)
        dist.destroy_process_group()
        if rank != 0:
            return
    if not links:
        print("# link not measured: one process (run under torchrun with 2 or more ranks to measure it)")
    links.update({f"{name} (assumed)": link for name, link in mamba_cp.LINKS.items()})
    report_model_table(args, links, args.model_local_length)


# ---------------------------------------------------------------------------------------------
# single device: the CP path's per-rank compute in a world of one, against the plain SSD
# ---------------------------------------------------------------------------------------------


def bench_cp_local(args, L, sweep):
    """`mamba_conv1d_ssd_cp` (cp_group=None, conv included) against the unfused layer (conv1d,
    then `mamba_chunk_scan_combined`) and the SSD alone, at L tokens, fwd+bwd (fwd with
    --fwd-only), the same shape; eager, and on a GPU also CUDA-graph replays (the GPU alone: the
    eager figure carries each call's host latency). `sweep`: the single-device RESULT dicts
    already measured; the SSD's times are reused from there when the length matches. Returns
    the RESULT dict."""
    device = "cuda" if CUDA else "cpu"
    timer = time_cuda if CUDA else time_wall
    phase = "fwd" if args.fwd_only else "fwdbwd"
    graphs = CUDA and not args.no_graph
    # the interpreter compiles nothing: on CPU the CP call's warm-up is skipped unless --warmup was given
    warmup = args.warmup if CUDA or args.warmup_given else 0
    r = dict(bench="cp_local_vs_ssd", L_local=L, batch=args.batch, dtype=args.dtype, nheads=args.nheads,
             headdim=args.headdim, ngroups=args.ngroups, dstate=args.dstate, d_conv=args.d_conv,
             chunk=args.chunk, iters=args.iters, cp_warmup=warmup, ssd_warmup=args.warmup, phase=phase,
             timing="cuda_events_p50" if CUDA else "wall_clock_p50_interpreter",
             cp_ms=None, unfused_ms=None, ssd_ms=None, cp_graph_ms=None, unfused_graph_ms=None, ssd_graph_ms=None,
             split_ms=None, split_graph_ms=None, core_gate_ms=None, core_gate_graph_ms=None,
             split_over_core_gate=None, split_over_core_gate_graph=None,
             cp_over_ssd=None, cp_over_unfused=None, unfused_over_ssd=None,
             cp_over_ssd_graph=None, cp_over_unfused_graph=None, unfused_over_ssd_graph=None,
             cp_peak_mib=None, ssd_peak_mib=None, cp_includes_conv=True, ssd_includes_conv=False,
             ssd_source=None, graph_error=None, error=None,
             device=torch.cuda.get_device_name() if CUDA else "cpu (triton interpreter)")
    errors = []
    try:
        leaves, grad_y = make_cp_local(args, L, 0, 1, "none", device)
        for name in ("cp", "unfused"):
            what = ("mamba_conv1d_ssd_cp (world of one)" if name == "cp"
                    else "conv1d then mamba_chunk_scan_combined (unfused, no CP)")
            log(f"[cp vs ssd] {what} L={L}: {phase}, {warmup} warm-up + {args.iters} timed ...")
            step = make_cp_step("none" if name == "cp" else "unfused", leaves, grad_y, args, None)
            r[f"{name}_ms"] = timer(step, args.iters, warmup)
            if CUDA and name == "cp":
                r["cp_peak_mib"] = measure_peak_mib(step)[0]
            if graphs:
                r[f"{name}_graph_ms"], _, graph = try_graph(name, step, args.iters, args.warmup, errors)
                del graph
        del leaves, grad_y, step
        split, separate, grad = make_gate_local(args, L, device)
        for name, leaves in (("split", split), ("core_gate", separate)):
            what = ("mamba_split_conv1d_scan_combined on zxbcdt (z gate)" if name == "split"
                    else "mamba_conv1d_ssd_cp on a contiguous xBC, then y * silu(z) in torch")
            log(f"[cp vs ssd] {what} L={L}: {phase}, {warmup} warm-up + {args.iters} timed ...")
            step = make_cp_step(name, leaves, grad, args, None)
            r[f"{name}_ms"] = timer(step, args.iters, warmup)
            if graphs:
                r[f"{name}_graph_ms"], _, graph = try_graph(name, step, args.iters, args.warmup, errors)
                del graph
        del split, separate, grad, step
    except Exception as e:  # noqa: BLE001 - report, keep going
        r["error"] = "cp: " + short_error(e)
        log(f"[cp vs ssd] CP call failed: {r['error']}")
    gc.collect()

    same = [s for s in sweep if s["L"] == L and s.get(f"{phase}_ms") is not None]
    if same:
        r["ssd_ms"], r["ssd_graph_ms"] = same[0][f"{phase}_ms"], same[0][f"{phase}_graph_ms"]
        r["ssd_peak_mib"], r["ssd_source"] = same[0]["peak_mib"], "single-device sweep above"
    else:
        try:
            log(f"[cp vs ssd] mamba_chunk_scan_combined L={L}: {phase} ...")
            inp, grad = make_inputs(args, L, device)
            fwd, fwdbwd = make_fns(inp, grad, args.chunk)
            fn = fwd if args.fwd_only else fwdbwd
            r["ssd_ms"], r["ssd_source"] = timer(fn, args.iters, args.warmup), "measured here"
            if CUDA:
                r["ssd_peak_mib"] = measure_peak_mib(fn)[0]
            if graphs:
                r["ssd_graph_ms"], _, graph = try_graph("ssd", fn, args.iters, args.warmup, errors)
                del graph
            del inp, grad, fwd, fwdbwd, fn
        except Exception as e:  # noqa: BLE001
            r["error"] = ((r["error"] + "; ") if r["error"] else "") + "ssd: " + short_error(e)
        gc.collect()
    for suffix in ("", "_graph"):
        cp, unfused, ssd = (r[f"{name}{suffix}_ms"] for name in ("cp", "unfused", "ssd"))
        r[f"cp_over_ssd{suffix}"] = ratio(cp, ssd)
        r[f"cp_over_unfused{suffix}"] = ratio(cp, unfused)
        r[f"unfused_over_ssd{suffix}"] = ratio(unfused, ssd)
        r[f"split_over_core_gate{suffix}"] = ratio(r[f"split{suffix}_ms"], r[f"core_gate{suffix}_ms"])
    r["graph_error"] = "; ".join(errors) or None
    if CUDA:
        torch.cuda.empty_cache()
    return r


def human_cp_local(r):
    g = lambda key: f" (graph {fmt(r[key], unit=' ms')})" if CUDA else ""      # noqa: E731
    gr = lambda key: f" (graph {fmt(r[key], '.2f', 'x')})" if CUDA else ""     # noqa: E731
    line = (f"CP per-rank compute, world of one, L_local={r['L_local']} batch={r['batch']} {r['dtype']}, "
            f"{r['phase']}, p50 of {r['iters']} iters, eager (graph):\n"
            f"  mamba_conv1d_ssd_cp, conv1d included, full CP path: {fmt(r['cp_ms'], unit=' ms')}{g('cp_graph_ms')}\n"
            f"  unfused conv1d then mamba_chunk_scan_combined (no CP, no state passing): "
            f"{fmt(r['unfused_ms'], unit=' ms')}{g('unfused_graph_ms')}\n"
            f"  mamba_chunk_scan_combined alone (no conv) [{r['ssd_source']}]: "
            f"{fmt(r['ssd_ms'], unit=' ms')}{g('ssd_graph_ms')}\n"
            f"  fused CP / unfused {fmt(r['cp_over_unfused'], '.2f', 'x')}{gr('cp_over_unfused_graph')}, "
            f"unfused / SSD alone {fmt(r['unfused_over_ssd'], '.2f', 'x')}{gr('unfused_over_ssd_graph')}, "
            f"fused CP / SSD alone {fmt(r['cp_over_ssd'], '.2f', 'x')}{gr('cp_over_ssd_graph')}; "
            f"peak {fmt(r['cp_peak_mib'], '.0f', ' MiB')} vs {fmt(r['ssd_peak_mib'], '.0f', ' MiB')} (SSD alone)\n"
            f"  mamba_split_conv1d_scan_combined on zxbcdt, z gate: {fmt(r['split_ms'], unit=' ms')}{g('split_graph_ms')}\n"
            f"  mamba_conv1d_ssd_cp on a contiguous xBC, then the gate in torch: "
            f"{fmt(r['core_gate_ms'], unit=' ms')}{g('core_gate_graph_ms')}\n"
            f"  split entry / core + gate {fmt(r['split_over_core_gate'], '.2f', 'x')}{gr('split_over_core_gate_graph')}")
    if r["graph_error"]:
        line += f"\n  [graph error: {r['graph_error']}]"
    if r["error"]:
        line += f"\n  [error: {r['error']}]"
    return line


# ---------------------------------------------------------------------------------------------
# torchrun: every CP path side by side
# ---------------------------------------------------------------------------------------------


def sync_barrier(device):
    """All ranks line up, outside any timed region."""
    if CUDA:
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()


def collect_errors(error, failed):
    """When any rank `failed` (the agreed flag), every rank gathers every rank's message; returns
    one string naming the ranks, or None. Every rank must call it at the same point."""
    if not failed:
        return None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    ranks_of = {}
    for r, m in enumerate(every):
        if m:
            ranks_of.setdefault(m, []).append(str(r))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(rs)}: {m}" for m, rs in ranks_of.items()) \
        or "failed on another rank"


def any_rank(flag, device):
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() > 0


def time_distributed(step, args, device, label, rank):
    """Warm-up then timed iterations of `step`. Per iteration: barrier (and CUDA synchronize)
    outside the timed region, CUDA events (wall clock on CPU) around the call, then one
    all_reduce(MAX) of [ms, failed]: the rank-maximum time, and a stop on every rank at once
    when any rank raised. Returns (per-iteration rank-max ms over the timed iterations, error)."""
    times, error = [], None
    for i in range(args.warmup + args.iters):
        if rank == 0 and i == 0 and args.warmup:
            log(f"[rank 0] {label}: warm-up ({args.warmup}) ...")
        if rank == 0 and i == args.warmup:
            log(f"[rank 0] {label}: timing {args.iters} iters ...")
        sync_barrier(device)
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        try:
            out = step()
            del out
        except Exception as e:  # noqa: BLE001 - agreed on below, reported in RESULT
            error = short_error(e)
        if CUDA:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) if error is None else 0.0
        else:
            ms = (time.perf_counter() - t0) * 1e3
        agreed = torch.tensor([ms, 1.0 if error else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if agreed[1].item() > 0:
            return times, collect_errors(error, True)
        if i >= args.warmup:
            times.append(agreed[0].item())
    return times, None


def time_distributed_graph(step, args, device, label, rank):
    """`step` captured into one CUDA graph on every rank (collectives included; capture_graph),
    then its replays timed as time_distributed times eager calls: the GPUs alone, without the
    host's latency. A capture failure on any rank is agreed on and returned as the error.
    Returns (times, error)."""
    error, graph = None, None
    try:
        graph, out = capture_graph(step, args.warmup)
        del out
    except Exception as e:  # noqa: BLE001 - agreed on below, reported in RESULT
        error = short_error(e)
    if any_rank(error is not None, device):
        return [], "graph capture: " + collect_errors(error, True)
    times, error = time_distributed(graph.replay, args, device, label + " (graph)", rank)
    del graph
    return times, error


def bench_cp_path(args, path, L, rank, world, device):
    """One path at global length L on every rank of the WORLD group; returns the RESULT dict
    (identical on every rank but for local fields)."""
    group = dist.group.WORLD
    s = shape_of(args)
    c = path_bytes(path, world, L, args.batch, s, DTYPE_BYTES[args.dtype])
    r = dict(bench="cp_paths", path=path,
             input_layout="zigzag" if input_layout(path) == "virtual" else "contiguous",
             load_balancing=layout_of(path)[0], summary_exchange=None if path == "a2a" else layout_of(path)[1],
             function=("mamba_conv1d_ssd_a2a" if path == "a2a" else "mamba_conv1d_ssd_cp") if args.entry == "core"
             else ("mamba_conv1d_ssd_a2a then y * silu(z)" if path == "a2a" else "mamba_split_conv1d_scan_combined"),
             entry=args.entry,
             W=world, L=L, L_local=L // world if L % world == 0 else None, batch=args.batch, dtype=args.dtype,
             nheads=s.nheads, headdim=s.headdim, ngroups=s.ngroups, dstate=s.dstate, d_conv=s.d_conv, chunk=args.chunk,
             iters=args.iters, warmup=args.warmup, phase="fwd" if args.fwd_only else "fwdbwd",
             timing=("cuda_events" if CUDA else "wall_clock_interpreter") + "_rank_max_p50",
             p50_ms=None, min_ms=None, max_ms=None, speedup_vs_a2a=None, peak_mib=None, base_mib=None,
             graph_p50_ms=None, graph_speedup_vs_a2a=None, graph_error=None,
             comm_fwd_bytes=None if c is None else c["fwd"], comm_bwd_bytes=None if c is None else c["bwd"],
             backend=dist.get_backend(), device=torch.cuda.get_device_name() if CUDA else "cpu (triton interpreter)",
             error=None)
    label = f"{path} L={L}"
    if L % (2 * world):
        r["error"] = f"L={L} is not divisible by 2W={2 * world}: no run"
        return r

    leaves = grad_y = step = None
    error = None
    try:
        if rank == 0:
            log(f"[rank 0] {label}: building inputs ({L // world} tokens per rank) ...")
        if args.entry == "mixer":
            leaves, grad_y = make_mixer_local(args, L, rank, world, input_layout(path), device)
            step = make_cp_step("mixer:" + path, leaves, grad_y, args, group)
        else:
            leaves, grad_y = make_cp_local(args, L, rank, world, input_layout(path), device)
            step = make_cp_step(path, leaves, grad_y, args, group)
    except Exception as e:  # noqa: BLE001
        error = short_error(e)
    r["error"] = collect_errors(error, any_rank(error is not None, device))
    if r["error"] is None:
        if CUDA:
            gc.collect()
            torch.cuda.synchronize()
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
        if CUDA and not args.no_graph and r["error"] is None:
            times, r["graph_error"] = time_distributed_graph(step, args, device, label, rank)
            if times and r["graph_error"] is None:
                r["graph_p50_ms"] = statistics.median(times)
            if rank == 0:
                log(f"[rank 0] {label}: " + (f"graph p50 {r['graph_p50_ms']:.3f} ms" if r["graph_error"] is None
                                             else f"graph error: {r['graph_error']}"))
    del leaves, grad_y, step
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return r


def human_cp_table(rows, world, args):
    """The side-by-side table of one length."""
    L = rows[0]["L"]
    phase = "forward" if args.fwd_only else "forward+backward"
    if L % (2 * world):
        return f"\nL={L} global, W={world}: not run, L must be divisible by 2W = {2 * world}"
    out = [f"\nL={L} global, {L // world} tokens per rank, W={world}: {phase} of conv1d + SSD + exchange, "
           f"p50 of the rank maximum over {args.iters} iters after {args.warmup} warm-up, eager and "
           f"CUDA-graph replay (the GPUs alone; on CUDA only)",
           f"{'path':<13}{'input':<12}{'p50 ms':>11}{'vs a2a':>9}{'graph ms':>10}{'vs a2a':>9}{'peak MiB':>10}"
           f"{'comm fwd / bwd per rank':>28}  note"]
    for r in rows:
        comm = (f"{fmt_bytes(r['comm_fwd_bytes'])} / {fmt_bytes(r['comm_bwd_bytes'])}"
                if r["comm_fwd_bytes"] is not None else "n/a")
        note = f"{r['function']} on the zigzag shard (load_balancing='virtual')" if r["path"] == "a2a" else ""
        if r["error"]:
            note = (note + "; " if note else "") + f"ERROR: {r['error']}"
        if r["graph_error"]:
            note = (note + "; " if note else "") + f"graph: {r['graph_error']}"
        out.append(f"{r['path']:<13}{r['input_layout']:<12}{fmt(r['p50_ms'], '.3f'):>11}"
                   f"{fmt(r['speedup_vs_a2a'], '.2f', 'x'):>9}{fmt(r['graph_p50_ms'], '.3f'):>10}"
                   f"{fmt(r['graph_speedup_vs_a2a'], '.2f', 'x'):>9}{fmt(r['peak_mib'], '.0f'):>10}{comm:>28}  {note}")
    return "\n".join(out)


def init_distributed(args):
    """Process group from torchrun's environment (NCCL with CUDA, gloo on CPU). `--cp` without
    torchrun gets a world of one on a free local port. Returns (rank, world, device)."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if CUDA else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    return dist.get_rank(), dist.get_world_size(), device


def main_distributed(args):
    rank, world, device = init_distributed(args)
    s = shape_of(args)
    if rank == 0:
        where = (f"{torch.cuda.get_device_name()} x{world}, NCCL" if CUDA
                 else f"CPU x{world} processes, gloo, Triton interpreter, wall-clock times; "
                      "NOT representative of a GPU")
        print(f"# CP paths: {where}; torch {torch.__version__}, triton {mamba_cp.triton.__version__}; "
              f"nheads={s.nheads} headdim={s.headdim} ngroups={s.ngroups} dstate={s.dstate} d_conv={s.d_conv} "
              f"chunk={args.chunk} batch={args.batch} dtype={args.dtype}; paths {','.join(args.paths)}"
              + tuning_note(args))
        print("# a2a = mamba_conv1d_ssd_a2a fed the zigzag shard (load_balancing='virtual'), the layout a Megatron "
              "trainer hands the mixer; speedup = a2a p50 / path p50"
              + ("; --entry mixer: mamba_split_conv1d_scan_combined on zxbcdt with the z gate (a2a: its core on views, "
                 "then the gate in torch)" if args.entry == "mixer" else ""), flush=True)
        bad = [L for L in args.lengths if L % (2 * world)]
        if bad:
            print(f"# WARNING: lengths {bad} are not divisible by 2W = {2 * world} (each rank holds L/W tokens, "
                  f"the zigzag layouts cut L into 2W pieces): they are skipped, with an error in their RESULT lines",
                  flush=True)
    results = []
    for L in args.lengths:
        rows = [bench_cp_path(args, path, L, rank, world, device) for path in args.paths]
        for key, speedup in (("p50_ms", "speedup_vs_a2a"), ("graph_p50_ms", "graph_speedup_vs_a2a")):
            base = next((r[key] for r in rows if r["path"] == "a2a"), None)
            for r in rows:
                r[speedup] = ratio(base, r[key])
        results += rows
        if rank == 0:
            print(human_cp_table(rows, world, args))
            for r in rows:
                print("RESULT " + json.dumps(dict(r, **tuned(args))))
            sys.stdout.flush()
    if rank == 0 and args.plot:
        series = {}
        for r in results:
            if r["p50_ms"] is not None:
                series.setdefault(r["path"], []).append((r["L"], r["p50_ms"]))
        phase = "fwd" if args.fwd_only else "fwd+bwd"
        plot(args, series, f"CP paths, W={world}: {phase} p50 (rank max)", args.plot_world or world)
    sync_barrier(device)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------


def plot(args, time_series, time_title, W, time_xlabel="global sequence length L (tokens)"):
    """Left: time vs L per series; right: comm_bytes per rank vs L per path at world W (solid
    fwd+bwd, dashed fwd; paths with identical bytes share one line). Log-log. Without
    matplotlib: one line saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {args.plot}: matplotlib is not installed, no plot drawn (pip install matplotlib)", flush=True)
        return
    shape, dtype, batch = comm_shape(args)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for label, points in time_series.items():
        points = sorted(points)
        left.plot([L for L, _ in points], [ms for _, ms in points], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel=time_xlabel, ylabel="time (ms)", title=time_title)
    left.grid(True, which="both", alpha=0.3)
    if time_series:
        left.legend(fontsize=8)
    else:
        left.text(0.5, 0.5, "no successful timing", ha="center", transform=left.transAxes)

    lengths = sorted(set(COMM_LENGTHS) | set(args.lengths))
    curves, missing = {}, []                       # (fwd, total) points -> paths with those bytes
    for path in args.paths:
        pts = [(L, path_bytes(path, W, L, batch, shape, DTYPE_BYTES[dtype])) for L in lengths]
        pts = tuple((L, c["fwd"], c["fwd"] + c["bwd"]) for L, c in pts if c is not None and c["fwd"] + c["bwd"] > 0)
        if pts:
            curves.setdefault(pts, []).append(path)
        else:
            missing.append(path)
    for pts, paths in curves.items():
        name = " = ".join(paths)
        line, = right.plot([L for L, _, _ in pts], [tot / MIB for _, _, tot in pts], marker="o",
                           label=f"{name}: fwd+bwd")
        right.plot([L for L, _, _ in pts], [f / MIB for _, f, _ in pts], linestyle="--", color=line.get_color(),
                   alpha=0.7, label=f"{name}: fwd")
    title = (f"bytes received per rank, W={W} ({shape.nheads}x{shape.headdim} heads, dstate {shape.dstate}, "
             f"{dtype}, batch {batch})")
    if missing:
        title += f"\nnot runnable at W={W}: {', '.join(missing)}"
    right.set(xscale="log", yscale="log", xlabel="global sequence length L (tokens)",
              ylabel="MiB per rank per layer", title=title)
    right.grid(True, which="both", alpha=0.3)
    if curves:
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, f"nothing is communicated at W={W}", ha="center", transform=right.transAxes)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)
    print(f"# plot written to {args.plot}", flush=True)


# ---------------------------------------------------------------------------------------------
# reporting and main
# ---------------------------------------------------------------------------------------------


def fmt(v, spec=".3f", unit=""):
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def human_line(r):
    line = (f"L={r['L']:>6} batch={r['batch']} {r['dtype']}: "
            f"fwd {fmt(r['fwd_ms'], unit=' ms')} (graph {fmt(r['fwd_graph_ms'], unit=' ms')}), "
            f"fwd+bwd {fmt(r['fwdbwd_ms'], unit=' ms')} (graph {fmt(r['fwdbwd_graph_ms'], unit=' ms')}), "
            f"copy floor {fmt(r['copy_floor_ms'], unit=' ms')} for {r['copy_bytes'] / MIB:.1f} MiB, "
            f"fwd/floor {fmt(r['fwd_over_floor'], '.2f', 'x')} (graph {fmt(r['fwd_graph_over_floor'], '.2f', 'x')}), "
            f"peak {fmt(r['peak_mib'], '.0f', ' MiB')}")
    if r["error"]:
        line += f"  [error: {r['error']}]"
    if r["graph_error"]:
        line += f"  [graph error: {r['graph_error']}]"
    return line


def is_distributed(args):
    return args.cp or int(os.environ.get("WORLD_SIZE", "1")) > 1


def apply_tuning(ap, args):
    """--launch and --kernel-chunk: a variant of mamba_cp's Tuning for this process, so a tuning
    run needs no edit of mamba_cp.py. Each header line says what was changed."""
    args.tuning = {}
    base = mamba_cp.tuning()
    changes = {}
    if args.launch:
        try:
            launch = json.loads(args.launch)
        except json.JSONDecodeError as e:
            ap.error(f"--launch: got {args.launch!r}, expected JSON ({e})")
        if not isinstance(launch, dict) or any(k not in mamba_cp.TUNED_KERNELS or not isinstance(v, dict)
                                               for k, v in launch.items()):
            ap.error(f"--launch: got {args.launch!r}, expected an object mapping some of "
                     f"{', '.join(mamba_cp.TUNED_KERNELS)} to option objects")
        changes["launch"] = {**base.launch, **launch}
        args.tuning["launch"] = launch
    if args.kernel_chunk is not None:
        q = args.kernel_chunk
        if q < 16 or q & (q - 1):
            ap.error(f"--kernel-chunk: got {q}, expected a power of two from 16")
        changes.update(chunk_fwd=q, chunk_bwd=q)
        args.tuning["kernel_chunk"] = q
    if changes:
        mamba_cp.set_tuning(dataclasses.replace(base, name=base.name + " (bench flags)", **changes))


def tuning_note(args):
    return f"; TUNING {json.dumps(args.tuning)}" if args.tuning else ""


def tuned(args):
    """What a RESULT line adds when the run was tuned: nothing otherwise."""
    return {"tuning": args.tuning} if args.tuning else {}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", action="store_true",
                    help="time the CP paths (implied under torchrun with WORLD_SIZE > 1; alone: a world of one)")
    ap.add_argument("--lengths", help="comma-separated sequence lengths (global under torchrun); default: "
                    f"single device {GPU_DEFAULTS['lengths']} on GPU, {CPU_DEFAULTS['lengths']} on CPU; "
                    f"CP paths {CP_LENGTHS['gpu']} on GPU, {CP_LENGTHS['cpu']} on CPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, help="timed iterations (default 20 GPU, 2 CPU)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up calls (default 5 GPU, 1 CPU)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of x, B, C / xBC (default bf16 GPU, fp32 CPU)")
    for name in ("nheads", "headdim", "ngroups", "dstate", "d_conv", "chunk"):
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        ap.add_argument(*flags, dest=name, type=int,
                        help=f"default {GPU_DEFAULTS[name]} on GPU, {CPU_DEFAULTS[name]} on CPU")
    ap.add_argument("--local-length", "--local_length", dest="local_length",
                    help="single device: comma-separated tokens per rank of the CP-vs-SSD comparison "
                    f"(default {GPU_DEFAULTS['local_length']} GPU, {CPU_DEFAULTS['local_length']} CPU)")
    ap.add_argument("--entry", choices=("core", "mixer"), default="core",
                    help="torchrun: time the fused core (mamba_conv1d_ssd_cp on xBC, dt), or the entry Mamba2 mixers "
                         "call (mamba_split_conv1d_scan_combined on zxbcdt with the z gate; a2a: its core on views, "
                         "then the gate in torch)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help=f"comma-separated CP paths to time (and tabulate), of {','.join(PATHS)}")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timings")
    ap.add_argument("--profile", action="store_true", help="also print per-kernel GPU times per L")
    ap.add_argument("--against", metavar="REV", help="time this tree's SSD and mixer entry against mamba_cp.py as "
                    "committed at git revision REV (or in the file REV), in one process (before/after)")
    ap.add_argument("--conv", action="store_true", help="time only the conv (conv1d_fwd, conv1d_bwd): plain, with a "
                    "halo, with document ids, with both")
    ap.add_argument("--sass", nargs="?", const=90, type=int, metavar="ARCH",
                    help="compile (not run) every kernel of the SSD and the mixer entry, forward and backward, for "
                         "compute capability ARCH (default 90, the H100 and H200), on any machine, a GPU's or not: "
                         "registers, stack bytes and SASS instructions per kernel; at the record shape unless "
                         "given, the first of --lengths; with --against REV, REV's kernels beside")
    ap.add_argument("--comm-shape", choices=("run", "record"), default="run",
                    help="shape of the bytes table and plot: this run's flags (default) or the record shape")
    ap.add_argument("--plot", metavar="FILE.png", help="draw time and communication vs L (needs matplotlib)")
    ap.add_argument("--plot-world", type=int, help="W of the plot's communication panel (default: the run's W; "
                    "8 without torchrun)")
    ap.add_argument("--timeout", type=int, default=600,
                    help="torchrun: process-group timeout in seconds (a failure on some ranks only ends there)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", action="store_true",
                    help="print only the exchange model: each path's communication time per layer for W = 2..1024 "
                         "(alpha and beta measured under torchrun with 2 or more ranks, and mamba_cp.LINKS' assumed)")
    ap.add_argument("--model-local-length", dest="model_local_length", type=int, default=16384,
                    help="--model: tokens per rank (default 16384)")
    ap.add_argument("--launch", metavar="JSON",
                    help="tuning: replace kernels' launch options, e.g. '{\"bwd_x\": {\"num_warps\": 4}}' "
                         f"(kernels: {', '.join(mamba_cp.TUNED_KERNELS)}; GPU only)")
    ap.add_argument("--hybrid", nargs=argparse.REMAINDER, metavar="{attention,step} ...",
                    help="run examples/hybrid_bench.py with the arguments that follow (GPU): a transformers hybrid "
                         "under examples/transformers_cp.py, its attention against flash ('attention') or one "
                         "training step of a granite-4.0-h-tiny-sized GraniteMoeHybrid ('step'); "
                         "`--hybrid step --help` for its options")
    ap.add_argument("--kernel-chunk", dest="kernel_chunk", type=int,
                    help=f"tuning: the kernels' chunk length, forward and backward (default "
                         f"{mamba_cp.tuning().chunk_fwd}; a power of two from 16)")
    args = ap.parse_args(argv)
    apply_tuning(ap, args)
    args.warmup_given = args.warmup is not None
    defaults = dict(GPU_DEFAULTS if CUDA or args.sass else CPU_DEFAULTS)
    if is_distributed(args):
        defaults["lengths"] = CP_LENGTHS["gpu" if CUDA else "cpu"]
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.lengths = [int(s) for s in str(args.lengths).split(",") if s.strip()]
    args.local_lengths = [int(s) for s in str(args.local_length).split(",") if s.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        ap.error(f"--paths: got {unknown or 'nothing'}, expected some of {','.join(PATHS)}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if args.plot_world is not None and args.plot_world < 1:
        ap.error("--plot-world must be >= 1")
    return args


def main_single(args):
    shape = (f"nheads={args.nheads} headdim={args.headdim} ngroups={args.ngroups} dstate={args.dstate} "
             f"chunk={args.chunk} batch={args.batch} dtype={args.dtype}")
    if CUDA:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
              f"{mamba_cp.triton.__version__}; {shape}; p50 of {args.iters} iters after {args.warmup} warm-up"
              + tuning_note(args))
    else:
        print(f"# CPU: Triton interpreter, wall-clock times; NOT representative of a GPU. {shape}; "
              f"p50 of {args.iters} iters after {args.warmup} warm-up" + tuning_note(args))
    sys.stdout.flush()
    sweep = []
    for L in args.lengths:
        log(f"measuring L={L} ...")
        r = bench_single_device(args, L)
        sweep.append(r)
        print(human_line(r))
        print("RESULT " + json.dumps(dict(r, **tuned(args))), flush=True)
        if args.profile and CUDA:
            for phase, rows in profile_kernels(args, L).items():
                total = sum(ms for _, _, ms in rows)
                print(f"  profile L={L} {phase}: {total:.3f} ms of kernels per call")
                for name, calls, ms in rows:
                    print(f"    {ms:8.3f} ms  {calls:5.1f}x  {name}")
                print("RESULT " + json.dumps(dict(bench="profile", L=L, phase=phase, kernels=rows, **tuned(args))),
                      flush=True)

    for L in args.local_lengths:
        r = bench_cp_local(args, L, sweep)
        print("\n" + human_cp_local(r))
        print("RESULT " + json.dumps(dict(r, **tuned(args))), flush=True)

    report_comm_table(args)

    if args.plot:
        series = {}
        for key, label in (("fwd_ms", "fwd eager"), ("fwdbwd_ms", "fwd+bwd eager"), ("fwd_graph_ms", "fwd graph"),
                           ("fwdbwd_graph_ms", "fwd+bwd graph"), ("copy_floor_ms", "copy floor")):
            pts = [(s["L"], s[key]) for s in sweep if s[key] is not None]
            if pts:
                series[label] = pts
        where = torch.cuda.get_device_name() if CUDA else "CPU interpreter"
        plot(args, series, f"single-device mamba_chunk_scan_combined ({where})", args.plot_world or 8,
             time_xlabel="sequence length L (tokens)")


def bench_conv(args, L):
    """The conv alone (mamba_cp.conv1d_fwd / conv1d_bwd on the record shape's xBC), forward and
    forward+backward, eager and graphed, as the CP path runs it: plain (a world of one), with a
    halo (a later segment), with document ids, and with both (packed documents under CP)."""
    torch.manual_seed(args.seed)
    dev, dt = ("cuda" if CUDA else "cpu"), DTYPES[args.dtype]
    dim, d1 = args.nheads * args.headdim + 2 * args.ngroups * args.dstate, args.d_conv - 1
    xBC = torch.randn(args.batch, L, dim, device=dev, dtype=dt)
    w, bias = torch.randn(dim, args.d_conv, device=dev) * 0.3, torch.randn(dim, device=dev) * 0.1
    dout = torch.randn_like(xBC)
    halo = torch.randn(args.batch, d1, dim, device=dev, dtype=dt)
    seq = (torch.arange(L, device=dev) // 1000).to(torch.int32).expand(args.batch, L).contiguous()  # 1,000-token docs
    halo_seq = torch.zeros(args.batch, d1, device=dev, dtype=torch.int32)
    out = {"bench": "conv", "L": L, "batch": args.batch, "dtype": args.dtype, "dim": dim, "d_conv": args.d_conv}
    timer, errors = (time_cuda if CUDA else time_wall), []
    for name, h, ids in (("plain", None, None), ("halo", halo, None), ("ids", None, seq), ("halo_ids", halo, seq)):
        kw = dict(halo=h, seq_idx=ids, halo_seq=halo_seq if h is not None and ids is not None else None)
        fwd = functools.partial(mamba_cp.conv1d_fwd, xBC, w, bias, **kw)

        def fwdbwd(fwd=fwd, kw=kw):
            fwd()
            return mamba_cp.conv1d_bwd(dout, xBC, w, bias, **kw)[0]
        for phase, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            out[f"{name}_{phase}_ms"] = timer(fn, args.iters, args.warmup)
            if CUDA and not args.no_graph:
                out[f"{name}_{phase}_graph_ms"] = try_graph(f"{name} {phase}", fn, args.iters, args.warmup, errors)[0]
    out["graph_error"] = "; ".join(errors) or None
    return out


def main_conv(args):
    print(f"# the conv alone, {torch.cuda.get_device_name() if CUDA else 'CPU interpreter'}; xBC of "
          f"{args.nheads * args.headdim + 2 * args.ngroups * args.dstate} channels, d_conv {args.d_conv}, "
          f"{args.dtype}, batch {args.batch}; ms p50 of {args.iters}, eager (graphed)")
    for L in args.lengths:
        r = bench_conv(args, L)
        for phase in ("fwd", "fwdbwd"):
            cells = [f"{n} {r[f'{n}_{phase}_ms']:.3f}" + (f" ({fmt(r.get(f'{n}_{phase}_graph_ms'))})" if CUDA else "")
                     for n in ("plain", "halo", "ids", "halo_ids")]
            print(f"L={L:>7} {phase:>6}: " + ", ".join(cells))
        print("RESULT " + json.dumps(dict(r, **tuned(args))), flush=True)


class _CompileOnly:
    """--sass: Triton's driver replaced by a stand-in that reports a GPU of compute capability
    `arch`, and every kernel launch turned into its compile (Triton's own warm-up path), so the
    public functions run on CPU tensors and compile each kernel they would launch; what they
    return is garbage. Reaches into Triton's runtime (driver.set_active, JITFunction.run)."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget
        self.target, self.compiled = GPUTarget("cuda", arch, 32), {}

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def __enter__(self):
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction
        self.run = JITFunction.run
        compiled = self.compiled

        def compile_only(fn, *a, grid, warmup, **kw):
            kernel = self.run(fn, *a, grid=grid, warmup=True, **kw)
            compiled.setdefault(id(kernel), (fn.fn.__name__, kernel))
            return kernel
        driver.set_active(self)
        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc):
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction
        JITFunction.run = self.run
        try:
            driver.reset_active()
        except RuntimeError:        # a machine without a GPU driver has no default to go back to
            pass


def sass_counts(kernel):
    """(registers, stack bytes a thread, SASS instructions) of a compiled kernel, read with the
    cuobjdump that ships with Triton."""
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(mamba_cp.triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                       for flag in ("-res-usage", "-sass"))
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return int(regs), int(stack), len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))


def sass_calls(args, L, module):
    """The SSD's and the mixer entry's calls as the timed runs make them (forward+backward, the
    forward alone with --fwd-only), on CPU tensors."""
    ssd_inp, ssd_grad = make_inputs(args, L, "cpu")
    split, _, split_grad = make_gate_local(args, L, "cpu")
    calls = (("ssd", make_fns(ssd_inp, ssd_grad, args.chunk, functools.partial(ssd, module=module))),
             ("entry", make_fns(split, split_grad, args.chunk, lambda t, _: split_entry(t, args, module=module))))
    return [(name, fns[0] if args.fwd_only else fns[1]) for name, fns in calls]


def main_sass(args):
    """--sass: every kernel of the SSD and of the mixer entry compiled for one GPU arch, nothing run."""
    L = args.lengths[0]
    print(f"# kernels compiled for sm_{args.sass} (triton {mamba_cp.triton.__version__}), not run; "
          f"nheads={args.nheads} headdim={args.headdim} ngroups={args.ngroups} dstate={args.dstate} "
          f"chunk={args.chunk} batch={args.batch} L={L} dtype={args.dtype}" + tuning_note(args))
    modules = [("after", mamba_cp)] + ([("before", load_revision(args.against))] if args.against else [])
    with _CompileOnly(args.sass) as stand_in:
        for label, module in modules:
            for call_name, call in sass_calls(args, L, module):
                stand_in.compiled.clear()
                call()
                for name, kernel in stand_in.compiled.values():
                    regs, stack, count = sass_counts(kernel)
                    r = dict(bench="sass", module=label, call=call_name, kernel=name, arch=args.sass, L=L,
                             dtype=args.dtype, registers=regs, stack_bytes=stack, instructions=count)
                    print(f"{label:>6} {call_name:>5} {name:<28} {regs:>4} registers {stack:>5} stack bytes "
                          f"{count:>6} instructions")
                    print("RESULT " + json.dumps(dict(r, **tuned(args))), flush=True)


def load_revision(rev):
    """mamba_cp.py as committed at git revision `rev` (or the file at the path `rev`), imported
    beside this tree's module under a name of its own, its custom ops renamed so that both register: the "before" of a before/after
    run in one process, on one GPU, one set of inputs."""
    import importlib.util
    import re
    import subprocess
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isfile(rev):                     # a copy of the module, for machines without the git history
        with open(rev) as f:
            src = f.read()
    else:
        try:
            src = subprocess.run(["git", "show", f"{rev}:mamba_cp.py"], cwd=here, capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"--against: cannot read mamba_cp.py at {rev!r}: {(getattr(e, 'stderr', '') or e)}".strip())
    name = "mamba_cp_at_" + re.sub(r"\W", "_", os.path.basename(rev))
    src = src.replace("mamba_cp::", f"{name}::").replace("torch.ops.mamba_cp.", f"torch.ops.{name}.")
    path = os.path.join(tempfile.mkdtemp(prefix="bench_against_"), name + ".py")   # Triton reads kernels' source
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def bench_against(args, L, before):
    """This tree's mamba_cp (after) and `before` (load_revision) in turn on the same inputs: the
    SSD (mamba_chunk_scan_combined) and the mixer entry (mamba_split_conv1d_scan_combined, z gate),
    forward and forward+backward, eager and graphed, and the peak memory of forward+backward."""
    dev = "cuda" if CUDA else "cpu"
    inp, grad_y = make_inputs(args, L, dev)
    split, _, grad = make_gate_local(args, L, dev)
    out = {"bench": "against", "rev": args.against, "L": L, "batch": args.batch, "dtype": args.dtype}
    timer, errors = (time_cuda if CUDA else time_wall), []
    for tag, module in (("before", before), ("after", mamba_cp)):
        for what, (fwd, fwdbwd) in (
                ("ssd", make_fns(inp, grad_y, args.chunk, lambda t, chunk, m=module: ssd(t, chunk, m))),
                ("entry", make_fns(split, grad, args.chunk, lambda t, chunk, m=module: split_entry(t, args, module=m)))):
            for phase, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                key = f"{what}_{phase}_{tag}"
                out[f"{key}_ms"] = timer(fn, args.iters, args.warmup)
                if CUDA and not args.no_graph:
                    out[f"{key}_graph_ms"] = try_graph(key, fn, args.iters, args.warmup, errors)[0]
            if CUDA:
                out[f"{what}_peak_mib_{tag}"] = measure_peak_mib(fwdbwd)[0]
    for what in ("ssd", "entry"):            # before's time over after's: above 1, after is faster
        for phase in ("fwd", "fwdbwd"):
            for mode in ("", "_graph"):
                out[f"{what}_{phase}{mode}_speedup"] = ratio(out.get(f"{what}_{phase}_before{mode}_ms"),
                                                             out.get(f"{what}_{phase}_after{mode}_ms"))
    out["graph_error"] = "; ".join(errors) or None
    return out


def main_against(args):
    before = load_revision(args.against)
    print(f"# this tree's mamba_cp (after) against {args.against}'s (before), one process, "
          f"{torch.cuda.get_device_name() if CUDA else 'CPU interpreter'}; {args.dtype}, batch {args.batch}, "
          f"nheads {args.nheads} headdim {args.headdim} ngroups {args.ngroups} dstate {args.dstate} chunk "
          f"{args.chunk}; ms p50 of {args.iters}, eager (graphed); before / after")
    for L in args.lengths:
        r = bench_against(args, L, before)
        for what in ("ssd", "entry"):
            cells = []
            for phase in ("fwd", "fwdbwd"):
                cell = f"{phase} {fmt(r[f'{what}_{phase}_before_ms'])} / {fmt(r[f'{what}_{phase}_after_ms'])}"
                if CUDA and not args.no_graph:
                    cell += (f" ({fmt(r.get(f'{what}_{phase}_before_graph_ms'))} / "
                             f"{fmt(r.get(f'{what}_{phase}_after_graph_ms'))})")
                cells.append(cell)
            print(f"L={L:>7} {what:>5}: " + ", ".join(cells))
        print("RESULT " + json.dumps(dict(r, **tuned(args))), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.sass:
        main_sass(args)
    elif args.against:
        main_against(args)
    elif args.conv:
        main_conv(args)
    elif args.hybrid is not None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))
        import hybrid_bench
        hybrid_bench.main(args.hybrid or ["step"])
    elif args.model:
        main_model(args)
    elif is_distributed(args):
        main_distributed(args)
    else:
        main_single(args)


if __name__ == "__main__":
    main()
