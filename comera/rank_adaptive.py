"""Two-stage rank-adaptive training (docs/design.md section 4).

Stage 1 (rank discovery): ``loss = task + gamma * sum ||g||_1`` over every
gate of every TT layer; after each optimizer step a fused proximal step (C
kernel ``comera::gate_prox_``) turns the gates' subgradient step into a
proximal one: entries that the L1 pull carried across zero, or that lie
within ``threshold`` of it, become exactly 0 and stay 0 (dead ranks).

Stage 2 (reach the target): a size controller drives the live size
``S = sum_k r_{k-1} n_k r_k`` (live ranks) down to ``S* = dense / target``:

* a budget ``S_t`` falls from the size at the start of stage 2 to ``S*``
  along a cubic schedule over the first half of stage 2 (fast while there is
  slack, gentle near the target);
* the penalty weight ``lam`` follows multiplicative dual ascent on
  ``S / S_t - 1``: it grows while the model is bigger than the budget and
  decays when ahead of it.  Each bond's L1 term is weighted by what one of
  its ranks costs, so expensive ranks feel more pressure;
* whenever ``S > S_t`` the controller kills the cheapest ranks itself: the
  smallest contribution (|g_j| times the norms of the two core slices rank j
  joins, which does not depend on how scale is split between gate and cores)
  per parameter saved, never taking ``S`` below ``S* / 1.03``;
* once ``S <= S*`` (or no kill can bring it closer) the ranks freeze: no
  more penalty, no more deaths; dead entries are still re-zeroed each step.

Without ``target_compression``, stage 2 is fine-tuning with frozen ranks.
With a target, no step of either stage takes the model beyond it (deaths
that would overshoot are undone, the largest contributions first).
"""
import math
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from comera.layer_base import dense_params, mode_size, tt_layers
from comera.ops.gate_prox import gate_prox_
from comera.prune import prune

# The budget reaches the target after this fraction of stage 2; the rest of
# stage 2 fine-tunes at the final ranks.
_REACH_FRACTION = 0.5
# Multiplicative dual-ascent gain: lam *= exp(_DUAL_GAIN * (S / S_t - 1)).
_DUAL_GAIN = 0.05
_LAMBDA_RANGE = (1e-3, 1e3)  # lam stays within this factor range of its start
# Deaths never take the size below S* / (1 + _UNDERSHOOT): compression at
# most 3% above the target.
_UNDERSHOOT = 0.03


