"""Tests for the front door's server settings: per-stage deadlines and the per-client connection cap."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from edgellmd.settings import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    ConfigError,
    ServerSettings,
    parse_settings,
)

CONFIGURATION = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _parse(server: dict[str, Any] | None) -> ServerSettings:
    data = {
        "server": server,
        "models": [{"name": "tiny", "file": "tiny.gguf"}],
        "lock": {"allow_unsigned": True},
    }
    return parse_settings(data, base_dir=Path("/srv")).server


def _problems(server: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        _parse(server)
    return caught.value.problems


def test_defaults() -> None:
    server = _parse(None)
    assert server.header_timeout_s == DEFAULT_HEADER_TIMEOUT_S == 10.0
    assert server.body_timeout_s == DEFAULT_BODY_TIMEOUT_S == 30.0
    assert server.keepalive_timeout_s == DEFAULT_KEEPALIVE_TIMEOUT_S == 75.0
    assert server.max_connections == DEFAULT_MAX_CONNECTIONS == 1024
    assert server.max_connections_per_client == DEFAULT_MAX_CONNECTIONS_PER_CLIENT == 256
    # One client may hold a fraction of the whole: the rest stays for everybody else.
    assert DEFAULT_MAX_CONNECTIONS_PER_CLIENT < DEFAULT_MAX_CONNECTIONS


def test_values_are_read() -> None:
    server = _parse(
        {
            "header_timeout_s": 2,
            "body_timeout_s": 0.5,
            "keepalive_timeout_s": 600,
            "max_connections": 50,
            "max_connections_per_client": 1,
        }
    )
    assert (server.header_timeout_s, server.body_timeout_s, server.keepalive_timeout_s) == (2.0, 0.5, 600.0)
    assert (server.max_connections, server.max_connections_per_client) == (50, 1)
    # Above the global cap is allowed: the global cap is then the one that bites.
    above = _parse({"max_connections": 10, "max_connections_per_client": 100})
    assert above.max_connections_per_client == 100


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ({"body_timeout_s": 0}, "server.body_timeout_s: must be a finite number > 0, got 0"),
        ({"body_timeout_s": -1}, "server.body_timeout_s: must be a finite number > 0, got -1"),
        ({"body_timeout_s": "30s"}, "server.body_timeout_s: must be a finite number > 0, got '30s'"),
        ({"body_timeout_s": True}, "server.body_timeout_s: must be a finite number > 0, got True"),
        ({"body_timeout_s": float("inf")}, "server.body_timeout_s: must be a finite number > 0, got inf"),
        ({"keepalive_timeout_s": 0}, "server.keepalive_timeout_s: must be a finite number > 0, got 0"),
        ({"keepalive_timeout_s": None}, "server.keepalive_timeout_s: must be a finite number > 0, got None"),
        ({"header_timeout_s": -0.5}, "server.header_timeout_s: must be a finite number > 0, got -0.5"),
        (
            {"max_connections_per_client": 0},
            "server.max_connections_per_client: must be an integer from 1 to 1000000, got 0",
        ),
        (
            {"max_connections_per_client": 1.5},
            "server.max_connections_per_client: must be an integer from 1 to 1000000, got 1.5",
        ),
        (
            {"max_connections_per_client": True},
            "server.max_connections_per_client: must be an integer from 1 to 1000000, got True",
        ),
        (
            {"max_connections_per_client": 1_000_001},
            "server.max_connections_per_client: must be an integer from 1 to 1000000, got 1000001",
        ),
        (
            {"max_connections_per_client": "64"},
            "server.max_connections_per_client: must be an integer from 1 to 1000000, got '64'",
        ),
    ],
)
def test_bad_values_name_the_key(server: dict[str, Any], problem: str) -> None:
    assert _problems(server) == [problem]


def test_every_problem_is_reported_at_once() -> None:
    problems = _problems({"body_timeout_s": 0, "keepalive_timeout_s": "x", "max_connections_per_client": 0})
    assert [p.split(":")[0] for p in problems] == [
        "server.body_timeout_s",
        "server.keepalive_timeout_s",
        "server.max_connections_per_client",
    ]


def _shown(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "null" if value is None else str(value)


@pytest.mark.parametrize(
    "field",
    [
        "header_timeout_s",
        "body_timeout_s",
        "keepalive_timeout_s",
        "max_connections",
        "max_connections_per_client",
    ],
)
def test_the_configuration_page_documents_each_front_door_key_with_its_default(field: str) -> None:
    readme = CONFIGURATION.read_text(encoding="utf-8")
    default = next(f.default for f in dataclasses.fields(ServerSettings) if f.name == field)
    assert f"| `server.{field}` | `{_shown(default)}` |" in readme
    assert re.search(rf"^  {field}: {re.escape(_shown(default))} +#", readme, re.MULTILINE), field
