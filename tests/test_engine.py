"""The real llama.cpp engine on tiny generated models: batching, queueing, cancellation, limits."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import llama_cpp
import pytest

from edgellmd.engine import EngineConfig, EngineError, ModelLoadError, scheduler
from edgellmd.engine.embedding import EmbeddingEngine
from edgellmd.engine.fairness import Share
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams, TextDelta
from edgellmd.engine.scheduler import Engine, in_sequence_order
from tests.ggufmodels import N_VOCAB, TinyModelSpec, write_tiny_model

GREEDY = SamplingParams(temperature=0.0)


def make_engine(path: Path, *, slots: int = 2, context: int = 256, batch: int = 512) -> Engine:
    return Engine(
        EngineConfig(
            path=path, slots=slots, context_size=context, batch_size=batch, threads=1, threads_batch=1
        ),
        name=path.stem,
    )


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    eng = make_engine(tiny_model)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider tiny model: a few hundred tokens/s, slow enough to cancel mid-generation."""
    path = tmp_path_factory.mktemp("slow") / "slow.gguf"
    return write_tiny_model(
        path, TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)
    )


async def generate(
    engine: Engine,
    prompt: str | list[int],
    max_tokens: int = 32,
    *,
    sampling: SamplingParams = GREEDY,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = True,
) -> tuple[str, Finished]:
    tokens = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
    gen = engine.submit(
        GenerationRequest(tokens, max_tokens, sampling, stop, ignore_eos), asyncio.get_running_loop()
    )
    return await read_all(gen)


async def read_all(gen: Any) -> tuple[str, Finished]:
    """A generation's text and its Finished event."""
    parts: list[str] = []
    async for event in gen.events():
        parts.append(event.text)
        if isinstance(event, Finished):
            return "".join(parts), event
    raise AssertionError("no Finished event")


def test_model_info(engine: Engine) -> None:
    info = engine.info
    assert info.architecture == "llama"
    assert info.n_vocab == N_VOCAB
    assert info.n_ctx_train == 4096
    assert info.bos_text == "<s>"
    assert info.eos_text == "</s>"
    assert info.add_bos
    assert info.chat_template is not None
    assert "add_generation_prompt" in info.chat_template


def test_tokenize_round_trip(engine: Engine) -> None:
    tokens = engine.tokenize("héllo")
    assert tokens[0] == 1  # BOS
    assert len(tokens) == 1 + len("héllo".encode())  # one byte token per UTF-8 byte
    assert engine.detokenize(tokens[1:]) == "héllo"
    assert engine.tokenize("<s>x", add_special=False, parse_special=True)[0] == 1
    assert engine.tokenize("<s>x", add_special=False, parse_special=False)[0] != 1


@pytest.mark.parametrize("kind", [Engine, EmbeddingEngine])
def test_missing_and_invalid_files_are_refused(tmp_path: Path, kind: type[Engine | EmbeddingEngine]) -> None:
    def load(path: Path) -> None:
        kind(
            EngineConfig(path=path, slots=1, context_size=128, batch_size=128, threads=1, threads_batch=1),
            name=path.stem,
        ).close()

    with pytest.raises(ModelLoadError, match="not found"):
        load(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ModelLoadError, match="could not load"):
        load(junk)


@pytest.mark.parametrize("mmap", [False, True])
async def test_the_file_is_mapped_only_when_asked(tmp_path: Path, mmap: bool) -> None:
    # A mapped file truncated in place kills the process (SIGBUS): the registry maps only
    # its private preload copies and reads a models-directory file into memory.
    path = write_tiny_model(tmp_path / "mapped.gguf", TinyModelSpec(seed=5))
    engine = Engine(
        EngineConfig(
            path=path, slots=1, context_size=128, batch_size=64, threads=1, threads_batch=1, mmap=mmap
        ),
        name="mapped",
    )
    try:
        mapped = str(path) in await asyncio.to_thread(Path("/proc/self/maps").read_text)
        _, fin = await generate(engine, "abc", 8)
    finally:
        engine.close()
    assert mapped == mmap
    assert fin.completion_tokens == 8


