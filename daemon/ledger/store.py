"""The ledger's database: one SQLite file (WAL, synchronous=FULL), one writer thread, group commits.

Writes come from the event loop (a request's usage, as it ends) and from any thread (audit
records, through the logging handler); each is queued and the writer thread commits all that
is queued in one transaction, then resolves their futures. A request's usage is committed
before its answer says how many tokens it used (api.session awaits the commit), so what a
client was told is on disk even if the daemon is killed the next instant; a request cut by
the kill may be counted although its client never heard (its tokens were computed).

Quotas read totals kept in memory (loaded for the current day and month at start, added to
as records are queued), never the database on the request path. A write that fails (a full
disk) is kept and tried again at the next commit or maintenance pass; `error` says what
failed until a commit succeeds, and `/admin/status` shows it.

Without a database file the ledger is an in-memory database: the same code, forgotten at exit.

The usage is checked against its seals (`seals.check`) at the start, on the writer before the
first request, and after that on a thread of its own (`check_usage`) over a read connection:
the check digests every hour kept (4.5 s for 400 days of 50 rows an hour on a 2-core machine),
and on the writer it would hold every commit, and every answer waiting for its usage's, that
long. A read transaction sees one committed state, and an honest ledger matches its seals in
every one, so a check beside the commits finds what one between them would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar
from zoneinfo import ZoneInfo

from edgellmd.ledger import audit, seals, usage
from edgellmd.ledger.audit import AuditEntry, Verdict
from edgellmd.ledger.usage import UsageRecord

T = TypeVar("T")
log = logging.getLogger(audit.MIRROR_LOGGER)  # its lines mirror the audit chain
SCHEMA_VERSION: Final = 2  # 2: rotations name their anchor (audit.NAMED_ANCHORS_SINCE)
BUSY_TIMEOUT_MS: Final = 5000
MAX_KEPT: Final = 100_000  # records of each kind kept for a retry while commits fail; then the oldest go
# /admin/audit walks the whole audit chain at most this often; between, the records added since.
FULL_VERIFY_S: Final = 60.0
# The hourly maintenance digests the usage again unless a check began this recently and nothing
# but the daemon wrote to the database since (the maintenance right after the start's check).
USAGE_FRESH_S: Final = 600.0


class Budgets(Protocol):
    """What a quota check reads: a key's budgets per local day and month (None: no budget).
    The keys file's `KeyQuota` is one; `Quota` is the ledger's own."""

    @property
    def requests_per_day(self) -> int | None: ...
    @property
    def requests_per_month(self) -> int | None: ...
    @property
    def tokens_per_day(self) -> int | None: ...
    @property
    def tokens_per_month(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Quota:
    """A key's budgets per local day and month (None: no budget)."""

    requests_per_day: int | None = None
    requests_per_month: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None


@dataclass(frozen=True, slots=True)
class Breach:
    """A budget that is spent: which, its limit, what was used and when it is full again."""

    budget: str  # e.g. "tokens_per_month"
    limit: int
    used: int
    resets: datetime  # local time

    def message(self) -> str:
        """What the 429 says."""
        what, per = self.budget.split("_per_")
        return (
            f"quota exceeded: this key used {self.used} of its {self.limit} {what} per {per}; "
            f"it resets at {self.resets.isoformat()}"
        )


class LedgerError(Exception):
    """The ledger's database cannot be opened (the daemon does not start without it)."""


def open_database(path: Path | None) -> sqlite3.Connection:
    """Open (creating, mode 0600) the ledger's database and its tables; ":memory:" without a path.

    LedgerError, naming the file, for one that cannot be: a missing directory, a symlink, not
    a regular file, not a database, a newer schema.
    """
    try:
        return _open_database(path)
    except (OSError, sqlite3.Error) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise LedgerError(f"ledger.database {path}: {why}") from None


