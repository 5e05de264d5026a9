"""`edgellmctl bench`: drive any OpenAI-compatible server with streamed requests and print figures."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from edgellmctl.cli import (
    CommandError,
    Subcommands,
    add_key_options,
    http_url,
    int_at_least,
    positive_int,
    read_key,
    redact,
)
from edgellmd.files import UnsuitableFile, read_regular

DEFAULT_PROMPT: Final = "Once upon a time, in a small village by the sea,"
KEY_ENV: Final = "EDGELLM_API_KEY"
KEY_FILE_ENV: Final = "EDGELLM_API_KEY_FILE"
MAX_SCHEMA_BYTES: Final = 1024 * 1024
MAX_PROMPT_BYTES: Final = 4 * 1024 * 1024
CONNECT_TIMEOUT_S: Final = 10.0
# A stream that sends nothing for this long is counted as a connection error; long
# generations are fine as long as tokens keep coming.
READ_TIMEOUT_S: Final = 300.0
ENDPOINT_PATHS: Final = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CONNECTION: Final = "connection"
TRUNCATED: Final = "truncated"
BAD_STREAM: Final = "bad stream"
DONE: Final = b"[DONE]"


class BenchError(Exception):
    """The benchmark cannot run at all (server unreachable, no model to use)."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run, validated by the argument parser."""

    base_url: str
    model: str | None
    concurrency: int
    requests: int
    max_tokens: int
    prompt: str = DEFAULT_PROMPT
    endpoint: str = "completions"
    key: str | None = field(default=None, repr=False)  # never in a repr or a log
    warmup: int = 1
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None  # chat only: structured output to measure
    temperature: float = 0.8
    system: str | None = None  # a system prompt every request starts with (chat: a system message)
    users: int = 0  # closed-loop users holding conversations; 0: every request is a fresh prompt


@dataclass(frozen=True, slots=True)
class Speed:
    """A reply's own account of speculation and prompt reuse, in whichever form the server gives it.

    edgellmd and OpenAI: `usage.completion_tokens_details.accepted_prediction_tokens` and
    `rejected_prediction_tokens`, `usage.prompt_tokens_details.cached_tokens`. llama-server:
    `timings.draft_n`, `draft_n_accepted` and `cache_n`.
    """

    drafted: int
    accepted: int
    cached: int


def speed_of(chunk: Any) -> Speed | None:
    """The Speed a chunk (or a whole answer) reports, or None when it reports none."""
    if not isinstance(chunk, dict):
        return None
    usage, timings = chunk.get("usage"), chunk.get("timings")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens_details"), dict):
        details = usage["completion_tokens_details"]
        prompt = usage.get("prompt_tokens_details")
        accepted = _count(details.get("accepted_prediction_tokens"))
        rejected = _count(details.get("rejected_prediction_tokens"))
        cached = _count(prompt.get("cached_tokens")) if isinstance(prompt, dict) else 0
        return Speed(accepted + rejected, accepted, cached)
    if isinstance(timings, dict):
        return Speed(
            _count(timings.get("draft_n")),
            _count(timings.get("draft_n_accepted")),
            _count(timings.get("cache_n")),
        )
    return None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one streamed request measured; `error` is None when it succeeded."""

    ttft_s: float | None
    latency_s: float
    tokens: int
    error: str | None = None
    text: str = ""  # the reply, for a conversation's next turn
    speed: Speed | None = None  # what the server said its speed features did, when it said


@dataclass(frozen=True, slots=True)
class BenchSummary:
    """Aggregate figures of the measured phase; percentiles are NaN when no request succeeded."""

    requests: int
    ok: int
    failed: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    stream_tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    latency_p50_s: float
    latency_p95_s: float
    errors: dict[str, int] = field(default_factory=dict)
    drafted_tokens: int | None = None  # None: the server reported no speculation figures
    accepted_tokens: int | None = None
    cached_prompt_tokens: int | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks.

    This is numpy's default ("linear"): with the values sorted, the percentile sits at
    position (len - 1) * q / 100 and is interpolated between its two neighbours; q=0 is the
    minimum, q=100 the maximum, q=50 of an even count the mean of the middle two.
    No values give NaN; q outside 0..100 raises ValueError.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: list[RequestResult], wall_s: float) -> BenchSummary:
    """Aggregate per-request results measured over `wall_s` seconds.

    Only successful requests count towards tokens, rates and percentiles. The per-stream
    rate of a request is tokens / (latency - ttft); requests with fewer than two tokens are
    left out of its mean, since their decode time is only the stream's closing overhead.
    """
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    rates = [
        r.tokens / (r.latency_s - r.ttft_s)
        for r in ok
        if r.ttft_s is not None and r.latency_s > r.ttft_s and r.tokens > 1
    ]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok]
    speeds = [r.speed for r in ok if r.speed is not None]
    return BenchSummary(
        requests=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        wall_s=wall_s,
        tokens=tokens,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        stream_tokens_per_s=sum(rates) / len(rates) if rates else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        latency_p50_s=percentile(latencies, 50),
        latency_p95_s=percentile(latencies, 95),
        errors=dict(Counter(r.error for r in results if r.error is not None)),
        drafted_tokens=sum(s.drafted for s in speeds) if speeds else None,
        accepted_tokens=sum(s.accepted for s in speeds) if speeds else None,
        cached_prompt_tokens=sum(s.cached for s in speeds) if speeds else None,
    )


def api_base(url: str) -> str:
    """The server base without a trailing `/` or `/v1`: `http://h:8080/v1/` -> `http://h:8080`."""
    base = url.rstrip("/")
    return base.removesuffix("/v1")


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _error_label(response: aiohttp.ClientResponse) -> str:
    """`429 rate_limit_error` from an OpenAI error envelope, else just the status code."""
    label = str(response.status)
    try:
        body = await response.json(content_type=None)
    except (ValueError, aiohttp.ClientError, TimeoutError):
        return label
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    # The type is server-chosen text; keep it short and printable before it reaches a report.
    if isinstance(kind, str) and kind.isprintable() and 0 < len(kind) <= 64:
        return f"{label} {kind}"
    return label


def chunk_text(chunk: Any) -> str:
    """The generated text a stream chunk carries: `choices[0].text` or `choices[0].delta.content`."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    first = choices[0]
    text = first.get("text")
    if text is None and isinstance(first.get("delta"), dict):
        text = first["delta"].get("content")
    return text if isinstance(text, str) else ""


@dataclass(slots=True)
class StreamTally:
    """Running account of one SSE stream, fed one event's data at a time."""

    started: float
    ttft_s: float | None = None
    text_chunks: int = 0
    usage_tokens: int | None = None
    done: bool = False
    parts: list[str] = field(default_factory=list)
    speed: Speed | None = None

    def feed(self, data: bytes, now: float) -> None:
        """Account for one event's data; raises ValueError for data that is not JSON."""
        if data.strip() == DONE:
            self.done = True
            return
        chunk = json.loads(data)
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        self.speed = speed_of(chunk) or self.speed
        text = chunk_text(chunk)
        if text:
            self.parts.append(text)
            self.text_chunks += 1
            if self.ttft_s is None:
                self.ttft_s = now - self.started

    @property
    def tokens(self) -> int:
        """Completion tokens: the server's usage figure when it sent one, else text chunks."""
        return self.text_chunks if self.usage_tokens is None else self.usage_tokens


