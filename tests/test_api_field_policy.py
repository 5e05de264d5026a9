"""The unknown-field policy, fed by the request shapes of the SDKs installed with the project:
every field the official APIs take is known here (served, accepted and ignored, or refused by
name as unsupported), and a truly unknown field is still 400 `unknown_parameter`.

When a new `openai` or `anthropic` release adds a request field, the first test here fails
until the field is given its place in a decoder (and the README's table says which).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import pytest
from anthropic.types import ToolParam, message_count_tokens_params, message_create_params
from openai.types import completion_create_params as legacy_params
from openai.types.chat import ChatCompletionFunctionToolParam
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import FunctionToolParam, response_create_params
from openai.types.shared_params import (
    FunctionDefinition,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    ResponseFormatText,
)

from edgellmd.api.anthropic import decode as anthropic_decode
from edgellmd.api.openai import decode as openai_decode
from edgellmd.api.request import Limits
from edgellmd.api.responses import decode as responses_decode
from edgellmd.errors import InvalidRequest, UnsupportedParameter

LIMITS: Final = Limits(max_tokens_limit=512, default_max_tokens=None)
# On the wire from clients, though not (yet) in the SDK's own parameter types.
WIRE_ONLY: Final = {"responses": {"client_metadata"}}


def _fields(params: Any) -> set[str]:
    return set(params.__required_keys__ | params.__optional_keys__)


@pytest.mark.parametrize(
    ("family", "params", "known"),
    [
        ("chat", chat_params.CompletionCreateParamsBase, openai_decode._CHAT_FIELDS),
        ("completions", legacy_params.CompletionCreateParamsBase, openai_decode._COMPLETION_FIELDS),
        ("responses", response_create_params.ResponseCreateParamsBase, responses_decode._FIELDS),
        ("messages", message_create_params.MessageCreateParamsBase, anthropic_decode._MESSAGE_FIELDS),
        (
            "count_tokens",
            message_count_tokens_params.MessageCountTokensParams,
            anthropic_decode._COUNT_FIELDS,
        ),
    ],
)
def test_every_field_the_current_sdks_send_is_known(family: str, params: Any, known: frozenset[str]) -> None:
    sdk = _fields(params) | WIRE_ONLY.get(family, set())
    unsupported = anthropic_decode._UNSUPPORTED_FIELDS if family in ("messages", "count_tokens") else set()
    assert sdk - known - unsupported == set(), (
        f"{family}: fields the SDK sends that this server calls unknown"
    )


@pytest.mark.parametrize(
    ("family", "params", "known"),
    [
        ("messages tools", ToolParam, anthropic_decode._TOOL_FIELDS),
        ("responses function tools", FunctionToolParam, responses_decode._FUNCTION_TOOL_KEYS),
    ],
)
def test_every_tool_field_the_current_sdks_send_is_known(
    family: str, params: Any, known: frozenset[str]
) -> None:
    """Tool definitions too: Claude Code 2.1 sends `defer_loading` on some of its tools, which a
    server that knew only the older fields refused mid-session."""
    assert _fields(params) - known == set(), f"{family}: fields the SDK sends that this server calls unknown"


@pytest.mark.parametrize(
    ("params", "known"),
    [
        (ChatCompletionFunctionToolParam, openai_decode._TOOL_FIELDS),
        (FunctionDefinition, openai_decode._FUNCTION_FIELDS),
        (ResponseFormatText, openai_decode._FORMAT_FIELDS["text"]),
        (ResponseFormatJSONObject, openai_decode._FORMAT_FIELDS["json_object"]),
        (ResponseFormatJSONSchema, openai_decode._FORMAT_FIELDS["json_schema"]),
    ],
)
def test_chat_knows_every_nested_field_the_sdk_sends(params: Any, known: frozenset[str]) -> None:
    assert _fields(params) == set(known)


CHAT: Final = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL: Final = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object", "foo": 1}}, "response_format.foo"),
        ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema"),
        ({"tools": [TOOL | {"foo": 1}]}, "tools[0].foo"),
        (
            {"tools": [TOOL, {"type": "function", "function": {"name": "g", "foo": 1}}]},
            "tools[1].function.foo",
        ),
    ],
)
def test_chat_refuses_an_unknown_nested_field_as_a_top_level_one(extra: dict[str, Any], param: str) -> None:
    """Unknown keys in response_format, a tool or its function were taken and ignored, where
    the same key elsewhere (json_schema, a message) was a 400."""
    with pytest.raises(InvalidRequest) as caught:
        openai_decode.parse_chat(CHAT | extra, LIMITS)
    assert (caught.value.code, caught.value.param) == ("unknown_parameter", param)


@pytest.mark.parametrize("name", ["", "a b", "x\u0000", "é", "n" * 65])
def test_a_json_schema_name_is_what_openai_takes(name: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": {"type": "object"}}}
    with pytest.raises(InvalidRequest) as caught:
        openai_decode.parse_chat(CHAT | {"response_format": fmt}, LIMITS)
    assert caught.value.param == "response_format.json_schema.name"


def test_a_prompt_list_of_mixed_items_is_not_several_prompts() -> None:
    body = {"model": "m", "prompt": [1, "a"]}
    with pytest.raises(InvalidRequest) as caught:
        openai_decode.parse_completion(body, LIMITS)
    assert not isinstance(caught.value, UnsupportedParameter)
    assert "must be a string or a list of token ids" in str(caught.value)


MESSAGE: Final = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def test_a_messages_tool_with_the_newer_fields_is_accepted_and_they_are_checked() -> None:
    tool = {
        "name": "read",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        "defer_loading": True,
        "allowed_callers": ["direct"],
        "eager_input_streaming": False,
        "input_examples": [{"path": "a.txt"}],
    }
    parsed = anthropic_decode.parse_messages(MESSAGE | {"tools": [tool]}, LIMITS)
    assert parsed.chat.tools is not None
    assert parsed.chat.tools.names == ("read",)
    with pytest.raises(InvalidRequest, match=r"tools\[0\]\.defer_loading' must be true or false"):
        anthropic_decode.parse_messages(MESSAGE | {"tools": [tool | {"defer_loading": "yes"}]}, LIMITS)


CLAUDE_CODE_EDITS: Final = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}


def test_what_the_current_anthropic_sdk_and_claude_code_send_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = MESSAGE | {
        "speed": "fast",
        "inference_geo": "eu",
        "diagnostics": {"previous_message_id": None},
        "user_profile_id": "up_1",
        "workspace_id": "wrkspc_1",
        "context_management": CLAUDE_CODE_EDITS,
    }
    with caplog.at_level(logging.DEBUG, logger="edgellmd.api.fields"):
        parsed = anthropic_decode.parse_messages(body, LIMITS)
    assert parsed.chat.common.max_tokens == 16
    (line,) = [r.getMessage() for r in caplog.records if r.name == "edgellmd.api.fields"]
    assert line == (
        "accepted and ignored: context_management, diagnostics, inference_geo, speed, "
        "user_profile_id, workspace_id"
    )
    assert "wrkspc_1" not in line  # names only, never a value
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "context_management")}
    assert anthropic_decode.parse_count_tokens(counted).model == "m"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"speed": "ludicrous"}, "speed"),
        ({"inference_geo": 7}, "inference_geo"),
        ({"workspace_id": "w" * 257}, "workspace_id"),
        ({"diagnostics": "yes"}, "diagnostics"),
        ({"diagnostics": {"previous_message_id": 5}}, "diagnostics.previous_message_id"),
        ({"diagnostics": {"other": 1}}, "diagnostics.other"),
        ({"context_management": []}, "context_management"),
        ({"context_management": {"edits": "all"}}, "context_management.edits"),
        ({"context_management": {"edits": [{"type": "clear_thinking_1"}] * 17}}, "context_management.edits"),
        ({"context_management": {"edits": [{"keep": "all"}]}}, "context_management.edits[0]"),
        ({"context_management": {"edits": [], "more": 1}}, "context_management.more"),
    ],
)
def test_ignored_fields_must_still_be_what_anthropic_takes(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        anthropic_decode.parse_messages(MESSAGE | extra, LIMITS)
    assert caught.value.param == param
    assert not isinstance(caught.value, UnsupportedParameter)


def test_a_context_edit_that_changes_the_prompt_is_refused_by_name() -> None:
    edits = {"edits": [CLAUDE_CODE_EDITS["edits"][0], {"type": "clear_tool_uses_20250919"}]}
    with pytest.raises(
        UnsupportedParameter, match=r"context_management.edits\[1\].*clear_tool_uses_20250919"
    ):
        anthropic_decode.parse_messages(MESSAGE | {"context_management": edits}, LIMITS)
    with pytest.raises(UnsupportedParameter, match="'container'"):
        anthropic_decode.parse_messages(MESSAGE | {"container": "c"}, LIMITS)


def test_codex_client_metadata_is_accepted_on_responses() -> None:
    metadata = {
        "turn_id": "t" * 600,
        "session_id": "s" * 600,
        "nested": {"a": [1, 2]},
    }  # ~1.2 KB as Codex sends
    parsed = responses_decode.parse_responses(
        {"model": "m", "input": "hi", "client_metadata": metadata}, LIMITS
    )
    assert parsed.chat.common.model == "m"
    assert "client_metadata" not in parsed.echo  # ignored: not repeated in the response object
    for odd in ("ids", [1], 3):
        with pytest.raises(InvalidRequest) as caught:
            responses_decode.parse_responses({"model": "m", "input": "hi", "client_metadata": odd}, LIMITS)
        assert caught.value.param == "client_metadata"


def test_chat_takes_the_prompt_cache_fields_and_names_moderation_unsupported() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    parsed = openai_decode.parse_chat(
        chat | {"prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "x"}}, LIMITS
    )
    assert parsed.common.model == "m"
    with pytest.raises(InvalidRequest) as caught:
        openai_decode.parse_chat(chat | {"prompt_cache_options": "x"}, LIMITS)
    assert caught.value.param == "prompt_cache_options"
    with pytest.raises(UnsupportedParameter):
        openai_decode.parse_chat(chat | {"moderation": {"model": "omni"}}, LIMITS)


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (openai_decode.parse_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        (responses_decode.parse_responses, {"model": "m", "input": "hi"}),
        (anthropic_decode.parse_messages, MESSAGE),
    ],
)
@pytest.mark.parametrize("name", ["temperatur", "client_metadata_v2", "spEEd", "x" * 300, "\u202espeed"])
def test_a_truly_unknown_field_is_still_unknown_parameter(
    parse: Any, body: dict[str, Any], name: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(body | {name: 1}, LIMITS)
    assert caught.value.code == "unknown_parameter"
    assert name not in str(caught.value) or len(name) < 64  # a long name is not echoed whole
