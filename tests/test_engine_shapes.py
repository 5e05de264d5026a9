"""Batch shapes: slot choice that keeps busy slots together, and dummy rows up to faster step sizes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, overload

import llama_cpp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellmd.engine import EngineConfig
from edgellmd.engine import scheduler as scheduler_module
from edgellmd.engine.drafts import Speculation
from edgellmd.engine.scheduler import Engine
from edgellmd.engine.shapes import (
    SPLIT_COST_TOKENS,
    StepTimes,
    choose_slot,
    even_rows,
    measure_steps,
    pad_slots,
    padded_sizes,
    plan_rows,
    runs,
)
from tests.test_engine import generate  # greedy, to the end: the text and the Finished event

B, F = True, False  # a busy slot, a free one
T = True  # a slot that may take a dummy row
# Decode step ms by size measured on the demo model (8 slots, 2 cores; engine.shapes).
DEMO_STEPS = [22.1, 46.9, 73.1, 54.5, 78.5, 61.7, 98.6, 70.5]


# ---- the pure rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("busy", "expected"),
    [([], 0), ([F, F], 0), ([B], 1), ([B, B, B], 1), ([B, F, B], 2), ([F, B, F, B, B, F, B], 3)],
)
def test_runs_counts_the_ubatches_of_a_decode_step(busy: list[bool], expected: int) -> None:
    assert runs(busy) == expected


def test_a_new_sequence_fills_the_gap_or_extends_the_run() -> None:
    zeros = [0] * 8
    # Slots 0, 1 and 4 busy: slots 2, 3 and 5 keep two runs, 6 and 7 would make three.
    assert choose_slot([B, B, F, F, B, F, F, F], zeros) == 2
    assert choose_slot([B, B, B, F, F, F, F, F], zeros) == 3  # right after the run
    assert choose_slot([F, F, F, F, F, F, F, B], zeros) == 6  # right before it
    assert choose_slot([F] * 4, zeros[:4]) == 0  # nothing busy: the lowest slot
    with pytest.raises(ValueError, match="no free slot"):
        choose_slot([B, B], [0, 0])


def test_a_longer_prefix_wins_among_slots_that_keep_the_run_and_splits_it_only_past_the_cost() -> None:
    busy = [B, F, F, F, F, F]
    # Slots 1 keeps one run and nothing else does: it wins unless another saves more.
    assert choose_slot(busy, [0, 10, 0, 0, 40, 0]) == 1
    assert choose_slot(busy, [0, 10, 0, 0, 10 + SPLIT_COST_TOKENS, 0]) == 1
    assert choose_slot(busy, [0, 10, 0, 0, 11 + SPLIT_COST_TOKENS, 0]) == 4
    # Nothing busy: every slot keeps one run, the longest prefix wins.
    assert choose_slot([F, F, F], [3, 9, 4]) == 1
    # Two slots keep the run (before and after it): the one with the longer prefix.
    assert choose_slot([F, B, F], [2, 0, 5]) == 2


def test_sizes_pad_to_the_fastest_larger_size_with_a_margin() -> None:
    assert padded_sizes(DEMO_STEPS) == [1, 2, 4, 4, 6, 6, 8, 8]
    # 5% faster is within the noise of a few decodes: not padded.
    assert padded_sizes([10.0, 20.0, 19.0]) == [1, 2, 3]
    assert padded_sizes([10.0, 20.0, 17.0]) == [1, 3, 3]
    # Sizes that cost what their rows cost (a GPU, a tiny model): nothing is padded.
    assert padded_sizes([1.0, 1.1, 1.2, 1.3]) == [1, 2, 3, 4]
    assert padded_sizes([]) == []


def test_dummy_rows_go_next_to_the_one_busy_run() -> None:
    every = [True] * 8
    assert pad_slots([B, B, B, F, F, F, F, F], every, 1) == [3]
    assert pad_slots([F, F, F, F, F, B, B, B], every, 2) == [3, 4]
    assert pad_slots([F, B, B, F], every, 2) == [0, 3]  # after the run, then before it
    assert pad_slots([B, F, B, F], every, 1) is None  # two runs: a row would not fill either
    assert pad_slots([F, F, F, F], every[:4], 1) is None  # nothing busy: nothing to pad
    # A slot that may not take a row stops the search on its side.
    assert pad_slots([B, B, F, F], [F, F, F, T], 1) is None
    assert pad_slots([F, B, B, F], [T, F, F, F], 1) == [0]
    assert pad_slots([B, B, B, F], every[:4], 2) is None  # not enough room


def test_holes_are_filled_when_one_ubatch_is_cheaper_than_the_runs() -> None:
    every = [True] * 8
    # 3 sequences around a hole: 47 + 22 ms as two ubatches, 54 as one of 4.
    assert plan_rows([B, B, F, B, F, F, F, F], every, StepTimes(DEMO_STEPS)) == [2]
    # 7 around a hole: 73 + 54 ms against 70 for all 8.
    assert plan_rows([B, B, B, F, B, B, B, B], every, StepTimes(DEMO_STEPS)) == [3]
    # Two lone sequences: 22 + 22 ms beats 54 for the 4 rows a filled step would take.
    assert plan_rows([B, F, B, F, F, F, F, F], every, StepTimes(DEMO_STEPS)) == []
    # One run: padded at its end as `target` says.
    assert plan_rows([B, B, B, F, F, F, F, F], every, StepTimes(DEMO_STEPS)) == [3]
    assert plan_rows([B, B, B, B, F, F, F, F], every, StepTimes(DEMO_STEPS)) == []
    # A hole that may not take a row, no timings (padding off), nothing present: no rows.
    assert plan_rows([B, B, F, B, F, F, F, F], [F, F, F, F, T, T, T, T], StepTimes(DEMO_STEPS)) == []
    assert plan_rows([B, B, F, B], every[:4], StepTimes([])) == []
    assert plan_rows([F] * 8, every, StepTimes(DEMO_STEPS)) == []


def test_drafting_steps_are_evened_when_the_rows_cost_less_than_the_ubatches_they_save() -> None:
    demo = StepTimes(DEMO_STEPS, row_seconds=2.4)  # ms here: a row without logits, 1-row steps 22
    assert even_rows([9, 1], demo) == 9  # 8 rows (19 ms) save a ubatch (22 ms)
    assert even_rows([5, 1], demo) == 5
    assert even_rows([9, 1, 1, 1], demo) == 0  # 24 rows cost more than one ubatch
    assert even_rows([9, 5, 1], demo) == 9  # 12 rows, two ubatches saved
    assert even_rows([4, 4], demo) == 0  # already one ubatch
    assert even_rows([9, 1], StepTimes(DEMO_STEPS)) == 0  # no row timing: nothing evened
    assert even_rows([9, 1], StepTimes([])) == 0


def test_measure_steps_takes_the_fastest_in_alternating_order_within_its_budget() -> None:
    clock = [0.0]
    calls: list[int] = []
    # Size 1 timed while another process had the cores twice: only its quiet run counts.
    cost = {1: [0.156, 0.013, 0.31], 2: [0.05, 0.09, 0.04], 3: [0.1, 0.1, 0.4]}

    def decode(n: int) -> None:
        clock[0] += cost[n][sum(c == n for c in calls)]
        calls.append(n)

    assert measure_steps(decode, 3, lambda: clock[0]) == pytest.approx([0.013, 0.04, 0.1])
    assert calls == [1, 2, 3, 3, 2, 1, 1, 2, 3]

    # Past the budget: it stops where it is, with the sizes measured from 1 up.
    calls.clear()

    def slow_decode(n: int) -> None:
        clock[0] += 0.8 * n
        calls.append(n)

    assert measure_steps(slow_decode, 8, lambda: clock[0]) == pytest.approx([0.8, 1.6])
    assert calls == [1, 2]  # 2.4 s after two: the third is not started
    calls.clear()
    assert measure_steps(calls.append, 3, lambda: clock[0]) == [0.0, 0.0, 0.0]
    assert len(calls) == 9  # a clock that does not move: every round of every size


def test_step_times_follow_the_steps_served_and_explore_the_unpadded_size() -> None:
    times = StepTimes([0.020, 0.040, 0.060, 0.037])
    assert times.padded() == {3: 4}
    sizes = [times.target(3) for _ in range(2 * StepTimes.EXPLORE_EVERY)]
    # Every EXPLORE_EVERY-th step of size 3 runs unpadded, the others padded to 4.
    assert sizes.count(3) == 2
    assert sizes.count(4) == 2 * StepTimes.EXPLORE_EVERY - 2
    assert sizes[StepTimes.EXPLORE_EVERY - 1] == 3
    assert [times.target(n) for n in (1, 2, 4, 9)] == [1, 2, 4, 9]  # 9: more than it measured
    # The load measured size 4 on a busy machine: the padded steps served say otherwise.
    for _ in range(60):
        times.record(4, 0.100)
    assert times.seconds[3] > 0.09
    assert times.padded() == {}
    assert times.target(3) == 3
    # Size 3 turns slow in its own (explored) steps: padding comes back.
    for _ in range(60):
        times.record(3, 0.200)
    assert times.padded() == {3: 4}
    times.record(0, 1.0)  # sizes it never measured are left alone
    times.record(5, 1.0)
    assert len(times.seconds) == 4
    assert StepTimes([]).target(3) == 3
    assert StepTimes([]).padded() == {}


def _steps_until_unpadded(times: StepTimes, limit: int) -> int:
    """Serve one-row steps (13 ms alone, 26 ms padded to two) until size 1 is no longer padded."""
    for step in range(limit):
        if times.padded().get(1) is None:
            return step
        size = times.target(1)
        times.record(size, 0.013 if size == 1 else 0.026)
    return limit


def test_a_size_a_busy_load_timed_far_too_slow_stops_being_padded_within_a_few_explorations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a load beside three others measured on 2 cores (decode step ms by size 1-5): one
    # row 156 ms, two rows 26 ms. Every one-row step was padded to two, at twice its cost
    # (a dummy row computes the logits of the whole vocabulary too).
    busy_load = [0.156, 0.026, 0.144, 0.277, 2.12]
    times = StepTimes(busy_load, slots=8)
    assert times.seconds[:5] == pytest.approx([0.156, 0.026, 0.144, 0.277, 0.78])  # size 5: 5 x size 1
    assert times.padded().get(1) == 2
    assert _steps_until_unpadded(times, 1000) <= 4 * StepTimes.EXPLORE_EVERY
    assert times.seconds[0] < 0.026
    for _ in range(2 * StepTimes.EXPLORE_EVERY):
        assert times.target(1) == 1
        times.record(1, 0.013)
    assert times.seconds[0] == pytest.approx(0.013, rel=0.01)
    # One step held up by another process (300 ms) counts as twice the figure at most, and
    # by WEIGHT: it does not start padding. A machine that stays busy does move the figure.
    times.record(1, 0.3)
    assert times.seconds[0] == pytest.approx(0.013 * (1 + StepTimes.WEIGHT), rel=0.01)
    assert times.padded().get(1) is None
    for _ in range(30):
        times.record(1, 0.04)
    assert times.seconds[0] > 0.03
    # A size timed at more than that many one-row steps is taken at that many.
    assert StepTimes([0.013, 1.46, 0.144], slots=4).seconds == pytest.approx([0.013, 0.026, 0.039, 0.052])
    # With one weight both ways it took hundreds of steps (a few seconds of every stream).
    monkeypatch.setattr(StepTimes, "FAST_WEIGHT", StepTimes.WEIGHT)
    assert _steps_until_unpadded(StepTimes(busy_load, slots=8), 2000) > 20 * StepTimes.EXPLORE_EVERY


def test_a_partly_measured_table_is_completed_and_the_first_step_served_replaces_an_estimate() -> None:
    # The load ran out of time after sizes 1 and 2 of 8: the rest are estimated, each row as
    # dear as a row of the largest measured step, so nothing pads to them.
    times = StepTimes([0.020, 0.030], slots=8)
    assert len(times.seconds) == 8
    assert times.seconds[2:] == pytest.approx([0.015 * m for m in range(3, 9)])
    assert times.measured == [True, True] + [False] * 6
    assert times.padded() == {}
    assert [times.target(n) for n in range(1, 9)] == list(range(1, 9))
    assert times.at(9) == pytest.approx(0.135)  # past the table too
    assert times.at(0) == float("inf")
    # A real step of size 4 replaces its estimate at once, then averages as measured ones do.
    times.record(4, 0.015)
    assert times.seconds[3] == pytest.approx(0.015)
    assert times.measured[3]
    assert times.padded() == {1: 4, 2: 4, 3: 4}
    times.record(4, 0.025)
    assert times.seconds[3] == pytest.approx(0.015 + StepTimes.WEIGHT * 0.010)
    times.record(4, 0.5)  # counted as twice the figure at most
    assert times.seconds[3] == pytest.approx(0.0155 * (1 + StepTimes.WEIGHT))


def test_the_planner_never_indexes_past_a_table_the_load_cut_short() -> None:
    """The second hostile round: one size of eight measured, then busy slots split by a gap
    (a short reply ended between long ones) crashed the scheduler with an IndexError."""
    short = StepTimes([0.05], slots=8)
    every = [T] * 8
    assert plan_rows([B, F, B, B, F, F, F, F], every, short) == []  # estimates fill no hole
    assert plan_rows([B, F, F, F, F, F, F, B], every, short) == []
    two = StepTimes([0.05, 0.02], slots=8)
    assert plan_rows([B, F, F, F, F, F, F, F], every, two) == [1]  # measured: pads 1 to 2
    # An estimate is pessimistic: a hole is filled when even that beats the runs apart.
    assert plan_rows([B, F, B, F, F, F, F, F], every, two) == [1]
    # An older caller's bare table (no slot count) holds as well.
    assert plan_rows([B, F, B, B, F, F, F, F], every, StepTimes([0.05])) == []


@st.composite
def _plans(draw: st.DrawFn) -> tuple[list[float], int, list[bool], list[bool]]:
    slots = draw(st.integers(1, 12))
    measured = draw(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=slots))
    present = draw(st.lists(st.booleans(), min_size=slots, max_size=slots))
    usable = [not p and draw(st.booleans()) for p in present]
    return measured, slots, present, usable


@settings(max_examples=400, deadline=None)
@given(_plans())
def test_every_partial_table_and_gap_pattern_plans_rows_only_in_free_usable_slots(
    plan: tuple[list[float], int, list[bool], list[bool]],
) -> None:
    measured, slots, present, usable = plan
    times = StepTimes(measured, slots=slots)
    assert len(times.seconds) == slots
    for _ in range(StepTimes.EXPLORE_EVERY + 1):  # padded and exploring steps alike
        rows = plan_rows(present, usable, times)
        assert rows == sorted(set(rows))
        assert all(usable[i] and not present[i] for i in rows)
        if rows:
            filled = [p or i in rows for i, p in enumerate(present)]
            assert runs(filled) == 1  # a planned step is one ubatch
    # Served steps of any size keep the table whole.
    times.record(slots, 0.5)
    times.record(slots + 1, 0.5)
    assert len(times.seconds) == slots


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.floats(0.01, 3.0))
def test_a_load_cut_short_at_any_point_leaves_a_whole_table(slots: int, per_row: float) -> None:
    clock = [0.0]

    def decode(n: int) -> None:
        clock[0] += per_row * n

    measured = measure_steps(decode, slots, lambda: clock[0])
    assert 1 <= len(measured) <= slots
    times = StepTimes(measured, slots=slots)
    assert len(times.seconds) == slots
    assert all(t > 0 for t in times.seconds)


# ---- the engine -------------------------------------------------------------------------------


def make_engine(
    path: Path,
    *,
    slots: int,
    padding: bool = True,
    context: int = 256,
    batch: int = 512,
    spec: Speculation = Speculation(),  # noqa: B008 - a frozen dataclass
) -> Engine:
    config = EngineConfig(
        path=path,
        slots=slots,
        context_size=context,
        batch_size=batch,
        threads=1,
        threads_batch=1,
        batch_padding=padding,
        speculative=spec,
    )
    return Engine(config, name=path.stem)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[list[tuple[int, int, bool]]]]:
    """Every llama_decode batch from now on: (sequence, position, logits wanted) per row."""
    seen: list[list[tuple[int, int, bool]]] = []
    decode = llama_cpp.llama_decode

    def spy(ctx: Any, batch: Any) -> int:
        rows = [(batch.seq_id[k][0], batch.pos[k], bool(batch.logits[k])) for k in range(batch.n_tokens)]
        seen.append(rows)
        return int(decode(ctx, batch))

    def start() -> list[list[tuple[int, int, bool]]]:
        monkeypatch.setattr(llama_cpp, "llama_decode", spy)
        return seen

    return start


PROMPTS = ("Once upon a time", "the quick brown fox", "zzz yy x", "a b c d e f")


async def test_padded_steps_give_the_same_text_and_leave_every_cached_prefix_intact(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    decodes: Callable[[], list[list[tuple[int, int, bool]]]],
) -> None:
    plain = make_engine(tiny_model, slots=4, padding=False)
    try:
        alone = {p: (await generate(plain, p, 24))[0] for p in PROMPTS}
        together = await asyncio.gather(*(generate(plain, p, 24) for p in PROMPTS[:3]))
        unpadded = plain.performance()["batch_padding"]
    finally:
        plain.close()
    assert unpadded == {
        "enabled": False,
        "step_ms": [],
        "step_estimated": [],
        "padded": {},
        "padded_steps": 0,
        "row_ms": 0.0,
        "evened_draft_steps": 0,
    }
    # A machine on which 4 rows decode faster than 1, 2 or 3: every step is padded to 4.
    monkeypatch.setattr(scheduler_module, "measure_steps", lambda decode, slots: [1.0, 1.0, 1.0, 0.5])
    engine = make_engine(tiny_model, slots=4)
    try:
        assert engine.steps.padded() == {1: 4, 2: 4, 3: 4}
        # Slots 1 to 3 get a prefix each, then slot 0 generates alone beside them.
        await asyncio.gather(*(generate(engine, p, 24) for p in PROMPTS))
        seen = decodes()
        solo = await generate(engine, PROMPTS[0], 24)
        padded = [rows for rows in seen if len(rows) == 4 and {s for s, _, _ in rows} == {0, 1, 2, 3}]
        steps = len(seen)
        assert engine.padded_steps >= 20
        assert len(padded) >= 20
        # The dummy rows sit at the end of each slot's cached tokens, every step the same.
        assert {rows[1][1] for rows in padded} == {len(engine.tokenize(PROMPTS[1])) + 23}
        # Slot 1's prefix is still whole: the same prompt reuses all of it.
        reused = engine.prompt_tokens_reused
        again = await generate(engine, PROMPTS[1], 24)
        assert engine.prompt_tokens_reused - reused == len(engine.tokenize(PROMPTS[1])) - 1
        assert again[1].cached_tokens == len(engine.tokenize(PROMPTS[1])) - 1
        mixed = await asyncio.gather(*(generate(engine, p, 24) for p in PROMPTS[:3]))
        shown = engine.performance()["batch_padding"]
    finally:
        engine.close()
    # What /admin/status shows: the step times as they stand, what is padded, how often.
    assert shown["enabled"] is True
    assert len(shown["step_ms"]) == 4
    assert shown["padded_steps"] == engine.padded_steps >= 30
    assert "3" in shown["padded"]
    assert solo[0] == alone[PROMPTS[0]]
    assert again[0] == alone[PROMPTS[1]]
    assert [t for t, _ in mixed] == [t for t, _ in together] == [alone[p] for p in PROMPTS[:3]]
    assert steps >= 24


async def test_a_hole_left_by_a_finished_reply_is_filled_and_keeps_its_prefix(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    decodes: Callable[[], list[list[tuple[int, int, bool]]]],
) -> None:
    plain = make_engine(tiny_model, slots=4, padding=False)
    try:
        alone = {p: (await generate(plain, p, 60))[0] for p in (PROMPTS[0], PROMPTS[2] + " and")}
    finally:
        plain.close()
    # Here one ubatch of 4 rows costs half of one of 1: slots 0 and 2 alone (two ubatches)
    # cost 2, with slots 1 and 3 filled 0.5.
    monkeypatch.setattr(scheduler_module, "measure_steps", lambda decode, slots: [1.0, 1.0, 1.0, 0.5])
    engine = make_engine(tiny_model, slots=4)
    try:
        seen = decodes()
        long_0 = asyncio.create_task(generate(engine, PROMPTS[0], 60))
        await asyncio.sleep(0)
        short_1 = asyncio.create_task(generate(engine, PROMPTS[1], 2))
        await asyncio.sleep(0)
        long_2 = asyncio.create_task(generate(engine, PROMPTS[2] + " and", 60))
        await short_1
        texts = [(await t)[0] for t in (long_0, long_2)]
        reused = engine.prompt_tokens_reused
        again = await generate(engine, PROMPTS[1], 2)
        prompt_1 = len(engine.tokenize(PROMPTS[1]))
    finally:
        engine.close()
    assert texts == [alone[PROMPTS[0]], alone[PROMPTS[2] + " and"]]
    filled = [rows for rows in seen if [s for s, _, _ in rows] == [0, 1, 2, 3]]
    assert not [rows for rows in seen if [s for s, _, _ in rows] == [0, 2]]  # never two ubatches
    # Slot 1's row: its reply's second token, then the dummy row at the end of its cached
    # prompt and reply, every step the same position (it left with each step).
    assert {rows[1][1] for rows in filled} <= {prompt_1, prompt_1 + 1}
    assert sum(rows[1][1] == prompt_1 + 1 for rows in filled) >= 40
    assert engine.prompt_tokens_reused - reused == prompt_1 - 1
    assert again[1].cached_tokens == prompt_1 - 1


async def test_a_gap_after_a_load_that_measured_one_size_does_not_crash_the_scheduler(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second hostile round's reproduction: the load timed one step size of four, then
    requests of 60, 2, 60 and 60 tokens left a gap between busy slots; the planner indexed a
    size that was never measured and the scheduler died."""
    plain = make_engine(tiny_model, slots=4, padding=False)
    try:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2] + " and", PROMPTS[3]]
        alone = [(await generate(plain, p, n))[0] for p, n in zip(prompts, (60, 2, 60, 60), strict=True)]
    finally:
        plain.close()
    monkeypatch.setattr(scheduler_module, "measure_steps", lambda decode, slots: [0.01])
    engine = make_engine(tiny_model, slots=4)
    try:
        assert len(engine.steps.seconds) == 4
        assert engine.performance()["batch_padding"]["step_estimated"] == [2, 3, 4]
        tasks = []
        for prompt, n in zip(prompts, (60, 2, 60, 60), strict=True):
            tasks.append(asyncio.create_task(generate(engine, prompt, n)))
            await asyncio.sleep(0)
        done = await asyncio.gather(*tasks)
        after = await generate(engine, PROMPTS[0], 60)
    finally:
        engine.close()
    assert [f.reason for _, f in done] == ["length"] * 4
    assert [t for t, _ in done] == alone
    assert after[0] == alone[0]


