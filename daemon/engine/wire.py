"""The channel between the daemon and an engine process: length-prefixed JSON frames, and codecs.

Each frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON. JSON, not pickle:
the engine process parses model files and client-shaped data in C++ and may be subverted, so
the daemon reads nothing from it that could run code, and bounds what it reads
(`MAX_FRAME_BYTES`). The codecs turn the engine's dataclasses into plain JSON values and
back (a stream's events, a generation request, the engine's configuration, the model's facts).
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from edgellmd.engine.config import MediaChunk, PreparedMedia
from edgellmd.engine.drafts import Speculation
from edgellmd.engine.fairness import MAX_WEIGHT, PRIORITY_NAMES, Share
from edgellmd.engine.generation import (
    Event,
    Finished,
    GenerationRequest,
    MediaSpan,
    SamplingParams,
    TextDelta,
    TokenLogprob,
)

MAX_FRAME_BYTES: Final = 64 * 1024 * 1024  # a prompt of 32k tokens is about 200 KB of JSON
MAX_MEDIA_POSITIONS: Final = 1 << 24  # positions one prepared image or clip may claim (a sanity bound)
_LENGTH: Final = struct.Struct(">I")


def _code_digest() -> str:
    """The daemon package's sources, hashed (the engine process imports more than `engine/`).
    A daemon and an engine process of different code must not talk (frames one side writes the
    other misreads): the package upgraded in place while the daemon ran starts engines of the
    new code."""
    digest = hashlib.sha256()
    root = Path(__file__).parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


CODE: Final = _code_digest()
CODE_CHANGED: Final = (
    "the engine's code differs from the daemon's (edgellm was upgraded while the daemon ran): "
    "restart the daemon"
)


class ChannelClosed(ConnectionError):
    """The other side closed the channel (or sent what no frame can be)."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """Write one frame (blocking; callers serialise their writes)."""
    data = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed(
                "the channel closed mid-frame" if chunks or size != 4 else "the channel closed"
            )
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> dict[str, Any]:
    """Read one frame (blocking); ChannelClosed at the end or on a frame that is not an object."""
    (size,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ChannelClosed(f"a frame of {size} bytes is over the channel's limit")
    try:
        message = json.loads(_exactly(sock, size))
    except (ValueError, RecursionError):
        raise ChannelClosed("a frame is not JSON") from None
    if not isinstance(message, dict):
        raise ChannelClosed("a frame is not a JSON object")
    return message


# ---- codecs ------------------------------------------------------------------------------------


def _logprob(item: TokenLogprob) -> list[Any]:
    return [item.token, list(item.bytes), item.logprob, [[t, list(b), lp] for t, b, lp in item.top]]


def _unlogprob(value: list[Any]) -> TokenLogprob:
    token, raw, logprob, top = value
    return TokenLogprob(
        str(token),
        tuple(int(b) for b in raw),
        float(logprob),
        tuple((str(t), tuple(int(x) for x in b), float(lp)) for t, b, lp in top),
    )


def encode_event(event: Event) -> list[Any]:
    """One stream event as a JSON value."""
    logprobs = [_logprob(lp) for lp in event.logprobs]
    if isinstance(event, TextDelta):
        if event.queue_s or event.cached_tokens:  # a first delta
            return ["d", event.text, event.completion_tokens, logprobs, event.queue_s, event.cached_tokens]
        return ["d", event.text, event.completion_tokens, logprobs]
    return [
        "f",
        event.reason,
        event.prompt_tokens,
        event.completion_tokens,
        event.text,
        event.error,
        event.stop_sequence,
        logprobs,
        event.cached_tokens,
        event.draft_tokens,
        event.accepted_draft_tokens,
        event.queue_s,
        event.admitted,
    ]


def decode_event(value: list[Any]) -> Event:
    """The event `encode_event` made (ValueError, TypeError or KeyError for anything else)."""
    kind = value[0]
    if kind == "d":
        _, text, completion, logprobs, *first = value
        if len(first) not in (0, 2):
            raise ValueError("not an event")
        queued, cached = first or (0.0, 0)
        return TextDelta(
            str(text),
            int(completion),
            tuple(_unlogprob(lp) for lp in logprobs),
            queue_s=float(queued),
            cached_tokens=int(cached),
        )
    if kind != "f":
        raise ValueError("not an event")
    (
        _,
        reason,
        prompt,
        completion,
        text,
        error,
        stop,
        logprobs,
        cached,
        drafted,
        accepted,
        queued,
        admitted,
    ) = value
    if reason not in ("stop", "length", "cancelled", "error"):
        raise ValueError("not a finish reason")
    return Finished(
        reason,
        int(prompt),
        int(completion),
        text=str(text),
        error=None if error is None else str(error),
        stop_sequence=None if stop is None else str(stop),
        logprobs=tuple(_unlogprob(lp) for lp in logprobs),
        cached_tokens=int(cached),
        draft_tokens=int(drafted),
        accepted_draft_tokens=int(accepted),
        queue_s=float(queued),
        admitted=bool(admitted),
    )


def encode_request(request: GenerationRequest) -> dict[str, Any]:
    """A generation request as a JSON object (its grammar travels compiled, by id)."""
    sampling = asdict(request.sampling)
    sampling["logit_bias"] = [list(pair) for pair in request.sampling.logit_bias]
    sampling["grammar"] = None
    return {
        "prompt_tokens": list(request.prompt_tokens),
        "max_tokens": request.max_tokens,
        "sampling": sampling,
        "stop": list(request.stop),
        "ignore_eos": request.ignore_eos,
        "logprobs": request.logprobs,
        "cache_scope": request.cache_scope,
        "share": [request.share.tenant, request.share.weight, request.share.priority],
        "media": [[span.start, span.length, span.key] for span in request.media],
    }


def decode_request(value: dict[str, Any]) -> GenerationRequest:
    """The request `encode_request` made."""
    sampling = dict(value["sampling"])
    sampling["logit_bias"] = tuple((int(t), float(b)) for t, b in sampling["logit_bias"])
    return GenerationRequest(
        prompt_tokens=[int(t) for t in value["prompt_tokens"]],
        max_tokens=int(value["max_tokens"]),
        sampling=SamplingParams(**sampling),
        stop=tuple(str(s) for s in value["stop"]),
        ignore_eos=bool(value["ignore_eos"]),
        logprobs=None if value["logprobs"] is None else int(value["logprobs"]),
        cache_scope=str(value["cache_scope"]),
        share=_share(value["share"]),
        media=tuple(MediaSpan(int(start), int(length), str(key)) for start, length, key in value["media"]),
    )


MAX_MEDIA_KEY: Final = 128  # a chunk's id: a sha256 in hex and its index


def encode_media(media: PreparedMedia) -> dict[str, Any]:
    """A prepared image or clip as a JSON object (token runs as lists, chunks as [key, length])."""
    return {
        "digest": media.digest,
        "pieces": [
            {"key": p.key, "length": p.length} if isinstance(p, MediaChunk) else list(p) for p in media.pieces
        ],
    }


def decode_media(value: Any, n_vocab: int, most: int) -> PreparedMedia:
    """The PreparedMedia `encode_media` made, checked (ValueError or TypeError otherwise): token ids of the
    vocabulary, chunk ids of a bounded length, at most `most` positions in all."""
    if not isinstance(value, dict) or not isinstance(value.get("pieces"), list):
        raise TypeError("not prepared media")
    pieces: list[tuple[int, ...] | MediaChunk] = []
    total = 0
    for piece in value["pieces"]:
        if isinstance(piece, list):
            tokens = tuple(piece)
            if not all(type(t) is int and 0 <= t < n_vocab for t in tokens):
                raise ValueError("not a token id")
            pieces.append(tokens)
            total += len(tokens)
        elif isinstance(piece, dict):
            key, length = piece.get("key"), piece.get("length")
            if not isinstance(key, str) or not 0 < len(key) <= MAX_MEDIA_KEY or type(length) is not int:
                raise ValueError("not a media chunk")
            if length < 1:
                raise ValueError("not a media chunk")
            pieces.append(MediaChunk(key, length))
            total += length
        else:
            raise TypeError("not a piece")
        if total > most:
            raise ValueError("more positions than a prompt holds")
    return PreparedMedia(str(value.get("digest", "")), tuple(pieces))


def _share(value: Any) -> Share:
    tenant, weight, priority = value
    if type(weight) is not int or not 1 <= weight <= MAX_WEIGHT:
        raise ValueError("not a share")
    if type(priority) is not int or priority not in PRIORITY_NAMES:  # True is no class
        raise ValueError("not a share")
    return Share(str(tenant), weight, priority)


def encode_config(config: Any) -> dict[str, Any]:
    """An EngineConfig as a JSON object (paths as strings)."""
    data = asdict(config)
    data["path"] = str(config.path)
    data["mmproj"] = None if config.mmproj is None else str(config.mmproj)
    spec = data["speculative"]
    spec["draft_path"] = None if config.speculative.draft_path is None else str(config.speculative.draft_path)
    return data


def decode_config(value: dict[str, Any], config_type: type[Any]) -> Any:
    """The EngineConfig `encode_config` made (`config_type`: the class, which lives beside llama.cpp)."""
    data = dict(value)
    data["path"] = Path(data["path"])
    data["mmproj"] = None if data.get("mmproj") is None else Path(data["mmproj"])
    spec = dict(data["speculative"])
    spec["draft_path"] = None if spec["draft_path"] is None else Path(spec["draft_path"])
    data["speculative"] = Speculation(**spec)
    return config_type(**data)
