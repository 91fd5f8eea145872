"""comera against the alternatives a user would otherwise pick, in one run.

Part 1 (linear): forward+backward time and peak memory of one TT linear
layer at bench_linear's shapes and ranks (4096 rows = 32 x 128 tokens):
comera.TTLinear, tensorly-torch's FactorizedLinear in its TT-matrix format
(BlockTT, both of its implementations: "factorized" contracts the input with
the cores by einsum, "reconstructed" rebuilds the dense weight) at the same
rank and at the rank giving comera's parameter count ("equal params"), the
paper's pure-PyTorch scheme (peers.PaperTTLinear) and nn.Linear.

Part 2 (transformer): a whole training step of the paper's six-encoder
transformer at batch 1, 8 and 32 (sequence 128): dense AdamW, GaLore
(galore-torch's GaLoreAdamW, rank 128, its periodic SVDs amortised into its
step time) and comera (train_step.py).

    pip install -e ".[bench]"
    python benchmarks/bench_peers.py --threads 1   # both parts (long on 2 cores)
    python benchmarks/bench_peers.py --part linear
    python benchmarks/bench_peers.py --quick       # tiny sizes, in-process, seconds

How it measures (benchmarks/README.md, "How we measure"): time is wall
clock (process CPU time is an extra column), every method of a row is built
in one process and timed interleaved after a warm-up (timing.interleaved),
median with its interquartile range.  Memory is measured apart, one fresh
subprocess per method (and shape), with the memory high-water mark reset
before the measured steps.  Every subprocess gets --threads and
OMP_NUM_THREADS and asserts the count it runs with.  --in-process runs
everything in this process instead.
Writes benchmarks/results/peers_cpu.{json,md} (peers_cpu_linear.* or
peers_cpu_transformer.* with --part, peers_cpu_quick* with --quick) and PNG
plots next to them, with the machine record.  The committed tables are the two
parts, each run at 1 thread.
"""
import argparse
import json
import os

import torch

from bench_linear import RANKS, ROWS, SHAPES
from common import (case_subprocess, keep_freed_memory, peak_rss_bytes, release_freed_memory,
                    reset_peak_rss, rss_bytes, write_results, RESULTS)
from peers import LINEAR_METHODS, build_linear, linear_rank, num_params
from timing import assert_threads, finish_record, interleaved, machine_line, machine_record
from train_step import METHODS as STEP_METHODS, run_case as run_step_case, time_methods

BATCHES = [1, 8, 32]


