import math

import pytest
import torch
from torch import nn

import comera
from comera.layers import tt
from reference import dense_wt_by_entries

SHAPES = [
    # in, out, in_shape, out_shape, rank
    (6, 4, [2, 3], [4], 2),
    (12, 20, [3, 4], [4, 5], 3),
    (8, 27, [2, 2, 2], [3, 3, 3], 4),
    (16, 6, [2, 2, 2, 2], [2, 3], 3),
    (30, 16, [2, 3, 5], [2, 2, 2, 2], 5),
    (7, 11, [2, 4], [3, 4], 3),            # prime sizes, padded
    (5, 9, [5], [3, 3], 1),                 # rank 1, p = 1
    (24, 24, [2, 3, 4], [4, 3, 2], 100),    # rank at the TT bound
    (16, 16, [2, 2, 2, 2], [2, 2, 2, 2], [2, 4, 8, 16, 8, 4, 2]),
]


def _make(in_f, out_f, in_shape, out_shape, rank, dtype, path="auto", bias=True):
    layer = comera.TTLinear(in_f, out_f, bias=bias, rank=rank, in_shape=in_shape,
                            out_shape=out_shape, dtype=dtype, path=path)
    with torch.no_grad():  # gates away from 1 so gate gradients matter
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    return layer


def _dense_reference(layer, x):
    cores = [c.detach().clone().requires_grad_() for c in layer.cores]
    gates = [g.detach().clone().requires_grad_() for g in layer.gates]
    wt = dense_wt_by_entries(cores, gates, layer.num_in_cores, layer.in_features, layer.out_features)
    xr = x.detach().clone().requires_grad_()
    y = xr @ wt
    b = None
    if layer.bias is not None:
        b = layer.bias.detach().clone().requires_grad_()
        y = y + b
    return y, xr, cores, gates, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["merge", "sequential", "auto"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("batch", [0, 1, 37, 513])
def test_matches_dense_reference(shape, path, dtype, batch):
    in_f, out_f, in_shape, out_shape, rank = shape
    layer = _make(in_f, out_f, in_shape, out_shape, rank, dtype, path)
    x = torch.randn(batch, in_f, dtype=dtype, requires_grad=True)
    y = layer(x)
    yr, xr, cores, gates, b = _dense_reference(layer, x)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(y, yr, **tol)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    for c, cr in zip(layer.cores, cores):
        torch.testing.assert_close(c.grad, cr.grad, **tol)
    for gt, gr in zip(layer.gates, gates):
        torch.testing.assert_close(gt.grad, gr.grad, **tol)
    torch.testing.assert_close(layer.bias.grad, b.grad, **tol)


@pytest.mark.parametrize("path", ["merge", "sequential"])
def test_three_d_and_non_contiguous_input(path):
    layer = _make(12, 20, [3, 4], [4, 5], 3, torch.float64, path)
    base = torch.randn(20, 4, 12, dtype=torch.float64)
    x = base.transpose(0, 1)  # (4, 20, 12), not contiguous
    assert not x.is_contiguous()
    y = layer(x)
    assert y.shape == (4, 20, 20)
    torch.testing.assert_close(y, x @ layer.weight.t() + layer.bias)


def test_no_bias_and_input_without_grad():
    layer = _make(12, 20, [3, 4], [4, 5], 3, torch.float64, bias=False)
    x = torch.randn(9, 12, dtype=torch.float64)
    layer(x).sum().backward()
    assert all(c.grad is not None for c in layer.cores)
    torch.testing.assert_close(layer(x), x @ layer.weight.t())


@pytest.mark.parametrize("path", ["merge", "sequential"])
def test_gradcheck_float64(path):
    layer = _make(6, 8, [2, 3], [2, 4], 3, torch.float64, path)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    params = list(layer.cores) + list(layer.gates) + [layer.bias]

    def f(x, *ps):
        cores, gates, bias = ps[:4], ps[4:7], ps[7]
        return comera.ops.tt_linear(x, cores, gates, bias, 2, 8, path)

    assert torch.autograd.gradcheck(f, (x, *params))


def test_opcheck():
    layer = _make(12, 20, [3, 4], [4, 5], 3, torch.float32)
    x = torch.randn(7, 12, requires_grad=True)
    args = (x, list(layer.cores), list(layer.gates), layer.bias, 2, 20, 0)
    torch.library.opcheck(torch.ops.comera.tt_linear.default, args)
    y, t = torch.ops.comera.tt_linear(*args)
    bargs = (torch.randn_like(y), x.detach(), t, [c.detach() for c in layer.cores],
             [g.detach() for g in layer.gates], True, True, 2, 20, 0)
    torch.library.opcheck(torch.ops.comera.tt_linear_backward.default, bargs)


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model = nn.Sequential(comera.TTLinear(24, 32, rank=4), nn.GELU(), comera.TTLinear(32, 8, rank=4))
    x = torch.randn(6, 24)
    compiled = torch.compile(model, fullgraph=True)
    y_c = compiled(x)
    y_c.sum().backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_e = model(x)
    y_e.sum().backward()
    torch.testing.assert_close(y_c, y_e, atol=1e-6, rtol=1e-5)
    for gc, ge in zip(grads_c, (p.grad for p in model.parameters())):
        torch.testing.assert_close(gc, ge, atol=1e-6, rtol=1e-5)


def test_bfloat16_input():
    layer = comera.TTLinear(24, 32, rank=4)
    x = torch.randn(5, 24).to(torch.bfloat16).requires_grad_()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), layer(x.float()), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_default_shapes_and_init_variance():
    layer = comera.TTLinear(768, 3072, rank=16)
    assert layer.in_shape == [8, 8, 12] and layer.out_shape == [12, 16, 16]
    w = layer.weight.detach()
    target = 1.0 / (3 * 768)
    assert 0.7 * target < w.var().item() < 1.3 * target
    assert abs(layer.bias.detach().max().item()) <= 1 / math.sqrt(768)


