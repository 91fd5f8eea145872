"""The CUDA implementations of the tt_embedding operators (csrc/tt_embedding/cuda*.cu
and its glue, csrc/tt_embedding/op.cpp).

Every test here is marked needs_cuda and skipped without a GPU.  Each checks
the CUDA op against an independent reference: the float64 CPU kernels on the
same (rounded) values, float64 gradcheck, torch.library.opcheck, eager runs
for torch.compile.  The whole-training-step CUDA graph capture with a
capturable TTEmbedding is in tests/ops/test_cuda.py (with the TTLinear one).

COMERA_TEST_CUDA_DEVICE=cpu runs the same test code with the CPU as the
"device" (float32/float64 only; tests of CUDA-only features skip).
"""
import os

import pytest
import torch

import comera
from comera.ops.embedding import REUSE

pytestmark = pytest.mark.needs_cuda

DEV = os.environ.get("COMERA_TEST_CUDA_DEVICE", "cuda")
ON_GPU = DEV == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="a CUDA-only feature: needs a real GPU")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 6e-3}
SHAPES = [
    # num_embeddings, embedding_dim, row modes, dim modes, rank, padding_idx
    (15, 6, [5, 3], [2, 3], 3, None),
    (13, 7, [4, 4], [3, 3], 4, 0),                  # padded rows and entries
    (24, 12, [3, 2, 4], [2, 2, 3], 100, 5),         # ranks at the TT bound
    (20, 11, [2, 3, 2, 2], [2, 2, 1, 3], 3, 19),
    (1000, 64, [10, 10, 10], [4, 4, 4], 16, None),  # wide rows, many repeats
]
MODES = [(None, False), ("sum", False), ("sum", True), ("mean", False)]


def _dtypes():
    return DTYPES if ON_GPU else [torch.float32, torch.float64]


def _close(got, ref, rel, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    err = (got.double().cpu() - ref).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-30)
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs largest entry {scale:.3g}"


def _tensors(shape, dtype):
    """Cores and gates of a float64 layer, rounded through dtype."""
    num, dim, v, e, rank, pad = shape
    torch.manual_seed(0)
    layer = comera.TTEmbedding(num, dim, rank=rank, shape=(v, e), padding_idx=pad,
                               dtype=torch.float64)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    rnd = lambda t: t.detach().to(dtype).to(torch.float64)  # noqa: E731
    return [rnd(c) for c in layer.cores], [rnd(g) for g in layer.gates]


