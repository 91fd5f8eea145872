"""Rank adaptation and pruning under FSDP2 (``torch.distributed.fsdp.fully_shard``).

Sharding TT layers needs nothing special: ``fully_shard`` each TT layer
(or a block holding some) and then the model, and train as usual.  The
cores and gates become DTensors sharded on their first dim, which
:class:`comera.RankAdaptive` handles by itself (built before or after
sharding): it gathers the gates' whole values for its step, takes process
0's outcome everywhere, and each process writes its own piece back
(docs/distributed.md).

Pruning is the step that needs FSDP's cooperation: it changes parameter
shapes, and FSDP keeps its own records of each sharded parameter (sizes,
padding, the buffers it all-gathers into).  :func:`prune` cuts the dead
ranks of every sharded TT layer out of the parameters, their gradients and
the optimizer state, and renews FSDP's records; the Parameter objects stay
the same objects, so the optimizer keeps working.  Pass it to the
controller::

    ra = comera.RankAdaptive(model, prune_every=100, pruner=comera.integrations.fsdp.prune)

Checkpoints of a sharded model: :func:`full_state_dict` /
:func:`load_full_state_dict` (model) and :func:`full_optimizer_state_dict`
/ :func:`load_full_optimizer_state_dict` (optimizer) gather to, and load
from, whole tensors; loading first resizes pruned TT layers to the
checkpoint's ranks.  Every function here is collective: call it in every
process, at the same point.

FSDP's records are renewed through its parameter objects (``FSDPParam``),
written against torch 2.13; tests/integrations/test_fsdp.py checks them.
"""
from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from comera.adapt.prune import cut, keep_indices
from comera.layers.base import checkpoint_shapes, full_value, is_sharded, tt_layers

__all__ = ["prune", "all_ranks", "full_state_dict", "load_full_state_dict",
           "full_optimizer_state_dict", "load_full_optimizer_state_dict"]


def _fsdp_params(model: nn.Module) -> Dict[int, object]:
    """id(sharded parameter) -> the FSDPParam that manages it, for every FSDP
    module in ``model``; all of them resharded first, so that the sharded
    parameters are the registered ones."""
    out = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        module.reshard()
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                out[id(fp.sharded_param)] = fp
    return out


@torch.no_grad()
def _reshape(param: nn.Parameter, value: torch.Tensor, fp) -> None:
    """Gives the sharded ``param`` the whole value ``value`` of another shape:
    FSDP shards it anew (its sizes, padding and placement records), the
    Parameter object is kept, and its all-gather buffers are rebuilt at the
    next unshard."""
    placement = fp.fsdp_placement
    place = None if placement == Shard(0) else (lambda _p: placement)
    whole = nn.Parameter(value.to(param.dtype).contiguous(), requires_grad=param.requires_grad)
    fp._init_sharded_param(whole, fp.device, place, fp.mesh_info)
    fresh = fp.sharded_param
    torch.utils.swap_tensors(param, fresh)   # the old object now holds the new shard
    fp.sharded_param = param
    fp._setattr_on_modules(param)
    if fp.post_forward_mesh_info:
        fp._init_sharded_post_forward_param_metadata(whole)
    fp._init_extensions()
    fp.all_gather_outputs = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param               # rebuilt for the new size when needed
    fp.init_dtype_attrs(fp.mp_policy)


def _like(value: torch.Tensor, param: DTensor) -> DTensor:
    """The whole tensor ``value`` as a DTensor placed like ``param`` (every
    process passes the same ``value``; no communication)."""
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)


@torch.no_grad()
def _cut_state(param: DTensor, old_shape: torch.Size, left, right, optimizer) -> None:
    """Cuts the gradient and the optimizer state of a pruned sharded parameter."""
    if param.grad is not None:
        g = param.grad
        param.grad = None if g.shape != old_shape else \
            _like(cut(full_value(g), left, right), param) if is_sharded(g) else None
    if optimizer is None or param not in optimizer.state:
        return
    state = optimizer.state[param]
    for key in sorted(state, key=str):
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.shape != old_shape:
            continue
        new = cut(full_value(value), left, right)
        state[key] = _like(new, param) if is_sharded(value) else new


def all_ranks(model: nn.Module) -> Dict[str, List[int]]:
    """``{layer name: ranks}`` of every TT layer in ``model`` (shapes only: no collective)."""
    return {name: [int(c.shape[-1]) for c in list(layer.cores)[:-1]]
            for name, layer in tt_layers(model)}


