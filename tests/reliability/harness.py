"""The reliability suite's tools: durations, a signed box, a real daemon process, load clients, figures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final, Self

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from edgellmctl.keys import create_key
from tests.ggufmodels import TinyModelSpec
from tests.serving import SignedLock, sse_events

MODE_VARIABLE: Final = "EDGELLM_RELIABILITY"  # "full": the long run; anything else: the CI run
FIGURES_VARIABLE: Final = "EDGELLM_RELIABILITY_FIGURES"  # a file every scenario appends its figures to
MODEL: Final = "m"
# Wide enough that a token takes real arithmetic (about 3,000 tokens/s over four streams on
# one core), small enough (8 MB) that verifying and loading it takes a tenth of a second.
STEADY_SPEC: Final = TinyModelSpec(seed=31, n_embd=256, n_head=4, n_head_kv=2, n_ff=1024)
OTHER_SPEC: Final = TinyModelSpec(seed=32, n_embd=256, n_head=4, n_head_kv=2, n_ff=1024)
PROMPT: Final = "The reliability test says"
CLIENT_TIMEOUT_S: Final = 120.0


# ---- durations, thresholds and figures ------------------------------------------------------------


def full_run() -> bool:
    """True when EDGELLM_RELIABILITY=full asks for the long run."""
    return os.environ.get(MODE_VARIABLE) == "full"


def duration(ci_seconds: float, full_seconds: float) -> float:
    """How long a scenario runs: the bounded CI figure, or the full one with EDGELLM_RELIABILITY=full."""
    return full_seconds if full_run() else ci_seconds


def bound(ci: float, full: float) -> float:
    """A threshold that depends on machine noise: the issue's figure in the full run, looser in CI."""
    return full if full_run() else ci


def reproduce(nodeid: str) -> str:
    """The command that runs one scenario again, in the same mode."""
    prefix = f"{MODE_VARIABLE}=full " if full_run() else ""
    return f"{prefix}.venv/bin/pytest -s -m reliability '{nodeid}'"


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


