"""Images and clips through the scheduler: prepared on the pool, decoded in a slot, reused by prefix.

The reference is libmtmd's own evaluation of the same prompt (tests/test_engine_mtmd.py's
path): the engine's first reply token must see the same distribution, so the image reached
the text model where the prompt put it, whole, and only once.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import io
import math
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest
from PIL import Image

from edgellmd.engine.config import (
    EngineConfig,
    EngineError,
    MediaChunk,
    MediaError,
    MediaInput,
    MediaLimits,
    PreparedMedia,
)
from edgellmd.engine.generation import (
    Finished,
    GenerationRequest,
    MediaSpan,
    SamplingParams,
    TokenLogprob,
    placeholders,
)
from edgellmd.engine.media import MAX_JPEG_SCANS, decode_audio, decode_image, jpeg_scans
from edgellmd.engine.remote import NATIVE_LINES, NATIVE_WINDOW_S, NativeLines, RemoteEngine
from edgellmd.engine.scheduler import Engine
from tests.ggufmodels import (
    TinyAudioProjectorSpec,
    TinyModelSpec,
    TinyProjectorSpec,
    write_tiny_audio_projector,
    write_tiny_model,
    write_tiny_projector,
)
from tests.test_api_media import progressive_jpeg, scan_flood

LIMITS = MediaLimits()
GREEDY = SamplingParams(temperature=0.0)


def png(seed: int, width: int = 40, height: int = 30) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def wav(seconds: float, hz: float, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.5 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    out = io.BytesIO()
    import wave  # noqa: PLC0415

    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return out.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("media")
    return write_tiny_model(root / "text.gguf", TinyModelSpec(seed=9)), write_tiny_projector(root / "p.gguf")


def make_engine(model: Path, projector: Path | None, *, context: int = 256, slots: int = 2) -> Engine:
    config = EngineConfig(
        path=model,
        slots=slots,
        context_size=context,
        batch_size=512,
        threads=1,
        threads_batch=1,
        mmproj=projector,
    )
    return Engine(config, name=model.stem)


@pytest.fixture(scope="module")
def engine(files: tuple[Path, Path]) -> Iterator[Engine]:
    eng = make_engine(*files)
    yield eng
    eng.close()


def prompt_with(
    engine: Engine | RemoteEngine, before: list[int], media: PreparedMedia, after: list[int]
) -> tuple[list[int], tuple[MediaSpan, ...]]:
    tokens, spans = list(before), []
    for piece in media.pieces:
        if isinstance(piece, MediaChunk):
            spans.append(MediaSpan(len(tokens), piece.length, piece.key))
            tokens += placeholders(piece.key, piece.length)
        else:
            tokens += piece
    return tokens + after, tuple(spans)


async def first_token(
    engine: Engine, tokens: list[int], spans: tuple[MediaSpan, ...], max_tokens: int = 1
) -> Finished:
    request = GenerationRequest(tokens, max_tokens, GREEDY, ignore_eos=True, logprobs=5, media=spans)
    gen = engine.submit(request, asyncio.get_running_loop())
    logprobs: list[TokenLogprob] = []
    async for event in gen.events(30):
        logprobs.extend(event.logprobs)
        if isinstance(event, Finished):
            return replace(event, logprobs=tuple(logprobs))
    raise AssertionError("no Finished")


def top(finished: Finished) -> list[float]:
    """The first reply token's best alternatives' log-probabilities."""
    return [logprob for _, _, logprob in finished.logprobs[0].top]


def reference(files: tuple[Path, Path], image: bytes) -> tuple[list[int], list[int], np.ndarray]:
    """libmtmd's evaluation of "A<image>B" on a fresh context: the tokens around the image and the
    next-token log-probabilities."""
    model_path, projector = files
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = 256
    ctx_params.n_batch = ctx_params.n_ubatch = 64
    ctx_params.n_threads = ctx_params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    mparams = mtmd.mtmd_context_params_default()
    mparams.use_gpu, mparams.print_timings, mparams.n_threads, mparams.warmup = False, False, 1, False
    mctx = mtmd.mtmd_init_from_file(str(projector).encode(), model, mparams)
    pixels = np.ascontiguousarray(np.asarray(Image.open(io.BytesIO(image)).convert("RGB")), dtype=np.uint8)
    height, width, _ = pixels.shape
    bitmap = mtmd.mtmd_bitmap_init(width, height, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    text = mtmd.mtmd_input_text()
    prompt = b"A" + mtmd.mtmd_default_marker() + b"B"
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), True, True
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        texts = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                texts.append([int(ids[j]) for j in range(n.value)])
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 64, True, ctypes.byref(n_past)) == 0
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(mctx)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    shifted = logits - logits.max()
    logprobs = shifted - math.log(float(np.exp(shifted).sum()))
    return texts[0], texts[-1], logprobs


async def test_an_image_reaches_the_model_where_the_prompt_puts_it(
    engine: Engine, files: tuple[Path, Path]
) -> None:
    image = png(10)
    before, after, expected = reference(files, image)
    prepared = engine.prepare_media(MediaInput("image", image, "png"), LIMITS)
    try:
        assert prepared.n_positions == TinyProjectorSpec().image_tokens  # the mlp projector adds no markup
        tokens, spans = prompt_with(engine, before, prepared, after)
        finished = await first_token(engine, tokens, spans)
    finally:
        engine.release_media([p.key for p in prepared.pieces if isinstance(p, MediaChunk)])
    assert finished.error is None, finished.error
    assert finished.prompt_tokens == len(before) + TinyProjectorSpec().image_tokens + len(after)
    top = finished.logprobs[0].top
    best = np.argsort(-expected)[: len(top)]
    got = [lp for _, _, lp in top]
    assert np.allclose(got, expected[best], atol=1e-3), (got, expected[best])


async def test_the_same_image_is_encoded_once_and_its_prefix_reused_another_is_not(
    engine: Engine, files: tuple[Path, Path]
) -> None:
    before, after, _ = reference(files, png(1))
    encoded = engine.projector.encoded if engine.projector else 0

    async def ask(image: bytes) -> Finished:
        prepared = engine.prepare_media(MediaInput("image", image), LIMITS)
        try:
            tokens, spans = prompt_with(engine, before, prepared, after)
            return await first_token(engine, tokens, spans)
        finally:
            engine.release_media([p.key for p in prepared.pieces if isinstance(p, MediaChunk)])

    first = await ask(png(21))
    again = await ask(png(21))
    other = await ask(png(22))
    assert engine.projector is not None
    assert engine.projector.encoded == encoded + 2  # 21 once, 22 once
    assert engine.projector.reused >= 1
    # The second asking kept the first's cache past the image: only the last token again.
    assert again.cached_tokens == again.prompt_tokens - 1
    assert top(again) == pytest.approx(top(first))
    # Another image shares the text before it, never the image's positions.
    assert other.cached_tokens <= len(before)
    assert top(other) != pytest.approx(top(first))


async def test_a_request_whose_media_is_not_prepared_or_misplaced_is_refused(engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    key = "0" * 64 + ":0"
    tokens = [1, 5, *placeholders(key, 4), 6]
    with pytest.raises(EngineError, match="not prepared"):
        engine.submit(GenerationRequest(tokens, 1, GREEDY, media=(MediaSpan(2, 4, key),)), loop)
    with pytest.raises(EngineError, match="placeholders"):
        engine.submit(GenerationRequest(tokens, 1, GREEDY, media=(MediaSpan(1, 4, key),)), loop)
    with pytest.raises(EngineError, match="negative"):
        engine.submit(GenerationRequest(tokens, 1, GREEDY), loop)
    with pytest.raises(EngineError, match="out of"):  # the prompt's last position starts the reply
        engine.submit(GenerationRequest(tokens[:-1], 1, GREEDY, media=(MediaSpan(2, 4, key),)), loop)
    # It still serves.
    finished = await first_token(engine, [1, 5, 6], ())
    assert finished.error is None


@pytest.mark.parametrize(
    ("data", "declared", "says"),
    [
        (png(1)[:-40], "png", "truncated or corrupt"),
        (b"\x89PNG\r\n\x1a\nnot really", None, "could not be read"),
        (png(1), "image/jpeg", "not the jpeg"),
        (png(1, 1, 9000), None, "max_image_side"),
        (wav(0.5, 440), None, "none of the formats"),
    ],
)
def test_images_the_engine_cannot_use_are_the_clients_error(
    engine: Engine, data: bytes, declared: str | None, says: str
) -> None:
    with pytest.raises(MediaError, match=says):
        engine.prepare_media(MediaInput("image", data, declared), LIMITS)
    assert engine.projector is not None
    assert engine.projector.status()["store_held"] == 0  # nothing held by a refusal


def test_a_model_without_a_projector_reads_no_images(files: tuple[Path, Path]) -> None:
    plain = make_engine(files[0], None)
    try:
        assert plain.media_kinds == ()
        with pytest.raises(MediaError, match="reads no images"):
            plain.prepare_media(MediaInput("image", png(1)), LIMITS)
    finally:
        plain.close()


async def test_a_clip_reaches_the_model_through_the_audio_projector(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "text.gguf", TinyModelSpec(seed=9))
    projector = write_tiny_audio_projector(tmp_path / "audio.gguf")
    eng = make_engine(model, projector, context=1024, slots=1)
    try:
        assert eng.media_kinds == ("audio",)
        with pytest.raises(MediaError, match="reads no images"):
            eng.prepare_media(MediaInput("image", png(1)), LIMITS)
        results = []
        for hz in (440, 440, 1000):
            prepared = eng.prepare_media(MediaInput("audio", wav(1.0, hz, rate=8000), "wav"), LIMITS)
            try:
                assert prepared.n_positions == TinyAudioProjectorSpec().chunk_tokens
                tokens, spans = prompt_with(eng, [1, 30], prepared, [40])
                results.append(await first_token(eng, tokens, spans))
            finally:
                eng.release_media([p.key for p in prepared.pieces if isinstance(p, MediaChunk)])
        same, again, other = (top(r) for r in results)
        assert same == pytest.approx(again)
        assert same != pytest.approx(other)
        with pytest.raises(MediaError, match="max_audio_seconds"):
            eng.prepare_media(MediaInput("audio", wav(3.0, 440)), MediaLimits(max_audio_seconds=2))
    finally:
        eng.close()


async def test_an_engine_process_prepares_media_as_the_engine_does(
    engine: Engine, files: tuple[Path, Path]
) -> None:
    """Across the channel: the same image gives the same reply distribution; a refusal keeps its
    limit; an answer out of shape is not trusted."""
    config = dataclasses.replace(engine.config)
    remote = RemoteEngine(config, name="remote-media", landlock=True)
    try:
        assert remote.media_kinds == ("image",)
        image = png(31)
        before, after, _ = reference(files, image)
        results = []
        for eng in (engine, remote):
            prepared = eng.prepare_media(MediaInput("image", image, "image/png"), LIMITS)
            try:
                tokens, spans = prompt_with(eng, before, prepared, after)
                request = GenerationRequest(tokens, 1, GREEDY, ignore_eos=True, logprobs=5, media=spans)
                gen = eng.submit(request, asyncio.get_running_loop())
                logprobs: list[TokenLogprob] = []
                async for event in gen.events(30):
                    logprobs.extend(event.logprobs)
                results.append([lp for _, _, lp in logprobs[0].top])
            finally:
                eng.release_media([p.key for p in prepared.pieces if isinstance(p, MediaChunk)])
        assert results[0] == pytest.approx(results[1])
        with pytest.raises(MediaError, match="max_image_side") as refused:
            remote.prepare_media(MediaInput("image", png(1, 1, 9000)), LIMITS)
        assert refused.value.limit == "media.max_image_side"
    finally:
        remote.close()


_RAW_ONE_SAMPLE = """
import ctypes, sys
import llama_cpp, llama_cpp.mtmd_cpp as mtmd
import numpy as np
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
mparams = mtmd.mtmd_context_params_default()
mparams.use_gpu, mparams.print_timings, mparams.n_threads, mparams.warmup = False, False, 1, False
mctx = mtmd.mtmd_init_from_file(sys.argv[2].encode(), model, mparams)
pcm = np.zeros(int(sys.argv[3]), dtype=np.float32)
bitmap = mtmd.mtmd_bitmap_init_from_audio(len(pcm), pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
text = mtmd.mtmd_input_text()
prompt = mtmd.mtmd_default_marker()
text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), False, True
chunks = mtmd.mtmd_input_chunks_init()
bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
print("status", mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1), flush=True)
"""


@pytest.mark.parametrize("samples", [1, 16_000])
def test_libmtmd_aborts_on_a_one_sample_clip_which_the_engine_pads(tmp_path: Path, samples: int) -> None:
    """The hazard, kept visible: libmtmd asserts (SIGABRT, the whole process) on a clip of one
    sample; a second of silence is read. The engine pads every short clip (engine.media)."""
    model = write_tiny_model(tmp_path / "text.gguf", TinyModelSpec(seed=9))
    projector = write_tiny_audio_projector(tmp_path / "audio.gguf")
    done = subprocess.run(
        [sys.executable, "-c", _RAW_ONE_SAMPLE, str(model), str(projector), str(samples)],
        capture_output=True,
        timeout=120,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        check=False,
    )
    if samples == 1:
        assert done.returncode == -signal.SIGABRT, done.stdout
        assert b"GGML_ASSERT" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"status 0" in done.stdout
    eng = make_engine(model, projector, context=1024, slots=1)
    try:
        for clip in (wav(1 / 16_000, 440), wav(0.001, 440, rate=8000)):  # one sample, eight
            prepared = eng.prepare_media(MediaInput("audio", clip), LIMITS)
            assert prepared.n_positions == TinyAudioProjectorSpec().chunk_tokens
            eng.release_media([p.key for p in prepared.pieces if isinstance(p, MediaChunk)])
    finally:
        eng.close()


def test_an_engines_native_output_reaches_the_log_at_a_bounded_pace() -> None:
    """libmpg123 writes a line per defect of a corrupt MP3: a flood of them shows NATIVE_LINES a
    window and a count of the rest, never the flood."""
    lines = NativeLines()
    admitted = [lines.admit(0.001 * i) for i in range(1000)]  # a thousand lines within a second
    assert sum(show for show, _ in admitted) == NATIVE_LINES
    assert all(held == 0 for _, held in admitted)
    show, held = lines.admit(NATIVE_WINDOW_S + 1)  # the next window: shown, the held ones counted
    assert show
    assert held == 1000 - NATIVE_LINES
    assert lines.admit(NATIVE_WINDOW_S + 2) == (True, 0)


# ---- what a clip's header may declare (engine.media, before a sample is decoded) ----------------


def _wav_header(rate: int, channels: int, body: bytes) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels, channels, 8)
    chunks = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + chunks


def _flac(rate: int, channels: int, seconds: float) -> bytes:
    """Silence, which FLAC stores as constant subframes: a few bytes a block, whatever it declares."""
    import soundfile  # noqa: PLC0415

    out = io.BytesIO()
    frames = int(rate * seconds)
    with soundfile.SoundFile(out, "w", samplerate=rate, channels=channels, format="FLAC") as clip:
        block = np.zeros((65_536, channels), dtype=np.float32)
        for start in range(0, frames, len(block)):
            clip.write(block[: min(len(block), frames - start)])
    return out.getvalue()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # Declares 4.29 GHz over 740 KB: 0.0002 s by its header, and seconds of resampling.
        (_wav_header(4_294_967_295, 1, bytes(740_000)), "sample rate is 4294967295 Hz"),
        (_wav_header(999, 1, bytes(4_000)), "sample rate is 999 Hz"),
        (_wav_header(16_000, 9, bytes(9 * 1_000)), "9 channels; at most 8"),
    ],
)
def test_a_wav_header_no_recorder_writes_is_refused_before_decoding(data: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        decode_audio(data, "wav", MediaLimits(max_audio_seconds=600), 16_000)


def test_a_flac_that_declares_more_samples_than_its_limit_is_refused_as_it_decodes() -> None:
    """A small FLAC of silence declaring 8 channels at 96 kHz: the duration limit alone let it
    decode into gigabytes (the engine killed at its memory limit, other requests with it). The
    samples of all channels are bounded too, and read a block at a time, mono as they come."""
    limits = MediaLimits(max_audio_seconds=10)
    bomb = _flac(96_000, 8, 10)
    assert len(bomb) < 200_000
    with pytest.raises(MediaError, match="more samples than 10 s of 48 kHz stereo"):
        decode_audio(bomb, "flac", limits, 16_000)
    stereo = decode_audio(_flac(48_000, 2, 10), "flac", limits, 16_000)  # the bound itself: read
    assert len(stereo) == pytest.approx(160_000, abs=16)
    with pytest.raises(MediaError, match="longer than 10 s"):
        decode_audio(_flac(16_000, 1, 11), "flac", limits, 16_000)


def test_an_image_encoded_for_one_cache_scope_is_encoded_again_for_another(engine: Engine) -> None:
    """The store of encoded chunks was shared by every key: another key's same image was found
    there, answered in a fraction of an encode's time, and so told that key the image had been
    sent (the KV reuse was scoped; the store was not). Its ids begin from the scope now."""
    projector = engine.projector
    assert projector is not None
    image = png(77)
    held: list[str] = []
    try:
        ids: dict[str, list[str]] = {}
        for scope in ("key:aaaaaaaaaaaa", "key:aaaaaaaaaaaa", "key:bbbbbbbbbbbb", "group:team"):
            before = (projector.encoded, projector.reused)
            prepared = engine.prepare_media(MediaInput("image", image, "png", scope=scope), LIMITS)
            keys = [p.key for p in prepared.pieces if isinstance(p, MediaChunk)]
            held += keys
            ids.setdefault(scope, keys)
            assert ids[scope] == keys  # the same scope: the same chunks
            reused = projector.reused - before[1]
            assert (reused > 0) is (scope == "key:aaaaaaaaaaaa" and len(held) > len(keys))
        assert len({tuple(k) for k in ids.values()}) == 3  # three scopes, three encodings
    finally:
        engine.release_media(held)


def test_a_jpegs_scans_are_counted_by_its_markers_and_a_flood_of_them_is_refused_undecoded() -> None:
    """A 68 KB progressive JPEG of a thousand refinement scans took 30 s of an engine's prompt
    threads (every scan walks every block again). The scans are counted by walking the markers:
    an encoder's ten pass, bytes that look like a scan's marker inside a segment or a scan's
    data do not count, and past MAX_JPEG_SCANS the file is refused before any decoding."""
    plain = progressive_jpeg(comment=b"\xff\xda" * 100)  # "markers" inside a COM segment
    assert jpeg_scans(plain) == 10
    assert decode_image(plain, "jpeg", LIMITS).shape == (64, 64, 3)
    baseline = io.BytesIO()
    Image.new("RGB", (16, 16)).save(baseline, "JPEG")
    assert jpeg_scans(baseline.getvalue()) == 1
    flood = scan_flood(extra=2_000)
    assert jpeg_scans(flood) == MAX_JPEG_SCANS + 1  # counted no further than needed
    with pytest.raises(MediaError, match=f"more than {MAX_JPEG_SCANS} progressive scans"):
        decode_image(flood, "jpeg", LIMITS)
    assert jpeg_scans(plain[:40]) <= 1  # a cut file stops the count; Pillow says what is wrong
    # Bytes libjpeg skips between segments (it warns and reads on): the walk skips them too.
    # A stray byte, or a stuffed FF00, before the first scan hid every scan from it.
    first = flood.index(b"\xff\xda")
    for stray in (b"\x00", b"junk", b"\xff\x00", b"\xff\xff\x00\x01"):
        hidden = flood[:first] + stray + flood[first:]
        assert jpeg_scans(hidden) == MAX_JPEG_SCANS + 1, stray
        with pytest.raises(MediaError, match="progressive scans"):
            decode_image(hidden, "jpeg", LIMITS)
