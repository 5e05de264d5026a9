"""Usage sealed into the audit chain: each hour's totals, once the hour is over.

The usage tables are totals the daemon adds to (`usage.write`); nothing in them shows an edit.
Once a UTC hour is over, the daemon appends to the audit chain a `usage sealed` record of that
hour's rows: how many, their requests and tokens, and the SHA-256 of the rows themselves (key,
model, endpoint and figures, in key order). A record that arrives for an hour already over (a
request that ended at 12:59:59 and committed after 13:00, a record retried after a failed
commit) reseals its hour in the same transaction, so an honest ledger's hours match their last
seals at every moment, whenever the daemon is killed. `check` finds:

- an hour whose rows differ from its last seal: a count edited, a row added or removed;
- an hour sealed and within the usage retention whose rows are all gone: removed;
- an hour with rows and no seal before the last hour sealed, or before the newest seal's
  `through` (the hour it was made in: every hour before it with rows was sealed, so the
  quiet hours after the last one with rows too): added by another hand;
- an hour with rows and no seal from a clean stop (`STOPPED`: the daemon seals the hour it
  stops in and says every hour before the next is sealed) to the start after it (`RESUMED`,
  or now while no daemon runs): no daemon ran to record it;
- an hour with rows that has not begun by the clock (`AHEAD_S`; or the clock was set back; the running
  daemon's own hours in progress are never read so: `store.Ledger._keep`).

A text cell is digested with its type where it is no text (a blob of the same bytes, a
number, a NULL): retyped, a row no longer answers a lookup by its key.

A seal record is the chain's, so editing or removing one is a break `audit.verify` names, and
rewriting the chain after it is what the journal's copy shows (`audit.compare`).

What seals cannot show: the hour in progress, and at a start after a stop that was not clean
(a kill, a power cut) the hours after the last seal's mark, which the daemon seals as it
finds them. A writer of the database can change those unseen. Hours older than the audit
chain's oldest record whose seal went with a rotation (`ledger.audit_retention_days` shorter
than `usage_retention_days`) are counted as unverifiable, not checked. The per-request rows
(`usage_requests`, kept `usage_detail_hours`) are a lookup, not sealed.

The quota totals (`usage_periods`, what budgets count) are checked at the daemon's start
against the hours (`check_periods`): a day's or month's total can be no less than the hours
wholly inside it, nor more than the hours that overlap it (in a zone whose offset is not whole
hours, an hour straddles two days). A total below the floor is raised to it (a key that
lowered its own total gets its budget spent again); one above the ceiling is said and kept
(lowered, it would hand the key budget back). Hours `check` found edited bound nothing.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any, Final
from zoneinfo import ZoneInfo

from edgellmd.ledger.audit import AuditEntry
from edgellmd.ledger.usage import HOUR_S, hour_of, local_start, next_month, text_of

SEALED: Final = "usage sealed"  # the action of a seal record
STOPPED: Final = "usage stopped"  # the record a clean stop appends: every hour before `through` sealed
RESUMED: Final = "usage resumed"  # the record a start after such a stop appends first
TAMPERED: Final = "usage tampered"  # the action of the record a start that finds an edit appends
# An hour with rows that begins this long after the clock has not begun: added by another hand
# (or the clock was set back). The slack: a record committed as an hour begins, read by a
# check whose clock was read a moment before.
AHEAD_S: Final = 60
MAX_NAMED: Final = 5  # problems named in a status answer or record (all are counted)
MAX_TOTAL: Final = 2**63 - 1  # SQLite's largest integer: sums of edited counts stop there


@dataclass(frozen=True, slots=True)
class Figures:
    """An hour's rows, summed and digested."""

    rows: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    digest: str

    def text(self) -> str:
        tokens = self.prompt_tokens + self.completion_tokens
        return f"{self.rows} row(s), {self.requests} request(s), {tokens} token(s)"


EMPTY: Final = Figures(0, 0, 0, 0, hashlib.sha256(b"[]").hexdigest())


@dataclass(frozen=True, slots=True)
class Seal:
    """The last seal record of an hour."""

    seq: int
    hour: int  # its start, seconds since the epoch
    figures: Figures
    retention_days: int | None
    pruned_before: int  # the latest cut the daemon's pruning had made when it sealed (0: none)
    time_zone: str | None  # the box's zone when it sealed (quota periods are its days)
    through: int | None = None  # every hour before it with rows was sealed by then (None: older seals)


