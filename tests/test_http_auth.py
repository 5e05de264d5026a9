"""setup_admin_networks and setup_auth on a bare application: who may call what, and the audit trail.

Keys are real: a keys file written by `edgellmctl keys`' own `create_key`. The whole daemon's
key table, hot reload and the keys CLI are in test_auth.py, revocation of running requests in
test_revocation.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict
from pytest_aiohttp import AiohttpClient

from edgellmctl.keys import create_key
from edgellmd.engine.generation import Running
from edgellmd.http import appkeys
from edgellmd.http.auth import setup_admin_networks, setup_auth
from edgellmd.keys import RELOAD_INTERVAL_S, KeysFileError, KeyStore, hash_secret, parse_token
from tests.bare import AuditLine, audit_lines, bare_app, error_of, everything_logged, route_all

REPO = Path(__file__).resolve().parents[1]

PEER: Final = "127.0.0.1"  # where the test client connects from
UNKNOWN_ID: Final = "0123456789ab"
PATHS: Final = (
    "/",
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1",
    "/v1/models",
    "/v1x",
    "/admin",
    "/admin/status",
    "/administrator",
)


@dataclass(frozen=True)
class Keys:
    path: Path
    tokens: dict[str, str]  # label -> token
    ids: dict[str, str]  # label -> key id

    def bearer(self, label: str) -> str:
        return f"Bearer {self.tokens[label]}"


def edit_key(path: Path, key_id: str, **fields: Any) -> None:
    """Change one entry of a keys file as an operator with an editor would (mode kept 0600)."""
    data = yaml.safe_load(path.read_text())
    for entry in data["keys"]:
        if entry["id"] == key_id:
            entry.update(fields)
    path.write_text(yaml.safe_dump(data))
    os.chmod(path, 0o600)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    path = tmp_path_factory.mktemp("auth") / "keys.yaml"
    made = {
        label: create_key(path, label, scopes, limits=limits)
        for label, scopes, limits in [
            ("app", ["inference"], {"max_tokens": 64}),
            ("ops", ["admin"], {}),
            ("scraper", ["metrics"], {}),
            ("all", ["inference", "admin", "metrics"], {}),
            ("expired", ["inference"], {}),
            ("disabled", ["inference"], {}),
        ]
    }
    edit_key(path, made["expired"][0], expires="2020-01-01T00:00:00Z")
    edit_key(path, made["disabled"][0], disabled=True)
    return Keys(
        path,
        {label: token for label, (_, token) in made.items()},
        {label: key_id for label, (key_id, _) in made.items()},
    )


async def door(
    aiohttp_client: AiohttpClient,
    keys_file: Path | None,
    *,
    metrics_public: bool = False,
    networks: tuple[str, ...] = (),
    peer: str | None = None,
) -> TestClient[Any, Any]:
    """A bare app with `who` on every path of PATHS behind the two installers, in app.py's order."""
    app = bare_app(peer=peer)
    app[appkeys.GENERATIONS] = Running()  # the keys watcher ends the generations of revoked keys
    route_all(app, PATHS)
    setup_admin_networks(app, networks)
    setup_auth(app, keys_file, metrics_public=metrics_public)
    return await aiohttp_client(app)


# ---- which paths need which scope ---------------------------------------------------------------

SCOPES: Final = [  # path, the scope it needs (None: public), a key that has only that scope
    ("/", None, None),
    ("/healthz", None, None),
    ("/readyz", None, None),
    ("/v1x", None, None),
    ("/administrator", None, None),
    ("/v1", "inference", "app"),
    ("/v1/models", "inference", "app"),
    ("/admin", "admin", "ops"),
    ("/admin/status", "admin", "ops"),
    ("/metrics", "metrics", "scraper"),
]


