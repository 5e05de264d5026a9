"""The ledger on its own: usage rows, quota periods in the box's time zone, persistence, retries,
and the audit chain's verification of edited, removed and reordered records."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from edgellmctl.__main__ import main as ctl
from edgellmd.http import logs
from edgellmd.ledger import audit, store, usage
from edgellmd.ledger.audit import AuditEntry
from edgellmd.ledger.store import FULL_VERIFY_S, AuditHandler, Ledger, LedgerError, Quota, utc_text
from edgellmd.ledger.usage import UsageQuery, UsageRecord


class Clock:
    def __init__(self, when: datetime) -> None:
        self.now = when.timestamp()

    def __call__(self) -> float:
        return self.now


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _record(
    rid: str, at: float, *, key: str = "aaaaaaaaaaaa", prompt: int = 10, completion: int = 5
) -> UsageRecord:
    return UsageRecord(rid, key, "m", "/v1/chat/completions", prompt, completion, at)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    opened = Ledger(
        tmp_path / "ledger.sqlite3", time_zone="Europe/Berlin", clock=Clock(datetime(2026, 12, 3, tzinfo=UTC))
    )
    yield opened
    opened.close()


def _rows(ledger: Ledger, query: UsageQuery) -> list[dict[str, object]]:
    return ledger.query(lambda conn: usage.select(conn, query, ledger.zone)).result()


def test_usage_is_summed_per_local_day_and_hour_and_a_request_id_counts_once(ledger: Ledger) -> None:
    # 23:30 UTC on 3 December is 00:30 on the 4th in Berlin: another local day.
    assert ledger.record(_record("r1", _at("2026-12-03T10:15:00+00:00"))).result(5) is True
    assert ledger.record(_record("r2", _at("2026-12-03T10:45:00+00:00"), completion=7)).result(5) is True
    assert ledger.record(_record("r3", _at("2026-12-03T23:30:00+00:00"))).result(5) is True
    assert ledger.record(_record("r1", _at("2026-12-03T10:50:00+00:00"))).result(5) is False  # seen already
    days = _rows(ledger, UsageQuery(group="day"))
    assert [(r["period"], r["requests"], r["total_tokens"]) for r in days] == [
        ("2026-12-03", 2, 32),
        ("2026-12-04", 1, 15),
    ]
    hours = _rows(ledger, UsageQuery(group="hour"))
    assert [r["period"] for r in hours] == ["2026-12-03T11:00+0100", "2026-12-04T00:00+0100"]
    only_4th = _rows(ledger, UsageQuery(since=datetime(2026, 12, 4).date(), group="month"))
    assert [(r["period"], r["requests"]) for r in only_4th] == [("2026-12", 1)]
    assert _rows(ledger, UsageQuery(key_id="bbbbbbbbbbbb")) == []


def test_a_quota_counts_the_local_calendar_and_says_when_it_resets(tmp_path: Path) -> None:
    clock = Clock(datetime(2026, 12, 31, 22, 0, tzinfo=UTC))  # 23:00 in Berlin, the last day of the year
    ledger = Ledger(tmp_path / "l.sqlite3", time_zone="Europe/Berlin", clock=clock)
    quota = Quota(tokens_per_day=40, tokens_per_month=100)
    try:
        assert ledger.check("aaaaaaaaaaaa", quota) is None
        ledger.record(_record("r1", clock.now, prompt=30, completion=15)).result(5)
        breach = ledger.check("aaaaaaaaaaaa", quota)
        assert breach is not None
        assert (breach.budget, breach.limit, breach.used) == ("tokens_per_day", 40, 45)
        assert breach.resets.isoformat() == "2027-01-01T00:00:00+01:00"
        assert "45 of its 40 tokens per day" in breach.message()
        assert ledger.check("bbbbbbbbbbbb", quota) is None  # another key's budget is its own
        clock.now += 3600  # past local midnight: a new day and a new month
        assert ledger.check("aaaaaaaaaaaa", quota) is None
        assert ledger.used("aaaaaaaaaaaa") == {
            "requests_day": 0,
            "tokens_day": 0,
            "requests_month": 0,
            "tokens_month": 0,
        }
    finally:
        ledger.close()


def test_prompts_in_flight_count_against_a_token_budget_until_their_usage_is_recorded(
    ledger: Ledger,
) -> None:
    """Requests that passed the check together each hold their prompt before computing it: the
    next sees them (a day's budget of 100 let 30 requests of 25-token prompts through, 13.5 times
    the budget, as only finished requests counted). What a request held goes as its usage is
    recorded, or when it ends without any."""
    quota = Quota(tokens_per_day=100)
    key = "aaaaaaaaaaaa"
    assert ledger.reserve(key, quota, 40) is None
    assert ledger.reserve(key, quota, 40) is None
    assert ledger.reserve(key, quota, 40) is None  # 80 held: below the budget still, so it passes
    refused = ledger.reserve(key, quota, 40)
    assert refused is not None
    assert (refused.budget, refused.limit, refused.used) == ("tokens_per_day", 100, 120)
    breach = ledger.check(key, quota)  # the front door's check sees the held prompts too
    assert breach is not None
    assert breach.used == 120
    assert ledger.reserve("bbbbbbbbbbbb", quota, 40) is None  # another key's budget is its own
    # One ends with its usage (the prompt and 5 generated), one without any (refused after all).
    ledger.record(_record("r1", ledger._clock(), key=key, prompt=40, completion=5), reserved=40).result(5)
    ledger.unreserve(key, 40)
    assert ledger.check(key, quota) is None  # 45 used and 40 held
    ledger.record(_record("r2", ledger._clock(), key=key, prompt=40, completion=5), reserved=40).result(5)
    assert ledger._reserved == {"bbbbbbbbbbbb": 40}
    assert ledger.used(key)["tokens_day"] == 90
    assert ledger.reserve(key, Quota(), 40) is None  # no token budget: nothing held
    assert key not in ledger._reserved


def test_usage_and_quotas_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock(datetime(2026, 12, 3, 12, tzinfo=UTC))
    path = tmp_path / "l.sqlite3"
    first = Ledger(path, clock=clock)
    for i in range(3):
        first.record(_record(f"r{i}", clock.now, prompt=100, completion=0)).result(5)
    first.close()
    again = Ledger(path, clock=clock)
    try:
        assert again.used("aaaaaaaaaaaa")["tokens_month"] == 300
        breach = again.check("aaaaaaaaaaaa", Quota(requests_per_month=3))
        assert breach is not None
        assert breach.resets.isoformat() == "2027-01-01T00:00:00+00:00"
    finally:
        again.close()
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_failed_commit_is_kept_and_written_once_later(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = usage.write
    calls = {"n": 0}

    def flaky(conn: sqlite3.Connection, record: UsageRecord, zone: object, *, detail: bool) -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real(conn, record, zone, detail=detail)  # type: ignore[arg-type]

    monkeypatch.setattr(usage, "write", flaky)
    with pytest.raises(OSError, match="disk is full"):
        ledger.record(_record("r1", _at("2026-12-03T10:00:00+00:00"))).result(5)
    assert ledger.error is not None
    assert ledger.status()["waiting"] == 1
    ledger.record(_record("r2", _at("2026-12-03T10:01:00+00:00"))).result(5)
    assert ledger.status()["error"] is None
    days = _rows(ledger, UsageQuery())
    assert [(r["requests"], r["total_tokens"]) for r in days] == [(2, 30)]  # both, each once


def _chain(conn: sqlite3.Connection, n: int) -> None:
    head = audit.head(conn)
    conn.execute("BEGIN")
    for _ in range(n):
        seq = head[0] + 1
        head = audit.append(conn, AuditEntry(utc_text(1_796_000_000 + seq), "INFO", f"action {seq}"), head)
    conn.execute("COMMIT")


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    ledger = Ledger(tmp_path / "chain.sqlite3")
    ledger.close()
    conn = sqlite3.connect(tmp_path / "chain.sqlite3", isolation_level=None)
    _chain(conn, 6)
    yield conn
    conn.close()


def test_an_intact_chain_verifies(chain: sqlite3.Connection) -> None:
    verdict = audit.verify(chain)
    assert (verdict.ok, verdict.checked, verdict.first, verdict.last) == (True, 6, 1, 6)


def test_an_edited_record_is_found(chain: sqlite3.Connection) -> None:
    chain.execute("UPDATE audit SET action = 'nothing happened' WHERE seq = 4")
    verdict = audit.verify(chain)
    assert not verdict.ok
    assert verdict.at_seq == 4
    assert "record 4 was edited" in str(verdict.problem)


def test_an_edit_with_a_recomputed_hash_breaks_the_next_link(chain: sqlite3.Connection) -> None:
    row = chain.execute(
        "SELECT seq, at, level, action, key_id, peer, detail, prev FROM audit WHERE seq = 3"
    ).fetchone()
    forged = audit.record_hash(row[7], (row[0], row[1], row[2], "forged", row[4], row[5], row[6]))
    chain.execute("UPDATE audit SET action = 'forged', hash = ? WHERE seq = 3", (forged,))
    verdict = audit.verify(chain)
    assert verdict.at_seq == 4
    assert "does not follow record 3" in str(verdict.problem)


def test_a_removed_record_is_found(chain: sqlite3.Connection) -> None:
    chain.execute("DELETE FROM audit WHERE seq = 2")
    verdict = audit.verify(chain)
    assert verdict.at_seq == 3
    assert "record 2 is missing" in str(verdict.problem)


def test_reordered_records_are_found(chain: sqlite3.Connection) -> None:
    chain.execute("UPDATE audit SET seq = -5 WHERE seq = 5")
    chain.execute("UPDATE audit SET seq = 5 WHERE seq = 2")
    chain.execute("UPDATE audit SET seq = 2 WHERE seq = -5")
    verdict = audit.verify(chain)
    assert verdict.at_seq == 2
    assert not verdict.ok


def test_entries_queued_out_of_time_order_still_make_an_honest_chain(ledger: Ledger) -> None:
    """Two threads stamp their entries and queue them in the other order, or the wall clock
    steps back: the chain must not read as reordered. The later-queued entry takes its
    predecessor's time."""
    seqs = [
        ledger.audit(AuditEntry("2026-12-03T10:00:00.500Z", "INFO", "stamped second, queued first")),
        ledger.audit(AuditEntry("2026-12-03T10:00:00.400Z", "INFO", "stamped first, queued second")),
    ]
    assert [f.result(5) for f in seqs] == [1, 2]
    later = ledger.audit(AuditEntry("2026-12-03T09:00:00.000Z", "INFO", "after the clock stepped back"))
    assert later.result(5) == 3
    verdict = ledger.query(audit.verify).result(5)
    assert (verdict.ok, verdict.checked) == (True, 3), verdict.problem
    ats = [r.at for r in ledger.query(audit.select).result(5)]
    assert ats == ["2026-12-03T10:00:00.500Z"] * 3


