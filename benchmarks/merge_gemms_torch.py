"""The torch side of the CPU kernel design (docs/design.md section 5):
torch.mm on each batch product of the TTLinear merge path (the shapes that
benchmarks/c/merge_gemms.c times for comera's micro-kernel), and the
per-call time at batch 1 of TTLinear against nn.Linear.

    python benchmarks/merge_gemms_torch.py [--threads 1] [--in 768 --out 3072 --rank 30]

Prints milliseconds and GFLOP/s (interleaved medians; wall clock and process CPU
time, which at 1 thread compares with the thread CPU time that the C harness
reports on a loaded machine)."""
import argparse

import torch
from torch import nn

import comera
from common import keep_freed_memory
from timing import assert_threads, interleaved, machine_line, machine_record


def products(B, n_in, n_out, r):
    """name -> (callable, flops) for the merge path's products over B rows."""
    x, dy = torch.randn(B, n_in), torch.randn(B, n_out)
    V, U = torch.randn(n_in, r), torch.randn(r, n_out)
    T, S = torch.randn(B, r), torch.randn(B, r)
    return {
        "fwd T = x V": (lambda: torch.mm(x, V), 2 * B * n_in * r),
        "fwd y = T U (+ bias, addmm)": (lambda: torch.addmm(dy[0], T, U), 2 * B * n_out * r),
        "bwd S = dy U^T": (lambda: torch.mm(dy, U.t()), 2 * B * n_out * r),
        "bwd dx = S V^T": (lambda: torch.mm(S, V.t()), 2 * B * n_in * r),
        "bwd dU = T^T dy": (lambda: torch.mm(T.t(), dy), 2 * B * n_out * r),
        "bwd dV = x^T S": (lambda: torch.mm(x.t(), S), 2 * B * n_in * r),
    }


def batch_one(shapes):
    """Forward of one row, no grad: TTLinear against nn.Linear."""
    out = {}
    for n_in, n_out, r in shapes:
        tt, dense = comera.TTLinear(n_in, n_out, rank=r), nn.Linear(n_in, n_out)
        x = torch.randn(1, n_in)

        def many(m):
            def run():
                with torch.no_grad():
                    for _ in range(200):
                        m(x)
            return run
        t = interleaved({"TTLinear": many(tt), "nn.Linear": many(dense)}, reps=7)
        out[(n_in, n_out, r)] = {k: v["wall"]["median"] / 200 for k, v in t.items()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--in", dest="n_in", type=int, default=768)
    ap.add_argument("--out", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args()
    keep_freed_memory()  # no page faults on the fresh 50 MB outputs, as in bench_linear.py
    assert_threads(args.threads)
    rec = machine_record()
    print(machine_line(rec))
    prods = products(args.rows, args.n_in, args.out, args.rank)
    t = interleaved({k: f for k, (f, _) in prods.items()}, reps=7)
    total = 0.0
    for name, (_, flops) in prods.items():
        ms, cpu = t[name]["wall"]["median"] * 1e3, t[name]["cpu"]["median"] * 1e3
        total += cpu
        print(f"{name:32s} wall {ms:8.2f} ms, cpu {cpu:8.2f} ms {flops / cpu * 1e-6:6.1f} GFLOP/s")
    print(f"{'sum (cpu)':32s} {total:8.2f} ms")
    for shape, v in batch_one([(128, 512, 16), (768, 3072, 30)]).items():
        print(f"batch 1 {shape}: TTLinear {v['TTLinear'] * 1e6:.1f} us, "
              f"nn.Linear {v['nn.Linear'] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
