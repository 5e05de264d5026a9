"""Prometheus metrics: request counters and latency histograms, plus gauges read at scrape time.

Names follow Prometheus conventions under `edgellm_`. The alert rules and the dashboard in
ops/monitoring/ use these names: any change here must be reflected there (their tests check
every name they use against the exposition).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgellmd import __version__
from edgellmd.host.cpu import host_stats
from edgellmd.host.gpu import GpuSnapshot

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
# Seconds. Requests run from milliseconds (errors, embeddings) to minutes (long streams).
REQUEST_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS: Final = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
ITL_BUCKETS: Final = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
# models.registry.ModelState's values (host sits below models: it cannot import them).
STATES: Final = ("loading", "ready", "restarting", "failed", "unloaded", "revoked")


class TokenTiming:
    """Time to first token and inter-token gaps of one generation (a few float ops per event)."""

    __slots__ = ("_first", "_itl", "_last", "_start", "_tokens", "_ttft")

    def __init__(self, ttft: Any, itl: Any) -> None:
        self._ttft, self._itl = ttft, itl
        self._start = self._last = time.monotonic()
        self._tokens = 0
        self._first = True

    def tokens(self, total: int) -> None:
        """The generation has produced `total` tokens so far."""
        if total <= self._tokens:
            return
        now = time.monotonic()
        if self._first:
            self._ttft.observe(now - self._start)
            self._first = False
        else:
            # Events can carry several tokens (a busy loop catching up): spread the gap.
            gap = (now - self._last) / (total - self._tokens)
            for _ in range(total - self._tokens):
                self._itl.observe(gap)
        self._tokens, self._last = total, now


class Metrics:
    """One registry per application (no process-wide globals)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "edgellm_requests",
            "HTTP requests answered, by endpoint, status and key id",
            ["endpoint", "status", "key_id"],
            registry=r,
        )
        self.request_duration = Histogram(
            "edgellm_request_duration_seconds",
            "Time from request to the end of the answer",
            ["endpoint"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "edgellm_time_to_first_token_seconds",
            "Time from admission to the first generated token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "edgellm_inter_token_latency_seconds",
            "Time between generated tokens",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "edgellm_prompt_tokens", "Prompt tokens processed", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "edgellm_completion_tokens", "Tokens generated", ["model"], registry=r
        )
        build = Gauge("edgellm_build_info", "The daemon's version", ["version"], registry=r)
        build.labels(__version__).set(1)

    def timing(self, model: str) -> TokenTiming:
        """A per-generation timer feeding the TTFT and inter-token histograms of `model`."""
        return TokenTiming(self.ttft.labels(model), self.itl.labels(model))

    def add_state(
        self,
        registry: ModelsView,
        refusals: Callable[[], Tally[str]],
        gpu: Callable[[], GpuSnapshot | None],
        shm: Path | None,
        models_dir: Path | None,
    ) -> None:
        """Gauges and counters that are read from the daemon's state at every scrape."""
        self.registry.register(_StateCollector(registry, refusals, gpu, shm, models_dir))

    def render(self) -> bytes:
        """The text exposition."""
        return generate_latest(self.registry)

    def as_json(self) -> dict[str, Any]:
        """The same figures as JSON: {name: {type, help, samples: [{labels, value}]}}."""
        out: dict[str, Any] = {}
        for family in self.registry.collect():
            out[family.name] = {
                "type": family.type,
                "help": family.documentation,
                "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in family.samples],
            }
        return out


class ModelsView(Protocol):
    """What the metrics read of the served models (models.registry.Registry is one)."""

    def status(self) -> dict[str, Any]:
        """The admin status document: each model's state, slots and queue."""

    @property
    def reloads_by_model(self) -> Mapping[tuple[str, str], int]:
        """Loads, reloads and unloads by (model, result)."""

    @property
    def rejections(self) -> Mapping[str, int]:
        """429 server_overloaded refusals by model."""

    @property
    def engine_restarts(self) -> Mapping[tuple[str, str], int]:
        """Engines that stopped by themselves, by (model, reason: crash, hang, exit or the signal)."""


class _StateCollector(Collector):
    def __init__(
        self,
        registry: ModelsView,
        refusals: Callable[[], Tally[str]],
        gpu: Callable[[], GpuSnapshot | None],
        shm: Path | None,
        models_dir: Path | None,
    ) -> None:
        self._registry = registry
        self._refusals = refusals
        self._gpu = gpu
        self._shm = shm
        self._models_dir = models_dir

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        refused = CounterMetricFamily(
            "edgellm_rate_limited", "Requests refused by a key's rate limits", labels=["reason"]
        )
        counts = self._refusals()
        for reason in ("rpm", "tpm", "concurrency"):
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        yield from self._gpus()
        yield from self._host()

    def _models(self) -> Iterator[Metric]:
        status = self._registry.status()
        gauges = {
            name: GaugeMetricFamily(f"edgellm_{name}", text, labels=["model"])
            for name, text in (
                ("slots_busy", "Slots generating now"),
                ("slots_total", "Slots configured"),
                ("queue_depth", "Requests waiting for a slot"),
                ("queue_size", "Queue bound; beyond it 429"),
            )
        }
        info = GaugeMetricFamily(
            "edgellm_model_info", "The version each model serves", labels=["model", "version", "sha256"]
        )
        state = GaugeMetricFamily(
            "edgellm_model_state", "1 for the model's current state", labels=["model", "state"]
        )
        for m in status["models"]:
            name = m["name"]
            gauges["slots_total"].add_metric([name], m["slots_total"])
            gauges["queue_size"].add_metric([name], m["queue_size"])
            gauges["slots_busy"].add_metric([name], m.get("slots_busy", 0))
            gauges["queue_depth"].add_metric([name], m.get("queue_depth", 0))
            for s in STATES:
                state.add_metric([name, s], 1.0 if m["state"] == s else 0.0)
            if m["state"] == "ready":
                version = "" if m.get("version") is None else str(m["version"])
                info.add_metric([name, version, (m.get("sha256") or "")[:12]], 1)
        yield from gauges.values()
        yield info
        yield state
        yield from _performance(status["models"])
        reloads = CounterMetricFamily(
            "edgellm_reloads", "Loads, reloads and unloads by result", labels=["model", "result"]
        )
        for (model, result), n in sorted(self._registry.reloads_by_model.items()):
            reloads.add_metric([model, result], n)
        yield reloads
        rejected = CounterMetricFamily(
            "edgellm_queue_rejections",
            "Requests refused with 429 server_overloaded (slots busy, queue full)",
            labels=["model"],
        )
        for model, n in sorted(self._registry.rejections.items()):
            rejected.add_metric([model], n)
        yield rejected
        stops = CounterMetricFamily(
            "edgellm_engine_restarts",
            "Engines that stopped by themselves, by reason (crash, hang, exit, or the signal that "
            "ended an engine process): each is restarted, or trips the breaker",
            labels=["model", "reason"],
        )
        for (model, reason), n in sorted(self._registry.engine_restarts.items()):
            stops.add_metric([model, reason], n)
        yield stops

    def _gpus(self) -> Iterator[Metric]:
        snapshot = self._gpu()
        if snapshot is None or not snapshot.available:
            return
        up = GaugeMetricFamily(
            "edgellm_gpu_up", "1 while the GPU answers NVML, 0 once lost", labels=["gpu", "name"]
        )
        simple = {
            key: GaugeMetricFamily(f"edgellm_gpu_{key}", text, labels=["gpu"])
            for key, text in (
                ("memory_used_bytes", "GPU memory in use"),
                ("memory_total_bytes", "GPU memory"),
                ("utilization_ratio", "GPU busy share of the last sample period"),
                ("temperature_celsius", "GPU temperature"),
                ("power_watts", "GPU power draw"),
                ("power_limit_watts", "GPU enforced power limit"),
            )
        }
        throttle = GaugeMetricFamily(
            "edgellm_gpu_throttle_active", "1 while a clock-event reason is active", labels=["gpu", "reason"]
        )
        ecc = GaugeMetricFamily(
            "edgellm_gpu_ecc_volatile_errors", "ECC errors since the driver loaded", labels=["gpu", "kind"]
        )
        for gpu in snapshot.devices:
            index = str(gpu.index)
            up.add_metric([index, gpu.name or ""], 0.0 if gpu.lost else 1.0)
            if gpu.lost:
                continue
            for key, value in (
                ("memory_used_bytes", gpu.memory_used),
                ("memory_total_bytes", gpu.memory_total),
                ("utilization_ratio", None if gpu.utilization_gpu is None else gpu.utilization_gpu / 100),
                ("temperature_celsius", gpu.temperature_c),
                ("power_watts", gpu.power_w),
                ("power_limit_watts", gpu.power_limit_w),
            ):
                if value is not None:
                    simple[key].add_metric([index], float(value))
            for reason in gpu.throttle_reasons:
                throttle.add_metric([index, reason], 1.0)
            for kind, count in (
                ("corrected", gpu.ecc_volatile_corrected),
                ("uncorrected", gpu.ecc_volatile_uncorrected),
            ):
                if count is not None:
                    ecc.add_metric([index, kind], float(count))
        yield up
        yield from simple.values()
        yield throttle
        yield ecc

    def _host(self) -> Iterator[Metric]:
        stats = host_stats(shm=self._shm, models_dir=self._models_dir)
        proc = stats["process"]
        for name, text, value in (
            ("host_cpu_usage_ratio", "Host CPU busy share since the last scrape", stats["cpu_usage_ratio"]),
            ("host_load1", "Host load average over 1 minute", stats["load1"]),
            ("host_memory_used_bytes", "Host memory in use (total - available)", stats["memory_used_bytes"]),
            ("host_memory_total_bytes", "Host memory", stats["memory_total_bytes"]),
            ("process_resident_memory_bytes", "The daemon's resident memory", proc["rss_bytes"]),
            ("process_threads", "The daemon's threads", proc["threads"]),
            ("process_open_fds", "The daemon's open file descriptors", proc["open_fds"]),
        ):
            yield GaugeMetricFamily(f"edgellm_{name}", text, value=float(value))
        shm = stats["shm"]
        if shm is not None:
            yield GaugeMetricFamily("edgellm_shm_used_bytes", "Preload tmpfs in use", value=shm["used_bytes"])
            yield GaugeMetricFamily("edgellm_shm_free_bytes", "Preload tmpfs free", value=shm["free_bytes"])


_SPEED_COUNTERS: Final = (
    # (metric, help, section of a model's "performance", key)
    ("edgellm_draft_tokens", "Draft tokens checked by speculative decoding", "speculative", "drafted_tokens"),
    (
        "edgellm_draft_accepted_tokens",
        "Draft tokens the sampler agreed with",
        "speculative",
        "accepted_tokens",
    ),
    ("edgellm_prompt_cache_hits", "Prompts that restored a cached prefix", "prompt_cache", "hits"),
    ("edgellm_prompt_cache_misses", "Prompts the prompt cache had nothing for", "prompt_cache", "misses"),
    (
        "edgellm_prompt_cache_restored_tokens",
        "Prompt tokens restored, not prefilled",
        "prompt_cache",
        "restored_tokens",
    ),
    (
        "edgellm_prompt_cache_restore_seconds",
        "Time spent restoring cached prefixes",
        "prompt_cache",
        "restore_seconds",
    ),
    ("edgellm_prompt_cache_evictions", "Cached prefixes dropped for room", "prompt_cache", "evicted"),
)


def _performance(models: list[dict[str, Any]]) -> Iterator[Metric]:
    """Speculation and prompt-cache counters of each loaded model (they restart with a reload)."""
    families = {
        metric: CounterMetricFamily(metric, text, labels=["model"]) for metric, text, _, _ in _SPEED_COUNTERS
    }
    used = GaugeMetricFamily(
        "edgellm_prompt_cache_bytes", "Host RAM the prompt cache holds", labels=["model"]
    )
    for m in models:
        perf = m.get("performance")
        if not perf:
            continue
        for metric, _, section, key in _SPEED_COUNTERS:
            values = perf.get(section)
            if values is not None:
                families[metric].add_metric([m["name"]], float(values[key]))
        if perf.get("prompt_cache") is not None:
            used.add_metric([m["name"]], float(perf["prompt_cache"]["used_bytes"]))
    yield from families.values()
    yield used
