"""The registry's reloads on the real engine: what a change builds, and what it only verifies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from edgellmd.host.metrics import STATES
from edgellmd.http import appkeys
from edgellmd.http.app import create_app
from edgellmd.models.handle import AnyEngine, default_engine_factory
from edgellmd.models.loader import stat_key
from edgellmd.models.registry import ModelState, Outcome, Registry
from edgellmd.settings import ModelSettings
from tests.ggufmodels import TinyModelSpec
from tests.test_models_lifecycle import MODEL, SETTLE_S, Box

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


class CountingFactory:
    """The real engine factory, counting the engines it builds."""

    def __init__(self) -> None:
        self.built: list[str] = []

    def __call__(self, settings: ModelSettings, mmap: bool) -> AnyEngine:
        self.built.append(settings.name)
        return default_engine_factory(settings, mmap)


async def _until(condition: Callable[[], object], what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _serve(
    box: Box, aiohttp_client: Any, factory: CountingFactory, **lifecycle: Any
) -> tuple[Any, Registry, list[list[Outcome]]]:
    """A daemon on `box` built by `factory`, once ready; the outcomes of every reload it finishes."""
    app: web.Application = create_app(box.settings(**lifecycle), engine_factory=factory)
    client = await aiohttp_client(app)
    registry = app[appkeys.REGISTRY]
    finished: list[list[Outcome]] = []

    def on_reload(event: str, outcomes: list[Outcome]) -> None:
        if event == "reload_finished":
            finished.append(outcomes)

    registry.observe(on_reload)
    await _until(lambda: finished, "the first load")
    assert [(o.result, o.trigger) for o in finished[0]] == [("loaded", "start")]
    finished.clear()
    return client, registry, finished


def _newer_mtime(path: Path) -> None:
    later = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))


async def test_a_touched_identical_file_is_verified_not_loaded(box: Box, aiohttp_client: Any) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    factory = CountingFactory()
    client, registry, finished = await _serve(box, aiohttp_client, factory)
    assert factory.built == [MODEL]
    handle = registry.get(MODEL)
    path = box.models / "tiny.gguf"
    _newer_mtime(path)  # same bytes, new stat
    await _until(lambda: finished, "the watcher's reload")
    assert [(o.result, o.trigger, o.version) for o in finished[0]] == [("unchanged", "watch", box.version)]
    assert factory.built == [MODEL]  # no engine built: the bytes were checked, not loaded
    assert registry.get(MODEL) is handle  # the warm one serves on
    assert handle.provenance.source_stat == stat_key(path)  # the new stat is noted ...
    answer = await client.post("/admin/reload", json={})  # ... so the next look finds nothing to do
    assert [r["result"] for r in (await answer.json())["results"]] == ["unchanged"]
    assert factory.built == [MODEL]
    answer = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert answer.status == 200


@pytest.mark.parametrize("preload", [True, False])
async def test_a_touched_file_whose_bytes_changed_is_refused_without_a_load(
    box: Box, aiohttp_client: Any, preload: bool
) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    factory = CountingFactory()
    lifecycle = {} if preload else {"preload_dir": None}
    _, registry, finished = await _serve(box, aiohttp_client, factory, **lifecycle)
    handle = registry.get(MODEL)
    path = box.models / "tiny.gguf"
    tampered = bytearray(data)
    tampered[len(tampered) // 2] ^= 0x01
    box.replace(path, bytes(tampered))  # same size, other bytes, the same lock entry
    await _until(lambda: finished, "the watcher's reload")
    [outcome] = finished[0]
    assert (outcome.result, outcome.trigger) == ("failed", "watch")
    assert outcome.reason is not None
    assert "the lockfile says" in outcome.reason
    assert factory.built == [MODEL]
    assert registry.get(MODEL) is handle  # the verified one serves on
    # Put back: verified again (the stat changed), and unchanged.
    box.replace(path, data)
    await _until(lambda: len(finished) > 1, "the reload of the restored file")
    assert [o.result for o in finished[-1]] == ["unchanged"]
    assert factory.built == [MODEL]
    await asyncio.sleep(SETTLE_S * 3)
    assert len(finished) == 2  # nothing more to look at


def test_the_metrics_know_every_model_state() -> None:
    assert sorted(STATES) == sorted(s.value for s in ModelState)


async def test_a_reloaded_model_starts_with_an_empty_prompt_cache(box: Box, aiohttp_client: Any) -> None:
    """KV states belong to the weights that made them: a new version never restores an old one's.

    In-process engines (an engine process's cache dies with it), whose cache the test reads."""
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=11)))})
    models = [
        {
            "name": MODEL,
            "threads": 1,
            "context_size": 512,
            "slots": 1,
            "prompt_cache_mb": 16,
            "isolation": "thread",
        }
    ]
    app: web.Application = create_app(box.settings(models, watch=False), engine_factory=CountingFactory())
    client = await aiohttp_client(app)
    registry = app[appkeys.REGISTRY]
    await _until(registry.ready_handles, "the first load")
    shared = "A long shared system prompt for every request. " * 4
    first, second = shared + "First?", "Another prompt that takes the only slot. " * 4

    async def complete(prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = await client.post("/v1/completions", json=body)
        assert answer.status == 200, await answer.text()
        return str((await answer.json())["choices"][0]["text"])

    def cache_of(handle: Any) -> Any:
        assert handle.engine.prompt_cache is not None
        return handle.engine.prompt_cache

    old = registry.get(MODEL)
    await complete(first)
    await complete(second)
    assert cache_of(old).covers(old.engine.tokenize(first))  # kept: ready to be restored
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=12)))})
    answer = await client.post("/admin/reload", json={})
    assert [r["result"] for r in (await answer.json())["results"]] == ["loaded"]
    new = registry.get(MODEL)
    assert new is not old
    assert not cache_of(new).entries
    after = await complete(first)
    assert cache_of(new).stats.hits == 0  # prefilled from scratch on the new weights
    assert cache_of(new).stats.misses >= 1
    await complete(second)
    assert await complete(first) == after  # now restored from the new version's own cache
    assert cache_of(new).stats.hits == 1


class HeldFactory(CountingFactory):
    """Builds engines, but holds the ones after the first until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, settings: ModelSettings, mmap: bool) -> AnyEngine:
        if self.built:
            self.entered.set()
            self.release.wait(30)
        return super().__call__(settings, mmap)


async def test_a_load_cancelled_half_way_leaves_a_failed_model_that_loads_again(
    box: Box, aiohttp_client: Any
) -> None:
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=11)))})
    factory = HeldFactory()
    _, registry, _ = await _serve(box, aiohttp_client, factory, watch=False)
    await registry.unload(MODEL)
    task = asyncio.create_task(registry.load(MODEL))
    await _until(factory.entered.is_set, "the second build to start")
    assert registry.status()["models"][0]["state"] == "loading"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    model = registry.status()["models"][0]
    assert (model["state"], model["reason"]) == ("failed", "the load was cancelled before it finished")
    factory.release.set()
    assert (await registry.load(MODEL)).result == "loaded"
    assert registry.status()["models"][0]["state"] == "ready"
