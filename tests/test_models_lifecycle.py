"""Model lifecycle on the real engine: hot swap under load, bad and slow files, preload, budget, admin."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.http import appkeys
from tests.ggufmodels import TinyModelSpec
from tests.serving import RunningDaemon, SignedLock, free_port, running, settings_for, sse_events, wait_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

MODEL = "tiny"
SETTLE_S = 0.3
PROMPT = "The swap test"
MAX_TOKENS = 12
BIG = TinyModelSpec(seed=5, n_ff=2048)  # about 4 MiB: more than a 1 MiB preload cap


@dataclass
class Box(SignedLock):
    """A signed box, and the daemon settings this module serves it with."""

    def settings(self, models: list[dict[str, Any]] | None = None, **lifecycle: Any) -> Any:
        models = models or [{"name": MODEL, "threads": 1, "context_size": 128, "slots": 2}]
        return settings_for(
            models,
            lock=self.lock_settings(),
            lifecycle={"preload_dir": str(self.shm), "watch_settle_s": SETTLE_S, **lifecycle},
        )


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def model_status(daemon: RunningDaemon, name: str = MODEL) -> dict[str, Any]:
    status, body = daemon.get("/admin/status")
    assert status == 200, body
    return next(m for m in body["models"] if m["name"] == name)


def wait_status(
    daemon: RunningDaemon, test: Callable[[dict[str, Any]], bool], what: str, name: str = MODEL
) -> dict[str, Any]:
    """The model's /admin/status entry once `test` holds for it."""
    found: list[dict[str, Any]] = []

    def check() -> bool:
        found[:] = [model_status(daemon, name)]
        return test(found[0])

    wait_for(check, what=what)
    return found[0]


def _has_version(version: int, status: dict[str, Any]) -> bool:
    return bool(status["version"] == version)


