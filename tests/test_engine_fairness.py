"""Fair share between keys: the queue's order (class, then weighted virtual time, then arrival),
whom a waiting request may pause, and the scheduler doing both on the real engine: a paused
sequence resumes where it left off, to the token, and a flooding key cannot keep another's
request out of the slots."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edgellmd.engine import EngineConfig
from edgellmd.engine.fairness import (
    IDLE_KEEP_S,
    IDLE_KEPT,
    IDLE_LEAD,
    QUANTUM_S,
    FairQueue,
    Running,
    Share,
    victim,
)
from edgellmd.engine.generation import Finished, Generation, GenerationRequest, SamplingParams, TextDelta
from edgellmd.engine.scheduler import FIRST_TOKEN_ALONE, Engine
from edgellmd.engine.wire import decode_event, decode_request, encode_event, encode_request
from tests.ggufmodels import TinyModelSpec, write_tiny_model

GREEDY = SamplingParams(temperature=0.0)
BATCH = Share("a", 1, -1)
INTERACTIVE = Share("b", 1, 1)


@dataclass(eq=False)
class Entry:
    name: str
    share: Share


def queue() -> FairQueue[Entry]:
    return FairQueue(lambda e: e.share)


def test_one_tenant_is_served_in_arrival_order() -> None:
    q = queue()
    entries = [Entry(f"a{i}", Share("a")) for i in range(4)]
    for e in entries:
        q.append(e)
    assert [q.pop().name for _ in range(4)] == ["a0", "a1", "a2", "a3"]
    assert not q
    with pytest.raises(IndexError):
        q.pop()


def test_a_newcomer_goes_before_a_flooding_tenants_backlog() -> None:
    q = queue()
    for i in range(50):
        q.append(Entry(f"a{i}", Share("a")))
    first = q.pop()
    q.started(first)
    q.charge(first.share, 400)  # a's prompt was computed
    q.append(Entry("b0", Share("b")))
    assert q.pop().name == "b0"  # ahead of a's 49 others


def test_a_tenant_holding_slots_waits_behind_one_holding_none_at_equal_virtual_time() -> None:
    q = queue()
    a0, a1, b0 = Entry("a0", Share("a")), Entry("a1", Share("a")), Entry("b0", Share("b"))
    for e in (a0, a1, b0):
        q.append(e)
    assert q.pop() is a0
    q.started(a0)
    assert q.pop() is b0  # nothing charged yet: the slots held decide


def test_weights_divide_the_virtual_time() -> None:
    q = queue()
    heavy, light = Share("heavy", 3), Share("light", 1)
    for i in range(3):
        q.append(Entry(f"h{i}", heavy))
        q.append(Entry(f"l{i}", light))
    order = []
    for _ in range(6):
        e = q.pop()
        order.append(e.name[0])
        q.started(e)
        q.charge(e.share, 300)
    # heavy's 300 tokens count as 100: it gets three turns before light's second.
    assert order[:4] == ["h", "l", "h", "h"]
    assert q.vtime["heavy"] == pytest.approx(300.0)
    assert q.vtime["light"] == pytest.approx(900.0)


def test_a_higher_class_goes_first_whatever_the_virtual_time() -> None:
    q = queue()
    q.append(Entry("a0", BATCH))
    q.charge(INTERACTIVE, 10)  # b is not active yet: nothing to charge
    q.append(Entry("b0", INTERACTIVE))
    q.charge(INTERACTIVE, 10_000)
    assert q.vtime["b"] == pytest.approx(10_000)
    assert q.pop().name == "b0"
    # Within one tenant as well: its interactive request before its earlier batch one.
    q = queue()
    q.append(Entry("x-batch", Share("x", 1, -1)))
    q.append(Entry("x-now", Share("x", 1, 1)))
    assert [q.pop().name for _ in range(2)] == ["x-now", "x-batch"]


def test_idleness_banks_no_credit() -> None:
    q = queue()
    a, b = Share("a"), Share("b")
    busy = Entry("a0", a)
    q.append(busy)
    q.started(q.pop())
    q.charge(a, 5000)
    # b arrives now: it starts at the least active virtual time, not at zero.
    q.append(Entry("b0", b))
    assert q.vtime["b"] == pytest.approx(5000)
    q.started(q.pop())
    q.stopped(busy, done=True)
    assert "a" not in q.vtime  # a is gone: nothing waits or runs for it
    q.charge(b, 100)
    q.append(Entry("a1", a))
    assert q.vtime["a"] == pytest.approx(5100)  # back at the least active: b's


def test_a_tenant_idle_between_its_requests_keeps_what_it_is_ahead() -> None:
    """A tenant that sends its requests one after another is idle between each: it started again
    at the least virtual time each time, every request a newcomer's, and the scheduler let each
    stop another's step and go alone ahead of its decodes. It comes back at its own virtual
    time where that is more (at the least where that is more); once nothing at all waits or
    runs, nobody is ahead of anyone."""
    q = queue()
    a, b = Share("a"), Share("b")
    a_run = Entry("a0", a)
    q.append(a_run)
    q.started(q.pop())
    q.charge(a, 10)
    for round_ in range(3):
        b_req = Entry(f"b{round_}", b)
        q.append(b_req)
        q.started(q.pop())
        q.charge(b, 50)
        q.stopped(b_req, done=True)
        assert "b" not in q.vtime
        q.charge(a, 1)
    b_last = Entry("b-last", b)
    q.append(b_last)
    assert q.vtime["b"] == pytest.approx(12 + IDLE_LEAD)  # its own, ahead of a's 13 (by at most IDLE_LEAD)
    assert q.ahead(b, [a])
    assert not q.ahead(a, [b])
    assert not q.ahead(Share("b", 1, 1), [a])  # never ahead of a lower class
    assert not q.ahead(b, [b])
    q.started(q.pop())
    q.stopped(b_last, done=True)
    q.charge(a, 1000)  # a passes it: it comes back at the least again
    b_again = Entry("b-again", b)
    q.append(b_again)
    assert q.vtime["b"] == pytest.approx(1013)
    q.remove(b_again)
    q.dropped(b_again)
    q.charge(a, 5)
    q.stopped(a_run, done=True)  # nothing waits or runs: every count starts again
    q.append(Entry("b-fresh", b))
    assert q.vtime == {"b": 0.0}


def test_a_lead_earned_on_spare_capacity_is_kept_only_in_part_and_briefly() -> None:
    """A key that sent long prompts while the box had room ran thousands of tokens ahead; kept
    whole, its next one-line request waited 20 s behind every key that came since. It comes
    back at most IDLE_LEAD ahead, and level after IDLE_KEEP_S idle."""
    now = [100.0]
    q: FairQueue[Entry] = FairQueue(lambda e: e.share, clock=lambda: now[0])
    c, x = Share("c"), Share("x")
    q.append(Entry("c0", c))
    q.started(q.pop())
    for round_ in range(2):
        x_req = Entry(f"x{round_}", x)
        q.append(x_req)
        q.started(q.pop())
        q.charge(x, 5000)  # a long prompt, computed beside c's stream
        q.stopped(x_req, done=True)
        q.append(Entry(f"x-back{round_}", x))
        assert q.vtime["x"] == pytest.approx(q.vtime["c"] + IDLE_LEAD)
        q.remove(back := next(iter(q)))
        q.dropped(back)
        now[0] += IDLE_KEEP_S + 0.1  # idle past the keep: level with the least again
        q.append(Entry(f"x-later{round_}", x))
        assert q.vtime["x"] == pytest.approx(q.vtime["c"])
        q.remove(later := next(iter(q)))
        q.dropped(later)


def test_idle_tenants_kept_are_bounded() -> None:
    q = queue()
    busy = Share("busy")
    q.append(Entry("busy", busy))
    q.started(q.pop())
    for k in range(IDLE_KEPT + 10):
        share = Share(f"t{k}")
        entry = Entry(f"e{k}", share)
        q.append(entry)
        q.started(q.pop())
        q.charge(share, 1 + k % 60)  # each ahead of the busy one, the later ones more
        q.stopped(entry, done=True)
    assert len(q._idle) <= IDLE_KEPT
    q.append(Entry("late", Share("t59")))  # among the most ahead: still known
    assert q.vtime["t59"] == pytest.approx(60)


def test_a_paused_entry_keeps_its_place_among_its_tenants() -> None:
    q = queue()
    a0, a1 = Entry("a0", Share("a")), Entry("a1", Share("a"))
    q.append(a0)
    q.append(a1)
    assert q.pop() is a0
    q.started(a0)
    q.stopped(a0, done=False)  # paused
    q.append(a0)
    assert q.arrival(a0) < q.arrival(a1)
    assert q.pop() is a0


def test_remove_and_dropped_forget_an_entry() -> None:
    q = queue()
    a0, b0 = Entry("a0", Share("a")), Entry("b0", Share("b"))
    q.append(a0)
    q.append(b0)
    q.remove(a0)
    q.dropped(a0)
    assert len(q) == 1
    assert "a" not in q.vtime
    with pytest.raises(ValueError, match="does not wait"):
        q.remove(a0)
    assert q.tenants() == {"b": {"running": 0, "waiting": 1, "vtime": 0.0}}
    assert list(q) == [b0]


def test_held_counts_each_tenants_slots_and_waiting_entries() -> None:
    q = queue()
    a0, a1, a2, b0 = (Entry(n, Share(n[0])) for n in ("a0", "a1", "a2", "b0"))
    for entry in (a0, a1, a2, b0):
        q.append(entry)
    q.remove(a0)
    q.started(a0)
    assert q.held() == Counter({"a": 3, "b": 1})
    q.stopped(a0, done=True)
    q.remove(b0)
    q.dropped(b0)
    assert q.held() == Counter({"a": 2})  # none for a tenant with nothing left


def _running(*spec: tuple[int, Share, float, int]) -> list[Running]:
    return [Running(i, share, held, cells) for i, share, held, cells in spec]


def test_the_queue_order_shows_who_would_be_taken_next_without_taking_anyone() -> None:
    q = queue()
    for i in range(3):
        q.append(Entry(f"a{i}", Share("a")))
    q.append(Entry("b0", Share("b")))
    q.append(Entry("c0", Share("c", 1, 1)))  # interactive: first whatever the time
    first = q.pop()
    assert first.name == "c0"
    q.started(first)
    q.charge(first.share, 100)
    shown = [e.name for e in q.order(10)]
    # a and b alike: a holds no slot and arrived first, then b, then a's others (a holds one now).
    assert shown == ["a0", "b0", "a1", "a2"]
    assert [e.name for e in q.order(2)] == ["a0", "b0"]
    assert len(q) == 4  # nothing was taken
    taken = []
    for _ in range(4):  # as the scheduler takes them: each holds a slot once taken
        entry = q.pop()
        q.started(entry)
        taken.append(entry.name)
    assert taken == shown  # nothing changed meanwhile: the order it said


def test_a_higher_class_pauses_a_lower_one_that_ran_its_quantum() -> None:
    old = QUANTUM_S + 0.1
    slots = _running((0, BATCH, old, 100), (1, Share("c", 1, 0), old, 10))
    held = Counter({"a": 1, "c": 1})
    assert victim(INTERACTIVE, slots, held, tenants=3, n_slots=2) == 0  # the lowest class first
    fresh = _running((0, BATCH, QUANTUM_S / 2, 100))
    assert victim(INTERACTIVE, fresh, Counter({"a": 1}), tenants=2, n_slots=1) is None
    # The same class and no one above its share: nobody is paused.
    assert victim(Share("c", 1, -1), slots[:1], Counter({"a": 1}), tenants=2, n_slots=2) is None


def test_a_tenant_below_its_share_pauses_one_above_it() -> None:
    old = QUANTUM_S + 1
    a = Share("a")
    slots = _running(*((i, a, old, 100 + i) for i in range(4)))
    held = Counter({"a": 4})
    assert victim(Share("b"), slots, held, tenants=2, n_slots=4) == 0  # the fewest cells to copy
    # A tenant at its share keeps its slots; a waiting request of the same tenant never pauses one.
    assert victim(Share("b"), slots[:2], Counter({"a": 2, "b": 2}), tenants=2, n_slots=4) is None
    assert victim(a, slots, held, tenants=1, n_slots=4) is None


def test_share_and_queue_time_cross_the_engine_process_wire() -> None:
    request = GenerationRequest([1, 2, 3], 8, GREEDY, share=Share("0123456789ab", 7, -1))
    assert decode_request(encode_request(request)).share == Share("0123456789ab", 7, -1)
    for odd in (["k", 0, 0], ["k", 1001, 0], ["k", 1, 2], ["k", True, 0], ["k", "1", 0], ["k", 1, True]):
        encoded = encode_request(request) | {"share": odd}
        with pytest.raises((ValueError, TypeError)):
            decode_request(encoded)
    fin = Finished("stop", 3, 4, queue_s=1.25)
    decoded = decode_event(encode_event(fin))
    assert decoded == fin
    assert isinstance(decoded, Finished)
    assert decoded.queue_s == 1.25
    first = decode_event(encode_event(TextDelta("Hi", 1, queue_s=0.5, cached_tokens=12)))
    assert isinstance(first, TextDelta)
    assert first.queue_s == 0.5  # a stream's first token tells its wait (x-queue-ms)
    assert first.cached_tokens == 12  # and its cached prompt tokens (Anthropic's message_start)
    assert decode_event(encode_event(TextDelta("there", 2))) == TextDelta("there", 2)
    odd_deltas = (
        ["d", "x", 1, [], 0.5],
        ["d", "x", 1, [], 0.5, 1, 2],
        ["d", "x", 1, [], "soon", 0],
        ["d", "x", 1],
    )
    for odd_delta in odd_deltas:
        with pytest.raises((ValueError, TypeError)):
            decode_event(odd_delta)


# ---- on the real engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough that a few hundred tokens take a second or so."""
    path = tmp_path_factory.mktemp("fair") / "slow.gguf"
    return write_tiny_model(
        path, TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)
    )


