"""ModelHandle's admission checks: the capacity bound and the bounded tokenizing of long prompts."""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest

from edgellmd.engine import EngineConfig
from edgellmd.engine.embedding import EmbeddingEngine
from edgellmd.errors import ContextLengthExceeded, ServerOverloaded
from edgellmd.models.handle import PREFIX_CHARS_PER_TOKEN, ModelHandle, Provenance
from edgellmd.settings import ModelSettings

CONTEXT = 256


class CountingEngine:
    """Stands in for the engine: a tokenizer of `chars_per_token` characters a token that
    records how many characters it was asked to tokenize, and settable slot counts."""

    def __init__(self, chars_per_token: int = 1) -> None:
        self.chars_per_token = chars_per_token
        self.calls: list[int] = []
        self.busy_slots = 0
        self.queue_depth = 0
        self.by_key: Counter[str] = Counter()  # what each key holds; all "" unless a test says

    def occupancy(self) -> tuple[int, int]:
        return self.busy_slots, self.queue_depth

    def held_by_tenant(self) -> Counter[str]:
        return self.by_key or Counter({"": self.busy_slots + self.queue_depth})

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.calls.append(len(text))
        return [7] * (int(add_special) + math.ceil(len(text) / self.chars_per_token))


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


def make_handle(engine: CountingEngine, executor: ThreadPoolExecutor, **settings: Any) -> ModelHandle:
    fields: dict[str, Any] = {"name": "m", "file": None, "context_size": CONTEXT, **settings}
    provenance = Provenance(
        source=Path("m.gguf"), source_stat=None, locked=None, lock_version=None, copy=None, memory_bytes=0
    )
    return ModelHandle(
        settings=ModelSettings(**fields),
        engine=cast(Any, engine),
        template=None,
        executor=executor,
        provenance=provenance,
    )


async def test_a_prompt_far_past_the_context_is_refused_after_tokenizing_a_prefix(
    executor: ThreadPoolExecutor,
) -> None:
    engine = CountingEngine()
    handle = make_handle(engine, executor)
    with pytest.raises(ContextLengthExceeded) as refused:
        await handle.text_prompt("stuff " * 200_000)
    assert engine.calls == [CONTEXT * PREFIX_CHARS_PER_TOKEN]  # never the whole 1.2 MB
    assert refused.value.param == "prompt"
    assert "at least" in refused.value.message
    assert f"context is {CONTEXT} tokens" in refused.value.message


async def test_a_long_prompt_that_tokenizes_compactly_is_tokenized_whole(
    executor: ThreadPoolExecutor,
) -> None:
    # 50 characters a token: 10,000 characters are 200 tokens plus BOS, which fit in 256.
    engine = CountingEngine(chars_per_token=50)
    handle = make_handle(engine, executor)
    tokens = await handle.text_prompt("x" * 10_000)
    assert len(tokens) == 201
    first = CONTEXT * PREFIX_CHARS_PER_TOKEN
    assert engine.calls == [first, 2 * first, 4 * first, 10_000]  # doubling prefixes, then whole


async def test_a_prompt_within_the_prefix_length_is_tokenized_once(executor: ThreadPoolExecutor) -> None:
    engine = CountingEngine()
    handle = make_handle(engine, executor)
    assert len(await handle.text_prompt("a" * 254)) == 255  # BOS + 254: just fits
    with pytest.raises(ContextLengthExceeded) as refused:
        await handle.text_prompt("a" * 255)
    assert engine.calls == [254, 255]
    assert "the prompt has 256 tokens" in refused.value.message


async def test_a_prefix_within_the_slack_proves_nothing(executor: ThreadPoolExecutor) -> None:
    # 3,000 characters at 8 a token: the first prefix (2,048 characters) holds 257 tokens,
    # past the context but not past the slack a mid-word cut may add, so the whole is counted.
    engine = CountingEngine(chars_per_token=8)
    handle = make_handle(engine, executor)
    with pytest.raises(ContextLengthExceeded) as refused:
        await handle.text_prompt("y" * 3_000)
    assert engine.calls == [2_048, 3_000]
    assert "the prompt has 376 tokens" in refused.value.message


async def test_embedding_inputs_are_bounded_the_same_way(executor: ThreadPoolExecutor) -> None:
    engine = CountingEngine()
    handle = make_handle(engine, executor, embedding=True)
    with pytest.raises(ContextLengthExceeded) as refused:
        await handle.text_prompt("z" * 100_000, param="input")
    assert engine.calls == [CONTEXT * PREFIX_CHARS_PER_TOKEN]
    assert refused.value.param == "input"
    assert "an input has at least" in refused.value.message


