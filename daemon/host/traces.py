"""OpenTelemetry traces of requests, exported over OTLP/HTTP; off unless `telemetry.traces_endpoint`.

A request's span opens when the front door takes it (continuing the caller's trace when it
sends a valid `traceparent`) and closes with its answer. Its phases are not live spans: each
layer notes when a phase began and ended on the request's `RequestTrace` (a few integers),
and the children are made from those notes when the request ends, with their real start and
end times: `auth`, `prompt` (chat template and tokenizing), `grammar` (compilation), then per
choice `queue` (waiting for a slot), `prefill` (slot to first token) and `decode` (first token
to the end). So a slow request shows where its time went, and a request that is not traced
costs one `None` check per phase.

Spans carry timings, token counts, the model, the API key's id (never the key) and the request
id; prompts and outputs only with `telemetry.traces_include_text`. Export runs on the SDK's
own thread with a bounded queue (`MAX_QUEUED_SPANS`; beyond it spans are dropped, never the
request slowed); exports that fail are counted (`edgellm_trace_exports_total{result}`) and
never touch readiness.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

EXPORT_INTERVAL_S: Final = 1.0  # spans wait at most this long on the daemon before they leave
EXPORT_TIMEOUT_S: Final = 10.0  # one export's limit, on the exporter's thread
MAX_QUEUED_SPANS: Final = 4096  # beyond it, new spans are dropped until the queue drains
MAX_EXPORT_BATCH: Final = 512
MAX_TEXT_CHARS: Final = 4096  # of a prompt or an output, when text is traced at all
# The W3C trace context headers; a value past this is not one (and is ignored).
MAX_TRACEPARENT_CHARS: Final = 55
MAX_TRACESTATE_CHARS: Final = 512


def now_ns() -> int:
    """Now, in ns since the epoch: the clock phases are noted in."""
    return time.time_ns()


@dataclass(slots=True)
class Phase:
    """A phase of the request, in ns since the epoch."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestTrace:
    """A traced request: its open span and the phases noted so far."""

    span: Span
    include_text: bool
    phases: list[Phase] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    # time.monotonic() and the epoch at one instant: monotonic readings (token timings) convert.
    _mono: float = field(default_factory=time.monotonic)
    _epoch: int = field(default_factory=now_ns)

    def epoch_ns(self, monotonic: float) -> int:
        """A `time.monotonic()` reading as ns since the epoch."""
        return self._epoch + round((monotonic - self._mono) * 1e9)

    def phase(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        """Note a phase that ran from `start_ns` to `end_ns` (default: now)."""
        self.phases.append(Phase(name, start_ns, now_ns() if end_ns is None else end_ns, attributes))

    def text(self, key: str, value: str) -> None:
        """Note a prompt, if text is traced (cut to MAX_TEXT_CHARS)."""
        if self.include_text:
            self.attributes[key] = value[:MAX_TEXT_CHARS]

    def output(self, choice: int, text: str) -> None:
        """Add to choice `choice`'s output, if text is traced (up to MAX_TEXT_CHARS of it)."""
        if not self.include_text or not text:
            return
        key = "gen_ai.completion" if choice == 0 else f"gen_ai.completion.{choice}"
        held = self.attributes.get(key, "")
        if len(held) < MAX_TEXT_CHARS:
            self.attributes[key] = (held + text)[:MAX_TEXT_CHARS]


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """What the tracer needs of `telemetry` (settings sit above host)."""

    endpoint: str | None
    sample_ratio: float = 1.0
    include_text: bool = False
    service_name: str = "edgellmd"
    version: str = ""


class Tracer:
    """Makes request spans and exports them; every method is a no-op while tracing is off."""

    def __init__(self, settings: TraceSettings) -> None:
        self.settings = settings
        self.exports: Counter[str] = Counter()  # export results: success, failure
        self._lock = threading.Lock()
        self._provider: TracerProvider | None = None
        self._tracer: Any = None
        if settings.endpoint is not None:
            self._start(settings.endpoint)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def _start(self, endpoint: str) -> None:
        # Imported here: a daemon that traces nothing loads none of the SDK.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: PLC0415

        s = self.settings
        resource = Resource.create({"service.name": s.service_name, "service.version": s.version})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(s.sample_ratio)))
        inner = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        provider.add_span_processor(
            BatchSpanProcessor(
                _counting(inner, self.exports, self._lock),
                max_queue_size=MAX_QUEUED_SPANS,
                schedule_delay_millis=EXPORT_INTERVAL_S * 1000,
                max_export_batch_size=MAX_EXPORT_BATCH,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
            )
        )
        self._provider = provider
        self._tracer = provider.get_tracer("edgellmd", s.version)

    def start(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]
    ) -> RequestTrace | None:
        """Open a request's span (None when tracing is off or the request is not sampled)."""
        if self._tracer is None:
            return None
        from opentelemetry.trace import SpanKind  # noqa: PLC0415
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

        carrier = {}
        parent = headers.get("traceparent", "")
        if 0 < len(parent) <= MAX_TRACEPARENT_CHARS:
            carrier["traceparent"] = parent
            state = headers.get("tracestate", "")
            if 0 < len(state) <= MAX_TRACESTATE_CHARS:
                carrier["tracestate"] = state
        context = TraceContextTextMapPropagator().extract(carrier)  # an invalid one: a new trace
        span = self._tracer.start_span(
            name, context=context, kind=SpanKind.SERVER, attributes=dict(attributes)
        )
        if not span.is_recording():  # sampled out (by the ratio, or the caller's flags)
            span.end()
            return None
        return RequestTrace(span, self.settings.include_text)

    def finish(
        self, trace: RequestTrace | None, attributes: Mapping[str, Any], *, error: bool = False
    ) -> None:
        """Close the request's span: its phases become its children, with their own times."""
        if trace is None or self._tracer is None:
            return
        from opentelemetry.trace import Status, StatusCode, set_span_in_context  # noqa: PLC0415

        parent = set_span_in_context(trace.span)
        for phase in trace.phases:
            child = self._tracer.start_span(
                phase.name, context=parent, start_time=phase.start_ns, attributes=phase.attributes
            )
            child.end(end_time=max(phase.start_ns, phase.end_ns))
        trace.span.set_attributes({**trace.attributes, **attributes})
        if error:
            trace.span.set_status(Status(StatusCode.ERROR))
        trace.span.end()

    def shutdown(self) -> None:
        """Export what is queued and stop, within EXPORT_TIMEOUT_S in all: the SDK's own stop
        waits up to 30 s, batch after batch, and a collector that accepts and never answers held
        the daemon's stop that long (past the unit's TimeoutStopSec beside a drain). What is not
        exported by then is dropped, and said so."""
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is None:
            return
        stopping = threading.Thread(target=provider.shutdown, name="trace-shutdown", daemon=True)
        stopping.start()
        stopping.join(EXPORT_TIMEOUT_S)
        if stopping.is_alive():
            log.warning(
                "traces not exported within %.0f s of the stop were dropped (the collector did not answer)",
                EXPORT_TIMEOUT_S,
            )


def _counting(inner: SpanExporter, counts: Counter[str], lock: threading.Lock) -> SpanExporter:
    """`inner`, counting what each export reports (success or failure) in `counts`."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: PLC0415

    class Counting(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            try:
                result = inner.export(spans)
            except Exception:  # an exporter must not kill the SDK's thread
                log.warning("trace export failed", exc_info=True)
                result = SpanExportResult.FAILURE
            with lock:
                counts["success" if result == SpanExportResult.SUCCESS else "failure"] += 1
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return inner.force_flush(timeout_millis)

    return Counting()
