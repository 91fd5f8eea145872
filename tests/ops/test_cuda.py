"""The CUDA implementations of the tt_linear operators (csrc/tt_linear/cuda.cu and
its glue, csrc/tt_linear/op.cpp).

Every test here is marked needs_cuda and skipped without a GPU.  Each checks
the CUDA op against an independent reference: the float64 CPU kernels on the
same (rounded) values, float64 gradcheck, torch.library.opcheck, eager runs
for torch.compile and CUDA graph replay.

COMERA_TEST_CUDA_DEVICE=cpu runs the same test code with the CPU as the
"device" (float32/float64 only; tests of CUDA-only features skip), so the
tests themselves can be checked on a machine without a GPU.
"""
import copy
import os

import pytest
import torch
from torch import nn

import comera
from comera.ops.linear import PATHS

pytestmark = pytest.mark.needs_cuda

DEV = os.environ.get("COMERA_TEST_CUDA_DEVICE", "cuda")
ON_GPU = DEV == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="a CUDA-only feature: needs a real GPU")

SHAPES = [
    # in, out, in_shape, out_shape, rank
    (6, 4, [2, 3], [4], 2),
    (12, 20, [3, 4], [4, 5], 3),
    (16, 6, [2, 2, 2, 2], [2, 3], 3),
    (30, 16, [2, 3, 5], [2, 2, 2, 2], 5),
    (7, 11, [2, 4], [3, 4], 3),             # prime sizes, padded
    (5, 9, [5], [3, 3], 1),                  # rank 1, p = 1
    (24, 24, [2, 3, 4], [4, 3, 2], 100),     # rank at the TT bound
    (96, 768, [4, 4, 6], [12, 16, 4], 8),    # long gradient sums (split reductions)
    (768, 3072, [8, 8, 12], [12, 16, 16], 30),
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# error allowed, relative to the largest reference entry
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 6e-3}


def _dtypes():
    return DTYPES if ON_GPU else [torch.float32, torch.float64]


def _close(got, ref, rel, what):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    err = (got.double().cpu() - ref).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-30)
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs largest entry {scale:.3g}"


def _layer_tensors(in_f, out_f, in_shape, out_shape, rank, bias=True):
    layer = comera.TTLinear(in_f, out_f, bias=bias, rank=rank, in_shape=in_shape,
                            out_shape=out_shape, dtype=torch.float64)
    with torch.no_grad():  # gates away from 1, so their gradients matter
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    b = layer.bias.detach() if bias else None
    return ([c.detach() for c in layer.cores], [g.detach() for g in layer.gates], b,
            layer.num_in_cores)


def _run(cores, gates, bias, x, dy, p, out_f, path, device, dtype):
    """tt_linear forward + backward through the op itself (so t is seen)."""
    leaf = lambda v: v.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()  # noqa: E731
    cs, gs = [leaf(c) for c in cores], [leaf(g) for g in gates]
    b = leaf(bias) if bias is not None else None
    xx = leaf(x)
    y, t = torch.ops.comera.tt_linear(xx, cs, gs, b, p, out_f, PATHS[path])
    y.backward(dy.to(device, dtype))
    return y, t, xx.grad, [c.grad for c in cs], [g.grad for g in gs], b.grad if b is not None else None


