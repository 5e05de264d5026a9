"""`edgellmctl bench`: drive any OpenAI-compatible server with streamed completions and print figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp

DEFAULT_PROMPT: Final = "Once upon a time, in a small village by the sea,"
KEY_ENV: Final = "EDGELLM_API_KEY"
TIMEOUT_S: Final = 600


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run."""

    base_url: str
    model: str | None
    concurrency: int
    requests: int
    max_tokens: int
    prompt: str = DEFAULT_PROMPT
    endpoint: str = "completions"
    key: str | None = None
    warmup: int = 1
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one streamed request measured; `error` is None when it succeeded."""

    ttft_s: float | None
    latency_s: float
    tokens: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class BenchSummary:
    """Aggregate figures of a run."""

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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: list[RequestResult], wall_s: float) -> BenchSummary:
    """Aggregate per-request results measured over `wall_s` seconds."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    rates = [r.tokens / (r.latency_s - r.ttft_s) for r in ok
             if r.ttft_s is not None and r.latency_s > r.ttft_s and r.tokens > 1]
    return BenchSummary(
        requests=len(results), ok=len(ok), failed=len(results) - len(ok), wall_s=wall_s,
        tokens=tokens, tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        stream_tokens_per_s=sum(rates) / len(rates) if rates else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        latency_p50_s=percentile([r.latency_s for r in ok], 50),
        latency_p95_s=percentile([r.latency_s for r in ok], 95),
        errors=dict(Counter(r.error for r in results if r.error is not None)),
    )


def _api_base(url: str) -> str:
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _error_of(response: aiohttp.ClientResponse) -> str:
    label = str(response.status)
    try:
        body = await response.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        return label
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        kind = body["error"].get("type")
        if isinstance(kind, str):
            return f"{label} {kind}"
    return label


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    text = first.get("text")
    if text is None:
        text = (first.get("delta") or {}).get("content")
    return text if isinstance(text, str) else ""


async def one_request(session: aiohttp.ClientSession, config: BenchConfig, model: str,
                      index: int) -> RequestResult:
    """Send one streamed request and measure it."""
    body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens, "temperature": 0.8,
                            "seed": index, "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": config.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = config.prompt
        path = "/v1/completions"
    if config.ignore_eos:
        body["ignore_eos"] = True
    started = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with session.post(_api_base(config.base_url) + path, json=body,
                                headers=_headers(config.key)) as response:
            if response.status != 200:
                return RequestResult(None, time.perf_counter() - started, 0, await _error_of(response))
            done = False
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if isinstance(chunk.get("usage"), dict):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if _chunk_text(chunk):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - started
    except (TimeoutError, aiohttp.ClientError, OSError):
        return RequestResult(None, time.perf_counter() - started, 0, "connection")
    except ValueError:
        return RequestResult(None, time.perf_counter() - started, 0, "bad chunk")
    latency = time.perf_counter() - started
    if not done:
        return RequestResult(ttft, latency, chunks, "truncated")
    return RequestResult(ttft, latency, usage_tokens if isinstance(usage_tokens, int) else chunks)


async def _first_model(session: aiohttp.ClientSession, config: BenchConfig) -> str:
    async with session.get(_api_base(config.base_url) + "/v1/models",
                           headers=_headers(config.key)) as response:
        if response.status != 200:
            raise RuntimeError(f"GET /v1/models answered {await _error_of(response)}")
        body = await response.json()
    models = body.get("data") or []
    if not models:
        raise RuntimeError("the server lists no models")
    model_id: str = models[0]["id"]
    return model_id


async def run_bench(config: BenchConfig) -> BenchSummary:
    """Warm up, then run `requests` streamed requests over `concurrency` workers."""
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    # One connection per request: keep-alive behaviour differs between servers, and a
    # fresh connection is what a LAN client mostly does.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await _first_model(session, config)
        for i in range(config.warmup):
            await one_request(session, config, model, -1 - i)
        indexes = iter(range(config.requests))
        results: list[RequestResult] = []

        async def worker() -> None:
            for index in indexes:  # shared iterator: each index is taken by one worker
                results.append(await one_request(session, config, model, index))  # noqa: PERF401 - sequential awaits, not a transform

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        return summarize(results, time.perf_counter() - started)


def format_summary(s: BenchSummary, config: BenchConfig) -> str:
    """Aligned plain-text report."""
    lines = [
        f"requests            {s.ok} ok, {s.failed} failed (concurrency {config.concurrency}, "
        f"max_tokens {config.max_tokens})",
        f"wall time           {s.wall_s:.3f} s",
        f"completion tokens   {s.tokens}",
        f"aggregate           {s.tokens_per_s:.1f} tokens/s",
        f"per stream          {s.stream_tokens_per_s:.1f} tokens/s",
        f"TTFT p50 / p95      {s.ttft_p50_s:.3f} / {s.ttft_p95_s:.3f} s",
        f"latency p50 / p95   {s.latency_p50_s:.3f} / {s.latency_p95_s:.3f} s",
    ]
    if s.errors:
        lines.append("errors              " + ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())))
    return "\n".join(lines)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"must be an http(s) URL, got {text!r}")
    return text


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `bench`."""
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server",
                       description="Stream completions from any OpenAI-compatible server and print "
                       "aggregate tokens/s, time to first token and latency percentiles.")
    p.add_argument("--url", required=True, type=_url, help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--key", help=f"API key (default: ${KEY_ENV}); never printed")
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    p.add_argument("-c", "--concurrency", type=_positive, default=1, help="concurrent streams")
    p.add_argument("-n", "--requests", type=_positive, default=8, help="measured requests")
    p.add_argument("-m", "--max-tokens", type=_positive, default=64, help="max_tokens per request")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (default 1)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate max_tokens tokens (llama.cpp servers honour it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its figures; 1 when every request failed."""
    config = BenchConfig(
        base_url=args.url, model=args.model, concurrency=args.concurrency, requests=args.requests,
        max_tokens=args.max_tokens, prompt=args.prompt, endpoint=args.endpoint,
        key=args.key or os.environ.get(KEY_ENV), warmup=max(0, args.warmup), ignore_eos=args.ignore_eos,
    )
    try:
        summary = asyncio.run(run_bench(config))
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError) as exc:
        print(f"edgellmctl bench: cannot reach {config.base_url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: getattr(summary, k) for k in BenchSummary.__slots__}))
    else:
        print(format_summary(summary, config))
    if summary.ok == 0:
        print("edgellmctl bench: every request failed", file=sys.stderr)
        return 1
    return 0
