"""TTLinear forward+backward against nn.Linear and the same merge path written
with torch.matmul, at transformer shapes (4096 rows = 32 x 128 tokens), in
float32 and in bfloat16.

    python benchmarks/bench_linear.py            # all cases at 1 and 2 threads, ~10 minutes
    python benchmarks/bench_linear.py --quick    # one case
    python benchmarks/bench_linear.py --shapes 768x3072,768x768 --ranks 30,16
    python benchmarks/bench_linear.py --dtypes bfloat16   # the bfloat16 part alone

Writes benchmarks/results/linear_cpu.json and linear_cpu.md.  The methods of
a case are timed interleaved by wall clock (benchmarks/timing.py), at each
thread count of --threads.  The machine record (CPU, ISA, torch's BLAS,
sgemm and copy rates measured in the same run) gives each TTLinear case's
roofline efficiency:
    max(plan flops / sgemm rate, plan bytes / copy bandwidth) / measured time.
TTLinear is also timed with comera's output pool switched off
(COMERA_OUTPUT_POOL=0, per call, same rounds: docs/design.md section 5):
its large outputs then come from torch's allocator, with the huge-page
advice; nn.Linear and the matmul path never get either (run the whole
script under GLIBC_TUNABLES=glibc.malloc.hugetlb=1 to give every method
huge pages).
Peak memory is the growth of the process's peak RSS during one forward +
backward, in a fresh subprocess per case.

The bfloat16 part times, interleaved: TTLinear and nn.Linear as bfloat16
modules (bfloat16 input and gradient); the same float32 modules under
torch.autocast("cpu", bfloat16) with bfloat16 activations (a layer between
autocast ops) and with a float32 input (a layer after a layer norm, which
autocast keeps in float32; the gradient arriving is bfloat16 either way);
and the TTLinear in float32, for "never slower than float32".  nn.Linear in
bfloat16 runs on oneDNN's AMX kernels where the CPU has them; TTLinear on
comera's kernel variant that plan() names (amx: AMX tiles).  The machine
record adds torch's measured bfloat16 GEMM rate.
"""
import argparse
import json
import os

import torch
from torch import nn

import comera
from comera.ops.dense import merge
from common import (pool_off, routed, keep_freed_memory, peak_memory_subprocess, peak_rss_bytes,
                    reset_peak_rss, rss_bytes, write_results)
from timing import assert_threads, finish_record, interleaved, machine_line, machine_record

SHAPES = [(768, 768), (768, 3072), (3072, 768)]
RANKS = [8, 16, 30, 64]
ROWS = 4096
DTYPES = ("float32", "bfloat16")


class MatmulMerge(nn.Module):
    """The merge path in plain PyTorch: V, U from the cores, two matmuls."""

    def __init__(self, layer: comera.TTLinear):
        super().__init__()
        self.cores = nn.ParameterList(nn.Parameter(c.detach().clone()) for c in layer.cores)
        self.gates = nn.ParameterList(nn.Parameter(g.detach().clone()) for g in layer.gates)
        self.bias = nn.Parameter(layer.bias.detach().clone())
        self.p, self.in_f, self.out_f = layer.num_in_cores, layer.in_features, layer.out_features

    def forward(self, x):
        cores, gates = list(self.cores), list(self.gates)
        V = merge(cores[: self.p], gates[: self.p])[: self.in_f]
        U = merge(cores[self.p:], gates[self.p:]).reshape(V.shape[1], -1)[:, : self.out_f]
        return torch.addmm(self.bias, x @ V, U)


def build(method, in_f, out_f, rank):
    torch.manual_seed(0)
    if method == "nn.Linear":
        return nn.Linear(in_f, out_f)
    layer = comera.TTLinear(in_f, out_f, rank=rank)
    return layer if method == "comera.TTLinear" else MatmulMerge(layer)


def step_fn(module, x, gy):
    def run():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(gy)
    return run


def memory_case(case):
    module = build(case["method"], case["in"], case["out"], case["rank"])
    x = torch.randn(ROWS, case["in"], requires_grad=True)
    gy = torch.randn(ROWS, case["out"])
    reset_peak_rss()
    base = rss_bytes()
    step_fn(module, x, gy)()
    print(max(0, peak_rss_bytes() - base))


