"""Self-tests of the float64 oracle in reference_ssd.py (CPU, fast)."""

import math

import pytest
import torch
import torch.nn.functional as F

from reference_ssd import (causal_conv1d_reference, conv1d_ssd_reference, process_dt,
                           ssd_reference, ssd_reference_chunked)


def rel_rms(got, want):
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def seq_from_starts(l, starts):
    """Document ids (l,) with a new document at each position in `starts`."""
    s = torch.zeros(l, dtype=torch.int32)
    for st in starts:
        s[st:] += 1
    return s


# ---------------------------------------------------------------- hand-computed case

def test_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)
    dt = torch.tensor([0.5, 1.0, 0.25]).view(1, 3, 1)
    A = torch.tensor([-1.0])
    B = torch.tensor([1.0, 1.0, 2.0]).view(1, 3, 1, 1)
    C = torch.tensor([2.0, 1.0, 1.0]).view(1, 3, 1, 1)
    D = torch.tensor([0.5])
    z = torch.tensor([0.0, 1.0, -2.0]).view(1, 3, 1, 1)

    s0 = 0.5 * 1 * 1
    s1 = math.exp(-1.0) * s0 + 1.0 * 2 * 1
    s2 = math.exp(-0.25) * s1 + 0.25 * 3 * 2
    want = [s0 * 2 + 0.5 * 1, s1 * 1 + 0.5 * 2, s2 * 1 + 0.5 * 3]
    y, S = ssd_reference(x, dt, A, B, C, D=D)
    assert y.dtype == torch.float64 and S.shape == (1, 1, 1, 1)
    torch.testing.assert_close(y.flatten(), torch.tensor(want, dtype=torch.float64))
    assert S.item() == pytest.approx(s2, rel=1e-14)

    # gate: y *= silu(z)
    silu = lambda v: v / (1 + math.exp(-v))
    y, _ = ssd_reference(x, dt, A, B, C, D=D, z=z)
    gated = [w * silu(v) for w, v in zip(want, [0.0, 1.0, -2.0])]
    torch.testing.assert_close(y.flatten(), torch.tensor(gated, dtype=torch.float64))

    # initial state 1 reaches the first document only; a new document starts at t = 2
    init = torch.ones(1, 1, 1, 1)
    seq = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    i0 = math.exp(-0.5) * 1.0 + 0.5
    i1 = math.exp(-1.0) * i0 + 2.0
    i2 = 0.0 + 1.5
    y, S = ssd_reference(x, dt, A, B, C, initial_states=init, seq_idx=seq)
    want = [i0 * 2, i1 * 1, i2 * 1]
    torch.testing.assert_close(y.flatten(), torch.tensor(want, dtype=torch.float64))
    assert S.item() == pytest.approx(i2, rel=1e-14)


def test_process_dt():
    dt = torch.tensor([[[-1.0, 0.3, 30.0]]])
    assert torch.equal(process_dt(dt), dt.double())  # default limit: no clamp, stays negative
    sp = process_dt(dt, dt_softplus=True)
    torch.testing.assert_close(sp, F.softplus(dt.double()))
    assert sp[0, 0, 2].item() == 30.0  # linear above threshold 20
    cl = process_dt(dt, dt_bias=torch.tensor([0.0, 0.1, 0.0]), dt_limit=(0.0, 1.0))
    torch.testing.assert_close(cl, torch.tensor([[[0.0, 0.4, 1.0]]], dtype=torch.float64))


# ---------------------------------------------------------------- chunked == sequential

def make_inputs(gen, b, l, h, g, p, n, *, D=None, z=False, dt_bias=False, init=False,
                seq_starts=None):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    inp = dict(
        x=r(b, l, h, p),
        dt=torch.rand(b, l, h, generator=gen, dtype=torch.float64) + 0.01,
        A=-(torch.rand(h, generator=gen, dtype=torch.float64) + 0.5),
        B=r(b, l, g, n),
        C=r(b, l, g, n),
    )
    if D == "h":
        inp["D"] = r(h)
    elif D == "hp":
        inp["D"] = r(h, p)
    if z:
        inp["z"] = r(b, l, h, p)
    if dt_bias:
        inp["dt_bias"] = r(h) * 0.5
    if init:
        inp["initial_states"] = r(b, h, p, n)
    for v in inp.values():
        v.requires_grad_(True)
    if seq_starts is not None:
        inp["seq_idx"] = torch.stack([seq_from_starts(l, s) for s in seq_starts])
    return inp