async def test_a_grammar_holds_when_the_model_never_picks_its_tokens(engine: Engine) -> None:
    # The tiny model's first picks are almost never "z": every token is a grammar miss,
    # resampled among the likeliest candidates the grammar allows.
    for sampling in (
        SamplingParams(temperature=0.0, grammar='root ::= "z"+'),
        SamplingParams(temperature=1.0, seed=3, grammar='root ::= "z"+'),
    ):
        text, fin = await generate(engine, "Once upon a time", 24, sampling=sampling, ignore_eos=False)
        assert text == "z" * fin.completion_tokens
        assert fin.completion_tokens >= 1


async def test_grammar_misses_are_resampled_with_the_requests_logit_bias(engine: Engine) -> None:
    # "!" (+100) wins every first pick and breaks the grammar; among the letters the grammar
    # allows, "q" (+60) must win the resample at temperature 0 however low the model ranks it.
    bang, q = engine.tokenize("!", add_special=False)[0], engine.tokenize("q", add_special=False)[0]
    sampling = SamplingParams(
        temperature=0.0, grammar="root ::= [a-z]+", logit_bias=((bang, 100.0), (q, 60.0))
    )
    text, _ = await generate(engine, "Once upon a time", 32, sampling=sampling)
    assert text == "q" * 32
    without_grammar, _ = await generate(
        engine,
        "Once upon a time",
        8,
        sampling=SamplingParams(temperature=0.0, logit_bias=((bang, 100.0), (q, 60.0))),
    )
    assert without_grammar == "!" * 8


async def test_penalties_count_the_resampled_token_not_the_rejected_pick(engine: Engine) -> None:
    # "!" wins every first pick and breaks the grammar, so every token is a resample among
    # the letters, where "a" leads "b" by 100 until the frequency penalty (200 per use) has
    # put "a" one use ahead: the letters alternate. Penalties that counted the rejected "!"
    # instead would never touch "a": "aaaa...".
    bang, a, b = (engine.tokenize(c, add_special=False)[0] for c in "!ab")
    bias = ((bang, 1e6), (a, 1e4 + 100), (b, 1e4))
    sampling = SamplingParams(
        temperature=0.0, grammar="root ::= [a-z]+", frequency_penalty=200.0, logit_bias=bias
    )
    text, _ = await generate(engine, "Once upon a time", 16, sampling=sampling)
    assert text == "ab" * 8
    # Without the grammar the chain's own picks are counted: "!" until it falls behind "a".
    free, _ = await generate(
        engine,
        "Once upon a time",
        8,
        sampling=SamplingParams(temperature=0.0, frequency_penalty=2e5, logit_bias=bias),
    )
    assert free.startswith("!!!!!ab")


async def test_a_grammar_no_token_can_continue_ends_the_reply(engine: Engine) -> None:
    # The grammar allows only "z" and the request's own bias forbids it: no token of the
    # vocabulary fits. Accepting any other into the grammar would abort inside llama.cpp.
    z = engine.tokenize("z", add_special=False)[0]
    sampling = SamplingParams(temperature=0.0, grammar='root ::= "z"+', logit_bias=((z, float("-inf")),))
    text, fin = await generate(engine, "Once upon a time", 8, sampling=sampling)
    assert (text, fin.reason, fin.completion_tokens) == ("", "stop", 0)
    text, fin = await generate(
        engine, "Once upon a time", 4, sampling=SamplingParams(temperature=0.0, grammar='root ::= "z"+')
    )
    assert (text, fin.completion_tokens) == ("zzzz", 4)  # and the engine serves on


