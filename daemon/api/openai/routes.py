"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/audio/transcriptions (api.openai.audio)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from edgellmd.api.context import TOKENS_USED, TRACE, USER_TAG, context, tenant, token_limits
from edgellmd.api.jsontext import read_json_object
from edgellmd.api.openai.audio import PATH as TRANSCRIPTIONS
from edgellmd.api.openai.audio import transcriptions
from edgellmd.api.openai.decode import (
    CompletionRequest,
    EmbeddingRequest,
    parse_chat,
    parse_completion,
    parse_embeddings,
)
from edgellmd.api.openai.encode import Shape, collect, stream
from edgellmd.api.request import ChatRequest, Limits
from edgellmd.api.session import chat_session, generation_session, pooled_call, user_tag
from edgellmd.errors import ModelNotFound, ServiceUnavailable, shown
from edgellmd.host.traces import now_ns
from edgellmd.models.handle import ModelHandle

log = logging.getLogger(__name__)

OWNED_BY: Final = "edgellm"


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the models that can serve now."""
    handles = context(request).registry.ready_handles()
    return web.json_response({"object": "list", "data": [_model_object(h) for h in handles]})


def _model_object(handle: ModelHandle) -> dict[str, Any]:
    return {"id": handle.name, "object": "model", "created": handle.created, "owned_by": OWNED_BY}


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: one model, when it can serve now."""
    name = request.match_info["model"]
    try:
        handle = context(request).registry.get(name)
    except ServiceUnavailable:
        handle = None
    if handle is None:
        raise ModelNotFound(
            f"the model {shown(name, quote=True)} does not exist or is not loaded", param="model"
        )
    return web.json_response(_model_object(handle))


async def _parse_off_loop(
    request: web.Request, parse: Callable[[dict[str, Any], Limits], Any], data: dict[str, Any]
) -> Any:
    """Validate a body; one with a schema (its grammar is built as it is checked) on the prompt pool.

    Checking and converting the largest schema the limits allow takes most of a second: a
    cost the client controls, kept off the event loop that every other request shares.
    """
    if "response_format" not in data and "tools" not in data:
        return parse(data, token_limits(request))
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(context(request).executor, parse, data, token_limits(request))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body: ChatRequest = await _parse_off_loop(request, parse_chat, await read_json_object(request))
    common = body.common
    async with chat_session(request, body) as session:
        handle = session.handle
        shape = Shape(
            chat=True,
            model=handle.name,
            fingerprint=handle.provenance.fingerprint,
            include_usage=common.include_usage,
            logprobs=common.logprobs,
            tools=body.tools,
            reasoning=handle.settings.reasoning != "none",
        )
        return await (stream(request, session, shape) if common.stream else collect(session, shape))


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    data = await read_json_object(request)
    body: CompletionRequest = await _parse_off_loop(request, parse_completion, data)
    common = body.common
    async with context(request).registry.lease(common.model) as handle:
        handle.generator  # noqa: B018 - refuses embedding models before tokenizing
        handle.check_capacity(tenant(request))  # a request that will be refused costs no tokenizing
        began = now_ns()
        tokens = await handle.text_prompt(body.prompt)
        trace = request.get(TRACE)
        if trace is not None:
            trace.phase("prompt", began, **{"gen_ai.usage.input_tokens": len(tokens)})
            if isinstance(body.prompt, str):
                trace.text("gen_ai.prompt", body.prompt)
        shape = Shape(
            chat=False,
            model=handle.name,
            fingerprint=handle.provenance.fingerprint,
            include_usage=common.include_usage,
            logprobs=common.logprobs,
        )
        async with generation_session(request, handle, common, tokens, param="response_format") as session:
            return await (stream(request, session, shape) if common.stream else collect(session, shape))


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings: one unit vector per input, from a model configured with embedding: true."""
    body: EmbeddingRequest = parse_embeddings(await read_json_object(request))
    tag = user_tag(body.user)
    if tag is not None:
        request[USER_TAG] = tag
    async with context(request).registry.lease(body.model) as handle:
        handle.embedder  # noqa: B018 - refuses generation models before tokenizing
        inputs = [await handle.text_prompt(item, param="input") for item in body.inputs]
        request[TOKENS_USED] = n_tokens = sum(len(t) for t in inputs)
        whose = tenant(request)
        vectors = await pooled_call(
            request, handle, n_tokens, lambda model: model.embed(inputs, tenant=whose)
        )
    return web.json_response(
        {
            "object": "list",
            "model": handle.name,
            "data": [
                {"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        },
        dumps=lambda obj: json.dumps(obj, separators=(",", ":")),
    )


Route = tuple[str, str, Callable[[web.Request], Any]]
ROUTES: Final[tuple[Route, ...]] = (
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model}", get_model),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/embeddings", embeddings),
    ("POST", TRANSCRIPTIONS, transcriptions),
)


def setup_openai(app: web.Application) -> None:
    """Install the OpenAI-compatible routes."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
