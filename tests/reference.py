"""Independent dense references for the TT layers (pure torch, no comera ops)."""
import itertools
import math

import torch


def dense_wt_by_entries(cores, gates, num_in, in_features, out_features):
    """W^T built entry by entry from docs/design.md section 2's formula (slow; for small layers)."""
    dims = [c.shape[1] for c in cores]
    in_modes, out_modes = dims[:num_in], dims[num_in:]
    D = len(cores)
    wt = torch.zeros(math.prod(in_modes), math.prod(out_modes), dtype=cores[0].dtype)
    for i_idx in itertools.product(*[range(n) for n in in_modes]):
        for j_idx in itertools.product(*[range(m) for m in out_modes]):
            idx = list(i_idx) + list(j_idx)
            v = cores[0][:, idx[0], :]
            for k in range(1, D):
                v = (v * gates[k - 1]) @ cores[k][:, idx[k], :]
            i = 0
            for a, n in zip(i_idx, in_modes):
                i = i * n + a
            j = 0
            for b, m in zip(j_idx, out_modes):
                j = j * m + b
            wt[i, j] = v.reshape(())
    return wt[:in_features, :out_features]