def autocast_step(module, x, gy):
    """step_fn under torch.autocast("cpu", bfloat16)."""
    run = step_fn(module, x, gy)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run()
    return step


def time_bf16_case(in_f, out_f, rank, reps):
    """fwd+bwd of TTLinear and nn.Linear as bfloat16 modules and under
    autocast (bfloat16 activations, and a float32 input), and of the
    TTLinear in float32, interleaved."""
    x = torch.randn(ROWS, in_f, requires_grad=True)
    gy = torch.randn(ROWS, out_f)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    gyb = gy.to(torch.bfloat16)
    ttl, dense = build("comera.TTLinear", in_f, out_f, rank), build("nn.Linear", in_f, out_f, 0)
    ttb = build("comera.TTLinear", in_f, out_f, rank).to(torch.bfloat16)
    denseb = build("nn.Linear", in_f, out_f, 0).to(torch.bfloat16)
    methods = {"TTLinear bf16": step_fn(ttb, xb, gyb),
               "nn.Linear bf16": step_fn(denseb, xb, gyb),
               "TTLinear autocast": autocast_step(ttl, xb, gyb),
               "nn.Linear autocast": autocast_step(dense, xb, gyb),
               "TTLinear autocast f32 input": autocast_step(ttl, x, gyb),
               "nn.Linear autocast f32 input": autocast_step(dense, x, gyb),
               "TTLinear float32": step_fn(ttl, x, gy)}
    return ttb, interleaved(methods, reps=reps)


def bf16_gemm_rate(n: int = 2048) -> float:
    """torch's measured bfloat16 GEMM rate, FLOP/s (median of 5)."""
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    t = interleaved({"mm": lambda: torch.mm(a, b)}, reps=5)["mm"]["wall"]["median"]
    return 2.0 * n ** 3 / t


def bf16_row(nt, in_f, out_f, rank, reps):
    ttb, t = time_bf16_case(in_f, out_f, rank, reps)
    med = {m: v["wall"]["median"] for m, v in t.items()}
    plan = ttb.plan(ROWS)
    tt_b, tt_ac, tt_ac32 = (med["TTLinear bf16"], med["TTLinear autocast"],
                            med["TTLinear autocast f32 input"])
    return {
        "dtype": "bfloat16", "threads": nt, "in": in_f, "out": out_f, "rank": rank, "rows": ROWS,
        "ranks": ttb.ranks, "kernel": plan["kernel"], "plan_seconds": plan["seconds"],
        "timing": t, "times_s": med,
        "speedup_bf16_vs_dense_bf16": med["nn.Linear bf16"] / tt_b,
        "speedup_autocast_vs_dense_autocast": med["nn.Linear autocast"] / tt_ac,
        "speedup_autocast_f32_input_vs_dense": med["nn.Linear autocast f32 input"] / tt_ac32,
        "float32_over_bf16": med["TTLinear float32"] / tt_b,
        "float32_over_autocast": med["TTLinear float32"] / tt_ac,
        "float32_over_autocast_f32_input": med["TTLinear float32"] / tt_ac32,
    }


