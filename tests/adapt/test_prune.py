"""comera.prune: physical truncation of dead ranks (docs/design.md section 4).

References: the unpruned layer with its dead gates at zero (same function),
the dense weight built entry by entry (tests/reference.py), and optimizers
run on a small model built by hand from the surviving slices."""
import copy
import warnings

import pytest
import torch
from torch import nn

import comera
from reference import dense_wt_by_entries


def _layer_with_dead_ranks(dtype, bias=True):
    """48 -> 60 (modes 4x3x4 -> 3x4x5), rank 6, dead entries on the first,
    the middle and the last bond and an untouched bond."""
    layer = comera.TTLinear(48, 60, bias=bias, rank=6, in_shape=[4, 3, 4], out_shape=[3, 4, 5],
                            dtype=dtype)
    dead = {0: [1, 3], 2: [0, 2, 5], 4: [4]}
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
        for k, idx in dead.items():
            layer.gates[k][idx] = 0
    keep = {k: [j for j in range(layer.gates[k].numel()) if j not in dead.get(k, [])]
            for k in range(len(layer.gates))}
    return layer, keep


def _slices(layer, keep):
    """The surviving slices of every core and gate, cut by direct indexing."""
    D = len(layer.cores)
    cores = []
    for k, c in enumerate(layer.cores):
        t = c.detach()
        if k > 0:
            t = t[keep[k - 1]]
        if k < D - 1:
            t = t[..., keep[k]]
        cores.append(t.clone())
    gates = [g.detach()[keep[k]].clone() for k, g in enumerate(layer.gates)]
    return cores, gates


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_prune_keeps_outputs_and_gradients(dtype, tol):
    layer, keep = _layer_with_dead_ranks(dtype)
    ref = copy.deepcopy(layer)
    x = torch.randn(9, 48, dtype=dtype)
    dy = torch.randn(9, 60, dtype=dtype)

    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    y_ref.backward(dy)
    ref_cores, ref_gates = _slices(ref, keep)  # values
    grad_cores = [None] * len(ref.cores)
    for k, c in enumerate(ref.cores):  # gradients, cut the same way
        t = c.grad
        if k > 0:
            t = t[keep[k - 1]]
        if k < len(ref.cores) - 1:
            t = t[..., keep[k]]
        grad_cores[k] = t
    grad_gates = [g.grad[keep[k]] for k, g in enumerate(ref.gates)]

    params_before = [id(p) for p in layer.parameters()]
    live_size = layer.live_tt_params()
    out = comera.prune(layer)
    assert [id(p) for p in layer.parameters()] == params_before
    assert out == {"": [len(keep[k]) for k in range(5)]}
    assert layer.ranks == [len(keep[k]) for k in range(5)]
    assert layer.tt_params() == live_size
    for c, r in zip(layer.cores, ref_cores):
        torch.testing.assert_close(c.detach(), r, rtol=0, atol=0)

    xp = x.clone().requires_grad_()
    y = layer(xp)
    y.backward(dy)
    scale = max(1.0, y_ref.abs().max().item())
    torch.testing.assert_close(y, y_ref, rtol=0, atol=tol * scale)
    # against the dense weight of the pruned cores, built entry by entry
    wt = dense_wt_by_entries([c.detach().double() for c in layer.cores],
                             [g.detach().double() for g in layer.gates], 3, 48, 60)
    y_dense = x.double() @ wt + layer.bias.detach().double()
    torch.testing.assert_close(y.double(), y_dense, rtol=0, atol=max(tol, 1e-5) * scale)
    torch.testing.assert_close(xp.grad, xr.grad, rtol=0, atol=tol * scale)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=0, atol=tol * scale)
    for c, g in zip(layer.cores, grad_cores):
        torch.testing.assert_close(c.grad, g, rtol=0, atol=tol * max(1.0, g.abs().max().item()))
    for p, g in zip(layer.gates, grad_gates):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=tol * max(1.0, g.abs().max().item()))


def test_prune_nothing_dead_is_a_no_op():
    layer = comera.TTLinear(24, 16, rank=4)
    before = [c.detach().clone() for c in layer.cores]
    assert comera.prune(layer) == {}
    for c, b in zip(layer.cores, before):
        assert torch.equal(c, b)