async def _read_stream(response: aiohttp.ClientResponse, tally: StreamTally) -> None:
    """Parse SSE until `data: [DONE]` or the end of the body (events end at a blank line)."""
    data: list[bytes] = []
    async for raw in response.content:
        line = raw.rstrip(b"\r\n")
        if not line:
            if data:
                tally.feed(b"\n".join(data), time.perf_counter())
                data.clear()
                if tally.done:
                    return
            continue
        name, _, value = line.partition(b":")
        if name == b"data":  # comments (":...") and other fields (event, id, retry) carry no text
            data.append(value.removeprefix(b" "))
    # Be lenient with a final `data: [DONE]` that lacks its blank line; any other partial event
    # at the end of the body is what a cut stream looks like and is left unparsed.
    if data and b"\n".join(data).strip() == DONE:
        tally.done = True


def request_body(
    config: BenchConfig, model: str, index: int, history: Sequence[tuple[str, str]] = ()
) -> dict[str, Any]:
    """The JSON body of request `index` (its seed, so that runs are repeatable).

    `history`: a conversation's earlier turns (question, reply), sent before this question.
    """
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "seed": index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        messages = [{"role": "system", "content": config.system}] if config.system else []
        for question, reply in history:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        body["messages"] = [*messages, {"role": "user", "content": config.prompt}]
    elif config.users:  # a conversation, from its first turn on
        turns = "".join(f"User: {q}\nAssistant: {a}\n" for q, a in history)
        body["prompt"] = f"{config.system or ''}\n\n{turns}User: {config.prompt}\nAssistant:"
    else:
        body["prompt"] = f"{config.system}\n\n{config.prompt}" if config.system else config.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.response_format is not None:
        body["response_format"] = config.response_format
    return body


async def one_request(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    model: str,
    index: int,
    history: Sequence[tuple[str, str]] = (),
) -> RequestResult:
    """Send one streamed request and measure it; failures become an `error` label, never raise."""
    url = api_base(config.base_url) + ENDPOINT_PATHS[config.endpoint]
    started = time.perf_counter()
    tally = StreamTally(started)
    streaming = False
    try:
        async with session.post(
            url, json=request_body(config, model, index, history), headers=_headers(config.key)
        ) as response:
            if not 200 <= response.status < 300:
                return RequestResult(None, time.perf_counter() - started, 0, await _error_label(response))
            streaming = True
            await _read_stream(response, tally)
    except (TimeoutError, aiohttp.ClientError, OSError):
        # A connection lost once the stream had begun is a cut stream, like one that ends
        # without [DONE]; before that, the server was not reached or answered nothing.
        if not streaming:
            return RequestResult(None, time.perf_counter() - started, 0, CONNECTION)
    except ValueError:  # a chunk that is not JSON, or a line past aiohttp's line limit
        return RequestResult(tally.ttft_s, time.perf_counter() - started, tally.tokens, BAD_STREAM)
    latency = time.perf_counter() - started
    if not tally.done:
        return RequestResult(tally.ttft_s, latency, tally.tokens, TRUNCATED)
    return RequestResult(tally.ttft_s, latency, tally.tokens, text="".join(tally.parts), speed=tally.speed)


async def first_model(session: aiohttp.ClientSession, config: BenchConfig) -> str:
    """The first model id that `GET /v1/models` lists."""
    try:
        async with session.get(
            api_base(config.base_url) + "/v1/models", headers=_headers(config.key)
        ) as response:
            if response.status != 200:
                raise BenchError(f"GET /v1/models answered {await _error_label(response)}")
            body = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise BenchError(f"cannot reach {api_base(config.base_url)}: {exc}") from None
    except ValueError:
        raise BenchError("GET /v1/models answered something that is not JSON") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list) or not models:
        raise BenchError("the server lists no models; name one with --model")
    model_id = models[0].get("id") if isinstance(models[0], dict) else None
    if not isinstance(model_id, str) or not model_id:
        raise BenchError("the first model GET /v1/models lists has no id; name one with --model")
    return model_id


