"""Rank adaptation: :class:`RankAdaptive` (the two-stage schedule and its
optimizer hook, ``rank_adaptive``), the step on the gates (``step``), the
rank controller over tensors (``controller``) and its state (``state``),
the gates' flat view (``gates``), argument checks (``settings``), balancing
(``balance``) and physical pruning (``prune``).  Built on
:mod:`comera.layers` and :mod:`comera.ops`."""
from comera.adapt.prune import prune
from comera.adapt.rank_adaptive import RankAdaptive

__all__ = ["RankAdaptive", "prune"]
