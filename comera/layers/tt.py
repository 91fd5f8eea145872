"""Tensor-train helpers shared by the layers: factorisation of sizes, rank
bounds, variance-matched initialisation, TT-SVD and dense reconstruction."""
import math
from typing import List, Optional, Sequence, Union

import torch


def _prime_factors(n: int) -> List[int]:
    out, d = [], 2
    while d * d <= n:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    if n > 1:
        out.append(n)
    return out


def _best_split(n: int, k: int) -> List[int]:
    """The k factors of n (ascending) with the smallest largest factor."""
    best: Optional[List[int]] = None

    def rec(rest: int, k_left: int, lo: int, acc: List[int]):
        nonlocal best
        if k_left == 1:
            if rest >= lo:
                cand = acc + [rest]
                if best is None or max(cand) < max(best):
                    best = cand
            return
        d = lo
        while d ** k_left <= rest:
            if rest % d == 0:
                rec(rest // d, k_left - 1, d, acc + [d])
            d += 1

    rec(n, k, 1, [])
    assert best is not None
    return best


def default_num_factors(n: int) -> int:
    return 3 if n >= 27 else 2 if n >= 4 else 1


MAX_AUTO_FACTORIZE = 2**32


def factorize(n: int, k: Optional[int] = None) -> List[int]:
    """Balanced factorisation of ``n`` into ``k`` factors, ascending.

    When ``n`` has no balanced factorisation (a prime, say), the smallest
    ``n' >= n`` that has one is factorised instead; the caller treats the
    extra ``n' - n`` entries as padding.

    Example:
        >>> factorize(768), factorize(3072), factorize(769)
        ([8, 8, 12], [12, 16, 16], [7, 10, 11])
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"factorize: n must be a positive int, got {n!r}")
    if n > MAX_AUTO_FACTORIZE:
        # the search below is trial division: fine for any real layer, but
        # it would take minutes (or hang) for astronomically large sizes
        raise ValueError(f"factorize: {n} is above {MAX_AUTO_FACTORIZE} (2**32), too large to "
                         "factorise automatically; pass the modes explicitly (TTLinear's "
                         "in_shape/out_shape, TTEmbedding's shape)")
    k = default_num_factors(n) if k is None else k
    if k < 1:
        raise ValueError(f"factorize: k must be >= 1, got {k}")
    if k == 1:
        return [n]
    limit = 1.5 * n ** (1.0 / k) + 1.0
    best = None
    for cand in range(n, n + max(16, n // 20) + 1):
        split = _best_split(cand, k)
        if max(split) <= limit:
            return split
        if best is None or max(split) < max(best):
            best = split
    return best


INT64_MAX = 2**63 - 1
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""The parameter dtypes of the TT layers."""


def check_sizes(**sizes: int) -> None:
    """Each keyword a layer size: an int in ``[1, 2**63 - 1]``, else TypeError /
    ValueError naming it.

    Example:
        >>> check_sizes(in_features=0)
        Traceback (most recent call last):
        ...
        ValueError: in_features must be in [1, 2**63 - 1], got 0
    """
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not 1 <= v <= INT64_MAX:
            raise ValueError(f"{name} must be in [1, 2**63 - 1], got {v}")


def dense_source(source, modules: tuple, layout: str):
    """``(weight, dtype)`` of what ``from_dense`` was given: a module of the
    ``modules`` types (its ``weight``) or a 2-D tensor ``layout``; ``dtype`` is
    the weight's own when a TT layer may have it, else float32."""
    if isinstance(source, modules):
        weight = source.weight
    elif isinstance(source, torch.Tensor):
        weight = source
    else:
        names = ", ".join(f"nn.{m.__name__}" for m in modules)
        raise TypeError(f"from_dense expects an {names} or a 2-D weight tensor, got "
                        f"{type(source).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D {layout}, got {tuple(weight.shape)}")
    return weight, weight.dtype if weight.dtype in DTYPES else torch.float32


def layer_dtype(dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a layer's parameters get (``None``: torch's default), checked."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be torch.float32, float64, bfloat16 or float16, got {dtype}")
    return dtype