async def run_bench(config: BenchConfig) -> BenchSummary:
    """Warm up sequentially, then run `requests` streamed requests over `concurrency` workers."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    # A fresh connection per request: servers differ in how they close idle keep-alive
    # connections, and a POST on a connection the server just closed fails without a retry.
    # On a LAN the connect costs well under a millisecond of each TTFT.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await first_model(session, config)
        for i in range(config.warmup):
            # Seeds after the measured ones, so every request of a run has its own.
            warm = await one_request(session, config, model, config.requests + i)
            if warm.error == CONNECTION:
                raise BenchError(f"cannot reach {api_base(config.base_url)} (warm-up request failed)")
        indexes = iter(range(config.requests))
        results: list[RequestResult] = []
        # Conversations: each user waits its turn in a round-robin line; a worker takes the
        # user at its head, sends that user's next question after the earlier turns, and
        # puts the user back at the end with the reply added.
        line: asyncio.Queue[list[tuple[str, str]]] = asyncio.Queue()
        for _ in range(config.users):
            line.put_nowait([])

        async def worker() -> None:
            for index in indexes:  # one shared iterator: each index goes to exactly one worker
                if not config.users:
                    results.append(await one_request(session, config, model, index))
                    continue
                history = await line.get()
                result = await one_request(session, config, model, index, history)
                results.append(result)
                if result.error is None:
                    history.append((config.prompt, result.text))
                line.put_nowait(history)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        return summarize(results, time.perf_counter() - started)


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def format_text(s: BenchSummary, config: BenchConfig) -> str:
    """Aligned plain-text report."""
    rows = [
        (
            "requests",
            f"{s.ok} ok, {s.failed} failed of {s.requests} "
            f"(concurrency {config.concurrency}, max_tokens {config.max_tokens}"
            + (f", {config.users} users" if config.users else "")
            + ")",
        ),
        ("wall time", f"{s.wall_s:.3f} s"),
        ("completion tokens", str(s.tokens)),
        ("aggregate", f"{s.tokens_per_s:.1f} tokens/s"),
        ("per stream (mean)", f"{s.stream_tokens_per_s:.1f} tokens/s"),
        ("TTFT p50 / p95", f"{_seconds(s.ttft_p50_s)} / {_seconds(s.ttft_p95_s)} s"),
        ("latency p50 / p95", f"{_seconds(s.latency_p50_s)} / {_seconds(s.latency_p95_s)} s"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) or "none"),
    ]
    if s.drafted_tokens is not None and s.accepted_tokens is not None:
        rate = f" ({s.accepted_tokens / s.drafted_tokens:.0%})" if s.drafted_tokens else ""
        rows.append(("drafts accepted", f"{s.accepted_tokens} of {s.drafted_tokens}{rate}"))
    if s.cached_prompt_tokens is not None:
        rows.append(("cached prompt tokens", str(s.cached_prompt_tokens)))
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in rows)


def format_json(s: BenchSummary) -> str:
    """One JSON object with the summary's fields; NaN (no successful request) becomes null."""
    figures = {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in dataclasses.asdict(s).items()
    }
    return json.dumps(figures)


