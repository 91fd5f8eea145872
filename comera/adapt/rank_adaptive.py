"""Two-stage rank-adaptive training: :class:`RankAdaptive` (docs/design.md section 4).

Two ways to drive it, with the same result (tested): ``ra.attach(optimizer)``
once, and an optimizer post-step hook runs :meth:`RankAdaptive.step` after
every ``optimizer.step()`` (a step that a GradScaler skips skips the stage
logic too); or ``ra.step(optimizer)`` right after ``optimizer.step()``.

Balance (``balance=True``): every TT layer is first rewritten, with the same
function, so that the gate on bond k holds the singular values of the
layer's unfolding there over the largest (:func:`comera.adapt.balance.balance_`):
a gate entry's size means the same in every layer.

Stage 1 (rank discovery): after each optimizer step every live gate entry
loses ``lr * gamma`` (``lr``: its parameter group's current learning rate),
an L1 proximal step decoupled from the optimizer like AdamW's weight decay,
so ``gamma`` means the same under SGD, AdamW or Adafactor.  Entries that
reach 0, cross it, or lie within ``threshold`` of it die and stay dead.
Stage 2: a size controller drives the live TT size down to
``dense / target_compression``, removing the ranks whose loss is least
affected (``stage2_rule``), then freezes the ranks (ranks die whole, so it
can end slightly beyond the target; the tests allow 5%).  Without a target,
stage 2 fine-tunes with frozen ranks.

Who does what: :class:`RankAdaptive` owns the schedule and the state
(:class:`comera.adapt.state.ControllerState`) and passes them on;
:class:`comera.adapt.step.GateStep` steps the gates;
:class:`comera.adapt.controller.RankController` decides; :func:`comera.prune`
cuts dead ranks out.

Sharded parameters (FSDP2's ``fully_shard``, before or after the controller
is built): balancing, the gate step and the controller work on the gates'
(and for the ``"magnitude"`` rule the cores') whole values, gathered with
``full_tensor()``; process 0's outcome (gates and controller state) is
broadcast, and each process writes back its own piece of the gates, so every
process takes the same decisions.  Every process must then run the same
steps.  Pruning sharded layers needs FSDP's own bookkeeping:
``pruner=comera.integrations.fsdp.prune`` (docs/distributed.md).
"""
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from comera.adapt.balance import balance_
from comera.adapt.controller import RankController
from comera.adapt.gates import FlatGates, GateRates
from comera.adapt.prune import keep_indices, prune
from comera.adapt.settings import SAVED, check_int, check_settings
from comera.adapt.state import ControllerState
from comera.adapt.step import GateStep
from comera.layers.base import (dense_params, full_value, is_sharded, mode_size, param_list,
                                tt_layers, write_full_value_)

Pruner = Callable[[nn.Module, Optional[torch.optim.Optimizer]], Dict[str, List[int]]]


