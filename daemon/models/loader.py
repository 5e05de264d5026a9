"""Building a serving handle for one model: budget check → verify + preload → budget (may evict)
→ GPU plan → load → template → warm-up.

Everything slow runs off the event loop; any step that fails raises LoadFailed with the reason
an operator sees, after undoing what it did (a preload copy removed, an engine closed). The
registry decides when to build and swaps the result in.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Final

from edgellmd.engine import EngineError
from edgellmd.engine.build import supports_gpu_offload
from edgellmd.engine.chat import TemplateError
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.engine.remote import RemoteEngine, abort_loads
from edgellmd.host.gpu import GpuSnapshot
from edgellmd.host.hugepages import Collapse, collapse_resident
from edgellmd.host.offload import plan_gpu_layers
from edgellmd.models.budget import estimate_bytes, kv_cache_bytes
from edgellmd.models.gguf import GgufError, gguf_layer_bytes, learned_positions, read_gguf_values
from edgellmd.models.handle import (
    AnyEngine,
    CompanionProvenance,
    EngineFactory,
    ModelHandle,
    Provenance,
    chat_template_for,
)
from edgellmd.models.lockfile import (
    LockedModel,
    LockError,
    Lockfile,
    resolve_model_file,
    shown,
)
from edgellmd.models.preload import NoRoom, PreloadArea
from edgellmd.models.verify import VerifiedFile, check_size, open_verified
from edgellmd.settings import GPU_LAYERS_AUTO, LockSettings, ModelSettings

log = logging.getLogger(__name__)

STOP_POLL_S: Final = 0.2  # how often a loading engine's wait looks at the daemon's stop
WARM_UP_TIMEOUT_S: Final = 60.0  # a short generation that takes longer than this is a broken model
# What the files loaded beside a model are called in reasons and logs (CompanionProvenance.role).
DRAFT_MODEL: Final = "draft model"
MMPROJ: Final = "mmproj"
# A multimodal projector's general.architecture: llama.cpp's converters write it in every one
# (vision and audio alike), and libmtmd loads nothing else.
PROJECTOR_ARCHITECTURE: Final = "clip"


class LoadFailed(Exception):
    """A step of building a handle failed; the message is the reason operators see."""


def stat_key(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def unreadable(path: Path, name: object) -> str:
    """Why the file at `path` (shown as `name`) cannot be stat-ed: missing, a loop, a dangling link."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{name} is a symlink loop"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return f"{name} is a symlink to a file that does not exist"
        if exc.errno == errno.ENOENT:
            return f"not found: {name}"
        return f"cannot read {name}: {exc.strerror or exc}"
    return f"{name} changed while it was looked at"


def check_projector(path: Path) -> None:
    """Refuse a file that is no multimodal projector (a text model named by mistake); LoadFailed."""
    try:
        architecture = read_gguf_values(path).get("general.architecture")
    except GgufError as exc:
        raise LoadFailed(str(exc)) from None
    if architecture != PROJECTOR_ARCHITECTURE:
        shown_arch = shown(architecture) if isinstance(architecture, str) else "missing"
        raise LoadFailed(
            f"not a multimodal projector: its GGUF architecture is {shown_arch}, not {PROJECTOR_ARCHITECTURE}"
        )


def fit_positions(settings: ModelSettings, files: tuple[Path | None, ...]) -> ModelSettings:
    """`settings` with context_size cut to the positions the model (and its draft model) learned.

    llama.cpp aborts the engine on a position past a model's learned position embeddings
    (`learned_positions`: 512 in BERT-base-sized embedders and rerankers, 1,024 in GPT-2) and
    does not bound them itself. Every position the engine decodes is below context_size and
    every longer input is a 400 naming it, so the cut keeps each request's positions inside.
    """
    limits = [n for file in files if file is not None and (n := learned_positions(file)) is not None]
    if not limits or settings.context_size <= min(limits):
        return settings
    log.warning(
        "model %s: context_size %d is past the %d positions its position embeddings hold; "
        "it serves %d tokens per slot",
        settings.name,
        settings.context_size,
        min(limits),
        min(limits),
    )
    return replace(settings, context_size=min(limits))


