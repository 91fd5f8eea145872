"""RankAdaptive and the fused gate proximal step (comera::gate_prox_).

References: a per-entry Python transcription of the rule of the C kernel
(csrc/gate_prox/cpu.c), the textbook proximal gradient step
(soft-threshold) for plain SGD, a teacher layer of known ranks, and the
size formula S = sum_k r_{k-1} n_k r_k evaluated by hand."""
import io
import math
import warnings

import pytest
import torch
from torch import nn

import comera
from comera.ops import gate_prox as gate_prox_module


# --------------------------------------------------------------- the kernel
def _prox_reference(g, s, threshold, min_live, kill):
    """The rule of the C kernel, entry by entry in plain Python."""
    g, s = [float(v) for v in g], [int(v) for v in s]
    sgn = [(v > 0) - (v < 0) for v in g]
    if not kill:
        for i in range(len(g)):
            if s[i] == 0:
                g[i] = 0.0
            elif sgn[i] != 0:
                s[i] = sgn[i]
        return g, s, sum(v != 0 for v in s)
    doomed = [s[i] != 0 and (abs(g[i]) <= threshold or sgn[i] != s[i]) for i in range(len(g))]
    live = sum(s[i] != 0 and not doomed[i] for i in range(len(g)))
    rescue = sorted((i for i in range(len(g)) if doomed[i] and g[i] != 0), key=lambda i: -abs(g[i]))
    for i in rescue[:max(0, min_live - live)]:
        doomed[i] = False
    for i in range(len(g)):
        if s[i] == 0 or doomed[i]:
            g[i], s[i] = 0.0, 0
        else:
            s[i] = sgn[i]
    return g, s, sum(v != 0 for v in s)


def _random_gates(sizes, dtype, gen):
    gates, signs = [], []
    for n in sizes:
        g = torch.randn(n, dtype=dtype, generator=gen) * 0.05
        s = torch.sign(torch.randn(n, generator=gen)).to(torch.int8)  # some crossed zero
        s[torch.rand(n, generator=gen) < 0.2] = 0  # some dead already
        gates.append(g)
        signs.append(s)
    return gates, signs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kill", [True, False])
@pytest.mark.parametrize("min_live", [0, 1, 3])
def test_gate_prox_matches_reference(dtype, kill, min_live):
    gen = torch.Generator().manual_seed(7)
    sizes = [0, 1, 5, 16, 40]
    gates, signs = _random_gates(sizes, dtype, gen)
    expect = [_prox_reference(g.tolist(), s.tolist(), 0.03, min_live, kill)
              for g, s in zip(gates, signs)]
    live = comera.ops.gate_prox_(gates, signs, 0.03, min_live, kill)
    assert live.dtype == torch.int64
    assert live.tolist() == [e[2] for e in expect]
    for g, s, (eg, es, _) in zip(gates, signs, expect):
        assert g.tolist() == [float(torch.tensor(v, dtype=dtype)) for v in eg]
        assert s.tolist() == es


@pytest.mark.parametrize("kill", [True, False])
def test_gate_prox_without_a_kernel_goes_through_the_cpu(monkeypatch, kill):
    """Gates on a device with no comera kernel are stepped by the C kernel on
    CPU copies and written back: same result as the reference; a NaN changes
    nothing."""
    monkeypatch.setattr(gate_prox_module, "_has_kernel", lambda device, dtype: False)
    gen = torch.Generator().manual_seed(11)
    gates, signs = _random_gates([0, 3, 9, 20], torch.float32, gen)
    expect = [_prox_reference(g.tolist(), s.tolist(), 0.03, 2, kill) for g, s in zip(gates, signs)]
    live = comera.ops.gate_prox_(gates, signs, 0.03, 2, kill)
    assert live.tolist() == [e[2] for e in expect]
    for g, s, (eg, es, _) in zip(gates, signs, expect):
        assert g.tolist() == [float(torch.tensor(v)) for v in eg] and s.tolist() == es
    gates = [torch.tensor([0.5, 1e-5]), torch.tensor([float("nan"), 1e-5])]
    signs = [torch.ones(2, dtype=torch.int8), torch.ones(2, dtype=torch.int8)]
    assert comera.ops.gate_prox_(gates, signs, 1e-3, 1, kill).tolist() == [0, -1]
    assert gates[0].tolist() == [0.5, torch.tensor(1e-5).item()]
    assert all(bool((s == 1).all()) for s in signs)


