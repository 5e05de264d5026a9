"""Chat prompts: the model's own Jinja2 template, a template file, or a llama.cpp built-in by name."""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellmd.engine.config import MediaInput

log = logging.getLogger(__name__)

# Renders (role, content) pairs with a named llama.cpp template; provided by the engine.
BuiltinRenderer = Callable[[str, Sequence[tuple[str, str]]], str]
# A piece of a rendered prompt: its text, and whether the template wrote it (True) or it is
# text from the request (False), which must never become control tokens.
Segment = tuple[str, bool]
# A rendered prompt with its images and clips: segments, and (as ints) where media item n of
# the conversation stands (`ChatTemplate.render_parts`).
Part = Segment | int


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
    # Images and clips in the content, in order: item k stands at character `media_at[k]` of
    # `content` (between its text parts, as the client placed it).
    media: tuple[MediaInput, ...] = ()
    media_at: tuple[int, ...] = ()

    def _with_media(self, text: Callable[[str], str], markers: Markers, first: int) -> str:
        """The content with `text` applied to its text pieces and media markers between them."""
        out, at = [], 0
        for k, offset in enumerate(self.media_at):
            out += [text(self.content[at:offset]), markers.media_marker(first + k)]
            at = offset
        out.append(text(self.content[at:]))
        return "".join(out)

    def joined(self, other: ChatMessage, joiner: str) -> ChatMessage:
        """This message and `other` as one (`joiner` between two non-empty contents; the calls
        of both, the media of both moved along)."""
        glue = joiner if self.content and other.content else ""
        shift = len(self.content) + len(glue)
        return replace(
            self,
            content=self.content + glue + other.content,
            tool_calls=(*self.tool_calls, *other.tool_calls),
            media=(*self.media, *other.media),
            media_at=(*self.media_at, *(shift + at for at in other.media_at)),
        )

    def prefixed(self, text: str) -> ChatMessage:
        """The same message with `text` before its content (its media moved along)."""
        return replace(
            self, content=text + self.content, media_at=tuple(len(text) + at for at in self.media_at)
        )

    def shown(self, markers: Markers, first: int = 0) -> ChatMessage:
        """This message as rendered for real: its media as markers (items `first` on)."""
        if not self.media:
            return self
        return replace(self, content=self._with_media(lambda t: t, markers, first))

    def marked(self, markers: Markers, first: int = 0) -> ChatMessage:
        """This message with every client-chosen string replaced by a marker (see Markers), and
        its media by media markers (items `first` on)."""
        calls = tuple(
            {
                **call,
                "id": markers.mark(call["id"]) if isinstance(call.get("id"), str) else call.get("id"),
                "function": {
                    **call["function"],
                    "name": markers.mark(call["function"].get("name", "")),
                    "arguments": json.dumps(markers.tree(call_arguments(call["function"]))),
                },
            }
            for call in self.tool_calls
        )
        return replace(
            self,
            content=self._with_media(markers.mark, markers, first),
            tool_calls=calls,
            tool_call_id=None if self.tool_call_id is None else markers.mark(self.tool_call_id),
            name=None if self.name is None else markers.mark(self.name),
        )

    def as_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates expect it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            # Templates print arguments with `| tojson`: they want an object, not OpenAI's string.
            out["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": call_arguments(call["function"])}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


# Arguments nested deeper than this reach a template as their text, not as a value: rendering
# walks values recursively. The API's decoders refuse deeper ones from clients (api.jsontext);
# a stored reply's own arguments (Responses' previous_response_id) come from the model.
MAX_ARGUMENT_DEPTH: Final = 64


def call_arguments(function: Mapping[str, Any]) -> Any:
    """A tool call's arguments as a value for a template: parsed, or the text when it does not
    parse or nests deeper than MAX_ARGUMENT_DEPTH."""
    text = function.get("arguments") or "{}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return function.get("arguments")
    return value if json_depth(value, MAX_ARGUMENT_DEPTH) <= MAX_ARGUMENT_DEPTH else text


def _raise_exception(message: str) -> NoReturn:
    # Hugging Face templates call raise_exception() to reject conversations they cannot render.
    raise TemplateError(message)


def _environment() -> jinja2.Environment:
    # Sandboxed: a model file is data, and its template must not reach Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    return env


_HTML_SAFE: Final = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "'": "\\u0027"}


