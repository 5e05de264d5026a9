"""A loaded model as requests see it: prompt preparation, generation, embeddings, and its identity."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

from edgellmd.engine import EngineConfig, EngineError, GrammarError, default_threads
from edgellmd.engine.chat import (
    NO_TEMPLATE_MESSAGE,
    BuiltinChatTemplate,
    ChatMessage,
    ChatTemplate,
    JinjaChatTemplate,
    Part,
    Segment,
    TemplateError,
    json_keys,
)
from edgellmd.engine.config import MediaChunk, MediaError, MediaInput, MediaLimits, PreparedMedia
from edgellmd.engine.drafts import Speculation
from edgellmd.engine.generation import (
    ENGINE_STOPPED,
    Generation,
    GenerationRequest,
    Grammar,
    MediaSpan,
    placeholders,
)
from edgellmd.engine.remote import RemoteEngine
from edgellmd.engine.tool_turns import tool_turns
from edgellmd.errors import (
    ContextLengthExceeded,
    EngineFailed,
    InvalidRequest,
    ServerOverloaded,
    ServiceUnavailable,
)
from edgellmd.files import read_regular
from edgellmd.models.budget import MIB, estimate_bytes
from edgellmd.models.lockfile import LockedModel
from edgellmd.settings import ModelSettings

if TYPE_CHECKING:  # the in-process engines load llama.cpp: imported where a model runs in a thread
    from edgellmd.engine.embedding import EmbeddingEngine
    from edgellmd.engine.scheduler import Engine

AnyEngine: TypeAlias = "Engine | EmbeddingEngine | RemoteEngine"
# What serves generations (embeddings): in this process or in an engine process.
Generator: TypeAlias = "Engine | RemoteEngine"
Embedder: TypeAlias = "EmbeddingEngine | RemoteEngine"
# (settings, mmap): mmap is True only for a private preload copy, which nobody else can
# truncate under the mapping (see engine_config).
EngineFactory = Callable[[ModelSettings, bool], AnyEngine]

MAX_TEMPLATE_BYTES = 1024 * 1024  # a chat template file is a few kilobytes
# Seconds a refused request is told to wait (429 at capacity; 503 when its model version was
# swapped or unloaded under it): a slot frees, or the next version serves, within about that.
RETRY_AFTER_BUSY_S: Final = "1"
RETRY_AFTER_LOADING_S: Final = "5"  # for a model that does not serve now (503), and /readyz's
# Past `slots + queue_size`, a key below its fair share of that room is still admitted, up to
# this many times the room in all (check_capacity): the bound on what one model holds.
FAIR_OVERFLOW: Final = 2
# models[].prefill_chunk when unset and nothing is offloaded. On 2 CPU cores (docs/benchmarks.md,
# fair share) a step of 8 decodes took 50 ms, and each prompt token about 1.6 ms more: 64
# tokens keep a step near 150 ms; 512 made steps of 700 ms, and 32 cost a tenth of the throughput.
CPU_PREFILL_CHUNK: Final = 64
# A prompt longer than this many characters per token of the context is first tokenized in
# prefixes (see ModelHandle._tokenize_bounded). Real text averages 3 to 5 characters a token.
PREFIX_CHARS_PER_TOKEN = 8


def _prefix_slack(limit: int) -> int:
    """Tokens a prefix cut mid-word may hold beyond what the same text holds in the whole."""
    return 16 + limit // 8


def engine_config(settings: ModelSettings, *, mmap: bool = False) -> EngineConfig:
    """Translate a model's settings into what the engine needs, deciding thread counts.

    `mmap`: memory-map the file rather than read it. Only for a private preload copy: a
    mapped file that someone truncates in place kills the process with SIGBUS at the next
    touch of a lost page, so a file in the models directory is read into memory instead.
    """
    if settings.file is None:
        raise EngineError(f"model {settings.name}: no file to load")
    gpu_layers = settings.gpu_layers
    if isinstance(gpu_layers, str):  # "auto": the loader sizes it from free VRAM before this
        raise EngineError(
            f"model {settings.name}: gpu_layers {gpu_layers} was not resolved to a layer count before loading"
        )
    threads = settings.threads or default_threads()
    spec = settings.speculative
    draft: Path | None = None  # speculative mode draft: the draft model's file (an embedder has none)
    if spec.mode == "draft" and not settings.pooled:
        if spec.draft_file is None:
            raise EngineError(f"model {settings.name}: speculative mode draft without a draft model file")
        draft = spec.draft_file
    return EngineConfig(
        path=settings.file,
        slots=settings.slots,
        context_size=settings.context_size,
        batch_size=settings.batch_size,
        threads=threads,
        threads_batch=settings.threads_batch or threads,
        gpu_layers=gpu_layers,
        mmap=mmap,
        cache_type_k=settings.cache_type_k,
        cache_type_v=settings.cache_type_v,
        flash_attention=settings.flash_attention,
        prompt_cache_bytes=settings.prompt_cache_mb * MIB,
        batch_padding=settings.batch_padding,
        preempt_steps=settings.preempt_steps,
        prefill_chunk=settings.prefill_chunk or (settings.batch_size if gpu_layers else CPU_PREFILL_CHUNK),
        queue_timeout_s=settings.queue_timeout_s or 0.0,
        rank=settings.serves == "rerank",
        inputs_per_decode=settings.inputs_per_decode,
        speculative=Speculation(
            mode=spec.mode,
            max_draft=spec.max_draft,
            ngram_min=spec.ngram_min,
            ngram_max=spec.ngram_max,
            max_sequences=spec.max_sequences,
            draft_path=draft,
            draft_name=spec.draft_model or (draft.name if draft is not None else ""),
            draft_p_min=spec.draft_p_min,
            # Mapped only when both are private preload copies (the loader puts them side by side
            # in its area); a draft verified in place, or unsigned, is read like the model's own.
            draft_mmap=mmap and draft is not None and draft.parent == settings.file.parent,
        ),
        # The projector's file as the loader verified it (its preload copy or descriptor).
        mmproj=None if settings.pooled else settings.mmproj_file,
    )


def memory_group_limit(settings: ModelSettings) -> int | None:
    """The engine process's memory cgroup limit: what the budget counts for the model (the same
    estimate the loader keeps room for) plus the headroom; None without a group."""
    if not settings.memory_group or settings.file is None:
        return None
    need = estimate_bytes(settings.file, settings, settings.speculative.draft_file, settings.mmproj_file)
    return need + settings.memory_group_headroom_mb * MIB


def default_engine_factory(settings: ModelSettings, mmap: bool = False) -> AnyEngine:
    """Load a model with the real llama.cpp engine (blocking): a generator or an embedder, on a
    thread of the daemon's or in an engine process of its own (`isolation`)."""
    config = engine_config(settings, mmap=mmap)
    if settings.isolation == "process":
        kind = settings.serves
        limit = settings.memory_limit_mb * MIB if settings.memory_limit_mb else None
        return RemoteEngine(
            config,
            name=settings.name,
            kind=kind,
            hang_s=settings.hang_timeout_s,
            address_space=limit,
            memory_max=memory_group_limit(settings),
        )
    # An in-process engine: llama.cpp is loaded into the daemon from here on.
    if settings.pooled:
        from edgellmd.engine.embedding import EmbeddingEngine  # noqa: PLC0415 - see above

        return EmbeddingEngine(config, name=settings.name)
    from edgellmd.engine.scheduler import Engine  # noqa: PLC0415 - see above

    return Engine(config, name=settings.name)