def _check_number(name: str, value, low: float, *, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < low or (strict and value == low):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {op} {low:g}, got {value}")
    return value


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class RankAdaptive:
    """Drives the TT ranks of ``model`` during training (see the module doc).

    Args:
        model: any module; every TTLinear / TTEmbedding inside is controlled.
        gamma: stage-1 L1 weight on the gates (>= 0).
        threshold: dead zone (>= 0): a live gate entry with ``|g| <= threshold``
            after a step dies.
        stage1_steps, stage2_steps: lengths of the two stages, in ``step()``
            calls.  The controller stays in stage 2 (ranks frozen) afterwards.
        target_compression: dense / live TT parameters to reach in stage 2
            (> 1), or None.
        prune_every: if set, :func:`comera.prune` runs every ``prune_every``
            steps (with the optimizer given to :meth:`step`), so dead ranks
            stop costing compute during training.
        min_rank: no bond is taken below this many live ranks (>= 1).

    Usage: add :meth:`penalty` to the loss, call :meth:`step` right after
    ``optimizer.step()``.

    Example:
        >>> import torch, comera
        >>> model = torch.nn.Sequential(comera.TTLinear(64, 64, rank=8))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> ra = comera.RankAdaptive(model, gamma=1e-3, threshold=1e-2, stage1_steps=20,
        ...                          stage2_steps=20, target_compression=12.0, prune_every=10)
        >>> for _ in range(40):
        ...     x = torch.randn(32, 64)
        ...     loss = (model(x) - x).pow(2).mean() + ra.penalty()
        ...     opt.zero_grad(); loss.backward(); opt.step(); ra.step(opt)
        >>> ra.stage, ra.frozen, abs(ra.compression() / 12.0 - 1) < 0.05
        (2, True, True)
    """

    def __init__(self, model: nn.Module, *, gamma: float, threshold: float, stage1_steps: int,
                 stage2_steps: int, target_compression: Optional[float] = None,
                 prune_every: Optional[int] = None, min_rank: int = 1):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.gamma = _check_number("gamma", gamma, 0.0)
        self.threshold = _check_number("threshold", threshold, 0.0)
        self.stage1_steps = _check_int("stage1_steps", stage1_steps, 0)
        self.stage2_steps = _check_int("stage2_steps", stage2_steps, 0)
        if target_compression is not None:
            target_compression = _check_number("target_compression", target_compression, 1.0,
                                               strict=True)
            if self.stage2_steps < 1:
                raise ValueError("stage2_steps must be >= 1 when target_compression is set "
                                 f"(stage 2 is where the target is reached), got {stage2_steps}")
        self.target_compression = target_compression
        self.prune_every = None if prune_every is None else _check_int("prune_every", prune_every, 1)
        self.min_rank = _check_int("min_rank", min_rank, 1)
        self.model = model
        self._layers: List[Tuple[str, nn.Module]] = list(tt_layers(model))
        if not self._layers:
            warnings.warn("comera.RankAdaptive: the model has no TT layers (TTLinear / "
                          "TTEmbedding); the controller does nothing (penalty() is 0, step() "
                          "only counts steps)", stacklevel=2)
        self._dense = sum(dense_params(layer) for _, layer in self._layers)
        self._step = 0
        self._lam = 0.0
        self._lam0 = 0.0
        self._frozen = False  # set once the target is reached
        self._size_start: Optional[int] = None  # S when stage 2 began
        self._signs: List[torch.Tensor] = []
        self._sync_signs(force=True)

    # ------------------------------------------------------------- state
    @property
    def stage(self) -> int:
        """1 during the first ``stage1_steps`` steps, 2 afterwards."""
        return 1 if self._step < self.stage1_steps else 2

    @property
    def frozen(self) -> bool:
        """True once ranks no longer change (target reached, or stage 2 without a target)."""
        if not self._layers:
            return True
        if self._frozen:
            return True
        return self.stage == 2 and self.target_compression is None

    @property
    def steps(self) -> int:
        """``step()`` calls so far."""
        return self._step

    def _gates(self) -> List[nn.Parameter]:
        return [g for _, layer in self._layers for g in layer.gates]

    def _sync_signs(self, force: bool = False) -> None:
        """(Re)builds the sign vectors from the gates when their shapes no
        longer match (after prune(), a checkpoint load): exact zeros are dead."""
        gates = self._gates()
        if not force and len(gates) == len(self._signs) and all(
                s.shape == g.shape and s.device == g.device for s, g in zip(self._signs, gates)):
            return
        self._signs = [torch.sign(g.detach()).to(torch.int8).contiguous() for g in gates]

    def _bond_index(self) -> List[Tuple[int, int]]:
        """(layer index, bond) of every gate, in _gates() order."""
        return [(i, k) for i, (_, layer) in enumerate(self._layers) for k in range(len(layer.gates))]

    def _live(self) -> List[List[int]]:
        out, j = [], 0
        for _, layer in self._layers:
            n = len(layer.gates)
            out.append([int(torch.count_nonzero(s)) for s in self._signs[j:j + n]])
            j += n
        return out

    def _size(self, live: List[List[int]]) -> int:
        total = 0
        for (_, layer), ranks in zip(self._layers, live):
            full = [1] + ranks + [1]
            total += sum(full[k] * mode_size(c) * full[k + 1] for k, c in enumerate(layer.cores))
        return total

    def _rank_cost(self, li: int, k: int, live: List[List[int]]) -> int:
        """Parameters one live rank of bond k of layer li costs (both cores it joins)."""
        cores = self._layers[li][1].cores
        full = [1] + live[li] + [1]
        return full[k] * mode_size(cores[k]) + mode_size(cores[k + 1]) * full[k + 2]

    def compression(self) -> float:
        """Dense parameters of the TT layers over their live TT parameters (1.0 without TT layers)."""
        if not self._layers:
            return 1.0
        self._sync_signs()
        size = self._size(self._live())
        return self._dense / size if size else float("inf")

    def _target_size(self) -> float:
        return self._dense / self.target_compression

    # ----------------------------------------------------------- penalty
    def penalty(self) -> torch.Tensor:
        """The current stage's penalty, to add to the loss (differentiable in the gates).

        Stage 1: ``gamma * sum ||g_k||_1``.  Stage 2 with a target, until it
        is reached: ``lam * sum_k w_k ||g_k||_1`` with ``lam`` set by the
        controller and ``w_k`` the cost of one rank of bond k over the mean
        cost.  Frozen ranks (or no TT layer): a zero tensor.
        """
        gates = self._gates()
        if not gates:
            return torch.zeros(())
        zero = gates[0].new_zeros(())
        if self.frozen:
            return zero
        if self.stage == 1:
            if self.gamma == 0:
                return zero
            return self.gamma * sum(g.abs().sum() for g in gates)
        self._sync_signs()
        live = self._live()
        costs = [self._rank_cost(li, k, live) for li, k in self._bond_index()]
        mean = sum(costs) / len(costs)
        lam = self._lam if self._size_start is not None else self.gamma
        return lam * sum((c / mean) * g.abs().sum() for c, g in zip(costs, gates))

    # -------------------------------------------------------------- step
    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Call right after ``optimizer.step()``: proximal step on the gates,
        stage switch, the stage-2 size controller, and pruning every
        ``prune_every`` steps (which needs ``optimizer``)."""
        if self.prune_every is not None and optimizer is None:
            raise TypeError("RankAdaptive.step: prune_every is set, so pass the optimizer "
                            "(its state is pruned with the model)")
        if not self._layers:
            self._step += 1
            return
        self._sync_signs()
        gates = self._gates()
        kill = not self.frozen
        guard = kill and self.target_compression is not None
        before = [g.detach().clone() for g in gates] if guard else None
        signs_before = [s.clone() for s in self._signs] if guard else None
        live = gate_prox_([g.data for g in gates], self._signs, self.threshold,
                          self.min_rank, kill)
        bad = [i for i, v in enumerate(live.tolist()) if v < 0]
        if bad:
            li, k = self._bond_index()[bad[0]]
            name = self._layers[li][0] or "<model>"
            raise ValueError(f"RankAdaptive.step: gate {k} of layer '{name}' contains NaN "
                             "(no gate was changed; check the learning rate and the loss)")
        if guard:
            self._undo_overshoot(before, signs_before)
        if self.target_compression is not None and not self._frozen:
            self._control()
        self._step += 1
        if self.prune_every is not None and self._step % self.prune_every == 0:
            prune(self.model, optimizer)
            self._sync_signs()

    @torch.no_grad()
    def _contributions(self) -> List[torch.Tensor]:
        """|g_j| * ||left slice j|| * ||right slice j|| per gate entry: the size of
        rank j's contribution, whatever the split of scale between gate and cores."""
        out = []
        for _, layer in self._layers:
            cores = list(layer.cores)
            for k, g in enumerate(layer.gates):
                left = cores[k].detach().reshape(-1, cores[k].shape[-1]).norm(dim=0)
                right = cores[k + 1].detach().reshape(cores[k + 1].shape[0], -1).norm(dim=1)
                out.append((g.detach().abs() * left * right).double().cpu())
        return out

    @torch.no_grad()
    def _undo_overshoot(self, before: List[torch.Tensor], signs_before: List[torch.Tensor]) -> None:
        """Revives this step's deaths, largest contribution first, while the
        size is below S* / (1 + _UNDERSHOOT)."""
        floor = self._target_size() / (1.0 + _UNDERSHOOT)
        live = self._live()
        size = self._size(live)
        if size >= floor:
            return
        contrib = self._contributions()
        victims = []
        for gi, (li, k) in enumerate(self._bond_index()):
            died = (signs_before[gi] != 0) & (self._signs[gi] == 0) & (before[gi] != 0)
            for j in torch.nonzero(died).flatten().tolist():
                victims.append((float(contrib[gi][j]) if contrib[gi][j] > 0 else
                                float(before[gi][j].abs()), gi, li, k, j))
        gates = self._gates()
        for _, gi, li, k, j in sorted(victims, reverse=True):
            if size >= floor:
                break
            size += self._rank_cost(li, k, live)
            live[li][k] += 1
            value = before[gi][j]
            gates[gi].data[j] = value
            self._signs[gi][j] = 1 if value > 0 else -1

    def _budget(self, t: int) -> float:
        """The size allowed after stage-2 step t (0-based): cubic from the start size to S*."""
        target = self._target_size()
        reach = max(1, math.ceil(self.stage2_steps * _REACH_FRACTION))
        frac = min(1.0, (t + 1) / reach)
        return target + (self._size_start - target) * (1.0 - frac) ** 3

    @torch.no_grad()
    def _control(self) -> None:
        """Stage-2 size controller (and the target check of stage 1)."""
        target = self._target_size()
        live = self._live()
        size = self._size(live)
        if size <= target:
            self._frozen = True
            return
        if self.stage != 2:
            return
        if self._size_start is None:
            self._size_start = size
            self._lam0 = self._lam = self.gamma if self.gamma > 0 else 1e-4
        t = self._step - self.stage1_steps
        budget = self._budget(t)
        ratio = size / budget - 1.0
        lo, hi = (self._lam0 * r for r in _LAMBDA_RANGE)
        self._lam = min(hi, max(lo, self._lam * math.exp(_DUAL_GAIN * ratio)))
        if size > budget:
            self._kill_down_to(budget, live, size, final=budget <= target)

    @torch.no_grad()
    def _kill_down_to(self, budget: float, live: List[List[int]], size: int, final: bool) -> None:
        """Greedy kills of the cheapest ranks (least contribution per parameter
        saved) until size <= budget, never below S* / (1 + _UNDERSHOOT).  When
        ``final`` and no allowed kill remains, takes the one kill that lands
        closest to S* if it beats stopping, then freezes."""
        target = self._target_size()
        floor = target / (1.0 + _UNDERSHOOT)
        contrib = self._contributions()
        bonds = self._bond_index()
        gates = self._gates()
        while size > budget:
            best = None  # (score, gi, li, k, j, cost)
            closest = None  # (|log(size'/S*)|, gi, li, k, j, cost)
            for gi, (li, k) in enumerate(bonds):
                if live[li][k] <= self.min_rank:
                    continue
                cost = self._rank_cost(li, k, live)
                alive = torch.nonzero(self._signs[gi].cpu() != 0).flatten()
                vals = contrib[gi][alive]
                j = int(alive[int(torch.argmin(vals))])
                score = float(contrib[gi][j]) / cost
                if size - cost >= floor:
                    if best is None or score < best[0]:
                        best = (score, gi, li, k, j, cost)
                else:
                    miss = abs(math.log((size - cost) / target)) if size > cost else math.inf
                    if closest is None or miss < closest[0]:
                        closest = (miss, gi, li, k, j, cost)
            if best is None:
                if final and closest is not None and closest[0] < abs(math.log(size / target)):
                    best = (0.0,) + closest[1:]
                else:
                    break
            _, gi, li, k, j, cost = best
            gates[gi].data[j] = 0
            self._signs[gi][j] = 0
            live[li][k] -= 1
            size -= cost
        if final:
            self._frozen = True

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, object]:
        """Counters, controller state and each gate entry's live/dead sign, so
        that a resumed run continues in the same stage with the same ranks."""
        return {
            "step": self._step,
            "frozen": self._frozen,
            "lam": self._lam,
            "lam0": self._lam0,
            "size_start": self._size_start,
            "signs": [s.clone() for s in self._signs],
            "config": {"gamma": self.gamma, "threshold": self.threshold,
                       "stage1_steps": self.stage1_steps, "stage2_steps": self.stage2_steps,
                       "target_compression": self.target_compression,
                       "prune_every": self.prune_every, "min_rank": self.min_rank},
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restores :meth:`state_dict` (load the model's weights first).  The
        schedule (stage lengths, target) comes from the constructor; a
        mismatch with the saved one is warned about."""
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("RankAdaptive.load_state_dict: expected a dict from "
                             "RankAdaptive.state_dict()")
        saved = state.get("config", {})
        mine = self.state_dict()["config"]
        diff = sorted(k for k in mine if k in saved and saved[k] != mine[k])
        if diff:
            warnings.warn(f"RankAdaptive.load_state_dict: the saved controller had other "
                          f"settings ({', '.join(f'{k}={saved[k]!r}' for k in diff)}); "
                          "continuing with this controller's", stacklevel=2)
        self._step = _check_int("step", state["step"], 0)
        self._frozen = bool(state["frozen"])
        self._lam = float(state["lam"])
        self._lam0 = float(state["lam0"])
        self._size_start = state["size_start"]
        signs = list(state.get("signs", []))
        gates = self._gates()
        if len(signs) == len(gates) and all(s.shape == g.shape for s, g in zip(signs, gates)):
            self._signs = [s.to(device=g.device, dtype=torch.int8).clone().contiguous()
                           for s, g in zip(signs, gates)]
        else:
            self._sync_signs(force=True)
