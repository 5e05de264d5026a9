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

from edgellmctl import workload
from edgellmctl.cli import (
    CommandError,
    Subcommands,
    add_key_options,
    http_url,
    int_at_least,
    int_between,
    positive_int,
    read_key,
    redact,
)
from edgellmctl.streams import (
    BAD_STREAM,
    CONNECT_TIMEOUT_S,
    CONNECTION,
    ENDPOINT_PATHS,
    READ_TIMEOUT_S,
    TRUNCATED,
    BenchError,
    Speed,
    StreamTally,
    api_base,
    error_label,
    first_model,
    headers,
    percentile,
    read_stream,
)
from edgellmd.files import UnsuitableFile, read_regular

DEFAULT_PROMPT: Final = "Once upon a time, in a small village by the sea,"
KEY_ENV: Final = "EDGELLM_API_KEY"
KEY_FILE_ENV: Final = "EDGELLM_API_KEY_FILE"
MAX_SCHEMA_BYTES: Final = 1024 * 1024
MAX_PROMPT_BYTES: Final = 4 * 1024 * 1024
WORKLOAD_REQUESTS: Final = 100  # per rate: enough for a p90, a p99 that says something
MAX_RATE: Final = 10_000.0  # requests/s one client offers


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
            url, json=request_body(config, model, index, history), headers=headers(config.key)
        ) as response:
            if not 200 <= response.status < 300:
                return RequestResult(None, time.perf_counter() - started, 0, await error_label(response))
            streaming = True
            await read_stream(response, tally)
    except (TimeoutError, aiohttp.ClientError, OSError):
        # A connection lost once the stream had begun is a cut stream, like one that ends
        # without [DONE]; before that, the server was not reached or answered nothing.
        if not streaming:
            return RequestResult(None, time.perf_counter() - started, 0, CONNECTION)
    except ValueError:  # a chunk that is not JSON, or a line past aiohttp's line limit
        return RequestResult(tally.ttft_s, time.perf_counter() - started, tally.tokens, BAD_STREAM)
    latency = time.perf_counter() - started
    if tally.error is not None:  # an error event, then [DONE]: no success
        return RequestResult(tally.ttft_s, latency, tally.tokens, tally.error)
    if not tally.done:
        return RequestResult(tally.ttft_s, latency, tally.tokens, TRUNCATED)
    return RequestResult(tally.ttft_s, latency, tally.tokens, text="".join(tally.parts), speed=tally.speed)


async def run_bench(config: BenchConfig) -> BenchSummary:
    """Warm up sequentially, then run `requests` streamed requests over `concurrency` workers."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    # A fresh connection per request: servers differ in how they close idle keep-alive
    # connections, and a POST on a connection the server just closed fails without a retry.
    # On a LAN the connect costs well under a millisecond of each TTFT.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await first_model(session, config.base_url, config.key)
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
        action="append",
        type=http_url,
        help="server base URL, with or without /v1, e.g. http://127.0.0.1:8080; with --workload, "
        "once per server to compare, measured in turn at every rate",
    )
    add_key_options(
        p, what="API key, sent as a bearer token and never printed", file_env=KEY_FILE_ENV, env=KEY_ENV
    )
    p.add_argument("--model", help="model id (default: the first one GET /v1/models lists)")
    p.add_argument("-c", "--concurrency", type=positive_int, help="concurrent streams (default 1)")
    p.add_argument(
        "-n",
        "--requests",
        type=int_between(1, workload.MAX_REQUESTS),
        help=f"measured requests (default 8; with --workload, per rate: default {WORKLOAD_REQUESTS})",
    )
    p.add_argument("-m", "--max-tokens", type=positive_int, help="max_tokens per request (default 64)")
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
    _add_workload_options(p)
    p.set_defaults(func=run)


def rate_list(text: str) -> tuple[float, ...]:
    """`0.5,1,2`: offered rates in requests/s, each finite and above 0, rising."""
    parse = float_in(0.0, MAX_RATE)
    rates = tuple(parse(part.strip()) for part in text.split(",") if part.strip())
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"must be rates above 0, comma-separated, got {text!r}")
    if list(rates) != sorted(set(rates)):
        raise argparse.ArgumentTypeError(f"rates must rise without repeats, got {text!r}")
    return rates


def _label(text: str) -> str:
    if not 0 < len(text) <= 40 or not text.isprintable():
        raise argparse.ArgumentTypeError("must be 1 to 40 printable characters")
    return text


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "serving benchmark (--workload)",
        "open-loop arrivals, ShareGPT-like lengths, goodput under an SLO; any other option "
        "above that shapes closed-loop requests (-c, --users, --prompt ...) is refused with it",
    )
    g.add_argument(
        "--workload",
        choices=workload.ARRIVALS,
        help="arrivals: poisson (exponential gaps at each --rate), constant (evenly spaced), or burst "
        "(every request at once)",
    )
    g.add_argument(
        "--rate",
        type=rate_list,
        help="offered requests/s, comma-separated for a sweep, e.g. 0.25,0.5,1,2 (poisson, constant)",
    )
    g.add_argument("--label", action="append", type=_label, help="a --url's name in reports, once per --url")
    g.add_argument(
        "--lengths",
        choices=("sharegpt", "fixed"),
        default="sharegpt",
        help="sharegpt (default): log-normal draws with ShareGPT's means (161 prompt, 338 output "
        "tokens); fixed: every request at --max-prompt-tokens and --max-output-tokens",
    )
    g.add_argument(
        "--length-scale",
        type=float_in(0.001, 100.0),
        default=1.0,
        help="multiply the sharegpt means, e.g. 0.25 for a small model on a CPU (default 1)",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int_between(workload.MIN_PROMPT_TOKENS, workload.MAX_TOKENS_LIMIT),
        default=1024,
        help="longest prompt drawn (default 1024)",
    )
    g.add_argument(
        "--max-output-tokens",
        type=int_between(1, workload.MAX_TOKENS_LIMIT),
        default=1024,
        help="longest output drawn (default 1024)",
    )
    g.add_argument(
        "--seed", type=int_between(0, 2**31 - 1), default=0, help="seed of lengths and arrivals (default 0)"
    )
    g.add_argument(
        "--slo-ttft",
        type=float_in(0.001, 86_400.0),
        default=2.0,
        help="SLO: seconds to first token (default 2)",
    )
    g.add_argument(
        "--slo-tokens-per-s",
        type=float_in(0.0, 1e6),
        default=5.0,
        help="SLO: tokens/s after the first, per request (default 5)",
    )
    g.add_argument(
        "--slo-attainment",
        type=float_in(0.01, 1.0),
        default=0.9,
        help="SLO: share of requests that must meet it for a rate to hold (default 0.9)",
    )
    g.add_argument(
        "--until-saturated",
        action="store_true",
        help="stop a server's sweep at the first rate where it misses the SLO",
    )
    g.add_argument("--svg", type=Path, metavar="FILE", help="write goodput and TTFT p90 against rate as SVG")
    g.add_argument("--save", type=Path, metavar="FILE", help="also write the JSON report to FILE")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its figures; 1 when it cannot run or every request failed."""
    try:
        key = read_key(args.key_file, what="API key", file_env=KEY_FILE_ENV, env=KEY_ENV)
    except CommandError as exc:
        print(redact(f"edgellmctl bench: {exc}"), file=sys.stderr)
        return 2
    if args.workload is not None:
        return run_workload_command(args, key)
    for option, value in (
        ("--rate", args.rate),
        ("--label", args.label),
        ("--svg", args.svg),
        ("--save", args.save),
    ):
        if value is not None:
            print(f"edgellmctl bench: {option} needs --workload", file=sys.stderr)
            return 2
    if len(args.url) > 1:
        print("edgellmctl bench: one --url, unless --workload compares servers", file=sys.stderr)
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
        base_url=args.url[0],
        model=args.model,
        concurrency=args.concurrency or 1,
        requests=args.requests or 8,
        max_tokens=args.max_tokens or 64,
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


