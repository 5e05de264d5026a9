"""API keys at rest: the keys file (hashed secrets only), its validation and hot reload."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hashlib
import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import yaml

from edgellmd.files import UnsuitableFile, open_regular
from edgellmd.redaction import KEY_PREFIX, KEY_TOKEN

log = logging.getLogger(__name__)

TOKEN_PREFIX: Final = KEY_PREFIX
SCOPES: Final = ("inference", "admin", "metrics")
RELOAD_INTERVAL_S: Final = 0.5  # how often the keys file's identity (device, inode, size, times) is checked
_ID: Final = re.compile(r"[0-9a-f]{12}")
_HASH: Final = re.compile(r"sha256:[0-9a-f]{64}")
_LIMIT_KEYS: Final = ("rpm", "tpm", "concurrent", "max_tokens")
MAX_NAME: Final = 64  # characters of a key's name
MAX_LIMIT: Final = 1_000_000_000  # the most a new key's rpm, tpm, concurrent or max_tokens may say
QUOTA_KEYS: Final = ("requests_per_day", "requests_per_month", "tokens_per_day", "tokens_per_month")
_ENTRY_KEYS: Final = (
    "id",
    "name",
    "hash",
    "scopes",
    "expires",
    "disabled",
    "limits",
    "created",
    "cache_group",
    "weight",
    "priority",
    "quota",
    "max_tokens_over_limit",
)
# A cache group: keys that share cached prompt state (one team's apps with one system prompt).
CACHE_GROUP: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_KEYS_BYTES: Final = 4 * 1024 * 1024
# Fair share between keys (engine.fairness): a key's weight, and its class, highest first. A
# key's class is the ceiling of its requests' (a request may ask for less, never more).
MAX_WEIGHT: Final = 1000
PRIORITIES: Final = {"interactive": 1, "normal": 0, "batch": -1}
# What a max_tokens past the ceiling gets: a 400, or the ceiling (agent CLIs ask for 32,000).
OVER_LIMIT_POLICIES: Final = ("refuse", "clamp")


class KeysFileError(Exception):
    """The keys file cannot be used; the message names the entry and field."""


class KeysFileNotWritable(KeysFileError):
    """The keys file cannot be written (a read-only file system, a directory the daemon may not write)."""


class NoSuchKey(KeysFileError):
    """No entry of the keys file has this id."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """Per-key limits; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class KeyQuota:
    """Per-key budgets per calendar day and month in the box's time zone (`ledger.time_zone`);
    None means none. Enforced at admission from the ledger's persistent usage."""

    requests_per_day: int | None = None
    requests_per_month: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key as stored: never the secret, only its hash."""

    id: str
    name: str
    hash: str
    scopes: frozenset[str]
    expires: datetime | None = None
    disabled: bool = False
    limits: KeyLimits = field(default_factory=KeyLimits)
    cache_group: str | None = None  # keys of one group share cached KV state; else the key's own
    weight: int = 1  # its share of slots and prefill against other keys' (engine.fairness)
    priority: str = "normal"  # its requests' highest class: a key of PRIORITIES
    quota: KeyQuota = field(default_factory=KeyQuota)  # day and month budgets (ledger)
    # A max_tokens past the ceiling: refused (400) or cut to it; None: server.max_tokens_over_limit.
    max_tokens_over_limit: str | None = None

    @property
    def cache_scope(self) -> str:
        """Whose cached KV state this key's requests may reuse (`GenerationRequest.cache_scope`)."""
        return f"group:{self.cache_group}" if self.cache_group else f"key:{self.id}"

    def usable(self, now: datetime) -> str | None:
        """Why this key cannot be used now, or None."""
        if self.disabled:
            return "disabled"
        if self.expires is not None and now >= self.expires:
            return "expired"
        return None


