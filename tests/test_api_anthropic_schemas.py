"""Messages bodies: how they decode into the shared request model, and the table of bad inputs.

Every bad input answers a 4xx in Anthropic's shape, naming what is wrong, never a 5xx; the
table runs against the session's real daemon (tests/conftest.py: `tiny`, 256 tokens of
context, max_tokens_limit 512, 64 KiB bodies).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Final

import pytest

from edgellmd.api.anthropic.decode import (
    BLOCK_JOINER,
    TOOL_ERROR_PREFIX,
    parse_count_tokens,
    parse_messages,
)
from edgellmd.api.request import Limits
from edgellmd.engine.chat import ChatMessage
from edgellmd.errors import ApiError, InvalidRequest
from tests.serving import RunningDaemon

LIMITS: Final = Limits(max_tokens_limit=512, default_max_tokens=None)
HELLO: Final = [{"role": "user", "content": "hello"}]
WEATHER: Final = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(**fields: Any) -> dict[str, Any]:
    """A valid Messages body for `tiny`, with `fields` added or replaced (None removes one)."""
    out: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": HELLO, **fields}
    return {k: v for k, v in out.items() if v is not None}


def said(*blocks: Any, role: str = "user") -> dict[str, Any]:
    """A body whose one message holds these content blocks."""
    return body(messages=[{"role": role, "content": list(blocks)}])


# ---- decoding into the shared model -----------------------------------------------------------


def test_a_tool_conversation_becomes_chat_turns() -> None:
    parsed = parse_messages(
        body(
            system=[
                {"type": "text", "text": "Be brief."},
                {"type": "text", "text": "Be kind.", "cache_control": {}},
            ],
            messages=[
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},  # dropped
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "no"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            tools=[WEATHER],
        ),
        LIMITS,
    )
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})},
    }
    assert parsed.chat.messages == (
        ChatMessage("system", f"Be brief.{BLOCK_JOINER}Be kind."),
        ChatMessage("user", "Weather in Oslo?"),
        ChatMessage("assistant", "Let me look.", tool_calls=(call,)),
        ChatMessage("tool", "sunny", tool_call_id="toolu_1", name="get_weather"),
        ChatMessage("tool", TOOL_ERROR_PREFIX + "no", tool_call_id="toolu_1", name="get_weather"),
        ChatMessage("user", "And tomorrow?"),
    )
    tools = parsed.chat.tools
    assert tools is not None
    assert tools.mode == "auto"
    assert tools.names == ("get_weather",)
    assert tools.tools[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": WEATHER["input_schema"],
            "description": "Current weather",
        },
    }
    assert parsed.chat.common.sampling.grammar == tools.grammar


def test_an_empty_tools_list_is_no_tools() -> None:
    assert parse_messages(body(tools=[], tool_choice={"type": "none"}), LIMITS).chat.tools is None


def test_consecutive_turns_of_one_role_are_combined() -> None:
    parsed = parse_messages(
        body(
            messages=[
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "b"}]},
            ]
        ),
        LIMITS,
    )
    assert parsed.chat.messages == (ChatMessage("user", f"a{BLOCK_JOINER}b"),)


def test_a_system_message_inside_messages_joins_the_system_prompt() -> None:
    """Anthropic's mid-conversation system messages (Claude Code 2.1 sends one, with the
    `mid-conversation-system-2026-04-07` beta): chat templates take a system turn first only, so
    each joins the system prompt in order; any other role is still a 400."""
    parsed = parse_messages(
        body(
            system="Be kind.",
            messages=[
                *HELLO,
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "system", "content": "Agents: claude."},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "again"},
            ],
        ),
        LIMITS,
    )
    roles = [m.role for m in parsed.chat.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert parsed.chat.messages[0].content == "Be kind.\n\nBe brief.\n\nAgents: claude."
    only = parse_messages(body(messages=[{"role": "system", "content": "Rules."}, *HELLO]), LIMITS)
    assert (only.chat.messages[0].role, only.chat.messages[0].content) == ("system", "Rules.")
    with pytest.raises(InvalidRequest, match="must be user, assistant or system") as caught:
        parse_messages(body(messages=[*HELLO, {"role": "tool", "content": "x"}]), LIMITS)
    assert caught.value.param == "messages[1].role"
    with pytest.raises(InvalidRequest) as caught:
        parse_messages(body(messages=[{"role": "system", "content": "only rules"}]), LIMITS)
    assert caught.value.param == "messages"  # no user or assistant turn


def _call(call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "f", "input": {}}]}


def _result(call_id: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "ok"}]}


@pytest.mark.parametrize(
    "messages",
    [
        [*HELLO, _call("t1"), _result("t2")],  # answers no call
        [_result("t1")],  # nothing before it
        # a call answered once already, two messages back
        [*HELLO, _call("t1"), _result("t1"), {"role": "assistant", "content": "ok"}, _result("t1")],
        [*HELLO, _call("t1"), {"role": "user", "content": "x"}, _result("t1")],  # not the message before
    ],
    ids=["unknown id", "first message", "answered before", "two messages back"],
)
def test_a_tool_result_that_answers_no_tool_use_of_the_message_before_is_refused(
    messages: list[dict[str, Any]],
) -> None:
    """The second hostile round: Messages took a tool_result whose tool_use_id matched no
    tool_use (Responses refused the same); Anthropic's API refuses it with a 400."""
    with pytest.raises(InvalidRequest, match="unexpected tool_use_id") as caught:
        parse_messages(body(messages=messages), LIMITS)
    assert caught.value.param is not None
    assert caught.value.param.endswith(".content[0].tool_use_id")


