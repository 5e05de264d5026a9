"""A multimodal projector (mmproj) through the signed lock, the loader and the registry:
verified and preloaded as the model's own file, part of its version, freed with it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from edgellmctl.__main__ import main as edgellmctl
from edgellmd.engine import EngineConfig
from edgellmd.engine.config import MEDIA_STORE_BYTES
from edgellmd.engine.remote import RemoteEngine
from edgellmd.engine.worker import _model_files
from edgellmd.http import appkeys
from edgellmd.http.app import create_app
from edgellmd.models import registry as registry_module
from edgellmd.models.budget import estimate_bytes
from edgellmd.models.handle import AnyEngine, default_engine_factory, engine_config
from edgellmd.models.lockfile import load_lock
from edgellmd.models.registry import ModelState, Outcome, Registry
from edgellmd.models.watch import watch_targets
from edgellmd.settings import ModelSettings, load_settings
from tests.ggufmodels import (
    TinyModelSpec,
    TinyProjectorSpec,
    write_tiny_audio_projector,
    write_tiny_model,
    write_tiny_projector,
)
from tests.serving import settings_for
from tests.test_models_lifecycle import MODEL, Box

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

TEXT = TinyModelSpec(seed=11)
PROJECTOR = "vision"
PROMPT = "The projector test"


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def _projector_bytes(box: Box, seed: int = 1) -> bytes:
    path = box.sources / f"mmproj-{seed}.gguf"
    if not path.exists():
        write_tiny_projector(path, TinyProjectorSpec(seed=seed))
    return path.read_bytes()


def _publish(box: Box, projector: bytes | None, *, text: bytes | None = None, listed: str = PROJECTOR) -> int:
    """The text model and (unless None) a projector as `listed` in the models directory, under a
    newly signed lock; the projector's entry records its header as `edgellmctl lock add` does."""
    text = text if text is not None else box.model_bytes(TEXT)
    box.replace(box.models / "tiny.gguf", text)
    models: dict[str, Any] = {MODEL: Box.entry("tiny.gguf", text)}
    if projector is not None:
        box.replace(box.models / "mmproj.gguf", projector)
        entry = Box.entry("mmproj.gguf", projector)
        models[listed] = {**entry, "gguf": {"architecture": "clip", "file_type": "ALL_F32"}}
    return box.sign_lock(models)


def _models(**model: Any) -> list[dict[str, Any]]:
    return [{"name": MODEL, "threads": 1, "context_size": 128, "slots": 2, "mmproj": PROJECTOR, **model}]


class CountingFactory:
    """The real engine factory, noting the settings each engine it builds loads."""

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


def _settled(registry: Registry) -> bool:
    """The model's load is over, well or not."""
    return registry.states()[MODEL][0] is not ModelState.LOADING


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
    await _until(partial(_settled, registry), "the first load")
    finished.clear()
    return client, registry, finished, factory


