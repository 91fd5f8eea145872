"""The tiny `comera pretrain` command line of the pretrain tests: one layer,
hidden 32, sequence 32, vocabulary 300, so a run takes a second or two.

Example:
    >>> args = tiny_args(batch_size=8)
    >>> args[args.index("--batch-size") + 1]
    '8'
"""
import os
import sysconfig

STDLIB = sysconfig.get_paths()["stdlib"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_args(batch_size: int = 4, valid_blocks: int = 4, eval_every: int = 3,
              checkpoint_every: int = 2) -> list:
    """The tiny model's arguments, quiet, one thread, a quarter of the files
    held out for validation."""
    return ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--seq-len", "32",
            "--batch-size", str(batch_size), "--vocab-size", "300",
            "--valid-blocks", str(valid_blocks), "--eval-every", str(eval_every),
            "--checkpoint-every", str(checkpoint_every), "--log-every", "1",
            "--valid-fraction", "0.25", "--quiet", "--threads", "1"]
