"""Validation of Anthropic Messages bodies into the shared request model; every rejection names its field.

A Messages body decodes into the same `ChatRequest` as an OpenAI chat body: `system` and the
text blocks become system, user and assistant turns, `tool_use` blocks an assistant's tool
calls, `tool_result` blocks tool turns, `tools` and `tool_choice` the same tool plan (and
grammar) as chat's, `output_config.format` the same structured-output grammar as
`response_format`. What Messages has of its own is only its shape.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from edgellmd.api.fields import Fields, note_ignored, typed
from edgellmd.api.media import Content, MediaReader, MediaRules
from edgellmd.api.request import ChatRequest, CommonRequest, Limits, within_ceiling
from edgellmd.api.structured import (
    FUNCTION_NAME_CHARS,
    ToolPlan,
    response_format_grammar,
    tool_plan,
)
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput
from edgellmd.engine.generation import DEFAULT_PENALTY_LAST_N, DEFAULT_TOP_K, SamplingParams
from edgellmd.errors import ApiError, InvalidRequest, UnsupportedParameter, shown

log = logging.getLogger(__name__)

# Each stop string is looked for after every token on the scheduler thread: twice OpenAI's 4.
MAX_STOP_SEQUENCES: Final = 8
MAX_STOP_LENGTH: Final = 256  # characters per stop sequence, as chat's `stop`
MAX_TOP_K: Final = 1_000_000
MIN_THINKING_BUDGET: Final = 1024  # Anthropic's own lower bound on budget_tokens
MAX_USER_ID: Final = 256  # Anthropic's limit on metadata.user_id
MAX_CONTEXT_EDITS: Final = 16  # context_management.edits: there are two kinds at Anthropic
BLOCK_JOINER: Final = "\n\n"  # between text blocks of one turn, and turns that merge

# Accepted and ignored (checked for Anthropic's types): they change nothing this server makes.
IGNORED_FIELDS: Final = frozenset(
    {
        "service_tier",  # one tier here
        "cache_control",  # the daemon reuses a slot's prompt prefix by itself
        "speed",  # standard or fast: one speed here
        "inference_geo",  # the box is where it is
        "diagnostics",  # previous_message_id, for cache-miss reasons this server does not give
        "user_profile_id",
        "workspace_id",
    }
)
CONTEXT_EDIT_PREFIX: Final = "clear_thinking_"  # the context_management edits accepted
# Claude Code opens `system` with a line of billing metadata for Anthropic's API, not for the
# model: `x-anthropic-billing-header: cc_version=2.1.332.8cc; cc_entrypoint=sdk-cli; ...`.
# Its hash differs from one conversation to the next (and its `cch=` nonce, where sent, from
# one request to the next): left in, it would part every prompt from the others right after
# the tools, so that no new session or subagent reuses the long system prompt they share.
BILLING_HEADER: Final = "x-anthropic-billing-header:"
_MESSAGE_FIELDS: Final = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "metadata",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "context_management",  # edits that clear earlier thinking only: it never reaches the prompt
    }
    | IGNORED_FIELDS
)
_COUNT_FIELDS: Final = (
    frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"})
    | IGNORED_FIELDS
)
# Known to Anthropic, not done here: refused by name rather than as unknown fields.
_UNSUPPORTED_FIELDS: Final = frozenset({"container", "mcp_servers"})
_UNSUPPORTED_BLOCKS: Final = frozenset(
    {
        "document",
        "search_result",
        "container_upload",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
    }
)
_BLOCK_FIELDS: Final = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "image": frozenset({"type", "source", "cache_control"}),
    # An earlier reply's thinking, sent back: accepted and left out of the prompt, as
    # reasoning models' own templates drop earlier turns' reasoning.
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}
# A tool's fields; the last four are accepted and ignored: every tool is in the prompt (no tool
# search defers one: defer_loading), called by the model directly (allowed_callers), its input
# sent whole (eager_input_streaming) and shown by its schema (input_examples).
_TOOL_IGNORED: Final = frozenset(
    {"defer_loading", "allowed_callers", "eager_input_streaming", "input_examples"}
)
_TOOL_FIELDS: Final = (
    frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"}) | _TOOL_IGNORED
)
_TOOL_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
TOOL_ERROR_PREFIX: Final = "Error: "  # how a tool_result with is_error reaches the model

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated `POST /v1/messages` body: the shared chat request and how to show reasoning."""

    chat: ChatRequest
    show_thinking: bool  # False with thinking disabled: a reasoning model's thinking is left out


