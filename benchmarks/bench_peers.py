"""comera against the alternatives a user would otherwise pick, in one run.

Part 1 (linear): forward+backward time and peak memory of one TT linear
layer at bench_linear's shapes and ranks (4096 rows = 32 x 128 tokens):
comera.TTLinear, tensorly-torch's FactorizedLinear in its TT-matrix format
(BlockTT, both of its implementations: "factorized" contracts the input with
the cores by einsum, "reconstructed" rebuilds the dense weight), the paper's
pure-PyTorch scheme (peers.PaperTTLinear) and nn.Linear.

Part 2 (transformer): a whole training step of the paper's six-encoder
transformer at batch 1, 8 and 32 (sequence 128): dense AdamW, GaLore
(galore-torch's GaLoreAdamW, rank 128) and comera (train_step.py).

    pip install -e ".[bench]"
    python benchmarks/bench_peers.py               # both parts (long on 2 cores)
    python benchmarks/bench_peers.py --part linear
    python benchmarks/bench_peers.py --quick       # tiny sizes, in-process, seconds

Each training-step case, and each (layer method, shape) over all ranks, runs
in a fresh subprocess; the memory high-water mark is reset before each
measurement (after returning freed memory to the OS).  --in-process runs
everything in this process instead.
Writes benchmarks/results/peers_cpu.{json,md} (peers_cpu_quick.* with
--quick) and PNG plots next to them.
"""
import argparse
import json
import os

import torch

from bench_linear import RANKS, ROWS, SHAPES
from common import (case_subprocess, keep_freed_memory, machine_info, peak_rss_bytes,
                    release_freed_memory, reset_peak_rss, rss_bytes, time_bounded, write_results,
                    RESULTS)
from peers import LINEAR_METHODS, build_linear, num_params
from train_step import METHODS as STEP_METHODS, run_case as run_step_case

BATCHES = [1, 8, 32]


