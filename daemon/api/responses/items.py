"""GET /v1/responses/{id}/input_items: the items a stored response was generated from, a page at a time.

The store keeps a response's conversation as chat turns (`store.StoredResponse`): every turn
it continued (`previous_response_id`) and its own input, then its output. The listing is
those input turns in OpenAI's item shapes: a user, system or developer turn is a `message`
of `input_text` (and `input_image` / `input_audio`) parts, an assistant turn a `message` of
`output_text` and a `function_call` per call, a tool turn a `function_call_output`. Each item's
id is made from the response's id and the item's place, so that `after` pages stay put for as
long as the response is stored. Instructions are not items (OpenAI lists none for them); a
reasoning item sent as input was not kept (`decode.input_turns`), so it is not listed; a
`developer` turn is listed as the `system` turn the model saw.

An image's data is listed only when `include` asks for `message.input_image.image_url` (as
OpenAI does): its http(s) address as sent, or a data: URL of its bytes.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput
from edgellmd.errors import InvalidRequest, shown

DEFAULT_LIMIT: Final = 20  # OpenAI's
MAX_LIMIT: Final = 100  # OpenAI's
IMAGE_URL: Final = "message.input_image.image_url"
# What `include` may name (OpenAI's ResponseIncludable); only IMAGE_URL changes what is listed.
INCLUDABLE: Final = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        IMAGE_URL,
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
        "message.output_text.logprobs",
    }
)
PARAMETERS: Final = frozenset({"after", "include", "include[]", "limit", "order"})
MAX_ITEM_ID_CHARS: Final = 64  # longer than any id made here


@dataclass(frozen=True, slots=True)
class Page:
    """What a listing asks for."""

    after: str | None = None
    limit: int = DEFAULT_LIMIT
    descending: bool = True  # OpenAI's default order: the newest item first
    images: bool = False  # `include` named IMAGE_URL


def page_of(query: Mapping[str, str], includes: Sequence[str]) -> Page:
    """The listing's parameters from a query (`includes`: every `include` / `include[]` value).
    400 naming the parameter for any value OpenAI would not take."""
    for name in query:
        if name not in PARAMETERS:
            raise InvalidRequest(
                f"unknown parameter {shown(name[:40], quote=True)} (expected after, include, limit, order)",
                param=shown(name[:40]),
            )
    limit = DEFAULT_LIMIT
    if "limit" in query:
        text = query["limit"]
        if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_LIMIT):
            raise InvalidRequest(f"'limit' must be an integer from 1 to {MAX_LIMIT}", param="limit")
        limit = int(text)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be asc or desc", param="order")
    after = query.get("after")
    if after is not None and not 0 < len(after) <= MAX_ITEM_ID_CHARS:
        raise InvalidRequest(
            f"'after' must be an item id (1 to {MAX_ITEM_ID_CHARS} characters)", param="after"
        )
    for value in includes:
        if value not in INCLUDABLE:
            raise InvalidRequest(
                f"'include' {shown(value[:80], quote=True)} is not one of {', '.join(sorted(INCLUDABLE))}",
                param="include",
            )
    return Page(after, limit, order == "desc", IMAGE_URL in includes)


def input_items(
    response_id: str, turns: Sequence[ChatMessage], *, images: bool = False
) -> list[dict[str, Any]]:
    """The input turns as items, oldest first."""
    items: list[dict[str, Any]] = []

    def item_id(prefix: str) -> str:
        digest = hashlib.sha256(f"{response_id}/{len(items)}".encode()).hexdigest()
        return prefix + digest[:32]

    for turn in turns:
        if turn.role == "tool":
            items.append(
                {
                    "id": item_id("fco_"),
                    "type": "function_call_output",
                    "call_id": turn.tool_call_id or "",
                    "output": turn.content,
                    "status": "completed",
                }
            )
        elif turn.role == "assistant":
            if turn.content or not turn.tool_calls:
                items.append(
                    {
                        "id": item_id("msg_"),
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": turn.content, "annotations": []}],
                    }
                )
            for call in turn.tool_calls:
                function = call.get("function", {})
                items.append(
                    {
                        "id": item_id("fc_"),
                        "type": "function_call",
                        "call_id": call.get("id", ""),
                        "name": function.get("name", ""),
                        "arguments": function.get("arguments", ""),
                        "status": "completed",
                    }
                )
        else:
            items.append(
                {
                    "id": item_id("msg_"),
                    "type": "message",
                    "role": turn.role,
                    "status": "completed",
                    "content": _input_parts(turn, images),
                }
            )
    return items


def _input_parts(turn: ChatMessage, images: bool) -> list[dict[str, Any]]:
    """A user, system or developer turn's parts: its text between its media, as sent."""
    parts: list[dict[str, Any]] = []
    at = 0
    for media, offset in zip(turn.media, turn.media_at, strict=True):
        if turn.content[at:offset]:
            parts.append({"type": "input_text", "text": turn.content[at:offset]})
        parts.append(_media_part(media, images))
        at = offset
    if turn.content[at:] or not parts:
        parts.append({"type": "input_text", "text": turn.content[at:]})
    return parts


def _media_part(media: MediaInput, images: bool) -> dict[str, Any]:
    if media.kind == "audio":
        data = base64.b64encode(media.data).decode("ascii")
        return {"type": "input_audio", "input_audio": {"data": data, "format": media.format or "wav"}}
    url = None
    if images:
        url = (
            media.url
            or f"data:image/{media.format or 'png'};base64,{base64.b64encode(media.data).decode('ascii')}"
        )
    return {"type": "input_image", "detail": "auto", "file_id": None, "image_url": url}


def listing(items: list[dict[str, Any]], page: Page) -> dict[str, Any]:
    """One page of `items` (oldest first) in OpenAI's list object; 400 for an `after` it lacks."""
    ordered = list(reversed(items)) if page.descending else items
    start = 0
    if page.after is not None:
        found = next((i for i, item in enumerate(ordered) if item["id"] == page.after), None)
        if found is None:
            raise InvalidRequest(
                f"'after' {shown(page.after, quote=True)} is no input item of this response", param="after"
            )
        start = found + 1
    data = ordered[start : start + page.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + page.limit < len(ordered),
    }
