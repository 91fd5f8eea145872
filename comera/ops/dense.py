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
    """The whole padded table ``(prod v, prod e)`` of TTM cores (differentiable).

    The cores after the first are contracted first, from the last one back;
    then each row slice of the first core meets that block in a product of
    its own (a batched product).  A row's arithmetic thus never depends on
    how many slices the first core has, where rows are added and dropped: a
    BLAS may round a row differently in a product of another row count (MKL
    on AMD CPUs does), and kept rows must stay bit-exact."""
    eff = [c * gates[k] if k < len(gates) else c for k, c in enumerate(cores)]
    r, v, e, _ = eff[-1].shape
    R = eff[-1].reshape(r, v, e)  # (r_{k-1}, rows of cores k.., columns of cores k..)
    for c in reversed(eff[1:-1]):
        r0, v, e, r1 = c.shape
        _, V, E = R.shape
        T = (c.reshape(r0 * v * e, r1) @ R.reshape(r1, V * E)).reshape(r0, v, e, V, E)
        R = T.permute(0, 1, 3, 2, 4).reshape(r0, v * V, e * E)
    first = eff[0]
    _, v, e, r1 = first.shape
    _, V, E = R.shape
    if len(eff) == 1:
        return first.reshape(v, e)
    out = torch.bmm(first.reshape(v, e, r1), R.reshape(1, r1, V * E).expand(v, r1, V * E))
    return out.reshape(v, e, V, E).permute(0, 2, 1, 3).reshape(v * V, e * E)


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
