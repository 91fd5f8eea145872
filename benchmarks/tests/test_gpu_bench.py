"""The CPU-side logic of the GPU check: benchmarks/gpu_bench.py in its tiny CPU
mode, the reading of the speed targets and of pre-training rates, and
benchmarks/gpu_check.sh as a dry run (no build, tests skipped, tiny CPU
benchmarks, a two-step pre-training)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_bench  # noqa: E402

LINEAR_METHODS = {"nn.Linear", "nn.Linear compiled", "comera.TTLinear"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = gpu_bench.main(["--out", str(out), "--device", "cpu", "--tiny", "--budget-s", "120",
                             "--compile-backend", "eager"])
    return out, result


def test_tiny_cpu_run_writes_json_and_markdown(tiny_run):
    out, result = tiny_run
    saved = json.loads((out / "gpu_bench.json").read_text())
    assert saved["machine"]["device"] == "cpu" and saved["machine"]["gpu"] is None
    assert {p.name for p in out.iterdir()} >= {f"gpu_bench_{s}.json" for s in gpu_bench.SECTIONS}
    assert saved["missing"] == ["pretrain"]  # not asked for
    lin = saved["linear"]
    assert len(lin) == 1 and lin[0]["mode"] == "eager" and lin[0]["dtype"] == "float32"
    assert set(lin[0]["ms"]) == LINEAR_METHODS and "errors" not in lin[0]
    assert all(v > 0 for v in lin[0]["ms"].values())
    assert lin[0]["x_vs_dense"]["nn.Linear"] == pytest.approx(1.0)
    assert lin[0]["x_vs_compiled"]["nn.Linear compiled"] == pytest.approx(1.0)
    assert lin[0]["predicted_ms"]["comera.TTLinear"] > 0 and lin[0]["predicted_ms"]["launches"] > 2
    tr = saved["transformer"]
    assert len(tr) == 1 and set(tr[0]["ms"]) == {"dense", "dense compiled", "comera",
                                                 "comera+tt_embedding"}
    assert tr[0]["params"]["comera"] < tr[0]["params"]["dense"] == tr[0]["params"]["dense compiled"]
    emb = saved["embedding"]
    assert len(emb) == 1 and emb[0]["mode"] == "eager" and emb[0]["cuda_kernels"] is False
    assert set(emb[0]["ms"]) == {"nn.Embedding", "nn.Embedding compiled", "comera.TTEmbedding",
                                 "comera.TTEmbedding capturable"}
    assert all(v > 0 for v in emb[0]["ms"].values()) and "errors" not in emb[0]
    md = (out / "gpu_bench.md").read_text()
    assert '- eager {"in": 48, "out": 96' in md and "x compiled:" in md
    assert "comera.TTEmbedding capturable" in md
    assert "## transformer" in md and "dense compiled" in md


def test_a_failing_method_is_recorded_and_the_others_run():
    case = {"ms": {}}
    args = type("A", (), {"warmup": 1, "loops": 1, "inner": 1})()

    def broken():
        raise RuntimeError("capture failed")
    gpu_bench.run_case(case, "bad", broken, torch.device("cpu"), "eager", args)
    gpu_bench.run_case(case, "good", lambda: (lambda: None), torch.device("cpu"), "eager", args)
    assert case["errors"] == {"bad": "RuntimeError: capture failed"} and set(case["ms"]) == {"good"}


def test_graph_case_builds_a_capturable_embedding():
    cfg = gpu_bench.transformer_config(type("A", (), {"tiny": True})())
    graph = gpu_bench.build_transformer("comera+tt_embedding", cfg, "cpu", capturable=True)
    eager = gpu_bench.build_transformer("comera+tt_embedding", cfg, "cpu")
    assert graph.tok.capturable and not eager.tok.capturable
    ids = torch.randint(0, cfg["vocab"], (2, cfg["seq"]))
    torch.testing.assert_close(graph(ids), eager(ids))  # same seed, same numbers


def _case(mode, x, xc):
    return {"mode": mode, "x_vs_dense": {"nn.Linear": 1.0, "comera.TTLinear": x},
            "x_vs_compiled": {"comera.TTLinear": xc}}


def test_targets_are_read_from_the_matching_cases():
    result = {
        "linear": [_case("eager", 1.6, 1.2), _case("graph", 1.9, 1.1)],
        "embedding": [{"mode": "graph", "x_vs_dense": {"comera.TTEmbedding": 9.0,
                                                        "comera.TTEmbedding capturable": 0.5}}],
        "transformer": [{"mode": "eager", "config": {"layers": 6}, "x_vs_dense": {"comera": 1.4}},
                        {"mode": "graph", "config": {"layers": 2}, "x_vs_dense": {"comera": 9.0}}],
        "pretrain": [{"mode": "eager", "x_vs_dense": {"comera": 1.2}}],
    }
    got = {t["target"]: (t["want_x"], t["got_x"], t["met"], t.get("x_vs_compiled"))
           for t in gpu_bench.targets(result)}
    assert got == {
        "linear (eager): comera.TTLinear vs dense": (1.5, 1.6, True, 1.2),
        "linear (graph): comera.TTLinear vs dense": (2.0, 1.9, False, 1.1),
        # a graph holds the capturable layer only
        "embedding (graph): comera.TTEmbedding capturable vs dense": (1.0, 0.5, False, None),
        "transformer (eager): comera vs dense": (1.3, 1.4, True, None),  # six encoders only
        "pretrain (eager): comera vs dense": (1.3, 1.2, False, None),
    }


def test_steady_tokens_per_s_leaves_out_the_first_logged_steps():
    # running rates: 10 steps in 0.1 s (compiling), then 10 more in 1/30 s
    history = {"tokens_per_s": [[10, 100.0], [20, 150.0]]}
    assert gpu_bench.steady_tokens_per_s(history) == pytest.approx(300.0)
    assert gpu_bench.steady_tokens_per_s({"tokens_per_s": [[10, 100.0]]}) is None
    assert gpu_bench.steady_tokens_per_s({}) is None


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    env.pop("COMERA_TEST_CUDA_DEVICE", None)
    env.pop("RESULTS", None)
    committed = set(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "summary.md").read_text()
    assert proc.returncode == 0, summary[:3000]
    assert "(dry run)" in summary and "- build: skipped (dry run" in summary
    # without a GPU every needs_cuda test is collected and skipped
    assert "- tests: ok:" in summary and "skipped" in summary
    for stage in ("linear", "embedding", "transformer"):
        assert f"- {stage}: ok (dry run: tiny sizes on the CPU, no CUDA graphs)" in summary
    assert "- pretrain: both: ok; dense --compile: ok" in summary
    results = sorted(os.listdir(tmp_path / "results"))
    assert len(results) == 3, results
    assert results[0].startswith("gpu_") and results[0].endswith(".json")
    assert results[2].startswith("gpu_check_") and results[2].endswith(".md")
    saved = json.loads((tmp_path / "results" / results[0]).read_text())
    assert saved["missing"] == []
    assert set(saved["linear"][0]["ms"]) == LINEAR_METHODS
    pre = saved["pretrain"][0]
    assert set(pre["tokens_per_s"]) == {"dense", "comera", "dense compiled"}
    assert pre["runs"]["dense compiled"]["compile"] is True
    assert pre["x_vs_dense"]["dense"] == pytest.approx(1.0)
    assert "x_vs_compiled" in pre and "comera" in pre["x_vs_compiled"]
    assert "comera GPU benchmarks" in summary and "## pretrain" in summary
    # the dry run writes nothing into the repository's results
    assert not set(results) & (set(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
                               - committed)
