"""Liveness and readiness probes for systemd and load balancers, and /metrics for Prometheus."""

from __future__ import annotations

import asyncio
import re
from typing import Final

from aiohttp import web

from edgellmd.api.context import DRAINING, LEDGER, context
from edgellmd.host.metrics import CONTENT_TYPE
from edgellmd.models.handle import RETRY_AFTER_LOADING_S
from edgellmd.models.registry import ModelState


async def healthz(_request: web.Request) -> web.Response:
    """GET /healthz: the process is alive and its event loop answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """GET /readyz: 200 once every configured model is loaded and warmed, else 503 with reasons
    (file paths cut to their names: the probe is public); 503 `draining` from the moment a
    shutdown begins (the models still finish what they run)."""
    registry = context(request).registry
    models: dict[str, dict[str, str]] = {}
    for name, (state, error) in registry.states().items():
        models[name] = {"state": state.value}
        if error:
            models[name]["reason"] = public(error)
    draining = request.app.get(DRAINING)
    if draining is not None and draining.is_set():
        return _not_ready("draining", models)
    ledger = request.app.get(LEDGER)
    failing = ledger.failing_summary if ledger is not None else None
    if failing is not None:
        # Usage and the audit chain are not being written (or not durably: the file is gone):
        # quotas and the trail would be wrong. The cause is on /admin/status, not on this
        # public probe.
        return _not_ready("ledger_failing", models, reason=failing)
    if registry.all_ready:
        return web.json_response({"status": "ready", "models": models})
    states = {s for s, _ in registry.states().values()}
    if ModelState.FAILED in states:
        status = "failed"
    elif ModelState.RESTARTING in states:
        status = "restarting"
    elif ModelState.LOADING in states:
        status = "loading"
    else:
        status = "unloaded"  # an operator unloaded every model
    return _not_ready(status, models)


# A path on the box: what a public probe shows of it is its last part (/admin/status shows it all).
_PATH: Final = re.compile(r"(?<![\w.:/])/(?:[^\s/:'\"(),]+/)+([^\s/:'\"(),]+)")


def public(reason: str) -> str:
    """A model's reason as the public probe shows it: file paths cut to their names, so that an
    unauthenticated caller learns why, not where the box keeps its files."""
    return _PATH.sub(r"\1", reason)


def _not_ready(status: str, models: dict[str, dict[str, str]], **more: str) -> web.Response:
    body = {"status": status, **more, "models": models}
    return web.json_response(body, status=503, headers={"Retry-After": RETRY_AFTER_LOADING_S})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text exposition (the metrics scope unless auth.metrics_public)."""
    body = await asyncio.to_thread(context(request).metrics.render)  # psutil reads /proc
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def setup_health(app: web.Application) -> None:
    """Install the probe routes (public: no key needed) and /metrics."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
