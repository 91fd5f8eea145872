"""The comera::tt_linear operator: fake, autograd, and a convenient wrapper.

Native files: ``csrc/tt_linear/op.cpp`` (torch glue), ``csrc/tt_linear/cpu.c``
(the CPU kernels and the planner), ``csrc/tt_linear/cuda.cu`` (the CUDA
kernels); the schemas of ``comera::tt_linear``, ``comera::tt_linear_backward``
and ``comera::tt_linear_plan`` are in ``csrc/registration.cpp``.
"""
from typing import List, Optional, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)

PATHS = {"auto": 0, "merge": 1, "sequential": 2}
PATH_NAMES = {v: k for k, v in PATHS.items()}


@torch.library.register_fake("comera::tt_linear")
def _tt_linear_fake(x, cores, gates, bias, num_in_cores, out_features, path):
    rmid = cores[num_in_cores - 1].shape[-1]
    return x.new_empty(x.shape[0], out_features), x.new_empty(x.shape[0], rmid)


@torch.library.register_fake("comera::tt_linear_backward")
def _tt_linear_backward_fake(grad_y, x, t, cores, gates, has_bias, needs_input_grad,
                             num_in_cores, out_features, path):
    gx = torch.empty_like(x) if needs_input_grad else x.new_empty(0)
    gb = x.new_empty(out_features) if has_bias else x.new_empty(0)
    return gx, [torch.empty_like(c) for c in cores], [torch.empty_like(g) for g in gates], gb


def _setup_context(ctx, inputs, output):
    x, cores, gates, bias, num_in_cores, out_features, path = inputs
    _, t = output
    ctx.save_for_backward(x, t, *cores, *gates)
    ctx.num_cores = len(cores)
    ctx.has_bias = bias is not None
    ctx.num_in_cores = num_in_cores
    ctx.out_features = out_features
    ctx.path = path
    ctx.mark_non_differentiable(t)


def _backward(ctx, grad_y, grad_t):
    x, t, *rest = ctx.saved_tensors
    cores, gates = rest[: ctx.num_cores], rest[ctx.num_cores:]
    gx, gcores, ggates, gb = torch.ops.comera.tt_linear_backward(
        grad_y.contiguous(), x, t, cores, gates, ctx.has_bias, ctx.needs_input_grad[0],
        ctx.num_in_cores, ctx.out_features, ctx.path)
    return (gx if ctx.needs_input_grad[0] else None, list(gcores), list(ggates),
            gb if ctx.has_bias else None, None, None, None)


torch.library.register_autograd("comera::tt_linear", _backward, setup_context=_setup_context)

# Autocast (AMP): the TT contractions always accumulate in float32.  On CPU,
# called directly under autocast, the op casts its floating inputs to float32
# (never float64 ones) and returns float32, like autocast's "fp32 ops"; the
# wrapper below then returns autocast's dtype, like F.linear (see
# _autocast_dtype).  On CUDA the wrapper runs the kernels in the autocast dtype
# (their accumulators are float32), which is where the GPU speed comes from.
torch.library.register_autocast("comera::tt_linear", "cpu", torch.float32)


def _autocast_dtype(x: torch.Tensor, compute: torch.dtype) -> Optional[torch.dtype]:
    """The output dtype autocast wants for a linear op on ``x`` (None when
    autocast is off for x's device, or the layer computes in float64, which
    autocast leaves alone)."""
    dev = x.device.type
    if compute != torch.float32 or dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def tt_linear(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
              bias: Optional[torch.Tensor], num_in_cores: int, out_features: int,
              path: str = "auto") -> torch.Tensor:
    """Applies a TT linear map to ``x`` of shape ``(*, in_features)``.

    ``cores`` (input cores first) and ``gates`` follow docs/design.md section 2;
    computation happens in the cores' dtype (a bfloat16/float16 ``x`` is
    computed in float32 and returned in its own dtype).  Under
    ``torch.autocast("cpu")`` a float32 layer computes in float32 and returns
    autocast's dtype (bfloat16 by default), as ``F.linear`` does.  Under
    ``torch.autocast("cuda")`` a CUDA call runs in the autocast dtype with
    float32 accumulation, like :class:`torch.nn.Linear`: cores, gates and bias
    are cast per call and their gradients flow back in their own dtype.

    Example:
        >>> import torch, comera
        >>> layer = comera.TTLinear(6, 4, rank=2)
        >>> y = comera.ops.tt_linear(torch.randn(3, 6), list(layer.cores), list(layer.gates),
        ...                          layer.bias, len(layer.in_shape), 4)
        >>> y.shape
        torch.Size([3, 4])
    """
    compute = cores[0].dtype
    autocast = x.is_cuda and torch.is_autocast_enabled("cuda") and compute == torch.float32
    if autocast:
        compute = torch.get_autocast_dtype("cuda")
        cores = [c.to(compute) for c in cores]
        gates = [g.to(compute) for g in gates]
        bias = bias.to(compute) if bias is not None else None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != compute:
        x2 = x2.to(compute)
    y, _ = torch.ops.comera.tt_linear(x2.contiguous(), list(cores), list(gates), bias,
                                      num_in_cores, out_features, PATHS[path])
    out_dtype = y.dtype if autocast else (_autocast_dtype(x, compute) or x.dtype)
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y.reshape(*lead, out_features)


def tt_linear_plan(in_modes: List[int], out_modes: List[int], ranks: List[int],
                   in_features: int, out_features: int, batch: int) -> dict:
    """The C planner's costs for ``batch`` rows, as a dict.

    Example:
        >>> from comera.ops import tt_linear_plan
        >>> tt_linear_plan([8, 8, 12], [12, 16, 16], [1, 30, 30, 30, 30, 30, 1], 768, 3072, 4096)["path"]
        'merge'
    """
    try:
        v = torch.ops.comera.tt_linear_plan(list(in_modes), list(out_modes), list(ranks),
                                            in_features, out_features, batch).tolist()
    except ValueError as err:
        # the native planner reports overflowing sizes as ValueError; name the arguments
        raise ValueError(f"tt_linear_plan: in_modes {list(in_modes)}, out_modes "
                         f"{list(out_modes)}, ranks {list(ranks)} and batch {batch} give sizes "
                         f"that overflow int64 ({str(err).splitlines()[0]})") from None
    return {
        "path": PATH_NAMES[int(v[0])],
        "batch": batch,
        "merge": {"flops": v[1], "bytes": v[2], "seconds": v[3]},
        "sequential": {"flops": v[4], "bytes": v[5], "seconds": v[6]},
    }
