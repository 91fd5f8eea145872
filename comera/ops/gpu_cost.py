"""A cost model of comera's CUDA kernels, for deciding on paper while no GPU
is at hand (docs/gpu_cost.md).

It walks the launch sequence of the CUDA launchers (``csrc/tt_linear/cuda.cu``,
``csrc/tt_embedding/cuda*.cu``) and gives every launch its FLOPs, the bytes it
moves to and from memory, and a roofline time on a named GPU::

    seconds(launch) = max(bytes / bandwidth, flops / rate) + launch_s

``rate`` is the tensor-core rate of the element type for the cuBLAS products
and the CUDA-core rate of the accumulator type (float32, or float64) for
comera's own kernels.  The launch counts are the launchers' own, checked
against the CUDA emulation's counts by the tests (the table
``tests/cuda_emu/launch_counts.txt``); bytes count each operand once (no
cache reuse, no re-reads), so the times are a lower bound.
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Union

import torch

_ELEMENT = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class GPU:
    """Peak rates of one GPU: HBM bandwidth (bytes/s), dense FLOP rates
    (FLOP/s) of the tensor cores per input type and of the CUDA cores, and
    ``launch_s``, the time one dependent launch adds (start-up and tail of a
    kernel replayed back to back, as in a CUDA graph).  Any function here
    takes one in place of a name.

    Example:
        >>> from comera.ops.gpu_cost import GPU, tt_linear_gpu_cost
        >>> mine = GPU("my GPU", bandwidth=2e12, tensor16=300e12, tf32=150e12, fp32=20e12,
        ...            fp64_tensor=10e12, fp64=10e12, launch_s=3e-6)
        >>> tt_linear_gpu_cost([4], [4], [1, 2, 1], 4, 4, 8, gpu=mine)["gpu"]
        'my GPU'
    """
    name: str
    bandwidth: float
    tensor16: float  # bfloat16 and float16 inputs, float32 accumulation
    tf32: float
    fp32: float
    fp64_tensor: float
    fp64: float
    launch_s: float


# SXM parts, dense (no sparsity) peak rates from the vendor's data sheets
GPUS: Dict[str, GPU] = {
    "H100": GPU("NVIDIA H100 SXM", bandwidth=3.35e12, tensor16=989.4e12, tf32=494.7e12,
                fp32=66.9e12, fp64_tensor=66.9e12, fp64=33.5e12, launch_s=2.0e-6),
    "H200": GPU("NVIDIA H200 SXM", bandwidth=4.8e12, tensor16=989.4e12, tf32=494.7e12,
                fp32=66.9e12, fp64_tensor=66.9e12, fp64=33.5e12, launch_s=2.0e-6),
}


def gpu_spec(gpu: Union[str, GPU]) -> GPU:
    """The :class:`GPU` entry for a name (``"H100"``, ``"H200"``, or a device
    name that contains one, such as ``"NVIDIA H200"``), or ``gpu`` itself.

    Example:
        >>> from comera.ops.gpu_cost import gpu_spec
        >>> gpu_spec("NVIDIA H100 80GB HBM3").bandwidth
        3350000000000.0
    """
    if isinstance(gpu, GPU):
        return gpu
    for key, spec in GPUS.items():
        if key.lower() in str(gpu).lower():
            return spec
    raise ValueError(f"gpu must be one of {sorted(GPUS)} (or a GPU entry), got {gpu!r}")


def _check_dtype(dtype):
    if dtype not in _ELEMENT:
        raise TypeError(f"dtype must be float32, float64, bfloat16 or float16, got {dtype}")


def _blas_rate(g: GPU, dtype, tf32: bool) -> float:
    if dtype in (torch.bfloat16, torch.float16):
        return g.tensor16
    if dtype == torch.float64:
        return g.fp64_tensor
    return g.tf32 if tf32 else g.fp32


class _Launches:
    """Collects the launches of one op call, phase by phase."""

    def __init__(self, g: GPU, dtype, tf32: bool):
        self.g, self.items, self.element = g, [], _ELEMENT[dtype]
        self.kernel_rate = g.fp64 if dtype == torch.float64 else g.fp32
        self.blas_rate = _blas_rate(g, dtype, tf32)

    def add(self, phase: str, kind: str, name: str, flops: float, nbytes: float, sizes=()):
        """``sizes``: a product's M, N, K and leading dimensions, in elements."""
        rate = self.blas_rate if kind == "blas" else self.kernel_rate
        seconds = max(nbytes / self.g.bandwidth, flops / rate) + self.g.launch_s
        item = {"phase": phase, "kind": kind, "name": name, "flops": float(flops),
                "bytes": float(nbytes), "seconds": seconds}
        if kind == "blas":  # every size a multiple of 16 bytes: cuBLAS's aligned kernels
            item["aligned"] = all(n * self.element % 16 == 0 for n in sizes)
        self.items.append(item)

    def summary(self, **head) -> dict:
        out = dict(head)
        out["gpu"] = self.g.name
        out["kernels"] = self.items
        for phase in ("forward", "backward"):
            mine = [k for k in self.items if k["phase"] == phase]
            out[phase] = {
                "flops": sum(k["flops"] for k in mine),
                "bytes": sum(k["bytes"] for k in mine),
                "seconds": sum(k["seconds"] for k in mine),
                "launches": {kind: sum(k["kind"] == kind for k in mine)
                             for kind in ("kernel", "blas", "copy")},
                "unaligned_blas": sum(not k.get("aligned", True) for k in mine),
            }
        for key in ("flops", "bytes", "seconds"):
            out[key] = out["forward"][key] + out["backward"][key]
        return out


