"""A draft model through the signed lock, the loader and the registry: verified, preloaded, reloaded."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from edgellmd.engine import EngineConfig
from edgellmd.engine.generation import GenerationRequest, SamplingParams
from edgellmd.engine.scheduler import Engine
from edgellmd.http import appkeys
from edgellmd.http.app import create_app
from edgellmd.models.budget import estimate_bytes
from edgellmd.models.handle import AnyEngine, default_engine_factory, engine_config
from edgellmd.models.registry import ModelState, Outcome, Registry
from edgellmd.settings import ModelSettings, load_settings
from tests.ggufmodels import TinyModelSpec
from tests.serving import settings_for
from tests.test_models_lifecycle import MODEL, Box

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

TARGET = TinyModelSpec(seed=11)
TWIN = TARGET  # drafts exactly what the model says: nearly every draft is kept
OTHER = TinyModelSpec(seed=12, n_layer=1)
DRAFT = "draft"
PROMPT = "The draft test"


def _models(**speculative: Any) -> list[dict[str, Any]]:
    spec = {"mode": "draft", "draft_model": DRAFT, "draft_p_min": 0, **speculative}
    return [{"name": MODEL, "threads": 1, "context_size": 128, "slots": 2, "speculative": spec}]


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


class CountingFactory:
    """The real engine factory, noting what each engine it builds loads."""

    def __init__(self) -> None:
        self.built: list[ModelSettings] = []

    def __call__(self, settings: ModelSettings, mmap: bool) -> AnyEngine:
        self.built.append(settings)
        return default_engine_factory(settings, mmap)


async def _until(condition: Callable[[], object], what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _serve(
    box: Box, aiohttp_client: Any, models: list[dict[str, Any]], **lifecycle: Any
) -> tuple[Any, Registry, list[list[Outcome]], CountingFactory]:
    """A daemon on `box`, once its first load finished (well or not); the outcomes of later reloads."""
    factory = CountingFactory()
    app: web.Application = create_app(box.settings(models, **lifecycle), engine_factory=factory)
    client = await aiohttp_client(app)
    registry = app[appkeys.REGISTRY]
    finished: list[list[Outcome]] = []
    registry.observe(
        lambda event, outcomes: finished.append(outcomes) if event == "reload_finished" else None
    )
    await _until(lambda: registry.states()[MODEL][0] is not ModelState.LOADING, "the first load")
    finished.clear()  # the start's own, when it ended after the observer came
    return client, registry, finished, factory


async def _complete(client: Any) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    answer = await client.post("/v1/completions", json=body)
    assert answer.status == 200, await answer.text()
    return str((await answer.json())["choices"][0]["text"])


async def _plain_text(path: Path) -> str:
    """What the model says without drafts, straight from the engine."""
    engine = Engine(
        EngineConfig(path=path, slots=1, context_size=128, batch_size=64, threads=1, threads_batch=1)
    )
    try:
        gen = engine.submit(
            GenerationRequest(engine.tokenize(PROMPT), 24, SamplingParams(temperature=0.0), ignore_eos=True),
            asyncio.get_running_loop(),
        )
        parts = [event.text async for event in gen.events()]
        return "".join(parts)
    finally:
        engine.close()


def _status(registry: Registry) -> dict[str, Any]:
    return next(m for m in registry.status()["models"] if m["name"] == MODEL)


@pytest.mark.parametrize("preload", [True, False])
async def test_a_locked_draft_is_verified_preloaded_and_drafts(
    box: Box, aiohttp_client: Any, preload: bool
) -> None:
    target, twin = box.model_bytes(TARGET), box.model_bytes(TWIN)
    box.publish({MODEL: ("tiny.gguf", target), DRAFT: ("draft.gguf", twin)})
    lifecycle = {} if preload else {"preload_dir": None}
    client, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False, **lifecycle)
    assert registry.states()[MODEL] == (ModelState.READY, None)
    [loaded] = factory.built
    draft_file = loaded.speculative.draft_file
    assert draft_file is not None
    if preload:  # both copied into the preload area, and both mapped from there
        assert len(box.copies()) == 2
        assert draft_file in box.copies()
        assert engine_config(loaded, mmap=True).speculative.draft_mmap
    else:  # loaded through the descriptor that was hashed
        assert box.copies() == []
        assert str(draft_file).startswith("/proc/self/fd/")
        assert not engine_config(loaded, mmap=False).speculative.draft_mmap
    assert await _complete(client) == await _plain_text(box.models / "tiny.gguf")
    performance = _status(registry)["performance"]["speculative"]
    assert (performance["mode"], performance["draft_model"]) == ("draft", DRAFT)
    assert performance["accepted_tokens"] > 10
    handle = registry.get(MODEL)
    assert handle.provenance.draft is not None
    assert handle.provenance.draft.locked is not None
    assert handle.provenance.draft.locked.size == len(twin)
    settings = box.settings(_models()).models[0]
    without = estimate_bytes(box.models / "tiny.gguf", settings)
    assert handle.provenance.memory_bytes > without + len(twin)  # its file and its KV cache
    await client.close()
    assert box.copies() == []


async def test_a_draft_missing_from_the_lock_fails_the_load_with_the_reason(
    box: Box, aiohttp_client: Any
) -> None:
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TARGET))})
    _, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False)
    state, reason = registry.states()[MODEL]
    assert state is ModelState.FAILED
    assert reason == f"draft model {DRAFT} is not in the lockfile (version 1)"
    assert factory.built == []
    assert box.copies() == []  # the model's own copy was never made


@pytest.mark.parametrize("preload", [True, False])
async def test_a_tampered_draft_fails_the_load_and_leaves_no_copy(
    box: Box, aiohttp_client: Any, preload: bool
) -> None:
    twin = box.model_bytes(TWIN)
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TARGET)), DRAFT: ("draft.gguf", twin)})
    tampered = bytearray(twin)
    tampered[len(tampered) // 2] ^= 0x01
    box.replace(box.models / "draft.gguf", bytes(tampered))  # the lock still vouches for `twin`
    lifecycle = {} if preload else {"preload_dir": None}
    _, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False, **lifecycle)
    state, reason = registry.states()[MODEL]
    assert state is ModelState.FAILED
    assert reason is not None
    assert reason.startswith(f"draft model {DRAFT}: file draft.gguf: draft.gguf has sha256 ")
    assert "the lockfile says" in reason
    assert factory.built == []
    assert box.copies() == []  # the model's copy, made first, went too


@pytest.mark.parametrize("bad", ["directory", "fifo", "truncated"])
async def test_a_draft_that_is_no_model_file_fails_the_load(box: Box, aiohttp_client: Any, bad: str) -> None:
    twin = box.model_bytes(TWIN)
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TARGET)), DRAFT: ("draft.gguf", twin)})
    path = box.models / "draft.gguf"
    path.unlink()
    if bad == "directory":
        path.mkdir()
    elif bad == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(twin[: len(twin) // 2])
    _, registry, _, _ = await _serve(box, aiohttp_client, _models(), watch=False)
    state, reason = registry.states()[MODEL]
    assert state is ModelState.FAILED
    expected = {
        "directory": "draft.gguf is a directory, not a regular file",
        "fifo": "draft.gguf is a FIFO, not a regular file",
        "truncated": f"draft.gguf is {len(twin) // 2} bytes; the lockfile says {len(twin)}",
    }[bad]
    assert reason == f"draft model {DRAFT}: file draft.gguf: {expected}"
    assert box.copies() == []


async def test_a_changed_draft_reloads_the_model_a_touched_one_is_only_verified(
    box: Box, aiohttp_client: Any
) -> None:
    target, twin, other = box.model_bytes(TARGET), box.model_bytes(TWIN), box.model_bytes(OTHER)
    box.publish({MODEL: ("tiny.gguf", target), DRAFT: ("draft.gguf", twin)})
    client, registry, finished, factory = await _serve(box, aiohttp_client, _models())
    first = registry.get(MODEL)
    expected = await _complete(client)

    # A new lock entry for the draft (new bytes, the model's own unchanged): a new version.
    version = box.publish({MODEL: ("tiny.gguf", target), DRAFT: ("draft.gguf", other)})
    await _until(lambda: finished, "the watcher's reload")
    assert [(o.result, o.version) for o in finished[-1]] == [("loaded", version)]
    second = registry.get(MODEL)
    assert second is not first
    assert second.provenance.draft is not None
    assert second.provenance.draft.locked is not None
    assert second.provenance.draft.locked.size == len(other)
    assert len(factory.built) == 2
    assert await _complete(client) == expected  # another draft, the same text
    await _until(lambda: len(box.copies()) == 2, "the old version's copies to go")

    # The draft's file touched, its bytes the same: checked against its entry, nothing loaded.
    path = box.models / "draft.gguf"
    later = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))
    finished.clear()
    await _until(lambda: finished, "the reload of the touched draft")
    assert [o.result for o in finished[-1]] == ["unchanged"]
    assert len(factory.built) == 2
    assert registry.get(MODEL) is second

    # Its bytes changed under the same entry: refused, the verified version serves on.
    tampered = bytearray(other)
    tampered[-1] ^= 0x01
    finished.clear()
    box.replace(path, bytes(tampered))
    await _until(lambda: finished, "the reload of the tampered draft")
    [outcome] = finished[-1]
    assert outcome.result == "failed"
    assert outcome.reason is not None
    assert outcome.reason.startswith(f"draft model {DRAFT}: file draft.gguf: draft.gguf has sha256")
    assert registry.get(MODEL) is second
    assert await _complete(client) == expected

    # A lock that drops the draft: the load fails, the old version keeps serving.
    finished.clear()
    box.publish({MODEL: ("tiny.gguf", target)})
    await _until(lambda: finished, "the reload without the draft")
    [outcome] = finished[-1]
    assert (outcome.result, outcome.reason) == (
        "failed",
        f"draft model {DRAFT} is not in the lockfile (version {box.version})",
    )
    assert registry.get(MODEL) is second
    assert _status(registry)["state"] == "ready"
    assert len(factory.built) == 2
    await client.close()
    assert box.copies() == []


async def test_an_unsigned_draft_file_loads_and_its_change_reloads(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    box = Box(tmp_path / "box")  # only for its tiny model bytes
    (tmp_path / "target.gguf").write_bytes(box.model_bytes(TARGET))
    (tmp_path / "small.gguf").write_bytes(box.model_bytes(TWIN))
    config = tmp_path / "edgellm.yaml"
    spec = {"mode": "draft", "draft_file": "small.gguf", "draft_p_min": 0}
    config.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": MODEL,
                        "file": "target.gguf",
                        "threads": 1,
                        "context_size": 128,
                        "speculative": spec,
                    }
                ],
                "lock": {"allow_unsigned": True},
                "lifecycle": {"preload_dir": str(tmp_path / "shm"), "watch": False},
            }
        )
    )
    settings = load_settings(config)
    assert settings.models[0].speculative.draft_file == tmp_path / "small.gguf"  # relative to the config
    app: web.Application = create_app(settings)
    client = await aiohttp_client(app)
    registry = app[appkeys.REGISTRY]
    await _until(registry.ready_handles, "the first load")
    assert _status(registry)["performance"]["speculative"]["draft_model"] == "small.gguf"
    assert await _complete(client) == await _plain_text(tmp_path / "target.gguf")
    first = registry.get(MODEL)
    (tmp_path / "small.gguf").write_bytes(box.model_bytes(OTHER))
    answer = await client.post("/admin/reload", json={})
    assert [r["result"] for r in (await answer.json())["results"]] == ["loaded"]
    assert registry.get(MODEL) is not first
    answer = await client.post("/admin/reload", json={})
    assert [r["result"] for r in (await answer.json())["results"]] == ["unchanged"]


def test_the_settings_take_a_draft_p_min_from_0_to_1(tmp_path: Path) -> None:
    for value in (0, 1, 0.5):
        spec = {"mode": "draft", "draft_file": "d.gguf", "draft_p_min": value}
        models = [{"name": "m", "file": "m.gguf", "speculative": spec}]
        parsed = settings_for(models, base_dir=tmp_path).models[0].speculative
        assert parsed.draft_p_min == value
        assert isinstance(parsed.draft_p_min, float)
