"""Host cost of one small call: what a layer costs when its kernel is almost
free and the per-call work (Python, the dispatcher, the torch glue, autograd)
is all there is.  One thread, one process, every case timed interleaved with
its dense counterpart (benchmarks/timing.py: shuffled rounds, wall clock;
each round times ``--calls`` calls and reports the median per call):

* TTLinear(128, 512, rank=16) against nn.Linear(128, 512), one row: forward
  without gradients, and forward + backward (gradients set to None first);
* TTEmbedding(30522, 768) against nn.Embedding, 8 tokens, forward without
  gradients;
* the same TTLinear forward + backward with its cores and gates frozen
  (``requires_grad=False``: 2 gradient leaves, bias and input, as
  nn.Linear's weight, bias and input are 3) against nn.Linear: what the
  layer would cost without the autograd engine's work per leaf (one
  gradient accumulation node per core and gate).

    python tools/bench_call_overhead.py [--calls 200] [--reps 15] [--out host_cost_cpu]

Writes benchmarks/results/<out>.json and .md (with the machine record and a
``targets`` list).
"""
import argparse
import os
import sys

import torch

import comera

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from common import write_results  # noqa: E402
from timing import (finish_record, interleaved, machine_line, machine_record,  # noqa: E402
                    paired_ratio)


def batch_of(fn, calls):
    def run():
        for _ in range(calls):
            fn()
    return run


def fwd_bwd(module, x, gy):
    params = list(module.parameters())

    def run():
        for p in params:
            p.grad = None
        x.grad = None
        module(x).backward(gy)
    return run


def cases():
    torch.manual_seed(0)
    tt, dense = comera.TTLinear(128, 512, rank=16), torch.nn.Linear(128, 512)
    x1, xg, gy = torch.randn(1, 128), torch.randn(1, 128, requires_grad=True), torch.randn(1, 512)
    emb_tt, emb = comera.TTEmbedding(30522, 768), torch.nn.Embedding(30522, 768)
    tokens = torch.randint(0, 30522, (8,))
    frozen = comera.TTLinear(128, 512, rank=16)
    frozen.load_state_dict(tt.state_dict())
    for p in [*frozen.cores, *frozen.gates]:
        p.requires_grad_(False)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    return {
        "linear_forward": (no_grad(lambda: tt(x1)), no_grad(lambda: dense(x1)), 1.5),
        "linear_forward_backward": (fwd_bwd(tt, xg, gy), fwd_bwd(dense, xg, gy), 1.5),
        "embedding_forward": (no_grad(lambda: emb_tt(tokens)), no_grad(lambda: emb(tokens)), 2.0),
        "linear_forward_backward_cores_frozen": (fwd_bwd(frozen, xg, gy), fwd_bwd(dense, xg, gy),
                                                 None),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200, help="calls per timed round")
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--out", default="host_cost_cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rec = machine_record()
    rows, targets, out = [], [], {}
    for name, (tt_fn, dense_fn, want) in cases().items():
        r = interleaved({"comera": batch_of(tt_fn, args.calls), "dense": batch_of(dense_fn, args.calls)},
                        reps=args.reps, warmup=2)
        us = {k: r[k]["wall"]["median"] / args.calls * 1e6 for k in r}
        ratio = paired_ratio(r["comera"]["samples"], r["dense"]["samples"])
        out[name] = {"comera_us": us["comera"], "dense_us": us["dense"], "ratio": ratio,
                     "comera_iqr_us": r["comera"]["wall"]["iqr"] / args.calls * 1e6,
                     "dense_iqr_us": r["dense"]["wall"]["iqr"] / args.calls * 1e6}
        if want is not None:
            targets.append({"name": f"{name}: comera / dense time", "want": f"<= {want}",
                            "got": round(ratio["median"], 3), "met": ratio["median"] <= want})
        rows.append(f"| {name} | {us['comera']:.1f} | {us['dense']:.1f} | "
                    f"{ratio['median']:.2f} ({ratio['lo']:.2f}-{ratio['hi']:.2f}) | "
                    f"{'' if want is None else ('<= ' + str(want))} |")
    finish_record(rec)
    command = "python tools/bench_call_overhead.py " + " ".join(sys.argv[1:])
    payload = {"command": command.strip(), "machine": rec, "calls_per_round": args.calls,
               "rounds": args.reps, "cases": out, "targets": targets}
    md = "\n".join([
        "# Host cost of small calls (CPU, 1 thread)", "",
        f"Command: `{payload['command']}`", "", machine_line(rec), "",
        "Microseconds per call, median over interleaved rounds of "
        f"{args.calls} calls; ratio: median of the per-round ratios (95% bootstrap interval).", "",
        "| case | comera (us) | dense (us) | ratio | target |", "|---|---|---|---|---|", *rows, "",
        "Targets: " + "; ".join(f"{t['name']} {t['want']}: {t['got']} "
                                f"({'met' if t['met'] else 'missed'})" for t in targets), ""])
    write_results(args.out, payload, md)


if __name__ == "__main__":
    main()
