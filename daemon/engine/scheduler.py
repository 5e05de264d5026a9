"""The continuous-batching scheduler: one model, one llama_context, one thread.

One `Engine` owns one model and one `llama_context` with `n_seq_max = slots` and one KV
region per slot, driven by one scheduler thread. Each scheduler step builds one
`llama_batch` holding one token for every generating sequence plus as many prompt tokens of
admitted sequences as `n_batch` leaves room for (chunked prefill interleaved with decoding),
runs one `llama_decode`, samples each sequence with its own C sampler chain and hands the
new text to the event loop with one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import asdict
from typing import Any, Final

import llama_cpp as llama
import numpy as np

from edgellmd.engine import native
from edgellmd.engine.config import (
    EngineConfig,
    EngineError,
    MediaError,
    MediaInput,
    MediaLimits,
    ModelLoadError,
    PreparedMedia,
)
from edgellmd.engine.draft_model import DraftModel
from edgellmd.engine.drafts import (
    MIN_CACHED_TOKENS,
    Drafter,
    ModelDrafter,
    PromptCache,
    common_prefix,
    make_drafter,
)
from edgellmd.engine.fairness import PRIORITY_NAMES, FairQueue, Running, Share, victim
from edgellmd.engine.generation import (
    QUEUE_TIMEOUT,
    Event,
    Finished,
    FinishReason,
    Generation,
    GenerationRequest,
    Grammar,
    HeldLogprobs,
    MediaSpan,
    SamplingParams,
    StopMatcher,
    TextDelta,
    TokenLogprob,
    Utf8Stream,
    check_media,
    earlier_chars,
)
from edgellmd.engine.native import (
    ControlTokens,
    Item,
    NativeThread,
    context_params,
    decode_bos,
    fill_batch,
    flash_attention_type,
    keep_prefix,
    model_meta,
    read_model_info,
    token_piece,
    tokenize_segments,
    tokenize_text,
)
from edgellmd.engine.projector import Projector
from edgellmd.engine.sampling import (
    Candidates,
    CompiledGrammar,
    SlotSampler,
    compile_grammar,
    make_chain,
)
from edgellmd.engine.shapes import StepTimes, choose_slot, even_rows, measure_steps, plan_rows, runs

log = logging.getLogger(__name__)

_IDLE_WAIT_S: Final = 0.5  # the idle scheduler still wakes up to report liveness
_LOCKSTEP_WAIT_S: Final = 0.02  # longest the scheduler waits for the event loop to send a step
_FLASH_NAMES: Final = {
    int(llama.LLAMA_FLASH_ATTN_TYPE_ENABLED): "on",
    int(llama.LLAMA_FLASH_ATTN_TYPE_DISABLED): "off",
    int(llama.LLAMA_FLASH_ATTN_TYPE_AUTO): "auto",
}
_KV_BLOCK: Final = 32  # values per block of q8_0 and q4_0
_ROW_PROBE: Final = 8  # rows of the load's step that times a row without logits
_KV_PAD: Final = 256  # llama.cpp rounds the KV cells an attention reads up to this
_MIN_RESTORE_GAIN: Final = 64  # tokens a cached prefix must save over a slot's own to be restored
# The largest sequence state copied between slots (`_share_prefixes`): the copy passes through
# host memory, half the default room an engine's memory group leaves beyond its budget.
_MAX_SHARE_BYTES: Final = 512 * 2**20
_SHED_EVERY_S: Final = 0.02  # how often the waiting queue is scanned for queue_timeout_s
_QUEUE_WAITS: Final = 256  # admissions whose queue waits /admin/status summarises
QUEUE_SHOWN: Final = 64  # waiting generations /admin/status lists, in the order they would be taken
# A prompt with at most this many tokens left to compute takes a step of its own for its
# first token, ahead of the decodes (`Engine._step`).
FIRST_TOKEN_ALONE: Final = 64
# After a step is stopped for a newcomer (Engine._preempt_for), this many steps run whole: the
# newcomer's own and one of those it stopped.
_STOP_REST: Final = 2


def _check_kv_blocks(model: Any, config: EngineConfig) -> None:
    """A quantized KV cache stores heads in blocks of 32 values: refuse a head size it cannot.

    llama.cpp's own refusal is a log line and a context that is not created; this names the
    setting to change.
    """
    arch = model_meta(model, "general.architecture") or ""
    n_head = max(1, llama.llama_model_n_head(model))
    default = llama.llama_model_n_embd(model) // n_head
    for side, kind in (("k", config.cache_type_k), ("v", config.cache_type_v)):
        if kind == "f16":
            continue
        key = "key_length" if side == "k" else "value_length"
        given = model_meta(model, f"{arch}.attention.{key}")
        head = int(given) if given and given.isdigit() else default
        if head % _KV_BLOCK:
            raise ModelLoadError(
                f"cache_type_{side} {kind} stores blocks of {_KV_BLOCK} values and this model's "
                f"attention heads have {head}: use f16 for it"
            )


class _Slot:
    """Scheduler-thread state of one sequence in the batch."""

    __slots__ = (
        "accepted",
        "admitted",
        "batch_index",
        "cached",
        "completion",
        "draft",
        "drafted",
        "drafter",
        "gen",
        "last",
        "logprobs",
        "media",
        "n_past",
        "peers",
        "prefilled",
        "prompt",
        "reused",
        "sampler",
        "since",
        "stops",
        "utf8",
    )

    def __init__(self, gen: Generation, sampler: SlotSampler, drafter: Drafter | None = None) -> None:
        self.gen = gen
        self.sampler = sampler
        self.prompt: Sequence[int] = gen.request.prompt_tokens
        self.prefilled = 0  # prompt tokens already in the KV cache
        self.n_past = 0  # position of the next token
        self.completion = 0  # tokens generated so far
        self.batch_index = -1  # where this sequence's logits sit in the last batch, or -1
        self.last = -1  # the last sampled token, fed back in the next step
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(gen.request.stop)
        # Each token's logprob, out with its text (none for a stop string's); only when asked.
        self.logprobs = HeldLogprobs() if gen.request.logprobs is not None else None
        self.drafter = drafter  # prompt lookup or a draft model's: the tokens, the draft length
        self.draft: list[int] = []  # the draft tokens in the last batch, after `last`
        self.cached = 0  # prompt tokens whose KV came from a slot or the prompt cache
        # Counted in the engine's prompt_tokens_reused and _shared for this sequence: taken back
        # when a failed copy wipes them (they are computed after all).
        self.reused = (0, 0)
        # The common start of this prompt and another running generation's (`_share_prefixes`),
        # found once per pair: prompts never change.
        self.peers: dict[Generation, int] = {}
        self.drafted = 0  # draft tokens checked, and of those the ones the sampler agreed with
        self.accepted = 0
        self.since = time.monotonic()  # when it took (or resumed in) its slot: fairness.QUANTUM_S
        self.admitted = self.since  # when it first took a slot: how long generations hold one
        self.media: tuple[MediaSpan, ...] = gen.request.media  # images and clips, in prompt order

    def media_from(self, pos: int) -> MediaSpan | None:
        """The first media span that starts at `pos` or after it."""
        return next((span for span in self.media if span.start >= pos), None)


class Engine(NativeThread):
    """One loaded model and its scheduler thread; all public methods are thread-safe."""

    kind: Final = "generation"  # as RemoteEngine.kind: what the model serves

    def __init__(self, config: EngineConfig, *, name: str = "model") -> None:
        """Load the model and start its scheduler (blocking: call it off the event loop).

        Everything native happens on the engine's own thread: llama.cpp's CPU backend runs
        on OpenMP, which keeps a team of threads per calling thread, and more OpenMP threads
        than CPUs makes libgomp stop spinning at barriers and sleep instead. A model loaded
        and warmed on one thread and decoded on another measured 20 context switches per
        graph node and a quarter of the throughput gone.
        """
        super().__init__(config, name)
        # Waiting generations, new ones and paused ones, in fair order (engine.fairness).
        self._pending: FairQueue[Generation] = FairQueue(_share)
        # Paused sequences: their slot state, KV state (llama_state_seq_get_data) and tokens.
        self._paused: dict[Generation, tuple[_Slot, bytes, list[int]]] = {}
        self.pauses = 0  # sequences paused for a fairer tenant or a higher class
        self.first_token_steps = 0  # steps a short prompt's last chunk took alone (FIRST_TOKEN_ALONE)
        self._alone = False  # the last step was one of those: this one decodes
        self.queue_waits: deque[float] = deque(maxlen=_QUEUE_WAITS)  # the last admissions' waits
        # How long the last finished generations held their slots: what a waiting one can expect.
        self.hold_times: deque[float] = deque(maxlen=_QUEUE_WAITS)
        self._shed_at = 0.0  # when the waiting queue is next scanned for late generations
        self._slots: list[_Slot | None] = [None] * config.slots
        # Liveness for the systemd watchdog: when the scheduler last finished a step or idled.
        self.heartbeat = time.monotonic()
        # Generations ended, by finish reason, and tokens generated (written by the scheduler).
        self.finished: Counter[str] = Counter()
        self.tokens_generated = 0
        self.prompt_tokens_reused = 0
        self.prompt_tokens_shared = 0  # of those, copied from another running sequence
        self.drafted_tokens = 0  # draft tokens checked in a batch
        self.accepted_tokens = 0  # of which the request's own sampler picked the same
        self.prompt_cache = PromptCache(config.prompt_cache_bytes) if config.prompt_cache_bytes else None
        self._pieces: dict[int, bytes] = {}  # token -> bytes, filled by the scheduler
        self._candidates: Candidates  # resampling room, made once the vocabulary is known
        # Tokens whose keys/values each sequence holds in the KV cache, position by position.
        # A finished sequence keeps them so that the next prompt with the same prefix (a
        # system prompt, a growing conversation) skips that part of the prefill.
        self._kv: list[list[int]] = [[] for _ in range(config.slots)]
        self._scope: list[str] = ["" for _ in range(config.slots)]  # whose prompt each slot's KV holds
        self._forget: set[str] = set()  # scopes whose cached state goes (forget_scopes), under _cond
        self._draft: DraftModel | None = None  # speculative mode draft: loaded with the model
        self.projector: Projector | None = None  # the model's multimodal projector (config.mmproj)
        # Decode step seconds by size (measured at load, kept current by the steps served).
        self.steps = StepTimes([])
        self._pads: list[tuple[int, int]] = []  # (slot, position) of the last step's dummy rows
        self.padded_steps = 0
        self.evened_steps = 0  # drafting steps made one ubatch by rows without logits
        # Stopping a step in progress for a tenant it holds nothing of (config.preempt_steps).
        self._stop: native.StepAbort | None = None  # made with the context
        self._step_shares: list[Share] | None = None  # an armed step's shares, under _cond
        self._stop_rest = 0  # steps still to finish whole before another may be stopped
        self._stopped_for: Generation | None = None  # whom the stop was asked for, under _cond
        self._newcomer: Generation | None = None  # whom the last stopped step was stopped for
        self.stopped_steps = 0
        self._start_thread(f"engine:{name}")

    def _load(self) -> None:
        config = self.config
        self._load_model()
        model = self._model
        self._n_swa = max(0, llama.llama_model_n_swa(model))

        _check_kv_blocks(model, config)
        # Room for one row per slot in every decode, whatever batch_size says: each step
        # holds a token of every generating sequence, and the load times steps of every size.
        rows = self._rows = max(config.batch_size, config.slots)
        cparams = context_params(config, rows)
        # Sliding-window layers keep only their window (llama-server's default too): for
        # Gemma 3 that is most of the KV cache. A prefix that slid out of the window cannot
        # be reused, which _assign detects (seq_rm fails) and answers with a full prefill.
        # A prompt cache restores a prefix of a saved sequence: that needs every position of
        # the sliding-window layers too, so they keep the full context (more memory).
        cparams.swa_full = self.prompt_cache is not None
        if self._n_swa and self.prompt_cache is None:
            log.info(
                "model %s: sliding-window layers (window %d): a slot reuses an earlier prompt's"
                " prefix only whole; prompt_cache_mb keeps the full context, so that a new"
                " conversation reuses a system prompt it shares (docs/api.md, coding agents)",
                self.name,
                self._n_swa,
            )
        ctx = llama.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {config.path}")
        self._ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        # CPU steps only: llama.cpp's CPU backend checks the flag between nodes, a GPU's kernels
        # run to the end (and a GPU step is a few milliseconds).
        if config.preempt_steps and config.gpu_layers == 0:
            self._stop = native.StepAbort.make(ctx)
        self._batch = llama.llama_batch_init(rows, 0, config.slots)
        self.info = read_model_info(model, self._vocab, config.path)
        self.controls = ControlTokens(self._vocab, self.n_vocab)
        # Room for the whole vocabulary: the last resort of a grammar miss draws from all of it.
        self._candidates = Candidates(self.n_vocab)
        if config.speculative.mode == "draft":
            self._draft = DraftModel.open(config, model, self.name)
        if config.mmproj is not None:
            self.projector = Projector(
                config.mmproj,
                model,
                threads=config.threads_batch,
                use_gpu=config.gpu_layers > 0,
                log_callback=native.on_llama_log,
            )

    # ---- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (thread-safe: the vocabulary is read-only until close)."""
        with self.native_use():
            return tokenize_text(self._vocab, text, add_special=add_special, parse_special=parse_special)

    def tokenize_segments(
        self, segments: Sequence[tuple[str, bool]], *, add_special: bool = True
    ) -> list[int]:
        """(text, trusted) segments to token ids; control tokens are parsed in trusted text only."""
        with self.native_use():
            return tokenize_segments(self._vocab, self.controls, segments, add_special=add_special)

    def contains_control_text(self, text: str) -> bool:
        """True when `text` holds the text of one of the vocabulary's control tokens."""
        return self.controls.contains(text)

    def compile_grammar(self, grammar: str, copies: int = 1) -> list[CompiledGrammar]:
        """Parse a GBNF grammar into `copies` grammar samplers (any thread; GrammarError if refused).

        Done before a request is admitted, on the prompt pool: the scheduler thread never
        meets a grammar for the first time, and a grammar llama.cpp refuses is the client's
        error, answered before anything is queued.
        """
        with self.native_use():
            return compile_grammar(self._vocab, grammar, copies)

    @property
    def media_kinds(self) -> tuple[str, ...]:
        """What the model reads besides text ("image", "audio"): its projector's."""
        return self.projector.kinds if self.projector is not None else ()

    def prepare_media(self, item: MediaInput, limits: MediaLimits) -> PreparedMedia:
        """Decode and encode an image or clip for a prompt (the prompt pool, never the scheduler
        thread); its chunks stay held until `release_media`. MediaError for the client's input."""
        with self.native_use():
            if self.projector is None:
                raise MediaError(f"this model reads no {'images' if item.kind == 'image' else 'audio'}")
            return self.projector.prepare(item, limits, self._rows)

    def release_media(self, keys: Sequence[str]) -> None:
        """Let go of chunks `prepare_media` held (any thread)."""
        if self.projector is not None:
            self.projector.release(tuple(keys))

    def _piece(self, token: int, *, special: bool = False) -> bytes:
        return token_piece(self._vocab, token, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids to text (for tests and diagnostics)."""
        return b"".join(self._piece(t) for t in tokens).decode("utf-8", "replace")

    # ---- scheduler interface (event loop side) -------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        grammar: Grammar | None = None,
        *,
        generation: Generation | None = None,
    ) -> Generation:
        """Queue a generation; its events arrive on `loop`. Never blocks on the scheduler.

        A request with a grammar brings it compiled (`compile_grammar`, on the prompt pool);
        one that does not gets it compiled here, in the caller's thread (GrammarError).
        The engine owns `grammar` from here on, whatever happens. `generation`: the object
        to deliver to (an engine process's, which forwards its events), made here otherwise.
        """
        try:
            return self._queue(request, generation or Generation(request, loop), grammar)
        except BaseException:
            if grammar is not None:
                grammar.free()
            raise

    def _queue(self, request: GenerationRequest, gen: Generation, grammar: Grammar | None) -> Generation:
        if len(request.prompt_tokens) == 0:
            raise EngineError("empty prompt")
        wrong = check_media(request.prompt_tokens, request.media)
        if wrong is not None:
            raise EngineError(wrong)
        if request.media and (
            self.projector is None or not all(self.projector.holds(span.key) for span in request.media)
        ):
            raise EngineError("a media span's chunk is not prepared in this engine")
        gen.grammar = grammar
        if request.sampling.grammar is not None and grammar is None:
            gen.grammar = self.compile_grammar(request.sampling.grammar)[0]
        with self._cond:
            if self._stopping:
                _free_grammar(gen)
                raise EngineError("engine is shutting down")
            gen.queue_s = -time.monotonic()  # the admission adds its own time: the wait
            self._pending.append(gen)
            self._preempt_for(gen)
            self._cond.notify()
        return gen

    def _preempt_for(self, gen: Generation) -> None:
        """A generation was just queued (under the lock): stop the step in progress for it when
        that step computes nothing of its tenant's (or only lower classes than its own) and the
        next admission takes it, into a free slot or one fairness pauses for it.

        Its first token then waits for the step in progress only up to the next graph node, not
        to the end (with every slot decoding and a prompt chunk, 100 ms on two cores against a
        30 ms short prompt). The stopped step is undone and runs again after it; after a stop,
        `_STOP_REST` steps run whole, so new tenants arriving back to back cannot starve the
        running ones; and a tenant computed for more than one the step serves stops nothing
        (`FairQueue.ahead`), so neither can one tenant's requests sent one after another.
        """
        shares, stop = self._step_shares, self._stop
        if shares is None or stop is None or stop.asked:
            return
        share = gen.request.share
        served = any(s.tenant == share.tenant for s in shares)
        higher = share.priority > max(s.priority for s in shares)
        if served and not higher:
            return
        # Never for a tenant computed for more than one the step serves: back-to-back
        # requests of one key stopped every other key's steps in turn (engine.fairness).
        if not higher and self._pending.ahead(share, shares):
            return
        if self._pending.peek() is not gen:
            return
        if None not in self._slots and self._victim(share, time.monotonic()) is None:
            return
        self._stopped_for = gen
        stop.ask()

    def wake(self) -> None:
        """Wake the scheduler (after a cancellation) so the slot is freed at once; a waiting
        generation that was cancelled leaves the queue here and now, not after the step in
        progress (a long prefill's seconds): its key's requests count against its `concurrent`
        cap only until their handlers end, and a hung-up client's queue entries held the
        model's queue meanwhile (five times the cap, the queue full for everyone)."""
        with self._cond:
            self._drop_cancelled(paused_too=False)
            self._cond.notify()

    def _drop_cancelled(self, *, paused_too: bool) -> None:
        """End the cancelled generations of the queue (under the lock). A paused one (its sampler
        and KV copy the scheduler thread's) only from that thread: `paused_too`."""
        if not any(g.cancelled for g in self._pending):
            return
        for gen in [g for g in self._pending if g.cancelled and (paused_too or g not in self._paused)]:
            self._pending.remove(gen)
            self._pending.dropped(gen)
            _free_grammar(gen)
            self.finished["cancelled"] += 1
            paused = self._paused.pop(gen, None)
            done = 0
            if paused is not None:
                paused[0].sampler.free()
                done = paused[0].completion
            admitted = paused is not None  # a paused one had a slot; the others never did
            gen.push_threadsafe(
                [Finished("cancelled", len(gen.request.prompt_tokens), done, admitted=admitted)]
            )

    def forget_scopes(self, scopes: Collection[str]) -> None:
        """Drop the cached KV state of these cache scopes (their keys were revoked, disabled or expired).

        Free slots holding their prompts are cleared and the prompt cache's entries go at the
        scheduler's next pass; a slot still running one of their requests (ended by the keys
        watch within a second) is cleared once it finishes.
        """
        with self._cond:
            self._forget.update(s for s in scopes if s)
            self._cond.notify()

    def _drop_forgotten(self) -> None:
        """Under the lock: clear free slots and cache entries of the scopes being forgotten."""
        if self.prompt_cache is not None:
            self.prompt_cache.drop_scopes(self._forget)
        running: set[str] = set()
        for i, slot in enumerate(self._slots):
            if self._scope[i] not in self._forget:
                continue
            if slot is not None:
                running.add(self._scope[i])
                continue
            llama.llama_memory_seq_rm(self._memory, i, -1, -1)
            self._kv[i].clear()
            self._scope[i] = ""
            if self._draft is not None:
                self._draft.forget(i)
        self._forget &= running

    @property
    def busy_slots(self) -> int:
        """Slots holding a running generation."""
        return sum(s is not None for s in self._slots)

    @property
    def queue_depth(self) -> int:
        """Generations waiting for a slot."""
        return len(self._pending)

    def occupancy(self) -> tuple[int, int]:
        """Slots busy and generations waiting, read together.

        Under the scheduler's lock: a generation moving from the queue into a slot is then
        counted exactly once (read separately, it could be counted in neither, and admission
        would let one request too many in).
        """
        with self._cond:
            return self.busy_slots, len(self._pending)

    def held_by_tenant(self) -> Counter[str]:
        """Generations running or waiting, by their key (`Share.tenant`), under the lock."""
        with self._cond:
            return self._pending.held()

    def performance(self) -> dict[str, Any]:
        """What the speed features have done since the load, for /admin/status and /metrics."""
        config = self.config
        cache = self.prompt_cache
        return {
            "kv_cache": {
                "type_k": config.cache_type_k,
                "type_v": config.cache_type_v,
                "flash_attention": _FLASH_NAMES[flash_attention_type(config)],
            },
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "prompt_tokens_shared": self.prompt_tokens_shared,
            "fairness": self._fairness(),
            "batch_padding": {
                "enabled": config.batch_padding,
                "step_ms": [round(t * 1000, 2) for t in self.steps.seconds],
                # Sizes the load had no time to measure and no step has measured since.
                "step_estimated": [n for n, m in enumerate(list(self.steps.measured), 1) if not m],
                "padded": {str(n): m for n, m in self.steps.padded().items()},
                "padded_steps": self.padded_steps,
                "row_ms": round(self.steps.row_seconds * 1000, 2),
                "evened_draft_steps": self.evened_steps,
            },
            "speculative": {
                "mode": config.speculative.mode,
                **({"draft_model": config.speculative.draft_name} if self._draft is not None else {}),
                "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens,
            },
            # The projector's store of encoded images and clips (None: the model reads text only).
            "media": self.projector.status() if self.projector is not None else None,
            "prompt_cache": None
            if cache is None
            else {
                "max_bytes": cache.max_bytes,
                "used_bytes": cache.used_bytes,
                "entries": len(cache.entries),
                **asdict(cache.stats),
            },
        }

    def _fairness(self) -> dict[str, Any]:
        with self._cond:
            tenants = self._pending.tenants()
            waits = sorted(self.queue_waits)
            paused = len(self._paused)
            # Host memory the paused sequences' KV copies hold (at most a slot's each, one per slot).
            paused_bytes = sum(len(state) for _, state, _ in self._paused.values())
            waiting = [(gen.request.share, gen.queue_s) for gen in self._pending.order(QUEUE_SHOWN)]
            holds = sorted(self.hold_times)
        now = time.monotonic()
        # The time still to wait: with every slot busy, each for a median hold of the recent
        # generations, slots free about every hold / (slots + 1) s from now, and the entry at
        # position p (from 0) takes the (p + 1)th of them.
        hold = holds[len(holds) // 2] if holds else None
        queue = [
            {
                "position": p + 1,
                "tenant": share.tenant,
                "class": PRIORITY_NAMES.get(share.priority, str(share.priority)),
                "waited_ms": round((now + queue_s) * 1000),
                "estimated_wait_ms": None
                if hold is None
                else round((p + 1) * hold / (self.config.slots + 1) * 1000),
            }
            for p, (share, queue_s) in enumerate(waiting)
        ]
        return {
            "queue": queue,
            "tenants": tenants,
            "paused": paused,
            "paused_bytes": paused_bytes,
            "pauses": self.pauses,
            "first_token_steps": self.first_token_steps,
            # Steps stopped in progress for a newcomer's first token, and run again (_preempt_for).
            "stopped_steps": self.stopped_steps,
            # The recent admissions' waits: what a request queued now can expect.
            "queue_wait_ms": {
                "p50": round(waits[len(waits) // 2] * 1000, 1) if waits else 0.0,
                "p95": round(waits[min(len(waits) - 1, len(waits) * 95 // 100)] * 1000, 1) if waits else 0.0,
            },
        }

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        return not self._pending and self.busy_slots == 0

    def _release(self, error: str) -> None:
        """On the engine thread, once it stops: end what is left with `error`, then free the model."""
        with self._cond:
            self._stopping = True
            leftovers = list(self._pending)
            for gen in leftovers:
                self._pending.remove(gen)
                self._pending.dropped(gen)
        for gen in leftovers:
            _free_grammar(gen)
            paused = self._paused.pop(gen, None)
            done = 0
            if paused is not None:
                paused[0].sampler.free()
                done = paused[0].completion
            admitted = paused is not None
            gen.push_threadsafe(
                [Finished("error", len(gen.request.prompt_tokens), done, error=error, admitted=admitted)]
            )
        for i, slot in enumerate(self._slots):
            if slot is None:
                continue
            try:
                self._finish(i, "error", error=error, deliver=True)
            except Exception:  # the state that stopped the scheduler may stop this too
                log.exception("model %s: ending the request in slot %d failed", self.name, i)
                self._slots[i] = None
                slot.gen.push_threadsafe([Finished("error", len(slot.prompt), slot.completion, error=error)])
        self._free_native()

    # ---- scheduler thread -----------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run one decode so compute buffers exist before the first real request."""
        if not decode_bos(self._ctx, self._batch, self._vocab):
            raise ModelLoadError(f"warm-up decode failed for {self.config.path}")
        chain, _ = make_chain(SamplingParams(temperature=0.0), self.n_vocab)
        llama.llama_sampler_sample(chain, self._ctx, 0)
        llama.llama_sampler_free(chain)
        llama.llama_memory_clear(self._memory, True)
        if self.config.batch_padding and self.config.slots > 1:
            self._measure_steps()
        if self._draft is not None:
            self._draft.warm_up()

    def _measure_steps(self) -> None:
        """Time a decode step of each size and choose what each size is padded to (engine.shapes)."""

        def timed(items: list[Item]) -> float:
            fill_batch(self._batch, items)
            started = time.perf_counter()
            if llama.llama_decode(self._ctx, self._batch) != 0:
                raise ModelLoadError(f"a warm-up decode of {len(items)} rows failed for {self.config.path}")
            took = time.perf_counter() - started
            for seq in {it[2] for it in items}:
                llama.llama_memory_seq_rm(self._memory, seq, -1, -1)
            return took

        # Each step size: one row in each of the first n sequences.
        seconds = measure_steps(lambda n: timed([(0, 0, seq, True) for seq in range(n)]), self.config.slots)
        # A row without logits: one sequence's step of ROW_PROBE rows against one of 1.
        probe = min(_ROW_PROBE, self._rows)
        took = timed([(0, pos, 0, pos == probe - 1) for pos in range(probe)])
        row = (took - seconds[0]) / max(1, probe - 1)
        self.steps = StepTimes(seconds, max(row, 0.0) if probe > 1 else 0.0, slots=self.config.slots)
        llama.llama_memory_clear(self._memory, True)
        log.info(
            "model %s: decode step ms by size %s (%d of %d measured); padded at first %s",
            self.name,
            [round(t * 1000, 1) for t in self.steps.seconds],
            len(seconds),
            self.config.slots,
            self.steps.padded() or "none",
        )

    def _free_native(self) -> None:
        if self.projector is not None:  # it refers to the model: freed first, once no call is inside
            with self._cond:
                self._stopping = True
                while self._users:
                    self._cond.wait()
            self.projector.close()
            self.projector = None
        super()._free_native()
        if self._draft is not None:  # loaded on this thread with the model, freed with it
            self._draft.free()
            self._draft = None

    def _run(self) -> None:
        # An exception ends the thread as a fault (NativeThread._main): its requests get
        # ENGINE_STOPPED and the registry restarts the model.
        while self._step():
            pass

    def _admit(self) -> bool:
        """Move waiting generations into free slots; returns False when asked to stop."""
        with self._cond:
            while not self._stopping and not self._pending and self.busy_slots == 0 and not self._forget:
                self.heartbeat = time.monotonic()
                self._cond.wait(_IDLE_WAIT_S)
            if self._stopping:
                return False
            if self._forget:
                self._drop_forgotten()
            # Waiting clients that gave up leave the queue now, not when a slot frees up.
            self._drop_cancelled(paused_too=True)
            now = time.monotonic()
            if self.config.queue_timeout_s > 0 and self._pending and now >= self._shed_at:
                # Not at every step: a scan of the queue is O(waiting), a step a few milliseconds.
                self._shed_at = now + _SHED_EVERY_S
                self._shed_late(now, self.config.queue_timeout_s)
            while self._pending:
                if None not in self._slots and not self._pause_for(now):
                    break
                gen = self._pending.pop()
                self._pending.started(gen)
                if gen in self._paused:
                    self._resume(gen, now)
                else:
                    gen.queue_s += now  # it was -(when it was queued)
                    self.queue_waits.append(gen.queue_s)
                    self._assign(gen)
        return True

    def _shed_late(self, now: float, limit: float) -> None:
        """Refuse the waiting generations that have not had a slot for `limit` seconds (under the
        lock). Only those that never started: a paused one has tokens out already."""
        late = [g for g in self._pending if g not in self._paused and now + g.queue_s > limit]
        for gen in late:
            self._pending.remove(gen)
            self._pending.dropped(gen)
            _free_grammar(gen)
            self.finished["error"] += 1  # by Finished.reason, as an engine process counts it
            gen.queue_s += now  # it was -(when it was queued)
            self.queue_waits.append(gen.queue_s)
            prompt = len(gen.request.prompt_tokens)
            gen.push_threadsafe(
                [Finished("error", prompt, 0, error=QUEUE_TIMEOUT, queue_s=gen.queue_s, admitted=False)]
            )

    def _pause_for(self, now: float) -> bool:
        """Every slot busy: pause one for the next waiting request if fairness asks (under the lock)."""
        waiting = self._pending.peek()
        if waiting is None:
            return False
        i = self._victim(waiting.request.share, now)
        return i is not None and self._pause(i)

    def _victim(self, waiting: Share, now: float) -> int | None:
        """The slot fairness would pause for a request of `waiting`'s, or None (under the lock)."""
        if len(self._paused) >= len(self._slots):  # paused state is bounded
            return None
        running = [
            Running(i, s.gen.request.share, now - s.since, len(self._kv[i]))
            for i, s in enumerate(self._slots)
            if s is not None
        ]
        return victim(waiting, running, self._pending.running, len(self._pending.vtime), len(self._slots))

    def _pause(self, i: int) -> bool:
        """Move slot i's sequence out: its KV state to host memory, the generation back in the queue."""
        slot = self._slots[i]
        assert slot is not None  # noqa: S101 - called for a busy slot
        size = llama.llama_state_seq_get_size(self._ctx, i)
        buffer = (ctypes.c_uint8 * max(size, 1))()
        written = llama.llama_state_seq_get_data(self._ctx, buffer, size, i) if size > 0 else 0
        if written <= 0:
            return False  # nothing to save it with: it keeps its slot
        self._paused[slot.gen] = (slot, ctypes.string_at(buffer, written), list(self._kv[i]))
        llama.llama_memory_seq_rm(self._memory, i, -1, -1)
        self._kv[i].clear()
        self._slots[i] = None
        slot.gen.queue_s -= time.monotonic()  # the pause counts as waiting, until it resumes
        self._pending.stopped(slot.gen, done=False)
        self._pending.append(slot.gen)
        self.pauses += 1
        return True

    def _resume(self, gen: Generation, now: float) -> None:
        """Put a paused sequence back in a free slot where it left off (under the lock)."""
        slot, data, tokens = self._paused.pop(gen)
        gen.queue_s += now
        busy = [s is not None for s in self._slots]
        target = min(
            (i for i, b in enumerate(busy) if not b),
            key=lambda i: (runs([b or j == i for j, b in enumerate(busy)]), len(self._kv[i]), i),
        )
        llama.llama_memory_seq_rm(self._memory, target, -1, -1)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        scope = gen.request.cache_scope
        if self._scope[target] != scope:
            self._scope[target] = scope
            if self._draft is not None:
                self._draft.forget(target)
        slot.since = now
        slot.batch_index = -1
        slot.draft = []
        self._slots[target] = slot
        if llama.llama_state_seq_set_data(self._ctx, buffer, len(data), target) != len(data):
            llama.llama_memory_seq_rm(self._memory, target, -1, -1)
            self._kv[target].clear()
            self._finish(target, "error", error="could not resume the paused sequence", deliver=True)
            return
        self._kv[target] = tokens

    def _assign(self, gen: Generation) -> None:
        """Put `gen` in a free slot: the one that keeps the busy slots together, or one whose
        cached tokens share a much longer prefix with its prompt (`shapes.choose_slot`)."""
        prompt, scope = gen.request.prompt_tokens, gen.request.cache_scope
        busy = [s is not None for s in self._slots]
        # Another scope's cached tokens are no prefix of this prompt (GenerationRequest.cache_scope).
        shared = [
            0 if b or owner != scope else common_prefix(kv, prompt)
            for b, kv, owner in zip(busy, self._kv, self._scope, strict=True)
        ]
        held = [len(kv) for kv in self._kv]  # another's prefix is kept while an emptier slot is free
        best = choose_slot(busy, shared, held)  # keeping the busy slots in one run (engine.shapes)
        best_len = shared[best]
        if self.prompt_cache is not None:
            best, best_len = self._restore(prompt, scope, best, best_len)
        if self._scope[best] != scope:
            self._scope[best] = scope
            if self._draft is not None:  # nor is its draft model's
                self._draft.forget(best)
        # The last prompt token is always decoded again: its logits start the reply.
        # Sliding-window layers keep only the last n_swa positions of a sequence; the new
        # tokens need the window before `reuse`, which may have slid out already.
        want = min(best_len, len(prompt) - 1)
        for span in gen.request.media:  # an image is decoded whole: never keep part of one
            if span.start < want < span.start + span.length:
                want = span.start
        reuse = keep_prefix(self._memory, best, want, self._n_swa)
        del self._kv[best][reuse:]
        grammar, gen.grammar = gen.grammar, None
        sampler = SlotSampler(
            gen.request.sampling,
            self._vocab,
            self._candidates,
            grammar if isinstance(grammar, CompiledGrammar) else None,
        )
        # Drafts copy tokens from the prompt: none for one with media (no token stands there).
        drafter = None if gen.request.media else make_drafter(self.config.speculative, prompt)
        slot = _Slot(gen, sampler, drafter)
        slot.prefilled = slot.n_past = slot.cached = reuse
        slot.reused = (reuse, 0)
        self.prompt_tokens_reused += reuse
        self._slots[best] = slot

    def _restore(self, prompt: Sequence[int], scope: str, best: int, best_len: int) -> tuple[int, int]:
        """Restore a cached prefix of `scope` into a free slot when it saves more than the slots' own KV."""
        cache = self.prompt_cache
        assert cache is not None  # noqa: S101 - called with a cache only
        found = cache.best(prompt, scope)
        if found is None or found[2] < best_len + _MIN_RESTORE_GAIN:
            if best_len < MIN_CACHED_TOKENS:  # neither a slot nor the cache had this prefix
                cache.stats.misses += 1
            return best, best_len
        tokens, data, shared = found
        # Into the free slot that keeps the busy ones together, the one whose own tokens are
        # worth least (the shortest) among those.
        busy = [s is not None for s in self._slots]
        target = min(
            (i for i, b in enumerate(busy) if not b),
            key=lambda i: (runs([b or j == i for j, b in enumerate(busy)]), len(self._kv[i]), i),
        )
        started = time.perf_counter()
        llama.llama_memory_seq_rm(self._memory, target, -1, -1)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama.llama_state_seq_set_data(self._ctx, buffer, len(data), target) != len(data):
            llama.llama_memory_seq_rm(self._memory, target, -1, -1)
            self._kv[target].clear()
            cache.stats.misses += 1
            return best, best_len
        self._kv[target] = list(tokens)
        cache.stats.hits += 1
        cache.stats.restored_tokens += shared
        cache.stats.restore_seconds += time.perf_counter() - started
        return target, shared

    def _decode_media(self, i: int, slot: _Slot, span: MediaSpan) -> bool:
        """Decode a media span's embeddings into slot `i` (the scheduler thread); False when it
        failed, the generation then ended with an error."""
        projector = self.projector
        rc = -1 if projector is None else projector.decode(self._ctx, span.key, span.start, i, self._rows)
        if rc != 0:
            log.error("model %s: decoding a media chunk failed with status %d", self.name, rc)
            self._finish(i, "error", error=f"decoding an image or clip failed (status {rc})", deliver=True)
            return False
        with self._cond:
            self._pending.charge(slot.gen.request.share, span.length)
        self._kv[i].extend(slot.prompt[span.start : span.start + span.length])
        slot.prefilled = slot.n_past = span.start + span.length
        self.heartbeat = time.monotonic()
        return True

    def _prefill_rank(self, slot: _Slot) -> tuple[int, float, int, int]:
        """Whose prompt chunk goes first: the class, the tenant computed for least, the one holding
        fewer slots (a newcomer starts at the least virtual time: it wins the tie), arrival."""
        share = slot.gen.request.share
        queue = self._pending
        return (
            -share.priority,
            queue.vtime.get(share.tenant, 0.0),
            queue.running[share.tenant],
            queue.arrival(slot.gen),
        )

    def _keep(self, i: int) -> None:
        """Save a finished sequence's KV state in the prompt cache (long ones, not already there)."""
        cache = self.prompt_cache
        tokens = self._kv[i]
        scope = self._scope[i]
        if cache is None or len(tokens) < MIN_CACHED_TOKENS or cache.covers(tokens, scope):
            return
        size = llama.llama_state_seq_get_size(self._ctx, i)
        if size <= 0 or size > cache.max_bytes:
            return
        buffer = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(self._ctx, buffer, size, i)
        if written > 0:
            cache.put(tokens, ctypes.string_at(buffer, written), scope)

    def _common(self, slot: _Slot, other: _Slot) -> int:
        """The common start of two running generations' prompts (found once per pair), 0 when
        they cannot share a cache: another scope's (GenerationRequest.cache_scope), or media."""
        found = slot.peers.get(other.gen)
        if found is None:
            request, theirs = slot.gen.request, other.gen.request
            shareable = request.cache_scope == theirs.cache_scope and not request.media and not theirs.media
            found = common_prefix(slot.prompt, other.prompt) if shareable else 0
            slot.peers[other.gen] = found
        return found

    def _share_prefixes(self) -> set[int]:
        """Prompts whose start another running sequence holds take it from there, a copy of that
        sequence's KV state (as a pause moves one), instead of computing it again: the n choices
        of one request (a generation each, one prompt), or a key's requests that arrive together
        with one long system prompt. A sequence computing more of a start that others share goes
        first: those behind it wait (the slots returned sit the step out) and copy once it is
        in, where it will hold more than a copy to be had now (never one whose copy lacks only
        the last token, which the copy leaves out too) and enough to be copied. It waits only
        for one of a class no lower than its own (never behind a batch request that ranks last),
        and on a model with sliding-window layers only for one whose prompt ends within that
        start (past it, the window it copies has moved on). A prefix shorter than
        MIN_CACHED_TOKENS is computed: it costs less than the copy."""
        waiting: set[int] = set()
        live = {slot.gen for slot in self._slots if slot is not None}
        for j, slot in enumerate(self._slots):
            if slot is None or slot.prefilled >= len(slot.prompt):
                continue
            for gone in [gen for gen in slot.peers if gen not in live]:  # never held past its end
                del slot.peers[gone]
            last = len(slot.prompt) - 1  # the last token is decoded again: its logits
            best, best_keep, awaited = -1, 0, 0
            for k, other in enumerate(self._slots):
                if k == j or other is None:
                    continue
                common = self._common(slot, other)
                if common < slot.prefilled + MIN_CACHED_TOKENS:
                    continue
                keep = min(common, other.prefilled, last)
                if keep > best_keep and self._copyable(k, keep):
                    best, best_keep = k, keep
                if (
                    other.prefilled < common
                    and (other.prefilled, -k) > (slot.prefilled, -j)
                    and other.gen.request.share.priority >= slot.gen.request.share.priority
                    and (self._n_swa == 0 or len(other.prompt) == common)
                ):
                    awaited = max(awaited, min(common, last))
            # Worth it where it will hold more than a copy gives now, and enough to copy at all.
            if awaited > best_keep and awaited >= slot.prefilled + MIN_CACHED_TOKENS:
                waiting.add(j)
                continue
            if (
                best >= 0
                and best_keep >= slot.prefilled + MIN_CACHED_TOKENS
                and not self._copy_prefix(best, j, best_keep)
            ):
                source = self._slots[best]
                if source is not None:  # never tried again: a failed copy costs what the slot had
                    slot.peers[source.gen] = 0
        return waiting

    def _copyable(self, source: int, keep: int) -> bool:
        """Whether a copy of slot `source`'s sequence state can be cut to `keep` positions: with
        sliding-window layers, a state saved and set again holds the window before its last
        position only, which must reach back to `keep - n_swa + 1` (see `keep_prefix`)."""
        if self._n_swa <= 0:
            return True
        pos_min = int(llama.llama_memory_seq_pos_min(self._memory, source))
        pos_max = int(llama.llama_memory_seq_pos_max(self._memory, source))
        restored_min = max(pos_min, pos_max - self._n_swa + 1)
        return pos_min >= 0 and restored_min <= max(0, keep - self._n_swa + 1)

    def _copy_prefix(self, source: int, target: int, keep: int) -> bool:
        """Slot `target`'s sequence made a copy of the first `keep` positions of `source`'s;
        False when that failed (its own prefix may be gone with it: it starts again)."""
        slot = self._slots[target]
        assert slot is not None  # noqa: S101 - called for a busy slot
        if not self._copyable(source, keep):
            return False
        size = llama.llama_state_seq_get_size(self._ctx, source)
        if not 0 < size <= _MAX_SHARE_BYTES:
            return False
        buffer = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(self._ctx, buffer, size, source)
        if written <= 0:
            return False
        before = slot.prefilled
        llama.llama_memory_seq_rm(self._memory, target, -1, -1)
        copied = llama.llama_state_seq_set_data(self._ctx, buffer, written, target) == written
        kept = keep_prefix(self._memory, target, keep, self._n_swa) if copied else 0
        if not copied:
            llama.llama_memory_seq_rm(self._memory, target, -1, -1)
        # What it had of its own is gone too when the copy failed: its prompt starts again.
        self._kv[target] = list(slot.prompt[:kept])
        slot.prefilled = slot.n_past = kept
        # A reply's cached_tokens are those kept from an earlier request (its slot's, the prompt
        # cache): a copy from a sequence computing beside it is not (n choices: the prompt was
        # computed once for the request, and it is charged once).
        slot.cached = min(slot.cached, kept)
        reused, shared = slot.reused
        if not copied:  # what the counts had of this sequence is computed again
            self.prompt_tokens_reused -= reused
            self.prompt_tokens_shared -= shared
            reused = shared = 0
        if kept > before:
            reused, shared = reused + kept - before, shared + kept - before
            self.prompt_tokens_reused += kept - before
            self.prompt_tokens_shared += kept - before
        slot.reused = (reused, shared)
        return kept >= keep

    def _step(self) -> bool:
        if not self._admit():
            return False
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.gen.cancelled:
                self._finish(i, "cancelled", deliver=True)
        waiting = self._share_prefixes()

        # One token for every generating sequence first, so running streams never stall
        # behind a long prompt; then prompt chunks in fair order with what is left, at most
        # `prefill_chunk` while sequences generate (stall-free batching: a step stays short).
        items: list[Item] = []
        budget = self.config.batch_size
        generating = [
            (i, s) for i, s in enumerate(self._slots) if s is not None and s.prefilled >= len(s.prompt)
        ]
        # Prompt chunks in fair order: the class, then the tenant computed for least (engine.fairness).
        prefilling = [
            (i, s)
            for i, s in enumerate(self._slots)
            if s is not None and s.prefilled < len(s.prompt) and i not in waiting
        ]
        if len(prefilling) > 1:
            with self._cond:
                prefilling.sort(key=lambda pair: self._prefill_rank(pair[1]))
        # Short prompts' last chunks go alone, ahead of the decodes: their first tokens come one
        # short step later, not after a step of every sequence. With one KV stream per slot
        # llama.cpp splits a mixed step by sequence anyway, so the decodes lose next to nothing;
        # never twice in a row, so that a run of short prompts cannot stall them, and never for
        # a tenant computed for more than one decoding (`FairQueue.ahead`): its prompt joins
        # their step instead.
        chunk = self.config.prefill_chunk or budget
        limit = min(FIRST_TOKEN_ALONE, chunk)
        first = _short_prompts(prefilling, limit)
        if first and generating:  # not ahead of the decodes for a tenant that has had more than its turn
            with self._cond:
                decoding = [s.gen.request.share for _, s in generating]
                first = [(i, s) for i, s in first if not self._pending.ahead(s.gen.request.share, decoding)]
        stopped_for = False
        if self._newcomer is not None:  # a step was stopped for it: its short prompt goes first
            mine = [(i, s) for i, s in prefilling if s.gen is self._newcomer]
            self._newcomer = None
            if mine and len(mine[0][1].prompt) - mine[0][1].prefilled <= limit:
                first, stopped_for = mine, True
        # Alone when anything else would share the step: decodes, or other prompts' chunks. Never
        # twice in a row, unless a step was stopped for this one (the step after it runs whole).
        others = bool(generating) or len(first) < len(prefilling)
        was_alone = self._alone
        self._alone = bool(others and first and (stopped_for or not self._alone))
        if self._alone:
            generating, prefilling = [], first
            self.first_token_steps += 1
        elif generating:
            budget = min(budget, len(generating) + chunk)
        spec = self.config.speculative
        # Drafts only while few sequences decode: a full batch is compute-bound, drafts only cost.
        drafting = spec.enabled and len(generating) <= spec.max_sequences
        budget -= len(generating)
        # The sequences that draft this step: not those resting after drafts that all failed.
        drafters = (
            {i for i, s in generating if s.drafter is not None and not s.drafter.resting()}
            if drafting
            else set()
        )
        if drafters and self._draft is not None:  # one pass of the draft model drafts for them all
            self._draft.propose(
                [
                    (
                        i,
                        s.drafter,
                        min(
                            budget,
                            self.config.context_size - 3 - s.n_past,
                            s.gen.request.max_tokens - s.completion - 1,
                        ),
                    )
                    for i, s in generating
                    if i in drafters and isinstance(s.drafter, ModelDrafter)
                ]
            )
        # Where each sequence's rows start: what a stopped step removes again (_undo).
        marks: dict[int, tuple[int, int, int]] = {}
        for i, slot in generating:
            marks[i] = (slot.n_past, slot.prefilled, len(self._kv[i]))
            slot.batch_index = len(items)
            items.append((slot.last, slot.n_past, i, True))
            self._kv[i].append(slot.last)
            slot.n_past += 1
            slot.draft = []
            if i in drafters and slot.drafter is not None:
                # Room: the batch, the slot's context, and the reply's own limit.
                room = min(
                    budget,
                    self.config.context_size - 2 - slot.n_past,
                    slot.gen.request.max_tokens - slot.completion - 1,
                )
                if room > 0:
                    slot.draft = slot.drafter.draft()[:room]
                    items.extend((d, slot.n_past + j, i, True) for j, d in enumerate(slot.draft))
                    self._kv[i].extend(slot.draft)
                    budget -= len(slot.draft)
        for i, slot in prefilling:
            if budget <= 0:
                break
            span = slot.media_from(slot.prefilled)
            if span is not None and span.start == slot.prefilled:
                # Its text before it is in the cache (the last step's chunk stopped there): the
                # image or clip is decoded now, alone, and the text after it joins this step.
                if not self._decode_media(i, slot, span):
                    continue
                budget -= span.length
                span = slot.media_from(slot.prefilled)
                if budget <= 0:
                    continue
            end = span.start if span is not None else len(slot.prompt)
            take = min(budget, end - slot.prefilled)
            start = slot.prefilled
            done = start + take == len(slot.prompt)
            last = start + take - 1
            marks[i] = (slot.n_past, slot.prefilled, len(self._kv[i]))
            items.extend((slot.prompt[p], p, i, done and p == last) for p in range(start, start + take))
            self._kv[i].extend(slot.prompt[start : start + take])
            slot.prefilled += take
            slot.n_past = slot.prefilled
            slot.batch_index = len(items) - 1 if done else -1
            budget -= take
        if not items:
            self.heartbeat = time.monotonic()
            return True
        computed = Counter(item[2] for item in items)
        with self._cond:
            for i, count in computed.items():
                slot = self._slots[i]
                if slot is not None:
                    self._pending.charge(slot.gen.request.share, count)
        decode_only = len(items) == len(generating)  # a token for each generating sequence, no more
        if decode_only:
            items += self._padding(items)
        elif len(items) == sum(1 + len(s.draft) for _, s in generating):  # tokens and drafts only
            items += self._even_drafts(generating, len(items))
        items = in_sequence_order(items, self._slots)
        # Its time counts for its size when the step is one ubatch (sequences without a gap).
        one_ubatch = decode_only and items[-1][2] - items[0][2] == len(items) - 1

        fill_batch(self._batch, items)
        # A step may be stopped for a newcomer (_preempt_for), unless a draft model proposed for
        # it: that moved the draft model's own state, which a second try would not find as it
        # was (prompt lookup drafts again from the tokens alone).
        stop = self._stop if self._stop_rest == 0 and not (drafters and self._draft is not None) else None
        if stop is not None:
            with self._cond:
                self._step_shares = [self._slots[i].gen.request.share for i in computed]  # type: ignore[union-attr]
                head = self._pending.peek()  # queued since the admission, while this step was built
                if head is not None:
                    self._preempt_for(head)
        started = time.perf_counter()
        rc = llama.llama_decode(self._ctx, self._batch)
        stopped = False
        if stop is not None:
            with self._cond:
                self._step_shares = None
                stopped = rc == 2 and stop.asked
                stop.clear()
                self._newcomer = self._stopped_for if stopped else None
                self._stopped_for = None
        elif self._stop_rest:
            self._stop_rest -= 1
        if one_ubatch and rc == 0:
            self.steps.record(len(items), time.perf_counter() - started)
        for seq, pos in self._pads:  # dummy rows leave the KV cache at once, decoded or not
            llama.llama_memory_seq_rm(self._memory, seq, pos, -1)
        self._pads.clear()
        if stopped:
            self._undo(marks, was_alone)
            self.heartbeat = time.monotonic()
            return True
        if rc != 0:
            log.error("llama_decode failed with status %d on model %s", rc, self.name)
            for i, slot in enumerate(self._slots):
                if slot is not None and any(it[2] == i for it in items):
                    self._finish(i, "error", error=f"decode failed (status {rc})", deliver=True)
            self.heartbeat = time.monotonic()
            return True

        outbox: list[tuple[Generation, list[Event]]] = []
        for i, slot in enumerate(self._slots):
            if slot is None or slot.batch_index < 0:
                continue
            if slot.draft:
                events = self._verify(i, slot)
                if events:
                    outbox.append((slot.gen, events))
                continue
            token = slot.sampler.sample(self._ctx, slot.batch_index)
            if token < 0:  # no token can continue the grammar
                slot.batch_index = -1
                outbox.append((slot.gen, self._finish(i, "stop")))
                continue
            logprob = self._logprob(slot, token) if slot.gen.request.logprobs is not None else None
            slot.batch_index = -1
            events = self._advance(i, slot, token, logprob)
            if events:
                outbox.append((slot.gen, events))
        if outbox:
            _deliver(outbox)
        self.heartbeat = time.monotonic()
        return True

    def _undo(self, marks: dict[int, tuple[int, int, int]], was_alone: bool) -> None:
        """A stopped step never ran: each sequence's rows leave the KV cache (llama.cpp keeps the
        ubatches it finished) and its slot is where it was.

        Its tokens stay charged to their tenants: taken back, they would put the stopped tenant's
        virtual time below the newcomer's (which starts at the least of those with work), and the
        newcomer the step was stopped for would wait behind it after all.
        """
        for i, (n_past, prefilled, cells) in marks.items():
            llama.llama_memory_seq_rm(self._memory, i, n_past, -1)
            del self._kv[i][cells:]
            slot = self._slots[i]
            assert slot is not None  # noqa: S101 - it had rows in the step
            slot.n_past, slot.prefilled, slot.batch_index = n_past, prefilled, -1
            slot.draft = []
        if self._alone:
            self.first_token_steps -= 1
        self._alone = was_alone
        self._stop_rest = _STOP_REST
        self.stopped_steps += 1

    def _padding(self, items: list[Item]) -> list[Item]:
        """Dummy rows for a decode step (one token per generating sequence), or none.

        They fill the holes between the step's sequences (each run of consecutive ones is a
        ubatch of its own) and bring the step to a size that decodes faster
        (`shapes.plan_rows`). Each is token 0 at the end of a free slot's cached tokens. A
        slot is usable only while its cells have room, and, with sliding-window layers, only
        while its cached tokens are fewer than the window: a later position could let
        llama.cpp overwrite cells of that prefix.
        """
        if not self.steps.seconds:  # padding off
            return []
        present = [False] * len(self._slots)
        for _, _, seq, _ in items:
            present[seq] = True
        limit = self.config.context_size - 1
        if self._n_swa:
            limit = min(limit, self._n_swa - 1)
        # Nor a slot holding more cells than the busy ones: attention spans as many cells of
        # every stream of a ubatch as its fullest stream holds (rounded up to 256).
        span = _cells_spanned(max(len(self._kv[seq]) for _, _, seq, _ in items))
        usable = [
            slot is None and len(kv) < limit and _cells_spanned(len(kv) + 1) <= span
            for slot, kv in zip(self._slots, self._kv, strict=True)
        ]
        chosen = plan_rows(present, usable, self.steps)
        if not chosen:
            return []
        # Positions from llama.cpp itself: a row must follow the last one the cache holds
        # (after a failed decode the tokens noted in _kv may not all be there).
        self._pads = [(seq, llama.llama_memory_seq_pos_max(self._memory, seq) + 1) for seq in chosen]
        self.padded_steps += 1
        return [(0, pos, seq, True) for seq, pos in self._pads]

    def _even_drafts(self, generating: list[tuple[int, _Slot]], n_items: int) -> list[Item]:
        """Rows without logits that give every sequence of a drafting step as many rows as the
        longest draft's (`shapes.even_rows`), so that the step is one ubatch; or none.

        Only for sequences in one run of slots (a gap splits the step anyway), with room in
        the batch and in each one's context. They follow each sequence's own rows and leave
        the KV cache right after the step, as rejected drafts do.
        """
        ids = [i for i, _ in generating]
        if ids[-1] - ids[0] != len(ids) - 1:
            return []
        counts = [1 + len(s.draft) for _, s in generating]
        most = even_rows(counts, self.steps)
        if not most or n_items + sum(most - c for c in counts) > self._rows:
            return []
        if any(s.n_past + most > self.config.context_size - 1 for _, s in generating):
            return []
        rows: list[Item] = []
        for (i, slot), count in zip(generating, counts, strict=True):
            if count < most:
                start = slot.n_past + len(slot.draft)
                rows.extend((0, start + j, i, False) for j in range(most - count))
                self._pads.append((i, start))
        self.evened_steps += 1
        return rows

    def _verify(self, i: int, slot: _Slot) -> list[Event]:
        """Check a sequence's draft with its own sampler, position by position; keep what matches.

        The token at each position is sampled exactly as plain decoding would sample it (the
        same chain, grammar and random state, from the logits at that position); a draft
        token is kept only when it is that token, and the first one that differs ends the
        check, so the reply is token for token what plain decoding gives. Rejected positions
        leave the KV cache.
        """
        draft, base = slot.draft, slot.batch_index
        req = slot.gen.request
        first = slot.n_past - 1  # where `last` went; the drafts follow it
        produced: list[tuple[int, TokenLogprob | None]] = []
        dead_end = False
        for j in range(len(draft) + 1):
            slot.batch_index = base + j
            token = slot.sampler.sample(self._ctx, base + j)
            if token < 0:  # no token can continue the grammar
                dead_end = True
                break
            produced.append((token, self._logprob(slot, token) if req.logprobs is not None else None))
            ends = not req.ignore_eos and llama.llama_vocab_is_eog(self._vocab, token)
            if j == len(draft) or token != draft[j] or ends:
                break
        kept = len(produced) if dead_end else max(0, len(produced) - 1)  # drafts the sampler confirmed
        self.drafted_tokens += len(draft)
        self.accepted_tokens += kept
        slot.drafted += len(draft)
        slot.accepted += kept
        if slot.drafter is not None:
            slot.drafter.accepted(len(draft), kept)
        # The cache holds `last` and the kept drafts; the rest leave it.
        llama.llama_memory_seq_rm(self._memory, i, first + 1 + kept, -1)
        del self._kv[i][len(self._kv[i]) - (len(draft) - kept) :]
        slot.draft = []
        events: list[Event] = []
        for k, (token, logprob) in enumerate(produced):
            slot.n_past = first + 1 + k  # each token before this one is in the cache
            slot.batch_index = -1
            events += self._advance(i, slot, token, logprob)
            if self._slots[i] is not slot:  # finished
                return events
        slot.batch_index = -1
        if dead_end:
            slot.n_past = first + 1 + kept
            events += self._finish(i, "stop")
        return events

    def _logprob(self, slot: _Slot, token: int) -> TokenLogprob:
        """Log-softmax of the model's logits at this position (numpy over the C array)."""
        top_n = slot.gen.request.logprobs or 0
        pointer = llama.llama_get_logits_ith(self._ctx, slot.batch_index)
        logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        peak = float(logits.max())
        norm = peak + math.log(float(np.exp(logits - peak).sum()))
        top: tuple[tuple[str, tuple[int, ...], float], ...] = ()
        if top_n > 0:
            best = np.argpartition(logits, -top_n)[-top_n:]
            best = best[np.argsort(logits[best])[::-1]]
            top = tuple(self._logprob_entry(int(t), float(logits[t]) - norm) for t in best)
        text, raw, value = self._logprob_entry(token, float(logits[token]) - norm)
        return TokenLogprob(text, raw, value, top)

    def _logprob_entry(self, token: int, value: float) -> tuple[str, tuple[int, ...], float]:
        piece = self._cached_piece(token)
        return piece.decode("utf-8", "replace"), tuple(piece), value

    def _cached_piece(self, token: int) -> bytes:
        """A token's bytes; the vocabulary never changes, so each token is converted once."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def _advance(self, i: int, slot: _Slot, token: int, logprob: TokenLogprob | None = None) -> list[Event]:
        """Account for one sampled token; returns the events it produces."""
        req = slot.gen.request
        if not req.ignore_eos and llama.llama_vocab_is_eog(self._vocab, token):
            return self._finish(i, "stop")
        slot.completion += 1
        self.tokens_generated += 1
        slot.last = token
        if slot.drafter is not None:
            slot.drafter.append(token)
        raw = self._cached_piece(token)
        piece = slot.utf8.feed(raw)
        text, hit = slot.stops.feed(piece)
        held = slot.logprobs
        delta = TextDelta(
            text,
            slot.completion,
            () if held is None else held.feed(len(piece), logprob, len(text), earlier_chars(piece, raw)),
            queue_s=slot.gen.queue_s if slot.completion == 1 else 0.0,
            cached_tokens=slot.cached if slot.completion == 1 else 0,
        )
        if hit:
            return [delta, *self._finish(i, "stop", flushed=True)]
        if slot.completion >= req.max_tokens or slot.n_past + 1 >= self.config.context_size:
            return [delta, *self._finish(i, "length")]
        return [delta]

    def _finish(
        self,
        i: int,
        reason: FinishReason,
        *,
        error: str | None = None,
        flushed: bool = False,
        deliver: bool = False,
    ) -> list[Event]:
        slot = self._slots[i]
        assert slot is not None  # noqa: S101 - scheduler invariant
        self.finished[reason] += 1  # counted before the slot shows free: readers see both
        self._slots[i] = None
        with self._cond:
            self._pending.stopped(slot.gen, done=True)
        if reason == "error":  # the cache may not hold what _kv says: forget it
            llama.llama_memory_seq_rm(self._memory, i, -1, -1)
            self._kv[i].clear()
        elif reason in ("stop", "length"):
            self._keep(i)  # for a later prompt that starts the same way, in any slot
            self.hold_times.append(time.monotonic() - slot.admitted)
        slot.sampler.free()
        tail = ""
        if not flushed and reason in ("stop", "length"):
            tail, _ = slot.stops.feed(slot.utf8.flush())
            tail += slot.stops.flush()
        event = Finished(
            reason,
            len(slot.prompt),
            slot.completion,
            text=tail,
            error=error,
            stop_sequence=slot.stops.hit,
            # What held text the finish sent: every logprob still held, but a stop string's.
            logprobs=()
            if slot.logprobs is None
            else slot.logprobs.rest(keep=slot.stops.hit is None and reason in ("stop", "length")),
            cached_tokens=slot.cached,
            draft_tokens=slot.drafted,
            accepted_draft_tokens=slot.accepted,
            queue_s=slot.gen.queue_s,
        )
        if deliver:
            slot.gen.push_threadsafe([event])
            return []
        return [event]


def _short_prompts(prefilling: list[tuple[int, _Slot]], limit: int) -> list[tuple[int, _Slot]]:
    """The first prompts, in fair order, whose remaining tokens come to at most `limit` in all."""
    out: list[tuple[int, _Slot]] = []
    left = limit
    for i, slot in prefilling:
        need = len(slot.prompt) - slot.prefilled
        if need > left:
            break
        out.append((i, slot))
        left -= need
    return out


def _share(gen: Generation) -> Share:
    return gen.request.share


def _cells_spanned(cells: int) -> int:
    """The KV cells attention reads for a stream holding `cells` (llama.cpp pads to 256)."""
    return -(-cells // _KV_PAD) * _KV_PAD


def in_sequence_order(items: list[Item], slots: Sequence[_Slot | None]) -> list[Item]:
    """A step's batch items with their sequences in id order, each one's tokens together, in order.

    With one KV stream per sequence, llama.cpp splits a batch into ubatches of consecutive
    sequence ids (llama_batch_allocr::split_equal, sequential), and each ubatch reads every
    weight of the model again: a prompt token of slot 2 placed after the tokens of slots 0
    to 7 made two ubatches (measured: such a step's decode took twice as long). Generating
    sequences come first and prompts after, so a request starting in a low slot broke the
    order; sorting mends it. Every slot's batch_index follows its token. (Sequences absent
    from a step between present ones still split it: the ids are the KV streams, which is why
    `_assign` keeps the busy slots together.)
    """
    if all(items[k][2] <= items[k + 1][2] for k in range(len(items) - 1)):
        return items
    order = sorted(range(len(items)), key=lambda k: items[k][2])  # stable: positions stay in order
    moved = {old: new for new, old in enumerate(order)}
    for slot in slots:
        if slot is not None and slot.batch_index >= 0:
            slot.batch_index = moved[slot.batch_index]
    return [items[k] for k in order]


def _deliver(outbox: list[tuple[Generation, list[Event]]]) -> None:
    """Hand one step's events to their event loops and wait until the loops have sent them.

    One wake-up of each loop per step, not one per token. The wait keeps the scheduler and
    the event loop in lockstep: llama.cpp's decode threads use every core, and an event loop
    formatting and writing SSE chunks during a decode steals a core from one of them, which
    stalls the whole thread pool at its next barrier (measured: a third of single-stream
    throughput on two cores). Formatting a step's chunks takes well under a millisecond.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, list[Event]]]] = {}
    for gen, events in outbox:
        by_loop.setdefault(gen.loop, []).append((gen, events))
    handled: list[threading.Event] = []  # one per loop and step: a late set() must not leak
    for loop, items in by_loop.items():
        done = threading.Event()
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            loop.call_soon_threadsafe(_push_all, loop, items, done)
            handled.append(done)
    for done in handled:
        # Bounded: a busy or stuck loop must never stall generation for everybody else.
        done.wait(_LOCKSTEP_WAIT_S)


def _push_all(
    loop: asyncio.AbstractEventLoop, items: list[tuple[Generation, list[Event]]], done: threading.Event
) -> None:
    for gen, events in items:
        gen.push(events)
    # Runs after the consumers woken above have taken their turn (the ready queue is FIFO).
    loop.call_soon(_after_consumers, loop, done)


def _after_consumers(loop: asyncio.AbstractEventLoop, done: threading.Event) -> None:
    # One more turn: a consumer's write may have scheduled follow-up work of its own.
    loop.call_soon(done.set)


def _free_grammar(gen: Generation) -> None:
    grammar = gen.grammar
    gen.grammar = None
    if isinstance(grammar, CompiledGrammar):
        grammar.free()
