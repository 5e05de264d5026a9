"""Helpers every `edgellmctl` subcommand shares: argument types and user-facing error handling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user-facing failure: printed without a traceback, exit status 1."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)


def guarded(func: Command, *expected: type[Exception]) -> Command:
    """Run `func`; CommandError, the `expected` errors and OSError become one line and exit 1."""
    handled: tuple[type[Exception], ...] = (CommandError, *expected)

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except handled as exc:
            print(f"edgellmctl {args.command}: {exc}", file=sys.stderr)
        except OSError as exc:
            print(f"edgellmctl {args.command}: {exc.filename or ''}: {exc.strerror}", file=sys.stderr)
        return 1

    return run