def _rotate(conn: sqlite3.Connection, before: float) -> int:
    conn.execute("BEGIN")
    gone, _, _ = audit.rotate(conn, utc_text(before), audit.head(conn), utc_text(1_796_000_100))
    conn.execute("COMMIT")
    return gone


def test_rotation_keeps_the_rest_verifiable_and_removals_still_show(chain: sqlite3.Connection) -> None:
    assert _rotate(chain, 1_796_000_004) == 3  # records 1 to 3 went
    verdict = audit.verify(chain)
    assert (verdict.ok, verdict.checked, verdict.first) == (True, 4, 4), (
        verdict.problem
    )  # 4-6 and the rotation's
    named = audit.select(chain, action=audit.ROTATED)
    assert [(r.seq, r.detail["anchor"], r.detail["removed"]) for r in named] == [(7, 3, 3)]
    _chain(chain, 1)  # the chain goes on from its head
    assert audit.verify(chain).checked == 5
    assert _rotate(chain, 1_796_000_006) == 2  # 4 and 5: the anchor is 5 now, named by record 9
    assert audit.verify(chain).ok
    chain.execute("DELETE FROM audit WHERE seq = 6")  # the oldest left: the anchor shows it
    assert "record 6 is missing" in str(audit.verify(chain).problem)