def test_results_that_answer_the_calls_of_the_message_before_pass() -> None:
    two = {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": {}},
            {"type": "tool_use", "id": "b", "name": "g", "input": {}},
        ],
    }
    answers = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "b", "content": "2"},
            {"type": "tool_result", "tool_use_id": "a", "content": "1"},
        ],
    }
    parsed = parse_messages(body(messages=[*HELLO, two, answers, _call("c"), _result("c")]), LIMITS)
    assert [m.tool_call_id for m in parsed.chat.messages if m.role == "tool"] == ["b", "a", "c"]


def test_sampling_stop_and_user() -> None:
    parsed = parse_messages(
        body(
            temperature=0.5,
            top_p=0.9,
            top_k=7,
            stop_sequences=["END", ""],
            metadata={"user_id": "u-1"},
            stream=True,
            service_tier="auto",
        ),
        LIMITS,
    )
    common = parsed.chat.common
    assert (common.sampling.temperature, common.sampling.top_p, common.sampling.top_k) == (0.5, 0.9, 7)
    assert common.stop == ("END",)
    assert common.user == "u-1"
    assert common.stream is True
    assert common.max_tokens == 4
    assert common.n == 1
    assert parsed.show_thinking is True
    assert parsed.chat.tools is None


@pytest.mark.parametrize(
    ("choice", "mode", "one_call"),
    [
        ({"type": "auto"}, "auto", False),
        ({"type": "any"}, "required", False),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", True),
        ({"type": "tool", "name": "get_weather"}, "required", False),
        ({"type": "none"}, "none", False),
    ],
)
def test_tool_choice_maps_onto_chats(choice: dict[str, Any], mode: str, one_call: bool) -> None:
    two = [WEATHER, {**WEATHER, "name": "get_time"}]  # one call per tool offered, unless one is asked
    tools = parse_messages(body(tools=two, tool_choice=choice), LIMITS).chat.tools
    assert tools is not None
    assert tools.mode == mode
    assert (tools.grammar is None) == (mode == "none")
    if one_call:
        several = parse_messages(body(tools=two, tool_choice={"type": "any"}), LIMITS).chat.tools
        assert several is not None
        assert tools.grammar != several.grammar  # at most one call


