"""Two-stage rank-adaptive training (docs/design.md section 4).

Two ways to drive it, with the same result (tested):

* ``ra.attach(optimizer)`` once: an optimizer post-step hook runs
  :meth:`RankAdaptive.step` after every ``optimizer.step()`` (so an
  unchanged loop ``loss.backward(); optimizer.step()`` trains both stages;
  a step that a GradScaler skips skips the stage logic too);
* or, explicitly, ``ra.step(optimizer)`` right after ``optimizer.step()``.

Balance (at construction, ``balance=True``): every TT layer is rewritten,
without changing its function, into its canonical (Vidal) form: the gate
on bond k holds the singular values of the layer's unfolding at that bond,
divided by the largest one, and the cores hold the orthonormal bases and
the scale.  So a gate entry's size means the same in every layer: the
weight of its rank relative to the bond's strongest, in [0, 1].

Stage 1 (rank discovery): after each optimizer step every live gate entry
is soft-thresholded, ``g <- sign(g) max(|g| - lr * gamma, 0)`` with ``lr``
the current learning rate of the gate's parameter group: an L1 proximal
step decoupled from the optimizer (like AdamW's weight decay), so ``gamma``
means the same under SGD, AdamW or Adafactor.  Units: an entry with no
gradient pull loses ``lr * gamma`` per step, so it dies after about
``|g| / (lr * gamma)`` steps (``1 / (lr * gamma)`` from the top of the
scale); under Adam-like optimizers, whose step is at most about ``lr``, an
entry survives while its normalised gradient pull exceeds ``gamma``
(so ``gamma`` is best kept below 1).  Then the fused kernel
``comera::gate_prox_`` kills entries that reached 0, crossed zero, or lie
within ``threshold`` of it (they stay 0: dead ranks).

Stage 2 (reach the target): a size controller drives the live size
``S = sum_k r_{k-1} n_k r_k`` (live ranks) down to ``S* = dense / target``:
a budget falls along a cubic from the size at the start of stage 2 to
``S*``; the decoupled shrink continues with strength ``lr * lam * w_k``
(``lam`` by dual ascent on ``S / S_t - 1``, ``w_k`` the cost of one rank
of bond k over the mean cost); and whenever ``S`` is above the budget the
controller removes the ranks whose loss is least affected: with
``stage2_rule="saliency"`` (default) the smallest running average of the
first-order estimate ``|g_j * dL/dg_j|`` of the loss change if entry j
were removed, per parameter saved; with ``"magnitude"`` the smallest
``|g_j| ||left slice j|| ||right slice j||``.  Once ``S <= S*`` the ranks
freeze.  Without ``target_compression``, stage 2 fine-tunes with frozen
ranks.  With a target, stage 2 stops at the first step whose compression
reaches it; since ranks die whole it can end slightly beyond (the tests
allow 5%).

Who decides what: the proximal kernel proposes the threshold / sign-flip
deaths; :class:`comera.adapt.controller.RankController` (no torch, plain
numbers) sets the budget and ``lam`` and decides which proposed deaths to
undo and which ranks to kill besides; :meth:`RankAdaptive._commit` writes
its decision into the gates and signs.

Synchronisation: with the gates on CUDA, :meth:`RankAdaptive.step` runs
the same rule without reading the device (:mod:`comera.adapt.device`: the
controller's state and decisions are tensors), so training never waits for
the GPU between prune steps and a whole step can be captured in a CUDA
graph.  A NaN gate then makes the step a no-op and its ValueError is raised
by :meth:`RankAdaptive.check`, which every prune step calls.  On the CPU
the host controller decides (the same decisions, cheaper there).
"""
import math
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from comera.adapt.gates import FlatGates
from comera.layers.base import dense_params, mode_size, param_list, tt_layers
from comera.ops.gate_prox import gate_prox_
from comera.adapt.balance import balance_  # noqa: F401  (comera.adapt.rank_adaptive.balance_ stays importable)
from comera.adapt.prune import _keep_indices, prune
from comera.adapt.controller import Decision, Proposal, RankController, Scores, tt_size
from comera.adapt.device import DeviceController, device_step


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


