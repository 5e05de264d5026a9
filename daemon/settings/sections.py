"""The settings: a frozen dataclass per section of the YAML file, and the rules some settings have.

Each field is declared once with `setting()` (`settings.declare`); the few settings whose value
depends on another, on the file system or on a syntax of their own hook a reader to their
field here.
"""

# ruff: noqa: RUF009 - setting() is this package's dataclass field specifier: it returns
# dataclasses.field(default=..., metadata=...), which RUF009 accepts when it is spelled out.

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from edgellmd.host import verdicts
from edgellmd.host.cpu import AUTO as AUTO_CPUS
from edgellmd.host.cpu import CpuListError, parse_cpu_list
from edgellmd.host.verdicts import GpuLayers
from edgellmd.settings.declare import (
    Bounds,
    Checker,
    Field,
    about,
    is_int,
    join_path,
    read_section,
    setting,
    show,
)

MAX_CONFIG_BYTES: Final = 1_048_576  # a config file is a few hundred bytes; refuse anything absurd
GPU_LAYERS_ALL: Final = -1  # `gpu_layers: -1`: every layer, and the output layer
GPU_LAYERS_AUTO: Final = verdicts.GPU_LAYERS_AUTO  # "auto"; the loader and doctor compare with it here
# Model names: the config's models[].name and the lockfile's members (models.lockfile reads it here).
MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
CONNECTIONS: Final[Bounds] = (1, 1_000_000)
THREADS: Final[Bounds] = (1, 1024)
MEGABYTES: Final[Bounds] = (1, None)
_TEMPLATE_NAME: Final = re.compile(r"[a-z0-9_.-]{1,64}")
_ORIGIN: Final = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")
_CIDR: Final = re.compile(r"[0-9A-Fa-f.:]+(/[0-9]{1,3})?")
# An OTLP/HTTP endpoint: scheme, host (name, IPv4 or [IPv6]) and port, and a plain path.
_OTLP_URL: Final = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]{1,255}(/[A-Za-z0-9._~/-]{0,255})?")
_SERVICE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FETCH_HOST: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]")


# ---- the settings with rules of their own ----------------------------------------------------


def _server_host(f: Field) -> Any:
    host = f.data.get(f.spec.name, f.default)
    if not isinstance(host, str) or not host or any(char.isspace() for char in host):
        f.problem(f"must be a non-empty host name or address, got {show(host)}")
        return f.default
    return host


def _default_max_tokens(f: Field) -> Any:
    # Bounded by the limit as parsed (its default if the limit itself is wrong).
    return f.integer((1, f.parsed["max_tokens_limit"]))


def _tls_key(f: Field) -> Any:
    key = f.file_path()
    if (f.data.get("tls_cert") is None) != (f.value is None):
        f.checker.add(
            join_path(f.section, "tls_cert"), "tls_cert and tls_key go together: set both or neither"
        )
    return key


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def _admin_cidrs(f: Field) -> Any:
    return f.strings(valid=_is_network)


def _model_name(f: Field) -> Any:
    name = f.string()
    if f.value is None and f.mapping:  # a non-mapping model is reported already
        f.problem("required")
    return name or ""


def _chat_template_file(f: Field) -> Any:
    path = f.file_path()
    if f.value is not None and f.data.get("chat_template") is not None:
        f.checker.add(
            join_path(f.section, "chat_template"), f"cannot be combined with {f.path}; set only one of them"
        )
    return path


def _time_zone(f: Field) -> Any:
    zone = f.value if f.given else f.default
    if not isinstance(zone, str) or not zone or len(zone) > 64:
        f.problem(f"must be an IANA time zone name like UTC or Europe/Berlin, got {show(zone)}")
        return f.default
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        f.problem(f"is not a time zone this box knows (IANA names like Europe/Berlin), got {show(zone)}")
        return f.default
    return zone


def _ratio(f: Field) -> Any:
    value = f.value if f.given else f.default
    if (is_int(value) or isinstance(value, float)) and 0 <= value <= 1:
        return float(value)
    f.problem(f"must be a number from 0 to 1, got {show(value)}")
    return f.default


def _cpus(f: Field) -> Any:
    cpus = f.value
    if is_int(cpus):
        cpus = str(cpus)  # `cpus: 3` in YAML is an int
    if cpus is None:
        return None
    if not isinstance(cpus, str):
        f.problem(f'must be a CPU list like "0-3,8" or "auto", got {show(cpus)}')
        return None
    if cpus.strip().lower() == AUTO_CPUS:
        return AUTO_CPUS
    try:
        parse_cpu_list(cpus)
    except CpuListError as exc:
        f.problem(f"{exc}, got {show(cpus)}")
        return None
    return cpus


