"""The console's live figures: a bounded history sampled in the daemon, and one event stream per session.

One sampler task reads the cheap figures (tokens generated, time to first token, queue depth,
busy slots, the GPU monitor's last reading) every `console.stream_interval_s` into a ring
that holds `console.history_s` seconds, and notes every load, reload and unload it sees in a
bounded reload history. Each signed-in page holds one event stream: it gets the history
once, then, at each tick, the overview as /readyz, /admin/status and /admin/stats build
it (their own handlers are called, so the page shows exactly their figures). A stream
ends when its session ends (sign-out, expiry, key revoked, shutdown) or when the same
session opens another one (a reloaded page).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from edgellmd import __version__
from edgellmd.api import admin, health
from edgellmd.api.context import API_CONTEXT, ApiContext, context
from edgellmd.api.sse import SSE_HEADERS, dumps, event
from edgellmd.http import appkeys
from edgellmd.http.console.sessions import (
    CONSOLE_SESSION,
    KEY_NO_LONGER_VALID,
    SESSIONS,
    ConsoleSession,
    current_key,
)
from edgellmd.models.lockfile import LockError, format_time, key_id, load_lock, load_public_key, verify_lock
from edgellmd.settings import Settings

log = logging.getLogger(__name__)

RELOAD_HISTORY: Final = 50  # loads, reloads and unloads the page lists
EXPIRY_WARNING_S: Final = 14 * 86400  # a lockfile that expires sooner than this is shown as a warning
Figures = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Sample:
    """The figures of one tick: what the charts draw."""

    t: float  # wall clock
    tokens_per_s: float  # generated tokens over the tick, every model
    ttft_s: float | None  # mean time to first token of the generations that began in the tick
    queue: int  # requests waiting for a slot, every model
    busy: int  # slots generating
    gpus: tuple[dict[str, float | int | None], ...]  # per GPU: util %, memory bytes, °C, W


def _family_sums(collected: Iterable[Any], *suffixes: str) -> dict[str, float]:
    """Sum a prometheus family's samples by name suffix (`_total`, `_sum`, `_count`) over its labels."""
    sums = dict.fromkeys(suffixes, 0.0)
    for family in collected:
        for sample in family.samples:
            for suffix in suffixes:
                if sample.name.endswith(suffix):
                    sums[suffix] += sample.value
    return sums


