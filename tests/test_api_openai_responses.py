"""POST /v1/responses with the official `openai` client on a real daemon: answers, streams, tools, store."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jsonschema  # type: ignore[import-untyped] # no stubs in the dev set (it comes with ansible-lint)
import openai
import pytest
from openai.types.responses import Response

from edgellmctl.keys import create_key
from edgellmd.settings import ResponsesSettings
from tests.ggufmodels import TINY_CHAT_TEMPLATE, TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for
from tests.tools import WEATHER_DESCRIPTION, WEATHER_NAME, WEATHER_PARAMETERS

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

# A template that renders tools, calls and results itself (the other path: `plain`'s template
# cannot, so its tools are described in a system turn).
TOOLS_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}<|assistant|>{{ m.content }}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A reasoning model's template opens its thinking itself (as DeepSeek R1's and Qwen3's do).
THINK_TEMPLATE: Final = TINY_CHAT_TEMPLATE.replace(
    "<|assistant|>{% endif %}", "<|assistant|><think>{% endif %}"
)
MAX_BODY_BYTES: Final = 65536
WEATHER: Any = {
    "type": "function",
    "name": WEATHER_NAME,
    "description": WEATHER_DESCRIPTION,
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
PERSON: Final = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cyd"]},
        "age": {"type": "integer"},
        "member": {"type": "boolean"},
        "role": {"anyOf": [{"type": "string", "enum": ["admin", "user"]}, {"type": "null"}]},
    },
    "required": ["name", "age", "member", "role"],
    "additionalProperties": False,
}
ASK: Final = "What is the weather in Oslo?"


@dataclass
class Keys:
    path: Path
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    path = tmp_path_factory.mktemp("responses-keys") / "keys.yaml"
    tokens = {label: create_key(path, label, ["inference"], limits={})[1] for label in ("a", "b")}
    return Keys(path, tokens)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[RunningDaemon]:
    root = tmp_path_factory.mktemp("responses")
    plain = write_tiny_model(root / "plain.gguf", TinyModelSpec(seed=31))
    tools = write_tiny_model(root / "tools.gguf", TinyModelSpec(seed=32, chat_template=TOOLS_TEMPLATE))
    think = write_tiny_model(root / "think.gguf", TinyModelSpec(seed=33, chat_template=THINK_TEMPLATE))
    settings = settings_for(
        [
            {"name": "plain", "file": str(plain), "slots": 4, "context_size": 2048, "threads": 1},
            {"name": "tools", "file": str(tools), "slots": 2, "context_size": 2048, "threads": 1},
            {
                "name": "think",
                "file": str(think),
                "slots": 1,
                "context_size": 512,
                "threads": 1,
                "reasoning": "deepseek",
            },
        ],
        server={"max_tokens_limit": 1024, "max_body_bytes": MAX_BODY_BYTES},
        lifecycle={"watch": False},
        auth={"keys_file": str(keys.path)},
    )
    with running(settings) as d:
        yield d


def _client(daemon: RunningDaemon, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0, timeout=60)


@pytest.fixture
def client(daemon: RunningDaemon, keys: Keys) -> Iterator[openai.OpenAI]:
    with _client(daemon, keys.tokens["a"]) as c:
        yield c


@pytest.fixture
def other(daemon: RunningDaemon, keys: Keys) -> Iterator[openai.OpenAI]:
    """A client with another key: it must not see `client`'s responses."""
    with _client(daemon, keys.tokens["b"]) as c:
        yield c


