"""Revocation bites at once: a revoked or disabled key's running streams end, its waiting requests go."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.keys import RELOAD_INTERVAL_S
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import running, settings_for, sse_events

SLOW = TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)


async def _stream(
    session: aiohttp.ClientSession, url: str, token: str, started: asyncio.Event, max_tokens: int = 3000
) -> dict[str, Any]:
    body = {"model": "m", "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    out: dict[str, Any] = {"tokens": 0, "error": None, "done": False, "status": None}
    async with session.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as resp:
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = (await resp.json())["error"]
            return out
        async for chunk in sse_events(resp.content):
            if chunk is None:
                out["done"] = True
                break
            if "error" in chunk:
                out["error"] = chunk["error"]
                out["ended_at"] = time.monotonic()
                continue
            out["tokens"] += 1
            started.set()
    return out


@pytest.mark.slow
def test_revoking_a_key_ends_its_streams_and_queued_requests_only(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "slow.gguf", SLOW)
    keys = tmp_path / "keys.yaml"
    victim_id, victim = create_key(keys, "victim", ["inference"], limits={})
    _, bystander = create_key(keys, "bystander", ["inference"], limits={})
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "slots": 2, "context_size": 4096, "queue_size": 4}],
        server={"max_tokens_limit": 4000},
        auth={"keys_file": str(keys)},
    )

    async def scenario(url: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], float]:
        async with aiohttp.ClientSession() as session:
            started = asyncio.Event()
            running_one = asyncio.create_task(_stream(session, url, victim, started))
            other = asyncio.create_task(_stream(session, url, bystander, asyncio.Event(), max_tokens=200))
            await asyncio.wait_for(started.wait(), 30)
            queued = asyncio.create_task(_stream(session, url, victim, asyncio.Event()))  # no slot left
            await asyncio.sleep(0.3)
            assert edgellmctl(["keys", "revoke", "--file", str(keys), victim_id]) == 0
            revoked_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(running_one, queued, other), 60)
            return results[0], results[1], results[2], revoked_at

    with running(settings) as daemon:
        first, waiting, bystanding, revoked_at = asyncio.run(scenario(daemon.url))
        assert first["error"]["code"] == "invalid_api_key", first
        assert first["error"]["type"] == "authentication_error"
        assert first["done"]  # the stream still ends properly, with [DONE]
        assert first["tokens"] < 3000
        assert first["ended_at"] - revoked_at < RELOAD_INTERVAL_S + 1.5
        assert waiting["error"] is not None, waiting
        assert waiting["error"]["code"] == "invalid_api_key", waiting
        assert bystanding["error"] is None, bystanding
        assert bystanding["done"], bystanding
        status, body = daemon.post(
            "/v1/completions",
            {"model": "m", "prompt": "x", "max_tokens": 1},
            headers={"Authorization": f"Bearer {victim}"},
        )
        assert status == 401, body
