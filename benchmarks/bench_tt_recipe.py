"""What makes a TT model learn per step: dense against TT variants of the
same preset, one seed, one learning rate, validation MLM loss only.

Each configuration (``CONFIGS``) is a recipe change on top of the converted
model of ``comera pretrain`` (comera/pretrain/model.py ``build_comera``):

* ``method``: ``dense`` or ``tt``;
* ``adapt``: rank adaptation on (the preset's RankAdaptive: stage-1 L1 on the
  gates, stage 2 to the preset's target compression) or off (fixed ranks,
  the preset's initial ranks unless ``rank``/``vocab_rank`` say otherwise);
* ``keep_dense``: globs of layers left dense (e.g. the word embedding);
* ``core_lr``: multiplier of the peak lr for the TT cores and gates (the
  rest of the model keeps the lr);
* ``gamma``, ``stage1``, ``stage2``, ``target``: the rank-adaptation schedule;
* ``balance``: RankAdaptive's canonical-form rewrite at the start (None:
  with rank adaptation only, as RankAdaptive does by default).

Data and evaluation as benchmarks/bench_quality.py (the standard library,
held-out files, 256 validation blocks with one fixed mask); the test split
is never scored.  Each run's JSON is written to
``benchmarks/results/tt_recipe_runs/<name>.json`` as soon as it ends, and a
rerun skips runs whose file exists with the same settings; the summary goes
to ``benchmarks/results/tt_recipe_cpu.{json,md}``.

    python benchmarks/bench_tt_recipe.py --steps 1500 --lr 3e-3 --only dense tt-comera tt-fixed0
    python benchmarks/bench_tt_recipe.py --steps 1500 --update-probe
    python benchmarks/bench_tt_recipe.py --report-only
"""
import argparse
import fnmatch
import hashlib
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
RUNS = os.path.join(RESULTS, "tt_recipe_runs")
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

EMB = "roberta.embeddings.word_embeddings"
DEC = "lm_head.decoder"
QK = ["*.attention.self.query", "*.attention.self.key"]
FFN = ["*.intermediate.dense", "*.output.dense"]

# name -> recipe (see the module doc); every unset key takes the default
CONFIGS = {
    "dense": {"method": "dense"},
    "tt-comera": {"method": "tt", "adapt": True, "gamma": 0.5},
    "tt-fixed0": {"method": "tt", "adapt": False},
    "tt-fixed0-emb-dense": {"method": "tt", "adapt": False, "keep_dense": [EMB]},
    "tt-fixed0-vocab-dense": {"method": "tt", "adapt": False, "keep_dense": [EMB, DEC]},
    "tt-fixed0-dec-dense": {"method": "tt", "adapt": False, "keep_dense": [DEC]},
    "tt-fixed0-qk-dense": {"method": "tt", "adapt": False, "keep_dense": QK},
    "tt-fixed0-ffn-dense": {"method": "tt", "adapt": False, "keep_dense": FFN},
    "tt-fixed-r32": {"method": "tt", "adapt": False, "rank": 32, "vocab_rank": 64},
    "tt-fixed0-balanced": {"method": "tt", "adapt": False, "balance": True},
    "tt-fixed0-corelr3": {"method": "tt", "adapt": False, "core_lr": 3.0},
    "tt-fixed0-corelr10": {"method": "tt", "adapt": False, "core_lr": 10.0},
    "tt-comera-corelr3": {"method": "tt", "adapt": True, "gamma": 0.5, "core_lr": 3.0},
    "tt-comera-gamma0.1": {"method": "tt", "adapt": True, "gamma": 0.1},
    "tt-comera-gamma0": {"method": "tt", "adapt": True, "gamma": 0.0},
    "tt-comera-corelr10": {"method": "tt", "adapt": True, "gamma": 0.5, "core_lr": 10.0},
    "tt-comera-gamma0.1-corelr3": {"method": "tt", "adapt": True, "gamma": 0.1, "core_lr": 3.0},
    "tt-comera-nobalance": {"method": "tt", "adapt": True, "gamma": 0.5, "balance": False},
    # the stage schedule: reach the target early and train longer at the final ranks, or
    # discover ranks for longer and shrink late (the preset: stage 1 30%, stage 2 40%)
    "tt-comera-gamma0.1-early": {"method": "tt", "adapt": True, "gamma": 0.1, "stage1": 0.1,
                                 "stage2": 0.3},
    "tt-comera-gamma0.1-late": {"method": "tt", "adapt": True, "gamma": 0.1, "stage1": 0.5,
                                "stage2": 0.3},
}
DEFAULTS = {"adapt": False, "keep_dense": [], "core_lr": 1.0, "gamma": None, "stage1": None,
            "stage2": None, "target": "preset", "balance": None, "rank": None, "vocab_rank": None,
            "core_wd": None}


