"""The CPU's bfloat16 and float16 TT linear kernels through the op: values and
gradients against the float64 layer of the same (rounded) parameters, under
every micro-kernel variant this CPU runs (AMX among them where it has it;
COMERA_ISA is read once per process, so each variant runs in a fresh
interpreter), torch.autocast("cpu") on a float32 layer without float32 copies
of the activations, the op's dtype rules, and the planner's kernel and time."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import comera
from comera.ops.linear_plan import KERNELS

HALF = (torch.bfloat16, torch.float16)
# largest |error| / largest |reference| over an output: a few roundings of
# 2^-9 (bfloat16) or 2^-12 (float16) each, as in the C tests
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _layer(in_f, out_f, rank, bias, dtype, seed=0, **kw):
    torch.manual_seed(seed)
    layer = comera.TTLinear(in_f, out_f, rank=rank, bias=bias, **kw)
    with torch.no_grad():  # gates away from 1, so their gradients matter
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    return layer.to(dtype)


def _step(layer, x, gy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(gy)
    return y.detach(), x.grad, [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(96, 200, [4, 9, 11, 7, 8], True, [4, 4, 6], [5, 5, 8]),
                                   (768, 768, 30, True, None, None),
                                   (50, 70, 5, False, None, None)])
def test_half_layer_matches_float64(dtype, shape):
    in_f, out_f, rank, bias, in_shape, out_shape = shape
    kw = {"in_shape": in_shape, "out_shape": out_shape} if in_shape else {}
    layer = _layer(in_f, out_f, rank, bias, dtype, **kw)
    ref = _layer(in_f, out_f, rank, bias, torch.float64, **kw)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    torch.manual_seed(1)
    x = torch.randn(300, in_f).to(dtype)
    gy = torch.randn(300, out_f).to(dtype)
    y, gx, grads = _step(layer, x, gy)
    y64, gx64, grads64 = _step(ref, x.double(), gy.double())
    assert y.dtype == gx.dtype == dtype and all(g.dtype == dtype for g in grads)
    tol = TOL[dtype]
    assert rel_err(y, y64) <= tol and rel_err(gx, gx64) <= tol
    for g, g64 in zip(grads, grads64):
        assert rel_err(g, g64) <= tol


# One forward+backward in the variant COMERA_ISA names, bfloat16 and
# float16 modules, printed as JSON with the kernel the planner names.
_CHILD = r"""
import json, sys, torch, comera
out = {"isa": torch.ops.comera.cpu_isa()}
for name in ("bfloat16", "float16"):
    dtype = getattr(torch, name)
    torch.manual_seed(0)
    layer = comera.TTLinear(96, 200, rank=[4, 9, 11, 7, 8], in_shape=[4, 4, 6],
                            out_shape=[5, 5, 8])
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    layer = layer.to(dtype)
    torch.manual_seed(1)
    x = torch.randn(130, 96).to(dtype).requires_grad_()
    gy = torch.randn(130, 200).to(dtype)
    y = layer(x)
    y.backward(gy)
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    out[name] = {"kernel": layer.plan(130)["kernel"],
                 "values": [y.detach().double().flatten().tolist()] +
                           [g.double().flatten().tolist() for g in grads]}
print(json.dumps(out))
"""


def _reference(name):
    dtype = getattr(torch, name)
    torch.manual_seed(0)
    layer = comera.TTLinear(96, 200, rank=[4, 9, 11, 7, 8], in_shape=[4, 4, 6],
                            out_shape=[5, 5, 8])
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    layer = layer.to(dtype).double()
    torch.manual_seed(1)
    x = torch.randn(130, 96).to(dtype).double().requires_grad_()
    gy = torch.randn(130, 200).to(dtype).double()
    y = layer(x)
    y.backward(gy)
    return [y.detach()] + [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("isa", ["amx", "avx512bf16", "avx512", "avx2", "generic"])
def test_every_variant_matches_float64(isa):
    env = dict(os.environ, COMERA_ISA=isa, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if "cannot run it" in proc.stderr or "not built" in proc.stderr:
        pytest.skip(f"this CPU (or build) does not run {isa}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("bfloat16", "float16"):
        dtype = getattr(torch, name)
        # the pair kernels run bfloat16 only; float16 runs on the float32 tile
        want = isa if (isa not in ("amx", "avx512bf16") or name == "bfloat16") else "avx512"
        assert out[name]["kernel"] == want
        for got, ref in zip(out[name]["values"], _reference(name)):
            assert rel_err(torch.tensor(got).reshape(ref.shape), ref) <= TOL[dtype], (isa, name)


class _Record(TorchDispatchMode):
    """Every aten op's name and the dtypes and shapes of its outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.calls.append((str(func), [(o.dtype, tuple(o.shape)) for o in outs
                                        if isinstance(o, torch.Tensor)]))
        return out


@pytest.mark.parametrize("dtype", HALF)
def test_autocast_runs_16bit_kernels_on_a_float32_layer(dtype):
    layer = _layer(768, 3072, 16, True, torch.float32)
    ref = _layer(768, 3072, 16, True, torch.float64)
    torch.manual_seed(2)
    x = torch.randn(256, 768).to(dtype)
    gy = torch.randn(256, 3072).to(dtype)
    xr = x.detach().clone().requires_grad_()
    rec = _Record()
    with rec, torch.autocast("cpu", dtype=dtype):
        y = layer(xr)
        y.backward(gy)
    assert y.dtype == dtype and xr.grad.dtype == dtype
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
    # no float32 tensor of the activations' size: x, y, dy and dx stay 16-bit
    big = [(name, o) for name, outs in rec.calls for o in outs
           if o[0] == torch.float32 and o[1] in ((256, 768), (256, 3072))]
    assert not big, big
    y64, gx64, grads64 = _step(ref, x.double(), gy.double())
    assert rel_err(y, y64) <= TOL[dtype] and rel_err(xr.grad, gx64) <= TOL[dtype]
    for p, g64 in zip(layer.parameters(), grads64):
        assert rel_err(p.grad, g64) <= TOL[dtype]