@pytest.mark.parametrize(
    ("busy", "waiting", "refused"),
    [
        (0, 0, False),
        (1, 1, False),  # a slot is free: room for one more
        (1, 2, True),  # the free slot's request already waits for the scheduler: full
        (0, 3, True),  # nothing running yet, but slots and queue are spoken for
        (2, 0, False),
        (2, 1, True),
    ],
)
def test_capacity_counts_running_and_waiting_together(
    executor: ThreadPoolExecutor, busy: int, waiting: int, refused: bool
) -> None:
    engine = CountingEngine()
    engine.busy_slots, engine.queue_depth = busy, waiting
    handle = make_handle(engine, executor, slots=2, queue_size=1)
    if refused:
        with pytest.raises(ServerOverloaded) as overloaded:
            handle.check_capacity("")
        assert overloaded.value.headers == {"Retry-After": "1"}
        assert handle.counters["queue_rejections"] == 1
    else:
        assert handle.check_capacity("") is False  # within the bound
        assert handle.counters["queue_rejections"] == 0


@pytest.mark.parametrize(
    ("held", "asking", "admitted"),
    [
        # slots 2 + queue_size 2: room 4, at most 8 (FAIR_OVERFLOW) in all.
        ({"flood": 4}, "flood", False),  # the key that filled it holds more than its share
        ({"flood": 4}, "other", True),  # a key holding nothing: its share is 4 // 2
        ({"flood": 4, "other": 1}, "other", True),  # 1 < 5 // 2
        ({"flood": 4, "other": 2}, "other", False),  # its share (2) is held
        ({"flood": 4, "b": 1, "c": 1}, "d", True),  # 0 < 6 // 4
        ({"flood": 4, "b": 1, "c": 1}, "b", False),  # 1 is b's share of 6 among 3 keys
        ({"flood": 2, "b": 2}, "b", False),  # at the bound, b holds its share: as before
        ({"flood": 7}, "other", True),  # the last place below twice the room
        ({"flood": 8}, "other", False),  # twice the room: nobody, whatever they hold
    ],
)
def test_past_the_queue_bound_a_key_below_its_fair_share_still_gets_in(
    executor: ThreadPoolExecutor, held: dict[str, int], asking: str, admitted: bool
) -> None:
    engine = CountingEngine()
    engine.by_key = Counter(held)
    engine.busy_slots = 2
    engine.queue_depth = sum(held.values()) - 2
    handle = make_handle(engine, executor, slots=2, queue_size=2)
    if admitted:
        assert handle.check_capacity(asking) is True  # let in past the bound (counted where it is used)
        assert handle.counters["queue_rejections"] == 0
    else:
        with pytest.raises(ServerOverloaded):
            handle.check_capacity(asking)
        assert handle.counters["queue_rejections"] == 1


def test_a_requests_choices_are_let_in_or_refused_together(executor: ThreadPoolExecutor) -> None:
    engine = CountingEngine()
    engine.busy_slots, engine.queue_depth = 2, 1  # room 4 (slots 2, queue 2): one place left
    handle = make_handle(engine, executor, slots=2, queue_size=2)
    assert handle.check_capacity("", 1) is False
    with pytest.raises(ServerOverloaded):
        handle.check_capacity("", 2)  # one key alone: held to the bound, both choices or none
    engine.by_key = Counter({"flood": 3})
    assert handle.check_capacity("other", 2) is True  # below its share: both, past the bound
    assert handle.check_capacity("other", 5) is True  # 3 + 5 = twice the room
    with pytest.raises(ServerOverloaded):
        handle.check_capacity("other", 6)


def test_nobody_is_let_past_the_bound_of_an_idle_model(executor: ThreadPoolExecutor) -> None:
    handle = make_handle(CountingEngine(), executor, slots=1, queue_size=0)
    with pytest.raises(ServerOverloaded):
        handle.check_capacity("k", 2)  # more choices than the room, and no other key there


class HeldEmbedder:
    """An embedding engine whose calls end when the test says."""

    def __init__(self) -> None:
        self.futures: list[Future[list[list[float]]]] = []

    def submit_embed(self, inputs: Any) -> Future[list[list[float]]]:
        self.futures.append(Future())
        return self.futures[-1]

    def abandon(self, future: Future[list[list[float]]]) -> None:
        future.cancel()


