"""Chat prompts: the model's own Jinja2 template, a template file, or a llama.cpp built-in by name."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Renders (role, content) pairs with a named llama.cpp template; provided by the engine.
BuiltinRenderer = Callable[[str, Sequence[tuple[str, str]]], str]


class TemplateError(Exception):
    """The template could not render these messages; the message is safe to show a client."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation, as the API validated it."""

    role: str
    content: str
    tool_calls: tuple[Mapping[str, Any], ...] = ()  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates expect it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            # Templates print arguments with `| tojson`: they want an object, not OpenAI's string.
            out["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"])}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments(function: Mapping[str, Any]) -> Any:
    try:
        return json.loads(function.get("arguments") or "{}")
    except ValueError:
        return function.get("arguments")


def _raise_exception(message: str) -> NoReturn:
    # Hugging Face templates call raise_exception() to reject conversations they cannot render.
    raise TemplateError(message)


def _environment() -> jinja2.Environment:
    # Sandboxed: a model file is data, and its template must not reach Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    return env


class ChatTemplate:
    """Turns a list of chat messages into the prompt text the model was trained on."""

    supports_tools = False  # whether the template renders `tools` and tool messages

    def render(self, messages: Sequence[ChatMessage],
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:  # pragma: no cover - interface
        """Return the prompt text, ending where the assistant's reply begins."""
        raise NotImplementedError

    @property
    def source(self) -> str:  # pragma: no cover - interface
        """Where the template came from, for logs and status."""
        raise NotImplementedError


class JinjaChatTemplate(ChatTemplate):
    """A Hugging Face-style Jinja2 chat template (GGUF `tokenizer.chat_template` or a file)."""

    def __init__(self, text: str, *, bos_token: str, eos_token: str, origin: str) -> None:
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template from {origin} does not compile: {exc}") from exc
        self._bos = bos_token
        self._eos = eos_token
        self._origin = origin
        # A template that never mentions `tools` cannot show them to the model.
        self.supports_tools = "tools" in text

    @property
    def source(self) -> str:
        """Where the template came from."""
        return self._origin

    def render(self, messages: Sequence[ChatMessage],
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render with `add_generation_prompt=True`, as llama-server and transformers do."""
        context: dict[str, Any] = {
            "messages": [m.as_dict() for m in messages],
            "add_generation_prompt": True,
            "bos_token": self._bos,
            "eos_token": self._eos,
        }
        if tools:
            context["tools"] = list(tools)
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed on these messages: {exc}") from exc


class BuiltinChatTemplate(ChatTemplate):
    """One of llama.cpp's built-in templates, rendered by `llama_chat_apply_template`."""

    def __init__(self, name: str, renderer: BuiltinRenderer) -> None:
        self._name = name
        self._renderer = renderer

    @property
    def source(self) -> str:
        """The built-in template's name."""
        return f"built-in template {self._name!r}"

    def render(self, messages: Sequence[ChatMessage],
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render through llama.cpp (which knows no tools)."""
        return self._renderer(self._name, [(m.role, m.content) for m in messages])


NO_TEMPLATE_MESSAGE: Final = (
    "model {model!r} has no chat template; use /v1/completions, or configure "
    "chat_template (a llama.cpp built-in name) or chat_template_file for it"
)
