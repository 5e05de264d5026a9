"""llama.cpp's log, as the daemon logs it: ggml's levels mapped to Python's, on the real library."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgellmd.engine import EngineConfig, ModelLoadError, native
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.engine.scheduler import Engine
from tests.ggufmodels import TinyModelSpec, write_tiny_model

LOGGER = "edgellmd.engine.native"
# enum ggml_log_level, as llama.cpp passes it to the log callback.
NONE, DEBUG, INFO, WARN, ERROR, CONT = range(6)


def _config(path: Path) -> EngineConfig:
    return EngineConfig(path=path, slots=1, context_size=64, batch_size=32, threads=1, threads_batch=1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = write_tiny_model(tmp_path_factory.mktemp("log") / "tiny.gguf", TinyModelSpec(seed=1))
    eng = Engine(_config(path), name="tiny")
    yield eng
    eng.close()


def _llama_records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == LOGGER and r.getMessage().startswith("llama.cpp: ")
    ]


def test_a_llama_cpp_warning_is_logged_at_warning(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    # The model adds a BOS and the text starts with one too: llama.cpp warns of the double BOS.
    assert engine.info.add_bos
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        tokens = engine.tokenize(engine.info.bos_text + "hi", add_special=True, parse_special=True)
    assert tokens[:2] == [1, 1]
    warnings = [m for level, m in _llama_records(caplog) if level == logging.WARNING]
    assert len(warnings) == 1, _llama_records(caplog)
    assert "the prompt also starts with a BOS token" in warnings[0]


async def test_a_normal_load_warm_up_and_generation_of_the_tiny_model_warn_of_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(seed=2))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        eng = Engine(_config(path), name="tiny")  # loads and warms up
        try:
            gen = eng.submit(
                GenerationRequest(eng.tokenize("hello"), 4, SamplingParams(temperature=0.0), ignore_eos=True),
                asyncio.get_running_loop(),
            )
            events = [event async for event in gen.events()]
            assert isinstance(events[-1], Finished)
            assert events[-1].reason == "length"
        finally:
            eng.close()
    records = _llama_records(caplog)
    assert records, "llama.cpp's load log reaches the daemon's log (at debug)"
    assert [m for level, m in records if level >= logging.WARNING] == []


def test_llama_cpp_errors_are_logged_at_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a GGUF file" * 8)
    with caplog.at_level(logging.DEBUG, logger=LOGGER), pytest.raises(ModelLoadError):
        Engine(_config(path), name="garbage")
    errors = [m for level, m in _llama_records(caplog) if level == logging.ERROR]
    assert any("invalid magic characters" in m for m in errors), _llama_records(caplog)


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        ([(ERROR, b"boom\n")], [(logging.ERROR, "boom")]),
        ([(WARN, b"careful\n")], [(logging.WARNING, "careful")]),
        ([(INFO, b"print_info: n_ctx = 64\n")], [(logging.DEBUG, "print_info: n_ctx = 64")]),
        ([(DEBUG, b"a tensor\n")], [(logging.DEBUG, "a tensor")]),
        # A continuation keeps the level of the line it continues; whitespace alone is no line.
        (
            [(WARN, b"half a warning"), (CONT, b" and the rest\n")],
            [(logging.WARNING, "half a warning"), (logging.WARNING, "and the rest")],
        ),
        (
            [(ERROR, b"failed:"), (CONT, b" why\n"), (INFO, b"loading"), (CONT, b"."), (CONT, b"\n")],
            [
                (logging.ERROR, "failed:"),
                (logging.ERROR, "why"),
                (logging.DEBUG, "loading"),
                (logging.DEBUG, "."),
            ],
        ),
        ([(NONE, b"unleveled\n")], [(logging.DEBUG, "unleveled")]),
    ],
)
def test_ggml_levels_map_to_python_levels(
    calls: list[tuple[int, bytes]], expected: list[tuple[int, str]], caplog: pytest.LogCaptureFixture
) -> None:
    # llama.cpp calls this callback itself; driven directly here for continuations, which no
    # load of the test models produces at a warning or error level.
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        native.on_llama_log(INFO, b"reset the continuation\n", None)
        caplog.clear()
        for level, text in calls:
            native.on_llama_log(level, text, None)
    assert _llama_records(caplog) == [(level, f"llama.cpp: {m}") for level, m in expected]
