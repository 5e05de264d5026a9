"""setup_health on a bare application: /healthz, /readyz over a real registry's states, and /metrics.

The registry is real and loads tiny models with the real engine; a model whose file is not a
GGUF fails to load as it would in production. Whether the probes need a key is setup_auth's
spec (test_http_auth.py); the whole daemon's probes are in test_api_openai.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest
from pytest_aiohttp import AiohttpClient

from edgellmd.__main__ import drain
from edgellmd.api.context import API_CONTEXT
from edgellmd.api.health import public, setup_health
from tests.bare import api_context, bare_app, error_of, model_settings, not_a_model
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import running, settings_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

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
    # The probe is public: a reason names the file, never where the box keeps it.
    assert not any(str(broken.parent) in reason for reason in reasons.values()), reasons
    assert all(broken.name in reason for reason in reasons.values()), reasons


@pytest.mark.parametrize(
    ("reason", "shown"),
    [
        ("could not load /dev/shm/edgellm/tiny-3f2a.gguf (bad)", "could not load tiny-3f2a.gguf (bad)"),
        ("mmproj p: file /srv/models/p.gguf: missing", "mmproj p: file p.gguf: missing"),
        ("file models/x.gguf: sha256 differs", "file models/x.gguf: sha256 differs"),  # relative: as it is
        (
            "fetched from https://host.example/a/b",
            "fetched from https://host.example/a/b",
        ),  # no path of the box
        ("'/etc/edgellm/keys.yaml' is not a regular file", "'keys.yaml' is not a regular file"),
    ],
)
def test_a_public_reason_names_files_without_their_folders(reason: str, shown: str) -> None:
    assert public(reason) == shown


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


def test_readyz_says_draining_from_the_moment_a_shutdown_begins(tmp_path: Path) -> None:
    """The daemon's own drain (what SIGTERM runs): the probe turns 503 `draining` at once, on a
    connection a balancer holds open, while the stream that was running finishes."""
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "slots": 1, "context_size": 512}]
    )
    with running(settings) as daemon:
        assert daemon.app is not None
        assert daemon._runner is not None
        app, runner = daemon.app, daemon._runner

        async def scenario() -> tuple[int, dict[str, Any], str]:
            # The balancer's connection, its own session: the stream must not take it from the pool.
            async with aiohttp.ClientSession() as balancer, aiohttp.ClientSession() as session:
                async with balancer.get(daemon.url + "/readyz") as probe:
                    assert probe.status == 200
                body = {"model": "m", "prompt": "x", "max_tokens": 300, "stream": True, "ignore_eos": True}
                async with session.post(daemon.url + "/v1/completions", json=body) as stream:
                    await stream.content.readline()  # it runs
                    drained = asyncio.wrap_future(
                        asyncio.run_coroutine_threadsafe(drain(app, runner, 30), daemon.loop)
                    )
                    await asyncio.sleep(0.2)
                    async with balancer.get(daemon.url + "/readyz") as probe:  # the idle kept-alive one
                        status, shown = probe.status, await probe.json()
                    rest = (await stream.read()).decode()
                await drained
                return status, shown, rest

        status, shown, rest = asyncio.run(scenario())
    assert status == 503, shown
    assert shown["status"] == "draining"
    assert shown["models"]["m"]["state"] == "ready"  # the model still serves what it holds
    assert rest.rstrip().endswith("data: [DONE]")  # the running stream finished