class Figures:
    """A scenario's measurements, printed (pytest -s) with the command that reproduces them."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.values: dict[str, Any] = {}
        self.shown = False

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def show(self) -> None:
        """Print the figures (call it before asserting on them, so a failure still shows them)."""
        mode = "full" if full_run() else "CI"
        lines = [f"== reliability figures: {self.nodeid} ({mode} run)"]
        lines += [f"   {key}: {_shown(value)}" for key, value in self.values.items()]
        lines.append(f"   reproduce: {reproduce(self.nodeid)}")
        print("\n" + "\n".join(lines), flush=True)
        target = os.environ.get(FIGURES_VARIABLE)
        if target:
            with Path(target).open("a", encoding="utf-8") as out:
                out.write(
                    json.dumps({"test": self.nodeid, "mode": mode, "figures": self.values}, default=str)
                    + "\n"
                )
        self.shown = True


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; nan for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    """The median; nan for no values."""
    return percentile(values, 50)


# ---- a signed box -----------------------------------------------------------------------------------


@dataclass
class SignedBox(SignedLock):
    """An operator's box (see SignedLock) with API keys: an app's and an operator's."""

    model: ClassVar[str] = MODEL
    app_token: str = ""  # inference scope
    admin_token: str = ""  # admin and metrics scopes

    def __post_init__(self) -> None:
        super().__post_init__()
        _, self.app_token = create_key(self.keys_file, "app", ["inference"], limits={})
        _, self.admin_token = create_key(self.keys_file, "ops", ["admin", "metrics"], limits={})

    @property
    def keys_file(self) -> Path:
        return self.root / "keys.yaml"

    def config(
        self,
        port: int,
        *,
        model: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None,
        lifecycle: dict[str, Any] | None = None,
        auth: dict[str, Any] | None = None,
        extra_models: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """A daemon configuration for this box (YAML is a superset of the JSON it is written as)."""
        return {
            "server": {"host": "127.0.0.1", "port": port, **(server or {})},
            "models": [
                {
                    "name": MODEL,
                    "threads": 1,
                    "context_size": 256,
                    "slots": 4,
                    "queue_size": 16,
                    **(model or {}),
                },
                *extra_models,
            ],
            "lock": self.lock_settings(),
            "auth": {"keys_file": str(self.keys_file), **(auth or {})},
            "lifecycle": {
                "preload_dir": str(self.shm),
                "watch": True,
                "watch_settle_s": 0.3,
                **(lifecycle or {}),
            },
            "logging": {"level": "info", "format": "json"},
        }


# ---- the daemon as a process ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """One HTTP answer: status, headers and the body (parsed when it is JSON)."""

    status: int
    headers: Mapping[str, str]
    body: Any


@dataclass(frozen=True, slots=True)
class Usage:
    """The daemon process's resources at one moment."""

    at: float
    rss: int
    fds: int
    threads: int
    shm_bytes: int  # bytes of files under its preload directory
    shm_files: int
    cpu_s: float = 0.0  # CPU time the daemon has used so far (user and system)


class DaemonProcess:
    """`python -m edgellmd --config FILE` as a child process (behind an optional command prefix)."""

    def __init__(
        self, box: SignedBox, config: dict[str, Any], *, prefix: Sequence[str] = (), label: str = "daemon"
    ) -> None:
        self.box = box
        self.config = config
        self.port = int(config["server"]["port"])
        self.config_path = box.root / f"{label}.yaml"
        self.log_path = box.root / f"{label}.log"
        self.prefix = list(prefix)
        self.proc: subprocess.Popen[bytes] | None = None
        self._process: psutil.Process | None = None

    # -- process control

    def start(self, *, ready: bool = True, timeout: float = 60.0) -> Self:
        """Start the process; by default wait until /readyz answers 200."""
        self.config_path.write_text(json.dumps(self.config))
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "edgellmd", "--config", str(self.config_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._process = psutil.Process(self.proc.pid)
        if ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait for /readyz 200; fail with the log's tail if the process dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise AssertionError(f"the daemon exited with {self.returncode}:\n{self.log_tail()}")
            reply = self.probe("/readyz")
            if reply is not None and reply.status == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"the daemon was not ready within {timeout} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        """True while the process lives."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def send(self, signum: signal.Signals) -> None:
        """Send a signal to the daemon."""
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the process to exit; its exit status."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL if it does not exit in time); the exit status."""
        if self.proc is None:
            return 0
        if self.running:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind."""
        if self.proc is not None and self.running:
            self.proc.kill()
            self.proc.wait(30)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stop(30)

    # -- HTTP

    @property
    def url(self) -> str:
        """Base URL, http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self.port}"

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        raw: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Reply:
        """One request with the stdlib client (a fresh connection); never raises for HTTP errors."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        if token:
            hdrs["Authorization"] = f"Bearer {token}"
        hdrs.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, headers=hdrs, method=method)  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback only
                return Reply(resp.status, dict(resp.headers), _parsed(resp.read()))
        except urllib.error.HTTPError as exc:
            with exc:
                return Reply(exc.code, dict(exc.headers), _parsed(exc.read()))

    def get(self, path: str, *, token: str | None = None) -> Reply:
        """GET `path`."""
        return self.call("GET", path, token=token)

    def probe(self, path: str) -> Reply | None:
        """GET `path`, or None while nothing listens yet."""
        try:
            return self.get(path)
        except OSError:
            return None

    def complete(
        self, *, max_tokens: int = 16, prompt: str = PROMPT, token: str | None = None, **extra: Any
    ) -> Reply:
        """A greedy, non-streamed completion of exactly `max_tokens` tokens."""
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
        return self.call("POST", "/v1/completions", body, token=token or self.box.app_token)

    def admin(self, method: str, path: str, body: Any = None) -> Reply:
        """An /admin call with the operator's key."""
        return self.call(method, path, body, token=self.box.admin_token)

    def status(self) -> dict[str, Any]:
        """GET /admin/status."""
        reply = self.admin("GET", "/admin/status")
        assert reply.status == 200, reply
        result: dict[str, Any] = reply.body
        return result

    def model(self) -> dict[str, Any]:
        """The served model's entry in /admin/status."""
        entry: dict[str, Any] = next(m for m in self.status()["models"] if m["name"] == MODEL)
        return entry

    def metric(self, name: str, where: Callable[[Mapping[str, str]], bool] = lambda _: True) -> float:
        """The sum of a /metrics sample's values over the series whose labels pass `where`."""
        reply = self.get("/metrics", token=self.box.admin_token)
        assert reply.status == 200, reply
        text = reply.body.decode() if isinstance(reply.body, bytes) else str(reply.body)
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and where(sample.labels)
        )

    # -- resources and logs

    def usage(self) -> Usage:
        """RSS, open descriptors, threads, CPU time and preload-area bytes of the daemon now, its
        engine processes (with `isolation: process`) counted in: the work and what it holds are
        theirs as much as the daemon's."""
        assert self._process is not None
        rss = fds = threads = 0
        cpu_s = 0.0
        for process in [self._process, *self._process.children(recursive=True)]:
            try:
                with process.oneshot():
                    rss += process.memory_info().rss
                    fds += process.num_fds()
                    threads += process.num_threads()
                    times = process.cpu_times()
                    cpu_s += times.user + times.system
            except psutil.NoSuchProcess:  # an engine (or a probe) that ended just now
                if process is self._process:
                    raise
        preload = self.config["lifecycle"].get("preload_dir")
        shm_bytes, shm_files = tree_size(Path(preload)) if preload else (0, 0)
        return Usage(time.monotonic(), rss, fds, threads, shm_bytes, shm_files, cpu_s)

    def records(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines so far (other lines, such as a traceback's, are skipped)."""
        out = []
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def messages(self, level: str | None = None) -> list[str]:
        """Log messages, optionally only those of one level."""
        return [str(r.get("msg")) for r in self.records() if level is None or r.get("level") == level]

    def errors(self) -> list[str]:
        """Error and critical log messages."""
        return [str(r.get("msg")) for r in self.records() if r.get("level") in ("error", "critical")]

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log, for failure messages."""
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _parsed(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data


def tree_size(root: Path) -> tuple[int, int]:
    """(bytes, regular files) under `root`; (0, 0) when it does not exist."""
    total = files = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(dirpath, name))
                total += st.st_size
                files += 1
    return total, files


# ---- load -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    """What one client got for one request."""

    status: int  # HTTP status; 0 when the connection failed
    started: float
    ended: float = 0.0
    tokens: int = 0  # completion tokens, from usage
    complete: bool = False  # a whole answer: finish_reason and, streamed, [DONE] with no error event
    first_token_at: float | None = None
    fingerprints: set[str] = field(default_factory=set)
    text: str = ""
    retry_after: str | None = None
    code: str | None = None  # the error envelope's code
    problem: str | None = None  # what went wrong: transport, protocol, an error event
    client: int = -1  # which load client sent it
    number: int = -1  # the client's how-manieth request (0: its first, on a new connection)

    @property
    def latency(self) -> float:
        """Seconds from sending the request to the end of its answer."""
        return self.ended - self.started

    @property
    def ok(self) -> bool:
        """A complete 200 answer."""
        return self.status == 200 and self.complete and self.problem is None


def completion(
    max_tokens: int = 16, *, stream: bool = False, prompt: str = PROMPT, **extra: Any
) -> tuple[str, dict[str, Any]]:
    """(path, body) of a greedy completion of exactly `max_tokens` tokens."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return "/v1/completions", body


def chat(max_tokens: int = 16, *, stream: bool = False, content: str = PROMPT) -> tuple[str, dict[str, Any]]:
    """(path, body) of a greedy chat completion of exactly `max_tokens` tokens."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return "/v1/chat/completions", body


def _choice_text(choice: Mapping[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


async def ask(
    session: aiohttp.ClientSession, url: str, token: str, path: str, body: Mapping[str, Any]
) -> Answer:
    """Send one completion request and read the whole answer (SSE when streamed)."""
    answer = Answer(0, time.monotonic())
    headers = {"Authorization": f"Bearer {token}"}
    try:
        async with session.post(url + path, json=body, headers=headers) as response:
            answer.status = response.status
            answer.retry_after = response.headers.get("Retry-After")
            if response.status != 200:
                payload = await response.json(content_type=None)
                answer.code = payload["error"]["code"]
            elif body.get("stream"):
                await _read_stream(response, answer)
            else:
                payload = await response.json()
                choice = payload["choices"][0]
                answer.text = _choice_text(choice)
                answer.tokens = payload["usage"]["completion_tokens"]
                answer.fingerprints.add(payload["system_fingerprint"])
                answer.complete = choice["finish_reason"] is not None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        answer.problem = f"{type(exc).__name__}: {exc}"
    answer.ended = time.monotonic()
    return answer


async def _read_stream(response: aiohttp.ClientResponse, answer: Answer) -> None:
    finished = done = False
    parts: list[str] = []
    async for chunk in sse_events(response.content):
        if chunk is None:
            done = True
            break
        if "error" in chunk:
            answer.code = chunk["error"].get("code")
            answer.problem = f"error event: {chunk['error']}"
            continue
        answer.fingerprints.add(chunk["system_fingerprint"])
        if chunk.get("usage"):
            answer.tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            text = _choice_text(choice)
            if text and answer.first_token_at is None:
                answer.first_token_at = time.monotonic()
            parts.append(text)
            finished = finished or choice.get("finish_reason") is not None
    answer.text = "".join(parts)
    answer.complete = done and finished


Request = Callable[[int, int], tuple[str, dict[str, Any]]]  # (client, request number) -> (path, body)


class Load:
    """Clients, each on its own connection, sending requests back to back until stopped.

    They run in a thread with its own event loop, so the test can measure and break things
    meanwhile. A client that gets a 429 waits as `Retry-After` says (with jitter), as the
    OpenAI SDK does; `stop()` lets every request in flight finish.
    """

    def __init__(
        self, url: str, token: str, clients: int, request: Request, *, pause_s: float = 0.0, seed: int = 0
    ) -> None:
        self.url = url
        self.token = token
        self.clients = clients
        self.request = request
        self.pause_s = pause_s
        self.seed = seed
        self.answers: list[Answer] = []
        self.started_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def start(self) -> Self:
        """Start the clients."""
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self, timeout: float = CLIENT_TIMEOUT_S) -> list[Answer]:
        """Stop sending; wait for the requests in flight; every answer."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "load clients did not stop"
        return self.answers

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread.is_alive():
            self.stop()

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            number = 0
            while not self._stop.is_set():
                path, body = self.request(index, number)
                number += 1
                answer = await ask(session, self.url, self.token, path, body)
                answer.client, answer.number = index, number - 1
                self.answers.append(answer)
                if answer.status == 429:
                    await asyncio.sleep(float(answer.retry_after or 1) * rng.uniform(0.5, 1.5))
                elif answer.status == 0:
                    await asyncio.sleep(0.05)  # a refused connection must not spin
                elif self.pause_s:
                    await asyncio.sleep(self.pause_s * rng.uniform(0.5, 1.5))


def tokens_between(answers: Sequence[Answer], start: float, end: float) -> int:
    """Completion tokens of the complete answers that ended in [start, end)."""
    return sum(a.tokens for a in answers if a.ok and start <= a.ended < end)


def failures(answers: Sequence[Answer]) -> list[Answer]:
    """Answers that are neither complete nor a clean 429."""
    return [a for a in answers if not a.ok and not (a.status == 429 and a.problem is None)]


def describe(answers: Sequence[Answer], limit: int = 5) -> str:
    """A short account of some answers, for assertion messages."""
    return "; ".join(f"status {a.status} code {a.code} problem {a.problem}" for a in answers[:limit])


# ---- privileges the faults need ---------------------------------------------------------------------


def _works(argv: Sequence[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0
    except OSError:
        return False


def obeying_file_modes() -> list[str] | None:
    """A command prefix under which the daemon obeys file modes, as under its own service user.

    Root reads a mode-000 file; dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the
    bounding set before exec makes it obey modes like any other user. None when that is
    not possible here; [] when no prefix is needed (not root).
    """
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
    return prefix if _works([*prefix, "true"]) else None


def private_tmpfs(mountpoint: Path, size_mb: int) -> list[str] | None:
    """A command prefix that runs the daemon with a fresh `size_mb` tmpfs at `mountpoint`, its own.

    The mount lives in a private mount namespace: nothing else on the machine sees it, and
    it goes away with the process. None when mount namespaces are not allowed here.
    """
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("nsenter") is None:
        return None
    prefix = [
        unshare,
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        'mount -t tmpfs -o "size=$1,mode=1777" tmpfs "$2" && shift 2 && exec "$@"',
        "sh",
        f"{size_mb}m",
        str(mountpoint),
    ]
    return prefix if _works([*prefix, "true"]) else None


def in_mount_namespace(pid: int, argv: Sequence[str]) -> str:
    """Run a command in the mount namespace of process `pid`; its stdout."""
    nsenter = shutil.which("nsenter")
    assert nsenter is not None
    done = subprocess.run(
        [nsenter, "-t", str(pid), "-m", "--", *argv], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout
