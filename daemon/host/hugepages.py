"""Transparent huge pages for what a model load leaves resident: llama.cpp's weights, KV cache
and compute buffers.

After each load the daemon asks the kernel to collapse the nearly resident 2 MiB spans of
large anonymous mappings (`MADV_COLLAPSE`, Linux 6.1 and later); EINVAL once, and it
carries on. Why, with the figures: docs/internals.md, "Transparent huge pages".
"""

from __future__ import annotations

import ctypes
import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MADV_COLLAPSE: Final = 25
MIN_BYTES: Final = 8 * 1024 * 1024  # smaller mappings are the interpreter's and libraries'
MIN_RESIDENT: Final = 0.9  # of a huge page's small pages, for it to be made
HUGE: Final = 2 * 1024 * 1024
PAGE: Final = 4096


@dataclass(frozen=True, slots=True)
class Mapping:
    """An anonymous private mapping of /proc/self/smaps."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Collapse:
    """What one pass did: spans collapsed (runs of huge pages), their bytes, the time it took,
    and why it stopped."""

    spans: int = 0
    bytes: int = 0
    seconds: float = 0.0
    unsupported: str | None = None  # set when the kernel cannot do it at all
    failed: int = 0  # spans the kernel could not collapse this time (EAGAIN twice, ENOMEM)
    failed_bytes: int = 0  # their bytes: with `bytes`, what the pass found resident


def anonymous_mappings(smaps: str) -> list[Mapping]:
    """The private anonymous writable mappings of an smaps (or maps) text: no path, or [heap]."""
    out: list[Mapping] = []
    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if len(head) < 5 or head[0].endswith(":") or "-" not in head[0]:
            continue  # a field line of the mapping above
        perms, path = head[1], head[5] if len(head) > 5 else ""
        if perms.startswith("rw") and perms[3] == "p" and path in ("", "[heap]"):
            low, _, high = head[0].partition("-")
            out.append(Mapping(int(low, 16), int(high, 16)))
    return out


def resident_runs(mapping: Mapping, resident: Callable[[int, int], bytes]) -> list[tuple[int, int]]:
    """The runs of 2 MiB-aligned huge-page spans inside `mapping` whose small pages are nearly all
    resident (`resident(address, length)`: one byte per 4 KiB page, 1 when resident, else 0),
    as (start, length)."""
    first = -(-mapping.start // HUGE) * HUGE  # the first 2 MiB boundary at or after the start
    last = mapping.end // HUGE * HUGE
    if last - first < HUGE:
        return []
    pages = resident(first, last - first)
    per = HUGE // PAGE
    if len(pages) < (last - first) // PAGE:
        return []  # residency unknown: collapse nothing
    runs: list[tuple[int, int]] = []
    for i in range((last - first) // HUGE):
        chunk = pages[i * per : (i + 1) * per]
        if chunk.count(1) < MIN_RESIDENT * per:
            continue
        address = first + i * HUGE
        if runs and runs[-1][0] + runs[-1][1] == address:
            runs[-1] = (runs[-1][0], runs[-1][1] + HUGE)
        else:
            runs.append((address, HUGE))
    return runs


Madvise = Callable[[int, int, int], int]  # (address, length, advice) -> 0, or -errno


def _libc() -> ctypes.CDLL:
    # The process's own symbols, libc's among them: find_library runs a compiler and
    # writes temporary files, which a confined engine process may not.
    return ctypes.CDLL(None, use_errno=True)


def _libc_madvise() -> Madvise:
    call = _libc().madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int

    def madvise(address: int, length: int, advice: int) -> int:
        if call(address, length, advice) == 0:
            return 0
        return -ctypes.get_errno()

    return madvise


def pagemap_resident(pagemap: Path = Path("/proc/self/pagemap")) -> Callable[[int, int], bytes]:
    """Residency of this process's pages from its pagemap (bit 63 of each page's entry: present).

    Not mincore(2): the systemd unit's system-call filter (@system-service) refuses it, while
    reading a file of /proc/self is allowed everywhere.
    """

    def resident(address: int, length: int) -> bytes:
        try:
            with pagemap.open("rb", buffering=0) as f:
                f.seek(address // PAGE * 8)
                data = f.read(length // PAGE * 8)
        except OSError:
            return b""  # nothing counts as resident
        entries = memoryview(data)[: len(data) // 8 * 8].cast("Q")
        return bytes(entry >> 63 for entry in entries)

    return resident


def collapse_resident(
    smaps: Path = Path("/proc/self/smaps"),
    madvise: Madvise | None = None,
    resident: Callable[[int, int], bytes] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Collapse:
    """Back this process's resident spans of large anonymous mappings with huge pages."""
    started = clock()
    try:
        text = smaps.read_text()
    except OSError as exc:
        return Collapse(unsupported=f"cannot read {smaps}: {exc.strerror}")
    advise = madvise or _libc_madvise()
    pages = resident or pagemap_resident()
    done = total = failed = failed_bytes = 0
    for m in anonymous_mappings(text):
        if m.size < MIN_BYTES:
            continue
        for address, length in resident_runs(m, pages):
            rc = advise(address, length, MADV_COLLAPSE)
            if rc == -errno.EAGAIN:  # a transient lock or charge: the kernel says retry
                rc = advise(address, length, MADV_COLLAPSE)
            if rc == -errno.EINVAL:
                return Collapse(
                    done,
                    total,
                    clock() - started,
                    unsupported="the kernel does not collapse huge pages (MADV_COLLAPSE needs Linux 6.1 and "
                    "transparent huge pages not set to never)",
                )
            if rc != 0:  # no free huge page now (a fragmented or busy box): khugepaged may later
                failed += 1
                failed_bytes += length
                continue
            done += 1
            total += length
    return Collapse(done, total, clock() - started, failed=failed, failed_bytes=failed_bytes)
