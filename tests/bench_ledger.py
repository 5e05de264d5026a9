"""Benchmark: the usage's check against its seals on a large ledger, and what it costs commits.

Run: .venv/bin/python -m tests.bench_ledger [--days 400] [--rows 50]
Writes a ledger of `--days` days of `--rows` usage rows an hour (hour rows, their seals and
three other audit records an hour), then prints the time to load the seals, to check every
hour, to open the ledger (the start's check), and how long a usage record waited for its
commit while the hourly maintenance checked the usage, and while /admin/usage read it all.
Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from edgellmd.ledger import audit, seals, store, usage
from edgellmd.ledger.usage import HOUR_S, UsageQuery, UsageRecord

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def build(path: Path, days: int, per_hour: int, now: int) -> int:
    """The ledger's database with `days` of usage, every hour sealed: how many rows."""
    conn = store.open_database(path)
    first = now - days * 86_400
    rows = [
        (hour, f"{i % 40:012x}", f"model{i % 3}", ENDPOINTS[i % 3], 3 + i, 100 + i, 50 + i)
        for hour in range(first, now, HOUR_S)
        for i in range(per_hour)
    ]
    conn.execute("BEGIN")
    conn.executemany("INSERT OR IGNORE INTO usage_hours VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    head = audit.head(conn)
    for hour, found in seals.figures(conn).items():
        at = store.utc_text(hour + HOUR_S + 1)
        entry = seals.entry(
            hour, found, at, retention_days=400, pruned_before=0, resealed=None, time_zone="UTC"
        )
        head = audit.append(conn, entry, head)
        for n in range(3):
            head = audit.append(conn, audit.AuditEntry(at, "INFO", "key used", detail={"n": n}), head)
    conn.execute("COMMIT")
    conn.close()
    return len(rows)


def timed(what: str, func: Callable[[], object]) -> None:
    started = time.perf_counter()
    func()
    print(f"{what}: {time.perf_counter() - started:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=400)
    parser.add_argument("--rows", type=int, default=50, help="usage rows an hour")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the made-up ledger has no quota totals: the start says so
    now = int(time.time()) // HOUR_S * HOUR_S
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.sqlite3"
        rows = build(path, args.days, args.rows, now)
        size = path.stat().st_size / 2**20
        print(f"{args.days} days of {args.rows} rows an hour: {rows} rows, {size:.0f} MiB")
        conn = store.open_database(path)
        timed("load the seals", lambda: seals.load(conn))
        timed("check every hour", lambda: seals.check(conn, now + 60, retention_days=400))
        conn.close()
        opened: list[store.Ledger] = []
        timed("open the ledger (the start's check)", lambda: opened.append(store.Ledger(path)))
        ledger = opened[0]
        setattr(store, "USAGE_FRESH_S", 0.0)  # noqa: B010 - the hourly check, the start's just made
        started = time.perf_counter()
        checking = ledger.maintain()
        time.sleep(0.2)
        record = UsageRecord("bench", f"{1:012x}", "model0", ENDPOINTS[0], 1, 1, time.time())
        asked = time.perf_counter()
        ledger.record(record).result(60)
        waited = time.perf_counter() - asked
        checking.result(60)
        took = time.perf_counter() - started
        print(f"maintenance: {took:.3f} s; a record committed meanwhile waited {waited:.3f} s")
        # /admin/usage over every day kept, as the console's Usage page asks for a long range.
        everything = UsageQuery(group="day")
        started = time.perf_counter()
        reading = ledger.read(lambda conn: usage.select(conn, everything, ledger.zone, limit=100_000))
        time.sleep(0.2)
        record = UsageRecord("bench2", f"{1:012x}", "model0", ENDPOINTS[0], 1, 1, time.time())
        asked = time.perf_counter()
        ledger.record(record).result(60)
        waited = time.perf_counter() - asked
        rows = len(reading.result(60))
        took = time.perf_counter() - started
        print(f"usage by day, {rows} rows: {took:.3f} s; a record committed meanwhile waited {waited:.3f} s")
        ledger.close()


if __name__ == "__main__":
    main()