@dataclass(frozen=True, slots=True)
class Stop:
    """The newest clean stop the chain holds (`STOPPED`), and when usage was recorded again."""

    seq: int
    through: int  # the hour after the one it stopped in: every hour before it was sealed
    resumed: int | None  # the hour of the first record after it (None: no daemon ran since)


@dataclass(slots=True)
class Findings:
    """What `check` found."""

    sealed: int = 0  # hours whose rows match their seals
    open: list[int] = field(default_factory=list)  # hours with rows after the last seal
    unverifiable: int = 0  # hours whose seals went with a rotation of the chain
    found: dict[int, str] = field(default_factory=dict)  # what is wrong, by the hour it names

    @property
    def problems(self) -> list[str]:
        """What is wrong, in hour order."""
        return [self.found[hour] for hour in sorted(self.found)]

    def as_dict(self) -> dict[str, Any]:
        """For /admin/status, /admin/audit and `edgellmctl audit verify --json`."""
        problems = self.problems
        return {
            "ok": not problems,
            "sealed_hours": self.sealed,
            "open_hours": len(self.open),
            "unverifiable_hours": self.unverifiable,
            "problems": len(problems),
            "problem": problems[0] if problems else None,
            "named": problems[:MAX_NAMED],
        }


LAST_HOUR: Final = 253_402_297_200  # 9999-12-31T23:00Z: an hour past it is an edit's


def label(hour: int) -> str:
    """An hour as seal records and messages name it: its UTC start."""
    if not 0 <= hour <= LAST_HOUR:
        return f"at {hour} s (no hour a record has)"
    return datetime.fromtimestamp(hour, UTC).strftime("%Y-%m-%dT%H:00Z")


def _iso(at: int) -> str:
    """A whole hour as the chain's records write times (`store.utc_text`), to compare with them."""
    return datetime.fromtimestamp(min(max(at, 0), LAST_HOUR), UTC).strftime("%Y-%m-%dT%H:00:00.000Z")


def _cell(value: object) -> object:
    # A hand edit may leave any SQLite value: digested as what it is, never a crash.
    return value if type(value) in (int, str) or value is None else repr(value)


def _text_cell(kind: object, value: object) -> object:
    # Text as it always was (the seals made before read the same); any other type named.
    if kind == "text":
        return text_of(value)
    return [str(kind), value.hex() if isinstance(value, bytes) else None]


def _count(value: object) -> int:
    return value if type(value) is int else 0


def figures(conn: sqlite3.Connection, hours: Iterable[int] | None = None) -> dict[int, Figures]:
    """{hour: its rows summed and digested}, for these hours (every hour with rows when None)."""
    # Text read as bytes and decoded here (`text_of`): a hand edit that left bytes that are no
    # UTF-8 reads as other text (an edit found), never an error that stops a start or a commit.
    # A text cell retyped (a blob of the same bytes, a NULL, a number) is digested with its
    # type: read as bytes alone it looked the same, and no text lookup finds it any more.
    query = (
        "SELECT CASE typeof(hour) WHEN 'integer' THEN hour ELSE -1 END,"
        " typeof(key_id), CAST(key_id AS BLOB), typeof(model), CAST(model AS BLOB),"
        " typeof(endpoint), CAST(endpoint AS BLOB),"
        " requests, prompt_tokens, completion_tokens FROM usage_hours"
    )
    args: list[int] = []
    if hours is not None:
        args = sorted(set(hours))
        if not args:
            return {}
        query += f" WHERE hour IN ({','.join('?' for _ in args)})"
    query += " ORDER BY hour, key_id, model, endpoint"
    out: dict[int, Figures] = {}
    current: int | None = None
    rows: list[list[object]] = []

    def close() -> None:
        if current is not None:
            body = json.dumps(rows, separators=(",", ":"), ensure_ascii=False).encode()
            out[current] = Figures(
                len(rows),
                sum(_count(r[3]) for r in rows),
                sum(_count(r[4]) for r in rows),
                sum(_count(r[5]) for r in rows),
                hashlib.sha256(body).hexdigest(),
            )

    for stored, *rest in conn.execute(query, args):
        hour = stored if type(stored) is int else -1  # an edited hour: no seal has it, read as added
        if hour != current:
            close()
            current, rows = hour, []
        texts = [_text_cell(kind, value) for kind, value in zip(rest[0:6:2], rest[1:6:2], strict=True)]
        rows.append([*texts, *(_cell(v) for v in rest[6:])])
    close()
    return out


