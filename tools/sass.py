"""Every kernel of the SSD (mamba_chunk_scan_combined) and of the mixer entry
(mamba_split_conv1d_scan_combined, z gate; --calls adds "mixer", with the gated RMSNorm and out
projection, and "conv", the conv alone in bench.py --conv's four cases: plain, a halo, document
ids, both; or one case, "conv_plain", "conv_halo", "conv_ids" or "conv_halo_ids"), forward and
backward, compiled (never run) for one GPU arch, on any machine, a GPU's or not; per kernel its
registers, stack bytes (spills), SASS instructions and those of its longest loop's body (where a
kernel spends its steps: the conv's time follows it), and one `RESULT {json}` line.

    python tools/sass.py [--arch 90] [--against REV] [--lengths 16384] [shape flags] [--fwd-only]
                         [--launch JSON] [--kernel-chunk Q] [--tuning-fields JSON] [--calls ssd,entry,mixer,conv]

How: Triton's driver is replaced by a stand-in that reports a GPU of compute capability ARCH, and
every kernel launch becomes its compile (Triton's warm-up path), so the public functions run on
CPU tensors and compile what they would launch (what they return is garbage); the counts are
read with the cuobjdump that ships with Triton. With --against REV, mamba_cp.py at git revision
REV (or the file REV) is compiled too: rows "before" (REV) and "after" (this tree). bench.py's
tuning flags (--launch, --kernel-chunk, --tuning-fields) compile a variant of this tree's GPU
tuning, as bench.py times one (REV keeps its own).

A developer instrument: it reaches into Triton's runtime (driver.set_active, JITFunction.run).
The project never imports it.
"""

import argparse
import json
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"     # a compile for a GPU, never the interpreter: before mamba_cp's import
import common  # noqa: E402 - puts the repository root on sys.path
import mamba_cp  # noqa: E402
import bench  # noqa: E402 - its tuning flags (apply_tuning)
import torch  # noqa: E402


class CompileOnly:
    """Triton's active driver replaced by this stand-in of a GPU of compute capability `arch`, and
    JITFunction.run by its warm-up (compile, no launch); `compiled` gathers what was compiled."""

    def __init__(self, arch, modules):
        from triton.backends.compiler import GPUTarget
        self.target, self.compiled = GPUTarget("cuda", arch, 32), {}
        # the modules' launchers, and whether each launched directly (older revisions have none)
        self.launched = [(m._Launched, m._Launched.direct) for m in modules if hasattr(m, "_Launched")]
        # and whether each takes CPU tensors (its checks refuse them for GPU kernels, but nothing launches here)
        self.cpu_ok = [(m, m._CPU_TENSORS_OK) for m in modules if hasattr(m, "_CPU_TENSORS_OK")]

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
        self.run, compiled = JITFunction.run, self.compiled

        def compile_only(fn, *a, grid, warmup, **kw):
            kernel = self.run(fn, *a, grid=grid, warmup=True, **kw)
            compiled.setdefault(id(kernel), (fn.fn.__name__, kernel))
            return kernel
        driver.set_active(self)
        JITFunction.run = compile_only
        for launched, _ in self.launched:      # every launch through JITFunction.run
            launched.direct = False
        for m, _ in self.cpu_ok:
            m._CPU_TENSORS_OK = True
        return self

    def __exit__(self, *exc):
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction
        JITFunction.run = self.run
        for launched, direct in self.launched:
            launched.direct = direct
        for m, ok in self.cpu_ok:
            m._CPU_TENSORS_OK = ok
        try:
            driver.reset_active()
        except RuntimeError:        # a machine without a GPU driver has no default to go back to
            pass


