"""torch.func support shared by the comera operators.

The operators' autograd is registered with ``torch.library.register_autograd``
(one path for eager calls, the modules, ``torch.compile`` and
``torch.export``).  torch generates an ``autograd.Function`` for it without
``setup_context``, which torch.func transforms (``grad``, ``vjp``,
``jacrev``, per-sample gradients with ``vmap(grad(...))``) refuse, and
without a forward-mode formula.  So under a torch.func transform, or while
forward-mode AD is active, the Python wrappers (:func:`comera.ops.tt_linear`,
:func:`comera.ops.tt_embedding`, hence the modules) call the operators
through an ``autograd.Function`` of their own with ``setup_context``,
``generate_vmap_rule`` and a ``jvp`` (the TT maps are multilinear in the
input, every core and every gate, so a tangent is a sum of forward calls).
Elsewhere nothing changes.

The operators themselves get vmap rules (:func:`register_loop_vmap`):
a batch dim only on the rows is folded into the rows where that is exact
(the forward ops), and everything else is computed one batch entry at a time
and stacked, which is always exact (per-sample core gradients need the
per-sample backward, not the summed one).

torch's older vmap (``torch._vmap_internals``: ``autograd.grad(...,
is_grads_batched=True)``, ``autograd.functional.jacobian(vectorize=True)``,
gradcheck's batched checks) never reaches those rules: its batched tensors
dispatch to the ``Batched`` key, whose per-entry fallback refuses operators
with ``Tensor[]`` arguments.  Under it (:func:`legacy_batched`) the wrappers'
backward and forward-mode tangents are computed in plain torch ops instead,
the same re-expression double backward uses.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.autograd import forward_ad

_peek = torch._C._functorch.peek_interpreter_stack
_is_legacy = torch._C._functorch.is_legacy_batchedtensor
_compiling = torch.compiler.is_compiling


def func_active() -> bool:
    """True under a torch.func transform or with forward-mode AD active (never
    while torch.compile traces: the registered autograd serves it)."""
    return (_peek() is not None or forward_ad._current_level >= 0) and not _compiling()


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_autocast_on = torch._C._is_any_autocast_enabled
_transforms_on = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled
_profiler = torch.autograd.profiler
_tracing = torch._C._get_tracing_state


def straight_to_kernel(first: torch.Tensor, core: torch.Tensor) -> bool:
    """Whether a call without gradients may go straight to an operator's CPU
    kernel (``redispatch_boxed``), past the dispatcher's layers above it,
    which would all pass it on unchanged: CPU tensors, no autocast, no torch.func
    transform, forward-mode AD or functionalization, no Python dispatch or
    function mode, no profiler (it records calls at the top), no
    ``torch.jit.trace``, and plain tensors (a subclass such as DTensor
    dispatches itself).  The caller has
    checked that gradients are off and torch.compile is not tracing.

    Example:
        >>> import torch
        >>> straight_to_kernel(torch.zeros(2), torch.nn.Parameter(torch.ones(2)))
        True
        >>> with torch.autocast("cpu"):
        ...     straight_to_kernel(torch.zeros(2), torch.ones(2))
        False
    """
    return (type(first) is torch.Tensor and type(core) in _PLAIN_TYPES and first.is_cpu
            and core.is_cpu and not _autocast_on()
            and not _transforms_on() and forward_ad._current_level < 0 and not _dispatch_modes()
            and not _function_mode_on() and not _profiler._is_profiler_enabled
            and _tracing() is None)


def eager_apply(cls: type) -> Callable:
    """``cls.apply`` for calls made while no torch.func transform is active:
    ``autograd.Function.apply`` binds the arguments to ``forward``'s
    signature with ``inspect`` on every call of a Function that has
    ``setup_context`` (for default arguments, which comera's Functions do not
    have) and then calls the C ``apply`` below it, which this calls directly.
    Under a transform, ``cls.apply`` itself.

    Example:
        >>> import torch
        >>> class Double(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(x):
        ...         return 2 * x
        ...     @staticmethod
        ...     def setup_context(ctx, inputs, output):
        ...         pass
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return 2 * g
        >>> eager_apply(Double)(torch.ones(2, requires_grad=True)).grad_fn is not None
        True
    """
    below = super(torch.autograd.Function, cls).apply
    transforms_active = torch._C._are_functorch_transforms_active
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead

    def apply(first, *args):
        if transforms_active():
            return cls.apply(first, *args)
        # what Function.apply does to tensors that outlived a transform; the
        # other arguments are a layer's parameters
        return below(unwrap_if_dead(first), *args)
    return apply


def _pick(value, dim: Optional[int], b: int):
    if dim is None or value is None:
        return value
    return value.select(dim, b)


def _unbatch(args: Sequence, in_dims: Sequence, b: int) -> List:
    out = []
    for a, d in zip(args, in_dims):
        if isinstance(a, (list, tuple)):
            dims = d if isinstance(d, (list, tuple)) else [d] * len(a)
            out.append([_pick(t, dd, b) for t, dd in zip(a, dims)])
        else:
            out.append(_pick(a, d, b))
    return out


def _stack(results: List):
    first = results[0]
    if isinstance(first, (list, tuple)):
        parts = [_stack([r[i] for r in results]) for i in range(len(first))]
        stacked = type(first)(p[0] for p in parts) if isinstance(first, tuple) else [p[0] for p in parts]
        dims = tuple(p[1] for p in parts) if isinstance(first, tuple) else [p[1] for p in parts]
        return stacked, dims
    return torch.stack(results), 0


def loop(op: Callable, info, in_dims: Sequence, args: Sequence) -> Tuple[object, object]:
    """Runs ``op`` once per batch entry and stacks the outputs along dim 0."""
    results = [op(*_unbatch(args, in_dims, b)) for b in range(info.batch_size)]
    return _stack(results)


def any_batched(in_dims: Sequence) -> bool:
    for d in in_dims:
        if isinstance(d, (list, tuple)):
            if any(x is not None for x in d):
                return True
        elif d is not None:
            return True
    return False


def register_loop_vmap(name: str, fold: Optional[Callable] = None) -> None:
    """Registers a vmap rule for ``comera::<name>``: ``fold(info, in_dims, *args)``
    may return ``(output, out_dims)`` for the cases it computes exactly in one
    call, or None; otherwise the op runs once per batch entry."""
    op = getattr(torch.ops.comera, name).default

    def rule(info, in_dims, *args):
        if fold is not None:
            out = fold(info, in_dims, *args)
            if out is not None:
                return out
        return loop(op, info, in_dims, args)

    torch.library.register_vmap(f"comera::{name}", rule)


def unview_reshape(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.reshape(shape)`` for a fresh operator output ``t``, returned as a
    tensor of its own rather than a view of ``t`` (as ``nn.Linear``'s output
    is): FSDP2 warns about modules that return views, since an in-place op
    on one would drop its backward hook.

    Example:
        >>> import torch
        >>> unview_reshape(torch.zeros(6, 2), (2, 3, 2))._is_view()
        False
    """
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    return torch.ops.aten._unsafe_view(t, shape)


def legacy_batched(*tensors) -> bool:
    """Whether any of ``tensors`` is a BatchedTensor of torch's older vmap
    (``torch._vmap_internals``), which ``autograd.grad(is_grads_batched=True)``,
    ``autograd.functional.jacobian(vectorize=True)`` and gradcheck's batched
    checks run the backward (or a forward-mode tangent) under.  That vmap
    dispatches to the ``Batched`` key, not to the rules of
    :func:`register_loop_vmap` (functorch's ``torch.vmap``), and its per-entry
    fallback refuses operators with ``Tensor[]`` arguments, as every comera
    operator has; so the wrappers compute such calls in plain torch ops.

    Example:
        >>> import torch
        >>> from torch._vmap_internals import _vmap
        >>> legacy_batched(torch.zeros(2))
        False
        >>> _vmap(lambda v: torch.tensor(legacy_batched(v)))(torch.zeros(3, 2)).tolist()
        [True, True, True]
    """
    return any(t is not None and _is_legacy(t) for t in tensors)


def needs_graph() -> bool:
    """Inside a backward: whether its result must itself be differentiable
    (``create_graph=True``, forward-mode AD, or an outer grad/jvp transform,
    as in ``hessian`` / ``jacrev(jacrev(f))``)."""
    if torch.is_grad_enabled() or forward_ad._current_level >= 0:
        return True
    if _peek() is None:
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    kinds = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
    return any(i.key() in kinds for i in retrieve_all_functorch_interpreters())


def composite_vjp(fn: Callable, primals: Sequence, cotangent: torch.Tensor):
    """The vjp of a plain-torch re-expression ``fn`` of an operator (its
    dense form): differentiable to any order and under any transform."""
    _, vjp_fn = torch.func.vjp(fn, *primals)
    return vjp_fn(cotangent)
