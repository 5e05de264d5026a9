"""Served models by name: leases for requests, and verify → preload → load → warm-up → swap.

The "RwLock swap": a request takes a lease on its model's current handle for its whole life
(`Registry.lease`); a reload builds the new handle off the event loop and then swaps the
entry's pointer in one assignment on the loop, so new requests get the new model at once
and never wait for a load. The old handle is retired and freed (engine closed, preloaded
copy removed) when its last lease ends. A reload that fails at any step leaves the old
handle serving and records why.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

from edgellmd.engine import BuildInfo, EngineError, build, wire
from edgellmd.engine.remote import RemoteEngine
from edgellmd.errors import ApiError, ModelNotFound, ServiceUnavailable, shown
from edgellmd.host.gpu import GpuSnapshot
from edgellmd.models.budget import MIB, OverBudget, Resident, evictions
from edgellmd.models.handle import (
    RETRY_AFTER_LOADING_S,
    CompanionProvenance,
    EngineFactory,
    ModelHandle,
    Provenance,
    default_engine_factory,
)
from edgellmd.models.loader import Loader, LoadFailed, stat_key
from edgellmd.models.lockfile import (
    LockedModel,
    LockError,
    Lockfile,
    VersionState,
    format_time,
    load_lock,
    load_public_key,
    verify_lock,
)
from edgellmd.models.preload import PreloadArea
from edgellmd.settings import LifecycleSettings, LockSettings, ModelSettings

log = logging.getLogger(__name__)
audit = logging.getLogger("edgellmd.audit")

# A model whose engine stops by itself (its scheduler crashed, its process died) is restarted
# after a pause that grows with each stop in the model's crash_loop_window_s; its
# crash_loop_stops-th stop in that window trips the breaker: the model stays failed until an
# operator loads it.
RESTART_BACKOFF_S: Final = (1.0, 2.0, 5.0, 15.0)
CLOCK_SKEW: Final = timedelta(hours=1)  # a lockfile issued further ahead of this clock is said
T = TypeVar("T")

__all__ = ["ModelHandle", "ModelState", "Outcome", "Registry"]


class ModelState(enum.Enum):
    """Whether a configured model can serve now."""

    LOADING = "loading"  # first load in progress; nothing serves yet
    READY = "ready"  # serving (a reload may be running beside it)
    RESTARTING = "restarting"  # not serving: its engine stopped by itself; it restarts soon
    FAILED = "failed"  # not serving: the last load failed
    UNLOADED = "unloaded"  # not serving: an operator unloaded it, or it was evicted
    REVOKED = "revoked"  # not serving: the accepted lockfile does not list it


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one load, reload or unload of one model came to."""

    model: str
    result: str  # "loaded", "unchanged", "unloaded", "revoked" or "failed"
    reason: str | None
    trigger: str  # "start", "watch", "admin", "signal"
    at: float  # wall-clock time it finished
    version: int | None = None  # the lockfile version the model now serves from

    @property
    def ok(self) -> bool:
        """False when the operation failed (a revocation is the lockfile applied, not a failure)."""
        return self.result != "failed"

    def as_dict(self) -> dict[str, Any]:
        """JSON form for the admin API."""
        return {
            "model": self.model,
            "result": self.result,
            "reason": self.reason,
            "trigger": self.trigger,
            "at": self.at,
            "version": self.version,
        }


@dataclass(slots=True)
class _Queued:
    """A reload waiting for the registry's mutex, which later requests it covers may join."""

    names: tuple[str, ...] | None
    force: bool
    done: asyncio.Future[list[Outcome]]


@dataclass(frozen=True, slots=True)
class EngineStop:
    """A model's engine stopping by itself: when, why, and what the registry did about it."""

    at: float  # wall-clock time
    fault: str
    action: str  # "restart in N s" or "breaker tripped"

    def as_dict(self) -> dict[str, Any]:
        """JSON form for /admin/status."""
        return {"at": self.at, "fault": self.fault, "action": self.action}


@dataclass(slots=True)
class _Entry:
    settings: ModelSettings
    state: ModelState = ModelState.LOADING
    handle: ModelHandle | None = None
    error: str | None = None
    reloading: bool = False
    last: Outcome | None = None
    stops: list[float] = field(default_factory=list)  # monotonic times, within the breaker's window
    last_stop: EngineStop | None = None
    restart: asyncio.Task[None] | None = None  # the pending restart after a stop
    restart_from: Provenance | None = None  # the stopped engine's verified copy, for its restart


