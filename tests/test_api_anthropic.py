"""Anthropic's Messages API with the official `anthropic` SDK against a real daemon with real keys.

Text and tool round trips, whole and streamed; count_tokens; stop sequences; replies cut by
max_tokens inside a tool call; thinking blocks from a reasoning model; errors in Anthropic's
shape with the statuses (and so the SDK exception classes) Anthropic uses.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import anthropic
import pytest

from edgellmctl.keys import create_key
from edgellmd.api.anthropic import encode as anthropic_answers
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for
from tests.tools import TIME_NAME, TIME_PARAMETERS, WEATHER_DESCRIPTION, WEATHER_NAME, WEATHER_PARAMETERS

# Any: the SDK's TypedDict parameters would need every literal spelled out.
WEATHER: Any = {"name": WEATHER_NAME, "description": WEATHER_DESCRIPTION, "input_schema": WEATHER_PARAMETERS}
TIME: Any = {"name": TIME_NAME, "input_schema": TIME_PARAMETERS}
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
HELLO: Any = [{"role": "user", "content": "hello"}]
GREEDY: Final = {"temperature": 0}  # not a parameter of this SDK's create(): sent as extra_body
# The chat template of the reasoning model opens the thinking itself, as DeepSeek R1's does.
THINKING_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)
# Coupled to the daemon fixture below.
MAX_TOKENS_LIMIT: Final = 2048
KEY_MAX_TOKENS: Final = 64
CONTEXT: Final = 2048


@dataclass(frozen=True)
class Served:
    daemon: RunningDaemon
    tokens: dict[str, str]  # key label -> token

    def client(self, label: str = "app", **options: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.daemon.url, api_key=self.tokens[label], max_retries=0, **options
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("anthropic")
    plain = write_tiny_model(root / "plain.gguf", TinyModelSpec(seed=71))
    thinker = write_tiny_model(root / "thinker.gguf", TinyModelSpec(seed=72, chat_template=THINKING_TEMPLATE))
    keys = root / "keys.yaml"
    made = {
        label: create_key(keys, label, scopes, limits=limits)
        for label, scopes, limits in [
            ("app", ["inference"], {}),
            ("small", ["inference"], {"max_tokens": KEY_MAX_TOKENS}),
            ("ops", ["admin"], {}),
            ("slow", ["inference"], {"rpm": 1}),
        ]
    }
    settings = settings_for(
        [
            {"name": "plain", "file": str(plain), "slots": 2, "context_size": CONTEXT, "threads": 1},
            {
                "name": "single",
                "file": str(plain),
                "slots": 1,
                "queue_size": 0,
                "context_size": CONTEXT,
                "threads": 1,
            },
            {
                "name": "thinker",
                "file": str(thinker),
                "slots": 1,
                "context_size": 1024,
                "threads": 1,
                "reasoning": "deepseek",
            },
        ],
        server={"max_tokens_limit": MAX_TOKENS_LIMIT, "max_body_bytes": 65536},
        lifecycle={"watch": False},
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        yield Served(daemon, {label: token for label, (_, token) in made.items()})


@pytest.fixture
def client(served: Served) -> Iterator[anthropic.Anthropic]:
    with served.client() as sdk:
        yield sdk


def raw_post(
    served: Served, path: str, body: Any, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    """A POST with exactly these headers (and a JSON content type): status, headers, body."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - loopback URL
        served.daemon.url + path,
        data=data,
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310 - loopback URL
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def events(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An event stream's (event name, data) pairs."""
    out = []
    for chunk in payload.decode().split("\n\n"):
        if not chunk.strip():
            continue
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def assert_anthropic_error(body: Any, kind: str) -> str:
    assert set(body) == {"type", "error"}
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    message: str = body["error"]["message"]
    assert message
    return message


# ---- text ---------------------------------------------------------------------------------------


def prompt_tokens(message: anthropic.types.Message) -> int:
    """The whole prompt of a reply, as count_tokens counts it: prefilled plus read from a cache."""
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_create_answers_a_message(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="plain", max_tokens=12, messages=HELLO, extra_body=GREEDY)
    assert message.id.startswith("msg_")
    assert len(message.id) > len("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "plain"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert prompt_tokens(message) == client.messages.count_tokens(model="plain", messages=HELLO).input_tokens
    assert 1 <= message.usage.output_tokens <= 12
    assert (message.stop_reason == "max_tokens") == (message.usage.output_tokens == 12)
    assert all(block.type == "text" for block in message.content)
    assert len(message.content) <= 1


def test_stream_helpers_give_the_same_greedy_text(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="plain", max_tokens=16, messages=HELLO, extra_body=GREEDY)
    with client.messages.stream(model="plain", max_tokens=16, messages=HELLO, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1  # token by token, not one piece at the end
    text = "".join(pieces)
    assert final.content[0].type == "text"
    assert final.content[0].text == text
    assert whole.content[0].type == "text"
    assert whole.content[0].text == text
    assert final.stop_reason == whole.stop_reason
    assert prompt_tokens(final) == prompt_tokens(whole)
    assert final.usage.cache_read_input_tokens  # the second time: the slot kept the prompt
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id.startswith("msg_")


def test_system_prompt_as_string_and_blocks_counts_the_same(client: anthropic.Anthropic) -> None:
    as_string = client.messages.count_tokens(model="plain", system="Brief.\n\nKind.", messages=HELLO)
    as_blocks = client.messages.count_tokens(
        model="plain",
        system=[{"type": "text", "text": "Brief."}, {"type": "text", "text": "Kind."}],
        messages=HELLO,
    )
    without = client.messages.count_tokens(model="plain", messages=HELLO)
    assert as_string.input_tokens == as_blocks.input_tokens
    # the tiny template: "<|system|>" + the text + "\n", one token per byte (no spaces: each is 3)
    assert as_string.input_tokens == without.input_tokens + len(b"<|system|>Brief.\n\nKind.\n")


# Claude Code's first system block: its hash differs between conversations (and a `cch=` nonce,
# where sent, between requests).
BILLING: Final = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"


def test_claude_codes_billing_header_stays_out_of_the_prompt(client: anthropic.Anthropic) -> None:
    """Left in, it parted every conversation's prompt from the others' right where the system
    prompt begins: a new session or a subagent reused none of the system prompt they share."""
    system = "Be terse; answer in one line. " * 8
    plain = client.messages.count_tokens(model="plain", system=system, messages=HELLO).input_tokens
    for header in (BILLING.format("8cc"), BILLING.format("be0") + " cch=1c8b4;"):
        blocks: Any = [{"type": "text", "text": header}, {"type": "text", "text": system}]
        assert (
            client.messages.count_tokens(model="plain", system=blocks, messages=HELLO).input_tokens == plain
        )
        joined = client.messages.count_tokens(model="plain", system=f"{header}\n{system}", messages=HELLO)
        assert joined.input_tokens == plain
    for suffix, said in (("8cc", "the first conversation"), ("be0", "another conversation")):
        blocks = [{"type": "text", "text": BILLING.format(suffix)}, {"type": "text", "text": system}]
        said_now: Any = [{"role": "user", "content": said}]
        reply = client.messages.create(
            model="plain", max_tokens=1, system=blocks, messages=said_now, extra_body=GREEDY
        )
    # The other conversation's system prompt came from the slot (one token per byte here).
    assert (reply.usage.cache_read_input_tokens or 0) > len(system)


def test_the_raw_stream_has_anthropics_events_in_order(served: Served) -> None:
    said = [{"role": "user", "content": "events, in order"}]  # this test's own prompt
    body = {"model": "plain", "max_tokens": 8, "messages": said, "stream": True, "temperature": 0}
    cache_reads = []
    for _ in range(2):  # the second time the slot kept the prompt: more of it is a cache read
        status, headers, payload = raw_post(served, "/v1/messages", body, {"x-api-key": served.tokens["app"]})
        assert status == 200
        assert int(headers["x-queue-ms"]) >= 0  # the headers waited for the first token
        assert headers["Content-Type"].startswith("text/event-stream")
        got = events(payload)
        names = [name for name, _ in got]
        assert names[:2] == ["message_start", "ping"]
        assert names[-2:] == ["message_delta", "message_stop"]
        assert all(data["type"] == name for name, data in got)
        start = got[0][1]["message"]
        assert start["content"] == []
        assert start["stop_reason"] is None
        delta = got[-2][1]
        assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == 8
        # message_start splits the prompt into prefilled and cached as the end does.
        end = delta["usage"]
        for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            assert start["usage"][name] == end[name], name
        cache_reads.append(end["cache_read_input_tokens"])
        blocks = [name for name in names if name.startswith("content_block")]
        assert blocks[0] == "content_block_start"
        assert blocks[-1] == "content_block_stop"
        assert b"[DONE]" not in payload
    assert cache_reads[1] > cache_reads[0]


def test_pings_keep_a_quiet_stream_alive(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anthropic_answers, "PING_INTERVAL_S", 0.0)  # any wait for a token is too long
    body = {"model": "plain", "max_tokens": 6, "messages": HELLO, "stream": True}
    status, _, payload = raw_post(served, "/v1/messages", body, {"x-api-key": served.tokens["app"]})
    assert status == 200
    names = [name for name, _ in events(payload)]
    assert names.count("ping") > 1
    assert names[-1] == "message_stop"


# ---- stop sequences -----------------------------------------------------------------------------


def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="plain", max_tokens=40, messages=ASK, extra_body=GREEDY)
    assert whole.content[0].type == "text"
    text = whole.content[0].text
    # A printable ASCII character of the greedy reply, past its start: the same greedy run stops there.
    stop = next(c for c in text[2:] if c.isascii() and c.isalnum())
    cut = client.messages.create(
        model="plain", max_tokens=40, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    expected = text[: text.index(stop)]
    assert "".join(b.text for b in cut.content if b.type == "text") == expected
    with client.messages.stream(
        model="plain", max_tokens=40, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence"
    assert final.stop_sequence == stop


# ---- tools --------------------------------------------------------------------------------------


def _tool_uses(message: anthropic.types.Message) -> list[anthropic.types.ToolUseBlock]:
    return [b for b in message.content if b.type == "tool_use"]


def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    asked = client.messages.create(
        model="plain", max_tokens=400, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert asked.stop_reason == "tool_use", asked
    [use] = _tool_uses(asked)
    assert [b.type for b in asked.content] == ["tool_use"]  # never the internal JSON as text
    assert use.id.startswith("toolu_")
    assert use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(use.input["celsius"], bool)
    history: Any = [
        *ASK,
        {"role": "assistant", "content": asked.content},  # the SDK's own blocks, sent back
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}],
        },
    ]
    answer = client.messages.create(model="plain", max_tokens=20, messages=history, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The result reached the prompt: it holds the call and its result.
    counted = client.messages.count_tokens(model="plain", messages=history, tools=[WEATHER])
    assert prompt_tokens(answer) == counted.input_tokens
    before = client.messages.count_tokens(model="plain", messages=ASK, tools=[WEATHER])
    assert counted.input_tokens > before.input_tokens + len(b"sunny, 21 C")


def test_a_streamed_tool_round_trip_streams_the_arguments(client: anthropic.Anthropic) -> None:
    partials: list[str] = []
    with client.messages.stream(
        model="plain",
        max_tokens=400,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
    ) as stream:
        partials.extend(
            ev.delta.partial_json
            for ev in stream
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [use] = _tool_uses(final)
    assert use.name == "get_time"
    assert len(partials) > 3  # as the model writes them, not in one piece
    assert json.loads("".join(partials)) == use.input
    assert isinstance(use.input["zone"], int)
    history: Any = [
        *ASK,
        {"role": "assistant", "content": final.content},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "12:00"}],
                },
                {"type": "text", "text": "And now?"},
            ],
        },
    ]
    with client.messages.stream(model="plain", max_tokens=10, messages=history, tools=[TIME]) as again:
        assert again.get_final_message().stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_tool_choice_auto_and_none(client: anthropic.Anthropic) -> None:
    for seed_text in ("a", "b", "c"):
        answer = client.messages.create(
            model="plain",
            max_tokens=400,
            messages=[{"role": "user", "content": f"Weather? {seed_text}"}],
            tools=[WEATHER, TIME],
            tool_choice={"type": "auto"},
        )
        uses = _tool_uses(answer)
        if uses:
            assert answer.stop_reason in ("tool_use", "max_tokens")
            assert {u.name for u in uses} <= {"get_weather", "get_time"}
        for block in answer.content:
            if block.type == "text":
                assert '"tool_calls"' not in block.text
                assert '{"response"' not in block.text
    plain = client.messages.create(
        model="plain", max_tokens=8, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert _tool_uses(plain) == []
    assert plain.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("max_tokens", [10, 30, 60, 90])  # before the name, in the arguments, ...
def test_a_reply_cut_mid_tool_call(client: anthropic.Anthropic, max_tokens: int) -> None:
    args: Any = {
        "model": "plain",
        "max_tokens": max_tokens,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**args)
    assert whole.stop_reason in ("max_tokens", "tool_use")
    assert [b.type for b in whole.content if b.type != "tool_use"] == []  # no internal JSON as text
    for use in _tool_uses(whole):  # only complete calls
        assert set(use.input) == {"city", "celsius"}
    if whole.stop_reason == "max_tokens":
        assert whole.usage.output_tokens == max_tokens
    with client.messages.stream(**args) as stream:
        seen = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason
    assert [b for b in final.content if b.type == "text"] == []
    starts = [e for e in seen if e.type == "content_block_start"]
    stops = [e for e in seen if e.type == "content_block_stop"]
    assert len(starts) == len(stops) <= 1  # every block it opened is closed
    complete = [u for u in _tool_uses(final) if set(u.input) == {"city", "celsius"}]
    assert [u.input for u in complete] == [u.input for u in _tool_uses(whole)]
    if final.stop_reason == "tool_use":
        assert complete == _tool_uses(final)


# ---- count_tokens -------------------------------------------------------------------------------


def test_count_tokens_counts_the_tools_too(client: anthropic.Anthropic) -> None:
    bare = client.messages.count_tokens(model="plain", messages=ASK).input_tokens
    with_tools = client.messages.count_tokens(model="plain", messages=ASK, tools=[WEATHER]).input_tokens
    assert with_tools > bare + len(json.dumps(WEATHER["input_schema"]["properties"])) // 2
    used = client.messages.create(
        model="plain", max_tokens=400, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert (
        prompt_tokens(used)
        == client.messages.count_tokens(
            model="plain", messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
        ).input_tokens
    )


def test_count_tokens_refuses_what_generates(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="plain", messages=ASK, extra_body={"max_tokens": 5})
    assert "max_tokens" in caught.value.message


# ---- thinking -----------------------------------------------------------------------------------

SPLIT: Final = {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "^ab</think>cd$"}}}