# ------------------------------------------------------------------ linear
def _split_chunk(k: int) -> int:  # split_chunk in csrc/common/cuda_common.cuh
    c = 16
    while c < 256 and c * c < k:
        c += 1
    return c


def _split_count(k: int) -> int:
    c = _split_chunk(k)
    return -(-k // c) if k > c else 1


def tt_linear_gpu_cost(in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int],
                       in_features: int, out_features: int, batch: int,
                       dtype: torch.dtype = torch.bfloat16, *, bias: bool = True,
                       input_grad: bool = True, gpu: Union[str, GPU] = "H200",
                       tf32: bool = False) -> dict:
    """FLOPs, bytes, launches and predicted seconds of one forward and one
    backward call of ``comera::tt_linear`` on the GPU (the merge path, the
    only one there), launch by launch, for ``batch`` rows of ``dtype``.
    ``ranks`` has the two outer 1s; ``input_grad``: the backward computes
    dx; ``tf32``: float32 products on TF32 tensor cores.

    Returns a dict: ``kernels`` (one entry per launch: phase, kind
    ``kernel``/``blas``/``copy``, name, flops, bytes, seconds, and for a
    cuBLAS product ``aligned``: every size and leading dimension a multiple
    of 16 bytes, which cuBLAS's fastest tensor-core kernels need), ``forward``
    and ``backward`` (their sums, launch counts by kind and
    ``unaligned_blas``), and the totals ``flops``, ``bytes`` and ``seconds``.

    Example:
        >>> import torch
        >>> from comera.ops.gpu_cost import tt_linear_gpu_cost
        >>> c = tt_linear_gpu_cost([8, 8, 12], [12, 16, 16], [1, 8, 32, 32, 32, 16, 1],
        ...                        768, 3072, 4096, torch.bfloat16, gpu="H200")
        >>> c["forward"]["launches"], c["backward"]["launches"]
        ({'kernel': 4, 'blas': 2, 'copy': 1}, {'kernel': 11, 'blas': 4, 'copy': 0})
        >>> round(c["seconds"] * 1e6)   # microseconds, forward + backward
        67
    """
    _check_dtype(dtype)
    g = gpu_spec(gpu)
    dims = list(in_modes) + list(out_modes)
    r = list(ranks)
    p, D = len(in_modes), len(dims)
    if len(r) != D + 1 or r[0] != 1 or r[-1] != 1 or min(dims + r) < 1 or batch < 0:
        raise ValueError(f"tt_linear_gpu_cost: ranks {r} must have len(in_modes) + "
                         f"len(out_modes) + 1 = {D + 1} positive entries, 1 at both ends, "
                         f"and batch {batch} must be >= 0")
    e, a = _ELEMENT[dtype], (8 if dtype == torch.float64 else 4)
    B, n_in, n_out, rm, hb = batch, in_features, out_features, r[p], int(bool(bias))
    size = [r[k] * dims[k] * r[k + 1] for k in range(D)]
    ncore, ngated, ngates = sum(size), sum(size[:-1]), sum(r[1:D])
    out_pad = math.prod(out_modes)
    # rows of P_k, the product of the cores first..k of k's merge chain
    chains = [(0, p - 1), (p, D - 1)]
    rows, P = [0] * D, 0
    for first, last in chains:
        m = r[first]
        for k in range(first, last + 1):
            m *= dims[k]
            rows[k] = m
            P += m * r[k + 1]
    steps = max(p, D - p) - 1
    # the rank the large products share, padded to 32 bytes (csrc/tt_linear/cuda.cu):
    # rp pads the rank (V, S), rk the rank and the bias ([T 1], [U; b])
    step = 32 // e
    rp, rk = (-(-n // step) * step for n in (rm, rm + hb))
    L = _Launches(g, dtype, tf32)

    def merges(phase):
        for step in range(1, steps + 1):
            fl = nb = 0
            for first, last in chains:
                k = first + step
                if k <= last:
                    M, K, N = rows[k - 1], r[k], dims[k] * r[k + 1]
                    fl += 2 * M * K * N
                    nb += a * (M * K + K * N + M * N)
            L.add(phase, "kernel", f"merge step {step}", fl, nb)

    # ---- forward (nothing at all for an empty batch)
    if B > 0:
        L.add("forward", "kernel", "gated cores", ncore, e * (ncore + ngates) + a * ncore)
        merges("forward")
        L.add("forward", "kernel", "pack V, [U; b]", 0,
              a * (n_in * rm + rm * n_out) + e * (n_in * rp + rk * n_out) + hb * e * (n_out + B * rk))
        L.add("forward", "blas", "T = x V", 2 * B * n_in * rp,
              e * (B * n_in + n_in * rp + (1 + hb) * B * rp), (B, rp, n_in, n_in, rp, rk))
        L.add("forward", "blas", "y = [T 1] [U; b]", 2 * B * rk * n_out,
              e * (B * rk + rk * n_out + B * n_out), (B, n_out, rk, rk, n_out, n_out))
        if rk != rm:
            L.add("forward", "copy", "t from the padded T", 0, 2 * e * B * rm)
    # ---- backward
    L.add("backward", "kernel", "gated cores, transposed, dP zeroed", ncore,
          e * (ncore + ngates) + a * (2 * ncore + P + (rk - rm) * out_pad))
    merges("backward")
    L.add("backward", "kernel", "pack V, U, [t 1]", 0,
          a * (n_in * rm + rm * n_out) + e * (n_in * rp + rp * n_out) + (rk != rm) * e * (B * rm + B * rk))
    if B > 0:
        L.add("backward", "blas", "S = dy U^T", 2 * B * n_out * rp,
              e * (B * n_out + rp * n_out + B * rp), (B, rp, n_out, n_out, n_out, rp))
        L.add("backward", "blas", "[dU; db] = [t 1]^T dy", 2 * rk * n_out * B,
              e * (B * rk + B * n_out) + a * rk * n_out, (rk, n_out, B, rk, n_out, out_pad))
        if input_grad:
            L.add("backward", "blas", "dx = S V^T", 2 * B * rp * n_in,
                  e * (B * rp + n_in * rp + B * n_in), (B, n_in, rp, rp, rp, n_in))
        L.add("backward", "blas", "dV = x^T S", 2 * n_in * rp * B,
              e * (B * n_in + B * rp) + a * n_in * rp, (n_in, rp, B, n_in, rp, rp))
        if rp != rm:
            L.add("backward", "copy", "dV from the padded product", 0, 2 * a * n_in * rm)
    nsplit = [1] * D  # split sums of d(eff_k) over the rows of P_{k-1}
    for step in range(steps):
        fl = nb = sum_bytes = 0
        for first, last in chains:
            k = last - step
            if k <= first:
                continue
            X, N = rows[k - 1], dims[k] * r[k + 1]
            nsplit[k] = _split_count(X)
            ns = _split_count(N)
            fl += 4 * X * r[k] * N  # d(eff_k) = P_{k-1}^T dP_k and dP_{k-1} = dP_k eff_k^T
            nb += a * (X * r[k] + 2 * X * N + nsplit[k] * r[k] * N + r[k] * N + ns * X * r[k])
            if ns > 1:
                sum_bytes += a * (ns + 1) * X * r[k]
        L.add("backward", "kernel", f"merge gradient step {step + 1}", fl, nb)
        if sum_bytes:
            L.add("backward", "kernel", f"split sums step {step + 1}", 0, sum_bytes)
    parts = sum(nsplit[k] * size[k] for k in range(D))
    L.add("backward", "kernel", "core gradients", parts + ngated,
          a * (parts + ncore) + e * (ncore + ngates) + hb * (a + e) * n_out)
    chunks = sum(r[k + 1] * -(-(size[k] // r[k + 1]) // 16) for k in range(D - 1))
    L.add("backward", "kernel", "gate gradient parts", 2 * ngated, (a + e) * ngated + a * chunks)
    L.add("backward", "kernel", "gate gradient sums", chunks, a * chunks + e * ngates)
    return L.summary(device="cuda", op="tt_linear", path="merge", batch=B,
                     dtype=str(dtype).replace("torch.", ""))


def dense_linear_gpu_cost(in_features: int, out_features: int, batch: int,
                          dtype: torch.dtype = torch.bfloat16, *, bias: bool = True,
                          input_grad: bool = True, gpu: Union[str, GPU] = "H200",
                          tf32: bool = False) -> dict:
    """The same model for :class:`torch.nn.Linear` (one cuBLAS product with
    the bias in its epilogue forward; dx and dW products and a bias column
    sum backward), to compare with :func:`tt_linear_gpu_cost`.

    Example:
        >>> import torch
        >>> from comera.ops.gpu_cost import dense_linear_gpu_cost
        >>> c = dense_linear_gpu_cost(768, 3072, 4096, torch.bfloat16, gpu="H200")
        >>> round(c["flops"] / 1e9, 1), round(c["seconds"] * 1e6)
        (58.0, 72)
    """
    _check_dtype(dtype)
    L = _Launches(gpu_spec(gpu), dtype, tf32)
    e, a = _ELEMENT[dtype], (8 if dtype == torch.float64 else 4)
    B, i, o, hb = batch, in_features, out_features, int(bool(bias))
    if B > 0:
        L.add("forward", "blas", "y = x W^T + b", 2 * B * i * o, e * (B * i + i * o + B * o + hb * o),
              (B, i, o))
        if input_grad:
            L.add("backward", "blas", "dx = dy W", 2 * B * o * i, e * (B * o + o * i + B * i),
                  (B, i, o))
        L.add("backward", "blas", "dW = dy^T x", 2 * o * B * i, e * (B * o + B * i + o * i),
              (B, i, o))
        if hb:
            L.add("backward", "kernel", "db = column sums of dy", B * o, e * (B * o + o) + a * o)
    return L.summary(device="cuda", op="linear", batch=B, dtype=str(dtype).replace("torch.", ""))


def tt_linear_gpu_plan(in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int],
                       in_features: int, out_features: int, batch: int,
                       dtype: torch.dtype = torch.bfloat16, *, bias: bool = True,
                       gpu: Union[str, GPU] = "H200") -> dict:
    """:func:`tt_linear_gpu_cost` with the same call of :class:`torch.nn.Linear`
    beside it (``"dense"``, :func:`dense_linear_gpu_cost`) and the predicted
    speed-up ``"x_vs_dense"`` (dense seconds over TT seconds): what
    ``TTLinear.plan(device="cuda")`` returns.

    Example:
        >>> import torch
        >>> from comera.ops.gpu_cost import tt_linear_gpu_plan
        >>> p = tt_linear_gpu_plan([8, 8, 12], [12, 16, 16], [1, 8, 32, 32, 32, 16, 1],
        ...                        768, 3072, 4096, torch.bfloat16, gpu="H200")
        >>> round(p["x_vs_dense"], 2)
        1.07
    """
    out = tt_linear_gpu_cost(in_modes, out_modes, ranks, in_features, out_features, batch, dtype,
                             bias=bias, gpu=gpu)
    out["dense"] = dense_linear_gpu_cost(in_features, out_features, batch, dtype, bias=bias,
                                         gpu=gpu)
    out["x_vs_dense"] = out["dense"]["seconds"] / out["seconds"]
    return out


# --------------------------------------------------------------- embedding
SORT_CHUNK = 1024  # elements ranked by one launch before the merge passes (cuda.cuh)


def _log2_passes(n: int) -> int:
    passes, w = 0, 1
    while w < n:
        passes, w = passes + 1, 2 * w
    return passes


REUSE_CODES = {"auto": 0, "none": 1, "dedup": 2, "prefix": 3}
MODE_CODES = {"plain": 0, "sum": 1, "mean": 2}
SORT_FLOPS_PER_INDEX = 512.0  # COMERA_EMB_SORT_FLOPS_PER_INDEX (comera/tt_embedding.h)


def tt_embedding_gpu_cost(row_modes: Sequence[int], dim_modes: Sequence[int],
                          ranks: Sequence[int], num_embeddings: int, embedding_dim: int, n: int,
                          dtype: torch.dtype = torch.float32, *, mode: str = "plain",
                          num_bags: int = 0, reuse: str = "auto",
                          gpu: Union[str, GPU] = "H200") -> dict:
    """The same model for one forward and one backward call of
    ``comera::tt_embedding`` on the GPU: ``n`` indices, ``mode`` ``"plain"``,
    ``"sum"`` or ``"mean"`` (with ``num_bags`` bags), ``reuse`` as the layer's
    (``"auto"`` sorts for deduplication when a row's contraction costs more
    than the sort).  Every slot is costed as contracted (as with no repeated
    index); a sort is one launch ranking chunks of 1024 (key, position)
    pairs of 16 bytes, then ``ceil(log2(n / 1024))`` merge passes.

    Example:
        >>> from comera.ops.gpu_cost import tt_embedding_gpu_cost
        >>> c = tt_embedding_gpu_cost([37, 25, 33], [8, 8, 12], [1, 32, 32, 1], 30522, 768,
        ...                           4096, reuse="dedup")
        >>> c["forward"]["launches"], c["backward"]["launches"]
        ({'kernel': 12, 'blas': 0, 'copy': 0}, {'kernel': 39, 'blas': 0, 'copy': 0})
    """
    _check_dtype(dtype)
    if mode not in MODE_CODES or reuse not in REUSE_CODES:
        raise ValueError(f"mode must be one of {sorted(MODE_CODES)} and reuse one of "
                         f"{sorted(REUSE_CODES)}, got {mode!r}, {reuse!r}")
    v, ed, r = list(row_modes), list(dim_modes), list(ranks)
    d = len(v)
    if len(ed) != d or len(r) != d + 1 or n < 0:
        raise ValueError(f"tt_embedding_gpu_cost: {d} row modes need {d} dim modes and "
                         f"{d + 1} ranks, got {ed} and {r}")
    L = _Launches(gpu_spec(gpu), dtype, False)
    e, a = _ELEMENT[dtype], (8 if dtype == torch.float64 else 4)
    E = [math.prod(ed[: k + 1]) for k in range(d)]
    level = [E[k] * r[k + 1] for k in range(d)]
    size = [r[k] * v[k] * ed[k] * r[k + 1] for k in range(d)]
    D, bags = embedding_dim, (num_bags if mode != "plain" else 0)
    flops_row = sum(2.0 * E[k - 1] * r[k] * ed[k] * r[k + 1] for k in range(1, d))
    dedup = reuse != "none" and (reuse != "auto" or flops_row > SORT_FLOPS_PER_INDEX)

    def sort(phase, what):  # sort_pairs in csrc/tt_embedding/cuda.cuh
        if n <= 1:
            return
        L.add(phase, "kernel", f"{what} chunk ranks", 2 * n * min(n, SORT_CHUNK), 32 * n)
        w, q = SORT_CHUNK, 0
        while w < n:
            q, w = q + 1, 2 * w
            L.add(phase, "kernel", f"{what} merge pass {q}", 0, 32 * n + 16 * n * _log2_passes(n))

    def common(phase, sorts):
        for k in range(d):
            L.add(phase, "kernel", f"gated core {k}", size[k], e * (size[k] + r[k + 1]) + a * size[k])
        if n == 0:
            return
        L.add(phase, "kernel", "slots", 0, 8 * n + 16 * n)
        if sorts:
            sort(phase, "index sort")
        L.add(phase, "kernel", "heads", 0, 48 * n)

    def level_kernel(phase, k):
        L.add(phase, "kernel", f"level {k}", 2 * n * level[k] * r[k],
              a * n * (level[k] + (level[k - 1] if k else 0)) + 16 * n)

    # ---- forward
    common("forward", dedup)
    for k in range(d):
        level_kernel("forward", k)
    out_rows = n if mode == "plain" else bags
    L.add("forward", "kernel", "output rows", n * D if mode != "plain" else 0,
          a * n * D + e * out_rows * D + 16 * n)
    # ---- backward (always sorted: deterministic sums)
    common("backward", True)
    for k in range(d - 1):
        level_kernel("backward", k)
    if mode != "plain":
        L.add("backward", "kernel", "bags", 0, 8 * (bags + n) + 16 * n)
    L.add("backward", "kernel", "seed gradient parts", n * D, e * out_rows * D + a * n * D)
    L.add("backward", "kernel", "seed gradient sums", n * D, a * (n * D + n * level[d - 1]))
    for k in range(d - 1, -1, -1):
        L.add("backward", "kernel", f"core {k} keys", 0, 16 * n + 16 * n)
        sort("backward", f"core {k}")
        L.add("backward", "kernel", f"core {k} slice bounds", 0, 8 * (v[k] + 1) + 8 * n)
        L.add("backward", "kernel", f"core {k} gradient parts", 2 * n * level[k] * r[k],
              a * n * (level[k] + (level[k - 1] if k else 0)))
        L.add("backward", "kernel", f"core {k} gradient sums", size[k], a * 2 * size[k] + e * size[k])
        if k < d - 1:
            L.add("backward", "kernel", f"gate {k} gradient parts", 2 * size[k], (a + e) * size[k])
            L.add("backward", "kernel", f"gate {k} gradient sums", size[k] // 16 + r[k + 1],
                  a * (size[k] // 16) + e * r[k + 1])
        if k > 0:
            L.add("backward", "kernel", f"level {k} gradient", 2 * n * level[k - 1] * ed[k] * r[k + 1],
                  a * n * (level[k] + level[k - 1]))
    return L.summary(device="cuda", op="tt_embedding", n=n, mode=mode,
                     reuse="dedup" if dedup else "none", dtype=str(dtype).replace("torch.", ""))


def launch_counts(cost: dict) -> List[int]:
    """``[kernels, cuBLAS calls, copies]`` of the forward, then the backward,
    of a cost dict: the form of the launch table the CUDA emulation checks.

    Example:
        >>> from comera.ops.gpu_cost import launch_counts, tt_linear_gpu_cost
        >>> launch_counts(tt_linear_gpu_cost([5], [7], [1, 3, 1], 5, 7, 4, bias=False))
        [2, 2, 1, 5, 4, 1]
    """
    return [cost[phase]["launches"][kind] for phase in ("forward", "backward")
            for kind in ("kernel", "blas", "copy")]
