"""comera.adapt.controller: the rank controller on tensors, with no model.
References: sizes and rank costs worked out by hand, the cubic budget and
the dual-ascent formula written out, and small kill / revive cases whose
answer is argued in each test.  Every decision case runs in both modes:
``sync=True`` (may read to stop early) and ``sync=False`` (no reads)."""
import math

import pytest
import torch

import comera
from comera.adapt import controller as rc
from comera.adapt.controller import RankController, TTSizes
from comera.adapt.state import ControllerState

SHAPES = [[4, 4, 4], [8, 2]]  # two layers: 3 cores (2 bonds) and 2 cores (1 bond)
CPU = torch.device("cpu")
BOTH_MODES = pytest.mark.parametrize("sync", [True, False])


def _ctl(target=None, shapes=([4, 4, 4],), **kw):
    args = dict(gamma=1e-3, stage1_steps=0, stage2_steps=4, target_size=target, min_rank=1)
    args.update(kw)
    return RankController(shapes, **args)


def _state(nb, width=3):
    return ControllerState.for_gates([torch.ones(width) for _ in range(nb)])


def _decide(ctl, state, step, live, proposals, scores, sync):
    """ctl.decide in plain terms: ``live`` ranks per bond, ``proposals``
    (bond, entry, magnitude), ``scores`` per bond {entry: contribution} or
    None where the controller must not need them (checked when ``sync``: a
    sync-free controller always evaluates them in stage 2).  Returns the
    sorted (bond, entry) lists of revivals and kills."""
    nb, width = len(live), 3
    died = torch.zeros(nb, width, dtype=torch.bool)
    magnitude = torch.zeros(nb, width, dtype=torch.float64)
    for b, j, m in proposals:
        died[b, j], magnitude[b, j] = True, m
    matrix = torch.full((nb, width), math.inf, dtype=torch.float64)
    for b, per in enumerate(scores or []):
        for j, c in per.items():
            matrix[b, j] = c

    def score_fn():
        if scores is None and sync:
            pytest.fail("scores were not needed")
        return matrix
    state.step = step
    state.tick()  # the device copy of the step, as RankAdaptive.step_begin writes it
    revive, kill = ctl.decide(state, torch.tensor(live), died, magnitude, score_fn,
                              torch.tensor(True), [width] * nb, sync=sync)
    as_pairs = lambda m: sorted(map(tuple, m.nonzero().tolist()))  # noqa: E731
    return as_pairs(revive), as_pairs(kill)


# ------------------------------------------------------------ sizes and costs
def test_size_and_rank_cost_by_hand():
    sizes = TTSizes(SHAPES, CPU)
    live = torch.tensor([2, 3, 5])
    # layer 0: 1*4*2 + 2*4*3 + 3*4*1 = 44; layer 1: 1*8*5 + 5*2*1 = 50
    assert int(sizes.size(live)) == 94
    # one rank of bond 0 of layer 0 joins core 0 (1 x 4) and core 1 (4 x 3)
    assert sizes.cost(live).tolist() == [1 * 4 + 4 * 3, 2 * 4 + 4 * 1, 8 + 2]
    # the cost is what one more rank adds to the size
    for b in range(3):
        more = live.clone()
        more[b] += 1
        assert int(sizes.size(more) - sizes.size(live)) == int(sizes.cost(live)[b])
    assert rc.bonds(SHAPES) == [(0, 0), (0, 1), (1, 0)]
    # batched: one size per row
    assert sizes.size(torch.stack([live, live + 1])).tolist() == [94, int(sizes.size(live + 1))]


def test_budget_is_cubic_from_the_start_size_to_the_target():
    ctl = _ctl(target=100.0, stage2_steps=10)
    start = torch.tensor(900.0, dtype=torch.float64)
    reach = math.ceil(10 * rc.REACH_FRACTION)
    assert ctl.reach_steps() == reach
    for t in range(12):
        frac = min(1.0, (t + 1) / reach)
        assert float(ctl.budget(t, start)) == pytest.approx(100 + 800 * (1 - frac) ** 3)
    assert float(ctl.budget(reach - 1, start)) == 100.0 and float(ctl.budget(20, start)) == 100.0


def test_stage_and_frozen_without_a_target():
    ctl = _ctl(stage1_steps=3)
    assert [ctl.stage(s) for s in range(5)] == [1, 1, 1, 2, 2]
    assert not ctl.schedule_frozen(2) and ctl.schedule_frozen(3)  # stage 2 fine-tunes
    assert _decide(ctl, _state(2), 5, [3, 3], [], None, sync=True) == ([], [])
    with_target = _ctl(target=10.0, stage1_steps=3, stage2_steps=4)   # reach: 2 steps
    assert [with_target.schedule_frozen(s) for s in range(3, 7)] == [False, False, True, True]


