"""The captured pre-training step (comera.pretrain.graphed), checked on the CPU:
the fixed-capacity MLM head against the boolean-index one, a graphed run
against the eager Stepper through both rank-adaptive stages and pruning (the
graph stood in by RerunGraph, which replays by running the step again and
checks that no host state changes), and that the captured work never reads
the device (a dispatch mode that fails on every op that would)."""
import json
import os
import shutil
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import comera  # noqa: E402
from comera.__main__ import main  # noqa: E402
from comera.pretrain import graphed  # noqa: E402
from comera.pretrain.graphed import GraphedStepper, RerunGraph, check_capturable  # noqa: E402
from comera.pretrain.loop import (Options, make_capturable, make_optimizer,  # noqa: E402
                                  make_schedule, portable_state)
from comera.pretrain.model import build_comera, preset  # noqa: E402
from comera.pretrain.step import MLMObjective, Stepper, autocast, pack_masked  # noqa: E402
from comera.pretrain import loop  # noqa: E402
from pretrain_tiny import STDLIB, tiny_args  # noqa: E402

CPU = torch.device("cpu")
VOCAB = 300

_aten = torch.ops.aten
READS_DEVICE = {_aten._local_scalar_dense.default, _aten.nonzero.default,
                _aten.masked_select.default, _aten.is_nonzero.default, _aten.equal.default,
                _aten.item.default}


