"""Do adaptive ranks beat fixed ones?  MLM pre-training on the standard
library at equal final TT parameter count:

* ``adaptive``: CoMERA rank-adaptive training: start at the preset's ranks,
  stage 1 (decoupled L1 on the gates), stage 2 to the target compression
  (``--rule``, default saliency), pruning;
* ``adaptive-magnitude``: the same with the magnitude stage-2 rule (at the
  learning rate chosen for ``adaptive``; off with ``--no-magnitude``);
* ``fixed``: uniform TT ranks (linear rank r, vocabulary layers 2r, the
  presets' ratio) whose converted-layer size is the closest to dense / target,
  trained from step 0 without rank adaptation;
* ``dense``: the uncompressed model.

Same data, steps, schedule and tuning budget for every method: each learning
rate of ``--lrs`` (one grid for all) is tried with the first seed, the one
with the lowest validation loss is kept, and the other seeds run at it.
Reported: mean +- std of the final validation MLM loss over the seeds.

    python benchmarks/bench_adaptive.py                     # the full protocol (days on a 2-core CPU)
    python benchmarks/bench_adaptive.py --presets tiny      # the run recorded here (19 min)

Writes benchmarks/results/adaptive_<device>.{json,md,png} (``--tag`` adds a
suffix) with the command and the machine record.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from common import edge_note, on_grid_edge  # noqa: E402
from timing import finish_record, machine_line, machine_record  # noqa: E402

import comera  # noqa: E402
from comera.pretrain import corpus as corpus_mod  # noqa: E402
from comera.pretrain import tokenizer as tok_mod  # noqa: E402
from comera.pretrain.data import MLMData  # noqa: E402
from comera.pretrain.model import build_comera, build_dense, count_parameters, preset  # noqa: E402
from comera.pretrain.loop import evaluate, make_optimizer, make_schedule, mlm_loss_sum  # noqa: E402


def load_data(p, seed: int, cache: str, log=print) -> MLMData:
    corpus = corpus_mod.load_corpus(None, valid_fraction=0.05, seed=seed)
    os.makedirs(cache, exist_ok=True)
    max_mb = p.tokenizer_max_mb
    tok, train_ids, valid_ids, _ = tok_mod.load_or_build(
        cache, corpus, vocab_size=p.vocab_size, max_train_tokens=p.max_train_tokens,
        max_valid_tokens=p.valid_blocks * p.seq_len * 2,
        tokenizer_max_bytes=None if max_mb is None else int(max_mb * 1e6), log=log)
    return MLMData(train_ids, valid_ids, seq_len=p.seq_len, batch_size=p.batch_size,
                   vocab_size=tok.get_vocab_size(), valid_blocks=p.valid_blocks, seed=seed)


def fixed_rank_for(p, vocab: int, target_size: float) -> int:
    """The uniform rank r (vocabulary layers 2r) whose converted-layer TT size
    is the closest to ``target_size`` (in log ratio)."""
    best = None
    for r in range(1, p.rank + 1):
        q = preset_copy(p, rank=r, vocab_rank=2 * r)
        size = count_parameters(build_comera(q, vocab, 0))["converted_tt"]
        miss = abs(math.log(size / target_size))
        if best is None or miss < best[0]:
            best = (miss, r)
        if size > target_size:
            break
    return best[1]


def preset_copy(p, **changes):
    import copy
    q = copy.deepcopy(p)
    for k, v in changes.items():
        setattr(q, k, v)
    return q


def train_one(method: str, p, data: MLMData, *, lr: float, seed: int, target=None, rule="saliency",
              fixed_rank=None) -> dict:
    """One training run; returns its final validation loss and sizes."""
    vocab = data.vocab_size
    if method == "dense":
        model = build_dense(p, vocab, seed)
    elif method == "fixed":
        model = build_comera(preset_copy(p, rank=fixed_rank, vocab_rank=2 * fixed_rank), vocab, seed)
    else:
        model = build_comera(p, vocab, seed)
    model.train()
    q = preset_copy(p, lr=lr)
    opt = make_optimizer(model, q, lr)
    sched = make_schedule(opt, q)
    ra = None
    if method.startswith("adaptive"):
        ra = comera.RankAdaptive(model, gamma=p.gamma, threshold=p.threshold,
                                 stage1_steps=int(p.stage1 * p.steps),
                                 stage2_steps=int(p.stage2 * p.steps), target_compression=target,
                                 prune_every=p.prune_every, stage2_rule=rule).attach(opt)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    start = count_parameters(model)["converted_tt"]
    losses = []
    for step in range(p.steps):
        inputs, labels = data.batch(step)
        loss_sum, count = mlm_loss_sum(model, inputs, labels)
        loss = loss_sum / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), p.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    if ra is not None:
        ra.detach()
        comera.prune(model, opt)
    counts = count_parameters(model)
    valid = evaluate(model, data, torch.device("cpu"), p.batch_size)
    return {"method": method, "lr": lr, "seed": seed, "target": target, "rule": rule,
            "fixed_rank": fixed_rank, "valid_loss": valid, "train_loss_last": losses[-1],
            "converted_tt_start": start, "converted_tt": counts["converted_tt"],
            "converted_dense": counts["converted_dense"],
            "compression_converted": (counts["converted_dense"] / counts["converted_tt"]
                                      if counts["converted_tt"] else 1.0),
            "wall_s": time.perf_counter() - t0,
            "final_ranks": comera.storage.tt_live_ranks(model) if method != "dense" else None}


def tuned(runs_for, lrs, seeds, log):
    """Tries every lr with the first seed, keeps the best, runs the other
    seeds at it.  ``runs_for(lr, seed)`` trains one run."""
    trials = []
    for lr in lrs:
        r = runs_for(lr, seeds[0])
        log(f"  lr {lr:g} seed {seeds[0]}: valid {r['valid_loss']:.4f} ({r['wall_s']:.0f} s)")
        trials.append(r)
    best = min(trials, key=lambda r: r["valid_loss"] if math.isfinite(r["valid_loss"]) else math.inf)
    runs = [best]
    for seed in seeds[1:]:
        r = runs_for(best["lr"], seed)
        log(f"  lr {best['lr']:g} seed {seed}: valid {r['valid_loss']:.4f} ({r['wall_s']:.0f} s)")
        runs.append(r)
    return {"lr": best["lr"], "trials": trials, "runs": runs, **summary(runs)}


def summary(runs):
    v = [r["valid_loss"] for r in runs]
    return {"valid_mean": statistics.mean(v), "valid_std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "converted_tt_mean": statistics.mean(r["converted_tt"] for r in runs),
            "compression_mean": statistics.mean(r["compression_converted"] for r in runs)}


def _edge_choices(res: dict) -> list:
    """'preset target method (lr)' for every choice at the smallest or largest
    rate its grid tried: the grid did not bracket that method's best rate."""
    out = []
    for pname, pres in res["presets"].items():
        entries = [("-", "dense", pres["dense"])]
        entries += [(f"{tkey}x", m, t[m]) for tkey, t in pres["targets"].items()
                    for m in ("adaptive", "fixed") if m in t]
        for tkey, m, e in entries:
            if on_grid_edge(e["lr"], [r["lr"] for r in e.get("trials", [])]):
                out.append(f"{pname} {tkey} {m} ({e['lr']:g})")
    return out


