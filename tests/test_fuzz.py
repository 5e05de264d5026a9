"""Fuzzing the front door (hypothesis, bounded): random bodies, headers and paths never get a 5xx."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import RunningDaemon

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)
FIELDS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "stream",
        "stream_options",
        "n",
        "seed",
        "top_k",
        "min_p",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "response_format",
        "tools",
        "user",
    ]
)
REQUESTISH = st.dictionaries(FIELDS, JSON, max_size=8).map(lambda d: {"model": "tiny", **d})
PATHS = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/healthz",
        "/readyz",
        "/v1/",
        "/admin/status",
        "/",
        "/v1/completions/../models",
    ]
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _send(
    daemon: RunningDaemon, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, bytes]:
    req = urllib.request.Request(daemon.url + path, data=body, headers=headers, method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def _check(status: int, payload: bytes) -> None:
    assert status < 500, payload[:300]
    if status >= 400:
        body: Any = json.loads(payload)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str)
        assert error["message"]


@FUZZ
@given(body=REQUESTISH, path=PATHS)
def test_random_request_bodies(daemon: RunningDaemon, body: dict[str, Any], path: str) -> None:
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(max(body["max_tokens"], 1), 4)  # keep generations short
    else:
        body["max_tokens"] = 2
    raw = json.dumps(body).encode()
    _check(*_send(daemon, "POST", path, raw, {"Content-Type": "application/json"}))


@FUZZ
@given(
    raw=st.binary(max_size=300),
    content_type=st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1", ""]),
)
def test_random_bytes(daemon: RunningDaemon, raw: bytes, content_type: str) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    _check(*_send(daemon, "POST", "/v1/chat/completions", raw, headers))


HEADER_NAMES = st.sampled_from(
    ["X-Request-Id", "Authorization", "Accept", "X-Forwarded-For", "Content-Type", "User-Agent"]
)
HEADER_VALUES = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80)


@FUZZ
@given(
    headers=st.dictionaries(HEADER_NAMES, HEADER_VALUES, max_size=4),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=PATHS,
)
def test_random_headers_methods_and_paths(
    daemon: RunningDaemon, headers: dict[str, str], method: str, path: str
) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode() if method != "GET" else None
    _check(*_send(daemon, method, path, body, headers))


# Every Unicode category, lone surrogates included (json.dumps writes them as \\udXXX escapes,
# which is how a hostile client gets them into a parsed body).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
ODD_DIGITS = st.text(st.characters(categories=["Nd", "No", "Nl"]), min_size=1, max_size=4)
HOSTILE_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": ANY_TEXT},
                optional={"name": ANY_TEXT},
            ),
            min_size=1,
            max_size=3,
        ),
        "stop": st.lists(ANY_TEXT, max_size=3),
        "logit_bias": st.dictionaries(ODD_DIGITS | ANY_TEXT, st.integers(-100, 100), max_size=3),
        "user": ANY_TEXT,
        "model": ANY_TEXT | st.just("tiny"),
        "response_format": st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries(
                    {
                        "name": ANY_TEXT,
                        "schema": st.fixed_dictionaries(
                            {"type": st.just("object")},
                            optional={
                                "properties": st.dictionaries(
                                    ANY_TEXT,
                                    st.fixed_dictionaries(
                                        {},
                                        optional={
                                            "type": st.sampled_from(["string", "integer"]),
                                            "const": ANY_TEXT,
                                            "enum": st.lists(ANY_TEXT, min_size=1, max_size=3),
                                            "pattern": ANY_TEXT,
                                        },
                                    ),
                                    max_size=3,
                                )
                            },
                        ),
                    }
                ),
            }
        ),
    },
)


@FUZZ
@given(body=HOSTILE_FIELDS, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_bodies_with_any_unicode_and_odd_digits(
    daemon: RunningDaemon, body: dict[str, Any], path: str
) -> None:
    body = {"model": "tiny", **body, "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = next((m["content"] for m in body.pop("messages", [])), "x") or "x"
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    _check(*_send(daemon, "POST", path, raw, {"Content-Type": "application/json"}))


def test_the_daemon_is_ready_after_the_fuzzing(daemon: RunningDaemon) -> None:
    assert daemon.get("/readyz")[0] == 200
    status, body = daemon.post("/v1/completions", {"model": "tiny", "prompt": "still fine", "max_tokens": 3})
    assert status == 200
    assert body["usage"]["completion_tokens"] >= 1
