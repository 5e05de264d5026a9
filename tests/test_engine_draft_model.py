"""Speculative decoding with a draft model on the real engine: the text is exactly plain decoding's."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgellmd.engine import EngineConfig, ModelLoadError
from edgellmd.engine.drafts import Speculation
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.engine.scheduler import Engine
from tests.ggufmodels import TinyModelSpec, write_tiny_model

TARGET = TinyModelSpec(seed=5)
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "abcabcabcabc the quick brown fox jumps over the lazy dog " * 2,
    "hello world",
    "0101010101010101",
    "repeat repeat repeat repeat repeat",
    '{"name": "a", "name": "b", "name": "c", "name": "',
    "hello there",  # shares its start with an earlier prompt: the draft's KV prefix is reused
]
ABAB = 'root ::= ("ab")+ "." '


def _draft(path: Path, *, p_min: float = 0.0, max_draft: int = 6, max_sequences: int = 8) -> Speculation:
    return Speculation(
        mode="draft",
        max_draft=max_draft,
        max_sequences=max_sequences,
        draft_path=path,
        draft_name=path.stem,
        draft_p_min=p_min,
    )


NO_DRAFTS = Speculation()


def _engine(model: Path, spec: Speculation = NO_DRAFTS, *, slots: int = 4, context: int = 512) -> Engine:
    return Engine(
        EngineConfig(
            path=model,
            slots=slots,
            context_size=context,
            batch_size=256,
            threads=1,
            threads_batch=1,
            speculative=spec,
        ),
        name="m",
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-model")
    return {
        "target": write_tiny_model(root / "target.gguf", TARGET),
        "same": write_tiny_model(root / "same.gguf", TARGET),  # the target's twin: drafts what it says
        "other": write_tiny_model(root / "other.gguf", TinyModelSpec(seed=9, n_layer=1)),  # disagrees a lot
        "bigger": write_tiny_model(root / "bigger.gguf", TinyModelSpec(seed=7, n_layer=3)),
        "alien": write_tiny_model(root / "alien.gguf", TinyModelSpec(seed=9, control_tokens=("<|x|>",))),
        # The same size of vocabulary as each other, and one token that is not the same.
        "marked": write_tiny_model(root / "marked.gguf", TinyModelSpec(seed=5, control_tokens=("<|a|>",))),
        "remarked": write_tiny_model(
            root / "remarked.gguf", TinyModelSpec(seed=9, control_tokens=("<|b|>",))
        ),
    }


@pytest.fixture(scope="module")
def plain(models: dict[str, Path]) -> Iterator[Engine]:
    engine = _engine(models["target"])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def twin(models: dict[str, Path]) -> Iterator[Engine]:
    engine = _engine(models["target"], _draft(models["same"]))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def wrong(models: dict[str, Path]) -> Iterator[Engine]:
    """A draft that is mostly wrong, drafting whatever its confidence: many rejections."""
    engine = _engine(models["target"], _draft(models["other"]))
    yield engine
    engine.close()


async def _generate(
    engine: Engine, prompt: str, max_tokens: int = 48, sampling: SamplingParams = GREEDY
) -> tuple[str, str, int]:
    """The reply's text, finish reason and token count (the draft counters differ by design)."""
    gen = engine.submit(
        GenerationRequest(engine.tokenize(prompt), max_tokens, sampling, ignore_eos=sampling.grammar is None),
        asyncio.get_running_loop(),
    )
    parts = []
    async for event in gen.events():
        parts.append(event.text)
        if isinstance(event, Finished):
            assert event.error is None, event
            return "".join(parts), event.reason, event.completion_tokens
    raise AssertionError("no Finished event")


@pytest.mark.parametrize("draft", ["twin", "wrong"])
async def test_greedy_text_with_a_draft_model_is_plain_decodings(
    plain: Engine, draft: str, request: pytest.FixtureRequest
) -> None:
    engine: Engine = request.getfixturevalue(draft)
    drafted = engine.drafted_tokens
    for prompt in PROMPTS:
        assert await _generate(engine, prompt) == await _generate(plain, prompt), prompt
    assert engine.drafted_tokens - drafted > len(PROMPTS) * 10  # it drafted all along


async def test_several_streams_at_once_with_grammars_among_them(
    plain: Engine, twin: Engine, wrong: Engine
) -> None:
    cases = [(p, GREEDY) for p in PROMPTS[:3]]
    cases.append(("ab", SamplingParams(temperature=0.0, grammar=ABAB)))
    cases.append(("ab ab ab", SamplingParams(temperature=0.0, grammar=ABAB)))
    expected = [await _generate(plain, p, sampling=s) for p, s in cases]
    accepted = twin.accepted_tokens
    for engine in (twin, wrong):
        drafted = engine.drafted_tokens
        got = await asyncio.gather(*(_generate(engine, p, sampling=s) for p, s in cases))
        assert list(got) == expected
        assert engine.drafted_tokens > drafted
    assert twin.accepted_tokens > accepted  # the twin's drafts are right


async def test_drafting_that_pauses_while_the_batch_is_full_resumes_exactly(
    models: dict[str, Path], plain: Engine
) -> None:
    # max_sequences 2 with five streams: no drafts while more than two decode, drafts again
    # once streams end; the draft's KV catches up with what it missed.
    engine = _engine(models["target"], _draft(models["same"], max_sequences=2), slots=5)
    try:
        lengths = [8, 16, 24, 40, 64]
        expected = [await _generate(plain, p, n) for p, n in zip(PROMPTS, lengths, strict=False)]
        got = await asyncio.gather(*(_generate(engine, p, n) for p, n in zip(PROMPTS, lengths, strict=False)))
        assert list(got) == expected
        assert engine.accepted_tokens > 0
    finally:
        engine.close()


