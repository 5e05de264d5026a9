"""Agent loops against the daemon: Claude Code or Codex CLI through three turns, and for every
request its prompt tokens, the tokens it reused (a slot's prefix or the prompt cache) and its
time to first token.

Run: `.venv/bin/python -m tests.bench_agents --cli claude|codex [--model tiny|demo]
[--prompt-cache-mb N] [--slots 2] [--max-turns 2] [--max-tokens N] [--turns 3]
[--npm-prefix DIR]`. The CLIs come from npm as in tests/test_agent_clis.py (pinned versions,
no install scripts, a bare environment); the daemon runs in this process on a key with
`max_tokens_over_limit: clamp`. Turn 1 asks for a look at a file (Claude Code with
`--max-turns`, so that a tool call brings a follow-up request); turn 2 continues the session
(`claude -p --continue`, `codex exec resume --last`); turn 3 is a new session in the same
folder. `tiny` is the tests' byte-per-token model (context 131072), `demo` Gemma 3 270M
(context 32768, the quick start's settings otherwise). For each request after the first
it also prints where its prompt parts from the earlier prompt it shares most with: the text
on both sides, which shows why a follow-up reuses less than its predecessor's whole prompt.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgellmctl.keys import create_key
from edgellmd.api import session
from edgellmd.engine.drafts import common_prefix
from edgellmd.engine.generation import Generation
from edgellmd.host.metrics import Metrics, TokenTiming
from edgellmd.settings import Settings
from tests.bench_structured import demo_model
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import access_log, running, settings_for
from tests.test_agent_clis import (
    CLI_TIMEOUT_S,
    base_env,
    claude_env,
    codex_config,
    install_clis,
    run_cli,
)

TURN_1 = "Read notes.txt and tell me in one sentence what it asks for."
TURN_2 = "Thanks. Now say which file you read, in one word."
TURN_3 = "What does notes.txt ask for? One sentence."  # a new session in the same folder
NOTES = "Please water the plants on Friday.\n"
SHOWN = 60  # characters shown on each side of where a prompt parts from an earlier one


@dataclass
class Record:
    """One generation the daemon ran: its prompt, its result and its timer."""

    tokens: list[int]
    gen: Generation
    arrived: float
    turn: int
    timing: TokenTiming | None = None


@dataclass
class Recorder:
    """Every generation submitted while it is installed, in submission order."""

    records: list[Record] = field(default_factory=list)
    turn: int = 0  # the CLI run under way


@contextmanager
def recording() -> Iterator[Recorder]:
    """Wrap the session's submission and the metrics' timer to see each request's figures.

    Both are called in one synchronous stretch per request (api.session.generation_session),
    so the timer made right after a submission is that submission's.
    """
    recorder = Recorder()
    submit, timing = session._submit_all, Metrics.timing

    def submit_all(*args: Any, **kwargs: Any) -> list[Generation]:
        gens = submit(*args, **kwargs)
        recorder.records.append(Record(list(args[2]), gens[0], time.monotonic(), recorder.turn))
        return gens

    def timer(self: Metrics, model: str, arrived: float | None = None) -> TokenTiming:
        made = timing(self, model, arrived)
        last = recorder.records[-1] if recorder.records else None
        if last is not None and last.timing is None:
            last.timing = made
            last.arrived = arrived if arrived is not None else last.arrived
        return made

    session._submit_all = submit_all
    Metrics.timing = timer  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        session._submit_all = submit
        Metrics.timing = timing  # type: ignore[method-assign]


def vocabulary(model: Path) -> list[bytes]:
    """The GGUF's token pieces as bytes, for showing prompts (byte tokens as their byte)."""
    from gguf import GGUFReader  # noqa: PLC0415 - only the benchmark reads pieces

    reader = GGUFReader(model)
    field_ = reader.fields["tokenizer.ggml.tokens"]
    out = []
    for i in field_.data:
        piece = bytes(field_.parts[i])
        if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece)
    return out


def text(tokens: Sequence[int], vocab: list[bytes]) -> str:
    joined = b"".join(vocab[t] if 0 <= t < len(vocab) else f"<{t}>".encode() for t in tokens)
    return joined.decode("utf-8", "replace").replace("\u2581", " ")


def report(records: list[Record], vocab: list[bytes]) -> list[dict[str, Any]]:
    """Print a row per request and where each later prompt parts from its closest predecessor."""
    rows: list[dict[str, Any]] = []
    print(f"{'#':>2} turn {'prompt':>7} {'cached':>7} {'shared':>7} {'queue s':>7} {'TTFT s':>7} new tok/s")
    for k, rec in enumerate(records):
        final = rec.gen.final
        prompt = final.prompt_tokens if final is not None else len(rec.tokens)
        cached = final.cached_tokens if final is not None else 0
        queue = final.queue_s if final is not None else 0.0
        first = rec.timing.first_at if rec.timing is not None else None
        ttft = None if first is None else first - rec.arrived
        best, shared = -1, 0
        for j in range(k):
            n = common_prefix(rec.tokens, records[j].tokens)
            if n > shared:
                best, shared = j, n
        rate = (prompt - cached) / ttft if ttft else 0.0
        rows.append(
            {
                "turn": rec.turn,
                "prompt": prompt,
                "cached": cached,
                "shared": shared,
                "with": best,
                "queue_s": queue,
                "ttft_s": ttft,
            }
        )
        shown = "-" if ttft is None else f"{ttft:.1f}"
        figures = f"{prompt:>7} {cached:>7} {shared:>7} {queue:>7.1f} {shown:>7} {rate:>9.0f}"
        print(f"{k:>2} {rec.turn:>4} {figures}")
    for k, rec in enumerate(records):
        row = rows[k]
        if row["with"] < 0:
            continue
        other = records[row["with"]].tokens
        at = row["shared"]
        print(
            f"\n#{k} parts from #{row['with']} at token {at} of {len(rec.tokens)}"
            f" (#{row['with']}: {len(other)}):"
        )
        print(f"  before: {text(rec.tokens[max(0, at - 20) : at], vocab)!r}")
        print(f"  #{k}:   {text(rec.tokens[at : at + 30], vocab)[:SHOWN]!r}")
        print(f"  #{row['with']}:   {text(other[at : at + 30], vocab)[:SHOWN]!r}")
    return rows


