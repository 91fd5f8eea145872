"""CoMERA's quality against dense at equal wall-clock and at equal steps,
and against fixed TT ranks at CoMERA's final size: one protocol.

Methods (the ``--preset`` model, default ``mini``):

* ``dense``: the uncompressed RoBERTa MLM model;
* ``comera``: its CoMERA version, rank-adaptive (stage 1 L1 on the gates,
  stage 2 to the preset's target compression, pruning);
* ``fixed``: TT layers at fixed ranks, sized to CoMERA's final converted-layer
  parameters of the same seed and budget (within +-2%: uniform ranks, linear
  layers r and vocabulary layers 2r, then one layer at a time raised to the
  next rank until the size is closest), trained without rank adaptation.

Budgets:

* ``steps``: every method trains the preset's steps;
* ``wall``: every method trains for the wall-clock that dense needs for the
  preset's steps.  The machine is shared, so wall-clock is not read off the
  clock during training: before any run, the step time of each method is
  measured in one process, interleaved, median of several rounds (CoMERA
  at its starting ranks and at its final size, weighted by the stage
  schedule), and the budget is converted into a step count per method.  The
  figures, the CPU and the load are recorded in ``calibration.json``.

Tuning: the peak learning rate of every method comes from one grid
(``--lrs``), each rate trained once with a tuning seed (``--tune-seed``, not
one of the reported seeds) for ``--tune-fraction`` of the equal-steps budget
(the whole schedule shortened alike), chosen by validation MLM loss; the
fine-tuning rate of the code-search encoder likewise from ``--ft-lrs`` by
validation MRR on the tuning encoders.  Then, per seed (each seed varies the
initialisation, the data order and the masks), every run of both budgets;
the order of the methods rotates with the seed.  The held-out test split is
scored once per run, after training: test MLM loss (fixed masks) and code
search MRR after the contrastive fine-tune (each docstring against its code
and 999 distractors, every test pair a query once).

Data: the standard library; files held out of training by a hash of the
path (``--heldout``), a quarter of them the validation split, the rest the
test split.  The unigram cross-entropy of the test labels under the
training-token counts is the baseline a model must beat to have learned
anything beyond token frequencies.

Resumable: each run writes ``<runs-dir>/<name>.json`` when it ends; a rerun
skips every run whose file exists (with the same settings) and reports
everything that has finished.

    python benchmarks/bench_quality.py                  # the whole protocol (hours)
    python benchmarks/bench_quality.py --report-only    # the report of what has finished
    python benchmarks/bench_quality.py --quick          # a tiny smoke run (seconds)

Writes benchmarks/results/quality_cpu.{json,md,png} (``--tag`` adds a suffix).
"""
import argparse
import copy
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

METHODS = ("dense", "comera", "fixed")
BUDGETS = ("steps", "wall")
TEST_MASK_SEED = 1_000_003  # one fixed mask of the validation and test blocks for every run
QUICK = {"preset": "tiny", "layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "seq_len": 32,
         "batch_size": 4, "vocab_size": 300, "steps": 12, "rank": 4, "vocab_rank": 8,
         "target_compression": 6.0, "prune_every": 2, "max_train_tokens": 20000,
         "tokenizer_max_mb": 0.3}


# --------------------------------------------------------------------------- data

