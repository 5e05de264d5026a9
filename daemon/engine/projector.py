"""A model's multimodal projector (libmtmd): images and clips into positions of a prompt.

`Projector.prepare` runs on the prompt pool, before a request is admitted: it decodes the
client's bytes in Python (`engine.media`), hands the pixels or samples to libmtmd, which
cuts them into chunks (the projector's own markup as tokens, and the media's chunks), and
encodes each media chunk into embeddings, kept in a store under an id made from the bytes'
sha256. The scheduler thread later decodes a chunk's embeddings into a sequence
(`decode`): the same llama_decode a prompt's tokens get, one chunk at a time.

The store is refcounted: a prepared request holds its chunks until it lets them go
(`release`); chunks nobody holds stay, least recently used first out, within
`config.MEDIA_STORE_BYTES`, so the same image sent again (the next turn of a conversation) is not
encoded twice. A prompt refers to a chunk by placeholder ids (`generation.placeholders`)
derived from its id, so that prefix reuse and the prompt cache match an image exactly when
its bytes are the same.

libmtmd shares one output buffer per context: encoding is serialised per model.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import llama_cpp as llama
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from edgellmd.engine import media
from edgellmd.engine.config import (
    MEDIA_STORE_BYTES,
    MediaChunk,
    MediaError,
    MediaInput,
    MediaLimits,
    ModelLoadError,
    PreparedMedia,
)

log = logging.getLogger(__name__)

_NO_CALLBACK: Final = mtmd.mtmd_helper_post_decode_callback()  # a NULL function pointer
_log_callback: Any = None  # keeps the ctypes thunk alive while libmtmd may call it


@dataclass(slots=True)
class _Stored:
    chunk: Any  # mtmd_input_chunk_p, a copy this store owns
    embeddings: np.ndarray  # float32, n_tokens x n_embd
    non_causal: bool
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.embeddings.nbytes)


def _set_log(callback: Any) -> None:
    global _log_callback  # noqa: PLW0603 - one log callback per process, as llama.cpp's
    if _log_callback is None:
        _log_callback = llama.llama_log_callback(callback)
        mtmd.mtmd_log_set(_log_callback, ctypes.c_void_p())
        mtmd.mtmd_helper_log_set(_log_callback, ctypes.c_void_p())


class Projector:
    """libmtmd's context for one loaded model, and its store of encoded chunks."""

    def __init__(self, path: Path, model: Any, *, threads: int, use_gpu: bool, log_callback: Any) -> None:
        """Load the projector beside `model` (on the engine thread, at load); ModelLoadError if refused."""
        _set_log(log_callback)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = max(1, threads)
        params.warmup = True
        ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not load the projector {path} for this model (not a projector, "
                "or made for a model of another width)"
            )
        self._ctx = ctx
        if mtmd.mtmd_decode_use_mrope(ctx):
            mtmd.mtmd_free(ctx)
            self._ctx = None
            raise ModelLoadError(
                f"the projector {path} places its tokens with M-RoPE (Qwen2-VL and its kin), "
                "which this server does not support yet"
            )
        self.vision = bool(mtmd.mtmd_support_vision(ctx))
        self.audio = bool(mtmd.mtmd_support_audio(ctx))
        self.sample_rate = int(mtmd.mtmd_get_audio_sample_rate(ctx)) if self.audio else 0
        self.n_embd = int(llama.llama_model_n_embd_inp(model))
        self._encode_lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._store: OrderedDict[str, _Stored] = OrderedDict()
        self.encoded = 0  # chunks encoded, and chunks found in the store instead
        self.reused = 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """What the model reads besides text: "image", "audio"."""
        return tuple(k for k, on in (("image", self.vision), ("audio", self.audio)) if on)

    def prepare(self, item: MediaInput, limits: MediaLimits, max_chunk_tokens: int) -> PreparedMedia:
        """Decode and encode one image or clip (any thread); its chunks are held until `release`.

        MediaError for input the client must change: an undecodable file, a broken limit,
        a kind this projector does not read, or a chunk whose positions attend to each other
        (an image, on some models) longer than `max_chunk_tokens`: one decode must hold it.
        """
        if item.kind not in self.kinds:
            raise MediaError(f"this model reads no {'images' if item.kind == 'image' else 'audio'}")
        # The scope first: another scope's same bytes are another chunk (no reuse, no timing).
        digest = hashlib.sha256(item.scope.encode("utf-8", "surrogatepass") + b"\0" + item.data).hexdigest()
        if item.kind == "image":
            pixels = media.decode_image(item.data, item.format, limits)
            height, width, _ = pixels.shape
            bitmap = mtmd.mtmd_bitmap_init(
                width, height, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            )
        else:
            samples = media.decode_audio(item.data, item.format, limits, self.sample_rate)
            bitmap = mtmd.mtmd_bitmap_init_from_audio(
                len(samples), samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            )
        if not bitmap:
            raise MediaError(f"the {item.kind} could not be handed to the projector")
        chunks = mtmd.mtmd_input_chunks_init()
        held: list[str] = []
        try:
            self._tokenize(chunks, bitmap, item.kind)
            pieces = self._pieces(chunks, item.kind, digest, max_chunk_tokens, held)
        except BaseException:
            self.release(held)
            raise
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
        return PreparedMedia(digest, pieces)

    def _tokenize(self, chunks: Any, bitmap: Any, kind: str) -> None:
        """Cut one bitmap into chunks: the projector's markup around the media's own chunks."""
        part = mtmd.mtmd_input_part()
        part.text = ctypes.POINTER(mtmd.mtmd_input_text)()  # NULL: this part is the bitmap
        part.bitmap = bitmap
        parts = (ctypes.POINTER(mtmd.mtmd_input_part) * 1)(ctypes.pointer(part))
        with self._encode_lock:  # tokenizing preprocesses into the context's buffers too
            rc = mtmd.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False)
        if rc != 0:
            raise MediaError(f"the projector could not take this {kind} (status {rc})")

    def _pieces(
        self, chunks: Any, kind: str, digest: str, max_chunk_tokens: int, held: list[str]
    ) -> tuple[tuple[int, ...] | MediaChunk, ...]:
        """The chunks as token ids and held media chunks, in order (each held one noted in `held`)."""
        pieces: list[tuple[int, ...] | MediaChunk] = []
        for index in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, index)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                if n.value:
                    pieces.append(tuple(int(ids[i]) for i in range(n.value)))
                continue
            length = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
            if int(mtmd.mtmd_input_chunk_get_n_pos(chunk)) != length:  # M-RoPE is refused at load
                raise MediaError(f"the projector placed this {kind} in fewer positions than tokens")
            # Positions that attend to each other (an image, on some models) go in one decode.
            if length > max_chunk_tokens and mtmd.mtmd_decode_use_non_causal(self._ctx, chunk):
                raise MediaError(
                    f"the {kind} becomes {length} tokens and this model decodes at most "
                    f"{max_chunk_tokens} at once (its batch_size)",
                    limit="models[].batch_size",
                )
            key = f"{digest}:{index}"
            self._hold(key, chunk)
            held.append(key)
            pieces.append(MediaChunk(key, length))
        return tuple(pieces)

    def _hold(self, key: str, chunk: Any) -> None:
        """Hold the chunk's embeddings under `key`, encoding them unless the store has them."""
        with self._store_lock:
            stored = self._store.get(key)
            if stored is not None:
                stored.refs += 1
                self._store.move_to_end(key)
                self.reused += 1
                return
        length = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        with self._encode_lock:
            rc = mtmd.mtmd_encode_chunk(self._ctx, chunk)
            if rc != 0:
                raise MediaError(f"the projector could not encode this input (status {rc})")
            out = mtmd.mtmd_get_output_embd(self._ctx)
            embeddings = np.ctypeslib.as_array(out, shape=(length * self.n_embd,)).copy()
        copy = mtmd.mtmd_input_chunk_copy(chunk)
        if not copy:
            raise MediaError("the projector's chunk could not be kept")
        stored = _Stored(copy, embeddings, bool(mtmd.mtmd_decode_use_non_causal(self._ctx, chunk)), refs=1)
        with self._store_lock:
            raced = self._store.get(key)
            if raced is not None:  # another request encoded the same bytes meanwhile
                raced.refs += 1
                mtmd.mtmd_input_chunk_free(copy)
                return
            self._store[key] = stored
            self.encoded += 1
            self._trim()

    def release(self, keys: list[str] | tuple[str, ...]) -> None:
        """Let go of chunks `prepare` held (any thread; unknown keys are ignored)."""
        with self._store_lock:
            for key in keys:
                stored = self._store.get(key)
                if stored is not None and stored.refs > 0:
                    stored.refs -= 1
            self._trim()

    def holds(self, key: str) -> bool:
        """Whether the store has `key`'s embeddings (held or kept)."""
        with self._store_lock:
            return key in self._store

    def _trim(self) -> None:
        """Drop the least recently used chunks nobody holds past MEDIA_STORE_BYTES (under the store lock)."""
        total = sum(s.nbytes for s in self._store.values())
        for key in [k for k, s in self._store.items() if s.refs == 0]:
            if total <= MEDIA_STORE_BYTES:
                break
            stored = self._store.pop(key)
            total -= stored.nbytes
            mtmd.mtmd_input_chunk_free(stored.chunk)

    def decode(self, ctx: Any, key: str, n_past: int, seq: int, n_batch: int) -> int:
        """Decode a held chunk's embeddings into sequence `seq` at `n_past` (the engine thread).

        llama.cpp's status (0: done); -1 when the store no longer has the chunk.
        """
        with self._store_lock:
            stored = self._store.get(key)
            if stored is None:
                return -1
            stored.refs += 1  # held while it decodes: a release meanwhile cannot free it
            self._store.move_to_end(key)
        new_n_past = llama.llama_pos(0)
        try:
            return int(
                mtmd.mtmd_helper_decode_image_chunk(
                    self._ctx,
                    ctx,
                    stored.chunk,
                    stored.embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                    n_past,
                    seq,
                    n_batch,
                    ctypes.byref(new_n_past),
                    _NO_CALLBACK,
                    None,
                )
            )
        finally:
            self.release((key,))

    def status(self) -> dict[str, Any]:
        """What /admin/status shows of it."""
        with self._store_lock:
            held = sum(1 for s in self._store.values() if s.refs)
            return {
                "reads": list(self.kinds),
                "chunks_encoded": self.encoded,
                "chunks_reused": self.reused,
                "store_chunks": len(self._store),
                "store_held": held,
                "store_bytes": sum(s.nbytes for s in self._store.values()),
            }

    def close(self) -> None:
        """Free the store and the context (the engine thread, once nothing decodes)."""
        with self._store_lock:
            for stored in self._store.values():
                mtmd.mtmd_input_chunk_free(stored.chunk)
            self._store.clear()
        if self._ctx:
            mtmd.mtmd_free(self._ctx)
            self._ctx = None
