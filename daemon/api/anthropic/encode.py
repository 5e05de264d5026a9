"""Anthropic's Messages answers: whole messages, event streams of content blocks, and its error shape.

A reply's parts (`api.reply`) map onto content blocks: answer text onto `text` blocks,
reasoning onto `thinking` blocks, each tool call onto a `tool_use` block whose `input`
streams as `input_json_delta` while the model writes it. A reply cut inside a call keeps
only its complete calls in the whole message; a stream has already shown the unfinished
call's block (as Anthropic's own streams do) and ends it with `stop_reason: max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from aiohttp import web

from edgellmd.api.reply import (
    CallArguments,
    CallEnd,
    CallStart,
    ReasoningPart,
    ReplyReader,
    TextPart,
    ToolCall,
    arguments_object,
)
from edgellmd.api.session import ChoiceEnd, ChoicePart, Session, aborted, read_choices
from edgellmd.api.sse import Write, event, sse
from edgellmd.engine.generation import Finished, NoProgress
from edgellmd.errors import ApiError, GenerationTimeout, InternalError, ServerOverloaded

log = logging.getLogger(__name__)

T = TypeVar("T")

# A stream that waits this long with nothing to say (a long prompt still being read) sends
# a ping, so that proxies between it and its client do not take it for dead.
PING_INTERVAL_S: Final = 10.0
OVERLOADED_STATUS: Final = 529  # Anthropic's "overloaded": every slot and the queue are full
# Anthropic's error types by HTTP status; other 4xx are invalid requests, other 5xx api errors.
ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    OVERLOADED_STATUS: "overloaded_error",
}
PING: Final = event("ping", {"type": "ping"})


def error_body(exc: ApiError) -> tuple[int, dict[str, Any]]:
    """An error's status and body in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    status = OVERLOADED_STATUS if isinstance(exc, ServerOverloaded) else exc.status
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": exc.message}}


def render_error(exc: ApiError) -> web.Response:
    """An error answer in Anthropic's shape (the front door adds the error's headers)."""
    status, body = error_body(exc)
    return web.json_response(body, status=status)


def _error_event(exc: ApiError) -> bytes:
    return event("error", error_body(exc)[1])


def usage(final: Finished) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens prefilled for this request, and
    `cache_read_input_tokens` those whose KV cache an earlier request left (in its slot or in the
    prompt cache); together they are the whole prompt, as count_tokens counts it."""
    return {
        "input_tokens": final.prompt_tokens - final.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": final.cached_tokens,
        "output_tokens": final.completion_tokens,
    }


def _failed(final: Finished) -> ApiError:
    cut = aborted(final.error)
    if cut is not None:
        return cut
    log.error("generation failed: %s", final.error)
    return InternalError("the model failed while generating")


def tool_use_id(call_id: str) -> str:
    """A tool call's id in Anthropic's form (`toolu_…`), from the reply's own."""
    return "toolu_" + call_id.removeprefix("call_")


@dataclass(slots=True)
class Reply:
    """How one Messages answer is shaped: its id, model, requested max_tokens and thinking."""

    model: str
    max_tokens: int | None
    show_thinking: bool
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])

    def stop_reason(self, final: Finished, reader: ReplyReader) -> str:
        """`max_tokens` (or the context's end), `stop_sequence`, `tool_use` or `end_turn`."""
        if final.reason == "length":
            if self.max_tokens is not None and final.completion_tokens < self.max_tokens:
                return "model_context_window_exceeded"  # the slot's context ended it first
            return "max_tokens"
        if final.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if reader.calls else "end_turn"

    def head(self, prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The message before any content, as `message_start` carries it: its usage split as
        `message_delta`'s will be (the first token tells the cached part: TextDelta.cached_tokens)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens - cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached_tokens,
                "output_tokens": 0,
            },
        }

    def message(self, end: ChoiceEnd) -> dict[str, Any]:
        """The whole message: thinking, text and complete tool_use blocks."""
        reader, final = end.reader, end.final
        content: list[dict[str, Any]] = []
        if self.show_thinking and reader.reasoning:
            content.append({"type": "thinking", "thinking": reader.reasoning, "signature": ""})
        if reader.answer:
            content.append({"type": "text", "text": reader.answer})
        content.extend(_tool_use(call) for call in reader.calls)
        body = self.head(final.prompt_tokens)
        body["content"] = content
        body["stop_reason"] = self.stop_reason(final, reader)
        body["stop_sequence"] = final.stop_sequence
        body["usage"] = usage(final)
        return body


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.name,
        "input": arguments_object(call),
    }


