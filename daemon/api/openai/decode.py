"""Validation of OpenAI request bodies into typed requests; every rejection names its parameter."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from edgellmd.api.fields import Fields, metadata_object, note_ignored, reject_unknown, unsupported
from edgellmd.api.jsontext import embedded_json
from edgellmd.api.media import Content, MediaReader
from edgellmd.api.request import (
    ChatRequest,
    CommonRequest,
    Limits,
    service_tier,
    token_limit,
    within_ceiling,
)
from edgellmd.api.structured import response_format_grammar, tool_plan
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.generation import DEFAULT_PENALTY_LAST_N, DEFAULT_TOP_K, SamplingParams
from edgellmd.errors import (
    InvalidRequest,
    UnsupportedParameter,
    shown,
)

MAX_STOP_SEQUENCES: Final = 4  # OpenAI's limit
MAX_STOP_LENGTH: Final = 256  # characters per stop string
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's documented default for /v1/completions
MAX_EMBEDDING_INPUTS: Final = 2048  # OpenAI's limit on inputs per embeddings request
ENCODING_FORMATS: Final = ("float", "base64")
CHAT_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_CHOICES: Final = 16  # n; each choice takes a slot
MAX_LOGIT_BIAS: Final = 1024  # entries
MAX_TOP_LOGPROBS: Final = 20  # chat; OpenAI's limit
MAX_COMPLETION_LOGPROBS: Final = 5  # legacy completions; OpenAI's limit
_TOKEN_ID: Final = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() takes "²" and "٣"

# Accepted and ignored: they do not change what is generated.
_IGNORED: Final = frozenset(
    {
        "user",
        "store",
        "metadata",
        "service_tier",  # read (request.service_tier): a class, never above the key's
        "parallel_tool_calls",
        "prediction",
        "reasoning_effort",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "verbosity",
    }
)
_SAMPLING: Final = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "logit_bias",
        "ignore_eos",
    }
)
_CHAT_FIELDS: Final = (
    _SAMPLING
    | _IGNORED
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "modalities",
        "audio",
        "web_search_options",
        "moderation",
    }
)
_COMPLETION_FIELDS: Final = _SAMPLING | _IGNORED | {"prompt", "echo", "suffix", "best_of"}
_EMBEDDING_FIELDS: Final = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated `POST /v1/completions` body; the prompt is text or token ids."""

    common: CommonRequest
    prompt: str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """A validated `POST /v1/embeddings` body; each input is text or token ids."""

    model: str
    inputs: tuple[str | tuple[int, ...], ...]  # always a tuple, even for one string
    encoding_format: str  # one of ENCODING_FORMATS
    user: str | None


def _stop(f: Fields) -> tuple[str, ...]:
    value = f.data.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    if any(len(s) > MAX_STOP_LENGTH for s in items):
        raise InvalidRequest(
            f"each 'stop' sequence must be at most {MAX_STOP_LENGTH} characters", param="stop"
        )
    return tuple(s for s in items if s)


