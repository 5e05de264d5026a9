"""Run a real edgellmd application on a loopback port in a background thread, for tests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from edgellmd.app import create_app, start_server
from edgellmd.settings import Settings, parse_settings


def settings_for(models: list[dict[str, Any]], server: dict[str, Any] | None = None,
                 base_dir: Path | None = None, lock: dict[str, Any] | None = None,
                 lifecycle: dict[str, Any] | None = None,
                 auth: dict[str, Any] | None = None) -> Settings:
    """Settings from plain dicts, as a YAML file would give them (the test server picks its own port)."""
    data: dict[str, Any] = {"server": {**(server or {})}, "models": models,
                            "logging": {"level": "debug", "format": "text"},
                            "lock": lock or {"allow_unsigned": True},
                            "lifecycle": lifecycle, "auth": auth}
    return parse_settings(data, base_dir=base_dir or Path.cwd())


class RunningDaemon:
    """A daemon serving in its own thread and event loop; `url` is its base address."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="test-daemon", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._stop())
        self.loop.close()

    async def _start(self) -> None:
        self.app = create_app(self.settings)
        self._runner = await start_server(self.app, "127.0.0.1", 0)
        addresses = self._runner.addresses
        self.port = addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def shrink_send_buffers(self, size: int) -> None:
        """Give connections accepted from now on a small kernel send buffer (Linux inherits it
        from the listening socket), so that a client that stops reading blocks the server fast."""
        assert self._runner is not None
        for site in self._runner.sites:
            server = site._server  # aiohttp keeps the asyncio server private
            assert server is not None
            for sock in server.sockets:  # type: ignore[attr-defined] # an asyncio Server here
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:41234."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait_ready: bool = True, timeout: float = 60.0) -> RunningDaemon:
        """Start serving; by default wait until /readyz says 200."""
        self._thread.start()
        self._started.wait(timeout)
        if self._error is not None:
            raise RuntimeError("daemon failed to start") from self._error
        if wait_ready:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                status, _ = self.get("/readyz")
                if status == 200:
                    return self
                time.sleep(0.05)
            raise TimeoutError("daemon did not become ready")
        return self

    def stop(self) -> None:
        """Shut down and free the models."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(60)

    def get(self, path: str) -> tuple[int, Any]:
        """A plain GET (stdlib client) returning (status, parsed JSON body)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:  # noqa: S310 - loopback URL
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def post(self, path: str, body: Any, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """A plain POST of JSON (or raw bytes) returning (status, parsed JSON body)."""
        data = raw if raw is not None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, headers=hdrs, method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback URL
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


@contextmanager
def running(settings: Settings, *, wait_ready: bool = True) -> Iterator[RunningDaemon]:
    """Serve `settings` for the duration of a with-block."""
    daemon = RunningDaemon(settings).start(wait_ready=wait_ready)
    try:
        yield daemon
    finally:
        daemon.stop()
