"""comera pretrain: corpus, tokenizer, masking, schedule, checkpoints and the
whole command end to end (tiny models on a tiny real-code corpus)."""
import doctest
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="comera pretrain needs the train extra")
pytest.importorskip("tokenizers", reason="comera pretrain needs the train extra")

import comera  # noqa: E402
from comera.__main__ import main  # noqa: E402
from comera import storage  # noqa: E402
from comera.pretrain import corpus as corpus_mod  # noqa: E402
from comera.pretrain import data as data_mod  # noqa: E402
from comera.pretrain import tokenizer as tok_mod  # noqa: E402
from comera.pretrain.model import count_parameters, preset  # noqa: E402
from comera.pretrain.report import METRIC_KEYS  # noqa: E402
from comera.pretrain.loop import make_optimizer, make_schedule  # noqa: E402

from pretrain_tiny import REPO, STDLIB, tiny_args  # noqa: E402

TINY = tiny_args()


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    """Real source: the json package and a few modules of the standard library."""
    d = tmp_path_factory.mktemp("code")
    shutil.copytree(os.path.join(STDLIB, "json"), d / "json", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "string.py", "colorsys.py"):
        shutil.copy(os.path.join(STDLIB, name), d / name)
    return str(d)


def run_cli(*args):
    return main(["pretrain", *args])


DENSE_RUN = ["--method", "dense", "--steps", "8", *TINY]


@pytest.fixture(scope="module")
def dense_run(code_dir, tmp_path_factory):
    """One uninterrupted dense run, shared by the tests that read it."""
    out = str(tmp_path_factory.mktemp("dense") / "run")
    assert run_cli("--corpus", code_dir, "--out", out, *DENSE_RUN) == 0
    return out


def load_metrics(out):
    with open(os.path.join(out, "metrics.json")) as fh:
        return json.load(fh)


# ----------------------------------------------------------------- corpus
def test_default_corpus_is_the_standard_library():
    root, files = corpus_mod.find_source_files()
    assert root == os.path.abspath(STDLIB)
    rel = {os.path.relpath(f, root) for f in files}
    assert os.path.join("json", "decoder.py") in rel and "os.py" in rel
    assert not any("site-packages" in f.split(os.sep) for f in rel)
    assert all(f.endswith(".py") for f in files)


def test_split_is_deterministic_disjoint_and_by_file():
    paths = [f"pkg{i % 7}/mod{i}.py" for i in range(200)]
    train, valid = corpus_mod.split_files(paths, 0.1, seed=3)
    assert (train, valid) == corpus_mod.split_files(list(reversed(paths)), 0.1, seed=3)
    assert set(train).isdisjoint(valid) and set(train) | set(valid) == set(paths)
    assert len(valid) == 20
    assert corpus_mod.split_files(paths, 0.1, seed=4)[1] != valid
    # Adding a file does not move the others between the sets (ranks are per
    # file; here the validation share grows from 20 to 21 files).
    train2, valid2 = corpus_mod.split_files(paths + ["new.py"], 0.1, seed=3)
    assert set(valid) <= set(valid2) and len(valid2) == 21
    # Two files: one each way.
    t, v = corpus_mod.split_files(["a.py", "b.py"], 0.05)
    assert len(t) == 1 and len(v) == 1


