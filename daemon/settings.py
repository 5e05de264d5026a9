"""Daemon configuration: one YAML file validated once into frozen dataclasses.

Declare once: every setting is one dataclass field made by `setting()`, which carries its
default, its range or choices and a one-line doc. One generic reader parses every section
from those declarations (the field's type says how a value is read; the few settings with a
rule of their own hook a small reader to their field), `edgellmd --check-config` prints every
problem it finds, and `python -m edgellmd.settings --markdown` writes the README's
configuration reference from the same declarations (tests/test_settings_reference.py holds
the README to it).
"""

# ruff: noqa: RUF009 - setting() is this module's dataclass field specifier: it returns
# dataclasses.field(default=..., metadata=...), which RUF009 accepts when it is spelled out.

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import re
import reprlib
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal, TypedDict, TypeGuard, TypeVar, Unpack

import yaml

from edgellmd.files import FileTooLarge, NotRegularFile, read_regular
from edgellmd.host import verdicts
from edgellmd.host.cpu import AUTO as AUTO_CPUS
from edgellmd.host.cpu import CpuListError, parse_cpu_list
from edgellmd.host.verdicts import GpuLayers

MAX_CONFIG_BYTES: Final = 1_048_576  # a config file is a few hundred bytes; refuse anything absurd
GPU_LAYERS_ALL: Final = -1  # `gpu_layers: -1`: every layer, and the output layer
GPU_LAYERS_AUTO: Final = verdicts.GPU_LAYERS_AUTO  # "auto"; the loader and doctor compare with it here
# Model names: the config's models[].name and the lockfile's members (models.lockfile reads it here).
MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")

Bounds = tuple[int, int | None]  # lowest, highest (None: no upper bound)
_CONNECTIONS: Final[Bounds] = (1, 1_000_000)
_THREADS: Final[Bounds] = (1, 1024)
_MEGABYTES: Final[Bounds] = (1, None)
_TEMPLATE_NAME: Final = re.compile(r"[a-z0-9_.-]{1,64}")
_ORIGIN: Final = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")
_CIDR: Final = re.compile(r"[0-9A-Fa-f.:]+(/[0-9]{1,3})?")
_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOP_LEVEL: Final = "(top level)"
_SHOW_CHARS: Final = 40
# Bounded repr: config values are untrusted and may be huge or alias-nested (billion laughs).
_REPR: Final = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxstring = _SHOW_CHARS
_REPR.maxother = _SHOW_CHARS
_ABOUT: Final = "edgellm"  # the dataclass field metadata key of a declaration

T = TypeVar("T")


class ConfigError(Exception):
    """Raised with every problem found; .problems is a list[str], each 'key.path: message'."""

    problems: list[str]

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _show(value: object) -> str:
    """A short, safe rendering of an untrusted value for an error message."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def _key_text(key: object) -> str:
    return key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else _show(key)


def _join(path: str, key: object) -> str:
    return _key_text(key) if path == _TOP_LEVEL else f"{path}.{_key_text(key)}"


def _range_text(bounds: Bounds) -> str:
    low, high = bounds
    return f">= {low}" if high is None else f"from {low} to {high}"


def _is_int(value: object) -> TypeGuard[int]:
    # bool is a subclass of int, and YAML's yes/no/true/false are no port numbers.
    return isinstance(value, int) and not isinstance(value, bool)


def _within(value: int, bounds: Bounds) -> bool:
    low, high = bounds
    return value >= low and (high is None or value <= high)


# ---- declarations ----------------------------------------------------------------------------

Reader = Callable[["_Field"], Any]


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


class _Declared(TypedDict, total=False):
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


def about(doc: str, **declared: Unpack[_Declared]) -> dict[str, About]:
    """The field metadata of a setting without a default (`field(metadata=about(...))`)."""
    return {_ABOUT: About(doc, **declared)}


def setting(default: T, doc: str, **declared: Unpack[_Declared]) -> T:
    """A setting's dataclass field: its default, its doc, and how a value is checked."""
    return field(default=default, metadata=about(doc, **declared))


@dataclass(frozen=True, slots=True)
class _Spec:
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


def _declared(cls: type[Any]) -> tuple[_Spec, ...]:
    """The declared fields of a settings class, in order; a field without a declaration is no key.

    Not cached: a config is read a few times in a daemon's life, and a dozen fields a time.
    """
    hints = typing.get_type_hints(cls)
    specs = tuple(
        _Spec(f.name, f.metadata[_ABOUT], f.default, hints[f.name])
        for f in fields(cls)
        if _ABOUT in f.metadata
    )
    for spec in specs:
        _kind(spec)  # a declaration the reader cannot read fails at the first parse, not in production
    return specs


def _kind(spec: _Spec) -> Reader:
    """How a field is read: its own reader, or the one its type implies."""
    if spec.about.read is not None:
        return spec.about.read
    base, about = spec.base, spec.about
    if is_dataclass(base):
        return _Field.subsection
    if base is int and about.bounds is not None:
        return _Field.integer
    if base is str and (about.choices or about.pattern is not None):
        return _Field.string
    if base == tuple[str, ...] and about.pattern is not None:
        return _Field.strings
    kinds: dict[Any, Reader] = {float: _Field.number, bool: _Field.boolean, Path: _Field.file_path}
    if base in kinds:
        return kinds[base]
    raise TypeError(f"setting {spec.name}: no reader for {spec.hint!r} as declared; give it read=")


# ---- reading -----------------------------------------------------------------------------------


class _Checker:
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
            self.add(path, f"must be a mapping with keys {', '.join(allowed)}, got {_show(value)}")
            return {}
        expected = ", ".join(sorted(allowed))
        for key in value:
            if key not in allowed:
                self.add(_join(path, key), f"unknown key (expected one of {expected})")
        return {key: item for key, item in value.items() if key in allowed}


