"""Per-call cost of the torch glue: TTLinear(128, 512, rank=16) forward on one
row, one thread, median of 200 calls (after 50 warm-up calls), in microseconds.
Also the bare operator call (torch.ops.comera.tt_linear) on the same inputs,
and on zero rows (the glue alone: boxing, checks, prepare, output allocation).

    python tools/bench_call_overhead.py [--repeat N]
"""
import argparse
import statistics
import time

import torch

import comera


def median_us(fn, n, warmup=50):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5, help="report the best of this many medians")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = comera.TTLinear(128, 512, rank=16)
    x = torch.randn(1, 128)
    cores, gates = list(layer.cores), list(layer.gates)
    num_in = layer.num_in_cores if hasattr(layer, "num_in_cores") else len(cores) // 2
    bias = layer.bias
    op = torch.ops.comera.tt_linear.default
    with torch.no_grad():
        layer_us = min(median_us(lambda: layer(x), args.calls) for _ in range(args.repeat))
        op_us = min(median_us(lambda: op(x, cores, gates, bias, num_in, 512, 0), args.calls)
                    for _ in range(args.repeat))
        x0 = x[:0]  # no rows: checks, prepare and output allocation, no kernel
        glue_us = min(median_us(lambda: op(x0, cores, gates, bias, num_in, 512, 0), args.calls)
                      for _ in range(args.repeat))
    print(f"torch {torch.__version__}: TTLinear(128, 512, rank=16) forward, batch 1, 1 thread: "
          f"layer {layer_us:.1f} us, op {op_us:.1f} us, op on 0 rows {glue_us:.1f} us (median of {args.calls}, best of "
          f"{args.repeat})")


if __name__ == "__main__":
    main()