async def test_occupancy_counts_a_generation_moving_into_a_slot_once(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between leaving the queue and filling its slot a generation is in neither; admission
    # reading the two apart let one request too many in under overload.
    engine = make_engine(tiny_model, slots=1)
    moving, release = threading.Event(), threading.Event()
    seen: list[tuple[int, int]] = []
    assign = Engine._assign

    def slow_assign(self: Engine, gen: Any) -> None:
        moving.set()
        release.wait(10)
        assign(self, gen)

    monkeypatch.setattr(Engine, "_assign", slow_assign)
    try:
        # Long enough that it still holds its slot when the reader gets the lock, however busy
        # the machine (the reader is cut off from it only by the move, not by the generation).
        request = GenerationRequest(engine.tokenize("abc"), 200, GREEDY, ignore_eos=True)
        gen = engine.submit(request, asyncio.get_running_loop())
        assert await asyncio.to_thread(moving.wait, 10)
        assert (engine.busy_slots, engine.queue_depth) == (0, 0)  # read apart: counted nowhere
        reader = threading.Thread(target=lambda: seen.append(engine.occupancy()))
        reader.start()
        await asyncio.sleep(0.2)
        assert seen == []  # waits for the move to finish
        release.set()
        await asyncio.to_thread(reader.join, 10)
        assert seen == [(1, 0)]
        gen.cancel()
        engine.wake()
        async for _ in gen.events():
            pass
    finally:
        release.set()
        engine.close()


async def test_generates_exactly_max_tokens(engine: Engine) -> None:
    text, fin = await generate(engine, "Once upon a time", 40)
    assert fin.reason == "length"
    assert fin.completion_tokens == 40
    assert fin.prompt_tokens == len(engine.tokenize("Once upon a time"))
    assert text


async def test_greedy_is_deterministic_and_seeds_reproduce(engine: Engine) -> None:
    a, _ = await generate(engine, "abc", 24)
    b, _ = await generate(engine, "abc", 24)
    assert a == b
    seeded = SamplingParams(temperature=1.0, seed=1234, top_k=0)
    c, _ = await generate(engine, "abc", 24, sampling=seeded)
    d, _ = await generate(engine, "abc", 24, sampling=seeded)
    e, _ = await generate(engine, "abc", 24, sampling=SamplingParams(temperature=1.0, seed=99, top_k=0))
    assert c == d
    assert c != e


async def test_eos_ends_generation_with_stop(engine: Engine) -> None:
    # Whatever the random weights do, a generation that is allowed to stop at EOS never
    # reports more tokens than it was given, and the finish reason says which limit it hit.
    results = await asyncio.gather(
        *(
            generate(
                engine,
                f"prompt {i}",
                200,
                sampling=SamplingParams(temperature=1.5, seed=i, top_k=0),
                ignore_eos=False,
            )
            for i in range(6)
        )
    )
    for _, fin in results:
        assert fin.reason in ("stop", "length")
        assert fin.completion_tokens <= 200
        if fin.reason == "length":
            assert fin.completion_tokens == 200


async def test_stop_string_cuts_the_text(engine: Engine) -> None:
    full, _ = await generate(engine, "The stop test", 48)
    stop = full[20:23]
    assert len(stop) == 3
    text, fin = await generate(engine, "The stop test", 48, stop=(stop,))
    assert fin.reason == "stop"
    assert text == full[: full.index(stop)]


async def test_more_requests_than_slots_all_complete_without_cross_talk(engine: Engine) -> None:
    # The tiny model is F32 with well-separated logits, so greedy decoding is bitwise stable
    # whatever else shares the batch; each request's text under load equals its text alone.
    prompts = [f"request number {i}: " + "x" * i for i in range(8)]
    alone = [await generate(engine, p, 32) for p in prompts]
    loaded = await asyncio.gather(*(generate(engine, p, 32) for p in prompts))
    assert [t for t, _ in loaded] == [t for t, _ in alone]
    assert len({t for t, _ in alone}) == len(prompts)  # distinct outputs: cross-talk would show
    assert all(f.completion_tokens == 32 for _, f in loaded)
    assert engine.busy_slots == 0
    assert engine.queue_depth == 0


async def test_requests_wait_for_a_slot(tiny_model: Path) -> None:
    eng = make_engine(tiny_model, slots=1)
    try:
        loop = asyncio.get_running_loop()
        gens = [
            eng.submit(GenerationRequest(eng.tokenize(f"q{i}"), 64, GREEDY, ignore_eos=True), loop)
            for i in range(3)
        ]
        assert eng.busy_slots <= 1
        first_token_at: list[float] = []
        done_at: list[float] = []

        async def consume(gen_index: int) -> None:
            async for event in gens[gen_index].events():
                if isinstance(event, TextDelta) and len(first_token_at) <= gen_index:
                    first_token_at.append(time.monotonic())
                if isinstance(event, Finished):
                    done_at.append(time.monotonic())
                    assert event.completion_tokens == 64

        for i in range(3):
            await consume(i)
        # With one slot each request starts only after the previous one finished.
        assert first_token_at[1] >= done_at[0]
        assert first_token_at[2] >= done_at[1]
    finally:
        eng.close()


async def test_cancel_frees_the_slot_at_once(slow_model: Path) -> None:
    eng = make_engine(slow_model, slots=1, context=4096)
    try:
        loop = asyncio.get_running_loop()
        long_run = eng.submit(GenerationRequest(eng.tokenize("long"), 4000, GREEDY, ignore_eos=True), loop)
        events = long_run.events()
        assert isinstance(await anext(events), TextDelta)
        assert eng.busy_slots == 1
        long_run.cancel()
        eng.wake()
        cancelled_at = time.monotonic()
        while eng.busy_slots and time.monotonic() - cancelled_at < 5:  # noqa: ASYNC110 - polls the scheduler thread
            await asyncio.sleep(0.005)
        freed_after = time.monotonic() - cancelled_at
        assert eng.busy_slots == 0
        assert freed_after < 1.0
        assert eng.finished["cancelled"] == 1
        # The next request starts at once instead of waiting for 4000 tokens.
        started = time.monotonic()
        _, fin = await generate(eng, "next", 4)
        assert fin.completion_tokens == 4
        assert time.monotonic() - started < 1.0
        assert eng.tokens_generated < 4000
    finally:
        eng.close()


async def test_cancelled_waiting_request_leaves_the_queue(slow_model: Path) -> None:
    eng = make_engine(slow_model, slots=1, context=4096)
    try:
        loop = asyncio.get_running_loop()
        running = eng.submit(GenerationRequest(eng.tokenize("a"), 2000, GREEDY, ignore_eos=True), loop)
        waiting = eng.submit(GenerationRequest(eng.tokenize("b"), 10, GREEDY, ignore_eos=True), loop)
        await anext(running.events())
        assert eng.queue_depth == 1
        waiting.cancel()
        eng.wake()
        fin = [e async for e in waiting.events()][-1]
        assert isinstance(fin, Finished)
        assert fin.reason == "cancelled"
        assert eng.queue_depth == 0
        running.cancel()
    finally:
        eng.close()


async def test_a_cancelled_waiting_request_leaves_the_queue_without_waiting_for_the_step(
    slow_model: Path,
) -> None:
    """The queue let a cancelled request go at the scheduler's next pass, after the step in
    progress (a long prefill: seconds on a busy box): a key's hung-up requests, released from
    its `concurrent` cap by their handlers, held the model's queue meanwhile. `wake` takes it
    out there and then."""
    eng = make_engine(slow_model, slots=1, context=4096, batch=512)
    try:
        loop = asyncio.get_running_loop()
        long_prompt = eng.tokenize("many words " * 1500)[:3000]
        running = eng.submit(GenerationRequest(long_prompt, 4, GREEDY, ignore_eos=True), loop)
        began = time.monotonic()
        while eng.busy_slots == 0 and time.monotonic() - began < 5:  # noqa: ASYNC110 - the scheduler thread
            await asyncio.sleep(0.001)
        waiting = [eng.submit(GenerationRequest(eng.tokenize(f"b{i}"), 10, GREEDY), loop) for i in range(3)]
        assert eng.queue_depth == 3
        for gen in waiting:
            gen.cancel()
        eng.wake()
        assert eng.queue_depth == 0  # at once: the scheduler thread is inside the prefill
        for gen in waiting:
            fin = [e async for e in gen.events()][-1]
            assert isinstance(fin, Finished)
            assert fin.reason == "cancelled"
        assert eng.finished["cancelled"] == 3
        final = [e async for e in running.events()][-1]
        assert isinstance(final, Finished)
        assert final.reason == "length"
    finally:
        eng.close()


async def test_prefill_is_chunked_and_interleaved_with_decoding(tiny_model: Path) -> None:
    # batch 16: a 240-token prompt needs 16 steps of prefill (15 prompt tokens beside one
    # decode token each); a running stream must get a token at every one of those steps
    # instead of stalling behind the whole prompt in one big step.
    eng = make_engine(tiny_model, slots=2, batch=16)
    try:
        loop = asyncio.get_running_loop()
        a = eng.submit(GenerationRequest(eng.tokenize("a"), 250, GREEDY, ignore_eos=True), loop)
        seen: list[tuple[float, int]] = []
        first = asyncio.Event()

        async def consume_a() -> None:
            async for event in a.events():
                seen.append((time.monotonic(), event.completion_tokens))
                first.set()

        task = asyncio.create_task(consume_a())
        await first.wait()
        submitted = time.monotonic()
        b = eng.submit(GenerationRequest(eng.tokenize("p" * 239), 1, GREEDY, ignore_eos=True), loop)
        await anext(b.events())  # B's first token: its prefill is complete
        b_first = time.monotonic()
        during = [n for t, n in seen if submitted < t <= b_first]
        assert len(during) >= 15
        a.cancel()
        eng.wake()
        await task
    finally:
        eng.close()


async def test_generation_stops_at_the_slot_context(engine: Engine) -> None:
    prompt = engine.tokenize("z" * 200)  # 201 tokens of a 256-token slot
    _, fin = await generate(engine, prompt, 1000)
    assert fin.reason == "length"
    assert fin.prompt_tokens + fin.completion_tokens <= 256
    assert fin.completion_tokens >= 50


async def test_close_ends_running_generations_with_an_error(tiny_model: Path) -> None:
    eng = make_engine(tiny_model, slots=1, context=4096)
    loop = asyncio.get_running_loop()
    gen = eng.submit(GenerationRequest(eng.tokenize("x"), 4000, GREEDY, ignore_eos=True), loop)
    queued = eng.submit(GenerationRequest(eng.tokenize("y"), 10, GREEDY, ignore_eos=True), loop)
    await anext(gen.events())
    await loop.run_in_executor(None, eng.close)
    last = [e async for e in gen.events()][-1]
    assert isinstance(last, Finished)
    assert last.reason == "error"
    queued_last = [e async for e in queued.events()][-1]
    assert isinstance(queued_last, Finished)
    assert queued_last.reason == "error"


async def test_a_shared_prompt_prefix_is_not_prefilled_twice(tiny_model: Path) -> None:
    eng = make_engine(tiny_model, slots=1)
    try:
        system = "You are a terse assistant. " * 4
        first, _ = await generate(eng, system + "Question one?", 16)
        before = eng.prompt_tokens_reused
        again, _ = await generate(eng, system + "Question one?", 16)
        assert again == first  # reusing the cache changes nothing in the answer
        assert eng.prompt_tokens_reused - before == len(eng.tokenize(system + "Question one?")) - 1
        before = eng.prompt_tokens_reused
        await generate(eng, system + "Another question entirely", 16)
        shared = len(eng.tokenize(system + "Question ")) - 1  # BOS + the system prompt + "Question "
        assert eng.prompt_tokens_reused - before >= len(eng.tokenize(system)) - 1
        assert eng.prompt_tokens_reused - before <= shared + 1
    finally:
        eng.close()


async def _together(engine: Engine, requests: list[GenerationRequest]) -> list[tuple[str, Finished]]:
    """Submit the requests in one go (as the n choices of one request are) and read them all."""
    loop = asyncio.get_running_loop()
    gens = [engine.submit(request, loop) for request in requests]
    return list(await asyncio.gather(*(read_all(g) for g in gens)))


class StepLog:
    """An engine's steps counted, and at which step each copy of a prompt's start was made."""

    def __init__(self, eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        self.copies: list[tuple[int, int, int]] = []  # (step, source, target)
        self.waited: list[set[int]] = []  # the classes (Share.priority) of the slots that sat a step out
        self.peers: list[int] = []  # the most `peers` any slot held, at each step
        step, copy, share = eng._step, eng._copy_prefix, eng._share_prefixes

        def counted() -> bool:
            self.steps += 1
            return step()

        def copied(source: int, target: int, keep: int) -> bool:
            self.copies.append((self.steps, source, target))
            return copy(source, target, keep)

        def shared() -> set[int]:
            waiting = share()
            self.waited.append({eng._slots[j].gen.request.share.priority for j in waiting})  # type: ignore[union-attr]
            self.peers.append(max((len(s.peers) for s in eng._slots if s is not None), default=0))
            return waiting

        monkeypatch.setattr(eng, "_step", counted)
        monkeypatch.setattr(eng, "_copy_prefix", copied)
        monkeypatch.setattr(eng, "_share_prefixes", shared)


async def test_choices_of_one_prompt_compute_it_once_and_answer_as_if_alone(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The n choices of a request are a generation each with one prompt: the first computes it,
    the others wait for it and copy its KV (a 728-token prompt with n = 8 took 1.4-2.2 s to its
    answers against 0.18-0.36 s for n = 1: every choice computed the prompt). Greedy choices
    read exactly as one alone; another cache scope (another key) never shares."""
    prompt_text = "The quick brown fox jumps over the lazy dog. " * 12
    alone = make_engine(tiny_model, slots=1, context=1024)
    try:
        expected, _ = await generate(alone, prompt_text, 24)
    finally:
        alone.close()
    eng = make_engine(tiny_model, slots=4, context=1024)
    try:
        log = StepLog(eng, monkeypatch)
        prompt = eng.tokenize(prompt_text)
        assert len(prompt) > 500
        request = GenerationRequest(prompt, 24, GREEDY, ignore_eos=True, cache_scope="key-a")
        answers = await _together(eng, [request] * 4)
        assert [text for text, _ in answers] == [expected] * 4
        assert eng.prompt_tokens_shared == 3 * (len(prompt) - 1)  # computed once, copied three times
        # All copied in the step after the first had it (one a step, each copy's one token short
        # of the start read as still computing it and held the others back a step more).
        assert len({step for step, _, _ in log.copies}) == 1
        # Kept from no earlier request: the prompt was computed once, for this one.
        assert [f.cached_tokens for _, f in answers] == [0] * 4
        assert eng.performance()["prompt_tokens_shared"] == eng.prompt_tokens_shared
        # Other keys' requests with the same prompt, together: each computes its own.
        shared = eng.prompt_tokens_shared
        others = [
            GenerationRequest([*prompt[:-1], prompt[-2]], 8, GREEDY, ignore_eos=True, cache_scope=f"key-{n}")
            for n in "bcde"
        ]
        await _together(eng, others)
        assert eng.prompt_tokens_shared == shared
    finally:
        eng.close()


async def test_a_sequence_state_over_the_copy_bound_is_computed_not_copied(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy passes through host memory: past `_MAX_SHARE_BYTES` each choice computes its
    prompt (the followers still wait once, then find the copy refused and go on)."""
    monkeypatch.setattr(scheduler, "_MAX_SHARE_BYTES", 1024)
    eng = make_engine(tiny_model, slots=3, context=1024)
    try:
        prompt = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 8)
        request = GenerationRequest(prompt, 8, GREEDY, ignore_eos=True)
        answers = await _together(eng, [request] * 3)
        assert len({text for text, _ in answers}) == 1
        assert [f.reason for _, f in answers] == ["length"] * 3
        assert eng.prompt_tokens_shared == 0
    finally:
        eng.close()


async def test_a_choice_whose_leader_is_cancelled_mid_prompt_computes_it_itself(slow_model: Path) -> None:
    """The choices behind one computing their common prompt wait for it; cancelled before its
    prompt is in, the next one computes it (none waits for a sequence that is gone)."""
    eng = make_engine(slow_model, slots=3, context=4096, batch=64)
    try:
        prompt = eng.tokenize("Pack my box with five dozen liquor jugs. " * 40)
        loop = asyncio.get_running_loop()
        request = GenerationRequest(prompt, 8, GREEDY, ignore_eos=True)
        leader = eng.submit(request, loop)
        followers = [eng.submit(request, loop) for _ in range(2)]
        await asyncio.sleep(0.05)  # a chunk or two of its prompt in
        leader.cancel()
        results = []
        for gen in followers:
            events = [e async for e in gen.events()]
            assert isinstance(events[-1], Finished)
            results.append(events[-1])
        assert [f.reason for f in results] == ["length", "length"]
        assert [f.completion_tokens for f in results] == [8, 8]
        # The second follower copied the first's prompt, whole or but for what it had computed.
        assert eng.prompt_tokens_shared >= len(prompt) - 1 - 64 * 2
    finally:
        eng.close()


async def test_a_sequence_never_waits_for_one_of_a_lower_class_to_compute_their_start(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch request computing a long start that an interactive one shares (one key's
    `service_tier: flex` and priority requests, or keys of one cache group): the interactive one
    does not sit out behind it, whose prompt chunks rank last (behind any normal request's
    long prompt too); it computes its own, as without sharing."""
    eng = make_engine(slow_model, slots=2, context=4096, batch=64)
    try:
        log = StepLog(eng, monkeypatch)
        start = eng.tokenize("Pack my box with five dozen liquor jugs. " * 30)
        loop = asyncio.get_running_loop()
        low = GenerationRequest(
            [*start, *eng.tokenize(" x" * 20, add_special=False)],
            4,
            GREEDY,
            ignore_eos=True,
            share=Share("b", 1, -1),
        )
        high = GenerationRequest(
            [*start, *eng.tokenize(" y" * 20, add_special=False)],
            4,
            GREEDY,
            ignore_eos=True,
            share=Share("i", 1, 1),
        )
        batch = eng.submit(low, loop)
        while eng._slots[0] is None or eng._slots[0].prefilled < 128:  # noqa: ASYNC110 - the scheduler thread
            await asyncio.sleep(0.002)
        interactive = eng.submit(high, loop)
        for gen in (batch, interactive):
            events = [e async for e in gen.events()]
            assert isinstance(events[-1], Finished)
            assert events[-1].completion_tokens == 4
        assert not any(1 in classes for classes in log.waited)
    finally:
        eng.close()


async def test_a_long_prompt_holds_no_finished_neighbours(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common starts a computing prompt found with its neighbours are kept while they run,
    not after: a long prompt in small chunks beside a stream of short requests (another key's)
    held every one of them, prompt and all, until it finished."""
    eng = make_engine(slow_model, slots=3, context=4096, batch=16)
    try:
        log = StepLog(eng, monkeypatch)
        loop = asyncio.get_running_loop()
        text = "a long document to summarise. " * 40
        long = GenerationRequest(eng.tokenize(text), 1, GREEDY, cache_scope="key-a", share=Share("a"))
        assert 1000 < len(long.prompt_tokens) < 4000
        gen = eng.submit(long, loop)
        short = GenerationRequest(
            eng.tokenize("a short one " * 4), 1, GREEDY, cache_scope="key-b", share=Share("b")
        )
        for _ in range(8):
            await _together(eng, [short, short])
        assert any(s is not None and s.gen is gen for s in eng._slots)  # still computing its prompt
        await read_all(gen)
        assert max(log.peers) <= 2  # the other two slots' generations at most
    finally:
        eng.close()


async def test_a_failed_copy_takes_back_the_reuse_it_wiped(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a neighbour's state that fails wipes the sequence's own prefix too, and it
    computes its prompt again: what it had kept from its slot is no longer counted in
    prompt_tokens_reused (it stayed counted, as if never computed)."""
    eng = make_engine(slow_model, slots=2, context=2048, batch=64)
    try:
        loop = asyncio.get_running_loop()
        start = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
        rest = eng.tokenize(" Pack my box with five dozen liquor jugs." * 6, add_special=False)
        assert min(len(start), len(rest)) > 128  # each longer than MIN_CACHED_TOKENS

        def request(prompt: list[int], n: int) -> GenerationRequest:
            return GenerationRequest(prompt, n, GREEDY, ignore_eos=True, cache_scope="key-a")

        def slot_of(gen: Any) -> Any:
            return next((s for s in eng._slots if s is not None and s.gen is gen), None)

        first = eng.submit(request(start, 4), loop)
        while slot_of(first) is None:  # noqa: ASYNC110 - the scheduler thread
            await asyncio.sleep(0.002)
        # The leader takes the other slot (the first's is busy) and computes the whole start.
        leader = eng.submit(request([*start, *rest], 2048 - len(start) - len(rest) - 8), loop)
        await read_all(first)
        while (held := slot_of(leader)) is None or held.prefilled < len(held.prompt):  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        tries: list[int] = []

        def refused(*args: Any) -> int:
            tries.append(1)
            return 0

        monkeypatch.setattr(llama_cpp, "llama_state_seq_set_data", refused)  # the scheduler's `llama`
        before, shared = eng.prompt_tokens_reused, eng.prompt_tokens_shared  # the leader copied the start
        # The follower keeps the start from the first's slot (counted as reused), then finds
        # the leader past it and copies: the copy fails and wipes what it kept.
        follower = eng.submit(request([*start, *rest, *eng.tokenize(" Why?", add_special=False)], 4), loop)
        _, done = await read_all(follower)
        assert tries, "no copy was tried"
        assert (done.reason, done.completion_tokens, done.cached_tokens) == ("length", 4, 0)
        assert (eng.prompt_tokens_reused, eng.prompt_tokens_shared) == (before, shared)
        leader.cancel()
        await read_all(leader)
    finally:
        eng.close()


def test_close_waits_for_a_tokenize_in_progress_and_refuses_later_ones(tiny_model: Path) -> None:
    """A prompt-pool thread may still be tokenizing for a request whose lease ended: the model
    must not be freed under it (before the guard, close() freed the vocabulary mid-call)."""
    eng = make_engine(tiny_model, slots=1)
    text = "tokenize me " * 6_000  # 72 kB: most of a second with the byte vocabulary
    out: list[int] = []
    inside = threading.Event()

    def tokenize() -> None:
        inside.set()
        out.extend(eng.tokenize(text))

    thread = threading.Thread(target=tokenize)
    thread.start()
    inside.wait(5)
    time.sleep(0.05)  # well inside llama_tokenize by now
    eng.close()  # blocks until the tokenize above is out
    thread.join(30)
    assert len(out) > len(text) // 2  # the byte vocabulary: about a token per byte
    with pytest.raises(EngineError, match="shutting down"):
        eng.tokenize("after")


# ---- batches in sequence order ---------------------------------------------------------------


def test_a_batch_is_put_in_sequence_order_with_each_slots_logits_index_following() -> None:
    # Slots 1 and 3 generate (a token each, slot 3 with a 2-token draft), slot 0 prefills
    # its last prompt tokens after them: llama.cpp wants the ids in order.
    slots: list[Any] = [SimpleNamespace(batch_index=-1) for _ in range(4)]
    items = [
        (11, 5, 1, True),
        (31, 7, 3, True),
        (32, 8, 3, True),
        (33, 9, 3, True),
        (1, 3, 0, False),
        (2, 4, 0, True),
    ]
    slots[1].batch_index, slots[3].batch_index, slots[0].batch_index = 0, 1, 5
    slots[2] = None
    ordered = in_sequence_order(items, slots)
    assert [it[2] for it in ordered] == [0, 0, 1, 3, 3, 3]
    assert [it[1] for it in ordered if it[2] == 3] == [7, 8, 9]  # a sequence's tokens keep their order
    assert ordered[slots[0].batch_index] == (2, 4, 0, True)
    assert ordered[slots[1].batch_index] == (11, 5, 1, True)
    assert ordered[slots[3].batch_index] == (31, 7, 3, True)  # the draft's positions follow it
    # A batch already in order is left as it is.
    assert in_sequence_order(ordered, slots) is ordered


async def test_a_request_starting_in_a_low_slot_while_higher_ones_generate(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slot 0 frees first and the next request takes it while slots 1 and 2 still generate:
    # its prompt tokens come last when the batch is built, and must be decoded in order.
    engine = make_engine(tiny_model, slots=3)
    seen: list[list[int]] = []
    decode = llama_cpp.llama_decode

    def spy(ctx: Any, batch: Any) -> int:
        seen.append([batch.seq_id[k][0] for k in range(batch.n_tokens)])
        return int(decode(ctx, batch))

    try:
        alone = {p: (await generate(engine, p, 40))[0] for p in ("Once upon", "the quick brown", "zzz yy x")}
        monkeypatch.setattr(llama_cpp, "llama_decode", spy)
        short = asyncio.create_task(generate(engine, "hi", 2))
        await asyncio.sleep(0)
        long_ones = [asyncio.create_task(generate(engine, p, 40)) for p in ("Once upon", "the quick brown")]
        await short
        late = await generate(engine, "zzz yy x", 40)
        texts = [(await t)[0] for t in long_ones]
    finally:
        engine.close()
    assert texts == [alone["Once upon"], alone["the quick brown"]]
    assert late[0] == alone["zzz yy x"]
    mixed = [ids for ids in seen if len(set(ids)) > 1]
    assert any(ids[0] == 0 and 1 in ids for ids in mixed)  # the late request did join them
    assert all(ids == sorted(ids) for ids in seen)
