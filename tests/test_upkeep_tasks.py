"""The daemon's background loops outlive a pass that raises: the ledger's upkeep (hours
sealed, failed commits retried, retention), the console's sessions watch (sessions of revoked
keys ended) and systemd's STATUS= and watchdog. Before, one exception ended the task with
nothing said: no hour was sealed again, a failing ledger was never retried, a revoked key's
console session went on, the watchdog's pings stopped with no cause in the log."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Any

import pytest
from aiohttp import web

from edgellmd.host import systemd
from edgellmd.http import appkeys
from edgellmd.http import ledger as http_ledger
from edgellmd.http.console import door


def _done(value: object = None) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class FlakyLedger:
    """Raises in `tick` on the passes listed, and in `maintain` on the first call."""

    def __init__(self, tick_fails: set[int]) -> None:
        self.ticks = 0
        self.maintained = 0
        self.tick_fails = tick_fails
        self.error: str | None = None

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks in self.tick_fails:
            raise RuntimeError("tick broke")

    def check_file(self) -> str | None:
        return None

    def retry(self) -> Future[None]:
        return _done()

    def maintain(self) -> Future[None]:
        self.maintained += 1
        if self.maintained == 1:
            failed: Future[None] = Future()
            failed.set_exception(ValueError("maintenance broke"))
            return failed
        return _done()


class Summary:
    def flush_summary(self) -> None:
        pass


async def _until(check: Any) -> None:
    async with asyncio.timeout(5.0):
        while not check():  # noqa: ASYNC110 - polls counters the task under test moves
            await asyncio.sleep(0.005)


async def test_the_ledgers_upkeep_goes_on_after_a_pass_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(http_ledger, "RETRY_INTERVAL_S", 0.01)
    monkeypatch.setattr(http_ledger, "MAINTAIN_INTERVAL_S", 0.0)
    ledger = FlakyLedger(tick_fails={2, 3, 4, 8})
    caplog.set_level(logging.ERROR, logger=http_ledger.log.name)
    task = asyncio.create_task(http_ledger._tend(ledger, Summary()))  # type: ignore[arg-type]
    try:
        await _until(lambda: ledger.ticks >= 10)
        assert not task.done()
        assert ledger.maintained >= 2  # the failed maintenance did not end it either
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    logged = [r for r in caplog.records if r.name == http_ledger.log.name]
    # Said once for each run of the same failure: the maintenance's, tick's 2-4, tick's 8.
    assert [str(r.exc_info[1]) for r in logged if r.exc_info] == [
        "maintenance broke",
        "tick broke",
        "tick broke",
    ]


class FlakySessions:
    def __init__(self) -> None:
        self.pruned = 0
        self.ended: list[set[str]] = []

    def prune(self) -> int:
        self.pruned += 1
        if self.pruned == 1:
            raise OSError("sessions broke")
        return 0

    def key_ids(self) -> set[str]:
        return {"0123456789ab"}

    def end_keys(self, gone: set[str]) -> None:
        self.ended.append(gone)


class NoKeys:
    def get(self, key_id: str) -> None:
        return None


async def test_the_console_sessions_watch_goes_on_after_a_pass_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(door, "WATCH_INTERVAL_S", 0.01)
    monkeypatch.setattr(door, "unusable", lambda store, ids: set(ids))  # every key revoked
    sessions = FlakySessions()
    app = web.Application()
    app[appkeys.KEY_STORE] = NoKeys()  # type: ignore[misc]
    caplog.set_level(logging.ERROR, logger=door.log.name)
    context = door._sessions_ctx(sessions)(app)  # type: ignore[arg-type]
    await anext(context)
    try:
        await _until(lambda: sessions.ended)
        assert sessions.ended[0] == {"0123456789ab"}  # the revoked key's sessions ended all the same
    finally:
        with pytest.raises(StopAsyncIteration):
            await anext(context)
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["sessions broke"]


class Notes:
    """A notifier that records what it was told."""

    watchdog_s = None
    enabled = True

    def __init__(self) -> None:
        self.pings = 0
        self.statuses: list[str] = []

    def watchdog(self) -> None:
        self.pings += 1

    def status(self, text: str) -> None:
        self.statuses.append(text)


class FlakyRegistry:
    """Its heartbeats and status raise on the first `fails` calls each."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.beats = 0
        self.asked = 0

    def heartbeats(self) -> list[tuple[str, float]]:
        self.beats += 1
        if self.beats <= self.fails:
            raise KeyError("m")
        return []

    def status(self) -> dict[str, Any]:
        self.asked += 1
        if self.asked <= self.fails:
            raise KeyError("models")
        return {"models": []}


async def test_the_watchdog_and_status_loops_go_on_after_a_pass_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A health check that raises is no ping (not knowing is not healthy), said, and the loop
    goes on: the pings resume once it answers. STATUS= goes on being told likewise."""
    monkeypatch.setattr(systemd, "STATUS_EVERY_S", 0.01)
    notes, registry = Notes(), FlakyRegistry(fails=3)
    supervisor = systemd.Supervisor(notes, registry)  # type: ignore[arg-type]
    supervisor._ready_sent = True
    caplog.set_level(logging.WARNING, logger=systemd.log.name)
    tasks = [
        asyncio.create_task(supervisor._watchdog_loop(0.02)),
        asyncio.create_task(supervisor._status_loop()),
    ]
    try:
        await _until(lambda: notes.pings >= 3 and len(notes.statuses) >= 3)
        assert registry.beats >= 6
        assert registry.asked >= 6
        assert not any(task.done() for task in tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert notes.statuses[0] == "0/0 models ready"
    messages = [r.getMessage() for r in caplog.records]
    assert "not pinging the systemd watchdog: the health check failed: KeyError: 'm'" in messages
    assert "healthy again: watchdog pings resumed" in messages
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["'models'"]
