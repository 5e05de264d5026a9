"""The Responses store: per owner, bounded by count and bytes, oldest out first."""

from __future__ import annotations

import pytest

from edgellmd.api.responses.encode import new_id
from edgellmd.api.responses.store import RESPONSE_ID, ResponseStore, StoredResponse, message_size
from edgellmd.engine.chat import ChatMessage

BIG = 1 << 30


def _entry(owner: str = "a", text: str = "hi") -> StoredResponse:
    return StoredResponse.of(
        owner, b'{"id": "x"}', (ChatMessage("user", text), ChatMessage("assistant", "yo"))
    )


def test_ids_have_the_shape_that_is_checked() -> None:
    assert RESPONSE_ID.fullmatch(new_id("resp_"))
    assert not RESPONSE_ID.fullmatch("resp_" + "g" * 32)


def test_an_owner_sees_only_its_own() -> None:
    store = ResponseStore()
    rid = new_id("resp_")
    assert store.put(rid, _entry("a"), max_responses=10, max_bytes=BIG)
    assert store.get("a", rid) is not None
    assert store.get("b", rid) is None
    assert not store.delete("b", rid)  # another owner cannot delete it either
    assert store.get("a", rid) is not None
    assert store.delete("a", rid)
    assert store.get("a", rid) is None
    assert store.bytes == 0


def test_the_oldest_go_first_when_the_count_is_reached() -> None:
    store = ResponseStore()
    ids = [new_id("resp_") for _ in range(4)]
    for rid in ids:
        store.put(rid, _entry(), max_responses=3, max_bytes=BIG)
    assert store.owned("a") == ids[1:]
    assert len(store) == 3


def test_the_oldest_go_first_when_the_bytes_are_reached() -> None:
    store = ResponseStore()
    size = _entry().size
    ids = [new_id("resp_") for _ in range(5)]
    for rid in ids:
        store.put(rid, _entry(), max_responses=100, max_bytes=2 * size + size // 2)
    assert store.owned("a") == ids[-2:]
    assert store.bytes == 2 * size


@pytest.mark.parametrize("max_responses", [0, 5])
def test_what_cannot_fit_is_not_stored(max_responses: int) -> None:
    store = ResponseStore()
    keep = new_id("resp_")
    store.put(keep, _entry(), max_responses=5, max_bytes=BIG)
    huge = _entry(text="x" * 10_000)
    assert not store.put(new_id("resp_"), huge, max_responses=max_responses, max_bytes=5_000)
    assert store.owned("a") == [keep]  # nothing was evicted for an entry that could never fit


def test_sizes_count_every_string_of_a_turn() -> None:
    plain = message_size(ChatMessage("user", "hello"))
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_call = message_size(ChatMessage("assistant", "hello", tool_calls=(call,)))
    assert with_call > plain
    assert message_size(ChatMessage("user", "é" * 10)) > message_size(ChatMessage("user", "e" * 10))


def test_a_flooding_owner_evicts_its_own_responses_never_a_quieter_ones() -> None:
    store = ResponseStore()
    kept = new_id("resp_")
    store.put(kept, _entry("a"), max_responses=10, max_bytes=BIG)
    flood = [new_id("resp_") for _ in range(200)]
    for rid in flood:
        assert store.put(rid, _entry("b"), max_responses=10, max_bytes=BIG)
    assert store.get("a", kept) is not None
    assert store.owned("b") == flood[-9:]  # b's oldest went, b's newest stayed
    assert len(store) == 10


def test_the_byte_bound_takes_from_the_owner_holding_the_most_bytes() -> None:
    store = ResponseStore()
    small, large = _entry("a"), _entry("b", text="x" * 4000)
    a_ids = [new_id("resp_") for _ in range(3)]
    for rid in a_ids:
        store.put(rid, small, max_responses=100, max_bytes=BIG)
    limit = 3 * small.size + 2 * large.size
    b_ids = [new_id("resp_") for _ in range(5)]
    for rid in b_ids:
        assert store.put(rid, large, max_responses=100, max_bytes=limit)
    assert store.owned("a") == a_ids  # fewer bytes: untouched
    assert store.owned("b") == b_ids[-2:]
    assert store.bytes <= limit
    # A new response of a's that needs room still takes it from b, which holds more bytes.
    medium = _entry("a", text="y" * 2000)
    assert store.put(new_id("resp_"), medium, max_responses=100, max_bytes=limit)
    assert store.owned("a")[:3] == a_ids
    assert store.owned("b") == b_ids[-1:]


def test_an_owner_alone_may_use_the_whole_store_and_its_entries_drop_with_it() -> None:
    store = ResponseStore()
    ids = [new_id("resp_") for _ in range(5)]
    for rid in ids:
        store.put(rid, _entry("a"), max_responses=5, max_bytes=BIG)
    store.put(new_id("resp_"), _entry("b"), max_responses=10, max_bytes=BIG)
    assert store.owned("a") == ids
    assert store.drop_owners({"a", "nobody"}) == 5
    assert store.owners() == {"b"}
    assert store.bytes == _entry("b").size
    assert store.get("a", ids[0]) is None
