"""How a setting is declared and read: `setting()` fields, and the one reader every section goes through.

A setting is one dataclass field made by `setting()`: its default, its range or choices and
a one-line doc (`About`). `read_section` reads a section from its YAML value by those
declarations (the field's type says how; a setting with a rule of its own hooks a reader to
its field), collecting every problem (`Checker`) rather than stopping at the first.
"""

from __future__ import annotations

import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypedDict, TypeGuard, TypeVar, Unpack

Bounds = tuple[int, int | None]  # lowest, highest (None: no upper bound)
PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOP_LEVEL: Final = "(top level)"
_SHOW_CHARS: Final = 40
# Bounded repr: config values are untrusted and may be huge or alias-nested (billion laughs).
_REPR: Final = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxstring = _SHOW_CHARS
_REPR.maxother = _SHOW_CHARS
ABOUT_KEY: Final = "edgellm"  # the dataclass field metadata key of a declaration

T = TypeVar("T")


class ConfigError(Exception):
    """Raised with every problem found; .problems is a list[str], each 'key.path: message'."""

    problems: list[str]

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def show(value: object) -> str:
    """A short, safe rendering of an untrusted value for an error message."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def key_text(key: object) -> str:
    return key if isinstance(key, str) and PLAIN_KEY.fullmatch(key) else show(key)


def join_path(path: str, key: object) -> str:
    return key_text(key) if path == TOP_LEVEL else f"{path}.{key_text(key)}"


def range_text(bounds: Bounds) -> str:
    low, high = bounds
    return f">= {low}" if high is None else f"from {low} to {high}"


def is_int(value: object) -> TypeGuard[int]:
    # bool is a subclass of int, and YAML's yes/no/true/false are no port numbers.
    return isinstance(value, int) and not isinstance(value, bool)


def within(value: int, bounds: Bounds) -> bool:
    low, high = bounds
    return value >= low and (high is None or value <= high)


# ---- declarations ----------------------------------------------------------------------------

Reader = Callable[["Field"], Any]


@dataclass(frozen=True, slots=True)
class About:
    """What a setting's field declares beside its type and default, for parsing and the README."""

    doc: str  # one line: the README block's comment and the start of the table's meaning
    bounds: Bounds | None = None  # integers: the range allowed
    also: int | None = None  # one more integer allowed below the range (gpu_layers' -1)
    choices: tuple[str, ...] = ()  # strings: the values allowed, matched case-insensitively
    pattern: re.Pattern[str] | None = None  # strings, and each item of a list of strings
    wanted: str = ""  # what a pattern-checked value must be, in the problem's words
    read: Reader | None = None  # a rule of its own, instead of the one the field's type implies
    accepts: str = ""  # the README's "accepts" column where `read` decides it
    example: str | None = None  # YAML the README block shows instead of the default (required ones)
    more: str = ""  # further detail for the README table (Markdown)


class Declared(TypedDict, total=False):
    """About's keywords beside its doc, for the signatures of `about()` and `setting()`."""

    bounds: Bounds
    also: int
    choices: tuple[str, ...]
    pattern: re.Pattern[str]
    wanted: str
    read: Reader
    accepts: str
    example: str
    more: str


def about(doc: str, **declared: Unpack[Declared]) -> dict[str, About]:
    """The field metadata of a setting without a default (`field(metadata=about(...))`)."""
    return {ABOUT_KEY: About(doc, **declared)}


def setting(default: T, doc: str, **declared: Unpack[Declared]) -> T:
    """A setting's dataclass field: its default, its doc, and how a value is checked."""
    return field(default=default, metadata=about(doc, **declared))


@dataclass(frozen=True, slots=True)
class Spec:
    """A declared field as the reader sees it."""

    name: str
    about: About
    default: Any  # dataclasses.MISSING when the field has none
    hint: Any  # the resolved annotation

    @property
    def members(self) -> tuple[Any, ...]:
        origin = typing.get_origin(self.hint)
        return typing.get_args(self.hint) if origin in (typing.Union, types.UnionType) else (self.hint,)

    @property
    def nullable(self) -> bool:
        return type(None) in self.members

    @property
    def literals(self) -> tuple[object, ...]:
        """Values a `Literal[...]` member of the type allows (gpu_layers' "auto")."""
        return tuple(v for m in self.members if typing.get_origin(m) is Literal for v in typing.get_args(m))

    @property
    def base(self) -> Any:
        """The type without None and literals: what the generic reader goes by."""
        rest = [m for m in self.members if m is not type(None) and typing.get_origin(m) is not Literal]
        return rest[0] if len(rest) == 1 else self.hint

    @property
    def required(self) -> bool:
        return self.default is MISSING and not self.nullable


def declared_specs(cls: type[Any]) -> tuple[Spec, ...]:
    """The declared fields of a settings class, in order; a field without a declaration is no key.

    Not cached: a config is read a few times in a daemon's life, and a dozen fields a time.
    """
    hints = typing.get_type_hints(cls)
    specs = tuple(
        Spec(f.name, f.metadata[ABOUT_KEY], f.default, hints[f.name])
        for f in fields(cls)
        if ABOUT_KEY in f.metadata
    )
    for spec in specs:
        reader_of(spec)  # a declaration the reader cannot read fails at the first parse, not in production
    return specs


def reader_of(spec: Spec) -> Reader:
    """How a field is read: its own reader, or the one its type implies."""
    if spec.about.read is not None:
        return spec.about.read
    base, about = spec.base, spec.about
    if is_dataclass(base):
        return Field.subsection
    if base is int and about.bounds is not None:
        return Field.integer
    if base is str and (about.choices or about.pattern is not None):
        return Field.string
    if base == tuple[str, ...] and about.pattern is not None:
        return Field.strings
    kinds: dict[Any, Reader] = {float: Field.number, bool: Field.boolean, Path: Field.file_path}
    if base in kinds:
        return kinds[base]
    raise TypeError(f"setting {spec.name}: no reader for {spec.hint!r} as declared; give it read=")