def _agree(model: nn.Module, what: str) -> None:
    mine = all_ranks(model)
    everyone: List[Optional[Dict[str, List[int]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(r != mine for r in everyone):
        raise RuntimeError(f"comera.integrations.fsdp.{what}: the processes disagree on the TT "
                           f"ranks: {everyone}")


def prune(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
          root: Optional[nn.Module] = None) -> Dict[str, List[int]]:
    """:func:`comera.prune` for a model whose TT layers are sharded by
    ``fully_shard``: the dead ranks (zero gate entries, read from the
    gathered gates, the same in every process) are cut out of the cores and
    gates, their gradients and the optimizer's state, and FSDP's records of
    the parameters are renewed.  Layers that are not sharded are pruned as
    :func:`comera.prune` does.  Call it in every process at the same step
    (it is collective); it checks that the processes end with the same
    ranks (RuntimeError otherwise).  ``root``: the module holding the FSDP
    modules that shard ``model``'s TT layers, when ``model`` does not (a
    root sharded around it; default ``model``).

    Returns ``{layer name: new ranks}`` for the layers that changed.

    Example (in every process of a 2-process gloo group):
        >>> for layer in model.tt_layers: fully_shard(layer)          # doctest: +SKIP
        >>> fully_shard(model)                                         # doctest: +SKIP
        >>> comera.integrations.fsdp.prune(model, optimizer)           # doctest: +SKIP
        {'0': [4, 2, 3]}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prune: model must be an nn.Module, got {type(model).__name__}")
    managed = _fsdp_params(model if root is None else root)
    layers = list(tt_layers(model))
    gates = {name: [full_value(g) for g in layer.gates] for name, layer in layers}
    for name, values in gates.items():
        for k, g in enumerate(values):
            if torch.isnan(g).any():
                raise ValueError(f"prune: gate {k} of layer '{name or '<model>'}' contains NaN; "
                                 "refusing to prune on NaN (check the learning rate / loss)")
    changed: Dict[str, List[int]] = {}
    for name, layer in layers:
        keeps = [keep_indices(g) for g in gates[name]]
        cuts = [None if keep.numel() == g.numel() else keep for keep, g in zip(keeps, gates[name])]
        if all(c is None for c in cuts):
            continue
        cores, gs = list(layer.cores), list(layer.gates)
        # (parameter, rank cut of its first dim, of its last dim)
        jobs = [(c, cuts[k - 1] if k > 0 else None, cuts[k] if k < len(cuts) else None)
                for k, c in enumerate(cores)] + [(g, cuts[k], None) for k, g in enumerate(gs)]
        for p, left, right in jobs:
            if left is None and right is None:
                continue
            fp = managed.get(id(p))
            if fp is None:
                raise TypeError(f"prune: a parameter of TT layer '{name or '<model>'}' is not "
                                "sharded by an FSDP module of this model (comera.prune prunes "
                                "unsharded models)")
            old_shape = p.shape
            _reshape(p, cut(full_value(p), left, right), fp)
            _cut_state(p, old_shape, left, right, optimizer)
        changed[name] = [c.shape[-1] for c in list(layer.cores)[:-1]]
    _agree(model, "prune")
    return changed


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered whole, on the
    CPU, in every process (collective)."""
    return {k: full_value(v).cpu() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *,
                         root: Optional[nn.Module] = None) -> None:
    """Loads a whole-tensor state dict (:func:`full_state_dict`, or one saved
    from an unsharded model) into a sharded model: sharded TT layers are first
    resized to the checkpoint's ranks (as :meth:`load_state_dict` does for
    plain ones), then every tensor takes its values.  Keys must match exactly
    (KeyError naming the difference).  ``root``: as for :func:`prune`."""
    managed = _fsdp_params(model if root is None else root)
    for name, layer in tt_layers(model):
        prefix = f"{name}." if name else ""
        core_shapes, gate_shapes = checkpoint_shapes(layer, state_dict, prefix)
        for plist, shapes in ((layer.cores, core_shapes), (layer.gates, gate_shapes)):
            for k, shape in shapes.items():
                p = plist[k]
                if p.shape == shape:
                    continue
                if not is_sharded(p):
                    raise TypeError(f"load_full_state_dict: layer '{name}' is not sharded: "
                                    "use comera.storage.load_state_dict")
                _reshape(p, torch.zeros(shape, dtype=p.dtype, device=p.device), managed[id(p)])
                p.grad = None
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    for key, t in own.items():
        value = state_dict[key]
        if isinstance(t, torch.Tensor):
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"load_full_state_dict: {key} has shape {tuple(value.shape)} "
                                 f"in the checkpoint, {tuple(t.shape)} in the model")
            if is_sharded(t):
                t.to_local().copy_(_like(value.to(t.dtype), t).to_local())
            else:
                t.copy_(value)


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded state tensor gathered
    whole, on the CPU, in every process (collective)."""
    sd = optimizer.state_dict()
    state = {}
    for idx in sorted(sd["state"]):
        state[idx] = {k: full_value(v).cpu() if is_sharded(v) else v
                      for k, v in sorted(sd["state"][idx].items(), key=lambda kv: str(kv[0]))}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Loads :func:`full_optimizer_state_dict` into an optimizer over sharded
    parameters: every state tensor shaped like its (whole) parameter is placed
    like the parameter, then ``optimizer.load_state_dict`` takes it (load the
    model first, so that pruned parameters have their checkpoint shapes)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for idx, entry in state_dict["state"].items():
        p = params[int(idx)]
        state[idx] = {k: _like(v, p) if is_sharded(p) and isinstance(v, torch.Tensor)
                      and v.shape == p.shape else v for k, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
