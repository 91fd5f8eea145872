"""The paper's six-encoder transformer (768 hidden, 3072 FFN, 12 heads, vocab
30522, sequence 128), dense against comera (every encoder linear and the
word embedding in TT format, rank 30):

1. size: parameters and MB (float32), compression of the TT layers and of
   the whole model;
2. rank-adaptive compression: stage 1 (L1 on the gates) for --stage1 steps,
   then from a copy of that model per target, stage 2 for --stage2 steps
   driving the TT layers to the target, then physical pruning; trained on
   the code-docstring data (code_docstring.py, the model's 3-way head used
   for the 2 labels) - on a 2-core CPU this is a short run that exercises the
   machinery at full size, not a converged training;
3. training-step time and whole-process peak memory at batch 1, 8 and 32:
   dense AdamW, comera at rank 30, and comera pruned to the largest target
   (train_step.py): memory in one fresh subprocess per method, time with
   every method of a batch size in one subprocess, interleaved (wall clock,
   median and interquartile range; CPU time in the JSON).  Each subprocess
   gets --threads and OMP_NUM_THREADS and asserts the count.

    python benchmarks/bench_transformer.py --threads 1
    python benchmarks/bench_transformer.py --quick      # tiny preset, seconds

Writes benchmarks/results/transformer_cpu.{json,md} and PNG plots, with the
machine record.
"""
import argparse
import copy
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F

import comera
import code_docstring
from common import RESULTS, case_subprocess, keep_freed_memory, write_results
from encoder import PRESETS, build_model
from timing import assert_threads, finish_record, machine_line, machine_record
from train_step import run_case as run_step_case, time_methods

BATCHES = [1, 8, 32]
TARGETS = [100.0, 200.0, 361.0]


def size_report(cfg, rank):
    dense = build_model(cfg, "dense")
    tt = build_model(cfg, "comera", rank=rank)
    n_dense = sum(p.numel() for p in dense.parameters())
    n_tt = sum(p.numel() for p in tt.parameters())
    return {"dense_params": n_dense, "dense_mb": n_dense * 4 / 2**20,
            "comera_params": n_tt, "comera_mb": n_tt * 4 / 2**20,
            "tt_layer_compression": comera.compression(tt), "model_compression": n_dense / n_tt,
            "summary": comera.summary(tt)}


