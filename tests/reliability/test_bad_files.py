"""Bad files while serving: broken model, lock and keys files, a full /dev/shm; precise reports, repair."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
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
def serving(
    box: SignedBox, figures: Figures, *, prefix: Sequence[str] = (), **config: Any
) -> Iterator[DaemonProcess]:
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


def last_reload(
    daemon: DaemonProcess, test: Callable[[dict[str, Any]], bool], what: str, name: str = MODEL
) -> dict[str, Any]:
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
    box: SignedBox, figures: Figures
) -> None:
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
    box: SignedBox, figures: Figures
) -> None:
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


# ---- files that are not regular files ----------------------------------------------------------------
#
# A FIFO put in place of a file the daemon reads made its open() wait for a writer for ever:
# reloads hung, and SIGTERM no longer stopped the daemon (the registry's mutex was held).

STOP_S = 20.0  # SIGTERM to exit, with nothing in flight; a wedged registry never gets there
ANSWER_S = 20.0  # /admin/reload with a tiny model; a blocked open never answers


@contextmanager
def _socket_bound(path: Path) -> Iterator[None]:
    """A Unix socket bound at `path` (by a short relative name: AF_UNIX paths stop at 108 bytes)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = Path.cwd()
    os.chdir(path.parent)
    try:
        sock.bind(path.name)
    finally:
        os.chdir(cwd)
    with sock:
        yield


@contextmanager
def put_in_place(kind: str, path: Path) -> Iterator[str]:
    """Replace `path` with a non-regular file of `kind` (renamed over it where rename allows); its noun."""
    tmp = path.with_name(f".{path.name}.{kind}")
    if kind == "fifo":
        os.mkfifo(tmp, 0o600)
        tmp.rename(path)
        yield "a FIFO"
    elif kind == "character device":
        try:
            os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is: it never ends
        except PermissionError:
            pytest.skip("cannot make a device node here (not root, or no CAP_MKNOD)")
        tmp.rename(path)
        yield "a character device"
    elif kind == "socket":
        with _socket_bound(tmp):
            tmp.rename(path)
            yield "a socket"
    elif kind == "directory":
        tmp.mkdir(mode=0o700)
        path.unlink()  # a directory cannot be renamed over a file
        tmp.rename(path)
        yield "a directory"
    else:
        raise AssertionError(kind)


def timed_admin(daemon: DaemonProcess, method: str, path: str, body: Any = None) -> tuple[Any, float]:
    """An /admin call and the seconds it took; fails (instead of hanging) past ANSWER_S."""
    started = time.monotonic()
    reply = daemon.call(method, path, body, token=daemon.box.admin_token, timeout=ANSWER_S)
    return reply, time.monotonic() - started


def stops_promptly(daemon: DaemonProcess, figures: Figures) -> None:
    """SIGTERM ends the daemon cleanly within STOP_S."""
    started = time.monotonic()
    daemon.send(signal.SIGTERM)
    try:
        status = daemon.wait(STOP_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"SIGTERM did not stop the daemon within {STOP_S} s:\n{daemon.log_tail()}"
        ) from None
    figures["SIGTERM to exit s"] = time.monotonic() - started
    assert status == 0, daemon.log_tail()


@contextmanager
def loaded(daemon: DaemonProcess, figures: Figures) -> Iterator[None]:
    """Light steady load for the body; asserts that no request failed meanwhile."""
    with Load(daemon.url, daemon.box.app_token, 2, lambda _c, _n: completion(8), pause_s=0.02) as load:
        yield
    bad = failures(load.answers)
    figures["requests during the fault / failed"] = (len(load.answers), len(bad))
    assert bad == [], describe(bad)


