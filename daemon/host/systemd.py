"""systemd integration: READY/STATUS/RELOADING/STOPPING/EXTEND_TIMEOUT, and an honest watchdog.

sdnotify's SystemdNotifier silently drops every message when NOTIFY_SOCKET was unset when it
was built and swallows send errors; this wrapper builds it only when the socket is set, in
its raising mode, and logs failures (once per kind) instead of hiding them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import sdnotify

from edgellmd.host.upkeep import PassFailures

log = logging.getLogger(__name__)

STATUS_EVERY_S: Final = 10.0  # STATUS= refresh while nothing else changes
EXTEND_EVERY_S: Final = 10.0  # while a load runs, ask for this much more start/reload time ...
EXTEND_BY_S: Final = 30.0  # ... each time
USEC: Final = 1_000_000
MAX_PROBLEM_CHARS: Final = 160  # of a problem in STATUS= (a database error's text)


class Notifier:
    """Messages to systemd's notify socket; a quiet no-op when not started by systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self._sd: sdnotify.SystemdNotifier | None = None
        self._failed: set[str] = set()
        self.sent: list[str] = []  # every message, for diagnostics
        if self.address is not None:
            try:
                _probe(self.address)  # sdnotify would leak its socket when this fails
                self._sd = sdnotify.SystemdNotifier(debug=True)  # reads NOTIFY_SOCKET itself
            except OSError as exc:
                log.error("cannot reach systemd's notify socket %s: %s", self.address, exc.strerror or exc)  # noqa: TRY400
        self.watchdog_s = _watchdog_interval(env)

    def close(self) -> None:
        """Close the socket (no message can be sent afterwards)."""
        if self._sd is not None and self._sd.socket is not None:
            self._sd.socket.close()
        self._sd = None

    @property
    def enabled(self) -> bool:
        """True when messages reach systemd."""
        return self._sd is not None

    def send(self, *fields: str) -> bool:
        """Send one message of `KEY=value` fields; False (logged once per kind) when it fails."""
        if self._sd is None:
            return False
        message = "\n".join(fields)
        try:
            self._sd.notify(message)
        except OSError as exc:
            kind = fields[0].split("=", 1)[0]
            if kind not in self._failed:
                self._failed.add(kind)
                log.error("systemd notify %s failed: %s", kind, exc.strerror or exc)  # noqa: TRY400
            return False
        self.sent.append(message)
        return True

    def ready(self, status: str) -> None:
        """The service is up (after start or after a reload)."""
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        """A one-line summary for `systemctl status`."""
        self.send(f"STATUS={status}")

    def reloading(self) -> None:
        """A reload starts (systemd requires the monotonic timestamp with it)."""
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for more time for the current start, reload or stop."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * USEC)}")

    def stopping(self) -> None:
        """Shutdown begins."""
        self.send("STOPPING=1", "STATUS=stopping: draining in-flight requests")

    def watchdog(self) -> None:
        """The service is healthy."""
        self.send("WATCHDOG=1")


