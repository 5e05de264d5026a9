"""What a max_tokens past the ceiling gets: a 400 (the default), or the ceiling when the server's or
the key's `max_tokens_over_limit` is clamp (what agent CLIs need: Claude Code asks for 32,000),
told in the `x-max-tokens-clamped` header; the real clients of every family, real keys."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import yaml

from edgellmctl.__main__ import main as ctl
from edgellmctl.keys import create_key
from edgellmd.keys import KeysFileError, read_keys_file
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

CEILING = 64
AGENT_ASKS = 32_000  # Claude Code's max_tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, dict[str, str]]]:
    root = tmp_path_factory.mktemp("maxtokens")
    model = write_tiny_model(root / "m.gguf", TinyModelSpec(seed=5))
    keys = root / "keys.yaml"
    tokens = {
        "strict": create_key(keys, "strict", ["inference"], limits={})[1],
        "agent": create_key(keys, "agent", ["inference"], limits={}, max_tokens_over_limit="clamp")[1],
        "small": create_key(
            keys, "small", ["inference"], limits={"max_tokens": 8}, max_tokens_over_limit="clamp"
        )[1],
    }
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "slots": 2, "context_size": 512}],
        server={"max_tokens_limit": CEILING},
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        yield daemon, tokens


@pytest.fixture
def clients(served: Any) -> Iterator[Callable[[str], openai.OpenAI]]:
    """An OpenAI client per key asked for, every one closed (its sockets) when the test ends."""
    daemon, _ = served
    made: list[openai.OpenAI] = []

    def client(token: str) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0, timeout=60))
        return made[-1]

    yield client
    for each in made:
        each.close()


def test_past_the_ceiling_is_refused_by_default(served: Any, clients: Callable[[str], openai.OpenAI]) -> None:
    _, tokens = served
    with pytest.raises(openai.BadRequestError) as caught:
        clients(tokens["strict"]).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=AGENT_ASKS
        )
    assert caught.value.body is not None
    assert f"at most {CEILING}" in str(caught.value.body)


def test_a_clamping_key_gets_the_ceiling_and_is_told_so_on_every_family(
    served: Any, clients: Callable[[str], openai.OpenAI]
) -> None:
    daemon, tokens = served
    client = clients(tokens["agent"])
    raw = client.chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=AGENT_ASKS,
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-max-tokens-clamped"] == str(CEILING)
    usage = raw.parse().usage
    assert usage is not None
    assert usage.completion_tokens == CEILING  # ignore_eos: it ran to the ceiling
    responses = client.responses.with_raw_response.create(model="m", input="hi", max_output_tokens=AGENT_ASKS)
    assert responses.headers["x-max-tokens-clamped"] == str(CEILING)
    assert responses.parse().max_output_tokens == CEILING  # the response says what it ran with
    with (
        anthropic.Anthropic(base_url=daemon.url, api_key=tokens["agent"], max_retries=0) as messages,
        messages.messages.with_streaming_response.create(
            model="m", max_tokens=AGENT_ASKS, messages=[{"role": "user", "content": "hi"}], stream=True
        ) as streamed,
    ):
        assert streamed.headers["x-max-tokens-clamped"] == str(CEILING)
        assert "event: message_stop" in "\n".join(streamed.iter_lines())
    # Within the ceiling nothing is cut, and nothing is said.
    fine = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert "x-max-tokens-clamped" not in fine.headers


def test_a_keys_own_lower_ceiling_is_what_it_is_clamped_to(
    served: Any, clients: Callable[[str], openai.OpenAI]
) -> None:
    _, tokens = served
    raw = clients(tokens["small"]).completions.with_raw_response.create(
        model="m", prompt="hi", max_tokens=CEILING, extra_body={"ignore_eos": True}
    )
    assert raw.headers["x-max-tokens-clamped"] == "8"
    usage = raw.parse().usage
    assert usage is not None
    assert usage.completion_tokens == 8


def test_the_server_policy_clamps_every_key(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=5))
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "slots": 1, "context_size": 256}],
        server={"max_tokens_limit": 16, "max_tokens_over_limit": "clamp"},
    )
    with running(settings) as daemon:
        status, _ = daemon.post(
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000},
        )
        assert status == 200


def test_edgellmctl_writes_the_policy_and_the_keys_file_refuses_a_wrong_one(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    args = ["--name", "agent", "--scope", "inference", "--max-tokens-over-limit", "clamp"]
    assert ctl(["keys", "create", "--file", str(keys), *args]) == 0
    (key,) = read_keys_file(keys).values()
    assert key.max_tokens_over_limit == "clamp"
    data = yaml.safe_load(keys.read_text())
    data["keys"][0]["max_tokens_over_limit"] = "stretch"
    keys.write_text(yaml.safe_dump(data))
    with pytest.raises(KeysFileError, match=r"keys\[0\].max_tokens_over_limit: must be one of refuse, clamp"):
        read_keys_file(keys)
