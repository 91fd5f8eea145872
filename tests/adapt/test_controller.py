"""comera.rank_controller: the rank controller over plain numbers (no model,
no tensors).  References: sizes and rank costs worked out by hand, the cubic
budget and the dual-ascent formula written out, and small kill / revive
cases whose answer is argued in each test."""
import math
import subprocess
import sys

import pytest

from comera import rank_controller as rc
from comera.rank_controller import Proposal, RankController

SHAPES = [[4, 4, 4], [8, 2]]  # two layers: 3 cores (2 bonds) and 2 cores (1 bond)


def _ctl(target=None, **kw):
    args = dict(gamma=1e-3, stage1_steps=0, stage2_steps=4, target_size=target, min_rank=1)
    args.update(kw)
    return RankController(**args)


# ------------------------------------------------------------ sizes and costs
def test_size_and_rank_cost_by_hand():
    live = [[2, 3], [5]]
    # layer 0: 1*4*2 + 2*4*3 + 3*4*1 = 44; layer 1: 1*8*5 + 5*2*1 = 50
    assert rc.tt_size(SHAPES, live) == 94
    # one rank of bond 0 of layer 0 joins core 0 (1 x 4) and core 1 (4 x 3)
    assert rc.rank_cost(SHAPES[0], live[0], 0) == 1 * 4 + 4 * 3
    assert rc.rank_cost(SHAPES[0], live[0], 1) == 2 * 4 + 4 * 1
    assert rc.rank_cost(SHAPES[1], live[1], 0) == 8 + 2
    # the cost is what one more rank adds to the size
    for li, k in rc.bonds(SHAPES):
        more = [list(r) for r in live]
        more[li][k] += 1
        assert rc.tt_size(SHAPES, more) - rc.tt_size(SHAPES, live) == \
            rc.rank_cost(SHAPES[li], live[li], k)
    assert rc.bonds(SHAPES) == [(0, 0), (0, 1), (1, 0)]


def test_budget_is_cubic_from_the_start_size_to_the_target():
    ctl = _ctl(target=100.0, stage2_steps=10)
    ctl.size_start = 900
    reach = math.ceil(10 * rc.REACH_FRACTION)
    for t in range(12):
        frac = min(1.0, (t + 1) / reach)
        assert ctl.budget(t) == pytest.approx(100 + 800 * (1 - frac) ** 3)
    assert ctl.budget(reach - 1) == 100.0 and ctl.budget(20) == 100.0


def test_stage_and_frozen_without_a_target():
    ctl = _ctl(stage1_steps=3)
    assert [ctl.stage(s) for s in range(5)] == [1, 1, 1, 2, 2]
    assert not ctl.ranks_frozen(2) and ctl.ranks_frozen(3)  # stage 2 fine-tunes
    assert ctl.decide(5, SHAPES, [[3, 3], [4]], [], lambda: pytest.fail("no scores needed")) \
        == rc.Decision()


def test_penalty_weights_are_costs_over_their_mean():
    ctl = _ctl(target=10.0, gamma=0.2)
    live = [[2, 3], [5]]
    lam, w = ctl.penalty_weights(SHAPES, live)
    costs = [16, 12, 10]
    assert lam == 0.2  # stage 2 has not started: gamma
    assert w == pytest.approx([c / (sum(costs) / 3) for c in costs])
    ctl.size_start, ctl.lam = 500, 0.7
    assert ctl.penalty_weights(SHAPES, live)[0] == 0.7


# ---------------------------------------------------------- the dual variable
def test_dual_ascent_grows_lam_above_budget_and_clamps():
    ctl = _ctl(target=10.0, gamma=0.5, stage2_steps=100)
    shapes, live = [[4, 4, 4]], [[3, 3]]          # S = 60
    scores = [{0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}]
    ctl.decide(0, shapes, live, [], lambda: [dict(s) for s in scores])
    assert ctl.size_start == 60 and ctl.lam0 == 0.5
    budget = ctl.budget(0)
    assert ctl.lam == pytest.approx(0.5 * math.exp(rc.DUAL_GAIN * (60 / budget - 1)))
    ctl.lam = 0.5 * rc.LAMBDA_RANGE[1] * 0.999
    ctl.decide(1, shapes, live, [], lambda: [dict(s) for s in scores])
    assert ctl.lam == 0.5 * rc.LAMBDA_RANGE[1]          # clamped at the top
    zero = _ctl(target=10.0, gamma=0.0, stage2_steps=100)
    zero.decide(0, shapes, live, [], lambda: [dict(s) for s in scores])
    assert zero.lam0 == 1e-4  # gamma 0: lam starts small, not at 0


