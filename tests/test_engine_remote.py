"""Engines in processes of their own (`isolation: process`): a native fault costs one model's requests.

A real daemon serves two tiny models, each in a confined engine process. One engine is killed
mid-stream with SIGKILL, SIGSEGV or SIGABRT (what the OOM killer, a wild pointer and a
`GGML_ASSERT` do): its streams end with an error in their API family's shape within a second,
the other model's streams finish intact, /readyz says which model restarts, and the model
serves again by itself. A stopped engine (SIGSTOP) is a hang: killed and replaced. And from
inside a real engine process, what its confinement refuses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import json
import os
import signal
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from edgellmd.engine import remote as remote_module
from edgellmd.engine import wire
from edgellmd.engine.config import EngineConfig, EngineError, ModelLoadError
from edgellmd.engine.confine import landlock_abi
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.engine.remote import RemoteEngine
from edgellmd.engine.worker import TEST_HOOKS_ENV
from edgellmd.errors import ServiceUnavailable
from edgellmd.host import memgroups
from edgellmd.http import appkeys
from edgellmd.models import handle as handle_module
from edgellmd.models import registry as registry_module
from edgellmd.models.budget import estimate_bytes
from edgellmd.settings import ModelSettings
from edgellmd.settings.declare import ConfigError
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import (
    RunningDaemon,
    engine_workers,
    running,
    settings_for,
    stop_new_engine_worker,
    wait_for,
)

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

# Slow enough (hundreds of tokens a second) that a stream is still running when its engine dies.
SLOW = TinyModelSpec(seed=31, n_embd=256, n_head=4, n_head_kv=2, n_layer=2, n_ff=1024)
SLOTS = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    os.environ[TEST_HOOKS_ENV] = "1"  # the engine processes answer the confinement probes
    root = tmp_path_factory.mktemp("isolated")
    models = []
    for name, seed in (("left", 31), ("right", 32)):
        path = write_tiny_model(root / f"{name}.gguf", dataclasses.replace(SLOW, seed=seed))
        models.append(
            {
                "name": name,
                "file": str(path),
                "slots": SLOTS,
                "context_size": 1024,
                "threads": 1,
                "isolation": "process",
                "hang_timeout_s": 2.0,
                "crash_loop_stops": 1000,  # every test here stops an engine: never trip the breaker
            }
        )
    settings = settings_for(
        models,
        server={"max_tokens_limit": 4096},
        lifecycle={"preload_dir": str(root / "shm"), "watch": False},
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(registry_module, "RESTART_BACKOFF_S", (0.2,))  # restart at once
            with running(settings) as daemon:
                yield daemon
    finally:
        os.environ.pop(TEST_HOOKS_ENV, None)


def _engine(daemon: RunningDaemon, name: str) -> RemoteEngine:
    assert daemon.app is not None
    engine = daemon.app[appkeys.REGISTRY].get(name).engine
    assert isinstance(engine, RemoteEngine)
    return engine


def _serving_pid(daemon: RunningDaemon, name: str) -> int | None:
    """The pid of the engine process that serves `name` now (None while none does)."""
    try:
        return _engine(daemon, name).pid
    except ServiceUnavailable:
        return None


def _ready(daemon: RunningDaemon, name: str) -> bool:
    _, body = daemon.get("/readyz")
    return bool(body["models"][name]["state"] == "ready")


def _stream(
    daemon: RunningDaemon, model: str, max_tokens: int, out: list[list[dict[str, Any] | str]]
) -> None:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Once upon a time"}],
    }
    request = urllib.request.Request(  # noqa: S310 - loopback
        daemon.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    events: list[dict[str, Any] | str] = []
    out.append(events)
    with urllib.request.urlopen(request, timeout=60) as answer:  # noqa: S310 - loopback
        for raw in answer:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))


def _chunks(events: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT], ids=["KILL", "SEGV", "ABRT"]
)
def test_a_killed_engine_costs_its_own_streams_only_and_comes_back(pair: RunningDaemon, signum: int) -> None:
    """8 streams on each model: the killed model's running ones end with the error within a
    second; its queued ones wait for the restarted engine and finish; the other model's all
    finish intact; nothing of the dead process is left behind."""
    wait_for(lambda: _ready(pair, "left") and _ready(pair, "right"), what="both models")
    victim = _engine(pair, "left")
    preload = Path(pair.settings.lifecycle.preload_dir or "")
    copies = sorted(p.name for p in preload.rglob("*.gguf"))
    running: list[list[dict[str, Any] | str]] = []
    queued: list[list[dict[str, Any] | str]] = []
    right: list[list[dict[str, Any] | str]] = []
    threads = [threading.Thread(target=_stream, args=(pair, "left", 3000, running)) for _ in range(SLOTS)]
    threads += [threading.Thread(target=_stream, args=(pair, "right", 200, right)) for _ in range(2 * SLOTS)]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: len(running) == SLOTS and all(len(s) >= 3 for s in running), what="the left streams to flow"
    )
    waiting = [threading.Thread(target=_stream, args=(pair, "left", 40, queued)) for _ in range(SLOTS)]
    for thread in waiting:
        thread.start()
    wait_for(lambda: victim.queue_depth == SLOTS, what="the queued left requests")
    os.kill(victim.pid, signum)
    killed = time.monotonic()
    for thread in threads[:SLOTS]:
        thread.join(5)
    ended = time.monotonic() - killed
    assert ended < 1.5, f"the killed model's streams took {ended:.2f} s to end"
    for events in running:
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert isinstance(error, dict)
        assert error["error"]["code"] == "engine_failed", error
    for thread in threads[SLOTS:] + waiting:
        thread.join(60)
    for events in right:  # the other model never noticed
        assert events[-1] == "[DONE]"
        assert _chunks(events)[-1]["choices"][0]["finish_reason"] == "length"
        assert not any(isinstance(e, dict) and "error" in e for e in events)
    for events in queued:  # waited for the restarted engine, then were served in full
        assert events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert _chunks(events)[-1]["choices"][0]["finish_reason"] == "length"
        usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
        assert usage["completion_tokens"] == 40
    # Not ready while it restarts, with the reason; then a new engine process serves.
    status, body = pair.get("/readyz")
    if status == 503:
        assert body["models"]["left"]["state"] in ("restarting", "loading")
        assert body["models"]["right"]["state"] == "ready"
    wait_for(lambda: _ready(pair, "left"), timeout=10, what="the restart")
    assert _engine(pair, "left").pid != victim.pid
    status, answer = pair.post(
        "/v1/chat/completions",
        {"model": "left", "max_tokens": 4, "messages": [{"role": "user", "content": "again"}]},
    )
    assert status == 200, answer
    status, shown = pair.get("/admin/status")
    model = next(m for m in shown["models"] if m["name"] == "left")
    assert model["engine_stops"] >= 1
    name = signal.Signals(signum).name
    assert name in model["last_engine_stop"]["fault"]
    assert model["engine_process"]["pid"] == _engine(pair, "left").pid
    # The token hand-off across the boundary is measured: the other model's frames.
    handoff = next(m for m in shown["models"] if m["name"] == "right")["engine_process"]["handoff"]
    assert handoff["frames"] > 0
    assert 0 <= handoff["p50_ms"] <= handoff["p99_ms"] < 1000
    with urllib.request.urlopen(pair.url + "/metrics", timeout=10) as answer:  # noqa: S310 - loopback
        metrics = answer.read().decode()
    assert f'edgellm_engine_restarts_total{{model="left",reason="{name.lower()}"}}' in metrics
    # Nothing of the dead process is left: reaped, its socket closed, no second /dev/shm copy.
    wait_for(lambda: not Path(f"/proc/{victim.pid}").exists(), timeout=5, what="the old process to be reaped")
    assert victim._sock.fileno() == -1
    assert sorted(p.name for p in preload.rglob("*.gguf")) == copies


def test_a_request_before_its_first_byte_gets_503_engine_failed(pair: RunningDaemon) -> None:
    wait_for(lambda: _ready(pair, "right"), what="the model")
    victim = _engine(pair, "right")
    answers: list[tuple[int, Any]] = []

    def ask() -> None:
        answers.append(
            pair.post(
                "/v1/chat/completions",
                {
                    "model": "right",
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
        )

    thread = threading.Thread(target=ask)
    thread.start()
    wait_for(lambda: victim.busy_slots == 1, what="the request to run")
    time.sleep(0.1)
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(5)
    status, body = answers[0]
    assert status == 503
    assert body["error"]["code"] == "engine_failed"
    wait_for(lambda: _ready(pair, "right"), timeout=10, what="the restart")


def test_a_stopped_engine_is_a_hang_that_is_killed_and_replaced(pair: RunningDaemon) -> None:
    wait_for(lambda: _ready(pair, "left"), what="the model")
    victim = _engine(pair, "left")
    out: list[list[dict[str, Any] | str]] = []
    thread = threading.Thread(target=_stream, args=(pair, "left", 3000, out))
    thread.start()
    wait_for(lambda: out and len(out[0]) >= 3, what="the stream to flow")
    os.kill(victim.pid, signal.SIGSTOP)
    thread.join(10)  # hang_timeout_s is 2 s
    assert not thread.is_alive()
    error = out[0][-2]
    assert isinstance(error, dict)
    assert error["error"]["code"] == "engine_failed"
    wait_for(lambda: _ready(pair, "left"), timeout=10, what="the replacement")
    _, shown = pair.get("/admin/status")
    model = next(m for m in shown["models"] if m["name"] == "left")
    assert "no progress" in model["last_engine_stop"]["fault"]


def test_a_request_whose_engine_hangs_as_its_prompt_is_tokenized_is_told_so(pair: RunningDaemon) -> None:
    """A request tokenizing when its engine hung (or died) was told the model "was unloaded
    while the request was prepared" (model_not_ready): nothing unloaded it."""
    wait_for(lambda: _ready(pair, "left"), what="the model")
    victim = _engine(pair, "left")
    os.kill(victim.pid, signal.SIGSTOP)
    code, body = pair.post("/v1/completions", {"model": "left", "prompt": "tokenized by a stopped engine"})
    assert code == 503
    assert body["error"]["code"] == "engine_failed", body
    assert "unloaded" not in body["error"]["message"]
    wait_for(lambda: _ready(pair, "left"), timeout=10, what="the replacement")


