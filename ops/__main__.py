"""Command-line entry point of `edgellmctl`: one subcommand per operator task."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from edgellmctl import __version__, admin, bench, doctor, keys, ledger, lock, quickstart
from edgellmctl.cli import Parser


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every subcommand registered."""
    # Parser: options by their full names only, and errors that never show a secret; every
    # subcommand's parser is a Parser too.
    parser = Parser(prog="edgellmctl", description="Operate an edgellm appliance.")
    parser.add_argument("--version", action="version", version=f"edgellmctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each module registers its own subcommand and sets `func` to its runner.
    quickstart.add_parser(sub)
    lock.add_parser(sub)
    keys.add_parser(sub)
    bench.add_parser(sub)
    admin.add_parsers(sub)
    ledger.add_parsers(sub)
    doctor.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `edgellmctl` and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
