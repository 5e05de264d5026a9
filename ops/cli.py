"""Helpers every `edgellmctl` subcommand shares: argument types and user-facing error handling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user-facing failure: printed without a traceback, exit status 1."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


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
