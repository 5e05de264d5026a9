"""OpenAI API breadth with the real `openai` client: structured output, tools, logprobs, n, logit_bias."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for
from tests.tools import TIME_NAME, TIME_PARAMETERS, WEATHER_DESCRIPTION, WEATHER_NAME, WEATHER_PARAMETERS

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

# A chat template with tool support, in the Hugging Face dialect (tools listed in the system
# turn, assistant tool calls and tool results rendered as their own turns).
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Any: the openai client's TypedDict parameters would need every literal spelled out.
WEATHER: Any = {
    "type": "function",
    "function": {"name": WEATHER_NAME, "description": WEATHER_DESCRIPTION, "parameters": WEATHER_PARAMETERS},
}
TIME: Any = {"type": "function", "function": {"name": TIME_NAME, "parameters": TIME_PARAMETERS}}
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Person(BaseModel):
    """The structured-output test schema: every value bounded, so any model finishes it."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["ada", "bob", "cyd"]
    age: int
    member: bool
    role: Literal["admin", "user"] | None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    root = tmp_path_factory.mktemp("breadth")
    plain = write_tiny_model(root / "plain.gguf", TinyModelSpec(seed=31))
    tools = write_tiny_model(root / "tools.gguf", TinyModelSpec(seed=32, chat_template=TOOLS_TEMPLATE))
    settings = settings_for(
        [
            {"name": "plain", "file": str(plain), "slots": 4, "context_size": 2048, "threads": 1},
            {"name": "tools", "file": str(tools), "slots": 4, "context_size": 1024, "threads": 1},
            {
                "name": "embed",
                "file": str(plain),
                "embedding": True,
                "slots": 1,
                "context_size": 128,
                "threads": 1,
            },
        ],
        server={"max_tokens_limit": 1024},
        lifecycle={"watch": False},
    )
    with running(settings) as d:
        yield d


@pytest.fixture
def client(daemon: RunningDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


# ---- structured output ------------------------------------------------------------------------


def test_json_schema_output_validates_in_every_seeded_run(client: openai.OpenAI) -> None:
    for seed in range(20):
        answer = client.beta.chat.completions.parse(
            model="plain",
            messages=[{"role": "user", "content": "Describe a person."}],
            response_format=Person,
            seed=seed,
            temperature=1.0,
            max_tokens=200,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)  # the client validated it with pydantic
        assert Person.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_json_object_output_is_a_json_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model="plain",
            messages=ASK,
            response_format={"type": "json_object"},
            seed=seed,
            temperature=0.7,
            max_tokens=400,
        )
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)
        else:  # a random model may fill a long string; what it wrote is still JSON's prefix
            assert (answer.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "minLength": 1}}}, "minLength"),
        ({"type": "object", "allOf": [{"type": "object"}]}, "allOf"),
        ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ],
)
def test_unsupported_schema_keywords_are_named(
    client: openai.OpenAI, schema: dict[str, Any], keyword: str
) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="plain", messages=ASK, response_format=fmt)
    assert caught.value.code == "unsupported_parameter"
    assert f"'{keyword}'" in caught.value.message


# ---- tools ------------------------------------------------------------------------------------


