"""Per-key limits and the bounded queue, measured against a real daemon, plus the bucket arithmetic."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from edgellmctl.keys import create_key
from edgellmd.api.context import LEDGER
from edgellmd.errors import RateLimited
from edgellmd.http import appkeys
from edgellmd.http.ratelimit import RateLimiter, TokenBucket
from edgellmd.keys import ApiKey, KeyLimits
from edgellmd.settings import parse_settings
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, at_once, running

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(**limits: int) -> ApiKey:
    return ApiKey(
        id="0123456789ab",
        name="k",
        hash="sha256:" + "0" * 64,
        scopes=frozenset({"inference"}),
        limits=KeyLimits(**limits),
    )


def test_bucket_refills_evenly_over_a_minute() -> None:
    bucket = TokenBucket(60.0)
    bucket.take(60, 0.0)
    assert bucket.wait_for(1, 0.0) == pytest.approx(1.0)
    assert bucket.wait_for(1, 0.5) == pytest.approx(0.5)
    assert bucket.wait_for(1, 1.0) == 0.0
    assert bucket.reset_after(1.0) == pytest.approx(59.0)


def test_limiter_requests_per_minute_with_a_fake_clock() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    key = _key(rpm=3)
    for _ in range(3):
        limiter.admit(key)
        limiter.release(key, 0)
    with pytest.raises(RateLimited) as caught:
        limiter.admit(key)
    assert caught.value.headers["Retry-After"] == "20"
    assert limiter.headers(key)["x-ratelimit-remaining-requests"] == "0"
    assert limiter.headers(key)["x-ratelimit-reset-requests"] == "1m0s"
    clock.now += 20
    limiter.admit(key)


def test_a_prompt_is_taken_from_tokens_per_minute_when_it_is_submitted() -> None:
    """Requests admitted together (the bucket not yet in debt) each take their prompt as they
    are submitted: the next sees it, and is refused while the bucket holds less than its own. At
    the end a request is charged the rest of what it used, and given back a prompt it took but
    never computed."""
    clock = FakeClock()
    limiter = RateLimiter(clock)
    key = _key(tpm=100)
    assert limiter.reserve(key, 40) is True
    assert limiter.reserve(key, 40) is True
    with pytest.raises(RateLimited) as caught:
        limiter.reserve(key, 40)  # 20 left
    assert caught.value.headers["Retry-After"] == "12"  # 20 more at 100 a minute
    limiter.release(key, 40 + 15, taken=40)  # its prompt and 15 generated: 15 more
    limiter.release(key, 0, taken=40)  # refused after all: given back
    state = limiter._states[key.id]
    assert state.tokens is not None
    assert state.tokens.level == pytest.approx(45)  # 100 - 40 - 15, the refused prompt back
    # A prompt larger than a minute's allowance waits for a full bucket, then goes into debt.
    clock.now += 60
    assert limiter.reserve(key, 250) is True
    assert state.tokens.level == pytest.approx(-150)
    limiter.release(key, 0, taken=250)  # given back: never above the capacity
    assert state.tokens.level == pytest.approx(100)
    assert limiter.reserve(_key(), 40) is False  # no tokens per minute: nothing taken


def test_limiter_tokens_per_minute_and_concurrency() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    key = _key(tpm=100, concurrent=1)
    limiter.admit(key)
    with pytest.raises(RateLimited, match="concurrent"):
        limiter.admit(key)
    limiter.release(key, 130)  # 30 tokens in debt
    with pytest.raises(RateLimited) as caught:
        limiter.admit(key)
    assert caught.value.headers["Retry-After"] == "18"  # 30 tokens of debt at 100/minute
    clock.now += 18
    limiter.admit(key)
    assert limiter.headers(key)["x-ratelimit-limit-tokens"] == "100"


@pytest.fixture(scope="module")
def limited(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningDaemon, dict[str, str]]]:
    root = tmp_path_factory.mktemp("limits")
    keys = root / "keys.yaml"
    tokens = {
        "rpm": create_key(keys, "rpm", ["inference"], limits={"rpm": 60})[1],
        "tpm": create_key(keys, "tpm", ["inference"], limits={"tpm": 200})[1],
        "ceiling": create_key(keys, "ceiling", ["inference"], limits={"max_tokens": 8})[1],
        "free": create_key(keys, "free", ["inference"], limits={})[1],
    }
    settings = parse_settings(
        {
            "models": [
                {
                    "name": "tiny",
                    "file": str(models_dir / "tiny.gguf"),
                    "slots": 2,
                    "context_size": 256,
                    "threads": 1,
                }
            ],
            "lock": {"allow_unsigned": True},
            "auth": {"keys_file": str(keys)},
        },
        base_dir=root,
    )
    with running(settings) as daemon:
        yield daemon, tokens


def _complete(daemon: RunningDaemon, token: str, **body: Any) -> tuple[int, Any, dict[str, str]]:
    import json  # noqa: PLC0415
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    payload = {"model": "tiny", "prompt": "x", "max_tokens": 1, **body}
    req = urllib.request.Request(  # noqa: S310
        daemon.url + "/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read()), dict(exc.headers)


def test_a_60_rpm_burst_gets_its_bucket_then_429s(limited: tuple[RunningDaemon, dict[str, str]]) -> None:
    daemon, tokens = limited
    results = [_complete(daemon, tokens["rpm"]) for _ in range(100)]
    statuses = [s for s, _, _ in results]
    ok = statuses.count(200)
    # The bucket holds 60; the burst takes a couple of seconds, which refills one or two more.
    assert 60 <= ok <= 64
    assert statuses[:60] == [200] * 60
    refused = [(b, h) for s, b, h in results if s == 429]
    assert len(refused) == 100 - ok
    body, headers = refused[-1]
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "rate_limit_exceeded"
    retry_after = int(headers["Retry-After"])
    assert retry_after == 1  # one request per second refills
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    ok_headers = results[0][2]
    assert ok_headers["x-ratelimit-limit-requests"] == "60"
    assert int(ok_headers["x-ratelimit-remaining-requests"]) >= 58
    time.sleep(retry_after)
    assert _complete(daemon, tokens["rpm"])[0] == 200


def test_tokens_per_minute(limited: tuple[RunningDaemon, dict[str, str]]) -> None:
    daemon, tokens = limited
    statuses = []
    for _ in range(12):
        status, body, headers = _complete(
            daemon, tokens["tpm"], prompt="p" * 40, max_tokens=10, ignore_eos=True
        )
        statuses.append(status)
        if status == 429:
            break
    # Each request costs 41 prompt + 10 completion tokens: a 200-token bucket serves 4 (the
    # 4th leaves it 4 tokens in debt), and the 5th is refused until the debt is paid.
    assert statuses == [200] * 4 + [429]
    assert body["error"]["code"] == "rate_limit_exceeded"
    wait = int(headers["Retry-After"])
    assert 1 <= wait <= 2  # 4 tokens of debt at 200 per minute: 1.2 s
    assert headers["x-ratelimit-limit-tokens"] == "200"
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    time.sleep(wait)
    assert _complete(daemon, tokens["tpm"], prompt="p", max_tokens=1)[0] == 200


def test_a_key_max_tokens_ceiling(limited: tuple[RunningDaemon, dict[str, str]]) -> None:
    daemon, tokens = limited
    status, body, _ = _complete(daemon, tokens["ceiling"], max_tokens=9)
    assert status == 400
    assert body["error"]["param"] == "max_tokens"
    status, body, _ = _complete(daemon, tokens["ceiling"], prompt="y", max_tokens=None, ignore_eos=True)
    assert status == 200
    # The completions default (16) is cut to the key's ceiling (8); before, 16 were generated.
    assert body["usage"]["completion_tokens"] == 8


def test_unlimited_keys_get_no_ratelimit_headers(limited: tuple[RunningDaemon, dict[str, str]]) -> None:
    daemon, tokens = limited
    status, _, headers = _complete(daemon, tokens["free"])
    assert status == 200
    assert not any(h.lower().startswith("x-ratelimit") for h in headers)


def test_the_openai_client_retries_a_429_and_succeeds(limited: tuple[RunningDaemon, dict[str, str]]) -> None:
    daemon, tokens = limited
    seen: list[tuple[float, str, int, str | None]] = []  # (when, "request"|"response", status, Retry-After)

    def on_request(request: httpx.Request) -> None:
        seen.append((time.monotonic(), "request", 0, None))

    def on_response(response: httpx.Response) -> None:
        seen.append((time.monotonic(), "response", response.status_code, response.headers.get("retry-after")))

    hooks: dict[str, list[Any]] = {"request": [on_request], "response": [on_response]}
    with openai.OpenAI(
        base_url=daemon.url + "/v1",
        api_key=tokens["rpm"],
        max_retries=3,
        http_client=openai.DefaultHttpxClient(event_hooks=hooks),
    ) as client:
        # The bucket refills a token a second: on a loaded machine the one the drain left short can
        # be back before the client's first try. Such a try proves nothing; drain and try again.
        for _ in range(5):
            time.sleep(1.2)
            while _complete(daemon, tokens["rpm"])[0] == 200:  # drain the bucket
                pass
            seen.clear()
            reply = client.completions.create(model="tiny", prompt="x", max_tokens=1)
            assert reply.usage is not None
            if seen[1][2] == 429:
                break
        else:
            pytest.fail(f"the client's first try was never refused: {seen}")
    assert [(kind, status) for _, kind, status, _ in seen][-2:] == [("request", 0), ("response", 200)]
    refused_at, _, _, retry_after = seen[1]
    assert retry_after is not None
    # The client waited as told before it tried again.
    assert seen[2][0] - refused_at >= int(retry_after) - 0.05


def test_a_full_queue_refuses_at_once(tmp_path: Path) -> None:
    model = write_tiny_model(
        tmp_path / "slow.gguf", TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)
    )
    settings = parse_settings(
        {
            "models": [
                {
                    "name": "slow",
                    "file": str(model),
                    "slots": 1,
                    "queue_size": 2,
                    "context_size": 2048,
                    "threads": 1,
                }
            ],
            "lock": {"allow_unsigned": True},
        },
        base_dir=tmp_path,
    )
    with running(settings) as daemon:
        results: dict[int, tuple[int, Any]] = {}

        def call(i: int) -> None:
            results[i] = daemon.post(
                "/v1/completions", {"model": "slow", "prompt": f"q{i}", "max_tokens": 800, "ignore_eos": True}
            )

        assert daemon.app is not None
        engine = daemon.app[appkeys.REGISTRY].get("slow").engine
        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while (engine.busy_slots, engine.queue_depth) != (1, 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (engine.busy_slots, engine.queue_depth) == (1, 2)  # one running, two waiting
        started = time.monotonic()
        status, body = daemon.post("/v1/completions", {"model": "slow", "prompt": "q3", "max_tokens": 5})
        refused_in = time.monotonic() - started
        for t in threads:
            t.join(60)
    assert status == 429
    assert body["error"]["code"] == "server_overloaded"
    assert refused_in < 0.5  # at once, not after the queue drained
    assert [results[i][0] for i in range(3)] == [200, 200, 200]
    assert all(results[i][1]["usage"]["completion_tokens"] == 800 for i in range(3))


def _burst(daemon: RunningDaemon, token: str, n: int, **body: Any) -> list[tuple[int, Any]]:
    """`n` completions sent at the same moment; their statuses and bodies."""
    return [(status, answer) for status, answer, _ in at_once(lambda: _complete(daemon, token, **body), n)]


def test_requests_arriving_together_go_past_a_token_budget_by_what_they_generate_alone(
    tmp_path: Path, models_dir: Path
) -> None:
    """Thirty requests at once from a key with a 100-token budget (a day's, or a minute's): each
    prompt counts against the budget as it is submitted, so those that pass go past it by what
    they generate, as the docs say. Before, only finished requests counted: all thirty passed,
    13.5 times the budget. Refused requests are charged nothing, and every count a request held
    comes back."""
    keys = tmp_path / "keys.yaml"
    ids, tokens = {}, {}
    for name, limits, quota in (("daily", {}, {"tokens_per_day": 100}), ("minute", {"tpm": 100}, None)):
        ids[name], tokens[name] = create_key(keys, name, ["inference"], limits=limits, quota=quota)
    settings = parse_settings(
        {
            "models": [
                {"name": "tiny", "file": str(models_dir / "tiny.gguf"), "slots": 4, "context_size": 256},
            ],
            "lock": {"allow_unsigned": True},
            "auth": {"keys_file": str(keys)},
            "ledger": {"database": str(tmp_path / "ledger.sqlite3")},
        },
        base_dir=tmp_path,
    )
    max_tokens = 20
    with running(settings) as daemon:
        assert daemon.app is not None
        for name, code in (("daily", "quota_exceeded"), ("minute", "rate_limit_exceeded")):
            results = _burst(
                daemon, tokens[name], 30, prompt="p" * 24, max_tokens=max_tokens, ignore_eos=True
            )
            passed = [body for status, body in results if status == 200]
            refused = [body for status, body in results if status == 429]
            assert len(passed) + len(refused) == 30, results
            assert {body["error"]["code"] for body in refused} == {code}
            prompt = passed[0]["usage"]["prompt_tokens"]
            charged = sum(body["usage"]["total_tokens"] for body in passed)
            # Past the budget by the last prompt let in and what the passing requests generated.
            assert charged <= 100 + prompt + len(passed) * max_tokens, (len(passed), charged)
            assert len(passed) <= 100 // prompt + 1
            ledger = daemon.app[LEDGER]
            assert ledger.used(ids[name])["requests_day"] == len(passed)  # the refused: nothing
            assert ids[name] not in ledger._reserved
            state = daemon.app[appkeys.RATE_LIMITER]._states[ids[name]]
            assert state.in_flight == 0
