"""A client that disconnects mid-stream frees its slot at once (real sockets, real engine)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from edgellmd.http import appkeys
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for, wait_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slow_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One slot on a model slow enough (a few hundred tokens/s) that 4000 tokens take seconds."""
    path = write_tiny_model(
        tmp_path_factory.mktemp("slow") / "slow.gguf",
        TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048),
    )
    settings = settings_for(
        [{"name": "slow", "file": str(path), "slots": 1, "context_size": 4096, "threads": 1}],
        server={"max_tokens_limit": 4000},
    )
    with running(settings) as daemon:
        yield daemon


def _engine_busy(daemon: RunningDaemon) -> int:
    assert daemon.app is not None
    return daemon.app[appkeys.REGISTRY].get("slow").engine.busy_slots


def _seconds_to_free_after_closing(daemon: RunningDaemon, sock: socket.socket) -> float:
    """Close the client's socket and time how long the slot stays busy (5 s at most)."""
    sock.close()
    closed_at = time.monotonic()
    while _engine_busy(daemon) and time.monotonic() - closed_at < 5:
        time.sleep(0.005)
    assert _engine_busy(daemon) == 0
    return time.monotonic() - closed_at


def _open_stream(daemon: RunningDaemon, body: dict[str, object]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n" + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


def test_disconnect_mid_stream_frees_the_slot(slow_daemon: RunningDaemon) -> None:
    sock = _open_stream(
        slow_daemon,
        {
            "model": "slow",
            "prompt": "go",
            "max_tokens": 4000,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        },
    )
    received = b""
    while received.count(b"data: ") < 3:  # the stream is running
        received += sock.recv(65536)
    assert b"200 OK" in received
    assert _engine_busy(slow_daemon) == 1
    assert _seconds_to_free_after_closing(slow_daemon, sock) < 1.0
    # The next request starts at once rather than after the abandoned 4000 tokens.
    started = time.monotonic()
    status, body = slow_daemon.post(
        "/v1/completions", {"model": "slow", "prompt": "next", "max_tokens": 5, "ignore_eos": True}
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 5
    assert time.monotonic() - started < 1.0


def test_disconnect_of_a_non_streamed_request_frees_the_slot(slow_daemon: RunningDaemon) -> None:
    sock = _open_stream(
        slow_daemon, {"model": "slow", "prompt": "go", "max_tokens": 4000, "ignore_eos": True}
    )
    deadline = time.monotonic() + 5
    while not _engine_busy(slow_daemon) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _engine_busy(slow_daemon) == 1
    assert _seconds_to_free_after_closing(slow_daemon, sock) < 1.0


def test_a_client_that_stops_reading_is_cut_and_its_slot_freed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = write_tiny_model(
        tmp_path_factory.mktemp("stall") / "slow.gguf",
        TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048),
    )
    settings = settings_for(
        [{"name": "slow", "file": str(path), "slots": 1, "context_size": 4096, "threads": 1}],
        server={"max_tokens_limit": 4000, "stream_write_timeout_s": 1.0},
    )
    with running(settings) as daemon:
        assert daemon.app is not None
        engine = daemon.app[appkeys.REGISTRY].get("slow").generator
        warm_up = dict(engine.finished)  # the load's own short generation
        daemon.shrink_send_buffers(4096)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
        sock.connect(("127.0.0.1", daemon.port))
        payload = json.dumps(
            {"model": "slow", "prompt": "go", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert b"200 OK" in sock.recv(64)  # and then never read again
        deadline = time.monotonic() + 5
        while not engine.busy_slots and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.busy_slots == 1
        started = time.monotonic()
        while engine.busy_slots and time.monotonic() - started < 30:
            time.sleep(0.05)
        assert engine.busy_slots == 0
        # Cut long before the 4000 tokens were done: the generation was cancelled, not finished.
        assert engine.finished["cancelled"] == 1, dict(engine.finished)
        assert engine.finished["length"] == warm_up.get("length", 0)
        assert engine.tokens_generated < 4000
        sock.close()


def test_a_short_stream_whose_client_never_reads_is_cut_at_its_end(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A stream shorter than aiohttp's 64 KiB write buffer never waits for its client until the
    end: the last write waited for a client that never reads, without a deadline, holding the
    connection and its handler (a running request: the drain waited for it) until the client
    closed. It is cut after stream_write_timeout_s, as a long stream is."""
    path = write_tiny_model(tmp_path_factory.mktemp("short") / "m.gguf", TinyModelSpec(seed=9))
    settings = settings_for(
        [{"name": "m", "file": str(path), "slots": 1, "context_size": 512, "threads": 1}],
        server={"stream_write_timeout_s": 1.0},
    )
    with running(settings) as daemon:
        assert daemon.app is not None
        running_requests = daemon.app[appkeys.GENERATIONS]
        daemon.shrink_send_buffers(4096)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.connect(("127.0.0.1", daemon.port))
        payload = json.dumps(
            {"model": "m", "prompt": "go", "max_tokens": 450, "stream": True, "ignore_eos": True}
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(lambda: len(running_requests) == 1, what="the stream running")
        started = time.monotonic()
        wait_for(lambda: len(running_requests) == 0, what="the stream cut", timeout=10)
        assert time.monotonic() - started < 5
        sock.close()


def test_a_request_that_makes_no_progress_is_ended(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write_tiny_model(
        tmp_path_factory.mktemp("progress") / "slow.gguf",
        TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048),
    )
    settings = settings_for(
        [{"name": "slow", "file": str(path), "slots": 1, "context_size": 4096, "threads": 1}],
        server={"max_tokens_limit": 4000, "progress_timeout_s": 1.0},
    )
    with running(settings) as daemon:
        assert daemon.app is not None
        engine = daemon.app[appkeys.REGISTRY].get("slow").generator
        blocker = _open_stream(
            daemon, {"model": "slow", "prompt": "hog", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        )
        deadline = time.monotonic() + 5
        while not engine.busy_slots and time.monotonic() < deadline:
            time.sleep(0.01)
        # Queued behind 4000 tokens, this one gets no token for longer than the deadline.
        started = time.monotonic()
        status, body = daemon.post("/v1/completions", {"model": "slow", "prompt": "wait", "max_tokens": 5})
        assert status == 504
        assert (body["error"]["type"], body["error"]["code"]) == ("server_error", "timeout")
        assert 0.9 <= time.monotonic() - started < 3.0
        deadline = time.monotonic() + 1
        while engine.queue_depth and time.monotonic() < deadline:  # it leaves at the next step
            time.sleep(0.01)
        assert engine.queue_depth == 0
        # Streamed, the same: the deadline held only after the headers' 10 s wait, so a stream
        # queued past it was a 200 and a late reply.
        started = time.monotonic()
        status, body = daemon.post(
            "/v1/completions", {"model": "slow", "prompt": "wait", "max_tokens": 5, "stream": True}
        )
        assert status == 504, body
        assert body["error"]["code"] == "timeout"
        assert 0.9 <= time.monotonic() - started < 3.0
        blocker.close()
