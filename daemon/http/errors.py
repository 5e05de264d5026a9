"""Rendering the error table: one middleware turns every failure below it into OpenAI's envelope."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from edgellmd.api.context import ERROR_SHAPES
from edgellmd.errors import (
    ApiError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from edgellmd.http import logs

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _from_http(exc: web.HTTPException) -> ApiError:
    # aiohttp raises these itself (routing, body size); map them into the same table.
    if exc.status == 404:
        return NotFound("no such endpoint")
    if exc.status == 405:
        return MethodNotAllowed("method not allowed on this endpoint")
    if exc.status == 413:
        return PayloadTooLarge("request body too large")
    err = InvalidRequest(exc.reason or "bad request")
    err.status = exc.status  # type: ignore[misc] # an instance-level status for the rare others
    return err


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every failure as an OpenAI error envelope; unexpected ones as a bare 500."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _render(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _render(request, _from_http(exc))
    except Exception:
        log.exception(
            "unhandled error in %s %s (request %s)", request.method, request.path, logs.request_id.get()
        )
        return _render(request, InternalError("internal server error"))


def _render(request: web.Request, exc: ApiError) -> web.Response:
    shapes = request.app.get(ERROR_SHAPES)
    render = shapes.renderer(request.path) if shapes is not None else None
    response = render(exc) if render is not None else web.json_response(exc.body(), status=exc.status)
    response.headers.update(exc.headers)
    return response