def test_undecodable_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "good.py").write_text("def f():\n    return 1\n")
    (tmp_path / "also_good.py").write_text("x = 'h\u00e9llo'\n", encoding="utf-8")
    (tmp_path / "latin1.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    (tmp_path / "binary.py").write_bytes(b"\x00\x01\x02abc")
    (tmp_path / "empty.py").write_text("   \n")
    (tmp_path / "notes.txt").write_text("not python")
    c = corpus_mod.load_corpus(str(tmp_path), valid_fraction=0.5)
    names = {p for p, _ in c.train + c.valid}
    assert names == {"good.py", "also_good.py"}
    assert c.skipped == {"not_utf8": 1, "binary": 1, "empty": 1}
    assert sorted(c.skipped_files) == ["binary.py", "empty.py", "latin1.py"]
    # A glob takes any extension it matches.
    c2 = corpus_mod.load_corpus(str(tmp_path / "*"), valid_fraction=0.5)
    assert {p for p, _ in c2.train + c2.valid} == {"good.py", "also_good.py", "notes.txt"}


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "no_match", "all_bad", "one_file"])
def test_bad_corpus_is_a_clear_error(tmp_path, kind, capsys):
    if kind == "missing":
        spec, expect = str(tmp_path / "nope"), "does not exist"
    elif kind == "empty_dir":
        (tmp_path / "e").mkdir()
        spec, expect = str(tmp_path / "e"), "contains no source files"
    elif kind == "no_match":
        spec, expect = str(tmp_path / "**" / "*.zzz"), "matches no files"
    elif kind == "all_bad":
        (tmp_path / "a.py").write_bytes(b"\xff\xfe\xfa")
        (tmp_path / "b.py").write_bytes(b"\xff\xfe\xfb")
        spec, expect = str(tmp_path), "could be read as UTF-8"
    else:
        (tmp_path / "only.py").write_text("x = 1\n")
        spec, expect = str(tmp_path), "at least 2 readable files"
    with pytest.raises(ValueError, match=expect):
        corpus_mod.load_corpus(spec)
    out = tmp_path / "run"
    assert run_cli("--corpus", spec, "--out", str(out), *TINY) == 2
    err = capsys.readouterr().err
    assert "comera pretrain: error:" in err and expect in err
    assert not (out / "config.json").exists()  # nothing half-made


# -------------------------------------------------------------- tokenizer
def test_tokenizer_is_deterministic_and_cached(code_dir, tmp_path):
    c = corpus_mod.load_corpus(code_dir, valid_fraction=0.25)
    texts = [t for _, t in c.train]
    a = tok_mod.train_tokenizer(texts, 400)
    b = tok_mod.train_tokenizer(texts, 400)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(s) for s in tok_mod.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    sample = c.valid[0][1]
    assert a.decode(a.encode(sample).ids) == sample  # byte-level: lossless on unseen code
    logs = []
    t1, tr1, va1, _ = tok_mod.load_or_build(str(tmp_path), c, vocab_size=400, log=logs.append)
    t2, tr2, va2, _ = tok_mod.load_or_build(str(tmp_path), c, vocab_size=400, log=logs.append)
    assert any("cached" in m for m in logs) and not any("cached" in m for m in logs[:1])
    assert torch.equal(tr1, tr2) and torch.equal(va1, va2) and t1.to_str() == t2.to_str()
    # The stream is each file's tokens then </s>, in the corpus order.
    first = c.train[0][1]
    n = len(t1.encode(first).ids)
    assert tr1[:n].tolist() == t1.encode(first).ids and int(tr1[n]) == tok_mod.EOS
    assert int((tr1 == tok_mod.EOS).sum()) == len(c.train)
    # Resuming against a changed corpus is refused.
    c.train[0] = (c.train[0][0], c.train[0][1] + "\n# edited\n")
    with pytest.raises(ValueError, match="corpus changed"):
        tok_mod.load_or_build(str(tmp_path), c, vocab_size=400, resume=True)


# ----------------------------------------------------------------- data
def test_masking_follows_80_10_10():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(5, 1000, (400, 500), generator=g)
    blocks[:, 0] = tok_mod.BOS
    blocks[:, -1] = tok_mod.EOS
    inputs, labels = data_mod.mask_tokens(blocks, 1000, torch.Generator().manual_seed(2))
    again = data_mod.mask_tokens(blocks, 1000, torch.Generator().manual_seed(2))
    assert torch.equal(inputs, again[0]) and torch.equal(labels, again[1])
    chosen = labels != -100
    ordinary = blocks >= 5
    assert not chosen[~ordinary].any()
    assert torch.equal(labels[chosen], blocks[chosen])
    assert torch.equal(inputs[~chosen], blocks[~chosen])
    frac = chosen.sum().item() / ordinary.sum().item()
    assert abs(frac - 0.15) < 0.003
    n = chosen.sum().item()
    masked = (inputs[chosen] == tok_mod.MASK).sum().item() / n
    kept = (inputs[chosen] == blocks[chosen]).sum().item() / n
    swapped = ((inputs[chosen] != blocks[chosen]) & (inputs[chosen] != tok_mod.MASK)).sum().item() / n
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(swapped - 0.1) < 0.01
    assert (inputs[chosen] >= 5).logical_or(inputs[chosen] == tok_mod.MASK).all()
    # A batch too short to draw any token still predicts one.
    few = torch.tensor([[0, 7, 2]])
    _, lab = data_mod.mask_tokens(few, 100, torch.Generator().manual_seed(0), prob=1e-9)
    assert (lab != -100).sum() == 1 and lab[0, 1] == 7


