"""CPU lists, one CPU per physical core, pinning a real daemon process, and host figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from edgellmd.host.cpu import CpuListError, format_cpu_list, host_stats, one_per_core, parse_cpu_list
from edgellmd.settings import ConfigError, parse_settings
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import free_port


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", {0}),
        ("0-3", {0, 1, 2, 3}),
        ("0-3,8", {0, 1, 2, 3, 8}),
        ("1, 3-4", {1, 3, 4}),
        ("5-5", {5}),
    ],
)
def test_cpu_lists_parse_and_format(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "CPU list"),
        ("a", "CPU list"),
        ("1-", "CPU list"),
        ("3-1", "backwards"),
        ("9000", "beyond"),
        ("1,,2", "CPU list"),
        ("-1", "CPU list"),
    ],
)
def test_bad_cpu_lists_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(CpuListError, match=fragment):
        parse_cpu_list(text)


def test_one_logical_cpu_per_physical_core(tmp_path: Path) -> None:
    # Two cores with two hyperthreads each, numbered the usual Intel way (0/2, 1/3), and a CPU
    # without topology information.
    for cpu, siblings in [(0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")]:
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
    assert one_per_core(frozenset({0, 1, 2, 3}), tmp_path) == {0, 1}
    assert one_per_core(frozenset({2, 3}), tmp_path) == {2, 3}  # only one sibling allowed each
    assert one_per_core(frozenset({0, 2, 7}), tmp_path) == {0, 7}


@pytest.mark.parametrize(
    ("cpus", "fragment"),
    [
        ("0-x", "host.cpus: must be a CPU list"),
        ("4-2", "backwards"),
        ([0], "host.cpus: must be"),
    ],
)
def test_host_settings_are_validated(cpus: Any, fragment: str) -> None:
    data = {
        "models": [{"name": "m", "file": "m.gguf"}],
        "lock": {"allow_unsigned": True},
        "host": {"cpus": cpus},
    }
    with pytest.raises(ConfigError, match=fragment):
        parse_settings(data, base_dir=Path.cwd())


def test_host_settings_accept_auto_and_a_single_number() -> None:
    data: dict[str, Any] = {"models": [{"name": "m", "file": "m.gguf"}], "lock": {"allow_unsigned": True}}
    assert parse_settings({**data, "host": {"cpus": "AUTO"}}, base_dir=Path.cwd()).host.cpus == "auto"
    assert parse_settings({**data, "host": {"cpus": 3}}, base_dir=Path.cwd()).host.cpus == "3"


def _affinities(pid: int) -> dict[str, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        name = (task / "comm").read_text().strip()
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[f"{task.name}:{name}"] = line.split(":", 1)[1].strip()
    return out


@pytest.mark.parametrize("cpus", ["0", "auto"])
def test_a_pinned_daemon_runs_every_thread_on_its_cpus(tmp_path: Path, cpus: str) -> None:
    allowed = os.sched_getaffinity(0)
    if cpus == "0" and 0 not in allowed:
        pytest.skip("CPU 0 is not available to the tests")
    expected = {0} if cpus == "0" else one_per_core(frozenset(allowed))
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    port = free_port()
    config = {
        "server": {"port": port},
        "host": {"cpus": cpus},
        "models": [{"name": "m", "file": str(model), "slots": 1, "context_size": 128}],
        "lock": {"allow_unsigned": True},
        "lifecycle": {"preload_dir": None, "watch": False},
    }
    path = tmp_path / "edgellm.yaml"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgellmd", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        status: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/status", timeout=2) as r:
                    status = json.load(r)
                if status is not None and status["models"][0]["state"] == "ready":
                    break
            except OSError:
                pass
            time.sleep(0.05)
        assert status is not None
        model_status = status["models"][0]
        assert model_status["state"] == "ready"
        # The engine's threads follow the pinned set, not the machine.
        assert model_status["threads"] == len(expected)
        assert model_status["threads_batch"] == len(expected)
        # Every thread of the process, the engine's and the executors' included (the main
        # thread, the engine's, and at least one of the load's pool threads: how many the
        # pool started depends on how the load's steps overlapped).
        affinities = _affinities(proc.pid)
        assert len(affinities) >= 3
        assert set(affinities.values()) == {format_cpu_list(expected)}, affinities
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_host_stats_are_plausible(tmp_path: Path) -> None:
    stats = host_stats(shm=Path("/dev/shm"), models_dir=tmp_path)
    assert 0 <= stats["cpu_usage_ratio"] <= 1
    assert stats["memory_total_bytes"] >= stats["memory_used_bytes"] > 0
    assert stats["process"]["rss_bytes"] > 10 * 1024 * 1024
    assert stats["process"]["threads"] >= 1
    assert stats["process"]["open_fds"] > 2
    assert stats["models_dir"]["total_bytes"] > 0
    assert parse_cpu_list(stats["affinity"]) == os.sched_getaffinity(0)
    assert host_stats(shm=tmp_path / "missing", models_dir=None)["shm"] is None
