"""Bare applications for the installer specs: the error middleware, one installer, tiny handlers.

In the manner of Home Assistant's tests/components/http/: each `setup_<concern>` is installed
on an application of its own, with a handler or two behind it, and driven with
pytest-aiohttp's `aiohttp_client`. The error middleware is always there, so that refusals
render as the daemon renders them (OpenAI's envelope).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp import ClientResponse, web
from aiohttp.typedefs import Middleware

from edgellmd.api.context import CALLER, ApiContext
from edgellmd.engine.generation import Running
from edgellmd.host.cpu import Pinning
from edgellmd.host.metrics import Metrics
from edgellmd.http import appkeys
from edgellmd.http.app import PROMPT_THREADS
from edgellmd.http.errors import Handler, error_middleware
from edgellmd.models.registry import Registry
from edgellmd.settings import LifecycleSettings, LoggingSettings, ModelSettings, ServerSettings, Settings

AUDIT: Final = "edgellmd.audit"


def bare_app(*, peer: str | None = None) -> web.Application:
    """An application with nothing but the error middleware.

    `peer` stands in for the client's address (the test client always connects from
    127.0.0.1), as Home Assistant's `mock_real_ip` does: every middleware installed after
    it, and every handler, sees `request.remote == peer`.
    """
    middlewares: list[Middleware] = [error_middleware]
    if peer is not None:
        middlewares.insert(0, _seen_from(peer))
    return web.Application(middlewares=middlewares)


def _seen_from(peer: str) -> Middleware:
    @web.middleware
    async def seen_from(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request.clone(remote=peer))

    return seen_from


async def who(request: web.Request) -> web.Response:
    """A handler that says who the request was, as the front door left it."""
    key = request.get(appkeys.API_KEY)
    caller = request.get(CALLER)
    return web.json_response(
        {
            "path": request.path,
            "peer": request.remote,
            "key_id": key.id if key is not None else None,
            "caller": [caller.key_id, caller.max_tokens] if caller is not None else None,
        }
    )


def route_all(app: web.Application, paths: Sequence[str], handler: Handler = who) -> None:
    """Serve `handler` on GET and POST at each path."""
    for path in paths:
        app.router.add_get(path, handler)
        app.router.add_post(path, handler)


async def error_of(response: ClientResponse) -> tuple[int, str, str | None]:
    """(status, error type, error code) of an answer that must be OpenAI's error envelope."""
    body = await response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return response.status, body["error"]["type"], body["error"]["code"]


@dataclass(frozen=True, slots=True)
class AuditLine:
    """One record of the audit logger, as an operator's log pipeline keys it."""

    level: str
    message: str
    peer: str | None
    key_id: str | None


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[AuditLine]:
    """The audit records captured so far."""
    return [
        AuditLine(r.levelname, r.getMessage(), getattr(r, "peer", None), getattr(r, "key_id", None))
        for r in caplog.records
        if r.name == AUDIT
    ]


def everything_logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record's message and attributes, to look for what must never be logged."""
    return "\n".join(r.getMessage() + repr(vars(r)) for r in caplog.records)


def not_a_model(path: Path) -> Path:
    """Write a file that claims to be a GGUF and is not: llama.cpp refuses it, as it would in production."""
    path.write_bytes(b"GGUF broken")
    return path


def model_settings(name: str, file: Path, **settings: Any) -> ModelSettings:
    """A served model's settings, small enough to load in a blink."""
    fields: dict[str, Any] = {"threads": 1, "context_size": 128, "slots": 1, **settings}
    return ModelSettings(name=name, file=file, **fields)


@asynccontextmanager
async def api_context(
    models: Sequence[ModelSettings],
    *,
    start: bool = True,
    key_valid: Callable[[str], bool] = lambda _key_id: True,
    server: ServerSettings | None = None,
) -> AsyncIterator[ApiContext]:
    """What the app factory gives the adapters: a real registry over `models` (loaded, unless
    `start` is false), real metrics, a prompt pool; closed again at the end."""
    settings = Settings(
        server=server or ServerSettings(),
        models=tuple(models),
        logging=LoggingSettings(),
        lifecycle=LifecycleSettings(preload_dir=None, watch=False),
    )
    with ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="prompt") as executor:
        registry = Registry(settings.models, executor, lock=settings.lock, lifecycle=settings.lifecycle)
        try:
            if start:
                await registry.start()
            yield ApiContext(
                settings=settings,
                registry=registry,
                metrics=Metrics(),
                executor=executor,
                generations=Running(),
                pinning=Pinning(frozenset(os.sched_getaffinity(0)), None, pinned=False),
                key_valid=key_valid,
            )
        finally:
            await registry.close()