def sass_counts(kernel):
    """(registers, stack bytes a thread, SASS instructions, those of its longest loop's body: from a
    backward branch's target to the branch, 0 without a loop) of a compiled kernel."""
    tool = os.path.join(os.path.dirname(mamba_cp.triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                       for flag in ("-res-usage", "-sass"))
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    lines = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(\S[^;]*)", sass, re.M)   # (address, instruction)
    at = {int(a, 16): i for i, (a, _) in enumerate(lines)}
    loop = 0
    for i, (a, ins) in enumerate(lines):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        # a branch back, not the exit's branch to itself
        if target and int(target.group(1), 16) < int(a, 16) and int(target.group(1), 16) in at:
            loop = max(loop, i - at[int(target.group(1), 16)] + 1)
    return int(regs), int(stack), len(lines), loop


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability (default 90: the H100 and H200)")
    ap.add_argument("--against", metavar="REV", help="also compile mamba_cp.py at git revision REV (or the file REV)")
    ap.add_argument("--fwd-only", action="store_true", help="compile the forward kernels only")
    bench.add_tuning_flags(ap)
    common.add_shape_flags(ap, common.RECORD)
    args = ap.parse_args()
    bench.apply_tuning(ap, args)
    L = args.lengths[0]
    modules = [("", mamba_cp)]          # a label only where there is something to tell apart
    if args.against:
        modules = [("before", common.load_revision(args.against)), ("after", mamba_cp)]
    phase = "fwd" if args.fwd_only else "fwdbwd"
    print(f"# kernels compiled for sm_{args.arch} (triton {mamba_cp.triton.__version__}), not run; "
          f"nheads={args.nheads} headdim={args.headdim} ngroups={args.ngroups} dstate={args.dstate} "
          f"chunk={args.chunk} batch={args.batch} L={L} dtype={args.dtype}, {phase}"
          + (f"; before = {args.against}, after = this tree" if args.against else "")
          + (f"; tuning {json.dumps(args.tuning)}" if args.tuning else ""), flush=True)
    with CompileOnly(args.arch, [m for _, m in modules]) as stand_in:
        for label, module in modules:
            calls = common.steps(module, args, L, "cpu", [c for c in args.calls if not c.startswith("conv")])
            calls.update({(f"conv_{case}", phase): fn for case, fn in conv_cases(module, args, L, phase)
                          if "conv" in args.calls or f"conv_{case}" in args.calls})
            for call in [c for c, ph in calls if ph == phase]:
                stand_in.compiled.clear()
                calls[call, phase]()
                for name, kernel in stand_in.compiled.values():
                    regs, stack, count, loop = sass_counts(kernel)
                    r = dict(bench="sass", call=call, kernel=name, arch=args.arch, L=L, dtype=args.dtype,
                             registers=regs, stack_bytes=stack, instructions=count, loop_instructions=loop)
                    if label:
                        r["module"] = label
                    print((f"{label:>6} " if label else "") + f"{call:>13} {name:<28} {regs:>4} registers "
                          f"{stack:>5} stack bytes {count:>6} instructions, {loop:>5} in its longest loop")
                    print("RESULT " + json.dumps(r), flush=True)


def conv_cases(module, args, L, phase):
    """(case, closure) of the conv alone on xBC, as bench.py --conv's four cases: its forward, and
    with "fwdbwd" its backward (which the mixer entry runs after the forward's recompute)."""
    dim, d, dtype = args.nheads * args.headdim + 2 * args.ngroups * args.dstate, args.d_conv, common.DTYPES[args.dtype]
    xBC, w, bias = torch.randn(args.batch, L, dim).to(dtype), torch.randn(dim, d), torch.randn(dim)
    halo, halo_seq = torch.randn(args.batch, d - 1, dim).to(dtype), torch.zeros(args.batch, d - 1, dtype=torch.int32)
    seq = (torch.arange(L) // max(1, L // 3)).to(torch.int32).expand(args.batch, L).contiguous()
    for case, kw in (("plain", {}), ("halo", dict(halo=halo)), ("ids", dict(seq_idx=seq)),
                     ("halo_ids", dict(halo=halo, seq_idx=seq, halo_seq=halo_seq))):
        def run(kw=kw):
            module.conv1d_fwd(xBC, w, bias, **kw)
            if phase == "fwdbwd":
                module.conv1d_bwd(xBC, xBC, w, bias, **kw)
        yield case, run


if __name__ == "__main__":
    main()