def time_case(in_f, out_f, rank, reps):
    """fwd+bwd of nn.Linear, TTLinear and the matmul merge path, interleaved."""
    x = torch.randn(ROWS, in_f, requires_grad=True)
    gy = torch.randn(ROWS, out_f)
    ttl = build("comera.TTLinear", in_f, out_f, rank)
    # pool off on an x of its own: freeing a pooled x.grad while the pool is
    # switched off would drop the pool's idle blocks for the pooled methods
    x_off = x.detach().clone().requires_grad_()
    methods = {"nn.Linear": step_fn(build("nn.Linear", in_f, out_f, 0), x, gy),
               "comera.TTLinear": step_fn(ttl, x, gy),
               "TTLinear pool off": pool_off(step_fn(ttl, x_off, gy)),
               "TTLinear routed": routed(step_fn(ttl, x, gy)),
               "matmul merge": step_fn(build("matmul merge", in_f, out_f, rank), x, gy)}
    return ttl, interleaved(methods, reps=reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--memory-case")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--shapes", help="comma-separated INxOUT (default: all three)")
    ap.add_argument("--ranks", help="comma-separated ranks (default: 8,16,30,64)")
    ap.add_argument("--out", help="results name (default: linear_cpu, linear_cpu_quick)")
    ap.add_argument("--dtypes", default=",".join(DTYPES),
                    help="comma-separated parts to run: float32, bfloat16")
    args = ap.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(dtypes) <= set(DTYPES):
        ap.error(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes}")
    threads = [int(t) for t in str(args.threads).split(",")]
    heap_cache = keep_freed_memory()
    if args.memory_case:
        assert_threads(threads[0])
        return memory_case(json.loads(args.memory_case))
    assert_threads(max(threads))
    machine = machine_record()
    machine["comera_kernel"] = {"float32": torch.ops.comera.cpu_isa(),
                                "bfloat16": comera.TTLinear(8, 8, rank=2).plan(
                                    1, torch.bfloat16)["kernel"]}
    if "bfloat16" in dtypes:
        machine["bf16_gemm_flops_per_s"] = bf16_gemm_rate()
    shapes = [(768, 3072)] if args.quick else SHAPES
    ranks = [30] if args.quick else RANKS
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    if args.ranks:
        ranks = [int(r) for r in args.ranks.split(",")]
    rows, bf16_rows = [], []
    for nt in threads:
        assert_threads(nt)
        for in_f, out_f in shapes:
            for rank in ranks:
                if "bfloat16" in dtypes:
                    bf16_rows.append(bf16_row(nt, in_f, out_f, rank, args.reps))
                    print(json.dumps({k: v for k, v in bf16_rows[-1].items() if k != "timing"}))
                if "float32" not in dtypes:
                    continue
                ttl, t = time_case(in_f, out_f, rank, args.reps)
                med = {m: v["wall"]["median"] for m, v in t.items()}
                plan = ttl.plan(ROWS)
                cost = plan[plan["path"]]
                route = routed(lambda: ttl.plan(ROWS)["route"])()
                roof = max(cost["flops"] / machine["sgemm_flops_per_s"],
                           cost["bytes"] / machine["copy_bytes_per_s"])
                rows.append({
                    "threads": nt, "in": in_f, "out": out_f, "rank": rank, "rows": ROWS,
                    "ranks": ttl.ranks, "path": plan["path"], "route": route,
                    "kernel": plan["kernel"], "plan_seconds": plan["seconds"],
                    "plan_flops": cost["flops"],
                    "plan_bytes": cost["bytes"], "timing": t,
                    "time_dense_s": med["nn.Linear"], "time_tt_s": med["comera.TTLinear"],
                    "time_matmul_merge_s": med["matmul merge"],
                    "time_tt_no_pool_s": med["TTLinear pool off"],
                    "time_tt_routed_s": med["TTLinear routed"],
                    "routed_speedup_vs_matmul_merge": med["matmul merge"] / med["TTLinear routed"],
                    "speedup_vs_dense": med["nn.Linear"] / med["comera.TTLinear"],
                    "speedup_vs_matmul_merge": med["matmul merge"] / med["comera.TTLinear"],
                    "roofline_efficiency": roof / med["comera.TTLinear"],
                })
                if not args.no_memory and nt == threads[0]:
                    for method, key in (("nn.Linear", "dense"), ("comera.TTLinear", "tt"),
                                        ("matmul merge", "matmul_merge")):
                        rows[-1][f"peak_mem_{key}_bytes"] = peak_memory_subprocess(
                            "bench_linear", {"method": method, "in": in_f, "out": out_f,
                                             "rank": rank}, threads=nt)
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "timing"}))
    finish_record(machine)
    payload = {"machine": machine, "glibc_keep_freed_memory": heap_cache,
               "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "dtypes": dtypes,
               "clock": "wall", "interleaved": True, "reps": args.reps, "cases": rows,
               "bf16_cases": bf16_rows}
    payload["targets"] = targets(rows, bf16_rows)
    write_results(args.out or ("linear_cpu" if not args.quick else "linear_cpu_quick"), payload,
                  markdown(payload, args))


