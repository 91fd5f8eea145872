"""Routing of TT linear calls to torch's BLAS (comera.ops.route): the torch
way matches the C kernels, the choice is measured once per key and cached,
visible in plan(), and never made where it must not be."""
import os
import subprocess
import sys

import pytest
import torch

import comera
from comera.ops import linear as linear_op, route


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Routing on (it is opt-in), nothing cached, and no call served by a
    layer's merged V and U (those small calls never reach the routing)."""
    monkeypatch.setattr(linear_op, "CACHED_MACS", -1)
    previous = route.set_mode("auto")
    route.clear()
    yield
    route.set_mode(previous)
    route.clear()


def test_off_by_default(monkeypatch):
    route.set_mode("comera")
    monkeypatch.setattr(route, "MIN_FLOPS", 0.0)
    layer = comera.TTLinear(64, 96, rank=6)
    y = layer(torch.randn(40, 64, requires_grad=True))
    assert route.choices() == {} and not _uses_torch(y)
    r = layer.plan(40)["route"]
    assert r["choice"] == "comera" and "opt-in" in r["why"]


def _uses_torch(y):
    """Whether y's graph holds torch's addmm (the routed way)."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "Addmm" in type(fn).__name__:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _run(layer, x):
    layer.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_()
    y = layer(xx)
    y.pow(2).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    return y.detach(), xx.grad, grads


@pytest.mark.parametrize("shape", [(48, 20, 4), (30, 64, 6), (64, 64, 8)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(9,), (2, 5)])
def test_torch_way_matches_the_c_kernels(monkeypatch, shape, bias, lead):
    in_f, out_f, rank = shape
    layer = comera.TTLinear(in_f, out_f, bias=bias, rank=rank)
    x = torch.randn(*lead, in_f)
    route.set_mode("comera")
    y_c, gx_c, g_c = _run(layer, x)
    route.set_mode("torch")
    y_t, gx_t, g_t = _run(layer, x)
    assert y_t.shape == y_c.shape == (*lead, out_f)
    torch.testing.assert_close(y_t, y_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_t, gx_c, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_t, g_c):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_forced_torch_way_runs_torch_ops(monkeypatch):
    layer = comera.TTLinear(32, 16, rank=4)
    x = torch.randn(5, 32)
    route.set_mode("torch")
    assert _uses_torch(layer(x))
    route.set_mode("comera")
    assert not _uses_torch(layer(x))


def test_small_calls_are_never_timed():
    layer = comera.TTLinear(64, 64, rank=4)
    layer(torch.randn(8, 64))
    assert route.choices() == {}
    r = layer.plan(8)["route"]
    assert r["choice"] == "comera" and "MIN_FLOPS" in r["why"]


@pytest.mark.parametrize("grad", [True, False])
def test_large_call_is_timed_once_and_cached(monkeypatch, grad):
    monkeypatch.setattr(route, "MIN_FLOPS", 0.0)
    layer = comera.TTLinear(64, 96, rank=6)
    x = torch.randn(40, 64)
    assert layer.plan(40)["route"]["choice"] == "not timed yet"
    with torch.set_grad_enabled(grad):
        y1 = layer(x)
        entries = route.choices()
        assert len(entries) == 1
        (key, hit), = entries.items()
        assert hit["choice"] in ("comera", "torch")
        assert hit["comera_s"] > 0 and hit["torch_s"] > 0
        assert hit["choice"] == ("torch" if hit["torch_s"] < hit["comera_s"] else "comera")
        y2 = layer(torch.randn(33, 64))     # 33 and 40 rows share the bucket of 64
        assert route.choices() == entries
    r = layer.plan(40)["route"]
    assert r["choice"] == hit["choice"]
    assert r["training" if grad else "inference"]["comera_s"] == hit["comera_s"]
    route.set_mode("comera")
    torch.testing.assert_close(y1, layer(x), rtol=1e-5, atol=1e-5)
    assert y2.shape == (33, 96)


def test_cached_choice_is_followed(monkeypatch):
    monkeypatch.setattr(route, "MIN_FLOPS", 0.0)
    layer = comera.TTLinear(64, 96, rank=6)
    x = torch.randn(40, 64, requires_grad=True)
    layer(x)
    key, = route.choices()
    for choice, torch_ops in (("torch", True), ("comera", False)):
        route._choices[key] = {"choice": choice, "comera_s": 1.0, "torch_s": 1.0}
        assert _uses_torch(layer(x)) == torch_ops


def test_never_routed_where_it_must_not_be(monkeypatch):
    monkeypatch.setattr(route, "MIN_FLOPS", 0.0)
    x = torch.randn(40, 64)
    fixed = comera.TTLinear(64, 96, rank=6, path="merge")
    fixed(x)
    assert fixed.plan(40)["route"]["why"] == "path='merge'"
    comera.TTLinear(64, 96, rank=6, dtype=torch.float64)(x.double())
    with torch.autocast("cpu"):
        comera.TTLinear(64, 96, rank=6)(x)
    assert route.choices() == {}


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_compiled_calls_keep_the_c_kernel(monkeypatch, mode):
    monkeypatch.setattr(route, "MIN_FLOPS", 0.0)
    route.set_mode(mode)
    layer = comera.TTLinear(64, 96, rank=6)
    x = torch.randn(40, 64)
    y = torch.compile(layer, backend="eager", fullgraph=True)(x)
    assert route.choices() == {}
    route.set_mode("comera")
    torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-5)


def test_bad_mode_names_the_argument():
    with pytest.raises(ValueError, match="mode must be one of auto, comera, torch, got 'fast'"):
        route.set_mode("fast")
    assert route.mode() == "auto"


def test_bad_environment_value_names_the_variable():
    env = dict(os.environ, COMERA_ROUTE="fast")
    run = subprocess.run([sys.executable, "-c", "import comera"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0
    assert "COMERA_ROUTE must be one of auto, comera, torch, got 'fast'" in run.stderr


def test_mode_is_read_once_not_per_call(monkeypatch):
    route.set_mode("comera")
    monkeypatch.setenv(route.ENV, "torch")  # after import: no effect
    layer = comera.TTLinear(32, 16, rank=4)
    assert not _uses_torch(layer(torch.randn(5, 32)))
