"""A TTLinear keeps its merged V and U per parameter version
(comera.ops.linear.Prepared): small calls without gradients reuse them, and
every way a parameter can change makes the next call merge again, so no call
ever sees stale weights."""
import copy
import io
import pickle

import pytest
import torch

import comera
from comera.ops import linear as linear_op


def _reference(layer, x):
    w = layer.weight.detach().double()
    y = x.detach().double() @ w.t()
    return y if layer.bias is None else y + layer.bias.detach().double()


def _check(layer, x, tol=1e-5):
    with torch.no_grad():
        y = layer(x)
    torch.testing.assert_close(y.double(), _reference(layer, x), rtol=tol, atol=tol)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 4)])
def test_small_calls_use_the_merged_pair(dtype, bias, lead):
    layer = comera.TTLinear(48, 40, rank=5, bias=bias, dtype=dtype)
    x = torch.randn(*lead, 48, dtype=dtype)
    y = _check(layer, x)
    assert y.shape == (*lead, 40) and y.dtype == dtype and not y._is_view()
    v = layer._prepared.v
    assert v is not None and v.shape == (48, layer.ranks[1])
    _check(layer, x)
    assert layer._prepared.v is v  # nothing changed: no merge


def test_large_and_training_calls_run_the_operator():
    layer = comera.TTLinear(48, 40, rank=5)
    rows = linear_op.CACHED_MACS // (5 * 88) + 1
    with torch.no_grad():
        layer(torch.randn(rows, 48))
    assert layer._prepared.v is None
    with torch.no_grad():
        layer(torch.randn(2, 48))
    assert layer._prepared.v is not None
    y = layer(torch.randn(2, 48))  # gradients wanted: the pair is dropped
    assert y.grad_fn is not None and layer._prepared.key is None


def _changes():
    def optimizer_step(layer):
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        layer(torch.randn(3, 48)).pow(2).sum().backward()
        opt.step()

    def in_place(layer):
        with torch.no_grad():
            layer.cores[1].mul_(1.5)

    def gate_in_place(layer):
        with torch.no_grad():
            layer.gates[0][0] = 0.25

    def bias_in_place(layer):
        with torch.no_grad():
            layer.bias.add_(1.0)

    def load_state(layer):
        other = comera.TTLinear(48, 40, rank=5)
        layer.load_state_dict(other.state_dict())

    def new_parameter(layer):
        layer.cores[0] = torch.nn.Parameter(torch.randn_like(layer.cores[0]))

    def new_bias(layer):
        layer.bias = torch.nn.Parameter(torch.randn_like(layer.bias))

    def reset(layer):
        layer.reset_parameters()

    def to_double(layer):
        layer.double()

    return [optimizer_step, in_place, gate_in_place, bias_in_place, load_state, new_parameter,
            new_bias, reset, to_double]


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
def test_every_change_of_a_parameter_is_seen(change):
    torch.manual_seed(0)
    layer = comera.TTLinear(48, 40, rank=5)
    x = torch.randn(2, 48)
    before = _check(layer, x)
    change(layer)
    after = _check(layer, x.to(layer.cores[0].dtype))
    assert not torch.allclose(before.double(), after.double())


def test_gate_step_and_pruning_are_seen():
    torch.manual_seed(0)
    model = torch.nn.Sequential(comera.TTLinear(48, 40, rank=6))
    ra = comera.RankAdaptive(model, threshold=0.05, gamma=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ra.attach(opt)
    x = torch.randn(2, 48)
    for _ in range(3):
        _check(model[0], x)
        opt.zero_grad()
        model(torch.randn(4, 48)).pow(2).mean().backward()
        opt.step()
    _check(model[0], x)
    comera.prune(model, opt)
    _check(model[0], x)


@pytest.mark.parametrize("how", ["assign", "in_place"])
def test_writes_through_data_are_renewed_by_clear_or_a_training_call(how):
    layer = comera.TTLinear(48, 40, rank=5)
    x = torch.randn(2, 48)

    def write():
        if how == "assign":
            layer.cores[2].data = layer.cores[2].detach() * 2.0
        else:
            layer.cores[2].data.mul_(2.0)

    _check(layer, x)
    write()  # invisible to the version counter
    layer.clear_prepared()
    _check(layer, x)
    write()
    layer(x)  # a call with gradients
    _check(layer, x)


def test_copies_and_pickles_carry_no_merged_pair():
    layer = comera.TTLinear(48, 40, rank=5)
    x = torch.randn(2, 48)
    _check(layer, x)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other._prepared.v is None
        torch.testing.assert_close(_check(other, x), _check(layer, x))
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(_check(loaded, x), _check(layer, x))


def test_transforms_autocast_and_compile_keep_the_operator():
    layer = comera.TTLinear(48, 40, rank=5)
    x = torch.randn(2, 48)
    with torch.no_grad(), torch.autocast("cpu"):
        assert layer(x).dtype == torch.bfloat16
    assert layer._prepared.v is None
    y = torch.func.vmap(layer)(torch.randn(3, 2, 48))
    assert y.shape == (3, 2, 40) and layer._prepared.v is None
    with torch.no_grad():
        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), _check(layer, x))
