"""api.reply: a reply's parts read as the text streams, however the stream is cut."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellmd.api.reply import (
    CallArguments,
    CallEnd,
    CallStart,
    Part,
    ReasoningPart,
    ReasoningSplitter,
    ReplyReader,
    TextPart,
    ToolReplyReader,
)

NAMES = ("get_weather", "search")


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _read(reader: ToolReplyReader | ReplyReader, pieces: list[str]) -> list[Part]:
    parts: list[Part] = []
    for piece in pieces:
        parts += reader.feed(piece)
    if isinstance(reader, ReplyReader):
        parts += reader.finish()
    return parts


def _summary(parts: list[Part]) -> dict[str, Any]:
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    calls: dict[int, dict[str, Any]] = {}
    for p in parts:
        if isinstance(p, CallStart):
            calls[p.index] = {"name": p.name, "args": "", "ended": False}
        elif isinstance(p, CallArguments):
            calls[p.index]["args"] += p.delta
        elif isinstance(p, CallEnd):
            calls[p.index]["ended"] = True
    return {"text": text, "calls": [calls[i] for i in sorted(calls)]}


REPLIES = [
    ('{"response": "Hello \\"world\\"\\n\\u00e9\\ud83d\\ude00"}', 'Hello "world"\né😀', []),
    (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}]}',
        "",
        [("get_weather", {"city": "Oslo", "days": [1, 2]})],
    ),
    (
        '{ "tool_calls" : [\n  { "name" : "search" , "arguments" : { "q" : "a}]\\"b" } } ,\n'
        '  {"name": "get_weather", "arguments": {}}\n] }',
        "",
        [("search", {"q": 'a}]"b'}), ("get_weather", {})],
    ),
]


@pytest.mark.parametrize(("reply", "text", "calls"), REPLIES)
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
@settings(max_examples=60, deadline=None)
def test_any_cutting_of_the_stream_gives_the_same_parts(
    reply: str, text: str, calls: list[Any], cuts: list[int]
) -> None:
    reader = ToolReplyReader(NAMES)
    summary = _summary(_read(reader, _chunks(reply, cuts)))
    assert summary["text"] == text
    assert [(c["name"], json.loads(c["args"])) for c in summary["calls"]] == calls
    assert all(c["ended"] for c in summary["calls"])
    assert [c.name for c in reader.complete_calls] == [name for name, _ in calls]
    assert not reader.raw


def test_a_reply_cut_inside_a_call_keeps_only_the_complete_ones() -> None:
    reader = ToolReplyReader(NAMES)
    _read(
        reader,
        [
            '{"tool_calls": [{"name": "search", "arguments": {"q": "x"}}, ',
            '{"name": "get_weather", "arguments": {"city": "Os',
        ],
    )
    assert [c.name for c in reader.calls] == ["search", "get_weather"]
    assert [c.name for c in reader.complete_calls] == ["search"]


def test_text_that_is_not_the_tool_shape_is_plain_text() -> None:
    reader = ToolReplyReader(NAMES)
    assert _summary(_read(reader, ["Sure, ", "here it is"]))["text"] == "Sure, here it is"
    assert reader.raw


@pytest.mark.parametrize("opened", [False, True])
@given(cuts=st.lists(st.integers(0, 200), max_size=10))
@settings(max_examples=60, deadline=None)
def test_reasoning_is_split_from_the_answer_however_the_stream_is_cut(opened: bool, cuts: list[int]) -> None:
    reply = ("" if opened else "  <think>") + "Let me think </thin about it.</think>\n\nThe answer is 4."
    reader = ReplyReader(reasoning=ReasoningSplitter("<think>", "</think>", opened=opened))
    parts = _read(reader, _chunks(reply, cuts))
    assert "".join(p.text for p in parts if isinstance(p, ReasoningPart)) == "Let me think </thin about it."
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == "The answer is 4."
    assert reader.answer == "The answer is 4."


def test_a_reply_without_the_open_tag_is_all_answer() -> None:
    reader = ReplyReader(reasoning=ReasoningSplitter("<think>", "</think>"))
    parts = _read(reader, ["<thi", "s is not it"])
    assert reader.answer == "<this is not it"
    assert not [p for p in parts if isinstance(p, ReasoningPart)]


def test_reasoning_then_a_tool_call() -> None:
    reader = ReplyReader(tools=NAMES, reasoning=ReasoningSplitter("<think>", "</think>"))
    _read(reader, ['<think>call it</think>{"tool_calls": [{"name": "search", ', '"arguments": {"q": "x"}}]}'])
    assert reader.reasoning == "call it"
    assert [c.name for c in reader.calls] == ["search"]
    assert reader.answer == ""
