"""Checkpoints that resume exactly: model, optimizer, schedule, RNG states,
step, history and the rank controller's state.  Pruned TT layers have
smaller cores than a freshly built model; their parameters are resized to
the checkpoint's shapes before the state is loaded (the live ranks are also
stored, for the record and for a clear error)."""
import os
import random
from typing import Dict

import torch
from torch import nn

from comera.atomic import atomic_write
from comera.layer_base import live_ranks, replace_data, tt_layers


def save(path: str, state: dict) -> None:
    """Writes atomically (temp file in the same directory, fsync, os.replace):
    a crash or an error while saving never leaves a torn file and keeps the
    previous checkpoint."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load(path: str) -> dict:
    # Our own checkpoints hold plain containers of tensors and numbers, so
    # weights_only=True loads them and never runs code from the file.
    return torch.load(path, map_location="cpu", weights_only=True)


def tt_shapes(model: nn.Module) -> Dict[str, list]:
    """Stored ranks of every TT layer: ``{name: [r_1, ..., r_{D-1}]}``.

    Example:
        >>> import comera
        >>> tt_shapes(nn.Sequential(nn.Linear(4, 4), comera.TTLinear(64, 64, rank=4)))
        {'1': [4, 4, 4, 4, 4]}
    """
    return {name: [int(g.numel()) for g in layer.gates] for name, layer in tt_layers(model)}


def tt_live_ranks(model: nn.Module) -> Dict[str, list]:
    return {name: live_ranks(layer) for name, layer in tt_layers(model)}


@torch.no_grad()
def resize_tt_to(model: nn.Module, state_dict: dict) -> None:
    """Gives every TT core and gate of ``model`` the shape it has in
    ``state_dict`` (values are overwritten by the load that follows).  The
    Parameter objects stay the same, so an optimizer built on the model
    still refers to them."""
    for name, layer in tt_layers(model):
        prefix = f"{name}." if name else ""
        for kind in ("cores", "gates"):
            for i, p in enumerate(getattr(layer, kind)):
                key = f"{prefix}{kind}.{i}"
                if key not in state_dict:
                    raise ValueError(f"checkpoint has no {key!r}: it was not saved from this model")
                want = state_dict[key].shape
                if want != p.shape:
                    if p.dim() != len(want) or (kind == "cores" and p.shape[1:-1] != want[1:-1]):
                        raise ValueError(f"checkpoint's {key} has shape {tuple(want)}, which this "
                                         f"model's layer (shape {tuple(p.shape)}) cannot take: "
                                         "only ranks can differ")
                    replace_data(p, torch.zeros(want, dtype=p.dtype, device=p.device))
                    p.grad = None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