@pytest.mark.parametrize(
    ("thinking", "shown"),
    [
        (None, True),
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, False),
        ({"type": "disabled"}, False),
    ],
)
def test_thinking_says_whether_reasoning_is_shown(thinking: dict[str, Any] | None, shown: bool) -> None:
    assert parse_messages(body(max_tokens=2000, thinking=thinking), Limits(4096, None)).show_thinking is shown


def test_count_tokens_takes_the_conversation_and_tools() -> None:
    counted = parse_count_tokens({"model": "tiny", "messages": HELLO, "tools": [WEATHER], "system": "x"})
    assert counted.model == "tiny"
    assert counted.messages == (ChatMessage("system", "x"), ChatMessage("user", "hello"))
    assert counted.tools is not None
    assert counted.tools.names == ("get_weather",)


def test_schema_refusals_name_the_messages_fields() -> None:
    with pytest.raises(ApiError) as caught:
        parse_messages(
            body(
                tools=[{**WEATHER, "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}]
            ),
            LIMITS,
        )
    assert "tools[0].input_schema" in caught.value.message
    assert "function" not in caught.value.message
    with pytest.raises(ApiError) as bad_format:
        parse_messages(
            body(output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}}), LIMITS
        )
    assert "output_config.format" in bad_format.value.message
    assert "response_format" not in bad_format.value.message


# ---- the bad-input table, over the wire ---------------------------------------------------------

