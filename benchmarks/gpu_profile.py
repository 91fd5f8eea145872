"""Where a TTLinear forward+backward spends its GPU time, kernel by kernel,
beside nn.Linear and the torch.matmul merge path (bench_linear.MatmulMerge).

    python benchmarks/gpu_profile.py --out DIR      # on a GPU, ~20 s
    python benchmarks/gpu_profile.py --out DIR --layer embedding

Writes DIR/gpu_profile.md: per method, the CUDA kernels of 20 steps
(torch.profiler), sorted by GPU time, and the wall time per step; for
TTLinear also every kernel launch of one step in order, with its grid, block
and GPU time (from the profiler's trace), to tell the launches of one kernel
apart, and the host side of the same steps sorted by self CPU time.  With
--layer embedding: TTEmbedding(30522, 768, rank 16) against nn.Embedding on
4096 Zipf(1.1) indices, written to DIR/gpu_profile_embedding.md.
"""
import json
import tempfile
import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import comera

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_embedding import zipf_indices  # noqa: E402
from bench_linear import MatmulMerge  # noqa: E402


def module(method, in_f, out_f, rank, dtype):
    torch.manual_seed(0)
    layer = comera.TTLinear(in_f, out_f, rank=rank)
    m = {"nn.Linear": nn.Linear(in_f, out_f), "comera.TTLinear": layer,
         "matmul merge": MatmulMerge(layer)}[method]
    return m.to("cuda", dtype)


def launches(step, what="TTLinear"):
    """Every GPU kernel and memset of one step, in launch order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    rows = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                  key=lambda e: e["ts"])
    out = [f"### One {what} step, launch by launch", "",
           "| # | kernel | grid | block | us |", "|---|---|---|---|---|"]
    for i, e in enumerate(rows):
        a = e.get("args", {})
        out.append(f"| {i} | {e['name'][:70]} | {a.get('grid', '')} | {a.get('block', '')} "
                   f"| {e.get('dur', 0):.1f} |")
    total = sum(e.get("dur", 0) for e in rows)
    return out + ["", f"GPU time in this step: {total:.1f} us", ""]


def profile_steps(step, steps):
    """Wall ms per step (unprofiled), and the profiler of `steps` more."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return wall, prof


def embedding_lines(args):
    num, dim, rank = 30522, 768, 16
    idx = zipf_indices(num, 4096, torch.Generator().manual_seed(0)).cuda()
    gy = torch.randn(4096, dim, device="cuda")
    lines = [f"# GPU profile: embedding {num} x {dim}, TT rank {rank}, 4096 Zipf(1.1) indices,"
             " float32", "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
             f"{args.steps} forward+backward steps per method.", ""]
    torch.manual_seed(0)
    for method, m in (("nn.Embedding", nn.Embedding(num, dim)),
                      ("comera.TTEmbedding", comera.TTEmbedding(num, dim, rank=rank))):
        m = m.cuda()

        def step():
            for p in m.parameters():
                p.grad = None
            m(idx).backward(gy)

        wall, prof = profile_steps(step, args.steps)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                          max_name_column_width=60)
        lines += [f"## {method}: {wall:.3f} ms per step (wall, unprofiled)", "", "```", table,
                  "```", ""]
        if method == "comera.TTEmbedding":
            lines += launches(step, "TTEmbedding")
    return lines


def write(out, name, lines):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="768,3072")
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layer", choices=["linear", "embedding"], default="linear")
    args = ap.parse_args(argv)
    if args.layer == "embedding":
        write(args.out, "gpu_profile_embedding.md", embedding_lines(args))
        return
    in_f, out_f = (int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.rows, in_f, device="cuda", dtype=dtype, requires_grad=True)
    gy = torch.randn(args.rows, out_f, device="cuda", dtype=dtype)
    lines = [f"# GPU profile: {in_f} -> {out_f}, rank {args.rank}, {args.rows} rows, {args.dtype}",
             "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
             f"{args.steps} forward+backward steps per method.", ""]
    for method in ("nn.Linear", "comera.TTLinear", "matmul merge"):
        m = module(method, in_f, out_f, args.rank, dtype)

        def step():
            x.grad = None
            for p in m.parameters():
                p.grad = None
            m(x).backward(gy)

        wall, prof = profile_steps(step, args.steps)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        lines += [f"## {method}: {wall:.3f} ms per step (wall, unprofiled)", "", "```", table, "```", ""]
        if method == "comera.TTLinear":
            lines += launches(step)
            host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                             max_name_column_width=60)
            lines += ["### The same steps by host (CPU) time", "", "```", host, "```", ""]
    write(args.out, "gpu_profile.md", lines)


if __name__ == "__main__":
    main()