def test_padding_prime_sizes():
    layer = comera.TTLinear(769, 13, rank=4)
    assert math.prod(layer.in_shape) >= 769 and math.prod(layer.out_shape) >= 13
    x = torch.randn(3, 769, dtype=torch.float32)
    assert layer.weight.shape == (13, 769)
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias, atol=1e-5, rtol=1e-4)


def test_to_dense_and_from_dense_round_trip():
    lin = nn.Linear(24, 36)
    full = comera.TTLinear.from_dense(lin, rank=1000)
    torch.testing.assert_close(full.weight, lin.weight, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(full.to_dense().weight, lin.weight, atol=1e-5, rtol=1e-4)
    small = comera.TTLinear.from_dense(lin.weight, rank=2)
    assert max(small.ranks) <= 2 and small.bias is None
    # TT-SVD truncation of a TT-rank-2 weight is exact
    teacher = comera.TTLinear(24, 36, rank=2, dtype=torch.float64)
    again = comera.TTLinear.from_dense(teacher.weight.detach(), rank=2)
    torch.testing.assert_close(again.weight.double(), teacher.weight.detach(), atol=1e-5, rtol=1e-4)


def test_plan_and_repr():
    layer = comera.TTLinear(768, 3072, rank=30)
    plan = layer.plan(4096)
    assert plan["path"] == "merge"
    assert plan["merge"]["flops"] >= 6 * 4096 * 30 * (768 + 3072)
    assert plan["sequential"]["flops"] > 0
    r = repr(layer)
    assert "ranks=" in r and "compression=" in r and "in_shape=[8, 8, 12]" in r


@pytest.mark.parametrize("batch, exc", [
    (torch.randn(4, 768), TypeError), (4.0, TypeError), (True, TypeError), (-1, ValueError),
])
def test_plan_bad_batch(batch, exc):
    with pytest.raises(exc, match="batch"):
        comera.TTLinear(768, 3072, rank=30).plan(batch)


def test_plan_takes_int_like_batch():
    layer = comera.TTLinear(768, 3072, rank=30)
    assert layer.plan(torch.tensor(4096))["batch"] == layer.plan(4096)["batch"] == 4096


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(in_features=12, out_features=8, rank=0), ValueError, "rank"),
    (dict(in_features=12, out_features=8, rank=[2, 2]), ValueError, "rank"),
    (dict(in_features=12, out_features=8, rank=2, in_shape=[3, 5]), ValueError, "in_shape"),
    (dict(in_features=12, out_features=8, rank=2, out_shape=[3, 2]), ValueError, "out_shape"),
    (dict(in_features=0, out_features=8, rank=2), ValueError, "in_features"),
    (dict(in_features=12, out_features=8, rank=2.5), TypeError, "rank"),
    (dict(in_features=12, out_features=8, rank=2, path="fast"), ValueError, "path"),
    (dict(in_features=12, out_features=8, rank=2, dtype=torch.int32), TypeError, "dtype"),
])
def test_bad_constructor_arguments(kwargs, exc, words):
    in_f, out_f = kwargs.pop("in_features"), kwargs.pop("out_features")
    with pytest.raises(exc, match=words):
        comera.TTLinear(in_f, out_f, **kwargs)