def test_records_removed_before_a_forged_anchor_show(chain: sqlite3.Connection) -> None:
    """Another hand removes the oldest records and sets the anchor to the last it removed (its
    seq and hash, copied): what is left is a whole chain from that anchor, but no rotation
    record names it."""
    assert audit.verify(chain).ok
    digest = _hash_of(chain, 3)
    chain.execute("DELETE FROM audit WHERE seq <= 3")
    chain.execute("INSERT INTO audit_anchor (one, seq, hash) VALUES (1, 3, ?)", (digest,))
    verdict = audit.verify(chain)
    assert not verdict.ok
    assert verdict.at_seq == 4
    assert "records up to 3 were removed by another hand" in str(verdict.problem)


def test_a_forged_anchor_past_a_real_rotation_shows(chain: sqlite3.Connection) -> None:
    """After a rotation, another hand removes more and moves the anchor: the last rotation
    record names the anchor it left, not theirs."""
    assert _rotate(chain, 1_796_000_003) == 2
    digest = _hash_of(chain, 4)
    chain.execute("DELETE FROM audit WHERE seq <= 4")
    chain.execute("UPDATE audit_anchor SET seq = 4, hash = ?", (digest,))
    verdict = audit.verify(chain)
    assert "records up to 4 were removed by another hand" in str(verdict.problem)
    # Walking only what came since a whole walk, a new rotation's record is checked the same way.
    chain.execute("UPDATE audit_anchor SET seq = 2, hash = ?", ("0" * 64,))
    assert "no rotation record names the anchor (record 2)" in str(
        audit.verify(chain, after=(6, _hash_of(chain, 6), "")).problem
    )
    chain.execute("UPDATE audit_anchor SET seq = x'00', hash = 'x'")
    assert "the anchor was edited" in str(audit.verify(chain).problem)


def _hash_of(conn: sqlite3.Connection, seq: int) -> str:
    row = conn.execute("SELECT hash FROM audit WHERE seq = ?", (seq,)).fetchone()
    assert row is not None
    return str(row[0])