@pytest.mark.parametrize("kind", ["fifo", "character device", "socket", "directory"])
def test_a_model_file_that_is_not_a_regular_file_is_refused_at_once_and_sigterm_still_stops(
    box: SignedBox, figures: Figures, kind: str
) -> None:
    data = box.model_bytes(STEADY_SPEC)
    version = box.publish(data, file=FILE)
    with DaemonProcess(box, box.config(free_port())) as daemon:
        daemon.start()
        with put_in_place(kind, box.models / FILE) as noun:
            expected = f"file {FILE}: {FILE} is {noun}, not a regular file"
            with loaded(daemon, figures):
                # The watcher sees the change and reloads by itself: refused, the old copy serves.
                model = last_reload(daemon, lambda o: failed(o) and o["reason"] == expected, "the refusal")
                assert model["state"] == "ready"
                assert model["version"] == version
                # An operator's reload answers at once, with the reason; the old version serves on.
                reply, took = timed_admin(daemon, "POST", "/admin/reload", {"force": True})
                figures["reported"] = (reply.status, reply.body["results"][0]["reason"])
                figures["/admin/reload answered in s"] = took
                assert reply.status == 409
                assert reply.body["results"][0]["result"] == "failed"
                assert reply.body["results"][0]["reason"] == expected
                still_serving(daemon, version)
                assert any(expected in m and "previous version keeps serving" in m for m in daemon.errors())
            # With the thing still in place and a reload just refused, SIGTERM stops the daemon.
            stops_promptly(daemon, figures)
    figures.show()


def test_a_signed_entry_with_a_nul_byte_is_refused_with_its_reason_at_reload_and_at_start(
    box: SignedBox, figures: Figures
) -> None:
    data = box.model_bytes(STEADY_SPEC)
    version = box.publish(data, file=FILE)
    good = box.lock.read_bytes()
    expected = f"lockfile refused: models.{MODEL}.file: must not contain control characters"
    with DaemonProcess(box, box.config(free_port())) as daemon:
        daemon.start()
        with loaded(daemon, figures):
            box.sign_lock({MODEL: box.entry(f"{FILE}\x00.txt", data)})  # a signer's tool gone wrong
            model = last_reload(daemon, failed, "the refused lockfile")
            assert model["last_reload"]["reason"] == expected
            reply, took = timed_admin(daemon, "POST", "/admin/reload", {"force": True})
            figures["reported"] = (reply.status, reply.body["results"][0]["reason"])
            figures["/admin/reload answered in s"] = took
            assert reply.status == 409  # was a 500
            assert reply.body["results"][0]["reason"] == expected
            assert daemon.status()["lock"]["version"] == version  # the refused lock moved nothing
            assert box.highest_version() == version
            still_serving(daemon, version)
        stops_promptly(daemon, figures)
    # Starting with it: start-up ends "failed" with the reason, not "loading" for ever.
    with DaemonProcess(box, box.config(free_port()), label="restart") as daemon:
        daemon.start(ready=False)
        model = wait_for(
            lambda: daemon.probe("/readyz") is not None and (m := daemon.model())["state"] != "loading" and m,
            what="the start-up to end",
        )
        figures["at start"] = (model["state"], model["reason"])
        assert model["state"] == "failed"
        assert model["reason"] == expected
        assert daemon.get("/readyz").status == 503
        box.replace(box.lock, good)  # the fix applies without a restart
        wait_for(lambda: daemon.model()["state"] == "ready", what="the recovery")
        stops_promptly(daemon, figures)
    figures.show()


