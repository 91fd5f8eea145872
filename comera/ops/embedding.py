"""The comera::tt_embedding operator: fake, autograd, and a convenient wrapper.

Native files: ``csrc/tt_embedding/op.cpp`` (torch glue),
``csrc/tt_embedding/cpu_impl.h`` and ``cpu_bwd_impl.h`` (the CPU kernels'
bodies, compiled once per dtype as ``cpu_f32.c`` and ``cpu_f64.c``),
``plan.c`` (the planner),
``csrc/tt_embedding/cuda.cu`` (the CUDA kernels); the schemas of
``comera::tt_embedding``, ``comera::tt_embedding_backward`` and
``comera::tt_embedding_plan`` are in ``csrc/registration.cpp``.
"""
from typing import List, Optional, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)
from comera.ops.dense import ttm_table
from comera.ops.func import (any_batched, composite_vjp, eager_apply, func_active, legacy_batched, needs_graph,
                             register_loop_vmap, straight_to_kernel, unview_reshape)

_HALF = (torch.bfloat16, torch.float16)
# The CPU kernels themselves, for calls that nothing above them would change
# (straight_to_kernel): the guard that skips autograd, or the packet's
# dispatch, costs a few-token lookup about a microsecond.
_LOOKUP_CPU = torch.ops.comera.tt_embedding.default._handle.redispatch_boxed
_BACKWARD_CPU = torch.ops.comera.tt_embedding_backward.default._handle.redispatch_boxed
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_compiling = torch.compiler.is_compiling

MODES = {None: 0, "sum": 1, "mean": 2}
REUSE = {"auto": 0, "none": 1, "dedup": 2, "prefix": 3}
REUSE_NAMES = {v: k for k, v in REUSE.items()}


@torch.library.register_fake("comera::tt_embedding")
def _tt_embedding_fake(indices, offsets, per_sample_weights, cores, gates, num_embeddings,
                       embedding_dim, padding_idx, mode, reuse):
    rows = indices.shape[0] if mode == 0 else offsets.shape[0] - 1
    return cores[0].new_empty(rows, embedding_dim)


@torch.library.register_fake("comera::tt_embedding_backward")
def _tt_embedding_backward_fake(grad_out, indices, offsets, per_sample_weights, cores, gates,
                                num_embeddings, embedding_dim, padding_idx, mode, reuse):
    return [torch.empty_like(c) for c in cores], [torch.empty_like(g) for g in gates]


def _setup_context(ctx, inputs, output):
    (indices, offsets, psw, cores, gates, num_embeddings, embedding_dim, padding_idx, mode,
     reuse) = inputs
    ctx.save_for_backward(indices, offsets, psw, *cores, *gates)
    ctx.num_cores = len(cores)
    ctx.args = (num_embeddings, embedding_dim, padding_idx, mode, reuse)


def _psw_grad(indices, offsets, cores, gates, grad, args):
    """d(out[bag]) / d(w_p) = row(indices[p]) for the bag holding position p."""
    num_embeddings, embedding_dim, padding_idx, _, reuse = args
    n = indices.shape[0]
    if grad.shape[0] == 0 or n == 0:
        return grad.new_zeros(n)
    rows = torch.ops.comera.tt_embedding(indices, None, None, cores, gates, num_embeddings,
                                         embedding_dim, padding_idx, 0, reuse)
    pos = torch.arange(n, device=indices.device, dtype=offsets.dtype)
    # offsets end at n, so every position lies in a bag; clamp keeps the
    # gather in range for positions past the last (non-empty) bag start
    bag = (torch.searchsorted(offsets, pos, right=True) - 1).clamp(0, grad.shape[0] - 1)
    return (rows * grad[bag]).sum(-1)


def dense_lookup(indices, offsets, psw, cores, gates, num_embeddings, embedding_dim,
                 padding_idx, mode, reuse=0):
    """What ``comera::tt_embedding`` computes, in plain torch ops on the
    reconstructed table (differentiable to any order)."""
    table = ttm_table(list(cores), list(gates), num_embeddings, embedding_dim)
    if padding_idx >= 0:
        keep = torch.ones(num_embeddings, 1, dtype=table.dtype, device=table.device)
        keep[padding_idx] = 0
        table = table * keep
    # index_select, not F.embedding, whose double backward fails on zero indices
    rows = table.index_select(0, indices.reshape(-1)).reshape(*indices.shape, table.shape[-1])
    if mode == 0:
        return rows
    # bags as a segment sum (F.embedding_bag has no double backward)
    n, bags = indices.shape[0], offsets.shape[0] - 1
    pos = torch.arange(n, device=indices.device)
    bag = (torch.searchsorted(offsets.to(torch.int64), pos, right=True) - 1).clamp(0, max(bags - 1, 0))
    if psw is not None:
        rows = rows * psw.unsqueeze(-1).to(rows.dtype)
    out = rows.new_zeros(bags, rows.shape[-1]).index_add(0, bag, rows)
    if mode == 2:
        live = (indices != padding_idx).to(rows.dtype) if padding_idx >= 0 else rows.new_ones(n)
        count = rows.new_zeros(bags).index_add(0, bag, live).clamp(min=1)
        out = out / count.unsqueeze(-1)
    return out