def check_chunked(inp, chunk_size, gen, **kw):
    y1, s1 = ssd_reference(**inp, **kw)
    y2, s2 = ssd_reference_chunked(**inp, **kw, chunk_size=chunk_size)
    assert rel_rms(y2, y1) < 1e-10
    assert rel_rms(s2, s1) < 1e-10
    wy = torch.randn(y1.shape, generator=gen, dtype=torch.float64)
    ws = torch.randn(s1.shape, generator=gen, dtype=torch.float64)
    leaves = {k: v for k, v in inp.items() if torch.is_tensor(v) and v.requires_grad}
    g1 = torch.autograd.grad((y1 * wy).sum() + (s1 * ws).sum(), list(leaves.values()))
    g2 = torch.autograd.grad((y2 * wy).sum() + (s2 * ws).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, g1, g2):
        assert torch.isfinite(b).all(), name
        assert rel_rms(b, a) < 1e-10, (name, rel_rms(b, a))


def test_chunked_all_options():
    gen = torch.Generator().manual_seed(0)
    # row 0: documents start at 10, 16 (a chunk boundary), 30 and a 1-token document at 31;
    # row 1: documents start at 5 and 32 (a chunk boundary)
    inp = make_inputs(gen, 2, 37, 4, 2, 3, 5, D="hp", z=True, dt_bias=True, init=True,
                      seq_starts=[[10, 16, 30, 31], [5, 32]])
    with torch.no_grad():  # signed raw dt so softplus spans both sides of the limit
        inp["dt"].copy_(torch.randn(inp["dt"].shape, generator=gen, dtype=torch.float64) * 2 - 1)
    limit = (0.1, 1.5)
    dtp = process_dt(inp["dt"], inp["dt_bias"], True, limit)
    low, high = (dtp == limit[0]).float().mean(), (dtp == limit[1]).float().mean()
    assert 0.05 < low < 0.5 and 0.05 < high < 0.5  # the limit really clamps, on both sides
    check_chunked(inp, 16, gen, dt_softplus=True, dt_limit=limit)


@pytest.mark.parametrize("l,chunk", [(64, 16), (37, 16), (37, 64), (16, 16), (1, 8)])
def test_chunked_lengths(l, chunk):
    gen = torch.Generator().manual_seed(l * 100 + chunk)
    inp = make_inputs(gen, 2, l, 4, 1, 3, 4, init=True)
    check_chunked(inp, chunk, gen)


@pytest.mark.parametrize("D", ["h", "hp"])
def test_chunked_D_and_groups(D):
    gen = torch.Generator().manual_seed(1)
    inp = make_inputs(gen, 1, 37, 4, 2, 3, 5, D=D, z=True)
    check_chunked(inp, 16, gen)


def test_chunked_seq_idx_no_init():
    gen = torch.Generator().manual_seed(2)
    inp = make_inputs(gen, 2, 40, 4, 4, 2, 3, seq_starts=[[1, 8, 9, 24], [20]])
    check_chunked(inp, 8, gen, dt_softplus=True)


def test_chunked_extreme_decay():
    gen = torch.Generator().manual_seed(3)
    inp = make_inputs(gen, 2, 37, 4, 2, 3, 5, D="h", init=True, seq_starts=[[20], [3]])
    with torch.no_grad():  # dt' * A = -1000 at a few tokens
        for t in (0, 7, 16, 33):
            inp["dt"][:, t] = 1000.0 / -inp["A"]
    dA = process_dt(inp["dt"]) * inp["A"]
    assert torch.isclose(dA, torch.tensor(-1000.0, dtype=torch.float64)).sum() == 4 * 2 * 4
    check_chunked(inp, 16, gen)


