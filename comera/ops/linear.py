"""The comera::tt_linear operator: fake, autograd, and a convenient wrapper.

Native files: ``csrc/tt_linear/op.cpp`` (torch glue), ``cpu_impl.h`` (the CPU
kernels' body, compiled once per dtype as ``cpu_f32.c`` and ``cpu_f64.c``),
``plan.c`` (the planner), ``cuda.cu`` (the CUDA kernels); the schemas of
``comera::tt_linear``, ``comera::tt_linear_backward`` and
``comera::tt_linear_plan`` are in ``csrc/registration.cpp``.
"""
import operator
from typing import List, Optional, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)
from comera.ops import route
from comera.ops.dense import merge
from comera.ops.linear_plan import PATHS
from comera.ops.func import (any_batched, composite_vjp, eager_apply, func_active, legacy_batched,
                             needs_graph, register_loop_vmap, straight_to_kernel, unview_reshape)

_HALF = (torch.bfloat16, torch.float16)
# The CPU kernels themselves, for calls that nothing above them would change
# (straight_to_kernel): the guard that skips autograd, or the packet's
# dispatch, costs a small call 1-3 us.
_FORWARD_CPU = torch.ops.comera.tt_linear.default._handle.redispatch_boxed
_BACKWARD_CPU = torch.ops.comera.tt_linear_backward.default._handle.redispatch_boxed
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)



@torch.library.register_fake("comera::tt_linear")
def _tt_linear_fake(x, cores, gates, bias, num_in_cores, out_features, path):
    rmid = cores[num_in_cores - 1].shape[-1]
    act = cores[0].dtype if cores[0].dtype in _HALF else x.dtype  # y and t: the 16-bit type
    return (x.new_empty(x.shape[0], out_features, dtype=act),
            x.new_empty(x.shape[0], rmid, dtype=act))


@torch.library.register_fake("comera::tt_linear_backward")
def _tt_linear_backward_fake(grad_y, x, t, cores, gates, has_bias, needs_input_grad,
                             num_in_cores, out_features, path):
    gx = torch.empty_like(x) if needs_input_grad else x.new_empty(0)
    gb = cores[0].new_empty(out_features) if has_bias else cores[0].new_empty(0)
    return gx, [torch.empty_like(c) for c in cores], [torch.empty_like(g) for g in gates], gb


# ------------------------------------------------------------------ autograd
# One backward, two doors to it: the operator's own autograd registration
# (direct calls of torch.ops.comera.tt_linear, torch.compile, torch.export)
# and TTLinearFunction (every call of the Python wrapper: eager training,
# torch.func transforms, forward-mode AD).  Both save (x, t, cores, gates).
def _composite(x, cores, gates, num_in_cores, out_features):
    """``x`` (2-D) times the TT weight in plain torch ops: the merge path, ``V``
    and ``U`` merged from the cores (``(in_features + out_features) * r``
    memory, never the dense weight).  Differentiable to any order and
    traceable by either vmap (the older one has no rule for the alias that a
    full-range slice makes, so padding is cut only where there is some)."""
    p = num_in_cores
    V = merge(cores[:p], gates[:p])
    if V.shape[0] != x.shape[-1]:
        V = V[: x.shape[-1]]
    U = merge(cores[p:], gates[p:]).reshape(V.shape[1], -1)
    if U.shape[1] != out_features:
        U = U[:, :out_features]
    return (x @ V) @ U


def _backward_from(saved, needs_x, num_cores, has_bias, num_in_cores, out_features, path,
                   grad_y):
    """(dx, dcores, dgates, dbias) from the saved tensors, by the backward op;
    by the vjp of :func:`_composite` when the gradients must be differentiable
    (double backward, hessians) or ``grad_y`` is a batch of the older vmap
    (``autograd.grad(is_grads_batched=True)``, ``jacobian(vectorize=True)``,
    gradcheck's batched check; see :func:`comera.ops.func.legacy_batched`)."""
    x, t, *cg = saved
    cores, gates = list(cg[:num_cores]), list(cg[num_cores:])
    if needs_graph() or legacy_batched(grad_y):
        def f(x_, cores_, gates_):
            return _composite(x_, cores_, gates_, num_in_cores, out_features)

        gx, gcores, ggates = composite_vjp(f, (x, cores, gates), grad_y)
        gb = grad_y.sum(0) if has_bias else None
    else:
        args = (grad_y.contiguous(), x, t, cores, gates, has_bias, needs_x, num_in_cores,
                out_features, path)
        if straight_to_kernel(x, cores[0]):
            gx, gcores, ggates, gb = _BACKWARD_CPU(_CPU, *args)
        else:
            gx, gcores, ggates, gb = torch.ops.comera.tt_linear_backward(*args)
    return gx if needs_x else None, list(gcores), list(ggates), gb if has_bias else None


