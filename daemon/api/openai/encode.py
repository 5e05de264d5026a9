"""OpenAI's response objects for chat and text completions: whole answers and SSE streams.

One request runs one generation per choice (`n`); a stream interleaves their chunks by
`index`. The common case (one choice, no logprobs, no tools) takes a fast path that
renders each token's chunk from a frame prepared once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web

from edgellmd.api.reply import CallArguments, CallStart, ReasoningPart, TextPart
from edgellmd.api.session import ChoiceEnd, Session, aborted, finish_reason, read_choices
from edgellmd.api.sse import Write, dumps, sse
from edgellmd.api.structured import ToolPlan
from edgellmd.engine.generation import (
    Event,
    Finished,
    NoProgress,
    TextDelta,
    TokenLogprob,
)
from edgellmd.errors import (
    GenerationTimeout,
    InternalError,
    envelope,
)
from edgellmd.host.metrics import TokenTiming

log = logging.getLogger(__name__)

_SENTINEL: Final = "\x00edgellm-delta\x00"  # never produced by a tokenizer: its JSON form is unique
SSE_DONE: Final = b"data: [DONE]\n\n"


def _finish_reason(fin: Finished) -> str:
    return "length" if fin.reason == "length" else "stop"


@dataclass
class Choice:
    """What one choice produced."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: Finished | None = None

    @property
    def text(self) -> str:
        """The choice's text so far."""
        return "".join(self.parts)


class Shape:
    """How one endpoint shapes its objects (chat and text completions differ only here)."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        fingerprint: str,
        include_usage: bool = False,
        logprobs: int | None = None,
        tools: ToolPlan | None = None,
        reasoning: bool = False,
    ) -> None:
        self.chat = chat
        self.model = model
        # Which approved bytes answered: a reload in the middle of a stream cannot mix two.
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.want_logprobs = logprobs is not None
        # With a tool grammar the reply is tool-call JSON, read as it streams (api.reply);
        # with a reasoning model its thinking is split from its answer the same way.
        self.tools = tools if tools is not None and tools.grammar is not None else None
        self.reasoning = reasoning
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._delta_frame: tuple[bytes, bytes] | None = None

    def delta_event(self, text: str) -> bytes:
        """The SSE event for a text delta of choice 0: a frame rendered once, the text encoded per token."""
        if self._delta_frame is None:
            rendered = dumps(self.chunk(_SENTINEL, None))
            head, tail = rendered.split(dumps(_SENTINEL))
            self._delta_frame = (b"data: " + head, tail + b"\n\n")
        head, tail = self._delta_frame
        return head + dumps(text) + tail

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def logprobs(self, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (chat: `content`; completions: the legacy lists)."""
        if not self.want_logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": e.token,
                        "logprob": e.logprob,
                        "bytes": list(e.bytes),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top],
                    }
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # Keyed by text: byte tokens that print alike keep the likelier one (best last).
            "top_logprobs": [{t: lp for t, _, lp in reversed(e.top)} for e in entries],
            "text_offset": offsets,
        }

    @property
    def reads_parts(self) -> bool:
        """True when the reply is read as parts (tool calls, reasoning), not passed on as text."""
        return self.tools is not None or self.reasoning

    def message(self, end: ChoiceEnd) -> dict[str, Any]:
        """A chat message from a choice read as parts: answer, tool calls, reasoning."""
        reader = end.reader
        calls = reader.calls
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reader.answer or (None if calls else ""),
            "refusal": None,
        }
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_text}}
                for c in calls
            ]
        if reader.reasoning is not None:
            message["reasoning_content"] = reader.reasoning
        return message

    def complete_parts(self, ends: Sequence[ChoiceEnd]) -> dict[str, Any]:
        """The whole chat answer from choices read as parts."""
        body = self._base("chat.completion")
        body["choices"] = [
            {
                "index": e.index,
                "message": self.message(e),
                "logprobs": self.logprobs(e.logprobs),
                "finish_reason": finish_reason(e.final, e.reader),
            }
            for e in sorted(ends, key=lambda e: e.index)
        ]
        body["usage"] = usage_of([e.final for e in ends])
        return body

    def complete(self, choices: Sequence[Choice]) -> dict[str, Any]:
        """The whole answer."""
        out = []
        for c in choices:
            assert c.final is not None  # noqa: S101 - complete() gets finished choices
            if self.chat:
                message = {"role": "assistant", "content": c.text, "refusal": None}
                out.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": self.logprobs(c.logprobs),
                        "finish_reason": _finish_reason(c.final),
                    }
                )
            else:
                out.append(
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": self.logprobs(c.logprobs),
                        "finish_reason": _finish_reason(c.final),
                    }
                )
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = out
        body["usage"] = usage(choices)
        return body

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        *,
        index: int = 0,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk (a usage chunk when `usage` is given)."""
        if self.chat:
            body = self._base("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        else:
            body = self._base("text_completion")
            choices = [
                {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            ]
        body["choices"] = [] if usage is not None else choices
        if self.include_usage:
            body["usage"] = usage
        return body


def usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """The usage of finished choices (see usage_of)."""
    return usage_of([c.final for c in choices if c.final])


def usage_of(finals: Sequence[Finished]) -> dict[str, Any]:
    """Prompt tokens once (every choice shares the prompt), completion tokens summed.

    OpenAI's details say what the speed features did: `cached_tokens`, the prompt tokens
    whose KV cache was kept from an earlier request or restored from the prompt cache;
    `accepted_prediction_tokens` and `rejected_prediction_tokens`, the speculative draft
    tokens the sampler agreed and disagreed with (0 without speculation).
    """
    prompt = max((f.prompt_tokens for f in finals), default=0)
    completion = sum(f.completion_tokens for f in finals)
    drafted = sum(f.draft_tokens for f in finals)
    accepted = sum(f.accepted_draft_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": max((f.cached_tokens for f in finals), default=0)},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        },
    }


def _failed(event: Finished) -> Exception:
    cut = aborted(event.error)
    if cut is not None:
        return cut
    log.error("generation failed: %s", event.error)
    return InternalError("the model failed while generating")


async def collect(session: Session, shape: Shape) -> web.Response:
    """Wait for every choice and answer with the whole completion."""
    try:
        if shape.reads_parts:
            ends = [item async for item in read_choices(session) if isinstance(item, ChoiceEnd)]
            for end in ends:
                if end.final.reason == "error":
                    raise _failed(end.final)
            return web.json_response(shape.complete_parts(ends))
        choices = await asyncio.gather(*(_collect_one(session, i) for i in range(len(session.gens))))
    except NoProgress:
        log.error("generation made no progress for %.0f s; request ended", session.idle_timeout)  # noqa: TRY400 - no traceback to show
        raise GenerationTimeout("the model made no progress in time") from None
    return web.json_response(shape.complete(choices))


async def collect_text(session: Session) -> tuple[str, Finished]:
    """The first choice's whole text and its end (an error ends it as `collect` would)."""
    try:
        choice = await _collect_one(session, 0)
    except NoProgress:
        log.error("generation made no progress for %.0f s; request ended", session.idle_timeout)  # noqa: TRY400 - no traceback to show
        raise GenerationTimeout("the model made no progress in time") from None
    assert choice.final is not None  # noqa: S101 - _collect_one returns finished choices
    return choice.text, choice.final


