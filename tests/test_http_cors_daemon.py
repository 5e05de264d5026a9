"""CORS only for configured origins (preflight before auth), and admin access by network."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgellmctl.keys import create_key
from edgellmd.settings import ConfigError, parse_settings
from tests.serving import RunningDaemon, running, small_tiny

ALLOWED = "https://app.example:8443"


def _request(
    daemon: RunningDaemon, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(daemon.url + path, data=data, headers=headers, method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def browser_daemon(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningDaemon, str]]:
    root = tmp_path_factory.mktemp("cors")
    _, token = create_key(root / "keys.yaml", "web", ["inference", "admin"], limits={})
    settings = parse_settings(
        {
            "server": {"cors_origins": [ALLOWED]},
            "auth": {"keys_file": str(root / "keys.yaml"), "admin_cidrs": ["10.0.0.0/8"]},
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
        },
        base_dir=root,
    )
    with running(settings) as daemon:
        yield daemon, token


def test_preflight_from_an_allowed_origin(browser_daemon: tuple[RunningDaemon, str]) -> None:
    daemon, _ = browser_daemon
    status, headers, _ = _request(
        daemon,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": ALLOWED,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert status == 204  # no credentials needed for a preflight
    assert headers["Access-Control-Allow-Origin"] == ALLOWED
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    assert headers["Vary"] == "Origin"


def test_answers_to_an_allowed_origin_carry_the_header(browser_daemon: tuple[RunningDaemon, str]) -> None:
    daemon, token = browser_daemon
    status, headers, _ = _request(
        daemon,
        "POST",
        "/v1/completions",
        {"Origin": ALLOWED, "Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        {"model": "tiny", "prompt": "x", "max_tokens": 1},
    )
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == ALLOWED
    status, headers, _ = _request(daemon, "GET", "/v1/models", {"Origin": ALLOWED})
    assert status == 401  # CORS is not authentication
    assert headers["Access-Control-Allow-Origin"] == ALLOWED


def test_other_origins_get_no_cors_headers(browser_daemon: tuple[RunningDaemon, str]) -> None:
    daemon, token = browser_daemon
    status, headers, _ = _request(
        daemon,
        "OPTIONS",
        "/v1/chat/completions",
        {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert status in (401, 405)
    assert "Access-Control-Allow-Origin" not in headers
    status, headers, _ = _request(
        daemon, "GET", "/v1/models", {"Origin": "https://evil.example", "Authorization": f"Bearer {token}"}
    )
    assert status == 200
    assert "Access-Control-Allow-Origin" not in headers


def test_admin_is_refused_outside_the_listed_networks(browser_daemon: tuple[RunningDaemon, str]) -> None:
    daemon, token = browser_daemon
    status, _, body = _request(daemon, "GET", "/admin/status", {"Authorization": f"Bearer {token}"})
    error = json.loads(body)["error"]
    assert status == 403  # 127.0.0.1 is not in 10.0.0.0/8, whatever the key
    assert (error["type"], error["code"]) == ("permission_error", "address_not_allowed")


def test_admin_from_a_listed_network_reaches_auth(models_dir: Path, tmp_path: Path) -> None:
    settings = parse_settings(
        {
            "auth": {"keys_file": str(tmp_path / "keys.yaml"), "admin_cidrs": ["127.0.0.0/8"]},
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
        },
        base_dir=tmp_path,
    )
    create_key(tmp_path / "keys.yaml", "ops", ["admin"], limits={})
    with running(settings) as daemon:
        status, _, body = _request(daemon, "GET", "/admin/status", {})
    assert status == 401  # past the network check, stopped by the missing key
    assert json.loads(body)["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"server": {"cors_origins": ["*"]}}, "server.cors_origins[0]"),
        ({"server": {"cors_origins": "https://a.example"}}, "server.cors_origins"),
        ({"auth": {"admin_cidrs": ["10.0.0.0/33"]}}, "auth.admin_cidrs[0]"),
        ({"auth": {"admin_cidrs": ["not-a-network"]}}, "auth.admin_cidrs[0]"),
    ],
)
def test_bad_cors_and_cidr_settings(tmp_path: Path, data: dict[str, Any], where: str) -> None:
    base = {"models": [{"name": "m", "file": "m.gguf"}], "lock": {"allow_unsigned": True}}
    with pytest.raises(ConfigError) as caught:
        parse_settings({**base, **data}, base_dir=tmp_path)
    assert any(p.startswith(where + ":") for p in caught.value.problems), caught.value.problems
