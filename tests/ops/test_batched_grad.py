"""Batched gradients through the TT operators: ``autograd.grad(...,
is_grads_batched=True)``, ``autograd.functional.jacobian(vectorize=True)``
and gradcheck's batched checks (backward and forward mode).

All three run under torch's older vmap (``torch._vmap_internals``), whose
batched tensors dispatch to the ``Batched`` key: the operators' rules for
``torch.vmap`` (comera/ops/func.py ``register_loop_vmap``) never see them,
and its per-entry fallback refuses operators with ``Tensor[]`` arguments.
The wrappers then compute the backward (and forward-mode tangents) in plain
torch ops; these tests check the result against the dense references of
tests/reference.py and tests/reference_embedding.py, on both doors of the
backward (the wrapper's Function and the operator's registered autograd)."""
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.autograd.functional import jacobian
from torch.func import functional_call

import comera
from reference import dense_wt_by_entries
from reference_embedding import dense_ttm_by_entries

F64 = torch.float64


def _linear(path, bias=True):
    torch.manual_seed(0)
    # 10 -> 7 features on modes [2, 5] x [2, 4]: padding on the output side
    return comera.TTLinear(10, 7, bias=bias, rank=[2, 3, 2], in_shape=[2, 5], out_shape=[2, 4],
                           path=path, dtype=F64)


def _dense_linear(m, x):
    wt = dense_wt_by_entries(list(m.cores), list(m.gates), 2, 10, 7)
    y = x @ wt
    return y + m.bias if m.bias is not None else y


