"""Reading a client's JSON object field by field: typed getters whose failures name the param.

Every API family (chat and completions, Responses, Messages) validates its bodies with these,
so a wrong type or an out-of-range number reads the same everywhere, and no client value is
echoed at length (`shown`). Only the refusal of an unknown field keeps each API's own words
(`reject_unknown` is OpenAI's; the Messages decoder says Anthropic's "Extra inputs are not
permitted").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar

from edgellmd.errors import InvalidRequest, UnsupportedParameter, shown

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_METADATA_KEYS: Final = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS: Final = 64
MAX_METADATA_VALUE_CHARS: Final = 512


def known_parameters(query: Iterable[str], allowed: frozenset[str]) -> None:
    """400 naming the first query parameter that is not in `allowed` (its name shown bounded)."""
    for name in query:
        if name not in allowed:
            raise InvalidRequest(
                f"unknown parameter {shown(name[:40])!r} (expected {', '.join(sorted(allowed))})",
                param=shown(name[:40]),
            )


def note_ignored(data: Mapping[str, Any], names: Iterable[str]) -> None:
    """A debug line naming the accepted-and-ignored fields a body set (their values stay out)."""
    present = sorted(name for name in names if data.get(name) is not None)
    if present:
        log.debug("accepted and ignored: %s", ", ".join(present))


def number_text(value: float) -> str:
    """A client's number, echoed only when short: a 4000-digit integer stays out of the answer."""
    return shown(value, limit=24, placeholder="a number out of range")


def check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    """400 naming `name` unless lo <= value <= hi (either bound may be absent)."""
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {number_text(value)}", param=name)
    if lo is not None and value < lo:
        raise InvalidRequest(f"'{name}' must be at least {lo}, got {number_text(value)}", param=name)
    if hi is not None and value > hi:
        raise InvalidRequest(f"'{name}' must be at most {hi}, got {number_text(value)}", param=name)


def typed(value: Any, kind: type[T], param: str, what: str) -> T:
    """`value` when it is a `kind` (a bool is no int); else 400 "'param' must be `what`"."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"'{param}' must be {what}", param=param)
    return value


def reject_unknown(data: Mapping[str, Any], allowed: frozenset[str], where: str = "") -> None:
    """OpenAI's 400 for a field the endpoint does not know (its name shown safely): a
    top-level one, or one of the object at `where` (`tools[0].function`)."""
    for name in data:
        if name not in allowed:
            safe = f"{where}.{shown(name)}" if where else shown(name)
            raise InvalidRequest(
                f"unrecognized request argument: {safe}", param=safe, code="unknown_parameter"
            )


def unsupported(name: str, why: str = "") -> UnsupportedParameter:
    """The 400 for a field this server knows and does not serve."""
    what = f"'{name}' {why}" if why else f"'{name}'"
    return UnsupportedParameter(f"{what} is not supported by this server", param=name)


class Fields:
    """Typed getters over one JSON object; `prefix` names a nested one (`text.format.`)."""

    def __init__(self, data: Mapping[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def present(self, key: str) -> bool:
        return self.data.get(key) is not None

    def string(self, key: str, *, required: bool = False, nonempty: bool = False) -> str | None:
        value = self.data.get(key)
        param = self.name(key)
        if value is None:
            if required:
                raise InvalidRequest(f"'{param}' is required", param=param)
            return None
        if not isinstance(value, str):
            raise InvalidRequest(f"'{param}' must be a string", param=param)
        if nonempty and not value:
            raise InvalidRequest(f"'{param}' must not be empty", param=param)
        return value

    def choice(self, key: str, allowed: tuple[str, ...]) -> str | None:
        value = self.string(key)
        if value is not None and value not in allowed:
            param = self.name(key)
            raise InvalidRequest(f"'{param}' must be one of {', '.join(allowed)}", param=param)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            param = self.name(key)
            raise InvalidRequest(f"'{param}' must be a boolean", param=param)
        return value

    def integer(self, key: str, *, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        param = self.name(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"'{param}' must be an integer", param=param)
        check_range(param, value, lo, hi)
        return value

    def number(self, key: str, default: float, *, lo: float | None = None, hi: float | None = None) -> float:
        value = self.data.get(key)
        if value is None:
            return default
        param = self.name(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"'{param}' must be a number", param=param)
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer past any float: 1 followed by 400 zeros
            finite = False
        if not finite:
            raise InvalidRequest(f"'{param}' must be a finite number", param=param)
        check_range(param, value, lo, hi)
        return float(value)

    def only(self, allowed: frozenset[str], what: str) -> None:
        """400 for a key of this nested object that is not in `allowed`."""
        for key in self.data:
            if key not in allowed:
                safe = shown(key)
                # A key that cannot be shown is not named: the object that holds it is.
                param = self.name(key) if key and safe == key else self.prefix.rstrip(".")
                raise InvalidRequest(f"unrecognized field in '{what}': {safe}", param=param)


def metadata_object(value: Any) -> dict[str, str]:
    """`metadata` held to OpenAI's limits (chat and Responses): string keys and values."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_KEYS} keys", param="metadata"
        )
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"'metadata' keys must be at most {MAX_METADATA_KEY_CHARS} characters", param="metadata"
            )
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"'metadata' values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return dict(value)
