"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from edgellmd import appkeys
from edgellmd.api.schemas import (
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    EmbeddingRequest,
    Limits,
    parse_chat,
    parse_completion,
    parse_embeddings,
    read_json_object,
)
from edgellmd.errors import GenerationTimeout, InternalError, ServiceUnavailable, envelope
from edgellmd.generation import (
    SHUTTING_DOWN,
    Finished,
    Generation,
    GenerationRequest,
    NoProgress,
    TextDelta,
)
from edgellmd.handle import ModelHandle
from edgellmd.metrics import TokenTiming

log = logging.getLogger(__name__)

OWNED_BY: Final = "edgellm"
_SENTINEL: Final = "\x00edgellm-delta\x00"  # never produced by a tokenizer: its JSON form is unique
SSE_DONE: Final = b"data: [DONE]\n\n"
SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell reverse proxies not to buffer the stream
}


def _limits(request: web.Request) -> Limits:
    server = request.app[appkeys.SETTINGS].server
    ceiling = server.max_tokens_limit
    key = request.get(appkeys.API_KEY)
    if key is not None and key.limits.max_tokens is not None:
        ceiling = min(ceiling, key.limits.max_tokens)  # the key's own ceiling, when lower
    default = server.default_max_tokens
    return Limits(max_tokens_limit=ceiling,
                  default_max_tokens=min(default, ceiling) if default is not None else None)


def _usage(fin: Finished) -> dict[str, int]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


