"""Raw-socket HTTP/1.1 for front-door tests: bytes no client library would send, answers read by hand."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RawAnswer:
    """One response as it came off the wire."""

    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    head: bytes  # the status line and headers, as sent

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


def connect(port: int, *, source: str | None = None, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:port, from `source` (another loopback address) if given."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if source is not None:
        sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_answer(sock: socket.socket, timeout: float = 10.0) -> RawAnswer:
    """Read one response (head, then Content-Length bytes of body) from `sock`, and nothing more.

    Bytes behind it (a pipelined request's answer) stay in the socket for the next call.
    """
    sock.settimeout(timeout)
    seen = b""
    while True:
        peeked = sock.recv(65536, socket.MSG_PEEK)
        if not peeked:
            raise ConnectionError(f"closed before a complete response head: {seen[:200]!r}")
        end = (seen + peeked).find(b"\r\n\r\n")
        if end >= 0:
            seen += _recv_exactly(sock, end + 4 - len(seen))
            break
        seen += _recv_exactly(sock, len(peeked))
    head = seen[:-4]
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = _recv_exactly(sock, int(headers.get("content-length", "0")))
    return RawAnswer(int(lines[0].split(" ", 2)[1]), headers, body, head)


def exchange(port: int, data: bytes, *, timeout: float = 10.0) -> RawAnswer:
    """Send `data` on a new connection and read the one answer."""
    with connect(port, timeout=timeout) as sock:
        sock.sendall(data)
        return read_answer(sock, timeout)


def closed_within(sock: socket.socket, seconds: float, *, drip: bytes = b"", every: float = 0.2) -> float:
    """Send `drip` one byte every `every` s (none: wait) until the server closes; the time it took.

    Anything the server sends meanwhile is read and ignored; fails if still open after `seconds`.
    """
    started = time.monotonic()
    sock.settimeout(every)
    sent = 0
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - started
        if sent < len(drip):
            try:
                sock.send(drip[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
            sent += 1
    raise AssertionError(f"still open after {seconds} s")


def get(path: str, *, token: str | None = None, extra: str = "") -> bytes:
    """A GET request head (keep-alive)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}{extra}\r\n".encode()


def post(
    path: str, body: bytes, *, token: str | None = None, length: int | None = None, chunked: bool = False
) -> bytes:
    """A JSON POST request: head and (for Content-Length) body; `length` may lie."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    framing = (
        "Transfer-Encoding: chunked\r\n"
        if chunked
        else f"Content-Length: {len(body) if length is None else length}\r\n"
    )
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n{framing}\r\n"
    ).encode()
    return head + body
