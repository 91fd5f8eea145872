"""torch.func and higher-order autograd through the TT layers: vmap, grad,
jacrev, jacfwd, jvp, hessian, per-sample gradients (vmap(grad)), model
ensembles (vmap over parameters), forward-mode AD and double backward, each
checked against a loop over samples or the dense equivalent.  Also
meta-device construction, reset_parameters and conversion of meta models."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap

import comera


def _linear():
    return comera.TTLinear(12, 6, rank=3, dtype=torch.float64)


def _params(m):
    return {k: v.detach() for k, v in m.named_parameters()}


def test_vmap_forward_linear_and_embedding():
    m = _linear()
    x = torch.randn(4, 3, 12, dtype=torch.float64)
    torch.testing.assert_close(vmap(m)(x), m(x))
    torch.testing.assert_close(vmap(m, in_dims=1, out_dims=1)(x), m(x))
    e = comera.TTEmbedding(50, 6, rank=3, padding_idx=0, dtype=torch.float64)
    idx = torch.randint(0, 50, (4, 5))
    torch.testing.assert_close(vmap(e)(idx), e(idx))


def test_grad_matches_autograd():
    m = _linear()
    x = torch.randn(4, 12, dtype=torch.float64)
    p = _params(m)
    g = grad(lambda p: functional_call(m, p, (x,)).pow(2).sum())(p)
    m(x).pow(2).sum().backward()
    for k, q in m.named_parameters():
        torch.testing.assert_close(g[k], q.grad)


@pytest.mark.parametrize("kind", ["linear", "embedding", "bag"])
def test_per_sample_gradients_match_a_loop(kind):
    if kind == "linear":
        m = _linear()
        data = torch.randn(5, 12, dtype=torch.float64)
        call = lambda p, xi: functional_call(m, p, (xi.unsqueeze(0),))  # noqa: E731
    else:
        mode = None if kind == "embedding" else "sum"
        m = comera.TTEmbedding(50, 6, rank=3, padding_idx=0, mode=mode, dtype=torch.float64)
        data = torch.randint(0, 50, (5, 4))
        call = lambda p, xi: functional_call(m, p, (xi.unsqueeze(0),))  # noqa: E731
    p = _params(m)

    def loss(p, xi):
        return call(p, xi).pow(2).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(p, data)
    for b in range(data.shape[0]):
        one = grad(loss)(p, data[b])
        for k in p:
            torch.testing.assert_close(per_sample[k][b], one[k])


def test_jacrev_jacfwd_hessian_match_dense():
    m = _linear()
    W, b = m.weight.detach(), m.bias.detach()
    x = torch.randn(12, dtype=torch.float64)
    torch.testing.assert_close(jacrev(m)(x), W)
    torch.testing.assert_close(jacfwd(m)(x), W)
    f = lambda x: m(x).pow(2).sum()  # noqa: E731
    torch.testing.assert_close(hessian(f)(x), 2 * W.t() @ W)
    torch.testing.assert_close(jacrev(jacrev(f))(x), 2 * W.t() @ W)


def test_jvp_in_inputs_and_parameters():
    m = _linear()
    x = torch.randn(3, 12, dtype=torch.float64)
    t = torch.randn_like(x)
    _, dy = jvp(m, (x,), (t,))
    torch.testing.assert_close(dy, t @ m.weight.detach().t())
    p = _params(m)
    tp = {k: torch.randn_like(v) for k, v in p.items()}
    f = lambda p: functional_call(m, p, (x,))  # noqa: E731
    _, dy = jvp(f, (p,), (tp,))
    # against the jvp of the dense form (plain torch ops)
    _, want = jvp(lambda p: F.linear(x, _dense_weight(m, p), p["bias"]), (p,), (tp,))
    torch.testing.assert_close(dy, want)


def _dense_weight(m, p):
    cores = [p[f"cores.{k}"] for k in range(len(m.cores))]
    gates = [p[f"gates.{k}"] for k in range(len(m.gates))]
    return comera.ops.dense.dense_wt(cores, gates, m.num_in_cores, m.in_features,
                                      m.out_features).t()


def test_embedding_jvp_and_psw_grad():
    bag = comera.TTEmbedding(50, 6, rank=3, mode="sum", dtype=torch.float64)
    idx = torch.randint(0, 50, (3, 4))
    w = torch.randn(3, 4, dtype=torch.float64)
    g = grad(lambda w: bag(idx, per_sample_weights=w).pow(2).sum())(w)
    w2 = w.clone().requires_grad_()
    bag(idx, per_sample_weights=w2).pow(2).sum().backward()
    torch.testing.assert_close(g, w2.grad)
    tw = torch.randn_like(w)
    _, dy = jvp(lambda w: bag(idx, per_sample_weights=w), (w,), (tw,))
    torch.testing.assert_close(dy, bag(idx, per_sample_weights=tw))


def test_forward_mode_ad():
    m = _linear()
    x, t = torch.randn(3, 12, dtype=torch.float64), torch.randn(3, 12, dtype=torch.float64)
    with fwAD.dual_level():
        y = m(fwAD.make_dual(x, t))
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, t @ m.weight.detach().t())


def test_ensemble_vmap_over_parameters():
    m = _linear()
    x = torch.randn(3, 12, dtype=torch.float64)
    p = _params(m)
    stacked = {k: torch.stack([v, 2 * v]) for k, v in p.items()}
    out = vmap(lambda q: functional_call(m, q, (x,)))(stacked)
    torch.testing.assert_close(out[1], functional_call(m, {k: 2 * v for k, v in p.items()}, (x,)))


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
def test_double_backward_matches_dense(mode):
    if mode is None:
        m = _linear()
        x = torch.randn(4, 12, dtype=torch.float64)
        dense = lambda x: F.linear(x, m.weight, m.bias)  # noqa: E731
    else:
        m = comera.TTEmbedding(40, 6, rank=3, padding_idx=2, mode=mode, dtype=torch.float64)
        x = torch.tensor([[2, 5, 7], [2, 2, 9]])
        def dense(x):  # F.embedding_bag has no double backward: bags by hand
            rows = F.embedding(x, m.weight).sum(1)
            return rows if mode == "sum" else rows / (x != 2).sum(1, keepdim=True).clamp(min=1)
    params = list(m.parameters())

    def penalty(fn):
        g = torch.autograd.grad(fn(x).pow(2).sum(), params, create_graph=True, allow_unused=True)
        gp = sum(q.pow(2).sum() for q in g if q is not None)
        return torch.autograd.grad(gp, params, allow_unused=True)

    for a, b in zip(penalty(m), penalty(dense)):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------ meta device
def test_construction_on_meta_device():
    with torch.device("meta"):
        emb = comera.TTEmbedding(30522, 768, rank=8)
        lin = comera.TTLinear(768, 3072, rank=8)
    assert all(p.is_meta for p in list(emb.parameters()) + list(lin.parameters()))
    assert lin(torch.empty(2, 768, device="meta")).shape == (2, 3072)
    assert emb(torch.zeros(2, 3, dtype=torch.long, device="meta")).shape == (2, 3, 768)
    lin2 = comera.TTLinear(64, 32, rank=4, device="meta")
    assert lin2.cores[0].is_meta


@pytest.mark.parametrize("make", [lambda: comera.TTLinear(64, 32, rank=4),
                                  lambda: comera.TTEmbedding(100, 16, rank=4, padding_idx=3)])
def test_reset_parameters_is_the_construction_init(make):
    torch.manual_seed(7)
    a = make()
    torch.manual_seed(7)
    with torch.device("meta"):
        b = make()
    b = b.to_empty(device="cpu")
    b.reset_parameters()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    if isinstance(a, comera.TTEmbedding):
        assert b(torch.tensor([3])).abs().sum() == 0  # the padding row reads as zero


def test_convert_a_meta_model_then_materialise():
    def build():
        return torch.nn.Sequential(torch.nn.Embedding(100, 16, padding_idx=0),
                                   torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    with torch.device("meta"):
        net = build()
    net = comera.convert(net, rank=4, min_compression=0.1)
    assert isinstance(net[1], comera.TTLinear) and net[1].cores[0].is_meta
    with pytest.raises(ValueError, match="meta"):
        with torch.device("meta"):
            comera.convert(build(), rank=4, min_compression=0.1, init="svd")
    # load a checkpoint of a real converted model into the materialised one
    torch.manual_seed(0)
    real = comera.convert(build(), rank=4, min_compression=0.1)
    net = net.to_empty(device="cpu")
    net.load_state_dict(real.state_dict())
    idx = torch.randint(0, 100, (2, 5))
    torch.testing.assert_close(net(idx), real(idx), rtol=0, atol=0)
    # or initialise it afresh
    for mod in net.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    assert torch.isfinite(net(idx)).all()


def test_convert_keeps_half_dtypes():
    net = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 32)).bfloat16()
    comera.convert(net, rank=4, min_compression=0.1)
    assert isinstance(net[0], comera.TTEmbedding) and isinstance(net[1], comera.TTLinear)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    out = net(torch.randint(0, 100, (2, 3)))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in net.parameters())


def test_half_gates_in_gate_prox():
    g = torch.tensor([0.5, 1e-4, -0.2, 0.3], dtype=torch.bfloat16)
    s = torch.tensor([1, 1, 1, 0], dtype=torch.int8)
    assert comera.ops.gate_prox_([g], [s], threshold=1e-3).tolist() == [1]
    assert g.tolist() == [0.5, 0.0, 0.0, 0.0] and s.tolist() == [1, 0, 0, 0]