# ---- reading -----------------------------------------------------------------------------------


class Checker:
    """Collects problems; each reader returns a well-typed fallback so parsing carries on."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def section(
        self, value: object, path: str, allowed: tuple[str, ...], *, null_ok: bool
    ) -> dict[str, object]:
        """The known keys of a mapping; reports a non-mapping and every unknown key."""
        if value is None and null_ok:
            return {}
        if not isinstance(value, dict):
            self.add(path, f"must be a mapping with keys {', '.join(allowed)}, got {show(value)}")
            return {}
        expected = ", ".join(sorted(allowed))
        for key in value:
            if key not in allowed:
                self.add(join_path(path, key), f"unknown key (expected one of {expected})")
        return {key: item for key, item in value.items() if key in allowed}


@dataclass(frozen=True, slots=True)
class Field:
    """One setting being read: its declaration, its section's data, and what that section has so far."""

    checker: Checker
    section: str  # the section's key path
    spec: Spec
    data: Mapping[str, object]  # the section's known keys
    parsed: Mapping[str, Any]  # the section's settings read before this one
    base_dir: Path
    mapping: bool  # the section was a mapping; if not, that is reported and nothing is "required"

    @property
    def path(self) -> str:
        return join_path(self.section, self.spec.name)

    @property
    def given(self) -> bool:
        return self.spec.name in self.data

    @property
    def value(self) -> object:
        return self.data.get(self.spec.name)

    @property
    def default(self) -> Any:
        return None if self.spec.default is MISSING else self.spec.default

    def problem(self, message: str) -> None:
        self.checker.add(self.path, message)

    def read(self) -> Any:
        kind = reader_of(self.spec)
        if kind is Field.subsection or self.spec.about.read is not None or self.given:
            return kind(self)
        return self.default

    def integer(self, bounds: Bounds | None = None) -> Any:
        bounds = bounds or self.spec.about.bounds or (0, None)
        value, also, nullable = self.value, self.spec.about.also, self.spec.nullable
        if value is None and nullable:
            return None
        if is_int(value) and (value == also or within(value, bounds)):
            return value
        if isinstance(value, str) and value in self.spec.literals:
            return value
        self.problem(f"must be {integer_text(bounds, also, nullable=nullable)}, got {show(value)}")
        return None if nullable else self.default

    def number(self) -> Any:
        value = self.value
        if value is None and self.spec.nullable:
            return None
        if is_int(value) or isinstance(value, float):
            try:
                number = float(value)
            except OverflowError:  # an int beyond any float
                number = math.inf
            if math.isfinite(number) and number > 0:
                return number
        wanted = "null or a finite number > 0" if self.spec.nullable else "a finite number > 0"
        self.problem(f"must be {wanted}, got {show(value)}")
        return self.default

    def boolean(self) -> Any:
        if isinstance(self.value, bool):
            return self.value
        self.problem(f"must be true or false, got {show(self.value)}")
        return self.default

    def string(self) -> Any:
        value, about = self.value, self.spec.about
        if about.choices:
            if isinstance(value, str) and value.lower() in about.choices:
                return value.lower()
            self.problem(f"must be one of {', '.join(about.choices)}, got {show(value)}")
            return self.default
        if value is None:
            return None
        if isinstance(value, str) and about.pattern is not None and about.pattern.fullmatch(value):
            return value
        self.problem(f"must be {about.wanted}, got {show(value)}")
        return None

    def file_path(self) -> Path | None:
        value = self.value
        if value is None:
            return None
        if isinstance(value, str) and value.strip() and "\0" not in value:
            # Relative to the config file, never the working directory; symlinks kept as written.
            return self.base_dir / value  # an absolute value replaces base_dir
        self.problem(f"must be a non-empty string (a file path), got {show(value)}")
        return None

    def strings(self, valid: Callable[[str], bool] = lambda _: True) -> tuple[str, ...]:
        value, pattern = self.value, self.spec.about.pattern
        if value is None:
            return ()
        if not isinstance(value, list):
            self.problem(f"must be a list, got {show(value)}")
            return ()
        out: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, str) and pattern is not None and pattern.fullmatch(item) and valid(item):
                out.append(item)
            else:
                self.checker.add(f"{self.path}[{i}]", f"must be {self.spec.about.wanted}, got {show(item)}")
        return tuple(out)

    def subsection(self, *, null_ok: bool = True) -> Any:
        return read_section(
            self.checker, self.spec.base, self.value, self.path, self.base_dir, null_ok=null_ok
        )


def integer_text(bounds: Bounds, also: int | None, *, nullable: bool) -> str:
    wanted = f"an integer {range_text(bounds)}"
    if also is not None:
        wanted = f"{also} or {wanted}"
    return f"null or {wanted}" if nullable else wanted


def read_section(
    checker: Checker, cls: type[Any], value: object, path: str, base_dir: Path, *, null_ok: bool
) -> Any:
    """One section (an instance of a settings class) read from its YAML value, every problem reported."""
    specs = declared_specs(cls)
    data = checker.section(value, path, tuple(spec.name for spec in specs), null_ok=null_ok)
    mapping = isinstance(value, dict)
    parsed: dict[str, Any] = {}
    for spec in specs:
        parsed[spec.name] = Field(checker, path, spec, data, parsed, base_dir, mapping).read()
    return cls(**parsed)
