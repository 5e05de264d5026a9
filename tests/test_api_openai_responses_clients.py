"""Frameworks on the Responses API against a real daemon: the OpenAI Agents SDK and LangChain's ChatOpenAI."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import agents
import openai
import pydantic
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from tests.serving import RunningDaemon, client_daemon, client_key


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return client_key(tmp_path_factory.mktemp("clients-keys"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, token: tuple[Path, str]) -> Iterator[RunningDaemon]:
    with client_daemon(tmp_path_factory.mktemp("clients"), token[0]) as d:
        yield d


@pytest.fixture(autouse=True, scope="module")
def no_tracing() -> None:
    agents.set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI


def _agent(client: openai.AsyncOpenAI, called: list[str]) -> agents.Agent[None]:
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    # A tiny random model does not decide to stop by itself: one required call ends the run.
    return agents.Agent(
        name="weather",
        instructions="Answer weather questions with the tool.",
        model=agents.OpenAIResponsesModel(model="plain", openai_client=client),
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=600
        ),
        tool_use_behavior="stop_on_first_tool",
    )


@pytest.fixture
async def client(daemon: RunningDaemon, token: tuple[Path, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=daemon.url + "/v1", api_key=token[1], max_retries=0, timeout=60
    ) as c:
        yield c


async def test_agents_sdk_runs_a_tool_to_completion(client: openai.AsyncOpenAI) -> None:
    called: list[str] = []
    result = await agents.Runner.run(_agent(client, called), "What is the weather in Oslo?")
    assert len(called) == 1
    assert result.final_output == f"sunny in {called[0]}"
    assert [type(r).__name__ for r in result.raw_responses] == ["ModelResponse"]


async def test_agents_sdk_streamed(client: openai.AsyncOpenAI) -> None:
    called: list[str] = []
    result = agents.Runner.run_streamed(_agent(client, called), "Weather in Lima?")
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds
    assert len(called) == 1
    assert result.final_output == f"sunny in {called[0]}"


class Forecast(pydantic.BaseModel):
    """The agent's output_type: a pydantic model, sent as a strict text.format / response_format."""

    city: Literal["Paris", "Oslo", "Lima"]
    warm: bool


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_agents_sdk_with_tools_and_an_output_type_finishes(
    client: openai.AsyncOpenAI, api: str
) -> None:
    """openai-agents' standard Agent: tools and an output_type in one request (refused before),
    answered with the output_type's JSON."""
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    model: agents.Model = (
        agents.OpenAIResponsesModel(model="plain", openai_client=client)
        if api == "responses"
        else agents.OpenAIChatCompletionsModel(model="plain", openai_client=client)
    )
    agent = agents.Agent(
        name="forecaster",
        instructions="Use the tool, then answer.",
        model=model,
        tools=[get_weather],
        output_type=Forecast,
        # The tiny random model calls a tool whenever it may (tests/test_api_structured_tools.py
        # holds auto's call-or-answer grammar to both): here the tools ride along unused.
        model_settings=agents.ModelSettings(temperature=0, max_tokens=1000, tool_choice="none"),
    )
    result = await agents.Runner.run(agent, "Is it warm in Oslo?", max_turns=2)
    assert isinstance(result.final_output, Forecast)
    assert called == []
    assert len(result.raw_responses) == 1


def test_langchain_streams_and_the_text_adds_up(daemon: RunningDaemon, token: tuple[Path, str]) -> None:
    llm = ChatOpenAI(
        model="plain",
        use_responses_api=True,
        base_url=daemon.url + "/v1",
        api_key=SecretStr(token[1]),
        max_retries=0,
        temperature=0,
        max_completion_tokens=16,
    )
    whole = llm.invoke("hello")
    chunks = list(llm.stream("hello"))
    assert len(chunks) > 2
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    streamed = "".join(c.text for c in chunks)
    assert streamed == whole.text
    assert streamed


# ---- what Codex CLI sends: a namespace of tools, a hosted tool, client_metadata -----------------

CODEX_TOOLS: Any = [  # Any: the SDK's TypedDict unions, spelled as JSON
    {
        "type": "namespace",
        "name": "files",
        "description": "The workspace's files",
        "tools": [
            {
                "type": "function",
                "name": "read",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "maxLength": 12}},  # enforced: not strict
                    "required": ["path"],
                },
                "strict": False,
            }
        ],
    },
    {"type": "web_search"},
]


async def test_a_codex_shaped_request_calls_a_namespaced_tool(client: openai.AsyncOpenAI) -> None:
    """Codex CLI's shape, whole and streamed: the call comes back as the namespace's own name,
    the hosted tool is left out with a note, and the call sent back continues the conversation."""
    metadata = {"turn_id": "019a-turn", "session_id": "019a-session"}
    asked = {
        "model": "plain",
        "input": "Read README.md",
        "tools": CODEX_TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 600,
        "extra_body": {"client_metadata": metadata},
    }
    response = await client.responses.create(**asked)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("read", "files")
    assert response.metadata == {
        "edgellm_tools_left_out": "tools this server cannot run were left out: web_search"
    }
    stream = await client.responses.create(**asked, stream=True)
    added = [e.item async for e in stream if e.type == "response.output_item.done"]
    assert [(i.name, i.namespace) for i in added if i.type == "function_call"] == [("read", "files")]
    followed = await client.responses.create(
        model="plain",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "# edgellm"}],
        tools=CODEX_TOOLS,
        max_output_tokens=8,
    )
    assert followed.status in ("completed", "incomplete")
    # Listed later, the call keeps its namespace (the model's name for it is namespace__name).
    listed = [i async for i in client.responses.input_items.list(followed.id, order="asc")]
    calls = [i for i in listed if i.type == "function_call"]
    assert [(c.name, c.namespace, c.call_id) for c in calls] == [("read", "files", call.call_id)]
