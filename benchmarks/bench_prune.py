"""Forward+backward time of a TTLinear before and after physical rank pruning.

TTLinear 768 -> 3072 at rank 30; then every bond keeps its first 10 ranks
(the rest of each gate set to 0) and is measured twice: masked (dead ranks
still computed, what CoMERA's reference code does) and pruned with
comera.prune.  The time ratio is compared with the ratio of the planner's
FLOP counts for the path it runs.

    python benchmarks/bench_prune.py [--batch 4096 1024] [--reps 20]

Writes benchmarks/results/bench_prune.json and bench_prune.md.
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

import comera

HERE = os.path.dirname(os.path.abspath(__file__))


def fwd_bwd_seconds(layer, batch, reps, warmup=3):
    """Median seconds of y = layer(x); y.backward(dy), x requiring grad."""
    x = torch.randn(batch, layer.in_features, requires_grad=True)
    dy = torch.randn(batch, layer.out_features)
    times = []
    for i in range(warmup + reps):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        t0 = time.perf_counter()
        layer(x).backward(dy)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    return statistics.median(times)


def plan_flops(layer, batch):
    plan = layer.plan(batch)
    return plan["path"], plan[plan["path"]]["flops"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[4096, 1024])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--live", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    torch.manual_seed(0)

    rows = []
    for batch in args.batch:
        layer = comera.TTLinear(768, 3072, rank=args.rank)
        ranks_full = layer.ranks
        path_full, flops_full = plan_flops(layer, batch)
        t_full = fwd_bwd_seconds(layer, batch, args.reps)

        with torch.no_grad():  # keep the first `live` ranks of every bond
            for g in layer.gates:
                g[args.live:] = 0
        t_masked = fwd_bwd_seconds(layer, batch, args.reps)

        comera.prune(layer)
        ranks_pruned = layer.ranks
        path_pruned, flops_pruned = plan_flops(layer, batch)
        t_pruned = fwd_bwd_seconds(layer, batch, args.reps)

        rows.append({
            "batch": batch,
            "ranks_full": ranks_full, "ranks_pruned": ranks_pruned,
            "path_full": path_full, "path_pruned": path_pruned,
            "ms_full": t_full * 1e3, "ms_masked": t_masked * 1e3, "ms_pruned": t_pruned * 1e3,
            "flops_full": flops_full, "flops_pruned": flops_pruned,
            "time_ratio": t_full / t_pruned,
            "flop_ratio": flops_full / flops_pruned,
            "masked_over_pruned": t_masked / t_pruned,
        })
        r = rows[-1]
        print(f"batch {batch}: rank {ranks_full} {r['ms_full']:.2f} ms ({path_full}), "
              f"masked {r['ms_masked']:.2f} ms, pruned {ranks_pruned} {r['ms_pruned']:.2f} ms "
              f"({path_pruned}); time ratio {r['time_ratio']:.2f}x, FLOP ratio "
              f"{r['flop_ratio']:.2f}x", flush=True)

    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor() or "unknown",
            "reps": args.reps, "layer": "TTLinear(768, 3072)", "rank": args.rank,
            "live_rank": args.live}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_prune.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    lines = [
        f"# Pruning benchmark: TTLinear 768 -> 3072, rank {args.rank} -> live rank {args.live}",
        "",
        f"forward+backward (x requires grad), median of {args.reps}; torch {meta['torch']}, "
        f"{meta['threads']} threads. Masked = dead ranks zeroed but still computed.",
        "",
        "| batch | ranks | path | ms | masked ms | pruned ranks | path | pruned ms | "
        "time ratio | FLOP ratio | masked / pruned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['ranks_full']} | {r['path_full']} | {r['ms_full']:.2f} | "
                     f"{r['ms_masked']:.2f} | {r['ranks_pruned']} | {r['path_pruned']} | "
                     f"{r['ms_pruned']:.2f} | {r['time_ratio']:.2f}x | {r['flop_ratio']:.2f}x | "
                     f"{r['masked_over_pruned']:.2f}x |")
    with open(os.path.join(args.out, "bench_prune.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