async def test_no_padding_where_it_would_split_the_step_or_outgrow_the_busy_cells(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    decodes: Callable[[], list[list[tuple[int, int, bool]]]],
) -> None:
    monkeypatch.setattr(scheduler_module, "measure_steps", lambda decode, slots: [1.0, 0.5, 0.5])
    engine = make_engine(tiny_model, slots=3, context=1024)
    try:
        assert engine.steps.padded() == {1: 2}
        long_prompt = "a b c d e f g h " * 10
        assert 300 < len(engine.tokenize(long_prompt)) < 900  # more cells than a short reply spans
        await asyncio.gather(generate(engine, "hi", 4), generate(engine, long_prompt, 4))
        seen = decodes()
        before = engine.padded_steps
        # Slot 0 alone: slot 1 holds more than 256 cells, and slot 2 is not next to slot 0.
        await generate(engine, "the quick brown fox", 16)
        assert all({s for s, _, _ in rows} == {0} for rows in seen)
        assert engine.padded_steps == before
    finally:
        engine.close()


async def test_a_request_takes_the_slot_that_keeps_the_busy_ones_together(
    tiny_model: Path, decodes: Callable[[], list[list[tuple[int, int, bool]]]]
) -> None:
    engine = make_engine(tiny_model, slots=4, padding=False)
    try:
        alone = (await generate(engine, PROMPTS[3], 40))[0]
        # Fill slots 0 to 3 (slot 3 ends with PROMPTS[3] cached), then run long replies in
        # slots 0 and 2 around a short one in slot 1.
        await asyncio.gather(*(generate(engine, p, 2) for p in PROMPTS))
        seen = decodes()
        long_0 = asyncio.create_task(generate(engine, PROMPTS[0], 60))
        await asyncio.sleep(0)
        short_1 = asyncio.create_task(generate(engine, PROMPTS[1] + " and", 2))
        await asyncio.sleep(0)
        long_2 = asyncio.create_task(generate(engine, PROMPTS[2] + " and", 60))
        await short_1
        # Slot 3 holds this prompt's prefix, slot 1 keeps slots 0 to 2 one run: slot 1 wins.
        late = await generate(engine, PROMPTS[3], 40)
        await asyncio.gather(long_0, long_2)
    finally:
        engine.close()
    assert late[0] == alone
    rows_late = [rows for rows in seen if len({s for s, _, _ in rows}) == 3]
    assert rows_late, "the late request never decoded beside the two long ones"
    assert all({s for s, _, _ in rows} == {0, 1, 2} for rows in rows_late)


