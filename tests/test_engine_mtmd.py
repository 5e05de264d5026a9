"""llama.cpp's multimodal library (libmtmd) through llama-cpp-python, on tiny generated models.

Groundwork for images and audio (issue 31): the build the project installs carries libmtmd and
its ctypes bindings, and a projector the tests write with `gguf` (tests.ggufmodels
`write_tiny_projector`) loads beside a tiny text model, turns an image into the tokens the
projector's shape says, and the text model reads them: the same image gives the same logits,
another image other logits; the same for audio through a tiny Ultravox projector. A projector
whose width is not the text model's is refused with NULL, not a crash. No daemon code uses
libmtmd yet; these tests pin what it will build on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest

from tests.ggufmodels import (
    TinyAudioProjectorSpec,
    TinyModelSpec,
    TinyProjectorSpec,
    write_tiny_audio_projector,
    write_tiny_model,
    write_tiny_projector,
)

N_BATCH: Final = 64


@dataclass
class Loaded:
    model: Any
    ctx: Any
    mctx: Any
    n_vocab: int


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mtmd")
    text = write_tiny_model(root / "text.gguf", TinyModelSpec(seed=9))
    return text, write_tiny_projector(root / "projector.gguf")


def _params() -> Any:
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = 1
    params.warmup = False
    return params


@pytest.fixture(scope="module")
def loaded(files: tuple[Path, Path]) -> Iterator[Loaded]:
    text, projector = files
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(text).encode(), model_params)
    assert model
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = 256
    ctx_params.n_batch = ctx_params.n_ubatch = N_BATCH
    ctx_params.n_threads = ctx_params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    assert ctx
    mctx = mtmd.mtmd_init_from_file(str(projector).encode(), model, _params())
    assert mctx, "libmtmd refused the tiny projector"
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    yield Loaded(model, ctx, mctx, n_vocab)
    mtmd.mtmd_free(mctx)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


def _image(seed: int, width: int = 40, height: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _read(loaded: Loaded, image: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The next-token logits after "A<image>B", the image's token count and the positions used."""
    pixels = np.ascontiguousarray(image, dtype=np.uint8)
    height, width, _ = pixels.shape
    bitmap = mtmd.mtmd_bitmap_init(width, height, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    return _eval(loaded, bitmap, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE, N_BATCH)


def _hear(loaded: Loaded, samples: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The same after "A<audio>B" of 16 kHz mono samples."""
    pcm = np.ascontiguousarray(samples, dtype=np.float32)
    bitmap = mtmd.mtmd_bitmap_init_from_audio(len(pcm), pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    return _eval(loaded, bitmap, mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO, 512)


def _eval(loaded: Loaded, bitmap: Any, kind: int, n_batch: int) -> tuple[np.ndarray, int, int]:
    """Tokenize "A<media>B" with the bitmap, evaluate it from an empty cache; the last logits,
    the media's token count and the positions used. Text follows the marker: a media chunk
    yields no logits of its own."""
    assert bitmap
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(loaded.ctx), True)
    prompt = b"A" + mtmd.mtmd_default_marker() + b"B"
    text = mtmd.mtmd_input_text()
    text.text = prompt
    text.text_len = len(prompt)
    text.add_special = True
    text.parse_special = True
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(loaded.mctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        media = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
        media_tokens = sum(
            mtmd.mtmd_input_chunk_get_n_tokens(c) for c in media if mtmd.mtmd_input_chunk_get_type(c) == kind
        )
        n_past = llama_cpp.llama_pos(0)
        evaluated = mtmd.mtmd_helper_eval_chunks(
            loaded.mctx, loaded.ctx, chunks, 0, 0, n_batch, True, ctypes.byref(n_past)
        )
        assert evaluated == 0
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    logits = llama_cpp.llama_get_logits_ith(loaded.ctx, -1)
    return np.ctypeslib.as_array(logits, shape=(loaded.n_vocab,)).copy(), media_tokens, int(n_past.value)


def test_an_image_becomes_the_projectors_tokens_and_the_text_model_reads_them(loaded: Loaded) -> None:
    assert mtmd.mtmd_support_vision(loaded.mctx)
    assert not mtmd.mtmd_support_audio(loaded.mctx)
    first, image_tokens, n_past = _read(loaded, _image(10))
    assert image_tokens == TinyProjectorSpec().image_tokens == 4
    assert n_past == 2 + image_tokens + 1  # BOS and "A", the image, "B"
    again, _, _ = _read(loaded, _image(10))
    other, _, _ = _read(loaded, _image(20))
    assert np.array_equal(first, again)  # the same pixels, the same logits
    assert float(np.max(np.abs(first - other))) > 1e-3  # the image reached the text model
    assert np.all(np.isfinite(first))


def test_an_image_of_any_size_is_resized_to_the_projectors_square(loaded: Loaded) -> None:
    for width, height in ((1, 1), (300, 7), (29, 500)):
        logits, image_tokens, _ = _read(loaded, _image(3, width, height))
        assert image_tokens == TinyProjectorSpec().image_tokens
        assert np.all(np.isfinite(logits))


def test_a_projector_of_another_width_is_refused_not_a_crash(
    files: tuple[Path, Path], loaded: Loaded
) -> None:
    narrow = write_tiny_projector(files[1].with_name("narrow.gguf"), TinyProjectorSpec(text_embd=32))
    assert not mtmd.mtmd_init_from_file(str(narrow).encode(), loaded.model, _params())
    caps = mtmd.mtmd_get_cap_from_file(str(files[1]).encode())
    assert caps.inp_vision
    assert not caps.inp_audio


def test_audio_becomes_the_audio_projectors_tokens_and_the_text_model_reads_them(tmp_path: Path) -> None:
    text = write_tiny_model(tmp_path / "text.gguf", TinyModelSpec(seed=9))
    projector = write_tiny_audio_projector(tmp_path / "audio.gguf")
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(text).encode(), model_params)
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = 1024  # a chunk of audio is hundreds of tokens, however short the clip
    ctx_params.n_batch = ctx_params.n_ubatch = 512
    ctx_params.n_threads = ctx_params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    mctx = mtmd.mtmd_init_from_file(str(projector).encode(), model, _params())
    assert mctx, "libmtmd refused the tiny audio projector"
    try:
        assert mtmd.mtmd_support_audio(mctx)
        assert mtmd.mtmd_get_audio_sample_rate(mctx) == 16_000
        loaded = Loaded(
            model, ctx, mctx, llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        )
        seconds = np.arange(16_000) / 16_000
        tone, other = (0.5 * np.sin(2 * np.pi * f * seconds) for f in (440, 1000))
        first, tokens, n_past = _hear(loaded, tone)
        assert tokens == TinyAudioProjectorSpec().chunk_tokens == 375
        assert n_past == 2 + tokens + 1
        assert np.array_equal(first, _hear(loaded, tone)[0])
        assert float(np.max(np.abs(first - _hear(loaded, other)[0]))) > 1e-3
    finally:
        mtmd.mtmd_free(mctx)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