def _raw(
    daemon: RunningDaemon, token: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None
) -> tuple[int, bytes]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    req = urllib.request.Request(daemon.url + path, data=data, headers=headers, method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def _events(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A raw event stream as (event line's name, data's object) pairs."""
    out = []
    for block in payload.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- answers ----------------------------------------------------------------------------------


def test_create(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="plain", input="hello", max_output_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert isinstance(response, Response)
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.model == "plain"
    assert response.status == "incomplete"  # ignore_eos: it stops at max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    assert response.output_text == message.content[0].text
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.max_output_tokens == 12
    assert response.tools == []
    assert response.tool_choice == "auto"
    assert response.to_dict()["store"] is True  # echoed; the SDK's type does not declare it
    Response.model_validate(response.model_dump())  # what the daemon sent holds the SDK's types strictly


def test_a_reply_that_ends_by_itself_is_completed(client: openai.OpenAI) -> None:
    # A constrained reply ends when its JSON does: the model cannot run on.
    fmt: Any = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = client.responses.create(model="plain", input="A person.", text={"format": fmt}, temperature=0)
    assert response.status == "completed"
    assert response.incomplete_details is None
    assert response.completed_at is not None
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_stream_helper_events_in_order(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    whole = client.responses.create(model="plain", input="A person.", text={"format": fmt}, temperature=0)
    with client.responses.stream(
        model="plain", input="A person.", text={"format": fmt}, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2  # as generated, not in one piece
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert final.status == "completed"
    assert final.usage is not None
    assert whole.usage is not None
    # The same tokens; how many of the prompt's came from a slot's cache depends on the slots.
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
        whole.usage.total_tokens,
    )
    assert final.id != whole.id


def test_stream_event_lines_are_named_like_their_type(daemon: RunningDaemon, keys: Keys) -> None:
    body = {"model": "plain", "input": "hi", "max_output_tokens": 5, "stream": True, "temperature": 0}
    status, payload = _raw(daemon, keys.tokens["a"], "POST", "/v1/responses", body)
    assert status == 200
    events = _events(payload)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[-1][0] in ("response.completed", "response.incomplete")
    assert "[DONE]" not in payload.decode()


def test_reasoning_items(client: openai.OpenAI) -> None:
    extra = {"ignore_eos": True}
    response = client.responses.create(
        model="think", input="Think.", max_output_tokens=10, temperature=0, extra_body=extra
    )
    first = response.output[0]
    assert first.type == "reasoning"
    assert first.id.startswith("rs_")
    assert first.content is not None
    assert first.content[0].text
    assert "<think>" not in json.dumps(response.model_dump())
    with client.responses.stream(
        model="think", input="Think.", max_output_tokens=10, temperature=0, extra_body=extra
    ) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == first.content[0].text
    assert events[-1].type == "response.incomplete"


# ---- tools ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["plain", "tools"])
def test_function_call_round_trip(client: openai.OpenAI, model: str) -> None:
    """A call, its output sent back as a function_call_output item, and the answer after it."""
    response = client.responses.create(
        model=model,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=600,
    )
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert call.status == "completed"
    assert call.call_id.startswith("call_")
    assert call.id is not None
    assert call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(args["celsius"], bool)
    assert response.output_text == ""
    history: Any = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees, rain"},
    ]

    def ask(items: Any) -> Response:
        return client.responses.create(
            model=model, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0
        )

    answer, alone = ask(history), ask(history[:1])
    assert [item.type for item in answer.output] == ["message"]
    assert answer.status in ("completed", "incomplete")
    # The call and its output were in the prompt: they cost at least their text in tokens.
    assert answer.usage is not None
    assert alone.usage is not None
    assert answer.usage.input_tokens >= alone.usage.input_tokens + len("12 degrees, rain" + call.name)


def test_streamed_function_call(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "name": "get_weather"}
    with client.responses.stream(
        model="tools",
        input=ASK,
        tools=[WEATHER],
        tool_choice=named,
        parallel_tool_calls=False,
        max_output_tokens=600,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    assert call.type == "function_call"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    assert json.loads(arguments)["city"] in ("Paris", "Oslo", "Lima")


CUT_BODY: Final = {
    "model": "plain",
    "input": ASK,
    "tools": [WEATHER],
    "tool_choice": "required",
    "temperature": 0,
    "parallel_tool_calls": False,
}


def _streamed_arguments(daemon: RunningDaemon, token: str, limit: int) -> str:
    body = {**CUT_BODY, "max_output_tokens": limit, "stream": True}
    _, payload = _raw(daemon, token, "POST", "/v1/responses", body)
    events = [data for _, data in _events(payload)]
    return "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")


def _cut_point(daemon: RunningDaemon, token: str) -> int:
    """The largest max_output_tokens that cuts the (greedy) call inside its arguments.

    Greedy decoding makes every shorter reply a prefix of the longer ones, so "the arguments
    are whole JSON" holds from one limit up: bisect for it.
    """

    def whole(limit: int) -> bool:
        try:
            json.loads(_streamed_arguments(daemon, token, limit))
        except json.JSONDecodeError:
            return False
        return True

    _, payload = _raw(daemon, token, "POST", "/v1/responses", {**CUT_BODY, "max_output_tokens": 1000})
    full = json.loads(payload)
    assert full["status"] == "completed"
    lo, hi = 1, full["usage"]["output_tokens"]  # whole(hi); not whole(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if whole(mid):
            hi = mid
        else:
            lo = mid
    return lo


def test_a_reply_cut_inside_a_call(daemon: RunningDaemon, keys: Keys) -> None:
    limit = _cut_point(daemon, keys.tokens["a"])
    body = {**CUT_BODY, "max_output_tokens": limit}
    status, payload = _raw(daemon, keys.tokens["a"], "POST", "/v1/responses", body)
    assert status == 200
    whole = json.loads(payload)
    status, streamed = _raw(daemon, keys.tokens["a"], "POST", "/v1/responses", {**body, "stream": True})
    assert status == 200
    events = [data for _, data in _events(streamed)]
    final = events[-1]
    assert final["type"] == "response.incomplete"
    for response in (whole, final["response"]):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert response["output"] == []  # only complete calls, and there are none
        assert response["usage"]["output_tokens"] == limit
    # The stream showed the call as it was generated, then closed it unfinished.
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["type"] for e in added] == ["function_call"]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args.startswith("{")
    assert len(args) > 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(args)
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["status"] for e in done] == ["incomplete"]
    assert not any(e["type"] == "response.function_call_arguments.done" for e in events)
    # edgellm's tool-call wrapper never reaches a text field, streamed or not.
    for text in (payload.decode(), streamed.decode()):
        assert '\\"tool_calls\\"' not in text
        assert '"tool_calls"' not in text
        assert "output_text" not in text  # no message item at all


def test_structured_output_validates_in_20_seeded_runs(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    for seed in range(20):
        response = client.responses.create(
            model="plain",
            input="Describe a person.",
            text={"format": fmt},
            temperature=1.0,
            max_output_tokens=300,
            extra_body={"seed": seed},
        )
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), PERSON)


def test_seeds_reproduce(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        return client.responses.create(
            model="plain", input="Once", max_output_tokens=10, temperature=1.5, extra_body={"seed": seed}
        ).output_text

    assert run(5) == run(5)


def test_usage_counts_the_prompt_tokens_an_earlier_request_left(client: openai.OpenAI) -> None:
    prompt = "A prompt long enough to matter, sent twice in a row. " * 2

    def usage() -> Any:
        return client.responses.create(model="plain", input=prompt, max_output_tokens=4).usage

    first, again = usage(), usage()
    assert first is not None
    assert again is not None
    assert again.input_tokens == first.input_tokens
    # The slot kept the first one's prompt: all of it but the last token, decoded again for its logits.
    assert again.input_tokens_details.cached_tokens == again.input_tokens - 1


# ---- refusals --------------------------------------------------------------------------------

UNKNOWN_ID: Final = "resp_" + "0" * 32
FUNCTION: Final = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def _bad(name: str, body: dict[str, Any], status: int, param: str | None, code: str | None = None) -> Any:
    return pytest.param({"model": "plain", "input": "hi", **body}, status, param, code, id=name)


BAD: Final = [
    _bad("model-missing", {"model": None}, 400, "model"),
    _bad("model-unknown", {"model": "nope"}, 404, "model", "model_not_found"),
    _bad("unknown-field", {"frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    _bad("chat-field", {"messages": []}, 400, "messages", "unknown_parameter"),
    _bad("n", {"n": 2}, 400, "n", "unknown_parameter"),
    _bad("input-missing", {"input": None}, 400, "input"),
    _bad("input-number", {"input": 5}, 400, "input"),
    _bad("input-empty", {"input": []}, 400, "input"),
    _bad("item-not-object", {"input": ["hi"]}, 400, "input[0]"),
    _bad("item-type-number", {"input": [{"type": 3}]}, 400, "input[0].type"),
    _bad("item-type-unknown", {"input": [{"type": "telepathy"}]}, 400, "input[0].type"),
    _bad(
        "item-web-search",
        {"input": [{"type": "web_search_call", "id": "ws_1"}]},
        400,
        "input[0].type",
        "unsupported_parameter",
    ),
    _bad(
        "item-reference",
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        400,
        "input[0].type",
        "unsupported_parameter",
    ),
    _bad("role-unknown", {"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    _bad("role-number", {"input": [{"role": 1, "content": "x"}]}, 400, "input[0].role"),
    _bad("content-missing", {"input": [{"role": "user"}]}, 400, "input[0].content"),
    _bad("content-number", {"input": [{"role": "user", "content": 5}]}, 400, "input[0].content"),
    _bad("part-not-object", {"input": [{"role": "user", "content": ["x"]}]}, 400, "input[0].content[0]"),
    _bad(
        "part-image-data-url-without-base64",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
        400,
        "input[0].content[0].image_url",
        "invalid_image",
    ),
    _bad(
        "part-image-by-file-id",
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
        400,
        "input[0].content[0].file_id",
        "unsupported_parameter",
    ),
    _bad(
        "part-image-in-a-system-message",
        {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
        400,
        "input[0].content[0].type",
        "unsupported_parameter",
    ),
    _bad(
        "part-file",
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
        400,
        "input[0].content[0].type",
        "unsupported_parameter",
    ),
    _bad(
        "part-output-text-for-user",
        {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
        400,
        "input[0].content[0].type",
    ),
    _bad(
        "part-text-number",
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        400,
        "input[0].content[0].text",
    ),
    _bad(
        "call-without-id",
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        400,
        "input[0].call_id",
    ),
    _bad(
        "call-arguments-object",
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        400,
        "input[0].arguments",
    ),
    _bad(
        "output-without-call",
        {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
        400,
        "input",
    ),
    _bad(
        "output-number",
        {"input": [{"type": "function_call_output", "call_id": "c1", "output": 5}]},
        400,
        "input[0].output",
    ),
    _bad("instructions-number", {"instructions": 5}, 400, "instructions"),
    *(
        _bad(
            f"tool-{kind}-required",
            {"tools": [{"type": kind}], "tool_choice": "required"},  # forced: nothing here can run it
            400,
            "tool_choice",
            "unsupported_parameter",
        )
        for kind in (
            "web_search",
            "file_search",
            "computer_use_preview",
            "code_interpreter",
            "mcp",
            "custom",
            "image_generation",
        )
    ),
    _bad("tool-unknown-type", {"tools": [{"type": "teleporter"}]}, 400, "tools[0].type"),
    _bad("tools-not-list", {"tools": "f"}, 400, "tools"),
    _bad(
        "tool-chat-shape",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools[0].function",
    ),
    _bad("tool-bad-name", {"tools": [{**FUNCTION, "name": "no spaces"}]}, 400, "tools[0].name"),
    _bad("tool-parameters-string", {"tools": [{**FUNCTION, "parameters": "{}"}]}, 400, "tools[0].parameters"),
    _bad(
        "tool-parameters-integer",
        {"tools": [{**FUNCTION, "parameters": {"type": "integer"}}], "tool_choice": "required"},
        400,
        "tools[0].parameters",
    ),
    _bad(
        "tool-parameters-boolean",
        {"tools": [{**FUNCTION, "parameters": {"type": "boolean"}}]},
        400,
        "tools[0].parameters",
    ),
    _bad(
        "tool-unsupported-keyword",
        {
            "tools": [
                {
                    **FUNCTION,
                    "strict": True,  # the exact subset: not relaxed (grammar.relax)
                    "parameters": {"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}},
                }
            ]
        },
        400,
        "tools[0].parameters",
        "unsupported_parameter",
    ),
    _bad("tools-duplicate", {"tools": [FUNCTION, FUNCTION]}, 400, "tools"),
    _bad("tool-choice-unknown", {"tools": [FUNCTION], "tool_choice": "sometimes"}, 400, "tool_choice"),
    _bad(
        "tool-choice-other-name",
        {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "g"}},
        400,
        "tool_choice",
    ),
    _bad("tool-choice-without-tools", {"tool_choice": "required"}, 400, "tool_choice"),
    _bad(
        "tool-choice-allowed-tools",
        {"tools": [FUNCTION], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
        400,
        "tool_choice",
        "unsupported_parameter",
    ),
    _bad("parallel-string", {"tools": [FUNCTION], "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    _bad("text-number", {"text": 5}, 400, "text"),
    _bad("text-unknown-key", {"text": {"colour": "red"}}, 400, "text.colour"),
    _bad("format-unknown", {"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    _bad(
        "format-schema-missing",
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        400,
        "text.format.schema",
    ),
    _bad(
        "format-name-missing",
        {"text": {"format": {"type": "json_schema", "schema": {}}}},
        400,
        "text.format.name",
    ),
    _bad(
        "format-unsupported-keyword",
        {
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "allOf": [{}]}}
            }
        },
        400,
        "text.format.schema",
        "unsupported_parameter",
    ),
    _bad(
        "format-with-tool-calls-still-checked",
        {"tools": [FUNCTION], "text": {"format": {"type": "json_object", "name": "x"}}},
        400,
        "text.format.name",
    ),
    _bad("metadata-string", {"metadata": "x"}, 400, "metadata"),
    _bad("metadata-17-keys", {"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    _bad("metadata-long-key", {"metadata": {"k" * 65: "v"}}, 400, "metadata"),
    _bad("metadata-long-value", {"metadata": {"k": "v" * 513}}, 400, "metadata"),
    _bad("metadata-number-value", {"metadata": {"k": 1}}, 400, "metadata"),
    _bad("max-output-tokens-zero", {"max_output_tokens": 0}, 400, "max_output_tokens"),
    _bad("max-output-tokens-over", {"max_output_tokens": 99_999}, 400, "max_output_tokens"),
    _bad("max-output-tokens-string", {"max_output_tokens": "5"}, 400, "max_output_tokens"),
    _bad("max-output-tokens-huge", {"max_output_tokens": 10**400}, 400, "max_output_tokens"),
    _bad("temperature-high", {"temperature": 3}, 400, "temperature"),
    _bad("temperature-string", {"temperature": "hot"}, 400, "temperature"),
    _bad("top-p-high", {"top_p": 2}, 400, "top_p"),
    _bad("stream-string", {"stream": "yes"}, 400, "stream"),
    _bad(
        "stream-options-without-stream",
        {"stream_options": {"include_obfuscation": False}},
        400,
        "stream_options",
    ),
    _bad("store-string", {"store": "no"}, 400, "store"),
    _bad("user-number", {"user": 5}, 400, "user"),
    _bad("previous-id-shape", {"previous_response_id": "abc"}, 400, "previous_response_id"),
    _bad("previous-id-number", {"previous_response_id": 5}, 400, "previous_response_id"),
    _bad(
        "previous-id-unknown",
        {"previous_response_id": UNKNOWN_ID},
        404,
        "previous_response_id",
        "previous_response_not_found",
    ),
    _bad("background", {"background": True}, 400, "background", "unsupported_parameter"),
    _bad("conversation", {"conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    _bad("prompt", {"prompt": {"id": "pmpt_1"}}, 400, "prompt", "unsupported_parameter"),
    _bad(
        "context-management",
        {"context_management": [{"type": "compaction"}]},
        400,
        "context_management",
        "unsupported_parameter",
    ),
    _bad(
        "include-logprobs",
        {"include": ["message.output_text.logprobs"]},
        400,
        "include",
        "unsupported_parameter",
    ),
    _bad("include-unknown", {"include": ["everything"]}, 400, "include"),
    _bad("include-string", {"include": "reasoning.encrypted_content"}, 400, "include"),
    _bad("top-logprobs", {"top_logprobs": 3}, 400, "top_logprobs", "unsupported_parameter"),
    _bad("truncation-unknown", {"truncation": "sometimes"}, 400, "truncation"),
    _bad("reasoning-effort-unknown", {"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    _bad("reasoning-unknown-key", {"reasoning": {"depth": 3}}, 400, "reasoning.depth"),
    _bad("seed-string", {"seed": "1"}, 400, "seed"),
    _bad("too-long-for-the-context", {"input": "x" * 5000}, 400, "input", "context_length_exceeded"),
    _bad(
        "too-long-in-items",
        {"input": [{"role": "user", "content": "y" * 3000}] * 2},
        400,
        "input",
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD)
def test_bad_input(
    daemon: RunningDaemon, keys: Keys, body: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    body = {k: v for k, v in body.items() if v is not None}
    got, payload = _raw(daemon, keys.tokens["a"], "POST", "/v1/responses", body)
    error = json.loads(payload)["error"]
    assert (got, error["param"], error["code"]) == (status, param, code), error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


def test_bad_bodies(daemon: RunningDaemon, keys: Keys) -> None:
    token = keys.tokens["a"]
    too_big = json.dumps({"model": "plain", "input": "x" * MAX_BODY_BYTES}).encode()
    for raw, status in [
        (too_big, 413),
        (b"[]", 400),
        (b"{", 400),
        (rb'{"model": "plain", "input": "\ud800"}', 400),
    ]:
        got, payload = _raw(daemon, token, "POST", "/v1/responses", raw=raw)
        assert got == status
        assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v1/responses/abc", 400),
        ("/v1/responses/resp_" + "G" * 32, 400),
        (f"/v1/responses/{UNKNOWN_ID}", 404),
    ],
)
@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_bad_ids(daemon: RunningDaemon, keys: Keys, path: str, status: int, method: str) -> None:
    got, payload = _raw(daemon, keys.tokens["a"], method, path)
    assert got == status
    assert json.loads(payload)["error"]["param"] == "response_id"


def test_accepted_and_ignored_fields_change_nothing(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="plain", input="hi", max_output_tokens=8, temperature=0)
    dressed = client.responses.create(
        model="plain",
        input="hi",
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "low", "summary": "auto"},
        truncation="auto",
        service_tier="auto",
        include=["reasoning.encrypted_content"],
        metadata={"trace": "t1"},
        user="end-user-1",
        safety_identifier="s1",
        prompt_cache_key="k1",
        max_tool_calls=3,
        parallel_tool_calls=True,
        text={"verbosity": "low"},
        store=True,
    )
    assert dressed.output_text == plain.output_text
    assert dressed.metadata == {"trace": "t1"}
    assert dressed.user == "end-user-1"
    assert dressed.reasoning is not None
    assert dressed.reasoning.effort == "low"


# ---- the store --------------------------------------------------------------------------------


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tools", input="My name is Ada.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="tools",
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The same conversation sent whole (instructions are not carried over, as OpenAI's).
    explicit = client.responses.create(
        model="tools",
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert second.usage is not None
    assert explicit.usage is not None
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.output_text == explicit.output_text
    # and a chain: the third continues the second, which continued the first
    third = client.responses.create(
        model="tools", previous_response_id=second.id, input="Again?", max_output_tokens=4, temperature=0
    )
    assert third.usage is not None
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def _call_then_answer(client: openai.OpenAI, asked: Any, **more: Any) -> tuple[Response, Any, Response]:
    """A response that must call the weather tool, and the one answering with the call's output."""
    call = client.responses.create(
        model="plain",
        input=asked,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=600,
        **more,
    )
    [made] = call.output
    assert made.type == "function_call"
    answer = client.responses.create(
        model="plain",
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": made.call_id, "output": "sunny"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=6,
    )
    return call, made, answer


def test_previous_response_id_with_a_function_call_output(client: openai.OpenAI) -> None:
    _, _, answer = _call_then_answer(client, ASK)
    assert [o.type for o in answer.output] == ["message"]


def test_get_and_delete(client: openai.OpenAI, daemon: RunningDaemon, keys: Keys) -> None:
    created = client.responses.create(model="plain", input="hi", max_output_tokens=4, metadata={"run": "1"})
    assert client.responses.retrieve(created.id) == created
    status, payload = _raw(daemon, keys.tokens["a"], "DELETE", f"/v1/responses/{created.id}")
    assert status == 200
    assert json.loads(payload) == {"id": created.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="plain", previous_response_id=created.id, input="more")
    assert caught.value.code == "previous_response_not_found"


def test_input_items_list_what_a_response_was_made_from(client: openai.OpenAI) -> None:
    """The SDK's `responses.input_items.list`: every turn a chain continued and its own input
    (a call, its output), newest first by default, paged with `after` by the SDK itself."""
    asked = [{"role": "developer", "content": "use tools"}, {"role": "user", "content": ASK}]
    call, made, answer = _call_then_answer(client, asked, instructions="be brief")
    first = client.responses.input_items.list(call.id, order="asc")
    # A developer turn is the system turn the model saw.
    roles = [(i.type, getattr(i, "role", None)) for i in first.data]
    assert roles == [("message", "system"), ("message", "user")]
    assert first.data[1].to_dict()["content"] == [{"type": "input_text", "text": ASK}]  # no instructions
    assert first.has_more is False
    listed = client.responses.input_items.list(answer.id, order="asc")
    kinds = [i.type for i in listed.data]
    assert kinds == ["message", "message", "function_call", "function_call_output"]
    call_item, output_item = listed.data[2].to_dict(), listed.data[3].to_dict()
    assert (call_item["call_id"], call_item["name"], call_item["arguments"]) == (
        made.call_id,
        made.name,
        made.arguments,
    )
    assert (output_item["call_id"], output_item["output"]) == (made.call_id, "sunny")
    # Newest first by default; a page of one at a time, the SDK following `after` to the end.
    newest = client.responses.input_items.list(answer.id)
    assert [i.id for i in newest.data] == [i.id for i in reversed(listed.data)]
    paged = [i.id for i in client.responses.input_items.list(answer.id, limit=1, order="asc")]
    assert paged == [i.id for i in listed.data]
    assert len(set(paged)) == 4
    # The same ids every time (pages stay put while the response is stored).
    assert [i.id for i in client.responses.input_items.list(answer.id, order="asc").data] == paged
    page = client.responses.input_items.list(answer.id, order="asc", limit=2, after=paged[0])
    assert ([i.id for i in page.data], page.has_more) == (paged[1:3], True)
    raw = client.get(
        f"/responses/{answer.id}/input_items",
        cast_to=object,
        options={"params": {"order": "asc", "limit": 2, "after": paged[0]}},
    )
    assert isinstance(raw, dict)
    assert (raw["object"], raw["first_id"], raw["last_id"]) == ("list", paged[1], paged[2])


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=-1", "limit"),
        ("limit=%EF%BC%91", "limit"),  # a fullwidth digit
        ("order=up", "order"),
        ("after=msg_nothing", "after"),
        ("after=" + "x" * 65, "after"),
        ("include=bogus", "include"),
        ("include[]=message.input_image.image_url&include[]=nope", "include"),
        ("page=2", "page"),
    ],
)
def test_input_items_refuse_what_openai_would(
    daemon: RunningDaemon, keys: Keys, query: str, param: str
) -> None:
    created = _client(daemon, keys.tokens["a"]).responses.create(
        model="plain", input="hi", max_output_tokens=2
    )
    status, payload = _raw(daemon, keys.tokens["a"], "GET", f"/v1/responses/{created.id}/input_items?{query}")
    assert status == 400, payload
    error = json.loads(payload)["error"]
    assert error["param"] == param
    assert "x" * 65 not in error["message"]


