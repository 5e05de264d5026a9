"""File watching: lockfile and model file changes, debounced until stable, become one reload."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from edgellmd.models.registry import Registry
from edgellmd.settings import Settings

log = logging.getLogger(__name__)

# Names that downloaders, editors and atomic writers use for files that are not done yet.
TEMP_SUFFIXES: Final = (".tmp", ".temp", ".part", ".partial", ".crdownload", ".download", ".swp", "~")

Snapshot = dict[str, tuple[int, int, int]]


def is_temporary(name: str) -> bool:
    """True for hidden files and the usual partial-download and editor names."""
    return name.startswith(".") or name.endswith(TEMP_SUFFIXES)


class _Handler(FileSystemEventHandler):
    """Runs on watchdog's thread: only pokes the event loop."""

    def __init__(self, watcher: ModelWatcher) -> None:
        self._watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads (the daemon's own hashing among them) change nothing
        paths = [event.src_path, getattr(event, "dest_path", "")]
        if any(self._watcher.relevant(os.fsdecode(p)) for p in paths if p):
            self._watcher.poke_threadsafe()


class ModelWatcher:
    """Watches directories; once every relevant file has been unchanged for `settle_s`, reloads."""

    def __init__(
        self, registry: Registry, *, open_dirs: Iterable[Path], files: Iterable[Path], settle_s: float
    ) -> None:
        self.registry = registry
        self.open_dirs = {d.absolute() for d in open_dirs}  # every file in these counts
        self.files = {f.absolute() for f in files}  # and these files, wherever they are
        self.directories = sorted(self.open_dirs | {f.parent for f in self.files})
        self.settle_s = settle_s
        self.reloads = 0  # reloads this watcher started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poked = asyncio.Event()
        self._observer: BaseObserver | None = None
        self._task: asyncio.Task[None] | None = None

    def relevant(self, path: str) -> bool:
        """Whether a changed path may change what is served."""
        p = Path(path)
        if is_temporary(p.name):
            return False
        return p in self.files or p.parent in self.open_dirs

    def poke_threadsafe(self) -> None:
        """Note a change (from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._poked.set)

    def _snapshot(self) -> Snapshot:
        """Size, mtime and inode of every relevant file: equal snapshots mean nothing moved."""
        out: Snapshot = {}
        for directory in self.directories:
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                path = directory / name
                if not self.relevant(str(path)):
                    continue
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                out[str(path)] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out

    async def start(self) -> None:
        """Start observing (inotify, or polling where inotify is unavailable)."""
        self._loop = asyncio.get_running_loop()
        handler = _Handler(self)
        for label, factory in (("inotify", Observer), ("polling", PollingObserver)):
            observer: BaseObserver = factory()
            try:
                for directory in self.directories:
                    observer.schedule(handler, str(directory), recursive=False)
                observer.start()
            except OSError as exc:
                log.warning(
                    "file watching with %s failed (%s); trying the next method", label, exc.strerror or exc
                )
                continue
            self._observer = observer
            break
        if self._observer is None:
            log.error("file watching is unavailable: reload with POST /admin/reload")
            return
        self._task = asyncio.create_task(self._run(), name="model-watcher")
        log.info(
            "watching %s for model and lockfile changes (settle %.1fs)",
            ", ".join(map(str, self.directories)),
            self.settle_s,
        )

    async def stop(self) -> None:
        """Stop observing and cancel a pending reload wait (a running reload finishes)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._observer is not None:
            self._observer.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._observer.join)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._poked.wait()
            # Debounce: wait until no event arrived and no file moved for a whole interval,
            # so a file being copied or downloaded is only looked at once it is complete.
            before = await loop.run_in_executor(None, self._snapshot)
            while True:
                self._poked.clear()
                await asyncio.sleep(self.settle_s)
                after = await loop.run_in_executor(None, self._snapshot)
                if not self._poked.is_set() and after == before:
                    break
                before = after
            self.reloads += 1
            try:
                outcomes = await self.registry.reload(trigger="watch")
            except Exception:
                log.exception("reload after a file change failed")
                continue
            changed = [
                f"{o.model}: {o.result}" + (f" ({o.reason})" if o.reason else "")
                for o in outcomes
                if o.result != "unchanged"
            ]
            log.info("files changed; reload: %s", "; ".join(changed) or "nothing to do")


def watch_targets(settings: Settings) -> tuple[list[Path], list[Path]]:
    """Directories whose every file counts (the models directory), and single files that count."""
    lock = settings.lock
    if not lock.allow_unsigned and lock.file is not None and lock.models_dir is not None:
        # The lockfile's own directory may hold configs and keys: only the lockfile counts there.
        return [lock.models_dir], [lock.file]
    # Unsigned: each model's files, those loaded beside it (draft model, projector) included.
    files = [m.file for m in settings.models] + [m.mmproj_file for m in settings.models]
    files += [m.speculative.draft_file for m in settings.models]
    return [], [f for f in files if f is not None]
