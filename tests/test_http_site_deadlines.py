"""The front door's deadlines: each request head, each body, idle keep-alive; answers in progress spared."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from edgellmd.http.app import create_app, start_server
from edgellmd.settings import Settings
from tests.rawhttp import RawAnswer, closed_within, connect, get, post, read_answer
from tests.serving import RunningDaemon, running, settings_for, small_tiny

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

HEADER_S = 1.0
BODY_S = 1.0
KEEPALIVE_S = 2.0
SLACK_S = 1.0  # timers, a busy 2-core box
COMPLETION = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
SLOW_HEAD = get("/healthz", extra="X-Slow: " + "a" * 200 + "\r\n")


def _settings(models_dir: Path) -> Settings:
    return settings_for(
        [small_tiny(models_dir)],
        server={"header_timeout_s": HEADER_S, "body_timeout_s": BODY_S, "keepalive_timeout_s": KEEPALIVE_S},
    )


@pytest.fixture(scope="module")
def door(models_dir: Path) -> Iterator[RunningDaemon]:
    with running(_settings(models_dir)) as daemon:
        yield daemon


def _check_timeout_answer(answer: RawAnswer) -> None:
    assert answer.status == 408
    assert answer.json()["error"]["code"] == "request_timeout"
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert answer.headers["connection"] == "close"
    assert answer.headers["server"] == "edgellm"


def test_a_second_head_dripped_on_a_kept_alive_connection_is_cut(door: RunningDaemon) -> None:
    with connect(door.port) as sock:
        sock.sendall(get("/healthz"))
        assert read_answer(sock).status == 200
        took = closed_within(sock, HEADER_S + 5, drip=SLOW_HEAD)  # 45 s to send it all
    assert HEADER_S - 0.1 <= took <= HEADER_S + SLACK_S


def test_a_second_head_started_late_gets_the_whole_deadline(door: RunningDaemon) -> None:
    # Idle for most of the keep-alive timeout, then a head: its own deadline, from its first byte.
    with connect(door.port) as sock:
        sock.sendall(get("/healthz"))
        assert read_answer(sock).status == 200
        time.sleep(KEEPALIVE_S * 0.75)
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        time.sleep(HEADER_S * 0.7)  # past the keep-alive timeout, within the head's deadline
        sock.sendall(b"Host: 127.0.0.1\r\n\r\n")
        assert read_answer(sock).status == 200


def test_a_body_shorter_than_its_content_length_is_cut(door: RunningDaemon) -> None:
    with connect(door.port) as sock:
        started = time.monotonic()
        sock.sendall(post("/v1/completions", b"0123456789", length=1000))
        answer = read_answer(sock, timeout=BODY_S + 5)
        answered = time.monotonic() - started
        closed = closed_within(sock, 5.0)
    assert BODY_S - 0.1 <= answered <= BODY_S + SLACK_S
    _check_timeout_answer(answer)
    assert closed <= SLACK_S


def test_a_chunked_body_that_never_ends_is_cut(door: RunningDaemon) -> None:
    with connect(door.port) as sock:
        started = time.monotonic()
        sock.sendall(post("/v1/completions", b"", chunked=True) + b'5\r\n{"a":\r\n')
        # More chunks keep coming, slowly: the deadline is for the whole body, not for silence.
        sock.settimeout(0.3)
        data = b""
        while b"\r\n\r\n" not in data and time.monotonic() - started < BODY_S + 5:
            try:
                data += sock.recv(65536)
            except TimeoutError:
                sock.sendall(b"1\r\n \r\n")
        answered = time.monotonic() - started
    assert BODY_S - 0.1 <= answered <= BODY_S + SLACK_S
    assert data.startswith(b"HTTP/1.1 408 ")


def test_an_unread_body_still_has_its_deadline(door: RunningDaemon) -> None:
    # /healthz never reads a body: the answer comes at once, the connection goes at the deadline.
    with connect(door.port) as sock:
        sock.sendall(get("/healthz", extra="Content-Length: 1000\r\n") + b"0123456789")
        assert read_answer(sock).status == 200
        took = closed_within(sock, BODY_S + 5)
    assert took <= BODY_S + SLACK_S


def test_an_idle_kept_alive_connection_is_closed(door: RunningDaemon) -> None:
    with connect(door.port) as sock:
        sock.sendall(get("/healthz"))
        assert read_answer(sock).status == 200
        took = closed_within(sock, KEEPALIVE_S + 5)
    assert KEEPALIVE_S - 0.1 <= took <= KEEPALIVE_S + SLACK_S


@pytest.mark.parametrize("chunked", [False, True])
def test_a_connection_idle_after_a_body_sent_with_its_head_gets_the_keep_alive_time(
    door: RunningDaemon, chunked: bool
) -> None:
    """A small POST in one write (what SDK clients send): its Content-Length body ends where
    no blank line is, and the connection idle after its answer is no head being dripped."""
    if chunked:
        request = post("/v1/completions", b"", chunked=True) + b"%x\r\n%s\r\n0\r\n\r\n" % (
            len(COMPLETION),
            COMPLETION,
        )
    else:
        request = post("/v1/completions", COMPLETION)
    with connect(door.port) as sock:
        sock.sendall(request)
        assert read_answer(sock, timeout=30).status == 200
        took = closed_within(sock, KEEPALIVE_S + 5)
    assert KEEPALIVE_S - 0.1 <= took <= KEEPALIVE_S + SLACK_S


def test_a_silent_new_connection_gets_the_header_deadline(door: RunningDaemon) -> None:
    with connect(door.port) as sock:
        took = closed_within(sock, HEADER_S + 5)
    assert HEADER_S - 0.1 <= took <= HEADER_S + SLACK_S


def test_a_keep_alive_client_making_many_requests_is_never_cut(door: RunningDaemon) -> None:
    # Requests with and without bodies, heads and bodies split across reads, pauses between
    # them: together far longer than every deadline.
    started = time.monotonic()
    with connect(door.port) as sock:
        for i in range(24):
            if i % 3 == 0:
                request = post("/v1/completions", COMPLETION)
                sock.sendall(request[:20])
                time.sleep(0.05)
                sock.sendall(request[20:-5])
                time.sleep(0.05)
                sock.sendall(request[-5:])
                answer = read_answer(sock, timeout=30)
                assert answer.status == 200, answer.body
            elif i % 3 == 1:
                sock.sendall(
                    post("/v1/completions", b"", chunked=True)
                    + b"%x\r\n" % len(COMPLETION)
                    + COMPLETION
                    + b"\r\n"
                )
                time.sleep(0.1)
                sock.sendall(b"0\r\n\r\n")
                answer = read_answer(sock, timeout=30)
                assert answer.status == 200, answer.body
            else:
                sock.sendall(get("/healthz"))
                assert read_answer(sock).status == 200
            time.sleep(0.25)
        sock.sendall(get("/readyz"))  # the same socket all along: it was never closed
        assert read_answer(sock).status == 200
    assert time.monotonic() - started > HEADER_S + BODY_S + KEEPALIVE_S


def test_pipelined_requests_are_answered_and_a_partial_head_behind_them_timed(
    door: RunningDaemon,
) -> None:
    with connect(door.port) as sock:
        sock.sendall(get("/healthz") + get("/readyz") + b"GET /hea")
        assert read_answer(sock).status == 200
        assert read_answer(sock).status == 200
        took = closed_within(sock, HEADER_S + 5)
    assert took <= HEADER_S + SLACK_S


async def test_an_answer_in_progress_is_not_cut_by_a_deadline(models_dir: Path) -> None:
    """A slow streamed answer outlives every deadline; a head sent behind it is timed from its end."""
    stream_s = HEADER_S + BODY_S + 0.5

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        end = time.monotonic() + stream_s
        while time.monotonic() < end:
            await response.write(b"tick\n")
            await asyncio.sleep(0.2)
        await response.write_eof()
        return response

    app = create_app(_settings(models_dir))
    app.router.add_get("/test/slow", slow)
    runner = await start_server(app, "127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(get("/test/slow") + b"GET /healthz HTTP/1.1\r\n")  # a next head, begun
        await writer.drain()
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the chunked answer's end
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk, f"closed during the answer, after {time.monotonic() - started:.1f} s"
            data += chunk
        ended = time.monotonic()
        assert ended - started >= stream_s
        assert data.count(b"tick") >= 5
        rest = await asyncio.wait_for(reader.read(65536), HEADER_S + 5)
        assert rest == b""  # the begun head was cut, a header deadline after the answer ended
        assert time.monotonic() - ended <= HEADER_S + SLACK_S
        writer.close()
    finally:
        await runner.cleanup()