def _finish_reason(fin: Finished) -> str:
    return "length" if fin.reason == "length" else "stop"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the models that can serve now."""
    handles = request.app[appkeys.REGISTRY].ready_handles()
    return web.json_response({"object": "list", "data": [
        {"id": h.name, "object": "model", "created": h.created, "owned_by": OWNED_BY}
        for h in handles]})


def _generation_request(handle: ModelHandle, common: CommonRequest, tokens: list[int]) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=tokens, max_tokens=handle.generation_limit(len(tokens), common.max_tokens),
        sampling=common.sampling, stop=common.stop, ignore_eos=common.ignore_eos)


class _Shape:
    """How one endpoint shapes its objects (chat and text completions differ only here)."""

    def __init__(self, *, chat: bool, handle: ModelHandle, timing: TokenTiming,
                 include_usage: bool = False) -> None:
        self.chat = chat
        self.timing = timing
        self.model = handle.name
        # Which approved bytes answered: a reload in the middle of a stream cannot mix two.
        self.fingerprint = handle.provenance.fingerprint
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._delta_frame: tuple[bytes, bytes] | None = None

    def delta_event(self, text: str) -> bytes:
        """The SSE event for a text delta: a prefix and suffix rendered once, the text encoded per token."""
        if self._delta_frame is None:
            rendered = _dumps(self.chunk(_SENTINEL, None, include_usage=self.include_usage))
            head, tail = rendered.split(_dumps(_SENTINEL))
            self._delta_frame = (b"data: " + head, tail + b"\n\n")
        head, tail = self._delta_frame
        return head + _dumps(text) + tail

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def complete(self, text: str, fin: Finished) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None, "finish_reason": _finish_reason(fin)}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": _finish_reason(fin)}
            body = self._base("text_completion")
        body["choices"] = [choice]
        body["usage"] = _usage(fin)
        return body

    def chunk(self, text: str | None, finish_reason: str | None, *, role: bool = False,
              usage: dict[str, int] | None = None, include_usage: bool = False) -> dict[str, Any]:
        if self.chat:
            body = self._base("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            body = self._base("text_completion")
            choices = [{"index": 0, "text": text or "", "logprobs": None,
                        "finish_reason": finish_reason}]
        body["choices"] = [] if usage is not None else choices
        if include_usage:
            body["usage"] = usage
        return body


async def _collect(gen: Generation, shape: _Shape, idle_timeout: float) -> web.Response:
    parts: list[str] = []
    try:
        return await _collect_events(gen, shape, idle_timeout, parts)
    except NoProgress:
        log.error("generation made no progress for %.0f s; request ended", idle_timeout)  # noqa: TRY400 - no traceback to show
        raise GenerationTimeout("the model made no progress in time") from None


async def _collect_events(gen: Generation, shape: _Shape, idle_timeout: float,
                          parts: list[str]) -> web.Response:
    timing = shape.timing
    async for event in gen.events(idle_timeout):
        parts.append(event.text)
        timing.tokens(event.completion_tokens)
        if isinstance(event, Finished):
            if event.reason == "error":
                if event.error == SHUTTING_DOWN:
                    raise ServiceUnavailable(SHUTTING_DOWN)
                log.error("generation failed: %s", event.error)
                raise InternalError("the model failed while generating")
            return web.json_response(shape.complete("".join(parts), event))
    raise InternalError("the generation ended without finishing")  # pragma: no cover


async def _stream(request: web.Request, gen: Generation, shape: _Shape) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    server = request.app[appkeys.SETTINGS].server
    timeout = server.stream_write_timeout_s

    async def write(data: bytes) -> None:
        # A client that stops reading fills the socket buffers and this write waits; past the
        # deadline the stream is cut so that its slot goes to somebody who is listening.
        # With nothing buffered a write cannot wait, and needs no timer (the per-token path).
        transport = request.transport
        if transport is not None and transport.get_write_buffer_size() == 0:
            await response.write(data)
            return
        async with asyncio.timeout(timeout):
            await response.write(data)

    try:
        try:
            await _send_events(write, gen, shape, server.progress_timeout_s)
        except NoProgress:
            log.error("generation made no progress for %.0f s; stream ended",  # noqa: TRY400 - no traceback
                      server.progress_timeout_s)
            await write(b"data: " + _dumps(envelope(
                "the model made no progress in time", "server_error", None, "timeout")) + b"\n\n")
        await write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream; the caller frees the slot. Nothing to answer.
        log.info("client disconnected mid-stream")
    except TimeoutError:
        log.warning("client stopped reading its stream for %.1f s; stream cut", timeout)
        if request.transport is not None:
            request.transport.abort()
    return response


async def _send_events(write: Callable[[bytes], Awaitable[None]], gen: Generation,
                       shape: _Shape, idle_timeout: float) -> None:
    async def send(obj: dict[str, Any]) -> None:
        await write(b"data: " + _dumps(obj) + b"\n\n")

    include_usage = shape.include_usage
    if shape.chat:
        await send(shape.chunk("", None, role=True, include_usage=include_usage))
    timing = shape.timing
    async for event in gen.events(idle_timeout):
        timing.tokens(event.completion_tokens)
        if isinstance(event, TextDelta):
            if event.text:
                await write(shape.delta_event(event.text))
            continue
        if event.reason == "error":
            if event.error == SHUTTING_DOWN:
                await send(envelope(SHUTTING_DOWN, "server_error", None, "server_shutting_down"))
                break
            log.error("generation failed mid-stream: %s", event.error)
            await send(envelope("the model failed while generating", "server_error", None,
                                "internal_error"))
            break
        if event.text:
            await write(shape.delta_event(event.text))
        await send(shape.chunk(None if shape.chat else "", _finish_reason(event),
                               include_usage=include_usage))
        if include_usage:
            await send(shape.chunk(None, None, usage=_usage(event), include_usage=True))


async def _run(request: web.Request, handle: ModelHandle, common: CommonRequest,
               tokens: list[int], shape: _Shape) -> web.StreamResponse:
    gen = handle.submit(_generation_request(handle, common, tokens))
    active = request.app[appkeys.GENERATIONS]
    active.add(gen)
    try:
        if common.stream:
            return await _stream(request, gen, shape)
        return await _collect(gen, shape, request.app[appkeys.SETTINGS].server.progress_timeout_s)
    finally:
        # Normal end, client gone (write error or handler cancelled): either way the slot
        # must be free now, not when the generation would have ended.
        active.discard(gen)
        gen.cancel()
        handle.generator.wake()
        fin = gen.final
        request[appkeys.TOKENS_USED] = (fin.prompt_tokens + fin.completion_tokens if fin
                                        else len(tokens))
        if fin is not None:
            metrics = request.app[appkeys.METRICS]
            metrics.prompt_tokens.labels(handle.name).inc(fin.prompt_tokens)
            metrics.completion_tokens.labels(handle.name).inc(fin.completion_tokens)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body: ChatRequest = parse_chat(await read_json_object(request), _limits(request))
    async with request.app[appkeys.REGISTRY].lease(body.common.model) as handle:
        tokens = await handle.chat_prompt(body.messages)
        shape = _Shape(chat=True, handle=handle, include_usage=body.common.include_usage,
                       timing=request.app[appkeys.METRICS].timing(handle.name))
        return await _run(request, handle, body.common, tokens, shape)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    body: CompletionRequest = parse_completion(await read_json_object(request), _limits(request))
    async with request.app[appkeys.REGISTRY].lease(body.common.model) as handle:
        handle.generator  # noqa: B018 - refuses embedding models before tokenizing
        tokens = await handle.text_prompt(body.prompt)
        shape = _Shape(chat=False, handle=handle, include_usage=body.common.include_usage,
                       timing=request.app[appkeys.METRICS].timing(handle.name))
        return await _run(request, handle, body.common, tokens, shape)


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings: one unit vector per input, from a model configured with embedding: true."""
    body: EmbeddingRequest = parse_embeddings(await read_json_object(request))
    if body.user is not None:
        request[appkeys.USER_TAG] = body.user
    async with request.app[appkeys.REGISTRY].lease(body.model) as handle:
        handle.embedder  # noqa: B018 - refuses generation models before tokenizing
        inputs = [await handle.text_prompt(item, param="input") for item in body.inputs]
        request[appkeys.TOKENS_USED] = n_tokens = sum(len(t) for t in inputs)
        vectors = await handle.embed(inputs)
        request.app[appkeys.METRICS].prompt_tokens.labels(handle.name).inc(n_tokens)
    return web.json_response({
        "object": "list", "model": handle.name,
        "data": [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }, dumps=lambda obj: json.dumps(obj, separators=(",", ":")))


Route = tuple[str, str, Callable[[web.Request], Any]]
ROUTES: Final[tuple[Route, ...]] = (
    ("GET", "/v1/models", list_models),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/embeddings", embeddings),
)


def setup_openai(app: web.Application) -> None:
    """Install the OpenAI-compatible routes."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
