"""A scheduler that stops by itself: the model leaves service at once, tells why, and restarts.

The fault is injected into the real engine's scheduler loop (an exception from one step), on
a real daemon with a real notify socket: what its clients, /readyz, /admin/status, systemd's
STATUS= and /metrics say, and when it serves again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from edgellmd.engine import scheduler as scheduler_module
from edgellmd.host.systemd import Notifier
from edgellmd.http import appkeys
from edgellmd.http.app import create_app
from edgellmd.models import registry as registry_module
from edgellmd.models.loader import LoadFailed
from tests.serving import settings_for
from tests.test_host_systemd import NotifySocket

MODEL = "tiny"


WARM_UP_STEPS = 2  # a load's warm-up generation: its prefill and one more token


class Fault:
    """Makes the scheduler's next step with a request in a slot raise, once per arming."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.fired = 0
        self.sticky = False  # fire at every such step past an engine's warm-up, not once per arming
        self.busy_steps: dict[int, int] = {}  # by engine: steps with a request in a slot

    def arm(self) -> None:
        self.armed.set()


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Fault:
    injected = Fault()
    real = scheduler_module.Engine._step

    def step(self: scheduler_module.Engine) -> bool:
        # Only with a request in a slot: a step that ends a load's warm-up may still be
        # returning when the model already shows ready.
        busy = injected.busy_steps[id(self)] = injected.busy_steps.get(id(self), 0) + int(self.busy_slots > 0)
        if injected.sticky and busy <= WARM_UP_STEPS:  # a load's warm-up goes through
            return real(self)
        if injected.armed.is_set() and self.busy_slots:
            if not injected.sticky:
                injected.armed.clear()
            injected.fired += 1
            raise RuntimeError("injected scheduler fault")
        return real(self)

    monkeypatch.setattr(scheduler_module.Engine, "_step", step)
    return injected


@pytest.fixture
def notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock.path))  # sdnotify reads it from the environment
    yield sock
    sock.close()


async def _serve(
    aiohttp_client: Any, tiny_model: Path, notifier: Notifier | None = None, **model: Any
) -> Any:
    settings = settings_for(
        # The fault is injected into the scheduler in this process: the engine runs on a thread here.
        [
            {
                "name": MODEL,
                "file": str(tiny_model),
                "slots": 1,
                "context_size": 512,
                "threads": 1,
                "isolation": "thread",
                **model,
            }
        ]
    )
    app: web.Application = create_app(settings, notifier=notifier)
    client = await aiohttp_client(app)
    await _until(client, lambda status, _: status == 200, "the first load")
    return client


