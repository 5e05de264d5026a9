"""Usage sealed into the audit chain: each hour's totals once it is over, so that an edit of a
token count, a removed or an added row, or a lowered quota total shows (`edgellmctl audit
verify`, the daemon's start and its hourly check) while an honest ledger never reads as edited,
whatever moment a commit or a kill falls on."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from edgellmctl.__main__ import main as ctl
from edgellmd.ledger import audit, seals, store, usage
from edgellmd.ledger.store import Ledger, Quota
from edgellmd.ledger.usage import UsageRecord

KEY = "aaaaaaaaaaaa"


class Clock:
    def __init__(self, text: str) -> None:
        self.now = _at(text)

    def __call__(self) -> float:
        return self.now


def _at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def _record(rid: str, at: str, *, key: str = KEY, prompt: int = 10, completion: int = 5) -> UsageRecord:
    return UsageRecord(rid, key, "m", "/v1/chat/completions", prompt, completion, _at(at))


def _seal_records(path: Path) -> list[dict[str, object]]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT seq, detail FROM audit WHERE action = ? ORDER BY seq", (seals.SEALED,))
        return [{"seq": seq, **json.loads(detail)} for seq, detail in rows]
    finally:
        conn.close()


def _edit(path: Path, sql: str, *args: object) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute(sql, args).rowcount >= 1
    finally:
        conn.close()


def _verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = ctl(["audit", "verify", "--database", str(path)])
    return code, capsys.readouterr().out


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.sqlite3"


@pytest.fixture
def clock() -> Clock:
    return Clock("2026-12-03T10:20:00")


@pytest.fixture
def ledger(path: Path, clock: Clock) -> Iterator[Ledger]:
    opened = Ledger(path, clock=clock)
    yield opened
    opened.close()


def _two_sealed_hours(ledger: Ledger, clock: Clock) -> None:
    """Usage in the hours from 10:00 and 11:00, both over and sealed by 12:05."""
    ledger.record(_record("r1", "2026-12-03T10:21:00")).result(5)
    ledger.record(_record("r2", "2026-12-03T10:40:00", completion=7)).result(5)
    clock.now = _at("2026-12-03T11:05:00")
    ledger.record(_record("r3", "2026-12-03T11:04:00", key="bbbbbbbbbbbb")).result(5)  # seals 10:00
    clock.now = _at("2026-12-03T12:05:00")
    ledger.tick()  # no request comes: the hour from 11:00 is sealed all the same
    ledger.query(lambda conn: None).result(5)  # the writer has run the tick's commit


def test_each_hour_is_sealed_once_over_and_an_honest_ledger_verifies(
    ledger: Ledger, clock: Clock, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger.record(_record("r0", "2026-12-03T10:20:00")).result(5)
    assert _seal_records(path) == []  # the hour in progress is not sealed
    _two_sealed_hours(ledger, clock)
    sealed = _seal_records(path)
    assert [
        (s["hour"], s["rows"], s["requests"], s["prompt_tokens"], s["completion_tokens"]) for s in sealed
    ] == [
        ("2026-12-03T10:00Z", 1, 3, 30, 17),
        ("2026-12-03T11:00Z", 1, 1, 10, 5),
    ]
    assert all(s["usage_retention_days"] == 400 for s in sealed)
    code, out = _verify(path, capsys)
    assert code == 0, out
    assert "usage intact: 2 sealed hour(s) match their seals" in out
    assert ledger.status()["usage_seals"]["ok"] is True
    # The chain and its seals stay whole as the chain verifies them.
    assert audit.verify(sqlite3.connect(path)).ok


def test_a_record_that_lands_in_an_hour_over_reseals_it_in_the_same_commit(
    ledger: Ledger, clock: Clock, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request that ended at 10:59 and committed after the hour's seal (or a record retried
    after a failed commit): its hour is sealed again with it, never left to read as edited."""
    _two_sealed_hours(ledger, clock)
    first = _seal_records(path)[0]
    ledger.record(_record("late", "2026-12-03T10:59:59", prompt=100)).result(5)
    resealed = _seal_records(path)[-1]
    assert (resealed["hour"], resealed["requests"], resealed["prompt_tokens"]) == (
        "2026-12-03T10:00Z",
        3,
        120,
    )
    assert resealed["resealed"] == first["seq"]
    code, out = _verify(path, capsys)
    assert code == 0, out
    assert "2 sealed hour(s)" in out


