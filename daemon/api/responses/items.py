"""GET /v1/responses/{id}/input_items: the items a stored response was generated from, a page at a time.

The store keeps a response's conversation as chat turns (`store.StoredResponse`): every turn
it continued (`previous_response_id`) and its own input, then its output. The listing is
those input turns in OpenAI's item shapes: a user, system or developer turn is a `message`
of `input_text` (and `input_image`) parts, an assistant turn a `message` of `output_text` and
a `function_call` per call (a namespace's function under its own name and `namespace`, as the
responses of the chain named them), a tool turn a `function_call_output`.

An item's id is made from the conversation up to its turn and its place there, so the same
turn has the same id in every response of a chain, and pages stay put for as long as the
response is stored. The ids a response gave its own output items are not kept: a call listed
later has another id than the one its response showed.

What is not kept is not listed: instructions (OpenAI lists none), input reasoning items, audio
clips (OpenAI's message items have no audio part: they are left out of the listing), the
boundaries between several text parts of one message (listed as one), a `refusal` part (in the
assistant's text), an image's `detail` (listed as `auto`); a `developer` turn is listed as the
`system` turn the model saw. An image's data is listed only when `include` asks for
`message.input_image.image_url`, as at OpenAI: its http(s) address as sent, or a data: URL.

A page holds at most `limit` items and, past its first item, about MAX_PAGE_BYTES of them
(an image's data URL is most of that): beyond, `has_more` says to ask for the next page.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from edgellmd.api.fields import known_parameters
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput
from edgellmd.errors import InvalidRequest, shown

DEFAULT_LIMIT: Final = 20  # OpenAI's
MAX_LIMIT: Final = 100  # OpenAI's
MAX_PAGE_BYTES: Final = 8 * 1024 * 1024  # of a page's items past its first (estimated from their data)
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


@dataclass(frozen=True, slots=True)
class Item:
    """One listed item, not yet built: its id, its turn, and which of the turn's items it is
    (an assistant turn's text is -1, its calls 0, 1, ...; any other turn's one item is -1)."""

    id: str
    turn: ChatMessage
    call: int = -1


def page_of(query: Mapping[str, str], includes: Sequence[str]) -> Page:
    """The listing's parameters from a query (`includes`: every `include` / `include[]` value).
    400 naming the parameter for any value OpenAI would not take."""
    known_parameters(query, PARAMETERS)
    limit = DEFAULT_LIMIT
    if "limit" in query:
        text = query["limit"]
        # Digits first (int() takes other scripts' digits, and refuses 4,300 of them with an error).
        digits = text.lstrip("0")
        limit = int(digits) if text.isascii() and text.isdigit() and 0 < len(digits) <= 3 else 0
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"'limit' must be an integer from 1 to {MAX_LIMIT}", param="limit")
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


def input_items(turns: Sequence[ChatMessage], owner: str) -> list[Item]:
    """The input turns' items, oldest first, with their ids (nothing is built yet).

    The ids begin from the owner (the key that stored the response): the same conversation
    under another key has other ids, so an id seen somewhere confirms no guess of its
    conversation made with another key."""
    items: list[Item] = []
    chain = hashlib.sha256(b"edgellm input items\0" + owner.encode("utf-8", "surrogatepass") + b"\0")
    for turn in turns:
        chain.update(_digest(turn))
        at = chain.copy().digest()
        if turn.role == "assistant":
            if turn.content or not turn.tool_calls:
                items.append(Item(_item_id("msg_", at, -1), turn))
            items += [Item(_item_id("fc_", at, k), turn, k) for k in range(len(turn.tool_calls))]
        else:
            items.append(Item(_item_id("fco_" if turn.role == "tool" else "msg_", at, -1), turn))
    return items


def _item_id(prefix: str, at: bytes, place: int) -> str:
    """The id of a turn's item: the conversation's digest up to the turn (`at`), and its place."""
    return prefix + hashlib.sha256(at + place.to_bytes(4, "little", signed=True)).hexdigest()[:32]


def _digest(turn: ChatMessage) -> bytes:
    """What identifies a turn in its conversation."""
    parts: list[Any] = [turn.role, turn.content, list(turn.tool_calls), turn.tool_call_id, turn.name]
    parts.append([(m.kind, m.url, hashlib.sha256(m.data).hexdigest()) for m in turn.media])
    parts.append(list(turn.media_at))
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()


def listing(
    items: list[Item], page: Page, namespaces: Mapping[str, tuple[str, str]] | None = None
) -> dict[str, Any]:
    """One page of `items` (oldest first) in OpenAI's list object, built; 400 for an `after` it
    lacks. `namespaces`: the model's tool name -> (namespace, name), for calls to list."""
    ordered = list(reversed(items)) if page.descending else items
    start = 0
    if page.after is not None:
        found = next((i for i, item in enumerate(ordered) if item.id == page.after), None)
        if found is None:
            raise InvalidRequest(
                f"'after' {shown(page.after, quote=True)} is no input item of this response", param="after"
            )
        start = found + 1
    data: list[dict[str, Any]] = []
    size = 0
    for item in ordered[start : start + page.limit]:
        built, weight = _build(item, page.images, namespaces or {})
        if data and size + weight > MAX_PAGE_BYTES:
            break
        data.append(built)
        size += weight
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(data) < len(ordered),
    }


def _build(item: Item, images: bool, namespaces: Mapping[str, tuple[str, str]]) -> tuple[dict[str, Any], int]:
    """The item in OpenAI's shape, and about how many bytes it holds."""
    turn = item.turn
    if turn.role == "tool":
        built: dict[str, Any] = {
            "id": item.id,
            "type": "function_call_output",
            "call_id": turn.tool_call_id or "",
            "output": turn.content,
            "status": "completed",
        }
        return built, len(turn.content)
    if turn.role == "assistant" and item.call >= 0:
        call = turn.tool_calls[item.call]
        function = call.get("function", {})
        name, arguments = str(function.get("name", "")), str(function.get("arguments", ""))
        built = {"id": item.id, "type": "function_call", "call_id": call.get("id", "")}
        if name in namespaces:
            built["namespace"], name = namespaces[name]
        built.update({"name": name, "arguments": arguments, "status": "completed"})
        return built, len(arguments)
    if turn.role == "assistant":
        content = [{"type": "output_text", "text": turn.content, "annotations": []}]
        built = {
            "id": item.id,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": content,
        }
        return built, len(turn.content)
    parts = _input_parts(turn, images)
    built = {"id": item.id, "type": "message", "role": turn.role, "status": "completed", "content": parts}
    return built, sum(len(p.get("text") or p.get("image_url") or "") for p in parts)


def _input_parts(turn: ChatMessage, images: bool) -> list[dict[str, Any]]:
    """A user, system or developer turn's parts: its text between its images, as sent."""
    parts: list[dict[str, Any]] = []
    at = 0
    for media, offset in zip(turn.media, turn.media_at, strict=True):
        if turn.content[at:offset]:
            parts.append({"type": "input_text", "text": turn.content[at:offset]})
        if media.kind == "image":  # a clip has no part in OpenAI's message items
            parts.append(_image_part(media, images))
        at = offset
    if turn.content[at:] or not parts:
        parts.append({"type": "input_text", "text": turn.content[at:]})
    return parts


def _image_part(media: MediaInput, images: bool) -> dict[str, Any]:
    url = None
    if images:
        data = base64.b64encode(media.data).decode("ascii")
        url = media.url or f"data:image/{media.format or 'png'};base64,{data}"
    return {"type": "input_image", "detail": "auto", "file_id": None, "image_url": url}
