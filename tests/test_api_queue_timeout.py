"""models[].queue_timeout_s: a request that waited past it for a slot gets a 429, never a late answer."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgellmd.engine.generation import QUEUE_TIMEOUT
from edgellmd.settings import ConfigError
from tests.serving import RunningDaemon, running, settings_for, small_tiny
from tests.test_host_metrics import scrape, value

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

LONG = {"model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True}  # seconds long


def tiny(models_dir: Path, **extra: Any) -> dict[str, Any]:
    return small_tiny(models_dir, **{"queue_size": 8, "context_size": 2048, **extra})


@pytest.fixture
def daemon(models_dir: Path) -> Iterator[RunningDaemon]:
    with running(settings_for([tiny(models_dir, queue_timeout_s=0.05)], lifecycle={"watch": False})) as d:
        yield d


def post(daemon: RunningDaemon, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(  # noqa: S310 - loopback
        daemon.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def hold_the_slot(daemon: RunningDaemon) -> tuple[threading.Thread, list[int]]:
    """A long generation in the one slot, running by the time this returns."""
    statuses: list[int] = []
    thread = threading.Thread(target=lambda: statuses.append(post(daemon, LONG)[0]))
    thread.start()
    deadline = time.monotonic() + 10
    while value(scrape(daemon), "edgellm_slots_busy", model="tiny") < 1:
        assert time.monotonic() < deadline, "the long request never took the slot"
        time.sleep(0.005)
    return thread, statuses


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_waits_past_the_timeout_is_refused_with_429(
    daemon: RunningDaemon, stream: bool
) -> None:
    thread, statuses = hold_the_slot(daemon)
    started = time.monotonic()
    status, headers, body = post(daemon, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream})
    waited = time.monotonic() - started
    thread.join(60)
    assert statuses == [200]  # the one holding the slot is served in full
    assert status == 429, body
    assert headers["Retry-After"] == "1"
    error = json.loads(body)["error"]
    assert error["code"] == "server_overloaded"
    assert error["message"] == QUEUE_TIMEOUT
    assert waited < 5  # refused near its timeout, not when the slot came free
    samples = scrape(daemon)
    labels = {"model": "tiny", "model_name": "tiny", "api": "completions"}
    assert value(samples, "edgellm_request_success_total", **labels, finished_reason="shed") == 1
    assert value(samples, "edgellm_request_slo_total", **labels, result="missed") == 1
    assert value(samples, "edgellm_slots_busy", model="tiny") == 0


def test_without_a_timeout_the_same_request_waits_its_turn(models_dir: Path) -> None:
    with running(settings_for([tiny(models_dir)], lifecycle={"watch": False})) as daemon:
        thread, statuses = hold_the_slot(daemon)
        status, headers, _ = post(daemon, {"model": "tiny", "prompt": "hi", "max_tokens": 4})
        thread.join(60)
    assert statuses == [200]
    assert status == 200
    assert int(headers["x-queue-ms"]) > 50  # it did wait, past where the other daemon refused it


@pytest.mark.parametrize("bad", [0, -1, "soon", True, float("inf")])
def test_a_bad_queue_timeout_is_refused(models_dir: Path, bad: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_for([tiny(models_dir, queue_timeout_s=bad)])
    assert any("models[0].queue_timeout_s" in p for p in caught.value.problems), caught.value.problems
