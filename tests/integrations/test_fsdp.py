"""FSDP2 (``fully_shard``, gloo, 2 processes on this machine) with rank
adaptation, against one process training the unsharded model on the
concatenated batch.

One spawn of 2 workers runs every phase in turn (starting processes is the
slow part); each worker computes the single-process reference itself, on an
unsharded copy, and asserts; a failure stops both workers, so the checks
after it report that they did not run.  A model of two TTLinear layers:
``fully_shard`` on each TT layer, then on the model; AdamW;
``RankAdaptive`` built before or after sharding, pruning every few steps
through ``comera.integrations.fsdp.prune``."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import comera
from comera.integrations import fsdp as cfsdp

import gloo_phases

WORLD = gloo_phases.WORLD
STEPS = 12
SETTINGS = dict(gamma=0.5, threshold=1e-2, stage1_steps=4, stage2_steps=6, prune_every=3)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(16, 24, rank=4, in_shape=[4, 4], out_shape=[4, 6]),
                         nn.GELU(),
                         comera.TTLinear(24, 8, rank=[3, 4, 3], in_shape=[4, 6], out_shape=[2, 4]))


def _shard(model):
    for m in model:
        if isinstance(m, comera.TTLinear):
            fully_shard(m)
    fully_shard(model)
    return model


def _data(steps, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g))
            for _ in range(steps)]


def _target(model):
    return 2.0 * comera.compression(model)


def _reference(steps, data=None):
    """One process, the unsharded model, the whole batch: losses, final ranks,
    and the trained objects."""
    model = _model()
    target = _target(model)
    ra = comera.RankAdaptive(model, target_compression=target, **SETTINGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra.attach(opt)
    losses = []
    for x, y in (data or _data(steps)):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, cfsdp.all_ranks(model), (model, opt, ra)


def _sharded_run(rank, steps, build_before):
    model = _model()
    target = _target(model)
    if build_before:   # balanced unsharded, then sharded
        ra = comera.RankAdaptive(model, target_compression=target, pruner=cfsdp.prune, **SETTINGS)
        _shard(model)
    else:              # sharded, then balanced through the gathered cores
        _shard(model)
        ra = comera.RankAdaptive(model, target_compression=target, pruner=cfsdp.prune, **SETTINGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra.attach(opt)
    half = slice(rank * 4, (rank + 1) * 4)
    losses = []
    for x, y in _data(steps):
        loss = nn.functional.mse_loss(model(x[half]), y[half])
        opt.zero_grad()
        loss.backward()
        opt.step()
        both = loss.detach().clone()
        dist.all_reduce(both)
        losses.append(float(both) / WORLD)
    return losses, model, opt, ra


def _same_everywhere(obj):
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, obj)
    return all(o == everyone[0] for o in everyone)


def _check_training(rank, build_before):
    ref_losses, ref_ranks, (ref_model, _, ref_ra) = _reference(STEPS)
    losses, model, opt, ra = _sharded_run(rank, STEPS, build_before)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=0)
    ranks = cfsdp.all_ranks(model)
    assert ranks == ref_ranks, (ranks, ref_ranks)
    assert any(r < 4 for rs in ranks.values() for r in rs), ranks     # something was pruned
    assert ra.frozen and ra.compression() == pytest.approx(ref_ra.compression())
    assert ra.compression() >= _target(_model()) * 0.97
    assert _same_everywhere(ranks)
    assert _same_everywhere([s.tolist() for s in ra.state.signs])
    whole = cfsdp.full_state_dict(model)
    for key, value in ref_model.state_dict().items():
        torch.testing.assert_close(whole[key], value, atol=1e-4, rtol=1e-4, msg=key)
    # the optimizer state was cut with the parameters: it has their (global) shapes
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape


def _before_phase(rank):
    _check_training(rank, build_before=True)


def _after_phase(rank):
    _check_training(rank, build_before=False)


def _resume_phase(rank):
    """A pruned run saved at step 6 (whole tensors), loaded into a freshly
    built and sharded model, goes on like the run that never stopped."""
    ref_losses, ref_ranks, _ = _reference(STEPS)
    first = 6
    losses, model, opt, ra = _sharded_run(rank, first, build_before=False)
    assert cfsdp.all_ranks(model) != cfsdp.all_ranks(_model())    # pruned by then
    saved = {"model": cfsdp.full_state_dict(model), "optimizer": cfsdp.full_optimizer_state_dict(opt),
             "controller": ra.state_dict()}
    model = _shard(_model())                                         # full ranks again
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra = comera.RankAdaptive(model, target_compression=_target(_model()), pruner=cfsdp.prune,
                             **SETTINGS)
    cfsdp.load_full_state_dict(model, saved["model"])
    cfsdp.load_full_optimizer_state_dict(opt, saved["optimizer"])
    ra.load_state_dict(saved["controller"])
    ra.attach(opt)
    assert cfsdp.all_ranks(model) == {k: v for k, v in cfsdp.all_ranks(model).items()}
    half = slice(rank * 4, (rank + 1) * 4)
    for x, y in _data(STEPS)[first:]:
        loss = nn.functional.mse_loss(model(x[half]), y[half])
        opt.zero_grad()
        loss.backward()
        opt.step()
        both = loss.detach().clone()
        dist.all_reduce(both)
        losses.append(float(both) / WORLD)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=0)
    assert cfsdp.all_ranks(model) == ref_ranks


def _errors_phase(rank):
    """Sharded layers are never pruned by comera.prune, nor by a controller
    without the FSDP pruner."""
    model = _shard(_model())
    with pytest.raises(TypeError, match="comera.integrations.fsdp.prune"):
        comera.prune(model)
    with pytest.raises(ValueError, match="pruner=comera.integrations.fsdp.prune"):
        comera.RankAdaptive(model, prune_every=2)
    assert cfsdp.prune(model) == {}                                  # nothing dead yet


PHASES = [_before_phase, _after_phase, _resume_phase, _errors_phase]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return gloo_phases.spawn(tmp_path_factory, "fsdp", PHASES)


def test_fsdp_rank_adaptive_built_before_sharding_matches_one_process(fsdp_run):
    gloo_phases.check(fsdp_run, _before_phase)


def test_fsdp_rank_adaptive_built_after_sharding_matches_one_process(fsdp_run):
    gloo_phases.check(fsdp_run, _after_phase)


def test_fsdp_pruned_run_saved_and_resumed_matches_one_process(fsdp_run):
    gloo_phases.check(fsdp_run, _resume_phase)


def test_fsdp_refuses_the_unsharded_pruner(fsdp_run):
    gloo_phases.check(fsdp_run, _errors_phase)
