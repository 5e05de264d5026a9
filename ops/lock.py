"""`edgellmctl keygen` and `edgellmctl lock add|remove|sign|verify|show`: the signed model lockfile."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgellmctl.cli import CommandError, Subcommands, guarded
from edgellmd.files import UnsuitableFile, open_regular
from edgellmd.models.lockfile import (
    MODEL_NAME,
    SCHEMA,
    LockError,
    VersionState,
    file_problem,
    format_time,
    key_id,
    load_lock,
    load_private_key,
    load_public_key,
    parse_lock,
    read_lock_bytes,
    shown,
    sign,
    verify_lock,
)
from edgellmd.models.verify import hash_fd, open_verified, read_gguf_facts
from edgellmd.settings import ConfigError, load_settings

DEFAULT_LOCK: Final = Path("models.lock")
DEFAULT_EXPIRY: Final = "365d"
_DURATION: Final = re.compile(r"(\d+)([dhw])")
_UNITS: Final = {"h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}
MAX_VALIDITY: Final = timedelta(days=100 * 365)  # a signature meant to outlive the box is a mistake


# ---- files ----------------------------------------------------------------------------------


def write_atomically(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    *,
    replace: bool = True,
    check: Callable[[Path], None] | None = None,
) -> None:
    """Write `data` to `path` via a temporary file and a rename: readers never see half a file.

    `check(temporary path)` may refuse the written file before it takes `path`'s name; with
    `replace=False` an existing `path` is never replaced (FileExistsError).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if check is not None:
            check(Path(tmp))
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails when `path` exists, where a rename would replace it
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone already after a rename


