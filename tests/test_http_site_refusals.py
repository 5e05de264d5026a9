"""What aiohttp's parser refuses is answered with an envelope and security headers, quoting nothing.

The last test runs the daemon as a process with JSON logs at debug level, sends every kind of
malformed request carrying a real API key, and scans the whole log for the key's secret.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import compression_utils, web

from edgellmd.http.app import SECURITY_HEADERS
from edgellmd.http.site import check_internals
from tests.ggufmodels import TinyModelSpec
from tests.rawhttp import RawAnswer, closed_within, connect, exchange, get, post, read_answer
from tests.reliability.harness import DaemonProcess, SignedBox
from tests.serving import RunningDaemon, free_port, running, settings_for, small_tiny

MARK = "zq7MARKzq7"  # stands for anything a client sent: it must never come back
HEAD_TOO_LARGE = "request_head_too_large"
MALFORMED = "malformed_request"


def _head(*lines: str, request_line: str = "GET /healthz HTTP/1.1") -> bytes:
    return (request_line + "\r\n" + "".join(line + "\r\n" for line in lines) + "\r\n").encode()


def malformed(secret: str) -> dict[str, tuple[bytes, str, str]]:
    """Malformed requests carrying `secret` (an API key or a marker): (bytes, code, message)."""
    auth = f"Authorization: Bearer {secret}"
    chunked = "Transfer-Encoding: chunked"
    return {
        "bare-lf-in-header": (
            f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: 1\n{auth}\r\n\r\n".encode(),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "lf-line-endings": (
            f"GET /healthz HTTP/1.1\nHost: 127.0.0.1\n{auth}\n\n".encode(),
            MALFORMED,
            "the request line is not valid",
        ),
        "nul-in-header": (
            _head("Host: 127.0.0.1", f"{auth}\0x"),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "control-char-in-header": (
            _head("Host: 127.0.0.1", f"{auth}\x01"),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "header-too-long": (
            _head("Host: 127.0.0.1", auth + "a" * 9000),
            HEAD_TOO_LARGE,
            "the request line or a header is longer than 8190 bytes",
        ),
        "header-name-too-long": (
            _head("Host: 127.0.0.1", auth, "X" * 9000 + ": y"),
            HEAD_TOO_LARGE,
            "the request line or a header is longer than 8190 bytes",
        ),
        "request-line-too-long": (
            _head(auth, request_line=f"GET /{secret}{'a' * 9000} HTTP/1.1"),
            HEAD_TOO_LARGE,
            "the request line or a header is longer than 8190 bytes",
        ),
        "too-many-headers": (
            _head(auth, *(f"X-{i}: {secret}" for i in range(100))),
            HEAD_TOO_LARGE,
            "more than 64 headers",
        ),
        "bad-chunk-size": (
            _head("Host: 127.0.0.1", auth, chunked, request_line="POST /v1/models HTTP/1.1")
            + f"{secret}\r\n".encode(),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "invalid-method": (
            _head(auth, request_line="G<T /healthz HTTP/1.1"),
            MALFORMED,
            "the method is not valid",
        ),
        "tls-on-plain-port": (
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + secret.encode(),
            MALFORMED,
            "this is not HTTP (TLS sent to a plain-HTTP port?)",
        ),
        "bad-http-version": (
            _head(auth, request_line="GET /healthz HTTP/9.9"),
            MALFORMED,
            "the request line is not valid",
        ),
        "invalid-target": (
            _head(auth, request_line=f"GET /{secret}\x7f HTTP/1.1"),
            MALFORMED,
            "the request target is not valid",
        ),
        "space-before-colon": (
            _head("Host: 127.0.0.1", f"Authorization : Bearer {secret}"),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "obsolete-line-folding": (
            _head("Host: 127.0.0.1", "X-A: 1", f" {auth}"),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "length-and-chunked": (
            _head(
                "Host: 127.0.0.1", auth, "Content-Length: 3", chunked, request_line="POST /v1/models HTTP/1.1"
            )
            + b"0\r\n\r\n",
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
        "bad-content-length": (
            _head(
                "Host: 127.0.0.1", auth, f"Content-Length: {secret}", request_line="POST /v1/models HTTP/1.1"
            ),
            MALFORMED,
            "a header or the body's framing is not valid",
        ),
    }


CASES = malformed(MARK)


def check_refusal(answer: RawAnswer, code: str, message: str) -> None:
    """A parser refusal: 400, OpenAI's envelope, the daemon's headers, the connection closed."""
    assert answer.status == 400
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json() == {
        "error": {
            "message": f"malformed HTTP request: {message}",
            "type": "invalid_request_error",
            "param": None,
            "code": code,
        }
    }
    for name, value in SECURITY_HEADERS.items():
        assert answer.headers[name.lower()] == value, name
    assert answer.headers["cache-control"] == "no-store"
    assert answer.headers["connection"] == "close"
    assert len(answer.headers["x-request-id"]) == 32
    assert "aiohttp" not in answer.head.decode("latin-1").lower()


@pytest.fixture(scope="module")
def door(models_dir: Path) -> Iterator[RunningDaemon]:
    settings = settings_for(
        [small_tiny(models_dir)],
        server={"header_timeout_s": 2.0, "body_timeout_s": 2.0},
    )
    with running(settings) as daemon:
        yield daemon


@pytest.mark.parametrize("case", list(CASES))
def test_a_parser_refusal_is_an_envelope_that_echoes_nothing(
    door: RunningDaemon,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    data, code, message = CASES[case]
    with caplog.at_level("DEBUG"), connect(door.port) as sock:
        sock.sendall(data)
        answer = read_answer(sock)
        assert closed_within(sock, 2.0) < 1.0
    check_refusal(answer, code, message)
    assert MARK not in answer.head.decode("latin-1") + answer.body.decode()
    assert MARK not in caplog.text
    assert f"request from 127.0.0.1 refused: malformed HTTP request: {message}" in caplog.messages
    assert door.get("/healthz")[0] == 200


def test_a_broken_chunk_mid_body_is_answered_by_the_app_with_an_envelope(door: RunningDaemon) -> None:
    with connect(door.port) as sock:
        sock.sendall(post("/v1/completions", b"", chunked=True) + b'5\r\n{"a":\r\n')
        time.sleep(0.2)  # the handler is reading the body by now
        sock.sendall(f"{MARK}\r\n".encode())
        answer = read_answer(sock)
    assert answer.status == 400
    assert answer.json()["error"] == {
        "message": "malformed HTTP request: the body's framing is not valid",
        "type": "invalid_request_error",
        "param": None,
        "code": MALFORMED,
    }
    assert answer.headers["connection"] == "close"
    assert answer.headers["server"] == "edgellm"
    assert MARK not in answer.body.decode()


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_a_body_whose_encoding_does_not_decode_is_a_400(
    door: RunningDaemon, encoding: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's mistake, answered: no ERROR line (aiohttp meets the body again while it
    drains the request, and logs that as an unhandled exception)."""
    caplog.set_level(logging.INFO)
    garbage = b"this is not gzip at all"
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: "
        + encoding
        + b"\r\nContent-Length: "
        + str(len(garbage)).encode()
        + b"\r\n\r\n"
        + garbage
    )
    answer = exchange(door.port, request)
    assert answer.status == 400, answer
    assert answer.json()["error"]["code"] == MALFORMED
    assert door.get("/healthz")[0] == 200
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_codings_named_as_taken_are_the_ones_this_box_decodes(door: RunningDaemon) -> None:
    """br and zstd were named among the codings taken, and every such body failed as "not
    valid": aiohttp decodes them only with its optional modules installed."""
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    request = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: compress\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    answer = exchange(door.port, request)
    assert answer.status == 415, answer
    taken = answer.json()["error"]["message"].split("must be one of ")[1].split(", ")
    expected = {"deflate", "gzip", "identity"}
    expected |= {"br"} if compression_utils.HAS_BROTLI else set()
    expected |= {"zstd"} if compression_utils.HAS_ZSTD else set()
    assert set(taken) == expected


