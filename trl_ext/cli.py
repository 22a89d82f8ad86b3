"""The `trl-ext` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trl_ext import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-ext",
        description="Stepwise RLM training, judge credit, the IPO loss and monitors on top of Hugging Face TRL.",
    )
    parser.add_argument("--version", action="version", version=f"trl-ext {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
