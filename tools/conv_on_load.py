"""A timing prototype of the conv inside the SSD: this tree's mamba_cp.py rewritten so that the
chunk kernels compute the causal conv where they load x, B and C, and the conv's forward passes
(the forward's, and the backward's recompute) are skipped. Written to OUT, for tools/against.py:

    python tools/conv_on_load.py [--x-only] OUT.py
    python tools/against.py OUT.py --calls ssd,entry      # OUT is "before", this tree "after"

Each x, B and C tile is loaded as silu(bias + sum_k w_k u[t-3+k]) from the pre-conv tensor: four
shifted loads, four weight vectors and a bias vector a tile (read from the tensor itself: their
values do not matter), d_conv 4, no halo and no document ids, so it is a lower bound on what a
fused kernel costs. The backward's conv pass stays (its gradient needs the chunk kernels' dx, dB,
dC of the tokens after each one). With --x-only, only x is convolved on load, and B and C by a
conv pass over their channels alone (they are read once per head of their group, x once per head).
Its results are wrong; its work is the fused design's. "ssd" then times the SSD with the conv's
cost added to its loads, "entry" the fused layer against the separate pass.

A developer instrument (it rewrites the module's source); the project never imports it.
"""

import argparse
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONV_LOAD_TILE = '''

@triton.jit
def _conv_load_tile(ptr, stride, b64, t64, i, offs, mask, CONV: tl.constexpr = True):
    """Prototype: the tile as the conv's output, computed from the pre-conv tensor at ptr."""
    if not CONV:
        return tl.load(_tile_ptrs(ptr, stride, b64, t64, i, offs), mask=mask, other=0.0)
    col = ptr + i * stride[2] + offs * stride[3]
    acc = tl.load(col + 16, mask=offs >= 0, other=0.0).to(tl.float32)[None, :]        # the bias
    for k in tl.static_range(4):
        tk = t64 - (3 - k)
        wk = tl.load(col + 4 * k, mask=offs >= 0, other=0.0).to(tl.float32)           # tap k's weights
        acc += wk[None, :] * tl.load(_tile_ptrs(ptr, stride, b64, tk, i, offs), mask=mask & (tk >= 0)[:, None],
                                     other=0.0).to(tl.float32)
    return (acc * _sigmoid(acc, True)).to(ptr.dtype.element_ty)
'''

X_RAW_BC_CONV = '''

def _x_raw_bc_conv(call, plan):
    """Prototype: x as the pre-conv tensor's view, B and C from a conv pass over their channels."""
    hp, g, n = plan.nheads * plan.headdim, plan.ngroups, plan.dstate
    bias = None if call.conv_bias is None else call.conv_bias[hp:]
    bc = _conv1d_fwd(call.xBC[..., hp:], call.conv_weight[hp:], bias)
    rows, s, _ = bc.shape
    size, stride = (rows, s, g, n), (bc.stride(0), bc.stride(1), n, 1)
    return split_xBC(call.xBC, plan)[0], bc.as_strided(size, stride, 0), bc.as_strided(size, stride, g * n)
'''


def replace(src, old, new, count=None):
    """src with old replaced by new; old must occur (exactly `count` times, when given)."""
    found = src.count(old)
    if not found or count is not None and found != count:
        raise SystemExit(f"conv_on_load: mamba_cp.py changed: {old!r} occurs {found} times")
    return src.replace(old, new)


def prototype(src, x_only):
    load = "    return tl.load(_tile_ptrs(ptr, stride, b64, t64, i, offs), mask=mask, other=0.0)\n"
    src = replace(src, load, load + CONV_LOAD_TILE, 1)
    # the state passes: forward (x, B) convolve both; reverse (dy, C) only C
    src = replace(src, "ht = _load_tile(head_ptr,", "ht = _conv_load_tile(head_ptr,", 1)
    src = replace(src, "valid[:, None] & (offs_p[None, :] < headdim))",
                  "valid[:, None] & (offs_p[None, :] < headdim), not REVERSE)", 1)
    if not x_only:
        src = replace(src, "gt = _load_tile(group_ptr,", "gt = _conv_load_tile(group_ptr,", 1)
    for name in ("x",) if x_only else ("B", "C", "x"):     # the output and chunk-backward kernels
        src = replace(src, f"_load_tile({name}_ptr, stride_{name},", f"_conv_load_tile({name}_ptr, stride_{name},")
    skipped = re.compile(r"_conv1d_fwd\(call\.xBC, call\.conv_weight, call\.conv_bias, (?:kept\.)?halo, "
                         r"call\.seq_idx, (?:kept\.)?halo_seq,\s*silu=plan\.silu\)")
    src, n = skipped.subn("call.xBC", src)
    if n != 2:
        raise SystemExit(f"conv_on_load: mamba_cp.py changed: {n} conv forward passes found in the method, not 2")
    if x_only:
        src = replace(src, "\n\ndef method_forward(", X_RAW_BC_CONV + "\n\ndef method_forward(", 1)
        for d in ("fwd", "bwd"):             # the method's two (the all-to-all baseline's stays as it is)
            src = src.replace(f"ssd = ssd_tensors(*split_xBC(conv_out, plan.{d}), call, plan.{d})",
                              f"ssd = ssd_tensors(*_x_raw_bc_conv(call, plan.{d}), call, plan.{d})", 1)
    return src


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT", help="where to write the prototype module")
    ap.add_argument("--x-only", action="store_true", help="convolve only x on load; B and C in a pass of their own")
    args = ap.parse_args()
    with open(os.path.join(ROOT, "mamba_cp.py")) as f:
        src = prototype(f.read(), args.x_only)
    with open(args.out, "w") as f:
        f.write(src)


if __name__ == "__main__":
    main()
