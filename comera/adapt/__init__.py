"""Rank adaptation: :class:`RankAdaptive` (the two-stage schedule and its
optimizer hook), the rank controller, the gates' flat view, balancing and
physical pruning.  Built on :mod:`comera.layers` and :mod:`comera.ops`."""
from comera.adapt.prune import prune
from comera.adapt.rank_adaptive import RankAdaptive

__all__ = ["RankAdaptive", "prune"]