def _unsigned(f: Field) -> bool:
    return f.data.get("allow_unsigned") is True


def _lock_path(f: Field) -> Any:
    """lock.file, models_dir, state_dir: required with a lockfile, refused without one."""
    if _unsigned(f):
        if f.given:
            f.problem("cannot be combined with lock.allow_unsigned: true")
        return None
    if not f.given:
        f.problem("required")
    return f.file_path()


def _trusted_keys(f: Field) -> Any:
    if _unsigned(f):
        if f.given:
            f.problem("cannot be combined with lock.allow_unsigned: true")
        return ()
    raw = f.value
    if not isinstance(raw, list) or not raw:
        f.problem(f"must be a non-empty list of public key files, got {show(raw)}")
        return ()
    keys: list[Path] = []
    for index, item in enumerate(raw):
        if isinstance(item, str) and item.strip() and "\0" not in item:
            keys.append(f.base_dir / item)
        else:
            f.checker.add(f"{f.path}[{index}]", f"must be a non-empty string (a file path), got {show(item)}")
    return tuple(keys)


def _models(f: Field) -> Any:
    if not f.mapping:  # a non-mapping top level is reported already
        return ()
    if not f.given:
        f.problem("required; must be a non-empty list of model mappings")
        return ()
    if not isinstance(f.value, list) or not f.value:
        f.problem(f"must be a non-empty list of model mappings, got {show(f.value)}")
        return ()
    models = tuple(
        read_section(f.checker, ModelSettings, entry, f"{f.path}[{index}]", f.base_dir, null_ok=False)
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


def _probability(f: Field) -> Any:
    """speculative.draft_p_min: a number from 0 to 1 (the generic float reader wants one > 0)."""
    value = f.value
    if not f.given:
        return f.default
    if (is_int(value) or isinstance(value, float)) and 0 <= value <= 1:  # NaN fails both
        return float(value)
    f.problem(f"must be a number from 0 to 1, got {show(value)}")
    return f.default


def _check_model(checker: Checker, model: ModelSettings, path: str) -> None:
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
    if model.memory_limit_mb is not None:
        if model.isolation != "process":
            checker.add(f"{path}.memory_limit_mb", "limits an engine process: only with isolation process")
        elif model.gpu_layers != 0:
            checker.add(
                f"{path}.memory_limit_mb",
                "not with gpu_layers: a CUDA runtime reserves more address space than any limit allows",
            )
    if model.embedding and model.kind == "rerank":
        checker.add(
            f"{path}.embedding", "`embedding: true` is `kind: embedding`; a rerank model leaves it out"
        )
    if model.pooled:
        what = f"a{'n' if model.serves == 'embedding' else ''} {model.serves} model"
        if spec.mode != "none":
            checker.add(f"{path}.speculative.mode", f"{what} generates no text to draft")
        if model.prompt_cache_mb:
            checker.add(f"{path}.prompt_cache_mb", f"{what} keeps no prompt cache")
        for key, value in (("mmproj", model.mmproj), ("mmproj_file", model.mmproj_file)):
            if value is not None:
                checker.add(
                    f"{path}.{key}", f"{what} reads no images or audio: a projector is for kind generation"
                )
    elif model.inputs_per_decode != 1:
        checker.add(
            f"{path}.inputs_per_decode",
            "packs the inputs of embedding and rerank models: a generation "
            "model batches its sequences anyway",
        )
    if model.mmproj is not None and model.mmproj == model.name:
        checker.add(
            f"{path}.mmproj", f"names this model itself ({model.name!r}): the projector is a file of its own"
        )


def _lock(f: Field) -> Any:
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


def _check_model_files(checker: Checker, raw_models: object, lock: LockSettings) -> None:
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
        pooled = entry.get("embedding") or entry.get("kind") in ("embedding", "rerank")
        # A projector's file likewise (a pooled model is refused one in _check_model).
        if not pooled:
            _check_projector_files(checker, entry, f"models[{index}]", lock)
        # A draft model's file likewise (speculative mode draft; an embedding model is refused it).
        spec = entry.get("speculative")
        if not isinstance(spec, dict) or str(spec.get("mode")).lower() != "draft" or pooled:
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


def _check_projector_files(checker: Checker, entry: dict[Any, Any], where: str, lock: LockSettings) -> None:
    """models[].mmproj names the projector in the lockfile; models[].mmproj_file is its file, unsigned."""
    if lock.allow_unsigned:
        if entry.get("mmproj") is not None and entry.get("mmproj_file") is None:
            checker.add(
                f"{where}.mmproj_file",
                "required with mmproj (lock.allow_unsigned is set): the projector's GGUF file",
            )
    elif entry.get("mmproj_file") is not None:
        checker.add(
            f"{where}.mmproj_file",
            "not allowed with a lockfile: the lock names the projector's file (set mmproj)",
        )


def _auth(f: Field) -> Any:
    auth = f.subsection()
    host = f.parsed["server"].host
    if auth.keys_file is None and not is_loopback(host):
        f.checker.add(
            "server.host",
            f"{host!r} is not a loopback address: serving a network "
            "without API keys is refused; set auth.keys_file",
        )
    return auth


def _console(f: Field) -> Any:
    console = f.subsection()
    if console.enabled and f.parsed["auth"].keys_file is None:
        f.checker.add(
            "console.enabled", "the console signs in with API keys: set auth.keys_file to enable it"
        )
    return console


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


# ---- the settings ------------------------------------------------------------------------------
# Each default here is docs/configuration.md's and the Ansible role's (defaults/main.yml): the
# reference in docs/ is generated from these declarations, the role's defaults are not (keep them level).


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
    max_tokens_over_limit: str = setting(
        "refuse",
        "a max_tokens past the ceiling: refuse (400) or clamp (cut to the ceiling)",
        choices=("refuse", "clamp"),
        more="a clamped answer says so in its `x-max-tokens-clamped` header (the ceiling it got); a key's "
        "own `max_tokens_over_limit` in the keys file overrides this for its requests",
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
        more="(a stream whose headers went out, after at most 10 s of waiting for a slot: an error event)",
    )
    max_connections: int = setting(1024, "connections beyond this are closed at once", bounds=CONNECTIONS)
    # One address may hold a quarter of the global cap: room for an app server's pool of a few
    # hundred streams (or a NAT gateway's users), while one address's slow-loris heads or
    # never-ending bodies leave three quarters of the connections to everybody else. Not
    # checked against max_connections: above it, the global cap is the one that bites.
    max_connections_per_client: int = setting(
        256,
        "likewise from one client address (behind a proxy: raise it)",
        bounds=CONNECTIONS,
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
        more="(see [API keys](operations.md#api-keys)); required unless `server.host` is a loopback address",
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
    proxy_cidrs: tuple[str, ...] = setting(
        (),
        "the load balancers in front of the box: /admin/* and the console are refused from them",
        read=_admin_cidrs,
        pattern=_CIDR,
        wanted="a network like 10.0.0.5/32",
        accepts="a list of networks like 10.0.0.5/32",
        more="behind a balancer every client comes from its address, which `admin_cidrs` may "
        "hold: 403 `address_not_allowed`; call /admin/* on a box directly",
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
        "where they are kept: ngram on text that copies its input pays at 24 (docs/benchmarks.md); the "
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
        bounds=THREADS,
        more="(the pinned count with `host.cpus`)",
    )
    threads_batch: int | None = setting(None, "prompt threads; null: same as threads", bounds=THREADS)
    batch_size: int = setting(
        512,
        "tokens per llama_decode (n_batch, n_ubatch); the prefill chunk while nothing generates",
        bounds=(1, 65536),
        more="llama.cpp gets at least `slots` rows: every step holds a token of each generating sequence",
    )
    prefill_chunk: int | None = setting(
        None,
        "prompt tokens a step takes while other sequences generate; null: 64 on the CPU, batch_size with "
        "layers on a GPU",
        bounds=(1, 65536),
        more="a step holds every generating sequence's next token and prompt chunks up to this many tokens, "
        "so their time between tokens (and a newcomer's wait for its first step) stays near one short "
        "step (stall-free batching); a prompt with nobody generating takes batch_size per step",
    )
    preempt_steps: bool = setting(
        True,
        "stop the step in progress when a request arrives from a key that step computes nothing for "
        "(or of a higher class), so that its first token does not wait for the whole step",
        more="the stopped step is undone and runs again right after the newcomer's; after a stop two "
        "steps run whole, so keys arriving back to back cannot starve the running ones, and a key "
        "computed for more than those the step serves stops nothing; a step a "
        "draft model proposed for is never stopped; CPU models only (with layers on a GPU a step is a "
        "few milliseconds and runs to its end)",
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
        more="(`server_overloaded`) to a key holding its fair share of `slots + queue_size`; a key "
        "below it is still let in, up to twice that room in all",
    )
    inputs_per_decode: int = setting(
        1,
        "embedding and rerank models: inputs packed into one llama_decode (each its own sequence), "
        "taken from every waiting request in turn; 1: each input a decode of its own",
        bounds=(1, 256),
        more="at most `slots`. 1 keeps every input's vector or score the same whatever else is sent; "
        "packed, they change slightly with what shares the decode (on Gemma 3 270M up to 5e-8 per "
        "component, 1e-2 with flash attention) and come faster (25 against 14 inputs/s, 8 a decode, "
        "2 cores)",
    )
    queue_timeout_s: float | None = setting(
        None,
        "a request still waiting for a slot this long is refused: 429 `server_overloaded` with "
        "`Retry-After`; null: it waits its turn",
        more="shedding for goodput: a request that has waited past its deadline (say the SLO's "
        "`telemetry.slo_ttft_s`) would be served late anyway, and its slot time goes to those that "
        "can still be on time (see [Benchmarks](benchmarks.md#serving-benchmark-goodput-under-an-slo)); "
        "a stream is refused before its headers when this is under 10 s, else ended with an error event",
    )
    kind: str = setting(
        "generation",
        "what the model serves: generation (chat, completions, responses, messages), embedding "
        "(/v1/embeddings) or rerank (/v1/rerank)",
        choices=("generation", "embedding", "rerank"),
        more="a rerank model's GGUF declares rank pooling (a classifier head), as llama.cpp's "
        "converter writes bge-reranker, jina-reranker and Qwen3-Reranker; see [Reranking](api.md#reranking)",
    )
    embedding: bool = setting(
        False,
        "an embedding model, served by /v1/embeddings only: the older spelling of `kind: embedding`",
        more="(mean pooling unless the GGUF says otherwise)",
    )
    mmproj: str | None = setting(
        None,
        "generation models: the multimodal projector's entry in the lockfile (llama.cpp's mmproj, "
        "for images and audio)",
        pattern=MODEL_NAME,
        wanted="a model name of 1 to 64 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit",
        more="a projector GGUF (architecture `clip`) made for this model, verified and preloaded as the "
        "model's own file and part of its version: a change to it reloads the model; unsigned, only "
        "the name status pages show",
    )
    mmproj_file: Path | None = setting(
        None,
        "generation models, unsigned mode only: the multimodal projector GGUF, relative to the config file",
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
        "model restarts by itself (docs/internals.md, engine processes)",
    )
    hang_timeout_s: float = setting(
        30.0,
        "with isolation process: an engine that shows no step progress this long while work is "
        "pending is killed and restarted",
        more="a load, or its warm-up: no CPU time, page faults or reads this long; once it serves, "
        "keep it well above the slowest step on a busy box: a step that takes longer reads as a hang; "
        "idle, no heartbeat this long (at least 10 s) is a hang too",
    )
    memory_limit_mb: int | None = setting(
        None,
        "with isolation process: the engine process's address-space limit (RLIMIT_AS); past it an "
        "allocation fails, that engine dies and restarts alone, and the daemon lives on; null: none",
        bounds=(64, 16_777_216),
        more="virtual memory, not resident: it counts the mapped model file, every thread's stack and "
        "allocator arenas, so allow the model's size plus about 1 GiB; CPU models only (a CUDA runtime "
        "reserves far more address space than it uses: refused with gpu_layers)",
    )
    memory_group: bool = setting(
        True,
        "with isolation process: the engine process in a memory cgroup of its own, limited to what "
        "the memory budget counts for the model plus memory_group_headroom_mb; past it that engine "
        "alone is killed and restarts",
        more="made where the daemon may make cgroups: its own cgroup v2 delegated to it (systemd's "
        "`Delegate=`), or cgroup v1's memory hierarchy; elsewhere one warning and the engines run "
        "without (docs/operations.md, memory groups)",
    )
    memory_group_headroom_mb: int = setting(
        1024,
        "what an engine process may use beyond its model's estimate in its memory group: the "
        "interpreter, llama.cpp's compute buffers, allocator slack",
        bounds=(64, 1_048_576),
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

    @property
    def serves(self) -> str:
        """generation, embedding or rerank: `kind`, with `embedding: true` read as its older spelling."""
        return "embedding" if self.embedding and self.kind == "generation" else self.kind

    @property
    def pooled(self) -> bool:
        """An embedding or reranking model: no text generation, no chat template, no KV kept."""
        return self.serves != "generation"


@dataclass(frozen=True, slots=True)
class ResponsesSettings:
    """OpenAI Responses API: the in-memory store behind `store` and `previous_response_id`."""

    store_max_responses: int = setting(
        1000,
        "responses kept in memory (the most-holding key's oldest evicted first); 0: nothing is stored",
        bounds=(0, 1_000_000),
        more="per daemon, each visible only to the API key that made it; never written to disk",
    )
    store_max_mb: int = setting(
        64, "memory the stored responses and their conversations may take", bounds=(1, 65536)
    )


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    """Usage, quotas and the audit log, kept in one SQLite database that survives restarts."""

    database: Path | None = setting(
        None,
        "the SQLite file of usage, quotas and the hash-chained audit log; null: in memory, forgotten at exit",
        more="WAL mode, created with mode 0600; under systemd put it in the state directory "
        "(`/var/lib/edgellm/ledger.sqlite3`)",
    )
    time_zone: str = setting(
        "UTC",
        "the time zone whose calendar days and months quotas and usage reports count",
        read=_time_zone,
        accepts="an IANA time zone name",
    )
    usage_detail_hours: int = setting(
        48,
        "hours a row per request (its id and tokens) is kept beside the hourly totals; 0: none",
        bounds=(0, 8760),
        more="none without `database` (in memory they would grow with the traffic)",
    )
    usage_retention_days: int = setting(400, "days hourly usage totals are kept", bounds=(1, 36_500))
    audit_retention_days: int = setting(
        400,
        "days audit records are kept",
        bounds=(1, 36_500),
        more="older records go at the hourly rotation; the last one gone stays as the chain's anchor",
    )


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """Where models are preloaded, how file changes are watched, and the memory they may use."""

    preload_dir: Path | None = setting(
        Path("/dev/shm/edgellm"),  # noqa: S108 - tmpfs on purpose: models load from RAM
        "tmpfs for model copies (made while hashed); null: load from models_dir",
        more="each daemon keeps its copies in a locked subdirectory of its own; a model loaded from "
        "models_dir must be owned by root or the daemon's user and writable by no group or other user",
    )
    preload_max_mb: int | None = setting(
        None,
        "cap on what the copies may take; null: the filesystem's free space",
        bounds=MEGABYTES,
        more="a model that does not fit loads from the models directory (still verified, and only if no one "
        "but root or the daemon's user may write it), with a warning",
    )
    watch: bool = setting(True, "reload when a model file or the lockfile changes")
    watch_settle_s: float = setting(
        2.0, "a changed file must keep its size and mtime this long before a reload"
    )
    memory_budget_mb: int | None = setting(
        None,
        "loaded models' estimated size (weights + KV cache); null: no budget",
        bounds=MEGABYTES,
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
        "(see [Console](operations.md#console))",
    )
    session_idle_s: float = setting(
        900.0,
        "a console session unused this long ends",
        more="an open overview reading its live stream counts as use (a wall display stays signed in)",
    )
    session_max_s: float = setting(28800.0, "a console session ends this long after its sign-in, used or not")
    max_sessions: int = setting(
        64,
        "console sessions held in memory",
        bounds=(1, 10_000),
        more="a sign-in beyond it ends the least recently used session of the key holding the most",
    )
    max_sessions_per_key: int = setting(
        4,
        "console sessions one API key may hold",
        bounds=(1, 10_000),
        more="a sign-in beyond it ends that key's least recently used session, never another key's",
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
        more="then 429 `rate_limit_exceeded` with `Retry-After` for the wrong ones, like the API's "
        "limits; a right key still signs in (its 256-bit secret cannot be guessed at any rate)",
    )
    signins_per_key_per_minute: int = setting(
        10,
        "successful sign-ins allowed per API key and minute",
        bounds=(1, 10_000),
        more="then 429 `rate_limit_exceeded` with `Retry-After`, whatever the address",
    )


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """The service level /metrics counts goodput against, and OpenTelemetry traces (off by default)."""

    slo_ttft_s: float = setting(
        2.0,
        "goodput: a request meets the SLO when its first token comes within this many seconds of its arrival",
        more='counted in `edgellm_request_slo_total{result="met"}` '
        "(see [Observability](observability.md#metrics))",
    )
    slo_tokens_per_s: float = setting(
        5.0, "goodput: and its tokens after the first come at least this fast (per choice)"
    )
    traces_endpoint: str | None = setting(
        None,
        "OTLP/HTTP endpoint spans are exported to, e.g. `http://collector:4318/v1/traces`; null: no traces",
        pattern=_OTLP_URL,
        wanted="an http(s) URL with a plain path",
        more="a span per request with children for auth, queue, grammar, prefill and decode; "
        "a request's `traceparent` header continues the caller's trace "
        "(see [Observability](observability.md#traces))",
    )
    traces_sample_ratio: float = setting(
        1.0,
        "share of requests traced that arrive without a sampled `traceparent`",
        read=_ratio,
        accepts="a number from 0 to 1",
        more="a caller's sampling decision in `traceparent` is followed",
    )
    traces_include_text: bool = setting(
        False,
        "put prompts and outputs in the spans",
        more="off: spans carry timings, token counts and ids, never text",
    )
    service_name: str = setting(
        "edgellmd", "`service.name` of the exported spans", pattern=_SERVICE_NAME, wanted="a short name"
    )


@dataclass(frozen=True, slots=True)
class MediaSettings:
    """Images and audio clips in requests, for models with a projector (`models[].mmproj`)."""

    max_images: int = setting(8, "images per request (400 past it)", bounds=(0, 256))
    max_image_bytes: int = setting(
        10_485_760,
        "bytes of one image file (decoded from base64): 400 past it",
        bounds=(1024, 268_435_456),
        more="a request's body is bounded by `server.max_body_bytes` first: raise that too for "
        "large images (base64 adds a third)",
    )
    max_image_pixels: int = setting(
        16_777_216,
        "width times height of one image: 400 past it, from its header, before a pixel is decoded",
        bounds=(1, 89_478_485),
        more="the ceiling, 89,478,485, is Pillow's own decompression-bomb bound",
    )
    max_image_side: int = setting(
        8192, "the longer side of one image, in pixels: 400 past it", bounds=(1, 65_535)
    )
    max_clips: int = setting(4, "audio clips per request (400 past it)", bounds=(0, 64))
    max_audio_bytes: int = setting(
        26_214_400,
        "bytes of one clip file (decoded from base64, or as uploaded): 400 past it",
        bounds=(1024, 1_073_741_824),
        more="as for images, `server.max_body_bytes` bounds the request first",
    )
    max_audio_seconds: float = setting(
        600.0,
        "length of one clip: 400 past it (a WAV file by its header, before its samples are read)",
        bounds=(1, 86_400),
    )
    fetch_hosts: tuple[str, ...] = setting(
        (),
        "hosts whose http(s) image URLs the daemon fetches; none: such URLs are refused (400), "
        "only data: URLs and base64 are read",
        pattern=_FETCH_HOST,
        wanted="a host name or address, no scheme or port",
        more="a fetch follows no redirect and reads at most `media.max_image_bytes`",
    )
    fetch_timeout_s: float = setting(10.0, "a fetched image must arrive within this many seconds")


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
    ledger: LedgerSettings = setting(LedgerSettings(), "usage, quotas and the audit log")
    telemetry: TelemetrySettings = setting(
        TelemetrySettings(), "the SLO goodput is counted against, and OpenTelemetry traces"
    )
    media: MediaSettings = setting(MediaSettings(), "images and audio clips in requests")
    source: Path | None = None  # the file it was read from; no setting


# Defaults other modules name (the systemd unit's tests, the front door's), read from the declarations.
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = ServerSettings().shutdown_timeout_s
DEFAULT_HEADER_TIMEOUT_S: Final = ServerSettings().header_timeout_s
DEFAULT_BODY_TIMEOUT_S: Final = ServerSettings().body_timeout_s
DEFAULT_KEEPALIVE_TIMEOUT_S: Final = ServerSettings().keepalive_timeout_s
DEFAULT_MAX_CONNECTIONS: Final = ServerSettings().max_connections
DEFAULT_MAX_CONNECTIONS_PER_CLIENT: Final = ServerSettings().max_connections_per_client
DEFAULT_PRELOAD_DIR: Final = LifecycleSettings().preload_dir
