"""Run a real edgellmd application on a loopback port in a background thread, for tests."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgellmd.http.app import create_app, start_server
from edgellmd.models.lockfile import format_time, sign
from edgellmd.models.preload import AREA_PREFIX
from edgellmd.settings import Settings, parse_settings
from tests.ggufmodels import TinyModelSpec, write_tiny_model


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    condition: Callable[[], Any], *, timeout: float = 30.0, what: str = "a condition", interval: float = 0.02
) -> Any:
    """Poll until `condition()` is truthy and return it; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _sse_data(raw: bytes) -> dict[str, Any] | str | None:
    """One line of an OpenAI-style event stream: its JSON object, "[DONE]", or None (not data)."""
    line = raw.decode("utf-8").strip()
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    if data == "[DONE]":
        return data
    chunk: dict[str, Any] = json.loads(data)
    return chunk


async def sse_events(lines: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON objects of an event stream (aiohttp's `response.content`), then None for its
    `[DONE]`, after which it ends; a stream cut short simply ends without the None."""
    async for raw in lines:
        data = _sse_data(raw)
        if isinstance(data, str):
            yield None
            return
        if data is not None:
            yield data


def sse_events_sync(lines: Iterable[bytes]) -> Iterator[dict[str, Any] | None]:
    """`sse_events` for a blocking response (urllib's)."""
    for raw in lines:
        data = _sse_data(raw)
        if isinstance(data, str):
            yield None
            return
        if data is not None:
            yield data


@dataclass
class SignedLock:
    """An operator's box as the daemon finds it: a models directory, the lockfile that vouches
    for it (signed by a key of its own), the rollback state and a preload root."""

    root: Path
    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    version: int = 0
    # What `publish(data)` serves one model's bytes as, and the file it puts them in.
    model: ClassVar[str] = "model"
    model_file: ClassVar[str] = "model.gguf"

    def __post_init__(self) -> None:
        self.models.mkdir(parents=True)
        self.sources.mkdir()
        self.pub.write_bytes(
            self.key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    @property
    def models(self) -> Path:
        """The models directory the lockfile's paths are relative to."""
        return self.root / "models"

    @property
    def sources(self) -> Path:
        """Where model files are made before they are published."""
        return self.root / "sources"

    @property
    def lock(self) -> Path:
        """The signed lockfile."""
        return self.root / "models.lock"

    @property
    def pub(self) -> Path:
        """The signer's public key (the daemon's trusted key)."""
        return self.root / "signer.pub"

    @property
    def state(self) -> Path:
        """lock.state_dir: the highest lockfile version accepted."""
        return self.root / "state"

    @property
    def shm(self) -> Path:
        """A preload root of the box's own (lifecycle.preload_dir); each daemon makes its area in it."""
        return self.root / "shm"

    def model_bytes(self, spec: TinyModelSpec) -> bytes:
        """The bytes of a tiny model of this spec (written once per box, under `sources`)."""
        digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:12]  # equal specs, equal files
        path = self.sources / f"tiny-{spec.seed}-{digest}.gguf"
        if not path.exists():
            write_tiny_model(path, spec)
        return path.read_bytes()

    @staticmethod
    def entry(file: str, data: bytes) -> dict[str, Any]:
        """A lockfile entry for `data` stored as `file`."""
        return {
            "file": file,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "gguf": {"architecture": "llama"},
        }

    def sign_lock(self, models: dict[str, Any], *, version: int | None = None) -> int:
        """Write a newly signed lockfile (atomically); `version` defaults to the next one."""
        if version is None:
            version = self.version + 1
        self.version = max(self.version, version)
        now = datetime.now(UTC)
        doc: dict[str, Any] = {
            "schema": 1,
            "version": version,
            "issued": format_time(now),
            "expires": format_time(now + timedelta(days=1)),
            "models": models,
        }
        doc["signatures"] = [sign(doc, self.key)]
        self.replace(self.lock, json.dumps(doc).encode())
        return version

    def publish(
        self,
        models: bytes | Mapping[str, tuple[str, bytes]],
        *,
        file: str | None = None,
        write_files: bool = True,
    ) -> int:
        """Put model files in place (each by rename), then sign a new lockfile version naming
        them; returns the version.

        `models` is one model's bytes, served as `model` from `file` (default `model_file`),
        or {name: (file, bytes)} for several. With `write_files=False` only the lock is
        signed: for files that are put in place some other way (slowly, or corrupted).
        """
        entries = {self.model: (file or self.model_file, models)} if isinstance(models, bytes) else models
        if write_files:
            for path, data in entries.values():
                self.replace(self.models / path, data)
        return self.sign_lock({name: self.entry(path, data) for name, (path, data) in entries.items()})

    @staticmethod
    def replace(path: Path, data: bytes) -> None:
        """Write `data` to `path` the way operators should: a hidden temporary, then a rename."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.rename(path)

    def highest_version(self) -> int:
        """The highest lockfile version the daemon accepted, as its rollback state file says."""
        data = json.loads((self.state / "lock-state.json").read_text())
        return int(data["highest_version"])

    def copies(self) -> list[Path]:
        """The preloaded copies of models under `shm`, of every daemon that uses it."""
        return sorted(self.shm.glob(f"{AREA_PREFIX}*/*.gguf"))

    def lock_settings(self) -> dict[str, Any]:
        """The daemon's `lock` section for this directory and key."""
        return {
            "file": str(self.lock),
            "models_dir": str(self.models),
            "state_dir": str(self.state),
            "trusted_keys": [str(self.pub)],
        }


def small_tiny(models_dir: Path, **extra: Any) -> dict[str, Any]:
    """The tiny model in one slot of 128 tokens, one thread (`extra` over that): a model entry
    for tests of the front door, auth and the host, where what the model says does not matter."""
    return {
        "name": "tiny",
        "file": str(models_dir / "tiny.gguf"),
        "slots": 1,
        "context_size": 128,
        "threads": 1,
        **extra,
    }


def settings_for(
    models: list[dict[str, Any]],
    server: dict[str, Any] | None = None,
    base_dir: Path | None = None,
    lock: dict[str, Any] | None = None,
    lifecycle: dict[str, Any] | None = None,
    auth: dict[str, Any] | None = None,
    ledger: dict[str, Any] | None = None,
    telemetry: dict[str, Any] | None = None,
    media: dict[str, Any] | None = None,
) -> Settings:
    """Settings from plain dicts, as a YAML file would give them (the test server picks its own port)."""
    data: dict[str, Any] = {
        "server": {**(server or {})},
        "models": models,
        "logging": {"level": "debug", "format": "text"},
        "lock": lock or {"allow_unsigned": True},
        "lifecycle": lifecycle,
        "auth": auth,
        "ledger": ledger,
        "telemetry": telemetry,
        "media": media,
    }
    return parse_settings(data, base_dir=base_dir or Path.cwd())


T = TypeVar("T")


def at_once(ask: Callable[[], T], n: int) -> list[T]:
    """`ask()` from `n` threads let go together; their answers, in the order they came."""
    answers: list[T] = []
    gate = threading.Barrier(n)

    def one() -> None:
        gate.wait(10)
        answers.append(ask())

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers


class RunningDaemon:
    """A daemon serving in its own thread and event loop; `url` is its base address."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="test-daemon", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._stop())
        self.loop.close()

    async def _start(self) -> None:
        self.app = create_app(self.settings)
        self._runner = await start_server(self.app, "127.0.0.1", 0)
        addresses = self._runner.addresses
        self.port = addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def shrink_send_buffers(self, size: int) -> None:
        """Give connections accepted from now on a small kernel send buffer (Linux inherits it
        from the listening socket), so that a client that stops reading blocks the server fast."""
        assert self._runner is not None
        for site in self._runner.sites:
            server = site._server  # aiohttp keeps the asyncio server private
            assert server is not None
            for sock in server.sockets:  # type: ignore[attr-defined] # an asyncio Server here
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:41234."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait_ready: bool = True, timeout: float = 60.0) -> RunningDaemon:
        """Start serving; by default wait until /readyz says 200."""
        self._thread.start()
        self._started.wait(timeout)
        if self._error is not None:
            raise RuntimeError("daemon failed to start") from self._error
        if wait_ready:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                status, _ = self.get("/readyz")
                if status == 200:
                    return self
                time.sleep(0.05)
            raise TimeoutError("daemon did not become ready")
        return self

    def stop(self) -> None:
        """Shut down and free the models."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(60)

    def get(self, path: str) -> tuple[int, Any]:
        """A plain GET (stdlib client) returning (status, parsed JSON body)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:  # noqa: S310 - loopback URL
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def post(
        self, path: str, body: Any, *, raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """A plain POST of JSON (or raw bytes) returning (status, parsed JSON body)."""
        data = raw if raw is not None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, headers=hdrs, method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback URL
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


@contextmanager
def running(settings: Settings, *, wait_ready: bool = True) -> Iterator[RunningDaemon]:
    """Serve `settings` for the duration of a with-block."""
    daemon = RunningDaemon(settings).start(wait_ready=wait_ready)
    try:
        yield daemon
    finally:
        daemon.stop()


def client_key(folder: Path) -> tuple[Path, str]:
    """A keys file in `folder` with one inference key: the file and the key's token."""
    from edgellmctl.keys import create_key  # noqa: PLC0415 - the CLI's helper, for the tests that need keys

    path = folder / "keys.yaml"
    return path, create_key(path, "client", ["inference"], limits={})[1]


@contextmanager
def client_daemon(folder: Path, keys: Path) -> Iterator[RunningDaemon]:
    """What the client-framework tests point their clients at: `plain`, a tiny model with 2 slots
    of 8192 tokens, answers of up to 1024, served to the keys in `keys`."""
    model = write_tiny_model(folder / "plain.gguf", TinyModelSpec(seed=31))
    settings = settings_for(
        [{"name": "plain", "file": str(model), "slots": 2, "context_size": 8192, "threads": 1}],
        server={"max_tokens_limit": 1024},
        lifecycle={"watch": False},
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        yield daemon


@dataclass(frozen=True, slots=True)
class Access:
    """One line of the daemon's access log."""

    method: str
    path: str
    status: int


class AccessLog(logging.Handler):
    """Collects the daemon's access lines (`edgellmd.access`: method, path, status, seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[Access] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            self.lines.append(Access(str(args[0]), str(args[1]), int(str(args[2]))))

    def refused(self) -> list[Access]:
        """The API requests the daemon answered with an error."""
        return [a for a in self.lines if a.path.startswith("/v1/") and a.status >= 400]

    def answered(self, path: str) -> int:
        return sum(1 for a in self.lines if a.path == path and a.status == 200)


@contextmanager
def access_log() -> Iterator[AccessLog]:
    """The daemon's access lines while the with-block runs (the logger's level raised to INFO)."""
    logger = logging.getLogger("edgellmd.access")
    handler = AccessLog()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def engine_workers() -> set[int]:
    """The pids of this process's engine processes now (other tests' daemons' among them)."""
    import psutil  # noqa: PLC0415 - only the tests that stop engines as they load need it

    found = set()
    for child in psutil.Process().children():
        with suppress(psutil.Error):
            if "edgellmd.engine.worker" in " ".join(child.cmdline()):
                found.add(child.pid)
    return found


def stop_new_engine_worker(others: set[int], timeout: float = 20.0) -> int:
    """SIGSTOP the first engine process started after `others` was taken (an engine that stops
    or deadlocks as it loads); its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in engine_workers() - others:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                return pid
        time.sleep(0.005)
    raise AssertionError("no new engine process was seen")
