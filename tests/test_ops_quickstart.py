"""`edgellmctl quickstart` on the real demo model: argument types, failures in one line, the keys it makes."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgellmctl.__main__ import main
from edgellmd.keys import parse_token, read_keys_file
from edgellmd.settings import load_settings

pytestmark = pytest.mark.demo

DEMO_FILE = "gemma-3-270m-q4_k_m.gguf"


@dataclass(frozen=True, slots=True)
class Result:
    """Exit status and captured output of one `edgellmctl` run."""

    status: int
    out: str
    err: str


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> Result:
    capsys.readouterr()
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return Result(status, captured.out, captured.err)


def check_config(directory: Path) -> None:
    """The config quickstart wrote is one the daemon takes."""
    config = directory / "edgellm.yaml"
    checked = subprocess.run(
        [sys.executable, "-m", "edgellmd", "--check-config", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr


def assert_one_line(result: Result) -> None:
    assert result.status == 1, result
    assert result.err.startswith("edgellmctl quickstart: ")
    assert result.err.endswith("\n")
    assert result.err.count("\n") == 1, result.err
    assert "Traceback" not in result.err


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, assembled once for the module."""
    directory = tmp_path_factory.mktemp("installed")
    assert main(["quickstart", "--dir", str(directory)]) == 0
    return directory / "models" / DEMO_FILE


@pytest.fixture
def fresh(tmp_path: Path, installed: Path) -> Path:
    """A directory to set up whose models/ already holds the demo model (a hard link: no copy)."""
    directory = tmp_path / "qs"
    (directory / "models").mkdir(parents=True)
    os.link(installed, directory / "models" / DEMO_FILE)
    return directory


# ---- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--port", "0", "argument --port: must be an integer in 1..65535, got 0"),
        ("--port", "65536", "argument --port: must be an integer in 1..65535, got 65536"),
        ("--port", "http", "argument --port: must be an integer in 1..65535, got 'http'"),
        ("--slots", "0", "argument --slots: must be an integer >= 1, got 0"),
        ("--slots", "two", "argument --slots: must be an integer >= 1, got 'two'"),
        ("--context", "63", "argument --context: must be an integer >= 64, got 63"),
    ],
)
def test_bad_numbers_are_argument_errors(
    option: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["quickstart", "--dir", str(tmp_path / "qs"), option, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "usage: edgellmctl quickstart" in err
    assert err.endswith(f"edgellmctl quickstart: error: {message}\n")
    assert not (tmp_path / "qs").exists()  # refused before anything was written


# ---- failures: one line, exit 1, and a second run that works ---------------------------------


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (["--slots", "100000"], "models[0].slots"),
        (["--host", "a b"], "server.host"),
    ],
)
def test_a_config_the_daemon_would_refuse_is_never_written(
    extra: list[str], problem: str, fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "quickstart", "--dir", fresh, *extra)
    assert_one_line(result)
    assert "the config would be invalid: " in result.err
    assert problem in result.err
    assert not (fresh / "edgellm.yaml").exists()
    assert [p.name for p in fresh.iterdir() if p.name.startswith(".")] == []


def _file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("in the way\n")


def _directory(path: Path) -> None:
    path.mkdir(parents=True)


# (what is in the way, how it gets there, extra options, a word the message must hold)
OBSTACLES: list[tuple[str, Callable[[Path], None], list[str], str]] = [
    (".", _file, [], "qs"),  # --dir names a regular file
    ("models", _file, [], "models"),
    ("keys", _file, [], "keys"),
    ("keys/signing.pem", _directory, [], "signing.pem"),
    ("models.lock", _directory, [], "models.lock"),
    ("keys.yaml", _directory, [], "keys.yaml"),
    ("admin.key", _directory, [], "admin.key"),
    ("tls", _file, ["--tls"], "tls"),
    ("tls/cert.pem", _directory, ["--tls"], "cert.pem"),
    ("tls/key.pem", _directory, ["--tls"], "key.pem"),
    ("edgellm.yaml", _directory, ["--force"], "edgellm.yaml"),
]


