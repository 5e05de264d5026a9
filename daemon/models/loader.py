"""Building a serving handle for one model: verify + preload → GPU plan → load → template → warm-up.

Everything slow runs off the event loop; any step that fails raises LoadFailed with the reason
an operator sees, after undoing what it did (a preload copy removed, an engine closed). The
registry decides when to build and swaps the result in.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
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
from edgellmd.engine.config import KV_BYTES_PER_VALUE
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams
from edgellmd.host.gpu import GpuSnapshot
from edgellmd.host.hugepages import Collapse, collapse_resident
from edgellmd.host.offload import plan_gpu_layers
from edgellmd.models.budget import MIB
from edgellmd.models.gguf import GgufError, gguf_layer_bytes, learned_positions, read_gguf_values
from edgellmd.models.handle import DraftProvenance, EngineFactory, ModelHandle, Provenance, chat_template_for
from edgellmd.models.lockfile import (
    LockedModel,
    LockError,
    Lockfile,
    resolve_model_file,
)
from edgellmd.models.preload import NoRoom, PreloadArea
from edgellmd.models.verify import VerifiedFile, open_verified
from edgellmd.settings import GPU_LAYERS_AUTO, LockSettings, ModelSettings

log = logging.getLogger(__name__)

WARM_UP_TIMEOUT_S: Final = 60.0  # a short generation that takes longer than this is a broken model


class LoadFailed(Exception):
    """A step of building a handle failed; the message is the reason operators see."""


def stat_key(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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


def estimate_bytes(path: Path, settings: ModelSettings, draft: Path | None = None) -> int:
    """Memory a model will take once loaded: its file, its KV cache, its prompt cache, its draft model's."""
    need = path.stat().st_size + kv_cache_bytes(path, settings) + settings.prompt_cache_mb * MIB
    if draft is not None:  # its file and its KV cache (f16, a sequence per slot as the model's)
        need += draft.stat().st_size + kv_cache_bytes(draft, settings, kinds=("f16", "f16"))
    return need


