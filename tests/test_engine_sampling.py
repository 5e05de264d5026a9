"""The grammar-miss resample's candidate pools: the k best tokens, found cheaply."""

from __future__ import annotations

import numpy as np
import pytest

from edgellmd.engine.sampling import PEAK_SPREADS, _best


def _reference(scores: np.ndarray, k: int) -> set[int]:
    return {int(t) for t in np.argsort(-scores, kind="stable")[:k]}


@pytest.mark.parametrize("k", [1, 64, 4096])
@pytest.mark.parametrize(
    "shape",
    [
        "sharp",  # a few tokens near the peak: the first spread rarely holds k
        "normal",  # logits of a typical model: thousands within a few units of the peak
        "flat",  # everything within the first spread
        "spiked",  # one token far above all others: no spread holds k, the full partition does
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
        scores[12345] = 10.0 + 2 * PEAK_SPREADS[-1]
    scores = np.unique(scores)[:n]  # distinct values: the k best are one set
    rng.shuffle(scores)
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