@pytest.mark.parametrize("batch", [0, 1, 37, 513])
@pytest.mark.parametrize("path", ["auto", "merge", "sequential"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}r{s[4]}")
def test_cuda_matches_cpu_float64(shape, dtype, path, batch):
    if dtype not in _dtypes():
        pytest.skip("bfloat16/float16 ops exist on CUDA only")
    in_f, out_f, in_shape, out_shape, rank = shape
    cores, gates, bias, p = _layer_tensors(in_f, out_f, in_shape, out_shape, rank)
    x = torch.randn(batch, in_f, dtype=torch.float64)
    dy = torch.randn(batch, out_f, dtype=torch.float64)
    # the reference sees exactly the values the device sees
    rnd = lambda v: v.to(dtype).to(torch.float64)  # noqa: E731
    cores, gates, bias, x, dy = [rnd(c) for c in cores], [rnd(g) for g in gates], rnd(bias), rnd(x), rnd(dy)
    ref = _run(cores, gates, bias, x, dy, p, out_f, "merge", "cpu", torch.float64)
    got = _run(cores, gates, bias, x, dy, p, out_f, path, DEV, dtype)
    rel = REL_TOL[dtype]
    for name, g, r in zip(["y", "t", "grad x"], got[:3], ref[:3]):
        assert g.dtype == dtype and g.device.type == DEV
        _close(g, r, rel, name)
    for k, (g, r) in enumerate(zip(got[3], ref[3])):
        _close(g, r, rel, f"grad core {k}")
    # a gate gradient sums over a whole core, with cancellation: in 16-bit
    # types its error relative to its largest entry is a few times larger
    grel = 3 * rel if dtype in (torch.bfloat16, torch.float16) else rel
    for k, (g, r) in enumerate(zip(got[4], ref[4])):
        _close(g, r, grel, f"grad gate {k}")
    _close(got[5], ref[5], rel, "grad bias")


@pytest.mark.parametrize("needs_input_grad", [True, False])
def test_backward_op_without_bias_or_input_grad(needs_input_grad):
    cores, gates, _, p = _layer_tensors(12, 20, [3, 4], [4, 5], 3, bias=False)
    x = torch.randn(9, 12, dtype=torch.float64)
    dy = torch.randn(9, 20, dtype=torch.float64)
    dev = lambda v: v.to(DEV)  # noqa: E731
    _, t = torch.ops.comera.tt_linear(dev(x), [dev(c) for c in cores], [dev(g) for g in gates],
                                      None, p, 20, 0)
    gx, gc, gg, gb = torch.ops.comera.tt_linear_backward(
        dev(dy), dev(x), t, [dev(c) for c in cores], [dev(g) for g in gates], False,
        needs_input_grad, p, 20, 0)
    assert gb.numel() == 0
    assert gx.numel() == (9 * 12 if needs_input_grad else 0)
    _, _, rgx, rgc, rgg, _ = _run(cores, gates, None, x, dy, p, 20, "merge", "cpu", torch.float64)
    if needs_input_grad:
        _close(gx, rgx, 1e-10, "grad x")
    for g, r in zip(gc + gg, rgc + rgg):
        _close(g, r, 1e-10, "core/gate grad")


@pytest.mark.parametrize("path", ["merge", "sequential"])
def test_gradcheck_float64_on_device(path):
    cores, gates, bias, p = _layer_tensors(6, 8, [2, 3], [2, 4], 3)
    args = [torch.randn(5, 6, dtype=torch.float64)] + cores + gates + [bias]
    args = [a.to(DEV).requires_grad_() for a in args]

    def f(x, *ps):
        return comera.ops.tt_linear(x, ps[:4], ps[4:7], ps[7], 2, 8, path)

    assert torch.autograd.gradcheck(f, tuple(args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_on_device(dtype):
    if dtype not in _dtypes():
        pytest.skip("bfloat16 ops exist on CUDA only")
    cores, gates, bias, p = _layer_tensors(12, 20, [3, 4], [4, 5], 3)
    dev = lambda v: v.to(DEV, dtype).requires_grad_()  # noqa: E731
    x = dev(torch.randn(7, 12))
    cs, gs = [dev(c) for c in cores], [dev(g) for g in gates]
    args = (x, cs, gs, dev(bias), p, 20, 0)
    torch.library.opcheck(torch.ops.comera.tt_linear.default, args)
    y, t = torch.ops.comera.tt_linear(*args)
    bargs = (torch.randn_like(y).detach(), x.detach(), t.detach(), [c.detach() for c in cs],
             [g.detach() for g in gs], True, True, p, 20, 0)
    torch.library.opcheck(torch.ops.comera.tt_linear_backward.default, bargs)


def test_torch_compile_fullgraph_matches_eager_on_device():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(comera.TTLinear(24, 32, rank=4), nn.GELU(),
                          comera.TTLinear(32, 8, rank=4)).to(DEV)
    x = torch.randn(6, 24, device=DEV)
    compiled = torch.compile(model, fullgraph=True)
    y_c = compiled(x)
    y_c.sum().backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_e = model(x)
    y_e.sum().backward()
    torch.testing.assert_close(y_c, y_e, atol=1e-5, rtol=1e-5)
    for gc, ge in zip(grads_c, (p.grad for p in model.parameters())):
        torch.testing.assert_close(gc, ge, atol=1e-5, rtol=1e-5)


def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(64, 96, rank=6), nn.GELU(),
                         comera.TTLinear(96, 32, rank=6)).to(DEV)


def _small_token_model():
    """A capturable TTEmbedding feeding TTLinear layers: token ids in."""
    torch.manual_seed(0)
    return nn.Sequential(comera.TTEmbedding(1000, 64, rank=8, capturable=True),
                         comera.TTLinear(64, 96, rank=6), nn.GELU(),
                         comera.TTLinear(96, 32, rank=6)).to(DEV)


def _capture_case(kind):
    """(model factory, 8 batches) for the graph capture test."""
    g = torch.Generator(device=DEV).manual_seed(1)
    if kind == "tt_linear":
        return _small_model, [(torch.randn(128, 64, device=DEV, generator=g),
                               torch.randn(128, 32, device=DEV, generator=g)) for _ in range(8)]
    # repeated ids within a batch, so dedup really groups rows; the targets
    # are a fixed function of the ids, and two batches alternate, so that
    # replays 3 and 7 see the same batch and the loss must have fallen
    table = torch.randn(40, 32, device=DEV, generator=g)
    ids = [torch.randint(0, 40, (16, 8), device=DEV, generator=g) for _ in range(2)] * 4
    return _small_token_model, [(x, table[x]) for x in ids]


def _train_step(model, opt, x, y):
    out = nn.functional.mse_loss(model(x), y)
    out.backward()
    opt.step()
    return out


@needs_gpu
@pytest.mark.parametrize("kind", ["tt_linear", "tt_embedding+tt_linear"])
def test_cuda_graph_captures_a_whole_training_step(kind):
    """Forward, backward and AdamW(capturable=True) captured once, replayed on
    new data, match the same steps run eagerly: TTLinear layers, and a
    capturable TTEmbedding (dedup with index-count-sized buffers) in front."""
    make, batches = _capture_case(kind)
    eager, graphed = make(), make()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, capturable=True)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-2, capturable=True)
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps (0..2), outside the graph
        for x, y in batches[:3]:
            opt_g.zero_grad(set_to_none=True)
            _train_step(graphed, opt_g, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _train_step(graphed, opt_g, static_x, static_y)
    before = [p.detach().clone() for p in graphed.parameters()]  # capture runs nothing
    losses_g = []
    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses_g.append(static_loss.item())

    losses_e = []
    for i, (x, y) in enumerate(batches):
        opt_e.zero_grad(set_to_none=True)
        loss = _train_step(eager, opt_e, x, y)
        if i >= 3:
            losses_e.append(loss.item())
    torch.cuda.synchronize()
    assert losses_g == pytest.approx(losses_e, rel=1e-4, abs=1e-6)
    # the replays really stepped: every parameter moved (the loss of a few
    # steps on different random batches need not fall: seen on an H200)
    assert all(not torch.equal(b, p) for b, p in zip(before, graphed.parameters()))
    for pg, pe in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(pg, pe, atol=1e-5, rtol=1e-4)


@needs_gpu
def test_forward_and_backward_never_synchronise_with_the_host():
    model = _small_model()
    x = torch.randn(256, 64, device=DEV, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(p.grad is not None for p in model.parameters())


@needs_gpu
def test_autocast_bfloat16_like_nn_linear():
    layer = comera.TTLinear(64, 48, rank=6).to(DEV)
    x = torch.randn(33, 64, device=DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    _close(y, layer(x).detach().double().cpu(), 4e-2, "autocast output")
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())


@needs_gpu
def test_benchmark_shape_bfloat16_against_dense_float32():
    """768 -> 3072, rank 30, 4096 rows (the benchmark case) in bfloat16 against
    the dense float32 product on the same GPU."""
    layer = comera.TTLinear(768, 3072, rank=30).to(DEV)
    x = torch.randn(4096, 768, device=DEV)
    ref = x @ layer.weight.detach().t() + layer.bias.detach()
    lb = copy.deepcopy(layer).to(torch.bfloat16)
    y = lb(x.to(torch.bfloat16))
    _close(y, ref.double().cpu(), 4e-2, "bf16 output")


def test_mixed_devices_are_refused():
    if not ON_GPU:
        pytest.skip("needs two devices")
    cores, gates, bias, p = _layer_tensors(12, 20, [3, 4], [4, 5], 3)
    cs = [c.to(DEV) for c in cores]
    gs = [g.to(DEV) for g in gates]
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.comera.tt_linear(torch.randn(3, 12, dtype=torch.float64, device=DEV),
                                   cs[:1] + [cores[1]] + cs[2:], gs, None, p, 20, 0)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.comera.tt_linear(torch.randn(3, 12, dtype=torch.float64, device=DEV),
                                   cs, gs, bias, p, 20, 0)
    with pytest.raises(RuntimeError, match="path"):
        torch.ops.comera.tt_linear(torch.randn(3, 12, dtype=torch.float64, device=DEV),
                                   cs, gs, None, p, 20, 3)


@pytest.mark.parametrize("kill", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gate_prox_on_device_matches_cpu(dtype, kill):
    if dtype not in _dtypes():
        pytest.skip("bfloat16/float16 gates exist on CUDA only")
    torch.manual_seed(3)
    sizes = [1, 5, 17, 40, 8]
    gates = [(torch.rand(n, dtype=torch.float64) - 0.5) * 0.05 for n in sizes]
    signs = [torch.randint(-1, 2, (n,), dtype=torch.int8) for n in sizes]
    ref_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    ref_g = [g.to(dtype).to(ref_dtype) for g in gates]
    ref_s = [s.clone() for s in signs]
    dev_g = [g.to(DEV, dtype) for g in gates]
    dev_s = [s.to(DEV) for s in signs]
    want = comera.ops.gate_prox_(ref_g, ref_s, threshold=0.01, min_live=3, kill=kill)
    got = comera.ops.gate_prox_(dev_g, dev_s, threshold=0.01, min_live=3, kill=kill)
    # the live counts stay on the device (no copy back, no wait)
    assert got.device == dev_g[0].device and got.tolist() == want.tolist()
    for g, s, rg, rs in zip(dev_g, dev_s, ref_g, ref_s):
        assert torch.equal(s.cpu(), rs)
        assert torch.equal(g.cpu().to(ref_dtype), rg)
    if ON_GPU:  # the CUDA kernel served it, not the torch fallback
        assert torch._C._dispatch_has_kernel_for_dispatch_key("comera::gate_prox_", "CUDA")


def test_gate_prox_nan_leaves_every_gate_alone_on_device():
    gates = [torch.tensor([0.5, -0.001, 0.2], device=DEV), torch.tensor([float("nan"), 1.0], device=DEV)]
    signs = [torch.tensor([1, 1, -1], dtype=torch.int8, device=DEV),
             torch.tensor([1, 1], dtype=torch.int8, device=DEV)]
    before = [g.clone() for g in gates]
    live = comera.ops.gate_prox_(gates, signs, threshold=0.01)
    assert live.tolist() == [0, -1]
    torch.testing.assert_close(gates[0], before[0])
    assert signs[0].tolist() == [1, 1, -1]