async def _until(client: Any, test: Any, what: str, limit_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:
        answer = await client.get("/readyz")
        body = await answer.json()
        if test(answer.status, body):
            return dict(body)
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {body}"
        await asyncio.sleep(0.02)


async def _model(client: Any) -> dict[str, Any]:
    answer = await client.get("/admin/status")
    body = await answer.json()
    return dict(next(m for m in body["models"] if m["name"] == MODEL))


async def _crash(client: Any, fault: Fault) -> None:
    """The scheduler's next step raises: the request that wakes it is cut with a 503."""
    fault.arm()
    answer = await client.post("/v1/completions", json=_completion(2))
    assert answer.status == 503
    assert (await answer.json())["error"]["code"] == "engine_failed"


def _completion(max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream_and_one_waiting(client: Any) -> tuple[Any, asyncio.Task[Any]]:
    """A stream generating in the only slot (its first event read), and a request waiting for it."""
    stream = await client.post("/v1/completions", json=_completion(400, stream=True))
    assert stream.status == 200
    assert (await stream.content.readline()).startswith(b"data: ")
    waiting = asyncio.create_task(client.post("/v1/completions", json=_completion(4)))
    deadline = time.monotonic() + 10
    while (await _model(client)).get("queue_depth") != 1:
        assert time.monotonic() < deadline, "the second request never queued"
        await asyncio.sleep(0.01)
    return stream, waiting


async def test_a_crashed_scheduler_takes_its_model_out_of_service_and_it_restarts(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, notify: NotifySocket
) -> None:
    client = await _serve(aiohttp_client, tiny_model, Notifier())
    app = client.server.app
    registry = app[appkeys.REGISTRY]
    assert [name for name, _ in registry.heartbeats()] == [MODEL]
    old_engine = registry.get(MODEL).engine

    # One stream generating in the only slot, one request waiting for it.
    stream, waiting = await _stream_and_one_waiting(client)

    fault.arm()
    events = [line.strip() async for line in stream.content if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    cut = json.loads(events[-2][len(b"data: ") :])
    assert cut["error"]["code"] == "engine_failed"

    # At once: not ready, with the model and the reason, everywhere an operator looks.
    body = await _until(client, lambda status, b: status == 503, "readiness to drop")
    assert body["status"] == "restarting"
    assert body["models"][MODEL]["state"] == "restarting"
    assert "RuntimeError" in body["models"][MODEL]["reason"]
    shown = await _model(client)
    assert shown["state"] == "restarting"
    assert shown["engine_stops"] == 1
    assert shown["last_engine_stop"]["fault"] == "its scheduler crashed (RuntimeError)"
    assert shown["last_engine_stop"]["action"] == "restart in 1 s"
    assert registry.heartbeats() == []  # the watchdog judges the models that serve
    deadline = time.monotonic() + 5  # a datagram on its way to the reader thread
    while not any(f"{MODEL} restarting" in f for f in notify.fields() if f.startswith("STATUS=")):
        assert time.monotonic() < deadline, notify.fields()
        await asyncio.sleep(0.01)
    late = await client.post("/v1/completions", json=_completion(4))
    assert late.status == 503  # a new request is told to come back; ...
    assert late.headers["Retry-After"]
    assert (await late.json())["error"]["code"] == "model_not_ready"
    assert not waiting.done()  # ... the one that was queued waits for the restarted engine

    # By itself, after the pause: a new engine serves, and the old one was freed.
    body = await _until(client, lambda status, _: status == 200, "the restart")
    assert body["models"][MODEL]["state"] == "ready"
    assert registry.get(MODEL).engine is not old_engine
    served = await asyncio.wait_for(waiting, 10)
    assert served.status == 200, await served.text()
    assert (await served.json())["usage"]["completion_tokens"] == 4
    answer = await client.post("/v1/completions", json=_completion(4))
    assert answer.status == 200
    assert (await answer.json())["usage"]["completion_tokens"] == 4
    shown = await _model(client)
    assert shown["last_reload"]["trigger"] == "restart"
    assert shown["last_reload"]["result"] == "loaded"
    assert shown["engine_stops"] == 1  # the count stays for the operator
    metrics = await (await client.get("/metrics")).text()
    assert f'edgellm_engine_restarts_total{{model="{MODEL}",reason="crash"}} 1.0' in metrics
    assert f'edgellm_model_state{{model="{MODEL}",state="restarting"}} 0.0' in metrics
    deadline = time.monotonic() + 10
    while old_engine._thread.is_alive() or registry.status()["draining"]:
        assert time.monotonic() < deadline, "the stopped engine was never freed"
        await asyncio.sleep(0.02)


async def test_a_crash_loop_trips_the_breaker_until_an_operator_loads_the_model(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.05,))
    client = await _serve(aiohttp_client, tiny_model, crash_loop_stops=3, crash_loop_window_s=60)
    for crash in range(1, 3):
        await _crash(client, fault)
        await _until(client, lambda status, b: b["status"] == "restarting", f"stop {crash}")
        await _until(client, lambda status, _: status == 200, f"restart {crash}")
    await _crash(client, fault)
    body = await _until(client, lambda status, b: b["status"] == "failed", "the breaker")
    assert "stopped 3 times within 60 s, so it is not restarted" in body["models"][MODEL]["reason"]
    await asyncio.sleep(0.3)  # many backoffs' time: still failed
    shown = await _model(client)
    assert shown["state"] == "failed"
    assert shown["engine_stops"] == 3
    assert shown["last_engine_stop"]["action"] == "breaker tripped"
    answer = await client.post("/v1/completions", json=_completion(2))
    assert answer.status == 503

    # An operator's load resets the breaker and serves again.
    loaded = await client.post(f"/admin/models/{MODEL}/load")
    assert loaded.status == 200, await loaded.text()
    await _until(client, lambda status, _: status == 200, "the operator's load")
    await _crash(client, fault)
    body = await _until(client, lambda status, b: status == 503, "one more stop")
    assert body["status"] == "restarting"  # one stop since the load: restarted, not tripped
    await _until(client, lambda status, _: status == 200, "the restart after the load")
    assert fault.fired == 4


async def test_an_unload_during_the_pause_cancels_the_restart(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.5,))
    client = await _serve(aiohttp_client, tiny_model)
    await _crash(client, fault)
    await _until(client, lambda status, b: b["status"] == "restarting", "the stop")
    unloaded = await client.post(f"/admin/models/{MODEL}/unload")
    assert unloaded.status == 200
    await asyncio.sleep(1.0)
    shown = await _model(client)
    assert shown["state"] == "unloaded"
    assert shown["reason"] == "unloaded by an operator"


async def test_a_request_whose_turn_kills_the_engine_again_is_not_replayed_twice(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued request waits for the restart once; if the restarted engine dies at its turn as
    well (it may be the poison), it fails: two stops, not a crash loop fed by one request."""
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.05,))
    client = await _serve(aiohttp_client, tiny_model)
    _stream, waiting = await _stream_and_one_waiting(client)
    fault.sticky = True
    fault.arm()
    answer = await asyncio.wait_for(waiting, 20)
    assert answer.status == 503
    assert (await answer.json())["error"]["code"] == "engine_failed"
    fault.armed.clear()
    assert fault.fired == 2  # the stream's step, then the replayed request's: no third
    # The request hears of the stop from the engine's thread, the registry on the event loop.
    deadline = time.monotonic() + 10
    while (await _model(client))["engine_stops"] != 2:
        assert time.monotonic() < deadline, "the second stop was never counted"
        await asyncio.sleep(0.01)
    await _until(client, lambda status, _: status == 200, "the restart after the second stop")
    assert (await _model(client))["engine_stops"] == 2


async def test_a_restart_whose_load_breaks_unexpectedly_fails_with_a_reason(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that raises what no load should (a bug, a reader a file broke) fails the restart
    with a reason, as any failed load does, and counts as one more stop: never a restart task
    dying unseen, the model left `restarting` for good; tried again until the breaker trips."""
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.05,))
    client = await _serve(aiohttp_client, tiny_model, crash_loop_stops=3, crash_loop_window_s=60)
    registry = client.server.app[appkeys.REGISTRY]

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(registry.loader, "build", broken)
    await _crash(client, fault)
    body = await _until(client, lambda _, b: b["models"][MODEL]["state"] == "failed", "the breaker")
    reason = body["models"][MODEL]["reason"]
    assert reason.startswith("the restart failed: the load failed unexpectedly (RecursionError; see the log)")
    assert "stopped 3 times within 60 s, so it is not restarted" in reason
    shown = await _model(client)
    assert shown["last_reload"]["trigger"] == "restart"
    assert shown["engine_stops"] == 3  # the crash and two failed restarts