# ---------------------------------------------------------------- causal conv1d

def test_conv_matches_torch():
    gen = torch.Generator().manual_seed(4)
    b, l, dim, K = 2, 11, 6, 4
    x = torch.randn(b, l, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, K, generator=gen, dtype=torch.float64)
    bias = torch.randn(dim, generator=gen, dtype=torch.float64)
    want = F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], bias, padding=K - 1,
                           groups=dim)[..., :l].transpose(1, 2))
    torch.testing.assert_close(causal_conv1d_reference(x, w, bias), want, rtol=1e-13, atol=1e-13)
    want0 = F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], None, padding=K - 1,
                            groups=dim)[..., :l].transpose(1, 2))
    torch.testing.assert_close(causal_conv1d_reference(x, w), want0, rtol=1e-13, atol=1e-13)


def test_conv_seq_idx():
    gen = torch.Generator().manual_seed(5)
    b, l, dim, K = 2, 12, 5, 4
    starts = [[4, 6, 7], [9]]
    seq = torch.stack([seq_from_starts(l, s) for s in starts])
    x = torch.randn(b, l, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(dim, K, generator=gen, dtype=torch.float64)
    bias = torch.randn(dim, generator=gen, dtype=torch.float64)
    out = causal_conv1d_reference(x, w, bias, seq)
    # every document convolved on its own
    for row in range(b):
        edges = [0] + starts[row] + [l]
        for s, e in zip(edges[:-1], edges[1:]):
            torch.testing.assert_close(out[row, s:e], causal_conv1d_reference(x[row:row + 1, s:e], w, bias)[0],
                                       rtol=1e-13, atol=1e-13)
    # output at a document's first token has exactly zero gradient w.r.t. earlier tokens
    for row in range(b):
        for st in starts[row]:
            (gx,) = torch.autograd.grad(out[row, st].sum(), x, retain_graph=True)
            assert torch.all(gx[row, :st] == 0)
            assert torch.all(gx[1 - row] == 0)
            assert torch.any(gx[row, st] != 0)


# ---------------------------------------------------------------- fused conv + SSD

def test_conv1d_ssd():
    gen = torch.Generator().manual_seed(6)
    b, l, h, p, g, n, K = 2, 21, 4, 3, 2, 5, 4
    dim = h * p + 2 * g * n
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    xBC, dt, w, cb, dtb, D = r(b, l, dim), r(b, l, h), r(dim, K), r(dim), r(h), r(h)
    A = -(torch.rand(h, generator=gen, dtype=torch.float64) + 0.5)
    seq = torch.stack([seq_from_starts(l, [8]), seq_from_starts(l, [3, 16])])
    kw = dict(headdim=p, ngroups=g, seq_idx=seq, dt_limit=(0.0, 2.0))
    y, S = conv1d_ssd_reference(xBC, dt, w, cb, dtb, A, D, **kw)
    u = causal_conv1d_reference(xBC, w, cb, seq)
    x_, B_, C_ = u[..., :h * p], u[..., h * p:h * p + g * n], u[..., h * p + g * n:]
    y2, S2 = ssd_reference(x_.reshape(b, l, h, p), dt, A, B_.reshape(b, l, g, n),
                           C_.reshape(b, l, g, n), D=D, dt_bias=dtb, seq_idx=seq,
                           dt_softplus=True, dt_limit=(0.0, 2.0))
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(S, S2, rtol=0, atol=0)
    y3, S3 = conv1d_ssd_reference(xBC, dt, w, cb, dtb, A, D, chunked=True, chunk_size=8, **kw)
    assert rel_rms(y3, y) < 1e-10 and rel_rms(S3, S) < 1e-10
    with pytest.raises(ValueError):
        conv1d_ssd_reference(xBC[..., :-1], dt, w[:-1], cb[:-1], dtb, A, D, **kw)
