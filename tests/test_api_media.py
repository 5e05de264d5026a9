"""Images and audio through the API families, with the real clients, on tiny models with projectors.

"vision" reads images (tests.ggufmodels' LLaVA-style projector: any image is 4 tokens),
"hears" reads audio (a Whisper-and-Ultravox projector: any clip is 375 tokens a 30 s chunk),
"plain" reads text only; all run in engine processes. The clients are the real `openai`
(chat `image_url` and `input_audio` parts, Responses `input_image`, `audio.transcriptions`)
and `anthropic` (an `image` block, count_tokens) SDKs. The hostile cases each get a 400 that
names what was wrong while another stream keeps its pace and no engine stops.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import io
import os
import signal
import struct
import threading
import time
import wave
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, Final

import anthropic
import httpx
import numpy as np
import openai
import pytest
from aiohttp import web
from PIL import Image

from edgellmctl.keys import create_key
from edgellmd.api.openai.audio import MAX_PARTS
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput, MediaLimits
from edgellmd.engine.remote import RemoteEngine
from edgellmd.errors import ContextLengthExceeded
from edgellmd.http import appkeys
from tests.ggufmodels import (
    TinyAudioProjectorSpec,
    TinyModelSpec,
    TinyProjectorSpec,
    write_tiny_audio_projector,
    write_tiny_model,
    write_tiny_projector,
)
from tests.serving import RunningDaemon, running, settings_for, wait_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

IMAGE_TOKENS: Final = TinyProjectorSpec().image_tokens
CLIP_TOKENS: Final = TinyAudioProjectorSpec().chunk_tokens
MAX_IMAGES: Final = 3
MAX_IMAGE_BYTES: Final = 200_000


def png(seed: int = 1, width: int = 40, height: int = 30) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def flat(width: int, height: int) -> bytes:
    """A one-colour PNG: small whatever its size."""
    out = io.BytesIO()
    Image.new("L", (width, height), 128).save(out, "PNG")
    return out.getvalue()


def bomb(side: int = 8000) -> bytes:
    """A real decompression bomb: a few kilobytes that decode to side x side pixels."""
    out = io.BytesIO()
    Image.new("1", (side, side)).save(out, "PNG", optimize=True)
    return out.getvalue()


def progressive_jpeg(side: int = 64, comment: bytes = b"") -> bytes:
    """A progressive JPEG as Pillow writes one (ten scans), with a COM segment of `comment`."""
    pixels = np.random.default_rng(side).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", progressive=True, quality=90)
    data = out.getvalue()
    if comment:
        data = data[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + data[2:]
    return data


def scan_flood(extra: int = 60) -> bytes:
    """A progressive JPEG whose last scan is repeated `extra` times: each refinement scan walks
    every block again, 35 bytes apiece, seconds of decoding for a few kilobytes."""
    data = progressive_jpeg()
    last = data.rindex(b"\xff\xda")  # the last scan's marker (none in Pillow's entropy data)
    return data[:-2] + data[last:-2] * extra + data[-2:]


def wav(seconds: float = 1.0, hz: float = 440.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.4 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def lying_wav(hours: float = 10.0) -> bytes:
    """A WAV header that declares hours of 16 kHz samples, over one kilobyte of them."""
    declared = int(hours * 3600 * 16_000 * 2)
    fmt = struct.pack("<HHIIHH", 1, 1, 16_000, 32_000, 2, 16)
    body = (
        b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", declared) + bytes(1024)
    )
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + body


def wav_declaring(rate: int, seconds_of_bytes: float = 0.05) -> bytes:
    """An 8-bit mono WAV whose header says `rate`, over bytes for `seconds_of_bytes` at 16 kHz."""
    body = bytes(int(16_000 * seconds_of_bytes))
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    chunks = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + chunks


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


class Served:
    def __init__(self, daemon: RunningDaemon, token: str, pictures: str, others: list[str]) -> None:
        self.daemon = daemon
        self.token = token
        self.pictures = pictures  # base URL of a local server of images (fetch tests)
        self.others = others  # two more keys' tokens (tenants beside the app's)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.daemon.url + "/v1", api_key=self.token, max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.daemon.url, api_key=self.token, max_retries=0)

    def post(self, path: str, body: dict[str, Any], token: str | None = None) -> tuple[int, dict[str, Any]]:
        answer = httpx.post(
            self.daemon.url + path,
            json=body,
            headers={"Authorization": f"Bearer {token or self.token}"},
            timeout=60,
        )
        return answer.status_code, answer.json()

    def engine(self, name: str) -> RemoteEngine:
        assert self.daemon.app is not None
        engine = self.daemon.app[appkeys.REGISTRY].get(name).engine
        assert isinstance(engine, RemoteEngine)
        return engine


def _picture_server() -> Generator[str, None, None]:
    """A local HTTP server of images: one to fetch, one too big, a redirect and a slow one."""

    async def ok(_: web.Request) -> web.Response:
        return web.Response(body=png(7), content_type="image/png")

    async def big(_: web.Request) -> web.Response:
        return web.Response(body=png(8, 400, 400), content_type="image/png")

    async def moved(_: web.Request) -> web.Response:
        raise web.HTTPFound("/ok.png")

    async def slow(_: web.Request) -> web.Response:
        await asyncio_sleep(5)
        return web.Response(body=png(9), content_type="image/png")

    asyncio_sleep = asyncio.sleep
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/ok.png", ok)
    app.router.add_get("/big.png", big)
    app.router.add_get("/moved.png", moved)
    app.router.add_get("/slow.png", slow)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("media")
    keys = root / "keys.yaml"
    _, token = create_key(keys, "app", ["inference"], limits={})
    others = [create_key(keys, name, ["inference"], limits={})[1] for name in ("second", "third")]
    text = write_tiny_model(root / "text.gguf", TinyModelSpec(seed=9))
    models = [
        {
            "name": "vision",
            "file": str(text),
            "mmproj_file": str(write_tiny_projector(root / "vision.gguf")),
            "slots": 2,
            "context_size": 256,
            "threads": 1,
        },
        {
            "name": "hears",
            "file": str(text),
            "mmproj_file": str(write_tiny_audio_projector(root / "audio.gguf")),
            "slots": 1,
            "context_size": 1024,
            "threads": 1,
        },
        {"name": "plain", "file": str(text), "slots": 2, "context_size": 512, "threads": 1},
    ]
    pictures = _picture_server()
    base = next(pictures)
    settings = settings_for(
        models,
        server={"max_body_bytes": 8 * 1024 * 1024},
        auth={"keys_file": str(keys)},
        lifecycle={"preload_dir": str(root / "shm"), "watch": False},
        media={
            "max_images": MAX_IMAGES,
            "max_image_bytes": MAX_IMAGE_BYTES,
            "fetch_hosts": ["127.0.0.1"],
            "fetch_timeout_s": 1.5,
        },
    )
    try:
        with running(settings) as daemon:
            yield Served(daemon, token, base, others)
    finally:
        pictures.close()


def _prompt_tokens(served: Served, content: Any, model: str = "vision") -> dict[str, Any]:
    status, body = served.post(
        "/v1/chat/completions",
        {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]},
    )
    assert status == 200, body
    usage: dict[str, Any] = body["usage"]
    return usage


def test_the_openai_sdk_sends_an_image_part_and_its_tokens_count(served: Served) -> None:
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": "What is in"}, image_part(png(1))]}
    ]
    with served.openai() as client:
        answer = client.chat.completions.create(
            model="vision", max_tokens=4, temperature=0, messages=messages
        )
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage is not None
    text_only = _prompt_tokens(served, [{"type": "text", "text": "What is in"}])["prompt_tokens"]
    assert answer.usage.prompt_tokens == text_only + IMAGE_TOKENS


def test_the_same_image_again_reuses_its_cache_and_another_does_not(served: Served) -> None:
    content = [{"type": "text", "text": "Look:"}, image_part(png(2)), {"type": "text", "text": "now"}]
    first = _prompt_tokens(served, content)
    again = _prompt_tokens(served, content)
    assert again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
    other = _prompt_tokens(served, [content[0], image_part(png(3)), content[2]])
    # The text before the image may be reused; the image's positions never are.
    assert other["prompt_tokens_details"]["cached_tokens"] <= other["prompt_tokens"] - IMAGE_TOKENS - 2


def test_a_data_url_is_read_whatever_the_case_of_its_scheme_and_parameters(served: Served) -> None:
    """RFC 2397: the scheme, the media type and `base64` are case-insensitive (was a 400)."""
    encoded = base64.b64encode(png(6)).decode()
    lower = _prompt_tokens(
        served, [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}}]
    )
    upper = _prompt_tokens(
        served, [{"type": "image_url", "image_url": {"url": f"DATA:IMAGE/PNG;BASE64,{encoded}"}}]
    )
    assert upper["prompt_tokens"] == lower["prompt_tokens"]
    status, answer = served.post(
        "/v1/chat/completions",
        _message({"type": "image_url", "image_url": {"url": f"data:image/png;base64x,{encoded}"}}),
    )
    assert (status, answer["error"]["code"]) == (400, "invalid_image")  # a parameter that is not base64


def test_responses_takes_an_input_image(served: Served) -> None:
    with served.openai() as client:
        answer = client.responses.create(
            model="vision",
            max_output_tokens=4,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Describe"},
                        {"type": "input_image", "image_url": data_url(png(4)), "detail": "auto"},
                    ],
                }
            ],
        )
    assert answer.status in ("completed", "incomplete")
    assert answer.usage is not None
    text_only = _prompt_tokens(served, [{"type": "text", "text": "Describe"}])["prompt_tokens"]
    assert answer.usage.input_tokens == text_only + IMAGE_TOKENS


def _image_turn(image: bytes) -> Any:
    return [
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image), "detail": "auto"}]}
    ]


def test_a_chain_of_responses_is_held_to_the_image_bound_as_a_chat_history_is(served: Served) -> None:
    """A chat client sends its history's images again and is counted on them all; a chain of
    previous_response_id, each turn within media.max_images, grew a prompt of any number."""
    previous = None
    with served.openai() as client:
        for turn in range(MAX_IMAGES):  # one image a turn: the last fills the bound
            answer = client.responses.create(
                model="vision",
                max_output_tokens=1,
                store=True,
                previous_response_id=previous,
                input=_image_turn(png(40 + turn)),
            )
            previous = answer.id
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model="vision",
                max_output_tokens=1,
                previous_response_id=previous,
                input=_image_turn(png(50)),
            )
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "previous_response_id"
    assert f"holds {MAX_IMAGES + 1} images" in error["message"]
    assert "media.max_images" in error["message"]


def test_the_anthropic_sdk_sends_an_image_block(served: Served) -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(5)).decode()},
    }
    messages: Any = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    with served.anthropic() as client:
        counted = client.messages.count_tokens(model="vision", messages=messages)
        answer = client.messages.create(model="vision", max_tokens=4, messages=messages)
    assert answer.stop_reason in ("max_tokens", "end_turn")
    usage = answer.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert counted.input_tokens > IMAGE_TOKENS


def test_an_audio_part_and_a_transcription(served: Served) -> None:
    messages: Any = [{"role": "user", "content": [audio_part(wav(1.0)), {"type": "text", "text": "Say?"}]}]
    with served.openai() as client:
        answer = client.chat.completions.create(model="hears", max_tokens=3, messages=messages)
        assert answer.usage is not None
        assert answer.usage.prompt_tokens > CLIP_TOKENS
        transcript = client.audio.transcriptions.create(
            model="hears", file=("clip.wav", wav(1.5, 300), "audio/wav"), response_format="json"
        )
        assert isinstance(transcript.text, str)
        plain = client.audio.transcriptions.create(
            model="hears", file=("clip.wav", wav(0.5), "audio/wav"), response_format="text", language="en"
        )
        assert isinstance(plain, str)
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.transcriptions.create(model="vision", file=("clip.wav", wav(0.5), "audio/wav"))
        assert refused.value.code == "model_not_supported"
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.transcriptions.create(
                model="hears", file=("clip.wav", wav(0.5), "audio/wav"), response_format="srt"
            )
        assert refused.value.code == "unsupported_parameter"


def _message(*parts: Any, model: str = "vision") -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": list(parts)}]}


HOSTILE: Final = [
    ("decompression-bomb", _message(image_part(bomb())), "media.max_image_pixels"),
    ("truncated-png", _message(image_part(png(1)[:-60])), "truncated or corrupt"),
    ("jpeg-scan-flood", _message(image_part(scan_flood(), "image/jpeg")), "more than 64 progressive scans"),
    ("one-by-100000", _message(image_part(flat(1, 100_000))), "media.max_image_side"),
    ("mismatched-media-type", _message(image_part(png(1), "image/jpeg")), "not the jpeg"),
    ("not-an-image", _message(image_part(b"GIF89a but not really", "image/gif")), "could not be read"),
    (
        "not-base64",
        _message({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}),
        "base64",
    ),
    ("too-many-images", _message(*[image_part(png(i)) for i in range(MAX_IMAGES + 1)]), "media.max_images"),
    ("too-many-bytes", _message(image_part(png(1, 300, 300))), "media.max_image_bytes"),
    ("image-on-a-text-model", _message(image_part(png(1)), model="plain"), "reads no images"),
    ("audio-on-an-image-model", _message(audio_part(wav(0.2))), "reads no audio"),
    ("ten-hour-wav-header", _message(audio_part(lying_wav()), model="hears"), "media.max_audio_seconds"),
    ("wav-said-mp3", _message(audio_part(wav(0.2), "mp3"), model="hears"), "not the mp3"),
    ("audio-format-unknown", _message(audio_part(wav(0.2), "aiff"), model="hears"), "format"),
    # 0.0002 s by its header at 4.29 GHz, and seconds of resampling in the engine a request.
    (
        "absurd-sample-rate",
        _message(audio_part(wav_declaring(4_294_967_295), "wav"), model="hears"),
        "sample rate",
    ),
]


def test_a_clip_longer_than_the_context_is_a_400_saying_so_not_a_503_to_retry(served: Served) -> None:
    """Three 30 s chunks of 375 positions are past the context of 1,024: the engine process's
    answer was taken for a lie (more positions than a context holds), the engine's work counted
    as the model unloaded, a 503 asking the client to retry the same clip."""
    pid = served.engine("hears").pid
    clip = wav_declaring(1_000, seconds_of_bytes=90 * 1_000 / 16_000)  # 90 s at 1 kHz
    status, answer = served.post("/v1/chat/completions", _message(audio_part(clip, "wav"), model="hears"))
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded", answer
    assert "context is 1024 tokens" in answer["error"]["message"]
    assert served.engine("hears").pid == pid  # nothing restarted, nothing unloaded


def _stream_seconds(served: Served, out: list[float]) -> None:
    began = time.monotonic()
    body = {
        "model": "plain",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Once upon a time"}],
    }
    with httpx.stream(
        "POST",
        served.daemon.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {served.token}"},
        timeout=60,
    ) as answer:
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in lines)
    out.append(time.monotonic() - began)


def test_hostile_media_are_400s_naming_why_while_another_stream_keeps_its_pace(served: Served) -> None:
    pids = {name: served.engine(name).pid for name in ("vision", "hears", "plain")}
    alone: list[float] = []
    _stream_seconds(served, alone)
    beside: list[float] = []
    stream = threading.Thread(target=_stream_seconds, args=(served, beside))
    stream.start()
    for name, body, says in HOSTILE:
        status, answer = served.post("/v1/chat/completions", body)
        assert status == 400, (name, answer)
        assert says in answer["error"]["message"], (name, answer)
        assert answer["error"]["code"] in ("invalid_image", "invalid_audio", "model_not_supported"), (
            name,
            answer,
        )
    # The same bounds on every family's spelling of an image.
    status, answer = served.post(
        "/v1/responses",
        {
            "model": "vision",
            "max_output_tokens": 2,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(bomb())}]}],
        },
    )
    assert status == 400, answer
    assert "media.max_image_pixels" in answer["error"]["message"]
    truncated = base64.b64encode(png(1)[:-60]).decode()
    status, answer = served.post(
        "/v1/messages",
        {
            "model": "vision",
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": truncated},
                        }
                    ],
                }
            ],
        },
    )
    assert status == 400, answer
    assert answer["type"] == "error"
    assert "truncated or corrupt" in answer["error"]["message"]
    # The same bounds on the transcription endpoint's upload.
    upload = httpx.post(
        served.daemon.url + "/v1/audio/transcriptions",
        headers={"Authorization": f"Bearer {served.token}"},
        files={"file": ("long.wav", lying_wav(), "audio/wav")},
        data={"model": "hears"},
        timeout=30,
    )
    assert upload.status_code == 400, upload.text
    assert "media.max_audio_seconds" in upload.json()["error"]["message"]
    stream.join(60)
    assert beside, "the stream beside the hostile requests did not finish"
    # A stream beside them runs at the pace of one alone, give or take this machine's noise.
    assert beside[0] < 3 * alone[0] + 2.0, (alone, beside)
    # No engine stopped: each is the process it was, and each still serves.
    assert {name: served.engine(name).pid for name in pids} == pids
    assert _prompt_tokens(served, [image_part(png(6)), {"type": "text", "text": "ok"}])["prompt_tokens"] > 0


def test_image_urls_are_fetched_from_listed_hosts_only(served: Served) -> None:
    def url_part(url: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url}}

    usage = _prompt_tokens(served, [url_part(served.pictures + "/ok.png"), {"type": "text", "text": "hi"}])
    assert usage["prompt_tokens"] > IMAGE_TOKENS
    cases = [
        (served.pictures + "/moved.png", "answered 302"),
        (served.pictures + "/big.png", "media.max_image_bytes"),
        (served.pictures + "/slow.png", "media.fetch_timeout_s"),
        (served.pictures.replace("127.0.0.1", "localhost") + "/ok.png", "media.fetch_hosts"),
        ("ftp://127.0.0.1/ok.png", "data: URL or an http(s) URL"),
    ]
    for url, says in cases:
        began = time.monotonic()
        status, answer = served.post("/v1/chat/completions", _message(url_part(url)))
        assert status == 400, (url, answer)
        assert says in answer["error"]["message"], (url, answer)
        assert time.monotonic() - began < 4, url  # the slow one is cut at its timeout


def test_a_queued_image_request_is_served_by_the_restarted_engine(served: Served) -> None:
    """Its chunks lived in the dead process: the restarted one prepares them again, under the
    same ids, before the request is submitted there."""
    victim = served.engine("vision")
    long_ones: list[int] = []

    def hold_a_slot() -> None:
        status, _ = served.post(
            "/v1/chat/completions",
            {
                "model": "vision",
                "max_tokens": 200,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "go"}],
            },
        )
        long_ones.append(status)

    holders = [threading.Thread(target=hold_a_slot) for _ in range(2)]
    for thread in holders:
        thread.start()
    wait_for(lambda: victim.busy_slots == 2, what="both slots busy")
    result: list[tuple[int, dict[str, Any]]] = []
    queued = threading.Thread(
        target=lambda: result.append(
            served.post("/v1/chat/completions", _message(image_part(png(11)), {"type": "text", "text": "x"}))
        )
    )
    queued.start()
    wait_for(lambda: victim.queue_depth == 1, what="the image request queued")
    os.kill(victim.pid, signal.SIGKILL)
    queued.join(60)
    for thread in holders:
        thread.join(60)
    status, body = result[0]
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > IMAGE_TOKENS
    assert served.engine("vision").pid != victim.pid
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    # Each holder was cut with engine_failed (503) or finished on its own before the kill.
    assert set(long_ones) <= {200, 503}
    wait_for(lambda: not Path(f"/proc/{victim.pid}").exists(), timeout=5, what="the dead process reaped")


def settled(loop: asyncio.AbstractEventLoop) -> None:
    """Every callback the loop was given before this call has run, and what they woke too:
    a `cancel()` from this thread reaches its task through the loop, later than it returns."""
    for _ in range(3):
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), loop).result(10)


def test_a_prompt_whose_client_left_lets_go_of_its_images(served: Served) -> None:
    """A client gone while its image waits for the prompt pool or the media pool: the image is
    never prepared (a key capped at one request in flight queued any number of clips by leaving
    each). Gone while its engine prepares a clip: the preparation finishes and its chunks are
    let go of then, never held for good."""
    assert served.daemon.app is not None
    registry = served.daemon.app[appkeys.REGISTRY]
    handle = registry.get("vision")
    assert handle.media_executor is not None
    assert handle.media_executor is not handle.executor
    assert registry.get("hears").media_executor not in (None, handle.media_executor)  # a pool per model

    def media(model: str = "vision") -> dict[str, Any]:
        """The engine's media figures as they are now: from a status frame made after this call
        began (they come every quarter second: the last one may be older than an encode)."""
        engine = served.engine(model)

        def frame_after(seen: object) -> None:
            wait_for(lambda: engine._status is not seen, timeout=10, what="a status frame")

        for _ in range(2):  # the first change may be a frame made before
            frame_after(engine._status)
        figures: dict[str, Any] = engine.performance()["media"]
        return figures

    def looking_at(seed: int) -> ChatMessage:
        return ChatMessage("user", "look", media=(MediaInput("image", png(seed), "png"),), media_at=(4,))

    async def ask(model: str, asked: ChatMessage) -> Any:
        return await registry.get(model).chat_prompt([asked], media_limits=MediaLimits())

    def idle(model: str = "vision") -> bool:
        """Nothing held and nothing encoded for half a second (an earlier test's replay may
        still be preparing its image in a restarted engine)."""
        first = media(model)["chunks_encoded"]
        time.sleep(0.5)
        return bool(media(model)["chunks_encoded"] == first and media(model)["store_held"] == 0)

    for seed, pool in ((120, handle.media_executor), (121, handle.executor)):  # an image each
        wait_for(idle, timeout=30, what="the engine idle")
        gate = threading.Event()
        blocker = pool.submit(gate.wait, 30)  # the pool's one thread for this tenant, held
        asked = asyncio.run_coroutine_threadsafe(ask("vision", looking_at(seed)), served.daemon.loop)
        time.sleep(0.3)  # queued behind the blocker
        asked.cancel()
        settled(served.daemon.loop)  # the loop has cancelled the request before the pool moves on
        gate.set()
        blocker.result(5)
        time.sleep(0.5)
        assert media()["store_held"] == 0
        # Never prepared: the same image asked for now is encoded, not found in the engine's
        # store (whatever else an earlier test's replay may still encode meanwhile).
        before = media()
        again = asyncio.run_coroutine_threadsafe(ask("vision", looking_at(seed)), served.daemon.loop)
        prompt = again.result(30)
        assert prompt.held is not None
        prompt.held.release()
        after = media()
        assert after["chunks_reused"] == before["chunks_reused"], (before, after)
        assert after["chunks_encoded"] > before["chunks_encoded"]

    clip = wav_declaring(1_000, seconds_of_bytes=600 * 1_000 / 16_000)  # seconds to prepare
    heard = ChatMessage("user", "hear", media=(MediaInput("audio", clip, "wav"),), media_at=(4,))
    wait_for(lambda: idle("hears"), timeout=30, what="the engine idle")
    encoded = media("hears")["chunks_encoded"]
    asked = asyncio.run_coroutine_threadsafe(ask("hears", heard), served.daemon.loop)
    wait_for(lambda: media("hears")["chunks_encoded"] > encoded, timeout=30, what="the clip being prepared")
    asked.cancel()
    # Done before the cancel came (a loaded machine): the clip, long enough to take seconds to
    # prepare, makes a prompt longer than the context, refused with its chunks let go of.
    with contextlib.suppress(concurrent.futures.CancelledError, ContextLengthExceeded):
        if (prompt := asked.result(30)).held is not None:
            prompt.held.release()
    wait_for(lambda: media("hears")["store_held"] == 0, timeout=30, what="its chunks let go of")
    assert media("hears")["chunks_encoded"] > encoded


def _upload(served: Served, files: Any = None, data: Any = None, **more: Any) -> httpx.Response:
    return httpx.post(
        served.daemon.url + "/v1/audio/transcriptions",
        headers={"Authorization": f"Bearer {served.token}", **more.pop("headers", {})},
        files=files,
        data=data,
        timeout=30,
        **more,
    )


@pytest.mark.parametrize(
    ("name", "files", "data", "status", "says"),
    [
        ("no file", {"model": (None, "hears")}, None, 400, "'file' is required"),
        ("no model", {"file": ("a.wav", wav(0.2), "audio/wav")}, {}, 400, "'model' is required"),
        (
            "two files",
            [("file", ("a.wav", wav(0.2), "audio/wav")), ("file", ("b.wav", wav(0.2), "audio/wav"))],
            {"model": "hears"},
            400,
            "one 'file' per request",
        ),
        ("unknown field", {"file": ("a.wav", wav(0.2), "audio/wav")}, {"model": "hears", "x": "1"}, 400, "x"),
        ("empty file", {"file": ("a.wav", b"", "audio/wav")}, {"model": "hears"}, 400, "empty"),
        (
            "verbose_json",
            {"file": ("a.wav", wav(0.2), "audio/wav")},
            {"model": "hears", "response_format": "verbose_json"},
            400,
            "json or text",
        ),
        (
            "timestamps",
            {"file": ("a.wav", wav(0.2), "audio/wav")},
            {"model": "hears", "timestamp_granularities[]": "word"},
            400,
            "not supported",
        ),
        (
            "temperature",
            {"file": ("a.wav", wav(0.2), "audio/wav")},
            {"model": "hears", "temperature": "hot"},
            400,
            "from 0 to 1",
        ),
        (
            "language",
            {"file": ("a.wav", wav(0.2), "audio/wav")},
            {"model": "hears", "language": "english please"},
            400,
            "ISO-639-1",
        ),
        ("not audio", {"file": ("a.wav", png(1), "audio/wav")}, {"model": "hears"}, 400, "formats"),
        (
            "a text model",
            {"file": ("a.wav", wav(0.2), "audio/wav")},
            {"model": "plain"},
            400,
            "reads no audio",
        ),
        ("no such model", {"file": ("a.wav", wav(0.2), "audio/wav")}, {"model": "nope"}, 404, "nope"),
    ],
)
def test_transcription_uploads_that_are_wrong_are_refused_by_name(
    served: Served, name: str, files: Any, data: Any, status: int, says: str
) -> None:
    answer = _upload(served, files=files, data=data)
    assert answer.status_code == status, (name, answer.text)
    assert says in answer.json()["error"]["message"], (name, answer.text)


def test_a_clip_the_engine_refuses_is_the_file_s_fault_not_a_message_s(served: Served) -> None:
    """A clip refused as it was decoded named `messages` (a field transcriptions has not) and
    "clip 1", as a chat request's would: it names `file`."""
    for wrong in (wav(0.5)[:-300] + b"\x00" * 7, wav(0.5).replace(b"WAVE", b"WAVX", 1)):
        answer = _upload(served, files={"file": ("a.wav", wrong, "audio/wav")}, data={"model": "hears"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "file", error
        assert not error["message"].startswith("clip"), error


def _form(*fields: tuple[str, bytes]) -> bytes:
    return (
        b"".join(
            b'--b\r\nContent-Disposition: form-data; name="' + name.encode() + b'"\r\n\r\n' + value + b"\r\n"
            for name, value in fields
        )
        + b"--b--\r\n"
    )


def test_a_chunked_form_is_bounded_in_all_as_one_with_a_length(served: Served) -> None:
    """A chunked body has no Content-Length to refuse up front: once, 200 MB of a repeated field
    (each part within its own bound) were read to the end and answered 200. A form has at most
    MAX_PARTS parts, and their bytes together are bounded by server.max_body_bytes (8 MiB here)."""
    field = ("include[]", b"x" * 60_000)
    body = _form(
        ("model", b"hears"), *[field] * 50, ("file", bytes(6_000_000))
    )  # 9 MB, each part within its own

    def chunked() -> Iterator[bytes]:  # no length: httpx sends it chunked
        for start in range(0, len(body), 65_536):
            yield body[start : start + 65_536]

    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    answer = _upload(served, content=chunked(), headers=headers)
    assert answer.status_code == 413, answer.text
    many = _form(("model", b"hears"), *[("include[]", b"x")] * MAX_PARTS, ("file", wav(0.2)))
    answer = _upload(served, content=many, headers=headers)
    assert answer.status_code == 400, answer.text
    assert f"more than {MAX_PARTS} parts" in answer.json()["error"]["message"]
    fits = _form(("model", b"hears"), *[("include[]", b"x")] * 8, ("file", wav(0.2)))
    assert _upload(served, content=iter([fits]), headers=headers).status_code == 200


def test_transcription_bodies_that_are_not_a_form_are_refused(served: Served) -> None:
    json_body = _upload(served, json={"model": "hears"})
    assert json_body.status_code == 415
    urlencoded = _upload(served, data={"model": "hears"})
    assert urlencoded.status_code == 415
    no_boundary = _upload(served, content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"})
    assert no_boundary.status_code == 400, no_boundary.text
    cut = _upload(
        served,
        content=b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nhears\r\n--b\r\nContent-Dispo',
        headers={"Content-Type": "multipart/form-data; boundary=b"},
    )
    assert cut.status_code == 400, cut.text
    # The box still transcribes.
    ok = _upload(served, files={"file": ("a.wav", wav(0.3), "audio/wav")}, data={"model": "hears"})
    assert ok.status_code == 200, ok.text
    assert set(ok.json()) == {"text", "usage"}


def test_clips_being_prepared_hold_up_no_other_key_s_text_prompts(served: Served) -> None:
    """Two keys' clips of ten minutes, prepared for seconds each: a third key's text chat, on
    another model and on the clips' own, and its image on another model, are answered
    meanwhile. Images and clips wait on their model's media pool and the engine prepares them
    on a thread of its own: on the prompt pool (two threads, every model's) the two clips held
    both for as long as they took; on one media pool of every model's, the image waited too."""
    clip = _message(
        audio_part(wav_declaring(1_000, seconds_of_bytes=600 * 1_000 / 16_000), "wav"), model="hears"
    )
    began = time.monotonic()
    status, answer = served.post("/v1/chat/completions", clip)
    alone = time.monotonic() - began
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded", answer
    ended: list[float] = []

    def prepare(token: str) -> None:
        status, answer = served.post("/v1/chat/completions", clip, token=token)
        assert status == 400, answer
        assert answer["error"]["code"] == "context_length_exceeded", answer
        ended.append(time.monotonic())

    heavy = [threading.Thread(target=prepare, args=(token,)) for token in served.others]
    for thread in heavy:
        thread.start()
    time.sleep(alone / 4)  # both clips are being read and prepared now
    text: dict[str, float] = {}
    for model, part in (
        ("plain", {"type": "text", "text": "Hi"}),
        ("hears", {"type": "text", "text": "Hi"}),
        ("vision", image_part(png(14))),  # another model's images wait on its own media pool
    ):
        started = time.monotonic()
        status, answer = served.post("/v1/chat/completions", _message(part, model=model))
        assert status == 200, answer
        text[model] = time.monotonic() - started
    finished = time.monotonic()
    for thread in heavy:
        thread.join(120)
    assert len(ended) == 2
    # Answered while both clips were still being prepared, in a fraction of one clip's time.
    assert finished < min(ended), (alone, text, [e - finished for e in ended])
    assert sum(text.values()) < alone / 2, (alone, text)