def _graph_backward(grad, indices, offsets, psw, cores, gates, args, psw_grad):
    """Gradients that are themselves differentiable (double backward,
    hessians), from the dense table (``num_embeddings * embedding_dim``
    memory, like nn.Embedding)."""
    if psw is None:
        def f(cores_, gates_):
            return dense_lookup(indices, offsets, None, cores_, gates_, *args)

        gcores, ggates = composite_vjp(f, (list(cores), list(gates)), grad)
        return list(gcores), list(ggates), None

    def fw(cores_, gates_, psw_):
        return dense_lookup(indices, offsets, psw_, cores_, gates_, *args)

    gcores, ggates, gpsw = composite_vjp(fw, (list(cores), list(gates), psw), grad)
    return list(gcores), list(ggates), gpsw if psw_grad else None


# One backward, two doors to it, as for tt_linear (comera/ops/linear.py): the
# operator's registered autograd and TTEmbeddingFunction.
def _backward_from(saved, num_cores, args, psw_grad, grad):
    """(dcores, dgates, dper_sample_weights) from the saved tensors: by the
    backward op, or from the dense table when the gradients must be
    differentiable or ``grad`` is a batch of the older vmap
    (:func:`comera.ops.func.legacy_batched`)."""
    indices, offsets, psw, *cg = saved
    cores, gates = cg[:num_cores], cg[num_cores:]
    if needs_graph() or legacy_batched(grad):
        return _graph_backward(grad, indices, offsets, psw, cores, gates, args, psw_grad)
    grad = grad.contiguous()
    if straight_to_kernel(indices, cores[0]):
        gcores, ggates = _BACKWARD_CPU(_CPU, grad, indices, offsets, psw, cores, gates, *args)
    else:
        gcores, ggates = torch.ops.comera.tt_embedding_backward(
            grad, indices, offsets, psw, cores, gates, *args)
    gpsw = _psw_grad(indices, offsets, cores, gates, grad, args) if psw_grad else None
    return list(gcores), list(ggates), gpsw


def _backward(ctx, grad):
    gcores, ggates, gpsw = _backward_from(ctx.saved_tensors, ctx.num_cores, ctx.args,
                                          ctx.needs_input_grad[2], grad)
    return (None, None, gpsw, gcores, ggates, None, None, None, None, None)


torch.library.register_autograd("comera::tt_embedding", _backward, setup_context=_setup_context)


class TTEmbeddingFunction(torch.autograd.Function):
    """``comera::tt_embedding`` as the Python wrapper calls it (see
    comera.ops.linear.TTLinearFunction).  Inputs are flat: indices, offsets,
    per_sample_weights, args (num_embeddings, embedding_dim, padding_idx,
    mode, reuse), num_cores, *cores, *gates."""
    generate_vmap_rule = True

    @staticmethod
    def forward(indices, offsets, psw, args, num_cores, *cg):
        call = (indices, offsets, psw, list(cg[:num_cores]), list(cg[num_cores:]), *args)
        if func_active():  # the transforms' layers must see the operator
            return torch.ops.comera.tt_embedding(*call)
        if straight_to_kernel(indices, cg[0]):
            return _LOOKUP_CPU(_CPU, *call)
        with torch._C._AutoDispatchBelowAutograd():  # this Function records the call
            return torch.ops.comera.tt_embedding.default(*call)

    @staticmethod
    def setup_context(ctx, inputs, output):
        indices, offsets, psw, args, num_cores, *cg = inputs
        ctx.save_for_backward(indices, offsets, psw, *cg)
        ctx.save_for_forward(indices, offsets, psw, *cg)
        ctx.num_cores, ctx.args = num_cores, args

    @staticmethod
    def backward(ctx, grad):
        gcores, ggates, gpsw = _backward_from(ctx.saved_tensors, ctx.num_cores, ctx.args,
                                              ctx.needs_input_grad[2], grad)
        return (None, None, gpsw, None, None, *gcores, *ggates)

    @staticmethod
    def jvp(ctx, _i, _o, dpsw, _a, _n, *dcg):
        # multilinear in per_sample_weights and in each core and gate; tangents
        # that are a batch of the older vmap go through the dense table
        indices, offsets, psw, *cg = ctx.saved_tensors
        n = ctx.num_cores
        lookup = dense_lookup if legacy_batched(dpsw, *dcg) else torch.ops.comera.tt_embedding
        out = None
        for k, d in enumerate(dcg):
            if d is not None:
                c = cg[:k] + [d] + cg[k + 1:]
                y = lookup(indices, offsets, psw, c[:n], c[n:], *ctx.args)
                out = y if out is None else out + y
        if dpsw is not None:
            y = lookup(indices, offsets, dpsw.contiguous(), cg[:n], cg[n:], *ctx.args)
            out = y if out is None else out + y
        if out is None:
            rows = indices.shape[0] if ctx.args[3] == 0 else offsets.shape[0] - 1
            out = cg[0].new_zeros(rows, ctx.args[1])
        return out