async def collect(session: Session, reply: Reply) -> web.Response:
    """Wait for the reply and answer with the whole message."""
    end: ChoiceEnd | None = None
    try:
        async for item in read_choices(session):
            if isinstance(item, ChoiceEnd):
                end = item
    except NoProgress:
        log.error("generation made no progress for %.0f s; request ended", session.idle_timeout)  # noqa: TRY400 - no traceback to show
        raise GenerationTimeout("the model made no progress in time") from None
    if end is None:  # pragma: no cover - read_choices always ends a choice
        raise InternalError("the generation ended without finishing")
    if end.final.reason == "error":
        raise _failed(end.final)
    return web.json_response(reply.message(end))


class _Blocks:
    """The stream's content blocks: at most one open, each with the next index."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self.index = -1
        self.open: str | None = None  # the open block's type

    async def start(self, block: dict[str, Any]) -> None:
        await self.stop()
        self.index += 1
        self.open = block["type"]
        await self._write(
            event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )

    async def delta(self, delta: dict[str, Any]) -> None:
        await self._write(
            event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        )

    async def stop(self) -> None:
        if self.open is not None:
            self.open = None
            await self._write(
                event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            )


async def _with_pings(items: AsyncIterator[T], write: Write, interval: float) -> AsyncGenerator[T, None]:
    """`items`, with a ping written whenever none comes for `interval` seconds."""
    queue: asyncio.Queue[T | Exception | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                async with asyncio.timeout(interval):
                    got = await queue.get()
            except TimeoutError:
                await write(PING)
                continue
            if got is None:
                return
            if isinstance(got, Exception):
                raise got
            yield got
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _send_part(blocks: _Blocks, item: ChoicePart, reply: Reply) -> None:
    part = item.part
    if isinstance(part, TextPart):
        if blocks.open != "text":
            await blocks.start({"type": "text", "text": ""})
        await blocks.delta({"type": "text_delta", "text": part.text})
    elif isinstance(part, ReasoningPart):
        if not reply.show_thinking:
            return
        if blocks.open != "thinking":
            await blocks.start({"type": "thinking", "thinking": "", "signature": ""})
        await blocks.delta({"type": "thinking_delta", "thinking": part.text})
    elif isinstance(part, CallStart):
        await blocks.start({"type": "tool_use", "id": tool_use_id(part.id), "name": part.name, "input": {}})
    elif isinstance(part, CallArguments):
        if blocks.open == "tool_use":
            await blocks.delta({"type": "input_json_delta", "partial_json": part.delta})
    elif isinstance(part, CallEnd):
        await blocks.stop()


async def send_events(write: Write, session: Session, reply: Reply) -> None:
    """Write the message's events as the reply is generated; raises NoProgress past the idle timeout."""
    first = session.gens[0].peek()  # there by now, unless it took longer than sse waits
    cached = first.cached_tokens if first is not None else 0
    await write(
        event(
            "message_start", {"type": "message_start", "message": reply.head(session.prompt_tokens, cached)}
        )
    )
    await write(PING)  # as Anthropic sends one straight after message_start
    blocks = _Blocks(write)
    async with contextlib.aclosing(_with_pings(read_choices(session), write, PING_INTERVAL_S)) as items:
        async for item in items:
            if isinstance(item, ChoicePart):
                await _send_part(blocks, item, reply)
                continue
            await blocks.stop()
            final = item.final
            if final.reason == "error":
                await write(_error_event(_failed(final)))
                return
            delta = {
                "stop_reason": reply.stop_reason(final, item.reader),
                "stop_sequence": final.stop_sequence,
            }
            await write(
                event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(final)})
            )
            await write(event("message_stop", {"type": "message_stop"}))
            return


async def stream(request: web.Request, session: Session, reply: Reply) -> web.StreamResponse:
    """Answer with Anthropic's event stream: message_start, content blocks, message_delta, message_stop."""
    timeout = _error_event(GenerationTimeout("the model made no progress in time"))
    return await sse(
        request, session, lambda write: send_events(write, session, reply), on_no_progress=timeout, done=None
    )
