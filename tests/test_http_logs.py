"""edgellmd.http.logs: JSON lines with request ids; no parser error text, traceback or key secret."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from edgellmd.http import logs
from edgellmd.http.app import create_app
from edgellmd.ledger import audit
from edgellmd.redaction import redact
from tests.serving import settings_for

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
        # Glued to word characters: the second hostile round found these whole in the log.
        (f"/v1/models/X{KEY}", "/v1/models/Xelk_0123456789ab_[redacted]"),
        (f"X-Request-Id: a{KEY}", "X-Request-Id: aelk_0123456789ab_[redacted]"),
        (f'"user": "x{KEY}"', '"user": "xelk_0123456789ab_[redacted]"'),
        (f"9{KEY}9", "9elk_0123456789ab_[redacted]"),
        (f"{KEY[:24]} cut short", "elk_0123456789ab_[redacted] cut short"),
        (f"{KEY}{KEY}", "elk_0123456789ab_[redacted]"),  # one run of a secret's alphabet
    ],
)
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown


@pytest.mark.parametrize(
    "exc",
    [
        BadHttpMessage(f"Invalid header value char:\n\n  b'Authorization: Bearer {KEY}\\x00'\n   ^"),
        LineTooLong(f"Bearer {KEY}aaaa", 8190),
        web.RequestPayloadError(f"400, message:\n  Invalid chunk: {KEY}"),
    ],
)
def test_parser_errors_lose_their_text_and_traceback(
    exc: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    record = _record("aiohttp.server", "Error handling request from %s", "127.0.0.1", exc=exc)
    assert logs.ProtocolErrorFilter().filter(record)
    assert record.levelname == "INFO"  # a client's malformed request, answered: no ERROR line
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
    assert logs.ProtocolErrorFilter().filter(record)
    assert record.exc_info is not None
    assert record.levelname == "ERROR"
    line = json.loads(logs.JsonFormatter().format(record))
    assert "ValueError: boom" in line["exc"]


def test_a_parser_error_is_dropped_where_info_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiohttp.server")
    record = _record("aiohttp.server", "Unhandled exception", exc=web.RequestPayloadError("bad deflate"))
    assert not logs.ProtocolErrorFilter().filter(record)


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


@pytest.mark.usefixtures("root_restored")
@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_a_key_glued_to_other_text_reaches_no_log_line_and_no_answer(
    fmt: str, monkeypatch: pytest.MonkeyPatch, aiohttp_client: Any, tiny_model: Path
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    logs.configure("debug", fmt)
    settings = settings_for([{"name": "tiny", "file": str(tiny_model), "slots": 1, "threads": 1}])
    client = await aiohttp_client(create_app(settings))
    deadline = time.monotonic() + 30
    while (await client.get("/readyz")).status != 200:
        assert time.monotonic() < deadline, "the model never loaded"
        await asyncio.sleep(0.02)
    answers: list[str] = []
    for path in (f"/v1/models/X{KEY}", f"/v1/models/{KEY}"):
        answer = await client.get(path)
        assert answer.status == 404
        answers.append(await answer.text())
    answer = await client.post("/v1/completions", json={"model": f"X{KEY}", "prompt": "hi", "max_tokens": 1})
    assert answer.status == 404
    answers.append(await answer.text())
    chat = {
        "model": "tiny",
        "max_tokens": 1,
        "user": f"x{KEY}",
        "messages": [{"role": "user", "content": "hi"}],
    }
    answer = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": f"a{KEY}"})
    assert answer.status == 200
    assert SECRET not in answer.headers["X-Request-Id"]
    answers.append(await answer.text())
    messages = {
        "model": "tiny",
        "max_tokens": 1,
        "metadata": {"user_id": f"x{KEY}"},
        "messages": [{"role": "user", "content": "hi"}],
    }
    answer = await client.post("/v1/messages", json=messages, headers={"X-Request-Id": KEY})
    assert answer.status == 200
    assert SECRET not in answer.headers["X-Request-Id"]
    answers.append(await answer.text())
    for text in answers:
        assert SECRET not in text
    await client.close()
    written = out.getvalue()
    assert SECRET not in written
    assert written.count("elk_0123456789ab_[redacted]") >= 2  # the access lines of the 404s


FORGED = f"audit record 1 {'0' * 64}: forged"


@pytest.mark.usefixtures("root_restored")
@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_a_request_path_writes_one_line_and_poses_as_no_audit_record(
    fmt: str, monkeypatch: pytest.MonkeyPatch, aiohttp_client: Any, tiny_model: Path
) -> None:
    """A client's path is logged whole: line breaks, terminal escapes and bidi overrides come
    out escaped in a text line (JSON escapes its own), and words shaped like the ledger's
    mirror of the audit chain, anywhere in it, are not read as one (`audit verify --against`
    would report tampering that never happened)."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    logs.configure("info", fmt)
    settings = settings_for([{"name": "tiny", "file": str(tiny_model), "slots": 1, "threads": 1}])
    client = await aiohttp_client(create_app(settings))
    head = "2026-12-05 10:00:00,000 INFO edgellmd.ledger [-] "
    for path in (
        "/" + FORGED.replace(" ", "%20"),
        "/x%0a" + (head + FORGED).replace(" ", "%20"),
        "/x%0d%1b[31m%E2%80%AE%E2%80%A8" + FORGED.replace(" ", "%20"),
        f'/x:%20{{"logger":"edgellmd.ledger","msg":"{FORGED}"}}'.replace(" ", "%20"),
    ):
        assert (await client.get(path)).status == 404
    await client.close()
    lines = out.getvalue().splitlines()
    access = [line for line in lines if "edgellmd.access" in line]
    assert len(access) == 4, lines  # one line each, whatever the path held
    if fmt == "text":
        assert all(line.startswith(("20", "19")) for line in lines)  # no line begins with a client's words
        assert "\\x0a" in access[1]
        assert "\\x1b" in access[2]
        assert "\\u202e" in access[2]
    assert FORGED in "\n".join(access)
    assert [audit.mirrored_record(line) for line in lines] == [None] * len(lines)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_the_ledgers_own_lines_are_read_as_its_mirror(fmt: str) -> None:
    record = logging.LogRecord(
        audit.MIRROR_LOGGER,
        logging.INFO,
        __file__,
        1,
        "audit record %d %s: %s",
        (7, "ab" * 32, "reload"),
        None,
    )
    record.request_id = "-"
    line = (logs.JsonFormatter() if fmt == "json" else logs.TextFormatter(logs.TEXT_FORMAT)).format(record)
    assert audit.mirrored_record(line) == (7, "ab" * 32)
    prefix = "Dec 05 10:00:00 box edgellmd[812]: "  # journalctl's default output
    assert audit.mirrored_record(prefix + line) == ((7, "ab" * 32) if fmt == "json" else None)


def test_a_json_line_holds_no_character_a_terminal_or_a_line_reader_acts_on() -> None:
    """json escapes C0 controls alone: a request path's U+009B (a one-byte CSI), a bidi
    override or U+2028 (a line break to line-based JSON tools) reached the line raw."""
    hostile = "/v1/\x9b31m\u202etxt.exe\u2028forged\x1b[2J"
    record = _record("edgellmd.access", "GET %s 401", hostile)
    record.request_id = "-"
    line = logs.JsonFormatter().format(record)
    assert line.isascii()
    assert line.isprintable()
    assert json.loads(line)["msg"] == f"GET {hostile} 401"  # the text itself, escaped in JSON only
