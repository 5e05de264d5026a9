"""Structured output together with tools (openai-agents' Agent with tools and an output_type,
pydantic-ai's tool plus output type): with tool_choice auto the grammar allows a call or an
answer of the format's schema, whose JSON is the answer's text; a required or named call is the
tool grammar alone. On all three families, with the real clients against a real daemon."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import anthropic
import openai
import pytest

from edgellmctl.keys import create_key
from edgellmd.api.anthropic.decode import parse_messages
from edgellmd.api.openai.decode import parse_chat
from edgellmd.api.reply import ReplyReader, TextPart, ToolReplyReader
from edgellmd.api.request import Limits
from edgellmd.api.responses.decode import parse_responses
from edgellmd.errors import ApiError
from tests.bench_grammar_limits import ByteVocab, byte_vocab
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

LIMITS: Final = Limits(max_tokens_limit=512, default_max_tokens=None)
CITY: Any = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}, "warm": {"type": "boolean"}},
    "required": ["city", "warm"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        # every value bounded (maxLength is enforced: not strict), so a random model's call ends
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}},
    },
}
ASK: Any = [{"role": "user", "content": "Is it warm in Oslo?"}]
RESPONSES_TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER["function"]["parameters"],
        "strict": False,
    }
]
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ByteVocab]:
    with byte_vocab(tmp_path_factory.mktemp("structured-tools")) as v:
        yield v


def test_auto_allows_a_call_or_an_answer_of_the_format_and_nothing_else(vocab: ByteVocab) -> None:
    body = parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER], "response_format": FORMAT}, LIMITS)
    grammar = body.common.sampling.grammar
    assert grammar is not None
    assert vocab.parses(grammar)
    call = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}'
    assert vocab.matches(grammar, call)
    assert vocab.matches(grammar, '{"response":{"city":"Oslo","warm":false}}')
    assert not vocab.matches(grammar, '{"response":"it is warm"}')  # text is not the format
    assert not vocab.matches(grammar, '{"response":{"city":"Bergen","warm":false}}')
    required = parse_chat(
        {
            "model": "m",
            "messages": ASK,
            "tools": [WEATHER],
            "response_format": FORMAT,
            "tool_choice": "required",
        },
        LIMITS,
    ).common.sampling.grammar
    assert required is not None
    assert vocab.matches(required, call)
    assert not vocab.matches(required, '{"response":{"city":"Oslo","warm":false}}')


def test_every_family_combines_them_and_still_checks_the_format() -> None:
    responses = parse_responses(
        {
            "model": "m",
            "input": "hi",
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
            ],
            "text": {"format": {"type": "json_schema", "name": "city", "schema": CITY}},
        },
        LIMITS,
    )
    assert responses.chat.common.sampling.grammar is not None
    assert "response" in responses.chat.common.sampling.grammar
    messages = parse_messages(
        {
            "model": "m",
            "max_tokens": 64,
            "messages": ASK,
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "output_config": {"format": {"type": "json_schema", "schema": CITY}},
        },
        LIMITS,
    )
    assert messages.chat.common.sampling.grammar is not None
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    for choice in ("auto", "required"):
        with pytest.raises(ApiError) as caught:
            parse_chat(
                {
                    "model": "m",
                    "messages": ASK,
                    "tools": [WEATHER],
                    "response_format": bad,
                    "tool_choice": choice,
                },
                LIMITS,
            )
        assert caught.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_the_reader_gives_a_structured_answers_json_as_its_text(cut: int) -> None:
    reply = '{"response": {"city": "Oslo", "warm": true, "note": "a } in \\"text\\""}}'
    reader = ToolReplyReader(["get_weather"])
    parts = [p for i in range(0, len(reply), cut) for p in reader.feed(reply[i : i + cut])]
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    assert json.loads(text) == {"city": "Oslo", "warm": True, "note": 'a } in "text"'}
    assert not reader.raw
    assert reader.calls == []


@pytest.mark.parametrize("cut", [1, 2, 5, 1000])
def test_stop_strings_are_matched_in_the_answer_text_never_in_the_tool_call_json(cut: int) -> None:
    """With tools the reply's text is JSON around the answer: the engine matched stop strings
    in that JSON ("\n", '"', "name"), ended the reply and lost the call. The reader matches
    them in the answer text alone, across pieces, and says which one ended it."""

    def read(reply: str, stops: list[str]) -> tuple[str, list[str], str | None]:
        reader = ReplyReader(tools=["get_weather"], stops=stops)
        parts = [p for i in range(0, len(reply), cut) for p in reader.feed(reply[i : i + cut])]
        parts += reader.finish()
        text = "".join(p.text for p in parts if isinstance(p, TextPart))
        return text, [c.name for c in reader.calls], reader.stopped

    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    for stops in (["\n"], ['"'], ["name"], ["{"], ["city"]):
        assert read(call, stops) == ("", ["get_weather"], None), stops
    answer = '{"response": "It is warm.\\nIn Oslo too. END here"}'
    assert read(answer, ["END"]) == ("It is warm.\nIn Oslo too. ", [], "END")
    assert read(answer, ["\n", "too"]) == ("It is warm.", [], "\n")  # the first in the text
    assert read(answer, ["Oslo t"]) == ("It is warm.\nIn ", [], "Oslo t")
    assert read(answer, ["warm!"]) == ("It is warm.\nIn Oslo too. END here", [], None)  # held, then let go


# ---- the real clients ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, str]]:
    root = tmp_path_factory.mktemp("structured-tools-daemon")
    model = write_tiny_model(root / "m.gguf", TinyModelSpec(seed=41))
    keys = root / "keys.yaml"
    _, token = create_key(keys, "app", ["inference"], limits={})
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "slots": 2, "context_size": 2048}],
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        yield daemon, token


def _valid(text: str) -> None:
    value = json.loads(text)
    assert value["city"] in ("Oslo", "Lima")
    assert isinstance(value["warm"], bool)
    assert set(value) == {"city", "warm"}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_chat_and_responses_answer_with_a_call_or_the_formats_json(
    served: Any, seed: int, request: pytest.FixtureRequest
) -> None:
    daemon, token = served
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0, timeout=60)
    request.addfinalizer(client.close)  # its sockets go with the test
    tools: Any = [WEATHER]
    fmt: Any = FORMAT
    chat = client.chat.completions.create(
        model="m", messages=ASK, tools=tools, response_format=fmt, max_tokens=1000, seed=seed
    )
    choice = chat.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
        assert choice.message.content is None
    else:
        assert choice.finish_reason == "stop"
        _valid(choice.message.content or "")
    response = client.responses.create(
        model="m",
        input="Is it warm in Oslo?",
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "parameters": WEATHER["function"]["parameters"],
                "strict": False,
            }
        ],
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
        max_output_tokens=1000,
        extra_body={"seed": seed},
    )
    kinds = [item.type for item in response.output]
    if "function_call" not in kinds:
        assert response.status == "completed"
        _valid(response.output_text)


def test_messages_answer_with_a_tool_use_or_the_formats_json(
    served: Any, request: pytest.FixtureRequest
) -> None:
    daemon, token = served
    client = anthropic.Anthropic(base_url=daemon.url, api_key=token, max_retries=0)
    request.addfinalizer(client.close)
    seen = set()
    for temperature in (0.0, 0.5, 1.0):
        message = client.messages.create(
            model="m",
            max_tokens=1000,
            messages=[{"role": "user", "content": "Is it warm in Oslo?"}],
            tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            extra_body={
                "output_config": {"format": {"type": "json_schema", "schema": CITY}},
                "temperature": temperature,
            },
        )
        seen.add(message.stop_reason)
        if message.stop_reason == "end_turn":
            (block,) = message.content
            assert block.type == "text"
            _valid(block.text)
        else:
            assert message.stop_reason == "tool_use"
    assert seen <= {"end_turn", "tool_use"}


def test_a_stop_string_never_cuts_a_forced_tool_call(served: Any, request: pytest.FixtureRequest) -> None:
    """`stop: ["\\n"]` with a call forced: the engine matched the stop in the call's JSON and
    the reply came back empty (finish_reason stop, no tool_calls; Messages: content [])."""
    daemon, token = served
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0, timeout=60)
    request.addfinalizer(client.close)
    tools: Any = [WEATHER]
    for stop in (["\n"], ['"'], ["name"]):
        chat = client.chat.completions.create(
            model="m", messages=ASK, tools=tools, tool_choice="required", stop=stop, max_tokens=300, seed=3
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", (stop, choice)
        calls = choice.message.tool_calls
        assert calls
        assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    messages = anthropic.Anthropic(base_url=daemon.url, api_key=token, max_retries=0)
    request.addfinalizer(messages.close)
    message = messages.messages.create(
        model="m",
        max_tokens=300,
        messages=[{"role": "user", "content": "Is it warm in Oslo?"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        tool_choice={"type": "any"},
        stop_sequences=["\n"],
    )
    assert message.stop_reason == "tool_use", message
    assert [block.type for block in message.content] == ["tool_use"]


def test_a_stop_string_in_the_answer_text_ends_the_reply_there(
    served: Any, request: pytest.FixtureRequest
) -> None:
    """The answer's text, inside the reply's wrapper, is where the stop strings are matched:
    cut before the first one, the generation ended there (not run on to max_tokens), and the
    finish is `stop`. (`t` is barred, token 3 + 0x74: the wrapper can then only be an answer's.)"""
    daemon, token = served
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0, timeout=60)
    request.addfinalizer(client.close)
    tools: Any = [WEATHER]
    ask: Any = {"model": "m", "messages": ASK, "tools": tools, "max_tokens": 300, "seed": 1}
    bar_t = {"119": -100}
    whole = client.chat.completions.create(**ask, logit_bias=bar_t)
    assert whole.choices[0].finish_reason == "length"
    text = whole.choices[0].message.content or ""
    stops = ["e", "a", " ", "o"]
    first = min((text.find(s), s) for s in stops if s in text)
    cut = client.chat.completions.create(**ask, logit_bias=bar_t, stop=stops)
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: first[0]]
    assert cut.usage is not None
    assert cut.usage.completion_tokens < 300
