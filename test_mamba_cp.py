"""Oracle tests for mamba_cp: every result against the float64 loop of reference_ssd.py.

    pytest -q test_mamba_cp.py            # CPU: Triton interpreter, float32, bound 1e-5
                                          # GPU: the same cases, plus bf16 at the record shape
                                          #      and one 2^20-token call

Criterion (DESIGN.md section 7): relative RMS error rms(got - want) / rms(want), per tensor,
for the output, the final state and every gradient.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import mamba_cp
import reference_ssd as ref
from reference_ssd import (causal_conv1d_reference, conv1d_ssd_reference, process_dt,
                           ssd_reference, ssd_reference_chunked)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # without CUDA the kernels run in the Triton interpreter
FP32_BOUND = 1e-5
BF16_BOUND = 1e-2


def rel_rms(got, want):
    got, want = got.double(), want.double()
    scale = want.pow(2).mean().sqrt()
    err = (got - want).pow(2).mean().sqrt()
    if not torch.isfinite(got).all():
        return float("inf")
    return (err / scale).item() if scale > 0 else err.item()


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

SMALL = dict(batch=2, seqlen=77, nheads=4, headdim=24, ngroups=2, dstate=20, chunk=16)


def make_inputs(seed, *, batch, seqlen, nheads, headdim, ngroups, dstate, chunk, dtype=torch.float32,
                device=DEVICE, D=None, z=False, dt_bias=False, dt_softplus=False, initial_states=False,
                seq_idx=None, dt_limit=(0.0, float("inf")), extreme=False):
    """One seeded set of inputs; options named as in mamba_chunk_scan_combined.
    D: None, "h" or "hp". seq_idx: None or a list of document start positions."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    b, l, h, p, n = batch, seqlen, nheads, headdim, dstate
    kw = {}
    A = -torch.exp(torch.rand(h, generator=g) * 1.5 - 1.0).to(device)            # (h,) in (-1.6, -0.4)
    if dt_softplus:
        dt = rnd(b, l, h, scale=0.7) - 1.0                                         # raw, softplus inside
    else:
        dt = (torch.rand(b, l, h, generator=g) * 0.3 + 0.02).to(device)            # already positive
    if extreme:  # 5% of tokens with dt'*A = -1000 among small decays
        big = (torch.rand(b, l, h, generator=g) < 0.05).to(device)
        dt = torch.where(big, 1000.0 / -A, dt * 0.1)
    x = rnd(b, l, h, p).to(dtype)
    B = rnd(b, l, ngroups, n).to(dtype)
    C = rnd(b, l, ngroups, n).to(dtype)
    if D == "h":
        kw["D"] = rnd(h)
    elif D == "hp":
        kw["D"] = rnd(h, p)
    if z:
        kw["z"] = rnd(b, l, h, p).to(dtype)
    if dt_bias:
        kw["dt_bias"] = rnd(h, scale=0.5)
    if initial_states:
        kw["initial_states"] = rnd(b, h, p, n)
    if seq_idx is not None:
        ids = torch.zeros(b, l, dtype=torch.int32)
        for start in seq_idx:
            ids[:, start:] += 1
        if b > 1:  # the second row splits once more, mid-chunk
            ids[1, l // 2:] += 1
        kw["seq_idx"] = ids.to(device)
    return dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk, dt_softplus=dt_softplus, dt_limit=dt_limit, **kw)


DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def run_both(inputs, oracle_inputs=None, chunked=False):
    """Output, final state and every gradient from the kernels and from the oracle, under the
    same random output weights. Returns {name: (got, want)}."""
    inputs = {k: (v.detach().clone().requires_grad_(True) if k in DIFFERENTIABLE else v)
              for k, v in inputs.items()}
    oracle_inputs = inputs if oracle_inputs is None else {
        k: (v.detach().clone().requires_grad_(True) if k in DIFFERENTIABLE else v) for k, v in oracle_inputs.items()}
    leaves = [k for k in DIFFERENTIABLE if k in inputs]

    y, final = mamba_cp.mamba_chunk_scan_combined(**inputs, return_final_states=True)
    g = torch.Generator().manual_seed(1234)
    wy = torch.randn(y.shape, generator=g).to(y.device)
    wf = torch.randn(final.shape, generator=g).to(y.device)
    grads = torch.autograd.grad((y.float() * wy).sum() + (final * wf).sum(), [inputs[k] for k in leaves])

    oracle_kw = {k: v for k, v in oracle_inputs.items() if k != "chunk_size"}
    if chunked:
        yr, fr = ref.ssd_reference_chunked(**oracle_kw, chunk_size=inputs["chunk_size"])
    else:
        yr, fr = ref.ssd_reference(**oracle_kw)
    grads_r = torch.autograd.grad((yr * wy.double()).sum() + (fr * wf.double()).sum(),
                                  [oracle_inputs[k] for k in leaves])
    out = {"y": (y, yr), "final_states": (final, fr)}
    out.update({"d" + k: (a, b) for k, a, b in zip(leaves, grads, grads_r)})
    return out


def assert_close(pairs, bound):
    errs = {k: rel_rms(a, b) for k, (a, b) in pairs.items()}
    bad = {k: e for k, e in errs.items() if not e <= bound}
    assert not bad, f"relative RMS above {bound:g}: {bad} (all: {errs})"
    return errs


# ---------------------------------------------------------------------------------------------
# Single-device SSD against the oracle
# ---------------------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "D_h": dict(D="h"),
    "D_hp": dict(D="hp"),
    "z": dict(z=True),
    "dt_bias": dict(dt_bias=True),
    "dt_softplus": dict(dt_softplus=True),
    "initial_states": dict(initial_states=True),
    "seq_idx": dict(seq_idx=[16, 40, 41]),
    "dt_limit": dict(dt_softplus=True, dt_bias=True, dt_limit=(0.25, 0.6)),
    "all": dict(D="hp", z=True, dt_bias=True, dt_softplus=True, initial_states=True,
                seq_idx=[16, 40, 41], dt_limit=(0.05, 1.5)),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_against_oracle(name):
    assert_close(run_both(make_inputs(1, **SMALL, **OPTIONS[name])), FP32_BOUND)


@pytest.mark.parametrize("shape", [
    dict(batch=1, seqlen=100, nheads=3, headdim=8, ngroups=1, dstate=16, chunk=64),   # partial chunk
    dict(batch=2, seqlen=33, nheads=6, headdim=24, ngroups=3, dstate=20, chunk=16),  # odd sizes
    dict(batch=1, seqlen=5, nheads=2, headdim=8, ngroups=2, dstate=8, chunk=16),     # shorter than a chunk
    dict(batch=1, seqlen=64, nheads=2, headdim=32, ngroups=1, dstate=32, chunk=32),  # exact chunks
], ids=["l100_q64", "g3_p24_n20", "l5", "exact"])
def test_awkward_shapes(shape):
    assert_close(run_both(make_inputs(2, **shape, D="h", z=True, dt_bias=True, dt_softplus=True,
                                      initial_states=True)), FP32_BOUND)


def test_dt_limit_clamps():
    inputs = make_inputs(3, **SMALL, dt_softplus=True, dt_bias=True, dt_limit=(0.25, 0.6))
    v = ref.process_dt(inputs["dt"], inputs["dt_bias"], True)
    low, high = (v < 0.25).float().mean().item(), (v > 0.6).float().mean().item()
    assert low > 0.05 and high > 0.05, f"the limit must clamp on both sides (got {low:.2f}, {high:.2f})"
    assert_close(run_both(inputs), FP32_BOUND)


