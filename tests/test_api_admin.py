"""setup_admin on a bare application: the /admin routes over a real registry, their answers and audit lines.

The registry is real and loads tiny models with the real engine. Who may reach /admin is
setup_auth's and setup_admin_networks' spec (test_http_auth.py); reloads of a signed lockfile
under load, the memory budget and `edgellmctl` against a whole daemon are in test_lifecycle.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from edgellmctl.keys import create_key
from edgellmd.api.admin import setup_admin
from edgellmd.api.context import API_CONTEXT, ApiContext
from edgellmd.host.cpu import format_cpu_list
from edgellmd.http import appkeys
from edgellmd.http.auth import setup_auth
from tests.bare import AuditLine, api_context, audit_lines, bare_app, error_of, model_settings, not_a_model

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

PEER: Final = "127.0.0.1"


@dataclass
class Admin:
    client: TestClient[Any, Any]
    context: ApiContext
    headers: dict[str, str]  # the operator's key, when the app checks keys

    async def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return await self.client.post(path, json=body, headers=self.headers, **kwargs)

    async def get(self, path: str) -> Any:
        return await self.client.get(path, headers=self.headers)

    def model(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(m for m in self.context.registry.status()["models"] if m["name"] == name)
        return found


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    return not_a_model(tmp_path / "broken.gguf")


@asynccontextmanager
async def serving(
    aiohttp_client: AiohttpClient, models: dict[str, Path], *, keys_file: Path | None = None, token: str = ""
) -> AsyncIterator[Admin]:
    async with api_context([model_settings(name, file) for name, file in models.items()]) as context:
        app = bare_app()
        app[API_CONTEXT] = context
        if keys_file is not None:
            app[appkeys.GENERATIONS] = context.generations
            setup_auth(app, keys_file)
        setup_admin(app)
        client = await aiohttp_client(app)
        yield Admin(client, context, {"Authorization": f"Bearer {token}"} if token else {})


@pytest.fixture
async def admin(aiohttp_client: AiohttpClient, tiny_model: Path) -> AsyncIterator[Admin]:
    """/admin over one loaded model, `tiny`, without keys."""
    async with serving(aiohttp_client, {"tiny": tiny_model}) as found:
        yield found


@pytest.fixture
async def admin_of_two(aiohttp_client: AiohttpClient, tiny_model: Path, broken: Path) -> AsyncIterator[Admin]:
    """/admin over `tiny`, loaded, and `bad`, whose file is no GGUF."""
    async with serving(aiohttp_client, {"tiny": tiny_model, "bad": broken}) as found:
        yield found


ROUTES: Final = [  # method, path, status with the tiny model loaded
    ("GET", "/admin/status", 200),
    ("GET", "/admin/stats", 200),
    ("POST", "/admin/reload", 200),
    ("POST", "/admin/models/tiny/load", 200),
    ("POST", "/admin/models/tiny/unload", 200),
]
WRONG_METHODS: Final = [
    ("POST", "/admin/status"),
    ("POST", "/admin/stats"),
    ("GET", "/admin/reload"),
    ("GET", "/admin/models/tiny/load"),
    ("GET", "/admin/models/tiny/unload"),
]


async def test_routes(admin: Admin) -> None:
    for method, path, status in ROUTES:
        assert (await admin.client.request(method, path)).status == status, (method, path)
    for method, path in WRONG_METHODS:
        response = await admin.client.request(method, path)
        assert await error_of(response) == (405, "invalid_request_error", "method_not_allowed"), path
    for path in ("/admin", "/admin/models/tiny", "/admin/models/tiny/delete"):
        assert await error_of(await admin.client.post(path)) == (404, "invalid_request_error", "not_found")


async def test_status_is_the_registrys(admin: Admin) -> None:
    response = await admin.get("/admin/status")
    body = await response.json()
    assert response.status == 200
    assert body["lock"] == admin.context.registry.status()["lock"]
    assert [(m["name"], m["state"], m["file"]) for m in body["models"]] == [
        ("tiny", "ready", admin.model("tiny")["file"])
    ]


async def test_stats_without_a_gpu_monitor(admin: Admin) -> None:
    response = await admin.get("/admin/stats")
    body = await response.json()
    assert response.status == 200
    assert set(body) == {"metrics", "host", "gpu", "build", "models"}
    assert body["gpu"] == {"available": False, "reason": "not read yet", "devices": [], "verdicts": []}
    assert body["host"]["pinning"] == {
        "cpus": format_cpu_list(frozenset(os.sched_getaffinity(0))),
        "requested": None,
        "pinned": False,
        "note": None,
    }
    assert "edgellm_build_info" in body["metrics"]
    assert [m["name"] for m in body["models"]["models"]] == ["tiny"]


async def test_stats_show_what_the_llama_cpp_build_can_do(admin: Admin) -> None:
    # The CPU build this machine runs: no CUDA backend, no architectures, no offload.
    response = await admin.get("/admin/stats")
    build = (await response.json())["build"]
    assert set(build) == {"backends", "devices", "cuda_archs", "gpu_offload", "system_info", "features"}
    assert build["backends"] == ["CPU"]
    assert build["cuda_archs"] == []
    assert build["gpu_offload"] is False
    assert [(d["name"], d["type"]) for d in build["devices"]] == [("CPU", "cpu")]
    assert build["devices"][0]["memory_total"] > 0
    assert build["system_info"].startswith("CPU : ")
    assert build["features"]["CPU"]


# body (JSON, or raw bytes with a content type) -> status, error type, code, param, message part
RELOAD_BODIES: Final[list[Any]] = [
    pytest.param(None, 200, None, None, None, None, id="no-body"),
    pytest.param({}, 200, None, None, None, None, id="empty-object"),
    pytest.param({"model": "tiny"}, 200, None, None, None, None, id="one-model"),
    pytest.param({"model": "tiny", "force": False}, 200, None, None, None, None, id="not-forced"),
    pytest.param(
        {"models": ["tiny"]},
        400,
        "invalid_request_error",
        None,
        "models",
        "unknown field 'models' (expected model, force)",
        id="unknown-field",
    ),
    pytest.param(
        {"x" * 500: 1},
        400,
        "invalid_request_error",
        None,
        "x" * 64,
        "unknown field 'xxxx",
        id="long-unknown-field",
    ),
    pytest.param(
        {"model": 5},
        400,
        "invalid_request_error",
        None,
        "model",
        "'model' must be a string",
        id="model-not-a-string",
    ),
    pytest.param({"model": None}, 200, None, None, None, None, id="model-null-means-all"),
    pytest.param(
        {"force": "yes"},
        400,
        "invalid_request_error",
        None,
        "force",
        "'force' must be true or false",
        id="force-not-a-bool",
    ),
    pytest.param(
        {"model": "nope"},
        404,
        "invalid_request_error",
        "model_not_found",
        "model",
        "the model 'nope' does not exist",
        id="unknown-model",
    ),
    pytest.param(
        (b"[]", "application/json"),
        400,
        "invalid_request_error",
        None,
        None,
        "the JSON body must be an object",
        id="not-an-object",
    ),
    pytest.param(
        (b"{", "application/json"),
        400,
        "invalid_request_error",
        None,
        None,
        "the body is not valid JSON",
        id="not-json",
    ),
    pytest.param(
        (b"{}", "text/plain"),
        415,
        "invalid_request_error",
        "unsupported_media_type",
        None,
        "must be JSON",
        id="not-declared-json",
    ),
]


@pytest.mark.parametrize(("body", "status", "kind", "code", "param", "message"), RELOAD_BODIES)
async def test_reload_bodies(
    admin: Admin,
    caplog: pytest.LogCaptureFixture,
    body: Any,
    status: int,
    kind: str | None,
    code: str | None,
    param: str | None,
    message: str | None,
) -> None:
    with caplog.at_level(logging.INFO):
        if isinstance(body, tuple):
            response = await admin.client.post(
                "/admin/reload", data=body[0], headers={"Content-Type": body[1]}
            )
        else:
            response = (
                await admin.client.post("/admin/reload", json=body)
                if body is not None
                else await admin.client.post("/admin/reload")
            )
    answer = await response.json()
    if status == 200:
        assert response.status == 200
        assert answer["ok"] is True
        assert [(r["model"], r["result"], r["trigger"]) for r in answer["results"]] == [
            ("tiny", "unchanged", "admin")
        ]
        assert audit_lines(caplog) == [AuditLine("INFO", "admin reload: tiny unchanged", PEER, None)]
        return
    assert await error_of(response) == (status, kind, code)
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"]
    assert audit_lines(caplog) == []  # nothing was done, nothing to audit


async def test_a_forced_reload_builds_a_new_copy(admin: Admin) -> None:
    before = admin.model("tiny")["loaded_at"]
    response = await admin.post("/admin/reload", {"model": "tiny", "force": True})
    assert response.status == 200
    assert [r["result"] for r in (await response.json())["results"]] == ["loaded"]
    assert admin.model("tiny")["loaded_at"] > before


async def test_unload_then_load(admin: Admin) -> None:
    unloaded = await admin.post("/admin/models/tiny/unload")
    assert unloaded.status == 200
    assert [(r["model"], r["result"], r["reason"]) for r in (await unloaded.json())["results"]] == [
        ("tiny", "unloaded", "unloaded by an operator")
    ]
    tiny = admin.model("tiny")
    assert (tiny["state"], tiny["reason"]) == ("unloaded", "unloaded by an operator")
    again = await admin.post("/admin/models/tiny/unload")
    assert again.status == 200  # nothing left to do is no failure
    # A reload of every model leaves an operator's unload alone ...
    everything = await admin.post("/admin/reload")
    assert (everything.status, (await everything.json())["results"]) == (200, [])
    assert admin.model("tiny")["state"] == "unloaded"
    # ... loading it by name brings it back.
    loaded = await admin.post("/admin/models/tiny/load")
    assert loaded.status == 200
    assert [r["result"] for r in (await loaded.json())["results"]] == ["loaded"]
    assert admin.model("tiny")["state"] == "ready"


@pytest.mark.parametrize("action", ["load", "unload"])
async def test_an_unknown_model(admin: Admin, action: str) -> None:
    response = await admin.post(f"/admin/models/nope/{action}")
    assert await error_of(response) == (404, "invalid_request_error", "model_not_found")
    assert (await response.json())["error"]["param"] == "model"


async def test_a_failed_operation_is_a_409_that_says_which(
    admin_of_two: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        load = await admin_of_two.post("/admin/models/bad/load")
        reload = await admin_of_two.post("/admin/reload")
    assert load.status == 409
    body = await load.json()
    assert body["ok"] is False
    assert [(r["model"], r["result"]) for r in body["results"]] == [("bad", "failed")]
    assert "not a supported GGUF model" in body["results"][0]["reason"]
    assert reload.status == 409  # one failure among them is enough; each result says which
    assert [(r["model"], r["result"]) for r in (await reload.json())["results"]] == [
        ("tiny", "unchanged"),
        ("bad", "failed"),
    ]
    assert audit_lines(caplog) == [
        AuditLine("INFO", "admin load: bad failed", PEER, None),
        AuditLine("INFO", "admin reload: tiny unchanged, bad failed", PEER, None),
    ]
    assert admin_of_two.model("tiny")["state"] == "ready"


async def test_each_action_leaves_an_audit_line_naming_the_key(
    aiohttp_client: AiohttpClient, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys.yaml"
    key_id, token = create_key(keys, "ops", ["admin"], limits={})
    async with serving(aiohttp_client, {"tiny": tiny_model}, keys_file=keys, token=token) as admin:
        with caplog.at_level(logging.INFO, logger="edgellmd.audit"):
            for path in ("/admin/status", "/admin/stats"):  # reading is not audited
                assert (await admin.get(path)).status == 200
            assert (await admin.post("/admin/reload")).status == 200
            assert (await admin.post("/admin/models/tiny/unload")).status == 200
            assert (await admin.post("/admin/models/tiny/load")).status == 200
    assert audit_lines(caplog) == [
        AuditLine("INFO", "admin reload: tiny unchanged", PEER, key_id),
        AuditLine("INFO", "admin unload: tiny unloaded", PEER, key_id),
        AuditLine("INFO", "admin load: tiny loaded", PEER, key_id),
    ]
    assert token.split("_", 2)[2] not in caplog.text
