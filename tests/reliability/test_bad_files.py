"""Bad files while serving: broken model, lock and keys files, a full /dev/shm; precise reports, repair."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from edgellmctl.keys import create_key
from tests.reliability.harness import (
    MODEL,
    OTHER_SPEC,
    STEADY_SPEC,
    DaemonProcess,
    Figures,
    Load,
    SignedBox,
    completion,
    describe,
    failures,
    in_mount_namespace,
    obeying_file_modes,
    private_tmpfs,
)
from tests.serving import free_port, wait_for

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

FILE = "model.gguf"


@contextmanager
def serving(box: SignedBox, figures: Figures, *, prefix: Sequence[str] = (),
            **config: Any) -> Iterator[DaemonProcess]:
    """A daemon under light steady load; on leaving, asserts that no request failed meanwhile."""
    with DaemonProcess(box, box.config(free_port(), **config), prefix=prefix) as daemon:
        daemon.start()
        with Load(daemon.url, box.app_token, 2, lambda _c, _n: completion(8), pause_s=0.02) as load:
            yield daemon
        assert daemon.running, daemon.log_tail()
    bad = failures(load.answers)
    figures["requests during the fault / failed"] = (len(load.answers), len(bad))
    figures.show()
    assert bad == [], describe(bad)


def last_reload(daemon: DaemonProcess, test: Callable[[dict[str, Any]], bool], what: str,
                name: str = MODEL) -> dict[str, Any]:
    """The model's last reload outcome once `test` holds for it."""
    found: list[dict[str, Any]] = []

    def check() -> bool:
        model = next(m for m in daemon.status()["models"] if m["name"] == name)
        found[:] = [model]
        return model["last_reload"] is not None and test(model["last_reload"])

    wait_for(check, what=what, timeout=20)
    return found[0]


def still_serving(daemon: DaemonProcess, version: int) -> None:
    """Ready, answering, and from the version that was serving before the fault."""
    assert daemon.get("/readyz").status == 200
    reply = daemon.complete(max_tokens=4)
    assert reply.status == 200, reply
    assert reply.body["system_fingerprint"].startswith(f"edgellm-v{version}-")


def failed(outcome: dict[str, Any]) -> bool:
    return bool(outcome["result"] == "failed")


def recovered(outcome: dict[str, Any]) -> bool:
    return bool(outcome["result"] != "failed")


# ---- model files --------------------------------------------------------------------------------------


def test_a_deleted_model_file_is_reported_the_other_model_reloads_and_restoring_recovers(
        box: SignedBox, figures: Figures) -> None:
    steady, other = box.model_bytes(STEADY_SPEC), box.model_bytes(OTHER_SPEC)
    box.models.joinpath("other.gguf").write_bytes(other)
    box.publish(steady, file=FILE)
    version = box.sign_lock({MODEL: box.entry(FILE, steady), "b": box.entry("other.gguf", other)})
    model_b = {"name": "b", "threads": 1, "context_size": 256, "slots": 1}
    with serving(box, figures, extra_models=[model_b]) as daemon:
        (box.models / FILE).unlink()
        model = last_reload(daemon, failed, "the failed reload")
        reason = model["last_reload"]["reason"]
        figures["reported"] = reason
        assert reason == f"model file not found: {FILE}"
        assert model["state"] == "ready"
        assert model["version"] == version
        still_serving(daemon, version)  # from its preloaded copy
        assert any(reason in m and "previous version keeps serving" in m for m in daemon.errors())
        # What it can: the other model takes a new version meanwhile.
        new_b = box.model_bytes(STEADY_SPEC)
        box.replace(box.models / "b2.gguf", new_b)
        version_b = box.sign_lock({MODEL: box.entry(FILE, steady), "b": box.entry("b2.gguf", new_b)})
        wait_for(lambda: _model(daemon, "b")["version"] == version_b, what="model b's new version")
        assert _model(daemon, MODEL)["last_reload"]["reason"] == reason
        # Putting the file back recovers without a restart, and the report says so.
        box.replace(box.models / FILE, steady)
        model = last_reload(daemon, recovered, "the recovery")
        figures["after the fix"] = model["last_reload"]
        assert model["last_reload"]["reason"] is None
        assert daemon.admin("POST", "/admin/reload", {"model": MODEL, "force": True}).status == 200
        still_serving(daemon, version_b)


def _model(daemon: DaemonProcess, name: str) -> dict[str, Any]:
    entry: dict[str, Any] = next(m for m in daemon.status()["models"] if m["name"] == name)
    return entry


