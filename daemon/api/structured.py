"""Structured output and tool calls: OpenAI's JSON-schema subset, checked, and turned into grammars.

`response_format` json_object / json_schema constrain the reply with a grammar (llama.cpp's
grammar sampler). Tool calls use the same machinery, as llama.cpp's generic tool-call format
does: the reply is constrained to `{"tool_calls": [{"name", "arguments"}]}` (or, with
`tool_choice: auto`, alternatively `{"response": "..."}`), which works with any model, and
is turned back into OpenAI's `tool_calls`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Final

from edgellmd.errors import ApiError, InvalidRequest, UnsupportedParameter
from edgellmd.grammar.convert import embedded_grammar, schema_to_grammar
from edgellmd.grammar.relax import relax
from edgellmd.grammar.schema import SCHEMA_KEYWORDS, SCHEMA_TYPES, CheckedSchema, SchemaError
from edgellmd.grammar.schema import check_schema as _check

log = logging.getLogger(__name__)
# How TOOL_INSTRUCTIONS asks for an answer without tools (tool_choice auto).
TEXT_ANSWER: Final = ', or, to answer without tools, {"response": <your answer>}'
STRUCTURED_ANSWER: Final = (
    ', or, to answer without tools, {"response": <your answer, JSON of the requested format>}'
)

__all__ = [
    "SCHEMA_KEYWORDS",
    "SCHEMA_TYPES",
    "ToolPlan",
    "check_schema",
    "response_format_grammar",
    "tool_plan",
]

MAX_TOOLS: Final = 128
MAX_PARALLEL_CALLS: Final = 8  # calls in one reply: a model that never stops calling is cut here
FUNCTION_NAME_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
TOOL_INSTRUCTIONS: Final = (
    "You can call the tools described to you. To call tools, reply only with a JSON object "
    '{{"tool_calls": [{{"name": <tool name>, "arguments": <arguments object>}}]}}{answer}.'
)


def _api_error(exc: SchemaError, param: str) -> ApiError:
    kind = UnsupportedParameter if exc.unsupported else InvalidRequest
    return kind(exc.message, param=param)


def check_schema(schema: Any, param: str, label: str = "") -> CheckedSchema:
    """Check a schema in full (grammar.schema); a 400 naming the keyword, where it is and any limit."""
    try:
        return _check(schema, label)
    except SchemaError as exc:
        raise _api_error(exc, param) from None


def _grammar(schema: CheckedSchema, param: str) -> str:
    try:
        return schema_to_grammar(schema)
    except SchemaError as exc:
        raise _api_error(exc, param) from None


@cache
def _json_object_grammar() -> str:
    return schema_to_grammar({"type": "object"})


def response_format_grammar(value: Any) -> str | None:
    """The grammar a `response_format` asks for; None for plain text."""
    if isinstance(value, dict) and value.get("type") == "json_object":
        return _json_object_grammar()
    checked = response_format_schema(value)
    return None if checked is None else _grammar(checked, "response_format.json_schema.schema")


def response_format_schema(value: Any) -> CheckedSchema | None:
    """The checked schema a `response_format` asks for (json_object: any object); None for text."""
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest("'response_format' must be an object with a 'type'", param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return check_schema({"type": "object"}, param)
    if kind != "json_schema":
        raise InvalidRequest(
            "'response_format.type' must be text, json_object or json_schema", param="response_format.type"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequest(
            "'response_format.json_schema' must be an object with a 'name' and a 'schema'",
            param="response_format.json_schema",
        )
    name = spec["name"]
    if not name or len(name) > 64 or set(name) - FUNCTION_NAME_CHARS:  # as OpenAI names them
        raise InvalidRequest(
            "'response_format.json_schema.name' must be 1 to 64 of a-z A-Z 0-9 _ -",
            param="response_format.json_schema.name",
        )
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise InvalidRequest(
            f"unrecognized field in 'response_format.json_schema': {sorted(unknown)[0][:40]}",
            param="response_format.json_schema",
        )
    param = "response_format.json_schema.schema"
    return check_schema(spec.get("schema", {"type": "object"}), param)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools ask of the reply."""

    tools: tuple[Mapping[str, Any], ...]  # as the client sent them (checked), for the chat template
    mode: str  # "none", "auto", "required" (a named function is "required" with one tool)
    grammar: str | None
    instructions: str = ""
    names: tuple[str, ...] = field(default=())


