"""Smoke tests of the benchmark scripts (--quick: tiny sizes, in-process) and
unit tests of the pieces they rely on: the paper-scheme peer layer, the
code-docstring data set and the whole-process memory helpers.

The scripts need the benchmark extra (``pip install -e ".[bench]"``)."""
import json
import math
import os
import sys

import pytest
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import code_docstring  # noqa: E402
import common  # noqa: E402
import comera  # noqa: E402
from peers import PaperTTLinear, build_linear, LINEAR_METHODS  # noqa: E402


def _read(out, name):
    with open(os.path.join(out, name + ".json")) as f:
        payload = json.load(f)
    with open(os.path.join(out, name + ".md")) as f:
        md = f.read()
    return payload, md


def _pngs_exist(out, payload):
    assert payload["plots"], "no plot written"
    for png in payload["plots"]:
        path = os.path.join(out, png)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


# ------------------------------------------------------------ peer layers
def test_paper_scheme_matches_dense_reference_and_gradcheck():
    torch.manual_seed(0)
    tt = comera.TTLinear(24, 20, rank=3, dtype=torch.float64)
    paper = PaperTTLinear.from_ttlinear(tt)
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    # independent reference: dense weight rebuilt from the cores, plain autograd
    ref = x @ tt.weight.t() + tt.bias
    torch.testing.assert_close(paper(x), ref)
    params = list(paper.parameters())
    assert torch.autograd.gradcheck(lambda x, *ps: paper(x), (x, *params))
    # the custom backward gives the same core/gate/bias grads as autograd on the reference
    g = torch.randn(5, 20, dtype=torch.float64)
    paper(x).backward(g)
    ref_grads = torch.autograd.grad(ref, list(tt.cores) + list(tt.gates) + [tt.bias], g)
    for p, r in zip(list(paper.cores) + list(paper.gates) + [paper.bias], ref_grads):
        torch.testing.assert_close(p.grad, r)


@pytest.mark.parametrize("method", LINEAR_METHODS)
def test_every_peer_computes_a_linear_map_of_the_right_shape(method):
    layer = build_linear(method, 64, 48, rank=4)
    x = torch.randn(3, 64)
    y = layer(x)
    assert y.shape == (3, 48)
    # linear in x up to the bias: f(2x) - f(x) == f(x) - f(0)
    z = torch.zeros(1, 64)
    torch.testing.assert_close(layer(2 * x) - y, y - layer(z), atol=1e-4, rtol=1e-4)


def test_build_linear_rejects_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        build_linear("nope", 8, 8, 2)


# --------------------------------------------------------------- data set
def test_tokens_split_identifiers_and_punctuation():
    assert code_docstring.tokens("HTTPServer.get_item(x2)") == [
        "http", "server", ".", "get", "item", "(", "x", "2", ")"]


def test_make_pairs_half_true_half_mismatched_and_no_self_match():
    funcs = [(f"doc {i} words here", f"body_{i} = {i}") for i in range(11)]
    pairs = code_docstring.make_pairs(funcs, seed=3)
    assert len(pairs) == 11 and sum(p[2] for p in pairs) == 5
    own = dict(funcs)
    for doc, body, label in pairs:
        assert (own[doc] == body) == (label == 1)
    negatives = [body for _, body, label in pairs if label == 0]
    assert len(set(negatives)) == len(negatives)  # no body reused


def test_functions_in_file_extracts_doc_and_body_without_docstring(tmp_path):
    src = ('class Shape:\n    @property\n    def area(self, w,\n             h):\n'
           '        """Return the area of a rectangle.\n\n        More text."""\n'
           '        check(w, h)\n        return w * h  # product of the sides\n\n'
           'def nodoc(a):\n    x = a\n    return x\n\n'
           'def inline(a):  """Docstring on the def line is skipped."""; return a\n')
    path = tmp_path / "m.py"
    path.write_text(src)
    # the signature (no decorator), then the body without the docstring
    assert code_docstring.functions_in_file(str(path)) == [
        ("Return the area of a rectangle.",
         "def area(self, w,\n         h):\n    check(w, h)\n    return w * h  # product of the sides")]


