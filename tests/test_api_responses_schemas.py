"""Responses bodies as the request model: input items as turns, flat tools and text.format as chat's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edgellmd.api.request import Limits
from edgellmd.api.responses.decode import ResponsesRequest, parse_responses
from edgellmd.engine.chat import ChatMessage
from edgellmd.errors import ApiError, InvalidRequest, UnsupportedParameter

LIMITS = Limits(max_tokens_limit=512, default_max_tokens=None)
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _parse(**body: Any) -> ResponsesRequest:
    return parse_responses({"model": "tiny", **body}, LIMITS)


def test_a_string_is_one_user_turn() -> None:
    body = _parse(input="hello", instructions="Be brief.")
    assert body.chat.messages == (ChatMessage("user", "hello"),)
    assert body.instructions == "Be brief."  # the handler puts it first, after any stored turns
    assert body.store
    assert body.chat.common.max_tokens == 512  # no max_output_tokens: the ceiling
    assert body.chat.common.n == 1


def test_items_become_turns() -> None:
    body = _parse(
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ]
    )
    system, user, assistant, out1, out2 = body.chat.messages
    assert system == ChatMessage("system", "Rules.")
    assert user == ChatMessage("user", "ab")
    assert assistant.role == "assistant"
    assert assistant.content == "Let me look."  # the reply's text and its calls: one turn
    assert [c["id"] for c in assistant.tool_calls] == ["c1", "c2"]
    assert assistant.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert (out1.role, out1.tool_call_id, out1.content) == ("tool", "c1", "one")
    assert (out2.tool_call_id, out2.content) == ("c2", "two")


def test_function_tools_become_chat_tools() -> None:
    body = _parse(input="hi", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    plan = body.chat.tools
    assert plan is not None
    assert plan.mode == "required"
    assert plan.names == ("get_weather",)
    assert plan.tools[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": WEATHER["parameters"],
            "description": "Current weather",
        },
    }
    assert body.chat.common.sampling.grammar == plan.grammar
    assert body.echo["tools"] == [{**WEATHER, "strict": True}]
    assert body.echo["tool_choice"] == {"type": "function", "name": "get_weather"}


def test_no_tools_and_auto_is_plain_text() -> None:
    body = _parse(input="hi", tools=[], tool_choice="auto")
    assert body.chat.tools is None
    assert body.chat.common.sampling.grammar is None


@pytest.mark.parametrize(
    ("text", "constrained"),
    [
        ({"format": {"type": "text"}}, False),
        ({"format": {"type": "json_object"}}, True),
        (
            {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
            True,
        ),
        ({"verbosity": "low"}, False),
    ],
)
def test_text_format(text: dict[str, Any], constrained: bool) -> None:
    body = _parse(input="hi", text=text)
    assert (body.chat.common.sampling.grammar is not None) is constrained
    assert body.echo["text"]["format"]["type"] == text.get("format", {"type": "text"})["type"]


def test_limits_and_echo() -> None:
    body = parse_responses(
        {"model": "tiny", "input": "hi", "metadata": {"k": "v"}, "user": "u1"},
        Limits(max_tokens_limit=64, default_max_tokens=32),
    )
    assert body.chat.common.max_tokens == 32
    assert body.chat.common.user == "u1"
    assert body.echo["metadata"] == {"k": "v"}
    assert body.echo["max_output_tokens"] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "tools": [
                    {
                        **WEATHER,
                        "strict": True,  # the exact subset: not relaxed (grammar.relax)
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "minLength": 1}},
                        },
                    }
                ]
            },
            "tools[0].parameters",
        ),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "p", "schema": {"type": "object", "allOf": []}}
                }
            },
            "text.format.schema",
        ),
    ],
)
def test_schema_refusals_name_this_apis_params(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _parse(input="hi", **body)
    assert isinstance(caught.value, UnsupportedParameter)
    assert caught.value.param == param
    assert "function." not in caught.value.message
    assert "response_format" not in caught.value.message


# ---- what Codex CLI sends: namespace tools, hosted tools ----------------------------------------

NAMESPACE: dict[str, Any] = {
    "type": "namespace",
    "name": "crm",
    "description": "The customer database",
    "tools": [
        {**WEATHER, "name": "lookup", "defer_loading": False, "allowed_callers": ["direct"]},
        {"type": "function", "name": "note", "parameters": None, "strict": False},
        {"type": "custom", "name": "freeform"},
    ],
}


def test_a_namespace_becomes_its_function_tools_and_hosted_tools_are_left_out() -> None:
    body = _parse(input="hi", tools=[WEATHER, NAMESPACE, {"type": "web_search"}])
    plan = body.chat.tools
    assert plan is not None
    assert plan.names == ("get_weather", "crm__lookup", "crm__note")
    assert body.namespaces == {"crm__lookup": ("crm", "lookup"), "crm__note": ("crm", "note")}
    echoed = body.echo["tools"]
    assert [t["type"] for t in echoed] == ["function", "namespace"]
    assert [t["name"] for t in echoed[1]["tools"]] == ["lookup", "note"]
    note = body.echo["metadata"]["edgellm_tools_left_out"]
    assert note == "tools this server cannot run were left out: crm.custom, web_search"


def test_only_hosted_tools_is_a_plain_answer_unless_a_call_is_forced() -> None:
    body = _parse(
        input="hi", tools=[{"type": "web_search"}, {"type": "code_interpreter"}], metadata={"a": "b"}
    )
    assert body.chat.tools is None
    assert body.echo["metadata"] == {
        "a": "b",
        "edgellm_tools_left_out": "tools this server cannot run were left out: code_interpreter, web_search",
    }
    # Metadata already holding OpenAI's 16 keys: a 17th (the note) is more than a client may
    # send back, so the note is left out.
    full = {f"k{i}": "v" for i in range(16)}
    assert _parse(input="hi", tools=[{"type": "web_search"}], metadata=full).echo["metadata"] == full
    with pytest.raises(UnsupportedParameter) as caught:
        _parse(input="hi", tools=[{"type": "web_search"}], tool_choice="required")
    assert caught.value.param == "tool_choice"
    with pytest.raises(UnsupportedParameter):
        _parse(input="hi", tools=[WEATHER, {"type": "web_search"}], tool_choice={"type": "web_search"})


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{**NAMESPACE, "name": "bad name"}], "tools[0].name"),
        ([{**NAMESPACE, "tools": []}], "tools[0].tools"),
        ([{**NAMESPACE, "tools": "lookup"}], "tools[0].tools"),
        ([{**NAMESPACE, "extra": 1}], "tools[0].extra"),
        ([{**NAMESPACE, "name": "n" * 60}], "tools[0].tools[0].name"),  # 60 + 2 + 6 characters: over 64
        ([{**NAMESPACE, "tools": [WEATHER, WEATHER]}], "tools[0].tools[1].name"),
        ([{**NAMESPACE, "tools": [{"type": "web_search"}]}], "tools[0].tools[0].type"),
        ([{**NAMESPACE, "tools": [5]}], "tools[0].tools[0]"),
        ([{**NAMESPACE, "tools": [WEATHER] * 129}], "tools[0].tools"),  # bounded before any is read
        (  # two namespaces of 100 functions: 200 in all
            [
                {**NAMESPACE, "name": f"n{i}", "tools": [{**WEATHER, "name": f"f{j}"} for j in range(100)]}
                for i in range(2)
            ],
            "tools",
        ),
        ([{"type": "web_search"}] * 129, "tools"),
    ],
)
def test_a_bad_namespace_is_a_400_naming_the_field(tools: list[Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _parse(input="hi", tools=tools)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_a_namespaced_call_sent_back_is_the_name_the_model_saw() -> None:
    body = _parse(
        tools=[NAMESPACE],
        input=[
            {"role": "user", "content": "look it up"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "lookup",
                "namespace": "crm",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    )
    (call,) = body.chat.messages[1].tool_calls
    assert call["function"]["name"] == "crm__lookup"


@pytest.mark.parametrize("kind", [[], {}, ["function"], {"x": 1}, [[]]])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "tools": [{"type": "KIND", "name": "f"}]}, "tools[0]"),
        ({"input": [{"role": "user", "content": [{"type": "KIND", "text": "x"}]}]}, "input[0].content[0]"),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "KIND", "text": "x"}],
                    }
                ]
            },
            "input[0].output[0]",
        ),
    ],
)
def test_a_type_that_is_a_list_or_an_object_is_a_400_not_a_500(
    kind: Any, body: dict[str, Any], param: str
) -> None:
    """Once, `type` reached a frozenset membership test before any check that it is a string:
    a list or an object cannot be hashed (TypeError, a 500)."""
    text = json.dumps(body).replace('"KIND"', json.dumps(kind))
    with pytest.raises(InvalidRequest) as caught:
        _parse(**json.loads(text))
    assert caught.value.param == param
