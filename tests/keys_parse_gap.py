"""The event loop's longest gap while a large keys file is parsed on it and off it, side by side
(tests/test_http_auth.py runs it in a fresh interpreter: the test process, thousands of tests
in, held the loop up to a second while a thread parsed, three pairs in a row, where a fresh one
holds it a few milliseconds).

    python -m tests.keys_parse_gap DIRECTORY   ->   one JSON line: {"pairs": [[off, on], ...], "keys": N}
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import yaml

from edgellmctl.keys import create_key
from edgellmd.keys import KeyStore

KEYS = 4000
PAIRS = 3
HEAP_OBJECTS = 500_000


async def longest_gap(work: Callable[[], Awaitable[object]]) -> float:
    """The loop's longest turn-to-turn gap, ticking every 2 ms, while `work` runs."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = loop.time()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    await work()
    done.set()
    await ticker
    return max(gaps)


async def measure(directory: Path) -> dict[str, object]:
    # As in the daemon (edgellmd.__main__): a short switch interval, and a heap of some size
    # (a full collection of it, set off by the parse, held the loop whichever thread ran it).
    sys.setswitchinterval(0.0005)
    heap = [{"n": i, "of": [i]} for i in range(HEAP_OBJECTS)]
    path = directory / "keys.yaml"
    create_key(path, "first", ["inference"], limits={})
    data = yaml.safe_load(path.read_bytes())
    record = data["keys"][0]
    data["keys"] = [
        {**record, "id": f"{i:012x}", "name": f"key {i}", "hash": "sha256:" + f"{i:064x}"}
        for i in range(KEYS)
    ]
    text = yaml.safe_dump(data)
    store = KeyStore(path)

    def rewrite(n: int) -> None:
        tmp = directory / "keys.new"
        tmp.write_text(text.replace("key 0\n", f"key 0 ({n})\n", 1))
        tmp.chmod(0o600)
        tmp.rename(path)

    async def on_the_loop() -> None:
        if not store.reload_if_changed():
            raise RuntimeError("the keys file was not read")

    pairs: list[tuple[float, float]] = []
    names: list[str] = []
    for n in range(PAIRS):
        rewrite(2 * n + 1)
        blocked = await longest_gap(on_the_loop)
        rewrite(2 * n + 2)
        gap = await longest_gap(store.reload)
        first = store.get(f"{0:012x}")
        names.append(first.name if first is not None else "")
        pairs.append((gap, blocked))
        if gap < blocked / 4:
            break
    return {"pairs": pairs, "keys": len(store), "names": names, "heap": len(heap)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure(Path(sys.argv[1])))))