@dataclass(frozen=True, slots=True)
class _Field:
    """One setting being read: its declaration, its section's data, and what that section has so far."""

    checker: _Checker
    section: str  # the section's key path
    spec: _Spec
    data: Mapping[str, object]  # the section's known keys
    parsed: Mapping[str, Any]  # the section's settings read before this one
    base_dir: Path
    mapping: bool  # the section was a mapping; if not, that is reported and nothing is "required"

    @property
    def path(self) -> str:
        return _join(self.section, self.spec.name)

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
        kind = _kind(self.spec)
        if kind is _Field.subsection or self.spec.about.read is not None or self.given:
            return kind(self)
        return self.default

    def integer(self, bounds: Bounds | None = None) -> Any:
        bounds = bounds or self.spec.about.bounds or (0, None)
        value, also, nullable = self.value, self.spec.about.also, self.spec.nullable
        if value is None and nullable:
            return None
        if _is_int(value) and (value == also or _within(value, bounds)):
            return value
        if isinstance(value, str) and value in self.spec.literals:
            return value
        self.problem(f"must be {_integer_text(bounds, also, nullable=nullable)}, got {_show(value)}")
        return None if nullable else self.default

    def number(self) -> Any:
        value = self.value
        if _is_int(value) or isinstance(value, float):
            try:
                number = float(value)
            except OverflowError:  # an int beyond any float
                number = math.inf
            if math.isfinite(number) and number > 0:
                return number
        self.problem(f"must be a finite number > 0, got {_show(value)}")
        return self.default

    def boolean(self) -> Any:
        if isinstance(self.value, bool):
            return self.value
        self.problem(f"must be true or false, got {_show(self.value)}")
        return self.default

    def string(self) -> Any:
        value, about = self.value, self.spec.about
        if about.choices:
            if isinstance(value, str) and value.lower() in about.choices:
                return value.lower()
            self.problem(f"must be one of {', '.join(about.choices)}, got {_show(value)}")
            return self.default
        if value is None:
            return None
        if isinstance(value, str) and about.pattern is not None and about.pattern.fullmatch(value):
            return value
        self.problem(f"must be {about.wanted}, got {_show(value)}")
        return None

    def file_path(self) -> Path | None:
        value = self.value
        if value is None:
            return None
        if isinstance(value, str) and value.strip() and "\0" not in value:
            # Relative to the config file, never the working directory; symlinks kept as written.
            return self.base_dir / value  # an absolute value replaces base_dir
        self.problem(f"must be a non-empty string (a file path), got {_show(value)}")
        return None

    def strings(self, valid: Callable[[str], bool] = lambda _: True) -> tuple[str, ...]:
        value, pattern = self.value, self.spec.about.pattern
        if value is None:
            return ()
        if not isinstance(value, list):
            self.problem(f"must be a list, got {_show(value)}")
            return ()
        out: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, str) and pattern is not None and pattern.fullmatch(item) and valid(item):
                out.append(item)
            else:
                self.checker.add(f"{self.path}[{i}]", f"must be {self.spec.about.wanted}, got {_show(item)}")
        return tuple(out)

    def subsection(self, *, null_ok: bool = True) -> Any:
        return _section(self.checker, self.spec.base, self.value, self.path, self.base_dir, null_ok=null_ok)


def _integer_text(bounds: Bounds, also: int | None, *, nullable: bool) -> str:
    wanted = f"an integer {_range_text(bounds)}"
    if also is not None:
        wanted = f"{also} or {wanted}"
    return f"null or {wanted}" if nullable else wanted


def _section(
    checker: _Checker, cls: type[Any], value: object, path: str, base_dir: Path, *, null_ok: bool
) -> Any:
    """One section (an instance of a settings class) read from its YAML value, every problem reported."""
    specs = _declared(cls)
    data = checker.section(value, path, tuple(spec.name for spec in specs), null_ok=null_ok)
    mapping = isinstance(value, dict)
    parsed: dict[str, Any] = {}
    for spec in specs:
        parsed[spec.name] = _Field(checker, path, spec, data, parsed, base_dir, mapping).read()
    return cls(**parsed)


# ---- the settings with rules of their own ----------------------------------------------------


def _server_host(f: _Field) -> Any:
    host = f.data.get(f.spec.name, f.default)
    if not isinstance(host, str) or not host or any(char.isspace() for char in host):
        f.problem(f"must be a non-empty host name or address, got {_show(host)}")
        return f.default
    return host


def _default_max_tokens(f: _Field) -> Any:
    # Bounded by the limit as parsed (its default if the limit itself is wrong).
    return f.integer((1, f.parsed["max_tokens_limit"]))


def _tls_key(f: _Field) -> Any:
    key = f.file_path()
    if (f.data.get("tls_cert") is None) != (f.value is None):
        f.checker.add(_join(f.section, "tls_cert"), "tls_cert and tls_key go together: set both or neither")
    return key


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def _admin_cidrs(f: _Field) -> Any:
    return f.strings(valid=_is_network)


def _model_name(f: _Field) -> Any:
    name = f.string()
    if f.value is None and f.mapping:  # a non-mapping model is reported already
        f.problem("required")
    return name or ""


def _chat_template_file(f: _Field) -> Any:
    path = f.file_path()
    if f.value is not None and f.data.get("chat_template") is not None:
        f.checker.add(
            _join(f.section, "chat_template"), f"cannot be combined with {f.path}; set only one of them"
        )
    return path


