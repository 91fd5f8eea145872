"""Forward+backward time of a TTLinear before and after physical rank pruning.

TTLinear 768 -> 3072 at rank 30 (4096 rows, x requiring grad).  Then every
bond keeps its first 10 ranks (the rest of each gate set to 0), measured
twice: masked (dead ranks zeroed but still computed, what CoMERA's reference
code does) and after comera.prune.  The time ratio full / pruned is set
against the ratio of the planner's FLOP counts and of the roofline times
max(flops / sgemm rate, bytes / copy bandwidth), both rates measured in the
same run.  A TT layer at rank 10 is near the memory-bound side of this
shape, so the time also has a part that does not depend on the rank: every
call allocates and writes y (rows x 3072) and dx (rows x 768).  That floor is
measured in the same run (allocate + fill those outputs) and the ratio of the
times above it is reported as well.

    python benchmarks/bench_prune.py             # 4096 and 1024 rows
    python benchmarks/bench_prune.py --rows 4096 --reps 5
    python benchmarks/bench_prune.py --threads 1 --clock cpu   # a busy shared machine

Writes benchmarks/results/prune_cpu.json and prune_cpu.md (with --clock cpu:
prune_cpu_cputime.*).  --clock cpu times with the process's CPU time rather
than the wall clock, which on a machine shared with other jobs leaves out the
time the process waited for a core (use it with --threads 1, since CPU time
adds up over threads).

Allocation note: every call allocates y and dx afresh; glibc serves blocks
this large with mmap, so each call also pays first-touch page faults on
them (tens of ms at 4096 rows), whatever the rank.  Setting
MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 keeps
that memory in the heap; the table records which MALLOC_* settings a run had.
"""
import argparse
import os
import statistics
import time

import torch

import comera
from common import copy_bandwidth, machine_info, sgemm_flops, time_fn, write_results


def cpu_time_fn(fn, *, warmup=2, reps=7):
    """Median process CPU time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def step_fn(layer, x, gy):
    def run():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        layer(x).backward(gy)
    return run


def output_floor_fn(rows, in_f, out_f):
    """Allocating and writing the outputs every forward+backward must produce."""
    def run():
        torch.empty(rows, out_f).fill_(1.0)
        torch.empty(rows, in_f).fill_(1.0)
    return run


def costs(layer, rows, flops_rate, bw):
    plan = layer.plan(rows)
    c = plan[plan["path"]]
    return {"path": plan["path"], "flops": c["flops"], "bytes": c["bytes"],
            "roofline_s": max(c["flops"] / flops_rate, c["bytes"] / bw)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 1024])
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--live", type=int, default=10)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (CPU time adds up over threads)")
    timer = time_fn if args.clock == "wall" else cpu_time_fn
    malloc_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}
    torch.set_num_threads(args.threads)
    flops_rate, bw = sgemm_flops(), copy_bandwidth()
    cases = []
    for rows in args.rows:
        torch.manual_seed(0)
        layer = comera.TTLinear(768, 3072, rank=args.rank)
        x = torch.randn(rows, 768, requires_grad=True)
        gy = torch.randn(rows, 3072)
        full = dict(costs(layer, rows, flops_rate, bw), ranks=layer.ranks,
                    time_s=timer(step_fn(layer, x, gy), reps=args.reps))
        with torch.no_grad():
            for g in layer.gates:
                g[args.live:] = 0
        masked_s = timer(step_fn(layer, x, gy), reps=args.reps)
        comera.prune(layer)
        pruned = dict(costs(layer, rows, flops_rate, bw), ranks=layer.ranks,
                      time_s=timer(step_fn(layer, x, gy), reps=args.reps))
        floor_s = timer(output_floor_fn(rows, 768, 3072), reps=args.reps)
        case = {
            "rows": rows, "full": full, "masked_time_s": masked_s, "pruned": pruned,
            "output_floor_s": floor_s,
            "above_floor_ratio": (full["time_s"] - floor_s) / max(pruned["time_s"] - floor_s, 1e-9),
            "time_ratio": full["time_s"] / pruned["time_s"],
            "flop_ratio": full["flops"] / pruned["flops"],
            "roofline_ratio": full["roofline_s"] / pruned["roofline_s"],
            "masked_over_pruned": masked_s / pruned["time_s"],
        }
        cases.append(case)
        print(f"rows {rows}: {full['ranks']} {full['time_s'] * 1e3:.1f} ms -> {pruned['ranks']} "
              f"{pruned['time_s'] * 1e3:.1f} ms (masked {masked_s * 1e3:.1f} ms): time "
              f"{case['time_ratio']:.2f}x (above the {floor_s * 1e3:.1f} ms output floor "
              f"{case['above_floor_ratio']:.2f}x), FLOPs {case['flop_ratio']:.2f}x, roofline "
              f"{case['roofline_ratio']:.2f}x", flush=True)

    payload = {"machine": machine_info(), "sgemm_flops_per_s": flops_rate,
               "copy_bytes_per_s": bw, "dtype": "float32", "layer": "TTLinear(768, 3072)",
               "rank": args.rank, "live_rank": args.live, "clock": args.clock,
               "malloc_env": malloc_env, "cases": cases}
    md = [f"# Pruning: TTLinear 768 -> 3072, rank {args.rank} -> live rank {args.live}, "
          "forward+backward, CPU, float32\n",
          f"Machine: {payload['machine']['processor']}, {args.threads} threads, torch "
          f"{torch.__version__}, {args.clock} clock; sgemm {flops_rate / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s "
          "(measured in the same run). Masked: dead ranks zeroed but still computed (no "
          "pruning). Ratios are full / pruned; roofline = max(plan flops / sgemm, plan bytes "
          "/ copy); floor = allocating and writing y and dx alone, and the ratio of the times "
          "above it. glibc malloc settings: "
          f"{' '.join(f'{k}={v}' for k, v in malloc_env.items()) or 'defaults'}.\n",
          "| rows | ranks | path | ms | masked ms | pruned ranks | path | pruned ms | time ratio "
          "| FLOP ratio | roofline ratio | floor ms | ratio above floor | masked / pruned |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        f, p = c["full"], c["pruned"]
        md.append(f"| {c['rows']} | {f['ranks']} | {f['path']} | {f['time_s'] * 1e3:.1f} | "
                  f"{c['masked_time_s'] * 1e3:.1f} | {p['ranks']} | {p['path']} | "
                  f"{p['time_s'] * 1e3:.1f} | {c['time_ratio']:.2f}x | {c['flop_ratio']:.2f}x | "
                  f"{c['roofline_ratio']:.2f}x | {c['output_floor_s'] * 1e3:.1f} | "
                  f"{c['above_floor_ratio']:.2f}x | {c['masked_over_pruned']:.2f}x |")
    flags = "" if args.clock == "wall" else f" --threads {args.threads} --clock cpu"
    env = "".join(f"{k}={v} " for k, v in malloc_env.items())
    md.append(f"\nReproduce: `{env}python benchmarks/bench_prune.py{flags}` (after `make install`).\n")
    write_results("prune_cpu" if args.clock == "wall" else "prune_cpu_cputime", payload,
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
