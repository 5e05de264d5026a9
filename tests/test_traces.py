"""OpenTelemetry traces: a real daemon exports over OTLP/HTTP to a receiver here, which decodes them."""

from __future__ import annotations

import http.server
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from edgellmctl.keys import create_key
from edgellmd.host import traces as traces_module
from edgellmd.settings import ConfigError
from tests.serving import RunningDaemon, running, settings_for, small_tiny
from tests.test_host_metrics import scrape, value

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

TRACE_ID: Final = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID: Final = "00f067aa0ba902b7"
PROMPT: Final = "the secret recipe is forty-two parsnips"
WAIT_S: Final = 20.0


@dataclass
class Received:
    """What the OTLP receiver got: every span, and every raw body."""

    spans: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    status: int = 200  # what it answers
    lock: threading.Lock = field(default_factory=threading.Lock)

    def named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name]

    def wait_for(self, name: str, count: int = 1) -> list[dict[str, Any]]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = self.named(name)
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no {count} span(s) named {name!r} within {WAIT_S} s: {self.spans}")


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@contextmanager
def receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP trace receiver on a loopback port (protobuf, as the SDK's exporter sends)."""
    got = Received()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            export = ExportTraceServiceRequest()
            export.ParseFromString(body)
            with got.lock:
                got.bodies.append(body)
                for resource in export.resource_spans:
                    service = {a.key: _value(a.value) for a in resource.resource.attributes}
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            got.spans.append(
                                {
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "span_id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(),
                                    "start": span.start_time_unix_nano,
                                    "end": span.end_time_unix_nano,
                                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                                    "error": span.status.code == 2,
                                    "service": service,
                                }
                            )
            self.send_response(got.status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", got
    finally:
        server.shutdown()
        server.server_close()


def tiny(models_dir: Path) -> dict[str, Any]:
    return small_tiny(models_dir, context_size=256)


@contextmanager
def traced(
    models_dir: Path, tmp_path: Path, **telemetry: Any
) -> Iterator[tuple[RunningDaemon, Received, str]]:
    keys = tmp_path / "keys.yaml"
    _, secret = create_key(keys, "app", ["inference", "metrics"], limits={})
    with receiver() as (url, got):
        settings = settings_for(
            [tiny(models_dir)],
            auth={"keys_file": str(keys)},
            lifecycle={"watch": False},
            telemetry={"traces_endpoint": url, **telemetry},
        )
        with running(settings) as daemon:
            yield daemon, got, secret


def chat(daemon: RunningDaemon, secret: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, **extra}
    status, answer = daemon.post(
        "/v1/chat/completions", body, headers={"Authorization": f"Bearer {secret}", **(headers or {})}
    )
    assert status == 200, answer


def test_a_request_is_one_span_with_its_phases_as_children(models_dir: Path, tmp_path: Path) -> None:
    with traced(models_dir, tmp_path) as (daemon, got, secret):
        chat(daemon, secret, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, ignore_eos=True)
        (root,) = got.wait_for("POST /v1/chat/completions")
        daemon.get("/healthz")
        scrape(daemon, {"Authorization": f"Bearer {secret}"})
        raw = b"".join(got.bodies)
    # The caller's trace goes on: same trace id, its span the parent.
    assert root["trace_id"] == TRACE_ID
    assert root["parent"] == PARENT_ID
    assert root["service"]["service.name"] == "edgellmd"
    a = root["attributes"]
    assert a["http.response.status_code"] == 200
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.operation.name"] == "chat"
    assert len(a["edgellm.key_id"]) > 0
    assert not root["error"]
    children = {s["name"]: s for s in got.spans if s["parent"] == root["span_id"]}
    assert set(children) == {"auth", "prompt", "queue", "prefill", "decode"}  # no grammar: none asked
    assert all(c["trace_id"] == TRACE_ID for c in children.values())
    for child in children.values():
        assert root["start"] <= child["start"] <= child["end"] <= root["end"], child["name"]
    # One after the other: auth, prompt, queue, prefill, decode.
    order = [children[n] for n in ("auth", "prompt", "queue", "prefill", "decode")]
    for before, after in itertools.pairwise(order):
        assert before["end"] <= after["start"] + 1_000_000, (
            before["name"],
            after["name"],
        )  # 1 ms of rounding
    assert children["queue"]["end"] == children["prefill"]["start"]
    assert children["prefill"]["end"] == children["decode"]["start"]
    assert children["prompt"]["attributes"]["gen_ai.usage.input_tokens"] > 0
    # No text unless asked for, and never the key.
    assert PROMPT.encode() not in raw
    assert secret.encode() not in raw
    # Probes and scrapes are not traced.
    assert {s["attributes"].get("http.route") for s in got.spans if s["parent"] != root["span_id"]} == {
        "/v1/chat/completions"
    }


def test_grammar_sampling_and_bad_trace_context(models_dir: Path, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with traced(models_dir, tmp_path) as (daemon, got, secret):
        unsampled = "a" * 32
        chat(
            daemon, secret, {"traceparent": f"00-{unsampled}-{PARENT_ID}-00"}
        )  # the caller says: not sampled
        chat(daemon, secret, {"traceparent": "00-zz-not-a-trace"})  # invalid: a trace of its own
        chat(
            daemon,
            secret,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        roots = got.wait_for("POST /v1/chat/completions", 2)
    assert all(r["trace_id"] != unsampled for r in roots)
    assert len({r["trace_id"] for r in roots}) == 2
    grammar = [s for s in got.spans if s["name"] == "grammar"]
    assert len(grammar) == 1
    assert grammar[0]["attributes"]["edgellm.grammars"] == 1
    assert grammar[0]["parent"] in {r["span_id"] for r in roots}


def test_text_only_when_asked_and_a_ratio_of_zero_traces_nothing_new(
    models_dir: Path, tmp_path: Path
) -> None:
    with traced(models_dir, tmp_path, traces_include_text=True) as (daemon, got, secret):
        chat(daemon, secret)
        (root,) = got.wait_for("POST /v1/chat/completions")
    assert PROMPT in root["attributes"]["gen_ai.prompt"]
    assert isinstance(root["attributes"]["gen_ai.completion"], str)
    with traced(models_dir, tmp_path / "zero", traces_sample_ratio=0) as (daemon, got, secret):
        chat(daemon, secret)
        chat(daemon, secret, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})  # the caller's choice wins
        (root,) = got.wait_for("POST /v1/chat/completions")
        time.sleep(1.5)  # past an export interval: nothing else comes
    assert root["trace_id"] == TRACE_ID
    assert len(got.named("POST /v1/chat/completions")) == 1


def test_an_export_that_fails_is_counted_and_costs_the_request_nothing(
    models_dir: Path, tmp_path: Path
) -> None:
    with traced(models_dir, tmp_path) as (daemon, got, secret):
        got.status = 400  # the collector refuses: the exporter gives the batch up at once
        chat(daemon, secret)
        deadline = time.monotonic() + WAIT_S
        failures = 0.0
        while time.monotonic() < deadline and not failures:
            failures = value(
                scrape(daemon, {"Authorization": f"Bearer {secret}"}),
                "edgellm_trace_exports_total",
                result="failure",
            )
            time.sleep(0.1)
        assert failures >= 1
        assert daemon.get("/readyz")[0] == 200  # tracing never touches readiness
        got.status = 200
        chat(daemon, secret)
        got.wait_for("POST /v1/chat/completions", 2)


@pytest.mark.parametrize(
    ("telemetry", "problem"),
    [
        ({"traces_endpoint": "ftp://collector/v1/traces"}, "telemetry.traces_endpoint"),
        ({"traces_endpoint": "http://user:pw@collector/v1/traces"}, "telemetry.traces_endpoint"),
        ({"traces_sample_ratio": 1.5}, "telemetry.traces_sample_ratio: must be a number from 0 to 1"),
        ({"traces_sample_ratio": True}, "telemetry.traces_sample_ratio"),
        ({"slo_ttft_s": 0}, "telemetry.slo_ttft_s"),
        ({"slo_tokens_per_s": float("nan")}, "telemetry.slo_tokens_per_s"),
        ({"service_name": "a b"}, "telemetry.service_name"),
    ],
)
def test_bad_telemetry_settings_are_refused(
    models_dir: Path, telemetry: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_for([tiny(models_dir)], telemetry=telemetry)
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_a_collector_that_never_answers_holds_the_stop_no_longer_than_one_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's own stop waits up to 30 s, a batch at a time: a collector that accepts and
    never answers held the daemon's stop that long, past the unit's TimeoutStopSec beside a
    drain. The tracer's stop gives up after EXPORT_TIMEOUT_S in all."""
    monkeypatch.setattr(traces_module, "EXPORT_TIMEOUT_S", 1.0)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
    try:
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"
        tracer = traces_module.Tracer(traces_module.TraceSettings(endpoint=endpoint))
        for i in range(2_000):  # a backlog of several batches
            tracer.finish(tracer.start("chat", {}, {"i": i}), {})
        started = time.monotonic()
        tracer.shutdown()
        took = time.monotonic() - started
        assert took < 3.0, took
        assert not tracer.enabled
    finally:
        silent.close()