def test_input_items_are_their_owners_alone(
    client: openai.OpenAI, other: openai.OpenAI, daemon: RunningDaemon, keys: Keys
) -> None:
    mine = client.responses.create(model="plain", input="secret", max_output_tokens=2)
    listed: Any = client.responses.input_items.list(mine.id).data[0].to_dict()
    assert listed["content"][0]["text"] == "secret"
    unknown = "resp_" + "0" * 32
    answers = []
    for rid in (mine.id, unknown):
        status, payload = _raw(daemon, keys.tokens["b"], "GET", f"/v1/responses/{rid}/input_items")
        answers.append((status, payload.decode().replace(rid, "ID")))
    assert answers[0] == answers[1]
    assert answers[0][0] == 404
    status, _ = _raw(daemon, keys.tokens["a"], "GET", "/v1/responses/abc/input_items")
    assert status == 400
    client.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(mine.id)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model="plain", input="hi", max_output_tokens=4, store=False)
    assert response.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_streamed_response_is_stored(client: openai.OpenAI) -> None:
    with client.responses.stream(model="plain", input="hi", max_output_tokens=3, temperature=0) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    stored = client.responses.retrieve(last.response.id)
    assert stored.output_text == last.response.output_text
    assert stored.usage == last.response.usage


def test_another_key_sees_nothing(
    client: openai.OpenAI, other: openai.OpenAI, daemon: RunningDaemon, keys: Keys
) -> None:
    mine = client.responses.create(model="plain", input="secret", max_output_tokens=4)
    unknown = "resp_" + "0" * 32
    for rid in (mine.id, unknown):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model="plain", previous_response_id=rid, input="go on")

    def answer(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, payload = _raw(daemon, keys.tokens["b"], method, path, body)
        return status, json.loads(payload.decode().replace(mine.id, "ID").replace(unknown, "ID"))

    # Exactly like an unknown id: the same status and the same body.
    for method in ("GET", "DELETE"):
        assert answer(method, f"/v1/responses/{mine.id}") == answer(method, f"/v1/responses/{unknown}")
    body = {"model": "plain", "input": "x", "max_output_tokens": 2}
    theirs = answer("POST", "/v1/responses", {**body, "previous_response_id": mine.id})
    assert theirs == answer("POST", "/v1/responses", {**body, "previous_response_id": unknown})
    assert theirs[0] == 404
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_the_store_evicts_the_oldest(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(seed=34))
    settings = settings_for(
        [{"name": "tiny", "file": str(model), "slots": 1, "context_size": 256, "threads": 1}],
        lifecycle={"watch": False},
    )
    settings = dataclasses.replace(settings, responses=ResponsesSettings(store_max_responses=2))
    with running(settings) as d, openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0) as c:
        ids = [c.responses.create(model="tiny", input="hi", max_output_tokens=2).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):  # auth off: one anonymous owner, bounded all the same
            c.responses.retrieve(ids[0])
        assert [c.responses.retrieve(rid).id for rid in ids[1:]] == ids[1:]
