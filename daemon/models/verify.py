"""A model file's bytes against its lock entry: size, sha256 and GGUF header, read once.

One module for both ways a file is checked: opened in the models directory and hashed
through the descriptor that is then loaded (`open_verified`), or hashed while it is copied
into /dev/shm (`models.preload`, through `hash_stream`'s sink). Either way what is loaded is
the bytes that were hashed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from edgellmd.files import UnsuitableFile, open_regular
from edgellmd.models import gguf
from edgellmd.models.lockfile import LockedModel, LockError, resolve_model_file, shown

HASH_CHUNK: Final = 4 * 1024 * 1024  # large reads keep hashing at the speed of sha256sum
Progress = Callable[[int], None]  # called with the number of bytes just hashed


class VerifiedFile:
    """A model file opened once, checked through that descriptor, and loaded through it too.

    Loading `load_path` (/proc/self/fd/N) reads the inode that was hashed even if the path
    is replaced afterwards; the /dev/shm preload copies while hashing, which also rules out
    writes into the same inode.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @property
    def load_path(self) -> Path:
        """A path that names exactly the verified open file."""
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        """Close the descriptor (a loaded model keeps its own mapping)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def hash_stream(src: int, size: int, progress: Progress | None = None, sink: int | None = None) -> str:
    """sha256 of the next `size` bytes read from `src`, written on to `sink` as they are read
    (the preload copy) when one is given. LockError when the file ends early."""
    digest = hashlib.sha256()
    view = memoryview(bytearray(HASH_CHUNK))
    remaining = size
    while remaining > 0:
        n = os.readv(src, [view[: min(HASH_CHUNK, remaining)]])
        if n == 0:
            raise LockError("the file ended while it was being read (truncated meanwhile?)")
        chunk = view[:n]
        digest.update(chunk)
        written = 0
        while sink is not None and written < n:
            written += os.write(sink, chunk[written:])
        remaining -= n
        if progress is not None:
            progress(n)
    return digest.hexdigest()


def hash_fd(fd: int, size: int, progress: Progress | None = None) -> str:
    """sha256 of the first `size` bytes readable from `fd`, from its start."""
    os.lseek(fd, 0, os.SEEK_SET)
    return hash_stream(fd, size, progress)


def check_size(entry: LockedModel, size: int) -> None:
    """Refuse a file whose size is not the lock's (before hashing gigabytes)."""
    if size != entry.size:
        raise LockError(f"{entry.file} is {size} bytes; the lockfile says {entry.size}")


def check_bytes(entry: LockedModel, digest: str, path: Path) -> None:
    """Refuse bytes whose sha256 is not the lock's, or whose GGUF header (at `path`) disagrees."""
    if digest != entry.sha256:
        raise LockError(f"{entry.file} has sha256 {digest[:16]}...; the lockfile says {entry.sha256[:16]}...")
    check_gguf(read_gguf_facts(path), entry)


def open_verified(models_dir: Path, entry: LockedModel, progress: Progress | None = None) -> VerifiedFile:
    """Open the entry's file, check its size, hash and GGUF header; the caller closes it."""
    path = resolve_model_file(models_dir, entry.file)
    try:
        fd = open_regular(path, follow_symlinks=False)
    except UnsuitableFile as exc:
        raise LockError(exc.describe(entry.file)) from None
    except OSError as exc:
        raise LockError(f"cannot open {entry.file}: {exc.strerror}") from None
    verified = VerifiedFile(path, fd)
    try:
        _check_open_file(verified, entry, progress)
    except BaseException:
        verified.close()
        raise
    return verified


def check_sole_writer(fd: int, label: str) -> None:
    """Refuse a file loaded in place that someone but the daemon's user or root may write.

    A descriptor keeps the hashed inode when the path is replaced, not when the inode itself is
    rewritten: llama.cpp reads (or maps) the file after the hash, so another user with write
    access could put unverified weights under a verified hash. The owner is the daemon's user
    or root and the mode gives no group or other write (with POSIX ACLs the group bits are the
    mask, so no named user or group may write either). The preload copy needs none of this:
    it is the daemon's own."""
    st = os.fstat(fd)
    mine = os.geteuid()
    if st.st_uid not in (mine, 0):
        raise LockError(
            f"{label} is owned by uid {st.st_uid}, who could rewrite it after it is hashed: a model "
            f"loaded in place (no preload copy) must be owned by root or the daemon's user (uid {mine})"
        )
    if st.st_mode & 0o022:
        raise LockError(
            f"{label} is writable by its group or others (mode {st.st_mode & 0o777:o}), who could rewrite "
            "it after it is hashed: a model loaded in place (no preload copy) must not be (chmod go-w)"
        )


def _check_open_file(verified: VerifiedFile, entry: LockedModel, progress: Progress | None) -> None:
    check_sole_writer(verified.fd, shown(entry.file))
    size = os.fstat(verified.fd).st_size
    check_size(entry, size)
    digest = hash_fd(verified.fd, size, progress)
    if os.fstat(verified.fd).st_size != size:
        raise LockError(f"{entry.file} changed size while it was being hashed")
    check_bytes(entry, digest, verified.load_path)


def read_gguf_facts(path: Path) -> dict[str, str | int]:
    """Architecture, file type and context length from a GGUF header; LockError when it is not one."""
    try:
        return gguf.read_gguf_facts(path)
    except gguf.GgufError as exc:
        raise LockError(str(exc)) from None


def check_gguf(facts: Mapping[str, str | int], entry: LockedModel) -> None:
    """Refuse a file whose GGUF header disagrees with what the lock recorded."""
    for member, expected in entry.gguf.items():
        actual = facts.get(member)
        if actual != expected:
            raise LockError(
                f"{entry.file}: GGUF {member} is {_fact(actual)}; the lockfile says {_fact(expected)}"
            )


def _fact(value: object) -> str:
    # A GGUF header is untrusted until it matches: its strings may be huge or hold anything.
    return shown(value) if isinstance(value, str) else repr(value)
