"""OpenAI's response objects and their event streams, built from a reply's parts (`api.reply`).

One `Draft` follows a reply as it is generated: each part (answer text, reasoning, a tool
call's start, arguments and end) becomes the stream events OpenAI sends for it, and the
output items of the response object. Streamed and whole answers are built by the same code,
so they cannot differ. A reply cut short keeps only its complete calls in the answer; a call
the cut left unfinished is closed in the stream as `incomplete` and left out of the object.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from edgellmd.api.reply import CallArguments, CallEnd, CallStart, Part, ReasoningPart, TextPart
from edgellmd.api.responses.decode import NAMESPACE_JOINER
from edgellmd.api.session import ChoiceEnd
from edgellmd.engine.chat import ChatMessage
from edgellmd.errors import ApiError

# A failed response's error code: the one of OpenAI's codes (its SDK types list them) that fits
# every way a generation fails here (a model error, shutdown, a revoked key, no progress);
# the message says which.
SERVER_ERROR: Final = "server_error"


def new_id(prefix: str) -> str:
    """An id in OpenAI's form: `resp_`, `msg_`, `fc_`, `rs_` and 32 hex digits."""
    return prefix + uuid.uuid4().hex


@dataclass(slots=True)
class _Writing:
    """The message or reasoning item being written: its text so far."""

    kind: str  # "message" or "reasoning"
    id: str
    index: int  # its output index
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


class Draft:
    """One response as it is generated: its events, its output items, and the object around them."""

    def __init__(
        self, model: str, echo: Mapping[str, Any], namespaces: Mapping[str, tuple[str, str]] | None = None
    ) -> None:
        self.id = new_id("resp_")
        self.model = model
        self.echo = echo
        self.namespaces = namespaces or {}  # the model's tool name -> (namespace, name): decode.Tools
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self._seq = 0
        self._items: list[dict[str, Any] | None] = []  # by output index; None while being written
        self._left_out: set[int] = set()  # output indexes of calls the cut left unfinished
        self._writing: _Writing | None = None
        self._calls: dict[int, int] = {}  # a call's index in the reply -> its output index

    # ---- events ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """The events before any output: created, then in progress."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, part: Part) -> list[dict[str, Any]]:
        """The events for the next part of the reply."""
        if isinstance(part, TextPart):
            return self._text("message", part.text)
        if isinstance(part, ReasoningPart):
            return self._text("reasoning", part.text)
        if isinstance(part, CallStart):
            return self._call_start(part)
        return self._call_part(part)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        writing = self._writing
        events: list[dict[str, Any]] = []
        if writing is None or writing.kind != kind:
            events, writing = self._begin(kind)
        writing.parts.append(text)
        if kind == "message":
            events.append(
                self._event("response.output_text.delta", **self._where(writing), delta=text, logprobs=[])
            )
        else:
            events.append(self._event("response.reasoning_text.delta", **self._where(writing), delta=text))
        return events

    def _call_start(self, part: CallStart) -> list[dict[str, Any]]:
        events = self._close("completed")
        index = len(self._items)
        item = {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": part.id,
            "name": part.name,
            "arguments": "",
            "status": "in_progress",
        }
        if part.name in self.namespaces:  # a namespace's function: its own name, and the namespace
            item["namespace"], item["name"] = self.namespaces[part.name]
        self._items.append(item)
        self._calls[part.index] = index
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        return events

    def _call_part(self, part: CallArguments | CallEnd) -> list[dict[str, Any]]:
        index = self._calls.get(part.index)
        item = self._items[index] if index is not None else None
        if index is None or item is None:  # pragma: no cover - the reader starts every call first
            return []
        where = {"item_id": item["id"], "output_index": index}
        if isinstance(part, CallArguments):
            item["arguments"] += part.delta
            return [self._event("response.function_call_arguments.delta", **where, delta=part.delta)]
        item["status"] = "completed"
        return [
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def finish(self, end: ChoiceEnd) -> list[dict[str, Any]]:
        """The events that close the reply, ending with `response.completed` or `response.incomplete`."""
        cut = end.final.reason == "length"
        status = "incomplete" if cut else "completed"
        events = self._close(status)
        complete = {call.id for call in end.reader.calls}
        for index in self._calls.values():
            item = self._items[index]
            assert item is not None  # noqa: S101 - calls are never None
            if item["call_id"] in complete:
                continue
            self._left_out.add(index)
            if item["status"] == "in_progress":  # cut inside its arguments
                item["status"] = "incomplete"
                events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        if not self._items:  # nothing said at all: one empty message, as chat's content ""
            events += self._begin("message")[0]
            events += self._close(status)
        self.status = status
        self.incomplete = {"reason": "max_output_tokens"} if cut else None
        self.completed_at = int(time.time())
        prompt, completion = end.final.prompt_tokens, end.final.completion_tokens
        self.usage = {
            "input_tokens": prompt,
            # Prompt tokens whose KV came from an earlier request (a slot's, or the prompt cache).
            "input_tokens_details": {"cached_tokens": end.final.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
        events.append(self._event(f"response.{status}", response=self.response()))
        return events

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """The event that ends a reply the server could not finish."""
        self.status = "failed"
        self.error = {"code": SERVER_ERROR, "message": error.message}
        return [self._event("response.failed", response=self.response())]

    def _where(self, writing: _Writing) -> dict[str, Any]:
        return {"item_id": writing.id, "output_index": writing.index, "content_index": 0}

    def _begin(self, kind: str) -> tuple[list[dict[str, Any]], _Writing]:
        events = self._close("completed")
        writing = _Writing(kind, new_id("msg_" if kind == "message" else "rs_"), len(self._items))
        self._items.append(None)
        self._writing = writing
        if kind == "message":
            item, part = _message_item(writing.id, None, "in_progress"), _text_part("")
        else:
            item, part = (
                _reasoning_item(writing.id, None, "in_progress"),
                {"type": "reasoning_text", "text": ""},
            )
        events.append(self._event("response.output_item.added", output_index=writing.index, item=item))
        events.append(self._event("response.content_part.added", **self._where(writing), part=part))
        return events, writing

    def _close(self, status: str) -> list[dict[str, Any]]:
        writing, self._writing = self._writing, None
        if writing is None:
            return []
        text, where = writing.text, self._where(writing)
        if writing.kind == "message":
            item, part = _message_item(writing.id, text, status), _text_part(text)
            done = self._event("response.output_text.done", **where, text=text, logprobs=[])
        else:
            item, part = _reasoning_item(writing.id, text, status), {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", **where, text=text)
        self._items[writing.index] = item
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=writing.index, item=item),
        ]

    # ---- the object -----------------------------------------------------------------------------

    def output(self) -> list[dict[str, Any]]:
        """The finished output items, in order; calls cut short are left out."""
        return [
            item for index, item in enumerate(self._items) if item is not None and index not in self._left_out
        ]

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "model": self.model,
            "output": self.output(),
            "usage": self.usage,
            **self.echo,
        }

    def turns(self) -> tuple[ChatMessage, ...]:
        """The output as the conversation's next turn, for continuing it (reasoning is left out)."""
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for item in self.output():
            if item["type"] == "message":
                text.extend(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {
                            "name": f"{item['namespace']}{NAMESPACE_JOINER}{item['name']}"
                            if item.get("namespace")
                            else item["name"],
                            "arguments": item["arguments"],
                        },
                    }
                )
        return (ChatMessage("assistant", "".join(text), tool_calls=tuple(calls)),)