async def test_an_engine_that_dies_again_as_its_restart_loads_is_restarted_again(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacement engine killed while it loaded (the OOM killer, a second crash while
    warming): the model was failed for good after one counted stop, far from its breaker, with
    nothing in the audit log. It is one more stop, and the next restart serves."""
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.05,))
    client = await _serve(aiohttp_client, tiny_model, crash_loop_stops=4, crash_loop_window_s=60)
    registry = client.server.app[appkeys.REGISTRY]
    build = registry.loader.build
    calls = 0

    async def dies_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise LoadFailed("the engine process was killed by SIGKILL while loading")
        return await build(*args, **kwargs)

    monkeypatch.setattr(registry.loader, "build", dies_once)
    await _crash(client, fault)
    await _until(client, lambda status, _: status == 200 and calls == 2, "the second restart")
    shown = await _model(client)
    assert (shown["state"], shown["engine_stops"], calls) == ("ready", 2, 2)
    assert (
        "the restart failed: the engine process was killed by SIGKILL" in shown["last_engine_stop"]["fault"]
    )
    assert shown["last_engine_stop"]["action"] == "restart in 0.05 s"
    metrics = await (await client.get("/metrics")).text()
    assert f'edgellm_engine_restarts_total{{model="{MODEL}",reason="restart_failed"}} 1' in metrics


@pytest.mark.parametrize("reload_fails", [False, True], ids=["reload loads", "reload fails"])
async def test_an_engine_that_dies_during_a_reload_is_restarted_only_if_the_reload_did_not_bring_it_back(
    aiohttp_client: Any,
    tiny_model: Path,
    fault: Fault,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    reload_fails: bool,
) -> None:
    """The serving engine dies while a reload of its model loads the new version: the restart
    waits for the reload's turn, and once the reload swapped the new version in, it loaded that
    again (a second load of a healthy, fresh engine, its requests moved for nothing). Where the
    reload fails instead, the restart brings the model back, as before: never failed for good
    after one stop."""
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (0.05,))
    client = await _serve(aiohttp_client, tiny_model)
    registry = client.server.app[appkeys.REGISTRY]
    build = registry.loader.build
    began, held, builds = asyncio.Event(), asyncio.Event(), []

    async def slow(*args: Any, **kwargs: Any) -> Any:
        builds.append(kwargs.get("reuse"))
        if len(builds) == 1:  # the reload's
            began.set()
            await held.wait()
            if reload_fails:
                raise LoadFailed("the engine process was killed by SIGKILL while loading")
        return await build(*args, **kwargs)

    monkeypatch.setattr(registry.loader, "build", slow)
    caplog.set_level(logging.INFO, logger="edgellmd.audit")
    reload = asyncio.create_task(registry.reload([MODEL], force=True, trigger="watch"))
    await asyncio.wait_for(began.wait(), 30)
    await _crash(client, fault)  # the serving engine dies while the reload loads
    await _until(client, lambda _, b: b["models"][MODEL]["state"] == "restarting", "the stop")
    await asyncio.sleep(0.3)  # the restart is waiting for the reload's turn by now
    held.set()
    outcomes = await asyncio.wait_for(reload, 30)
    assert [o.result for o in outcomes] == ["failed" if reload_fails else "loaded"]
    await _until(client, lambda status, _: status == 200, "the model back")
    await asyncio.sleep(0.5)  # a restart queued behind the reload would have begun by now
    entry = registry._entries[MODEL]
    assert entry.restart is None
    assert len(builds) == (2 if reload_fails else 1), builds  # the restart's only after a failure
    # The stopped engine's copy, kept for a restart that had nothing to do, is gone too.
    assert entry.restart_from is None
    serving = entry.handle.provenance.copy
    assert serving is not None
    deadline = time.monotonic() + 10
    while sorted(serving.parent.glob("*.gguf")) != [serving]:
        assert time.monotonic() < deadline, sorted(serving.parent.glob("*.gguf"))
        await asyncio.sleep(0.05)
    shown = await _model(client)
    brought_back_by = "restart" if reload_fails else "watch"
    assert (shown["state"], shown["last_reload"]["trigger"]) == ("ready", brought_back_by)
    assert shown["engine_stops"] == 1
    audited = [r.getMessage() for r in caplog.records if r.name == "edgellmd.audit"]
    restarts = [text for text in audited if "(restart)" in text]
    assert restarts == (["reload (restart): tiny loaded"] if reload_fails else []), audited


async def test_once_the_daemon_stops_no_engine_is_restarted_and_no_request_waits_for_one(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that died as SIGTERM came was restarted during the drain, and the requests
    that waited for it were served on it and cut at the stop's end with no error event. From
    the drain on, a restart waiting is cancelled and a stop restarts nothing; a request waiting
    for a replacement has its answer (none) at once."""
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (5.0,))
    client = await _serve(aiohttp_client, tiny_model)
    registry = client.server.app[appkeys.REGISTRY]
    stopped = registry.ready_handles()[0]
    await _crash(client, fault)
    await _until(client, lambda status, b: b["status"] == "restarting", "the stop")
    waiting = asyncio.ensure_future(registry.replacement(stopped, 30.0))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    started = time.monotonic()
    registry.stop_restarts()
    assert await waiting is None
    assert time.monotonic() - started < 1
    shown = await _model(client)
    assert shown["state"] == "failed"
    assert shown["reason"].endswith("not restarted: the daemon is stopping")
    await asyncio.sleep(0.2)
    assert (await _model(client))["state"] == "failed"  # no restart came after all


async def test_a_request_waiting_for_a_restart_when_the_daemon_stops_is_told_it_stops(
    aiohttp_client: Any, tiny_model: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued request waited for the restarted engine; the drain began, so none came, and it
    was told "the model's engine stopped; it is restarting" with engine_failed: a retry hint
    for a restart that never comes. It is told the server is shutting down."""
    monkeypatch.setattr(registry_module, "RESTART_BACKOFF_S", (5.0,))
    client = await _serve(aiohttp_client, tiny_model)
    registry = client.server.app[appkeys.REGISTRY]
    stream, waiting = await _stream_and_one_waiting(client)
    fault.arm()
    events = [line.strip() async for line in stream.content if line.startswith(b"data: ")]
    assert json.loads(events[-2][len(b"data: ") :])["error"]["code"] == "engine_failed"
    await _until(client, lambda status, b: b["status"] == "restarting", "the stop")
    await asyncio.sleep(0.1)
    assert not waiting.done()  # it waits for the restart ...
    registry.stop_restarts()  # ... which the drain cancels
    answer = await asyncio.wait_for(waiting, 2)
    assert answer.status == 503
    error = (await answer.json())["error"]
    assert (error["code"], error["message"]) == ("server_shutting_down", "the server is shutting down")
