"""Do adaptive ranks beat fixed ones?  MLM pre-training on the standard
library at equal final TT parameter count:

* ``adaptive``: CoMERA rank-adaptive training: start at the preset's ranks,
  stage 1 (decoupled L1 on the gates), stage 2 to the target compression
  (``--rule``, default saliency), pruning;
* ``adaptive-magnitude``: the same with the magnitude stage-2 rule, tuned on
  the same grid as every other method (off with ``--no-magnitude``);
* ``fixed``: TT ranks fixed from step 0, sized to the adaptive run's final
  converted-layer parameters of the same seed, within +-2%
  (bench_quality.fixed_ranks_for: uniform ranks, linear r and vocabulary
  layers 2r, then single layers raised to their next rank), trained without
  rank adaptation;
* ``dense``: the uncompressed model.

Same data, steps, schedule and tuning budget for every method.  Files held
out of training are split into a validation and a test split
(bench_quality.split_heldout).  Each learning rate of ``--lrs`` (one grid for
all) is tried with the tuning seed (``--tune-seed``, not one of the reported
seeds), the one with the lowest validation loss is kept; then every reported
seed (``--seeds``; a seed sets the initialisation, the data order and the
masks) trains at it and the test split is scored once.  Reported: mean +- std
of the final test MLM loss over the seeds.

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
from bench_quality import fixed_ranks_for  # noqa: E402
from timing import finish_record, machine_line, machine_record  # noqa: E402

import comera  # noqa: E402
from comera.pretrain import corpus as corpus_mod  # noqa: E402
from comera.pretrain import tokenizer as tok_mod  # noqa: E402
from comera.pretrain.data import MLMData  # noqa: E402
from comera.pretrain.model import build_comera, build_dense, count_parameters, preset  # noqa: E402
from comera.pretrain.loop import evaluate, make_optimizer, make_schedule, mlm_loss_sum  # noqa: E402


def load_data(p, cache: str, log=print, heldout: float = 0.1) -> dict:
    """Token streams of the training files and the validation and test sets
    (fixed masks) of the held-out files; the data seed of a run is applied
    by :func:`seeded`."""
    from types import SimpleNamespace
    from bench_quality import EvalSet, split_heldout
    corpus = corpus_mod.load_corpus(None, valid_fraction=heldout, seed=0)
    held = dict(corpus.valid)
    valid_rels, test_rels = split_heldout(list(held))
    os.makedirs(cache, exist_ok=True)
    max_mb = p.tokenizer_max_mb
    split = SimpleNamespace(train=corpus.train, valid=[(r, held[r]) for r in valid_rels])
    tok, train_ids, valid_ids, _ = tok_mod.load_or_build(
        cache, split, vocab_size=p.vocab_size, max_train_tokens=p.max_train_tokens,
        max_valid_tokens=p.valid_blocks * p.seq_len * 2,
        tokenizer_max_bytes=None if max_mb is None else int(max_mb * 1e6), log=log)
    test_ids = tok_mod.encode_files(tok, [held[r] for r in test_rels], p.valid_blocks * p.seq_len * 2)
    vocab = tok.get_vocab_size()
    return {"train_ids": train_ids, "vocab_size": vocab,
            "valid": EvalSet(valid_ids, p.seq_len, p.valid_blocks, vocab),
            "test": EvalSet(test_ids, p.seq_len, p.valid_blocks, vocab)}


def seeded(p, data: dict, seed: int) -> MLMData:
    """The training batches and masks of ``seed``."""
    ids = data["train_ids"]
    return MLMData(ids, ids[: 2 * p.seq_len], seq_len=p.seq_len, batch_size=p.batch_size,
                   vocab_size=data["vocab_size"], valid_blocks=1, seed=seed)


def preset_copy(p, **changes):
    import copy
    q = copy.deepcopy(p)
    for k, v in changes.items():
        setattr(q, k, v)
    return q


def train_one(method: str, p, data: dict, *, lr: float, seed: int, target=None, rule="saliency",
              fixed_ranks=None, score_test=False) -> dict:
    """One training run (the batches and masks of ``seed``); returns its
    final validation loss (and test loss with ``score_test``) and sizes."""
    from bench_quality import build_fixed
    vocab = data["vocab_size"]
    batches = seeded(p, data, seed)
    if method == "dense":
        model = build_dense(p, vocab, seed)
    elif method == "fixed":
        model = build_fixed(p, vocab, seed, fixed_ranks)
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
        inputs, labels = batches.batch(step)
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
    cpu = torch.device("cpu")
    valid = evaluate(model, data["valid"], cpu, p.batch_size)
    test = evaluate(model, data["test"], cpu, p.batch_size) if score_test else None
    return {"method": method, "lr": lr, "seed": seed, "target": target, "rule": rule,
            "fixed_ranks": fixed_ranks, "valid_loss": valid, "test_loss": test,
            "train_loss_last": losses[-1],
            "converted_tt_start": start, "converted_tt": counts["converted_tt"],
            "converted_dense": counts["converted_dense"],
            "compression_converted": (counts["converted_dense"] / counts["converted_tt"]
                                      if counts["converted_tt"] else 1.0),
            "wall_s": time.perf_counter() - t0,
            "final_ranks": comera.storage.tt_live_ranks(model) if method != "dense" else None}


def tuned(runs_for, lrs, seeds, tune_seed, log):
    """Tries every lr with the tuning seed (validation loss only), keeps the
    best, then trains every reported seed at it and scores the test split.
    ``runs_for(lr, seed, score_test)`` trains one run."""
    trials = []
    for lr in lrs:
        r = runs_for(lr, tune_seed, False)
        log(f"  lr {lr:g} tuning seed {tune_seed}: valid {r['valid_loss']:.4f} ({r['wall_s']:.0f} s)")
        trials.append(r)
    best = min(trials, key=lambda r: r["valid_loss"] if math.isfinite(r["valid_loss"]) else math.inf)
    runs = []
    for seed in seeds:
        r = runs_for(best["lr"], seed, True)
        log(f"  lr {best['lr']:g} seed {seed}: test {r['test_loss']:.4f} ({r['wall_s']:.0f} s)")
        runs.append(r)
    return {"lr": best["lr"], "trials": trials, "best_trial": best, "runs": runs, **summary(runs)}


def summary(runs):
    v = [r["valid_loss"] for r in runs]
    t = [r["test_loss"] for r in runs if r.get("test_loss") is not None]
    return {"valid_mean": statistics.mean(v), "valid_std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "test_mean": statistics.mean(t) if t else None,
            "test_std": (statistics.stdev(t) if len(t) > 1 else 0.0) if t else None,
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


def score(e: dict) -> tuple:
    """(mean, std) of the reported loss: the test loss, or the validation
    loss of results written before the test split existed."""
    if e.get("test_mean") is not None:
        return e["test_mean"], e["test_std"]
    return e["valid_mean"], e["valid_std"]


def markdown(res: dict) -> str:
    test = res.get("protocol", 1) >= 2
    intro = ("Test MLM loss (mean +- std over the seeds, lower is better) at the end of training; each "
             "method's learning rate was chosen from the same grid by validation loss with a tuning "
             "seed that is not one of the reported seeds; each seed sets the initialisation, the data "
             "order and the masks; the fixed ranks are sized to the same seed's adaptive run." if test else
             "Validation MLM loss (mean +- std over the seeds, lower is better) at the end of training; "
             "each method's learning rate was chosen on the validation split from the same grid with "
             "the first seed (an earlier protocol: the selection seed is inside the mean, the seeds "
             "vary the initialisation only).")
    lines = ["# Adaptive against fixed TT ranks at equal parameter count (MLM, CPU)", "",
             f"Written by `benchmarks/bench_adaptive.py`.  {intro}  Sizes are the converted (TT) "
             "layers' parameters.", "",
             f"Command: `{res['command']}`", "", machine_line(res["machine"]), "",
             f"Settings: {res['settings']}", ""]
    if res.get("reduced"):
        lines += [f"This is a reduced run of the protocol ({res['reduced']}); the full protocol is "
                  "`python benchmarks/bench_adaptive.py` (presets tiny and small at their own step "
                  "counts, targets 15x, 25x and 40x, 3 seeds, lr grid 3e-4 to 1e-1).", ""]
    lines += [f"| preset | target | method | lr | {'test' if test else 'valid'} loss | TT params | compression | "
              "ranks (first seed, first 3 layers) |", "|---|---|---|---|---|---|---|---|"]
    for pname, pres in res["presets"].items():
        d = pres["dense"]
        lines.append(f"| {pname} | - | dense | {d['lr']:g} | {score(d)[0]:.4f} +- {score(d)[1]:.4f} "
                     f"| - | 1x | - |")
        for tkey, t in pres["targets"].items():
            for m in ("adaptive", "adaptive-magnitude", "fixed"):
                if m not in t:
                    continue
                e = t[m]
                ranks = e["runs"][0]["final_ranks"] or {}
                shown = "; ".join(f"{k.split('.')[-1] if len(k) > 20 else k}: {v}"
                                  for k, v in list(ranks.items())[1:4])
                lines.append(f"| {pname} | {tkey}x | {m} | {e['lr']:g} | {score(e)[0]:.4f} +- "
                             f"{score(e)[1]:.4f} | {e['converted_tt_mean']:,.0f} | "
                             f"{e['compression_mean']:.1f}x | {shown} |")
    note = edge_note(_edge_choices(res))
    if note:
        lines += ["", note]
    lines += ["", "Verdict (mean of the seeds; adaptive wins when its loss is below fixed's by more "
              "than the larger std of the two; the target: adaptive wins at 2 of 3 targets):", ""]
    wins = total = 0
    for pname, pres in res["presets"].items():
        for tkey, t in pres["targets"].items():
            (a, sa), (f, sf) = score(t["adaptive"]), score(t["fixed"])
            spread = max(sa, sf)
            won = "adaptive wins" if f - a > spread else "fixed wins" if a - f > spread else "within the spread"
            wins, total = wins + (f - a > spread), total + 1
            extra = ""
            if "adaptive-magnitude" in t:
                extra = (f"; magnitude rule {score(t['adaptive-magnitude'])[0]:.4f}")
            lines.append(f"- {pname}, {tkey}x: adaptive {a:.4f} vs fixed {f:.4f} "
                         f"({(a / f - 1) * 100:+.2f}%, spread {spread:.4f}): {won}{extra}; dense "
                         f"{score(pres['dense'])[0]:.4f}")
    lines.append(f"- adaptive wins at {wins} of {total} targets")
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
                ax.errorbar(xs, [score(pres["targets"][t][m])[0] for t in targets],
                            yerr=[score(pres["targets"][t][m])[1] for t in targets], fmt=style,
                            capsize=3, label=m)
        ax.axhline(score(pres["dense"])[0], color="k", lw=1, ls=":", label="dense")
        ax.set_xlabel("target compression of the converted layers")
        ax.set_ylabel(("test" if res.get("protocol", 1) >= 2 else "validation") + " MLM loss (mean +- std)")
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
    ap.add_argument("--tune-seed", type=int, default=100, help="the seed of the lr choice (not reported)")
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
        data = load_data(p, os.path.join(REPO, args.cache, pname), log)
        vocab = data["vocab_size"]
        log(f"{pname}: {p.steps} steps, batch {p.batch_size} x {p.seq_len}")
        pres = {"steps": p.steps, "targets": {}}
        log("dense")
        pres["dense"] = tuned(lambda lr, s, test: train_one("dense", p, data, lr=lr, seed=s, score_test=test),
                              args.lrs, args.seeds, args.tune_seed, log)
        dense_conv = count_parameters(build_comera(p, vocab, 0))["converted_dense"]
        for target in args.targets:
            t = {}
            log(f"{pname} target {target:g}x: adaptive ({args.rule})")
            t["adaptive"] = tuned(lambda lr, s, test: train_one("adaptive", p, data, lr=lr, seed=s,
                                                                target=target, rule=args.rule,
                                                                score_test=test),
                                  args.lrs, args.seeds, args.tune_seed, log)
            if not args.no_magnitude:
                other = "magnitude" if args.rule == "saliency" else "saliency"
                log(f"{pname} target {target:g}x: adaptive ({other}), its own lr choice")
                t["adaptive-magnitude"] = tuned(
                    lambda lr, s, test: train_one("adaptive", p, data, lr=lr, seed=s, target=target,
                                                  rule=other, score_test=test),
                    args.lrs, args.seeds, args.tune_seed, log)
            # the fixed ranks of a seed: the size of that seed's adaptive run (the tuning
            # seed: the chosen trial's)
            sized = {r["seed"]: r["converted_tt"] for r in t["adaptive"]["runs"]}
            sized[args.tune_seed] = t["adaptive"]["best_trial"]["converted_tt"]

            def fixed_run(lr, s, test, target_sizes=sized):
                ranks, size = fixed_ranks_for(p, vocab, target_sizes[s])
                r = train_one("fixed", p, data, lr=lr, seed=s, fixed_ranks=ranks, score_test=test)
                r["size_vs_adaptive"] = r["converted_tt"] / target_sizes[s] - 1
                return r
            log(f"{pname} target {target:g}x: fixed ranks at each seed's adaptive size")
            t["fixed"] = tuned(fixed_run, args.lrs, args.seeds, args.tune_seed, log)
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
    res["protocol"] = 2  # test split scored once, tuning seed apart, seeded data, magnitude tuned
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
