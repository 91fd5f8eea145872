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
from comera.pretrain import processes
from comera.pretrain.corpus import DEFAULT_TEXT_FIELDS
from comera.pretrain.loop import METHODS, Budget, Options, train_method
from comera.storage import write_json

# Settings that change what a run computes: a resumed run must keep them.
RUN_KEYS = ("preset_name", "preset", "seed", "corpus", "max_files", "valid_fraction", "extensions",
            "text_fields")
# The value of a key that run directories written before it existed imply.
KEY_DEFAULTS = {"text_fields": list(DEFAULT_TEXT_FIELDS)}


def resolve_config(args) -> dict:
    """The run's settings: the preset with every flag that was given on top.

    Example:
        >>> from comera.__main__ import build_parser
        >>> args = build_parser().parse_args(["pretrain", "--preset", "paper", "--steps", "40"])
        >>> cfg = resolve_config(args)
        >>> cfg["preset"]["steps"], cfg["preset"]["hidden"], cfg["corpus"]
        (40, 768, None)
    """
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
            "extensions": list(args.extensions),
            "text_fields": list(getattr(args, "text_field", None) or DEFAULT_TEXT_FIELDS)}


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
        for k, v in KEY_DEFAULTS.items():
            saved.setdefault(k, v)
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
    write_json(os.path.join(out, "config.json"), config)
    return out


def pick_device(name: str) -> torch.device:
    """The device of a single-process run (see :func:`processes.pick_device`)."""
    return processes.pick_device(name)


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


def _quiet(message: str) -> None:
    pass


def _prepare(args, config: dict, p, methods, log) -> dict:
    """The main process's share before training: corpus (checked before the
    run directory exists), run directory, tokenizer and token streams, and
    the results of methods a resumed run already finished."""
    corpus = corpus_mod.load_corpus(config["corpus"], valid_fraction=config["valid_fraction"],
                                    seed=config["seed"], max_files=config["max_files"],
                                    extensions=config["extensions"],
                                    text_fields=config.get("text_fields", DEFAULT_TEXT_FIELDS))
    run_dir = prepare_run_dir(args, config)
    log(f"run directory: {run_dir}")
    info = corpus.describe()
    log(f"corpus: {corpus.root}: {info['train_files']} training / {info['valid_files']} validation "
        f"documents, skipped {sum(info['skipped'].values())} {info['skipped'] or ''}".rstrip())
    max_mb = p.tokenizer_max_mb
    tok, train_ids, valid_ids, tok_meta = tok_mod.load_or_build(
        run_dir, corpus, vocab_size=p.vocab_size, max_train_tokens=p.max_train_tokens,
        max_valid_tokens=p.valid_blocks * p.seq_len * 2,
        tokenizer_max_bytes=None if max_mb is None else int(max_mb * 1e6), resume=args.resume, log=log)
    finished = {}
    for method in methods:
        result_path = os.path.join(run_dir, method, "result.json")
        if args.resume and os.path.isfile(result_path):
            with open(result_path) as fh:
                previous = json.load(fh)
            if previous.get("steps_done", 0) >= p.steps:
                finished[method] = previous
    return {"run_dir": run_dir, "corpus": info, "train_ids": train_ids, "valid_ids": valid_ids,
            "vocab_size": tok.get_vocab_size(), "tokenizer": tok_meta, "finished": finished}


def run_pretrain(args, log=_log) -> dict:
    """Runs the whole job described by the parsed ``args``; returns the
    metrics written to ``metrics.json``.  Started by torchrun (or another
    launcher), every process runs it: the main one prepares the data and
    writes every file, the others train their share of each batch."""
    methods = list(METHODS) if args.method == "both" else [args.method]
    config = resolve_config(args)
    p = preset(args.preset)
    for k, v in config["preset"].items():
        setattr(p, k, v)
    grad_accum = getattr(args, "grad_accum", 1)
    ctx, device = processes.setup(args.device)
    try:
        processes.split_batch(p.batch_size, ctx.world, grad_accum)
        options = Options(ctx=ctx, precision=getattr(args, "precision", "fp32"), grad_accum=grad_accum,
                          compile=bool(getattr(args, "compile", False)),
                          fsdp=bool(getattr(args, "fsdp", False)), graph=getattr(args, "graph", None))
        options.graphed(device)  # validates --graph against the processes and --fsdp
        if options.fsdp and not ctx.enabled:
            raise ValueError("--fsdp shards the model over several processes: start the run with "
                             "torchrun (torchrun --nproc-per-node N -m comera pretrain --fsdp ...)")
        if options.fsdp and options.compile:
            raise ValueError("--fsdp and --compile cannot be combined yet")
        return _run(args, config, p, methods, device, options, log if ctx.main else _quiet)
    finally:
        ctx.close()


