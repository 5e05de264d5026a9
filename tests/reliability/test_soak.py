"""Soak: steady load for 2 minutes (10 in the full run) grows no memory, descriptors, threads or /dev/shm."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.harness import (
    STEADY_SPEC,
    DaemonProcess,
    Figures,
    Load,
    SignedBox,
    Usage,
    bound,
    chat,
    completion,
    describe,
    duration,
    failures,
    full_run,
    median,
    tokens_between,
)
from tests.serving import free_port

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

CLIENTS = 6  # four slots busy and two requests waiting, all the time
MAX_TOKENS = 32
SCRAPE_EVERY_S = 5.0  # /metrics and /admin/status, as Prometheus and an operator would


def _request(client: int, number: int) -> tuple[str, dict[str, Any]]:
    kind = (client + number) % 4
    if kind == 0:
        return completion(MAX_TOKENS, stream=True)
    if kind == 1:
        return completion(MAX_TOKENS)
    if kind == 2:
        return chat(MAX_TOKENS, stream=True)
    return chat(MAX_TOKENS)


def test_soak_grows_nothing_and_keeps_its_pace(box: SignedBox, shm_root: Path, figures: Figures) -> None:
    total_s = duration(120, 600)
    warm_up_s = duration(20, 60)
    window_s = duration(5, 10)
    sample_s = duration(1, 2)
    box.publish(box.model_bytes(STEADY_SPEC))
    config = box.config(free_port(), lifecycle={"preload_dir": str(shm_root)})
    samples: list[Usage] = []
    with DaemonProcess(box, config) as daemon:
        daemon.start()
        with Load(daemon.url, box.app_token, CLIENTS, _request) as load:
            start = load.started_at
            next_scrape = start
            while time.monotonic() < start + total_s:
                samples.append(daemon.usage())
                if time.monotonic() >= next_scrape:
                    assert daemon.get("/metrics").status == 401  # no key: refused
                    assert daemon.metric("edgellm_slots_total") == 4
                    daemon.status()
                    next_scrape += SCRAPE_EVERY_S
                time.sleep(sample_s)
        answers = load.answers
        end_usage = daemon.usage()
        after = daemon.model()
        errors = daemon.errors()

    measured = [s for s in samples if s.at >= start + warm_up_s]
    k = max(5, len(measured) // 6)  # the first and the last sixth of the measured time
    first, last = measured[:k], measured[-k:]
    rss_growth = median([s.rss for s in last]) / median([s.rss for s in first]) - 1
    # Tokens per second in windows of whole sampling intervals; the first third's median
    # against the last third's.
    edges = measured[:: max(1, round(window_s / sample_s))]
    windows = list(itertools.pairwise(edges))
    rates = [tokens_between(answers, a.at, b.at) / (b.at - a.at) for a, b in windows]
    # The daemon's own pace: tokens per second of CPU it used. Unlike the wall-clock rate it
    # leaves out time the daemon did not run (other tenants' share of the cores, steal), but
    # not their slowdown through shared caches (see REPORT.md); a daemon that slows itself
    # down (work growing with what it has served) needs more CPU per token either way.
    paces = [tokens_between(answers, a.at, b.at) / max(b.cpu_s - a.cpu_s, 1e-3) for a, b in windows]
    third = max(1, len(rates) // 3)
    rate_first, rate_last = median(rates[:third]), median(rates[-third:])
    drift = rate_last / rate_first - 1
    pace_first, pace_last = median(paces[:third]), median(paces[-third:])
    pace_drift = pace_last / pace_first - 1
    rate_bound = 0.5
    pace_bound = bound(0.25, 0.10)
    # CI shares its machine with other jobs: there a pace that rises came from neighbours
    # going quiet (one CI soak: +37% in two minutes), while a daemon whose work grows with
    # what it has served can only slow down. So CI fails a slowdown only; the full run holds
    # the "stable within 10%" both ways.
    both_ways = full_run()
    sides = "either way" if both_ways else "slowdown only"

    def steady(change: float, limit: float) -> bool:
        return abs(change) <= limit if both_ways else change >= -limit

    bad = failures(answers)
    # Descriptors and threads: medians, as a scrape's connection may be open at any one sample.
    fds = (median([s.fds for s in first]), median([s.fds for s in last]))
    threads = (median([s.threads for s in first]), median([s.threads for s in last]))

    figures["duration_s / warm-up_s / window_s"] = (total_s, warm_up_s, window_s)
    figures["requests / failed"] = (len(answers), len(bad))
    figures["RSS MiB after warm-up -> end"] = (
        median([s.rss for s in first]) / 2**20,
        median([s.rss for s in last]) / 2**20,
    )
    figures["RSS growth (bound 5%)"] = f"{rss_growth:+.2%}"
    figures["fds after warm-up -> end (medians; max)"] = (*fds, max(s.fds for s in measured))
    figures["threads after warm-up -> end (medians; max)"] = (*threads, max(s.threads for s in measured))
    figures["/dev/shm bytes, files: min..max while measured"] = (
        min(s.shm_bytes for s in measured),
        max(s.shm_bytes for s in measured),
        min(s.shm_files for s in measured),
        max(s.shm_files for s in measured),
    )
    figures["tokens/s per window"] = [round(r) for r in rates]
    figures["tokens/s first third -> last third"] = (rate_first, rate_last)
    figures["tokens/s drift (bound)"] = f"{drift:+.1%} ({rate_bound:.0%}, {sides})"
    figures["tokens per CPU-second per window"] = [round(p) for p in paces]
    figures["tokens per CPU-second first third -> last third"] = (pace_first, pace_last)
    figures["tokens per CPU-second drift (bound)"] = f"{pace_drift:+.1%} ({pace_bound:.0%}, {sides})"
    figures.show()

    assert bad == [], describe(bad)
    assert all(a.tokens == MAX_TOKENS for a in answers)
    assert rss_growth < 0.05
    assert fds[1] <= fds[0]
    assert threads[1] <= threads[0]
    # The preload area holds the one copy, byte for byte the same all along.
    assert {(s.shm_bytes, s.shm_files) for s in measured} == {(len(box.model_bytes(STEADY_SPEC)), 2)}
    assert end_usage.shm_bytes == len(box.model_bytes(STEADY_SPEC))
    assert steady(pace_drift, pace_bound), f"pace drift {pace_drift:+.1%}"
    assert steady(drift, rate_bound), f"tokens/s drift {drift:+.1%}"
    assert min(rates) > 0  # never stalled for a whole window
    assert (after["slots_busy"], after["queue_depth"], after["leases"]) == (0, 0, 0)
    assert errors == []
