"""Usage by key, model, endpoint and hour; the day and month periods quotas count against.

Every finished request is one record: who (the key id, "" without API keys), which model and
endpoint, its prompt and completion tokens, when it ended. One transaction writes its request
row (kept `detail_hours`, so that a request id is counted once and can be looked up), adds it
to its UTC hour's row, and to its key's day and month in the box's time zone: a period quotas
read and `/admin/usage` sums are never half written.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, Final
from zoneinfo import ZoneInfo

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS usage_requests (
    request_id TEXT PRIMARY KEY,
    at REAL NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_requests_at ON usage_requests (at);
CREATE TABLE IF NOT EXISTS usage_hours (
    hour INTEGER NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    PRIMARY KEY (hour, key_id, model, endpoint)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS usage_periods (
    key_id TEXT NOT NULL,
    period TEXT NOT NULL,
    requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (key_id, period)
) WITHOUT ROWID;
"""
GROUPS: Final = ("hour", "day", "month")
# A usage row's fields, in the order CSV answers (`/admin/usage`, `edgellmctl usage --csv`) give them.
COLUMNS: Final = (
    "period",
    "key_id",
    "model",
    "endpoint",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
)
HOUR_S: Final = 3600
# The days a query may name: a day's local start, the day after its end and an hour before it
# must all be times Python can hold in any zone (9999-12-31's next day is not).
FIRST_DAY: Final = date(1970, 1, 1)
LAST_DAY: Final = date(9998, 12, 31)


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished request's usage."""

    request_id: str
    key_id: str
    model: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    at: float  # when it ended, seconds since the epoch

    @property
    def tokens(self) -> int:
        """Prompt and completion together: what quotas count."""
        return self.prompt_tokens + self.completion_tokens


def hour_of(at: float) -> int:
    """The start of the UTC hour a moment falls in: the hour rows are keyed by."""
    return int(at // HOUR_S) * HOUR_S


def day_period(moment: datetime) -> str:
    """The day a local time falls in, as usage_periods names it."""
    return f"day:{moment.date().isoformat()}"


def month_period(moment: datetime) -> str:
    """The month a local time falls in."""
    return f"month:{moment:%Y-%m}"


def periods(at: float, zone: ZoneInfo) -> tuple[str, str]:
    """(day, month) of a moment in the box's time zone."""
    local = datetime.fromtimestamp(at, zone)
    return day_period(local), month_period(local)


def next_day(at: float, zone: ZoneInfo) -> datetime:
    """The start of the next local day (when a daily budget is full again)."""
    local = datetime.fromtimestamp(at, zone).date() + timedelta(days=1)
    return datetime(local.year, local.month, local.day, tzinfo=zone)


def next_month(at: float, zone: ZoneInfo) -> datetime:
    """The start of the next local month."""
    local = datetime.fromtimestamp(at, zone).date()
    year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
    return datetime(year, month, 1, tzinfo=zone)


def write(conn: sqlite3.Connection, record: UsageRecord, zone: ZoneInfo, *, detail: bool) -> bool:
    """Add one request (inside the caller's transaction); False when its id was counted already."""
    if detail and record.request_id:
        cursor = conn.execute(
            "INSERT OR IGNORE INTO usage_requests VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.request_id,
                record.at,
                record.key_id,
                record.model,
                record.endpoint,
                record.prompt_tokens,
                record.completion_tokens,
            ),
        )
        if cursor.rowcount == 0:
            return False
    hour = hour_of(record.at)
    conn.execute(
        "INSERT INTO usage_hours VALUES (?, ?, ?, ?, 1, ?, ?) ON CONFLICT DO UPDATE SET"
        " requests = requests + 1, prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
        " completion_tokens = completion_tokens + excluded.completion_tokens",
        (hour, record.key_id, record.model, record.endpoint, record.prompt_tokens, record.completion_tokens),
    )
    for period in periods(record.at, zone):
        conn.execute(
            "INSERT INTO usage_periods VALUES (?, ?, 1, ?) ON CONFLICT DO UPDATE SET"
            " requests = requests + 1, tokens = tokens + excluded.tokens",
            (record.key_id, period, record.tokens),
        )
    return True


def load_periods(conn: sqlite3.Connection, names: Iterable[str]) -> dict[tuple[str, str], list[int]]:
    """{(key id, period): [requests, tokens]} for these periods (the current day and month); a
    cell edited to something other than a whole number reads as -1, below what any hours hold
    (`seals.check_periods` puts it back)."""
    wanted = list(names)
    marks = ",".join("?" for _ in wanted)
    rows = conn.execute(
        # Read as bytes: a hand edit that left bytes that are no UTF-8 is other text, not an error.
        "SELECT CAST(key_id AS BLOB), CAST(period AS BLOB), requests, tokens FROM usage_periods"  # noqa: S608
        f" WHERE period IN ({marks})",
        wanted,
    )
    return {
        (text_of(key_id), text_of(period)): [n if type(n) is int else -1 for n in (requests, tokens)]
        for key_id, period, requests, tokens in rows
    }