def _cpus(f: _Field) -> Any:
    cpus = f.value
    if _is_int(cpus):
        cpus = str(cpus)  # `cpus: 3` in YAML is an int
    if cpus is None:
        return None
    if not isinstance(cpus, str):
        f.problem(f'must be a CPU list like "0-3,8" or "auto", got {_show(cpus)}')
        return None
    if cpus.strip().lower() == AUTO_CPUS:
        return AUTO_CPUS
    try:
        parse_cpu_list(cpus)
    except CpuListError as exc:
        f.problem(f"{exc}, got {_show(cpus)}")
        return None
    return cpus


def _unsigned(f: _Field) -> bool:
    return f.data.get("allow_unsigned") is True


def _lock_path(f: _Field) -> Any:
    """lock.file, models_dir, state_dir: required with a lockfile, refused without one."""
    if _unsigned(f):
        if f.given:
            f.problem("cannot be combined with lock.allow_unsigned: true")
        return None
    if not f.given:
        f.problem("required")
    return f.file_path()


def _trusted_keys(f: _Field) -> Any:
    if _unsigned(f):
        if f.given:
            f.problem("cannot be combined with lock.allow_unsigned: true")
        return ()
    raw = f.value
    if not isinstance(raw, list) or not raw:
        f.problem(f"must be a non-empty list of public key files, got {_show(raw)}")
        return ()
    keys: list[Path] = []
    for index, item in enumerate(raw):
        if isinstance(item, str) and item.strip() and "\0" not in item:
            keys.append(f.base_dir / item)
        else:
            f.checker.add(
                f"{f.path}[{index}]", f"must be a non-empty string (a file path), got {_show(item)}"
            )
    return tuple(keys)


def _models(f: _Field) -> Any:
    if not f.mapping:  # a non-mapping top level is reported already
        return ()
    if not f.given:
        f.problem("required; must be a non-empty list of model mappings")
        return ()
    if not isinstance(f.value, list) or not f.value:
        f.problem(f"must be a non-empty list of model mappings, got {_show(f.value)}")
        return ()
    models = tuple(
        _section(f.checker, ModelSettings, entry, f"{f.path}[{index}]", f.base_dir, null_ok=False)
        for index, entry in enumerate(f.value)
    )
    first_seen: dict[str, int] = {}
    for index, model in enumerate(models):
        if not model.name:  # missing or invalid, already reported
            continue
        if model.name in first_seen:
            f.checker.add(
                f"{f.path}[{index}].name",
                f"duplicate model name {model.name!r} (also models[{first_seen[model.name]}])",
            )
        else:
            first_seen[model.name] = index
        _check_model(f.checker, model, f"{f.path}[{index}]")
    return models


def _probability(f: _Field) -> Any:
    """speculative.draft_p_min: a number from 0 to 1 (the generic float reader wants one > 0)."""
    value = f.value
    if not f.given:
        return f.default
    if (_is_int(value) or isinstance(value, float)) and 0 <= value <= 1:  # NaN fails both
        return float(value)
    f.problem(f"must be a number from 0 to 1, got {_show(value)}")
    return f.default


def _check_model(checker: _Checker, model: ModelSettings, path: str) -> None:
    """What one field cannot say alone: settings of a model that contradict each other."""
    if model.cache_type_v != "f16" and model.flash_attention == "off":
        checker.add(
            f"{path}.cache_type_v",
            f"{model.cache_type_v} values need flash attention; flash_attention is off",
        )
    spec = model.speculative
    if spec.ngram_min > spec.ngram_max:
        checker.add(
            f"{path}.speculative.ngram_min",
            f"{spec.ngram_min} is more than ngram_max ({spec.ngram_max})",
        )
    if spec.mode == "draft":
        if spec.draft_model is not None and spec.draft_model == model.name:
            checker.add(
                f"{path}.speculative.draft_model",
                f"names this model itself ({model.name!r}): each draft token would cost a token of its own",
            )
    else:
        for key, value in (("draft_model", spec.draft_model), ("draft_file", spec.draft_file)):
            if value is not None:
                checker.add(f"{path}.speculative.{key}", f"only with mode draft (mode is {spec.mode})")
    if model.embedding:
        if spec.mode != "none":
            checker.add(f"{path}.speculative.mode", "an embedding model generates no text to draft")
        if model.prompt_cache_mb:
            checker.add(f"{path}.prompt_cache_mb", "an embedding model keeps no prompt cache")


def _lock(f: _Field) -> Any:
    if not f.mapping:
        return LockSettings()
    if f.value is None:
        f.problem(
            "required: name the signed lockfile (lock.file, lock.trusted_keys, "
            "lock.models_dir, lock.state_dir), or set lock.allow_unsigned: true for development"
        )
        lock = LockSettings(allow_unsigned=True)
    else:
        lock = f.subsection(null_ok=False)
    if f.parsed["models"]:
        _check_model_files(f.checker, f.data.get("models"), lock)
    return lock


def _check_model_files(checker: _Checker, raw_models: object, lock: LockSettings) -> None:
    """With a lockfile the lock names every file; without one each model needs its own."""
    if not isinstance(raw_models, list):
        return
    for index, entry in enumerate(raw_models):
        if not isinstance(entry, dict):
            continue
        given = entry.get("file") is not None
        if lock.allow_unsigned and not given:
            checker.add(f"models[{index}].file", "required (lock.allow_unsigned is set)")
        elif not lock.allow_unsigned and given:
            checker.add(
                f"models[{index}].file", "not allowed with a lockfile: the lock names each model's file"
            )
        # A draft model's file likewise (speculative mode draft; an embedding model is refused it).
        spec = entry.get("speculative")
        if not isinstance(spec, dict) or str(spec.get("mode")).lower() != "draft" or entry.get("embedding"):
            continue
        where = f"models[{index}].speculative"
        if lock.allow_unsigned and spec.get("draft_file") is None:
            checker.add(f"{where}.draft_file", "required with mode draft (lock.allow_unsigned is set)")
        elif not lock.allow_unsigned:
            if spec.get("draft_file") is not None:
                checker.add(
                    f"{where}.draft_file",
                    "not allowed with a lockfile: the lock names the draft model's file (set draft_model)",
                )
            if spec.get("draft_model") is None:
                checker.add(
                    f"{where}.draft_model", "required with mode draft: the draft model's name in the lockfile"
                )


