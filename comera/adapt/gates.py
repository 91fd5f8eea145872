"""All the gates of a model as one flat vector, for the host step of
:class:`comera.RankAdaptive`.

A model converted by :func:`comera.convert` has one gate per TT bond: 72 in
the ``comera pretrain`` tiny preset, each a short vector.  A step written as
a loop over the gates runs a few tensor operations per gate, and at this
size each costs more in dispatch than in arithmetic: the loop took 7 to 11
ms a step there, about a tenth of the training step.  Concatenated, the same
elementwise arithmetic is a few operations for the whole model, and
:meth:`FlatGates.split` gives the per-gate pieces back as views.
"""
from typing import List, Sequence

import torch


class FlatGates:
    """Offsets of gates of the given sizes in their concatenation.

    Example:
        >>> import torch
        >>> fg = FlatGates([2, 3])
        >>> flat = fg.cat([torch.tensor([1., 0.]), torch.tensor([0., 2., 3.])])
        >>> [t.tolist() for t in fg.split(flat)]
        [[1.0, 0.0], [0.0, 2.0, 3.0]]
        >>> fg.counts(flat != 0)
        [1, 2]
        >>> fg.locate(torch.tensor([1, 4]))
        [(0, 1), (1, 2)]
    """

    def __init__(self, sizes: Sequence[int]):
        self.sizes = [int(n) for n in sizes]
        starts, total = [], 0
        for n in self.sizes:
            starts.append(total)
            total += n
        self.starts = starts
        self.total = total
        self.gate_of = torch.repeat_interleave(torch.arange(len(self.sizes)),
                                               torch.tensor(self.sizes, dtype=torch.long))

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when ``tensors`` have this object's sizes, in order."""
        return len(tensors) == len(self.sizes) and all(
            t.numel() == n for t, n in zip(tensors, self.sizes))

    def cat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors flattened and concatenated (a new tensor)."""
        if not tensors:
            return torch.zeros(0)
        return torch.cat([t.reshape(-1) for t in tensors])

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Per-gate views of a flat tensor."""
        return list(flat.split(self.sizes))

    def per_entry(self, values: Sequence, dtype: torch.dtype, device) -> torch.Tensor:
        """One value per gate repeated over its entries (a flat tensor)."""
        per_gate = torch.tensor(values, dtype=dtype, device=device)
        return per_gate.repeat_interleave(torch.tensor(self.sizes, dtype=torch.long,
                                                       device=device), output_size=self.total)

    def counts(self, mask: torch.Tensor) -> List[int]:
        """True entries of a flat boolean mask, per gate."""
        out = torch.zeros(len(self.sizes), dtype=torch.long, device=mask.device)
        out.index_add_(0, self.gate_of.to(mask.device), mask.to(torch.long))
        return out.tolist()

    def locate(self, flat_index: torch.Tensor) -> List[tuple]:
        """(gate, entry) of each flat index."""
        gates = self.gate_of[flat_index.cpu()].tolist()
        return [(g, i - self.starts[g]) for g, i in zip(gates, flat_index.tolist())]
