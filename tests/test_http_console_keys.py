"""The console's API keys on a real daemon: list, create, disable, enable, revoke, a read-only keys file."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.keys import read_keys_file
from tests.serving import running
from tests.test_http_console import Box, Browser, _settings


@pytest.fixture(scope="module")
def box(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    keys = tmp_path_factory.mktemp("console-keys") / "keys.yaml"
    _, token = create_key(keys, "operator", ["admin"], limits={})
    with running(_settings(models_dir, keys)) as daemon:
        yield Box(daemon, keys, {"operator": token})


@pytest.fixture
def operator(box: Box) -> Browser:
    browser = box.browser()
    assert browser.sign_in(box.tokens["operator"]).status == 200
    return browser


def _listed(operator: Browser) -> dict[str, dict[str, Any]]:
    return {k["id"]: k for k in operator.request("GET", "/ui/api/keys").json()["keys"]}


def test_a_key_is_created_with_its_token_shown_once(
    box: Box, operator: Browser, capsys: pytest.CaptureFixture[str]
) -> None:
    body = {
        "name": "app-b",
        "scopes": ["inference", "metrics"],
        "expires_days": 30,
        "limits": {"rpm": 60, "max_tokens": 256},
    }
    created = operator.request("POST", "/ui/api/keys", body).json()
    token, key = created["token"], created["key"]
    assert token.startswith(f"elk_{key['id']}_")
    assert key["scopes"] == ["inference", "metrics"]
    assert key["limits"] == {"rpm": 60, "max_tokens": 256}
    assert key["state"] == "active"
    assert key["expires"] is not None
    assert key["created"] is not None
    stored = box.keys.read_text()
    assert token.split("_", 2)[2] not in stored  # only its hash
    assert os.stat(box.keys).st_mode & 0o777 == 0o600
    listing = operator.request("GET", "/ui/api/keys")
    assert token not in listing.body.decode()
    assert "sha256:" not in listing.body.decode()
    assert listing.json()["writable"] is True
    assert read_keys_file(box.keys)[key["id"]].limits.rpm == 60  # a file the daemon and the CLI read
    assert edgellmctl(["keys", "list", "--file", str(box.keys)]) == 0
    assert "app-b" in capsys.readouterr().out
    answer = box.browser().request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert answer.status == 200  # in force before the console answered


def test_disable_enable_and_revoke(box: Box, operator: Browser) -> None:
    created = operator.request("POST", "/ui/api/keys", {"name": "tmp", "scopes": ["inference"]}).json()
    key_id, token = created["key"]["id"], created["token"]
    bearer = {"Authorization": f"Bearer {token}"}
    assert operator.request("POST", f"/ui/api/keys/{key_id}/disable", {}).status == 200
    assert _listed(operator)[key_id]["state"] == "disabled"
    assert box.browser().request("GET", "/v1/models", headers=bearer).status == 401
    assert operator.request("POST", f"/ui/api/keys/{key_id}/enable", {}).status == 200
    assert box.browser().request("GET", "/v1/models", headers=bearer).status == 200
    assert operator.request("POST", f"/ui/api/keys/{key_id}/revoke", {}).status == 200
    assert key_id not in _listed(operator)
    assert key_id not in yaml.safe_load(box.keys.read_text())["keys"].__repr__()
    assert box.browser().request("GET", "/v1/models", headers=bearer).status == 401
    for verb in ("disable", "enable", "revoke"):
        answer = operator.request("POST", f"/ui/api/keys/{key_id}/{verb}", {})
        assert (answer.status, answer.code) == (404, "key_not_found")
    assert operator.request("POST", "/ui/api/keys/NOT-AN-ID/revoke", {}).status == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"scopes": ["inference"]}, "name"),
        ({"name": "", "scopes": ["inference"]}, "name"),
        ({"name": "x" * 65, "scopes": ["inference"]}, "name"),
        ({"name": "bell\x07", "scopes": ["inference"]}, "name"),
        ({"name": "a", "scopes": []}, "scopes"),
        ({"name": "a", "scopes": ["root"]}, "scopes"),
        ({"name": "a", "scopes": "inference"}, "scopes"),
        ({"name": "a", "scopes": ["inference"], "limits": {"rpm": 0}}, "limits.rpm"),
        ({"name": "a", "scopes": ["inference"], "limits": {"rpm": True}}, "limits.rpm"),
        ({"name": "a", "scopes": ["inference"], "limits": {"burst": 3}}, "limits"),
        ({"name": "a", "scopes": ["inference"], "expires_days": 0}, "expires_days"),
        ({"name": "a", "scopes": ["inference"], "expires_days": 10**6}, "expires_days"),
        ({"name": "a", "scopes": ["inference"], "hash": "sha256:" + "0" * 64}, "hash"),
    ],
)
def test_a_bad_new_key_is_refused_and_nothing_is_written(
    box: Box, operator: Browser, body: dict[str, Any], param: str
) -> None:
    before = box.keys.read_bytes()
    answer = operator.request("POST", "/ui/api/keys", body)
    assert answer.status == 400
    assert answer.json()["error"]["param"] == param
    assert box.keys.read_bytes() == before


def test_a_keys_file_the_daemon_may_not_write_is_said_plainly(
    box: Box, operator: Browser, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Root in a container passes every permission check, and mounting a read-only file system
    # needs privileges a test should not use: the two system calls answer as a read-only mount
    # (ProtectSystem=strict) makes them answer.
    def read_only(*_args: Any, **_kwargs: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("edgellmd.keys.tempfile.mkstemp", read_only)
    monkeypatch.setattr("edgellmd.http.console.keys.os.statvfs", read_only)
    caplog.set_level(logging.DEBUG)
    before = box.keys.read_bytes()
    listing = operator.request("GET", "/ui/api/keys").json()
    assert listing["writable"] is False
    assert listing["keys"]  # still listed
    answer = operator.request("POST", "/ui/api/keys", {"name": "nope", "scopes": ["inference"]})
    assert (answer.status, answer.code) == (403, "keys_file_read_only")
    message = answer.json()["error"]["message"]
    assert "Read-only file system" in message
    assert "README" in message
    operator_id = next(iter(listing["keys"]))["id"]
    assert operator.request("POST", f"/ui/api/keys/{operator_id}/disable", {}).code == "keys_file_read_only"
    assert box.keys.read_bytes() == before
    assert not [r for r in caplog.records if r.exc_info]  # refused, not crashed: no traceback logged
    assert "console key change refused: KeysFileNotWritable" in caplog.text


def test_the_cli_still_writes_through_the_shared_helpers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    key_id, token = create_key(path, "cli", ["inference"], limits={"rpm": 5}, expires_in="2d")
    assert edgellmctl(["keys", "revoke", key_id, "--file", str(path)]) == 0
    assert read_keys_file(path)[key_id].disabled
    assert edgellmctl(["keys", "revoke", "000000000000", "--file", str(path)]) == 1
    assert "no key with id '000000000000'" in capsys.readouterr().err
    assert token not in path.read_text()
    assert path.read_text().startswith("# edgellm API keys")
