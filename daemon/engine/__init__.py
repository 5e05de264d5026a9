"""The llama.cpp engines: model loading, tokenization, the continuous-batching scheduler, embeddings.

This package is the only code that imports `llama_cpp` (house rule: quarantine the native
dependency); everything above it uses the names below.

- `native`: llama.cpp's backend and log, model loading and metadata, tokens, the
  one-thread-per-model base both engines share, and what the build can do (`build_info`).
- `scheduler`: `Engine`, one generation model batched over its slots by one thread.
- `sampling`: each sequence's C sampler chain and grammar (structured output).
- `embedding`: `EmbeddingEngine`, one unit vector per input.
- `remote`, `worker`, `wire`, `confine`: a model's engine in a confined process of its own
  (`isolation: process`): the daemon's side, the process's, the frames between them, and
  what the process may do.
"""

from __future__ import annotations

from edgellmd.engine.embedding import EmbeddingEngine
from edgellmd.engine.native import (
    BackendDevice,
    BuildInfo,
    EngineConfig,
    EngineError,
    ModelInfo,
    ModelLoadError,
    apply_builtin_template,
    build_info,
    builtin_chat_templates,
    default_threads,
    supports_gpu_offload,
)
from edgellmd.engine.sampling import CompiledGrammar, GrammarError
from edgellmd.engine.scheduler import Engine

__all__ = [
    "BackendDevice",
    "BuildInfo",
    "CompiledGrammar",
    "EmbeddingEngine",
    "Engine",
    "EngineConfig",
    "EngineError",
    "GrammarError",
    "ModelInfo",
    "ModelLoadError",
    "apply_builtin_template",
    "build_info",
    "builtin_chat_templates",
    "default_threads",
    "supports_gpu_offload",
]
