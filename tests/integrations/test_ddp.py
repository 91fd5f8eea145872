"""DistributedDataParallel (gloo, 2 processes on this machine) on converted models.

One spawn of 2 workers (starting processes is the slow part) runs both
checks in turn; each worker asserts, records which checks passed, and a
failure stops both workers (torch.multiprocessing.spawn), so the checks
after it report that they did not run."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comera
import comera.integrations.ddp  # noqa: F401

import gloo_phases

WORLD = gloo_phases.WORLD


def _model():
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                     batch_first=True)
    net = nn.Sequential(nn.Linear(24, 32), nn.GELU(), enc, nn.Linear(32, 8))
    return comera.convert(net, rank=4, min_compression=0.5)


def _data(steps, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 5, 24, generator=g), torch.randn(batch, 5, 8, generator=g))
            for _ in range(steps)]


def _gather(t):
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def _grad_phase(rank):
    model = _model()
    assert sum(isinstance(m, comera.TTLinear) for m in model.modules()) == 4
    single = copy.deepcopy(model)                     # the single-process reference
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(single.parameters(), lr=0.05)
    half = slice(rank * 4, (rank + 1) * 4)
    for x, y in _data(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        nn.functional.mse_loss(ddp(x[half]), y[half]).backward()
        nn.functional.mse_loss(single(x), y).backward()      # the concatenated batch
        for (name, p), q in zip(model.named_parameters(), single.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
            g0, g1 = _gather(p.grad)
            assert torch.equal(g0, g1), name
        opt.step()
        opt_ref.step()
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def _same_everywhere(obj):
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, obj)
    return all(o == everyone[0] for o in everyone)


def _rank_adaptive_phase(rank):
    from comera.integrations import ddp as cddp
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    start = comera.compression(model)
    ra = comera.RankAdaptive(model, gamma=0.5, threshold=1e-2, stage1_steps=6, stage2_steps=12,
                             target_compression=2.0 * start)
    half = slice(rank * 4, (rank + 1) * 4)
    old = ddp                                   # an old wrapper that stays referenced
    rewraps = 0
    for step, (x, y) in enumerate(_data(18)):
        loss = nn.functional.mse_loss(ddp(x[half]), y[half]) + ra.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ra.step(opt)
        if step % 3 == 2:
            new, pruned = cddp.prune(ddp, opt)
            assert (new is ddp) == (not pruned)
            rewraps += new is not ddp
            ddp = new
            assert _same_everywhere(cddp.all_ranks(model))
    assert rewraps >= 1 and old is not ddp
    assert ra.compression() >= 2.0 * start * 0.97, (ra.compression(), start)
    assert _same_everywhere([p.detach().tolist() for p in model.parameters()])
    # the re-wrapped model still gives the single-process gradients
    single = copy.deepcopy(model)
    x, y = _data(1, batch=8)[0]
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x[half]), y[half]).backward()
    nn.functional.mse_loss(single(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def _hook_phase(rank):
    """RankAdaptive attached to each process's optimizer: both stages run from
    the optimizer hook, on the all-reduced gradients, identically everywhere."""
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    start = comera.compression(model)
    ra = comera.RankAdaptive(model, gamma=0.5, threshold=1e-2, stage1_steps=6, stage2_steps=10,
                             target_compression=2.0 * start).attach(opt)
    half = slice(rank * 4, (rank + 1) * 4)
    for x, y in _data(16):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[half]), y[half]).backward()
        opt.step()
    assert ra.steps == 16 and ra.frozen
    assert abs(ra.compression() / (2.0 * start) - 1) <= 0.05
    assert _same_everywhere([p.detach().tolist() for p in model.parameters()])
    assert _same_everywhere([s.tolist() for s in ra._saliency])
    ddp, _ = comera.integrations.ddp.prune(ddp, opt)
    assert _same_everywhere(comera.integrations.ddp.all_ranks(model))
    ra.detach()


PHASES = [_grad_phase, _rank_adaptive_phase, _hook_phase]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return gloo_phases.spawn(tmp_path_factory, "ddp", PHASES)


def test_ddp_gradients_equal_single_process_on_concatenated_batch(ddp_run):
    gloo_phases.check(ddp_run, _grad_phase)


def test_ddp_rank_adaptive_and_prune_keep_ranks_identical(ddp_run):
    gloo_phases.check(ddp_run, _rank_adaptive_phase)


def test_ddp_attached_rank_adaptive_is_identical_in_every_process(ddp_run):
    gloo_phases.check(ddp_run, _hook_phase)
