"""setup_cors on a bare application: preflights answered for listed origins only, their answers tagged.

The whole daemon's CORS behaviour (preflights before auth, with real keys) is in test_cors_admin.py.
"""

from __future__ import annotations

from typing import Any, Final

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from edgellmd.errors import PermissionDenied
from edgellmd.http import cors
from edgellmd.http.cors import setup_cors
from edgellmd.http.errors import error_middleware
from tests.bare import bare_app, error_of, route_all

ALLOWED: Final = "https://app.example:8443"
ALSO_ALLOWED: Final = "http://localhost:3000"
OTHER: Final = "https://evil.example"
CORS_HEADERS: Final = (
    "Access-Control-Allow-Origin",
    "Access-Control-Allow-Methods",
    "Access-Control-Allow-Headers",
    "Access-Control-Max-Age",
    "Vary",
)
PREFLIGHT_ANSWER: Final = {
    "Access-Control-Allow-Origin": ALLOWED,
    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": cors.ALLOW_HEADERS,
    "Access-Control-Max-Age": "600",
    "Vary": "Origin",
}
TAGGED: Final = {"Access-Control-Allow-Origin": ALLOWED, "Vary": "Origin"}


async def refused(_request: web.Request) -> web.Response:
    raise PermissionDenied("not for you")


async def streamed(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def browser_door(aiohttp_client: AiohttpClient, origins: list[str]) -> TestClient[Any, Any]:
    app = bare_app()
    route_all(app, ["/v1/models"])
    app.router.add_get("/v1/refused", refused)
    app.router.add_get("/v1/stream", streamed)
    setup_cors(app, origins)
    return await aiohttp_client(app)


def preflight(origin: str, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }


# (method, path, request headers) -> (status, the CORS headers of the answer)
ROWS: Final[list[Any]] = [
    pytest.param("OPTIONS", "/v1/models", preflight(ALLOWED), 204, PREFLIGHT_ANSWER, id="preflight"),
    pytest.param(
        "OPTIONS", "/v1/models", preflight(ALLOWED, "GET"), 204, PREFLIGHT_ANSWER, id="preflight-for-a-get"
    ),
    # Answered before routing: a preflight learns nothing about which routes exist.
    pytest.param(
        "OPTIONS", "/no/such/route", preflight(ALLOWED), 204, PREFLIGHT_ANSWER, id="preflight-anywhere"
    ),
    pytest.param(
        "OPTIONS",
        "/v1/models",
        preflight(ALSO_ALLOWED),
        204,
        {**PREFLIGHT_ANSWER, "Access-Control-Allow-Origin": ALSO_ALLOWED},
        id="second-origin",
    ),
    pytest.param("OPTIONS", "/v1/models", preflight(OTHER), 405, {}, id="preflight-other-origin"),
    # Origins are compared as the browser sends them: exactly.
    pytest.param(
        "OPTIONS",
        "/v1/models",
        preflight("https://APP.example:8443"),
        405,
        {},
        id="preflight-origin-in-other-case",
    ),
    pytest.param(
        "OPTIONS", "/v1/models", preflight(ALLOWED + "/"), 405, {}, id="preflight-origin-with-a-slash"
    ),
    pytest.param("OPTIONS", "/v1/models", preflight("null"), 405, {}, id="preflight-null-origin"),
    pytest.param(
        "OPTIONS",
        "/v1/models",
        {"Access-Control-Request-Method": "POST"},
        405,
        {},
        id="preflight-without-origin",
    ),
    # Not a preflight (no Access-Control-Request-Method): routed, and the refusal tagged.
    pytest.param("OPTIONS", "/v1/models", {"Origin": ALLOWED}, 405, TAGGED, id="plain-options"),
    pytest.param("GET", "/v1/models", {"Origin": ALLOWED}, 200, TAGGED, id="get"),
    pytest.param("POST", "/v1/models", {"Origin": ALLOWED}, 200, TAGGED, id="post"),
    pytest.param("GET", "/v1/models", {"Origin": OTHER}, 200, {}, id="get-other-origin"),
    pytest.param("GET", "/v1/models", {}, 200, {}, id="get-without-origin"),
    # Errors are tagged too, so that the page can read why it was refused.
    pytest.param("GET", "/v1/refused", {"Origin": ALLOWED}, 403, TAGGED, id="refusal"),
    pytest.param("GET", "/no/such/route", {"Origin": ALLOWED}, 404, TAGGED, id="not-found"),
    pytest.param("GET", "/v1/refused", {"Origin": OTHER}, 403, {}, id="refusal-other-origin"),
    pytest.param("GET", "/v1/stream", {"Origin": ALLOWED}, 200, TAGGED, id="stream"),
]


@pytest.mark.parametrize(("method", "path", "headers", "status", "cors"), ROWS)
async def test_cors_table(
    aiohttp_client: AiohttpClient,
    method: str,
    path: str,
    headers: dict[str, str],
    status: int,
    cors: dict[str, str],
) -> None:
    client = await browser_door(aiohttp_client, [ALLOWED, ALSO_ALLOWED])
    response = await client.request(method, path, headers=headers)
    assert response.status == status
    assert {name: response.headers[name] for name in CORS_HEADERS if name in response.headers} == cors
    if status == 204:
        assert await response.read() == b""  # the handler never runs for a preflight
    elif status >= 400:
        await error_of(response)  # refusals stay OpenAI envelopes


async def test_a_preflight_is_answered_whatever_the_credentials(aiohttp_client: AiohttpClient) -> None:
    client = await browser_door(aiohttp_client, [ALLOWED])
    response = await client.options(
        "/v1/models", headers={**preflight(ALLOWED), "Authorization": "Bearer nonsense"}
    )
    assert response.status == 204
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED


async def test_without_origins_nothing_is_installed(aiohttp_client: AiohttpClient) -> None:
    app = bare_app()
    route_all(app, ["/v1/models"])
    setup_cors(app, [])
    assert list(app.middlewares) == [error_middleware]
    assert list(app.on_response_prepare) == []
    client = await aiohttp_client(app)
    response = await client.options("/v1/models", headers=preflight(ALLOWED))
    assert await error_of(response) == (405, "invalid_request_error", "method_not_allowed")
    assert not any(name in response.headers for name in CORS_HEADERS)
    response = await client.get("/v1/models", headers={"Origin": ALLOWED})
    assert response.status == 200
    assert not any(name in response.headers for name in CORS_HEADERS)


def test_the_sdks_headers_pass_a_preflight() -> None:
    """What the OpenAI and Anthropic clients send on every request (the JavaScript SDKs send the
    same from a browser), less what a browser sends itself (Accept is safelisted; a page cannot
    set User-Agent)."""
    import anthropic  # noqa: PLC0415 - only this test looks at the SDKs
    import openai  # noqa: PLC0415

    allowed = {name.strip().lower() for name in cors.ALLOW_HEADERS.split(",")}
    sent = {
        *anthropic.Anthropic(api_key="k", base_url="http://127.0.0.1:9").default_headers,
        *openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9").default_headers,
        "x-api-key",  # Anthropic's key header
        "X-Stainless-Retry-Count",  # added to each attempt
        "X-Stainless-Timeout",
    }
    assert {name.lower() for name in sent} - {"accept", "user-agent"} <= allowed
