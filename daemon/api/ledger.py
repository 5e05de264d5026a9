"""A finished request's usage, counted and written to the ledger; the admin's view of the ledger.

`account` is called once per request, when its last choice ends and before the answer tells
the client how many tokens it used (the final usage chunk or event, the JSON body): the
ledger's commit is awaited (at most LEDGER_WAIT_S; a slow or failing disk delays no answer
longer than that, and the record stays queued), so that what a client was told is on disk.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import re
import sqlite3
import time
import uuid
from collections.abc import Callable
from datetime import date, timedelta
from typing import Any, Final, TypeVar
from zoneinfo import ZoneInfo

from aiohttp import web

from edgellmd.api.context import CALLER, LEDGER, PROMPT_HELD, TOKENS_USED, USAGE_ID
from edgellmd.api.fields import known_parameters
from edgellmd.errors import InvalidRequest, ServiceUnavailable
from edgellmd.ledger.audit import select as audit_select
from edgellmd.ledger.store import Ledger, utc_text
from edgellmd.ledger.usage import COLUMNS, FIRST_DAY, GROUPS, LAST_DAY, UsageQuery, UsageRecord, local_start
from edgellmd.ledger.usage import select as usage_rows
from edgellmd.models.handle import RETRY_AFTER_LOADING_S

log = logging.getLogger(__name__)
T = TypeVar("T")
LEDGER_WAIT_S: Final = 2.0  # the longest an answer waits for its usage's commit


async def account(request: web.Request, model: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Count a finished request's tokens (once) and wait for the ledger to hold them."""
    request[TOKENS_USED] = prompt_tokens + completion_tokens
    ledger = request.app.get(LEDGER)
    if ledger is None:
        return
    caller = request.get(CALLER)
    record = UsageRecord(
        request_id=request.get(USAGE_ID) or uuid.uuid4().hex,
        key_id=caller.key_id if caller is not None else "",
        model=model,
        endpoint=request.path,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        at=time.time(),
    )
    # The prompt tokens the request held against its key's budgets go as its usage counts.
    committed = asyncio.wrap_future(ledger.record(record, reserved=request.pop(PROMPT_HELD, 0)))
    committed.add_done_callback(_retrieved)
    try:
        await asyncio.wait_for(asyncio.shield(committed), LEDGER_WAIT_S)
    except TimeoutError:
        log.warning(
            "usage of request %s not yet committed after %.0f s; it stays queued",
            record.request_id,
            LEDGER_WAIT_S,
        )
    except OSError:
        pass  # logged by the ledger, kept for its next commit


def _retrieved(future: asyncio.Future[bool]) -> None:
    if not future.cancelled():
        future.exception()  # a failed commit is the ledger's to log, not asyncio's


# ---- /admin/usage and /admin/audit ---------------------------------------------------------------

MAX_USAGE_ROWS: Final = 100_000  # an answer past it asks for a narrower range or a coarser grouping
MAX_AUDIT_ROWS: Final = 10_000
_CALENDAR_DATE: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_KEY_ID: Final = re.compile(r"[0-9a-f]{12}")
_NAME: Final = re.compile(r"[A-Za-z0-9._/{}:-]{1,128}")
_USAGE_PARAMS: Final = frozenset({"since", "until", "key", "model", "endpoint", "group", "format"})
_AUDIT_PARAMS: Final = frozenset({"since", "until", "key", "action", "limit"})


def _ledger(request: web.Request) -> Ledger:
    ledger = request.app.get(LEDGER)
    if ledger is None:
        raise ServiceUnavailable("the ledger is not open yet")
    return ledger


def _params(request: web.Request, allowed: frozenset[str]) -> dict[str, str]:
    query = request.rel_url.query
    known_parameters(query, allowed)
    for name in query:
        if len(query.getall(name)) > 1:
            raise InvalidRequest(f"'{name}' given more than once", param=name)
    return {name: query[name] for name in query}


def _date(params: dict[str, str], name: str) -> date | None:
    text = params.get(name)
    if text is None:
        return None
    try:  # the calendar form alone: fromisoformat takes week dates (2026-W49-1) too
        day = date.fromisoformat(text) if _CALENDAR_DATE.fullmatch(text) else None
    except ValueError:
        day = None
    if day is None or not FIRST_DAY <= day <= LAST_DAY:
        raise InvalidRequest(
            f"'{name}' must be a date like 2026-12-01, from {FIRST_DAY} to {LAST_DAY}", param=name
        )
    return day


def _dates(params: dict[str, str]) -> tuple[date | None, date | None]:
    """`since` and `until`, checked, the one not before the other."""
    since, until = _date(params, "since"), _date(params, "until")
    if since is not None and until is not None and until < since:
        raise InvalidRequest("'until' is before 'since'", param="until")
    return since, until


def _key_param(params: dict[str, str]) -> str | None:
    key = params.get("key")
    if key is not None and not _KEY_ID.fullmatch(key):
        raise InvalidRequest("'key' must be a key id (12 lowercase hex digits)", param="key")
    return key


