"""The benchmarks' timing helper (benchmarks/timing.py): interleaved rounds,
median and spread, the machine record, and subprocess cases that really run
with the thread count asked."""
import json
import os
import statistics
import sys

import pytest
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import timing  # noqa: E402


def test_interleaved_shuffles_the_order_and_counts_reps():
    calls = []
    methods = {name: (lambda n=name: calls.append(n)) for name in "abcd"}
    out = timing.interleaved(methods, reps=8, warmup=1)
    assert calls[:4] == ["a", "b", "c", "d"]  # warm-up, one each
    rounds = [calls[4 + 4 * r: 8 + 4 * r] for r in range(8)]
    assert all(sorted(r) == ["a", "b", "c", "d"] for r in rounds)  # each once a round
    # no method always follows the same one
    for name in "abcd":
        before = {r[r.index(name) - 1] for r in rounds if r.index(name) > 0}
        assert len(before) >= 2, (name, rounds)
    again = []
    timing.interleaved({n: (lambda n=n: again.append(n)) for n in "abcd"}, reps=8, warmup=1)
    assert again == calls  # seeded: a rerun calls in the same order
    for name in "abcd":
        wall = out[name]["wall"]
        assert wall["reps"] == 8
        assert wall["min"] <= wall["median"] <= wall["max"]
        assert wall["iqr"] >= 0
        assert out[name]["cpu"]["reps"] == 8


def test_interleaved_budget_stops_after_three_rounds():
    import time
    out = timing.interleaved({"slow": lambda: time.sleep(0.02)}, reps=50, warmup=0,
                             budget_s=0.01)
    assert out["slow"]["wall"]["reps"] == 3


def test_interleaved_refuses_no_methods():
    with pytest.raises(ValueError, match="methods"):
        timing.interleaved({})


def test_machine_record_has_what_a_reader_needs():
    rec = timing.finish_record(timing.machine_record(measure=False))
    for key in ("cpu_model", "isa", "cores", "torch", "torch_blas", "threads", "load_before",
                "load_after"):
        assert key in rec
    assert rec["torch"] == torch.__version__
    line = timing.machine_line(rec)
    assert rec["cpu_model"] in line and "threads" in line


def test_machine_record_names_the_isa_limits_set(monkeypatch):
    for k in timing.ISA_LIMITS:
        monkeypatch.delenv(k, raising=False)
    assert "isa_limits" not in timing.machine_record(measure=False)
    monkeypatch.setenv("COMERA_ISA", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    rec = timing.machine_record(measure=False)
    assert rec["isa_limits"] == {"COMERA_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    line = timing.machine_line(rec)
    assert "limited by COMERA_ISA=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2" in line


@pytest.mark.parametrize("threads", [1, 2])
def test_subprocess_case_runs_with_the_threads_asked(tmp_path, threads):
    script = tmp_path / "case.py"
    script.write_text(
        "import argparse, json, os, timing, torch\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--threads', type=int)\n"
        "a = ap.parse_args(); timing.assert_threads(a.threads)\n"
        "print(json.dumps({'torch': torch.get_num_threads(),"
        " 'omp': os.environ['OMP_NUM_THREADS']}))\n")
    out = timing.threaded_subprocess([str(script)], threads, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"torch": threads, "omp": str(threads)}


def test_interleaved_keeps_the_round_times_for_paired_ratios():
    out = timing.interleaved({"a": lambda: None, "b": lambda: sum(range(2000))}, reps=5, warmup=0)
    assert len(out["a"]["samples"]) == len(out["b"]["samples"]) == 5
    assert statistics.median(out["b"]["samples"]) == out["b"]["wall"]["median"]


def test_paired_ratio_median_and_interval():
    den = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 0.95]
    num = [3.0 * d for d in den]  # the same ratio every round, whatever the round's speed
    r = timing.paired_ratio(num, den)
    assert r["rounds"] == 7
    assert all(abs(r[k] - 3.0) < 1e-12 for k in ("median", "lo", "hi"))
    noisy = timing.paired_ratio([2.6, 3.4, 2.9, 3.1, 3.0, 2.8, 3.2], [1.0] * 7)
    assert noisy["lo"] < 3.0 < noisy["hi"] and noisy["median"] == 3.0
    assert noisy == timing.paired_ratio([2.6, 3.4, 2.9, 3.1, 3.0, 2.8, 3.2], [1.0] * 7)  # seeded
    with pytest.raises(ValueError, match="equal, non-empty"):
        timing.paired_ratio([1.0], [1.0, 2.0])
