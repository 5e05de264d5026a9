"""Prometheus metrics: request counters and latency histograms, plus gauges read at scrape time.

Names follow Prometheus conventions under `edgellm_`. The alert rules and the dashboard in
ops/monitoring/ use these names: any change here must be reflected there (their tests check
every name they use against the exposition).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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
# A GPU box answers its first token in tens of milliseconds, a CPU box under load in seconds.
TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
ITL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
QUEUE_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Tokens per request, prompt or generated: powers of two up to the longest context served.
TOKEN_BUCKETS: Final = tuple(float(2**i) for i in range(18))
# models.registry.ModelState's values (host sits below models: it cannot import them).
STATES: Final = ("loading", "ready", "restarting", "failed", "unloaded", "revoked")
# vLLM names its model label `model_name`; the families a vLLM dashboard reads carry it beside
# `model` (the same value), so that such a dashboard needs only the prefix changed.
MODEL_LABELS: Final = ("model", "model_name")
REQUEST_LABELS: Final = (*MODEL_LABELS, "api")


class TokenTiming:
    """Time to first token and inter-token gaps of one generation (a few float ops per event).

    Times are `time.monotonic()`: the timing starts at admission (the generation's submission
    to its engine, after tokenizing and grammar compilation, before any wait for a slot);
    `arrived` is when the request's first byte was read, for the time to first token the
    client sees.
    """

    __slots__ = (
        "_arrived",
        "_counter",
        "_first",
        "_itl",
        "_last",
        "_start",
        "_tokens",
        "_ttft",
        "_ttft_arrival",
        "first_at",
    )

    def __init__(
        self, ttft: Any, ttft_arrival: Any, itl: Any, arrived: float | None = None, counter: Any = None
    ) -> None:
        self._ttft, self._ttft_arrival, self._itl = ttft, ttft_arrival, itl
        self._counter = counter  # generated tokens, counted as they stream (not when the request ends)
        self._start = self._last = time.monotonic()
        self._arrived = arrived
        self._tokens = 0
        self._first = True
        self.first_at: float | None = None  # when the first token came

    @property
    def seen(self) -> int:
        """Tokens its events have shown so far: what a generation cut before its end produced."""
        return self._tokens

    def settle(self, total: int) -> None:
        """The generation ended with `total` tokens: count those no event has shown yet (the
        last event's, read after this; a client gone before the end), and no more after."""
        if self._counter is not None and total > self._tokens:
            self._counter.inc(total - self._tokens)
        self._counter = None

    def tokens(self, total: int) -> None:
        """The generation has produced `total` tokens so far."""
        if total <= self._tokens:
            return
        if self._counter is not None:
            self._counter.inc(total - self._tokens)
        now = time.monotonic()
        if self._first:
            self._ttft.observe(now - self._start)
            self._ttft_arrival.observe(now - (self._start if self._arrived is None else self._arrived))
            self._first = False
            self.first_at = now
        else:
            # Events can carry several tokens (a busy loop catching up): spread the gap.
            gap = (now - self._last) / (total - self._tokens)
            for _ in range(total - self._tokens):
                self._itl.observe(gap)
        self._tokens, self._last = total, now


# The finishes of a choice that was served whole (`edgellm_request_success_total`'s
# `finished_reason`): only these can meet the SLO.
SERVED_REASONS: Final = frozenset({"stop", "length"})


@dataclass(frozen=True, slots=True)
class ChoiceFigures:
    """How one choice of a finished request went, for the per-request histograms."""

    queue_s: float  # waited for a slot
    completion_tokens: int
    finish_reason: str
    first_at: float | None  # monotonic: its first token (None: it produced none)


@dataclass(frozen=True, slots=True)
class Slo:
    """The service level goodput counts against (settings `telemetry.slo_*`)."""

    ttft_s: float = 2.0
    tokens_per_s: float = 5.0

    def met(self, arrived: float, ended: float, choice: ChoiceFigures) -> bool:
        """Finished whole (stop or length: not an error, shed, cancelled or cut short), its first
        token within `ttft_s` of the arrival, and the rest at `tokens_per_s` or faster until the
        request `ended` (a choice's own last token is not timed apart from its end)."""
        if choice.finish_reason not in SERVED_REASONS:  # fast tokens then an error are no goodput
            return False
        if choice.first_at is None or choice.first_at - arrived > self.ttft_s:
            return False
        after_first = choice.completion_tokens - 1
        decode = ended - choice.first_at
        return after_first <= 0 or decode <= 0 or after_first / decode >= self.tokens_per_s


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
        self.ttft_admission = Histogram(
            "edgellm_time_to_first_token_from_admission_seconds",
            "Time from admission (submission to the engine, after tokenizing and grammar "
            "compilation) to the first generated token: slot wait and prefill",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "edgellm_time_to_first_token_seconds",
            "Time from the request's arrival to its first generated token: all it waited included",
            MODEL_LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "edgellm_inter_token_latency_seconds",
            "Time between generated tokens",
            MODEL_LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "edgellm_request_queue_time_seconds",
            "Time a request waited for a slot (its longest-waiting choice)",
            REQUEST_LABELS,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "edgellm_request_prefill_time_seconds",
            "Time from a request's slot to its first token (its last choice to start)",
            REQUEST_LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "edgellm_request_decode_time_seconds",
            "Time from a request's first token to its last",
            REQUEST_LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "edgellm_e2e_request_latency_seconds",
            "Time from a generation request's arrival to its last token",
            REQUEST_LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "edgellm_request_prompt_tokens",
            "Prompt tokens per generation request",
            REQUEST_LABELS,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "edgellm_request_generation_tokens",
            "Tokens generated per request, every choice counted",
            REQUEST_LABELS,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "edgellm_request_success",
            "Choices finished, by finish reason (stop, length, tool_calls, error ...)",
            [*REQUEST_LABELS, "finished_reason"],
            registry=r,
        )
        self.slo_requests = Counter(
            "edgellm_request_slo",
            "Generation requests by whether each of their choices met the SLO (telemetry.slo_ttft_s "
            "from arrival to first token, telemetry.slo_tokens_per_s after it): the rate of "
            'result="met" is goodput',
            [*REQUEST_LABELS, "result"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "edgellm_prompt_tokens",
            "Prompt tokens of requests, once per request (usage)",
            MODEL_LABELS,
            registry=r,
        )
        self.completion_tokens = Counter(
            "edgellm_completion_tokens", "Tokens generated", MODEL_LABELS, registry=r
        )
        build = Gauge("edgellm_build_info", "The daemon's version", ["version"], registry=r)
        build.labels(__version__).set(1)
        # Trace exports by result (host.traces), read at scrape time; none while tracing is off.
        self.trace_exports: Callable[[], Mapping[str, int]] = dict
        r.register(_TraceExports(self))

    def timing(self, model: str, arrived: float | None = None) -> TokenTiming:
        """A per-generation timer feeding the TTFT and inter-token histograms of `model`, and
        its generated-tokens counter as the tokens stream (`settle` adds what no event showed)."""
        return TokenTiming(
            self.ttft_admission.labels(model),
            self.ttft.labels(model, model),
            self.itl.labels(model, model),
            arrived,
            self.completion_tokens.labels(model, model),
        )

    def request_done(
        self,
        model: str,
        api: str,
        *,
        arrived: float,
        admitted: float,
        prompt_tokens: int,
        choices: Sequence[ChoiceFigures],
        slo: Slo,
    ) -> bool:
        """Observe a generation request that just ended (every choice finished, or it failed, or
        its client left); True when it met the SLO."""
        labels = (model, model, api)
        now = time.monotonic()
        self.e2e.labels(*labels).observe(now - arrived)
        self.request_prompt_tokens.labels(*labels).observe(prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(sum(c.completion_tokens for c in choices))
        if choices:
            self.queue_time.labels(*labels).observe(max(c.queue_s for c in choices))
        started = [c for c in choices if c.first_at is not None]
        if started:
            last = max(started, key=lambda c: c.first_at or 0.0)
            first_at = last.first_at or 0.0
            self.prefill_time.labels(*labels).observe(max(0.0, first_at - admitted - last.queue_s))
            self.decode_time.labels(*labels).observe(max(0.0, now - first_at))
        for c in choices:
            self.request_success.labels(*labels, c.finish_reason).inc()
        met = bool(choices) and all(slo.met(arrived, now, c) for c in choices)
        self.slo_requests.labels(*labels, "met" if met else "missed").inc()
        return met

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
    def fair_admissions(self) -> Mapping[str, int]:
        """Requests let in past the queue bound for a key below its fair share, by model."""

    @property
    def engine_restarts(self) -> Mapping[tuple[str, str], int]:
        """Engines that stopped by themselves, by (model, reason: crash, hang, exit or the signal)."""


class _TraceExports(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "edgellm_trace_exports",
            "OTLP trace exports by result (success, failure); failed batches are dropped",
            labels=["result"],
        )
        counts = self._metrics.trace_exports()
        for result in ("success", "failure"):
            family.add_metric([result], counts.get(result, 0))
        yield family


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
        # vLLM's names for the same two figures, with its label beside ours.
        running = GaugeMetricFamily(
            "edgellm_num_requests_running", "Sequences generating now (slots_busy)", labels=MODEL_LABELS
        )
        waiting = GaugeMetricFamily(
            "edgellm_num_requests_waiting", "Sequences waiting for a slot (queue_depth)", labels=MODEL_LABELS
        )
        # The daemon's own RSS (process_resident_memory_bytes) holds no model: each engine
        # process's is here, so a memory alert sees where the memory is.
        engine_rss = GaugeMetricFamily(
            "edgellm_engine_resident_memory_bytes",
            "Resident memory of each model's engine process (isolation: process)",
            labels=["model"],
        )
        for m in status["models"]:
            name = m["name"]
            process = m.get("engine_process")
            if isinstance(process, dict):
                engine_rss.add_metric([name], process.get("rss_bytes", 0))
            running.add_metric([name, name], m.get("slots_busy", 0))
            waiting.add_metric([name, name], m.get("queue_depth", 0))
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
        yield engine_rss
        yield running
        yield waiting
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
        fair = CounterMetricFamily(
            "edgellm_fair_admissions",
            "Requests let in past slots + queue_size because their key held less than its fair "
            "share of that room (another key had filled it)",
            labels=["model"],
        )
        for model, n in sorted(self._registry.fair_admissions.items()):
            fair.add_metric([model], n)
        yield fair
        stops = CounterMetricFamily(
            "edgellm_engine_restarts",
            "Engines that stopped by themselves, by reason (crash, hang, oom, exit, the signal that "
            "ended an engine process, or restart_failed: a restart's load): each is restarted, or "
            "trips the breaker",
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
