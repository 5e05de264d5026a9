"""Daemon configuration: one YAML file validated once into frozen dataclasses."""

from __future__ import annotations

import ipaddress
import math
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Final, TypeGuard

import yaml

from edgellmd.host.cpu import AUTO as AUTO_CPUS
from edgellmd.host.cpu import CpuListError, parse_cpu_list

# Defaults. Any change here must be reflected in the README's Configuration section and in
# the Ansible role's defaults/main.yml.
DEFAULT_HOST: Final = "127.0.0.1"  # loopback: exposing the daemon is an explicit decision
DEFAULT_PORT: Final = 8080
DEFAULT_MAX_BODY_BYTES: Final = 1_048_576
DEFAULT_MAX_TOKENS_LIMIT: Final = 4096
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0
DEFAULT_STREAM_WRITE_TIMEOUT_S: Final = 30.0
DEFAULT_HEADER_TIMEOUT_S: Final = 10.0
DEFAULT_BODY_TIMEOUT_S: Final = 30.0  # a 1 MiB body at 35 KB/s; a slower upload is a held connection
DEFAULT_KEEPALIVE_TIMEOUT_S: Final = 75.0  # as nginx, and the role's HAProxy http-keep-alive
DEFAULT_PROGRESS_TIMEOUT_S: Final = 300.0
DEFAULT_MAX_CONNECTIONS: Final = 1024
# One address may hold a quarter of the global cap: room for an app server's pool of a few
# hundred streams (or a NAT gateway's users), while one address's slow-loris heads or
# never-ending bodies leave three quarters of the connections to everybody else.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT: Final = 256
MAX_CONNECTIONS_RANGE: Final = (1, 1_000_000)
DEFAULT_LOG_LEVEL: Final = "info"
DEFAULT_LOG_FORMAT: Final = "json"
DEFAULT_CONTEXT_SIZE: Final = 4096
DEFAULT_SLOTS: Final = 4
DEFAULT_BATCH_SIZE: Final = 512
DEFAULT_GPU_LAYERS: Final = 0
DEFAULT_QUEUE_SIZE: Final = 16
DEFAULT_PRELOAD_DIR: Final = Path("/dev/shm/edgellm")  # noqa: S108 - tmpfs on purpose: models load from RAM
DEFAULT_WATCH_SETTLE_S: Final = 2.0
DEFAULT_GPU_POLL_S: Final = 10.0
DEFAULT_GPU_HEADROOM_MB: Final = 1024  # CUDA context, compute buffers and fragmentation

# Limits on what a config may ask for.
PORT_RANGE: Final = (1, 65535)
BODY_BYTES_RANGE: Final = (1024, None)
MAX_TOKENS_LIMIT_RANGE: Final = (1, None)
CONTEXT_SIZE_RANGE: Final = (64, 1_048_576)
SLOTS_RANGE: Final = (1, 256)
THREADS_RANGE: Final = (1, 1024)
BATCH_SIZE_RANGE: Final = (1, 65536)
GPU_LAYERS_RANGE: Final = (0, 100_000)  # plus -1, meaning every layer
GPU_LAYERS_ALL: Final = -1
GPU_LAYERS_AUTO: Final = -2  # `gpu_layers: auto`: as many as fit in free VRAM, decided at load time
QUEUE_SIZE_RANGE: Final = (0, 100_000)
MEMORY_BUDGET_MB_RANGE: Final = (1, None)
GPU_HEADROOM_MB_RANGE: Final = (0, None)
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("json", "text")
MAX_CONFIG_BYTES: Final = 1_048_576  # a config file is a few hundred bytes; refuse anything absurd

_MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
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


class ConfigError(Exception):
    """Raised with every problem found; .problems is a list[str], each 'key.path: message'."""

    problems: list[str]

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The HTTP listener and per-request limits."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT  # ceiling on any request's max_tokens
    default_max_tokens: int | None = None  # None: until the slot's context is full
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S  # a client that stops reading is cut
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # deadline for each request head, from its first byte
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # deadline for each request body, from the end of its head
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S  # an idle kept-alive connection is closed then
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S  # longest wait for a request's next token
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections beyond this are closed at once
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT  # likewise, from one address
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, the daemon speaks HTTPS
    tls_key: Path | None = None  # PEM private key
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; empty: no CORS


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    """Log level and line format."""

    level: str = DEFAULT_LOG_LEVEL
    format: str = DEFAULT_LOG_FORMAT


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """Who may call the API."""

    keys_file: Path | None = None  # YAML of hashed API keys (0600); None: no authentication
    admin_cidrs: tuple[str, ...] = ()  # /admin/* only from these networks; empty: from anywhere
    metrics_public: bool = False  # /metrics without a key (else the metrics scope is needed)