def test_batch_order_is_a_pure_function_of_the_step():
    order = data_mod.BatchOrder(num_blocks=7, batch_size=3, seed=5)
    seq = torch.cat([order.indices(s) for s in range(7)])  # 21 samples = 3 epochs
    for e in range(3):
        assert sorted(seq[7 * e: 7 * e + 7].tolist()) == list(range(7))
    fresh = data_mod.BatchOrder(num_blocks=7, batch_size=3, seed=5)
    assert torch.equal(fresh.indices(5), order.indices(5))  # no dependence on call history
    assert not torch.equal(torch.cat([data_mod.BatchOrder(7, 3, 6).indices(s) for s in range(7)]), seq)


def test_schedule_warms_up_then_decays_linearly():
    p = preset("tiny")
    p.steps, p.warmup, p.lr = 10, 0.2, 1.0
    model = nn.Linear(2, 2)
    opt = make_optimizer(model, p)
    sched = make_schedule(opt, p)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    expected = [0.5, 1.0] + [(10 - s) / 8 for s in range(2, 10)]
    assert lrs == pytest.approx(expected)


def test_optimizer_does_not_decay_biases_norms_or_gates():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), comera.TTLinear(64, 64, rank=4))
    opt = make_optimizer(model, preset("tiny"))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names == {"0.weight"} | {f"2.cores.{i}" for i in range(6)}
    assert opt.param_groups[1]["weight_decay"] == 0.0


# ------------------------------------------------- parameters and checkpoints
def test_count_parameters_counts_live_tt_ranks():
    tt = comera.TTLinear(64, 48, rank=4)
    model = nn.Sequential(nn.Linear(8, 64), tt)
    with torch.no_grad():
        tt.gates[1][1:] = 0          # bond 2 keeps 1 of its ranks
    counts = count_parameters(model)
    ranks = [1] + [int((g != 0).sum()) for g in tt.gates] + [1]
    dims = tt.in_shape + tt.out_shape
    live = sum(ranks[k] * dims[k] * ranks[k + 1] for k in range(len(dims)))
    other = 8 * 64 + 64 + 48  # first Linear and TT bias
    assert counts["converted_dense"] == 64 * 48 and counts["converted_tt"] == live
    assert counts["total_live"] == other + live + sum(ranks[1:-1])
    assert counts["dense_equivalent"] == other + 64 * 48
    assert counts["total"] == sum(p.numel() for p in model.parameters())


def test_resize_then_load_restores_a_smaller_rank_model():
    small = comera.TTLinear(64, 48, rank=[2, 3, 4, 3, 2])
    big = comera.TTLinear(64, 48, rank=4)
    assert small.ranks != big.ranks
    wrap_small, wrap_big = nn.Sequential(small), nn.Sequential(big)
    params_before = [id(p) for p in wrap_big.parameters()]
    comera.load_state_dict(wrap_big, wrap_small.state_dict())
    assert [id(p) for p in wrap_big.parameters()] == params_before
    assert big.ranks == [2, 3, 4, 3, 2]
    x = torch.randn(5, 64)
    torch.testing.assert_close(big(x), small(x))
    other_modes = nn.Sequential(comera.TTLinear(64, 48, rank=4, in_shape=[8, 8], out_shape=[6, 8]))
    with pytest.raises(ValueError, match="does not fit TTLinear '0'"):
        comera.load_state_dict(other_modes, wrap_small.state_dict())


