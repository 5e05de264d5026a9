"""Tools on every model: for a chat template that cannot render tools, the conversation rewritten
into turns it can show (llama.cpp's generic tool-call approach).

The tools are described in a system turn (each function with its description and JSON-schema
parameters, then the reply format the grammar enforces); an assistant's earlier calls become
its reply in that same format, and each tool result becomes a user turn naming the call it
answers. The reply format (`{"tool_calls": [...]}` or `{"response": ...}`) is the one
`api.structured` constrains the reply to, whatever the template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from edgellmd.engine.chat import ChatMessage, call_arguments

TOOLS_HEADER = "You have access to the following tools (functions):"
RESULT_HEADER = "Result of the tool call {id} ({name}):"


def _describe(tool: Mapping[str, Any]) -> str:
    inner = tool.get("function")
    function: Mapping[str, Any] = inner if isinstance(inner, Mapping) else tool
    name = str(function.get("name", ""))
    description = function.get("description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    lines = [f"- {name}"]
    if isinstance(description, str) and description:
        lines.append(f"  description: {description}")
    lines.append(f"  parameters (JSON schema): {json.dumps(parameters, ensure_ascii=False, sort_keys=True)}")
    return "\n".join(lines)


def _calls_text(message: ChatMessage) -> str:
    calls = []
    for call in message.tool_calls:
        function = call.get("function", {})
        arguments = call_arguments(function)
        calls.append({"name": function.get("name"), "arguments": arguments})
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


def tool_turns(
    messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, instructions: str = ""
) -> tuple[ChatMessage, ...]:
    """The conversation with its tools, calls and results as plain system, user and assistant turns.

    `instructions` (the reply format) ends the tools' system turn; a conversation that only
    carries earlier calls and results (no `tools` now) gets no tools turn.
    """
    names: dict[str, str] = {}  # call id -> function name, to say what a result answers
    out: list[ChatMessage] = []
    if tools:
        described = "\n".join(_describe(t) for t in tools)
        out.append(
            ChatMessage(
                "system", f"{TOOLS_HEADER}\n{described}" + (f"\n\n{instructions}" if instructions else "")
            )
        )
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            for call in message.tool_calls:
                if isinstance(call.get("id"), str):
                    names[call["id"]] = str(call.get("function", {}).get("name", "a tool"))
            text = _calls_text(message)
            content = f"{message.content}\n{text}" if message.content else text
            out.append(ChatMessage("assistant", content))
        elif message.role == "tool":
            call_id = message.tool_call_id or "?"
            header = RESULT_HEADER.format(id=call_id, name=message.name or names.get(call_id, "a tool"))
            out.append(replace(message, role="user", tool_call_id=None, name=None).prefixed(f"{header}\n"))
        else:
            out.append(message)
    return tuple(out)
