"""Helpers every `edgellmctl` subcommand shares: the parser, argument types, keys and error handling."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, NoReturn, TypeAlias
from urllib.parse import urlsplit

from edgellmd.errors import escaped
from edgellmd.files import UnsuitableFile, read_regular

Command = Callable[[argparse.Namespace], int]

MAX_KEY_FILE_BYTES: Final = 4096  # a token is under 200 characters
# The shape of an edgellm API token, also cut short or glued to other text.
_TOKEN_LIKE: Final = re.compile(r"elk_[0-9a-f]{12}_[A-Za-z0-9_-]*")
HIDDEN_TOKEN: Final = "elk_(hidden)"  # noqa: S105 - what a token is replaced with, not a secret
HIDDEN_VALUE: Final = "..."
_OPTION_NAME: Final = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*")
_UNRECOGNIZED: Final = "unrecognized arguments: "
_LINE_BREAKS: Final = re.compile(r"\s*[\r\n]+\s*")


class CommandError(Exception):
    """A user-facing failure: printed without a traceback, exit status 1."""


def redact(message: str) -> str:
    """`message` without anything that may be a secret: API tokens, and values argparse did not take.

    argparse's "unrecognized arguments: ..." repeats the words it did not take, and a word
    after an unknown option is its value (`--key elk_...`): only option names are kept.
    """
    head, found, rest = message.partition(_UNRECOGNIZED)
    if found:
        words = []
        for word in rest.split(" "):
            name = word.split("=", 1)[0]
            words.append(name if _OPTION_NAME.fullmatch(name) else HIDDEN_VALUE)
        message = head + found + " ".join(words)
        if HIDDEN_VALUE in words or "=" in rest:
            message += " (values are not shown)"
    return _TOKEN_LIKE.sub(HIDDEN_TOKEN, message)


class Parser(argparse.ArgumentParser):
    """edgellmctl's argument parser: options by their full names only, errors that never show a secret.

    Subparsers are of this class too (argparse makes them of their parent's class).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Prefix matching took `status --key K` for `--key-file K` (and printed K when the
        # "file" could not be read): an option is taken only by its full name, everywhere.
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print the usage and the redacted message; exit status 2."""
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {redact(message)}\n")


# What each module's add_parser() registers its subcommands on.
Subcommands: TypeAlias = "argparse._SubParsersAction[Parser]"


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


def int_between(minimum: int, maximum: int) -> Callable[[str], int]:
    """argparse type: an integer in `minimum`..`maximum`."""
    expected = f"must be an integer in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{expected}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
port_number = int_between(1, 65535)


def one_line(message: str) -> str:
    """`message` on one line: line breaks (a YAML error's context, say) become spaces."""
    return _LINE_BREAKS.sub(" ", message).strip()


def describe_os_error(exc: OSError) -> str:
    """An OSError as "<file>: <reason>", or the reason alone when no file is known."""
    if isinstance(exc, UnsuitableFile):
        return str(exc)
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def guarded(func: Command, *expected: type[Exception]) -> Command:
    """Run `func`; CommandError, the `expected` errors and OSError become one line and exit 1."""
    handled: tuple[type[Exception], ...] = (CommandError, *expected)

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except handled as exc:
            message = str(exc)
        except OSError as exc:
            message = describe_os_error(exc)
        # Escaped: a message may carry a daemon's answer or a file's words (its controls inert).
        print(redact(f"edgellmctl {args.command}: {escaped(one_line(message))}"), file=sys.stderr)
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
        raise argparse.ArgumentTypeError(
            "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8080"
        )
    if parts.username is not None or parts.password is not None:
        raise argparse.ArgumentTypeError("must not carry credentials; pass the key with --key-file")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError("must be the server's base URL, without a query or fragment")
    return text


def add_key_options(p: argparse.ArgumentParser, *, what: str, file_env: str, env: str) -> None:
    """`--key-file FILE`: how every command that talks to a server takes its key.

    Never the key itself on the command line: argv shows in `ps` and in shell history.
    """
    p.add_argument(
        "--key-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the {what} (default: the file named by ${file_env}, else ${env})",
    )


def read_key(key_file: Path | None, *, what: str, file_env: str, env: str) -> str | None:
    """The key from `key_file`, else from the file $`file_env` names, else $`env`; None when none is given.

    CommandError (one line, never the key) for a file that cannot be read or a key that
    cannot travel in an HTTP header.
    """
    path = key_file or os.environ.get(file_env) or None
    if path is not None:
        try:
            data = read_regular(path, MAX_KEY_FILE_BYTES)
        except UnsuitableFile as exc:
            raise CommandError(f"the {what} file {exc}") from None
        except OSError as exc:
            raise CommandError(f"cannot read the {what} file {path}: {exc.strerror}") from None
        try:
            key = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CommandError(f"the {what} file {path} is not UTF-8 text") from None
        if not key:
            raise CommandError(f"the {what} file {path} is empty")
    else:
        key = os.environ.get(env, "").strip()
    if not key:
        return None
    if not (key.isascii() and key.isprintable()):
        raise CommandError(f"the {what} holds characters an HTTP header cannot carry")
    return key
