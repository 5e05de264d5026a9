"""Operator endpoints under /admin (admin scope, admin networks): status, stats, reload, load, unload."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
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


def _answer(request: web.Request, action: str, outcomes: Sequence[Outcome]) -> web.Response:
    """200 when every operation succeeded (or had nothing to do), else 409; the body says which."""
    ok = all(o.ok for o in outcomes)
    caller = request.get(CALLER)
    audit.info(
        "admin %s: %s",
        action,
        ", ".join(f"{o.model} {o.result}" for o in outcomes) or "nothing",
        extra={"peer": request.remote, "key_id": caller.key_id if caller else None},
    )
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
    outcomes = await registry.reload([model] if model is not None else None, force=force, trigger="admin")
    return _answer(request, "reload", outcomes)


async def load(request: web.Request) -> web.Response:
    """POST /admin/models/{name}/load: load (verify, preload, warm up) an unloaded model."""
    registry = context(request).registry
    return _answer(request, "load", [await registry.load(request.match_info["name"])])


async def unload(request: web.Request) -> web.Response:
    """POST /admin/models/{name}/unload: stop serving a model once its requests end."""
    registry = context(request).registry
    return _answer(request, "unload", [await registry.unload(request.match_info["name"])])


def setup_admin(app: web.Application) -> None:
    """Install the /admin routes (auth requires the admin scope for every /admin path)."""
    app.router.add_get("/admin/status", status)
    app.router.add_get("/admin/stats", stats)
    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/models/{name}/load", load)
    app.router.add_post("/admin/models/{name}/unload", unload)
    setup_ledger_routes(app)
