"""TTEmbedding(capturable=True) and the host-side index check that it skips.

On CUDA the capturable layer never synchronises with the host (see
tests/ops/test_cuda_embedding.py for the graph capture); here, on the CPU, it
must give exactly the results of the default layer, and the index check that
the CUDA path runs (check_indices_on_device, device-agnostic) must accept
good batches and raise the CPU op's errors for bad ones.
"""
import copy

import pytest
import torch

import comera
from comera.ops.embedding import check_indices_on_device


def _pair(mode=None, padding_idx=None, dtype=torch.float64):
    torch.manual_seed(0)
    base = comera.TTEmbedding(50, 12, rank=3, shape=([5, 10], [3, 4]), mode=mode,
                              padding_idx=padding_idx, dtype=dtype)
    cap = copy.deepcopy(base)
    cap.capturable = True
    return base, cap


@pytest.mark.parametrize("reuse", ["auto", "none", "dedup", "prefix"])
@pytest.mark.parametrize("mode, weighted", [(None, False), ("sum", False), ("sum", True),
                                            ("mean", False)])
def test_capturable_matches_default_on_cpu(mode, weighted, reuse):
    base, cap = _pair(mode=mode, padding_idx=4)
    assert cap.capturable and not base.capturable
    base.reuse = cap.reuse = reuse
    idx = torch.tensor([3, 4, 3, 49, 0, 3, 17, 17, 4])
    offsets = torch.tensor([0, 2, 2, 6]) if mode else None
    psw = torch.linspace(-1, 2, idx.numel(), dtype=torch.float64) if weighted else None
    outs, grads = [], []
    for layer in (base, cap):
        out = layer(idx, offsets, psw) if mode else layer(idx.reshape(3, 3))
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in layer.parameters()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    # and both are right: the dense table gives the same rows
    dense = base.to_dense()
    ref = dense(idx, offsets, per_sample_weights=psw) if mode else dense(idx.reshape(3, 3))
    torch.testing.assert_close(outs[1], ref, atol=1e-10, rtol=1e-10)


def test_capturable_constructor_repr_and_cpu_errors():
    emb = comera.TTEmbedding(20, 6, rank=2, capturable=True)
    assert emb.capturable is True and "capturable=True" in repr(emb)
    assert "capturable" not in repr(comera.TTEmbedding(20, 6, rank=2))
    # on the CPU the C kernels check the indices whatever the option says
    with pytest.raises(IndexError, match="out of range for num_embeddings=20"):
        emb(torch.tensor([1, 20]))


def test_capturable_compiles_fullgraph():
    _, cap = _pair(dtype=torch.float32)
    idx = torch.tensor([[1, 2, 2], [9, 0, 1]])
    compiled = torch.compile(cap, fullgraph=True)
    torch.testing.assert_close(compiled(idx), cap(idx))


def test_device_check_accepts_good_batches():
    check_indices_on_device(torch.tensor([0, 4, 2]), None, 5)
    check_indices_on_device(torch.tensor([0, 4, 2], dtype=torch.int32),
                            torch.tensor([0, 0, 3], dtype=torch.int32), 5)
    check_indices_on_device(torch.zeros(0, dtype=torch.int64), torch.tensor([0]), 5)
    check_indices_on_device(torch.tensor([[1, 2], [3, 4]]), None, 5)  # any shape


@pytest.mark.parametrize("idx, pos", [([0, 5, 1], 1), ([-1, 0], 0), ([2, 2, 7, 9], 2)])
def test_device_check_raises_the_cpu_ops_index_error(idx, pos):
    t = torch.tensor(idx)
    with pytest.raises(IndexError) as mine:
        check_indices_on_device(t, None, 5)
    assert f"index {idx[pos]} at position {pos} is out of range" in str(mine.value)
    emb = comera.TTEmbedding(5, 4, rank=2, shape=([5, 1], [2, 2]))
    with pytest.raises(IndexError) as cpu:
        emb(t)
    assert str(mine.value) in str(cpu.value)  # the same words as the C kernels' check


@pytest.mark.parametrize("offsets, k", [([1, 2, 3], 0), ([0, 2, 1, 3], 2), ([0, 1, 2], 2),
                                        ([0, 5, 3], 1), ([0, 4], 1)])
def test_device_check_raises_for_bad_offsets(offsets, k):
    idx = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=rf"offsets\[{k}\] = {offsets[k]} is invalid"):
        check_indices_on_device(idx, torch.tensor(offsets), 5)
    emb = comera.TTEmbedding(5, 4, rank=2, shape=([5, 1], [2, 2]), mode="sum",
                             include_last_offset=True)
    with pytest.raises(ValueError, match=rf"offsets\[{k}\] = {offsets[k]} is invalid"):
        emb(idx, torch.tensor(offsets))  # the CPU op names the same entry