def test_penalty_weights_are_costs_over_their_mean():
    ctl = _ctl(target=10.0, gamma=0.2, shapes=SHAPES)
    state = _state(3)
    lam, w = ctl.penalty_weights(state, torch.tensor([2, 3, 5]))
    costs = [16, 12, 10]
    assert float(lam) == 0.2  # stage 2 has not started: gamma
    assert w.tolist() == pytest.approx([c / (sum(costs) / 3) for c in costs])
    state.started.fill_(True)
    state.lam.fill_(0.7)
    assert float(ctl.penalty_weights(state, torch.tensor([2, 3, 5]))[0]) == 0.7


# ---------------------------------------------------------- the dual variable
@BOTH_MODES
def test_dual_ascent_grows_lam_above_budget_and_clamps(sync):
    ctl = _ctl(target=10.0, gamma=0.5, stage2_steps=100)
    state = _state(2)                                   # S = 60 at ranks [3, 3]
    scores = [{0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}]
    _decide(ctl, state, 0, [3, 3], [], scores, sync)
    assert float(state.size_start) == 60 and float(state.lam0) == 0.5 and bool(state.started)
    budget = float(ctl.budget(0, state.size_start))
    assert float(state.lam) == pytest.approx(0.5 * math.exp(rc.DUAL_GAIN * (60 / budget - 1)))
    state.lam.fill_(0.5 * rc.LAMBDA_RANGE[1] * 0.999)
    _decide(ctl, state, 1, [3, 3], [], scores, sync)
    assert float(state.lam) == 0.5 * rc.LAMBDA_RANGE[1]          # clamped at the top
    zero = _ctl(target=10.0, gamma=0.0, stage2_steps=100)
    zstate = _state(2)
    _decide(zero, zstate, 0, [3, 3], [], scores, sync)
    assert float(zstate.lam0) == 1e-4  # gamma 0: lam starts small, not at 0


# --------------------------------------------------------------------- kills
@BOTH_MODES
def test_kills_take_least_contribution_per_parameter_until_the_budget(sync):
    ctl = _ctl(target=30.0, stage2_steps=4)
    state = _state(2)                              # S = 60 at ranks [3, 3]
    scores = [{0: 0.5, 1: 0.1, 2: 0.9}, {0: 0.2, 1: 0.3, 2: 0.4}]
    # budget 30 + 30/8 = 33.75.  Both bonds cost 16: entry 1 of bond 0
    # (0.1/16) goes first; then bond 0 would cost 16 (28 < floor 29.1) and
    # bond 1 costs 12: its smallest entry, 0, goes (S = 32).
    assert _decide(ctl, state, 0, [3, 3], [], scores, sync) == ([], [(0, 1), (1, 0)])
    assert not bool(state.frozen)
    # at the target budget no allowed kill remains and none lands closer
    # than 32 (each leaves 20): freeze with nothing killed
    assert _decide(ctl, state, 1, [2, 2], [], [{0: 0.5, 2: 0.9}, {1: 0.3, 2: 0.4}], sync) \
        == ([], [])
    assert bool(state.frozen)
    assert _decide(ctl, state, 2, [2, 2], [], None, sync) == ([], [])


@BOTH_MODES
def test_kills_respect_min_rank_and_the_floor(sync):
    ctl = _ctl(target=40.0, stage2_steps=1, min_rank=2)   # the budget is the target at once
    state = _state(2)
    scores = [{0: 0.1, 1: 0.2, 2: 0.3}, {0: 5.0, 1: 6.0}]
    # S = 12 + 24 + 8 = 44; bond 1 is at min_rank; bond 0's rank costs 4 + 8 = 12,
    # leaving 32 < floor 38.8, |log(32/40)| = 0.22 > |log(44/40)| = 0.095: no kill, frozen
    assert _decide(ctl, state, 0, [3, 2], [], scores, sync) == ([], [])
    assert bool(state.frozen)


@BOTH_MODES
def test_final_kill_lands_closest_to_the_target_when_it_beats_stopping(sync):
    ctl = _ctl(target=50.0, stage2_steps=1)
    state = _state(2)
    scores = [{0: 0.1, 1: 0.2, 2: 0.3}, {0: 5.0, 1: 6.0, 2: 7.0}]
    # S = 12 + 36 + 12 = 60; each kill costs 16 and leaves 44 < floor 48.5,
    # but |log(44/50)| = 0.128 < |log(60/50)| = 0.182: the closest is taken
    # (bond 0, the first of the equally close ones), then the ranks freeze
    assert _decide(ctl, state, 0, [3, 3], [], scores, sync) == ([], [(0, 0)])
    assert bool(state.frozen)


