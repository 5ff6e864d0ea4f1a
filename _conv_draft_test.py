"""Oracle tests for _conv_draft: conv1d_fwd / conv1d_bwd against reference_ssd.causal_conv1d_reference.

The reference has no halo. A halo is the d-1 tokens just before the shard, so the reference runs
on the concatenation [halo, xBC] (ids [halo_seq, seq_idx]) and its first d-1 outputs are dropped;
the halo's gradient is the gradient w.r.t. the first d-1 rows of that concatenation.
Criterion: relative RMS error rms(got - want) / rms(want) < 1e-5 in float32, per tensor.
"""

import pytest
import torch

import _conv_draft as cd
from reference_ssd import causal_conv1d_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = 1e-5


def rel_rms(got, want):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    err = (got - want).pow(2).mean().sqrt()
    scale = want.pow(2).mean().sqrt()
    return (err / scale).item() if scale > 0 else err.item()   # both exactly zero: 0


def doc_ids(b, l, d, starts):
    """Ids (b, d-1+l) of [halo, shard]: row i gets a new document at each shard position in
    starts[i] (negative = inside the halo)."""
    full = torch.zeros(b, d - 1 + l, dtype=torch.int32)
    for i, pos in enumerate(starts):
        for p in pos:
            if -(d - 1) < p < l:   # a start at the first halo token changes nothing
                full[i, p + d - 1:] += 1
    return full


def make(b, l, dim, d, *, halo, bias, starts, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(b, l, dim + 13, generator=g).to(DEVICE)   # slice on the device: .to() would compact it
    xBC = wide[:, :, 5:5 + dim] if strided else wide[:, :, :dim].contiguous()   # (b, l, dim)
    inp = dict(
        xBC=xBC,
        weight=torch.randn(dim, d, generator=g) * 0.5,
        bias=torch.randn(dim, generator=g) if bias else None,
        halo=torch.randn(b, d - 1, dim, generator=g) if halo else None,
        seq_idx=None, halo_seq=None)
    if starts is not None:
        ids = doc_ids(b, l, d, starts)
        inp["seq_idx"] = ids[:, d - 1:].contiguous()
        if halo:
            inp["halo_seq"] = ids[:, :d - 1].contiguous()
    dout = torch.randn(b, l, dim, generator=g)
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in inp.items()}, dout.to(DEVICE)


def reference(inp, dout):
    """float64 output and gradients (dxBC, dhalo, dweight, dbias) of sum(out * dout)."""
    d = inp["weight"].shape[1]
    x = inp["xBC"].detach().double().requires_grad_()
    w = inp["weight"].detach().double().requires_grad_()
    bias = inp["bias"].detach().double().requires_grad_() if inp["bias"] is not None else None
    seq = inp["seq_idx"]
    if inp["halo"] is not None:
        h = inp["halo"].detach().double().requires_grad_()
        full = torch.cat([h, x], dim=1)                                   # (b, d-1+l, dim)
        seq_full = torch.cat([inp["halo_seq"], seq], dim=1) if seq is not None else None
        out = causal_conv1d_reference(full, w, bias, seq_full)[:, d - 1:]
    else:
        h = None
        out = causal_conv1d_reference(x, w, bias, seq)
    leaves = [t for t in (x, h, w, bias) if t is not None]
    grads = iter(torch.autograd.grad((out * dout.double()).sum(), leaves))
    return out, tuple(next(grads) if t is not None else None for t in (x, h, w, bias))