def complete(daemon: RunningDaemon, model: str = MODEL) -> tuple[int, dict[str, Any]]:
    return daemon.post(
        "/v1/completions",
        {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    )


# ---- the swap under load ------------------------------------------------------------------------


@dataclass
class StreamResult:
    status: int
    fingerprints: set[str]
    text: str
    done: bool
    error: str | None = None


async def _stream_once(session: aiohttp.ClientSession, url: str) -> StreamResult:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return StreamResult(response.status, set(), "", done=False, error=await response.text())
            prints: set[str] = set()
            parts: list[str] = []
            done = False
            async for chunk in sse_events(response.content):
                if chunk is None:
                    done = True
                    break
                if "error" in chunk:
                    return StreamResult(200, prints, "".join(parts), done=False, error=str(chunk))
                prints.add(chunk["system_fingerprint"])
                parts.append(chunk["choices"][0]["text"])
            return StreamResult(200, prints, "".join(parts), done=done)
    except aiohttp.ClientError as exc:
        return StreamResult(0, set(), "", done=False, error=repr(exc))


async def _clients(url: str, n: int, stop: threading.Event) -> list[StreamResult]:
    results: list[StreamResult] = []

    async def client() -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                results.append(await _stream_once(session, url))

    await asyncio.gather(*(client() for _ in range(n)))
    return results


def test_swap_under_load_loses_nothing_and_never_mixes_versions(box: Box) -> None:
    data = {"a": box.model_bytes(TinyModelSpec(seed=11)), "b": box.model_bytes(TinyModelSpec(seed=12))}
    box.publish({MODEL: ("tiny.gguf", data["a"])})
    # What each model says alone, to compare every answer under load with.
    expected: dict[str, str] = {}
    for label in ("a", "b"):
        sub = Box(box.root / f"ref-{label}")
        sub.publish({MODEL: ("tiny.gguf", data[label])})
        with running(sub.settings(watch=False)) as ref:
            status, body = complete(ref)
            assert status == 200, body
            expected[label] = body["choices"][0]["text"]
    assert expected["a"] != expected["b"]
    sha_label = {hashlib.sha256(v).hexdigest()[:12]: k for k, v in data.items()}

    with running(
        box.settings(
            models=[{"name": MODEL, "threads": 1, "context_size": 128, "slots": 4, "queue_size": 64}]
        )
    ) as daemon:
        stop = threading.Event()
        results: list[StreamResult] = []
        # The clients run in their own thread and event loop until the swaps are done.
        clients = threading.Thread(target=lambda: results.extend(asyncio.run(_clients(daemon.url, 8, stop))))
        clients.start()
        versions_seen = [model_status(daemon)["version"]]
        try:
            wait_for(lambda: _served(daemon) >= 8, what="load to start")
            for i in range(10):
                label = "b" if i % 2 == 0 else "a"
                version = box.publish({MODEL: ("tiny.gguf", data[label])})
                m = wait_status(daemon, partial(_has_version, version), f"version {version}")
                assert m["state"] == "ready"
                assert m["sha256"] == hashlib.sha256(data[label]).hexdigest()
                versions_seen.append(m["version"])
                time.sleep(0.2)  # let requests run on this version
        finally:
            stop.set()
            clients.join(60)
        assert versions_seen == list(range(1, 12))
        assert len(results) > 40
        failures = [r for r in results if r.error or not r.done]
        assert failures == []
        per_version: dict[str, int] = {}
        for r in results:
            assert len(r.fingerprints) == 1, r.fingerprints
            (fingerprint,) = r.fingerprints
            label = sha_label[fingerprint.rsplit("-", 1)[1]]
            assert r.text == expected[label], (fingerprint, r.text)
            per_version[fingerprint] = per_version.get(fingerprint, 0) + 1
        assert len(per_version) >= 6  # answers came from many of the versions in turn
        reloads = daemon.app[appkeys.REGISTRY].reloads if daemon.app else {}
        assert reloads.get("failed", 0) == 0
        # Every retired version was freed: only the serving copy is left in /dev/shm.
        wait_for(lambda: len(box.copies()) == 1, what="retired copies to be removed")
        assert box.copies()[0] == Path(model_status(daemon)["shm_path"])
    assert box.copies() == []  # and the daemon's area goes with it


def _served(daemon: RunningDaemon) -> int:
    return daemon.app[appkeys.REGISTRY].get(MODEL).generator.tokens_generated if daemon.app else 0


# ---- bad and slow replacements ------------------------------------------------------------------


def test_a_corrupt_replacement_is_reported_and_the_old_model_keeps_serving(box: Box) -> None:
    good = box.model_bytes(TinyModelSpec(seed=11))
    other = box.model_bytes(TinyModelSpec(seed=12))
    box.publish({MODEL: ("tiny.gguf", good)})
    with running(box.settings()) as daemon:
        before = model_status(daemon)
        corrupt = bytearray(other)
        corrupt[len(corrupt) // 2] ^= 0xFF
        tmp = box.models / ".tiny.tmp"
        tmp.write_bytes(bytes(corrupt))
        tmp.rename(box.models / "tiny.gguf")
        box.publish({MODEL: ("tiny.gguf", other)}, write_files=False)  # the lock vouches for `other`
        m = wait_status(daemon, lambda s: s["last_reload"]["result"] == "failed", "the failed reload")
        assert "sha256" in m["last_reload"]["reason"]
        assert (m["state"], m["version"], m["sha256"]) == ("ready", 1, before["sha256"])
        status, body = complete(daemon)
        assert status == 200
        assert body["system_fingerprint"] == before["fingerprint"]
        # Fixing the file recovers without a restart.
        tmp.write_bytes(other)
        tmp.rename(box.models / "tiny.gguf")
        m = wait_status(daemon, lambda s: s["version"] == 2, "recovery")
        assert m["last_reload"]["result"] == "loaded"
        wait_for(lambda: len(box.copies()) == 1, what="the old copy to go")


def test_a_slowly_written_file_is_loaded_once_complete_and_not_before(box: Box) -> None:
    first = box.model_bytes(TinyModelSpec(seed=11))
    second = box.model_bytes(TinyModelSpec(seed=12))
    box.publish({MODEL: ("tiny.gguf", first)})
    with running(box.settings(watch_settle_s=0.5)) as daemon:
        box.publish({MODEL: ("tiny.gguf", second)}, write_files=False)
        chunk = len(second) // 16 + 1
        with (box.models / "tiny.gguf").open("wb") as out:  # in place, like a slow download
            for start in range(0, len(second), chunk):
                out.write(second[start : start + chunk])
                out.flush()
                time.sleep(0.1)
                m = model_status(daemon)
                assert (m["state"], m["version"]) == ("ready", 1)
                assert complete(daemon)[0] == 200
        m = wait_status(daemon, lambda s: s["version"] == 2, "the new version")
        assert m["sha256"] == hashlib.sha256(second).hexdigest()
        registry = daemon.app[appkeys.REGISTRY] if daemon.app else None
        assert registry is not None
        assert registry.reloads.get("failed", 0) == 0  # never tried on the half-written file
        assert registry.reloads.get("loaded", 0) == 2  # the start and the one reload


def test_temporary_files_do_not_trigger_reloads(box: Box) -> None:
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=11)))})
    with running(box.settings()) as daemon:
        for name in (".tiny.gguf.swp", "tiny.gguf.part", "new.gguf.crdownload", "x.tmp"):
            (box.models / name).write_bytes(b"partial")
        time.sleep(SETTLE_S * 4)
        last = model_status(daemon)["last_reload"]
        assert (last["result"], last["trigger"]) == ("loaded", "start")