def _call_round_trip(client: openai.OpenAI, calls: list[dict[str, Any]]) -> str:
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls}]
    history += [{"role": "tool", "tool_call_id": c["id"], "content": "12 degrees, rain"} for c in calls]
    answer = client.chat.completions.create(
        model="tools", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    return answer.choices[0].message.content or ""


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    # One call (parallel_tool_calls: false): a random model pads JSON with whitespace, and
    # several calls could run past max_tokens.
    answer = client.chat.completions.create(
        model="tools",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=1000,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        assert call.type == "function"
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Oslo", "Lima")
        assert isinstance(args["celsius"], bool)
        assert call.id.startswith("call_")
    reply = _call_round_trip(client, [c.model_dump(exclude_none=True) for c in calls])
    assert isinstance(reply, str)


def test_streamed_tool_call_round_trip(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(
        model="tools",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=1000,
        stream=True,
    )
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["id"] += delta.id or ""
                if delta.function is not None:
                    entry["function"]["name"] += delta.function.name or ""
                    entry["function"]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert calls
    for call in calls.values():
        assert call["function"]["name"] == "get_time"  # the named function, only
        assert isinstance(json.loads(call["function"]["arguments"])["zone"], int)
    _call_round_trip(client, list(calls.values()))


def test_parallel_calls_and_auto(client: openai.OpenAI) -> None:
    for seed in range(6):
        answer = client.chat.completions.create(
            model="tools",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="auto",
            seed=seed,
            temperature=1.0,
            max_tokens=1000,
        )
        message = answer.choices[0].message
        if message.tool_calls:
            # A reply cut by max_tokens keeps the calls it completed, and says it was cut.
            assert answer.choices[0].finish_reason in ("tool_calls", "length")
            assert 1 <= len(message.tool_calls) <= 8
            names = {c.function.name for c in message.tool_calls}  # type: ignore[union-attr] # functions only
            assert names <= {"get_weather", "get_time"}
        else:  # auto may answer directly: then plain content
            assert isinstance(message.content, str)
    one = client.chat.completions.create(
        model="tools",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=1000,
    )
    assert len(one.choices[0].message.tool_calls or []) == 1


def test_parallel_calls_are_read_in_order() -> None:
    from edgellmd.api.reply import ReplyReader  # noqa: PLC0415

    text = json.dumps(
        {
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Oslo"}},
                {"name": "get_time", "arguments": {"zone": 2}},
                {"name": "not_offered", "arguments": {}},
            ]
        }
    )
    reader = ReplyReader(tools=("get_weather", "get_time"))
    reader.feed(text)
    assert reader.answer == ""
    assert [c.name for c in reader.calls] == ["get_weather", "get_time"]
    assert json.loads(reader.calls[1].arguments_text) == {"zone": 2}
    assert len({c.id for c in reader.calls}) == 2
    answer = ReplyReader(tools=("get_time",))
    answer.feed('{"response": "hi"}')
    assert answer.answer == "hi"
    # A reply cut short inside a call shows neither the internal JSON nor the unfinished call.
    cut = ReplyReader(tools=("get_time",))
    cut.feed('{"tool_calls": [{"na')
    assert cut.answer == ""
    assert cut.calls == []


def test_tools_work_with_a_template_that_cannot_render_them(client: openai.OpenAI) -> None:
    """The server describes the tools in a system turn and shows results as turns the
    template can render: the plain model's template has no tool support (before: 400)."""
    answer = client.chat.completions.create(
        model="plain", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=600, temperature=0
    )
    choice = answer.choices[0]
    # The random tiny model may go on calling until max_tokens: complete calls come back either way.
    assert choice.finish_reason in ("tool_calls", "length"), choice
    assert choice.message.content is None  # never the internal tool-call JSON
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr] # a function call
    json.loads(call.function.arguments)  # type: ignore[union-attr]
    # and the round trip: the result goes back as a turn the template renders
    followup = client.chat.completions.create(
        model="plain",
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_tokens=20,
    )
    assert followup.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---- logprobs, n, logit_bias, seed, models ---------------------------------------------------


def test_chat_logprobs_agree_with_greedy_choices(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="plain", messages=ASK, temperature=0, max_tokens=12, logprobs=True, top_logprobs=4
    )
    content = answer.choices[0].logprobs.content if answer.choices[0].logprobs else None
    assert content is not None
    assert len(content) == answer.usage.completion_tokens if answer.usage else False
    for entry in content:
        assert math.isfinite(entry.logprob)
        assert entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 4
        assert tops == sorted(tops, reverse=True)
        assert all(math.isfinite(t) for t in tops)
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token


def test_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    answer = client.completions.create(model="plain", prompt="Once", temperature=0, max_tokens=6, logprobs=2)
    lp = answer.choices[0].logprobs
    assert lp is not None
    assert lp.tokens is not None
    assert lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value == pytest.approx(max(top.values()))
        assert token in top


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_end_where_a_stop_string_cuts_the_text(client: openai.OpenAI, stream: bool) -> None:
    """Logprobs ran past a stop: the text stopped before the stop string, and the logprobs went
    on with the token that began it (the stop string and what followed it in that token)."""
    free = client.completions.create(model="plain", prompt="Once", temperature=0, max_tokens=8, logprobs=1)
    assert free.choices[0].logprobs is not None
    tokens = free.choices[0].logprobs.tokens
    assert tokens is not None
    k = next(i for i in range(2, len(tokens)) if tokens[i].strip() and tokens[i] not in "".join(tokens[:i]))
    kwargs: dict[str, Any] = {"model": "plain", "prompt": "Once", "temperature": 0, "max_tokens": 8}
    if stream:
        text, shown = "", []
        for chunk in client.completions.create(**kwargs, logprobs=1, stop=[tokens[k]], stream=True):
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None and chunk.choices[0].logprobs.tokens:
                shown += chunk.choices[0].logprobs.tokens
    else:
        answer = client.completions.create(**kwargs, logprobs=1, stop=[tokens[k]])
        assert answer.choices[0].logprobs is not None
        text, shown = answer.choices[0].text, list(answer.choices[0].logprobs.tokens or [])
    assert text == "".join(tokens[:k])
    assert shown == tokens[:k], (tokens, k, text, shown)  # not the stop string's token


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(client: openai.OpenAI, stream: bool) -> None:
    if not stream:
        answer = client.completions.create(
            model="plain",
            prompt="Once",
            max_tokens=5,
            n=3,
            seed=3,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert sorted(c.index for c in answer.choices) == [0, 1, 2]
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 15  # the sum over the choices
        return
    options: Any = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model="plain",
            messages=ASK,
            max_tokens=5,
            n=3,
            seed=3,
            temperature=1.0,
            stream=True,
            stream_options=options,
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}
    usage = chunks[-1].usage
    assert usage is not None
    texts = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    assert usage.completion_tokens <= 15
    assert len(texts) == 3


def test_seeds_reproduce_and_choices_differ(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        answer = client.completions.create(
            model="plain", prompt="The", max_tokens=12, n=2, seed=11, temperature=1.5, top_p=1.0
        )
        return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]

    first = run()
    assert run() == first  # documented: the same seed gives the same text
    single = client.completions.create(model="plain", prompt="The", max_tokens=12, seed=11, temperature=1.5)
    assert single.choices[0].text == first[0]  # choice i uses seed + i


def test_logit_bias_forces_and_bans(client: openai.OpenAI) -> None:
    a = 3 + ord("a")  # the tiny vocabulary: 3 specials, then one token per byte
    forced = client.completions.create(
        model="plain", prompt="x", max_tokens=8, temperature=0, logit_bias={str(a): 100}
    )
    assert forced.choices[0].text == "a" * 8
    plain = client.completions.create(model="plain", prompt="x", max_tokens=8, temperature=0)
    first = plain.choices[0].text.encode()[0]
    banned = client.completions.create(
        model="plain", prompt="x", max_tokens=8, temperature=0, logit_bias={str(3 + first): -100}
    )
    assert banned.choices[0].text.encode()[0] != first


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve("tools")
    assert (model.id, model.object, model.owned_by) == ("tools", "model", "edgellm")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_user_is_logged_as_a_tag(daemon: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    import logging  # noqa: PLC0415

    with caplog.at_level(logging.INFO, logger="edgellmd.access"):
        status, _ = daemon.post(
            "/v1/completions", {"model": "plain", "prompt": "x", "max_tokens": 1, "user": "app-user-42"}
        )
    assert status == 200
    assert any(getattr(r, "user", None) == "app-user-42" for r in caplog.records)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "plain", "prompt": "x", "max_tokens": 1}),
        ("/v1/embeddings", {"model": "embed", "input": "x"}),
    ],
)
def test_a_long_or_unprintable_user_is_logged_short(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    import logging  # noqa: PLC0415

    for user, expected in (("u" * 5000, "u" * 64), ("line\nbreak", "(unprintable)")):
        with caplog.at_level(logging.INFO, logger="edgellmd.access"):
            caplog.clear()
            status, answer = daemon.post(path, {**body, "user": user})
        assert status == 200, answer
        tags = [getattr(r, "user", None) for r in caplog.records if r.name == "edgellmd.access"]
        assert tags == [expected]


def test_tiny_vocabulary_byte_tokens(tmp_path: Path) -> None:
    # Guards the token arithmetic the logit_bias test relies on.
    from tests.ggufmodels import N_VOCAB  # noqa: PLC0415

    assert N_VOCAB == 3 + 256
    del tmp_path


@pytest.mark.parametrize("max_tokens", [10, 30, 60, 90])  # before the name, inside the arguments, ...
def test_a_reply_cut_mid_tool_call_shows_no_internal_json(client: openai.OpenAI, max_tokens: int) -> None:
    args: Any = {
        "model": "plain",
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    answer = client.chat.completions.create(**args)
    choice = answer.choices[0]
    assert choice.finish_reason in ("length", "tool_calls")
    assert not choice.message.content  # before: the internal {"tool_calls": [{"name": ... as text
    for call in choice.message.tool_calls or []:  # only complete calls
        json.loads(call.function.arguments)
    content, names, finish = [], [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            names += [t.function.name for t in c.delta.tool_calls or [] if t.function and t.function.name]
            finish = c.finish_reason or finish
    assert "".join(content) == ""
    assert finish == choice.finish_reason
    assert len(names) <= 1


def test_tool_call_arguments_stream_as_they_are_generated(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="plain",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=400,
        parallel_tool_calls=False,
        stream=True,
        seed=3,
    )
    deltas: list[str] = []
    ids = set()
    for chunk in stream:
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                if t.id:
                    ids.add(t.id)
                if t.function and t.function.arguments:
                    deltas.append(t.function.arguments)
    assert len(ids) == 1
    assert len(deltas) > 3  # one per token or so, not one at the end
    json.loads("".join(deltas))  # and they add up to the whole arguments