def _name_param(params: dict[str, str], name: str) -> str | None:
    value = params.get(name)
    if value is not None and not _NAME.fullmatch(value):
        raise InvalidRequest(f"'{name}' must be 1 to 128 letters, digits or ._/{{}}:-", param=name)
    return value


def usage_query(params: dict[str, str]) -> UsageQuery:
    """The checked filters of a usage request (`/admin/usage`'s query string)."""
    since, until = _dates(params)
    group = params.get("group", "day")
    if group not in GROUPS:
        raise InvalidRequest(f"'group' must be one of {', '.join(GROUPS)}", param="group")
    return UsageQuery(
        since=since,
        until=until,
        key_id=_key_param(params),
        model=_name_param(params, "model"),
        endpoint=_name_param(params, "endpoint"),
        group=group,
    )


async def _read(ledger: Ledger, fn: Callable[[sqlite3.Connection], T]) -> T:
    """`ledger.read(fn)`, a database that cannot be read a 503 `ledger_failing` (its file
    removed under the daemon read as a disk I/O error, answered 500 with a traceback logged)."""
    try:
        return await asyncio.wrap_future(ledger.read(fn))
    except sqlite3.Error as exc:
        log.error("the ledger could not be read: %s: %s", type(exc).__name__, exc)  # noqa: TRY400
        raise ServiceUnavailable(
            f"the usage ledger cannot be read: {type(exc).__name__}: {exc}",
            code="ledger_failing",
            headers={"Retry-After": RETRY_AFTER_LOADING_S},  # as /readyz's ledger_failing
        ) from None


async def admin_usage(request: web.Request) -> web.StreamResponse:
    """GET /admin/usage: tokens and requests per period, key, model and endpoint (JSON or CSV)."""
    params = _params(request, _USAGE_PARAMS)
    query = usage_query(params)
    form = params.get("format", "json")
    if form not in ("json", "csv"):
        raise InvalidRequest("'format' must be json or csv", param="format")
    ledger = _ledger(request)
    rows = await _read(ledger, lambda conn: usage_rows(conn, query, ledger.zone, limit=MAX_USAGE_ROWS))
    if len(rows) > MAX_USAGE_ROWS:
        raise InvalidRequest(
            f"more than {MAX_USAGE_ROWS} rows: narrow since/until or group by day or month", param="group"
        )
    if form == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, COLUMNS, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
        return web.Response(text=out.getvalue(), content_type="text/csv", charset="utf-8")
    totals = {
        name: sum(int(row[name]) for row in rows)
        for name in ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
    }
    return web.json_response(
        {
            "object": "usage",
            "time_zone": ledger.zone.key,
            "group": query.group,
            "since": query.since.isoformat() if query.since else None,
            "until": query.until.isoformat() if query.until else None,
            "data": rows,
            "totals": totals,
        }
    )


async def admin_audit(request: web.Request) -> web.Response:
    """GET /admin/audit: audit records in time order, filtered by time, key and action, newest `limit`."""
    params = _params(request, _AUDIT_PARAMS)
    since, until = _dates(params)
    key_id = _key_param(params)
    action = params.get("action")
    if action is not None and not 1 <= len(action) <= 64:
        raise InvalidRequest("'action' must be 1 to 64 characters", param="action")
    given = params.get("limit", "1000")
    limit = int(given) if given.isascii() and given.isdigit() and len(given) <= 6 else 0
    if not 1 <= limit <= MAX_AUDIT_ROWS:
        raise InvalidRequest(f"'limit' must be a whole number from 1 to {MAX_AUDIT_ROWS}", param="limit")
    ledger = _ledger(request)

    def read(conn: sqlite3.Connection) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        found = audit_select(
            conn,
            since=_day_start(since, ledger.zone) if since else None,
            until=_day_start(until + timedelta(days=1), ledger.zone) if until else None,
            key_id=key_id,
            action=action,
            limit=limit,
        )
        verdict, covered = ledger.chain(conn)
        return [r.as_dict() for r in found], {
            "ok": verdict.ok,
            "checked": covered,
            "problem": verdict.problem,
            "caveat": verdict.caveat,
        }

    records, chain = await _read(ledger, read)
    # The usage against its seals, again when another hand wrote to the database since the last
    # check (at most every minute; off the writer: commits go on meanwhile).
    chain["usage"] = (await asyncio.wrap_future(ledger.check_usage(whole_walk=True))).as_dict()
    return web.json_response({"object": "list", "data": records, "chain": chain})


def _day_start(day: date, zone: ZoneInfo) -> str:
    return utc_text(local_start(day, zone))


def setup_ledger_routes(app: web.Application) -> None:
    """Install /admin/usage and /admin/audit (the admin scope, as every /admin path)."""
    app.router.add_get("/admin/usage", admin_usage)
    app.router.add_get("/admin/audit", admin_audit)
