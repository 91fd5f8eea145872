"""Rank adaptation on CUDA without host synchronisation (comera/adapt/step.py,
comera/adapt/controller.py, csrc/gate_prox/cuda.cu): RankAdaptive steps under
torch.cuda.set_sync_debug_mode("error"), and a whole training step with
RankAdaptive captured in a CUDA graph and replayed against eager steps.

Every test is marked needs_cuda; the ones that need CUDA itself (sync debug
mode, graphs) skip under COMERA_TEST_CUDA_DEVICE=cpu.  The CPU-side proof of
the same property (a detector of host reads, equality with sync_free=False) is
tests/adapt/test_rank_device.py.
"""
import contextlib
import os

import pytest
import torch
from torch import nn

import comera

pytestmark = pytest.mark.needs_cuda

DEV = os.environ.get("COMERA_TEST_CUDA_DEVICE", "cuda")
ON_GPU = DEV == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="a CUDA-only feature: needs a real GPU")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(64, 96, rank=8), nn.GELU(),
                         comera.TTLinear(96, 32, rank=8)).to(DEV)  # compression 5.4


def _batches(n):
    g = torch.Generator(device=DEV).manual_seed(1)
    return [(torch.randn(128, 64, device=DEV, generator=g),
             torch.randn(128, 32, device=DEV, generator=g)) for _ in range(n)]


def _rank_adaptive(model, opt, **kw):
    args = dict(gamma=0.3, threshold=1e-2, stage1_steps=6, stage2_steps=10,
                target_compression=12.0)
    args.update(kw)
    return comera.RankAdaptive(model, **args).attach(opt)


@contextlib.contextmanager
def _sync_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_gpu
def test_gate_prox_on_cuda_neither_copies_nor_waits():
    gates = [torch.randn(n, device=DEV) * 0.05 for n in (3, 17, 64)] * 30  # 90 gates: 2 chunks
    gates = [g.clone() for g in gates]
    signs = [torch.sign(g).to(torch.int8) for g in gates]
    ref_g, ref_s = [g.cpu() for g in gates], [s.cpu() for s in signs]
    with _sync_error():
        live = comera.ops.gate_prox_(gates, signs, threshold=0.02, min_live=2)
    want = comera.ops.gate_prox_(ref_g, ref_s, threshold=0.02, min_live=2)
    assert live.device.type == "cuda" and live.tolist() == want.tolist()
    for g, s, rg, rs in zip(gates, signs, ref_g, ref_s):
        assert torch.equal(g.cpu(), rg) and torch.equal(s.cpu(), rs)


@needs_gpu
@pytest.mark.parametrize("rule", ["saliency", "magnitude"])
def test_rank_adaptive_steps_never_synchronise(rule):
    """Attached steps through stage 1, the stage-2 controller and frozen
    steps, each optimizer step (AdamW capturable, which itself does not
    sync, then the RankAdaptive hook) under sync debug mode "error"; only
    the prune steps, outside it, may sync.  The run reaches the target."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, capturable=True)
    ra = _rank_adaptive(model, opt, stage2_rule=rule, prune_every=5)
    for i, (x, y) in enumerate(_batches(20)):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        if i == 0 or (i + 1) % 5 == 0:  # the first step builds the device state; prune steps
            opt.step()
            continue
        with _sync_error():
            opt.step()
    assert ra.steps == 20 and ra.uses_sync_free()  # the sync-free path ran
    ra.check()
    assert ra.frozen and abs(ra.compression() / 12.0 - 1) < 0.05


def _graph_vs_eager(ra_kwargs, steps=6):
    """Warm-up steps, then one captured step (forward, backward, AdamW
    capturable, the RankAdaptive hook) replayed on new batches, against the
    same steps run eagerly on a twin."""
    batches = _batches(3 + steps)
    eager, graphed = _model(), _model()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=2e-2, capturable=True)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=2e-2, capturable=True)
    ra_e = _rank_adaptive(eager, opt_e, **ra_kwargs)
    ra_g = _rank_adaptive(graphed, opt_g, **ra_kwargs)

    def step(model, opt, x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: builds optimizer and controller state
        for x, y in batches[:3]:
            opt_g.zero_grad(set_to_none=True)
            step(graphed, opt_g, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step(graphed, opt_g, static_x, static_y)
    live = []
    for i, (x, y) in enumerate(batches):
        opt_e.zero_grad(set_to_none=True)
        step(eager, opt_e, x, y)
        live.append(sum(int(torch.count_nonzero(s)) for s in ra_e._signs))
        if i >= 3:
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            torch.cuda.synchronize()
            for se, sg in zip(ra_e._signs, ra_g._signs):
                assert torch.equal(se, sg), f"replay {i - 3}: signs differ"
    for pe, pg in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(pg, pe, atol=1e-5, rtol=1e-4)
    for ae, ag in zip(ra_e._saliency, ra_g._saliency):
        torch.testing.assert_close(ag, ae, atol=1e-9, rtol=1e-6)
    return ra_e, ra_g, live[2:]


@needs_gpu
def test_cuda_graph_replays_stage1_steps_like_eager():
    """Stage 1 with a target: shrink, proximal kills and the controller's
    review (revivals, freeze check) all inside the graph.  Ranks die during
    the replayed steps, so the replays really ran the gate step."""
    ra_e, ra_g, live = _graph_vs_eager(dict(stage1_steps=100, gamma=1.0, threshold=0.02,
                                            target_compression=40.0))
    assert ra_e.stage == 1 and not ra_e.frozen and live[-1] < live[0]
    assert ra_g.compression() == ra_e.compression()


@needs_gpu
def test_cuda_graph_replays_frozen_steps_like_eager():
    """Stage 2 once the ranks are frozen (fine-tuning): dead entries stay 0."""
    ra_e, ra_g, live = _graph_vs_eager(dict(stage1_steps=1, stage2_steps=2,
                                            target_compression=8.0))
    assert ra_e.frozen and ra_g.frozen and len(set(live)) == 1
    for g, s in zip(ra_g._gates(), ra_g._signs):
        assert torch.equal(torch.where(s == 0, g.detach(), torch.zeros_like(g)),
                           torch.zeros_like(g))