async def test_an_embed_call_counts_for_its_key_as_the_engine_counts_it(executor: ThreadPoolExecutor) -> None:
    """One call of many inputs fills an embedding model's slots (the engine counts its inputs):
    its key then holds the room, and its next call is refused while another key's goes in."""
    engine = CountingEngine()
    engine.by_key = Counter({"x": 0})  # an embedding engine knows no keys: the handle counts
    handle = make_handle(engine, executor, slots=4, queue_size=0, embedding=True)
    embedder = HeldEmbedder()
    big = asyncio.create_task(handle._pool(cast(Any, embedder), [[1]] * 400, "flood"))
    await asyncio.sleep(0)
    engine.busy_slots = 4  # what the engine shows for it
    assert handle._pooled == Counter({"flood": 4})
    small = asyncio.create_task(handle._pool(cast(Any, embedder), [[1]], "other"))
    await asyncio.sleep(0)
    engine.queue_depth = 1
    assert handle.counters["fair_admissions"] == 1
    # Counted by calls, the flooding key would hold 1 of its share of 2 and get in again.
    with pytest.raises(ServerOverloaded):
        await handle._pool(cast(Any, embedder), [[1]] * 60, "flood")
    for future in embedder.futures:
        future.set_result([[0.0]])
    await asyncio.gather(big, small)
    assert handle._pooled == Counter()


def test_embed_calls_in_flight_count_for_their_key(executor: ThreadPoolExecutor) -> None:
    engine = CountingEngine()
    engine.busy_slots, engine.queue_depth = 1, 1
    engine.by_key = Counter({"x": 0})  # an embedding engine knows no keys: the handle counts calls
    handle = make_handle(engine, executor, slots=1, queue_size=1)
    handle._pooled["flood"] += 2
    with pytest.raises(ServerOverloaded):
        handle.check_capacity("flood")
    assert handle.check_capacity("other") is True


async def test_an_embedding_request_holds_no_pool_thread_while_the_model_works(
    executor: ThreadPoolExecutor, tiny_model: Path
) -> None:
    """Model loads, hashing, NVML polling and /metrics share the loop's default executor: an
    embedding waiting for its model must not occupy one of its threads (before: a blocking
    future.result() inside it)."""
    engine = EmbeddingEngine(
        EngineConfig(path=tiny_model, slots=1, context_size=128, batch_size=128, threads=1, threads_batch=1),
        name="embed",
    )
    loop = asyncio.get_running_loop()
    blocked = threading.Event()
    with ThreadPoolExecutor(1) as only_thread:
        loop.set_default_executor(only_thread)
        handle = make_handle(cast(Any, engine), executor, embedding=True, context_size=128)
        try:
            hold = loop.run_in_executor(None, blocked.wait, 30)  # the default pool's one thread is busy
            vectors = await asyncio.wait_for(handle.embed([[5, 6, 7]], tenant=""), 10)
            assert len(vectors) == 1
        finally:
            blocked.set()
            await hold
            engine.close()


class CompilingEngine(CountingEngine):
    """A generation engine whose grammars compile when the test says, counting those freed (an
    engine process keeps each one it compiled until it is freed)."""

    kind = "generation"

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.go = threading.Event()
        self.compiled = 0
        self.freed = 0

    def compile_grammar(self, grammar: str, copies: int = 1) -> list[Any]:
        self.started.set()
        self.go.wait(10)
        self.compiled += copies
        return [FreedGrammar(self) for _ in range(copies)]


class FreedGrammar:
    def __init__(self, engine: CompilingEngine) -> None:
        self.engine = engine

    def free(self) -> None:
        self.engine.freed += 1


async def test_grammars_compiled_for_a_request_gone_meanwhile_are_freed(executor: ThreadPoolExecutor) -> None:
    """A request cancelled (its client gone, the drain, its key revoked) while its grammar
    compiles: the copies are freed once compiled (they were kept in the engine process for good);
    while it still waits for a prompt thread: never compiled."""
    engine = CompilingEngine()
    handle = make_handle(engine, executor)
    asking = asyncio.create_task(handle.grammars('root ::= "a"', 3, "response_format"))
    assert await asyncio.to_thread(engine.started.wait, 10)
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking
    engine.go.set()
    for _ in range(200):
        if engine.freed == 3:
            break
        await asyncio.sleep(0.01)
    assert (engine.compiled, engine.freed) == (3, 3)

    gate = threading.Event()
    blocker = executor.submit(gate.wait, 10)  # the pool's one thread, taken
    waiting = asyncio.create_task(handle.grammars('root ::= "b"', 2, "response_format"))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.set()
    blocker.result(10)
    await asyncio.sleep(0.05)
    assert (engine.compiled, engine.freed) == (3, 3)  # the second request's never compiled

    kept = await handle.grammars('root ::= "c"', 2, "response_format")  # one not cancelled: its own
    assert kept is not None
    assert len(kept) == 2
    assert (engine.compiled, engine.freed) == (5, 3)
