"""The front door's side of the ledger: open it first and close it last, chain the audit logger's
records into it, enforce quotas at admission, and keep it tidy (summaries, retention).

Every record of the `edgellmd.audit` logger (admin actions, key changes, reloads, engine
deaths, quota breaches) becomes a record of the hash chain; failed sign-ins are summed into
one record per minute. The logger still writes its lines to the journal as before, and the
ledger adds one line per chained record with its seq and hash (`edgellmd.ledger`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from edgellmd.api.context import LEDGER, PROMPT_HELD
from edgellmd.errors import QuotaExceeded
from edgellmd.host.upkeep import PassFailures
from edgellmd.keys import ApiKey
from edgellmd.ledger.store import AuditHandler, Breach, Ledger
from edgellmd.settings import Settings

audit = logging.getLogger("edgellmd.audit")
log = logging.getLogger(__name__)
SUMMARY_INTERVAL_S: Final = 60.0  # failed sign-ins are summed this long into one audit record
MAINTAIN_INTERVAL_S: Final = 3600.0  # retention and rotation
RETRY_INTERVAL_S: Final = 5.0  # how often a failing ledger tries its kept records again
_HANDLER: Final = web.AppKey("audit_handler", AuditHandler)
_BREACHES: Final = web.AppKey("quota_breaches", set[tuple[str, str, str]])


def check_quota(request: web.Request, key: ApiKey, *, hold: bool = False) -> bool:
    """Refuse (429 quota_exceeded, Retry-After and x-quota-reset) a key that spent a budget.

    With `hold`, a request that passes counts in flight against the key's request budgets
    until the caller releases it (`release_quota`); True when it was held so.
    """
    ledger = request.app.get(LEDGER)
    if ledger is None:
        return False
    holds = hold and (key.quota.requests_per_day is not None or key.quota.requests_per_month is not None)
    breach = ledger.check(key.id, key.quota, hold=holds)
    if breach is None:
        return holds
    raise _exceeded(request, key, breach)


def reserve_quota(request: web.Request, key: ApiKey, tokens: int) -> None:
    """Hold a prompt about to be computed against the key's day and month token budgets
    (`Ledger.reserve`), or refuse as `check_quota` does when one is spent."""
    ledger = request.app.get(LEDGER)
    if ledger is None:
        return
    breach = ledger.reserve(key.id, key.quota, tokens)
    if breach is not None:
        raise _exceeded(request, key, breach)
    if key.quota.tokens_per_day is not None or key.quota.tokens_per_month is not None:
        request[PROMPT_HELD] = request.get(PROMPT_HELD, 0) + tokens


def unreserve_quota(request: web.Request, key: ApiKey, tokens: int) -> None:
    """Let go of `tokens` of what `reserve_quota` held (a prompt refused after all)."""
    ledger = request.app.get(LEDGER)
    held = min(tokens, request.get(PROMPT_HELD, 0))
    if ledger is not None and held > 0:
        ledger.unreserve(key.id, held)
        request[PROMPT_HELD] -= held


def _exceeded(request: web.Request, key: ApiKey, breach: Breach) -> QuotaExceeded:
    """The 429 for a spent budget (Retry-After and x-quota-reset), audited once per budget and period."""
    reset = breach.resets.isoformat()
    seen = request.app[_BREACHES]
    if (key.id, breach.budget, reset) not in seen:  # once per budget and period, not per refusal
        if len(seen) > 10_000:
            seen.clear()
        seen.add((key.id, breach.budget, reset))
        audit.warning(
            "quota exceeded: %s (%d of %d)",
            breach.budget,
            breach.used,
            breach.limit,
            extra={"peer": request.remote, "key_id": key.id, "budget": breach.budget},
        )
    wait = max(1, math.ceil(breach.resets.timestamp() - time.time()))
    return QuotaExceeded(breach.message(), headers={"Retry-After": str(wait), "x-quota-reset": reset})


def release_quota(request: web.Request, key: ApiKey, *, held: bool = True) -> None:
    """The end of a request: what `check_quota(..., hold=True)` held (`held`), and any prompt
    `reserve_quota` held that no usage record let go of (a request refused before it ran)."""
    ledger = request.app.get(LEDGER)
    if ledger is None:
        return
    if held:
        ledger.release(key.id)
    left = request.pop(PROMPT_HELD, 0)
    if left > 0:
        ledger.unreserve(key.id, left)


async def _tend(ledger: Ledger, handler: AuditHandler) -> None:
    """The ledger's upkeep: hours sealed once over, failed commits retried, failed sign-ins
    summed, retention and rotation. A pass that raises is logged (once, until another error or
    a pass that works) and the next goes on: the seals and the retries ride on this task."""
    last_summary = last_maintained = time.monotonic()
    failures = PassFailures(log)
    while True:
        await asyncio.sleep(RETRY_INTERVAL_S)
        now = time.monotonic()
        try:
            ledger.tick()  # an hour over is sealed (see ledger.seals)
            ledger.check_file()  # its file removed or replaced under it: said, saved at the stop
            if ledger.error is not None:  # /readyz says so until a commit goes through again
                await asyncio.wrap_future(ledger.retry())
            if now - last_summary >= SUMMARY_INTERVAL_S:
                last_summary = now
                handler.flush_summary()
            if now - last_maintained >= MAINTAIN_INTERVAL_S:
                last_maintained = now
                await asyncio.wrap_future(ledger.maintain())
        except Exception as exc:  # noqa: BLE001 - logged (PassFailures)
            failures.failed(exc, "the ledger's upkeep failed; it goes on in %.1f s", RETRY_INTERVAL_S)
        else:
            failures.passed()


def setup_ledger(app: web.Application, settings: Settings) -> None:
    """Open the ledger when the app starts (its first context: the last to close)."""
    config = settings.ledger

    async def ledger_ctx(app: web.Application) -> AsyncIterator[None]:
        ledger = await asyncio.to_thread(
            Ledger,
            config.database,
            time_zone=config.time_zone,
            # In memory, a row per request would grow with the traffic: hourly totals only.
            detail_hours=config.usage_detail_hours if config.database is not None else 0,
            retention_days=config.usage_retention_days,
            audit_retention_days=config.audit_retention_days,
        )
        await asyncio.wrap_future(ledger.maintain())
        app[LEDGER] = ledger
        handler = app[_HANDLER] = AuditHandler(ledger)
        audit.addHandler(handler)
        if audit.getEffectiveLevel() > logging.INFO:
            audit.setLevel(logging.INFO)  # the chain takes every audit record, whatever the log level
        log.info(
            "ledger: %s (time zone %s)", config.database or "in memory, forgotten at exit", config.time_zone
        )
        task = asyncio.create_task(_tend(ledger, handler), name="ledger")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        handler.flush_summary()
        audit.removeHandler(handler)
        await asyncio.to_thread(ledger.close)

    app[_BREACHES] = set()
    app.cleanup_ctx.append(ledger_ctx)
