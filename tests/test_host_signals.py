"""Signal routing of the daemon: stop and reload into the loop, then ignored until the process exits."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgellmd.__main__ import EARLY_SIGNALS
from edgellmd.host.signals import RELOAD_SIGNAL, STOP_SIGNALS, Signals
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.test_host_systemd import Proc, start_daemon

ALL = (*STOP_SIGNALS, RELOAD_SIGNAL)


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    """Put pytest's own handlers back whatever a test installs."""
    saved = {signum: signal.getsignal(signum) for signum in ALL}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


async def test_stop_and_reload_reach_the_loop_then_are_ignored(saved_handlers: None) -> None:
    del saved_handlers
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    woke = asyncio.Event()

    def note(what: str) -> None:
        seen.append(what)
        woke.set()

    signals = Signals(loop, on_stop=lambda: note("stop"), on_reload=lambda: note("reload"))
    signals.attach()
    try:
        cases = ((signal.SIGHUP, "reload"), (signal.SIGTERM, "stop"), (signal.SIGINT, "stop"))
        for signum, expected in cases:
            woke.clear()
            os.kill(os.getpid(), signum)
            await asyncio.wait_for(woke.wait(), 5)
            assert seen[-1] == expected
    finally:
        signals.detach()
    assert all(signal.getsignal(signum) == signal.SIG_IGN for signum in ALL)
    os.kill(os.getpid(), signal.SIGTERM)  # ignored by the kernel: this process lives on
    await asyncio.sleep(0.05)
    assert seen == ["reload", "stop", "stop"]


async def test_a_signal_on_another_thread_wakes_an_idle_loop(saved_handlers: None) -> None:
    """A worker thread signals itself while the loop sits in its selector; only the wakeup
    descriptor can end that wait before the 5 s timer (measured without it: the full timer)."""
    del saved_handlers
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    signals = Signals(loop, on_stop=stopped.set, on_reload=lambda: None)
    signals.attach()
    sent: list[float] = []

    def worker() -> None:
        time.sleep(0.2)  # the main thread is parked in the selector by now
        sent.append(time.monotonic())
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        await asyncio.wait_for(stopped.wait(), 5)
        assert time.monotonic() - sent[0] < 1.0
    finally:
        thread.join(5)
        signals.detach()


@pytest.mark.slow
def test_repeated_sigterm_while_stopping_still_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM every few milliseconds from the first until the process is gone: exit 0, nothing left in shm.

    Before the handlers outlived the event loop, every such run ended by the signal (-15) in
    the interpreter's teardown, after "edgellmd stopped".
    """
    model = write_tiny_model(tmp_path / "small.gguf", TinyModelSpec(seed=22, n_embd=256, n_ff=1024))
    daemon = start_daemon(tmp_path, model, {}, shutdown_timeout_s=1)
    deadline = time.monotonic() + 60
    while daemon.get("/readyz")[0] != 200:
        assert time.monotonic() < deadline, daemon.log.read_text()
        assert daemon.proc.poll() is None, daemon.log.read_text()
        time.sleep(0.05)
    assert any(daemon.shm.glob("edgellmd-*/*.gguf"))
    sent = 0
    deadline = time.monotonic() + 60
    while daemon.proc.poll() is None:
        assert time.monotonic() < deadline
        daemon.proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.002)
    log = daemon.log.read_text()
    assert daemon.proc.returncode == 0, log
    assert sent > 1
    assert "edgellmd stopped" in log
    assert "Traceback" not in log
    assert not list(daemon.shm.glob("edgellmd-*"))


def _masks(pid: int, *fields: str) -> list[int]:
    """Process `pid`'s signal masks of these /proc status fields ("SigCgt:", "SigBlk:")."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return []
    return [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(fields)]


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    return any(mask & (1 << (signum - 1)) for mask in _masks(pid, "SigCgt:"))