def check(inp, dout):
    out = cd.conv1d_fwd(**inp)
    got = cd.conv1d_bwd(dout, **inp)
    want_out, want = reference(inp, dout)
    assert out.dtype == inp["xBC"].dtype and out.is_contiguous()
    errs = {"out": rel_rms(out, want_out)}
    for name, g, w in zip(("dxBC", "dhalo", "dweight", "dbias"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.shape == w.shape, name
            errs[name] = rel_rms(g, w)
    assert got[0].dtype == inp["xBC"].dtype
    assert all(e < BOUND for e in errs.values()), errs
    return out, got


# Document starts per batch row, in shard positions (negative: inside the halo; starts past the
# shard's end are dropped). "mixed": a start inside the halo, a one-token document at 4, and a
# start at 1 so that taps straddle it; "mixed2": a start exactly at 0, and starts at 2 and 3 (a
# one-token document at 2); "one-doc": ids given, a single document everywhere.
STARTS = {
    "none": None,
    "one-doc": [[], []],
    "mixed": [[-1, 4, 5], [1]],
    "mixed2": [[0], [2, 3]],
}


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("halo", [False, True])
@pytest.mark.parametrize("l,starts", [(1, "mixed"), (3, "mixed"), (3, "mixed2"), (50, "mixed"),
                                      (50, "mixed2"), (77, "mixed"), (77, "mixed2")])
def test_matches_reference(d, l, halo, starts):
    bias = (d + l + halo + len(starts)) % 2 == 1   # half the cases with bias, spread over the grid
    inp, dout = make(2, l, 40, d, halo=halo, bias=bias, starts=STARTS[starts], seed=d * 100 + l)
    check(inp, dout)


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("halo", [False, True])
def test_without_documents(d, halo):
    bias = (d + halo) % 2 == 1      # each of halo / no halo seen with and without bias
    inp, dout = make(2, 77, 40, d, halo=halo, bias=bias, starts=None, seed=d)
    check(inp, dout)


@pytest.mark.parametrize("starts", [[[-2], [-1]], [[0], [0]], [[1], [2]], [[3, 4], [1, 2]], [[], []]],
                         ids=["in-halo", "at-0", "at-1-2", "one-token", "one-doc"])
def test_document_boundaries(starts):
    """Each kind of boundary alone, d=4 with a halo: the halo's own ids matter."""
    inp, dout = make(2, 50, 40, 4, halo=True, bias=True, starts=starts, seed=5)
    check(inp, dout)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_non_contiguous(d):
    inp, dout = make(2, 77, 40, d, halo=True, bias=True, starts=STARTS["mixed"], strided=True)
    assert not inp["xBC"].is_contiguous()
    inp["halo"] = inp["halo"].transpose(1, 2).contiguous().transpose(1, 2)   # channel-strided halo
    inp["weight"] = inp["weight"].t().contiguous().t()                          # tap-major weight
    dout = dout.transpose(0, 1).contiguous().transpose(0, 1)
    inp["seq_idx"] = inp["seq_idx"].long()                                      # int64 ids, int32 halo ids
    check(inp, dout)


def test_small_tiles_many_programs(monkeypatch):
    """Tiles smaller than the sequence and the channels, several token blocks per backward program:
    taps cross tile edges, channel masks, partial sums folded across blocks."""
    monkeypatch.setattr(cd, "_INTERP_BLOCKS", (32, 32))
    monkeypatch.setattr(cd, "_GPU_BLOCKS", (32, 32))
    monkeypatch.setattr(cd, "_BWD_PROGRAMS", 7)   # 3 token x 2 channel blocks x 2 rows -> 2 blocks each
    inp, dout = make(2, 77, 40, 4, halo=True, bias=True, starts=STARTS["mixed"], seed=3)
    check(inp, dout)


def test_deterministic(monkeypatch):
    monkeypatch.setattr(cd, "_BWD_PROGRAMS", 1)   # every token block of a row in one program
    inp, dout = make(2, 77, 40, 4, halo=True, bias=True, starts=STARTS["mixed"], seed=11)
    a, b = cd.conv1d_bwd(dout, **inp), cd.conv1d_bwd(dout, **inp)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(cd.conv1d_fwd(**inp), cd.conv1d_fwd(**inp))


def test_need_dhalo_false():
    inp, dout = make(2, 50, 40, 4, halo=True, bias=False, starts=None)
    dx, dhalo, dw, db = cd.conv1d_bwd(dout, **inp, need_dhalo=False)
    assert dhalo is None and db is None
    _, want = reference(inp, dout)
    assert rel_rms(dx, want[0]) < BOUND and rel_rms(dw, want[2]) < BOUND


def test_bad_inputs():
    inp, dout = make(2, 10, 40, 4, halo=True, bias=True, starts=STARTS["mixed"])
    bad = [
        dict(weight=inp["weight"][:, :1]),                        # d_conv 1
        dict(weight=inp["weight"][:30]),                          # wrong dim
        dict(halo=inp["halo"][:, :2]),                            # halo not d-1 rows
        dict(halo_seq=None),                                      # halo + seq_idx need halo_seq
        dict(seq_idx=inp["seq_idx"].float()),                     # ids must be integers
        dict(seq_idx=None),                                       # halo_seq without seq_idx
        dict(xBC=inp["xBC"][0]),                                  # 2 dims
        dict(bias=inp["bias"][:5]),
    ]
    for change in bad:
        with pytest.raises(ValueError, match=r"^\w+: got .*, expected "):
            cd.conv1d_fwd(**{**inp, **change})
    with pytest.raises(ValueError, match="dout: got"):
        cd.conv1d_bwd(dout[:, :5], **inp)