class NoDeviceReads(TorchDispatchMode):
    """Fails on every op that would make the host wait for the device, or
    give a shape that depends on values (boolean indexing).  ``paused``:
    while the optimizer steps (AdamW on the CPU cannot be ``capturable``; on
    CUDA the stepper requires it)."""
    paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        boolean_index = func in (_aten.index.Tensor, _aten.index_put_.default,
                                 _aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if func in READS_DEVICE or boolean_index:
            raise AssertionError(f"{func} reads the device inside a captured step")
        return func(*args, **kwargs)


def _preset():
    p = preset("tiny")
    p.layers, p.hidden, p.heads, p.ffn, p.seq_len = 1, 32, 2, 64, 16
    p.steps, p.warmup, p.batch_size = 24, 0.2, 4
    return p


def _batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(5, VOCAB, (4, 16), generator=g)
        y = torch.where(torch.rand(4, 16, generator=g) < 0.25, x, torch.full_like(x, -100))
        y[:, 0] = x[:, 0]  # never an empty batch
        out.append((x, y))
    return out


def _run(graphed: bool, steps: int, grad_accum: int = 1, precision: str = "fp32"):
    p = _preset()
    model = build_comera(p, VOCAB, seed=0)
    opt = make_optimizer(model, p)
    sched = make_schedule(opt, p)
    ra = comera.RankAdaptive(model, gamma=0.05, threshold=0.05, stage1_steps=6, stage2_steps=10,
                             target_compression=3.0, prune_every=5, sync_free=True)
    make_capturable(opt, CPU)
    torch.manual_seed(1)  # dropout
    if graphed:
        def host():
            return (ra.state.step, ra.capture_key(), len(opt.state))

        detector = NoDeviceReads()
        opt.register_step_pre_hook(lambda *_: setattr(detector, "paused", True))
        opt.register_step_post_hook(lambda *_: setattr(detector, "paused", False))

        def graph():
            inner = RerunGraph(host)
            run = inner.replay

            def replay():
                with detector:
                    run()
            inner.replay = replay
            return inner
        stepper = GraphedStepper(model, opt, device=CPU, controller=ra, graph=graph,
                                 grad_accum=grad_accum, precision=precision, clip=1.0)
    else:
        stepper = Stepper(model, opt, device=CPU, grad_accum=grad_accum, precision=precision,
                          clip=1.0)
        ra.attach(opt)
    losses = []
    for x, y in _batches(steps):
        losses.append(stepper.step(x, y))
        sched.step()
    return losses, model, ra, stepper


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fixed_capacity_head_is_the_boolean_head(precision):
    p = _preset()
    model = build_comera(p, VOCAB, seed=0).eval()
    obj = MLMObjective(model)
    x, y = _batches(1)[0]
    with autocast(CPU, precision):
        ref = obj(x, y)
    ref.backward()
    want = [q.grad.clone() for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    index, targets = pack_masked(y.reshape(1, 4, 16), 64)
    with autocast(CPU, precision):
        got = obj.fixed(x, index[0], targets[0])
    got.backward()
    # bf16: the padded rows change how the products are blocked, so rounding
    rtol, atol = (1e-5, 1e-7) if precision == "fp32" else (3e-2, 2e-3)
    assert torch.allclose(got, ref, rtol=rtol, atol=0)
    for a, b in zip(model.parameters(), want):
        assert torch.allclose(a.grad, b, rtol=rtol, atol=atol)


def test_pack_masked_pads_and_refuses_overflow():
    labels = torch.full((2, 1, 4), -100)
    labels[0, 0, 2], labels[1, 0, :] = 9, 3
    index, targets = pack_masked(labels, 4)
    assert index.tolist() == [[2, 0, 0, 0], [0, 1, 2, 3]]
    assert targets.tolist() == [[9, -100, -100, -100], [3, 3, 3, 3]]
    with pytest.raises(ValueError, match="4 masked positions, more than capacity=3"):
        pack_masked(labels, 3)


def test_the_detector_sees_the_boolean_head():
    """The dispatch mode does catch the eager head's data-dependent shape."""
    obj = MLMObjective(build_comera(_preset(), VOCAB, seed=0))
    x, y = _batches(1)[0]
    with pytest.raises(AssertionError, match="reads the device"), NoDeviceReads():
        obj(x, y)


@pytest.mark.parametrize("grad_accum,precision,inside", [
    (1, "fp32", True), (2, "fp32", True), (1, "bf16", True), (1, "fp32", False)])
def test_graphed_run_matches_eager_through_both_stages_and_pruning(grad_accum, precision, inside,
                                                                    monkeypatch):
    """``inside``: the stage-2 gate step in the graph, or after it (reading
    the device, as for models with many kill rounds)."""
    monkeypatch.setattr(graphed, "GRAPH_KILL_ROUNDS", 10**6 if inside else 0)
    steps = 24
    eager_losses, eager_model, eager_ra, _ = _run(False, steps, grad_accum, precision)
    losses, model, ra, stepper = _run(True, steps, grad_accum, precision)
    assert eager_ra.stage == ra.stage == 2 and ra.frozen
    assert ra.compression() == pytest.approx(eager_ra.compression())
    assert [tuple(q.shape) for q in model.parameters()] == \
        [tuple(q.shape) for q in eager_model.parameters()]
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert losses == pytest.approx(eager_losses, rel=tol)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.allclose(a, b, rtol=tol, atol=tol * 1e-2)
    # one eager step after every change of structure (the stage switch at
    # step 6, the prunes after steps 5, 10, 15 and 20, the frozen schedule),
    # a capture at the next; every other step is a replay
    assert 4 <= stepper.captures <= stepper.eager_steps < steps // 2


def test_evaluation_after_replays_sees_the_new_weights():
    """Replays change parameters behind autograd's version counters; the
    stepper bumps them, so a TTLinear's cached merge is renewed."""
    losses, model, ra, stepper = _run(True, 4)
    layer = next(m for m in model.modules() if isinstance(m, comera.TTLinear))
    x = torch.randn(1, layer.in_features)
    with torch.no_grad():
        cached = layer(x)
    layer.clear_prepared()
    with torch.no_grad():
        fresh = layer(x)
    assert torch.equal(cached, fresh)


def test_float_learning_rate_is_refused():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="lr as a tensor on cpu"):
        check_capturable(opt, CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        GraphedStepper(model, opt, device=CPU)


def test_checkpointed_optimizer_state_is_portable():
    p = _preset()
    model = build_comera(p, VOCAB, seed=0)
    opt = make_optimizer(model, p)
    make_capturable(opt, CPU)
    state = portable_state(opt)
    assert all(type(g["lr"]) is float and not g.get("capturable") for g in state["param_groups"])
    fresh = make_optimizer(build_comera(p, VOCAB, seed=0), p)
    fresh.load_state_dict(state)
    make_capturable(fresh, CPU)
    assert [float(g["lr"]) for g in fresh.param_groups] == [float(g["lr"]) for g in opt.param_groups]


def test_graph_option_is_checked(tmp_path, capsys):
    assert Options().graphed(CPU) is False and Options(graph=False).graphed(CPU) is False
    with pytest.raises(ValueError, match="does not combine with several processes or --fsdp"):
        Options(graph=True, fsdp=True).graphed(CPU)
    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("def f(x):\n    return x + 1\n" * 50)
    out = str(tmp_path / "run")
    assert main(["pretrain", "--graph", "--device", "cpu", "--corpus", str(code), "--out", out,
                 "--steps", "2", *tiny_args()]) == 2
    assert "--graph captures CUDA graphs: it needs a CUDA --device, got cpu" in \
        capsys.readouterr().err


class _Refuses:
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def _model_and_optimizer():
    p = _preset()
    model = build_comera(p, VOCAB, seed=0)
    opt = make_optimizer(model, p)
    make_capturable(opt, CPU)
    return model, opt


def test_a_failed_capture_warns_and_trains_on_eagerly():
    stepper = GraphedStepper(*_model_and_optimizer(), device=CPU, graph=_Refuses)
    batches = _batches(4)
    with pytest.warns(UserWarning, match="capturing the training step in a CUDA graph failed"):
        losses = [stepper.step(x, y) for x, y in batches]
    assert stepper.report() == {"captures": 0, "eager_steps": 4,
                                "failed": "RuntimeError: operation not permitted when stream is "
                                          "capturing"}
    ref = Stepper(*_model_and_optimizer(), device=CPU)
    assert losses == pytest.approx([ref.step(x, y) for x, y in batches], rel=1e-6)


def test_token_ids_are_checked_on_the_host():
    model, opt = _model_and_optimizer()
    stepper = GraphedStepper(model, opt, device=CPU, graph=RerunGraph)
    assert all(m.capturable for m in model.modules() if isinstance(m, comera.TTEmbedding))
    x, y = _batches(1)[0]
    x[0, 3] = VOCAB
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 300\), got \[\d+, 300\]"):
        stepper.step(x, y)


# ------------------------------------------------- the whole command line
COMERA_ARGS = ["--rank", "4", "--vocab-rank", "8", "--prune-every", "3", "--target-compression",
               "20", "--stage1", "0.25", "--stage2", "0.5", "--lr", "0.001", "--lr-comera", "0.002"]


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("code")
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "string.py", "colorsys.py"):
        shutil.copy(os.path.join(STDLIB, name), d / name)
    return str(d)


