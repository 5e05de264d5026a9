"""An operator's action runs to its end even when the client that asked goes away at once."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import RunningDaemon, running, settings_for


@pytest.fixture
def daemon(models_dir: Path) -> Iterator[RunningDaemon]:
    model = {
        "name": "tiny",
        "file": str(models_dir / "tiny.gguf"),
        "slots": 1,
        "context_size": 256,
        "threads": 1,
    }
    with running(settings_for([model], lifecycle={"watch": False})) as d:
        yield d


def state(daemon: RunningDaemon) -> tuple[str, str | None]:
    status, body = daemon.get("/admin/status")
    assert status == 200
    (tiny,) = [m for m in body["models"] if m["name"] == "tiny"]
    return tiny["state"], tiny.get("reason")


def hang_up_after_sending(daemon: RunningDaemon, path: str) -> None:
    """POST `path` and close the connection before any answer (a tab reloaded at once)."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_RDWR)


def test_a_load_whose_client_hangs_up_still_loads(daemon: RunningDaemon) -> None:
    assert daemon.post("/admin/models/tiny/unload", None, raw=b"")[0] == 200
    assert state(daemon)[0] == "unloaded"
    hang_up_after_sending(daemon, "/admin/models/tiny/load")
    deadline = time.monotonic() + 30
    while state(daemon)[0] != "ready":
        assert time.monotonic() < deadline, f"the model stayed {state(daemon)}"
        time.sleep(0.02)
    # And it serves.
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert daemon.post("/v1/completions", body)[0] == 200
    # Loading what is loaded, then an unknown model: answered as before.
    assert daemon.post("/admin/models/tiny/load", None, raw=b"")[0] == 200
    assert daemon.post("/admin/models/nope/load", None, raw=b"")[0] == 404