def chat_template_for(settings: ModelSettings, engine: AnyEngine) -> ChatTemplate | None:
    """The template a model's chat requests use: configured override first, then the GGUF's own."""
    info = engine.info
    if settings.chat_template_file is not None:
        try:
            text = read_regular(settings.chat_template_file, MAX_TEMPLATE_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise TemplateError(f"{settings.chat_template_file} is not UTF-8") from None
        return JinjaChatTemplate(
            text, bos_token=info.bos_text, eos_token=info.eos_text, origin=str(settings.chat_template_file)
        )
    if settings.chat_template is not None:
        # An engine process renders with its own llama.cpp: the daemon calls no native code.
        if isinstance(engine, RemoteEngine):
            names, apply = engine.builtin_templates, engine.apply_builtin_template
        else:  # an in-process engine: llama.cpp is loaded here already
            from edgellmd.engine import native  # noqa: PLC0415 - see default_engine_factory

            names, apply = native.builtin_chat_templates(), native.apply_builtin_template
        if settings.chat_template not in names:
            raise TemplateError(
                f"chat_template {settings.chat_template!r} is not a llama.cpp built-in template"
            )
        return BuiltinChatTemplate(settings.chat_template, apply)
    if info.chat_template:
        return JinjaChatTemplate(
            info.chat_template, bos_token=info.bos_text, eos_token=info.eos_text, origin="the model file"
        )
    return None


# What each `reasoning:` setting means: the tags between which a model thinks.
REASONING_TAGS: Final = {"deepseek": ("<think>", "</think>")}


def _release_held(job: asyncio.Future[Prompt | MediaPlan]) -> None:
    """A prompt nobody waits for any more: let go of the chunks its media hold."""
    result = job.result() if not job.cancelled() and job.exception() is None else None
    if isinstance(result, Prompt) and result.held is not None:
        result.held.release()


@dataclass(frozen=True, slots=True)
class MediaPlan:
    """A rendered prompt whose images and clips are still to be prepared: its parts (text
    segments and media positions), the items, those the template kept, and whether the
    tokenizer adds the BOS. Its text alone has been found to fit."""

    parts: list[Part]
    media: tuple[MediaInput, ...]
    used: list[int]
    add_special: bool
    opened: bool  # the template opened the model's reasoning at the end


def _free_compiled(job: Future[list[Grammar]]) -> None:
    if not job.cancelled() and job.exception() is None:
        for grammar in job.result():
            grammar.free()


def _release_prepared(engine: Generator, job: Future[PreparedMedia]) -> None:
    if not job.cancelled() and job.exception() is None:
        MediaHold(engine, [p.key for p in job.result().pieces if isinstance(p, MediaChunk)]).release()


class MediaHold:
    """The chunks an engine holds for a prompt's images and clips, until the request lets go
    (`release`, idempotent: the session's end)."""

    def __init__(self, engine: Generator, keys: Sequence[str]) -> None:
        self.engine = engine
        self.keys = tuple(keys)
        self._released = False

    def release(self) -> None:
        """Let the engine keep them or drop them as its store needs (any thread)."""
        if not self._released:
            self._released = True
            with contextlib.suppress(EngineError):
                self.engine.release_media(self.keys)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered, tokenized chat prompt."""

    tokens: list[int]
    reasoning_open: bool = False  # the template opened the model's thinking: the reply starts in it
    media: tuple[MediaSpan, ...] = ()  # where its images and clips stand in `tokens`
    media_items: tuple[MediaInput, ...] = ()  # those images and clips, in order (to prepare again)
    held: MediaHold | None = None  # their chunks in the engine: released when the request ends


def _gone(engine: object, name: str) -> ServiceUnavailable:
    """What a request is told whose engine went away while it was prepared (tokenized,
    rendered, its grammar compiled): its engine died or hung (it restarts), or an unload or a
    swap retired it."""
    if getattr(engine, "fault", None) is not None:
        return EngineFailed(ENGINE_STOPPED, headers={"Retry-After": RETRY_AFTER_LOADING_S})
    return ServiceUnavailable(
        f"the model {name!r} was unloaded while the request was prepared; retry",
        headers={"Retry-After": RETRY_AFTER_BUSY_S},
    )


@dataclass(frozen=True, slots=True)
class CompanionProvenance:
    """Where a file loaded beside the model came from, as Provenance says it for the model's own:
    its draft model (speculative mode draft) or its multimodal projector (mmproj)."""

    role: str  # "draft model" or "mmproj": what reasons and logs call it
    name: str  # its lock entry (or, unsigned, the configured name or the file's)
    source: Path
    source_stat: tuple[int, int, int, int] | None
    locked: LockedModel | None
    copy: Path | None

    @property
    def label(self) -> str:
        """How a reason names it: "mmproj NAME", "draft model NAME"."""
        return f"{self.role} {self.name}"


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a loaded model's bytes came from, for status pages and change detection."""

    source: Path  # the file in the models directory (or the configured file, unsigned)
    source_stat: tuple[int, int, int, int] | None  # dev, inode, size, mtime_ns when verified
    locked: LockedModel | None  # the lock entry it was verified against; None: unsigned mode
    lock_version: int | None
    copy: Path | None  # the preloaded copy it was loaded from; None: loaded from `source`
    memory_bytes: int  # estimated: weights plus KV cache (the draft model's and projector's included)
    draft: CompanionProvenance | None = None  # speculative mode draft: its draft model
    mmproj: CompanionProvenance | None = None  # its multimodal projector (images, audio)

    @property
    def fingerprint(self) -> str:
        """A short identity of the served bytes, sent as OpenAI's system_fingerprint.

        A projector's bytes are part of them (what an image becomes is its doing); a draft
        model's are not (drafts never change the output).
        """
        if self.locked is None:
            return "edgellm-unsigned"
        served = f"edgellm-v{self.lock_version}-{self.locked.sha256[:12]}"
        if self.mmproj is not None and self.mmproj.locked is not None:
            served += f"-{self.mmproj.locked.sha256[:12]}"
        return served


@dataclass(slots=True, eq=False)
class ModelHandle:
    """One loaded model; requests hold a lease on it for their whole life (see Registry.lease)."""

    settings: ModelSettings
    engine: AnyEngine
    template: ChatTemplate | None
    executor: Executor
    provenance: Provenance
    # Where images and clips wait for the engine to prepare them: the model's own media pool,
    # not the prompt pool, whose threads every model's text needs (a clip of minutes held one
    # for seconds). None: the prompt pool (handles made outside a daemon).
    media_executor: Executor | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    loaded_at: float = field(default_factory=time.time)
    leases: int = 0  # requests using it now
    retired: bool = False  # replaced or unloaded: freed when the last lease ends
    disposing: bool = False  # its engine is being closed
    counters: Tally[str] = field(default_factory=Tally)  # the model's, shared across its versions
    last_used: float = field(default_factory=time.monotonic)
    _rerank_pieces: list[list[int] | str] | None = None  # `_rerank_template`, once read
    _pooled: Tally[str] = field(default_factory=Tally)  # embed/rank calls in flight, by key (_pool)

    @property
    def name(self) -> str:
        """The model's configured name."""
        return self.settings.name

    def _serving(self, kind: str, refusal: str) -> AnyEngine:
        """The engine when it serves `kind`; else the 400 `refusal` (model_not_supported)."""
        if self.engine.kind == kind:
            return self.engine
        raise InvalidRequest(f"the model {self.name!r} {refusal}", param="model", code="model_not_supported")

    @property
    def reads(self) -> tuple[str, ...]:
        """What the model's requests may hold: "text", and "image" or "audio" where its projector
        reads them (a generation model's; embedding and reranking models read text)."""
        if self.engine.kind != "generation":
            return ("text",)
        return ("text", *cast("Generator", self.engine).media_kinds)

    @property
    def generator(self) -> Generator:
        """The text generation engine; 400 for an embedding or reranking model."""
        use = "is a reranking model: use /v1/rerank" if self.engine.kind == "rerank" else None
        return cast(
            "Generator", self._serving("generation", use or "is an embedding model: use /v1/embeddings")
        )

    @property
    def embedder(self) -> Embedder:
        """The embedding engine; 400 for any other model."""
        return cast("Embedder", self._serving("embedding", "does not produce embeddings"))

    @property
    def ranker(self) -> Embedder:
        """The reranking engine (one score per input); 400 for any other model."""
        refusal = "does not rerank: a reranking model is configured with kind: rerank"
        return cast("Embedder", self._serving("rerank", refusal))

    def _tokenize_bounded(
        self,
        text: str,
        param: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        whole: Callable[[], list[int]] | None = None,
        what: str | None = None,
    ) -> list[int]:
        """Tokenize `text`, giving up early (400) once a prefix proves it cannot fit the context.

        Tokenizing is linear or worse in the text's length and runs on the prompt pool that
        every request shares, so a prompt far past the context must not be tokenized whole:
        prefixes of growing length (`PREFIX_CHARS_PER_TOKEN` characters per token of the
        context, doubling) are tried first. A prefix cut mid-word may hold a few more tokens
        than the same text inside the whole prompt, so a prefix must exceed the limit by
        `_prefix_slack` before it proves anything. `whole` tokenizes the whole prompt when
        that is not `text` tokenized plainly (a chat prompt's segments).
        """
        limit = self.settings.context_size
        enough = limit + _prefix_slack(limit)
        chars = limit * PREFIX_CHARS_PER_TOKEN
        while chars < len(text):
            n_prefix = len(
                self.engine.tokenize(text[:chars], add_special=add_special, parse_special=parse_special)
            )
            if n_prefix >= enough:
                at_least = n_prefix - _prefix_slack(limit)
                per = "per request" if what is None else "per pair of query and document"
                what = what or ("an input" if self.settings.pooled else "the prompt")
                raise ContextLengthExceeded(
                    f"this model's context is {limit} tokens {per}; {what} has at least "
                    f"{at_least} tokens (its first {chars} characters alone)",
                    param=param,
                )
            chars *= 2
        if whole is not None:
            return whole()
        return self.engine.tokenize(text, add_special=add_special, parse_special=parse_special)

    def _render_and_tokenize(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        limits: MediaLimits | None = None,
        scope: str = "",
    ) -> Prompt | MediaPlan:
        assert self.template is not None  # noqa: S101 - checked by the caller
        generator = self.generator
        # Object keys of tool arguments and tool definitions stay in the template's text (they
        # order its JSON); the only ones refused are those that spell a control token.
        for key in json_keys([tools or [], [m.as_dict().get("tool_calls") or [] for m in messages]]):
            if generator.contains_control_text(key):
                raise InvalidRequest(
                    "an object key in 'tools' or 'tool_calls' holds the text of one of "
                    "the model's control tokens",
                    param="messages",
                )
        parts, media = self.template.render_parts(messages, tools)
        segments = [p for p in parts if isinstance(p, tuple)]
        text = "".join(part for part, _ in segments)
        # Templates that print the BOS themselves must not get a second one from the tokenizer.
        bos = self.engine.info.bos_text
        add_special = not (bos and segments and segments[0][1] and segments[0][0].startswith(bos))
        # A template that opens the model's thinking itself (DeepSeek R1, Qwen3): the reply
        # starts inside the reasoning. Only the template's own text can open it, at the very end.
        tags = REASONING_TAGS.get(self.settings.reasoning)
        last = parts[-1] if parts else None
        opened = bool(tags and isinstance(last, tuple) and last[1] and last[0].rstrip().endswith(tags[0]))
        if media:  # the text alone must fit before any image or clip is decoded
            scoped = tuple(replace(item, scope=scope) for item in media)
            return self._media_plan(parts, scoped, text, add_special, opened)
        tokens = self._tokenize_bounded(
            text, "messages", whole=lambda: generator.tokenize_segments(segments, add_special=add_special)
        )
        return Prompt(tokens, reasoning_open=opened)

    def _media_plan(
        self, parts: list[Part], media: tuple[MediaInput, ...], text: str, add_special: bool, opened: bool
    ) -> MediaPlan:
        """A prompt with images and clips, checked before any is decoded: the model reads each
        kind the template kept, and the text alone fits (tokenized in prefixes as any prompt's)."""
        generator = self.generator
        used = sorted({p for p in parts if isinstance(p, int)})
        for index in used:
            if media[index].kind not in generator.media_kinds:
                what = "images" if media[index].kind == "image" else "audio"
                raise InvalidRequest(
                    f"the model {self.name!r} reads no {what}"
                    + ("" if generator.media_kinds else " (it has no multimodal projector: models[].mmproj)"),
                    param="messages",
                    code="model_not_supported",
                )
        self._tokenize_bounded(text, "messages", whole=list)
        return MediaPlan(parts, media, used, add_special, opened)

    async def _with_media(self, plan: MediaPlan, limits: MediaLimits) -> Prompt:
        """Tokens of a prompt with images and clips: each item the template kept prepared by the
        engine (decoded, encoded, held) while waiting on the media pool, then the parts put
        together on the prompt pool, each item's positions as placeholders."""
        generator = self.generator
        loop = asyncio.get_running_loop()
        prepared: dict[int, PreparedMedia] = {}
        keys: list[str] = []
        try:
            for position, index in enumerate(plan.used):
                try:
                    prepared[index] = await self._prepare(plan.media[index], limits)
                except MediaError as exc:
                    kind = plan.media[index].kind
                    raise InvalidRequest(
                        f"{'image' if kind == 'image' else 'clip'} {position + 1}: {exc}",
                        param="messages",
                        code=f"invalid_{kind}",
                    ) from None
                keys += [p.key for p in prepared[index].pieces if isinstance(p, MediaChunk)]
            tokens, spans = await loop.run_in_executor(self.executor, self._assemble, plan, prepared)
        except BaseException:
            MediaHold(generator, keys).release()
            raise
        return Prompt(
            tokens,
            reasoning_open=plan.opened,
            media=tuple(spans),
            media_items=tuple(plan.media[i] for i in plan.used),
            held=MediaHold(generator, keys),
        )

    def _assemble(
        self, plan: MediaPlan, prepared: Mapping[int, PreparedMedia]
    ) -> tuple[list[int], list[MediaSpan]]:
        """The prompt's text runs tokenized and its prepared items' pieces, in order."""
        generator = self.generator
        tokens: list[int] = []
        spans: list[MediaSpan] = []
        run: list[Segment] = []
        for part in [*plan.parts, -1]:
            if isinstance(part, tuple):
                run.append(part)
                continue
            if run or not tokens:  # the text so far (the first run carries the BOS)
                tokens += generator.tokenize_segments(run, add_special=plan.add_special and not tokens)
                run = []
            if part < 0:
                break
            for piece in prepared[part].pieces:
                if isinstance(piece, MediaChunk):
                    spans.append(MediaSpan(len(tokens), piece.length, piece.key))
                    tokens += placeholders(piece.key, piece.length)
                else:
                    tokens += piece
        return tokens, spans

    async def hold_media(self, items: Sequence[MediaInput], limits: MediaLimits) -> MediaHold:
        """Prepare these images and clips again in this handle's engine (a restarted one: its
        chunks get the same ids, so a prompt's placeholders stand as they were)."""
        generator = self.generator
        keys: list[str] = []
        try:
            for item in items:
                prepared = await self._prepare(item, limits)
                keys += [p.key for p in prepared.pieces if isinstance(p, MediaChunk)]
        except BaseException:
            MediaHold(generator, keys).release()
            raise
        return MediaHold(generator, keys)

    async def _prepare(self, item: MediaInput, limits: MediaLimits) -> PreparedMedia:
        """One image or clip prepared by the engine while the caller waits on the media pool. A
        caller gone while it waits: never prepared (a key capped at one request in flight
        queued any number of clips by leaving each); gone while the engine prepares it: its
        chunks are let go of once the engine is done with it."""
        generator = self.generator
        job = (self.media_executor or self.executor).submit(generator.prepare_media, item, limits)
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            if not job.cancel():  # under way: what it holds goes when it is done
                job.add_done_callback(partial(_release_prepared, generator))
            raise

    async def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        instructions: str = "",
        media_limits: MediaLimits | None = None,
        scope: str = "",
    ) -> Prompt:
        """Render the chat template and tokenize, off the event loop.

        With tools (or tool calls and results in the history): a template that renders tools
        gets them, with `instructions` (the reply format) as a system turn first; a template
        that cannot is given the conversation rewritten into turns it can show, the tools
        described in a system turn (engine.tool_turns): tools work on every model.
        """
        self.generator  # noqa: B018 - refuses embedding models
        if self.template is None:
            raise InvalidRequest(
                NO_TEMPLATE_MESSAGE.format(model=self.name), param="messages", code="chat_template_missing"
            )
        tooling = tools or any(m.tool_calls or m.role == "tool" for m in messages)
        if tooling and not self.template.supports_tools:
            messages, tools = tool_turns(messages, tools, instructions), None
        elif instructions:
            messages = (ChatMessage("system", instructions), *messages)
        loop = asyncio.get_running_loop()
        render = partial(self._render_and_tokenize, messages, tools, media_limits, scope)
        try:
            job = loop.run_in_executor(self.executor, render)
            try:
                rendered = await asyncio.shield(job)
            except asyncio.CancelledError:  # the client left: the chunks it holds go when it is done
                job.add_done_callback(_release_held)
                raise
            if isinstance(rendered, MediaPlan):
                prompt = await self._with_media(rendered, media_limits or MediaLimits())
            else:
                prompt = rendered
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        except EngineError:  # unloaded meanwhile (a swap or an unload while it rendered)
            raise _gone(self.engine, self.name) from None
        try:
            self.check_prompt(prompt.tokens, "messages")
        except BaseException:
            if prompt.held is not None:
                prompt.held.release()
            raise
        return prompt

    async def text_prompt(self, prompt: str | Sequence[int], param: str = "prompt") -> list[int]:
        """Tokenize a prompt (or check given token ids), off the event loop."""
        if isinstance(prompt, str):
            loop = asyncio.get_running_loop()
            try:
                tokens = await loop.run_in_executor(self.executor, self._tokenize_bounded, prompt, param)
            except EngineError:
                raise _gone(self.engine, self.name) from None
        else:
            tokens = list(prompt)
            if any(t >= self.engine.n_vocab for t in tokens):
                raise InvalidRequest(f"'{param}' token ids must be below {self.engine.n_vocab}", param=param)
        self.check_prompt(tokens, param)
        return tokens

    async def rerank_prompts(
        self, query: str, documents: Sequence[str], max_tokens_per_doc: int | None = None
    ) -> list[list[int]]:
        """Each document with the query, tokenized as the model scores them, off the event loop.

        The GGUF's rerank prompt where it has one (its markup parsed for control tokens, the
        query's and documents' text never: user text is text), else llama-server's pair format
        (`ModelInfo.pair_tokens`). A document past `max_tokens_per_doc` (the client's own bound,
        as Cohere's API has it) is cut there; a pair past the context is a 400 naming it.
        """
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self.executor, self._rerank_prompts, query, documents, max_tokens_per_doc
            )
        except EngineError:
            raise _gone(self.engine, self.name) from None

    def _rerank_prompts(
        self, query: str, documents: Sequence[str], max_tokens_per_doc: int | None
    ) -> list[list[int]]:
        info = self.engine.info
        limit = self.settings.context_size

        def text(value: str, param: str, what: str) -> list[int]:
            return self._tokenize_bounded(value, param, add_special=False, what=what) if value else []

        def first(value: str, n: int) -> list[int]:
            """The first `n` tokens of `value`, from a prefix of it long enough to hold them
            (a document of megabytes cut to 100 tokens is not tokenized whole)."""
            chars = max(256, n * PREFIX_CHARS_PER_TOKEN)
            while True:
                tokens = self.engine.tokenize(value[:chars], add_special=False)
                # A few tokens past the cut: the last ones of a prefix may merge with what follows.
                if chars >= len(value) or len(tokens) > n + 8:
                    return tokens[:n]
                chars *= 2

        asked = text(query, "query", "the query")
        template = self._rerank_template()
        opening, between, closing = info.pair_tokens
        prompts: list[list[int]] = []
        for i, document in enumerate(documents):
            if max_tokens_per_doc is None:
                doc = text(document, "documents", f"document {i}")
            else:
                doc = first(document, max_tokens_per_doc) if document else []
            if template is None:
                tokens = [*opening, *asked, *between, *doc, *closing]
            else:
                tokens = []
                for piece in template:
                    tokens += piece if isinstance(piece, list) else asked if piece == "{query}" else doc
            if not tokens:
                raise InvalidRequest(f"document {i} and the query are both empty", param="documents")
            if len(tokens) > limit:
                raise ContextLengthExceeded(
                    f"this model ranks at most {limit} tokens per document, the query and the prompt's "
                    f"markup included; document {i} makes {len(tokens)}",
                    param="documents",
                )
            prompts.append(tokens)
        return prompts

    def _rerank_template(self) -> list[list[int] | str] | None:
        """The GGUF's rerank prompt as its markup's tokens (control tokens parsed) and the
        `{query}` and `{document}` markers between them; read once per loaded model."""
        if self._rerank_pieces is None and self.engine.info.rerank_template is not None:
            parts = re.split(r"(\{query\}|\{document\})", self.engine.info.rerank_template)
            self._rerank_pieces = [
                part
                if part in ("{query}", "{document}")
                else self.engine.tokenize(part, add_special=False, parse_special=True)
                for part in parts
                if part
            ]
        return self._rerank_pieces

    def check_prompt(self, tokens: Sequence[int], param: str) -> None:
        """Refuse empty prompts and prompts that leave no room to generate in a slot."""
        if not tokens:
            raise InvalidRequest("the prompt is empty", param=param)
        limit = self.settings.context_size
        if self.settings.pooled:
            if len(tokens) > limit:
                raise ContextLengthExceeded(
                    f"this model embeds at most {limit} tokens per input; an input has {len(tokens)}",
                    param=param,
                )
            return
        if len(tokens) >= limit:
            raise ContextLengthExceeded(
                f"this model's context is {limit} tokens per request; the prompt has "
                f"{len(tokens)} tokens and leaves no room for a reply",
                param=param,
            )

    def generation_limit(self, n_prompt: int, requested: int | None) -> int:
        """Tokens a request may generate: what it asked for, capped by the room left in its slot."""
        room = self.settings.context_size - n_prompt
        return room if requested is None else min(requested, room)

    def check_capacity(self, tenant: str, count: int = 1) -> bool:
        """Refuse at once (429) when the slots and the queue together hold all they may, and the
        asking key (`tenant`: its `Share.tenant`, "" without keys) already holds its share;
        `count`: the generations the request brings (its choices), let in or refused together.

        The bound counts running and waiting requests together: a slot that is free but not
        yet filled (the scheduler is inside a decode step) must not let the queue grow past
        ``queue_size``. Past it, a key that holds less than its fair share of that room (the
        room divided among the keys holding any of it, itself counted) is still let in, up to
        `FAIR_OVERFLOW` times the room: one key flooding a model fills the queue, but every
        other key still gets in, and the queue's fair order (engine.fairness) serves it next.
        True when it was let in that way: the caller counts it (`fair_admissions`) once the
        request is in, so that a request checked twice, or refused for its next choice, counts
        once or not at all.
        """
        busy, waiting = self.engine.occupancy()
        room = self.settings.slots + self.settings.queue_size
        held = busy + waiting
        if held + count <= room:
            return False
        if held + count <= FAIR_OVERFLOW * room:
            by_key = self.engine.held_by_tenant() + self._pooled
            mine = by_key[tenant]
            keys = len(by_key) + (0 if mine else 1)
            # Only when another key holds part of the room: a key alone is held to the bound.
            if keys > 1 and mine < max(1, room // keys):
                return True
        self.counters["queue_rejections"] += 1
        raise ServerOverloaded(
            f"model {self.name!r} is at capacity ({busy} running, {waiting} waiting); retry shortly",
            headers={"Retry-After": RETRY_AFTER_BUSY_S},
        )

    async def grammars(self, grammar: str | None, copies: int, param: str) -> list[Grammar] | None:
        """Parse a request's grammar (one copy per choice) on the prompt pool, before admission.

        A grammar llama.cpp refuses is the request's fault: 400, before anything is queued.
        """
        if grammar is None:
            return None
        generator = self.generator

        def compile_them() -> list[Grammar]:
            return list(generator.compile_grammar(grammar, copies))

        job = self.executor.submit(compile_them)
        try:
            try:
                compiled: list[Grammar] = await asyncio.shield(asyncio.wrap_future(job))
            except asyncio.CancelledError:  # the client left, the drain or a revocation ended it
                if not job.cancel():  # compiling: freed once done (an engine process keeps them)
                    job.add_done_callback(_free_compiled)
                raise
        except GrammarError:
            raise InvalidRequest(
                "the output constraint of this request cannot be compiled into a grammar",
                param=param,
                code="invalid_grammar",
            ) from None
        except EngineError:
            raise _gone(self.engine, self.name) from None
        return compiled

    def submit(
        self, request: GenerationRequest, grammar: Grammar | None = None, *, admitted: bool = False
    ) -> Generation:
        """Start a generation, or refuse at once (429) when the slots and the queue are full
        (`admitted`: the caller has just checked for the whole request, `check_capacity`).

        The generation owns `grammar` (compiled by `grammars`) from here on, refused or not.
        """
        try:
            generator = self.generator
            if not admitted:
                self.check_capacity(request.share.tenant)
        except BaseException:
            if grammar is not None:
                grammar.free()
            raise
        try:
            return generator.submit(request, asyncio.get_running_loop(), grammar)
        except GrammarError:
            raise
        except EngineError:  # it stopped meanwhile: by itself (restarting), or closed by a swap
            if generator.fault is not None:
                raise EngineFailed(ENGINE_STOPPED, headers={"Retry-After": RETRY_AFTER_BUSY_S}) from None
            raise _gone(self.engine, self.name) from None

    async def embed(self, inputs: Sequence[Sequence[int]], *, tenant: str) -> list[list[float]]:
        """Embed tokenized inputs on the model's own thread (429 when it is saturated and
        `tenant`, the asking key, holds its share: check_capacity)."""
        return await self._pool(self.embedder, inputs, tenant)

    async def rank(self, inputs: Sequence[Sequence[int]], *, tenant: str) -> list[float]:
        """Score tokenized query-document pairs (`rerank_prompt`) on the model's own thread."""
        return [vector[0] for vector in await self._pool(self.ranker, inputs, tenant)]

    async def _pool(
        self, embedder: Embedder, inputs: Sequence[Sequence[int]], tenant: str
    ) -> list[list[float]]:
        past_bound = self.check_capacity(tenant)
        # Counted as the engine counts a call running (its inputs, up to the slots): one call
        # of many inputs fills the model, and its key is then seen to (check_capacity).
        cost = max(1, min(len(inputs), self.settings.slots))
        self._pooled[tenant] += cost
        try:
            future = embedder.submit_embed(inputs)
            if past_bound:
                self.counters["fair_admissions"] += 1
            try:
                return await asyncio.wrap_future(future)
            except asyncio.CancelledError:  # the client left: the model stops on its work
                embedder.abandon(future)
                raise
        except EngineError as exc:
            if str(exc) == ENGINE_STOPPED:
                raise EngineFailed(ENGINE_STOPPED, headers={"Retry-After": RETRY_AFTER_BUSY_S}) from None
            if "unloaded" in str(exc) or "shutting down" in str(exc):
                raise _gone(self.engine, self.name) from None
            raise
        finally:
            self._pooled[tenant] -= cost
            if not self._pooled[tenant]:
                del self._pooled[tenant]
