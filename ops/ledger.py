"""`edgellmctl usage` (the daemon's /admin/usage) and `edgellmctl audit verify|show` (the ledger file).

`usage` asks the running daemon, like `status`. `audit` reads the ledger's SQLite file itself,
read-only and without the daemon: a verification must not take the word of the process whose
records it checks, and it works while the daemon is down.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sqlite3
import sys
import time
from dataclasses import replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode

from edgellmctl.admin import AdminClient, add_daemon_options, answer_guarded
from edgellmctl.cli import CommandError, Subcommands, guarded, int_between
from edgellmd.errors import escaped
from edgellmd.ledger import audit, seals
from edgellmd.ledger.store import utc_text
from edgellmd.ledger.usage import COLUMNS, FIRST_DAY, LAST_DAY

DEFAULT_DATABASE: Final = Path("/var/lib/edgellm/ledger.sqlite3")
NOTHING_COMPARED: Final = "it holds no audit record line of a record in this ledger: nothing was compared"


def _day(value: str) -> str:
    try:
        # The calendar form alone: fromisoformat takes week dates (2026-W49-1) too.
        day = date.fromisoformat(value) if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value) else None
    except ValueError:
        day = None
    if day is None or not FIRST_DAY <= day <= LAST_DAY:
        raise argparse.ArgumentTypeError(f"a date like 2026-12-01, from {FIRST_DAY} to {LAST_DAY}")
    return day.isoformat()


def _instant(value: str) -> str:
    """A date or an ISO 8601 time (UTC unless it says otherwise), as audit records write theirs."""
    try:
        at = datetime.fromisoformat(value) if 10 <= len(value) <= 40 else None
    except ValueError:
        at = None
    if at is None or not FIRST_DAY <= at.date() <= LAST_DAY:
        raise argparse.ArgumentTypeError(
            f"a date like 2026-12-01 or a time like 2026-12-01T09:30:00Z, from {FIRST_DAY} to {LAST_DAY}"
        )
    return utc_text((at if at.tzinfo is not None else at.replace(tzinfo=UTC)).timestamp())


def run_usage(args: argparse.Namespace) -> int:
    """Print usage per period, key, model and endpoint: a table, JSON or CSV."""
    query = {
        name: value
        for name, value in (
            ("since", args.since),
            ("until", args.until),
            ("key", args.key_id),
            ("model", args.model),
            ("endpoint", args.endpoint),
            ("group", args.group),
        )
        if value is not None
    }
    _, answer = AdminClient(args).call("GET", "/admin/usage?" + urlencode(query))
    rows: list[dict[str, Any]] = answer.get("data", []) if isinstance(answer, dict) else []
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.csv:
        writer = csv.DictWriter(sys.stdout, COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: escaped(v) if isinstance(v, str) else v for k, v in r.items()} for r in rows)
    else:
        print(format_usage(answer))
    return 0


def format_usage(answer: dict[str, Any]) -> str:
    """The usage answer as a table with a total line."""
    rows = answer.get("data", [])
    table = [("PERIOD", "KEY", "MODEL", "ENDPOINT", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL")]
    table += [
        (
            str(r["period"]),
            str(r["key_id"]) or "-",
            str(r["model"]),
            str(r["endpoint"]),
            str(r["requests"]),
            str(r["prompt_tokens"]),
            str(r["completion_tokens"]),
            str(r["total_tokens"]),
        )
        for r in rows
    ]
    totals = answer.get("totals", {})
    table.append(
        (
            "total",
            "",
            "",
            "",
            str(totals.get("requests", 0)),
            str(totals.get("prompt_tokens", 0)),
            str(totals.get("completion_tokens", 0)),
            str(totals.get("total_tokens", 0)),
        )
    )
    cells = [[escaped(cell) for cell in row] for row in table]  # the daemon's words, inert
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i < 4 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]
    zone, group = escaped(str(answer.get("time_zone", "UTC"))), escaped(str(answer.get("group", "day")))
    return "\n".join([*lines, f"(periods in {zone}, grouped by {group})"])


def _open(path: Path) -> sqlite3.Connection:
    """The ledger file, read-only; never created."""
    if not path.is_file():
        raise CommandError(f"no ledger at {path} (set ledger.database, or pass --database)")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        conn.execute("SELECT 1 FROM audit LIMIT 1")
    except sqlite3.Error as exc:
        raise CommandError(f"cannot read the ledger {path}: {exc}") from None
    return conn


def _usage_without_records(conn: sqlite3.Connection) -> str | None:
    """An empty chain in a ledger that holds usage: whole, or emptied by another hand (a daemon
    that audited anything, a failed sign-in or a key change, wrote records; its log tells)."""
    try:
        row = conn.execute("SELECT count(*), sum(requests) FROM usage_hours").fetchone()
    except sqlite3.Error:
        return None
    if not row or not row[0]:
        return None
    return (
        f"the chain holds no records while the ledger holds usage ({row[1]} request(s)): if the "
        "daemon audited anything its records were removed; check against its log (--against)"
    )


def run_verify(args: argparse.Namespace) -> int:
    """Walk the audit chain; 0 when it is whole, 1 with where it breaks first."""
    conn = _open(args.database)
    try:
        # One read transaction: the chain and the usage as of one moment, though the daemon
        # writes on (a record landing late reseals its hour between two reads otherwise).
        conn.execute("BEGIN")
        verdict = audit.verify(conn)
        if verdict.ok and verdict.checked == 0 and verdict.caveat is None:
            verdict = replace(verdict, caveat=_usage_without_records(conn))
        try:
            sealed = seals.check(conn, time.time())
        except (sqlite3.Error, ValueError, OverflowError) as exc:  # an edit no check foresaw: no pass
            sealed = seals.Findings()
            sealed.found[-1] = (
                f"the usage could not be checked against its seals: {type(exc).__name__}: {exc}"
            )
        matched, differs = (0, None) if args.against is None else _against(conn, args.against)
    finally:
        conn.close()
    if args.against is not None and differs is None and matched == 0:
        # Not a pass: the wrong file, or a log from before the records the database holds.
        differs = NOTHING_COMPARED
    intact = verdict.ok and differs is None and not sealed.problems
    if args.json:
        answer: dict[str, Any] = {
            "ok": intact,
            "checked": verdict.checked,
            "first": verdict.first,
            "last": verdict.last,
            "problem": verdict.problem,
            "at_seq": verdict.at_seq,
            "caveat": verdict.caveat,
            "usage": sealed.as_dict(),
        }
        if args.against is not None:
            answer["against_log"] = {"matched": matched, "problem": differs}
        print(json.dumps(answer))
    elif verdict.ok:
        span = f"records {verdict.first} to {verdict.last}" if verdict.checked else "no records"
        print(f"audit chain intact: {verdict.checked} record(s) checked ({span})")
        if verdict.caveat is not None:
            print(f"but {verdict.caveat}")
    else:
        print(f"audit chain BROKEN after {verdict.checked} good record(s): {verdict.problem}")
    if not args.json:
        print(_usage_text(sealed))
    if args.against is not None and not args.json:
        if differs is None:
            print(f"the log's copy agrees: {matched} record(s) matched")
        elif differs == NOTHING_COMPARED:
            print(f"the log is no copy of this ledger's chain: {differs}")
        else:
            print(f"the log's copy DIFFERS after {matched} matching record(s): {differs}")
    return 0 if intact else 1


def _usage_text(found: seals.Findings) -> str:
    """What `audit verify` says of the usage against its seals."""
    if found.problems:
        lines = [f"usage EDITED: {len(found.problems)} hour(s) differ from their seals"]
        lines += [f"  {p}" for p in found.problems[: seals.MAX_NAMED]]
        if len(found.problems) > seals.MAX_NAMED:
            lines.append(f"  and {len(found.problems) - seals.MAX_NAMED} more")
        return "\n".join(lines)
    text = f"usage intact: {found.sealed} sealed hour(s) match their seals"
    if found.open:
        text += (
            f"; {len(found.open)} hour(s) after the last seal "
            "(the hour in progress, or those of a daemon that did not stop cleanly)"
        )
    if found.unverifiable:
        text += f"; {found.unverifiable} hour(s) whose seals went with the chain's rotation, unchecked"
    return text


def _against(conn: sqlite3.Connection, source: str) -> tuple[int, str | None]:
    """The chain against the daemon's log lines in `source` (a file, or - for standard input)."""
    if source == "-":
        return audit.compare(conn, sys.stdin)
    try:
        with Path(source).open(encoding="utf-8", errors="replace") as lines:
            return audit.compare(conn, lines)
    except OSError as exc:
        raise CommandError(f"cannot read {source}: {exc.strerror or exc}") from None


