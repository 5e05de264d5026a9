"""No position past a model's learned position embeddings reaches llama.cpp (models.loader.fit_positions).

BERT embedders and rerankers, GPT-2 and StarCoder look each position up in a table of learned
positions (the GGUF's `position_embd.weight`, as many rows as the model's context_length), and
llama.cpp does not bound the lookup: a position past the table fails
GGML_ASSERT(i01 >= 0 && i01 < ne01) in ggml's get_rows, which aborts the process. With a
context_size past the table (the default 4,096 against BERT's 512), one /v1/embeddings input
longer than the table killed its engine process, twice (an embedding cut by its engine's death
is asked again of the restarted one), and an answer of 503; a few such requests trip the
crash-loop breaker. The loader now cuts such a model's context_size to its table: a longer
input is the 400 that names the limit, and a generation stops at the table's end.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from edgellmd.engine.remote import RemoteEngine
from edgellmd.http import appkeys
from edgellmd.models.gguf import learned_positions
from edgellmd.models.loader import fit_positions
from tests.ggufmodels import LEARNED_POSITIONS, write_tiny_bert, write_tiny_gpt2, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

CONTEXT: Final = 2 * LEARNED_POSITIONS  # configured past the table, as the default 4,096 is past BERT's 512
# The tiny vocabulary has one token per byte, and a BOS first: n characters are n + 1 tokens.
FITS: Final = "a" * (LEARNED_POSITIONS - 1)
PAST: Final = "a" * LEARNED_POSITIONS


def _settings(file: Path, context_size: int = CONTEXT, **more: Any) -> Any:
    return settings_for([{"name": "m", "file": str(file), "context_size": context_size, **more}]).models[0]


# ---- the hazard: what llama.cpp does with the raw lookup ---------------------------------------------

# An embedding engine in this process, configured past its model's table, embeds `n` tokens.
_RAW: Final = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from edgellmd.engine.config import EngineConfig
    from edgellmd.engine.embedding import EmbeddingEngine

    path, context, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    config = EngineConfig(
        path=path, slots=1, context_size=context, batch_size=context, threads=1, threads_batch=1
    )
    engine = EmbeddingEngine(config, name="raw")
    engine.embed([[3 + i % 200 for i in range(n)]])
    engine.close()
    print("embedded")
    """
)


@pytest.mark.parametrize("tokens", [LEARNED_POSITIONS, LEARNED_POSITIONS + 1])
def test_the_raw_native_lookup_past_the_table_aborts_the_process(tmp_path: Path, tokens: int) -> None:
    """The hazard itself, in a child process: the last position of the table is served, the
    next one aborts inside llama.cpp (no Python exception, no error code)."""
    bert = write_tiny_bert(tmp_path / "bert.gguf")
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # ggml would run gdb on itself first
    done = subprocess.run(  # this interpreter, a fixed script
        [sys.executable, "-c", _RAW, str(bert), str(CONTEXT), str(tokens)],
        capture_output=True,
        timeout=120,
        env=env,
        check=False,
    )
    if tokens <= LEARNED_POSITIONS:
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
        assert done.stdout.strip() == b"embedded"
    else:
        assert done.returncode == -signal.SIGABRT, done.stderr.decode(errors="replace")[-2000:]
        assert b"GGML_ASSERT(i01 >= 0 && i01 < ne01) failed" in done.stderr


# ---- the check: the table read from the GGUF header, context_size cut to it ----------------------------


def test_learned_positions_are_the_rows_of_the_position_table(tmp_path: Path) -> None:
    assert learned_positions(write_tiny_bert(tmp_path / "bert.gguf", positions=48)) == 48
    assert learned_positions(write_tiny_bert(tmp_path / "rr.gguf", rank=True)) == LEARNED_POSITIONS
    assert learned_positions(write_tiny_gpt2(tmp_path / "gpt2.gguf", positions=80)) == 80
    assert learned_positions(write_tiny_model(tmp_path / "llama.gguf")) is None  # RoPE: computed
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    assert learned_positions(garbage) is None  # the load itself says what is wrong with it


