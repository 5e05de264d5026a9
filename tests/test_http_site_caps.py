"""The front door's connection caps: in all, and per client address, so one client cannot starve another."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgellmctl.keys import create_key
from edgellmd.http.site import REFUSAL_LOG_INTERVAL_S, Door, DoorLimits, client_address
from tests.rawhttp import connect, get, post, read_answer
from tests.serving import RunningDaemon, running, settings_for, small_tiny, wait_for

PER_CLIENT = 4
TOTAL = 12
ABUSER = "127.0.0.1"
OTHER = "127.0.0.2"  # all of 127.0.0.0/8 is loopback on Linux


@dataclass(frozen=True, slots=True)
class CappedDaemon:
    daemon: RunningDaemon
    token: str


@pytest.fixture(scope="module")
def capped(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CappedDaemon]:
    keys = tmp_path_factory.mktemp("cap-keys") / "keys.yaml"
    _, token = create_key(keys, "app", ["inference"], limits={})
    # Deadlines far away: the held connections stay held for the whole test.
    settings = settings_for(
        [small_tiny(models_dir)],
        server={
            "max_connections": TOTAL,
            "max_connections_per_client": PER_CLIENT,
            "header_timeout_s": 60,
            "body_timeout_s": 60,
        },
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        yield CappedDaemon(daemon, token)


def _refused_at_accept(port: int, source: str) -> bool:
    """True when a new connection from `source` is closed without an answer to its request."""
    with connect(port, source=source, timeout=3) as sock:
        try:
            sock.sendall(get("/healthz"))
            return sock.recv(4096) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True


def test_one_client_holding_its_cap_does_not_starve_another(capped: CappedDaemon) -> None:
    port = capped.daemon.port
    held: list[socket.socket] = []
    try:
        for i in range(PER_CLIENT):  # slow-loris heads and never-ending bodies, from one address
            sock = connect(port, source=ABUSER)
            if i % 2:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            else:
                sock.sendall(post("/v1/completions", b"{", token=capped.token, length=1000))
            held.append(sock)
        time.sleep(0.2)
        assert _refused_at_accept(port, ABUSER)
        # Another address is served: the public probe and an authenticated request.
        with connect(port, source=OTHER) as sock:
            sock.sendall(get("/healthz"))
            assert read_answer(sock).status == 200
            sock.sendall(get("/v1/models", token=capped.token))
            answer = read_answer(sock)
            assert answer.status == 200, answer.body
            assert [m["id"] for m in answer.json()["data"]] == ["tiny"]
        assert all(sock.fileno() >= 0 for sock in held)  # the abuser's connections are still open
    finally:
        for sock in held:
            sock.close()
    # Its connections gone, the first client is served again.
    wait_for(lambda: not _refused_at_accept(port, ABUSER), timeout=5, what="the cap to free up")


def test_the_global_cap_still_holds_across_clients(capped: CappedDaemon) -> None:
    port = capped.daemon.port
    sources = [f"127.0.0.{i}" for i in range(10, 10 + TOTAL // PER_CLIENT)]
    held = [connect(port, source=source) for source in sources for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)
        assert _refused_at_accept(port, "127.0.0.99")  # under its own cap, over the global one
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: capped.daemon.get("/healthz")[0] == 200, timeout=5, what="capacity back")


def test_refusals_are_logged_without_flooding(capped: CappedDaemon, caplog: pytest.LogCaptureFixture) -> None:
    port = capped.daemon.port
    held = [connect(port, source="127.0.0.50") for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)
        with caplog.at_level("WARNING", logger="edgellmd.http.site"):
            for _ in range(5):
                assert _refused_at_accept(port, "127.0.0.50")
    finally:
        for sock in held:
            sock.close()
    lines = [r.getMessage() for r in caplog.records if "max_connections_per_client" in r.getMessage()]
    assert len(lines) <= 1  # one line per interval (this test's may fall in an earlier one's)


@pytest.mark.parametrize(
    ("peer", "counted_as"),
    [
        (("127.0.0.1", 5000), "127.0.0.1"),
        (("::ffff:127.0.0.1", 5000, 0, 0), "127.0.0.1"),  # IPv4-mapped: the IPv4 address
        (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),
        (("2001:db8:1:2:aaaa::1", 5000, 0, 0), "2001:db8:1:2::/64"),  # IPv6: its /64
        (("2001:db8:1:2:bbbb::9", 5000, 0, 0), "2001:db8:1:2::/64"),
        (("::1", 5000, 0, 0), "::1"),
        (None, "?"),
        ("", "?"),
    ],
)
def test_client_address(peer: object, counted_as: str) -> None:
    assert client_address(peer) == counted_as


def test_door_counts_mapped_and_plain_ipv4_as_one_client() -> None:
    door = Door(
        DoorLimits(header_timeout_s=1, body_timeout_s=1, max_connections=10, max_connections_per_client=2)
    )
    assert door.admit(client_address(("10.0.0.1", 1)))
    assert door.admit(client_address(("::ffff:10.0.0.1", 2, 0, 0)))
    assert not door.admit(client_address(("10.0.0.1", 3)))
    assert door.admit(client_address(("10.0.0.2", 4)))
    door.release("10.0.0.1")
    assert door.admit(client_address(("::ffff:10.0.0.1", 5, 0, 0)))
    assert door.open == 3
    assert door.by_client == {"10.0.0.1": 2, "10.0.0.2": 1}


def test_door_logs_one_line_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    door = Door(
        DoorLimits(header_timeout_s=1, body_timeout_s=1, max_connections=10, max_connections_per_client=1),
        clock=lambda: now[0],
    )
    assert door.admit("10.0.0.1")
    with caplog.at_level("WARNING", logger="edgellmd.http.site"):
        for _ in range(5):
            assert not door.admit("10.0.0.1")
            now[0] += 1
        now[0] += REFUSAL_LOG_INTERVAL_S
        assert not door.admit("10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "connection from 10.0.0.1 refused: 1 connections open from that client "
        "(server.max_connections_per_client)",
        "connection from 10.0.0.1 refused: 1 connections open from that client "
        "(server.max_connections_per_client); 4 more refused since the last such line",
    ]
