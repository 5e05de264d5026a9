"""A request still in its prompt stage (rendering, tokenizing, waiting for its media or its turn
on the prompt pool) is a running request too: the drain waits for it, ends it past its deadline
with a 503 `server_shutting_down` in its own family's shape, and a key revoked meanwhile ends
it with a 401 at once.

Before, only running generations counted: the drain returned at once with such a request still
preparing, and the server's cleanup then cancelled its handler, so its client lost the
connection with no answer at all.

The prompt stage is held here as a busy box holds it: both prompt-pool threads taken by other
work, so that the request's tokenizing waits its turn.
"""

from __future__ import annotations

import asyncio
import contextvars
import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.__main__ import drain
from edgellmd.api.pool import POOL_TENANT, FairPool
from edgellmd.api.session import Preparing
from edgellmd.http import appkeys
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for, wait_for

# A daemon and its engine process: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

COMPLETION = {"model": "m", "prompt": "hello there", "max_tokens": 4}
MESSAGE = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


class Box:
    def __init__(
        self, daemon: RunningDaemon, keys: Path, tokens: dict[str, str], ids: dict[str, str]
    ) -> None:
        self.daemon, self.keys, self.tokens, self.ids = daemon, keys, tokens, ids

    def post(self, path: str, body: Any, key: str = "user") -> tuple[int, Any]:
        return self.daemon.post(path, body, headers={"Authorization": f"Bearer {self.tokens[key]}"})


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    path = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=5))
    keys = tmp_path / "keys.yaml"
    tokens, ids = {}, {}
    for name in ("user", "revoked"):
        ids[name], tokens[name] = create_key(keys, name, ["inference"], limits={})
    settings = settings_for(
        [{"name": "m", "file": str(path), "slots": 2, "context_size": 512, "threads": 1}],
        auth={"keys_file": str(keys)},
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    with running(settings) as daemon:
        yield Box(daemon, keys, tokens, ids)


def _prompt_pool(daemon: RunningDaemon) -> FairPool:
    """The model's own prompt pool, where its requests' tokenizing waits."""
    assert daemon.app is not None
    pool = daemon.app[appkeys.REGISTRY].get("m").executor
    assert isinstance(pool, FairPool)
    return pool


class HeldPool:
    """Both of the model's prompt-pool threads busy with other tenants' work until `release`."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.gate = threading.Event()
        pool = _prompt_pool(daemon)
        self.jobs: list[Future[bool]] = []
        for i in range(pool.workers):  # a tenant takes one thread at most: one tenant each
            context = contextvars.copy_context()
            context.run(POOL_TENANT.set, f"other-{i}")
            self.jobs.append(context.run(pool.submit, self.gate.wait, 60))

    def release(self) -> None:
        self.gate.set()
        for job in self.jobs:
            job.result(10)


def _in_background(box: Box, path: str, body: Any, key: str = "user") -> list[tuple[int, Any, float]]:
    answers: list[tuple[int, Any, float]] = []

    def ask() -> None:
        status, answer = box.post(path, body, key)
        answers.append((status, answer, time.monotonic()))

    threading.Thread(target=ask, daemon=True).start()
    return answers


def _waiting(box: Box, key: str = "user") -> bool:
    """The key's request waits for a prompt-pool thread (its tokenizing)."""
    return _prompt_pool(box.daemon).waiting().get(box.ids[key], 0) == 1


def _running(daemon: RunningDaemon) -> list[object]:
    assert daemon.app is not None
    return list(daemon.app[appkeys.GENERATIONS]._items)


def _drain(daemon: RunningDaemon, deadline_s: float) -> float:
    """Run the daemon's drain; returns how long it took."""
    assert daemon.app is not None
    assert daemon._runner is not None
    started = time.monotonic()
    asyncio.run_coroutine_threadsafe(drain(daemon.app, daemon._runner, deadline_s), daemon.loop).result(60)
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", COMPLETION),
        ("/v1/completions", {**COMPLETION, "stream": True}),  # its stream not begun: a plain 503
        ("/v1/messages", MESSAGE),
    ],
    ids=["completion", "stream", "messages"],
)
def test_the_drain_ends_a_request_still_preparing_past_its_deadline_with_a_503(
    box: Box, path: str, body: dict[str, Any]
) -> None:
    held = HeldPool(box.daemon)
    try:
        answers = _in_background(box, path, body)
        wait_for(lambda: _waiting(box), what="the request in its prompt stage")
        assert [type(item) for item in _running(box.daemon)] == [Preparing]
        took = _drain(box.daemon, 0.5)
        assert 0.4 < took < 5  # it waited for the request, then ended it
        wait_for(lambda: bool(answers), what="the request's answer", timeout=5)
    finally:
        held.release()
    status, answer, _ = answers[0]
    assert status == 503, answer
    if path == "/v1/messages":  # Anthropic's own error shape
        assert answer["type"] == "error", answer
        assert answer["error"]["type"] == "overloaded_error", answer
        assert "shutting down" in answer["error"]["message"]
    else:
        assert answer["error"]["code"] == "server_shutting_down", answer
    assert _running(box.daemon) == []


