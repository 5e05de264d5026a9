"""Reasoning models (`reasoning: deepseek`): the text between the thinking tags is reasoning, not answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

# A template that opens the model's thinking itself, as DeepSeek R1's and Qwen3's do.
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    root = tmp_path_factory.mktemp("reasoning")
    thinker = write_tiny_model(root / "thinker.gguf", TinyModelSpec(seed=61, chat_template=THINKING_TEMPLATE))
    plain = write_tiny_model(root / "plain.gguf", TinyModelSpec(seed=62))
    settings = settings_for(
        [
            {
                "name": "thinker",
                "file": str(thinker),
                "slots": 2,
                "context_size": 1024,
                "threads": 1,
                "reasoning": "deepseek",
            },
            {
                "name": "opener",
                "file": str(plain),
                "slots": 1,
                "context_size": 1024,
                "threads": 1,
                "reasoning": "deepseek",
            },
            {"name": "plain", "file": str(plain), "slots": 1, "context_size": 1024, "threads": 1},
        ],
        lifecycle={"watch": False},
    )
    with running(settings) as d:
        yield d


def _format(pattern: str) -> dict[str, Any]:
    # The grammar writes a JSON string: `"` + what the pattern allows + `"`.
    return {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": {"type": "string", "pattern": pattern}},
    }


def test_a_template_that_opens_the_thinking_makes_the_reply_reasoning_until_the_close_tag(
    daemon: RunningDaemon,
) -> None:
    status, body = daemon.post(
        "/v1/chat/completions",
        {
            "model": "thinker",
            "messages": ASK,
            "max_tokens": 64,
            "temperature": 0,
            "response_format": _format("^ab</think>cd$"),
        },
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == '"ab'
    assert message["content"].rstrip() == 'cd"'  # the JSON grammar allows trailing whitespace


def test_an_unclosed_thought_is_all_reasoning_and_no_answer(daemon: RunningDaemon) -> None:
    status, body = daemon.post(
        "/v1/chat/completions",
        {
            "model": "thinker",
            "messages": ASK,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] == ""
    assert len(message["reasoning_content"]) > 0
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_reply_that_opens_its_own_thinking_is_split_too(daemon: RunningDaemon) -> None:
    status, body = daemon.post(
        "/v1/chat/completions",
        {
            "model": "opener",
            "messages": ASK,
            "max_tokens": 64,
            "temperature": 0,
            "response_format": _format("^<think>hm</think>yes$"),
        },
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    # The reply starts with the quote the JSON string needs, so it does not open with the tag:
    # it is all answer; a reply opening with the tag is split (see tests/test_api_reply.py).
    assert message["content"].rstrip() == '"<think>hm</think>yes"'
    status, body = daemon.post(
        "/v1/chat/completions",
        {
            "model": "plain",
            "messages": ASK,
            "max_tokens": 64,
            "temperature": 0,
            "response_format": _format("^ab</think>cd$"),
        },
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].rstrip() == '"ab</think>cd"'  # no reasoning: as written
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_reasoning_streams_as_reasoning_content_deltas(daemon: RunningDaemon) -> None:
    import urllib.request  # noqa: PLC0415 - a raw SSE read

    body = json.dumps(
        {
            "model": "thinker",
            "messages": ASK,
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
            "response_format": _format("^abcdef</think>ghijkl$"),
        }
    ).encode()
    request = urllib.request.Request(  # noqa: S310 - loopback
        daemon.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    reasoning, content = [], []
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - loopback
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            if delta.get("content"):
                content.append(delta["content"])
    assert "".join(reasoning) == '"abcdef'
    assert "".join(content).rstrip() == 'ghijkl"'
    assert len(reasoning) > 1  # token by token, not at the end
