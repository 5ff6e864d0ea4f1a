"""What tools/sass.py and tools/against.py share: the repository root on sys.path, the two calls
they compile or time (the SSD, mamba_chunk_scan_combined; the mixer entry,
mamba_split_conv1d_scan_combined with the z gate; and the same entry as a Mamba2 mixer calls it,
with the gated RMSNorm and the out projection) and their inputs, and mamba_cp.py at another
revision imported beside this tree's. Developer instruments: the project never imports them.

This file imports no mamba_cp: each script sets TRITON_INTERPRET as it needs before its import.
"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)            # `import mamba_cp` from tools/ as from the root

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RECORD = dict(nheads=64, headdim=64, ngroups=8, dstate=128, d_conv=4, chunk=128, dtype="bf16", lengths="16384")


def add_shape_flags(ap, defaults):
    """The shape flags, with `defaults` (RECORD's keys); --lengths is a comma-separated list."""
    for name in ("nheads", "headdim", "ngroups", "dstate", "d_conv", "chunk"):
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        ap.add_argument(*flags, dest=name, type=int, default=defaults[name], help=f"default {defaults[name]}")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=defaults["dtype"],
                    help=f"dtype of x, B, C and zxbcdt (default {defaults['dtype']})")
    ap.add_argument("--lengths", default=defaults["lengths"], type=lambda s: [int(v) for v in s.split(",") if v],
                    help=f"comma-separated sequence lengths (default {defaults['lengths']})")
    ap.add_argument("--calls", default="ssd,entry", type=lambda s: [c for c in s.split(",") if c],
                    help="comma-separated calls of " + ", ".join(CALLS) + " (default ssd,entry)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)


def _params(gen, h, device):
    """dt_bias, A, D of h heads, fp32: softplus(dt_bias) in (1e-3, 1e-1), A in (-15, -1), D near 1."""
    rand = torch.rand(3, h, generator=gen, device=device)
    return dict(dt_bias=torch.log(torch.expm1(1e-3 + (1e-1 - 1e-3) * rand[0])),
                A=-torch.exp(2.7 * rand[1]), D=1.0 + 0.1 * (rand[2] - 0.5))


def ssd_inputs(args, L, device):
    """The SSD's leaves (x, dt, A, B, C, D, dt_bias; all require grad) and its output's gradient."""
    gen = torch.Generator(device).manual_seed(args.seed)
    b, h, p, g, n, dtype = args.batch, args.nheads, args.headdim, args.ngroups, args.dstate, DTYPES[args.dtype]

    def randn(*size, scale=1.0, dt=dtype):
        return (torch.randn(size, generator=gen, device=device) * scale).to(dt)

    leaves = dict(x=randn(b, L, h, p), dt=randn(b, L, h, scale=0.5, dt=torch.float32),
                  B=randn(b, L, g, n, scale=n ** -0.5), C=randn(b, L, g, n, scale=n ** -0.5), **_params(gen, h, device))
    return {k: v.requires_grad_(True) for k, v in leaves.items()}, randn(b, L, h, p)


def entry_inputs(args, L, device):
    """The mixer entry's leaves: zxbcdt = [z | xBC | dt] (dt raw) in --dtype, the conv's weight and
    bias, dt_bias, A, D in fp32; all require grad. Also the gated output's gradient."""
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    dim, h, dtype = args.nheads * args.headdim, args.nheads, DTYPES[args.dtype]
    conv_dim = dim + 2 * args.ngroups * args.dstate
    leaves = dict(zxbcdt=torch.randn(args.batch, L, dim + conv_dim + h, generator=gen, device=device).to(dtype),
                  conv_weight=torch.randn(conv_dim, args.d_conv, generator=gen, device=device) * args.d_conv ** -0.5,
                  conv_bias=0.1 * torch.randn(conv_dim, generator=gen, device=device), **_params(gen, h, device))
    grad = torch.randn(args.batch, L, dim, generator=gen, device=device).to(dtype)
    return {k: v.requires_grad_(True) for k, v in leaves.items()}, grad


def mixer_inputs(args, L, device):
    """The entry's leaves as a Mamba2 mixer of transformers calls it (examples/transformers_cp.py):
    also the gated RMSNorm's weight (a group of dim / ngroups channels, after the gate) and the out
    projection's weight (dim / 2 outputs: expand 2), both in --dtype; the projected output's gradient."""
    leaves, _ = entry_inputs(args, L, device)
    gen = torch.Generator(device).manual_seed(args.seed + 2)
    dim, dtype = args.nheads * args.headdim, DTYPES[args.dtype]
    leaves["rmsnorm_weight"] = (1 + 0.1 * torch.randn(dim, generator=gen, device=device)).to(dtype).requires_grad_(True)
    leaves["outproj_weight"] = (torch.randn(dim // 2, dim, generator=gen, device=device) * dim ** -0.5).to(
        dtype).requires_grad_(True)
    return leaves, torch.randn(args.batch, L, dim // 2, generator=gen, device=device).to(dtype)


def ssd(module, t, args):
    return module.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], args.chunk, D=t["D"],
                                            dt_bias=t["dt_bias"], dt_softplus=True)


def entry(module, t, args):
    return module.mamba_split_conv1d_scan_combined(t["zxbcdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"],
                                                   t["A"], t["D"], args.chunk, headdim=args.headdim,
                                                   ngroups=args.ngroups)


def mixer(module, t, args):
    return module.mamba_split_conv1d_scan_combined(t["zxbcdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"],
                                                   t["A"], t["D"], args.chunk, headdim=args.headdim,
                                                   ngroups=args.ngroups, rmsnorm_weight=t["rmsnorm_weight"],
                                                   rmsnorm_eps=1e-5, norm_before_gate=False,
                                                   outproj_weight=t["outproj_weight"])


CALLS = {"ssd": (ssd, ssd_inputs), "entry": (entry, entry_inputs), "mixer": (mixer, mixer_inputs)}


def steps(module, args, L, device, calls=("ssd", "entry")):
    """{(call, phase): argument-free closure} for each call in `calls` ("ssd", "entry", "mixer")
    of `module`, phase "fwd" (under no_grad) and "fwdbwd" (autograd.grad into every leaf)."""
    out = {}
    for name in calls:
        call, make = CALLS[name]
        leaves, grad = make(args, L, device)

        def fwd(call=call, leaves=leaves):
            with torch.no_grad():
                return call(module, leaves, args)

        def fwdbwd(call=call, leaves=leaves, grad=grad):
            return torch.autograd.grad(call(module, leaves, args), list(leaves.values()), grad)

        out[name, "fwd"], out[name, "fwdbwd"] = fwd, fwdbwd
    return out


def load_revision(rev):
    """mamba_cp.py as committed at git revision `rev` (or the file at the path `rev`), imported
    under a name of its own beside this tree's module. Its custom ops' namespace is renamed
    (every "mamba_cp::" and torch.ops.mamba_cp), whatever the ops are called, so both modules
    register theirs in one process."""
    if os.path.isfile(rev):                     # a copy of the module, for machines without the git history
        with open(rev) as f:
            src = f.read()
    else:
        run = subprocess.run(["git", "show", f"{rev}:mamba_cp.py"], cwd=ROOT, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"cannot read mamba_cp.py at {rev!r}: {run.stderr.strip()}")
        src = run.stdout
    name = "mamba_cp_at_" + re.sub(r"\W", "_", os.path.basename(rev))
    src = re.sub(r"\bmamba_cp::", f"{name}::", src)
    src = re.sub(r"\btorch\.ops\.mamba_cp\b", f"torch.ops.{name}", src)
    path = os.path.join(tempfile.mkdtemp(prefix="mamba_cp_rev_"), name + ".py")   # Triton reads kernels' source
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