def _open_database(path: Path | None) -> sqlite3.Connection:
    if path is None:
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    else:
        # Created 0600 before SQLite opens it; a symlink (O_NOFOLLOW) or a FIFO or device is refused.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise sqlite3.OperationalError(f"{path} is not a regular file")
        finally:
            os.close(fd)
        conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        conn.close()
        raise sqlite3.OperationalError(f"the ledger {path} is of a newer edgellm (schema {version})")
    conn.executescript(usage.SCHEMA + audit.SCHEMA)
    if version < audit.NAMED_ANCHORS_SINCE:
        _adopt_anchor(conn, path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return conn


def _open_reader(path: Path) -> sqlite3.Connection:
    """The usage checks' own connection to the database the writer opened: reads only."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA query_only=ON")
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    except BaseException:
        conn.close()
        raise
    return conn


def _unchecked(exc: Exception) -> seals.Findings:
    """What a check that could not be made finds: that, never a pass."""
    log.error("ledger: the usage could not be checked against its seals: %s", exc)
    found = seals.Findings()
    found.found[-1] = f"the usage could not be checked against its seals: {type(exc).__name__}: {exc}"
    return found


def _data_version(conn: sqlite3.Connection) -> int:
    """Changes when another connection commits to the database (never for this one's own)."""
    version = conn.execute("PRAGMA data_version").fetchone()[0]
    return version if type(version) is int else -1


def _ours_beside(path: Path) -> list[tuple[Path, tuple[int, int]]]:
    """The `<path>-wal` and `<path>-shm` files this process holds open, with their identities:
    the WAL and shared memory of the database file gone from `path`. SQLite never removes those
    of a database file that was moved or unlinked, and one opened at the path later would read
    that WAL as its own (a file put there, or the ledger's copy saved back)."""
    held: set[tuple[int, int]] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                info = os.stat(f"/proc/self/fd/{fd}")
                held.add((info.st_dev, info.st_ino))
    ours = []
    for suffix in ("-wal", "-shm"):
        beside = path.with_name(path.name + suffix)
        with contextlib.suppress(OSError):
            found = _identity(beside)
            if found is not None and found in held:
                ours.append((beside, found))
    return ours


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None when there is none."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino)


def _snapshot(reader: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """`fn` on the read connection in one read transaction: every read of it sees one
    committed state of the database."""
    reader.execute("BEGIN")
    try:
        return fn(reader)
    finally:
        reader.execute("COMMIT")


def _adopt_anchor(conn: sqlite3.Connection, path: Path | None) -> None:
    """A ledger of schema 1 may hold an anchor that no record names (its rotations named none):
    a record naming it is appended once, as a WARNING, so that `verify` holds every later
    anchor to a rotation record."""
    anchor = audit.unnamed_anchor(conn)
    if anchor is None:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        entry = audit.rotation_entry(anchor, utc_text(time.time()))
        seq, digest = audit.append(conn, entry, audit.head(conn))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    log.warning("audit chain: the anchor (record %d) kept by an older edgellm is adopted", anchor[0])
    _mirror(seq, digest, entry, path)


def _mirror(seq: int, digest: str, entry: AuditEntry, path: Path | None) -> None:
    """The journal's copy of a record of the chain (see audit.mirrored_record)."""
    where = str(path) if path is not None else None  # which chain, in a JSON log line
    log.info(
        "audit record %d %s: %s", seq, digest, entry.action, extra={"key_id": entry.key_id, "database": where}
    )


def utc_text(at: float) -> str:
    """An audit record's time: UTC, ISO 8601 with milliseconds."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(at * 1000) % 1000:03d}Z"


class Ledger:
    """Usage, quotas and the audit chain over one database and its writer thread."""

    def __init__(
        self,
        path: Path | None,
        *,
        time_zone: str = "UTC",
        detail_hours: int = 48,
        retention_days: int = 400,
        audit_retention_days: int = 400,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.zone = ZoneInfo(time_zone)
        self.detail_hours = detail_hours
        self.retention_days = retention_days
        self.audit_retention_days = audit_retention_days
        self._clock = clock
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ledger")
        # The usage checks after the start's (`check_usage`): their own thread, their own reads.
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="ledger-check")
        self._reader: sqlite3.Connection | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the database it opened
        self._mode = 0o600  # its permissions as last seen, for a copy saved back (`_save_if_gone`)
        self.file_problem: str | None = None  # the file removed or replaced under it (`check_file`)
        self._file_here = True  # whether the file at its path was that one at the last check
        try:
            self._conn = self._writer.submit(open_database, path).result()
            if path is not None:
                self._reader = _open_reader(path)
                self._file = _identity(path)
                self._mode = stat.S_IMODE(os.stat(path).st_mode)
        except BaseException:
            self._writer.shutdown(wait=False)
            self._checker.shutdown(wait=False)
            if getattr(self, "_conn", None) is not None:
                self._conn.close()
            raise
        self._lock = threading.Lock()
        self._usage: list[tuple[UsageRecord, Future[bool]]] = []
        self._audit: list[tuple[AuditEntry, Future[int]]] = []
        self._retry_usage: list[UsageRecord] = []
        # Requests admitted and not yet ended, by key: a request budget counts them as spent,
        # so that concurrent requests cannot pass it together (`check(..., hold=True)`).
        self._in_flight: Counter[str] = Counter()
        self._reserved: Counter[str] = Counter()  # prompt tokens of requests in flight (`reserve`)
        # The audit chain as /admin/audit last found it whole (`chain`): the thread of `read` only.
        self._chain_end: tuple[int, str, str] | None = None
        self._chain_at = -FULL_VERIFY_S
        self._chain_covered = 0
        self._retry_audit: list[AuditEntry] = []
        self._scheduled = False
        self._closed = False
        self._head = self._run(audit.head)
        if path is not None:  # what this start found, for `compare`: nothing added while stopped
            log.info("audit chain opened after record %d %s", *self._head, extra={"database": str(path)})
        self._current = usage.periods(clock(), self.zone)
        # Usage seals (see `seals`), writer thread only: the seq of each hour's last seal, the
        # hours written since theirs (sealed once over), the hours found edited (never resealed).
        self._seals: dict[int, tuple[int, str]] = {}  # hour: (seq, digest) of its last seal
        self._dirty: set[int] = set()
        self._tampered: set[int] = set()
        self._reported: set[int] = set()  # hours whose edits the log and the chain were told of
        self._tick_hour = 0
        self._pruned_before = 0  # the latest cut pruning made, said in each seal (see seals.pruned_cut)
        # When the last usage check began: the writer's `PRAGMA data_version` then (it changes
        # when another connection commits, never for the daemon's own) and time.monotonic().
        self._checked: tuple[int, float] | None = None
        self.usage_found = seals.Findings()
        self._resume: AuditEntry | None = None  # the start's `seals.RESUMED` record, queued first
        self._through = -1  # the newest seal's mark (`seals.Seal.through`): hours before it are sealed
        self.error: str | None = None  # the last failed commit, until one succeeds
        self.commits = 0
        self.records = 0
        self.dropped = 0  # records given up after commits failed for longer than MAX_KEPT allows
        self.foreign: str | None = None  # records found in the chain that this daemon did not write
        self._periods = self._run(self._open_usage)
        self._queue_resume()

    def _queue_resume(self) -> None:
        """The start's `seals.RESUMED` record (when `_open_usage` made one), the first queued."""
        if self._resume is not None:
            self.audit(self._resume)
            self._resume = None

    def _open_usage(self, conn: sqlite3.Connection) -> dict[tuple[str, str], list[int]]:
        """On the writer, at the start: the usage checked against its seals and the quota totals
        against the hours (put back within them, in one transaction with the record that says
        so); the hours after the last seal are sealed as found once over. The totals to count."""
        now = self._clock()
        self._checked = (_data_version(conn), time.monotonic())
        sealed = seals.load(conn)
        self._seals = {hour: (seal.seq, seal.figures.digest) for hour, seal in sealed.items()}
        newest = max(sealed.values(), key=lambda seal: seal.seq, default=None)
        self._pruned_before = newest.pruned_before if newest is not None else 0
        # A time zone changed since the newest seal: its days and months are other spans of
        # hours, whose totals are counted from the hours, not said to be edited.
        rezoned = newest is not None and newest.time_zone not in (None, self.zone.key)
        restate = newest is not None and (newest.retention_days != self.retention_days or rezoned)
        if restate and newest is not None and newest.retention_days is not None:
            # The latest cut the old retention can have made: its hours stay gone when lengthened.
            self._pruned_before = max(self._pruned_before, int(now - newest.retention_days * 86_400))
        found = self._check_usage(conn, now, sealed)
        self._dirty = set(found.open)
        if restate and newest is not None and newest.hour not in self._tampered:
            self._dirty.add(newest.hour)  # `audit verify` reads the retention from the newest seal
        cutoff = seals.pruned_cut(sealed, now, self.retention_days, self._pruned_before) or 0.0
        stored = usage.load_periods(conn, self._current)
        totals, fixed = seals.check_periods(
            conn, stored, self._current, zone=self.zone, cutoff=cutoff, edited=found.found
        )
        if rezoned and newest is not None:
            log.info(
                "ledger: the time zone changed from %s to %s: the current day's and month's totals"
                " are counted from their hours",
                newest.time_zone,
                self.zone.key,
            )
            fixed = []
        stop = seals.last_stop(conn)
        if stop is not None and stop.resumed is None:  # the first start since a clean stop: ends its span
            self._resume = seals.resume_entry(utc_text(now), stop)
        mark = seals.newest_mark(sealed, stop)
        self._through = mark if mark is not None else -1
        if found.found or fixed or totals != stored:
            self._report(conn, found, fixed, {k: v for k, v in totals.items() if stored.get(k) != v})
        return totals

    def _check_usage(
        self, conn: sqlite3.Connection, now: float, sealed: Mapping[int, seals.Seal] | None = None
    ) -> seals.Findings:
        """On the writer: every hour's usage against its seal, kept for `status` (said by the caller)."""
        return self._keep(self._findings(conn, now, self._pruned_before, sealed))

    def _findings(
        self,
        conn: sqlite3.Connection,
        now: float,
        pruned_before: int,
        sealed: Mapping[int, seals.Seal] | None = None,
    ) -> seals.Findings:
        """Every hour's usage against its seal, on any connection (a check that fails is itself
        a finding, never a pass)."""
        try:
            return seals.check(
                conn, now, retention_days=self.retention_days, sealed=sealed, pruned_before=pruned_before
            )
        except (sqlite3.Error, ValueError, OverflowError) as exc:  # never a pass: not checked is said
            return _unchecked(exc)

    def _keep(self, found: seals.Findings) -> seals.Findings:
        """On the writer: a check's findings kept for `status`; the edited hours are never sealed
        again. The hours this daemon wrote and has not sealed yet are its own, in progress: one
        ahead of a clock stepped back since is no edit."""
        for hour in self._dirty & set(found.found):
            del found.found[hour]
            found.open.append(hour)
        if -1 not in found.found:  # a check that failed names no hour
            self._tampered |= set(found.found)
        self.usage_found = found
        return found

    def _apply(self, conn: sqlite3.Connection, found: seals.Findings) -> seals.Findings:
        """On the writer: a check's findings kept, and those not yet told of said (`_report`)."""
        self._report(conn, self._keep(found))
        return found

    def check_usage(
        self, *, whole_walk: bool = False, after: Future[bool] | None = None
    ) -> Future[seals.Findings]:
        """Check the usage against its seals off the writer (see the module's doc): a future of
        what `status` then says. A whole walk of /admin/audit (`whole_walk`) checks only when
        another connection wrote to the database since the last check, at most every
        FULL_VERIFY_S; the hourly maintenance unless the last check is younger than
        USAGE_FRESH_S and nothing wrote since. `after`: a future to wait for first (the
        maintenance's writer part: True when it removed usage or records, a check then due)."""
        try:
            return self._checker.submit(self._check_off_writer, whole_walk, after)
        except RuntimeError:  # closed: what was found stands
            done: Future[seals.Findings] = Future()
            done.set_result(self.usage_found)
            return done

    def _check_off_writer(self, whole_walk: bool, after: Future[bool] | None) -> seals.Findings:
        removed = after.result() if after is not None else False
        due = self._writer.submit(self._due, self._conn, whole_walk, removed).result()
        if due is None:
            return self.usage_found
        now, pruned_before = due
        reader = self._reader
        if reader is None:  # in memory: one connection, the writer's
            found = self._writer.submit(self._findings, self._conn, now, pruned_before).result()
        else:
            try:  # one committed state for every read of the check
                found = _snapshot(reader, lambda conn: self._findings(conn, now, pruned_before))
            except sqlite3.Error as exc:
                found = _unchecked(exc)
        return self._writer.submit(self._apply, self._conn, found).result()

    def _due(self, conn: sqlite3.Connection, whole_walk: bool, removed: bool) -> tuple[float, int] | None:
        """On the writer: (now, the pruning's cut) for a check to begin now, None when none is due."""
        version, moment = _data_version(conn), time.monotonic()
        if self._checked is not None and not removed:
            written = version != self._checked[0]
            age = moment - self._checked[1]
            if (whole_walk and not (written and age >= FULL_VERIFY_S)) or (
                not whole_walk and not written and age < USAGE_FRESH_S
            ):
                return None
        self._checked = (version, moment)
        return self._clock(), self._pruned_before

    def _report(
        self,
        conn: sqlite3.Connection,
        found: seals.Findings,
        fixed: Sequence[str] = (),
        totals: Mapping[tuple[str, str], list[int]] | None = None,
    ) -> None:
        """On the writer: edited usage found (the hours not told of before, and quota totals
        put back, in the same transaction), said in the log and in the chain (ERROR)."""
        problems = [text for hour, text in sorted(found.found.items()) if hour not in self._reported]
        problems += fixed
        if not problems and not totals:
            return
        for problem in problems:
            log.error("%s (tampering?)", problem)
        named = " | ".join(problems[: seals.MAX_NAMED])
        detail = {"problems": len(problems), "first": problems[0] if problems else "", "named": named}
        entry = AuditEntry(utc_text(self._clock()), "ERROR", seals.TAMPERED, detail=detail)
        head, noted = self._head, list[tuple[int, str, AuditEntry]]()
        try:
            conn.execute("BEGIN IMMEDIATE")
            seals.write_periods(conn, totals or {})
            if problems:
                head, noted = self._foreign_records(conn, self._head)
                head = audit.append(conn, entry, head)
            conn.execute("COMMIT")
        except (sqlite3.Error, ValueError, OverflowError) as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("ledger: the record of edited usage could not be written: %s", self.error)  # noqa: TRY400
            return
        self._reported.update(found.found)
        if not problems:
            return
        self._head = head
        for seq, digest, noted_entry in [*noted, (head[0], head[1], entry)]:
            _mirror(seq, digest, noted_entry, self.path)

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return self._writer.submit(fn, self._conn).result()

    def query(self, fn: Callable[[sqlite3.Connection], T]) -> Future[T]:
        """Run a read on the writer thread (the connection is its own): a future of its result."""
        return self._writer.submit(fn, self._conn)

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> Future[T]:
        """Run a read off the writer (the admin API's): on the checks' thread and connection, in
        one read transaction, once what was queued before it is committed. A year of usage
        read on the writer held every commit, and the answers waiting for theirs, for seconds.
        In memory (one connection): on the writer. A future of its result."""
        if self._reader is None:
            return self.query(fn)
        try:
            return self._checker.submit(self._read, fn)
        except RuntimeError:  # closed
            refused: Future[T] = Future()
            refused.set_exception(RuntimeError("the ledger is closed"))
            return refused

    def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        reader = self._reader
        assert reader is not None  # noqa: S101 - read() sends only a ledger with a file here
        self._writer.submit(self._commit).result()  # what was queued before the read is in it
        return _snapshot(reader, fn)

    # ---- usage and quotas ------------------------------------------------------------------

    def _roll(self, now: float) -> tuple[str, str]:
        """Under the lock: the current (day, month); totals of past periods are let go."""
        current = usage.periods(now, self.zone)
        if current != self._current:
            self._current = current
            self._periods = {k: v for k, v in self._periods.items() if k[1] in current}
        return current

    def record(self, record: UsageRecord, reserved: int = 0) -> Future[bool]:
        """Count a finished request now (quotas see it at once) and queue its commit; the
        `reserved` prompt tokens it held (`reserve`) are let go of in the same moment.

        The future is True once it is on disk, False when its id was counted already; it
        fails when the commit did (the record is kept and tried again).
        """
        future: Future[bool] = Future()
        with self._lock:
            self._unreserve(record.key_id, reserved)
            for period in self._roll(record.at):
                totals = self._periods.setdefault((record.key_id, period), [0, 0])
                totals[0] += 1
                totals[1] += record.tokens
            self._usage.append((record, future))
            self._schedule()
        return future

    def used(self, key_id: str, now: float | None = None) -> dict[str, int]:
        """What a key used in the current local day and month."""
        with self._lock:
            day, month = self._roll(self._clock() if now is None else now)
            d = self._periods.get((key_id, day), [0, 0])
            m = self._periods.get((key_id, month), [0, 0])
        return {"requests_day": d[0], "tokens_day": d[1], "requests_month": m[0], "tokens_month": m[1]}

    def check(
        self, key_id: str, quota: Budgets, now: float | None = None, *, hold: bool = False
    ) -> Breach | None:
        """The first budget of `quota` that `key_id` has spent, or None.

        With `hold`, a request that passes is counted in flight until `release`: a request
        budget counts the requests in flight as spent, so that requests arriving together
        cannot pass it together. A token budget is checked against what finished requests
        used and the prompts of those in flight (`reserve`): the requests in flight when it
        runs out may go past it by what they generate.
        """
        if (
            quota.requests_per_day is None
            and quota.requests_per_month is None
            and quota.tokens_per_day is None
            and quota.tokens_per_month is None
        ):
            return None  # most keys: no lock taken, nothing read
        moment = self._clock() if now is None else now
        with self._lock:
            day, month = self._roll(moment)
            d = self._periods.get((key_id, day), [0, 0])
            m = self._periods.get((key_id, month), [0, 0])
            flying = self._in_flight[key_id] if hold else 0
            prompts = self._reserved[key_id]
            for budget, limit, used, resets in (
                ("requests_per_day", quota.requests_per_day, d[0] + flying, usage.next_day),
                ("tokens_per_day", quota.tokens_per_day, d[1] + prompts, usage.next_day),
                ("requests_per_month", quota.requests_per_month, m[0] + flying, usage.next_month),
                ("tokens_per_month", quota.tokens_per_month, m[1] + prompts, usage.next_month),
            ):
                if limit is not None and used >= limit:
                    return Breach(budget, limit, used, resets(moment, self.zone))
            if hold:
                self._in_flight[key_id] += 1
        return None

    def reserve(self, key_id: str, quota: Budgets, tokens: int, now: float | None = None) -> Breach | None:
        """Hold a prompt about to be computed against `key_id`'s token budgets, or the first of
        them spent (by finished requests and the prompts held already): requests that passed the
        check together each see the others' prompts before they compute theirs. Held until the
        request's usage is recorded (`record`) or `unreserve`."""
        if tokens <= 0 or (quota.tokens_per_day is None and quota.tokens_per_month is None):
            return None
        moment = self._clock() if now is None else now
        with self._lock:
            day, month = self._roll(moment)
            held = self._reserved[key_id]
            for budget, limit, period, resets in (
                ("tokens_per_day", quota.tokens_per_day, day, usage.next_day),
                ("tokens_per_month", quota.tokens_per_month, month, usage.next_month),
            ):
                used = self._periods.get((key_id, period), [0, 0])[1] + held
                if limit is not None and used >= limit:
                    return Breach(budget, limit, used, resets(moment, self.zone))
            self._reserved[key_id] += tokens
        return None

    def unreserve(self, key_id: str, tokens: int) -> None:
        """Let go of prompt tokens `reserve` held for a request that recorded no usage."""
        with self._lock:
            self._unreserve(key_id, tokens)

    def _unreserve(self, key_id: str, tokens: int) -> None:
        if tokens > 0 and key_id in self._reserved:
            self._reserved[key_id] -= tokens
            if self._reserved[key_id] <= 0:
                del self._reserved[key_id]

    def release(self, key_id: str) -> None:
        """A request `check(..., hold=True)` let pass has ended."""
        with self._lock:
            self._in_flight[key_id] -= 1
            if self._in_flight[key_id] <= 0:
                del self._in_flight[key_id]

    # ---- audit -----------------------------------------------------------------------------

    def audit(self, entry: AuditEntry) -> Future[int]:
        """Queue an audit record (from any thread); the future is its seq once committed."""
        future: Future[int] = Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("the ledger is closed"))
                return future
            self._audit.append((entry, future))
            self._schedule()
        return future

    def chain(self, conn: sqlite3.Connection, now: float | None = None) -> tuple[Verdict, int]:
        """On the thread of `read`: the audit chain verified, and how many records that
        verdict covers. The whole chain at most every FULL_VERIFY_S; between, the records added
        since the last walk that found it whole, checked against where that walk ended."""
        moment = time.monotonic() if now is None else now
        resume = self._chain_end if moment - self._chain_at < FULL_VERIFY_S else None
        verdict = audit.verify(conn, after=resume)
        if not verdict.ok or verdict.end is None:
            self._chain_end, self._chain_at = None, -FULL_VERIFY_S  # walk it all next time
            return verdict, verdict.checked
        covered = (self._chain_covered if resume is not None else 0) + verdict.checked
        if resume is None:
            self._chain_at = moment
        self._chain_end, self._chain_covered = verdict.end, covered
        return verdict, covered

    # ---- the writer ------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Under the lock: make sure a commit runs soon for what is queued."""
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._writer.submit(self._commit)

    def _commit(self) -> None:
        with self._lock:
            self._scheduled = False
            pending_usage, self._usage = self._usage, []
            pending_audit, self._audit = self._audit, []
            retry_usage, self._retry_usage = self._retry_usage, []
            retry_audit, self._retry_audit = self._retry_audit, []
        this_hour = usage.hour_of(self._clock())
        due = {hour for hour in self._dirty - self._tampered if hour < this_hour}
        if not (pending_usage or pending_audit or retry_usage or retry_audit or due):
            return
        conn = self._conn
        head = self._head
        written: list[tuple[int, str, AuditEntry]] = []
        noted: list[tuple[int, str, AuditEntry]] = []  # the daemon's own note of foreign records
        fresh: list[bool] = []
        new_seals: dict[int, tuple[int, str]] = {}
        touched: set[int] = set()
        over: list[int] = []
        edited: dict[int, str] = {}
        detail = self.detail_hours > 0
        try:
            conn.execute("BEGIN IMMEDIATE")
            records = [*retry_usage, *(r for r, _ in pending_usage)]
            edited = self._edited_before(conn, records)
            again = [usage.write(conn, r, self.zone, detail=detail) for r in retry_usage]
            fresh = [usage.write(conn, r, self.zone, detail=detail) for r, _ in pending_usage]
            written_now = zip(records, [*again, *fresh], strict=True)
            touched = {usage.hour_of(r.at) for r, new in written_now if new}
            # An hour over is sealed in the transaction that wrote its last rows (see `seals`); so
            # is one at or before the newest sealed hour, or before the newest seal's mark,
            # whatever the clock says (stepped back).
            horizon = max(max(self._seals, default=-1), self._through - usage.HOUR_S)
            over = sorted(
                h
                for h in due | touched
                if (h < this_hour or h <= horizon) and h not in self._tampered and h not in edited
            )
            if retry_audit or pending_audit or over:
                head, noted = self._foreign_records(conn, head)
            for entry in [*retry_audit, *(e for e, _ in pending_audit)]:
                head = audit.append(conn, entry, head)
                written.append((head[0], head[1], entry))
            head = self._append_seals(conn, over, head, through=this_hour, to=(written, new_seals))
            conn.execute("COMMIT")
        except Exception as exc:  # noqa: BLE001 - a full disk or a bug: kept, tried again, reported
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            self.error = f"{type(exc).__name__}: {exc}"
            log.error(  # noqa: TRY400 - the cause is in the message; no traceback wanted
                "ledger commit failed, %d record(s) kept for the next try: %s",
                len(pending_usage) + len(pending_audit) + len(retry_usage) + len(retry_audit),
                self.error,
            )
            with self._lock:
                self._retry_usage = [*retry_usage, *(r for r, _ in pending_usage), *self._retry_usage]
                self._retry_audit = [*retry_audit, *(e for e, _ in pending_audit), *self._retry_audit]
                # A disk full for hours must not fill the memory too: past the bound the oldest go.
                for name in ("_retry_usage", "_retry_audit"):
                    kept: list[Any] = getattr(self, name)
                    if len(kept) > MAX_KEPT:
                        self.dropped += len(kept) - MAX_KEPT
                        setattr(self, name, kept[-MAX_KEPT:])
            failure = OSError(self.error)
            for _, future in pending_usage:
                future.set_exception(failure)
            for _, audit_future in pending_audit:
                audit_future.set_exception(failure)
            return
        self._head = head
        self._seals.update(new_seals)
        if new_seals:
            self._through = max(self._through, this_hour)
        self._tampered.update(edited)
        self._dirty = (self._dirty | touched) - set(over) - self._tampered
        self.error = None
        self.commits += 1
        self.records += len(pending_usage) + len(retry_usage)
        for (_, future), new in zip(pending_usage, fresh, strict=True):
            future.set_result(new)
        seqs = iter(written[len(retry_audit) :])
        for _, audit_future in pending_audit:
            audit_future.set_result(next(seqs)[0])
        for seq, digest, entry in [*noted, *written]:
            _mirror(seq, digest, entry, self.path)
        if edited:  # found as a record landed in it: said now, never sealed over
            self.usage_found.found.update(edited)
            found_now = seals.Findings(found=dict(edited))
            self._report(conn, found_now)

    def _append_seals(
        self,
        conn: sqlite3.Connection,
        hours: Sequence[int],
        head: tuple[int, str],
        *,
        through: int,
        to: tuple[list[tuple[int, str, AuditEntry]], dict[int, tuple[int, str]]],
    ) -> tuple[int, str]:
        """Inside a transaction: a seal record of each of these hours that holds rows, marked
        `through`, appended after `head` (each added to `to`: the records written, the new
        seals). The new head."""
        written, new_seals = to
        stamp = utc_text(self._clock())
        for hour, found in (seals.figures(conn, hours) if hours else {}).items():
            entry = seals.entry(
                hour,
                found,
                stamp,
                retention_days=self.retention_days,
                pruned_before=self._pruned_before,
                resealed=self._seals[hour][0] if hour in self._seals else None,
                time_zone=self.zone.key,
                through=through,
            )
            head = audit.append(conn, entry, head)
            written.append((head[0], head[1], entry))
            new_seals[hour] = (head[0], found.digest)
        return head

    def _edited_before(self, conn: sqlite3.Connection, records: Sequence[UsageRecord]) -> dict[int, str]:
        """Inside the commit, before its records are written: the sealed hours they land in whose
        rows no longer match their seals (an edit since; sealed again, it would be blessed)."""
        cut = max(self._pruned_before, self._clock() - self.retention_days * 86_400)
        hours = {usage.hour_of(r.at) for r in records}
        sealed = sorted(h for h in hours if h in self._seals and h not in self._tampered and h >= cut)
        if not sealed:
            return {}
        now = seals.figures(conn, sealed)
        return {
            hour: (
                f"usage of the hour {seals.label(hour)} was edited: its rows differ from its seal "
                f"(record {self._seals[hour][0]}), found as a record landed in it"
            )
            for hour in sealed
            if now.get(hour, seals.EMPTY).digest != self._seals[hour][1]
        }

    def _foreign_records(
        self, conn: sqlite3.Connection, head: tuple[int, str]
    ) -> tuple[tuple[int, str], list[tuple[int, str, AuditEntry]]]:
        """Inside the commit's transaction: the head to append after. Records past the daemon's
        own head were written by another hand (the daemon is the chain's one writer): appending
        after them, the daemon says so in the chain and its log, rather than failing every commit
        (usage with it) on their seq. A head behind the daemon's (its last records removed) is
        not followed: the gap the next record leaves shows the removal."""
        found = audit.head(conn)
        if found[0] <= head[0]:
            return head, []
        seen = (
            f"records {head[0] + 1} to {found[0]} were"
            if found[0] > head[0] + 1
            else f"record {found[0]} was"
        )
        message = f"audit chain: {seen} not written by this daemon (tampering?)"
        log.error("%s; the next records follow them", message)
        self.foreign = message
        entry = AuditEntry(utc_text(self._clock()), "ERROR", message)
        after = audit.append(conn, entry, found)
        return after, [(after[0], after[1], entry)]

    def tick(self) -> None:
        """Called often (the event loop's ledger task): once an hour is over, seal what it
        holds, whether or not a request comes to trigger a commit."""
        hour = usage.hour_of(self._clock())
        if hour != self._tick_hour and not self._closed:
            self._tick_hour = hour
            self._writer.submit(self._commit)

    def retry(self) -> Future[None]:
        """Commit what earlier commits could not (on the writer): a failing ledger mends itself
        once its disk has room again, whether or not new requests come to trigger a commit."""
        return self._writer.submit(self._commit)

    def maintain(self) -> Future[seals.Findings]:
        """Retry what failed, prune usage past its retention, rotate the audit log (on the writer),
        then check the usage against its seals (`check_usage`): a future of what that found."""

        def run(conn: sqlite3.Connection) -> bool:
            self._commit()
            now = self._clock()
            try:
                conn.execute("BEGIN IMMEDIATE")
                hours = usage.prune(
                    conn, now, detail_hours=self.detail_hours, retention_days=self.retention_days
                )
                self._pruned_before = max(self._pruned_before, int(now - self.retention_days * 86_400))
                before = utc_text(now - self.audit_retention_days * 86_400)
                head, noted = self._foreign_records(conn, self._head)
                gone, head, rotated = audit.rotate(conn, before, head, utc_text(now))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("ledger maintenance failed: %s", self.error)  # noqa: TRY400
                return False
            self._head = head
            for seq, digest, entry in noted:
                _mirror(seq, digest, entry, self.path)
            if rotated is not None:
                _mirror(head[0], head[1], rotated, self.path)
            return hours > 0 or gone > 0

        return self.check_usage(after=self._writer.submit(run, self._conn))

    def status(self) -> dict[str, Any]:
        """For /admin/status: where the ledger is, what it wrote and whether its last commit failed."""
        with self._lock:
            waiting = len(self._usage) + len(self._audit) + len(self._retry_usage) + len(self._retry_audit)
        return {
            "database": str(self.path) if self.path is not None else None,
            "time_zone": self.zone.key,
            "commits": self.commits,
            "usage_records": self.records,
            "audit_head": self._head[0],
            "waiting": waiting,
            "dropped": self.dropped,
            "foreign_records": self.foreign,
            "usage_seals": self.usage_found.as_dict(),
            "error": self.failing,
        }

    @property
    def failing(self) -> str | None:
        """Why the ledger is not writing durably: a failed commit, or its file gone from its
        path (`check_file`); None when it is. /readyz says `ledger_failing` while it is not None."""
        return self.error or self.file_problem

    @property
    def failing_summary(self) -> str | None:
        """`failing` in a few words, without the path or the error (a public probe shows it):
        /readyz's reason and the start of systemd's STATUS= line."""
        if self.file_problem is not None:
            return "the usage ledger's database file is gone from its path"
        if self.error is not None:
            return "the usage ledger cannot commit"
        return None

    def check_file(self) -> str | None:
        """Whether the database file is still the one the ledger opened (`file_problem`). One
        removed or replaced while the daemon runs took every later record with it: SQLite goes
        on writing into the open file, which nobody can read and which is gone at the stop.
        Said (ERROR, /readyz, status) until the stop, which saves what the ledger holds.

        Once the file is gone, this process's `-wal` and `-shm` by its name are removed at once
        (the open connections keep theirs): SQLite leaves those of a moved database, and any
        file opened at the path read that WAL as its own (a database renamed over the ledger
        showed, and on its first read-write close was given, the ledger's tables). A file put
        back stays said until the restart: its recent records are in a WAL no name reaches."""
        if self.path is None or self._file is None:
            return None
        try:
            info: os.stat_result | None = os.stat(self.path)
        except FileNotFoundError:
            info = None
        except OSError:
            return self.file_problem  # cannot look: as it was
        self._file_here = info is not None and (info.st_dev, info.st_ino) == self._file
        if info is not None and self._file_here:
            self._mode = stat.S_IMODE(info.st_mode)
            if self.file_problem is None:
                return None
            problem = (
                f"the database file {self.path} was removed or replaced while the daemon ran and is "
                "back: what it records is not on disk for good until the daemon restarts (restart it)"
            )
        else:
            what = "removed" if info is None else "replaced by another file"
            problem = (
                f"the database file {self.path} was {what} while the daemon ran: records go on into "
                "the file it opened, saved back at the daemon's stop (restart it to write to the file again)"
            )
            if problem != self.file_problem:  # first seen gone: nothing of ours makes the names again
                for beside, identity in _ours_beside(self.path):
                    with contextlib.suppress(OSError):
                        if _identity(beside) == identity:
                            beside.unlink()
        if problem != self.file_problem:
            log.error("ledger: %s", problem)
        self.file_problem = problem
        return problem

    def _seal_at_stop(self) -> None:
        """On the writer, at a clean stop after the last commit: the hours written since their
        seals, the one in progress too, sealed now, and a `seals.STOPPED` record saying every
        hour before the next is sealed. Quiet hours after the last seal, the hour the daemon
        stopped in and the hours until it runs again held no usage but what is sealed: rows
        added to them later are found (`seals.check`). Not for a ledger that holds no usage,
        nor one failing (what it could not write is said already)."""
        if self.error is not None or not (self._seals or self._dirty):
            return
        this_hour = usage.hour_of(self._clock())
        through = this_hour + usage.HOUR_S
        hours = sorted(self._dirty - self._tampered)
        written: list[tuple[int, str, AuditEntry]] = []
        new_seals: dict[int, tuple[int, str]] = {}
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            head, noted = self._foreign_records(conn, self._head)
            head = self._append_seals(conn, hours, head, through=through, to=(written, new_seals))
            stamp = utc_text(self._clock())
            entry = seals.stop_entry(stamp, max([through, *(h + usage.HOUR_S for h in hours)]))
            head = audit.append(conn, entry, head)
            written.append((head[0], head[1], entry))
            conn.execute("COMMIT")
        except Exception as exc:  # noqa: BLE001 - a full disk or a bug: the next start finds them open
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            log.error("ledger: the usage could not be sealed at the stop: %s: %s", type(exc).__name__, exc)  # noqa: TRY400
            return
        self._head = head
        self._seals.update(new_seals)
        self._dirty -= set(new_seals)
        for seq, digest, record in [*noted, *written]:
            _mirror(seq, digest, record, self.path)

    def _save_if_gone(self) -> Path | None:
        """On the writer, at the stop: when the database file is gone from its path, the whole
        database as this connection holds it, copied to a new file beside it (returned). None
        when nothing needs saving."""
        if self.path is None or self._file is None or self.check_file() is None:
            return None
        if self._file_here:
            return None  # put back: the close writes the WAL into it, as any close does
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        saved = self.path.with_name(f"{self.path.name}.saving-{stamp}")
        fd = os.open(saved, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, self._mode & 0o770)  # the file's own mode (a reader group), never others'
        finally:
            os.close(fd)
        target = sqlite3.connect(str(saved))
        try:
            self._conn.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
        finally:
            target.close()
        return saved

    def _place(self, saved: Path) -> None:
        """The saved copy put at the database's path where it is free, beside it where another
        file took it (that one is left as it is)."""
        assert self.path is not None  # noqa: S101 - saved only for a ledger with a file
        where = self.path
        try:
            os.link(saved, where)  # never over a file that stands there
        except FileExistsError:
            where = saved.with_name(saved.name.replace(".saving-", ".kept-"))
            os.link(saved, where)
        saved.unlink()
        if where != self.path:
            log.error(
                "ledger: another file stands at %s; what this daemon recorded is saved as %s",
                self.path,
                where,
            )
        else:
            log.warning("ledger: the database file removed while the daemon ran is written back to %s", where)

    def close(self) -> None:
        """Commit what is queued and close the database."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # A check or read under way ends first (it asks the writer); those not begun are not.
        self._checker.shutdown(wait=True, cancel_futures=True)
        if self._reader is not None:
            self._reader.close()
        self._writer.submit(self._commit).result()
        self._writer.submit(self._seal_at_stop).result()
        with self._lock:
            lost_usage, lost_audit = len(self._retry_usage), len(self._retry_audit)
        if lost_usage or lost_audit:  # the last try failed too: say so, never a quiet stop
            log.error(
                "ledger closed with %d usage and %d audit record(s) it could not write; they are lost: %s",
                lost_usage,
                lost_audit,
                self.error,
            )
        try:
            gone = self._writer.submit(self._save_if_gone).result()
        except (OSError, sqlite3.Error) as exc:
            gone = None
            log.error("ledger: its database file is gone and what it held could not be saved: %s", exc)  # noqa: TRY400
        self._writer.submit(self._conn.close).result()
        if gone is not None:
            try:
                self._place(gone)
            except OSError as exc:
                log.error("ledger: what it held is saved as %s, not put back: %s", gone, exc)  # noqa: TRY400
        self._writer.shutdown(wait=True)


# ---- the audit logger's records, into the chain -------------------------------------------------

# What any client can cause at will (wrong credentials, refused addresses, cross-site or
# CSRF-less console calls) comes in floods: summed per minute into one record, not one each.
FAILED_SIGN_INS: Final = ("auth failed", "console sign-in refused", "console refused", "admin refused")
SUMMARY: Final = "failed sign-ins and refusals in the last minute: {count}"
_EXTRA: Final = ("model", "action", "outcome", "trigger", "budget")


class AuditHandler(logging.Handler):
    """A logging handler on the `edgellmd.audit` logger: every record goes into the chain,
    failed sign-ins as a per-minute summary (`flush_summary`)."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(logging.INFO)
        self.ledger = ledger
        self._failed: dict[str, int] = {}
        self._peers: dict[str, int] = {}
        self._failed_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            peer = getattr(record, "peer", None)
            if message.startswith(FAILED_SIGN_INS):
                with self._failed_lock:
                    self._failed[message] = self._failed.get(message, 0) + 1
                    if peer:
                        self._peers[str(peer)] = self._peers.get(str(peer), 0) + 1
                return
            detail = {
                k: getattr(record, k) for k in _EXTRA if isinstance(getattr(record, k, None), str | int)
            }
            key_id = getattr(record, "key_id", None)
            self.ledger.audit(
                AuditEntry(
                    utc_text(record.created),
                    record.levelname,
                    message,
                    key_id=str(key_id) if key_id else None,
                    peer=str(peer) if peer else None,
                    detail=detail,
                )
            )
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)

    def flush_summary(self, now: float | None = None) -> Future[int] | None:
        """One record of the failed sign-ins since the last summary (none when there were none)."""
        with self._failed_lock:
            failed, self._failed = self._failed, {}
            peers, self._peers = self._peers, {}
        if not failed:
            return None
        top = dict(sorted(peers.items(), key=lambda kv: (-kv[1], kv[0]))[:10])
        detail: Mapping[str, Any] = {"count": sum(failed.values()), "reasons": failed, "peers": top}
        at = time.time() if now is None else now
        return self.ledger.audit(
            AuditEntry(
                utc_text(at),
                "WARNING",
                SUMMARY.format(count=sum(failed.values())),
                detail=detail,
            )
        )
