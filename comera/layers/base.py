"""What every TT layer (TTLinear, TTEmbedding) shares for rank adaptation:
live ranks and sizes, and checkpoint loading that follows the ranks.

A TT layer has ``.cores`` (an nn.ParameterList of D cores whose FIRST and
LAST dims are the rank dims: (r_{k-1}, ..., r_k), modes in between) and
``.gates`` (D - 1 vectors, gate k on the bond between core k and core k+1).
Layers inherit :class:`TTLayerMixin` before nn.Module::

    class TTLinear(TTLayerMixin, nn.Module): ...

which gives them :meth:`~TTLayerMixin.live_ranks`,
:meth:`~TTLayerMixin.live_tt_params`, :meth:`~TTLayerMixin.dense_params`
and a ``_load_from_state_dict`` that resizes cores and gates to the ranks
stored in a checkpoint (so a pruned model's state_dict loads into a freshly
built one).  :func:`is_tt_layer` also accepts layers that only duck-type
the interface.
"""
import math
from typing import Dict, Iterator, List, Tuple

import torch
from torch.autograd.graph import increment_version
from torch import nn

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, distribute_tensor
else:  # a build without torch.distributed: no sharded parameters
    DTensor, distribute_tensor = (), None


def is_tt_layer(module: nn.Module) -> bool:
    """True for modules that carry TT cores and gates (TTLinear, TTEmbedding).

    Example:
        >>> import torch, comera
        >>> from comera.layers.base import is_tt_layer
        >>> is_tt_layer(comera.TTLinear(8, 8, rank=2)), is_tt_layer(torch.nn.Linear(8, 8))
        (True, False)
    """
    if isinstance(module, TTLayerMixin):
        return True
    cores, gates = getattr(module, "cores", None), getattr(module, "gates", None)
    return (isinstance(cores, nn.ParameterList) and isinstance(gates, nn.ParameterList)
            and len(cores) == len(gates) + 1 and callable(getattr(module, "tt_params", None)))


