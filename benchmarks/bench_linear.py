"""TTLinear forward+backward against nn.Linear and the same merge path written
with torch.matmul, at transformer shapes (4096 rows = 32 x 128 tokens).

    python benchmarks/bench_linear.py            # all cases, ~2-3 minutes
    python benchmarks/bench_linear.py --quick    # one case

Writes benchmarks/results/linear_cpu.json and linear_cpu.md.  Also measures
the machine's sgemm rate and copy bandwidth in the same run and reports each
TTLinear case's roofline efficiency:
    max(plan flops / sgemm rate, plan bytes / copy bandwidth) / measured time.
Peak memory is the growth of the process's peak RSS during one forward +
backward, in a fresh subprocess per case.
"""
import argparse
import json

import torch
from torch import nn

import comera
from comera import tt
from common import (copy_bandwidth, keep_freed_memory, machine_info, peak_memory_subprocess, peak_rss_bytes,
                    reset_peak_rss, rss_bytes,
                    sgemm_flops, time_fn, write_results)

SHAPES = [(768, 768), (768, 3072), (3072, 768)]
RANKS = [8, 16, 30, 64]
ROWS = 4096


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
        V = tt.merge(cores[: self.p], gates[: self.p])[: self.in_f]
        U = tt.merge(cores[self.p:], gates[self.p:]).reshape(V.shape[1], -1)[:, : self.out_f]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-case")
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heap_cache = keep_freed_memory()
    if args.memory_case:
        return memory_case(json.loads(args.memory_case))
    flops_rate, bw = sgemm_flops(), copy_bandwidth()
    shapes = [(768, 3072)] if args.quick else SHAPES
    ranks = [30] if args.quick else RANKS
    rows = []
    for in_f, out_f in shapes:
        x = torch.randn(ROWS, in_f, requires_grad=True)
        gy = torch.randn(ROWS, out_f)
        dense = build("nn.Linear", in_f, out_f, 0)
        t_dense = time_fn(step_fn(dense, x, gy), reps=5)
        m_dense = None if args.no_memory else peak_memory_subprocess(
            "bench_linear", {"method": "nn.Linear", "in": in_f, "out": out_f, "rank": 0})
        for rank in ranks:
            ttl = build("comera.TTLinear", in_f, out_f, rank)
            mm = build("matmul merge", in_f, out_f, rank)
            t_tt = time_fn(step_fn(ttl, x, gy), reps=9)
            t_mm = time_fn(step_fn(mm, x, gy), reps=9)
            plan = ttl.plan(ROWS)
            cost = plan[plan["path"]]
            roof = max(cost["flops"] / flops_rate, cost["bytes"] / bw)
            mem = {}
            if not args.no_memory:
                for method in ("comera.TTLinear", "matmul merge"):
                    mem[method] = peak_memory_subprocess(
                        "bench_linear", {"method": method, "in": in_f, "out": out_f, "rank": rank})
            rows.append({
                "in": in_f, "out": out_f, "rank": rank, "rows": ROWS, "ranks": ttl.ranks,
                "path": plan["path"], "plan_flops": cost["flops"], "plan_bytes": cost["bytes"],
                "time_dense_s": t_dense, "time_tt_s": t_tt, "time_matmul_merge_s": t_mm,
                "speedup_vs_dense": t_dense / t_tt, "speedup_vs_matmul_merge": t_mm / t_tt,
                "roofline_efficiency": roof / t_tt,
                "peak_mem_dense_bytes": m_dense, "peak_mem_tt_bytes": mem.get("comera.TTLinear"),
                "peak_mem_matmul_merge_bytes": mem.get("matmul merge"),
            })
            print(json.dumps(rows[-1]))
    payload = {"machine": machine_info(), "glibc_keep_freed_memory": heap_cache, "sgemm_flops_per_s": flops_rate,
               "copy_bytes_per_s": bw, "dtype": "float32", "cases": rows}
    mb = lambda b: "-" if b is None else f"{b / 2**20:.1f}"
    md = ["# TTLinear forward+backward, CPU, float32, 4096 rows\n",
          f"Machine: {payload['machine']['processor']}, {args.threads} threads, torch "
          f"{torch.__version__}; sgemm {flops_rate / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s "
          "(measured in the same run). Freed memory stays in the heap for every method "
          "(mallopt, as with jemalloc/tcmalloc).\n",
          "| in -> out | rank | path | nn.Linear ms | TTLinear ms | matmul merge ms | x dense | "
          "x matmul merge | roofline eff. | peak MB dense / TT / merge |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['in']} -> {r['out']} | {r['rank']} | {r['path']} | "
                  f"{r['time_dense_s'] * 1e3:.2f} | {r['time_tt_s'] * 1e3:.2f} | "
                  f"{r['time_matmul_merge_s'] * 1e3:.2f} | {r['speedup_vs_dense']:.1f} | "
                  f"{r['speedup_vs_matmul_merge']:.2f} | {r['roofline_efficiency'] * 100:.0f}% | "
                  f"{mb(r['peak_mem_dense_bytes'])} / {mb(r['peak_mem_tt_bytes'])} / "
                  f"{mb(r['peak_mem_matmul_merge_bytes'])} |")
    md.append("\nReproduce: `python benchmarks/bench_linear.py` (after `make install`).\n")
    write_results("linear_cpu" if not args.quick else "linear_cpu_quick", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
