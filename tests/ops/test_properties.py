"""Property-based tests (hypothesis) of every comera operator against dense
references written here with plain torch (no comera helpers):

  comera::tt_linear (+ backward)      vs x @ W^T + b, W rebuilt by einsum
  comera::tt_embedding (+ backward)   vs F.embedding / F.embedding_bag on the rebuilt table
  comera::gate_prox_                  vs the C kernel's rule (csrc/gate_prox/cpu_impl.h) as a loop

over random mode sizes, ranks (including ranks above the TT bound), padded
feature counts, dtypes (float32, float64), batch sizes (0 and 1 included),
index sets (repeats, padding rows, empty bags) and evaluation paths.  Each
property runs 200 derandomized examples, so CI sees the same cases every run.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comera
from comera.ops import gate_prox_, tt_embedding, tt_linear

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = st.sampled_from([torch.float32, torch.float64])
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _rand(shape, dtype, scale=1.0):
    return (torch.rand(shape, dtype=torch.float64) * 2 - 1).mul_(scale).to(dtype)


def _close(got, want, dtype, what):
    tol = TOL[dtype]
    # scale the absolute tolerance with the size of the reference
    atol = tol["atol"] * (1.0 + (float(want.abs().max()) if want.numel() else 0.0))
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- references
def dense_linear_wt(cores, gates, num_in, in_features, out_features):
    """W^T (in x out) from docs/design.md section 2: contract the cores left to
    right with the gates on the bonds, row-major over (i_1..i_p, j_1..j_q)."""
    m = cores[0]                                           # (1, n_1, r_1)
    for k in range(1, len(cores)):
        m = torch.einsum("air,r,rjs->aijs", m, gates[k - 1], cores[k])
        m = m.reshape(1, -1, cores[k].shape[-1])
    in_pad = math.prod(c.shape[1] for c in cores[:num_in])
    return m.reshape(in_pad, -1)[:in_features, :out_features]


def dense_table(cores, gates, num_embeddings, embedding_dim):
    """E (num x dim) from docs/design.md section 3: cores (r, v, e, r'), row t over
    (i_1..i_d) row-major, entries over (j_1..j_d) row-major."""
    m = cores[0]                                           # (1, v1, e1, r1)
    for k in range(1, len(cores)):
        m = torch.einsum("aver,r,rwfs->avwefs", m, gates[k - 1], cores[k])
        a, v, w, e, f, s = m.shape
        m = m.reshape(a, v * w, e * f, s)
    return m.reshape(m.shape[1], m.shape[2])[:num_embeddings, :embedding_dim]


# ------------------------------------------------------------------ tt_linear
@st.composite
def linear_cases(draw):
    p = draw(st.integers(1, 3))
    q = draw(st.integers(1, 3 if p < 3 else 2))
    modes = draw(st.lists(st.integers(1, 4), min_size=p + q, max_size=p + q))
    ranks = draw(st.lists(st.integers(1, 5), min_size=p + q - 1, max_size=p + q - 1))
    in_pad, out_pad = math.prod(modes[:p]), math.prod(modes[p:])
    in_f = draw(st.integers(max(1, in_pad - 2), in_pad))
    out_f = draw(st.integers(max(1, out_pad - 2), out_pad))
    lead = draw(st.sampled_from([(0,), (1,), (2,), (5,), (2, 3), (3, 0)]))
    return dict(p=p, modes=modes, ranks=ranks, in_f=in_f, out_f=out_f, lead=lead,
                dtype=draw(DTYPES), bias=draw(st.booleans()),
                path=draw(st.sampled_from(["auto", "merge", "sequential"])),
                seed=draw(st.integers(0, 2**31 - 1)))


@SETTINGS
@given(linear_cases())
def test_tt_linear_matches_dense(c):
    """Forward and every gradient of comera::tt_linear equal those of the
    dense layer x @ W^T + b with W rebuilt from the cores."""
    torch.manual_seed(c["seed"])
    dtype, p = c["dtype"], c["p"]
    full = [1] + c["ranks"] + [1]
    cores = [_rand((full[k], n, full[k + 1]), dtype).requires_grad_()
             for k, n in enumerate(c["modes"])]
    gates = [_rand((r,), dtype).requires_grad_() for r in c["ranks"]]
    bias = _rand((c["out_f"],), dtype).requires_grad_() if c["bias"] else None
    x = _rand((*c["lead"], c["in_f"]), dtype).requires_grad_()
    y = tt_linear(x, cores, gates, bias, p, c["out_f"], path=c["path"])
    assert y.shape == (*c["lead"], c["out_f"]) and y.dtype == dtype

    # reference in float64 from the same values
    c64 = [t.detach().double().requires_grad_() for t in cores]
    g64 = [t.detach().double().requires_grad_() for t in gates]
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    x64 = x.detach().double().requires_grad_()
    want = x64 @ dense_linear_wt(c64, g64, p, c["in_f"], c["out_f"])
    if b64 is not None:
        want = want + b64
    _close(y.double(), want.detach(), dtype, "y")

    gy = _rand(y.shape, dtype)
    got = torch.autograd.grad(y, [x, *cores, *gates] + ([bias] if bias is not None else []), gy)
    ref = torch.autograd.grad(want, [x64, *c64, *g64] + ([b64] if b64 is not None else []),
                              gy.double())
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and a.dtype == dtype
        _close(a.double(), b, dtype, f"gradient {i}")


# --------------------------------------------------------------- tt_embedding
@st.composite
def embedding_cases(draw):
    d = draw(st.integers(2, 3))
    rows = draw(st.lists(st.integers(1, 4), min_size=d, max_size=d))
    dims = draw(st.lists(st.integers(1, 3), min_size=d, max_size=d))
    ranks = draw(st.lists(st.integers(1, 4), min_size=d - 1, max_size=d - 1))
    num_pad, dim_pad = math.prod(rows), math.prod(dims)
    num = draw(st.integers(max(1, num_pad - 3), num_pad))
    dim = draw(st.integers(max(1, dim_pad - 2), dim_pad))
    mode = draw(st.sampled_from([None, "sum", "mean"]))
    n = draw(st.sampled_from([0, 1, 2, 3, 7, 12]))
    # few distinct values, so repeats are common
    idx = draw(st.lists(st.integers(0, num - 1), min_size=n, max_size=n))
    pad = draw(st.one_of(st.none(), st.integers(0, num - 1)))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    return dict(rows=rows, dims=dims, ranks=ranks, num=num, dim=dim, mode=mode, idx=idx,
                pad=pad, offsets=[0] + cuts, dtype=draw(DTYPES),
                psw=mode == "sum" and draw(st.booleans()),
                reuse=draw(st.sampled_from(["auto", "none", "dedup", "prefix"])),
                seed=draw(st.integers(0, 2**31 - 1)))


@SETTINGS
@given(embedding_cases())
def test_tt_embedding_matches_dense(c):
    """Lookups (plain and bags, padding rows, repeated indices, empty bags,
    per-sample weights) and core/gate/weight gradients equal F.embedding /
    F.embedding_bag on the rebuilt table, for every reuse strategy."""
    torch.manual_seed(c["seed"])
    dtype = c["dtype"]
    full = [1] + c["ranks"] + [1]
    cores = [_rand((full[k], v, e, full[k + 1]), dtype).requires_grad_()
             for k, (v, e) in enumerate(zip(c["rows"], c["dims"]))]
    gates = [_rand((r,), dtype).requires_grad_() for r in c["ranks"]]
    idx = torch.tensor(c["idx"], dtype=torch.int64)
    offsets = torch.tensor(c["offsets"], dtype=torch.int64)
    psw = _rand((len(c["idx"]),), dtype).requires_grad_() if c["psw"] else None
    kw = dict(padding_idx=c["pad"], mode=c["mode"], reuse=c["reuse"])
    if c["mode"] is not None:
        kw.update(offsets=offsets, per_sample_weights=psw)
    out = tt_embedding(idx, cores, gates, c["num"], c["dim"], **kw)

    c64 = [t.detach().double().requires_grad_() for t in cores]
    g64 = [t.detach().double().requires_grad_() for t in gates]
    w64 = psw.detach().double().requires_grad_() if psw is not None else None
    table = dense_table(c64, g64, c["num"], c["dim"])
    if c["pad"] is not None:  # the padding row reads as zero (nn.Embedding initialises it so)
        keep = torch.ones(c["num"], 1, dtype=torch.float64)
        keep[c["pad"]] = 0
        table = table * keep
    if c["mode"] is None:
        want = F.embedding(idx, table, padding_idx=c["pad"])
    else:
        want = F.embedding_bag(idx, table, offsets, mode=c["mode"], per_sample_weights=w64,
                               padding_idx=c["pad"])
    assert out.shape == want.shape and out.dtype == dtype
    _close(out.double(), want.detach(), dtype, "output")

    go = _rand(out.shape, dtype)
    params = [*cores, *gates] + ([psw] if psw is not None else [])
    params64 = [*c64, *g64] + ([w64] if w64 is not None else [])
    got = torch.autograd.grad(out, params, go, allow_unused=True)
    ref = torch.autograd.grad(want, params64, go.double(), allow_unused=True)
    for i, (a, b) in enumerate(zip(got, ref)):
        b = torch.zeros_like(params64[i]) if b is None else b
        a = torch.zeros_like(params[i]) if a is None else a
        _close(a.double(), b, dtype, f"gradient {i}")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(num=st.integers(1, 30), bad=st.one_of(st.integers(-2**62, -1), st.integers(0, 2**62)),
       mode=st.sampled_from([None, "sum", "mean"]), pos=st.integers(0, 4))
def test_tt_embedding_out_of_range_raises(num, bad, mode, pos):
    """An index outside [0, num_embeddings) raises IndexError naming the
    index, its position and num_embeddings, wherever it sits in the batch."""
    if 0 <= bad < num:
        bad = num + bad
    emb = comera.TTEmbedding(num, 4, rank=2, shape=([num, 1], [2, 2]), mode=mode)
    idx = torch.zeros(5, dtype=torch.int64)
    idx[pos] = bad
    args = (idx, torch.tensor([0, 2])) if mode else (idx,)
    with pytest.raises(IndexError, match=rf"index {bad} at position {pos} is out of range for "
                                         rf"num_embeddings={num}"):
        emb(*args)


# ------------------------------------------------------------------ gate_prox_
def naive_prox(gates, signs, threshold, min_live, kill):
    """The rule of the C kernel (csrc/gate_prox/cpu_impl.h), entry by entry."""
    if any(math.isnan(v) for g in gates for v in g):
        return [-1 if any(math.isnan(v) for v in g) else 0 for g in gates], gates, signs
    live_counts, out_g, out_s = [], [], []
    for g, s in zip(gates, signs):
        g, s = list(g), list(s)
        doomed = []
        live = 0
        for i, v in enumerate(g):
            now = (v > 0) - (v < 0)
            if s[i] == 0:
                g[i] = 0.0
            elif not kill:
                s[i] = now if now else s[i]
                live += 1
            elif abs(v) <= threshold or now != s[i]:
                doomed.append(i)
            else:
                s[i] = now
                live += 1
        # rescue the largest non-zero doomed entries (first one on ties)
        order = sorted((i for i in doomed if g[i] != 0), key=lambda i: (-abs(g[i]), i))
        rescued = set(order[: max(0, min_live - live)])
        for i in doomed:
            if i in rescued:
                s[i] = (g[i] > 0) - (g[i] < 0)
                live += 1
            else:
                g[i], s[i] = 0.0, 0
        live_counts.append(live)
        out_g.append(g)
        out_s.append(s)
    return live_counts, out_g, out_s


@st.composite
def prox_cases(draw):
    k = draw(st.integers(1, 4))
    values = st.one_of(st.sampled_from([0.0, 1e-4, -1e-4, 0.5, -0.5]),
                       st.floats(-2, 2, allow_nan=False, width=32))
    gates = [draw(st.lists(values, min_size=0, max_size=8)) for _ in range(k)]
    signs = [[draw(st.sampled_from([-1, 0, 1])) for _ in g] for g in gates]
    if draw(st.integers(0, 9)) == 0 and any(gates):  # a NaN somewhere, now and then
        j = next(i for i, g in enumerate(gates) if g)
        gates[j][draw(st.integers(0, len(gates[j]) - 1))] = math.nan
    return dict(gates=gates, signs=signs, dtype=draw(DTYPES),
                threshold=draw(st.sampled_from([0.0, 1e-3, 0.1, 0.6, -1.0])),
                min_live=draw(st.integers(0, 3)), kill=draw(st.booleans()))


@SETTINGS
@given(prox_cases())
def test_gate_prox_matches_rule(c):
    """comera::gate_prox_ gives the live counts, gates and signs of the rule
    of the C kernel written as a loop; a NaN anywhere changes nothing and marks
    its gate -1."""
    dtype = c["dtype"]
    gates = [torch.tensor(g, dtype=dtype) for g in c["gates"]]
    signs = [torch.tensor(s, dtype=torch.int8) for s in c["signs"]]
    # the reference sees the values as stored in dtype
    g_in = [[float(v) for v in g] for g in gates]
    want_live, want_g, want_s = naive_prox(g_in, c["signs"], c["threshold"], c["min_live"],
                                           c["kill"])
    live = gate_prox_(gates, signs, c["threshold"], c["min_live"], c["kill"])
    assert live.tolist() == want_live
    for g, s, wg, ws in zip(gates, signs, want_g, want_s):
        assert s.tolist() == ws
        torch.testing.assert_close(g, torch.tensor(wg, dtype=dtype), equal_nan=True,
                                   rtol=0, atol=0)