def _auth(f: _Field) -> Any:
    auth = f.subsection()
    host = f.parsed["server"].host
    if auth.keys_file is None and not _is_loopback(host):
        f.checker.add(
            "server.host",
            f"{host!r} is not a loopback address: serving a network "
            "without API keys is refused; set auth.keys_file",
        )
    return auth


def _console(f: _Field) -> Any:
    console = f.subsection()
    if console.enabled and f.parsed["auth"].keys_file is None:
        f.checker.add(
            "console.enabled", "the console signs in with API keys: set auth.keys_file to enable it"
        )
    return console


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


# ---- the settings ------------------------------------------------------------------------------
# Each default here is the README's and the Ansible role's (defaults/main.yml): the README's
# reference is generated from these declarations, the role's defaults are not (keep them level).


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The HTTP listener and per-request limits."""

    host: str = setting(  # loopback: exposing the daemon is an explicit decision
        "127.0.0.1",
        "address to listen on; loopback by default",
        read=_server_host,
        accepts="a host name or address",
        more="anything but a loopback address needs `auth.keys_file`",
    )
    port: int = setting(8080, "listen port", bounds=(1, 65535))
    max_body_bytes: int = setting(1_048_576, "larger request bodies get 413", bounds=(1024, None))
    max_tokens_limit: int = setting(
        4096, "ceiling on any request's max_tokens (400 above it)", bounds=(1, None)
    )
    default_max_tokens: int | None = setting(
        None,
        "max_tokens when a request gives none; null: until EOS or a full context",
        read=_default_max_tokens,
        accepts="null or an integer from 1 to `server.max_tokens_limit`",
        more="(or `server.max_tokens_limit`; `/v1/completions` defaults to 16, as OpenAI documents)",
    )
    shutdown_timeout_s: float = setting(30.0, "on SIGTERM, in-flight requests get this long to finish")
    stream_write_timeout_s: float = setting(
        30.0, "a streaming client that reads nothing this long is cut off", more="(and its slot freed)"
    )
    header_timeout_s: float = setting(
        10.0,
        "each request head must be complete this long after its first byte (slow-loris)",
        more="the first head counts from the connection's opening, a pipelined one from the answer "
        "before it; a late head gets the connection closed, unanswered",
    )
    body_timeout_s: float = setting(  # a 1 MiB body at 35 KB/s; a slower upload is a held connection
        30.0,
        "each request body must be complete this long after its head: else 408, closed",
        more="(`request_timeout`, if its answer has not begun), whether the handler read it or not",
    )
    keepalive_timeout_s: float = setting(  # as nginx, and the role's HAProxy http-keep-alive
        75.0, "an idle kept-alive connection is closed after this"
    )
    progress_timeout_s: float = setting(
        300.0,
        "a request that gets no token (or no slot) for this long is ended: 504",
        more="(an error event when streaming)",
    )
    max_connections: int = setting(1024, "connections beyond this are closed at once", bounds=_CONNECTIONS)
    # One address may hold a quarter of the global cap: room for an app server's pool of a few
    # hundred streams (or a NAT gateway's users), while one address's slow-loris heads or
    # never-ending bodies leave three quarters of the connections to everybody else. Not
    # checked against max_connections: above it, the global cap is the one that bites.
    max_connections_per_client: int = setting(
        256,
        "likewise from one client address (behind a proxy: raise it)",
        bounds=_CONNECTIONS,
        more="so that one client cannot starve the others; IPv4-mapped IPv6 peers count as their IPv4 "
        "address, other IPv6 peers by /64. Behind a load balancer every connection comes from its "
        "address: raise this to `server.max_connections`",
    )
    tls_cert: Path | None = setting(None, "PEM certificate chain: with tls_key, HTTPS only (TLS 1.2+)")
    tls_key: Path | None = setting(
        None,
        "its PEM private key (edgellmctl quickstart --tls makes a self-signed pair)",
        read=_tls_key,
        accepts="a file path, with `server.tls_cert`",
    )
    cors_origins: tuple[str, ...] = setting(
        (),
        "browser origins allowed to call the API; none: no CORS headers at all",
        pattern=_ORIGIN,
        wanted="an origin like https://app.example:8443",
        more="preflights are answered before auth",
    )


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    """Log level and line format."""

    level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    format: str = setting("json", "json: one object per line, with request_id", choices=("json", "text"))


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """Who may call the API."""

    keys_file: Path | None = setting(
        None,
        "API keys (hashed, mode 0600); null: no auth at all, only on loopback",
        more="(see [API keys](#api-keys)); required unless `server.host` is a loopback address",
    )
    admin_cidrs: tuple[str, ...] = setting(
        (),
        "if set, /admin/* answers only peers in these networks",
        read=_admin_cidrs,
        pattern=_CIDR,
        wanted="a network like 10.0.0.0/8",
        accepts="a list of networks like 10.0.0.0/8",
        more="others get 403 `address_not_allowed`",
    )
    metrics_public: bool = setting(False, "serve /metrics without a key (else it needs the metrics scope)")


@dataclass(frozen=True, slots=True)
class LockSettings:
    """Where the signed lockfile, its trusted keys, the model files and the rollback state live."""

    file: Path | None = setting(
        None,
        "the signed lockfile; required unless allow_unsigned",
        read=_lock_path,
        accepts="a file path",
        example="models.lock",
    )
    trusted_keys: tuple[Path, ...] = setting(
        (),
        "Ed25519 public keys (PEM); list several to rotate keys",
        read=_trusted_keys,
        accepts="a non-empty list of file paths",
        example="[keys/signing.pub]",
        more="a lock signed by any of them is accepted; required unless `lock.allow_unsigned`",
    )
    models_dir: Path | None = setting(
        None,
        "lockfile paths are relative to this",
        read=_lock_path,
        accepts="a directory path",
        example="models",
    )
    state_dir: Path | None = setting(
        None,
        "keeps the highest lockfile version accepted (rollback guard)",
        read=_lock_path,
        accepts="a directory path",
        example="state",
    )
    allow_unsigned: bool = setting(
        False,
        "development only, without the four keys above: models[].file loads unverified",
        more="with a loud warning in the log",
    )


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    """Speculative decoding: drafts from the request's text or a draft model, checked in the same batch."""

    mode: str = setting(
        "none",
        "none; ngram: draft from the prompt and reply so far; draft: a smaller model drafts",
        choices=("none", "ngram", "draft"),
        more="ngram pays on text that copies its input (rewriting, extraction, code edits, quotes, JSON "
        "that repeats keys); draft needs a model of the same vocabulary (`draft_model`); the output is "
        "exactly plain decoding's (each draft token is checked with the request's own sampler)",
    )
    max_draft: int = setting(
        8,
        "most draft tokens per sequence and step",
        bounds=(1, 64),
        more="each drafted position costs a row of the output layer when checked, so long drafts pay only "
        "where they are kept: ngram on text that copies its input pays at 24 (README: Benchmarks); the "
        "draft length adapts, cut where a draft is rejected, and a sequence whose drafts keep failing "
        "outright pauses drafting, longer each time",
    )
    ngram_min: int = setting(2, "shortest repeated n-gram that makes a draft", bounds=(1, 16))
    ngram_max: int = setting(4, "longest n-gram looked up first", bounds=(1, 16))
    max_sequences: int = setting(
        2,
        "draft only while at most this many sequences decode together",
        bounds=(1, 256),
        more="on a CPU a full batch is compute-bound and drafts only cost; a GPU box may raise it",
    )
    draft_model: str | None = setting(
        None,
        "mode draft: the draft model's entry in the lockfile (required with a lockfile)",
        pattern=MODEL_NAME,
        wanted="a model name of 1 to 64 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit",
        more="a smaller model of the same vocabulary, verified and preloaded as every model is, with a KV "
        "cache (f16) of the model's slots and context; unsigned, only the name status pages show",
    )
    draft_file: Path | None = setting(
        None, "mode draft, unsigned mode only (then required): the draft GGUF, relative to the config file"
    )
    draft_p_min: float = setting(
        0.75,
        "mode draft: a draft ends where the draft model's top token is less likely than this",
        read=_probability,
        accepts="a number from 0 to 1",
        more="as llama.cpp's `--draft-p-min`",
    )


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One served model and how llama.cpp loads it."""

    name: str = field(
        metadata=about(
            'what clients send as "model"; its file comes from the lockfile',
            read=_model_name,
            pattern=MODEL_NAME,
            wanted="1 to 64 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit",
            accepts="1 to 64 of `A-Za-z0-9._:-`, starting with a letter or digit",
            example="gemma3-270m",
        )
    )
    # Unsigned (development) mode only: with a lockfile the lock names the file. Absolute.
    file: Path | None = field(
        metadata=about("unsigned mode only (then required): the GGUF file, relative to the config file")
    )
    context_size: int = setting(4096, "tokens per slot (prompt + reply)", bounds=(64, 1_048_576))
    slots: int = setting(4, "requests decoded together; more wait in the queue", bounds=(1, 256))
    threads: int | None = setting(
        None,
        "decode threads; null: every CPU the process may run on",
        bounds=_THREADS,
        more="(the pinned count with `host.cpus`)",
    )
    threads_batch: int | None = setting(None, "prompt threads; null: same as threads", bounds=_THREADS)
    batch_size: int = setting(
        512,
        "tokens per llama_decode (n_batch, n_ubatch); also the prefill chunk",
        bounds=(1, 65536),
        more="llama.cpp gets at least `slots` rows: every step holds a token of each generating sequence",
    )
    gpu_layers: GpuLayers = setting(
        0,
        "layers to offload (-1: all, auto: what fits in free VRAM) on a GPU build",
        bounds=(0, 100_000),
        also=GPU_LAYERS_ALL,
        more="`auto` offloads as many as fit in free VRAM less `host.gpu_headroom_mb` (sized from the "
        "GGUF's tensors plus each layer's KV cache share; 0 on a CPU-only build or without a usable GPU)",
    )
    chat_template: str | None = setting(
        None,
        "a llama.cpp built-in template name (gemma, chatml, llama3, ...)",
        pattern=_TEMPLATE_NAME,
        wanted="a built-in template name of 1 to 64 characters of a-z 0-9 _ . -",
    )
    chat_template_file: Path | None = setting(
        None,
        "or a Jinja2 template file; neither: the GGUF's own template",
        read=_chat_template_file,
        accepts="a file path, not with `chat_template`",
    )
    queue_size: int = setting(
        16,
        "requests that may wait for a slot; beyond that 429 at once",
        bounds=(0, 100_000),
        more="(`server_overloaded`)",
    )
    embedding: bool = setting(
        False,
        "an embedding model, served by /v1/embeddings only",
        more="(mean pooling unless the GGUF says otherwise)",
    )
    evictable: bool = setting(
        False,
        "may be unloaded (least recently used first) to fit another in the budget",
        more="when a load would exceed `lifecycle.memory_budget_mb`; only idle models are",
    )
    cache_type_k: str = setting(
        "f16",
        "KV cache type of the keys: f16, q8_0 (half the bytes) or q4_0",
        choices=("f16", "q8_0", "q4_0"),
        more="the memory budget and `gpu_layers: auto` count the chosen type's bytes",
    )
    cache_type_v: str = setting(
        "f16",
        "KV cache type of the values: f16, q8_0 or q4_0 (quantized: needs flash attention)",
        choices=("f16", "q8_0", "q4_0"),
        more="llama.cpp stores quantized values only with flash attention: `auto` turns it on for them",
    )
    flash_attention: str = setting(
        "auto", "flash attention: auto (llama.cpp decides), on or off", choices=("auto", "on", "off")
    )
    prompt_cache_mb: int = setting(
        0,
        "host RAM for KV states of earlier prompts (LRU); 0: no prompt cache",
        bounds=(0, 1_048_576),
        more="a prompt that starts as an earlier one did (a shared system prompt, a conversation back "
        "after its slot was reused) restores that prefix instead of prefilling it again",
    )
    isolation: str = setting(
        "process",
        "where the model's engine runs: thread (in the daemon) or process (a confined process of its own)",
        choices=("thread", "process"),
        more="with process, a crash or hang in llama.cpp costs this model's requests only; the "
        "model restarts by itself (see the README, engine processes)",
    )
    hang_timeout_s: float = setting(
        30.0,
        "with isolation process: an engine that shows no step progress this long while work is "
        "pending is killed and restarted",
    )
    crash_loop_stops: int = setting(
        5,
        "an engine that stops by itself this many times within crash_loop_window_s is not "
        "restarted again: the model stays failed until an operator loads it",
        bounds=(1, 1000),
        more="before that, each restart waits longer (1, 2, 5, then 15 s)",
    )
    crash_loop_window_s: float = setting(
        600.0, "the window in which crash_loop_stops engine stops trip the breaker", bounds=(1, 604_800)
    )
    batch_padding: bool = setting(
        True,
        "pad a step of generating sequences with dummy rows up to a size that decodes faster, "
        "and even out drafting steps",
        more="each step size from 1 to `slots` is timed at load (for about 2 s at most; sizes it did not "
        "reach are estimated, never padded to, until a step measures them) and kept current by "
        "the steps served; a dummy row is one token in a free slot next to the busy ones, "
        "removed after the step",
    )
    speculative: SpeculativeSettings = setting(
        SpeculativeSettings(), "speculative decoding (drafts verified in the same batch)"
    )
    reasoning: str = setting(
        "none",
        "deepseek: text between <think> and </think> is the model's reasoning, not its answer",
        choices=("none", "deepseek"),
        more="returned as `reasoning_content` (chat), `reasoning` items (Responses) and `thinking` blocks "
        "(Messages), never mixed into the answer; `none` leaves the reply as the model wrote it",
    )


@dataclass(frozen=True, slots=True)
class ResponsesSettings:
    """OpenAI Responses API: the in-memory store behind `store` and `previous_response_id`."""

    store_max_responses: int = setting(
        1000,
        "responses kept in memory (oldest evicted first); 0: nothing is stored",
        bounds=(0, 1_000_000),
        more="per daemon, each visible only to the API key that made it; never written to disk",
    )
    store_max_mb: int = setting(
        64, "memory the stored responses and their conversations may take", bounds=(1, 65536)
    )


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """Where models are preloaded, how file changes are watched, and the memory they may use."""

    preload_dir: Path | None = setting(
        Path("/dev/shm/edgellm"),  # noqa: S108 - tmpfs on purpose: models load from RAM
        "tmpfs for model copies (made while hashed); null: load from models_dir",
        more="each daemon keeps its copies in a locked subdirectory of its own",
    )
    preload_max_mb: int | None = setting(
        None,
        "cap on what the copies may take; null: the filesystem's free space",
        bounds=_MEGABYTES,
        more="a model that does not fit loads from the models directory (still verified), with a warning",
    )
    watch: bool = setting(True, "reload when a model file or the lockfile changes")
    watch_settle_s: float = setting(
        2.0, "a changed file must keep its size and mtime this long before a reload"
    )
    memory_budget_mb: int | None = setting(
        None,
        "loaded models' estimated size (weights + KV cache); null: no budget",
        bounds=_MEGABYTES,
        more="a load past it is refused, unless unloading idle evictable models makes room",
    )


@dataclass(frozen=True, slots=True)
class HostSettings:
    """How the daemon uses its hardware."""

    cpus: str | None = setting(
        None,
        'pin every thread to these CPUs ("0-3,8", or auto); null: as allowed',
        read=_cpus,
        accepts="null, a CPU list or `auto`",
        more="before any model loads (`auto`: one logical CPU per physical core of the allowed set); model "
        "`threads` default to the pinned count; a refused pinning is logged and the daemon carries on",
    )
    huge_pages: bool = setting(
        True,
        "after each model load, back its resident memory with transparent huge pages",
        more="`MADV_COLLAPSE` (Linux 6.1 on) on the daemon's large, nearly all resident anonymous "
        "mappings: llama.cpp's weights, KV cache and compute buffers; where the kernel cannot, "
        "one warning and the daemon carries on (`daemon/host/hugepages.py` says why)",
    )
    gpu_poll_s: float = setting(10.0, "seconds between NVML readings")
    gpu_headroom_mb: int = setting(  # CUDA context, compute buffers and fragmentation
        1024, "VRAM that gpu_layers: auto leaves free", bounds=(0, None)
    )


@dataclass(frozen=True, slots=True)
class ConsoleSettings:
    """The web console at /ui: a session per sign-in, a live overview, actions and a playground."""

    enabled: bool = setting(
        False,
        "serve the web console at /ui (needs `auth.keys_file`)",
        more="sign-in with an API key; `auth.admin_cidrs` applies to it as to /admin/* "
        "(see [Console](#console))",
    )
    session_idle_s: float = setting(900.0, "a console session unused this long ends")
    session_max_s: float = setting(28800.0, "a console session ends this long after its sign-in, used or not")
    max_sessions: int = setting(
        64,
        "console sessions held in memory",
        bounds=(1, 10_000),
        more="a sign-in beyond it ends the least recently used session",
    )
    stream_interval_s: float = setting(
        2.0, "seconds between two updates of the live overview", more="(one event stream per session)"
    )
    history_s: int = setting(
        600, "seconds of chart history (tokens/s, TTFT, queue, GPU) the daemon keeps", bounds=(60, 86_400)
    )
    signin_failures_per_minute: int = setting(
        10,
        "wrong keys allowed per client address and minute at sign-in",
        bounds=(1, 10_000),
        more="then 429 `rate_limit_exceeded` with `Retry-After`, like the API's limits",
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """The whole daemon configuration."""

    server: ServerSettings = field(metadata=about("the HTTP listener and per-request limits"))
    models: tuple[ModelSettings, ...] = field(metadata=about("at least one", read=_models))
    logging: LoggingSettings = field(metadata=about("log level and line format"))
    lock: LockSettings = setting(
        LockSettings(allow_unsigned=True), "required: which models may load", read=_lock
    )
    auth: AuthSettings = setting(AuthSettings(), "who may call the API", read=_auth)
    lifecycle: LifecycleSettings = setting(LifecycleSettings(), "preloading, file watching, memory budget")
    host: HostSettings = setting(HostSettings(), "how the daemon uses its hardware")
    responses: ResponsesSettings = setting(ResponsesSettings(), "the Responses API's store")
    console: ConsoleSettings = setting(ConsoleSettings(), "the web console at /ui", read=_console)
    source: Path | None = None  # the file it was read from; no setting


# Defaults other modules name (the systemd unit's tests, the front door's), read from the declarations.
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = ServerSettings().shutdown_timeout_s
DEFAULT_HEADER_TIMEOUT_S: Final = ServerSettings().header_timeout_s
DEFAULT_BODY_TIMEOUT_S: Final = ServerSettings().body_timeout_s
DEFAULT_KEEPALIVE_TIMEOUT_S: Final = ServerSettings().keepalive_timeout_s
DEFAULT_MAX_CONNECTIONS: Final = ServerSettings().max_connections
DEFAULT_MAX_CONNECTIONS_PER_CLIENT: Final = ServerSettings().max_connections_per_client
DEFAULT_PRELOAD_DIR: Final = LifecycleSettings().preload_dir


def parse_settings(data: object, *, base_dir: Path) -> Settings:
    """Validate already-parsed YAML data into Settings, raising ConfigError with every problem."""
    checker = _Checker()
    settings: Settings = _section(checker, Settings, data, _TOP_LEVEL, base_dir.absolute(), null_ok=False)
    if checker.problems:
        raise ConfigError(checker.problems)
    return settings


def _duplicate_keys(root: yaml.Node) -> list[str]:
    """Problems for keys repeated in one mapping, which yaml.safe_load silently collapses."""
    problems: list[tuple[int, str]] = []
    seen_nodes: set[int] = set()  # aliases share nodes; visit each once
    pending: list[tuple[yaml.Node, str]] = [(root, _TOP_LEVEL)]
    while pending:
        node, path = pending.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            pending.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                child = _join(path, key_node.value)
                line = key_node.start_mark.line + 1
                key = (key_node.tag, key_node.value)
                if key in first_line:
                    problems.append((line, f"{child}: duplicate key (lines {first_line[key]} and {line})"))
                else:
                    first_line[key] = line
                pending.append((value_node, child))
    return [problem for _, problem in sorted(problems)]


def _read_yaml(path: Path) -> tuple[object, list[str]]:
    """The file's parsed YAML and any problems with the file itself."""
    where = str(path)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES)  # a FIFO in its place never blocks the start
    except FileTooLarge:
        return None, [f"{where}: config file is larger than {MAX_CONFIG_BYTES} bytes"]
    except NotRegularFile as exc:
        reason = "Is a directory" if exc.kind == "a directory" else exc.describe("it")
        return None, [f"{where}: cannot read config file: {reason}"]
    except OSError as exc:
        return None, [f"{where}: cannot read config file: {exc.strerror or type(exc).__name__}"]
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return None, [f"{where}: config file is not UTF-8 (bad byte at offset {exc.start})"]
    try:
        data = yaml.safe_load(text)
        duplicates = _duplicate_keys(node) if (node := yaml.compose(text, yaml.SafeLoader)) else []
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        # e.g. context "while parsing a flow sequence", problem "expected ',' or ']', but ..."
        reason = _show_reason("; ".join(part for part in (exc.context, exc.problem) if part))
        # A constructor error is well-formed YAML that safe_load refuses (a !!python tag).
        refused = isinstance(exc, yaml.constructor.ConstructorError)
        kind = "unsupported YAML" if refused else "YAML syntax error"
        return None, [f"{where}: {kind}{at}: {reason}"]
    except yaml.YAMLError as exc:
        return None, [f"{where}: YAML error: {_show_reason(str(exc).splitlines()[0])}"]
    except ValueError:  # an integer literal past sys.get_int_max_str_digits()
        return None, [f"{where}: YAML error: a number literal is too large"]
    except RecursionError:
        return None, [f"{where}: YAML error: nested too deeply"]
    if data is None:
        return None, [f"{where}: config file is empty (expected a mapping with a 'models' list)"]
    return data, duplicates