# ------------------------------------------------------------ end to end
def _check_complete_report(out, methods):
    m = load_metrics(out)
    for method in methods:
        r = m["methods"][method]
        for key in METRIC_KEYS:
            assert key in r, key
        assert r["parameters"]["total"] > 0 and r["valid_loss"] > 0 and r["tokens_per_s"] >= 0
        assert r["valid_perplexity"] == pytest.approx(2.718281828 ** r["valid_loss"], rel=1e-6)
        assert r["wall_time_s"] >= r["train_time_s"] >= 0 and r["peak_memory_bytes"] > 0
    report = open(os.path.join(out, "report.md")).read()
    for needle in ("validation MLM loss", "training tokens/s", "peak memory", "compression, whole model"):
        assert needle in report
    for name in m["plots"].values():
        with open(os.path.join(out, name), "rb") as fh:
            head = fh.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(os.path.join(out, name)) > 2000
        assert f"]({name})" in report
    return m


def test_end_to_end_dense_writes_a_complete_report(code_dir, dense_run):
    out = dense_run
    m = _check_complete_report(out, ["dense"])
    r = m["methods"]["dense"]
    assert r["steps_done"] == 8 and r["stopped"] == "finished"
    assert [s for s, _ in r["history"]["valid"]] == [3, 6, 8]
    assert r["history"]["step"] == list(range(1, 9)) and len(r["history"]["loss"]) == 8
    assert r["compression_whole"] == 1.0 and r["parameters"]["converted_layers"] == 0
    assert m["corpus"]["train_files"] + m["corpus"]["valid_files"] == 11
    for f in ("config.json", "tokenizer.json", "dense/checkpoint.pt", "valid_loss.png", "compression.png"):
        assert os.path.isfile(os.path.join(out, f)), f
    # Reusing the directory without --resume is refused; --resume of a finished run is a no-op.
    assert run_cli("--corpus", code_dir, "--out", out, *DENSE_RUN) == 2
    assert run_cli("--corpus", code_dir, "--out", out, "--resume", *DENSE_RUN) == 0
    assert load_metrics(out)["methods"]["dense"]["history"] == r["history"]
    # ... and a resume with other settings is refused, naming them.
    from comera.__main__ import build_parser
    from comera.pretrain.pipeline import run_pretrain
    args = build_parser().parse_args(["pretrain", "--corpus", code_dir, "--out", out, "--resume",
                                      "--lr", "0.5", *DENSE_RUN])
    with pytest.raises(ValueError, match="lr"):
        run_pretrain(args, log=lambda *a: None)


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(code_dir, dense_run, tmp_path):
    split = str(tmp_path / "split")
    assert run_cli("--corpus", code_dir, "--out", split, "--stop-after", "4", *DENSE_RUN) == 0
    first = load_metrics(split)["methods"]["dense"]
    assert first["stopped"] == "--stop-after" and first["steps_done"] == 4
    assert os.path.isfile(os.path.join(split, "report.md"))
    assert run_cli("--corpus", code_dir, "--out", split, "--resume", *DENSE_RUN) == 0
    a = load_metrics(dense_run)["methods"]["dense"]["history"]
    b = load_metrics(split)["methods"]["dense"]["history"]
    assert b["step"] == a["step"] == list(range(1, 9))
    assert b["loss"] == a["loss"]  # bit for bit
    assert b["lr"] == a["lr"]
    valid_b = dict((s, v) for s, v in b["valid"])
    assert all(valid_b[s] == v for s, v in a["valid"])
    assert 4 in valid_b  # the stop evaluated the weights it saved


def test_max_minutes_stops_cleanly_and_reports(code_dir, tmp_path):
    out = str(tmp_path / "run")
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "dense", "--steps", "1000",
                   "--max-minutes", "0.0001", *TINY) == 0
    m = _check_complete_report(out, ["dense"])
    r = m["methods"]["dense"]
    assert r["stopped"] == "time budget (--max-minutes)" and r["steps_done"] < 1000
    state = storage.load_training_state(os.path.join(out, "dense", "checkpoint.pt"))
    assert state["step"] == r["steps_done"] and not state["finished"]