# Running average of the saliency |g * dL/dg|: weight of the past.
SALIENCY_DECAY = 0.9


def _flat_cat(fg: FlatGates, tensors: List[torch.Tensor]) -> torch.Tensor:
    """fg.cat on the first tensor's device (gates on several devices meet there)."""
    home = tensors[0].device if tensors else torch.device("cpu")
    return fg.cat([t.to(home) for t in tensors])


STAGE2_RULES = ("saliency", "magnitude")


class RankAdaptive:
    """Drives the TT ranks of ``model`` during training (see the module doc).

    Args:
        model: any module; every TTLinear / TTEmbedding inside is controlled.
        gamma: stage-1 decoupled L1 strength on the gates (>= 0): each step a
            live gate entry loses ``lr * gamma`` (``lr``: its parameter
            group's current learning rate), so one with no gradient pull
            dies after about ``|g| / (lr * gamma)`` steps; balanced gates
            lie in [0, 1].  Under Adam-like optimizers keep it below 1.
        threshold: dead zone (>= 0): a live gate entry with ``|g| <= threshold``
            after a step dies.
        stage1_steps, stage2_steps: lengths of the two stages, in optimizer
            steps.  The controller stays in stage 2 (ranks frozen) afterwards.
        target_compression: dense / live TT parameters to reach in stage 2
            (> 1), or None.
        prune_every: if set, :func:`comera.prune` runs every ``prune_every``
            steps (with the optimizer given to :meth:`step`), so dead ranks
            stop costing compute during training.
        min_rank: no bond is taken below this many live ranks (>= 1).
        stage2_rule: how stage 2 picks the ranks to remove: ``"saliency"``
            (default; the running average of ``|g_j dL/dg_j|``, the
            first-order loss change of removing rank j) or ``"magnitude"``
            (``|g_j|`` times the norms of the two core slices it joins).
        balance: rewrite every TT layer in canonical form now (same
            function, gates = relative singular values; see
            :func:`balance_`), so a gate's size means the same in every
            layer.  Do it before the optimizer has state.
        sync_free: ``None`` (default): on CUDA, the per-step logic (gate
            step, live ranks, stage-2 controller) stays on the device and
            only prune steps read it back, so a step can be captured in a
            CUDA graph; elsewhere the host path runs.  ``False`` keeps the
            host path on CUDA too (a few syncs per step, but cheaper than the
            device controller's kill loop in eager stage 2); ``True`` forces
            the device path (same results, tested equal).

    Usage: ``ra.attach(optimizer)`` once, then train as usual; or call
    :meth:`step` right after every ``optimizer.step()``.  :meth:`penalty`
    is kept for old loops and is 0 (the L1 pull is the decoupled step).

    Example:
        >>> import torch, comera
        >>> model = torch.nn.Sequential(comera.TTLinear(64, 64, rank=8))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> ra = comera.RankAdaptive(model, gamma=0.5, threshold=1e-2, stage1_steps=20,
        ...                          stage2_steps=20, target_compression=12.0,
        ...                          prune_every=10).attach(opt)
        >>> for _ in range(40):
        ...     x = torch.randn(32, 64)
        ...     loss = (model(x) - x).pow(2).mean()
        ...     opt.zero_grad(); loss.backward(); opt.step()   # the hook runs ra.step(opt)
        >>> ra.stage, ra.frozen, abs(ra.compression() / 12.0 - 1) < 0.05
        (2, True, True)
    """

    _saliency_decay = SALIENCY_DECAY
    # None: the sync-free device path runs when the gates are on CUDA; True /
    # False force it on or off (tests force it on the CPU).
    _force_device: Optional[bool] = None

    def __init__(self, model: nn.Module, *, gamma: float, threshold: float, stage1_steps: int,
                 stage2_steps: int, target_compression: Optional[float] = None,
                 prune_every: Optional[int] = None, min_rank: int = 1,
                 stage2_rule: str = "saliency", balance: bool = True,
                 sync_free: Optional[bool] = None):
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
        if sync_free not in (None, True, False):
            raise TypeError(f"sync_free must be None, True or False, got {sync_free!r}")
        self._force_device = sync_free
        if stage2_rule not in STAGE2_RULES:
            raise ValueError(f"stage2_rule must be one of {STAGE2_RULES}, got {stage2_rule!r}")
        self.stage2_rule = stage2_rule
        self.balance = bool(balance)
        self.model = model
        self._layers: List[Tuple[str, nn.Module]] = list(tt_layers(model))
        if not self._layers:
            warnings.warn("comera.RankAdaptive: the model has no TT layers (TTLinear / "
                          "TTEmbedding); the controller does nothing (penalty() is 0, step() "
                          "only counts steps)", stacklevel=2)
        if self.balance:
            for _, layer in self._layers:
                balance_(layer)
        self._dense = sum(dense_params(layer) for _, layer in self._layers)
        self._step = 0
        target_size = None if target_compression is None else self._dense / target_compression
        self._ctl = RankController(gamma=self.gamma, stage1_steps=self.stage1_steps,
                                   stage2_steps=self.stage2_steps, target_size=target_size,
                                   min_rank=self.min_rank)
        self._signs: List[torch.Tensor] = []
        self._saliency: List[torch.Tensor] = []
        self._hooks: list = []
        self._attached: Optional[torch.optim.Optimizer] = None
        self._in_hook = False
        self._dc: Optional[DeviceController] = None  # the controller's state on the device
        self._fg: Optional[FlatGates] = None  # offsets of the gates in one flat vector
        self._sync_signs(force=True)

    # ------------------------------------------------------------- state
    @property
    def stage(self) -> int:
        """1 during the first ``stage1_steps`` steps, 2 afterwards."""
        return self._ctl.stage(self._step)

    @property
    def frozen(self) -> bool:
        """True once ranks no longer change (target reached, or stage 2 without a target)."""
        self._pull()
        return not self._layers or self._ctl.ranks_frozen(self._step)

    @property
    def steps(self) -> int:
        """Steps taken so far (optimizer steps seen by the hook, or ``step()`` calls)."""
        return self._step

    def _pull(self) -> None:
        """Copies the device controller's state into the host one (syncs)."""
        if self._dc is not None:
            self._dc.pull(self._ctl)

    def _device_ctl(self, device: torch.device) -> DeviceController:
        """The controller state on ``device`` (built from the host state when needed)."""
        if self._dc is None or self._dc.device != device:
            self._pull()
            self._dc = DeviceController(self._ctl, self._shapes(), device)
        return self._dc

    def _use_device(self, gates: List[torch.Tensor]) -> bool:
        if len({g.device for g in gates}) != 1:
            return False
        if self._force_device is not None:
            return self._force_device
        return gates[0].device.type == "cuda"

    def _gates(self) -> List[nn.Parameter]:
        return [g for _, layer in self._layers for g in param_list(layer.gates)]

    def _flat(self, tensors: List[torch.Tensor]) -> FlatGates:
        """The gates' flat layout (comera.adapt.gates), rebuilt when the sizes change."""
        if self._fg is None or not self._fg.matches(tensors):
            self._fg = FlatGates([t.numel() for t in tensors])
        return self._fg

    def _sync_signs(self, force: bool = False) -> None:
        """(Re)builds the sign vectors from the gates when their shapes no
        longer match (after prune(), a checkpoint load): exact zeros are dead."""
        gates = self._gates()
        if not force and len(gates) == len(self._signs) and all(
                s.shape == g.shape and s.device == g.device for s, g in zip(self._signs, gates)):
            return
        self._signs = [torch.sign(g.detach()).to(torch.int8).contiguous() for g in gates]
        if len(self._saliency) != len(gates) or any(
                a.shape != g.shape or a.device != g.device for a, g in zip(self._saliency, gates)):
            self._saliency = [torch.zeros(g.shape, dtype=torch.float64, device=g.device)
                              for g in gates]

    # The numbers the controller works on: mode sizes per core, live ranks per bond.
    def _shapes(self) -> List[List[int]]:
        return [[mode_size(c) for c in layer.cores] for _, layer in self._layers]

    def _live(self) -> List[List[int]]:
        fg = self._flat(self._signs)
        counts = fg.counts(_flat_cat(fg, self._signs) != 0)
        out, j = [], 0
        for _, layer in self._layers:
            n = len(layer.gates)
            out.append(counts[j:j + n])
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
        """A zero tensor, kept so that loops written for the penalty form
        (``loss + ra.penalty()``) still run: the L1 pull of both stages is
        now the decoupled proximal step inside :meth:`step`."""
        gates = self._gates()
        return gates[0].new_zeros(()) if gates else torch.zeros(())

    def shrink_strength(self) -> List[float]:
        """Per gate, this step's L1 strength before the learning rate: ``gamma``
        in stage 1, ``lam * w_k`` in stage 2 until the target, 0 once frozen."""
        gates = self._gates()
        if self.frozen or not gates:
            return [0.0] * len(gates)
        if self.stage == 1:
            return [self.gamma] * len(gates)
        self._sync_signs()
        self._pull()
        lam, weights = self._ctl.penalty_weights(self._shapes(), self._live())
        return [lam * w for w in weights]

    # -------------------------------------------------------------- hook
    def attach(self, optimizer: torch.optim.Optimizer) -> "RankAdaptive":
        """Runs :meth:`step` after every ``optimizer.step()`` (an optimizer
        post-step hook; a pre-step hook marks the step as the hook's), so an
        unchanged training loop trains both stages.  A step skipped by AMP's
        GradScaler never calls ``optimizer.step()``, so it skips the stage
        logic too.  Returns ``self``; :meth:`detach` undoes it.

        Example:
            >>> import torch, comera
            >>> layer = comera.TTLinear(16, 16, rank=4)
            >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
            >>> ra = comera.RankAdaptive(layer, gamma=0.1, threshold=1e-3, stage1_steps=5,
            ...                          stage2_steps=0).attach(opt)
            >>> layer(torch.randn(2, 16)).sum().backward(); opt.step()
            >>> ra.steps
            1
            >>> ra.detach(); opt.step(); ra.steps
            1
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("RankAdaptive.attach: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if self._attached is not None:
            raise RuntimeError("RankAdaptive.attach: already attached to an optimizer "
                               "(call detach() first)")

        def pre(opt, args, kwargs):
            self._in_hook = True

        def post(opt, args, kwargs):
            try:
                self._step_impl(opt)
            finally:
                self._in_hook = False

        self._hooks = [optimizer.register_step_pre_hook(pre),
                       optimizer.register_step_post_hook(post)]
        self._attached = optimizer
        return self

    def detach(self) -> None:
        """Removes the hooks of :meth:`attach` (nothing if not attached)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._attached, self._in_hook = [], None, False

    # -------------------------------------------------------------- step
    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Call right after ``optimizer.step()`` (unless :meth:`attach` is
        used): saliency update, decoupled L1 shrink of the gates (strength
        ``lr * gamma``, needs ``optimizer`` for ``lr``; without it only the
        dead zone acts), the proximal kill step, stage switch, the stage-2
        size controller, and pruning every ``prune_every`` steps (which
        needs ``optimizer``).  With the gates on CUDA no step but a prune
        step waits for the GPU, and a NaN gate is reported by :meth:`check`
        (module doc)."""
        if self._attached is not None:
            raise RuntimeError("RankAdaptive.step: attached to an optimizer, whose step() already "
                               "runs it (call detach() to drive it by hand)")
        self._step_impl(optimizer)

    def _group_lrs(self, optimizer, gates) -> List[Optional[float]]:
        lr_of = {}
        if optimizer is not None:
            for group in optimizer.param_groups:
                lr = group["lr"]  # a tensor lr (capturable optimizers) stays a tensor: no read
                for p in group["params"]:
                    lr_of[id(p)] = lr if isinstance(lr, torch.Tensor) else float(lr)
        return [lr_of.get(id(g)) for g in gates]

    @torch.no_grad()
    def _step_impl(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        if self.prune_every is not None and optimizer is None:
            raise TypeError("RankAdaptive.step: prune_every is set, so pass the optimizer "
                            "(its state is pruned with the model)")
        if not self._layers:
            self._step += 1
            return
        self._sync_signs()
        gates = self._gates()
        if self._use_device(gates):
            device_step(self, optimizer)
        else:
            self._host_step(gates, optimizer)
        self._step += 1
        if self.prune_every is not None and self._step % self.prune_every == 0:
            self.check()
            keeps = [_keep_indices(g) for g in gates]
            prune(self.model, optimizer)
            self._saliency = [s.index_select(0, k.to(s.device)) if s.shape != g.shape else s
                              for s, k, g in zip(self._saliency, keeps, gates)]
            self._sync_signs()

    def check(self) -> None:
        """Raises the ValueError of a NaN gate met by an earlier sync-free
        step (gates on CUDA: :meth:`step` does not read the device, so it
        defers the error to here; every prune step calls this).  No step
        changed a gate while one held a NaN.  Reads the device.

        Example:
            >>> import torch, comera
            >>> layer = comera.TTLinear(16, 16, rank=4)
            >>> ra = comera.RankAdaptive(layer, gamma=0.1, threshold=1e-3, stage1_steps=5,
            ...                          stage2_steps=0)
            >>> ra.step(); ra.check()   # no NaN: nothing to raise
        """
        if self._dc is not None and bool(self._dc.nan_seen):
            self._raise_on_nan([-1 if b else 0 for b in self._dc.nan_gates.tolist()],
                               deferred=True)

    def _host_step(self, gates: List[nn.Parameter], optimizer) -> None:
        """The step with the host controller (reads the device), on the gates
        concatenated into one flat vector (comera.adapt.gates): a few tensor
        operations per step instead of a few per gate."""
        self._pull()
        self._dc = None
        fg = self._flat(gates)
        data = [g.data for g in gates]
        flat = _flat_cat(fg, data)  # a copy: the values before this step
        if bool(torch.isnan(flat).any()):
            bad = {i for i, g in enumerate(data) if bool(torch.isnan(g).any())}
            self._raise_on_nan([-1 if i in bad else 0 for i in range(len(gates))])
        self._update_saliency(gates, fg, flat)
        kill = not self.frozen
        # with a target, the controller reviews the kernel's deaths and may add its own
        review = kill and self._ctl.target_size is not None
        signs_before = _flat_cat(fg, self._signs) if review else None
        if kill:
            self._shrink(gates, optimizer, fg, flat)
        live = gate_prox_(data, self._signs, self.threshold, self.min_rank, kill)
        self._raise_on_nan(live.tolist())
        if review:
            died_flat = (signs_before != 0) & (_flat_cat(fg, self._signs) == 0) & (flat != 0)
            where = torch.nonzero(died_flat).flatten()
            proposals = [Proposal(gi, j, m) for (gi, j), m in
                         zip(fg.locate(where), flat[where].abs().tolist())]
            before, died = fg.split(flat), fg.split(died_flat)
            decision = self._ctl.decide(self._step, self._shapes(), self._live(), proposals,
                                        lambda: self._scores(before, died))
            self._commit(decision, before)

    def _update_saliency(self, gates: List[nn.Parameter], fg: FlatGates,
                         flat: torch.Tensor) -> None:
        """Running average of |g dL/dg| (the gradient of this step)."""
        grads = [g.grad for g in gates]
        if all(gr is not None and gr.shape == g.shape for gr, g in zip(grads, gates)):
            contrib = (flat * _flat_cat(fg, grads)).abs().double()
            torch._foreach_mul_(self._saliency, SALIENCY_DECAY)
            torch._foreach_add_(self._saliency, [c.to(s.device) for c, s in
                                                 zip(fg.split(contrib), self._saliency)],
                                alpha=1.0 - SALIENCY_DECAY)
            return
        for g, sal in zip(gates, self._saliency):  # some gates got no gradient this step
            if g.grad is not None and g.grad.shape == g.shape:
                sal.mul_(SALIENCY_DECAY).add_((g.detach() * g.grad).abs().double(),
                                              alpha=1.0 - SALIENCY_DECAY)

    def _shrink(self, gates: List[torch.Tensor], optimizer, fg: FlatGates,
                flat: torch.Tensor) -> None:
        """Decoupled L1 step ``g <- sign(g) max(|g| - lr * strength, 0)``; a
        gate that it would leave with fewer than ``min_rank`` non-zero entries
        keeps its largest ones unshrunk (the kernel then keeps them alive).
        ``flat``: the gates' values concatenated (comera.adapt.gates)."""
        amounts = [float(lr * strength) if lr is not None and strength > 0 and g.numel() else None
                   for g, lr, strength in zip(gates, self._group_lrs(optimizer, gates),
                                              self.shrink_strength())]
        if all(a is None for a in amounts):
            return
        # dead entries may have been moved by the optimizer (momentum): the kernel re-zeroes them
        old = torch.where(_flat_cat(fg, self._signs).to(flat.device) != 0, flat,
                          torch.zeros_like(flat))
        step = fg.per_entry([a or 0.0 for a in amounts], flat.dtype, flat.device)
        applied = fg.per_entry([a is not None for a in amounts], torch.bool, flat.device)
        new = torch.where(applied, old.sign() * (old.abs() - step).clamp_min(0), flat)
        nz_old, nz_new = fg.counts(old != 0), fg.counts(new != 0)
        olds, news = fg.split(old), fg.split(new)
        for gi, a in enumerate(amounts):
            need = min(self.min_rank, nz_old[gi])
            if a is not None and nz_new[gi] < need:
                top = torch.topk(olds[gi].abs(), need).indices
                news[gi][top] = torch.where(news[gi][top] != 0, news[gi][top], olds[gi][top])
        torch._foreach_copy_([g.data for g in gates], [n.to(g.device) for n, g in zip(news, gates)])

    def _raise_on_nan(self, live: List[int], deferred: bool = False) -> None:
        bad = [i for i, v in enumerate(live) if v < 0]
        if bad:
            li, k = [(i, k) for i, (_, layer) in enumerate(self._layers)
                     for k in range(len(layer.gates))][bad[0]]
            name = self._layers[li][0] or "<model>"
            when = ("(seen by an earlier step on the device; no step changed a gate while "
                    "it held NaN" if deferred else "(no gate was changed")
            raise ValueError(f"RankAdaptive.step: gate {k} of layer '{name}' contains NaN "
                             f"{when}; check the learning rate and the loss)")

    @torch.no_grad()
    def _scores(self, before: List[torch.Tensor], died: List[torch.Tensor]) -> Scores:
        """Per bond, entry -> how much removing it would cost, for the live
        entries and this step's deaths.  ``"saliency"``: the running average
        of ``|g_j dL/dg_j|`` (first-order loss change).  ``"magnitude"``:
        ``|g_j| * ||left slice j|| * ||right slice j||`` (at the value before
        the step for deaths), the size of rank j's contribution."""
        out, gi = [], 0
        for _, layer in self._layers:
            cores = list(layer.cores)
            for k, g in enumerate(layer.gates):
                if self.stage2_rule == "saliency":
                    contrib = self._saliency[gi].cpu().tolist()
                else:
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
        self._pull()
        return {
            "step": self._step,
            "frozen": self._ctl.frozen,
            "lam": self._ctl.lam,
            "lam0": self._ctl.lam0,
            "size_start": self._ctl.size_start,
            "signs": [s.clone() for s in self._signs],
            "saliency": [a.clone() for a in self._saliency],
            "config": {"gamma": self.gamma, "threshold": self.threshold,
                       "stage1_steps": self.stage1_steps, "stage2_steps": self.stage2_steps,
                       "target_compression": self.target_compression,
                       "prune_every": self.prune_every, "min_rank": self.min_rank,
                       "stage2_rule": self.stage2_rule},
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
        self._dc = None  # rebuilt from the restored host state by the next device step
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
        # older checkpoints have no saliency: start it again from zero
        saliency = list(state.get("saliency", []))
        if len(saliency) == len(gates) and all(a.shape == g.shape for a, g in zip(saliency, gates)):
            self._saliency = [a.to(device=g.device, dtype=torch.float64).clone()
                              for a, g in zip(saliency, gates)]
        else:
            self._saliency = [torch.zeros(g.shape, dtype=torch.float64, device=g.device)
                              for g in gates]
