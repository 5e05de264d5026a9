"""The official `openai` client, sync and async, against the daemon: answers, streams and errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Final

import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.serving import RunningDaemon

HELLO: Final[list[ChatCompletionMessageParam]] = [{"role": "user", "content": "hello"}]
MAX_TOKENS: Final = 12
# `ignore_eos` is an extension: exactly MAX_TOKENS tokens, whatever the random weights say.
EXACT: Final = {"ignore_eos": True}


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[openai.OpenAI]:
    """A sync client pointed at the daemon (no retries: a failure must show at once)."""
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
async def aclient(daemon: RunningDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    """An async client pointed at the daemon."""
    async with openai.AsyncOpenAI(
        base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=30
    ) as c:
        yield c


def _check_chat_chunks(chunks: list[ChatCompletionChunk], *, include_usage: bool) -> str:
    """Check a chat stream's chunk sequence and return its text."""
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    assert all(c.model == "tiny" for c in chunks)
    content = chunks[:-1] if include_usage else chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in content[:-1]] == [None] * (len(content) - 1)
    assert content[-1].choices[0].finish_reason == "length"
    if include_usage:
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.usage is None for c in chunks)
    return "".join(c.choices[0].delta.content or "" for c in content)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models] == ["tiny", "notemplate", "builtin"]
    assert all(m.owned_by == "edgellm" for m in models)


def test_chat_non_stream(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT
    )
    assert answer.id.startswith("chatcmpl-")
    assert answer.object == "chat.completion"
    assert answer.model == "tiny"
    [choice] = answer.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + MAX_TOKENS


def test_chat_stream_equals_the_non_streamed_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT
    )
    with client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=EXACT,
        stream=True,
        stream_options={"include_usage": True},
    ) as stream:
        chunks = list(stream)
    text = _check_chat_chunks(chunks, include_usage=True)
    assert text == whole.choices[0].message.content
    assert _counts(chunks[-1].usage) == _counts(whole.usage)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    # Between the role chunk and the finish chunk: one chunk per token that completed some text
    # (each token is one byte here, so never more chunks than tokens), none of them empty.
    deltas = chunks[1:-2]
    assert 1 <= len(deltas) <= MAX_TOKENS
    assert all(c.choices[0].delta.content for c in deltas)


def _counts(usage: CompletionUsage | None) -> tuple[int, int, int]:
    """The token counts, less how they were computed (the second request may find its prompt in a slot)."""
    assert usage is not None
    assert usage.prompt_tokens_details is not None  # the SDK reads edgellm's details
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_chat_stream_without_usage(client: openai.OpenAI) -> None:
    with client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT, stream=True
    ) as stream:
        chunks = list(stream)
    assert _check_chat_chunks(chunks, include_usage=False)


def test_completions_non_stream_and_stream_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny", prompt="hello", max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT
    )
    assert whole.id.startswith("cmpl-")
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == MAX_TOKENS
    with client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=EXACT,
        stream=True,
        stream_options={"include_usage": True},
    ) as stream:
        chunks = list(stream)
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == []
    assert _counts(chunks[-1].usage) == _counts(whole.usage)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text


def test_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert caught.value.type == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_bad_request_errors(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, temperature=-1, stream=stream)
    assert caught.value.status_code == 400
    assert caught.value.code is None
    assert caught.value.param == "temperature"
    assert caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hello", echo=True, stream=stream)
    assert caught.value.code == "unsupported_parameter"
    assert caught.value.param == "echo"


async def test_async_chat_and_stream_agree(aclient: openai.AsyncOpenAI) -> None:
    whole = await aclient.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT
    )
    stream = await aclient.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=EXACT,
        stream=True,
        stream_options={"include_usage": True},
    )
    async with stream:
        chunks = [chunk async for chunk in stream]
    assert _check_chat_chunks(chunks, include_usage=True) == whole.choices[0].message.content
    assert _counts(chunks[-1].usage) == _counts(whole.usage)


async def test_async_completions_stream(aclient: openai.AsyncOpenAI) -> None:
    whole = await aclient.completions.create(
        model="tiny", prompt="hello", max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT
    )
    stream = await aclient.completions.create(
        model="tiny", prompt="hello", max_tokens=MAX_TOKENS, temperature=0, extra_body=EXACT, stream=True
    )
    async with stream:
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


async def test_async_models_and_errors(aclient: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in aclient.models.list()]
    assert models == ["tiny", "notemplate", "builtin"]
    with pytest.raises(openai.NotFoundError) as not_found:
        await aclient.completions.create(model="nope", prompt="hello")
    assert (not_found.value.code, not_found.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as bad:
        await aclient.chat.completions.create(model="tiny", messages=HELLO, temperature=-1)
    assert (bad.value.code, bad.value.param) == (None, "temperature")
