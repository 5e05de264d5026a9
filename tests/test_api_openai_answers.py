"""Server-sent event framing, byte for byte, as a raw socket and `curl -N` receive it."""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Final

import pytest

from tests.serving import RunningDaemon

CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
HELLO: Final = [{"role": "user", "content": "hello"}]
HELLO_CHAT_PROMPT_TOKENS: Final = 1 + len(b"<|user|>hello\n<|assistant|>")  # BOS + one token a byte
MAX_TOKENS: Final = 12
DONE: Final = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class RawResponse:
    """An HTTP/1.1 answer as it came off the socket: status line, headers, de-chunked body."""

    status_line: bytes
    headers: dict[str, str]  # names lower-cased
    body: bytes


def dechunk(data: bytes) -> bytes:
    """Decode a chunked transfer-encoded body strictly (every size line and CRLF where it belongs)."""
    out = bytearray()
    pos = 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            assert data[pos:] == b"\r\n"  # no trailers, nothing after the last chunk
            return bytes(out)
        out += data[pos : pos + size]
        assert data[pos + size : pos + size + 2] == b"\r\n"
        pos += size + 2


def split_head(raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Status line, headers (lower-cased names) and the rest of an HTTP/1.1 answer."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep
    status_line, *lines = head.split(b"\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        assert name.lower() not in headers, f"duplicate header {name}"
        headers[name.lower()] = value.strip()
    return status_line, headers, rest


def post_raw(daemon: RunningDaemon, path: str, body: dict[str, Any]) -> RawResponse:
    """POST `body` over a fresh socket with `Connection: close` and read until the server closes."""
    payload = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    received = bytearray()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            received += chunk
    status_line, headers, rest = split_head(bytes(received))
    if headers.get("transfer-encoding") == "chunked":
        rest = dechunk(rest)
    else:
        assert int(headers["content-length"]) == len(rest)
    return RawResponse(status_line, headers, rest)


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """Check that `body` is exactly `data: <json>\\n\\n`... then `data: [DONE]\\n\\n`; the JSON objects."""
    body.decode("utf-8")  # strictly valid UTF-8 throughout
    assert b"\r" not in body
    assert body.endswith(DONE + b"\n\n")
    frames = body[: -len(b"\n\n")].split(b"\n\n")
    assert frames[-1] == DONE
    assert len(frames) >= 2
    events: list[dict[str, Any]] = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: "), frame
        assert b"\n" not in frame
        event = json.loads(frame[len(b"data: ") :])
        assert isinstance(event, dict)
        events.append(event)
    return events


def check_stream_headers(response: RawResponse) -> None:
    """What every SSE answer must carry."""
    assert response.status_line == b"HTTP/1.1 200 OK"
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in response.headers
    assert response.headers["x-request-id"]


def check_envelope_fields(events: list[dict[str, Any]], obj: str, prefix: str) -> None:
    """One id, one `created`, one model and the right `object` across a whole stream."""
    assert len({e["id"] for e in events}) == 1
    assert events[0]["id"].startswith(prefix)
    assert len({e["created"] for e in events}) == 1
    assert isinstance(events[0]["created"], int)
    assert all(e["object"] == obj and e["model"] == "tiny" for e in events)


def check_usage(
    events: list[dict[str, Any]], include_usage: bool
) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
    """Split off the usage chunk (checking `usage` on every other chunk); the choice chunks and usage."""
    if not include_usage:
        assert all(e.get("usage") is None for e in events)
        return events, None
    *choice_events, last = events
    assert last["choices"] == []
    usage = last["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    }
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
    # Prompt tokens whose KV came from a slot or the prompt cache; no speculation on this model.
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert usage["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
    for event in choice_events:
        assert "usage" in event
        assert event["usage"] is None
    return choice_events, counts(usage)


def counts(usage: dict[str, Any]) -> dict[str, int]:
    """The token counts of a usage object, less the details that say how they were computed
    (a second request may find its prompt in a slot: its cached_tokens differ by design)."""
    return {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def chat_stream_text(
    events: list[dict[str, Any]], *, include_usage: bool, finish: str = "length"
) -> tuple[str, dict[str, int] | None]:
    """Check a chat stream's chunks; its text and usage."""
    check_envelope_fields(events, "chat.completion.chunk", "chatcmpl-")
    chunks, usage = check_usage(events, include_usage)
    choices = [c["choices"] for c in chunks]
    assert all(len(c) == 1 and c[0]["index"] == 0 for c in choices)
    first, *middle, last = (c[0] for c in choices)
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None
    for choice in middle:
        assert set(choice["delta"]) == {"content"}
        assert isinstance(choice["delta"]["content"], str)
        assert choice["delta"]["content"]
        assert choice["finish_reason"] is None
    assert last["delta"] == {}
    assert last["finish_reason"] == finish
    return "".join(c["delta"]["content"] for c in middle), usage


def completion_stream_text(
    events: list[dict[str, Any]], *, include_usage: bool, finish: str = "length"
) -> tuple[str, dict[str, int] | None]:
    """Check a text completion stream's chunks; its text and usage."""
    check_envelope_fields(events, "text_completion", "cmpl-")
    chunks, usage = check_usage(events, include_usage)
    choices = [c["choices"] for c in chunks]
    assert all(len(c) == 1 and c[0]["index"] == 0 for c in choices)
    *middle, last = (c[0] for c in choices)
    for choice in middle:
        assert isinstance(choice["text"], str)
        assert choice["text"]
        assert choice["finish_reason"] is None
    assert last["text"] == ""
    assert last["finish_reason"] == finish
    return "".join(c["text"] for c in middle), usage


def non_streamed(daemon: RunningDaemon, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The same request without streaming: its text and the whole answer."""
    status, answer = daemon.post(path, body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return (choice["message"]["content"] if path == CHAT else choice["text"]), answer


GREEDY: Final = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_framing(daemon: RunningDaemon, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": HELLO, "stream": True, **GREEDY}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = post_raw(daemon, CHAT, body)
    check_stream_headers(response)
    text, usage = chat_stream_text(sse_events(response.body), include_usage=include_usage)
    whole_text, whole = non_streamed(daemon, CHAT, {**body, "stream": False, "stream_options": None})
    assert text == whole_text
    if include_usage:
        assert (
            usage
            == counts(whole["usage"])
            == {
                "prompt_tokens": HELLO_CHAT_PROMPT_TOKENS,
                "completion_tokens": MAX_TOKENS,
                "total_tokens": HELLO_CHAT_PROMPT_TOKENS + MAX_TOKENS,
            }
        )


@pytest.mark.parametrize("include_usage", [True, False])
def test_completion_stream_framing(daemon: RunningDaemon, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "prompt": "hello", "stream": True, **GREEDY}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = post_raw(daemon, COMPLETIONS, body)
    check_stream_headers(response)
    text, usage = completion_stream_text(sse_events(response.body), include_usage=include_usage)
    whole_text, whole = non_streamed(daemon, COMPLETIONS, {**body, "stream": False, "stream_options": None})
    assert text == whole_text
    if include_usage:
        assert usage == counts(whole["usage"])
        assert usage is not None
        assert usage["completion_tokens"] == MAX_TOKENS


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_cut_by_a_stop_string(daemon: RunningDaemon, path: str) -> None:
    base: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": 40, "ignore_eos": True}
    base |= {"messages": HELLO} if path == CHAT else {"prompt": "hello"}
    full, _ = non_streamed(daemon, path, base)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected, answer = non_streamed(daemon, path, {**base, "stop": [stop]})
    assert expected == full[: full.index(stop)]
    assert answer["choices"][0]["finish_reason"] == "stop"
    response = post_raw(
        daemon, path, {**base, "stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
    )
    check_stream_headers(response)
    events = sse_events(response.body)
    read = chat_stream_text if path == CHAT else completion_stream_text
    text, usage = read(events, include_usage=True, finish="stop")
    assert text == expected
    assert usage == counts(answer["usage"])


def test_stream_that_may_end_at_eos(daemon: RunningDaemon) -> None:
    # Without ignore_eos the random weights may pick EOS: the framing must hold either way.
    response = post_raw(
        daemon,
        CHAT,
        {
            "model": "tiny",
            "messages": HELLO,
            "stream": True,
            "max_tokens": 30,
            "stream_options": {"include_usage": True},
        },
    )
    check_stream_headers(response)
    events = sse_events(response.body)
    finish = events[-2]["choices"][0]["finish_reason"]
    assert finish in {"stop", "length"}
    _, usage = chat_stream_text(events, include_usage=True, finish=finish)
    assert usage is not None
    assert (finish == "length") == (usage["completion_tokens"] == 30)


def test_invalid_stream_request_is_answered_with_json_not_sse(daemon: RunningDaemon) -> None:
    response = post_raw(daemon, CHAT, {"model": "tiny", "messages": HELLO, "stream": True, "temperature": -1})
    assert response.status_line == b"HTTP/1.1 400 Bad Request"
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    error = json.loads(response.body)["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "temperature")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_curl_sees_the_same_framing(daemon: RunningDaemon, path: str) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
    }
    body |= {"messages": HELLO} if path == CHAT else {"prompt": "hello"}
    done = subprocess.run(
        [
            "curl",
            "-sSN",
            "--http1.1",
            "--max-time",
            "30",
            "-D",
            "-",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            "@-",
            daemon.url + path,
        ],
        input=json.dumps(body).encode(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    status_line, headers, stream = split_head(done.stdout)
    check_stream_headers(RawResponse(status_line, headers, stream))
    read = chat_stream_text if path == CHAT else completion_stream_text
    text, usage = read(sse_events(stream), include_usage=True)
    raw_text, raw_usage = read(sse_events(post_raw(daemon, path, body).body), include_usage=True)
    assert (text, usage) == (raw_text, raw_usage)