_apply_embedding = eager_apply(TTEmbeddingFunction)


# The overload's own callable: OpOverload.__call__ is this call behind a
# Python frame, which costs about a tenth of a few-token lookup.
_LOOKUP = torch.ops.comera.tt_embedding.default._op


def _run(indices, offsets, psw, cores: List[torch.Tensor], gates: List[torch.Tensor], *args):
    grad = torch.is_grad_enabled()
    if not grad and not _compiling() and straight_to_kernel(indices, cores[0]):
        return _LOOKUP_CPU(_CPU, indices, offsets, psw, cores, gates, *args)
    if _compiling():  # the compiled graph holds the operator
        return torch.ops.comera.tt_embedding(indices, offsets, psw, cores, gates, *args)
    if grad or func_active():
        return _apply_embedding(indices, offsets, psw, args, len(cores), *cores, *gates)
    # nothing to record: below autograd, whose Python kernel would cost more
    # than a few-token lookup only to find that
    with torch._C._AutoDispatchBelowAutograd():
        return _LOOKUP(indices, offsets, psw, cores, gates, *args)


def _fold_forward(info, in_dims, indices, offsets, psw, cores, gates, *args):
    """Plain lookups with only the indices batched: one call on all of them."""
    if args[3] != 0 or any_batched(in_dims[1:]):
        return None
    idx = indices.movedim(in_dims[0], 0)
    out = torch.ops.comera.tt_embedding(idx.reshape(-1), offsets, psw, cores, gates, *args)
    return out.reshape(info.batch_size, idx.shape[1], -1), 0


register_loop_vmap("tt_embedding", _fold_forward)
register_loop_vmap("tt_embedding_backward")


