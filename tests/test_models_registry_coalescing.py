"""A storm of reloads coalesces: one runs beside the one in progress, one copy beside the serving one."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import aiohttp

from edgellmd.http import appkeys
from tests.ggufmodels import TinyModelSpec
from tests.serving import running
from tests.test_models_lifecycle import MODEL, Box

STORM = 20


def test_twenty_forced_reloads_at_once_build_at_most_two_copies(tmp_path: Path) -> None:
    box = Box(tmp_path)
    data = box.model_bytes(TinyModelSpec(seed=41, n_ff=1024))
    box.publish({MODEL: ("m.gguf", data)})
    with running(box.settings(watch=False)) as daemon:
        assert daemon.app is not None
        registry = daemon.app[appkeys.REGISTRY]
        loaded_before = registry.reloads["loaded"]
        most_copies = 0
        sampling = threading.Event()

        def sample() -> None:
            nonlocal most_copies
            while not sampling.is_set():
                most_copies = max(most_copies, len(box.copies()))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()

        async def storm() -> list[int]:
            async with aiohttp.ClientSession() as session:

                async def one() -> int:
                    async with session.post(daemon.url + "/admin/reload", json={"force": True}) as resp:
                        body = await resp.json()
                        assert body["ok"], body
                        return resp.status

                return await asyncio.gather(*(one() for _ in range(STORM)))

        try:
            statuses = asyncio.run(storm())
        finally:
            sampling.set()
            sampler.join()
        assert statuses == [200] * STORM
        builds = registry.reloads["loaded"] - loaded_before
        # The first runs at once; all the others wait together and join one more.
        assert 1 <= builds <= 2, builds
        assert most_copies <= 2, most_copies
        status, body = daemon.get("/readyz")
        assert status == 200, body
