"""Physical rank truncation: dead ranks (gate entries that are exactly 0) are
cut out of the two cores they join and out of the gate, so they stop costing
FLOPs and memory (docs/design.md section 4).  The Parameter objects stay the same
objects (only their data shrinks), and optimizer state shaped like a pruned
parameter (Adam/AdamW exp_avg, exp_avg_sq, max_exp_avg_sq, SGD momentum_buffer,
...) is cut the same way, so training simply continues."""
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn

from comera.layers.base import is_sharded, replace_data, tt_layers


def keep_indices(gate: torch.Tensor) -> torch.Tensor:
    keep = torch.nonzero(gate.detach() != 0).flatten()
    if keep.numel() == 0:
        # A bond with no live rank makes the layer identically zero; one slice
        # with a zero gate keeps that function while the kernels keep rank >= 1.
        keep = torch.zeros(1, dtype=torch.long, device=gate.device)
    return keep


def cut(t: torch.Tensor, left: Optional[torch.Tensor], right: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` with its first dim indexed by ``left`` and its last by ``right``."""
    if left is not None:
        t = t.index_select(0, left.to(t.device))
    if right is not None:
        t = t.index_select(t.dim() - 1, right.to(t.device))
    return t.contiguous()


def _factored(shape: torch.Size, param_shape: torch.Size) -> bool:
    """Same number of dims as the parameter, each either the parameter's or 1."""
    return len(shape) == len(param_shape) >= 2 and all(
        a == b or a == 1 for a, b in zip(shape, param_shape))


@torch.no_grad()
def _shrink(p: nn.Parameter, left, right, optimizer) -> None:
    old_shape = p.shape
    replace_data(p, cut(p.data, left, right))
    if p.grad is not None:
        p.grad = cut(p.grad, left, right) if p.grad.shape == old_shape else None
    if optimizer is not None and p in optimizer.state:
        state = optimizer.state[p]
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == old_shape:
                state[key] = cut(value, left, right)
            elif _factored(value.shape, old_shape):
                # a factored statistic (Adafactor's row_var / col_var): same dims, some of them
                # reduced to 1; cut the rank dims it still has
                state[key] = cut(value, left if value.shape[0] == old_shape[0] else None,
                                  right if value.shape[-1] == old_shape[-1] else None)


def prune(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, List[int]]:
    """Cuts the dead ranks of every TT layer in ``model`` out of its cores and gates.

    For each bond k with dead entries (gate k exactly 0), the matching slices
    of core k's last dim, core k+1's first dim and gate k are removed.  The
    layer computes the same function (a dead rank contributes nothing), now
    at the smaller ranks.  Pass the ``optimizer`` that trains the model to cut
    its per-parameter state the same way (every state tensor shaped like the
    parameter); without it, stale state of a pruned parameter would no longer
    fit.  Factored statistics (Adafactor's row / column variances, shaped like
    the parameter with some dims reduced to 1) are cut along the rank dims
    they keep.

    Returns ``{layer name: new ranks}`` for the layers that changed.

    Example:
        >>> import torch, comera
        >>> layer = comera.TTLinear(64, 64, rank=8)
        >>> opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        >>> layer(torch.randn(4, 64)).sum().backward(); opt.step()
        >>> with torch.no_grad():
        ...     layer.gates[2][3:] = 0
        >>> comera.prune(layer, opt)
        {'': [4, 8, 3, 8, 4]}
        >>> opt.state[layer.cores[2]]["exp_avg"].shape
        torch.Size([8, 4, 3])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prune: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(getattr(optimizer, "state", None), dict):
        raise TypeError("prune: optimizer must be a torch.optim.Optimizer (with a .state dict), "
                        f"got {type(optimizer).__name__}")
    changed: Dict[str, List[int]] = {}
    found = False
    for name, layer in tt_layers(model):
        if any(is_sharded(p) for p in layer.parameters()):
            raise TypeError(f"prune: TT layer '{name or '<model>'}' has sharded (DTensor) "
                            "parameters (FSDP2's fully_shard): use "
                            "comera.integrations.fsdp.prune(model, optimizer), which also "
                            "updates FSDP's own records of the parameters")
    # every layer is checked before any is cut: a NaN anywhere prunes nothing
    for name, layer in tt_layers(model):
        for k, g in enumerate(layer.gates):
            if torch.isnan(g.detach()).any():
                raise ValueError(f"prune: gate {k} of layer '{name or '<model>'}' contains NaN; "
                                 "refusing to prune on NaN (check the learning rate / loss)")
    for name, layer in tt_layers(model):
        found = True
        gates = list(layer.gates)
        keeps = [keep_indices(g) for g in gates]
        cut = [None if keep.numel() == g.numel() else keep for keep, g in zip(keeps, gates)]
        if all(c is None for c in cut):
            continue
        cores = list(layer.cores)
        for k, core in enumerate(cores):
            left = cut[k - 1] if k > 0 else None
            right = cut[k] if k < len(gates) else None
            if left is not None or right is not None:
                _shrink(core, left, right, optimizer)
        for k, g in enumerate(gates):
            if cut[k] is not None:
                _shrink(g, cut[k], None, optimizer)
        changed[name] = [c.shape[-1] for c in cores[:-1]]
    if not found:
        warnings.warn("comera.prune: the model has no TT layers (TTLinear / TTEmbedding); "
                      "nothing to prune", stacklevel=2)
    return changed
