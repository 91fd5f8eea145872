"""Routing a TT linear call to torch's BLAS where that is measured faster
(opt-in: ``COMERA_ROUTE=auto``).

On the merge path a TT linear call is two batch-sized products (``x V``,
then ``T U``; four more in its backward) around two small merges of the
cores.  comera's C kernels run them; on some machines and shapes the BLAS
that torch already carries is as fast (wide ranks on an AVX-512 Xeon,
docs/design.md section 5).  With ``COMERA_ROUTE=auto`` in the environment
when comera is imported, or after :func:`set_mode` ``("auto")``, a float32 CPU call with ``path="auto"`` whose forward costs
at least :data:`MIN_FLOPS` is timed once both ways, on its own input
(forward, and backward when gradients are wanted; interleaved, the fastest
of 5 rounds after a warm-up), and the faster way is cached per key: core
shapes, bias, gradient wanted or not, rows rounded up to a power of two and
torch's thread count.  Later calls with the same key follow the cache.  The
torch way is the paper's scheme: the cores merged into ``V`` and ``U`` with
autograd, then ``addmm(bias, x V, U)``.

Off by default, like ``torch.backends.cudnn.benchmark``: the one-off timing
raises the first call's peak memory (about 2x for 768 -> 3072 at 4096 rows),
and where the two ways are within a machine's noise the choice can differ
between runs, and with it the last bits of the results.  ``comera`` (or
unset) runs the C kernels only; ``torch`` routes every eligible call.

Never routed: smaller calls (the C kernel's lower per-call overhead wins
there; never timed), calls that ``torch.compile`` traces (the compiled graph
holds the C kernel's op), torch.func transforms, ``torch.autocast("cpu")``,
float64, CUDA.  ``TTLinear.plan()`` shows the choice for its layer.

Example:
    >>> import torch, comera
    >>> from comera.ops import route
    >>> layer = comera.TTLinear(256, 256, rank=8)
    >>> layer(torch.randn(8, 256)).shape
    torch.Size([8, 256])
    >>> layer.plan(8)["route"]["choice"]   # mode 'comera' (the default): the C kernels
    'comera'
"""
import os
import time
from typing import Dict, Optional, Sequence

import torch

from comera.ops.dense import merge
from comera.ops.linear_plan import tt_linear_plan

MIN_FLOPS = 1e8
"""Forward FLOPs of the two merge-path products below which no call is timed."""

ENV = "COMERA_ROUTE"
_MODES = ("auto", "comera", "torch")
_ROUNDS = 5

_choices: Dict[tuple, dict] = {}