def test_a_model_whose_engine_hangs_holds_up_no_other_models_requests(pair: RunningDaemon) -> None:
    """Tokenizing is a call to the model's engine, made on a prompt-pool thread: on one pool of
    every model's, requests to a stopped engine held its threads until the hang was found, and
    a request to a healthy model waited as long (19 s of a 20 s hang_timeout_s). Each model has
    its own pool: the other model answers while the stopped one's request still waits."""
    for name in ("left", "right"):
        wait_for(lambda name=name: _ready(pair, name), what="the models")  # type: ignore[misc]
    victim = _engine(pair, "left")
    answers: list[tuple[str, int, float]] = []

    def ask(model: str) -> None:
        body = {"model": model, "prompt": f"a prompt for {model}", "max_tokens": 4}
        code, _ = pair.post("/v1/completions", body)
        answers.append((model, code, time.monotonic()))

    os.kill(victim.pid, signal.SIGSTOP)
    stuck = [threading.Thread(target=ask, args=("left",)) for _ in range(2)]
    for thread in stuck:
        thread.start()
    wait_for(lambda: bool(victim._calls), what="a call waiting on the stopped engine")
    ask("right")
    for thread in stuck:
        thread.join(30)
    order = [(model, code) for model, code, _ in sorted(answers, key=lambda a: a[2])]
    assert order[0] == ("right", 200), order  # before the hang was found (hang_timeout_s 2 s)
    assert sorted(order[1:]) == [("left", 503), ("left", 503)], order
    wait_for(lambda: _ready(pair, "left"), timeout=10, what="the replacement")


