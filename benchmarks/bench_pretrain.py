"""Dense against CoMERA pre-training, one preset per call, recorded in
benchmarks/results/pretrain_<device>.{json,md}.

    python benchmarks/bench_pretrain.py --preset tiny            # its default budget
    python benchmarks/bench_pretrain.py --preset paper --steps 40

Each call runs ``comera pretrain --method both`` in a fresh process (both
methods, the same steps, data and seed), then adds its numbers to the JSON
(keyed by preset and steps) and rewrites the Markdown table from it.  The
targets of issue 7 are checked and shown, never asserted.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)

# Issue 7: paper preset, same steps: compression >= 4.23x and >= 1.5x the dense
# tokens/s; tiny preset at its default budget: validation loss within 5%.
# Issue 16, tiny preset: the converted layers' live-rank compression at least
# doubles from the first to the last step, and the layers end with different ranks.
TARGETS = {"paper": {"compression_whole": 4.23, "speedup": 1.5},
           "tiny": {"loss_within": 0.05, "compression_growth": 2.0, "ranks_differ": True}}


def run(preset: str, steps, out: str, extra) -> dict:
    cmd = [sys.executable, "-m", "comera", "pretrain", "--method", "both", "--preset", preset,
           "--out", out, "--quiet"] + (["--steps", str(steps)] if steps else []) + list(extra)
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=REPO)
    with open(os.path.join(REPO, out, "metrics.json")) as fh:
        metrics = json.load(fh)
    metrics["command_wall_s"] = time.time() - t0
    metrics["command"] = " ".join(["comera"] + cmd[3:])
    return metrics


def entry(preset: str, metrics: dict) -> dict:
    d, c = metrics["methods"]["dense"], metrics["methods"]["comera"]
    cmp_ = metrics["comparison"]
    e = {
        "preset": preset, "steps": d["steps_done"], "command": metrics["command"],
        "command_wall_s": metrics["command_wall_s"], "environment": metrics["environment"],
        "dense": {k: d[k] for k in ("valid_loss", "valid_perplexity", "tokens_per_s", "peak_memory_bytes",
                                    "peak_memory_growth_bytes", "wall_time_s", "parameters",
                                    "compression_whole")},
        "comera": {k: c[k] for k in ("valid_loss", "valid_perplexity", "tokens_per_s", "peak_memory_bytes",
                                     "peak_memory_growth_bytes", "wall_time_s", "parameters",
                                     "compression_whole", "compression_converted", "final_ranks")},
        "comparison": cmp_,
    }
    t = TARGETS.get(preset, {})
    checks = {}
    if "compression_whole" in t:
        checks[f"compression >= {t['compression_whole']}x"] = cmp_["compression_whole"] >= t["compression_whole"]
    if "speedup" in t:
        checks[f"tokens/s >= {t['speedup']}x dense"] = cmp_["speedup_tokens_per_s"] >= t["speedup"]
    if "loss_within" in t:
        checks[f"valid loss within {100 * t['loss_within']:.0f}% of dense"] = \
            abs(cmp_["valid_loss_relative_difference"]) <= t["loss_within"]
    if "compression_growth" in t:
        series = c["history"]["compression"]
        growth = series[-1][1] / series[0][1]
        e["comera"]["compression_first_last"] = [series[0][1], series[-1][1]]
        checks[f"converted-layer compression x{t['compression_growth']:g} from first to last step "
               f"({series[0][1]:.2f}x -> {series[-1][1]:.2f}x)"] = growth >= t["compression_growth"]
    if t.get("ranks_differ"):
        ranks = c["final_ranks"] or {}
        distinct = len({tuple(v) for v in ranks.values()})
        checks[f"layers end with different ranks ({distinct} distinct of {len(ranks)})"] = distinct > 1
    e["targets"] = checks
    return e


def markdown(entries: dict, device: str) -> str:
    lines = [f"# comera pretrain: dense against CoMERA ({device})", "",
             "Written by `benchmarks/bench_pretrain.py`; each row is one `comera pretrain --method both` "
             "run (same data, seed and steps for both methods). Ratios are CoMERA over dense from the "
             "same run.", "",
             "| preset | steps | dense loss | CoMERA loss | loss diff | dense tok/s | CoMERA tok/s | speed-up "
             "| whole-model compression | converted-layer compression | peak RSS dense / CoMERA (above start) "
             "| targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(entries):
        e = entries[key]
        d, c, cmp_ = e["dense"], e["comera"], e["comparison"]
        targets = "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in e["targets"].items()) or "-"
        mem = (f"{d['peak_memory_bytes'] / 2**20:,.0f} / {c['peak_memory_bytes'] / 2**20:,.0f} MiB "
               f"({d['peak_memory_growth_bytes'] / 2**20:,.0f} / {c['peak_memory_growth_bytes'] / 2**20:,.0f})")
        lines.append(
            f"| {e['preset']} | {e['steps']} | {d['valid_loss']:.4f} | {c['valid_loss']:.4f} | "
            f"{100 * cmp_['valid_loss_relative_difference']:+.2f}% | {d['tokens_per_s']:,.0f} | "
            f"{c['tokens_per_s']:,.0f} | {cmp_['speedup_tokens_per_s']:.2f}x | "
            f"{c['compression_whole']:.2f}x | {c['compression_converted']:.2f}x | {mem} | {targets} |")
    lines += ["", "Commands and machines:", ""]
    for key in sorted(entries):
        e = entries[key]
        env = e["environment"]
        lines.append(f"- `{e['command']}` ({e['command_wall_s'] / 60:.1f} min; torch {env['torch']}, "
                     f"{env['device']}, {env['threads']} threads of {env['cpu_count']} CPUs)")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small", "paper"])
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's")
    ap.add_argument("--out", default=None, help="run directory (default runs/bench-<preset>-<time>)")
    args, extra = ap.parse_known_args(argv)
    # Relative to the repository (the command runs there), so no machine path is recorded.
    out = args.out or os.path.join("runs", f"bench-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    metrics = run(args.preset, args.steps, out, extra)
    device = "gpu" if metrics["environment"]["device"].startswith("cuda") else "cpu"
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"pretrain_{device}.json")
    entries = {}
    if os.path.exists(path):
        with open(path) as fh:
            entries = json.load(fh)
    e = entry(args.preset, metrics)
    entries[f"{args.preset}-{e['steps']}"] = e
    with open(path, "w") as fh:
        json.dump(entries, fh, indent=1)
    md = markdown(entries, device.upper())
    with open(os.path.join(RESULTS, f"pretrain_{device}.md"), "w") as fh:
        fh.write(md)
    print(md)


if __name__ == "__main__":
    main()
