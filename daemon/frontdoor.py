"""The listening socket's guards: a deadline for a request's head (slow-loris) and a connection cap."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from aiohttp import web

log = logging.getLogger(__name__)

_HEAD_END: Final = b"\r\n\r\n"


class _Guarded(asyncio.Protocol):
    """Wraps aiohttp's protocol: closes a connection whose first request head is late."""

    def __init__(self, inner: asyncio.Protocol, site: GuardedSite) -> None:
        self._inner = inner
        self._site = site
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        site = self._site
        site.open_connections += 1
        if site.open_connections > site.max_connections:
            log.warning("connection refused: %d connections open (server.max_connections)",
                        site.open_connections - 1)
            transport.close()
        else:
            self._timer = asyncio.get_running_loop().call_later(site.header_timeout, self._expire)
        self._inner.connection_made(transport)

    def _expire(self) -> None:
        peer = self._transport.get_extra_info("peername") if self._transport else None
        log.warning("connection from %s closed: no complete request head within %.1f s",
                    peer[0] if peer else "?", self._site.header_timeout)
        if isinstance(self._transport, asyncio.Transport):
            self._transport.abort()
        elif self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            # Only the first head is timed; later ones on a kept-alive connection fall under
            # aiohttp's keep-alive timeout.
            seen = self._tail + data
            if _HEAD_END in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._site.open_connections -= 1
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class GuardedSite(web.TCPSite):
    """A TCP site whose connections get a request-head deadline and a cap on their number."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, header_timeout: float,
                 max_connections: int, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.open_connections = 0

    async def start(self) -> None:
        """Listen, wrapping every connection's protocol in the guard."""
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None  # noqa: S101 - the runner is set up before its sites start
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Guarded(server(), self), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address, reuse_port=self._reuse_port)
