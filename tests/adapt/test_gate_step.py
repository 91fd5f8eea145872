"""The fused gate step (comera::gate_step_, comera.ops.gate_step_) against the
tensor code of GateStep it replaces, bit for bit: random gates (ties, dead
and flipped entries, NaN, gates without gradient, min_rank rescues, frozen
ranks, kill on and off, both stages), whole RankAdaptive trainings, the
operator's opcheck, and how many operators a stage-1 step dispatches."""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import comera
from comera.adapt.controller import RankController
from comera.adapt.gates import FlatGates
from comera.adapt.state import ControllerState
from comera.adapt.step import GateStep
from comera.ops.gate_step import has_gate_step_kernel

VALUES = [0.0, 0.25, -0.25, 0.5, -0.5, 0.3, 1e-3, -2e-3, 0.05, -0.07, 1.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaN == NaN, 0.0 != -0.0)."""
    return t.view({1: torch.int8, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
                                    for x, y in zip(a, b))


def _case(draw_sizes, rng, dtype, nan_gate, no_grad):
    gates, signs = [], []
    for k, n in enumerate(draw_sizes):
        idx = torch.randint(len(VALUES), (n,), generator=rng)
        g = torch.tensor([VALUES[i] for i in idx.tolist()], dtype=dtype)
        g = g * torch.where(torch.rand(n, generator=rng) < 0.5, 1.0, 1.1).to(dtype)
        s = torch.sign(g).to(torch.int8)
        flip = torch.rand(n, generator=rng)
        s = torch.where(flip < 0.15, torch.zeros_like(s), s)          # dead entries
        s = torch.where((flip > 0.9) & (s != 0), -s, s)              # sign flipped since
        p = torch.nn.Parameter(g)
        if k not in no_grad:
            p.grad = torch.randn(n, generator=rng).to(dtype)
        gates.append(p)
        signs.append(s)
    if nan_gate is not None and nan_gate < len(gates) and draw_sizes[nan_gate]:
        with torch.no_grad():
            gates[nan_gate][0] = float("nan")
    return gates, signs


def _state(gates, signs, rng, frozen, nan_seen):
    state = ControllerState.for_gates(gates)
    state.signs = [s.to(g.device) for s, g in zip(signs, gates)]
    state.saliency = [torch.rand(g.numel(), generator=rng, dtype=torch.float64).to(g.device)
                      for g in gates]
    state.frozen.fill_(frozen)
    state.nan_seen.fill_(nan_seen)
    return state


def _compare(sizes, seed, dtype, stage, target, frozen, nan_gate, nan_seen, no_grad, min_rank,
             gamma, lr, sync, threshold, device=torch.device("cpu")):
    """One GateStep.run through the operator and through the tensor code, on
    copies of the same random gates and state: the same bits everywhere."""
    rng = torch.Generator().manual_seed(seed)
    made, signs = _case(sizes, rng, dtype, nan_gate, no_grad)
    gates = [torch.nn.Parameter(g.detach().to(device)) for g in made]
    for g, g0 in zip(gates, made):
        g.grad = None if g0.grad is None else g0.grad.to(device)
    state = _state(gates, signs, rng, frozen, nan_seen)
    state.step = 2 if stage == 1 else 5
    # one bond per gate: a two-core layer each
    ctl = RankController([[2, 3]] * len(gates), gamma=gamma, stage1_steps=4, stage2_steps=8,
                         target_size=(3.0 * sum(sizes) if target else None), min_rank=min_rank)
    rates = (torch.rand(len(gates), generator=rng, dtype=torch.float64) * 0.5).to(device) \
        if lr else None
    fg = FlatGates(sizes, device)
    results = []
    for fused in (True, False):
        gs = [torch.nn.Parameter(g.detach().clone()) for g in gates]
        for g, g0 in zip(gs, gates):
            g.grad = None if g0.grad is None else g0.grad.clone()
        st_ = copy.deepcopy(state)
        step = GateStep(ctl, [], threshold=threshold, rule="saliency")
        step.fused = fused
        assert step.fits_fused(st_, fg, gs, rates)
        step.nan_error = lambda bad, deferred=False: ValueError(bad)
        try:
            step.run(st_, fg, gs, rates, sync=sync)
            raised = None
        except ValueError as e:
            raised = e.args
        results.append((raised, [g.detach() for g in gs], st_))
    (r1, g1, s1), (r2, g2, s2) = results
    assert r1 == r2
    assert _same(g1, g2)
    assert _same(s1.signs, s2.signs)
    assert _same(s1.saliency, s2.saliency)
    for name in ControllerState._SCALARS:
        assert _same([getattr(s1, name)], [getattr(s2, name)]), name


CASES = dict(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=7),
             seed=st.integers(0, 2 ** 31 - 1), stage=st.sampled_from([1, 2]),
             target=st.booleans(), frozen=st.booleans(),
             nan_gate=st.one_of(st.none(), st.integers(0, 6)), nan_seen=st.booleans(),
             no_grad=st.sets(st.integers(0, 6), max_size=3), min_rank=st.integers(1, 3),
             gamma=st.sampled_from([0.0, 0.5, 4.0]), lr=st.booleans(), sync=st.booleans(),
             threshold=st.sampled_from([-1.0, 0.0, 1e-2]))


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64]), **CASES)
def test_fused_step_matches_tensor_step(**case):
    _compare(**case)


CUDA = torch.device("cuda")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_gate_step_kernel(CUDA, torch.float32),
    reason="needs a GPU and comera's CUDA kernels")


@needs_gpu
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), **CASES)
def test_fused_step_matches_tensor_step_on_cuda(**case):
    _compare(device=CUDA, **case)


@needs_gpu
def test_one_launch_for_192_gates():
    """The `paper` preset's 192 gates: one kernel, whatever they hold."""
    gates = [torch.randn(12, device=CUDA) * 0.1 for _ in range(192)]
    args = ([torch.sign(g).to(torch.int8) for g in gates], [torch.randn_like(g) for g in gates],
            [torch.zeros(12, dtype=torch.float64, device=CUDA) for _ in gates])
    amount = torch.full((192,), 0.01, device=CUDA)
    comera.ops.gate_step_(gates, *args, amount, threshold=1e-3)   # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        comera.ops.gate_step_(gates, *args, amount, threshold=1e-3)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "gate_step" in e.name and "kernel" in e.name]
    assert len(names) == 1 and "gate_step_kernel" in names[0], names


