"""setup_openai on a bare application: its routes, and what it takes from and leaves for the front door.

A real registry serves tiny models with the real engine. The front door's side of the
contract is request state: CALLER (who the key is, its max_tokens ceiling) comes in, the
context's `key_valid` says whether that key still works, and TOKENS_USED goes out for the
rate limiter. The request and answer shapes, against a whole daemon, are in test_api_openai.py,
test_api_breadth.py and test_openai_client.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from aiohttp.typedefs import Middleware
from pytest_aiohttp import AiohttpClient

from edgellmd.api.context import API_CONTEXT, CALLER, TOKENS_USED, ApiContext, Caller
from edgellmd.api.openai.routes import setup_openai
from edgellmd.engine.generation import KEY_REVOKED
from edgellmd.http.errors import Handler
from edgellmd.settings import ServerSettings
from tests.bare import api_context, bare_app, error_of, model_settings, not_a_model
from tests.serving import sse_events

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

SPENT: Final = web.AppKey("spent", list[int | None])  # each request's TOKENS_USED, as the limiter reads it
PROMPT: Final = "The bare app says"


@dataclass
class Served:
    client: TestClient[Any, Any]
    context: ApiContext
    spent: list[int | None]


def _front_door(caller: Caller | None) -> Middleware:
    """Stands in for authentication (sets CALLER) and for the rate limiter (reads TOKENS_USED)."""

    @web.middleware
    async def front_door(request: web.Request, handler: Handler) -> web.StreamResponse:
        if caller is not None:
            request[CALLER] = caller
        try:
            return await handler(request)
        finally:
            request.app[SPENT].append(request.get(TOKENS_USED))

    return front_door


@asynccontextmanager
async def serving(
    aiohttp_client: AiohttpClient,
    models: dict[str, Path],
    *,
    caller: Caller | None = None,
    key_valid: Callable[[str], bool] = lambda _key_id: True,
    server: ServerSettings | None = None,
    embedding: tuple[str, ...] = (),
) -> AsyncIterator[Served]:
    settings = [model_settings(name, file, embedding=name in embedding) for name, file in models.items()]
    async with api_context(settings, key_valid=key_valid, server=server) as context:
        app = bare_app()
        app.middlewares.append(_front_door(caller))
        app[API_CONTEXT] = context
        app[SPENT] = []
        setup_openai(app)
        yield Served(await aiohttp_client(app), context, app[SPENT])


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    return not_a_model(tmp_path / "broken.gguf")


def completion(max_tokens: int | None = 4, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


# ---- routes -------------------------------------------------------------------------------------

ROUTES: Final[list[Any]] = [  # method, path, body -> status, code
    pytest.param("GET", "/v1/models", None, 200, None, id="models"),
    pytest.param("GET", "/v1/models/tiny", None, 200, None, id="model"),
    pytest.param("POST", "/v1/completions", completion(), 200, None, id="completions"),
    pytest.param("POST", "/v1/chat/completions", chat(max_tokens=2), 200, None, id="chat"),
    pytest.param("POST", "/v1/embeddings", {"model": "embed", "input": "x"}, 200, None, id="embeddings"),
    pytest.param("GET", "/v1/models/nope", None, 404, "model_not_found", id="unknown-model"),
    pytest.param("POST", "/v1/models", {}, 405, "method_not_allowed", id="post-models"),
    pytest.param("DELETE", "/v1/models/tiny", None, 405, "method_not_allowed", id="delete-model"),
    pytest.param("GET", "/v1/completions", None, 405, "method_not_allowed", id="get-completions"),
    pytest.param("GET", "/v1/chat/completions", None, 405, "method_not_allowed", id="get-chat"),
    pytest.param("GET", "/v1/embeddings", None, 405, "method_not_allowed", id="get-embeddings"),
    pytest.param("POST", "/v1/responses", {}, 404, "not_found", id="no-responses-api"),
    pytest.param("GET", "/v1", None, 404, "not_found", id="bare-prefix"),
    pytest.param("POST", "/v1/completions/", completion(), 404, "not_found", id="trailing-slash"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), ROUTES)
async def test_routes(
    aiohttp_client: AiohttpClient,
    tiny_model: Path,
    method: str,
    path: str,
    body: Any,
    status: int,
    code: str | None,
) -> None:
    async with serving(
        aiohttp_client, {"tiny": tiny_model, "embed": tiny_model}, embedding=("embed",)
    ) as served:
        response = await served.client.request(method, path, json=body)
        if code is None:
            assert response.status == status, await response.text()
        else:
            error = await error_of(response)
            assert (error[0], error[2]) == (status, code)


async def test_only_models_that_can_serve_now_are_listed(
    aiohttp_client: AiohttpClient, tiny_model: Path, broken: Path
) -> None:
    models = {"tiny": tiny_model, "spare": tiny_model, "bad": broken}
    async with serving(aiohttp_client, models) as served:
        client = served.client
        await served.context.registry.unload("spare")
        listing = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in listing["data"]] == ["tiny"]
        for name in ("spare", "bad", "nope"):
            response = await client.get(f"/v1/models/{name}")
            assert await error_of(response) == (404, "invalid_request_error", "model_not_found")
            assert (await response.json())["error"]["param"] == "model"
        # Asked to generate, a configured model that does not serve says so, and when to retry.
        for name, why in (
            ("spare", "the model 'spare' is unloaded: unloaded by an operator"),
            ("bad", "the model 'bad' is failed"),
        ):
            response = await client.post("/v1/completions", json=completion(model=name))
            assert await error_of(response) == (503, "server_error", "model_not_ready")
            assert (await response.json())["error"]["message"] == why
            assert response.headers["Retry-After"] == "5"
        unknown = await client.post("/v1/completions", json=completion(model="nope"))
        assert await error_of(unknown) == (404, "invalid_request_error", "model_not_found")


# ---- CALLER in --------------------------------------------------------------------------------

CEILINGS: Final[list[Any]] = [  # path, server limit, the key's max_tokens, body -> status, tokens or param
    pytest.param("/v1/completions", 512, 4, completion(4), 200, 4, id="at-the-keys-ceiling"),
    pytest.param("/v1/completions", 512, 4, completion(5), 400, "max_tokens", id="over-the-keys-ceiling"),
    pytest.param("/v1/completions", 3, 4, completion(4), 400, "max_tokens", id="server-limit-is-lower"),
    pytest.param("/v1/completions", 512, None, completion(20), 200, 20, id="key-without-a-ceiling"),
    pytest.param("/v1/chat/completions", 512, 4, chat(), 200, 4, id="chat-default-runs-to-the-ceiling"),
    pytest.param(
        "/v1/chat/completions",
        512,
        4,
        chat(max_completion_tokens=5),
        400,
        "max_completion_tokens",
        id="chat-over-the-ceiling",
    ),
]


@pytest.mark.parametrize(("path", "server_limit", "key_limit", "body", "status", "expected"), CEILINGS)
async def test_a_callers_max_tokens_ceiling(
    aiohttp_client: AiohttpClient,
    tiny_model: Path,
    path: str,
    server_limit: int,
    key_limit: int | None,
    body: dict[str, Any],
    status: int,
    expected: Any,
) -> None:
    async with serving(
        aiohttp_client,
        {"tiny": tiny_model},
        caller=Caller("0123456789ab", key_limit),
        server=ServerSettings(max_tokens_limit=server_limit),
    ) as served:
        response = await served.client.post(path, json=body)
        answer = await response.json()
    if status == 200:
        assert response.status == 200, answer
        assert answer["usage"]["completion_tokens"] == expected
        return
    assert await error_of(response) == (400, "invalid_request_error", None)
    assert answer["error"]["param"] == expected
    assert f"at most {min(server_limit, key_limit or server_limit)}" in answer["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_key_that_stopped_working_generates_nothing(
    aiohttp_client: AiohttpClient, tiny_model: Path, path: str
) -> None:
    body = completion() if path == "/v1/completions" else chat(max_tokens=4)
    async with serving(
        aiohttp_client,
        {"tiny": tiny_model},
        caller=Caller("revokedrevok"),
        key_valid=lambda key_id: key_id != "revokedrevok",
    ) as served:
        engine = served.context.registry.get("tiny").generator
        warmed_up = engine.tokens_generated  # the load's warm-up generation
        response = await served.client.post(path, json=body)
        assert await error_of(response) == (401, "authentication_error", "invalid_api_key")
        assert (await response.json())["error"]["message"] == KEY_REVOKED
        assert engine.tokens_generated == warmed_up
        assert served.spent == [None]  # nothing generated, nothing to charge
    async with serving(
        aiohttp_client,
        {"tiny": tiny_model},
        caller=Caller("stillgood123"),
        key_valid=lambda key_id: key_id != "revokedrevok",
    ) as served:
        assert (await served.client.post(path, json=body)).status == 200
    # Without authentication there is no key to ask about.
    async with serving(aiohttp_client, {"tiny": tiny_model}, key_valid=lambda _: False) as served:
        assert (await served.client.post(path, json=body)).status == 200


# ---- TOKENS_USED out --------------------------------------------------------------------------


async def test_tokens_used_are_left_for_the_rate_limiter(
    aiohttp_client: AiohttpClient, tiny_model: Path
) -> None:
    async with serving(
        aiohttp_client, {"tiny": tiny_model, "embed": tiny_model}, embedding=("embed",)
    ) as served:
        client = served.client
        answer = await (await client.post("/v1/completions", json=completion(6))).json()
        usage = answer["usage"]
        chatted = await (await client.post("/v1/chat/completions", json=chat(max_tokens=3))).json()
        streamed = await client.post(
            "/v1/completions", json=completion(5, stream=True, stream_options={"include_usage": True})
        )
        chunks = [chunk async for chunk in sse_events(streamed.content)]
        stream_usage = next(c["usage"] for c in chunks if c is not None and c.get("usage"))
        embedded = await (
            await client.post("/v1/embeddings", json={"model": "embed", "input": ["ab", "cde"]})
        ).json()
        refused = await client.post("/v1/completions", json=completion(max_tokens=0))
        assert refused.status == 400
        unknown = await client.post("/v1/completions", json=completion(model="nope"))
        assert unknown.status == 404
    assert usage["completion_tokens"] == 6
    assert stream_usage["completion_tokens"] == 5
    assert chunks[-1] is None  # the stream ended with [DONE]
    assert served.spent == [
        usage["prompt_tokens"] + usage["completion_tokens"],
        chatted["usage"]["prompt_tokens"] + chatted["usage"]["completion_tokens"],
        stream_usage["prompt_tokens"] + stream_usage["completion_tokens"],  # counted once it ended
        embedded["usage"]["prompt_tokens"],
        None,
        None,  # refused before any work: nothing to charge
    ]