def test_load_splits_by_file_and_encodes(tmp_path):
    data = code_docstring.load(300, 24, max_files=120, cache_dir=str(tmp_path))
    tr, te = data["train"], data["test"]
    assert tr["ids"].shape[1] == 24 and tr["ids"].max() < 300
    assert (tr["ids"][:, 0] == code_docstring.CLS).all()
    assert abs(data["stats"]["train_positive_fraction"] - 0.5) < 0.01
    assert (te["padding"] == (te["ids"] == code_docstring.PAD)).all()
    # the cache returns the same tensors
    again = code_docstring.load(300, 24, max_files=120, cache_dir=str(tmp_path))
    assert torch.equal(again["train"]["ids"], tr["ids"])


def test_collect_never_puts_one_file_in_both_splits(tmp_path):
    for i in range(30):  # two documented functions per file
        (tmp_path / f"f{i}.py").write_text("".join(
            f'def g{i}_{j}(a):\n    """Compute value {j} of file {i} please."""\n'
            f'    b = a + {i} * {j}\n    return b * {i} + 1234567 - {j} * 7654321\n\n'
            for j in range(2)))
    train, test = code_docstring.collect([str(tmp_path)], max_files=100)
    assert train and test and len(train) + len(test) == 60
    file_of = lambda doc: doc.split("file ")[1].split()[0]
    train_files, test_files = {file_of(d) for d, _ in train}, {file_of(d) for d, _ in test}
    assert not train_files & test_files
    assert len(train) == 2 * len(train_files) and len(test) == 2 * len(test_files)


# ---------------------------------------------------------- memory helpers
def test_peak_rss_sees_a_large_allocation_after_reset():
    common.release_freed_memory()
    base = common.rss_bytes()
    assert common.reset_peak_rss()
    t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MB, touched
    grown = common.peak_rss_bytes() - base
    del t
    assert grown >= 60 << 20


@pytest.mark.parametrize("threads", [1, 2])
def test_case_subprocess_runs_a_linear_case_with_the_threads_asked(threads):
    """The case runs in a fresh process that got --threads and OMP_NUM_THREADS
    and asserted the count (timing.assert_threads) before measuring."""
    res = common.case_subprocess("bench_peers", {"kind": "linear_ranks", "method": "nn.Linear",
                                                 "in": 512, "out": 1024, "ranks": [0], "rows": 2048},
                                 threads, timeout=300)
    assert len(res) == 1 and res[0]["method"] == "nn.Linear" and res[0]["params"] == 512 * 1024 + 1024
    assert res[0]["threads"] == threads and res[0]["omp_num_threads"] == str(threads)
    # the step allocates at least its 8 MB output and 4 MB input gradient
    assert res[0]["peak_bytes"] >= 12 << 20


def test_case_subprocess_refuses_a_case_that_reports_other_threads(monkeypatch):
    import subprocess
    import timing
    fake = subprocess.CompletedProcess([], 0, stdout=json.dumps({"threads": 2}) + "\n", stderr="")
    monkeypatch.setattr(timing, "threaded_subprocess", lambda *a, **k: fake)
    with pytest.raises(RuntimeError, match="asked for 1 threads"):
        common.case_subprocess("bench_peers", {"kind": "linear_ranks"}, 1)


def test_equal_param_rank_is_the_closest_tltorch_rank():
    from peers import equal_param_rank, num_params, tltorch_blocktt
    target = num_params(comera.TTLinear(768, 3072, rank=30))
    r = equal_param_rank(768, 3072, target)
    gap = lambda k: abs(num_params(tltorch_blocktt(768, 3072, k, "factorized")) - target)
    assert gap(r) <= gap(r - 1) and gap(r) <= gap(r + 1)
    assert gap(r) < 0.1 * target
    layer = build_linear("tltorch BlockTT (reconstructed, equal params)", 768, 3072, 30)
    assert abs(num_params(layer) - target) == gap(r)


def test_galore_step_time_amortises_its_svd_step():
    from train_step import GALORE, time_methods
    res = time_methods({"preset": "tiny", "batch": 2, "rank": 4, "reps": 3,
                        "methods": [["dense AdamW", "dense AdamW", None],
                                    ["GaLore AdamW", "GaLore AdamW", None]]})
    assert set(res["methods"]) == {"dense AdamW", "GaLore AdamW"}  # the SVD variant is folded in
    g = res["methods"]["GaLore AdamW"]
    steady, svd = g["wall"]["median"], g["svd_step_wall_s"]
    assert g["amortised_wall_s"] == pytest.approx(steady + max(0.0, svd - steady)
                                                  / GALORE["update_proj_gap"])
    assert g["wall"]["reps"] == 3 and res["methods"]["dense AdamW"]["wall"]["reps"] == 3