def _batch(shape, n, mode, weighted, dtype):
    num, pad = shape[0], shape[5]
    g = torch.Generator().manual_seed(n)
    idx = torch.randint(0, num, (n,), generator=g)
    idx[torch.rand(n, generator=g) < 0.4] = 3 % num  # repeats
    if pad is not None and n > 2:
        idx[1] = pad
    offsets = None
    if mode is not None:
        offsets = torch.tensor([0, 0, n // 3, n // 3, n]) if n else torch.tensor([0, 0])
    psw = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).double() if weighted else None
    return idx, offsets, psw


def _run(cores, gates, idx, offsets, psw, grad, shape, mode, reuse, device, dtype):
    """Forward and backward ops on `device` in `dtype`."""
    num, dim, _, _, _, pad = shape
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    cs, gs = [to(c) for c in cores], [to(g) for g in gates]
    ii = idx.to(device)
    oo = None if offsets is None else offsets.to(device)
    args = (num, dim, -1 if pad is None else pad, {None: 0, "sum": 1, "mean": 2}[mode],
            REUSE[reuse])
    out = torch.ops.comera.tt_embedding(ii, oo, to(psw), cs, gs, *args)
    gc, gg = torch.ops.comera.tt_embedding_backward(to(grad), ii, oo, to(psw), cs, gs, *args)
    return out, gc, gg


@pytest.mark.parametrize("n", [0, 1, 40, 700])
@pytest.mark.parametrize("reuse", ["auto", "none", "dedup"])
@pytest.mark.parametrize("mode, weighted", MODES, ids=["plain", "sum", "sum-psw", "mean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}r{s[4]}")
def test_cuda_matches_cpu_float64(shape, dtype, mode, weighted, reuse, n):
    if dtype not in _dtypes():
        pytest.skip("bfloat16/float16 ops exist on CUDA only")
    cores, gates = _tensors(shape, dtype)
    idx, offsets, psw = _batch(shape, n, mode, weighted, dtype)
    rows = n if mode is None else offsets.numel() - 1
    grad = torch.randn(rows, shape[1], dtype=torch.float64).to(dtype).double()
    ref = _run(cores, gates, idx, offsets, psw, grad, shape, mode, "dedup", "cpu", torch.float64)
    got = _run(cores, gates, idx, offsets, psw, grad, shape, mode, reuse, DEV, dtype)
    rel = REL_TOL[dtype]
    assert got[0].dtype == dtype and got[0].device.type == DEV
    _close(got[0], ref[0], rel, "output")
    grel = 3 * rel if dtype in (torch.bfloat16, torch.float16) else rel
    for k, (g, r) in enumerate(zip(got[1], ref[1])):
        _close(g, r, grel, f"grad core {k}")
    for k, (g, r) in enumerate(zip(got[2], ref[2])):
        _close(g, r, grel, f"grad gate {k}")


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
def test_gradcheck_float64_on_device(mode):
    shape = SHAPES[1]
    cores, gates = _tensors(shape, torch.float64)
    idx = torch.tensor([3, 0, 5, 3, 12, 7]).to(DEV)
    offsets = torch.tensor([0, 2, 2, 6]).to(DEV) if mode else None
    params = [t.to(DEV).requires_grad_() for t in cores + gates]
    psw = None
    if mode == "sum":
        psw = torch.randn(6, dtype=torch.float64, device=DEV).requires_grad_()

    def f(*ps):
        w = ps[-1] if mode == "sum" else None
        ps = ps[:-1] if mode == "sum" else ps
        return comera.ops.tt_embedding(idx, ps[:2], ps[2:], 13, 7, offsets=offsets,
                                       per_sample_weights=w, padding_idx=0, mode=mode,
                                       include_last_offset=True)

    assert torch.autograd.gradcheck(f, tuple(params + ([psw] if psw is not None else [])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_on_device(dtype):
    if dtype not in _dtypes():
        pytest.skip("bfloat16 ops exist on CUDA only")
    cores, gates = _tensors(SHAPES[2], dtype)
    dev = lambda t: t.to(DEV, dtype).requires_grad_()  # noqa: E731
    cs, gs = [dev(c) for c in cores], [dev(g) for g in gates]
    idx = torch.tensor([3, 5, 3, 23, 0]).to(DEV)
    offsets = torch.tensor([0, 2, 5]).to(DEV)
    for args in [(idx, None, None, cs, gs, 24, 12, 5, 0, 0),
                 (idx, offsets, dev(torch.rand(5)), cs, gs, 24, 12, 5, 1, 2)]:
        torch.library.opcheck(torch.ops.comera.tt_embedding.default, args)
        out = torch.ops.comera.tt_embedding(*args)
        bargs = (torch.randn_like(out).detach(),) + tuple(
            [t.detach() for t in a] if isinstance(a, list) else
            (a.detach() if isinstance(a, torch.Tensor) else a) for a in args)
        torch.library.opcheck(torch.ops.comera.tt_embedding_backward.default, bargs)


@pytest.mark.parametrize("capturable", [False, True])
def test_torch_compile_fullgraph_matches_eager_on_device(capturable):
    torch._dynamo.reset()
    torch.manual_seed(0)
    emb = comera.TTEmbedding(500, 32, rank=6, capturable=capturable).to(DEV)
    idx = torch.randint(0, 500, (4, 9), device=DEV)
    compiled = torch.compile(emb, fullgraph=True)
    out_c = compiled(idx)
    (out_c ** 2).sum().backward()
    grads_c = [p.grad.clone() for p in emb.parameters()]
    emb.zero_grad()
    out_e = emb(idx)
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    for gc, ge in zip(grads_c, (p.grad for p in emb.parameters())):
        torch.testing.assert_close(gc, ge, atol=1e-5, rtol=1e-5)


def test_bad_indices_raise_on_device_unless_capturable():
    emb = comera.TTEmbedding(30, 8, rank=3).to(DEV)
    with pytest.raises(IndexError, match="index 30 at position 2 is out of range"):
        emb(torch.tensor([1, 2, 30], device=DEV))
    bag = comera.TTEmbedding(30, 8, rank=3, mode="sum", include_last_offset=True).to(DEV)
    with pytest.raises(ValueError, match=r"offsets\[1\] = 5 is invalid"):
        bag(torch.tensor([1, 2, 3], device=DEV), torch.tensor([0, 5, 3], device=DEV))


@needs_gpu
def test_capturable_bad_index_reads_nan_without_a_sync():
    emb = comera.TTEmbedding(30, 8, rank=3, capturable=True).to(DEV)
    idx = torch.tensor([1, 30, -2, 1], device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = emb(idx)
        out.nan_to_num().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.isfinite(out[0]).all() and torch.equal(out[0], out[3])
    assert all(torch.isfinite(p.grad).all() for p in emb.parameters())


@needs_gpu
@pytest.mark.parametrize("mode", [None, "mean"])
def test_capturable_forward_and_backward_never_synchronise(mode):
    emb = comera.TTEmbedding(30522, 768, rank=16, mode=mode, capturable=True).to(DEV)
    idx = torch.randint(0, 30522, (32, 128), device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        emb(idx).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_backward_is_deterministic_and_order_independent():
    """Repeated runs give bitwise equal gradients; permuting a batch of distinct
    rows changes no bit either (every sum runs in a fixed order)."""
    torch.manual_seed(0)
    emb = comera.TTEmbedding(1000, 48, rank=8).to(DEV)
    idx = torch.randint(0, 1000, (4000,), device=DEV)
    grads = []
    for _ in range(2):
        emb.zero_grad()
        emb(idx).sum().backward()
        grads.append([p.grad.clone() for p in emb.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    distinct = torch.randperm(1000, device=DEV)[:300]
    w = torch.randn(300, 48, device=DEV)
    perm = torch.randperm(300, device=DEV)
    runs = []
    for order in (torch.arange(300, device=DEV), perm):
        emb.zero_grad()
        (emb(distinct[order]) * w[order]).sum().backward()
        runs.append([p.grad.clone() for p in emb.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@needs_gpu
def test_bfloat16_layer_against_float32():
    torch.manual_seed(0)
    emb = comera.TTEmbedding(30522, 768, rank=16).to(DEV)
    idx = torch.randint(0, 30522, (8, 128), device=DEV)
    ref = emb(idx)
    low = emb.to(torch.bfloat16)(idx)
    assert low.dtype == torch.bfloat16
    _close(low.float().double().cpu(), ref.double().cpu(), 4e-2, "bfloat16 vs float32")