class Feed:
    """The sampler: a bounded ring of samples, the reload history, and a tick the streams wait on."""

    def __init__(self, app: web.Application, *, interval_s: float, history_s: int) -> None:
        self._app = app
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=max(2, int(history_s / interval_s)))
        self.reloads: deque[dict[str, Any]] = deque(maxlen=RELOAD_HISTORY)
        self._seen: set[tuple[str, float]] = set()  # (model, at) of outcomes already in `reloads`
        self._tick = asyncio.Event()
        self._last: tuple[float, float, float, float] | None = None  # clock, tokens, ttft sum, count
        self.started, self.started_at = time.monotonic(), time.time()  # with the app: the daemon's start

    def _sample(self, ctx: ApiContext) -> Sample:
        now = time.monotonic()
        tokens = _family_sums(ctx.metrics.completion_tokens.collect(), "_total")["_total"]
        ttft = _family_sums(ctx.metrics.ttft.collect(), "_sum", "_count")
        last, self._last = self._last, (now, tokens, ttft["_sum"], ttft["_count"])
        rate, mean_ttft = 0.0, None
        if last is not None and now > last[0]:
            rate = max(0.0, tokens - last[1]) / (now - last[0])
            started = ttft["_count"] - last[3]
            if started > 0:
                mean_ttft = (ttft["_sum"] - last[2]) / started
        status = ctx.registry.status()
        self._note_reloads(status["models"])
        snapshot = ctx.gpu.latest if ctx.gpu is not None else None
        gpus = tuple(
            {
                "index": gpu.index,
                "util": gpu.utilization_gpu,
                "memory_used": gpu.memory_used,
                "memory_total": gpu.memory_total,
                "temperature": gpu.temperature_c,
                "power": gpu.power_w,
            }
            for gpu in (snapshot.devices if snapshot is not None else ())
            if not gpu.lost
        )
        return Sample(
            t=time.time(),
            tokens_per_s=round(rate, 3),
            ttft_s=None if mean_ttft is None else round(mean_ttft, 4),
            queue=sum(m.get("queue_depth", 0) for m in status["models"]),
            busy=sum(m.get("slots_busy", 0) for m in status["models"]),
            gpus=gpus,
        )

    def _note_reloads(self, models: list[dict[str, Any]]) -> None:
        for model in models:
            last = model.get("last_reload")
            if last is None or (last["model"], last["at"]) in self._seen:
                continue
            self._seen.add((last["model"], last["at"]))
            self.reloads.appendleft(last)  # newest first, as the page lists them
        if len(self._seen) > 4 * RELOAD_HISTORY:
            self._seen = {(r["model"], r["at"]) for r in self.reloads}

    def sample_now(self) -> None:
        """Take one sample now (each tick; an action's outcome also shows at once)."""
        ctx = self._app.get(API_CONTEXT)
        if ctx is None:  # the app is still starting
            return
        self.samples.append(self._sample(ctx))
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def run(self) -> None:
        """Sample every interval until cancelled."""
        while True:
            try:
                self.sample_now()
            except Exception:  # a bug here must not end the console's figures; log and go on
                log.exception("console sampler failed; trying again at the next tick")
            await asyncio.sleep(self.interval_s)

    async def next_tick(self) -> None:
        """Wait for the next sample."""
        await self._tick.wait()

    def history(self) -> dict[str, Any]:
        """The whole ring, for a page that just connected."""
        return {
            "interval_s": self.interval_s,
            "history_s": self.interval_s * (self.samples.maxlen or 0),
            "samples": [asdict(s) for s in self.samples],
        }

    def latest(self) -> dict[str, Any] | None:
        """The newest sample."""
        return asdict(self.samples[-1]) if self.samples else None


