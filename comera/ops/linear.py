"""The comera::tt_linear operator: fake, autograd, and a convenient wrapper.

Native files: ``csrc/tt_linear/op.cpp`` (torch glue), ``csrc/tt_linear/cpu.c``
(the CPU kernels and the planner), ``csrc/tt_linear/cuda.cu`` (the CUDA
kernels); the schemas of ``comera::tt_linear``, ``comera::tt_linear_backward``
and ``comera::tt_linear_plan`` are in ``csrc/registration.cpp``.
"""
from typing import List, Optional, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)
from comera.ops import route
from comera.ops.func import any_batched, composite_vjp, func_active, needs_graph, register_loop_vmap

_HALF = (torch.bfloat16, torch.float16)

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


def dense_wt(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], num_in_cores: int,
             in_features: int, out_features: int) -> torch.Tensor:
    """The dense ``(in_features, out_features)`` matrix ``W^T`` of TT cores
    (plain torch ops, differentiable to any order)."""
    from comera import tt
    p = num_in_cores
    V = tt.merge(cores[:p], gates[:p])
    U = tt.merge(cores[p:], gates[p:]).reshape(V.shape[1], -1)
    return (V @ U)[:in_features, :out_features]


def _graph_backward(grad_y, x, cores, gates, has_bias, num_in_cores, out_features):
    """Gradients that are themselves differentiable (double backward,
    hessians): from the dense form ``x @ W^T``, which costs
    ``in_features * out_features`` memory, like nn.Linear."""
    def f(x_, cores_, gates_):
        return x_ @ dense_wt(cores_, gates_, num_in_cores, x_.shape[-1], out_features)

    gx, gcores, ggates = composite_vjp(f, (x, list(cores), list(gates)), grad_y)
    return gx, list(gcores), list(ggates), grad_y.sum(0) if has_bias else None


def _backward(ctx, grad_y, grad_t):
    x, t, *rest = ctx.saved_tensors
    cores, gates = rest[: ctx.num_cores], rest[ctx.num_cores:]
    if needs_graph():
        gx, gcores, ggates, gb = _graph_backward(grad_y, x, cores, gates, ctx.has_bias,
                                                 ctx.num_in_cores, ctx.out_features)
        return (gx if ctx.needs_input_grad[0] else None, gcores, ggates, gb, None, None, None)
    gx, gcores, ggates, gb = torch.ops.comera.tt_linear_backward(
        grad_y.contiguous(), x, t, cores, gates, ctx.has_bias, ctx.needs_input_grad[0],
        ctx.num_in_cores, ctx.out_features, ctx.path)
    return (gx if ctx.needs_input_grad[0] else None, list(gcores), list(ggates),
            gb if ctx.has_bias else None, None, None, None)


torch.library.register_autograd("comera::tt_linear", _backward, setup_context=_setup_context)

# ------------------------------------------------------------- eager autograd
class _EagerTTLinear(torch.autograd.Function):
    """The eager training path: the same two operators as the registered
    autograd, without its per-call pytree walk over the list arguments (a
    TTLinear(128, 128) on 8 rows: forward + backward 314 -> 173 us, of which
    the two C calls are 58).  torch.compile and torch.func keep the
    registered autograd and _TTLinearFunction.  Inputs are flat: x, bias,
    num_in_cores, out_features, path, num_cores, *cores, *gates."""

    @staticmethod
    def forward(ctx, x, bias, num_in_cores, out_features, path, num_cores, *cg):
        # below autograd: this Function records the call (the registered
        # autograd would otherwise run, and cost a redispatch, here too)
        with torch._C._AutoDispatchBelowAutograd():
            y, t = torch.ops.comera.tt_linear.default(x, list(cg[:num_cores]),
                                                      list(cg[num_cores:]), bias, num_in_cores,
                                                      out_features, path)
        ctx.save_for_backward(x, t, *cg)
        # the context _TTLinearFunction.backward reads (same inputs, same order)
        ctx.num_cores, ctx.has_bias = num_cores, bias is not None
        ctx.args = (num_in_cores, out_features, path)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return _TTLinearFunction.backward(ctx, grad_y, None)


def _call_op(x, cores, gates, bias, num_in_cores, out_features, path):
    """y of the operator in eager mode: through _EagerTTLinear where autograd
    may record the call, else straight below the autograd key (the registered
    autograd would only check and redispatch: 12 of a one-row call's 33 us).
    torch.compile traces the registered operator."""
    if torch.compiler.is_compiling():
        y, _ = torch.ops.comera.tt_linear(x, list(cores), list(gates), bias, num_in_cores,
                                          out_features, path)
    elif torch.is_grad_enabled():
        y = _EagerTTLinear.apply(x, bias, num_in_cores, out_features, path, len(cores),
                                 *cores, *gates)
    else:
        with torch._C._AutoDispatchBelowAutograd():
            y, _ = torch.ops.comera.tt_linear.default(x, list(cores), list(gates), bias,
                                                      num_in_cores, out_features, path)
    return y