def test_bad_forward_inputs():
    layer = comera.TTLinear(12, 8, rank=2)
    with pytest.raises(ValueError, match="in_features=12"):
        layer(torch.randn(3, 11))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(3, 12, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="meta"):
        layer(torch.randn(3, 12, device="meta"))
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.tensor(1.0))


def test_op_level_bad_arguments_raise_not_crash():
    layer = comera.TTLinear(12, 8, rank=2)
    cores, gates = list(layer.cores), list(layer.gates)
    x = torch.randn(3, 12)
    with pytest.raises(RuntimeError):
        torch.ops.comera.tt_linear(x, cores, gates[:1], None, 2, 8, 0)
    with pytest.raises(RuntimeError):
        torch.ops.comera.tt_linear(x, cores, gates, None, 2, 100, 0)
    with pytest.raises(RuntimeError):
        torch.ops.comera.tt_linear(x, cores, gates, None, 5, 8, 0)
    with pytest.raises(RuntimeError):
        torch.ops.comera.tt_linear(x, cores, gates, None, 2, 8, 7)
    with pytest.raises(RuntimeError):
        torch.ops.comera.tt_linear(torch.randn(3, 13), cores, gates, None, 2, 8, 0)
    with pytest.raises(ValueError, match="overflow"):  # TORCH_CHECK_VALUE in the planner
        torch.ops.comera.tt_linear_plan([1 << 40, 1 << 40], [2], [1, 1, 1, 1], 4, 2, 1)


def test_optimizer_trains_layer():
    torch.manual_seed(1)
    teacher = nn.Linear(16, 8)
    layer = comera.TTLinear(16, 8, rank=8)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(256, 16)
    y = teacher(x).detach()
    first = None
    for _ in range(300):
        loss = nn.functional.mse_loss(layer(x), y)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 * first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_eager_path_equals_the_registered_autograd(dtype, bias):
    """Eager training goes through ops.linear.TTLinearFunction (no pytree walk per
    call); its values and gradients are the registered autograd's, bit for bit."""
    from comera.ops import linear as L
    layer = comera.TTLinear(24, 20, rank=3, bias=bias).to(dtype)
    x = torch.randn(7, 24, dtype=dtype, requires_grad=True)
    gy = torch.randn(7, 20, dtype=dtype)
    y = layer(x)
    # a 2-D input: the output is the Function's own (no view of it, which FSDP2 warns about)
    assert type(y.grad_fn).__name__ == "TTLinearFunctionBackward" and not y._is_view()
    grads = torch.autograd.grad(y, [x, *layer.parameters()], gy)
    y_reg, _ = torch.ops.comera.tt_linear(x, list(layer.cores), list(layer.gates), layer.bias,
                                          layer.num_in_cores, 20, L.PATHS["auto"])
    assert "TTLinearFunction" not in type(y_reg.grad_fn).__name__  # the registered autograd
    grads_reg = torch.autograd.grad(y_reg, [x, *layer.parameters()], gy)
    assert torch.equal(y, y_reg)
    for g, r in zip(grads, grads_reg):
        assert torch.equal(g, r)
    with torch.no_grad():  # a small call without gradients: the layer's merged V and U
        y_merged = layer(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(y_merged, y.detach(), rtol=tol, atol=tol)


@pytest.mark.parametrize("in_f, out_f", [(16, 1024), (1024, 16)])
def test_outputs_of_8mb_or_more_match_dense(in_f, out_f):
    # 2048 rows make y (16 -> 1024) or dx (1024 -> 16) 8 MB: the size from which
    # the C kernels write them with streaming stores (common/gemm.h)
    layer = _make(in_f, out_f, None, None, 4, torch.float32, "merge")
    x = torch.randn(2048, in_f, requires_grad=True)
    y = layer(x)
    yr, xr, cores, gates, b = _dense_reference(layer, x)
    torch.testing.assert_close(y, yr, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    for c, cr in zip(layer.cores, cores):
        torch.testing.assert_close(c.grad, cr.grad, atol=1e-3, rtol=1e-4)