def daemon_settings(args: argparse.Namespace, model: Path, keys: Path) -> tuple[Settings, str, int]:
    if args.model == "tiny":
        name, context = "m", 131_072
        entry: dict[str, Any] = {"flash_attention": "on"}  # no n_ctx-wide attention matrix per batch
    else:
        name, context = "gemma3-270m", 32_768
        entry = {"batch_size": 512, "chat_template": "gemma"}  # the quick start's
    entry |= {"name": name, "file": str(model), "slots": args.slots, "context_size": context, "threads": 2}
    if args.prompt_cache_mb:
        entry["prompt_cache_mb"] = args.prompt_cache_mb
    settings = settings_for(
        [entry],
        server={
            "max_tokens_limit": args.max_tokens,
            "default_max_tokens": args.max_tokens,  # Codex asks for no limit
            "max_body_bytes": 4 * 1024 * 1024,
            "progress_timeout_s": CLI_TIMEOUT_S,
        },
        lifecycle={"watch": False},
        auth={"keys_file": str(keys)},
    )
    return settings, name, context


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cli", choices=["claude", "codex"], required=True)
    p.add_argument("--model", choices=["tiny", "demo"], default="tiny")
    p.add_argument("--prompt-cache-mb", type=int, default=0)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=2, help="Claude Code's --max-turns per turn")
    p.add_argument("--turns", type=int, choices=[1, 2, 3], default=3)
    p.add_argument("--max-tokens", type=int, default=64, help="the answer ceiling (clamped to it)")
    p.add_argument("--npm-prefix", type=Path, help="where the CLIs are (installed there if not)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per CLI run")
    p.add_argument("--out", type=Path, help="write the rows as JSON")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        root = Path(tmp)
        prefix = args.npm_prefix or root / "npm"
        clis = install_clis(prefix)
        model = (
            write_tiny_model(root / "m.gguf", TinyModelSpec(seed=31, context_length=131_072))
            if args.model == "tiny"
            else demo_model(root)
        )
        keys = root / "keys.yaml"
        token = create_key(keys, "agent", ["inference"], limits={}, max_tokens_over_limit="clamp")[1]
        settings, name, context = daemon_settings(args, model, keys)
        home, work = root / "home", root / "work"
        work.mkdir()
        (work / "notes.txt").write_text(NOTES)
        started = time.monotonic()
        with running(settings) as daemon, access_log() as log, recording() as recorder:
            if args.cli == "claude":
                home.mkdir()
                env = claude_env(home, daemon.url, token, model=name)
                argv = ["node", str(clis.claude), "-p", "--model", name, "--output-format", "json"]
                # No subagents: a turn is one conversation (Gemma called Agent at random, and
                # each subagent's requests queued beside the measured ones).
                argv += ["--max-turns", str(args.max_turns), "--disallowedTools", "Agent", "Workflow", "--"]
                turns = [[*argv, TURN_1], [*argv[:-1], "--continue", "--", TURN_2], [*argv, TURN_3]]
            else:
                (home / ".codex").mkdir(parents=True)
                (home / ".codex" / "config.toml").write_text(
                    codex_config(daemon.url, model=name, context=context)
                )
                env = {**base_env(home), "CODEX_HOME": str(home / ".codex"), "EDGELLM_API_KEY": token}
                codex = ["node", str(clis.codex), "exec"]
                flags = ["--skip-git-repo-check", "--json"]  # `exec resume` takes no --color
                turns = [
                    [*codex, *flags, TURN_1],
                    [*codex, "resume", "--last", *flags, TURN_2],
                    [*codex, *flags, TURN_3],
                ]
            for turn, command in enumerate(turns[: args.turns], 1):
                recorder.turn = turn
                run = run_cli(command, env=env, cwd=work, timeout=args.timeout)
                print(f"turn {turn}: exit {run.returncode} after {run.seconds:.1f} s")
                if run.returncode != 0 or run.timed_out:
                    print(run.tail())
        print(
            f"{args.cli} on {args.model}, slots {args.slots}, prompt_cache_mb {args.prompt_cache_mb}: "
            f"{len(recorder.records)} requests in {time.monotonic() - started:.0f} s;"
            f" refused: {log.refused()}"
        )
        rows = report(recorder.records, vocabulary(model))
        if args.out:
            args.out.write_text(
                json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, default=str)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