class Loader:
    """Builds handles: the files' checks and copies, the engine, its template and warm-up."""

    def __init__(
        self,
        executor: Executor,
        factory: EngineFactory,
        lock: LockSettings,
        *,
        gpu: Callable[[], GpuSnapshot | None] = lambda: None,
        gpu_headroom_bytes: int = 0,
        huge_pages: bool = False,
    ) -> None:
        self._executor = executor  # the prompt pool, handed to every handle
        self._huge_pages = huge_pages  # host.huge_pages: collapse what each load left resident
        self.collapsed: Collapse | None = None  # the last load's huge-page pass
        self._factory = factory
        self._lock = lock
        self._gpu = gpu  # the GPU monitor's latest snapshot, for gpu_layers: auto
        self._gpu_headroom = gpu_headroom_bytes
        self.area: PreloadArea | None = None  # set once the registry has opened it
        # The daemon stops (Registry.stop_restarts): a copy or hash in progress ends at its next
        # chunk, and no engine is started or kept (a load would hold the stop until it ended).
        self.stopping = threading.Event()

    def _unless_stopping(self, _: int) -> None:
        """A copy's or hash's progress: the daemon's stop ends it between two chunks."""
        if self.stopping.is_set():
            raise LockError("the daemon is stopping: not loaded")

    async def _start_engine(
        self, loop: asyncio.AbstractEventLoop, settings: ModelSettings, mmap: bool
    ) -> AnyEngine:
        """The engine of a load (its process started and loaded on a thread). A stop while it
        loads kills its process (`abort_loads`); one that comes once it is loaded closes it; a
        load cancelled meanwhile closes the engine the thread ends up with (never an engine
        process and memory cgroup left behind the daemon)."""
        started = loop.run_in_executor(None, self._factory, settings, mmap)
        said = False
        try:
            while not started.done():
                await asyncio.wait({started}, timeout=STOP_POLL_S)
                if self.stopping.is_set() and abort_loads([settings.name]) and not said:
                    said = True
                    log.warning(
                        "model %s: the daemon is stopping: its engine process, still loading, is killed",
                        settings.name,
                    )
        except asyncio.CancelledError:
            abort_loads([settings.name])
            started.add_done_callback(_close_in_background)
            raise
        engine = started.result()
        if self.stopping.is_set():
            await loop.run_in_executor(None, engine.close)
            raise EngineError("the daemon is stopping: not loaded")
        return engine

    async def _collapse(self, loop: asyncio.AbstractEventLoop, name: str, engine: AnyEngine) -> None:
        """Back what the load left resident with huge pages (host.hugepages); said once if not.

        In the process that holds the model: its engine process, or this one."""
        if isinstance(engine, RemoteEngine):
            try:
                result = await loop.run_in_executor(None, engine.collapse_huge_pages)
            except EngineError as exc:
                result = Collapse(unsupported=f"the engine process did not say ({exc})")
        else:
            result = await loop.run_in_executor(None, collapse_resident)
        if result.unsupported is not None:
            if self.collapsed is None or self.collapsed.unsupported is None:
                log.warning("host.huge_pages: %s; model %s stays on small pages", result.unsupported, name)
        else:
            log.info(
                "model %s: %d MiB in %d spans moved to huge pages in %.2f s%s",
                name,
                result.bytes // (1024 * 1024),
                result.spans,
                result.seconds,
                (
                    f" ({result.failed} spans, {result.failed_bytes // (1024 * 1024)} MiB, could not be now)"
                    if result.failed
                    else ""
                ),
            )
        self.collapsed = result

    def _unreadable(self, locked: LockedModel | None, source: Path) -> str:
        """Why a model's file cannot be stat-ed, judged on the path its lock entry names
        (before its symlinks are followed), or on `source` unsigned."""
        if locked is None or self._lock.models_dir is None:
            return unreadable(source, source)
        return unreadable(self._lock.models_dir / locked.file, locked.file)

    def source(self, settings: ModelSettings, locked: LockedModel | None) -> Path:
        """The model's file in the models directory (or the configured file, unsigned)."""
        if locked is not None:
            assert self._lock.models_dir is not None  # noqa: S101 - settings guarantee
            return resolve_model_file(self._lock.models_dir, locked.file)
        assert settings.file is not None  # noqa: S101 - settings guarantee (unsigned mode)
        return settings.file

    async def build(
        self,
        settings: ModelSettings,
        locked: LockedModel | None,
        lock: Lockfile | None,
        *,
        counters: Tally[str],
        make_room: Callable[[ModelSettings, int, bool], None],
        dispose: Callable[[ModelHandle], None],
        reuse: Provenance | None = None,
        media_executor: Executor | None = None,
        prompt_executor: Executor | None = None,
    ) -> ModelHandle:
        """verify + preload → load → warm-up, all off the loop; raises LoadFailed with the reason.

        `make_room(settings, need, evict)` keeps the memory budget for the estimated size (raises
        LoadFailed; with `evict`, it may unload idle evictable models first). It is asked twice:
        before verification from the headers on disk, to refuse at once what cannot fit, and
        after it from the verified bytes, the only time it may evict. `dispose` frees a handle
        whose warm-up failed.
        """
        loop = asyncio.get_running_loop()
        name = settings.name
        started = time.monotonic()
        try:
            source = self.source(settings, locked)
        except LockError as exc:
            raise LoadFailed(f"file {locked.file if locked else '?'}: {exc}") from None
        source_stat = stat_key(source)
        if source_stat is None:
            raise LoadFailed("model file " + self._unreadable(locked, source))
        # Before its header is read for the budget: a file of another size than the lock's (padded
        # to look big) is refused here, never counted, never a reason to evict. What is no
        # regular file is refused by its kind, below.
        if locked is not None and source_stat[2] != locked.size and _regular(source):
            try:
                check_size(locked, source_stat[2])
            except LockError as exc:
                raise LoadFailed(f"file {locked.file}: {exc}") from None
        draft = self.draft_source(settings, lock)
        mmproj = self.mmproj_source(settings, lock)
        # A first look at the budget, from the headers as they are on disk: it may refuse the
        # load at once (it cannot fit even with every idle evictable model gone), never evict
        # for it. Nothing is verified yet, and a file of the locked size with a lying header
        # must not make room by unloading anyone.
        await self._budget(
            settings, source, draft.source if draft else None, mmproj.source if mmproj else None, make_room
        )
        reused = reuse is not None and self.reusable(reuse, locked, source_stat, draft, mmproj)
        if reused and reuse is not None:
            # A restart after an engine died: its copies were verified and nothing changed since.
            copy, verified = reuse.copy, None
            if mmproj is not None and reuse.mmproj is not None:
                mmproj = replace(mmproj, copy=reuse.mmproj.copy)
            log.info("model %s: restarting from its verified copy %s (not hashed again)", name, copy)
        else:
            copy, verified = await self._prepare(settings, source, locked)
        load_path = copy or (verified.load_path if verified is not None else source)
        # What this load made so far, undone if a later step fails.
        copies: list[Path | None] = [copy, mmproj.copy if mmproj is not None else None]
        opened: list[VerifiedFile | None] = [verified]
        # The files loaded beside the model: checked and preloaded exactly as its own.
        draft_verified: VerifiedFile | None = None
        if draft is not None:
            draft, draft_verified = await self._prepare_companion(settings, draft, copies, opened)
        mmproj_verified: VerifiedFile | None = None
        if mmproj is not None and not reused:
            mmproj, mmproj_verified = await self._prepare_companion(
                settings, mmproj, copies, opened, check=check_projector
            )
        # The budget for real, from the verified bytes (no position past what the model learned
        # reaches llama.cpp: fit_positions): only now may it evict idle evictable models.
        try:
            settings, need = await self._budget(
                settings,
                load_path,
                _load_path(draft, draft_verified) if draft is not None else None,
                _load_path(mmproj, mmproj_verified) if mmproj is not None else None,
                make_room,
                evict=True,
            )
        except LoadFailed:
            self.discard_copies(copies)
            for file in opened:
                if file is not None:
                    file.close()
            raise
        if settings.gpu_layers == GPU_LAYERS_AUTO:
            layers, why = await loop.run_in_executor(
                None,
                partial(
                    plan_gpu_layers,
                    partial(gguf_layer_bytes, load_path),
                    snapshot=self._gpu(),
                    offload_supported=await loop.run_in_executor(None, supports_gpu_offload),
                    headroom_bytes=self._gpu_headroom,
                    kv_bytes=await loop.run_in_executor(None, kv_cache_bytes, load_path, settings),
                ),
            )
            log.info("model %s: gpu_layers auto -> %s: %s", name, "all" if layers == -1 else layers, why)
            settings = replace(settings, gpu_layers=layers)
        loaded = replace(settings, file=load_path)
        if draft is not None:  # the engine loads the draft from where it was verified, too
            draft_path = _load_path(draft, draft_verified)
            loaded = replace(
                loaded,
                speculative=replace(settings.speculative, draft_model=draft.name, draft_file=draft_path),
            )
        if mmproj is not None:  # and the projector likewise
            loaded = replace(loaded, mmproj=mmproj.name, mmproj_file=_load_path(mmproj, mmproj_verified))
        try:
            # Mapped only from a private preload copy: a file in the models directory that is
            # truncated in place under a mapping would kill the daemon (SIGBUS).
            engine = await self._start_engine(loop, loaded, copy is not None)
        except (EngineError, OSError) as exc:
            self.discard_copies(copies)
            raise LoadFailed(str(exc)) from None
        finally:
            for file in opened:
                if file is not None:
                    file.close()  # the loaded model keeps its own mapping
        if self._huge_pages:
            await self._collapse(loop, settings.name, engine)
        try:
            template = None if settings.pooled else chat_template_for(settings, engine)
        except (TemplateError, EngineError, OSError) as exc:
            await loop.run_in_executor(None, engine.close)
            self.discard_copies(copies)
            raise LoadFailed(f"chat template: {exc}") from None
        provenance = Provenance(
            source=source,
            source_stat=source_stat,
            locked=locked,
            lock_version=lock.version if lock is not None else None,
            copy=copy,
            memory_bytes=need,
            draft=draft,
            mmproj=mmproj,
        )
        handle = ModelHandle(
            settings,
            engine,
            template,
            prompt_executor or self._executor,
            provenance,
            media_executor=media_executor,
            counters=counters,
        )
        try:
            await self.warm_up(handle)
        except LoadFailed:
            dispose(handle)
            raise
        log.info(
            "model %s loaded in %.2fs (%s, %d slots x %d tokens, %s, template: %s)",
            name,
            time.monotonic() - started,
            engine.info.description,
            settings.slots,
            settings.context_size,
            f"preloaded to {copy}" if copy else f"from {source}",
            template.source if template else "none",
        )
        return handle

    async def _budget(
        self,
        settings: ModelSettings,
        model: Path,
        draft: Path | None,
        mmproj: Path | None,
        make_room: Callable[[ModelSettings, int, bool], None],
        *,
        evict: bool = False,
    ) -> tuple[ModelSettings, int]:
        """The settings fitted to the model's learned positions and the bytes the load needs, read
        from these files' headers; `make_room` keeps the budget for them (evicting only when
        `evict`) or raises LoadFailed."""
        loop = asyncio.get_running_loop()
        fitted = await loop.run_in_executor(None, fit_positions, settings, (model, draft))
        try:
            need = await loop.run_in_executor(None, estimate_bytes, model, fitted, draft, mmproj)
        except OSError as exc:
            raise LoadFailed(f"cannot read {exc.filename or model.name}: {exc.strerror}") from None
        make_room(fitted, need, evict)
        return fitted, need

    @staticmethod
    def reusable(
        reuse: Provenance,
        locked: LockedModel | None,
        source_stat: object,
        draft: CompanionProvenance | None,
        mmproj: CompanionProvenance | None,
    ) -> bool:
        """Whether a dead engine's preload copies may be loaded again as they are: the same lock
        entries, the same files in the models directory, no draft model, and the copies still
        there. A projector configured or changed since (or one verified in place, without a
        copy) is not reusable: everything is checked again."""
        return (
            reuse.copy is not None
            and reuse.locked == locked
            and reuse.source_stat == source_stat
            and draft is None
            and reuse.draft is None
            and _same_copy(reuse.mmproj, mmproj)
            and reuse.copy.is_file()
        )

    def _companion(
        self, settings: ModelSettings, lock: Lockfile | None, role: str, name: str | None, file: Path | None
    ) -> CompanionProvenance:
        """A file loaded beside the model, by its lock entry `name` (or, unsigned, at `file`); not
        yet copied. LoadFailed, naming it, when the lock does not list it or it cannot be read."""
        entry: LockedModel | None = None
        if lock is not None:
            assert name is not None  # noqa: S101 - the callers check
            entry = lock.models.get(name)
            if entry is None:
                raise LoadFailed(f"{role} {name} is not in the lockfile (version {lock.version})")
            try:
                source = self.source(settings, entry)
            except LockError as exc:
                raise LoadFailed(f"{role} {name}: file {entry.file}: {exc}") from None
        else:
            assert file is not None  # noqa: S101 - the callers check
            source = file
            name = name or source.name
        source_stat = stat_key(source)
        if source_stat is None:
            raise LoadFailed(f"{role} {name}: file " + self._unreadable(entry, source))
        return CompanionProvenance(role, name, source, source_stat, entry, None)

    def draft_source(self, settings: ModelSettings, lock: Lockfile | None) -> CompanionProvenance | None:
        """Where the model's draft model comes from (speculative mode draft), not yet copied; LoadFailed."""
        spec = settings.speculative
        if spec.mode != "draft" or settings.pooled:
            return None
        if lock is not None and spec.draft_model is None:  # settings guarantee; loaders built by hand may not
            raise LoadFailed("speculative mode draft needs speculative.draft_model with a lockfile")
        if lock is None and spec.draft_file is None:
            raise LoadFailed("speculative mode draft needs speculative.draft_file (unsigned mode)")
        return self._companion(settings, lock, DRAFT_MODEL, spec.draft_model, spec.draft_file)

    def mmproj_source(self, settings: ModelSettings, lock: Lockfile | None) -> CompanionProvenance | None:
        """The model's multimodal projector (None: it has none), not yet copied; LoadFailed."""
        if lock is None and settings.mmproj is not None and settings.mmproj_file is None:
            # Settings guarantee; loaders built by hand may not.
            raise LoadFailed("mmproj needs mmproj_file (unsigned mode)")
        if not _has_mmproj(settings, lock):
            return None
        return self._companion(settings, lock, MMPROJ, settings.mmproj, settings.mmproj_file)

    def mmproj_entry(self, settings: ModelSettings, lock: Lockfile | None) -> LockedModel | None:
        """The lock entry the model's projector would be verified against now (None: none, unsigned)."""
        if lock is None or not _has_mmproj(settings, lock) or settings.mmproj is None:
            return None
        return lock.models.get(settings.mmproj)

    def mmproj_changed(
        self, settings: ModelSettings, loaded: CompanionProvenance | None, lock: Lockfile | None
    ) -> bool:
        """True when the projector a handle was built with is not the one the model would get now:
        another (or no) `mmproj` setting, another lock entry, or its file changed on disk."""
        if not _has_mmproj(settings, lock):
            return loaded is not None
        if loaded is None:
            return True
        if lock is not None:
            if loaded.name != settings.mmproj or loaded.locked != self.mmproj_entry(settings, lock):
                return True
        elif loaded.source != settings.mmproj_file:
            return True
        return stat_key(loaded.source) != loaded.source_stat

    def draft_entry(self, settings: ModelSettings, lock: Lockfile | None) -> LockedModel | None:
        """The lock entry the model's draft model would be verified against now (None: no draft, unsigned)."""
        spec = settings.speculative
        if lock is None or spec.mode != "draft" or settings.pooled or spec.draft_model is None:
            return None
        return lock.models.get(spec.draft_model)

    def draft_changed(
        self, settings: ModelSettings, loaded: CompanionProvenance | None, lock: Lockfile | None
    ) -> bool:
        """True when the draft model a handle was built with is not the one the model would get now."""
        if settings.speculative.mode != "draft" or settings.pooled:
            return loaded is not None
        if loaded is None:
            return True
        if lock is not None and self.draft_entry(settings, lock) != loaded.locked:
            return True
        return stat_key(loaded.source) != loaded.source_stat

    async def reverify(self, settings: ModelSettings, locked: LockedModel) -> tuple[int, int, int, int]:
        """Check the model's file against its lock entry (size, sha256, GGUF header) and load nothing.

        Returns the file's stat from before the check: a file that changes while it is read
        shows a newer stat at the next look, and is checked again. Raises LoadFailed.
        """
        loop = asyncio.get_running_loop()
        assert self._lock.models_dir is not None  # noqa: S101 - settings guarantee (signed mode)
        try:
            source = self.source(settings, locked)
        except LockError as exc:
            raise LoadFailed(f"file {locked.file}: {exc}") from None
        before = stat_key(source)
        if before is None:
            raise LoadFailed("model file " + self._unreadable(locked, source))
        try:
            verified = await loop.run_in_executor(
                None, open_verified, self._lock.models_dir, locked, self._unless_stopping
            )
        except LockError as exc:
            raise LoadFailed(f"file {locked.file}: {exc}") from None
        except OSError as exc:
            raise LoadFailed(f"file {locked.file}: {exc.strerror or exc}") from None
        verified.close()
        log.info(
            "model %s: %s changed on disk but verified the same (%d bytes, sha256 %s…): the "
            "loaded model serves on",
            settings.name,
            locked.file,
            locked.size,
            locked.sha256[:16],
        )
        return before

    async def _prepare_companion(
        self,
        settings: ModelSettings,
        companion: CompanionProvenance,
        copies: list[Path | None],
        opened: list[VerifiedFile | None],
        *,
        check: Callable[[Path], None] | None = None,
    ) -> tuple[CompanionProvenance, VerifiedFile | None]:
        """Check and preload a file loaded beside the model exactly as the model's own, then
        `check` what was verified. On failure this load's `copies` are removed and its `opened`
        files closed, and LoadFailed names the companion ("mmproj NAME: ...")."""
        suffix = "mmproj" if companion.role == MMPROJ else "draft"
        try:
            copy, verified = await self._prepare(settings, companion.source, companion.locked, suffix=suffix)
            copies.append(copy)
            opened.append(verified)
            if check is not None:
                await asyncio.get_running_loop().run_in_executor(
                    None, check, copy or (verified.load_path if verified is not None else companion.source)
                )
        except LoadFailed as exc:
            self.discard_copies(copies)
            for file in opened:
                if file is not None:
                    file.close()
            raise LoadFailed(f"{companion.label}: {exc}") from None
        return replace(companion, copy=copy), verified

    async def _prepare(
        self, settings: ModelSettings, source: Path, locked: LockedModel | None, *, suffix: str = ""
    ) -> tuple[Path | None, VerifiedFile | None]:
        """Copy into the preload area while hashing, or verify in place when there is no room.

        `suffix` tells a file loaded beside the model from the model's own in the area's names.
        """
        loop = asyncio.get_running_loop()
        label = locked.file if locked is not None else source.name
        if self.area is not None:
            name = f"{settings.name}-{suffix}" if suffix else settings.name
            try:
                copy = await loop.run_in_executor(
                    None, self.area.copy, source, name, locked, self._unless_stopping
                )
            except NoRoom as exc:
                log.warning(
                    "model %s: no room to preload %s into %s (%s); loading it from the "
                    "models directory instead",
                    settings.name,
                    label,
                    self.area.root,
                    exc,
                )
            except LockError as exc:
                raise LoadFailed(f"file {label}: {exc}") from None
            except OSError as exc:
                raise LoadFailed(f"file {label}: {exc.strerror or exc}") from None
            else:
                if locked is not None:
                    log.info(
                        "model %s: %s verified (%d bytes, sha256 %s…) and preloaded",
                        settings.name,
                        locked.file,
                        locked.size,
                        locked.sha256[:16],
                    )
                return copy, None
        if locked is None:
            return None, None
        assert self._lock.models_dir is not None  # noqa: S101 - settings guarantee
        try:
            verified = await loop.run_in_executor(
                None, open_verified, self._lock.models_dir, locked, self._unless_stopping
            )
        except LockError as exc:
            raise LoadFailed(f"file {locked.file}: {exc}") from None
        # Loaded through the descriptor that was hashed: a file swapped after the check is
        # never what llama.cpp reads.
        log.info(
            "model %s: %s verified (%d bytes, sha256 %s…)",
            settings.name,
            locked.file,
            locked.size,
            locked.sha256[:16],
        )
        return None, verified

    async def warm_up(self, handle: ModelHandle) -> None:
        """A short generation (or one embedding) through the real request path."""
        engine = handle.engine
        loop = asyncio.get_running_loop()
        if isinstance(engine, RemoteEngine):
            engine.warming = True  # its supervisor counts CPU time as progress (the slowest steps)
        try:
            bos = await loop.run_in_executor(None, partial(engine.tokenize, "", add_special=True))
            bos = bos or await loop.run_in_executor(None, partial(engine.tokenize, "a", add_special=False))
            if handle.settings.pooled:
                pooled = handle.rank if handle.settings.serves == "rerank" else handle.embed
                await asyncio.wait_for(pooled([bos], tenant=""), WARM_UP_TIMEOUT_S)  # the daemon's own
                return
            gen = handle.submit(
                GenerationRequest(
                    prompt_tokens=bos, max_tokens=2, ignore_eos=True, sampling=SamplingParams(temperature=0.0)
                )
            )
            final: Finished | None = None
            async with asyncio.timeout(WARM_UP_TIMEOUT_S):
                async for event in gen.events():
                    if isinstance(event, Finished):
                        final = event
        except (EngineError, TimeoutError) as exc:
            raise LoadFailed(f"warm-up failed: {_died(handle) or str(exc) or 'timed out'}") from None
        finally:
            if isinstance(engine, RemoteEngine):
                engine.warming = False
        if final is None or final.reason == "error":
            why = _died(handle) or (final.error if final else "no result")
            raise LoadFailed(f"warm-up generation failed: {why}")

    def discard_copy(self, copy: Path | None) -> None:
        """Remove a preload copy (a failed load's, or a freed version's)."""
        if copy is not None and self.area is not None:
            self.area.remove(copy)

    def discard_copies(self, copies: list[Path | None]) -> None:
        """Remove a failed load's preload copies (the model's, its draft model's, its projector's)."""
        for copy in copies:
            self.discard_copy(copy)


