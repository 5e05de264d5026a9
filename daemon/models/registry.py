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
import os
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Final

from edgellmd.engine import EmbeddingEngine, EngineError, supports_gpu_offload
from edgellmd.engine.chat import TemplateError
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.errors import ModelNotFound, ServiceUnavailable
from edgellmd.host.gpu import GpuSnapshot, plan_gpu_layers
from edgellmd.models.handle import (
    EngineFactory,
    ModelHandle,
    Provenance,
    chat_template_for,
    default_engine_factory,
)
from edgellmd.models.lockfile import (
    LockedModel,
    LockError,
    Lockfile,
    VerifiedFile,
    VersionState,
    load_lock,
    load_public_key,
    open_verified,
    read_gguf_values,
    resolve_model_file,
    verify_lock,
)
from edgellmd.models.preload import NoRoom, PreloadArea
from edgellmd.settings import GPU_LAYERS_AUTO, LifecycleSettings, LockSettings, ModelSettings

log = logging.getLogger(__name__)

RETRY_AFTER_LOADING_S: Final = "5"
WARM_UP_TIMEOUT_S: Final = 60.0  # a short generation that takes longer than this is a broken model
MIB: Final = 1024 * 1024
KV_BYTES_PER_VALUE: Final = 2  # llama.cpp's default KV cache type is f16

__all__ = ["ModelHandle", "ModelState", "Outcome", "Registry"]


class ModelState(enum.Enum):
    """Whether a configured model can serve now."""

    LOADING = "loading"  # first load in progress; nothing serves yet
    READY = "ready"  # serving (a reload may be running beside it)
    FAILED = "failed"  # not serving: the last load failed
    UNLOADED = "unloaded"  # not serving: an operator unloaded it, or it was evicted


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one load, reload or unload of one model came to."""

    model: str
    result: str  # "loaded", "unchanged", "unloaded" or "failed"
    reason: str | None
    trigger: str  # "start", "watch", "admin", "signal"
    at: float  # wall-clock time it finished
    version: int | None = None  # the lockfile version the model now serves from

    @property
    def ok(self) -> bool:
        """False when the operation failed."""
        return self.result != "failed"

    def as_dict(self) -> dict[str, Any]:
        """JSON form for the admin API."""
        return {"model": self.model, "result": self.result, "reason": self.reason,
                "trigger": self.trigger, "at": self.at, "version": self.version}


@dataclass(slots=True)
class _Queued:
    """A reload waiting for the registry's mutex, which later requests it covers may join."""

    names: tuple[str, ...] | None
    force: bool
    done: asyncio.Future[list[Outcome]]


class _LoadFailed(Exception):
    """A step of building a handle failed; the message is the reason operators see."""


@dataclass(slots=True)
class _Entry:
    settings: ModelSettings
    state: ModelState = ModelState.LOADING
    handle: ModelHandle | None = None
    error: str | None = None
    reloading: bool = False
    last: Outcome | None = None


