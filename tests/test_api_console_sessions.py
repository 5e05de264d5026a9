"""The console's session store: ids kept as hashes, idle and absolute expiry, a bound, ends by key."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from edgellmd.http.console.sessions import (
    EXPIRED,
    KEY_NO_LONGER_VALID,
    REPLACED,
    REPLACED_OWN,
    SIGNED_OUT,
    SessionStore,
)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _store(clock: Clock, capacity: int = 4) -> SessionStore:
    return SessionStore(idle_s=60.0, max_s=300.0, capacity=capacity, clock=clock)


def test_a_session_is_found_by_its_id_only(clock: Clock) -> None:
    store = _store(clock)
    session_id, session = store.create("aaaaaaaaaaaa")
    assert store.get(session_id) is session
    assert store.get(None) is None
    assert store.get(session_id[:-1] + ("A" if session_id[-1] != "A" else "B")) is None
    assert store.get(session_id + "x") is None  # not even hashed: the wrong shape
    assert session_id not in repr(store.__dict__)  # held by its hash
    assert session.csrf != session_id
    assert len(session.csrf) >= 43


def test_idle_expiry_is_pushed_back_by_use_absolute_expiry_is_not(clock: Clock) -> None:
    store = _store(clock)
    session_id, session = store.create("aaaaaaaaaaaa")
    for _ in range(4):  # used every 50 s: never idle for 60
        clock.now += 50
        assert store.get(session_id) is session
    assert store.expires_in(session) == pytest.approx(60 - 0)
    clock.now += 50  # 250 s old
    assert store.get(session_id) is session
    assert store.expires_in(session) == pytest.approx(50)  # the absolute end is nearer
    clock.now += 50  # 300 s: over, used or not
    assert store.get(session_id) is None
    assert session.end_reason == EXPIRED
    assert session.ended.is_set()


def test_an_unused_session_expires_and_is_pruned(clock: Clock) -> None:
    store = _store(clock)
    _, session = store.create("aaaaaaaaaaaa")
    clock.now += 61
    assert store.prune() == 1
    assert len(store) == 0
    assert session.end_reason == EXPIRED


def test_the_store_is_bounded_least_recently_used_out_first(clock: Clock) -> None:
    store = _store(clock, capacity=2)
    first_id, first = store.create("aaaaaaaaaaaa")
    _, second = store.create("bbbbbbbbbbbb")
    clock.now += 1
    store.get(first_id)  # used: the second is now the least recently used
    _, third = store.create("cccccccccccc")
    assert len(store) == 2
    assert second.end_reason == REPLACED
    assert first.end_reason is None
    assert third.end_reason is None


def test_sessions_end_by_key_and_by_sign_out(clock: Clock) -> None:
    store = _store(clock)
    _, one = store.create("aaaaaaaaaaaa")
    _, two = store.create("aaaaaaaaaaaa")
    other_id, other = store.create("bbbbbbbbbbbb")
    assert store.key_ids() == {"aaaaaaaaaaaa", "bbbbbbbbbbbb"}
    assert store.end_keys({"aaaaaaaaaaaa"}) == 2
    assert (one.end_reason, two.end_reason) == (KEY_NO_LONGER_VALID, KEY_NO_LONGER_VALID)
    store.end(other, SIGNED_OUT)
    assert store.get(other_id) is None
    assert other.end_reason == SIGNED_OUT


def test_a_new_stream_stops_the_one_before(clock: Clock) -> None:
    store = _store(clock)
    _, session = store.create("aaaaaaaaaaaa")
    first = session.claim_stream()
    second = session.claim_stream()
    assert first.is_set()
    assert not second.is_set()
    store.close()
    assert second.is_set()
    assert len(store) == 0


def test_a_key_signing_in_again_and_again_replaces_its_own_sessions(clock: Clock) -> None:
    store = SessionStore(idle_s=60.0, max_s=300.0, capacity=8, per_key=2, clock=clock)
    admin_id, admin = store.create("admin0000000")
    churned = []
    for _ in range(64):
        clock.now += 0.01
        churned.append(store.create("inference000")[1])
    assert store.get(admin_id) is admin  # never signed out by another key's sign-ins
    assert admin.end_reason is None
    assert len(store) == 3
    assert all(s.end_reason == REPLACED_OWN for s in churned[:-2])
    assert all(s.end_reason is None for s in churned[-2:])


def test_a_full_store_takes_from_the_key_holding_the_most(clock: Clock) -> None:
    store = SessionStore(idle_s=60.0, max_s=300.0, capacity=4, per_key=3, clock=clock)
    _, a = store.create("aaaaaaaaaaaa")
    b = [store.create("bbbbbbbbbbbb")[1] for _ in range(3)]
    clock.now += 1
    store.create("cccccccccccc")  # full: b holds the most, its least recently used goes, not a
    assert a.end_reason is None
    assert b[0].end_reason == REPLACED
    assert [s.end_reason for s in b[1:]] == [None, None]
