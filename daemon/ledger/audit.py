"""The audit log as a hash chain: each record carries the hash of the one before.

A record is (seq, at, level, action, key_id, peer, detail). Its hash is SHA-256 over the
previous record's hash and the record's fields as canonical JSON, so that editing a record
changes its hash, removing one leaves a gap in `seq` and a `prev` that names a hash no record
has, and moving one breaks both. `verify` walks the chain from its anchor and says where it
breaks first. Records older than the retention go at rotation; the last one that went stays
as the anchor (its seq and hash), so that what is left still verifies, and the rotation
appends a record naming that anchor (`ROTATED`). An anchor no rotation record names was set
by another hand: the records before it were removed, not rotated (`verify` says so).

What a chain cannot show on its own: someone who can write the database may rewrite every
record after the one they edit, hashes included. Every record is mirrored to the daemon's
log (the journal) with its hash, and `compare` finds such a rewrite against that mirror
(`edgellmctl audit verify --against`).
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

GENESIS: Final = "0" * 64  # the `prev` of the first record ever
SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    level TEXT NOT NULL,
    action TEXT NOT NULL,
    key_id TEXT,
    peer TEXT,
    detail TEXT NOT NULL,
    prev TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_at ON audit (at);
CREATE TABLE IF NOT EXISTS audit_anchor (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    seq INTEGER NOT NULL,
    hash TEXT NOT NULL
);
"""
MAX_TEXT: Final = 512  # characters of an action or a detail value kept (log lines are short)
ROTATED: Final = "audit rotated"  # the action of the record a rotation appends, naming the anchor
# Ledgers written before rotation records (schema 1) may hold an anchor no record names.
NAMED_ANCHORS_SINCE: Final = 2


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """What happened, before it has a place in the chain."""

    at: str  # UTC, ISO 8601 with milliseconds
    level: str  # INFO, WARNING, ERROR
    action: str
    key_id: str | None = None
    peer: str | None = None
    detail: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """A record of the chain, as stored."""

    seq: int
    at: str
    level: str
    action: str
    key_id: str | None
    peer: str | None
    detail: dict[str, Any]
    prev: str
    hash: str

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON answers and `edgellmctl audit show --json` print it."""
        return {
            "seq": self.seq,
            "at": self.at,
            "level": self.level,
            "action": self.action,
            "key_id": self.key_id,
            "peer": self.peer,
            "detail": self.detail,
            "hash": self.hash,
        }


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def record_hash(prev: str, fields: tuple[int, str, str, str, str | None, str | None, str]) -> str:
    """The hash a record must carry: over the one before's and its own fields (seq, at, level,
    action, key_id, peer, detail as stored)."""
    body = _canonical(list(fields))
    return hashlib.sha256(f"{prev}\n{body}".encode()).hexdigest()


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def head(conn: sqlite3.Connection) -> tuple[int, str]:
    """(seq, hash) of the last record, or of the anchor when every record went, or the genesis."""
    row = conn.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
    if row is None:
        row = conn.execute("SELECT seq, hash FROM audit_anchor").fetchone()
    return (int(row[0]), str(row[1])) if row is not None else (0, GENESIS)


def append(conn: sqlite3.Connection, entry: AuditEntry, last: tuple[int, str]) -> tuple[int, str]:
    """Write `entry` after `last` (inside the caller's transaction); the new (seq, hash).

    A record is never older than the one before it: two threads stamp their entries and queue
    them in the other order, or the wall clock steps back, and an honest chain would read as
    reordered. Such an entry takes its predecessor's time instead."""
    seq = last[0] + 1
    # Read as bytes: a hand edit that left bytes that are no UTF-8 must not fail every append.
    before = conn.execute("SELECT CAST(at AS BLOB) FROM audit WHERE seq = ?", (last[0],)).fetchone()
    earlier = (
        before[0].decode("utf-8", "replace") if before is not None and isinstance(before[0], bytes) else None
    )
    at = max(entry.at, earlier) if earlier is not None else entry.at
    detail = _canonical(
        {k: _clip(str(v)) if isinstance(v, str) else v for k, v in (entry.detail or {}).items()}
    )
    action = _clip(entry.action)
    digest = record_hash(last[1], (seq, at, entry.level, action, entry.key_id, entry.peer, detail))
    conn.execute(
        "INSERT INTO audit (seq, at, level, action, key_id, peer, detail, prev, hash)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (seq, at, entry.level, action, entry.key_id, entry.peer, detail, last[1], digest),
    )
    return seq, digest


def rotate(
    conn: sqlite3.Connection, before: str, last: tuple[int, str], at: str
) -> tuple[int, tuple[int, str], AuditEntry | None]:
    """Remove the records older than `before` (an ISO time), keeping the last as the anchor,
    and append after `last` (the head) a record naming it; (how many went, the new head, the
    record appended: None when nothing went)."""
    row = conn.execute(
        "SELECT seq, hash FROM audit WHERE at < ? ORDER BY seq DESC LIMIT 1", (before,)
    ).fetchone()
    if row is None:
        return 0, last, None
    keep_head = conn.execute("SELECT MAX(seq) FROM audit").fetchone()[0]
    if row[0] == keep_head:  # never the newest: the chain's head stays in the table
        row = conn.execute(
            "SELECT seq, hash FROM audit WHERE seq < ? ORDER BY seq DESC LIMIT 1", (row[0],)
        ).fetchone()
        if row is None:
            return 0, last, None
    gone = int(conn.execute("DELETE FROM audit WHERE seq <= ?", (row[0],)).rowcount)
    conn.execute("INSERT OR REPLACE INTO audit_anchor (one, seq, hash) VALUES (1, ?, ?)", (row[0], row[1]))
    detail = {"anchor": int(row[0]), "anchor_hash": str(row[1]), "before": before, "removed": gone}
    entry = AuditEntry(at, "INFO", ROTATED, detail=detail)
    return gone, append(conn, entry, last), entry


def rotation_entry(anchor: tuple[int, str], at: str) -> AuditEntry:
    """The record that names an anchor found unnamed in a ledger of schema 1 (written before
    rotations named theirs): adopted at the daemon's start, as a WARNING, once."""
    detail = {"anchor": anchor[0], "anchor_hash": anchor[1], "adopted": "kept by an older edgellm"}
    return AuditEntry(at, "WARNING", ROTATED, detail=detail)


def unnamed_anchor(conn: sqlite3.Connection) -> tuple[int, str] | None:
    """The anchor, when the last rotation record does not name it (None when it does, or none)."""
    anchor, named, _ = _anchor_naming(conn)
    return anchor if anchor is not None and named != anchor else None


def _anchor_naming(conn: sqlite3.Connection) -> tuple[tuple[int, str] | None, tuple[int, str] | None, bool]:
    """The anchor (seq, hash), the anchor the last rotation record names, and whether that
    record adopted it (an older edgellm's) rather than left it by a rotation."""
    row = conn.execute("SELECT seq, hash FROM audit_anchor").fetchone()
    # An anchor edited to another type is `verify`'s to name; here it vouches for nothing.
    anchor = (row[0], row[1]) if row is not None and type(row[0]) is int and type(row[1]) is str else None
    last = conn.execute(
        "SELECT detail FROM audit WHERE action = ? ORDER BY seq DESC LIMIT 1", (ROTATED,)
    ).fetchone()
    return (anchor, *_rotation(last[0])) if last is not None else (anchor, None, False)


def _rotation(detail: object) -> tuple[tuple[int, str] | None, bool]:
    """The anchor a rotation record's detail names, and whether it adopted it."""
    try:
        parsed = json.loads(detail) if isinstance(detail, str) else None
    except ValueError:
        return None, False
    if not isinstance(parsed, dict):
        return None, False
    seq, digest = parsed.get("anchor"), parsed.get("anchor_hash")
    named = (seq, digest) if type(seq) is int and isinstance(digest, str) else None
    return named, "adopted" in parsed


def _records(conn: sqlite3.Connection, where: str = "", args: tuple[Any, ...] = ()) -> Iterator[AuditRecord]:
    query = f"SELECT seq, at, level, action, key_id, peer, detail, prev, hash FROM audit {where} ORDER BY seq"  # noqa: S608 - fixed clauses
    for row in conn.execute(query, args):
        # A hand edit may leave any SQLite value in any column: shown as text, never a 500.
        seq, at, level, action, key_id, peer, detail, prev, digest = (
            v if v is None or type(v) in (int, str) else repr(v)[:80] for v in row
        )
        try:
            parsed = json.loads(detail) if isinstance(detail, str) else None
        except ValueError:
            parsed = {"unreadable": str(detail)[:80]}
        yield AuditRecord(
            seq if type(seq) is int else -1,
            str(at),
            str(level),
            str(action),
            None if key_id is None else str(key_id),
            None if peer is None else str(peer),
            parsed if isinstance(parsed, dict) else {},
            str(prev),
            str(digest),
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `verify` found: how many records it checked and the first break, if any."""

    checked: int
    first: int | None  # seq of the first record checked
    last: int | None
    problem: str | None = None  # where and how the chain breaks first
    at_seq: int | None = None
    # Where a walk that found the chain whole ended: (seq, hash, at) of its last record (of
    # the record it started after, when there was nothing new), to go on from next time.
    end: tuple[int, str, str] | None = None
    caveat: str | None = None  # what could not be checked, on a chain found whole

    @property
    def ok(self) -> bool:
        """True when the chain is whole."""
        return self.problem is None


def verify(conn: sqlite3.Connection, after: tuple[int, str, str] | None = None) -> Verdict:
    """Walk the chain from its anchor; the first record that was edited, removed or moved.

    `after`: (seq, hash, at) of a record a walk found whole before (`Verdict.end`): only the
    records after it are walked, the first of them checked against it.
    """
    row = conn.execute("SELECT seq, hash FROM audit_anchor").fetchone()
    if row is not None and (type(row[0]) is not int or type(row[1]) is not str):
        return Verdict(0, None, None, "the anchor was edited: it holds a value no rotation writes", 1)
    anchor = (row[0], row[1]) if row is not None else None
    if after is not None:
        prev_seq, prev_hash, prev_at = after
    else:
        prev_seq, prev_hash = anchor if anchor is not None else (0, GENESIS)
        prev_at = ""
    named: tuple[int, str] | None = None  # the anchor the last rotation record walked names
    rotations = 0
    checked, first = 0, None
    fields = "seq, at, level, action, key_id, peer, detail, prev, hash"
    query = f"SELECT {fields} FROM audit WHERE seq > ? ORDER BY seq"  # noqa: S608 - no client text
    rows = conn.execute(query, (prev_seq,))
    while True:
        try:
            row = next(rows, None)
        except sqlite3.OperationalError as exc:  # a hand-edited cell of bytes that are no UTF-8
            if "decode" not in str(exc):
                raise
            broken = prev_seq + 1
            why = f"a record after record {prev_seq} was edited: it holds text that is not UTF-8"
            return Verdict(checked, broken if first is None else first, broken, why, broken)
        if row is None:
            break
        seq, at, level, action, key_id, peer, detail, prev, digest = row
        if not all(v is None or type(v) in (int, str) for v in row) or type(seq) is not int:
            broken = seq if type(seq) is int else prev_seq + 1
            why = f"record {broken} was edited: a field holds a value no record is written with"
            return Verdict(checked, broken if first is None else first, broken, why, broken)
        first = seq if first is None else first
        problem: str | None = None
        if seq != prev_seq + 1:
            problem = f"record {prev_seq + 1} is missing (removed) before record {seq}"
        elif prev != prev_hash:
            problem = f"record {seq} does not follow record {prev_seq}: removed, reordered or rewritten"
        elif digest != record_hash(prev, (seq, at, level, action, key_id, peer, detail)):
            problem = f"record {seq} was edited: its hash does not match its contents"
        elif str(at) < prev_at:
            problem = f"record {seq} is older than record {prev_seq}: reordered"
        if problem is not None:
            return Verdict(checked, first, seq, problem, seq)
        checked += 1
        prev_seq, prev_hash, prev_at = seq, digest, str(at)
        if action == ROTATED:
            named, rotations = _rotation(detail)[0], rotations + 1
    last = prev_seq if checked else None
    caveat = None
    # The last rotation names the anchor it left. Walking it all, an anchor that none names was
    # set by another hand; walking the records since a whole walk, only a new rotation can tell.
    if anchor is not None and named != anchor and (after is None or rotations):
        if after is None and conn.execute("PRAGMA user_version").fetchone()[0] < NAMED_ANCHORS_SINCE:
            caveat = (
                f"the anchor (record {anchor[0]}) was kept by an older edgellm, which named no anchor: "
                "that the records before it went by rotation cannot be checked until the daemon adopts it"
            )
        else:
            why = (
                f"records up to {anchor[0]} were removed by another hand: "
                f"no rotation record names the anchor (record {anchor[0]})"
            )
            return Verdict(checked, first, last, why, anchor[0] + 1)
    return Verdict(checked, first, last, end=(prev_seq, prev_hash, prev_at), caveat=caveat)


# How the daemon mirrors each record to its log (the journal): its ledger logger's message
# "audit record SEQ HASH: ACTION", in a JSON line or a text line (logging.format).
MIRROR_LOGGER: Final = "edgellmd.ledger"
MIRROR_MESSAGE: Final = re.compile(r"audit record (\d{1,18}) ([0-9a-f]{64}): ")
# And at each start, the head it found: "audit chain opened after record SEQ HASH". The daemon
# is the chain's one writer, so that head is the last record it logged before it stopped.
OPENED_MESSAGE: Final = re.compile(r"audit chain opened after record (\d{1,18}) ([0-9a-f]{64})$")
# A text line begins with its time, level and logger (http.logs.TEXT_FORMAT); a client's
# words (a request path in the access log) can only come after those, so cannot pose as one.
_TEXT_MIRROR: Final = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO " + re.escape(MIRROR_LOGGER) + r" \[[^\]]*\] (audit .*)"
)


def mirrored_record(line: str) -> tuple[int, str] | None:
    """The seq and hash a line of the daemon's log mirrors, or None for any other line.

    Only the ledger logger's own lines count, found by their structure: a JSON line's `logger`
    and `msg` (after whatever prefix the journal put before it), a text line's head. The
    same words anywhere else (a client's request path in the access log, a key's name) are
    not a mirror line, so nobody without the database can make the check report tampering.
    """
    return _ledger_line(line, MIRROR_MESSAGE)


def opened_record(line: str) -> tuple[int, str] | None:
    """The head (seq, hash) a start of the daemon found, from its ledger logger's line."""
    return _ledger_line(line, OPENED_MESSAGE)


def _ledger_line(line: str, pattern: re.Pattern[str]) -> tuple[int, str] | None:
    message: object = None
    brace = line.find("{")
    if brace >= 0:
        try:
            entry = json.loads(line[brace:])
        except ValueError:
            entry = None
        if isinstance(entry, dict) and entry.get("logger") == MIRROR_LOGGER:
            message = entry.get("msg")
    if message is None:
        head = _TEXT_MIRROR.match(line)
        message = head.group(1) if head else None
    found = pattern.match(message) if isinstance(message, str) else None
    return (int(found.group(1)), found.group(2)) if found else None


def compare(conn: sqlite3.Connection, mirrored: Iterable[str]) -> tuple[int, str | None]:
    """The chain against its mirror in the daemon's log (its JSON or text lines; see
    `mirrored_record`): how many mirrored records it matched, and the first that the database
    no longer holds as logged: rewritten (hashes and all, which the chain alone cannot show) or
    removed; or a record between the first and the last the log holds that the log does not:
    added by another hand; or records a start of the daemon found past the last it logged
    before (added while it was stopped). Records gone with rotation (at or before the anchor)
    are not counted, nor records after the log's last (written since the log was taken, or
    added while the daemon runs: it notes those itself, see `store.Ledger`)."""
    anchor, named, adopted = _anchor_naming(conn)
    rotated = anchor[0] if anchor is not None else 0
    # An anchor no rotation of this daemon named (none names it, or only an adoption does: a
    # schema-1 ledger's, or one forged with the schema turned back) does not vouch that the
    # records before it went by rotation: the log's copy of those says they were written.
    unvouched = anchor is not None and (named != anchor or adopted)
    matched = 0
    logged_seqs: set[int] = set()
    below: list[int] = []  # logged records at or before an unvouched anchor
    last: int | None = None  # the last record the log says the daemon wrote
    for line in mirrored:
        found = mirrored_record(line)
        if found is None:
            opened = opened_record(line)
            if opened is not None and last is not None and opened[0] > max(last, rotated):
                return matched, (
                    f"records {max(last, rotated) + 1} to {opened[0]} are in the database, not in the log: "
                    f"added while the daemon was stopped (it had written up to record {last}), "
                    "or their lines lost with a daemon killed as it wrote them"
                )
            continue
        seq, logged = found
        last = seq
        if seq <= rotated:
            if unvouched:
                below.append(seq)
            continue
        logged_seqs.add(seq)
        row = conn.execute("SELECT hash FROM audit WHERE seq = ?", (seq,)).fetchone()
        if row is None:
            return matched, f"record {seq} is in the log and not in the database: removed"
        if str(row[0]) != logged:
            return matched, f"record {seq} is not what the log says was written: rewritten"
        matched += 1
    if logged_seqs:
        low, high = min(logged_seqs), max(logged_seqs)
        between = conn.execute("SELECT seq FROM audit WHERE seq > ? AND seq < ? ORDER BY seq", (low, high))
        for (seq,) in between:
            if seq not in logged_seqs:
                return matched, f"record {seq} is in the database, not in the log: added (or its line lost)"
    if below:
        return matched, (
            f"records {min(below)} to {max(below)} are in the log and gone from the database, before "
            f"an anchor (record {rotated}) that no rotation of this edgellm named: removed by another "
            "hand (or by an older edgellm's rotation, which named no anchor)"
        )
    return matched, None


def select(
    conn: sqlite3.Connection,
    *,
    since: str | None = None,
    until: str | None = None,
    key_id: str | None = None,
    action: str | None = None,
    limit: int = 1000,
) -> list[AuditRecord]:
    """Records in time order, filtered by time (ISO), key and a word of the action; the newest `limit`."""
    clauses, args = [], []
    if since is not None:
        clauses.append("at >= ?")
        args.append(since)
    if until is not None:
        clauses.append("at < ?")
        args.append(until)
    if key_id is not None:
        clauses.append("key_id = ?")
        args.append(key_id)
    if action is not None:
        clauses.append("instr(lower(action), lower(?)) > 0")
        args.append(action)
    where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
    if limit > 0:  # the newest `limit`, read as such, not the whole table
        newest = conn.execute(
            f"SELECT seq FROM audit {where} ORDER BY seq DESC LIMIT 1 OFFSET ?",  # noqa: S608 - fixed clauses
            (*args, limit - 1),
        ).fetchone()
        if newest is not None:
            where = "WHERE " + " AND ".join([*clauses, "seq >= ?"])
            args.append(newest[0])
    return list(_records(conn, where, tuple(args)))