class RankAdaptive:
    """Drives the TT ranks of ``model`` during training (see the module doc).

    Args:
        model: any module; every TTLinear / TTEmbedding inside is controlled.
        gamma: stage-1 L1 strength (>= 0; default 0.5): each step a live gate
            entry loses ``lr * gamma``, so one with no gradient pull dies after
            about ``|g| / (lr * gamma)`` steps (balanced gates lie in [0, 1]).
            Under Adam-like optimizers an entry survives while its normalised
            gradient pull exceeds ``gamma``: keep it below 1.
        threshold: dead zone (>= 0; default 1e-2, a hundredth of the bond's
            strongest rank): a live entry with ``|g| <= threshold`` dies.
        stage1_steps, stage2_steps: lengths of the two stages in optimizer
            steps (default 1000 each, a short fine-tune).  Stage 2 lasts
            afterwards, with frozen ranks.
        target_compression: dense / live TT parameters to reach in stage 2
            (> 1), or None (default: stage 2 only fine-tunes).
        prune_every: if set, :func:`comera.prune` runs every ``prune_every``
            steps (with the optimizer given to :meth:`step`), so dead ranks
            stop costing compute during training.  Default None.
        min_rank: no bond is taken below this many live ranks (>= 1; default 1).
        stage2_rule: how stage 2 picks the ranks to remove: ``"saliency"``
            (default; the running average of ``|g_j dL/dg_j|``, the first-order
            loss change of removing rank j) or ``"magnitude"`` (``|g_j|`` times
            the norms of the two core slices it joins).
        balance: rewrite every TT layer in canonical form now (default True;
            same function, see :func:`balance_`).  Do it before the optimizer
            has state.
        sync_free: whether :meth:`step` may read the device.  ``None``
            (default): it does not on CUDA (only prune steps read it back, so a
            step can be captured in a CUDA graph; a NaN gate makes the steps
            no-ops and is raised by :meth:`check`), and does on the CPU.
            ``True`` / ``False`` force either.  Both run the same tensor code
            to the same gates and ranks; reading lets a step raise on a NaN at
            once and stop the stage-2 kill loop at the last kill, which in
            eager CUDA stage 2 costs a few syncs per step instead of the
            sync-free loop's fixed number of rounds.
        pruner: what prunes every ``prune_every`` steps, called as
            ``pruner(model, optimizer)``: :func:`comera.prune` (default), or
            ``comera.integrations.fsdp.prune`` for a model whose TT layers are
            sharded by FSDP2's ``fully_shard`` (required there).

    Usage: ``ra.attach(optimizer)`` once, then train as usual; or call
    :meth:`step` right after every ``optimizer.step()``.  :meth:`penalty`
    is kept for old loops and is 0 (the L1 pull is the decoupled step).

    Example:
        >>> import torch, comera
        >>> model = torch.nn.Sequential(comera.TTLinear(64, 64, rank=8))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> ra = comera.RankAdaptive(model, stage1_steps=20, stage2_steps=20,
        ...                          target_compression=12.0, prune_every=10).attach(opt)
        >>> for _ in range(40):
        ...     x = torch.randn(32, 64)
        ...     loss = (model(x) - x).pow(2).mean()
        ...     opt.zero_grad(); loss.backward(); opt.step()   # the hook runs ra.step(opt)
        >>> ra.stage, ra.frozen, abs(ra.compression() / 12.0 - 1) < 0.05
        (2, True, True)
    """

    def __init__(self, model: nn.Module, *, gamma: float = 0.5, threshold: float = 1e-2,
                 stage1_steps: int = 1000, stage2_steps: int = 1000,
                 target_compression: Optional[float] = None, prune_every: Optional[int] = None,
                 min_rank: int = 1, stage2_rule: str = "saliency", balance: bool = True,
                 sync_free: Optional[bool] = None, pruner: Optional[Pruner] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        # gamma, threshold, stage1_steps, ..., sync_free: the checked arguments, as attributes
        vars(self).update(check_settings(
            gamma=gamma, threshold=threshold, stage1_steps=stage1_steps, stage2_steps=stage2_steps,
            target_compression=target_compression, prune_every=prune_every, min_rank=min_rank,
            stage2_rule=stage2_rule, balance=balance, sync_free=sync_free))
        if pruner is not None and not callable(pruner):
            raise TypeError(f"pruner must be callable, got {type(pruner).__name__}")
        self.model = model
        self._pruner = pruner
        self._layers: List[Tuple[str, nn.Module]] = list(tt_layers(model))
        self._check_pruner()
        if not self._layers:
            warnings.warn("comera.RankAdaptive: the model has no TT layers (TTLinear / "
                          "TTEmbedding); the controller does nothing (penalty() is 0, step() "
                          "only counts steps)", stacklevel=2)
        for _, layer in self._layers if self.balance else ():
            balance_(layer)
        self._dense = sum(dense_params(layer) for _, layer in self._layers)
        self.controller = RankController(
            [[mode_size(c) for c in layer.cores] for _, layer in self._layers], gamma=self.gamma,
            stage1_steps=self.stage1_steps, stage2_steps=self.stage2_steps, min_rank=self.min_rank,
            target_size=None if self.target_compression is None
            else self._dense / self.target_compression)
        self._gate_step = GateStep(self.controller, self._layers, threshold=self.threshold,
                                   rule=self.stage2_rule)
        self.state = ControllerState.for_gates(self._values(self._gates()))
        self._rates = GateRates()
        self._fg: Optional[FlatGates] = None  # the gates' flat layout, rebuilt when they change
        self._hooks: list = []
        self._attached: Optional[torch.optim.Optimizer] = None

    # ------------------------------------------------------------- state
    @property
    def stage(self) -> int:
        """1 during the first ``stage1_steps`` steps, 2 afterwards."""
        return self.controller.stage(self.state.step)

    @property
    def frozen(self) -> bool:
        """True once ranks no longer change (target reached, or stage 2 without a target)."""
        return (not self._layers or bool(self.state.frozen)
                or (self.stage == 2 and self.target_compression is None))

    @property
    def steps(self) -> int:
        """Steps taken so far (optimizer steps seen by the hook, or ``step()`` calls)."""
        return self.state.step

    # The signs and saliency as they were named before the state object (read by tests).
    _signs = property(lambda self: self.state.signs)
    _saliency = property(lambda self: self.state.saliency)
    # The state once steps ran and run sync-free, else None (tests/ops/test_cuda_sync_free.py).
    _dc = property(lambda self: self.state if self.state.step and self.uses_sync_free() else None)

    def uses_sync_free(self) -> bool:
        """Whether :meth:`step` runs without reading the device: ``sync_free``,
        or when it is None, whether the gates are on one CUDA device."""
        devices = {g.device for g in self._gates()}
        if len(devices) != 1:
            return False  # no gates, or gates on several devices (copies between them sync)
        return devices.pop().type == "cuda" if self.sync_free is None else self.sync_free

    def _gates(self) -> List[nn.Parameter]:
        return [g for _, layer in self._layers for g in param_list(layer.gates)]

    def _check_pruner(self) -> None:
        """Sharded TT layers are pruned by FSDP's glue, never by comera.prune."""
        if self.prune_every is None or self._pruner is not None:
            return
        if any(is_sharded(p) for _, layer in self._layers for p in layer.parameters()):
            raise ValueError("RankAdaptive: the TT layers are sharded (DTensor parameters, "
                             "FSDP2's fully_shard) and prune_every is set: pass "
                             "pruner=comera.integrations.fsdp.prune")

    @staticmethod
    def _values(gates: List[torch.Tensor]) -> List[torch.Tensor]:
        """Plain tensors holding the gates' whole values, for the state and the
        step: the gates themselves, or, when they are sharded, gathered copies
        carrying gathered gradients (a collective)."""
        if not any(is_sharded(g) for g in gates):
            return gates
        out = []
        for g in gates:
            v = full_value(g).clone()
            if g.grad is not None:
                v.grad = full_value(g.grad)
            out.append(v)
        return out

    def _follow(self) -> None:
        """Rebuilds the state's per-gate tensors if the gates changed shape or
        device (gathering sharded gates only then)."""
        gates = self._gates()
        if not self.state.fits(gates):
            self.state.follow(self._values(gates))

    @torch.no_grad()
    def _agree(self, params: List[torch.Tensor], values: List[torch.Tensor]) -> None:
        """Sharded gates: process 0's gate values and state go to every
        process (so that floating-point noise can never make them decide
        differently), then each process writes its piece of the gates."""
        mesh = params[0].device_mesh
        group = mesh.get_group() if mesh.ndim == 1 else None
        src = dist.get_global_rank(group, 0) if group is not None else 0
        fg = self._flat(values)
        packed = torch.cat([fg.cat(values).double(), self.state.pack()])
        dist.broadcast(packed, src=src, group=group)
        fg.write_(values, packed[:fg.total].to(values[0].dtype))
        self.state.unpack_(packed[fg.total:])
        for p, v in zip(params, values):
            write_full_value_(p, v)

    def _flat(self, gates: List[torch.Tensor]) -> FlatGates:
        """The gates' flat layout (comera.adapt.gates), rebuilt when the sizes change."""
        if self._fg is None or not self._fg.matches(gates):
            self._fg = FlatGates([g.numel() for g in gates], gates[0].device,
                                 spread=len({g.device for g in gates}) > 1)
        return self._fg

    def _live(self) -> torch.Tensor:
        """Live ranks per bond (an int64 tensor)."""
        self._follow()
        fg = self._flat(self.state.signs)
        return fg.counts(fg.cat(self.state.signs) != 0)

    def compression(self) -> float:
        """Dense parameters of the TT layers over their live TT parameters (1.0 without TT layers)."""
        if not self._layers:
            return 1.0
        live = self._live()
        size = int(self.controller.sizes(live.device).size(live))
        return self._dense / size if size else float("inf")

    def penalty(self) -> torch.Tensor:
        """A zero tensor, kept so that loops written for the penalty form
        (``loss + ra.penalty()``) still run: the L1 pull of both stages is
        the decoupled proximal step inside :meth:`step`."""
        gates = self._gates()
        return torch.zeros((), dtype=gates[0].dtype, device=gates[0].device) if gates \
            else torch.zeros(())

    def shrink_strength(self) -> List[float]:
        """Per gate, this step's L1 strength before the learning rate: ``gamma``
        in stage 1, ``lam * w_k`` in stage 2 until the target, 0 once frozen."""
        n = len(self._gates())
        if self.frozen or not n:
            return [0.0] * n
        if self.stage == 1:
            return [self.gamma] * n
        lam, weights = self.controller.penalty_weights(self.state, self._live())
        return (lam * weights).tolist()

    # -------------------------------------------------------------- hook
    def attach(self, optimizer: torch.optim.Optimizer) -> "RankAdaptive":
        """Runs :meth:`step` after every ``optimizer.step()`` (an optimizer
        post-step hook), so an unchanged training loop trains both stages.  A
        step skipped by AMP's GradScaler never calls ``optimizer.step()``, so
        it skips the stage logic too.  Returns ``self``; :meth:`detach` undoes it.

        Example:
            >>> import torch, comera
            >>> layer = comera.TTLinear(16, 16, rank=4)
            >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
            >>> ra = comera.RankAdaptive(layer, stage1_steps=5).attach(opt)
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
        self._hooks = [optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self._step_impl(opt))]
        self._attached = optimizer
        return self

    def detach(self) -> None:
        """Removes the hook of :meth:`attach` (nothing if not attached)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._attached = [], None

    # -------------------------------------------------------------- step
    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Call right after ``optimizer.step()`` (unless :meth:`attach` is
        used): saliency update, decoupled L1 shrink of the gates (strength
        ``lr * gamma``, needs ``optimizer`` for ``lr``; without it only the
        dead zone acts), the proximal kill step, stage switch, the stage-2
        size controller, and pruning every ``prune_every`` steps (which
        needs ``optimizer``).  Sync-free (``sync_free``), no step but a prune
        step reads the device, and a NaN gate is reported by :meth:`check`."""
        if self._attached is not None:
            raise RuntimeError("RankAdaptive.step: attached to an optimizer, whose step() already "
                               "runs it (call detach() to drive it by hand)")
        self._step_impl(optimizer)

    @torch.no_grad()
    def _step_impl(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        if self.prune_every is not None and optimizer is None:
            raise TypeError("RankAdaptive.step: prune_every is set, so pass the optimizer "
                            "(its state is pruned with the model)")
        self.step_begin()
        self.step_gates(optimizer)
        self.step_end(optimizer)

    # The three parts of a step, for a caller that captures the middle one in
    # a CUDA graph (comera.pretrain.graphed): host, device only, host.
    def kill_rounds(self) -> int:
        """The masked kill rounds the next sync-free step runs (0 outside the
        part of stage 2 that kills): what a captured step costs on top of a
        few hundred small operations, each round several more."""
        lengths = [g.numel() for g in self._gates()]
        return 0 if self.frozen_by_schedule() else self.controller.kill_rounds(self.state.step,
                                                                              lengths)

    def frozen_by_schedule(self) -> bool:
        """Whether the ranks are frozen at the next step whatever the gates hold."""
        return self.controller.schedule_frozen(self.state.step)

    def capture_key(self) -> tuple:
        """What the device work of the next step depends on besides tensor
        values: the stage, whether the schedule froze the ranks, the gates'
        shapes and the number of kill rounds (which falls, in powers of two,
        as the budget's schedule slows).  A captured :meth:`step_gates` stays
        valid while the key is unchanged (the budget and learning rates are
        read from tensors).

        Example:
            >>> import torch, comera
            >>> ra = comera.RankAdaptive(comera.TTLinear(16, 16, rank=4), stage1_steps=1)
            >>> before = ra.capture_key(); ra.step(); ra.capture_key() == before
            False
        """
        return (self.stage, self.frozen_by_schedule(),
                tuple(tuple(g.shape) for g in self._gates()), self.kill_rounds())

    @torch.no_grad()
    def step_begin(self) -> None:
        """First part of :meth:`step` (host): follows moved or pruned gates
        and writes the step counter to the device (``state.clock``)."""
        self._follow()
        self.state.tick()

    @torch.no_grad()
    def step_gates(self, optimizer: Optional[torch.optim.Optimizer],
                   sync: Optional[bool] = None) -> None:
        """Second part of :meth:`step`: the gate step.  Sync-free
        (:meth:`uses_sync_free`), it only queues device work, so it can be
        captured in a CUDA graph and replayed while :meth:`capture_key` holds.
        ``sync``: overrides :meth:`uses_sync_free` for this call (the same
        result; reading the device stops the stage-2 kill loop early)."""
        if not self._layers:
            return
        self._check_pruner()
        params = self._gates()
        gates = self._values(params)
        fg = self._flat(gates)
        self._gate_step.run(self.state, fg, gates, self._rates(optimizer, params, fg.device),
                            sync=not self.uses_sync_free() if sync is None else sync)
        if gates is not params:
            self._agree(params, gates)

    @torch.no_grad()
    def step_end(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Last part of :meth:`step` (host): counts the step and prunes every
        ``prune_every`` steps (which reads the device)."""
        self.state.step += 1
        if not self._layers or self.prune_every is None or self.state.step % self.prune_every:
            return
        if optimizer is None:
            raise TypeError("RankAdaptive.step_end: prune_every is set, so pass the optimizer "
                            "(its state is pruned with the model)")
        self.check()
        gates = self._values(self._gates())
        keeps = [keep_indices(g) for g in gates]
        (self._pruner or prune)(self.model, optimizer)
        gates = self._values(self._gates())
        self.state.after_prune(gates, keeps)
        self._flat(gates)  # the new layout now, not in the next (maybe sync-free) step

    def check(self) -> None:
        """Raises the ValueError of a NaN gate met by an earlier sync-free
        step (:meth:`step` does not read the device then, so it defers the
        error to here; every prune step calls this).  No step changed a gate
        while one held a NaN.  Reads the device.

        Example:
            >>> import torch, comera
            >>> ra = comera.RankAdaptive(comera.TTLinear(16, 16, rank=4), stage1_steps=5)
            >>> ra.step(); ra.check()   # no NaN: nothing to raise
        """
        if bool(self.state.nan_seen):
            raise self._gate_step.nan_error(self.state.nan_gates.tolist(), deferred=True)

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, object]:
        """Counters, controller state and each gate entry's live/dead sign, so
        that a resumed run continues in the same stage with the same ranks."""
        return dict(self.state.checkpoint(), config=self._config())

    def _config(self) -> Dict[str, object]:
        return {k: getattr(self, k) for k in SAVED}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restores :meth:`state_dict` (load the model's weights first).  The
        schedule (stage lengths, target) comes from the constructor; a
        mismatch with the saved one is warned about."""
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("RankAdaptive.load_state_dict: expected a dict from "
                             "RankAdaptive.state_dict()")
        saved, mine = state.get("config", {}), self._config()
        diff = sorted(k for k in mine if k in saved and saved[k] != mine[k])
        if diff:
            warnings.warn(f"RankAdaptive.load_state_dict: the saved controller had other "
                          f"settings ({', '.join(f'{k}={saved[k]!r}' for k in diff)}); "
                          "continuing with this controller's", stacklevel=2)
        check_int("step", state["step"], 0)
        gates = self._values(self._gates())
        self.state.follow(gates)
        self.state.load_checkpoint(state, gates)
