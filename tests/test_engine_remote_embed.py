"""An embedding whose engine process dies under it is asked again of the restarted engine, once."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgellmd.engine.remote import RemoteEngine
from edgellmd.http import appkeys
from edgellmd.models import registry as registry_module
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for, wait_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

SLOW = TinyModelSpec(seed=41, n_embd=256, n_head=4, n_head_kv=2, n_layer=4, n_ff=1024)


@pytest.fixture
def embedder(tmp_path: Path) -> Iterator[RunningDaemon]:
    path = write_tiny_model(tmp_path / "embed.gguf", dataclasses.replace(SLOW))
    model = {"name": "embed", "file": str(path), "embedding": True, "slots": 1, "context_size": 512}
    settings = settings_for(
        [{**model, "threads": 1, "isolation": "process"}],
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry_module, "RESTART_BACKOFF_S", (0.2,))
        with running(settings) as daemon:
            yield daemon


def _engine(daemon: RunningDaemon) -> RemoteEngine:
    assert daemon.app is not None
    engine = daemon.app[appkeys.REGISTRY].get("embed").engine
    assert isinstance(engine, RemoteEngine)
    return engine


def test_an_embedding_cut_by_its_engines_death_is_answered_by_the_restarted_engine(
    embedder: RunningDaemon,
) -> None:
    victim = _engine(embedder)
    # Token ids: no tokenizing call to the engine before the embedding's own.
    inputs = [[(i * 7 + j) % 200 + 1 for j in range(420)] for i in range(48)]
    answers: list[tuple[int, Any]] = []
    thread = threading.Thread(
        target=lambda: answers.append(embedder.post("/v1/embeddings", {"model": "embed", "input": inputs}))
    )
    thread.start()
    wait_for(lambda: bool(victim._calls) or bool(answers), what="the embedding to reach the engine")
    assert not answers, answers
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(60)
    status, body = answers[0]
    assert status == 200, body
    assert len(body["data"]) == len(inputs)
    assert _engine(embedder).pid != victim.pid  # answered by the restarted engine
    _, shown = embedder.get("/admin/status")
    assert shown["models"][0]["engine_stops"] == 1
