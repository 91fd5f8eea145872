"""The wall time and the learning of `make demo` (`comera pretrain --preset
demo`): runs the same command in a fresh run folder, timed from start to
report, and records the validation losses of both methods against the
unigram level of the same validation tokens.

    python benchmarks/bench_demo.py              # writes benchmarks/results/demo_cpu.{json,md}
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def unigram_level(run_dir, vocab):
    """Cross-entropy of the run's validation tokens under its training-token
    counts (add-one smoothed): what knowing token frequencies alone gives."""
    import torch
    from bench_quality import unigram_cross_entropy
    ids = torch.load(os.path.join(run_dir, "tokens.pt"), weights_only=True)
    return unigram_cross_entropy(ids["train"], ids["valid"].long(), vocab)


def markdown(rec):
    from timing import machine_line
    lines = ["# `make demo`: wall time and learning (CPU)", "",
             f"Command: `{rec['command']}` (what `make demo` runs), timed by `benchmarks/bench_demo.py` "
             f"from start to report: **{rec['wall_s'] / 60:.1f} minutes**.", "",
             f"Unigram cross-entropy of the validation tokens under the training-token counts: "
             f"{rec['unigram_valid']:.4f}.", "",
             "| method | steps | validation loss (first -> last evaluation) | tokens/s | training s | "
             "whole-model compression |", "|---|---|---|---|---|---|"]
    for m, r in rec["methods"].items():
        v = r["valid"]
        lines.append(f"| {m} | {r['steps']} | {v[0][1]:.4f} (step {v[0][0]}) -> {v[-1][1]:.4f} (step {v[-1][0]}) | "
                     f"{r['tokens_per_s']:,.0f} | {r['train_s']:.0f} | {r['compression_whole']:.2f}x |")
    lines += ["", machine_line(rec["machine"]), ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--runs-dir", default=os.path.join(REPO, "runs"))
    args = ap.parse_args(argv)
    from timing import finish_record, machine_record
    machine = machine_record(measure=False)
    run_dir = os.path.join(args.runs_dir, f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    cmd = [sys.executable, "-m", "comera", "pretrain", "--preset", "demo", "--quiet", "--out", run_dir]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    wall = time.perf_counter() - t0
    finish_record(machine)
    with open(os.path.join(run_dir, "metrics.json")) as fh:
        metrics = json.load(fh)
    with open(os.path.join(run_dir, "tokenizer_meta.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    rec = {"command": "python -m comera pretrain --preset demo", "wall_s": wall, "machine": machine,
           "unigram_valid": unigram_level(run_dir, vocab), "methods": {}}
    for m, r in metrics["methods"].items():
        rec["methods"][m] = {"steps": r["steps_done"], "valid": r["history"]["valid"],
                             "tokens_per_s": r["tokens_per_s"], "train_s": r["train_time_s"],
                             "compression_whole": r["compression_whole"],
                             "final_ranks": r.get("final_ranks")}
    from common import write_results
    write_results("demo_cpu", rec, markdown(rec), out_dir=args.out)
    return rec


if __name__ == "__main__":
    main()
