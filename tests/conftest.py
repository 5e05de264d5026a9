"""Shared fixtures: tiny GGUF models written per session and a daemon serving them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

TINY_SLOTS = 2
TINY_CONTEXT = 256


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny test models."""
    root = tmp_path_factory.mktemp("models")
    write_tiny_model(root / "tiny.gguf", TinyModelSpec(seed=1))
    write_tiny_model(root / "tiny-b.gguf", TinyModelSpec(seed=2))
    write_tiny_model(root / "notemplate.gguf", TinyModelSpec(seed=3, chat_template=None))
    return root


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    """Path of the main tiny model (it carries a Jinja chat template)."""
    return models_dir / "tiny.gguf"


@pytest.fixture(scope="session")
def daemon(models_dir: Path) -> Iterator[RunningDaemon]:
    """One daemon for the whole session: `tiny` (2 slots), `notemplate`, and `builtin` (chatml)."""
    settings = settings_for(
        [
            {
                "name": "tiny",
                "file": str(models_dir / "tiny.gguf"),
                "slots": TINY_SLOTS,
                "context_size": TINY_CONTEXT,
                "threads": 1,
            },
            {
                "name": "notemplate",
                "file": str(models_dir / "notemplate.gguf"),
                "slots": 1,
                "context_size": 128,
                "threads": 1,
            },
            {
                "name": "builtin",
                "file": str(models_dir / "notemplate.gguf"),
                "slots": 1,
                "context_size": 128,
                "threads": 1,
                "chat_template": "chatml",
            },
        ],
        server={"max_tokens_limit": 512, "max_body_bytes": 65536},
    )
    with running(settings) as d:
        yield d


def pytest_unconfigure(config: pytest.Config) -> None:
    """llama-cpp-python opens two /dev/null files when imported (to quiet llama.cpp's output)
    and never closes them: a test process that loaded a model in-process warned at its exit."""
    del config
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        held = getattr(utils, name, None)
        if held is not None:
            held.close()