@BOTH_MODES
def test_stage1_never_kills_but_freezes_at_the_target(sync):
    ctl = _ctl(target=50.0, stage1_steps=5)
    state = _state(2)
    assert _decide(ctl, state, 0, [3, 3], [], None, sync) == ([], [])
    assert not bool(state.frozen)
    assert _decide(ctl, state, 1, [2, 2], [], None, sync) == ([], [])
    assert bool(state.frozen)  # S = 32 <= 50


# ------------------------------------------------------------------ revivals
@BOTH_MODES
def test_overshooting_deaths_are_undone_largest_first_up_to_the_floor(sync):
    ctl = _ctl(target=40.0, stage1_steps=10)
    state = _state(2)
    # the prox step left ranks [1, 1] (S = 12) after killing four entries;
    # the floor is 40 / 1.03 = 38.8
    proposals = [(0, 1, 0.05), (0, 2, 0.30), (1, 0, 0.20), (1, 2, 0.20)]
    revive, kill = _decide(ctl, state, 0, [1, 1], proposals, None, sync)
    # 0.30 (bond 0): S 12 -> 20; then the 0.20 tie goes to the later bond/entry,
    # (1, 2): S -> 32; then (1, 0): S -> 44 >= floor: stop
    assert revive == sorted([(0, 2), (1, 2), (1, 0)])
    assert kill == [] and not bool(state.frozen)  # 44 > 40, but stage 1 does not kill


@BOTH_MODES
def test_no_revival_above_the_floor_and_revived_entries_can_be_killed(sync):
    ctl = _ctl(target=30.0, stage2_steps=4)
    state = _state(2)
    # above the floor: the proposed death stands, and a dead entry is never killed again
    revive, kill = _decide(ctl, state, 0, [3, 2], [(1, 2, 0.9)],
                           [{0: 0.5, 1: 0.1, 2: 0.9}, {0: 0.2, 1: 0.3, 2: 0.01}], sync)
    assert revive == [] and (1, 2) not in kill


def test_a_nan_step_changes_nothing():
    """``ok`` False (a NaN gate): no revival, no kill, the state as it was."""
    ctl = _ctl(target=30.0, stage2_steps=4)
    state = _state(2)
    scores = torch.tensor([[0.5, 0.1, 0.9], [0.2, 0.3, 0.4]], dtype=torch.float64)
    died = torch.zeros(2, 3, dtype=torch.bool)
    revive, kill = ctl.decide(state, torch.tensor([3, 3]), died, scores, lambda: scores,
                              torch.tensor(False), [3, 3])
    assert not revive.any() and not kill.any()
    assert not bool(state.started) and not bool(state.frozen) and float(state.lam) == 0.0


# ------------------------------------------------------- kill rounds bound
@pytest.mark.parametrize("seed", range(4))
def test_kill_rounds_bound_every_kill_the_greedy_makes(seed, monkeypatch):
    """Training runs whose stage 2 kills: at every step the greedy, run
    without a bound, kills no more ranks than ``kill_rounds`` allows."""
    torch.manual_seed(seed)
    dims = [(24, 32), (48, 16), (32, 32)][seed % 3]
    model = torch.nn.Sequential(comera.TTLinear(*dims, rank=6), torch.nn.ReLU(),
                                comera.TTLinear(dims[1], dims[0], rank=6))
    seen = []
    unbounded = RankController._kills

    def spy(self, sizes, live, size, budget, alive, going, final, rounds, sync):
        full = unbounded(self, sizes, live, size, budget, alive, going, final, 10**6, True)
        seen.append((int(full.sum()), rounds))
        return unbounded(self, sizes, live, size, budget, alive, going, final, rounds, sync)
    monkeypatch.setattr(RankController, "_kills", spy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    ra = comera.RankAdaptive(model, gamma=0.02, stage1_steps=5, stage2_steps=40 + 20 * seed,
                             target_compression=6.0 + 4 * seed, sync_free=True).attach(opt)
    for _ in range(5 + 40 + 20 * seed):
        x = torch.randn(16, dims[0])
        loss = (model(x) - x.flip(1)[:, :dims[0]]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sum(k for k, _ in seen) > 0, "no step killed: the test shows nothing"
    assert all(k <= r for k, r in seen), seen