LONG_NAME: Final = "k" * 500
BAD: Final[list[tuple[str, dict[str, Any], str]]] = [
    # (what, body, a piece of the message)
    ("no max_tokens", body(max_tokens=None), "'max_tokens' is required"),
    ("max_tokens a string", body(max_tokens="5"), "'max_tokens' must be an integer"),
    ("max_tokens a boolean", body(max_tokens=True), "'max_tokens' must be an integer"),
    ("max_tokens zero", body(max_tokens=0), "at least 1"),
    ("max_tokens past the server's", body(max_tokens=10**40), "at most 512"),
    ("max_tokens a float", body(max_tokens=4.0), "'max_tokens' must be an integer"),
    ("no model", body(model=None), "'model' is required"),
    ("model a number", body(model=5), "'model' must be a non-empty string"),
    ("no messages", body(messages=None), "'messages' is required"),
    ("empty messages", body(messages=[]), "non-empty list"),
    ("messages a string", body(messages="hi"), "non-empty list"),
    ("message not an object", body(messages=["hi"]), "'messages[0]' must be an object"),
    ("tool role", body(messages=[{"role": "tool", "content": "x"}]), "must be user, assistant or system"),
    (
        "only a system turn",
        body(messages=[{"role": "system", "content": "x"}]),
        "at least one user or assistant",
    ),
    ("no content", body(messages=[{"role": "user"}]), "'messages[0].content' is required"),
    (
        "unknown message field",
        body(messages=[{"role": "user", "content": "x", "name": "a"}]),
        "messages[0].name",
    ),
    ("content a number", body(messages=[{"role": "user", "content": 5}]), "string or a list"),
    ("block without type", said({"text": "x"}), "with a 'type'"),
    ("unknown block type", said({"type": "bogus"}), "'bogus'"),
    ("image block without a source type", said({"type": "image", "source": {}}), "source.type"),
    ("image block by file", said({"type": "image", "source": {"type": "file", "file_id": "f"}}), "file_id"),
    (
        "image block of another media type",
        said({"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AA=="}}),
        "media_type",
    ),
    (
        "image block not base64",
        said({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%"}}),
        "base64",
    ),
    ("document block", said({"type": "document", "source": {}}), "'document'"),
    (
        "server tool block",
        said({"type": "server_tool_use", "id": "x"}, role="assistant"),
        "'server_tool_use'",
    ),
    ("tool_use from the user", said({"type": "tool_use", "id": "t", "name": "f", "input": {}}), "'tool_use'"),
    (
        "tool_result from the assistant",
        said({"type": "tool_result", "tool_use_id": "t"}, role="assistant"),
        "'tool_result'",
    ),
    ("text not a string", said({"type": "text", "text": 5}), "content[0].text' must be a string"),
    ("unknown block field", said({"type": "text", "text": "x", "foo": 1}), "content[0].foo"),
    (
        "tool_use input a list",
        body(
            messages=[
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]},
                *HELLO,
            ]
        ),
        "input' must be an object",
    ),
    (
        "tool_use id odd",
        body(
            messages=[
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "a b", "name": "f", "input": {}}],
                },
                *HELLO,
            ]
        ),
        "'messages[0].content[0].id'",
    ),
    (
        "tool_result without id",
        said({"type": "tool_result", "content": "x"}),
        "tool_use_id' must be a string",
    ),
    (
        "tool_result image without a source",
        said({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}),
        "source' must be an object",
    ),
    (
        "is_error a string",
        said({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}),
        "is_error' must be a boolean",
    ),
    ("system a number", body(system=5), "'system' must be a string or a list of text blocks"),
    ("system image", body(system=[{"type": "image"}]), "'image'"),
    ("prefill", body(messages=[*HELLO, {"role": "assistant", "content": "The answer is"}]), "prefill"),
    ("only empty turns", body(messages=[{"role": "user", "content": []}]), "at least one user"),
    ("tools not a list", body(tools={"name": "f"}), "'tools' must be a list"),
    ("no tools but a choice", body(tools=[], tool_choice={"type": "any"}), "needs 'tools'"),
    (
        "web search tool",
        body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "'web_search_20250305'",
    ),
    ("bash tool", body(tools=[{"type": "bash_20250124", "name": "bash"}]), "'bash_20250124'"),
    ("tool without schema", body(tools=[{"name": "f"}]), "'tools[0].input_schema'"),
    ("schema not an object", body(tools=[{"name": "f", "input_schema": {"type": "string"}}]), "type object"),
    ("tool name with a space", body(tools=[{**WEATHER, "name": "get weather"}]), "'tools[0].name'"),
    ("unknown tool field", body(tools=[{**WEATHER, "foo": 1}]), "tools[0].foo"),
    ("duplicate tools", body(tools=[WEATHER, WEATHER]), "unique"),
    (
        "unsupported schema keyword",
        body(
            tools=[
                {
                    **WEATHER,
                    "strict": True,  # held to the exact subset (a tool that is not strict is relaxed)
                    "input_schema": {
                        "type": "object",
                        "properties": {"a": {"type": "string", "format": "bogus-format"}},
                    },
                }
            ]
        ),
        "tools[0].input_schema",
    ),
    ("tool_choice a string", body(tools=[WEATHER], tool_choice="auto"), "'tool_choice' must be an object"),
    (
        "tool_choice required",
        body(tools=[WEATHER], tool_choice={"type": "required"}),
        "auto, any, tool or none",
    ),
    (
        "tool_choice unknown tool",
        body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
        "name one of the tools",
    ),
    ("tool_choice without tools", body(tool_choice={"type": "any"}), "needs 'tools'"),
    (
        "disable_parallel a string",
        body(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": "y"}),
        "must be a boolean",
    ),
    ("stop_sequences a string", body(stop_sequences="x"), "list of strings"),
    ("stop_sequences numbers", body(stop_sequences=[1]), "list of strings"),
    ("too many stop sequences", body(stop_sequences=[str(i) for i in range(9)]), "at most 8"),
    ("a long stop sequence", body(stop_sequences=["x" * 257]), "at most 256"),
    ("temperature past 1", body(temperature=1.5), "between 0 and 1"),
    ("temperature negative", body(temperature=-0.1), "between 0 and 1"),
    ("temperature a string", body(temperature="hot"), "must be a number"),
    ("temperature huge", body(temperature=10**400), "must be a finite number"),
    ("top_p past 1", body(top_p=2), "between 0 and 1"),
    ("top_k negative", body(top_k=-1), "'top_k'"),
    ("top_k a float", body(top_k=1.5), "'top_k' must be an integer"),
    ("metadata a string", body(metadata="x"), "'metadata' must be an object"),
    ("user_id a number", body(metadata={"user_id": 5}), "'metadata.user_id' must be a string"),
    ("user_id too long", body(metadata={"user_id": "u" * 257}), "at most 256"),
    ("unknown metadata", body(metadata={"foo": 1}), "metadata.foo"),
    ("stream a string", body(stream="yes"), "'stream' must be a boolean"),
    ("thinking a number", body(thinking=5), "'thinking' must be an object"),
    (
        "thinking without budget",
        body(thinking={"type": "enabled"}),
        "'thinking.budget_tokens' must be an integer",
    ),
    (
        "thinking budget small",
        body(max_tokens=500, thinking={"type": "enabled", "budget_tokens": 10}),
        "at least 1024",
    ),
    (
        "thinking budget past max_tokens",
        body(max_tokens=500, thinking={"type": "enabled", "budget_tokens": 2048}),
        "less than 'max_tokens'",
    ),
    ("thinking unknown type", body(thinking={"type": "always"}), "enabled, adaptive or disabled"),
    ("output format unknown", body(output_config={"format": {"type": "yaml"}}), "json_schema"),
    (
        "output format beside tools, still checked",
        body(tools=[WEATHER], tool_choice={"type": "any"}, output_config={"format": {"type": "json_schema"}}),
        "output_config.format.schema",
    ),
    ("unknown output_config field", body(output_config={"foo": 1}), "output_config.foo"),
    ("service tier unknown", body(service_tier="priority"), "auto or standard_only"),
    ("unknown field", body(foo=1), "foo: Extra inputs are not permitted"),
    ("a long unknown field is not echoed", body(**{LONG_NAME: 1}), "(unprintable)"),
    ("container", body(container="c"), "'container' is not supported"),
    ("mcp servers", body(mcp_servers=[]), "'mcp_servers' is not supported"),
    ("OpenAI's max_completion_tokens", body(max_completion_tokens=4), "max_completion_tokens"),
    ("a prompt past the context", body(messages=[{"role": "user", "content": "x" * 400}]), "context"),
    ("a model without a chat template", body(model="notemplate"), "chat template"),
    (
        "a result that answers no call",
        body(messages=[*HELLO, _call("t1"), _result("t9")]),
        "unexpected tool_use_id",
    ),
]


