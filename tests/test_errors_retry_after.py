"""Retry-After: each value the daemon sends is named once, and every answer of a kind sends the same."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path
from typing import Any, Final

from edgellmd.http.app import create_app
from edgellmd.models.handle import RETRY_AFTER_BUSY_S, RETRY_AFTER_LOADING_S
from tests.serving import settings_for

DAEMON: Final = Path(__file__).resolve().parent.parent / "daemon"
HEADER: Final = "Retry-After"
# Its own rule (a key over its concurrency limit) in the http layer, not the models' wait;
# a literal there is for that module's owner to name.
NOT_YET_NAMED: Final = frozenset({"http/ratelimit.py"})


def _literal_values(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every `{"Retry-After": "<literal>"}` in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == HEADER and isinstance(value, ast.Constant):
                    found.append((node.lineno, str(value.value)))
    return found


def _definitions(path: Path) -> list[str]:
    """Names of the module-level RETRY_AFTER_* constants a module defines."""
    names = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        )
        if isinstance(target, ast.Name) and target.id.startswith("RETRY_AFTER_"):
            names.append(target.id)
    return names


def test_retry_after_values_are_named_constants_not_literals() -> None:
    literals = [
        f"daemon/{p.relative_to(DAEMON)}:{line}: {value!r}"
        for p in sorted(DAEMON.rglob("*.py"))
        if str(p.relative_to(DAEMON)) not in NOT_YET_NAMED
        for line, value in _literal_values(p)
    ]
    assert literals == [], "Retry-After literals (import the constant instead):\n" + "\n".join(literals)


def test_each_retry_after_constant_is_defined_once() -> None:
    defined = [
        (name, str(p.relative_to(DAEMON))) for p in sorted(DAEMON.rglob("*.py")) for name in _definitions(p)
    ]
    names = [name for name, _ in defined]
    assert sorted(names) == sorted(set(names)), defined
    assert {"RETRY_AFTER_LOADING_S", "RETRY_AFTER_BUSY_S"} <= set(names)


async def test_readyz_and_a_request_for_a_model_that_does_not_serve_say_the_same(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = settings_for(
        [{"name": "gone", "file": str(tmp_path / "missing.gguf"), "threads": 1}],
        lifecycle={"preload_dir": None, "watch": False},
    )
    client = await aiohttp_client(create_app(settings))
    deadline = time.monotonic() + 30
    while True:
        ready = await client.get("/readyz")
        if (await ready.json())["status"] != "loading" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert ready.status == 503
    assert ready.headers[HEADER] == RETRY_AFTER_LOADING_S
    answer = await client.post("/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 1})
    assert answer.status == 503
    assert answer.headers[HEADER] == RETRY_AFTER_LOADING_S
    assert RETRY_AFTER_BUSY_S.isdigit()
