"""The rules every JSON text a client sends must meet: the request body, and JSON inside a string.

A body is read once (`read_json_object`): UTF-8, at most `MAX_JSON_DEPTH` levels, no lone
UTF-16 surrogate, no number too long to convert. Some fields carry JSON as a string (a chat
assistant turn's `tool_calls[].function.arguments`, a Responses `function_call.arguments`):
the templates and the tool-turn rewriting parse those later, so `embedded_json` holds them
to the same rules at decode time, with a 400 naming the parameter. Nothing past it walks a
value nested deeper than the limit or meets a string llama.cpp cannot encode.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from aiohttp import compression_utils, hdrs, web

from edgellmd.engine.chat import json_depth
from edgellmd.errors import InvalidRequest, MalformedRequest, PayloadTooLarge, UnsupportedMediaType

# Deeper bodies are refused before anyone walks them. OpenAI allows 10 levels of schema
# nesting, each two JSON levels (four with an Optional's anyOf) inside a request's own few.
MAX_JSON_DEPTH: Final = 64
_PLAIN_NAME: Final = re.compile(r"[A-Za-z0-9_]{1,64}")
# JSON's \uD800-\uDFFF escapes are the only way a lone surrogate gets into a parsed value (the
# bytes are valid UTF-8): one that json.loads did not pair with its partner is refused, as
# it can be neither encoded for llama.cpp nor written back to a client.
_ESCAPED_SURROGATE: Final = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(data: Any) -> str | None:
    """Where the first string holding a lone surrogate is (`messages[0].content`), or None."""
    pending: list[tuple[Any, str]] = [(data, "")]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return path or "(the body)"
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_surrogate(key):
                    return "(a key)"
                shown = key if _PLAIN_NAME.fullmatch(key) else "?"
                pending.append((item, f"{path}.{shown}" if path else shown))
        elif isinstance(value, list):
            pending.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


# A body's Content-Encoding: one that aiohttp decodes here, or none (stacked codings are not
# decoded). br and zstd only where their modules are installed (aiohttp's optional extras):
# otherwise every such body would fail as "not valid" after the 415 named them as taken.
DECODED_CODINGS: Final = frozenset(
    {"", "identity", "gzip", "deflate"}
    | ({"br"} if compression_utils.HAS_BROTLI else set())
    | ({"zstd"} if compression_utils.HAS_ZSTD else set())
)


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """Read the body as a JSON object, refusing other media types, bad UTF-8 and deep nesting."""
    if request.content_type != "application/json":
        raise UnsupportedMediaType("the request body must be JSON (Content-Type: application/json)")
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise UnsupportedMediaType("the request body must be JSON in UTF-8 (charset=utf-8, or none)")
    coding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if coding not in DECODED_CODINGS:  # aiohttp would hand its bytes on as they came
        raise UnsupportedMediaType(
            "the request body's Content-Encoding must be one of " + ", ".join(sorted(DECODED_CODINGS - {""}))
        )
    limit = request._client_max_size
    if request.content_length is not None and request.content_length > limit:
        # Declared too long: refused at once, not after the body timeout of a body never sent.
        raise PayloadTooLarge(f"request body too large: {request.content_length} bytes, at most {limit}")
    try:
        raw = await request.read()  # bounded by client_max_size; aiohttp answers 413 beyond it
    except web.RequestPayloadError:  # a body encoding (gzip, chunks) that does not decode
        raise MalformedRequest("the request body could not be decoded") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except ValueError:  # e.g. an integer literal longer than Python converts
        raise InvalidRequest("the body is not valid JSON: a number is too long") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the JSON body must be an object")
    if json_depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    if _ESCAPED_SURROGATE.search(text):
        where = _lone_surrogate(data)
        if where is not None:
            raise InvalidRequest(
                f"the JSON body holds a lone UTF-16 surrogate escape (at {where}); "
                "strings must be valid Unicode",
                param=where if where != "(a key)" else None,
            )
    return data


def embedded_json(text: str, param: str) -> None:
    """Hold JSON that travels inside the string `text` (field `param`) to the body's rules.

    Text that is not JSON at all stays the client's text (OpenAI takes any string there);
    JSON that is nested too deep, holds a lone surrogate or a number too long is refused.
    The caller checked `text` itself with the body.
    """
    stripped = text.lstrip()
    if not stripped or stripped[0] not in '[{"':
        return  # a number, a literal, or plain text: nothing nests, nothing escapes
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        deep = True
    except json.JSONDecodeError:
        return
    except ValueError:  # an integer literal longer than Python converts
        raise InvalidRequest(f"'{param}' holds JSON with a number that is too long", param=param) from None
    else:
        deep = json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH
    if deep:
        raise InvalidRequest(f"'{param}' holds JSON nested deeper than {MAX_JSON_DEPTH} levels", param=param)
    if _ESCAPED_SURROGATE.search(text) and _lone_surrogate(value) is not None:
        raise InvalidRequest(
            f"'{param}' holds JSON with a lone UTF-16 surrogate escape; strings must be valid Unicode",
            param=param,
        )
