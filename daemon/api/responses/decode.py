"""Validation of OpenAI Responses bodies into the shared request model; every rejection names its parameter.

A Responses body is a chat request in another encoding: `input` items become the
conversation's turns (`function_call` items an assistant's tool calls, `function_call_output`
items tool results, `instructions` a system turn first), flat function tools and
`text.format` become chat's shapes for `structured.tool_plan` and `response_format_grammar`,
and what is left is echoed on the response object, as OpenAI's clients expect it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from edgellmd.api.fields import (
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    Fields,
    metadata_object,
    note_ignored,
    reject_unknown,
    unsupported,
)
from edgellmd.api.jsontext import embedded_json
from edgellmd.api.media import Content, MediaReader, MediaRules
from edgellmd.api.request import (
    ChatRequest,
    CommonRequest,
    Limits,
    service_tier,
    token_limit,
    within_ceiling,
)
from edgellmd.api.responses.store import RESPONSE_ID
from edgellmd.api.structured import (
    FUNCTION_NAME_CHARS,
    MAX_TOOLS,
    object_schema,
    response_format_grammar,
    response_format_schema,
    tool_plan,
)
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput
from edgellmd.engine.generation import DEFAULT_PENALTY_LAST_N, DEFAULT_TOP_K, SamplingParams
from edgellmd.errors import ApiError, InvalidRequest, UnsupportedParameter, shown

T = TypeVar("T")

MAX_TOP_LOGPROBS: Final = 20
_FORMAT_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
INPUT_ROLES: Final = ("user", "assistant", "system", "developer")
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES: Final = ("auto", "concise", "detailed")
VERBOSITIES: Final = ("low", "medium", "high")

# Accepted and ignored: they change nothing that is generated (or ask for data about items
# this server never makes, since it refuses the tools and inputs that would make them).
_IGNORED: Final = frozenset(
    {
        "user",  # logged as the request's user tag
        "metadata",  # checked against OpenAI's limits, echoed and stored
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "max_tool_calls",  # counts built-in tool calls; there are none here
        "reasoning",  # effort and summary: a local model thinks as its template says
        "truncation",  # `auto` as `disabled`: a conversation that does not fit is refused, never cut
        "stream_options",  # include_obfuscation: streams here carry no padding
        "client_metadata",  # a client's own turn ids (Codex CLI sends them on every request)
    }
)
# Refused when given (not null): they would change the answer and are not implemented.
_UNSUPPORTED: Final = (
    "conversation",
    "prompt",
    "background_options",
    "moderation",
    "access_programs",
    "image",
)
# edgellm's sampling extensions, as on chat (`seed` makes sampled answers reproducible).
_EXTENSIONS: Final = frozenset({"seed", "top_k", "min_p", "ignore_eos"})
_FIELDS: Final = (
    _IGNORED
    | _EXTENSIONS
    | frozenset(_UNSUPPORTED)
    | {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "stream",
        "store",
        "previous_response_id",
        "include",
        "background",
        "top_logprobs",
        "context_management",
    }
)
# `include` values that only add data about items this server never makes.
_INCLUDE_IGNORED: Final = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",  # reasoning here is plain text, never encrypted
    }
)
_INCLUDE_UNSUPPORTED: Final = frozenset({"message.output_text.logprobs"})
# OpenAI's other input item, tool and tool_choice types: named in a 400 as not supported here.
KNOWN_ITEM_TYPES: Final = frozenset(
    {
        "item_reference",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "web_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "compaction",
        "tool_search_call",
        "tool_search_output",
        "program",
        "program_output",
        "additional_tools",
    }
)
KNOWN_TOOL_TYPES: Final = frozenset(
    {
        "file_search",
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "computer",
        "computer_use_preview",
        "code_interpreter",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "custom",
        "apply_patch",
        "namespace",
        "tool_search",
        "programmatic_tool_calling",
    }
)
KNOWN_TOOL_CHOICES: Final = KNOWN_TOOL_TYPES | {"allowed_tools"}
# Tools OpenAI runs itself (search, code, a computer...): this box cannot. Given among others
# they are left out, and the response's metadata says so (DROPPED_TOOLS_KEY); asked for by
# tool_choice, or all there was with tool_choice required, they are a 400.
HOSTED_TOOL_TYPES: Final = KNOWN_TOOL_TYPES - {"namespace"}
DROPPED_TOOLS_KEY: Final = "edgellm_tools_left_out"
# A namespace's function `f` in `crm` is the model's `crm__f`; its calls come back as `f`
# with `namespace: crm`, as OpenAI's do.
NAMESPACE_JOINER: Final = "__"
_UNSUPPORTED_PARTS: Final = frozenset({"input_file"})
_MEDIA_PARTS: Final = frozenset({"input_image", "input_audio"})  # in user messages
_FUNCTION_TOOL_KEYS: Final = frozenset(
    # allowed_callers, defer_loading, output_schema, async: accepted, ignored (every tool is
    # loaded, called directly, and its output read as text)
    {
        "type",
        "name",
        "description",
        "parameters",
        "strict",
        "allowed_callers",
        "defer_loading",
        "output_schema",
        "async",
    }
)
_NAMESPACE_KEYS: Final = frozenset({"type", "name", "description", "tools"})


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated `POST /v1/responses` body."""

    chat: ChatRequest  # its messages: this request's own input (no instructions, no earlier turns)
    instructions: str | None
    previous_response_id: str | None
    store: bool
    echo: Mapping[str, Any] = field(default_factory=dict)  # the fields the response object repeats
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # Tools.namespaces