def test_benchmark_docstring_examples_run():
    import doctest
    import importlib
    for name in ("peers", "train_step", "timing", "code_docstring", "plots", "bench_codesearch",
                 "claims", "bench_linear"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.failed == 0 and result.attempted > 0, name


def test_bench_linear_targets_name_each_worst_case():
    import bench_linear
    f32 = [{"threads": t, "in": 768, "out": 768, "rank": r, "speedup_vs_matmul_merge": s}
           for t, r, s in ((1, 8, 1.9), (2, 30, 1.6), (1, 64, 0.9))]
    bf16 = [{"threads": 1, "in": i, "out": o, "rank": 30, "float32_over_bf16": a,
             "float32_over_autocast": 1.2, "float32_over_autocast_f32_input": 1.1,
             "speedup_bf16_vs_dense_bf16": d, "speedup_autocast_vs_dense_autocast": 9.0,
             "speedup_autocast_f32_input_vs_dense": 8.0}
            for i, o, a, d in ((768, 768, 0.8, 2.0), (768, 3072, 1.3, 5.0))]
    got = {t["name"]: t for t in bench_linear.targets(f32, bf16)}
    assert len(got) == 5
    assert got["float32 TTLinear / merge path, ranks 8-30"]["got"] == 1.6
    assert got["float32 TTLinear / merge path, ranks 8-30"]["met"]
    assert not got["float32 TTLinear / merge path, rank 64"]["met"]
    slower = [t for n, t in got.items() if n.startswith("float32 TTLinear time")][0]
    assert (slower["got"], slower["met"]) == (0.8, False)
    assert slower["worst_case"] == "1 thread(s), 768 -> 768 rank 30"
    wide = got["bfloat16 TTLinear / nn.Linear in the same setting, 768 -> 3072 rank 30"]
    assert (wide["got"], wide["met"]) == (5.0, True)


# ------------------------------------------------------ scripts, --quick
def test_bench_peers_quick(tmp_path):
    import bench_peers
    bench_peers.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    payload, md = _read(str(tmp_path), "peers_cpu_quick")
    lin = payload["linear"][0]
    assert set(lin["methods"]) == set(LINEAR_METHODS)
    for m in lin["methods"].values():
        assert m["wall_s"] > 0 and m["peak_bytes"] >= 0 and m["params"] > 0
        assert m["wall"]["reps"] >= 3 and m["wall"]["min"] <= m["wall_s"] <= m["wall"]["max"]
    assert set(lin["comera_speedup"]) == set(LINEAR_METHODS) - {"comera.TTLinear"}
    # the equal-parameter peer really has about comera's parameter count
    tt, eq = lin["methods"]["comera.TTLinear"], lin["methods"]["tltorch BlockTT (factorized, equal params)"]
    assert abs(eq["params"] - tt["params"]) < 0.15 * tt["params"] < lin["methods"][
        "tltorch BlockTT (factorized)"]["params"] - tt["params"]
    steps = payload["transformer"]
    assert [r["batch"] for r in steps] == [1, 2]
    for r in steps:
        assert set(r["methods"]) == {"dense AdamW", "GaLore AdamW", "comera"}
        galore = r["methods"]["GaLore AdamW"]
        assert galore["optimizer_state_bytes"] > 0
        assert galore["step_s"] >= galore["steady_step_s"]  # the amortised SVDs add, never remove
        assert all(v["step_s"] > 0 for v in r["methods"].values())
    assert payload["machine"]["threads"] == 1 and "load_after" in payload["machine"]
    assert "| in -> out | rank |" in md and "GaLore AdamW" in md and "Reproduce" in md
    assert "Machine:" in md
    _pngs_exist(str(tmp_path), payload)


def test_bench_transformer_quick(tmp_path):
    import bench_transformer
    p = bench_transformer.main(["--quick", "--threads", "1", "--out", str(tmp_path),
                                "--cache-dir", str(tmp_path / "cache")])
    payload, md = _read(str(tmp_path), "transformer_cpu_quick")
    assert payload["size"]["dense_params"] > 0 and payload["size"]["comera_params"] > 0
    stages = [r["stage"] for r in payload["rank_adaptive"]]
    assert stages == ["start (rank 30)", "after stage 1", "after stage 2"]
    last = payload["rank_adaptive"][-1]
    assert last["reached_target"] and last["tt_layer_compression"] >= 80.0 * 0.97
    # whole-model compression from the same parameter counts as the size table
    assert last["model_compression"] == pytest.approx(payload["size"]["dense_params"] / last["params"])
    assert last["model_compression"] < last["tt_layer_compression"]  # the dense parts stay
    methods = set(payload["steps"][0]["methods"])
    assert methods == {"dense AdamW", "comera", "comera pruned to 80x"}
    assert "## Training step" in md and "Reproduce" in md
    _pngs_exist(str(tmp_path), payload)
    assert p["preset"] == "tiny"


def test_bench_accuracy_quick(tmp_path):
    import bench_accuracy
    bench_accuracy.main(["--quick", "--threads", "1", "--out", str(tmp_path),
                         "--cache-dir", str(tmp_path / "cache")])
    payload, md = _read(str(tmp_path), "accuracy_cpu_quick")
    runs, grid, chosen = payload["runs"], payload["grid"], payload["chosen_lr"]
    names = ["dense", "comera (target 8x)", "comera (target 12x)"]
    # every configuration tried the same grid, and kept its best validation rate
    for name in names:
        tried = {g["lr"]: g["valid_accuracy"] for g in grid if g["config"] == name}
        assert sorted(tried) == [1e-3, 3e-3]
        assert tried[chosen[name]] == max(tried.values())
    # three seeds per configuration, all at the chosen rate, test scored
    for name in names:
        rs = [r for r in runs if r["config"] == name]
        assert sorted(r["seed"] for r in rs) == [0, 1, 2] and {r["lr"] for r in rs} == {chosen[name]}
        accs = [r["test_accuracy"] for r in rs]
        agg = payload["aggregate"][name]["test_accuracy"]
        assert agg["mean"] == pytest.approx(sum(accs) / 3)
    assert all(0.0 <= r["test_accuracy"] <= 1.0 and math.isfinite(r["train_loss"]) for r in runs)
    for r in runs:
        if r["config"] != "dense":
            assert r["reached_target"] and r["model_compression"] < r["compression"]
    assert not any("test_accuracy" in g for g in grid)  # the choice never saw the test split
    assert payload["data"]["valid_pairs"] > 0
    assert "| configuration | chosen lr |" in md and "+-" in md
    # with a two-rate grid every choice is on an edge, and the table says so
    assert "Chosen on the edge of the grid" in md
    assert all(f"{name} ({chosen[name]:g})" in md for name in names)
    _pngs_exist(str(tmp_path), payload)


def test_bench_accuracy_quick_cross_arch(tmp_path):
    """The cross-encoder path of the accuracy benchmark still runs end to end."""
    import bench_accuracy
    bench_accuracy.main(["--quick", "--arch", "cross", "--threads", "1", "--out", str(tmp_path),
                         "--cache-dir", str(tmp_path / "cache")])
    payload, md = _read(str(tmp_path), "accuracy_cpu_quick")
    assert "--arch cross" in payload["flags"] and "cross-encoder" in md


def test_split_pair_matches_the_encoded_sides():
    """split_pair recovers exactly the doc and body token lists that encode() wrote."""
    vocab = code_docstring.Vocab(["alpha beta gamma", "def f(x): return x + 1"], 64)
    pairs = [("alpha beta gamma", "def f(x): return x + 1", 1), ("beta", "def g(): pass", 0)]
    enc = code_docstring.encode(pairs, vocab, seq=12, doc_tokens=3)
    doc, body = code_docstring.split_pair(enc.ids, enc.segments, enc.padding, doc_tokens=3)
    assert doc.shape == (2, 3) and body.shape == (2, 10)
    for i, (d, b, _) in enumerate(pairs):
        want_d = vocab.encode(d, 3)
        want_b = vocab.encode(b, 12 - len(want_d) - 2)
        assert doc[i].tolist() == want_d + [code_docstring.PAD] * (3 - len(want_d))
        assert body[i].tolist() == want_b + [code_docstring.PAD] * (10 - len(want_b))


def test_dual_encoder_converts_the_same_linears_and_learns_overlap():
    import bench_accuracy
    from encoder import PRESETS, DualEncoderClassifier, build_model, encoder_linear_names
    cfg = PRESETS["tiny"]
    dense = DualEncoderClassifier(cfg)
    model = build_model(cfg, "comera", rank=2, embedding=False, arch="dual")
    tt = {n for n, m in model.named_modules() if isinstance(m, comera.TTLinear)}
    assert tt == set(encoder_linear_names(dense))
    assert isinstance(model.head[0], torch.nn.Linear)  # the head stays dense
    with pytest.raises(ValueError, match="arch"):
        build_model(cfg, "dense", arch="siamese")
    with pytest.raises(ValueError, match="cfg.seq"):
        dense.embed(torch.ones(1, cfg.seq + 1, dtype=torch.long))
    # padding does not change a pooled vector
    ids = torch.randint(4, cfg.vocab, (2, 5))
    padded = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1)
    dense.eval()
    torch.testing.assert_close(dense.embed(ids), dense.embed(padded), rtol=1e-5, atol=1e-5)
    # the contrastive term is added on matched pairs only, and is what changes the loss
    torch.manual_seed(0)
    b = {"doc": torch.randint(4, cfg.vocab, (6, 4)), "body": torch.randint(4, cfg.vocab, (6, 8)),
         "labels": torch.tensor([1, 1, 0, 1, 0, 1])}
    ce = bench_accuracy.task_loss(dense, b, 0.0)
    both = bench_accuracy.task_loss(dense, b, 1.0)
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(dense(b["doc"], b["body"]), b["labels"]))
    assert both.item() > ce.item()


