"""API keys: the table of requests and keys, audit lines without secrets, hot reload, the keys CLI."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmd.keys import KeysFileError, parse_keys, read_keys_file
from edgellmd.settings import ConfigError, parse_settings
from tests.serving import RunningDaemon, running, small_tiny

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

PROMPT_CANARY = "canary-prompt-7f3a"


@dataclass
class Keys:
    path: Path
    tokens: dict[str, str]  # label -> token
    ids: dict[str, str]


def _edit(path: Path, key_id: str, **fields: Any) -> None:
    data = yaml.safe_load(path.read_text())
    for entry in data["keys"]:
        if entry["id"] == key_id:
            entry.update(fields)
    path.write_text(yaml.safe_dump(data))
    os.chmod(path, 0o600)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    path = tmp_path_factory.mktemp("auth") / "keys.yaml"
    tokens: dict[str, str] = {}
    ids: dict[str, str] = {}
    for label, scopes in [
        ("inference", ["inference"]),
        ("admin", ["admin"]),
        ("expired", ["inference"]),
        ("disabled", ["inference"]),
        ("revoked", ["inference"]),
        ("metrics", ["metrics"]),
    ]:
        ids[label], tokens[label] = create_key(path, label, scopes, limits={})
    _edit(path, ids["expired"], expires="2020-01-01T00:00:00Z")
    _edit(path, ids["disabled"], disabled=True)
    assert edgellmctl(["keys", "revoke", ids["revoked"], "--file", str(path)]) == 0
    return Keys(path, tokens, ids)


@pytest.fixture(scope="module")
def guarded(keys: Keys, models_dir: Path) -> Iterator[RunningDaemon]:
    settings = parse_settings(
        {
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
            "auth": {"keys_file": str(keys.path)},
            "logging": {"level": "debug"},
        },
        base_dir=keys.path.parent,
    )
    with running(settings) as daemon:
        yield daemon


def _malformed(_: Keys) -> str:
    return "Bearer sk-not-an-edgellm-key"


def _wrong_secret(k: Keys) -> str:
    return "Bearer " + k.tokens["inference"][:-4] + "AAAA"


def _bearer(label: str) -> Any:
    return lambda k: f"Bearer {k.tokens[label]}"


ROWS: list[tuple[str, Any, int, str | None]] = [
    ("none", lambda k: None, 401, "authentication_error"),
    ("malformed", _malformed, 401, "authentication_error"),
    ("basic-scheme", lambda k: "Basic dXNlcjpwYXNz", 401, "authentication_error"),
    ("wrong-secret", _wrong_secret, 401, "authentication_error"),
    ("unknown-id", lambda k: "Bearer elk_0123456789ab_" + "x" * 43, 401, "authentication_error"),
    ("expired", _bearer("expired"), 401, "authentication_error"),
    ("disabled", _bearer("disabled"), 401, "authentication_error"),
    ("revoked", _bearer("revoked"), 401, "authentication_error"),
    ("wrong-scope", _bearer("admin"), 403, "permission_error"),
    ("metrics-scope-only", _bearer("metrics"), 403, "permission_error"),
    ("right-scope", _bearer("inference"), 200, None),
]


@pytest.mark.parametrize(
    ("header", "status", "error_type"), [pytest.param(h, s, t, id=i) for i, h, s, t in ROWS]
)
def test_request_key_table(
    guarded: RunningDaemon,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
    header: Any,
    status: int,
    error_type: str | None,
) -> None:
    value = header(keys)
    headers = {"Authorization": value} if value else {}
    with caplog.at_level(logging.DEBUG):
        got, body = guarded.post(
            "/v1/completions", {"model": "tiny", "prompt": PROMPT_CANARY, "max_tokens": 2}, headers=headers
        )
        time.sleep(0.05)  # the daemon logs from its own thread
    assert got == status, body
    logged = "\n".join(r.getMessage() + repr(vars(r)) for r in caplog.records)
    assert PROMPT_CANARY not in logged, "prompts never reach a log line"
    audit = [r for r in caplog.records if r.name == "edgellmd.audit"]
    if error_type is None:
        assert body["usage"]["completion_tokens"] >= 1
        assert audit == []
        return
    assert body["error"]["type"] == error_type
    assert audit, "every refusal leaves an audit line"
    assert getattr(audit[-1], "peer", None) == "127.0.0.1"
    for label, token in keys.tokens.items():
        secret = token.split("_", 2)[2]  # elk_<id>_<secret>; the secret itself may hold "_"
        assert len(secret) >= 40
        leaks = [
            (r.name, r.getMessage()[:200]) for r in caplog.records if secret in r.getMessage() + repr(vars(r))
        ]
        assert not leaks, f"the {label} key's secret reached a log line: {leaks}"


def test_audit_line_names_the_key_id_when_parseable(
    guarded: RunningDaemon, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        guarded.post(
            "/v1/completions",
            {"model": "tiny", "prompt": "x"},
            headers={"Authorization": f"Bearer {keys.tokens['admin']}"},
        )
        time.sleep(0.05)
    audit = [r for r in caplog.records if r.name == "edgellmd.audit"]
    assert getattr(audit[-1], "key_id", None) == keys.ids["admin"]


def test_unauthorized_answers_carry_www_authenticate(guarded: RunningDaemon) -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(guarded.url + "/v1/models", timeout=5)  # noqa: S310 - loopback
    with caught.value:
        assert caught.value.code == 401
        assert caught.value.headers["WWW-Authenticate"] == "Bearer"


def test_probes_stay_public(guarded: RunningDaemon) -> None:
    assert guarded.get("/healthz")[0] == 200
    assert guarded.get("/readyz")[0] == 200


def _wait_for(condition: Any, timeout: float = 2.0) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
    return time.monotonic() - started


def test_keys_file_hot_reload(models_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    first_id, first = create_key(path, "first", ["inference"], limits={})
    settings = parse_settings(
        {
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
            "auth": {"keys_file": str(path)},
        },
        base_dir=tmp_path,
    )
    with running(settings) as daemon:

        def status(token: str) -> int:
            return daemon.post(
                "/v1/completions",
                {"model": "tiny", "prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer {token}"},
            )[0]

        assert status(first) == 200
        _, second = create_key(path, "second", ["inference"], limits={})
        assert _wait_for(lambda: status(second) == 200) < 2.0
        assert edgellmctl(["keys", "revoke", first_id, "--file", str(path)]) == 0
        assert _wait_for(lambda: status(first) == 401) < 2.0
        # A corrupt file changes nothing: the last good keys stay in force.
        good = path.read_text()
        path.write_text("keys: [this is: not valid")
        os.chmod(path, 0o600)
        time.sleep(1.0)
        assert status(second) == 200
        assert status(first) == 401
        path.write_text(good.replace("second", "second-renamed"))
        os.chmod(path, 0o600)
        assert _wait_for(lambda: status(second) == 200) < 2.0


def test_non_loopback_without_keys_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.host: '0\.0\.0\.0' is not a loopback address"):
        parse_settings(
            {
                "server": {"host": "0.0.0.0"},
                "models": [{"name": "m", "file": "m.gguf"}],
                "lock": {"allow_unsigned": True},
            },
            base_dir=tmp_path,
        )
    parse_settings(
        {
            "server": {"host": "0.0.0.0"},
            "models": [{"name": "m", "file": "m.gguf"}],
            "lock": {"allow_unsigned": True},
            "auth": {"keys_file": "k.yaml"},
        },
        base_dir=tmp_path,
    )
    parse_settings(
        {
            "server": {"host": "::1"},
            "models": [{"name": "m", "file": "m.gguf"}],
            "lock": {"allow_unsigned": True},
        },
        base_dir=tmp_path,
    )


def test_keys_cli_create_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.yaml"
    assert (
        edgellmctl(
            [
                "keys",
                "create",
                "--file",
                str(path),
                "--name",
                "app",
                "--scope",
                "inference",
                "--rpm",
                "60",
                "--tpm",
                "1000",
                "--concurrent",
                "2",
                "--max-tokens",
                "256",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    token = out.strip()
    assert token.startswith("elk_")
    assert "shown once" in err
    assert path.stat().st_mode & 0o777 == 0o600
    stored = path.read_text()
    assert token not in stored
    assert token.split("_", 2)[2] not in stored
    key = next(iter(read_keys_file(path).values()))
    limits = key.limits
    assert (limits.rpm, limits.tpm, limits.concurrent, limits.max_tokens) == (60, 1000, 2, 256)
    assert edgellmctl(["keys", "list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    assert key.id in listing
    assert "rpm=60" in listing
    assert "sha256" not in listing
    assert token.split("_", 2)[2] not in listing
    assert edgellmctl(["keys", "revoke", key.id, "--file", str(path)]) == 0
    assert read_keys_file(path)[key.id].disabled
    assert edgellmctl(["keys", "revoke", "ffffffffffff", "--file", str(path)]) == 1
    assert "no key with id" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--name", "\x1b[31mred\x1b[0m"],  # a terminal escape, printed by `keys list`
        ["--name", "a\n06180332bdd5  admin-forged  admin"],  # a forged row of the table
        ["--name", "\u202eevil"],
        ["--name", "x" * 65],
        ["--name", "app", "--rpm", "9" * 23],  # the console's ceiling: 1,000,000,000
        ["--name", "app", "--max-tokens", "1000000001"],
    ],
)
def test_keys_cli_refuses_what_the_console_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    path = tmp_path / "keys.yaml"
    with pytest.raises(SystemExit) as exc:
        edgellmctl(["keys", "create", "--file", str(path), "--scope", "inference", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgellmctl keys create: error: argument"), err
    assert "\x1b" not in err[-1]
    assert "\u202e" not in err[-1]
    assert not path.exists()


def test_keys_list_refuses_a_hand_edited_name_that_is_not_printable_without_echoing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon refuses such a file (a name is shown to operators: a bidi override or an
    escape sequence in it could pose as other text); the CLI says where, never the name."""
    path = tmp_path / "keys.yaml"
    create_key(path, "app", ["inference"], limits={})
    path.write_text(path.read_text().replace("name: app", 'name: "a\\nb\\e[31m"'))
    assert edgellmctl(["keys", "list", "--file", str(path)]) == 1
    captured = capsys.readouterr()
    assert "keys[0].name: must be printable" in captured.err
    assert "\x1b" not in captured.out + captured.err
    assert "[31m" not in captured.out + captured.err