def _run(args, config, p, methods, device, options: Options, log) -> dict:
    import comera.pretrain.report  # noqa: F401 - fail now, not after training, without matplotlib
    ctx = options.ctx
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    set_determinism(device)
    started = time.time()
    prep = ctx.from_main(lambda: _prepare(args, config, p, methods, log))
    run_dir = prep["run_dir"]
    data = MLMData(prep["train_ids"], prep["valid_ids"], seq_len=p.seq_len, batch_size=p.batch_size,
                   vocab_size=prep["vocab_size"], valid_blocks=p.valid_blocks, seed=config["seed"])
    del prep["train_ids"], prep["valid_ids"]  # the blocks hold the tokens now
    log(f"data: {data.train.shape[0]:,} training blocks of {p.seq_len}, "
        f"{data.valid_inputs.shape[0]} validation blocks; device {device}, {torch.get_num_threads()} "
        f"threads, {ctx.world} process(es), {options.precision}, --grad-accum {options.grad_accum}"
        + (", compiled" if options.compile else "") + (", FSDP2" if options.fsdp else ""))

    deadline_total = None if args.max_minutes is None else started + 60.0 * args.max_minutes
    results = dict(prep["finished"])
    for method in results:
        log(f"{method}: already finished ({results[method]['steps_done']} steps)")
    with StopFlag(log) as stop:
        for i, method in enumerate(methods):
            if method in results:
                continue
            if ctx.any(stop.requested):
                break
            deadline = None
            if deadline_total is not None:
                # Share what is left of the budget among the methods still to run.
                deadline = time.time() + (deadline_total - time.time()) / (len(methods) - i)
            results[method] = r = train_method(
                method, p, data, run_dir, device=device, seed=config["seed"], resume=args.resume,
                budget=Budget(deadline, args.stop_after), stop=stop, progress=not args.quiet, log=log,
                options=options)
            if ctx.main:
                write_json(os.path.join(run_dir, method, "result.json"), r, indent=None)
            log(f"{method}: {r['stopped']} after {r['steps_done']} steps: valid loss {r['valid_loss']:.4f}, "
                f"{r['tokens_per_s']:,.0f} tokens/s, whole-model compression {r['compression_whole']:.2f}x")
        interrupted = ctx.any(stop.requested)
    metrics = {"interrupted": interrupted}
    if ctx.main:
        metrics.update(_write(run_dir, config, prep, data, results, methods, device, options))
        metrics["interrupted"] = interrupted
        log(f"report: {os.path.join(run_dir, 'report.md')}")
    ctx.barrier()  # every process ends after the files are written
    return metrics


def _write(run_dir, config, prep, data, results, methods, device, options: Options) -> dict:
    from comera.pretrain.report import write_report  # matplotlib is only needed here
    # Methods run earlier into this directory (e.g. one method at a time) join the report.
    for method in METHODS:
        path = os.path.join(run_dir, method, "result.json")
        if method not in results and os.path.isfile(path):
            with open(path) as fh:
                results[method] = json.load(fh)
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "threads": torch.get_num_threads(), "cpu_count": cpu_count(), "platform": platform.platform(),
           "processes": options.ctx.world, "backend": options.ctx.backend,
           "precision": options.precision, "grad_accum": options.grad_accum, "compile": options.compile,
           "fsdp": options.fsdp}
    return write_report(run_dir, config=config, corpus=prep["corpus"], tokenizer=prep["tokenizer"],
                        data=data.describe(), results=results, requested=methods, env=env)