def make_engine(path: Path, slots: int, **more: Any) -> Engine:
    config = EngineConfig(
        path=path, slots=slots, context_size=1024 * slots, batch_size=512, threads=1, threads_batch=1, **more
    )
    return Engine(config, name="fair")


def _submit(eng: Engine, prompt: str, max_tokens: int, share: Share) -> Generation:
    request = GenerationRequest(eng.tokenize(prompt), max_tokens, GREEDY, ignore_eos=True, share=share)
    return eng.submit(request, asyncio.get_running_loop())


async def _drain(gen: Generation, first: list[float] | None = None) -> tuple[str, Finished]:
    """`gen`'s text and end; `first` gets the time of its first token (a tiny model's token may
    be no text at all, so any event before the end counts)."""
    parts = []
    async for event in gen.events(30):
        if first is not None and not first and not isinstance(event, Finished):
            first.append(time.monotonic())
        parts.append(event.text)
        if isinstance(event, Finished):
            return "".join(parts), event
    raise AssertionError("no Finished")


async def _tokens_seen(gen: Generation, count: int) -> list[str]:
    """Read `count` text deltas of `gen` (its events stay readable afterwards)."""
    parts: list[str] = []
    events = gen.events(30)
    while len(parts) < count:
        event = await anext(events)
        assert isinstance(event, TextDelta), event
        parts.append(event.text)
    return parts