@pytest.mark.parametrize(
    ("edit", "found"),
    [
        (
            "UPDATE usage_hours SET completion_tokens = 1 WHERE hour = {h}",
            "differ from it (1 row(s), 2 request(s), 21 token(s) now)",
        ),
        ("UPDATE usage_hours SET prompt_tokens = 'ten' WHERE hour = {h}", "differ from it"),
        ("DELETE FROM usage_hours WHERE hour = {h}", "its rows are gone"),
        (
            "INSERT INTO usage_hours VALUES ({h}, 'cccccccccccc', 'm', '/v1/embeddings', 1, 9, 0)",
            "differ from it (2 row(s), 3 request(s), 41 token(s) now)",
        ),
    ],
)
def test_an_edit_of_a_sealed_hour_is_found_by_verify_and_by_the_daemons_start(
    path: Path,
    clock: Clock,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    edit: str,
    found: str,
) -> None:
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    ten = int(_at("2026-12-03T10:00:00"))
    _edit(path, edit.format(h=ten))
    code, out = _verify(path, capsys)
    assert code == 1, out
    assert "audit chain intact" in out  # the chain is whole: the usage beside it is not
    assert "usage EDITED" in out
    sealed = "its seal (record 1) holds 1 row(s), 2 request(s), 32 token(s)"
    assert f"usage of the hour 2026-12-03T10:00Z was edited: {sealed}" in out
    assert found in out
    assert ctl(["audit", "verify", "--database", str(path), "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert (answer["ok"], answer["usage"]["ok"], answer["usage"]["problems"]) == (False, False, 1)

    caplog.set_level(logging.ERROR, logger="edgellmd.ledger")
    again = Ledger(path, clock=clock)
    try:
        state = again.status()["usage_seals"]
        assert (state["ok"], state["sealed_hours"], state["problems"]) == (False, 1, 1)
        assert found in state["problem"]
        assert any(found in r.getMessage() and "tampering?" in r.getMessage() for r in caplog.records)
        told = again.query(lambda conn: audit.select(conn, action=seals.TAMPERED)).result(5)
        assert [(r.level, r.detail["problems"]) for r in told] == [("ERROR", 1)]
        assert found in str(told[0].detail["first"])
        # A record for the edited hour never reseals it: the edit stays found.
        again.record(_record("late", "2026-12-03T10:30:00")).result(5)
        again.maintain().result(5)
        assert again.status()["usage_seals"]["problems"] == 1
        assert (
            len(again.query(lambda conn: audit.select(conn, action=seals.TAMPERED)).result(5)) == 1
        )  # said once
    finally:
        again.close()
    assert _verify(path, capsys)[0] == 1


def test_rows_added_for_an_hour_between_sealed_hours_are_found(
    ledger: Ledger, clock: Clock, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_sealed_hours(ledger, clock)
    nine = int(_at("2026-12-03T09:00:00"))
    _edit(path, "INSERT INTO usage_hours VALUES (?, ?, 'm', '/v1/chat/completions', 2, 20, 2)", nine, KEY)
    code, out = _verify(path, capsys)
    assert code == 1
    assert "usage of the hour 2026-12-03T09:00Z has no seal though later hours are sealed" in out
    # The running daemon finds it at its next check (hourly, or a whole walk of /admin/audit).
    ledger.maintain().result(5)
    state = ledger.status()["usage_seals"]
    assert state["problems"] == 1
    assert "added by another hand" in state["problem"]


def test_an_edit_while_the_daemon_runs_is_found_by_its_next_whole_walk(
    ledger: Ledger, clock: Clock, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/admin/audit's whole walks digest the usage again only when another connection wrote to
    the database since the last check (`PRAGMA data_version`), at most every FULL_VERIFY_S."""
    _two_sealed_hours(ledger, clock)
    digests = 0
    real_check = seals.check

    def counted(*args: Any, **kwargs: Any) -> seals.Findings:
        nonlocal digests
        digests += 1
        return real_check(*args, **kwargs)

    monkeypatch.setattr(seals, "check", counted)
    monkeypatch.setattr(store, "FULL_VERIFY_S", 0.0)
    # The daemon's own commits since the start's check: nothing to digest again.
    assert ledger.check_usage(whole_walk=True).result(5).problems == []
    assert digests == 0
    _edit(path, "UPDATE usage_hours SET requests = 0 WHERE hour = ?", int(_at("2026-12-03T11:00:00")))
    found = ledger.check_usage(whole_walk=True).result(5)
    assert digests == 1
    assert len(found.problems) == 1
    state = ledger.status()["usage_seals"]
    assert (state["ok"], state["problems"]) == (False, 1)
    assert "2026-12-03T11:00Z" in state["problem"]
    # Said once in the chain, however often it is found again.
    assert ledger.check_usage(whole_walk=True).result(5).problems == found.problems
    assert len(_told(ledger)) == 1
    # Within FULL_VERIFY_S of the last check, another hand's write waits for the next walk.
    monkeypatch.setattr(store, "FULL_VERIFY_S", 3600.0)
    _edit(path, "UPDATE usage_hours SET requests = 9 WHERE hour = ?", int(_at("2026-12-03T10:00:00")))
    ledger.check_usage(whole_walk=True).result(5)
    assert digests == 1
    # The hourly maintenance digests it whatever the walks did.
    ledger.maintain().result(5)
    assert digests == 2
    assert ledger.status()["usage_seals"]["problems"] == 2


def test_the_usage_check_runs_beside_the_commits(
    ledger: Ledger, clock: Clock, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check digests every hour kept (seconds on a large ledger): on the writer it would hold
    every commit, and every answer waiting for its usage, that long. It reads a committed state
    of its own while records commit, and what it finds holds."""
    _two_sealed_hours(ledger, clock)
    started, release = threading.Event(), threading.Event()
    real_check = seals.check

    def held(*args: Any, **kwargs: Any) -> seals.Findings:
        started.set()
        assert release.wait(10)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(seals, "check", held)
    monkeypatch.setattr(store, "USAGE_FRESH_S", 0.0)  # the start's check was just now
    checking = ledger.maintain()
    assert started.wait(5)
    # While the check is held, records commit (a late one reseals its hour) and are read back.
    assert ledger.record(_record("r4", "2026-12-03T12:06:00")).result(5) is True
    assert ledger.record(_record("late", "2026-12-03T11:59:59")).result(5) is True
    assert (
        ledger.query(lambda conn: conn.execute("SELECT count(*) FROM usage_requests").fetchone()[0]).result(5)
        == 5
    )
    release.set()
    found = checking.result(5)
    assert found.problems == []
    assert found.sealed == 2
    assert ledger.status()["usage_seals"]["ok"] is True


def test_a_check_that_cannot_read_is_said_never_a_pass(
    ledger: Ledger, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    _two_sealed_hours(ledger, clock)

    def broken(*args: Any, **kwargs: Any) -> seals.Findings:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(seals, "check", broken)
    monkeypatch.setattr(store, "USAGE_FRESH_S", 0.0)
    found = ledger.maintain().result(5)
    assert found.problems == [
        "the usage could not be checked against its seals: OperationalError: disk I/O error"
    ]
    assert ledger.status()["usage_seals"]["ok"] is False
    monkeypatch.undo()
    monkeypatch.setattr(store, "USAGE_FRESH_S", 0.0)
    assert ledger.maintain().result(5).problems == []  # and the next one that can, passes
    assert ledger.status()["usage_seals"]["ok"] is True


def test_hours_pruned_with_the_retention_are_no_edit_and_the_newest_seal_says_the_retention(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit verify` reads the usage retention from the newest seal: a retention shortened
    restates it, so the hours it prunes read as pruned, not removed."""
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    clock.now = _at("2026-12-05T12:30:00")  # two days on
    short = Ledger(path, clock=clock, retention_days=1)
    try:
        short.maintain().result(5)  # prunes the hours of the 3rd; restates the newest seal
        assert short.query(seals.figures).result(5) == {}
        newest = _seal_records(path)[-1]
        assert (newest["hour"], newest["usage_retention_days"]) == ("2026-12-03T11:00Z", 1)
        assert short.status()["usage_seals"]["ok"] is True
    finally:
        short.close()
    code, out = _verify(path, capsys)
    assert code == 0, out


def test_a_quota_total_lowered_while_the_daemon_was_stopped_is_put_back_at_its_start(
    path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A key's day total edited down would give it its budget again: the start finds the total
    below what the day's hours hold, puts it back and says so in the log and the chain."""
    clock = Clock("2026-12-03T15:10:00")
    first = Ledger(path, clock=clock, time_zone="Europe/Berlin")
    for i, at in enumerate(("2026-12-03T09:10:00", "2026-12-03T13:10:00", "2026-12-03T15:05:00")):
        first.record(_record(f"r{i}", at, prompt=30, completion=0)).result(5)
    first.close()
    _edit(path, "UPDATE usage_periods SET tokens = 0, requests = 0 WHERE period = 'day:2026-12-03'")
    _edit(path, "UPDATE usage_periods SET tokens = 'none' WHERE period = 'month:2026-12'")
    caplog.set_level(logging.ERROR, logger="edgellmd.ledger")
    again = Ledger(path, clock=clock, time_zone="Europe/Berlin")
    try:
        assert again.used(KEY) == {
            "requests_day": 3,
            "tokens_day": 90,
            "requests_month": 3,
            "tokens_month": 90,
        }
        breach = again.check(KEY, Quota(tokens_per_day=90))
        assert breach is not None
        assert breach.used == 90
        told = again.query(lambda conn: audit.select(conn, action=seals.TAMPERED)).result(5)
        assert [r.detail["problems"] for r in told] == [2]
        assert "the quota total of key aaaaaaaaaaaa for day:2026-12-03 was edited" in str(
            told[0].detail["named"]
        )
        assert sum("quota total" in r.getMessage() for r in caplog.records) == 2
    finally:
        again.close()
    third = Ledger(path, clock=clock, time_zone="Europe/Berlin")  # put back on disk: said once
    try:
        assert third.used(KEY)["tokens_day"] == 90
        assert len(third.query(lambda conn: audit.select(conn, action=seals.TAMPERED)).result(5)) == 1
    finally:
        third.close()
    assert _verify(path, capsys)[0] == 0


def test_a_quota_total_in_a_zone_of_half_hours_is_bounded_by_the_hours_it_straddles(path: Path) -> None:
    """In Kolkata (UTC+5:30) a day begins at 18:30 UTC: the hour from 18:00 is half in each
    day, so a day's total may hold it or not. Honest totals are never 'put back'."""
    clock = Clock("2026-12-03T20:00:00")
    first = Ledger(path, clock=clock, time_zone="Asia/Kolkata")
    first.record(_record("before", "2026-12-03T18:10:00")).result(5)  # the 3rd, local
    first.record(_record("after", "2026-12-03T18:50:00")).result(5)  # the 4th, local
    first.record(_record("later", "2026-12-03T19:50:00")).result(5)
    first.close()
    again = Ledger(path, clock=clock, time_zone="Asia/Kolkata")
    try:
        assert again.used(KEY)["requests_day"] == 2
        assert again.status()["usage_seals"]["ok"] is True
        assert again.query(lambda conn: audit.select(conn, action=seals.TAMPERED)).result(5) == []
    finally:
        again.close()
    _edit(path, "UPDATE usage_periods SET requests = 0, tokens = 0 WHERE period = 'day:2026-12-04'")
    third = Ledger(path, clock=clock, time_zone="Asia/Kolkata")
    try:
        # The hour from 19:00 is wholly the 4th's: the least the day holds; the straddled hour may
        # or may not be the day's, so the total is put back to the floor, 1 request.
        assert third.used(KEY)["requests_day"] == 1
    finally:
        third.close()


def test_a_failed_seal_leaves_nothing_half_written_and_a_retry_seals_it(
    ledger: Ledger,
    clock: Clock,
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The rows of an hour over and its seal commit together: a commit that fails on the seal
    (a full disk) writes neither, and the retry writes both, so no moment reads as edited."""
    ledger.record(_record("r1", "2026-12-03T10:21:00")).result(5)
    clock.now = _at("2026-12-03T11:01:00")
    real = audit.append
    failed = {"n": 0}

    def full(conn: sqlite3.Connection, entry: audit.AuditEntry, last: tuple[int, str]) -> tuple[int, str]:
        if entry.action == seals.SEALED and failed["n"] == 0:
            failed["n"] += 1
            raise sqlite3.OperationalError("database or disk is full")
        return real(conn, entry, last)

    monkeypatch.setattr(audit, "append", full)
    with pytest.raises(OSError, match="disk is full"):
        ledger.record(_record("r2", "2026-12-03T10:59:00")).result(5)
    assert seals.check(sqlite3.connect(path), clock.now).problems == []
    assert _seal_records(path) == []
    ledger.retry().result(5)
    assert [(s["requests"]) for s in _seal_records(path)] == [2]
    assert _verify(path, capsys)[0] == 0


def test_hours_whose_seals_went_with_the_chains_rotation_are_unverifiable_not_edited(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = Clock("2026-12-03T10:20:00")
    first = Ledger(path, clock=clock, audit_retention_days=1)
    _two_sealed_hours(first, clock)
    clock.now = _at("2026-12-05T12:30:00")
    first.record(_record("r9", "2026-12-05T11:00:00")).result(5)  # sealed now: the hour is over
    first.maintain().result(5)  # the seals of the 3rd go with the chain's rotation
    state = first.status()["usage_seals"]
    first.close()
    assert (state["ok"], state["sealed_hours"], state["unverifiable_hours"]) == (True, 1, 2)
    code, out = _verify(path, capsys)
    assert code == 0, out
    assert "2 hour(s) whose seals went with the chain's rotation, unchecked" in out


@pytest.mark.parametrize("table", ["usage_hours", "usage_periods"])
def test_text_that_is_not_utf8_in_the_usage_is_an_edit_found_not_a_failed_start(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], table: str
) -> None:
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    _edit(path, f"UPDATE {table} SET key_id = CAST(x'ff' AS TEXT) WHERE key_id = ?", KEY)  # noqa: S608
    again = Ledger(path, clock=clock)  # opens and serves: the edit is said, not a crash
    try:
        again.record(_record("r9", "2026-12-03T12:06:00")).result(5)
        told = again.query(lambda conn: audit.select(conn, action=seals.TAMPERED)).result(5)
        assert len(told) == 1
        if table == "usage_hours":
            assert "usage of the hour 2026-12-03T10:00Z was edited" in str(told[0].detail["first"])
        else:  # the key's total is under a name no key has: the key's own is put back from its hours
            assert "the quota total of key aaaaaaaaaaaa" in str(told[0].detail["named"])
            assert again.used(KEY)["requests_month"] == 3
    finally:
        again.close()
    code, out = _verify(path, capsys)
    assert code == (1 if table == "usage_hours" else 0)
    if table == "usage_hours":
        assert "usage of the hour 2026-12-03T10:00Z was edited" in out


def _told(ledger: Ledger) -> list[str]:
    return [
        str(r.detail["named"])
        for r in ledger.query(lambda c: audit.select(c, action=seals.TAMPERED)).result(5)
    ]


def test_a_clock_stepped_back_over_a_sealed_hour_reseals_it_and_reads_as_honest(
    ledger: Ledger, clock: Clock, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NTP steps the clock back into an hour already sealed (or a box boots a day behind): a
    record for it reseals it at once, never an 'edited' or 'added by another hand' later."""
    _two_sealed_hours(ledger, clock)
    clock.now = _at("2026-12-03T11:59:50")  # back into the hour from 11:00, sealed at 12:05
    ledger.record(_record("back", "2026-12-03T11:59:55")).result(5)
    clock.now = _at("2026-12-03T09:30:00")  # a day's worth further back: an hour never sealed
    ledger.record(_record("boot", "2026-12-03T09:31:00")).result(5)
    clock.now = _at("2026-12-03T12:30:00")
    ledger.maintain().result(5)
    assert ledger.status()["usage_seals"]["problems"] == 0
    assert _told(ledger) == []
    code, out = _verify(path, capsys)
    assert code == 0, out
    assert "3 sealed hour(s)" in out


def test_a_retention_lengthened_keeps_the_hours_a_shorter_one_pruned_as_pruned(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pruned with a 1-day retention, the hours are gone; started again with 30 days they are
    not 'removed', and the month's total is not lowered to what the hours left hold."""
    clock = Clock("2026-12-03T10:20:00")
    first = Ledger(path, clock=clock, retention_days=1)
    _two_sealed_hours(first, clock)
    clock.now = _at("2026-12-05T12:30:00")
    first.maintain().result(5)  # prunes the 3rd
    first.close()
    longer = Ledger(path, clock=clock, retention_days=30)
    try:
        assert longer.status()["usage_seals"]["ok"] is True
        assert _told(longer) == []
        assert longer.used(KEY)["tokens_month"] == 32  # the total stands: its hours went by pruning
    finally:
        longer.close()
    code, out = _verify(path, capsys)
    assert code == 0, out


def test_a_period_whose_first_hour_straddles_the_retention_cut_is_not_said_to_be_over(path: Path) -> None:
    """In Kolkata a day begins at 18:30 UTC: pruning at 18:45 on the last day of the retention
    removes the hour from 18:00, half the new day's; the day's total holds more than the hours
    left, honestly."""
    clock = Clock("2026-12-06T18:40:00")
    first = Ledger(path, clock=clock, time_zone="Asia/Kolkata", retention_days=1)
    first.record(_record("in-straddle", "2026-12-06T18:35:00")).result(5)  # the 7th, local
    clock.now = _at("2026-12-07T18:20:00")  # 23:50 on the 7th, local
    first.record(_record("later", "2026-12-07T18:10:00")).result(5)
    first.maintain().result(5)  # prunes the hour from 2026-12-06T18:00
    first.close()
    clock.now = _at("2026-12-07T18:25:00")
    again = Ledger(path, clock=clock, time_zone="Asia/Kolkata", retention_days=1)
    try:
        assert again.used(KEY)["requests_day"] == 2
        assert _told(again) == []
    finally:
        again.close()


def test_an_edited_hour_leaves_the_others_to_bound_a_lowered_total(path: Path, clock: Clock) -> None:
    """An edit of another key's sealed hour must not switch the period's floor off: the hours
    found whole still hold this key's total up, and a total is never lowered."""
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    _edit(path, "UPDATE usage_hours SET prompt_tokens = 11 WHERE key_id = 'bbbbbbbbbbbb'")
    _edit(path, "UPDATE usage_periods SET requests = 0, tokens = 0 WHERE key_id = ?", KEY)
    again = Ledger(path, clock=clock)
    try:
        assert again.used(KEY)["tokens_day"] == 32  # from its own hour, found whole
        told = _told(again)
        assert len(told) == 1
        assert "2026-12-03T11:00Z was edited" in told[0]
        assert "the quota total of key aaaaaaaaaaaa for day:2026-12-03 was edited" in told[0]
    finally:
        again.close()


BIG = 2**63 - 1
NINE = int(_at("2026-12-03T09:00:00"))


@pytest.mark.parametrize(
    ("edit", "usage_ok"),
    [
        ("INSERT INTO usage_hours VALUES (CAST(x'ff' AS TEXT), 'k', 'm', 'e', 1, 1, 1)", False),
        (f"INSERT INTO usage_hours VALUES ({NINE}, 'b', 'm', 'e', {BIG}, {BIG}, 5)", False),  # noqa: S608
        # The seal record itself: the chain's break, and its hour unsealed before the stop's mark.
        ("UPDATE audit SET detail = CAST(x'ff' AS TEXT) WHERE seq = 2", False),
        (f"UPDATE usage_periods SET tokens = {BIG}", True),  # noqa: S608 - said at the start
    ],
)
def test_odd_values_in_the_usage_are_an_edit_found_never_a_failed_start_or_a_silent_check(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], edit: str, usage_ok: bool
) -> None:
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    _edit(path, edit)
    again = Ledger(path, clock=clock)
    try:
        again.record(_record("r9", "2026-12-03T12:06:00")).result(5)
        again.maintain().result(5)
        state = again.status()["usage_seals"]
    finally:
        again.close()
    code, out = _verify(path, capsys)
    assert state["ok"] is usage_ok
    assert code == (0 if "usage_periods" in edit else 1), out


def test_an_hour_edited_while_running_is_found_when_a_record_lands_in_it_not_sealed_over(
    ledger: Ledger, clock: Clock, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record landing late in a sealed hour reseals it: an edit made since its seal would be
    blessed by the new seal. The hour is checked against its seal first, found and said."""
    _two_sealed_hours(ledger, clock)
    _edit(path, "UPDATE usage_hours SET prompt_tokens = 0 WHERE hour = ?", int(_at("2026-12-03T10:00:00")))
    ledger.record(_record("late", "2026-12-03T10:59:59")).result(5)
    assert [s["hour"] for s in _seal_records(path)] == ["2026-12-03T10:00Z", "2026-12-03T11:00Z"]  # none new
    told = _told(ledger)
    assert len(told) == 1
    assert "2026-12-03T10:00Z was edited: its rows differ from its seal (record 1)" in told[0]
    assert ledger.status()["usage_seals"]["ok"] is False
    code, out = _verify(path, capsys)
    assert code == 1
    assert "usage of the hour 2026-12-03T10:00Z was edited" in out


def test_a_time_zone_changed_between_starts_counts_the_new_days_from_their_hours_unalarmed(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock("2026-12-03T23:30:00")  # the 3rd in UTC, the 4th in Berlin
    first = Ledger(path, clock=clock)
    first.record(_record("r1", "2026-12-03T23:10:00")).result(5)
    clock.now = _at("2026-12-04T00:10:00")
    first.record(_record("r2", "2026-12-04T00:05:00")).result(5)  # seals the hour from 23:00
    first.close()
    caplog.set_level(logging.INFO, logger="edgellmd.ledger")
    berlin = Ledger(path, clock=clock, time_zone="Europe/Berlin")
    try:
        assert berlin.used(KEY)["requests_day"] == 2  # both are the 4th in Berlin
        assert _told(berlin) == []
        assert any("time zone changed from UTC to Europe/Berlin" in r.getMessage() for r in caplog.records)
    finally:
        berlin.close()
    again = Ledger(path, clock=clock, time_zone="Europe/Berlin")  # written back, restated: quiet
    try:
        assert again.used(KEY)["requests_day"] == 2
        assert _told(again) == []
    finally:
        again.close()


# ---- quiet hours, a clean stop, the hours no daemon ran, hours ahead of the clock -------------------


def _add_hour(path: Path, at: str, key: str = KEY) -> None:
    _edit(
        path,
        "INSERT INTO usage_hours VALUES (?, ?, 'm', '/v1/chat/completions', 1000, 90000, 10000)",
        int(_at(at)),
        key,
    )


def _actions(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [action for (action,) in conn.execute("SELECT action FROM audit ORDER BY seq")]
    finally:
        conn.close()


def test_rows_added_to_a_quiet_hour_after_the_last_seal_are_found_once_the_daemon_stopped_clean(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only hours with rows are sealed: the quiet hours after the last one read as open (the
    hour in progress, or the one the daemon stopped in), and rows added to them were sealed as
    found at the next start, their tokens counted in the key's quota totals. A clean stop seals
    what it holds and says every hour before the next is sealed."""
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)  # 10:00 and 11:00 sealed at 12:05
    clock.now = _at("2026-12-03T14:30:00")
    first.close()
    assert _actions(path)[-1] == seals.STOPPED
    _add_hour(path, "2026-12-03T12:00:00")
    _add_hour(path, "2026-12-03T14:00:00")  # the hour it stopped in
    code, out = _verify(path, capsys)
    assert code == 1, out
    for hour in ("12:00Z", "14:00Z"):
        assert (
            f"usage of the hour 2026-12-03T{hour} has no seal though every hour before 2026-12-03T15:00Z "
            "was sealed: added by another hand (1 row(s), 1000 request(s), 100000 token(s))"
        ) in out
    clock.now = _at("2026-12-03T15:10:00")
    again = Ledger(path, clock=clock)
    try:
        state = again.status()["usage_seals"]
        assert (state["ok"], state["problems"], state["open_hours"]) == (False, 2, 0)
        assert again.used(KEY)["requests_month"] == 2  # the added hours count for nothing
        again.record(_record("honest", "2026-12-03T15:11:00")).result(5)
    finally:
        again.close()
    assert [s["hour"] for s in _seal_records(path)][-1] == "2026-12-03T15:00Z"  # none of theirs
    assert _verify(path, capsys)[0] == 1


def test_rows_added_for_the_hours_no_daemon_ran_are_found_and_an_honest_restart_is_not(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()  # at 12:05: every hour before 13:00 sealed
    _add_hour(path, "2026-12-03T15:00:00")
    clock.now = _at("2026-12-03T17:20:00")
    again = Ledger(path, clock=clock)
    try:
        state = again.status()["usage_seals"]
        assert (state["ok"], state["problems"]) == (False, 1)
        down = "usage of the hour 2026-12-03T15:00Z has no seal and falls while no daemon ran"
        assert down in state["problem"]
        again.record(_record("after", "2026-12-03T17:25:00")).result(5)  # honest: its hour is open
        again.maintain().result(5)
        assert again.status()["usage_seals"]["problems"] == 1
        clock.now = _at("2026-12-03T18:05:00")
        again.tick()
        again.query(lambda conn: None).result(5)  # the writer has run the tick's commit
    finally:
        again.close()
    assert [s["hour"] for s in _seal_records(path)][-1] == "2026-12-03T17:00Z"
    actions = _actions(path)
    assert actions.count(seals.STOPPED) == 2
    assert actions.count(seals.RESUMED) == 1
    code, out = _verify(path, capsys)
    assert code == 1, out
    assert out.count("added by another hand") == 1
    assert "2026-12-03T15:00Z" in out


def test_honest_stops_and_starts_in_every_order_verify_intact(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart in the hour it stopped in, one hours later, usage in the hour of a stop (sealed
    at the stop, sealed again by a record after the restart): no problem anywhere."""
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.record(_record("stop-hour", "2026-12-03T12:06:00")).result(5)
    clock.now = _at("2026-12-03T12:10:00")
    first.close()  # seals 12:00 in progress
    assert _seal_records(path)[-1]["hour"] == "2026-12-03T12:00Z"
    clock.now = _at("2026-12-03T12:30:00")
    second = Ledger(path, clock=clock)
    try:
        second.record(_record("same-hour", "2026-12-03T12:31:00")).result(5)  # reseals 12:00
        assert second.status()["usage_seals"]["problems"] == 0
    finally:
        second.close()
    clock.now = _at("2026-12-03T16:00:00")
    third = Ledger(path, clock=clock)
    try:
        third.record(_record("later", "2026-12-03T16:10:00")).result(5)
        third.maintain().result(5)
        assert third.status()["usage_seals"]["problems"] == 0
        assert third.used(KEY)["requests_month"] == 5
    finally:
        third.close()
    code, out = _verify(path, capsys)
    assert code == 0, out
    assert "usage intact: 4 sealed hour(s) match their seals" in out
    assert "after the last seal" not in out  # nothing open: the stop sealed 16:00


def test_a_ledger_that_never_held_usage_writes_no_stop_record(path: Path, clock: Clock) -> None:
    Ledger(path, clock=clock).close()
    Ledger(path, clock=clock).close()
    assert seals.STOPPED not in _actions(path)


@pytest.mark.parametrize("hour", ["2026-12-03T13:00:00", "2026-12-04T12:00:00", "2100-01-01T00:00:00"])
def test_rows_in_an_hour_ahead_of_the_clock_are_found(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], hour: str
) -> None:
    """An hour later than the clock can be neither the hour in progress nor the one the daemon
    stopped in: it was open until it came, then sealed as found."""
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    _add_hour(path, hour)
    again = Ledger(path, clock=clock)
    try:
        state = again.status()["usage_seals"]
        assert (state["ok"], state["open_hours"]) == (False, 0)
        ahead = f"usage of the hour {hour[:13]}:00Z is ahead of the clock (2026-12-03T12:00Z)"
        assert ahead in state["problem"]
    finally:
        again.close()


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE usage_hours SET key_id = CAST(key_id AS BLOB) WHERE hour = {h}",
        "UPDATE usage_hours SET model = 42 WHERE hour = {h}",
        "UPDATE usage_hours SET endpoint = 7 WHERE hour = {h}",
    ],
)
def test_a_text_cell_retyped_is_an_edit_found_and_the_usage_still_reads(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], edit: str
) -> None:
    """A key id turned into a blob of the same bytes digested the same (read as bytes alone),
    so the seals said intact, while every text lookup missed the row and /admin/usage answered
    500 (text and bytes sorted together)."""
    first = Ledger(path, clock=clock)
    _two_sealed_hours(first, clock)
    first.close()
    ten = int(_at("2026-12-03T10:00:00"))
    _edit(path, edit.format(h=ten))
    _add_hour(path, "1990-01-01T00:00:00")  # and one far before: an hour of another era
    _edit(path, "UPDATE usage_hours SET hour = 10000000000000000 WHERE hour < 700000000")
    code, out = _verify(path, capsys)
    assert code == 1, out
    assert "usage of the hour 2026-12-03T10:00Z was edited" in out
    conn = sqlite3.connect(path)
    try:
        rows = usage.select(conn, usage.UsageQuery(group="hour"), ZoneInfo("UTC"))
    finally:
        conn.close()
    assert sum(row["requests"] for row in rows) == 3  # every sealed row counted, as text
    assert all(isinstance(row[k], str) for row in rows for k in ("key_id", "model", "endpoint"))


def test_a_clock_stepped_back_past_a_seals_mark_or_behind_its_own_hour_reads_as_honest(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marks and the hours ahead of the clock against the daemon's own records: a record
    after the clock stepped back into a quiet hour before the newest mark is sealed at once (it
    read as added by another hand), and the daemon's own hour now ahead of the clock is its own
    hour in progress, sealed at the stop."""
    monkeypatch.setattr(store, "USAGE_FRESH_S", 0.0)  # every maintenance checks
    ledger = Ledger(path, clock=clock)
    try:
        ledger.record(_record("r1", "2026-12-03T10:21:00")).result(5)
        clock.now = _at("2026-12-03T13:05:00")
        ledger.tick()  # 10:00 sealed, its mark 13:00: 11:00 and 12:00 quiet
        ledger.record(_record("r2", "2026-12-03T13:06:00")).result(5)
        clock.now = _at("2026-12-03T15:10:00")
        ledger.record(_record("r3", "2026-12-03T15:10:00")).result(5)  # its hour in progress: 15:00
        clock.now = _at("2026-12-03T11:30:00")  # stepped back 3 h 40 min
        ledger.record(_record("back", "2026-12-03T11:31:00")).result(5)
        ledger.maintain().result(5)
        state = ledger.status()["usage_seals"]
        assert (state["ok"], state["problems"]) == (True, 0), state
        assert _told(ledger) == []
        assert "2026-12-03T11:00Z" in [s["hour"] for s in _seal_records(path)]
    finally:
        ledger.close()
    code, out = _verify(path, capsys)
    assert code == 0, out
    assert "usage intact: 4 sealed hour(s) match their seals" in out  # 10, 11, 13 and 15 (at the stop)


def test_a_record_after_the_clock_stepped_back_into_a_quiet_hour_before_the_mark_is_sealed_at_once(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(path, clock=clock)
    try:
        ledger.record(_record("r1", "2026-12-03T10:21:00")).result(5)
        clock.now = _at("2026-12-03T13:05:00")
        ledger.tick()  # 10:00 sealed, its mark 13:00: 11:00 and 12:00 quiet, none sealed after
        ledger.query(lambda conn: None).result(5)
        clock.now = _at("2026-12-03T11:30:00")
        ledger.record(_record("back", "2026-12-03T11:31:00")).result(5)
        assert [s["hour"] for s in _seal_records(path)] == ["2026-12-03T10:00Z", "2026-12-03T11:00Z"]
        monkeypatch.setattr(store, "USAGE_FRESH_S", 0.0)
        ledger.maintain().result(5)
        assert ledger.status()["usage_seals"]["problems"] == 0
    finally:
        ledger.close()
    code, out = _verify(path, capsys)
    assert code == 0, out


def test_a_restart_in_the_hour_a_clean_stop_left_quiet_records_into_it_honestly(
    path: Path, clock: Clock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop at 11:10 (no usage since 11:00) says every hour before 12:00 is sealed; a
    restart at 11:20 records into 11:00 again: read as added by another hand (by `audit verify`
    meanwhile, the running daemon's checks, a start after a kill), and never sealed after."""
    first = Ledger(path, clock=clock)
    first.record(_record("r1", "2026-12-03T10:21:00")).result(5)
    clock.now = _at("2026-12-03T11:05:00")
    first.tick()
    first.query(lambda conn: None).result(5)
    clock.now = _at("2026-12-03T11:10:00")
    first.close()
    clock.now = _at("2026-12-03T11:20:00")
    monkeypatch.setattr(store, "USAGE_FRESH_S", 0.0)
    second = Ledger(path, clock=clock)
    try:
        second.record(_record("r2", "2026-12-03T11:21:00")).result(5)
        code, out = _verify(path, capsys)
        assert code == 0, out
        second.maintain().result(5)
        assert second.status()["usage_seals"]["problems"] == 0
        clock.now = _at("2026-12-03T11:50:00")
        after_kill = Ledger(path, clock=clock)  # the second never closed: as after a kill
        try:
            assert after_kill.status()["usage_seals"]["problems"] == 0
        finally:
            after_kill.close()
    finally:
        second.close()
    assert _verify(path, capsys)[0] == 0