def check_core_sizes(layer: str, core_shapes: Sequence[Sequence[int]], what: str) -> None:
    """Refuses, before anything is allocated, cores whose element count
    overflows int64 (the C kernels index with int64), naming ``what`` (the
    arguments that set the sizes)."""
    for k, shape in enumerate(core_shapes):
        n = math.prod(shape)
        if n > INT64_MAX:
            raise ValueError(f"{layer}: {what} give core {k} the shape {tuple(shape)} ({n} "
                             "elements), which overflows int64: use smaller modes or ranks")


def rank_bounds(dims: Sequence[int]) -> List[int]:
    """Largest useful rank of each internal bond of a TT with these modes."""
    out = []
    for k in range(1, len(dims)):
        out.append(min(math.prod(dims[:k]), math.prod(dims[k:])))
    return out


def resolve_ranks(rank: Union[int, Sequence[int]], dims: Sequence[int], name: str = "rank") -> List[int]:
    """Internal ranks (len(dims) - 1 ints) from an int or a list, capped at the TT bounds."""
    bounds = rank_bounds(dims)
    if isinstance(rank, bool) or not isinstance(rank, (int, list, tuple)):
        raise TypeError(f"{name} must be an int or a list of {len(bounds)} ints, got {type(rank).__name__}")
    if isinstance(rank, int):
        if rank < 1:
            raise ValueError(f"{name} must be >= 1, got {rank}")
        return [min(rank, b) for b in bounds]
    ranks = list(rank)
    if len(ranks) != len(bounds):
        raise ValueError(f"{name} must have {len(bounds)} entries (one per internal bond), got {len(ranks)}")
    for i, (r, b) in enumerate(zip(ranks, bounds)):
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{name}[{i}] must be an int, got {type(r).__name__}")
        if r < 1:
            raise ValueError(f"{name}[{i}] must be >= 1, got {r}")
        if r > b:
            raise ValueError(f"{name}[{i}] = {r} exceeds the TT bound {b} of that bond")
    return ranks


def init_std(num_cores: int, inner_ranks: Sequence[int], target_var: float) -> float:
    """Std of iid zero-mean core entries so that the reconstructed matrix has
    variance ``target_var``: each entry is a sum over prod(inner_ranks) paths
    of products of num_cores entries, so Var = prod(r) * std^(2 D)."""
    paths = math.prod(inner_ranks) if inner_ranks else 1
    return (target_var / paths) ** (1.0 / (2 * num_cores))


@torch.no_grad()
def normal_cores_(cores: Sequence[torch.Tensor], std: float) -> None:
    """Fills each core in place with iid N(0, std^2) entries (drawn as
    ``torch.randn(shape) * std`` in the core's dtype, in float32 for
    bfloat16/float16 cores, then copied in; on the meta device nothing is
    drawn)."""
    for c in cores:
        if c.device.type == "meta":
            continue
        dtype = torch.float32 if c.dtype in (torch.bfloat16, torch.float16) else c.dtype
        c.copy_(torch.randn(c.shape, dtype=dtype, device=c.device) * std)


def tt_svd(tensor: torch.Tensor, dims: Sequence[int], ranks: Sequence[int]) -> List[torch.Tensor]:
    """TT-SVD of ``tensor`` (numel == prod(dims)) truncated to the inner
    ``ranks``; computed in float64, cores returned in float64 and contiguous
    (LAPACK's factors are column-major: parameters keeping those strides
    would be copied by every kernel call and round differently in a BLAS)."""
    C = tensor.detach().to(torch.float64).reshape(-1)
    cores, r_prev = [], 1
    for k in range(len(dims) - 1):
        C = C.reshape(r_prev * dims[k], -1)
        U, S, Vh = torch.linalg.svd(C, full_matrices=False)
        r = min(ranks[k], S.shape[0])
        cores.append(U[:, :r].reshape(r_prev, dims[k], r).contiguous())
        C = S[:r, None] * Vh[:r]
        r_prev = r
    cores.append(C.reshape(r_prev, dims[-1], 1).contiguous())
    return cores