async def test_a_paused_sequence_resumes_where_it_left_off(slow_model: Path) -> None:
    eng = make_engine(slow_model, slots=1)
    try:
        reference, ref_fin = await _drain(_submit(eng, "a long batch job", 300, BATCH))
        assert eng.pauses == 0
        batch = _submit(eng, "a long batch job", 300, BATCH)
        seen = await _tokens_seen(batch, 20)
        await asyncio.sleep(QUANTUM_S)
        urgent = _submit(eng, "quick question", 8, INTERACTIVE)
        assert eng.held_by_tenant() == Counter({"a": 1, "b": 1})  # what admission counts per key
        _, urgent_fin = await _drain(urgent)
        assert urgent_fin.completion_tokens == 8
        assert eng.pauses == 1  # the batch job gave up its slot for the interactive request
        rest, fin = await _drain(batch)
        assert "".join(seen) + rest == reference  # greedy: the same text, token for token
        assert fin.completion_tokens == ref_fin.completion_tokens == 300
        assert fin.reason == "length"
        assert fin.queue_s > 0  # the pause counts as waiting
        assert urgent_fin.queue_s < 2
        assert eng.held_by_tenant() == Counter()
        performance = eng.performance()["fairness"]
        assert performance["pauses"] == 1
        assert performance["paused"] == 0
        assert performance["tenants"] == {}  # nothing waits or runs now
    finally:
        eng.close()


