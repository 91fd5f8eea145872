"""The TT linear layers that bench_peers.py compares, built at the same shape
and rank: comera.TTLinear, tensorly-torch's FactorizedLinear (its
tensor-train-matrix format, "BlockTT"), the paper's pure-PyTorch scheme
(docs/design.md section 2) and nn.Linear.

tensorly-torch is imported lazily: it is a benchmark-only dependency
(``pip install comera[bench]``).

Example:
    >>> import torch
    >>> layer = build_linear("paper scheme", 768, 3072, rank=8)
    >>> layer(torch.randn(4, 768)).shape
    torch.Size([4, 3072])
"""
import torch
from torch import nn

import comera
from comera.layers import tt
from comera.ops.dense import merge

LINEAR_METHODS = ["comera.TTLinear", "paper scheme", "tltorch BlockTT (factorized)",
                  "tltorch BlockTT (reconstructed)", "tltorch BlockTT (factorized, equal params)",
                  "tltorch BlockTT (reconstructed, equal params)", "nn.Linear"]
# At the same rank tensorly-torch's TT-matrix has about 3.7x comera's
# parameters (its cores pair input and output modes); the "equal params"
# variants take the rank that gives comera's parameter count instead.
EQUAL = " equal params)"


class _TwoMatmul(torch.autograd.Function):
    """y = (x V) U + b with the backward written out so that it reuses the
    forward's T = x V and the merged halves V, U (no autograd graph over the
    batch-sized products):
        S = dy U^T,  dx = S V^T,  dU = T^T dy,  dV = x^T S,  db = sum dy."""

    @staticmethod
    def forward(ctx, x, V, U, bias):
        T = x @ V
        y = T @ U if bias is None else torch.addmm(bias, T, U)
        ctx.save_for_backward(x, V, U, T)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, V, U, T = ctx.saved_tensors
        S = dy @ U.t()
        dx = S @ V.t() if ctx.needs_input_grad[0] else None
        dV = x.t() @ S
        dU = T.t() @ dy
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dV, dU, db


class PaperTTLinear(nn.Module):
    """The CoMERA paper's pure-PyTorch TT linear layer: merge the input-side
    cores into V (in x r_mid) and the output-side cores into U (r_mid x out)
    with plain autograd (batch independent, small), then two matmuls with a
    custom autograd backward that reuses them.

    Example:
        >>> import torch, comera
        >>> tt_layer = comera.TTLinear(64, 32, rank=4)
        >>> paper = PaperTTLinear.from_ttlinear(tt_layer)
        >>> x = torch.randn(3, 64)
        >>> torch.allclose(paper(x), tt_layer(x), atol=1e-5)
        True
    """

    def __init__(self, cores, gates, bias, num_in_cores, in_features, out_features):
        super().__init__()
        self.cores = nn.ParameterList(nn.Parameter(c.detach().clone()) for c in cores)
        self.gates = nn.ParameterList(nn.Parameter(g.detach().clone()) for g in gates)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.p, self.in_features, self.out_features = num_in_cores, in_features, out_features

    @classmethod
    def from_ttlinear(cls, layer: comera.TTLinear) -> "PaperTTLinear":
        return cls(layer.cores, layer.gates, layer.bias, layer.num_in_cores,
                   layer.in_features, layer.out_features)

    def forward(self, x):
        cores, gates = list(self.cores), list(self.gates)
        V = merge(cores[: self.p], gates[: self.p])[: self.in_features]
        U = merge(cores[self.p:], gates[self.p:]).reshape(V.shape[1], -1)[:, : self.out_features]
        lead = x.shape[:-1]
        y = _TwoMatmul.apply(x.reshape(-1, self.in_features), V, U, self.bias)
        return y.reshape(*lead, self.out_features)


def tltorch_blocktt(in_f, out_f, rank, implementation):
    """tensorly-torch's FactorizedLinear in its TT-matrix format (BlockTT):
    cores (r, m_k, n_k, r) over the same mode sizes comera picks."""
    import tltorch  # benchmark-only dependency
    return tltorch.FactorizedLinear(tuple(tt.factorize(in_f)), tuple(tt.factorize(out_f)),
                                    factorization="blocktt", rank=rank,
                                    implementation=implementation)


def equal_param_rank(in_f, out_f, target):
    """The tensorly-torch BlockTT rank whose parameter count is closest to
    `target` (ties: the smaller rank).

    Example:
        >>> r = equal_param_rank(768, 3072, 34706)   # comera's count at rank 30
        >>> r < 30
        True
    """
    best, r = None, 1
    while True:
        n = num_params(tltorch_blocktt(in_f, out_f, r, "factorized"))
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (r, n)
        if n >= target or r > max(in_f, out_f):
            return best[0]
        r += 1


def linear_rank(method, in_f, out_f, rank):
    """The rank `method` is built at for comera's `rank`: the same, except
    the equal-parameter variants (see EQUAL)."""
    if method.endswith(EQUAL):
        return equal_param_rank(in_f, out_f, num_params(comera.TTLinear(in_f, out_f, rank=rank)))
    return rank


def build_linear(method, in_f, out_f, rank):
    """One layer of `method` (one of LINEAR_METHODS), seeded so every run
    builds the same weights; `rank` is comera's rank (the equal-parameter
    variants convert it with linear_rank)."""
    if method not in LINEAR_METHODS:
        raise ValueError(f"method must be one of {LINEAR_METHODS}, got {method!r}")
    rank = linear_rank(method, in_f, out_f, rank)
    torch.manual_seed(0)
    if method == "nn.Linear":
        return nn.Linear(in_f, out_f)
    if method == "comera.TTLinear":
        return comera.TTLinear(in_f, out_f, rank=rank)
    if method == "paper scheme":
        return PaperTTLinear.from_ttlinear(comera.TTLinear(in_f, out_f, rank=rank))
    impl = "factorized" if "(factorized" in method else "reconstructed"
    return tltorch_blocktt(in_f, out_f, rank, impl)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
