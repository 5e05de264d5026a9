"""The Responses API's input items: stored chat turns as OpenAI's items, and their pages."""

from __future__ import annotations

import base64

import pytest

from edgellmd.api.responses.items import IMAGE_URL, Page, input_items, listing, page_of
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput
from edgellmd.errors import InvalidRequest

PNG = b"\x89PNG\r\n\x1a\nnot really"
CLIP = b"RIFF....WAVE"


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
    call = {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
    return (
        look,
        fetched,
        ChatMessage("assistant", "let me see", tool_calls=(call,)),
        ChatMessage("tool", "42", tool_call_id="call_1"),
    )


def test_turns_become_items_with_their_parts_in_place() -> None:
    items = input_items("resp_x", _turns())
    assert [i["type"] for i in items] == [
        "message",
        "message",
        "message",
        "function_call",
        "function_call_output",
    ]
    assert items[0]["content"] == [
        {"type": "input_text", "text": "before"},
        {"type": "input_image", "detail": "auto", "file_id": None, "image_url": None},  # not asked for
        {"type": "input_text", "text": " after"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(CLIP).decode(), "format": "wav"}},
    ]
    assert items[2]["content"] == [{"type": "output_text", "text": "let me see", "annotations": []}]
    assert (items[3]["call_id"], items[3]["name"], items[3]["arguments"]) == ("call_1", "get", '{"a": 1}')
    assert (items[4]["call_id"], items[4]["output"]) == ("call_1", "42")
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "msg", "fc", "fco"]
    assert len({i["id"] for i in items}) == 5
    assert [i["id"] for i in items] == [i["id"] for i in input_items("resp_x", _turns())]  # stable
    assert all(a["id"] != b["id"] for a, b in zip(items, input_items("resp_y", _turns()), strict=True))


def test_image_data_only_when_included() -> None:
    items = input_items("resp_x", _turns(), images=True)
    assert items[0]["content"][1]["image_url"] == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert items[1]["content"] == [
        {"type": "input_image", "detail": "auto", "file_id": None, "image_url": "https://pics.lan/a.png"}
    ]


def test_pages_follow_after_in_either_order() -> None:
    items = input_items("resp_x", _turns())
    ids = [i["id"] for i in items]
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


def test_the_query_is_read_as_openai_documents_it() -> None:
    assert page_of({}, []) == Page()
    assert page_of({"limit": "100", "order": "asc", "after": "msg_1"}, [IMAGE_URL]) == Page(
        "msg_1", 100, False, True
    )
    assert page_of({}, ["reasoning.encrypted_content"]).images is False
    for query, includes, param in [
        ({"limit": "0"}, [], "limit"),
        ({"limit": "1e2"}, [], "limit"),
        ({"limit": "٣"}, [], "limit"),  # an Arabic-Indic digit: isdigit, not an integer here
        ({"order": "DESC"}, [], "order"),
        ({"after": ""}, [], "after"),
        ({}, ["image_url"], "include"),
        ({"before": "x"}, [], "before"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            page_of(query, includes)
        assert caught.value.param == param
