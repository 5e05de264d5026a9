"""Speculative decoding and the prompt cache on the real engine: the text is exactly plain decoding's."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from edgellmd.engine import EngineConfig, ModelLoadError
from edgellmd.engine.drafts import (
    FIRST_PAUSE,
    MAX_PAUSE,
    MIN_CACHED_TOKENS,
    PAUSE_AFTER,
    NgramDrafter,
    PromptCache,
    Speculation,
    common_prefix,
)
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.engine.scheduler import Engine
from tests.ggufmodels import TinyModelSpec, write_tiny_model

NGRAM = Speculation(mode="ngram", max_draft=6, max_sequences=8)
NO_DRAFTS = Speculation()
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "abcabcabcabc the quick brown fox jumps over the lazy dog " * 2,
    "hello world",
    "0101010101010101",
    "repeat repeat repeat repeat repeat",
    '{"name": "a", "name": "b", "name": "c", "name": "',
]
ABAB = 'root ::= ("ab")+ "." '  # a reply that repeats itself: drafts are right most of the time


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("drafts") / "m.gguf", TinyModelSpec(seed=5))


def _engine(model: Path, *, slots: int = 4, spec: Speculation = NO_DRAFTS, cache_mb: int = 0) -> Engine:
    return Engine(
        EngineConfig(
            path=model,
            slots=slots,
            context_size=1024,
            batch_size=512,
            threads=1,
            threads_batch=1,
            speculative=spec,
            prompt_cache_bytes=cache_mb * 1024 * 1024,
        ),
        name="m",
    )


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[Engine]:
    engine = _engine(model)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def drafting(model: Path) -> Iterator[Engine]:
    engine = _engine(model, spec=NGRAM)
    yield engine
    engine.close()


async def _generate(
    engine: Engine,
    prompt: str | list[int],
    max_tokens: int = 48,
    sampling: SamplingParams = GREEDY,
) -> tuple[str, Finished]:
    """The reply as the client sees it, less how it was computed (prompt tokens that came from
    a cache, drafts checked): those differ by design; `_run` keeps them."""
    text, final = await _run(engine, prompt, max_tokens, sampling)
    return text, replace(final, cached_tokens=0, draft_tokens=0, accepted_draft_tokens=0)


async def _run(
    engine: Engine,
    prompt: str | list[int],
    max_tokens: int = 48,
    sampling: SamplingParams = GREEDY,
) -> tuple[str, Finished]:
    tokens = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
    gen = engine.submit(
        GenerationRequest(tokens, max_tokens, sampling, ignore_eos=sampling.grammar is None),
        asyncio.get_running_loop(),
    )
    parts = []
    async for event in gen.events():
        parts.append(event.text)
        if isinstance(event, Finished):
            return "".join(parts), event
    raise AssertionError("no Finished event")


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_text_with_drafts_is_plain_decodings(
    plain: Engine, drafting: Engine, prompt: str
) -> None:
    assert await _generate(drafting, prompt) == await _generate(plain, prompt)


async def test_several_streams_at_once_with_grammars_among_them(plain: Engine, drafting: Engine) -> None:
    cases = [(p, SamplingParams(temperature=0.0)) for p in PROMPTS[:3]]
    cases.append(("ab", SamplingParams(temperature=0.0, grammar=ABAB)))
    expected = [await _generate(plain, p, sampling=s) for p, s in cases]
    before = drafting.accepted_tokens
    got = await asyncio.gather(*(_generate(drafting, p, sampling=s) for p, s in cases))
    assert list(got) == expected
    assert drafting.accepted_tokens > before  # the grammar's repeating reply was drafted and kept


async def test_a_repeating_reply_keeps_most_drafts(plain: Engine, drafting: Engine) -> None:
    sampling = SamplingParams(temperature=0.0, grammar=ABAB)
    drafted, accepted = drafting.drafted_tokens, drafting.accepted_tokens
    text, final = await _run(drafting, "ab ab ab", 64, sampling)
    assert (text, replace(final, draft_tokens=0, accepted_draft_tokens=0)) == await _run(
        plain, "ab ab ab", 64, sampling
    )
    # The request's own counts are the engine's (it ran alone), most drafts kept.
    assert final.draft_tokens == drafting.drafted_tokens - drafted > 0
    assert final.accepted_draft_tokens == drafting.accepted_tokens - accepted > final.draft_tokens // 2


@pytest.mark.parametrize("seed", range(6))
async def test_seeded_sampling_is_the_same_with_drafts(plain: Engine, drafting: Engine, seed: int) -> None:
    for grammar in (None, ABAB):
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar, top_k=8)
        assert await _generate(drafting, PROMPTS[0], 40, sampling) == await _generate(
            plain, PROMPTS[0], 40, sampling
        )


async def test_the_first_tokens_distribution_matches_plain_decoding(plain: Engine, drafting: Engine) -> None:
    """Over 120 seeds the replies' first four tokens come out alike: the same counts exactly,
    since each position is sampled from the same logits with the same random state (a bound
    with margin would hold anyway: this is the stronger property)."""

    async def histogram(engine: Engine) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()
        for seed in range(120):
            text, _ = await _generate(engine, "0101 0101 0101", 4, SamplingParams(temperature=1.0, seed=seed))
            counts[text] += 1
        return counts

    with_drafts, without = await histogram(drafting), await histogram(plain)
    assert with_drafts == without
    assert len(without) > 10  # the sampler really varies


def test_the_drafter_finds_the_longest_earlier_match() -> None:
    drafter = NgramDrafter(
        Speculation(mode="ngram", max_draft=3, ngram_min=1, ngram_max=3), [1, 2, 3, 4, 9, 2, 3]
    )
    assert drafter.draft() == [4, 9, 2]  # "2 3" was followed by "4 9 2"
    drafter.append(5)
    assert drafter.draft() == []  # "3 5" never occurred; nor "5" alone
    drafter.accepted(3, 0)
    assert drafter.draft_len == 1
    drafter.accepted(1, 1)
    assert drafter.draft_len == 3


def test_drafts_rejected_outright_again_and_again_pause_drafting_for_longer_each_time() -> None:
    drafter = NgramDrafter(Speculation(mode="ngram", max_draft=4), [])

    def rest_steps() -> int:
        steps = 0
        while drafter.resting():
            steps += 1
            assert steps <= MAX_PAUSE
        return steps

    for _ in range(PAUSE_AFTER - 1):
        drafter.accepted(2, 0)
        assert rest_steps() == 0  # not yet
    drafter.accepted(2, 0)
    assert rest_steps() == FIRST_PAUSE
    for pause in (2 * FIRST_PAUSE, 4 * FIRST_PAUSE):  # each further run doubles the pause
        for _ in range(PAUSE_AFTER):
            drafter.accepted(1, 0)
        assert rest_steps() == pause
    # A draft kept even in part ends the back-off and the count of rejections.
    drafter.accepted(3, 1)
    for _ in range(PAUSE_AFTER - 1):
        drafter.accepted(1, 0)
    drafter.accepted(2, 2)
    drafter.accepted(1, 0)
    assert rest_steps() == 0
    for _ in range(PAUSE_AFTER - 1):
        drafter.accepted(1, 0)
    assert rest_steps() == FIRST_PAUSE
    # Steps without a draft (no match) count for nothing; the pause never passes MAX_PAUSE.
    drafter.accepted(0, 0)
    assert rest_steps() == 0
    for _ in range(12 * PAUSE_AFTER):
        drafter.accepted(1, 0)
        rest_steps()
    for _ in range(PAUSE_AFTER):
        drafter.accepted(1, 0)
    assert rest_steps() == MAX_PAUSE


# ---- the prompt cache ------------------------------------------------------------------------


async def test_a_restored_prefix_continues_exactly_as_a_full_prefill(model: Path, plain: Engine) -> None:
    system = "You are a careful assistant. " * 12  # well past MIN_CACHED_TOKENS with the byte vocabulary
    assert len(plain.tokenize(system)) > MIN_CACHED_TOKENS
    cached = _engine(model, slots=1, cache_mb=64)
    try:
        await _generate(cached, system + "First question?", 8)
        await _generate(cached, "Something else entirely, to take the slot. " * 4, 8)  # the slot's KV is gone
        assert cached.prompt_cache is not None
        hits = cached.prompt_cache.stats.hits
        restored = cached.prompt_cache.stats.restored_tokens
        text, final = await _run(cached, system + "Second question?", 24)
        assert cached.prompt_cache.stats.hits == hits + 1
        assert final.cached_tokens == cached.prompt_cache.stats.restored_tokens - restored
        assert final.cached_tokens >= len(plain.tokenize(system)) - 1
        assert (text, replace(final, cached_tokens=0)) == await _generate(
            plain, system + "Second question?", 24
        )
    finally:
        cached.close()


def test_the_cache_keeps_within_its_size_lru() -> None:
    cache = PromptCache(max_bytes=1000)
    for n in range(5):
        cache.put([n] * 200, bytes(300))
    assert cache.used_bytes <= 1000
    assert len(cache.entries) == 3
    assert cache.stats.evicted == 2
    assert cache.best([4] * 200 + [7]) is not None  # the newest stays
    assert cache.best([0] * 200) is None  # the oldest went
    cache.put([4] * 300, bytes(400))  # extends an entry: replaces it
    assert ("", (4,) * 200) not in cache.entries
    assert cache.used_bytes <= 1000


def test_the_prompt_cache_finds_a_state_only_for_the_scope_that_stored_it() -> None:
    cache = PromptCache(max_bytes=10_000)
    cache.put([3] * 200, bytes(100), "key-a")
    assert cache.best([3] * 200 + [9], "key-a") is not None
    assert cache.best([3] * 200 + [9], "key-b") is None  # another key's prompt is a miss
    assert cache.best([3] * 200 + [9]) is None
    assert cache.covers([3] * 100, "key-a")
    assert not cache.covers([3] * 100, "key-b")
    cache.put([3] * 300, bytes(100), "key-b")  # extends a-'s tokens, but in another scope: both stay
    assert len(cache.entries) == 2


def test_one_scopes_flood_evicts_its_own_entries_never_anothers() -> None:
    """Once one LRU for every scope: a key's dozen long prompts flushed another key's cached
    prefix, and its own next hits said whether that other key had been busy meanwhile."""
    cache = PromptCache(max_bytes=1000)
    cache.put([1] * 200, bytes(300), "key-a")
    for n in range(12):  # B's flood, each entry as large as A's
        cache.put([100 + n] * 200, bytes(300), "key-b")
    assert cache.used_bytes <= 1000
    assert cache.best([1] * 200 + [9], "key-a") is not None  # A's prefix stays
    assert [k for k in cache.entries if k[0] == "key-b"] == [("key-b", (110 + i,) * 200) for i in range(2)]
    assert cache.stats.evicted == 10
    # A's flood in turn: A, holding the most, gives up its own oldest; B keeps what it held
    # once the two were even (a tie takes from the scope whose entry is least recently used).
    for n in range(2, 8):
        cache.put([n] * 200, bytes(300), "key-a")
    assert cache.best([1] * 200 + [9], "key-a") is None
    assert cache.best([7] * 200 + [9], "key-a") is not None
    assert len([k for k in cache.entries if k[0] == "key-b"]) == 1
    # Each scope's bytes are kept as entries come and go, not recounted at every eviction.
    recount: dict[str, int] = {}
    for (owner, _), state in cache.entries.items():
        recount[owner] = recount.get(owner, 0) + len(state)
    assert cache.held == recount == {"key-a": 600, "key-b": 300}
    assert cache.drop_scopes({"key-b"}) == 1
    assert (cache.held, cache.used_bytes) == ({"key-a": 600}, 600)


# ---- a quantized KV cache ----------------------------------------------------------------------


def test_a_quantized_cache_needs_heads_in_whole_blocks(model: Path) -> None:
    # The tiny model's heads have 16 values; q8_0 stores blocks of 32.
    config = EngineConfig(path=model, slots=1, context_size=256, batch_size=64, threads=1, threads_batch=1)
    with pytest.raises(ModelLoadError, match=r"cache_type_k q8_0 stores blocks of 32 values .* have 16"):
        Engine(replace(config, cache_type_k="q8_0"), name="m")
    with pytest.raises(ModelLoadError, match=r"cache_type_v q4_0"):
        Engine(replace(config, cache_type_v="q4_0"), name="m")


async def test_a_q8_0_cache_generates_and_takes_about_half_the_bytes(tmp_path: Path) -> None:
    wide = write_tiny_model(tmp_path / "wide.gguf", TinyModelSpec(seed=2, n_embd=128, n_head=4))
    config = EngineConfig(
        path=wide,
        slots=1,
        context_size=512,
        batch_size=64,
        threads=1,
        threads_batch=1,
        prompt_cache_bytes=1 << 24,
    )
    prompt = "the cache holds keys and values; " * 8  # long enough to be kept in the prompt cache
    sizes = {}
    texts = {}
    for kind in ("f16", "q8_0"):
        engine = Engine(replace(config, cache_type_k=kind, cache_type_v=kind), name=kind)
        try:
            assert engine.performance()["kv_cache"]["flash_attention"] == ("auto" if kind == "f16" else "on")
            texts[kind], finished = await _generate(engine, prompt, 24)
            assert finished.completion_tokens == 24
            assert engine.prompt_cache is not None
            assert len(engine.prompt_cache.entries) == 1  # the finished sequence's saved state
            sizes[kind] = engine.prompt_cache.used_bytes
        finally:
            engine.close()
    assert texts["q8_0"]  # it decodes; quantized keys and values may pick other tokens
    # 34 bytes per 32 values against 64: the saved state of the same sequence shrinks alike.
    assert 0.45 < sizes["q8_0"] / sizes["f16"] < 0.6, sizes


@given(
    st.integers(0, 1200),
    st.integers(0, 1200),
    st.integers(0, 300),
    st.sampled_from([(list, list), (tuple, list), (list, tuple), (tuple, tuple)]),
)
@example(600, 400, 101, (tuple, list))  # past the first block, a cache key against a prompt
@example(300, 256, 0, (list, list))  # a difference right at a block's start
@example(1200, 1200, 0, (list, tuple))  # one the other's start, over several blocks
def test_common_prefix_is_the_first_difference(
    length: int, cut: int, tail: int, kinds: tuple[type[Any], type[Any]]
) -> None:
    """Compared a block at a time (C speed), the first token that differs, as token by token:
    across block boundaries, and a list against a tuple (the prompt cache's keys are tuples)."""
    a = [(k * 7) % 5 for k in range(length)]
    b = a[: min(cut, length)] + [9] * (tail % 2) + [(k * 3) % 5 for k in range(tail)]
    expected = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    first, second = kinds
    assert common_prefix(first(a), second(b)) == expected
    assert common_prefix(second(b), first(a)) == expected
