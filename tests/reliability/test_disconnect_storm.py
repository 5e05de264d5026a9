"""Disconnect storm: 100 clients abort mid-stream at random points; every slot is free within a second."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.reliability.harness import (
    MODEL,
    STEADY_SPEC,
    DaemonProcess,
    Figures,
    SignedBox,
    ask,
    bound,
    completion,
    describe,
    duration,
    median,
    percentile,
)
from tests.serving import free_port

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

CLIENTS = 100
SLOTS = 4
STREAM_TOKENS = 2000  # far more than any client waits for: every stream is abandoned
MAX_EVENTS = 60  # a client aborts after 0..60 events, or at a random moment, whichever is first
FREE_WITHIN_S = 1.0
SPEED_STREAMS = 4
SPEED_TOKENS = 256  # a round of about a second here: shorter ones moved by 2x from one to the next


@dataclass(frozen=True, slots=True)
class Abort:
    """How one storm client left."""

    events: int  # SSE events received before leaving
    how: str  # "close" (FIN) or "reset" (RST)
    at: float  # time.monotonic() of the close


async def _storm_client(port: int, token: str, rng: random.Random) -> Abort:
    await asyncio.sleep(rng.uniform(0, 1.0))  # arrivals spread over a second
    body = json.dumps(
        {"model": MODEL, "prompt": "storm", "max_tokens": STREAM_TOKENS, "stream": True, "ignore_eos": True}
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    target = rng.randint(0, MAX_EVENTS)
    deadline = time.monotonic() + rng.uniform(0.05, 4.0)
    seen = b""
    events = 0
    while events < target:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            break
        assert chunk, "the server ended a stream that should still run"
        seen = seen[-8:] + chunk
        events += chunk.count(b"data: ")
    how = rng.choice(("close", "reset"))
    if how == "reset":
        sock: socket.socket = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    closed = time.monotonic()
    await asyncio.gather(writer.wait_closed(), return_exceptions=True)
    return Abort(events, how, closed)


async def _storm(daemon: DaemonProcess) -> tuple[list[Abort], list[tuple[float, dict[str, Any]]]]:
    """Run the storm while polling /admin/status; returns the aborts and the (time, status) polls."""
    rng = random.Random(8)
    polls: list[tuple[float, dict[str, Any]]] = []
    storm_done = asyncio.Event()

    async def poll() -> None:
        headers = {"Authorization": f"Bearer {daemon.box.admin_token}"}
        async with aiohttp.ClientSession() as session:
            calm_since: float | None = None
            while True:
                async with session.get(daemon.url + "/admin/status", headers=headers) as response:
                    model = next(m for m in (await response.json())["models"] if m["name"] == MODEL)
                now = time.monotonic()
                polls.append((now, model))
                idle = (model["slots_busy"], model["queue_depth"], model["leases"]) == (0, 0, 0)
                if storm_done.is_set() and idle:
                    calm_since = calm_since or now
                    if now - calm_since > 0.2:
                        return
                else:
                    calm_since = None
                await asyncio.sleep(0.01)

    poller = asyncio.create_task(poll())
    aborts = await asyncio.gather(
        *(
            _storm_client(daemon.port, daemon.box.app_token, random.Random(rng.random()))
            for _ in range(CLIENTS)
        )
    )
    storm_done.set()
    await asyncio.wait_for(poller, 30)
    return list(aborts), polls


async def _speed(daemon: DaemonProcess, rounds: int) -> tuple[list[float], list[float]]:
    """Tokens/s of SPEED_STREAMS concurrent streams, and their TTFTs, round by round."""
    path, body = completion(SPEED_TOKENS, stream=True)
    rates: list[float] = []
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            started = time.monotonic()
            answers = await asyncio.gather(
                *(ask(session, daemon.url, daemon.box.app_token, path, body) for _ in range(SPEED_STREAMS))
            )
            assert all(a.ok for a in answers), describe(answers)
            rates.append(sum(a.tokens for a in answers) / (time.monotonic() - started))
            ttfts += [a.first_token_at - a.started for a in answers if a.first_token_at is not None]
    return rates, ttfts


def _side_by_side(
    daemon: DaemonProcess, control: DaemonProcess, rounds: int
) -> tuple[list[float], list[float], list[float]]:
    """Speed rounds of the daemon and the control in turns (ABBA: a trend in the machine cancels):
    the daemon's tokens/s against the control's, round by round; the daemon's own; its TTFTs."""
    ratios: list[float] = []
    rates: list[float] = []
    ttfts: list[float] = []
    for number in range(rounds):
        order = (daemon, control) if number % 2 == 0 else (control, daemon)
        speeds: dict[int, float] = {}
        for which in order:
            measured, firsts = asyncio.run(_speed(which, 1))
            speeds[id(which)] = measured[0]
            if which is daemon:
                ttfts += firsts
        ratios.append(speeds[id(daemon)] / speeds[id(control)])
        rates.append(speeds[id(daemon)])
    return ratios, rates, ttfts