def test_the_drain_waits_for_a_request_still_preparing_and_it_is_answered(box: Box) -> None:
    held = HeldPool(box.daemon)
    try:
        answers = _in_background(box, "/v1/completions", COMPLETION)
        wait_for(lambda: _waiting(box), what="the request in its prompt stage")
        releaser = threading.Timer(1.0, held.release)
        releaser.start()
        took = _drain(box.daemon, 30)
        drained = time.monotonic()
    finally:
        held.release()
    assert 0.9 < took < 20  # it waited for the request: not at once, and not to its deadline
    wait_for(lambda: bool(answers), what="the request's answer", timeout=5)
    status, answer, answered = answers[0]
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] > 0
    assert answered <= drained + 0.5  # answered before (or as) the drain ended


def test_a_key_revoked_while_its_request_is_preparing_ends_it_with_a_401_at_once(box: Box) -> None:
    held = HeldPool(box.daemon)
    try:
        answers = _in_background(box, "/v1/completions", COMPLETION, key="revoked")
        wait_for(lambda: _waiting(box, "revoked"), what="the request in its prompt stage")
        started = time.monotonic()
        assert edgellmctl(["keys", "revoke", box.ids["revoked"], "--file", str(box.keys)]) == 0
        wait_for(lambda: bool(answers), what="the request's answer", timeout=10)
        ended = answers[0][2] - started
        assert ended < 5  # within the keys file's check, while the pool was still held
        assert not held.gate.is_set()
    finally:
        held.release()
    status, answer, _ = answers[0]
    assert status == 401, answer
    assert answer["error"]["code"] == "invalid_api_key"
    # The daemon serves on: another key's request, once the pool is free.
    status, answer = box.post("/v1/completions", COMPLETION)
    assert status == 200, answer


def test_a_request_on_a_connection_kept_alive_into_the_stop_is_refused_and_the_connection_closed(
    box: Box,
) -> None:
    """A client that keeps its connection (every SDK's pool does) could send requests after the
    stop began, and retry its 503 on the same connection: nothing ended those, and the server's
    own wait for them doubled the stop. Once draining, an API request is refused at once, and
    every answer closes its connection."""
    headers = {"Authorization": f"Bearer {box.tokens['user']}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", box.daemon.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION), headers=headers)
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        assert first.getheader("Connection") != "close"  # kept alive, as a pooled client's is
        assert _drain(box.daemon, 30) < 5  # nothing running: the drain is done at once
        started = time.monotonic()
        conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION), headers=headers)
        second = conn.getresponse()
        answer = json.loads(second.read())
        assert time.monotonic() - started < 2
        assert second.status == 503, answer
        assert answer["error"]["code"] == "server_shutting_down"
        assert second.getheader("Connection") == "close"
        # Closed: the client opens a new connection for its next request, which the stopping
        # server no longer accepts.
        with pytest.raises(ConnectionRefusedError):
            conn.request("GET", "/healthz")
    finally:
        conn.close()
    assert _running(box.daemon) == []