def test_a_model_file_truncated_in_place_is_reported_and_replacing_it_recovers(
        box: SignedBox, figures: Figures) -> None:
    data = box.model_bytes(STEADY_SPEC)
    version = box.publish(data, file=FILE)
    with serving(box, figures) as daemon:
        with (box.models / FILE).open("r+b") as fh:
            fh.truncate(len(data) // 2)
        model = last_reload(daemon, failed, "the failed reload")
        reason = model["last_reload"]["reason"]
        figures["reported"] = reason
        assert reason == f"file {FILE}: {FILE} is {len(data) // 2} bytes; the lockfile says {len(data)}"
        still_serving(daemon, version)
        box.replace(box.models / FILE, data)
        model = last_reload(daemon, recovered, "the recovery")
        figures["after the fix"] = model["last_reload"]
        still_serving(daemon, version)


def test_an_unreadable_model_file_is_reported_and_chmod_recovers(box: SignedBox, figures: Figures) -> None:
    prefix = obeying_file_modes()
    if prefix is None:
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE (no setpriv): a mode means nothing")
    data = box.model_bytes(STEADY_SPEC)
    version = box.publish(data, file=FILE)
    with serving(box, figures, prefix=prefix) as daemon:
        (box.models / FILE).chmod(0)
        # A mode change alters no byte: only a reload that reads the file finds out.
        reply = daemon.admin("POST", "/admin/reload", {"force": True})
        reason = reply.body["results"][0]["reason"]
        figures["reported"] = (reply.status, reason)
        assert reply.status == 409
        assert reason == f"file {FILE}: cannot open {FILE}: Permission denied"
        still_serving(daemon, version)
        (box.models / FILE).chmod(0o644)
        reply = daemon.admin("POST", "/admin/reload", {"force": True})
        figures["after the fix"] = (reply.status, reply.body["results"][0]["result"])
        assert reply.status == 200
        assert reply.body["results"][0]["result"] == "loaded"
        still_serving(daemon, version)


# ---- the lockfile ------------------------------------------------------------------------------------


def test_a_deleted_lockfile_is_reported_and_restoring_it_recovers(box: SignedBox, figures: Figures) -> None:
    version = box.publish(box.model_bytes(STEADY_SPEC), file=FILE)
    good = box.lock.read_bytes()
    with serving(box, figures) as daemon:
        box.lock.unlink()
        model = last_reload(daemon, failed, "the refused lockfile")
        reason = model["last_reload"]["reason"]
        figures["reported"] = reason
        assert reason == f"lockfile refused: cannot read {box.lock}: No such file or directory"
        still_serving(daemon, version)
        box.replace(box.lock, good)
        model = last_reload(daemon, recovered, "the recovery")
        figures["after the fix"] = model["last_reload"]
        assert daemon.status()["lock"]["version"] == version
        still_serving(daemon, version)


@pytest.mark.parametrize("damage", ["garbage", "tampered"])
def test_a_corrupted_lockfile_is_refused_precisely_and_restoring_it_recovers(
        box: SignedBox, figures: Figures, damage: str) -> None:
    version = box.publish(box.model_bytes(STEADY_SPEC), file=FILE)
    good = box.lock.read_bytes()
    if damage == "garbage":
        bad, expected = good[: len(good) // 2], "lockfile refused: not valid JSON: "
    else:  # a higher version without a new signature: what a rollback-guard bypass would try
        doc = json.loads(good)
        doc["version"] = version + 10
        bad = json.dumps(doc).encode()
        expected = "lockfile refused: the lockfile's signature does not verify: it was changed after signing"
    with serving(box, figures) as daemon:
        box.replace(box.lock, bad)
        model = last_reload(daemon, failed, "the refused lockfile")
        reason = model["last_reload"]["reason"]
        figures["reported"] = reason
        assert reason.startswith(expected)
        assert box.highest_version() == version  # a refused lockfile moves no rollback state
        still_serving(daemon, version)
        box.replace(box.lock, good)
        model = last_reload(daemon, recovered, "the recovery")
        figures["after the fix"] = model["last_reload"]
        still_serving(daemon, version)


# ---- the keys file -----------------------------------------------------------------------------------


def test_a_corrupted_keys_file_keeps_the_last_good_keys_and_a_fixed_one_applies(
        box: SignedBox, figures: Figures) -> None:
    box.publish(box.model_bytes(STEADY_SPEC), file=FILE)
    good = box.keys_file.read_bytes()
    with serving(box, figures) as daemon:
        _write_private(box.keys_file, b"keys: [{id: 0123, name: broken\n")
        rejected = wait_for(lambda: [m for m in daemon.errors() if "keys file change rejected" in m],
                            what="the rejection in the log")
        figures["reported"] = rejected[0]
        assert "the previous 2 key(s) stay in force" in rejected[0]
        assert "YAML syntax error" in rejected[0]
        assert daemon.complete(max_tokens=4).status == 200  # the last good keys still work
        # Fixed: the good keys plus a new one; the new key works within a second, no restart.
        _write_private(box.keys_file, good)
        _, token = create_key(box.keys_file, "late", ["inference"], limits={})
        reply = wait_for(lambda: (r := daemon.complete(max_tokens=4, token=token)).status == 200 and r,
                         what="the new key to work", timeout=5)
        figures["after the fix"] = f"new key answered {reply.status}"
        assert daemon.complete(max_tokens=4).status == 200
        # Loosened permissions are a corruption too: refused, the keys in force stay.
        box.keys_file.chmod(0o644)
        wait_for(lambda: any("chmod 600 it" in m for m in daemon.errors()), what="the mode refusal")
        assert daemon.complete(max_tokens=4, token=token).status == 200
        box.keys_file.chmod(0o600)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o600)
    tmp.rename(path)


# ---- /dev/shm full ------------------------------------------------------------------------------------

SHM = Path("/dev/shm")
SHM_MB = 48  # the daemon keeps 16 MiB of a tmpfs free for others; a copy is about 8 MiB


def _shm_free(pid: int) -> int:
    script = "import os; s = os.statvfs('/dev/shm'); print(s.f_bavail * s.f_frsize)"
    return int(in_mount_namespace(pid, [sys.executable, "-c", script]))


def test_a_full_dev_shm_loads_from_the_models_dir_verified_and_preloads_again_once_freed(
        box: SignedBox, figures: Figures) -> None:
    prefix = private_tmpfs(SHM, SHM_MB)
    if prefix is None:
        pytest.skip("cannot mount a private tmpfs on /dev/shm here (unshare/mount not permitted)")
    steady, other = box.model_bytes(STEADY_SPEC), box.model_bytes(OTHER_SPEC)
    box.publish(steady, file=FILE)
    with serving(box, figures, prefix=prefix, lifecycle={"preload_dir": str(SHM / "edgellm")}) as daemon:
        assert daemon.model()["shm_path"] is not None
        # Someone else fills /dev/shm: 4 MiB stay free, not enough for the next copy.
        filler = SHM / "someone-else"
        fill = _shm_free(daemon.pid) - 4 * 2**20
        in_mount_namespace(daemon.pid, ["sh", "-c", f"head -c {fill} /dev/zero > {filler}"])
        figures["free in /dev/shm after filling MiB"] = _shm_free(daemon.pid) / 2**20
        version = box.publish(other, file="other.gguf")
        model = wait_for(lambda: (m := daemon.model())["version"] == version and m, what="the new version")
        warning = [m for m in daemon.messages("warning") if "no room to preload" in m]
        figures["reported"] = warning
        assert warning
        assert model["shm_path"] is None  # loaded from the models directory ...
        assert any("other.gguf verified" in m for m in daemon.messages())  # ... verified all the same
        still_serving(daemon, version)
        # Completely full now: what is loaded keeps serving.
        in_mount_namespace(daemon.pid, ["sh", "-c", f"head -c {2**30} /dev/zero >> {filler}; true"])
        assert _shm_free(daemon.pid) == 0
        time.sleep(0.5)
        still_serving(daemon, version)
        # Freed: the next reload preloads again; no restart.
        in_mount_namespace(daemon.pid, ["rm", "-f", str(filler)])
        reply = daemon.admin("POST", "/admin/reload", {"force": True})
        assert reply.status == 200, reply
        model = daemon.model()
        figures["after the fix"] = model["shm_path"]
        assert model["shm_path"] is not None
        assert model["shm_path"].startswith(str(SHM / "edgellm"))
        still_serving(daemon, version)
    assert not (SHM / "someone-else").exists()  # the machine's own /dev/shm was never filled


def test_a_model_file_truncated_in_place_without_a_preload_copy_does_not_kill_the_daemon(
        box: SignedBox) -> None:
    data = box.model_bytes(STEADY_SPEC)
    box.publish(data, file=FILE)
    config = box.config(free_port(), lifecycle={"preload_dir": None})
    with DaemonProcess(box, config) as daemon:
        daemon.start()
        assert daemon.model()["shm_path"] is None
        with (box.models / FILE).open("r+b") as fh:
            fh.truncate(len(data) // 2)
        time.sleep(0.2)
        answered: list[int | str] = []
        for _ in range(3):
            try:
                answered.append(daemon.complete(max_tokens=4).status)
            except OSError as exc:  # the connection died with the process
                answered.append(f"{type(exc).__name__}")
            time.sleep(0.1)
        exit_status = daemon.returncode
    assert exit_status is None, f"the daemon died with exit status {exit_status}; answers {answered}"
    assert answered == [200, 200, 200]