def recipe(name):
    if name in CONFIGS:
        return dict(DEFAULTS, **CONFIGS[name])
    raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")


def build(cfg, p, vocab, seed):
    import comera
    from comera.pretrain.model import (CONVERT_EXCLUDE, _share_output_bias, build_dense,
                                       convert_ranks)
    model = build_dense(p, vocab, seed)
    if cfg["method"] == "dense":
        return model
    torch.manual_seed(seed + 1)
    ranks = convert_ranks(p)
    if cfg["rank"] is not None or cfg["vocab_rank"] is not None:
        from comera.pretrain.model import VOCAB_LAYERS
        ranks = {n: cfg["vocab_rank"] or p.vocab_rank for n in VOCAB_LAYERS}
        ranks["*"] = cfg["rank"] or p.rank
    model = comera.convert(model, rank=ranks, exclude=CONVERT_EXCLUDE + list(cfg["keep_dense"]),
                           embeddings=True, init=p.init)
    _share_output_bias(model)
    return model


def optimizer(model, p, lr, cfg):
    """AdamW as comera.pretrain.loop.make_optimizer, with the TT cores and
    gates in groups of their own (lr times ``core_lr``)."""
    groups = {}
    for name, prm in model.named_parameters():
        if not prm.requires_grad:
            continue
        tt = ".cores." in name or ".gates." in name
        decay = prm.dim() >= 2 and ".gates." not in name
        wd = p.weight_decay if decay else 0.0
        if ".cores." in name and cfg["core_wd"] is not None:
            wd = cfg["core_wd"]
        key = (tt, wd)
        groups.setdefault(key, {"params": [], "weight_decay": wd,
                                "lr": lr * (cfg["core_lr"] if tt else 1.0)})["params"].append(prm)
    return torch.optim.AdamW(list(groups.values()), lr=lr, betas=(0.9, 0.98), eps=1e-6)


def controller(model, p, cfg):
    from comera.adapt.rank_adaptive import RankAdaptive
    s1 = p.stage1 if cfg["stage1"] is None else cfg["stage1"]
    s2 = p.stage2 if cfg["stage2"] is None else cfg["stage2"]
    target = p.target_compression if cfg["target"] == "preset" else cfg["target"]
    return RankAdaptive(model, gamma=p.gamma if cfg["gamma"] is None else cfg["gamma"],
                        threshold=p.threshold, stage1_steps=int(s1 * p.steps),
                        stage2_steps=int(s2 * p.steps), target_compression=target,
                        prune_every=p.prune_every, stage2_rule=p.stage2_rule,
                        balance=cfg["balance"] is not False)


def sizes(model):
    from comera.pretrain.model import count_parameters
    c = count_parameters(model)
    return {"total": c["total"], "total_live": c["total_live"], "converted_tt": c["converted_tt"],
            "converted_dense": c["converted_dense"]}


def weight_stds(model):
    """Std of every TT layer's reconstructed weight (table)."""
    from comera.layers.base import tt_layers
    return {n: float(m.weight.detach().float().std()) for n, m in tt_layers(model)}


def run(name, cfg, p, data, lr, seed, evals, log=print):
    from comera import storage
    from comera.adapt import prune
    from comera.adapt.balance import balance_
    from comera.layers.base import tt_layers
    from comera.pretrain.data import MLMData
    from comera.pretrain.loop import make_schedule
    from comera.pretrain.step import Stepper, evaluate
    from bench_quality import train_curve
    cpu = torch.device("cpu")
    mlm = MLMData(data["train_ids"], data["train_ids"][: p.seq_len * 2], seq_len=p.seq_len,
                  batch_size=p.batch_size, vocab_size=data["vocab"], valid_blocks=1, seed=seed)
    model = build(cfg, p, data["vocab"], seed).train()
    if cfg["method"] == "tt" and not cfg["adapt"] and cfg["balance"]:
        for _, layer in tt_layers(model):
            balance_(layer)
    start = sizes(model)
    stds = weight_stds(model)
    opt = optimizer(model, p, lr, cfg)
    sched = make_schedule(opt, p)
    stepper = Stepper(model, opt, device=cpu, clip=p.clip)
    ctrl = controller(model, p, cfg).attach(opt) if cfg["method"] == "tt" and cfg["adapt"] else None
    torch.manual_seed(seed)
    t_wall = time.perf_counter()
    losses, hist, train_s = train_curve(stepper, sched, mlm, p.steps, evals,
                                        lambda: evaluate(model, data["valid"], cpu, p.batch_size),
                                        log=log, name=name, log_evals=True)
    stepper.close()
    if ctrl is not None:
        ctrl.detach()
        prune(model, opt)
    return {"config": cfg, "steps": p.steps, "steps_done": len(losses), "lr": lr, "seed": seed,
            "valid_loss": hist["valid"][-1] if hist["valid"] else math.inf,
            "best_valid": min(hist["valid"]) if hist["valid"] else math.inf,
            "history": hist, "train_s": train_s, "wall_s": time.perf_counter() - t_wall,
            "sizes_start": start, "sizes": sizes(model), "init_weight_std": stds,
            "final_ranks": storage.tt_live_ranks(model) if cfg["method"] == "tt" else None,
            "gamma_used": (p.gamma if cfg["gamma"] is None else cfg["gamma"]) if cfg["adapt"] else None,
            "load_end": list(os.getloadavg())}