def _stat_key(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def estimate_bytes(path: Path, settings: ModelSettings) -> int:
    """Memory a model will take once loaded: its file plus an f16 KV cache for every slot."""
    size = path.stat().st_size
    try:
        values = read_gguf_values(path)
    except LockError:
        return size  # the load itself will say what is wrong with the file
    arch = values.get("general.architecture")
    layers = values.get(f"{arch}.block_count")
    embd = values.get(f"{arch}.embedding_length")
    heads = values.get(f"{arch}.attention.head_count")
    heads_kv = values.get(f"{arch}.attention.head_count_kv", heads)
    if not (isinstance(layers, int) and isinstance(embd, int) and isinstance(heads, int)
            and isinstance(heads_kv, int) and min(layers, embd, heads, heads_kv) > 0):
        return size
    cells = settings.context_size * settings.slots
    kv = 2 * layers * cells * (embd // heads) * heads_kv * KV_BYTES_PER_VALUE
    return size + kv


class Registry:
    """Configured models by name, each with its current handle, state and last outcome."""

    def __init__(self, models: Sequence[ModelSettings], executor: Executor,
                 factory: EngineFactory = default_engine_factory,
                 lock: LockSettings | None = None,
                 lifecycle: LifecycleSettings | None = None, *,
                 gpu: Callable[[], GpuSnapshot | None] = lambda: None,
                 gpu_headroom_bytes: int = 0) -> None:
        self._entries = {m.name: _Entry(m) for m in models}
        self._executor = executor
        self._factory = factory
        self._lock = lock or LockSettings(allow_unsigned=True)
        self._lifecycle = lifecycle or LifecycleSettings(preload_dir=None, watch=False)
        self._gpu = gpu  # the GPU monitor's latest snapshot, for gpu_layers: auto
        self._gpu_headroom = gpu_headroom_bytes
        self._mutex = asyncio.Lock()  # one load/reload/unload at a time
        self._queued: list[_Queued] = []  # reloads waiting for the mutex
        self._disposals: set[asyncio.Task[None]] = set()
        self._freeing: dict[str, set[asyncio.Task[None]]] = {}  # by model: copies being freed
        self._draining: set[ModelHandle] = set()  # retired, waiting for their last request
        self.area: PreloadArea | None = None
        self.lock_version: int | None = None  # of the last lockfile that verified
        self.reloads: Tally[str] = Tally()  # outcomes by result
        self.reloads_by_model: Tally[tuple[str, str]] = Tally()  # by (model, result), for metrics
        # Per model, shared by every version of it: 429 server_overloaded refusals and the like.
        self._counters: dict[str, Tally[str]] = {m.name: Tally() for m in models}
        # Called with ("reload_started", []) and ("reload_finished", outcomes) around reloads.
        self.observers: list[Callable[[str, list[Outcome]], None]] = []

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
                log.warning("preload directory %s unusable (%s); models load from the models "
                            "directory", root, exc.strerror or exc)
            else:
                self.area = area
        if self._lock.allow_unsigned:
            log.warning("UNSIGNED MODE (lock.allow_unsigned): models load WITHOUT lockfile "
                        "verification; never run a production box like this")
        await self.reload(trigger="start")

    async def close(self) -> None:
        """Free every model and remove the preload area, off the event loop."""
        loop = asyncio.get_running_loop()
        async with self._mutex:
            for entry in self._entries.values():
                if entry.handle is not None:
                    handle, entry.handle = entry.handle, None
                    entry.state = ModelState.UNLOADED
                    await loop.run_in_executor(None, handle.engine.close)
            await asyncio.gather(*self._disposals, return_exceptions=True)
            if self.area is not None:
                await loop.run_in_executor(None, self.area.close)

    # ---- requests -----------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            shown = name if len(name) <= 64 and name.isprintable() else "(unprintable)"
            raise ModelNotFound(f"the model {shown!r} does not exist", param="model")
        return entry

    def get(self, name: str) -> ModelHandle:
        """The serving handle for `name`; 404 for unknown models, 503 when none serves."""
        entry = self._entry(name)
        if entry.handle is None:
            detail = f": {entry.error}" if entry.state is ModelState.UNLOADED and entry.error else ""
            raise ServiceUnavailable(f"the model {name!r} is {entry.state.value}{detail}",
                                     headers={"Retry-After": RETRY_AFTER_LOADING_S})
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

    @property
    def rejections(self) -> dict[str, int]:
        """429 server_overloaded refusals per model since start."""
        return {name: c["queue_rejections"] for name, c in self._counters.items()}

    def ready_handles(self) -> list[ModelHandle]:
        """Handles of every model that can serve now, in configuration order."""
        return [e.handle for e in self._entries.values() if e.handle is not None]

    def states(self) -> dict[str, tuple[ModelState, str | None]]:
        """Each model's state and, when it is not serving, why."""
        return {name: (e.state, e.error) for name, e in self._entries.items()}

    @property
    def all_ready(self) -> bool:
        """True when every model that should serve is loaded and warmed (unloaded ones aside)."""
        return all(e.state in (ModelState.READY, ModelState.UNLOADED) for e in self._entries.values()) \
            and any(e.state is ModelState.READY for e in self._entries.values())

    # ---- lifecycle operations -------------------------------------------------------------

    async def reload(self, names: Sequence[str] | None = None, *, force: bool = False,
                     trigger: str = "admin") -> list[Outcome]:
        """Re-verify the lockfile and replace every named model whose approved bytes changed.

        `force` reloads models whose lock entry and file look unchanged too. Models an
        operator unloaded stay unloaded unless named explicitly.
        """
        entries = [self._entry(n) for n in names] if names is not None else list(self._entries.values())
        # Coalesce: a reload still waiting for its turn reads the files only once it runs, so a
        # request that it covers (all models, or these; forced if this one is) joins it. A storm
        # of reloads thus runs at most one beside the one in progress.
        for waiting in self._queued:
            if (waiting.names is None or (names is not None and set(names) <= set(waiting.names))) \
                    and (waiting.force or not force):
                outcomes = await asyncio.shield(waiting.done)
                return [o for o in outcomes if names is None or o.model in names]
        queued = _Queued(tuple(names) if names is not None else None, force,
                         asyncio.get_running_loop().create_future())
        self._queued.append(queued)
        try:
            async with self._mutex:
                self._queued.remove(queued)
                if trigger != "start":
                    self._notify("reload_started", [])
                outcomes = await self._reload(entries, names, force=force, trigger=trigger)
                self._notify("reload_finished", outcomes)
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
        for observer in self.observers:
            try:
                observer(event, outcomes)
            except Exception:
                log.exception("registry observer failed on %s", event)

    async def _reload(self, entries: list[_Entry], names: Sequence[str] | None, *, force: bool,
                      trigger: str) -> list[Outcome]:
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
            outcomes.append(await self._refresh(entry, lock, force=force, trigger=trigger))
        return outcomes

    async def load(self, name: str) -> Outcome:
        """Load a model that is unloaded or failed (an operator's request)."""
        return (await self.reload([name], trigger="admin"))[0]

    async def unload(self, name: str) -> Outcome:
        """Stop serving a model; requests in flight finish on it first."""
        entry = self._entry(name)
        async with self._mutex:
            return self._unload(entry, "unloaded by an operator", "admin")

    def _unload(self, entry: _Entry, reason: str, trigger: str) -> Outcome:
        handle, entry.handle = entry.handle, None
        entry.state, entry.error = ModelState.UNLOADED, reason
        if handle is not None:
            self._retire(handle)
        log.info("model %s unloaded: %s", entry.settings.name, reason)
        return self._record(entry, Outcome(entry.settings.name, "unloaded", reason, trigger, time.time()))

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
        log.info("lockfile %s version %d verified (signed by key %s…)", self._lock.file,
                 lock.version, signer[:16])
        return lock

    def _source(self, entry: _Entry, locked: LockedModel | None) -> Path:
        if locked is not None:
            assert self._lock.models_dir is not None  # noqa: S101 - settings guarantee
            return resolve_model_file(self._lock.models_dir, locked.file)
        assert entry.settings.file is not None  # noqa: S101 - settings guarantee (unsigned mode)
        return entry.settings.file

    def _changed(self, entry: _Entry, locked: LockedModel | None) -> bool:
        handle = entry.handle
        if handle is None:
            return True
        prov = handle.provenance
        if locked != prov.locked:
            return True
        try:
            source = self._source(entry, locked)
        except LockError:
            return True  # let the load say why
        return _stat_key(source) != prov.source_stat

    async def _refresh(self, entry: _Entry, lock: Lockfile | None, *, force: bool,
                       trigger: str) -> Outcome:
        name = entry.settings.name
        locked: LockedModel | None = None
        if lock is not None:
            locked = lock.models.get(name)
            if locked is None:
                # A newer signed lock that drops a model revokes it: it stops serving.
                reason = f"model {name!r} is not in the lockfile (version {lock.version})"
                if entry.handle is not None:
                    self._unload(entry, reason, trigger)
                return self._failed(entry, reason, trigger)
        if not force and not self._changed(entry, locked):
            return self._record(entry, Outcome(name, "unchanged", None, trigger, time.time(),
                                               self._version(entry)), log_it=False)
        old = entry.handle
        if old is None:
            entry.state = ModelState.LOADING
        entry.reloading = True
        try:
            # At most one copy beside the serving one: versions retired by earlier reloads
            # (their last request is done) are freed before another is built.
            await asyncio.gather(*self._freeing.get(name, ()), return_exceptions=True)
            handle = await self._build(entry.settings, locked, lock)
        except _LoadFailed as exc:
            return self._failed(entry, str(exc), trigger)
        finally:
            entry.reloading = False
        if old is not None and not force and old.provenance.locked == locked and locked is not None:
            # Same approved bytes (the file was touched or rewritten identically): keep the
            # warm one, note the new stat so the next check does not reload it again.
            old.provenance = replace(old.provenance, source_stat=handle.provenance.source_stat,
                                     lock_version=handle.provenance.lock_version)
            self._retire(handle)
            return self._record(entry, Outcome(name, "unchanged", None, trigger, time.time(),
                                               self._version(entry)))
        entry.handle, entry.state, entry.error = handle, ModelState.READY, None  # the swap
        if old is not None:
            self._retire(old)
        log.info("model %s now serving %s (%s)", name, handle.provenance.fingerprint,
                 "replaced the previous version" if old is not None else "first load")
        return self._record(entry, Outcome(name, "loaded", None, trigger, time.time(),
                                           handle.provenance.lock_version))

    @staticmethod
    def _version(entry: _Entry) -> int | None:
        return entry.handle.provenance.lock_version if entry.handle is not None else None

    def _failed(self, entry: _Entry, reason: str, trigger: str) -> Outcome:
        if entry.handle is None and entry.state is not ModelState.UNLOADED:
            entry.state, entry.error = ModelState.FAILED, reason
        serving = " (the previous version keeps serving)" if entry.handle is not None else ""
        log.error("model %s: %s failed: %s%s", entry.settings.name,
                  "load" if trigger == "start" else "reload", reason, serving)
        return self._record(entry, Outcome(entry.settings.name, "failed", reason, trigger,
                                           time.time(), self._version(entry)), log_it=False)

    def _record(self, entry: _Entry, outcome: Outcome, *, log_it: bool = True) -> Outcome:
        # "unchanged" does not hide the last load, but it does replace a failure: once the
        # file or lockfile is fixed, /admin/status, `edgellmctl status` and systemd's STATUS=
        # must stop reporting a fault that is gone.
        recovered = entry.last is not None and not entry.last.ok and outcome.ok
        if outcome.result != "unchanged" or entry.last is None or recovered:
            entry.last = outcome
        if recovered:
            log.info("model %s: recovered (%s) after the failed reload", outcome.model, outcome.result)
        self.reloads[outcome.result] += 1
        self.reloads_by_model[outcome.model, outcome.result] += 1
        if log_it and outcome.result != "loaded":
            log.info("model %s: %s", outcome.model, outcome.result)
        return outcome

    # ---- building a handle ----------------------------------------------------------------

    async def _build(self, settings: ModelSettings, locked: LockedModel | None,
                     lock: Lockfile | None) -> ModelHandle:
        """verify + preload → load → warm-up, all off the loop; raises _LoadFailed with the reason."""
        loop = asyncio.get_running_loop()
        name = settings.name
        started = time.monotonic()
        try:
            source = self._source(_Entry(settings), locked)
        except LockError as exc:
            raise _LoadFailed(f"file {locked.file if locked else '?'}: {exc}") from None
        source_stat = _stat_key(source)
        if source_stat is None:
            raise _LoadFailed(f"model file not found: {locked.file if locked else source}")
        try:
            need = await loop.run_in_executor(None, estimate_bytes, source, settings)
        except OSError as exc:
            raise _LoadFailed(f"cannot read {source.name}: {exc.strerror}") from None
        await self._make_room(settings, need)
        copy, verified = await self._prepare(settings, source, locked)
        load_path = copy or (verified.load_path if verified is not None else source)
        if settings.gpu_layers == GPU_LAYERS_AUTO:
            layers, why = await loop.run_in_executor(None, partial(
                plan_gpu_layers, load_path, snapshot=self._gpu(), offload_supported=supports_gpu_offload(),
                headroom_bytes=self._gpu_headroom, kv_bytes=need - source_stat[2]))
            log.info("model %s: gpu_layers auto -> %s: %s", name, "all" if layers == -1 else layers, why)
            settings = replace(settings, gpu_layers=layers)
        try:
            # Mapped only from a private preload copy: a file in the models directory that is
            # truncated in place under a mapping would kill the daemon (SIGBUS).
            engine = await loop.run_in_executor(None, self._factory, replace(settings, file=load_path),
                                                copy is not None)
        except (EngineError, OSError) as exc:
            self._discard_copy(copy)
            raise _LoadFailed(str(exc)) from None
        finally:
            if verified is not None:
                verified.close()  # the loaded model keeps its own mapping
        try:
            template = None if settings.embedding else chat_template_for(settings, engine)
        except (TemplateError, EngineError, OSError) as exc:
            await loop.run_in_executor(None, engine.close)
            self._discard_copy(copy)
            raise _LoadFailed(f"chat template: {exc}") from None
        provenance = Provenance(source=source, source_stat=source_stat, locked=locked,
                                lock_version=lock.version if lock is not None else None,
                                copy=copy, memory_bytes=need)
        handle = ModelHandle(settings, engine, template, self._executor, provenance,
                             counters=self._counters[name])
        try:
            await self._warm_up(handle)
        except _LoadFailed:
            self._dispose(handle)
            raise
        log.info("model %s loaded in %.2fs (%s, %d slots x %d tokens, %s, template: %s)", name,
                 time.monotonic() - started, engine.info.description, settings.slots,
                 settings.context_size, f"preloaded to {copy}" if copy else f"from {source}",
                 template.source if template else "none")
        return handle

    async def _prepare(self, settings: ModelSettings, source: Path,
                       locked: LockedModel | None) -> tuple[Path | None, VerifiedFile | None]:
        """Copy into the preload area while hashing, or verify in place when there is no room."""
        loop = asyncio.get_running_loop()
        label = locked.file if locked is not None else source.name
        if self.area is not None:
            try:
                copy = await loop.run_in_executor(None, self.area.copy, source, settings.name, locked)
            except NoRoom as exc:
                log.warning("model %s: no room to preload %s into %s (%s); loading it from the "
                            "models directory instead", settings.name, label, self.area.root, exc)
            except LockError as exc:
                raise _LoadFailed(f"file {label}: {exc}") from None
            except OSError as exc:
                raise _LoadFailed(f"file {label}: {exc.strerror or exc}") from None
            else:
                if locked is not None:
                    log.info("model %s: %s verified (%d bytes, sha256 %s…) and preloaded",
                             settings.name, locked.file, locked.size, locked.sha256[:16])
                return copy, None
        if locked is None:
            return None, None
        assert self._lock.models_dir is not None  # noqa: S101 - settings guarantee
        try:
            verified = await loop.run_in_executor(None, open_verified, self._lock.models_dir, locked)
        except LockError as exc:
            raise _LoadFailed(f"file {locked.file}: {exc}") from None
        # Loaded through the descriptor that was hashed: a file swapped after the check is
        # never what llama.cpp reads.
        log.info("model %s: %s verified (%d bytes, sha256 %s…)", settings.name, locked.file,
                 locked.size, locked.sha256[:16])
        return None, verified

    async def _warm_up(self, handle: ModelHandle) -> None:
        """A short generation (or one embedding) through the real request path."""
        engine = handle.engine
        try:
            bos = engine.tokenize("", add_special=True) or engine.tokenize("a", add_special=False)
            if isinstance(engine, EmbeddingEngine):
                await asyncio.wait_for(handle.embed([bos]), WARM_UP_TIMEOUT_S)
                return
            gen = handle.submit(GenerationRequest(prompt_tokens=bos, max_tokens=2, ignore_eos=True,
                                                  sampling=SamplingParams(temperature=0.0)))
            final: Finished | None = None
            async with asyncio.timeout(WARM_UP_TIMEOUT_S):
                async for event in gen.events():
                    if isinstance(event, Finished):
                        final = event
        except (EngineError, TimeoutError) as exc:
            raise _LoadFailed(f"warm-up failed: {str(exc) or 'timed out'}") from None
        if final is None or final.reason == "error":
            raise _LoadFailed(f"warm-up generation failed: {final.error if final else 'no result'}")

    async def _make_room(self, settings: ModelSettings, need: int) -> None:
        """Keep loaded models within the memory budget, evicting idle evictable ones (LRU) if allowed."""
        budget_mb = self._lifecycle.memory_budget_mb
        if budget_mb is None:
            return
        budget = budget_mb * MIB
        # The model being replaced is not counted: its old copy is freed once its requests end.
        others = [e for e in self._entries.values()
                  if e.handle is not None and e.settings.name != settings.name]
        used = sum(e.handle.provenance.memory_bytes for e in others if e.handle is not None)
        if used + need <= budget:
            return
        candidates = sorted((e for e in others if e.settings.evictable and e.handle is not None
                             and e.handle.leases == 0 and e.handle.engine.idle),
                            key=lambda e: e.handle.last_used if e.handle else 0.0)
        evict: list[_Entry] = []
        for cand in candidates:
            if used + need <= budget:
                break
            assert cand.handle is not None  # noqa: S101 - filtered above
            used -= cand.handle.provenance.memory_bytes
            evict.append(cand)
        if used + need > budget:
            raise _LoadFailed(
                f"memory budget exceeded: {settings.name} needs about {need // MIB} MiB, "
                f"{(budget - used) // MIB} MiB of the {budget_mb} MiB budget is free and no idle "
                "evictable model can make room")
        for cand in evict:
            self._unload(cand, f"evicted to make room for {settings.name} (memory budget)", "budget")

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
        self._discard_copy(handle.provenance.copy)
        log.info("model %s: previous version %s freed", handle.name, handle.provenance.fingerprint)

    def _discard_copy(self, copy: Path | None) -> None:
        if copy is not None and self.area is not None:
            self.area.remove(copy)

    # ---- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Everything /admin/status shows: the lockfile, the preload area, each model."""
        models = []
        for name, entry in self._entries.items():
            handle = entry.handle
            item: dict[str, Any] = {
                "name": name, "kind": "embedding" if entry.settings.embedding else "generation",
                "state": entry.state.value, "reason": entry.error, "reloading": entry.reloading,
                "slots_total": entry.settings.slots, "queue_size": entry.settings.queue_size,
                "evictable": entry.settings.evictable,
                "last_reload": entry.last.as_dict() if entry.last else None,
            }
            if handle is not None:
                prov = handle.provenance
                busy, waiting = handle.engine.occupancy()
                item.update({
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
                })
            models.append(item)
        budget = self._lifecycle.memory_budget_mb
        return {
            "lock": {"file": str(self._lock.file) if self._lock.file else None,
                     "version": self.lock_version, "unsigned": self._lock.allow_unsigned},
            "preload": {"dir": str(self.area.path) if self.area and self.area.path else None,
                        "used_bytes": self.area.used_bytes() if self.area else 0},
            "memory": {"budget_bytes": budget * MIB if budget else None,
                       "used_bytes": sum(h.provenance.memory_bytes for h in self.ready_handles())},
            # Replaced or unloaded versions that still have requests running on them.
            "draining": [{"name": h.name, "fingerprint": h.provenance.fingerprint, "leases": h.leases}
                         for h in self._draining],
            "models": models,
        }
