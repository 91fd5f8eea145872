"""All the gates of a model as one flat vector, for the step of
:class:`comera.RankAdaptive`.

A model converted by :func:`comera.convert` has one gate per TT bond: 72 in
the ``comera pretrain`` tiny preset, each a short vector.  A step written as
a loop over the gates runs a few tensor operations per gate, and at this
size each costs more in dispatch than in arithmetic: the loop took 7 to 11
ms a step there, about a tenth of the training step.  Concatenated, the same
elementwise arithmetic is a few operations for the whole model.

Every per-gate quantity (counts, per-entry values, the padded (gate, entry)
matrix) comes from index tensors built once on the gates' device, so the
step never needs host data, nor reads the device.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (no call at all when it is there already)."""
    return t if t.device == device else t.to(device)


class FlatGates:
    """Offsets of gates of the given sizes in their concatenation on
    ``device``; ``spread``: the gates lie on several devices (then each is
    moved there and back).

    Example:
        >>> import torch
        >>> fg = FlatGates([2, 3])
        >>> flat = fg.cat([torch.tensor([1., 0.]), torch.tensor([0., 2., 3.])])
        >>> [t.tolist() for t in fg.split(flat)]
        [[1.0, 0.0], [0.0, 2.0, 3.0]]
        >>> fg.counts(flat != 0).tolist()
        [1, 2]
        >>> fg.pad(flat, -1.0).tolist()
        [[1.0, 0.0, -1.0], [0.0, 2.0, 3.0]]
        >>> fg.rank_within(flat).tolist()   # place in its gate, largest first
        [0, 1, 2, 1, 0]
    """

    def __init__(self, sizes: Sequence[int], device=torch.device("cpu"), spread: bool = False):
        self.sizes = [int(n) for n in sizes]
        self.device = torch.device(device)
        self.spread = spread
        self.width = max(self.sizes, default=0)
        starts, total = [], 0
        for n in self.sizes:
            starts.append(total)
            total += n
        self.total = total
        gate_of = [g for g, n in enumerate(self.sizes) for _ in range(n)]
        start_of = [starts[g] for g in gate_of]

        def as_long(values):
            return torch.tensor(values, dtype=torch.int64, device=self.device)
        self.gate_of, self._start_of = as_long(gate_of), as_long(start_of)
        # flat index -> index into the (gate, entry) matrix padded to `width`
        self._padded = as_long([g * self.width + i - s
                                for i, (g, s) in enumerate(zip(gate_of, start_of))])
        self._positions = torch.arange(total, device=self.device)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when ``tensors`` have this layout's sizes, in order, and lie
        on its device (or, when ``spread``, the first of them does)."""
        return len(tensors) == len(self.sizes) and all(
            t.numel() == n and (self.spread or t.device == self.device)
            for t, n in zip(tensors, self.sizes)) and (
            not tensors or tensors[0].device == self.device)

    def cat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors flattened and concatenated on this layout's device (a new tensor)."""
        if not tensors:
            return torch.zeros(0, device=self.device)
        flat = [t if t.dim() == 1 else t.reshape(-1) for t in tensors]
        return torch.cat([on_device(t, self.device) for t in flat] if self.spread else flat)

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Per-gate views of a flat tensor."""
        return list(flat.split(self.sizes))

    def write_(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """Copies a flat tensor back into the per-gate tensors (in place)."""
        if tensors:
            parts = [p if t.dim() == 1 else p.view(t.shape)
                     for p, t in zip(self.split(flat), tensors)]
            if self.spread:
                parts = [on_device(p, t.device) for p, t in zip(parts, tensors)]
            torch._foreach_copy_([t.data for t in tensors], parts)
            # writes through .data: bump the version counters so that what is
            # kept per parameter version (a layer's merged V and U) is renewed
            increment_version(list(tensors))

    def per_entry(self, per_gate: torch.Tensor) -> torch.Tensor:
        """One value per gate (a tensor) repeated over its entries (a flat tensor)."""
        return per_gate.index_select(0, self.gate_of)

    def counts(self, mask: torch.Tensor) -> torch.Tensor:
        """True entries of a flat boolean mask, per gate (an int64 tensor)."""
        out = torch.zeros(len(self.sizes), dtype=torch.int64, device=self.device)
        return out.index_add_(0, self.gate_of, mask.to(torch.int64))

    def pad(self, flat: torch.Tensor, fill) -> torch.Tensor:
        """The (gate, entry) matrix of a flat tensor, each gate padded with ``fill``."""
        out = flat.new_full((len(self.sizes) * self.width,), fill)
        return out.scatter(0, self._padded, flat).view(len(self.sizes), self.width)

    def unpad(self, matrix: torch.Tensor) -> torch.Tensor:
        """The flat tensor of a (gate, entry) matrix (the inverse of :meth:`pad`)."""
        return matrix.reshape(-1).index_select(0, self._padded)

    def rank_within(self, values: torch.Tensor) -> torch.Tensor:
        """Each entry's place in its gate when the gate is sorted by
        decreasing ``values`` (ties: the earlier entry first), from 0."""
        order = torch.sort(values, descending=True, stable=True).indices
        order = order.index_select(0, torch.sort(self.gate_of.index_select(0, order),
                                                 stable=True).indices)
        place = torch.empty_like(order).scatter_(0, order, self._positions)
        return place - self._start_of


class GateRates:
    """Each gate's current learning rate (its parameter group's ``lr``) as
    one float64 tensor, 0 for a gate the optimizer does not train.

    The gates' group membership is cached as masks on the device, so a step
    combines them with the groups' current ``lr`` (a float, or a tensor for
    capturable optimizers) without copying host data to the device.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
        >>> opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.5}])
        >>> GateRates()(opt, [a, b], torch.device("cpu")).tolist()
        [0.1, 0.5]
    """

    def __init__(self):
        self._key: Optional[Tuple] = None
        self._masks: List[Tuple[int, torch.Tensor]] = []

    def __call__(self, optimizer: Optional[torch.optim.Optimizer], gates: Sequence[torch.Tensor],
                 device: torch.device) -> Optional[torch.Tensor]:
        """Per gate, the learning rate (None without an optimizer or when it trains no gate)."""
        if optimizer is None:
            return None
        group_of: Dict[int, int] = {id(p): gi for gi, group in enumerate(optimizer.param_groups)
                                    for p in group["params"]}
        where = tuple(group_of.get(id(g), -1) for g in gates)
        key = (where, device)
        if key != self._key:
            self._masks = [(gi, torch.tensor([float(w == gi) for w in where], dtype=torch.float64,
                                             device=device)) for gi in sorted(set(where) - {-1})]
            self._key = key
        lr = None
        for gi, mask in self._masks:
            part = mask * optimizer.param_groups[gi]["lr"]
            lr = part if lr is None else lr + part
        return lr