PROBE_LAYERS = [EMB, "roberta.encoder.layer.0.attention.self.query",
                "roberta.encoder.layer.0.intermediate.dense", DEC]


def update_probe(p, data, lr, steps=20, seed=0, names=("dense", "tt-fixed0", "tt-fixed0-balanced")):
    """How far ``steps`` AdamW steps at a constant ``lr`` (no warm-up, no
    clipping) move each probed layer's (reconstructed) weight: ``||W_t -
    W_0|| / ||W_0||`` per recipe, the same batches for each."""
    from comera.adapt.balance import balance_
    from comera.layers.base import tt_layers
    from comera.pretrain.data import MLMData
    from comera.pretrain.step import Stepper
    mlm = MLMData(data["train_ids"], data["train_ids"][: p.seq_len * 2], seq_len=p.seq_len,
                  batch_size=p.batch_size, vocab_size=data["vocab"], valid_blocks=1, seed=seed)
    out = {}
    for name in names:
        cfg = recipe(name)
        model = build(cfg, p, data["vocab"], seed).train()
        if cfg["balance"]:
            for _, layer in tt_layers(model):
                balance_(layer)
        mods = dict(model.named_modules())
        w0 = {n: mods[n].weight.detach().clone() for n in PROBE_LAYERS}
        stepper = Stepper(model, optimizer(model, p, lr, cfg), device=torch.device("cpu"), clip=None)
        for s in range(steps):
            stepper.step(*mlm.batch(s))
        stepper.close()
        out[name] = {n: float((mods[n].weight.detach() - w0[n]).norm() / w0[n].norm()) for n in PROBE_LAYERS}
    return {"steps": steps, "lr": lr, "seed": seed, "relative_change": out}