def _common(
    f: Fields, limits: Limits, *, max_tokens_names: tuple[str, ...], default_max_tokens: int | None
) -> CommonRequest:
    model = f.string("model", required=True)
    assert model is not None  # noqa: S101 - required=True guarantees it
    if not model:
        raise InvalidRequest("'model' must not be empty", param="model")

    asked: int | None = None
    for name in max_tokens_names:  # max_completion_tokens, the newer name, wins
        value = f.integer(name, lo=1)
        if value is not None:
            asked = within_ceiling(limits, name, value)
    max_tokens = token_limit(limits, asked, default_max_tokens)

    n = f.integer("n", lo=1, hi=MAX_CHOICES) or 1
    stream = f.boolean("stream", False)
    include_usage = False
    options = f.data.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise InvalidRequest(
                "'stream_options' must be an object with 'include_usage'", param="stream_options"
            )
        if not isinstance(options.get("include_usage", False), bool):
            raise InvalidRequest(
                "'stream_options.include_usage' must be a boolean", param="stream_options.include_usage"
            )
        include_usage = bool(options.get("include_usage", False))

    seed = f.integer("seed", lo=-(2**63), hi=2**64 - 1)
    sampling = SamplingParams(
        temperature=f.number("temperature", 1.0, lo=0.0, hi=2.0),
        top_p=f.number("top_p", 1.0, lo=0.0, hi=1.0),
        top_k=f.integer("top_k", lo=0, hi=1_000_000) if f.present("top_k") else DEFAULT_TOP_K,  # type: ignore[arg-type] # present() guarantees an int
        min_p=f.number("min_p", 0.0, lo=0.0, hi=1.0),
        repeat_penalty=f.number("repeat_penalty", 1.0, lo=0.01, hi=10.0),
        presence_penalty=f.number("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        penalty_last_n=DEFAULT_PENALTY_LAST_N,
        seed=seed,
        logit_bias=_logit_bias(f.data.get("logit_bias")),
    )
    return CommonRequest(
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(f),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=f.boolean("ignore_eos", False),
        n=n,
        user=f.string("user"),
        priority=service_tier(f),
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} with biases from -100 (ban) to 100 (force)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", param="logit_bias"
        )
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key)):
            raise InvalidRequest("'logit_bias' keys must be token ids (as strings)", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise InvalidRequest("'logit_bias' values must be numbers from -100 to 100", param="logit_bias")
        # -100 bans the token outright, as OpenAI documents.
        out.append((int(key), float("-inf") if bias <= -100 else float(bias)))
    return tuple(out)


# Content part fields, by part type (OpenAI's; `detail` asks for a resolution the projector decides).
_PART_FIELDS: Final = {
    "text": frozenset({"type", "text"}),
    "image_url": frozenset({"type", "image_url"}),
    "input_audio": frozenset({"type", "input_audio"}),
}


def _content(value: Any, param: str, role: str, media: MediaReader) -> Content:
    """A message's content: a string, or text, image and audio parts (images and audio in user
    messages only, as OpenAI has them)."""
    content = Content()
    if isinstance(value, str):
        content.text(value)
        return content
    if not isinstance(value, list):
        raise InvalidRequest(f"'{param}' must be a string or a list of content parts", param=param)
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"'{where}' must be a content part object with a 'type'", param=where)
        kind = part["type"]
        if kind not in _PART_FIELDS or (kind != "text" and role != "user"):
            allowed = "text, image_url or input_audio" if role == "user" else "text"
            raise UnsupportedParameter(
                f"content parts of type {shown(kind[:32])} are not supported in {role} messages ({allowed})",
                param=f"{where}.type",
            )
        unknown = set(part) - _PART_FIELDS[kind]
        if unknown:
            key = shown(sorted(unknown)[0])
            raise InvalidRequest(f"unrecognized content part field: {key}", param=f"{where}.{key}")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
            content.text(part["text"])
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(image, dict) and image.get("detail", "auto") not in ("auto", "low", "high"):
                raise InvalidRequest(
                    f"'{where}.image_url.detail' must be auto, low or high", param=f"{where}.image_url.detail"
                )
            content.media(media.image_url(url, f"{where}.image_url.url"))
        else:
            audio = part.get("input_audio")
            if not isinstance(audio, dict) or set(audio) - {"data", "format"}:
                raise InvalidRequest(
                    f"'{where}.input_audio' must be {{data, format}}", param=f"{where}.input_audio"
                )
            content.media(media.audio_base64(audio.get("data"), audio.get("format"), f"{where}.input_audio"))
    return content


