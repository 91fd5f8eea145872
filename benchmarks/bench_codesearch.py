"""Code search MRR, CodeSearchNet protocol, from a `comera pretrain` run:
dense against CoMERA encoders after the same short contrastive fine-tune.

Data: (docstring summary, code without its docstring) pairs of the
documented functions (code_docstring.functions_in_file) in the run's own
corpus, split by file: the test pairs come from the files that the run held
out of pre-training (its validation split); the fine-tuning pairs from its
training files, of which 1 in 8 (the first by a hash of the path) is kept apart
as the validation split the learning rate is chosen on.

Protocol (benchmarks/README.md, "How we tune"): each encoder (the run's
final dense and CoMERA checkpoints; CoMERA's ranks stay as pre-training left
them) is fine-tuned for --steps steps with the symmetric in-batch InfoNCE
loss on mean-pooled, L2-normalised embeddings (scale 20), AdamW, 6% warm-up
and linear decay.  Each encoder picks its peak learning rate from the same
grid (--lr-grid) by validation MRR with the first seed; then the test split
is scored once per seed (--seeds) at the chosen rate.  MRR: the test pairs,
shuffled once, are cut into pools of --pool pairs (1 true + 999 distractors
by default; the remainder is scored against the last --pool pairs, so every
test pair is a query once); each docstring ranks its own code among the
pool's codes.

    python benchmarks/bench_codesearch.py --run runs/RUN     # a finished `--method both` run
    python benchmarks/bench_codesearch.py                    # runs `comera pretrain` (tiny) first
    python benchmarks/bench_codesearch.py --quick            # tiny everything (smoke test)

Writes benchmarks/results/codesearch_cpu.{json,md} (codesearch_cpu_quick.*
with --quick) with the machine record.
"""
import argparse
import hashlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
METHODS = ["dense", "comera"]
SCALE = 20.0  # fixed inverse temperature of the cosine similarities


