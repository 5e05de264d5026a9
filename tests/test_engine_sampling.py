"""The grammar-miss resample's candidate pools: the k best tokens, found cheaply."""

from __future__ import annotations

import numpy as np
import pytest

from edgellmd.engine.sampling import THRESHOLD_SAMPLE, _best


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