@pytest.mark.parametrize("which", ["lockfile", "trusted key"])
def test_a_fifo_in_place_of_the_lockfile_or_a_trusted_key_is_refused_at_once(
    box: SignedBox, figures: Figures, which: str
) -> None:
    version = box.publish(box.model_bytes(STEADY_SPEC), file=FILE)
    target = box.lock if which == "lockfile" else box.pub
    good = target.read_bytes()
    what = "" if which == "lockfile" else "public key "
    expected = f"lockfile refused: {what}{target} is a FIFO, not a regular file"
    with DaemonProcess(box, box.config(free_port())) as daemon:
        daemon.start()
        with loaded(daemon, figures):
            with put_in_place("fifo", target):
                reply, took = timed_admin(daemon, "POST", "/admin/reload", {"force": True})
                figures["reported"] = (reply.status, reply.body["results"][0]["reason"])
                figures["/admin/reload answered in s"] = took
                assert reply.status == 409
                assert reply.body["results"][0]["reason"] == expected
                still_serving(daemon, version)
                target.unlink()
            box.replace(target, good)
            reply, _ = timed_admin(daemon, "POST", "/admin/reload", {"force": True})
            assert reply.status == 200, reply
            still_serving(daemon, version)
        stops_promptly(daemon, figures)
    figures.show()


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
    box: SignedBox, figures: Figures, damage: str
) -> None:
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
    box: SignedBox, figures: Figures
) -> None:
    box.publish(box.model_bytes(STEADY_SPEC), file=FILE)
    good = box.keys_file.read_bytes()
    with serving(box, figures) as daemon:
        _write_private(box.keys_file, b"keys: [{id: 0123, name: broken\n")
        rejected = wait_for(
            lambda: [m for m in daemon.errors() if "keys file change rejected" in m],
            what="the rejection in the log",
        )
        figures["reported"] = rejected[0]
        assert "the previous 2 key(s) stay in force" in rejected[0]
        assert "YAML syntax error" in rejected[0]
        assert daemon.complete(max_tokens=4).status == 200  # the last good keys still work
        # Fixed: the good keys plus a new one; the new key works within a second, no restart.
        _write_private(box.keys_file, good)
        _, token = create_key(box.keys_file, "late", ["inference"], limits={})
        reply = wait_for(
            lambda: (r := daemon.complete(max_tokens=4, token=token)).status == 200 and r,
            what="the new key to work",
            timeout=5,
        )
        figures["after the fix"] = f"new key answered {reply.status}"
        assert daemon.complete(max_tokens=4).status == 200
        # Loosened permissions are a corruption too: refused, the keys in force stay.
        box.keys_file.chmod(0o644)
        wait_for(lambda: any("chmod 600 it" in m for m in daemon.errors()), what="the mode refusal")
        assert daemon.complete(max_tokens=4, token=token).status == 200
        box.keys_file.chmod(0o600)


def test_a_fifo_in_place_of_the_keys_file_keeps_the_last_good_keys_and_stops_nothing(
    box: SignedBox, figures: Figures
) -> None:
    box.publish(box.model_bytes(STEADY_SPEC), file=FILE)
    good = box.keys_file.read_bytes()
    with DaemonProcess(box, box.config(free_port())) as daemon:
        daemon.start()
        # The keys file is polled from the event loop: a blocked read there would stop every request.
        with loaded(daemon, figures), put_in_place("fifo", box.keys_file):
            rejected = wait_for(
                lambda: [m for m in daemon.errors() if "keys file change rejected" in m],
                what="the rejection in the log",
            )
            figures["reported"] = rejected[0]
            assert rejected[0].endswith(f"{box.keys_file} is a FIFO, not a regular file")
            assert "the previous 2 key(s) stay in force" in rejected[0]
            assert daemon.complete(max_tokens=4).status == 200
        _write_private(box.keys_file, good)
        stops_promptly(daemon, figures)
    # Starting with one: the daemon exits at once (status 1) and the log says why.
    with (
        put_in_place("fifo", box.keys_file),
        DaemonProcess(box, box.config(free_port()), label="restart") as daemon,
    ):
        daemon.start(ready=False)
        try:
            status = daemon.wait(STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"start-up hung on the FIFO:\n{daemon.log_tail()}") from None
        figures["start-up with a FIFO: exit status"] = status
        assert status == 1
        assert f"{box.keys_file} is a FIFO, not a regular file" in daemon.log_tail()
    figures.show()


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
    box: SignedBox, figures: Figures
) -> None:
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
        # The old version's copy is freed once its engine has closed, in the background: wait
        # for that, or the filling below races with it.
        wait_for(
            lambda: any("previous version" in m and "freed" in m for m in daemon.messages()),
            what="the previous version to be freed",
        )

        # Completely full now: what is loaded keeps serving. The old copy's pages go back to the
        # tmpfs once its engine process's memory is torn down, which the kernel may finish a
        # moment after the process was reaped (and the copy unlinked): fill until it stays full.
        def full() -> bool:
            in_mount_namespace(daemon.pid, ["sh", "-c", f"head -c {2**30} /dev/zero >> {filler}; true"])
            time.sleep(0.2)
            return _shm_free(daemon.pid) == 0

        wait_for(full, what="/dev/shm to stay full")
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
    box: SignedBox,
) -> None:
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