def _step(model, opt, ra, b):
    loss = F.cross_entropy(model(b["ids"], b["segments"], b["padding"]), b["labels"])
    opt.zero_grad(set_to_none=True)
    (loss + ra.penalty()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    ra.step(opt)
    return loss.item()


def rank_adaptive(cfg, args, state_dir):
    """Stage 1 once, stage 2 per target; returns the rows and the path of the
    pruned state_dict at the largest target."""
    data = code_docstring.load(cfg.vocab, cfg.seq, max_files=args.max_files,
                               max_train=args.max_train, max_test=16, cache_dir=args.cache_dir)
    train = data["train"]
    n = train["labels"].shape[0]
    gen = torch.Generator().manual_seed(0)

    def batch(step):
        idx = torch.randint(0, n, (args.ra_batch,), generator=gen)
        return {k: t[idx] for k, t in train.items()}

    model = build_model(cfg, "comera", rank=args.rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ra = comera.RankAdaptive(model, gamma=args.gamma, threshold=args.threshold,
                             stage1_steps=args.stage1, stage2_steps=0, prune_every=25)
    start = comera.compression(model)
    n_dense = sum(p.numel() for p in build_model(cfg, "dense").parameters())
    t0 = time.perf_counter()
    losses = [_step(model, opt, ra, batch(s)) for s in range(args.stage1)]
    comera.prune(model, opt)
    rows = [{"stage": "start (rank %d)" % args.rank, "target": None, "tt_layer_compression": start,
             "params": sum(p.numel() for p in build_model(cfg, "comera", rank=args.rank).parameters())},
            {"stage": "after stage 1", "target": None, "steps": args.stage1,
             "tt_layer_compression": comera.compression(model), "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
             "seconds": time.perf_counter() - t0,
             "params": sum(p.numel() for p in model.parameters())}]
    print(json.dumps(rows[-1]), flush=True)
    best_path = None
    for target in args.targets:
        m2, o2 = copy.deepcopy((model, opt))
        ra2 = comera.RankAdaptive(m2, gamma=args.gamma, threshold=args.threshold, stage1_steps=0,
                                  stage2_steps=args.stage2, target_compression=target, prune_every=25)
        t0 = time.perf_counter()
        losses = [_step(m2, o2, ra2, batch(s)) for s in range(args.stage2)]
        comera.prune(m2, o2)
        n_params = sum(p.numel() for p in m2.parameters())
        rows.append({"stage": "after stage 2", "target": target, "steps": args.stage2,
                     "reached_target": bool(ra2.frozen),
                     "tt_layer_compression": comera.compression(m2),
                     "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "seconds": time.perf_counter() - t0,
                     "params": n_params, "mb": n_params * 4 / 2**20,
                     "target_overshoot": comera.compression(m2) / target - 1.0})
        print(json.dumps(rows[-1]), flush=True)
        if target == max(args.targets):
            best_path = os.path.join(state_dir, f"pruned_{target:g}.pt")
            torch.save(m2.state_dict(), best_path)
            rows[-1]["summary"] = comera.summary(m2)
        del m2, o2, ra2
    for r in rows:
        r["model_compression"] = n_dense / r["params"]
    return rows, best_path


def step_cases(args, preset, pruned_path):
    methods = [("dense AdamW", "dense AdamW", None), ("comera", "comera", None)]
    if pruned_path:
        methods.append((f"comera pruned to {max(args.targets):g}x", "comera", pruned_path))

    def run(case):
        if args.in_process:
            return time_methods(case) if case["kind"] == "step_time" else run_step_case(case)
        return case_subprocess("bench_transformer", case, args.threads)

    out = []
    for batch in args.batches:
        row = {"batch": batch, "methods": {}}
        for label, method, state in methods:
            row["methods"][label] = run({"kind": "step", "method": method, "preset": preset,
                                         "batch": batch, "rank": args.rank, "reps": 1,
                                         "state_path": state})
        t = run({"kind": "step_time", "preset": preset, "batch": batch, "rank": args.rank,
                 "methods": [list(m) for m in methods], "reps": args.step_reps,
                 "budget_s": args.budget})
        for label, tm in t["methods"].items():
            row["methods"][label].update(wall=tm["wall"], cpu=tm["cpu"], step_s=tm["wall"]["median"],
                                         step_cpu_s=tm["cpu"]["median"])
        d = row["methods"]["dense AdamW"]
        row["speedup_vs_dense"] = {k: d["step_s"] / v["step_s"] for k, v in row["methods"].items()}
        row["memory_reduction_vs_dense"] = {k: d["peak_bytes"] / max(1, v["peak_bytes"])
                                            for k, v in row["methods"].items()}
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "methods"}), flush=True)
    return out


def markdown(p, args):
    s, cfg = p["size"], p["config"]
    mb = lambda b: f"{b / 2**20:.1f}"
    md = ["# The paper's six-encoder transformer: dense against comera (CPU, float32)\n",
          f"Preset `{p['preset']}`: {cfg['layers']} layers, hidden {cfg['hidden']}, FFN {cfg['ffn']}, "
          f"{cfg['heads']} heads, vocab {cfg['vocab']}, sequence {cfg['seq']}, {cfg['classes']}-way head. "
          f"comera: every encoder linear and the word embedding in TT format, rank {args.rank}.\n",
          machine_line(p["machine"]) + "\n",
          "## Size\n",
          "| model | parameters | MB (fp32) | TT-layer compression | whole-model compression |",
          "|---|---|---|---|---|",
          f"| dense | {s['dense_params']:,} | {s['dense_mb']:.1f} | - | 1.0x |",
          f"| comera rank {args.rank} | {s['comera_params']:,} | {s['comera_mb']:.1f} | "
          f"{s['tt_layer_compression']:.1f}x | {s['model_compression']:.1f}x |"]
    if p["rank_adaptive"]:
        md += ["\n## Rank-adaptive compression\n",
               f"Stage 1: {args.stage1} steps (gamma {args.gamma:g}, threshold {args.threshold:g}); "
               f"stage 2: {args.stage2} steps per target; batch {args.ra_batch}, AdamW lr {args.lr:g}, "
               "code-docstring data. TT-layer compression = dense parameters of the TT layers over "
               "their live TT parameters; whole-model compression = the dense model's parameters "
               "over the pruned model's (the position embeddings, layer norms and head stay "
               "dense); MB = the whole pruned model.\n",
               "| stage | target | reached | TT-layer compression | whole-model compression | "
               "model params | model MB | loss (last 10) |",
               "|---|---|---|---|---|---|---|---|"]
        for r in p["rank_adaptive"]:
            tgt = "-" if r.get("target") is None else f"{r['target']:g}x"
            reached = "-" if "reached_target" not in r else ("yes" if r["reached_target"] else "no")
            params = r.get("params", s["comera_params"])
            loss = f"{r['loss_last10']:.3f}" if "loss_last10" in r else "-"
            md.append(f"| {r['stage']} | {tgt} | {reached} | {r['tt_layer_compression']:.1f}x | "
                      f"{r['model_compression']:.1f}x | {params:,} | {params * 4 / 2**20:.1f} | {loss} |")
    md += ["\n## Training step\n",
           "Wall clock per step: median [interquartile range] of interleaved rounds (every method "
           "of a batch size in one process, round-robin, after one warm-up step each; CPU time in "
           "the JSON); peak = whole-process peak RSS during the "
           "steps minus the RSS before the model was built (weights, grads, AdamW state, activations), "
           "taken after one step of a tiny model of the same method so that modules and code loaded "
           "once per process are not counted.\n",
           "| batch | method | step ms [IQR] | peak MB | speed-up vs dense | memory reduction vs dense |",
           "|---|---|---|---|---|---|"]
    for r in p["steps"]:
        for k, v in r["methods"].items():
            md.append(f"| {r['batch']} | {k} | {v['step_s'] * 1e3:.1f} [{v['wall']['iqr'] * 1e3:.1f}] | "
                      f"{mb(v['peak_bytes'])} | "
                      f"{r['speedup_vs_dense'][k]:.2f}x | {r['memory_reduction_vs_dense'][k]:.2f}x |")
    md.append(f"\nReproduce: `python benchmarks/bench_transformer.py {p['flags']}`.\n")
    return "\n".join(md) + "\n"


