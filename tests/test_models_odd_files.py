"""Model files that are not what they claim: a symlink loop, a dangling symlink, a directory.

The second hostile round found a model file made a symlink to itself answered with a 500 and
no audit line by `POST /admin/reload`, an unretrieved task exception on SIGHUP, and a model
stuck in `loading` with no reason at start-up. Each odd file is now the model's failure, with
its reason: 409 and an audit line from the admin API, `failed` at start-up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.ggufmodels import TinyModelSpec
from tests.serving import running, settings_for, wait_for
from tests.test_models_lifecycle import MODEL, Box, model_status


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def _loop(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(path.name)


def _dangling(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("nowhere.gguf")


def _directory(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


def _two_step_loop(path: Path) -> None:
    path.unlink(missing_ok=True)
    other = path.with_name("other.gguf")
    other.symlink_to(path.name)
    path.symlink_to(other.name)


ODD: dict[str, Callable[[Path], None]] = {
    "symlink loop": _loop,
    "two-step symlink loop": _two_step_loop,
    "dangling symlink": _dangling,
    "directory": _directory,
}
REASONS: dict[Callable[[Path], None], str] = {
    _loop: "is a symlink loop",
    _two_step_loop: "is a symlink loop",
    _dangling: "is a symlink to a file that does not exist",
    _directory: "is a directory",
}


@pytest.mark.parametrize("odd", ODD.values(), ids=ODD.keys())
def test_an_odd_file_at_start_up_is_a_failed_model_with_its_reason(
    box: Box, odd: Callable[[Path], None]
) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    odd(box.models / "tiny.gguf")
    with running(box.settings(), wait_ready=False) as daemon:
        wait_for(lambda: model_status(daemon)["state"] == "failed", what="the model to fail")
        shown = model_status(daemon)
        assert shown["reason"]
        assert REASONS[odd] in shown["reason"]
        status, body = daemon.get("/readyz")
        assert status == 503
        assert body["status"] == "failed"
        assert body["models"][MODEL]["reason"] == shown["reason"]


@pytest.mark.parametrize("odd", ODD.values(), ids=ODD.keys())
def test_an_odd_file_on_reload_is_a_409_with_an_audit_line_and_the_old_version_serves(
    box: Box, odd: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    with running(box.settings(watch=False)) as daemon:
        before = model_status(daemon)
        odd(box.models / "tiny.gguf")
        with caplog.at_level(logging.INFO, logger="edgellmd.audit"):
            status, body = daemon.post("/admin/reload", {"force": True})
        assert status == 409, body
        result = body["results"][0]
        assert (result["model"], result["result"]) == (MODEL, "failed")
        assert REASONS[odd] in result["reason"]
        audit = [r for r in caplog.records if r.name == "edgellmd.audit"]
        assert any(f"{MODEL} failed" in r.getMessage() for r in audit), [r.getMessage() for r in audit]
        after = model_status(daemon)
        assert (after["state"], after["sha256"]) == ("ready", before["sha256"])
        assert after["last_reload"]["result"] == "failed"
        # A SIGHUP-style reload (the registry's own, not through HTTP) finishes the same way.
        status, body = daemon.post(f"/admin/models/{MODEL}/load", {})
        assert status in (200, 409)


def test_an_odd_file_seen_by_the_watcher_leaves_the_model_serving(box: Box) -> None:
    data = box.model_bytes(TinyModelSpec(seed=11))
    box.publish({MODEL: ("tiny.gguf", data)})
    with running(box.settings()) as daemon:
        before = model_status(daemon)
        _loop(box.models / "tiny.gguf")
        os.utime(box.models, None)
        status, body = daemon.post("/admin/reload", {})
        assert status == 409, body
        assert model_status(daemon)["sha256"] == before["sha256"]


@pytest.mark.parametrize("odd", ODD.values(), ids=ODD.keys())
def test_an_odd_file_configured_in_unsigned_mode_fails_with_its_reason(
    tmp_path: Path, odd: Callable[[Path], None]
) -> None:
    path = tmp_path / "tiny.gguf"
    odd(path)
    settings = settings_for([{"name": MODEL, "file": str(path), "slots": 1, "threads": 1}])
    with running(settings, wait_ready=False) as daemon:
        wait_for(lambda: model_status(daemon)["state"] == "failed", what="the model to fail")
        reason = model_status(daemon)["reason"]
        assert reason
        assert REASONS[odd] in reason
        status, body = daemon.post(f"/admin/models/{MODEL}/load", {})
        assert status == 409, body
        assert body["results"][0]["reason"]