async def test_a_paused_sequence_cancelled_or_closed_ends_with_what_it_generated(slow_model: Path) -> None:
    eng = make_engine(slow_model, slots=1)
    try:
        batch = _submit(eng, "batch one", 800, BATCH)
        await _tokens_seen(batch, 10)
        await asyncio.sleep(QUANTUM_S)
        urgent = _submit(eng, "urgent", 400, INTERACTIVE)
        await _tokens_seen(urgent, 2)
        fairness = eng.performance()["fairness"]
        assert fairness["paused"] == 1
        assert fairness["paused_bytes"] > 0  # its KV copy, in host memory
        batch.cancel()
        eng.wake()
        _, fin = await _drain(batch)
        assert fin.reason == "cancelled"
        assert fin.completion_tokens >= 10
        fairness = eng.performance()["fairness"]
        assert (fairness["paused"], fairness["paused_bytes"]) == (0, 0)
        # Paused again, then the engine closes: the paused one ends with an error, not silence.
        second = _submit(eng, "batch two", 800, BATCH)
        urgent.cancel()
        eng.wake()
        await _drain(urgent)
        await _tokens_seen(second, 5)
        await asyncio.sleep(QUANTUM_S)
        third = _submit(eng, "urgent again", 400, INTERACTIVE)
        await _tokens_seen(third, 2)
        assert eng.performance()["fairness"]["paused"] == 1
    finally:
        eng.close()
    _, closed = await _drain(second)
    assert closed.reason == "error"
    assert closed.completion_tokens >= 5


