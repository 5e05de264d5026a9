"""A reply as its parts, whatever the API: answer text, reasoning, tool calls, read as they stream.

The engine streams text. What that text means depends on the request: with tools, the reply
is edgellm's tool-call JSON (`{"tool_calls": [{"name", "arguments"}]}`, or with tool_choice
auto `{"response": "..."}`), constrained by a grammar; with a reasoning model, the text
between its thinking tags is its reasoning. `ReplyReader` turns the stream into the parts
every API family shows (`TextPart`, `ReasoningPart`, `CallStart`, `CallArguments`,
`CallEnd`), incrementally: answer text and tool-call arguments reach the client as they are
generated, and the internal JSON never does. Each adapter encodes the parts in its own wire
format (OpenAI chat chunks, Responses events, Anthropic content blocks).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

WHITESPACE: Final = " \t\n\r"


@dataclass(frozen=True, slots=True)
class TextPart:
    """Answer text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningPart:
    """Text from between the model's thinking tags."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call begins: its index in the reply, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of a tool call's arguments (JSON text, as generated)."""

    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """A tool call is complete: its arguments are a whole JSON value."""

    index: int


Part = TextPart | ReasoningPart | CallStart | CallArguments | CallEnd


@dataclass(slots=True)
class ToolCall:
    """One tool call as it accumulates."""

    index: int
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    complete: bool = False

    @property
    def arguments_text(self) -> str:
        """The arguments' JSON text (`{}` when the model gave none)."""
        text = "".join(self.arguments).strip()
        return text or "{}"


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


class _JsonString:
    """Decodes a JSON string's contents incrementally (after its opening quote)."""

    __slots__ = ("_escape", "_high", "done")

    def __init__(self) -> None:
        self._escape = ""  # a backslash escape being read
        self._high: int | None = None  # a high surrogate waiting for its low half
        self.done = False

    def feed(self, text: str, start: int) -> tuple[str, int]:
        """Decode from text[start:]; returns (decoded, position after what was consumed)."""
        out: list[str] = []
        i = start
        while i < len(text) and not self.done:
            c = text[i]
            i += 1
            if self._escape:
                self._escape += c
                if self._escape == "\\u" or (self._escape.startswith("\\u") and len(self._escape) < 6):
                    continue
                out.append(self._decode_escape())
                continue
            if c == "\\":
                self._escape = c
            elif c == '"':
                self.done = True
            else:
                out.append(self._flush_high() + c)
        return "".join(out), i

    def _flush_high(self) -> str:
        high, self._high = self._high, None
        return "" if high is None else "\ufffd"  # a lone high surrogate: not text

    def _decode_escape(self) -> str:
        escape, self._escape = self._escape, ""
        simple = {
            '\\"': '"',
            "\\\\": "\\",
            "\\/": "/",
            "\\b": "\b",
            "\\f": "\f",
            "\\n": "\n",
            "\\r": "\r",
            "\\t": "\t",
        }
        if escape in simple:
            return self._flush_high() + simple[escape]
        try:
            code = int(escape[2:], 16)
        except ValueError:
            return self._flush_high() + "\ufffd"
        if 0xD800 <= code <= 0xDBFF:
            pending = self._flush_high()
            self._high = code
            return pending
        if 0xDC00 <= code <= 0xDFFF:
            if self._high is None:
                return "\ufffd"
            high, self._high = self._high, None
            return chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00))
        return self._flush_high() + chr(code)


class _JsonValue:
    """Follows one JSON value's text until it is complete (objects, arrays, strings, scalars)."""

    __slots__ = ("_depth", "_escape", "_in_string", "_started", "done")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False
        self.done = False

    def feed(self, text: str, start: int) -> int:
        """Consume from text[start:]; returns the position after the value's end (or len)."""
        i = start
        while i < len(text):
            c = text[i]
            if not self._started:
                if c in WHITESPACE:
                    i += 1
                    continue
                self._started = True
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                        return i + 1
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.done = True
                    return i + 1
            elif self._depth == 0 and c in ",}]" + WHITESPACE:
                self.done = True  # a scalar ends where its text does
                return i
            i += 1
        return i


