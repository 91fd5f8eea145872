"""The state of rank adaptation: what :class:`comera.RankAdaptive` owns and
hands to the rank controller and the gate step each step.

Everything that depends on gate values is a tensor on the gates' device,
so reading or updating it never waits for a GPU.  The step counter is a
host integer, because the stage follows from it without looking at the
device; ``clock`` is its copy on the device, written before each step, so
that a step captured in a CUDA graph reads the current step's budget
rather than the one of the step it was captured at.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch


def _signs_of(gates: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each entry's sign (int8): exact zeros are dead."""
    return [torch.sign(g.detach()).to(torch.int8).contiguous() for g in gates]


def _zero_saliency(gates: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [torch.zeros(g.shape, dtype=torch.float64, device=g.device) for g in gates]


def _fits(tensors: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> bool:
    """Same count, shapes and devices as the gates."""
    return len(tensors) == len(gates) and all(
        t.shape == g.shape and t.device == g.device for t, g in zip(tensors, gates))


@dataclass
class ControllerState:
    """Step counter, per-gate signs and saliency, and the stage-2 controller's
    scalars (0-d tensors on the first gate's device).

    Attributes:
        step: steps taken (a host int: the stage follows from it).
        clock: ``step`` as a float64 0-d tensor on the device (set by
            :meth:`tick`; the stage-2 budget reads it).
        signs: per gate (int8, on the gate's device): +-1 live, 0 dead.
        saliency: per gate (float64): running average of ``|g dL/dg|``.
        lam, lam0: the stage-2 penalty weight and its start value.
        size_start: the live size when stage 2 began (valid once ``started``).
        started: the stage-2 controller has started.
        frozen: the ranks no longer change (target reached).
        nan_seen, nan_gates: a NaN met by a sync-free step, and in which gates
            (raised later by :meth:`comera.RankAdaptive.check`).

    Example:
        >>> import torch
        >>> state = ControllerState.for_gates([torch.tensor([0.5, 0.0, -0.2])])
        >>> state.signs[0].tolist(), bool(state.frozen), state.checkpoint()["size_start"]
        ([1, 0, -1], False, None)
    """
    step: int
    signs: List[torch.Tensor]
    saliency: List[torch.Tensor]
    lam: torch.Tensor
    lam0: torch.Tensor
    size_start: torch.Tensor
    started: torch.Tensor
    frozen: torch.Tensor
    nan_seen: torch.Tensor
    nan_gates: torch.Tensor
    clock: torch.Tensor

    @classmethod
    def for_gates(cls, gates: Sequence[torch.Tensor]) -> "ControllerState":
        """A fresh state: step 0, signs from the gates, zero saliency."""
        home = gates[0].device if gates else torch.device("cpu")
        f64, flag = dict(dtype=torch.float64, device=home), dict(dtype=torch.bool, device=home)
        return cls(step=0, signs=_signs_of(gates), saliency=_zero_saliency(gates),
                   lam=torch.zeros((), **f64), lam0=torch.zeros((), **f64),
                   size_start=torch.zeros((), **f64), started=torch.zeros((), **flag),
                   frozen=torch.zeros((), **flag), nan_seen=torch.zeros((), **flag),
                   nan_gates=torch.zeros(len(gates), **flag), clock=torch.zeros((), **f64))

    _SCALARS = ("lam", "lam0", "size_start", "started", "frozen", "nan_seen", "nan_gates",
                "clock")

    @property
    def device(self) -> torch.device:
        """Where the scalars live (the first gate's device)."""
        return self.lam.device

    def fits(self, gates: Sequence[torch.Tensor]) -> bool:
        """Whether the per-gate tensors and the scalars fit ``gates`` (shapes
        and devices only: no value is read)."""
        return _fits(self.signs, gates) and _fits(self.saliency, gates) and (
            not gates or gates[0].device == self.device)

    def pack(self) -> torch.Tensor:
        """Signs, saliency and scalars as one float64 tensor (for a broadcast).

        Example:
            >>> import torch
            >>> a = ControllerState.for_gates([torch.tensor([0.5, 0.0])])
            >>> b = ControllerState.for_gates([torch.tensor([0.0, 0.2])])
            >>> _ = a.lam.fill_(3.0); b.unpack_(a.pack())
            >>> b.signs[0].tolist(), float(b.lam)
            ([1, 0], 3.0)
        """
        parts = [torch.cat([t.reshape(-1).double() for t in ts]) if ts else
                 torch.zeros(0, dtype=torch.float64, device=self.device)
                 for ts in (self.signs, self.saliency)]
        scalars = [getattr(self, name).reshape(-1).double() for name in self._SCALARS]
        return torch.cat([p.to(self.device) for p in parts] + scalars)

    def unpack_(self, packed: torch.Tensor) -> None:
        """Takes the values of :meth:`pack` (of a state with the same layout)."""
        at = 0
        for ts in (self.signs, self.saliency):
            for t in ts:
                t.copy_(packed[at:at + t.numel()].view(t.shape))
                at += t.numel()
        for name in self._SCALARS:
            t = getattr(self, name)
            t.copy_(packed[at:at + t.numel()].view(t.shape))
            at += t.numel()

    def follow(self, gates: Sequence[torch.Tensor]) -> None:
        """Rebuilds what no longer fits the gates (after a prune or a move to
        another device): the signs from the gates, the saliency from zero;
        the scalars move to the first gate's device."""
        if not _fits(self.signs, gates):
            self.signs = _signs_of(gates)
        if not _fits(self.saliency, gates):
            self.saliency = _zero_saliency(gates)
        if gates and gates[0].device != self.device:
            for name in self._SCALARS:
                setattr(self, name, getattr(self, name).to(gates[0].device))

    def tick(self) -> None:
        """Copies the host step counter to ``clock`` (a fill: no read of the device)."""
        self.clock.fill_(float(self.step))

    def note_nan(self, bad: torch.Tensor) -> None:
        """Records ``bad`` (per gate: holds a NaN) if it is the first NaN seen."""
        first = bad.any() & ~self.nan_seen
        self.nan_gates.copy_(torch.where(first, bad, self.nan_gates))
        self.nan_seen |= first

    def after_prune(self, gates: Sequence[torch.Tensor], keeps: Sequence[torch.Tensor]) -> None:
        """Cuts the saliency like :func:`comera.prune` cut the gates (``keeps``:
        the entries each gate kept) and rebuilds the signs."""
        self.saliency = [s.index_select(0, k.to(s.device)) if s.shape != g.shape else s
                         for s, k, g in zip(self.saliency, keeps, gates)]
        self.follow(gates)

    # ------------------------------------------------------- checkpoints
    def checkpoint(self) -> Dict[str, object]:
        """The fields of :meth:`comera.RankAdaptive.state_dict` (reads the device)."""
        started = bool(self.started)
        return {"step": self.step, "frozen": bool(self.frozen), "lam": float(self.lam),
                "lam0": float(self.lam0),
                "size_start": round(float(self.size_start)) if started else None,
                "signs": [s.clone() for s in self.signs],
                "saliency": [a.clone() for a in self.saliency]}

    def load_checkpoint(self, saved: Dict[str, object], gates: Sequence[torch.Tensor]) -> None:
        """Restores :meth:`checkpoint`'s fields.  Signs or saliency that do not
        fit the gates (older checkpoints have no saliency) start again from
        the gates and from zero."""
        self.step = saved["step"]
        self.frozen.fill_(bool(saved["frozen"]))
        self.lam.fill_(float(saved["lam"]))
        self.lam0.fill_(float(saved["lam0"]))
        size_start: Optional[float] = saved["size_start"]
        self.started.fill_(size_start is not None)
        self.size_start.fill_(0.0 if size_start is None else float(size_start))
        self.nan_seen.fill_(False)
        self.nan_gates.fill_(False)
        self.tick()
        signs, saliency = list(saved.get("signs", [])), list(saved.get("saliency", []))
        same = [len(t) == len(gates) and all(a.shape == g.shape for a, g in zip(t, gates))
                for t in (signs, saliency)]
        self.signs = ([s.to(device=g.device, dtype=torch.int8).clone().contiguous()
                       for s, g in zip(signs, gates)] if same[0] else _signs_of(gates))
        self.saliency = ([a.to(device=g.device, dtype=torch.float64).clone()
                          for a, g in zip(saliency, gates)] if same[1] else _zero_saliency(gates))