async def test_a_draft_identical_to_the_model_gets_nearly_every_draft_accepted(twin: Engine) -> None:
    drafted, accepted = twin.drafted_tokens, twin.accepted_tokens
    await _generate(twin, PROMPTS[0], 96)
    await _generate(twin, "something else entirely", 96)
    drafted, accepted = twin.drafted_tokens - drafted, twin.accepted_tokens - accepted
    assert drafted > 100
    assert accepted >= 0.95 * drafted, (accepted, drafted)


async def test_a_draft_that_is_always_wrong_soon_stops_costing(wrong: Engine, plain: Engine) -> None:
    # Drafting whatever its confidence, the other model is nearly always rejected: each
    # sequence backs off (pauses growing after every run of rejections), so a long reply
    # checks a fraction of the drafts it would at one draft per step, and stays plain's.
    drafted, accepted = wrong.drafted_tokens, wrong.accepted_tokens
    result = await _generate(wrong, PROMPTS[1], 240)
    drafted, accepted = wrong.drafted_tokens - drafted, wrong.accepted_tokens - accepted
    assert result == await _generate(plain, PROMPTS[1], 240)
    assert accepted <= 0.1 * drafted  # the premise: nearly every draft is wrong
    assert 0 < drafted <= 60, drafted  # one per step would be about 240


async def test_a_confident_draft_only_drafts_where_it_is_sure(models: dict[str, Path], plain: Engine) -> None:
    """With llama.cpp's default draft_p_min the mostly wrong draft drafts less, and still changes nothing."""
    sure = _engine(models["target"], _draft(models["other"], p_min=0.75))
    try:
        for prompt in PROMPTS[:3]:
            assert await _generate(sure, prompt) == await _generate(plain, prompt)
        assert sure.drafted_tokens < 3 * 48 * 6
    finally:
        sure.close()


async def test_seeded_sampling_gives_plain_decodings_distribution(plain: Engine, wrong: Engine) -> None:
    """Each position is sampled from the model's own logits with the request's own chain and
    random state, so a seed gives the same reply with or without drafts. Bounds with margin
    all the same: a build whose batched logits round differently may flip a rare sample."""

    async def replies(engine: Engine) -> list[str]:
        out = []
        for seed in range(100):
            sampling = SamplingParams(temperature=1.0, seed=seed, top_k=8)
            text, _, _ = await _generate(engine, "0101 0101 0101", 6, sampling)
            out.append(text)
        return out

    with_drafts, without = await replies(wrong), await replies(plain)
    same = sum(a == b for a, b in zip(with_drafts, without, strict=True))
    assert same >= 90, same  # every one, as built here
    firsts = collections.Counter(t[:1] for t in with_drafts), collections.Counter(t[:1] for t in without)
    distance = sum(abs(firsts[0][k] - firsts[1][k]) for k in firsts[0].keys() | firsts[1].keys()) / 200
    assert distance <= 0.1, firsts
    assert len(set(without)) > 10  # the sampler really varies
    for seed in range(4):  # and under a grammar
        sampling = SamplingParams(temperature=1.0, seed=seed, top_k=8, grammar=ABAB)
        assert await _generate(wrong, "ab", 24, sampling) == await _generate(plain, "ab", 24, sampling)


async def test_max_draft_64_in_a_tiny_context_stops_at_the_context(models: dict[str, Path]) -> None:
    small = _engine(models["target"], context=64, slots=2)
    drafting = _engine(models["target"], _draft(models["same"], max_draft=64), context=64, slots=2)
    try:
        for prompt in ("hi", PROMPTS[3]):  # 36 tokens: the reply fills the other 28
            got = await _generate(drafting, prompt, 200)
            assert got == await _generate(small, prompt, 200)
            assert got[1] == "length"
            assert len(small.tokenize(prompt)) + got[2] <= 64
        assert drafting.accepted_tokens > 0
    finally:
        small.close()
        drafting.close()


def test_performance_names_the_draft_model(twin: Engine, plain: Engine) -> None:
    speculative = twin.performance()["speculative"]
    assert (speculative["mode"], speculative["draft_model"]) == ("draft", "same")
    assert speculative["drafted_tokens"] >= speculative["accepted_tokens"] > 0
    assert "draft_model" not in plain.performance()["speculative"]


async def test_a_draft_larger_than_the_model_still_works_with_a_warning(
    models: dict[str, Path], plain: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="edgellmd.engine.draft_model"):
        engine = _engine(models["target"], _draft(models["bigger"]))
    try:
        assert any("is not smaller than the model it drafts for" in r.getMessage() for r in caplog.records)
        assert await _generate(engine, PROMPTS[1]) == await _generate(plain, PROMPTS[1])
    finally:
        engine.close()
    assert engine._draft is None  # freed with the model


def test_a_draft_of_another_vocabulary_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"^draft model alien: cannot draft for this model: its vocabulary has 260 tokens",
    ):
        _engine(models["target"], _draft(models["alien"]))
    with pytest.raises(ModelLoadError, match=r"^draft model remarked: .* the text of token 259 differs"):
        _engine(models["marked"], _draft(models["remarked"]))


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "truncated", "not-gguf"])
def test_a_draft_file_that_cannot_load_is_refused_with_its_reason(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "bad.gguf"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "truncated":
        data = models["same"].read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "not-gguf":
        path.write_bytes(b"GGUF" + b"\0" * 64)
    reason = {
        "missing": "model file not found",
        "directory": "is not a regular file",
        "fifo": "is not a regular file",
        "truncated": "could not load",
        "not-gguf": "could not load",
    }[kind]
    with pytest.raises(ModelLoadError, match=rf"^draft model bad: .*{reason}"):
        _engine(models["target"], _draft(path), slots=1, context=64)
