"""edgellmd.http.logs: JSON lines with request ids; no parser error text, traceback or key secret."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from edgellmd.http import logs

KEY = "elk_0123456789ab_" + "S3cr3t-part_" * 3 + "abcdefg"  # 12 hex id, a 43-char secret
SECRET = KEY.split("_", 2)[2]


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    access = logging.getLogger("aiohttp.access").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(access)


def _record(name: str, msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, info)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"Bearer {KEY}", "Bearer elk_0123456789ab_[redacted]"),
        (
            f"GET /v1/{KEY}?k={KEY} 404",
            "GET /v1/elk_0123456789ab_[redacted]?k=elk_0123456789ab_[redacted] 404",
        ),
        ("elk_short_secret stays", "elk_short_secret stays"),  # not a key's shape
        ("no key here", "no key here"),
    ],
)
def test_redact(text: str, shown: str) -> None:
    assert logs.redact(text) == shown


@pytest.mark.parametrize(
    "exc",
    [
        BadHttpMessage(f"Invalid header value char:\n\n  b'Authorization: Bearer {KEY}\\x00'\n   ^"),
        LineTooLong(f"Bearer {KEY}aaaa", 8190),
        web.RequestPayloadError(f"400, message:\n  Invalid chunk: {KEY}"),
    ],
)
def test_parser_errors_lose_their_text_and_traceback(exc: BaseException) -> None:
    record = _record("aiohttp.server", "Error handling request from %s", "127.0.0.1", exc=exc)
    assert logs.ProtocolErrorFilter().filter(record)
    assert record.exc_info is None
    assert record.getMessage() == f"malformed HTTP request: {type(exc).__name__} (request bytes not logged)"
    line = logs.JsonFormatter().format(record)
    assert SECRET not in line
    assert "Authorization" not in line


def test_a_parser_error_as_a_cause_or_an_argument_is_scrubbed_too() -> None:
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = BadHttpMessage(f"bad {KEY}")
    record = _record("edgellmd.errors", "unhandled", exc=wrapped)
    logs.ProtocolErrorFilter().filter(record)
    assert record.exc_info is None
    record = _record("aiohttp.server", "parser said %s", BadHttpMessage(f"bad {KEY}"))
    logs.ProtocolErrorFilter().filter(record)
    assert SECRET not in record.getMessage()


def test_other_errors_keep_their_traceback() -> None:
    record = _record("aiohttp.server", "Unhandled exception", exc=ValueError("boom"))
    logs.ProtocolErrorFilter().filter(record)
    assert record.exc_info is not None
    line = json.loads(logs.JsonFormatter().format(record))
    assert "ValueError: boom" in line["exc"]


def test_json_lines_redact_extras_and_the_request_id() -> None:
    token = logs.request_id.set(KEY)  # a client may send anything sane as its X-Request-Id
    try:
        record = _record("edgellmd.access", "GET %s 404", f"/{KEY}")
        record.peer = f"x {KEY}"
        line = logs.JsonFormatter().format(record)
    finally:
        logs.request_id.reset(token)
    assert SECRET not in line
    entry = json.loads(line)
    assert entry["msg"] == "GET /elk_0123456789ab_[redacted] 404"
    assert entry["peer"] == "x elk_0123456789ab_[redacted]"


@pytest.mark.usefixtures("root_restored")
@pytest.mark.parametrize("fmt", ["json", "text"])
def test_configure_scrubs_every_logger(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    logs.configure("debug", fmt)
    for name in logs.AIOHTTP_LOGGERS:
        assert any(isinstance(f, logs.ProtocolErrorFilter) for f in logging.getLogger(name).filters)
    logs.guard_library_loggers()  # idempotent
    assert (
        sum(isinstance(f, logs.ProtocolErrorFilter) for f in logging.getLogger("aiohttp.server").filters) == 1
    )
    bad = BadHttpMessage(f"Invalid header value char: b'Authorization: Bearer {KEY}'")
    logging.getLogger("aiohttp.server").error("Error handling request from %s", "10.0.0.1", exc_info=bad)
    logging.getLogger("edgellmd.api").error("handler failed", exc_info=web.RequestPayloadError(str(bad)))
    logging.getLogger("edgellmd.access").info("GET /%s 404", KEY)
    text = out.getvalue()
    assert SECRET not in text
    assert "Authorization" not in text
    assert text.count("malformed HTTP request: ") == 2
    assert "elk_0123456789ab_[redacted]" in text
