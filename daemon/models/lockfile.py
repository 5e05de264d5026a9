"""The signed model lockfile: parsing, Ed25519 signatures, expiry, rollback state and file checks.

Format (DESIGN.md, "Lockfile format"): a JSON object signed over its canonical form (sorted
keys, `(",", ":")` separators, UTF-8) with the `signatures` member removed. A model is
served only when a trusted key signed the lock, the lock has not expired, its version is
not lower than the highest this box accepted before, and the file's size, sha256 and GGUF
header match the lock's entry (`models.verify` checks the file's bytes).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgellmd import settings
from edgellmd.errors import shown as show_value
from edgellmd.files import UnsuitableFile, read_regular

SCHEMA: Final = 1
ALGORITHM: Final = "ed25519"
STATE_FILE: Final = "lock-state.json"
MAX_LOCK_BYTES: Final = 4 * 1024 * 1024
MAX_KEY_BYTES: Final = 64 * 1024  # a PEM Ed25519 key is about 120 bytes
MAX_STATE_BYTES: Final = 64 * 1024
MAX_FILE_CHARS: Final = 1024  # a lock entry's `file`; each folder name is bounded by the OS (255 bytes)
MAX_GGUF_VALUE_CHARS: Final = 256
MAX_SHOWN_CHARS: Final = 64  # longer or unprintable values from a lockfile are never put in a message
# Signatures are not covered by a signature: a lockfile padded with thousands of them cost
# seconds of verification at every reload. One per key (`lock sign` replaces a key's own);
# a key rotation needs two or three.
MAX_SIGNATURES: Final = 16
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
MODEL_NAME: Final = settings.MODEL_NAME  # one pattern for the config's model names and the lock's
_PLAIN_MEMBER: Final = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # JSON member names shown as they are
# C0 and C1 control characters and DEL: NUL cuts a path short in C, the others rewrite
# terminals and split log lines.
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class LockError(Exception):
    """The lockfile or a model file is refused; the message says exactly why."""


@dataclass(frozen=True, slots=True)
class LockedModel:
    """One approved model file."""

    name: str
    file: str
    size: int
    sha256: str
    gguf: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Signature:
    """One signature over the canonical form."""

    key_id: str
    sig: bytes


@dataclass(frozen=True, slots=True)
class Lockfile:
    """A parsed (not yet verified) lockfile."""

    version: int
    issued: datetime | None
    expires: datetime | None
    models: Mapping[str, LockedModel]
    signatures: tuple[Signature, ...]
    document: Mapping[str, Any]

    def canonical(self) -> bytes:
        """The bytes that signatures cover."""
        return canonical_bytes(self.document)


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """Canonical JSON of `document` without its `signatures` member."""
    body = {k: v for k, v in document.items() if k != "signatures"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def format_time(moment: datetime) -> str:
    """RFC 3339 UTC with a Z, to the second, as the lockfile stores times."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: object, where: str) -> datetime:
    if not isinstance(value, str):
        raise LockError(f"{where}: must be a UTC time like 2026-11-30T00:00:00Z")
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise LockError(f"{where}: must be a UTC time like 2026-11-30T00:00:00Z") from None
    if moment.tzinfo is None:
        raise LockError(f"{where}: must carry a time zone (use Z for UTC)")
    return moment