def _show_reason(reason: str) -> str:
    # PyYAML's reasons quote at most a character or a token; cap them anyway.
    return reason if len(reason) <= 120 else reason[:117] + "..."


def load_settings(path: str | Path) -> Settings:
    """Read and validate a YAML config file, raising ConfigError with every problem."""
    source = Path(path).absolute()
    data, problems = _read_yaml(Path(path))
    if data is None:
        raise ConfigError(problems)
    try:
        settings = parse_settings(data, base_dir=source.parent)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return replace(settings, source=source)


def check_config(path: str | Path) -> list[str]:
    """The problems with a config file: [] when it is valid."""
    try:
        load_settings(path)
    except ConfigError as exc:
        return exc.problems
    return []


# ---- the README's reference --------------------------------------------------------------------

README_BEGIN: Final = (
    "<!-- generated by `python -m edgellmd.settings --markdown` from the declarations "
    "in daemon/settings.py: edit those, then run it with --readme README.md -->"
)
README_END: Final = "<!-- end of the generated configuration reference -->"
_COMMENT_COLUMN: Final = 27  # where the YAML block's comments start, as far as the keys allow


def _yaml_text(value: object) -> str:
    """A value as the README's YAML block and table write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml_text(item) for item in value) + "]"
    if isinstance(value, str) and yaml.safe_load(value) != value:
        return json.dumps(value)  # JSON strings are YAML strings
    return str(value)


def _accepts(spec: _Spec) -> str:
    """What a setting accepts, in the words of its problems."""
    about, base = spec.about, spec.base
    if about.accepts:
        return about.accepts
    if base is int and about.bounds is not None:
        text = _integer_text(about.bounds, about.also, nullable=spec.nullable)
        return text + "".join(f", or `{value}`" for value in spec.literals)
    if base is str and about.choices:
        return ", ".join(f"`{choice}`" for choice in about.choices)
    plain = {
        float: "a finite number > 0",
        bool: "`true` or `false`",
        Path: "a path",
        str: about.wanted,
        tuple[str, ...]: f"a list, each {about.wanted}",
    }[base]
    return f"null or {plain}" if spec.nullable else plain


def _sections() -> Iterable[tuple[_Spec, type, bool]]:
    """Each top-level key, its settings class, and whether it holds a list of them."""
    for top in _declared(Settings):
        listed = not is_dataclass(top.base)
        yield top, typing.get_args(top.hint)[0] if listed else top.base, listed


def _commented(text: str, doc: str) -> str:
    return f"{text.ljust(_COMMENT_COLUMN)}# {doc}" if len(text) < _COMMENT_COLUMN else f"{text}  # {doc}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """The README's configuration reference: a YAML block of every key and a table, from the declarations."""
    block = ["```yaml"]
    table = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    for top, cls, listed in _sections():
        block.append(_commented(f"{top.name}:", top.about.doc))
        _reference_rows(
            cls, f"{top.name}{'[]' if listed else ''}", "  ", listed=listed, block=block, table=table
        )
    block.append("```")
    return "\n".join([*block, "", *table]) + "\n"


