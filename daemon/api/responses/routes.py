"""OpenAI's Responses API: POST /v1/responses, stored responses, GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

The same request as a chat completion in another encoding (`responses.decode`): one
conversation, the same session (`api.session`: lease, prompt, grammar, tools on every
model), the same reply parts, encoded as response objects and events (`responses.encode`).
Finished responses are kept per API key in memory (`responses.store`) so that
`previous_response_id` can continue them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from edgellmd.api.context import KEYS_GONE, context, tenant, token_limits
from edgellmd.api.jsontext import read_json_object
from edgellmd.api.media import MediaRules
from edgellmd.api.request import ChatRequest
from edgellmd.api.responses.decode import ResponsesRequest, parse_responses
from edgellmd.api.responses.encode import Draft
from edgellmd.api.responses.items import input_items, listing, page_of
from edgellmd.api.responses.store import RESPONSE_ID, ResponseStore, StoredResponse
from edgellmd.api.session import ChoiceEnd, ChoicePart, Session, aborted, chat_session, read_choices
from edgellmd.api.sse import Write, dumps, event, sse
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.generation import Finished, NoProgress
from edgellmd.errors import ApiError, GenerationTimeout, InternalError, InvalidRequest, NotFound, shown

log = logging.getLogger(__name__)

RESPONSES_STORE: Final = web.AppKey("responses_store", ResponseStore)
NO_PROGRESS: Final = "the model made no progress in time"


def _store(request: web.Request) -> ResponseStore:
    return request.app[RESPONSES_STORE]


async def _parse(request: web.Request, data: dict[str, Any]) -> ResponsesRequest:
    """Validate a body; one with schemas (their grammars are built as they are checked) on the prompt pool."""
    if data.get("tools") is None and data.get("text") is None:
        return parse_responses(data, token_limits(request))
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(context(request).executor, parse_responses, data, token_limits(request))


def _check_call_outputs(turns: tuple[ChatMessage, ...]) -> None:
    """Every function_call_output answers a function_call earlier in the conversation."""
    called: set[str] = set()
    for turn in turns:
        for call in turn.tool_calls:
            called.add(call["id"])
        if turn.role == "tool" and turn.tool_call_id not in called:
            raise InvalidRequest(
                "a function_call_output's call_id matches no function_call before it", param="input"
            )


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a response continues and adds: its turns, and its chain's namespace functions."""

    turns: tuple[ChatMessage, ...]
    namespaces: Mapping[str, tuple[str, str]]