def test_disconnect_storm_frees_every_slot_at_once(box: SignedBox, figures: Figures) -> None:
    rounds = int(duration(6, 16))
    box.publish(box.model_bytes(STEADY_SPEC))
    model = {"slots": SLOTS, "queue_size": CLIENTS, "context_size": 2048}
    server = {"max_tokens_limit": STREAM_TOKENS}
    config = box.config(free_port(), model=model, server=server)
    # The control: the same model and settings, never stormed. Its speed in the same minute is
    # the machine's: before and after the storm, in turns with the stormed daemon's.
    control_config = box.config(
        free_port(), model=model, server=server, lifecycle={"preload_dir": None, "watch": False}
    )
    with DaemonProcess(box, config) as daemon, DaemonProcess(box, control_config, label="control") as control:
        daemon.start()
        control.start()
        asyncio.run(_speed(control, 1))  # its first requests, as the daemon's come next
        before_ratios, before, ttft_before = _side_by_side(daemon, control, rounds)
        storm_started = time.monotonic()
        aborts, polls = asyncio.run(_storm(daemon))
        after_ratios, after, ttft_after = _side_by_side(daemon, control, rounds)
        final = daemon.model()
        errors = daemon.errors() + control.errors()
        disconnects = sum("client disconnected" in m for m in daemon.messages())

    last_close = max(a.at for a in aborts)
    free_at = next(
        t
        for t, m in polls
        if t >= last_close and (m["slots_busy"], m["queue_depth"], m["leases"]) == (0, 0, 0)
    )
    busy_peak = max(m["slots_busy"] for _, m in polls)
    # The stormed daemon's speed against the control's after the storm, over the same before it:
    # a neighbour slows both daemons' rounds alike, slots or work the storm left behind only its.
    speed_ratio = median(after_ratios) / median(before_ratios)
    speed_floor = 1 - bound(0.5, 0.2)
    figures["storm duration s"] = last_close - storm_started
    figures["clients (FIN / RST)"] = (
        len(aborts),
        sum(a.how == "close" for a in aborts),
        sum(a.how == "reset" for a in aborts),
    )
    figures["events before abort: min / median / max"] = (
        min(a.events for a in aborts),
        median([a.events for a in aborts]),
        max(a.events for a in aborts),
    )
    figures["aborted while queued (0 events)"] = sum(a.events == 0 for a in aborts)
    figures["peak slots busy during storm"] = busy_peak
    figures["slots and queue free after last abort s (bound)"] = (free_at - last_close, FREE_WITHIN_S)
    figures["tokens/s before / after (median of rounds)"] = (median(before), median(after))
    figures["against the control per round, before"] = [round(r, 3) for r in before_ratios]
    figures["against the control per round, after"] = [round(r, 3) for r in after_ratios]
    figures["speed after / before, against the control (floor)"] = (speed_ratio, speed_floor)
    figures["TTFT p50 before / after s"] = (percentile(ttft_before, 50), percentile(ttft_after, 50))
    figures["disconnects logged"] = disconnects
    figures.show()

    assert busy_peak == SLOTS  # the storm did fill the slots
    assert free_at - last_close < FREE_WITHIN_S
    assert speed_ratio >= speed_floor
    assert (final["slots_busy"], final["queue_depth"], final["leases"]) == (0, 0, 0)
    assert errors == []
