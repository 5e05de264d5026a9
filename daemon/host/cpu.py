"""The host: CPU affinity (pinning before any model loads) and psutil figures for stats and metrics."""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

log = logging.getLogger(__name__)

SYSFS_CPU: Final = Path("/sys/devices/system/cpu")
MAX_CPU: Final = 8191  # Linux's largest NR_CPUS
AUTO: Final = "auto"
_CPU_LIST: Final = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


class CpuListError(ValueError):
    """A `cpus` value that is not a CPU list like "0-3,8"."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """`"0-3,8"` -> {0, 1, 2, 3, 8}; raises CpuListError naming the problem."""
    compact = text.replace(" ", "")
    if not _CPU_LIST.fullmatch(compact):
        raise CpuListError('must be a CPU list like "0-3,8" or "auto"')
    cpus: set[int] = set()
    for part in compact.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if first > last:
            raise CpuListError(f"range {part} runs backwards")
        if last > MAX_CPU:
            raise CpuListError(f"CPU {last} is beyond {MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8"."""
    out: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def one_per_core(allowed: frozenset[int], sysfs: Path = SYSFS_CPU) -> frozenset[int]:
    """The lowest allowed logical CPU of each physical core (SMT siblings from sysfs)."""
    chosen: set[int] = set()
    seen: set[frozenset[int]] = set()
    for cpu in sorted(allowed):
        try:
            siblings = parse_cpu_list(
                (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
            )
        except (OSError, CpuListError):
            siblings = frozenset({cpu})  # no topology: count it as a core of its own
        if siblings in seen:
            continue
        seen.add(siblings)
        chosen.add(cpu)
    return frozenset(chosen)


@dataclass(frozen=True, slots=True)
class Pinning:
    """What the process ended up allowed to run on, and how it got there."""

    cpus: frozenset[int]
    requested: str | None
    pinned: bool  # sched_setaffinity succeeded
    note: str | None = None  # why the result differs from the request


def pin_cpus(requested: str | None, sysfs: Path = SYSFS_CPU) -> Pinning:
    """Pin every thread of the process (and so every later one) to `requested`; never fatal.

    Call before the daemon starts its own threads: Linux sets affinity per thread and new
    threads inherit their creator's. `auto` keeps one logical CPU per physical core of the
    allowed set.
    """
    allowed = frozenset(os.sched_getaffinity(0))
    if requested is None:
        return Pinning(allowed, None, pinned=False)
    target = one_per_core(allowed, sysfs) if requested == AUTO else parse_cpu_list(requested)
    note = None
    outside = target - allowed
    if outside:
        note = f"CPUs {format_cpu_list(outside)} are not allowed to this process (cgroup/cpuset)"
        target &= allowed
    if not target:
        log.warning(
            "cpus %r: none of these CPUs is allowed (%s); running on %s",
            requested,
            note,
            format_cpu_list(allowed),
        )
        return Pinning(allowed, requested, pinned=False, note=note)
    try:
        os.sched_setaffinity(0, target)
        _pin_other_threads(target)
    except OSError as exc:
        log.warning(
            "cpus %r: pinning refused (%s; seccomp or cgroup policy?); running on %s",
            requested,
            exc.strerror or exc,
            format_cpu_list(allowed),
        )
        return Pinning(allowed, requested, pinned=False, note=f"pinning refused: {exc.strerror or exc}")
    if note:
        log.warning("cpus %r: %s; pinned to the rest", requested, note)
    log.info(
        "pinned to CPUs %s (%d); model threads default to that count", format_cpu_list(target), len(target)
    )
    return Pinning(target, requested, pinned=True, note=note)


def _pin_other_threads(target: frozenset[int]) -> None:
    """Threads that already exist (a BLAS pool started at import) do not inherit: pin each."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), target)
        except ProcessLookupError:
            continue  # ended meanwhile


def _disk(path: Path | None) -> dict[str, int] | None:
    if path is None:
        return None
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return {"total_bytes": usage.total, "used_bytes": usage.used, "free_bytes": usage.free}


def host_stats(*, shm: Path | None, models_dir: Path | None) -> dict[str, Any]:
    """CPU, memory and load of the host; RSS, threads and open files of this process; disk use."""
    proc = psutil.Process()
    memory = psutil.virtual_memory()
    with proc.oneshot():
        rss = proc.memory_info().rss
        threads = proc.num_threads()
        fds = proc.num_fds()
        cpu_times = proc.cpu_times()
    return {
        "cpu_usage_ratio": psutil.cpu_percent(interval=None) / 100,
        "cpu_count": psutil.cpu_count(),
        "affinity": format_cpu_list(os.sched_getaffinity(0)),
        "load1": os.getloadavg()[0],
        "memory_total_bytes": memory.total,
        "memory_used_bytes": memory.total - memory.available,
        "process": {
            "rss_bytes": rss,
            "threads": threads,
            "open_fds": fds,
            "cpu_seconds": cpu_times.user + cpu_times.system,
        },
        "shm": _disk(shm),
        "models_dir": _disk(models_dir),
    }