def _layer_and_step(method, case):
    module = build_linear(method, case["in"], case["out"], case["rank"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case["rows"], case["in"], generator=g, requires_grad=True)
    gy = torch.randn(case["rows"], case["out"], generator=g)

    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(gy)

    return module, step


def linear_case(case):
    """Memory of one layer's forward+backward: the peak RSS growth over the
    RSS once the layer and its inputs exist (as in bench_linear), over one
    warm-up step and one more."""
    module, step = _layer_and_step(case["method"], case)
    release_freed_memory()
    base = rss_bytes()
    reset_peak_rss()
    step()
    step()
    return {"method": case["method"], "in": case["in"], "out": case["out"], "rank": case["rank"],
            "built_rank": linear_rank(case["method"], case["in"], case["out"], case["rank"]),
            "rows": case["rows"], "params": num_params(module), "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "peak_bytes": max(0, peak_rss_bytes() - base)}


def linear_ranks_case(case):
    """linear_case at each of case["ranks"] in turn (one process per method
    and shape: a fresh interpreter per rank would cost more than the
    measurements on a loaded machine); the peak is reset before each rank."""
    return [linear_case(dict(case, rank=r)) for r in case["ranks"]]


def linear_time_case(case):
    """Every method of LINEAR_METHODS at one shape, for each rank of
    case["ranks"]: built in this process, timed interleaved."""
    out = []
    for rank in case["ranks"]:
        steps = {}
        for method in LINEAR_METHODS:
            steps[method] = _layer_and_step(method, dict(case, rank=0 if method == "nn.Linear"
                                                         else rank))[1]
        t = interleaved(steps, reps=case.get("reps", 7), warmup=2, budget_s=case.get("budget_s"))
        out.append({"rank": rank, "threads": torch.get_num_threads(), "timing": t})
    return out


def step_time_case(case):
    return time_methods(case)


CASE_KINDS = {"linear_ranks": linear_ranks_case, "linear_time": linear_time_case,
              "step": run_step_case, "step_time": step_time_case}


def run_one(case, args):
    if args.in_process:
        return CASE_KINDS[case["kind"]](case)
    return case_subprocess("bench_peers", case, args.threads)


def linear_part(args):
    shapes = [(256, 512)] if args.quick else SHAPES
    ranks = [8] if args.quick else RANKS
    rows = 256 if args.quick else ROWS
    out = []
    for in_f, out_f in shapes:
        memory = {}
        for method in LINEAR_METHODS:
            method_ranks = [0] if method == "nn.Linear" else ranks
            res = run_one({"kind": "linear_ranks", "method": method, "in": in_f, "out": out_f,
                           "ranks": method_ranks, "rows": rows}, args)
            memory[method] = {r: m for r, m in zip(method_ranks, res)}
        times = run_one({"kind": "linear_time", "in": in_f, "out": out_f, "ranks": ranks,
                         "rows": rows, "reps": args.reps, "budget_s": args.budget}, args)
        for rank, t in zip(ranks, times):
            res = {"in": in_f, "out": out_f, "rank": rank, "rows": rows, "methods": {}}
            for method in LINEAR_METHODS:
                m = memory[method][0 if method == "nn.Linear" else rank]
                tm = t["timing"][method]
                res["methods"][method] = {
                    "params": m["params"], "built_rank": m["built_rank"], "peak_bytes": m["peak_bytes"],
                    "wall_s": tm["wall"]["median"], "wall": tm["wall"], "cpu_s": tm["cpu"]["median"],
                    "cpu": tm["cpu"]}
            t_tt = res["methods"]["comera.TTLinear"]["wall_s"]
            res["comera_speedup"] = {k: v["wall_s"] / t_tt for k, v in res["methods"].items()
                                     if k != "comera.TTLinear"}
            res["comera_fastest"] = all(s > 1.0 for s in res["comera_speedup"].values())
            out.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "methods"}), flush=True)
    return out


def transformer_part(args):
    preset = "tiny" if args.quick else "paper"
    batches = [1, 2] if args.quick else BATCHES
    out = []
    for batch in batches:
        row = {"batch": batch, "methods": {}}
        for method in STEP_METHODS:
            row["methods"][method] = run_one(
                {"kind": "step", "method": method, "preset": preset, "batch": batch, "rank": 30,
                 "reps": 1}, args)
        t = run_one({"kind": "step_time", "preset": preset, "batch": batch, "rank": 30,
                     "methods": [[m, m, None] for m in STEP_METHODS], "reps": args.step_reps,
                     "budget_s": args.budget}, args)
        for method, tm in t["methods"].items():
            m = row["methods"][method]
            m.update(wall=tm["wall"], cpu=tm["cpu"], step_s=tm["wall"]["median"],
                     step_cpu_s=tm["cpu"]["median"])
            if "amortised_wall_s" in tm:  # GaLore: its periodic SVDs spread over the gap
                m.update(step_s=tm["amortised_wall_s"], steady_step_s=tm["wall"]["median"],
                         svd_step_s=tm["svd_step_wall_s"])
        m = row["methods"]
        row["comera_step_speedup"] = {k: m[k]["step_s"] / m["comera"]["step_s"]
                                      for k in m if k != "comera"}
        row["comera_memory_reduction"] = {k: m[k]["peak_bytes"] / max(1, m["comera"]["peak_bytes"])
                                          for k in m if k != "comera"}
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "methods"}), flush=True)
    return out


