"""JSON that travels inside a string meets the body's rules: depth, surrogates, long numbers.

The second hostile round reached two 500s with it: a lone surrogate escape inside a chat
assistant turn's `tool_calls[].function.arguments` (UnicodeEncodeError on its way to
llama.cpp) and 2,000-deep nesting there or in a Responses `function_call.arguments`
(RecursionError in the tool-turn rewriting). Each family now answers 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from edgellmd.api.jsontext import MAX_JSON_DEPTH, embedded_json
from edgellmd.api.reply import ToolCall, arguments_object
from edgellmd.engine.chat import MAX_ARGUMENT_DEPTH, ChatMessage, JinjaChatTemplate
from edgellmd.engine.tool_turns import tool_turns
from edgellmd.errors import InvalidRequest
from tests.serving import RunningDaemon

SURROGATE = json.dumps({"city": "\ud800"})  # '{"city": "\\ud800"}': valid JSON text, a lone surrogate inside
DEEP = "[" * 2000 + "]" * 2000
DEEP_OBJECT = '{"a": ' * 100 + "1" + "}" * 100
LONG_NUMBER = '{"n": ' + "9" * 5000 + "}"


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (SURROGATE, "lone UTF-16 surrogate"),
        (DEEP, f"nested deeper than {MAX_JSON_DEPTH} levels"),
        (DEEP_OBJECT, f"nested deeper than {MAX_JSON_DEPTH} levels"),
        (LONG_NUMBER, "number that is too long"),
        ("[" * 5000, f"nested deeper than {MAX_JSON_DEPTH} levels"),  # unterminated, and too deep to tell
        ('"\\udfff"', "lone UTF-16 surrogate"),
        ('  [{"k": ["\\ud83d"]}]', "lone UTF-16 surrogate"),
    ],
)
def test_embedded_json_is_refused_where_the_body_would_be(text: str, refused: str) -> None:
    with pytest.raises(InvalidRequest, match=refused) as caught:
        embedded_json(text, "messages[1].tool_calls[0].function.arguments")
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
    assert text not in caught.value.message


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{}",
        '{"city": "Paris", "emoji": "\\ud83d\\ude00"}',  # a pair is one character
        "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH,
        "not json at all",
        "{broken",
        "9" * 5000,  # a bare number nests nothing and parses as text downstream
        "[" * 10 + "x",  # not JSON: kept as the client's text
    ],
)
def test_embedded_json_within_the_rules_or_plain_text_passes(text: str) -> None:
    embedded_json(text, "arguments")


def _function(arguments: str) -> dict[str, str]:
    return {"name": "get_weather", "arguments": arguments}


def _chat(arguments: str, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }


def _responses(arguments: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_output_tokens": 2,
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    }


@pytest.mark.parametrize("arguments", [SURROGATE, DEEP], ids=["surrogate", "deep"])
@pytest.mark.parametrize("model", ["tiny", "builtin"])  # a Jinja template; chatml, rewritten into turns
def test_chat_tool_call_arguments_get_a_400_naming_them(
    daemon: RunningDaemon, arguments: str, model: str
) -> None:
    status, body = daemon.post("/v1/chat/completions", _chat(arguments, model))
    assert status == 400, body
    assert body["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("arguments", [SURROGATE, DEEP], ids=["surrogate", "deep"])
def test_responses_function_call_arguments_get_a_400_naming_them(
    daemon: RunningDaemon, arguments: str
) -> None:
    status, body = daemon.post("/v1/responses", _responses(arguments))
    assert status == 400, body
    assert body["error"]["param"] == "input[1].arguments"


def test_arguments_within_the_rules_still_answer(daemon: RunningDaemon) -> None:
    fine = json.dumps({"city": "Paris \U0001f600", "nested": [[["ok"]]]})
    status, body = daemon.post("/v1/chat/completions", _chat(fine, "tiny"))
    assert status == 200, body
    # Rewritten into turns, the conversation outgrows this model's 128 tokens: past the check.
    status, body = daemon.post("/v1/chat/completions", _chat(fine, "builtin"))
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
    status, body = daemon.post("/v1/responses", _responses(fine))
    assert status == 200, body


@pytest.mark.parametrize(
    "tool_input",
    [
        {"city": "\ud800"},  # json.dumps sends the escape; the body check refuses it
        json.loads("[" * 70 + "]" * 70),
    ],
    ids=["surrogate", "deep"],
)
def test_messages_tool_use_input_meets_the_body_rules_in_anthropics_shape(
    daemon: RunningDaemon, tool_input: Any
) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": tool_input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
    }
    status, answer = daemon.post("/v1/messages", body)
    assert status == 400, answer
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("depth", [60, 65, 300, 5000])
def test_arguments_the_model_wrote_itself_render_at_any_depth(depth: int) -> None:
    """A stored reply's calls (Responses' previous_response_id) were written by the model, which
    logit_bias can push to nest "[" as deep as max_tokens allows: the reply's reader, the
    template and the tool-turn rewriting take them without walking them recursively."""
    text = "[" * depth + "]" * depth
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}
    messages = (ChatMessage("user", "hi"), ChatMessage("assistant", "", tool_calls=(call,)))
    template = JinjaChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}",
        bos_token="",
        eos_token="",
        origin="test",
    )
    rendered = "".join(part for part, _ in template.render_segments(messages, None))
    turns = tool_turns(messages, None)
    assert "assistant:" in rendered
    assert turns[1].role == "assistant"
    # Compared as text: a failing comparison of values this deep would overflow the report.
    shown = json.dumps(json.loads(turns[1].content)["tool_calls"][0]["arguments"])
    assert shown == (json.dumps(text) if depth > MAX_ARGUMENT_DEPTH else text.replace("][", "], ["))
    parsed = arguments_object(ToolCall(0, "c1", "f", [text]))
    assert json.dumps(parsed) == ("{}" if depth == 5000 else text.replace("][", "], ["))