def _int(value: object, where: str, *, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise LockError(f"{where}: must be an integer >= {lo}")
    return value


def shown(value: str) -> str:
    """`value` quoted for a message if it is short and printable, else a placeholder."""
    return show_value(
        value, limit=MAX_SHOWN_CHARS, quote=True, placeholder="(a value too long or unprintable to show)"
    )


def _member(name: str) -> str:
    """A JSON member name for a message path: as it is when plain, else quoted or a placeholder."""
    return name if _PLAIN_MEMBER.fullmatch(name) else shown(name)


def file_problem(file: str) -> str | None:
    """Why `file` cannot be a lock entry's path (relative, inside the models directory), or None."""
    if not file:
        return "must be a non-empty string"
    if len(file) > MAX_FILE_CHARS:
        return f"must be at most {MAX_FILE_CHARS} characters"
    if _CONTROL.search(file):
        return "must not contain control characters"
    if not file.isprintable():  # a bidi override or a zero-width mark: a name that reads as another
        return "must be printable (no format, bidi or zero-width characters)"
    if "\\" in file:
        # Legal in a Linux file name, but in a lockfile it is a Windows path that names
        # something else here; folders are separated by '/'.
        return f"{shown(file)} contains a backslash; separate folders with '/'"
    if file.startswith("/"):
        return f"{shown(file)} is an absolute path; lockfile paths are relative to the models directory"
    if ".." in file.split("/"):
        return f"{shown(file)} contains '..'; lockfile paths stay inside the models directory"
    return None


def _text_problem(value: str) -> str | None:
    if len(value) > MAX_GGUF_VALUE_CHARS:
        return f"must be at most {MAX_GGUF_VALUE_CHARS} characters"
    if _CONTROL.search(value):
        return "must not contain control characters"
    if not value.isprintable():
        return "must be printable (no format, bidi or zero-width characters)"
    return None


def _gguf(value: object, where: str) -> dict[str, str | int]:
    if not isinstance(value, dict):
        raise LockError(f"{where}: must be an object of strings and integers")
    for key, item in value.items():
        problem = _text_problem(key)
        if problem is not None:
            raise LockError(f"{where}: member names {problem}")
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise LockError(f"{where}.{_member(key)}: must be a string or an integer")
        problem = _text_problem(item) if isinstance(item, str) else None
        if problem is not None:
            raise LockError(f"{where}.{_member(key)}: {problem}")
    return value


def _model(name: str, value: object) -> LockedModel:
    if not MODEL_NAME.fullmatch(name):
        raise LockError(
            f"models.{_member(name)}: model names are 1-64 of A-Za-z0-9._:- starting with a letter or digit"
        )
    where = f"models.{name}"
    if not isinstance(value, dict):
        raise LockError(f"{where}: must be an object")
    unknown = sorted(set(value) - {"file", "size", "sha256", "gguf"})
    if unknown:
        raise LockError(f"{where}.{_member(unknown[0])}: unknown member")
    for member in ("file", "size", "sha256"):
        if member not in value:
            raise LockError(f"{where}.{member}: required")
    file = value["file"]
    if not isinstance(file, str):
        raise LockError(f"{where}.file: must be a non-empty string")
    problem = file_problem(file)
    if problem is not None:
        raise LockError(f"{where}.file: {problem}")
    sha = value["sha256"]
    if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
        raise LockError(f"{where}.sha256: must be 64 lowercase hex digits")
    gguf = _gguf(value.get("gguf", {}), f"{where}.gguf")
    return LockedModel(name, file, _int(value["size"], f"{where}.size", lo=1), sha, gguf)


def _signatures(value: object) -> tuple[Signature, ...]:
    if not isinstance(value, list) or len(value) > MAX_SIGNATURES:
        raise LockError(f"signatures: must be a list of at most {MAX_SIGNATURES}")
    out: list[Signature] = []
    for i, item in enumerate(value):
        where = f"signatures[{i}]"
        if not isinstance(item, dict):
            raise LockError(f"{where}: must be an object")
        if item.get("alg") != ALGORITHM:
            raise LockError(f"{where}.alg: must be {ALGORITHM!r}")
        key_id = item.get("key_id")
        if not isinstance(key_id, str) or not _HEX64.fullmatch(key_id):
            raise LockError(f"{where}.key_id: must be 64 lowercase hex digits")
        try:
            sig = base64.b64decode(item.get("sig", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise LockError(f"{where}.sig: must be base64") from None
        if len(sig) != 64:
            raise LockError(f"{where}.sig: an Ed25519 signature is 64 bytes")
        if any(s.key_id == key_id for s in out):
            raise LockError(f"{where}.key_id: a second signature by the same key")
        out.append(Signature(key_id, sig))
    return tuple(out)


def parse_lock(data: bytes | str) -> Lockfile:
    """Parse and check the shape of a lockfile; errors name the member."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise LockError(f"not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise LockError("the lockfile must be a JSON object")
    try:  # what is signed is its canonical UTF-8: a lone surrogate (an escape like \ud800) has none
        canonical_bytes(document)
    except UnicodeEncodeError:
        raise LockError("the lockfile holds text that is not Unicode (a lone surrogate escape)") from None
    unknown = sorted(set(document) - {"schema", "version", "issued", "expires", "models", "signatures"})
    if unknown:
        raise LockError(f"{_member(unknown[0])}: unknown member")
    for member in ("schema", "version", "models"):
        if member not in document:
            raise LockError(f"{member}: required")
    if type(document["schema"]) is not int or document["schema"] != SCHEMA:
        raise LockError(f"schema: must be {SCHEMA}")
    models = document["models"]
    if not isinstance(models, dict):
        raise LockError("models: must be an object of model name -> entry")
    issued = document.get("issued")
    expires = document.get("expires")
    return Lockfile(
        version=_int(document["version"], "version"),
        issued=None if issued is None else _parse_time(issued, "issued"),
        expires=None if expires is None else _parse_time(expires, "expires"),
        models={name: _model(name, entry) for name, entry in models.items()},
        signatures=_signatures(document.get("signatures", [])),
        document=document,
    )


def read_lock_bytes(path: Path) -> bytes:
    """The bytes of a lockfile: a regular file of at most MAX_LOCK_BYTES (never blocks)."""
    try:
        return read_regular(path, MAX_LOCK_BYTES)
    except UnsuitableFile as exc:
        raise LockError(str(exc)) from None
    except OSError as exc:
        raise LockError(f"cannot read {path}: {exc.strerror}") from None


def load_lock(path: Path) -> Lockfile:
    """Read and parse a lockfile."""
    return parse_lock(read_lock_bytes(path))


# ---- keys -----------------------------------------------------------------------------------


def key_id(key: Ed25519PublicKey) -> str:
    """Hex sha256 of the raw 32-byte public key."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read a PEM Ed25519 public key."""
    try:
        key = serialization.load_pem_public_key(read_regular(path, MAX_KEY_BYTES))
    except UnsuitableFile as exc:
        raise LockError(f"public key {exc}") from None
    except OSError as exc:
        raise LockError(f"cannot read public key {path}: {exc.strerror}") from None
    except ValueError:
        raise LockError(f"{path} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise LockError(f"{path} is not an Ed25519 public key")
    return key


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key (unencrypted PKCS#8)."""
    try:
        key = serialization.load_pem_private_key(read_regular(path, MAX_KEY_BYTES), password=None)
    except UnsuitableFile as exc:
        raise LockError(f"signing key {exc}") from None
    except OSError as exc:
        raise LockError(f"cannot read signing key {path}: {exc.strerror}") from None
    except (ValueError, TypeError):
        raise LockError(f"{path} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise LockError(f"{path} is not an Ed25519 private key")
    return key


def sign(document: Mapping[str, Any], key: Ed25519PrivateKey) -> dict[str, str]:
    """A signature entry over the canonical form of `document`."""
    sig = key.sign(canonical_bytes(document))
    return {
        "key_id": key_id(key.public_key()),
        "alg": ALGORITHM,
        "sig": base64.b64encode(sig).decode("ascii"),
    }


def verify_lock(lock: Lockfile, trusted: Sequence[Ed25519PublicKey], *, now: datetime | None = None) -> str:
    """Check signatures and expiry; return the id of the trusted key whose signature verified."""
    if not lock.signatures:
        raise LockError("the lockfile is not signed")
    by_id = {key_id(k): k for k in trusted}
    message = lock.canonical()
    known = [s for s in lock.signatures if s.key_id in by_id]
    if not known:
        ids = ", ".join(s.key_id[:16] for s in lock.signatures)
        raise LockError(f"the lockfile is signed only by untrusted keys ({ids})")
    verified = None
    for signature in known:
        try:
            by_id[signature.key_id].verify(signature.sig, message)
        except InvalidSignature:
            continue
        verified = signature.key_id
        break
    if verified is None:
        raise LockError("the lockfile's signature does not verify: it was changed after signing")
    moment = now or datetime.now(UTC)
    if lock.expires is None:
        raise LockError("the lockfile has no expiry time (sign it with an expiry)")
    if moment >= lock.expires:
        raise LockError(f"the lockfile expired at {format_time(lock.expires)}")
    return verified


# ---- rollback protection -----------------------------------------------------------------


class VersionState:
    """The highest lockfile version this box has accepted, persisted atomically."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / STATE_FILE

    def highest(self) -> int:
        """0 when nothing was accepted yet; a corrupt state file is refused, never reset."""
        try:
            data = json.loads(read_regular(self.path, MAX_STATE_BYTES))
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise LockError(f"cannot read rollback state {self.path}: {exc.strerror}") from None
        except ValueError as exc:
            raise LockError(f"cannot read rollback state {self.path}: {exc}") from None
        value = data.get("highest_version") if isinstance(data, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LockError(f"rollback state {self.path} is corrupt")
        return value

    def check(self, version: int) -> None:
        """Refuse a version lower than one accepted before."""
        highest = self.highest()
        if version < highest:
            raise LockError(
                f"lockfile version {version} is lower than version {highest} "
                "accepted before (rollback refused)"
            )

    def accept(self, version: int) -> None:
        """Record `version` if it is the highest yet (write, fsync, rename, fsync the folder)."""
        if version <= self.highest():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".lock-state.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"highest_version": version}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ---- model files -------------------------------------------------------------------------


def resolve_model_file(models_dir: Path, file: str) -> Path:
    """The model's path inside `models_dir`; refuses absolute paths, `..` and symlink escapes."""
    problem = file_problem(file)  # parse_lock refused these already; this keeps callers safe alone
    if problem is not None:
        raise LockError(f"file: {problem}")
    try:
        root = models_dir.resolve()
        path = (root / file).resolve()
    except (RuntimeError, OSError):  # a symlink loop: RuntimeError up to Python 3.12, OSError after
        raise LockError(f"file {shown(file)} is a symlink loop") from None
    if not path.is_relative_to(root):
        raise LockError(f"file {shown(file)} resolves outside the models directory (through a symlink)")
    return path
