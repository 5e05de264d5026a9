"""`edgellmctl bench` against a real daemon: figures, errors by status, no key in the output."""

from __future__ import annotations

import json
import math
import socket

import pytest

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.bench import BenchConfig, RequestResult, percentile, run_bench, summarize
from tests.serving import RunningDaemon


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0], 50, 1.0),
        ([1.0, 2.0], 50, 1.5),
        ([3.0, 1.0, 2.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 95, 3.85),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_summarize_arithmetic() -> None:
    results = [
        RequestResult(ttft_s=0.1, latency_s=1.1, tokens=10),
        RequestResult(ttft_s=0.3, latency_s=2.3, tokens=30),
        RequestResult(ttft_s=None, latency_s=0.01, tokens=0, error="429 rate_limit_error"),
    ]
    s = summarize(results, wall_s=2.5)
    assert (s.requests, s.ok, s.failed, s.tokens) == (3, 2, 1, 40)
    assert s.tokens_per_s == pytest.approx(16.0)
    assert s.stream_tokens_per_s == pytest.approx((10 / 1.0 + 30 / 2.0) / 2)
    assert s.ttft_p50_s == pytest.approx(0.2)
    assert s.latency_p95_s == pytest.approx(1.1 + 0.95 * 1.2)
    assert s.errors == {"429 rate_limit_error": 1}


async def test_run_bench_counts_every_token(daemon: RunningDaemon) -> None:
    config = BenchConfig(base_url=daemon.url, model=None, concurrency=2, requests=5, max_tokens=12,
                         ignore_eos=True, prompt="bench")
    summary = await run_bench(config)
    assert (summary.ok, summary.failed) == (5, 0)
    assert summary.tokens == 5 * 12
    assert summary.tokens_per_s == pytest.approx(summary.tokens / summary.wall_s)
    assert 0 < summary.ttft_p50_s <= summary.latency_p50_s


async def test_run_bench_chat_endpoint(daemon: RunningDaemon) -> None:
    config = BenchConfig(base_url=daemon.url + "/v1", model="tiny", concurrency=1, requests=2,
                         max_tokens=6, ignore_eos=True, endpoint="chat", warmup=0)
    summary = await run_bench(config)
    assert summary.ok == 2
    assert summary.tokens == 12


async def test_errors_are_counted_by_status_and_type(daemon: RunningDaemon) -> None:
    config = BenchConfig(base_url=daemon.url, model="no-such-model", concurrency=2, requests=3,
                         max_tokens=4, warmup=0)
    summary = await run_bench(config)
    assert summary.ok == 0
    assert summary.errors == {"404 invalid_request_error": 3}


def test_cli_prints_json_and_never_the_key(daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    secret = "sk-edgellm-test-secret-value"
    rc = edgellmctl(["bench", "--url", daemon.url, "--key", secret, "-c", "2", "-n", "2", "-m", "5",
                     "--ignore-eos", "--json", "--model", "tiny"])
    out, err = capsys.readouterr()
    assert rc == 0
    figures = json.loads(out)
    assert figures["ok"] == 2
    assert figures["tokens"] == 10
    assert set(figures) >= {"tokens_per_s", "ttft_p50_s", "ttft_p95_s", "latency_p50_s",
                            "latency_p95_s", "errors", "wall_s"}
    assert secret not in out + err


def test_cli_text_report(daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    assert edgellmctl(["bench", "--url", daemon.url, "-n", "2", "-m", "4", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "aggregate" in out
    assert "TTFT p50 / p95" in out


def test_dead_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = edgellmctl(["bench", "--url", f"http://127.0.0.1:{port}", "-n", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "cannot reach" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["-c", "0"], ["-n", "-1"], ["-m", "x"], ["--url", "ftp://host"]])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    base = ["bench", "--url", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit) as exc:
        edgellmctl(base + args)
    assert exc.value.code == 2
