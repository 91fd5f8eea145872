"""The benchmark protocol of benchmarks/README.md ("How we measure", "How we
tune"): validation split by file, seeds and their statistics, compression at
the first and last step, the code-search MRR, the paper-claims table, and the
interleaved pruning benchmark.  The scripts need the benchmark extra."""
import json
import os
import sys

import pytest
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import code_docstring  # noqa: E402


def test_collect_with_validation_keeps_every_file_in_one_split(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i}.py").write_text(
            f'def g{i}(a):\n    """Compute value of file {i} please."""\n'
            f'    b = a + {i}\n    return b * {i} + 1234567 - 7654321\n')
    train, valid, test = code_docstring.collect([str(tmp_path)], max_files=100, valid=True)
    file_of = lambda doc: doc.split("file ")[1].split()[0]
    sets = [{file_of(d) for d, _ in split} for split in (train, valid, test)]
    assert all(sets) and len(train) + len(valid) + len(test) == 60
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    # the same files as without validation: valid is carved from train, test unchanged
    train2, test2 = code_docstring.collect([str(tmp_path)], max_files=100)
    assert test2 == test and sorted(train2) == sorted(train + valid)


def _seed_metrics(loss_d, loss_c, tok_d, tok_c, first, last, seed):
    hist = {"compression": [[0, first * 1.2], [9, last * 1.2]],
            "whole_compression": [[0, first], [9, last]]}
    common = {"valid_perplexity": 1.0, "peak_memory_bytes": 10, "peak_memory_growth_bytes": 5,
              "wall_time_s": 1.0, "parameters": 100, "steps_done": 10}
    return {"command": f"comera pretrain --seed {seed}", "command_wall_s": 1.0,
            "environment": {"threads": 1, "device": "cpu"},
            "methods": {"dense": dict(common, valid_loss=loss_d, tokens_per_s=tok_d, compression_whole=1.0),
                        "comera": dict(common, valid_loss=loss_c, tokens_per_s=tok_c,
                                       compression_whole=last, compression_converted=last * 1.2,
                                       final_ranks={"a": [1, 2], "b": [2, 2]}, history=hist)},
            "comparison": {"valid_loss_relative_difference": (loss_c - loss_d) / loss_d,
                           "speedup_tokens_per_s": tok_c / tok_d, "peak_memory_growth_ratio": 2.0}}


def test_bench_pretrain_entry_means_over_seeds_and_first_last_compression():
    import bench_pretrain
    recs = [bench_pretrain.seed_record(_seed_metrics(6.0, 6.3, 100.0, 150.0, 8.0, 20.0, 0)),
            bench_pretrain.seed_record(_seed_metrics(6.2, 6.2, 100.0, 250.0, 8.0, 24.0, 1))]
    e = bench_pretrain.entry("tiny", [0, 1], recs, {"threads": 1})
    assert e["loss_diff"]["mean"] == pytest.approx((0.05 + 0.0) / 2)
    assert e["speedup"]["mean"] == pytest.approx(2.0) and e["speedup"]["std"] == pytest.approx(0.7071, 1e-3)
    assert e["whole_first"]["mean"] == 8.0 and e["whole_last"]["mean"] == 22.0
    checks = e["targets"]
    assert checks["valid loss within 5% of dense"]
    assert any(k.startswith("converted-layer compression x2") and v for k, v in checks.items())
    paper = bench_pretrain.entry("paper", [0, 1], recs, {"threads": 1})
    assert paper["targets"]["whole-model compression >= 4.23x"]  # checked on the last step


