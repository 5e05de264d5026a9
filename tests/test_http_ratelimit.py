"""setup_ratelimit on a bare application: each key's `limits` from the keys file, 429s, x-ratelimit-*.

setup_auth installs the limits (they count only requests that proved who they are), so the
keys here are real ones written by `create_key`; handlers report what they spent as
TOKENS_USED, as the OpenAI adapters do. The bucket arithmetic with a fake clock and the
whole daemon's bursts are in test_ratelimit.py.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from edgellmctl.keys import create_key
from edgellmd.api.context import TOKENS_USED
from edgellmd.engine.generation import Running
from edgellmd.errors import InvalidRequest
from edgellmd.http import appkeys
from edgellmd.http.auth import setup_auth, setup_ratelimit
from edgellmd.keys import RELOAD_INTERVAL_S
from tests.bare import bare_app, error_of, who

LIMITS: Final = {  # label -> scopes, limits
    "rpm2": (["inference"], {"rpm": 2}),
    "rpm2-too": (["inference"], {"rpm": 2}),
    "tpm100": (["inference"], {"tpm": 100}),
    "one-at-a-time": (["inference"], {"concurrent": 1}),
    "ops": (["admin", "inference"], {"rpm": 1}),
    "free": (["inference"], {}),
}
RATE_HEADERS: Final = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


@dataclass(frozen=True)
class Keys:
    path: Path
    tokens: dict[str, str]
    ids: dict[str, str]

    def auth(self, label: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[label]}"}


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    path = tmp_path / "keys.yaml"
    made = {
        label: create_key(path, label, scopes, limits=limits) for label, (scopes, limits) in LIMITS.items()
    }
    return Keys(
        path,
        {label: token for label, (_, token) in made.items()},
        {label: key_id for label, (key_id, _) in made.items()},
    )


@dataclass
class Gate:
    """Holds /v1/wait's requests until opened."""

    entered: asyncio.Event
    open: asyncio.Event


GATE: Final = web.AppKey("gate", Gate)
HANDLED: Final = web.AppKey("handled", list[str])  # paths that reached a handler, in order


async def spend(request: web.Request) -> web.Response:
    """Use `?tokens=N` tokens, and fail afterwards with `?fail=1` (a 400 after the work was done)."""
    request.app[HANDLED].append(request.path)
    request[TOKENS_USED] = int(request.query.get("tokens", "0"))
    if request.query.get("fail"):
        raise InvalidRequest("failed after spending")
    return web.json_response({"ok": True})


async def wait(request: web.Request) -> web.Response:
    request.app[HANDLED].append(request.path)
    gate = request.app[GATE]
    gate.entered.set()
    await gate.open.wait()
    return web.json_response({"ok": True})


def limited_app(keys_file: Path | None) -> web.Application:
    app = bare_app()
    app[appkeys.GENERATIONS] = Running()
    app[GATE] = Gate(asyncio.Event(), asyncio.Event())
    app[HANDLED] = []
    app.router.add_post("/v1/spend", spend)
    app.router.add_get("/v1/wait", wait)
    app.router.add_get("/admin/status", who)
    if keys_file is not None:
        setup_auth(app, keys_file)  # and with it setup_ratelimit
    else:
        setup_ratelimit(app)
    return app


async def door(aiohttp_client: AiohttpClient, keys: Keys) -> TestClient[Any, Any]:
    return await aiohttp_client(limited_app(keys.path))


def rate_headers(response: Any) -> dict[str, str]:
    return {name: response.headers[name] for name in RATE_HEADERS if name in response.headers}


async def test_requests_per_minute(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    first = await client.post("/v1/spend", headers=keys.auth("rpm2"))
    assert first.status == 200
    assert rate_headers(first) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
    }  # one request refills in 30 s
    second = await client.post("/v1/spend", headers=keys.auth("rpm2"))
    assert rate_headers(second) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
    }
    third = await client.post("/v1/spend", headers=keys.auth("rpm2"))
    assert await error_of(third) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert (await third.json())["error"][
        "message"
    ] == "rate limit reached for requests per minute; retry in 30 s"
    assert third.headers["Retry-After"] == "30"
    assert rate_headers(third)["x-ratelimit-remaining-requests"] == "0"
    assert client.app is not None
    assert client.app[HANDLED] == ["/v1/spend"] * 2  # the refused one never reached the handler
    assert client.app[appkeys.RATE_LIMITER].refusals == {"rpm": 1}
    # Each key has buckets of its own.
    assert (await client.post("/v1/spend", headers=keys.auth("rpm2-too"))).status == 200


