"""The ``comera`` command line: ``comera pretrain ...`` (also
``python -m comera pretrain ...``).

Example:
    $ comera pretrain --method both          # the tiny preset on the standard library
    $ comera pretrain --preset paper --steps 200 --out runs/paper
"""
import argparse
import sys

from comera.pretrain.cli import add_arguments, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="comera", description="comera command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    pre = sub.add_parser("pretrain", help="CodeBERT-style MLM pre-training, dense against CoMERA",
                         description="Masked-language-model pre-training of a RoBERTa encoder on "
                                     "Python source (by default the standard library), dense and/or "
                                     "CoMERA; writes report.md, metrics.json and plots.")
    add_arguments(pre)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "pretrain":
        try:
            return run(args)
        except (ValueError, ImportError) as e:
            print(f"comera pretrain: error: {e}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
