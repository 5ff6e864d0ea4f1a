"""How many Python calls one eager call of the mixer entry makes into mamba_cp.py's own functions.

A developer instrument (the project never imports it). It runs `mamba_split_conv1d_scan_combined`
forward+backward on two gloo ranks of this machine (CPU, the Triton interpreter), with packed
documents, three times, and counts with sys.setprofile the calls of the third into functions
defined in mamba_cp.py: Python functions, lambdas and comprehensions, not the Triton kernels and
their @triton.jit helpers (on a GPU those are not Python calls). Prints the total, the launches
(Triton kernels run), the most called functions, and the torch operations (torch.profiler's aten
events) of a fourth call, its launches left out:

    python tools/host_calls.py [--world 2] [--layout none] [--top 25] [--no-documents] [--entry mixer|core]
"""
import argparse
import collections
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mamba_cp  # noqa: E402  (before torch.distributed's and triton's users)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def kernel_names():
    """Names of the module's Triton functions (kernels and @triton.jit helpers)."""
    from triton.runtime.jit import JITFunction
    kinds = (JITFunction,)
    try:
        from triton.runtime.interpreter import InterpretedFunction
        kinds += (InterpretedFunction,)
    except ImportError:
        pass
    return {name for name, v in vars(mamba_cp).items() if isinstance(getattr(v, "jit", v), kinds)}


def make_call(args, rank, world):
    g = torch.Generator().manual_seed(0)
    h, p, ng, n, d = 4, 8, 2, 8, 4
    L = 64 * world
    dim, conv_dim = h * p, h * p + 2 * ng * n
    zxbcdt = torch.randn(1, L, dim + conv_dim + h, generator=g)
    w = torch.randn(conv_dim, d, generator=g) * 0.3
    leaves = [mamba_cp.shard(zxbcdt, rank, world, args.layout).requires_grad_(), w.requires_grad_(),
              torch.zeros(conv_dim).requires_grad_(), torch.zeros(h).requires_grad_(),
              (-torch.rand(h, generator=g)).requires_grad_(), torch.ones(h).requires_grad_()]
    seq = None
    if args.documents:
        seq = mamba_cp.shard((torch.arange(L) // 40)[None].to(torch.int32), rank, world, args.layout)
    group = dist.group.WORLD

    if args.entry == "mixer":
        def call():
            out = mamba_cp.mamba_split_conv1d_scan_combined(*leaves, 16, seq_idx=seq, headdim=p, ngroups=ng,
                                                            cp_group=group, load_balancing=args.layout)
            out.sum().backward()
    else:
        def call():
            z, xBC, dt = leaves[0].split([dim, conv_dim, h], dim=-1)
            y = mamba_cp.mamba_conv1d_ssd_cp(xBC, dt, *leaves[1:], 16, headdim=p, ngroups=ng, cp_group=group,
                                             load_balancing=args.layout, seq_idx=seq)
            y.sum().backward()
    return call


def count(rank, world, port, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    call = make_call(args, rank, world)
    for _ in range(2):
        call()
    here, kernels = os.path.abspath(mamba_cp.__file__), kernel_names()
    calls, launches = collections.Counter(), collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or os.path.abspath(frame.f_code.co_filename) != here:
            return
        name = frame.f_code.co_name
        if name not in kernels:
            calls[name] += 1

    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run

    def counted_run(fn, *a, **kw):            # one launch of a kernel
        launches[fn.fn.__name__] += 1
        return run(fn, *a, **kw)
    interpreter.InterpretedFunction.run = counted_run
    dist.barrier()
    sys.setprofile(profile)
    call()
    sys.setprofile(None)
    interpreter.InterpretedFunction.run = run
    if rank == 0:
        print(f"{sum(calls.values())} Python calls into {len(calls)} of mamba_cp.py's functions "
              f"(entry {args.entry}, W = {world}, layout {args.layout}, documents {args.documents}); "
              f"{sum(launches.values())} Triton launches")
        for name, c in calls.most_common(args.top):
            print(f"  {c:5d}  {name}")
        print("launches: " + ", ".join(f"{k} {v}" for k, v in sorted(launches.items())))
    # the torch operations of one more call, its Triton launches replaced by nothing (the
    # interpreter's own copies are not the module's); nested ones count too (aten::zeros holds an aten::empty)
    from torch.profiler import ProfilerActivity, profile
    launch, mamba_cp._Launched.launch = mamba_cp._Launched.launch, lambda self, grid, *a, **k: None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    mamba_cp._Launched.launch = launch
    ops = collections.Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})
    if rank == 0:
        print(f"{sum(ops.values())} torch operations (aten::, nested included): " +
              ", ".join(f"{k[6:]} {v}" for k, v in ops.most_common(args.top)))
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layout", default="none")
    ap.add_argument("--entry", choices=("mixer", "core"), default="mixer")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-documents", dest="documents", action="store_false")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(count, args=(args.world, port, args), nprocs=args.world)
