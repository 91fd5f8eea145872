"""comera.summary / comera.compression, checkpoints of pruned models, and the
docstring examples of the rank-adaptation modules.

References: sizes computed by hand from the mode sizes and live ranks
(S = sum_k r_{k-1} n_k r_k), dense parameter counts from the features, and
the outputs of the model that wrote the checkpoint."""
import doctest
import importlib
import io
import warnings

import pytest
import torch
from torch import nn

import comera


def _model():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(48, 60, rank=6, in_shape=[4, 3, 4], out_shape=[3, 4, 5]),
                         nn.ReLU(),
                         nn.Sequential(comera.TTLinear(60, 10, bias=False, rank=5)))


def _kill(model):
    """Dead ranks on a few bonds of both layers."""
    with torch.no_grad():
        model[0].gates[0][[1, 2]] = 0
        model[0].gates[2][[0, 3, 4, 5]] = 0
        model[2][0].gates[1][0] = 0


def _size(dims, ranks):
    r = [1] + ranks + [1]
    return sum(r[k] * dims[k] * r[k + 1] for k in range(len(dims)))


def test_summary_and_compression_against_hand_counts():
    model = _model()
    _kill(model)
    l0, l1 = model[0], model[2][0]
    r0 = [2, 6, 2, 6, 5]
    r1 = [r - (1 if k == 1 else 0) for k, r in enumerate(l1.ranks)]
    assert l0.live_ranks() == r0 and l1.live_ranks() == r1
    s0 = _size([4, 3, 4, 3, 4, 5], r0)
    s1 = _size(l1.in_shape + l1.out_shape, r1)
    assert l0.live_tt_params() == s0 and l1.live_tt_params() == s1
    assert comera.compression(model) == pytest.approx((48 * 60 + 60 * 10) / (s0 + s1))

    table = comera.summary(model).splitlines()
    header = table[0].split()
    assert header[:2] == ["layer", "type"] and "compression" in header
    row0 = table[1]
    assert row0.startswith("0 ") and "TTLinear" in row0 and "4x3x4 -> 3x4x5" in row0
    assert str(r0) in row0 and f" {s0} " in row0 and " 2880 " in row0
    assert row0.rstrip().endswith(f"{2880 / s0:.1f}x")
    assert table[2].startswith("2.0 ") and str(r1) in table[2] and " 600 " in table[2]
    total = table[3].split()
    assert total[0] == "total" and total[1:] == [str(s0 + s1), "3480", f"{3480 / (s0 + s1):.1f}x"]

    # pruning makes the live size physical and leaves the report unchanged
    comera.prune(model)
    assert l0.tt_params() == s0 and l1.tt_params() == s1
    assert comera.summary(model).splitlines() == table
    assert l0.compression() == pytest.approx(2880 / s0)


def test_summary_and_compression_without_tt_layers():
    model = nn.Sequential(nn.Linear(4, 4))
    assert comera.compression(model) == 1.0
    assert "no TT layers" in comera.summary(model)


def test_duck_typed_layer_is_counted():
    """A TT layer that only duck-types the interface (cores, gates,
    tt_params, compression) is found and sized like a TTLinear."""
    class Duck(nn.Module):
        def __init__(self):
            super().__init__()
            self.cores = nn.ParameterList([nn.Parameter(torch.randn(1, 6, 3)),
                                           nn.Parameter(torch.randn(3, 5, 1))])
            self.gates = nn.ParameterList([nn.Parameter(torch.tensor([1.0, 0.0, 2.0]))])

        def tt_params(self):
            return sum(c.numel() for c in self.cores)

        def compression(self):
            return 30 / self.tt_params()

    model = nn.Sequential(Duck())
    assert comera.compression(model) == pytest.approx(30 / (6 * 2 + 2 * 5))
    comera.prune(model)
    assert model[0].cores[0].shape == (1, 6, 2)


# ------------------------------------------------------------ checkpoints
def _pruned_trained_model():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randn(8, 48)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    _kill(model)
    comera.prune(model, opt)
    return model, opt


@pytest.mark.parametrize("loader", ["plain", "helper", "torch.save"])
def test_pruned_checkpoint_loads_into_a_fresh_model(loader):
    model, _ = _pruned_trained_model()
    sd = model.state_dict()
    fresh = _model()
    assert fresh[0].ranks == [4, 6, 6, 6, 5]
    params = [id(p) for p in fresh.parameters()]
    if loader == "plain":
        result = fresh.load_state_dict(sd)
    elif loader == "helper":
        result = comera.load_state_dict(fresh, sd)
    else:
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        result = fresh.load_state_dict(torch.load(buf))
    assert not result.missing_keys and not result.unexpected_keys
    assert [id(p) for p in fresh.parameters()] == params
    assert fresh[0].ranks == model[0].ranks == [2, 6, 2, 6, 5]
    assert fresh[2][0].ranks == model[2][0].ranks
    for a, b in zip(fresh.state_dict().values(), sd.values()):
        assert torch.equal(a, b)
    x = torch.randn(5, 48)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    # and it trains on, with an optimizer built after loading
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        fresh(x).pow(2).mean().backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_checkpoint_with_optimizer_state_resumes_identically():
    model, opt = _pruned_trained_model()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)  # built before loading
    comera.load_state_dict(fresh, ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    for _ in range(3):
        x = torch.randn(8, 48)
        for m, o in ((model, opt), (fresh, fresh_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_of_other_modes_is_refused_naming_the_layer():
    model, _ = _pruned_trained_model()
    sd = model.state_dict()
    other = nn.Sequential(comera.TTLinear(48, 60, rank=6, in_shape=[6, 8], out_shape=[3, 4, 5]),
                          nn.ReLU(), nn.Sequential(comera.TTLinear(60, 10, bias=False, rank=5)))
    with pytest.raises(ValueError, match=r"TTLinear '0'.*(mode sizes|only \d+ cores)"):
        comera.load_state_dict(other, sd)
    with pytest.raises(RuntimeError, match=r"TTLinear '0'"):
        other.load_state_dict(sd)

    other2 = nn.Sequential(comera.TTLinear(48, 60, rank=6, in_shape=[4, 4, 3], out_shape=[3, 4, 5]),
                           nn.ReLU(), nn.Sequential(comera.TTLinear(60, 10, bias=False, rank=5)))
    with pytest.raises(ValueError, match=r"TTLinear '0': core 1 has shape .* mode sizes "
                                         r"\(3,\) vs \(4,\) differ"):
        comera.load_state_dict(other2, sd)


def test_checkpoint_with_inconsistent_ranks_is_refused():
    model, _ = _pruned_trained_model()
    sd = dict(model.state_dict())
    sd["2.0.gates.1"] = torch.ones(sd["2.0.gates.1"].numel() + 1)
    fresh = _model()
    before = [tuple(p.shape) for p in fresh.parameters()]
    with pytest.raises(ValueError, match=r"TTLinear '2\.0': the ranks of bond 1 disagree"):
        comera.load_state_dict(fresh, sd)
    assert [tuple(p.shape) for p in fresh.parameters()] == before  # nothing resized


def test_load_state_dict_argument_errors():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        comera.load_state_dict({}, {})
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        comera.load_state_dict(_model(), [1, 2])


# -------------------------------------------------- docstring examples
@pytest.mark.parametrize("module", ["comera.layers.base", "comera.adapt.prune", "comera.layers.summary",
                                    "comera.storage", "comera.adapt.rank_adaptive",
                                    "comera.ops.gate_prox"])
def test_docstring_examples_run(module):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the examples run clean
        result = doctest.testmod(importlib.import_module(module),
                                 optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