def markdown(res: dict) -> str:
    lines = ["# Adaptive against fixed TT ranks at equal parameter count (MLM, CPU)", "",
             "Written by `benchmarks/bench_adaptive.py`.  Validation MLM loss (mean +- std over the "
             "seeds, lower is better) at the end of training; each method's learning rate was chosen "
             "on the validation split from the same grid with the first seed.  Sizes are the "
             "converted (TT) layers' parameters.", "",
             f"Command: `{res['command']}`", "", machine_line(res["machine"]), "",
             f"Settings: {res['settings']}", ""]
    if res.get("reduced"):
        lines += [f"This is a reduced run of the protocol ({res['reduced']}); the full protocol is "
                  "`python benchmarks/bench_adaptive.py` (presets tiny and small at their own step "
                  "counts, targets 15x, 25x and 40x, 3 seeds, lr grid 3e-4 to 1e-1).", ""]
    lines += ["| preset | target | method | lr | valid loss | TT params | compression | "
              "ranks (first seed, first 3 layers) |", "|---|---|---|---|---|---|---|---|"]
    for pname, pres in res["presets"].items():
        d = pres["dense"]
        lines.append(f"| {pname} | - | dense | {d['lr']:g} | {d['valid_mean']:.4f} +- {d['valid_std']:.4f} "
                     f"| - | 1x | - |")
        for tkey, t in pres["targets"].items():
            for m in ("adaptive", "adaptive-magnitude", "fixed"):
                if m not in t:
                    continue
                e = t[m]
                ranks = e["runs"][0]["final_ranks"] or {}
                shown = "; ".join(f"{k.split('.')[-1] if len(k) > 20 else k}: {v}"
                                  for k, v in list(ranks.items())[1:4])
                lines.append(f"| {pname} | {tkey}x | {m} | {e['lr']:g} | {e['valid_mean']:.4f} +- "
                             f"{e['valid_std']:.4f} | {e['converted_tt_mean']:,.0f} | "
                             f"{e['compression_mean']:.1f}x | {shown} |")
    note = edge_note(_edge_choices(res))
    if note:
        lines += ["", note]
    lines += ["", "Verdict (mean of the seeds; the target: adaptive <= fixed at every target):", ""]
    for pname, pres in res["presets"].items():
        for tkey, t in pres["targets"].items():
            a, f = t["adaptive"]["valid_mean"], t["fixed"]["valid_mean"]
            won = "adaptive wins" if a <= f else "fixed wins"
            extra = ""
            if "adaptive-magnitude" in t:
                extra = (f"; magnitude rule {t['adaptive-magnitude']['valid_mean']:.4f}")
            lines.append(f"- {pname}, {tkey}x: adaptive {a:.4f} vs fixed {f:.4f} "
                         f"({(a / f - 1) * 100:+.2f}%): {won}{extra}; dense "
                         f"{pres['dense']['valid_mean']:.4f}")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    presets = list(res["presets"])
    fig = Figure(figsize=(5.5 * len(presets), 4))
    FigureCanvasAgg(fig)
    for i, pname in enumerate(presets):
        ax = fig.add_subplot(1, len(presets), i + 1)
        pres = res["presets"][pname]
        targets = sorted(pres["targets"], key=float)
        xs = [float(t) for t in targets]
        for m, style in (("adaptive", "o-"), ("adaptive-magnitude", "s--"), ("fixed", "^-")):
            if all(m in pres["targets"][t] for t in targets):
                ax.errorbar(xs, [pres["targets"][t][m]["valid_mean"] for t in targets],
                            yerr=[pres["targets"][t][m]["valid_std"] for t in targets], fmt=style,
                            capsize=3, label=m)
        ax.axhline(pres["dense"]["valid_mean"], color="k", lw=1, ls=":", label="dense")
        ax.set_xlabel("target compression of the converted layers")
        ax.set_ylabel("validation MLM loss (mean +- std)")
        ax.set_title(f"{pname}: {res['settings_short']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


FULL = {"presets": ["tiny", "small"], "targets": [15.0, 25.0, 40.0], "seeds": [0, 1, 2],
        "lrs": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1], "steps": None}


