"""This tree's SSD (mamba_chunk_scan_combined) and mixer entry (mamba_split_conv1d_scan_combined,
z gate; --calls adds "mixer", the entry with the gated RMSNorm and out projection) timed
against mamba_cp.py as committed at git revision REV (or in the file REV, for a machine without
the history), both imported in one process and run in turn on the same inputs.

    python tools/against.py REV [--lengths 4096,16384,65536] [--iters 20] [--warmup 5] [shape flags]
    python tools/against.py HEAD --tuning-fields '{"state_tile": 32}'   # a tuning against the tree's own

bench.py's tuning flags (--launch, --kernel-chunk, --tuning-fields) run this tree's module under a
variant of its Tuning, so REV = HEAD (or the file mamba_cp.py, where there is no history) times
a tuning variant against the same code's own choices.

Forward (under no_grad) and forward+backward (autograd.grad into every input), each timed eager
(CUDA events around one call after a synchronize; the two modules' calls take turns, so the
host's drift falls on both alike), on a GPU also by the host's time to enqueue one call with the
GPU kept busy ("host"), and as CUDA-graph replays; p50 over --iters after --warmup. Printed:
before (REV) / after (this tree) and their ratio ("speedup", above 1 when this tree is faster),
on a GPU the peak memory of forward+backward above what was allocated before it, and one
`RESULT {json}` line per length. On CPU the kernels run in the Triton interpreter at a small float32 shape,
timed by wall clock: that checks the script, not the speed.

A developer instrument: it imports an old revision of the module beside this one (its custom ops
renamed). The project never imports it.
"""

import argparse
import functools
import gc
import json
import statistics
import time

import common
import mamba_cp  # before anything that imports triton: it picks the interpreter when CUDA is absent
import torch
import bench  # its tuning flags (add_tuning_flags, apply_tuning)
from bench import call_ms as one_ms   # one call's latency: CUDA events after a synchronize (wall clock on CPU)

CUDA = torch.cuda.is_available()
CPU_SHAPE = dict(nheads=4, headdim=16, ngroups=2, dstate=16, d_conv=4, chunk=16, dtype="fp32", lengths="64,128")
GPU_SHAPE = dict(common.RECORD, lengths="4096,16384,65536")


def busy(wake=True):
    """Hold the GPU for ~20 ms (a sleep kernel) so that what follows is only enqueued while the host is timed.
    With wake, then run one tiny backward: torch runs a CUDA backward on its autograd engine's own
    thread, which falls asleep while the host waits here, and waking it costs the next backward a
    fixed fraction of a millisecond on some hosts (torch's own, too: host_profile.py prints it). A
    training step pays that once, in its first backward, not once per layer: it is not the call's."""
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000)
    if wake:
        leaf = _leaf()
        torch.autograd.grad(leaf.sum(), [leaf])


@functools.cache
def _leaf():
    """busy()'s small CUDA leaf."""
    return torch.zeros(8, device="cuda", requires_grad=True)


def host_ms(fn, idle=False, wake=True):
    """The host's time to enqueue one call: with the GPU held busy first (nothing the call launches
    waits on the GPU; wake: busy()'s), or with idle, after a synchronize (the GPU runs each kernel
    as it comes)."""
    torch.cuda.synchronize() if idle else busy(wake)
    t0 = time.perf_counter()
    fn()
    t = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return t


def p50_ms(fn, iters, warmup):
    """p50 of one_ms(fn) over iters calls after warmup."""
    return taking_turns([fn], iters, warmup)[0]


def taking_turns(fns, iters, warmup, timer=one_ms):
    """p50 of timer(fn) for each fn, the fns taking turns call by call, so that the host's drift
    (clocks, other processes) falls on each alike: eager calls are host-bound at short lengths."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            t.append(timer(fn))
    return [statistics.median(t) for t in times]


def graph_p50_ms(fn, iters, warmup):
    """fn captured into a CUDA graph (warm-up on a side stream first), its replays timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return p50_ms(graph.replay, iters, warmup)