def tt_layers(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """(qualified name, layer) for every TT layer in ``model`` (itself included)."""
    for name, module in model.named_modules():
        if is_tt_layer(module):
            yield name, module


def cores_and_gates(layer: nn.Module) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """A TT layer's cores and gates as lists in index order, read from the
    two ParameterLists' parameter dicts (as :func:`param_list`): ``layer.cores``
    alone goes through ``nn.Module.__getattr__``, which costs as much as a
    small lookup's kernel.

    Example:
        >>> import comera
        >>> cores, gates = cores_and_gates(comera.TTLinear(16, 16, rank=3))
        >>> [tuple(c.shape) for c in cores], [tuple(g.shape) for g in gates]
        ([(1, 4, 3), (3, 4, 3), (3, 4, 3), (3, 4, 1)], [(3,), (3,), (3,)])
    """
    mods = layer._modules
    return (list(mods["cores"]._parameters.values()),
            list(mods["gates"]._parameters.values()))


def param_list(plist: nn.ParameterList) -> List[torch.Tensor]:
    """The entries of a ParameterList in index order, read from its parameter
    dict: ``list(plist)`` goes through ``__getitem__`` per entry, which costs
    more than the whole C kernel call at batch 1.  Index assignment keeps a
    key's position, so the dict order is the index order.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> pl = nn.ParameterList([nn.Parameter(torch.zeros(1)), nn.Parameter(torch.ones(2))])
        >>> [p.numel() for p in param_list(pl)]
        [1, 2]
    """
    return list(plist._parameters.values())


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (a parameter sharded by FSDP2's ``fully_shard``,
    or otherwise distributed): its values live in pieces across processes.

    Example:
        >>> import torch
        >>> is_sharded(torch.zeros(3))
        False
    """
    return isinstance(t, DTensor)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) tensor, detached, as a plain
    tensor on the local device.  For a DTensor this is ``full_tensor()``, a
    collective: every process of its mesh must call it, in the same order.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> full_value(p).requires_grad
        False
    """
    if isinstance(t, DTensor):
        return t.detach().full_tensor()
    return t.detach()


@torch.no_grad()
def write_full_value_(t: torch.Tensor, value: torch.Tensor) -> None:
    """Copies the whole value ``value`` (shaped like ``t``) into ``t`` in place;
    a DTensor keeps its placements and takes its own piece of ``value`` (no
    communication: every process passes the same ``value``).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> write_full_value_(p, torch.tensor([1.0, 2.0])); p.tolist()
        [1.0, 2.0]
    """
    if isinstance(t, DTensor):
        mine = distribute_tensor(value.to(t.dtype), t.device_mesh, t.placements,
                                 src_data_rank=None).to_local()
        t.to_local().copy_(mine)
    else:
        t.copy_(value)


def mode_size(core: torch.Tensor) -> int:
    """Entries of a core per (left rank, right rank) pair: the product of its modes."""
    return math.prod(core.shape[1:-1])


def live_ranks(layer: nn.Module) -> List[int]:
    """Non-zero gate entries per bond (for sharded gates a collective: see
    :func:`full_value`)."""
    return [int(torch.count_nonzero(full_value(g))) for g in layer.gates]


def size_from_ranks(layer: nn.Module, ranks: List[int]) -> int:
    """S = sum_k r_{k-1} n_k r_k for the given internal ranks (docs/design.md section 4)."""
    full = [1] + list(ranks) + [1]
    return sum(full[k] * mode_size(c) * full[k + 1] for k, c in enumerate(layer.cores))


def dense_params(layer: nn.Module) -> int:
    """Parameters of the dense equivalent of a TT layer (its weight matrix or table)."""
    if callable(getattr(layer, "dense_params", None)):
        return int(layer.dense_params())
    return _dense_params_default(layer)


def _dense_params_default(layer: nn.Module) -> int:
    if hasattr(layer, "in_features") and hasattr(layer, "out_features"):
        return int(layer.in_features) * int(layer.out_features)
    if hasattr(layer, "num_embeddings") and hasattr(layer, "embedding_dim"):
        return int(layer.num_embeddings) * int(layer.embedding_dim)
    # compression() is dense / tt_params() for every TT layer
    return int(round(float(layer.compression()) * layer.tt_params()))


@torch.no_grad()
def replace_data(param: nn.Parameter, new: torch.Tensor) -> None:
    """Gives ``param`` new data of another shape, keeping the Parameter object.

    Autograd caches one gradient accumulator per leaf, recording the leaf's
    shape, and reuses it while any graph that saw the leaf is alive (a loss
    tensor kept from the previous step is enough); ``param.data = new``
    alone does not refresh it when only the shape changes, and the next
    backward would fail.  Setting data of another dtype first drops the cached
    accumulator (torch resets it on a dtype change), so it is rebuilt with the
    new shape.
    """
    other = torch.float64 if new.dtype != torch.float64 else torch.float32
    param.data = torch.empty(0, dtype=other, device=new.device)
    param.data = new
    # .data keeps the version counter: bump it, so that what is kept per
    # parameter version (a TTLinear's merged V and U) is renewed
    increment_version(param)


def _layer_name(prefix: str) -> str:
    return prefix[:-1] if prefix.endswith(".") else (prefix or "<model>")


def checkpoint_shapes(layer: nn.Module, state_dict: Dict[str, torch.Tensor],
                      prefix: str) -> Tuple[Dict[int, torch.Size], Dict[int, torch.Size]]:
    """Checks the cores and gates stored under ``prefix`` against ``layer``.

    Returns the checkpoint's core and gate shapes (by index; absent keys are
    left out).  Raises ValueError, naming the layer, when the checkpoint was
    made by a layer of another architecture (other modes, another number of
    cores) or its ranks do not chain (core k's last dim, gate k and core
    k+1's first dim must agree).
    """
    name = _layer_name(prefix)
    kind = type(layer).__name__
    cores, gates = list(layer.cores), list(layer.gates)
    D = len(cores)
    core_shapes: Dict[int, torch.Size] = {}
    gate_shapes: Dict[int, torch.Size] = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        rest = key[len(prefix):].split(".")
        if len(rest) != 2 or rest[0] not in ("cores", "gates") or not rest[1].isdigit():
            continue
        idx = int(rest[1])
        count = D if rest[0] == "cores" else D - 1
        if idx >= count:
            raise ValueError(f"checkpoint does not fit {kind} '{name}': it has {key} but the "
                             f"layer has only {count} {rest[0]} (a different architecture)")
        (core_shapes if rest[0] == "cores" else gate_shapes)[idx] = value.shape
    for k, shape in core_shapes.items():
        mine = cores[k].shape
        if len(shape) != len(mine) or tuple(shape[1:-1]) != tuple(mine[1:-1]):
            raise ValueError(
                f"checkpoint does not fit {kind} '{name}': core {k} has shape {tuple(shape)} in "
                f"the checkpoint, the layer's is {tuple(mine)}: the mode sizes "
                f"{tuple(shape[1:-1])} vs {tuple(mine[1:-1])} differ (a layer built with other "
                "shapes or features); only the rank dims (first and last) may differ")
    for k, shape in gate_shapes.items():
        if len(shape) != 1:
            raise ValueError(f"checkpoint does not fit {kind} '{name}': gate {k} has shape "
                             f"{tuple(shape)}, expected a vector")
    # ranks must chain: r_0 = r_D = 1, core k's last dim = gate k = core k+1's first dim
    if 0 in core_shapes and core_shapes[0][0] != 1:
        raise ValueError(f"checkpoint does not fit {kind} '{name}': core 0 has first (rank) dim "
                         f"{core_shapes[0][0]}, expected 1")
    if D - 1 in core_shapes and core_shapes[D - 1][-1] != 1:
        raise ValueError(f"checkpoint does not fit {kind} '{name}': core {D - 1} has last (rank) "
                         f"dim {core_shapes[D - 1][-1]}, expected 1")
    for k in range(D - 1):
        seen = {}
        if k in core_shapes:
            seen[f"core {k} last dim"] = core_shapes[k][-1]
        if k in gate_shapes:
            seen[f"gate {k} length"] = gate_shapes[k][0]
        if k + 1 in core_shapes:
            seen[f"core {k + 1} first dim"] = core_shapes[k + 1][0]
        if len(set(seen.values())) > 1:
            detail = ", ".join(f"{a} = {b}" for a, b in seen.items())
            raise ValueError(f"checkpoint does not fit {kind} '{name}': the ranks of bond {k} "
                             f"disagree ({detail})")
    return core_shapes, gate_shapes


@torch.no_grad()
def resize_to_checkpoint(layer: nn.Module, state_dict: Dict[str, torch.Tensor],
                         prefix: str = "") -> bool:
    """Gives ``layer``'s cores and gates the shapes stored in ``state_dict``
    (same Parameter objects, new storage; the values are then copied in by
    load_state_dict).  Returns True when any shape changed.  Raises
    ValueError naming the layer when the checkpoint does not fit."""
    core_shapes, gate_shapes = checkpoint_shapes(layer, state_dict, prefix)
    changed = False
    for plist, shapes in ((layer.cores, core_shapes), (layer.gates, gate_shapes)):
        for k, shape in shapes.items():
            p = plist[k]
            if p.shape != shape:
                replace_data(p, torch.zeros(shape, dtype=p.dtype, device=p.device))
                p.grad = None
                changed = True
    return changed


class TTLayerMixin:
    """Rank-adaptation support shared by the TT layers (inherit it before nn.Module).

    Example:
        >>> import torch, comera
        >>> layer = comera.TTLinear(64, 64, rank=4)
        >>> with torch.no_grad():
        ...     layer.gates[2][:2] = 0          # two dead ranks on bond 2
        >>> layer.live_ranks(), layer.live_tt_params() < layer.tt_params()
        ([4, 4, 2, 4, 4], True)
    """

    def live_ranks(self) -> List[int]:
        """Non-zero gate entries per bond: the ranks that still matter."""
        return live_ranks(self)

    def live_tt_params(self) -> int:
        """Core parameters counting live ranks only (what :func:`comera.prune` leaves)."""
        return size_from_ranks(self, self.live_ranks())

    def dense_params(self) -> int:
        """Parameters of the dense weight (or table) this layer replaces."""
        return _dense_params_default(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # nn.Module.load_state_dict visits a module before its children, so the
        # cores and gates (held by the ParameterList children) are resized here
        # to the checkpoint's ranks before they are copied in.
        try:
            resize_to_checkpoint(self, state_dict, prefix)
        except ValueError as err:
            error_msgs.append(str(err))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
