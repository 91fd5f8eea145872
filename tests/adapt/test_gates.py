"""The flat-gate step of RankAdaptive (comera.adapt.gates, comera.adapt.step)
against a per-gate loop written out here, and FlatGates itself."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import comera
from comera.adapt.gates import FlatGates
from comera.ops.gate_prox import gate_prox_
from comera.adapt.step import SALIENCY_DECAY


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.integers(0, 2**31 - 1))
def test_flatgates_roundtrip_counts_pad_rank(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(-1, 2, (n,), generator=g).float() for n in sizes]
    fg = FlatGates(sizes)
    flat = fg.cat(parts)
    assert flat.numel() == sum(sizes)
    assert all(torch.equal(a, b) for a, b in zip(fg.split(flat), parts))
    assert fg.counts(flat != 0).tolist() == [int(torch.count_nonzero(p)) for p in parts]
    # the (gate, entry) matrix: entry j of gate i at [i, j], the rest filled
    padded = fg.pad(flat, 7.0)
    assert padded.shape == (len(sizes), max(sizes))
    expect = [(i, j) for i, p in enumerate(parts) for j in torch.nonzero(p).flatten().tolist()]
    assert [tuple(ij) for ij in torch.nonzero(padded.masked_fill(padded == 7.0, 0)).tolist()] \
        == expect
    assert torch.equal(fg.unpad(padded), flat)
    # each entry's place in its gate by decreasing value, ties by position
    for p, ranks in zip(parts, fg.split(fg.rank_within(flat))):
        order = sorted(range(len(p)), key=lambda j: (-float(p[j]), j))
        assert ranks.tolist() == [order.index(j) for j in range(len(p))]
    per = fg.per_entry(torch.arange(len(sizes), dtype=torch.float32))
    assert per.tolist() == [float(i) for i, n in enumerate(sizes) for _ in range(n)]
    assert fg.matches(parts) and not fg.matches(parts + [torch.zeros(1)])


def _reference_step(gates, signs, saliency, lr, strength, threshold, min_rank):
    """Stage-1 host step, one gate at a time (the loop the flat step replaced)."""
    for g, sal in zip(gates, saliency):
        if g.grad is not None:
            sal.mul_(SALIENCY_DECAY).add_((g.detach() * g.grad).abs().double(),
                                          alpha=1.0 - SALIENCY_DECAY)
    for g, sign in zip(gates, signs):
        old = torch.where(sign != 0, g.data, torch.zeros_like(g.data))
        g.data.copy_(old.sign() * (old.abs() - lr * strength).clamp_min(0))
        need = min(min_rank, int(torch.count_nonzero(old)))
        if int(torch.count_nonzero(g.data)) < need:
            # the largest entries, ties to the earlier one (the rule on the CPU and CUDA alike)
            top = torch.sort(old.abs(), descending=True, stable=True).indices[:need]
            g.data[top] = torch.where(g.data[top] != 0, g.data[top], old[top])
    gate_prox_([g.data for g in gates], signs, threshold, min_rank, True)


@pytest.mark.parametrize("gamma", [0.5, 5.0])   # 5.0 shrinks whole gates: the min_rank rescue
@pytest.mark.parametrize("drop_grad", [False, True])  # a gate without gradient: the loop path
@pytest.mark.parametrize("sync_free", [False, True])
def test_flat_step_matches_per_gate_loop(gamma, drop_grad, sync_free):
    torch.manual_seed(0)
    model = torch.nn.Sequential(comera.TTLinear(24, 36, rank=5), comera.TTLinear(36, 8, rank=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ra = comera.RankAdaptive(model, gamma=gamma, threshold=1e-3, stage1_steps=50, stage2_steps=0,
                             min_rank=2, balance=False, sync_free=sync_free)
    gates = ra._gates()
    start = [g.detach().clone() for g in gates]
    ref = [g.detach().clone() for g in gates]
    ref_signs = [s.clone() for s in ra.state.signs]
    ref_sal = [a.clone() for a in ra.state.saliency]
    for step in range(6):
        grads = [torch.randn_like(g) for g in gates]
        if drop_grad:
            grads[1] = None
        for g, gr in zip(gates, grads):
            g.grad = gr
        ref_params = [torch.nn.Parameter(r.clone()) for r in ref]
        for p, gr in zip(ref_params, grads):
            p.grad = gr
        ra.step(opt)   # optimizer.step() is not called: only the controller moves the gates
        _reference_step(ref_params, ref_signs, ref_sal, 0.05, gamma, 1e-3, 2)
        ref = [p.detach() for p in ref_params]
        for a, b in zip(gates, ref):
            assert torch.equal(a.detach(), b), step
        for a, b in zip(ra.state.signs, ref_signs):
            assert torch.equal(a, b), step
        for a, b in zip(ra.state.saliency, ref_sal):
            assert torch.equal(a, b), step
    live = [int(torch.count_nonzero(s)) for s in ra.state.signs]
    assert all(n >= 2 for n in live)
    if gamma == 5.0:   # entries died, and min_rank kept two alive somewhere
        assert any(n == 2 for n in live), live
    else:              # the shrink moved the gates
        assert any(not torch.equal(g.detach(), g0) for g, g0 in zip(gates, start)), live
