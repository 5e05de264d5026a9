"""Embedding and rerank calls are running requests as generations are: a key revoked meanwhile
ends its call with a 401, the drain waits for them and ends them past its deadline with a 503,
and a call refused before it started (429: the model saturated) is charged nothing.

Before, none of this held: the calls were not among the running requests, so a revoked key's
calls ran to the end and answered 200, the drain never waited for one (its client got no
answer at all when the daemon stopped), and a 429 was charged every token of its inputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.__main__ import drain
from edgellmd.api.session import PooledCall
from edgellmd.http import appkeys
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for, wait_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

# Slow enough that a call of a few dozen long inputs takes seconds on one thread.
SLOW = TinyModelSpec(seed=43, n_embd=256, n_head=4, n_head_kv=2, n_layer=4, n_ff=1024)
INPUTS = [[(i * 7 + j) % 200 + 1 for j in range(420)] for i in range(64)]  # token ids: no tokenizing


class Box:
    def __init__(
        self, daemon: RunningDaemon, keys: Path, tokens: dict[str, str], ids: dict[str, str]
    ) -> None:
        self.daemon, self.keys, self.tokens, self.ids = daemon, keys, tokens, ids

    def post(self, path: str, body: Any, key: str) -> tuple[int, Any]:
        return self.daemon.post(path, body, headers={"Authorization": f"Bearer {self.tokens[key]}"})

    def usage(self, key: str) -> dict[str, int]:
        request = urllib.request.Request(  # noqa: S310 - loopback
            f"{self.daemon.url}/admin/usage?group=month&key={self.ids[key]}",
            headers={"Authorization": f"Bearer {self.tokens['admin']}"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
            return dict(json.loads(answer.read())["totals"])


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    path = write_tiny_model(tmp_path / "embed.gguf", dataclasses.replace(SLOW))
    keys = tmp_path / "keys.yaml"
    tokens, ids = {}, {}
    for name, scopes in (("admin", ["admin"]), ("flood", ["inference"]), ("revoked", ["inference"])):
        ids[name], tokens[name] = create_key(keys, name, scopes, limits={})
    model = {"name": "embed", "file": str(path), "embedding": True, "slots": 1, "context_size": 512}
    settings = settings_for(
        [{**model, "threads": 1, "queue_size": 0}],
        auth={"keys_file": str(keys)},
        ledger={"database": str(tmp_path / "ledger.sqlite3")},
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    with running(settings) as daemon:
        yield Box(daemon, keys, tokens, ids)


def _call_in_background(box: Box, key: str, path: str = "/v1/embeddings") -> list[tuple[int, Any]]:
    answers: list[tuple[int, Any]] = []
    body = {"model": "embed", "input": INPUTS}
    threading.Thread(target=lambda: answers.append(box.post(path, body, key)), daemon=True).start()
    assert box.daemon.app is not None
    running = box.daemon.app[appkeys.GENERATIONS]
    # Its pooled call itself, not the request still preparing (`Preparing`, there from the start).
    wait_for(
        lambda: any(isinstance(item, PooledCall) for item in list(running._items)) or bool(answers),
        what="the call among the running requests",
    )
    assert not answers, answers
    return answers


def test_a_key_revoked_while_its_embedding_runs_ends_it_with_a_401(box: Box) -> None:
    answers = _call_in_background(box, "revoked")
    started = time.monotonic()
    assert edgellmctl(["keys", "revoke", box.ids["revoked"], "--file", str(box.keys)]) == 0
    wait_for(lambda: bool(answers), what="the call's answer")
    status, body = answers[0]
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key"
    assert time.monotonic() - started < 5  # within the keys file's check, not the call's whole run


def test_the_drain_waits_for_an_embedding_and_ends_it_past_its_deadline_with_a_503(box: Box) -> None:
    answers = _call_in_background(box, "flood")
    daemon = box.daemon
    assert daemon.app is not None
    assert daemon._runner is not None
    started = time.monotonic()
    asyncio.run_coroutine_threadsafe(drain(daemon.app, daemon._runner, 0.5), daemon.loop).result(20)
    assert time.monotonic() - started < 5
    wait_for(lambda: bool(answers), what="the call's answer")
    status, body = answers[0]
    assert status == 503, body
    assert body["error"]["code"] == "server_shutting_down"


def test_an_embedding_refused_at_capacity_is_charged_nothing(box: Box) -> None:
    answers = _call_in_background(box, "flood")
    status, body = box.post("/v1/embeddings", {"model": "embed", "input": INPUTS}, "flood")
    assert status == 429, body
    assert body["error"]["code"] == "server_overloaded"
    wait_for(lambda: bool(answers), what="the first call's answer")
    assert answers[0][0] == 200
    charged = answers[0][1]["usage"]["prompt_tokens"]

    def recorded() -> dict[str, int] | None:
        totals = box.usage("flood")
        return totals if totals["requests"] == 2 else None

    totals: dict[str, int] = wait_for(recorded, what="both calls in the ledger")
    assert totals["prompt_tokens"] == charged == 64 * 420
