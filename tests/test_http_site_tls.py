"""The front door over TLS: the handshake is a stage with a deadline too, and refusals look the same."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgellmctl.quickstart import write_self_signed
from edgellmd.settings import parse_settings
from tests.rawhttp import closed_within
from tests.serving import RunningDaemon, small_tiny, wait_for

HEADER_S = 1.0
SLACK_S = 1.0


@pytest.fixture(scope="module")
def tls_door(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, ssl.SSLContext]]:
    root = tmp_path_factory.mktemp("tls-door")
    cert, key = write_self_signed(root / "tls", "127.0.0.1")
    settings = parse_settings(
        {
            "server": {"tls_cert": str(cert), "tls_key": str(key), "header_timeout_s": HEADER_S},
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
        },
        base_dir=root,
    )
    daemon = RunningDaemon(settings).start(wait_ready=False)
    context = ssl.create_default_context(cafile=str(cert))
    try:
        wait_for(lambda: _listening(daemon.port), timeout=30, what="the TLS listener")
        yield daemon.port, context
    finally:
        daemon.stop()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _tls(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    return context.wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1"
    )


def test_a_handshake_that_never_comes_is_cut(tls_door: tuple[int, ssl.SSLContext]) -> None:
    port, _ = tls_door
    with socket.create_connection(("127.0.0.1", port)) as raw:  # TCP only, never a ClientHello
        took = closed_within(raw, HEADER_S + 5)
    assert HEADER_S - 0.1 <= took <= HEADER_S + SLACK_S


def test_a_slow_head_after_the_handshake_is_cut(tls_door: tuple[int, ssl.SSLContext]) -> None:
    port, context = tls_door
    with _tls(port, context) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(HEADER_S + 5)
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            assert sock.recv(4096) == b""
        took = time.monotonic() - started
    assert took <= HEADER_S + SLACK_S


def test_a_parser_refusal_over_tls_is_an_envelope(tls_door: tuple[int, ssl.SSLContext]) -> None:
    port, context = tls_door
    with _tls(port, context) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: \x00secret\r\n\r\n")
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, ssl.SSLError):
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400 ")
    assert b"Server: edgellm" in head
    assert json.loads(body)["error"]["code"] == "malformed_request"
    assert b"secret" not in data