def _previous(request: web.Request, body: ResponsesRequest) -> StoredResponse | None:
    """The stored response that `previous_response_id` continues (404 when it is not this key's)."""
    rid = body.previous_response_id
    if rid is None:
        return None
    stored = _store(request).get(tenant(request), rid)
    if stored is None:
        raise NotFound(
            f"no stored response with id {shown(rid, quote=True)}",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored


def _check_media_count(turns: tuple[ChatMessage, ...], rules: MediaRules) -> None:
    """The images and clips of the whole prompt, earlier turns included, within the request's
    bounds: a chat client sends its history's images again and is counted on all of them, and a
    chain of previous_response_id, each turn within the bound, once grew a prompt without one."""
    for kind, most, setting, code in (
        ("image", rules.max_images, "media.max_images", "invalid_image"),
        ("audio", rules.max_clips, "media.max_clips", "invalid_audio"),
    ):
        held = sum(1 for turn in turns for item in turn.media if item.kind == kind)
        if held > most:
            what = "images" if kind == "image" else "audio clips"
            raise InvalidRequest(
                f"the conversation, with the responses it continues, holds {held} {what}; a request "
                f"may hold at most {most} ({setting})",
                param="previous_response_id",
                code=code,
            )


def _keep(
    request: web.Request,
    body: ResponsesRequest,
    conversation: Conversation,
    draft: Draft,
    payload: bytes,
) -> None:
    """Store a finished response (when asked) with its conversation, for GET and previous_response_id."""
    if not body.store:
        return
    limits = context(request).settings.responses
    turns = conversation.turns
    entry = StoredResponse.of(
        tenant(request), payload, turns + draft.turns(), len(turns), conversation.namespaces
    )
    if not _store(request).put(
        draft.id, entry, max_responses=limits.store_max_responses, max_bytes=limits.store_max_mb * 1024 * 1024
    ):
        log.info("response not stored: the store is off or the conversation is larger than all of it")


def _json(payload: bytes) -> web.Response:
    return web.Response(body=payload, content_type="application/json", charset="utf-8")


def _failure(final: Finished) -> ApiError:
    cut = aborted(final.error)
    if cut is not None:
        return cut
    log.error("generation failed: %s", final.error)
    return InternalError("the model failed while generating")


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    body = await _parse(request, await read_json_object(request))
    previous = _previous(request, body)
    conversation = Conversation(
        (previous.conversation if previous else ()) + body.chat.messages,
        {**(previous.namespaces if previous else {}), **body.namespaces},
    )
    _check_call_outputs(conversation.turns)
    if previous is not None:
        _check_media_count(conversation.turns, MediaRules.of(context(request).settings.media))
    system = (ChatMessage("system", body.instructions),) if body.instructions else ()
    chat = ChatRequest(common=body.chat.common, messages=system + conversation.turns, tools=body.chat.tools)
    async with contextlib.AsyncExitStack() as stack:
        try:
            session = await stack.enter_async_context(chat_session(request, chat))
        except ApiError as exc:
            if exc.param == "messages":  # the prompt's errors (too long, unrenderable) are the input's
                exc.param = "input"
            raise
        draft = Draft(session.handle.name, body.echo, body.namespaces)
        if body.chat.common.stream:
            return await _stream(request, session, body, conversation, draft)
        return await _collect(request, session, body, conversation, draft)
    raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises


async def _collect(
    request: web.Request,
    session: Session,
    body: ResponsesRequest,
    conversation: Conversation,
    draft: Draft,
) -> web.Response:
    try:
        async for item in read_choices(session):
            if isinstance(item, ChoicePart):
                draft.feed(item.part)
                continue
            if item.final.reason == "error":
                raise _failure(item.final)
            draft.finish(item)
    except NoProgress:
        log.error("generation made no progress for %.0f s; request ended", session.idle_timeout)  # noqa: TRY400 - no traceback to show
        raise GenerationTimeout(NO_PROGRESS) from None
    payload = dumps(draft.response())
    _keep(request, body, conversation, draft, payload)
    return _json(payload)


async def _stream(
    request: web.Request,
    session: Session,
    body: ResponsesRequest,
    conversation: Conversation,
    draft: Draft,
) -> web.StreamResponse:
    async def send(write: Write) -> None:
        async def emit(events: list[dict[str, Any]]) -> None:
            for e in events:
                await write(event(e["type"], e))

        await emit(draft.start())
        try:
            async for item in read_choices(session):
                if isinstance(item, ChoicePart):
                    await emit(draft.feed(item.part))
                    continue
                assert isinstance(item, ChoiceEnd)  # noqa: S101 - parts, then the end
                if item.final.reason == "error":
                    await emit(draft.fail(_failure(item.final)))
                    return
                events = draft.finish(item)
                # Stored before the client hears it is done: a GET right after finds it.
                _keep(request, body, conversation, draft, dumps(draft.response()))
                await emit(events)
        except NoProgress:
            await emit(draft.fail(GenerationTimeout(NO_PROGRESS)))
            raise  # sse logs it and ends the stream

    return await sse(request, session, send, on_no_progress=b"", done=None)


def _response_id(request: web.Request) -> str:
    rid = request.match_info["response_id"]
    if not RESPONSE_ID.fullmatch(rid):
        raise InvalidRequest(
            "'response_id' must be an id this server gave a response (resp_ and 32 hex digits)",
            param="response_id",
        )
    return rid


def _not_found(rid: str) -> NotFound:
    return NotFound(f"no stored response with id {shown(rid, quote=True)}", param="response_id")


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a stored response, to the key that made it."""
    rid = _response_id(request)
    stored = _store(request).get(tenant(request), rid)
    if stored is None:
        raise _not_found(rid)
    return _json(stored.body)


async def list_input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: the items it was generated from, a page at a time."""
    rid = _response_id(request)
    query = request.rel_url.query
    page = page_of(query, [*query.getall("include", []), *query.getall("include[]", [])])
    stored = _store(request).get(tenant(request), rid)
    if stored is None:
        raise _not_found(rid)

    def page_json() -> bytes:  # hashing turns and encoding images: off the loop
        return dumps(
            listing(input_items(stored.conversation[: stored.inputs], stored.owner), page, stored.namespaces)
        )

    loop = asyncio.get_running_loop()
    return _json(await loop.run_in_executor(context(request).executor, page_json))


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: forget a stored response (OpenAI's deletion object)."""
    rid = _response_id(request)
    if not _store(request).delete(tenant(request), rid):
        raise _not_found(rid)
    return _json(dumps({"id": rid, "object": "response", "deleted": True}))


def setup_responses(app: web.Application) -> None:
    """Install the Responses API routes and their store."""
    store = app[RESPONSES_STORE] = ResponseStore()
    app.setdefault(KEYS_GONE, []).append(store.drop_owners)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
