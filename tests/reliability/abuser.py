"""An abusive client, run as its own process: one kind of abuse, on and off, every answer checked.

    python -m tests.reliability.abuser KIND URL TOKEN ON_S OFF_S CYCLES

Abuses for ON_S seconds, keeps quiet for OFF_S, CYCLES times. Prints "ready" when it starts,
then one JSON line: {"kind", "sent", "statuses", "problems", "on", "off"} where "on" and "off"
list the (start, end) intervals in time.monotonic(), which on Linux is the same clock in
every process: the test sorts its own clients' requests into them.
Raw sockets throughout, so that nothing a client library adds or refuses gets in the way.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

RATE_PER_S: Final = 20.0  # requests per second of each body-borne abuse
WORKERS: Final = 4
SLOW_LORIS_CONNECTIONS: Final = 64
DRIP_S: Final = 0.5  # a slow-loris sends one byte of its head this often
HEADER_TIMEOUT_S: Final = 2.0  # the daemon's server.header_timeout_s in the abuse scenario
CUT_SLACK_S: Final = 1.5
MAX_BODY: Final = 1024 * 1024  # the daemon's server.max_body_bytes (its default)
INJECTED: Final = "X-Injected"
# About 5,300 tokens of the test models' byte vocabulary. Longer prompts hold up everyone's
# prompt preparation (see test_abuse's xfail test), which would drown what this measures.
STUFFING: Final = "stuff " * 666


@dataclass
class Tally:
    """What the abuser saw."""

    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes


async def _read_response(reader: asyncio.StreamReader) -> Response:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Response(status, headers, body)


async def exchange(host: str, port: int, head: bytes, body: bytes = b"") -> Response:
    """Send one request on a new connection (the body while reading the answer); its response."""
    reader, writer = await asyncio.open_connection(host, port)

    async def send() -> None:
        try:
            writer.write(head)
            for start in range(0, len(body), 65536):
                writer.write(body[start : start + 65536])
                await writer.drain()
        except ConnectionError:
            pass  # the server answered and closed before taking the whole body: fine

    sender = asyncio.create_task(send())
    try:
        return await asyncio.wait_for(_read_response(reader), 30)
    finally:
        sender.cancel()
        writer.close()
        await asyncio.gather(sender, writer.wait_closed(), return_exceptions=True)


def _post(path: str, token: str, body: bytes, *, length: int | None = None, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    ).encode()


def _check_envelope(tally: Tally, kind: str, response: Response, status: int, code: str | None) -> None:
    tally.statuses[str(response.status)] += 1
    if response.status != status:
        tally.problem(f"{kind}: status {response.status}, expected {status}: {response.body[:200]!r}")
        return
    try:
        error = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        tally.problem(f"{kind}: not an error envelope: {response.body[:200]!r}")
        return
    if set(error) != {"message", "type", "param", "code"} or error["code"] != code:
        tally.problem(f"{kind}: envelope {error}")
    if any(INJECTED.lower() in name for name in response.headers):
        tally.problem(f"{kind}: an injected header came back: {dict(response.headers)}")
    if "\r" in error["message"] or "\n" in error["message"]:
        tally.problem(f"{kind}: the message echoes raw control characters: {error['message']!r}")


# ---- the kinds of abuse --------------------------------------------------------------------------------

Attack = Callable[[str, int, str, Tally], Awaitable[None]]


async def oversized(host: str, port: int, token: str, tally: Tally) -> None:
    """A body twice server.max_body_bytes: 413 payload_too_large."""
    body = b'{"model": "m", "prompt": "' + b"a" * (2 * MAX_BODY) + b'"}'
    response = await exchange(host, port, _post("/v1/completions", token, body), body)
    _check_envelope(tally, "oversized", response, 413, "payload_too_large")


async def deep_json(host: str, port: int, token: str, tally: Tally) -> None:
    """JSON nested 100,000 deep (200 KB): 400 before anyone walks it."""
    body = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await exchange(host, port, _post("/v1/completions", token, body), body)
    _check_envelope(tally, "deep_json", response, 400, None)


async def invalid_utf8(host: str, port: int, token: str, tally: Tally) -> None:
    """Bytes that are not UTF-8 inside a JSON string: 400."""
    body = b'{"model": "m", "prompt": "caf\xe9 \xff\xfe\xc3\x28"}'
    response = await exchange(host, port, _post("/v1/completions", token, body), body)
    _check_envelope(tally, "invalid_utf8", response, 400, None)


async def huge_max_tokens(host: str, port: int, token: str, tally: Tally) -> None:
    """max_tokens of 10^12, and one of 5000 digits: 400, never a generation."""
    for value in ("1000000000000", "9" * 5000):
        body = f'{{"model": "m", "prompt": "x", "max_tokens": {value}}}'.encode()
        response = await exchange(host, port, _post("/v1/completions", token, body), body)
        _check_envelope(tally, "huge_max_tokens", response, 400, None)


async def prompt_stuffing(host: str, port: int, token: str, tally: Tally) -> None:
    """A chat of 4,000 characters (20 times the 256-token context): 400 context_length_exceeded."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": STUFFING}]}).encode()
    response = await exchange(host, port, _post("/v1/chat/completions", token, body), body)
    _check_envelope(tally, "prompt_stuffing", response, 400, "context_length_exceeded")