async def test_a_flooding_key_does_not_keep_another_keys_request_out(slow_model: Path) -> None:
    eng = make_engine(slow_model, slots=2)
    flood = Share("flood")
    try:
        floods = [_submit(eng, f"long job {i}", 400, flood) for i in range(8)]
        await _tokens_seen(floods[0], 5)
        await asyncio.sleep(QUANTUM_S)
        _, fin = await _drain(_submit(eng, "short", 4, Share("other")))
        assert fin.completion_tokens == 4
        # It took a flooder's slot (pausing it): it did not wait for a 400-token job to end.
        assert eng.pauses >= 1
        assert floods[0].final is None
        assert floods[1].final is None
        for gen in floods:
            gen.cancel()
        eng.wake()
        for gen in floods:
            await _drain(gen)
    finally:
        eng.close()


async def test_status_lists_the_queue_in_order_with_waits_and_estimates(slow_model: Path) -> None:
    eng = make_engine(slow_model, slots=1)
    try:
        _, first = await _drain(_submit(eng, "warm", 8, Share("a")))  # a hold time to estimate from
        assert first.completion_tokens == 8
        running = _submit(eng, "long job", 400, Share("a"))
        await _tokens_seen(running, 3)
        waiting = [_submit(eng, f"q{i}", 4, Share(t)) for i, t in enumerate(["a", "b", "a"])]
        queue = eng.performance()["fairness"]["queue"]
        assert [q["position"] for q in queue] == [1, 2, 3]
        assert [q["tenant"] for q in queue] == ["b", "a", "a"]  # b holds no slot: first
        assert all(q["waited_ms"] >= 0 for q in queue)
        estimates = [q["estimated_wait_ms"] for q in queue]
        assert estimates[0] > 0
        assert estimates == sorted(estimates)
        for gen in [running, *waiting]:
            gen.cancel()
        eng.wake()
        for gen in waiting:  # (the running one's events have their reader above)
            await _drain(gen)
        assert eng.performance()["fairness"]["queue"] == []
    finally:
        eng.close()


