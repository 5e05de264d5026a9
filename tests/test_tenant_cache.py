"""No key learns another's prompt through the cache: KV state is reused within one key's scope only.

Key A sends a long system prompt; key B then sends the same prompt: `cached_tokens` is 0
for B (a miss), while A's own repeat reuses its prefix. Tried with the slots' own cached
prefixes and with the host-RAM prompt cache, in an engine process and on the daemon's
threads.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from edgellmctl.keys import create_key
from edgellmd.keys import KeysFileError, read_keys_file
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, running, settings_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

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


def test_keys_of_one_cache_group_share_their_prompts_state_and_no_one_else(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=52))
    keys = tmp_path / "keys.yaml"
    _, app1 = create_key(keys, "team-app-1", ["inference"], limits={}, cache_group="team")
    _, app2 = create_key(keys, "team-app-2", ["inference"], limits={}, cache_group="team")
    _, outsider = create_key(keys, "outsider", ["inference"], limits={})
    model_settings = {"name": "m", "file": str(model), "threads": 1, "slots": 3, "context_size": 2048}
    settings = settings_for([model_settings], auth={"keys_file": str(keys)})
    with running(settings) as daemon:
        _ask(daemon, app1, SECRET)
        assert _ask(daemon, outsider, SECRET)["prompt_tokens_details"]["cached_tokens"] == 0
        shared = _ask(daemon, app2, SECRET)  # the other app of the team: the team's state
        assert shared["prompt_tokens_details"]["cached_tokens"] > 300, shared


def test_a_cache_group_must_be_a_plain_name(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    with pytest.raises(KeysFileError):
        create_key(keys, "odd", ["inference"], limits={}, cache_group="team/../other")
    create_key(keys, "fine", ["inference"], limits={}, cache_group="team-1.a")
    data = yaml.safe_load(keys.read_text())
    data["keys"][0]["cache_group"] = "x" * 65
    keys.write_text(yaml.safe_dump(data))
    with pytest.raises(KeysFileError, match="cache_group"):
        read_keys_file(keys)


def _set_disabled(keys: Path, key_id: str, disabled: bool) -> None:
    data = yaml.safe_load(keys.read_text())
    for entry in data["keys"]:
        if entry["id"] == key_id:
            entry["disabled"] = disabled
    keys.write_text(yaml.safe_dump(data))


def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_disabled_keys_cached_state_and_stored_responses_are_dropped(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=53))
    keys = tmp_path / "keys.yaml"
    alice_id, alice = create_key(keys, "alice", ["inference"], limits={})
    team_id, team1 = create_key(keys, "team-1", ["inference"], limits={}, cache_group="team")
    _, team2 = create_key(keys, "team-2", ["inference"], limits={}, cache_group="team")
    model_settings = {
        "name": "m",
        "file": str(model),
        "threads": 1,
        "slots": 2,
        "context_size": 2048,
        "prompt_cache_mb": 64,
    }
    settings = settings_for([model_settings], auth={"keys_file": str(keys)})
    auth = {"Authorization": f"Bearer {alice}"}
    with running(settings) as daemon:
        _ask(daemon, alice, SECRET)
        _ask(daemon, team1, "Team notes: " + SECRET)
        for filler in range(2):  # both slots now hold other prompts: alice's lives in the cache too
            _ask(daemon, alice, f"something else entirely, number {filler} " * 20)
        _ask(daemon, alice, SECRET)  # and in a slot again
        status, stored = daemon.post(
            "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}, headers=auth
        )
        assert status == 200, stored
        assert _get(daemon, f"/v1/responses/{stored['id']}", alice)[0] == 200

        _set_disabled(keys, alice_id, True)
        _set_disabled(keys, team_id, True)
        _until(lambda: _get(daemon, "/v1/models", alice)[0] == 401)
        time.sleep(1.5)  # the keys watch's next pass has dropped what was kept for them
        _set_disabled(keys, alice_id, False)
        _until(lambda: _get(daemon, "/v1/models", alice)[0] == 200)

        again = _ask(daemon, alice, SECRET)
        assert again["prompt_tokens_details"]["cached_tokens"] == 0, again  # neither slot nor cache
        assert _get(daemon, f"/v1/responses/{stored['id']}", alice)[0] == 404
        # team-2 is still in force: the team's shared state stays.
        shared = _ask(daemon, team2, "Team notes: " + SECRET)
        assert shared["prompt_tokens_details"]["cached_tokens"] > 300, shared


def _get(daemon: RunningDaemon, path: str, token: str) -> tuple[int, Any]:
    request = urllib.request.Request(daemon.url + path, headers={"Authorization": f"Bearer {token}"})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback URL
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
