"""The listening socket's guards: slow request heads are cut, and connections are capped."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.rawhttp import closed_within
from tests.serving import RunningDaemon, running, settings_for, small_tiny

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded_socket(models_dir: Path) -> Iterator[RunningDaemon]:
    settings = settings_for(
        [small_tiny(models_dir)],
        server={"header_timeout_s": 1.0, "max_connections": 4},
    )
    with running(settings) as daemon:
        yield daemon


def test_slow_loris_is_cut_at_the_header_deadline(guarded_socket: RunningDaemon) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", guarded_socket.port)) as sock:
        took = closed_within(sock, 5.0, drip=head)  # one byte every 0.2 s: 45 s for the head
    assert 0.9 <= took <= 2.5


def test_a_silent_connection_is_cut_too(guarded_socket: RunningDaemon) -> None:
    with socket.create_connection(("127.0.0.1", guarded_socket.port)) as sock:
        assert 0.9 <= closed_within(sock, 5.0) <= 2.5


def test_a_prompt_client_is_not_affected(guarded_socket: RunningDaemon) -> None:
    with socket.create_connection(("127.0.0.1", guarded_socket.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        time.sleep(1.5)  # past the header deadline: the head was complete in time
        assert b"200 OK" in sock.recv(4096)
        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # keep-alive still works
        assert b"200 OK" in sock.recv(4096)


def test_connections_beyond_the_cap_are_closed_and_others_served(guarded_socket: RunningDaemon) -> None:
    held = [socket.create_connection(("127.0.0.1", guarded_socket.port)) for _ in range(4)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", guarded_socket.port)) as extra:
            extra.settimeout(2)
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            try:
                answer = extra.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed without an answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert guarded_socket.get("/healthz")[0] == 200  # capacity is back once they close


@pytest.mark.parametrize(
    "head",
    [
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + b"".join(b"X-%d: y\r\n" % i for i in range(100))
        + b"\r\n",
    ],
    ids=["huge-header", "huge-request-line", "too-many-headers"],
)
def test_oversized_heads_are_refused(guarded_socket: RunningDaemon, head: bytes) -> None:
    with socket.create_connection(("127.0.0.1", guarded_socket.port), timeout=5) as sock:
        sock.sendall(head)
        answer = sock.recv(4096)
    assert answer.split(b" ", 2)[1] in (b"400", b"414", b"431")
    assert guarded_socket.get("/healthz")[0] == 200