def _batch_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every llama_decode the engines run from here (the step's size, as llama.cpp sees it)."""
    import llama_cpp  # noqa: PLC0415 - patched for this test only

    sizes: list[int] = []
    real = llama_cpp.llama_decode

    def counted(ctx: object, batch: object) -> int:
        sizes.append(int(batch.n_tokens))  # type: ignore[attr-defined]
        return int(real(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", counted)
    return sizes


@pytest.mark.slow  # counts the scheduler's steps: not beside another worker (./dev test --quick)
async def test_a_short_prompt_takes_a_step_of_its_own_and_the_decodes_lose_no_token(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prompt's chunk goes alone ahead of the decodes (its first token one short step
    later), never twice in a row: under a stream of short prompts the running one still gets a
    token every other step, and its text is what it is alone."""
    eng = make_engine(slow_model, slots=4)
    other = Share("b")
    try:
        reference, _ = await _drain(_submit(eng, "a long job", 120, BATCH))
        sizes = _batch_sizes(monkeypatch)
        long = _submit(eng, "a long job", 120, BATCH)
        seen = await _tokens_seen(long, 3)
        before = len(sizes)
        shorts = [_submit(eng, f"short question number {i}", 1, other) for i in range(12)]
        for gen in shorts:
            _, fin = await _drain(gen)
            assert fin.completion_tokens == 1
        during = len(sizes) - before
        rest, fin = await _drain(long)
        assert "".join(seen) + rest == reference  # greedy: the steps it waited changed nothing
        assert fin.completion_tokens == 120
        # The shorts admitted together (three free slots: four rounds or more) took a step of their
        # own, their prompts' rows only, but never two back to back: a step between holds the
        # running sequence's token, so at least every other round went alone.
        alone = eng.first_token_steps
        assert 2 <= alone <= 12
        assert during >= 2 * alone - 1
        assert eng.performance()["fairness"]["first_token_steps"] == alone
    finally:
        eng.close()


async def test_prefill_chunk_bounds_a_step_while_others_generate(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a sequence generating, a step takes at most `prefill_chunk` prompt tokens besides its
    token; alone, a prompt takes `batch_size` per step. The chunked prompt's reply is the same."""
    eng = make_engine(slow_model, slots=2, prefill_chunk=16)
    prompt = " ".join(f"word{i}" for i in range(150))
    try:
        alone_text, _ = await _drain(_submit(eng, prompt, 6, BATCH))
        sizes = _batch_sizes(monkeypatch)
        long = _submit(eng, "a long job", 400, BATCH)
        await _tokens_seen(long, 3)
        mark = len(sizes)
        text, fin = await _drain(_submit(eng, prompt, 6, Share("b")))
        assert text == alone_text
        assert fin.completion_tokens == 6
        chunked = sizes[mark:]
        assert max(chunked) <= 1 + 16  # the running one's token and a chunk of 16
        assert len(chunked) >= len(eng.tokenize(prompt)) // 16
        long.cancel()
        eng.wake()
        await _drain(long)
        mark = len(sizes)
        await _drain(_submit(eng, " ".join(f"other{i}" for i in range(150)), 2, BATCH))  # no prefix cached
        assert max(sizes[mark:]) > 100  # nobody generating: the whole prompt in one step
    finally:
        eng.close()


# ---- a step stopped for a newcomer (preempt_steps) ---------------------------------------------


async def _in_progress(eng: Engine) -> None:
    """Until the engine is inside a step that may be stopped."""
    deadline = time.monotonic() + 10
    while eng._step_shares is None:
        assert time.monotonic() < deadline, "no step started"
        await asyncio.sleep(0.001)


def _assert_kv_matches(eng: Engine) -> None:
    """Each sequence's KV cache holds the positions the scheduler counts, no more (the engine idle)."""
    import llama_cpp  # noqa: PLC0415 - read once the engine is idle

    held = [len(kv) for kv in eng._kv]
    cached = [llama_cpp.llama_memory_seq_pos_max(eng._memory, i) + 1 for i in range(len(held))]
    assert cached == held


LONG_PROMPT = " ".join(f"w{i}" for i in range(150))  # about 940 tokens: one step of a second or so


@pytest.mark.parametrize("stops", [True, False])
async def test_another_keys_short_prompt_stops_the_step_in_progress(slow_model: Path, stops: bool) -> None:
    """A's long prompt is one long step; B's short prompt, arriving during it, stops it: B's
    first token comes before A's, and A's reply is what it is alone, to the token. A second
    request of A's own stops nothing. With `preempt_steps: false` B waits for A's step."""
    config = {"slots": 3, "context_size": 2048, "batch_size": 1024, "threads": 1, "threads_batch": 1}
    alone = Engine(EngineConfig(path=slow_model, **config), name="alone")  # type: ignore[arg-type]
    try:
        reference, _ = await _drain(_submit(alone, LONG_PROMPT, 8, BATCH), [])
    finally:
        alone.close()
    eng = Engine(EngineConfig(path=slow_model, preempt_steps=stops, **config), name="fair")  # type: ignore[arg-type]
    try:
        await _drain(_submit(eng, "warm up " * 20, 2, BATCH))
        a = _submit(eng, LONG_PROMPT, 8, BATCH)
        if stops:
            await _in_progress(eng)
            own = _submit(eng, "A's own short question", 2, BATCH)  # A is in the step: no stop
            await asyncio.sleep(0.02)
            assert eng.stopped_steps == 0
        else:
            await asyncio.sleep(0.05)
            own = _submit(eng, "A's own short question", 2, BATCH)
        a_first: list[float] = []
        b_first: list[float] = []
        b = _submit(eng, "B's short question", 2, Share("b"))
        (a_text, a_fin), (_, b_fin), _ = await asyncio.gather(
            _drain(a, a_first), _drain(b, b_first), _drain(own)
        )
        assert a_text == reference  # the stopped step, undone and run again, changed nothing
        assert (a_fin.completion_tokens, b_fin.completion_tokens) == (8, 2)
        assert a_fin.prompt_tokens == len(eng.tokenize(LONG_PROMPT))
        if stops:
            assert b_first[0] < a_first[0]  # B did not wait for A's long step
            assert eng.stopped_steps == 1
            assert eng.first_token_steps == 1  # B's prompt went alone, ahead of A's
            assert eng.performance()["fairness"]["stopped_steps"] == 1
        else:
            assert a_first[0] < b_first[0]
            assert eng.stopped_steps == 0
        _assert_kv_matches(eng)
    finally:
        eng.close()


async def test_one_keys_requests_one_after_another_stop_no_step_once_it_is_ahead(slow_model: Path) -> None:
    """Key B sends one-token requests one after another while key A streams: B was idle between
    each, so each came back at A's virtual time as a newcomer, stopped A's step in progress and
    went alone ahead of A's decode (A's stream fell to 0.15x its rate, against 0.27x with
    `preempt_steps: false`). B's first request still does both; the later ones, B having been
    computed for more than A, join A's steps. A's text is what it is alone."""
    config = {"slots": 2, "context_size": 2048, "batch_size": 512, "threads": 1, "threads_batch": 1}
    eng = Engine(EngineConfig(path=slow_model, **config), name="fair")  # type: ignore[arg-type]
    try:
        heavy = Share("a", 50)
        reference, _ = await _drain(_submit(eng, "a long job", 200, heavy))
        long = _submit(eng, "a long job", 200, heavy)
        seen = await _tokens_seen(long, 3)
        for i in range(12):
            # A weighs 50 times B: B's ~30 prompt tokens count for more than 1,500 of A's
            # decode steps, which no pace of this loop lets A take between two of B's requests.
            prompt = f"short question number {i}"
            assert len(eng.tokenize(prompt)) <= FIRST_TOKEN_ALONE
            _, fin = await _drain(_submit(eng, prompt, 1, Share("b")))
            assert fin.completion_tokens == 1
        stops, alone = eng.stopped_steps, eng.first_token_steps
        rest, fin = await _drain(long)
        assert "".join(seen) + rest == reference
        assert fin.completion_tokens == 200
        assert stops <= 2, stops
        assert alone <= 2, alone
        _assert_kv_matches(eng)
    finally:
        eng.close()


async def test_steps_stopped_over_and_over_change_no_token(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every step that may be stopped is stopped once (its prompt chunk or its decodes, with
    llama.cpp's finished ubatches in the cache): each reply is what it is without stops, to the
    token, the KV cache holds what the scheduler counts, and llama.cpp's reports of the stops
    are not logged as errors."""
    import llama_cpp  # noqa: PLC0415 - patched for this test only

    config = {
        "slots": 3,
        "context_size": 2048,
        "batch_size": 256,
        "prefill_chunk": 64,
        "threads": 1,
        "threads_batch": 1,
    }
    prompts = [LONG_PROMPT, "a short one", "w1 w2 w3 " * 20]

    async def replies(eng: Engine) -> list[str]:
        # Queued at once (the scheduler waits on its lock meanwhile, a reentrant one): every
        # step is the same in both engines, whatever the timing, bar the stops.
        with eng._cond:
            gens = [_submit(eng, prompt, 48, BATCH) for prompt in prompts]
        return [(await _drain(gen))[0] for gen in gens]

    plain = Engine(EngineConfig(path=slow_model, preempt_steps=False, **config), name="plain")  # type: ignore[arg-type]
    try:
        reference = await replies(plain)
        assert plain.stopped_steps == 0
    finally:
        plain.close()
    eng = Engine(EngineConfig(path=slow_model, **config), name="stopped")  # type: ignore[arg-type]
    real = llama_cpp.llama_decode
    # Each armed step stops after its k-th graph node, k taken in turn from these: at the first
    # node, or in a later ubatch with the earlier ones' rows already in the KV cache (a mixed
    # step is one ubatch per sequence shape), or never (more nodes than the step has).
    stop_after = itertools.cycle([1, 20, 40, 60, 80, 100, 130])
    left = [-1]

    def at_node(_data: object) -> bool:
        if left[0] < 0:
            return False
        left[0] -= 1
        if left[0] == 0:
            eng._stop.ask()  # type: ignore[union-attr]
        return left[0] == 0

    stopped_at: list[int] = []
    decodes = [0]

    def stopping(ctx: object, batch: object) -> int:
        k = left[0] = next(stop_after) if eng._step_shares is not None else -1
        decodes[0] += 1
        rc = int(real(ctx, batch))
        if rc == 2:
            stopped_at.append(k)
        return rc

    callback = llama_cpp.ggml_abort_callback(at_node)  # a test's slow one: the GIL at every node
    try:
        llama_cpp.llama_set_abort_callback(eng._ctx, callback, None)  # the engine idles now
        monkeypatch.setattr(llama_cpp, "llama_decode", stopping)
        with caplog.at_level("DEBUG", logger="edgellmd.engine.native"):
            got = await replies(eng)
        monkeypatch.setattr(llama_cpp, "llama_decode", real)
        assert eng.stopped_steps == len(stopped_at) >= 10
        assert len(set(stopped_at)) >= 3  # at the first node and deeper, part of the step done
        # Asked at every step, a stop comes at most every third: two steps run whole after each.
        assert eng.stopped_steps <= (decodes[0] + 2) // 3
        assert got == reference
        _assert_kv_matches(eng)
        reports = [r for r in caplog.records if "llama.cpp" in r.getMessage()]
        assert any("ret = 2" in r.getMessage() for r in reports)  # the stops were reported...
        assert all(r.levelname == "DEBUG" for r in reports)  # ...at debug, not as failures
    finally:
        eng.close()
