"""The CPU-side logic of the GPU check: benchmarks/gpu_bench.py in its tiny CPU
mode, the reading of the GPU targets, and benchmarks/gpu_check.sh as a
dry run (no build, tests skipped, tiny CPU benchmarks)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_bench  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = gpu_bench.main(["--out", str(out), "--device", "cpu", "--tiny", "--budget-s", "120"])
    return out, result


def test_tiny_cpu_run_writes_json_and_markdown(tiny_run):
    out, result = tiny_run
    saved = json.loads((out / "gpu_bench.json").read_text())
    assert saved["machine"]["device"] == "cpu" and saved["machine"]["gpu"] is None
    lin = saved["linear"]
    assert len(lin) == 1 and lin[0]["mode"] == "eager" and lin[0]["dtype"] == "float32"
    assert set(lin[0]["ms"]) == {"nn.Linear", "comera.TTLinear", "matmul merge"}
    assert all(v > 0 for v in lin[0]["ms"].values())
    assert lin[0]["x_vs_nn_linear"]["nn.Linear"] == pytest.approx(1.0)
    tr = saved["transformer"]
    assert len(tr) == 1 and {"dense", "comera"} <= set(tr[0]["ms"])
    assert tr[0]["params"]["comera"] < tr[0]["params"]["dense"]
    emb = saved["embedding"]
    assert len(emb) == 1 and emb[0]["mode"] == "eager" and emb[0]["cuda_kernels"] is False
    assert set(emb[0]["ms"]) == {"nn.Embedding", "comera.TTEmbedding",
                                 "comera.TTEmbedding capturable"}
    assert all(v > 0 for v in emb[0]["ms"].values()) and "errors" not in emb[0]
    assert "comera+tt_embedding" in tr[0]["ms"]
    md = (out / "gpu_bench.md").read_text()
    assert "| float32 | eager | 48 -> 96 |" in md
    assert "comera.TTEmbedding capturable" in md
    assert "Transformer training step" in md and "dense" in md


def test_graph_case_builds_a_capturable_embedding():
    cfg = gpu_bench.transformer_config(type("A", (), {"tiny": True})())
    graph = gpu_bench.build_transformer("comera+tt_embedding", cfg, "cpu", capturable=True)
    eager = gpu_bench.build_transformer("comera+tt_embedding", cfg, "cpu")
    assert graph.tok.capturable and not eager.tok.capturable
    ids = torch.randint(0, cfg["vocab"], (2, cfg["seq"]))
    torch.testing.assert_close(graph(ids), eager(ids))  # same seed, same numbers


def _case(mode, x):
    return {"in": 768, "out": 3072, "rank": 30, "rows": 4096, "dtype": "bfloat16", "mode": mode,
            "ms": {"nn.Linear": 1.0, "comera.TTLinear": 1.0 / x, "matmul merge": 0.5},
            "x_vs_nn_linear": {"nn.Linear": 1.0, "comera.TTLinear": x, "matmul merge": 2.0}}


def test_targets_are_read_from_the_matching_cases():
    result = {
        "linear": [_case("eager", 3.0), _case("graph", 6.0),
                   dict(_case("graph", 9.0), dtype="float32")],  # wrong dtype: ignored
        "transformer": [{"mode": "eager", "x_vs_dense": {"dense": 1.0, "comera": 1.5}},
                        {"mode": "graph", "x_vs_dense": {"dense": 1.0, "comera": 2.5}}],
    }
    got = {(t["target"], t["met"]): t["got_x"] for t in gpu_bench.targets(result)}
    assert len(got) == 4
    assert [x for (name, met), x in got.items() if "TTLinear" in name] == [3.0, 6.0]
    assert {met for (name, met) in got if "(eager)" in name} == {False}
    assert {met for (name, met) in got if "(graph)" in name} == {True}


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    env.pop("COMERA_TEST_CUDA_DEVICE", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "summary.md").read_text()
    assert "- build: skipped (dry run)" in summary, proc.stdout[-3000:]
    assert "- benchmarks: ok" in summary, (tmp_path / "bench.log").read_text()[-3000:]
    # without a GPU every needs_cuda test is collected and skipped
    assert "- tests (needs_cuda): ok:" in summary and "skipped" in summary
    assert proc.returncode == 0
    results = sorted(os.listdir(tmp_path / "results"))
    assert len(results) == 2 and results[0].startswith("gpu_") and results[0].endswith(".json")
    assert "comera GPU benchmarks" in summary
