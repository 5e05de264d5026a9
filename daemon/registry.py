"""Served models by name: loading them off the event loop, their state, and the handles requests use."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from edgellmd import engine as engine_mod
from edgellmd.chat import (
    NO_TEMPLATE_MESSAGE,
    BuiltinChatTemplate,
    ChatMessage,
    ChatTemplate,
    JinjaChatTemplate,
    TemplateError,
)
from edgellmd.engine import Engine, EngineConfig, EngineError
from edgellmd.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    ServerOverloaded,
    ServiceUnavailable,
)
from edgellmd.generation import Generation, GenerationRequest
from edgellmd.lockfile import (
    LockedModel,
    LockError,
    Lockfile,
    VerifiedFile,
    VersionState,
    load_lock,
    load_public_key,
    open_verified,
    verify_lock,
)
from edgellmd.settings import LockSettings, ModelSettings

log = logging.getLogger(__name__)

EngineFactory = Callable[[ModelSettings], Engine]
RETRY_AFTER_LOADING_S = "5"


class ModelState(enum.Enum):
    """Where a configured model stands."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


def engine_config(settings: ModelSettings) -> EngineConfig:
    """Translate a model's settings into what the engine needs, deciding thread counts."""
    if settings.file is None:
        raise EngineError(f"model {settings.name}: no file to load")
    threads = settings.threads or engine_mod.default_threads()
    return EngineConfig(
        path=settings.file, slots=settings.slots, context_size=settings.context_size,
        batch_size=settings.batch_size, threads=threads,
        threads_batch=settings.threads_batch or threads, gpu_layers=settings.gpu_layers,
    )


def default_engine_factory(settings: ModelSettings) -> Engine:
    """Load a model with the real llama.cpp engine (blocking)."""
    return Engine(engine_config(settings), name=settings.name)


def chat_template_for(settings: ModelSettings, engine: Engine) -> ChatTemplate | None:
    """The template a model's chat requests use: configured override first, then the GGUF's own."""
    info = engine.info
    if settings.chat_template_file is not None:
        text = settings.chat_template_file.read_text(encoding="utf-8")
        return JinjaChatTemplate(text, bos_token=info.bos_text, eos_token=info.eos_text,
                                 origin=str(settings.chat_template_file))
    if settings.chat_template is not None:
        if settings.chat_template not in engine_mod.builtin_chat_templates():
            raise TemplateError(f"chat_template {settings.chat_template!r} is not a llama.cpp "
                                "built-in template")
        return BuiltinChatTemplate(settings.chat_template, engine_mod.apply_builtin_template)
    if info.chat_template:
        return JinjaChatTemplate(info.chat_template, bos_token=info.bos_text,
                                 eos_token=info.eos_text, origin="the model file")
    return None


@dataclass(slots=True)
class ModelHandle:
    """A loaded model as requests see it: prompt preparation and generation."""

    settings: ModelSettings
    engine: Engine
    template: ChatTemplate | None
    executor: Executor
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        """The model's configured name."""
        return self.settings.name

    def _render_and_tokenize(self, messages: Sequence[ChatMessage]) -> list[int]:
        assert self.template is not None  # noqa: S101 - checked by the caller
        text = self.template.render(messages)
        # Templates that print the BOS themselves must not get a second one from the tokenizer.
        bos = self.engine.info.bos_text
        add_special = not (bos and text.startswith(bos))
        return self.engine.tokenize(text, add_special=add_special, parse_special=True)

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Render the chat template and tokenize, off the event loop."""
        if self.template is None:
            raise InvalidRequest(NO_TEMPLATE_MESSAGE.format(model=self.name), param="messages",
                                 code="chat_template_missing")
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(self.executor, self._render_and_tokenize, messages)
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        self.check_prompt(tokens, "messages")
        return tokens

    async def text_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize a completion prompt (or check given token ids), off the event loop."""
        if isinstance(prompt, str):
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(self.executor, self.engine.tokenize, prompt)
        else:
            tokens = list(prompt)
            if any(t >= self.engine.n_vocab for t in tokens):
                raise InvalidRequest(f"'prompt' token ids must be below {self.engine.n_vocab}",
                                     param="prompt")
        self.check_prompt(tokens, "prompt")
        return tokens

    def check_prompt(self, tokens: Sequence[int], param: str) -> None:
        """Refuse empty prompts and prompts that leave no room to generate in a slot."""
        if not tokens:
            raise InvalidRequest("the prompt is empty", param=param)
        limit = self.settings.context_size
        if len(tokens) >= limit:
            raise ContextLengthExceeded(
                f"this model's context is {limit} tokens per request; the prompt has "
                f"{len(tokens)} tokens and leaves no room for a reply", param=param)

    def generation_limit(self, n_prompt: int, requested: int | None) -> int:
        """Tokens a request may generate: what it asked for, capped by the room left in its slot."""
        room = self.settings.context_size - n_prompt
        return room if requested is None else min(requested, room)

    def submit(self, request: GenerationRequest) -> Generation:
        """Start a generation, or refuse at once (429) when every slot is busy and the queue full."""
        engine = self.engine
        if engine.busy_slots >= self.settings.slots and engine.queue_depth >= self.settings.queue_size:
            raise ServerOverloaded(
                f"model {self.name!r} is at capacity ({self.settings.slots} running, "
                f"{engine.queue_depth} waiting); retry shortly", headers={"Retry-After": "1"})
        return engine.submit(request, asyncio.get_running_loop())


