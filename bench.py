"""Benchmark of mamba_cp's single-device chunked SSD (DESIGN.md section 8).

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

Output: a human-readable line per L, and one `RESULT {json}` line per L; progress on stderr.

Without CUDA the kernels run in the Triton interpreter (mamba_cp sets TRITON_INTERPRET=1):
a small float32 shape, wall-clock timing (time.perf_counter), no graphs, no copy floor and no
peak memory (null). Those times say nothing about a GPU; the run only checks the script.
"""

import argparse
import gc
import json
import statistics
import sys
import time

import torch

import mamba_cp  # before anything triton-related: it picks the interpreter when CUDA is absent

CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_REPS = 10  # back-to-back copies per timed sample of the copy floor
MIB = 2 ** 20

# shape of record on a GPU; a small shape for the CPU interpreter
GPU_DEFAULTS = dict(lengths="4096,16384,65536", iters=20, warmup=5, dtype="bf16",
                    nheads=64, headdim=64, ngroups=8, dstate=128, chunk=128)
CPU_DEFAULTS = dict(lengths="128,256", iters=2, warmup=1, dtype="fp32",
                    nheads=4, headdim=16, ngroups=2, dstate=16, chunk=16)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# inputs and the call under test
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


def ssd(inp, chunk):
    return mamba_cp.mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                                              D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)


def make_fns(inp, grad_y, chunk):
    """The two calls under test, as argument-free closures over static tensors."""
    leaves = list(inp.values())

    def fwd():
        with torch.no_grad():
            return ssd(inp, chunk)

    def fwdbwd():
        y = ssd(inp, chunk)
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


def time_graph(fn, iters, warmup):
    """Capture fn into a CUDA graph and time replays; returns (p50 ms, captured output).
    Warm-up runs on a side stream before capture, as the torch.cuda.graph docs prescribe."""
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
    ms = time_cuda(graph.replay, iters, warmup)
    return ms, out, graph


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", help="comma-separated sequence lengths "
                    f"(default {GPU_DEFAULTS['lengths']} on GPU, {CPU_DEFAULTS['lengths']} on CPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, help="timed iterations (default 20 GPU, 2 CPU)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up calls (default 5 GPU, 1 CPU)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of x, B, C (default bf16 GPU, fp32 CPU)")
    for name in ("nheads", "headdim", "ngroups", "dstate", "chunk"):
        ap.add_argument(f"--{name}", type=int,
                        help=f"default {GPU_DEFAULTS[name]} on GPU, {CPU_DEFAULTS[name]} on CPU")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timings")
    ap.add_argument("--profile", action="store_true", help="also print per-kernel GPU times per L")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for k, v in (GPU_DEFAULTS if CUDA else CPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.lengths = [int(s) for s in str(args.lengths).split(",") if s.strip()]
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    shape = (f"nheads={args.nheads} headdim={args.headdim} ngroups={args.ngroups} dstate={args.dstate} "
             f"chunk={args.chunk} batch={args.batch} dtype={args.dtype}")
    if CUDA:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
              f"{mamba_cp.triton.__version__}; {shape}; p50 of {args.iters} iters after {args.warmup} warm-up")
    else:
        print(f"# CPU: Triton interpreter, wall-clock times; NOT representative of a GPU. {shape}; "
              f"p50 of {args.iters} iters after {args.warmup} warm-up")
    sys.stdout.flush()
    for L in args.lengths:
        log(f"measuring L={L} ...")
        r = bench_single_device(args, L)
        print(human_line(r))
        print("RESULT " + json.dumps(r), flush=True)
        if args.profile and CUDA:
            for phase, rows in profile_kernels(args, L).items():
                total = sum(ms for _, _, ms in rows)
                print(f"  profile L={L} {phase}: {total:.3f} ms of kernels per call")
                for name, calls, ms in rows:
                    print(f"    {ms:8.3f} ms  {calls:5.1f}x  {name}")
                print("RESULT " + json.dumps(dict(bench="profile", L=L, phase=phase, kernels=rows)), flush=True)


if __name__ == "__main__":
    main()