async def _complete(client: Any) -> dict[str, Any]:
    """A completion's answer: its text, and the version that answered (`system_fingerprint`)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answer = await client.post("/v1/completions", json=body)
    assert answer.status == 200, await answer.text()
    return dict(await answer.json())


async def _status(client: Any) -> dict[str, Any]:
    answer = await client.get("/admin/status")
    assert answer.status == 200
    body = await answer.json()
    return dict(next(m for m in body["models"] if m["name"] == MODEL))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- a signed projector -----------------------------------------------------------------------


@pytest.mark.parametrize("preload", [True, False])
async def test_a_signed_projector_is_verified_preloaded_and_given_to_the_engine(
    box: Box, aiohttp_client: Any, preload: bool
) -> None:
    projector = _projector_bytes(box)
    _publish(box, projector)
    lifecycle = {} if preload else {"preload_dir": None}
    client, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False, **lifecycle)
    assert registry.states()[MODEL] == (ModelState.READY, None)
    [loaded] = factory.built
    given = engine_config(loaded, mmap=preload).mmproj
    assert given is not None
    assert given == loaded.mmproj_file
    handle = registry.get(MODEL)
    mmproj = handle.provenance.mmproj
    assert mmproj is not None
    assert mmproj.locked is not None
    assert (mmproj.name, mmproj.locked.sha256, mmproj.source) == (
        PROJECTOR,
        _sha(projector),
        box.models / "mmproj.gguf",
    )
    if preload:  # both copied into the preload area; the engine gets the projector's copy
        assert len(box.copies()) == 2
        assert given == mmproj.copy
        assert given in box.copies()
        assert given.read_bytes() == projector
        assert given.name.startswith(f"{MODEL}-mmproj-")
    else:  # loaded through the descriptor that was hashed
        assert box.copies() == []
        assert mmproj.copy is None
        assert str(given).startswith("/proc/self/fd/")
    # The engine process loaded it (through what it was given): the model reads images now,
    # and serves text as before.
    assert handle.generator.media_kinds == ("image",)
    assert (await _complete(client))["choices"][0]["text"]
    shown = await _status(client)
    assert shown["mmproj"] == {
        "name": PROJECTOR,
        "sha256": _sha(projector),
        "file": "mmproj.gguf",
        "shm_path": str(mmproj.copy) if preload else None,
    }
    text = box.model_bytes(TEXT)
    assert shown["fingerprint"] == f"edgellm-v1-{_sha(text)[:12]}-{_sha(projector)[:12]}"
    settings = box.settings(_models()).models[0]
    assert (
        handle.provenance.memory_bytes
        == estimate_bytes(box.models / "tiny.gguf", settings) + len(projector) + MEDIA_STORE_BYTES
    )  # its file, and the encoded images its engine may keep
    await client.close()
    assert box.copies() == []


async def test_a_projector_whose_bytes_differ_from_the_lock_fails_the_load_and_leaves_no_copy(
    box: Box, aiohttp_client: Any
) -> None:
    projector = _projector_bytes(box)
    _publish(box, projector)
    tampered = bytearray(projector)
    tampered[len(tampered) // 2] ^= 0x01
    box.replace(box.models / "mmproj.gguf", bytes(tampered))  # the lock still vouches for `projector`
    _, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False)
    state, reason = registry.states()[MODEL]
    assert state is ModelState.FAILED
    assert reason is not None
    assert reason.startswith(f"mmproj {PROJECTOR}: file mmproj.gguf: mmproj.gguf has sha256 ")
    assert reason.endswith(f"the lockfile says {_sha(projector)[:16]}...")
    assert factory.built == []
    assert box.copies() == []  # the model's copy, made first, went too


@pytest.mark.parametrize("bad", ["unlisted", "missing", "escaping"])
async def test_a_projector_the_lock_does_not_vouch_for_is_refused_with_the_reason(
    box: Box, aiohttp_client: Any, bad: str
) -> None:
    projector = _projector_bytes(box)
    if bad == "unlisted":
        _publish(box, None)
    elif bad == "missing":
        _publish(box, projector)
        (box.models / "mmproj.gguf").unlink()
    else:  # an entry whose file is outside the models directory, through a symlink
        _publish(box, projector)
        outside = box.root / "outside.gguf"
        outside.write_bytes(projector)
        (box.models / "mmproj.gguf").unlink()
        (box.models / "mmproj.gguf").symlink_to(outside)
    _, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False)
    state, reason = registry.states()[MODEL]
    assert state is ModelState.FAILED
    assert (
        reason
        == {
            "unlisted": f"mmproj {PROJECTOR} is not in the lockfile (version 1)",
            "missing": f"mmproj {PROJECTOR}: file not found: mmproj.gguf",
            "escaping": f"mmproj {PROJECTOR}: file mmproj.gguf: file 'mmproj.gguf' resolves outside the "
            "models directory (through a symlink)",
        }[bad]
    )
    assert factory.built == []
    assert box.copies() == []


async def test_a_text_model_named_as_the_projector_is_refused(box: Box, aiohttp_client: Any) -> None:
    text, other = box.model_bytes(TEXT), box.model_bytes(TinyModelSpec(seed=12))
    box.publish({MODEL: ("tiny.gguf", text), PROJECTOR: ("other.gguf", other)})  # both "llama"
    _, registry, _, factory = await _serve(box, aiohttp_client, _models(), watch=False)
    assert registry.states()[MODEL] == (
        ModelState.FAILED,
        f"mmproj {PROJECTOR}: not a multimodal projector: its GGUF architecture is 'llama', not clip",
    )
    assert factory.built == []
    assert box.copies() == []  # the projector's copy was made, then refused


# ---- its version ------------------------------------------------------------------------------


async def test_a_changed_projector_reloads_the_model_a_touched_one_is_only_verified(
    box: Box, aiohttp_client: Any
) -> None:
    first_bytes, second_bytes = _projector_bytes(box, seed=1), _projector_bytes(box, seed=2)
    _publish(box, first_bytes)
    client, registry, finished, factory = await _serve(box, aiohttp_client, _models())
    first = registry.get(MODEL)
    before = first.provenance.fingerprint
    assert (await _complete(client))["system_fingerprint"] == before

    # New projector bytes under a new lock entry, the model's own unchanged: a new version.
    version = _publish(box, second_bytes)
    await _until(lambda: finished, "the watcher's reload")
    assert [(o.result, o.version) for o in finished[-1]] == [("loaded", version)]
    second = registry.get(MODEL)
    assert second is not first
    mmproj = second.provenance.mmproj
    assert mmproj is not None
    assert mmproj.locked is not None
    assert mmproj.locked.sha256 == _sha(second_bytes)
    assert second.provenance.fingerprint != before
    assert second.provenance.fingerprint.endswith(f"-{_sha(second_bytes)[:12]}")
    assert (await _complete(client))["system_fingerprint"] == second.provenance.fingerprint
    assert len(factory.built) == 2
    await _until(lambda: len(box.copies()) == 2, "the old version's copies to go")
    assert mmproj.copy in box.copies()
    assert mmproj.copy is not None
    assert mmproj.copy.read_bytes() == second_bytes

    # The projector's file touched, its bytes the same: checked against its entry, nothing loaded.
    path = box.models / "mmproj.gguf"
    later = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))
    finished.clear()
    await _until(lambda: finished, "the reload of the touched projector")
    assert [o.result for o in finished[-1]] == ["unchanged"]
    assert len(factory.built) == 2
    assert registry.get(MODEL) is second

    # Its bytes changed under the same entry: refused, the verified version serves on.
    tampered = bytearray(second_bytes)
    tampered[-1] ^= 0x01
    finished.clear()
    box.replace(path, bytes(tampered))
    await _until(lambda: finished, "the reload of the tampered projector")
    [outcome] = finished[-1]
    assert outcome.result == "failed"
    assert outcome.reason is not None
    assert outcome.reason.startswith(f"mmproj {PROJECTOR}: file mmproj.gguf: mmproj.gguf has sha256")
    assert registry.get(MODEL) is second
    assert (await _complete(client))["system_fingerprint"] == second.provenance.fingerprint
    await client.close()
    assert box.copies() == []


async def test_a_changed_mmproj_setting_is_a_change_of_version(box: Box, aiohttp_client: Any) -> None:
    projector = _projector_bytes(box)
    _publish(box, projector)
    client, registry, _, _ = await _serve(box, aiohttp_client, _models(), watch=False)
    loaded = registry.get(MODEL).provenance.mmproj
    lock = load_lock(box.lock)
    settings = box.settings(_models()).models[0]
    loader = registry.loader
    assert not loader.mmproj_changed(settings, loaded, lock)
    assert loader.mmproj_changed(replace(settings, mmproj=None), loaded, lock)  # dropped
    assert loader.mmproj_changed(replace(settings, mmproj="other"), loaded, lock)  # another entry
    assert loader.mmproj_changed(settings, None, lock)  # newly configured
    answer = await client.post("/admin/reload", json={})
    assert [r["result"] for r in (await answer.json())["results"]] == ["unchanged"]
    await client.close()


async def test_the_projector_copy_is_removed_with_the_model(box: Box, aiohttp_client: Any) -> None:
    projector = _projector_bytes(box)
    _publish(box, projector)
    client, registry, _, _ = await _serve(box, aiohttp_client, _models(), watch=False)
    mmproj = registry.get(MODEL).provenance.mmproj
    assert mmproj is not None
    assert mmproj.copy is not None
    assert mmproj.copy.is_file()
    answer = await client.post(f"/admin/models/{MODEL}/unload")
    assert answer.status == 200, await answer.text()
    await _until(lambda: box.copies() == [], "the freed version's copies to go")
    assert not mmproj.copy.exists()
    # Loaded again: checked and copied again, under a new name.
    answer = await client.post(f"/admin/models/{MODEL}/load")
    assert answer.status == 200, await answer.text()
    again = registry.get(MODEL).provenance.mmproj
    assert again is not None
    assert again.copy in box.copies()
    assert again.copy != mmproj.copy
    await client.close()


async def test_a_restarted_engine_process_loads_both_verified_copies_again(
    box: Box, aiohttp_client: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.2,))  # restart at once
    projector = _projector_bytes(box)
    _publish(box, projector)
    client, registry, _, factory = await _serve(
        box, aiohttp_client, _models(isolation="process"), watch=False
    )
    before = await _status(client)
    victim = registry.get(MODEL).engine
    assert isinstance(victim, RemoteEngine)
    with caplog.at_level(logging.INFO, logger="edgellmd.models.loader"):
        os.kill(victim.pid, signal.SIGKILL)
        await _until(lambda: len(factory.built) == 2 and registry.ready_handles(), "the restart")
    after = await _status(client)
    assert after["shm_path"] == before["shm_path"]
    assert after["mmproj"] == before["mmproj"]
    assert factory.built[1].mmproj_file == Path(before["mmproj"]["shm_path"])
    assert any("restarting from its verified copy" in r.getMessage() for r in caplog.records)
    assert not any("verified (" in r.getMessage() for r in caplog.records)  # nothing hashed again
    assert sorted(map(str, box.copies())) == sorted([before["shm_path"], before["mmproj"]["shm_path"]])
    await client.close()
    assert box.copies() == []


# ---- unsigned mode, the engine process, the operator's tools -----------------------------------


async def test_an_unsigned_projector_file_loads_and_its_change_reloads(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    box = Box(tmp_path / "box")  # only for its tiny files
    (tmp_path / "text.gguf").write_bytes(box.model_bytes(TEXT))
    (tmp_path / "eyes.gguf").write_bytes(_projector_bytes(box, seed=1))
    config = tmp_path / "edgellm.yaml"
    model = {
        "name": MODEL,
        "file": "text.gguf",
        "mmproj_file": "eyes.gguf",
        "threads": 1,
        "context_size": 128,
    }
    config.write_text(
        yaml.safe_dump(
            {
                "models": [model],
                "lock": {"allow_unsigned": True},
                "lifecycle": {"preload_dir": str(tmp_path / "shm"), "watch_settle_s": 0.3},
            }
        )
    )
    settings = load_settings(config)
    assert settings.models[0].mmproj_file == tmp_path / "eyes.gguf"  # relative to the config
    assert tmp_path / "eyes.gguf" in watch_targets(settings)[1]
    app: web.Application = create_app(settings)
    client = await aiohttp_client(app)
    registry = app[appkeys.REGISTRY]
    await _until(registry.ready_handles, "the first load")
    shown = await _status(client)
    assert (shown["mmproj"]["name"], shown["mmproj"]["sha256"]) == ("eyes.gguf", None)
    assert shown["fingerprint"] == "edgellm-unsigned"
    first = registry.get(MODEL)
    # The watcher sees the projector's file change and loads the model again.
    Box.replace(tmp_path / "eyes.gguf", _projector_bytes(box, seed=2))
    await _until(lambda: registry.ready_handles() and registry.get(MODEL) is not first, "the reload")
    await client.close()


def test_the_engine_process_may_read_the_projector(tmp_path: Path) -> None:
    model, projector = tmp_path / "m.gguf", tmp_path / "p.gguf"
    config = EngineConfig(path=model, slots=1, context_size=64, batch_size=8, threads=1, threads_batch=1)
    assert _model_files(config) == [model]
    assert _model_files(replace(config, mmproj=projector)) == [model, projector]


async def test_edgellmctl_adds_and_signs_projectors_the_daemon_then_loads(
    tmp_path: Path, aiohttp_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_model(models / "tiny.gguf", TEXT)
    write_tiny_projector(models / "vision.gguf")
    write_tiny_audio_projector(models / "audio.gguf")
    lock = tmp_path / "models.lock"
    assert edgellmctl(["keygen", "--out", str(tmp_path / "keys")]) == 0
    for name, file in ((MODEL, "tiny.gguf"), (PROJECTOR, "vision.gguf"), ("audio", "audio.gguf")):
        argv = ["lock", "add", name, str(models / file), "--lock", str(lock), "--models-dir", str(models)]
        assert edgellmctl(argv) == 0
    assert edgellmctl(["lock", "sign", "--lock", str(lock), "--key", str(tmp_path / "keys/signing.pem")]) == 0
    capsys.readouterr()
    recorded = load_lock(lock).models
    assert dict(recorded[PROJECTOR].gguf) == {"architecture": "clip", "file_type": "ALL_F32"}
    assert dict(recorded["audio"].gguf) == {"architecture": "clip"}  # it names no file type
    lock_settings = {
        "file": str(lock),
        "models_dir": str(models),
        "state_dir": str(tmp_path / "state"),
        "trusted_keys": [str(tmp_path / "keys/signing.pub")],
    }
    for projector, reads in ((PROJECTOR, ("image",)), ("audio", ("audio",))):
        settings = settings_for(
            _models(mmproj=projector),
            lock=lock_settings,
            lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
        )
        app: web.Application = create_app(settings)
        client = await aiohttp_client(app)
        registry = app[appkeys.REGISTRY]
        await _until(partial(_settled, registry), "the load")
        assert registry.states()[MODEL] == (ModelState.READY, None)
        shown = await _status(client)
        assert shown["mmproj"]["sha256"] == recorded[projector].sha256
        assert registry.get(MODEL).generator.media_kinds == reads
        await client.close()