def test_ctrl_c_stops_cleanly_and_resume_continues(code_dir, tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "comera", "pretrain", "--corpus", code_dir, "--out", out, "--method",
           "dense", "--steps", "100000", *TINY]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(out, "dense", "checkpoint.pt")):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out_text, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopping cleanly" in out_text
    m = _check_complete_report(out, ["dense"])
    done = m["methods"]["dense"]["steps_done"]
    assert m["methods"]["dense"]["stopped"] == "interrupted" and 2 <= done < 100000
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "dense", "--steps", "100000",
                   "--resume", "--stop-after", "2", *TINY) == 0
    h = load_metrics(out)["methods"]["dense"]["history"]
    assert h["step"] == list(range(1, done + 3))


# ------------------------------------------------------------- CoMERA
# Small ranks and a compression target the tiny model reaches within the run,
# with pruning every 2 steps: stage 1 is steps 1-3, stage 2 steps 4-9.
COMERA = ["--rank", "4", "--vocab-rank", "8", "--prune-every", "2", "--target-compression", "20",
          "--stage1", "0.25", "--stage2", "0.5", "--lr", "0.001", "--lr-comera", "0.002"]


BOTH_RUN = ["--steps", "12", *TINY, *COMERA]


@pytest.fixture(scope="module")
def both_run(code_dir, tmp_path_factory):
    """One uninterrupted run of both methods, shared by the tests that read it."""
    out = str(tmp_path_factory.mktemp("both") / "run")
    assert run_cli("--corpus", code_dir, "--out", out, "--method", "both", *BOTH_RUN) == 0
    return out


def _fresh_comera(out):
    """The comera model of a run, built anew and loaded from its checkpoint."""
    from comera.pretrain.model import build_comera
    cfg = json.load(open(os.path.join(out, "config.json")))
    p = preset(cfg["preset_name"])
    for k, v in cfg["preset"].items():
        setattr(p, k, v)
    state = storage.load_training_state(os.path.join(out, "comera", "checkpoint.pt"))
    vocab = json.load(open(os.path.join(out, "tokenizer_meta.json")))["vocab_size"]
    model = build_comera(p, vocab, cfg["seed"])
    comera.load_state_dict(model, state["model"])
    return model, state, p, cfg


def test_end_to_end_both_methods(both_run):
    out = both_run
    m = _check_complete_report(out, ["dense", "comera"])
    d, c = m["methods"]["dense"], m["methods"]["comera"]
    assert d["steps_done"] == c["steps_done"] == 12
    assert max(d["history"]["lr"]) == pytest.approx(1e-3) and max(c["history"]["lr"]) == pytest.approx(2e-3)
    assert "ranks_comera" in m["plots"] and "comera layers" in open(os.path.join(out, "report.md")).read()
    # The comera model is the dense model with its linear layers and word embedding in TT form.
    assert c["parameters"]["dense_equivalent"] == d["parameters"]["total"]
    names = set(c["final_ranks"])
    assert "roberta.embeddings.word_embeddings" in names and "lm_head.decoder" in names
    assert "roberta.embeddings.position_embeddings" not in names
    assert sum(".attention.self.query" in n for n in names) == 1  # TINY has one encoder
    # Stage 2 drove the converted layers to the target, and the ranks shrank.
    assert c["compression_converted"] >= 20 * 0.99
    h = c["history"]["ranks"]["layers"]
    assert any(sum(series[-1]) < sum(series[0]) for series in h.values())
    assert [s for _, s in c["history"]["stage"]][:2] == ["1", "1"]
    assert c["history"]["stage"][-1][1].startswith("2")
    # Counts against the model itself, rebuilt from the (pruned) checkpoint.
    model, state, p, cfg = _fresh_comera(out)
    assert sum(x.numel() for x in model.parameters()) == c["parameters"]["total_live"]
    assert c["compression_whole"] == pytest.approx(d["parameters"]["total"] / c["parameters"]["total_live"])
    assert comera.compression(model) == pytest.approx(c["compression_converted"])
    from comera.layers.base import tt_layers
    assert state["tt_ranks"] == {n: [int(g.numel()) for g in layer.gates] for n, layer in tt_layers(model)}


