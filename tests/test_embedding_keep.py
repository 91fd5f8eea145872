"""The CPU training path of TTEmbedding: the forward keeps its sorted rows
(comera::_tt_embedding_keep) and the backward takes them back (kept_rows)
instead of sorting the indices again (csrc/tt_embedding/keep.c)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import comera

REUSES = ["none", "dedup", "prefix", "auto"]


class _OpLog(TorchDispatchMode):
    """Records each op call's name and argument count."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.name(), len(args)))
        return func(*args, **(kwargs or {}))


def _make(dtype, mode=None, padding_idx=None):
    torch.manual_seed(0)
    emb = comera.TTEmbedding(500, 24, rank=5, dtype=dtype, mode=mode, padding_idx=padding_idx)
    with torch.no_grad():
        for g in emb.gates:
            g.uniform_(0.5, 1.5)
    return emb


def _args(emb, idx, offsets=None, psw=None):
    mode = {None: 0, "sum": 1, "mean": 2}[emb.mode]
    pad = -1 if emb.padding_idx is None else emb.padding_idx
    reuse = {"auto": 0, "none": 1, "dedup": 2, "prefix": 3}[emb.reuse]
    return (idx, offsets, psw, [c.detach() for c in emb.cores], [g.detach() for g in emb.gates],
            emb.num_embeddings, emb.embedding_dim, pad, mode, reuse)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode, padding_idx", [(None, None), (None, 3), ("sum", None),
                                               ("mean", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reuse", REUSES)
def test_training_step_keeps_rows_and_gives_the_same_gradients(reuse, dtype, mode, padding_idx,
                                                                threads):
    emb = _make(dtype, mode, padding_idx)
    emb.reuse = reuse
    idx = torch.randint(0, 500, (3000,))
    idx[::5] = 3  # repeats, and padding where padding_idx is 3
    offsets = torch.tensor([0, 7, 7, 1500]) if mode else None
    grad = torch.randn(3000 if mode is None else 4, 24, dtype=dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _OpLog() as log:
            emb(idx, offsets).backward(grad)
        # the plain pair of ops: sorts again in the backward
        args = _args(emb, idx, None if mode is None else torch.cat([offsets, torch.tensor([3000])]))
        out = torch.ops.comera.tt_embedding(*args)
        gcores, ggates = torch.ops.comera.tt_embedding_backward(grad, *args)
    finally:
        torch.set_num_threads(prev)
    names = dict(log.calls)
    assert "comera::_tt_embedding_keep" in names
    assert names["comera::tt_embedding_backward"] == 12  # with kept_rows
    torch.testing.assert_close(emb(idx, offsets).detach(), out, rtol=0, atol=0)
    for p, g in zip([*emb.cores, *emb.gates], [*gcores, *ggates]):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)  # the same bits


def test_opcheck_of_the_training_pair():
    emb = _make(torch.float32, mode="sum", padding_idx=2)
    idx = torch.tensor([4, 4, 0, 22, 2, 4])
    offsets = torch.tensor([0, 2, 2, 6])
    psw = torch.randn(6)
    args = _args(emb, idx, offsets, psw)
    torch.library.opcheck(torch.ops.comera._tt_embedding_keep.default, args)
    out, kept = torch.ops.comera._tt_embedding_keep(*args)
    assert kept.dtype == torch.int64 and kept.dim() == 1
    torch.library.opcheck(torch.ops.comera.tt_embedding_backward.default,
                          (torch.randn_like(out), *args, kept))


def test_kept_rows_of_another_call_are_refused():
    emb = _make(torch.float64)
    args = _args(emb, torch.tensor([1, 5, 5, 9]))
    out, kept = torch.ops.comera._tt_embedding_keep(*args)
    grad = torch.randn_like(out)
    other = _args(emb, torch.tensor([1, 5, 6, 9]))
    with pytest.raises(ValueError, match="kept rows or states are not this call's|not this call"):
        torch.ops.comera.tt_embedding_backward(grad, *other, kept)
    shorter = _args(emb, torch.tensor([1, 5, 5]))
    with pytest.raises(ValueError, match="not this call"):
        torch.ops.comera.tt_embedding_backward(grad[:3], *shorter, kept)
    tampered = kept.clone()
    tampered[5:] = tampered[5:].flip(0)
    with pytest.raises(ValueError, match="not this call"):
        torch.ops.comera.tt_embedding_backward(grad, *args, tampered)
    with pytest.raises(TypeError, match="kept_rows must be int64"):
        torch.ops.comera.tt_embedding_backward(grad, *args, kept.double())
    with pytest.raises(ValueError, match="kept_rows must be a contiguous 1-D"):
        torch.ops.comera.tt_embedding_backward(grad, *args, kept.reshape(1, -1))
    # the right rows still work after all that
    gcores, _ = torch.ops.comera.tt_embedding_backward(grad, *args, kept)
    ref, _ = torch.ops.comera.tt_embedding_backward(grad, *args)
    for a, b in zip(gcores, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