def _mb(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def _ms(s):
    return f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def _spread(w):
    """Median [interquartile range] in ms."""
    return f"{_ms(w['median'])} [{_ms(w['iqr'])}]"


def markdown(payload):
    md = ["# comera against its peers (CPU, float32)\n",
          machine_line(payload["machine"]),
          "Times are wall clock: median [interquartile range] in ms of the interleaved rounds "
          "(every method of a row timed in one process, round-robin, after a warm-up); CPU time "
          "is in the JSON. Memory is measured in one fresh subprocess per method. Freed memory "
          "stays in the heap for every method (mallopt, as with jemalloc/tcmalloc).\n"]
    if payload["linear"]:
        md += ["## TT linear layer, forward + backward\n",
               f"{payload['linear'][0]['rows']} rows. Rank = comera's rank; the tltorch \"equal "
               "params\" columns use the rank giving comera's parameter count (shown as r=). "
               "x = comera's wall-clock speed-up over that method; MB = peak memory growth during "
               "the step.\n",
               "| in -> out | rank | " + " | ".join(LINEAR_METHODS) + " | comera fastest |",
               "|---|---|" + "---|" * len(LINEAR_METHODS) + "---|"]
        for r in payload["linear"]:
            cells = []
            for meth in LINEAR_METHODS:
                m = r["methods"][meth]
                x = "" if meth == "comera.TTLinear" else f" ({r['comera_speedup'][meth]:.1f}x)"
                rk = f" r={m['built_rank']}" if meth.endswith("equal params)") else ""
                cells.append(f"{_spread(m['wall'])}{x} / {_mb(m['peak_bytes'])} MB{rk}")
            md.append(f"| {r['in']} -> {r['out']} | {r['rank']} | " + " | ".join(cells) +
                      f" | {'yes' if r['comera_fastest'] else 'no'} |")
        md.append("\nParameters per layer: " + "; ".join(
            f"{r['in']}->{r['out']} r{r['rank']}: " + ", ".join(
                f"{k} {v['params']}" for k, v in r["methods"].items()) for r in payload["linear"][:4]) +
            (" ..." if len(payload["linear"]) > 4 else "") + "\n")
    if payload["transformer"]:
        md += _transformer_md(payload)
    md.append(f"\nReproduce: `python benchmarks/bench_peers.py {payload['flags']}`.\n")
    return "\n".join(md) + "\n"


def _transformer_md(payload):
    cfg = payload["transformer_config"]
    md = ["## Six-encoder transformer, one training step\n",
          f"Preset {payload['transformer_preset']}: {cfg['layers']} layers, hidden {cfg['hidden']}, "
          f"FFN {cfg['ffn']}, {cfg['heads']} heads, vocab {cfg['vocab']}, sequence {cfg['seq']}, "
          f"{cfg['classes']}-way classifier. GaLore: rank 128 on every encoder linear; its step = "
          "steady step + (step with the SVDs - steady step) / 200 (its update_proj_gap), both timed "
          "in the same interleaved rounds. comera: every encoder linear and the word embedding at "
          "rank 30. Peak = whole-process peak RSS during the steps minus the RSS before the model "
          "was built (weights, grads, optimizer state, activations), taken after one step of a tiny "
          "model of the same method so that modules and code loaded once per process are not "
          "counted.\n",
          "| batch | method | step ms [IQR] | GaLore steady / SVD step ms | peak MB | params | "
          "optimizer state MB | comera step speed-up | comera memory reduction |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["transformer"]:
        for meth, m in r["methods"].items():
            sp = "-" if meth == "comera" else f"{r['comera_step_speedup'][meth]:.2f}x"
            mr = "-" if meth == "comera" else f"{r['comera_memory_reduction'][meth]:.2f}x"
            gal = f"{_ms(m['steady_step_s'])} / {_ms(m['svd_step_s'])}" if "svd_step_s" in m else "-"
            md.append(f"| {r['batch']} | {meth} | {_ms(m['step_s'])} [{_ms(m['wall']['iqr'])}] | {gal} | "
                      f"{_mb(m['peak_bytes'])} | {m['param_count']:,} | "
                      f"{_mb(m['optimizer_state_bytes'])} | {sp} | {mr} |")
    return md


def plots(payload, out_dir, name):
    from plots import grouped_bars, line_plot
    written = []
    if payload["linear"]:
        groups = [f"{r['in']}->{r['out']} r{r['rank']}" for r in payload["linear"]]
        series = {m: [r["methods"][m]["wall_s"] * 1e3 for r in payload["linear"]] for m in LINEAR_METHODS}
        p = os.path.join(out_dir, name + "_linear_time.png")
        grouped_bars(p, groups, series, "forward+backward ms, wall clock (log)", "TT linear layer, "
                     f"{payload['linear'][0]['rows']} rows", logy=True)
        written.append(p)
    if payload["transformer"]:
        batches = [r["batch"] for r in payload["transformer"]]
        for key, label, fname in (("step_s", "training step s", "_step_time.png"),
                                  ("peak_bytes", "peak memory MB", "_step_memory.png")):
            scale = 1.0 if key == "step_s" else 1.0 / 2**20
            series = {m: (batches, [r["methods"][m][key] * scale for r in payload["transformer"]])
                      for m in STEP_METHODS}
            p = os.path.join(out_dir, name + fname)
            line_plot(p, series, "batch size", label, f"six-encoder transformer ({payload['transformer_preset']}"
                      f" preset), {label}", logx=True, logy=True)
            written.append(p)
    return written


def reproduce_flags(args):
    flags = ["--quick"] if args.quick else []
    if args.part != "all":
        flags.append(f"--part {args.part}")
    flags += [f"--threads {args.threads}", f"--budget {args.budget:g}", f"--reps {args.reps}",
              f"--step-reps {args.step_reps}"]
    return " ".join(flags + (["--in-process"] if args.in_process and not args.quick else []))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, in this process (smoke test)")
    ap.add_argument("--part", choices=["all", "linear", "transformer"], default="all")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of this process and of every case subprocess (asserted there)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of interleaved timing per row (at least 3 rounds)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds per linear row")
    ap.add_argument("--step-reps", type=int, default=5, help="interleaved rounds per training-step row")
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    assert_threads(args.threads)
    heap_cache = keep_freed_memory()
    if args.case:
        case = json.loads(args.case)
        print(json.dumps(CASE_KINDS[case["kind"]](case)))
        return None
    args.in_process = args.in_process or args.quick
    if args.in_process:  # one-time lazy initialisation is not any method's memory
        linear_case({"method": "nn.Linear", "in": 64, "out": 64, "rank": 0, "rows": 8})
        run_step_case({"method": "dense AdamW", "preset": "tiny", "batch": 1, "reps": 1})
    if args.budget is None:
        args.budget = 2.0 if args.quick else 60.0
    machine = machine_record(measure=not args.quick)
    payload = {"machine": machine, "glibc_keep_freed_memory": heap_cache, "dtype": "float32",
               "clock": "wall", "interleaved": True,
               "linear": linear_part(args) if args.part in ("all", "linear") else [],
               "transformer": transformer_part(args) if args.part in ("all", "transformer") else []}
    from encoder import PRESETS
    finish_record(machine)
    payload["transformer_preset"] = "tiny" if args.quick else "paper"
    payload["transformer_config"] = PRESETS[payload["transformer_preset"]].as_dict()
    payload["flags"] = reproduce_flags(args)
    name = "peers_cpu" + ("_quick" if args.quick else "") + ("" if args.part == "all" else "_" + args.part)
    out_dir = args.out or RESULTS
    payload["plots"] = [os.path.basename(p) for p in plots(payload, out_dir, name)]
    write_results(name, payload, markdown(payload), out_dir=out_dir)
    return payload


if __name__ == "__main__":
    main()
