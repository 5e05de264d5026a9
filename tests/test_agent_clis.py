"""Real coding agents against a real daemon: OpenAI's Codex CLI (`codex exec`, the Responses
API) and Anthropic's Claude Code (`claude -p`, the Messages API), each through one
non-interactive turn with its own full system prompt and tool list.

The CLIs come from npm at test time, into a temporary prefix (skipped when npm or the
registry is not there); each runs with a temporary HOME, a bare environment, its telemetry,
update checks and other nonessential traffic off, and the daemon as its only endpoint.
The tiny model's answer is random bytes and is not judged: what is checked is that the
agent finished its turn and that the daemon refused none of its requests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from edgellmctl.keys import create_key
from edgellmd.http import appkeys
from edgellmd.settings import Settings
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, access_log, running, settings_for

pytestmark = pytest.mark.slow

MODEL: Final = "m"
# The tiny model's vocabulary is one token per byte: Claude Code's prompt (about 17k tokens
# of a real tokenizer, its tools included) is some 70k tokens here, Codex's about 40k.
CONTEXT: Final = 131_072
# The ceiling on any answer, and Codex's default (it asks for no limit): the random model need
# not stop by itself, and each token attends over the whole long prompt. Claude Code asks for
# 32000: its key clamps that to this ceiling.
MAX_TOKENS: Final = 64
CLI_TIMEOUT_S: Final = 720.0
NPM_TIMEOUT_S: Final = 600.0
PROMPT: Final = "Reply with one word: hello. Do not use any tools."
CUT_SHORT: Final = "Incomplete response returned, reason: max_output_tokens"  # Codex's words
OUTPUT_LIMIT: Final = re.compile(r"response exceeded the \d+ output token maximum")  # Claude Code's
# Pinned: a test of what the clients send must not change under it when npm's latest does. Raise
# them on purpose (and read what a new version sends: tests/test_api_field_policy.py).
PACKAGES: Final = ("@openai/codex@0.171.0", "@anthropic-ai/claude-code@2.1.332")
# No install scripts: nothing but the packages themselves is fetched or run at install time
# (Claude Code's postinstall only copies its native binary in place of a stub; the wrapper
# launcher used below finds that binary without it).
NPM_FLAGS: Final = ("--ignore-scripts", "--no-audit", "--no-fund")
# What a refusal by the daemon reads like in a CLI's own error text.
REFUSAL_MARKERS: Final = (
    "unexpected status",
    "unknown_parameter",
    "invalid_request_error",
    "not supported",
    "Extra inputs",
    "API Error: 4",
    "API Error: 5",
)


@dataclass(frozen=True, slots=True)
class Installed:
    """The CLIs as npm put them in a temporary prefix."""

    codex: Path  # the package's node launcher (it execs the vendored binary)
    claude: Path  # the wrapper package's launcher: it works whether or not postinstall ran
    seconds: float


class Unavailable(Exception):
    """The CLIs could not be installed here (no npm, no registry): a reason to skip."""


def install_clis(prefix: Path) -> Installed:
    """`npm install` both CLIs into `prefix`, without install scripts; Unavailable says why not."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise Unavailable("npm and node are needed to install the agent CLIs")
    names = " ".join(PACKAGES)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [npm, "install", "--prefix", str(prefix), *NPM_FLAGS, *PACKAGES],
            capture_output=True,
            text=True,
            timeout=NPM_TIMEOUT_S,
            check=False,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
    except subprocess.TimeoutExpired:
        raise Unavailable(f"npm install of {names} took over {NPM_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise Unavailable(f"npm install of {names} failed (no registry?): {done.stderr.strip()[-600:]}")
    modules = prefix / "node_modules"
    installed = Installed(
        codex=modules / "@openai" / "codex" / "bin" / "codex.js",
        claude=modules / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs",
        seconds=time.monotonic() - started,
    )
    for launcher in (installed.codex, installed.claude):
        assert launcher.is_file(), f"npm installed no {launcher}"
    return installed


@pytest.fixture(scope="module")
def clis(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Both CLIs in a temporary prefix; skip without npm or its registry."""
    try:
        installed = install_clis(tmp_path_factory.mktemp("agent-clis"))
    except Unavailable as exc:
        pytest.skip(str(exc))
    print(f"npm install of both CLIs: {installed.seconds:.1f} s")
    return installed


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(seed=31, context_length=CONTEXT)
    return write_tiny_model(tmp_path_factory.mktemp("agent-model") / "m.gguf", spec)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("agent-keys") / "keys.yaml"
    _, token = create_key(path, "agent", ["inference"], limits={}, max_tokens_over_limit="clamp")
    return path, token


def _settings(model_file: Path, keys: Path) -> Settings:
    return settings_for(
        [
            {
                "name": MODEL,
                "file": str(model_file),
                "slots": 2,
                "context_size": CONTEXT,
                "threads": 2,
                # No n_ctx-wide attention matrix per batch: at this context it would be a GiB.
                "flash_attention": "on",
            }
        ],
        server={
            "max_tokens_limit": MAX_TOKENS,
            "default_max_tokens": MAX_TOKENS,
            "max_body_bytes": 4 * 1024 * 1024,  # Claude Code's body is a few hundred KB
            # A prompt of tens of thousands of tokens takes a while to prefill on two cores.
            "progress_timeout_s": CLI_TIMEOUT_S,
        },
        lifecycle={"watch": False},
        auth={"keys_file": str(keys)},
    )


@dataclass(frozen=True, slots=True)
class Run:
    """A finished CLI process."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def tail(self) -> str:
        out, err = self.stdout[-4000:], self.stderr[-4000:]
        return f"exit {self.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


def run_cli(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float = CLI_TIMEOUT_S) -> Run:
    """Run a CLI to its end, or kill its whole process group after `timeout` seconds."""
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,  # `codex exec` would otherwise wait for more prompt on stdin
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the launchers spawn the native binaries: kill them all
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Run(proc.returncode, out, err, time.monotonic() - started, timed_out=True)
    return Run(proc.returncode, out, err, time.monotonic() - started, timed_out=False)


def base_env(home: Path) -> dict[str, str]:
    """A bare environment: no API key, proxy or config of the machine's reaches the CLIs."""
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "TERM": "dumb",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def timings(daemon: RunningDaemon) -> str:
    """Prompt tokens and mean time to first token, from the daemon's own metrics."""
    assert daemon.app is not None
    registry = daemon.app[appkeys.METRICS].registry
    labels = {"model": MODEL, "model_name": MODEL}
    prompt = registry.get_sample_value("edgellm_prompt_tokens_total", labels) or 0.0
    count = registry.get_sample_value("edgellm_time_to_first_token_seconds_count", labels) or 0.0
    total = registry.get_sample_value("edgellm_time_to_first_token_seconds_sum", labels) or 0.0
    ttft = f"{total / count:.1f} s" if count else "n/a"
    return f"daemon: {count:.0f} generations, {prompt:.0f} prompt tokens in all, mean TTFT {ttft}"


def refusals(text: str) -> list[str]:
    return [marker for marker in REFUSAL_MARKERS if marker in text]


def codex_config(url: str, *, model: str = MODEL, context: int = CONTEXT) -> str:
    """~/.codex/config.toml: the daemon at `url` as its only provider; analytics, feedback, OTel,
    updates off."""
    return f"""\
model = "{model}"
model_provider = "edgellm"
model_context_window = {context}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.edgellm]
name = "edgellm"
base_url = "{url}/v1"
env_key = "EDGELLM_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {int(CLI_TIMEOUT_S * 1000)}

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
metrics_exporter = "none"
trace_exporter = "none"

[history]
persistence = "none"
"""


def test_codex_exec_finishes_a_turn(
    clis: Installed, model_file: Path, keys: tuple[Path, str], tmp_path: Path
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    env = {**base_env(home), "CODEX_HOME": str(home / ".codex"), "EDGELLM_API_KEY": keys[1]}
    with running(_settings(model_file, keys[0])) as daemon, access_log() as log:
        (home / ".codex" / "config.toml").write_text(codex_config(daemon.url))
        argv = ["node", str(clis.codex), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral"]
        run = run_cli([*argv, "--json", "--color", "never", PROMPT], env=env, cwd=work)
        print(f"codex exec: exit {run.returncode} after {run.seconds:.1f} s; {timings(daemon)}")
        print(f"access log: {log.lines}")

    assert not run.timed_out, f"codex ran past {CLI_TIMEOUT_S:.0f} s and was killed\n{run.tail()}"

    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    events: list[dict[str, Any]] = [json.loads(line) for line in lines]
    # Top-level error events are the CLI's transport and HTTP errors (a warning such as the
    # missing model metadata comes as an item of type "error", not one of these).
    errors = [e for e in events if e.get("type") in {"error", "turn.failed"}]
    assert not log.refused(), f"the daemon refused Codex: {log.refused()}\n{run.tail()}"
    assert not refusals(run.stderr), run.tail()
    assert log.answered("/v1/responses") >= 1, log.lines
    answers = [e for e in events if e.get("type") == "item.completed" and _item_type(e) == "agent_message"]
    assert answers, f"Codex showed no answer\n{run.tail()}"
    if any(_message(e) == CUT_SHORT for e in errors):
        # Codex asks for no output limit and a random model need not stop by itself: the
        # daemon ended the answer at default_max_tokens (status incomplete), which Codex
        # reports as a failed turn after showing the text. The answer's length, not the protocol.
        assert all(_message(e) == CUT_SHORT for e in errors), f"Codex reported errors: {errors}\n{run.tail()}"
        return
    assert not errors, f"Codex reported errors: {errors}\n{run.tail()}"
    assert run.returncode == 0, run.tail()
    assert "turn.completed" in [e.get("type") for e in events], run.tail()


def _item_type(event: dict[str, Any]) -> Any:
    item = event.get("item")
    return item.get("type") if isinstance(item, dict) else None


def _message(event: dict[str, Any]) -> Any:
    """An error event's text: `message` on an error, `error.message` on a failed turn."""
    error = event.get("error")
    return error.get("message") if isinstance(error, dict) else event.get("message")


def claude_env(home: Path, url: str, token: str, *, model: str = MODEL) -> dict[str, str]:
    """Claude Code's environment: the daemon at `url` as its API, nonessential traffic off."""
    return {
        **base_env(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": token,
        # Every model Claude Code may pick for a side request is the daemon's one model.
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0",  # a refusal shows as it is, not as a retry loop
        "API_TIMEOUT_MS": str(int(CLI_TIMEOUT_S * 1000)),
    }


def test_claude_code_print_finishes_a_turn(
    clis: Installed, model_file: Path, keys: tuple[Path, str], tmp_path: Path
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with running(_settings(model_file, keys[0])) as daemon, access_log() as log:
        env = claude_env(home, daemon.url, keys[1])
        argv = ["node", str(clis.claude), "-p", PROMPT, "--model", MODEL, "--output-format", "json"]
        run = run_cli([*argv, "--max-turns", "1", "--no-session-persistence"], env=env, cwd=work)
        print(f"claude -p: exit {run.returncode} after {run.seconds:.1f} s; {timings(daemon)}")
        print(f"access log: {log.lines}")

    assert not run.timed_out, f"claude ran past {CLI_TIMEOUT_S:.0f} s and was killed\n{run.tail()}"

    assert not log.refused(), f"the daemon refused Claude Code: {log.refused()}\n{run.tail()}"
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.tail()
    result: dict[str, Any] = json.loads(lines[-1])
    assert result.get("type") == "result", run.tail()
    assert result.get("api_error_status") is None, run.tail()
    assert not refusals(run.stderr), run.tail()
    assert log.answered("/v1/messages") >= 1, log.lines
    if result.get("is_error") or run.returncode != 0:
        # Two ends that are the random answer's, with every request answered (checked above):
        # it was a tool call, and the one allowed turn ended there; or it ran to the ceiling
        # (stop_reason max_tokens), Claude Code asked to resume three times, then gave up.
        text = str(result.get("result"))
        assert result.get("subtype") == "error_max_turns" or OUTPUT_LIMIT.search(text), run.tail()