def _blocks(message: anthropic.types.Message) -> list[tuple[str, str]]:
    # The grammar lets the JSON string end with whitespace: the text's end is not compared.
    return [
        (b.type, b.thinking if b.type == "thinking" else getattr(b, "text", "").rstrip())
        for b in message.content
    ]


def test_a_reasoning_models_thinking_comes_back_as_thinking_blocks(client: anthropic.Anthropic) -> None:
    # The schema makes the reply a JSON string whose text closes the thinking the template opened.
    body: Any = {
        "model": "thinker",
        "max_tokens": 64,
        "messages": ASK,
        "extra_body": {"output_config": SPLIT},
    }
    message = client.messages.create(**body)
    assert _blocks(message) == [("thinking", '"ab'), ("text", 'cd"')]
    budget: Any = {"type": "enabled", "budget_tokens": 1024}  # which must be less than max_tokens
    with client.messages.stream(**{**body, "max_tokens": 1100}, thinking=budget) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    hidden = client.messages.create(**body, thinking={"type": "disabled"})
    assert _blocks(hidden) == [("text", 'cd"')]  # the model still thinks: it is not shown


def test_a_model_without_reasoning_has_no_thinking_blocks(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="plain", max_tokens=1100, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert all(b.type == "text" for b in message.content)


# ---- errors, keys and limits --------------------------------------------------------------------


def test_errors_raise_the_sdks_classes(served: Served, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=5, messages=HELLO)
    assert_anthropic_error(missing.value.body, "not_found_error")
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(
            model="plain",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
                    ],
                }
            ],
        )
    assert "empty" in assert_anthropic_error(image.value.body, "invalid_request_error")
    stranger = anthropic.Anthropic(base_url=served.daemon.url, api_key="sk-nope", max_retries=0)
    with stranger, pytest.raises(anthropic.AuthenticationError) as bad_key:
        stranger.messages.create(model="plain", max_tokens=5, messages=HELLO)
    assert_anthropic_error(bad_key.value.body, "authentication_error")
    with served.client("ops") as ops, pytest.raises(anthropic.PermissionDeniedError) as no_scope:
        ops.messages.create(model="plain", max_tokens=5, messages=HELLO)
    assert_anthropic_error(no_scope.value.body, "permission_error")
    with served.client("small") as small:
        with pytest.raises(anthropic.BadRequestError) as over_key:
            small.messages.create(model="plain", max_tokens=KEY_MAX_TOKENS + 1, messages=HELLO)
        assert f"at most {KEY_MAX_TOKENS}" in over_key.value.message
        small.messages.create(model="plain", max_tokens=KEY_MAX_TOKENS, messages=HELLO)


