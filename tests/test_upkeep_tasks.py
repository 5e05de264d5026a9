"""The daemon's background upkeep outlives a pass that raises: the ledger's (hours sealed,
failed commits retried, retention) and the console's (sessions of revoked keys ended). Before,
one exception ended the task with nothing said: no hour was sealed again, a failing ledger was
never retried, a revoked key's console session went on."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Any

import pytest
from aiohttp import web

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