def reduced(res: dict) -> str:
    """What a run left out of the full protocol ('' when nothing)."""
    args = res.get("args")
    if args is None:       # recorded before the arguments were kept: read the command
        cmd = res["command"].split()
        args, key = {}, None
        for tok in cmd[2:]:
            if tok.startswith("--"):
                key = tok[2:]
                args[key] = []
            elif key:
                args[key].append(tok)
        args = {k: (v if k in ("presets",) else [float(x) for x in v]) for k, v in args.items()}
        if "steps" in args:
            args["steps"] = int(args["steps"][0])
    out = []
    for k, full in FULL.items():
        mine = args.get(k, full)
        if mine is not None and mine != full:
            want = full if full is not None else "each preset's"
            out.append(f"{k} {mine} instead of {want}")
    return "; ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--targets", nargs="+", type=float, default=[15.0, 25.0, 40.0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--lrs", nargs="+", type=float, default=[3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    ap.add_argument("--steps", type=int, default=None, help="default: each preset's")
    ap.add_argument("--rule", default="saliency", choices=["saliency", "magnitude"])
    ap.add_argument("--no-magnitude", action="store_true", help="skip the magnitude-rule runs")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--cache", default=os.path.join("runs", "bench-adaptive-cache"),
                    help="tokenizer cache folder (relative to the repository)")
    ap.add_argument("--redraw", default=None, metavar="JSON",
                    help="only rewrite the Markdown and the plot from a result JSON")
    args = ap.parse_args(argv)
    if args.redraw:
        with open(args.redraw) as fh:
            res = json.load(fh)
        res["reduced"] = reduced(res)
        base = args.redraw[:-len(".json")]
        with open(args.redraw, "w") as fh:
            json.dump(res, fh, indent=1)
        with open(base + ".md", "w") as fh:
            fh.write(markdown(res))
        plot(res, base + ".png")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = machine_record(measure=False)
    t_start = time.time()
    log = lambda m: print(m, flush=True)  # noqa: E731
    res = {"command": "python benchmarks/bench_adaptive.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "presets": {}}
    for pname in args.presets:
        p = preset(pname)
        if args.steps:
            p.steps = args.steps
        p.eval_every = p.steps
        data = load_data(p, args.seeds[0], os.path.join(REPO, args.cache, pname), log)
        vocab = data.vocab_size
        log(f"{pname}: {p.steps} steps, batch {p.batch_size} x {p.seq_len}")
        pres = {"steps": p.steps, "targets": {}}
        log("dense")
        pres["dense"] = tuned(lambda lr, s: train_one("dense", p, data, lr=lr, seed=s), args.lrs,
                              args.seeds, log)
        dense_conv = count_parameters(build_comera(p, vocab, 0))["converted_dense"]
        for target in args.targets:
            t = {}
            log(f"{pname} target {target:g}x: adaptive ({args.rule})")
            t["adaptive"] = tuned(lambda lr, s: train_one("adaptive", p, data, lr=lr, seed=s,
                                                          target=target, rule=args.rule),
                                  args.lrs, args.seeds, log)
            if not args.no_magnitude:
                other = "magnitude" if args.rule == "saliency" else "saliency"
                log(f"{pname} target {target:g}x: adaptive ({other}) at lr {t['adaptive']['lr']:g}")
                runs = [train_one("adaptive", p, data, lr=t["adaptive"]["lr"], seed=s, target=target,
                                  rule=other) for s in args.seeds]
                t["adaptive-magnitude"] = {"lr": t["adaptive"]["lr"], "runs": runs, **summary(runs)}
            r = fixed_rank_for(p, vocab, t["adaptive"]["converted_tt_mean"])
            log(f"{pname} target {target:g}x: fixed rank {r} (vocabulary {2 * r})")
            t["fixed"] = tuned(lambda lr, s: train_one("fixed", p, data, lr=lr, seed=s, fixed_rank=r),
                               args.lrs, args.seeds, log)
            t["dense_converted"] = dense_conv
            pres["targets"][f"{target:g}"] = t
        res["presets"][pname] = pres
    res["machine"] = finish_record(rec)
    res["wall_s"] = time.time() - t_start
    res["settings"] = (f"presets {args.presets}, targets {args.targets}, seeds {args.seeds}, lr grid "
                       f"{args.lrs}, steps {args.steps or 'preset'}, stage-2 rule {args.rule}; "
                       f"{res['wall_s'] / 60:.1f} min")
    res["settings_short"] = f"{len(args.seeds)} seeds, {args.steps or 'preset'} steps"
    res["args"] = vars(args)
    res["reduced"] = reduced(res)
    device = "cpu"
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"adaptive_{device}{args.tag}")
    with open(base + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    md = markdown(res)
    with open(base + ".md", "w") as fh:
        fh.write(md)
    plot(res, base + ".png")
    print(md)


if __name__ == "__main__":
    main()
