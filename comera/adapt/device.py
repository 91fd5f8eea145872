"""Rank adaptation without host synchronisation (docs/design.md section 4).

:class:`DeviceController` holds the state of
:class:`comera.adapt.controller.RankController` (``lam``, ``lam0``, the size
at the start of stage 2, ``frozen``) as tensors on the gates' device and
takes its per-step decisions with tensor operations only: nothing here reads
a device value back to the host, so on CUDA a step of
:class:`comera.RankAdaptive` never waits for the GPU and can be captured in
a CUDA graph.  The torch-free controller stays the specification; the tests
hold the two equal (same kills, same revivals, same ``lam``).

What the host still knows without looking: the step counter, hence the
stage and the budget's schedule coefficient; and that the ranks are frozen
from the stage-2 step where the budget reaches the target on (the
controller freezes there at the latest).  Everything that depends on gate
values (live ranks, sizes, ``lam``, ``frozen``, the choice of ranks) is a
tensor.

Layout: bonds in the order of :func:`comera.adapt.controller.bonds`; where a
matrix over (bond, entry) is needed, each bond's gate is padded to the
longest gate ``L``.
"""
import math
from typing import Callable, List, Sequence, Tuple

import torch

from comera.ops.gate_prox import gate_prox_
from comera.adapt.controller import (DUAL_GAIN, LAMBDA_RANGE, REACH_FRACTION, UNDERSHOOT,
                                    RankController, bonds)

INF = float("inf")


def reach_steps(stage2_steps: int) -> int:
    """Stage-2 steps after which the budget equals the target (as in
    :meth:`RankController.budget`): the ranks are frozen from then on."""
    return max(1, math.ceil(stage2_steps * REACH_FRACTION))


def pad_rows(rows: Sequence[torch.Tensor], width: int, value) -> torch.Tensor:
    """Stacks 1-D tensors into a (len(rows), width) matrix, filling with ``value``."""
    return torch.stack([torch.cat([r, r.new_full((width - r.numel(),), value)]) for r in rows])


