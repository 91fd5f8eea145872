"""TTEmbedding against nn.Embedding: parameters, lookup speed, training memory.

Tables: 30522 x 768 (BERT vocabulary) and 1,000,000 x 64 (a DLRM-style
table), TT ranks 16 and 32, default TT shapes (3 cores).  Indices are
Zipf(1.1): id k is drawn with probability proportional to (k + 1)^-1.1, so
low ids are hot (as in a frequency-sorted vocabulary); a second draw applies
a fixed random permutation to the ids (hot rows scattered over the table),
which leaves the number of distinct rows unchanged but makes shared
prefixes rarer.

Measured, all in this one run:
  * parameter bytes of the TT cores (+ gates) against the dense table;
  * forward + backward wall time of one 4096-index batch (output gradient
    given, parameter gradients set to None before each step, as
    zero_grad() does): nn.Embedding (dense gradient), TTEmbedding with the
    planner's choice (dedup + shared prefixes), with dedup only, and with
    dedup turned off (every index contracted on its own); at 1 thread and
    at torch's default thread count.  Methods are interleaved and each is
    timed `repeats` times by benchmarks/timing.py: wall clock is the
    headline, the median (with the minimum in brackets; IQR in the JSON).
    At 1 thread the median process CPU time is reported too: on a busy
    machine it tracks the work done more closely than wall time.  Every
    result carries the machine record (CPU, ISA, torch's BLAS, measured
    sgemm and copy rates, the load);
  * peak training memory over 100 AdamW steps (loss = mean of the squared
    output) on fresh 4096-index batches, each layer in its own subprocess.
    Two numbers: (a) the peak resident set growth of the process (Linux
    VmHWM, reset after one warm-up step of a tiny model and after the
    batches are made, before the layer is built), which includes
    everything: parameters, gradients, AdamW state, activations, the C
    kernels' workspace.  glibc runs with a fixed mmap threshold
    (MALLOC_MMAP_THRESHOLD_=131072) so freed buffers go back to the system
    instead of being cached by the allocator, whose caching depends on
    allocation history; (b) a tensor account: parameter, gradient and AdamW
    state bytes plus the activations (the output, its gradient,
    non-parameter tensors saved for backward) of one step.  The dense
    layers run 10 steps by default (--dense-steps): their memory is flat
    from the first step on, when AdamW allocates its state, and a dense
    AdamW step over a 64M-entry table takes seconds on two busy cores.

Writes benchmarks/results/bench_embedding.json and .md.

    python benchmarks/bench_embedding.py            # full run: about 10 minutes on the
                                                    # shared 2-core machine under load
    python benchmarks/bench_embedding.py --quick    # smoke run
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

import comera
from timing import (assert_threads, finish_record, interleaved, machine_line, machine_record,
                    paired_ratio)

TABLES = [(30522, 768), (1_000_000, 64)]
RANKS = [16, 32]
BATCH = 4096
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def zipf_indices(num, count, generator, permute=None):
    """`count` ids with P(k) proportional to (k + 1)^-1.1; `permute` maps ranks to ids."""
    probs = torch.arange(1, num + 1, dtype=torch.float64) ** -1.1
    idx = torch.multinomial(probs, count, replacement=True, generator=generator)
    return idx if permute is None else permute[idx]


def make_layer(kind, num, dim, rank):
    if kind == "dense":
        return nn.Embedding(num, dim)
    return comera.TTEmbedding(num, dim, rank=rank)


# ------------------------------------------------------------------ speed
def time_methods(fns, repeats, warmup=2):
    """fns: name -> (setup, run).  Timed by benchmarks/timing.py: interleaved
    rounds, wall clock, medians with spread.  setup runs inside the timed
    call (thread count, strategy, gradients to None: about 20 us for a TT
    layer on the two-core EPYC)."""
    calls = {name: (lambda setup=setup, run=run: (setup(), run()))
             for name, (setup, run) in fns.items()}
    t = interleaved(calls, reps=repeats, warmup=warmup)
    return {name: {"median_ms": 1e3 * v["wall"]["median"], "min_ms": 1e3 * v["wall"]["min"],
                   "iqr_ms": 1e3 * v["wall"]["iqr"], "cpu_median_ms": 1e3 * v["cpu"]["median"],
                   "reps": v["wall"]["reps"], "rounds_ms": [1e3 * x for x in v["samples"]]}
            for name, v in t.items()}


def step_fn(layer, idx, grad, reuse=None, threads=None):
    """(setup, run): setup picks the thread count and strategy and drops the
    gradients (untimed); run is one forward + backward."""
    def setup():
        if threads is not None:
            assert_threads(threads)
        if reuse is not None:
            layer.reuse = reuse
        layer.zero_grad(set_to_none=True)

    def run():
        layer(idx).backward(grad)
    return setup, run


def bench_speed(num, dim, rank, repeats, dense_layer, thread_counts):
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num, generator=gen)
    layer = make_layer("tt", num, dim, rank)
    grad = torch.randn(BATCH, dim, generator=gen)
    out = {}
    default_threads = torch.get_num_threads()
    for dist, permute in (("zipf", None), ("zipf-shuffled", perm)):
        idx = zipf_indices(num, BATCH, gen, permute)
        for threads in (thread_counts if dist == "zipf" else [1]):
            fns = {"tt_auto": step_fn(layer, idx, grad, "auto", threads),
                   "tt_dedup": step_fn(layer, idx, grad, "dedup", threads),
                   "tt_nodedup": step_fn(layer, idx, grad, "none", threads)}
            if dist == "zipf":
                fns["dense"] = step_fn(dense_layer, idx, grad, threads=threads)
            try:
                t = time_methods(fns, repeats)
            finally:
                torch.set_num_threads(default_threads)
            res = {"threads": threads, "times": t, "plan": layer.plan(idx)}
            res["dedup_speedup"] = t["tt_nodedup"]["median_ms"] / t["tt_auto"]["median_ms"]
            res["dedup_speedup_paired"] = paired_ratio(t["tt_nodedup"]["rounds_ms"],
                                                       t["tt_auto"]["rounds_ms"])
            res["dedup_only_speedup"] = t["tt_nodedup"]["median_ms"] / t["tt_dedup"]["median_ms"]
            if threads == 1:  # CPU time: what the work costs, whatever else runs
                res["dedup_speedup_cpu"] = (t["tt_nodedup"]["cpu_median_ms"] /
                                            t["tt_auto"]["cpu_median_ms"])
            if "dense" in t:
                res["speedup_vs_dense"] = t["dense"]["median_ms"] / t["tt_auto"]["median_ms"]
            out[f"{dist}, {threads} thread{'s' if threads > 1 else ''}"] = res
    return layer, out


# ----------------------------------------------------------------- memory
def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(kind, num, dim, rank, steps):
    """Runs in a subprocess: `steps` AdamW steps, prints one JSON line."""
    assert_threads(int(os.environ["OMP_NUM_THREADS"]))  # set by bench_memory
    for warm in (make_layer("dense", 64, 8, 2), make_layer("tt", 64, 8, 2)):  # lazy imports
        opt = torch.optim.AdamW(warm.parameters())
        warm(torch.tensor([1, 2])).square().mean().backward()
        opt.step()
    del warm, opt
    gen = torch.Generator().manual_seed(1)
    batches = [zipf_indices(num, BATCH, gen) for _ in range(steps)]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    rss0 = _status_kb("VmRSS")
    layer = make_layer(kind, num, dim, rank)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    params = list(layer.parameters())
    param_ptrs = {p.data_ptr() for p in params}
    saved = {}

    def pack(t):
        if t.data_ptr() not in param_ptrs:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    act_bytes = 0
    start = time.perf_counter()
    for s, idx in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if s == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(idx)
                loss = out.square().mean()
            # the output and its gradient; `square` saves the output itself
            act_bytes = 2 * out.numel() * out.element_size() + sum(
                b for p, b in saved.items() if p != out.data_ptr())
        else:
            out = layer(idx)
            loss = out.square().mean()
        loss.backward()
        opt.step()
        del out, loss
    seconds = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM") - rss0
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    state = [v for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    account = {"params": nbytes(params), "grads": nbytes([p.grad for p in params]),
               "adamw_state": nbytes(state), "activations": act_bytes}
    account["total"] = sum(account.values())
    print(json.dumps({"peak_rss_bytes": peak_kb * 1024, "tensor_account": account,
                      "steps": steps, "seconds": seconds}))


def bench_memory(kind, num, dim, rank, steps):
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", kind, str(num), str(dim),
           str(rank), str(steps)]
    # Memory does not depend on the thread count: one thread, asserted in the worker.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- report
def fmt_bytes(b):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def targets(report):
    """The targets (parameters, dedup speed-up, speed against nn.Embedding,
    memory), read off this run."""
    out = ["## Targets", ""]
    for r in report["configs"]:
        if r["table"] == "30522 x 768" and r["rank"] == 32:
            out.append(f"- 30522 x 768 at rank 32, >= 100x fewer parameters: "
                       f"**{r['compression']:.1f}x**")
    ups = [(f"{r['table']} r{r['rank']} {k}", s["dedup_speedup"]) for r in report["configs"]
           for k, s in r["speed"].items()]
    one = [(n, u) for n, u in ups if n.endswith(" 1 thread")]
    met = [name for name, up in one if up >= 3.0]
    out.append(f"- Zipf(1.1) batch, 1 thread, dedup + prefixes >= 3x faster than no dedup "
               f"(wall median): met in {len(met)} of {len(one)} cases "
               f"({'; '.join(met) if met else 'none'}); range {min(u for _, u in one):.2f}x "
               f"to {max(u for _, u in one):.2f}x")
    # a missed case beside the planner's flop ratio (modelled forward flops,
    # no dedup over dedup + prefixes): the speed-up if time followed flops
    for r in report["configs"]:
        for k, sp in r["speed"].items():
            if k.endswith(" 1 thread") and sp["dedup_speedup"] < 3.0:
                f = sp["plan"]["flops"]
                out.append(f"  - missed: {r['table']} r{r['rank']} {k}: "
                           f"{sp['dedup_speedup']:.2f}x (planner's flops, none / dedup + prefixes: "
                           f"{f['none'] / f['prefix']:.2f}x)")
    for r in report["configs"]:
        if r["table"] != "30522 x 768":
            continue
        for k, sp in r["speed"].items():
            if "speedup_vs_dense" in sp:
                verdict = "met" if sp["speedup_vs_dense"] >= 1.0 else "MISSED"
                out.append(f"- 30522 x 768 r{r['rank']} {k}: TT lookup+backward vs nn.Embedding "
                           f"(sparse=False) **{sp['speedup_vs_dense']:.2f}x** ({verdict}; "
                           f">= 1.0x wanted)")
    for table, mem in report["memory"].items():
        if table.startswith("1000000"):
            for name, m in mem.items():
                if name != "dense":
                    ratio = mem["dense"]["peak_rss_bytes"] / max(m["peak_rss_bytes"], 1)
                    out.append(f"- 1M x 64, peak training memory >= 50x below nn.Embedding + "
                               f"AdamW: {name} **{ratio:.1f}x** (peak RSS growth)")
    return out


def markdown(report):
    lines = ["# TTEmbedding vs nn.Embedding", "",
             f"Command: `{report['command']}`  ",
             machine_line(report["machine_record"]), "", *targets(report), "",
             "## Parameters", "",
             "| table | rank | TT shape (rows x dims) | ranks | TT params | TT bytes | dense bytes | fewer params |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["configs"]:
        lines.append(f"| {r['table']} | {r['rank']} | {r['row_shape']} x {r['dim_shape']} | "
                     f"{r['ranks']} | {r['tt_params']:,} | {fmt_bytes(r['tt_bytes'])} | "
                     f"{fmt_bytes(r['dense_bytes'])} | **{r['compression']:.1f}x** |")
    lines += ["", f"## Forward + backward, one batch of {BATCH} indices (wall ms: median of "
              f"{report['repeats']} interleaved runs, min in brackets; at 1 thread also the "
              "median CPU ms after the slash; after the speed-up, the 95% interval of the "
              "median per-round ratio, no dedup over auto, in square brackets)", "",
              "| table | rank | indices, threads | distinct rows | dense | TT auto (dedup + prefixes) | TT dedup only | TT no dedup | dedup speed-up, wall (CPU) | TT vs dense |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["configs"]:
        for dist, s in r["speed"].items():
            t = s["times"]

            def cell(k):
                if k not in t:
                    return "-"
                out = f"{t[k]['median_ms']:.1f} ({t[k]['min_ms']:.1f})"
                return out + (f" / {t[k]['cpu_median_ms']:.1f}" if s["threads"] == 1 else "")
            vs = f"{s['speedup_vs_dense']:.2f}x" if "speedup_vs_dense" in s else "-"
            up = f"**{s['dedup_speedup']:.2f}x**"
            if "dedup_speedup_cpu" in s:
                up += f" ({s['dedup_speedup_cpu']:.2f}x)"
            if "dedup_speedup_paired" in s:
                p = s["dedup_speedup_paired"]
                up += f" [{p['lo']:.2f}-{p['hi']:.2f}]"
            lines.append(f"| {r['table']} | {r['rank']} | {dist} | {s['plan']['unique']} | "
                         f"{cell('dense')} | {cell('tt_auto')} | {cell('tt_dedup')} | "
                         f"{cell('tt_nodedup')} | {up} | {vs} |")
    lines += ["", "Planner's forward flops for the batch (none / dedup / dedup + prefixes):", ""]
    for r in report["configs"]:
        for dist, s in r["speed"].items():
            if not dist.endswith(" 1 thread"):
                continue
            f = s["plan"]["flops"]
            lines.append(f"- {r['table']} r{r['rank']} {dist}: {f['none']:.3g} / {f['dedup']:.3g} / "
                         f"{f['prefix']:.3g} (distinct prefixes per level {s['plan']['prefixes']})")
    lines += ["", f"## Peak training memory, {report['steps']} AdamW steps "
              f"({report['dense_steps']} for the dense layers)", "",
              "Peak RSS growth includes parameters, gradients, AdamW state, activations, kernel "
              "workspace and allocator slack; the tensor account counts parameters + gradients + "
              "AdamW state + one step's activations.", "",
              "| table | layer | peak RSS growth | tensor account | ratio dense/TT (RSS) | ratio (account) | time for the steps |",
              "|---|---|---|---|---|---|---|"]
    for table, mem in report["memory"].items():
        dense = mem["dense"]
        for name, m in mem.items():
            rr = dense["peak_rss_bytes"] / max(m["peak_rss_bytes"], 1)
            ra = dense["tensor_account"]["total"] / m["tensor_account"]["total"]
            lines.append(f"| {table} | {name} | {fmt_bytes(m['peak_rss_bytes'])} | "
                         f"{fmt_bytes(m['tensor_account']['total'])} | "
                         f"{'-' if name == 'dense' else f'**{rr:.1f}x**'} | "
                         f"{'-' if name == 'dense' else f'{ra:.1f}x'} | {m['seconds']:.1f} s |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps (smoke run)")
    ap.add_argument("--repeats", type=int, default=11, help="timed runs per method")
    ap.add_argument("--steps", type=int, default=100, help="AdamW steps of the TT layers")
    ap.add_argument("--dense-steps", type=int, default=10, help="AdamW steps of the dense layers")
    ap.add_argument("--memory-worker", nargs=5, metavar=("KIND", "NUM", "DIM", "RANK", "STEPS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_worker:
        kind, num, dim, rank, steps = args.memory_worker
        memory_worker(kind, int(num), int(dim), int(rank), int(steps))
        return
    repeats, steps, dense_steps = args.repeats, args.steps, args.dense_steps
    if args.quick:
        repeats, steps, dense_steps = 2, 5, 2
    thread_counts = sorted({1, torch.get_num_threads()})
    torch.manual_seed(0)
    report = {"command": " ".join(["python benchmarks/bench_embedding.py", *sys.argv[1:]]),
              "machine_record": machine_record(),
              "clock": "wall", "interleaved": True,
              "repeats": repeats, "steps": steps, "dense_steps": dense_steps, "batch": BATCH,
              "configs": [], "memory": {}}
    for num, dim in TABLES:
        table = f"{num} x {dim}"
        dense = nn.Embedding(num, dim)
        for rank in RANKS:
            layer, speed = bench_speed(num, dim, rank, repeats, dense, thread_counts)
            cfg = {"table": table, "rank": rank, "row_shape": layer.row_shape,
                   "dim_shape": layer.dim_shape, "ranks": layer.ranks,
                   "tt_params": sum(p.numel() for p in layer.parameters()),
                   "tt_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
                   "dense_bytes": num * dim * 4, "speed": speed}
            cfg["compression"] = cfg["dense_bytes"] / cfg["tt_bytes"]
            report["configs"].append(cfg)
            ups = ", ".join(f"{s['dedup_speedup']:.2f}x ({k})" for k, s in speed.items())
            print(f"{table} r{rank}: {cfg['compression']:.1f}x fewer parameters; dedup speed-up "
                  f"{ups}", flush=True)
        del dense
        mem = {"dense": bench_memory("dense", num, dim, 0, dense_steps)}
        for rank in RANKS:
            mem[f"TT r{rank}"] = bench_memory("tt", num, dim, rank, steps)
            ratio = mem["dense"]["peak_rss_bytes"] / max(mem[f"TT r{rank}"]["peak_rss_bytes"], 1)
            print(f"{table} r{rank}: peak training memory {ratio:.1f}x below dense", flush=True)
        report["memory"][table] = mem
    finish_record(report["machine_record"])
    os.makedirs(RESULTS, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    with open(os.path.join(RESULTS, f"bench_embedding{suffix}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(RESULTS, f"bench_embedding{suffix}.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
