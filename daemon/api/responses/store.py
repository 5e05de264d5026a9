"""The Responses API's store: finished responses and their conversations, in memory, per API key, bounded.

`store: true` (the default, as OpenAI's) keeps a response so that `GET /v1/responses/{id}`
can show it and `previous_response_id` can continue its conversation. Nothing is written to
disk: a restart forgets everything. Each response belongs to the key that made it (one
anonymous owner when auth is off); another key's id looks exactly like an unknown one. The
store is bounded by count and by bytes (`responses.store_max_responses`, `store_max_mb`). When it
is full, room is made from the owner that holds the most (entries for the count bound, bytes for
the byte bound), that owner's oldest first: one key's flood of cheap calls evicts its own
responses, never a quieter key's, while a key alone on the box may still use the whole store
(and, having filled it, sees its oldest go when another key stores one: docs/security.md).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    inputs: int  # the conversation's first turns that were its input (GET .../input_items lists them)
    # The model's tool names of namespace functions -> (namespace, name), its chain's included.
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        owner: str,
        body: bytes,
        conversation: tuple[ChatMessage, ...],
        inputs: int | None = None,
        namespaces: Mapping[str, tuple[str, str]] | None = None,
    ) -> StoredResponse:
        """An entry, its size measured once; `inputs`: how many turns were input (default all)."""
        names = dict(namespaces or {})
        size = len(body) + sum(message_size(m) for m in conversation)
        size += sum(len(k) + len(n) + len(f) + MESSAGE_OVERHEAD_BYTES for k, (n, f) in names.items())
        held = len(conversation) if inputs is None else inputs
        return cls(owner, body, conversation, size, held, names)


def message_size(message: ChatMessage) -> int:
    """An estimate of what one turn holds in memory."""
    size = MESSAGE_OVERHEAD_BYTES + len(message.content.encode("utf-8", "replace"))
    size += sum(len(item.data) for item in message.media)  # its images and clips, as sent
    if message.tool_calls:
        size += len(json.dumps(message.tool_calls, ensure_ascii=False).encode("utf-8", "replace"))
    for text in (message.tool_call_id, message.name):
        if text is not None:
            size += len(text.encode("utf-8", "replace"))
    return size


class ResponseStore:
    """Stored responses by id, per owner oldest first; every lookup names its owner."""

    def __init__(self) -> None:
        self._entries: dict[str, StoredResponse] = {}
        self._owners: dict[str, OrderedDict[str, None]] = {}  # each owner's ids, oldest first
        self._owner_bytes: dict[str, int] = {}
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
        previous = self._entries.get(response_id)
        if previous is not None:  # ids are random: only a retried put meets its own
            self._remove(response_id, previous)
        while self._entries and len(self._entries) >= max_responses:
            self._evict_from(max(self._owners, key=lambda o: (len(self._owners[o]), o == entry.owner)))
        while self._entries and self._bytes + size > max_bytes:
            self._evict_from(max(self._owner_bytes, key=lambda o: (self._owner_bytes[o], o == entry.owner)))
        self._entries[response_id] = entry
        self._owners.setdefault(entry.owner, OrderedDict())[response_id] = None
        self._owner_bytes[entry.owner] = self._owner_bytes.get(entry.owner, 0) + size
        self._bytes += size
        return True

    def _evict_from(self, owner: str) -> None:
        oldest = next(iter(self._owners[owner]))
        self._remove(oldest, self._entries[oldest])

    def _remove(self, response_id: str, entry: StoredResponse) -> None:
        del self._entries[response_id]
        ids = self._owners[entry.owner]
        del ids[response_id]
        self._owner_bytes[entry.owner] -= entry.size
        if not ids:
            del self._owners[entry.owner], self._owner_bytes[entry.owner]
        self._bytes -= entry.size

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry, when it exists and belongs to `owner`."""
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget the entry; False when there was none of `owner`'s under that id."""
        entry = self.get(owner, response_id)
        if entry is None:
            return False
        self._remove(response_id, entry)
        return True

    def drop_owners(self, owners: set[str]) -> int:
        """Forget everything these owners stored (their keys were revoked or disabled); how many entries."""
        gone = [(rid, self._entries[rid]) for owner in owners for rid in self._owners.get(owner, ())]
        for response_id, entry in gone:
            self._remove(response_id, entry)
        return len(gone)

    def owners(self) -> set[str]:
        """The owners that have entries now."""
        return set(self._owners)

    def owned(self, owner: str) -> Sequence[str]:
        """The ids `owner` has stored, oldest first (for tests and diagnostics)."""
        return list(self._owners.get(owner, ()))