def _renamed(exc: ApiError, old: str, new: str) -> ApiError:
    """`exc` with chat's parameter names (`tools[0].function.`) spelled as this API's (`tools[0].`)."""
    if exc.param is not None:
        exc.param = exc.param.replace(old, new)
    exc.message = exc.message.replace(old, new)
    exc.args = (exc.message,)
    return exc


# ---- input items ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Turn:
    role: str
    content: Content = field(default_factory=Content)
    calls: list[dict[str, Any]] = field(default_factory=list)
    call_id: str | None = None


def _part_media(part: dict[str, Any], param: str, media: MediaReader) -> MediaInput:
    """An `input_image` ({image_url, detail}; a file_id is refused: there is no files API here)
    or an `input_audio` ({input_audio: {data, format}}) part."""
    if part["type"] == "input_image":
        unknown = set(part) - {"type", "image_url", "detail", "file_id"}
        if unknown:
            key = shown(sorted(unknown)[0])
            raise InvalidRequest(f"unrecognized content part field: {key}", param=f"{param}.{key}")
        if part.get("file_id") is not None:
            raise UnsupportedParameter(
                "images by file_id are not supported by this server (it has no files API); "
                "send image_url as a data: URL",
                param=f"{param}.file_id",
            )
        if part.get("detail", "auto") not in ("auto", "low", "high"):
            raise InvalidRequest(f"'{param}.detail' must be auto, low or high", param=f"{param}.detail")
        return media.image_url(part.get("image_url"), f"{param}.image_url")
    audio = part.get("input_audio")
    if set(part) - {"type", "input_audio"} or not isinstance(audio, dict) or set(audio) - {"data", "format"}:
        raise InvalidRequest(f"'{param}' must be {{type, input_audio: {{data, format}}}}", param=param)
    return media.audio_base64(audio.get("data"), audio.get("format"), f"{param}.input_audio")


def _part_text(part: Any, role: str, param: str) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequest(f"'{param}' must be a content part object with a 'type'", param=param)
    kind = part["type"]
    assistant = role == "assistant"
    if kind in _UNSUPPORTED_PARTS or (kind in _MEDIA_PARTS and role != "user"):
        where = "by this server" if kind in _UNSUPPORTED_PARTS else f"in {role} input"
        raise UnsupportedParameter(
            f"content parts of type {kind} are not supported {where}",
            param=f"{param}.type",
        )
    key = {"input_text": "text", "output_text": "text", "refusal": "refusal"}.get(kind)
    if key is None or (kind != "input_text" and not assistant):
        allowed = "input_text, output_text or refusal" if assistant else "input_text"
        raise InvalidRequest(f"'{param}.type' must be {allowed} here", param=f"{param}.type")
    text = part.get(key)
    if not isinstance(text, str):
        raise InvalidRequest(f"'{param}.{key}' must be a string", param=f"{param}.{key}")
    return text


def _content(value: Any, role: str, param: str, media: MediaReader) -> Content:
    content = Content()
    if isinstance(value, str):
        content.text(value)
        return content
    if not isinstance(value, list):
        raise InvalidRequest(f"'{param}' must be a string or a list of content parts", param=param)
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in _MEDIA_PARTS and role == "user":  # else _part_text's 400
            content.media(_part_media(part, where, media))
        else:
            content.text(_part_text(part, role, where))
    return content


