"""OpenAI's `POST /v1/audio/transcriptions`, on models whose projector hears (`models[].mmproj`).

The upload (multipart/form-data, as the OpenAI SDK's `audio.transcriptions.create` sends it)
is read whole within the body limit, its fields checked, and the clip put to the model as a
one-turn chat: the clip, then an instruction to write down what is said (with the request's
`language` and `prompt` as hints). The model's reply is the transcript: JSON
(`{"text", "usage"}`) or plain text, as `response_format` asks. A model that reads no audio,
a clip past `media.max_audio_bytes` or `media.max_audio_seconds`, or one that does not
decode, is a 400 naming why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from edgellmd.api.context import token_limits
from edgellmd.api.media import Content, MediaReader
from edgellmd.api.openai.encode import collect_text
from edgellmd.api.request import ChatRequest, CommonRequest, token_limit
from edgellmd.api.session import chat_session
from edgellmd.engine.config import MediaInput
from edgellmd.engine.generation import SamplingParams
from edgellmd.errors import (
    ApiError,
    InvalidRequest,
    MalformedRequest,
    PayloadTooLarge,
    UnsupportedMediaType,
    UnsupportedParameter,
    shown,
)

PATH: Final = "/v1/audio/transcriptions"
INSTRUCTION: Final = "Transcribe this audio word for word. Reply with the transcript only."
FORMATS: Final = ("json", "text")
# Known to OpenAI, not done here: refused by name (verbose_json, srt and vtt need timings).
_UNSUPPORTED: Final = frozenset({"timestamp_granularities[]", "timestamp_granularities", "chunking_strategy"})
_FIELDS: Final = frozenset(
    {
        "file",
        "model",
        "language",
        "prompt",
        "response_format",
        "temperature",
        "stream",
        "include[]",
        "include",
    }
)
_LANGUAGE: Final = re.compile(r"[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?")
MAX_FIELD_BYTES: Final = 65_536  # a text field (prompt, model, ...) of the form
# Parts of one form: the SDK sends a dozen at most. With the body limit over all of them, a
# chunked body (no Content-Length to refuse up front) of repeated fields ends at the limit.
MAX_PARTS: Final = 64
MAX_PROMPT_CHARS: Final = 4096


@dataclass(frozen=True, slots=True)
class Upload:
    """A transcription request's form: its fields and its file."""

    fields: dict[str, str]
    file: bytes
    filename: str | None
    content_type: str | None


async def _read_part(part: BodyPartReader, most: int, name: str, limit: int) -> bytes:
    """A part's bytes, refused once past `most` (its own bound) or `limit` (what is left of the body's)."""
    out = bytearray()
    while chunk := await part.read_chunk(65_536):
        out += chunk
        if len(out) > limit:
            raise PayloadTooLarge("request body too large: past the body limit (server.max_body_bytes)")
        if len(out) > most:
            raise InvalidRequest(f"the form field {name} is longer than {most} bytes", param=name)
    return bytes(out)


async def read_upload(request: web.Request, max_file_bytes: int) -> Upload:
    """The multipart form: each text field within MAX_FIELD_BYTES, the file within one byte past
    `max_file_bytes` (so that its refusal can name that limit), all within the body limit."""
    if request.content_type != "multipart/form-data":
        raise UnsupportedMediaType("the request body must be multipart/form-data, with the clip as 'file'")
    limit = request._client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body too large: {request.content_length} bytes, at most {limit}")
    fields: dict[str, str] = {}
    file: bytes | None = None
    filename = content_type = None
    left = limit  # what the parts' bytes may still take, chunked bodies included
    parts = 0
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            parts += 1
            if parts > MAX_PARTS:
                raise InvalidRequest(f"the form has more than {MAX_PARTS} parts")
            if not isinstance(part, BodyPartReader) or not part.name:
                raise InvalidRequest("each part of the form must be a named field")
            name = part.name
            if name not in _FIELDS and name not in _UNSUPPORTED:
                safe = shown(name[:64])
                raise InvalidRequest(f"unrecognized form field: {safe}", param=safe)
            if name == "file":
                if file is not None:
                    raise InvalidRequest("one 'file' per request", param="file")
                file = await _read_part(part, max_file_bytes + 1, name, left)
                left -= len(file)
                filename, content_type = part.filename, part.headers.get("Content-Type")
                continue
            raw = await _read_part(part, MAX_FIELD_BYTES, name, left)
            left -= len(raw)
            try:
                fields[name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"the form field {name} is not UTF-8 text", param=name) from None
    except (ValueError, AssertionError, KeyError, web.HTTPException, HttpProcessingError, EOFError):
        # aiohttp's multipart reader says "malformed" in many ways (a bad part head, a body cut
        # short, no boundary): each is the client's 400, never a traceback.
        raise MalformedRequest("the multipart body could not be read") from None
    if file is None:
        raise InvalidRequest("'file' is required: the audio clip", param="file")
    return Upload(fields, file, filename, content_type)