def _checked(mode: str, source: str) -> str:
    if mode not in _MODES:
        raise ValueError(f"{source} must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


# read once: a call checks this flag, never the environment
_mode = _checked(os.environ.get(ENV) or "comera", ENV)


def set_mode(mode: str) -> str:
    """Sets the routing mode (``"comera"``, ``"auto"`` or ``"torch"``; the
    initial one comes from ``COMERA_ROUTE`` at import) and returns the
    previous one.

    Example:
        >>> from comera.ops import route
        >>> previous = route.set_mode("auto")
        >>> route.mode()
        'auto'
        >>> _ = route.set_mode(previous)
    """
    global _mode
    previous, _mode = _mode, _checked(mode, "mode")
    return previous


def mode() -> str:
    """The routing mode in force (see :func:`set_mode`)."""
    return _mode


def clear() -> None:
    """Forgets every measured choice (the next eligible call is timed again).

    Example:
        >>> from comera.ops import route
        >>> route.clear()
        >>> route.choices()
        {}
    """
    _choices.clear()


def choices() -> Dict[tuple, dict]:
    """A copy of the cache: key -> ``{"choice", "comera_s", "torch_s"}``."""
    return dict(_choices)


def _key(cores: Sequence[torch.Tensor], has_bias: bool, rows: int, grad: bool) -> tuple:
    bucket = 1 << max(0, int(rows) - 1).bit_length()
    return (tuple(tuple(c.shape) for c in cores), bool(has_bias), bucket, bool(grad),
            torch.get_num_threads())


def _flops(cores, num_in_cores: int, rows: int, in_features: int, out_features: int) -> float:
    rmid = cores[num_in_cores - 1].shape[-1]
    return 2.0 * rows * rmid * (in_features + out_features)


def merge_torch(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
                bias: Optional[torch.Tensor], num_in_cores: int, out_features: int) -> torch.Tensor:
    """The merge path in torch ops (autograd throughout): ``V`` and ``U``
    merged from the cores, then ``addmm(bias, x V, U)``; ``x`` is 2-D.

    Example:
        >>> import torch, comera
        >>> from comera.ops.route import merge_torch
        >>> layer = comera.TTLinear(12, 6, rank=3)
        >>> x = torch.randn(4, 12)
        >>> y = merge_torch(x, list(layer.cores), list(layer.gates), layer.bias, 2, 6)
        >>> torch.allclose(y, layer(x), atol=1e-5)
        True
    """
    p = num_in_cores
    V = merge(cores[:p], gates[:p])[: x.shape[1]]
    U = merge(cores[p:], gates[p:]).reshape(V.shape[1], -1)[:, :out_features]
    T = x @ V
    return T @ U if bias is None else torch.addmm(bias, T, U)


def _wants_grad(x, cores, gates, bias) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [x, *cores, *gates] + ([bias] if bias is not None else [])
    return any(t.requires_grad for t in tensors)


def _time_both(x, cores, gates, bias, num_in_cores, out_features, grad) -> dict:
    """Forward (+ backward) of both ways on detached copies, interleaved."""
    def leaf(t):
        return None if t is None else t.detach().requires_grad_(grad)

    xs, b = leaf(x), leaf(bias)
    cs, gs = [leaf(c) for c in cores], [leaf(g) for g in gates]
    dy = torch.full((x.shape[0], out_features), 1e-3, dtype=x.dtype) if grad else None
    leaves = [t for t in [xs, b, *cs, *gs] if t is not None]

    def comera_way():
        y, _ = torch.ops.comera.tt_linear(xs, cs, gs, b, num_in_cores, out_features, 0)
        return y

    def torch_way():
        return merge_torch(xs, cs, gs, b, num_in_cores, out_features)

    def once(fn):
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        with torch.enable_grad() if grad else torch.no_grad():
            y = fn()
            if grad:
                y.backward(dy)
        return time.perf_counter() - t0

    once(comera_way), once(torch_way)  # warm-up: first-touch pages, packing buffers
    tc, tt_ = [], []
    for _ in range(_ROUNDS):
        tc.append(once(comera_way))
        tt_.append(once(torch_way))
    # the minimum: what each way costs when nothing else takes the core (the
    # median moved by 10% and more between repeats on a shared machine)
    c, t = min(tc), min(tt_)
    return {"choice": "torch" if t < c else "comera", "comera_s": c, "torch_s": t}


def _merge_planned(cores, num_in_cores, rows, in_features, out_features) -> bool:
    dims = [c.shape[1] for c in cores]
    ranks = [1] + [c.shape[-1] for c in cores[:-1]] + [1]
    plan = tt_linear_plan(dims[:num_in_cores], dims[num_in_cores:], ranks, in_features,
                          out_features, rows)
    return plan["path"] == "merge"


def use_torch(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
              bias: Optional[torch.Tensor], num_in_cores: int, out_features: int,
              path: str) -> bool:
    """Whether this call (``x`` 2-D, in the compute dtype) runs in torch ops."""
    mode = _mode
    if mode == "comera" or path != "auto":
        return False
    rows, in_features = x.shape
    if mode == "auto" and _flops(cores, num_in_cores, rows, in_features, out_features) < MIN_FLOPS:
        return False
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32
            or rows == 0 or torch.is_autocast_enabled("cpu")):
        # compiled graphs keep the C op; under autocast torch's matmuls would run in
        # its dtype, the C kernel in float32
        return False
    if mode == "torch":
        return True
    grad = _wants_grad(x, cores, gates, bias)
    key = _key(cores, bias is not None, rows, grad)
    if key not in _choices:
        hit = None
        if _merge_planned(cores, num_in_cores, rows, in_features, out_features):
            try:
                hit = _time_both(x, cores, gates, bias, num_in_cores, out_features, grad)
            except RuntimeError:
                pass  # e.g. out of memory for the second copy: keep the C kernel
        _choices[key] = hit or {"choice": "comera", "comera_s": None, "torch_s": None}
    return _choices[key]["choice"] == "torch"


def describe(cores: Sequence[torch.Tensor], has_bias: bool, num_in_cores: int, in_features: int,
             out_features: int, rows: int) -> dict:
    """The routing of a layer's calls of ``rows`` rows, for ``TTLinear.plan()``:
    ``choice`` ("comera", "torch", or "not timed yet"), ``why``, and the
    timings of the training and inference keys where measured."""
    dev, dtype = cores[0].device.type, cores[0].dtype
    if dev != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return {"choice": "comera", "why": f"only float32 CPU calls are routed ({dev}, {dtype})"}
    mode = _mode
    if mode == "comera":
        return {"choice": "comera", "why": "mode 'comera': the C kernels (routing is opt-in: "
                f"{ENV}=auto or route.set_mode('auto'))"}
    if mode != "auto":
        return {"choice": mode, "why": f"mode {mode!r}"}
    if _flops(cores, num_in_cores, rows, in_features, out_features) < MIN_FLOPS:
        return {"choice": "comera", "why": f"below MIN_FLOPS ({MIN_FLOPS:g}): never timed"}
    out = {"choice": "not timed yet", "why": "timed at the first call with this key"}
    for grad, name in ((True, "training"), (False, "inference")):
        hit = _choices.get(_key(cores, has_bias, rows, grad))
        if hit is not None:
            out[name] = dict(hit)
            if out["choice"] == "not timed yet":
                out["choice"], out["why"] = hit["choice"], f"measured ({name} call)"
    return out
