"""Server-sent event streams, the same for every API family: the write deadline, the cuts, the end."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from aiohttp import web

from edgellmd.api.session import Session
from edgellmd.engine.generation import NoProgress
from edgellmd.errors import GenerationTimeout

log = logging.getLogger(__name__)

SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell reverse proxies not to buffer the stream
}
Write = Callable[[bytes], Awaitable[None]]
# A stream's headers wait this long at most for every choice's first token, so that they can
# say how long it queued (`x-queue-ms`, as a whole answer's do); past it they go without.
STREAM_HEADERS_WAIT_S: Final = 10.0


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def event(name: str, data: Any) -> bytes:
    """One named event (`event:` and `data:` lines), as Anthropic and the Responses API send them."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


async def sse(
    request: web.Request,
    session: Session,
    send: Callable[[Write], Awaitable[None]],
    *,
    on_no_progress: bytes,
    done: bytes | None,
    headers: Mapping[str, str] = SSE_HEADERS,
) -> web.StreamResponse:
    """An event stream whose events `send` writes; the same cuts for every API family.

    A client that stops reading past the session's write timeout is cut (its slot goes to
    somebody who listens); a model that makes no progress ends the stream with
    `on_no_progress`; `done` (OpenAI's `[DONE]`) ends every stream that was not cut.
    """
    response = web.StreamResponse(headers=headers)
    # A progress deadline shorter than the wait for headers holds for the wait as well: a stream
    # still queued past it is a 504, as a request not streamed is (it was a 200 and a late reply).
    deadline = min(STREAM_HEADERS_WAIT_S, session.idle_timeout)
    waited = await session.queue_wait(deadline)
    refused = session.refused()  # shed before it started: a 429, not a stream
    if refused is not None:
        raise refused
    if waited is None and deadline < STREAM_HEADERS_WAIT_S:
        raise GenerationTimeout("the model made no progress in time")
    if waited is not None:
        response.headers["x-queue-ms"] = str(round(waited * 1000))
    await response.prepare(request)
    write_timeout = session.write_timeout

    async def write(data: bytes) -> None:
        # A client that stops reading fills the socket buffers and this write waits; past the
        # deadline the stream is cut so that its slot goes to somebody who is listening.
        # With nothing buffered a write cannot wait, and needs no timer (the per-token path).
        transport = request.transport
        if transport is not None and transport.get_write_buffer_size() == 0:
            await response.write(data)
            return
        async with asyncio.timeout(write_timeout):
            await response.write(data)

    try:
        try:
            await send(write)
        except NoProgress:
            log.error("generation made no progress for %.0f s; stream ended", session.idle_timeout)  # noqa: TRY400 - no traceback
            await write(on_no_progress)
        if done is not None:
            await write(done)
        # aiohttp waits for the client only past 64 KiB unsent, and at the end: a short stream's
        # reader that never reads held the connection and its handler here until it closed.
        async with asyncio.timeout(write_timeout):
            await response.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream; the caller frees the slot. Nothing to answer.
        log.info("client disconnected mid-stream")
    except TimeoutError:
        log.warning("client stopped reading its stream for %.1f s; stream cut", write_timeout)
        if request.transport is not None:
            request.transport.abort()
    return response