def test_bench_adaptive_redraw_rewrites_table_and_plot(tmp_path):
    """bench_adaptive's Markdown and plot come from its result JSON alone:
    --redraw on a copy of the committed result rewrites both, with the
    adaptive, fixed-rank and dense rows and what the reduced run left out."""
    import shutil
    import bench_adaptive
    src = os.path.join(BENCH, "results", "adaptive_cpu.json")
    dst = tmp_path / "adaptive_cpu.json"
    shutil.copy(src, dst)
    bench_adaptive.main(["--redraw", str(dst)])
    md = (tmp_path / "adaptive_cpu.md").read_text()
    for word in ("adaptive", "fixed", "dense"):
        assert word in md
    assert (tmp_path / "adaptive_cpu.png").stat().st_size > 0
    with open(dst) as f:
        assert "reduced" in json.load(f)


def test_bench_adaptive_names_choices_on_the_grid_edge():
    """A method whose chosen rate is the smallest or largest of its grid is
    named (the grid did not bracket its best rate); an interior choice is not."""
    import bench_adaptive

    def entry(lr, tried):
        return {"lr": lr, "trials": [{"lr": x} for x in tried]}

    grid = [1e-3, 3e-3, 1e-2]
    res = {"presets": {"tiny": {"dense": entry(3e-3, grid),
                                "targets": {"15.0": {"adaptive": entry(1e-2, grid),
                                                     "fixed": entry(3e-3, grid)}}}}}
    assert bench_adaptive._edge_choices(res) == ["tiny 15.0x adaptive (0.01)"]
    res["presets"]["tiny"]["dense"] = entry(1e-3, grid)
    assert bench_adaptive._edge_choices(res)[0] == "tiny - dense (0.001)"
    res["presets"]["tiny"]["dense"] = entry(1e-3, [1e-3])  # one rate: no grid to speak of
    assert bench_adaptive._edge_choices(res) == ["tiny 15.0x adaptive (0.01)"]