def split_heldout(rels, valid_share=4):
    """(valid, test): 1 in ``valid_share`` of the held-out files (by a hash of
    the path, at least one) for validation, the rest for the test.

    Example:
        >>> v, t = split_heldout([f"f{i}.py" for i in range(8)])
        >>> len(v), len(t), sorted(v + t) == sorted(f"f{i}.py" for i in range(8))
        (2, 6, True)
    """
    ranked = sorted(rels, key=lambda r: hashlib.sha1(("quality-valid:" + r).encode()).hexdigest())
    k = max(1, len(ranked) // valid_share)
    return sorted(ranked[:k]), sorted(ranked[k:])


def unigram_cross_entropy(train_ids, labels, vocab_size):
    """Cross-entropy (nats per predicted token) of ``labels`` (-100: not
    predicted) under the unigram distribution of ``train_ids`` (add-one
    smoothed): the loss of a model that knows only token frequencies.

    Example:
        >>> ids = torch.tensor([3, 3, 3, 4]); lab = torch.tensor([3, -100, 4])
        >>> round(unigram_cross_entropy(ids, lab, 5), 4)  # p(3) = 4/9, p(4) = 2/9
        1.1575
    """
    counts = torch.bincount(train_ids.long().flatten(), minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    chosen = labels[labels != -100].long()
    return float(-logp[chosen].mean())


class EvalSet:
    """Blocks with one fixed mask, scored by comera.pretrain.step.evaluate."""

    def __init__(self, ids, seq_len, blocks, vocab_size):
        from comera.pretrain.data import make_blocks, mask_tokens, seed_for
        b = make_blocks(ids, seq_len)[:blocks]
        if b.shape[0] == 0:
            raise ValueError(f"an evaluation split of {ids.numel()} tokens holds no block of {seq_len}")
        g = torch.Generator().manual_seed(seed_for(TEST_MASK_SEED, seq_len))
        self.valid_inputs, self.valid_labels = mask_tokens(b, vocab_size, g)

    def valid_batches(self, batch_size):
        for i in range(0, self.valid_inputs.shape[0], batch_size):
            yield self.valid_inputs[i:i + batch_size], self.valid_labels[i:i + batch_size]


def prepare_data(p, args, log=print):
    """Tokenizer, token streams, evaluation sets and code-search pairs
    (cached under ``args.cache``)."""
    from types import SimpleNamespace
    from comera.pretrain import corpus as corpus_mod
    from comera.pretrain import tokenizer as tok_mod
    from code_docstring import functions_in_file
    corpus = corpus_mod.load_corpus(args.corpus, valid_fraction=args.heldout, seed=0)
    held = dict(corpus.valid)
    valid_rels, test_rels = split_heldout(list(held))
    cache = args.cache
    os.makedirs(cache, exist_ok=True)
    split = SimpleNamespace(train=corpus.train, valid=[(r, held[r]) for r in valid_rels])
    max_mb = p.tokenizer_max_mb
    tok, train_ids, valid_ids, meta = tok_mod.load_or_build(
        cache, split, vocab_size=p.vocab_size, max_train_tokens=p.max_train_tokens,
        max_valid_tokens=args.eval_blocks * p.seq_len * 2,
        tokenizer_max_bytes=None if max_mb is None else int(max_mb * 1e6), log=log)
    test_ids = tok_mod.encode_files(tok, [held[r] for r in test_rels], args.eval_blocks * p.seq_len * 2)
    vocab = tok.get_vocab_size()
    pairs_path = os.path.join(cache, "pairs.json")
    key = meta["fingerprint"] + f":{args.heldout}:{args.ft_max_train}"
    pairs = None
    if os.path.isfile(pairs_path):
        with open(pairs_path) as fh:
            pairs = json.load(fh)
        if pairs.get("key") != key:
            pairs = None
    if pairs is None:
        log("code search: collecting (docstring, code) pairs")
        get = lambda rels: [list(f) for r in rels for f in functions_in_file(os.path.join(corpus.root, r))]  # noqa: E731
        train = get([r for r, _ in corpus.train])
        if len(train) > args.ft_max_train:
            keep = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:args.ft_max_train]
            train = [train[i] for i in sorted(keep.tolist())]
        pairs = {"key": key, "train": train, "valid": get(valid_rels)[:1000], "test": get(test_rels)}
        with open(pairs_path, "w") as fh:
            json.dump(pairs, fh)
    valid_set = EvalSet(valid_ids, p.seq_len, args.eval_blocks, vocab)
    test_set = EvalSet(test_ids, p.seq_len, args.eval_blocks, vocab)
    from bench_codesearch import encode
    enc = lambda ps: {"docs": encode(tok, [d for d, _ in ps], args.doc_len),  # noqa: E731
                      "codes": encode(tok, [c for _, c in ps], args.code_len)}
    return {"vocab": vocab, "train_ids": train_ids, "valid": valid_set, "test": test_set,
            "pairs": {k: enc(pairs[k]) for k in ("train", "valid", "test")},
            "describe": {
                "corpus": args.corpus or f"the Python {sys.version_info[0]}.{sys.version_info[1]} standard library",
                "train_files": len(corpus.train), "valid_files": len(valid_rels),
                "test_files": len(test_rels), "train_tokens": int(train_ids.numel()),
                "vocab_size": vocab,
                "valid_blocks": int(valid_set.valid_inputs.shape[0]),
                "test_blocks": int(test_set.valid_inputs.shape[0]),
                "test_masked_tokens": int((test_set.valid_labels != -100).sum()),
                "pairs": {k: len(pairs[k]) for k in ("train", "valid", "test")},
                "unigram_entropy_train": unigram_cross_entropy(train_ids, train_ids, vocab),
                "unigram_ce_test": unigram_cross_entropy(train_ids, test_set.valid_labels, vocab),
                "unigram_ce_valid": unigram_cross_entropy(train_ids, valid_set.valid_labels, vocab)}}


# --------------------------------------------------------------------------- models

def with_steps(p, steps):
    q = copy.deepcopy(p)
    q.steps = int(steps)
    return q


def build_fixed(p, vocab, seed, ranks):
    """The dense model of the seed converted at the per-layer ``ranks``
    (``{layer name: rank}``) without rank adaptation."""
    import comera
    from comera.pretrain.model import CONVERT_EXCLUDE, _share_output_bias, build_dense
    model = build_dense(p, vocab, seed)
    torch.manual_seed(seed + 1)
    # only the named layers: those that CoMERA's conversion of the same preset converts
    model = comera.convert(model, rank=dict(ranks), include=sorted(ranks), exclude=CONVERT_EXCLUDE,
                           embeddings=True, init=p.init)
    _share_output_bias(model)
    return model


def converted_size(p, vocab, ranks):
    from comera.pretrain.model import count_parameters
    return count_parameters(build_fixed(p, vocab, 0, ranks))["converted_tt"]


def layer_sizes(p, vocab, ranks):
    """{layer: its TT parameters} of the model converted at ``ranks``."""
    from comera.layers.base import live_ranks, size_from_ranks, tt_layers
    model = build_fixed(p, vocab, 0, ranks)
    return {n: size_from_ranks(m, live_ranks(m)) for n, m in tt_layers(model)}


def fixed_ranks_for(p, vocab, target):
    """Per-layer ranks whose converted TT size is the closest to ``target``:
    the largest uniform ranks below it (linear r, vocabulary layers 2r), then
    the layers whose next rank (linear r + 1, vocabulary 2r + 1 or 2r + 2)
    fits in what is left, largest first, and the smallest step past the
    target if that comes closer.  Returns (ranks, size).

    Example:
        >>> from comera.pretrain.model import preset
        >>> p = preset("tiny"); p.layers, p.hidden, p.ffn, p.seq_len = 1, 32, 64, 16
        >>> ranks, size = fixed_ranks_for(p, 300, 3000)
        >>> abs(size / 3000 - 1) < 0.02, size == converted_size(p, 300, ranks)
        (True, True)
    """
    from comera.pretrain.model import VOCAB_LAYERS, build_comera
    from comera.layers.base import tt_layers
    names = [n for n, _ in tt_layers(build_comera(p, vocab, 0))]
    spec = lambda lin, voc: {n: (voc if n in VOCAB_LAYERS else lin) for n in names}  # noqa: E731
    r = 1
    while r < 4 * p.rank and converted_size(p, vocab, spec(r + 1, 2 * r + 2)) <= target:
        r += 1
    levels = [layer_sizes(p, vocab, spec(r, 2 * r)), layer_sizes(p, vocab, spec(r + 1, 2 * r + 1)),
              layer_sizes(p, vocab, spec(r + 1, 2 * r + 2))]
    choice = {n: 0 for n in names}  # index into levels (linear layers: 0 or 1)
    size = lambda c: sum(levels[c[n]][n] for n in names)  # noqa: E731
    best = dict(choice)
    # one upgrade per layer at a time, the largest that still fits, until none fits
    while True:
        cur = size(choice)
        steps = []
        for n in names:
            top = 2 if n in VOCAB_LAYERS else 1
            if choice[n] < top:
                nxt = dict(choice, **{n: choice[n] + 1})
                steps.append((size(nxt) - cur, nxt))
        fits = [st for st in steps if cur + st[0] <= target]
        if not fits:
            past = [st for st in steps if st[0] > 0]
            if past:
                over = min(past, key=lambda st: st[0])[1]
                if abs(size(over) - target) < abs(cur - target):
                    best = over
                    break
            best = dict(choice)
            break
        choice = max(fits, key=lambda st: st[0])[1]
    lin = {0: r, 1: r + 1}
    voc = {0: 2 * r, 1: 2 * r + 1, 2: 2 * r + 2}
    ranks = {n: (voc if n in VOCAB_LAYERS else lin)[best[n]] for n in names}
    return ranks, converted_size(p, vocab, ranks)


def build(method, p, vocab, seed, fixed_ranks=None):
    from comera.pretrain.model import build_comera, build_dense
    if method == "dense":
        return build_dense(p, vocab, seed)
    if method == "comera":
        return build_comera(p, vocab, seed)
    return build_fixed(p, vocab, seed, fixed_ranks)


def sizes(model):
    from comera.pretrain.model import count_parameters
    c = count_parameters(model)
    enc = sum(t.numel() for t in model.roberta.parameters())
    return {"total": c["total"], "total_live": c["total_live"], "encoder": enc,
            "converted_tt": c["converted_tt"], "converted_dense": c["converted_dense"],
            "dense_equivalent": c["dense_equivalent"]}


# --------------------------------------------------------------------------- one run

def train_curve(stepper, sched, mlm, steps, evals, score, *, log=print, name="", log_evals=False):
    """Runs ``steps`` steps of ``stepper`` on ``mlm``'s batches, stepping
    ``sched`` after each, timing only the steps; every ``steps // evals``
    steps and at the end records ``score()`` (the validation loss).  Stops
    at a non-finite loss.  Returns (losses, history, training seconds); the
    history has step, train_s, loss (the mean since the last record) and
    valid."""
    every = max(1, steps // evals)
    hist = {"step": [], "train_s": [], "valid": [], "loss": []}
    losses, train_s = [], 0.0
    for step in range(steps):
        inputs, labels = mlm.batch(step)
        t0 = time.perf_counter()
        loss = stepper.step(inputs, labels)
        sched.step()
        train_s += time.perf_counter() - t0
        losses.append(loss)
        if not math.isfinite(loss):
            log(f"    {name}: loss {loss} at step {step + 1}: stopped")
            break
        if (step + 1) % every == 0 or step + 1 == steps:
            hist["step"].append(step + 1)
            hist["train_s"].append(train_s)
            hist["loss"].append(statistics.fmean(losses[-every:]))
            hist["valid"].append(score())
            if log_evals:
                log(f"  {name} step {step + 1}: train {hist['loss'][-1]:.4f} valid {hist['valid'][-1]:.4f}")
    return losses, hist, train_s


def train_run(method, p, data, *, steps, lr, seed, fixed_ranks=None, ft_lr=None, args=None,
              score_test=True, save_to=None, log=print):
    """Trains one method for ``steps`` steps at peak ``lr``; returns its
    record (validation curve against training time, test MLM loss and
    code-search MRR when ``score_test``, speed, sizes, peak memory)."""
    from common import peak_rss_bytes, release_freed_memory, reset_peak_rss, rss_bytes
    from comera import storage
    from comera.adapt import prune
    from comera.pretrain.data import MLMData
    from comera.pretrain.loop import make_controller, make_optimizer, make_schedule
    from comera.pretrain.step import Stepper, evaluate
    q = with_steps(p, steps)
    cpu = torch.device("cpu")
    mlm = MLMData(data["train_ids"], data["train_ids"][: q.seq_len * 2], seq_len=q.seq_len,
                  batch_size=q.batch_size, vocab_size=data["vocab"], valid_blocks=1, seed=seed)
    release_freed_memory()
    reset_peak_rss()
    base = rss_bytes()
    model = build(method, q, data["vocab"], seed, fixed_ranks).train()
    start_sizes = sizes(model)
    opt = make_optimizer(model, q, lr)
    sched = make_schedule(opt, q)
    stepper = Stepper(model, opt, device=cpu, clip=q.clip)
    ctrl = make_controller(model, q).attach(opt) if method == "comera" else None
    torch.manual_seed(seed)
    t_wall = time.perf_counter()
    losses, hist, train_s = train_curve(
        stepper, sched, mlm, q.steps, args.evals,
        lambda: evaluate(model, data["valid"], cpu, q.batch_size), log=log, name=method)
    stepper.close()
    if ctrl is not None:
        ctrl.detach()
        prune(model, opt)
    peak = peak_rss_bytes() - base
    rec = {"method": method, "steps": q.steps, "steps_done": len(losses), "lr": lr, "seed": seed,
           "train_s": train_s, "wall_s": time.perf_counter() - t_wall,
           "tokens_per_s": len(losses) * q.batch_size * q.seq_len / max(train_s, 1e-9),
           "peak_memory_growth_bytes": int(peak), "sizes_start": start_sizes, "sizes": sizes(model),
           "valid_loss": hist["valid"][-1] if hist["valid"] else math.inf, "history": hist,
           "fixed_ranks": fixed_ranks,
           "final_ranks": storage.tt_live_ranks(model) if method != "dense" else None,
           "load_end": list(os.getloadavg())}
    if save_to is not None:
        os.makedirs(os.path.dirname(save_to), exist_ok=True)
        torch.save(model, save_to + ".tmp")
        os.replace(save_to + ".tmp", save_to)
    if score_test and math.isfinite(rec["valid_loss"]):
        rec["test_loss"] = evaluate(model, data["test"], cpu, q.batch_size)
    if ft_lr is not None and math.isfinite(rec["valid_loss"]):
        rec["codesearch"] = codesearch(model, data, ft_lr, seed, args,
                                       splits=("test",) if score_test else ("valid",))
    del model, opt, sched, stepper, ctrl
    release_freed_memory()
    return rec


def codesearch(model, data, lr, seed, args, splits=("test",)):
    """Contrastive fine-tune of a copy of the encoder, then MRR on ``splits``."""
    from bench_codesearch import fine_tune, mrr
    ns = argparse.Namespace(steps=args.ft_steps, batch=args.ft_batch)
    enc, secs = fine_tune(copy.deepcopy(model.roberta), data["pairs"]["train"], lr, seed, ns)
    out = {"lr": lr, "fine_tune_s": secs}
    for s in splits:
        out[s] = mrr(enc, **data["pairs"][s], pool=args.pool)
    return out


# --------------------------------------------------------------------------- calibration

def calibrate(p, data, fixed_ranks, args, log=print):
    """Median step time of each method, measured in one process, interleaved
    (timing.interleaved); CoMERA at its starting ranks and, as the fixed
    model of its final size, at its end.  Returns the record, with the step
    counts of the equal-wall-clock budget."""
    from comera.pretrain.data import MLMData
    from comera.pretrain.loop import make_controller, make_optimizer
    from comera.pretrain.step import Stepper
    from timing import finish_record, interleaved, machine_record
    rec = machine_record(measure=not args.quick)
    mlm = MLMData(data["train_ids"], data["train_ids"][: p.seq_len * 2], seq_len=p.seq_len,
                  batch_size=p.batch_size, vocab_size=data["vocab"], valid_blocks=1, seed=0)
    batches = [mlm.batch(s) for s in range(4)]
    steppers, keep = {}, []
    for m in METHODS:
        model = build(m, p, data["vocab"], 0, fixed_ranks).train()
        opt = make_optimizer(model, p, 1e-4)
        st = Stepper(model, opt, device=torch.device("cpu"), clip=p.clip)
        if m == "comera":  # the gate step runs, nothing is pruned in these few steps
            keep.append(make_controller(model, with_steps(p, 10 ** 6)).attach(opt))
        steppers[m] = st
        keep.append(model)

    def runner(st):
        def go():
            for b in batches:
                st.step(*b)
        return go
    res = interleaved({m: runner(st) for m, st in steppers.items()}, reps=args.calib_reps, warmup=1)
    step_s = {m: res[m]["wall"]["median"] / len(batches) for m in METHODS}
    s1, s2 = p.stage1, p.stage2
    # stage 1 at the starting ranks, stage 2 shrinking (the mean of both ends), then the final size
    comera_avg = s1 * step_s["comera"] + s2 * 0.5 * (step_s["comera"] + step_s["fixed"]) \
        + (1 - s1 - s2) * step_s["fixed"]
    per_step = {"dense": step_s["dense"], "comera": comera_avg, "fixed": step_s["fixed"]}
    budget_s = p.steps * per_step["dense"]
    steps = {m: max(1, int(round(budget_s / per_step[m]))) for m in METHODS}
    for st in steppers.values():
        st.close()
    finish_record(rec)
    out = {"machine": rec, "timing": {m: res[m]["wall"] for m in METHODS},
           "step_s": step_s, "step_s_used": per_step, "steps_per_timed_call": len(batches),
           "wall_budget_s": budget_s, "wall_steps": steps, "fixed_ranks": fixed_ranks}
    log(f"calibration: step s {json.dumps({m: round(v, 4) for m, v in per_step.items()})}, "
        f"budget {budget_s:.0f} s -> steps {steps}")
    return out


# --------------------------------------------------------------------------- the protocol

def settings_key(p, args):
    """What a finished run depends on: a rerun with other settings does not reuse it."""
    from dataclasses import asdict
    # the preset's own rates and reporting cadence play no part here
    skip = ("lr", "lr_comera", "eval_every", "checkpoint_every", "log_every", "valid_blocks")
    s = {"preset": {k: v for k, v in asdict(p).items() if k not in skip}, "lrs": args.lrs, "ft_lrs": args.ft_lrs, "tune_fraction": args.tune_fraction,
         "tune_seed": args.tune_seed, "heldout": args.heldout, "eval_blocks": args.eval_blocks,
         "ft": [args.ft_steps, args.ft_batch, args.doc_len, args.code_len, args.pool, args.ft_max_train],
         "corpus": args.corpus, "threads": args.threads, "evals": args.evals}
    return hashlib.sha1(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]


class Store:
    """One JSON file per finished run under ``root``."""

    def __init__(self, root, key):
        self.root, self.key = root, key
        os.makedirs(root, exist_ok=True)

    def path(self, name):
        return os.path.join(self.root, name + ".json")

    def get(self, name):
        if not os.path.isfile(self.path(name)):
            return None
        with open(self.path(name)) as fh:
            rec = json.load(fh)
        return rec if rec.get("settings_key") == self.key else None

    def put(self, name, rec):
        rec = dict(rec, name=name, settings_key=self.key, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
        self._keep_other_settings(name)
        tmp = self.path(name) + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rec, fh, indent=1)
        os.replace(tmp, self.path(name))
        if self.on_write is not None:
            self.on_write(self.path(name))
        return rec

    on_write = None

    def _keep_other_settings(self, name):
        """A finished run of other settings under this name is renamed
        ``<name>.settings-<its key>.json``, never overwritten."""
        path = self.path(name)
        if not os.path.isfile(path):
            return
        with open(path) as fh:
            old = json.load(fh).get("settings_key")
        if old != self.key:
            os.replace(path, os.path.join(self.root, f"{name}.settings-{str(old)[:12]}.json"))


def run_name(budget, method, seed, lr=None):
    return f"{budget}-{method}-seed{seed}" + ("" if lr is None else f"-lr{lr:g}")


def order_for(seed):
    """The methods' order for a seed (rotated): comera always before fixed,
    whose size it sets.

    Example:
        >>> [order_for(s) for s in range(3)]
        [['dense', 'comera', 'fixed'], ['comera', 'dense', 'fixed'], ['comera', 'fixed', 'dense']]
    """
    return [["dense", "comera", "fixed"], ["comera", "dense", "fixed"], ["comera", "fixed", "dense"]][seed % 3]


def protocol(p, data, store, args, log=print):
    """Runs (or reuses) every run of the protocol; returns the records."""
    tune_steps = max(2, int(round(p.steps * args.tune_fraction)))
    seed = args.tune_seed
    runs = {}
    model_path = lambda name: os.path.join(args.cache, "models", store.key, name + ".pt")  # noqa: E731

    def once(name, **kw):
        rec = store.get(name)
        if rec is None:
            log(f"run {name}: {kw['steps']} steps")
            save = model_path(name) if name.startswith("tune-") else None
            rec = store.put(name, train_run(log=log, args=args, save_to=save, **kw))
            cs = rec.get("codesearch", {})
            log(f"  -> valid {rec['valid_loss']:.4f}" + (f", test {rec['test_loss']:.4f}" if "test_loss" in rec
                                                        else "")
                + (f", test MRR {cs['test']['mrr']:.4f}" if "test" in cs else "")
                + f", {rec['tokens_per_s']:,.0f} tokens/s, {rec['train_s']:.0f} s")
        runs[name] = rec
        return rec

    # 1. learning rates: dense and comera alternated, then fixed at the chosen comera's final size
    chosen = {}
    for lr in args.lrs:
        for m in ("dense", "comera"):
            once(run_name("tune", m, seed, lr), method=m, p=p, data=data, steps=tune_steps, lr=lr,
                 seed=seed, score_test=False)
    best = lambda m: min(args.lrs, key=lambda lr: _finite(runs[run_name("tune", m, seed, lr)]["valid_loss"]))  # noqa: E731
    for m in ("dense", "comera"):
        chosen[m] = best(m)
    tune_fixed_size = runs[run_name("tune", "comera", seed, chosen["comera"])]["sizes"]["converted_tt"]
    tune_ranks, _ = fixed_ranks_for(with_steps(p, tune_steps), data["vocab"], tune_fixed_size)
    for lr in args.lrs:
        once(run_name("tune", "fixed", seed, lr), method="fixed", p=p, data=data, steps=tune_steps, lr=lr,
             seed=seed, fixed_ranks=tune_ranks, score_test=False)
    chosen["fixed"] = best("fixed")
    # 2. fine-tuning rates of the code-search encoder (validation MRR, the chosen tuning encoders)
    ft = {}
    for m in METHODS:
        trials = {}
        for flr in args.ft_lrs:
            name = f"ftune-{m}-seed{seed}-lr{flr:g}"
            rec = store.get(name)
            if rec is None:
                tname = run_name("tune", m, seed, chosen[m])
                path = model_path(tname)
                if not os.path.isfile(path):  # the saved model is gone (a fresh machine): train it again
                    train_run(m, p, data, steps=tune_steps, lr=chosen[m], seed=seed, args=args,
                              fixed_ranks=tune_ranks if m == "fixed" else None, score_test=False,
                              save_to=path, log=log)
                model = torch.load(path, weights_only=False)
                rec = store.put(name, {"method": m, "ft_lr": flr, "encoder_run": tname,
                                       "codesearch": codesearch(model, data, flr, seed, args, ("valid",))})
                log(f"run {name}: valid MRR {rec['codesearch']['valid']['mrr']:.4f}")
            runs[name] = trials[flr] = rec
        ft[m] = max(args.ft_lrs, key=lambda f: trials[f]["codesearch"]["valid"]["mrr"])
    # 3. the equal-wall-clock step counts
    cal = store.get("calibration")
    if cal is None:
        cal = store.put("calibration", calibrate(p, data, tune_ranks, args, log))
    runs["calibration"] = cal
    # 4. the seeds: both budgets, methods in rotating order
    for s in args.seeds:
        for budget in BUDGETS:
            counts = {m: p.steps for m in METHODS} if budget == "steps" else cal["wall_steps"]
            for m in order_for(s):
                if budget == "wall" and m == "dense" and counts["dense"] == p.steps:
                    continue  # the same run as equal steps
                fixed_ranks = None
                if m == "fixed":
                    size = runs[run_name(budget, "comera", s)]["sizes"]["converted_tt"]
                    fixed_ranks, _ = fixed_ranks_for(p, data["vocab"], size)
                once(run_name(budget, m, s), method=m, p=p, data=data, steps=counts[m], lr=chosen[m],
                     seed=s, fixed_ranks=fixed_ranks, ft_lr=ft[m])
    return runs, chosen, ft, cal


def _finite(x):
    return x if x is not None and math.isfinite(x) else math.inf


# --------------------------------------------------------------------------- report

def stats(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "n": len(vals), "values": vals}


def collect(store, p, args):
    """Everything finished so far, summarised per budget and method."""
    cal = store.get("calibration")
    out = {"budgets": {}, "tuning": {}, "calibration": cal}
    for m in METHODS:
        trials = {f"{lr:g}": store.get(run_name("tune", m, args.tune_seed, lr)) for lr in args.lrs}
        fts = {f"{f:g}": store.get(f"ftune-{m}-seed{args.tune_seed}-lr{f:g}") for f in args.ft_lrs}
        out["tuning"][m] = {
            "valid_loss": {k: (r["valid_loss"] if r else None) for k, r in trials.items()},
            "ft_valid_mrr": {k: (r["codesearch"]["valid"]["mrr"] if r else None) for k, r in fts.items()}}
        done = {k: r for k, r in trials.items() if r}
        if len(done) == len(args.lrs):
            out["tuning"][m]["chosen_lr"] = float(min(done, key=lambda k: _finite(done[k]["valid_loss"])))
        fdone = {k: r for k, r in fts.items() if r}
        if len(fdone) == len(args.ft_lrs):
            out["tuning"][m]["chosen_ft_lr"] = float(max(fdone, key=lambda k: fdone[k]["codesearch"]["valid"]["mrr"]))
    for budget in BUDGETS:
        b = {}
        for m in METHODS:
            recs = []
            for s in args.seeds:
                r = store.get(run_name(budget, m, s))
                if r is None and budget == "wall" and m == "dense" and cal and cal["wall_steps"]["dense"] == p.steps:
                    r = store.get(run_name("steps", m, s))
                if r is not None:
                    recs.append(r)
            if not recs:
                continue
            b[m] = {"seeds": [r["seed"] for r in recs], "steps": [r["steps"] for r in recs],
                    "test_loss": stats([r.get("test_loss") for r in recs]),
                    "valid_loss": stats([r["valid_loss"] for r in recs]),
                    "test_mrr": stats([r.get("codesearch", {}).get("test", {}).get("mrr") for r in recs]),
                    "tokens_per_s": stats([r["tokens_per_s"] for r in recs]),
                    "train_s": stats([r["train_s"] for r in recs]),
                    "peak_memory_growth_bytes": stats([r["peak_memory_growth_bytes"] for r in recs]),
                    "encoder_params": stats([r["sizes"]["encoder"] for r in recs]),
                    "total_params": stats([r["sizes"]["total"] for r in recs]),
                    "converted_tt": stats([r["sizes"]["converted_tt"] for r in recs]),
                    "lr": recs[0]["lr"], "ft_lr": recs[0].get("codesearch", {}).get("lr"),
                    "histories": [{"seed": r["seed"], **r["history"]} for r in recs]}
            if m == "fixed":
                dev = []
                for r in recs:
                    c = store.get(run_name(budget, "comera", r["seed"]))
                    if c:
                        dev.append(r["sizes"]["converted_tt"] / c["sizes"]["converted_tt"] - 1)
                b[m]["size_vs_comera"] = stats(dev)
            b[m]["expected_seeds"] = len(args.seeds)
        out["budgets"][budget] = b
    out["targets"] = targets(out, args)
    return out


def _complete(entry, key, n):
    return entry is not None and entry.get(key) is not None and entry[key]["n"] == n


def targets(res, args):
    """The quality targets, each {name, want, got, met} (met None: not run yet)."""
    n = len(args.seeds)
    W, S = res["budgets"].get("wall", {}), res["budgets"].get("steps", {})
    out = []
    d, c = W.get("dense"), W.get("comera")
    ok = _complete(d, "test_loss", n) and _complete(c, "test_loss", n) and _complete(d, "test_mrr", n) \
        and _complete(c, "test_mrr", n)
    got = None
    met = None
    if ok:
        ratio = d["encoder_params"]["mean"] / c["encoder_params"]["mean"]
        got = (f"test loss {c['test_loss']['mean']:.4f} vs dense {d['test_loss']['mean']:.4f}; MRR "
               f"{c['test_mrr']['mean']:.4f} vs dense {d['test_mrr']['mean']:.4f}; encoder params {ratio:.2f}x fewer")
        met = (c["test_loss"]["mean"] <= d["test_loss"]["mean"]
               and c["test_mrr"]["mean"] >= d["test_mrr"]["mean"] - 0.01 and ratio >= 10)
    out.append({"name": "equal wall-clock: CoMERA test MLM loss <= dense, MRR >= dense - 0.01, "
                        ">= 10x fewer encoder parameters",
                "want": "loss_comera <= loss_dense and mrr_comera >= mrr_dense - 0.01 and "
                        "encoder_dense / encoder_comera >= 10", "got": got, "met": met})
    d, c = S.get("dense"), S.get("comera")
    got = met = None
    if _complete(d, "test_loss", n) and _complete(c, "test_loss", n):
        rel = c["test_loss"]["mean"] / d["test_loss"]["mean"] - 1
        got = f"{rel * 100:+.2f}% ({c['test_loss']['mean']:.4f} vs {d['test_loss']['mean']:.4f})"
        met = rel <= 0.03
    out.append({"name": "equal steps: CoMERA test MLM loss within 3% of dense",
                "want": "loss_comera / loss_dense - 1 <= 0.03", "got": got, "met": met})
    # adaptive against fixed: test loss at equal steps, test loss at equal wall-clock, MRR at equal wall-clock
    comps, wins, got_parts = 0, 0, []
    for label, B, key, lower in (("steps loss", S, "test_loss", True), ("wall loss", W, "test_loss", True),
                                 ("wall MRR", W, "test_mrr", False)):
        a, f = B.get("comera"), B.get("fixed")
        if not (_complete(a, key, n) and _complete(f, key, n)):
            continue
        comps += 1
        gap = (f[key]["mean"] - a[key]["mean"]) * (1 if lower else -1)
        spread = max(a[key]["std"], f[key]["std"])
        won = gap > spread
        wins += won
        got_parts.append(f"{label}: adaptive {a[key]['mean']:.4f} vs fixed {f[key]['mean']:.4f} "
                         f"(spread {spread:.4f}){' won' if won else ''}")
    out.append({"name": "adaptive beats fixed ranks at the same final size beyond the spread (the larger "
                        "std of the two) at 2 of 3 comparisons: test loss at equal steps, test loss at "
                        "equal wall-clock, MRR at equal wall-clock",
                "want": "wins >= 2 of 3", "got": (f"{wins} of {comps}: " + "; ".join(got_parts)) if comps else None,
                "met": (wins >= 2) if comps == 3 else None})
    return out


def pending(store, p, args):
    """The names of the protocol's runs that have not finished."""
    names = [run_name("tune", m, args.tune_seed, lr) for lr in args.lrs for m in METHODS]
    names += [f"ftune-{m}-seed{args.tune_seed}-lr{f:g}" for m in METHODS for f in args.ft_lrs]
    names.append("calibration")
    cal = store.get("calibration")
    for s in args.seeds:
        for budget in BUDGETS:
            for m in order_for(s):
                if budget == "wall" and m == "dense" and cal and cal["wall_steps"]["dense"] == p.steps:
                    continue
                names.append(run_name(budget, m, s))
    return [n for n in names if store.get(n) is None]


def fmt(s, digits=4):
    if s is None:
        return "-"
    return f"{s['mean']:.{digits}f} +- {s['std']:.{digits}f}"


def markdown(res):
    from timing import machine_line
    lines = ["# Quality at equal wall-clock and equal steps: dense, CoMERA, fixed TT ranks (CPU)", "",
             "Written by `benchmarks/bench_quality.py` (protocol in its docstring and in docs/pretrain.md).",
             "", f"Command: `{res['command']}`", ""]
    d = res.get("data")
    if d:
        lines += [f"Data: {d['train_files']} training files ({d['train_tokens']:,} tokens, vocabulary "
                  f"{d['vocab_size']}), {d['valid_files']} validation and {d['test_files']} test files "
                  f"held out ({d['valid_blocks']} and {d['test_blocks']} blocks scored; "
                  f"{d['test_masked_tokens']:,} masked test tokens); code search: {d['pairs']['train']} "
                  f"fine-tuning, {d['pairs']['valid']} validation and {d['pairs']['test']} test pairs. "
                  f"Unigram cross-entropy of the test labels under the training-token counts: "
                  f"**{d['unigram_ce_test']:.4f}** (training-token entropy {d['unigram_entropy_train']:.4f}).", ""]
    cal = res.get("calibration")
    if cal:
        lines += ["Equal wall-clock budget: " + ", ".join(
            f"{m} {cal['step_s_used'][m] * 1000:.1f} ms/step -> {cal['wall_steps'][m]} steps" for m in METHODS)
            + f" (budget {cal['wall_budget_s']:.0f} s; medians of {cal['timing']['dense']['reps']} interleaved "
              f"rounds of {cal['steps_per_timed_call']} steps; CoMERA: {cal['step_s']['comera'] * 1000:.1f} ms "
              f"at its starting ranks, {cal['step_s']['fixed'] * 1000:.1f} ms at its final size, weighted by "
              "the stage schedule).", "", machine_line(cal["machine"]), ""]
    lines += ["## Tuning (validation split, tuning seed)", "",
              "| method | valid MLM loss per lr | chosen lr | valid MRR per fine-tune lr | chosen fine-tune lr |",
              "|---|---|---|---|---|"]
    for m, t in res["tuning"].items():
        vl = ", ".join(f"{k}: {'-' if v is None else f'{v:.4f}'}" for k, v in t["valid_loss"].items())
        fm = ", ".join(f"{k}: {'-' if v is None else f'{v:.4f}'}" for k, v in t["ft_valid_mrr"].items())
        lines.append(f"| {m} | {vl} | {t.get('chosen_lr', '-')} | {fm} | {t.get('chosen_ft_lr', '-')} |")
    from common import edge_note, on_grid_edge
    edges = []
    for m, t in res["tuning"].items():
        for key, grid in (("chosen_lr", t["valid_loss"]), ("chosen_ft_lr", t["ft_valid_mrr"])):
            if key in t and on_grid_edge(t[key], [float(k) for k in grid]):
                edges.append(f"{m} {'fine-tune ' if key == 'chosen_ft_lr' else ''}({t[key]:g})")
    note = edge_note(edges)
    if note:
        lines += ["", note]
    lines += ["", "## Test results (mean +- std over the seeds that have finished)", "",
              "| budget | method | seeds | steps | test MLM loss | test MRR | tokens/s | encoder params | "
              "total params | TT params | peak memory growth (MB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for budget, b in res["budgets"].items():
        for m, e in b.items():
            mem = e["peak_memory_growth_bytes"]
            lines.append(
                f"| {budget} | {m} | {len(e['seeds'])} of {e['expected_seeds']} | "
                f"{'/'.join(map(str, sorted(set(e['steps']))))} | {fmt(e['test_loss'])} | {fmt(e['test_mrr'])} | "
                f"{e['tokens_per_s']['mean']:,.0f} | {e['encoder_params']['mean']:,.0f} | "
                f"{e['total_params']['mean']:,.0f} | {e['converted_tt']['mean']:,.0f} | "
                f"{mem['mean'] / 1e6:,.0f} |")
            if m == "fixed" and e.get("size_vs_comera"):
                lines[-1] = lines[-1][:-1] + f" (size vs CoMERA {e['size_vs_comera']['mean'] * 100:+.2f}%) |"
    lines += ["", "## Targets", ""]
    for t in res["targets"]:
        met = {True: "met", False: "**missed**", None: "not evaluated yet"}[t["met"]]
        lines.append(f"- {t['name']}: {met}" + (f" ({t['got']})" if t["got"] else ""))
    if res.get("pending"):
        lines += ["", "## Not finished yet", "",
                  f"{len(res['pending'])} runs remain: {', '.join(res['pending'])}.", "",
                  f"Resume (skips every finished run; `--commit` commits each run's JSON as it ends): "
                  f"`{res['command']} --commit`"]
    return "\n".join(lines) + "\n"


def plot(res, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    colors = {"dense": "k", "comera": "tab:blue", "fixed": "tab:orange"}
    for i, budget in enumerate(BUDGETS):
        ax = fig.add_subplot(1, 2, i + 1)
        for m, e in res["budgets"].get(budget, {}).items():
            for j, h in enumerate(e["histories"]):
                ax.plot(h["train_s"], h["valid"], color=colors[m], alpha=0.8, lw=1,
                        label=f"{m} (lr {e['lr']:g})" if j == 0 else None)
        if res.get("data"):
            ax.axhline(res["data"]["unigram_ce_valid"], color="grey", ls=":", lw=1, label="unigram")
        ax.set_xlabel("training time (s, measured; the machine is shared)")
        ax.set_ylabel("validation MLM loss")
        ax.set_title(f"equal {'wall-clock' if budget == 'wall' else 'steps'} (one line per seed)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(store, p, data, args, command):
    res = collect(store, p, args)
    res["command"] = command
    res["data"] = data["describe"] if data else None
    res["pending"] = pending(store, p, args)
    res["args"] = {k: v for k, v in vars(args).items() if k not in ("cache", "out")}
    res["args"]["runs_dir"] = os.path.relpath(args.runs_dir, REPO)
    res["preset"] = p.__dict__
    out_dir = args.out or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "quality_cpu" + args.tag)
    with open(base + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    with open(base + ".md", "w") as fh:
        fh.write(markdown(res))
    plot(res, base + ".png")
    return res


def commit_file(path, tries=5):
    """``git add`` and ``git commit`` of this one file (retried while another
    git command holds the index); returns whether the commit was made."""
    import subprocess
    for i in range(tries):
        add = subprocess.run(["git", "add", "--", path], cwd=REPO, capture_output=True, text=True)
        if add.returncode == 0:
            done = subprocess.run(["git", "commit", "-q", "-m",
                                   f"Quality benchmark: run {os.path.basename(path)[:-5]}", "--", path],
                                  cwd=REPO, capture_output=True, text=True)
            if done.returncode == 0:
                return True
        time.sleep(2 + 3 * i)
    print(f"could not commit {path}", flush=True)
    return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--steps", type=int, default=None, help="the equal-steps budget (default: the preset's)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--tune-seed", type=int, default=100)
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--tune-fraction", type=float, default=0.5)
    ap.add_argument("--ft-lrs", nargs="+", type=float, default=[3e-4, 1e-3, 3e-3, 1e-2])
    ap.add_argument("--ft-steps", type=int, default=2000)
    ap.add_argument("--ft-batch", type=int, default=32)
    ap.add_argument("--ft-max-train", type=int, default=20000)
    ap.add_argument("--doc-len", type=int, default=32)
    ap.add_argument("--code-len", type=int, default=64)
    ap.add_argument("--pool", type=int, default=1000)
    ap.add_argument("--heldout", type=float, default=0.2, help="share of the files held out (valid + test)")
    ap.add_argument("--eval-blocks", type=int, default=256)
    ap.add_argument("--evals", type=int, default=10, help="validation points per run (the curve)")
    ap.add_argument("--calib-reps", type=int, default=7)
    ap.add_argument("--corpus", default=None, help="default: the standard library")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs-dir", default=None,
                    help="where each finished run's JSON goes (default "
                         "benchmarks/results/quality_runs/<preset>-<steps>steps)")
    ap.add_argument("--cache", default=os.path.join(REPO, "runs", "bench-quality-cache"))
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--tag", default=None,
                    help="suffix of the result files (default: none at the preset's steps, "
                         "else _<steps>steps)")
    ap.add_argument("--report-only", action="store_true", help="write the report of the finished runs")
    ap.add_argument("--commit", action="store_true", help="git-commit each run's JSON as soon as it ends")
    ap.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = ap.parse_args(argv)
    from comera.pretrain.model import preset
    from timing import assert_threads
    p = preset("tiny" if args.quick else args.preset)
    if args.quick:
        for k, v in QUICK.items():
            if k != "preset":
                setattr(p, k, v)
        args.lrs, args.ft_lrs, args.seeds = args.lrs[:2], args.ft_lrs[:1], args.seeds[:2]
        args.ft_steps, args.ft_batch, args.pool, args.eval_blocks = 2, 4, 8, 4
        args.doc_len, args.code_len, args.calib_reps, args.evals, args.heldout = 8, 16, 3, 3, 0.25
        args.ft_max_train = 200
    if args.tag is None:
        args.tag = f"_{args.steps}steps" if args.steps and args.steps != p.steps else ""
    if args.steps:
        p.steps = args.steps
    if args.runs_dir is None:
        args.runs_dir = os.path.join(RESULTS, "quality_runs", f"{args.preset}-{p.steps}steps")
    assert_threads(args.threads)
    # the command that makes (or resumes) the result: without the report-only and commit switches
    flags = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--report-only", "--commit")]
    command = " ".join(["python benchmarks/bench_quality.py", *flags])
    store = Store(args.runs_dir, settings_key(p, args))
    if args.commit:
        store.on_write = commit_file
    log = lambda m: print(time.strftime("%H:%M:%S ") + m, flush=True)  # noqa: E731
    data = prepare_data(p, args, log)
    log(f"data: {json.dumps(data['describe'])}")
    if not args.report_only:
        protocol(p, data, store, args, log)
    res = report(store, p, data, args, command)
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