def _setup_context(ctx, inputs, output):
    x, cores, gates, bias, num_in_cores, out_features, path = inputs
    ctx.save_for_backward(x, output[1], *cores, *gates)
    ctx.mark_non_differentiable(output[1])
    ctx.args = (len(cores), bias is not None, num_in_cores, out_features, path)


def _backward(ctx, grad_y, grad_t):
    gx, gcores, ggates, gb = _backward_from(ctx.saved_tensors, ctx.needs_input_grad[0],
                                            *ctx.args, grad_y)
    return gx, gcores, ggates, gb, None, None, None


torch.library.register_autograd("comera::tt_linear", _backward, setup_context=_setup_context)


class TTLinearFunction(torch.autograd.Function):
    """``comera::tt_linear`` as the Python wrapper calls it.  Inputs are flat
    (x, bias, num_in_cores, out_features, path, num_cores, *cores, *gates), so
    autograd walks no list arguments per call; ``setup_context``,
    ``generate_vmap_rule`` and :meth:`jvp` make it work under torch.func
    transforms and forward-mode AD (:mod:`comera.ops.func`)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, bias, num_in_cores, out_features, path, num_cores, *cg):
        args = (x, list(cg[:num_cores]), list(cg[num_cores:]), bias, num_in_cores,
                out_features, path)
        if func_active():  # the transforms' layers must see the operator
            return torch.ops.comera.tt_linear(*args)
        # this Function records the call: the operator's registered autograd
        # would only check and redispatch (a third of a one-row call's time)
        if straight_to_kernel(x, cg[0]):
            return _FORWARD_CPU(_CPU, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.comera.tt_linear.default(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, num_in_cores, out_features, path, num_cores, *cg = inputs
        ctx.save_for_backward(x, output[1], *cg)
        if func_active():  # only a transform or forward-mode AD asks for the jvp
            ctx.save_for_forward(x, *cg)
        ctx.mark_non_differentiable(output[1])
        # grad_t is never used: no zeros made for it
        ctx.set_materialize_grads(False)
        ctx.args = (num_cores, bias is not None, num_in_cores, out_features, path)

    @staticmethod
    def backward(ctx, grad_y, grad_t):
        if grad_y is None:  # no gradient reached y
            return (None,) * len(ctx.needs_input_grad)
        gx, gcores, ggates, gb = _backward_from(ctx.saved_tensors, ctx.needs_input_grad[0],
                                                *ctx.args, grad_y)
        return (gx, gb, None, None, None, None, *gcores, *ggates)

    @staticmethod
    def jvp(ctx, dx, dbias, _a, _b, _c, _d, *dcg):
        # y = f(x, cores, gates) + bias, f linear in x and in each core and gate
        # separately: the tangent is one f call per input that has a tangent (in
        # torch ops when the tangents are a batch of the older vmap, as in
        # gradcheck's batched forward-mode check)
        x, *cg = ctx.saved_tensors
        n, _, num_in_cores, out_features, path = ctx.args
        out = None
        composite = legacy_batched(dx, dbias, *dcg)

        def add(x_, cg_):
            nonlocal out
            if composite:
                y = _composite(x_, list(cg_[:n]), list(cg_[n:]), num_in_cores, out_features)
            else:
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


_apply_linear = eager_apply(TTLinearFunction)


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
# under autocast, a float32 layer runs the 16-bit kernels in autocast's dtype
# and returns it, like F.linear: a 16-bit x with the float32 cores, gates and
# bias as they are, or a float32 x as it is with them cast (small); the
# kernels take both pairs, so no activation is cast.  16-bit cores take x in
# their own dtype; float64 is left alone.  On CUDA the wrapper runs the
# kernels in the autocast dtype (their accumulators are float32), which is
# where the GPU speed comes from.
@torch.library.impl("comera::tt_linear", "AutocastCPU")
def _tt_linear_autocast_cpu(x, cores, gates, bias, num_in_cores, out_features, path):
    want = cores[0].dtype if cores[0].dtype in _HALF else torch.get_autocast_dtype("cpu")
    if want in _HALF and torch.float64 not in (x.dtype, cores[0].dtype):
        if x.dtype == torch.float32 and cores[0].dtype == torch.float32:
            cores = [c.to(want) for c in cores]
            gates = [g.to(want) for g in gates]
            bias = bias.to(want) if bias is not None else None
        elif x.dtype not in (torch.float32, want):
            x = x.to(want)
    with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return torch.ops.comera.tt_linear.default(x, cores, gates, bias, num_in_cores,
                                                  out_features, path)


def _autocast_dtype(x: torch.Tensor, compute: torch.dtype) -> Optional[torch.dtype]:
    """The output dtype autocast wants for a linear op on ``x`` (None when
    autocast is off for x's device, or the layer computes in float64, which
    autocast leaves alone)."""
    dev = x.device.type
    if compute != torch.float32 or dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


class Prepared:
    """What a TT linear layer keeps between calls, per parameter version:
    ``V`` (in_features x r) and ``U`` (r x out_features), merged from the
    cores with the gates folded in, for calls without gradients of at most
    :data:`CACHED_MACS` multiply-adds (one row, a short batch: generation,
    evaluation), which then run ``addmm(bias, x V, U)`` instead of merging or
    contracting the cores again; and the rows of the last call (the default
    of ``TTLinear.plan``).

    The key is every parameter object and its version counter: an in-place
    update (an optimizer step, ``load_state_dict``, ``reset_parameters``, the
    gate step, pruning) or a new Parameter in the layer makes the next call
    merge again, and the layer drops the pair on ``.to()``.  A write through
    ``param.data`` is invisible to the version counter (as it is to
    autograd's own checks), so every call with gradients (a training step is
    coming) drops the pair too; after writing parameters through ``.data``
    outside training, call ``TTLinear.clear_prepared()``.

    Example:
        >>> import torch, comera
        >>> layer = comera.TTLinear(64, 32, rank=4)
        >>> with torch.no_grad():
        ...     y = layer(torch.randn(1, 64))
        >>> layer._prepared.v.shape, layer._prepared.u.shape
        (torch.Size([64, 4]), torch.Size([4, 32]))
    """
    __slots__ = ("key", "params", "v", "u", "rows")

    def __init__(self):
        self.key, self.params, self.v, self.u, self.rows = None, (), None, None, 1

    def clear(self) -> None:
        """Drops the merged pair (the next call without gradients merges again)."""
        self.key = self.v = self.u = None
        self.params = ()

    def __getstate__(self):  # copies and pickles carry no merged pair
        return {"rows": self.rows}

    def __setstate__(self, state):
        self.clear()
        self.rows = state.get("rows", 1)

    def merged(self, cores, gates, bias, num_in_cores, in_features, out_features):
        """``(V, U)`` for these parameters, merged again only when one changed."""
        params = cores + gates if bias is None else cores + gates + [bias]
        key = [p._version for p in params]
        if key != self.key or not all(map(operator.is_, params, self.params)):
            p = num_in_cores
            with torch.no_grad():  # contiguous: the kernels' operands (and rounding)
                dense = [c.contiguous() for c in cores]
                v = merge(dense[:p], gates[:p])
                u = merge(dense[p:], gates[p:]).reshape(v.shape[1], -1)
                self.v = v[:in_features].contiguous()
                self.u = u[:, :out_features].contiguous()
            self.key, self.params = key, params
        return self.v, self.u


CACHED_MACS = 1 << 20
"""Calls without gradients of at most this many multiply-adds in the two
merged products (rows x r x (in + out)) reuse a layer's merged ``V`` and
``U`` (:class:`Prepared`); larger ones are dominated by the products, which
the C kernels run."""


_CACHED_DTYPES = (torch.float32, torch.float64)
_any_autocast = torch._C._is_any_autocast_enabled


def tt_linear_prepared(x: torch.Tensor, cores: List[torch.Tensor], gates: List[torch.Tensor],
                       bias: Optional[torch.Tensor], num_in_cores: int, out_features: int,
                       path: str, prepared: Prepared) -> torch.Tensor:
    """:func:`tt_linear` for a layer that keeps a :class:`Prepared`: a small
    call without gradients reuses its merged ``V`` and ``U``; a call with
    gradients drops them and runs the operator.

    Example:
        >>> import torch, comera
        >>> from comera.ops.linear import Prepared, tt_linear, tt_linear_prepared
        >>> layer, prep = comera.TTLinear(12, 6, rank=3), Prepared()
        >>> x = torch.randn(2, 12)
        >>> args = (list(layer.cores), list(layer.gates), layer.bias, 2, 6)
        >>> with torch.no_grad():
        ...     torch.allclose(tt_linear_prepared(x, *args, "auto", prep), tt_linear(x, *args))
        True
    """
    if torch.compiler.is_compiling():  # the graph holds the operator; no side effects
        return tt_linear(x, cores, gates, bias, num_in_cores, out_features, path)
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    prepared.rows = rows or 1
    if torch.is_grad_enabled():
        prepared.key = None  # a training step is coming
    # the merged pair serves plain float32/float64 calls: no autocast, no transform
    elif (rows and rows * cores[num_in_cores - 1].shape[-1] * (in_features + out_features)
          <= CACHED_MACS and x.dtype == cores[0].dtype and x.dtype in _CACHED_DTYPES
          and type(x) is torch.Tensor and type(cores[0]) is torch.nn.Parameter
          and not _any_autocast() and not func_active()):
        v, u = prepared.merged(cores, gates, bias, num_in_cores, in_features, out_features)
        x2 = x if x.dim() == 2 else x.reshape(rows, in_features)
        y = torch.mm(x2, v)
        y = torch.mm(y, u) if bias is None else torch.addmm(bias, y, u)
        return y if x.dim() == 2 else unview_reshape(y, (*x.shape[:-1], out_features))
    return tt_linear(x, cores, gates, bias, num_in_cores, out_features, path)


def tt_linear(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
              bias: Optional[torch.Tensor], num_in_cores: int, out_features: int,
              path: str = "auto") -> torch.Tensor:
    """Applies a TT linear map to ``x`` of shape ``(*, in_features)``.

    ``cores`` (input cores first) and ``gates`` follow docs/design.md section 2;
    computation happens in the cores' dtype (an ``x`` of another dtype is cast
    to it, and the result returned in ``x``'s dtype).  bfloat16/float16 cores:
    the kernels take them on CUDA and on the CPU (16-bit inputs and outputs,
    float32 accumulation; AMX on CPUs that have it).  Under
    ``torch.autocast("cpu")`` a float32 layer runs the CPU's 16-bit kernels on
    ``x`` in autocast's dtype with its float32 cores, gates and bias as they
    are, and returns autocast's dtype (bfloat16 by default), as ``F.linear``
    does.  Under
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
    if (x.dtype == compute and route._mode == "comera" and not _any_autocast()
            and not torch.compiler.is_compiling()):
        # the usual call, in fewer steps: x in the layer's dtype, no autocast,
        # no routing (a third of a one-row call's time was these checks)
        x2 = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()
        if torch.is_grad_enabled() or func_active():
            y, _ = _apply_linear(x2, bias, num_in_cores, out_features, PATHS[path], len(cores),
                                 *cores, *gates)
        elif straight_to_kernel(x2, cores[0]):  # nothing to record
            y, _ = _FORWARD_CPU(_CPU, x2, list(cores), list(gates), bias, num_in_cores,
                                out_features, PATHS[path])
        else:
            with torch._C._AutoDispatchBelowAutograd():
                y, _ = torch.ops.comera.tt_linear.default(x2, list(cores), list(gates), bias,
                                                          num_in_cores, out_features,
                                                          PATHS[path])
        return y if x.dim() == 2 else unview_reshape(y, (*x.shape[:-1], out_features))
    autocast = x.is_cuda and torch.is_autocast_enabled("cuda") and compute == torch.float32
    if autocast:
        compute = torch.get_autocast_dtype("cuda")
        cores = [c.to(compute) for c in cores]
        gates = [g.to(compute) for g in gates]
        bias = bias.to(compute) if bias is not None else None
    elif (compute == torch.float32 and x.device.type == "cpu" and x.dtype != torch.float64
          and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in _HALF):
        # the CPU's 16-bit kernels take a 16-bit x with the float32 cores, gates and
        # bias, or a float32 x with them cast (small): x itself is never cast to float32
        compute = torch.get_autocast_dtype("cpu")
        autocast = True
        if x.dtype == torch.float32:
            cores = [c.to(compute) for c in cores]
            gates = [g.to(compute) for g in gates]
            bias = bias.to(compute) if bias is not None else None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # under CPU autocast a float32 x goes to the 16-bit kernels as it is (they
    # round it block by block)
    if x2.dtype != compute and not (autocast and x2.dtype == torch.float32 and not x2.is_cuda):
        x2 = x2.to(compute)
    x2, cores, gates, code = x2.contiguous(), list(cores), list(gates), PATHS[path]
    if torch.compiler.is_compiling():  # the compiled graph holds the operator
        y, _ = torch.ops.comera.tt_linear(x2, cores, gates, bias, num_in_cores, out_features, code)
    elif not func_active() and route.use_torch(x2, cores, gates, bias, num_in_cores,
                                               out_features, path):
        y = route.merge_torch(x2, cores, gates, bias, num_in_cores, out_features)
    elif torch.is_grad_enabled() or func_active():
        y, _ = _apply_linear(x2, bias, num_in_cores, out_features, code, len(cores),
                              *cores, *gates)
    else:  # nothing to record
        with torch._C._AutoDispatchBelowAutograd():
            y, _ = torch.ops.comera.tt_linear.default(x2, cores, gates, bias, num_in_cores,
                                                      out_features, code)
    out_dtype = y.dtype if autocast else (_autocast_dtype(x, compute) or x.dtype)
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    return unview_reshape(y, (*lead, out_features))