# ------------------------------------------------------------- torch.func
class _TTLinearFunction(torch.autograd.Function):
    """tt_linear for torch.func transforms and forward-mode AD (see comera.ops.func).
    Inputs are flat: x, bias, num_in_cores, out_features, path, num_cores,
    *cores, *gates."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, bias, num_in_cores, out_features, path, num_cores, *cg):
        y, t = torch.ops.comera.tt_linear(x, list(cg[:num_cores]), list(cg[num_cores:]), bias,
                                          num_in_cores, out_features, path)
        return y, t

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, num_in_cores, out_features, path, num_cores, *cg = inputs
        ctx.save_for_backward(x, output[1], *cg)
        ctx.save_for_forward(x, *cg)
        ctx.mark_non_differentiable(output[1])
        ctx.num_cores, ctx.has_bias = num_cores, bias is not None
        ctx.args = (num_in_cores, out_features, path)

    @staticmethod
    def backward(ctx, grad_y, grad_t):
        x, t, *cg = ctx.saved_tensors
        n = ctx.num_cores
        num_in_cores, out_features, path = ctx.args
        if needs_graph():
            gx, gcores, ggates, gb = _graph_backward(grad_y, x, cg[:n], cg[n:], ctx.has_bias,
                                                     num_in_cores, out_features)
            return (gx if ctx.needs_input_grad[0] else None, gb, None, None, None, None,
                    *gcores, *ggates)
        gx, gcores, ggates, gb = torch.ops.comera.tt_linear_backward(
            grad_y.contiguous(), x, t, cg[:n], cg[n:], ctx.has_bias, ctx.needs_input_grad[0],
            num_in_cores, out_features, path)
        return (gx if ctx.needs_input_grad[0] else None, gb if ctx.has_bias else None,
                None, None, None, None, *gcores, *ggates)

    @staticmethod
    def jvp(ctx, dx, dbias, _a, _b, _c, _d, *dcg):
        # y = f(x, cores, gates) + bias, f linear in x and in each core and gate
        # separately: the tangent is one f call per input that has a tangent
        x, *cg = ctx.saved_tensors
        n = ctx.num_cores
        num_in_cores, out_features, path = ctx.args
        out = None

        def add(x_, cg_):
            nonlocal out
            y, _ = torch.ops.comera.tt_linear(x_.contiguous(), list(cg_[:n]), list(cg_[n:]),
                                              None, num_in_cores, out_features, path)
            out = y if out is None else out + y

        if dx is not None:
            add(dx, cg)
        for k, d in enumerate(dcg):
            if d is not None:
                add(x, cg[:k] + [d] + cg[k + 1:])
        if dbias is not None:
            out = dbias.expand(x.shape[0], out_features) if out is None else out + dbias
        if out is None:
            out = x.new_zeros(x.shape[0], out_features)
        return out, None


def _linear_function(x, cores, gates, bias, num_in_cores, out_features, path):
    y, _ = _TTLinearFunction.apply(x, bias, num_in_cores, out_features, path, len(cores),
                                   *cores, *gates)
    return y


def _fold_forward(info, in_dims, x, cores, gates, bias, num_in_cores, out_features, path):
    """Only x batched: its batch dim joins the rows, exactly."""
    if any_batched(in_dims[1:]):
        return None
    B = info.batch_size
    xb = x.movedim(in_dims[0], 0)
    rows = xb.shape[1]
    y, t = torch.ops.comera.tt_linear(xb.reshape(B * rows, xb.shape[-1]).contiguous(), cores,
                                      gates, bias, num_in_cores, out_features, path)
    return (y.reshape(B, rows, -1), t.reshape(B, rows, -1)), (0, 0)


register_loop_vmap("tt_linear", _fold_forward)
register_loop_vmap("tt_linear_backward")


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
    computed in float32 and returned in its own dtype).  bfloat16/float16
    cores: on CUDA the kernels take them (float32 accumulation); on the CPU,
    whose kernels take float32/float64 only, cores, gates, bias and ``x`` are
    cast to float32 per call and the result is cast back (gradients reach the
    half-precision parameters through the casts).  Under
    ``torch.autocast("cpu")`` a float32 layer computes in float32 and returns
    autocast's dtype (bfloat16 by default), as ``F.linear`` does.  Under
    ``torch.autocast("cuda")`` a CUDA call runs in the autocast dtype with
    float32 accumulation, like :class:`torch.nn.Linear`: cores, gates and bias
    are cast per call and their gradients flow back in their own dtype.
    Under ``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``, ``jvp``)
    and forward-mode AD the call goes through an ``autograd.Function`` with
    ``setup_context``, a vmap rule and a ``jvp`` (see :mod:`comera.ops.func`).
    With ``COMERA_ROUTE=auto`` (opt-in), a large float32 CPU call with
    ``path="auto"`` may run in torch's BLAS instead of the C kernels, where
    that was measured faster (see :mod:`comera.ops.route`).

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
    elif compute in _HALF and not x.is_cuda:
        # the CPU kernels take float32/float64 only: float32 math, module dtype out
        compute = torch.float32
        cores = [c.float() for c in cores]
        gates = [g.float() for g in gates]
        bias = bias.float() if bias is not None else None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != compute:
        x2 = x2.to(compute)
    if func_active():
        y = _linear_function(x2.contiguous(), list(cores), list(gates), bias, num_in_cores,
                             out_features, PATHS[path])
    elif route.use_torch(x2, cores, gates, bias, num_in_cores, out_features, path):
        y = route.merge_torch(x2, list(cores), list(gates), bias, num_in_cores, out_features)
    else:
        y = _call_op(x2.contiguous(), cores, gates, bias, num_in_cores, out_features, PATHS[path])
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
