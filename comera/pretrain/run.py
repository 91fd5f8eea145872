"""``comera pretrain``: corpus -> tokenizer -> dense and/or CoMERA training
-> report, all in one run directory that ``--resume`` continues."""
import json
import os
import platform
import time
from dataclasses import asdict
from typing import Optional

import torch

from comera.pretrain import corpus as corpus_mod
from comera.pretrain import tokenizer as tok_mod
from comera.pretrain.data import MLMData
from comera.pretrain.model import preset, preset_fields
from comera.pretrain.monitor import StopFlag, cpu_count
from comera.pretrain.train import METHODS, Budget, train_method

# Settings that change what a run computes: a resumed run must keep them.
RUN_KEYS = ("preset_name", "preset", "seed", "corpus", "max_files", "valid_fraction", "extensions")


def resolve_config(args) -> dict:
    """The run's settings: the preset with every flag that was given on top."""
    p = preset(args.preset)
    for name in preset_fields():
        value = getattr(args, name, None)
        if value is not None:
            setattr(p, name, value)
    if p.eval_every < 1 or p.checkpoint_every < 1 or p.log_every < 1 or p.steps < 1:
        raise ValueError("--steps, --eval-every, --checkpoint-every and --log-every must be >= 1")
    if not 0 <= p.stage1 <= 1 or not 0 <= p.stage2 <= 1 or p.stage1 + p.stage2 > 1:
        raise ValueError(f"--stage1 and --stage2 are fractions of the steps with a sum <= 1, "
                         f"got {p.stage1} and {p.stage2}")
    if not 0 <= p.warmup < 1:
        raise ValueError(f"--warmup is a fraction of the steps in [0, 1), got {p.warmup}")
    corpus = None if args.corpus is None else args.corpus
    return {"preset_name": args.preset, "preset": asdict(p), "seed": args.seed, "corpus": corpus,
            "max_files": args.max_files, "valid_fraction": args.valid_fraction,
            "extensions": list(args.extensions)}


def _new_run_dir(base: str = "runs") -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, i = os.path.join(base, f"pretrain-{stamp}"), 1
    while os.path.exists(path):
        i += 1
        path = os.path.join(base, f"pretrain-{stamp}-{i}")
    return path


def _latest_run(base: str = "runs") -> str:
    runs = [os.path.join(base, d) for d in os.listdir(base)] if os.path.isdir(base) else []
    runs = [d for d in runs if os.path.isfile(os.path.join(d, "config.json"))]
    if not runs:
        raise ValueError(f"--resume without --out: no run directory with a config.json under {base}/")
    return max(runs, key=os.path.getmtime)


