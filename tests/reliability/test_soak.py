"""Soak: steady load for 2 minutes (10 in the full run) grows no memory, descriptors, threads or /dev/shm.

Its pace is judged side by side: after the soak, the soaked daemon and a freshly started one
take the same load at the same time, and each window's tokens per CPU-second of one are
compared with the other's over the same seconds. A daemon whose work grows with what it has
served is slower than the fresh one in every window; a neighbour slowing the machine down
slows both daemons in the same window.
"""

from __future__ import annotations

import itertools
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.harness import (
    STEADY_SPEC,
    Answer,
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
RAMP_S = 1.0  # a turn's first second, while its clients connect, is not measured


@dataclass
class SideBySide:
    """Tokens per CPU-second of each daemon, window by window, and every answer they got."""

    soaked: list[float] = field(default_factory=list)
    fresh: list[float] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [s / f for s, f in zip(self.soaked, self.fresh, strict=True)]


def _pace(answers: list[Answer], before: Usage, after: Usage) -> float:
    """Tokens per CPU-second a daemon used between two of its usage samples."""
    return tokens_between(answers, before.at, after.at) / max(after.cpu_s - before.cpu_s, 1e-3)


def _turn(daemon: DaemonProcess, token: str, seconds: float) -> None:
    """The daemon under the soak's load for a while (the fresh daemon's warm-up)."""
    with Load(daemon.url, token, CLIENTS, _request) as load:
        time.sleep(RAMP_S + seconds)
        load.stop()
    assert failures(load.answers) == [], describe(failures(load.answers))


def _side_by_side(
    soaked: DaemonProcess, fresh: DaemonProcess, token: str, windows: int, seconds: float
) -> SideBySide:
    """Both daemons under the soak's load at the same time, their paces compared window by window.

    Taken in turns (soaked, fresh, fresh, soaked) the pace of one turn against the next moved
    by up to 1.76x with nothing changed but the neighbours, and four pairs' median by 15% and
    more; side by side in the same seconds, the windows' ratios of two equal daemons stayed
    within 0.76-1.08 and their median within 6% (docs/reliability.md).
    """
    _turn(fresh, token, seconds)  # the fresh daemon's first requests, first pages of the model
    with Load(soaked.url, token, CLIENTS, _request) as a, Load(fresh.url, token, CLIENTS, _request) as b:
        time.sleep(RAMP_S)
        edges = [(soaked.usage(), fresh.usage())]
        for _ in range(windows):
            time.sleep(seconds)
            edges.append((soaked.usage(), fresh.usage()))
        a.stop()
        b.stop()
    result = SideBySide(answers=a.answers + b.answers)
    for (soaked_0, fresh_0), (soaked_1, fresh_1) in itertools.pairwise(edges):
        result.soaked.append(_pace(a.answers, soaked_0, soaked_1))
        result.fresh.append(_pace(b.answers, fresh_0, fresh_1))
    return result


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
    side_windows = round(duration(12, 12))
    side_window_s = duration(2.5, 5)
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
        # The fresh daemon as the soaked one was made (its own preload area, the watch on): with
        # neither, the soaked daemon used 3-5% more CPU per request than it, alike after 350
        # requests and after 4,600 (requests sent to the two in alternation).
        fresh_shm = shm_root.with_name(f"{shm_root.name}-fresh")
        control = box.config(free_port(), lifecycle={"preload_dir": str(fresh_shm)})
        try:
            with DaemonProcess(box, control, label="fresh") as fresh:
                fresh.start()
                side = _side_by_side(daemon, fresh, box.app_token, side_windows, side_window_s)
                fresh_errors = fresh.errors()
        finally:
            shutil.rmtree(fresh_shm, ignore_errors=True)
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
    # not their slowdown through shared caches (see docs/reliability.md); a daemon that slows itself
    # down (work growing with what it has served) needs more CPU per token either way.
    paces = [tokens_between(answers, a.at, b.at) / max(b.cpu_s - a.cpu_s, 1e-3) for a, b in windows]
    third = max(1, len(rates) // 3)
    rate_first, rate_last = median(rates[:third]), median(rates[-third:])
    drift = rate_last / rate_first - 1
    pace_first, pace_last = median(paces[:third]), median(paces[-third:])
    pace_drift = pace_last / pace_first - 1
    rate_bound = 0.5
    # The pace is judged against the fresh daemon, in the same seconds: the first third against
    # the last measures the machine as much as the daemon (neighbours moved one CI soak's pace
    # by -28% and another's by +37%, everything else flat). A daemon whose work grows with what
    # it has served can only be slower than a fresh one, so the bound is one-sided.
    pace_change = median(side.ratios) - 1
    pace_bound = bound(0.15, 0.10)
    # The wall-clock rate is the daemon against itself two minutes earlier, not side by side: on
    # a shared 2-core machine it moves with the neighbours (-50.9% in one run whose growth
    # figures were flat and whose side-by-side pace held), so CI reports it and the full run,
    # on a machine chosen for it, holds it within the bound either way.
    judged = full_run()
    sides = "either way" if judged else "reported"

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
    figures["tokens per CPU-second drift (reported)"] = f"{pace_drift:+.1%}"
    figures["side by side: soaked tokens per CPU-second"] = [round(p) for p in side.soaked]
    figures["side by side: fresh tokens per CPU-second"] = [round(p) for p in side.fresh]
    figures["soaked / fresh per window"] = [round(r, 3) for r in side.ratios]
    figures["soaked against fresh, median of windows (bound)"] = (
        f"{pace_change:+.1%} ({pace_bound:.0%}, slowdown only)"
    )
    figures.show()

    assert bad == [], describe(bad)
    assert all(a.tokens == MAX_TOKENS for a in answers)
    assert rss_growth < 0.05
    assert fds[1] <= fds[0]
    assert threads[1] <= threads[0]
    # The preload area holds the one copy, byte for byte the same all along.
    assert {(s.shm_bytes, s.shm_files) for s in measured} == {(len(box.model_bytes(STEADY_SPEC)), 2)}
    assert end_usage.shm_bytes == len(box.model_bytes(STEADY_SPEC))
    assert failures(side.answers) == [], describe(failures(side.answers))
    assert pace_change >= -pace_bound, f"the soaked daemon's pace {pace_change:+.1%} against a fresh one"
    assert not judged or abs(drift) <= rate_bound, f"tokens/s drift {drift:+.1%}"
    assert min(rates) > 0  # never stalled for a whole window
    assert (after["slots_busy"], after["queue_depth"], after["leases"]) == (0, 0, 0)
    assert errors == []
    assert fresh_errors == []