def run_workload_command(args: argparse.Namespace, key: str | None) -> int:
    """`--workload`: the serving benchmark; 1 when it cannot run or no request of it succeeded."""
    closed_loop = {
        "-c/--concurrency": args.concurrency is not None,
        "-m/--max-tokens": args.max_tokens is not None,  # outputs are drawn: --max-output-tokens
        "--users": args.users != 0,
        "--prompt/--prompt-file": args.prompt != DEFAULT_PROMPT or args.prompt_file is not None,
        "--system-file": args.system_file is not None,
        "--json-schema": args.json_schema is not None,
        "--ignore-eos": args.ignore_eos,  # always sent: outputs are their drawn length
    }
    refused = [option for option, given in closed_loop.items() if given]
    problem = None
    if refused:
        problem = f"{', '.join(refused)} shape closed-loop requests: not with --workload"
    elif args.workload == "burst" and args.rate is not None:
        problem = "a burst sends every request at once: --rate is for poisson and constant"
    elif args.workload != "burst" and args.rate is None:
        problem = f"--workload {args.workload} needs --rate"
    elif args.label is not None and len(args.label) != len(args.url):
        problem = f"{len(args.label)} --label for {len(args.url)} --url: give one per --url, or none"
    labels = args.label or [
        f"server {i + 1}" if len(args.url) > 1 else "server" for i in range(len(args.url))
    ]
    if problem is None and len(set(labels)) != len(labels):
        problem = "each --label must differ"
    if problem is not None:
        print(f"edgellmctl bench: {problem}", file=sys.stderr)
        return 2
    config = workload.WorkloadConfig(
        targets=tuple(
            workload.Target(label, url, args.model) for label, url in zip(labels, args.url, strict=True)
        ),
        arrivals=args.workload,
        rates=args.rate or (),
        requests=args.requests or WORKLOAD_REQUESTS,
        lengths=workload.Lengths(
            args.lengths, args.length_scale, args.max_prompt_tokens, args.max_output_tokens
        ),
        slo=workload.Slo(args.slo_ttft, args.slo_tokens_per_s, args.slo_attainment),
        seed=args.seed,
        endpoint=args.endpoint,
        key=key,
        warmup=args.warmup,
        temperature=args.temperature,
        until_saturated=args.until_saturated,
    )
    try:
        report = asyncio.run(workload.run_workload(config, workload.live_progress(sys.stderr)))
    except BenchError as exc:
        print(redact(f"edgellmctl bench: {exc}"), file=sys.stderr)
        return 1
    document = json.dumps(workload.as_json(report), allow_nan=False)
    for path, text in ((args.save, document + "\n"), (args.svg, None)):
        if path is None:
            continue
        try:
            path.write_text(workload.chart(report) if text is None else text, encoding="utf-8")
        except OSError as exc:
            print(f"edgellmctl bench: cannot write {path}: {exc.strerror}", file=sys.stderr)
            return 1
    print(document if args.json else workload.format_table(report))
    if not any(stage.ok for stage in report.stages):
        print("edgellmctl bench: no request of the workload succeeded", file=sys.stderr)
        return 1
    return 0
