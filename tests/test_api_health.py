"""setup_health on a bare application: /healthz, /readyz over a real registry's states, and /metrics.

The registry is real and loads tiny models with the real engine; a model whose file is not a
GGUF fails to load as it would in production. Whether the probes need a key is setup_auth's
spec (test_http_auth.py); the whole daemon's probes are in test_api_openai.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import pytest
from pytest_aiohttp import AiohttpClient

from edgellmd.api.context import API_CONTEXT
from edgellmd.api.health import setup_health
from tests.bare import api_context, bare_app, error_of, model_settings, not_a_model

BROKEN_REASON: Final = "not a supported GGUF model?"


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    return not_a_model(tmp_path / "broken.gguf")


async def test_healthz_needs_nothing_but_a_running_loop(aiohttp_client: AiohttpClient) -> None:
    app = bare_app()  # no API context: liveness must not depend on the models
    setup_health(app)
    client = await aiohttp_client(app)
    response = await client.get("/healthz")
    assert (response.status, await response.json()) == (200, {"status": "ok"})
    assert (await client.head("/healthz")).status == 200
    assert await error_of(await client.post("/healthz")) == (
        405,
        "invalid_request_error",
        "method_not_allowed",
    )


# models (name -> "tiny" or "broken"), whether the registry starts, models unloaded afterwards
# -> status, the body's "status", each model's entry
READINESS: Final[list[Any]] = [
    pytest.param({"tiny": "tiny"}, False, (), 503, "loading", {"tiny": {"state": "loading"}}, id="loading"),
    pytest.param({"tiny": "tiny"}, True, (), 200, "ready", {"tiny": {"state": "ready"}}, id="ready"),
    pytest.param(
        {"a": "tiny", "b": "tiny"},
        True,
        (),
        200,
        "ready",
        {"a": {"state": "ready"}, "b": {"state": "ready"}},
        id="all-ready",
    ),
    pytest.param({"bad": "broken"}, True, (), 503, "failed", {"bad": {"state": "failed"}}, id="failed"),
    pytest.param(
        {"tiny": "tiny", "bad": "broken"},
        True,
        (),
        503,
        "failed",
        {"tiny": {"state": "ready"}, "bad": {"state": "failed"}},
        id="one-failed",
    ),
    pytest.param(
        {"tiny": "tiny"},
        True,
        ("tiny",),
        503,
        "unloaded",
        {"tiny": {"state": "unloaded", "reason": "unloaded by an operator"}},
        id="all-unloaded",
    ),
    # An operator's unload is no fault: the rest still serves, the box is ready.
    pytest.param(
        {"a": "tiny", "b": "tiny"},
        True,
        ("b",),
        200,
        "ready",
        {"a": {"state": "ready"}, "b": {"state": "unloaded", "reason": "unloaded by an operator"}},
        id="one-unloaded",
    ),
]


@pytest.mark.parametrize(("models", "start", "unload", "status", "overall", "states"), READINESS)
async def test_readyz_table(
    aiohttp_client: AiohttpClient,
    tiny_model: Path,
    broken: Path,
    models: dict[str, str],
    start: bool,
    unload: tuple[str, ...],
    status: int,
    overall: str,
    states: dict[str, dict[str, str]],
) -> None:
    files = {"tiny": tiny_model, "broken": broken}
    async with api_context(
        [model_settings(name, files[kind]) for name, kind in models.items()], start=start
    ) as context:
        for name in unload:
            await context.registry.unload(name)
        app = bare_app()
        app[API_CONTEXT] = context
        setup_health(app)
        client = await aiohttp_client(app)
        response = await client.get("/readyz")
        body = await response.json()
    assert response.status == status
    assert response.headers.get("Retry-After") == (None if status == 200 else "5")
    assert body["status"] == overall
    reasons = {
        name: entry.pop("reason") for name, entry in body["models"].items() if entry["state"] == "failed"
    }
    assert body["models"] == states
    assert all(BROKEN_REASON in reason for reason in reasons.values()), reasons


async def test_metrics_renders_the_applications_metrics(
    aiohttp_client: AiohttpClient, tiny_model: Path
) -> None:
    async with api_context([model_settings("tiny", tiny_model)], start=False) as context:
        context.metrics.prompt_tokens.labels("tiny", "tiny").inc(3)
        app = bare_app()
        app[API_CONTEXT] = context
        setup_health(app)
        client = await aiohttp_client(app)
        response = await client.get("/metrics")
        text = await response.text()
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'edgellm_prompt_tokens_total{model="tiny",model_name="tiny"} 3.0' in text.splitlines()
    assert "edgellm_build_info{" in text
