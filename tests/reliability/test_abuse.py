"""Abuse: slow-loris, oversized, deep, invalid or stuffed requests are refused cleanly, sparing others."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from edgellmctl.keys import create_key
from tests.reliability import abuser
from tests.reliability.harness import (
    STEADY_SPEC,
    Answer,
    DaemonProcess,
    Figures,
    Load,
    SignedBox,
    bound,
    completion,
    describe,
    duration,
    failures,
    median,
)
from tests.serving import free_port

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
VICTIMS = 3  # fewer than the four slots: their latency is the daemon's, not a queue's
VICTIM_TOKENS = 64
ON_S = 1.0  # each kind of abuse runs a second, pauses a second, and again: the victims'
OFF_S = 1.0  # latency with and without it is compared cycle by cycle, not across minutes


def _victim(client: int, number: int) -> tuple[str, dict[str, Any]]:
    return completion(VICTIM_TOKENS, stream=(client + number) % 2 == 0)


def _abuse(kind: str, url: str, token: str, cycles: int) -> dict[str, Any]:
    """Run one abuser process (ON_S on, OFF_S off, `cycles` times); its summary."""
    argv = [
        sys.executable,
        "-m",
        "tests.reliability.abuser",
        kind,
        url,
        token,
        str(ON_S),
        str(OFF_S),
        str(cycles),
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=cycles * (ON_S + OFF_S) + 120)
    assert proc.returncode == 0, err
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary


def _within(answers: list[Answer], intervals: list[list[float]]) -> list[float]:
    """Latencies of the complete answers that ran entirely inside one of the intervals."""
    return [
        a.latency
        for a in answers
        if a.ok and any(start <= a.started and a.ended <= end for start, end in intervals)
    ]


def test_abuse_is_refused_cleanly_and_spares_other_clients(box: SignedBox, figures: Figures) -> None:
    cycles = int(duration(3, 10))
    slowdown_bound = bound(0.5, 0.2)
    _, abuser_token = create_key(box.keys_file, "abuser", ["inference"], limits={})
    box.publish(box.model_bytes(STEADY_SPEC))
    config = box.config(
        free_port(),
        server={
            "header_timeout_s": abuser.HEADER_TIMEOUT_S,
            "max_body_bytes": abuser.MAX_BODY,
            "max_tokens_limit": 512,
        },
    )
    summaries: dict[str, dict[str, Any]] = {}
    with DaemonProcess(box, config) as daemon:
        daemon.start()
        with Load(daemon.url, box.app_token, VICTIMS, _victim) as load:
            time.sleep(1.0)  # warm-up
            for kind in abuser.KINDS:
                summaries[kind] = _abuse(kind, daemon.url, abuser_token, cycles)
        answers = load.answers
        ready = daemon.get("/readyz").status
        errors = daemon.errors()
        server_5xx = daemon.metric(
            "edgellm_requests_total",
            lambda labels: labels["status"] >= "500" and labels["endpoint"] != "/readyz",
        )

    latency: dict[str, tuple[float, float, int, int]] = {}  # kind: (quiet median, abused median, n, n)
    for kind, summary in summaries.items():
        quiet, abused = _within(answers, summary["off"]), _within(answers, summary["on"])
        latency[kind] = (median(quiet), median(abused), len(quiet), len(abused))
    slowdowns = {kind: abused / quiet - 1 for kind, (quiet, abused, _, _) in latency.items()}
    bad = failures(answers)
    figures["abuse on / off s, cycles"] = (ON_S, OFF_S, cycles)
    figures["victim latency median s quiet -> abused (samples)"] = {
        kind: f"{q:.4f} -> {a:.4f} ({nq}, {na})" for kind, (q, a, nq, na) in latency.items()
    }
    figures["victim slowdown by abuse (bound)"] = (
        {k: f"{v:+.1%}" for k, v in slowdowns.items()},
        f"{slowdown_bound:.0%}",
    )
    figures["abuse sent / answers"] = {k: (s["sent"], s["statuses"]) for k, s in summaries.items()}
    figures["victim requests / failed"] = (len(answers), len(bad))
    figures.show()

    problems = {k: s["problems"] for k, s in summaries.items() if s["problems"]}
    assert problems == {}
    # The abuse did happen: at least half of the planned requests (slow-loris: connections).
    assert all(s["sent"] >= abuser.RATE_PER_S * ON_S * cycles / 2 for s in summaries.values())
    assert bad == [], describe(bad)
    assert all(n >= 10 for _, _, *counts in latency.values() for n in counts)
    assert all(v <= slowdown_bound for v in slowdowns.values()), slowdowns
    assert server_5xx == 0
    assert errors == []
    assert ready == 200


def test_stuffed_prompts_do_not_hold_up_other_clients(box: SignedBox) -> None:
    box.publish(box.model_bytes(STEADY_SPEC))
    with DaemonProcess(box, box.config(free_port())) as daemon:
        daemon.start()
        before = []
        for _ in range(5):
            started = time.monotonic()
            assert daemon.complete(max_tokens=16).status == 200
            before.append(time.monotonic() - started)
        stuffed = {"model": "m", "messages": [{"role": "user", "content": "stuff " * 25_000}]}
        statuses: list[int] = []
        stuffers = [
            threading.Thread(
                target=lambda: statuses.append(
                    daemon.call("POST", "/v1/chat/completions", stuffed, token=box.app_token).status
                )
            )
            for _ in range(2)
        ]
        for thread in stuffers:
            thread.start()
        time.sleep(0.3)  # both are being tokenized now
        started = time.monotonic()
        assert daemon.complete(max_tokens=16).status == 200
        during = time.monotonic() - started
        for thread in stuffers:
            thread.join(120)
    assert statuses == [400, 400]
    assert during < 1.2 * median(before) + 0.2, (during, median(before))