def test_mrr_counts_the_rank_of_the_true_code():
    import bench_codesearch

    class OneHot(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("O", (), {"last_hidden_state": torch.nn.functional.one_hot(input_ids, 8).float()})()

    docs = torch.tensor([[5], [6], [7], [5]])
    codes = torch.tensor([[5], [7], [7], [6]])
    res = bench_codesearch.mrr(OneHot(), docs, codes, pool=4)
    # query 0 (5): codes 5,7,7,6 -> true scores 1, none higher: rank 1
    # query 1 (6): its code 7 scores 0; code 6 scores 1 > 0: rank 2
    # query 2 (7): its code scores 1, code 1 ties (ties count in the doc's favour): rank 1
    # query 3 (5): its code 6 scores 0, code 5 scores 1: rank 2
    assert res["mrr"] == pytest.approx((1 + 0.5 + 1 + 0.5) / 4) and res["pool"] == 4


def test_bench_codesearch_quick(tmp_path):
    """Pre-trains both methods (tiny), fine-tunes each on the same grid and
    seeds, and scores test MRR after the choice."""
    import bench_codesearch
    p = bench_codesearch.main(["--quick", "--threads", "1", "--runs-dir", str(tmp_path / "runs"),
                               "--out", str(tmp_path)])
    with open(tmp_path / "codesearch_cpu_quick.json") as f:
        assert json.load(f)["flags"] == p["flags"]
    md = (tmp_path / "codesearch_cpu_quick.md").read_text()
    assert "| dense |" in md and "| comera |" in md and "Machine:" in md
    for m in ("dense", "comera"):
        r = p["methods"][m]
        assert [g["lr"] for g in r["grid"]] == [1e-4, 1e-3]
        assert r["chosen_lr"] == max(r["grid"], key=lambda g: g["valid"]["mrr"])["lr"]
        assert [s["seed"] for s in r["per_seed"]] == [0, 1, 2]
        assert all(0.0 < s["test"]["mrr"] <= 1.0 and s["test"]["pool"] == 8 for s in r["per_seed"])
    assert p["methods"]["comera"]["encoder_params"] < p["methods"]["dense"]["encoder_params"]
    assert p["data"]["test"] >= 8 and p["data"]["valid"] >= 2


def test_bench_prune_interleaved_rows(tmp_path):
    import bench_prune
    p = bench_prune.main(["--rows", "64", "--reps", "3", "--threads", "1", "--out", str(tmp_path)])
    case = p["cases"][0]
    expected = {"full", "masked", "pruned", "floor", "full_pool_off", "pruned_pool_off"}
    if sys.platform.startswith("linux"):
        expected.add("floor_huge")
    assert set(case["timing"]) == expected
    assert case["pool_off"]["time_ratio"] > 0
    assert all(t["wall"]["reps"] == 3 for t in case["timing"].values())
    assert case["pruned"]["ranks"] == [8, 10, 10, 10, 10] and case["flop_ratio"] > 1.0
    assert p["machine"]["threads"] == 1 and "Machine:" in (tmp_path / "prune_cpu.md").read_text()


def test_make_readme_claims_table_reads_the_results():
    import make_readme
    table = make_readme.claims_table()
    assert "| Paper claim |" in table
    for claim in ("43x", "4.23x", "99x"):
        assert claim in table
    assert "met" in table  # every row is judged, never left blank
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert len(rows) == 4  # the CodeBERT speed claim has a CPU and a GPU row
    for row in rows:
        assert row.rstrip().endswith(("| met |", "| not met |", "| not measured |"))


def _quality_result(loss_c, params_c, step_c, seeds=3):
    def entry(loss, params):
        st = lambda v: {"mean": v, "std": 0.0, "n": seeds, "values": [v] * seeds}  # noqa: E731
        return {"seeds": list(range(seeds)), "steps": [100] * seeds, "test_loss": st(loss),
                "total_params": st(params)}
    return {"budgets": {"steps": {"dense": entry(6.0, 1000.0), "comera": entry(loss_c, params_c)}},
            "calibration": {"step_s_used": {"dense": 0.2, "comera": step_c}},
            "preset": {"layers": 2, "hidden": 128}, "args": {"preset": "mini"},
            "command": "python benchmarks/bench_quality.py"}


def test_claims_codebert_verdict_follows_the_measured_entry(tmp_path, monkeypatch):
    """The CodeBERT CPU row reads the quality protocol (the result with the
    most finished seeds): met only when the compression, the speed-up and
    the test loss all hold; the GPU row reads every GPU pre-training result."""
    import claims
    monkeypatch.setattr(claims, "RESULTS", str(tmp_path))

    def write(loss_c, params_c, step_c, name="quality_cpu", seeds=3):
        with open(tmp_path / f"{name}.json", "w") as f:
            json.dump(_quality_result(loss_c, params_c, step_c, seeds), f)
        return claims.codebert_row()

    assert claims.codebert_row()[-1] == "not measured"   # no result file: never "met"
    assert write(6.1, 200.0, 0.1)[-1] == "met"
    assert write(6.1, 250.0, 0.1)[-1] == "not met"      # compression 4x, short of 4.23x
    assert write(6.1, 200.0, 0.13)[-1] == "not met"     # 1.5x is not about 2x
    row = write(6.9, 200.0, 0.1)                        # loss 15% worse than dense
    assert row[-1] == "not met" and "+15.0%" in row[1] and "5.0x" in row[1]
    row = write(6.0, 200.0, 0.1, name="quality_cpu_1500steps", seeds=2)
    assert "quality_cpu.md" in row[1]                   # 3 seeds beat 2
    assert claims.codebert_gpu_row()[-1] == "not measured"
    with open(tmp_path / "gpu_pretrain_x.json", "w") as f:
        json.dump({"methods": {"dense": {"tokens_per_s": 100.0}, "comera": {"tokens_per_s": 30.0}}}, f)
    row = claims.codebert_gpu_row()
    assert row[-1] == "not met" and "0.30x" in row[1]
    assert claims.dlrm_row()[-1] == "not measured"


def test_make_readme_flags_results_measured_before_the_protocol(tmp_path, monkeypatch):
    import make_readme
    monkeypatch.setattr(make_readme, "RESULTS", str(tmp_path))
    (tmp_path / "transformer_cpu.md").write_text("# old table\n")
    (tmp_path / "transformer_cpu.json").write_text(json.dumps({"clock": "cpu"}))
    assert "to be regenerated" in make_readme.section("transformer_cpu", "Transformer")
    (tmp_path / "transformer_cpu.json").write_text(json.dumps({"clock": "wall", "interleaved": True}))
    assert "to be regenerated" not in make_readme.section("transformer_cpu", "Transformer")
    (tmp_path / "peers_cpu.md").write_text("# a table\n")
    # a longer result name keeps its plots to itself
    for png in ("peers_cpu_step_time.png", "peers_cpu_linear_linear_time.png"):
        (tmp_path / png).write_bytes(b"\x89PNG")
    text = make_readme.section("peers_cpu", "Peers")
    assert "peers_cpu_step_time.png" in text and "peers_cpu_linear_linear_time.png" not in text
