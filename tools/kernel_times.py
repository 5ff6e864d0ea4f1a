"""Per-kernel GPU time of the SSD (mamba_chunk_scan_combined) and of the mixer entry
(mamba_split_conv1d_scan_combined, z gate; --calls adds "mixer", with the gated RMSNorm and out
projection), forward and forward+backward: torch.profiler's table
over --iters calls after one untimed call, per call, phase and length.

    python tools/kernel_times.py [--lengths 4096,16384,65536] [--iters 5] [shape flags] [tuning flags]

bench.py's tuning flags (--launch, --kernel-chunk, --tuning-fields) profile a variant of the GPU tuning.

Without CUDA it profiles the host instead (the Triton interpreter, at a small float32 shape):
that checks the script, not the kernels.

A developer instrument (it was `bench.py --profile`); the project never imports it.
"""

import argparse

import common
import mamba_cp  # before anything that imports triton: it picks the interpreter when CUDA is absent
import torch
import bench  # its tuning flags (add_tuning_flags, apply_tuning)
from torch.profiler import ProfilerActivity, profile

CUDA = torch.cuda.is_available()
CPU_SHAPE = dict(nheads=4, headdim=16, ngroups=2, dstate=16, d_conv=4, chunk=16, dtype="fp32", lengths="64")
GPU_SHAPE = dict(common.RECORD, lengths="4096,16384,65536")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5 if CUDA else 1, help="profiled calls (default 5 GPU, 1 CPU)")
    common.add_shape_flags(ap, GPU_SHAPE if CUDA else CPU_SHAPE)
    bench.add_tuning_flags(ap)
    args = ap.parse_args()
    bench.apply_tuning(ap, args)
    activity, column = (ProfilerActivity.CUDA, "device_time_total") if CUDA else (ProfilerActivity.CPU,
                                                                                  "cpu_time_total")
    for L in args.lengths:
        for (call, phase), fn in common.steps(mamba_cp, args, L, "cuda" if CUDA else "cpu", args.calls).items():
            fn()
            with profile(activities=[activity]) as prof:
                for _ in range(args.iters):
                    fn()
                if CUDA:
                    torch.cuda.synchronize()
            print(f"\n# {call} {phase}, L={L}, {args.dtype}: {args.iters} calls")
            print(prof.key_averages().table(sort_by=column, row_limit=20), flush=True)


if __name__ == "__main__":
    main()
