"""The preload area: verified copies only, never a half-written one, room checks, stale areas."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from edgellmd.models.lockfile import LockedModel, LockError
from edgellmd.models.preload import AREA_PREFIX, LOCK_NAME, NoRoom, PreloadArea, remove_stale_areas
from tests.ggufmodels import TinyModelSpec, write_tiny_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(seed=4))


def entry_for(path: Path, **changes: Any) -> LockedModel:
    data = path.read_bytes()
    fields: dict[str, Any] = {
        "name": "tiny",
        "file": path.name,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "gguf": {"architecture": "llama"},
    }
    fields.update(changes)
    return LockedModel(**fields)


@pytest.fixture
def area(tmp_path: Path) -> Any:
    opened = PreloadArea(tmp_path / "shm")
    opened.open()
    yield opened
    opened.close()


def files_in(area: PreloadArea) -> list[str]:
    assert area.path is not None
    return sorted(p.name for p in area.path.iterdir() if p.name != LOCK_NAME)


def test_a_verified_copy_is_byte_identical_and_read_only(area: PreloadArea, model: Path) -> None:
    copy = area.copy(model, "tiny", entry_for(model))
    assert copy.read_bytes() == model.read_bytes()
    assert copy.stat().st_mode & 0o777 == 0o400
    assert files_in(area) == [copy.name]
    assert area.used_bytes() == model.stat().st_size
    area.remove(copy)
    assert files_in(area) == []


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"sha256": "0" * 64}, "sha256"),
        ({"size": 1}, "bytes; the lockfile says 1"),
        ({"gguf": {"architecture": "gemma3"}}, "GGUF architecture"),
    ],
)
def test_a_copy_that_does_not_verify_leaves_nothing(
    area: PreloadArea, model: Path, changes: dict[str, Any], reason: str
) -> None:
    with pytest.raises(LockError, match=reason):
        area.copy(model, "tiny", entry_for(model, **changes))
    assert files_in(area) == []


def test_no_room_is_reported_before_copying(tmp_path: Path, model: Path) -> None:
    small = PreloadArea(tmp_path / "small", max_bytes=model.stat().st_size - 1)
    small.open()
    try:
        with pytest.raises(NoRoom, match="bytes needed"):
            small.copy(model, "tiny", entry_for(model))
        assert files_in(small) == []
    finally:
        small.close()


def test_a_full_filesystem_while_copying_is_no_room_and_leaves_nothing(
    area: PreloadArea, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    calls = []

    def write(fd: int, data: Any) -> int:
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(NoRoom, match="filled up"):
        area.copy(model, "tiny", entry_for(model))
    monkeypatch.undo()
    assert files_in(area) == []


def test_stale_areas_go_and_live_ones_stay(tmp_path: Path, model: Path) -> None:
    root = tmp_path / "shm"
    live = PreloadArea(root)
    live.open()
    live.copy(model, "tiny", None)
    stale = root / f"{AREA_PREFIX}99999-dead"
    stale.mkdir()
    (stale / LOCK_NAME).write_bytes(b"")
    (stale / "tiny-0000.gguf").write_bytes(b"old copy")
    lockless = root / f"{AREA_PREFIX}99998-early"  # killed before it took its lock
    lockless.mkdir()
    unrelated = root / "someone-else"
    unrelated.mkdir()
    assert remove_stale_areas(root) == 2
    assert not stale.exists()
    assert not lockless.exists()
    assert unrelated.exists()
    assert live.path is not None
    assert live.path.exists()
    live.close()
    assert not any(root.glob(f"{AREA_PREFIX}*"))


@pytest.mark.parametrize(("kind", "noun"), [("fifo", "a FIFO"), ("directory", "a directory")])
def test_a_source_that_is_not_a_regular_file_is_refused_at_once_and_leaves_nothing(
    area: PreloadArea, model: Path, tmp_path: Path, kind: str, noun: str
) -> None:
    source = tmp_path / "models" / "tiny.gguf"
    source.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(source)  # opened without O_NONBLOCK, the copy would wait for a writer for ever
    else:
        source.mkdir()
    with pytest.raises(LockError) as caught:
        area.copy(source, "tiny", entry_for(model))
    assert str(caught.value) == f"tiny.gguf is {noun}, not a regular file"
    assert files_in(area) == []