def test_a_model_dropped_from_a_newer_lock_stops_serving(box: Box) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    with running(box.settings()) as daemon:
        version = box.sign_lock({})
        wait_for(lambda: model_status(daemon)["state"] == "revoked", what="revocation")
        status, body = complete(daemon)
        assert status == 503
        assert f"revoked: model 'tiny' is not in the lockfile (version {version})" in body["error"]["message"]
        # Nothing serves: not ready, and /readyz says why.
        status, body = daemon.get("/readyz")
        assert (status, body["models"][MODEL]["state"]) == (503, "revoked")


OTHER = "other"


def _on_loop(daemon: RunningDaemon, call: Callable[[], Any]) -> Any:
    """`call()` run on the daemon's event loop (the registry is the loop's)."""

    async def run() -> Any:
        return call()

    return asyncio.run_coroutine_threadsafe(run(), daemon.loop).result(10)


@pytest.mark.parametrize("trigger", ["watch", "admin"])
def test_a_revoked_model_comes_back_with_a_lock_that_lists_it_again_an_unloaded_one_does_not(
    box: Box, trigger: str
) -> None:
    from edgellmd.host.systemd import summary  # noqa: PLC0415
    from tests.test_host_metrics import scrape, value  # noqa: PLC0415

    files = {
        MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=11))),
        OTHER: ("other.gguf", box.model_bytes(TinyModelSpec(seed=12))),
    }
    both = {name: box.entry(file, data) for name, (file, data) in files.items()}
    box.publish(files)
    models = [{"name": n, "threads": 1, "context_size": 128, "slots": 1} for n in (MODEL, OTHER)]
    with running(box.settings(models, watch=trigger == "watch")) as daemon:
        assert daemon.app is not None
        registry = daemon.app[appkeys.REGISTRY]
        seen: list[int | None] = []  # the lock version of every finished reload

        def on_reload(event: str, _: object) -> None:
            if event == "reload_finished":
                seen.append(registry.lock_version)

        registry.observe(on_reload)

        def apply(listed: tuple[str, ...]) -> int:
            version = box.sign_lock({name: both[name] for name in listed})
            if trigger == "admin":
                status, body = daemon.post("/admin/reload", {})
                assert (status, body["ok"]) == (200, True), body
            wait_for(lambda: version in seen, what=f"the reload of lock version {version}")
            return version

        # Dropped: revoked, said everywhere; the other model serves on, the box stays ready.
        dropped = apply((MODEL,))
        reason = f"model 'other' is not in the lockfile (version {dropped})"
        other = model_status(daemon, OTHER)
        assert (other["state"], other["reason"], other.get("version")) == ("revoked", reason, None)
        assert (other["last_reload"]["result"], other["last_reload"]["trigger"]) == ("revoked", trigger)
        status, body = daemon.get("/readyz")
        assert (status, body["models"][OTHER]) == (200, {"state": "revoked", "reason": reason}), body
        samples = scrape(daemon)
        assert value(samples, "edgellm_model_state", model=OTHER, state="revoked") == 1
        assert value(samples, "edgellm_model_state", model=OTHER, state="unloaded") == 0
        assert value(samples, "edgellm_reloads_total", model=OTHER, result="revoked") == 1
        text = _on_loop(daemon, lambda: summary(registry))
        assert text.startswith("1/2 models ready;")
        assert f"other revoked ({reason})" in text
        status, body = complete(daemon, OTHER)
        assert status == 503
        assert f"the model 'other' is revoked: {reason}" in body["error"]["message"]
        assert complete(daemon)[0] == 200
        # An operator cannot load what the lock does not list.
        status, body = daemon.post(f"/admin/models/{OTHER}/load", {})
        assert (status, body["results"][0]["result"], body["results"][0]["reason"]) == (409, "failed", reason)
        assert model_status(daemon, OTHER)["state"] == "revoked"

        # Listed again: back by itself, on the new lock.
        listed = apply((MODEL, OTHER))
        other = model_status(daemon, OTHER)
        assert (other["state"], other["reason"], other["version"]) == ("ready", None, listed)
        assert (other["last_reload"]["result"], other["last_reload"]["trigger"]) == ("loaded", trigger)
        assert complete(daemon, OTHER)[0] == 200

        # An operator's unload stands, through a lock that drops the model and one that lists it.
        assert daemon.post(f"/admin/models/{OTHER}/unload", {})[0] == 200
        apply((MODEL,))
        assert model_status(daemon, OTHER)["state"] == "unloaded"
        apply((MODEL, OTHER))
        assert model_status(daemon, OTHER)["state"] == "unloaded"
        status, body = daemon.get("/readyz")
        assert (status, body["models"][OTHER]["state"]) == (200, "unloaded")
        status, body = daemon.post(f"/admin/models/{OTHER}/load", {})
        assert (status, body["results"][0]["result"]) == (200, "loaded"), body
        assert complete(daemon, OTHER)[0] == 200


