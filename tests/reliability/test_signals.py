"""Signals: SIGTERM mid-stream drains every stream; SIGKILL and a restart keep the rollback guard's state."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from edgellmd.models.preload import AREA_PREFIX
from tests.reliability.harness import (
    OTHER_SPEC,
    STEADY_SPEC,
    Answer,
    DaemonProcess,
    Figures,
    SignedBox,
    ask,
    completion,
    describe,
    duration,
)
from tests.serving import free_port, wait_for

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

SLOTS = 4
STREAMS = 8  # four generating, four waiting for a slot when the signal comes
STREAM_TOKENS = 400


def _in_background(url: str, token: str, n: int, max_tokens: int) -> tuple[threading.Thread, list[Answer]]:
    """Start `n` concurrent streamed completions in a thread; their answers land in the list."""
    answers: list[Answer] = []

    async def run() -> None:
        path, body = completion(max_tokens, stream=True)
        async with aiohttp.ClientSession() as session:
            answers.extend(await asyncio.gather(*(ask(session, url, token, path, body) for _ in range(n))))

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    return thread, answers


def _refuses_connections(port: int) -> bool:
    """True once a new connection is refused: the listening socket closing while a connect is
    in flight resets that connection, which is a refusal too (not "still accepting")."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except (ConnectionRefusedError, ConnectionResetError):
        return True


def _areas(root: Path) -> list[Path]:
    return sorted(root.glob(f"{AREA_PREFIX}*"))


def test_sigterm_mid_stream_finishes_every_stream_then_exits_clean(box: SignedBox, figures: Figures) -> None:
    box.publish(box.model_bytes(STEADY_SPEC))
    config = box.config(
        free_port(),
        model={"slots": SLOTS, "queue_size": STREAMS, "context_size": 1024},
        server={"shutdown_timeout_s": 60, "max_tokens_limit": STREAM_TOKENS},
    )
    preload_root = Path(config["lifecycle"]["preload_dir"])
    with DaemonProcess(box, config) as daemon:
        daemon.start()
        thread, answers = _in_background(daemon.url, box.app_token, STREAMS, STREAM_TOKENS)
        wait_for(
            lambda: (daemon.model()["slots_busy"], daemon.model()["queue_depth"]) == (SLOTS, STREAMS - SLOTS),
            what="every slot busy and the rest queued",
        )
        signalled = time.monotonic()
        daemon.send(signal.SIGTERM)
        wait_for(lambda: _refuses_connections(daemon.port), timeout=5, what="new connections to be refused")
        refused_after = time.monotonic() - signalled
        thread.join(120)
        code = daemon.wait(120)
        exited_after = time.monotonic() - signalled
        messages = daemon.messages()

    figures["streams running / waiting at SIGTERM"] = (SLOTS, STREAMS - SLOTS)
    figures["new connections refused after s"] = refused_after
    figures["exit after s / status"] = (exited_after, code)
    figures["streams complete"] = f"{sum(a.ok for a in answers)} of {len(answers)}"
    figures.show()

    assert len(answers) == STREAMS
    assert all(a.ok for a in answers), describe([a for a in answers if not a.ok])
    assert all(a.tokens == STREAM_TOKENS for a in answers)
    assert code == 0
    assert any("shutting down" in m for m in messages)
    assert _areas(preload_root) == []  # the /dev/shm copy went with it