def text_of(value: object) -> str:
    """A text column read as bytes (`CAST(... AS BLOB)`), as the text it was written as."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def prune(conn: sqlite3.Connection, now: float, *, detail_hours: int, retention_days: int) -> int:
    """Drop request rows older than `detail_hours` and hour rows older than `retention_days`:
    how many hour rows went."""
    conn.execute("DELETE FROM usage_requests WHERE at < ?", (now - detail_hours * HOUR_S,))
    cutoff = now - retention_days * 86_400
    hours = conn.execute("DELETE FROM usage_hours WHERE hour < ?", (cutoff,)).rowcount
    oldest = datetime.fromtimestamp(cutoff, UTC).date()
    conn.execute(
        "DELETE FROM usage_periods WHERE (period LIKE 'day:%' AND substr(period, 5) < ?)"
        " OR (period LIKE 'month:%' AND substr(period, 7) < ?)",
        (oldest.isoformat(), f"{oldest:%Y-%m}"),
    )
    return hours


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """What `/admin/usage` asks for: a time range (local dates, inclusive), filters and a grouping."""

    since: date | None = None
    until: date | None = None
    key_id: str | None = None
    model: str | None = None
    endpoint: str | None = None
    group: str = "day"  # hour, day or month (local)


def select(
    conn: sqlite3.Connection, query: UsageQuery, zone: ZoneInfo, *, limit: int | None = None
) -> list[dict[str, Any]]:
    """Rows of usage per period (as `query.group` in the local zone), key, model and endpoint;
    past `limit` rows it stops at limit + 1 (the caller refuses so many: none is built past it)."""
    clauses: list[str] = []
    args: list[Any] = []
    if query.since is not None:
        clauses.append("hour >= ?")
        args.append(local_start(query.since, zone) - HOUR_S)  # an hour row may straddle a local day
    if query.until is not None:
        clauses.append("hour < ?")
        args.append(local_start(query.until + timedelta(days=1), zone))
    for column, value in (("key_id", query.key_id), ("model", query.model), ("endpoint", query.endpoint)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value)
    where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
    # Read as text and whole numbers whatever a hand edit left in a cell (a blob, a NULL, a
    # number as text: the seals name the edit); sorting them mixed was a 500.
    rows = conn.execute(
        "SELECT hour, CAST(key_id AS BLOB), CAST(model AS BLOB), CAST(endpoint AS BLOB),"  # noqa: S608
        " requests, prompt_tokens, completion_tokens"
        f" FROM usage_hours {where} ORDER BY hour",
        args,
    )
    totals: dict[tuple[str, str, str, str], list[int]] = {}
    seen, label = None, None  # rows come in hour order: an hour's label is found once
    for hour, key_id, model, endpoint, requests, prompt, completion in rows:
        if hour != seen:
            if type(hour) is not int:  # a hand edit (the seals name it): no period to count it in
                continue
            seen = hour
            try:
                local = datetime.fromtimestamp(hour, zone)
            except (ValueError, OverflowError, OSError):  # an hour edited past any calendar
                label = None
                continue
            outside = (query.since is not None and local.date() < query.since) or (
                query.until is not None and local.date() > query.until
            )
            label = None if outside else _label(local, query.group)
        if label is None:
            continue
        key_text, model_text, endpoint_text = (
            text_of(v) if v is not None else "" for v in (key_id, model, endpoint)
        )
        sums = totals.setdefault((label, key_text, model_text, endpoint_text), [0, 0, 0])
        for k, count in enumerate((requests, prompt, completion)):
            sums[k] += count if type(count) is int else 0
        if limit is not None and len(totals) > limit:
            break
    return [
        {
            "period": label,
            "key_id": key_id,
            "model": model,
            "endpoint": endpoint,
            "requests": requests,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        for (label, key_id, model, endpoint), (requests, prompt, completion) in sorted(totals.items())
    ]


def local_start(day: date, zone: ZoneInfo) -> float:
    """When a local day begins, in seconds since the epoch."""
    return datetime(day.year, day.month, day.day, tzinfo=zone).timestamp()


def _label(local: datetime, group: str) -> str:
    if group == "hour":
        return local.strftime("%Y-%m-%dT%H:00%z")
    if group == "month":
        return local.strftime("%Y-%m")
    return local.date().isoformat()


def request_rows(conn: sqlite3.Connection, ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """{request id: (prompt, completion)} of the request rows still kept, for these ids."""
    out: dict[str, tuple[int, int]] = {}
    for start in range(0, len(ids), 500):
        chunk = list(ids[start : start + 500])
        marks = ",".join("?" for _ in chunk)
        for rid, prompt, completion in conn.execute(
            "SELECT request_id, prompt_tokens, completion_tokens FROM usage_requests"  # noqa: S608
            f" WHERE request_id IN ({marks})",
            chunk,
        ):
            out[str(rid)] = (int(prompt), int(completion))
    return out
