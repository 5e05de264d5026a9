"""The client side of OpenAI-style streams: SSE parsing, error labels, model lookup, percentiles.

Shared by `edgellmctl bench`'s closed-loop benchmark and its serving benchmark (`workload`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

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


def api_base(url: str) -> str:
    """The server base without a trailing `/` or `/v1`: `http://h:8080/v1/` -> `http://h:8080`."""
    base = url.rstrip("/")
    return base.removesuffix("/v1")


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def error_label(response: aiohttp.ClientResponse) -> str:
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
    chunk_times: list[float] = field(default_factory=list)  # when each text chunk arrived
    prompt_tokens: int | None = None  # the server's usage figure, when it sent one
    # The stream's error event (`{"error": {...}}`: shed, its engine died, a timeout, the drain),
    # as `error_label` names an error answer: a stream that ends with one did not succeed,
    # though `[DONE]` follows it.
    error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        """Account for one event's data; raises ValueError for data that is not JSON."""
        if data.strip() == DONE:
            self.done = True
            return
        chunk = json.loads(data)
        failed = chunk.get("error") if isinstance(chunk, dict) else None
        if failed is not None and self.error is None:
            kind = failed.get("type") if isinstance(failed, dict) else None
            shown = kind if isinstance(kind, str) and kind.isprintable() and 0 < len(kind) <= 64 else "error"
            self.error = f"stream {shown}"
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            prompt = usage.get("prompt_tokens")
            self.prompt_tokens = prompt if isinstance(prompt, int) else self.prompt_tokens
        self.speed = speed_of(chunk) or self.speed
        text = chunk_text(chunk)
        if text:
            self.parts.append(text)
            self.text_chunks += 1
            self.chunk_times.append(now)
            if self.ttft_s is None:
                self.ttft_s = now - self.started

    @property
    def tokens(self) -> int:
        """Completion tokens: the server's usage figure when it sent one, else text chunks."""
        return self.text_chunks if self.usage_tokens is None else self.usage_tokens


async def read_stream(response: aiohttp.ClientResponse, tally: StreamTally) -> None:
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


async def first_model(session: aiohttp.ClientSession, base_url: str, key: str | None) -> str:
    """The first model id that `GET /v1/models` lists."""
    try:
        async with session.get(api_base(base_url) + "/v1/models", headers=headers(key)) as response:
            if response.status != 200:
                raise BenchError(f"GET /v1/models answered {await error_label(response)}")
            body = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise BenchError(f"cannot reach {api_base(base_url)}: {exc}") from None
    except ValueError:
        raise BenchError("GET /v1/models answered something that is not JSON") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list) or not models:
        raise BenchError("the server lists no models; name one with --model")
    model_id = models[0].get("id") if isinstance(models[0], dict) else None
    if not isinstance(model_id, str) or not model_id:
        raise BenchError("the first model GET /v1/models lists has no id; name one with --model")
    return model_id