@pytest.mark.parametrize("path", ["merge", "sequential"])
@pytest.mark.parametrize("direct", [False, True], ids=["wrapper", "registered"])
def test_is_grads_batched_linear_matches_dense_reference(path, direct):
    m = _linear(path)
    x = torch.randn(2, 3, 10, dtype=F64, requires_grad=True)
    params = [x, *m.cores, *m.gates, m.bias]
    if direct:  # the operator's registered autograd, not TTLinearFunction
        y, _ = torch.ops.comera.tt_linear(x.reshape(6, 10), list(m.cores), list(m.gates), m.bias,
                                          2, 7, comera.ops.linear.PATHS[path])
        y = y.reshape(2, 3, 7)
    else:
        y = m(x)
    ref = _dense_linear(m, x)
    torch.testing.assert_close(y, ref)
    v = torch.randn(5, 2, 3, 7, dtype=F64)
    got = torch.autograd.grad(y, params, v, is_grads_batched=True, retain_graph=True)
    want = torch.autograd.grad(ref, params, v, is_grads_batched=True, retain_graph=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("path", ["merge", "sequential"])
def test_vectorized_jacobian_linear(path):
    m = _linear(path)
    x = torch.randn(3, 10, dtype=F64)
    names = [n for n, _ in m.named_parameters()]
    values = tuple(p.detach() for _, p in m.named_parameters())

    def f(x_, *p):
        return functional_call(m, dict(zip(names, p)), (x_,))

    jac = jacobian(f, (x, *values), vectorize=True)
    loop = jacobian(f, (x, *values), vectorize=False)
    for a, b in zip(jac, loop):
        torch.testing.assert_close(a, b)
    # d y / d x is the dense weight, once per row
    wt = dense_wt_by_entries(list(m.cores), list(m.gates), 2, 10, 7).detach()
    torch.testing.assert_close(jac[0][1, :, 1, :], wt.t())
    assert not jac[0][1, :, 0, :].any()


@pytest.mark.parametrize("path", ["merge", "sequential"])
def test_gradcheck_batched_linear(path):
    m = _linear(path, bias=False)
    names = [n for n, _ in m.named_parameters()]
    x = torch.randn(3, 10, dtype=F64, requires_grad=True)
    inputs = (x, *[p.detach().requires_grad_() for _, p in m.named_parameters()])

    def f(x_, *p):
        return functional_call(m, dict(zip(names, p)), (x_,))

    assert gradcheck(f, inputs, check_batched_grad=True, check_forward_ad=True,
                     check_batched_forward_grad=True)
    assert gradgradcheck(f, inputs, check_batched_grad=True, check_fwd_over_rev=True)


def _embedding(mode=None, reuse="auto", padding_idx=None):
    torch.manual_seed(0)
    return comera.TTEmbedding(20, 6, rank=[3, 2], shape=([3, 2, 4], [2, 1, 3]), mode=mode,
                              reuse=reuse, padding_idx=padding_idx, dtype=F64)


def _dense_table(e):
    t = dense_ttm_by_entries(list(e.cores), list(e.gates), 20, 6)
    if e.padding_idx is not None:
        keep = torch.ones(20, 1, dtype=F64)
        keep[e.padding_idx] = 0
        t = t * keep
    return t


@pytest.mark.parametrize("reuse", ["none", "dedup", "prefix"])
@pytest.mark.parametrize("direct", [False, True], ids=["wrapper", "registered"])
def test_is_grads_batched_embedding_matches_dense_reference(reuse, direct):
    e = _embedding(reuse=reuse, padding_idx=2)
    idx = torch.tensor([[1, 2, 19], [7, 7, 0]])
    params = [*e.cores, *e.gates]
    if direct:
        y = torch.ops.comera.tt_embedding(idx.reshape(-1), None, None, list(e.cores),
                                          list(e.gates), 20, 6, 2, 0,
                                          comera.ops.embedding.REUSE[reuse]).reshape(2, 3, 6)
    else:
        y = e(idx)
    ref = torch.nn.functional.embedding(idx, _dense_table(e))
    torch.testing.assert_close(y, ref)
    v = torch.randn(4, 2, 3, 6, dtype=F64)
    got = torch.autograd.grad(y, params, v, is_grads_batched=True, retain_graph=True)
    want = torch.autograd.grad(ref, params, v, is_grads_batched=True, retain_graph=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_is_grads_batched_bags_with_weights(mode):
    e = _embedding(mode=mode, padding_idx=2 if mode == "mean" else None)
    idx, offsets = torch.tensor([1, 2, 19, 7, 7, 0]), torch.tensor([0, 2, 2, 5])
    psw = torch.rand(6, dtype=F64, requires_grad=True) if mode == "sum" else None
    params = [*e.cores, *e.gates] + ([psw] if psw is not None else [])
    y = e(idx, offsets, per_sample_weights=psw)
    dense = torch.nn.functional.embedding_bag
    ref = dense(idx, _dense_table(e), offsets, mode=mode, per_sample_weights=psw,
                padding_idx=e.padding_idx)
    torch.testing.assert_close(y, ref)
    v = torch.randn(3, *y.shape, dtype=F64)
    got = torch.autograd.grad(y, params, v, is_grads_batched=True, retain_graph=True)
    want = [torch.stack(w) for w in zip(*[torch.autograd.grad(ref, params, v[i], retain_graph=True)
                                          for i in range(3)])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("mode", [None, "sum"])
def test_gradcheck_batched_embedding(mode):
    e = _embedding(mode=mode, reuse="prefix")
    names = [n for n, _ in e.named_parameters()]
    idx = torch.tensor([1, 2, 19, 7, 7, 0])
    args = (idx,) if mode is None else (idx, torch.tensor([0, 2, 2]))
    params = tuple(p.detach().requires_grad_() for _, p in e.named_parameters())
    psw = (torch.rand(6, dtype=F64, requires_grad=True),) if mode == "sum" else ()

    def f(*p):
        kw = {"per_sample_weights": p[-1]} if psw else {}
        return functional_call(e, dict(zip(names, p[:len(names)])), args, kw)

    assert gradcheck(f, params + psw, check_batched_grad=True, check_forward_ad=True,
                     check_batched_forward_grad=True)
    assert gradgradcheck(f, params + psw, check_batched_grad=True)
