"""The real llama.cpp embedding engine on tiny generated models: vectors, batching, limits, lifecycle."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest

from edgellmd.engine import EngineConfig, EngineError, ModelLoadError
from edgellmd.engine.embedding import EmbeddingEngine
from tests.ggufmodels import (
    BOS_ID,
    N_VOCAB,
    TINY_RERANK_TEMPLATE,
    TinyModelSpec,
    write_tiny_model,
    write_tiny_reranker,
)

SLOTS = 2
CONTEXT = 64
TEXTS = ["hello", "hello world", "a rather longer sentence about nothing much", "x", "hello!"]


def make_engine(
    path: Path, *, slots: int = SLOTS, context: int = CONTEXT, rank: bool = False
) -> EmbeddingEngine:
    return EmbeddingEngine(
        EngineConfig(
            path=path,
            slots=slots,
            context_size=context,
            batch_size=512,
            threads=1,
            threads_batch=1,
            rank=rank,
        ),
        name=path.stem,
    )


def write_pooled_model(
    path: Path, pooling: gguf.PoolingType, monkeypatch: pytest.MonkeyPatch, spec: TinyModelSpec | None = None
) -> Path:
    """A tiny model whose GGUF declares `llama.pooling_type`, as embedding models do."""
    header = gguf.GGUFWriter.write_header_to_file

    def with_pooling(writer: gguf.GGUFWriter, *args: Any, **kwargs: Any) -> None:
        writer.add_pooling_type(pooling)
        header(writer, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "write_header_to_file", with_pooling)
        return write_tiny_model(path, spec or TinyModelSpec(seed=11))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("embed") / "embed.gguf", TinyModelSpec(seed=11))


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[EmbeddingEngine]:
    eng = make_engine(model)
    yield eng
    eng.close()


def vectors(engine: EmbeddingEngine, texts: list[str]) -> list[list[float]]:
    return engine.embed([engine.tokenize(t) for t in texts])


def test_dimensions_and_info(engine: EmbeddingEngine) -> None:
    assert engine.n_embd == TinyModelSpec().n_embd == 64
    assert engine.n_vocab == N_VOCAB
    assert engine.info.architecture == "llama"
    assert engine.info.n_vocab == N_VOCAB
    assert engine.pooling == "mean"  # the tiny llama declares no pooling: mean is the default
    (vector,) = vectors(engine, ["hello"])
    assert len(vector) == engine.n_embd
    assert all(isinstance(x, float) for x in vector)


def test_tokenize(engine: EmbeddingEngine) -> None:
    tokens = engine.tokenize("héllo")
    assert tokens[0] == BOS_ID
    assert len(tokens) == 1 + len("héllo".encode())
    assert engine.tokenize("hi", add_special=False) == engine.tokenize("hi")[1:]


def test_vectors_have_unit_length(engine: EmbeddingEngine) -> None:
    for vector in vectors(engine, TEXTS):
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-9)


def test_identical_inputs_give_identical_vectors(engine: EmbeddingEngine) -> None:
    (alone,) = vectors(engine, ["hello world"])
    assert vectors(engine, ["hello world"]) == [alone]
    batch = vectors(engine, ["x", "hello world", TEXTS[2], "hello world", "hello", "hello world"])
    assert batch[1] == batch[3] == batch[5] == alone


def test_different_inputs_give_different_vectors(engine: EmbeddingEngine) -> None:
    batch = vectors(engine, TEXTS)
    for i in range(len(batch)):
        for j in range(i + 1, len(batch)):
            assert batch[i] != batch[j]
            assert math.fsum(a * b for a, b in zip(batch[i], batch[j], strict=True)) < 0.9999


def test_batches_larger_than_slots_keep_order(engine: EmbeddingEngine) -> None:
    texts = [f"input number {i}" for i in range(SLOTS * 3 + 1)]
    batch = vectors(engine, texts)
    assert len(batch) == len(texts)
    assert batch == [vectors(engine, [t])[0] for t in texts]


def test_token_ids_are_embedded_as_given(engine: EmbeddingEngine) -> None:
    tokens = engine.tokenize("hello")
    assert engine.embed([tokens]) == engine.embed([tuple(tokens)]) == vectors(engine, ["hello"])
    longest = [BOS_ID] + [3] * (CONTEXT - 1)  # exactly context_size tokens is allowed
    assert len(engine.embed([longest, [N_VOCAB - 1]])) == 2


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "no inputs"),
        ([[]], "input 0 is empty"),
        ([[1, 2], []], "input 1 is empty"),
        ([[1], [1, N_VOCAB]], rf"input 1 holds a token id outside the vocabulary \(0 to {N_VOCAB - 1}\)"),
        ([[-1]], "input 0 holds a token id outside the vocabulary"),
        (
            [[1], [1], [1] * (CONTEXT + 1)],
            f"input 2 has {CONTEXT + 1} tokens, more than the limit of {CONTEXT}",
        ),
    ],
)
def test_bad_inputs_are_refused(engine: EmbeddingEngine, inputs: list[list[int]], message: str) -> None:
    with pytest.raises(EngineError, match=message):
        engine.embed(inputs)
    assert engine.idle  # nothing was queued


def test_concurrent_callers_both_succeed(engine: EmbeddingEngine) -> None:
    texts = [[f"thread {k} input {i}" for i in range(8)] for k in range(2)]
    expected = [vectors(engine, t) for t in texts]
    results: list[list[list[float]] | BaseException] = [[], []]
    start = threading.Barrier(2)

    def call(k: int) -> None:
        start.wait()
        try:
            results[k] = vectors(engine, texts[k])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[k] = exc

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_idle_state_and_heartbeat(engine: EmbeddingEngine) -> None:
    before = engine.heartbeat
    vectors(engine, ["tick"])
    assert engine.heartbeat > before
    assert engine.idle
    assert engine.busy_slots == 0
    assert engine.queue_depth == 0


def test_declared_pooling_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: EmbeddingEngine
) -> None:
    # Same weights as the `engine` fixture's model, which gets mean pooling by default.
    last = make_engine(write_pooled_model(tmp_path / "last.gguf", gguf.PoolingType.LAST, monkeypatch))
    try:
        assert last.pooling == "last"
        tokens = last.tokenize("hello world")
        (by_last,) = last.embed([tokens])
        assert math.isclose(math.fsum(x * x for x in by_last), 1.0, rel_tol=1e-9)
        assert by_last != engine.embed([tokens])[0]
        # Causal attention and last-token pooling: tokens after the prefix change the vector.
        assert last.embed([tokens[:3]])[0] != by_last
    finally:
        last.close()


def test_declared_none_pooling_gets_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: EmbeddingEngine
) -> None:
    none = make_engine(write_pooled_model(tmp_path / "none.gguf", gguf.PoolingType.NONE, monkeypatch))
    try:
        assert none.pooling == "mean"
        tokens = none.tokenize("hello world")
        assert none.embed([tokens]) == engine.embed([tokens])
    finally:
        none.close()


def test_reranking_models_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_pooled_model(tmp_path / "rank.gguf", gguf.PoolingType.RANK, monkeypatch)
    with pytest.raises(ModelLoadError, match="reranking model"):
        make_engine(path)


def test_close_is_idempotent_and_final(model: Path) -> None:
    eng = make_engine(model)
    assert len(vectors(eng, ["before"])) == 1
    tokens = eng.tokenize("after")
    eng.close()
    eng.close()
    with pytest.raises(EngineError, match="shutting down"):
        eng.embed([tokens])
    with pytest.raises(EngineError, match="shutting down"):  # the vocabulary is gone
        eng.tokenize("after")
    assert eng.idle


def test_close_fails_running_and_waiting_calls(tmp_path: Path) -> None:
    # A wider model and many inputs: the first call runs for seconds, the second waits behind it.
    path = write_tiny_model(
        tmp_path / "wide.gguf", TinyModelSpec(seed=12, n_embd=512, n_head=8, n_head_kv=4, n_ff=2048)
    )
    eng = make_engine(path)
    inputs = [[BOS_ID] + [3 + (i + k) % 256 for k in range(CONTEXT - 1)] for i in range(2000)]
    errors: list[BaseException | None] = [None, None]

    def call(k: int) -> None:
        try:
            eng.embed(inputs)
        except EngineError as exc:
            errors[k] = exc

    first = threading.Thread(target=call, args=(0,))
    first.start()
    deadline = time.monotonic() + 30
    while eng.busy_slots == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    second = threading.Thread(target=call, args=(1,))
    second.start()
    while eng.queue_depth == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert eng.busy_slots == SLOTS  # the running call, capped at slots
    assert eng.queue_depth == 1
    assert not eng.idle
    eng.close()
    first.join()
    second.join()
    assert [str(e) for e in errors] == ["the model was unloaded"] * 2
    assert eng.idle


def test_a_short_call_is_not_held_behind_a_long_one(engine: EmbeddingEngine) -> None:
    """Calls take turns, one decode each: a call of many inputs delays a call of one by a
    decode, not by its whole length, and neither's vectors change for sharing the thread."""
    long_inputs = [engine.tokenize(f"input number {i} of a long call") for i in range(300)]
    short = engine.tokenize("a short call")
    alone = engine.embed([short])
    first_long = engine.embed(long_inputs[:3])
    long_call = engine.submit_embed(long_inputs)
    deadline = time.monotonic() + 30
    while engine.busy_slots == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)
    short_call = engine.submit_embed([short])
    assert short_call.result(30) == alone
    assert not long_call.done()  # the short one came back while the long one still runs
    assert long_call.result(60)[:3] == first_long
    assert engine.idle