# ---- preload ------------------------------------------------------------------------------------


def test_no_room_in_the_preload_area_falls_back_to_the_models_dir_still_verified(
    box: Box, caplog: pytest.LogCaptureFixture
) -> None:
    big = box.model_bytes(BIG)
    assert len(big) > 1024 * 1024
    box.publish({MODEL: ("big.gguf", big)})
    with caplog.at_level(logging.INFO), running(box.settings(preload_max_mb=1)) as daemon:
        m = model_status(daemon)
        assert m["shm_path"] is None
        assert m["sha256"] == hashlib.sha256(big).hexdigest()
        assert complete(daemon)[0] == 200
        # Still verified in place: a tampered file is refused.
        tampered = bytearray(big)
        tampered[-1] ^= 0xFF
        (box.models / ".big.tmp").write_bytes(bytes(tampered))
        (box.models / ".big.tmp").rename(box.models / "big.gguf")
        m = wait_status(daemon, lambda s: s["last_reload"]["result"] == "failed", "the refused reload")
        assert "sha256" in m["last_reload"]["reason"]
    assert any(
        "no room to preload" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )
    assert any("verified" in r.getMessage() for r in caplog.records)
    assert box.copies() == []


def test_a_model_loaded_in_place_must_be_writable_by_the_daemon_or_root_alone(box: Box) -> None:
    """The descriptor keeps the hashed inode, not its bytes: another user who may write the
    file could rewrite it in place after the hash, and unverified weights would load under a
    verified hash. Loaded in place, such a file is refused, saying why; the preload copy is
    the daemon's own."""
    data = box.model_bytes(TinyModelSpec(seed=12))
    box.publish({MODEL: ("tiny.gguf", data)})
    path = box.models / "tiny.gguf"
    path.chmod(0o644)
    with running(box.settings(preload_dir=None, watch=False)) as daemon:
        assert model_status(daemon)["state"] == "ready"

        def forced_reload() -> dict[str, Any]:
            status, body = daemon.post("/admin/reload", {"force": True})
            assert status in (200, 409), body
            return model_status(daemon)

        path.chmod(0o664)
        refused = forced_reload()["last_reload"]
        assert refused["result"] == "failed"
        assert "writable by its group or others (mode 664)" in refused["reason"]
        assert complete(daemon)[0] == 200  # the verified version serves on
        path.chmod(0o644)
        if os.geteuid() == 0:  # only root gives a file away
            os.chown(path, 4242, -1)
            refused = forced_reload()["last_reload"]
            assert "owned by uid 4242" in refused["reason"], refused
            os.chown(path, 0, -1)
        assert forced_reload()["last_reload"]["result"] == "loaded"
    path.chmod(0o666)
    with running(box.settings(watch=False)) as daemon:  # preloaded: the copy is the daemon's own
        assert model_status(daemon)["state"] == "ready"
        assert model_status(daemon)["shm_path"] is not None