def test_an_older_ledgers_anchor_is_a_caveat_until_the_daemon_adopts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ledger rotated by an older edgellm (schema 1) holds an anchor no record names: read as
    it is, the chain verifies with a caveat; opened by the daemon, a WARNING record names it
    once, and from then on an anchor must be named."""
    path = tmp_path / "old.sqlite3"
    Ledger(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    _chain(conn, 5)
    digest = _hash_of(conn, 2)
    conn.execute("DELETE FROM audit WHERE seq <= 2")  # as schema 1's rotation left it
    conn.execute("INSERT INTO audit_anchor (one, seq, hash) VALUES (1, 2, ?)", (digest,))
    conn.execute("PRAGMA user_version=1")
    verdict = audit.verify(conn)
    assert verdict.ok
    assert "the anchor (record 2) was kept by an older edgellm" in str(verdict.caveat)
    conn.close()
    assert ctl(["audit", "verify", "--database", str(path)]) == 0
    assert "but the anchor (record 2) was kept by an older edgellm" in capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="edgellmd.ledger"):
        ledger = Ledger(path)
    try:
        verdict = ledger.query(audit.verify).result(5)
        assert (verdict.ok, verdict.caveat, verdict.checked) == (True, None, 4)
        adopted = ledger.query(lambda c: audit.select(c, action=audit.ROTATED)).result(5)
        assert [(r.seq, r.level, r.detail["anchor"]) for r in adopted] == [(6, "WARNING", 2)]
        assert "anchor (record 2) kept by an older edgellm is adopted" in caplog.text
        assert f"audit record 6 {adopted[0].hash}: audit rotated" in caplog.text  # the journal's copy
        ledger.audit(AuditEntry(utc_text(1_796_000_200), "INFO", "later")).result(5)
    finally:
        ledger.close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        digest = _hash_of(conn, 4)
        conn.execute("DELETE FROM audit WHERE seq <= 4")  # then a prefix removed, the anchor forged
        conn.execute("UPDATE audit_anchor SET seq = 4, hash = ?", (digest,))
        assert "records up to 4 were removed by another hand" in str(audit.verify(conn).problem)
    finally:
        conn.close()
    assert ctl(["audit", "verify", "--database", str(path), "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert (answer["ok"], answer["at_seq"], answer["caveat"]) == (False, 5, None)


def test_the_daemons_rotation_appends_its_record_and_mirrors_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(datetime(2026, 12, 3, tzinfo=UTC))
    ledger = Ledger(tmp_path / "l.sqlite3", audit_retention_days=1, clock=clock)
    try:
        for i in range(3):
            ledger.audit(AuditEntry(utc_text(clock.now + i), "INFO", f"old {i}")).result(5)
        clock.now += 3 * 86_400
        ledger.audit(AuditEntry(utc_text(clock.now), "INFO", "recent")).result(5)
        with caplog.at_level(logging.INFO, logger="edgellmd.ledger"):
            ledger.maintain().result(5)
        records = ledger.query(audit.select).result(5)
        assert [r.action for r in records] == ["recent", audit.ROTATED]
        assert (records[1].detail["anchor"], records[1].detail["removed"]) == (3, 3)
        assert ledger.status()["audit_head"] == 5
        assert f"audit record 5 {records[1].hash}: audit rotated" in caplog.text
        ledger.audit(AuditEntry(utc_text(clock.now), "INFO", "after")).result(5)
        verdict = ledger.query(audit.verify).result(5)
        assert (verdict.ok, verdict.checked, verdict.caveat) == (True, 3, None), verdict.problem
    finally:
        ledger.close()


def test_the_audit_logger_feeds_the_chain_and_failed_sign_ins_come_summed(ledger: Ledger) -> None:
    logger = logging.getLogger("edgellmd.audit.test")
    handler = AuditHandler(ledger)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        logger.info("admin reload: m loaded", extra={"peer": "127.0.0.1", "key_id": "aaaaaaaaaaaa"})
        for _ in range(50):
            logger.warning("auth failed: wrong or unknown key", extra={"peer": "10.0.0.9", "key_id": None})
        logger.warning("auth failed: no bearer token", extra={"peer": "10.0.0.8", "key_id": None})
        summary = handler.flush_summary()
        assert summary is not None
        summary.result(5)
        assert handler.flush_summary() is None  # nothing since
    finally:
        logger.removeHandler(handler)
    records = ledger.query(audit.select).result()
    assert [r.action for r in records] == [
        "admin reload: m loaded",
        "failed sign-ins and refusals in the last minute: 51",
    ]
    assert records[0].key_id == "aaaaaaaaaaaa"
    assert records[1].detail["reasons"] == {
        "auth failed: wrong or unknown key": 50,
        "auth failed: no bearer token": 1,
    }
    assert records[1].detail["peers"] == {"10.0.0.9": 50, "10.0.0.8": 1}
    assert ledger.query(audit.verify).result().ok


@pytest.mark.parametrize("kind", ["symlink", "not-a-database", "no-directory"])
def test_a_database_that_cannot_be_used_is_refused_by_name(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ledger.sqlite3"
    if kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"")
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "not-a-database":
        path.write_text("just text, not SQLite\n" * 100)
    else:
        path = tmp_path / "missing" / "ledger.sqlite3"
    with pytest.raises(LedgerError, match=f"ledger.database {path}"):
        Ledger(path)


def test_while_commits_keep_failing_what_is_kept_for_a_retry_is_bounded(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgellmd.ledger import store  # noqa: PLC0415 - patched here only

    def full(*_: object, **__: object) -> bool:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(usage, "write", full)
    monkeypatch.setattr(store, "MAX_KEPT", 3)
    for i in range(5):
        with pytest.raises(OSError, match="disk is full"):
            ledger.record(_record(f"r{i}", _at("2026-12-03T10:00:00+00:00"))).result(5)
    status = ledger.status()
    assert (status["waiting"], status["dropped"]) == (3, 2)
    assert "disk is full" in str(status["error"])
    assert ledger.used("aaaaaaaaaaaa")["requests_day"] == 5  # the quota still counts every one


def test_select_gives_the_newest_records_in_time_order_within_the_filters(chain: sqlite3.Connection) -> None:
    assert [r.seq for r in audit.select(chain, limit=2)] == [5, 6]
    assert [r.seq for r in audit.select(chain, limit=0)] == [1, 2, 3, 4, 5, 6]
    assert [r.seq for r in audit.select(chain, action="action 1", limit=5)] == [1]
    assert [r.seq for r in audit.select(chain, since=utc_text(1_796_000_003), limit=10)] == [3, 4, 5, 6]
    assert audit.select(chain, key_id="nobody") == []


def test_admin_audit_walks_the_whole_chain_once_a_minute_and_only_what_is_new_between(
    tmp_path: Path,
) -> None:
    """`Ledger.chain`: a full walk, then only the records added since the last whole walk; an
    edit among those is found at once, one among the older ones at the next full walk."""
    ledger = Ledger(tmp_path / "walk.sqlite3")
    conn = sqlite3.connect(tmp_path / "walk.sqlite3", isolation_level=None)
    try:
        _chain(conn, 5)
        verdict, covered = ledger.chain(conn, now=1000.0)
        assert (verdict.ok, verdict.checked, covered) == (True, 5, 5)
        _chain(conn, 3)
        verdict, covered = ledger.chain(conn, now=1010.0)
        assert (verdict.ok, verdict.checked, covered) == (True, 3, 8)  # the three new ones walked
        verdict, covered = ledger.chain(conn, now=1011.0)
        assert (verdict.ok, verdict.checked, covered) == (True, 0, 8)  # nothing new: nothing walked
        _chain(conn, 2)
        conn.execute("UPDATE audit SET action = 'nothing happened' WHERE seq = 10")
        verdict, _ = ledger.chain(conn, now=1012.0)
        assert not verdict.ok
        assert "record 10 was edited" in str(verdict.problem)
        conn.execute("UPDATE audit SET action = 'action 10' WHERE seq = 10")
        verdict, covered = ledger.chain(conn, now=1013.0)  # after a break, the whole chain again
        assert (verdict.ok, verdict.checked, covered) == (True, 10, 10)
        conn.execute("UPDATE audit SET action = 'nothing happened' WHERE seq = 2")
        assert ledger.chain(conn, now=1014.0)[0].ok  # an old record: not walked within the minute
        verdict, _ = ledger.chain(conn, now=1013.0 + FULL_VERIFY_S)
        assert not verdict.ok
        assert "record 2 was edited" in str(verdict.problem)
    finally:
        conn.close()
        ledger.close()


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b"{}", "record 4 was edited: a field holds a value no record is written with"),
        (b"\xff\xfe not UTF-8", "record 4 was edited"),
    ],
)
def test_a_cell_of_another_type_is_an_edit_found_not_a_crash(
    chain: sqlite3.Connection, value: bytes, problem: str
) -> None:
    """A hand edit may put any SQLite value in any column (a BLOB where text was, text that is
    no UTF-8): once, verifying it raised (a 500 on /admin/audit, a traceback in the CLI)."""
    if value.startswith(b"\xff"):
        chain.execute("UPDATE audit SET action = CAST(? AS TEXT) WHERE seq = 4", (value,))
        problem = "a record after record 3 was edited: it holds text that is not UTF-8"
    else:
        chain.execute("UPDATE audit SET detail = ? WHERE seq = 4", (value,))
    verdict = audit.verify(chain)
    assert (verdict.ok, verdict.checked, verdict.at_seq) == (False, 3, 4)
    assert problem in str(verdict.problem)
    if not value.startswith(b"\xff"):  # listed as text, never a crash
        shown = [r.as_dict() for r in audit.select(chain)]
        assert [r["seq"] for r in shown] == [1, 2, 3, 4, 5, 6]


def _forge_next(path: Path) -> int:
    """Another hand appends one record, correctly hashed, after the chain's head."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        head = audit.head(conn)
        conn.execute("BEGIN IMMEDIATE")
        audit.append(conn, AuditEntry(utc_text(1_796_000_000), "INFO", "forged"), head)
        conn.execute("COMMIT")
        return head[0] + 1
    finally:
        conn.close()


