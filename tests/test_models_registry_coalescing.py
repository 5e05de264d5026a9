"""A storm of reloads coalesces: one runs beside the one in progress, one copy beside the serving one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

from edgellmd.http import appkeys
from edgellmd.models.registry import ModelState, Registry
from edgellmd.settings import ModelSettings
from tests.ggufmodels import TinyModelSpec, write_tiny_model
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


async def test_a_load_does_not_join_a_waiting_reload_of_all_models_which_passes_it_over(
    tmp_path: Path,
) -> None:
    """A reload of all models passes over those an operator unloaded: once, a load that came
    while one waited joined it, got no outcome of its own and answered 500 (IndexError)."""
    async with _two_models(tmp_path) as registry:
        await registry.unload("a")
        async with registry._mutex:  # a reload in progress: the next ones wait
            everything = asyncio.ensure_future(registry.reload())
            await asyncio.sleep(0.05)
            loading = asyncio.ensure_future(registry.load("a"))
            await asyncio.sleep(0.05)
        outcomes = await everything
        assert [o.model for o in outcomes] == ["b"]  # "a" stays unloaded for a plain reload
        loaded = await loading
        assert (loaded.model, loaded.ok) == ("a", True), loaded
        assert registry.states()["a"][0] is ModelState.READY


async def test_a_load_that_joined_a_reload_of_all_models_past_an_unload_runs_its_own(tmp_path: Path) -> None:
    """A load came while the model was still ready and joined a waiting reload of all models;
    an unload queued before that reload ran first, so the reload passed the model over: the
    load had no outcome (500, IndexError) and the model stayed unloaded. It now loads."""
    async with _two_models(tmp_path) as registry:
        async with registry._mutex:  # a reload in progress: the next ones wait, in order
            unloading = asyncio.ensure_future(registry.unload("a"))
            await asyncio.sleep(0.05)
            everything = asyncio.ensure_future(registry.reload())
            await asyncio.sleep(0.05)
            loading = asyncio.ensure_future(registry.load("a"))  # "a" is ready still
            await asyncio.sleep(0.05)
        assert (await unloading).result == "unloaded"
        assert [o.model for o in await everything] == ["b"]  # passed over: unloaded by then
        loaded = await loading
        assert (loaded.model, loaded.ok) == ("a", True), loaded
        assert registry.states()["a"][0] is ModelState.READY


@contextlib.asynccontextmanager
async def _two_models(tmp_path: Path) -> AsyncIterator[Registry]:
    """A started registry of two tiny models, "a" and "b"."""
    paths = [write_tiny_model(tmp_path / f"{n}.gguf", TinyModelSpec(seed=s)) for n, s in (("a", 1), ("b", 2))]
    with ThreadPoolExecutor(2) as executor:
        registry = Registry(
            [
                ModelSettings(name=n, file=p, threads=1, context_size=128)
                for n, p in zip("ab", paths, strict=True)
            ],
            executor,
        )
        await registry.start()
        try:
            yield registry
        finally:
            await registry.close()
