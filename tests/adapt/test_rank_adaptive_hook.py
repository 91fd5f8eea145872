"""RankAdaptive.attach(optimizer): the optimizer-hook way of driving both
stages, against the explicit loop it stands for (``opt.step(); ra.step(opt)``),
under SGD, AdamW and Adafactor, gradient accumulation, a GradScaler that
skips a step, torch.compile, and old checkpoints.  DDP: tests/integrations/test_ddp.py."""
import copy

import pytest
import torch
from torch import nn

import comera

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}
RA = dict(gamma=0.5, threshold=1e-2, stage1_steps=8, stage2_steps=12, target_compression=30.0,
          prune_every=5)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(64, 128, rank=12), nn.Tanh(), comera.TTLinear(128, 64, rank=12))


def _batches(n, micro=1):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(16, 64, generator=g) for _ in range(micro)] for _ in range(n)]


def _train(model, opt, ra, batches, attached, scaler=None):
    for micro in batches:
        opt.zero_grad()
        for x in micro:                    # gradient accumulation over the micro-batches
            loss = (model(x) - torch.tanh(x)).pow(2).mean() / len(micro)
            loss.backward()
        opt.step()
        if not attached:
            ra.step(opt)


def _same(a, b):
    pa, pb = list(a.parameters()), list(b.parameters())
    assert len(pa) == len(pb)
    for p, q in zip(pa, pb):
        assert p.shape == q.shape and torch.equal(p, q)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("micro", [1, 3])
def test_attached_equals_the_explicit_loop(name, micro):
    """Same seeds: the hook gives bit-identical parameters, ranks and
    optimizer state to the explicit loop, with pruning and a target."""
    results = []
    for attached in (False, True):
        model = _mlp()
        opt = OPTIMIZERS[name](model.parameters())
        ra = comera.RankAdaptive(model, **RA)
        if attached:
            assert ra.attach(opt) is ra
        _train(model, opt, ra, _batches(24, micro), attached)
        assert ra.steps == 24                       # once per optimizer step, not per micro-batch
        results.append((model, ra))
    (m1, r1), (m2, r2) = results
    _same(m1, m2)
    assert r1.compression() == r2.compression() and r1.frozen and r2.frozen
    assert abs(r1.compression() / 30.0 - 1) <= 0.05
    assert m1[0].ranks == m2[0].ranks and m1[0].ranks == m1[0].live_ranks()   # pruned