async def test_tokens_per_minute_are_charged_when_a_request_ends(
    aiohttp_client: AiohttpClient, keys: Keys
) -> None:
    client = await door(aiohttp_client, keys)
    # A full bucket admits a request whatever it will cost; the cost is a debt to pay off.
    first = await client.post("/v1/spend", params={"tokens": "130"}, headers=keys.auth("tpm100"))
    assert first.status == 200
    # The answer's headers are stamped after the request ended: they count its own tokens.
    assert rate_headers(first) == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m18s",
    }  # 130 tokens at 100 a minute
    second = await client.post("/v1/spend", params={"tokens": "1"}, headers=keys.auth("tpm100"))
    assert await error_of(second) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert (await second.json())["error"][
        "message"
    ] == "rate limit reached for tokens per minute; retry in 18 s"  # the 30 tokens of debt
    assert second.headers["Retry-After"] == "18"
    assert client.app is not None
    assert client.app[appkeys.RATE_LIMITER].refusals == {"tpm": 1}


async def test_tokens_count_even_when_the_request_fails(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    failed = await client.post(
        "/v1/spend", params={"tokens": "130", "fail": "1"}, headers=keys.auth("tpm100")
    )
    assert await error_of(failed) == (400, "invalid_request_error", None)
    assert (await client.post("/v1/spend", headers=keys.auth("tpm100"))).status == 429


async def test_concurrent_requests_beyond_the_cap(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    assert client.app is not None
    gate = client.app[GATE]
    held = asyncio.create_task(client.get("/v1/wait", headers=keys.auth("one-at-a-time")))
    await asyncio.wait_for(gate.entered.wait(), 10)
    refused = await client.post("/v1/spend", headers=keys.auth("one-at-a-time"))
    assert await error_of(refused) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert (await refused.json())["error"]["message"] == "this key allows 1 concurrent request(s)"
    assert refused.headers["Retry-After"] == "1"
    assert rate_headers(refused) == {}  # no per-minute limits to describe
    assert (await client.post("/v1/spend", headers=keys.auth("free"))).status == 200  # other keys go on
    gate.open.set()
    assert (await held).status == 200
    assert (await client.post("/v1/spend", headers=keys.auth("one-at-a-time"))).status == 200
    assert client.app[appkeys.RATE_LIMITER].refusals == {"concurrency": 1}


async def test_a_failed_request_frees_its_place(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    for _ in range(3):
        failed = await client.post("/v1/spend", params={"fail": "1"}, headers=keys.auth("one-at-a-time"))
        assert failed.status == 400  # never 429: the failure released its slot


async def test_only_v1_paths_count_and_show_limits(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    for _ in range(3):  # the key allows one request a minute, but /admin is not counted
        admin = await client.get("/admin/status", headers=keys.auth("ops"))
        assert admin.status == 200
        assert rate_headers(admin) == {}
    assert (await client.post("/v1/spend", headers=keys.auth("ops"))).status == 200
    assert (await client.post("/v1/spend", headers=keys.auth("ops"))).status == 429


async def test_a_key_without_limits_is_never_refused(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    for _ in range(20):
        response = await client.post("/v1/spend", params={"tokens": "10000"}, headers=keys.auth("free"))
        assert response.status == 200
        assert rate_headers(response) == {}


async def test_without_a_key_nothing_is_limited(aiohttp_client: AiohttpClient) -> None:
    app = limited_app(None)  # setup_ratelimit alone: no request carries a key
    client = await aiohttp_client(app)
    for _ in range(5):
        response = await client.post("/v1/spend", params={"tokens": "10000"})
        assert response.status == 200
        assert rate_headers(response) == {}
    assert app[appkeys.RATE_LIMITER].refusals == {}  # the limiter, made at start-up, saw nothing


async def test_limits_follow_the_keys_file(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys)
    assert (await client.post("/v1/spend", headers=keys.auth("ops"))).status == 200
    assert (await client.post("/v1/spend", headers=keys.auth("ops"))).status == 429
    data = yaml.safe_load(keys.path.read_text())
    for entry in data["keys"]:
        if entry["id"] == keys.ids["ops"]:
            entry["limits"] = {"rpm": 3}
    keys.path.write_text(yaml.safe_dump(data))
    os.chmod(keys.path, 0o600)
    # New limits start from a full bucket, once the keys file is read again.
    for _ in range(int(5 / RELOAD_INTERVAL_S)):
        await asyncio.sleep(RELOAD_INTERVAL_S)
        response = await client.post("/v1/spend", headers=keys.auth("ops"))
        if response.status == 200:
            break
    assert response.status == 200
    assert rate_headers(response)["x-ratelimit-limit-requests"] == "3"
    assert rate_headers(response)["x-ratelimit-remaining-requests"] == "2"