def _train(fused, opt_name, steps, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(comera.TTLinear(24, 36, rank=6), torch.nn.ReLU(),
                                comera.TTLinear(36, 8, rank=5)).to(dtype)
    opt = (torch.optim.AdamW(model.parameters(), lr=3e-2) if opt_name == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ra = comera.RankAdaptive(model, **kw)
    ra._gate_step.fused = fused
    ra.attach(opt)
    x = torch.randn(16, 24, dtype=dtype)
    y = torch.randn(16, 8, dtype=dtype)
    for i in range(steps):
        opt.zero_grad()
        if i == 3:  # a step where one layer gets no gradient
            model[2](model[1](model[0](x).detach())).pow(2).mean().backward()
        else:
            (model(x) - y).pow(2).mean().backward()
        opt.step()
    return model, ra


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sync_free", [False, True])
def test_training_fused_matches_tensor_path(opt_name, dtype, sync_free):
    kw = dict(gamma=2.0, threshold=2e-2, stage1_steps=8, stage2_steps=12, target_compression=6.0,
              min_rank=2, prune_every=7, sync_free=sync_free)
    m1, ra1 = _train(True, opt_name, 26, dtype, **kw)
    m2, ra2 = _train(False, opt_name, 26, dtype, **kw)
    assert _same(list(m1.state_dict().values()), list(m2.state_dict().values()))
    assert _same(ra1.state.signs, ra2.state.signs)
    assert _same(ra1.state.saliency, ra2.state.saliency)
    for name in ControllerState._SCALARS:
        assert _same([getattr(ra1.state, name)], [getattr(ra2.state, name)]), name
    assert ra1.compression() > 1.5   # ranks died: the test saw kills and rescues


def test_fused_nan_is_recorded_not_applied():
    layer = comera.TTLinear(16, 16, rank=4, in_shape=[4, 4], out_shape=[4, 4])
    ra = comera.RankAdaptive(layer, stage1_steps=5, sync_free=True)
    layer(torch.randn(2, 16)).sum().backward()
    with torch.no_grad():
        layer.gates[0][1] = float("nan")
    before = [g.detach().clone() for g in layer.gates]
    sal = [a.clone() for a in ra.state.saliency]
    ra.step()
    assert _same([g.detach() for g in layer.gates], before)
    assert _same(ra.state.saliency, sal)
    assert ra.state.nan_gates.tolist() == [True] + [False] * (len(before) - 1)
    with pytest.raises(ValueError, match="gate 0 of layer"):
        ra.check()


def _op_args(dtype=torch.float64):
    g = [torch.tensor([0.5, 0.02, -0.2], dtype=dtype), torch.tensor([0.1, 0.3], dtype=dtype)]
    s = [torch.sign(x).to(torch.int8) for x in g]
    gr = [torch.ones(3, dtype=dtype), torch.empty(0, dtype=dtype)]
    sal = [torch.zeros(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
    return (g, s, gr, sal, torch.tensor([0.05, 0.2], dtype=dtype), torch.tensor(False),
            torch.tensor(False), torch.zeros(2, dtype=torch.bool), 1e-3, 1, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    torch.library.opcheck(torch.ops.comera.gate_step_.default, _op_args(dtype))


def test_op_refuses_bad_arguments():
    g, s, gr, sal, amount, frozen, seen, where, *rest = _op_args()
    with pytest.raises(RuntimeError, match="grads"):
        torch.ops.comera.gate_step_(g, s, [gr[0], torch.ones(3)], sal, amount, frozen, seen,
                                    where, *rest)
    with pytest.raises(RuntimeError, match="amount"):
        torch.ops.comera.gate_step_(g, s, gr, sal, amount[:1], frozen, seen, where, *rest)
    with pytest.raises(RuntimeError, match="saliency"):
        torch.ops.comera.gate_step_(g, s, gr, [a.float() for a in sal], amount, frozen, seen,
                                    where, *rest)
    with pytest.raises(RuntimeError, match="nan_seen"):
        torch.ops.comera.gate_step_(g, s, gr, sal, amount, frozen, seen, None, *rest)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _stage1_ops(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[comera.TTLinear(64, 64, rank=8) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ra = comera.RankAdaptive(model, stage1_steps=10, sync_free=True)
    ra._gate_step.fused = fused
    model(torch.randn(4, 64)).sum().backward()
    ra.step(opt)   # the first step builds the cached layouts
    ra.step_begin()
    with _Count() as count:
        ra.step_gates(opt)
    return count.ops


def test_stage1_step_is_a_handful_of_ops():
    fused, tensor = _stage1_ops(True), _stage1_ops(False)
    assert torch.ops.comera.gate_step_.default in fused
    # lr per gate (one group), the amount and its cast, the step
    assert len(fused) <= 5, fused
    # the tensor code it replaces: 71 operators and a .data (a detach) per gate and use
    assert len([f for f in tensor if f != torch.ops.aten.detach.default]) >= 50, tensor


def test_half_precision_on_cpu_takes_the_tensor_code():
    """No C kernel for bfloat16: the step runs the tensor code (gate_prox_
    through float32 copies), not the operator."""
    layer = comera.TTLinear(16, 16, rank=4, in_shape=[4, 4], out_shape=[4, 4]).bfloat16()
    ra = comera.RankAdaptive(layer, gamma=50.0, stage1_steps=5, balance=False)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 16, dtype=torch.bfloat16)).sum().backward()
    with _Count() as count:
        ra.step(opt)
    assert torch.ops.comera.gate_step_.default not in count.ops
    assert torch.ops.comera.gate_prox_.default in count.ops
    # a shrink of lr * gamma = 5 takes every gate down to its min_rank rescue
    assert [int(torch.count_nonzero(s)) for s in ra.state.signs] == [1] * len(layer.gates)
