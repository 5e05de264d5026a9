"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, in Anthropic's shapes.

The body decodes into the shared chat request (`anthropic.decode`) and runs through the
same session as OpenAI chat (`api.session`); only the encoding is Anthropic's
(`anthropic.encode`). Errors under /v1/messages, the front door's included
(authentication, rate limits, routing), are rendered in Anthropic's shape.
`anthropic-version` and `anthropic-beta` headers are accepted and not looked at.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from aiohttp import web

from edgellmd.api.anthropic.decode import CountRequest, MessagesRequest, parse_count_tokens, parse_messages
from edgellmd.api.anthropic.encode import Reply, collect, render_error, stream
from edgellmd.api.context import ERROR_SHAPES, ErrorShapes, context, token_limits
from edgellmd.api.jsontext import read_json_object
from edgellmd.api.media import MediaRules, fetch_media
from edgellmd.api.session import cache_scope, chat_session

MESSAGES: Final = "/v1/messages"
COUNT_TOKENS: Final = "/v1/messages/count_tokens"

T = TypeVar("T")


async def _parse(request: web.Request, parse: Callable[[Mapping[str, Any]], T], data: dict[str, Any]) -> T:
    """Validate a body; one with schemas (their grammars are built as they are checked) on the prompt pool."""
    if "tools" not in data and "output_config" not in data:
        return parse(data)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(context(request).executor, parse, data)


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    data = await read_json_object(request)
    body: MessagesRequest = await _parse(
        request, functools.partial(parse_messages, limits=token_limits(request)), data
    )
    chat = body.chat
    async with chat_session(request, chat) as session:
        handle = session.handle
        reply = Reply(
            model=handle.name,
            max_tokens=chat.common.max_tokens,
            show_thinking=body.show_thinking and handle.settings.reasoning != "none",
        )
        return await (stream(request, session, reply) if chat.common.stream else collect(session, reply))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages renders it; nothing generated."""
    settings = context(request).settings
    rules = MediaRules.of(settings.media)
    parse = functools.partial(parse_count_tokens, media=rules)
    body: CountRequest = await _parse(request, parse, await read_json_object(request))
    tools = body.tools
    async with context(request).registry.lease(body.model) as handle:
        # As api.session.chat_session renders it: the tools, the reply format they ask for, and
        # its images (whose positions count; their chunks are let go of at once).
        prompt = await handle.chat_prompt(
            await fetch_media(body.messages, settings.media),
            tools.tools if tools else None,
            instructions=tools.instructions if tools else "",
            media_limits=rules.limits,
            scope=cache_scope(request),
        )
        if prompt.held is not None:
            prompt.held.release()
    return web.json_response({"input_tokens": len(prompt.tokens)})


def setup_anthropic(app: web.Application) -> None:
    """Install the Messages API routes and its error envelope for them."""
    app.router.add_post(MESSAGES, messages)
    app.router.add_post(COUNT_TOKENS, count_tokens)
    shapes = app.get(ERROR_SHAPES)
    if shapes is None:  # an application built without the factory (tests of one installer)
        shapes = app[ERROR_SHAPES] = ErrorShapes()
    shapes.add(MESSAGES, render_error)
