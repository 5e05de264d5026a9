"""Helpers every `edgellmctl` subcommand shares: argument types and user-facing error handling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

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


def http_url(text: str) -> str:
    """argparse type: a server base URL (http or https, a host, no credentials, query or fragment)."""
    # Messages name what is wrong without echoing the text: it may hold a password. The parser
    # refuses credentials in the URL, so reports may show it.
    try:
        parts = urlsplit(text)
        _ = parts.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError:
        raise argparse.ArgumentTypeError("not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError("must be an http:// or https:// URL with a host, "
                                         "e.g. http://127.0.0.1:8080")
    if parts.username is not None or parts.password is not None:
        raise argparse.ArgumentTypeError("must not carry credentials; pass the key with --key")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError("must be the server's base URL, without a query or fragment")
    return text
