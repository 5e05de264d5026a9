"""/metrics and /admin/stats: the exposition parses, counters move with traffic, all contract names exist."""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.host.metrics import ChoiceFigures, Metrics, Slo
from edgellmd.host.nvml import read_gpus
from edgellmd.models.registry import Registry
from tests import fakenvml
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for, small_tiny
from tests.test_monitoring_assets import CONTRACT, HISTOGRAMS

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(daemon: RunningDaemon, headers: dict[str, str] | None = None) -> Samples:
    import urllib.request  # noqa: PLC0415

    req = urllib.request.Request(daemon.url + "/metrics", headers=headers or {})  # noqa: S310
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return parse(text)


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples.get((metric, frozenset(labels.items())), 0.0)


@pytest.fixture
def daemon(models_dir: Path) -> Iterator[RunningDaemon]:
    settings = settings_for(
        [
            {
                "name": "tiny",
                "file": str(models_dir / "tiny.gguf"),
                "slots": 1,
                "queue_size": 0,
                "context_size": 256,
                "threads": 1,
            }
        ],
        lifecycle={"watch": False},
    )
    with running(settings) as d:
        yield d


def test_counters_and_histograms_move_with_requests(daemon: RunningDaemon) -> None:
    before = scrape(daemon)
    for _ in range(3):
        status, body = daemon.post(
            "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
        )
        assert status == 200, body
    assert daemon.post("/v1/completions", {"model": "nope", "prompt": "hi"})[0] == 404
    daemon.get("/no/such/path/12345")
    after = scrape(daemon)

    def delta(metric: str, **labels: str) -> float:
        return value(after, metric, **labels) - value(before, metric, **labels)

    ok = {"endpoint": "/v1/completions", "status": "200", "key_id": ""}
    assert delta("edgellm_requests_total", **ok) == 3
    assert delta("edgellm_requests_total", endpoint="/v1/completions", status="404", key_id="") == 1
    assert delta("edgellm_requests_total", endpoint="unmatched", status="404", key_id="") == 1
    assert not any("12345" in str(labels) for _, labels in after)  # raw paths never become labels
    assert delta("edgellm_request_duration_seconds_count", endpoint="/v1/completions") == 4
    assert delta("edgellm_completion_tokens_total", model="tiny", model_name="tiny") == 15
    assert delta("edgellm_prompt_tokens_total", model="tiny", model_name="tiny") >= 3
    tiny = {"model": "tiny", "model_name": "tiny"}
    per_request = {**tiny, "api": "completions"}
    assert delta("edgellm_time_to_first_token_seconds_count", **tiny) == 3
    assert delta("edgellm_time_to_first_token_from_admission_seconds_count", model="tiny") == 3
    assert delta("edgellm_inter_token_latency_seconds_count", **tiny) == 12  # 4 gaps x 3
    for histogram in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "prompt_tokens"):
        assert delta(f"edgellm_request_{histogram}_count", **per_request) == 3
    assert delta("edgellm_e2e_request_latency_seconds_count", **per_request) == 3
    assert delta("edgellm_request_generation_tokens_sum", **per_request) == 15
    # Five tokens each: all land in the bucket of 8 and above, none at 4 or below.
    assert delta("edgellm_request_generation_tokens_bucket", **per_request, le="4.0") == 0
    assert delta("edgellm_request_generation_tokens_bucket", **per_request, le="8.0") == 3
    assert delta("edgellm_request_success_total", **per_request, finished_reason="length") == 3
    assert delta("edgellm_request_slo_total", **per_request, result="met") == 3  # a tiny model, idle
    assert delta("edgellm_request_slo_total", **per_request, result="missed") == 0
    assert value(after, "edgellm_num_requests_running", **tiny) == 0
    assert value(after, "edgellm_slots_total", model="tiny") == 1
    assert value(after, "edgellm_queue_size", model="tiny") == 0
    assert value(after, "edgellm_model_state", model="tiny", state="ready") == 1
    assert value(after, "edgellm_model_state", model="tiny", state="failed") == 0
    assert value(after, "edgellm_model_info", model="tiny", version="", sha256="") == 1
    assert value(after, "edgellm_reloads_total", model="tiny", result="loaded") == 1
    assert value(after, "edgellm_process_threads") > 2
    assert value(after, "edgellm_host_memory_total_bytes") > 0


def test_queue_rejections_are_counted(daemon: RunningDaemon) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        statuses = Counter(
            f.result()[0]
            for f in concurrent.futures.as_completed(
                [pool.submit(daemon.post, "/v1/completions", body) for _ in range(6)]
            )
        )
    assert statuses[429] >= 1, statuses
    assert value(scrape(daemon), "edgellm_queue_rejections_total", model="tiny") == statuses[429]