@dataclass(slots=True)
class _Entry:
    settings: ModelSettings
    state: ModelState = ModelState.LOADING
    handle: ModelHandle | None = None
    error: str | None = None


class Registry:
    """Configured models by name, with their load state."""

    def __init__(self, models: Sequence[ModelSettings], executor: Executor,
                 factory: EngineFactory = default_engine_factory,
                 lock: LockSettings | None = None) -> None:
        self._entries = {m.name: _Entry(m) for m in models}
        self._executor = executor
        self._factory = factory
        self._lock = lock or LockSettings(allow_unsigned=True)
        self.lock_version: int | None = None  # of the lockfile the served models came from

    async def load_all(self) -> None:
        """Verify the lockfile, then load every model in turn; failures are recorded, not raised."""
        loop = asyncio.get_running_loop()
        if self._lock.allow_unsigned:
            log.warning("UNSIGNED MODE (lock.allow_unsigned): models load WITHOUT lockfile "
                        "verification; never run a production box like this")
            for entry in self._entries.values():
                await self._load(entry, None)
            return
        try:
            lock = await loop.run_in_executor(None, self._verified_lock)
        except LockError as exc:
            log.error("lockfile %s refused: %s", self._lock.file, exc)  # noqa: TRY400 - the reason is the story
            for entry in self._entries.values():
                self._fail(entry, f"lockfile refused: {exc}")
            return
        self.lock_version = lock.version
        for entry in self._entries.values():
            locked = lock.models.get(entry.settings.name)
            if locked is None:
                self._fail(entry, f"model {entry.settings.name!r} is not in the lockfile")
                continue
            await self._load(entry, locked)

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

    def _fail(self, entry: _Entry, reason: str) -> None:
        entry.state, entry.error = ModelState.FAILED, reason
        log.error("model %s refused: %s", entry.settings.name, reason)

    def _open_verified(self, locked: LockedModel) -> VerifiedFile:
        assert self._lock.models_dir is not None  # noqa: S101 - settings guarantee
        return open_verified(self._lock.models_dir, locked)

    async def _load(self, entry: _Entry, locked: LockedModel | None) -> None:
        loop = asyncio.get_running_loop()
        name = entry.settings.name
        started = time.monotonic()
        settings = entry.settings
        verified: VerifiedFile | None = None
        if locked is not None:
            try:
                verified = await loop.run_in_executor(None, self._open_verified, locked)
            except LockError as exc:
                self._fail(entry, f"file {locked.file}: {exc}")
                return
            # Load through the descriptor that was hashed: a file swapped after the check
            # is never what llama.cpp reads.
            settings = replace(settings, file=verified.load_path)
            log.info("model %s: %s verified (%d bytes, sha256 %s…)", name, locked.file,
                     locked.size, locked.sha256[:16])
        log.info("loading model %s", name)
        try:
            # The default executor keeps the prompt threads free during long loads.
            eng = await loop.run_in_executor(None, self._factory, settings)
        except (EngineError, OSError) as exc:
            self._fail(entry, str(exc))
            return
        finally:
            if verified is not None:
                verified.close()  # the loaded model keeps its own mapping
        try:
            template = chat_template_for(entry.settings, eng)
        except (TemplateError, EngineError, OSError) as exc:
            eng.close()
            entry.state, entry.error = ModelState.FAILED, f"chat template: {exc}"
            log.error("model %s has an unusable chat template: %s", name, exc)  # noqa: TRY400
            return
        entry.handle = ModelHandle(entry.settings, eng, template, self._executor)
        entry.state, entry.error = ModelState.READY, None
        log.info("model %s ready in %.2fs (%s, %d slots x %d tokens, template: %s)", name,
                 time.monotonic() - started, eng.info.description, entry.settings.slots,
                 entry.settings.context_size, template.source if template else "none")

    def get(self, name: str) -> ModelHandle:
        """The ready handle for `name`; 404 for unknown models, 503 while loading or failed."""
        entry = self._entries.get(name)
        if entry is None:
            shown = name if len(name) <= 64 and name.isprintable() else "(unprintable)"
            raise ModelNotFound(f"the model {shown!r} does not exist", param="model")
        if entry.handle is None:
            raise ServiceUnavailable(f"the model {name!r} is {entry.state.value}",
                                     headers={"Retry-After": RETRY_AFTER_LOADING_S})
        return entry.handle

    def ready_handles(self) -> list[ModelHandle]:
        """Handles of every model that can serve now, in configuration order."""
        return [e.handle for e in self._entries.values() if e.handle is not None]

    def states(self) -> dict[str, tuple[ModelState, str | None]]:
        """Each model's state and, when it failed, why."""
        return {name: (e.state, e.error) for name, e in self._entries.items()}

    @property
    def all_ready(self) -> bool:
        """True when every configured model is loaded and warmed."""
        return all(e.state is ModelState.READY for e in self._entries.values())

    async def close(self) -> None:
        """Stop every scheduler and free every model, off the event loop."""
        loop = asyncio.get_running_loop()
        for entry in self._entries.values():
            if entry.handle is not None:
                handle, entry.handle = entry.handle, None
                entry.state = ModelState.LOADING
                await loop.run_in_executor(None, handle.engine.close)