def read_document(path: Path) -> dict[str, Any]:
    """The lockfile as a plain JSON document, checked by the daemon's parser (one read of the file)."""
    data = read_lock_bytes(path)
    parse_lock(data)  # refuses malformed locks and bad entries with the member named
    document: dict[str, Any] = json.loads(data)
    return document


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write a lockfile in a stable, readable layout; never one the daemon would refuse."""
    text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    parse_lock(text)
    write_atomically(path, text.encode())


def new_document() -> dict[str, Any]:
    """An empty, unsigned lockfile."""
    return {"schema": SCHEMA, "version": 0, "models": {}, "signatures": []}


def parse_duration(text: str) -> timedelta:
    """'365d', '12h', '2w' -> timedelta."""
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match.group(1)) == 0:
        raise CommandError(f"--expires must look like 365d, 12h or 2w, got {text[:32]!r}")
    count, unit = int(match.group(1)), _UNITS[match.group(2)]
    if count > MAX_VALIDITY // unit:
        raise CommandError(f"--expires must be at most {MAX_VALIDITY.days} days")
    return count * unit


class _Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.enabled = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        self.done += n
        if self.enabled:
            pct = 100 * self.done // max(self.total, 1)
            print(
                f"\r{self.label}: {pct:3d}% ({self.done >> 20}/{self.total >> 20} MiB)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


# ---- commands -------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    """Write an Ed25519 signing key (0600, never overwritten) and its public key."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    private_path = out / f"{args.name}.pem"
    public_path = out / f"{args.name}.pub"
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        # An existing key is never replaced (it may be the only copy), and a write cut short
        # leaves no half a key under its name.
        write_atomically(private_path, pem, 0o600, replace=False)
    except FileExistsError:
        raise CommandError(f"{private_path} exists; refusing to overwrite a signing key") from None
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    write_atomically(public_path, public)
    print(f"signing key  {private_path} (keep it secret; mode 0600)")
    print(f"public key   {public_path} (give this to the daemons: lock.trusted_keys)")
    print(f"key id       {key_id(key.public_key())}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    """Hash a GGUF file and record it under NAME (dropping signatures: the content changed)."""
    lock_path: Path = args.lock
    file: Path = args.file
    if not MODEL_NAME.fullmatch(args.name):
        raise CommandError(
            f"model names are 1-64 of A-Za-z0-9._:- starting with a letter or digit, got {shown(args.name)}"
        )
    models_dir: Path = args.models_dir or lock_path.parent
    document = read_document(lock_path) if lock_path.exists() else new_document()
    try:
        relative = file.resolve().relative_to(models_dir.resolve()).as_posix()
    except ValueError:
        raise CommandError(
            f"{file} is not inside the models directory {models_dir} "
            "(lockfile paths are relative to it; see --models-dir)"
        ) from None
    problem = file_problem(relative)
    if problem is not None:
        raise CommandError(f"{shown(str(file))}: the lockfile cannot name it: {problem}")
    try:
        fd = open_regular(file)
    except UnsuitableFile as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot read {file}: {exc.strerror}") from None
    try:
        # Header and hash both come from this one descriptor: the bytes recorded are the
        # bytes whose header was read.
        facts = read_gguf_facts(Path(f"/proc/self/fd/{fd}"))
        size = os.fstat(fd).st_size
        progress = _Progress(f"hashing {file.name}", size)
        digest = hash_fd(fd, size, progress)
        progress.close()
    except LockError as exc:
        raise CommandError(f"{file}: {exc}") from None
    finally:
        os.close(fd)
    gguf = {k: facts[k] for k in ("architecture", "file_type") if k in facts}
    document["models"][args.name] = {"file": relative, "size": size, "sha256": digest, "gguf": gguf}
    dropped = len(document.get("signatures", []))
    document["signatures"] = []
    try:
        write_document(lock_path, document)
    except LockError as exc:  # what the file's header says does not fit in a lockfile
        raise CommandError(f"{file}: {exc}") from None
    print(
        f"{args.name}: {relative} {size} bytes sha256 {digest} "
        f"({facts.get('architecture')}, {facts.get('file_type', '?')})"
    )
    if dropped:
        print(f"removed {dropped} signature(s): the lock changed; sign it again", file=sys.stderr)
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Drop NAME from the lock (and its now-invalid signatures)."""
    document = read_document(args.lock)
    if args.name not in document["models"]:
        raise CommandError(f"{args.name!r} is not in {args.lock}")
    del document["models"][args.name]
    document["signatures"] = []
    write_document(args.lock, document)
    print(f"removed {args.name}; the lock is now unsigned: sign it again")
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    """Bump (or set) the version, set issued/expires, and sign; --cosign adds a signature only."""
    document = read_document(args.lock)
    key = load_private_key(args.key)
    if args.cosign:
        if not document.get("signatures"):
            raise CommandError("--cosign needs a lock that is already signed")
        if args.version is not None or args.expires is not None:
            raise CommandError("--cosign signs the lock as it is: no --version or --expires")
    else:
        version = document["version"] + 1 if args.version is None else args.version
        if version < 0:
            raise CommandError("--version must be >= 0")
        now = datetime.now(UTC).replace(microsecond=0)
        document["version"] = version
        document["issued"] = format_time(now)
        document["expires"] = format_time(now + parse_duration(args.expires or DEFAULT_EXPIRY))
        document["signatures"] = []
    parse_lock(json.dumps(document))  # only a lock the daemon would take is ever signed
    signature = sign(document, key)
    document["signatures"] = [s for s in document["signatures"] if s["key_id"] != signature["key_id"]]
    document["signatures"].append(signature)
    write_document(args.lock, document)
    print(
        f"signed {args.lock} version {document['version']} (expires {document['expires']}) "
        f"with key {signature['key_id'][:16]}…"
    )
    return 0


@dataclass(frozen=True, slots=True)
class _Verified:
    """What `lock verify` checks: the lockfile, the keys it must be signed by, where its files are."""

    lock: Path
    trusted: tuple[Path, ...]
    models_dir: Path
    state_dir: Path | None = None  # the daemon's rollback state, when known


def _from_config(config: Path) -> _Verified:
    """The lockfile, trusted keys, models and state directories of the daemon's own configuration."""
    try:
        os.close(open_regular(config))  # load_settings would wait on a FIFO for ever
    except UnsuitableFile as exc:
        raise CommandError(f"--config: {exc}") from None
    except OSError:
        pass  # load_settings reports a file it cannot read as a config problem
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        first = exc.problems[0] if exc.problems else "invalid"
        more = (
            f" (and {len(exc.problems) - 1} more: edgellmd --check-config {config} lists them)"
            if len(exc.problems) > 1
            else ""
        )
        where = "" if first.startswith(str(config)) else f"{config}: "
        raise CommandError(f"{where}{first}{more}") from None
    lock = settings.lock
    if lock.allow_unsigned or lock.file is None or lock.models_dir is None:
        raise CommandError(f"{config} sets lock.allow_unsigned: it names no lockfile to verify")
    return _Verified(lock.file, lock.trusted_keys, lock.models_dir, lock.state_dir)


def cmd_verify(args: argparse.Namespace) -> int:
    """Check signatures, expiry and every file; one line per model; 0 only when all pass."""
    if args.config is not None:
        what = _from_config(args.config)
    else:
        path: Path = args.lock or DEFAULT_LOCK
        what = _Verified(path, tuple(args.trusted or ()), args.models_dir or path.parent)
    lock = load_lock(what.lock)
    ok = True
    if what.trusted:
        try:
            signer = verify_lock(lock, [load_public_key(p) for p in what.trusted])
            if what.state_dir is not None:  # the daemon refuses a version older than one it accepted
                VersionState(what.state_dir).check(lock.version)
            print(
                f"lock      version {lock.version}: signature by {signer[:16]}… verifies; "
                f"expires {format_time(lock.expires) if lock.expires else 'never'}"
            )
        except LockError as exc:
            ok = False
            print(f"lock      FAILED: {exc}")
    else:
        # Matching files prove nothing on their own: whoever can write them can write the lock.
        ok = False
        print(
            f"lock      version {lock.version}: FAILED: no signature verified: no trusted key given "
            "(--trusted PUBKEY, or --config FILE for the daemon's own)"
        )
    for name, entry in sorted(lock.models.items()):
        try:
            open_verified(what.models_dir, entry, _Progress(f"hashing {entry.file}", entry.size)).close()
        except LockError as exc:
            ok = False
            print(f"{name:<9} FAILED: {exc}")
        else:
            print(f"{name:<9} ok: {entry.file} {entry.size} bytes sha256 {entry.sha256[:16]}…")
    return 0 if ok else 1


def cmd_show(args: argparse.Namespace) -> int:
    """Print the lock as a table."""
    lock = load_lock(args.lock)
    issued = format_time(lock.issued) if lock.issued else "-"
    expires = format_time(lock.expires) if lock.expires else "-"
    print(f"version {lock.version}  issued {issued}  expires {expires}  signatures {len(lock.signatures)}")
    for s in lock.signatures:
        print(f"  signed by {s.key_id}")
    rows = [("NAME", "FILE", "SIZE", "SHA256", "GGUF")]
    rows += [
        (
            m.name,
            m.file,
            str(m.size),
            m.sha256[:16] + "…",
            " ".join(f"{k}={v}" for k, v in sorted(m.gguf.items())),
        )
        for m in sorted(lock.models.values(), key=lambda m: m.name)
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


# ---- parser ---------------------------------------------------------------------------------


def add_parser(sub: Subcommands) -> None:
    """Register `keygen` and `lock`."""
    keygen = sub.add_parser("keygen", help="make an Ed25519 signing key for lockfiles")
    keygen.add_argument("--out", required=True, type=Path, help="directory for NAME.pem and NAME.pub")
    keygen.add_argument("--name", default="signing", help="file name stem (default: signing)")
    keygen.set_defaults(func=guarded(cmd_keygen, LockError))

    lock = sub.add_parser("lock", help="manage the signed model lockfile")
    verbs = lock.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help_: str, lock_default: Path | None = DEFAULT_LOCK) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help_)
        p.add_argument("--lock", type=Path, default=lock_default, help="lockfile (default: models.lock)")
        return p

    add = verb("add", "hash a GGUF file and record it")
    add.add_argument("name", help="model name, as clients will ask for it")
    add.add_argument("file", type=Path, help="the GGUF file (inside the models directory)")
    add.add_argument("--models-dir", type=Path, help="models directory (default: the lockfile's folder)")
    add.set_defaults(func=guarded(cmd_add, LockError))

    remove = verb("remove", "drop a model from the lockfile")
    remove.add_argument("name")
    remove.set_defaults(func=guarded(cmd_remove, LockError))

    sign_p = verb("sign", "bump the version, set the expiry and sign")
    sign_p.add_argument("--key", type=Path, required=True, help="PEM signing key from keygen")
    sign_p.add_argument("--expires", help=f"validity from now: 365d, 12h, 2w (default {DEFAULT_EXPIRY})")
    sign_p.add_argument("--version", type=int, help="set this version instead of bumping it")
    sign_p.add_argument(
        "--cosign", action="store_true", help="add this key's signature without changing the lock"
    )
    sign_p.set_defaults(func=guarded(cmd_sign, LockError))

    # --lock defaults to None here: a --lock given beside --config is told apart from none.
    verify = verb("verify", "check signatures, expiry and every file", lock_default=None)
    verify.add_argument("--models-dir", type=Path, help="models directory (default: the lockfile's folder)")
    verify.add_argument("--trusted", type=Path, nargs="+", metavar="PUBKEY", help="trusted public keys")
    verify.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the daemon's config (edgellm.yaml): verify its lockfile with its trusted "
        "keys, models directory and rollback state",
    )
    run_verify = guarded(cmd_verify, LockError)

    def verify_alone(args: argparse.Namespace) -> int:
        if args.config is not None and (args.lock is not None or args.trusted or args.models_dir is not None):
            verify.error(
                "--config names the lockfile, trusted keys and models directory: "
                "not with --lock, --trusted or --models-dir"
            )
        return run_verify(args)

    verify.set_defaults(func=verify_alone)

    show = verb("show", "print the lockfile as a table")
    show.set_defaults(func=guarded(cmd_show, LockError))