async def test_more_slots_than_batch_size_still_gives_every_slot_its_row(tiny_model: Path) -> None:
    # batch_size 2 with 4 slots: the load times steps of 4 rows and each step holds 4.
    small = make_engine(tiny_model, slots=4, batch=2)
    try:
        assert len(small.steps.seconds) == 4
        texts = [t for t, _ in await asyncio.gather(*(generate(small, p, 16) for p in PROMPTS))]
        alone = [(await generate(small, p, 16))[0] for p in PROMPTS]
    finally:
        small.close()
    assert texts == alone


async def test_dummy_rows_follow_the_cache_after_a_failed_decode(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decode that fails leaves tokens noted for a slot that its cache never got. Dummy rows
    # take their positions from the cache itself, and padded steps go on serving after it.
    plain = make_engine(tiny_model, slots=4, padding=False)
    try:
        alone = (await generate(plain, PROMPTS[2], 24))[0]
    finally:
        plain.close()
    monkeypatch.setattr(scheduler_module, "measure_steps", lambda decode, slots: [1.0, 1.0, 1.0, 0.5])
    engine = make_engine(tiny_model, slots=4)
    decode = llama_cpp.llama_decode
    calls = [0]

    def fail_the_sixth(ctx: Any, batch: Any) -> int:
        calls[0] += 1
        return -1 if calls[0] == 6 else int(decode(ctx, batch))

    try:
        monkeypatch.setattr(llama_cpp, "llama_decode", fail_the_sixth)
        failed = await asyncio.gather(generate(engine, PROMPTS[0], 24), generate(engine, PROMPTS[1], 24))
        monkeypatch.setattr(llama_cpp, "llama_decode", decode)
        before = engine.padded_steps
        after = await generate(engine, PROMPTS[2], 24)
    finally:
        engine.close()
    assert [f.reason for _, f in failed] == ["error", "error"]
    assert after[1].reason == "length"
    assert after[0] == alone
    assert engine.padded_steps - before >= 20


async def test_evened_drafting_steps_give_plain_decodings_text(
    tiny_model: Path, decodes: Callable[[], list[list[tuple[int, int, bool]]]]
) -> None:
    prompts = ["abcabcabcabc the quick brown fox jumps over the lazy dog " * 2, "0101010101010101"]

    plain = make_engine(tiny_model, slots=2, context=1024)
    try:
        expected = [t for t, _ in await asyncio.gather(*(generate(plain, p, 48) for p in prompts))]
    finally:
        plain.close()
    ngram = Speculation(mode="ngram", max_draft=6, max_sequences=2)
    drafting = make_engine(tiny_model, slots=2, context=1024, spec=ngram)
    # Rows without logits cheap, a 1-row step dear: every uneven drafting step is evened.
    drafting.steps = StepTimes([1.0, 1.0], row_seconds=0.001)
    try:
        seen = decodes()
        texts = [t for t, _ in await asyncio.gather(*(generate(drafting, p, 48) for p in prompts))]
        evened = drafting.evened_steps
        again = [(await generate(drafting, p, 48))[0] for p in prompts]
    finally:
        drafting.close()
    assert texts == expected
    assert again == expected
    assert evened >= 1
    # An evened step: both sequences with the same row count, the extra rows without logits.
    even = [rows for rows in seen if {s for s, _, _ in rows} == {0, 1} and len(rows) > 2]
    assert any(sum(s == 0 for s, _, _ in rows) == sum(s == 1 for s, _, _ in rows) for rows in even)


class Drifting(Sequence[float]):
    """Step figures that the engine thread moves while another thread reads them: each read of
    an element returns a figure 5% above the last one read."""

    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.reads = 0

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[float]: ...
    def __getitem__(self, i: int | slice) -> float | Sequence[float]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        self.reads += 1
        return self.values[i] * 1.05**self.reads


def test_the_padded_sizes_are_read_from_one_copy_of_figures_that_move() -> None:
    """/admin/status asks for the padded sizes while the engine thread updates the step times:
    a figure that rose between two reads once raised StopIteration there (an HTTP 500)."""
    table = [22.0, 47.0, 73.0, 54.0, 79.0, 62.0, 99.0, 70.0]
    assert padded_sizes(Drifting(table)) == padded_sizes(table)
    times = StepTimes(table)
    times.seconds = Drifting(table)  # type: ignore[assignment]
    assert times.padded() == {3: 4, 5: 6, 7: 8}
