"""``resize_token_embeddings`` for transformers models whose word embedding
is a :class:`comera.TTEmbedding` (docs/design.md section 3, docs/huggingface.md).

The table grows or shrinks through :meth:`TTEmbedding.resize_rows_`: every
kept row keeps its value bit for bit (the same core slices); new rows that
fall in the padding of the TT's row space read what the cores already give
there, and each added slice of the leading core is set here:

* ``mean_resizing=True`` (transformers' default): the least-squares fit of
  its new rows to the mean of the old rows, transformers' target for added
  tokens (it draws them around that mean with a 1e-9-scaled covariance);
* ``mean_resizing=False``: random entries with the mean square of the
  existing slices, so the new rows have the scale of the old ones.

A head tied to the embedding (:class:`comera.layers.tied.TiedTTLinear`)
follows it; its bias is resized in place (the same Parameter, so BERT's
``cls.predictions.bias`` stays the decoder's), new entries the old mean
(``mean_resizing``) or zero, as transformers does.  An untied dense head is
resized by transformers' own ``_get_resized_lm_head``; an untied TTLinear
head is refused, since a TT weight's output rows cannot grow with the kept
rows exact.  The hook is an instance attribute that ``convert`` sets on a
transformers model (``to_dense`` removes it).
"""
import math
from typing import List, Optional

import torch
from torch import nn

from comera.layers.base import replace_data
from comera.ops.dense import merge
from comera.layers.embedding import TTEmbedding
from comera.layers.linear import TTLinear
from comera.layers.tied import TiedTTLinear


