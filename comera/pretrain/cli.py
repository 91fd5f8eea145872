"""Command-line flags of ``comera pretrain``.  Every preset setting has a
flag; a flag that is not given keeps the preset's value."""
import argparse

from comera.pretrain.model import PRESETS


def _number(text: str, cast, ok, expected: str):
    """``cast(text)`` when ``ok`` of it holds, else argparse's error naming ``expected``."""
    try:
        v = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {v}")
    return v


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a positive number")


def _fraction(text: str) -> float:
    return _number(text, float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _nonneg_float(text: str) -> float:
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Adds the ``comera pretrain`` flags to ``ap``.

    Example:
        >>> ap = argparse.ArgumentParser()
        >>> add_arguments(ap)
        >>> a = ap.parse_args(["--method", "dense", "--rank", "8"])
        >>> a.method, a.rank, a.lr, a.preset, a.precision, a.grad_accum
        ('dense', 8, None, 'tiny', 'fp32', 1)
    """
    g = ap.add_argument_group("run")
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model size and training budget (default: tiny, a few minutes on 2 CPU cores)")
    g.add_argument("--method", default="both", choices=["dense", "comera", "both"],
                   help="train the dense model, its CoMERA (TT, rank-adaptive) version, or both (default)")
    g.add_argument("--out", default=None, help="run directory (default: a new folder under runs/)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out (default: the latest under runs/) from its checkpoints")
    g.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="stop cleanly after this many minutes in all (shared among the methods) "
                        "and write the report; --resume continues")
    g.add_argument("--stop-after", type=_positive_int, default=None,
                   help="stop each method cleanly after this many steps of this invocation")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda or cuda:N")
    g.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for torch")
    g.add_argument("--quiet", action="store_true", help="no progress bar")

    g = ap.add_argument_group("scale out (several processes: start with torchrun)")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: activations in bfloat16 autocast, parameters and optimizer state "
                        "stay float32 (default: fp32)")
    g.add_argument("--grad-accum", type=_positive_int, default=1,
                   help="micro-batches per optimizer step: each process computes its share of "
                        "--batch-size in this many pieces (same result, less memory; default 1)")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state over the processes with "
                        "FSDP2 (fully_shard on every TT layer, then the whole model) instead of "
                        "replicating them with DistributedDataParallel; needs torchrun")
    g.add_argument("--graph", default=None, action=argparse.BooleanOptionalAction,
                   help="capture each training step in one CUDA graph (forward, backward, AdamW "
                        "and the rank controller's gate step), replayed with new batches; default: "
                        "on for one process on CUDA, off otherwise")
    g.add_argument("--compile", action="store_true", help="torch.compile the encoder (the output layer, on the masked positions only, "
                        "stays eager)")

    g = ap.add_argument_group("corpus")
    g.add_argument("--corpus", default=None,
                   help="a folder (searched recursively), a file, or a glob such as 'src/**/*.py' "
                        "(default: the running Python's standard library); .jsonl, .jsonl.gz and "
                        ".parquet files hold one document per record (see --text-field)")
    g.add_argument("--extensions", nargs="+", default=[".py"],
                   help="file endings taken from a --corpus folder (default: .py)")
    g.add_argument("--text-field", nargs="+", default=None, metavar="FIELD",
                   help="the string field(s) of each .jsonl/.parquet record that make its document, "
                        "joined by a newline (default: text; CodeSearchNet: code)")
    g.add_argument("--max-files", type=_positive_int, default=None,
                   help="use a fixed, seeded subset of this many documents (files, or records)")
    g.add_argument("--valid-fraction", type=_fraction, default=0.05,
                   help="share of the files held out for validation (default 0.05)")
    g.add_argument("--vocab-size", type=_positive_int, default=None, help="BPE vocabulary (preset: 8192)")
    g.add_argument("--max-train-tokens", type=_positive_int, default=None,
                   help="encode only this many training tokens (preset: tiny 2M, others all)")
    g.add_argument("--tokenizer-max-mb", type=_positive_float, default=None,
                   help="train the tokenizer on at most this many MB of training files")

    g = ap.add_argument_group("model and optimisation (default: the preset's)")
    g.add_argument("--layers", type=_positive_int)
    g.add_argument("--hidden", type=_positive_int)
    g.add_argument("--heads", type=_positive_int)
    g.add_argument("--ffn", type=_positive_int)
    g.add_argument("--seq-len", type=_positive_int)
    g.add_argument("--dropout", type=_fraction)
    g.add_argument("--batch-size", type=_positive_int,
                   help="sequences per optimizer step over all processes (the global batch)")
    g.add_argument("--steps", type=_positive_int)
    g.add_argument("--lr", type=_positive_float, help="peak learning rate (dense)")
    g.add_argument("--lr-comera", type=_positive_float,
                   help="peak learning rate of the CoMERA method (default: the preset's, else --lr)")
    g.add_argument("--warmup", type=_fraction, help="fraction of the steps spent warming up")
    g.add_argument("--weight-decay", type=_nonneg_float)
    g.add_argument("--clip", type=_positive_float, help="gradient-norm clipping")
    g.add_argument("--eval-every", type=_positive_int)
    g.add_argument("--valid-blocks", type=_positive_int, help="validation sequences scored")
    g.add_argument("--checkpoint-every", type=_positive_int)
    g.add_argument("--log-every", type=_positive_int, help="steps between rank/compression records")

    g = ap.add_argument_group("CoMERA (default: the preset's)")
    g.add_argument("--rank", type=_positive_int, help="initial TT rank of the converted linear layers")
    g.add_argument("--vocab-rank", type=_positive_int,
                   help="initial TT rank of the word embedding and the output decoder")
    g.add_argument("--init", choices=["random", "svd"], help="TT initialisation for comera.convert")
    g.add_argument("--gamma", type=_nonneg_float,
                   help="stage-1 L1 strength on the TT gates: a gate entry loses lr * gamma per step "
                        "(balanced gates lie in [0, 1]; keep it below 1 under AdamW)")
    g.add_argument("--threshold", type=_nonneg_float, help="gate entries below this die")
    g.add_argument("--stage1", type=_fraction, help="fraction of the steps in stage 1")
    g.add_argument("--stage2", type=_fraction, help="fraction of the steps in stage 2")
    g.add_argument("--target-compression", type=_positive_float,
                   help="stage 2 target: compression of the converted layers (dense / TT params)")
    g.add_argument("--prune-every", type=_positive_int, help="steps between physical rank pruning")
    g.add_argument("--stage2-rule", choices=["saliency", "magnitude"],
                   help="how stage 2 picks the ranks to remove: running |g dL/dg| (saliency) "
                        "or |g| times slice norms (magnitude)")


def run(args) -> int:
    """Runs ``comera pretrain``; returns the process exit status."""
    from comera.pretrain.pipeline import run_pretrain
    metrics = run_pretrain(args)
    return 130 if metrics.get("interrupted") else 0
