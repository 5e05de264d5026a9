"""Text-side helpers of the scheduler (UTF-8-safe detokenization, stop strings) and the event
stream a generation hands its consumer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from edgellmd.engine.generation import (
    Event,
    Finished,
    Generation,
    GenerationRequest,
    NoProgress,
    SamplingParams,
    StopMatcher,
    TextDelta,
    Utf8Stream,
)


def test_utf8_stream_holds_partial_characters() -> None:
    stream = Utf8Stream()
    snowman = "☃".encode()  # 3 bytes
    assert stream.feed(snowman[:1]) == ""
    assert stream.feed(snowman[1:2]) == ""
    assert stream.feed(snowman[2:] + b"x") == "☃x"
    assert stream.flush() == ""


def test_utf8_stream_emoji_split_over_four_pieces() -> None:
    stream = Utf8Stream()
    emoji = "🦙".encode()
    out = "".join(stream.feed(emoji[i : i + 1]) for i in range(4))
    assert out == "🦙"


def test_utf8_stream_invalid_bytes_become_replacement_characters() -> None:
    stream = Utf8Stream()
    assert stream.feed(b"a\xffb") == "a\ufffdb"
    # A truncated character at the very end is flushed as one replacement character.
    assert stream.feed("é".encode()[:1]) == ""
    assert stream.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "hit"),
    [
        ((), ["hello", " world"], ["hello", " world"], False),
        (("STOP",), ["abc", "deSTOPfg"], ["abc", "de"], True),
        # The stop string straddles pieces: nothing of it is emitted.
        (("STOP",), ["abcST", "OPxyz"], ["abc", ""], True),
        # A partial match is held back, then released when it turns out not to be a stop.
        (("STOP",), ["abcST", "ART"], ["abc", "START"], False),
        # The earliest of several stops wins.
        (("world", "lo"), ["hello world"], ["hel"], True),
        (("\n\n",), ["line\n", "\nnext"], ["line", ""], True),
    ],
)
def test_stop_matcher(stops: tuple[str, ...], pieces: list[str], emitted: list[str], hit: bool) -> None:
    matcher = StopMatcher(stops)
    out: list[str] = []
    got_hit = False
    for piece in pieces:
        text, got_hit = matcher.feed(piece)
        out.append(text)
        if got_hit:
            break
    assert out == emitted
    assert got_hit is hit


def test_stop_matcher_flush_releases_held_prefix() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("42</ans") == ("42", False)
    assert matcher.flush() == "</ans"
    assert matcher.flush() == ""


def test_sampling_params_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=0.5).penalized
    assert SamplingParams(repeat_penalty=1.1).penalized


# ---- the event stream of one generation ---------------------------------------------------------


def _request() -> GenerationRequest:
    return GenerationRequest(prompt_tokens=[1, 2, 3], max_tokens=8)


async def _collect(gen: Generation, idle_timeout: float | None) -> list[Event]:
    return [event async for event in gen.events(idle_timeout)]


async def test_events_arrive_in_order_before_and_while_waiting() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    gen.push([TextDelta("a", 1)])  # before the consumer starts
    consumer = asyncio.create_task(_collect(gen, 5.0))
    await asyncio.sleep(0.01)  # the consumer now waits
    gen.push([TextDelta("b", 2), TextDelta("c", 3)])
    await asyncio.sleep(0.01)
    final = Finished("stop", 3, 4, text="d")
    gen.push([TextDelta("", 4), final])
    events = await asyncio.wait_for(consumer, 2)
    assert [e.text for e in events] == ["a", "b", "c", "", "d"]
    assert events[-1] is final
    assert gen.final is final


async def test_events_stop_at_finished_and_leave_no_timer() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    consumer = asyncio.create_task(_collect(gen, 30.0))
    await asyncio.sleep(0.01)
    timer = gen._timer  # armed while the consumer waits
    assert timer is not None
    gen.push([Finished("length", 3, 8)])
    events = await asyncio.wait_for(consumer, 2)
    assert len(events) == 1
    assert timer.cancelled()
    assert gen._timer is None
    assert gen._waiter is None


async def test_no_event_within_the_idle_timeout_raises_no_progress() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    started = loop.time()
    with pytest.raises(NoProgress):
        await _collect(gen, 0.2)
    assert 0.15 <= loop.time() - started < 2.0
    assert gen._timer is None


async def test_steady_events_never_time_out_though_their_total_exceeds_the_timeout() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    consumer = asyncio.create_task(_collect(gen, 0.2))
    for n in range(1, 9):  # 8 gaps of 0.08 s: 0.64 s in all, every gap under 0.2 s
        await asyncio.sleep(0.08)
        gen.push([TextDelta("x", n)])
    gen.push([Finished("stop", 3, 8)])
    events = await asyncio.wait_for(consumer, 2)
    assert len(events) == 9


async def test_a_gap_after_steady_events_still_times_out() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    seen: list[Event] = []

    async def consume() -> None:
        async for event in gen.events(0.2):
            seen.append(event)  # noqa: PERF401 - what came before the timeout is the point

    consumer = asyncio.create_task(consume())
    for n in range(1, 4):
        await asyncio.sleep(0.08)
        gen.push([TextDelta("x", n)])
    with pytest.raises(NoProgress):
        await asyncio.wait_for(consumer, 2)
    assert len(seen) == 3


async def test_cancelling_the_consumer_clears_its_wait() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    consumer = asyncio.create_task(_collect(gen, 30.0))
    await asyncio.sleep(0.01)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert gen._waiter is None
    assert gen._timer is None
    # A push after the consumer left is kept, and a new consumer gets it.
    gen.push([Finished("cancelled", 3, 0)])
    assert [e.reason for e in await _collect(gen, 1.0) if isinstance(e, Finished)] == ["cancelled"]


async def test_two_consumers_at_once_are_refused() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    first = asyncio.create_task(_collect(gen, None))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="one consumer"):
        await _collect(gen, None)
    gen.push([Finished("stop", 3, 1)])
    assert len(await asyncio.wait_for(first, 2)) == 1


async def test_events_pushed_from_the_scheduler_thread() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)

    def produce() -> None:
        for n in range(1, 51):
            gen.push_threadsafe([TextDelta(str(n % 10), n)])
        gen.push_threadsafe([Finished("stop", 3, 50)])

    thread = threading.Thread(target=produce)
    consumer = asyncio.create_task(_collect(gen, 5.0))
    thread.start()
    events = await asyncio.wait_for(consumer, 5)
    thread.join()
    assert "".join(e.text for e in events) == "".join(str(n % 10) for n in range(1, 51))


async def test_ended_waits_for_the_finished_event_without_consuming_and_gives_up_at_its_limit() -> None:
    loop = asyncio.get_running_loop()
    gen = Generation(_request(), loop)
    gen.push([TextDelta("a", 1)])
    started = loop.time()
    assert await gen.ended(0.05) is None  # nothing finished: the limit, then None
    assert loop.time() - started >= 0.05
    final = Finished("stop", 3, 1)
    threading.Timer(0.05, gen.push_threadsafe, args=([final],)).start()
    started = loop.time()
    assert await gen.ended(10.0) is final  # at the event, not at the limit
    assert loop.time() - started < 5.0
    assert await gen.ended(0.0) is final
    # The events are all still there for a consumer.
    assert [type(e) for e in await _collect(gen, 1.0)] == [TextDelta, Finished]
