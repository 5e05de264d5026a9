"""`edgellmctl bench` against a scripted OpenAI-style streaming server on real sockets, and edgellmd."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

from edgellmctl import bench, streams
from edgellmctl.__main__ import main
from edgellmctl.bench import BenchConfig, RequestResult, request_body, run_bench, summarize
from edgellmctl.cli import Parser
from edgellmctl.streams import percentile
from tests.serving import RunningDaemon

KEY: Final = "sk-bench-secret-4711"
MODEL: Final = "fake-model"
SUMMARY_KEYS: Final = {
    "requests",
    "ok",
    "failed",
    "wall_s",
    "tokens",
    "tokens_per_s",
    "stream_tokens_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "latency_p50_s",
    "latency_p95_s",
    "errors",
    "drafted_tokens",
    "accepted_tokens",
    "cached_prompt_tokens",
}


@dataclass(frozen=True, slots=True)
class Seen:
    """One completion request as the fake server received it."""

    path: str
    authorization: str | None
    body: dict[str, Any]


@dataclass
class FakeOpenAI:
    """A scripted OpenAI-compatible streaming server; behaviour per request is keyed by its seed."""

    chunks: int = 5
    first_delay: float = 0.0  # after the headers (and the chat role chunk), before the first text
    chunk_delay: float = 0.0
    request_delay: float = 0.0  # before the status line
    usage_tokens: int | None = None  # None: the number of text chunks
    send_usage: bool = True
    usage_details: dict[str, Any] | None = None  # merged into the usage chunk (edgellmd, OpenAI)
    timings: dict[str, Any] | None = None  # sent in the final chunk, as llama-server does
    key: str | None = None
    fail: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # seed -> status, error type
    truncate: set[int] = field(default_factory=set)  # clean end of body without [DONE]
    cut: set[int] = field(default_factory=set)  # connection dropped mid-stream
    raw: bytes | None = None  # a stream body sent verbatim instead of the scripted one
    models: list[str] = field(default_factory=lambda: [MODEL, "other-model"])
    seen: list[Seen] = field(default_factory=list)
    model_lookups: int = 0
    active: int = 0
    max_active: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    def _denied(self, request: web.Request) -> web.Response | None:
        if self.key is None or request.headers.get("Authorization") == f"Bearer {self.key}":
            return None
        return error_response(401, "authentication_error")

    async def list_models(self, request: web.Request) -> web.Response:
        self.model_lookups += 1
        denied = self._denied(request)
        if denied is not None:
            return denied
        listed = [{"id": m, "object": "model", "owned_by": "me"} for m in self.models]
        return web.json_response({"object": "list", "data": listed})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        denied = self._denied(request)
        if denied is not None:
            return denied
        body = await request.json()
        self.seen.append(Seen(request.path, request.headers.get("Authorization"), body))
        chat = request.path.endswith("/chat/completions")
        seed = body["seed"]
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.request_delay)
            if seed in self.fail:
                status, kind = self.fail[seed]
                if kind is None:
                    return web.Response(
                        status=status, text="<html>upstream trouble</html>", content_type="text/html"
                    )
                return error_response(status, kind)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if self.raw is not None:
                await response.write(self.raw)
                await response.write_eof()
                return response
            if chat:  # OpenAI opens a chat stream with a role-only chunk: no text, so no TTFT yet
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                await send(response, {"choices": [role]})
            await asyncio.sleep(self.first_delay)
            for i in range(self.chunks):
                if i:
                    await asyncio.sleep(self.chunk_delay)
                text = f"tok{i} "
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await send(response, {"choices": [choice]})
                if i == 1 and seed in self.cut:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if i == 1 and seed in self.truncate:
                    await response.write_eof()
                    return response
            final = (
                {"index": 0, "delta": {}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "", "finish_reason": "length"}
            )
            last: dict[str, Any] = {"choices": [final]}
            if self.timings is not None:
                last["timings"] = self.timings
            await send(response, last)
            if self.send_usage and body.get("stream_options", {}).get("include_usage"):
                tokens = self.chunks if self.usage_tokens is None else self.usage_tokens
                await send(
                    response,
                    {
                        "choices": [],
                        "usage": {
                            "prompt_tokens": 3,
                            "completion_tokens": tokens,
                            "total_tokens": 3 + tokens,
                            **(self.usage_details or {}),
                        },
                    },
                )
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.active -= 1


def error_response(status: int, kind: str) -> web.Response:
    """OpenAI's error envelope."""
    return web.json_response(
        {"error": {"message": "no", "type": kind, "param": None, "code": None}}, status=status
    )