# --------------------------------------------------------------------- kills
def test_kills_take_least_contribution_per_parameter_until_the_budget():
    ctl = _ctl(target=30.0, stage2_steps=4)
    shapes = [[4, 4, 4]]                           # S = 60 at ranks [3, 3]
    scores = [{0: 0.5, 1: 0.1, 2: 0.9}, {0: 0.2, 1: 0.3, 2: 0.4}]
    d = ctl.decide(0, shapes, [[3, 3]], [], lambda: scores)
    # budget 30 + 30/8 = 33.75.  Both bonds cost 16: entry 1 of bond 0
    # (0.1/16) goes first; then bond 0 would cost 16 (28 < floor 29.1) and
    # bond 1 costs 12: its smallest entry, 0, goes (S = 32).
    assert d.kill == [(0, 1), (1, 0)] and d.revive == []
    assert not ctl.frozen
    # at the target budget no allowed kill remains and none lands closer
    # than 32 (each leaves 20): freeze with nothing killed
    d = ctl.decide(1, shapes, [[2, 2]], [], lambda: [{0: 0.5, 2: 0.9}, {1: 0.3, 2: 0.4}])
    assert d.kill == [] and ctl.frozen
    assert ctl.decide(2, shapes, [[2, 2]], [], lambda: pytest.fail("frozen")) == rc.Decision()


def test_kills_respect_min_rank_and_the_floor():
    ctl = _ctl(target=40.0, stage2_steps=1, min_rank=2)   # the budget is the target at once
    shapes = [[4, 4, 4]]
    scores = [{0: 0.1, 1: 0.2, 2: 0.3}, {0: 5.0, 1: 6.0}]
    d = ctl.decide(0, shapes, [[3, 2]], [], lambda: scores)   # S = 12 + 24 + 8 = 44
    # bond 1 is at min_rank; bond 0's rank costs 4 + 8 = 12, leaving 32 < floor
    # 38.8, |log(32/40)| = 0.22 > |log(44/40)| = 0.095: no kill, frozen
    assert d.kill == [] and ctl.frozen


def test_final_kill_lands_closest_to_the_target_when_it_beats_stopping():
    ctl = _ctl(target=50.0, stage2_steps=1)
    shapes = [[4, 4, 4]]
    scores = [{0: 0.1, 1: 0.2, 2: 0.3}, {0: 5.0, 1: 6.0, 2: 7.0}]
    # S = 12 + 36 + 12 = 60; each kill costs 16 and leaves 44 < floor 48.5,
    # but |log(44/50)| = 0.128 < |log(60/50)| = 0.182: the closest is taken
    # (bond 0, the first of the equally close ones), then the ranks freeze
    d = ctl.decide(0, shapes, [[3, 3]], [], lambda: scores)
    assert d.kill == [(0, 0)] and ctl.frozen


def test_stage1_never_kills_but_freezes_at_the_target():
    ctl = _ctl(target=50.0, stage1_steps=5)
    assert ctl.decide(0, [[4, 4, 4]], [[3, 3]], [], lambda: pytest.fail("stage 1")) \
        == rc.Decision()
    assert not ctl.frozen
    assert ctl.decide(1, [[4, 4, 4]], [[2, 2]], [], lambda: pytest.fail("at target")) \
        == rc.Decision()
    assert ctl.frozen  # S = 32 <= 50


# ------------------------------------------------------------------ revivals
def test_overshooting_deaths_are_undone_largest_first_up_to_the_floor():
    ctl = _ctl(target=40.0, stage1_steps=10)
    shapes = [[4, 4, 4]]
    # the prox step left ranks [1, 1] (S = 12) after killing four entries;
    # the floor is 40 / 1.03 = 38.8
    proposals = [Proposal(0, 1, 0.05), Proposal(0, 2, 0.30), Proposal(1, 0, 0.20),
                 Proposal(1, 2, 0.20)]
    d = ctl.decide(0, shapes, [[1, 1]], proposals, lambda: pytest.fail("stage 1"))
    # 0.30 (bond 0): S 12 -> 20; then the 0.20 tie goes to the later bond/entry,
    # (1, 2): S -> 32; then (1, 0): S -> 44 >= floor: stop
    assert d.revive == [(0, 2), (1, 2), (1, 0)]
    assert d.kill == [] and not ctl.frozen  # 44 > 40, but stage 1 does not kill


def test_no_revival_above_the_floor_and_revived_entries_can_be_killed():
    ctl = _ctl(target=30.0, stage2_steps=4)
    shapes = [[4, 4, 4]]
    # above the floor: the proposed death stands, and a dead entry is never killed again
    d = ctl.decide(0, shapes, [[3, 2]], [Proposal(1, 2, 0.9)],
                   lambda: [{0: 0.5, 1: 0.1, 2: 0.9}, {0: 0.2, 1: 0.3, 2: 0.01}])
    assert d.revive == [] and (1, 2) not in d.kill


# ---------------------------------------------------------------- no torch
def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import importlib.util\n"
            "spec = importlib.util.spec_from_file_location('rc', sys.argv[1])\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(mod.tt_size([[4, 4, 4]], [[2, 3]]))\n")
    out = subprocess.run([sys.executable, "-c", code, rc.__file__], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "44"
