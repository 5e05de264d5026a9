"""Fair share between keys on the daemon: a key's weight and class in the keys file, the class a
request asks for (`service_tier`, never above its key's), `n` against the key's concurrency,
and how long an answer waited (`x-queue-ms`, /admin/status)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from edgellmctl.__main__ import main as ctl
from edgellmctl.keys import create_key
from edgellmd.keys import KeysFileError, read_keys_file
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for, wait_for
from tests.test_host_metrics import scrape, value

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

SLOW = TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)
LONG = 500  # tokens of the batch key's job: far longer than the short requests


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weight", 0),
        ("weight", 1001),
        ("weight", True),
        ("weight", "2"),
        ("priority", "urgent"),
        ("priority", 1),
    ],
)
def test_weight_and_priority_must_be_what_the_keys_file_documents(
    tmp_path: Path, field: str, value: Any
) -> None:
    keys = tmp_path / "keys.yaml"
    create_key(keys, "k", ["inference"], limits={})
    data = yaml.safe_load(keys.read_text())
    data["keys"][0][field] = value
    keys.write_text(yaml.safe_dump(data))
    with pytest.raises(KeysFileError, match=rf"keys\[0\]\.{field}"):
        read_keys_file(keys)


def test_edgellmctl_creates_a_weighted_batch_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.yaml"
    assert ctl(["keys", "create", "--file", str(keys), "--name", "etl", "--scope", "inference",
                "--weight", "5", "--priority", "batch"]) == 0  # fmt: skip
    (key,) = read_keys_file(keys).values()
    assert (key.weight, key.priority) == (5, "batch")
    with pytest.raises(SystemExit):
        ctl(
            ["keys", "create", "--file", str(keys), "--name", "x", "--scope", "inference", "--weight", "1001"]
        )
    with pytest.raises(SystemExit):
        ctl(
            [
                "keys",
                "create",
                "--file",
                str(keys),
                "--name",
                "x",
                "--scope",
                "inference",
                "--priority",
                "vip",
            ]
        )
    assert len(read_keys_file(keys)) == 1
    capsys.readouterr()


class Tenants:
    def __init__(self, tmp_path: Path) -> None:
        self.keys = tmp_path / "keys.yaml"
        _, self.bulk = create_key(self.keys, "bulk", ["inference"], limits={}, priority="batch")
        _, self.bulk2 = create_key(self.keys, "bulk2", ["inference"], limits={}, priority="batch")
        _, self.app = create_key(self.keys, "app", ["inference"], limits={}, priority="interactive")
        _, self.pair = create_key(self.keys, "pair", ["inference"], limits={"concurrent": 2})
        _, self.admin = create_key(self.keys, "ops", ["admin"], limits={})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp_path = tmp_path_factory.mktemp("share")
    model = write_tiny_model(tmp_path / "m.gguf", SLOW)
    tenants = Tenants(tmp_path)
    model_settings = {"name": "m", "file": str(model), "threads": 1, "slots": 1, "context_size": 1024}
    settings = settings_for([model_settings], auth={"keys_file": str(tenants.keys)})
    with running(settings) as daemon:
        yield daemon, tenants


def _client(daemon: RunningDaemon, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0, timeout=60)


def _long_job(daemon: RunningDaemon, token: str) -> tuple[threading.Thread, threading.Event, list[float]]:
    """A streamed batch job of LONG tokens; `started` is set at its first token, `ended` gets its end time."""
    started = threading.Event()
    ended: list[float] = []

    def run() -> None:
        stream = _client(daemon, token).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "a long report"}],
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            started.set()
        ended.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    time.sleep(0.3)  # past the quantum a sequence runs before it may be paused
    return thread, started, ended


def _short(daemon: RunningDaemon, token: str, **extra: Any) -> tuple[float, int]:
    """A short non-streamed chat: when it ended, and its x-queue-ms."""
    raw = _client(daemon, token).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
    )
    assert raw.parse().usage is not None
    return time.monotonic(), int(raw.headers["x-queue-ms"])


def _fairness(daemon: RunningDaemon, admin: str) -> dict[str, Any]:
    req = urllib.request.Request(  # noqa: S310 - loopback URL
        daemon.url + "/admin/status", headers={"Authorization": f"Bearer {admin}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback URL
        status = json.loads(resp.read())
    (model,) = status["models"]
    fairness: dict[str, Any] = model["performance"]["fairness"]
    return fairness


def _pauses(daemon: RunningDaemon, admin: str) -> int:
    return int(_fairness(daemon, admin)["pauses"])


def test_an_interactive_key_goes_before_a_batch_keys_running_job(served: Any) -> None:
    daemon, t = served
    before = _pauses(daemon, t.admin)
    thread, _, ended = _long_job(daemon, t.bulk)
    done_at, queued_ms = _short(daemon, t.app)
    thread.join(60)
    assert ended
    assert done_at < ended[0]  # it did not wait for the 500-token job on the one slot
    assert queued_ms < 5000
    assert wait_for(lambda: _pauses(daemon, t.admin) > before, timeout=10)


def test_another_keys_request_stops_the_engine_processs_step_in_progress(served: Any) -> None:
    """The interactive key's request, queued while the batch job's step runs in the engine
    process, stops that step (it comes back counted in /admin/status); a request that lands
    between two steps is admitted without one, so a few are sent until one stops a step."""
    daemon, t = served
    before = int(_fairness(daemon, t.admin)["stopped_steps"])
    stopped = before
    tries = 0
    deadline = time.monotonic() + 60
    # Sent while a batch job runs, as many as it takes (six in a row once landed between steps
    # on a busy CI machine); another job when one ends first.
    while stopped == before and time.monotonic() < deadline:
        thread, _, ended = _long_job(daemon, t.bulk)
        while not ended and stopped == before and time.monotonic() < deadline:
            _short(daemon, t.app)
            tries += 1
            stopped = int(_fairness(daemon, t.admin)["stopped_steps"])
            time.sleep(0.3)  # the batch job back in its slot for a quantum
        thread.join(60)
        assert ended
    assert stopped > before, f"no step stopped in {tries} requests"


def test_a_request_may_ask_for_a_lower_class_never_a_higher_one(served: Any) -> None:
    daemon, t = served
    # The interactive key asks for flex: it is batch now and waits for the batch job's end.
    thread, _, ended = _long_job(daemon, t.bulk)
    done_at, queued_ms = _short(daemon, t.app, service_tier="flex")
    thread.join(60)
    assert ended
    assert done_at > ended[0]
    assert queued_ms > 0
    # Another batch key asks for priority: it stays batch, behind the running job.
    thread, _, ended = _long_job(daemon, t.bulk)
    done_at, _ = _short(daemon, t.bulk2, service_tier="priority")
    thread.join(60)
    assert done_at > ended[0]


def test_a_streams_headers_say_how_long_it_queued(served: Any) -> None:
    """A stream's headers wait for its first token (up to sse.STREAM_HEADERS_WAIT_S), so they carry
    `x-queue-ms` like a whole answer's: small on a free slot, the batch job's rest behind one."""
    daemon, t = served

    def streamed(**extra: Any) -> tuple[int, str, float]:
        sent = time.monotonic()
        with (
            _client(daemon, t.app) as client,
            client.chat.completions.with_streaming_response.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, **extra
            ) as raw,
        ):
            queued = int(raw.headers["x-queue-ms"])
            text = "".join(raw.iter_lines())
        return queued, text, time.monotonic() - sent

    queued, text, _ = streamed()
    assert queued < 2000
    assert text.endswith("data: [DONE]")
    thread, _, ended = _long_job(daemon, t.bulk)
    queued, text, took = streamed(service_tier="flex")  # batch now: it waits for the job's end
    thread.join(60)
    assert ended
    assert text.endswith("data: [DONE]")
    assert 0 < queued <= took * 1000
    assert queued >= 100  # it waited for a 500-token job's rest, not for nothing


def test_a_service_tier_openai_does_not_have_is_refused(served: Any) -> None:
    daemon, t = served
    status, body = daemon.post(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "service_tier": "platinum"},
        headers={"Authorization": f"Bearer {t.app}"},
    )
    assert status == 400
    assert body["error"]["param"] == "service_tier"
    status, body = daemon.post(
        "/v1/responses",
        {"model": "m", "input": "hi", "service_tier": ["flex"]},
        headers={"Authorization": f"Bearer {t.app}"},
    )
    assert status == 400
    assert body["error"]["param"] == "service_tier"


def test_n_counts_toward_the_keys_concurrency(served: Any) -> None:
    daemon, t = served
    client = _client(daemon, t.pair)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
    )
    assert len(reply.choices) == 2
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3
        )
    assert too_many.value.body["param"] == "n"  # type: ignore[index]
    # One request in flight already: n=2 would make three sequences.
    thread, _, _ = _long_job(daemon, t.pair)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
        )
    thread.join(60)
    # The places came back: two at once work again.
    assert (
        len(
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
            ).choices
        )
        == 2
    )


def _heavy_tool(i: int) -> dict[str, Any]:
    properties = {
        f"p{j}": {"type": "string", "pattern": f"^[a-z]{{1,8}}-{j}[0-9]{{2,4}}(x|y|z)+$"} for j in range(30)
    }
    return {"name": f"t{i}", "input_schema": {"type": "object", "properties": properties}}


def test_one_keys_costly_bodies_queue_behind_each_other_not_in_front_of_another_key(tmp_path: Path) -> None:
    """Key A sends eight /v1/messages bodies whose schemas cost the prompt pool a while each (and
    that its context then refuses); key B's one-token chat, sent just after, is answered sooner
    than one of A's requests takes alone: A's work takes one pool thread at a time, B gets the
    other (a pool first come, first served makes B wait for A's first four)."""
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=54))
    keys = tmp_path / "keys.yaml"
    _, alice = create_key(keys, "alice", ["inference"], limits={})
    _, bob = create_key(keys, "bob", ["inference"], limits={})
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "slots": 2, "context_size": 512}],
        auth={"keys_file": str(keys)},
    )
    hi = [{"role": "user", "content": "hi"}]
    heavy = json.dumps(
        {"model": "m", "max_tokens": 4, "messages": hi, "tools": [_heavy_tool(i) for i in range(64)]}
    )
    light = json.dumps({"model": "m", "max_tokens": 1, "messages": hi})
    with running(settings) as daemon:

        def send(token: str, data: str, path: str) -> tuple[int, float]:
            request = urllib.request.Request(  # noqa: S310 - loopback URL
                daemon.url + path,
                data=data.encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            )
            started = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            return status, time.monotonic() - started

        assert send(bob, light, "/v1/chat/completions")[0] == 200  # warm
        alone = min(send(alice, heavy, "/v1/messages")[1] for _ in range(2))
        answers: dict[str, tuple[int, float]] = {}

        def record(name: str, token: str, data: str, path: str) -> None:
            answers[name] = send(token, data, path)

        flood = [
            threading.Thread(target=record, args=(f"a{i}", alice, heavy, "/v1/messages")) for i in range(8)
        ]
        for thread in flood:
            thread.start()
        time.sleep(0.1)  # A's bodies are on the pool
        record("b", bob, light, "/v1/chat/completions")
        for thread in flood:
            thread.join(120)
    assert answers["b"][0] == 200
    assert sorted(status for name, (status, _) in answers.items() if name != "b") == [400] * 8  # too long
    assert answers["b"][1] < alone, (answers, alone)