def test_pruned_checkpoint_reloads_into_a_fresh_model(both_run):
    from comera.pretrain.data import MLMData
    from comera.pretrain.loop import evaluate
    out = both_run
    r = load_metrics(out)["methods"]["comera"]
    model, state, p, cfg = _fresh_comera(out)
    ids = torch.load(os.path.join(out, "tokens.pt"))
    vocab = json.load(open(os.path.join(out, "tokenizer_meta.json")))["vocab_size"]
    data = MLMData(ids["train"], ids["valid"], seq_len=p.seq_len, batch_size=p.batch_size, vocab_size=vocab,
                   valid_blocks=p.valid_blocks, seed=cfg["seed"])
    assert evaluate(model, data, torch.device("cpu"), p.batch_size) == pytest.approx(r["valid_loss"], rel=1e-6)


def test_comera_resume_with_pruned_ranks_gives_the_same_losses(code_dir, both_run, tmp_path):
    common = ["--corpus", code_dir, "--method", "comera", *BOTH_RUN]
    straight, split = both_run, str(tmp_path / "split")
    assert run_cli("--out", split, "--stop-after", "7", *common) == 0
    state = storage.load_training_state(os.path.join(split, "comera", "checkpoint.pt"))
    assert state["step"] == 7 and state["controller"] is not None
    first = load_metrics(split)["methods"]["comera"]
    initial = {n: series[0] for n, series in first["history"]["ranks"]["layers"].items()}
    assert state["tt_ranks"] != initial  # the checkpoint holds physically pruned layers
    assert run_cli("--out", split, "--resume", *common) == 0
    a = load_metrics(straight)["methods"]["comera"]
    b = load_metrics(split)["methods"]["comera"]
    assert b["history"]["loss"] == a["history"]["loss"]  # bit for bit
    assert b["history"]["compression"] == a["history"]["compression"]
    assert b["history"]["stage"] == a["history"]["stage"]
    assert b["final_ranks"] == a["final_ranks"]
    assert b["valid_loss"] == a["valid_loss"]


# ----------------------------------------------------------- docstrings
@pytest.mark.parametrize("module", ["corpus", "records", "data", "model", "tokenizer", "monitor", "plots", "loop",
                                    "step", "processes",
                                    "report", "pipeline", "cli"])
def test_docstring_examples_run(module):
    import importlib
    mod = importlib.import_module(f"comera.pretrain.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_demo_preset_is_mini_cut_short():
    """`make demo` trains the mini model (the one the quality benchmark
    sized), on a shorter budget, with the same rank schedule."""
    mini, demo = preset("mini"), preset("demo")
    same = ("layers", "hidden", "heads", "ffn", "seq_len", "vocab_size", "batch_size", "rank",
            "vocab_rank", "gamma", "stage1", "stage2", "target_compression", "lr", "lr_comera")
    assert {k: getattr(demo, k) for k in same} == {k: getattr(mini, k) for k in same}
    assert demo.steps < mini.steps and demo.steps % demo.eval_every == 0


@pytest.mark.parametrize("name", ["tiny", "small", "mini", "demo"])
def test_demo_presets_have_a_target_at_least_twice_their_start(name):
    """`make demo` shows ranks shrinking: the preset starts above its target
    rank, and the target at least doubles the converted layers' compression."""
    from comera.pretrain.model import build_comera
    p = preset(name)
    counts = count_parameters(build_comera(p, p.vocab_size, 0))
    start = counts["converted_dense"] / counts["converted_tt"]
    assert p.target_compression is not None and p.target_compression >= 2 * start, (start, p)
    assert p.gamma > 0 and p.stage1 > 0 and p.stage2 > 0 and p.stage2_rule == "saliency"