def test_seq_idx_documents():
    """Several documents, one starting exactly at a chunk boundary (32), a one-token document
    (47), and rows that split differently; with initial states that reach only the first."""
    inputs = make_inputs(4, **dict(SMALL, seqlen=90), seq_idx=[32, 47, 48, 70], initial_states=True,
                         D="h", z=True)
    assert inputs["seq_idx"][0, 31] != inputs["seq_idx"][0, 32]
    assert_close(run_both(inputs), FP32_BOUND)


@pytest.mark.parametrize("chunk", [64, 128])
def test_extreme_decay(chunk):
    inputs = make_inputs(5, batch=2, seqlen=300, nheads=4, headdim=16, ngroups=2, dstate=16, chunk=chunk,
                         extreme=True, D="hp", initial_states=True, seq_idx=[150])
    frac = (inputs["dt"] * inputs["A"] <= -999).float().mean().item()
    assert 0.02 < frac < 0.1
    errs = assert_close(run_both(inputs), FP32_BOUND)
    assert all(e == e for e in errs.values())


def test_deterministic():
    inputs = make_inputs(6, **SMALL, **OPTIONS["all"])
    runs = []
    for _ in range(2):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items() if k in DIFFERENTIABLE}
        y, f = mamba_cp.mamba_chunk_scan_combined(**{**inputs, **leaves}, return_final_states=True)
        grads = torch.autograd.grad(y.sum() + f.pow(2).sum(), list(leaves.values()))
        runs.append([y, f, *grads])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_returns_like_mamba_ssm():
    inputs = make_inputs(7, **SMALL)
    y = mamba_cp.mamba_chunk_scan_combined(**inputs)
    assert isinstance(y, torch.Tensor) and y.shape == inputs["x"].shape and y.dtype == inputs["x"].dtype
    y2, final = mamba_cp.mamba_chunk_scan_combined(**inputs, return_final_states=True)
    assert final.dtype == torch.float32 and final.shape == (2, 4, 24, 20)
    assert torch.equal(y, y2)


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument
# ---------------------------------------------------------------------------------------------

def _bad_cases():
    ok = make_inputs(8, batch=1, seqlen=20, nheads=4, headdim=8, ngroups=2, dstate=8, chunk=16, device="cpu")
    x, B = ok["x"], ok["B"]
    return {
        "x_rank": ("x", dict(x=x[0])),
        "dt_shape": ("dt", dict(dt=ok["dt"][:, :10])),
        "A_shape": ("A", dict(A=ok["A"][:3])),
        "B_rank": ("B", dict(B=B[0])),
        "C_shape": ("C", dict(C=ok["C"][..., :4])),
        "ngroups": ("B", dict(B=torch.randn(1, 20, 3, 8), C=torch.randn(1, 20, 3, 8))),
        "D_shape": ("D", dict(D=torch.randn(5))),
        "z_shape": ("z", dict(z=torch.randn(1, 20, 4, 7))),
        "dt_bias_shape": ("dt_bias", dict(dt_bias=torch.randn(4, 1))),
        "init_shape": ("initial_states", dict(initial_states=torch.randn(1, 4, 8, 9))),
        "seq_float": ("seq_idx", dict(seq_idx=torch.zeros(1, 20))),
        "seq_decreasing": ("seq_idx", dict(seq_idx=torch.tensor([[1] * 10 + [0] * 10], dtype=torch.int32))),
        "chunk_not_pow2": ("chunk_size", dict(chunk_size=48)),
        "chunk_small": ("chunk_size", dict(chunk_size=8)),
        "dtype_mismatch": ("B", dict(B=B.double())),
        "device_mismatch": ("A", dict(A=ok["A"].to("meta"))),
        "cu_seqlens": ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 20]))),
    }, ok


@pytest.mark.parametrize("case", list(_bad_cases()[0]))
def test_bad_input_raises(case):
    cases, ok = _bad_cases()
    name, change = cases[case]
    with pytest.raises(ValueError, match=rf"^{name}: got .*, expected "):
        mamba_cp.mamba_chunk_scan_combined(**{**ok, **change})


