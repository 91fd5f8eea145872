"""A minimal stand-in for a TT embedding (TTM cores and gates, docs/design.md
section 3) and its table built entry by entry: an independent reference for
the tied output layer that does not depend on comera.TTEmbedding."""
import itertools

import torch
from torch import nn


class StandInTTM(nn.Module):
    """Cores (r_{k-1}, v_k, e_k, r_k) and gates as docs/design.md section 3 lays them out."""

    def __init__(self, num, dim, vs, es, ranks):
        super().__init__()
        full = [1] + ranks + [1]
        self.num_embeddings, self.embedding_dim = num, dim
        self.cores = nn.ParameterList(nn.Parameter(torch.randn(full[k], v, e, full[k + 1], dtype=torch.float64))
                                      for k, (v, e) in enumerate(zip(vs, es)))
        self.gates = nn.ParameterList(nn.Parameter(torch.rand(r, dtype=torch.float64) + 0.5) for r in ranks)


def table_by_entries(emb):
    vs = [c.shape[1] for c in emb.cores]
    es = [c.shape[2] for c in emb.cores]
    rows = []
    for i_idx in itertools.product(*[range(v) for v in vs]):
        row = []
        for e_idx in itertools.product(*[range(e) for e in es]):
            m = emb.cores[0][:, i_idx[0], e_idx[0], :]
            for k in range(1, len(vs)):
                m = (m * emb.gates[k - 1]) @ emb.cores[k][:, i_idx[k], e_idx[k], :]
            row.append(m.reshape(()))
        rows.append(torch.stack(row))
    return torch.stack(rows)[: emb.num_embeddings, : emb.embedding_dim]
