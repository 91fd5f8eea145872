"""comera pretrain scaled out: several processes (torchrun, gloo), gradient
accumulation, bfloat16 autocast and torch.compile, each against the plain
single-process float32 run of the same settings."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="comera pretrain needs the train extra")
pytest.importorskip("tokenizers", reason="comera pretrain needs the train extra")

import comera  # noqa: E402
from comera.__main__ import main  # noqa: E402
from comera.pretrain.processes import split_batch  # noqa: E402
from comera.pretrain.model import build_comera, preset  # noqa: E402
from comera.pretrain.step import Stepper  # noqa: E402
from comera.pretrain.loop import make_optimizer  # noqa: E402

from pretrain_tiny import REPO, STDLIB, tiny_args  # noqa: E402

# A batch of 8, so that 2 processes x 2 micro-batches still get 2 rows each.
TINY = tiny_args(batch_size=8, valid_blocks=8, eval_every=5, checkpoint_every=5)
# Pruning every 2 steps and a target reached within the run: the processes
# must cut the same ranks again and again.
COMERA = ["--rank", "4", "--vocab-rank", "8", "--prune-every", "2", "--target-compression", "20",
          "--stage1", "0.25", "--stage2", "0.5", "--lr", "0.001", "--lr-comera", "0.002"]


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("code")
    shutil.copytree(os.path.join(STDLIB, "json"), d / "json", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "string.py", "colorsys.py"):
        shutil.copy(os.path.join(STDLIB, name), d / name)
    return str(d)


def run_cli(*args):
    return main(["pretrain", *args])


def history(out, method):
    with open(os.path.join(out, "metrics.json")) as fh:
        m = json.load(fh)
    return m["methods"][method], m["environment"]


def close(a, b, rtol):
    assert len(a) == len(b)
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst <= rtol, (worst, a, b)


def valid_at(result, step):
    return dict((s, v) for s, v in result["history"]["valid"])[step]


RUN = ["--steps", "20", *TINY, *COMERA]
# The other runs stop after 6 of the 20 steps (the same schedule).
SIX = [*RUN, "--stop-after", "6"]


@pytest.fixture(scope="module")
def reference(code_dir, tmp_path_factory):
    """Both methods, one process, float32, whole batches: 20 steps."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "both", *RUN) == 0
    return out


def test_grad_accum_is_the_same_step_as_the_whole_batch(code_dir, reference, tmp_path):
    out = str(tmp_path / "accum")
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "both", "--grad-accum", "4", *SIX) == 0
    for method in ("dense", "comera"):
        a, env = history(out, method)
        b, _ = history(reference, method)
        assert env["grad_accum"] == 4 and a["steps_done"] == 6
        # 4 micro-batches of 2 rows: only the summation order differs.
        close(a["history"]["loss"], b["history"]["loss"][:6], 1e-5)
        assert valid_at(a, 5) == pytest.approx(valid_at(b, 5), rel=1e-5)
        # the same ranks died (pruning every 2 steps)
        assert a["history"]["compression"][:7] == b["history"]["compression"][:7]
    assert history(out, "comera")[0]["compression_converted"] > 5


def test_batch_must_divide_among_processes_and_micro_batches(code_dir, tmp_path, capsys):
    assert split_batch(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"--batch-size 6 .* 4 processes x --grad-accum 1 = 4"):
        split_batch(6, 4, 1)
    out = tmp_path / "run"
    assert run_cli("--corpus", code_dir, "--out", str(out), "--grad-accum", "3", *SIX) == 2
    err = capsys.readouterr().err
    assert "--batch-size 8" in err and "--grad-accum 3" in err
    assert not out.exists()  # checked before anything is written


def test_bf16_autocasts_activations_and_keeps_float32_parameters():
    p = preset("tiny")
    p.layers, p.hidden, p.ffn, p.seq_len, p.rank, p.vocab_rank = 1, 32, 64, 16, 4, 8
    model = build_comera(p, 300, seed=0)
    opt = make_optimizer(model, p)
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, output.dtype)
        return hook
    query = model.roberta.encoder.layer[0].attention.self.query
    assert isinstance(query, comera.TTLinear)
    query.register_forward_hook(record("query"))
    model.roberta.encoder.layer[0].output.LayerNorm.register_forward_hook(record("norm"))
    grads = {}
    opt.register_step_pre_hook(lambda o, a, k: grads.update(
        {n: q.grad.dtype for n, q in model.named_parameters() if q.grad is not None}))
    stepper = Stepper(model, opt, device=torch.device("cpu"), precision="bf16", clip=1.0)
    x = torch.randint(5, 300, (4, 16))
    y = torch.where(torch.rand(4, 16) < 0.3, x, torch.full_like(x, -100))
    loss = stepper.step(x, y)
    assert seen["query"] == torch.bfloat16   # the TT layer's output, as nn.Linear's under autocast
    assert seen["norm"] == torch.float32     # autocast keeps layer norms in float32
    assert all(q.dtype == torch.float32 for q in model.parameters())
    assert grads and set(grads.values()) == {torch.float32}
    # The same step in float32 gives nearly the same loss (bf16 has 8 mantissa bits).
    fresh = build_comera(p, 300, seed=0)
    ref = Stepper(fresh, make_optimizer(fresh, p), device=torch.device("cpu"), clip=1.0).step(x, y)
    assert loss != ref and abs(loss - ref) / ref < 0.02
    with pytest.raises(ValueError, match="--precision must be one of"):
        Stepper(fresh, opt, device=torch.device("cpu"), precision="fp16")