def _check_indices(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {t.dtype}")
    return t


def _bad_offsets(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Per entry of CSR bag offsets: is it the one the C check reports?"""
    o = offsets.to(torch.int64)
    bad = o > n
    bad[:1] |= o[:1] != 0
    bad[1:] |= o[1:] < o[:-1]
    bad[-1:] |= o[-1:] != n
    return bad


def check_indices_on_device(indices: torch.Tensor, offsets: Optional[torch.Tensor],
                            num_embeddings: int) -> None:
    """Raises IndexError / ValueError for indices out of ``[0, num_embeddings)``
    or bad bag offsets (CSR: ``num_bags + 1`` entries, starting at 0, never
    decreasing, ending at ``len(indices)``), with the messages of the CPU op.

    The CUDA kernels never read index values on the host (so they can be
    captured in a CUDA graph) and turn a bad index into a NaN row; this check
    costs one host synchronisation, and :func:`tt_embedding` runs it for
    device tensors unless ``capturable=True``.  It works on any device.

    Example:
        >>> import torch
        >>> from comera.ops.embedding import check_indices_on_device
        >>> check_indices_on_device(torch.tensor([0, 4]), torch.tensor([0, 1, 2]), 5)
        >>> check_indices_on_device(torch.tensor([0, 5]), None, 5)
        Traceback (most recent call last):
        ...
        IndexError: index 5 at position 1 is out of range for num_embeddings=5 (expected 0 <= index < 5)
    """
    n = indices.numel()
    flat = indices.reshape(-1)
    if offsets is None:
        bad_off = flat.new_zeros(0, dtype=torch.bool)
    else:
        bad_off = _bad_offsets(offsets, n)
    bad_idx = (flat < 0) | (flat >= num_embeddings)
    # one synchronisation for both checks
    flags = torch.stack([bad_idx.any(), bad_off.any()]).tolist()
    if flags[0]:
        p = int(bad_idx.nonzero()[0, 0])
        raise IndexError(f"index {int(flat[p])} at position {p} is out of range for "
                         f"num_embeddings={num_embeddings} (expected 0 <= index < "
                         f"{num_embeddings})")
    if flags[1]:
        o = offsets.to(torch.int64).cpu()
        k = int(_bad_offsets(o, n).nonzero()[0, 0])
        raise ValueError(f"offsets[{k}] = {int(o[k])} is invalid: offsets must start at 0, "
                         f"never decrease, and the last one must equal the number of indices "
                         f"({n})")


def _out(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out if out.dtype == dtype else out.to(dtype)


def _check_on_device(capturable, input, offsets, num_embeddings):
    if capturable or input.device.type in ("cpu", "meta"):
        return  # the CPU op checks on its own; capturable: no host sync; meta: no values
    if torch.compiler.is_compiling():
        return  # a data-dependent branch would break the graph
    check_indices_on_device(input, offsets, num_embeddings)


def tt_embedding(input: torch.Tensor, cores: Sequence[torch.Tensor],
                 gates: Sequence[torch.Tensor], num_embeddings: int, embedding_dim: int, *,
                 offsets: Optional[torch.Tensor] = None,
                 per_sample_weights: Optional[torch.Tensor] = None,
                 padding_idx: Optional[int] = None, mode: Optional[str] = None,
                 include_last_offset: bool = False, reuse: str = "auto",
                 capturable: bool = False) -> torch.Tensor:
    """Looks up rows of a TTM-format embedding table (docs/design.md section 3).

    Plain mode (``mode=None``): ``input`` of any shape, output
    ``(*input.shape, embedding_dim)``.  Bag modes (``"sum"``, ``"mean"``):
    ``input`` 1-D with ``offsets`` (one start per bag; with
    ``include_last_offset`` one more entry, equal to ``len(input)``) or 2-D
    (one bag per row), output ``(num_bags, embedding_dim)``, like
    :func:`torch.nn.functional.embedding_bag`.  ``reuse`` picks the lookup
    strategy: ``"auto"`` (planner), ``"none"`` (every index on its own),
    ``"dedup"`` (each distinct row once), ``"prefix"`` (dedup and shared
    prefixes of the contraction reused).

    On CUDA the kernels use buffers sized by the number of indices (never by
    the number of distinct rows) and never wait for the device; the indices
    and offsets are checked first with one host synchronisation, unless
    ``capturable=True``: then nothing synchronises (the call can be captured
    in a CUDA graph) and an index out of range reads as a NaN row.  On the
    CPU ``capturable`` changes nothing: the C kernels always check.

    bfloat16/float16 cores: on the CPU the lookup runs on float32 copies and
    the rows are returned in the cores' dtype.  torch.func transforms and
    forward-mode AD are supported (see :mod:`comera.ops.func`).

    Example:
        >>> import torch, comera
        >>> emb = comera.TTEmbedding(100, 12, rank=4)
        >>> out = comera.ops.tt_embedding(torch.tensor([[1, 2], [3, 1]]), list(emb.cores),
        ...                               list(emb.gates), 100, 12)
        >>> out.shape
        torch.Size([2, 2, 12])
    """
    _check_indices("input", input)
    if mode not in MODES:
        raise ValueError(f"mode must be None, 'sum' or 'mean', got {mode!r}")
    if reuse not in REUSE:
        raise ValueError(f"reuse must be one of {sorted(REUSE)}, got {reuse!r}")
    pad = -1 if padding_idx is None else padding_idx
    cores, gates = list(cores), list(gates)
    dtype = cores[0].dtype
    if dtype in _HALF and not input.is_cuda:
        # the CPU kernels take float32/float64 only: float32 math, cores' dtype out
        cores = [c.float() for c in cores]
        gates = [g.float() for g in gates]
    if mode is None:
        if offsets is not None or per_sample_weights is not None:
            raise ValueError("offsets and per_sample_weights are only valid in bag modes "
                             "(mode='sum' or 'mean')")
        _check_on_device(capturable, input, None, num_embeddings)
        out = _run(input.reshape(-1), None, None, cores, gates, num_embeddings, embedding_dim,
                    pad, 0, REUSE[reuse])
        return unview_reshape(_out(out, dtype), (*input.shape, embedding_dim))
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (one bag per row), "
                             f"got offsets of shape {tuple(offsets.shape)}")
        bags, length = input.shape
        offsets = torch.arange(0, bags * length + 1, max(length, 1), device=input.device)
        if length == 0:
            offsets = torch.zeros(bags + 1, dtype=torch.int64, device=input.device)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        input = input.reshape(-1)
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets is required when input is 1-D in bag modes")
        _check_indices("offsets", offsets)
        if offsets.dim() != 1:
            raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
        offsets = offsets.to(torch.int64)
        if not include_last_offset:
            offsets = torch.cat([offsets, offsets.new_full((1,), input.shape[0])])
        elif offsets.shape[0] == 0:
            raise ValueError("offsets must have at least one entry with include_last_offset=True")
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D in bag modes, got "
                         f"{input.dim()}-D")
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError("per_sample_weights are only supported with mode='sum', "
                             f"got mode={mode!r}")
        if per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have the shape of input "
                             f"{tuple(input.shape)}, got {tuple(per_sample_weights.shape)}")
        per_sample_weights = per_sample_weights.to(cores[0].dtype)
    _check_on_device(capturable, input, offsets, num_embeddings)
    out = _run(input, offsets, per_sample_weights, cores, gates, num_embeddings, embedding_dim,
                pad, MODES[mode], REUSE[reuse])
    return _out(out, dtype)


def tt_embedding_rows(input: torch.Tensor, cores: List[torch.Tensor],
                      gates: List[torch.Tensor], num_embeddings: int, embedding_dim: int,
                      padding_idx: Optional[int] = None, reuse: str = "auto",
                      capturable: bool = False) -> torch.Tensor:
    """:func:`tt_embedding` in plain mode for a caller that has checked its
    own arguments once (``TTEmbedding``): ``input`` an int64/int32 tensor.
    The same result in fewer steps when ``input`` and the cores are on the
    CPU: a one-token lookup is mostly per-call overhead.

    Example:
        >>> import torch, comera
        >>> from comera.ops.embedding import tt_embedding_rows
        >>> emb = comera.TTEmbedding(100, 12, rank=4)
        >>> idx = torch.tensor([[1, 2], [3, 1]])
        >>> args = (list(emb.cores), list(emb.gates), 100, 12)
        >>> torch.equal(tt_embedding_rows(idx, *args), comera.ops.tt_embedding(idx, *args))
        True
    """
    core = cores[0]
    if core.dtype in _HALF or not (input.is_cpu and core.is_cpu):  # casts, device checks
        return tt_embedding(input, cores, gates, num_embeddings, embedding_dim,
                            padding_idx=padding_idx, reuse=reuse, capturable=capturable)
    flat = input if input.dim() == 1 else input.reshape(-1)
    out = _run(flat, None, None, cores, gates, num_embeddings, embedding_dim,
               -1 if padding_idx is None else padding_idx, 0, REUSE[reuse])
    return out if input.dim() == 1 else unview_reshape(out, (*input.shape, embedding_dim))


def tt_embedding_plan(input: torch.Tensor, row_shape: Sequence[int], dim_shape: Sequence[int],
                      ranks: Sequence[int], num_embeddings: int, embedding_dim: int,
                      padding_idx: Optional[int] = None) -> dict:
    """The C planner's view of one batch of plain lookups: distinct rows,
    distinct prefixes per level, and modelled flops/seconds per strategy.

    Example:
        >>> import torch
        >>> from comera.ops import tt_embedding_plan
        >>> p = tt_embedding_plan(torch.tensor([5, 5, 6, 70]), [10, 10], [4, 4], [1, 3, 1], 100, 16)
        >>> p["unique"], p["prefixes"]
        (3, [2, 3])
    """
    _check_indices("input", input)
    try:
        v = torch.ops.comera.tt_embedding_plan(
            input.reshape(-1), None, list(row_shape), list(dim_shape), list(ranks),
            num_embeddings, embedding_dim, -1 if padding_idx is None else padding_idx, 0).tolist()
    except ValueError as err:
        # the native planner reports overflowing sizes as ValueError; name the arguments
        raise ValueError(f"tt_embedding_plan: row_shape {list(row_shape)}, dim_shape "
                         f"{list(dim_shape)} and ranks {list(ranks)} give sizes that overflow "
                         f"int64 ({str(err).splitlines()[0]})") from None
    names = ("none", "dedup", "prefix")
    return {
        "reuse": REUSE_NAMES[int(v[0])],
        "rows": int(v[1]),
        "unique": int(v[2]),
        "flops": {n: v[3 + i] for i, n in enumerate(names)},
        "seconds": {n: v[6 + i] for i, n in enumerate(names)},
        "prefixes": [int(x) for x in v[9:]],
    }