def post(
    daemon: RunningDaemon, path: str, raw: bytes, content_type: str = "application/json"
) -> tuple[int, Any]:
    request = urllib.request.Request(  # noqa: S310 - loopback URL
        daemon.url + path, data=raw, headers={"Content-Type": content_type}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310 - loopback URL
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def anthropic_error(answer: Any) -> dict[str, str]:
    assert set(answer) == {"type", "error"}
    assert answer["type"] == "error"
    error: dict[str, str] = answer["error"]
    assert set(error) == {"type", "message"}
    assert error["message"]
    return error


@pytest.mark.parametrize(("what", "bad", "piece"), BAD, ids=[what for what, _, _ in BAD])
def test_bad_inputs_are_400s_in_anthropics_shape(
    daemon: RunningDaemon, what: str, bad: dict[str, Any], piece: str
) -> None:
    del what
    status, answer = post(daemon, "/v1/messages", json.dumps(bad).encode())
    assert status == 400, answer
    error = anthropic_error(answer)
    assert error["type"] == "invalid_request_error"
    assert piece in error["message"]
    assert LONG_NAME not in error["message"]


@pytest.mark.parametrize(
    ("raw", "content_type", "status", "piece"),
    [
        (b"{", "application/json", 400, "not valid JSON"),
        (b"[]", "application/json", 400, "must be an object"),
        (b"\xff", "application/json", 400, "UTF-8"),
        (b'{"model": "tiny"}', "text/plain", 415, "must be JSON"),
        (
            json.dumps(body(messages=[{"role": "user", "content": "x" * 70000}])).encode(),
            "application/json",
            413,
            "too large",
        ),
        (json.dumps(body(model="nope")).encode(), "application/json", 404, "does not exist"),
    ],
)
def test_bodies_that_do_not_parse_or_do_not_fit(
    daemon: RunningDaemon, raw: bytes, content_type: str, status: int, piece: str
) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        got, answer = post(daemon, path, raw, content_type)
        if path.endswith("count_tokens") and status == 404 and got == 400:
            continue  # the Messages body carries max_tokens, which count_tokens refuses first
        assert got == status, (path, answer)
        error = anthropic_error(answer)
        assert (
            error["type"]
            == {
                400: "invalid_request_error",
                404: "not_found_error",
                413: "request_too_large",
                415: "invalid_request_error",
            }[status]
        )
        assert piece in error["message"]


@pytest.mark.parametrize(
    ("bad", "piece"),
    [
        ({"model": "tiny"}, "'messages' is required"),
        ({"model": "tiny", "messages": HELLO, "max_tokens": 4}, "max_tokens: Extra inputs are not permitted"),
        ({"model": "tiny", "messages": HELLO, "stream": True}, "stream: Extra inputs are not permitted"),
        (
            {"model": "tiny", "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "w"}]},
            "'web_search_20250305'",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]}, "context"),
    ],
)
def test_bad_count_tokens_bodies(daemon: RunningDaemon, bad: dict[str, Any], piece: str) -> None:
    status, answer = post(daemon, "/v1/messages/count_tokens", json.dumps(bad).encode())
    assert status == 400, answer
    assert piece in anthropic_error(answer)["message"]