def _has_mmproj(settings: ModelSettings, lock: Lockfile | None) -> bool:
    """Whether the model is configured with a projector: `mmproj` signed, `mmproj_file` unsigned."""
    return not settings.pooled and (settings.mmproj if lock is not None else settings.mmproj_file) is not None


def _load_path(companion: CompanionProvenance, verified: VerifiedFile | None) -> Path:
    """Where the engine loads a file beside the model from: its copy, its verified descriptor, or
    (unsigned, without a preload area) the file itself."""
    return companion.copy or (verified.load_path if verified is not None else companion.source)


def _same_copy(stopped: CompanionProvenance | None, now: CompanionProvenance | None) -> bool:
    """A stopped engine's companion may be loaded again as it is: both absent, or the same
    entry and file as then, and its preload copy still there."""
    if stopped is None or now is None:
        return stopped is None and now is None
    return (
        stopped.copy is not None
        and (stopped.name, stopped.locked, stopped.source, stopped.source_stat)
        == (now.name, now.locked, now.source, now.source_stat)
        and stopped.copy.is_file()
    )


def _died(handle: ModelHandle) -> str | None:
    """Why an engine process died during the load, in its own words (not "it is restarting": a
    load that fails is not restarted), with the memory limit named when one is set."""
    fault = getattr(handle.engine, "fault", None)
    if not isinstance(fault, str):
        return None
    limit = handle.settings.memory_limit_mb
    return f"{fault} (memory_limit_mb is {limit}: too low for this model?)" if limit else fault


def _close_in_background(started: asyncio.Future[AnyEngine]) -> None:
    """The engine a cancelled load's thread ended up with: closed off the event loop."""
    if started.cancelled() or started.exception() is not None:
        return
    threading.Thread(target=started.result().close, name="engine-close", daemon=True).start()
