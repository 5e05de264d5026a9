"""The llama.cpp engines: model loading, tokenization, the continuous-batching scheduler, embeddings.

Only the native modules import `llama_cpp` (house rule: quarantine the native dependency),
and nothing imports them at the package's import: a daemon whose models all run in engine
processes never loads llama.cpp itself (tests/test_layers.py holds it).

- `config`: what an engine is told and answers, in plain Python (configs, model and build
  facts, errors); the names below.
- `native`: llama.cpp's backend and log, model loading and metadata, tokens, the
  one-thread-per-model base both engines share, and what the build can do.
- `scheduler`: `Engine`, one generation model batched over its slots by one thread.
- `sampling`: each sequence's C sampler chain and grammar (structured output).
- `embedding`: `EmbeddingEngine`, one unit vector per input.
- `remote`, `worker`, `wire`, `confine`: a model's engine in a confined process of its own
  (`isolation: process`): the daemon's side, the process's, the frames between them, and
  what the process may do.
- `build`: what the build can do, asked without loading llama.cpp in the daemon.
- `media`, `projector`: images and clips decoded in Python (Pillow, soundfile), then
  encoded by the model's multimodal projector (libmtmd) into positions of a prompt.
"""

from __future__ import annotations

from edgellmd.engine.config import (
    BackendDevice,
    BuildInfo,
    EngineConfig,
    EngineError,
    GrammarError,
    ModelInfo,
    ModelLoadError,
    default_threads,
)

__all__ = [
    "BackendDevice",
    "BuildInfo",
    "EngineConfig",
    "EngineError",
    "GrammarError",
    "ModelInfo",
    "ModelLoadError",
    "default_threads",
]