class LockInfo:
    """What the page shows of the lockfile: version, signers, expiry; read again only when a file changes."""

    def __init__(self, settings: Settings) -> None:
        self._lock = settings.lock
        self._cached: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def _identity(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for path in (self._lock.file, *self._lock.trusted_keys):
            try:
                st = os.stat(path) if path is not None else None
            except OSError:
                st = None
            out.append(None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def read(self) -> dict[str, Any]:
        """The lockfile's facts (blocking: files are read; call it off the loop)."""
        if self._lock.allow_unsigned or self._lock.file is None:
            return {"unsigned": True}
        identity = self._identity()
        if self._cached is None or self._cached[0] != identity:
            self._cached = (identity, self._read(self._lock.file, self._lock.trusted_keys))
        facts = dict(self._cached[1])
        expires = facts.get("expires_at")
        if expires is not None:
            left = expires - time.time()
            facts["expires_in_s"] = left
            facts["expiry_warning"] = left < EXPIRY_WARNING_S
        return facts

    @staticmethod
    def _read(path: Path, trusted_paths: tuple[Path, ...]) -> dict[str, Any]:
        try:
            lock = load_lock(path)
        except LockError as exc:
            return {"unsigned": False, "file": str(path), "problem": str(exc)}
        trusted: dict[str, Any] = {}
        for key_path in trusted_paths:
            with contextlib.suppress(LockError):
                key = load_public_key(key_path)
                trusted[key_id(key)] = key
        try:
            verified: str | None = verify_lock(lock, list(trusted.values()))
            problem = None
        except LockError as exc:
            verified, problem = None, str(exc)
        return {
            "unsigned": False,
            "file": str(path),
            "version": lock.version,
            "issued": format_time(lock.issued) if lock.issued else None,
            "expires": format_time(lock.expires) if lock.expires else None,
            "expires_at": lock.expires.timestamp() if lock.expires else None,
            "signers": [
                {"key_id": s.key_id, "trusted": s.key_id in trusted, "verified": s.key_id == verified}
                for s in lock.signatures
            ],
            "problem": problem,
        }


def _body(response: web.StreamResponse) -> Any:
    """The JSON document of an answer built by another adapter's handler."""
    body = response.body if isinstance(response, web.Response) else None
    if not isinstance(body, bytes):  # json_response always has bytes: anything else is a bug here
        raise TypeError("expected a JSON answer")
    return json.loads(body)


def _local_address(request: web.Request) -> str:
    """The address this page reached the daemon at (host:port; IPv6 in brackets)."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return request.host
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


async def overview(request: web.Request) -> dict[str, Any]:
    """What the overview shows, built by the handlers of /readyz, /admin/status and /admin/stats."""
    feed = request.app[FEED]
    stats = _body(await admin.stats(request))
    lock = await asyncio.to_thread(request.app[LOCK_INFO].read)
    return {
        "at": datetime.now(UTC).timestamp(),
        "ready": _body(await health.readyz(request)),
        "status": _body(await admin.status(request)),
        "host": stats["host"],
        "gpu": stats["gpu"],
        "build": stats["build"],
        "lockfile": lock,
        "reloads": list(feed.reloads),
        "sample": feed.latest(),
        "daemon": {
            "version": __version__,
            "started_at": feed.started_at,
            "uptime_s": round(time.monotonic() - feed.started, 1),
            "address": _local_address(request),
        },
    }


async def _first(*waits: asyncio.Future[Any]) -> None:
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)


def _no_longer_admin(request: web.Request, session: ConsoleSession) -> str | None:
    """Why the stream must end at this tick, judged on the session's key as it is now (a
    keys file reloaded since the stream began may have revoked it or taken its scope)."""
    key = current_key(request.app[appkeys.KEY_STORE], session)
    if key is None:
        return KEY_NO_LONGER_VALID
    if "admin" not in key.scopes:
        return "the API key of this session no longer has the 'admin' scope"
    return None


async def events(request: web.Request) -> web.StreamResponse:
    """GET /ui/api/events: the history once, then the overview at every tick, until the session ends."""
    session = request[CONSOLE_SESSION]
    sessions = request.app[SESSIONS]
    feed = request.app[FEED]
    ctx = context(request)
    stop = session.claim_stream()
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    write_timeout = ctx.settings.server.stream_write_timeout_s
    ended = asyncio.ensure_future(session.ended.wait())
    stopped = asyncio.ensure_future(stop.wait())
    reason = "replaced by a newer stream of this session"

    async def write(data: bytes) -> None:
        async with asyncio.timeout(write_timeout):  # a page that stops reading is cut
            await response.write(data)

    try:
        await write(event("history", feed.history()))
        while not stop.is_set():
            gone = _no_longer_admin(request, session)
            if gone is not None:
                reason = gone
                break
            await write(event("overview", await overview(request)))
            sessions.watched(session)  # written: somebody reads it (kiosk: it keeps the session)
            tick = asyncio.ensure_future(feed.next_tick())
            try:
                await _first(tick, ended, stopped)
            finally:
                tick.cancel()
        if session.end_reason is not None:
            reason = session.end_reason
        await write(b"event: end\ndata: " + dumps({"reason": reason}) + b"\n\n")
        await response.write_eof()
    except (ConnectionResetError, TimeoutError):
        log.info("console event stream ended by its client")
    finally:
        ended.cancel()
        stopped.cancel()
        if session.stream is stop:
            session.stream = None
    return response


def _feed_ctx(feed: Feed) -> Any:
    async def feed_ctx(_app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(feed.run(), name="console-feed")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return feed_ctx


def setup_live(app: web.Application, settings: Settings) -> None:
    """The sampler (one cleanup context) and what the event streams read."""
    console = settings.console
    feed = Feed(app, interval_s=console.stream_interval_s, history_s=console.history_s)
    app[FEED] = feed
    app[LOCK_INFO] = LockInfo(settings)
    app.cleanup_ctx.append(_feed_ctx(feed))


FEED: Final = web.AppKey("console_feed", Feed)
LOCK_INFO: Final = web.AppKey("console_lock_info", LockInfo)