def test_sigkill_then_restart_keeps_the_version_state_and_refuses_rollback(
    box: SignedBox, figures: Figures
) -> None:
    first, second = box.model_bytes(STEADY_SPEC), box.model_bytes(OTHER_SPEC)
    box.publish(first)
    config = box.config(free_port(), server={"max_tokens_limit": 4000}, model={"context_size": 4096})
    preload_root = Path(config["lifecycle"]["preload_dir"])
    daemon = DaemonProcess(box, config).start()
    try:
        for data in (second, first):  # v2, v3
            _publish_and_wait(daemon, data)
        old_lock = _older_lock(box, first)
        thread, cut = _in_background(daemon.url, box.app_token, 4, 4000)
        wait_for(lambda: daemon.model()["slots_busy"] == 4, what="streams mid-flight")
        daemon.send(signal.SIGKILL)
        assert daemon.wait(30) == -signal.SIGKILL
        thread.join(60)
        stale = _areas(preload_root)
        highest_after_crash = box.highest_version()

        # Restart: ready, serving v3, the killed daemon's /dev/shm area removed.
        daemon = DaemonProcess(box, config, label="restarted").start()
        restarted = daemon.model()
        areas = _areas(preload_root)

        # A live rollback is refused ...
        box.replace(box.lock, old_lock)
        refused = wait_for(
            lambda: (m := daemon.model())["last_reload"]["result"] == "failed" and m,
            what="the rollback to be refused",
        )
        serving_after_refusal = daemon.complete(max_tokens=4).body["system_fingerprint"]
        # ... and so is one through a crash: the old lockfile stays in place across SIGKILL.
        daemon.kill()
        daemon = DaemonProcess(box, config, label="rolled-back").start(ready=False)
        readyz = wait_for(
            lambda: (r := daemon.probe("/readyz")) is not None and r.body["status"] == "failed" and r,
            what="the refused start",
        )
        served = daemon.get("/v1/models", token=box.app_token)
        # A newer lockfile recovers it without a restart.
        version = box.publish(second)
        wait_for(lambda: daemon.get("/readyz").status == 200, what="the recovery")
        recovered = daemon.model()
    finally:
        daemon.kill()

    figures["streams cut by SIGKILL"] = sum(not a.ok for a in cut)
    figures["rollback state after the crash"] = highest_after_crash
    figures["stale /dev/shm areas left by SIGKILL -> after restart"] = (len(stale), len(areas))
    figures["restarted serving version"] = restarted["version"]
    figures["live rollback to v2"] = refused["last_reload"]["reason"]
    figures["start with the v2 lockfile"] = readyz.body["models"]["m"]["reason"]
    figures["recovered with"] = f"version {recovered['version']}"
    figures.show()

    assert highest_after_crash == 3
    assert len(stale) == 1  # SIGKILL cleans nothing up ...
    assert len(areas) == 1  # ... the next start does
    assert areas[0] != stale[0]
    assert restarted["version"] == 3
    assert restarted["state"] == "ready"
    assert "rollback refused" in refused["last_reload"]["reason"]
    assert "lockfile version 2 is lower than version 3" in refused["last_reload"]["reason"]
    assert serving_after_refusal.startswith("edgellm-v3-")
    assert "rollback refused" in readyz.body["models"]["m"]["reason"]
    assert served.body["data"] == []
    assert recovered["version"] == version == 4
    assert box.highest_version() == 4


def _publish_and_wait(daemon: DaemonProcess, data: bytes) -> None:
    version = daemon.box.publish(data)
    wait_for(lambda: daemon.model()["version"] == version, what=f"version {version}")


def _older_lock(box: SignedBox, data: bytes) -> bytes:
    """A validly signed lockfile with version 2, kept to replay later; the current one is restored."""
    current = box.lock.read_bytes()
    box.sign_lock({"m": box.entry("model.gguf", data)}, version=2)
    old = box.lock.read_bytes()
    box.replace(box.lock, current)
    return old


def test_sigkill_at_random_moments_of_reloads_never_breaks_a_restart(
    box: SignedBox, figures: Figures
) -> None:
    rounds = int(duration(3, 10))
    data = [box.model_bytes(STEADY_SPEC), box.model_bytes(OTHER_SPEC)]
    box.publish(data[0])
    config = box.config(free_port())
    preload_root = Path(config["lifecycle"]["preload_dir"])
    rng = random.Random(9)
    kills: list[tuple[float, int, int]] = []  # (delay, state after the kill, version served after restart)
    for i in range(rounds):
        daemon = DaemonProcess(box, config, label=f"round{i}").start()
        try:
            version = box.publish(data[(i + 1) % 2])
            daemon.send(signal.SIGHUP)
            delay = rng.uniform(0, 0.3)  # somewhere in verify, copy, load, warm-up or the state write
            time.sleep(delay)
            daemon.kill()
            state = box.highest_version()
            assert state in (version - 1, version)
            daemon = DaemonProcess(box, config, label=f"round{i}-restart").start()
            served = daemon.model()["version"]
            kills.append((delay, state, served))
            assert served == version == box.highest_version()
            assert len(_areas(preload_root)) == 1
            assert daemon.complete(max_tokens=4).status == 200
        finally:
            daemon.kill()
    figures["rounds"] = rounds
    figures["(kill delay s, state after kill, version after restart)"] = kills
    figures.show()
