"""The rank controller of :class:`comera.RankAdaptive`, on tensors
(docs/design.md section 4).

One implementation for the CPU and CUDA: the controller reads its inputs
(live ranks per bond, this step's proposed deaths, each entry's
contribution) and its state (:class:`comera.adapt.state.ControllerState`:
``lam``, the size at the start of stage 2, ``frozen``) as tensors and
answers with tensors.  With ``sync=False`` nothing here reads a device
value back, so on CUDA a step never waits for the GPU and can be captured
in a CUDA graph; with ``sync=True`` the same arithmetic may read the device
to stop its loops early (cheaper where a read costs nothing, as on the CPU).
Both give the same decisions (tests/adapt/test_rank_device.py).  What the
host knows without looking: the step counter, hence the stage and the
budget's schedule.

Sizes: a layer with mode sizes ``n_1..n_D`` and live ranks ``r_1..r_{D-1}``
holds ``S = sum_k r_{k-1} n_k r_k`` parameters (``r_0 = r_D = 1``); one live
rank of bond k costs ``r_{k-1} n_k + n_{k+1} r_{k+1}`` of them.

Stage 2 with a target size ``S*``:

* the budget ``S_t`` falls from the size at the start of stage 2 to ``S*``
  along a cubic schedule over the first ``REACH_FRACTION`` of stage 2;
* the penalty weight ``lam`` follows multiplicative dual ascent on
  ``S / S_t - 1``, within ``LAMBDA_RANGE`` times its start value;
* whenever ``S > S_t`` the cheapest ranks die: smallest contribution per
  parameter saved, never taking ``S`` below the floor ``S* / (1 + UNDERSHOOT)``;
* deaths the proximal step proposed are undone (largest gate magnitude
  before the step first) while ``S`` is below the floor;
* once ``S <= S*`` (or no kill can bring it closer) the ranks freeze.

Layout: bonds (one per gate) in the order of :func:`bonds`; where a matrix
over (bond, entry) is needed, each bond's gate is padded to the longest.
"""
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from comera.adapt.state import ControllerState

# The budget reaches the target after this fraction of stage 2; the rest of
# stage 2 fine-tunes at the final ranks.
REACH_FRACTION = 0.5
# Multiplicative dual-ascent gain: lam *= exp(DUAL_GAIN * (S / S_t - 1)).
DUAL_GAIN = 0.05
LAMBDA_RANGE = (1e-3, 1e3)  # lam stays within this factor range of its start
# Deaths never take the size below S* / (1 + UNDERSHOOT): compression at
# most 3% above the target.
UNDERSHOOT = 0.03
INF = float("inf")

Shapes = Sequence[Sequence[int]]    # per layer: the mode size of each core


def bonds(shapes: Shapes) -> List[Tuple[int, int]]:
    """(layer, bond) of every gate, layer by layer: the order of bond indices.

    Example:
        >>> bonds([[4, 4, 4], [8, 2]])
        [(0, 0), (0, 1), (1, 0)]
    """
    return [(li, k) for li, modes in enumerate(shapes) for k in range(len(modes) - 1)]


def _layer_ranks(shapes: Shapes, live: Sequence[int]) -> List[List[int]]:
    """Per layer, its ranks with the outer 1s, from the per-bond ranks."""
    out, at = [], 0
    for modes in shapes:
        out.append([1, *live[at:at + len(modes) - 1], 1])
        at += len(modes) - 1
    return out


def _tt_size(shapes: Shapes, live: Sequence[int]) -> int:
    """:meth:`TTSizes.size` in plain Python."""
    return sum(r[k] * n * r[k + 1] for modes, r in zip(shapes, _layer_ranks(shapes, live))
               for k, n in enumerate(modes))


def _rank_costs(shapes: Shapes, live: Sequence[int]) -> List[int]:
    """:meth:`TTSizes.cost` in plain Python."""
    return [r[k] * modes[k] + modes[k + 1] * r[k + 2]
            for modes, r in zip(shapes, _layer_ranks(shapes, live)) for k in range(len(modes) - 1)]