def _messages(f: Fields, media: MediaReader) -> tuple[ChatMessage, ...]:
    value = f.data.get("messages")
    if value is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out: list[ChatMessage] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        role = msg.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"'{where}.role' must be a string", param=f"{where}.role")
        if role == "function" or msg.get("function_call"):
            raise UnsupportedParameter(
                "the deprecated 'function' messages are not supported; use tools", param=f"{where}.role"
            )
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'{where}.role' must be one of {', '.join(sorted(CHAT_ROLES))}", param=f"{where}.role"
            )
        unknown = set(msg) - {"role", "content", "name", "refusal", "tool_calls", "tool_call_id"}
        if unknown:
            key = shown(sorted(unknown)[0])
            raise InvalidRequest(f"unrecognized message field: {key}", param=f"{where}.{key}")
        calls = _tool_calls(msg.get("tool_calls"), role, where)
        content = msg.get("content")
        if content is None and not calls:
            raise InvalidRequest(f"'{where}.content' is required", param=f"{where}.content")
        call_id = msg.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise InvalidRequest(
                f"'{where}.tool_call_id' is required for tool messages", param=f"{where}.tool_call_id"
            )
        name = msg.get("name")
        parts = Content() if content is None else _content(content, f"{where}.content", role, media)
        # `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
        out.append(
            parts.message(
                "system" if role == "developer" else role,
                tool_calls=calls,
                tool_call_id=call_id if role == "tool" else None,
                name=name if isinstance(name, str) else None,
            )
        )
    return tuple(out)


def _tool_calls(value: Any, role: str, where: str) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    param = f"{where}.tool_calls"
    if role != "assistant" or not isinstance(value, list):
        raise InvalidRequest(f"'{param}' must be a list, on assistant messages only", param=param)
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments", ""), str)
            and isinstance(call.get("id", ""), str)
        ):
            raise InvalidRequest(
                f"'{param}[{j}]' must be {{id, type: function, function: {{name, arguments}}}}",
                param=f"{param}[{j}]",
            )
        embedded_json(fn.get("arguments", ""), f"{param}[{j}].function.arguments")
    return tuple(value)


def parse_chat(data: Mapping[str, Any], limits: Limits) -> ChatRequest:
    """Validate a chat completion body."""
    reject_unknown(data, _CHAT_FIELDS)
    f = Fields(data)
    for name in ("functions", "function_call", "audio", "web_search_options", "moderation"):
        if f.present(name):
            raise unsupported(name)
    f.string("prompt_cache_retention")
    options = data.get("prompt_cache_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'prompt_cache_options' must be an object", param="prompt_cache_options")
    note_ignored(data, _IGNORED - {"user", "metadata", "service_tier"})
    # Ignored, but of the types OpenAI takes: a client's mistake is a 400 here as it is there.
    metadata_object(data.get("metadata"))
    for name in ("store", "parallel_tool_calls"):
        f.boolean(name, False)
    for name in ("reasoning_effort", "verbosity", "safety_identifier", "prompt_cache_key"):
        f.string(name)
    if f.present("prediction") and not isinstance(data["prediction"], dict):
        raise InvalidRequest("'prediction' must be an object", param="prediction")
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    answer_format = data["response_format"] if f.present("response_format") else None
    _nested_fields(answer_format, data.get("tools"))
    tools = tool_plan(
        data.get("tools"),
        data.get("tool_choice"),
        data.get("parallel_tool_calls"),
        answer_format=answer_format,
    )
    grammar: str | None = None
    if tools is not None and tools.grammar is not None:
        grammar = tools.grammar  # a call, or (auto) an answer of the format
    else:
        grammar = response_format_grammar(answer_format) if answer_format is not None else None
    modalities = data.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported("modalities", "other than ['text']")
    common = _common(
        f, limits, max_tokens_names=("max_tokens", "max_completion_tokens"), default_max_tokens=None
    )
    common = replace(
        common, logprobs=(top or 0) if logprobs else None, sampling=replace(common.sampling, grammar=grammar)
    )
    return ChatRequest(common=common, messages=_messages(f, MediaReader(limits.media)), tools=tools)


def parse_completion(data: Mapping[str, Any], limits: Limits) -> CompletionRequest:
    """Validate a (legacy) text completion body."""
    reject_unknown(data, _COMPLETION_FIELDS)
    f = Fields(data)
    if f.boolean("echo", False):
        raise unsupported("echo")
    if f.present("suffix"):
        raise unsupported("suffix")
    best_of = f.integer("best_of", lo=1, hi=128)
    if best_of is not None and best_of != 1:
        raise unsupported("best_of", "greater than 1")
    logprobs = f.integer("logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS)
    common = _common(
        f, limits, max_tokens_names=("max_tokens",), default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS
    )
    return CompletionRequest(common=replace(common, logprobs=logprobs), prompt=_prompt(data.get("prompt")))


_FORMAT_FIELDS: Final = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "json_schema"}),
}
_TOOL_FIELDS: Final = frozenset({"type", "function"})
_FUNCTION_FIELDS: Final = frozenset({"name", "description", "parameters", "strict"})