def test_bench_accuracy_grid_survives_a_diverged_rate(tmp_path, monkeypatch):
    """A rate at which comera's training diverges (RankAdaptive refuses NaN
    gates) is recorded as diverged and never chosen; the protocol goes on."""
    import bench_accuracy
    real = bench_accuracy.train_comera

    def train_comera(cfg, data, args, lr, seed, targets):
        if lr == 3e-3 and seed == args.tune_seed:  # the learning-rate choice
            raise ValueError("RankAdaptive.step: gate 0 of layer 'x' contains NaN")
        return real(cfg, data, args, lr, seed, targets)

    monkeypatch.setattr(bench_accuracy, "train_comera", train_comera)
    bench_accuracy.main(["--quick", "--threads", "1", "--out", str(tmp_path),
                         "--cache-dir", str(tmp_path / "cache")])
    payload, md = _read(str(tmp_path), "accuracy_cpu_quick")
    bad = [g for g in payload["grid"] if g.get("diverged")]
    assert {g["config"] for g in bad} == {"comera (target 8x)", "comera (target 12x)"}
    assert all(g["lr"] == 3e-3 and g["valid_accuracy"] is None for g in bad)
    assert all(payload["chosen_lr"][g["config"]] == 1e-3 for g in bad)
    assert "diverged" in md