def test_stale_copies_of_a_killed_daemon_are_removed_at_start_up(box: Box) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    port = free_port()
    lock = box.lock_settings()
    config = {
        "server": {"port": port},
        "models": [{"name": MODEL, "threads": 1, "context_size": 128, "slots": 1}],
        "lock": lock,
        "lifecycle": {"preload_dir": str(box.shm), "watch": False},
    }
    config_path = box.root / "edgellm.json.yaml"
    config_path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgellmd", "--config", str(config_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def ready() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    return s.recv(64).startswith(b"HTTP/1.1 200")
            except OSError:
                return False

        wait_for(ready, timeout=60, what="the daemon to be ready")
        # SIGHUP (systemctl reload) re-reads the lock; file watching is off here.
        box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=12)))})
        proc.send_signal(signal.SIGHUP)

        def version() -> Any:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/status", timeout=5) as r:
                return json.load(r)["models"][0]["version"]

        wait_for(lambda: version() == 2, what="the reload on SIGHUP")
        wait_for(lambda: len(box.copies()) == 1, what="the old copy to go")
        stale = box.copies()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert box.copies() == stale  # a killed daemon cleans nothing up
    with running(box.settings(watch=False)) as daemon:
        fresh = box.copies()
        assert len(fresh) == 1
        assert fresh[0].parent != stale[0].parent
        assert not stale[0].parent.exists()
        assert Path(model_status(daemon)["shm_path"]) == fresh[0]


# ---- several models, the memory budget and the admin API ----------------------------------------


def test_memory_budget_evicts_the_idle_evictable_model_or_refuses(box: Box) -> None:
    big = box.model_bytes(BIG)
    box.publish({"first": ("big.gguf", big), "second": ("big.gguf", big)})
    models = [
        {"name": "first", "threads": 1, "context_size": 128, "slots": 1, "evictable": True},
        {"name": "second", "threads": 1, "context_size": 128, "slots": 1},
    ]
    budget = len(big) // (1024 * 1024) + 2  # room for one of them
    with running(box.settings(models=models, memory_budget_mb=budget)) as daemon:
        first, second = model_status(daemon, "first"), model_status(daemon, "second")
        assert (first["state"], second["state"]) == ("unloaded", "ready")
        assert "evicted to make room for second" in first["reason"]
        status, body = complete(daemon, "first")
        assert status == 503
        assert "evicted" in body["error"]["message"]
        # `second` is not evictable: loading `first` again is refused, nothing changes.
        status, body = daemon.post("/admin/models/first/load", {})
        assert status == 409
        assert body["results"][0]["result"] == "failed"
        assert "memory budget exceeded" in body["results"][0]["reason"]
        assert model_status(daemon, "second")["state"] == "ready"
        # Unloading `second` makes room.
        assert daemon.post("/admin/models/second/unload", {})[0] == 200
        status, body = daemon.post("/admin/models/first/load", {})
        assert status == 200, body
        assert complete(daemon, "first")[0] == 200
        # A reload loads the new version beside the one serving: both count, and two do not fit.
        status, body = daemon.post("/admin/reload", {"model": "first", "force": True})
        assert status == 409, body
        reason = body["results"][0]["reason"]
        assert "memory budget exceeded" in reason
        assert model_status(daemon, "first")["state"] == "ready"  # the serving version goes on
        assert complete(daemon, "first")[0] == 200


MIB: Final = 1024 * 1024


def _evictable_pair(box: Box) -> tuple[bytes, list[dict[str, Any]], dict[str, int], int]:
    """Two models of one file, `first` evictable, and a budget (MiB) with room for both and a
    second version of `second` beside its serving one only once `first` is evicted; also the
    file, the models' settings and what each was counted in the budget."""
    small = box.model_bytes(TinyModelSpec(seed=13))
    box.publish({"first": ("first.gguf", small), "second": ("second.gguf", small)})
    models = [
        {"name": "first", "threads": 1, "context_size": 128, "slots": 1, "evictable": True},
        {"name": "second", "threads": 1, "context_size": 128, "slots": 1},
    ]
    with running(box.settings(models=models, watch=False)) as daemon:
        sizes = {m["name"]: m["memory_bytes"] for m in daemon.get("/admin/status")[1]["models"]}
    return small, models, sizes, (sizes["first"] + 2 * sizes["second"]) // MIB + 64


