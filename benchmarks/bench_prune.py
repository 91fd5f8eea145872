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
them, whatever the rank.  comera asks for transparent huge pages on its
large outputs (docs/design.md section 5); each TTLinear case is also timed
with that advice off (COMERA_HUGE_PAGES=0, switched per call), interleaved
with the rest in one process, so the table gives the before/after of the
advice.  The floor is measured both ways too: torch.empty + fill as is, and
with the same madvise (Linux).  The table records which MALLOC_* /
GLIBC_TUNABLES settings a run had and the load average before and after.
"""
import argparse
import copy
import ctypes
import os
import sys

import torch

import comera
from common import copy_bandwidth, machine_info, sgemm_flops, write_results
from timing import interleaved


def step_fn(layer, x, gy):
    def run():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        layer(x).backward(gy)
    return run


def advice_off(fn):
    """fn with comera's huge-page advice switched off for the call."""
    def run():
        os.environ["COMERA_HUGE_PAGES"] = "0"
        try:
            fn()
        finally:
            del os.environ["COMERA_HUGE_PAGES"]
    return run


def _madvise_huge():
    """madvise(MADV_HUGEPAGE) on a tensor's 2 MB-aligned interior, what
    comera does for its outputs; None off Linux."""
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
            "roofline_s": max(c["flops"] / flops_rate, c["bytes"] / bw)}


