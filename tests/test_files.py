"""Files that must be regular: FIFOs, devices, directories and sockets are refused at once, never read."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgellmd import files
from edgellmd.files import FileTooLarge, NotRegularFile, UnsuitableFile, open_regular, read_regular
from edgellmd.keys import KeysFileError, read_keys_file
from edgellmd.models.lockfile import (
    LockedModel,
    LockError,
    VersionState,
    load_lock,
    load_private_key,
    load_public_key,
)
from edgellmd.models.preload import PreloadArea
from edgellmd.models.verify import open_verified, read_gguf_facts
from tests.ggufmodels import TinyModelSpec, write_tiny_model

PROMPTLY_S = 5.0  # a refusal takes microseconds; a blocked open() would take for ever


@contextlib.contextmanager
def promptly(seconds: float = PROMPTLY_S) -> Iterator[None]:
    """Fail instead of hanging when the body blocks (a FIFO open waits for a writer for ever)."""

    def expire(_signum: int, _frame: FrameType | None) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


def _directory(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


@contextlib.contextmanager
def _socket_at(path: Path) -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes: bind by a short relative name in the folder.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = Path.cwd()
    os.chdir(path.parent)
    try:
        sock.bind(path.name)
    finally:
        os.chdir(cwd)
    try:
        yield path
    finally:
        sock.close()


@contextlib.contextmanager
def irregular(kind: str, path: Path) -> Iterator[Path]:
    """A non-regular file of `kind` at `path` (or, for devices, the device itself)."""
    if kind == "fifo":
        yield _fifo(path)
    elif kind == "directory":
        yield _directory(path)
    elif kind == "socket":
        with _socket_at(path) as where:
            yield where
    elif kind == "/dev/null":
        yield Path("/dev/null")
    elif kind == "/dev/zero":
        yield Path("/dev/zero")  # a read of it never ends
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "/dev/null", "/dev/zero", "directory", "socket"]
WORDS = {
    "fifo": "a FIFO",
    "/dev/null": "a character device",
    "/dev/zero": "a character device",
    "directory": "a directory",
    "socket": "a socket",
}


# ---- open_regular and read_regular ------------------------------------------------------------------


def test_a_regular_file_opens_blocking_and_close_on_exec(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"hello")
    fd = open_regular(path)
    try:
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert os.read(fd, 10) == b"hello"
    finally:
        os.close(fd)
    assert read_regular(path, 5) == b"hello"


@pytest.mark.parametrize("kind", KINDS)
def test_anything_but_a_regular_file_is_refused_at_once_in_one_line(kind: str, tmp_path: Path) -> None:
    with irregular(kind, tmp_path / "thing") as path, promptly():
        with pytest.raises(NotRegularFile) as caught:
            open_regular(path)
        with pytest.raises(NotRegularFile):
            read_regular(path, 1024)
    assert str(caught.value) == f"{path} is {WORDS[kind]}, not a regular file"
    assert caught.value.describe("model.gguf") == f"model.gguf is {WORDS[kind]}, not a regular file"
    # An OSError, so that "cannot read X: <strerror>" reports read well too.
    assert isinstance(caught.value, OSError)
    assert caught.value.strerror == f"Is {WORDS[kind]}, not a regular file"


def test_a_fifo_swapped_in_after_the_look_is_refused_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    fifo = _fifo(tmp_path / "fifo")
    real_stat = os.stat

    def looked_before_the_swap(path: Any, **kwargs: Any) -> os.stat_result:
        return real_stat(regular) if Path(path) == fifo else real_stat(path, **kwargs)

    monkeypatch.setattr(os, "stat", looked_before_the_swap)
    with promptly(), pytest.raises(NotRegularFile, match="is a FIFO"):
        open_regular(fifo)  # O_NONBLOCK: the open returns, the fstat refuses


def test_symlinks_are_followed_unless_asked_not_to(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"data")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_regular(link, 10) == b"data"
    with pytest.raises(NotRegularFile, match="is a symbolic link, not a regular file"):
        open_regular(link, follow_symlinks=False)
    fifo_link = tmp_path / "fifo-link"
    fifo_link.symlink_to(_fifo(tmp_path / "fifo"))
    with promptly(), pytest.raises(NotRegularFile, match="is a FIFO"):
        open_regular(fifo_link)


def test_read_regular_refuses_more_than_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_regular(path, 100) == b"x" * 100
    with pytest.raises(FileTooLarge) as caught:
        read_regular(path, 99)
    assert str(caught.value) == f"{path} is larger than 99 bytes"


def test_a_missing_file_is_the_usual_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "nope")
    assert not issubclass(FileNotFoundError, UnsuitableFile)


def test_kind_of() -> None:
    assert files.kind_of(stat.S_IFREG | 0o644) is None
    assert files.kind_of(stat.S_IFBLK) == "a block device"
    assert files.kind_of(stat.S_IFLNK) == "a symbolic link"


# ---- every reader of a model, lock or key file uses it ------------------------------------------------


def _pub(path: Path) -> Path:
    key = Ed25519PrivateKey.generate()
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


Reader = Callable[[Path], object]
READERS: list[tuple[str, Reader, type[Exception], str]] = [
    ("load_lock", load_lock, LockError, "{path} is {kind}, not a regular file"),
    ("load_public_key", load_public_key, LockError, "public key {path} is {kind}, not a regular file"),
    ("load_private_key", load_private_key, LockError, "signing key {path} is {kind}, not a regular file"),
    ("read_keys_file", read_keys_file, KeysFileError, "{path} is {kind}, not a regular file"),
    ("read_gguf_facts", read_gguf_facts, LockError, "the file is {kind}, not a regular file"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("reader", "error", "message"), [pytest.param(r, e, m, id=i) for i, r, e, m in READERS]
)
def test_each_reader_refuses_a_file_that_is_not_regular_in_one_line(
    kind: str, reader: Reader, error: type[Exception], message: str, tmp_path: Path
) -> None:
    with irregular(kind, tmp_path / "lock-state.json") as path, promptly(), pytest.raises(error) as caught:
        reader(path)
    assert str(caught.value) == message.format(path=path, kind=WORDS[kind])


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_a_rollback_state_file_that_is_not_regular_is_refused(kind: str, tmp_path: Path) -> None:
    state = tmp_path / "lock-state.json"
    with irregular(kind, state) as path, promptly(), pytest.raises(LockError) as caught:
        VersionState(tmp_path).highest()
    assert str(caught.value) == f"cannot read rollback state {path}: Is {WORDS[kind]}, not a regular file"


def test_a_public_key_larger_than_any_key_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.pub"
    big.write_bytes(_pub(tmp_path / "k.pub").read_bytes() * 1000)
    with pytest.raises(LockError, match=r"public key .* is larger than 65536 bytes"):
        load_public_key(big)


def _entry(path: Path, file: str) -> LockedModel:
    import hashlib  # noqa: PLC0415

    data = path.read_bytes()
    return LockedModel("tiny", file, len(data), hashlib.sha256(data).hexdigest(), {"architecture": "llama"})


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_a_model_file_that_is_not_regular_is_refused_by_verify_and_preload(kind: str, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    entry = _entry(write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(seed=3)), "model.gguf")
    area = PreloadArea(tmp_path / "shm")
    area.open()
    try:
        with irregular(kind, models / "model.gguf") as path, promptly():
            with pytest.raises(LockError) as verified:
                open_verified(models, entry)
            with pytest.raises(LockError) as copied:
                area.copy(path, "tiny", entry)
    finally:
        area.close()
    assert str(verified.value) == f"model.gguf is {WORDS[kind]}, not a regular file"
    assert str(copied.value) == f"model.gguf is {WORDS[kind]}, not a regular file"