def _probe(address: str) -> None:
    """Connect to the notify socket once, raising OSError when nobody listens there."""
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(target)


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """WATCHDOG_USEC in seconds when it is meant for this process (WATCHDOG_PID), else None."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", str(os.getpid())))
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC/WATCHDOG_PID")
        return None
    if usec <= 0 or pid != os.getpid():
        return None
    return usec / USEC


class Supervised(Protocol):
    """What the supervisor reads of the served models (models.registry.Registry is one)."""

    @property
    def all_ready(self) -> bool:
        """Every model that should serve is loaded and warm."""

    def status(self) -> dict[str, Any]:
        """The admin status document."""

    def heartbeats(self) -> list[tuple[str, float]]:
        """(model, monotonic time its scheduler last showed progress) of every serving model."""

    def observe(self, callback: Callable[[str, Sequence[object]], None]) -> None:
        """Call `callback(event, outcomes)` on "reload_started", "reload_finished" and
        "model_stopped" (an engine stopped by itself)."""


def _cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters with an ellipsis saying it goes on."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summary(registry: Supervised, problems: Sequence[str] = ()) -> str:
    """`2/2 models ready; tiny v7 1/4 busy; last reload: tiny loaded` — for STATUS=; what else
    keeps the daemon from serving (`problems`: a failing ledger, which /readyz reports) first."""
    status = registry.status()
    models = status["models"]
    ready = [m for m in models if m["state"] == "ready"]
    parts = [_cut(problem, MAX_PROBLEM_CHARS) for problem in problems]
    parts.append(f"{len(ready)}/{len(models)} models ready")
    for m in models:
        if m["state"] == "ready":
            version = f" v{m['version']}" if m.get("version") is not None else ""
            parts.append(f"{m['name']}{version} {m['slots_busy']}/{m['slots_total']} busy")
        else:
            parts.append(f"{m['name']} {m['state']}" + (f" ({m['reason'][:80]})" if m.get("reason") else ""))
    lasts = [m["last_reload"] for m in models if m.get("last_reload")]
    if lasts:
        last = max(lasts, key=lambda r: r["at"])
        parts.append(f"last reload: {last['model']} {last['result']}")
    return "; ".join(parts)


class Supervisor:
    """Drives the notifier from the registry's life and runs the watchdog pings."""

    def __init__(
        self, notifier: Notifier, registry: Supervised, problems: Callable[[], Sequence[str]] = tuple
    ) -> None:
        self.notifier = notifier
        self.registry = registry
        self.problems = problems  # what else /readyz refuses for, said first in STATUS=
        self._ready_sent = False
        self._unhealthy_logged = False
        self._tasks: list[asyncio.Task[None]] = []
        self._extending: asyncio.Task[None] | None = None

    def start(self, load_task: asyncio.Task[None]) -> None:
        """Begin: extend the start timeout while models load, then READY=1 once all are warm."""
        watchdog = self.notifier.watchdog_s
        if self.notifier.enabled:
            log.info(
                "systemd notify socket in use%s",
                f"; watchdog ping every {watchdog / 2:.1f}s" if watchdog else "",
            )
        self.registry.observe(self._on_registry)
        self._tasks.append(asyncio.create_task(self._startup(load_task), name="systemd-startup"))
        self._tasks.append(asyncio.create_task(self._status_loop(), name="systemd-status"))
        if self.notifier.watchdog_s is not None:
            self._tasks.append(
                asyncio.create_task(self._watchdog_loop(self.notifier.watchdog_s), name="systemd-watchdog")
            )

    async def stop(self) -> None:
        """Cancel the background tasks."""
        if self._extending is not None:
            self._tasks.append(self._extending)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _startup(self, load_task: asyncio.Task[None]) -> None:
        while not load_task.done():
            self.notifier.extend_timeout(EXTEND_BY_S)
            await asyncio.wait({load_task}, timeout=EXTEND_EVERY_S)
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        text = summary(self.registry, self.problems())
        if self.registry.all_ready:
            self.notifier.ready(text)
            self._ready_sent = True
        else:
            self.notifier.status(text)

    def _on_registry(self, event: str, outcomes: Sequence[object]) -> None:
        if event == "reload_started":
            if self._ready_sent:
                self.notifier.reloading()
            # A reload may verify and copy gigabytes: keep asking for time while it runs.
            self._extending = asyncio.get_running_loop().create_task(self._extend_while_reloading())
        elif event == "reload_finished":
            if self._extending is not None:
                self._extending.cancel()
                self._extending = None
            if self._ready_sent or outcomes:
                self._maybe_ready()  # after a reload; or models that failed at start came back
        elif event == "model_stopped" and self._ready_sent:
            self.notifier.status(summary(self.registry, self.problems()))  # which model stopped, why

    async def _extend_while_reloading(self) -> None:
        while True:
            self.notifier.extend_timeout(EXTEND_BY_S)
            await asyncio.sleep(EXTEND_EVERY_S)

    async def _status_loop(self) -> None:
        failures = PassFailures(log)
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            if not self._ready_sent:
                continue
            try:
                self.notifier.status(summary(self.registry, self.problems()))
            except Exception as exc:  # noqa: BLE001 - logged; STATUS= goes on being told
                failures.failed(
                    exc, "telling systemd the status failed; tried again in %.0f s", STATUS_EVERY_S
                )
            else:
                failures.passed()

    def healthy(self, now: float, window: float) -> str | None:
        """Why the daemon must not ping the watchdog now, or None when it may."""
        for name, heartbeat in self.registry.heartbeats():
            silent = now - heartbeat
            if silent > window:
                return f"the scheduler of model {name} has shown no progress for {silent:.1f}s"
        return None

    async def _watchdog_loop(self, timeout_s: float) -> None:
        # Pinging at half the timeout from the event loop proves the loop runs; the heartbeat
        # check proves every scheduler thread finished a step or idled within the timeout.
        interval = timeout_s / 2
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            lag = loop.time() - due
            if not self._ready_sent:
                continue  # systemd arms the watchdog once start-up completed (READY=1)
            try:
                problem = self.healthy(time.monotonic(), timeout_s)
            except Exception as exc:  # the loop must go on: not knowing is no ping, and said
                log.debug("the health check raised", exc_info=True)
                problem = f"the health check failed: {type(exc).__name__}: {exc}"
            if problem is None and lag > interval:
                problem = f"the event loop was blocked for {lag:.1f}s"
            if problem is None:
                self.notifier.watchdog()
                if self._unhealthy_logged:
                    log.warning("healthy again: watchdog pings resumed")
                    self._unhealthy_logged = False
            elif not self._unhealthy_logged:
                log.error("not pinging the systemd watchdog: %s", problem)
                self._unhealthy_logged = True