def entry(
    hour: int,
    found: Figures,
    at: str,
    *,
    retention_days: int,
    pruned_before: int,
    resealed: int | None,
    time_zone: str | None = None,
    through: int | None = None,
) -> AuditEntry:
    """The seal record of an hour (`resealed`: the seq of the seal a late record replaces;
    `through`: the hour in progress as it was sealed, every hour before it with rows sealed)."""
    detail: dict[str, Any] = {
        "hour": label(hour),
        "hour_start": hour,
        "rows": found.rows,
        "requests": found.requests,
        "prompt_tokens": found.prompt_tokens,
        "completion_tokens": found.completion_tokens,
        "digest": found.digest,
        "usage_retention_days": retention_days,
        "pruned_before": pruned_before,
    }
    if time_zone is not None:
        detail["time_zone"] = time_zone
    if resealed is not None:
        detail["resealed"] = resealed
    if through is not None:
        detail["through"] = through
    return AuditEntry(at, "INFO", SEALED, detail=detail)


def stop_entry(at: str, through: int) -> AuditEntry:
    """The record of a clean stop: no usage is recorded before `through` but what is sealed."""
    return AuditEntry(at, "INFO", STOPPED, detail={"through": through, "hour": label(through)})


def resume_entry(at: str, stop: Stop) -> AuditEntry:
    """The record of a start after a clean stop: the hours between held no daemon."""
    return AuditEntry(at, "INFO", RESUMED, detail={"after": stop.seq, "stopped_through": label(stop.through)})


def _detail(detail: object) -> dict[str, Any] | None:
    try:
        parsed = json.loads(text_of(detail)) if isinstance(detail, bytes) else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _an_hour(value: object) -> int | None:
    return value if type(value) is int and not value % HOUR_S and 0 <= value <= LAST_HOUR else None