def run_show(args: argparse.Namespace) -> int:
    """Print audit records in time order, filtered by time, key and action."""
    conn = _open(args.database)
    try:
        records = audit.select(
            conn,
            since=args.since,
            until=args.until,
            key_id=args.key_id,
            action=args.action,
            limit=args.limit,
        )
    finally:
        conn.close()
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=2))  # ASCII: no C1 control, no bidi override
        return 0
    for r in records:
        detail = f" {json.dumps(r.detail, ensure_ascii=False)}" if r.detail else ""
        who = " ".join(
            part
            for part in (f"key={r.key_id}" if r.key_id else "", f"peer={r.peer}" if r.peer else "")
            if part
        )
        # Escaped: an action holds what its record says (an engine stop's reason: native output).
        print(escaped(f"{r.seq:>6}  {r.at}  {r.level:<7}  {r.action}{'  ' + who if who else ''}{detail}"))
    return 0


def add_parsers(sub: Subcommands) -> None:
    """Register `usage` and `audit`."""
    p = sub.add_parser("usage", help="tokens and requests per key, model, endpoint and period")
    p.add_argument("--since", type=_day, help="first day, local to the box (YYYY-MM-DD)")
    p.add_argument("--until", type=_day, help="last day, included (YYYY-MM-DD)")
    p.add_argument("--key-id", help="only this key id")
    p.add_argument("--model", help="only this model")
    p.add_argument("--endpoint", help="only this endpoint, e.g. /v1/chat/completions")
    p.add_argument("--group", choices=("hour", "day", "month"), help="periods (default: day)")
    add_daemon_options(p)
    p.add_argument("--csv", action="store_true", help="print CSV")
    p.set_defaults(func=answer_guarded(run_usage))

    a = sub.add_parser("audit", help="verify or show the hash-chained audit log")
    verbs = a.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help_: str) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=help_)
        v.add_argument(
            "--database",
            type=Path,
            default=DEFAULT_DATABASE,
            help=f"the ledger file (default: {DEFAULT_DATABASE})",
        )
        v.add_argument("--json", action="store_true", help="print JSON")
        return v

    v = verb("verify", "check every record's hash and order; exit 1 at the first break")
    v.add_argument(
        "--against",
        metavar="LOG",
        help="also compare with the daemon's log lines (e.g. `journalctl -u edgellm -o cat > LOG`, "
        "or - for standard input): finds records rewritten with their hashes, or removed",
    )
    v.set_defaults(func=guarded(run_verify))
    s = verb("show", "print audit records")
    s.add_argument("--since", type=_instant, help="from this date or time (ISO 8601; UTC unless it says)")
    s.add_argument("--until", type=_instant, help="before this date or time (ISO 8601; UTC unless it says)")
    s.add_argument("--key-id", help="only this key id")
    s.add_argument("--action", help="only records whose action holds this text")
    s.add_argument(
        "--limit", type=int_between(0, 999_999_999), default=1000, help="the newest N (default 1000; 0: all)"
    )
    s.set_defaults(func=guarded(run_show))