class Registry:
    """Configured models by name, each with its current handle, state and last outcome."""

    def __init__(
        self,
        models: Sequence[ModelSettings],
        executor: Executor,
        factory: EngineFactory = default_engine_factory,
        lock: LockSettings | None = None,
        lifecycle: LifecycleSettings | None = None,
        *,
        gpu: Callable[[], GpuSnapshot | None] = lambda: None,
        gpu_headroom_bytes: int = 0,
        huge_pages: bool = False,
        media_pool: Callable[[str], Executor] | None = None,
        prompt_pool: Callable[[str], Executor] | None = None,
    ) -> None:
        self._entries = {m.name: _Entry(m) for m in models}
        # Each model's own prompt pool (templates, tokenizing and grammars by its engine), every
        # version's: a stopped engine holds its calls' threads until the hang is found, and on
        # one pool of all models' that stalled every other model's requests. `executor` (the
        # shared one) where none is given.
        self._prompt: dict[str, Executor] = (
            {m.name: prompt_pool(m.name) for m in models} if prompt_pool is not None else {}
        )
        # Each model with a projector: the pool its requests' images and clips wait on for its
        # engines (one model's clips hold up no other model's images), every version's.
        self._media: dict[str, Executor] = {
            m.name: media_pool(m.name)
            for m in models
            if media_pool is not None and (m.mmproj is not None or m.mmproj_file is not None)
        }
        self._lock = lock or LockSettings(allow_unsigned=True)
        self._lifecycle = lifecycle or LifecycleSettings(preload_dir=None, watch=False)
        self.loader = Loader(
            executor,
            factory,
            self._lock,
            gpu=gpu,
            gpu_headroom_bytes=gpu_headroom_bytes,
            huge_pages=huge_pages,
        )
        self._mutex = asyncio.Lock()  # one load/reload/unload at a time
        self._queued: list[_Queued] = []  # reloads waiting for the mutex
        self._detached: set[asyncio.Task[Any]] = set()  # operators' actions running (detached)
        self._disposals: set[asyncio.Task[None]] = set()
        self._freeing: dict[str, set[asyncio.Task[None]]] = {}  # by model: copies being freed
        self._draining: set[ModelHandle] = set()  # retired, waiting for their last request
        self.lock_version: int | None = None  # of the last lockfile that verified
        self.reloads: Tally[str] = Tally()  # outcomes by result
        self.reloads_by_model: Tally[tuple[str, str]] = Tally()  # by (model, result), for metrics
        self.engine_stops: Tally[str] = Tally()  # engines that stopped by themselves, by model
        self.engine_restarts: Tally[tuple[str, str]] = Tally()  # the same by (model, reason), for metrics
        # Per model, shared by every version of it: 429 server_overloaded refusals and the like.
        self._counters: dict[str, Tally[str]] = {m.name: Tally() for m in models}
        # Called with ("reload_started", []) and ("reload_finished", outcomes) around reloads.
        self.observers: list[Callable[[str, list[Outcome]], None]] = []
        self._news = asyncio.Event()  # set (and replaced) at every reload's end and engine stop
        self._stopping = False  # the daemon's drain began: nothing restarts (stop_restarts)
        self._build_info: BuildInfo | None = None  # the llama.cpp build's, once asked

    # ---- start and stop -----------------------------------------------------------------

    async def start(self) -> None:
        """Open the preload area (removing stale copies), then load every model."""
        loop = asyncio.get_running_loop()
        root = self._lifecycle.preload_dir
        if root is not None:
            max_mb = self._lifecycle.preload_max_mb
            area = PreloadArea(root, max_bytes=max_mb * MIB if max_mb else None)
            try:
                await loop.run_in_executor(None, area.open)
            except OSError as exc:
                log.warning(
                    "preload directory %s unusable (%s); models load from the models directory",
                    root,
                    exc.strerror or exc,
                )
            else:
                self.loader.area = area
        if self._lock.allow_unsigned:
            log.warning(
                "UNSIGNED MODE (lock.allow_unsigned): models load WITHOUT lockfile "
                "verification; never run a production box like this"
            )
        await self.reload(trigger="start")

    def stop_restarts(self) -> None:
        """The daemon is stopping (its drain begins): no engine is restarted from now on, an
        engine process still loading is killed (its load would hold the stop), and the requests
        waiting for a restart (`replacement`) end with their stop's error at once rather than
        being served by an engine started during the stop and cut at its end."""
        self._stopping = True
        # Copies and hashes end at their next chunk; an engine still loading is killed, and none
        # starts (Loader._start_engine).
        self.loader.stopping.set()
        for entry in self._entries.values():
            if entry.restart is not None:
                entry.restart.cancel()
                entry.restart = None
                entry.state, entry.error = (
                    ModelState.FAILED,
                    f"{entry.error}; not restarted: the daemon is stopping",
                )
        self._notify("stopping", [])

    @property
    def stopping(self) -> bool:
        """The daemon's drain began (`stop_restarts`): no engine restarts any more."""
        return self._stopping

    async def close(self) -> None:
        """Free every model and remove the preload area, off the event loop."""
        loop = asyncio.get_running_loop()
        self.loader.stopping.set()  # a load still in progress ends (Loader._start_engine)
        restarts = [e.restart for e in self._entries.values() if e.restart is not None]
        for task in [*restarts, *self._detached]:
            task.cancel()
        await asyncio.gather(*restarts, *self._detached, return_exceptions=True)
        async with self._mutex:
            names, closing = [], []
            for name, entry in self._entries.items():
                if entry.handle is not None:
                    handle, entry.handle = entry.handle, None
                    entry.state = ModelState.UNLOADED
                    names.append(name)
                    closing.append(loop.run_in_executor(None, handle.engine.close))
            # Together: an engine process that does not exit when told is killed after
            # CLOSE_TIMEOUT_S, and one after another, hung engines (a GPU driver's hang) added
            # that much each to the stop, past the unit's TimeoutStopSec.
            for name, outcome in zip(
                names, await asyncio.gather(*closing, return_exceptions=True), strict=True
            ):
                if isinstance(outcome, BaseException):
                    log.error("model %s: its engine did not close cleanly: %r", name, outcome)
            await asyncio.gather(*self._disposals, return_exceptions=True)
            for pool in [*self._media.values(), *self._prompt.values()]:
                pool.shutdown(wait=False, cancel_futures=True)
            if self.area is not None:
                await loop.run_in_executor(None, self.area.close)
                self.loader.area = None

    def detached(self, action: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run an operator's action (load, unload, reload) to its end whatever becomes of the
        request that asked: a client that goes away must not cancel a load half-way. `close()`
        cancels the ones still running; a failure is logged when nobody was left to hear it."""
        task = asyncio.get_running_loop().create_task(action)
        self._detached.add(task)

        def done(finished: asyncio.Task[T]) -> None:
            self._detached.discard(finished)
            error = None if finished.cancelled() else finished.exception()
            if error is not None and not isinstance(error, ApiError):  # a client's mistake is its answer
                log.error("operator action failed", exc_info=error)

        task.add_done_callback(done)
        return task

    # ---- requests -----------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFound(f"the model {shown(name, quote=True)} does not exist", param="model")
        return entry

    def get(self, name: str) -> ModelHandle:
        """The serving handle for `name`; 404 for unknown models, 503 when none serves."""
        entry = self._entry(name)
        if entry.handle is None:
            told = entry.state in (ModelState.UNLOADED, ModelState.REVOKED)  # why it was stopped
            detail = f": {entry.error}" if told and entry.error else ""
            raise ServiceUnavailable(
                f"the model {name!r} is {entry.state.value}{detail}",
                headers={"Retry-After": RETRY_AFTER_LOADING_S},
            )
        return entry.handle

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[ModelHandle]:
        """Hold the model's current handle for a request's whole life; a swap waits for no one."""
        handle = self.get(name)
        handle.leases += 1
        try:
            yield handle
        finally:
            handle.leases -= 1
            handle.last_used = time.monotonic()
            if handle.retired and handle.leases == 0:
                self._dispose(handle)

    async def replacement(self, stopped: ModelHandle, wait_s: float) -> ModelHandle | None:
        """The handle that serves `stopped`'s model once the restart after its engine's stop is done.

        For a request that was still waiting in the stopped engine (it got no token): it waits
        for the restarted engine rather than failing. None when no restart comes within
        `wait_s` seconds (the request's own progress deadline), the breaker tripped, an
        operator stopped the model meanwhile, or a different version now serves (its prompt
        was tokenized for this one).
        """
        entry = self._entries.get(stopped.name)
        if entry is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        # The engine's stop reaches the generations (its reader thread) before the registry
        # (the event loop): until then the stopped handle still looks like the serving one.
        while entry.handle is stopped or (entry.handle is None and entry.state is ModelState.RESTARTING):
            remaining = deadline - loop.time()
            if remaining <= 0 or self._stopping:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._news.wait()
        handle = entry.handle
        same = (stopped.provenance.fingerprint, stopped.provenance.source_stat)
        if handle is None or (handle.provenance.fingerprint, handle.provenance.source_stat) != same:
            return None
        return handle

    @property
    def rejections(self) -> dict[str, int]:
        """429 server_overloaded refusals per model since start."""
        return {name: c["queue_rejections"] for name, c in self._counters.items()}

    @property
    def fair_admissions(self) -> dict[str, int]:
        """Requests let in past a model's queue bound for a key below its fair share, per model."""
        return {name: c["fair_admissions"] for name, c in self._counters.items()}

    def ready_handles(self) -> list[ModelHandle]:
        """Handles of every model that can serve now, in configuration order."""
        return [e.handle for e in self._entries.values() if e.handle is not None]

    def heartbeats(self) -> list[tuple[str, float]]:
        """(model, when its engine thread last showed progress) for every serving model."""
        return [(h.name, h.engine.heartbeat) for h in self.ready_handles()]

    def observe(self, callback: Callable[[str, list[Outcome]], None]) -> None:
        """Call `callback(event, outcomes)` on "reload_started", "reload_finished" and
        "model_stopped" (an engine stopped by itself; no outcomes)."""
        self.observers.append(callback)

    def states(self) -> dict[str, tuple[ModelState, str | None]]:
        """Each model's state and, when it is not serving, why."""
        return {name: (e.state, e.error) for name, e in self._entries.items()}

    @property
    def all_ready(self) -> bool:
        """True when every model that should serve is loaded and warmed (unloaded and revoked ones aside)."""
        # A revoked model is not one that should serve: the signed lockfile, the operators'
        # word as much as an unload, stopped it. Every box of a fleet gets the same lockfile,
        # so counting it as not ready would take every box out of the balancers at once, and
        # the models they still serve with them. It shows in /readyz's body, in /admin/status,
        # in the metrics and in systemd's STATUS= all the same.
        stopped = (ModelState.READY, ModelState.UNLOADED, ModelState.REVOKED)
        return all(e.state in stopped for e in self._entries.values()) and any(
            e.state is ModelState.READY for e in self._entries.values()
        )

    # ---- lifecycle operations -------------------------------------------------------------

    async def reload(
        self, names: Sequence[str] | None = None, *, force: bool = False, trigger: str = "admin"
    ) -> list[Outcome]:
        """Re-verify the lockfile and replace every named model whose approved bytes changed.

        `force` reloads models whose lock entry and file look unchanged too. Models an
        operator unloaded stay unloaded unless named explicitly; revoked models come back
        once a lockfile lists them again.
        """
        entries = [self._entry(n) for n in names] if names is not None else list(self._entries.values())
        # Coalesce: a reload still waiting for its turn reads the files only once it runs, so a
        # request that it covers (all models, or these; forced if this one is) joins it. A storm
        # of reloads thus runs at most one beside the one in progress.
        # A reload of all models passes over those an operator unloaded: one named here (a
        # load) is not covered by it.
        unloaded = names is not None and any(e.state is ModelState.UNLOADED for e in entries)
        for waiting in self._queued:
            covered = (waiting.names is None and not unloaded) or (
                names is not None and waiting.names is not None and set(names) <= set(waiting.names)
            )
            if covered and (waiting.force or not force):
                outcomes = await asyncio.shield(waiting.done)
                found = [o for o in outcomes if names is None or o.model in names]
                if names is None or {o.model for o in found} >= set(names):
                    return found
                break  # an unload ran before it, so it passed a named model over: a turn of our own
        queued = _Queued(
            tuple(names) if names is not None else None, force, asyncio.get_running_loop().create_future()
        )
        self._queued.append(queued)
        try:
            async with self._mutex:
                self._queued.remove(queued)
                if trigger != "start":
                    self._notify("reload_started", [])
                outcomes = await self._reload(entries, names, force=force, trigger=trigger)
                self._notify("reload_finished", outcomes)
                # The admin API audits its own, with who asked; a restart that a reload made
                # needless did nothing to record.
                if trigger not in ("admin", "start") and (outcomes or trigger != "restart"):
                    audit.info(
                        "reload (%s): %s",
                        trigger,
                        ", ".join(f"{o.model} {o.result}" for o in outcomes) or "nothing",
                        extra={"peer": None, "key_id": None, "trigger": trigger},
                    )
        except BaseException as exc:
            if queued in self._queued:
                self._queued.remove(queued)
            if not queued.done.done():
                queued.done.set_exception(exc)
                queued.done.exception()  # retrieved: a storm's joiners may all be gone
            raise
        queued.done.set_result(outcomes)
        return outcomes

    def _notify(self, event: str, outcomes: list[Outcome]) -> None:
        self._news.set()
        self._news = asyncio.Event()
        for observer in self.observers:
            try:
                observer(event, outcomes)
            except Exception:
                log.exception("registry observer failed on %s", event)

    async def _reload(
        self, entries: list[_Entry], names: Sequence[str] | None, *, force: bool, trigger: str
    ) -> list[Outcome]:
        lock: Lockfile | None = None
        if not self._lock.allow_unsigned:
            loop = asyncio.get_running_loop()
            try:
                lock = await loop.run_in_executor(None, self._verified_lock)
            except LockError as exc:
                reason = f"lockfile refused: {exc}"
                log.error("lockfile %s refused: %s", self._lock.file, exc)  # noqa: TRY400 - the reason is the story
                return [self._failed(e, reason, trigger) for e in entries]
            self.lock_version = lock.version
        outcomes = []
        for entry in entries:
            if entry.state is ModelState.UNLOADED and names is None and trigger != "start":
                continue  # an operator's unload stands until they load it again
            if trigger == "restart" and entry.state is ModelState.READY and entry.handle is not None:
                # A reload it waited for brought the model back: the stopped engine's copy is
                # nobody's now. (A reload that failed meanwhile left it failed: restarted.)
                self._drop_restart_copy(entry)
                continue
            outcomes.append(await self._refresh(entry, lock, force=force, trigger=trigger))
        return outcomes

    async def load(self, name: str) -> Outcome:
        """Load a model that is unloaded, failed or revoked (an operator's request).

        It also resets the crash-loop breaker: the operator has looked at why it tripped.
        """
        self._entry(name).stops.clear()
        outcome = (await self.reload([name], trigger="admin"))[0]
        entry = self._entry(name)
        if entry.state is ModelState.REVOKED and outcome.ok:
            # Applied, but nothing loaded: the lockfile does not list it. Say so (409).
            return replace(outcome, result="failed", reason=entry.error)
        return outcome

    async def unload(self, name: str) -> Outcome:
        """Stop serving a model; requests in flight finish on it first."""
        entry = self._entry(name)
        async with self._mutex:
            return self._unload(entry, "unloaded by an operator", "admin")

    def _unload(self, entry: _Entry, reason: str, trigger: str) -> Outcome:
        handle, entry.handle = entry.handle, None
        entry.state, entry.error = ModelState.UNLOADED, reason
        self._cancel_restart(entry)
        if handle is not None:
            self._retire(handle)
        log.info("model %s unloaded: %s", entry.settings.name, reason)
        return self._record(entry, Outcome(entry.settings.name, "unloaded", reason, trigger, time.time()))

    def _revoke(self, entry: _Entry, lock: Lockfile, trigger: str) -> Outcome:
        """Stop serving a model the accepted lockfile does not list, until one lists it again."""
        name = entry.settings.name
        reason = f"model {name!r} is not in the lockfile (version {lock.version})"
        if entry.state is ModelState.REVOKED:  # still not listed: nothing to stop
            entry.error = reason
            return self._record(entry, Outcome(name, "unchanged", reason, trigger, time.time()), log_it=False)
        handle, entry.handle = entry.handle, None
        entry.state, entry.error = ModelState.REVOKED, reason
        self._cancel_restart(entry)
        if handle is not None:
            self._retire(handle)  # requests in flight finish on it first
        # At start as on any reload: a box restarted after a revocation comes up serving (and
        # ready with) the models the lockfile still lists.
        log.warning("model %s revoked: %s", name, reason)
        return self._record(entry, Outcome(name, "revoked", reason, trigger, time.time()), log_it=False)

    def _verified_lock(self) -> Lockfile:
        """Read, verify (signature, expiry, rollback) and accept the configured lockfile."""
        if self._lock.file is None or self._lock.state_dir is None:
            raise LockError("lock.file and lock.state_dir must be configured")
        lock = load_lock(self._lock.file)
        trusted = [load_public_key(path) for path in self._lock.trusted_keys]
        signer = verify_lock(lock, trusted)
        state = VersionState(self._lock.state_dir)
        state.check(lock.version)
        state.accept(lock.version)
        log.info(
            "lockfile %s version %d verified (signed by key %s…)", self._lock.file, lock.version, signer[:16]
        )
        now = datetime.now(UTC)
        if lock.issued is not None and lock.issued - now > CLOCK_SKEW:
            # Signed "in the future": this box's clock, or the signer's, is wrong, and the expiry
            # check reads this clock. Said, not refused: a box without a good clock still serves.
            log.warning(
                "lockfile %s says it was issued at %s, %s after this box's clock: check both clocks "
                "(its expiry, %s, is judged by this one)",
                self._lock.file,
                format_time(lock.issued),
                lock.issued - now,
                format_time(lock.expires) if lock.expires else "none",
            )
        return lock

    @property
    def area(self) -> PreloadArea | None:
        """This daemon's preload area, once opened (None: models load from the models directory)."""
        return self.loader.area

    def _changed(self, entry: _Entry, locked: LockedModel | None, lock: Lockfile | None) -> bool:
        handle = entry.handle
        if handle is None:
            return True
        prov = handle.provenance
        if locked != prov.locked:
            return True
        try:
            source = self.loader.source(entry.settings, locked)
        except LockError:
            return True  # let the load say why
        return (
            stat_key(source) != prov.source_stat
            or self.loader.draft_changed(entry.settings, prov.draft, lock)
            or self.loader.mmproj_changed(entry.settings, prov.mmproj, lock)
        )

    async def _refresh(self, entry: _Entry, lock: Lockfile | None, *, force: bool, trigger: str) -> Outcome:
        name = entry.settings.name
        locked: LockedModel | None = None
        if lock is not None:
            locked = lock.models.get(name)
            if locked is None:
                return self._revoke(entry, lock, trigger)
        if not force and not self._changed(entry, locked, lock):
            return self._record(
                entry,
                Outcome(name, "unchanged", None, trigger, time.time(), self._version(entry)),
                log_it=False,
            )
        old = entry.handle
        if (
            old is not None
            and not force
            and locked is not None
            and old.provenance.locked == locked
            and self._same_companion_entries(entry, old, lock)
        ):
            # The same lock entries; only a file's stat changed (touched, or rewritten
            # identically): check its bytes against the entry, and load nothing.
            return await self._reverify(entry, old, locked, trigger)
        # A stopped engine's checked copy: loaded again by its restart, by nothing else.
        reuse = entry.restart_from if trigger == "restart" else None
        if reuse is not None:
            entry.restart_from = None
        self._drop_restart_copy(entry)
        if old is None and entry.state is not ModelState.RESTARTING:  # a restart says so while it loads
            entry.state = ModelState.LOADING
        entry.reloading = True
        try:
            # At most one copy beside the serving one: versions retired by earlier reloads
            # (their last request is done) are freed before another is built.
            await asyncio.gather(*self._freeing.get(name, ()), return_exceptions=True)
            handle = await self.loader.build(
                entry.settings,
                locked,
                lock,
                counters=self._counters[name],
                make_room=self._make_room,
                dispose=self._dispose,
                reuse=reuse,
                media_executor=self._media.get(name),
                prompt_executor=self._prompt.get(name),
            )
        except LoadFailed as exc:
            self._discard_unused(reuse, None)
            return self._failed(entry, str(exc), trigger)
        except Exception as exc:  # a bug, or a file that broke a reader: this load fails, nothing else
            log.exception("model %s: the load failed unexpectedly", name)
            self._discard_unused(reuse, None)
            return self._failed(
                entry, f"the load failed unexpectedly ({type(exc).__name__}; see the log)", trigger
            )
        except BaseException:
            self._discard_unused(reuse, None)
            if entry.handle is None and entry.state is ModelState.LOADING:
                # Cancelled half-way (the daemon stops): nothing serves and nothing loads, so it
                # must not stay `loading`; failed, it can be loaded again.
                entry.state, entry.error = ModelState.FAILED, "the load was cancelled before it finished"
            raise
        finally:
            entry.reloading = False
        self._discard_unused(reuse, handle)
        entry.handle, entry.state, entry.error = handle, ModelState.READY, None  # the swap
        self._supervise(entry, handle)
        if old is not None:
            self._retire(old)
        log.info(
            "model %s now serving %s (%s)",
            name,
            handle.provenance.fingerprint,
            "replaced the previous version" if old is not None else "first load",
        )
        return self._record(
            entry, Outcome(name, "loaded", None, trigger, time.time(), handle.provenance.lock_version)
        )

    async def _reverify(
        self, entry: _Entry, handle: ModelHandle, locked: LockedModel, trigger: str
    ) -> Outcome:
        """Check a serving model's file against its unchanged lock entry; keep the warm handle."""
        name = entry.settings.name
        prov = handle.provenance
        source_stat, draft, mmproj = prov.source_stat, prov.draft, prov.mmproj
        entry.reloading = True
        try:
            if stat_key(prov.source) != source_stat:
                source_stat = await self.loader.reverify(entry.settings, locked)
            draft = await self._reverify_companion(entry, draft)
            mmproj = await self._reverify_companion(entry, mmproj)
        except LoadFailed as exc:
            return self._failed(entry, str(exc), trigger)
        finally:
            entry.reloading = False
        # Noted, so that the next look does not check it again. The served version (its
        # lock version, its fingerprint) is the one that was loaded: the bytes are the same.
        handle.provenance = replace(handle.provenance, source_stat=source_stat, draft=draft, mmproj=mmproj)
        return self._record(
            entry, Outcome(name, "unchanged", None, trigger, time.time(), self._version(entry))
        )

    async def _reverify_companion(
        self, entry: _Entry, companion: CompanionProvenance | None
    ) -> CompanionProvenance | None:
        """Check a file loaded beside the model whose stat changed against its unchanged lock
        entry; LoadFailed naming it. Returns it with the stat now seen."""
        if (
            companion is None
            or companion.locked is None
            or stat_key(companion.source) == companion.source_stat
        ):
            return companion
        try:
            seen = await self.loader.reverify(entry.settings, companion.locked)
        except LoadFailed as exc:
            raise LoadFailed(f"{companion.label}: {exc}") from None
        return replace(companion, source_stat=seen)

    def _same_companion_entries(self, entry: _Entry, handle: ModelHandle, lock: Lockfile | None) -> bool:
        """The lock entries of the model's draft model and projector (if any) are the ones its
        handle was built with (the projector's under the same name)."""
        prov, settings = handle.provenance, entry.settings
        draft, mmproj = prov.draft, prov.mmproj
        return (
            self.loader.draft_entry(settings, lock) == (draft.locked if draft is not None else None)
            and self.loader.mmproj_entry(settings, lock) == (mmproj.locked if mmproj is not None else None)
            and (mmproj is None or mmproj.name == settings.mmproj)
        )

    @staticmethod
    def _version(entry: _Entry) -> int | None:
        return entry.handle.provenance.lock_version if entry.handle is not None else None

    def _failed(self, entry: _Entry, reason: str, trigger: str) -> Outcome:
        # An unloaded or revoked model stays so (a refused lockfile changes nothing about it);
        # one that was being loaded again is LOADING here, and fails.
        if entry.handle is None and entry.state not in (ModelState.UNLOADED, ModelState.REVOKED):
            entry.state, entry.error = ModelState.FAILED, reason
        serving = " (the previous version keeps serving)" if entry.handle is not None else ""
        log.error(
            "model %s: %s failed: %s%s",
            entry.settings.name,
            "load" if trigger == "start" else "reload",
            reason,
            serving,
        )
        return self._record(
            entry,
            Outcome(entry.settings.name, "failed", reason, trigger, time.time(), self._version(entry)),
            log_it=False,
        )

    def _record(self, entry: _Entry, outcome: Outcome, *, log_it: bool = True) -> Outcome:
        # "unchanged" does not hide the last load, but it does replace a failure: once the
        # file or lockfile is fixed, /admin/status, `edgellmctl status` and systemd's STATUS=
        # must stop reporting a fault that is gone.
        recovered = entry.last is not None and not entry.last.ok and outcome.ok
        if outcome.result != "unchanged" or entry.last is None or recovered:
            entry.last = outcome
        if recovered and outcome.result != "revoked":  # a revocation is logged as one
            log.info("model %s: recovered (%s) after the failed reload", outcome.model, outcome.result)
        self.reloads[outcome.result] += 1
        self.reloads_by_model[outcome.model, outcome.result] += 1
        if log_it and outcome.result != "loaded":
            log.info("model %s: %s", outcome.model, outcome.result)
        return outcome

    # ---- engines that stop by themselves ---------------------------------------------------

    def _supervise(self, entry: _Entry, handle: ModelHandle) -> None:
        """Hear of it, on the event loop, when the engine of this serving handle stops by itself."""
        loop = asyncio.get_running_loop()

        def exited(fault: str | None) -> None:  # on the engine's thread
            if fault is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is gone
                    loop.call_soon_threadsafe(self._engine_stopped, entry, handle, fault)

        handle.engine.on_exit(exited)

    def _engine_stopped(self, entry: _Entry, handle: ModelHandle, fault: str) -> None:
        """Take a model whose engine stopped out of service now, and restart it (or trip the breaker).

        Its requests in flight were ended with ENGINE_STOPPED (a 503 that says retry); new
        ones get 503 from `get` until the restart swaps a new engine in. Nothing else stops:
        the other models, the admin API and the watchdog go on.
        """
        name = entry.settings.name
        if entry.handle is not handle:  # replaced or unloaded meanwhile: nothing serves on it
            log.warning("model %s: a retired engine stopped by itself: %s", name, fault)
            return
        entry.handle = None
        prov = handle.provenance
        if prov.copy is not None and prov.draft is None:  # the restart loads the checked copies again
            self._drop_restart_copy(entry)
            entry.restart_from = prov
            # Kept from this handle's freeing: they are the restart's now.
            mmproj = replace(prov.mmproj, copy=None) if prov.mmproj is not None else None
            handle.provenance = replace(prov, copy=None, mmproj=mmproj)
        self._retire(handle)  # freed once the requests that hold it have read their error
        self._count_stop(entry, fault, getattr(handle.engine, "fault_kind", "crash"))

    def _count_stop(self, entry: _Entry, fault: str, kind: str) -> None:
        """One more stop of a model's engine (its engine died, or the restart's load failed):
        restart it after a backoff, or trip the breaker at the window's last allowed stop."""
        name = entry.settings.name
        now = time.monotonic()
        window, allowed = entry.settings.crash_loop_window_s, entry.settings.crash_loop_stops
        entry.stops = [t for t in entry.stops if now - t < window] + [now]
        self.engine_stops[name] += 1
        self.engine_restarts[name, kind] += 1
        if self._stopping:
            action = "not restarted: the daemon is stopping"
            entry.state, entry.error = ModelState.FAILED, f"{fault}; {action}"
            log.error("model %s: %s", name, entry.error)
            self._drop_restart_copy(entry)
        elif len(entry.stops) >= allowed:
            action = "breaker tripped"
            entry.state = ModelState.FAILED
            entry.error = (
                f"{fault}; its engine stopped {len(entry.stops)} times within "
                f"{window:g} s, so it is not restarted: load it to try again"
            )
            log.error("model %s: %s", name, entry.error)
            self._drop_restart_copy(entry)
        else:
            delay = RESTART_BACKOFF_S[min(len(entry.stops), len(RESTART_BACKOFF_S)) - 1]
            action = f"restart in {delay:g} s"
            entry.state = ModelState.RESTARTING
            entry.error = f"{fault}; restarting (stop {len(entry.stops)} of {allowed} allowed)"
            log.error("model %s: %s; %s", name, fault, action)
            if entry.restart is not None:  # an earlier stop's restart: this one replaces it
                entry.restart.cancel()
            entry.restart = asyncio.get_running_loop().create_task(
                self._restart(entry, delay), name=f"restart:{name}"
            )
        entry.last_stop = EngineStop(time.time(), fault, action)
        audit.warning("engine of model %s stopped: %s; %s", name, fault, action, extra={"model": name})
        self._notify("model_stopped", [])

    async def _restart(self, entry: _Entry, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            if entry.state is not ModelState.RESTARTING:  # unloaded, revoked or loaded meanwhile
                return
            outcomes = await self.reload([entry.settings.name], force=True, trigger="restart")
            for outcome in outcomes:  # none: a reload it waited for brought the model back
                if not outcome.ok:
                    self._restart_failed(entry, outcome.reason or "no reason given")
        finally:
            if entry.restart is asyncio.current_task():
                entry.restart = None

    def _restart_failed(self, entry: _Entry, reason: str) -> None:
        """A restart's load failed: its engine died again as it loaded (killed, out of memory,
        crashed while warming). One more stop, tried again after the backoff until the breaker
        trips; never failed for good after one counted stop. Except an engine of other code
        than the daemon's (the package upgraded while it ran): no restart helps but the
        daemon's own, so the model fails at once, saying so."""
        if entry.state is ModelState.FAILED and entry.handle is None:
            entry.restart = None  # this task ends; the next stop's restart is another
            if wire.CODE_CHANGED in reason:
                name, action = entry.settings.name, "not restarted: restart the daemon"
                self.engine_restarts[name, "restart_failed"] += 1
                entry.error = f"the restart failed: {reason}"
                entry.last_stop = EngineStop(time.time(), entry.error, action)
                log.error("model %s: %s; %s", name, entry.error, action)
                audit.warning(
                    "engine of model %s stopped: %s; %s", name, entry.error, action, extra={"model": name}
                )
                self._drop_restart_copy(entry)
                self._notify("model_stopped", [])
                return
            self._count_stop(entry, f"the restart failed: {reason}", "restart_failed")

    def _cancel_restart(self, entry: _Entry) -> None:
        if entry.restart is not None and entry.restart is not asyncio.current_task():
            entry.restart.cancel()
            entry.restart = None
        self._drop_restart_copy(entry)

    def _discard_unused(self, reuse: Provenance | None, handle: ModelHandle | None) -> None:
        """Remove a stopped engine's copies that its restart did not load after all."""
        if reuse is None:
            return
        loaded = handle.provenance if handle is not None else None
        if loaded is None or loaded.copy != reuse.copy:
            self.loader.discard_copy(reuse.copy)
        if reuse.mmproj is not None and (loaded is None or _copy_of(loaded.mmproj) != reuse.mmproj.copy):
            self.loader.discard_copy(reuse.mmproj.copy)

    def _drop_restart_copy(self, entry: _Entry) -> None:
        """Remove a stopped engine's copies that no restart will load."""
        if entry.restart_from is not None:
            self.loader.discard_copy(entry.restart_from.copy)
            self.loader.discard_copy(_copy_of(entry.restart_from.mmproj))
            entry.restart_from = None

    # ---- building a handle ----------------------------------------------------------------

    def _make_room(self, settings: ModelSettings, need: int, evict: bool) -> None:
        """Keep loaded models within the memory budget, evicting idle evictable ones (LRU) if
        allowed and `evict` (the loader's figure from verified bytes; without it, only whether
        it could fit: LoadFailed when not)."""
        budget_mb = self._lifecycle.memory_budget_mb
        if budget_mb is None:
            return
        resident = [
            Resident(
                e.settings.name,
                e.handle.provenance.memory_bytes,
                e.settings.evictable and e.handle.leases == 0 and e.handle.engine.idle,
                e.handle.last_used,
            )
            for e in self._entries.values()
            if e.handle is not None and e.settings.name != settings.name
        ]
        # A reload loads the new version beside the one serving now, and a retired version
        # holds its memory until its last request ends: both count while they overlap.
        resident += [
            Resident(
                f"{h.name} (version {h.provenance.fingerprint}, until it is freed)",
                h.provenance.memory_bytes,
                False,
                0.0,
            )
            for h in self._overlapping(settings.name)
        ]
        try:
            names = evictions(budget_mb, settings.name, need, resident)
        except OverBudget as exc:
            raise LoadFailed(str(exc)) from None
        for name in names if evict else ():
            self._unload(
                self._entries[name], f"evicted to make room for {settings.name} (memory budget)", "budget"
            )

    def _overlapping(self, name: str) -> list[ModelHandle]:
        """Versions that hold memory beside a load of `name`: its serving one, and every retired
        one whose engine is not freed yet (an engine process that died holds nothing)."""
        entry = self._entries.get(name)
        serving = [entry.handle] if entry is not None and entry.handle is not None else []
        held = [h for h in self._draining if h not in serving]
        return [h for h in serving + held if not (isinstance(h.engine, RemoteEngine) and h.engine.exited)]

    # ---- freeing --------------------------------------------------------------------------

    def _retire(self, handle: ModelHandle) -> None:
        handle.retired = True
        if handle.leases == 0:
            self._dispose(handle)
        else:
            self._draining.add(handle)

    def _dispose(self, handle: ModelHandle) -> None:
        """Free a handle's engine and preloaded copy in the background (once)."""
        if handle.disposing:
            return
        handle.retired = handle.disposing = True
        self._draining.discard(handle)
        task = asyncio.get_running_loop().create_task(self._free(handle), name=f"free:{handle.name}")
        self._disposals.add(task)
        task.add_done_callback(self._disposals.discard)
        freeing = self._freeing.setdefault(handle.name, set())
        freeing.add(task)
        task.add_done_callback(freeing.discard)

    async def _free(self, handle: ModelHandle) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, handle.engine.close)
        self.loader.discard_copy(handle.provenance.copy)
        self.loader.discard_copy(_copy_of(handle.provenance.draft))
        self.loader.discard_copy(_copy_of(handle.provenance.mmproj))
        log.info("model %s: previous version %s freed", handle.name, handle.provenance.fingerprint)

    # ---- status ---------------------------------------------------------------------------

    def build_info(self) -> BuildInfo:
        """What the llama.cpp build can do (blocking): asked of a serving engine process where one
        runs (it has llama.cpp loaded), else as `engine.build` finds out; EngineError if nothing can say.

        Asked once: every engine process loads the same build, and an engine that hangs would
        hold /admin/stats for its hang_timeout_s at every ask."""
        if self._build_info is None:
            self._build_info = self._ask_build_info()
        return self._build_info

    def _ask_build_info(self) -> BuildInfo:
        for handle in self.ready_handles():
            if isinstance(handle.engine, RemoteEngine):
                with contextlib.suppress(EngineError):  # gone meanwhile: the next one, or the probe
                    return handle.engine.build_info()
        return build.build_info()

    def status(self) -> dict[str, Any]:
        """Everything /admin/status shows: the lockfile, the preload area, each model."""
        models = []
        for name, entry in self._entries.items():
            handle = entry.handle
            item: dict[str, Any] = {
                "name": name,
                "kind": entry.settings.serves,
                "state": entry.state.value,
                "reason": entry.error,
                "reloading": entry.reloading,
                "slots_total": entry.settings.slots,
                "queue_size": entry.settings.queue_size,
                # Let in past slots + queue_size: their key held less than its fair share.
                "fair_admissions": self._counters[name]["fair_admissions"],
                "evictable": entry.settings.evictable,
                "last_reload": entry.last.as_dict() if entry.last else None,
                "engine_stops": self.engine_stops[name],
                "last_engine_stop": entry.last_stop.as_dict() if entry.last_stop else None,
            }
            if handle is not None:
                prov = handle.provenance
                busy, waiting = handle.engine.occupancy()
                item.update(
                    {
                        "version": prov.lock_version,
                        "sha256": prov.locked.sha256 if prov.locked else None,
                        "file": prov.locked.file if prov.locked else str(prov.source),
                        "shm_path": str(prov.copy) if prov.copy else None,
                        "fingerprint": prov.fingerprint,
                        "loaded_at": handle.loaded_at,
                        "memory_bytes": prov.memory_bytes,
                        "slots_busy": busy,
                        "queue_depth": waiting,
                        "leases": handle.leases,
                        "threads": handle.engine.config.threads,
                        "threads_batch": handle.engine.config.threads_batch,
                        "reads": list(handle.reads),
                    }
                )
                if prov.mmproj is not None:  # its multimodal projector, as the model's own file is shown
                    item["mmproj"] = {
                        "name": prov.mmproj.name,
                        "sha256": prov.mmproj.locked.sha256 if prov.mmproj.locked else None,
                        "file": prov.mmproj.locked.file if prov.mmproj.locked else str(prov.mmproj.source),
                        "shm_path": str(prov.mmproj.copy) if prov.mmproj.copy else None,
                    }
                if handle.engine.kind == "generation":
                    item["performance"] = handle.generator.performance()
                if isinstance(handle.engine, RemoteEngine):
                    item["engine_process"] = handle.engine.process()
            models.append(item)
        budget = self._lifecycle.memory_budget_mb
        return {
            "lock": {
                "file": str(self._lock.file) if self._lock.file else None,
                "version": self.lock_version,
                "unsigned": self._lock.allow_unsigned,
            },
            "preload": {
                "dir": str(self.area.path) if self.area and self.area.path else None,
                "used_bytes": self.area.used_bytes() if self.area else 0,
            },
            "memory": {
                "budget_bytes": budget * MIB if budget else None,
                "used_bytes": sum(h.provenance.memory_bytes for h in self.ready_handles()),
            },
            # Replaced or unloaded versions that still have requests running on them.
            "draining": [
                {"name": h.name, "fingerprint": h.provenance.fingerprint, "leases": h.leases}
                for h in self._draining
            ],
            "models": models,
        }


def _copy_of(companion: CompanionProvenance | None) -> Path | None:
    """A draft model's or projector's preload copy, if it has one."""
    return companion.copy if companion is not None else None
