"""The listening socket's guards: a deadline at every stage of a connection, connection caps, parser refusals.

Each connection is served by `FrontDoorHandler`, a small subclass of aiohttp's protocol that
reads two of its private members (`check_internals` fails start-up loudly if they change).
Deadlines, caps, expectations and refusals, each in detail: docs/internals.md, "The
listening socket's guards".
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import json
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from aiohttp import hdrs, web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.http_parser import RawRequestMessage
from multidict import CIMultiDict

from edgellmd.errors import ApiError, ExpectationFailed, MalformedRequest, RequestTimeout, envelope
from edgellmd.http import logs

if TYPE_CHECKING:
    from aiohttp.streams import StreamReader
    from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)

_HEAD_END: Final = b"\r\n\r\n"
_HEAD: Final = "head"
_BODY: Final = "body"
CUT_GRACE_S: Final = 2.0  # after a body deadline: time to send the 408 before the connection is cut
REFUSAL_LOG_INTERVAL_S: Final = 10.0  # at most one line this often per cap; the rest are counted
_IPV6_CLIENT_PREFIX: Final = 64
_TLS_ON_PLAIN_PORT: Final = "Received HTTPS traffic on an HTTP port"  # aiohttp's own text
_TOO_MANY_HEADERS: Final = "Too many headers"  # the start of aiohttp's own text
# What the front door overrides or calls in aiohttp's RequestHandler, with the parameters it
# expects; check_internals compares them with the installed aiohttp.
_RELIED_ON: Final = {
    "connection_made": ("self", "transport"),
    "connection_lost": ("self", "exc"),
    "data_received": ("self", "data"),
    "finish_response": ("self", "request", "resp", "start_time"),
    "handle_error": ("self", "request", "status", "exc", "message"),
    "close": ("self",),
    "keep_alive": ("self", "val"),
}


@dataclass(frozen=True, slots=True)
class DoorLimits:
    """The deadlines and caps a GuardedSite applies (server.* settings)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_connections_per_client: int