def test_internals_the_front_door_relies_on_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    check_internals()  # the installed aiohttp has them

    def handle_error(self: web.RequestHandler, request: Any, status: int = 500) -> web.StreamResponse:
        raise NotImplementedError

    monkeypatch.setattr(web.RequestHandler, "handle_error", handle_error)
    with pytest.raises(RuntimeError, match=r"site\.py\) relies on: RequestHandler\.handle_error"):
        check_internals()


def test_internals_check_names_a_missing_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = tuple(s for s in web.RequestHandler.__slots__ if s != "_messages")
    monkeypatch.setattr(web.RequestHandler, "__slots__", slots)
    with pytest.raises(RuntimeError, match="_messages is gone"):
        check_internals()


def test_internals_check_names_a_missing_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = tuple(s for s in web.RequestHandler.__slots__ if s != "_request_handler")
    monkeypatch.setattr(web.RequestHandler, "__slots__", slots)
    with pytest.raises(RuntimeError, match="_request_handler is gone"):
        check_internals()


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        ("/healthz", MARK),
        ("/v1/completions", f"{MARK}-continue"),
        ("/no/such/path", "100-continue-please"),
        ("/v1/models", f"100-continue, {MARK}"),
    ],
)
def test_an_unknown_expectation_is_a_417_envelope_that_echoes_nothing(
    door: RunningDaemon, path: str, expect: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp answered these itself: a text/plain 417 quoting the value, before any middleware."""
    method = "GET" if path != "/v1/completions" else "POST"
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}' if method == "POST" else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: [::1]\r\nExpect: {expect}\r\nContent-Type: application/json\r\n"
    )
    request = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with caplog.at_level("DEBUG"):
        answer = exchange(door.port, request)
    assert answer.status == 417, answer
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json()["error"] == {
        "message": "the request's Expect header names an expectation this server cannot meet",
        "type": "invalid_request_error",
        "param": None,
        "code": "expectation_failed",
    }
    assert answer.headers["x-request-id"]  # through the app's own middlewares: an access line too
    assert answer.headers["server"] == "edgellm"
    assert expect not in answer.head.decode("latin-1") + answer.body.decode()
    assert MARK not in caplog.text
    assert any(f"{method} {path} 417" in m for m in caplog.messages), caplog.messages
    assert door.get("/healthz")[0] == 200


@pytest.mark.parametrize("expect", ["100-continue", "100-Continue", " 100-CONTINUE "])
def test_100_continue_still_gets_its_interim_answer(door: RunningDaemon, expect: str) -> None:
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: {expect}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with connect(door.port) as sock:
        sock.sendall(head.encode())
        interim = read_answer(sock)
        assert interim.status == 100
        sock.sendall(body)
        answer = read_answer(sock)
    assert answer.status == 200, answer
    assert answer.json()["usage"]["completion_tokens"] == 1


# ---- the whole log of a real daemon process, scanned for a real key ----------------------------------


def _send(port: int, data: bytes, *, then: bytes = b"", wait: float = 0.0) -> bytes:
    """Send, optionally more after `wait` seconds, and read everything until the server closes."""
    with connect(port, timeout=10) as sock:
        sock.sendall(data)
        if then:
            time.sleep(wait)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(then)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return out


@pytest.mark.slow
def test_no_key_reaches_the_log_or_an_answer(tmp_path: Path) -> None:
    box = SignedBox(tmp_path / "box")
    box.publish(box.model_bytes(TinyModelSpec(seed=11)))
    token = box.app_token
    secret = token.split("_", 2)[2]
    assert len(secret) == 43
    config = box.config(free_port(), server={"header_timeout_s": 1.0, "body_timeout_s": 1.0})
    config["logging"] = {"level": "debug", "format": "json"}
    with DaemonProcess(box, config) as daemon:
        daemon.start()
        answers: dict[str, bytes] = {}
        for name, (data, _, _) in malformed(token).items():
            answers[name] = _send(daemon.port, data)
        # A broken chunk once the handler reads the body; a body that never completes; a head
        # that never completes; the key in a path, in a request id and in a query string.
        answers["mid-body-chunk"] = _send(
            daemon.port,
            post("/v1/completions", b"", token=token, chunked=True) + b'4\r\n{"a"\r\n',
            then=f"{token}\r\n".encode(),
            wait=0.3,
        )
        answers["body-timeout"] = _send(
            daemon.port, post("/v1/completions", f'{{"prompt": "{token}'.encode(), token=token, length=1000)
        )
        answers["head-timeout"] = _send(daemon.port, f"GET /healthz HTTP/1.1\r\n{token}: ".encode())
        answers["key-in-path"] = exchange(daemon.port, get(f"/v1/{token}?key={token}", token=token)).head
        answers["key-as-request-id"] = exchange(
            daemon.port, get("/healthz", extra=f"X-Request-Id: {token}\r\n")
        ).head
        assert daemon.get("/healthz").status == 200
        daemon.stop()
    log = daemon.log_path.read_text(encoding="utf-8", errors="replace")
    assert secret not in log
    # The key's id stays, for the operator: the access line of the request with the key in its path.
    assert f"GET /v1/elk_{token.split('_')[1]}_[redacted] 404" in log
    records = daemon.records()
    assert records, log[-2000:]
    refusals = [r["msg"] for r in records if r["logger"] == "edgellmd.http.site"]
    for name, (_, _, message) in malformed(token).items():
        assert f"request from 127.0.0.1 refused: malformed HTTP request: {message}" in refusals, name
    assert (
        "request from 127.0.0.1 refused: malformed HTTP request: the body's framing is not valid" in refusals
    )
    assert any("request body not complete within 1.0 s" in m for m in refusals)
    assert any("no complete request head within 1.0 s" in m for m in refusals)
    # (Watchdog may log an error of its own while the daemon stops: not this test's business.)
    assert not [
        r
        for r in records
        if r["level"] in ("error", "critical") and r["logger"].startswith(("aiohttp", "asyncio", "edgellmd"))
    ]
    for name, raw in answers.items():
        if name in ("key-as-request-id", "head-timeout"):
            continue  # the client's own id comes back to it; a cut head gets no answer
        assert secret not in raw.decode("latin-1"), name
        assert raw.split(b" ", 2)[1] in (b"400", b"404", b"408"), (name, raw[:80])
    assert answers["head-timeout"] == b""
    for name, (_, code, message) in malformed(token).items():
        head, _, body = answers[name].partition(b"\r\n\r\n")
        assert json.loads(body)["error"] == {
            "message": f"malformed HTTP request: {message}",
            "type": "invalid_request_error",
            "param": None,
            "code": code,
        }
        assert b"Server: edgellm" in head, name
        assert b"Connection: close" in head, name
