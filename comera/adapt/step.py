"""One rank-adaptation step on the gates of a model (docs/design.md section 4).

After the optimizer's step, :class:`GateStep`:

1. updates each entry's saliency, the running average of ``|g dL/dg|``;
2. shrinks every live entry, ``g <- sign(g) max(|g| - lr * strength, 0)``
   (strength ``gamma`` in stage 1, ``lam * w_b`` in stage 2), keeping the
   ``min_rank`` largest of a gate that would fall below ``min_rank``;
3. applies the proximal rule of ``comera::gate_prox_``, which proposes the
   deaths (entries at 0, across 0, or within ``threshold`` of it);
4. with a target, asks :class:`comera.adapt.controller.RankController`
   which proposed deaths to undo and which ranks to kill besides, and
   writes its answer into the gates and signs.

Steps 1 to 3 are one call of the fused operator ``comera::gate_step_``
(:func:`comera.ops.gate_step_`: one kernel launch on CUDA) whenever the
gates and their state share one device and dtype that it has a kernel for;
otherwise (gates spread over devices, half precision on the CPU) they run
as tensor code on the gates concatenated into one flat vector
(:class:`comera.adapt.gates.FlatGates`), the same on the CPU and on CUDA,
and the reference the operator is tested against.  Step 4 is tensor code.

With ``sync=False`` nothing reads the device: a NaN gate makes the step a
no-op and is recorded in the state (raised later by
:meth:`comera.RankAdaptive.check`).  With ``sync=True`` the step raises on
a NaN at once, skips the review of frozen ranks and lets the controller stop
its loops early.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version
from torch import nn

from comera.adapt.controller import INF, RankController
from comera.adapt.gates import FlatGates, on_device
from comera.adapt.state import ControllerState
from comera.layers.base import full_value
from comera.ops.gate_prox import gate_prox_
from comera.ops.gate_step import gate_step_, has_gate_step_kernel

# Running average of the saliency |g * dL/dg|: weight of the past.
SALIENCY_DECAY = 0.9


def update_saliency(fg: FlatGates, saliency: List[torch.Tensor], gates: Sequence[torch.Tensor],
                    flat: torch.Tensor, ok: torch.Tensor) -> None:
    """Running average of ``|g dL/dg|`` (this step's gradient) for every gate
    that has one; ``flat``: the gates' values, concatenated; nothing changes
    unless ``ok``."""
    grads = [g.grad for g in gates]
    have = [gr is not None and gr.shape == g.shape for g, gr in zip(gates, grads)]
    if not any(have):
        return
    if all(have):
        contribs = fg.split((flat * fg.cat(grads)).abs().double())
    else:  # some gates got no gradient this step
        contribs = [(g.detach() * gr).abs().double() if h else None
                    for g, gr, h in zip(gates, grads, have)]
    idx = [i for i, h in enumerate(have) if h]
    moved = torch._foreach_mul([saliency[i] for i in idx], SALIENCY_DECAY)
    torch._foreach_add_(moved, [on_device(contribs[i], saliency[i].device) for i in idx],
                        alpha=1.0 - SALIENCY_DECAY)
    new = list(saliency)
    for i, m in zip(idx, moved):
        new[i] = m
    fg.write_(saliency, torch.where(ok, fg.cat(new), fg.cat(saliency)))


class GateStep:
    """The step of :class:`comera.RankAdaptive` on the gates (module doc).

    Args:
        controller: decides the stage-2 kills and the revivals.
        layers: (name, TT layer) pairs, in the order of the gates.
        threshold: the proximal kernel's dead zone.
        rule: what a rank's contribution is, ``"saliency"`` or ``"magnitude"``.

    Example:
        >>> import torch, comera
        >>> from comera.adapt.controller import RankController
        >>> from comera.adapt.gates import FlatGates
        >>> from comera.adapt.state import ControllerState
        >>> layer = comera.TTLinear(16, 16, rank=4, in_shape=[4, 4], out_shape=[4, 4])
        >>> gates = list(layer.gates)
        >>> ctl = RankController([[4, 4, 4, 4]], gamma=0.5, stage1_steps=10,
        ...                      stage2_steps=0, target_size=None)
        >>> state = ControllerState.for_gates(gates)
        >>> fg = FlatGates([g.numel() for g in gates])
        >>> with torch.no_grad():
        ...     gates[1][1] = 1e-3                        # inside the dead zone
        >>> GateStep(ctl, [("", layer)], threshold=1e-2, rule="saliency").run(
        ...     state, fg, gates, lr=None, sync=True)
        >>> state.signs[1].tolist()
        [1, 0, 1, 1]
    """

    def __init__(self, controller: RankController, layers: Sequence[Tuple[str, nn.Module]], *,
                 threshold: float, rule: str):
        self.controller = controller
        self.layers = list(layers)
        self.threshold = threshold
        self.rule = rule
        self.fused = True  # False: always the tensor code (the reference in tests)
        self._none: Optional[torch.Tensor] = None  # the empty "no gradient" tensor

    @torch.no_grad()
    def run(self, state: ControllerState, fg: FlatGates, gates: Sequence[torch.Tensor],
            lr: Optional[torch.Tensor], sync: bool) -> None:
        """One step (module doc); ``lr``: per gate, its learning rate (None:
        no shrink, only the dead zone acts); ``sync``: may read the device."""
        if self.fused and self.fits_fused(state, fg, gates, lr):
            self._run_fused(state, fg, gates, lr, sync)
            return
        ctl = self.controller
        flat = fg.cat(gates)  # a copy: the values before this step
        bad = fg.counts(torch.isnan(flat)) > 0
        if sync and bool(bad.any()):
            raise self.nan_error(bad.tolist())
        ok = ~bad.any()
        state.note_nan(bad)
        update_saliency(fg, state.saliency, gates, flat, ok)
        done = ctl.schedule_frozen(state.step)
        if done and ctl.target_size is not None:
            state.frozen.fill_(True)
        kill = not done and not (sync and bool(state.frozen))
        review = kill and ctl.target_size is not None and len(gates) > 0
        signs0 = fg.cat(state.signs) if review else None
        frozen0 = state.frozen.clone()
        if kill and lr is not None:
            self._shrink(state, fg, gates, flat, lr, ok & ~frozen0)
        live = gate_prox_([g.data for g in gates], state.signs, self.threshold, ctl.min_rank, kill)
        increment_version(gates)  # written through .data: see FlatGates.write_
        if sync and bool((live < 0).any()):
            raise self.nan_error((live < 0).tolist())
        if review:
            self._review(state, fg, gates, flat, signs0, frozen0 & ok, ok, sync)

    def fits_fused(self, state: ControllerState, fg: FlatGates, gates: Sequence[torch.Tensor],
                   lr: Optional[torch.Tensor]) -> bool:
        """Whether ``comera::gate_step_`` can take this step: contiguous 1-D
        gates of one dtype on one device with a kernel, their signs,
        saliency (float64), gradients (or none) and ``lr`` there too.

        Example:
            >>> import torch
            >>> from comera.adapt.controller import RankController
            >>> from comera.adapt.gates import FlatGates
            >>> from comera.adapt.state import ControllerState
            >>> ctl = RankController([[2, 3], [2, 3]], gamma=0.5, stage1_steps=1,
            ...                      stage2_steps=0, target_size=None)
            >>> step = GateStep(ctl, [], threshold=0.0, rule="saliency")
            >>> gates = [torch.ones(3), torch.ones(2)]
            >>> step.fits_fused(ControllerState.for_gates(gates), FlatGates([3, 2]), gates, None)
            True
            >>> half = [g.bfloat16() for g in gates]   # no CPU kernel for bfloat16
            >>> step.fits_fused(ControllerState.for_gates(half), FlatGates([3, 2]), half, None)
            False
        """
        if not gates or fg.spread:
            return False
        dtype, device = gates[0].dtype, gates[0].device
        if state.device != device or not has_gate_step_kernel(device, dtype) or (
                lr is not None and lr.device != device):
            return False
        for g, s, a in zip(gates, state.signs, state.saliency):
            gr = g.grad
            if (g.dtype != dtype or g.device != device or g.dim() != 1 or not g.is_contiguous()
                    or s.dtype != torch.int8 or s.device != device or not s.is_contiguous()
                    or a.dtype != torch.float64 or a.device != device or not a.is_contiguous()):
                return False
            if gr is not None and gr.shape == g.shape and (
                    gr.dtype != dtype or gr.device != device or not gr.is_contiguous()):
                return False
        return True

    def _run_fused(self, state: ControllerState, fg: FlatGates, gates: Sequence[torch.Tensor],
                   lr: Optional[torch.Tensor], sync: bool) -> None:
        """:meth:`run` with steps 1-3 in one ``comera::gate_step_`` call, in
        the order of the tensor code: a NaN raises (``sync``) with nothing
        changed, else is recorded in the state by the operator."""
        ctl = self.controller
        done = ctl.schedule_frozen(state.step)
        kill = not done and not (sync and bool(state.frozen))
        review = kill and ctl.target_size is not None
        flat = fg.cat(gates) if review else None  # the values before this step
        signs0 = fg.cat(state.signs) if review else None
        frozen0 = state.frozen.clone() if review else None
        amount = self._amount(state, fg, lr, gates[0].dtype) if kill and lr is not None else None
        if self._none is None or self._none.device != gates[0].device or (
                self._none.dtype != gates[0].dtype):
            self._none = gates[0].new_empty(0)
        grads = [g.grad if g.grad is not None and g.grad.shape == g.shape else self._none
                 for g in gates]
        # the gates themselves, not .data (a dispatched detach each): no_grad here
        live = gate_step_(list(gates), state.signs, grads, state.saliency, amount,
                          threshold=self.threshold, min_live=ctl.min_rank, kill=kill,
                          frozen=state.frozen, nan_seen=None if sync else state.nan_seen,
                          nan_gates=None if sync else state.nan_gates)
        increment_version(list(gates))  # written behind autograd: see FlatGates.write_
        if sync and bool((live < 0).any()):
            raise self.nan_error((live < 0).tolist())
        if done and ctl.target_size is not None:
            state.frozen.fill_(True)
        if review:
            ok = (live >= 0).all()
            self._review(state, fg, gates, flat, signs0, frozen0 & ok, ok, sync)

    def _amount(self, state: ControllerState, fg: FlatGates, lr: torch.Tensor,
                dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Per gate, this step's shrink ``lr * strength`` in the gates' dtype
        (None: no shrink, stage 1 with ``gamma`` 0)."""
        ctl = self.controller
        if ctl.stage(state.step) == 2:
            lam, weights = ctl.penalty_weights(state, fg.counts(fg.cat(state.signs) != 0))
            return (lr * (lam * weights)).to(dtype)
        return (lr * ctl.gamma).to(dtype) if ctl.gamma > 0 else None

    def _shrink(self, state: ControllerState, fg: FlatGates, gates, flat: torch.Tensor,
                lr: torch.Tensor, keep: torch.Tensor) -> None:
        """The decoupled L1 step; a gate it would leave with fewer than
        ``min_rank`` non-zero entries keeps its largest ones unshrunk (ties:
        the earlier entry; the kernel then keeps them alive).  Where ``keep`` is False (a NaN gate,
        frozen ranks) the gates stay as they are."""
        ctl = self.controller
        per_gate = self._amount(state, fg, lr, flat.dtype)
        if per_gate is None:
            return
        signs = fg.cat(state.signs)
        amount = fg.per_entry(per_gate)
        # dead entries may have been moved by the optimizer (momentum): the kernel re-zeroes them
        old = torch.where(signs != 0, flat, torch.zeros_like(flat))
        new = old.sign() * (old.abs() - amount).clamp_min(0)
        need = fg.counts(old != 0).clamp_max(ctl.min_rank)
        short = fg.counts(new != 0) < need
        rescue = ((fg.rank_within(old.abs()) < fg.per_entry(need)) & fg.per_entry(short)
                  & (new == 0))
        fg.write_(gates, torch.where(keep, torch.where(rescue, old, new), flat))

    def _review(self, state: ControllerState, fg: FlatGates, gates, before: torch.Tensor,
                signs0: torch.Tensor, frozen: torch.Tensor, ok: torch.Tensor, sync: bool) -> None:
        """Undoes the kernel's kills where the ranks were frozen, then asks the
        controller and writes its revivals and kills into gates and signs.
        ``before``, ``signs0``: the gates and signs before this step."""
        after, signs = fg.cat(gates), fg.cat(state.signs)
        # frozen ranks: the step acts as the kernel without kills (kill=False)
        now = before.sign().to(torch.int8)
        after = torch.where(frozen, torch.where(signs0 == 0, torch.zeros_like(before), before),
                            after)
        signs = torch.where(frozen, torch.where((signs0 != 0) & (now != 0), now, signs0), signs)
        died = (signs0 != 0) & (signs == 0) & (before != 0)
        candidates = (signs != 0) | died
        norms = self.slice_norms(fg) if self.rule == "magnitude" else None

        def scores() -> torch.Tensor:
            value = torch.where(died, before, after)
            contrib = self.contributions(fg, state.saliency, value, norms)
            return fg.pad(torch.where(candidates, contrib, INF), INF)

        revive, kill = self.controller.decide(
            state, fg.counts(signs != 0), fg.pad(died, False), fg.pad(before.abs().double(), 0.0),
            scores, ok, fg.sizes, sync)
        revive, kill = fg.unpad(revive), fg.unpad(kill)
        back = torch.where(before > 0, 1, -1).to(torch.int8)
        fg.write_(gates, torch.where(kill, torch.zeros_like(before),
                                     torch.where(revive, before, after)))
        fg.write_(state.signs, torch.where(kill, torch.zeros_like(signs),
                                           torch.where(revive, back, signs)))

    def slice_norms(self, fg: FlatGates) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per gate entry j (flat): the norms of the core slices that rank j
        joins, left and right (sharded cores are gathered: a collective)."""
        lefts, rights = [], []
        for _, layer in self.layers:
            cores = [full_value(c) for c in layer.cores]
            for k in range(len(layer.gates)):
                lefts.append(cores[k].reshape(-1, cores[k].shape[-1]).norm(dim=0))
                rights.append(cores[k + 1].reshape(cores[k + 1].shape[0], -1).norm(dim=1))
        return fg.cat(lefts), fg.cat(rights)

    def contributions(self, fg: FlatGates, saliency: Sequence[torch.Tensor],
                      value: torch.Tensor,
                      norms: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Each entry's contribution (flat, float64): how much removing it would
        cost.  ``"saliency"``: the running average of ``|g_j dL/dg_j|`` (the
        first-order loss change).  ``"magnitude"``: ``|g_j| * ||left slice j||
        * ||right slice j||`` at ``value``, the size of rank j's contribution
        (``norms``: :meth:`slice_norms`, computed here when not given)."""
        if self.rule == "saliency":
            return fg.cat(saliency)
        lefts, rights = norms if norms is not None else self.slice_norms(fg)
        return (value.abs() * lefts * rights).double()

    def nan_error(self, bad: Sequence[bool], deferred: bool = False) -> ValueError:
        """The error for the first gate marked in ``bad``, naming its layer."""
        where = [(name, k) for name, layer in self.layers for k in range(len(layer.gates))]
        name, k = where[list(bad).index(True)]
        when = ("(seen by an earlier step on the device; no step changed a gate while "
                "it held NaN" if deferred else "(no gate was changed")
        return ValueError(f"RankAdaptive.step: gate {k} of layer '{name or '<model>'}' contains "
                          f"NaN {when}; check the learning rate and the loss)")