def test_bf16_run_trains_close_to_float32(code_dir, reference, tmp_path):
    out = str(tmp_path / "bf16")
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "comera", "--precision", "bf16",
                   *SIX) == 0
    a, env = history(out, "comera")
    b, _ = history(reference, "comera")
    assert env["precision"] == "bf16" and a["steps_done"] == 6
    close(a["history"]["loss"], b["history"]["loss"][:6], 0.02)
    assert a["history"]["loss"] != b["history"]["loss"][:6]
    assert valid_at(a, 5) == pytest.approx(valid_at(b, 5), rel=0.02)


def test_compile_matches_eager(code_dir, reference, tmp_path):
    out = str(tmp_path / "compiled")
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "dense", "--compile",
                   *RUN, "--stop-after", "3") == 0
    a, env = history(out, "dense")
    b, _ = history(reference, "dense")
    assert env["compile"] is True and a["steps_done"] == 3
    close(a["history"]["loss"], b["history"]["loss"][:3], 1e-4)


def _torchrun(out, code_dir, *extra):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    # --standalone: a free local port, so parallel test runs do not collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "comera", "pretrain", "--corpus", code_dir, "--out", out, "--method", "comera",
           *RUN, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_two_processes_train_like_one_and_resume(code_dir, reference, tmp_path):
    """2 gloo processes on the global batch of 8 (4 rows each) against 1
    process; the 2-process run stops after 10 steps and resumes."""
    one, two = reference, str(tmp_path / "two")
    first = _torchrun(two, code_dir, "--stop-after", "10")
    half, env = history(two, "comera")
    assert env["processes"] == 2 and env["backend"] == "gloo"
    assert half["stopped"] == "--stop-after" and half["steps_done"] == 10
    second = _torchrun(two, code_dir, "--resume")
    # Only process 0 logs and writes: one report line per invocation, and
    # the run directory holds one run's files.
    assert first.count("report: ") == 1 and second.count("report: ") == 1
    assert second.count("resumed from") == 1
    assert sorted(os.listdir(os.path.join(two, "comera"))) == ["checkpoint.pt", "result.json"]
    assert not [f for f in os.listdir(two) if f.endswith(".tmp")]
    a, _ = history(two, "comera")
    b, _ = history(one, "comera")
    assert a["history"]["step"] == list(range(1, 21)) and a["stopped"] == "finished"
    assert abs(a["valid_loss"] - b["valid_loss"]) / b["valid_loss"] < 0.02
    close(a["history"]["loss"], b["history"]["loss"], 0.02)
    # Pruning ran in both processes at the same steps (each prune checks that
    # they agree) and reached the same compression as one process.
    assert a["compression_converted"] >= 20 * 0.99
    assert abs(a["compression_converted"] - b["compression_converted"]) / b["compression_converted"] < 0.05


def test_ctrl_c_twice_at_once_is_one_request(monkeypatch):
    """Under torchrun a terminal's Ctrl-C reaches a worker twice at once
    (terminal and launcher): that stops cleanly; a later one aborts."""
    import signal
    import time
    from comera.pretrain.monitor import StopFlag
    with StopFlag(log=lambda *a: None) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert stop.requested and stop.reason == "interrupted"
        monkeypatch.setattr(StopFlag, "REPEAT_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)


def test_fsdp_two_processes_train_like_one_and_resume(code_dir, reference, tmp_path):
    """--fsdp: FSDP2 over 2 gloo processes (every TT layer and the whole model
    sharded; the rank controller and pruning on the sharded parameters)
    against 1 unsharded process: the same losses to 1e-4, the target
    compression with the same final ranks; stopped after 10 steps (with
    pruned ranks) and resumed from the whole-tensor checkpoint."""
    one, two = reference, str(tmp_path / "fsdp")
    _torchrun(two, code_dir, "--fsdp", "--stop-after", "10")
    half, env = history(two, "comera")
    assert env["fsdp"] is True and env["processes"] == 2 and env["backend"] == "gloo"
    assert half["steps_done"] == 10 and half["compression_converted"] > 1.5
    second = _torchrun(two, code_dir, "--fsdp", "--resume")
    assert second.count("resumed from") == 1
    a, _ = history(two, "comera")
    b, _ = history(one, "comera")
    assert a["history"]["step"] == list(range(1, 21)) and a["stopped"] == "finished"
    assert max(abs(x - y) for x, y in zip(a["history"]["loss"], b["history"]["loss"])) <= 1e-4
    assert a["final_ranks"] == b["final_ranks"]
    assert a["history"]["compression"] == b["history"]["compression"]
    assert a["compression_converted"] >= 20 * 0.99
    assert a["valid_loss"] == pytest.approx(b["valid_loss"], abs=1e-4)


def test_fsdp_needs_several_processes(code_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("--corpus", code_dir, "--out", str(out), "--fsdp", *SIX) == 2
    assert "--fsdp shards the model over several processes" in capsys.readouterr().err