def test_detach_and_misuse():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ra = comera.RankAdaptive(model, gamma=0.5, threshold=1e-2, stage1_steps=5, stage2_steps=0)
    ra.attach(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        ra.attach(opt)
    with pytest.raises(RuntimeError, match="attached to an optimizer"):
        ra.step(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        comera.RankAdaptive(_mlp(), gamma=0.5, threshold=1e-2, stage1_steps=5,
                            stage2_steps=0).attach(model)
    _train(model, opt, ra, _batches(2), attached=True)
    assert ra.steps == 2
    ra.detach()
    _train(model, opt, ra, _batches(2), attached=True)     # the hooks are gone
    assert ra.steps == 2
    ra.step(opt)                                            # by hand again
    assert ra.steps == 3


def test_grad_scaler_skipped_step_skips_the_stage_logic():
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("needs torch.amp.GradScaler")
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra = comera.RankAdaptive(model, **RA).attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.randn(16, 64)
    # a first, finite step
    opt.zero_grad()
    scaler.scale((model(x) - torch.tanh(x)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert ra.steps == 1
    gates = [g.detach().clone() for layer in (model[0], model[2]) for g in layer.gates]
    saliency = [s.clone() for s in ra.state.saliency]
    # an overflowing step: GradScaler finds inf gradients and never calls opt.step()
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert ra.steps == 1
    for g, before in zip((g for layer in (model[0], model[2]) for g in layer.gates), gates):
        assert torch.equal(g.detach(), before)
    for s, before in zip(ra.state.saliency, saliency):
        assert torch.equal(s, before)


def test_compiled_model_with_the_hook_matches_the_eager_explicit_loop():
    eager = _mlp()
    compiled_src = copy.deepcopy(eager)
    ra_kw = dict(RA, prune_every=None)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    ra_e = comera.RankAdaptive(eager, **ra_kw)
    opt_c = torch.optim.AdamW(compiled_src.parameters(), lr=1e-2)
    ra_c = comera.RankAdaptive(compiled_src, **ra_kw).attach(opt_c)
    compiled = torch.compile(compiled_src, backend="eager")
    for (x,) in _batches(12):
        for model, opt in ((eager, opt_e), (compiled, opt_c)):
            opt.zero_grad()
            (model(x) - torch.tanh(x)).pow(2).mean().backward()
            opt.step()
        ra_e.step(opt_e)
    assert ra_c.steps == 12 and ra_c.compression() == ra_e.compression()
    for p, q in zip(eager.parameters(), compiled_src.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_old_checkpoint_without_the_new_fields_loads():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra = comera.RankAdaptive(model, **dict(RA, prune_every=None)).attach(opt)
    _train(model, opt, ra, _batches(10), attached=True)
    state = ra.state_dict()
    assert "saliency" in state and state["config"]["stage2_rule"] == "saliency"
    del state["saliency"], state["config"]["stage2_rule"]          # as written before
    ra2 = comera.RankAdaptive(model, **dict(RA, prune_every=None), balance=False)
    ra2.load_state_dict(state)
    assert ra2.steps == 10 and ra2.compression() == ra.compression()
    assert all(float(s.abs().sum()) == 0 for s in ra2.state.saliency)   # starts again from zero


@pytest.mark.parametrize("rule", ["saliency", "magnitude"])
def test_both_stage2_rules_reach_the_target(rule):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra = comera.RankAdaptive(model, **RA, stage2_rule=rule).attach(opt)
    _train(model, opt, ra, _batches(24), attached=True)
    assert ra.frozen and abs(ra.compression() / 30.0 - 1) <= 0.05
    with pytest.raises(ValueError, match="stage2_rule"):
        comera.RankAdaptive(model, **RA, stage2_rule="random")


def test_saliency_is_the_running_average_of_g_times_grad():
    layer = comera.TTLinear(16, 16, rank=4, in_shape=[4, 4], out_shape=[4, 4])
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)         # lr 0: the gates do not move
    ra = comera.RankAdaptive(layer, gamma=0.0, threshold=0.0, stage1_steps=10,
                             stage2_steps=0).attach(opt)
    expect = [torch.zeros(g.shape, dtype=torch.float64) for g in layer.gates]
    for _ in range(3):
        x = torch.randn(8, 16)
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        for e, g in zip(expect, layer.gates):
            e.mul_(0.9).add_((g.detach() * g.grad).abs().double(), alpha=0.1)
        opt.step()
    for s, e in zip(ra.state.saliency, expect):
        torch.testing.assert_close(s, e)


def test_stage2_kills_the_least_salient_ranks():
    """Every stage-2 kill of the saliency rule is, within its bond, among the
    entries with the smallest saliency average: no kill without a loss-aware
    reason."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra = comera.RankAdaptive(model, **dict(RA, gamma=0.0, prune_every=None)).attach(opt)
    kills = []
    decide = ra.controller.decide

    def spy_decide(state, live, died, magnitude, scores, ok, lengths, sync=False):
        seen = {}

        def spy_scores():
            seen["s"] = scores()
            return seen["s"]
        revive, kill = decide(state, live, died, magnitude, spy_scores, ok, lengths, sync)
        if bool(kill.any()):
            s = seen["s"]
            saliency = nn.utils.rnn.pad_sequence(ra.state.saliency, batch_first=True,
                                                 padding_value=float("inf"))
            listed = torch.isfinite(s)       # the live entries and this step's deaths
            assert torch.equal(s[listed], saliency[listed])   # the scores are the saliencies
            alive = s.masked_fill(died & ~revive, float("inf"))
            for b in range(kill.shape[0]):
                if kill[b].any():
                    assert alive[b][kill[b]].max() <= alive[b][~kill[b]].min()
            kills.extend(kill.nonzero().tolist())
        return revive, kill

    ra.controller.decide = spy_decide
    _train(model, opt, ra, _batches(24), attached=True)
    assert len(kills) > 10 and ra.frozen
