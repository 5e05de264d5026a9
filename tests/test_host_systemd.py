"""systemd integration of a real edgellmd process: notify messages, watchdog pings, SIGTERM drain."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edgellmd.host.systemd import Notifier
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import free_port, sse_events_sync

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

WATCHDOG_USEC = 1_000_000  # systemd's smallest sensible value: a ping every 0.5 s
# Eight wide layers and a 2000-token prompt in one chunk: a single llama_decode that takes
# seconds on one thread, which is what a hung scheduler looks like from outside.
STALL_SPEC = TinyModelSpec(seed=21, n_embd=512, n_head=8, n_head_kv=8, n_layer=8, n_ff=2048)


@dataclass
class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's."""

    path: Path
    sock: socket.socket = field(init=False)
    messages: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def fields(self) -> list[str]:
        return [line for _, m in self.messages for line in m.split("\n")]

    def times(self, field_: str) -> list[float]:
        return [t for t, m in self.messages if field_ in m.split("\n")]

    def wait_for(self, field_: str, timeout: float = 60.0, after: float = 0.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t in self.times(field_) if t > after]
            if hits:
                return hits[0]
            time.sleep(0.02)
        raise AssertionError(f"no {field_!r} within {timeout}s; got {self.fields()}")


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    port: int
    shm: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:  # noqa: S310 - loopback
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)
        except OSError:
            return 0, None

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(  # noqa: S310
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback
            return r.status, json.load(r)


def start_daemon(
    tmp_path: Path,
    model: Path,
    env: dict[str, str],
    *,
    command: list[str] | None = None,
    held: tuple[signal.Signals, ...] = (),
    isolation: str = "process",
    **server: Any,
) -> Proc:
    """The daemon as a process (`command`: how it is started; `held`: signals it starts with blocked;
    `isolation`: where model m's engine runs)."""
    port = free_port()
    shm = tmp_path / "shm"
    config = {
        "server": {"port": port, **server},
        "models": [
            {
                "name": "m",
                "file": str(model),
                "threads": 1,
                "slots": 3,
                "context_size": 4096,
                "batch_size": 2048,
                "isolation": isolation,
            }
        ],
        "lock": {"allow_unsigned": True},
        "lifecycle": {"preload_dir": str(shm), "watch": False},
        "logging": {"format": "text", "level": "info"},
    }
    path = tmp_path / "edgellm.yaml"
    path.write_text(json.dumps(config))
    log = tmp_path / "daemon.log"
    # A blocked signal stays blocked across fork and exec: the child starts with this thread's mask.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held) if held else None
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*(command or [sys.executable, "-m", "edgellmd"]), "--config", str(path)],
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    finally:
        if before is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return Proc(proc, port, shm, log)


def stop(proc: Proc) -> int:
    if proc.proc.poll() is None:
        proc.proc.send_signal(signal.SIGTERM)
    try:
        return proc.proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.proc.kill()
        raise


@pytest.fixture(scope="module")
def stall_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("stall") / "stall.gguf", STALL_SPEC)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_notify_sequence_watchdog_cadence_and_stall(
    tmp_path: Path, notify: NotifySocket, stall_model: Path, isolation: str
) -> None:
    """In the daemon's thread, a stuck scheduler stops the pings; in an engine process it does
    not: the watchdog means "the daemon and its supervisor are alive", and the engine's own
    supervisor judges the engine (tests/test_engine_remote.py)."""
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    daemon = start_daemon(tmp_path, stall_model, env, isolation=isolation)
    try:
        ready_at = notify.wait_for("READY=1")
        status, body = daemon.get("/readyz")
        assert status == 200, body  # READY=1 came only once the model was warm
        before_ready = [m for t, m in notify.messages if t < ready_at]
        assert before_ready, "EXTEND_TIMEOUT_USEC is sent while the model loads"
        assert all("EXTEND_TIMEOUT_USEC=" in m for m in before_ready)
        ready_message = next(m for t, m in notify.messages if t == ready_at)
        assert "STATUS=1/1 models ready" in ready_message

        # Pings at half of WATCHDOG_USEC.
        time.sleep(2.6)
        pings = [t for t in notify.times("WATCHDOG=1") if t > ready_at]
        assert len(pings) >= 4
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert all(0.3 < g < 0.8 for g in gaps), gaps

        # A reload is framed by RELOADING=1 (with the monotonic time) and READY=1.
        mark = time.monotonic()
        assert daemon.post("/admin/reload", {"force": True})[0] == 200
        reloading = notify.wait_for("RELOADING=1", after=mark)
        message = next(m for t, m in notify.messages if t == reloading)
        assert any(line.startswith("MONOTONIC_USEC=") for line in message.split("\n"))
        assert notify.wait_for("READY=1", after=reloading) >= reloading

        # A scheduler stuck in one long llama_decode: in the daemon, the pings stop, then resume.
        mark = time.monotonic()
        done = threading.Event()

        def long_prefill() -> None:
            try:
                daemon.post(
                    "/v1/completions",
                    {"model": "m", "max_tokens": 1, "prompt": [3 + i % 250 for i in range(2000)]},
                )
            finally:
                done.set()

        threading.Thread(target=long_prefill, daemon=True).start()
        assert done.wait(120)
        finished = time.monotonic()
        time.sleep(1.2)
        pings = [t for t in notify.times("WATCHDOG=1") if t > mark]
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert finished - mark > WATCHDOG_USEC / 1e6  # long enough to have stopped them
        stalled = "not pinging the systemd watchdog: the scheduler of model m" in daemon.log.read_text()
        if isolation == "thread":
            assert max(gaps) > WATCHDOG_USEC / 1e6, (gaps, finished - mark)
            assert pings[-1] > finished  # pinging again once the scheduler is back
            assert stalled
        else:
            assert max(gaps) < 0.8, gaps
            assert not stalled
            # Serving, reloaded and asked for its status, the daemon never mapped llama.cpp.
            assert daemon.get("/admin/status")[0] == 200
            maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
            assert "libllama" not in maps
            assert "libggml" not in maps
    finally:
        code = stop(daemon)
    assert code == 0
    assert notify.fields().count("STOPPING=1") == 1
    assert not list(daemon.shm.glob("edgellmd-*"))