def test_count_tokens_of_the_shared_daemons_model(daemon: RunningDaemon) -> None:
    status, answer = post(
        daemon, "/v1/messages/count_tokens", json.dumps({"model": "tiny", "messages": HELLO}).encode()
    )
    assert status == 200
    assert answer == {"input_tokens": 1 + len(b"<|user|>hello\n<|assistant|>")}  # BOS, one token per byte


LOOPING: Final[dict[str, Any]] = {  # refers back to itself before any value: found building a grammar
    "type": "object",
    "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
    "properties": {"a": {"$ref": "#/$defs/x"}},
}


@pytest.mark.parametrize(
    "extra",
    [
        {
            "tools": [
                {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"type": "strin"}}}}
            ]
        },
        {"tools": [{**WEATHER, "input_schema": LOOPING}]},
        {
            "output_config": {
                "format": {"type": "json_schema", "schema": {"type": "object", "minProperties": -1}}
            }
        },
        {"output_config": {"format": {"type": "json_schema", "schema": LOOPING}}},
    ],
)
def test_count_tokens_refuses_every_schema_messages_refuses(extra: dict[str, Any]) -> None:
    """Once, count_tokens built no grammar and so passed a left-recursive schema (200) that
    /v1/messages refused (400): a refusal that comes only from building one."""
    with pytest.raises(ApiError) as by_messages:
        parse_messages(body(**extra), LIMITS)
    with pytest.raises(ApiError) as by_count:
        parse_count_tokens({"model": "tiny", "messages": HELLO, **extra})
    assert by_count.value.status == by_messages.value.status == 400
    assert by_count.value.param == by_messages.value.param
    counted = parse_count_tokens({"model": "tiny", "messages": HELLO, "tools": [WEATHER]})
    assert counted.tools is not None
    assert counted.tools.instructions  # the prompt is rendered as a reply's would be
