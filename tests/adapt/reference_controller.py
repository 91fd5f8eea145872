"""The rank controller written over plain numbers: the specification that
tests/adapt/test_rank_device.py holds comera.adapt.controller.RankController
(tensors) to, on random decision sequences.

No torch here: each TT layer is the mode size of each core, each bond its
live rank count, each gate entry a Python float (its contribution).  The
rules are those of the module doc of comera/adapt/controller.py; this is the
plain greedy loop they describe, one kill or revival at a time.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# The budget reaches the target after this fraction of stage 2; the rest of
# stage 2 fine-tunes at the final ranks.
REACH_FRACTION = 0.5
# Multiplicative dual-ascent gain: lam *= exp(DUAL_GAIN * (S / S_t - 1)).
DUAL_GAIN = 0.05
LAMBDA_RANGE = (1e-3, 1e3)  # lam stays within this factor range of its start
# Deaths never take the size below S* / (1 + UNDERSHOOT): compression at
# most 3% above the target.
UNDERSHOOT = 0.03

Shapes = Sequence[Sequence[int]]    # per layer: the mode size of each core
Live = Sequence[Sequence[int]]      # per layer: live ranks per bond
Scores = List[Dict[int, float]]     # per bond: entry -> contribution


def bonds(shapes: Shapes) -> List[Tuple[int, int]]:
    """(layer, bond) of every gate, layer by layer: the order of bond indices.

    Example:
        >>> bonds([[4, 4, 4], [8, 2]])
        [(0, 0), (0, 1), (1, 0)]
    """
    return [(li, k) for li, modes in enumerate(shapes) for k in range(len(modes) - 1)]


def tt_size(shapes: Shapes, live: Live) -> int:
    """``S = sum_k r_{k-1} n_k r_k`` summed over the layers.

    Example:
        >>> tt_size([[4, 4, 4]], [[2, 3]])  # 1*4*2 + 2*4*3 + 3*4*1
        44
    """
    total = 0
    for modes, ranks in zip(shapes, live):
        full = [1] + list(ranks) + [1]
        total += sum(full[k] * n * full[k + 1] for k, n in enumerate(modes))
    return total


def rank_cost(modes: Sequence[int], ranks: Sequence[int], k: int) -> int:
    """Parameters one live rank of bond k costs (both cores it joins).

    Example:
        >>> rank_cost([4, 4, 4], [2, 3], 0), rank_cost([4, 4, 4], [2, 3], 1)
        (16, 12)
    """
    full = [1] + list(ranks) + [1]
    return full[k] * modes[k] + modes[k + 1] * full[k + 2]


@dataclass(frozen=True)
class Proposal:
    """A death the proximal step proposed: gate entry ``entry`` of bond
    ``bond`` (an index into :func:`bonds`), whose value before the step had
    absolute value ``magnitude``."""
    bond: int
    entry: int
    magnitude: float


@dataclass
class Decision:
    """(bond, entry) pairs: proposed deaths to undo, and extra deaths."""
    revive: List[Tuple[int, int]] = field(default_factory=list)
    kill: List[Tuple[int, int]] = field(default_factory=list)


class RankController:
    """Budgets, the dual variable ``lam`` and kill / revive decisions.

    Args:
        gamma: stage-1 L1 weight (the start value of ``lam``, 1e-4 if 0).
        stage1_steps, stage2_steps: lengths of the two stages, in steps.
        target_size: ``S*`` (live parameters to reach), or None.
        min_rank: no bond is taken below this many live ranks.

    Example:
        >>> ctl = RankController(gamma=1e-3, stage1_steps=0, stage2_steps=4, target_size=30.0)
        >>> shapes = [[4, 4, 4]]                  # one layer, S = 60 at ranks [3, 3]
        >>> step0 = lambda: [{0: 0.5, 1: 0.1, 2: 0.9}, {0: 0.2, 1: 0.3, 2: 0.4}]
        >>> ctl.decide(0, shapes, [[3, 3]], [], step0).kill  # budget 30 + 30 / 8: S -> 32
        [(0, 1), (1, 0)]
        >>> step1 = lambda: [{0: 0.5, 2: 0.9}, {1: 0.3, 2: 0.4}]
        >>> ctl.decide(1, shapes, [[2, 2]], [], step1).kill, ctl.frozen  # a kill lands at 20
        ([], True)
    """

    def __init__(self, *, gamma: float, stage1_steps: int, stage2_steps: int,
                 target_size: Optional[float], min_rank: int = 1):
        self.gamma = gamma
        self.stage1_steps = stage1_steps
        self.stage2_steps = stage2_steps
        self.target_size = target_size
        self.min_rank = min_rank
        self.lam = 0.0
        self.lam0 = 0.0
        self.size_start: Optional[int] = None  # S when stage 2 began
        self.frozen = False  # set once the target is reached

    def stage(self, step: int) -> int:
        """1 during the first ``stage1_steps`` steps, 2 afterwards."""
        return 1 if step < self.stage1_steps else 2

    def ranks_frozen(self, step: int) -> bool:
        """True once ranks no longer change (target reached, or stage 2 without a target)."""
        return self.frozen or (self.stage(step) == 2 and self.target_size is None)

    def penalty_weights(self, shapes: Shapes, live: Live) -> Tuple[float, List[float]]:
        """Stage 2: ``(lam, w)`` with ``w_b`` the cost of one rank of bond b
        over the mean cost, so expensive ranks feel more pressure."""
        costs = [rank_cost(shapes[li], live[li], k) for li, k in bonds(shapes)]
        mean = sum(costs) / len(costs)
        lam = self.lam if self.size_start is not None else self.gamma
        return lam, [c / mean for c in costs]

    def budget(self, t: int) -> float:
        """The size allowed after stage-2 step t (0-based): cubic from the start size to S*."""
        target = self.target_size
        reach = max(1, math.ceil(self.stage2_steps * REACH_FRACTION))
        frac = min(1.0, (t + 1) / reach)
        return target + (self.size_start - target) * (1.0 - frac) ** 3

    def decide(self, step: int, shapes: Shapes, live: Live, proposals: Sequence[Proposal],
               scores: Callable[[], Scores]) -> Decision:
        """What to change after the proximal step of ``step`` (0-based).

        ``live``: live ranks after the proximal step; ``proposals``: the
        deaths it made.  ``scores()`` gives, per bond, the contribution of
        every entry live after the step and of every proposed death (as if
        kept); it is called only when a kill is needed.  Updates ``lam``,
        ``size_start`` and ``frozen``.
        """
        decision = Decision()
        if self.target_size is None or self.frozen:
            return decision
        live = [list(r) for r in live]
        decision.revive = self._revivals(shapes, live, proposals)
        size = tt_size(shapes, live)
        if size <= self.target_size:
            self.frozen = True
            return decision
        if self.stage(step) != 2:
            return decision
        budget = self._dual_step(step, size)
        if size > budget:
            revived = set(decision.revive)
            dropped = {(p.bond, p.entry) for p in proposals} - revived
            alive = [{j: c for j, c in per.items() if (b, j) not in dropped}
                     for b, per in enumerate(scores())]
            decision.kill = self._kills(shapes, live, size, budget, alive)
        return decision

    def _dual_step(self, step: int, size: int) -> float:
        """Starts stage 2 if needed, updates ``lam``; returns this step's budget."""
        if self.size_start is None:
            self.size_start = size
            self.lam0 = self.lam = self.gamma if self.gamma > 0 else 1e-4
        budget = self.budget(step - self.stage1_steps)
        lo, hi = (self.lam0 * r for r in LAMBDA_RANGE)
        self.lam = min(hi, max(lo, self.lam * math.exp(DUAL_GAIN * (size / budget - 1.0))))
        return budget

    def _revivals(self, shapes: Shapes, live: List[List[int]],
                  proposals: Sequence[Proposal]) -> List[Tuple[int, int]]:
        """Proposed deaths to undo, largest magnitude first, while the size is
        below the floor (``live`` is updated)."""
        floor = self.target_size / (1.0 + UNDERSHOOT)
        size = tt_size(shapes, live)
        if size >= floor:
            return []
        where = bonds(shapes)
        out = []
        for p in sorted(proposals, key=lambda p: (p.magnitude, p.bond, p.entry), reverse=True):
            if size >= floor:
                break
            li, k = where[p.bond]
            size += rank_cost(shapes[li], live[li], k)
            live[li][k] += 1
            out.append((p.bond, p.entry))
        return out

    def _kills(self, shapes: Shapes, live: List[List[int]], size: int, budget: float,
               alive: Scores) -> List[Tuple[int, int]]:
        """Greedy kills of the cheapest ranks (least contribution per parameter
        saved) until size <= budget, never below the floor.  When the budget
        is the target and no allowed kill remains, takes the one kill that
        lands closest to S* if it beats stopping, then freezes."""
        target = self.target_size
        floor = target / (1.0 + UNDERSHOOT)
        final = budget <= target
        where = bonds(shapes)
        out = []
        while size > budget:
            best = None     # (score, bond, entry, cost)
            closest = None  # (|log(size'/S*)|, bond, entry, cost)
            for b, (li, k) in enumerate(where):
                if live[li][k] <= self.min_rank:
                    continue
                cost = rank_cost(shapes[li], live[li], k)
                j = min(sorted(alive[b]), key=alive[b].__getitem__)  # first smallest
                score = alive[b][j] / cost
                if size - cost >= floor:
                    if best is None or score < best[0]:
                        best = (score, b, j, cost)
                else:
                    miss = abs(math.log((size - cost) / target)) if size > cost else math.inf
                    if closest is None or miss < closest[0]:
                        closest = (miss, b, j, cost)
            if best is None:
                if not (final and closest is not None
                        and closest[0] < abs(math.log(size / target))):
                    break
                best = closest
            _, b, j, cost = best
            li, k = where[b]
            del alive[b][j]
            live[li][k] -= 1
            size -= cost
            out.append((b, j))
        if final:
            self.frozen = True
        return out
