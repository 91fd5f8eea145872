"""Size report of a model's TT layers: live ranks, parameters, compression."""
from typing import List

from torch import nn

from comera.layers.base import dense_params, live_ranks, size_from_ranks, tt_layers


def _shapes(layer: nn.Module) -> str:
    for a, b in (("in_shape", "out_shape"), ("row_shape", "dim_shape")):  # linear, embedding
        if hasattr(layer, a) and hasattr(layer, b):
            return "x".join(map(str, getattr(layer, a))) + " -> " + "x".join(map(str, getattr(layer, b)))
    # generic: the modes of each core (an embedding core has (v_k, e_k))
    modes = [tuple(c.shape[1:-1]) for c in layer.cores]
    cols = list(zip(*modes)) if modes and all(len(m) == len(modes[0]) for m in modes) else [modes]
    return " , ".join("x".join(map(str, col)) for col in cols)


def compression(model: nn.Module) -> float:
    """Dense parameters of all TT layers over their live TT parameters.

    Live ranks (non-zero gate entries) count, pruned or not, so this is the
    ratio :func:`comera.prune` makes physical.  1.0 for a model without TT
    layers.

    Example:
        >>> import torch, comera
        >>> model = torch.nn.Sequential(comera.TTLinear(768, 3072, rank=16), torch.nn.ReLU())
        >>> round(comera.compression(model), 1)
        203.7
    """
    dense = live = 0
    for _, layer in tt_layers(model):
        dense += dense_params(layer)
        live += size_from_ranks(layer, live_ranks(layer))
    if dense == 0:
        return 1.0
    return dense / live if live > 0 else float("inf")


def summary(model: nn.Module) -> str:
    """A table of the TT layers: name, type, shapes, live ranks, TT params
    (live), dense params, compression, then the totals.

    Example:
        >>> import torch, comera
        >>> model = torch.nn.Sequential(comera.TTLinear(64, 32, rank=4), torch.nn.ReLU(),
        ...                             comera.TTLinear(32, 10, rank=4))
        >>> print(comera.summary(model))  # doctest: +NORMALIZE_WHITESPACE
        layer  type      shapes          live ranks       TT params  dense params  compression
        0      TTLinear  4x4x4 -> 2x4x4  [4, 4, 4, 4, 4]  256        2048          8.0x
        2      TTLinear  2x4x4 -> 2x5    [2, 4, 4, 4]     152        320           2.1x
        total                                             408        2368          5.8x
    """
    header = ["layer", "type", "shapes", "live ranks", "TT params", "dense params", "compression"]
    rows: List[List[str]] = []
    dense_total = live_total = 0
    for name, layer in tt_layers(model):
        ranks = live_ranks(layer)
        live = size_from_ranks(layer, ranks)
        dense = dense_params(layer)
        dense_total += dense
        live_total += live
        rows.append([name or "<model>", type(layer).__name__, _shapes(layer), str(ranks),
                     str(live), str(dense), f"{dense / live:.1f}x" if live else "inf"])
    if not rows:
        return "no TT layers (TTLinear / TTEmbedding) in this model"
    ratio = f"{dense_total / live_total:.1f}x" if live_total else "inf"
    rows.append(["total", "", "", "", str(live_total), str(dense_total), ratio])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines)