# ---------------------------------------------------------------------------------------------
# The oracle checks itself: a hand-computed case, and its chunked float64 form and causal conv
# against the token loop and torch (so the chunked form may stand in for the loop on the GPU)
# ---------------------------------------------------------------------------------------------

def seq_from_starts(l, starts):
    """Document ids (l,) with a new document at each position in `starts`."""
    s = torch.zeros(l, dtype=torch.int32)
    for st in starts:
        s[st:] += 1
    return s


# ---------------------------------------------------------------- hand-computed case

def test_oracle_hand_computed():
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


def test_oracle_process_dt():
    dt = torch.tensor([[[-1.0, 0.3, 30.0]]])
    assert torch.equal(process_dt(dt), dt.double())  # default limit: no clamp, stays negative
    sp = process_dt(dt, dt_softplus=True)
    torch.testing.assert_close(sp, F.softplus(dt.double()))
    assert sp[0, 0, 2].item() == 30.0  # linear above threshold 20
    cl = process_dt(dt, dt_bias=torch.tensor([0.0, 0.1, 0.0]), dt_limit=(0.0, 1.0))
    torch.testing.assert_close(cl, torch.tensor([[[0.0, 0.4, 1.0]]], dtype=torch.float64))


# ---------------------------------------------------------------- chunked == sequential

def oracle_inputs(gen, b, l, h, g, p, n, *, D=None, z=False, dt_bias=False, init=False,
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


def test_oracle_chunked_all_options():
    gen = torch.Generator().manual_seed(0)
    # row 0: documents start at 10, 16 (a chunk boundary), 30 and a 1-token document at 31;
    # row 1: documents start at 5 and 32 (a chunk boundary)
    inp = oracle_inputs(gen, 2, 37, 4, 2, 3, 5, D="hp", z=True, dt_bias=True, init=True,
                      seq_starts=[[10, 16, 30, 31], [5, 32]])
    with torch.no_grad():  # signed raw dt so softplus spans both sides of the limit
        inp["dt"].copy_(torch.randn(inp["dt"].shape, generator=gen, dtype=torch.float64) * 2 - 1)
    limit = (0.1, 1.5)
    dtp = process_dt(inp["dt"], inp["dt_bias"], True, limit)
    low, high = (dtp == limit[0]).float().mean(), (dtp == limit[1]).float().mean()
    assert 0.05 < low < 0.5 and 0.05 < high < 0.5  # the limit really clamps, on both sides
    check_chunked(inp, 16, gen, dt_softplus=True, dt_limit=limit)


@pytest.mark.parametrize("l,chunk", [(64, 16), (37, 16), (37, 64), (16, 16), (1, 8)])
def test_oracle_chunked_lengths(l, chunk):
    gen = torch.Generator().manual_seed(l * 100 + chunk)
    inp = oracle_inputs(gen, 2, l, 4, 1, 3, 4, init=True)
    check_chunked(inp, chunk, gen)


@pytest.mark.parametrize("D", ["h", "hp"])
def test_oracle_chunked_D_and_groups(D):
    gen = torch.Generator().manual_seed(1)
    inp = oracle_inputs(gen, 1, 37, 4, 2, 3, 5, D=D, z=True)
    check_chunked(inp, 16, gen)


def test_oracle_chunked_seq_idx_no_init():
    gen = torch.Generator().manual_seed(2)
    inp = oracle_inputs(gen, 2, 40, 4, 4, 2, 3, seq_starts=[[1, 8, 9, 24], [20]])
    check_chunked(inp, 8, gen, dt_softplus=True)


def test_oracle_chunked_extreme_decay():
    gen = torch.Generator().manual_seed(3)
    inp = oracle_inputs(gen, 2, 37, 4, 2, 3, 5, D="h", init=True, seq_starts=[[20], [3]])
    with torch.no_grad():  # dt' * A = -1000 at a few tokens
        for t in (0, 7, 16, 33):
            inp["dt"][:, t] = 1000.0 / -inp["A"]
    dA = process_dt(inp["dt"]) * inp["A"]
    assert torch.isclose(dA, torch.tensor(-1000.0, dtype=torch.float64)).sum() == 4 * 2 * 4
    check_chunked(inp, 16, gen)


# ---------------------------------------------------------------- causal conv1d

def test_oracle_conv_matches_torch():
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


def test_oracle_conv_seq_idx():
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

def test_oracle_conv1d_ssd():
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


# ---------------------------------------------------------------------------------------------
# GPU only: bf16 at the record shape, and 2^20 tokens in one call
# ---------------------------------------------------------------------------------------------

RECORD = dict(nheads=64, headdim=64, ngroups=8, dstate=128, chunk=128)
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (these shapes are too large for the interpreter)")


@gpu
@pytest.mark.parametrize("opts", [dict(), OPTIONS["all"]], ids=["plain", "all"])
def test_bf16_record_shape(opts):
    """bf16 kernels against the oracle fed the same bf16-rounded values (chunked float64 form)."""
    inputs = make_inputs(9, batch=2, seqlen=1000, **RECORD, dtype=torch.bfloat16, **opts)
    oracle_inputs = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
                     for k, v in inputs.items()}
    assert_close(run_both(inputs, oracle_inputs, chunked=True), BF16_BOUND)