def key_of(name, cfg, p, lr, seed, evals):
    from dataclasses import asdict
    s = {"cfg": cfg, "preset": asdict(p), "lr": lr, "seed": seed, "evals": evals}
    return hashlib.sha1(json.dumps(s, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_file(name, steps, lr, seed):
    """The run's JSON; the tuning seed (100) is left out of the name."""
    return os.path.join(RUNS, f"{name}-{steps}steps-lr{lr:g}" + ("" if seed == 100 else f"-seed{seed}") + ".json")


def report(args, data_desc, machine):
    from timing import machine_line
    rows = []
    for f in sorted(os.listdir(RUNS)) if os.path.isdir(RUNS) else []:
        if f.endswith(".json") and not f.startswith("_"):
            with open(os.path.join(RUNS, f)) as fh:
                rows.append(json.load(fh))
    rows.sort(key=lambda r: (r["seed"], r["steps"], r["lr"], r["valid_loss"]))
    out = {"command": "python benchmarks/bench_tt_recipe.py " + " ".join(sys.argv[1:]),
           "machine": machine, "data": data_desc, "configs": CONFIGS, "defaults": DEFAULTS,
           "runs": [{k: r[k] for k in ("name", "steps", "lr", "seed", "valid_loss", "best_valid",
                                       "train_s", "sizes_start", "sizes", "final_ranks", "history",
                                       "config")} for r in rows]}
    probe_path = os.path.join(RUNS, "_update_probe.json")
    if os.path.isfile(probe_path):
        with open(probe_path) as fh:
            out["update_probe"] = json.load(fh)
    with open(os.path.join(RESULTS, "tt_recipe_cpu.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    lines = ["# What makes TT training learn: dense against TT recipe variants (CPU)", "",
             "Written by `benchmarks/bench_tt_recipe.py` (the recipes in its `CONFIGS`). "
             "One seed, the mini preset cut to the steps shown (the whole lr schedule shortened "
             "alike), validation MLM loss (256 blocks, one fixed mask); the test split is not scored.",
             ""]
    if data_desc:
        lines += [f"Unigram cross-entropy of the validation labels: {data_desc['unigram_ce_valid']:.4f}.", ""]
    if machine:
        lines += [machine_line(machine), ""]
    lines += ["`gamma`: the stage-1 L1 strength of the rank-adaptive runs (runs recorded before "
              "the mini preset's default became 0.1 took the preset's 0.5).", "",
              "| configuration | gamma | seed | steps | lr | valid loss (end) | valid curve | TT params start -> end | "
              "total params end | train s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        curve = " ".join(f"{v:.2f}" for v in r["history"]["valid"])
        cg = r["config"]["gamma"]
        gamma = r.get("gamma_used", 0.5 if cg is None else cg) if r["config"].get("adapt") else None
        lines.append(f"| {r['name']} | {'-' if gamma is None else f'{gamma:g}'} | {r['seed']} | {r['steps']} | {r['lr']:g} | {r['valid_loss']:.4f} | {curve} | "
                     f"{r['sizes_start']['converted_tt']:,} -> {r['sizes']['converted_tt']:,} | "
                     f"{r['sizes']['total']:,} | {r['train_s']:.0f} |")
    if "update_probe" in out:
        pr = out["update_probe"]
        lines += ["", f"Update probe: relative change of each layer's (reconstructed) weight after "
                  f"{pr['steps']} AdamW steps at a constant lr {pr['lr']:g} (no warm-up, no clipping):", "",
                  "| recipe | " + " | ".join(n.split(".")[-1] if "layer" not in n else ".".join(n.split(".")[-2:])
                                            for n in PROBE_LAYERS) + " |",
                  "|---|" + "---|" * len(PROBE_LAYERS)]
        for name, row in pr["relative_change"].items():
            lines.append(f"| {name} | " + " | ".join(f"{row[n]:.3f}" for n in PROBE_LAYERS) + " |")
    with open(os.path.join(RESULTS, "tt_recipe_cpu.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--evals", type=int, default=6)
    ap.add_argument("--only", nargs="+", default=None, help="configurations to run (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(REPO, "runs", "bench-quality-cache"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--update-probe", action="store_true",
                    help="measure how far 20 AdamW steps move dense and TT weights, then report")
    args = ap.parse_args(argv)
    from comera.pretrain.model import preset
    from timing import assert_threads, finish_record, machine_record
    import bench_quality as bq
    assert_threads(args.threads)
    p = preset(args.preset)
    p.steps = args.steps
    log = lambda m: print(time.strftime("%H:%M:%S ") + m, flush=True)  # noqa: E731
    machine = machine_record(measure=not args.report_only)
    ns = argparse.Namespace(corpus=None, heldout=0.2, cache=args.cache, eval_blocks=256,
                            ft_max_train=20000, doc_len=32, code_len=64)
    data = bq.prepare_data(p, ns, log)
    os.makedirs(RUNS, exist_ok=True)
    if args.update_probe:
        log("update probe")
        probe = update_probe(p, data, args.lr)
        with open(os.path.join(RUNS, "_update_probe.json"), "w") as fh:
            json.dump(probe, fh, indent=1)
        log(json.dumps(probe["relative_change"]))
    elif not args.report_only:
        for name in args.only or list(CONFIGS):
            cfg = recipe(name)
            key = key_of(name, cfg, p, args.lr, args.seed, args.evals)
            path = run_file(name, p.steps, args.lr, args.seed)
            if os.path.isfile(path):
                with open(path) as fh:
                    if json.load(fh).get("settings_key") == key:
                        log(f"{name}: done already ({path})")
                        continue
            log(f"{name}: {p.steps} steps at lr {args.lr:g}")
            rec = run(name, cfg, p, data, args.lr, args.seed, args.evals, log)
            rec.update(name=name, settings_key=key, threads=args.threads)
            with open(path + ".tmp", "w") as fh:
                json.dump(rec, fh, indent=1)
            os.replace(path + ".tmp", path)
            log(f"{name}: valid {rec['valid_loss']:.4f}, {rec['train_s']:.0f} s")
    report(args, data["describe"], finish_record(machine))


if __name__ == "__main__":
    main()
