"""Where an eager call's host time goes, on a GPU: the SSD (mamba_chunk_scan_combined) and the
mixer entry (mamba_split_conv1d_scan_combined, z gate), forward and forward+backward.

    python tools/host_profile.py [--lengths 4096,16384] [--iters 20] [--top 30] [shape flags]

Per call and phase: the latency eager and as a CUDA-graph replay (p50, a synchronize before
each), the host's time to enqueue it (p50, the GPU held busy by a sleep kernel first, or idle),
with torch's autograd thread awake (against.busy: its wake is a step's, not a call's; also printed),
and the kernels it runs on the GPU. Then, for the entry's forward+backward at the first length:
a few torch operations' host cost; each Triton launch's through Triton's `kernel[grid]`, through
mamba_cp's `_Launched` and through the compiled launcher alone; the call's host time with every
launch through Triton, through `_Launched`, and with no launch at all (what the rest costs); and
torch.profiler's and cProfile's tables of the enqueue.

A developer instrument (the project never imports it). It needs CUDA.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import common
import mamba_cp
import torch
from against import busy, graph_p50_ms, p50_ms
from against import host_ms as enqueue_ms


def p50(values):
    return statistics.median(values)


def host_ms(fn, iters, idle=False, wake=True):
    """p50 of against.host_ms(fn, idle, wake) over iters calls after three."""
    return p50([enqueue_ms(fn, idle, wake) for _ in range(iters + 3)][3:])


def gpu_kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), sum(1 for n in names if not n.startswith(("at::", "void at::", "Memcpy", "Memset")))


def recorded_launches(fn):
    """(kernel, grid, args, constexprs) of each Triton launch fn makes (kernel: a mamba_cp._Launched)."""
    seen, launch = [], mamba_cp._Launched.launch

    def record(self, grid, *args, **constexprs):
        seen.append((self, grid, args, constexprs))
        return launch(self, grid, *args, **constexprs)

    mamba_cp._Launched.launch = record
    try:
        fn()
    finally:
        mamba_cp._Launched.launch = launch
    torch.cuda.synchronize()
    return seen


def host_us(op, reps):
    """p50 host µs of op(), called reps times in a row (the GPU idle at the start)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        op()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return p50(times)


def launch_costs(launches, reps=30):
    """Per launch, host µs: Triton's own path (kernel[grid]), this module's (mamba_cp._Launched),
    and the compiled kernel's launcher alone (its arguments prepared beforehand)."""
    rows = []
    for kernel, grid, args, constexprs in launches:
        key, flat = mamba_cp._launch_signature(torch.cuda.current_device(), args, constexprs)
        run, function, metadata, tail, _ = kernel.compiled[key]
        g, stream = (*grid, 1, 1), torch.cuda.current_stream().cuda_stream
        ways = dict(triton=lambda: kernel.jit[grid](*args, **constexprs),
                    module=lambda: kernel[grid](*args, **constexprs),
                    launcher=lambda: run(g[0], g[1], g[2], stream, function, metadata, None, None, None, *flat, *tail))
        row = {"kernel": kernel.fn.__name__, "args": len(args) + len(tail)}
        row.update({name: host_us(way, reps) for name, way in ways.items()})
        rows.append(row)
    return rows


def torch_costs(reps=200):
    """µs of a few torch host operations an eager call makes."""
    x = torch.empty(4096, 64, 64, device="cuda", dtype=torch.bfloat16)
    ops = dict(empty=lambda: torch.empty(64, 64, 128, device="cuda", dtype=torch.float32),
               view=lambda: x[:, :32].unflatten(-1, (8, 8)), stride=lambda: x.stride(), data_ptr=lambda: x.data_ptr(),
               current_stream=lambda: torch.cuda.current_stream().cuda_stream,
               sum=lambda: x[0, 0].sum())
    return {name: host_us(op, reps) for name, op in ops.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    common.add_shape_flags(ap, dict(common.RECORD, lengths="4096,16384"))
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; {args.dtype}, nheads {args.nheads} headdim {args.headdim} ngroups "
          f"{args.ngroups} dstate {args.dstate} chunk {args.chunk}", flush=True)
    for L in args.lengths:
        for (call, phase), fn in common.steps(mamba_cp, args, L, "cuda", args.calls).items():
            fn()
            eager, graphed = p50_ms(fn, args.iters, 3), graph_p50_ms(fn, args.iters, 3)
            host = host_ms(fn, args.iters)
            idle = host_ms(fn, args.iters, idle=True)
            kernels, triton_kernels = gpu_kernels(fn)
            print(f"L={L:>6} {call:>5} {phase:>6}: eager {eager:.3f} ms, graphed {graphed:.3f} ms "
                  f"({eager / graphed:.2f}x), host {host:.3f} ms (GPU idle {idle:.3f}) for {kernels} GPU kernels "
                  f"({triton_kernels} Triton): {1e3 * host / kernels:.0f} us a kernel", flush=True)
    leaf = torch.randn(1000, device="cuda", requires_grad=True)
    tiny = lambda: torch.autograd.grad((leaf * 2).sum(), [leaf])      # noqa: E731
    fn = common.steps(mamba_cp, args, args.lengths[0], "cuda", ("entry",))["entry", "fwdbwd"]
    fn()
    print(f"\n# the autograd thread's wake (against.busy): host ms with it awake / asleep, torch's own (x * 2).sum() "
          f"backward {host_ms(tiny, args.iters):.3f} / {host_ms(tiny, args.iters, wake=False):.3f}, the entry's "
          f"forward+backward at L={args.lengths[0]} {host_ms(fn, args.iters):.3f} / "
          f"{host_ms(fn, args.iters, wake=False):.3f}")
    print("\n# torch host operations, us:", {k: round(v, 1) for k, v in torch_costs().items()})
    print(f"\n# each Triton launch of the entry's forward+backward at L={args.lengths[0]}, host us p50 "
          f"(triton: kernel[grid] through Triton; module: mamba_cp's launch; launcher: the compiled launcher alone)")
    for row in launch_costs(recorded_launches(fn)):
        print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    def enqueue(label):
        fn()
        print(f"# {label}: host {host_ms(fn, args.iters):.3f} ms, GPU idle {host_ms(fn, args.iters, idle=True):.3f} ms")

    print()
    mamba_cp._Launched.direct = False
    enqueue("the same, every launch through Triton")
    mamba_cp._Launched.direct = True
    enqueue("through mamba_cp's launch")
    launch = mamba_cp._Launched.launch
    mamba_cp._Launched.launch = lambda self, grid, *a, **k: None
    try:
        enqueue("no Triton launch at all (garbage out)")
    finally:
        mamba_cp._Launched.launch = launch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(10):
            busy()
            fn()
        torch.cuda.synchronize()
    print("\n# torch.profiler, host, 10 enqueues of the entry's forward+backward, by self time\n" +
          tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    prof = cProfile.Profile()
    for _ in range(10):
        busy()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.top)
        print(f"\n# cProfile of 10 enqueues of the entry's forward+backward, by {order}\n" + s.getvalue())


if __name__ == "__main__":
    main()