class TTSizes:
    """The parameter count of TT layers as a function of their live ranks.

    Args:
        shapes: per layer, the mode size of each core.
        device: where the index tensors (and so the answers) live.

    Example:
        >>> import torch
        >>> sizes = TTSizes([[4, 4, 4]], torch.device("cpu"))
        >>> live = torch.tensor([2, 3])
        >>> int(sizes.size(live)), sizes.cost(live).tolist()  # 1*4*2 + 2*4*3 + 3*4*1
        (44, [16, 12])
    """

    def __init__(self, shapes: Shapes, device: torch.device):
        where = bonds(shapes)
        nb = len(where)
        # per core: its left and right bond (nb: the constant rank 1 at either end)
        left, right, modes, first = [], [], [], []
        for li, m in enumerate(shapes):
            first.append(len(modes))
            base = sum(len(s) - 1 for s in shapes[:li])
            for k, n in enumerate(m):
                left.append(base + k - 1 if k > 0 else nb)
                right.append(base + k if k < len(m) - 1 else nb)
                modes.append(n)
        # per bond (layer li, bond k): cost = r_left(core k) n_k + n_{k+1} r_right(core k+1)
        core = [first[li] + k for li, k in where]

        def as_long(values):
            return torch.tensor(values, dtype=torch.int64, device=device)
        self._left, self._right, self._modes = as_long(left), as_long(right), as_long(modes)
        self._cost_l, self._n_l = as_long([left[c] for c in core]), as_long([modes[c] for c in core])
        self._cost_r = as_long([right[c + 1] for c in core])
        self._n_r = as_long([modes[c + 1] for c in core])
        self.bond_ids = torch.arange(nb, device=device)

    def _ext(self, live: torch.Tensor) -> torch.Tensor:
        """Live ranks with a trailing 1 (the outer ranks), along the last dimension."""
        return torch.cat([live, torch.ones_like(live[..., :1])], dim=-1)

    def size(self, live: torch.Tensor) -> torch.Tensor:
        """``S = sum_k r_{k-1} n_k r_k`` over all layers; ``live``: (..., bonds) int64."""
        ext = self._ext(live)
        return (ext.index_select(-1, self._left) * self._modes
                * ext.index_select(-1, self._right)).sum(-1)

    def cost(self, live: torch.Tensor) -> torch.Tensor:
        """Parameters one live rank of each bond costs (both cores it joins)."""
        ext = self._ext(live)
        return (ext.index_select(-1, self._cost_l) * self._n_l
                + self._n_r * ext.index_select(-1, self._cost_r))


