"""Calls without gradients that go straight to the CPU kernel
(comera.ops.func.straight_to_kernel): the same numbers as the dispatched
call, and every layer of the dispatcher that would change or watch the call
(modes, autocast, transforms, the profiler, subclasses) still sees it."""
import pytest
import torch
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import comera
from comera.ops.dense import dense_wt
from comera.ops.embedding import dense_lookup
from comera.ops.func import straight_to_kernel


class SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class NoFunctionChange(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Marked(torch.Tensor):
    pass


def _plain():
    return straight_to_kernel(torch.zeros(2, dtype=torch.long), torch.nn.Parameter(torch.ones(2)))


def test_plain_call_goes_straight():
    assert _plain()


@pytest.mark.parametrize("context", ["autocast", "dispatch_mode", "function_mode", "profiler",
                                     "forward_ad"])
def test_any_layer_above_the_kernel_keeps_the_dispatcher(context):
    if context == "autocast":
        ctx = torch.autocast("cpu")
    elif context == "dispatch_mode":
        ctx = SeenOps()
    elif context == "function_mode":
        ctx = NoFunctionChange()
    elif context == "profiler":
        ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    else:
        ctx = forward_ad.dual_level()
    with ctx:
        assert not _plain()
    assert _plain()


def test_jit_tracing_keeps_the_dispatcher():
    seen = []

    def f(x):
        seen.append(_plain())
        return x * 2

    torch.jit.trace(f, torch.ones(2), check_trace=False)
    assert seen == [False]


def test_transforms_and_subclasses_keep_the_dispatcher():
    assert torch.vmap(lambda v: torch.tensor(float(_plain())) + 0 * v)(torch.zeros(3)).sum() == 0
    assert torch.func.functionalize(lambda v: v + float(_plain()))(torch.zeros(1)).item() == 0
    idx = torch.zeros(2, dtype=torch.long).as_subclass(Marked)
    assert not straight_to_kernel(idx, torch.ones(2))
    assert not straight_to_kernel(torch.zeros(2, dtype=torch.long), torch.ones(2).as_subclass(Marked))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tokens", [0, 1, 8, 300])
def test_lookup_without_gradients_matches_the_dispatched_call(dtype, tokens):
    torch.manual_seed(tokens)
    emb = comera.TTEmbedding(1000, 24, rank=4, padding_idx=3, dtype=dtype)
    idx = torch.randint(0, 1000, (tokens,))
    if tokens:
        idx[0] = 3
    want = emb(idx).detach()  # gradients on: the autograd path
    with torch.no_grad():
        got = emb(idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dense = dense_lookup(idx, None, None, [c.detach() for c in emb.cores],
                                    [g.detach() for g in emb.gates], 1000, 24, 3, 0, 0)
    torch.testing.assert_close(got, dense)


def test_lookup_without_gradients_is_seen_by_modes_and_the_profiler():
    emb = comera.TTEmbedding(100, 12, rank=3)
    idx = torch.tensor([1, 5, 7])
    with torch.no_grad():
        with SeenOps() as mode:
            emb(idx)
        assert "comera.tt_embedding.default" in mode.names
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            emb(idx)
    assert any(e.name == "comera::tt_embedding" for e in prof.events())


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_training_calls_are_seen_by_modes_and_the_profiler(kind):
    torch.manual_seed(0)
    if kind == "linear":
        layer, inp, ops = comera.TTLinear(16, 12, rank=3), torch.randn(4, 16), "tt_linear"
    else:
        layer, inp, ops = comera.TTEmbedding(100, 12, rank=3), torch.tensor([1, 5, 7]), "tt_embedding"
    with SeenOps() as mode:
        layer(inp).sum().backward()
    assert {f"comera.{ops}.default", f"comera.{ops}_backward.default"} <= set(mode.names)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(inp).sum().backward()
    names = {e.name for e in prof.events()}
    assert {f"comera::{ops}", f"comera::{ops}_backward"} <= names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_training_step_matches_the_dense_weight(dtype):
    torch.manual_seed(1)
    layer = comera.TTLinear(24, 20, rank=3, dtype=dtype)
    x = torch.randn(5, 24, dtype=dtype, requires_grad=True)
    layer(x).square().sum().backward()
    cores, gates = list(layer.cores), list(layer.gates)
    got = [x.grad] + [p.grad for p in cores + gates] + [layer.bias.grad]
    x2 = x.detach().clone().requires_grad_()
    c2 = [c.detach().clone().requires_grad_() for c in cores]
    g2 = [g.detach().clone().requires_grad_() for g in gates]
    b2 = layer.bias.detach().clone().requires_grad_()
    wt = dense_wt(c2, g2, len(layer.in_shape), 24, 20)  # plain torch ops
    (x2 @ wt + b2).square().sum().backward()
    for g, want in zip(got, [x2.grad] + [p.grad for p in c2 + g2] + [b2.grad]):
        torch.testing.assert_close(g, want)