@pytest.mark.parametrize(
    ("where", "make", "extra", "named"), [pytest.param(*o, id=o[0].replace("/", "-")) for o in OBSTACLES]
)
def test_a_path_in_the_way_is_one_line_and_a_second_run_works(
    where: str,
    make: Callable[[Path], None],
    extra: list[str],
    named: str,
    tmp_path: Path,
    installed: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = tmp_path / "qs"
    if where not in (".", "models"):
        (directory / "models").mkdir(parents=True)
        os.link(installed, directory / "models" / DEMO_FILE)
    obstacle = directory / where
    make(obstacle)
    result = run(capsys, "quickstart", "--dir", directory, *extra)
    assert_one_line(result)
    assert named in result.err
    if where != "edgellm.yaml":
        assert not (directory / "edgellm.yaml").exists()  # the config comes last, or not at all
    # Once the obstacle is gone, the same command succeeds: nothing half-written trips it.
    if obstacle.is_dir():
        shutil.rmtree(obstacle)
    else:
        obstacle.unlink()
    result = run(capsys, "quickstart", "--dir", directory, *extra)
    assert result.status == 0, result.err
    check_config(directory)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory all the same")
def test_an_unwritable_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.chmod(0o500)
    try:
        result = run(capsys, "quickstart", "--dir", tmp_path / "qs")
    finally:
        tmp_path.chmod(0o700)
    assert_one_line(result)
    assert "Permission denied" in result.err


def _file_size_limit(limit: int) -> Callable[[], None]:
    """preexec_fn: files may grow to `limit` bytes; a write past it fails with EFBIG (a full disk's kin)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _limited_quickstart(directory: Path, limit: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgellmctl", "quickstart", "--dir", str(directory)],
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=_file_size_limit(limit),
    )


def test_a_write_error_while_installing_the_model_leaves_nothing_a_second_run_trips_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "qs"
    failed = _limited_quickstart(directory, 1 << 20)
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.startswith("edgellmctl quickstart: ")
    assert failed.stderr.count("\n") == 1, failed.stderr
    assert "File too large" in failed.stderr
    assert not (directory / "models" / DEMO_FILE).exists()  # no half a model under its name
    assert os.listdir(directory / "models") == []  # and no temporary file left behind
    result = run(capsys, "quickstart", "--dir", directory)
    assert result.status == 0, result.err
    check_config(directory)


def test_a_write_error_on_the_config_leaves_no_config(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The keys file and the signed lock are ~500 and ~650 bytes; the config is ~1000.
    failed = _limited_quickstart(fresh, 800)
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.startswith("edgellmctl quickstart: ")
    assert failed.stderr.count("\n") == 1, failed.stderr
    assert "edgellm.yaml" in failed.stderr
    assert "File too large" in failed.stderr
    assert not (fresh / "edgellm.yaml").exists()
    assert [p.name for p in fresh.iterdir() if p.name.startswith(".")] == []
    result = run(capsys, "quickstart", "--dir", fresh)
    assert result.status == 0, result.err
    check_config(fresh)


def test_a_model_file_that_is_not_the_demo_model_is_named_with_what_to_do(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = fresh / "models" / DEMO_FILE
    model.unlink()
    model.write_bytes(b"GGUF half a model")
    result = run(capsys, "quickstart", "--dir", fresh)
    assert_one_line(result)
    assert f"{model} is not the demo model" in result.err
    assert "remove it" in result.err


# ---- API keys -------------------------------------------------------------------------------


def test_the_admin_key_reads_metrics_and_the_inference_key_only_infers(fresh: Path) -> None:
    assert main(["quickstart", "--dir", str(fresh)]) == 0
    keys = read_keys_file(fresh / "keys.yaml")
    scopes = {}
    for name in ("inference", "admin"):
        parsed = parse_token((fresh / f"{name}.key").read_text().strip())
        assert parsed is not None
        scopes[name] = keys[parsed[0]].scopes
    assert scopes == {"inference": {"inference"}, "admin": {"admin", "metrics", "inference"}}
    settings = load_settings(fresh / "edgellm.yaml")
    assert settings.auth.metrics_public is False  # the key is needed
    # The console is on, for this machine only, and the admin key can use its playground.
    assert settings.console.enabled is True
    assert settings.auth.admin_cidrs == ("127.0.0.0/8", "::1/128")


def test_a_second_run_keeps_good_tokens_and_replaces_broken_ones(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "quickstart", "--dir", fresh).status == 0
    inference = (fresh / "inference.key").read_text()
    (fresh / "admin.key").write_text("")  # as a run cut short before this fix left it
    assert run(capsys, "quickstart", "--dir", fresh, "--force").status == 0
    assert (fresh / "inference.key").read_text() == inference
    parsed = parse_token((fresh / "admin.key").read_text().strip())
    assert parsed is not None
    keys = read_keys_file(fresh / "keys.yaml")
    assert keys[parsed[0]].scopes == {"admin", "metrics", "inference"}
    assert (fresh / "admin.key").stat().st_mode & 0o777 == 0o600


def test_an_admin_key_from_an_older_quickstart_gains_the_metrics_and_inference_scopes(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "quickstart", "--dir", fresh).status == 0
    token = (fresh / "admin.key").read_text()
    parsed = parse_token(token.strip())
    assert parsed is not None
    text = (fresh / "keys.yaml").read_text()
    (fresh / "keys.yaml").write_text(text.replace("  - admin\n  - inference\n  - metrics\n", "  - admin\n"))
    assert read_keys_file(fresh / "keys.yaml")[parsed[0]].scopes == {"admin"}
    assert run(capsys, "quickstart", "--dir", fresh, "--force").status == 0
    assert (fresh / "admin.key").read_text() == token  # the same key, now with the scopes
    assert read_keys_file(fresh / "keys.yaml")[parsed[0]].scopes == {"admin", "metrics", "inference"}


# ---- lock verify --config -------------------------------------------------------------------


def test_lock_verify_with_the_config_checks_the_signature_and_the_model(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "quickstart", "--dir", fresh).status == 0
    result = run(capsys, "lock", "verify", "--config", fresh / "edgellm.yaml")
    assert result.status == 0, result.out + result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("lock      version 1: signature by ")
    assert "verifies; expires " in lines[0]
    assert lines[1].startswith(f"gemma3-270m ok: {DEMO_FILE} ")


def test_lock_verify_of_a_quickstart_lock_without_trusted_keys_verifies_no_signature(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "quickstart", "--dir", fresh).status == 0
    result = run(capsys, "lock", "verify", "--lock", fresh / "models.lock", "--models-dir", fresh / "models")
    assert result.status == 1
    assert "no signature verified" in result.out.splitlines()[0]
    assert result.out.splitlines()[1].startswith("gemma3-270m ok: ")