def held_out_pairs(run_dir):
    """(train, valid, test) lists of (doc, code) pairs from the run's corpus,
    split as described in the module docstring."""
    from comera.pretrain import corpus as corpus_mod
    from code_docstring import functions_in_file
    with open(os.path.join(run_dir, "config.json")) as fh:
        cfg = json.load(fh)
    corpus = corpus_mod.load_corpus(cfg["corpus"], valid_fraction=cfg["valid_fraction"], seed=cfg["seed"],
                                    max_files=cfg["max_files"], extensions=cfg["extensions"])
    # 1 in 8 of the training files (at least one), ranked by a hash of the path
    ranked = sorted((rel for rel, _ in corpus.train),
                    key=lambda rel: hashlib.sha1(("valid:" + rel).encode()).hexdigest())
    valid_files = set(ranked[: max(1, len(ranked) // 8)])
    splits = {"train": [], "valid": [], "test": []}
    for part, files in (("train", corpus.train), ("test", corpus.valid)):
        for rel, _ in files:
            name = "valid" if rel in valid_files else part
            splits[name] += functions_in_file(os.path.join(corpus.root, rel))
    return splits["train"], splits["valid"], splits["test"]


def load_encoder(run_dir, method):
    """The run's final `method` model (its checkpoint), as an encoder."""
    from comera import storage
    from comera.pretrain.model import Preset, build_comera, build_dense
    state = storage.load_training_state(os.path.join(run_dir, method, "checkpoint.pt"))
    p = Preset(**state["preset"])
    with open(os.path.join(run_dir, "tokenizer_meta.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    model = (build_comera if method == "comera" else build_dense)(p, vocab, 0)
    storage.load_state_dict(model, state["model"])
    return model.roberta, p


def encode(tok, texts, length):
    """Token ids (N, length) with <s> ... </s>, padded; and the padding mask."""
    from comera.pretrain.tokenizer import BOS, EOS, PAD
    ids = torch.full((len(texts), length), PAD, dtype=torch.long)
    for i, t in enumerate(texts):
        row = [BOS] + tok.encode(t).ids[: length - 2] + [EOS]
        ids[i, : len(row)] = torch.tensor(row)
    return ids


def embed(encoder, ids):
    """Mean over the non-padding tokens of the last hidden state, L2-normalised."""
    from comera.pretrain.tokenizer import PAD
    mask = ids != PAD
    h = encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    m = mask.unsqueeze(-1).to(h.dtype)
    return F.normalize((h * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1)


def pools(n, pool, seed=0):
    """Pools of at most ``pool`` pairs covering every one of ``n`` pairs once
    as a query: after one seeded shuffle, consecutive slices of ``pool``; the
    remainder is scored against the last ``pool`` pairs of the shuffle (so it
    too meets ``pool - 1`` distractors).  Returns ``[(pool indices, indices
    within the pool that are queries)]``.

    Example:
        >>> [(len(idx), q.tolist()) for idx, q in pools(5, 2)]
        [(2, [0, 1]), (2, [0, 1]), (2, [1])]
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if n <= pool:
        return [(perm, torch.arange(n))]
    out = [(perm[k:k + pool], torch.arange(pool)) for k in range(0, n - pool + 1, pool)]
    rest = n % pool
    if rest:
        out.append((perm[n - pool:], torch.arange(pool - rest, pool)))
    return out


@torch.no_grad()
def mrr(encoder, docs, codes, pool, seed=0, batch=128):
    """Mean reciprocal rank of each doc's own code among the codes of its
    pool: every pair is a query once, against ``pool - 1`` distractors
    (:func:`pools`; fewer only when there are fewer pairs).

    Example:
        >>> class Same(torch.nn.Module):  # an encoder that embeds ids as one-hot rows
        ...     def forward(self, input_ids, attention_mask):
        ...         return type("O", (), {"last_hidden_state": F.one_hot(input_ids, 16).float()})()
        >>> ids = torch.tensor([[5, 1], [6, 1], [7, 1]])
        >>> mrr(Same(), ids, ids, pool=2)
        {'mrr': 1.0, 'pool': 2, 'queries': 3}
    """
    encoder.eval()
    u = torch.cat([embed(encoder, docs[i:i + batch]) for i in range(0, len(docs), batch)])
    v = torch.cat([embed(encoder, codes[i:i + batch]) for i in range(0, len(codes), batch)])
    encoder.train()
    rr = []
    for idx, queries in pools(len(u), pool, seed):
        s = u[idx[queries]] @ v[idx].T
        true = s.gather(1, queries.unsqueeze(1))
        rank = (s > true).sum(1) + 1  # ties count in the doc's favour
        rr += (1.0 / rank.double()).tolist()
    return {"mrr": float(statistics.fmean(rr)), "pool": int(min(pool, len(u))), "queries": len(rr)}


def fine_tune(encoder, data, lr, seed, args):
    """args.steps steps of in-batch InfoNCE; returns (encoder, seconds)."""
    from bench_accuracy import lr_at
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    opt = torch.optim.AdamW(encoder.parameters(), lr=lr, weight_decay=0.01)
    n, t0 = data["docs"].shape[0], time.perf_counter()
    encoder.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, lr, warmup_frac=0.06, floor=0.0)
        idx = torch.randperm(n, generator=g)[: args.batch]  # distinct pairs: one positive each
        u, v = embed(encoder, data["docs"][idx]), embed(encoder, data["codes"][idx])
        s = SCALE * u @ v.T
        target = torch.arange(len(idx))
        loss = 0.5 * (F.cross_entropy(s, target) + F.cross_entropy(s.T, target))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
        opt.step()
    return encoder, time.perf_counter() - t0


def tensors(tok, pairs, args, cap, seed):
    """The encoded docs and codes of at most `cap` pairs (a seeded sample)."""
    if cap is not None and len(pairs) > cap:
        keep = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))[:cap]
        pairs = [pairs[i] for i in sorted(keep.tolist())]
    return {"docs": encode(tok, [d for d, _ in pairs], args.doc_len),
            "codes": encode(tok, [c for _, c in pairs], args.code_len)}


def evaluate_method(run_dir, method, data, args):
    """Learning-rate choice on validation (first seed), then test MRR per
    seed at the chosen rate.  Returns the method's record."""
    grid = []
    for lr in args.lr_grid:
        enc, secs = fine_tune(load_encoder(run_dir, method)[0], data["train"], lr, args.seeds[0], args)
        grid.append({"lr": lr, "valid": mrr(enc, **data["valid"], pool=args.pool), "seconds": secs})
        print(json.dumps({"method": method, **grid[-1]}), flush=True)
    best = max(grid, key=lambda g: g["valid"]["mrr"])
    encoder, _ = load_encoder(run_dir, method)
    params = sum(p.numel() for p in encoder.parameters())
    zero_shot = mrr(encoder, **data["test"], pool=args.pool)
    seeds = []
    for seed in args.seeds:
        enc, secs = fine_tune(load_encoder(run_dir, method)[0], data["train"], best["lr"], seed, args)
        seeds.append({"seed": seed, "test": mrr(enc, **data["test"], pool=args.pool), "seconds": secs})
        print(json.dumps({"method": method, **seeds[-1]}), flush=True)
    vals = [s["test"]["mrr"] for s in seeds]
    return {"grid": grid, "chosen_lr": best["lr"], "encoder_params": params,
            "zero_shot_test": zero_shot, "per_seed": seeds,
            "test_mrr": {"mean": statistics.fmean(vals),
                         "std": statistics.stdev(vals) if len(vals) > 1 else 0.0}}


def pretrain_first(args):
    """Runs `comera pretrain --method both` (tiny preset; tinier with
    --quick) and returns (its run directory, relative to the repository or
    as given, the command)."""
    import bench_pretrain
    out = os.path.join(args.runs_dir, f"codesearch-{time.strftime('%Y%m%d-%H%M%S')}")
    extra = (["--max-files", "60", "--valid-fraction", "0.25", "--max-train-tokens", "20000",
              "--tokenizer-max-mb", "0.3", "--eval-every", "3", "--valid-blocks", "4"]
             if args.quick else [])
    metrics = bench_pretrain.run("tiny", 6 if args.quick else None, 0, args.threads, out, extra)
    return out, metrics["command"]


def markdown(p, args):
    from timing import machine_line
    d = p["data"]
    md = ["# Code search MRR: dense against CoMERA encoders (CodeSearchNet protocol)\n",
          f"Encoders: the final checkpoints of `{p['pretrain_command']}` (run `{p['run']}`). Pairs: (docstring summary, "
          f"code) of documented functions in that run's corpus: {d['train']} fine-tuning and "
          f"{d['valid']} validation pairs from its training files (split by file), {d['test']} test "
          "pairs from the files it held out of pre-training. Each encoder: "
          f"{args.steps} steps of in-batch InfoNCE (batch {args.batch}, scale {SCALE:g}, AdamW), "
          f"peak learning rate chosen from the same grid ({', '.join(f'{x:g}' for x in args.lr_grid)}) "
          f"by validation MRR with seed {args.seeds[0]}, then test MRR once per seed "
          f"({', '.join(map(str, args.seeds))}): mean +- standard deviation. Each query ranks its "
          f"code among the {p['methods']['dense']['zero_shot_test']['pool']} codes of its pool "
          "(1 true + the rest distractors)" + (
              f"; {args.pool} were asked, the held-out split has fewer pairs" if
              p["methods"]["dense"]["zero_shot_test"]["pool"] < args.pool else "") + ".\n",
          "| encoder | encoder params | chosen lr | validation MRR (chosen) | test MRR | test MRR "
          "before fine-tuning |", "|---|---|---|---|---|---|"]
    for m, r in p["methods"].items():
        chosen = next(g for g in r["grid"] if g["lr"] == r["chosen_lr"])
        md.append(f"| {m} | {r['encoder_params']:,} | {r['chosen_lr']:g} | {chosen['valid']['mrr']:.4f} | "
                  f"{r['test_mrr']['mean']:.4f} +- {r['test_mrr']['std']:.4f} | "
                  f"{r['zero_shot_test']['mrr']:.4f} |")
    dn, cm = p["methods"]["dense"], p["methods"]["comera"]
    md.append(f"\nEncoder compression (dense over CoMERA encoder parameters): "
              f"{dn['encoder_params'] / cm['encoder_params']:.2f}x.\n")
    md.append(machine_line(p["machine"]))
    md.append(f"\nReproduce: `python benchmarks/bench_codesearch.py {p['flags']}`.\n")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=None, help="a finished `comera pretrain --method both` run directory")
    ap.add_argument("--quick", action="store_true", help="tiny pre-training and fine-tune (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="fine-tuning steps (same for both)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--lr-grid", type=float, nargs="+", default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pool", type=int, default=None, help="pairs per MRR pool (1 true + pool-1 distractors)")
    ap.add_argument("--doc-len", type=int, default=None)
    ap.add_argument("--code-len", type=int, default=None)
    ap.add_argument("--max-train", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs-dir", default="runs", help="where a fresh pre-training run goes")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    q = args.quick
    for k, v in {"steps": 4 if q else 200, "batch": 8 if q else 32, "pool": 8 if q else 1000,
                 "lr_grid": [1e-4, 1e-3] if q else [1e-4, 3e-4, 1e-3], "doc_len": 16 if q else 32,
                 "code_len": 32 if q else 64}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds must be distinct, got {args.seeds}")
    if args.pool < 2:
        ap.error(f"--pool must be >= 2 (1 true + distractors), got {args.pool}")
    sys.path.insert(0, REPO)
    from timing import assert_threads, finish_record, machine_record
    assert_threads(args.threads)
    machine = machine_record(measure=not q)
    if args.run:
        run_dir, command = args.run, None
    else:
        run_dir, command = pretrain_first(args)
    run_path = run_dir if os.path.isabs(run_dir) else os.path.join(REPO, run_dir)
    for m in METHODS:
        if not os.path.isfile(os.path.join(run_path, m, "checkpoint.pt")):
            raise ValueError(f"--run: {run_dir} has no {m}/checkpoint.pt; expected a finished "
                             "`comera pretrain --method both` run")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(run_path, "tokenizer.json"))
    train, valid, test = held_out_pairs(run_path)
    if min(len(train), len(valid), len(test)) < 2:
        raise ValueError(f"{run_dir}: {len(train)} training, {len(valid)} validation and {len(test)} test "
                         "pairs; expected at least 2 of each (a larger corpus or --valid-fraction)")
    data = {"train": tensors(tok, train, args, args.max_train, 0),
            "valid": tensors(tok, valid, args, 1000, 1), "test": tensors(tok, test, args, None, 2)}
    with open(os.path.join(run_path, "metrics.json")) as fh:
        pre = json.load(fh)
    if command is None:  # an existing run: describe it from its own config
        with open(os.path.join(run_path, "config.json")) as fh:
            c = json.load(fh)
        command = (f"comera pretrain --method both --preset {c['preset_name']} --seed {c['seed']} "
                   f"--steps {c['preset']['steps']}")
        if c.get("valid_fraction", 0.05) != 0.05:  # the held-out split the test pairs come from
            command += f" --valid-fraction {c['valid_fraction']}"
    p = {"machine": machine, "run": os.path.basename(run_dir.rstrip(os.sep)), "pretrain_command": command,
         "pretrain_steps": {m: pre["methods"][m]["steps_done"] for m in METHODS},
         "data": {"train": len(train), "valid": len(valid), "test": len(test)},
         "methods": {m: evaluate_method(run_path, m, data, args) for m in METHODS}}
    finish_record(machine)
    p["flags"] = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                          for k, v in sorted(vars(args).items())
                          if k not in ("quick", "out", "runs_dir", "run") and v is not None)
    p["flags"] = ("--quick " if q else "") + (f"--run runs/{p['run']} " if args.run else "") + p["flags"]
    from common import write_results
    write_results("codesearch_cpu" + ("_quick" if q else ""), p, markdown(p, args), out_dir=args.out)
    return p


if __name__ == "__main__":
    main()