async def header_injection(host: str, port: int, token: str, tally: Tally) -> None:
    """CR/LF and a header in model names (body and path) and in X-Request-Id: 404s, nothing reflected."""
    body = json.dumps({"model": f"m\r\n{INJECTED}: yes", "prompt": "x", "max_tokens": 1}).encode()
    extra = f"X-Request-Id: abc\r\n{INJECTED}-Id: <script>\r\n"
    response = await exchange(host, port, _post("/v1/completions", token, body, extra=extra), body)
    _check_envelope(tally, "header_injection", response, 404, "model_not_found")
    if response.headers.get("x-request-id") != "abc":
        tally.problem(f"header_injection: X-Request-Id {response.headers.get('x-request-id')!r}")
    head = (
        f"GET /v1/models/m%0D%0A{INJECTED}:%20yes HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nX-Request-Id: <script>alert(1)</script>\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    response = await exchange(host, port, head)
    _check_envelope(tally, "header_injection", response, 404, "model_not_found")
    if "<" in response.headers.get("x-request-id", ""):
        tally.problem("header_injection: an unsafe X-Request-Id was echoed")


ATTACKS: Final[dict[str, Attack]] = {
    "oversized": oversized,
    "deep_json": deep_json,
    "invalid_utf8": invalid_utf8,
    "huge_max_tokens": huge_max_tokens,
    "prompt_stuffing": prompt_stuffing,
    "header_injection": header_injection,
}
KINDS: Final = ("slow_loris", *ATTACKS)


async def _paced(attack: Attack, host: str, port: int, token: str, seconds: float, tally: Tally) -> None:
    interval = WORKERS / RATE_PER_S
    end = time.monotonic() + seconds

    async def worker(offset: float) -> None:
        await asyncio.sleep(offset)
        while time.monotonic() < end:
            started = time.monotonic()
            tally.sent += 1
            try:
                await attack(host, port, token, tally)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
                tally.problem(f"{attack.__name__}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(max(0.0, started + interval - time.monotonic()))

    await asyncio.gather(*(worker(i * interval / WORKERS) for i in range(WORKERS)))


async def slow_loris(host: str, port: int, seconds: float, tally: Tally) -> None:
    """Connections that send their request head one byte every DRIP_S: each must be cut in time."""
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 400 + b"\r\n\r\n"
    end = time.monotonic() + seconds

    async def connection() -> None:
        while time.monotonic() < end:
            tally.sent += 1
            reader, writer = await asyncio.open_connection(host, port)
            opened = time.monotonic()
            try:
                for byte in head:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    try:
                        data = await asyncio.wait_for(reader.read(1024), DRIP_S)
                    except TimeoutError:
                        continue
                    if data == b"":
                        break
                    tally.problem(f"slow_loris: got an answer to an incomplete head: {data[:80]!r}")
                    break
            except ConnectionError:
                pass
            finally:
                writer.close()
                await asyncio.gather(writer.wait_closed(), return_exceptions=True)
            lived = time.monotonic() - opened
            tally.statuses["cut"] += 1
            if lived > HEADER_TIMEOUT_S + CUT_SLACK_S:
                tally.problem(f"slow_loris: a connection lived {lived:.1f} s")

    await asyncio.gather(*(connection() for _ in range(SLOW_LORIS_CONNECTIONS)))


Interval = tuple[float, float]


async def run(
    kind: str, url: str, token: str, on_s: float, off_s: float, cycles: int
) -> tuple[Tally, list[Interval], list[Interval]]:
    """Abuse `url` in one way, on and off; the tally and the on and off intervals."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    tally = Tally()
    on: list[Interval] = []
    off: list[Interval] = []
    for _ in range(cycles):
        start = time.monotonic()
        if kind == "slow_loris":
            await slow_loris(host, port, on_s, tally)
        else:
            await _paced(ATTACKS[kind], host, port, token, on_s, tally)
        end = time.monotonic()
        on.append((start, end))
        await asyncio.sleep(off_s)
        off.append((end, time.monotonic()))
    return tally, on, off


def main(argv: list[str]) -> int:
    """Entry point: KIND URL TOKEN ON_S OFF_S CYCLES."""
    kind, url, token = argv[0], argv[1], argv[2]
    on_s, off_s, cycles = float(argv[3]), float(argv[4]), int(argv[5])
    if kind not in KINDS:
        print(f"unknown kind {kind}; one of {', '.join(KINDS)}", file=sys.stderr)
        return 2
    # On a real box the abuser's own CPU is somebody else's machine; here it shares the
    # daemon's two cores, and its work (building and sending megabytes) must not be counted
    # as the daemon's. It still gets every idle cycle: "sent" shows how much it managed.
    os.nice(19)
    print("ready", flush=True)
    tally, on, off = asyncio.run(run(kind, url, token, on_s, off_s, cycles))
    summary: dict[str, Any] = {
        "kind": kind,
        "sent": tally.sent,
        "statuses": dict(tally.statuses),
        "problems": tally.problems,
        "on": on,
        "off": off,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