def targets(rows, bf16_rows):
    """The CPU targets, each with its worst case: float32 TTLinear at least
    1.5x the merge path at ranks up to 30 and 1.0x above; bfloat16 TTLinear
    (as a bfloat16 module, under autocast, and under autocast with a float32
    input) never slower than the float32 layer, at least 1.5x nn.Linear in the
    same setting everywhere and 4x at 768 -> 3072 rank 30.

    Example:
        >>> r = {"threads": 1, "in": 8, "out": 8, "rank": 8, "speedup_vs_matmul_merge": 1.2}
        >>> [(t["got"], t["met"]) for t in targets([r], [])]
        [(1.2, False)]
    """
    label = lambda r: f"{r['threads']} thread(s), {r['in']} -> {r['out']} rank {r['rank']}"
    over_f32 = lambda r: min(r["float32_over_bf16"], r["float32_over_autocast"],
                             r["float32_over_autocast_f32_input"])
    over_dense = lambda r: min(r["speedup_bf16_vs_dense_bf16"],
                               r["speedup_autocast_vs_dense_autocast"],
                               r["speedup_autocast_f32_input_vs_dense"])
    wide = [r for r in bf16_rows if (r["in"], r["out"], r["rank"]) == (768, 3072, 30)]
    checks = [
        ("float32 TTLinear / merge path, ranks 8-30", 1.5,
         [(r["speedup_vs_matmul_merge"], label(r)) for r in rows if r["rank"] <= 30]),
        ("float32 TTLinear / merge path, rank 64", 1.0,
         [(r["speedup_vs_matmul_merge"], label(r)) for r in rows if r["rank"] > 30]),
        ("float32 TTLinear time / bfloat16 TTLinear time (bf16 module, autocast, autocast with "
         "a float32 input)", 1.0, [(over_f32(r), label(r)) for r in bf16_rows]),
        ("bfloat16 TTLinear / nn.Linear in the same setting", 1.5,
         [(over_dense(r), label(r)) for r in bf16_rows]),
        ("bfloat16 TTLinear / nn.Linear in the same setting, 768 -> 3072 rank 30", 4.0,
         [(over_dense(r), label(r)) for r in wide]),
    ]
    out = []
    for name, want, cases in checks:
        if cases:
            got, where = min(cases)
            out.append({"name": name, "want": f">= {want}", "got": round(got, 2),
                        "worst_case": where, "met": got >= want})
    return out


def markdown(payload, args):
    machine = payload["machine"]
    kernels = machine.get("comera_kernel", {})
    md = ["# TTLinear forward+backward, CPU, 4096 rows\n",
          machine_line(machine),
          f"comera's kernel variant: {kernels.get('float32', '?')} for float32, "
          f"{kernels.get('bfloat16', '?')} for bfloat16"
          + (f"; torch's bfloat16 GEMM {machine['bf16_gemm_flops_per_s'] / 1e9:.0f} GFLOP/s "
             "(measured in this run)" if "bf16_gemm_flops_per_s" in machine else "") + ".\n"]
    if payload["cases"]:
        md += float32_table(payload)
    if payload["bf16_cases"]:
        md += bf16_table(payload)
    if payload.get("targets"):
        md += ["\nTargets (worst case of each):\n"]
        md += [f"- {t['name']} {t['want']}: {t['got']:.2f} at {t['worst_case']} "
               f"(**{'met' if t['met'] else 'missed'}**)" for t in payload["targets"]]
    flags = " --quick" if args.quick else ""
    flags += f" --shapes {args.shapes}" if args.shapes else ""
    flags += f" --ranks {args.ranks}" if args.ranks else ""
    flags += " --no-memory" if args.no_memory else ""
    flags += f" --out {args.out}" if args.out else ""
    flags += f" --dtypes {args.dtypes}" if args.dtypes != ",".join(DTYPES) else ""
    env = f"GLIBC_TUNABLES={payload['glibc_tunables']} " if payload["glibc_tunables"] else ""
    env += "".join(f"{k}={v} " for k, v in machine.get("isa_limits", {}).items())
    md.append(f"\nReproduce: `{env}python benchmarks/bench_linear.py --threads {args.threads}"
              f" --reps {args.reps}{flags}` (after `make install`).\n")
    return "\n".join(md) + "\n"