def test_context_size_is_cut_to_the_table_only_when_it_is_past_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bert = write_tiny_bert(tmp_path / "bert.gguf")
    llama = write_tiny_model(tmp_path / "llama.gguf")
    with caplog.at_level(logging.WARNING, logger="edgellmd.models.loader"):
        cut = fit_positions(_settings(bert), (bert, None))
    assert cut.context_size == LEARNED_POSITIONS
    assert f"context_size {CONTEXT} is past the {LEARNED_POSITIONS} positions" in caplog.text
    within = _settings(bert, context_size=LEARNED_POSITIONS)
    assert fit_positions(within, (bert, None)) is within
    assert fit_positions(_settings(llama), (llama, None)).context_size == CONTEXT
    # A draft model decodes at the same positions as the model it drafts for: its table counts too.
    small = write_tiny_gpt2(tmp_path / "draft.gguf", positions=32)
    assert fit_positions(_settings(llama), (llama, small)).context_size == 32
    assert fit_positions(_settings(bert), (bert, small)).context_size == 32


# ---- the public API: every family that feeds such a model, against engine processes -------------------


@dataclass
class Served:
    daemon: RunningDaemon
    pids: dict[str, int]  # each model's engine process when the module began


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("positions")
    common = {"context_size": CONTEXT, "slots": 1, "threads": 1, "isolation": "process"}
    models = [
        {"name": "bert", "file": str(write_tiny_bert(base / "bert.gguf")), "kind": "embedding", **common},
        {"name": "rr", "file": str(write_tiny_bert(base / "rr.gguf", rank=True)), "kind": "rerank", **common},
        {"name": "gpt2", "file": str(write_tiny_gpt2(base / "gpt2.gguf")), **common},
    ]
    settings = settings_for(models, lifecycle={"preload_dir": str(base / "shm"), "watch": False})
    with running(settings) as daemon:
        yield Served(daemon, {name: _engine(daemon, name).pid for name in ("bert", "rr", "gpt2")})


def _engine(daemon: RunningDaemon, name: str) -> RemoteEngine:
    assert daemon.app is not None
    engine = daemon.app[appkeys.REGISTRY].get(name).engine
    assert isinstance(engine, RemoteEngine)
    return engine


def _assert_engine_lives(served: Served, name: str) -> None:
    assert _engine(served.daemon, name).pid == served.pids[name]
    _, status = served.daemon.get("/admin/status")
    (model,) = (m for m in status["models"] if m["name"] == name)
    assert model["engine_stops"] == 0
    assert model["state"] == "ready"


def _refused(status: int, body: Any, param: str) -> None:
    assert status == 400, body
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == param
    assert f"at most {LEARNED_POSITIONS} tokens" in body["error"]["message"]


def test_an_embedding_input_past_the_table_is_a_400_naming_it(served: Served) -> None:
    status, body = served.daemon.post("/v1/embeddings", {"model": "bert", "input": PAST})
    _refused(status, body, "input")
    tokens = [3 + i % 200 for i in range(LEARNED_POSITIONS + 1)]  # token ids: the same bound
    status, body = served.daemon.post("/v1/embeddings", {"model": "bert", "input": [tokens]})
    _refused(status, body, "input")
    status, body = served.daemon.post("/v1/embeddings", {"model": "bert", "input": FITS})
    assert status == 200, body
    assert len(body["data"][0]["embedding"]) == 32  # the tiny BERT's width
    _assert_engine_lives(served, "bert")


def test_a_rerank_pair_past_the_table_is_a_400_naming_it(served: Served) -> None:
    status, body = served.daemon.post("/v1/rerank", {"model": "rr", "query": "q", "documents": [PAST]})
    _refused(status, body, "documents")
    fits = FITS[:-1]  # the query's one token beside it
    status, body = served.daemon.post("/v1/rerank", {"model": "rr", "query": "q", "documents": [fits]})
    assert status == 200, body
    _assert_engine_lives(served, "rr")


def test_a_generation_stops_at_the_end_of_the_table(served: Served) -> None:
    prompt = "a" * (LEARNED_POSITIONS // 2)
    body = {"model": "gpt2", "prompt": prompt, "max_tokens": CONTEXT, "ignore_eos": True, "temperature": 0}
    status, answer = served.daemon.post("/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= LEARNED_POSITIONS
    status, answer = served.daemon.post("/v1/completions", {**body, "prompt": PAST})
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert f"context is {LEARNED_POSITIONS} tokens" in answer["error"]["message"]
    _assert_engine_lives(served, "gpt2")
