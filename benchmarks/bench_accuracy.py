"""Accuracy against compression on real data: code-docstring matching
(code_docstring.py) with the encoder classifier (encoder.py), dense against
comera at several target compressions, for the same training budget.

Model: by default (`--arch dual`) a siamese bi-encoder, as the CodeSearchNet
baselines for code search: the shared encoder embeds docstring and body apart,
a small dense head classifies the pair, trained with cross-entropy plus an
in-batch contrastive loss.  `--arch cross` is one encoder over [CLS] doc [SEP]
body; at this preset's budget it stayed at chance (50-51%), which is why the
dual encoder is the default.

Protocol (benchmarks/README.md, "How we tune"):
  * data: train / validation / test split by file (code_docstring.load with
    valid=True); the vocabulary comes from the training split;
  * every configuration (dense; comera at each target) picks its peak
    learning rate from the same grid (--lr-grid) with the same budget
    (stage1 + stage2 steps, same schedule, batches and optimizer), by
    validation accuracy, with the tuning seed (--tune-seed, not one of the
    reported seeds);
  * the test split is scored only after that choice, once per seed, for
    --seeds seeds, each trained afresh at the chosen rate (a seed sets the
    initialisation and the batch order); tables give mean +- standard
    deviation;
  * the best comera configuration at >= 40x is the one with the highest mean
    validation accuracy; its test accuracy is then read, never compared;
  * dense: AdamW for stage1 + stage2 steps.  comera: every encoder linear a
    TTLinear of rank --rank; stage 1 (L1 on the gates, rank discovery) for
    --stage1 steps, run once per (learning rate, seed); then, from a copy of
    that model and optimizer per target, stage 2 for --stage2 steps with
    RankAdaptive(target_compression=T), dead ranks pruned every 50 steps.
Encoder compression is that of the encoder's linears (dense parameters over
live TT parameters); whole-model compression (embeddings and the classifier
head stay dense) is reported next to it.

    python benchmarks/bench_accuracy.py            # small CPU preset, hours on 2 cores
    python benchmarks/bench_accuracy.py --quick    # tiny preset, seconds (smoke test)

Writes benchmarks/results/accuracy_cpu.{json,md,png} with the machine record.
"""
import argparse
import copy
import json
import os
import time

import torch
import torch.nn.functional as F

import comera
import code_docstring
from common import RESULTS, edge_note, on_grid_edge, write_results
from encoder import PRESETS, EncoderConfig, build_model
from timing import assert_threads, finish_record, machine_line, machine_record

TARGETS = [20.0, 40.0, 80.0]