def _stream(url: str, max_tokens: int, out: list[list[dict[str, Any]]]) -> None:
    body = json.dumps(
        {"model": "m", "prompt": "go", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(  # noqa: S310 - loopback
        url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
        events.extend({"done": True} if chunk is None else chunk for chunk in sse_events_sync(r))
    out.append(events)


@pytest.mark.parametrize(
    ("deadline", "max_tokens", "finish"),
    [
        (60, 40, "complete"),  # the streams finish within the drain deadline
        (1, 4000, "cut"),  # past it: an error event, then [DONE]
    ],
)
def test_sigterm_drains_running_streams(
    tmp_path: Path, deadline: int, max_tokens: int, finish: str, stall_model: Path
) -> None:
    model = write_tiny_model(tmp_path / "small.gguf", TinyModelSpec(seed=22, n_embd=256, n_ff=1024))
    del stall_model
    daemon = start_daemon(tmp_path, model, {}, shutdown_timeout_s=deadline, max_tokens_limit=4000)
    try:
        deadline_at = time.monotonic() + 60
        while daemon.get("/readyz")[0] != 200:
            assert time.monotonic() < deadline_at, daemon.log.read_text()
            time.sleep(0.05)
        assert any(daemon.shm.glob("edgellmd-*/*.gguf"))
        results: list[list[dict[str, Any]]] = []
        threads = [threading.Thread(target=_stream, args=(daemon.url, max_tokens, results)) for _ in range(3)]
        for t in threads:
            t.start()
        wait = time.monotonic() + 30
        while daemon.get("/admin/status")[1]["models"][0]["slots_busy"] < 3:
            assert time.monotonic() < wait
            time.sleep(0.02)
        engine_pid = daemon.get("/admin/status")[1]["models"][0]["engine_process"]["pid"]
        daemon.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
    finally:
        code = stop(daemon)
    assert code == 0
    assert not Path(f"/proc/{engine_pid}").exists()  # the engine process drained and exited too
    assert len(results) == 3
    for events in results:
        assert events[-1] == {"done": True}
        last = events[-2]
        if finish == "complete":
            assert last["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 0
        else:
            assert last["error"]["code"] == "server_shutting_down"
    assert not list(daemon.shm.glob("edgellmd-*"))  # no /dev/shm copy left behind


def test_sigterm_cuts_a_non_streamed_request_with_server_shutting_down(tmp_path: Path) -> None:
    """A whole answer cut by the drain deadline says why, as a stream's error event does (503
    `server_shutting_down`, not `model_not_ready`)."""
    model = write_tiny_model(tmp_path / "small.gguf", TinyModelSpec(seed=22, n_embd=256, n_ff=1024))
    daemon = start_daemon(tmp_path, model, {}, shutdown_timeout_s=1, max_tokens_limit=4000)
    answers: list[tuple[int, dict[str, Any]]] = []

    def ask() -> None:
        body = json.dumps({"model": "m", "prompt": "go", "max_tokens": 4000, "ignore_eos": True}).encode()
        req = urllib.request.Request(  # noqa: S310 - loopback
            daemon.url + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
                answers.append((r.status, json.loads(r.read())))
        except urllib.error.HTTPError as exc:
            answers.append((exc.code, json.loads(exc.read())))

    try:
        deadline_at = time.monotonic() + 60
        while daemon.get("/readyz")[0] != 200:
            assert time.monotonic() < deadline_at, daemon.log.read_text()
            time.sleep(0.05)
        thread = threading.Thread(target=ask)
        thread.start()
        while daemon.get("/admin/status")[1]["models"][0]["slots_busy"] < 1:
            assert time.monotonic() < deadline_at
            time.sleep(0.02)
        daemon.proc.send_signal(signal.SIGTERM)
        thread.join(120)
    finally:
        code = stop(daemon)
    assert code == 0
    assert len(answers) == 1
    status, body = answers[0]
    assert status == 503, body
    assert body["error"]["code"] == "server_shutting_down"


def test_a_client_sending_its_body_slowly_holds_the_stop_no_longer_than_its_deadline(tmp_path: Path) -> None:
    """A request whose body still trickles in when the drain deadline passes gets its whole 503,
    and the process exits a few seconds later: the server went on reading the rest of such a body
    for 10 s more (aiohttp's lingering close), waiting for it up to the deadline again."""
    model = write_tiny_model(tmp_path / "small.gguf", TinyModelSpec(seed=22))
    deadline = 6.0  # the old wait for what was left was the deadline again: long enough to tell apart
    daemon = start_daemon(tmp_path, model, {}, shutdown_timeout_s=deadline)
    answer = bytearray()
    sock = socket.socket()
    try:
        ready_by = time.monotonic() + 60
        while daemon.get("/readyz")[0] != 200:
            assert time.monotonic() < ready_by, daemon.log.read_text()
            time.sleep(0.05)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", daemon.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        time.sleep(0.3)  # its handler is reading the body
        stopped = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)

        def trickle() -> None:  # a byte every 0.2 s, until the server closes
            with contextlib.suppress(OSError):
                for _ in range(200):
                    sock.sendall(b" ")
                    time.sleep(0.2)

        threading.Thread(target=trickle, daemon=True).start()
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
        closed = time.monotonic() - stopped
        code = daemon.proc.wait(60)
        took = time.monotonic() - stopped
    finally:
        sock.close()
        stop(daemon)
    assert code == 0
    head, _, body = bytes(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == "server_shutting_down"
    # Its connection closed by the server's wait for what is left after the drain (2 s), then
    # the exit: it was twice the deadline (the server waited for the handler the deadline again,
    # itself reading the rest of the body for up to 10 s).
    assert closed < deadline + 3.5, closed
    assert took < deadline + 6, took
    assert not list(daemon.shm.glob("edgellmd-*"))


def test_notifier_without_a_socket_is_a_quiet_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.send("READY=1") is False
    assert notifier.watchdog_s is None


def test_notifier_reports_an_unreachable_socket(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "nobody-listens")
    monkeypatch.setenv("NOTIFY_SOCKET", missing)
    with caplog.at_level(logging.ERROR):
        notifier = Notifier({"NOTIFY_SOCKET": missing})
    assert not notifier.enabled
    assert "cannot reach systemd's notify socket" in caplog.text


def test_watchdog_is_only_for_this_process() -> None:
    mine = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_s == 4.0
    assert Notifier({**mine, "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"WATCHDOG_USEC": "soon"}).watchdog_s is None


def test_abstract_notify_socket_addresses_work(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"edgellm-test-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + name)
    server.settimeout(5)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        notifier.ready("1/1 models ready")
        assert server.recv(4096) == b"READY=1\nSTATUS=1/1 models ready"
        notifier.close()
        assert notifier.send("WATCHDOG=1") is False
    finally:
        server.close()


class _NoModels:
    """A registry serving nothing, for the summary alone."""

    def status(self) -> dict[str, Any]:
        return {"models": []}


def test_the_status_line_says_what_else_keeps_the_box_out_first_and_cuts_it_visibly() -> None:
    """A problem /readyz refuses for (a failing ledger) leads STATUS=; one past the bound ends
    in an ellipsis, not mid-word as if that were all."""
    from edgellmd.host.systemd import MAX_PROBLEM_CHARS, summary  # noqa: PLC0415

    assert summary(_NoModels()) == "0/0 models ready"  # type: ignore[arg-type]
    assert summary(_NoModels(), ["NOT READY: x"]) == "NOT READY: x; 0/0 models ready"  # type: ignore[arg-type]
    long = "NOT READY: " + "y" * 400
    said = summary(_NoModels(), [long]).split("; ")  # type: ignore[arg-type]
    assert len(said[0]) == MAX_PROBLEM_CHARS
    assert said[0].endswith("…")
    assert said[0][:-1] == long[: MAX_PROBLEM_CHARS - 1]
