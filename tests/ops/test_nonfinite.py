"""Non-finite values: NaN/Inf in the inputs of TTLinear and TTEmbedding
propagate as they would through nn.Linear / nn.Embedding (only the rows the
math says), nothing crashes or hangs, and the rank-adaptive machinery never
prunes a rank because of a NaN gate: it raises, naming the layer."""
import pytest
import torch
from torch import nn

import comera


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["merge", "sequential"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_linear_nonfinite_input_row(dtype, path, bad):
    torch.manual_seed(0)
    layer = comera.TTLinear(24, 20, rank=3, in_shape=[4, 6], out_shape=[4, 5], path=path,
                            dtype=dtype)
    dense = layer.to_dense()
    x = torch.randn(37, 24, dtype=dtype)     # more rows than one kernel row block
    x[5, 7] = bad
    x[30, 0] = bad
    x.requires_grad_()
    y = layer(x)
    want = dense(x.detach())
    rows_bad = torch.zeros(37, dtype=torch.bool)
    rows_bad[[5, 30]] = True
    # the rows holding the bad value: every output non-finite (NaN for NaN input), as in nn.Linear
    assert not torch.isfinite(y[rows_bad]).any()
    assert not torch.isfinite(want[rows_bad]).any()
    if bad != bad:
        assert torch.isnan(y[rows_bad]).all()
    # every other row: finite and equal to the dense layer
    assert torch.isfinite(y[~rows_bad]).all()
    torch.testing.assert_close(y[~rows_bad], want[~rows_bad])
    # backward: the input gradient of the clean rows does not see the bad ones
    gy = torch.randn_like(y)
    gy[rows_bad] = 0
    (gx,) = torch.autograd.grad(y, x, gy)
    assert torch.isfinite(gx[~rows_bad]).all()
    xd = x.detach().clone().requires_grad_()
    (gxd,) = torch.autograd.grad(dense(xd), xd, gy)
    torch.testing.assert_close(gx[~rows_bad], gxd[~rows_bad])


@pytest.mark.parametrize("reuse", ["none", "dedup", "prefix"])
def test_embedding_nan_in_table_reaches_only_its_rows(reuse):
    """A NaN in core 0's slice i_1 = 2 makes exactly the rows with first
    index 2 NaN (as an nn.Embedding whose rows hold NaN), for every reuse
    strategy (prefix sharing must not leak it to other rows)."""
    torch.manual_seed(0)
    emb = comera.TTEmbedding(60, 8, rank=3, shape=([3, 4, 5], [2, 2, 2]), reuse=reuse,
                             dtype=torch.float64)
    table = emb.to_dense().weight.detach().clone()
    with torch.no_grad():
        emb.cores[0][0, 2, 1, 0] = float("nan")
    idx = torch.tensor([0, 41, 40, 59, 41, 19, 20, 39, 40, 7])
    out = emb(idx)
    first = idx // 20
    assert torch.isnan(out[first == 2]).any(dim=1).all()
    assert torch.isfinite(out[first != 2]).all()
    torch.testing.assert_close(out[first != 2], table[idx[first != 2]])


def test_embedding_bag_nan_weight_reaches_only_its_bag():
    torch.manual_seed(0)
    bag = comera.TTEmbedding(60, 8, rank=3, shape=([3, 4, 5], [2, 2, 2]), mode="sum",
                             dtype=torch.float64)
    ref = nn.EmbeddingBag.from_pretrained(bag.to_dense().weight.detach(), mode="sum")
    idx = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    offsets = torch.tensor([0, 3, 5])
    w = torch.rand(8, dtype=torch.float64)
    w[4] = float("inf")
    w[0] = float("nan")
    out = bag(idx, offsets, per_sample_weights=w)
    want = ref(idx, offsets, per_sample_weights=w)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out[0]).all()
    assert not torch.isfinite(out[1]).any() and not torch.isfinite(want[1]).any()
    torch.testing.assert_close(out[2], want[2])


def _model():
    torch.manual_seed(0)
    return comera.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), rank=4)


def test_rank_adaptive_raises_on_nan_gate_and_prunes_nothing():
    model = _model()
    ctl = comera.RankAdaptive(model, gamma=1e-2, threshold=0.5, stage1_steps=5,
                              stage2_steps=5, target_compression=None)
    with torch.no_grad():
        model[0].gates[0][:] = 1e-3     # would all die at this threshold...
        model[2].gates[1][1] = float("nan")
    before = [[g.detach().clone() for g in m.gates] for m in (model[0], model[2])]
    with pytest.raises(ValueError, match=r"gate 1 of layer '2' contains NaN"):
        ctl.step()
    # ...but nothing changed anywhere, and nothing is pruned afterwards either
    for m, gs in zip((model[0], model[2]), before):
        for g, b in zip(m.gates, gs):
            torch.testing.assert_close(g.detach(), b, equal_nan=True, rtol=0, atol=0)
    ranks = [list(m.ranks) for m in (model[0], model[2])]
    with pytest.raises(ValueError, match=r"prune: gate 1 of layer '2' contains NaN"):
        comera.prune(model)
    assert [list(m.ranks) for m in (model[0], model[2])] == ranks


def test_prune_checks_every_layer_before_cutting():
    model = _model()
    with torch.no_grad():
        model[0].gates[0][2:] = 0          # prunable...
        model[2].gates[0][0] = float("nan")  # ...but a later layer holds a NaN
    with pytest.raises(ValueError, match=r"gate 0 of layer '2' contains NaN"):
        comera.prune(model)
    assert model[0].ranks[0] == 4        # layer 0 was not cut either
