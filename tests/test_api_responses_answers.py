"""Response objects and events from reply parts: the shapes OpenAI's SDK types hold, cut calls left out."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from edgellmd.api.reply import ReasoningSplitter, ReplyReader
from edgellmd.api.responses.encode import Draft
from edgellmd.api.session import ChoiceEnd
from edgellmd.engine.generation import Finished, FinishReason
from edgellmd.errors import InternalError

# The SDK's event types by their `type`, to validate each event as the one it says it is.
EVENTS: dict[str, Any] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
ECHO: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "service_tier": "default",
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}, "verbosity": "medium"},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
}


def _run(
    pieces: list[str],
    reason: FinishReason = "stop",
    *,
    tools: tuple[str, ...] | None = None,
    think: bool = False,
) -> tuple[Draft, list[dict[str, Any]]]:
    """Feed the reply `pieces` (as the model streamed them) through a reader and a draft."""
    splitter = ReasoningSplitter("<think>", "</think>") if think else None
    reader = ReplyReader(tools=tools, reasoning=splitter)
    draft = Draft("tiny", ECHO)
    events = draft.start()
    for piece in pieces:
        for part in reader.feed(piece):
            events += draft.feed(part)
    for part in reader.finish():
        events += draft.feed(part)
    end = ChoiceEnd(0, Finished(reason, prompt_tokens=7, completion_tokens=len(pieces)), reader)
    events += draft.finish(end)
    return draft, events


def _check(draft: Draft, events: list[dict[str, Any]]) -> Response:
    """Every event and the object validate as the SDK's types; sequence numbers count from 0."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS[e["type"]].model_validate(e)
    return Response.model_validate(draft.response())


def test_plain_text() -> None:
    draft, events = _run(["Hel", "lo"])
    response = _check(draft, events)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert response.status == "completed"
    assert response.output_text == "Hello"
    assert response.id.startswith("resp_")
    assert (response.output[0].id or "").startswith("msg_")
    assert response.usage is not None
    assert response.usage.total_tokens == 9
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []


def test_an_empty_reply_is_one_empty_message() -> None:
    draft, events = _run([])
    response = _check(draft, events)
    assert response.output_text == ""
    assert [item.type for item in response.output] == ["message"]


def test_tool_calls_stream_their_arguments_and_hide_the_json() -> None:
    text = json.dumps({"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]})
    draft, events = _run([text[i : i + 3] for i in range(0, len(text), 3)], tools=("f", "g"))
    response = _check(draft, events)
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    first = response.output[0]
    assert first.type == "function_call"
    assert json.loads(first.arguments) == {"a": 1}
    assert first.call_id.startswith("call_")
    assert first.id is not None
    assert first.id.startswith("fc_")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == '{"a": 1}{}'
    assert not any('"tool_calls"' in json.dumps(e) for e in events)


def test_a_cut_call_is_closed_incomplete_and_left_out() -> None:
    text = '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b'
    draft, events = _run([text], "length", tools=("f", "g"))
    response = _check(draft, events)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["function_call"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(d["name"], d["status"]) for d in done] == [("f", "completed"), ("g", "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    assert '"tool_calls"' not in json.dumps(events)


def test_reasoning_comes_first_as_its_own_item() -> None:
    draft, events = _run(["<think>hm", "m</think>\n\nYes"], think=True)
    response = _check(draft, events)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None
    assert reasoning.content[0].text == "hmm"
    assert response.output_text == "Yes"
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_failure() -> None:
    draft = Draft("tiny", ECHO)
    events = draft.start() + draft.fail(InternalError("the model failed while generating"))
    response = _check(draft, events)
    assert response.status == "failed"
    assert response.error is not None
    assert response.error.message == "the model failed while generating"


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_turns_for_the_next_request(reason: FinishReason) -> None:
    text = json.dumps({"tool_calls": [{"name": "f", "arguments": {"a": 1}}]})
    draft, _ = _run([text], reason, tools=("f",))
    [turn] = draft.turns()
    assert turn.role == "assistant"
    assert turn.content == ""
    [call] = turn.tool_calls
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