class ToolReplyReader:
    """Reads edgellm's tool-call JSON as it streams: answer text, calls and their arguments.

    The grammar guarantees the shape (`{"tool_calls": [{"name": ..., "arguments": ...}, ...]}`
    or `{"response": "..."}`, or `{"response": {...}}` whose JSON text is the answer when a
    format is asked for with tools, JSON whitespace anywhere between tokens, `name` before
    `arguments`); anything else that arrives anyway (no grammar in force) is taken as plain
    answer text from the first unexpected character on.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._names = frozenset(names)
        self._buf = ""
        self._state = "start"
        self._key = _JsonString()
        self._string = _JsonString()
        self._value = _JsonValue()
        self._answer = _JsonValue()  # a structured answer's JSON (`response` holding an object)
        self._keytext = ""  # the key being read
        self._name = ""  # the function name being read
        self.calls: list[ToolCall] = []
        self.raw = False  # the reply stopped following the tool-call shape: plain text

    def feed(self, text: str) -> list[Part]:
        """The parts completed by `text`."""
        if self.raw:
            return [TextPart(text)] if text else []
        self._buf += text
        parts: list[Part] = []
        i = 0
        buf = self._buf
        while i < len(buf) and not self.raw:
            i = self._step(buf, i, parts)
        self._buf = buf[i:]  # going raw consumes everything: nothing is left
        return parts

    def _expect(self, buf: str, i: int, char: str, then: str, parts: list[Part]) -> int:
        while i < len(buf) and buf[i] in WHITESPACE:
            i += 1
        if i >= len(buf):
            return i
        if buf[i] != char:
            return self._go_raw(buf, i, parts)
        self._state = then
        return i + 1

    def _go_raw(self, buf: str, i: int, parts: list[Part]) -> int:
        self.raw = True
        parts.append(TextPart(buf[i:]))
        return len(buf)

    def _step(self, buf: str, i: int, parts: list[Part]) -> int:
        state = self._state
        if state == "start":
            return self._expect(buf, i, "{", "top_key_open", parts)
        if state in ("top_key_open", "call_key_open"):
            return self._expect(buf, i, '"', state.replace("_open", ""), parts)
        if state in ("top_key", "call_key"):
            key, j = self._key.feed(buf, i)
            self._keytext += key
            if not self._key.done:
                return j
            self._key = _JsonString()
            name, self._keytext = self._keytext, ""
            self._state = f"{state}:{name}"
            return j
        if state.startswith("top_key:"):
            key = state.split(":", 1)[1]
            if key == "response":
                return self._expect(buf, i, ":", "response_open", parts)
            if key == "tool_calls":
                return self._expect(buf, i, ":", "calls_open", parts)
            return self._go_raw(buf, i, parts)
        if state == "response_open":
            while i < len(buf) and buf[i] in WHITESPACE:
                i += 1
            if i < len(buf) and buf[i] != '"':  # structured output with tools: the JSON is the answer
                self._state = "response_value"
                return i
            return self._expect(buf, i, '"', "response", parts)
        if state == "response_value":
            j = self._answer.feed(buf, i)
            if j > i:
                parts.append(TextPart(buf[i:j]))
            if self._answer.done:
                self._state = "end"
            return j
        if state == "response":
            text, j = self._string.feed(buf, i)
            if text:
                parts.append(TextPart(text))
            if self._string.done:
                self._state = "end"
            return j
        if state == "calls_open":
            return self._expect(buf, i, "[", "call_or_close", parts)
        if state == "call_or_close":
            while i < len(buf) and buf[i] in WHITESPACE:
                i += 1
            if i < len(buf) and buf[i] == "]":
                self._state = "end"
                return i + 1
            return self._expect(buf, i, "{", "call_key_open", parts)
        if state.startswith("call_key:"):
            key = state.split(":", 1)[1]
            if key == "name":
                return self._expect(buf, i, ":", "name_open", parts)
            if key == "arguments":
                return self._expect(buf, i, ":", "arguments", parts)
            return self._go_raw(buf, i, parts)
        if state == "name_open":
            return self._expect(buf, i, '"', "name", parts)
        if state == "name":
            text, j = self._string.feed(buf, i)
            self._name += text
            if self._string.done:
                self._string = _JsonString()
                name, self._name = self._name, ""
                call = ToolCall(len(self.calls), new_call_id(), name)
                self.calls.append(call)
                parts.append(CallStart(call.index, call.id, call.name))
                self._state = "after_name"
            return j
        if state == "after_name":
            return self._expect(buf, i, ",", "call_key_open", parts)
        if state == "arguments":
            j = self._value.feed(buf, i)
            chunk = buf[i:j]
            if chunk and self.calls:
                call = self.calls[-1]
                if not call.arguments:
                    chunk = chunk.lstrip()
                if chunk:
                    call.arguments.append(chunk)
                    parts.append(CallArguments(call.index, chunk))
            if self._value.done:
                self._value = _JsonValue()
                self._state = "call_close"
            return j
        if state == "call_close":
            if self.calls:
                call = self.calls[-1]
                nxt = self._expect(buf, i, "}", "after_call", parts)
                if self._state == "after_call":
                    call.complete = call.name in self._names
                    parts.append(CallEnd(call.index))
                return nxt
            return self._go_raw(buf, i, parts)
        if state == "after_call":
            while i < len(buf) and buf[i] in WHITESPACE:
                i += 1
            if i >= len(buf):
                return i
            if buf[i] == ",":
                self._state = "call_or_close"
                return i + 1
            return self._expect(buf, i, "]", "end", parts)
        # "end": the closing brace and whatever whitespace; nothing more is expected
        while i < len(buf) and buf[i] in WHITESPACE + "}":
            i += 1
        if i < len(buf):
            return self._go_raw(buf, i, parts)
        return i

    @property
    def complete_calls(self) -> list[ToolCall]:
        """The calls whose arguments were completed (a reply cut short may end inside one)."""
        return [c for c in self.calls if c.complete]


class ReasoningSplitter:
    """Separates the model's thinking (between its tags) from its answer, as text streams.

    A reply that starts (after whitespace) with the open tag, or one whose prompt already
    opened it (`opened`), is reasoning until the close tag; everything after is answer.
    """

    def __init__(self, open_tag: str, close_tag: str, *, opened: bool = False) -> None:
        self._open = open_tag
        self._close = close_tag
        self._state = "reasoning" if opened else "start"
        self._held = ""

    def feed(self, text: str) -> list[Part]:
        """The parts `text` completes (text that may be the start of a tag is held back)."""
        self._held += text
        parts: list[Part] = []
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                if not stripped:
                    return parts
                if stripped.startswith(self._open):
                    self._held = stripped[len(self._open) :]
                    self._state = "reasoning"
                    continue
                if self._open.startswith(stripped):
                    return parts  # maybe the tag, not complete yet
                self._state = "answer"
                continue
            if self._state == "answer_start":  # the blank line after the close tag is no answer
                self._held = self._held.lstrip(WHITESPACE)
                if not self._held:
                    return parts
                self._state = "answer"
            if self._state == "answer":
                parts.append(TextPart(self._held))
                self._held = ""
                return parts
            at = self._held.find(self._close)
            if at >= 0:
                if at:
                    parts.append(ReasoningPart(self._held[:at]))
                self._held = self._held[at + len(self._close) :]
                self._state = "answer_start"
                continue
            keep = _partial_suffix(self._held, self._close)
            if len(self._held) > keep:
                parts.append(ReasoningPart(self._held[: len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep :]
            return parts
        return parts

    def flush(self) -> list[Part]:
        """What is held back at the end of the reply."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [ReasoningPart(held) if self._state == "reasoning" else TextPart(held)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReplyReader:
    """One choice's stream of text turned into parts: reasoning first, then tools or answer text."""

    def __init__(
        self,
        *,
        tools: Sequence[str] | None = None,
        reasoning: ReasoningSplitter | None = None,
        stops: Sequence[str] = (),
    ) -> None:
        self.tools = ToolReplyReader(tools) if tools is not None else None
        self._reasoning = reasoning
        self.text: list[str] = []  # answer text so far
        self.thinking: list[str] = []  # reasoning so far
        # Stop strings matched here, against the answer text the client sees, where the reply's
        # text is tool-call JSON around it (the engine would match them in the JSON's syntax and
        # lose the calls): the stop found, and the end of the text that may begin one.
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> list[Part]:
        """The parts that `text` (the next piece of the reply) completes; none once a stop string
        was found in the answer text."""
        if self.stopped is not None:
            return []
        parts: list[Part] = self._reasoning.feed(text) if self._reasoning is not None else [TextPart(text)]
        return self._route(parts)

    def finish(self) -> list[Part]:
        """Whatever was held back, at the end of the reply."""
        if self.stopped is not None:
            return []
        parts = self._route(self._reasoning.flush()) if self._reasoning is not None else []
        held, self._held = self._held, ""  # no stop string can begin there any more
        if held:
            self.text.append(held)
            parts.append(TextPart(held))
        return parts

    def _visible(self, text: str) -> str:
        """Answer text up to the first stop string, holding back an end that may begin one."""
        if not self._stops or self.stopped is not None:
            return "" if self.stopped is not None else text
        buffer = self._held + text
        found = [(buffer.find(stop), stop) for stop in self._stops if stop in buffer]
        if found:
            at, self.stopped = min(found)
            self._held = ""
            return buffer[:at]
        keep = max(
            (n for stop in self._stops for n in range(min(len(stop) - 1, len(buffer)), 0, -1)
             if buffer.endswith(stop[:n])),
            default=0,
        )  # fmt: skip
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def _route(self, parts: list[Part]) -> list[Part]:
        routed: list[Part] = []
        for part in parts:
            if isinstance(part, TextPart) and self.tools is not None:
                routed.extend(self.tools.feed(part.text))
            else:
                routed.append(part)
        out: list[Part] = []
        for part in routed:
            if self.stopped is not None:
                break  # nothing after the stop string reaches the client
            out.append(
                TextPart(self._visible(part.text)) if isinstance(part, TextPart) and self._stops else part
            )
        for part in out:
            if isinstance(part, TextPart):
                self.text.append(part.text)
            elif isinstance(part, ReasoningPart):
                self.thinking.append(part.text)
        return [p for p in out if not isinstance(p, TextPart | ReasoningPart) or p.text]

    @property
    def answer(self) -> str:
        """The answer text so far."""
        return "".join(self.text)

    @property
    def reasoning(self) -> str | None:
        """The reasoning so far (None for a model without it)."""
        return "".join(self.thinking) if self._reasoning is not None else None

    @property
    def calls(self) -> list[ToolCall]:
        """The tool calls completed so far."""
        return self.tools.complete_calls if self.tools is not None else []


def arguments_object(call: ToolCall) -> object:
    """A completed call's arguments as a JSON value (its text parsed; {} when it does not parse)."""
    try:
        return json.loads(call.arguments_text)
    except (ValueError, RecursionError):  # a model can be pushed (logit_bias) to nest past the stack
        return {}
