"""The quality protocol (bench_quality.py): held-out split, unigram
baseline, MRR over every test pair, fixed ranks within 2% of a size, the
targets and the resumable run store.  Fast: no training run here."""
import argparse
import json
import math
import os
import sys

import pytest
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import bench_quality as bq  # noqa: E402


def test_heldout_split_is_disjoint_and_stable():
    rels = [f"pkg/m{i}.py" for i in range(40)]
    v, t = bq.split_heldout(rels)
    assert len(v) == 10 and len(t) == 30 and not set(v) & set(t) and sorted(v + t) == sorted(rels)
    assert bq.split_heldout(list(reversed(rels))) == (v, t)  # by the path, not the order


def test_unigram_cross_entropy_matches_the_formula():
    ids = torch.tensor([5, 5, 6, 7, 7, 7])
    labels = torch.tensor([[5, -100], [7, 9]])
    counts = torch.tensor([1, 1, 1, 1, 1, 3, 2, 4, 1, 1], dtype=torch.float64)  # add-one, vocab 10
    want = -float(torch.log(counts[[5, 7, 9]] / counts.sum()).mean())
    assert bq.unigram_cross_entropy(ids, labels, 10) == pytest.approx(want)


def test_mrr_pools_use_every_pair_once_with_full_pools():
    from bench_codesearch import pools
    for n, pool in ((2555, 1000), (1000, 1000), (7, 3), (2, 5)):
        seen = []
        for idx, queries in pools(n, pool, seed=1):
            assert len(idx) == min(n, pool)
            seen += idx[queries].tolist()
        assert sorted(seen) == list(range(n))