@gpu
def test_two_to_the_twenty_tokens():
    """x holds 2^32 elements: every offset must be int64. Checked against the same sequence
    run as two halves joined through initial_states. Memory: one set of inputs, shared by both
    runs (the gradients come from torch.autograd.grad, nothing accumulates)."""
    L = 1 << 20
    inputs = make_inputs(10, batch=1, seqlen=L, **RECORD, dtype=torch.bfloat16, D="h", dt_bias=True,
                         dt_softplus=True)
    assert inputs["x"].numel() == 1 << 32
    leaves = {k: v.requires_grad_(True) for k, v in inputs.items() if k in DIFFERENTIABLE}
    g = torch.Generator(device="cuda").manual_seed(11)
    wy = torch.randn(inputs["x"].shape, generator=g, device="cuda", dtype=torch.bfloat16)
    wf = torch.randn(1, 64, 64, 128, generator=g, device="cuda")

    y, f = mamba_cp.mamba_chunk_scan_combined(**inputs, return_final_states=True)
    g_full = torch.autograd.grad((y * wy).float().sum() + (f * wf).sum(), list(leaves.values()))
    y_full, f_full = y.detach(), f.detach()
    del y, f

    h = L // 2
    per_token = ("x", "dt", "B", "C")
    first = {**inputs, **{k: inputs[k][:, :h] for k in per_token}}
    second = {**inputs, **{k: inputs[k][:, h:] for k in per_token}}
    y1, f1 = mamba_cp.mamba_chunk_scan_combined(**first, return_final_states=True)
    y2, f2 = mamba_cp.mamba_chunk_scan_combined(**second, initial_states=f1, return_final_states=True)
    loss = (y1 * wy[:, :h]).float().sum() + (y2 * wy[:, h:]).float().sum() + (f2 * wf).sum()
    g_half = torch.autograd.grad(loss, list(leaves.values()))
    pairs = {"y": (torch.cat([y1.detach(), y2.detach()], 1), y_full), "final_states": (f2.detach(), f_full)}
    pairs.update({"d" + k: (b, a) for k, a, b in zip(leaves, g_full, g_half)})
    for k, (a, b) in pairs.items():
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{k} has NaN or inf"
    print({k: rel_rms(a, b) for k, (a, b) in pairs.items()})
    assert_close(pairs, BF16_BOUND)