async def _collect_one(session: Session, i: int) -> Choice:
    choice = Choice(i)
    async for event in session.events(i):
        session.timings[i].tokens(event.completion_tokens)
        choice.parts.append(event.text)
        choice.logprobs.extend(event.logprobs)
        if isinstance(event, Finished):
            if event.reason == "error":
                raise _failed(event)
            choice.final = event
            return choice
    raise InternalError("the generation ended without finishing")  # pragma: no cover


async def send_events(write: Write, session: Session, shape: Shape) -> None:
    """Write every choice's chunks as they come; raises NoProgress past the idle timeout."""
    gens, timings = session.gens, session.timings
    if shape.reads_parts:
        await _send_parts(write, session, shape)
        return
    if len(gens) == 1 and not shape.want_logprobs:
        await _send_single(write, session, timings[0], shape)
        return
    queue: asyncio.Queue[tuple[int, Event | NoProgress]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for event in session.events(i):
                timings[i].tokens(event.completion_tokens)
                queue.put_nowait((i, event))
        except NoProgress as exc:
            queue.put_nowait((i, exc))

    pumps = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    try:
        await _send_merged(write, queue, len(gens), shape)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _send(write: Write, obj: dict[str, Any]) -> None:
    await write(b"data: " + dumps(obj) + b"\n\n")


async def _send_error(write: Write, event: Finished) -> None:
    cut = aborted(event.error)
    if cut is not None:
        await _send(write, cut.body())
        return
    log.error("generation failed mid-stream: %s", event.error)
    await _send(write, envelope("the model failed while generating", "server_error", None, "internal_error"))


async def _send_merged(
    write: Write, queue: asyncio.Queue[tuple[int, Event | NoProgress]], n: int, shape: Shape
) -> None:
    choices = [Choice(i) for i in range(n)]
    offsets = [0] * n
    if shape.chat:
        for i in range(n):
            await _send(write, shape.chunk("", None, index=i, role=True))
    remaining = n
    while remaining:
        i, event = await queue.get()
        if isinstance(event, NoProgress):
            raise event
        choice = choices[i]
        if isinstance(event, Finished) and event.reason == "error":
            await _send_error(write, event)
            return
        if event.text or event.logprobs:
            await _send(
                write,
                shape.chunk(
                    event.text if shape.chat or event.text else "",
                    None,
                    index=i,
                    logprobs=shape.logprobs(event.logprobs, offsets[i]),
                ),
            )
            offsets[i] += len(event.text)
        if isinstance(event, Finished):
            choice.final = event
            remaining -= 1
            await _send_finish(write, shape, choice)
    if shape.include_usage:
        await _send(write, shape.chunk(None, None, usage=usage(choices)))


async def _send_finish(write: Write, shape: Shape, choice: Choice) -> None:
    assert choice.final is not None  # noqa: S101 - called on finish
    await _send(
        write, shape.chunk(None if shape.chat else "", _finish_reason(choice.final), index=choice.index)
    )


async def _send_parts(write: Write, session: Session, shape: Shape) -> None:
    """A chat stream read as parts: answer and reasoning deltas, tool calls as they are generated."""
    for i in range(len(session.gens)):
        await _send(write, shape.chunk("", None, index=i, role=True))
    ends: list[ChoiceEnd] = []
    async for item in read_choices(session):
        if isinstance(item, ChoiceEnd):
            if item.final.reason == "error":
                await _send_error(write, item.final)
                return
            ends.append(item)
            await _send(
                write,
                shape.chunk(
                    None,
                    finish_reason(item.final, item.reader),
                    index=item.index,
                    logprobs=shape.logprobs(item.logprobs),
                ),
            )
            continue
        part, index = item.part, item.index
        if isinstance(part, TextPart):
            await _send(write, shape.chunk(part.text, None, index=index))
        elif isinstance(part, ReasoningPart):
            await _send(write, shape.chunk(None, None, index=index, reasoning=part.text))
        elif isinstance(part, CallStart):
            call = {
                "index": part.index,
                "id": part.id,
                "type": "function",
                "function": {"name": part.name, "arguments": ""},
            }
            await _send(write, shape.chunk(None, None, index=index, tool_calls=[call]))
        elif isinstance(part, CallArguments):
            call = {"index": part.index, "function": {"arguments": part.delta}}
            await _send(write, shape.chunk(None, None, index=index, tool_calls=[call]))
    if shape.include_usage:
        prompt = max((e.final.prompt_tokens for e in ends), default=0)
        completion = sum(e.final.completion_tokens for e in ends)
        await _send(
            write,
            shape.chunk(
                None,
                None,
                usage={
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            ),
        )


async def _send_single(write: Write, session: Session, timing: TokenTiming, shape: Shape) -> None:
    """The per-token path of a plain one-choice stream: one prepared frame, no dict per token."""
    if shape.chat:
        await _send(write, shape.chunk("", None, role=True))
    async for event in session.events(0):
        timing.tokens(event.completion_tokens)
        if isinstance(event, TextDelta):
            if event.text:
                await write(shape.delta_event(event.text))
            continue
        if event.reason == "error":
            await _send_error(write, event)
            break
        if event.text:
            await write(shape.delta_event(event.text))
        await _send(write, shape.chunk(None if shape.chat else "", _finish_reason(event)))
        if shape.include_usage:
            choice = Choice(0, final=event)
            await _send(write, shape.chunk(None, None, usage=usage([choice])))


async def stream(request: web.Request, session: Session, shape: Shape) -> web.StreamResponse:
    """Answer with an SSE stream of chunks, ending with [DONE]."""
    timeout = (
        b"data: "
        + dumps(envelope("the model made no progress in time", "server_error", None, "timeout"))
        + b"\n\n"
    )
    return await sse(
        request,
        session,
        lambda write: send_events(write, session, shape),
        on_no_progress=timeout,
        done=SSE_DONE,
    )