def test_the_engine_process_is_confined(pair: RunningDaemon, tmp_path: Path) -> None:
    wait_for(lambda: _ready(pair, "right"), what="the model")
    engine = _engine(pair, "right")
    assert "no new privileges" in engine.confined
    assert engine.probe("inet").startswith("refused")  # seccomp: no socket but AF_UNIX
    status = Path(f"/proc/{engine.pid}/status").read_text()
    assert "NoNewPrivs:\t1" in status
    assert "CapEff:\t0000000000000000" in status
    # The OOM killer picks the runaway engine, never the daemon first.
    engine_adj = int(Path(f"/proc/{engine.pid}/oom_score_adj").read_text())
    assert engine_adj >= 500 > int(Path("/proc/self/oom_score_adj").read_text())
    if landlock_abi() <= 0:
        pytest.skip("no Landlock (the kernel lacks it, or a filter refuses it): the file system is open")
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the engine")
    assert engine.probe("read", str(outside)).startswith("refused")
    assert engine.probe("write", str(tmp_path / "dropped")).startswith("refused")
    assert not (tmp_path / "dropped").exists()
    assert engine.probe("read", "/etc/hostname") == "allowed"  # what it may read, it can


def _flowing(out: list[list[str]]) -> bool:
    """A stream's first few events arrived."""
    return bool(out) and sum(line.startswith("data:") for line in out[0]) >= 3


