"""CORS for configured browser origins only; without a list no CORS header is ever sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from aiohttp import web

from edgellmd.http import appkeys
from edgellmd.http.errors import Handler

ALLOW_METHODS: Final = "GET, POST, DELETE, OPTIONS"  # DELETE: /v1/responses/{id}
# What the OpenAI and Anthropic SDKs send from a browser: their keys (Anthropic's as
# x-api-key), versions and beta flags, and the Stainless client's own description of itself.
ALLOW_HEADERS: Final = ", ".join(
    (
        "Authorization",
        "Content-Type",
        "X-Request-Id",
        "X-Api-Key",
        "Anthropic-Version",
        "Anthropic-Beta",
        "Anthropic-Dangerous-Direct-Browser-Access",
        "OpenAI-Organization",
        "OpenAI-Project",
        *(
            f"X-Stainless-{name}"
            for name in (
                "Arch",
                "Async",
                "Helper-Method",
                "Lang",
                "OS",
                "Package-Version",
                "Retry-Count",
                "Runtime",
                "Runtime-Version",
                "Timeout",
            )
        ),
    )
)
MAX_AGE_S: Final = "600"


def setup_cors(app: web.Application, origins: Sequence[str]) -> None:
    """Answer preflights and tag answers for the listed origins (installed before auth:
    browsers send preflights without credentials)."""
    if not origins:
        return
    allowed = frozenset(origins)

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None or origin not in allowed:
            return await handler(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": ALLOW_METHODS,
                    "Access-Control-Allow-Headers": ALLOW_HEADERS,
                    "Access-Control-Max-Age": MAX_AGE_S,
                    "Vary": "Origin",
                },
            )
        request[appkeys.CORS_ORIGIN] = origin
        return await handler(request)

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.get(appkeys.CORS_ORIGIN)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    app.middlewares.append(cors_middleware)
    app.on_response_prepare.append(stamp)