def kv_cache_bytes(path: Path, settings: ModelSettings, *, kinds: tuple[str, str] | None = None) -> int:
    """The KV cache of every slot, in the configured cache types or `kinds` (0 when the file does not say)."""
    try:
        values = read_gguf_values(path)
    except GgufError:
        return 0  # the load itself will say what is wrong with the file
    arch = values.get("general.architecture")
    layers = values.get(f"{arch}.block_count")
    embd = values.get(f"{arch}.embedding_length")
    heads = values.get(f"{arch}.attention.head_count")
    heads_kv = values.get(f"{arch}.attention.head_count_kv", heads)
    if not (
        isinstance(layers, int)
        and isinstance(embd, int)
        and isinstance(heads, int)
        and isinstance(heads_kv, int)
        and min(layers, embd, heads, heads_kv) > 0
    ):
        return 0
    values_per_side = layers * settings.context_size * settings.slots * (embd // heads) * heads_kv
    type_k, type_v = kinds or (settings.cache_type_k, settings.cache_type_v)
    per_value = KV_BYTES_PER_VALUE[type_k] + KV_BYTES_PER_VALUE[type_v]
    return int(values_per_side * per_value)


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

    async def _collapse(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        """Back what the load left resident with huge pages (host.hugepages); said once if not."""
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
                f" ({result.failed} spans could not be)" if result.failed else "",
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
        make_room: Callable[[ModelSettings, int], None],
        dispose: Callable[[ModelHandle], None],
        reuse: Provenance | None = None,
    ) -> ModelHandle:
        """verify + preload → load → warm-up, all off the loop; raises LoadFailed with the reason.

        `make_room` keeps the memory budget for the estimated size (it may evict others or
        raise LoadFailed); `dispose` frees a handle whose warm-up failed.
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
        draft = self.draft_source(settings, lock)
        # No position past what the model learned reaches llama.cpp (see fit_positions).
        settings = await loop.run_in_executor(
            None, fit_positions, settings, (source, draft.source if draft else None)
        )
        try:
            need = await loop.run_in_executor(
                None, estimate_bytes, source, settings, draft.source if draft else None
            )
        except OSError as exc:
            raise LoadFailed(f"cannot read {exc.filename or source.name}: {exc.strerror}") from None
        make_room(settings, need)
        if reuse is not None and self.reusable(reuse, locked, source_stat, draft):
            # A restart after an engine died: its copy was verified and nothing changed since.
            copy, verified = reuse.copy, None
            log.info("model %s: restarting from its verified copy %s (not hashed again)", name, copy)
        else:
            copy, verified = await self._prepare(settings, source, locked)
        load_path = copy or (verified.load_path if verified is not None else source)
        draft_verified: VerifiedFile | None = None
        if draft is not None:  # checked and preloaded exactly as the model's own file
            try:
                draft_copy, draft_verified = await self._prepare(
                    settings, draft.source, draft.locked, draft=True
                )
            except LoadFailed as exc:
                self.discard_copy(copy)
                if verified is not None:
                    verified.close()
                raise LoadFailed(f"draft model {draft.name}: {exc}") from None
            draft = replace(draft, copy=draft_copy)
        copies = [copy, draft.copy if draft is not None else None]
        if settings.gpu_layers == GPU_LAYERS_AUTO:
            layers, why = await loop.run_in_executor(
                None,
                partial(
                    plan_gpu_layers,
                    partial(gguf_layer_bytes, load_path),
                    snapshot=self._gpu(),
                    offload_supported=await loop.run_in_executor(None, supports_gpu_offload),
                    headroom_bytes=self._gpu_headroom,
                    kv_bytes=await loop.run_in_executor(None, kv_cache_bytes, source, settings),
                ),
            )
            log.info("model %s: gpu_layers auto -> %s: %s", name, "all" if layers == -1 else layers, why)
            settings = replace(settings, gpu_layers=layers)
        loaded = replace(settings, file=load_path)
        if draft is not None:  # the engine loads the draft from where it was verified, too
            draft_path = draft.copy or (
                draft_verified.load_path if draft_verified is not None else draft.source
            )
            loaded = replace(
                loaded,
                speculative=replace(settings.speculative, draft_model=draft.name, draft_file=draft_path),
            )
        try:
            # Mapped only from a private preload copy: a file in the models directory that is
            # truncated in place under a mapping would kill the daemon (SIGBUS).
            engine = await loop.run_in_executor(None, self._factory, loaded, copy is not None)
        except (EngineError, OSError) as exc:
            self.discard_copies(copies)
            raise LoadFailed(str(exc)) from None
        finally:
            for opened in (verified, draft_verified):
                if opened is not None:
                    opened.close()  # the loaded model keeps its own mapping
        if self._huge_pages:
            await self._collapse(loop, settings.name)
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
        )
        handle = ModelHandle(settings, engine, template, self._executor, provenance, counters=counters)
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

    @staticmethod
    def reusable(
        reuse: Provenance, locked: LockedModel | None, source_stat: object, draft: DraftProvenance | None
    ) -> bool:
        """Whether a dead engine's preload copy may be loaded again as it is: the same lock entry,
        the same file in the models directory, no draft model, and the copy still there."""
        return (
            reuse.copy is not None
            and reuse.locked == locked
            and reuse.source_stat == source_stat
            and draft is None
            and reuse.draft is None
            and reuse.copy.is_file()
        )

    def draft_source(self, settings: ModelSettings, lock: Lockfile | None) -> DraftProvenance | None:
        """Where the model's draft model comes from (speculative mode draft), not yet copied; LoadFailed."""
        spec = settings.speculative
        if spec.mode != "draft" or settings.pooled:
            return None
        entry: LockedModel | None = None
        if lock is not None:
            if spec.draft_model is None:  # settings guarantee; loaders built by hand may not
                raise LoadFailed("speculative mode draft needs speculative.draft_model with a lockfile")
            name = spec.draft_model
            entry = lock.models.get(name)
            if entry is None:
                raise LoadFailed(f"draft model {name} is not in the lockfile (version {lock.version})")
            try:
                source = self.source(settings, entry)
            except LockError as exc:
                raise LoadFailed(f"draft model {name}: file {entry.file}: {exc}") from None
        else:
            if spec.draft_file is None:
                raise LoadFailed("speculative mode draft needs speculative.draft_file (unsigned mode)")
            source = spec.draft_file
            name = spec.draft_model or source.name
        source_stat = stat_key(source)
        if source_stat is None:
            raise LoadFailed(f"draft model {name}: file " + self._unreadable(entry, source))
        return DraftProvenance(name, source, source_stat, entry, None)

    def draft_entry(self, settings: ModelSettings, lock: Lockfile | None) -> LockedModel | None:
        """The lock entry the model's draft model would be verified against now (None: no draft, unsigned)."""
        spec = settings.speculative
        if lock is None or spec.mode != "draft" or settings.pooled or spec.draft_model is None:
            return None
        return lock.models.get(spec.draft_model)

    def draft_changed(
        self, settings: ModelSettings, loaded: DraftProvenance | None, lock: Lockfile | None
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
            verified = await loop.run_in_executor(None, open_verified, self._lock.models_dir, locked)
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

    async def _prepare(
        self, settings: ModelSettings, source: Path, locked: LockedModel | None, *, draft: bool = False
    ) -> tuple[Path | None, VerifiedFile | None]:
        """Copy into the preload area while hashing, or verify in place when there is no room."""
        loop = asyncio.get_running_loop()
        label = locked.file if locked is not None else source.name
        if self.area is not None:
            name = f"{settings.name}-draft" if draft else settings.name
            try:
                copy = await loop.run_in_executor(None, self.area.copy, source, name, locked)
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
            verified = await loop.run_in_executor(None, open_verified, self._lock.models_dir, locked)
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
        try:
            bos = await loop.run_in_executor(None, partial(engine.tokenize, "", add_special=True))
            bos = bos or await loop.run_in_executor(None, partial(engine.tokenize, "a", add_special=False))
            if handle.settings.pooled:
                pooled = handle.rank if handle.settings.serves == "rerank" else handle.embed
                await asyncio.wait_for(pooled([bos]), WARM_UP_TIMEOUT_S)
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
        if final is None or final.reason == "error":
            why = _died(handle) or (final.error if final else "no result")
            raise LoadFailed(f"warm-up generation failed: {why}")

    def discard_copy(self, copy: Path | None) -> None:
        """Remove a preload copy (a failed load's, or a freed version's)."""
        if copy is not None and self.area is not None:
            self.area.remove(copy)

    def discard_copies(self, copies: list[Path | None]) -> None:
        """Remove a failed load's preload copies (the model's and its draft model's)."""
        for copy in copies:
            self.discard_copy(copy)


def _died(handle: ModelHandle) -> str | None:
    """Why an engine process died during the load, in its own words (not "it is restarting": a
    load that fails is not restarted), with the memory limit named when one is set."""
    fault = getattr(handle.engine, "fault", None)
    if not isinstance(fault, str):
        return None
    limit = handle.settings.memory_limit_mb
    return f"{fault} (memory_limit_mb is {limit}: too low for this model?)" if limit else fault