class RankController:
    """Budgets, the dual variable ``lam`` and kill / revive decisions.

    Args:
        shapes: per layer, the mode size of each core.
        gamma: stage-1 L1 weight (the start value of ``lam``, 1e-4 if 0).
        stage1_steps, stage2_steps: lengths of the two stages, in steps.
        target_size: ``S*`` (live parameters to reach), or None.
        min_rank: no bond is taken below this many live ranks.

    Example:
        >>> import torch
        >>> from comera.adapt.state import ControllerState
        >>> ctl = RankController([[4, 4, 4]], gamma=1e-3, stage1_steps=0, stage2_steps=4,
        ...                      target_size=30.0)
        >>> state = ControllerState.for_gates([torch.ones(3), torch.ones(3)])
        >>> live = torch.tensor([3, 3])                        # S = 60
        >>> scores = torch.tensor([[0.5, 0.1, 0.9], [0.2, 0.3, 0.4]], dtype=torch.float64)
        >>> none = torch.zeros(2, 3, dtype=torch.bool)
        >>> revive, kill = ctl.decide(state, live, none, scores, lambda: scores,
        ...                           torch.tensor(True), lengths=[3, 3])
        >>> kill.nonzero().tolist()                            # budget 33.75: S -> 32
        [[0, 1], [1, 0]]
    """

    def __init__(self, shapes: Shapes, *, gamma: float, stage1_steps: int, stage2_steps: int,
                 target_size: Optional[float], min_rank: int = 1):
        self.shapes = [list(m) for m in shapes]
        self.gamma = gamma
        self.stage1_steps = stage1_steps
        self.stage2_steps = stage2_steps
        self.target_size = target_size
        self.min_rank = min_rank
        self._sizes: Dict[torch.device, TTSizes] = {}
        self._extremes: Dict[Tuple[int, ...], Tuple[float, float, float]] = {}

    def sizes(self, device: torch.device) -> TTSizes:
        """The size formulas on ``device`` (built once per device)."""
        if device not in self._sizes:
            self._sizes[device] = TTSizes(self.shapes, device)
        return self._sizes[device]

    # ------------------------------------------------------------ schedule
    def stage(self, step: int) -> int:
        """1 during the first ``stage1_steps`` steps, 2 afterwards."""
        return 1 if step < self.stage1_steps else 2

    def reach_steps(self) -> int:
        """Stage-2 steps after which the budget equals the target."""
        return max(1, math.ceil(self.stage2_steps * REACH_FRACTION))

    def schedule_frozen(self, step: int) -> bool:
        """True when the ranks are frozen at ``step`` whatever the gates hold:
        stage 2 without a target, or past the step where the budget reached
        the target (the controller froze there at the latest)."""
        return self.stage(step) == 2 and (
            self.target_size is None or step - self.stage1_steps >= self.reach_steps())

    def kill_rounds(self, step: int, lengths: Sequence[int]) -> int:
        """The masked kill rounds of step ``step`` (:meth:`_kills`): a bound,
        known on the host, on the kills the greedy can make, rounded up to a
        power of two (a captured step then changes rarely), and at most every
        entry that could die (``lengths``: each bond's gate length); 0 where
        no kill loop runs (no target, stage 1).

        Every kill removes at least ``c_min`` parameters (a rank of the
        cheapest bond, every other rank at ``min_rank``), and the kills stop
        within the budget.  A step starts at most at the previous budget, or,
        when kills were blocked there, within the dearest rank ``c_max`` of
        the floor; the budget then falls by at most ``S_max - S*`` times the
        schedule's drop (``S_max``: the size with every gate entry live).

        Example:
            >>> ctl = RankController([[16, 16, 16, 16]], gamma=1e-3, stage1_steps=0,
            ...                      stage2_steps=100, target_size=500.0)
            >>> ctl.kill_rounds(0, [16, 16, 16]), ctl.kill_rounds(20, [16, 16, 16])  # of 45
            (45, 32)
        """
        total = sum(max(0, n - self.min_rank) for n in lengths)
        if self.target_size is None or self.stage(step) != 2 or not total:
            return 0  # no kill loop runs
        s_max, c_min, c_max = self._size_extremes(lengths)
        t, reach = step - self.stage1_steps, self.reach_steps()
        left = [(1.0 - min(1.0, max(0, u + 1) / reach)) ** 3 for u in (t - 1, t)]
        drop = max(0.0, s_max - self.target_size) * max(0.0, left[0] - left[1])
        rounds = math.ceil(drop / c_min) + math.ceil(c_max / c_min) + 2
        return min(total, 1 << (rounds - 1).bit_length())

    def _size_extremes(self, lengths: Sequence[int]) -> Tuple[float, float, float]:
        """``(S_max, c_min, c_max)`` for these gate lengths (plain Python: the
        host never touches a tensor here; kept per lengths)."""
        key = tuple(lengths)
        if key not in self._extremes:
            full = list(key)
            least = [min(n, self.min_rank) for n in full]
            dying = [i for i, n in enumerate(full) if n > self.min_rank]
            self._extremes[key] = (float(_tt_size(self.shapes, full)),
                                   float(min(_rank_costs(self.shapes, least)[i] for i in dying)),
                                   float(max(_rank_costs(self.shapes, full))))
        return self._extremes[key]

    def budget(self, t, size_start: torch.Tensor) -> torch.Tensor:
        """The size allowed after stage-2 step t (0-based; an int, or a tensor
        on the device): cubic from the start size to S*."""
        target = self.target_size
        frac = (t + 1) / self.reach_steps()
        frac = frac.clamp(max=1.0) if isinstance(frac, torch.Tensor) else min(1.0, frac)
        return target + (size_start - target) * (1.0 - frac) ** 3

    def penalty_weights(self, state: ControllerState,
                        live: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stage 2: ``(lam, w)`` with ``w_b`` the cost of one rank of bond b
        over the mean cost, so expensive ranks feel more pressure; ``lam`` is
        ``gamma`` until the stage-2 controller starts."""
        costs = self.sizes(live.device).cost(live).double()
        lam = torch.where(state.started, state.lam, state.lam.new_full((), self.gamma))
        return lam, costs / (costs.sum() / costs.numel())

    # ----------------------------------------------------------- decisions
    def decide(self, state: ControllerState, live: torch.Tensor, died: torch.Tensor,
               magnitude: torch.Tensor, scores: Callable[[], torch.Tensor], ok: torch.Tensor,
               lengths: Sequence[int], sync: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """What to change after the proximal step of ``state.step``: returns
        (revive, kill) masks over (bond, entry), and updates ``state``
        (``lam``, the start size, ``frozen``).

        ``live``: live ranks per bond after the proximal step; ``died``: its
        proposed deaths, ``magnitude`` their ``|g|`` before the step;
        ``scores()`` (stage 2, when a kill may be needed): each entry's
        contribution, ``inf`` where the entry is neither live nor a proposed
        death; ``ok``: False makes the whole step a no-op (a NaN gate);
        ``lengths``: each bond's gate length (bounds the number of kills);
        ``sync``: may read the device to stop early (module doc).
        """
        target = self.target_size
        if target is None:  # nothing to reach: the kernel's deaths stand
            return torch.zeros_like(died), torch.zeros_like(died)
        sizes = self.sizes(live.device)
        active = ok & ~state.frozen
        revive = self._revivals(sizes, live, died, magnitude, sync) & active
        live = live + revive.sum(1)
        size = sizes.size(live)
        reached = active & (size.double() <= target)
        state.frozen |= reached
        active = active & ~reached
        kill = torch.zeros_like(died)
        if self.stage(state.step) != 2:
            return revive, kill
        budget = self._dual_step(state, size, active)
        need = active & (size.double() > budget)
        if sync and not bool(need):
            return revive, kill
        final = budget <= target
        alive = scores().masked_fill(died & ~revive, INF)
        rounds = self.kill_rounds(state.step, lengths)
        kill = self._kills(sizes, live, size, budget, alive, need, final, rounds, sync)
        state.frozen |= need & final
        return revive, kill

    def _dual_step(self, state: ControllerState, size: torch.Tensor,
                   active: torch.Tensor) -> torch.Tensor:
        """Starts stage 2 where needed, updates ``lam`` (both where ``active``);
        returns this step's budget."""
        start = self.gamma if self.gamma > 0 else 1e-4
        begin = active & ~state.started
        state.size_start.copy_(torch.where(begin, size.double(), state.size_start))
        state.lam0.copy_(torch.where(begin, state.lam0.new_full((), start), state.lam0))
        state.lam.copy_(torch.where(begin, state.lam0, state.lam))
        state.started |= active
        # the device's copy of the step: a captured step must not bake it in
        budget = self.budget(state.clock - self.stage1_steps, state.size_start)
        lo, hi = (state.lam0 * r for r in LAMBDA_RANGE)
        lam = torch.minimum(hi, torch.maximum(lo, state.lam * torch.exp(
            DUAL_GAIN * (size.double() / budget - 1.0))))
        state.lam.copy_(torch.where(active, lam, state.lam))
        return budget

    def _revivals(self, sizes: TTSizes, live: torch.Tensor, died: torch.Tensor,
                  magnitude: torch.Tensor, sync: bool) -> torch.Tensor:
        """Proposed deaths to undo, largest magnitude first (ties: larger bond,
        then larger entry, first), while the size is below the floor.  The
        size after each candidate prefix is computed at once, since reviving
        a rank of bond b adds exactly the cost of bond b at the ranks then."""
        floor = self.target_size / (1.0 + UNDERSHOOT)
        nb, width = died.shape
        n = nb * width
        keys = torch.where(died, magnitude, -INF).flatten().flip(0)  # flat index descending
        _, pos = torch.sort(keys, descending=True, stable=True)
        order = (n - 1) - pos
        if sync:  # the proposed deaths sort first: only they can be revived
            order = order[:int(died.sum())]
        is_prop = died.flatten().index_select(0, order)
        bond = torch.div(order, width, rounding_mode="floor")
        inc = ((bond[:, None] == sizes.bond_ids[None, :]) & is_prop[:, None]).long()
        before = sizes.size(live[None, :] + inc.cumsum(0) - inc)  # the size before each candidate
        take = is_prop & (before.double() < floor)
        return torch.zeros(n, dtype=torch.bool, device=died.device).scatter(
            0, order, take).view(nb, width)

    def _kills(self, sizes: TTSizes, live, size, budget, alive, going, final, rounds: int,
               sync: bool) -> torch.Tensor:
        """Greedy kills of the cheapest ranks (least contribution per parameter
        saved) until ``size <= budget``, never below the floor.  When the
        budget is the target and no allowed kill remains, takes the one kill
        that lands closest to S* if it beats stopping.  A fixed number of
        masked rounds (one kill or none each; :meth:`kill_rounds`, a bound on
        the kills), so no round asks the host whether to go on unless ``sync``."""
        target, floor = self.target_size, self.target_size / (1.0 + UNDERSHOOT)
        kill = torch.zeros(alive.shape, dtype=torch.bool, device=alive.device)
        entries = torch.arange(alive.shape[1], device=alive.device)
        for _ in range(rounds):
            cost = sizes.cost(live)
            low, arg = alive.min(dim=1)  # first smallest contribution per bond
            elig = live > self.min_rank
            after = size - cost
            allowed = elig & (after.double() >= floor)
            best = torch.where(allowed, low / cost.double(), INF).argmin()
            miss = torch.where(after > 0, (after.double() / target).log().abs(), INF)
            miss = torch.where(elig & ~allowed, miss, INF)
            closest = miss.argmin()
            use_closest = final & (miss.min() < (size.double() / target).log().abs())
            going = going & (size.double() > budget) & (allowed.any() | use_closest)
            if sync and not bool(going):
                break
            hit = (sizes.bond_ids == torch.where(allowed.any(), best, closest)) & going
            cell = hit[:, None] & (entries == (arg * hit).sum())[None, :]
            kill |= cell
            alive = alive.masked_fill(cell, INF)
            size = size - (cost * hit).sum()
            live = live - hit.long()
        return kill