def test_a_reranking_engine_scores_each_input(tmp_path: Path) -> None:
    model = write_tiny_reranker(tmp_path / "rank.gguf", seed=4)
    eng = make_engine(tmp_path / "rank.gguf", rank=True)
    try:
        assert eng.kind == "rerank"
        assert eng.pooling == "rank"
        assert eng.info.rerank_template == TINY_RERANK_TEMPLATE
        inputs = [[BOS_ID, *(3 + b for b in text.encode())] for text in TEXTS]
        scores = eng.embed(inputs)
        assert all(len(s) == 1 for s in scores)
        for got, tokens in zip(scores, inputs, strict=True):
            assert 0.0 < got[0] < 1.0
            assert got[0] == pytest.approx(model.score(tokens), abs=5e-3)
        assert eng.embed(inputs) == scores  # the same pair, the same score
    finally:
        eng.close()
    plain = write_tiny_model(tmp_path / "plain.gguf", TinyModelSpec(seed=3))
    with pytest.raises(ModelLoadError, match="not a reranking model"):
        make_engine(plain, slots=1, rank=True)


def test_packed_decodes_take_every_waiting_calls_inputs_in_turn(model: Path) -> None:
    """inputs_per_decode 4: a decode takes the waiting calls' next inputs round robin, so a short
    call rides along a long one's decode; packed vectors stay close to unpacked ones."""
    packed = EmbeddingEngine(
        EngineConfig(
            path=model,
            slots=4,
            context_size=CONTEXT,
            batch_size=512,
            threads=1,
            threads_batch=1,
            inputs_per_decode=4,
        ),
        name="packed",
    )
    single = make_engine(model, slots=4)
    try:
        tokens = [packed.tokenize(t) for t in TEXTS]
        with packed._cond:  # the engine's thread waits on this lock: it cannot take them meanwhile
            long_call = packed.submit_embed(tokens * 2)  # 10 inputs
            short_call = packed.submit_embed(tokens[:2])
            groups = packed._take()
        assert [len(group) for _, group in groups] == [2, 2]  # two rounds over both calls
        assert groups[0][1] == tokens[:2]
        assert groups[1][1] == tokens[:2]
        done_long, done_short = long_call.result(30), short_call.result(30)
        expected = single.embed(tokens)
        for got, want in zip(done_long[:5] + done_short, expected + expected[:2], strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    finally:
        packed.close()
        single.close()


def test_one_input_a_decode_gives_the_same_vector_whatever_else_waits(model: Path) -> None:
    eng = make_engine(model, slots=4)
    try:
        tokens = [eng.tokenize(t) for t in TEXTS]
        alone = eng.embed([tokens[0]])[0]
        with eng._cond:
            calls = [eng.submit_embed(tokens), eng.submit_embed([tokens[0]])]
            assert [len(group) for _, group in eng._take()] == [1]  # the head call's next input only
        assert calls[0].result(30)[0] == alone
        assert calls[1].result(30)[0] == alone
    finally:
        eng.close()


def test_packed_rerank_scores_agree_with_the_hand_computed_ones(tmp_path: Path) -> None:
    model = write_tiny_reranker(tmp_path / "rank.gguf", seed=4)
    eng = EmbeddingEngine(
        EngineConfig(
            path=tmp_path / "rank.gguf",
            slots=4,
            context_size=CONTEXT,
            batch_size=512,
            threads=1,
            threads_batch=1,
            rank=True,
            inputs_per_decode=4,
        ),
        name="packed-rank",
    )
    try:
        inputs = [[BOS_ID, *(3 + b for b in text.encode())] for text in TEXTS]
        for got, tokens in zip(eng.embed(inputs), inputs, strict=True):
            assert got[0] == pytest.approx(model.score(tokens), abs=5e-3)
    finally:
        eng.close()