def hash_secret(secret: str) -> str:
    """Stored form of a token's secret. Secrets are 256 random bits: a fast hash suffices."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def new_token() -> tuple[str, str, str]:
    """A fresh (key id, token, stored hash)."""
    key_id = secrets.token_hex(6)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    return key_id, f"{TOKEN_PREFIX}_{key_id}_{secret}", hash_secret(secret)


def parse_token(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed token, else None."""
    match = KEY_TOKEN.fullmatch(token)
    return (match.group(1), match.group(2)) if match else None


def _time(value: object, where: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    raise KeysFileError(f"{where}: must be a UTC time like 2027-01-01T00:00:00Z")


def _limits(value: object, where: str) -> KeyLimits:
    if value is None:
        return KeyLimits()
    if not isinstance(value, dict):
        raise KeysFileError(f"{where}: must be a mapping of {', '.join(_LIMIT_KEYS)}")
    unknown = sorted(set(value) - set(_LIMIT_KEYS))
    if unknown:
        raise KeysFileError(f"{where}.{unknown[0]}: unknown limit")
    out: dict[str, int | None] = {}
    for key in _LIMIT_KEYS:
        item = value.get(key)
        if item is not None and (isinstance(item, bool) or not isinstance(item, int) or item < 1):
            raise KeysFileError(f"{where}.{key}: must be an integer >= 1 or null")
        out[key] = item
    return KeyLimits(**out)


def _quota(value: object, where: str) -> KeyQuota:
    if value is None:
        return KeyQuota()
    if not isinstance(value, dict):
        raise KeysFileError(f"{where}: must be a mapping of {', '.join(QUOTA_KEYS)}")
    unknown = sorted(set(value) - set(QUOTA_KEYS))
    if unknown:
        raise KeysFileError(f"{where}.{str(unknown[0])[:40]}: unknown budget")
    out: dict[str, int | None] = {}
    for key in QUOTA_KEYS:
        item = value.get(key)
        if item is not None and (
            isinstance(item, bool) or not isinstance(item, int) or not 1 <= item < 2**53
        ):
            raise KeysFileError(f"{where}.{key}: must be a whole number >= 1 or null")
        out[key] = item
    return KeyQuota(**out)


def parse_keys(data: object, *, empty: bool = True) -> dict[str, ApiKey]:
    """Validate the keys file's YAML into keys by id; errors name the entry and field.
    `empty`: whether a file that holds no list of keys (nothing, or `keys:` alone) reads as
    no keys (else it is refused)."""
    # Nothing, or `keys:` with nothing after it yet (a file being written): no list of keys.
    if data is None or (isinstance(data, dict) and data.get("keys") is None):
        if not empty:
            raise KeysFileError(
                "the file holds no list of keys (half-written?); `keys: []` removes every key"
            )
        if data is None:
            return {}
    if not isinstance(data, dict) or set(data) - {"keys"}:
        raise KeysFileError("the keys file must be a mapping with one member, 'keys'")
    entries = data.get("keys") or []
    if not isinstance(entries, list):
        raise KeysFileError("keys: must be a list")
    keys: dict[str, ApiKey] = {}
    for i, entry in enumerate(entries):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where}: must be a mapping")
        unknown = sorted(set(entry) - set(_ENTRY_KEYS))
        if unknown:
            raise KeysFileError(f"{where}.{unknown[0]}: unknown field")
        key_id, name, hashed = entry.get("id"), entry.get("name"), entry.get("hash")
        if not isinstance(key_id, str) or not _ID.fullmatch(key_id):
            raise KeysFileError(f"{where}.id: must be 12 lowercase hex digits")
        if key_id in keys:
            raise KeysFileError(f"{where}.id: duplicate key id {key_id}")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise KeysFileError(f"{where}.name: must be a string of 1 to {MAX_NAME} characters")
        if not name.isprintable():  # as the CLI and the console make them: shown to operators
            raise KeysFileError(f"{where}.name: must be printable (no control, format or bidi characters)")
        if not isinstance(hashed, str) or not _HASH.fullmatch(hashed):
            raise KeysFileError(f"{where}.hash: must be sha256:<64 hex digits> (never the secret)")
        scopes = entry.get("scopes")
        if not isinstance(scopes, list) or not scopes or not all(s in SCOPES for s in scopes):
            raise KeysFileError(f"{where}.scopes: must be a non-empty list of {', '.join(SCOPES)}")
        disabled = entry.get("disabled", False)
        if not isinstance(disabled, bool):
            raise KeysFileError(f"{where}.disabled: must be true or false")
        group = entry.get("cache_group")
        if group is not None and not (isinstance(group, str) and CACHE_GROUP.fullmatch(group)):
            raise KeysFileError(
                f"{where}.cache_group: must be 1 to 64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        weight = entry.get("weight", 1)
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= MAX_WEIGHT:
            raise KeysFileError(f"{where}.weight: must be a whole number from 1 to {MAX_WEIGHT}")
        priority = entry.get("priority", "normal")
        if not isinstance(priority, str) or priority not in PRIORITIES:
            raise KeysFileError(f"{where}.priority: must be one of {', '.join(PRIORITIES)}")
        over = entry.get("max_tokens_over_limit")
        if over is not None and over not in OVER_LIMIT_POLICIES:
            raise KeysFileError(
                f"{where}.max_tokens_over_limit: must be one of {', '.join(OVER_LIMIT_POLICIES)}"
            )
        keys[key_id] = ApiKey(
            id=key_id,
            name=name,
            hash=hashed,
            scopes=frozenset(scopes),
            expires=_time(entry.get("expires"), f"{where}.expires"),
            disabled=disabled,
            limits=_limits(entry.get("limits"), f"{where}.limits"),
            cache_group=group,
            weight=weight,
            priority=priority,
            quota=_quota(entry.get("quota"), f"{where}.quota"),
            max_tokens_over_limit=over,
        )
    return keys


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """The cyclic garbage collector off while a document is built: its node graph, tens of
    thousands of objects alive until the end, sets off full collections of the whole heap, which
    hold the GIL on whichever thread allocates (the event loop's turns waited 0.3 s with a heap
    of a million objects, most of a second in a test process thousands of tests in). None of
    the objects is cyclic; the collector is on again as it was once the document is built."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def read_keys_data(path: Path) -> object:
    """The keys file's YAML, read only from a private regular file of at most MAX_KEYS_BYTES.

    The checks look at the open file, so what is checked is what is read; a FIFO, a device
    or a directory is refused without blocking.
    """
    try:
        fd = open_regular(path)
    except UnsuitableFile as exc:
        raise KeysFileError(str(exc)) from None
    except OSError as exc:
        raise KeysFileError(f"cannot read {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fd)
            if info.st_size > MAX_KEYS_BYTES:
                raise KeysFileError(f"{path} is larger than {MAX_KEYS_BYTES} bytes")
            if stat.S_IMODE(info.st_mode) & 0o077:
                raise KeysFileError(
                    f"{path} is readable or writable by others (mode "
                    f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
                )
            data = fh.read(MAX_KEYS_BYTES + 1)
    except OSError as exc:
        raise KeysFileError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_KEYS_BYTES:
        raise KeysFileError(f"{path} is larger than {MAX_KEYS_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeysFileError(f"{path} is not UTF-8") from None
    try:
        # The pure-Python loader, on a thread (KeyStore.reload): libyaml's is 4 to 7 times faster
        # but builds the whole document holding the GIL (a gap of a quarter of the parse, up to
        # a second, in the event loop's turns), where the Python one lets the loop run between steps.
        with _collector_off():
            return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"{path}: YAML syntax error: {exc}") from None
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        # Well-formed YAML whose value PyYAML cannot build: a date that does not exist
        # (2027-02-30, month 13), a malformed !!timestamp or !!float.
        raise KeysFileError(f"{path}: a value YAML cannot read ({type(exc).__name__}: {exc})") from None


def read_keys_file(path: Path) -> dict[str, ApiKey]:
    """Read and validate a keys file; refuses files that others can read or write."""
    return parse_keys(read_keys_data(path))


class KeyStore:
    """The keys in force, swapped whole when the keys file changes and still parses."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys: Mapping[str, ApiKey] = read_keys_file(path)
        self._identity = self._stat()
        self._seen: tuple[int, ...] | None = None  # a change in place, not yet settled
        self._reloading = asyncio.Lock()

    def _stat(self) -> tuple[int, ...] | None:
        """Who the file is now. The change time too: a file rewritten in place with its size and
        its modification time kept (`touch -r`, `cp -p`, `rsync --inplace -t`) was never read
        again, and a key whose hash was changed so went on being accepted."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_mode, info.st_ctime_ns)

    def get(self, key_id: str) -> ApiKey | None:
        """The key with this id, if any."""
        return self._keys.get(key_id)

    def __len__(self) -> int:
        return len(self._keys)

    def ids(self) -> set[str]:
        """The ids of every key in the file, usable or not."""
        return set(self._keys)

    def in_force(self, now: datetime) -> tuple[set[str], set[str]]:
        """The ids of the keys usable at `now`, and the cache scopes they use."""
        usable = [key for key in self._keys.values() if key.usable(now) is None]
        return {key.id for key in usable}, {key.cache_scope for key in usable}

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; a bad new file is logged and the last good keys stay.

        A file renamed into place (a new inode: how `edgellmctl` and most editors write) is
        complete, and read at once. One written in place may be half-written when it is looked
        at (truncated, not yet refilled: an empty file would read as no keys at all, revoking
        every one), so it is read once it has kept the same size and mtime for one check; and
        a file that holds no list of keys (nothing, or `keys:` alone) never replaces keys
        (`keys: []` says "none"). Blocking: the daemon's loop calls `reload`.
        """
        if not self._due():
            return False
        try:
            keys = self._parse()
        except KeysFileError as exc:
            return self._rejected(exc)
        return self._put(keys)

    async def reload(self) -> bool:
        """`reload_if_changed` with the file read and parsed off the event loop: a keys file of
        thousands of keys takes seconds of YAML (every request, `/healthz` and the watchdog's
        ping waited for it). One reload at a time; the keys in force meanwhile are the last ones."""
        async with self._reloading:
            if not self._due():
                return False
            try:
                keys = await asyncio.to_thread(self._parse)
            except KeysFileError as exc:
                return self._rejected(exc)
            return self._put(keys)

    def _due(self) -> bool:
        """Whether the file changed and is to be read now (see reload_if_changed)."""
        identity = self._stat()
        if identity == self._identity:
            self._seen = None
            return False
        # The same file (device and inode) changed: written in place.
        in_place = identity is not None and self._identity is not None and identity[:2] == self._identity[:2]
        if in_place and identity != self._seen:
            self._seen = identity  # the next check reads it if it is still the same
            return False
        self._seen = None
        self._identity = identity
        return True

    def _parse(self) -> dict[str, ApiKey]:
        # Empty (or comments alone): a file truncated and not yet written again, however long
        # that takes, never reads as every key revoked.
        return parse_keys(read_keys_data(self.path), empty=not self._keys)

    def _rejected(self, exc: KeysFileError) -> bool:
        log.error("keys file change rejected, the previous %d key(s) stay in force: %s", len(self._keys), exc)
        return False

    def _put(self, keys: dict[str, ApiKey]) -> bool:
        self._keys = keys
        log.info("keys file reloaded: %d key(s)", len(keys))
        return True

    async def watch(self) -> None:
        """Poll the keys file's identity and reload it when it changes (runs until cancelled)."""
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            await self.reload()


def key_record(
    key_id: str,
    name: str,
    hashed: str,
    scopes: list[str],
    *,
    limits: dict[str, int],
    expires: datetime | None,
    cache_group: str | None = None,
    weight: int | None = None,
    priority: str | None = None,
    quota: dict[str, int] | None = None,
    max_tokens_over_limit: str | None = None,
) -> dict[str, Any]:
    """A keys-file entry, as `edgellmctl keys create` appends it."""
    record: dict[str, Any] = {
        "id": key_id,
        "name": name,
        "hash": hashed,
        "scopes": scopes,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "disabled": False,
    }
    if expires is not None:
        record["expires"] = expires.strftime("%Y-%m-%dT%H:%M:%SZ")
    if limits:
        record["limits"] = limits
    if cache_group is not None:
        record["cache_group"] = cache_group
    if weight is not None:
        record["weight"] = weight
    if priority is not None:
        record["priority"] = priority
    if quota:
        record["quota"] = quota
    if max_tokens_over_limit is not None:
        record["max_tokens_over_limit"] = max_tokens_over_limit
    return record


# ---- writing (edgellmctl keys and the console share these) -------------------------------------

KEYS_FILE_HEADER: Final = (
    "# edgellm API keys: secrets are stored only as hashes. Edit with `edgellmctl keys` or the console.\n"
)


def load_keys_document(path: Path) -> dict[str, Any]:
    """The keys file as a document to edit ({"keys": [entries]}); a missing file is an empty one."""
    if not path.exists():
        return {"keys": []}
    raw = read_keys_data(path)  # one read: refuses a file others can read, a FIFO, a device
    parse_keys(raw)  # validates every entry
    data: dict[str, Any] = raw if isinstance(raw, dict) else {"keys": []}
    data["keys"] = data.get("keys") or []
    return data


def save_keys_document(path: Path, data: dict[str, Any]) -> None:
    """Write the keys file atomically (mode 0600), refusing a document the daemon would refuse."""
    parse_keys(data)
    text = KEYS_FILE_HEADER + yaml.safe_dump(data, sort_keys=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise KeysFileNotWritable(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # readers (the daemon's poll) never see half a file
    except OSError as exc:
        raise KeysFileNotWritable(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone already after the rename


def append_key(
    path: Path,
    name: str,
    scopes: Sequence[str],
    *,
    limits: dict[str, int],
    expires: datetime | None = None,
    cache_group: str | None = None,
    weight: int | None = None,
    priority: str | None = None,
    quota: dict[str, int] | None = None,
    max_tokens_over_limit: str | None = None,
) -> tuple[str, str]:
    """Add a new key to the keys file; returns (key id, token). The token is stored nowhere."""
    if cache_group is not None and not CACHE_GROUP.fullmatch(cache_group):
        raise KeysFileError("a cache group is 1 to 64 letters, digits, '.', '_' or '-'")
    data = load_keys_document(path)
    key_id, token, hashed = new_token()
    record = key_record(
        key_id,
        name,
        hashed,
        sorted(set(scopes)),
        limits=limits,
        expires=expires,
        cache_group=cache_group,
        weight=weight,
        priority=priority,
        quota=quota,
        max_tokens_over_limit=max_tokens_over_limit,
    )
    data["keys"].append(record)
    save_keys_document(path, data)
    return key_id, token


def _entry(data: dict[str, Any], key_id: str, path: Path) -> dict[str, Any]:
    for entry in data["keys"]:
        if entry.get("id") == key_id:
            found: dict[str, Any] = entry
            return found
    raise NoSuchKey(f"no key with id {key_id!r} in {path}")


def set_key_disabled(path: Path, key_id: str, disabled: bool) -> dict[str, Any]:
    """Disable (or enable again) the key `key_id`, kept in the file; returns its entry."""
    data = load_keys_document(path)
    entry = _entry(data, key_id, path)
    entry["disabled"] = disabled
    save_keys_document(path, data)
    return entry


def remove_key(path: Path, key_id: str) -> dict[str, Any]:
    """Take the key `key_id` out of the keys file for good; returns the entry it had."""
    data = load_keys_document(path)
    entry = _entry(data, key_id, path)
    data["keys"].remove(entry)
    save_keys_document(path, data)
    return entry