def _raw_stream(daemon: RunningDaemon, path: str, body: dict[str, Any], out: list[list[str]]) -> None:
    """The event names (`event:` lines) and data lines of a stream, as sent."""
    request = urllib.request.Request(  # noqa: S310 - loopback
        daemon.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    lines: list[str] = []
    out.append(lines)
    with urllib.request.urlopen(request, timeout=60) as answer:  # noqa: S310 - loopback
        lines.extend(line for raw in answer if (line := raw.decode().strip()))


@pytest.mark.parametrize(
    ("path", "body", "last_event"),
    [
        (
            "/v1/responses",
            {"model": "left", "input": "Once upon a time", "max_output_tokens": 3000, "stream": True},
            "response.failed",
        ),
        (
            "/v1/messages",
            {
                "model": "left",
                "max_tokens": 3000,
                "stream": True,
                "messages": [{"role": "user", "content": "Once upon a time"}],
            },
            "error",
        ),
    ],
    ids=["responses", "messages"],
)
def test_each_api_family_ends_a_killed_stream_with_its_own_error_event(
    pair: RunningDaemon, path: str, body: dict[str, Any], last_event: str
) -> None:
    for _attempt in range(3):  # Messages has no ignore_eos: a reply may end before the kill
        wait_for(lambda: _ready(pair, "left"), timeout=10, what="the model")
        victim = _engine(pair, "left")
        out: list[list[str]] = []
        thread = threading.Thread(target=_raw_stream, args=(pair, path, body, out))
        thread.start()
        wait_for(partial(_flowing, out), what="the stream")
        os.kill(victim.pid, signal.SIGKILL)
        thread.join(5)
        assert not thread.is_alive()
        events = [line[len("event: ") :] for line in out[0] if line.startswith("event: ")]
        if events[-1] in ("message_stop", "response.completed"):
            continue  # it finished first: nothing was cut
        assert events[-1] == last_event, events[-5:]
        assert "engine" in out[0][-1]  # the error names the engine: engine_failed, or its message
        break
    else:
        pytest.fail("every reply ended before its engine was killed")
    wait_for(lambda: _ready(pair, "left"), timeout=10, what="the restart")


def test_a_restart_loads_the_verified_copy_again_without_hashing_it(
    pair: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    wait_for(lambda: _ready(pair, "right"), what="the model")
    _, shown = pair.get("/admin/status")
    before = next(m for m in shown["models"] if m["name"] == "right")["shm_path"]
    assert before
    victim = _engine(pair, "right")
    with caplog.at_level("INFO", logger="edgellmd.models.loader"):
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(
            lambda: _serving_pid(pair, "right") not in (None, victim.pid),
            timeout=10,
            what="the restart",
        )
    _, shown = pair.get("/admin/status")
    assert next(m for m in shown["models"] if m["name"] == "right")["shm_path"] == before
    assert any("restarting from its verified copy" in r.getMessage() for r in caplog.records)
    assert Path(before).is_file()


def test_an_engine_that_sends_what_no_worker_sends_is_killed_at_once(pair: RunningDaemon) -> None:
    """The daemon trusts nothing an engine process sends: a frame it cannot read ends that
    process (it may be subverted) and the model restarts; the daemon itself never stumbles."""
    wait_for(lambda: _ready(pair, "right"), what="the model")
    victim = _engine(pair, "right")
    with contextlib.suppress(EngineError):  # the answer may never come: the process is killed first
        victim.probe("garbage")
    wait_for(lambda: victim.exited, timeout=5, what="the process to be killed")
    assert victim.fault == "its engine process sent a malformed frame and was killed"
    wait_for(
        lambda: _serving_pid(pair, "right") not in (None, victim.pid),
        timeout=10,
        what="the restart",
    )
    assert pair.get("/healthz")[0] == 200


def test_an_engine_past_its_memory_limit_fails_alone_and_says_why(tmp_path: Path) -> None:
    """`memory_limit_mb` is the engine process's address-space limit: one too low for the model
    fails that model's load with the limit named; the other model serves, the daemon lives on,
    and a limit that fits is one of the confinements /admin/status lists."""
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    common = {"file": str(model), "threads": 1, "context_size": 256, "isolation": "process"}
    settings = settings_for(
        [
            {"name": "starved", **common, "memory_limit_mb": 128},
            {"name": "fits", **common, "memory_limit_mb": 4096},
        ],
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    with running(settings, wait_ready=False) as daemon:

        def states() -> dict[str, dict[str, Any]]:
            return {m["name"]: m for m in daemon.get("/admin/status")[1]["models"]}

        wait_for(
            lambda: {m["state"] for m in states().values()} <= {"ready", "failed"}, what="both loads to end"
        )
        shown = states()
        assert shown["starved"]["state"] == "failed"
        assert "address space is limited to 128 MiB: too low?" in shown["starved"]["reason"]
        assert shown["fits"]["state"] == "ready"
        assert "address space at most 4096 MiB" in shown["fits"]["engine_process"]["confined"]
        status, body = daemon.post("/v1/completions", {"model": "fits", "prompt": "x", "max_tokens": 3})
        assert status == 200, body
        assert daemon.get("/healthz")[0] == 200


@pytest.mark.parametrize(
    ("extra", "words"),
    [({"isolation": "thread"}, "only with isolation process"), ({"gpu_layers": -1}, "not with gpu_layers")],
)
def test_a_memory_limit_where_it_cannot_hold_is_refused(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=rf"models\[0\]\.memory_limit_mb.*{words}"):
        settings_for(
            [{"name": "m", "file": "m.gguf", "memory_limit_mb": 1024, "isolation": "process", **extra}]
        )


def _memory_group_check(daemon: RunningDaemon, model: Path) -> Path:
    """The runaway/calm scenario of the test below, in a running daemon; the replacement's group."""
    victim = _engine(daemon, "runaway")
    group = victim.memory_group
    assert group is not None
    expected = estimate_bytes(model, daemon.settings.models[0]) + 128 * 1024 * 1024
    assert group.limit == expected
    assert group.path.name in Path(f"/proc/{victim.pid}/cgroup").read_text()
    _, status = daemon.get("/admin/status")
    shown = next(m for m in status["models"] if m["name"] == "runaway")["engine_process"]
    assert shown["memory_group"]["limit_bytes"] == expected
    assert 0 < shown["memory_group"]["usage_bytes"] < expected
    assert f"memory at most {expected // (1024 * 1024)} MiB" in " ".join(shown["confined"])
    calm = _engine(daemon, "calm").pid
    if landlock_abi() > 0:  # the engine (the daemon's own user) cannot raise its limit or leave
        for knob in ("memory.max", "memory.limit_in_bytes", "cgroup.procs"):
            if (group.path / knob).exists():
                assert victim.probe("write", str(group.path / knob)) == "refused: Permission denied"

    with pytest.raises(EngineError):  # the engine dies mid-call
        victim.probe("allocate", "512")
    wait_for(lambda: _serving_pid(daemon, "runaway") not in (None, victim.pid), timeout=30, what="a restart")
    wait_for(lambda: _ready(daemon, "runaway"), timeout=30, what="the model back")
    _, status = daemon.get("/admin/status")
    stop = next(m for m in status["models"] if m["name"] == "runaway")["last_engine_stop"]
    assert f"killed at its memory limit ({expected // (1024 * 1024)} MiB" in stop["fault"]
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as answer:  # noqa: S310 - loopback
        metrics = answer.read().decode()
    assert 'edgellm_engine_restarts_total{model="runaway",reason="oom"}' in metrics
    assert not group.path.exists()
    replacement = _engine(daemon, "runaway").memory_group
    assert replacement is not None
    assert replacement.path != group.path
    assert replacement.path.exists()
    assert _engine(daemon, "calm").pid == calm
    for name in ("runaway", "calm"):
        code, answered = daemon.post("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 3})
        assert code == 200, answered
    return replacement.path


def test_an_engine_past_its_memory_group_is_killed_alone_and_comes_back(tmp_path: Path) -> None:
    """Each engine process sits in a memory cgroup of its own, limited to what the budget counts
    for its model plus `memory_group_headroom_mb`. One that runs away (the test hook touches
    512 MiB) is killed by the kernel at that limit: the cause is named (`oom`), the other model
    and the daemon never notice, the model comes back in a new group, and the old group is gone."""
    groups = memgroups.shared()
    if isinstance(groups, str):
        pytest.skip(f"this process may make no memory cgroups here: {groups}")
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    common = {
        "file": str(model),
        "threads": 1,
        "context_size": 256,
        "isolation": "process",
        "memory_group_headroom_mb": 128,
    }
    settings = settings_for(
        [{"name": "runaway", **common}, {"name": "calm", **common}],
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    os.environ[TEST_HOOKS_ENV] = "1"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(registry_module, "RESTART_BACKOFF_S", (0.2,))
            with running(settings) as daemon:
                left = _memory_group_check(daemon, model)
        assert not left.exists()  # the daemon's stop removed what it made
    finally:
        os.environ.pop(TEST_HOOKS_ENV, None)


def test_a_memory_group_too_small_to_load_in_fails_that_load_and_says_why(tmp_path: Path) -> None:
    """An engine killed at its group's limit while it loads: that model fails with the limit and
    the setting to raise named; the other model serves; no group is left behind."""
    groups = memgroups.shared()
    if isinstance(groups, str):
        pytest.skip(f"this process may make no memory cgroups here: {groups}")
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    common = {"file": str(model), "threads": 1, "context_size": 256, "isolation": "process"}
    settings = settings_for(
        [{"name": "starved", **common}, {"name": "fits", **common}],
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    real = handle_module.memory_group_limit

    def limit(model_settings: ModelSettings) -> int | None:
        return 8 * 1024 * 1024 if model_settings.name == "starved" else real(model_settings)

    ours = f"{memgroups.PREFIX}{os.getpid()}-"  # this process's groups (another run may share the parent)
    before = {p.name for p in groups.parent.iterdir() if p.name.startswith(ours)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(handle_module, "memory_group_limit", limit)
        with running(settings, wait_ready=False) as daemon:

            def states() -> dict[str, dict[str, Any]]:
                return {m["name"]: m for m in daemon.get("/admin/status")[1]["models"]}

            wait_for(
                lambda: {m["state"] for m in states().values()} <= {"ready", "failed"},
                what="both loads to end",
            )
            shown = states()
            assert shown["starved"]["state"] == "failed"
            assert "killed at its memory cgroup's limit of 8 MiB" in shown["starved"]["reason"]
            assert "memory_group_headroom_mb" in shown["starved"]["reason"]
            assert shown["fits"]["state"] == "ready"
            code, body = daemon.post("/v1/completions", {"model": "fits", "prompt": "x", "max_tokens": 3})
            assert code == 200, body
    after = {p.name for p in groups.parent.iterdir() if p.name.startswith(ours)}
    assert after <= before


def test_without_memory_groups_engines_say_so_and_serve(tmp_path: Path) -> None:
    """Where the daemon may make no cgroup, an engine that wanted one lists why among its
    `unconfined` and serves; one configured without (`memory_group: false`) lists nothing."""
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    common = {"file": str(model), "threads": 1, "context_size": 256, "isolation": "process"}
    settings = settings_for(
        [{"name": "wanted", **common}, {"name": "off", **common, "memory_group": False}],
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
    )
    why = "no cgroup memory controller reaches this process (as on a host without one)"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memgroups, "_shared", why)
        with running(settings) as daemon:
            _, status = daemon.get("/admin/status")
            shown = {m["name"]: m["engine_process"] for m in status["models"]}
            assert shown["wanted"]["memory_group"] is None
            assert f"{memgroups.HOST_WIDE}{why}" in shown["wanted"]["unconfined"]
            assert shown["off"]["memory_group"] is None
            assert not any("memory" in line for line in shown["off"]["unconfined"])
            for name in ("wanted", "off"):
                code, body = daemon.post("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 3})
                assert code == 200, body


def test_an_engines_stderr_is_kept_escaped_for_every_place_its_tail_is_shown() -> None:
    """A stop's reason holds the engine's last lines: /admin/status, edgellmctl, the console,
    the audit chain, STATUS=. Native code prints a model file's own strings there (llama.cpp's
    metadata dump): an escape sequence, an OSC 52 clipboard write or a bidi override in them
    reached the operator's terminal raw."""
    engine = RemoteEngine.__new__(RemoteEngine)  # no process: only the reading of its stderr
    engine.name = "m"  # type: ignore[misc]  # set once, as __init__ would
    engine._tail = collections.deque(maxlen=8)
    hostile = "kv 3: \x1b[2J\x1b[41;97mALL OK\x1b[0m\x1b]52;c;aGk=\x07 \u202eexe.txt \x9b31m"
    engine._proc = types.SimpleNamespace(stderr=io.BytesIO(hostile.encode() + b"\n"))  # type: ignore[assignment]
    engine._read_stderr()
    (kept,) = engine._tail
    assert kept.isprintable()
    assert "\\x1b[2J" in kept
    assert "\\u202e" in kept
    assert "\\x9b" in kept


def _load_stopped(
    config: EngineConfig, name: str, hang_s: float
) -> tuple[threading.Thread, list[BaseException], int]:
    """Load an engine process on a thread and SIGSTOP it as it loads (an engine that stopped
    or deadlocked loading): the thread, where the load's failure goes, the process's pid."""
    others = engine_workers()  # engines of other tests' daemons, in this process
    failures: list[BaseException] = []

    def load() -> None:
        try:
            RemoteEngine(config, name=name, hang_s=hang_s)
        except BaseException as exc:  # noqa: BLE001 - the caller's to judge
            failures.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    return loader, failures, stop_new_engine_worker(others)


def _tiny_config(tmp_path: Path, seed: int) -> EngineConfig:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=seed))
    return EngineConfig(path=model, slots=1, context_size=128, batch_size=64, threads=1, threads_batch=1)


def _close(*engines: RemoteEngine) -> None:
    """Each engine let go on (it may be stopped) and closed."""
    for engine in engines:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine.pid, signal.SIGCONT)
        engine.close()


def test_an_engine_stopped_while_it_loads_is_a_hang_not_ten_minutes_of_a_held_registry(
    tmp_path: Path,
) -> None:
    """A load waited for the process's first frame for LOAD_TIMEOUT_S (600 s): an engine
    stopped (or deadlocked) as it loaded held the registry, every load and unload behind it and
    the daemon's stop. No CPU time and no reads for hang_s while loading is a hang, killed."""
    started = time.monotonic()
    loader, failures, pid = _load_stopped(_tiny_config(tmp_path, 5), "stopped", 1.5)
    loader.join(10)
    assert not loader.is_alive()
    assert time.monotonic() - started < 10
    assert len(failures) == 1
    assert isinstance(failures[0], ModelLoadError)
    assert "no progress for 1.5 s and was killed" in str(failures[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_call_to_a_stopped_idle_engine_starts_the_hang_clock_when_it_is_made(tmp_path: Path) -> None:
    """The hang clock of a call to an idle engine started at its last progress, not at the
    call: an engine stopped long enough before was killed at once, well before hang_s."""
    engine = RemoteEngine(_tiny_config(tmp_path, 6), name="idle", hang_s=1.5)
    try:
        assert engine.tokenize("hi")
        os.kill(engine.pid, signal.SIGSTOP)
        time.sleep(2.0)  # past hang_s, idle: nothing pending, nothing killed
        assert psutil.Process(engine.pid).status() == psutil.STATUS_STOPPED
        started = time.monotonic()
        with pytest.raises(EngineError):
            engine.tokenize("hi")
        waited = time.monotonic() - started
        assert 1.4 <= waited < 6, waited
        assert engine.fault_kind == "hang"
    finally:
        _close(engine)


def test_a_stopped_idle_engine_is_a_hang_found_without_a_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle engine that stopped was reported ready (readiness, status, metrics, systemd)
    until a request came and waited hang_s for it: its heartbeat frames stop, and that is a
    hang too. A live idle engine, beating, is left alone past the same time."""
    monkeypatch.setattr(remote_module, "IDLE_HANG_MIN_S", 1.5)
    stopped = RemoteEngine(_tiny_config(tmp_path, 8), name="stopped", hang_s=1.0)
    (tmp_path / "live").mkdir()
    live = RemoteEngine(_tiny_config(tmp_path / "live", 9), name="live", hang_s=1.0)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        started = time.monotonic()
        wait_for(lambda: stopped.fault is not None, timeout=10, what="the idle hang")
        # Its last beat came up to 0.75 s before the stop (a beat every 0.5 s, a frame every 0.25).
        assert 0.7 <= time.monotonic() - started < 8
        assert stopped.fault_kind == "hang"
        assert "idle engine process sent no heartbeat for 1.5 s" in (stopped.fault or "")
        time.sleep(1.0)  # the live one has been idle past 1.5 s by now
        assert live.fault is None
        assert live.tokenize("still here")
    finally:
        _close(stopped, live)


def test_the_supervisor_away_is_no_engines_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon stopped (SIGSTOP, a debugger) or its VM paused past the idle bound: on its
    return, what its supervisor saw of an engine's heartbeat is as old as the pause, and the
    engine is not killed for that. Here the engine is stopped exactly while its supervisor is
    away and goes on as it comes back."""
    monkeypatch.setattr(remote_module, "IDLE_HANG_MIN_S", 1.5)
    engines: list[RemoteEngine] = []
    away = threading.Event()
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread().name == "engine-supervisor:away" and not away.is_set():
            away.set()
            while not engines:
                real_sleep(0.01)
            os.kill(engines[0].pid, signal.SIGSTOP)
            real_sleep(3.0)
            os.kill(engines[0].pid, signal.SIGCONT)
            return
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)  # the supervisor's (remote.py calls time.sleep)
    engines.append(RemoteEngine(_tiny_config(tmp_path, 10), name="away", hang_s=1.0))
    engine = engines[0]
    try:
        wait_for(away.is_set, timeout=10, what="the supervisor to go away")
        real_sleep(5.0)  # back after 3 s; the engine beats again within the 1.5 s bound
        assert engine.fault is None
        assert engine.tokenize("back")
    finally:
        _close(engine)


def test_stats_do_not_wait_for_a_stopped_engine(pair: RunningDaemon) -> None:
    """/admin/stats asked a serving engine for the llama.cpp build at every call: with that
    engine stopped, the answer waited for the engine's hang timeout. It is asked once."""
    for name in ("left", "right"):
        wait_for(lambda name=name: _ready(pair, name), what="the models")  # type: ignore[misc]
    assert pair.get("/admin/stats")[0] == 200
    victims = [_engine(pair, name) for name in ("left", "right")]
    try:
        for victim in victims:
            os.kill(victim.pid, signal.SIGSTOP)
        started = time.monotonic()
        code, body = pair.get("/admin/stats")
        assert code == 200, body
        assert time.monotonic() - started < 1.0
    finally:
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGCONT)


def test_each_engines_resident_memory_is_a_metric(pair: RunningDaemon) -> None:
    """The daemon's RSS metric holds no model; each engine process's is its own series."""
    for name in ("left", "right"):
        wait_for(lambda name=name: _ready(pair, name), what="the models")  # type: ignore[misc]
    with urllib.request.urlopen(pair.url + "/metrics", timeout=10) as answer:  # noqa: S310 - loopback
        text = answer.read().decode()
    found = {
        line.split('model="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgellm_engine_resident_memory_bytes{")
    }
    assert set(found) == {"left", "right"}
    engines = {name: _engine(pair, name) for name in found}
    for name, rss in found.items():
        assert rss > 10 * 1024 * 1024, (name, rss)  # an interpreter with llama.cpp and the model
        assert engines[name].process()["rss_bytes"] == pytest.approx(rss, rel=0.5)


def test_a_stop_kills_the_engines_still_loading(tmp_path: Path) -> None:
    """SIGTERM while a model loads: the stop waited for the load (minutes for a large model),
    then the unit's stop timeout killed the daemon mid-drain. The drain kills the engine
    processes still loading; their loads fail at once. Only the named models' are killed."""
    loader, failures, _ = _load_stopped(_tiny_config(tmp_path, 7), "slow-to-load", 60)
    time.sleep(0.5)  # the engine is in _LOADING by now
    assert remote_module.abort_loads(["another-model"]) == 0
    started = time.monotonic()
    assert remote_module.abort_loads(["slow-to-load"]) == 1
    loader.join(10)
    assert not loader.is_alive()
    assert time.monotonic() - started < 5
    assert len(failures) == 1
    assert isinstance(failures[0], ModelLoadError)
    assert "SIGKILL while loading" in str(failures[0])


def test_the_stop_closes_hung_engines_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines that do not exit when told are killed after CLOSE_TIMEOUT_S: closed one after
    another, two stopped engines held the daemon's stop that long twice over (past the
    unit's TimeoutStopSec with a few models, the clean drain then cut by SIGKILL)."""
    monkeypatch.setattr(remote_module, "CLOSE_TIMEOUT_S", 2.0)
    models = [
        {
            "name": name,
            "file": str(write_tiny_model(tmp_path / f"{name}.gguf", TinyModelSpec(seed=seed))),
            "slots": 1,
            "context_size": 128,
            "threads": 1,
            "isolation": "process",
        }
        for name, seed in (("one", 51), ("two", 52))
    ]
    settings = settings_for(models, lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False})
    with running(settings) as daemon:
        wait_for(lambda: _ready(daemon, "one") and _ready(daemon, "two"), what="both models")
        pids = [_engine(daemon, name).pid for name in ("one", "two")]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
    took = time.monotonic() - started
    assert 2.0 <= took < 2 * 2.0 - 0.5, f"the stop took {took:.1f} s"  # once, not once per engine
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids
    )


def test_a_warming_engine_counts_cpu_time_as_progress_and_a_served_one_does_not(tmp_path: Path) -> None:
    """On a busy box the first steps after a load can take longer than hang_timeout_s: the
    warm-up killed such an engine as hung while its CPU time climbed. While the loader warms
    it up, CPU time is progress (as in a load); once it serves, a step this long is a hang."""
    spec = TinyModelSpec(seed=41, n_embd=512, n_head=8, n_head_kv=4, n_layer=4, n_ff=2048)
    model = write_tiny_model(tmp_path / "slow.gguf", spec)
    n = 2048  # one step of this many prompt tokens: seconds on one thread
    config = EngineConfig(path=model, slots=1, context_size=n + 16, batch_size=n, threads=1, threads_batch=1)
    engine = RemoteEngine(config, name="warming", hang_s=0.4)

    async def generate(first: int) -> tuple[Finished, float]:
        prompt = [first + i % 200 for i in range(n)]  # another prefix each time: no KV reuse
        request = GenerationRequest(
            prompt_tokens=prompt, max_tokens=2, ignore_eos=True, sampling=SamplingParams(temperature=0.0)
        )
        started = time.monotonic()
        events = [event async for event in engine.submit(request, asyncio.get_running_loop()).events()]
        assert isinstance(events[-1], Finished)
        return events[-1], time.monotonic() - started

    try:
        engine.warming = True
        warm, took = asyncio.run(generate(5))
        assert warm.reason == "length", warm.error
        assert took > 2 * engine.hang_s, f"the step took {took:.2f} s: not long enough to show anything"
        assert engine.fault is None
        engine.warming = False
        served, took = asyncio.run(generate(7))
        assert served.reason == "error"
        assert engine.fault_kind == "hang"
        assert took < 3.0
    finally:
        engine.close()


def test_an_engine_of_other_code_than_the_daemons_says_so_and_does_not_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package upgraded in place while the daemon ran: a restarted engine process runs the
    new code, and the two misread each other's frames ("sent a malformed frame", a crash loop
    with no word of why). The engine compares the daemon's code with its own first."""
    monkeypatch.setattr(wire, "CODE", "0" * 16)
    with pytest.raises(ModelLoadError, match="upgraded while the daemon ran"):
        RemoteEngine(_tiny_config(tmp_path, 8), name="upgraded")


def test_a_restart_into_other_code_fails_the_model_at_once_saying_to_restart_the_daemon(
    pair: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retried with backoff like a crash, the model read "restarting" for minutes, a state
    no restart could leave: it is failed at once, with the reason, until the daemon restarts
    (or an operator loads it once the code matches again)."""
    wait_for(lambda: _ready(pair, "right"), what="the model")
    assert pair.app is not None
    registry = pair.app[appkeys.REGISTRY]
    stops = registry.engine_stops["right"]
    monkeypatch.setattr(wire, "CODE", "0" * 16)  # the daemon's code, as the new engine sees it
    os.kill(_engine(pair, "right").pid, signal.SIGKILL)

    def failed() -> dict[str, Any] | None:
        model = next(m for m in pair.get("/admin/status")[1]["models"] if m["name"] == "right")
        return model if model["state"] == "failed" else None

    shown: dict[str, Any] = wait_for(failed, what="the model failed")
    assert "restart the daemon" in shown["reason"]
    assert shown["last_engine_stop"]["action"] == "not restarted: restart the daemon"
    time.sleep(1.0)  # past the backoff: nothing was tried again
    assert registry.engine_stops["right"] == stops + 1
    assert failed() is not None
    monkeypatch.undo()
    status, body = pair.post("/admin/models/right/load", {})
    assert status == 200, body
    wait_for(lambda: _ready(pair, "right"), what="the model back")