def _format_hint(upload: Upload) -> str | None:
    """The clip's format as its file name or part says (checked against its bytes later)."""
    if upload.filename and "." in upload.filename:
        return upload.filename.rsplit(".", 1)[1][:16]
    if upload.content_type:
        return upload.content_type[:64]
    return None


def _request(upload: Upload, item: MediaInput, limits_max: int, max_tokens: int) -> tuple[ChatRequest, str]:
    fields = upload.fields
    for name in _UNSUPPORTED & set(fields):
        raise UnsupportedParameter(f"'{name}' is not supported by this server", param=name)
    if fields.get("stream", "false").lower() not in ("false", "0"):
        raise UnsupportedParameter("streamed transcripts are not supported by this server", param="stream")
    model = fields.get("model")
    if not model:
        raise InvalidRequest("'model' is required", param="model")
    response_format = fields.get("response_format", "json")
    if response_format not in FORMATS:
        raise UnsupportedParameter(
            f"'response_format' must be json or text on this server (got {response_format[:32]!r})",
            param="response_format",
        )
    try:
        temperature = float(fields.get("temperature", "0"))
    except ValueError:
        temperature = -1.0
    if not 0.0 <= temperature <= 1.0:
        raise InvalidRequest("'temperature' must be a number from 0 to 1", param="temperature")
    language = fields.get("language")
    if language is not None and not _LANGUAGE.fullmatch(language):
        raise InvalidRequest("'language' must be an ISO-639-1 code like en", param="language")
    prompt = fields.get("prompt", "")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"'prompt' may be at most {MAX_PROMPT_CHARS} characters", param="prompt")
    content = Content()
    content.media(item)
    instruction = INSTRUCTION
    if language:
        instruction += f" The language is {language}."
    if prompt:
        instruction += f" It may continue or use the words of: {prompt}"
    content.text("\n" + instruction)
    common = CommonRequest(
        model=model,
        max_tokens=min(max_tokens, limits_max),
        sampling=SamplingParams(temperature=temperature),
        stop=(),
        stream=False,
        include_usage=True,
        ignore_eos=False,
    )
    return ChatRequest(common=common, messages=(content.message("user"),)), response_format


async def transcriptions(request: web.Request) -> web.Response:
    """POST /v1/audio/transcriptions: the clip's transcript, as JSON or text."""
    limits = token_limits(request)
    upload = await read_upload(request, limits.media.max_audio_bytes)
    item = MediaReader(limits.media).audio_file(upload.file, _format_hint(upload), "file")
    body, response_format = _request(upload, item, limits.max_tokens_limit, token_limit(limits, None))
    try:
        async with chat_session(request, body) as session:
            text, final = await collect_text(session)
    except ApiError as exc:
        if exc.param == "messages":  # the prompt is the daemon's own: what the client sent is its file
            exc.param = "file"
            exc.message = exc.message.removeprefix("clip 1: ")
        raise
    text = text.strip()
    if response_format == "text":
        return web.Response(text=text + "\n", content_type="text/plain")
    usage = {
        "type": "tokens",
        "input_tokens": final.prompt_tokens,
        "output_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }
    return web.json_response({"text": text, "usage": usage})
