"""No key learns another's prompt through the cache: KV state is reused within one key's scope only.

Key A sends a long system prompt; key B then sends the same prompt: `cached_tokens` is 0
for B (a miss), while A's own repeat reuses its prefix. Tried with the slots' own cached
prefixes and with the host-RAM prompt cache, in an engine process and on the daemon's
threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edgellmctl.keys import create_key
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

SECRET = "Payroll, confidential: " + ", ".join(f"employee {i} earns {1000 + 37 * i}" for i in range(30))


def _ask(daemon: RunningDaemon, token: str, prompt: str) -> dict[str, Any]:
    status, body = daemon.post(
        "/v1/chat/completions",
        {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}],
        },
        headers={"Authorization": f"Bearer {token}"},
    )
    assert status == 200, body
    return dict(body["usage"])


@pytest.mark.parametrize(
    ("isolation", "slots", "prompt_cache_mb"),
    [("process", 2, 0), ("thread", 2, 0), ("process", 2, 64)],
    ids=["slot-prefix-process", "slot-prefix-thread", "prompt-cache"],
)
def test_another_keys_identical_prompt_is_a_cache_miss(
    tmp_path: Path, isolation: str, slots: int, prompt_cache_mb: int
) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=51))
    keys = tmp_path / "keys.yaml"
    _, alice = create_key(keys, "alice", ["inference"], limits={})
    _, bob = create_key(keys, "bob", ["inference"], limits={})
    settings = settings_for(
        [
            {
                "name": "m",
                "file": str(model),
                "threads": 1,
                "slots": slots,
                "context_size": 2048,
                "isolation": isolation,
                "prompt_cache_mb": prompt_cache_mb,
            }
        ],
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        first = _ask(daemon, alice, SECRET)
        assert first["prompt_tokens"] > 300
        if prompt_cache_mb:
            # Push alice's prefix out of both slots: only the prompt cache still holds it.
            for filler in range(slots):
                _ask(daemon, alice, f"something else entirely, number {filler} " * 20)
        guess = _ask(daemon, bob, SECRET)
        assert guess["prompt_tokens_details"]["cached_tokens"] == 0, guess  # a miss, however close
        again = _ask(daemon, alice, SECRET)
        assert again["prompt_tokens_details"]["cached_tokens"] > 300, again  # her own: reused