class DeviceController:
    """The per-step decisions of :class:`RankController` on tensors.

    Args:
        ctl: the host controller: its constants (``gamma``, stage lengths,
            target, ``min_rank``) and, at construction, its state.
        shapes: per layer, the mode size of each core.
        device: where the state and the decisions live.

    Example:
        >>> import torch
        >>> from comera.adapt.controller import RankController
        >>> ctl = RankController(gamma=1e-3, stage1_steps=0, stage2_steps=4, target_size=30.0)
        >>> dc = DeviceController(ctl, [[4, 4, 4]], torch.device("cpu"))
        >>> live = torch.tensor([3, 3])
        >>> int(dc.size(live)), dc.cost(live).tolist()   # 4*3 + 3*4*3 + 3*4
        (60, [16, 16])
        >>> scores = torch.tensor([[0.5, 0.1, 0.9], [0.2, 0.3, 0.4]], dtype=torch.float64)
        >>> none = torch.zeros(2, 3, dtype=torch.bool)
        >>> revive, kill = dc.decide(0, live, none, scores, lambda: scores, torch.tensor(True),
        ...                          lengths=[3, 3])
        >>> kill.nonzero().tolist()           # as RankController.decide: (0, 1) and (1, 0)
        [[0, 1], [1, 0]]
    """

    def __init__(self, ctl: RankController, shapes: Sequence[Sequence[int]],
                 device: torch.device):
        self.ctl, self.device = ctl, device
        where = bonds(shapes)
        self.num_bonds = nb = len(where)
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
        as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        self._left, self._right, self._modes = as_long(left), as_long(right), as_long(modes)
        self._cost_l = as_long([left[c] for c in core])
        self._n_l = as_long([modes[c] for c in core])
        self._cost_r = as_long([right[c + 1] for c in core])
        self._n_r = as_long([modes[c + 1] for c in core])
        self._bond_ids = torch.arange(nb, device=device)
        f64 = dict(dtype=torch.float64, device=device)
        self.lam = torch.zeros((), **f64)
        self.lam0 = torch.zeros((), **f64)
        self.size_start = torch.zeros((), **f64)
        self.started = torch.zeros((), dtype=torch.bool, device=device)
        self.frozen = torch.zeros((), dtype=torch.bool, device=device)
        # the first NaN a step met, per gate (raised later, at a point that syncs anyway)
        self.nan_seen = torch.zeros((), dtype=torch.bool, device=device)
        self.nan_gates = torch.zeros(nb, dtype=torch.bool, device=device)
        self.push(ctl)

    # ------------------------------------------------------ host <-> device
    def push(self, ctl: RankController) -> None:
        """Loads the host controller's state (fills in place: no copy, no wait)."""
        self.lam.fill_(ctl.lam)
        self.lam0.fill_(ctl.lam0)
        self.started.fill_(ctl.size_start is not None)
        self.size_start.fill_(0.0 if ctl.size_start is None else float(ctl.size_start))
        self.frozen.fill_(bool(ctl.frozen))

    def pull(self, ctl: RankController) -> None:
        """Writes the state into the host controller (reads the device: syncs)."""
        ctl.lam, ctl.lam0 = float(self.lam), float(self.lam0)
        ctl.size_start = round(float(self.size_start)) if bool(self.started) else None
        ctl.frozen = bool(self.frozen)

    def note_nan(self, bad: torch.Tensor) -> None:
        """Records ``bad`` (per gate: holds a NaN) if it is the first NaN seen."""
        first = bad.any() & ~self.nan_seen
        self.nan_gates.copy_(torch.where(first, bad, self.nan_gates))
        self.nan_seen.copy_(self.nan_seen | first)

    # ------------------------------------------------------------- sizes
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

    def penalty_weights(self, live: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`RankController.penalty_weights`: ``(lam, w)``, tensors."""
        costs = self.cost(live).double()
        lam = torch.where(self.started, self.lam, self.lam.new_full((), self.ctl.gamma))
        return lam, costs / (costs.sum() / costs.numel())

    # --------------------------------------------------------- decisions
    def decide(self, step: int, live: torch.Tensor, died: torch.Tensor,
               magnitude: torch.Tensor, scores: Callable[[], torch.Tensor],
               ok: torch.Tensor, lengths: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`RankController.decide` on tensors: returns (revive, kill)
        masks over (bond, entry).

        ``live``: live ranks per bond after the proximal step; ``died``: its
        proposed deaths, ``magnitude`` their ``|g|`` before the step;
        ``scores()`` (called in stage 2 only): each entry's contribution,
        ``inf`` where the entry is neither live nor a proposed death; ``ok``:
        False makes the whole step a no-op (a NaN gate); ``lengths``: each
        bond's gate length (bounds the number of kills).
        """
        ctl = self.ctl
        target = ctl.target_size
        active = ok & ~self.frozen
        revive = self._revivals(live, died, magnitude) & active
        live = live + revive.sum(1)
        size = self.size(live)
        reached = active & (size.double() <= target)
        self.frozen.copy_(self.frozen | reached)
        active = active & ~reached
        kill = torch.zeros_like(died)
        if ctl.stage(step) != 2:
            return revive, kill
        budget = self._dual_step(step, size, active)
        final = budget <= target
        need = active & (size.double() > budget)
        alive = scores().masked_fill(died & ~revive, INF)
        rounds = sum(max(0, n - ctl.min_rank) for n in lengths)
        kill = self._kills(live, size, budget, alive, need, final, rounds)
        self.frozen.copy_(self.frozen | (need & final))
        return revive, kill

    def _dual_step(self, step: int, size: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Starts stage 2 where needed, updates ``lam`` (both where ``active``);
        returns this step's budget."""
        start = self.ctl.gamma if self.ctl.gamma > 0 else 1e-4
        begin = active & ~self.started
        self.size_start.copy_(torch.where(begin, size.double(), self.size_start))
        self.lam0.copy_(torch.where(begin, self.lam0.new_full((), start), self.lam0))
        self.lam.copy_(torch.where(begin, self.lam0, self.lam))
        self.started.copy_(self.started | active)
        target = self.ctl.target_size
        frac = min(1.0, (step - self.ctl.stage1_steps + 1) / reach_steps(self.ctl.stage2_steps))
        budget = target + (self.size_start - target) * (1.0 - frac) ** 3
        lo, hi = (self.lam0 * r for r in LAMBDA_RANGE)
        lam = torch.minimum(hi, torch.maximum(lo, self.lam * torch.exp(
            DUAL_GAIN * (size.double() / budget - 1.0))))
        self.lam.copy_(torch.where(active, lam, self.lam))
        return budget

    def _revivals(self, live: torch.Tensor, died: torch.Tensor,
                  magnitude: torch.Tensor) -> torch.Tensor:
        """Proposed deaths to undo, largest magnitude first (ties: larger bond,
        then larger entry, first), while the size is below the floor.  The
        size after each candidate prefix is computed at once, since reviving
        a rank of bond b adds exactly the cost of bond b at the ranks then."""
        floor = self.ctl.target_size / (1.0 + UNDERSHOOT)
        nb, width = died.shape
        n = nb * width
        keys = torch.where(died, magnitude, -INF).flatten().flip(0)  # flat index descending
        _, pos = torch.sort(keys, descending=True, stable=True)
        order = (n - 1) - pos
        is_prop = died.flatten().index_select(0, order)
        bond = torch.div(order, width, rounding_mode="floor")
        inc = ((bond[:, None] == self._bond_ids[None, :]) & is_prop[:, None]).long()
        sizes = self.size(live[None, :] + inc.cumsum(0) - inc)  # before each candidate
        take = is_prop & (sizes.double() < floor)
        return torch.zeros(n, dtype=torch.bool, device=died.device).scatter(
            0, order, take).view(nb, width)

    def _kills(self, live, size, budget, alive, going, final, rounds: int) -> torch.Tensor:
        """:meth:`RankController._kills` as a fixed number of masked greedy
        rounds (one kill or none each; as many rounds as entries could ever
        die), so no round asks the host whether to go on."""
        ctl = self.ctl
        target, floor = ctl.target_size, ctl.target_size / (1.0 + UNDERSHOOT)
        kill = torch.zeros(alive.shape, dtype=torch.bool, device=alive.device)
        entries = torch.arange(alive.shape[1], device=alive.device)
        for _ in range(rounds):
            cost = self.cost(live)
            low, arg = alive.min(dim=1)  # first smallest contribution per bond
            elig = live > ctl.min_rank
            after = size - cost
            allowed = elig & (after.double() >= floor)
            best = torch.where(allowed, low / cost.double(), INF).argmin()
            miss = torch.where(after > 0, (after.double() / target).log().abs(), INF)
            miss = torch.where(elig & ~allowed, miss, INF)
            closest = miss.argmin()
            use_closest = final & (miss.min() < (size.double() / target).log().abs())
            going = going & (size.double() > budget) & (allowed.any() | use_closest)
            hit = (self._bond_ids == torch.where(allowed.any(), best, closest)) & going
            cell = hit[:, None] & (entries == (arg * hit).sum())[None, :]
            kill |= cell
            alive = alive.masked_fill(cell, INF)
            size = size - (cost * hit).sum()
            live = live - hit.long()
        return kill


# ------------------------------------------------------- the step of RankAdaptive
def shrink_(g: torch.Tensor, sign: torch.Tensor, amount, min_rank: int,
            keep: torch.Tensor) -> None:
    """The decoupled L1 step of ``RankAdaptive._shrink`` on one gate, without
    host reads: ``g <- sign(g) max(|g| - amount, 0)`` over the live entries
    (dead ones are re-zeroed); if fewer than ``min(min_rank, live)`` entries
    stay non-zero, the largest live ones keep their value.  Where ``keep``
    (a bool tensor) is False the gate is left as it is."""
    old = torch.where(sign != 0, g, torch.zeros_like(g))
    new = old.sign() * (old.abs() - amount).clamp_min(0)
    k = min(min_rank, g.numel())
    need = torch.count_nonzero(old).clamp_max(min_rank)
    short = torch.count_nonzero(new) < need
    top = torch.topk(old.abs(), k).indices
    rescue = torch.zeros_like(sign, dtype=torch.bool).scatter(
        0, top, (torch.arange(k, device=g.device) < need) & short)
    new = torch.where(rescue & (new == 0), old, new)
    g.copy_(torch.where(keep, new, g))


def frozen_prox_(g: torch.Tensor, sign: torch.Tensor, g0: torch.Tensor, s0: torch.Tensor,
                 where: torch.Tensor) -> None:
    """Where ``where``: the proximal step without kills (``kill=False``)
    applied to the values before the step (``g0``, ``s0``): dead entries
    re-zeroed, live ones keep their value and take its sign if non-zero."""
    now = g0.sign().to(torch.int8)
    g.copy_(torch.where(where, torch.where(s0 == 0, torch.zeros_like(g0), g0), g))
    sign.copy_(torch.where(where, torch.where((s0 != 0) & (now != 0), now, s0), sign))


@torch.no_grad()
def device_step(ra, optimizer) -> None:
    """The gate step of :class:`comera.RankAdaptive` (saliency, shrink,
    proximal kill step, controller review) with no host reads: the stage
    comes from the host's step counter, everything value-dependent stays a
    tensor.  A NaN gate makes the step a no-op and is recorded for
    ``ra.check()`` (the next prune step calls it)."""
    gates, signs, ctl, step = ra._gates(), ra._signs, ra._ctl, ra._step
    dc = ra._device_ctl(gates[0].device)
    target = ctl.target_size
    stage2 = ctl.stage(step) == 2
    done = stage2 and (target is None or step - ctl.stage1_steps >= reach_steps(ctl.stage2_steps))
    if done and target is not None:  # the controller froze at the latest when the budget hit S*
        dc.frozen.fill_(True)
    bad = torch.stack([torch.isnan(g).any() for g in gates])
    ok = ~bad.any()
    dc.note_nan(bad)
    for g, sal in zip(gates, ra._saliency):
        if g.grad is not None and g.grad.shape == g.shape:
            new = sal * ra._saliency_decay
            new.add_((g.detach() * g.grad).abs().double(), alpha=1.0 - ra._saliency_decay)
            sal.copy_(torch.where(ok, new, sal))
    kill = not done
    review = kill and target is not None and dc.num_bonds > 0
    before = [g.detach().clone() for g in gates] if review else None
    signs_before = [s.clone() for s in signs] if review else None
    frozen0 = dc.frozen.clone() if review else torch.zeros_like(ok)
    if kill:
        _shrink_all(ra, dc, gates, optimizer, stage2, ok & ~frozen0)
    gate_prox_([g.data for g in gates], signs, ra.threshold, ra.min_rank, kill)
    if review:
        _review(ra, dc, gates, before, signs_before, frozen0 & ok, ok)


def _shrink_all(ra, dc, gates, optimizer, stage2: bool, keep: torch.Tensor) -> None:
    """Stage 1: strength ``gamma``; stage 2: ``lam * w_b`` (tensors), each times its lr."""
    if stage2:
        lam, weights = dc.penalty_weights(torch.stack([torch.count_nonzero(s) for s in ra._signs]))
    elif ra.gamma <= 0:
        return
    for b, (g, sign, lr) in enumerate(zip(gates, ra._signs, ra._group_lrs(optimizer, gates))):
        if lr is None or g.numel() == 0:
            continue
        strength = lam * weights[b] if stage2 else ra.gamma
        shrink_(g.data, sign, lr * strength, ra.min_rank, keep)


def _review(ra, dc, gates, before, signs_before, frozen, ok) -> None:
    """Undoes the kernel's kills where the ranks were frozen, then asks the
    controller and writes its revivals and kills into gates and signs."""
    signs = ra._signs
    for g, s, g0, s0 in zip(gates, signs, before, signs_before):
        frozen_prox_(g.data, s, g0, s0, frozen)
    lengths = [g.numel() for g in gates]
    width = max(lengths)
    died = [(s0 != 0) & (s == 0) & (g0 != 0) for s0, s, g0 in zip(signs_before, signs, before)]
    live = torch.stack([torch.count_nonzero(s) for s in signs])

    def scores() -> torch.Tensor:
        rows = []
        for b, contrib in enumerate(_contributions(ra, before, died)):
            rows.append(torch.where((signs[b] != 0) | died[b], contrib, INF))
        return pad_rows(rows, width, INF)

    revive, kill = dc.decide(ra._step, live, pad_rows(died, width, False),
                             pad_rows([g0.abs().double() for g0 in before], width, 0.0),
                             scores, ok, lengths)
    for b, (g, s, g0) in enumerate(zip(gates, signs, before)):
        rv, kl = revive[b, :lengths[b]], kill[b, :lengths[b]]
        back = torch.where(g0 > 0, 1, -1).to(torch.int8)
        g.data.copy_(torch.where(kl, torch.zeros_like(g0), torch.where(rv, g0, g.data)))
        s.copy_(torch.where(kl, torch.zeros_like(s), torch.where(rv, back, s)))


def _contributions(ra, before, died) -> List[torch.Tensor]:
    """Per gate, each entry's contribution (float64): the saliency average,
    or ``|g_j| ||left slice j|| ||right slice j||`` (the value before the
    step for this step's deaths), as ``RankAdaptive._scores``."""
    out, b = [], 0
    for _, layer in ra._layers:
        cores = list(layer.cores)
        for k, g in enumerate(layer.gates):
            if ra.stage2_rule == "saliency":
                out.append(ra._saliency[b])
            else:
                left = cores[k].detach().reshape(-1, cores[k].shape[-1]).norm(dim=0)
                right = cores[k + 1].detach().reshape(cores[k + 1].shape[0], -1).norm(dim=1)
                value = torch.where(died[b], before[b], g.detach())
                out.append((value.abs() * left * right).double())
            b += 1
    return out