def _reference_rows(
    cls: type, prefix: str, indent: str, *, listed: bool, block: list[str], table: list[str]
) -> None:
    """One section's keys; a key that is a section of its own (`speculative`) nests its keys."""
    for index, spec in enumerate(_declared(cls)):
        lead = indent + ("- " if index == 0 else "  ") if listed else indent
        key = f"{prefix}.{spec.name}"
        if isinstance(spec.base, type) and is_dataclass(spec.base):
            block.append(_commented(f"{lead}{spec.name}:", spec.about.doc))
            _reference_rows(
                spec.base, key, indent + ("    " if listed else "  "), listed=False, block=block, table=table
            )
            continue
        default = None if spec.default is MISSING else spec.default
        shown = spec.about.example if spec.about.example is not None else _yaml_text(default)
        block.append(_commented(f"{lead}{spec.name}: {shown}", spec.about.doc))
        more = spec.about.more
        meaning = spec.about.doc + ((" " if more.startswith("(") else "; ") + more if more else "")
        default_cell = "required" if spec.required else f"`{_yaml_text(default)}`"
        table.append(f"| `{key}` | {default_cell} | {_cell(_accepts(spec))} | {_cell(meaning)} |")


def with_reference(readme: str) -> str:
    """`readme` with the text between README_BEGIN and README_END replaced by the reference."""
    begin, end = readme.index(README_BEGIN) + len(README_BEGIN), readme.index(README_END)
    return f"{readme[:begin]}\n{reference_markdown()}{readme[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m edgellmd.settings --markdown [--readme FILE]`: print the reference, or rewrite FILE's."""
    parser = argparse.ArgumentParser(
        prog="python -m edgellmd.settings", description="The configuration reference, from the declarations."
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        required=True,
        help="print the README's Configuration reference (a YAML block and a table)",
    )
    parser.add_argument(
        "--readme", type=Path, help="rewrite it between the markers in this file instead of printing it"
    )
    args = parser.parse_args(argv)
    if args.readme is None:
        sys.stdout.write(reference_markdown())
        return 0
    text = args.readme.read_text(encoding="utf-8")
    try:
        updated = with_reference(text)
    except ValueError:
        sys.stderr.write(f"{args.readme}: no {README_BEGIN} ... {README_END} markers\n")
        return 1
    if updated != text:
        args.readme.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
