"""What an engine is told and what it answers, in plain Python: no native code.

The daemon's side of every engine (models, api, an engine process's `remote` half) reads
these without importing `llama_cpp`: a model's `EngineConfig`, the `ModelInfo` its load
reports, `BuildInfo` (what the llama.cpp build can do), the errors, and the KV cache's size
per value. `native` and the engines built on it fill them in.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from edgellmd.engine.drafts import Speculation

# Bytes per K or V value of each KV cache type (q8_0: 34-byte blocks of 32; q4_0: 18 of 32).
KV_BYTES_PER_VALUE: Final = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


class EngineError(Exception):
    """A llama.cpp operation failed."""


class ModelLoadError(EngineError):
    """A model file could not be loaded; the message says why."""


class GrammarError(EngineError):
    """A grammar llama.cpp cannot parse."""


class MediaError(EngineError):
    """An image or a clip the engine cannot use: a client's error (400), the message safe to show.

    `limit` names the bound it broke (a setting's name) when it broke one.
    """

    def __init__(self, message: str, *, limit: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit


MEDIA_KINDS: Final = ("image", "audio")
# Encoded images and clips an engine keeps for reuse once no request holds them (least
# recently used first out): part of a model's memory estimate when it has a projector.
MEDIA_STORE_BYTES: Final = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class MediaInput:
    """An image or an audio clip as a client sent it: its bytes, not yet decoded.

    Decoding (Pillow for images; the `wave` module and soundfile for audio) happens where
    the model's engine runs (`engine.media`), inside the confined engine process where there
    is one, and always before any byte reaches llama.cpp.
    """

    kind: str  # one of MEDIA_KINDS
    data: bytes
    format: str | None = None  # what the client declared ("png", "wav", "mp3"); None: not said
    # An http(s) address to fetch the bytes from (a host the operator allowed: api.media);
    # fetched before the prompt is made, so an engine only ever sees `data`.
    url: str | None = None
    # The cache scope it was sent under (api.context.cache_scope): its encoded chunks are held
    # under its digest with the scope, so another scope's same bytes are encoded again (a
    # chunk kept for one key, found by another, told that key by the time it saved).
    scope: str = ""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """Bounds on decoded media (settings `media.*`); the engine refuses past them with MediaError."""

    max_pixels: int = 16_777_216
    max_side: int = 8192
    max_audio_seconds: float = 600.0


@dataclass(frozen=True, slots=True)
class MediaChunk:
    """Positions of a prompt that one encoded image or audio chunk fills, by its id in the
    engine's media store (`key`); the prompt carries `length` placeholder ids there."""

    key: str
    length: int


@dataclass(frozen=True, slots=True)
class PreparedMedia:
    """A decoded and encoded image or clip: what it adds to a prompt, in order (token ids the
    projector's own markup, and chunks), and the sha256 of the bytes it was made from."""

    digest: str
    pieces: tuple[tuple[int, ...] | MediaChunk, ...]

    @property
    def n_positions(self) -> int:
        """Prompt positions it takes."""
        return sum(p.length if isinstance(p, MediaChunk) else len(p) for p in self.pieces)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the GGUF file says about the model, read once at load time."""

    path: Path
    architecture: str
    description: str
    n_ctx_train: int
    n_vocab: int
    n_params: int
    size_bytes: int
    chat_template: str | None
    bos_text: str
    eos_text: str
    add_bos: bool
    # A reranking model's prompt for a query and a document (`tokenizer.chat_template.rerank`,
    # with `{query}` and `{document}` markers), when its GGUF carries one.
    rerank_template: str | None = None
    # Else the tokens around them, as the vocabulary's flags say (llama-server's pair format):
    # before the query, between the two, after the document.
    pair_tokens: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] = ((), (), ())


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to load and run one model (filled from the model's settings)."""

    path: Path
    slots: int
    context_size: int  # tokens per slot
    batch_size: int
    threads: int
    threads_batch: int
    gpu_layers: int = 0
    mmap: bool = False  # may memory-map the file (a private preload copy only); False: read it
    cache_type_k: str = "f16"  # KV cache types: f16, q8_0, q4_0
    cache_type_v: str = "f16"
    flash_attention: str = "auto"  # auto, on, off
    prompt_cache_bytes: int = 0  # host RAM for KV states of earlier prompts; 0: none
    batch_padding: bool = True  # dummy rows up to a step size measured faster (engine.shapes)
    prefill_chunk: int = 0  # prompt tokens a step takes while others generate; 0: batch_size
    # Stop the step in progress for a newly queued request of a tenant it computes nothing for
    # (Engine._preempt_for): that request's first token waits one graph node, not a whole step.
    preempt_steps: bool = True
    # A generation still waiting for its first slot this long is refused (QUEUE_TIMEOUT): one
    # that cannot meet its deadline leaves room for those that can. 0: it waits its turn.
    queue_timeout_s: float = 0.0
    # A reranking model (rank pooling): one relevance score per input, not a vector.
    rank: bool = False
    # Embedding and rerank models: inputs per llama_decode, from any waiting calls (1: each its own).
    inputs_per_decode: int = 1
    speculative: Speculation = field(default_factory=Speculation)
    # The model's multimodal projector (libmtmd: images, audio), verified and preloaded as
    # the model's own file; None: the model reads text only.
    mmproj: Path | None = None


def default_threads() -> int:
    """Threads llama.cpp should use when the config does not say: the CPUs we may run on."""
    return max(1, len(os.sched_getaffinity(0)))


# enum ggml_backend_dev_type (ggml-backend.h), in order. llama_cpp binds none of the
# ggml_backend_dev_* / ggml_backend_reg_* calls; libllama links libggml, which has them.
DEVICE_TYPES: Final = ("cpu", "gpu", "igpu", "accel")


@dataclass(frozen=True, slots=True)
class BackendDevice:
    """One device of llama.cpp's backend registry (`CUDA0`, `CPU`), memory as it reports it now."""

    name: str
    description: str  # "NVIDIA H200", the CPU's model name
    type: str  # one of DEVICE_TYPES, or "unknown"
    memory_free: int  # bytes
    memory_total: int


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """Which backends, devices and CUDA architectures the loaded llama.cpp has (`build_info`)."""

    backends: tuple[str, ...]  # registered backends, e.g. ("CUDA", "CPU"); CUDA is there with 0 GPUs too
    devices: tuple[BackendDevice, ...]
    # Compute capabilities compiled into the CUDA backend, as CMake names them (61, 90, 120):
    # () without a CUDA backend; None when it has one that does not say (nvcc before 11.5).
    cuda_archs: tuple[int, ...] | None
    gpu_offload: bool  # llama_supports_gpu_offload()
    system_info: str  # llama_print_system_info(), as llama.cpp prints it
    features: dict[str, dict[str, str]]  # the same, parsed: backend -> feature -> value


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """`CUDA : ARCHS = 610,900 | USE_GRAPHS = 1 | CPU : AVX2 = 1 | ` -> {"CUDA": {"ARCHS": ...}, ...}.

    llama_print_system_info() writes, per backend that lists features, "NAME : " and then
    "KEY = VALUE | " for each; values never hold "|" (ARCHS is nvcc's comma-separated
    __CUDA_ARCH_LIST__).
    """
    out: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for raw in text.split("|"):
        part = raw.strip()
        while " : " in part:  # a backend starts here (one with no features runs into the next)
            name, _, part = part.partition(" : ")
            current = out.setdefault(name.strip(), {})
            part = part.strip()
        key, sep, value = part.partition(" = ")
        if current is not None and sep:
            current[key.strip()] = value.strip()
    return out


def cuda_archs_of(features: dict[str, dict[str, str]]) -> tuple[int, ...] | None:
    """The CUDA architectures in parsed system info: ARCHS "610,750,900" -> (61, 75, 90)."""
    cuda = features.get("CUDA")
    if cuda is None:
        return ()
    listed = cuda.get("ARCHS")
    if listed is None:
        return None
    archs = {int(a) // 10 for a in re.findall(r"\d+", listed)}  # __CUDA_ARCH_LIST__: 10 x CMake's
    return tuple(sorted(archs))
