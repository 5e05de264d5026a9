"""The Responses API's input items: stored chat turns as OpenAI's items, and their pages."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from openai.types.responses.response_item import ResponseItem
from pydantic import TypeAdapter

from edgellmd.api.responses.items import (
    IMAGE_URL,
    MAX_PAGE_BYTES,
    Page,
    input_items,
    listing,
    page_of,
)
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput
from edgellmd.errors import InvalidRequest

OWNER = "0123456789ab"  # the key that stored the response
PNG = b"\x89PNG\r\n\x1a\nnot really"
CLIP = b"RIFF....WAVE"
ITEM: Any = TypeAdapter(ResponseItem)  # what the openai SDK makes of an item


def _turns() -> tuple[ChatMessage, ...]:
    look = ChatMessage(
        "user",
        "before after",
        media=(MediaInput("image", PNG, "png"), MediaInput("audio", CLIP, "wav")),
        media_at=(6, 12),
    )
    fetched = ChatMessage(
        "user", "", media=(MediaInput("image", b"", None, url="https://pics.lan/a.png"),), media_at=(0,)
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "crm__get", "arguments": '{"a": 1}'}}
    plain = {"id": "call_2", "type": "function", "function": {"name": "a__b", "arguments": "{}"}}
    return (
        look,
        fetched,
        ChatMessage("assistant", "let me see", tool_calls=(call, plain)),
        ChatMessage("tool", "42", tool_call_id="call_1"),
    )


def _all(turns: tuple[ChatMessage, ...], **page: Any) -> list[dict[str, Any]]:
    listed = listing(
        input_items(turns, OWNER), Page(descending=False, limit=100, **page), {"crm__get": ("crm", "get")}
    )
    data: list[dict[str, Any]] = listed["data"]
    return data


def test_turns_become_items_with_their_parts_in_place() -> None:
    items = _all(_turns())
    kinds = ["message", "message", "message", "function_call", "function_call", "function_call_output"]
    assert [i["type"] for i in items] == kinds
    assert items[0]["content"] == [
        {"type": "input_text", "text": "before"},
        {"type": "input_image", "detail": "auto", "file_id": None, "image_url": None},  # not asked for
        {"type": "input_text", "text": " after"},  # the clip has no part in OpenAI's items
    ]
    assert items[2]["content"] == [{"type": "output_text", "text": "let me see", "annotations": []}]
    # A namespace's function under its own name; a name that merely holds "__" as it is.
    assert (items[3]["namespace"], items[3]["name"], items[3]["arguments"]) == ("crm", "get", '{"a": 1}')
    assert (items[4]["name"], "namespace" in items[4]) == ("a__b", False)
    assert (items[5]["call_id"], items[5]["output"]) == ("call_1", "42")
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "msg", "fc", "fc", "fco"]
    for item in items:  # every item as the SDK reads it, of the type it says
        parsed = ITEM.validate_python(item)
        assert parsed.type == item["type"]
        assert getattr(parsed, "role", None) == item.get("role")


def test_ids_are_the_same_in_every_response_of_a_chain_and_differ_between_turns() -> None:
    turns = _turns()
    ids = [i["id"] for i in _all(turns)]
    assert len(set(ids)) == len(ids)
    assert [i["id"] for i in _all(turns)] == ids  # stable
    longer = (*turns, ChatMessage("user", "and then?"))
    assert [i["id"] for i in _all(longer)][: len(ids)] == ids  # the next response of the chain
    other = (ChatMessage("user", "something else"), *turns[1:])
    assert not set(ids) & {i["id"] for i in _all(other)}  # another conversation


def test_image_data_only_when_included() -> None:
    items = _all(_turns(), images=True)
    assert items[0]["content"][1]["image_url"] == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert items[1]["content"] == [
        {"type": "input_image", "detail": "auto", "file_id": None, "image_url": "https://pics.lan/a.png"}
    ]


def test_pages_follow_after_in_either_order() -> None:
    items = input_items(_turns(), OWNER)
    ids = [i.id for i in items]
    whole = listing(items, Page(descending=False))
    assert ([i["id"] for i in whole["data"]], whole["has_more"]) == (ids, False)
    first = listing(items, Page(limit=2))
    assert ([i["id"] for i in first["data"]], first["has_more"]) == (ids[::-1][:2], True)
    rest = listing(items, Page(after=first["last_id"], limit=10))
    assert ([i["id"] for i in rest["data"]], rest["has_more"]) == (ids[::-1][2:], False)
    empty = listing(items, Page(after=ids[0]))  # the oldest, newest first: nothing after it
    assert (empty["data"], empty["first_id"], empty["last_id"], empty["has_more"]) == ([], None, None, False)
    with pytest.raises(InvalidRequest) as caught:
        listing(items, Page(after="msg_gone"))
    assert caught.value.param == "after"


def test_a_page_of_big_images_stops_early_and_says_there_is_more() -> None:
    big = b"\0" * (MAX_PAGE_BYTES // 2)
    turns = tuple(
        ChatMessage("user", "", media=(MediaInput("image", big, "png"),), media_at=(0,)) for _ in range(4)
    )
    items = input_items(turns, OWNER)
    page = listing(items, Page(limit=4, images=True))
    assert (len(page["data"]), page["has_more"]) == (1, True)  # each is 2/3 of the bound as base64
    nxt = listing(items, Page(limit=4, images=True, after=page["last_id"]))
    assert (len(nxt["data"]), nxt["has_more"]) == (1, True)
    assert len(listing(items, Page(limit=4))["data"]) == 4  # without their data, all of them


def test_the_query_is_read_as_openai_documents_it() -> None:
    assert page_of({}, []) == Page()
    assert page_of({"limit": "100", "order": "asc", "after": "msg_1"}, [IMAGE_URL]) == Page(
        "msg_1", 100, False, True
    )
    assert page_of({"limit": "007"}, []).limit == 7
    assert page_of({"limit": "0" * 4999 + "5"}, []).limit == 5  # zeros in front, as int() reads them
    assert page_of({}, ["reasoning.encrypted_content"]).images is False
    for query, includes, param in [
        ({"limit": "0"}, [], "limit"),
        ({"limit": "1e2"}, [], "limit"),
        ({"limit": "٣"}, [], "limit"),  # an Arabic-Indic digit: isdigit, not an integer here
        ({"limit": "9" * 5000}, [], "limit"),  # past int()'s digits: no ValueError
        ({"limit": "0" * 5000}, [], "limit"),
        ({"order": "DESC"}, [], "order"),
        ({"after": ""}, [], "after"),
        ({}, ["image_url"], "include"),
        ({"before": "x"}, [], "before"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            page_of(query, includes)
        assert caught.value.param == param


def test_the_same_conversation_under_another_key_has_other_ids() -> None:
    """The ids are the owner's: one seen somewhere confirms no guess made with another key
    (the same input sent by that key answers other ids), and they hold still for their owner."""
    mine = [i.id for i in input_items(_turns(), OWNER)]
    assert mine == [i.id for i in input_items(_turns(), OWNER)]
    theirs = [i.id for i in input_items(_turns(), "ba9876543210")]
    assert not set(mine) & set(theirs)
    assert [i.split("_")[0] for i in mine] == [i.split("_")[0] for i in theirs]  # the kinds stay