def plots(p, out_dir, name):
    from plots import line_plot
    batches = [r["batch"] for r in p["steps"]]
    methods = list(p["steps"][0]["methods"])
    out = []
    for key, label, suffix, scale in (("step_s", "training step s", "_step_time.png", 1.0),
                                      ("peak_bytes", "peak memory MB", "_step_memory.png", 1 / 2**20)):
        path = os.path.join(out_dir, name + suffix)
        line_plot(path, {m: (batches, [r["methods"][m][key] * scale for r in p["steps"]]) for m in methods},
                  "batch size", label, f"six-encoder transformer ({p['preset']}), {label}",
                  logx=True, logy=True)
        out.append(os.path.basename(path))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of this process and of every case subprocess (asserted there)")
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--stage1", type=int, default=None)
    ap.add_argument("--stage2", type=int, default=None)
    ap.add_argument("--gamma", type=float, default=0.5,
                    help="stage-1 L1 strength (a gate entry loses lr * gamma per step); the presets' value")
    ap.add_argument("--threshold", type=float, default=1e-2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ra-batch", type=int, default=None)
    ap.add_argument("--targets", type=float, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--step-reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    assert_threads(args.threads)
    heap_cache = keep_freed_memory()
    if args.case:
        case = json.loads(args.case)
        print(json.dumps(time_methods(case) if case["kind"] == "step_time" else run_step_case(case)))
        return None
    q = args.quick
    defaults = {"stage1": 4 if q else 100, "stage2": 4 if q else 100, "ra_batch": 4 if q else 8,
                "targets": [80.0] if q else TARGETS, "batches": [1, 2] if q else BATCHES,
                "budget": 2.0 if q else 30.0, "max_files": 200 if q else 4000,
                "max_train": 200 if q else 24000}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.in_process = args.in_process or q
    preset = "tiny" if q else "paper"
    cfg = PRESETS[preset]
    p = {"machine": machine_record(measure=not q), "glibc_keep_freed_memory": heap_cache,
         "preset": preset, "config": cfg.as_dict(), "rank": args.rank, "clock": "wall",
         "interleaved": True,
         "size": size_report(cfg, args.rank)}
    print(p["size"]["summary"].splitlines()[-1], flush=True)
    with tempfile.TemporaryDirectory() as state_dir:
        p["rank_adaptive"], pruned = rank_adaptive(cfg, args, state_dir)
        p["steps"] = step_cases(args, preset, pruned)
    finish_record(p["machine"])
    p["flags"] = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                          for k, v in sorted(vars(args).items())
                          if k not in ("quick", "out", "cache_dir", "case", "in_process") and v is not None)
    p["flags"] = ("--quick " if q else "") + p["flags"]
    name = "transformer_cpu" + ("_quick" if q else "")
    out_dir = args.out or RESULTS
    p["plots"] = plots(p, out_dir, name)
    write_results(name, p, markdown(p, args), out_dir=out_dir)
    return p


if __name__ == "__main__":
    main()