def test_mrr_scores_the_remainder_against_a_full_pool():
    import bench_codesearch

    class OneHot(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("O", (), {"last_hidden_state": torch.nn.functional.one_hot(input_ids, 8).float()})()

    ids = torch.tensor([[3], [4], [5], [6], [7]])
    assert bench_codesearch.mrr(OneHot(), ids, ids, pool=2) == {"mrr": 1.0, "pool": 2, "queries": 5}
    # every doc is token 5; pair 0's code is token 5 too, the others' token 6: a query other than
    # pair 0 ranks 2nd when pair 0 is in its pool, else 1st
    docs, codes = torch.full((5, 1), 5), torch.tensor([[5], [6], [6], [6], [6]])
    want = []
    for idx, queries in bench_codesearch.pools(5, 2, seed=3):
        want += [0.5 if 0 in idx.tolist() and int(idx[q]) != 0 else 1.0 for q in queries.tolist()]
    res = bench_codesearch.mrr(OneHot(), docs, codes, pool=2, seed=3)
    assert res["queries"] == 5 and res["mrr"] == pytest.approx(sum(want) / 5) and res["mrr"] < 1.0


def test_fixed_ranks_land_within_two_percent():
    from comera.pretrain.model import count_parameters, build_comera, preset
    p = preset("tiny")
    p.layers, p.hidden, p.heads, p.ffn, p.seq_len, p.vocab_size = 1, 64, 2, 256, 32, 1000
    start = count_parameters(build_comera(p, 1000, 0))["converted_tt"]
    for target in (start / 6.3, start / 2.7):
        ranks, size = bq.fixed_ranks_for(p, 1000, target)
        assert abs(size / target - 1) <= 0.02, (size, target, ranks)
        assert size == bq.converted_size(p, 1000, ranks)


def _rec(method, seed, loss, mrr, enc, tt=100):
    return {"method": method, "seed": seed, "steps": 10, "lr": 1e-3, "test_loss": loss, "valid_loss": loss,
            "codesearch": {"lr": 1e-3, "test": {"mrr": mrr}}, "tokens_per_s": 1.0, "train_s": 1.0,
            "peak_memory_growth_bytes": 1, "sizes": {"encoder": enc, "total": enc, "converted_tt": tt},
            "history": {"step": [10], "train_s": [1.0], "valid": [loss], "loss": [loss]}}


def test_targets_read_the_finished_runs_and_report_missing_ones(tmp_path):
    args = argparse.Namespace(seeds=[0, 1], tune_seed=9, lrs=[1e-3], ft_lrs=[1e-3])
    p = argparse.Namespace(steps=10)
    store = bq.Store(str(tmp_path), "k")
    res = bq.collect(store, p, args)
    assert [t["met"] for t in res["targets"]] == [None, None, None]
    store.put("calibration", {"wall_steps": {"dense": 10, "comera": 12, "fixed": 12}})
    for s in (0, 1):
        store.put(f"steps-dense-seed{s}", _rec("dense", s, 4.0 + s * 0.01, 0.30, 1000))
        store.put(f"steps-comera-seed{s}", _rec("comera", s, 4.1 + s * 0.01, 0.30, 80))
        store.put(f"steps-fixed-seed{s}", _rec("fixed", s, 4.3 + s * 0.01, 0.20, 80))
        store.put(f"wall-comera-seed{s}", _rec("comera", s, 3.95 + s * 0.01, 0.295, 80))
        store.put(f"wall-fixed-seed{s}", _rec("fixed", s, 4.2 + s * 0.01, 0.31, 80))
    res = bq.collect(store, p, args)
    wall, steps, adaptive = res["targets"]
    # wall: loss 3.955 <= 4.005, MRR 0.295 >= 0.29, 12.5x fewer encoder parameters
    assert wall["met"] is True and "12.50x" in wall["got"]
    assert steps["met"] is True and steps["got"].startswith("+2.50%")
    # adaptive wins both losses beyond the spread, loses the MRR: 2 of 3
    assert adaptive["met"] is True and adaptive["got"].startswith("2 of 3")
    assert res["budgets"]["wall"]["dense"]["seeds"] == [0, 1]  # the equal-steps dense runs
    store.put("wall-comera-seed1", _rec("comera", 1, 4.5, 0.1, 80))
    res = bq.collect(store, p, args)
    assert res["targets"][0]["met"] is False
    other = bq.Store(str(tmp_path), "another-setting")  # other settings: nothing is reused
    assert other.get("wall-comera-seed1") is None
    other.put("wall-comera-seed1", _rec("comera", 1, 4.0, 0.2, 80))  # ... and nothing is lost
    assert other.get("wall-comera-seed1")["test_loss"] == 4.0
    with open(tmp_path / "wall-comera-seed1.settings-k.json") as fh:
        assert json.load(fh)["test_loss"] == 4.5


def test_seed_order_rotates_and_comera_precedes_fixed():
    orders = [bq.order_for(s) for s in range(3)]
    assert len({o.index("dense") for o in orders}) == 3
    assert all(o.index("comera") < o.index("fixed") for o in orders)


class _Steps:
    """A stepper, schedule and batch source that replay a list of losses."""

    def __init__(self, losses):
        self.losses, self.sched_steps, self.batches = list(losses), 0, []

    def batch(self, step):
        self.batches.append(step)
        return step, step

    def step(self, inputs, labels):
        return self.losses[inputs]


class _Sched:
    def __init__(self):
        self.n = 0

    def step(self):
        self.n += 1


@pytest.mark.parametrize("steps,evals,want_steps", [(10, 3, [3, 6, 9, 10]), (4, 10, [1, 2, 3, 4])])
def test_train_curve_records_every_steps_over_evals_and_at_the_end(steps, evals, want_steps):
    run, sched, scores = _Steps([float(i) for i in range(steps)]), _Sched(), iter(range(100))
    losses, hist, train_s = bq.train_curve(run, sched, run, steps, evals, lambda: next(scores),
                                           log=lambda *_: None)
    assert losses == [float(i) for i in range(steps)] and run.batches == list(range(steps))
    assert sched.n == steps and train_s >= 0
    assert hist["step"] == want_steps and hist["valid"] == list(range(len(want_steps)))
    every = max(1, steps // evals)
    assert hist["loss"][0] == sum(range(every)) / every
    assert hist["train_s"] == sorted(hist["train_s"])


def test_train_curve_stops_at_a_non_finite_loss():
    run, logged = _Steps([1.0, 2.0, math.nan, 3.0]), []
    losses, hist, _ = bq.train_curve(run, _Sched(), run, 4, 4, lambda: 0.0, log=logged.append,
                                     name="dense")
    assert len(losses) == 3 and math.isnan(losses[-1]) and hist["step"] == [1, 2]
    assert logged == ["    dense: loss nan at step 3: stopped"]