def test_rate_limit_refusals_by_reason_and_stats_cli(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.yaml"
    _, app_key = create_key(keys, "app", ["inference"], limits={"rpm": 1})
    _, admin_key = create_key(keys, "ops", ["admin", "metrics"], limits={})
    (tmp_path / "admin.key").write_text(admin_key)
    settings = settings_for(
        [small_tiny(models_dir)],
        auth={"keys_file": str(keys)},
        lifecycle={"watch": False},
    )
    with running(settings) as daemon:
        auth = {"Authorization": f"Bearer {app_key}"}
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert daemon.post("/v1/completions", body, headers=auth)[0] == 200
        assert daemon.post("/v1/completions", body, headers=auth)[0] == 429
        samples = scrape(daemon, {"Authorization": f"Bearer {admin_key}"})
        assert value(samples, "edgellm_rate_limited_total", reason="rpm") == 1
        assert value(samples, "edgellm_rate_limited_total", reason="tpm") == 0
        key_ids = {dict(labels).get("key_id") for name, labels in samples if name == "edgellm_requests_total"}
        assert app_key not in key_ids  # ids only, never secrets
        assert edgellmctl(["stats", "--url", daemon.url, "--key-file", str(tmp_path / "admin.key")]) == 0
        out = capsys.readouterr().out
        assert "tiny" in out
        assert "rate limited: concurrency 0, rpm 1, tpm 0" in out
        assert admin_key not in out


def test_admin_stats_is_the_same_as_json(daemon: RunningDaemon) -> None:
    status, stats = daemon.get("/admin/stats")
    assert status == 200
    metrics = stats["metrics"]
    assert metrics["edgellm_slots_total"]["type"] == "gauge"
    assert metrics["edgellm_slots_total"]["samples"][0]["labels"] == {"model": "tiny"}
    assert stats["host"]["process"]["rss_bytes"] > 0
    assert stats["gpu"]["available"] is False  # no driver on this machine
    assert stats["models"]["models"][0]["name"] == "tiny"


def test_every_contract_name_is_exported_with_a_gpu(tmp_path: Path) -> None:
    # The alert rules and the dashboard are checked against CONTRACT; this checks the daemon
    # exports exactly those names (a fake H200 provides the GPU series).
    metrics = Metrics()
    registry = Registry([], ThreadPoolExecutor(1))
    snapshot = read_gpus(fakenvml.hot())
    metrics.add_state(registry, refusals=Counter, gpu=lambda: snapshot, shm=tmp_path, models_dir=tmp_path)
    metrics.requests.labels("/v1/completions", "200", "").inc()
    timing = metrics.timing("m")
    timing.tokens(1)
    timing.tokens(2)
    metrics.request_done(
        "m", "chat", arrived=0.0, admitted=0.0, prompt_tokens=3,
        choices=[ChoiceFigures(0.0, 2, "stop", timing.first_at)], slo=Slo(),
    )  # fmt: skip
    metrics.request_duration.labels("/v1/completions").observe(0.2)
    metrics.prompt_tokens.labels("m", "m").inc()
    metrics.completion_tokens.labels("m", "m").inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    exported = set()
    for family in families.values():
        for s in family.samples:
            exported.add(s.name)
    wanted: set[str] = set()
    for name in CONTRACT:
        if name in HISTOGRAMS:
            wanted |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            wanted.add(name)
    model_series = {
        "edgellm_slots_busy",
        "edgellm_slots_total",
        "edgellm_queue_depth",
        "edgellm_queue_size",
        "edgellm_model_info",
        "edgellm_model_state",
        "edgellm_reloads_total",
        "edgellm_queue_rejections_total",
        "edgellm_fair_admissions_total",
        "edgellm_num_requests_running",
        "edgellm_num_requests_waiting",
        "edgellm_engine_resident_memory_bytes",
        *(name for name in CONTRACT if "draft" in name or "prompt_cache" in name),
    }  # need a configured model: covered above
    assert wanted - exported - model_series == set()
    # And the other way round: every name the daemon exports is in the contract (a new metric
    # is declared there, where the dashboard's and the rules' checks read it).
    created = {name for name in exported if name.endswith("_created")}  # the client's own timestamps
    assert {name for name in exported - created if name.startswith("edgellm_")} - wanted == set()
    samples = parse(metrics.render().decode())
    assert value(samples, "edgellm_gpu_up", gpu="0", name="NVIDIA H200") == 1
    assert value(samples, "edgellm_gpu_memory_total_bytes", gpu="0") == 150754820096
    assert any(
        name == "edgellm_gpu_throttle_active" and dict(labels)["reason"].endswith("thermal_slowdown")
        for name, labels in samples
    )


def test_a_lost_gpu_reads_as_down(tmp_path: Path) -> None:
    metrics = Metrics()
    fake = fakenvml.gpu_lost_after(0)
    snapshot: Any = read_gpus(fake)
    metrics.add_state(
        Registry([], ThreadPoolExecutor(1)), refusals=Counter, gpu=lambda: snapshot, shm=None, models_dir=None
    )
    samples = parse(metrics.render().decode())
    # Two GPUs; the first fell off the bus.
    assert value(samples, "edgellm_gpu_up", gpu="0", name="NVIDIA H200") == 0
    assert value(samples, "edgellm_gpu_up", gpu="1", name="NVIDIA H200") == 1
    used = {dict(labels)["gpu"] for name, labels in samples if name == "edgellm_gpu_memory_used_bytes"}
    assert used == {"1"}


def test_speculation_and_prompt_cache_reach_status_and_metrics(tmp_path: Path) -> None:
    """The model's speed settings reach its engine; what they did shows in /admin/status and /metrics."""
    # Heads of 32 values: a q8_0 KV cache stores them in blocks of 32.
    model = write_tiny_model(tmp_path / "wide.gguf", TinyModelSpec(seed=2, n_embd=128, n_head=4))
    settings = settings_for(
        [
            {
                "name": "fast",
                "file": str(model),
                "slots": 1,
                "context_size": 1024,
                "threads": 1,
                "cache_type_k": "q8_0",
                "prompt_cache_mb": 32,
                "speculative": {"mode": "ngram", "max_draft": 4},
            }
        ],
        lifecycle={"watch": False},
    )
    shared = "rules of the house: " + "be brief and be right. " * 10
    with running(settings) as daemon:
        usages = []
        for prompt in (
            shared + "first: be brief and",
            "something else entirely " * 10,
            shared + "second: be brief and",
        ):
            body = {"model": "fast", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            status, reply = daemon.post("/v1/completions", body)
            assert status == 200, reply
            usages.append(reply["usage"])
        status, admin = daemon.get("/admin/status")
        assert status == 200, admin
        perf = admin["models"][0]["performance"]
        samples = scrape(daemon)
    assert perf["kv_cache"] == {"type_k": "q8_0", "type_v": "f16", "flash_attention": "auto"}
    assert perf["speculative"]["mode"] == "ngram"
    # Greedy decoding of a tiny model falls into a loop: the drafter finds n-grams to propose.
    assert perf["speculative"]["drafted_tokens"] > 0
    assert 0 <= perf["speculative"]["accepted_tokens"] <= perf["speculative"]["drafted_tokens"]
    cache = perf["prompt_cache"]
    # The third prompt starts as the first did; the slot held the second by then: a restore.
    assert cache["hits"] == 1, cache
    assert cache["restored_tokens"] >= 128
    assert 0 < cache["used_bytes"] <= 32 * 1024 * 1024
    for name, key in (
        ("edgellm_draft_tokens_total", "drafted_tokens"),
        ("edgellm_draft_accepted_tokens_total", "accepted_tokens"),
    ):
        assert value(samples, name, model="fast") == perf["speculative"][key]
    assert value(samples, "edgellm_prompt_cache_hits_total", model="fast") == 1
    # Each reply says what its request got, in OpenAI's usage details.
    assert usages[2]["prompt_tokens_details"]["cached_tokens"] == cache["restored_tokens"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] < 16  # shares only the BOS and a byte or so
    details = [u["completion_tokens_details"] for u in usages]
    assert sum(d["accepted_prediction_tokens"] for d in details) == perf["speculative"]["accepted_tokens"]
    assert (
        sum(d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] for d in details)
        == perf["speculative"]["drafted_tokens"]
    )
    assert value(samples, "edgellm_prompt_cache_bytes", model="fast") == cache["used_bytes"]


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def bucket(samples: Samples, metric: str, le: str, **labels: str) -> float:
    return value(samples, f"{metric}_bucket", **labels, le=le)


@pytest.mark.parametrize(("slo_tokens_per_s", "met"), [(4.9, True), (5.1, False)])
def test_a_request_of_known_timing_lands_in_the_right_buckets(
    monkeypatch: pytest.MonkeyPatch, slo_tokens_per_s: float, met: bool
) -> None:
    clock = Clock(100.3)  # admitted 0.3 s after its arrival at 100.0
    monkeypatch.setattr("edgellmd.host.metrics.time.monotonic", clock)
    metrics = Metrics()
    timing = metrics.timing("m", arrived=100.0)
    clock.now = 100.8  # first token: 0.8 s from arrival, 0.5 s from admission
    timing.tokens(1)
    clock.now = 103.0  # 11 more tokens in 2.2 s: 5 tokens/s
    timing.tokens(12)
    choice = ChoiceFigures(queue_s=0.2, completion_tokens=12, finish_reason="stop", first_at=timing.first_at)
    slo = Slo(ttft_s=1.0, tokens_per_s=slo_tokens_per_s)
    done = metrics.request_done(
        "m", "messages", arrived=100.0, admitted=100.3, prompt_tokens=40, choices=[choice], slo=slo
    )
    assert done is met
    samples = parse(metrics.render().decode())
    labels = {"model": "m", "model_name": "m"}
    request = {**labels, "api": "messages"}
    for metric, series, below, at in (
        ("edgellm_time_to_first_token_seconds", labels, "0.5", "1.0"),  # 0.8
        ("edgellm_request_queue_time_seconds", request, "0.1", "0.25"),  # 0.2
        ("edgellm_request_prefill_time_seconds", request, "0.25", "0.5"),  # 0.8 - 0.3 - 0.2 = 0.3
        ("edgellm_request_decode_time_seconds", request, "1.0", "2.5"),  # 2.2
        ("edgellm_e2e_request_latency_seconds", request, "2.5", "5.0"),  # 3.0
        ("edgellm_request_prompt_tokens", request, "32.0", "64.0"),  # 40
        ("edgellm_request_generation_tokens", request, "8.0", "16.0"),  # 12
    ):
        assert bucket(samples, metric, below, **series) == 0, metric
        assert bucket(samples, metric, at, **series) == 1, metric
    assert bucket(samples, "edgellm_time_to_first_token_from_admission_seconds", "0.5", model="m") == 1
    assert bucket(samples, "edgellm_time_to_first_token_from_admission_seconds", "0.25", model="m") == 0
    # 2.2 s spread over the 11 tokens one event carried: 0.2 s each.
    assert bucket(samples, "edgellm_inter_token_latency_seconds", "0.5", **labels) == 11
    assert bucket(samples, "edgellm_inter_token_latency_seconds", "0.1", **labels) == 0
    assert value(samples, "edgellm_request_success_total", **request, finished_reason="stop") == 1
    result = "met" if met else "missed"
    assert value(samples, "edgellm_request_slo_total", **request, result=result) == 1


@pytest.mark.parametrize(
    ("choice", "met"),
    [
        (ChoiceFigures(0.0, 1, "stop", 101.0), True),  # one token: its first decides
        (ChoiceFigures(0.0, 5, "stop", 101.01), False),  # the first token a shade late
        (ChoiceFigures(0.0, 0, "error", None), False),  # never started
        (ChoiceFigures(0.0, 1, "length", 101.0), True),  # cut at max_tokens: served whole
        # Fast tokens, then its engine died, its client left, or the drain cut it: served in
        # part, no goodput (all were counted met).
        (ChoiceFigures(0.0, 1, "error", 101.0), False),
        (ChoiceFigures(0.0, 1, "cancelled", 101.0), False),
        (ChoiceFigures(0.0, 1, "abort", 101.0), False),
    ],
)
def test_slo_of_one_choice(choice: ChoiceFigures, met: bool) -> None:
    assert Slo(ttft_s=1.0, tokens_per_s=5.0).met(100.0, 101.5, choice) is met


def test_the_configured_slo_decides_what_is_counted_met(models_dir: Path) -> None:
    model = {
        "name": "tiny",
        "file": str(models_dir / "tiny.gguf"),
        "slots": 1,
        "context_size": 256,
        "threads": 1,
    }
    settings = settings_for([model], lifecycle={"watch": False}, telemetry={"slo_ttft_s": 0.000001})
    with running(settings) as daemon:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert daemon.post("/v1/chat/completions", body)[0] == 200
        samples = scrape(daemon)
    request = {"model": "tiny", "model_name": "tiny", "api": "chat"}
    assert value(samples, "edgellm_request_slo_total", **request, result="missed") == 1  # no box is that fast
    assert value(samples, "edgellm_request_slo_total", **request, result="met") == 0


def test_generated_tokens_are_counted_as_they_stream_and_once() -> None:
    metrics = Metrics()
    timing = metrics.timing("m")

    def counted() -> float:
        return value(
            parse(metrics.render().decode()), "edgellm_completion_tokens_total", model="m", model_name="m"
        )

    timing.tokens(3)
    assert counted() == 3  # before the request ends: a live chart moves with the stream
    timing.tokens(3)  # the same total again counts nothing
    timing.tokens(7)
    assert counted() == 7
    timing.settle(9)  # the end: two tokens no event showed yet
    assert counted() == 9
    timing.tokens(9)  # the last event, read after the end was counted
    timing.settle(9)
    assert counted() == 9
