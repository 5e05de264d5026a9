"""pydantic-ai's Agent with a tool and an output type, run to its final output against a real
daemon on each family pydantic-ai speaks to a custom base URL: OpenAI chat
(`OpenAIChatModel`), OpenAI Responses (`OpenAIResponsesModel`) and Anthropic Messages
(`AnthropicModel`).

Each run is two requests, one step each: the agent calls its tool, then sends the result back
and gets the output type. The tiny random model calls a tool whenever it may (auto would loop),
so `tool_choice` is set per step, as pydantic-ai documents it (model settings from a callable):
the tool by name first, then `'none'`. What the families exercise, by output mode:

- `ToolOutput` (pydantic-ai's default): the output type is an output tool, `final_result`,
  offered beside the function tool. Step 1 forces the function tool by name (chat's
  `{"type": "function", "function": {...}}`, Responses' `{"type": "function", "name"}`,
  Messages' `{"type": "tool", "name"}`); step 2's `'none'` becomes `final_result` forced by
  name with the function tool riding along unused. The tool's result goes back in each
  family's own shape: a `tool` message, a `function_call_output` item, a `tool_result` block.
- `NativeOutput`: the output type is the family's structured output (chat `response_format`,
  Responses `text.format`, Messages `output_config.format`) in the same request as the tools,
  which the daemon refused before issue 28. Step 1 is `tool_choice` required (the one function
  tool), step 2 `none`: the answer is the schema's JSON as text.

`PromptedOutput` (the schema only in the prompt, nothing constrained) is not run: the random
model's text would not parse. Every run is also streamed (an event stream handler makes
pydantic-ai stream each request). The daemon must answer every request with a 200 (its access
log).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx2
import pydantic
import pytest
from pydantic_ai import Agent, NativeOutput, RunContext, ToolOutput
from pydantic_ai.messages import AgentStreamEvent, ToolCallPart, ToolReturnPart
from pydantic_ai.models import Model
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.profiles import ModelProfile
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.serving import AccessLog, RunningDaemon, access_log, client_daemon, client_key, wait_for

pytestmark = pytest.mark.slow

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


class Forecast(pydantic.BaseModel):
    """The agent's output type."""

    city: Literal["Paris", "Oslo", "Lima"]
    warm: bool


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return client_key(tmp_path_factory.mktemp("pydantic-ai-keys"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, token: tuple[Path, str]) -> Iterator[RunningDaemon]:
    with client_daemon(tmp_path_factory.mktemp("pydantic-ai"), token[0]) as d:
        yield d


@pytest.fixture
def log() -> Iterator[AccessLog]:
    with access_log() as lines:
        yield lines


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    # The SDKs' own HTTP library (openai and anthropic take an httpx2 client), closed per test.
    async with httpx2.AsyncClient(timeout=60) as client:
        yield client


def _structured(profile: ModelProfile) -> ModelProfile:
    """pydantic-ai turns native structured output on only for the Claude models it knows;
    every model of the daemon takes `output_config.format`."""
    return {**profile, "supports_json_schema_output": True}


def _model(family: str, daemon: RunningDaemon, token: str, http: httpx2.AsyncClient) -> Model:
    if family == "messages":
        provider = AnthropicProvider(base_url=daemon.url, api_key=token, http_client=http)
        return AnthropicModel("plain", provider=provider, profile=_structured)
    openai = OpenAIProvider(base_url=daemon.url + "/v1", api_key=token, http_client=http)
    return (
        OpenAIChatModel("plain", provider=openai)
        if family == "chat"
        else OpenAIResponsesModel("plain", provider=openai)
    )


def _per_step(ctx: RunContext[None]) -> ModelSettings:
    """The tool by name on the first step, then no function tool: the run is two requests."""
    return {
        "temperature": 0,
        "max_tokens": 400,
        "parallel_tool_calls": False,
        "tool_choice": ["get_weather"] if ctx.run_step == 1 else "none",
        # anthropic>=2 sends `anthropic-version: 2026-10-21`, for which pydantic-ai drops
        # `temperature` (that version's API refuses it); the daemon reads no version header,
        # and the older one keeps the run deterministic.
        "extra_headers": {"anthropic-version": "2023-06-01"},
    }


async def _drain(_ctx: RunContext[None], events: AsyncIterable[AgentStreamEvent]) -> None:
    async for _ in events:
        pass


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["tool", "native"])
@pytest.mark.parametrize("family", ["chat", "responses", "messages"])
async def test_an_agent_with_a_tool_and_an_output_type_finishes(
    daemon: RunningDaemon,
    token: tuple[Path, str],
    http: httpx2.AsyncClient,
    log: AccessLog,
    family: str,
    mode: str,
    streamed: bool,
) -> None:
    called: list[str] = []
    output: Any = ToolOutput(Forecast) if mode == "tool" else NativeOutput(Forecast)
    agent = Agent(
        _model(family, daemon, token[1], http),
        output_type=output,
        instructions="Look the weather up with the tool, then answer.",
        model_settings=_per_step,
    )

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    result = await agent.run("Is it warm in Oslo?", event_stream_handler=_drain if streamed else None)

    assert isinstance(result.output, Forecast)
    assert len(called) == 1
    # A stream's access line is written when the daemon closes it, maybe after the client read it.
    wait_for(lambda: len(log.lines) >= 2, timeout=10, what="both access lines")
    assert not log.refused(), log.refused()
    assert [a.path for a in log.lines if a.path.startswith("/v1/")] == [PATHS[family]] * 2
    parts = [part for message in result.all_messages() for part in message.parts]
    calls = [p.tool_name for p in parts if isinstance(p, ToolCallPart)]
    assert calls == (["get_weather", "final_result"] if mode == "tool" else ["get_weather"])
    returned = [p for p in parts if isinstance(p, ToolReturnPart) and p.tool_name == "get_weather"]
    assert [r.content for r in returned] == [f"sunny in {called[0]}"]