def _train_steps(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()


def _small_copy(layer, keep):
    small = comera.TTLinear(48, 60, rank=[len(keep[k]) for k in range(5)], in_shape=[4, 3, 4],
                            out_shape=[3, 4, 5], dtype=layer.cores[0].dtype)
    cores, gates = _slices(layer, keep)
    with torch.no_grad():
        for p, v in zip(small.cores, cores):
            p.copy_(v)
        for p, v in zip(small.gates, gates):
            p.copy_(v)
        small.bias.copy_(layer.bias)
    return small


def _cut_like(t, k, keep, D):
    if t.dim() == 1:  # a gate's state
        return t[keep[k]].clone()
    if k > 0:
        t = t[keep[k - 1]]
    if k < D - 1:
        t = t[..., keep[k]]
    return t.clone()


@pytest.mark.parametrize("make_opt,keys", [
    (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), ["exp_avg", "exp_avg_sq"]),
    (lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
     ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]),
    (lambda p: torch.optim.Adam(p, lr=1e-2), ["exp_avg", "exp_avg_sq"]),
    (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True), ["momentum_buffer"]),
], ids=["adamw", "adamw-amsgrad", "adam", "sgd-momentum"])
def test_optimizer_after_prune_matches_small_model(make_opt, keys):
    torch.manual_seed(1)
    layer, keep = _layer_with_dead_ranks(torch.float64)
    opt = make_opt(layer.parameters())
    data = [(torch.randn(16, 48, dtype=torch.float64), torch.randn(16, 60, dtype=torch.float64))
            for _ in range(6)]
    _train_steps(layer, opt, data[:3])
    with torch.no_grad():  # dead entries back at zero (RankAdaptive does this each step)
        for k, g in enumerate(layer.gates):
            mask = torch.ones_like(g, dtype=torch.bool)
            mask[keep[k]] = False
            g[mask] = 0

    # the reference: a small model and optimizer built by hand from the same state
    small = _small_copy(layer, keep)
    small_opt = make_opt(small.parameters())
    D = len(layer.cores)
    big_params = list(layer.cores) + list(layer.gates) + [layer.bias]
    small_params = list(small.cores) + list(small.gates) + [small.bias]
    for i, (bp, sp) in enumerate(zip(big_params, small_params)):
        k = i if i < D else i - D
        for key, value in opt.state[bp].items():
            if key in keys and bp is not layer.bias:
                small_opt.state[sp][key] = _cut_like(value, k, keep, D)
            else:
                small_opt.state[sp][key] = value.clone() if torch.is_tensor(value) else value

    comera.prune(layer, opt)
    for bp in big_params:
        for key in keys:
            assert opt.state[bp][key].shape == bp.shape
    _train_steps(layer, opt, data[3:])
    _train_steps(small, small_opt, data[3:])
    for a, b in zip(big_params, small_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-12)
    for a, b in zip(big_params, small_params):
        for key in keys:
            torch.testing.assert_close(opt.state[a][key], small_opt.state[b][key], rtol=0,
                                       atol=1e-12)


def test_training_continues_with_old_graph_alive():
    # A loss tensor kept from the previous step holds autograd's cached
    # gradient accumulators of the old shapes; pruning must not trip on them.
    layer, keep = _layer_with_dead_ranks(torch.float32)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x, y = torch.randn(8, 48), torch.randn(8, 60)
    loss = (layer(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for k, g in enumerate(layer.gates):
            mask = torch.ones_like(g, dtype=torch.bool)
            mask[keep[k]] = False
            g[mask] = 0
    comera.prune(layer, opt)
    for _ in range(2):
        opt.zero_grad()
        loss = (layer(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    assert all(p.grad.shape == p.shape for p in layer.parameters())
    assert torch.isfinite(loss)


def test_bond_with_no_live_rank_keeps_one_zero_slice():
    layer = comera.TTLinear(24, 16, rank=4, in_shape=[2, 3, 4], out_shape=[4, 4])
    with torch.no_grad():
        layer.gates[1].zero_()
    comera.prune(layer)
    assert layer.ranks[1] == 1 and float(layer.gates[1][0].detach()) == 0.0
    x = torch.randn(3, 24)
    torch.testing.assert_close(layer(x), layer.bias.detach().expand(3, 16))


def test_prune_in_a_model_and_state_dict_shapes():
    model = nn.Sequential(comera.TTLinear(24, 32, rank=4), nn.ReLU(), comera.TTLinear(32, 8, rank=4))
    with torch.no_grad():
        model[2].gates[0][1:] = 0
    out = comera.prune(model)
    assert list(out) == ["2"] and out["2"][0] == 1
    assert model.state_dict()["2.gates.0"].shape == (1,)
    assert model.state_dict()["2.cores.1"].shape[0] == 1


def test_prune_refuses_nan_and_names_the_layer():
    model = nn.Sequential(nn.Linear(4, 24), comera.TTLinear(24, 16, rank=4))
    with torch.no_grad():
        model[1].gates[2][0] = float("nan")
        model[1].gates[0][0] = 0
    shapes = [tuple(c.shape) for c in model[1].cores]
    with pytest.raises(ValueError, match=r"gate 2 of layer '1'.*NaN"):
        comera.prune(model)
    assert [tuple(c.shape) for c in model[1].cores] == shapes


def test_prune_without_tt_layers_warns_once():
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert comera.prune(model) == {}
    assert len(caught) == 1 and "no TT layers" in str(caught[0].message)


def test_prune_bad_arguments():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        comera.prune("model")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        comera.prune(comera.TTLinear(8, 8, rank=2), optimizer=object())
