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
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Final

import llama_cpp as llama
import numpy as np

from edgellmd.engine.generation import (
    Event,
    Finished,
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
    StopMatcher,
    TextDelta,
    TokenLogprob,
    Utf8Stream,
)
from edgellmd.engine.native import (
    ControlTokens,
    EngineConfig,
    EngineError,
    ModelLoadError,
    NativeThread,
    read_model_info,
    token_piece,
    tokenize_segments,
    tokenize_text,
)
from edgellmd.engine.sampling import (
    Candidates,
    CompiledGrammar,
    SlotSampler,
    compile_grammar,
    make_chain,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S: Final = 0.5  # the idle scheduler still wakes up to report liveness
_LOCKSTEP_WAIT_S: Final = 0.02  # longest the scheduler waits for the event loop to send a step


class _Slot:
    """Scheduler-thread state of one sequence in the batch."""

    __slots__ = (
        "batch_index",
        "completion",
        "gen",
        "last",
        "n_past",
        "prefilled",
        "prompt",
        "sampler",
        "stops",
        "utf8",
    )

    def __init__(self, gen: Generation, sampler: SlotSampler) -> None:
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


class Engine(NativeThread):
    """One loaded model and its scheduler thread; all public methods are thread-safe."""

    def __init__(self, config: EngineConfig, *, name: str = "model") -> None:
        """Load the model and start its scheduler (blocking: call it off the event loop).

        Everything native happens on the engine's own thread: llama.cpp's CPU backend runs
        on OpenMP, which keeps a team of threads per calling thread, and more OpenMP threads
        than CPUs makes libgomp stop spinning at barriers and sleep instead. A model loaded
        and warmed on one thread and decoded on another measured 20 context switches per
        graph node and a quarter of the throughput gone.
        """
        super().__init__(config, name)
        self._pending: deque[Generation] = deque()
        self._slots: list[_Slot | None] = [None] * config.slots
        # Liveness for the systemd watchdog: when the scheduler last finished a step or idled.
        self.heartbeat = time.monotonic()
        # Generations ended, by finish reason, and tokens generated (written by the scheduler).
        self.finished: Counter[str] = Counter()
        self.tokens_generated = 0
        self.prompt_tokens_reused = 0
        self._pieces: dict[int, bytes] = {}  # token -> bytes, filled by the scheduler
        self._candidates: Candidates  # resampling room, made once the vocabulary is known
        # Tokens whose keys/values each sequence holds in the KV cache, position by position.
        # A finished sequence keeps them so that the next prompt with the same prefix (a
        # system prompt, a growing conversation) skips that part of the prefill.
        self._kv: list[list[int]] = [[] for _ in range(config.slots)]
        self._start_thread(f"engine:{name}")

    def _load(self) -> None:
        config = self.config
        self._load_model()
        model = self._model
        self._n_swa = max(0, llama.llama_model_n_swa(model))

        cparams = llama.llama_context_default_params()
        cparams.n_ctx = config.context_size * config.slots
        cparams.n_batch = config.batch_size
        cparams.n_ubatch = config.batch_size
        cparams.n_seq_max = config.slots
        cparams.n_threads = config.threads
        cparams.n_threads_batch = config.threads_batch
        # One KV region of context_size cells per slot, as llama-server uses by default. A
        # unified pool (kv_unified) makes every sequence's attention span the cells of all
        # of them: measured 20% slower per token on the demo model with 8 slots on 2 cores.
        cparams.kv_unified = False
        # Sliding-window layers keep only their window (llama-server's default too): for
        # Gemma 3 that is most of the KV cache. A prefix that slid out of the window cannot
        # be reused, which _assign detects (seq_rm fails) and answers with a full prefill.
        cparams.swa_full = False
        cparams.no_perf = True
        ctx = llama.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {config.path}")
        self._ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        self._batch = llama.llama_batch_init(config.batch_size, 0, config.slots)
        self.info = read_model_info(model, self._vocab, config.path)
        self.controls = ControlTokens(self._vocab, self.n_vocab)
        # Room for the whole vocabulary: the last resort of a grammar miss draws from all of it.
        self._candidates = Candidates(self.n_vocab)

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
        grammar: CompiledGrammar | None = None,
    ) -> Generation:
        """Queue a generation; its events arrive on `loop`. Never blocks on the scheduler.

        A request with a grammar brings it compiled (`compile_grammar`, on the prompt pool);
        one that does not gets it compiled here, in the caller's thread (GrammarError).
        The engine owns `grammar` from here on, whatever happens.
        """
        try:
            return self._queue(request, loop, grammar)
        except BaseException:
            if grammar is not None:
                grammar.free()
            raise

    def _queue(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, grammar: CompiledGrammar | None
    ) -> Generation:
        if len(request.prompt_tokens) == 0:
            raise EngineError("empty prompt")
        gen = Generation(request, loop)
        gen.grammar = grammar
        if request.sampling.grammar is not None and grammar is None:
            gen.grammar = self.compile_grammar(request.sampling.grammar)[0]
        with self._cond:
            if self._stopping:
                _free_grammar(gen)
                raise EngineError("engine is shutting down")
            self._pending.append(gen)
            self._cond.notify()
        return gen

    def wake(self) -> None:
        """Wake the scheduler (after a cancellation) so the slot is freed at once."""
        with self._cond:
            self._cond.notify()

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

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        return not self._pending and self.busy_slots == 0

    def _release(self) -> None:
        """On the engine thread, once it stops: fail what is left, then free the model."""
        with self._cond:
            self._stopping = True
            leftovers = list(self._pending)
            self._pending.clear()
        for gen in leftovers:
            _free_grammar(gen)
            gen.push_threadsafe(
                [Finished("error", len(gen.request.prompt_tokens), 0, error="the model was unloaded")]
            )
        for i, slot in enumerate(self._slots):
            if slot is not None:
                self._finish(i, "error", error="the model was unloaded", deliver=True)
        self._free_native()

    # ---- scheduler thread -----------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run one decode so compute buffers exist before the first real request."""
        bos = llama.llama_vocab_bos(self._vocab)
        self._fill_batch([(bos if bos >= 0 else 0, 0, 0, True)])
        if llama.llama_decode(self._ctx, self._batch) != 0:
            raise ModelLoadError(f"warm-up decode failed for {self.config.path}")
        chain, _ = make_chain(SamplingParams(temperature=0.0), self.n_vocab)
        llama.llama_sampler_sample(chain, self._ctx, 0)
        llama.llama_sampler_free(chain)
        llama.llama_memory_clear(self._memory, True)

    def _fill_batch(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        batch = self._batch
        token, pos, n_seq, seq, logits = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        for j, (tok, p, s, out) in enumerate(items):
            token[j] = tok
            pos[j] = p
            n_seq[j] = 1
            seq[j][0] = s
            logits[j] = out
        batch.n_tokens = len(items)

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception:  # a bug here must not leave clients hanging forever
            log.exception("scheduler of model %s crashed", self.name)
            for i, slot in enumerate(self._slots):
                if slot is not None:
                    self._finish(i, "error", error="internal engine error", deliver=True)

    def _admit(self) -> bool:
        """Move waiting generations into free slots; returns False when asked to stop."""
        with self._cond:
            while not self._stopping and not self._pending and self.busy_slots == 0:
                self.heartbeat = time.monotonic()
                self._cond.wait(_IDLE_WAIT_S)
            if self._stopping:
                return False
            # Waiting clients that gave up leave the queue now, not when a slot frees up.
            if any(g.cancelled for g in self._pending):
                for gen in [g for g in self._pending if g.cancelled]:
                    self._pending.remove(gen)
                    _free_grammar(gen)
                    self.finished["cancelled"] += 1
                    gen.push_threadsafe([Finished("cancelled", len(gen.request.prompt_tokens), 0)])
            while self._pending and None in self._slots:
                gen = self._pending.popleft()
                self._assign(gen)
        return True

    def _assign(self, gen: Generation) -> None:
        """Put `gen` in the free slot whose cached tokens share the longest prefix with its prompt."""
        prompt = gen.request.prompt_tokens
        best, best_len = -1, -1
        for i, slot in enumerate(self._slots):
            if slot is None:
                n = _common_prefix(self._kv[i], prompt)
                if n > best_len:
                    best, best_len = i, n
        # The last prompt token is always decoded again: its logits start the reply.
        reuse = min(best_len, len(prompt) - 1)
        if reuse > 0 and self._n_swa > 0:
            # Sliding-window layers keep only the last n_swa positions of a sequence; the new
            # tokens need the window before `reuse`, which may have slid out already.
            pos_min = llama.llama_memory_seq_pos_min(self._memory, best)
            if pos_min < 0 or pos_min > max(0, reuse - self._n_swa):
                reuse = 0
        if reuse <= 0 or not llama.llama_memory_seq_rm(self._memory, best, reuse, -1):
            llama.llama_memory_seq_rm(self._memory, best, -1, -1)
            reuse = 0
        del self._kv[best][reuse:]
        grammar, gen.grammar = gen.grammar, None
        sampler = SlotSampler(
            gen.request.sampling,
            self._vocab,
            self._candidates,
            grammar if isinstance(grammar, CompiledGrammar) else None,
        )
        slot = _Slot(gen, sampler)
        slot.prefilled = slot.n_past = reuse
        self.prompt_tokens_reused += reuse
        self._slots[best] = slot

    def _step(self) -> bool:
        if not self._admit():
            return False
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.gen.cancelled:
                self._finish(i, "cancelled", deliver=True)

        # One token for every generating sequence first, so running streams never stall
        # behind a long prompt; then prompt chunks in admission order with what is left.
        items: list[tuple[int, int, int, bool]] = []
        budget = self.config.batch_size
        for i, slot in enumerate(self._slots):
            if slot is None or slot.prefilled < len(slot.prompt):
                continue
            slot.batch_index = len(items)
            items.append((slot.last, slot.n_past, i, True))
            self._kv[i].append(slot.last)
            slot.n_past += 1
        budget -= len(items)
        for i, slot in enumerate(self._slots):
            if budget <= 0:
                break
            if slot is None or slot.prefilled >= len(slot.prompt):
                continue
            take = min(budget, len(slot.prompt) - slot.prefilled)
            start = slot.prefilled
            done = start + take == len(slot.prompt)
            last = start + take - 1
            items.extend((slot.prompt[p], p, i, done and p == last) for p in range(start, start + take))
            self._kv[i].extend(slot.prompt[start : start + take])
            slot.prefilled += take
            slot.n_past = slot.prefilled
            slot.batch_index = len(items) - 1 if done else -1
            budget -= take
        if not items:
            self.heartbeat = time.monotonic()
            return True

        self._fill_batch(items)
        rc = llama.llama_decode(self._ctx, self._batch)
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
        text, hit = slot.stops.feed(slot.utf8.feed(self._cached_piece(token)))
        delta = TextDelta(text, slot.completion, (logprob,) if logprob is not None else ())
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
        if reason == "error":  # the cache may not hold what _kv says: forget it
            llama.llama_memory_seq_rm(self._memory, i, -1, -1)
            self._kv[i].clear()
        slot.sampler.free()
        tail = ""
        if not flushed and reason in ("stop", "length"):
            tail, _ = slot.stops.feed(slot.utf8.flush())
            tail += slot.stops.flush()
        event = Finished(
            reason, len(slot.prompt), slot.completion, text=tail, error=error, stop_sequence=slot.stops.hit
        )
        if deliver:
            slot.gen.push_threadsafe([event])
            return []
        return [event]


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n