def test_gate_prox_many_entries_uses_threads_and_agrees():
    # over the kernel's parallel cut-off (32768 entries in total)
    gen = torch.Generator().manual_seed(3)
    gates, signs = _random_gates([5000] * 10, torch.float32, gen)
    expect = [_prox_reference(g.tolist(), s.tolist(), 0.02, 1, True) for g, s in zip(gates, signs)]
    live = comera.ops.gate_prox_(gates, signs, 0.02)
    assert live.tolist() == [e[2] for e in expect]
    for g, (eg, _, _) in zip(gates, expect):
        assert torch.equal(g, torch.tensor(eg, dtype=torch.float32))


def test_gate_prox_nan_changes_nothing_and_reports_the_gate():
    gates = [torch.tensor([0.5, 1e-5]), torch.tensor([float("nan"), 1e-5]), torch.tensor([1e-5])]
    signs = [torch.ones(2, dtype=torch.int8), torch.ones(2, dtype=torch.int8),
             torch.ones(1, dtype=torch.int8)]
    before = [g.clone() for g in gates]
    live = comera.ops.gate_prox_(gates, signs, 1e-3)
    assert live.tolist() == [0, -1, 0]
    for g, b in zip(gates, before):
        assert torch.equal(g, b) or (torch.isnan(g).any() and torch.equal(g[1:], b[1:]))
    assert all(bool((s == 1).all()) for s in signs)


def test_gate_prox_mixed_dtypes_and_nan_in_one_group():
    g32, g64 = torch.tensor([0.5, 1e-5]), torch.tensor([1e-5, -0.3], dtype=torch.float64)
    s32, s64 = torch.ones(2, dtype=torch.int8), torch.ones(2, dtype=torch.int8)
    assert comera.ops.gate_prox_([g32, g64], [s32, s64], 1e-3).tolist() == [1, 1]
    assert g32.tolist() == [0.5, 0.0] and s32.tolist() == [1, 0]
    # both float64 entries are doomed (dead zone, sign change); min_live keeps the larger
    assert g64.tolist() == [0.0, -0.3] and s64.tolist() == [0, -1]
    # a NaN in the float64 group leaves the float32 group untouched too
    g32, g64 = torch.tensor([0.5, 1e-5]), torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    s32, s64 = torch.ones(2, dtype=torch.int8), torch.ones(2, dtype=torch.int8)
    assert comera.ops.gate_prox_([g32, g64], [s32, s64], 1e-3).tolist() == [0, -1]
    assert g32.tolist() == [0.5, torch.tensor(1e-5).item()] and s32.tolist() == [1, 1]


def test_gate_prox_argument_errors():
    g, s = torch.ones(3), torch.ones(3, dtype=torch.int8)
    with pytest.raises(ValueError, match="2 gates but 1 sign"):
        comera.ops.gate_prox_([g, g], [s], 0.1)
    with pytest.raises(RuntimeError, match="signs\\[0\\] must be a contiguous int8"):
        comera.ops.gate_prox_([g], [torch.ones(3)], 0.1)
    with pytest.raises(RuntimeError, match="shape \\(3,\\)"):
        comera.ops.gate_prox_([g], [torch.ones(2, dtype=torch.int8)], 0.1)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        comera.ops.gate_prox_([torch.ones(3, dtype=torch.int32)], [s], 0.1)
    with pytest.raises(RuntimeError, match="threshold must not be NaN"):
        comera.ops.gate_prox_([g], [s], float("nan"))
    with pytest.raises(RuntimeError, match="min_live must be >= 0"):
        comera.ops.gate_prox_([g], [s], 0.1, min_live=-1)


def test_gate_prox_opcheck():
    gen = torch.Generator().manual_seed(0)
    gates, signs = _random_gates([4, 7], torch.float32, gen)
    torch.library.opcheck(torch.ops.comera.gate_prox_.default, (gates, signs, 0.02, 1, True))


