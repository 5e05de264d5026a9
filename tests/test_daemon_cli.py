"""The `edgellmd` command line: --check-config and refusing bad configurations before serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgellmd.__main__ import main


def test_check_config_accepts_a_valid_file(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "ok.yaml"
    config.write_text(f"models:\n  - name: tiny\n    file: {tiny_model}\nlock:\n  allow_unsigned: true\n")
    assert main(["--check-config", str(config)]) == 0
    assert "configuration is valid" in capsys.readouterr().out


def test_check_config_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("server:\n  port: http\n  colour: red\nmodels:\n  - name: x\n    slots: 0\n")
    assert main(["--check-config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "server.port:" in err
    assert "server.colour: unknown key" in err
    assert "models[0].file: required" in err
    assert "models[0].slots:" in err
    assert "Traceback" not in err


def test_check_config_on_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check-config", str(tmp_path / "nope.yaml")]) == 1
    err = capsys.readouterr().err
    assert "nope.yaml" in err
    assert "Traceback" not in err


def test_serving_refuses_an_invalid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("models: []\n")
    assert main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert "models:" in err


def test_config_or_check_config_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "--config" in capsys.readouterr().err


def test_the_version_is_written_once_in_pyproject(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib  # noqa: PLC0415 - only this test reads the project file

    from edgellmctl import __version__ as ctl_version  # noqa: PLC0415
    from edgellmd import __version__ as daemon_version  # noqa: PLC0415

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert daemon_version == ctl_version == project["project"]["version"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"edgellmd {project['project']['version']}"


def test_a_fifo_in_place_of_the_config_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os  # noqa: PLC0415 - only this test makes a FIFO

    fifo = tmp_path / "edgellm.yaml"
    os.mkfifo(fifo)  # before: open() waited for a writer, for ever
    assert main(["--check-config", str(fifo)]) == 1
    assert "is a FIFO, not a regular file" in capsys.readouterr().err