def prepare_run_dir(args, config: dict) -> str:
    """Creates (or, with --resume, checks) the run directory."""
    out = args.out
    if args.resume:
        out = out or _latest_run()
        cfg_path = os.path.join(out, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"--resume: {out!r} is not a run directory (no config.json)")
        with open(cfg_path) as fh:
            saved = json.load(fh)
        diff = [k for k in RUN_KEYS if saved.get(k) != config.get(k)]
        if diff:
            details = []
            for k in diff:
                if k == "preset":
                    details += [f"{f}: {saved[k].get(f)} -> {config[k].get(f)}"
                                for f in config[k] if saved[k].get(f) != config[k].get(f)]
                else:
                    details.append(f"{k}: {saved.get(k)!r} -> {config.get(k)!r}")
            raise ValueError(f"--resume: the settings differ from the run in {out!r} "
                             f"({'; '.join(details)}); resume with the original flags")
        return out
    out = out or _new_run_dir()
    if os.path.isfile(os.path.join(out, "config.json")):
        raise ValueError(f"--out {out!r} already holds a run: pass --resume to continue it, "
                         "or choose another --out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    return out


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return dev


def set_determinism(device: torch.device) -> None:
    # cuBLAS needs a fixed workspace to be deterministic; this must be set
    # before the first cuBLAS call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op without a deterministic kernel warns instead of
    # stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False


def _log(message: str) -> None:
    # Flushed, so that a log file shows progress while the run goes on.
    print(message, flush=True)


def run_pretrain(args, log=_log) -> dict:
    """Runs the whole job described by the parsed ``args``; returns the
    metrics written to ``metrics.json``."""
    from comera.pretrain.report import write_report  # matplotlib is only needed here

    methods = list(METHODS) if args.method == "both" else [args.method]
    config = resolve_config(args)
    p = preset(args.preset)
    for k, v in config["preset"].items():
        setattr(p, k, v)
    device = pick_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    set_determinism(device)
    corpus = corpus_mod.load_corpus(config["corpus"], valid_fraction=config["valid_fraction"],
                                    seed=config["seed"], max_files=config["max_files"],
                                    extensions=config["extensions"])
    run_dir = prepare_run_dir(args, config)
    started = time.time()
    log(f"run directory: {run_dir}")
    info = corpus.describe()
    log(f"corpus: {corpus.root}: {info['train_files']} training / {info['valid_files']} validation "
        f"files, skipped {sum(info['skipped'].values())} {info['skipped'] or ''}".rstrip())
    max_mb = p.tokenizer_max_mb
    tok, train_ids, valid_ids, tok_meta = tok_mod.load_or_build(
        run_dir, corpus, vocab_size=p.vocab_size, max_train_tokens=p.max_train_tokens,
        max_valid_tokens=p.valid_blocks * p.seq_len * 2,
        tokenizer_max_bytes=None if max_mb is None else int(max_mb * 1e6), resume=args.resume, log=log)
    del corpus  # the texts are tokenized; keep their memory out of the measurements
    data = MLMData(train_ids, valid_ids, seq_len=p.seq_len, batch_size=p.batch_size,
                   vocab_size=tok.get_vocab_size(), valid_blocks=p.valid_blocks, seed=config["seed"])
    log(f"data: {train_ids.numel():,} training tokens in {data.train.shape[0]:,} blocks of {p.seq_len}, "
        f"{data.valid_inputs.shape[0]} validation blocks; device {device}, {torch.get_num_threads()} threads")

    deadline_total = None if args.max_minutes is None else started + 60.0 * args.max_minutes
    results = {}
    with StopFlag(log) as stop:
        for i, method in enumerate(methods):
            result_path = os.path.join(run_dir, method, "result.json")
            if args.resume and os.path.isfile(result_path):
                with open(result_path) as fh:
                    previous = json.load(fh)
                if previous.get("steps_done", 0) >= p.steps:
                    log(f"{method}: already finished ({previous['steps_done']} steps)")
                    results[method] = previous
                    continue
            if stop.requested:
                break
            deadline = None
            if deadline_total is not None:
                # Share what is left of the budget among the methods still to run.
                deadline = time.time() + (deadline_total - time.time()) / (len(methods) - i)
            results[method] = train_method(
                method, p, data, run_dir, device=device, seed=config["seed"], resume=args.resume,
                budget=Budget(deadline, args.stop_after), stop=stop, progress=not args.quiet, log=log)
            with open(result_path, "w") as fh:
                json.dump(results[method], fh)
            r = results[method]
            log(f"{method}: {r['stopped']} after {r['steps_done']} steps: valid loss {r['valid_loss']:.4f}, "
                f"{r['tokens_per_s']:,.0f} tokens/s, whole-model compression {r['compression_whole']:.2f}x")
        interrupted = stop.requested
    # Methods run earlier into this directory (e.g. one method at a time) join the report.
    for method in METHODS:
        path = os.path.join(run_dir, method, "result.json")
        if method not in results and os.path.isfile(path):
            with open(path) as fh:
                results[method] = json.load(fh)
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "threads": torch.get_num_threads(), "cpu_count": cpu_count(), "platform": platform.platform()}
    metrics = write_report(run_dir, config=config, corpus=info, tokenizer=tok_meta, data=data.describe(),
                           results=results, requested=methods, env=env)
    log(f"report: {os.path.join(run_dir, 'report.md')}")
    metrics["interrupted"] = interrupted
    return metrics
