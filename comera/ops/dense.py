"""Dense references of the TT operators, in plain torch ops.

Differentiable to any order: the operators' double backward, the routing to
torch's BLAS, ``TTLinear.weight`` / ``TTEmbedding.weight`` and the tests use
them.  docs/design.md sections 2 and 3 give the index conventions.
"""
from typing import Sequence

import torch


def merge(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> torch.Tensor:
    """Product of a chain of 3-D cores, each core k scaled by gates[k] on its
    right rank (len(gates) may be len(cores) or len(cores) - 1).  Returns the
    (r_first * prod n, r_last) matrix, row-major over (r_first, n_1..n_k)."""
    c0 = cores[0]
    if len(gates) > 0:
        c0 = c0 * gates[0]
    P = c0.reshape(-1, c0.shape[-1])
    for k in range(1, len(cores)):
        c = cores[k]
        if k < len(gates):
            c = c * gates[k]
        P = (P @ c.reshape(c.shape[0], -1)).reshape(-1, c.shape[-1])
    return P


def dense_wt(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], num_in_cores: int,
             in_features: int, out_features: int) -> torch.Tensor:
    """The dense ``(in_features, out_features)`` matrix ``W^T`` of TT cores
    (plain torch ops, differentiable to any order)."""
    p = num_in_cores
    V = merge(cores[:p], gates[:p])
    U = merge(cores[p:], gates[p:]).reshape(V.shape[1], -1)
    return (V @ U)[:in_features, :out_features]


def ttm_full(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole padded table ``(prod v, prod e)`` of TTM cores (differentiable)."""
    P = cores[0] * gates[0] if gates else cores[0]
    P = P.reshape(P.shape[1], P.shape[2], P.shape[3])  # (V, E, r)
    for k in range(1, len(cores)):
        c = cores[k] * gates[k] if k < len(gates) else cores[k]
        r, v, e, r2 = c.shape
        V, E, _ = P.shape
        P = (P.reshape(V * E, r) @ c.reshape(r, v * e * r2)).reshape(V, E, v, e, r2)
        P = P.permute(0, 2, 1, 3, 4).reshape(V * v, E * e, r2)
    return P.reshape(P.shape[0], P.shape[1])


def ttm_table(cores, gates, num_embeddings: int, embedding_dim: int) -> torch.Tensor:
    """The dense ``(num_embeddings, embedding_dim)`` table of TTM ``cores``
    (each ``(r_{k-1}, v_k, e_k, r_k)``) with ``gates`` on the internal bonds
    (docs/design.md section 3: row and column multi-indices row-major, the first
    mode the most significant).  Differentiable in cores and gates.

    Example:
        >>> import torch
        >>> c1, c2 = torch.randn(1, 2, 3, 4), torch.randn(4, 5, 2, 1)
        >>> t = ttm_table([c1, c2], [torch.ones(4)], 10, 6)
        >>> torch.allclose(t[7, 5], (c1[0, 1, 2] * c2[:, 2, 1, 0]).sum())
        True
    """
    return ttm_full(list(cores), list(gates))[:num_embeddings, :embedding_dim]