def _message(item: Mapping[str, Any], where: str, media: MediaReader) -> _Turn:
    f = Fields(item, f"{where}.")
    role = f.string("role", required=True)
    if role not in INPUT_ROLES:
        raise InvalidRequest(f"'{where}.role' must be one of {', '.join(INPUT_ROLES)}", param=f"{where}.role")
    if item.get("content") is None:
        raise InvalidRequest(f"'{where}.content' is required", param=f"{where}.content")
    content = _content(item["content"], role, f"{where}.content", media)
    # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
    return _Turn("system" if role == "developer" else role, content)


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    f = Fields(item, f"{where}.")
    call_id = f.string("call_id", required=True, nonempty=True)
    name = f.string("name", required=True, nonempty=True)
    namespace = f.string("namespace")
    if namespace:
        name = f"{namespace}{NAMESPACE_JOINER}{name}"  # as the model saw the tool
    arguments = f.string("arguments", required=True)
    assert arguments is not None  # noqa: S101 - required
    embedded_json(arguments, f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_output(item: Mapping[str, Any], where: str, media: MediaReader) -> _Turn:
    f = Fields(item, f"{where}.")
    call_id = f.string("call_id", required=True, nonempty=True)
    output = item.get("output")
    if output is None:
        raise InvalidRequest(f"'{where}.output' is required", param=f"{where}.output")
    return _Turn("tool", _content(output, "tool", f"{where}.output", media), call_id=call_id)


def _item_type(item: Mapping[str, Any], where: str) -> str:
    kind = item.get("type")
    if kind is None:
        return "message"  # the easy form: {"role", "content"}
    if not isinstance(kind, str):
        raise InvalidRequest(f"'{where}.type' must be a string", param=f"{where}.type")
    if kind in ("message", "function_call", "function_call_output", "reasoning"):
        return kind
    if kind in KNOWN_ITEM_TYPES:
        raise UnsupportedParameter(
            f"input items of type {kind} are not supported by this server", param=f"{where}.type"
        )
    raise InvalidRequest(
        f"'{where}.type' {shown(kind, quote=True)} is not an input item type "
        "(message, function_call, function_call_output, reasoning)",
        param=f"{where}.type",
    )


def input_turns(value: Any, media: MediaReader | None = None) -> tuple[ChatMessage, ...]:
    """`input` as conversation turns; consecutive function calls join one assistant turn.

    Reasoning items are accepted and dropped: chat templates leave earlier thinking out of
    the prompt (DeepSeek R1's strips it), and a reasoning item has no turn of its own to be.
    """
    if isinstance(value, str):
        return (ChatMessage("user", value),)
    if not isinstance(value, list):
        raise InvalidRequest("'input' must be a string or a list of input items", param="input")
    media = media or MediaReader(MediaRules())
    turns: list[_Turn] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        kind = _item_type(item, where)
        if kind == "message":
            turns.append(_message(item, where, media))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":
                last.calls.append(call)  # the calls of one reply, after its text
            else:
                turns.append(_Turn("assistant", calls=[call]))
        elif kind == "function_call_output":
            turns.append(_call_output(item, where, media))
    return tuple(t.content.message(t.role, tool_calls=tuple(t.calls), tool_call_id=t.call_id) for t in turns)


# ---- tools, tool_choice, text.format ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tools:
    """`tools` as chat's function tools (namespaces flattened), with what the reply needs back."""

    functions: list[dict[str, Any]]  # chat's shape: each function the model may call
    echoes: list[dict[str, Any]]  # what the response object repeats
    namespaces: dict[str, tuple[str, str]]  # the model's name -> (namespace, name)
    left_out: list[str]  # hosted tool types given and not served


def _tools(raw: Any) -> Tools:
    if raw is not None and (not isinstance(raw, list) or len(raw) > MAX_TOOLS):
        raise InvalidRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    out = Tools([], [], {}, [])
    for i, tool in enumerate(raw or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:  # a list or object: no hash, a 400 below
            out.left_out.append(str(kind))
        elif kind == "namespace":
            _namespace(tool, where, out)
        else:
            function, echo = _function_tool(tool, where)
            out.functions.append(function)
            out.echoes.append(echo)
    return out


def _named(tool: dict[str, Any], where: str, keys: frozenset[str]) -> tuple[Fields, str, str | None]:
    """A tool's fields (only `keys`), its name (a function name's characters) and description."""
    f = Fields(tool, f"{where}.")
    f.only(keys, where)
    name = f.string("name", required=True)
    if not name or len(name) > 64 or set(name) - FUNCTION_NAME_CHARS:
        raise InvalidRequest(f"'{where}.name' must be 1 to 64 of a-z A-Z 0-9 _ -", param=f"{where}.name")
    return f, name, f.string("description")


def _namespace(tool: dict[str, Any], where: str, out: Tools) -> None:
    """A namespace's function tools, each a tool of its own for the model; echoed as the namespace."""
    _, name, description = _named(tool, where, _NAMESPACE_KEYS)
    inner = tool.get("tools")
    if not isinstance(inner, list) or not inner or len(inner) > MAX_TOOLS:  # all of them: tool_plan
        raise InvalidRequest(
            f"'{where}.tools' must be a list of 1 to {MAX_TOOLS} function tools", param=f"{where}.tools"
        )
    echoes = []
    for j, member in enumerate(inner):
        at = f"{where}.tools[{j}]"
        if isinstance(member, dict) and member.get("type") == "custom":
            out.left_out.append(f"{name}.custom")
            continue
        function, echo = _function_tool(member, at, namespace=name)
        seen = function["function"]["name"]
        if seen in out.namespaces:
            raise InvalidRequest(f"'{at}.name' repeats a tool of namespace {name}", param=f"{at}.name")
        out.namespaces[seen] = (name, echo["name"])
        out.functions.append(function)
        if len(out.functions) > MAX_TOOLS:  # namespaces together: checked as they are read
            raise InvalidRequest(f"'tools' hold more than {MAX_TOOLS} function tools in all", param="tools")
        echoes.append(echo)
    out.echoes.append({"type": "namespace", "name": name, "description": description, "tools": echoes})


def _function_tool(
    tool: Any, where: str, namespace: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One function tool: chat's shape (for tool_plan and the template) and its echo."""
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise InvalidRequest(f"'{where}' must be a tool object with a 'type'", param=where)
    kind = tool["type"]
    if kind != "function":
        if kind in KNOWN_TOOL_TYPES:
            raise UnsupportedParameter(
                f"tools of type {kind} are not supported by this server (function tools only)",
                param=f"{where}.type",
            )
        raise InvalidRequest(
            f"'{where}.type' {shown(kind, quote=True)} is not a tool type", param=f"{where}.type"
        )
    f, name, description = _named(tool, where, _FUNCTION_TOOL_KEYS)
    strict = f.boolean("strict", True)  # the grammar holds every reply to the schema: strict, always
    # Checked here under the Responses API's names (chat's check of it then passes as it is).
    given = tool.get("parameters")
    parameters = object_schema(given, f"{where}.parameters")
    seen = name
    if namespace is not None:
        seen = f"{namespace}{NAMESPACE_JOINER}{name}"
        if len(seen) > 64:
            raise InvalidRequest(
                f"'{where}.name' and its namespace's name come to {len(seen)} characters with "
                f"'{NAMESPACE_JOINER}' between them; at most 64",
                param=f"{where}.name",
            )
    function: dict[str, Any] = {
        "name": seen,
        "parameters": parameters,
    }
    if tool.get("strict") is not None:  # strict: the exact subset; otherwise relaxed (grammar.relax)
        function["strict"] = strict
    if description is not None:
        function["description"] = description
    echo = {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": given,  # echoed as sent
        "strict": strict,
    }
    return {"type": "function", "function": function}, echo


def _tool_choice(value: Any) -> tuple[Any, Any]:
    """`tool_choice` in chat's shape, and its echo."""
    if value is None or isinstance(value, str):
        return value, value or "auto"
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "function":
            name = value.get("name")
            if not isinstance(name, str):
                raise InvalidRequest("'tool_choice.name' must be a string", param="tool_choice.name")
            return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}
        if isinstance(kind, str) and kind in KNOWN_TOOL_CHOICES:
            raise UnsupportedParameter(
                f"'tool_choice' of type {kind} is not supported by this server", param="tool_choice"
            )
    raise InvalidRequest(
        "'tool_choice' must be none, auto, required or an object of type function with a name",
        param="tool_choice",
    )


def _format(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text.format`, checked: as chat's `response_format` (None for text) and its echo. The
    grammar is built later, once: only when no tool grammar takes the reply over."""
    if value is None:
        return None, {"type": "text"}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest("'text.format' must be an object with a 'type'", param="text.format")
    kind = value["type"]
    f = Fields(value, "text.format.")
    if kind in ("text", "json_object"):
        f.only(frozenset({"type"}), "text.format")
        return (None if kind == "text" else {"type": kind}), {"type": kind}
    if kind != "json_schema":
        raise InvalidRequest(
            "'text.format.type' must be text, json_object or json_schema", param="text.format.type"
        )
    f.only(frozenset({"type", "name", "schema", "strict", "description"}), "text.format")
    name = f.string("name", required=True)
    if not _FORMAT_NAME.fullmatch(name or ""):
        raise InvalidRequest(
            "'text.format.name' must be 1 to 64 of a-z A-Z 0-9 _ -", param="text.format.name"
        )
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("'text.format.schema' must be a JSON schema object", param="text.format.schema")
    description = f.string("description")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("'text.format.strict' must be a boolean", param="text.format.strict")
    asked = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    _in_format_names(lambda: response_format_schema(asked))
    echo = {
        "type": "json_schema",
        "name": name,
        "schema": schema,
        "strict": strict,
        "description": description,
    }
    return asked, echo


def _in_format_names(check: Callable[[], T]) -> T:
    """`check()`, its refusal naming `text.format.` where chat's code says `response_format.json_schema.`."""
    try:
        return check()
    except ApiError as exc:
        raise _renamed(exc, "response_format.json_schema.", "text.format.") from None


def _text(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    if value is None:
        return None, {"format": {"type": "text"}, "verbosity": "medium"}
    if not isinstance(value, dict):
        raise InvalidRequest("'text' must be an object", param="text")
    f = Fields(value, "text.")
    f.only(frozenset({"format", "verbosity"}), "text")
    verbosity = f.choice("verbosity", VERBOSITIES) or "medium"  # accepted and ignored
    asked, fmt = _format(value.get("format"))
    return asked, {"format": fmt, "verbosity": verbosity}


# ---- the rest ---------------------------------------------------------------------------------


def _include(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    for v in value:
        if v in _INCLUDE_UNSUPPORTED:
            raise UnsupportedParameter(
                f"'include' value {v} is not supported by this server", param="include"
            )
        if v not in _INCLUDE_IGNORED:
            raise InvalidRequest(f"'include' value {shown(v, quote=True)} is not known", param="include")


def _reasoning(value: Any) -> dict[str, Any]:
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise InvalidRequest("'reasoning' must be an object", param="reasoning")
    f = Fields(value, "reasoning.")
    f.only(frozenset({"effort", "summary", "generate_summary"}), "reasoning")
    effort = f.choice("effort", REASONING_EFFORTS)
    summary = f.choice("summary", REASONING_SUMMARIES) or f.choice("generate_summary", REASONING_SUMMARIES)
    return {"effort": effort, "summary": summary}


def _refuseunsupported(f: Fields) -> None:
    for key in _UNSUPPORTED:
        if f.present(key):
            raise unsupported(key)
    if f.boolean("background", False):
        raise unsupported("background", "(background responses)")
    if f.data.get("context_management"):  # null and [] ask for nothing
        raise unsupported("context_management")
    if f.integer("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS):
        raise unsupported("top_logprobs")
    f.choice("truncation", ("auto", "disabled"))
    f.string("safety_identifier")
    f.string("prompt_cache_key")
    f.string("prompt_cache_retention")
    f.integer("max_tool_calls", lo=1)
    for name in ("prompt_cache_options", "client_metadata"):
        value = f.data.get(name)
        if value is not None and not isinstance(value, dict):
            raise InvalidRequest(f"'{name}' must be an object", param=name)
    note_ignored(f.data, _IGNORED - {"user", "metadata", "service_tier"})


def _stream_options(f: Fields, stream: bool) -> None:
    options = f.data.get("stream_options")
    if options is None:
        return
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    g = Fields(options, "stream_options.")
    g.only(frozenset({"include_obfuscation"}), "stream_options")
    g.boolean("include_obfuscation", False)


def _max_output_tokens(f: Fields, limits: Limits) -> tuple[int, int | None]:
    """The generation's token limit, and what the request asked for (echoed)."""
    asked = f.integer("max_output_tokens", lo=1)
    if asked is not None:
        asked = within_ceiling(limits, "max_output_tokens", asked)
    return token_limit(limits, asked), asked


def parse_responses(data: Mapping[str, Any], limits: Limits) -> ResponsesRequest:
    """Validate a Responses body (grammars are built as schemas are checked: run it off the loop)."""
    reject_unknown(data, _FIELDS)
    f = Fields(data)
    model = f.string("model", required=True, nonempty=True)
    assert model is not None  # noqa: S101 - required=True guarantees it
    _refuseunsupported(f)
    _include(data.get("include"))
    previous = f.string("previous_response_id")
    if previous is not None and not RESPONSE_ID.fullmatch(previous):
        raise InvalidRequest(
            "'previous_response_id' must be an id this server gave a response (resp_ and 32 hex digits)",
            param="previous_response_id",
        )
    value = data.get("input")
    if value is None and previous is None:
        raise InvalidRequest("'input' is required", param="input")
    turns = () if value is None else input_turns(value, MediaReader(limits.media))
    if not turns and previous is None:
        raise InvalidRequest("'input' must not be empty", param="input")
    instructions = f.string("instructions")
    stream = f.boolean("stream", False)
    _stream_options(f, stream)
    answer_format, text = _text(data.get("text"))

    given = _tools(data.get("tools"))
    functions = given.functions
    choice, choice_echo = _tool_choice(data.get("tool_choice"))
    if given.left_out and not functions and choice == "required":
        raise UnsupportedParameter(
            f"tool_choice required, and every tool given is one this server cannot run "
            f"({', '.join(sorted(set(given.left_out)))}): function tools only",
            param="tool_choice",
        )
    if not functions and choice in ("auto", "none") and given.left_out:
        choice = None  # only hosted tools, left out: a plain answer
    if not functions and choice == "auto":
        choice = None  # auto with nothing to call is no tools at all
    parallel = f.boolean("parallel_tool_calls", True)
    try:
        tools = tool_plan(functions or None, choice, parallel, answer_format=answer_format)
    except ApiError as exc:
        raise _renamed(exc, ".function.", ".") from None
    grammar: str | None = None
    if tools is not None and tools.grammar is not None:
        grammar = tools.grammar  # a call, or (auto) an answer of the format
    elif answer_format is not None:
        grammar = _in_format_names(lambda: response_format_grammar(answer_format))

    max_tokens, asked = _max_output_tokens(f, limits)
    temperature = f.number("temperature", 1.0, lo=0.0, hi=2.0)
    top_p = f.number("top_p", 1.0, lo=0.0, hi=1.0)
    top_k = f.integer("top_k", lo=0, hi=1_000_000)
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=DEFAULT_TOP_K if top_k is None else top_k,
        min_p=f.number("min_p", 0.0, lo=0.0, hi=1.0),
        penalty_last_n=DEFAULT_PENALTY_LAST_N,
        seed=f.integer("seed", lo=-(2**63), hi=2**64 - 1),
        grammar=grammar,
    )
    user = f.string("user")
    store = f.boolean("store", True)
    priority = service_tier(f)
    common = CommonRequest(
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=(),
        stream=stream,
        include_usage=False,
        ignore_eos=f.boolean("ignore_eos", False),
        user=user,
        priority=priority,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": asked,
        "max_tool_calls": data.get("max_tool_calls"),
        "metadata": _left_out(metadata_object(data.get("metadata")), given.left_out),
        "parallel_tool_calls": parallel,
        "previous_response_id": previous,
        "reasoning": _reasoning(data.get("reasoning")),
        "service_tier": "default",
        "store": store,
        "temperature": temperature,
        "text": text,
        "tool_choice": choice_echo,
        "tools": given.echoes,
        "top_logprobs": 0,
        "top_p": top_p,
        "truncation": data.get("truncation") or "disabled",
        "user": user,
        "safety_identifier": data.get("safety_identifier"),
        "prompt_cache_key": data.get("prompt_cache_key"),
    }
    return ResponsesRequest(
        chat=ChatRequest(common=common, messages=turns, tools=tools),
        instructions=instructions,
        previous_response_id=previous,
        store=store,
        echo=echo,
        namespaces=given.namespaces,
    )


def _left_out(metadata: dict[str, str], left_out: list[str]) -> dict[str, str]:
    """The response's metadata, with a note of the hosted tools given and not served, where it
    has room: a 17th key is more than OpenAI allows, and a client sending the metadata back
    (or to OpenAI) would be refused."""
    if not left_out or len(metadata) >= MAX_METADATA_KEYS:
        return metadata
    note = "tools this server cannot run were left out: " + ", ".join(sorted(set(left_out)))
    return {**metadata, DROPPED_TOOLS_KEY: note[:MAX_METADATA_VALUE_CHARS]}