def test_a_key_that_filled_a_models_queue_does_not_shut_another_key_out(tmp_path: Path) -> None:
    """One slot, a queue of one: key A's two long streams fill them, and A's third request is
    refused (429). Key B holds nothing there, so it is still let in past the bound (its fair
    share of the room), is answered before A's queued stream starts, and the admission is
    counted in /admin/status and /metrics. Before, B got 429 as long as A kept the queue full."""
    model = write_tiny_model(tmp_path / "m.gguf", SLOW)
    keys = tmp_path / "keys.yaml"
    _, flood = create_key(keys, "flood", ["inference"], limits={})
    _, other = create_key(keys, "other", ["inference"], limits={})
    _, admin = create_key(keys, "ops", ["admin", "metrics"], limits={})
    model_settings = {"name": "m", "file": str(model), "threads": 1, "slots": 1, "queue_size": 1}
    settings = settings_for([{**model_settings, "context_size": 1024}], auth={"keys_file": str(keys)})
    with running(settings) as daemon:

        def too_many_choices() -> None:  # more than slots + queue_size: never fits, busy or not
            with pytest.raises(openai.BadRequestError) as refused:
                _client(daemon, other).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3
                )
            assert refused.value.body["param"] == "n"  # type: ignore[index]

        too_many_choices()
        first_token: dict[int, float] = {}

        def stream(n: int) -> None:
            for _ in _client(daemon, flood).chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "a long report"}],
                max_tokens=LONG,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                first_token.setdefault(n, time.monotonic())

        jobs = [threading.Thread(target=stream, args=(n,), daemon=True) for n in range(2)]
        jobs[0].start()
        assert wait_for(lambda: 0 in first_token, timeout=30)
        jobs[1].start()
        assert wait_for(lambda: _fairness(daemon, admin)["queue"] != [], timeout=10)
        with pytest.raises(openai.RateLimitError):
            _short(daemon, flood)
        too_many_choices()
        done_at, _ = _short(daemon, other)
        # Its two choices go in together, and count as one admission.
        pair = _client(daemon, other).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
        )
        assert len(pair.choices) == 2
        for job in jobs:
            job.join(120)
        assert 1 in first_token
        assert done_at < first_token[1]  # B went ahead of A's stream that was waiting
        status = _status(daemon, admin)
        assert status["fair_admissions"] == 2
        samples = scrape(daemon, {"Authorization": f"Bearer {admin}"})
        assert value(samples, "edgellm_fair_admissions_total", model="m") == 2
        assert value(samples, "edgellm_queue_rejections_total", model="m") == 1


def _status(daemon: RunningDaemon, admin: str) -> dict[str, Any]:
    req = urllib.request.Request(  # noqa: S310 - loopback URL
        daemon.url + "/admin/status", headers={"Authorization": f"Bearer {admin}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback URL
        (model,) = json.loads(resp.read())["models"]
    return dict(model)
