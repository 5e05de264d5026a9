"""Batch shapes: which slots a request takes, and how many rows a decode step computes.

A request takes the free slot that keeps the busy ones in one run of sequence ids (one
ubatch), a step gets dummy rows up to a size the kernels decode faster, and drafting rows
are evened into one ubatch; the step sizes are timed at load and kept current. Why, with
the figures: docs/internals.md, "Batch shapes".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Final

# A free slot that splits the busy run must save this many more prompt tokens than the best
# slot that does not. A split costs one more read of every weight per step for as long as it
# lasts (about a decode step's time, 20 ms on the demo model), a prompt token about 1 ms of
# prefill on the same box: 256 tokens buy about a dozen split steps.
SPLIT_COST_TOKENS: Final = 256
# A size is padded to a larger one only when that one measured at least this much faster:
# the timings come from a few decodes on a machine that may be busy.
PAD_MARGIN: Final = 0.9
NEAR_BEST: Final = 1.03  # sizes within 3% of the fastest count as fast: the fewest dummy rows win
MEASURE_ROUNDS: Final = 3  # decodes of each size; the fastest counts (a busy machine only adds time)
MEASURE_BUDGET_S: Final = 2.0  # timing stops after this long, with the sizes done (a big model on a CPU)


def busy_runs(busy: Sequence[bool]) -> list[list[int]]:
    """The runs of consecutive busy slots, each as its slot indices (a decode step's ubatches)."""
    out: list[list[int]] = []
    for i, b in enumerate(busy):
        if b:
            if out and out[-1][-1] == i - 1:
                out[-1].append(i)
            else:
                out.append([i])
    return out


def runs(busy: Sequence[bool]) -> int:
    """How many runs of consecutive busy slots there are (the ubatches a decode step takes)."""
    return len(busy_runs(busy))


def choose_slot(busy: Sequence[bool], reuse: Sequence[int], held: Sequence[int] | None = None) -> int:
    """The free slot a new sequence takes, given each slot's reusable prefix length.

    The slot that keeps the fewest runs of busy slots, the longest reusable prefix among
    those, then the one holding the fewest cached tokens (`held`: what taking it throws
    away, another request's prefix), the lowest index among equals; another slot wins only
    when its prefix saves more than `SPLIT_COST_TOKENS` further tokens.
    """
    kept = held if held is not None else [0] * len(busy)
    free = [i for i, b in enumerate(busy) if not b]
    if not free:
        raise ValueError("no free slot")

    def runs_with(i: int) -> int:
        return runs([b or j == i for j, b in enumerate(busy)])

    split = {i: runs_with(i) for i in free}
    fewest = min(split.values())
    packed = max((i for i in free if split[i] == fewest), key=lambda i: (reuse[i], -kept[i], -i))
    longest = max(free, key=lambda i: (reuse[i], -split[i], -kept[i], -i))
    return longest if reuse[longest] - reuse[packed] > SPLIT_COST_TOKENS else packed


def padded_size(step_s: Sequence[float], n: int, margin: float = PAD_MARGIN) -> int:
    """The size to pad a step of size n to: n, or the smallest larger size whose step time
    (index size - 1) is within `NEAR_BEST` of the least, when that is below `margin` times
    that of n (fewer dummy rows where sizes cost about the same)."""
    times = list(step_s)  # one reading: the engine thread updates the figures as it serves
    least = min(times[n - 1 :])
    best = next(m for m in range(n, len(times) + 1) if times[m - 1] <= least * NEAR_BEST)
    return best if times[best - 1] < margin * times[n - 1] else n


def padded_sizes(step_s: Sequence[float], margin: float = PAD_MARGIN) -> list[int]:
    """`padded_size` of every size from 1 to len(step_s)."""
    return [padded_size(step_s, n, margin) for n in range(1, len(step_s) + 1)]


class StepTimes:
    """Decode step seconds by size: measured at load, then kept current by the steps served.

    The table is complete by construction: it holds a figure for every size from 1 to
    `slots`, whatever the load had time to measure (`estimate`), and `at` answers for any
    size. A load can be timed on a busy machine (another model loading or decoding, the old
    version still serving during a reload), so the figures it measured are only where the
    engine starts: every decode-only step moves its size's figure (an exponential average;
    the first step of a size that was only estimated replaces the estimate), and every
    `EXPLORE_EVERY`-th step of a size that is padded runs unpadded, so that the size's own
    figure stays current too. A busy machine only ever makes a step slower, so a step faster
    than its figure moves it by `FAST_WEIGHT`, a slower one by `WEIGHT` (and as if it took
    at most twice the figure: one step held up for a scheduler tick is an outlier, a machine
    that stays busy still moves the figure up within a dozen steps): a size timed at ten
    times its cost by a busy load is padded for a few explorations, not hundreds.
    A padded size that is not faster after all shows it in its own figure within a few
    dozen steps, and padding to it stops.
    """

    EXPLORE_EVERY: Final = 16
    WEIGHT: Final = 0.05  # of each new step in its size's average, when slower than the figure
    FAST_WEIGHT: Final = 0.5  # when faster: the figure was too high (a busy machine adds, never takes)

    def __init__(self, measured: Sequence[float], row_seconds: float = 0.0, *, slots: int = 0) -> None:
        given = list(measured)
        self.seconds = estimate(given, max(slots, len(given)))
        self.measured = [True] * len(given) + [False] * (len(self.seconds) - len(given))
        self.row_seconds = row_seconds  # one more row without logits in a step (measured at load)
        self._steps = [0] * len(self.seconds)

    def at(self, size: int) -> float:
        """The figure for a step of `size` rows (estimated past the table; inf for none)."""
        times = self.seconds
        if not times or size < 1:
            return math.inf
        if size <= len(times):
            return times[size - 1]
        return times[-1] * size / len(times)

    def target(self, n: int) -> int:
        """The size a decode step of `n` sequences should have (n itself most of the time)."""
        if n > len(self.seconds) or n < 1:
            return n
        self._steps[n - 1] += 1
        size = padded_size(self.seconds, n)
        if size != n and self._steps[n - 1] % self.EXPLORE_EVERY == 0:
            return n
        return size

    def record(self, size: int, seconds: float) -> None:
        """One decode-only step of `size` rows took `seconds`."""
        if 0 < size <= len(self.seconds):
            if self.measured[size - 1]:
                figure = self.seconds[size - 1]
                gap = seconds - figure
                # A step held up by another process counts as at most twice its figure.
                self.seconds[size - 1] += (
                    self.WEIGHT * min(gap, figure) if gap > 0 else self.FAST_WEIGHT * gap
                )
            else:
                self.seconds[size - 1] = seconds
                self.measured[size - 1] = True

    def padded(self) -> dict[int, int]:
        """Each size that is padded now, and to what (any thread: from one copy of the figures,
        which the engine thread keeps changing)."""
        return {n: m for n, m in enumerate(padded_sizes(list(self.seconds)), 1) if m != n}


def estimate(measured: Sequence[float], slots: int) -> list[float]:
    """`measured` (sizes 1 to k) extended to `slots` sizes: size m > k costs m / k times size k.

    That assumes batching gains nothing past what was measured: an estimated size is never
    faster than the largest measured one, so padding never targets it. For the same reason
    no measured size m is taken to cost more than m steps of one row: a figure above that
    was timed while something else had the cores.
    """
    out = [min(t, m * measured[0]) for m, t in enumerate(measured, 1)]
    if not out:
        return out
    k, last = len(out), out[-1]
    out += [last * m / k for m in range(k + 1, slots + 1)]
    return out


def pad_slots(busy: Sequence[bool], usable: Sequence[bool], count: int) -> list[int] | None:
    """`count` free, usable slots right after (then right before) the one run of busy slots.

    None when the busy slots are not one run or there are not enough such slots next to it:
    a dummy row anywhere else would split the step instead of filling it.
    """
    found = busy_runs(busy)
    if len(found) != 1 or count <= 0:
        return None
    first, last = found[0][0], found[0][-1]
    chosen: list[int] = []
    for i in range(last + 1, len(busy)):
        if len(chosen) == count or not usable[i]:
            break
        chosen.append(i)
    for i in range(first - 1, -1, -1):
        if len(chosen) == count or not usable[i]:
            break
        chosen.append(i)
    return sorted(chosen) if len(chosen) == count else None


def plan_rows(present: Sequence[bool], usable: Sequence[bool], times: StepTimes) -> list[int]:
    """The free slots that get a dummy row in a decode step of the `present` sequences.

    Holes between present sequences come first: filled, the step is one ubatch instead of
    one per run, and it is filled when its size's step time is below the runs' together (two
    lone sequences decode faster as two ubatches of one row than as one of three on some
    machines). Then rows at the ends of the run, up to the size `times` says is faster.
    None of it when a slot that would need a row may not take one.
    """
    found = busy_runs(present)
    if not found or not times.seconds:
        return []
    n = sum(len(run) for run in found)
    holes = [i for i in range(found[0][0], found[-1][-1] + 1) if not present[i]]
    if not all(usable[i] for i in holes):
        return []
    filled = [p or i in holes for i, p in enumerate(present)]
    size = times.target(n + len(holes))
    extra = pad_slots(filled, usable, size - n - len(holes)) or []
    if holes:
        split = sum(times.at(len(run)) for run in found)
        if times.at(n + len(holes) + len(extra)) >= split:
            return []
    return sorted(holes + extra)


def even_rows(counts: Sequence[int], times: StepTimes) -> int:
    """The row count to give every sequence of a step whose sequences hold `counts` rows
    (a token and its draft), or 0 to leave them as they are.

    llama.cpp's split gives each ubatch the same number of rows per sequence, so a step of
    counts 9 and 1 decodes as two ubatches: one of a row each, one of the other 8. Rows
    without logits that bring every sequence to the largest count make it one ubatch; they
    are worth it when they cost less than the ubatches they save (each about a 1-row step).
    Measured on the demo model: counts 9 and 1, 97 ms a step as they are and 88 ms even.
    """
    if not times.seconds or times.row_seconds <= 0 or len(set(counts)) < 2:
        return 0
    most = max(counts)
    rows = sum(most - c for c in counts)
    saved = len(set(counts)) - 1
    return most if rows * times.row_seconds < PAD_MARGIN * saved * times.seconds[0] else 0


def measure_steps(
    decode: Callable[[int], object], slots: int, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Seconds of one decode step of each size from 1 (index n - 1): the fastest of up to
    `MEASURE_ROUNDS` rounds, alternately up and down the sizes so that a trend in the machine
    spreads over all of them. The fastest, not the median: another process on the cores (a
    second model loading, llama.cpp's threads of another engine) only ever adds time, and one
    size timed too slow pads every step of that size to a larger one. Past `MEASURE_BUDGET_S`
    it stops, with the sizes measured so far from 1 up (at least 1): a big model on a CPU
    measures only its smaller sizes, and `StepTimes` estimates the others."""
    times: list[list[float]] = [[] for _ in range(slots)]
    started = clock()
    for round_ in range(MEASURE_ROUNDS):
        sizes = range(1, slots + 1) if round_ % 2 == 0 else range(slots, 0, -1)
        for n in sizes:
            if times[0] and clock() - started > MEASURE_BUDGET_S:
                return _fastest(times)
            t0 = clock()
            decode(n)
            times[n - 1].append(clock() - t0)
    return _fastest(times)


def _fastest(times: Sequence[Sequence[float]]) -> list[float]:
    """The least of each size's timings, for the sizes from 1 up that have any."""
    out: list[float] = []
    for t in times:
        if not t:
            break
        out.append(min(t))
    return out
