"""Preloading model files into tmpfs: copy while hashing, space checks, and cleanup of copies."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Final

from edgellmd.files import UnsuitableFile, open_regular
from edgellmd.models.lockfile import LockedModel, LockError
from edgellmd.models.verify import Progress, check_bytes, check_size, hash_stream

log = logging.getLogger(__name__)

AREA_PREFIX: Final = "edgellmd-"  # one directory per running daemon under the preload root
LOCK_NAME: Final = ".lock"  # held (flock) while the daemon lives: an unlocked area is stale
PARTIAL_PREFIX: Final = ".partial-"  # a copy being written; never loaded, removed on failure
# Left free on the filesystem beyond the copy itself: other tenants of /dev/shm (CUDA, POSIX
# shared memory) fail in odd ways when it fills up.
SPARE_BYTES: Final = 16 * 1024 * 1024


class NoRoom(Exception):
    """The preload area cannot hold this copy; load from the models directory instead."""


class PreloadArea:
    """This daemon's directory under the preload root, locked while the daemon lives.

    Copies are written as hidden partial files and renamed once complete and verified, so
    a copy with its final name is always whole. At start-up the areas of daemons that are
    gone (their lock is free: killed, crashed) are removed with whatever they held.
    """

    def __init__(self, root: Path, *, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.path: Path | None = None
        self._lock_fd = -1

    def open(self) -> None:
        """Create the root (0700) and this daemon's locked area; remove stale areas first."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        removed = remove_stale_areas(self.root)
        if removed:
            log.info("removed %d stale preload area(s) under %s", removed, self.root)
        path = self.root / f"{AREA_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700)
        fd = os.open(path / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path, self._lock_fd = path, fd

    def close(self) -> None:
        """Remove this daemon's area and everything in it."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def used_bytes(self) -> int:
        """Bytes held by the copies in this area."""
        if self.path is None:
            return 0
        total = 0
        with os.scandir(self.path) as entries:
            for item in entries:
                try:
                    total += item.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # removed meanwhile (a retired copy)
        return total

    def room(self) -> int:
        """Bytes a new copy may take: the filesystem's free space less a margin, within max_bytes."""
        if self.path is None:
            return 0
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize - SPARE_BYTES
        if self.max_bytes is not None:
            free = min(free, self.max_bytes - self.used_bytes())
        return max(free, 0)

    def copy(
        self, source: Path, name: str, entry: LockedModel | None, progress: Progress | None = None
    ) -> Path:
        """Copy `source` into the area while hashing it; with `entry`, verify size, sha256 and header.

        Raises NoRoom when the copy does not fit (checked first, and on ENOSPC while
        writing), LockError when the bytes are not the ones the lock approved.
        """
        if self.path is None:
            raise NoRoom("no preload area")
        label = entry.file if entry is not None else source.name
        try:
            src = open_regular(source, follow_symlinks=False)
        except UnsuitableFile as exc:  # a FIFO would block the copy (and the registry) forever
            raise LockError(exc.describe(label)) from None
        except OSError as exc:
            raise LockError(f"cannot open {label}: {exc.strerror}") from None
        try:
            size = os.fstat(src).st_size
            if entry is not None:
                check_size(entry, size)  # before copying gigabytes
            room = self.room()
            if size > room:
                raise NoRoom(f"{size} bytes needed, {room} available")
            final = self.path / f"{name}-{secrets.token_hex(4)}.gguf"
            partial = self.path / f"{PARTIAL_PREFIX}{final.name}"
            try:
                digest = _copy_hashing(src, partial, size, progress)
                if entry is not None:
                    _check_copy(partial, digest, entry)
                partial.rename(final)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
        finally:
            os.close(src)
        return final

    def remove(self, copy: Path) -> None:
        """Delete a copy (a model that was retired); a missing one is fine."""
        copy.unlink(missing_ok=True)


def _copy_hashing(src: int, dest: Path, size: int, progress: Progress | None) -> str:
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
    try:
        digest = hash_stream(src, size, progress, sink=out)
        if os.read(src, 1):
            raise LockError("the file grew while it was being copied (still being written?)")
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise NoRoom(f"the preload area filled up: {exc.strerror}") from None
        raise
    finally:
        os.close(out)
    return digest


def _check_copy(copy: Path, digest: str, entry: LockedModel) -> None:
    # The digest is of the bytes that were written: what gets loaded is what was checked.
    check_bytes(entry, digest, copy)


def remove_stale_areas(root: Path) -> int:
    """Remove the areas under `root` whose daemon is gone; returns how many."""
    removed = 0
    for area in root.glob(f"{AREA_PREFIX}*"):
        if not area.is_dir() or area.is_symlink():
            continue
        try:
            fd = os.open(area / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1  # killed between mkdir and lock: stale too
        except OSError:
            continue
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live daemon holds it
            shutil.rmtree(area, ignore_errors=True)
            removed += 1
        finally:
            if fd >= 0:
                os.close(fd)
    return removed