def _refused_evicting_nothing(daemon: RunningDaemon, reason: str) -> None:
    """A forced reload of `second` is refused for `reason`; `first` was not evicted for it."""
    status, body = daemon.post("/admin/reload", {"model": "second", "force": True})
    assert status == 409, body
    assert reason in body["results"][0]["reason"]
    assert model_status(daemon, "first")["state"] == "ready"  # never evicted for it
    assert model_status(daemon, "second")["state"] == "ready"  # its verified version serves on
    assert complete(daemon, "first")[0] == 200


def test_a_file_padded_past_its_locked_size_is_refused_before_it_can_evict_anything(box: Box) -> None:
    """Whoever can write a model file but not the lock: a file padded to look big is refused by
    its size before the budget counts it, so it never evicts another model."""
    small, models, sizes, budget = _evictable_pair(box)
    with running(box.settings(models=models, memory_budget_mb=budget, watch=False)) as daemon:
        assert model_status(daemon, "first")["state"] == "ready"
        with (box.models / "second.gguf").open("ab") as f:
            f.truncate(len(small) + 64 * MIB + sizes["first"] // 2)  # fits only with first gone
        _refused_evicting_nothing(daemon, "the lockfile says")


def test_a_file_of_the_locked_size_with_a_lying_header_evicts_nothing(box: Box) -> None:
    """The budget is kept from verified bytes: a file of exactly the locked size whose header
    claims 40 times the layers (a KV cache that fits only once the idle evictable model is
    gone) fails its hash check before anything is evicted for it. Before, the estimate read the
    header on disk first and unloaded `first` for a file that was then refused."""
    small, models, sizes, budget = _evictable_pair(box)
    key = b"llama.block_count"
    at = small.index(key) + len(key) + 4  # past the key and its value type (uint32)
    (layers,) = struct.unpack_from("<I", small, at)
    kv_per_layer = (sizes["second"] - len(small)) // layers  # the prompt cache is off here
    # Past what fits beside both, within what fits once `first` is evicted.
    wanted = budget * MIB - sizes["second"] - sizes["first"] // 2 - len(small)
    lying = bytearray(small)
    struct.pack_into("<I", lying, at, wanted // kv_per_layer)
    with running(box.settings(models=models, memory_budget_mb=budget, watch=False)) as daemon:
        assert model_status(daemon, "first")["state"] == "ready"
        (box.models / "second.gguf").write_bytes(bytes(lying))
        _refused_evicting_nothing(daemon, "sha256")


def test_admin_reload_reports_each_model_and_force_reloads(box: Box) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    with running(box.settings(watch=False)) as daemon:
        first = model_status(daemon)
        assert first["file"] == "tiny.gguf"
        assert first["shm_path"].startswith(str(box.shm))
        assert (first["slots_busy"], first["slots_total"], first["queue_depth"]) == (0, 2, 0)
        status, body = daemon.post("/admin/reload", {})
        assert (status, [r["result"] for r in body["results"]]) == (200, ["unchanged"])
        status, body = daemon.post("/admin/reload", {"model": MODEL, "force": True})
        assert (status, body["results"][0]["result"]) == (200, "loaded")
        assert model_status(daemon)["loaded_at"] > first["loaded_at"]
        assert daemon.post("/admin/reload", {"model": "nope"})[0] == 404
        assert daemon.post("/admin/reload", {"force": "yes"})[0] == 400
        assert daemon.post("/admin/reload", {"models": []})[0] == 400
        assert daemon.post("/admin/models/nope/load", {})[0] == 404


def test_edgellmctl_status_and_reload_use_the_admin_key(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    keys = box.root / "keys.yaml"
    _, admin = create_key(keys, "ops", ["admin"], limits={})
    _, inference = create_key(keys, "app", ["inference"], limits={})
    (box.root / "admin.key").write_text(admin + "\n")
    (box.root / "app.key").write_text(inference + "\n")
    settings = settings_for(
        [{"name": MODEL, "threads": 1, "context_size": 128, "slots": 2}],
        lock=box.lock_settings(),
        auth={"keys_file": str(keys)},
        lifecycle={"preload_dir": str(box.shm), "watch": False},
    )
    monkeypatch.delenv("EDGELLM_ADMIN_KEY", raising=False)
    monkeypatch.delenv("EDGELLM_ADMIN_KEY_FILE", raising=False)
    with running(settings) as daemon:
        common = ["--url", daemon.url, "--key-file", str(box.root / "admin.key")]
        assert edgellmctl(["status", *common]) == 0
        out = capsys.readouterr().out
        assert "MODEL" in out
        assert "version 1" in out
        assert MODEL in out
        assert hashlib.sha256(data).hexdigest()[:12] in out
        assert admin not in out
        box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=12)))})
        assert edgellmctl(["reload", MODEL, *common]) == 0
        assert capsys.readouterr().out.strip() == f"{MODEL}: loaded (version 2)"
        assert edgellmctl(["status", *common, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["models"][0]["version"] == 2
        # A failed reload exits 1 and says why.
        (box.models / "tiny.gguf").write_bytes(b"GGUF broken")
        assert edgellmctl(["reload", *common]) == 1
        assert "tiny: failed (version 2): file tiny.gguf" in capsys.readouterr().out
        # Without the admin scope, or without a key: refused, and the key is never printed.
        assert edgellmctl(["status", "--url", daemon.url, "--key-file", str(box.root / "app.key")]) == 1
        err = capsys.readouterr().err
        assert "HTTP 403" in err
        assert inference not in err
        assert edgellmctl(["status", "--url", daemon.url]) == 1
        assert "no admin key" in capsys.readouterr().err


def test_edgellmctl_status_when_the_daemon_is_down(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGELLM_ADMIN_KEY", "elk_0123456789ab_secret")
    assert edgellmctl(["status", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "cannot reach" in capsys.readouterr().err


@pytest.fixture
def embedder(models_dir: Path) -> Iterator[RunningDaemon]:
    settings = settings_for(
        [
            {
                "name": "embed",
                "file": str(models_dir / "tiny.gguf"),
                "embedding": True,
                "slots": 2,
                "context_size": 128,
                "threads": 1,
            },
            {
                "name": MODEL,
                "file": str(models_dir / "tiny.gguf"),
                "slots": 1,
                "context_size": 128,
                "threads": 1,
            },
        ],
        lifecycle={"watch": False},
    )
    with running(settings) as daemon:
        yield daemon


def test_embeddings_with_the_openai_client(embedder: RunningDaemon) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=embedder.url + "/v1", api_key="unused")
    one = client.embeddings.create(model="embed", input="hello world")
    assert len(one.data) == 1
    assert len(one.data[0].embedding) == 64  # the tiny model's n_embd
    many = client.embeddings.create(
        model="embed", input=["hello world", "other", "hello world"], encoding_format="float"
    )
    vectors = [d.embedding for d in many.data]
    assert [d.index for d in many.data] == [0, 1, 2]
    assert vectors[0] == vectors[2]
    assert vectors[0] != vectors[1]
    assert max(abs(a - b) for a, b in zip(vectors[0], one.data[0].embedding, strict=True)) < 1e-6
    assert abs(sum(v * v for v in vectors[1]) - 1.0) < 1e-4
    assert many.usage.prompt_tokens == many.usage.total_tokens > 0


@pytest.mark.parametrize(
    ("model", "path", "body", "status", "fragment"),
    [
        ("embed", "/v1/completions", {"prompt": "x"}, 400, "embedding model"),
        (
            "embed",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}]},
            400,
            "embedding model",
        ),
        (MODEL, "/v1/embeddings", {"input": "x"}, 400, "does not produce embeddings"),
        ("embed", "/v1/embeddings", {"input": "x" * 400}, 400, "at most 128 tokens"),
        ("embed", "/v1/embeddings", {"input": [1, 2, 99999]}, 400, "below"),
        ("nope", "/v1/embeddings", {"input": "x"}, 404, "does not exist"),
    ],
)
def test_embedding_requests_are_routed_by_kind(
    embedder: RunningDaemon, model: str, path: str, body: dict[str, Any], status: int, fragment: str
) -> None:
    got, answer = embedder.post(path, {"model": model, **body})
    assert got == status, answer
    assert fragment in answer["error"]["message"]


def test_the_preload_dir_is_per_daemon_and_removed_at_stop(box: Box) -> None:
    box.publish({MODEL: ("tiny.gguf", box.model_bytes(TinyModelSpec(seed=11)))})
    with running(box.settings(watch=False)), running(box.settings(watch=False)):
        copies = box.copies()
        assert len(copies) == 2
        assert copies[0].parent != copies[1].parent
        assert oct(os.stat(copies[0].parent).st_mode & 0o777) == "0o700"
    assert box.copies() == []