async def send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


@contextmanager
def serving(fake: FakeOpenAI) -> Iterator[str]:
    """Serve `fake` on a loopback port from its own thread and loop (bench.run() runs its own loop)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app())
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=main, name="fake-openai", daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def parse(argv: list[str]) -> argparse.Namespace:
    # bench's own parser, not edgellmctl.__main__'s: these tests do not depend on other subcommands.
    parser = Parser(prog="edgellmctl")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def cli(argv: list[str]) -> int:
    args = parse(argv)
    status: int = args.func(args)
    return status


def config(url: str, **kwargs: Any) -> BenchConfig:
    defaults: dict[str, Any] = {"model": None, "concurrency": 1, "requests": 4, "max_tokens": 16, "warmup": 0}
    return BenchConfig(base_url=url, **{**defaults, **kwargs})


async def started(fake: FakeOpenAI, aiohttp_server: AiohttpServer) -> str:
    server = await aiohttp_server(fake.app())
    return str(server.make_url("")).rstrip("/")


# --- pure parts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, math.nan),
        ([7.0], 0, 7.0),
        ([7.0], 50, 7.0),
        ([7.0], 100, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([3.0, 1.0, 2.0], 50, 2.0),  # unsorted input
        ([1.0, 2.0], 25, 1.25),
        ([float(i) for i in range(1, 11)], 95, 9.55),  # position 8.55 between 9 and 10
        ([float(i) for i in range(1, 21)], 95, 19.05),
        ([0.5, 0.5, 0.5], 95, 0.5),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    got = percentile(values, q)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(expected)


@pytest.mark.parametrize("q", [-1, 100.5, 1000])
def test_percentile_refuses_q_outside_0_to_100(q: float) -> None:
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], q)


def test_summarize_arithmetic() -> None:
    results = [
        RequestResult(ttft_s=0.1, latency_s=1.1, tokens=10),  # 10 tokens / 1.0 s
        RequestResult(ttft_s=0.2, latency_s=2.2, tokens=40),  # 40 tokens / 2.0 s
        RequestResult(ttft_s=None, latency_s=0.05, tokens=0, error="429 rate_limit_error"),
        RequestResult(ttft_s=0.3, latency_s=0.9, tokens=2, error="truncated"),
        RequestResult(ttft_s=None, latency_s=0.01, tokens=0, error="429 rate_limit_error"),
    ]
    s = summarize(results, wall_s=2.5)
    assert (s.requests, s.ok, s.failed, s.tokens) == (5, 2, 3, 50)
    assert s.wall_s == 2.5
    assert s.tokens_per_s == pytest.approx(20.0)
    assert s.stream_tokens_per_s == pytest.approx(15.0)  # mean of 10 and 20
    assert s.ttft_p50_s == pytest.approx(0.15)
    assert s.ttft_p95_s == pytest.approx(0.195)
    assert s.latency_p50_s == pytest.approx(1.65)
    assert s.latency_p95_s == pytest.approx(2.145)
    assert s.errors == {"429 rate_limit_error": 2, "truncated": 1}


def test_summarize_leaves_single_token_streams_out_of_the_stream_rate() -> None:
    s = summarize([RequestResult(0.1, 0.1001, 1), RequestResult(0.1, 0.6, 5)], wall_s=1.0)
    assert s.tokens == 6
    assert s.stream_tokens_per_s == pytest.approx(10.0)


def test_summary_of_nothing_but_failures_prints_dashes_and_nulls() -> None:
    s = summarize([RequestResult(None, 0.01, 0, "connection")] * 3, wall_s=0.05)
    assert (s.ok, s.failed, s.tokens, s.tokens_per_s, s.stream_tokens_per_s) == (0, 3, 0, 0.0, 0.0)
    assert math.isnan(s.ttft_p50_s)
    text = bench.format_text(s, config("http://x", concurrency=2))
    assert "- / - s" in text
    assert "connection: 3" in text
    figures = json.loads(bench.format_json(s))
    assert figures["ttft_p50_s"] is None
    assert figures["latency_p95_s"] is None
    assert figures["errors"] == {"connection": 3}


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
        ("https://llm.lan/v1/", "https://llm.lan"),
        ("http://gw.lan/llm/v1", "http://gw.lan/llm"),
    ],
)
def test_api_base(url: str, base: str) -> None:
    assert streams.api_base(url) == base


@pytest.mark.parametrize(
    ("chunk", "text"),
    [
        ({"choices": [{"text": "hi"}]}, "hi"),
        ({"choices": [{"delta": {"content": "hi"}}]}, "hi"),
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, ""),
        ({"choices": [{"delta": {"content": None}}]}, ""),
        ({"choices": [], "usage": {"completion_tokens": 3}}, ""),
        ({"choices": None}, ""),
        ({"choices": ["x"]}, ""),
        ([1, 2], ""),
        ("text", ""),
    ],
)
def test_chunk_text(chunk: Any, text: str) -> None:
    assert streams.chunk_text(chunk) == text


# --- run_bench against a scripted server ------------------------------------------------------------


async def test_figures_come_from_usage_and_wall_time(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=5, usage_tokens=7, first_delay=0.05, chunk_delay=0.01)
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, concurrency=2, requests=6, warmup=1))
    assert (s.requests, s.ok, s.failed, s.errors) == (6, 6, 0, {})
    assert s.tokens == 6 * 7  # the usage chunk's figure, not the 5 text chunks
    assert s.tokens_per_s == pytest.approx(s.tokens / s.wall_s)
    # Three rounds of two, each at least first_delay + 4 chunk delays.
    assert s.wall_s >= 3 * (0.05 + 4 * 0.01)
    assert s.ttft_p50_s >= 0.05
    assert s.latency_p50_s >= s.ttft_p50_s + 4 * 0.01
    assert s.latency_p95_s >= s.latency_p50_s
    assert s.stream_tokens_per_s > 0
    assert len(fake.seen) == 7  # one warm-up request, not counted
    assert fake.model_lookups == 1
    assert {x.body["model"] for x in fake.seen} == {MODEL}  # the first id /v1/models lists


async def test_tokens_fall_back_to_text_chunks_without_usage(aiohttp_server: AiohttpServer) -> None:
    url = await started(FakeOpenAI(chunks=6, send_usage=False), aiohttp_server)
    s = await run_bench(config(url, requests=3))
    assert (s.ok, s.tokens) == (3, 18)


async def test_chat_ttft_waits_for_text_not_the_role_chunk(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=4, first_delay=0.1)
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url + "/v1", model="picked", endpoint="chat", requests=2, prompt="Hi there"))
    assert (s.ok, s.tokens) == (2, 8)
    assert s.ttft_p50_s >= 0.1
    assert fake.model_lookups == 0
    body = fake.seen[0].body
    assert fake.seen[0].path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "Hi there"}]
    assert "prompt" not in body


async def test_request_bodies(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI()
    url = await started(fake, aiohttp_server)
    await run_bench(config(url, model="m", requests=3, max_tokens=9, warmup=2, prompt="P"))
    assert [x.path for x in fake.seen] == ["/v1/completions"] * 5
    assert sorted(x.body["seed"] for x in fake.seen[2:]) == [0, 1, 2]  # measured: the request index
    assert [x.body["seed"] for x in fake.seen[:2]] == [3, 4]  # warm-up: seeds after those
    for x in fake.seen:
        assert x.body == {
            "model": "m",
            "prompt": "P",
            "max_tokens": 9,
            "temperature": 0.8,
            "seed": x.body["seed"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        assert x.authorization is None
    fake.seen.clear()
    await run_bench(config(url, model="m", requests=1, ignore_eos=True))
    assert fake.seen[0].body["ignore_eos"] is True


async def test_concurrency_is_concurrent(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=2, request_delay=0.2)
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, concurrency=4, requests=4))
    assert s.ok == 4
    # All four were in flight at once (a timing bound would be flaky on a loaded machine).
    assert fake.max_active == 4


async def test_workers_share_the_requests(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=1, request_delay=0.01)
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, concurrency=3, requests=10))
    assert (s.requests, s.ok) == (10, 10)
    assert sorted(x.body["seed"] for x in fake.seen) == list(range(10))
    assert fake.max_active == 3


async def test_errors_are_counted_by_status_and_type(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(
        chunks=3,
        fail={
            0: (429, "rate_limit_error"),
            2: (429, "rate_limit_error"),
            3: (500, "server_error"),
            5: (503, None),
        },
    )
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, concurrency=2, requests=7))
    assert (s.requests, s.ok, s.failed) == (7, 3, 4)
    assert s.errors == {"429 rate_limit_error": 2, "500 server_error": 1, "503": 1}
    assert s.tokens == 3 * 3


async def test_streams_without_done_are_truncated(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=5, truncate={1}, cut={2})
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, requests=4))
    assert (s.ok, s.failed) == (2, 2)
    assert s.errors == {"truncated": 2}
    assert s.tokens == 2 * 5


@pytest.mark.parametrize(
    ("raw", "tokens", "error"),
    [
        # CRLF line ends, comments, other fields, `data:` without its space, no usage chunk.
        (
            b': keep-alive\r\n\r\nevent: message\r\nid: 1\r\ndata: {"choices": [{"text": "a"}]}\r\n\r\n'
            b'data:{"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n',
            2,
            None,
        ),
        # One event's JSON split over two data lines.
        (b'data: {"choices":\ndata: [{"text": "a"}]}\n\ndata: [DONE]\n\n', 1, None),
        # A final [DONE] without its blank line still ends the stream.
        (b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n', 1, None),
        # Usage wins over counted chunks, whatever chunk carries it.
        (
            b'data: {"choices": [{"text": "a"}], "usage": {"completion_tokens": 9}}\n\ndata: [DONE]\n\n',
            9,
            None,
        ),
        # A partial event at the end is a cut stream, not a parse error.
        (b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi', 1, "truncated"),
        (b"data: not json\n\ndata: [DONE]\n\n", 0, "bad stream"),
        # An error event (shed, its engine died, a timeout), then [DONE]: no success.
        (
            b'data: {"choices": [{"text": "a"}]}\n\n'
            b'data: {"error": {"message": "shed", "type": "rate_limit_error"}}\n\n'
            b"data: [DONE]\n\n",
            1,
            "stream rate_limit_error",
        ),
        (b"", 0, "truncated"),
    ],
)
async def test_sse_framing(raw: bytes, tokens: int, error: str | None, aiohttp_server: AiohttpServer) -> None:
    url = await started(FakeOpenAI(raw=raw), aiohttp_server)
    s = await run_bench(config(url, model=MODEL, requests=1))
    assert s.tokens == (tokens if error is None else 0)
    assert s.errors == ({} if error is None else {error: 1})


# --- the CLI: output, key, exit statuses ------------------------------------------------------------


def test_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(FakeOpenAI(chunks=4, fail={1: (500, "server_error")})) as url:
        assert cli(["--url", url, "-c", "2", "-n", "3", "-m", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split(None, 1)[1].startswith("2 ok, 1 failed of 3 (concurrency 2, max_tokens 4)")
    assert "completion tokens  8" in out
    assert "500 server_error: 1" in out
    for label in ("wall time", "aggregate", "per stream", "TTFT p50 / p95", "latency p50 / p95", "errors"):
        assert any(line.startswith(label) for line in lines), label
    # Aligned: every value starts in the same column, past two or more spaces.
    assert len({m.end() for m in (re.match(r".+?\S {2,}", line) for line in lines) if m}) == 1
    for line in lines:
        if line.startswith(("TTFT", "latency")):
            assert re.fullmatch(r"\S.*?\s{2,}\d+\.\d{3} / \d+\.\d{3} s", line), line


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(FakeOpenAI(chunks=3, truncate={0})) as url:
        assert cli(["--url", url, "--json", "-c", "1", "-n", "3", "-m", "3", "--endpoint", "chat"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == SUMMARY_KEYS
    assert (figures["requests"], figures["ok"], figures["failed"], figures["tokens"]) == (3, 2, 1, 6)
    assert figures["errors"] == {"truncated": 1}
    assert figures["tokens_per_s"] == pytest.approx(6 / figures["wall_s"])
    counts = {"requests", "ok", "failed", "tokens", "errors", "drafted_tokens", "accepted_tokens"}
    assert all(isinstance(figures[k], float) for k in SUMMARY_KEYS - counts - {"cached_prompt_tokens"})
    assert figures["drafted_tokens"] is None  # the fake reports no speculation


@pytest.fixture(autouse=True)
def _no_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bench.KEY_ENV, raising=False)
    monkeypatch.delenv(bench.KEY_FILE_ENV, raising=False)


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "inference.key"
    path.write_text(KEY + "\n")
    return path


@pytest.mark.parametrize("via", ["--key-file", "file-env", "env"])
def test_key_is_sent_and_never_printed(
    via: str, key_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpenAI(key=KEY)
    argv = ["-n", "2"]
    if via == "--key-file":
        argv += ["--key-file", str(key_file)]
    elif via == "file-env":
        monkeypatch.setenv(bench.KEY_FILE_ENV, str(key_file))
    else:
        monkeypatch.setenv(bench.KEY_ENV, KEY)
    with serving(fake) as url:
        assert cli(["--url", url, *argv]) == 0
        assert cli(["--url", url, *argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err
    assert fake.model_lookups == 2
    assert len(fake.seen) == 6
    assert {x.authorization for x in fake.seen} == {f"Bearer {KEY}"}


def test_missing_key_fails_the_model_lookup(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(FakeOpenAI(key=KEY)) as url:
        assert cli(["--url", url, "-n", "2"]) == 1
    captured = capsys.readouterr()
    assert "GET /v1/models answered 401 authentication_error" in captured.err
    assert "Traceback" not in captured.err


def test_wrong_key_fails_every_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong.key"
    wrong.write_text("sk-wrong-one\n")
    with serving(FakeOpenAI(key=KEY)) as url:
        assert cli(["--url", url, "--key-file", str(wrong), "--model", MODEL, "-n", "3"]) == 1
    captured = capsys.readouterr()
    assert "401 authentication_error: 3" in captured.out
    assert "every request" in captured.err
    assert "sk-wrong-one" not in captured.out + captured.err


def test_server_without_models_needs_model_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(FakeOpenAI(models=[])) as url:
        assert cli(["--url", url]) == 1
    assert "--model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        [],  # model lookup fails
        ["--model", MODEL],  # warm-up request fails
        ["--model", MODEL, "--warmup", "0", "--json"],  # every measured request fails
    ],
)
def test_dead_server_exits_1_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    assert cli(["--url", url, "-n", "3", *argv]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert url in captured.err
    assert "cannot reach" in captured.err or "every request" in captured.err
    if "--json" in argv:
        assert json.loads(captured.out)["errors"] == {"connection": 3}


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["-c", "0"], "--concurrency"),
        (["-n", "-1"], "--requests"),
        (["-m", "0"], "--max-tokens"),
        (["-m", "many"], "--max-tokens"),
        (["--warmup", "-1"], "--warmup"),
        (["--endpoint", "embeddings"], "--endpoint"),
        (["--temperature", "2.5"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "warm"], "--temperature"),
        (["--users", "-1"], "--users"),
        (["--prompt", "a", "--prompt-file", "p.txt"], "not allowed with argument"),
    ],
)
def test_bad_numbers_exit_2(argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--url", "http://127.0.0.1:8080", *argv])
    assert exc.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1/",
        "127.0.0.1:8080",
        "localhost:8080",
        "http://",
        "http://:8080",
        "http://127.0.0.1:99999",
        "http://user:hunter2@127.0.0.1:8080",
        "http://127.0.0.1:8080/v1?x=1",
    ],
)
def test_bad_url_exits_2(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--url" in err
    assert "hunter2" not in err


def test_url_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["-n", "1"])
    assert exc.value.code == 2
    assert "--url" in capsys.readouterr().err


@pytest.mark.parametrize("via", ["env", "--key-file"])
def test_key_that_cannot_be_a_header_exits_2(
    via: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--url", f"http://127.0.0.1:{closed_port()}"]
    if via == "env":
        monkeypatch.setenv(bench.KEY_ENV, "sk-abc\r\nX-Evil: 1")
    else:
        (tmp_path / "bad.key").write_text("sk-abc\r\nX-Evil: 1\n")
        argv += ["--key-file", str(tmp_path / "bad.key")]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "API key" in err
    assert "Evil" not in err


TOKEN: Final = "elk_0123456789ab_" + "S3cr3t-" * 6  # the shape of an edgellm API token


@pytest.mark.parametrize(
    "argv",
    [
        ["--key", TOKEN],  # the option bench had before: the key on the command line shows in `ps`
        [f"--key={TOKEN}"],
        ["--key-fi", TOKEN],  # an abbreviation of --key-file: options are taken by their full names only
        ["--api-key", TOKEN],
        [TOKEN],
    ],
    ids=["key", "key=", "abbreviation", "other-option", "positional"],
)
def test_a_key_on_the_command_line_is_refused_and_never_printed(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--url", "http://127.0.0.1:8080", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err
    assert TOKEN not in err
    assert "S3cr3t" not in err
    assert "0123456789ab" not in err


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "missing", "empty"])
def test_a_key_file_that_is_not_a_small_regular_file_is_refused_at_once(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inference.key"
    expected = {
        "fifo": "is a FIFO, not a regular file",
        "directory": "is a directory, not a regular file",
        "device": "is a character device, not a regular file",
        "missing": "No such file or directory",
        "empty": "is empty",
    }[kind]
    if kind == "fifo":
        os.mkfifo(path)  # an open() without O_NONBLOCK would wait here for a writer, for ever
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/zero")  # never ends
    elif kind == "empty":
        path.write_bytes(b"")
    assert cli(["--url", f"http://127.0.0.1:{closed_port()}", "--key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert expected in err


# --- edgellmd itself --------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_against_edgellmd(endpoint: str, daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--url",
        daemon.url + "/v1",
        "--model",
        "tiny",
        "-c",
        "2",
        "-n",
        "4",
        "-m",
        "8",
        "--ignore-eos",
        "--endpoint",
        endpoint,
        "--json",
    ]
    assert cli(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["ok"], figures["failed"], figures["errors"]) == (4, 0, {})
    assert figures["tokens"] == 4 * 8  # ignore_eos: every request runs to max_tokens
    assert figures["ttft_p50_s"] <= figures["latency_p50_s"]


def test_unknown_model_on_edgellmd(daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["--url", daemon.url, "--model", "no-such-model", "-c", "2", "-n", "3", "-m", "4"]) == 1
    captured = capsys.readouterr()
    assert "404 invalid_request_error: 3" in captured.out
    assert "every request" in captured.err


# --- conversations, prompt files, speed figures ---------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_users_hold_conversations_round_robin(endpoint: str, aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=2)
    url = await started(fake, aiohttp_server)
    s = await run_bench(
        config(
            url, model=MODEL, concurrency=2, requests=7, users=3, endpoint=endpoint, system="S!", prompt="Q?"
        )
    )
    assert s.ok == 7
    reply = "tok0 tok1 "
    if endpoint == "chat":
        turns = sorted((len(x.body["messages"]) - 2) // 2 for x in fake.seen)
        for x in fake.seen:
            messages = x.body["messages"]
            assert messages[0] == {"role": "system", "content": "S!"}
            assert messages[-1] == {"role": "user", "content": "Q?"}
            assert all(m == {"role": "assistant", "content": reply} for m in messages[2:-1:2])
    else:
        turns = sorted(x.body["prompt"].count("Assistant: tok0") for x in fake.seen)
        assert all(x.body["prompt"].startswith("S!\n\n") for x in fake.seen)
        assert all(x.body["prompt"].endswith("User: Q?\nAssistant:") for x in fake.seen)
    # Three users, seven requests: each user's first turn, then each one's second, then one third.
    assert turns == [0, 0, 0, 1, 1, 1, 2]


async def test_fewer_users_than_streams_limit_the_streams(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=1, request_delay=0.05)
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, concurrency=4, requests=6, users=2))
    assert s.ok == 6
    assert fake.max_active == 2  # a user waits for its reply before its next turn


async def test_a_failed_turn_is_not_added_to_the_conversation(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=1, fail={0: (500, "server_error")})
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, requests=3, users=1, endpoint="chat"))
    assert (s.ok, s.failed) == (2, 1)
    assert [len(x.body["messages"]) for x in fake.seen] == [1, 1, 3]


def test_a_system_prompt_alone_leads_every_fresh_prompt() -> None:
    body = request_body(BenchConfig("http://x", "m", 1, 1, 4, prompt="Q", system="S"), "m", 0)
    assert body["prompt"] == "S\n\nQ"
    chat = request_body(
        BenchConfig("http://x", "m", 1, 1, 4, prompt="Q", system="S", endpoint="chat"), "m", 0
    )
    assert chat["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]


@pytest.mark.parametrize(
    ("fake", "drafted", "accepted", "cached"),
    [
        pytest.param(
            FakeOpenAI(
                usage_details={
                    "prompt_tokens_details": {"cached_tokens": 100},
                    "completion_tokens_details": {
                        "accepted_prediction_tokens": 6,
                        "rejected_prediction_tokens": 2,
                    },
                }
            ),
            24,
            18,
            300,
            id="openai-usage-details",
        ),
        pytest.param(
            FakeOpenAI(timings={"draft_n": 5, "draft_n_accepted": 4, "cache_n": 7}),
            15,
            12,
            21,
            id="llama-server",
        ),
        pytest.param(FakeOpenAI(), None, None, None, id="neither"),
        pytest.param(
            FakeOpenAI(timings={"draft_n": "5", "draft_n_accepted": True, "cache_n": -3}), 0, 0, 0, id="junk"
        ),
    ],
)
async def test_speed_figures_come_from_what_the_server_reports(
    fake: FakeOpenAI,
    drafted: int | None,
    accepted: int | None,
    cached: int | None,
    aiohttp_server: AiohttpServer,
) -> None:
    url = await started(fake, aiohttp_server)
    s = await run_bench(config(url, model=MODEL, requests=3))
    assert (s.drafted_tokens, s.accepted_tokens, s.cached_prompt_tokens) == (drafted, accepted, cached)


def test_text_report_shows_the_acceptance_rate(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeOpenAI(timings={"draft_n": 8, "draft_n_accepted": 6, "cache_n": 10})
    with serving(fake) as url:
        assert cli(["--url", url, "-n", "2", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^drafts accepted\s+12 of 16 \(75%\)$", out, re.MULTILINE), out
    assert re.search(r"^cached prompt tokens\s+20$", out, re.MULTILINE), out
    with serving(FakeOpenAI()) as url:
        assert cli(["--url", url, "-n", "1", "--warmup", "0"]) == 0
    assert "drafts accepted" not in capsys.readouterr().out  # nothing reported, nothing printed


def test_prompt_and_system_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("Rewrite this: héllo", encoding="utf-8")
    (tmp_path / "s.txt").write_text("You are terse.", encoding="utf-8")
    fake = FakeOpenAI(chunks=1)
    with serving(fake) as url:
        argv = ["--url", url, "-n", "1", "--warmup", "0", "--endpoint", "chat", "--temperature", "0"]
        assert (
            cli([*argv, "--prompt-file", str(tmp_path / "p.txt"), "--system-file", str(tmp_path / "s.txt")])
            == 0
        )
    assert fake.seen[0].body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Rewrite this: héllo"},
    ]
    assert fake.seen[0].body["temperature"] == 0.0


@pytest.mark.parametrize(
    ("make", "complaint"),
    [
        (lambda d: d / "missing.txt", "cannot read"),
        (lambda d: d, "not a regular file"),
        (lambda d: _write(d / "empty.txt", b" \n"), "is empty"),
        (lambda d: _write(d / "latin1.txt", b"caf\xe9"), "is not UTF-8 text"),
    ],
)
@pytest.mark.parametrize("option", ["--prompt-file", "--system-file"])
def test_unusable_prompt_files_exit_2(
    make: Callable[[Path], Path],
    complaint: str,
    option: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = FakeOpenAI()
    with serving(fake) as url:
        assert cli(["--url", url, "-n", "1", option, str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edgellmctl bench: {option}: "), err
    assert complaint in err
    assert not fake.seen


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
