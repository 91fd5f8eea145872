"""Balancing a TT layer: the same function, with every gate holding its
rank's singular value relative to the bond's largest, so that a gate's size
means the same in every layer (used by :class:`comera.RankAdaptive`; the
math is in docs/design.md section 4)."""
import math

import torch
from torch import nn

from comera.layers.base import full_value, write_full_value_


@torch.no_grad()
def balance_(layer: nn.Module) -> bool:
    """Rewrites a TT layer in canonical (Vidal) form, keeping its function.

    Afterwards the gate on bond k holds the singular values of the layer's
    unfolding at bond k divided by the largest (so in [0, 1], largest 1), and
    the cores the orthonormal bases and the scale.  Dead (exactly zero) gate
    entries stay exactly zero.  Returns False, leaving the layer untouched,
    when a rank exceeds what its neighbours can carry (``r_k > r_{k-1} n_k``
    or ``r_{k-1} > n_k r_k``: a redundant rank) or a gate holds a non-finite
    value.  Sharded (DTensor) cores and gates are gathered, balanced whole and
    written back piece by piece: call it in every process.

    Example:
        >>> import torch, comera
        >>> from comera.adapt.rank_adaptive import balance_
        >>> layer = comera.TTLinear(16, 16, rank=4, in_shape=[4, 4], out_shape=[4, 4])
        >>> x = torch.randn(3, 16)
        >>> y = layer(x)
        >>> balance_(layer), torch.allclose(layer(x), y, atol=1e-5)
        (True, True)
        >>> [round(float(g.detach().max()), 6) for g in layer.gates]
        [1.0, 1.0, 1.0]
    """
    params = list(layer.cores), list(layer.gates)
    # whole values (sharded parameters are gathered: every process computes the same)
    cores, gates = [full_value(c) for c in params[0]], [full_value(g) for g in params[1]]
    D = len(cores)
    if D < 2:
        return False
    ranks = [1] + [int(c.shape[-1]) for c in cores[:-1]] + [1]
    modes = [math.prod(c.shape[1:-1]) for c in cores]
    if any(ranks[k + 1] > ranks[k] * modes[k] or ranks[k] > modes[k] * ranks[k + 1]
           for k in range(D)):
        return False
    if not all(bool(torch.isfinite(g).all()) for g in gates):
        return False
    # M_k = core_k diag(g_k): the chain without gates, in float64
    dead = [g.detach() == 0 for g in gates]
    M = [c.detach().double().cpu().reshape(ranks[k], modes[k], ranks[k + 1]) for k, c in enumerate(cores)]
    for k, g in enumerate(gates):
        M[k] = M[k] * g.detach().double().cpu()
    # right-orthonormalise cores D-1 .. 1 (RQ through a QR of the transpose)
    for k in range(D - 1, 0, -1):
        q, r = torch.linalg.qr(M[k].reshape(ranks[k], -1).T)      # (n r, r_{k}), (r_k, r_k)
        M[k] = q.T.reshape(ranks[k], modes[k], ranks[k + 1])
        M[k - 1] = torch.einsum("anb,cb->anc", M[k - 1], r)
    # left-to-right SVD sweep: core k <- U_k, gate k <- S_k, carry S_k V_k^T
    sig = []
    for k in range(D - 1):
        u, s, vt = torch.linalg.svd(M[k].reshape(-1, ranks[k + 1]), full_matrices=False)
        M[k] = u.reshape(ranks[k], modes[k], ranks[k + 1])
        M[k + 1] = torch.einsum("a,ab,bnc->anc", s, vt, M[k + 1])
        sig.append(s)
    # stored form: C_0 G_0 C_1 G_1 ... with G_k = S_k / max, C_{k+1} = diag(max / S_k) U_{k+1}
    new_gates, new_cores = [], [M[0]]
    for k, s in enumerate(sig):
        top = float(s[0]) if s.numel() and float(s[0]) > 0 else 1.0
        live = s > top * 1e-12
        g = torch.where(live, s / top, torch.zeros_like(s))
        n_dead = int(dead[k].sum())
        if n_dead:          # the function had that many zero singular values: keep them dead
            g[len(g) - n_dead:] = 0
            live = g != 0
        inv = torch.where(live, top / torch.where(live, s, torch.ones_like(s)), torch.zeros_like(s))
        new_gates.append(g)
        new_cores.append(M[k + 1] * inv[:, None, None])
    for c, new in zip(params[0], new_cores):
        write_full_value_(c, new.reshape(c.shape).to(c.dtype))
    for g, new in zip(params[1], new_gates):
        write_full_value_(g, new.to(g.dtype))
    return True
