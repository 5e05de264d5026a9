"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

from aiohttp import web

from edgellmd.api.context import CALLER, TOKENS_USED, USER_TAG, context
from edgellmd.api.openai_answers import Shape, collect, stream
from edgellmd.api.openai_schemas import (
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
from edgellmd.engine import CompiledGrammar
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.generation import KEY_REVOKED, Generation, GenerationRequest
from edgellmd.errors import InvalidRequest, KeyRevoked, ModelNotFound, ServiceUnavailable, shown
from edgellmd.models.handle import ModelHandle

log = logging.getLogger(__name__)

OWNED_BY: Final = "edgellm"


def _limits(request: web.Request) -> Limits:
    server = context(request).settings.server
    ceiling = server.max_tokens_limit
    caller = request.get(CALLER)
    if caller is not None and caller.max_tokens is not None:
        ceiling = min(ceiling, caller.max_tokens)  # the key's own ceiling, when lower
    default = server.default_max_tokens
    return Limits(
        max_tokens_limit=ceiling, default_max_tokens=min(default, ceiling) if default is not None else None
    )


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


def _generation_request(
    handle: ModelHandle, common: CommonRequest, tokens: list[int], choice: int
) -> GenerationRequest:
    sampling = common.sampling
    if choice and sampling.seed is not None:  # seeded choices differ from each other, reproducibly
        sampling = replace(sampling, seed=sampling.seed + choice)
    return GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=handle.generation_limit(len(tokens), common.max_tokens),
        sampling=sampling,
        stop=common.stop,
        ignore_eos=common.ignore_eos,
        logprobs=common.logprobs,
    )


def _submit_all(
    handle: ModelHandle, common: CommonRequest, tokens: list[int], grammars: list[CompiledGrammar] | None
) -> list[Generation]:
    """One generation per choice; all or none (a 429 on the third cancels the first two)."""
    gens: list[Generation] = []
    pending = list(grammars or [])
    try:
        for choice in range(common.n):
            grammar = pending.pop(0) if pending else None
            gens.append(handle.submit(_generation_request(handle, common, tokens, choice), grammar))
    except BaseException:
        for gen in gens:
            gen.cancel()
        for grammar in pending:
            grammar.free()
        raise
    return gens


def user_tag(value: str | None) -> str | None:
    """A client's `user` field as the access log may show it: short and printable."""
    if value is None:
        return None
    return shown(value[:64])


def check_key_still_valid(request: web.Request) -> None:
    """401 when the request's key was revoked, disabled or expired since it was authenticated."""
    caller = request.get(CALLER)
    if caller is not None and not context(request).key_valid(caller.key_id):
        raise KeyRevoked(KEY_REVOKED)


async def _run(
    request: web.Request,
    handle: ModelHandle,
    common: CommonRequest,
    tokens: list[int],
    shape: Shape,
    *,
    param: str,
) -> web.StreamResponse:
    tag = user_tag(common.user)
    if tag is not None:
        request[USER_TAG] = tag
    n_vocab = handle.engine.n_vocab
    if any(token >= n_vocab for token, _ in common.sampling.logit_bias):
        raise InvalidRequest(f"'logit_bias' token ids must be below {n_vocab}", param="logit_bias")
    grammars = await handle.grammars(common.sampling.grammar, common.n, param)
    try:
        check_key_still_valid(request)  # tokenizing and compiling took a while: revoked since?
    except BaseException:
        for grammar in grammars or []:
            grammar.free()
        raise
    gens = _submit_all(handle, common, tokens, grammars)
    metrics = context(request).metrics
    timings = [metrics.timing(handle.name) for _ in gens]
    active = context(request).generations
    caller = request.get(CALLER)
    for gen in gens:
        active.add(gen, caller.key_id if caller is not None else None)
    server = context(request).settings.server
    try:
        if common.stream:
            return await stream(
                request,
                gens,
                timings,
                shape,
                write_timeout=server.stream_write_timeout_s,
                idle_timeout=server.progress_timeout_s,
            )
        return await collect(gens, timings, shape, server.progress_timeout_s)
    finally:
        # Normal end, client gone (write error or handler cancelled): either way the slots
        # must be free now, not when the generations would have ended.
        for gen in gens:
            active.discard(gen)
            gen.cancel()
        handle.generator.wake()
        finals = [gen.final for gen in gens if gen.final is not None]
        completion = sum(fin.completion_tokens for fin in finals)
        request[TOKENS_USED] = len(tokens) + completion
        if finals:
            metrics.prompt_tokens.labels(handle.name).inc(finals[0].prompt_tokens)
            metrics.completion_tokens.labels(handle.name).inc(completion)


async def _parse_off_loop(
    request: web.Request, parse: Callable[[dict[str, Any], Limits], Any], data: dict[str, Any]
) -> Any:
    """Validate a body; one with a schema (its grammar is built as it is checked) on the prompt pool.

    Checking and converting the largest schema the limits allow takes most of a second: a
    cost the client controls, kept off the event loop that every other request shares.
    """
    if "response_format" not in data and "tools" not in data:
        return parse(data, _limits(request))
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(context(request).executor, parse, data, _limits(request))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body: ChatRequest = await _parse_off_loop(request, parse_chat, await read_json_object(request))
    common = body.common
    async with context(request).registry.lease(common.model) as handle:
        handle.generator  # noqa: B018 - refuses embedding models before tokenizing
        handle.check_capacity()  # a request that will be refused costs no tokenizing
        messages = body.messages
        if body.tools is not None and body.tools.instructions:
            messages = (ChatMessage("system", body.tools.instructions), *messages)
        tokens = await handle.chat_prompt(messages, body.tools.tools if body.tools else None)
        shape = Shape(
            chat=True,
            model=handle.name,
            fingerprint=handle.provenance.fingerprint,
            include_usage=common.include_usage,
            logprobs=common.logprobs,
            tools=body.tools,
        )
        param = "tools" if body.tools is not None and body.tools.grammar is not None else "response_format"
        return await _run(request, handle, common, tokens, shape, param=param)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    data = await read_json_object(request)
    body: CompletionRequest = await _parse_off_loop(request, parse_completion, data)
    common = body.common
    async with context(request).registry.lease(common.model) as handle:
        handle.generator  # noqa: B018 - refuses embedding models before tokenizing
        handle.check_capacity()  # a request that will be refused costs no tokenizing
        tokens = await handle.text_prompt(body.prompt)
        shape = Shape(
            chat=False,
            model=handle.name,
            fingerprint=handle.provenance.fingerprint,
            include_usage=common.include_usage,
            logprobs=common.logprobs,
        )
        return await _run(request, handle, common, tokens, shape, param="response_format")


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
        vectors = await handle.embed(inputs)
        context(request).metrics.prompt_tokens.labels(handle.name).inc(n_tokens)
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
)


def setup_openai(app: web.Application) -> None:
    """Install the OpenAI-compatible routes."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
