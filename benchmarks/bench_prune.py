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
    python benchmarks/bench_prune.py --rows 4096 --reps 5 --threads 1

The four calls of a row (full, masked, pruned, output floor) are timed
interleaved by wall clock (benchmarks/timing.py: warm-up, rounds in shuffled
order, median and interquartile range; process CPU time in the JSON), so a
change of machine load hits them alike.  Writes
benchmarks/results/prune_cpu.json and prune_cpu.md with the machine record
(which also holds the sgemm and copy rates the roofline uses).

Allocation note: every call returns a fresh y and dx.  From torch's
allocator, glibc serves blocks this large with mmap, so each call would pay
first-touch page faults on them, whatever the rank; comera hands its large
outputs out of its own pool of reused blocks instead (docs/design.md
section 5).  The full and pruned layers are also timed with the pool off
(COMERA_OUTPUT_POOL=0, switched per call: outputs from torch's allocator,
with comera's huge-page advice), interleaved with the rest, so the table
gives the before/after of the pool.  The floor (allocating and writing y
and dx as torch does) is measured as is and with the huge-page advice
(Linux).  The table records which MALLOC_* / GLIBC_TUNABLES
settings a run had.
"""
import argparse
import copy
import ctypes
import os
import sys

import torch

import comera
from common import pool_off, write_results
from timing import assert_threads, finish_record, interleaved, machine_line, machine_record


def step_fn(layer, x, gy):
    def run():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        layer(x).backward(gy)
    return run


def _madvise_huge():
    """madvise(MADV_HUGEPAGE) on a tensor's 2 MB-aligned interior, what
    comera does for its large outputs; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge, MADV_HUGEPAGE = 2 << 20, 14

    def advise(t):
        a, n = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = -(-a // huge) * huge, (a + n) // huge * huge
        if hi > lo:
            libc.madvise(lo, hi - lo, MADV_HUGEPAGE)
        return t
    return advise


def output_floor_fn(rows, in_f, out_f, advise=None):
    """Allocating and writing the outputs every forward+backward must produce
    (with ``advise``: after the huge-page advice comera gives its outputs)."""
    adv = advise or (lambda t: t)

    def run():
        adv(torch.empty(rows, out_f)).fill_(1.0)
        adv(torch.empty(rows, in_f)).fill_(1.0)
    return run


def costs(layer, rows, flops_rate, bw):
    plan = layer.plan(rows)
    c = plan[plan["path"]]
    return {"path": plan["path"], "flops": c["flops"], "bytes": c["bytes"],
            "roofline_s": max(c["flops"] / flops_rate, c["bytes"] / bw),
            "kernel": plan["kernel"], "plan_seconds": plan["seconds"]}


def time_row(rows, rank, live, reps, flops_rate, bw):
    """One row: the full layer, a copy masked to `live` ranks, a pruned copy
    and the output floor, timed interleaved."""
    torch.manual_seed(0)
    layer = comera.TTLinear(768, 3072, rank=rank)
    masked = copy.deepcopy(layer)
    with torch.no_grad():
        for g in masked.gates:
            g[live:] = 0
    pruned = copy.deepcopy(masked)
    comera.prune(pruned)
    x = torch.randn(rows, 768, requires_grad=True)
    gy = torch.randn(rows, 3072)
    # the pool-off methods get an x of their own: freeing a pooled x.grad while
    # the pool is switched off would drop the pool's idle blocks, and the
    # pooled methods would pay for fresh pages after them
    x_off = x.detach().clone().requires_grad_()
    methods = {"full": step_fn(layer, x, gy), "masked": step_fn(masked, x, gy),
               "pruned": step_fn(pruned, x, gy),
               "full_pool_off": pool_off(step_fn(layer, x_off, gy)),
               "pruned_pool_off": pool_off(step_fn(pruned, x_off, gy)),
               "floor": output_floor_fn(rows, 768, 3072)}
    advise = _madvise_huge()
    if advise is not None:
        methods["floor_huge"] = output_floor_fn(rows, 768, 3072, advise)
    t = interleaved(methods, reps=reps, warmup=2)
    med = {k: v["wall"]["median"] for k, v in t.items()}
    floor = med.get("floor_huge", med["floor"])
    full = dict(costs(layer, rows, flops_rate, bw), ranks=layer.ranks, time_s=med["full"])
    pr = dict(costs(pruned, rows, flops_rate, bw), ranks=pruned.ranks, time_s=med["pruned"])
    return {
        "rows": rows, "full": full, "masked_time_s": med["masked"], "pruned": pr,
        "output_floor_s": med["floor"], "timing": t,
        # the advised floor: what the layers' outputs cost without the pool
        "above_floor_ratio": (full["time_s"] - floor) / max(pr["time_s"] - floor, 1e-9),
        "time_ratio": full["time_s"] / pr["time_s"],
        "flop_ratio": full["flops"] / pr["flops"],
        "roofline_ratio": full["roofline_s"] / pr["roofline_s"],
        "masked_over_pruned": med["masked"] / pr["time_s"],
        "pool_off": {"full_s": med["full_pool_off"], "pruned_s": med["pruned_pool_off"],
                     "time_ratio": med["full_pool_off"] / med["pruned_pool_off"]},
        "output_floor_huge_s": med.get("floor_huge"),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 1024])
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--live", type=int, default=10)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="prune_cpu", help="results name (default prune_cpu)")
    args = ap.parse_args(argv)
    malloc_env = {k: v for k, v in sorted(os.environ.items())
                  if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}
    assert_threads(args.threads)
    machine = machine_record()
    flops_rate, bw = machine["sgemm_flops_per_s"], machine["copy_bytes_per_s"]
    cases = []
    for rows in args.rows:
        case = time_row(rows, args.rank, args.live, args.reps, flops_rate, bw)
        cases.append(case)
        full, pruned = case["full"], case["pruned"]
        floor_s = case["output_floor_huge_s"] or case["output_floor_s"]
        print(f"rows {rows}: {full['ranks']} {full['time_s'] * 1e3:.1f} ms -> {pruned['ranks']} "
              f"{pruned['time_s'] * 1e3:.1f} ms (masked {case['masked_time_s'] * 1e3:.1f} ms): time "
              f"{case['time_ratio']:.2f}x (above the {floor_s * 1e3:.1f} ms output floor "
              f"{case['above_floor_ratio']:.2f}x), FLOPs {case['flop_ratio']:.2f}x, roofline "
              f"{case['roofline_ratio']:.2f}x; output pool off: "
              f"{case['pool_off']['time_ratio']:.2f}x", flush=True)
    finish_record(machine)
    payload = {"machine": machine, "dtype": "float32", "layer": "TTLinear(768, 3072)",
               "rank": args.rank, "live_rank": args.live, "clock": "wall", "interleaved": True,
               "reps": args.reps, "malloc_env": malloc_env, "cases": cases}
    payload["targets"] = [{"name": f"{c['rows']} rows: full / pruned time", "want": ">= 2.3",
                           "got": round(c["time_ratio"], 2), "met": c["time_ratio"] >= 2.3}
                          for c in cases if c["rows"] == 4096]
    write_results(args.name, payload, markdown(payload, args), out_dir=args.out)
    return payload


def markdown(payload, args):
    malloc_env = payload["malloc_env"]
    md = [f"# Pruning: TTLinear 768 -> 3072, rank {args.rank} -> live rank {args.live}, "
          "forward+backward, CPU, float32\n",
          machine_line(payload["machine"]),
          f"comera's kernel variant: {payload['cases'][0]['full']['kernel']}; predicted "
          "(plan()['seconds']) full / pruned ms: "
          + ", ".join(f"{c['full']['plan_seconds'] * 1e3:.1f} / {c['pruned']['plan_seconds'] * 1e3:.1f}"
                      for c in payload["cases"]) + ".\n",
          "Wall clock, median [interquartile range] of interleaved rounds (full, masked, pruned and "
          "floor timed round-robin in one process). Masked: dead ranks zeroed but still computed "
          "(no pruning). Ratios are full / pruned (of the medians); roofline = max(plan flops / "
          "sgemm, plan bytes / copy); floor = allocating and writing y and dx alone (as torch does, "
          "and with comera's huge-page advice), and the ratio of the times above the advised "
          "floor; pool off: the same layers with comera's output pool switched off "
          "(COMERA_OUTPUT_POOL=0: outputs from torch's allocator, with the huge-page advice). "
          "glibc malloc settings: "
          f"{' '.join(f'{k}={v}' for k, v in malloc_env.items()) or 'defaults'}.\n",
          "| rows | ranks | path | ms [IQR] | masked ms | pruned ranks | path | pruned ms [IQR] | "
          "time ratio | FLOP ratio | roofline ratio | floor ms | ratio above floor | masked / pruned | "
          "pool off: ms, pruned ms, ratio | floor ms with advice |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in payload["cases"]:
        f, p, t = c["full"], c["pruned"], c["timing"]
        md.append(f"| {c['rows']} | {f['ranks']} | {f['path']} | {f['time_s'] * 1e3:.1f} "
                  f"[{t['full']['wall']['iqr'] * 1e3:.1f}] | {c['masked_time_s'] * 1e3:.1f} | "
                  f"{p['ranks']} | {p['path']} | {p['time_s'] * 1e3:.1f} "
                  f"[{t['pruned']['wall']['iqr'] * 1e3:.1f}] | {c['time_ratio']:.2f}x | "
                  f"{c['flop_ratio']:.2f}x | {c['roofline_ratio']:.2f}x | "
                  f"{c['output_floor_s'] * 1e3:.1f} | {c['above_floor_ratio']:.2f}x | "
                  f"{c['masked_over_pruned']:.2f}x | {c['pool_off']['full_s'] * 1e3:.1f}, "
                  f"{c['pool_off']['pruned_s'] * 1e3:.1f}, {c['pool_off']['time_ratio']:.2f}x | "
                  + (f"{c['output_floor_huge_s'] * 1e3:.1f} |" if c["output_floor_huge_s"] else "- |"))
    md += [f"\nTarget: {t['name']} {t['want']}: {t['got']:.2f}x "
           f"(**{'met' if t['met'] else 'missed'}**)" for t in payload.get("targets", [])]
    env = "".join(f"{k}={v} " for k, v in malloc_env.items())
    name = f" --name {args.name}" if args.name != "prune_cpu" else ""
    md.append(f"\nReproduce: `{env}python benchmarks/bench_prune.py --rows "
              f"{' '.join(map(str, args.rows))} --reps {args.reps} --threads {args.threads}{name}` "
              "(after `make install`).\n")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
