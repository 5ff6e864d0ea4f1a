"""Whether graphing the mixer entry with torch.cuda.make_graphed_callables pays (README "CUDA
graphs"): N layers of it in a step (every layer's forward, then one backward through all),
eager against the same N layers graphed together by torch (one memory pool shared by their
graphs; each call copies its inputs in, as a step's new activations would be), and beside them
the memory the graphs hold and the eager step's peak; last, the whole step captured as one CUDA
graph, the floor that no host work reaches.

    python tools/graphed_layers.py [--lengths 4096,16384] [--layers 1,4,8] [--calls entry,mixer] [shape flags]

Per length, call and N: the step's p50 eager and with the graphed layers (CUDA events after a
synchronize, the two taking turns), the memory the graphs reserve (after torch's warm-up and
capture, caches emptied), the eager step's peak above its inputs, and the replay of one CUDA graph
of the whole step (p50, a synchronize before each). One layer alone is the latency of one call;
with several, the host's work for one layer overlaps the GPU's for the layers before it, as in a
model.

A developer instrument (the project never imports it). It needs CUDA.
"""

import argparse

import common
import mamba_cp
import torch
from against import graph_p50_ms, taking_turns
from bench import MIB, free     # free: collect, synchronize, empty the cache


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_flags(ap, dict(common.RECORD, lengths="4096,16384"))
    ap.add_argument("--layers", default=[1, 4, 8], type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.dtype}, nheads {args.nheads} "
          f"headdim {args.headdim} ngroups {args.ngroups} dstate {args.dstate}", flush=True)
    for L in args.lengths:
        for name in args.calls:
            call, make = common.CALLS[name]
            for n in args.layers:
                layers = [make(args, L, "cuda") for _ in range(n)]          # [(leaves, gradient of the output)]
                names = list(layers[0][0])

                def layer(*tensors, call=call, names=names):
                    return call(mamba_cp, dict(zip(names, tensors)), args)

                def step(fns, layers=layers):
                    outs = [fn(*leaves.values()) for fn, (leaves, _) in zip(fns, layers)]
                    loss = sum((out.float() * grad.float()).sum() for out, (_, grad) in zip(outs, layers))
                    return torch.autograd.grad(loss, [t for leaves, _ in layers for t in leaves.values()])

                free()
                reserved = torch.cuda.memory_reserved()
                graphed = torch.cuda.make_graphed_callables(
                    (layer,) * n, tuple(tuple(t.detach().clone().requires_grad_(True) for t in leaves.values())
                                        for leaves, _ in layers))
                free()
                held = (torch.cuda.memory_reserved() - reserved) / MIB
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step([layer] * n)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / MIB
                eager, by_torch = taking_turns([lambda: step([layer] * n), lambda: step(graphed)], args.iters, 3)
                del graphed
                free()
                whole = graph_p50_ms(lambda: step([layer] * n), args.iters, 3)
                print(f"L={L:>6} {name:>5} x {n}: step eager {eager:.3f} ms, graphed layers {by_torch:.3f} ms "
                      f"({eager / by_torch:.2f}x), one graph of the step {whole:.3f} ms (eager {eager / whole:.2f}x); "
                      f"the graphs hold {held:.0f} MiB, the eager step's peak above its inputs {peak:.0f} MiB",
                      flush=True)
                del layers
                free()


if __name__ == "__main__":
    main()