def test_a_record_another_hand_appended_is_noted_and_never_wedges_the_ledger(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """Once, the daemon's next record took the forged one's seq: every commit failed after
    (usage with it), /readyz said ledger_failing for good. Now the daemon appends after it,
    says so in the chain, its log and its status, and the chain stays whole."""
    ledger.audit(AuditEntry(utc_text(1_796_000_000), "INFO", "first")).result(5)
    assert ledger.path is not None
    forged = _forge_next(ledger.path)
    with caplog.at_level(logging.ERROR, logger="edgellmd.ledger"):
        seq = ledger.audit(AuditEntry(utc_text(1_796_000_001), "INFO", "second")).result(5)
        ledger.record(_record("r1", _at("2026-12-03T10:00:00+00:00"))).result(5)
    assert seq == forged + 2  # after the forged record and the daemon's note of it
    status = ledger.status()
    assert status["error"] is None
    assert f"record {forged} was not written by this daemon" in str(status["foreign_records"])
    assert any("was not written by this daemon" in r.getMessage() for r in caplog.records)
    records = ledger.query(audit.select).result()
    assert [r.action for r in records] == [
        "first",
        "forged",
        f"audit chain: record {forged} was not written by this daemon (tampering?)",
        "second",
    ]
    assert ledger.query(audit.verify).result().ok
    assert [(r["requests"]) for r in _rows(ledger, UsageQuery())] == [1]


def test_a_removed_tail_is_not_followed_the_gap_shows_it(ledger: Ledger) -> None:
    for i in range(3):
        ledger.audit(AuditEntry(utc_text(1_796_000_000 + i), "INFO", f"r{i}")).result(5)
    assert ledger.path is not None
    conn = sqlite3.connect(ledger.path, isolation_level=None)
    conn.execute("DELETE FROM audit WHERE seq = 3")
    conn.close()
    ledger.audit(AuditEntry(utc_text(1_796_000_010), "INFO", "after")).result(5)
    verdict = ledger.query(audit.verify).result()
    assert "record 3 is missing" in str(verdict.problem)
    assert ledger.status()["foreign_records"] is None


def test_compare_finds_a_record_the_log_does_not_hold_between_those_it_does(
    chain: sqlite3.Connection,
) -> None:
    rows = chain.execute("SELECT seq, hash FROM audit ORDER BY seq").fetchall()
    line = "2026-12-03 10:00:00,000 INFO edgellmd.ledger [-] audit record {} {}: action {}"
    every = [line.format(seq, digest, seq) for seq, digest in rows]
    assert audit.compare(chain, every) == (6, None)
    without_4 = [text for text in every if " record 4 " not in text]
    matched, problem = audit.compare(chain, without_4)
    assert (matched, problem) == (5, "record 4 is in the database, not in the log: added (or its line lost)")
    assert audit.compare(chain, every[:4]) == (4, None)  # records after the log's last: written since


def test_closing_with_records_it_could_not_write_says_they_are_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger(tmp_path / "full.sqlite3")

    def full(conn: sqlite3.Connection, record: UsageRecord, zone: object, *, detail: bool) -> bool:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(usage, "write", full)
    with pytest.raises(OSError, match="disk is full"):
        ledger.record(_record("r1", _at("2026-12-03T10:00:00+00:00"))).result(5)
    with caplog.at_level(logging.ERROR, logger="edgellmd.ledger"):
        ledger.close()
    lost = [r.getMessage() for r in caplog.records if "they are lost" in r.getMessage()]
    assert lost == [
        "ledger closed with 1 usage and 0 audit record(s) it could not write; they are lost:"
        " OperationalError: database or disk is full"
    ]


def test_records_added_while_the_daemon_was_stopped_show_against_its_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another hand appends a correctly chained record while the daemon is stopped: the next
    start takes it as its head, and nothing in the chain shows it. The log does: each start
    says which record it opened after, and the log's last record before it was another."""
    path = tmp_path / "l.sqlite3"
    caplog.set_level(logging.INFO, logger="edgellmd.ledger")

    def run(*actions: str) -> None:
        ledger = Ledger(path)
        try:
            for action in actions:
                ledger.audit(AuditEntry(utc_text(1_796_000_000), "INFO", action)).result(5)
        finally:
            ledger.close()

    def journal() -> list[str]:
        text = logs.TextFormatter(logs.TEXT_FORMAT)
        ours = [r for r in caplog.records if r.name == "edgellmd.ledger"]
        return [text.format(logging.makeLogRecord({**vars(r), "request_id": "-"})) for r in ours]

    run("first", "second")
    run("third")  # an honest restart: opened after record 2, the last it logged
    with sqlite3.connect(path) as conn:
        assert audit.compare(conn, journal()) == (3, None)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    audit.append(conn, AuditEntry(utc_text(1_796_000_001), "INFO", "admin reload: nothing"), audit.head(conn))
    conn.execute("COMMIT")
    conn.close()
    run("fourth")
    with sqlite3.connect(path) as conn:
        assert audit.verify(conn).ok  # the chain alone: whole
        matched, problem = audit.compare(conn, journal())
    assert matched == 3
    assert "records 4 to 4 are in the database, not in the log: added while the daemon was stopped" in str(
        problem
    )
    assert audit.opened_record(journal()[-1]) is None  # the last line mirrors record 5
    assert [audit.opened_record(line) for line in journal() if "opened" in line][-1] == (
        4,
        _hash_of(sqlite3.connect(path), 4),
    )


def test_a_prefix_removed_under_an_adopted_anchor_shows_against_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The schema turned back to 1 made a forged anchor read as an older edgellm's: plain
    verify passed with a caveat, the daemon adopted it, and `--against` skipped every logged
    record at or before the anchor. The log says they were written; no rotation of this
    edgellm removed them. An honest rotation's records stay quiet."""
    path, honest = tmp_path / "l.sqlite3", tmp_path / "honest.sqlite3"
    caplog.set_level(logging.INFO, logger="edgellmd.ledger")

    def journal(of: Path) -> list[str]:
        text = logs.TextFormatter(logs.TEXT_FORMAT)
        ours = [r for r in caplog.records if getattr(r, "database", None) == str(of)]
        return [text.format(logging.makeLogRecord({**vars(r), "request_id": "-"})) for r in ours]

    clock = Clock(datetime(2026, 12, 3, tzinfo=UTC))
    ledger = Ledger(path, audit_retention_days=1, clock=clock)
    try:
        for i in range(6):
            ledger.audit(AuditEntry(utc_text(clock.now + i), "INFO", f"record {i + 1}")).result(5)
    finally:
        ledger.close()
    written = journal(path)  # the log until here: the same for the copy below
    with sqlite3.connect(path) as source, sqlite3.connect(honest) as target:
        source.backup(target)
    conn = sqlite3.connect(path, isolation_level=None)
    digest = _hash_of(conn, 4)
    conn.execute("DELETE FROM audit WHERE seq <= 4")
    conn.execute("INSERT INTO audit_anchor (one, seq, hash) VALUES (1, 4, ?)", (digest,))
    conn.execute("PRAGMA user_version=1")
    assert audit.verify(conn).ok  # a caveat, no more
    _, problem = audit.compare(conn, written)
    assert "records 1 to 4 are in the log and gone from the database" in str(problem)
    conn.close()
    Ledger(path).close()  # the daemon adopts it
    with sqlite3.connect(path) as conn:
        assert audit.verify(conn).ok
        _, problem = audit.compare(conn, journal(path))
    assert "no rotation of this edgellm named" in str(problem)

    # The same records rotated by the daemon itself: the log's copy of them is no alarm.
    clock.now += 3 * 86_400
    ledger = Ledger(honest, audit_retention_days=1, clock=clock)
    try:
        ledger.audit(AuditEntry(utc_text(clock.now), "INFO", "recent")).result(5)
        ledger.maintain().result(5)
    finally:
        ledger.close()
    with sqlite3.connect(honest) as conn:
        assert audit.verify(conn).ok
        assert conn.execute("SELECT seq FROM audit_anchor").fetchone()[0] == 6
        _, problem = audit.compare(conn, written + journal(honest))
    assert problem is None, problem


def test_an_emptied_chain_beside_recorded_usage_is_a_caveat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit verify` of a ledger whose chain holds nothing while it holds usage says so: it
    said "intact" as for a new ledger (a daemon that audited anything wrote records)."""
    path = tmp_path / "l.sqlite3"
    ledger = Ledger(path, clock=Clock(datetime(2026, 12, 3, 12, tzinfo=UTC)))
    try:
        assert ctl(["audit", "verify", "--database", str(path)]) == 0
        assert "but" not in capsys.readouterr().out  # a new ledger: nothing to say
        ledger.record(_record("r1", _at("2026-12-03T10:15:00+00:00"))).result(5)
        ledger.record(_record("r2", _at("2026-12-03T10:16:00+00:00"))).result(5)
        ledger.audit(AuditEntry(utc_text(1_796_000_200), "INFO", "key in force")).result(5)
    finally:
        ledger.close()
    assert ctl(["audit", "verify", "--database", str(path)]) == 0
    assert "but" not in capsys.readouterr().out  # records and usage: nothing to say
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DELETE FROM audit")
    conn.close()
    assert ctl(["audit", "verify", "--database", str(path)]) == 0
    out = capsys.readouterr().out
    assert "audit chain intact: 0 record(s) checked" in out
    assert "but the chain holds no records while the ledger holds usage (2 request(s))" in out
    assert ctl(["audit", "verify", "--database", str(path), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] is True
    assert "(2 request(s))" in answer["caveat"]


def test_admin_reads_run_beside_the_commits_and_see_what_was_queued_before_them(ledger: Ledger) -> None:
    """`read` (/admin/usage, /admin/audit) runs on a connection and thread of its own: a long
    read (a year of usage) no longer holds the commits, and the answers waiting for theirs.
    It sees every record queued before it, committed or not yet."""
    queued = ledger.record(_record("r1", _at("2026-12-03T10:15:00+00:00")))  # not waited for
    seen = ledger.read(lambda conn: conn.execute("SELECT count(*) FROM usage_hours").fetchone()[0]).result(5)
    assert seen == 1
    assert queued.result(5) is True
    started, release = threading.Event(), threading.Event()

    def long_read(conn: sqlite3.Connection) -> int:
        before = int(conn.execute("SELECT sum(requests) FROM usage_hours").fetchone()[0])
        started.set()
        assert release.wait(10)
        # One read transaction: what committed meanwhile is not in it.
        assert conn.execute("SELECT sum(requests) FROM usage_hours").fetchone()[0] == before
        return before

    reading = ledger.read(long_read)
    assert started.wait(5)
    assert ledger.record(_record("r2", _at("2026-12-03T10:16:00+00:00"))).result(5) is True  # not held
    release.set()
    assert reading.result(5) == 1
    assert (
        ledger.read(lambda conn: conn.execute("SELECT sum(requests) FROM usage_hours").fetchone()[0]).result(
            5
        )
        == 2
    )


def test_usage_select_stops_past_its_limit_and_skips_an_hour_edited_out_of_shape(ledger: Ledger) -> None:
    for i in range(5):
        ledger.record(_record(f"r{i}", _at(f"2026-12-03T1{i}:15:00+00:00"))).result(5)
    hours = _rows(ledger, UsageQuery(group="hour"))
    assert len(hours) == 5
    limited = ledger.query(
        lambda conn: usage.select(conn, UsageQuery(group="hour"), ledger.zone, limit=2)
    ).result()
    assert limited == hours[:3]  # limit + 1: the caller refuses so many
    assert ledger.query(
        lambda conn: usage.select(conn, UsageQuery(group="day"), ledger.zone, limit=1)
    ).result() == (_rows(ledger, UsageQuery(group="day")))
    ledger.query(
        lambda conn: conn.execute(
            "UPDATE usage_hours SET hour = 'x' WHERE hour = ?", (int(_at("2026-12-03T12:00:00+00:00")),)
        )
    ).result(5)
    left = _rows(ledger, UsageQuery(group="hour"))
    assert [row["period"] for row in left] == [
        row["period"] for row in hours if not str(row["period"]).startswith("2026-12-03T13:00")
    ]


def _requests(path: Path) -> set[str]:
    """The request ids a ledger file holds, read as a file of its own."""
    conn = sqlite3.connect(str(path))
    try:
        return {row[0] for row in conn.execute("SELECT request_id FROM usage_requests")}
    finally:
        conn.close()


@pytest.mark.parametrize("suffixes", [("",), ("", "-wal", "-shm")], ids=["main file", "with its WAL"])
def test_a_database_file_removed_under_the_ledger_is_said_and_written_back_at_its_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, suffixes: tuple[str, ...]
) -> None:
    """The ledger's file (and its WAL) removed while the daemon ran: SQLite went on writing into
    the open, unlinked file, nothing said so (status, /readyz), and at the restart every record
    since was gone (quotas reset, the audit chain begun again). It is said until the stop, which
    writes the whole database back to its path."""
    path = tmp_path / "ledger.sqlite3"
    clock = Clock(datetime(2026, 12, 3, tzinfo=UTC))
    ledger = Ledger(path, clock=clock)
    try:
        ledger.record(_record("before", clock())).result()
        path.chmod(0o640)  # a reader group, set by the operator
        assert ledger.check_file() is None
        for suffix in suffixes:
            path.with_name(path.name + suffix).unlink()
        ledger.record(_record("after", clock())).result()  # committed, into the open file
        with caplog.at_level(logging.ERROR):
            problem = ledger.check_file()
        assert problem is not None
        assert f"the database file {path} was removed while the daemon ran" in problem
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # its WAL by that name too, now
        assert ledger.failing == problem
        assert ledger.status()["error"] == problem  # what /admin/status, the console and ctl show
        assert problem in caplog.text
        ledger.record(_record("later", clock())).result()
    finally:
        ledger.close()
    assert _requests(path) == {"before", "after", "later"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite3"]  # no copy left beside it
    assert oct(path.stat().st_mode & 0o777) == "0o640"  # as it was
    reopened = Ledger(path, clock=clock)
    try:
        assert reopened.usage_found.as_dict()["ok"]  # the seals and the chain carried over whole
        assert reopened.check_file() is None
    finally:
        reopened.close()


def test_the_ledger_looks_for_its_files_beside_a_gone_database_once_each_time_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open-file listing that finds the ledger's own `-wal`/`-shm` by a gone file's name ran
    at every check (every 5 s, on the event loop) for as long as the file stayed gone; nothing of
    the ledger's makes those names again, so it runs when the file is first seen gone, and again
    only when what stands at the path changes (removed, then replaced)."""
    looked: list[Path] = []
    real = store._ours_beside

    def counted(path: Path) -> list[tuple[Path, tuple[int, int]]]:
        looked.append(path)
        return real(path)

    monkeypatch.setattr(store, "_ours_beside", counted)
    path = tmp_path / "ledger.sqlite3"
    clock = Clock(datetime(2026, 12, 3, tzinfo=UTC))
    ledger = Ledger(path, clock=clock)
    try:
        ledger.record(_record("before", clock())).result()
        assert ledger.check_file() is None
        path.rename(tmp_path / "aside.sqlite3")
        for _ in range(3):
            assert "was removed while the daemon ran" in (ledger.check_file() or "")
        assert looked == [path]
        assert ledger.failing_summary == "the usage ledger's database file is gone from its path"
        sqlite3.connect(str(path)).close()  # another file at the path
        for _ in range(2):
            assert "was replaced by another file" in (ledger.check_file() or "")
        assert looked == [path, path]
    finally:
        ledger.close()


def test_a_database_file_replaced_under_the_ledger_is_left_alone_and_its_records_saved_beside(
    tmp_path: Path,
) -> None:
    """Another database (in WAL mode) renamed over the ledger's path while it runs: what the
    ledger holds is saved beside it, and the ledger's own WAL, left by that name (SQLite removes
    none of a moved database's), is removed: opened later, the other file read it as its own
    and showed the ledger's tables in place of its own."""
    path = tmp_path / "ledger.sqlite3"
    clock = Clock(datetime(2026, 12, 3, tzinfo=UTC))
    ledger = Ledger(path, clock=clock)
    try:
        ledger.record(_record("ours", clock())).result()
        other = tmp_path / "other.sqlite3"
        foreign = sqlite3.connect(str(other), isolation_level=None)
        foreign.execute("PRAGMA journal_mode=WAL")
        foreign.execute("CREATE TABLE mine (x)")
        foreign.execute("INSERT INTO mine VALUES (42)")
        foreign.close()  # checkpointed, its WAL gone: a whole file, in WAL mode
        other.rename(path)
        assert (tmp_path / "ledger.sqlite3-wal").exists()  # the ledger's, by that name
        assert "was replaced by another file" in (ledger.check_file() or "")
        assert not (tmp_path / "ledger.sqlite3-wal").exists()  # gone as soon as it was seen
        ledger.record(_record("ours-later", clock())).result()
        meanwhile = sqlite3.connect(str(path))  # a read-write look while the daemon runs
        try:
            assert meanwhile.execute("SELECT x FROM mine").fetchall() == [(42,)]
        finally:
            meanwhile.close()
    finally:
        ledger.close()
    conn = sqlite3.connect(str(path))
    try:
        assert conn.execute("SELECT x FROM mine").fetchall() == [(42,)]
    finally:
        conn.close()
    assert not (tmp_path / "ledger.sqlite3-wal").exists()
    kept = sorted(tmp_path.glob("ledger.sqlite3.kept-*"))
    assert len(kept) == 1, sorted(p.name for p in tmp_path.iterdir())
    assert _requests(kept[0]) == {"ours", "ours-later"}
    assert oct(kept[0].stat().st_mode & 0o777) == "0o600"


def test_a_database_file_put_back_under_the_ledger_stays_said_and_holds_everything_after_the_stop(
    tmp_path: Path,
) -> None:
    """The file renamed away and back while the ledger runs: its WAL by that name went when it
    was seen gone, so the records since are not on disk for good until the stop, which says so
    until then; the stop's close writes them into the file (no copy beside it)."""
    path = tmp_path / "ledger.sqlite3"
    aside = tmp_path / "aside.sqlite3"
    clock = Clock(datetime(2026, 12, 3, tzinfo=UTC))
    ledger = Ledger(path, clock=clock)
    try:
        ledger.record(_record("before", clock())).result()
        path.rename(aside)
        assert "was removed while the daemon ran" in (ledger.check_file() or "")
        aside.rename(path)
        ledger.record(_record("back", clock())).result()
        assert "is back: what it records is not on disk for good" in (ledger.check_file() or "")
        assert ledger.failing is not None
    finally:
        ledger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite3"]
    assert _requests(path) == {"before", "back"}