@pytest.mark.parametrize(("path", "scope", "label"), SCOPES)
async def test_each_path_needs_its_scope(
    aiohttp_client: AiohttpClient,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
    path: str,
    scope: str | None,
    label: str | None,
) -> None:
    client = await door(aiohttp_client, keys.path)
    without = await client.get(path)
    if scope is None:
        assert without.status == 200
        assert (await without.json())["key_id"] is None  # public paths look at no key
        assert audit_lines(caplog) == []
        return
    assert await error_of(without) == (401, "authentication_error", "invalid_api_key")
    assert label is not None
    for holder in (label, "all"):  # its own scope only, or every scope
        with_key = await client.get(path, headers={"Authorization": keys.bearer(holder)})
        assert with_key.status == 200
        assert (await with_key.json())["key_id"] == keys.ids[holder]
    others = {other for _, needed, other in SCOPES if needed not in (None, scope) and other is not None}
    for other in sorted(others):  # a key with another scope only is forbidden, not unauthenticated
        refused = await client.get(path, headers={"Authorization": keys.bearer(other)})
        assert await error_of(refused) == (403, "permission_error", "insufficient_scope")


async def test_metrics_public_looks_at_no_key(
    aiohttp_client: AiohttpClient, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    client = await door(aiohttp_client, keys.path, metrics_public=True)
    for header in ({}, {"Authorization": "Bearer nonsense"}, {"Authorization": keys.bearer("app")}):
        response = await client.get("/metrics", headers=header)
        assert response.status == 200
        assert (await response.json())["key_id"] is None
    assert audit_lines(caplog) == []
    assert (await client.get("/v1/models")).status == 401  # the rest stays guarded


# ---- the header table ---------------------------------------------------------------------------


def _secret_swapped(k: Keys) -> str:
    token = k.tokens["app"]
    return "Bearer " + token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")


def _unknown(_: Keys) -> str:
    return f"Bearer elk_{UNKNOWN_ID}_" + "x" * 43


Row = tuple[Any, int, str | None, str | None, str | None, str | None]
# header (from the keys) -> status, error code, answer's message, audit message, key id in the audit line
HEADERS: Final[dict[str, Row]] = {
    "none": (
        lambda k: None,
        401,
        "invalid_api_key",
        "missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
        "auth failed: no bearer token",
        None,
    ),
    "empty": (
        lambda k: "",
        401,
        "invalid_api_key",
        "missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
        "auth failed: no bearer token",
        None,
    ),
    "basic": (
        lambda k: "Basic dXNlcjpwYXNz",
        401,
        "invalid_api_key",
        "malformed API key",
        "auth failed: malformed bearer token",
        None,
    ),
    "not-ours": (
        lambda k: "Bearer sk-not-an-edgellm-key",
        401,
        "invalid_api_key",
        "malformed API key",
        "auth failed: malformed bearer token",
        None,
    ),
    "scheme-only": (
        lambda k: "Bearer",
        401,
        "invalid_api_key",
        "malformed API key",
        "auth failed: malformed bearer token",
        None,
    ),
    "no-scheme": (
        lambda k: k.tokens["app"],
        401,
        "invalid_api_key",
        "malformed API key",
        "auth failed: malformed bearer token",
        None,
    ),
    "wrong-secret": (
        _secret_swapped,
        401,
        "invalid_api_key",
        "invalid API key",
        "auth failed: wrong or unknown key",
        "app",
    ),
    "unknown-id": (
        _unknown,
        401,
        "invalid_api_key",
        "invalid API key",
        "auth failed: wrong or unknown key",
        UNKNOWN_ID,
    ),
    "expired": (
        lambda k: k.bearer("expired"),
        401,
        "invalid_api_key",
        "API key expired",
        "auth failed: key expired",
        "expired",
    ),
    "disabled": (
        lambda k: k.bearer("disabled"),
        401,
        "invalid_api_key",
        "API key disabled",
        "auth failed: key disabled",
        "disabled",
    ),
    "wrong-scope": (
        lambda k: k.bearer("ops"),
        403,
        "insufficient_scope",
        "this API key does not have the 'inference' scope",
        "auth failed: key lacks scope inference",
        "ops",
    ),
    "right": (lambda k: k.bearer("app"), 200, None, None, None, None),
    "lowercase-scheme": (lambda k: "bearer " + k.tokens["app"], 200, None, None, None, None),
    "uppercase-scheme": (lambda k: "BEARER " + k.tokens["app"], 200, None, None, None, None),
    "spaces-around-the-token": (lambda k: "Bearer   " + k.tokens["app"], 200, None, None, None, None),
}


@pytest.mark.parametrize(
    ("header", "status", "code", "message", "audit", "audit_key"),
    [pytest.param(*row, id=name) for name, row in HEADERS.items()],
)
async def test_header_table(
    aiohttp_client: AiohttpClient,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
    header: Any,
    status: int,
    code: str | None,
    message: str | None,
    audit: str | None,
    audit_key: str | None,
) -> None:
    client = await door(aiohttp_client, keys.path)
    value = header(keys)
    with caplog.at_level(logging.DEBUG):
        response = await client.get(
            "/v1/models", headers={"Authorization": value} if value is not None else {}
        )
    assert response.status == status
    body = await response.json()
    assert response.headers.get("WWW-Authenticate") == ("Bearer" if status == 401 else None)
    if audit is None:
        assert body["key_id"] == keys.ids["app"]
        assert audit_lines(caplog) == []
        return
    kind = "authentication_error" if status == 401 else "permission_error"
    assert await error_of(response) == (status, kind, code)
    assert body["error"]["message"] == message
    assert body["error"]["param"] is None
    key_id = keys.ids.get(audit_key or "", audit_key)
    assert audit_lines(caplog) == [AuditLine("WARNING", audit, PEER, key_id)]
    presented = (value or "").rpartition(" ")[2]
    if presented and presented != "Bearer":  # what was presented reaches no line, nor its secret part
        secret = presented.split("_", 2)[2] if presented.startswith("elk_") else presented
        assert secret not in everything_logged(caplog)


@pytest.mark.parametrize(
    "which",
    [
        "two-authorization",
        "two-x-api-key",
        "each-a-different-key",
        "the-same-key-twice-over",
        "anthropic-and-openai",
    ],
)
async def test_a_request_naming_more_than_one_key_is_refused(
    aiohttp_client: AiohttpClient, keys: Keys, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    """Which of two keys a proxy in front checked is not known: none is taken (once the first won)."""
    client = await door(aiohttp_client, keys.path)
    app, ops = keys.bearer("app"), keys.bearer("ops")
    headers: list[tuple[str, str]] = {
        "two-authorization": [("Authorization", ops), ("Authorization", app)],
        "two-x-api-key": [("x-api-key", ops.split()[1]), ("x-api-key", app.split()[1])],
        "each-a-different-key": [("Authorization", app), ("x-api-key", ops.split()[1])],
        "the-same-key-twice-over": [("Authorization", app), ("x-api-key", app.split()[1])],
        "anthropic-and-openai": [
            ("Authorization", "bearer " + app.split()[1]),
            ("x-api-key", app.split()[1]),
        ],
    }[which]
    with caplog.at_level(logging.DEBUG):
        response = await client.get("/v1/models", headers=CIMultiDict(headers))
    if which in ("the-same-key-twice-over", "anthropic-and-openai"):  # one key, said both ways
        assert response.status == 200
        assert (await response.json())["key_id"] == keys.ids["app"]
        return
    assert await error_of(response) == (401, "authentication_error", "invalid_api_key")
    assert "more than one API key" in (await response.json())["error"]["message"]
    assert audit_lines(caplog) == [
        AuditLine("WARNING", "auth failed: more than one API key sent", PEER, None)
    ]


async def test_the_request_carries_its_key_and_caller(aiohttp_client: AiohttpClient, keys: Keys) -> None:
    client = await door(aiohttp_client, keys.path)
    app = await (await client.get("/v1/models", headers={"Authorization": keys.bearer("app")})).json()
    assert (app["key_id"], app["caller"]) == (keys.ids["app"], [keys.ids["app"], 64])  # limits.max_tokens
    ops = await (await client.get("/admin/status", headers={"Authorization": keys.bearer("ops")})).json()
    assert (ops["key_id"], ops["caller"]) == (keys.ids["ops"], [keys.ids["ops"], None])
    public = await (await client.get("/healthz", headers={"Authorization": keys.bearer("app")})).json()
    assert (public["key_id"], public["caller"]) == (None, None)


# ---- the keys file ------------------------------------------------------------------------------


async def test_without_a_keys_file_no_key_is_asked_for(aiohttp_client: AiohttpClient) -> None:
    app = bare_app()
    route_all(app, PATHS)
    setup_auth(app, None)
    assert list(app.cleanup_ctx) == []
    client = await aiohttp_client(app)
    for path in ("/v1/models", "/admin/status", "/metrics"):
        response = await client.get(path)
        assert response.status == 200
        assert await response.json() == {"path": path, "peer": PEER, "key_id": None, "caller": None}
    assert appkeys.KEY_STORE not in app
    assert appkeys.RATE_LIMITER not in app  # no keys, no limits


async def test_without_a_keys_file_no_web_page_reaches_the_daemon(aiohttp_client: AiohttpClient) -> None:
    """Keyless (loopback only), any page in a browser on the box could unload models with a
    preflight-free POST, and a name of its own resolving to 127.0.0.1 (DNS rebinding) could
    read answers: both are refused; curl, SDKs and allowed origins pass."""
    app = bare_app()
    route_all(app, PATHS)
    setup_auth(app, None, origins=("http://localhost:3000",))
    client = await aiohttp_client(app)
    page = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}
    refused = await client.post("/admin/status", headers=page, data="{}")
    assert await error_of(refused) == (403, "permission_error", "cross_site_request")
    beside = {"Origin": "http://localhost:9999", "Sec-Fetch-Site": "same-site"}  # another port
    assert (await client.get("/v1/models", headers=beside)).status == 403
    assert (
        await client.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"})
    ).status == 403  # an <img>
    rebound = await client.get("/v1/models", headers={"Host": "attacker.example:8080"})
    assert await error_of(rebound) == (403, "permission_error", "host_not_allowed")
    for host in ("127.0.0.1.nip.io", "[::ffff:10.0.0.1]", "0.0.0.0:8080", "127.0.0.1@evil.example"):
        assert (await client.get("/v1/models", headers={"Host": host})).status == 403, host
    # Numbers that are not loopback, or not one address: 128.1 is 128.0.0.1; libc's inet_aton
    # would read "127.1 x" as 127.0.0.1; 0.0.0.0 in one number; too many or too large parts.
    for host in ("128.1", "127.1%20x", "0", "127.0.0.1.1", "127.256.1", "127.0.65536", "08.1", "127.-1"):
        assert (await client.get("/v1/models", headers={"Host": host})).status == 403, host
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080", "LOCALHOST.", "[::ffff:127.0.0.1]:8080"):
        assert (await client.get("/v1/models", headers={"Host": host})).status == 200, host
    # The shorthand spellings curl sends as typed (`curl http://127.1:8080/`).
    for host in ("127.1", "127.1:8080", "0x7f.1", "0X7F.0.0.1", "0177.0.0.1", "2130706433", "127.0.1"):
        assert (await client.get("/v1/models", headers={"Host": host})).status == 200, host
    allowed = {"Origin": "http://localhost:3000", "Sec-Fetch-Site": "same-site"}
    assert (await client.post("/admin/status", headers=allowed, data="{}")).status == 200
    own = await client.post("/admin/status", headers={"Origin": str(client.make_url("")).rstrip("/")})
    assert own.status == 200  # a page the daemon served itself (same origin)
    assert (await client.get("/v1/models", headers={"Sec-Fetch-Site": "none"})).status == 200  # typed in


async def test_the_keys_file_is_read_when_the_app_starts(
    aiohttp_client: AiohttpClient, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    app = bare_app()
    app[appkeys.GENERATIONS] = Running()
    route_all(app, PATHS)
    setup_auth(app, keys.path)
    assert appkeys.KEY_STORE not in app
    with caplog.at_level(logging.INFO, logger="edgellmd.http.auth"):
        await aiohttp_client(app)
    assert len(app[appkeys.KEY_STORE]) == len(keys.tokens)
    assert f"API keys: {len(keys.tokens)} key(s) from {keys.path}" in caplog.messages
    assert not any(token in everything_logged(caplog) for token in keys.tokens.values())


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        pytest.param(lambda p: os.chmod(p, 0o644), "chmod 600", id="readable-by-others"),
        pytest.param(lambda p: p.unlink(), "cannot read", id="missing"),
        pytest.param(lambda p: p.write_text("keys: [oops"), "YAML syntax error", id="not-yaml"),
        pytest.param(lambda p: p.write_text("keys: []\nx: 2027-02-30\n"), "cannot read", id="bad-date"),
    ],
)
async def test_a_keys_file_that_cannot_be_used_stops_the_start(
    tmp_path: Path, damage: Any, match: str
) -> None:
    path = tmp_path / "keys.yaml"
    create_key(path, "app", ["inference"], limits={})
    damage(path)
    app = bare_app()
    app[appkeys.GENERATIONS] = Running()
    setup_auth(app, path)
    runner = web.AppRunner(app)
    try:
        with pytest.raises(KeysFileError, match=match):
            await runner.setup()  # the app's start-up: it never serves with keys it cannot read
    finally:
        await runner.cleanup()