def lr_at(step, total, peak, warmup_frac=0.05, floor=0.1):
    """Linear warm-up, then linear decay to floor * peak."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (floor + (1 - floor) * max(0.0, (total - step) / max(1, total - warm)))


def batch_at(data, step, batch, seed=0):
    """The step-th batch of a seeded epoch-wise shuffle (identical for every run)."""
    n = data["labels"].shape[0]
    per_epoch = max(1, n // batch)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    idx = perm[k * batch:(k + 1) * batch]
    return {key: t[idx] for key, t in data.items()}


def forward(model, b):
    if "doc" in b:  # dual encoder: the two sides apart
        return model(b["doc"], b["body"])
    return model(b["ids"], b["segments"], b["padding"])


def task_loss(model, b, contrastive):
    """Cross-entropy on the pair labels; for the dual encoder plus
    `contrastive` times the symmetric in-batch InfoNCE loss over the matched
    pairs of the batch (every other body of the batch is a negative)."""
    if "doc" not in b:
        return F.cross_entropy(forward(model, b), b["labels"])
    u, v = model.embed(b["doc"]), model.embed(b["body"])
    loss = F.cross_entropy(model.classify(u, v), b["labels"])
    pos = b["labels"] == 1
    if contrastive > 0 and int(pos.sum()) > 1:
        scores = model.logit_scale * F.normalize(u[pos], dim=-1) @ F.normalize(v[pos], dim=-1).T
        target = torch.arange(scores.shape[0])
        loss = loss + contrastive * 0.5 * (F.cross_entropy(scores, target) +
                                           F.cross_entropy(scores.T, target))
    return loss


def with_sides(data, doc_tokens):
    """The data with the doc / body sides split out (dual encoder)."""
    doc, body = code_docstring.split_pair(data["ids"], data["segments"], data["padding"], doc_tokens)
    return {"doc": doc, "body": body, "labels": data["labels"]}


@torch.no_grad()
def accuracy(model, data, batch=256):
    model.eval()
    correct = 0
    n = data["labels"].shape[0]
    for i in range(0, n, batch):
        b = {k: t[i:i + batch] for k, t in data.items()}
        correct += (forward(model, b).argmax(-1) == b["labels"]).sum().item()
    model.train()
    return correct / n


def train(model, opt, data, steps, args, peak_lr, seed, start=0, ra=None):
    """Steps [start, start + steps) of the shared schedule peaking at
    `peak_lr`, batches in the order of `seed`; returns (mean loss of the last
    50 steps, seconds)."""
    total = args.stage1 + args.stage2
    losses, t0 = [], time.perf_counter()
    for step in range(start, start + steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, peak_lr)
        b = batch_at(data, step, args.batch, seed=seed)
        loss = task_loss(model, b, args.contrastive)
        full = loss + ra.penalty() if ra is not None else loss
        opt.zero_grad(set_to_none=True)
        full.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if ra is not None:
            ra.step(opt)
        losses.append(loss.item())
    return sum(losses[-50:]) / max(1, len(losses[-50:])), time.perf_counter() - t0


def make_opt(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def encoder_compression(model):
    return comera.compression(model)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def train_dense(cfg, data, args, lr, seed):
    """[(config name, model, record)] of one dense run."""
    model = build_model(cfg, "dense", seed=seed, arch=args.arch)
    loss, secs = train(model, make_opt(model, lr), data["train"], args.stage1 + args.stage2, args,
                       lr, seed)
    return [("dense", model, {"compression": 1.0, "train_loss": loss, "seconds": secs})]


def train_comera(cfg, data, args, lr, seed, targets):
    """Stage 1 once, then stage 2 from a copy per target: [(config name,
    model, record)], one per target."""
    model = build_model(cfg, "comera", rank=args.rank, seed=seed, embedding=False, arch=args.arch)
    start = encoder_compression(model)
    opt = make_opt(model, lr)
    ra = comera.RankAdaptive(model, gamma=args.gamma, threshold=args.threshold,
                             stage1_steps=args.stage1, stage2_steps=0, prune_every=50)
    _, secs1 = train(model, opt, data["train"], args.stage1, args, lr, seed, ra=ra)
    comera.prune(model, opt)
    stage1 = {"start_compression": start, "stage1_compression": encoder_compression(model)}
    out = []
    for target in targets:
        m2, o2 = copy.deepcopy((model, opt))
        ra2 = comera.RankAdaptive(m2, gamma=args.gamma, threshold=args.threshold, stage1_steps=0,
                                  stage2_steps=args.stage2, target_compression=target, prune_every=50)
        loss, secs = train(m2, o2, data["train"], args.stage2, args, lr, seed, start=args.stage1,
                           ra=ra2)
        comera.prune(m2, o2)
        out.append((config_name(target), m2, dict(stage1, compression=encoder_compression(m2),
                                                  reached_target=bool(ra2.frozen), train_loss=loss,
                                                  seconds=secs1 + secs, summary=comera.summary(m2))))
        del o2, ra2
    return out


def config_name(target):
    return "dense" if target is None else f"comera (target {target:g}x)"


def select_lr(cfg, data, args):
    """Trains every configuration at every rate of the grid with the tuning
    seed and scores the validation split only.  Returns ({config: chosen lr},
    grid records, {config: (model, record)} of the chosen runs)."""
    seed, grid, kept = args.tune_seed, [], {}
    for lr in args.lr_grid:
        try:
            comera_runs = train_comera(cfg, data, args, lr, seed, args.targets)
        except ValueError as e:  # a rate too large: RankAdaptive refuses NaN gates
            comera_runs = []
            for t in args.targets:
                grid.append({"config": config_name(t), "lr": lr, "seed": seed,
                             "valid_accuracy": None, "diverged": str(e)})
                print(json.dumps(grid[-1]), flush=True)
        for name, model, rec in train_dense(cfg, data, args, lr, seed) + comera_runs:
            rec = dict(rec, config=name, lr=lr, seed=seed, valid_accuracy=accuracy(model, data["valid"]))
            grid.append({k: v for k, v in rec.items() if k != "summary"})
            print(json.dumps(grid[-1]), flush=True)
            best = kept.get(name)
            if best is None or rec["valid_accuracy"] > best[1]["valid_accuracy"]:
                kept[name] = (model, rec)
    return {name: rec["lr"] for name, (_, rec) in kept.items()}, grid, kept


def run(args):
    base = PRESETS[args.preset]
    cfg = EncoderConfig(**dict(base.as_dict(), vocab=args.vocab or base.vocab))
    t0 = time.perf_counter()
    data = code_docstring.load(cfg.vocab, cfg.seq, max_files=args.max_files,
                               max_train=args.max_train, max_test=args.max_test,
                               doc_tokens=min(32, cfg.seq // 3), cache_dir=args.cache_dir, valid=True)
    stats = data["stats"]
    sets = {k: data[k] for k in ("train", "valid", "test")}
    if args.arch == "dual":
        sets = {k: with_sides(v, stats["doc_tokens"]) for k, v in sets.items()}
    stats["build_or_load_s"] = time.perf_counter() - t0
    print(json.dumps(stats), flush=True)
    chosen, grid, kept = select_lr(cfg, sets, args)
    runs = []

    def record(name, model, rec, seed):
        runs.append({k: v for k, v in rec.items() if k not in ("config", "lr", "seed")})
        runs[-1].update(config=name, lr=chosen[name], seed=seed, params=n_params(model),
                        valid_accuracy=rec["valid_accuracy"] if "valid_accuracy" in rec
                        else accuracy(model, sets["valid"]),
                        test_accuracy=accuracy(model, sets["test"]))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "summary"}), flush=True)

    del kept  # the tuning runs score no test data
    for seed in args.seeds:
        for name, model, rec in train_dense(cfg, sets, args, chosen["dense"], seed):
            record(name, model, rec, seed)
        by_lr = {}
        for t in args.targets:
            by_lr.setdefault(chosen[config_name(t)], []).append(t)
        for lr, targets in by_lr.items():
            for name, model, rec in train_comera(cfg, sets, args, lr, seed, targets):
                record(name, model, rec, seed)
    dense_params = next(r["params"] for r in runs if r["config"] == "dense")
    for r in runs:
        r["model_compression"] = dense_params / r["params"]
    return cfg, stats, runs, grid, chosen


def aggregate(runs, names):
    """Per configuration: mean and standard deviation (over seeds) of the
    test and validation accuracy and of both compressions."""
    out = {}
    for name in names:
        rs = [r for r in runs if r["config"] == name]
        agg = {"seeds": [r["seed"] for r in rs], "lr": rs[0]["lr"]}
        for key in ("test_accuracy", "valid_accuracy", "compression", "model_compression",
                    "train_loss", "seconds"):
            vals = torch.tensor([float(r[key]) for r in rs], dtype=torch.float64)
            agg[key] = {"mean": float(vals.mean()),
                        "std": float(vals.std()) if len(rs) > 1 else 0.0}
        agg["reached_target"] = all(r.get("reached_target", True) for r in rs)
        out[name] = agg
    return out


def best_at(agg, min_compression=40.0):
    """The comera configuration at >= ``min_compression`` encoder compression
    with the highest mean validation accuracy (the test split plays no part in
    the choice), or None.

    Example:
        >>> a = {"dense": {}, "x": {"compression": {"mean": 45.0}, "valid_accuracy": {"mean": 0.7},
        ...                         "test_accuracy": {"mean": 0.9}},
        ...      "y": {"compression": {"mean": 50.0}, "valid_accuracy": {"mean": 0.8},
        ...            "test_accuracy": {"mean": 0.6}}}
        >>> best_at(a)
        'y'
    """
    cands = [n for n, a in agg.items() if n != "dense" and a["compression"]["mean"] >= min_compression]
    return max(cands, key=lambda n: agg[n]["valid_accuracy"]["mean"]) if cands else None


def _pm(v, scale=100.0, fmt=".2f"):
    return f"{v['mean'] * scale:{fmt}} +- {v['std'] * scale:{fmt}}"


def markdown(payload, args):
    cfg, st, agg = payload["config"], payload["data"], payload["aggregate"]
    dense = agg["dense"]["test_accuracy"]["mean"]
    md = ["# Accuracy against compression: code-docstring matching (CPU)\n",
          f"Data: {st['train_pairs']} training, {st['valid_pairs']} validation and {st['test_pairs']} "
          f"test pairs (half matched, half mismatched; split by file, no file in two splits) from "
          f"the sources of the standard library and the installed packages ({st['max_files']} files "
          f"sampled); vocabulary {st['vocab']} (training split), test [UNK] rate "
          f"{st['unk_rate_test'] * 100:.1f}%.\n",
          (f"Model: a siamese bi-encoder (`--arch dual`, as the CodeSearchNet baselines): one shared "
           "encoder embeds the docstring and the body apart (mean over tokens), a dense head "
           "classifies [u, v, |u-v|, u*v]; loss = cross-entropy on the labels + "
           f"{args.contrastive:g} x in-batch contrastive loss over the matched pairs. "
           if args.arch == "dual" else
           "Model: a cross-encoder (`--arch cross`) over [CLS] doc [SEP] body, classified on [CLS]. ") +
          f"Preset `{payload['preset']}`: {cfg['layers']} encoder layers, hidden {cfg['hidden']}, FFN "
          f"{cfg['ffn']}, {cfg['heads']} heads, sequence {cfg['seq']}, dropout {cfg['dropout']}. "
          f"Training: batch {args.batch}, AdamW (5% warm-up, linear decay), "
          f"{args.stage1 + args.stage2} steps for every run; comera: rank {args.rank} start, stage 1 "
          f"{args.stage1} steps (gamma {args.gamma:g}, threshold {args.threshold:g}), stage 2 "
          f"{args.stage2} steps per target.\n",
          f"Tuning: every configuration picks its peak learning rate from the same grid "
          f"({', '.join(f'{x:g}' for x in args.lr_grid)}) by validation accuracy with the tuning "
          f"seed {args.tune_seed}; the test split is scored after that choice only, on seeds "
          f"{', '.join(map(str, args.seeds))} trained afresh: mean +- standard deviation. Encoder compression = the "
          "encoder linears' dense parameters over their live TT parameters; whole model = all "
          "parameters (the embeddings and the head stay dense).\n",
          "| configuration | chosen lr | encoder compression | whole-model compression | "
          "validation accuracy % | test accuracy % | vs dense (points) | reached target |",
          "|---|---|---|---|---|---|---|---|"]
    for name, a in agg.items():
        reached = "-" if name == "dense" else ("yes" if a["reached_target"] else "no")
        md.append(f"| {name} | {a['lr']:g} | {_pm(a['compression'], 1, '.1f')}x | "
                  f"{_pm(a['model_compression'], 1, '.2f')}x | {_pm(a['valid_accuracy'])} | "
                  f"{_pm(a['test_accuracy'])} | {(a['test_accuracy']['mean'] - dense) * 100:+.2f} | "
                  f"{reached} |")
    md += ["\nValidation accuracy (%) of every grid run (tuning seed "
           f"{args.tune_seed}):\n", "| configuration | " +
           " | ".join(f"lr {x:g}" for x in args.lr_grid) + " |",
           "|---|" + "---|" * len(args.lr_grid)]
    for name in agg:
        cells = [next("diverged" if g["valid_accuracy"] is None else f"{g['valid_accuracy'] * 100:.2f}"
                      for g in payload["grid"] if g["config"] == name and g["lr"] == lr)
                 for lr in args.lr_grid]
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    n = best_at(agg)
    if n is not None:
        best = agg[n]
        gap = (dense - best["test_accuracy"]["mean"]) * 100
        md.append(f"\nTarget: within 1 point of dense at >= 40x encoder compression "
                  f"(means over seeds): {'met' if gap <= 1.0 else 'missed'}; the comera "
                  f"configuration at >= 40x with the best validation accuracy is {n}, {best['compression']['mean']:.1f}x at "
                  f"{best['test_accuracy']['mean'] * 100:.2f}%, {abs(gap):.2f} points "
                  f"{'below' if gap > 0 else 'above'} dense.")
    note = edge_note([f"{n} ({payload['chosen_lr'][n]:g})" for n in agg
                      if on_grid_edge(payload["chosen_lr"][n], args.lr_grid)])
    if note:
        md.append("\n" + note)
    md.append("\n" + machine_line(payload["machine"]))
    md.append(f"\nReproduce: `python benchmarks/bench_accuracy.py {payload['flags']}`.\n")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset and data (smoke test)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--arch", choices=["dual", "cross"], default="dual",
                    help="dual: siamese bi-encoder (default); cross: one encoder over [CLS] doc [SEP] body")
    ap.add_argument("--contrastive", type=float, default=0.5,
                    help="weight of the in-batch contrastive loss (dual encoder only)")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr-grid", type=float, nargs="+", default=None,
                    help="peak learning rates every configuration (dense included) chooses from")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="the reported seeds (init and batch order)")
    ap.add_argument("--tune-seed", type=int, default=100,
                    help="the seed of the learning-rate choice (not among --seeds)")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--stage1", type=int, default=None)
    ap.add_argument("--stage2", type=int, default=None)
    ap.add_argument("--gamma", type=float, default=1e-3)
    ap.add_argument("--threshold", type=float, default=1e-2)
    ap.add_argument("--targets", type=float, nargs="+", default=None)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--max-test", type=int, default=None, help="cap of the test and validation pairs")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = {"preset": "tiny" if q else "small", "rank": 4 if q else 16,
                "stage1": 6 if q else 500, "stage2": 6 if q else 500,
                "targets": [8.0, 12.0] if q else TARGETS, "max_files": 200 if q else 4000,
                "max_train": 200 if q else 24000, "max_test": 100 if q else 4000,
                "lr_grid": [1e-3, 3e-3] if q else [1e-3, 3e-3, 1e-2, 3e-2], "seeds": [0, 1, 2]}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if len(set(args.seeds)) < 1 or len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds must be distinct, got {args.seeds}")
    if args.tune_seed in args.seeds:
        ap.error(f"--tune-seed {args.tune_seed} must not be one of --seeds {args.seeds}")
    if q:
        args.batch = min(args.batch, 8)
    assert_threads(args.threads)
    machine = machine_record(measure=not q)
    cfg, stats, runs, grid, chosen = run(args)
    finish_record(machine)
    flags = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                     for k, v in sorted(vars(args).items())
                     if k not in ("quick", "out", "cache_dir", "vocab") and v is not None)
    names = ["dense"] + [config_name(t) for t in args.targets]
    payload = {"machine": machine, "preset": args.preset, "config": cfg.as_dict(),
               "data": stats, "chosen_lr": chosen, "grid": grid, "runs": runs,
               "aggregate": aggregate(runs, names), "flags": flags}
    name = "accuracy_cpu" + ("_quick" if q else "")
    out_dir = args.out or RESULTS
    payload["plots"] = [plot(payload, out_dir, name, args)]
    write_results(name, payload, markdown(payload, args), out_dir=out_dir)
    return payload


def plot(payload, out_dir, name, args):
    from plots import line_plot
    agg = payload["aggregate"]
    comera_names = [n for n in agg if n != "dense"]
    png = os.path.join(out_dir, name + ".png")
    xs = [agg[n]["compression"]["mean"] for n in comera_names]
    dense = agg["dense"]["test_accuracy"]["mean"] * 100
    line_plot(png, {"comera (mean over seeds)": (xs, [agg[n]["test_accuracy"]["mean"] * 100
                                                      for n in comera_names]),
                    "dense (mean over seeds)": ([1.0, max(xs)], [dense, dense])},
              "encoder compression (x, log)", "test accuracy %",
              f"code-docstring matching, preset {args.preset}", logx=True,
              annotate={"comera (mean over seeds)": [
                  f"+-{agg[n]['test_accuracy']['std'] * 100:.1f}" for n in comera_names]})
    return os.path.basename(png)


if __name__ == "__main__":
    main()