# ----------------------------------------------------- the prox step in use
def test_prox_step_is_the_proximal_gradient_step_for_sgd():
    """SGD on the task, then ra.step(), equals the textbook proximal step
    S_{lr gamma}(g - lr grad_task) on every entry the task gradient alone
    does not carry across zero: the L1 step is decoupled from the optimizer."""
    torch.manual_seed(0)
    lr, gamma = 0.1, 0.5
    layer = comera.TTLinear(12, 8, rank=6, in_shape=[3, 4], out_shape=[2, 4], dtype=torch.float64)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(-0.2, 0.2)  # several entries within lr*gamma = 0.05 of zero
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    ra = comera.RankAdaptive(layer, gamma=gamma, threshold=0.0, stage1_steps=10, stage2_steps=0,
                             balance=False)
    x, y = torch.randn(16, 12, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)

    task = (layer(x) - y).pow(2).mean()
    task_grads = torch.autograd.grad(task, list(layer.gates))
    old = [g.detach().clone() for g in layer.gates]
    u = [o - lr * tg for o, tg in zip(old, task_grads)]
    prox = [torch.sign(v) * torch.clamp(v.abs() - lr * gamma, min=0) for v in u]

    opt.zero_grad()
    ((layer(x) - y).pow(2).mean() + ra.penalty()).backward()  # penalty(): 0, kept for old loops
    opt.step()
    ra.step(opt)
    checked = died = 0
    for g, o, v, p in zip(layer.gates, old, u, prox):
        same_side = torch.sign(v) == torch.sign(o)
        torch.testing.assert_close(g.detach()[same_side], p[same_side], rtol=0, atol=1e-12)
        checked += int(same_side.sum())
        died += int((p[same_side] == 0).sum())
    assert checked >= 12 and died >= 3  # the test covers both kinds of entries


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_stage1_kills_an_unused_rank_at_the_documented_rate(opt_name):
    """Units of gamma: a gate entry with no gradient pull loses lr * gamma per
    step under any optimizer, so from |g| = 1 it dies after ceil(1 / (lr gamma))
    steps."""
    torch.manual_seed(0)
    lr, gamma = 0.05, 0.4          # 1 / (lr gamma) = 50 steps
    layer = comera.TTLinear(16, 16, rank=4, in_shape=[4, 4], out_shape=[4, 4], bias=False)
    ra = comera.RankAdaptive(layer, gamma=gamma, threshold=1e-5, stage1_steps=1000,
                             stage2_steps=0, balance=False)
    with torch.no_grad():
        layer.gates[1].copy_(torch.tensor([1.0, 1.0, 1.0, 3.0]))  # min_rank keeps one alive
    opt = (torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW)(
        [{"params": [layer.gates[1]], "lr": lr}], lr=lr, **({"weight_decay": 0.0} if opt_name == "adamw" else {}))
    died_at = None
    for step in range(1, 80):
        opt.zero_grad()           # no gradient at all: only the decoupled L1 step acts
        opt.step()
        ra.step(opt)
        if died_at is None and int((layer.gates[1].detach() == 0).sum()) == 3:
            died_at = step
    assert died_at == math.ceil(1 / (lr * gamma) - 1e-9), died_at


