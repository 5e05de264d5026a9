"""The Responses API's store: finished responses and their conversations, in memory, per API key, bounded.

`store: true` (the default, as OpenAI's) keeps a response so that `GET /v1/responses/{id}`
can show it and `previous_response_id` can continue its conversation. Nothing is written to
disk: a restart forgets everything. Each response belongs to the key that made it (one
anonymous owner when auth is off); another key's id looks exactly like an unknown one. The
store is bounded by count and by bytes (`responses.store_max_responses`, `store_max_mb`),
oldest first out.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from edgellmd.engine.chat import ChatMessage

RESPONSE_ID: Final = re.compile(r"resp_[0-9a-f]{32}")  # the ids this server makes (see new_response_id)
# What a message costs beyond its strings (the object, its tuple slot, the str headers): an
# estimate on the high side, so that the byte bound holds for conversations of many short turns.
MESSAGE_OVERHEAD_BYTES: Final = 256
ANONYMOUS: Final = ""  # the one owner when authentication is off


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response: its object as GET answers it, and its conversation for continuing it."""

    owner: str  # the API key id that made it
    body: bytes  # the response object's JSON
    conversation: tuple[ChatMessage, ...]  # every turn up to and including the response's output
    size: int  # bytes it is counted as: its JSON and its whole conversation (shared turns count in each)

    @classmethod
    def of(cls, owner: str, body: bytes, conversation: tuple[ChatMessage, ...]) -> StoredResponse:
        """An entry, its size measured once."""
        return cls(owner, body, conversation, len(body) + sum(message_size(m) for m in conversation))


def message_size(message: ChatMessage) -> int:
    """An estimate of what one turn holds in memory."""
    size = MESSAGE_OVERHEAD_BYTES + len(message.content.encode("utf-8", "replace"))
    if message.tool_calls:
        size += len(json.dumps(message.tool_calls, ensure_ascii=False).encode("utf-8", "replace"))
    for text in (message.tool_call_id, message.name):
        if text is not None:
            size += len(text.encode("utf-8", "replace"))
    return size


class ResponseStore:
    """Stored responses by id, oldest first; every lookup names its owner."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the stored entries are counted as, together."""
        return self._bytes

    def put(self, response_id: str, entry: StoredResponse, *, max_responses: int, max_bytes: int) -> bool:
        """Keep `entry`, evicting the oldest until it fits; False when it cannot fit at all."""
        size = entry.size
        if max_responses <= 0 or size > max_bytes:
            return False
        previous = self._entries.pop(response_id, None)
        if previous is not None:  # ids are random: only a retried put meets its own
            self._bytes -= previous.size
        while self._entries and (len(self._entries) >= max_responses or self._bytes + size > max_bytes):
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
        self._entries[response_id] = entry
        self._bytes += size
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry, when it exists and belongs to `owner`."""
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget the entry; False when there was none of `owner`'s under that id."""
        entry = self.get(owner, response_id)
        if entry is None:
            return False
        del self._entries[response_id]
        self._bytes -= entry.size
        return True

    def owned(self, owner: str) -> Sequence[str]:
        """The ids `owner` has stored, oldest first (for tests and diagnostics)."""
        return [rid for rid, entry in self._entries.items() if entry.owner == owner]
