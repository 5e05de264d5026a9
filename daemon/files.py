"""Opening files that must be regular files, without ever blocking.

Model files, the lockfile, trusted keys and the keys file are named by configuration and
live in directories an operator (or an attacker with a foothold) can write. A FIFO put
there blocks a plain `open()` until someone writes to it; a character device such as
/dev/zero never ends; a directory or a socket cannot be read at all. Everything here looks
at the file before opening it (opening a device can have effects of its own: a tape
rewinds, a watchdog arms), opens it without blocking, and checks what was opened.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Final

StrPath = str | os.PathLike[str]

# What a file is when it is not a regular file, for messages ("... is a FIFO, not a regular file").
_KINDS: Final = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),  # only seen with follow_symlinks=False
)


class UnsuitableFile(OSError):
    """A file refused before it was read; `str()` is one line naming the file and the reason.

    An OSError, so that code which already reports "cannot read X: <strerror>" reports these
    too; `describe(name)` words the reason for another name (a path relative to a folder).
    """

    def __init__(self, path: StrPath, problem: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, f"Is {problem}", os.fspath(path))
        self.problem = problem  # "a FIFO, not a regular file", "larger than 4096 bytes"

    def describe(self, name: str) -> str:
        """The reason, about `name`: "<name> is a FIFO, not a regular file"."""
        return f"{name} is {self.problem}"

    def __str__(self) -> str:
        return self.describe(str(self.filename))


class NotRegularFile(UnsuitableFile):
    """A FIFO, device, directory, socket (or, not following symlinks, a symlink) where a file belongs."""

    def __init__(self, path: StrPath, kind: str) -> None:
        code = errno.EISDIR if kind == "a directory" else errno.EINVAL
        super().__init__(path, f"{kind}, not a regular file", code)
        self.kind = kind


class FileTooLarge(UnsuitableFile):
    """A small file (a lockfile, a key) that is larger than its bound."""

    def __init__(self, path: StrPath, max_bytes: int) -> None:
        super().__init__(path, f"larger than {max_bytes} bytes", errno.EFBIG)
        self.max_bytes = max_bytes


def kind_of(mode: int) -> str | None:
    """What a file of this `st_mode` is ("a FIFO", "a directory", ...); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a file")


def _refuse_irregular(path: StrPath, mode: int) -> None:
    kind = kind_of(mode)
    if kind is not None:
        raise NotRegularFile(path, kind)


def open_regular(path: StrPath, *, follow_symlinks: bool = True) -> int:
    """Open a regular file read-only and close-on-exec, never blocking; the caller closes the fd.

    Raises NotRegularFile for anything else (with `follow_symlinks=False`, a symlink too,
    and the open uses O_NOFOLLOW), and the OSError of stat or open otherwise.
    """
    # Looked at first so that devices are not even opened; the fstat below is what counts
    # (the path may have been swapped in between) and O_NONBLOCK keeps that open from
    # waiting on a FIFO's writer. O_NOCTTY: a terminal never becomes ours by being opened.
    _refuse_irregular(path, os.stat(path, follow_symlinks=follow_symlinks).st_mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    fd = os.open(path, flags)
    try:
        _refuse_irregular(path, os.fstat(fd).st_mode)
        # Reads of a regular file never block anyway; cleared so the fd behaves as usual.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: StrPath, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The whole content of a small regular file; FileTooLarge when it holds more than `max_bytes`."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    with os.fdopen(fd, "rb") as fh:
        if os.fstat(fd).st_size > max_bytes:
            raise FileTooLarge(path, max_bytes)
        data = fh.read(max_bytes + 1)  # one more: a file that grew since the fstat is caught too
    if len(data) > max_bytes:
        raise FileTooLarge(path, max_bytes)
    return data