async def test_a_keys_file_yaml_cannot_build_is_refused_and_later_revocations_still_bite(
    aiohttp_client: AiohttpClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A date that does not exist (`expires: 2027-02-30T00:00:00Z`) is well-formed YAML that
    PyYAML cannot build: the ValueError escaped the reload and ended the keys watch without a
    word, so every later revocation was ignored until a restart. The file is refused, the
    keys in force stay, and the next good file is read."""
    path = tmp_path / "keys.yaml"
    victim_id, victim = create_key(path, "victim", ["inference"], limits={})
    app = bare_app()
    app[appkeys.GENERATIONS] = Running()
    route_all(app, PATHS)
    setup_auth(app, path)
    client = await aiohttp_client(app)
    bearer = {"Authorization": f"Bearer {victim}"}
    assert (await client.get("/v1/models", headers=bearer)).status == 200
    good = path.read_text()

    def replace_file(text: str) -> None:
        tmp = tmp_path / "keys.new"
        tmp.write_text(text)
        tmp.chmod(0o600)
        tmp.rename(path)

    with caplog.at_level(logging.ERROR):
        replace_file(good.replace("created:", "expires: 2027-02-30T00:00:00Z\n  created:", 1))
        await asyncio.sleep(4 * RELOAD_INTERVAL_S)
    assert "keys file change rejected" in caplog.text
    assert "day is out of range for month" in caplog.text
    assert (await client.get("/v1/models", headers=bearer)).status == 200  # the last good keys
    replace_file(good.replace("disabled: false", "disabled: true", 1))
    deadline = time.monotonic() + 10
    while (await client.get("/v1/models", headers=bearer)).status != 401:
        assert time.monotonic() < deadline, "the revocation never bit: the keys watch is gone"
        await asyncio.sleep(0.1)
    assert victim_id not in app[appkeys.KEY_STORE].in_force(datetime.now(UTC))[0]


# ---- admin networks -----------------------------------------------------------------------------

NETWORKS: Final = [  # peer, networks, path, key label to send (None: none), refused
    ("10.1.2.3", ("10.0.0.0/8",), "/admin/status", "ops", False),
    ("192.168.1.7", ("10.0.0.0/8",), "/admin/status", "ops", True),
    ("192.168.1.7", ("10.0.0.0/8", "192.168.1.0/24"), "/admin/status", "ops", False),
    ("192.168.1.7", ("10.0.0.0/8",), "/admin", "ops", True),
    ("10.1.2.3", ("10.1.2.3",), "/admin/status", "ops", False),  # a bare address: one host
    ("10.1.2.4", ("10.1.2.3",), "/admin/status", "ops", True),
    ("10.1.2.200", ("10.1.2.3/24",), "/admin/status", "ops", False),  # host bits are ignored
    ("2001:db8::7", ("2001:db8::/32",), "/admin/status", "ops", False),
    ("2001:db8::7", ("10.0.0.0/8",), "/admin/status", "ops", True),
    # An IPv4 client of a dual-stack listener is its IPv4 address (before: refused).
    ("::ffff:10.1.2.3", ("10.0.0.0/8",), "/admin/status", "ops", False),
    ("::ffff:192.168.1.7", ("10.0.0.0/8",), "/admin/status", "ops", True),
    ("", ("10.0.0.0/8",), "/admin/status", "ops", True),  # no address (a UNIX socket)
    ("not-an-address", ("0.0.0.0/0",), "/admin/status", "ops", True),
    # Before any key is looked at: no key is a 403 too, not a 401.
    ("192.168.1.7", ("10.0.0.0/8",), "/admin/status", None, True),
    # Only /admin paths are fenced.
    ("192.168.1.7", ("10.0.0.0/8",), "/v1/models", "app", False),
    ("192.168.1.7", ("10.0.0.0/8",), "/metrics", "scraper", False),
    ("192.168.1.7", ("10.0.0.0/8",), "/administrator", None, False),
]


@pytest.mark.parametrize(("peer", "networks", "path", "label", "refused"), NETWORKS)
async def test_admin_networks_table(
    aiohttp_client: AiohttpClient,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
    peer: str,
    networks: tuple[str, ...],
    path: str,
    label: str | None,
    refused: bool,
) -> None:
    client = await door(aiohttp_client, keys.path, networks=networks, peer=peer)
    headers = {"Authorization": keys.bearer(label)} if label else {}
    with caplog.at_level(logging.INFO):
        response = await client.get(path, headers=headers)
    if not refused:
        assert response.status == 200
        assert (await response.json())["peer"] == peer
        assert audit_lines(caplog) == []
        return
    assert await error_of(response) == (403, "permission_error", "address_not_allowed")
    message = (await response.json())["error"]["message"]
    assert message == "admin endpoints are not reachable from this address"
    assert "WWW-Authenticate" not in response.headers  # no key would help
    assert audit_lines(caplog) == [
        AuditLine("WARNING", "admin refused: address not in auth.admin_cidrs", peer, None)
    ]


async def test_admin_networks_stand_without_keys(aiohttp_client: AiohttpClient) -> None:
    inside = await door(aiohttp_client, None, networks=("10.0.0.0/8",), peer="10.9.9.9")
    assert (await inside.get("/admin/status")).status == 200
    outside = await door(aiohttp_client, None, networks=("10.0.0.0/8",), peer="172.16.0.1")
    assert await error_of(await outside.get("/admin/status")) == (
        403,
        "permission_error",
        "address_not_allowed",
    )


async def test_admin_through_a_load_balancer_is_refused_even_from_inside_the_admin_network(
    aiohttp_client: AiohttpClient, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a balancer every client comes from its address; a balancer on the management
    network made /admin/* and the console reachable to any client of it."""
    app = bare_app(peer="10.20.0.5")
    app[appkeys.GENERATIONS] = Running()
    route_all(app, PATHS)
    setup_admin_networks(app, ("10.20.0.0/24",), ("10.20.0.5/32", "10.20.0.6/32"))
    setup_auth(app, keys.path)
    client = await aiohttp_client(app)
    with caplog.at_level(logging.INFO):
        refused = await client.get("/admin/status", headers={"Authorization": keys.bearer("ops")})
        inference = await client.get("/v1/models", headers={"Authorization": keys.bearer("app")})
    assert await error_of(refused) == (403, "permission_error", "address_not_allowed")
    assert (await refused.json())["error"][
        "message"
    ] == "admin endpoints are not reachable through a load balancer"
    assert inference.status == 200  # what the balancer is for
    assert audit_lines(caplog) == [
        AuditLine("WARNING", "admin refused: address in auth.proxy_cidrs", "10.20.0.5", None)
    ]
    # With no admin networks at all, the balancers alone are fenced off.
    only = bare_app(peer="10.20.0.6")
    route_all(only, PATHS)
    setup_admin_networks(only, (), ("10.20.0.5/32", "10.20.0.6/32"))
    assert (await (await aiohttp_client(only)).get("/admin/status")).status == 403
    direct = bare_app(peer="10.20.0.9")
    route_all(direct, PATHS)
    setup_admin_networks(direct, (), ("10.20.0.5/32", "10.20.0.6/32"))
    assert (await (await aiohttp_client(direct)).get("/admin/status")).status == 200


async def test_without_networks_admin_is_reachable_from_anywhere(aiohttp_client: AiohttpClient) -> None:
    app = bare_app(peer="203.0.113.9")
    route_all(app, PATHS)
    before = list(app.middlewares)
    setup_admin_networks(app, [])
    assert list(app.middlewares) == before
    client = await aiohttp_client(app)
    assert (await client.get("/admin/status")).status == 200


def test_a_keys_file_caught_half_written_in_place_revokes_nothing(tmp_path: Path) -> None:
    """An editor or script that truncates the file and writes it again (not a rename) can be
    caught between the two: the empty file must not read as "no keys", which would end every
    running request and drop every tenant's cached state."""
    path = tmp_path / "keys.yaml"
    first_id, _ = create_key(path, "first", ["inference"], limits={})
    second_id, _ = create_key(path, "second", ["inference"], limits={})
    store = KeyStore(path)
    full = path.read_bytes()
    inode = path.stat().st_ino

    with path.open("r+b") as fh:  # truncated in place: the writer has not written yet
        fh.truncate(0)
    assert path.stat().st_ino == inode
    assert not store.reload_if_changed()
    assert store.ids() == {first_id, second_id}

    disabled = yaml.safe_load(full)
    disabled["keys"][0]["disabled"] = True
    with path.open("r+b") as fh:  # the writer finishes, still in place
        fh.write(yaml.safe_dump(disabled).encode())
    assert not store.reload_if_changed()  # changed since the last look: it may still be growing
    assert _in_force(store) == {first_id, second_id}
    assert store.reload_if_changed()  # the same at the next look: settled, read
    assert store.ids() == {first_id, second_id}
    assert _in_force(store) == {second_id}

    tmp = tmp_path / "keys.new"  # a file renamed into place is complete: read at the first look
    tmp.write_bytes(full)
    tmp.chmod(0o600)
    tmp.rename(path)
    assert store.reload_if_changed()
    assert _in_force(store) == {first_id, second_id}


def test_a_keys_file_rewritten_in_place_with_its_size_and_time_kept_is_read_again(tmp_path: Path) -> None:
    """A key's hash changed in place, the file's size and modification time put back as they
    were (`touch -r`, `cp -p`, `rsync --inplace -t`): the file read as unchanged, and the old
    token went on being accepted. Its change time moved, and that is a change."""
    path = tmp_path / "keys.yaml"
    first_id, first = create_key(path, "first", ["inference"], limits={})
    _, other = create_key(tmp_path / "other.yaml", "other", ["inference"], limits={})
    store = KeyStore(path)

    def accepted(token: str) -> bool:
        """Whether the token's secret is the one the first key's hash stands for."""
        parsed, key = parse_token(token), store.get(first_id)
        return parsed is not None and key is not None and hash_secret(parsed[1]) == key.hash

    assert accepted(first)
    assert not accepted(other)
    before = path.stat()
    old_hash = store.get(first_id).hash  # type: ignore[union-attr]
    new_hash = yaml.safe_load((tmp_path / "other.yaml").read_text())["keys"][0]["hash"]
    assert len(new_hash) == len(old_hash) != 0
    time.sleep(0.05)  # a change time of its own (the kernel's clock for it is coarse)
    with path.open("r+b") as fh:
        fh.write(path.read_bytes().replace(old_hash.encode(), new_hash.encode()))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert not store.reload_if_changed()  # changed in place: settled at the next look
    assert store.reload_if_changed()
    assert not accepted(first)
    assert accepted(other)  # the other token's secret is what the first key's hash stands for now


def test_a_keys_file_left_empty_for_a_while_revokes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that truncates in place and pauses longer than one check: the empty file kept
    its size and mtime, was read, and every key was revoked (running streams cut, 401s) until
    the writer came back. A file holding nothing replaces no keys; `keys: []` does."""
    path = tmp_path / "keys.yaml"
    first_id, _ = create_key(path, "first", ["inference"], limits={})
    store = KeyStore(path)
    full = path.read_bytes()
    with path.open("r+b") as fh:
        fh.truncate(0)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):  # settled, looked at again and again
            assert not store.reload_if_changed()
    assert _in_force(store) == {first_id}
    assert "the file holds no list of keys (half-written?)" in caplog.text
    for partial in (b"# only a comment\n", b"keys:\n", b"keys:  # being written\n", b"keys: null\n", b"{}\n"):
        with path.open("r+b") as fh:
            fh.truncate(0)
            fh.write(partial)
        store.reload_if_changed()
        assert not store.reload_if_changed(), partial
        assert _in_force(store) == {first_id}, partial
    with path.open("r+b") as fh:
        fh.truncate(0)
        fh.write(b"keys: []\n")  # said in so many words: none
    store.reload_if_changed()
    assert store.reload_if_changed()
    assert _in_force(store) == set()
    path.write_bytes(full)
    store.reload_if_changed()
    assert store.reload_if_changed()
    assert _in_force(store) == {first_id}


def _in_force(store: KeyStore) -> set[str]:
    return store.in_force(datetime.now(UTC))[0]


def test_a_large_keys_file_is_parsed_off_the_event_loop(tmp_path: Path) -> None:
    """Every change of a keys file of thousands of keys (a console "create key", an
    `edgellmctl keys create`) parsed its YAML on the event loop: seconds in which no request,
    `/healthz` or watchdog ping was answered. The daemon's reload parses it on a thread; the
    loop's longest gap meanwhile is compared with the same parse on the loop, side by side, in
    a fresh interpreter (tests/keys_parse_gap.py: this process, thousands of tests in, held the
    loop most of a second however the parse ran)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.keys_parse_gap", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    pairs = answer["pairs"]
    assert answer["keys"] == 4000
    assert answer["names"] == [f"key 0 ({2 * n + 2})" for n in range(len(pairs))]  # the reload took
    assert all(on > 0.05 for _, on in pairs), f"the parse was too short to show anything: {pairs}"
    # Up to three pairs: on a box busy with other work a thread's parse can still starve the
    # loop once (a gap of a second beside 4.4 s on the loop); a parse on the loop does every time.
    assert pairs[-1][0] < pairs[-1][1] / 4, f"the loop's longest gap (off it, on it), three times: {pairs}"


def test_the_keys_document_is_built_with_the_collector_off_and_on_again_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its node graph set off full collections of the heap on the parsing thread, holding the
    event loop (0.3 s with a heap of a million objects); the collector is off while the YAML
    is built, and on again after, also when the YAML is refused."""
    path = tmp_path / "keys.yaml"
    create_key(path, "first", ["inference"], limits={})
    seen: list[bool] = []
    real = yaml.safe_load

    def watching(text: str) -> object:
        seen.append(gc.isenabled())
        return real(text)

    monkeypatch.setattr(yaml, "safe_load", watching)
    assert gc.isenabled()
    assert len(KeyStore(path)) == 1
    assert seen == [False]
    assert gc.isenabled()
    path.write_text("keys: [unclosed\n")
    path.chmod(0o600)
    with pytest.raises(KeysFileError, match="YAML syntax error"):
        KeyStore(path)
    assert seen == [False, False]
    assert gc.isenabled()