def test_stage1_discovers_ranks_under_sgd_and_adamw():
    """With a task that needs rank 1 on the middle bond, stage 1 kills ranks under
    both SGD and AdamW, and never the last one."""
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.05), lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
        torch.manual_seed(0)
        teacher = _teacher([1, 1, 1, 1, 1], seed=3)
        student = comera.TTLinear(64, 64, bias=False, rank=6, in_shape=[4, 4, 4], out_shape=[4, 4, 4])
        opt = make(student.parameters())
        ra = comera.RankAdaptive(student, gamma=0.5, threshold=1e-2, stage1_steps=300,
                                 stage2_steps=0).attach(opt)
        start = sum(student.live_ranks())
        for _ in range(300):
            x = torch.randn(32, 64)
            loss = (student(x) - teacher(x).detach()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sum(student.live_ranks()) <= 0.6 * start, student.live_ranks()
        assert min(student.live_ranks()) >= 1


def test_dead_entries_stay_exactly_zero_under_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(comera.TTLinear(32, 32, rank=8), nn.Tanh(), comera.TTLinear(32, 16, rank=8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    ra = comera.RankAdaptive(model, gamma=0.5, threshold=2e-2, stage1_steps=120, stage2_steps=0)
    dead_seen = set()
    for _ in range(120):
        x = torch.randn(32, 32)
        loss = (model(x) - torch.sin(x[:, :16])).pow(2).mean() + ra.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ra.step(opt)
        dead_now = {(li, k, j) for li in (0, 2) for k, g in enumerate(model[li].gates)
                    for j in torch.nonzero(g.detach() == 0).flatten().tolist()}
        assert dead_seen <= dead_now  # nothing came back to life
        dead_seen = dead_now
    assert len(dead_seen) >= 5  # the penalty did kill ranks
    assert all(min(layer.live_ranks()) >= 1 for layer in (model[0], model[2]))


def test_penalty_is_zero_and_strength_follows_the_stage():
    layer = comera.TTLinear(24, 16, rank=4)
    ra = comera.RankAdaptive(layer, gamma=0.3, threshold=0.0, stage1_steps=1, stage2_steps=1)
    assert float(ra.penalty()) == 0.0          # the L1 pull is the decoupled step now
    assert ra.shrink_strength() == [0.3] * len(layer.gates)
    ra.step()
    assert ra.stage == 2 and ra.frozen  # no target: stage 2 fine-tunes with frozen ranks
    assert ra.shrink_strength() == [0.0] * len(layer.gates)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_balance_keeps_the_function_and_normalises_the_gates(kind):
    torch.manual_seed(0)
    if kind == "linear":
        layer = comera.TTLinear(64, 48, rank=6, dtype=torch.float64)
        x = torch.randn(5, 64, dtype=torch.float64)
    else:
        layer = comera.TTEmbedding(200, 32, rank=6, dtype=torch.float64)
        x = torch.randint(0, 200, (7,))
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.1, 3.0)
        layer.gates[0][1] = 0.0            # a dead rank stays dead
    y = layer(x)
    live = layer.live_ranks()
    assert comera.adapt.rank_adaptive.balance_(layer)
    torch.testing.assert_close(layer(x), y, rtol=1e-9, atol=1e-10)
    assert layer.live_ranks() == live
    for g in layer.gates:
        assert float(g.detach().max()) == pytest.approx(1.0) and float(g.detach().min()) >= 0
    # the cores on the left of each bond are left-orthonormal once the gates are put back
    c0 = layer.cores[0].detach().reshape(-1, layer.cores[0].shape[-1])
    c0 = c0[:, layer.gates[0].detach() != 0]
    torch.testing.assert_close(c0.T @ c0, torch.eye(c0.shape[1], dtype=c0.dtype), atol=1e-9, rtol=0)


# ------------------------------------------------ (a) rank recovery
def _teacher(true_ranks, seed):
    torch.manual_seed(seed)
    teacher = comera.TTLinear(64, 64, bias=False, rank=true_ranks,
                              in_shape=[4, 4, 4], out_shape=[4, 4, 4])
    with torch.no_grad():
        for c in teacher.cores:
            c.normal_()
        scale = teacher.weight.std() * math.sqrt(64)  # outputs of unit variance
        for c in teacher.cores:
            c.div_(scale ** (1 / len(teacher.cores)))
    return teacher


def test_rank_recovery_from_a_teacher():
    true = [2, 3, 3, 3, 2]
    teacher = _teacher(true, seed=1)
    torch.manual_seed(1)
    student = comera.TTLinear(64, 64, bias=False, rank=16, in_shape=[4, 4, 4], out_shape=[4, 4, 4])
    assert student.ranks == [4, 16, 16, 16, 4]
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2, weight_decay=0.0)
    ra = comera.RankAdaptive(student, gamma=0.5, threshold=1e-2, stage1_steps=800,
                             stage2_steps=200, prune_every=100)
    first = None
    for _ in range(1000):
        x = torch.randn(64, 64)
        with torch.no_grad():
            y = teacher(x)
        task = (student(x) - y).pow(2).mean()
        first = task.item() if first is None else first
        opt.zero_grad()
        (task + ra.penalty()).backward()
        opt.step()
        ra.step(opt)
    x = torch.randn(512, 64)
    with torch.no_grad():
        final = (student(x) - teacher(x)).pow(2).mean().item()
    live = student.live_ranks()
    assert all(r <= t + 1 for r, t in zip(live, true)), (live, true)
    assert student.ranks == live  # pruned physically (prune_every)
    assert final < 1e-3 * first, (final, first)


# -------------------------------------------- (b) target compression
def _mlp():
    return nn.Sequential(comera.TTLinear(64, 128, rank=12), nn.Tanh(),
                         comera.TTLinear(128, 64, rank=12))


def _size_by_hand(model):
    total = 0
    for layer in (model[0], model[2]):
        r = [1] + layer.live_ranks() + [1]
        dims = layer.in_shape + layer.out_shape
        total += sum(r[k] * dims[k] * r[k + 1] for k in range(len(dims)))
    return total


@pytest.mark.parametrize("target,prune_every", [(25.0, None), (60.0, 7)])
def test_target_compression_is_reached_and_kept(target, prune_every):
    torch.manual_seed(0)
    model = _mlp()
    dense = 64 * 128 * 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ra = comera.RankAdaptive(model, gamma=1e-3, threshold=1e-3, stage1_steps=20, stage2_steps=80,
                             target_compression=target, prune_every=prune_every)
    start = comera.compression(model)
    assert start < target
    history = []
    for _ in range(100):
        x = torch.randn(32, 64)
        loss = (model(x) - torch.tanh(x)).pow(2).mean() + ra.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ra.step(opt)
        history.append((ra.stage, ra.frozen, ra.compression()))
        assert history[-1][2] <= target * 1.05  # at most 5% beyond the target (ranks die whole)
    final = dense / _size_by_hand(model)
    assert ra.compression() == pytest.approx(final) == pytest.approx(comera.compression(model))
    assert abs(final / target - 1) <= 0.05, final
    assert ra.frozen and ra.stage == 2
    frozen_at = next(i for i, h in enumerate(history) if h[1])
    assert frozen_at < 100 - 20  # reached during the first part of stage 2 ...
    assert all(h[2] == history[-1][2] for h in history[frozen_at:])  # ... and kept
    if prune_every:
        comera.prune(model, opt)
        assert sum(layer.tt_params() for layer in (model[0], model[2])) == _size_by_hand(model)


def test_stage1_never_overshoots_the_target():
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # a brutal dead zone that alone would kill most ranks in one step
    ra = comera.RankAdaptive(model, gamma=0.0, threshold=0.7, stage1_steps=5, stage2_steps=5,
                             target_compression=20.0)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            for g in layer.gates:
                g.uniform_(0.0, 1.0)
    x = torch.randn(8, 64)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    ra.step(opt)
    c = ra.compression()
    assert 20.0 <= c <= 20.0 * 1.05 and ra.frozen


# ------------------------------------------------- resume from a checkpoint
def test_resume_continues_in_the_same_stage_and_trajectory():
    def make():
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ra = comera.RankAdaptive(model, gamma=1e-3, threshold=1e-3, stage1_steps=10,
                                 stage2_steps=40, target_compression=30.0, prune_every=5)
        return model, opt, ra

    def run(model, opt, ra, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(16, 64, generator=gen)
            loss = (model(x) - torch.tanh(x)).pow(2).mean() + ra.penalty()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ra.step(opt)

    model, opt, ra = make()
    run(model, opt, ra, 15, seed=1)
    assert ra.stage == 2 and not ra.frozen
    buf = io.BytesIO()  # through torch.save, as a checkpoint file would be
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "ra": ra.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    run(model, opt, ra, 20, seed=2)

    model2, opt2, ra2 = make()  # fresh, unpruned, other initial values
    comera.load_state_dict(model2, saved["model"])
    opt2.load_state_dict(saved["opt"])
    ra2.load_state_dict(saved["ra"])
    assert ra2.stage == 2 and ra2.steps == 15
    run(model2, opt2, ra2, 20, seed=2)
    assert ra2.frozen == ra.frozen and ra2.compression() == ra.compression()
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ----------------------------------------------- (f) arguments, no TT layers
@pytest.mark.parametrize("kwargs,match", [
    ({"gamma": -0.1}, "gamma must be a finite number >= 0"),
    ({"gamma": float("nan")}, "gamma must be a finite number"),
    ({"threshold": -1e-3}, "threshold must be a finite number >= 0"),
    ({"target_compression": 1.0}, "target_compression must be a finite number > 1"),
    ({"target_compression": 0.5}, "target_compression must be a finite number > 1"),
    ({"target_compression": float("inf")}, "target_compression must be a finite number"),
    ({"stage1_steps": -1}, "stage1_steps must be >= 0"),
    ({"prune_every": 0}, "prune_every must be >= 1"),
    ({"min_rank": 0}, "min_rank must be >= 1"),
    ({"target_compression": 10.0, "stage2_steps": 0}, "stage2_steps must be >= 1"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(gamma=1e-3, threshold=1e-3, stage1_steps=10, stage2_steps=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        comera.RankAdaptive(comera.TTLinear(8, 8, rank=2), **args)


def test_bad_argument_types_raise_type_error():
    layer = comera.TTLinear(8, 8, rank=2)
    with pytest.raises(TypeError, match="stage1_steps must be an int"):
        comera.RankAdaptive(layer, gamma=0.1, threshold=0.1, stage1_steps=1.5, stage2_steps=1)
    with pytest.raises(TypeError, match="gamma must be a number"):
        comera.RankAdaptive(layer, gamma="0.1", threshold=0.1, stage1_steps=1, stage2_steps=1)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        comera.RankAdaptive([layer], gamma=0.1, threshold=0.1, stage1_steps=1, stage2_steps=1)
    ra = comera.RankAdaptive(layer, gamma=0.1, threshold=0.1, stage1_steps=1, stage2_steps=1,
                             prune_every=2)
    with pytest.raises(TypeError, match="pass the optimizer"):
        ra.step()


def test_model_without_tt_layers_warns_once_and_does_nothing():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ra = comera.RankAdaptive(model, gamma=0.1, threshold=0.1, stage1_steps=2, stage2_steps=2,
                                 target_compression=4.0, prune_every=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            assert float(ra.penalty()) == 0.0
            ra.step(opt)
        assert ra.compression() == 1.0 and comera.compression(model) == 1.0
    assert len(caught) == 1 and "no TT layers" in str(caught[0].message)
    assert ra.stage == 2 and ra.steps == 5
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_nan_gate_raises_naming_the_layer():
    model = nn.Sequential(comera.TTLinear(16, 16, rank=4), nn.ReLU(),
                          nn.Sequential(comera.TTLinear(16, 8, rank=4)))
    ra = comera.RankAdaptive(model, gamma=0.1, threshold=0.5, stage1_steps=5, stage2_steps=5)
    with torch.no_grad():
        model[2][0].gates[1][2] = float("nan")
        model[0].gates[0][0] = 1e-3  # inside the dead zone, but must survive the failed step
    with pytest.raises(ValueError, match=r"gate 1 of layer '2\.0' contains NaN"):
        ra.step()
    assert model[0].gates[0][0].item() == torch.tensor(1e-3).item()
    assert ra.steps == 0


def test_defaults_construct_and_step():
    """RankAdaptive(model) alone: the documented defaults, and it trains."""
    torch.manual_seed(0)
    layer = comera.TTLinear(16, 16, rank=4)
    ra = comera.RankAdaptive(layer)
    assert (ra.gamma, ra.threshold, ra.stage1_steps, ra.stage2_steps) == (0.5, 1e-2, 1000, 1000)
    assert (ra.target_compression, ra.prune_every, ra.min_rank, ra.stage2_rule) == \
        (None, None, 1, "saliency")
    assert ra.balance and ra.sync_free is None
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    ra.attach(opt)
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    assert ra.steps == 3 and ra.stage == 1 and not ra.frozen
    assert ra.shrink_strength() == [0.5] * len(layer.gates)
    assert ra.compression() == pytest.approx(comera.compression(layer))
