"""A daemon that stops ends the loads in progress: a copy or hash at its next chunk, an engine
still loading killed, one loaded meanwhile closed, and one a cancelled load's thread ends up
with closed too (never an engine process or memory cgroup left behind)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edgellmd.engine import EngineError
from edgellmd.engine.config import EngineConfig, ModelLoadError
from edgellmd.engine.remote import RemoteEngine
from edgellmd.models.loader import Loader
from edgellmd.models.lockfile import LockError
from edgellmd.models.preload import PreloadArea
from edgellmd.settings import LockSettings, ModelSettings
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import engine_workers, stop_new_engine_worker


class Engine:
    """What a factory returns: closed or not."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


class SlowFactory:
    """An engine factory whose load lasts until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.engines: list[Engine] = []

    def __call__(self, settings: ModelSettings, mmap: bool) -> Engine:
        self.started.set()
        assert self.release.wait(30)
        engine = Engine()
        self.engines.append(engine)
        return engine


def _loader(factory: SlowFactory) -> Loader:
    return Loader(ThreadPoolExecutor(1), factory, LockSettings(allow_unsigned=True))  # type: ignore[arg-type]


async def test_an_engine_loaded_as_the_daemon_stops_is_closed_not_served(tmp_path: Path) -> None:
    factory = SlowFactory()
    loader = _loader(factory)
    settings = ModelSettings(name="m", file=tmp_path / "m.gguf")
    loading = asyncio.ensure_future(loader._start_engine(asyncio.get_running_loop(), settings, False))
    await asyncio.get_running_loop().run_in_executor(None, factory.started.wait, 10)
    loader.stopping.set()
    factory.release.set()
    with pytest.raises(EngineError, match="the daemon is stopping"):
        await loading
    assert factory.engines[0].closed.is_set()


async def test_an_engine_a_cancelled_load_ends_up_with_is_closed(tmp_path: Path) -> None:
    factory = SlowFactory()
    loader = _loader(factory)
    settings = ModelSettings(name="m", file=tmp_path / "m.gguf")
    loading = asyncio.ensure_future(loader._start_engine(asyncio.get_running_loop(), settings, False))
    await asyncio.get_running_loop().run_in_executor(None, factory.started.wait, 10)
    loading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loading
    factory.release.set()  # the thread's load ends after its task was cancelled
    deadline = time.monotonic() + 10
    while not (factory.engines and factory.engines[0].closed.is_set()):
        assert time.monotonic() < deadline, "the engine the cancelled load built was never closed"
        await asyncio.sleep(0.01)


def test_a_copy_in_progress_ends_at_its_next_chunk_when_the_daemon_stops(tmp_path: Path) -> None:
    source = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=2))
    area = PreloadArea(tmp_path / "shm")
    area.open()
    loader = _loader(SlowFactory())
    chunks: list[int] = []

    def progress(n: int) -> None:
        chunks.append(n)
        if len(chunks) == 1:
            loader.stopping.set()  # the stop comes after the first chunk
        loader._unless_stopping(n)

    try:
        with pytest.raises(LockError, match="the daemon is stopping"):
            area.copy(source, "m", None, progress)
        assert len(chunks) == 1
        assert area.path is not None
        assert [p.name for p in area.path.iterdir() if p.suffix == ".gguf"] == []  # no partial left
    finally:
        area.close()


async def test_the_stop_kills_an_engine_process_still_loading(tmp_path: Path) -> None:
    """The engine process of a load (stopped as it loads: a load that would last) is killed once
    the daemon stops; the load fails at once instead of holding the stop."""
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=4))
    config = EngineConfig(path=model, slots=1, context_size=128, batch_size=64, threads=1, threads_batch=1)
    others = engine_workers()

    def factory(settings: ModelSettings, mmap: bool) -> RemoteEngine:
        return RemoteEngine(config, name=settings.name, hang_s=60)

    loader = Loader(ThreadPoolExecutor(1), factory, LockSettings(allow_unsigned=True))
    settings = ModelSettings(name="held", file=model)
    loading = asyncio.ensure_future(loader._start_engine(asyncio.get_running_loop(), settings, False))
    await asyncio.get_running_loop().run_in_executor(None, stop_new_engine_worker, others)
    await asyncio.sleep(1.0)  # loading, and held
    assert not loading.done()
    started = time.monotonic()
    loader.stopping.set()
    with pytest.raises(ModelLoadError, match="SIGKILL while loading"):
        await loading
    assert time.monotonic() - started < 5
