"""The prompt pool shared between keys: a key runs at most its share of threads, keys take turns."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future

import pytest

from edgellmd.api.pool import POOL_TENANT, FairPool


@pytest.fixture
def pool() -> Iterator[FairPool]:
    fair = FairPool(2, name="test-pool")
    yield fair
    fair.shutdown(wait=True, cancel_futures=True)


def _as(tenant: str, pool: FairPool, fn: Callable[[], object]) -> Future[object]:
    return contextvars.copy_context().run(_submit, tenant, pool, fn)


def _submit(tenant: str, pool: FairPool, fn: Callable[[], object]) -> Future[object]:
    POOL_TENANT.set(tenant)
    return pool.submit(fn)


def _until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_one_key_flooding_the_pool_leaves_a_thread_for_another(pool: FairPool) -> None:
    release = threading.Event()
    started: list[str] = []

    def slow(name: str) -> Callable[[], str]:
        def job() -> str:
            started.append(name)
            release.wait(10)
            return name

        return job

    flood = [_as("a", pool, slow(f"a{i}")) for i in range(4)]
    _until(lambda: started == ["a0"])
    time.sleep(0.05)
    assert started == ["a0"]  # a's second job waits for a's first, though a thread is free
    assert pool.waiting() == {"a": 3}
    b = _as("b", pool, lambda: "b")
    assert b.result(5) == "b"  # on the free thread at once, ahead of a's queued three
    release.set()
    assert [f.result(5) for f in flood] == ["a0", "a1", "a2", "a3"]
    assert started == ["a0", "a1", "a2", "a3"]


def test_waiting_keys_take_turns(pool: FairPool) -> None:
    gate = threading.Event()
    order: list[str] = []
    blocker = _as("x", pool, lambda: gate.wait(10))  # holds x's share; one thread left
    hold = threading.Event()
    other = _as("y", pool, lambda: hold.wait(10))  # and now both threads are busy
    _until(lambda: pool.waiting() == {})

    def note(name: str) -> Callable[[], None]:
        return lambda: order.append(name)

    # a queues six jobs, then b three, all while both threads are busy.
    futures = [_as("a", pool, note(f"a{i}")) for i in range(6)]
    futures += [_as("b", pool, note(f"b{i}")) for i in range(3)]
    hold.set()
    for future in futures:
        future.result(5)
    gate.set()
    blocker.result(5)
    other.result(5)
    # a and b alternate while both wait, each in its own order; then a's rest.
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


def test_errors_and_cancellations_reach_the_caller_and_free_the_share(pool: FairPool) -> None:
    def boom() -> None:
        raise ValueError("bad schema")

    with pytest.raises(ValueError, match="bad schema"):
        _as("a", pool, boom).result(5)
    gate = threading.Event()
    first = _as("a", pool, lambda: gate.wait(10))
    queued = _as("a", pool, lambda: "never")
    assert queued.cancel()  # its client left while it waited
    gate.set()
    first.result(5)
    with pytest.raises(CancelledError):
        queued.result(5)
    assert _as("a", pool, lambda: "again").result(5) == "again"  # a's share came back each time


def test_jobs_see_their_callers_context_and_shutdown_refuses_new_ones() -> None:
    pool = FairPool(2)
    assert pool.per_key == 1
    assert _as("k", pool, POOL_TENANT.get).result(5) == "k"
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_every_thread_of_the_pool_runs_from_the_start() -> None:
    """Its threads do not grow with load: a soak counts the daemon's threads (reliability)."""

    # Its own threads, by name: the process's count moves with other tests' threads ending.
    def warm() -> int:
        return sum(t.name.startswith("warm") for t in threading.enumerate())

    assert warm() == 0
    pool = FairPool(3, name="warm")
    try:
        assert warm() == 3  # all of them at once, before any work
        for _ in range(2):
            assert pool.submit(lambda: 1).result() == 1
        assert warm() == 3
    finally:
        pool.shutdown(wait=True)