def _until_ready(daemon: Proc, interval: float = 0.05) -> None:
    """Until /readyz answers 200, the process alive all along."""
    deadline = time.monotonic() + 60
    while daemon.get("/readyz")[0] != 200:
        assert daemon.proc.poll() is None, daemon.log.read_text()
        assert time.monotonic() < deadline
        time.sleep(interval)


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.15, 0.3, 0.6])
def test_sigterm_in_the_first_moments_of_start_up_is_a_clean_stop(tmp_path: Path, delay_s: float) -> None:
    """A SIGTERM while the process imports, reads its config or loads: exit 0, never 143.

    Before the handlers were installed first, a signal in the first half second killed the
    process by its default action (exit status -15 here, 143 in a shell). What is left is the
    interpreter's own start, before any of edgellmd's code runs (about 80 ms on this
    machine): the test starts counting once the process catches SIGTERM.
    """
    model = write_tiny_model(tmp_path / "early.gguf", TinyModelSpec(seed=23))
    daemon = start_daemon(tmp_path, model, {})
    deadline = time.monotonic() + 30
    while not _catches(daemon.proc.pid, signal.SIGTERM):
        assert daemon.proc.poll() is None, daemon.log.read_text()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(delay_s)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0, daemon.log.read_text()
    assert not list(daemon.shm.glob("edgellmd-*/*.gguf"))


@pytest.mark.slow
def test_sighup_in_the_first_moments_of_start_up_does_not_kill(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "early.gguf", TinyModelSpec(seed=24))
    daemon = start_daemon(tmp_path, model, {})
    try:
        deadline = time.monotonic() + 30
        while not _catches(daemon.proc.pid, signal.SIGHUP):
            assert daemon.proc.poll() is None, daemon.log.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for _ in range(5):
            daemon.proc.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        _until_ready(daemon)
    finally:
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0, daemon.log.read_text()


# The command systemd runs (the console script beside this interpreter), not `python -m`.
COMMAND = [str(Path(sys.executable).with_name("edgellmd"))]


def _holds(pid: int, signum: int) -> bool:
    """Whether process `pid` blocks or catches `signum` (SigBlk, SigCgt in /proc)."""
    return any(mask & (1 << (signum - 1)) for mask in _masks(pid, "SigBlk:", "SigCgt:"))


def _honoured(daemon: Proc, signum: int) -> None:
    """SIGTERM: a clean stop, nothing left behind. SIGHUP: the daemon lives on and serves."""
    try:
        if signum == signal.SIGTERM:
            assert daemon.proc.wait(60) == 0, daemon.log.read_text()
            assert not list(daemon.shm.glob("edgellmd-*/*.gguf"))
            return
        _until_ready(daemon, 0.02)
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0, daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text()


@pytest.fixture(scope="module")
def early_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("early") / "early.gguf", TinyModelSpec(seed=25))


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.05, 0.2])
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_a_signal_held_by_the_launcher_is_honoured_at_any_moment_after_exec(
    tmp_path: Path, early_model: Path, delay_s: float, signum: int
) -> None:
    """Started with its stop and reload signals blocked (a launcher's mask survives exec), the
    daemon takes a signal sent at once, 10, 50 or 200 ms after exec as its own: none is the
    default action that killed it in the first 200 ms before."""
    daemon = start_daemon(tmp_path, early_model, {}, command=COMMAND, held=EARLY_SIGNALS)
    time.sleep(delay_s)
    daemon.proc.send_signal(signum)
    _honoured(daemon, signum)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_the_command_holds_its_signals_from_its_first_line(
    tmp_path: Path, early_model: Path, signum: int
) -> None:
    """Plain exec: the interpreter's own start is the only window (about 30 ms here). From the
    moment the process holds the signal it is honoured, and 200 ms after exec it always is."""
    daemon = start_daemon(tmp_path, early_model, {}, command=COMMAND)
    started = time.monotonic()
    deadline = started + 30
    while not _holds(daemon.proc.pid, signum):
        assert daemon.proc.poll() is None, daemon.log.read_text()
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    window = time.monotonic() - started
    daemon.proc.send_signal(signum)  # at once: blocked, not yet caught
    _honoured(daemon, signum)
    (tmp_path / "late").mkdir()
    late = start_daemon(tmp_path / "late", early_model, {}, command=COMMAND)
    time.sleep(max(0.2, window))
    late.proc.send_signal(signum)
    _honoured(late, signum)
