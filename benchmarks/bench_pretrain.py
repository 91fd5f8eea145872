"""Dense against CoMERA pre-training, one preset per call, recorded in
benchmarks/results/pretrain_<device>.{json,md}.

    python benchmarks/bench_pretrain.py --preset tiny --seeds 0 1 2 --threads 2
    python benchmarks/bench_pretrain.py --preset paper --steps 40 --seeds 0 1 2

Each seed runs ``comera pretrain --method both --seed S`` in a fresh process
(both methods, the same steps, data and seed) with --threads N and
OMP_NUM_THREADS=N; the process asserts the count before and after the run
(timing.assert_threads) and the run's own record of its threads is checked
here.  The entry (keyed by preset, steps and seeds) keeps every seed's
numbers, their mean +- standard deviation and the machine record; the
Markdown table is rewritten from all entries.  Compression is shown at the
first and at the last step, so that what rank adaptation removed is told
apart from what the starting ranks give.  The targets below are checked on
the means and shown, never asserted.  Speed is tokens per second of wall
clock (the training loop's own timer).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)

# Paper preset, same steps: compression >= 4.23x and >= 1.5x the dense
# tokens/s; tiny preset at its default budget: validation loss within 5%, the
# converted layers' live-rank compression at least doubles from the first to
# the last step, and the layers end with different ranks.
TARGETS = {"paper": {"compression_whole": 4.23, "speedup": 1.5},
           "tiny": {"loss_within": 0.05, "compression_growth": 2.0, "ranks_differ": True}}


def run_case(case: dict) -> dict:
    """In the subprocess: ``comera pretrain`` with the case's arguments, in
    this process, between two thread-count assertions; returns metrics.json."""
    from timing import assert_threads
    assert_threads(case["threads"])
    sys.path.insert(0, REPO)  # this checkout's comera, as `python -m comera` run there would import
    from comera.__main__ import main as comera_main
    status = comera_main(case["argv"])
    assert_threads(case["threads"])
    if status != 0:
        raise SystemExit(f"comera pretrain exited with {status}")
    with open(os.path.join(REPO, case["out"], "metrics.json")) as fh:
        return json.load(fh)


def run(preset: str, steps, seed: int, threads: int, out: str, extra) -> dict:
    from timing import threaded_subprocess
    argv = ["pretrain", "--method", "both", "--preset", preset, "--seed", str(seed), "--threads",
            str(threads), "--out", out, "--quiet"] + (["--steps", str(steps)] if steps else []) + list(extra)
    print("+ comera", " ".join(argv), flush=True)
    t0 = time.time()
    res = threaded_subprocess([os.path.abspath(__file__), "--case",
                               json.dumps({"argv": argv, "out": out, "threads": threads})],
                              threads, timeout=24 * 3600, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"comera {' '.join(argv)} failed: {res.stderr[-3000:]}")
    with open(os.path.join(REPO, out, "metrics.json")) as fh:
        metrics = json.load(fh)
    if metrics["environment"]["threads"] != threads:
        raise RuntimeError(f"asked for {threads} threads, the run recorded "
                           f"{metrics['environment']['threads']}")
    metrics["command_wall_s"] = time.time() - t0
    metrics["command"] = "comera " + " ".join(argv)
    return metrics


DENSE_KEYS = ("valid_loss", "valid_perplexity", "tokens_per_s", "peak_memory_bytes",
              "peak_memory_growth_bytes", "wall_time_s", "parameters", "compression_whole")


def seed_record(metrics: dict) -> dict:
    """One seed's numbers: both methods, the comparison, and the CoMERA
    compression at the first and the last step."""
    d, c = metrics["methods"]["dense"], metrics["methods"]["comera"]
    rec = {"command": metrics["command"], "command_wall_s": metrics["command_wall_s"],
           "environment": metrics["environment"], "steps": d["steps_done"],
           "dense": {k: d[k] for k in DENSE_KEYS},
           "comera": {k: c[k] for k in DENSE_KEYS + ("compression_converted", "final_ranks")},
           "comparison": metrics["comparison"]}
    hist = c["history"]
    for key, name in (("compression", "converted"), ("whole_compression", "whole")):
        series = hist.get(key) or []
        if series:
            rec["comera"][f"compression_{name}_first_last"] = [series[0][1], series[-1][1]]
    return rec


def _stats(values):
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def entry(preset: str, seeds: list, records: list, machine: dict) -> dict:
    """Mean +- std over seeds and the target checks on the means."""
    get = lambda f: _stats([f(r) for r in records])
    e = {"preset": preset, "steps": records[0]["steps"], "seeds": seeds, "machine": machine,
         "per_seed": records,
         "dense_valid_loss": get(lambda r: r["dense"]["valid_loss"]),
         "comera_valid_loss": get(lambda r: r["comera"]["valid_loss"]),
         "loss_diff": get(lambda r: r["comparison"]["valid_loss_relative_difference"]),
         "dense_tokens_per_s": get(lambda r: r["dense"]["tokens_per_s"]),
         "comera_tokens_per_s": get(lambda r: r["comera"]["tokens_per_s"]),
         "speedup": get(lambda r: r["comparison"]["speedup_tokens_per_s"]),
         "whole_first": get(lambda r: r["comera"]["compression_whole_first_last"][0]),
         "whole_last": get(lambda r: r["comera"]["compression_whole_first_last"][1]),
         "converted_first": get(lambda r: r["comera"]["compression_converted_first_last"][0]),
         "converted_last": get(lambda r: r["comera"]["compression_converted_first_last"][1]),
         "memory_ratio": get(lambda r: r["comparison"]["peak_memory_growth_ratio"] or 0.0)}
    t, checks = TARGETS.get(preset, {}), {}
    if "compression_whole" in t:
        checks[f"whole-model compression >= {t['compression_whole']}x"] = \
            e["whole_last"]["mean"] >= t["compression_whole"]
    if "speedup" in t:
        checks[f"tokens/s >= {t['speedup']}x dense"] = e["speedup"]["mean"] >= t["speedup"]
    if "loss_within" in t:
        checks[f"valid loss within {100 * t['loss_within']:.0f}% of dense"] = \
            abs(e["loss_diff"]["mean"]) <= t["loss_within"]
    if "compression_growth" in t:
        checks[f"converted-layer compression x{t['compression_growth']:g} from first to last step"] = \
            e["converted_last"]["mean"] / e["converted_first"]["mean"] >= t["compression_growth"]
    if t.get("ranks_differ"):
        distinct = [len({tuple(v) for v in (r["comera"]["final_ranks"] or {}).values()}) for r in records]
        checks[f"layers end with different ranks ({min(distinct)}+ distinct patterns)"] = min(distinct) > 1
    e["targets"] = checks
    return e


def _pm(s, fmt=".4f", scale=1.0):
    return f"{s['mean'] * scale:{fmt}} +- {s['std'] * scale:{fmt.lstrip('+')}}"


def markdown(entries: dict, device: str) -> str:
    from timing import machine_line
    lines = [f"# comera pretrain: dense against CoMERA ({device})", "",
             "Written by `benchmarks/bench_pretrain.py`; each row is one `comera pretrain --method both` "
             "run per seed (same data, seed and steps for both methods), mean +- standard deviation "
             "over the seeds. Ratios are CoMERA over dense from the same run. Compression is CoMERA's "
             "at the first -> the last step (the first is the starting ranks alone). Speed: tokens/s "
             "of wall clock.", "",
             "| preset | steps | seeds | dense loss | CoMERA loss | loss diff % | speed-up | whole-model "
             "compression | converted-layer compression | memory reduction (growth) | targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(entries):
        e = entries[key]
        if "per_seed" not in e:
            continue
        targets = "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in e["targets"].items()) or "-"
        lines.append(
            f"| {e['preset']} | {e['steps']} | {len(e['seeds'])} | {_pm(e['dense_valid_loss'])} | "
            f"{_pm(e['comera_valid_loss'])} | {_pm(e['loss_diff'], '+.2f', 100)} | "
            f"{_pm(e['speedup'], '.2f')}x | {e['whole_first']['mean']:.2f}x -> "
            f"{_pm(e['whole_last'], '.2f')}x | {e['converted_first']['mean']:.2f}x -> "
            f"{_pm(e['converted_last'], '.2f')}x | {_pm(e['memory_ratio'], '.2f')}x | {targets} |")
    lines += ["", "Commands and machines:", ""]
    for key in sorted(entries):
        e = entries[key]
        if "per_seed" not in e:
            continue
        r = e["per_seed"][0]
        lines.append(f"- `{r['command']}` and the other seeds "
                     f"({sum(x['command_wall_s'] for x in e['per_seed']) / 60:.1f} min in all). "
                     + machine_line(e["machine"]))
    legacy = [k for k in sorted(entries) if "per_seed" not in entries[k]]
    if legacy:
        lines += ["", "Older runs, before the protocol above (one seed, no machine record, final "
                  "compression only; the thread count is the run's own record):", "",
                  "| preset | steps | loss diff % | speed-up | whole-model compression (last) | command |",
                  "|---|---|---|---|---|---|"]
        for k in legacy:
            e, c = entries[k], entries[k]["comparison"]
            lines.append(f"| {e['preset']} | {e['steps']} | {100 * c['valid_loss_relative_difference']:+.2f} | "
                         f"{c['speedup_tokens_per_s']:.2f}x | {c['compression_whole']:.2f}x | "
                         f"`{e['command']}` ({e['environment']['threads']} threads) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small", "paper"])
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="run directory prefix (default runs/bench-<preset>-<time>)")
    ap.add_argument("--results", default=RESULTS, help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    if args.case:
        run_case(json.loads(args.case))
        return None
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds must be distinct, got {args.seeds}")
    from timing import assert_threads, finish_record, machine_record
    assert_threads(args.threads)
    machine = machine_record()
    # Relative to the repository (the command runs there), so no machine path is recorded.
    out = args.out or os.path.join("runs", f"bench-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    records = [seed_record(run(args.preset, args.steps, s, args.threads, f"{out}-seed{s}", extra))
               for s in args.seeds]
    finish_record(machine)
    device = "gpu" if records[0]["environment"]["device"].startswith("cuda") else "cpu"
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"pretrain_{device}.json")
    entries = {}
    if os.path.exists(path):
        with open(path) as fh:
            entries = json.load(fh)
    e = entry(args.preset, args.seeds, records, machine)
    entries[f"{args.preset}-{e['steps']}-seeds{len(args.seeds)}"] = e
    with open(path, "w") as fh:
        json.dump(entries, fh, indent=1)
    md = markdown(entries, device.upper())
    with open(os.path.join(args.results, f"pretrain_{device}.md"), "w") as fh:
        fh.write(md)
    print(md)
    return e


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