def last_stop(conn: sqlite3.Connection) -> Stop | None:
    """The newest clean stop in the chain, and the hour of the first record after it."""
    row = conn.execute(
        "SELECT seq, CAST(detail AS BLOB) FROM audit WHERE action = ? ORDER BY seq DESC LIMIT 1", (STOPPED,)
    ).fetchone()
    if row is None or type(row[0]) is not int:
        return None
    parsed = _detail(row[1])
    through = _an_hour(parsed.get("through")) if parsed is not None else None
    if through is None:
        return None  # edited out of shape: `audit.verify` names it
    after = conn.execute(
        "SELECT CAST(at AS BLOB) FROM audit WHERE seq > ? ORDER BY seq LIMIT 1", (row[0],)
    ).fetchone()
    resumed = None
    if after is not None:
        try:
            moment = datetime.strptime(text_of(after[0]), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
            resumed = hour_of(moment.timestamp())
        except ValueError:
            resumed = through  # an edited time: `audit.verify` names it; no span read from it
    return Stop(row[0], through, resumed)


def newest_mark(seals: Mapping[int, Seal], stop: Stop | None) -> int | None:
    """The hour before which every hour with rows was sealed: the newest seal's `through`, or
    a clean stop's, up to the hour the next start began in (a start in the hour it stopped in
    records into that hour again). None when nothing says."""
    marks = [seal.through for seal in seals.values() if seal.through is not None]
    if stop is not None:
        marks.append(stop.through if stop.resumed is None else min(stop.through, stop.resumed))
    return max(marks, default=None)


def load(conn: sqlite3.Connection) -> dict[int, Seal]:
    """{hour: its last seal} from the chain (a seal record edited out of shape is skipped:
    `audit.verify` names the edit)."""
    out: dict[int, Seal] = {}
    rows = conn.execute(
        "SELECT seq, CAST(detail AS BLOB) FROM audit WHERE action = ? ORDER BY seq", (SEALED,)
    )
    for seq, detail in rows:
        parsed = _detail(detail)
        if parsed is None or type(seq) is not int:
            continue
        hour, digest = parsed.get("hour_start"), parsed.get("digest")
        counts = [parsed.get(k) for k in ("rows", "requests", "prompt_tokens", "completion_tokens")]
        if (
            type(hour) is not int
            or hour % HOUR_S
            or not 0 <= hour <= LAST_HOUR
            or not isinstance(digest, str)
        ):
            continue
        if not all(type(c) is int for c in counts):
            continue
        days, pruned, zone = (parsed.get(k) for k in ("usage_retention_days", "pruned_before", "time_zone"))
        n_rows, requests, prompt, completion = (c if type(c) is int else 0 for c in counts)
        sealed = Figures(n_rows, requests, prompt, completion, digest)
        cut = pruned if type(pruned) is int else 0
        kept_days = days if type(days) is int and days > 0 else None
        through = _an_hour(parsed.get("through"))
        out[hour] = Seal(seq, hour, sealed, kept_days, cut, zone if isinstance(zone, str) else None, through)
    return out


def _oldest_record(conn: sqlite3.Connection) -> str | None:
    """The time of the chain's oldest record when a rotation left an anchor (None: nothing rotated)."""
    if conn.execute("SELECT 1 FROM audit_anchor").fetchone() is None:
        return None
    row = conn.execute("SELECT CAST(at AS BLOB) FROM audit ORDER BY seq LIMIT 1").fetchone()
    return text_of(row[0]) if row is not None else None


def pruned_cut(
    seals: Mapping[int, Seal], now: float, retention_days: int | None, pruned_before: int = 0
) -> float | None:
    """Before when hours may be gone with the retention: the retention's cut now, or the latest
    cut the daemon had made by its newest seal, whichever is later (a retention lengthened
    does not bring back the hours a shorter one pruned)."""
    newest = max(seals.values(), key=lambda s: s.seq, default=None)
    days = retention_days if retention_days is not None else (newest.retention_days if newest else None)
    cuts = [now - days * 86_400] if days is not None else []
    latest = max(pruned_before, newest.pruned_before if newest is not None else 0)
    if latest > 0:
        cuts.append(float(latest))
    return max(cuts) if cuts else None


def check(
    conn: sqlite3.Connection,
    now: float,
    *,
    retention_days: int | None = None,
    sealed: Mapping[int, Seal] | None = None,
    pruned_before: int = 0,
) -> Findings:
    """Every hour's rows against its last seal (see the module's doc). `retention_days`: the
    usage retention the daemon prunes by (by default the one the newest seal names): sealed
    hours older than it may be gone."""
    seals = load(conn) if sealed is None else sealed
    found = Findings()
    now_figures = figures(conn)
    cutoff = pruned_cut(seals, now, retention_days, pruned_before)
    last_sealed = max(seals, default=None)
    oldest = _oldest_record(conn)
    stop = last_stop(conn)
    through = newest_mark(seals, stop)
    # From the newest clean stop to the start after it (or now) no daemon ran to record usage.
    this_hour = hour_of(now)
    down = (stop.through, stop.resumed if stop.resumed is not None else this_hour) if stop else None
    for hour in sorted(set(seals) | set(now_figures)):
        seal, rows = seals.get(hour), now_figures.get(hour)
        if seal is not None:
            current = rows if rows is not None else EMPTY
            if current.digest == seal.figures.digest:
                found.sealed += 1
            elif rows is None and cutoff is not None and hour < cutoff:
                continue  # pruned with the retention
            else:
                what = "are gone" if rows is None else f"differ from it ({current.text()} now)"
                found.found[hour] = (
                    f"usage of the hour {label(hour)} was edited: its seal (record {seal.seq}) holds "
                    f"{seal.figures.text()}, its rows {what}"
                )
            continue
        held = rows.text() if rows else "no rows"
        if hour > now + AHEAD_S:
            found.found[hour] = (
                f"usage of the hour {label(hour)} is ahead of the clock ({label(this_hour)}): "
                f"added by another hand, or the clock was set back ({held})"
            )
        elif (last_sealed is None or hour > last_sealed) and (through is None or hour >= through):
            if down is not None and down[0] <= hour < down[1]:
                found.found[hour] = (
                    f"usage of the hour {label(hour)} has no seal and falls while no daemon ran (after "
                    f"the stop of record {stop.seq if stop else '?'}): added by another hand ({held})"
                )
            else:
                found.open.append(hour)
        elif oldest is not None and _iso(hour + HOUR_S) < oldest:
            found.unverifiable += 1  # its seal may have gone with a rotation of the chain
        elif last_sealed is not None and hour < last_sealed:
            shown = label(hour) if hour >= 0 else "an hour edited to a value no record has"
            found.found[hour] = (
                f"usage of the hour {shown} has no seal though later hours are sealed: "
                f"added by another hand ({held})"
            )
        else:
            found.found[hour] = (
                f"usage of the hour {label(hour)} has no seal though every hour before "
                f"{label(through or 0)} was sealed: added by another hand ({held})"
            )
    return found


# ---- quota totals ---------------------------------------------------------------------------------


def _span(period: str, zone: ZoneInfo) -> tuple[float, float] | None:
    """(start, end) of a usage_periods name in the zone's local time."""
    kind, _, text = period.partition(":")
    try:
        if kind == "day":
            day = date.fromisoformat(text)
            start = local_start(day, zone)
            return start, local_start(date.fromordinal(day.toordinal() + 1), zone)
        if kind == "month":
            first = date.fromisoformat(f"{text}-01")
            start = local_start(first, zone)
            return start, next_month(start, zone).timestamp()
    except (ValueError, OverflowError):
        return None
    return None


def check_periods(
    conn: sqlite3.Connection,
    stored: Mapping[tuple[str, str], list[int]],
    names: Iterable[str],
    *,
    zone: ZoneInfo,
    cutoff: float,
    edited: Iterable[int] = (),
) -> tuple[dict[tuple[str, str], list[int]], list[str]]:
    """The quota totals of these periods as the hours bound them: {(key, period): [requests,
    tokens]} raised to the hours wholly inside the period where a stored total is below them,
    and what was found. A total above the hours that overlap the period is said, never
    lowered (that would hand a key budget back). `cutoff`: before when hours may be gone with
    the retention (a period whose first hour began before it may hold more than the hours
    left). Hours `check` found `edited` bound nothing: the floor is the other hours', and a
    period holding one is not said to be above its hours."""
    edited_hours = set(edited)
    totals = {k: list(v) for k, v in stored.items()}
    problems: list[str] = []
    for period in names:
        span = _span(period, zone)
        if span is None:
            continue
        start, end = span
        touched_by_edit = any(start - HOUR_S < hour < end for hour in edited_hours)
        low: dict[str, list[int]] = {}
        high: dict[str, list[int]] = {}
        rows = conn.execute(
            "SELECT CAST(key_id AS BLOB), hour, requests, prompt_tokens + completion_tokens FROM usage_hours"
            " WHERE hour < ? AND hour + ? > ?",
            (end, HOUR_S, start),
        )
        for stored_key, hour, requests, tokens in rows:
            key_id = text_of(stored_key)
            if type(hour) is not int:
                continue  # an edited row: `check` names it
            figures_ = [_count(requests), _count(tokens)]
            upper = high.setdefault(key_id, [0, 0])
            lower = low.setdefault(key_id, [0, 0])
            for i in (0, 1):
                upper[i] = min(upper[i] + figures_[i], MAX_TOTAL)
                if start <= hour and hour + HOUR_S <= end and hour not in edited_hours:
                    lower[i] = min(lower[i] + figures_[i], MAX_TOTAL)
        # Its first hour (which may straddle its start) is still kept: the hours hold it all.
        bounded_above = not touched_by_edit and (start // HOUR_S) * HOUR_S >= cutoff
        for key_id in sorted(set(high) | {k for k, p in totals if p == period}):
            have = totals.get((key_id, period), [0, 0])
            floor, ceiling = low.get(key_id, [0, 0]), high.get(key_id, [0, 0])
            fixed = [max(have[i], floor[i]) for i in (0, 1)]
            if fixed != have:
                problems.append(
                    f"the quota total of key {key_id or '(none)'} for {period} was edited: it held "
                    f"{have[0]} request(s) and {have[1]} token(s), less than its hours hold "
                    f"({floor[0]} and {floor[1]}); put back to {fixed[0]} and {fixed[1]}"
                )
                totals[(key_id, period)] = fixed
            elif bounded_above and (have[0] > ceiling[0] or have[1] > ceiling[1]):
                problems.append(
                    f"the quota total of key {key_id or '(none)'} for {period} was edited: it holds "
                    f"{have[0]} request(s) and {have[1]} token(s), more than its hours hold "
                    f"({ceiling[0]} and {ceiling[1]}); kept (lowered, it would give the key budget back)"
                )
    return totals, problems


def write_periods(conn: sqlite3.Connection, totals: Mapping[tuple[str, str], list[int]]) -> None:
    """Put quota totals back (inside the caller's transaction)."""
    for (key_id, period), (requests, tokens) in totals.items():
        conn.execute(
            "INSERT INTO usage_periods VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE SET"
            " requests = excluded.requests, tokens = excluded.tokens",
            (key_id, period, requests, tokens),
        )