def object_schema(params: Any, where: str) -> dict[str, Any]:
    """A function's parameters: a JSON schema of an object, as OpenAI requires (a call's
    arguments are an object); none or `{}` is one without parameters, and one that says no
    type is taken as an object's."""
    if params is None or params == {}:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise InvalidRequest(f"'{where}' must be a JSON schema with type object", param=where)
    return params if "type" in params else {"type": "object", **params}


def _function(tool: Any, i: int) -> tuple[str, CheckedSchema]:
    where = f"tools[{i}]"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidRequest(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', param=where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or set(name) - FUNCTION_NAME_CHARS:
        raise InvalidRequest(
            f"'{where}.function.name' must be 1 to 64 of a-z A-Z 0-9 _ -", param=f"{where}.function.name"
        )
    params = object_schema(fn.get("parameters"), f"{where}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(
            f"'{where}.function.strict' must be true or false", param=f"{where}.function.strict"
        )
    if strict is not True:  # any JSON Schema, as OpenAI and Anthropic take for such tools
        params, left_out = relax(params)
        if left_out:
            log.debug("tool %s: schema keywords not enforced: %s", name, ", ".join(left_out))
    return name, check_schema(params, f"{where}.function.parameters", f"{where}.function.parameters")


def max_calls(parallel: bool | None, functions: int) -> int:
    """How many calls one reply may hold: what the request allows, never a fixed number to fill.

    `parallel_tool_calls: false`: one; `true`: up to MAX_PARALLEL_CALLS; not given: one per
    function offered (small models asked for "the weather in Paris" otherwise go on calling
    for every city they know until the list is full). The model ends the list when it wants.
    """
    if parallel is False:
        return 1
    if parallel is True:
        return MAX_PARALLEL_CALLS
    return max(1, min(functions, MAX_PARALLEL_CALLS))


def tool_plan(tools: Any, tool_choice: Any, parallel: Any, *, answer_format: Any = None) -> ToolPlan | None:
    """Check `tools`/`tool_choice`/`parallel_tool_calls` and build the reply's grammar (some
    refusals, left recursion among them, come only from building it: counting a prompt's
    tokens builds it too).

    `answer_format` (a `response_format`, chat's shape): with tool_choice auto, an answer
    without tools is that schema's JSON, not text (`{"response": {...}}`); a call required or
    named leaves it out, as nothing but a call may come.
    """
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be a list of 1 to {MAX_TOOLS} tools", param="tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = tuple(name for name, _ in functions)
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    mode = "auto" if tool_choice is None else tool_choice
    chosen = functions
    if isinstance(mode, dict):
        fn = mode.get("function") if mode.get("type") == "function" else None
        wanted = fn.get("name") if isinstance(fn, dict) else None
        match = [f for f in functions if f[0] == wanted]
        if not match:
            raise InvalidRequest("'tool_choice' must name one of the tools", param="tool_choice")
        chosen, mode = match, "required"
    elif mode not in ("none", "auto", "required"):
        raise InvalidRequest(
            "'tool_choice' must be none, auto, required or a named function", param="tool_choice"
        )
    # Checked whatever the mode: with a call required the format is not used, and still the client's.
    structured = response_format_schema(answer_format) if answer_format is not None else None
    if mode == "none":
        return ToolPlan(tuple(tools), "none", None, names=names)
    # edgellm's wrapper around the checked parameter schemas: its own nesting and names do not
    # count toward the client's limits (embedded_grammar); the parameters' counts add up.
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in chosen
        ]
    }
    calls: dict[str, Any] = {
        "type": "array",
        "items": call,
        "minItems": 1,
        "maxItems": max_calls(parallel, len(chosen)),
    }
    with_calls = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    schema: dict[str, Any] = with_calls
    answer = ""
    if mode == "auto":
        schema = {
            "anyOf": [
                with_calls,
                {
                    "type": "object",
                    "properties": {"response": structured or {"type": "string"}},
                    "required": ["response"],
                    "additionalProperties": False,
                },
            ]
        }
        answer = TEXT_ANSWER if structured is None else STRUCTURED_ANSWER
    try:
        built = embedded_grammar(schema)
    except SchemaError as exc:
        raise _api_error(exc, "tools") from None
    return ToolPlan(tuple(tools), mode, built, TOOL_INSTRUCTIONS.format(answer=answer), names)
