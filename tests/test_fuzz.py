"""Fuzzing the front door (hypothesis, bounded): random bodies, headers and paths never get a 5xx."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Final

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
        "/v1/responses",
        "/v1/responses/resp_00000000000000000000000000000000",
        "/v1/messages",
        "/v1/messages/count_tokens",
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


def _check(status: int, payload: bytes, path: str = "") -> None:
    """No 5xx; a 4xx in OpenAI's envelope, or under /v1/messages in Anthropic's."""
    assert status < 500, payload[:300]
    if status >= 400:
        body: Any = json.loads(payload)
        error = body["error"]
        if path == "/v1/messages" or path.startswith("/v1/messages/"):
            assert set(body) == {"type", "error"}
            assert body["type"] == "error"
            assert set(error) == {"type", "message"}
        else:
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
    _check(*_send(daemon, "POST", path, raw, {"Content-Type": "application/json"}), path)


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
    _check(*_send(daemon, method, path, body, headers), path)


# Every Unicode category, lone surrogates included (json.dumps writes them as \\udXXX escapes,
# which is how a hostile client gets them into a parsed body).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
# JSON that travels inside a string (call arguments): well-formed, any Unicode (lone
# surrogates as escapes), nested past the body's limit, or not JSON at all.
EMBEDDED = st.one_of(
    st.just('{"a": 1}'),
    st.dictionaries(ANY_TEXT, ANY_TEXT | JSON, max_size=3).map(json.dumps),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    ANY_TEXT,
)
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
        "tool_turn": EMBEDDED,  # becomes an assistant turn's tool call and its result
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
    arguments = body.pop("tool_turn", None)
    if arguments is not None:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        body["messages"] = [
            *body.get("messages", [{"role": "user", "content": "x"}]),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    if path == "/v1/completions":
        body["prompt"] = next((m["content"] for m in body.pop("messages", [])), "x") or "x"
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    _check(*_send(daemon, "POST", path, raw, {"Content-Type": "application/json"}))


# Responses-shaped bodies: every input item type (and a few that are not), tools of every kind,
# text formats, metadata past its limits, ids of every shape; most fields well-formed, so that
# many bodies get as far as the model, one field at a time hostile.
def _or_hostile(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # one in five hostile (one_of would draw each branch alike: a weight needs a draw of its own)
    return st.sampled_from((False, False, False, False, True)).flatmap(
        lambda hostile: ANY_TEXT | JSON if hostile else valid
    )


PARTS = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "input_text", "output_text", "refusal", "input_image", "bogus"])},
    optional={"text": _or_hostile(ANY_TEXT), "refusal": ANY_TEXT},
)
MESSAGES = st.fixed_dictionaries(
    {
        "role": _or_hostile(st.sampled_from(["user", "assistant", "system", "developer"])),
        "content": _or_hostile(ANY_TEXT | st.lists(PARTS, max_size=3)),
    },
    optional={"type": st.just("message"), "id": ANY_TEXT, "status": ANY_TEXT},
)
CALL_PAIRS = st.tuples(
    ANY_TEXT | st.just("c1"), st.sampled_from(["f", "get_weather"]) | ANY_TEXT, EMBEDDED
).map(
    lambda c: [
        {"type": "function_call", "call_id": c[0], "name": c[1], "arguments": c[2]},
        {"type": "function_call_output", "call_id": c[0], "output": "ok"},
    ]
)
OTHER_ITEMS = st.fixed_dictionaries(
    {"type": st.sampled_from(["reasoning", "item_reference", "web_search_call", "mcp_call", "bogus"])},
    optional={"summary": JSON, "id": ANY_TEXT, "call_id": ANY_TEXT, "output": JSON, "arguments": JSON},
)
ITEMS = st.lists(
    st.one_of(
        MESSAGES.map(lambda m: [m]), MESSAGES.map(lambda m: [m]), CALL_PAIRS, OTHER_ITEMS.map(lambda i: [i])
    ),
    min_size=1,
    max_size=3,
).map(lambda groups: [item for group in groups for item in group])
RESPONSES_TOOLS = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                ["function", "function", "web_search", "file_search", "mcp", "custom", "x"]
            ),
            "name": st.sampled_from(["f", "get_weather"]) | ANY_TEXT,
        },
        optional={
            "parameters": _or_hostile(st.just({"type": "object", "properties": {"a": {"type": "integer"}}})),
            "strict": st.booleans() | JSON,
            "description": ANY_TEXT,
        },
    ),
    max_size=2,
)
FORMATS = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
    optional={
        "name": st.just("out") | ANY_TEXT,
        "schema": _or_hostile(st.just({"type": "object", "properties": {"a": {"type": "boolean"}}})),
        "strict": st.booleans(),
    },
)
RESPONSES_BODIES = st.fixed_dictionaries(
    {"model": _or_hostile(st.just("tiny")), "input": _or_hostile(ANY_TEXT | ITEMS)},
    optional={
        "instructions": _or_hostile(ANY_TEXT),
        "tools": _or_hostile(RESPONSES_TOOLS),
        "tool_choice": _or_hostile(
            st.sampled_from(["auto", "none", "required"])
            | st.fixed_dictionaries(
                {"type": st.sampled_from(["function", "allowed_tools"]), "name": ANY_TEXT}
            )
        ),
        "parallel_tool_calls": _or_hostile(st.booleans()),
        "text": _or_hostile(
            st.fixed_dictionaries(
                {}, optional={"format": FORMATS, "verbosity": _or_hostile(st.sampled_from(["low", "high"]))}
            )
        ),
        "metadata": _or_hostile(st.dictionaries(ANY_TEXT, ANY_TEXT, max_size=20)),
        "previous_response_id": _or_hostile(st.just("resp_" + "0" * 32)),
        "store": _or_hostile(st.booleans()),
        "stream": st.booleans(),
        "temperature": _or_hostile(st.floats(0, 2)),
        "reasoning": _or_hostile(
            st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "x"])})
        ),
        "include": _or_hostile(
            st.lists(
                st.sampled_from(["reasoning.encrypted_content", "message.output_text.logprobs"]), max_size=2
            )
        ),
        "truncation": _or_hostile(st.sampled_from(["auto", "disabled"])),
        "user": _or_hostile(ANY_TEXT),
    },
)


@FUZZ
@given(body=RESPONSES_BODIES)
def test_responses_shaped_bodies(daemon: RunningDaemon, body: dict[str, Any]) -> None:
    body["max_output_tokens"] = 2  # keep generations short
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    _check(*_send(daemon, "POST", "/v1/responses", raw, {"Content-Type": "application/json"}))


# Messages-shaped bodies (Anthropic): every content block type (and some that are not), tools
# custom and typed, every tool_choice; most fields well-formed, one at a time hostile.
ANTHROPIC_BLOCKS = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["text", "text", "tool_use", "tool_result", "thinking", "image", "document", "bogus"]
        )
    },
    optional={
        "text": _or_hostile(ANY_TEXT),
        "id": _or_hostile(st.just("toolu_1")),
        "name": _or_hostile(st.sampled_from(["get_weather", "f"])),
        "input": _or_hostile(st.just({"city": "Oslo"})),
        "tool_use_id": _or_hostile(st.just("toolu_1")),
        "content": _or_hostile(
            ANY_TEXT
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": ANY_TEXT}),
                max_size=2,
            )
        ),
        "is_error": _or_hostile(st.booleans()),
        "thinking": ANY_TEXT,
        "signature": ANY_TEXT,
        "cache_control": _or_hostile(st.just({"type": "ephemeral"})),
    },
)
ANTHROPIC_MESSAGES = st.tuples(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant"] * 4 + ["system"]),
                "content": _or_hostile(ANY_TEXT | st.lists(ANTHROPIC_BLOCKS, max_size=3)),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
).map(lambda m: [*m[0], {"role": "user", "content": "go"}] if m[1] else m[0])  # mostly a user's turn last
ANTHROPIC_TOOLS = st.lists(
    st.fixed_dictionaries(
        {"name": _or_hostile(st.sampled_from(["get_weather", "f"]))},
        optional={
            "type": st.sampled_from(["custom", "web_search_20250305", "bash_20250124", "x"]),
            "description": ANY_TEXT,
            "input_schema": _or_hostile(
                st.just({"type": "object", "properties": {"city": {"type": "string"}}})
            ),
        },
    ),
    max_size=2,
)
MESSAGES_BODIES = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tiny", "tiny", "tiny", "nope"]),
        "messages": _or_hostile(ANTHROPIC_MESSAGES),
    },
    optional={
        "system": _or_hostile(
            ANY_TEXT
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ANY_TEXT}), max_size=2)
        ),
        "tools": _or_hostile(ANTHROPIC_TOOLS),
        "tool_choice": _or_hostile(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                optional={"name": _or_hostile(st.just("get_weather")), "disable_parallel_tool_use": JSON},
            )
        ),
        "stop_sequences": _or_hostile(st.lists(ANY_TEXT, max_size=3)),
        "temperature": _or_hostile(st.floats(0, 1)),
        "top_p": _or_hostile(st.floats(0, 1)),
        "top_k": _or_hostile(st.integers(0, 100)),
        "metadata": _or_hostile(st.fixed_dictionaries({}, optional={"user_id": ANY_TEXT})),
        "stream": st.booleans(),
        "thinking": _or_hostile(
            st.sampled_from([{"type": "disabled"}, {"type": "adaptive"}, {"type": "disabled"}])
            | st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "adaptive", "x"])},
                optional={"budget_tokens": st.integers(0, 4096) | JSON},
            )
        ),
        "output_config": _or_hostile(
            st.fixed_dictionaries(
                {},
                optional={
                    "format": st.fixed_dictionaries(
                        {"type": st.sampled_from(["json_schema", "x"])},
                        optional={"schema": _or_hostile(st.just({"type": "string", "maxLength": 2}))},
                    ),
                    "effort": JSON,
                },
            )
        ),
        "service_tier": _or_hostile(st.sampled_from(["auto", "standard_only"])),
    },
)
_GENERATING: Final = ("max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k", "metadata")


@FUZZ
@given(body=MESSAGES_BODIES, path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_messages_shaped_bodies(daemon: RunningDaemon, body: dict[str, Any], path: str) -> None:
    if path == "/v1/messages":
        body["max_tokens"] = 2  # keep generations short
    else:  # count_tokens takes the body without what generates
        body = {k: v for k, v in body.items() if k not in (*_GENERATING, "service_tier")}
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    _check(*_send(daemon, "POST", path, raw, {"Content-Type": "application/json"}), path)


def test_the_daemon_is_ready_after_the_fuzzing(daemon: RunningDaemon) -> None:
    assert daemon.get("/readyz")[0] == 200
    status, body = daemon.post("/v1/completions", {"model": "tiny", "prompt": "still fine", "max_tokens": 3})
    assert status == 200
    assert body["usage"]["completion_tokens"] >= 1