def _read_text(path: Path, option: str) -> str:
    """A prompt file's text: a small regular UTF-8 file, not empty."""
    try:
        text = read_regular(path, MAX_PROMPT_BYTES).decode("utf-8")
    except UnsuitableFile as exc:
        raise CommandError(f"{option}: {exc}") from None
    except OSError as exc:
        raise CommandError(f"{option}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CommandError(f"{option}: {path} is not UTF-8 text") from None
    if not text.strip():
        raise CommandError(f"{option}: {path} is empty")
    return text


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number from `low` to `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not low <= value <= high:  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be a number from {low:g} to {high:g}, got {text!r}")
        return value

    return parse


def add_parser(sub: Subcommands) -> None:
    """Register `bench`."""
    p = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server",
        description="Stream completions from any OpenAI-compatible server (edgellmd, "
        "llama-server, llama_cpp.server) and print aggregate tokens/s, time to first "
        "token and latency percentiles.",
    )
    p.add_argument(
        "--url",
        required=True,
        type=http_url,
        help="server base URL, with or without /v1, e.g. http://127.0.0.1:8080",
    )
    add_key_options(
        p, what="API key, sent as a bearer token and never printed", file_env=KEY_FILE_ENV, env=KEY_ENV
    )
    p.add_argument("--model", help="model id (default: the first one GET /v1/models lists)")
    p.add_argument("-c", "--concurrency", type=positive_int, default=1, help="concurrent streams (default 1)")
    p.add_argument("-n", "--requests", type=positive_int, default=8, help="measured requests (default 8)")
    p.add_argument(
        "-m", "--max-tokens", type=positive_int, default=64, help="max_tokens per request (default 64)"
    )
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, metavar="FILE", help="read the prompt text from FILE")
    p.add_argument(
        "--system-file",
        type=Path,
        metavar="FILE",
        help="a system prompt every request starts with (chat: a system message), to measure prompt reuse",
    )
    p.add_argument(
        "--users",
        type=int_at_least(0),
        default=0,
        help="closed-loop users holding conversations, served round-robin by the concurrent "
        "streams: each request carries its user's earlier turns (default 0: fresh prompts)",
    )
    p.add_argument(
        "--temperature",
        type=float_in(0.0, 2.0),
        default=0.8,
        help="sampling temperature (default 0.8; 0 for greedy, as speculation benchmarks use)",
    )
    p.add_argument(
        "--endpoint",
        choices=tuple(ENDPOINT_PATHS),
        default="completions",
        help="completions (default) or chat",
    )
    p.add_argument(
        "--warmup",
        type=int_at_least(0),
        default=1,
        help="sequential requests before the measured ones, not counted (default 1)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos so every request generates max_tokens tokens "
        "(edgellmd, llama-server and llama_cpp.server honour it)",
    )
    p.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="chat only: ask for structured output following this JSON schema "
        "(response_format json_schema) to measure constrained decoding",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its figures; 1 when it cannot run or every request failed."""
    try:
        key = read_key(args.key_file, what="API key", file_env=KEY_FILE_ENV, env=KEY_ENV)
    except CommandError as exc:
        print(redact(f"edgellmctl bench: {exc}"), file=sys.stderr)
        return 2
    response_format = None
    if args.json_schema is not None:
        if args.endpoint != "chat":
            print("edgellmctl bench: --json-schema needs --endpoint chat", file=sys.stderr)
            return 2
        try:
            schema = json.loads(read_regular(args.json_schema, MAX_SCHEMA_BYTES))
        except UnsuitableFile as exc:
            print(f"edgellmctl bench: --json-schema: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(
                f"edgellmctl bench: cannot read the JSON schema {args.json_schema}: {exc.strerror}",
                file=sys.stderr,
            )
            return 2
        except ValueError as exc:
            print(f"edgellmctl bench: cannot read the JSON schema {args.json_schema}: {exc}", file=sys.stderr)
            return 2
        response_format = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    try:
        prompt = args.prompt if args.prompt_file is None else _read_text(args.prompt_file, "--prompt-file")
        system = None if args.system_file is None else _read_text(args.system_file, "--system-file")
    except CommandError as exc:
        print(f"edgellmctl bench: {exc}", file=sys.stderr)
        return 2
    config = BenchConfig(
        base_url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        prompt=prompt,
        endpoint=args.endpoint,
        key=key,
        warmup=args.warmup,
        ignore_eos=args.ignore_eos,
        response_format=response_format,
        temperature=args.temperature,
        system=system,
        users=args.users,
    )
    try:
        summary = asyncio.run(run_bench(config))
    except BenchError as exc:
        print(redact(f"edgellmctl bench: {exc}"), file=sys.stderr)
        return 1
    print(format_json(summary) if args.json else format_text(summary, config))
    if summary.ok == 0:
        print(f"edgellmctl bench: every request to {api_base(config.base_url)} failed", file=sys.stderr)
        return 1
    return 0