@pytest.mark.parametrize("rank", [16, 10])
@pytest.mark.parametrize("dtype", HALF)
def test_autocast_takes_a_float32_input_as_it_is(dtype, rank):
    """A float32 x (a layer norm's output, say) goes to the 16-bit kernels
    uncast; y in autocast's dtype as F.linear's, dx in float32 straight from
    the kernel.  Rank 10: t = x V by the float32 dot kernel where the
    variant has one."""
    layer = _layer(768, 3072, rank, True, torch.float32)
    ref = _layer(768, 3072, rank, True, torch.float64)
    torch.manual_seed(3)
    x = torch.randn(256, 768, requires_grad=True)
    gy = torch.randn(256, 3072).to(dtype)
    rec = _Record()
    with rec, torch.autocast("cpu", dtype=dtype):
        y = layer(x)
        dense = torch.nn.functional.linear(x, layer.weight, layer.bias)
        y.backward(gy)
    assert y.dtype == dense.dtype == dtype and x.grad.dtype == torch.float32
    casts = [(name, o) for name, outs in rec.calls for o in outs
             if "_to_copy" in name and o[1] in ((256, 768), (256, 3072))]
    assert casts == [("aten._to_copy.default", (dtype, (256, 768)))], casts  # F.linear's own
    y64, gx64, grads64 = _step(ref, x.detach().double(), gy.double())
    assert rel_err(y, y64) <= TOL[dtype] and rel_err(x.grad, gx64) <= TOL[dtype]
    for p, g64 in zip(layer.parameters(), grads64):
        assert rel_err(p.grad, g64) <= TOL[dtype]


def test_op_takes_float32_parameters_with_16bit_activations():
    layer = _layer(64, 48, 4, True, torch.float32)
    x = torch.randn(10, 64).to(torch.bfloat16)
    cores, gates = list(layer.cores), list(layer.gates)
    y, t = torch.ops.comera.tt_linear(x, cores, gates, layer.bias, 3, 48, 0)
    assert y.dtype == t.dtype == torch.bfloat16
    gy = torch.randn(10, 48).to(torch.bfloat16)
    gx, gc, gg, gb = torch.ops.comera.tt_linear_backward(gy, x, t, cores, gates, True, True, 3,
                                                         48, 0)
    assert gx.dtype == torch.bfloat16 and gb.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in gc + gg)
    # the fake kernels say the same dtypes (torch.compile, torch.export)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        fy, ft = torch.ops.comera.tt_linear(x, cores, gates, layer.bias, 3, 48, 0)
        fgx, fgc, fgg, fgb = torch.ops.comera.tt_linear_backward(gy, x, t, cores, gates, True,
                                                                 True, 3, 48, 0)
    assert (fy.dtype, ft.dtype, fgx.dtype, fgb.dtype) == (y.dtype, t.dtype, gx.dtype, gb.dtype)
    assert [g.dtype for g in fgc + fgg] == [g.dtype for g in gc + gg]


def test_op_refuses_mixed_16bit_types():
    layer = _layer(64, 48, 4, True, torch.float16)
    x = torch.randn(10, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="core 0"):
        torch.ops.comera.tt_linear(x, list(layer.cores), list(layer.gates), layer.bias, 3, 48, 0)
    f32 = _layer(64, 48, 4, True, torch.float32)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.comera.tt_linear(x, list(f32.cores), list(f32.gates),
                                   layer.bias.to(torch.bfloat16), 3, 48, 0)


@pytest.mark.parametrize("path", ["merge", "sequential"])
def test_16bit_ignores_the_path(path):
    """The 16-bit kernels have the merge path only (as on CUDA)."""
    layer = _layer(96, 200, [4, 9, 11, 7, 8], True, torch.bfloat16, in_shape=[4, 4, 6],
                   out_shape=[5, 5, 8], path=path)
    auto = _layer(96, 200, [4, 9, 11, 7, 8], True, torch.bfloat16, in_shape=[4, 4, 6],
                  out_shape=[5, 5, 8])
    x = torch.randn(7, 96).to(torch.bfloat16)
    assert torch.equal(layer(x), auto(x))
    assert layer.plan(7)["path"] == "merge"


def test_plan_names_the_kernel_and_predicts_a_time():
    layer = comera.TTLinear(768, 3072, rank=30)
    f32 = layer.plan(4096)
    bf16 = layer.plan(4096, torch.bfloat16)
    assert f32["kernel"] in KERNELS and bf16["kernel"] in KERNELS
    assert f32["kernel"] == torch.ops.comera.cpu_isa()
    assert f32["dtype"] == "float32" and bf16["dtype"] == "bfloat16"
    assert 0 < bf16["seconds"] and 0 < f32["seconds"]
    assert bf16["merge"]["bytes"] < f32["merge"]["bytes"]  # 2-byte activations
    with torch.autocast("cpu"):
        assert layer.plan(4096)["dtype"] == "bfloat16"
    assert layer.to(torch.float16).plan(4096)["dtype"] == "float16"
