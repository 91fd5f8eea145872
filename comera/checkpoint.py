"""Loading checkpoints whose TT ranks differ from the model's (pruned models).

Plain ``model.load_state_dict(sd)`` already works: every TT layer resizes its
cores and gates to the checkpoint's ranks before they are copied in (see
:class:`comera.layer_base.TTLayerMixin`).  :func:`load_state_dict` does the
same but checks every layer first and raises a ValueError that names the
layer, instead of load_state_dict's collected RuntimeError.
"""
from typing import Mapping

import torch
from torch import nn

from comera.layer_base import checkpoint_shapes, resize_to_checkpoint, tt_layers


def load_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Loads ``state_dict`` into ``model``, resizing TT ranks to the checkpoint's.

    Returns what :meth:`torch.nn.Module.load_state_dict` returns (missing
    and unexpected keys).  Raises ValueError naming the layer when a TT
    layer's checkpoint has other mode sizes or another number of cores.
    After loading, recreate (or reload the state of) any optimizer built for
    the model's previous shapes.

    Example:
        >>> import torch, comera
        >>> small = comera.TTLinear(64, 64, rank=8)
        >>> with torch.no_grad():
        ...     small.gates[2][2:] = 0
        >>> _ = comera.prune(small)
        >>> fresh = comera.TTLinear(64, 64, rank=8)
        >>> _ = comera.load_state_dict(fresh, small.state_dict())
        >>> fresh.ranks
        [4, 8, 2, 8, 4]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError("load_state_dict: state_dict must be a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}")
    layers = [(layer, f"{name}." if name else "") for name, layer in tt_layers(model)]
    for layer, prefix in layers:
        checkpoint_shapes(layer, state_dict, prefix)  # raises, naming the layer; nothing resized yet
    for layer, prefix in layers:
        # TTLayerMixin layers would resize themselves; duck-typed ones need it done here
        resize_to_checkpoint(layer, state_dict, prefix)
    return model.load_state_dict(state_dict, strict=strict)