@dataclass(frozen=True, slots=True)
class LockSettings:
    """Where the signed lockfile, its trusted keys, the model files and the rollback state live."""

    file: Path | None = None  # the signed models.lock
    trusted_keys: tuple[Path, ...] = ()  # PEM Ed25519 public keys; several allow rotation
    models_dir: Path | None = None  # lockfile paths are relative to this
    state_dir: Path | None = None  # the highest accepted lockfile version is kept here
    allow_unsigned: bool = False  # development only: models load from models[].file unverified


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One served model and how llama.cpp loads it."""

    name: str
    # Unsigned (development) mode only: with a lockfile the lock names the file. Absolute.
    file: Path | None
    context_size: int = DEFAULT_CONTEXT_SIZE  # tokens per slot
    slots: int = DEFAULT_SLOTS
    threads: int | None = None  # None: decided at load time
    threads_batch: int | None = None  # None: decided at load time
    batch_size: int = DEFAULT_BATCH_SIZE  # llama.cpp n_batch, also the prefill chunk
    gpu_layers: int = DEFAULT_GPU_LAYERS  # -1: all layers; GPU_LAYERS_AUTO: what fits in VRAM
    chat_template: str | None = None  # a llama.cpp built-in template name
    chat_template_file: Path | None = None  # a Jinja2 template file; absolute
    queue_size: int = DEFAULT_QUEUE_SIZE  # requests that may wait for a slot; more get 429
    embedding: bool = False  # an embedding model: served by /v1/embeddings only
    evictable: bool = False  # may be unloaded (least recently used first) to fit another in the budget


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """Where models are preloaded, how file changes are watched, and the memory they may use."""

    # Models are copied here (tmpfs) while they are hashed and loaded from the copy; None:
    # loaded from the models directory. Each daemon keeps its copies in a subdirectory.
    preload_dir: Path | None = DEFAULT_PRELOAD_DIR
    preload_max_mb: int | None = None  # cap on what the copies may occupy; None: the free space
    watch: bool = True  # reload when a model file or the lockfile changes
    watch_settle_s: float = DEFAULT_WATCH_SETTLE_S  # a file must be unchanged this long first
    memory_budget_mb: int | None = None  # loaded models' estimated size; None: no budget


@dataclass(frozen=True, slots=True)
class HostSettings:
    """How the daemon uses its hardware."""

    cpus: str | None = None  # "0-3,8" or "auto" (one per physical core); None: what it is allowed
    gpu_poll_s: float = DEFAULT_GPU_POLL_S  # NVML polling interval
    gpu_headroom_mb: int = DEFAULT_GPU_HEADROOM_MB  # VRAM left free by gpu_layers: auto


@dataclass(frozen=True, slots=True)
class Settings:
    """The whole daemon configuration."""

    server: ServerSettings
    models: tuple[ModelSettings, ...]
    logging: LoggingSettings
    lock: LockSettings = LockSettings(allow_unsigned=True)
    auth: AuthSettings = AuthSettings()
    lifecycle: LifecycleSettings = LifecycleSettings()
    host: HostSettings = HostSettings()
    source: Path | None = None  # the file it was read from


_SERVER_KEYS: Final = tuple(f.name for f in fields(ServerSettings))
_LOGGING_KEYS: Final = tuple(f.name for f in fields(LoggingSettings))
_MODEL_KEYS: Final = tuple(f.name for f in fields(ModelSettings))
_LOCK_KEYS: Final = tuple(f.name for f in fields(LockSettings))
_AUTH_KEYS: Final = tuple(f.name for f in fields(AuthSettings))
_LIFECYCLE_KEYS: Final = tuple(f.name for f in fields(LifecycleSettings))
_HOST_KEYS: Final = tuple(f.name for f in fields(HostSettings))
_TOP_KEYS: Final = ("server", "models", "logging", "lock", "auth", "lifecycle", "host")


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


def _range_text(bounds: tuple[int, int | None]) -> str:
    low, high = bounds
    return f">= {low}" if high is None else f"from {low} to {high}"


class _Checker:
    """Collects problems; each check returns a well-typed fallback so parsing carries on."""

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

    def integer(
        self,
        data: Mapping[str, object],
        path: str,
        key: str,
        default: int,
        bounds: tuple[int, int | None],
        *,
        also: int | None = None,
    ) -> int:
        if key not in data:
            return default
        value = data[key]
        if _is_int(value) and (value == also or _within(value, bounds)):
            return value
        wanted = f"an integer {_range_text(bounds)}"
        if also is not None:
            wanted = f"{also} or {wanted}"
        self.add(_join(path, key), f"must be {wanted}, got {_show(value)}")
        return default

    def optional_integer(
        self, data: Mapping[str, object], path: str, key: str, bounds: tuple[int, int | None]
    ) -> int | None:
        value = data.get(key)
        if value is None or (_is_int(value) and _within(value, bounds)):
            return value
        wanted = f"null or an integer {_range_text(bounds)}"
        self.add(_join(path, key), f"must be {wanted}, got {_show(value)}")
        return None

    def positive_number(
        self, data: Mapping[str, object], path: str, key: str, default: float
    ) -> float:
        value = data.get(key, default)
        if _is_int(value) or isinstance(value, float):
            try:
                number = float(value)
            except OverflowError:  # an int beyond any float
                number = math.inf
            if math.isfinite(number) and number > 0:
                return number
        self.add(_join(path, key), f"must be a finite number > 0, got {_show(value)}")
        return default

    def boolean(self, data: Mapping[str, object], path: str, key: str, *, default: bool) -> bool:
        value = data.get(key, default)
        if isinstance(value, bool):
            return value
        self.add(_join(path, key), f"must be true or false, got {_show(value)}")
        return default

    def choice(
        self,
        data: Mapping[str, object],
        path: str,
        key: str,
        default: str,
        options: tuple[str, ...],
    ) -> str:
        value = data.get(key, default)
        if isinstance(value, str) and value.lower() in options:
            return value.lower()
        self.add(_join(path, key), f"must be one of {', '.join(options)}, got {_show(value)}")
        return default

    def text(
        self,
        data: Mapping[str, object],
        path: str,
        key: str,
        pattern: re.Pattern[str],
        wanted: str,
    ) -> str | None:
        """A string matching pattern; None when absent (the caller decides if that is allowed)."""
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, str) and pattern.fullmatch(value):
            return value
        self.add(_join(path, key), f"must be {wanted}, got {_show(value)}")
        return None

    def file_path(
        self, data: Mapping[str, object], path: str, key: str, base_dir: Path
    ) -> Path | None:
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, str) and value.strip() and "\0" not in value:
            # Relative to the config file, never the working directory; symlinks kept as written.
            return base_dir / value  # an absolute value replaces base_dir
        self.add(_join(path, key), f"must be a non-empty string (a file path), got {_show(value)}")
        return None


def _is_int(value: object) -> TypeGuard[int]:
    # bool is a subclass of int, and YAML's yes/no/true/false are no port numbers.
    return isinstance(value, int) and not isinstance(value, bool)


def _within(value: int, bounds: tuple[int, int | None]) -> bool:
    low, high = bounds
    return value >= low and (high is None or value <= high)


def _parse_server(checker: _Checker, value: object, base_dir: Path) -> ServerSettings:
    path = "server"
    data = checker.section(value, path, _SERVER_KEYS, null_ok=True)
    host = data.get("host", DEFAULT_HOST)
    if not isinstance(host, str) or not host or any(char.isspace() for char in host):
        checker.add(f"{path}.host", f"must be a non-empty host name or address, got {_show(host)}")
        host = DEFAULT_HOST
    limit = checker.integer(
        data, path, "max_tokens_limit", DEFAULT_MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT_RANGE
    )
    tls_cert, tls_key = _tls_pair(checker, data, base_dir)
    return ServerSettings(
        host=host,
        port=checker.integer(data, path, "port", DEFAULT_PORT, PORT_RANGE),
        max_body_bytes=checker.integer(
            data, path, "max_body_bytes", DEFAULT_MAX_BODY_BYTES, BODY_BYTES_RANGE
        ),
        max_tokens_limit=limit,
        # Bounded by the limit as parsed (its default if the limit itself is wrong).
        default_max_tokens=checker.optional_integer(data, path, "default_max_tokens", (1, limit)),
        shutdown_timeout_s=checker.positive_number(
            data, path, "shutdown_timeout_s", DEFAULT_SHUTDOWN_TIMEOUT_S
        ),
        stream_write_timeout_s=checker.positive_number(
            data, path, "stream_write_timeout_s", DEFAULT_STREAM_WRITE_TIMEOUT_S
        ),
        header_timeout_s=checker.positive_number(
            data, path, "header_timeout_s", DEFAULT_HEADER_TIMEOUT_S
        ),
        body_timeout_s=checker.positive_number(data, path, "body_timeout_s", DEFAULT_BODY_TIMEOUT_S),
        keepalive_timeout_s=checker.positive_number(
            data, path, "keepalive_timeout_s", DEFAULT_KEEPALIVE_TIMEOUT_S
        ),
        progress_timeout_s=checker.positive_number(
            data, path, "progress_timeout_s", DEFAULT_PROGRESS_TIMEOUT_S
        ),
        max_connections=checker.integer(
            data, path, "max_connections", DEFAULT_MAX_CONNECTIONS, MAX_CONNECTIONS_RANGE
        ),
        # Not checked against max_connections: above it, the global cap is the one that bites.
        max_connections_per_client=checker.integer(
            data, path, "max_connections_per_client", DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
            MAX_CONNECTIONS_RANGE,
        ),
        tls_cert=tls_cert,
        tls_key=tls_key,
        cors_origins=_string_list(checker, data, path, "cors_origins", pattern=_ORIGIN,
                                  wanted="an origin like https://app.example:8443"),
    )


def _string_list(checker: _Checker, data: Mapping[str, object], path: str, key: str, *,
                 pattern: re.Pattern[str], wanted: str) -> tuple[str, ...]:
    value = data.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        checker.add(f"{path}.{key}", f"must be a list, got {_show(value)}")
        return ()
    out: list[str] = []
    for i, item in enumerate(value):
        if isinstance(item, str) and pattern.fullmatch(item):
            out.append(item)
        else:
            checker.add(f"{path}.{key}[{i}]", f"must be {wanted}, got {_show(item)}")
    return tuple(out)


def _tls_pair(checker: _Checker, data: Mapping[str, object],
              base_dir: Path) -> tuple[Path | None, Path | None]:
    cert = checker.file_path(data, "server", "tls_cert", base_dir)
    key = checker.file_path(data, "server", "tls_key", base_dir)
    if (data.get("tls_cert") is None) != (data.get("tls_key") is None):
        checker.add("server.tls_cert", "tls_cert and tls_key go together: set both or neither")
    return cert, key


def _parse_logging(checker: _Checker, value: object) -> LoggingSettings:
    data = checker.section(value, "logging", _LOGGING_KEYS, null_ok=True)
    return LoggingSettings(
        level=checker.choice(data, "logging", "level", DEFAULT_LOG_LEVEL, LOG_LEVELS),
        format=checker.choice(data, "logging", "format", DEFAULT_LOG_FORMAT, LOG_FORMATS),
    )


def _parse_model(checker: _Checker, value: object, path: str, base_dir: Path) -> ModelSettings:
    data = checker.section(value, path, _MODEL_KEYS, null_ok=False)
    name = checker.text(
        data,
        path,
        "name",
        _MODEL_NAME,
        "1 to 64 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit",
    )
    file = checker.file_path(data, path, "file", base_dir)
    if isinstance(value, dict) and data.get("name") is None:  # non-mappings are reported already
        checker.add(f"{path}.name", "required")
    chat_template = checker.text(
        data,
        path,
        "chat_template",
        _TEMPLATE_NAME,
        "a built-in template name of 1 to 64 characters of a-z 0-9 _ . -",
    )
    chat_template_file = checker.file_path(data, path, "chat_template_file", base_dir)
    if data.get("chat_template") is not None and data.get("chat_template_file") is not None:
        checker.add(
            f"{path}.chat_template",
            f"cannot be combined with {path}.chat_template_file; set only one of them",
        )
    return ModelSettings(
        name=name or "",
        file=file,
        context_size=checker.integer(
            data, path, "context_size", DEFAULT_CONTEXT_SIZE, CONTEXT_SIZE_RANGE
        ),
        slots=checker.integer(data, path, "slots", DEFAULT_SLOTS, SLOTS_RANGE),
        threads=checker.optional_integer(data, path, "threads", THREADS_RANGE),
        threads_batch=checker.optional_integer(data, path, "threads_batch", THREADS_RANGE),
        batch_size=checker.integer(data, path, "batch_size", DEFAULT_BATCH_SIZE, BATCH_SIZE_RANGE),
        gpu_layers=GPU_LAYERS_AUTO if data.get("gpu_layers") == "auto" else checker.integer(
            data, path, "gpu_layers", DEFAULT_GPU_LAYERS, GPU_LAYERS_RANGE, also=GPU_LAYERS_ALL
        ),
        chat_template=chat_template,
        chat_template_file=chat_template_file,
        queue_size=checker.integer(data, path, "queue_size", DEFAULT_QUEUE_SIZE, QUEUE_SIZE_RANGE),
        embedding=checker.boolean(data, path, "embedding", default=False),
        evictable=checker.boolean(data, path, "evictable", default=False),
    )


def _parse_models(checker: _Checker, value: object, base_dir: Path) -> tuple[ModelSettings, ...]:
    if not isinstance(value, list) or not value:
        checker.add("models", f"must be a non-empty list of model mappings, got {_show(value)}")
        return ()
    models = tuple(
        _parse_model(checker, entry, f"models[{index}]", base_dir)
        for index, entry in enumerate(value)
    )
    first_seen: dict[str, int] = {}
    for index, model in enumerate(models):
        if not model.name:  # missing or invalid, already reported
            continue
        if model.name in first_seen:
            checker.add(
                f"models[{index}].name",
                f"duplicate model name {model.name!r} (also models[{first_seen[model.name]}])",
            )
        else:
            first_seen[model.name] = index
    return models


def _parse(checker: _Checker, data: object, base_dir: Path) -> Settings:
    top = checker.section(data, _TOP_LEVEL, _TOP_KEYS, null_ok=False)
    server = _parse_server(checker, top.get("server"), base_dir)
    if isinstance(data, dict):  # a non-mapping top level has already been reported
        if "models" in top:
            models = _parse_models(checker, top["models"], base_dir)
        else:
            checker.add("models", "required; must be a non-empty list of model mappings")
            models = ()
    else:
        models = ()
    logging = _parse_logging(checker, top.get("logging"))
    lock = _parse_lock(checker, top.get("lock"), base_dir) if isinstance(data, dict) else LockSettings()
    if isinstance(data, dict) and models:
        _check_model_files(checker, top.get("models"), lock)
    auth_data = checker.section(top.get("auth"), "auth", _AUTH_KEYS, null_ok=True)
    cidrs = _string_list(checker, auth_data, "auth", "admin_cidrs", pattern=_CIDR,
                         wanted="a network like 10.0.0.0/8")
    for i, cidr in enumerate(cidrs):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            checker.add(f"auth.admin_cidrs[{i}]", f"must be a network like 10.0.0.0/8, got {_show(cidr)}")
    metrics_public = checker.boolean(auth_data, "auth", "metrics_public", default=False)
    auth = AuthSettings(keys_file=checker.file_path(auth_data, "auth", "keys_file", base_dir),
                        admin_cidrs=cidrs, metrics_public=metrics_public)
    if auth.keys_file is None and not _is_loopback(server.host):
        checker.add("server.host", f"{server.host!r} is not a loopback address: serving a network "
                    "without API keys is refused; set auth.keys_file")
    lifecycle = _parse_lifecycle(checker, top.get("lifecycle"), base_dir)
    host = _parse_host(checker, top.get("host"))
    return Settings(server=server, models=models, logging=logging, lock=lock, auth=auth,
                    lifecycle=lifecycle, host=host)


def _parse_host(checker: _Checker, value: object) -> HostSettings:
    path = "host"
    data = checker.section(value, path, _HOST_KEYS, null_ok=True)
    cpus = data.get("cpus")
    if isinstance(cpus, int) and not isinstance(cpus, bool):
        cpus = str(cpus)  # `cpus: 3` in YAML is an int
    if cpus is not None:
        if not isinstance(cpus, str):
            checker.add(f"{path}.cpus", f"must be a CPU list like \"0-3,8\" or \"auto\", got {_show(cpus)}")
            cpus = None
        elif cpus.strip().lower() == AUTO_CPUS:
            cpus = AUTO_CPUS
        else:
            try:
                parse_cpu_list(cpus)
            except CpuListError as exc:
                checker.add(f"{path}.cpus", f"{exc}, got {_show(cpus)}")
                cpus = None
    return HostSettings(
        cpus=cpus,
        gpu_poll_s=checker.positive_number(data, path, "gpu_poll_s", DEFAULT_GPU_POLL_S),
        gpu_headroom_mb=checker.integer(data, path, "gpu_headroom_mb", DEFAULT_GPU_HEADROOM_MB,
                                        GPU_HEADROOM_MB_RANGE),
    )


def _parse_lifecycle(checker: _Checker, value: object, base_dir: Path) -> LifecycleSettings:
    path = "lifecycle"
    data = checker.section(value, path, _LIFECYCLE_KEYS, null_ok=True)
    preload_dir: Path | None = DEFAULT_PRELOAD_DIR
    if "preload_dir" in data:
        preload_dir = checker.file_path(data, path, "preload_dir", base_dir)
    return LifecycleSettings(
        preload_dir=preload_dir,
        preload_max_mb=checker.optional_integer(data, path, "preload_max_mb", MEMORY_BUDGET_MB_RANGE),
        watch=checker.boolean(data, path, "watch", default=True),
        watch_settle_s=checker.positive_number(data, path, "watch_settle_s", DEFAULT_WATCH_SETTLE_S),
        memory_budget_mb=checker.optional_integer(data, path, "memory_budget_mb",
                                                  MEMORY_BUDGET_MB_RANGE),
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _parse_lock(checker: _Checker, value: object, base_dir: Path) -> LockSettings:
    path = "lock"
    if value is None:
        checker.add(path, "required: name the signed lockfile (lock.file, lock.trusted_keys, "
                    "lock.models_dir, lock.state_dir), or set lock.allow_unsigned: true for development")
        return LockSettings(allow_unsigned=True)
    data = checker.section(value, path, _LOCK_KEYS, null_ok=False)
    unsigned = checker.boolean(data, path, "allow_unsigned", default=False)
    locations = ("file", "models_dir", "state_dir")
    if unsigned:
        for key in (*locations, "trusted_keys"):
            if key in data:
                checker.add(f"{path}.{key}", "cannot be combined with lock.allow_unsigned: true")
        return LockSettings(allow_unsigned=True)
    found = {key: checker.file_path(data, path, key, base_dir) for key in locations}
    for key in locations:
        if key not in data:
            checker.add(f"{path}.{key}", "required")
    keys: list[Path] = []
    raw_keys = data.get("trusted_keys")
    if not isinstance(raw_keys, list) or not raw_keys:
        checker.add(f"{path}.trusted_keys",
                    f"must be a non-empty list of public key files, got {_show(raw_keys)}")
    else:
        for index, item in enumerate(raw_keys):
            if isinstance(item, str) and item.strip() and "\0" not in item:
                keys.append(base_dir / item)
            else:
                checker.add(f"{path}.trusted_keys[{index}]",
                            f"must be a non-empty string (a file path), got {_show(item)}")
    return LockSettings(file=found["file"], trusted_keys=tuple(keys), models_dir=found["models_dir"],
                        state_dir=found["state_dir"])


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
            checker.add(f"models[{index}].file",
                        "not allowed with a lockfile: the lock names each model's file")


def parse_settings(data: object, *, base_dir: Path) -> Settings:
    """Validate already-parsed YAML data into Settings, raising ConfigError with every problem."""
    checker = _Checker()
    settings = _parse(checker, data, base_dir.absolute())
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
                    problems.append(
                        (line, f"{child}: duplicate key (lines {first_line[key]} and {line})")
                    )
                else:
                    first_line[key] = line
                pending.append((value_node, child))
    return [problem for _, problem in sorted(problems)]


def _read_yaml(path: Path) -> tuple[object, list[str]]:
    """The file's parsed YAML and any problems with the file itself."""
    where = str(path)
    try:
        with path.open("rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        return None, [f"{where}: cannot read config file: {exc.strerror or type(exc).__name__}"]
    if len(raw) > MAX_CONFIG_BYTES:
        return None, [f"{where}: config file is larger than {MAX_CONFIG_BYTES} bytes"]
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