def _pad_to(new_num_tokens: Optional[int], pad_to_multiple_of, current: int) -> Optional[int]:
    if pad_to_multiple_of is None:
        return new_num_tokens
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int):
        raise ValueError(f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, "
                         "which is not and integer. Please make sure to pass an integer")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    n = current if new_num_tokens is None else new_num_tokens
    return -(-n // pad_to_multiple_of) * pad_to_multiple_of


@torch.no_grad()
def _rest(emb: TTEmbedding) -> torch.Tensor:
    """``R[r, j, a]``: the product of cores 1.. (with their gates, and gate 0
    on the first index) for every row index ``j`` of the trailing row modes
    and every trailing dim index ``a``, in float64 on the CPU (the fits below
    solve there).  Row ``(i, j)`` of the
    table is ``sum_r cores[0][0, i, a0, r] * R[r, j, a]``."""
    cores = [c.detach().to("cpu", torch.float64) for c in emb.cores]
    gates = [g.detach().to("cpu", torch.float64) for g in emb.gates]
    t = cores[1] * gates[0].view(-1, 1, 1, 1)
    for core, gate in zip(cores[2:], gates[1:]):
        a, v, e, r = t.shape
        t = torch.einsum("avem,m,mwfn->avwefn", t, gate, core)
        t = t.reshape(a, v * core.shape[1], e * core.shape[2], core.shape[3])
    return t[..., 0]


@torch.no_grad()
def _fit_added_slices(emb: TTEmbedding, added: List[int], old_rows: int, mean_resizing: bool) -> None:
    """Sets the added slices of core 0 (all zero so far)."""
    core = emb.cores[0]
    if not added or core.device.type == "meta":
        return
    if not mean_resizing:
        kept = core.detach()[:, :added[0]].to(torch.float64)
        std = float(kept.pow(2).mean().sqrt()) if kept.numel() else 0.0
        fresh = torch.randn(core.shape[0], len(added), *core.shape[2:], dtype=torch.float64) * std
        core.data[:, added[0]:added[-1] + 1] = fresh.to(device=core.device, dtype=core.dtype)
        return
    mean = emb.weight.detach()[:old_rows].to("cpu", torch.float64).mean(0)
    R = _rest(emb)                                   # (r, rows per slice, trailing dims)
    per_slice, tail = R.shape[1], R.shape[2]
    e0 = core.shape[2]
    for i in added:
        rows = min(per_slice, emb.num_embeddings - i * per_slice)
        if rows <= 0:
            continue
        for a0 in range(e0):
            cols = min(tail, emb.embedding_dim - a0 * tail)
            if cols <= 0:
                continue
            A = R[:, :rows, :cols].reshape(R.shape[0], -1)          # (r, rows * cols)
            target = mean[a0 * tail:a0 * tail + cols].repeat(rows)  # each row the mean
            x = torch.linalg.lstsq(A.T, target.unsqueeze(1), driver="gelsd").solution[:, 0]
            core.data[0, i, a0] = x.to(device=core.device, dtype=core.dtype)


@torch.no_grad()
def resize_out_rows_(layer: TTLinear, out_features: int) -> List[int]:
    """Gives a TTLinear ``out_features`` outputs, every kept row of its weight
    bit-exact: the output index is row-major over ``out_shape``, so the first
    output core's mode is the most significant digit and grows or shrinks by
    whole slices (zero until the caller sets them).  Returns the indices of
    the added slices of that core; the caller resizes the bias."""
    p = layer.num_in_cores
    core = layer.cores[p]
    old = layer.out_shape[0]
    new = -(-out_features // math.prod(layer.out_shape[1:]))
    if new != old:
        added = torch.zeros(core.shape[0], max(new - old, 0), core.shape[2],
                            dtype=core.dtype, device=core.device)
        replace_data(core, torch.cat([core.detach()[:, :min(old, new)], added], dim=1))
        core.grad = None
        layer.out_shape[0] = new
    layer.out_features = out_features
    return list(range(old, new))


@torch.no_grad()
def _fit_added_out_slices(layer: TTLinear, added: List[int], old_rows: int, mean_resizing: bool) -> None:
    """Sets the added slices of the first output core: ``W^T[i, (k, j)] =
    L[i] X_k g R[:, j]``, so the minimum-norm least-squares ``X_k`` that
    makes every new row the old rows' mean is ``pinv(L) T pinv(R_J) / g``."""
    p = layer.num_in_cores
    core = layer.cores[p]
    if not added or core.device.type == "meta":
        return
    if not mean_resizing:
        kept = core.detach()[:, :added[0]].to(torch.float64)
        std = float(kept.pow(2).mean().sqrt()) if kept.numel() else 0.0
        fresh = torch.randn(core.shape[0], len(added), core.shape[2], dtype=torch.float64) * std
        core.data[:, added[0]:added[-1] + 1] = fresh.to(device=core.device, dtype=core.dtype)
        return
    cores = [c.detach().to("cpu", torch.float64) for c in layer.cores]
    gates = [g.detach().to("cpu", torch.float64) for g in layer.gates]
    L = merge(cores[:p], gates[:p])[:layer.in_features]                     # (in, r_left)
    if p + 1 < len(cores):
        R = merge(cores[p + 1:], gates[p + 1:]).reshape(core.shape[2], -1)  # (r_right, rest)
    else:
        R = torch.ones(1, 1, dtype=torch.float64)
    g = gates[p] if p < len(gates) else torch.ones(core.shape[2], dtype=torch.float64)
    mean = layer.weight.detach()[:old_rows].to("cpu", torch.float64).mean(0)  # over output rows
    Lp = torch.linalg.pinv(L)
    for k in added:
        rows = min(R.shape[1], layer.out_features - k * R.shape[1])
        if rows <= 0:
            continue
        target = mean.unsqueeze(1).expand(-1, rows)                          # (in, rows)
        x = Lp @ target @ torch.linalg.pinv(R[:, :rows])
        x = torch.where(g != 0, x / torch.where(g != 0, g, torch.ones_like(g)), torch.zeros_like(x))
        core.data[:, k] = x.to(device=core.device, dtype=core.dtype)


@torch.no_grad()
def _resize_bias(bias: Optional[nn.Parameter], n: int, mean_resizing: bool) -> None:
    if bias is None or bias.shape[0] == n:
        return
    old = bias.detach()
    fill = old.float().mean().to(old.dtype) if mean_resizing and old.numel() else 0
    new = torch.full((n,), fill, dtype=old.dtype, device=old.device) if n > old.shape[0] \
        else old[:n].clone()
    new[:min(n, old.shape[0])] = old[:min(n, old.shape[0])]
    replace_data(bias, new)
    bias.grad = None


class ResizeTokenEmbeddings:
    """``model.resize_token_embeddings`` of a converted transformers model
    (the class's own when the word embedding is dense).  Holds the model,
    so that ``copy.deepcopy`` and pickling carry it to the copy."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, new_num_tokens: Optional[int] = None, pad_to_multiple_of: Optional[int] = None,
                 mean_resizing: bool = True) -> nn.Module:
        model = self.model
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        if not isinstance(emb, TTEmbedding) and not isinstance(head, (TTLinear, TiedTTLinear)):
            return type(model).resize_token_embeddings(model, new_num_tokens, pad_to_multiple_of,
                                                       mean_resizing)
        n = _pad_to(new_num_tokens, pad_to_multiple_of, emb.weight.shape[0])
        if n is None:
            return emb
        tied = isinstance(head, TiedTTLinear) and head.embedding is emb
        if isinstance(head, TiedTTLinear) and not tied:
            raise ValueError("resize_token_embeddings: the output layer is tied to another "
                             "embedding than the input one")
        if isinstance(emb, TTEmbedding):
            old_rows = emb.num_embeddings
            if n != old_rows:
                added = emb.resize_rows_(n)
                _fit_added_slices(emb, added, old_rows, mean_resizing)
        elif emb.weight.shape[0] != n:               # a dense embedding, a TT head
            requires_grad = emb.weight.requires_grad
            emb = model._get_resized_embeddings(emb, n, mean_resizing=mean_resizing)
            emb.requires_grad_(requires_grad)
            model.set_input_embeddings(emb)
        if tied:
            _resize_bias(head.bias, n, mean_resizing)
        elif isinstance(head, TTLinear):
            if head.out_features != n:
                old_out = head.out_features
                added = resize_out_rows_(head, n)
                _fit_added_out_slices(head, added, old_out, mean_resizing)
                _resize_bias(head.bias, n, mean_resizing)
                model.set_output_embeddings(head)    # the model re-links its own bias attribute
        elif head is not None and getattr(head, "weight", None) is not None \
                and head.weight.shape[0] != n:
            requires_grad = head.weight.requires_grad
            new_head = model._get_resized_lm_head(head, n, mean_resizing=mean_resizing)
            new_head.requires_grad_(requires_grad)
            model.set_output_embeddings(new_head)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        text.vocab_size = n
        model.vocab_size = n
        return emb


def install_resize_hook(model: nn.Module) -> None:
    if callable(getattr(type(model), "resize_token_embeddings", None)) \
            and not isinstance(model.__dict__.get("resize_token_embeddings"), ResizeTokenEmbeddings):
        model.resize_token_embeddings = ResizeTokenEmbeddings(model)


def remove_resize_hook(model: nn.Module) -> None:
    if isinstance(model.__dict__.get("resize_token_embeddings"), ResizeTokenEmbeddings):
        del model.__dict__["resize_token_embeddings"]