class Markers:
    """Stand-ins for a request's strings while a template renders, so that its output can be
    split into what the template wrote and what the client wrote.

    A marker is digits only (a random nonce around an index): it survives what templates do
    to text (trim, upper, tojson) and holds no character a tokenizer treats specially.
    """

    def __init__(self) -> None:
        self.nonce = "".join(secrets.choice("123456789") for _ in range(12))
        self.texts: list[str] = []
        self.pattern = re.compile(self.nonce + r"(\d{1,9})" + self.nonce)
        # Where an image or clip stands: another nonce, so that no marker of text is one.
        self.media_nonce = "".join(secrets.choice("123456789") for _ in range(12))
        self.media_pattern = re.compile(self.media_nonce + r"(\d{1,9})" + self.media_nonce)

    def media_marker(self, index: int) -> str:
        """The marker of the conversation's media item `index`."""
        return f"{self.media_nonce}{index}{self.media_nonce}"

    def mark(self, text: str) -> str:
        """A marker for `text` (an empty string needs none)."""
        if not text:
            return text
        self.texts.append(text)
        return f"{self.nonce}{len(self.texts) - 1}{self.nonce}"

    def tree(self, value: Any) -> Any:
        """A JSON value with every string (not the keys) replaced by a marker."""
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, Mapping):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.tree(v) for v in value]
        return value


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (level by level, no recursion), stopping once past `limit`."""
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > limit:
            return depth
        nxt: list[Any] = []
        for v in level:
            if isinstance(v, Mapping):
                nxt.extend(v.values())
            elif isinstance(v, list | tuple):
                nxt.extend(v)
        level = nxt
    return depth


def json_keys(value: Any) -> Iterator[str]:
    """Every object key inside a JSON value (these stay in the template's text)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, Mapping):
            for key, sub in item.items():
                if isinstance(key, str):
                    yield key
                pending.append(sub)
        elif isinstance(item, list | tuple):
            pending.extend(item)


def _candidates(text: str) -> list[str]:
    """What a template may have made of a string: itself, trimmed, or JSON-encoded (tojson)."""
    encoded = json.dumps(text)[1:-1]
    html_safe = "".join(_HTML_SAFE.get(c, c) for c in encoded)
    out: list[str] = []
    for option in (
        text,
        text.strip(),
        text.lstrip(),
        text.rstrip(),
        html_safe,
        encoded,
        json.dumps(text, ensure_ascii=False)[1:-1],
    ):
        if option not in out:
            out.append(option)
    return out


def split_rendered(marked: str, real: str, markers: Markers) -> tuple[list[Segment], bool]:
    """Segments of the prompt: the template's text (trusted) and the request's (untrusted).

    `marked` is the template's output with markers for the request's strings, `real` its
    output with the strings themselves. Each marker is matched, in order, with what the
    template made of its string in `real`; then the prompt is exactly `real`. When that
    fails (a template that rewrites message text in other ways), the prompt is `marked` with
    each string put back as it is (JSON-encoded between quotes), and False says so.
    """
    pieces = markers.pattern.split(marked)
    template, keys = pieces[0::2], [int(k) for k in pieces[1::2]]
    segments: list[Segment] = [(template[0], True)]
    pos = len(template[0])
    aligned = real.startswith(template[0])
    for i, key in enumerate(keys):
        if not aligned:
            break
        after = template[i + 1]
        last = i == len(keys) - 1
        for option in _candidates(markers.texts[key]):
            end = pos + len(option)
            if (
                real.startswith(option, pos)
                and real.startswith(after, end)
                and (not last or end + len(after) == len(real))
            ):
                segments += [(option, False), (after, True)]
                pos = end + len(after)
                break
        else:
            aligned = False
    if aligned and pos == len(real):
        return [s for s in segments if s[0]], True
    segments = [(template[0], True)]
    for i, key in enumerate(keys):
        text = markers.texts[key]
        quoted = template[i].endswith('"') and template[i + 1].startswith('"')
        segments += [(json.dumps(text)[1:-1] if quoted else text, False), (template[i + 1], True)]
    return [s for s in segments if s[0]], False


class ChatTemplate:
    """Turns a list of chat messages into the prompt text the model was trained on."""

    supports_tools = False  # whether the template renders `tools` and tool messages
    _warned_rewrite = False

    def render_segments(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[Segment]:
        """Render, telling the template's own text from the request's (see split_rendered)."""
        markers = Markers()
        marked = self.render(
            [m.marked(markers) for m in messages], markers.tree(list(tools)) if tools else None
        )
        real = self.render(messages, tools)
        segments, exact = split_rendered(marked, real, markers)
        if not exact and not self._warned_rewrite:
            self._warned_rewrite = True
            log.info(
                "chat template %s rewrites message text; such prompts carry the text as sent", self.source
            )
        return segments

    def render_parts(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[Part], tuple[MediaInput, ...]]:
        """Render with the conversation's images and clips: segments, and where each stands (an
        int, the item's index in the tuple returned). Only the template's own text is searched
        for media markers; an item the template left out is not in the parts."""
        markers = Markers()
        firsts: list[int] = []
        media: list[MediaInput] = []
        for message in messages:
            firsts.append(len(media))
            media.extend(message.media)
        if not media:
            return list(self.render_segments(messages, tools)), ()
        marked = self.render(
            [m.marked(markers, first) for m, first in zip(messages, firsts, strict=True)],
            markers.tree(list(tools)) if tools else None,
        )
        real = self.render(
            [m.shown(markers, first) for m, first in zip(messages, firsts, strict=True)], tools
        )
        segments, _ = split_rendered(marked, real, markers)
        parts: list[Part] = []
        for text, trusted in segments:
            if not trusted:
                parts.append((text, trusted))
                continue
            pieces = markers.media_pattern.split(text)
            for k, piece in enumerate(pieces):
                if k % 2:
                    index = int(piece)
                    if index < len(media):
                        parts.append(index)
                elif piece:
                    parts.append((piece, True))
        return parts, tuple(media)

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:  # pragma: no cover - interface
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

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
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

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """Render through llama.cpp (which knows no tools)."""
        return self._renderer(self._name, [(m.role, m.content) for m in messages])


NO_TEMPLATE_MESSAGE: Final = (
    "model {model!r} has no chat template; use /v1/completions, or configure "
    "chat_template (a llama.cpp built-in name) or chat_template_file for it"
)