@dataclass(frozen=True, slots=True)
class CountRequest:
    """A validated `POST /v1/messages/count_tokens` body: what renders the prompt, nothing to generate."""

    model: str
    messages: tuple[ChatMessage, ...]
    tools: ToolPlan | None


def _fail(message: str, where: str) -> InvalidRequest:
    return InvalidRequest(message, param=where)


def _unknown(data: Mapping[str, Any], allowed: frozenset[str], where: str = "") -> None:
    for name in data:
        if name not in allowed:
            safe = shown(name)
            path = f"{where}.{safe}" if where else safe
            if not where and name in _UNSUPPORTED_FIELDS:
                raise UnsupportedParameter(f"'{name}' is not supported by this server", param=name)
            raise InvalidRequest(
                f"{path}: Extra inputs are not permitted", param=path, code="unknown_parameter"
            )


def _model(data: Mapping[str, Any]) -> str:
    model = data.get("model")
    if model is None:
        raise _fail("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise _fail("'model' must be a non-empty string", "model")
    return model


def _max_tokens(f: Fields, limits: Limits) -> int:
    if not f.present("max_tokens"):
        raise _fail("'max_tokens' is required", "max_tokens")
    value = f.integer("max_tokens", lo=1)
    assert value is not None  # noqa: S101 - present
    return within_ceiling(limits, "max_tokens", value)


def _stop_sequences(data: Mapping[str, Any]) -> tuple[str, ...]:
    value = data.get("stop_sequences")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _fail("'stop_sequences' must be a list of strings", "stop_sequences")
    if len(value) > MAX_STOP_SEQUENCES:
        raise _fail(f"'stop_sequences' takes at most {MAX_STOP_SEQUENCES} sequences", "stop_sequences")
    if any(len(s) > MAX_STOP_LENGTH for s in value):
        raise _fail(f"each stop sequence must be at most {MAX_STOP_LENGTH} characters", "stop_sequences")
    return tuple(s for s in value if s)


def _user(data: Mapping[str, Any]) -> str | None:
    value = data.get("metadata")
    if value is None:
        return None
    meta = typed(value, dict, "metadata", "an object")
    _unknown(meta, frozenset({"user_id"}), "metadata")
    user = Fields(meta, "metadata.").string("user_id")
    if user is None:
        return None
    if len(user) > MAX_USER_ID:
        raise _fail(f"'metadata.user_id' must be at most {MAX_USER_ID} characters", "metadata.user_id")
    return user


def _show_thinking(data: Mapping[str, Any], max_tokens: int | None) -> bool:
    """Whether a reasoning model's thinking comes back as thinking blocks.

    The model reasons or not by its own nature (`reasoning:` in its settings): `thinking`
    cannot switch that on or off here, and `budget_tokens` is checked as Anthropic checks it
    but not enforced apart from max_tokens, which the reasoning counts towards. `disabled`
    (or display `omitted`) leaves the thinking out of the answer.
    """
    value = data.get("thinking")
    if value is None:
        return True
    spec = typed(value, dict, "thinking", "an object with a 'type'")
    kind = spec.get("type")
    if kind == "disabled":
        _unknown(spec, frozenset({"type"}), "thinking")
        return False
    if kind not in ("enabled", "adaptive"):
        raise _fail("'thinking.type' must be enabled, adaptive or disabled", "thinking.type")
    _unknown(spec, frozenset({"type", "budget_tokens", "display"}), "thinking")
    display = spec.get("display")
    if display not in (None, "summarized", "omitted"):
        raise _fail("'thinking.display' must be summarized or omitted", "thinking.display")
    if kind == "enabled":
        budget = typed(spec.get("budget_tokens"), int, "thinking.budget_tokens", "an integer")
        if budget < MIN_THINKING_BUDGET:
            raise _fail(
                f"'thinking.budget_tokens' must be at least {MIN_THINKING_BUDGET}", "thinking.budget_tokens"
            )
        if max_tokens is not None and budget >= max_tokens:
            raise _fail("'thinking.budget_tokens' must be less than 'max_tokens'", "thinking.budget_tokens")
    elif "budget_tokens" in spec:
        raise _fail("'thinking.budget_tokens' is only for thinking type enabled", "thinking.budget_tokens")
    return display != "omitted"


def _image(block: dict[str, Any], where: str, media: MediaReader) -> MediaInput:
    """An image block: its source base64 ({media_type, data}) or a URL (fetched from the hosts
    media.fetch_hosts lists); a file_id is refused (no files API here)."""
    _unknown(block, _BLOCK_FIELDS["image"], where)
    source = typed(block.get("source"), dict, f"{where}.source", "an object")
    kind = source.get("type")
    if kind == "base64":
        _unknown(source, frozenset({"type", "media_type", "data"}), f"{where}.source")
        return media.image_base64(source.get("data"), source.get("media_type"), f"{where}.source")
    if kind == "url":
        _unknown(source, frozenset({"type", "url"}), f"{where}.source")
        return media.image_url(source.get("url"), f"{where}.source.url")
    if kind == "file":
        raise UnsupportedParameter(
            "images by file_id are not supported by this server (it has no files API); send base64",
            param=f"{where}.source.type",
        )
    raise _fail(f"'{where}.source.type' must be base64 or url", f"{where}.source.type")


def _blocks(value: Any, where: str, media: MediaReader) -> Content:
    """A tool result's content: a string, or text and image blocks."""
    content = Content()
    if isinstance(value, str):
        content.text(value)
        return content
    if not isinstance(value, list):
        raise _fail(f"'{where}' must be a string or a list of text and image blocks", where)
    last_text = False
    for j, block in enumerate(value):
        kind = _block_type(block, f"{where}[{j}]")
        if kind == "image":
            content.media(_image(block, f"{where}[{j}]", media))
            last_text = False
            continue
        if kind != "text":
            _refuse_block(kind, f"{where}[{j}]", "text and image blocks")
        if last_text:
            content.text(BLOCK_JOINER)
        content.text(_text_block(block, f"{where}[{j}]"))
        last_text = True
    return content


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks (joined); the only content `system` and tool results take."""
    return BLOCK_JOINER.join(_text_parts(value, where))


def _text_parts(value: Any, where: str) -> list[str]:
    """`_text`'s string, or each of its text blocks' text."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise _fail(f"'{where}' must be a string or a list of text blocks", where)
    parts: list[str] = []
    for j, block in enumerate(value):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            _refuse_block(kind, f"{where}[{j}]", "text blocks")
        parts.append(_text_block(block, f"{where}[{j}]"))
    return parts


def _system_text(value: Any) -> str:
    """The top-level `system` as the model sees it: without Claude Code's billing line (the first
    block, or the string, loses that line, and is left out if nothing else remains)."""
    parts = _text_parts(value, "system")
    if parts and parts[0].startswith(BILLING_HEADER):
        log.debug("system: a billing header left out")
        rest = parts[0].partition("\n")[2]
        parts = [rest, *parts[1:]] if rest else parts[1:]
    return BLOCK_JOINER.join(parts)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _fail(f"'{where}' must be a content block object with a 'type'", where)
    kind: str = block["type"]
    return kind


def _refuse_block(kind: str, where: str, allowed: str) -> None:
    name = shown(kind, limit=48, quote=True)
    if kind in _UNSUPPORTED_BLOCKS:
        raise UnsupportedParameter(
            f"content blocks of type {name} are not supported by this server (at '{where}'; {allowed} only)",
            param=f"{where}.type",
        )
    raise _fail(
        f"'{where}.type': unknown or misplaced content block type {name} ({allowed} only)", f"{where}.type"
    )


def _text_block(block: dict[str, Any], where: str) -> str:
    _unknown(block, _BLOCK_FIELDS["text"], where)
    citations = block.get("citations")
    if citations is not None and not isinstance(citations, list):  # accepted and ignored
        raise _fail(f"'{where}.citations' must be a list", f"{where}.citations")
    return typed(block.get("text"), str, f"{where}.text", "a string")


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    _unknown(block, _BLOCK_FIELDS["tool_use"], where)
    call_id = typed(block.get("id"), str, f"{where}.id", "a string")
    if not _TOOL_ID.fullmatch(call_id):
        raise _fail(f"'{where}.id' must be 1 to 128 of a-z A-Z 0-9 _ -", f"{where}.id")
    name = typed(block.get("name"), str, f"{where}.name", "a string")
    arguments = typed(block.get("input"), dict, f"{where}.input", "an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool_result(
    block: dict[str, Any], where: str, names: Mapping[str, str], asked: set[str], media: MediaReader
) -> ChatMessage:
    _unknown(block, _BLOCK_FIELDS["tool_result"], where)
    call_id = typed(block.get("tool_use_id"), str, f"{where}.tool_use_id", "a string")
    content = block.get("content")
    result = Content() if content is None else _blocks(content, f"{where}.content", media)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _fail(f"'{where}.is_error' must be a boolean", f"{where}.is_error")
    if call_id not in asked:  # as Anthropic's API: a result answers a call of the turn before it
        raise _fail(
            f"'{where}.tool_use_id': unexpected tool_use_id {shown(call_id, quote=True)}; each "
            "tool_result block must have a corresponding tool_use block in the previous message",
            f"{where}.tool_use_id",
        )
    message = result.message("tool", tool_call_id=call_id, name=names.get(call_id))
    return message.prefixed(TOOL_ERROR_PREFIX) if is_error else message


def _turns(
    i: int, role: str, content: Any, names: dict[str, str], asked: set[str], *, media: MediaReader
) -> list[ChatMessage]:
    """One Anthropic message as the shared model's turns (tool results are turns of their own).

    `asked` holds the tool_use ids of the message before (the calls a tool_result may answer);
    an assistant message leaves its own there for the next one.
    """
    answerable = set(asked)
    asked.clear()
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    if not isinstance(content, list):
        raise _fail(f"'{where}' must be a string or a list of content blocks", where)
    turns: list[ChatMessage] = []
    parts = Content()
    calls: list[dict[str, Any]] = []
    last_text = False  # text blocks in a row are joined with BLOCK_JOINER
    blocks = 0  # text and image blocks since the last turn (an empty text block is a turn too)

    def flush() -> None:
        nonlocal parts, last_text, blocks
        if blocks or calls:
            turns.append(parts.message(role, tool_calls=tuple(calls)))
            parts = Content()
            calls.clear()
        last_text = False
        blocks = 0

    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            if last_text:
                parts.text(BLOCK_JOINER)
            parts.text(_text_block(block, at))
            last_text = True
            blocks += 1
        elif kind == "image" and role == "user":
            parts.media(_image(block, at, media))
            last_text = False
            blocks += 1
        elif kind == "tool_use" and role == "assistant":
            call = _tool_use(block, at)
            names[call["id"]] = call["function"]["name"]
            asked.add(call["id"])
            calls.append(call)
        elif kind == "tool_result" and role == "user":
            flush()
            turns.append(_tool_result(block, at, names, answerable, media))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            _unknown(block, _BLOCK_FIELDS[kind], at)
        else:
            allowed = "text, tool_use and thinking" if role == "assistant" else "text, image and tool_result"
            _refuse_block(kind, at, allowed)
    flush()
    return turns


def _merged(turns: list[ChatMessage]) -> list[ChatMessage]:
    """Consecutive user (or assistant) turns as one, as Anthropic combines them."""
    out: list[ChatMessage] = []
    for turn in turns:
        last = out[-1] if out else None
        if last is not None and turn.role == last.role and turn.role in ("user", "assistant"):
            out[-1] = last.joined(turn, BLOCK_JOINER)
        else:
            out.append(turn)
    return out


def _messages(data: Mapping[str, Any], media: MediaReader) -> tuple[ChatMessage, ...]:
    value = data.get("messages")
    if value is None:
        raise _fail("'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise _fail("'messages' must be a non-empty list", "messages")
    turns: list[ChatMessage] = []
    system = data.get("system")
    if system is not None:
        text = _system_text(system)
        if text:
            turns.append(ChatMessage("system", text))
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the results that answer them
    asked: set[str] = set()  # the tool_use ids of the message before
    later: list[str] = []  # system messages among the turns
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        message = typed(item, dict, where, "an object with 'role' and 'content'")
        _unknown(message, frozenset({"role", "content"}), where)
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _fail(f"'{where}.role' must be user, assistant or system", f"{where}.role")
        if "content" not in message:
            raise _fail(f"'{where}.content' is required", f"{where}.content")
        if role == "system":
            # Anthropic's mid-conversation system messages (Claude Code sends one): chat templates
            # take a system turn first only, so the text joins the system prompt, in order.
            text = _text(message["content"], f"{where}.content")
            if text:
                later.append(text)
            continue
        turns.extend(_turns(i, role, message["content"], names, asked, media=media))
    if later:
        if turns and turns[0].role == "system":
            turns[0] = ChatMessage("system", "\n\n".join([turns[0].content, *later]))
        else:
            turns.insert(0, ChatMessage("system", "\n\n".join(later)))
    merged = _merged(turns)
    if not any(turn.role != "system" for turn in merged):
        raise _fail("'messages' must hold at least one user or assistant turn with content", "messages")
    if merged[-1].role == "assistant":
        # Anthropic's prefill continues the last assistant turn; a chat template renders it
        # as a finished turn and starts another, so the answer would not be what was asked.
        raise UnsupportedParameter(
            "a last message with role assistant (prefill) is not supported by this server; "
            "end with a user message",
            param=f"messages[{len(value) - 1}].role",
        )
    return tuple(merged)


# tool_plan and response_format_grammar speak chat's field names; a client of this API
# should read its own in a refusal.
_RENAMES: Final = (
    (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
    (re.compile(r"response_format\.json_schema\.schema"), "output_config.format.schema"),
    (re.compile(r"response_format"), "output_config.format"),
)


def _renamed(exc: ApiError) -> ApiError:
    def rename(text: str) -> str:
        for pattern, repl in _RENAMES:
            text = pattern.sub(repl, text)
        return text

    message, param = rename(exc.message), None if exc.param is None else rename(exc.param)
    if param is not None and param not in message:  # Anthropic's shape has no `param`: say where
        message = f"{message} (in '{param}')"
    return type(exc)(message, param=param, code=exc.code, headers=exc.headers)


def _in_our_names(build: Callable[[], T]) -> T:
    try:
        return build()
    except ApiError as exc:
        raise _renamed(exc) from None


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    tool = typed(tool, dict, where, "an object with 'name' and 'input_schema'")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise UnsupportedParameter(
            f"tools of type {shown(kind, limit=48, quote=True)} are not supported by this server "
            f"(at '{where}'; custom tools with an input_schema only)",
            param=f"{where}.type",
        )
    _unknown(tool, _TOOL_FIELDS, where)
    name = tool.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or set(name) - FUNCTION_NAME_CHARS:
        raise _fail(f"'{where}.name' must be 1 to 64 of a-z A-Z 0-9 _ -", f"{where}.name")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise _fail(f"'{where}.description' must be a string", f"{where}.description")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise _fail(f"'{where}.input_schema' must be a JSON schema with type object", f"{where}.input_schema")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if description is not None:
        function["description"] = description
    strict = tool.get("strict")
    if strict is not None:
        function["strict"] = typed(strict, bool, f"{where}.strict", "true or false")
    for flag in ("defer_loading", "eager_input_streaming"):
        if tool.get(flag) is not None:
            typed(tool[flag], bool, f"{where}.{flag}", "true or false")
    for listed in ("allowed_callers", "input_examples"):
        if tool.get(listed) is not None:
            typed(tool[listed], list, f"{where}.{listed}", "a list")
    note_ignored(tool, _TOOL_IGNORED)
    return {"type": "function", "function": function}


def _tool_choice(value: Any, names: set[str]) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as chat's, and whether parallel calls are allowed (None: default)."""
    if value is None:
        return None, None
    choice = typed(value, dict, "tool_choice", "an object with a 'type'")
    kind = choice.get("type")
    fields = (
        {"type", "name", "disable_parallel_tool_use"}
        if kind == "tool"
        else {"type", "disable_parallel_tool_use"}
    )
    if kind == "none":
        fields = {"type"}
    if kind not in ("auto", "any", "tool", "none"):
        raise _fail("'tool_choice.type' must be auto, any, tool or none", "tool_choice.type")
    _unknown(choice, frozenset(fields), "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _fail(
            "'tool_choice.disable_parallel_tool_use' must be a boolean",
            "tool_choice.disable_parallel_tool_use",
        )
    parallel = False if disable else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise _fail("'tool_choice.name' must name one of the tools", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _tools(data: Mapping[str, Any]) -> ToolPlan | None:
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if tools == []:  # Anthropic takes an empty list for no tools
        tools = None
    if tools is None:
        if choice is not None and not (isinstance(choice, dict) and choice.get("type") == "none"):
            raise _fail("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _fail("'tools' must be a list of tools", "tools")
    converted = [_tool(t, i) for i, t in enumerate(tools)]
    mode, parallel = _tool_choice(choice, {t["function"]["name"] for t in converted})
    answer = _output_format(data)
    fmt = (
        None
        if answer is None
        else {"type": "json_schema", "json_schema": {"name": "output", "schema": answer}}
    )
    return _in_our_names(lambda: tool_plan(converted, mode, parallel, answer_format=fmt))


def _output_format(data: Mapping[str, Any]) -> Any:
    """`output_config.format.schema` when there is one (its shape checked; the schema by the caller)."""
    value = data.get("output_config")
    if value is None:
        return None
    config = typed(value, dict, "output_config", "an object")
    _unknown(config, frozenset({"format", "effort"}), "output_config")  # effort: accepted and ignored
    spec = config.get("format")
    if spec is None:
        return None
    spec = typed(spec, dict, "output_config.format", "an object with a 'type'")
    if spec.get("type") != "json_schema":
        raise _fail("'output_config.format.type' must be json_schema", "output_config.format.type")
    _unknown(spec, frozenset({"type", "schema"}), "output_config.format")
    schema = spec.get("schema")
    if schema is None:
        raise _fail("'output_config.format.schema' is required", "output_config.format.schema")
    return schema


def _format_grammar(data: Mapping[str, Any]) -> str | None:
    schema = _output_format(data)
    if schema is None:
        return None
    fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return _in_our_names(lambda: response_format_grammar(fmt))


def _grammar(data: Mapping[str, Any], tools: ToolPlan | None) -> str | None:
    if tools is not None and tools.grammar is not None:
        return tools.grammar  # a call, or (auto) an answer of output_config's format
    return _format_grammar(data)


def _ignored(data: Mapping[str, Any]) -> None:
    """Fields accepted and ignored still have to be what Anthropic takes."""
    tier = data.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise _fail("'service_tier' must be auto or standard_only", "service_tier")
    cache = data.get("cache_control")
    if cache is not None and not isinstance(cache, dict):
        raise _fail("'cache_control' must be an object", "cache_control")
    speed = data.get("speed")
    if speed is not None and speed not in ("standard", "fast"):
        raise _fail("'speed' must be standard or fast", "speed")
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        value = data.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_ID):
            raise _fail(f"'{name}' must be a string of up to {MAX_USER_ID} characters", name)
    diagnostics = data.get("diagnostics")
    if diagnostics is not None:
        if not isinstance(diagnostics, dict):
            raise _fail("'diagnostics' must be an object", "diagnostics")
        _unknown(diagnostics, frozenset({"previous_message_id"}), "diagnostics")
        previous = diagnostics.get("previous_message_id")
        if previous is not None and (not isinstance(previous, str) or len(previous) > MAX_USER_ID):
            raise _fail(
                "'diagnostics.previous_message_id' must be a message id", "diagnostics.previous_message_id"
            )
    _context_management(data.get("context_management"))
    note_ignored(data, IGNORED_FIELDS | {"context_management"})


def _context_management(value: Any) -> None:
    """Edits that clear earlier turns' thinking are what this server does anyway (a chat template
    leaves earlier thinking out of the prompt): accepted. Any other edit changes the prompt: 400."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _fail("'context_management' must be an object", "context_management")
    _unknown(value, frozenset({"edits"}), "context_management")
    edits = value.get("edits")
    if edits is None:
        return
    if not isinstance(edits, list) or len(edits) > MAX_CONTEXT_EDITS:
        raise _fail(
            f"'context_management.edits' must be a list of up to {MAX_CONTEXT_EDITS}",
            "context_management.edits",
        )
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str):
            raise _fail(f"'{where}' must be an object with a type", where)
        if not kind.startswith(CONTEXT_EDIT_PREFIX):
            raise UnsupportedParameter(
                f"'{where}': only {CONTEXT_EDIT_PREFIX}* edits are supported by this server (earlier "
                f"thinking is left out of the prompt); {shown(kind, quote=True)} is not",
                param="context_management",
            )


def parse_messages(data: Mapping[str, Any], limits: Limits) -> MessagesRequest:
    """Validate a `POST /v1/messages` body."""
    _unknown(data, _MESSAGE_FIELDS)
    f = Fields(data)
    model = _model(data)
    max_tokens = _max_tokens(f, limits)
    show_thinking = _show_thinking(data, max_tokens)
    _ignored(data)
    top_k = f.integer("top_k", lo=0, hi=MAX_TOP_K)
    messages = _messages(data, MediaReader(limits.media))
    tools = _tools(data)
    sampling = SamplingParams(
        temperature=f.number("temperature", 1.0, lo=0, hi=1),
        top_p=f.number("top_p", 1.0, lo=0, hi=1),
        top_k=DEFAULT_TOP_K if top_k is None else top_k,
        penalty_last_n=DEFAULT_PENALTY_LAST_N,
        grammar=_grammar(data, tools),
    )
    common = CommonRequest(
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop_sequences(data),
        stream=f.boolean("stream", False),
        include_usage=False,
        ignore_eos=False,
        user=_user(data),
    )
    return MessagesRequest(ChatRequest(common=common, messages=messages, tools=tools), show_thinking)


def parse_count_tokens(data: Mapping[str, Any], media: MediaRules | None = None) -> CountRequest:
    """Validate a `POST /v1/messages/count_tokens` body (a Messages body without what generates)."""
    _unknown(data, _COUNT_FIELDS)
    model = _model(data)
    _show_thinking(data, None)
    _ignored(data)
    messages = _messages(data, MediaReader(media or MediaRules()))
    # What the prompt renders is checked as /v1/messages checks it, its grammars included
    # (built on the prompt pool and let go of): some refusals, a schema that refers back to
    # itself before any value (left recursion) among them, come only from building one.
    tools = _tools(data)
    _grammar(data, tools)
    return CountRequest(model, messages, tools)