def bf16_table(payload):
    ms = lambda v: f"{v * 1e3:.2f}"
    md = ["\n## bfloat16\n",
          "Wall clock, median of interleaved rounds. 'bf16': bfloat16 modules, bfloat16 input and "
          "gradient. 'autocast': the float32 modules under torch.autocast(\"cpu\", bfloat16), "
          "bfloat16 activations; 'autocast, f32 in': the same with a float32 input. x dense: "
          "nn.Linear's time over TTLinear's in the same setting; x TT f32: the float32 TTLinear's "
          "time over the bfloat16 one's (above 1: bfloat16 is faster). Predicted: plan()['seconds'] "
          "for the bfloat16 layer on its kernel.\n",
          "| threads | in -> out | rank | kernel | TT bf16 ms | nn.Linear bf16 ms | x dense | "
          "TT autocast ms | nn.Linear autocast ms | x dense | TT autocast, f32 in ms | "
          "nn.Linear autocast, f32 in ms | x dense | TT float32 ms | x TT f32: bf16 / autocast / "
          "f32 in | predicted ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["bf16_cases"]:
        t = r["times_s"]
        md.append(f"| {r['threads']} | {r['in']} -> {r['out']} | {r['rank']} | {r['kernel']} | "
                  f"{ms(t['TTLinear bf16'])} | {ms(t['nn.Linear bf16'])} | "
                  f"{r['speedup_bf16_vs_dense_bf16']:.2f} | {ms(t['TTLinear autocast'])} | "
                  f"{ms(t['nn.Linear autocast'])} | {r['speedup_autocast_vs_dense_autocast']:.2f} | "
                  f"{ms(t['TTLinear autocast f32 input'])} | "
                  f"{ms(t['nn.Linear autocast f32 input'])} | "
                  f"{r['speedup_autocast_f32_input_vs_dense']:.2f} | {ms(t['TTLinear float32'])} | "
                  f"{r['float32_over_bf16']:.2f} / {r['float32_over_autocast']:.2f} / "
                  f"{r['float32_over_autocast_f32_input']:.2f} | {ms(r['plan_seconds'])} |")
    return md


def float32_table(payload):
    mb = lambda b: "-" if b is None else f"{b / 2**20:.1f}"
    md = ["\n## float32\n",
          "Wall clock, median of the interleaved repetitions (spread in the JSON); nn.Linear, "
          "TTLinear and the merge path in torch.matmul timed round-robin in one process. Freed "
          "memory stays in the heap for every method (mallopt, as with jemalloc/tcmalloc). "
          "'pool off': TTLinear with its large outputs from torch's allocator (huge-page "
          "advice) instead of comera's output pool, same rounds. 'routed': TTLinear with "
          "COMERA_ROUTE=auto (opt-in; comera.ops.route), same rounds, and where it ran the "
          "products: its C kernels or torch's BLAS, as its one-off timing in the warm-up found "
          "faster. GLIBC_TUNABLES: "
          f"{payload['glibc_tunables'] or 'unset'}.\n",
          "| threads | in -> out | rank | path | nn.Linear ms | TTLinear ms | TTLinear ms pool "
          "off | matmul merge ms | x dense | x matmul merge | routed to | routed ms | routed x "
          "matmul merge | roofline eff. | predicted ms | peak MB dense / TT / merge |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["cases"]:
        md.append(f"| {r['threads']} | {r['in']} -> {r['out']} | {r['rank']} | {r['path']} | "
                  f"{r['time_dense_s'] * 1e3:.2f} | {r['time_tt_s'] * 1e3:.2f} | "
                  f"{r['time_tt_no_pool_s'] * 1e3:.2f} | "
                  f"{r['time_matmul_merge_s'] * 1e3:.2f} | {r['speedup_vs_dense']:.1f} | "
                  f"{r['speedup_vs_matmul_merge']:.2f} | {r['route']['choice']} | "
                  f"{r['time_tt_routed_s'] * 1e3:.2f} | {r['routed_speedup_vs_matmul_merge']:.2f} | "
                  f"{r['roofline_efficiency'] * 100:.0f}% | {r['plan_seconds'] * 1e3:.2f} | "
                  f"{mb(r.get('peak_mem_dense_bytes'))} / {mb(r.get('peak_mem_tt_bytes'))} / "
                  f"{mb(r.get('peak_mem_matmul_merge_bytes'))} |")
    return md


if __name__ == "__main__":
    main()