def test_x_api_key_with_anthropics_headers_authenticates(served: Served) -> None:
    body = {"model": "plain", "max_tokens": 2, "messages": HELLO}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "whatever-2099-01-01"}
    status, _, payload = raw_post(
        served, "/v1/messages", body, {"x-api-key": served.tokens["app"], **headers}
    )
    assert status == 200, payload
    assert json.loads(payload)["type"] == "message"
    status, answer_headers, payload = raw_post(served, "/v1/messages", body, headers)
    assert status == 401
    assert answer_headers["WWW-Authenticate"] == "Bearer"
    assert_anthropic_error(json.loads(payload), "authentication_error")


def test_rate_limits_answer_429_with_retry_after(served: Served) -> None:
    with served.client("slow") as slow:
        slow.messages.create(model="plain", max_tokens=1, messages=HELLO)
        with pytest.raises(anthropic.RateLimitError) as caught:
            slow.messages.create(model="plain", max_tokens=1, messages=HELLO)
    assert_anthropic_error(caught.value.body, "rate_limit_error")
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_a_full_model_is_overloaded_529(served: Served, client: anthropic.Anthropic) -> None:
    # The one slot held by a stream that cannot end soon: a Messages reply of the tiny model
    # ends at its end-of-turn token some 30 tokens in (milliseconds), so the slot is held
    # through the OpenAI route, with ignore_eos, on the same model.
    body = {
        "model": "single",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "messages": HELLO,
    }
    request = urllib.request.Request(  # noqa: S310 - loopback
        served.daemon.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {served.tokens['app']}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as busy:  # noqa: S310 - loopback
        assert busy.readline().startswith(b"data: ")  # the slot is taken once the stream has begun
        with pytest.raises(anthropic.OverloadedError) as caught:
            client.messages.create(model="single", max_tokens=1, messages=HELLO)
    assert_anthropic_error(caught.value.body, "overloaded_error")
    assert caught.value.status_code == 529
    assert "retry-after" in caught.value.response.headers


def test_routing_errors_under_messages_are_anthropics_and_elsewhere_openais(served: Served) -> None:
    auth = {"x-api-key": served.tokens["app"]}
    status, _, payload = raw_post(served, "/v1/messages/nothing", {}, auth)
    assert status == 404
    assert_anthropic_error(json.loads(payload), "not_found_error")
    request = urllib.request.Request(served.daemon.url + "/v1/messages", headers=auth)  # noqa: S310
    with pytest.raises(urllib.error.HTTPError) as wrong_method:
        urllib.request.urlopen(request, timeout=10)  # noqa: S310 - loopback URL
    with wrong_method.value as answer:
        assert answer.code == 405
        assert_anthropic_error(json.loads(answer.read()), "invalid_request_error")
    status, _, payload = raw_post(served, "/v1/chat/completions", {"model": "nope", "messages": HELLO}, auth)
    assert status == 404
    assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}  # OpenAI's
    status, _, payload = raw_post(served, "/v1/messagesx", {}, auth)
    assert status == 404
    assert "code" in json.loads(payload)["error"]  # not under /v1/messages: OpenAI's


def test_a_prompt_past_the_context_is_a_400(client: anthropic.Anthropic) -> None:
    long: Any = [{"role": "user", "content": "x" * (CONTEXT + 100)}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="plain", max_tokens=5, messages=long)
    assert "context" in assert_anthropic_error(caught.value.body, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="plain", messages=long)


def test_a_body_past_the_limit_is_413(served: Served) -> None:
    body = {"model": "plain", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 70000}]}
    status, _, payload = raw_post(served, "/v1/messages", body, {"x-api-key": served.tokens["app"]})
    assert status == 413
    assert_anthropic_error(json.loads(payload), "request_too_large")


def test_the_daemon_still_serves(served: Served) -> None:
    assert served.daemon.get("/readyz")[0] == 200
