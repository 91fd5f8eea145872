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
that would overshoot are undone, the largest gates first).

Who decides what: the proximal kernel proposes the threshold / sign-flip
deaths; :class:`comera.rank_controller.RankController` (no torch, plain
numbers) sets the budget and ``lam`` and decides which proposed deaths to
undo and which ranks to kill besides; :meth:`RankAdaptive._commit` writes
its decision into the gates and signs.
"""
import math
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from comera.layer_base import dense_params, mode_size, tt_layers
from comera.ops.gate_prox import gate_prox_
from comera.prune import prune
from comera.rank_controller import Decision, Proposal, RankController, Scores, tt_size


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
        target_size = None if target_compression is None else self._dense / target_compression
        self._ctl = RankController(gamma=self.gamma, stage1_steps=self.stage1_steps,
                                   stage2_steps=self.stage2_steps, target_size=target_size,
                                   min_rank=self.min_rank)
        self._signs: List[torch.Tensor] = []
        self._sync_signs(force=True)

    # ------------------------------------------------------------- state
    @property
    def stage(self) -> int:
        """1 during the first ``stage1_steps`` steps, 2 afterwards."""
        return self._ctl.stage(self._step)

    @property
    def frozen(self) -> bool:
        """True once ranks no longer change (target reached, or stage 2 without a target)."""
        return not self._layers or self._ctl.ranks_frozen(self._step)

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

    # The numbers the controller works on: mode sizes per core, live ranks per bond.
    def _shapes(self) -> List[List[int]]:
        return [[mode_size(c) for c in layer.cores] for _, layer in self._layers]

    def _live(self) -> List[List[int]]:
        out, j = [], 0
        for _, layer in self._layers:
            n = len(layer.gates)
            out.append([int(torch.count_nonzero(s)) for s in self._signs[j:j + n]])
            j += n
        return out

    def compression(self) -> float:
        """Dense parameters of the TT layers over their live TT parameters (1.0 without TT layers)."""
        if not self._layers:
            return 1.0
        self._sync_signs()
        size = tt_size(self._shapes(), self._live())
        return self._dense / size if size else float("inf")

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
        lam, weights = self._ctl.penalty_weights(self._shapes(), self._live())
        return lam * sum(w * g.abs().sum() for w, g in zip(weights, gates))

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
        # with a target, the controller reviews the kernel's deaths and may add its own
        review = kill and self._ctl.target_size is not None
        before = [g.detach().clone() for g in gates] if review else None
        signs_before = [s.clone() for s in self._signs] if review else None
        live = gate_prox_([g.data for g in gates], self._signs, self.threshold,
                          self.min_rank, kill)
        self._raise_on_nan(live.tolist())
        if review:
            died = [(sb != 0) & (s == 0) & (b != 0)
                    for sb, s, b in zip(signs_before, self._signs, before)]
            proposals = [Proposal(gi, j, float(before[gi][j].abs()))
                         for gi, d in enumerate(died) for j in torch.nonzero(d).flatten().tolist()]
            decision = self._ctl.decide(self._step, self._shapes(), self._live(), proposals,
                                        lambda: self._scores(before, died))
            self._commit(decision, before)
        self._step += 1
        if self.prune_every is not None and self._step % self.prune_every == 0:
            prune(self.model, optimizer)
            self._sync_signs()

    def _raise_on_nan(self, live: List[int]) -> None:
        bad = [i for i, v in enumerate(live) if v < 0]
        if bad:
            li, k = [(i, k) for i, (_, layer) in enumerate(self._layers)
                     for k in range(len(layer.gates))][bad[0]]
            name = self._layers[li][0] or "<model>"
            raise ValueError(f"RankAdaptive.step: gate {k} of layer '{name}' contains NaN "
                             "(no gate was changed; check the learning rate and the loss)")

    @torch.no_grad()
    def _scores(self, before: List[torch.Tensor], died: List[torch.Tensor]) -> Scores:
        """Per bond, entry -> |g_j| * ||left slice j|| * ||right slice j|| for
        the live entries and this step's deaths (at their value before the
        step): the size of rank j's contribution, whatever the split of scale
        between gate and cores."""
        out, gi = [], 0
        for _, layer in self._layers:
            cores = list(layer.cores)
            for k, g in enumerate(layer.gates):
                left = cores[k].detach().reshape(-1, cores[k].shape[-1]).norm(dim=0)
                right = cores[k + 1].detach().reshape(cores[k + 1].shape[0], -1).norm(dim=1)
                value = torch.where(died[gi], before[gi], g.detach())
                contrib = (value.abs() * left * right).double().cpu().tolist()
                keep = ((self._signs[gi] != 0) | died[gi]).cpu()
                out.append({j: contrib[j] for j in torch.nonzero(keep).flatten().tolist()})
                gi += 1
        return out

    @torch.no_grad()
    def _commit(self, decision: Decision, before: List[torch.Tensor]) -> None:
        """Writes the controller's decision: revived entries get back their
        value before the step, killed ones become 0; signs follow."""
        gates = self._gates()
        for gi, j in decision.revive:
            value = before[gi][j]
            gates[gi].data[j] = value
            self._signs[gi][j] = 1 if value > 0 else -1
        for gi, j in decision.kill:
            gates[gi].data[j] = 0
            self._signs[gi][j] = 0

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, object]:
        """Counters, controller state and each gate entry's live/dead sign, so
        that a resumed run continues in the same stage with the same ranks."""
        return {
            "step": self._step,
            "frozen": self._ctl.frozen,
            "lam": self._ctl.lam,
            "lam0": self._ctl.lam0,
            "size_start": self._ctl.size_start,
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
        self._ctl.frozen = bool(state["frozen"])
        self._ctl.lam = float(state["lam"])
        self._ctl.lam0 = float(state["lam0"])
        self._ctl.size_start = state["size_start"]
        signs = list(state.get("signs", []))
        gates = self._gates()
        if len(signs) == len(gates) and all(s.shape == g.shape for s, g in zip(signs, gates)):
            self._signs = [s.to(device=g.device, dtype=torch.int8).clone().contiguous()
                           for s, g in zip(signs, gates)]
        else:
            self._sync_signs(force=True)