def linear_case(case):
    """Times forward+backward of one layer; memory is the peak RSS growth over
    the RSS once the layer and its inputs exist (as in bench_linear)."""
    module = build_linear(case["method"], case["in"], case["out"], case["rank"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case["rows"], case["in"], generator=g, requires_grad=True)
    gy = torch.randn(case["rows"], case["out"], generator=g)

    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(gy)

    release_freed_memory()
    base = rss_bytes()
    reset_peak_rss()
    timing = time_bounded(step, reps=case.get("reps", 5), budget_s=case.get("budget_s", 10.0))
    return {"method": case["method"], "in": case["in"], "out": case["out"], "rank": case["rank"],
            "rows": case["rows"], "params": num_params(module), "wall_s": timing["median_s"],
            "cpu_s": timing["cpu_median_s"], "reps": timing["reps"], "first_wall_s": timing["first_s"],
            "first_cpu_s": timing["first_cpu_s"],
            "peak_bytes": max(0, peak_rss_bytes() - base)}


def linear_ranks_case(case):
    """linear_case at each of case["ranks"] in turn (one process per method
    and shape: a fresh interpreter per rank would cost more than the
    measurements on a loaded machine); the peak is reset before each rank."""
    return [linear_case(dict(case, rank=r)) for r in case["ranks"]]


CASE_KINDS = {"linear": linear_case, "linear_ranks": linear_ranks_case, "step": run_step_case}


def run_one(case, in_process):
    if in_process:
        return CASE_KINDS[case["kind"]](case)
    return case_subprocess("bench_peers", case)


def linear_part(args):
    shapes = [(256, 512)] if args.quick else SHAPES
    ranks = [8] if args.quick else RANKS
    rows = 256 if args.quick else ROWS
    out = []
    for in_f, out_f in shapes:
        by_method = {}
        for method in LINEAR_METHODS:
            method_ranks = [0] if method == "nn.Linear" else ranks
            res = run_one({"kind": "linear_ranks", "method": method, "in": in_f, "out": out_f,
                           "ranks": method_ranks, "rows": rows, "budget_s": args.budget},
                          args.in_process)
            by_method[method] = {r: m for r, m in zip(method_ranks, res)}
        for rank in ranks:
            res = {"in": in_f, "out": out_f, "rank": rank, "rows": rows, "methods": {}}
            for method in LINEAR_METHODS:
                m = by_method[method][0 if method == "nn.Linear" else rank]
                m = dict(m, time_s=m[args.clock + "_s"], first_s=m["first_" + args.clock + "_s"])
                res["methods"][method] = {k: m[k] for k in ("params", "time_s", "first_s", "wall_s",
                                                            "cpu_s", "reps", "peak_bytes")}
            t_tt = res["methods"]["comera.TTLinear"]["time_s"]
            res["comera_speedup"] = {k: v["time_s"] / t_tt for k, v in res["methods"].items()
                                     if k != "comera.TTLinear"}
            res["comera_fastest"] = all(s > 1.0 for s in res["comera_speedup"].values())
            out.append(res)
            print(json.dumps(res), flush=True)
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
                 "reps": args.step_reps, "budget_s": args.budget}, args.in_process)
        m = row["methods"]
        for v in m.values():
            v["step_s"], v["first_step_s"] = v[f"step_{args.clock}_s"], v[f"first_step_{args.clock}_s"]
        row["comera_step_speedup"] = {k: m[k]["step_s"] / m["comera"]["step_s"]
                                      for k in m if k != "comera"}
        row["comera_memory_reduction"] = {k: m[k]["peak_bytes"] / max(1, m["comera"]["peak_bytes"])
                                          for k in m if k != "comera"}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _mb(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def _ms(s, reps=None):
    text = f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"
    return text + ("*" if reps == 0 else "")


CLOCKS = {"wall": "wall-clock", "cpu": "process CPU time (all threads)"}


def reproduce_flags(args):
    flags = ["--quick"] if args.quick else []
    if args.part != "all":
        flags.append(f"--part {args.part}")
    flags += [f"--threads {args.threads}", f"--clock {args.clock}", f"--budget {args.budget:g}",
              f"--step-reps {args.step_reps}"]
    return " ".join(flags)


def markdown(payload, args):
    md = ["# comera against its peers (CPU, float32)\n",
          f"Machine: {payload['machine']['processor']}, {payload['machine']['threads']} threads, "
          f"torch {payload['machine']['torch']}, {payload['machine']['date']}, 1-minute load average "
          f"{payload['loadavg_before_after'][0]:.1f} before / {payload['loadavg_before_after'][1]:.1f} "
          f"after the run (other jobs shared the machine). Times are {CLOCKS[payload['clock']]}. Freed "
          "memory stays in the heap for every method (mallopt, as with jemalloc/tcmalloc).\n"]
    if payload["linear"]:
        md += ["## TT linear layer, forward + backward\n",
               f"{payload['linear'][0]['rows']} rows. Time in ms (median; * = one call only, the "
               "method was slower than the time budget), peak memory growth in MB during the step, "
               "x = comera's speed-up over that method.\n",
               "| in -> out | rank | " + " | ".join(LINEAR_METHODS) + " | comera fastest |",
               "|---|---|" + "---|" * len(LINEAR_METHODS) + "---|"]
        for r in payload["linear"]:
            cells = []
            for meth in LINEAR_METHODS:
                m = r["methods"][meth]
                x = "" if meth == "comera.TTLinear" else f" ({r['comera_speedup'][meth]:.1f}x)"
                cells.append(f"{_ms(m['time_s'], m['reps'])}{x} / {_mb(m['peak_bytes'])} MB")
            md.append(f"| {r['in']} -> {r['out']} | {r['rank']} | " + " | ".join(cells) +
                      f" | {'yes' if r['comera_fastest'] else 'no'} |")
        md.append("\nParameters per layer: " + "; ".join(
            f"{r['in']}->{r['out']} r{r['rank']}: " + ", ".join(
                f"{k} {v['params']}" for k, v in r["methods"].items()) for r in payload["linear"][:4]) +
            (" ..." if len(payload["linear"]) > 4 else "") + "\n")
    if payload["transformer"]:
        cfg = payload["transformer_config"]
        md += ["## Six-encoder transformer, one training step\n",
               f"Preset {payload['transformer_preset']}: {cfg['layers']} layers, hidden {cfg['hidden']}, "
               f"FFN {cfg['ffn']}, {cfg['heads']} heads, vocab {cfg['vocab']}, sequence {cfg['seq']}, "
               f"{cfg['classes']}-way classifier. GaLore: rank 128 on every encoder linear. comera: "
               "every encoder linear and the word embedding (when available) at rank 30. Peak = whole-"
               "process peak RSS during the steps minus the RSS before the model was built (weights, "
               "grads, optimizer state, activations), taken after one step of a tiny model of the same "
               "method so that modules and code loaded once per process are not counted. Step time = median after one warm-up step "
               "(GaLore's warm-up includes its SVDs, redone every 200 steps: first-step time shown).\n",
               "| batch | method | step ms | first step ms | peak MB | params | optimizer state MB | "
               "comera step speed-up | comera memory reduction |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in payload["transformer"]:
            for meth, m in r["methods"].items():
                sp = "-" if meth == "comera" else f"{r['comera_step_speedup'][meth]:.2f}x"
                mr = "-" if meth == "comera" else f"{r['comera_memory_reduction'][meth]:.2f}x"
                md.append(f"| {r['batch']} | {meth} | {_ms(m['step_s'])} | {_ms(m['first_step_s'])} | "
                          f"{_mb(m['peak_bytes'])} | {m['param_count']:,} | "
                          f"{_mb(m['optimizer_state_bytes'])} | {sp} | {mr} |")
    md.append(f"\nReproduce: `python benchmarks/bench_peers.py {reproduce_flags(args)}`.\n")
    return "\n".join(md) + "\n"


def plots(payload, out_dir, name):
    from plots import grouped_bars, line_plot
    written = []
    if payload["linear"]:
        groups = [f"{r['in']}->{r['out']} r{r['rank']}" for r in payload["linear"]]
        series = {m: [r["methods"][m]["time_s"] * 1e3 for r in payload["linear"]] for m in LINEAR_METHODS}
        p = os.path.join(out_dir, name + "_linear_time.png")
        grouped_bars(p, groups, series, "forward+backward ms (log)", "TT linear layer, "
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, in this process (smoke test)")
    ap.add_argument("--part", choices=["all", "linear", "transformer"], default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="which time the tables and ratios use (both are in the JSON); on a "
                         "machine shared with other jobs, --threads 1 --clock cpu is the stable one")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per case")
    ap.add_argument("--step-reps", type=int, default=3)
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap_cache = keep_freed_memory()
    if args.case:
        case = json.loads(args.case)
        print(json.dumps(CASE_KINDS[case["kind"]](case)))
        return None
    args.in_process = args.in_process or args.quick
    if args.in_process:  # one-time lazy initialisation is not any method's memory
        linear_case({"method": "nn.Linear", "in": 64, "out": 64, "rank": 0, "rows": 8, "budget_s": 0})
        run_step_case({"method": "dense AdamW", "preset": "tiny", "batch": 1, "reps": 1, "budget_s": 0})
    if args.budget is None:
        args.budget = 2.0 if args.quick else 10.0
    load_before = os.getloadavg()
    payload = {"machine": machine_info(), "glibc_keep_freed_memory": heap_cache, "dtype": "float32",
               "clock": args.clock,
               "linear": linear_part(args) if args.part in ("all", "linear") else [],
               "transformer": transformer_part(args) if args.part in ("all", "transformer") else []}
    from encoder import PRESETS
    payload["loadavg_before_after"] = [load_before[0], os.getloadavg()[0]]
    payload["transformer_preset"] = "tiny" if args.quick else "paper"
    payload["transformer_config"] = PRESETS[payload["transformer_preset"]].as_dict()
    name = "peers_cpu" + ("_quick" if args.quick else "") + ("" if args.part == "all" else "_" + args.part)
    out_dir = args.out or RESULTS
    payload["plots"] = [os.path.basename(p) for p in plots(payload, out_dir, name)]
    write_results(name, payload, markdown(payload, args), out_dir=out_dir)
    return payload


if __name__ == "__main__":
    main()
