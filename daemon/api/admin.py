"""Operator endpoints under /admin (admin scope, admin networks): status, stats, reload, load, unload."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Coroutine, Mapping
from typing import Any, Final

from aiohttp import web

from edgellmd.api.context import CALLER, LEDGER, context
from edgellmd.api.jsontext import read_json_object
from edgellmd.api.ledger import setup_ledger_routes
from edgellmd.engine import EngineError
from edgellmd.errors import InvalidRequest
from edgellmd.host.cpu import format_cpu_list, host_stats
from edgellmd.models.registry import Outcome

audit = logging.getLogger("edgellmd.audit")

_RELOAD_KEYS: Final = frozenset({"model", "force"})
CONFLICT: Final = 409  # an operation that failed leaves the model as it was


async def _run(
    request: web.Request, action: str, operation: Coroutine[Any, Any, list[Outcome]]
) -> web.Response:
    """Run an operator's action apart from the request (a client that goes away does not stop a
    load half-way), audit it when it ends, and answer: 200 when every operation succeeded (or had
    nothing to do), else 409; the body says which."""
    caller = request.get(CALLER)
    peer, key_id = request.remote, caller.key_id if caller else None

    async def run() -> list[Outcome]:
        outcomes = await operation
        audit.info(
            "admin %s: %s",
            action,
            ", ".join(f"{o.model} {o.result}" for o in outcomes) or "nothing",
            extra={"peer": peer, "key_id": key_id},
        )
        return outcomes

    outcomes = await asyncio.shield(context(request).registry.detached(run()))
    ok = all(o.ok for o in outcomes)
    return web.json_response(
        {"ok": ok, "results": [o.as_dict() for o in outcomes]}, status=200 if ok else CONFLICT
    )


async def status(request: web.Request) -> web.Response:
    """GET /admin/status: the lockfile, the preload area, every model's state and the ledger's."""
    answer = context(request).registry.status()
    ledger = request.app.get(LEDGER)
    if ledger is not None:
        answer["ledger"] = ledger.status()
    return web.json_response(answer)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        return [_jsonable(v) for v in value]
    return value


async def stats(request: web.Request) -> web.Response:
    """GET /admin/stats: the /metrics figures as JSON, with host, GPU, llama.cpp build and model details."""
    app = context(request)
    settings = app.settings
    metrics = await asyncio.to_thread(app.metrics.as_json)
    host = await asyncio.to_thread(
        host_stats, shm=settings.lifecycle.preload_dir, models_dir=settings.lock.models_dir
    )
    monitor = app.gpu
    snapshot = monitor.latest if monitor is not None else None
    gpu: dict[str, Any] = (
        _jsonable(snapshot)
        if snapshot is not None
        else {"available": False, "reason": "not read yet", "devices": []}
    )
    gpu["verdicts"] = _jsonable(monitor.latest_verdicts) if monitor is not None else []
    pinning = app.pinning
    host["pinning"] = {
        "cpus": format_cpu_list(pinning.cpus),
        "requested": pinning.requested,
        "pinned": pinning.pinned,
        "note": pinning.note,
    }
    # The loaded llama.cpp's backends, devices (memory as they report it now) and CUDA architectures.
    try:
        build = _jsonable(await asyncio.to_thread(app.registry.build_info))
    except EngineError as exc:  # no engine process to ask, and the probe failed: say so
        build = {"error": str(exc)}
    return web.json_response(
        {"metrics": metrics, "host": host, "gpu": gpu, "build": build, "models": app.registry.status()}
    )


async def reload(request: web.Request) -> web.Response:
    """POST /admin/reload [{"model": name, "force": bool}]: answers once the reload finished."""
    body: dict[str, Any] = {}
    if request.can_read_body:
        body = dict(await read_json_object(request))
    unknown = sorted(set(body) - _RELOAD_KEYS)
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0][:64]!r} (expected model, force)", param=unknown[0][:64]
        )
    model = body.get("model")
    force = body.get("force", False)
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    if not isinstance(force, bool):
        raise InvalidRequest("'force' must be true or false", param="force")
    registry = context(request).registry
    return await _run(
        request,
        "reload",
        registry.reload([model] if model is not None else None, force=force, trigger="admin"),
    )


async def load(request: web.Request) -> web.Response:
    """POST /admin/models/{name}/load: load (verify, preload, warm up) an unloaded model."""
    registry = context(request).registry
    return await _run(request, "load", _one(registry.load(request.match_info["name"])))


async def unload(request: web.Request) -> web.Response:
    """POST /admin/models/{name}/unload: stop serving a model once its requests end."""
    registry = context(request).registry
    return await _run(request, "unload", _one(registry.unload(request.match_info["name"])))


async def _one(operation: Awaitable[Outcome]) -> list[Outcome]:
    return [await operation]


def setup_admin(app: web.Application) -> None:
    """Install the /admin routes (auth requires the admin scope for every /admin path)."""
    app.router.add_get("/admin/status", status)
    app.router.add_get("/admin/stats", stats)
    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/models/{name}/load", load)
    app.router.add_post("/admin/models/{name}/unload", unload)
    setup_ledger_routes(app)