def _nested_fields(answer_format: Any, tools: Any) -> None:
    """The fields of `response_format` and of each tool and its function, as OpenAI takes
    them: one it does not know is a 400 there as at the top level (it was taken and ignored)."""
    if isinstance(answer_format, dict):
        kind = answer_format.get("type")
        known = _FORMAT_FIELDS.get(kind) if isinstance(kind, str) else None
        if known is not None:
            reject_unknown(answer_format, known, "response_format")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") == "function":
            reject_unknown(tool, _TOOL_FIELDS, f"tools[{i}]")
            if isinstance(tool.get("function"), dict):
                reject_unknown(tool["function"], _FUNCTION_FIELDS, f"tools[{i}].function")


def _prompt(value: Any) -> str | tuple[int, ...]:
    # OpenAI accepts a string, a list of strings, a list of token ids, or a list of such lists;
    # one prompt per request here (several would be several choices: not supported yet).
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        if any(t < 0 for t in value):
            raise InvalidRequest("'prompt' token ids must not be negative", param="prompt")
        return tuple(value)
    if value is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value):
        raise UnsupportedParameter("several prompts in one request are not supported", param="prompt")
    raise InvalidRequest("'prompt' must be a string or a list of token ids", param="prompt")


def parse_embeddings(data: Mapping[str, Any], max_inputs: int = MAX_EMBEDDING_INPUTS) -> EmbeddingRequest:
    """Validate an embeddings body."""
    reject_unknown(data, _EMBEDDING_FIELDS)
    f = Fields(data)
    if f.present("dimensions"):  # the model's vectors have one size; shortening them is not done here
        raise unsupported("dimensions")
    model = f.string("model", required=True)
    assert model is not None  # noqa: S101 - required=True guarantees it
    if not model:
        raise InvalidRequest("'model' must not be empty", param="model")
    inputs = _embedding_inputs(data.get("input"), max_inputs)
    encoding_format = f.string("encoding_format")
    if encoding_format is None:
        encoding_format = "float"
    if encoding_format not in ENCODING_FORMATS:
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    return EmbeddingRequest(
        model=model, inputs=inputs, encoding_format=encoding_format, user=f.string("user")
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: list[Any], where: str) -> tuple[int, ...]:
    if not value:
        raise InvalidRequest(f"'{where}' must not be an empty list", param="input")
    if not all(_is_token(t) for t in value):
        raise InvalidRequest(f"'{where}' must hold only integer token ids", param="input")
    if any(t < 0 for t in value):
        raise InvalidRequest(f"'{where}' token ids must not be negative", param="input")
    return tuple(value)


def _embedding_inputs(value: Any, max_inputs: int) -> tuple[str | tuple[int, ...], ...]:
    # OpenAI's four shapes: a string, a list of strings, a list of token ids (one input),
    # or a list of lists of token ids; never a mix of them, never deeper.
    if value is None:
        raise InvalidRequest("'input' is required", param="input")
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("'input' must not be an empty string", param="input")
        return (value,)
    shapes = (
        "'input' must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    )
    if not isinstance(value, list):
        raise InvalidRequest(shapes, param="input")
    if not value:
        raise InvalidRequest("'input' must not be an empty list", param="input")
    if all(_is_token(t) for t in value):
        return (_token_ids(value, "input"),)
    if len(value) > max_inputs:
        raise InvalidRequest(f"'input' takes at most {max_inputs} inputs, got {len(value)}", param="input")
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text:
                raise InvalidRequest(f"'input[{i}]' must not be an empty string", param="input")
        return tuple(value)
    if all(isinstance(v, list) for v in value):
        return tuple(_token_ids(v, f"input[{i}]") for i, v in enumerate(value))
    raise InvalidRequest(shapes, param="input")
