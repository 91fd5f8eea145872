"""Rank pruning under torch.nn.parallel.DistributedDataParallel.

Training a converted model under DDP needs nothing special: the TT cores and
gates are ordinary Parameters, DDP averages their gradients, and every process
takes the same optimizer and RankAdaptive steps, so the gates (and the dead
ranks) are the same everywhere.

Physical truncation (:func:`comera.prune`) is the one step that needs care:
it changes parameter *shapes*, and DDP built its gradient buckets (and
checked that every process agrees) for the old shapes.  So, in every process
at the same step::

    model, pruned = comera.integrations.ddp.prune(model, optimizer)

which (1) broadcasts every gate from rank 0, so the set of dead ranks is
bit-identical in every process even if floating-point noise differed,
(2) prunes ``model.module`` and the optimizer state in place (the Parameter
objects stay, so the optimizer keeps working), (3) checks that every process
ended with the same ranks, and (4) wraps the module in a fresh
DistributedDataParallel with the same settings (:func:`rewrap`).  Use the
returned model from then on.  A ``torch.compile``\\ d model recompiles once
for the new shapes.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import increment_version
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from comera.layers.base import tt_layers
from comera.adapt.prune import prune as comera_prune


def _check_ddp(ddp_model, fn: str) -> None:
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"{fn}: expected a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")


def rewrap(ddp_model: DistributedDataParallel, **ddp_kwargs) -> DistributedDataParallel:
    """A new DistributedDataParallel around ``ddp_model.module`` with the same
    settings (device_ids, output_device, dim, process_group,
    find_unused_parameters, gradient_as_bucket_view, static_graph); keyword
    arguments override them or add others (bucket_cap_mb, ...).  Call it in
    every process after parameter shapes changed.

    Example (in each of the processes of an initialised process group):
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)   # doctest: +SKIP
        >>> comera.prune(ddp.module, optimizer)                       # doctest: +SKIP
        >>> ddp = comera.integrations.ddp.rewrap(ddp)                 # doctest: +SKIP
    """
    _check_ddp(ddp_model, "rewrap")
    kwargs = dict(device_ids=ddp_model.device_ids, output_device=ddp_model.output_device,
                  dim=ddp_model.dim, process_group=ddp_model.process_group,
                  find_unused_parameters=ddp_model.find_unused_parameters,
                  gradient_as_bucket_view=ddp_model.gradient_as_bucket_view,
                  static_graph=bool(getattr(ddp_model, "static_graph", False)))
    kwargs.update(ddp_kwargs)
    return DistributedDataParallel(ddp_model.module, **kwargs)


@torch.no_grad()
def sync_gates(model: nn.Module, src: int = 0, group=None) -> None:
    """Broadcasts the gates of every TT layer in ``model`` from process ``src``.

    Example (in every process):
        >>> comera.integrations.ddp.sync_gates(ddp.module)     # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sync_gates: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    for _, layer in tt_layers(model):
        for g in layer.gates:
            dist.broadcast(g.data, src=src, group=group)
        increment_version(list(layer.gates))  # written through .data


def all_ranks(model: nn.Module) -> Dict[str, List[int]]:
    """``{layer name: ranks}`` of every TT layer in ``model``."""
    return {name: [int(c.shape[-1]) for c in list(layer.cores)[:-1]] for name, layer in tt_layers(model)}


def prune(ddp_model: DistributedDataParallel, optimizer: Optional[torch.optim.Optimizer] = None,
          **ddp_kwargs) -> Tuple[DistributedDataParallel, Dict[str, List[int]]]:
    """:func:`comera.prune` for a DDP model: same dead ranks in every process,
    then a re-wrapped DDP model.  Call it in every process at the same step.

    Returns ``(model, pruned)``: the DDP model to use from now on (``ddp_model``
    itself when no rank was cut) and ``{layer name: new ranks}``.  Raises
    RuntimeError when the processes end up with different ranks.

    Example (in each process of a 2-process gloo group):
        >>> ddp = torch.nn.parallel.DistributedDataParallel(comera.convert(net, rank=8))  # doctest: +SKIP
        >>> ...  # train with comera.RankAdaptive; some gates reach exactly 0
        >>> ddp, pruned = comera.integrations.ddp.prune(ddp, optimizer)                 # doctest: +SKIP
    """
    _check_ddp(ddp_model, "prune")
    group = ddp_model.process_group
    sync_gates(ddp_model.module, src=0, group=group)
    pruned = comera_prune(ddp_model.module, optimizer)
    mine = all_ranks(ddp_model.module)
    everyone: List[Optional[Dict[str, List[int]]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(r != mine for r in everyone):
        raise RuntimeError(f"comera.integrations.ddp.prune: the processes disagree on the ranks "
                           f"after pruning: {everyone}")
    if not pruned:
        return ddp_model, pruned
    return rewrap(ddp_model, **ddp_kwargs), pruned