def measure_case(rows, args, flops_rate, bw):
    """Full, masked and pruned layers (advice on and off) and both floors,
    timed interleaved in one process; medians of the chosen clock."""
    torch.manual_seed(0)
    full_layer = comera.TTLinear(768, 3072, rank=args.rank)
    x = torch.randn(rows, 768, requires_grad=True)
    gy = torch.randn(rows, 3072)
    masked_layer = copy.deepcopy(full_layer)
    with torch.no_grad():
        for g in masked_layer.gates:
            g[args.live:] = 0
    pruned_layer = copy.deepcopy(masked_layer)
    comera.prune(pruned_layer)
    advise = _madvise_huge()
    methods = {"full": step_fn(full_layer, x, gy),
               "full, advice off": advice_off(step_fn(full_layer, x, gy)),
               "masked": step_fn(masked_layer, x, gy),
               "pruned": step_fn(pruned_layer, x, gy),
               "pruned, advice off": advice_off(step_fn(pruned_layer, x, gy)),
               "floor": output_floor_fn(rows, 768, 3072)}
    if advise is not None:
        methods["floor, advised"] = output_floor_fn(rows, 768, 3072, advise)
    load_before = os.getloadavg()[0]
    timing = interleaved(methods, reps=args.reps)
    med = {k: v[args.clock]["median"] for k, v in timing.items()}
    full = dict(costs(full_layer, rows, flops_rate, bw), ranks=full_layer.ranks,
                time_s=med["full"], time_no_advice_s=med["full, advice off"])
    pruned = dict(costs(pruned_layer, rows, flops_rate, bw), ranks=pruned_layer.ranks,
                  time_s=med["pruned"], time_no_advice_s=med["pruned, advice off"])
    floor_s = med.get("floor, advised", med["floor"])
    return {
        "rows": rows, "full": full, "masked_time_s": med["masked"], "pruned": pruned,
        "output_floor_s": floor_s, "output_floor_no_advice_s": med["floor"],
        "above_floor_ratio": (full["time_s"] - floor_s) / max(pruned["time_s"] - floor_s, 1e-9),
        "time_ratio": full["time_s"] / pruned["time_s"],
        "time_ratio_no_advice": full["time_no_advice_s"] / pruned["time_no_advice_s"],
        "flop_ratio": full["flops"] / pruned["flops"],
        "roofline_ratio": full["roofline_s"] / pruned["roofline_s"],
        "masked_over_pruned": med["masked"] / pruned["time_s"],
        "load": [load_before, os.getloadavg()[0]], "timing": timing,
    }


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
    malloc_env = {k: v for k, v in sorted(os.environ.items())
                  if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    torch.set_num_threads(args.threads)
    flops_rate, bw = sgemm_flops(), copy_bandwidth()
    cases = []
    for rows in args.rows:
        case = measure_case(rows, args, flops_rate, bw)
        cases.append(case)
        f, p = case["full"], case["pruned"]
        print(f"rows {rows}: {f['ranks']} {f['time_s'] * 1e3:.1f} ms -> {p['ranks']} "
              f"{p['time_s'] * 1e3:.1f} ms (masked {case['masked_time_s'] * 1e3:.1f} ms): time "
              f"{case['time_ratio']:.2f}x (advice off: {f['time_no_advice_s'] * 1e3:.1f} -> "
              f"{p['time_no_advice_s'] * 1e3:.1f} ms, {case['time_ratio_no_advice']:.2f}x), "
              f"above the {case['output_floor_s'] * 1e3:.1f} ms floor "
              f"{case['above_floor_ratio']:.2f}x, FLOPs {case['flop_ratio']:.2f}x, roofline "
              f"{case['roofline_ratio']:.2f}x, load {case['load'][0]:.2f} -> "
              f"{case['load'][1]:.2f}", flush=True)
    payload = {"machine": machine_info(), "sgemm_flops_per_s": flops_rate,
               "copy_bytes_per_s": bw, "dtype": "float32", "layer": "TTLinear(768, 3072)",
               "rank": args.rank, "live_rank": args.live, "clock": args.clock,
               "interleaved": True, "reps": args.reps, "malloc_env": malloc_env,
               "cases": cases}
    write_results("prune_cpu" if args.clock == "wall" else "prune_cpu_cputime", payload,
                  markdown(payload, args))


def markdown(payload, args):
    malloc_env = payload["malloc_env"]
    md = [f"# Pruning: TTLinear 768 -> 3072, rank {args.rank} -> live rank {args.live}, "
          "forward+backward, CPU, float32\n",
          f"Machine: {payload['machine']['processor']}, {args.threads} threads, torch "
          f"{torch.__version__}, {args.clock} clock, median of {args.reps} interleaved "
          f"rounds; sgemm {payload['sgemm_flops_per_s'] / 1e9:.1f} GFLOP/s, copy "
          f"{payload['copy_bytes_per_s'] / 1e9:.1f} GB/s (measured in the same run). Masked: "
          "dead ranks zeroed but still computed (no pruning). Ratios are full / pruned; "
          "roofline = max(plan flops / sgemm, plan bytes / copy). 'advice off': the same "
          "layer with comera's huge-page advice switched off (COMERA_HUGE_PAGES=0), timed in "
          "the same rounds. Floor = allocating and writing y and dx alone (torch.empty + "
          "fill), with the same advice / without; the ratio above the floor uses the advised "
          "floor. glibc malloc settings: "
          f"{' '.join(f'{k}={v}' for k, v in malloc_env.items()) or 'defaults'}.\n",
          "| rows | ranks | ms | ms advice off | masked ms | pruned ranks | pruned ms | "
          "pruned ms advice off | time ratio | ratio advice off | FLOP ratio | roofline ratio "
          "| floor ms advised / not | ratio above floor | masked / pruned | load |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in payload["cases"]:
        f, p = c["full"], c["pruned"]
        md.append(f"| {c['rows']} | {f['ranks']} | {f['time_s'] * 1e3:.1f} | "
                  f"{f['time_no_advice_s'] * 1e3:.1f} | {c['masked_time_s'] * 1e3:.1f} | "
                  f"{p['ranks']} | {p['time_s'] * 1e3:.1f} | {p['time_no_advice_s'] * 1e3:.1f} | "
                  f"{c['time_ratio']:.2f}x | {c['time_ratio_no_advice']:.2f}x | "
                  f"{c['flop_ratio']:.2f}x | {c['roofline_ratio']:.2f}x | "
                  f"{c['output_floor_s'] * 1e3:.1f} / {c['output_floor_no_advice_s'] * 1e3:.1f} | "
                  f"{c['above_floor_ratio']:.2f}x | {c['masked_over_pruned']:.2f}x | "
                  f"{c['load'][0]:.2f} -> {c['load'][1]:.2f} |")
    flags = f" --threads {args.threads}" if args.threads != 2 else ""
    flags += "" if args.clock == "wall" else " --clock cpu"
    flags += "" if args.reps == 9 else f" --reps {args.reps}"
    env = "".join(f"{k}={v} " for k, v in malloc_env.items())
    md.append(f"\nReproduce: `{env}python benchmarks/bench_prune.py{flags}` (after "
              "`make install`).\n")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
