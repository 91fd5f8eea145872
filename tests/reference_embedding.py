"""Independent dense reference for the TT embedding (pure torch, no comera ops)."""
import itertools
import math

import torch


def _ravel(idx, modes):
    out = 0
    for i, m in zip(idx, modes):
        out = out * m + i
    return out


def dense_ttm_by_entries(cores, gates, num_embeddings, embedding_dim):
    """The table built entry by entry from docs/design.md section 3's formula:
    E[t, j] = C_1[:, i_1, j_1, :] g_1 C_2[:, i_2, j_2, :] g_2 ... (slow; small
    tables only).  Differentiable in the cores and gates."""
    rows = [c.shape[1] for c in cores]
    dims = [c.shape[2] for c in cores]
    entries = {}
    for i_idx in itertools.product(*[range(v) for v in rows]):
        t = _ravel(i_idx, rows)
        if t >= num_embeddings:
            continue
        for j_idx in itertools.product(*[range(e) for e in dims]):
            j = _ravel(j_idx, dims)
            if j >= embedding_dim:
                continue
            m = cores[0][:, i_idx[0], j_idx[0], :]
            for k in range(1, len(cores)):
                m = (m * gates[k - 1]) @ cores[k][:, i_idx[k], j_idx[k], :]
            entries[(t, j)] = m.reshape(())
    flat = [entries[(t, j)] for t in range(num_embeddings) for j in range(embedding_dim)]
    assert len(flat) == num_embeddings * embedding_dim <= math.prod(rows) * math.prod(dims)
    return torch.stack(flat).reshape(num_embeddings, embedding_dim)