def test_keys_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    create_key(path, "a", ["inference"], limits={})
    os.chmod(path, 0o644)
    with pytest.raises(KeysFileError, match="chmod 600"):
        read_keys_file(path)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"keys": [{"id": "xyz"}]}, "keys[0].id"),
        (
            {"keys": [{"id": "0123456789ab", "name": "a", "hash": "plain-secret", "scopes": ["inference"]}]},
            "keys[0].hash",
        ),
        (
            {"keys": [{"id": "0123456789ab", "name": "a", "hash": "sha256:" + "0" * 64, "scopes": ["root"]}]},
            "keys[0].scopes",
        ),
        (
            {
                "keys": [
                    {
                        "id": "0123456789ab",
                        "name": "a",
                        "hash": "sha256:" + "0" * 64,
                        "scopes": ["admin"],
                        "limits": {"rpm": 0},
                    }
                ]
            },
            "keys[0].limits.rpm",
        ),
        (
            {
                "keys": [
                    {
                        "id": "0123456789ab",
                        "name": "a",
                        "hash": "sha256:" + "0" * 64,
                        "scopes": ["admin"],
                        "colour": "red",
                    }
                ]
            },
            "keys[0].colour",
        ),
        ({"other": []}, "one member, 'keys'"),
        *(
            (
                {
                    "keys": [
                        {
                            "id": "0123456789ab",
                            "name": name,
                            "hash": "sha256:" + "0" * 64,
                            "scopes": ["admin"],
                        }
                    ]
                },
                "keys[0].name: must be printable",
            )
            for name in ("ops-eve \u202e", "a\u2066b", "tab\tname", "nul\x00", "zero\u200bwidth")
        ),
    ],
)
def test_malformed_keys_files_name_the_field(data: dict[str, Any], where: str) -> None:
    with pytest.raises(KeysFileError) as caught:
        parse_keys(data)
    assert where in str(caught.value)


@pytest.mark.parametrize(
    ("public", "label", "status"),
    [
        (False, None, 401),
        (False, "inference", 403),
        (False, "metrics", 200),
        (True, None, 200),
    ],
)
def test_metrics_needs_its_scope_unless_public(
    models_dir: Path, tmp_path: Path, public: bool, label: str | None, status: int
) -> None:
    path = tmp_path / "keys.yaml"
    tokens = {name: create_key(path, name, [name], limits={})[1] for name in ("inference", "metrics")}
    settings = parse_settings(
        {
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
            "auth": {"keys_file": str(path), "metrics_public": public},
        },
        base_dir=tmp_path,
    )
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    with running(settings) as daemon:
        headers = {"Authorization": f"Bearer {tokens[label]}"} if label else {}
        req = urllib.request.Request(daemon.url + "/metrics", headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=5) as answer:  # noqa: S310 - loopback
                code, body = answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            with exc:
                code, body = exc.code, exc.read()
        assert code == status
        assert (b"edgellm_build_info" in body) == (status == 200)