def _metrics(out):
    with open(os.path.join(out, "metrics.json")) as fh:
        return json.load(fh)["methods"]


class _RerunStepper(GraphedStepper):
    """What `comera pretrain` builds on CUDA, with RerunGraph for the graph."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, graph=RerunGraph, **kwargs)


def test_pretrain_command_graphed_trains_like_eager_and_resumes(code_dir, tmp_path, monkeypatch):
    """`comera pretrain` with its steps graphed (RerunGraph standing in for
    CUDA graphs), stopped halfway and resumed, against the eager run."""
    run = ["--corpus", code_dir, "--method", "both", "--steps", "12", *tiny_args(batch_size=8),
           *COMERA_ARGS]
    eager = str(tmp_path / "eager")
    assert main(["pretrain", *run, "--out", eager]) == 0
    monkeypatch.setattr(loop.Options, "graphed", lambda self, device: True)
    monkeypatch.setattr(loop, "GraphedStepper", _RerunStepper)
    out = str(tmp_path / "graphed")
    assert main(["pretrain", *run, "--out", out, "--stop-after", "5"]) == 0
    assert main(["pretrain", *run, "--out", out, "--resume"]) == 0
    want, got = _metrics(eager), _metrics(out)
    for method in ("dense", "comera"):
        assert got[method]["graph"]["captures"] >= 1, got[method]["graph"]
        assert got[method]["history"]["loss"] == pytest.approx(want[method]["history"]["loss"],
                                                               rel=1e-5)
        assert got[method]["valid_loss"] == pytest.approx(want[method]["valid_loss"], rel=1e-5)
    assert got["comera"]["final_ranks"] == want["comera"]["final_ranks"]


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: needs a real GPU")
def test_cuda_graphed_run_matches_eager_on_the_gpu():
    """The same run as above with real CUDA graphs (no dropout: a graph's
    random offsets need not follow eager's)."""
    cuda = torch.device("cuda")

    def run(graphed):
        p = _preset()
        p.dropout = 0.0
        model = build_comera(p, VOCAB, seed=0).to(cuda)
        opt = make_optimizer(model, p)
        sched = make_schedule(opt, p)
        ra = comera.RankAdaptive(model, gamma=0.05, threshold=0.05, stage1_steps=6,
                                 stage2_steps=10, target_compression=3.0, prune_every=5)
        make_capturable(opt, cuda)
        if graphed:
            stepper = GraphedStepper(model, opt, device=cuda, controller=ra, clip=1.0)
        else:
            stepper = Stepper(model, opt, device=cuda, clip=1.0)
            ra.attach(opt)
        losses = []
        for x, y in _batches(24):
            losses.append(stepper.step(x, y))
            sched.step()
        return losses, model, stepper

    want, eager_model, _ = run(False)
    got, model, stepper = run(True)
    assert stepper.failed is None and stepper.captures >= 4, stepper.report()
    assert got == pytest.approx(want, rel=1e-4)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