def client_address(peername: object) -> str:
    """The address a connection counts under: IPv4 (mapped ones too), or an IPv6 /64."""
    host = peername[0] if isinstance(peername, tuple) and peername else peername
    if not isinstance(host, str) or not host:
        return "?"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if not address.is_loopback:
            return str(ipaddress.IPv6Network((address, _IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


class Door:
    """The site's connection census: the caps, and a throttled line for each kind of refusal."""

    def __init__(self, limits: DoorLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self.open = 0
        self.by_client: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._quiet_until: dict[str, float] = {}

    def admit(self, client: str) -> bool:
        """Count a new connection from `client`, or refuse it (False) when a cap is reached."""
        if self.open >= self.limits.max_connections:
            self._refused(client, "max_connections", self.open, "in all")
            return False
        held = self.by_client[client]
        if held >= self.limits.max_connections_per_client:
            self._refused(client, "max_connections_per_client", held, "from that client")
            return False
        self.open += 1
        self.by_client[client] = held + 1
        return True

    def release(self, client: str) -> None:
        """Forget a connection admitted earlier."""
        self.open -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]

    def _refused(self, client: str, setting: str, held: int, where: str) -> None:
        # A flood of refused connections must not become a flood of log lines.
        self._unlogged[setting] += 1
        now = self._clock()
        if now < self._quiet_until.get(setting, -math.inf):
            return
        count = self._unlogged.pop(setting)
        more = f"; {count - 1} more refused since the last such line" if count > 1 else ""
        log.warning(
            "connection from %s refused: %d connections open %s (server.%s)%s",
            client,
            held,
            where,
            setting,
            more,
        )
        self._quiet_until[setting] = now + REFUSAL_LOG_INTERVAL_S


def check_internals(probe: web.RequestHandler | None = None) -> None:
    """Fail loudly if aiohttp's RequestHandler (or `probe`, one made) lacks what the front door relies on."""
    slots = getattr(web.RequestHandler, "__slots__", ())
    problems = [f"RequestHandler.{s} is gone" for s in ("_messages", "_request_handler") if s not in slots]
    if not problems and probe is not None:
        messages: object = probe._messages  # typed as a deque, and checked to be one
        if not isinstance(messages, deque):
            problems.append("RequestHandler._messages is no longer a deque")
    for name, expected in _RELIED_ON.items():
        method = getattr(web.RequestHandler, name, None)
        found = tuple(inspect.signature(method).parameters) if callable(method) else None
        if found != expected:
            problems.append(f"RequestHandler.{name}{found or ''} is not {name}{expected}")
    if problems:
        raise RuntimeError(
            f"aiohttp {aiohttp.__version__} changed what edgellmd's front door "
            f"(daemon/http/site.py) relies on: {'; '.join(problems)}"
        )


UNMET_EXPECTATION: Final = web.RequestKey("unmet_expectation", bool)


def meet_expectations(
    handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
) -> Callable[[BaseRequest], Awaitable[web.StreamResponse]]:
    """The app's entry, for requests whose `Expect` aiohttp would refuse itself: without the
    header, marked UNMET_EXPECTATION (100-continue, and an empty header, pass as they are)."""

    async def handle(request: BaseRequest) -> web.StreamResponse:
        expect = request.headers.get(hdrs.EXPECT)
        if not expect or expect.strip().lower() == "100-continue":
            return await handler(request)
        headers = CIMultiDict(request.headers)
        del headers[hdrs.EXPECT]
        unmet = request.clone(headers=headers)
        unmet[UNMET_EXPECTATION] = True
        response = await handler(unmet)
        # Prepared with the clone, which the app routed: its response hooks (the request id,
        # the security headers) run for it. aiohttp's own prepare then finds it done.
        if not response.prepared:
            await response.prepare(unmet)
        return response

    return handle


@web.middleware
async def refuse_unmet_expectations(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """417 in the error envelope for a request the front door marked (nothing of it echoed)."""
    if request.get(UNMET_EXPECTATION):
        raise ExpectationFailed("the request's Expect header names an expectation this server cannot meet")
    return await handler(request)


def _refusal(exc: HttpProcessingError, handler: web.RequestHandler) -> tuple[str, str]:
    """(code, text) for a parser error: a fixed description of its kind, never its message."""
    if isinstance(exc, LineTooLong):
        limit = max(handler.max_line_size, handler.max_field_size)
        return "request_head_too_large", f"the request line or a header is longer than {limit} bytes"
    if exc.message.startswith(_TOO_MANY_HEADERS):
        return "request_head_too_large", f"more than {handler.max_headers} headers"
    if isinstance(exc, BadHttpMethod):
        if exc.message == _TLS_ON_PLAIN_PORT:
            return "malformed_request", "this is not HTTP (TLS sent to a plain-HTTP port?)"
        return "malformed_request", "the method is not valid"
    if isinstance(exc, InvalidURLError):
        return "malformed_request", "the request target is not valid"
    if isinstance(exc, BadStatusLine):
        return "malformed_request", "the request line is not valid"
    if isinstance(exc, ContentEncodingError):
        return "malformed_request", "the body's content encoding is not valid"
    if isinstance(exc, PayloadEncodingError):
        return "malformed_request", "the body's framing is not valid"
    # aiohttp's C parser raises a plain BadHttpMessage for nearly every header problem (bad
    # characters, bare LF, folding, Content-Length with Transfer-Encoding), and for a broken
    # chunk that came in the same read as its head.
    return "malformed_request", "a header or the body's framing is not valid"


class FrontDoorHandler(web.RequestHandler):
    """aiohttp's protocol, plus per-stage deadlines, the connection caps and generic refusals."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        door: Door,
        headers: Mapping[str, str],
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        if self._request_handler is not None:
            self._request_handler = meet_expectations(self._request_handler)
        self._door = door
        self._answer_headers = headers
        self._clock = loop
        self._client = "?"  # what the caps count it under
        self._peer = "?"  # its address, for log lines
        self._admitted = False
        self._cut = False  # refused, or past a deadline: nothing more is read
        self._parsed_n = 0  # requests parsed so far (parser refusals too)
        self._answered_n = 0  # of which answered (in order: HTTP/1.1 answers in request order)
        self._answered_at = -math.inf  # when the last answer ended
        self._head_since: float | None = None  # bytes of an incomplete head seen since then
        self._body: StreamReader | None = None  # the last parsed request's incomplete body
        self._body_of = 0  # which request (its _parsed_n) that body belongs to
        self._body_since = 0.0
        self._framing = _HEAD  # how the last parsed request ends: head, chunked or length
        self._tail = b""  # the last bytes received, to spot a head end split across reads
        self._armed: tuple[str, float] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._grace: asyncio.TimerHandle | None = None

    # -- the connection's life

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection (or close it at once) and start the first head's deadline."""
        peername = transport.get_extra_info("peername")
        self._client = client_address(peername)
        self._peer = str(peername[0]) if isinstance(peername, tuple) and peername else self._client
        if not self._door.admit(self._client):
            self._cut = True
            _abort(transport)
            return  # aiohttp never sees it
        self._admitted = True
        super().connection_made(transport)
        self._head_since = self._clock.time()  # a silent connection is a head that never comes
        self._rearm()

    def connection_lost(self, exc: BaseException | None) -> None:
        """Stop the deadlines and give the connection's place back."""
        for timer in (self._timer, self._grace):
            if timer is not None:
                timer.cancel()
        self._timer = self._grace = None
        if not self._admitted:
            return
        self._admitted = False
        self._door.release(self._client)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Parse as aiohttp does, then note which stage the connection is in."""
        if self._cut:
            return
        messages = self._messages
        before = len(messages)
        body_was_open = self._body is not None
        super().data_received(data)
        now = self._clock.time()
        for i in range(before, len(messages)):
            message, payload = messages[i]
            self._parsed(message, payload, now)
        if self._body is not None and self._body.is_eof():
            self._body = None
        if data and self._body is None and not self._cut:
            if not body_was_open and len(messages) == before:
                partial = True  # every byte was a head's
            elif self._framing == "length":
                # Where a Content-Length body ended in this read is not known here: bytes of
                # a pipelined head behind it wait under the keep-alive timeout instead.
                partial = False
            else:  # after a head or a chunked body, which both end in a blank line
                partial = not (self._tail + data[-len(_HEAD_END) :]).endswith(_HEAD_END)
            if partial and self._head_since is None:
                self._head_since = now
                if self._answered_n >= self._parsed_n:
                    # No longer idle: aiohttp's keep-alive timer would cut this head at its
                    # own time; the head's deadline is the one that applies now.
                    self.keep_alive(True)
        self._tail = (self._tail + data[-len(_HEAD_END) :])[-len(_HEAD_END) + 1 :]
        self._rearm()

    def _parsed(self, message: object, payload: StreamReader, now: float) -> None:
        self._parsed_n += 1
        self._head_since = None
        if not isinstance(message, RawRequestMessage):  # aiohttp's record of a parser error
            if self._body is not None and not self._body.is_eof():
                self._refuse_body(message)  # the error is in the body being received
            self._body = None
            return
        if message.upgrade:
            self.close()  # nothing here speaks another protocol: answer this request, then close
        # Framed by its own kind whether or not its body came whole in the same read: a
        # Content-Length body that did (a small POST in one write) ends where no blank line is.
        if message.chunked:
            self._framing = "chunked"
        else:
            length = message.headers.get(hdrs.CONTENT_LENGTH, "")
            self._framing = "length" if length.isdigit() and int(length) > 0 else _HEAD
        if payload.is_eof():
            self._body = None
        else:
            self._body, self._body_of, self._body_since = payload, self._parsed_n, now

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """Send the answer as aiohttp does; its end starts the clocks of what was waiting."""
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answered_n += 1
            self._answered_at = self._clock.time()
            if self._admitted and not self._cut:
                self._rearm()

    # -- deadlines

    def _stage(self) -> tuple[str, float] | None:
        """The stage whose deadline runs, and since when; None while answers are pending or idle."""
        if self._body is not None:
            if self._answered_n < self._body_of - 1:
                return None  # an earlier request is still being answered
            return _BODY, max(self._body_since, self._answered_at)
        if self._head_since is not None and self._answered_n >= self._parsed_n:
            return _HEAD, max(self._head_since, self._answered_at)
        return None

    def _rearm(self) -> None:
        stage = self._stage()
        if stage == self._armed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed = stage
        if stage is not None:
            limits = self._door.limits
            limit = limits.header_timeout_s if stage[0] == _HEAD else limits.body_timeout_s
            self._timer = self._clock.call_at(stage[1] + limit, self._expire)

    def _expire(self) -> None:
        self._timer = None
        stage, self._armed = self._armed, None
        limits = self._door.limits
        self._cut = True
        if stage is not None and stage[0] == _BODY and self._body is not None:
            log.warning(
                "connection from %s closed: request body not complete within %.1f s (server.body_timeout_s)",
                self._peer,
                limits.body_timeout_s,
            )
            self._end_body(
                RequestTimeout(
                    f"the request body did not arrive within {limits.body_timeout_s:g} s",
                    headers={"Connection": "close"},
                )
            )
            return
        log.warning(
            "connection from %s closed: no complete request head within %.1f s (server.header_timeout_s)",
            self._peer,
            limits.header_timeout_s,
        )
        if self.transport is not None:
            _abort(self.transport)

    def _refuse_body(self, message: object) -> None:
        exc = getattr(message, "exc", None)  # aiohttp's _ErrInfo carries the parser's exception
        code, text = "malformed_request", "the body's framing is not valid"
        if isinstance(exc, PayloadEncodingError):
            code, text = _refusal(exc, self)
        log.info("request from %s refused: malformed HTTP request: %s", self._peer, text)
        self._cut = True
        self._end_body(
            MalformedRequest(f"malformed HTTP request: {text}", code=code, headers={"Connection": "close"})
        )

    def _end_body(self, error: ApiError) -> None:
        """End the incomplete body: its reader gets `error` (answered by the app), then close."""
        body, self._body = self._body, None
        if body is not None:
            if self._answered_n < self._body_of:  # its request is not answered yet
                body.set_exception(error)
            body.feed_eof()  # no lingering read of the rest; nothing more is fed (self._cut)
        self.close()  # after the answer now being made, if any
        self._grace = self._clock.call_later(CUT_GRACE_S, self._cut_now)

    def _cut_now(self) -> None:
        self._grace = None
        if self.transport is not None:
            _abort(self.transport)

    # -- refusals

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer a request aiohttp could not parse (or whose handler failed) with an envelope."""
        del message  # aiohttp's text quotes the request's bytes
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already being sent; the connection is closed")
        rid = uuid.uuid4().hex
        token = logs.request_id.set(rid)
        try:
            if isinstance(exc, HttpProcessingError):
                status, type_ = 400, "invalid_request_error"
                code, text = _refusal(exc, self)
                text = f"malformed HTTP request: {text}"
                log.info("request from %s refused: %s", self._peer, text)
            else:
                status = status if status >= 500 else 500
                type_, code, text = "server_error", "internal_error", "internal server error"
                log.error("unhandled error answering a request from %s", self._peer, exc_info=exc)
        finally:
            logs.request_id.reset(token)
        body = json.dumps(envelope(text, type_, None, code)).encode()
        response = web.Response(
            status=status,
            body=body,
            content_type="application/json",
            headers={
                **self._answer_headers,
                "Cache-Control": "no-store",
                "Connection": "close",
                "X-Request-Id": rid,
            },
        )
        response.force_close()
        return response


def _abort(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()
    else:
        transport.close()


class GuardedSite(web.TCPSite):
    """A TCP site whose connections are served by FrontDoorHandler."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        limits: DoorLimits,
        headers: Mapping[str, str],
        handler_args: Mapping[str, Any],
        **kwargs: Any,
    ) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.door = Door(limits)
        self._answer_headers = dict(headers)
        self._handler_args = dict(handler_args)

    async def start(self) -> None:
        """Listen, serving every connection with the guarded handler."""
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None  # noqa: S101 - the runner is set up before its sites start
        loop = asyncio.get_running_loop()

        def handler() -> FrontDoorHandler:
            return FrontDoorHandler(
                server, loop=loop, door=self.door, headers=self._answer_headers, **self._handler_args
            )

        check_internals(handler())
        # A TLS handshake is a stage too, bounded like a request head (asyncio's default: 60 s).
        tls = self._ssl_context
        self._server = await loop.create_server(
            handler,
            self._host,
            self._port,
            ssl=tls,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=self.door.limits.header_timeout_s if tls is not None else None,
        )