def peak_mib(fn):
    """The peak memory of one fn() call above what was allocated before it (its inputs, and
    whatever the other module's timing left), MiB."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def measure(args, L, modules):
    """{"{call}_{phase}_{tag}_ms": ..., graph and peak alike} for each (tag, module) in turn."""
    r = dict(bench="against", rev=args.rev, L=L, batch=args.batch, dtype=args.dtype, nheads=args.nheads,
             headdim=args.headdim, ngroups=args.ngroups, dstate=args.dstate, chunk=args.chunk, graph_error=None)
    device = "cuda" if CUDA else "cpu"
    steps = [common.steps(module, args, L, device, args.calls) for _, module in modules]
    for key in steps[0]:                 # eager: the two modules take turns
        fns = [s[key] for s in steps]
        timings = [("ms", taking_turns(fns, args.iters, args.warmup))]
        if CUDA:
            timings.append(("host_ms", taking_turns(fns, args.iters, 1, host_ms)))
        for what, values in timings:
            for (tag, _), v in zip(modules, values):
                r[f"{key[0]}_{key[1]}_{tag}_{what}"] = v
    del steps, fns
    gc.collect()
    for tag, module in modules:
        for (call, phase), fn in common.steps(module, args, L, device, args.calls).items():
            if CUDA and phase == "fwdbwd":   # before the graph: its memory pool would count
                r[f"{call}_peak_mib_{tag}"] = peak_mib(fn)
            if CUDA and not args.no_graph:
                try:
                    r[f"{call}_{phase}_{tag}_graph_ms"] = graph_p50_ms(fn, args.iters, args.warmup)
                except Exception as e:  # noqa: BLE001 - report, keep timing
                    r["graph_error"] = f"{call} {phase} {tag}: {type(e).__name__}: {str(e).splitlines()[0]}"[:300]
        gc.collect()
    for key in [k for k in r if k.endswith(("_before_ms", "_before_graph_ms", "_before_host_ms"))]:
        after = r.get(key.replace("_before", "_after"))
        r[key.replace("_before", "").replace("_ms", "_speedup")] = r[key] / after if after else None
    return r


def fmt(v, spec=".3f"):
    return "n/a" if v is None else f"{v:{spec}}"


def report(r, graphs, calls):
    for call in calls:
        cells = []
        for phase in ("fwd", "fwdbwd"):
            cell = (f"{phase} {fmt(r[f'{call}_{phase}_before_ms'])} / {fmt(r[f'{call}_{phase}_after_ms'])} ms "
                    f"= {fmt(r[f'{call}_{phase}_speedup'], '.2f')}x")
            if CUDA:
                host = [r[f"{call}_{phase}_{tag}_host_ms"] for tag in ("before", "after")]
                cell += f", host {fmt(host[0])} / {fmt(host[1])} = {fmt(r[f'{call}_{phase}_host_speedup'], '.2f')}x"
            if graphs:
                cell += (f" (graph {fmt(r.get(f'{call}_{phase}_before_graph_ms'))} / "
                         f"{fmt(r.get(f'{call}_{phase}_after_graph_ms'))} = "
                         f"{fmt(r.get(f'{call}_{phase}_graph_speedup'), '.2f')}x)")
            cells.append(cell)
        if CUDA:
            cells.append(f"peak {r[f'{call}_peak_mib_before']:.0f} / {r[f'{call}_peak_mib_after']:.0f} MiB")
        print(f"L={r['L']:>7} {call:>5}: " + ", ".join(cells))
    if r["graph_error"]:
        print(f"  [graph error: {r['graph_error']}]")


def main():
    defaults = GPU_SHAPE if CUDA else CPU_SHAPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", metavar="REV", help="git revision (or file) of the mamba_cp.py to time against")
    ap.add_argument("--iters", type=int, default=20 if CUDA else 2)
    ap.add_argument("--warmup", type=int, default=5 if CUDA else 1)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replays")
    bench.add_tuning_flags(ap)
    common.add_shape_flags(ap, defaults)
    args = ap.parse_args()
    modules = (("before", common.load_revision(args.rev)), ("after", mamba_cp))
    bench.apply_tuning(ap, args)         # this tree's module only: REV's keeps its own
    graphs = CUDA and not args.no_graph
    print(f"# before = mamba_cp.py at {args.rev}, after = this tree's"
          + (f" (tuning {json.dumps(args.tuning)})" if args.tuning else "") + "; one process, "
          f"{torch.cuda.get_device_name() if CUDA else 'CPU: Triton interpreter, wall clock, NOT a GPU timing'}; "
          f"{args.dtype}, batch {args.batch}, nheads {args.nheads} headdim {args.headdim} ngroups {args.ngroups} "
          f"dstate {args.dstate} chunk {args.chunk}; ms p50 of {args.iters} after {args.warmup} warm-up, "
          f"before / after = speedup" + (" (CUDA graph)" if graphs else ""), flush=True)
    for L in args.lengths:
        r = measure(args, L, modules)
        print("RESULT " + json.dumps(r))
        report(r, graphs, args.calls)


if __name__ == "__main__":
    main()
