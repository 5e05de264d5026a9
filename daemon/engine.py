"""The llama.cpp engines: model loading, tokenization, the continuous-batching scheduler, embeddings.

This is the only module that imports `llama_cpp` (house rule: quarantine the native
dependency). One `Engine` owns one model and one `llama_context` with `n_seq_max = slots`
and one KV region per slot, driven by one scheduler thread. Each scheduler step builds one
`llama_batch` holding one token for every generating sequence plus as many prompt tokens of
admitted sequences as `n_batch` leaves room for (chunked prefill interleaved with decoding),
runs one `llama_decode`, samples each sequence with its own C sampler chain and hands the
new text to the event loop with one `call_soon_threadsafe` per step.

An `EmbeddingEngine` owns one model and one `llama_context` created with embeddings on and a
pooling layer; its thread takes embed() jobs in order and returns one unit vector per input.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import ctypes
import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import llama_cpp as llama
import numpy as np

from edgellmd.generation import (
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

log = logging.getLogger(__name__)

# A grammar miss is resampled among the likeliest tokens the grammar allows: the first tier
# of candidates, then the second, and only when neither holds a valid token does the
# grammar walk the whole vocabulary (see Engine._resample_best).
_RESAMPLE_TIERS: Final = (64, 4096)
_PIECE_BUF: Final = 256  # bytes; longer pieces are retried with the size llama.cpp asks for
_DEFAULT_SEED: Final = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a fresh random seed per chain
_IDLE_WAIT_S: Final = 0.5  # the idle scheduler still wakes up to report liveness
_LOCKSTEP_WAIT_S: Final = 0.02  # longest the scheduler waits for the event loop to send a step
_GGML_LOG_LEVEL_WARN: Final = 3  # enum ggml_log_level (NONE, DEBUG, INFO, WARN, ERROR, CONT); not exported
_GGML_LOG_LEVEL_ERROR: Final = 4


class EngineError(Exception):
    """A llama.cpp operation failed."""


class ModelLoadError(EngineError):
    """A model file could not be loaded; the message says why."""


# llama.cpp keeps one process-wide log callback and one backend; both are set up once.
_backend_lock = threading.Lock()
_backend_ready = False
_log_callback: Any = None  # keeps the ctypes thunk alive for as long as llama.cpp may call it


def _on_llama_log(level: int, text: bytes | None, _user: object) -> None:
    # llama.cpp logs every tensor at load time; keep that at debug, surface its errors.
    if not text:
        return
    message = text.decode("utf-8", "replace").rstrip()
    if message:
        py_level = logging.WARNING if level == _GGML_LOG_LEVEL_ERROR else logging.DEBUG
        log.log(py_level, "llama.cpp: %s", message)


def _init_backend() -> None:
    global _backend_ready, _log_callback  # noqa: PLW0603 - one native backend per process
    with _backend_lock:
        if _backend_ready:
            return
        _log_callback = llama.llama_log_callback(_on_llama_log)
        llama.llama_log_set(_log_callback, ctypes.c_void_p())
        llama.llama_backend_init()
        _backend_ready = True


def builtin_chat_templates() -> list[str]:
    """Names of the chat templates compiled into llama.cpp (`gemma`, `chatml`, `llama3`, ...)."""
    count = llama.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * max(count, 1))()
    count = llama.llama_chat_builtin_templates(names, count)
    return sorted(n.decode() for n in names[:count] if n)


def apply_builtin_template(name: str, messages: Sequence[tuple[str, str]]) -> str:
    """Render (role, content) pairs with a llama.cpp built-in template, ending at the assistant's turn."""
    chat = (llama.llama_chat_message * len(messages))()
    keep: list[bytes] = []  # the C structs point into these buffers
    for i, (role, content) in enumerate(messages):
        r, c = role.encode(), content.encode()
        keep += (r, c)
        chat[i].role, chat[i].content = r, c
    size = sum(len(b) for b in keep) * 2 + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama.llama_chat_apply_template(name.encode(), chat, len(messages), True, buf, size)
        if n < 0:
            raise EngineError(f"chat template {name!r} is not a llama.cpp built-in template")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise EngineError("chat template output did not fit")  # pragma: no cover - size is exact


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the GGUF file says about the model, read once at load time."""

    path: Path
    architecture: str
    description: str
    n_ctx_train: int
    n_vocab: int
    n_params: int
    size_bytes: int
    chat_template: str | None
    bos_text: str
    eos_text: str
    add_bos: bool


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to load and run one model (filled from the model's settings)."""

    path: Path
    slots: int
    context_size: int  # tokens per slot
    batch_size: int
    threads: int
    threads_batch: int
    gpu_layers: int = 0
    mmap: bool = False  # may memory-map the file (a private preload copy only); False: read it


def _set_load_mode(mparams: Any, *, mmap: bool) -> None:
    """Map the file or read it, in whichever form this llama.cpp's model params take.

    Recent llama.cpp has `load_mode` (and `lazy_mode`, whose on-demand reads need a
    mapping); older ones a `use_mmap` flag. A ctypes structure silently accepts an unknown
    attribute, so the field is looked up first: a build with neither is refused rather than
    left mapping a file it was told to read.
    """
    fields = {name for name, *_ in type(mparams)._fields_}
    if "load_mode" in fields:
        # AUTO: llama.cpp's own choice for the device (a mapping on the CPU).
        mparams.load_mode = llama.LLAMA_LOAD_MODE_AUTO if mmap else llama.LLAMA_LOAD_MODE_NONE
        if "lazy_mode" in fields and not mmap:
            mparams.lazy_mode = llama.LLAMA_LAZY_MODE_OFF
    elif "use_mmap" in fields:
        mparams.use_mmap = mmap
    else:
        raise ModelLoadError("this llama.cpp build's model parameters have neither load_mode nor "
                             "use_mmap: cannot choose between mapping and reading the model file")


# ---- model metadata and tokens, shared by Engine and EmbeddingEngine ----------------------


def _model_meta(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def _read_model_info(model: Any, vocab: Any, path: Path) -> ModelInfo:
    desc = ctypes.create_string_buffer(256)
    llama.llama_model_desc(model, desc, len(desc))
    template = llama.llama_model_chat_template(model, None)
    return ModelInfo(
        path=path,
        architecture=_model_meta(model, "general.architecture") or "unknown",
        description=desc.value.decode("utf-8", "replace"),
        n_ctx_train=llama.llama_model_n_ctx_train(model),
        n_vocab=llama.llama_vocab_n_tokens(vocab),
        n_params=llama.llama_model_n_params(model),
        size_bytes=llama.llama_model_size(model),
        chat_template=template.decode("utf-8", "replace") if template else None,
        bos_text=_token_text(vocab, llama.llama_vocab_bos(vocab)),
        eos_text=_token_text(vocab, llama.llama_vocab_eos(vocab)),
        add_bos=bool(llama.llama_vocab_get_add_bos(vocab)),
    )


def _token_text(vocab: Any, token: int) -> str:
    if token < 0:
        return ""
    return _token_piece(vocab, token, special=True).decode("utf-8", "replace")


def _tokenize(vocab: Any, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8")
    size = len(data) + 8
    buf = (llama.llama_token * size)()
    n = llama.llama_tokenize(vocab, data, len(data), buf, size, add_special, parse_special)
    if n < 0:
        size = -n
        buf = (llama.llama_token * size)()
        n = llama.llama_tokenize(vocab, data, len(data), buf, size, add_special, parse_special)
    if n < 0:
        raise EngineError("tokenization failed")
    return list(buf[:n])


def _token_piece(vocab: Any, token: int, *, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(_PIECE_BUF)
    n = llama.llama_token_to_piece(vocab, token, buf, _PIECE_BUF, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[: max(n, 0)]


class _Slot:
    """Scheduler-thread state of one sequence in the batch."""

    __slots__ = (
        "batch_index", "chain", "check", "completion", "gen", "grammar", "history", "last",
        "n_past", "penalties", "prefilled", "prompt", "stops", "utf8",
    )

    def __init__(self, gen: Generation, chain: Any, penalties: Any = None, grammar: Any = None) -> None:
        self.gen = gen
        self.chain = chain
        # Structured output: a grammar sampler of its own (not in the chain), which checks
        # the chain's pick and, on a miss, filters the candidates of a resample.
        self.grammar = grammar
        self.check: Any = None
        # On a miss the chain has already accepted the rejected pick into its penalties: they
        # are rebuilt from `history` (the last penalty_last_n tokens really generated).
        self.penalties = penalties if grammar else None
        self.history: deque[int] | None = None
        if grammar:
            self.check = (llama.llama_token_data * 1)()
            if self.penalties:
                self.history = deque(maxlen=max(0, gen.request.sampling.penalty_last_n))
        self.prompt: Sequence[int] = gen.request.prompt_tokens
        self.prefilled = 0  # prompt tokens already in the KV cache
        self.n_past = 0  # position of the next token
        self.completion = 0  # tokens generated so far
        self.batch_index = -1  # where this sequence's logits sit in the last batch, or -1
        self.last = -1  # the last sampled token, fed back in the next step
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(gen.request.stop)


class _NativeThread(abc.ABC):
    """One model on one thread: it loads, warms up and then serves until stopped.

    Everything native happens on that thread (see Engine); subclasses provide _load,
    _warm_up, _run, _release and _free_native.
    """

    config: EngineConfig
    _model: Any
    _vocab: Any
    _ctx: Any
    _batch: Any
    n_vocab: int

    def _start_thread(self, name: str) -> None:
        """Start the thread and wait for the load; re-raise its error here."""
        self._loaded = threading.Event()
        self._load_errors: list[BaseException] = []  # set by the engine thread
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_errors:
            self._thread.join()
            raise self._load_errors[0]

    def _main(self) -> None:
        try:
            self._load()
            self._warm_up()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor's caller
            self._load_errors.append(exc if isinstance(exc, EngineError) else ModelLoadError(str(exc)))
            self._free_native()
            self._loaded.set()
            return
        self._loaded.set()
        try:
            self._run()
        finally:
            self._release()

    def _load_model(self) -> None:
        config = self.config
        mparams = llama.llama_model_default_params()
        mparams.n_gpu_layers = config.gpu_layers
        _set_load_mode(mparams, mmap=config.mmap)
        model = llama.llama_model_load_from_file(str(config.path).encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {config.path} (not a supported GGUF model?)")
        self._model = model
        self._vocab = llama.llama_model_get_vocab(model)
        self.n_vocab = llama.llama_vocab_n_tokens(self._vocab)

    @abc.abstractmethod
    def _load(self) -> None:
        """Provided by each engine (runs on the engine thread)."""

    @abc.abstractmethod
    def _warm_up(self) -> None:
        """Provided by each engine (runs on the engine thread)."""

    @abc.abstractmethod
    def _run(self) -> None:
        """Provided by each engine (runs on the engine thread)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Provided by each engine (runs on the engine thread)."""

    def _free_native(self) -> None:
        # Whatever _load got as far as creating, in reverse order.
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            llama.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            llama.llama_model_free(self._model)
            self._model = None


class Engine(_NativeThread):
    """One loaded model and its scheduler thread; all public methods are thread-safe."""

    def __init__(self, config: EngineConfig, *, name: str = "model") -> None:
        """Load the model and start its scheduler (blocking: call it off the event loop).

        Everything native happens on the engine's own thread: llama.cpp's CPU backend runs
        on OpenMP, which keeps a team of threads per calling thread, and more OpenMP threads
        than CPUs makes libgomp stop spinning at barriers and sleep instead. A model loaded
        and warmed on one thread and decoded on another measured 20 context switches per
        graph node and a quarter of the throughput gone.
        """
        _init_backend()
        self.config = config
        self.name: Final = name
        if not config.path.is_file():
            raise ModelLoadError(f"model file not found: {config.path}")
        self._cond = threading.Condition()
        self._pending: deque[Generation] = deque()
        self._slots: list[_Slot | None] = [None] * config.slots
        self._stopping = False
        # Liveness for the systemd watchdog: when the scheduler last finished a step or idled.
        self.heartbeat = time.monotonic()
        # Generations ended, by finish reason, and tokens generated (written by the scheduler).
        self.finished: Counter[str] = Counter()
        self.tokens_generated = 0
        self.prompt_tokens_reused = 0
        self._pieces: dict[int, bytes] = {}  # token -> bytes, filled by the scheduler
        # Grammar-miss candidates (scheduler thread only, sized once the vocabulary is
        # known), written through a numpy view.
        self._candidates: Any = None
        self._candidate_view: Any = None
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
        self.info = _read_model_info(model, self._vocab, config.path)
        # Room for the whole vocabulary: the last resort of a grammar miss draws from all of it.
        self._candidates = (llama.llama_token_data * self.n_vocab)()
        self._candidate_view = np.ctypeslib.as_array(self._candidates)
        self._all_tokens = np.arange(self.n_vocab, dtype=np.int32)

    # ---- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (thread-safe: the vocabulary is read-only)."""
        return _tokenize(self._vocab, text, add_special=add_special, parse_special=parse_special)

    def _piece(self, token: int, *, special: bool = False) -> bytes:
        return _token_piece(self._vocab, token, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids to text (for tests and diagnostics)."""
        return b"".join(self._piece(t) for t in tokens).decode("utf-8", "replace")

    # ---- scheduler interface (event loop side) -------------------------------------------

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Generation:
        """Queue a generation; its events arrive on `loop`. Never blocks on llama.cpp."""
        if len(request.prompt_tokens) == 0:
            raise EngineError("empty prompt")
        gen = Generation(request, loop)
        with self._cond:
            if self._stopping:
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

    def close(self) -> None:
        """Stop the scheduler, end every generation with an error, free native memory (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _release(self) -> None:
        """On the engine thread, once it stops: fail what is left, then free the model."""
        with self._cond:
            self._stopping = True
            leftovers = list(self._pending)
            self._pending.clear()
        for gen in leftovers:
            gen.push_threadsafe([Finished("error", len(gen.request.prompt_tokens), 0,
                                          error="the model was unloaded")])
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
        chain, _ = self._make_chain(SamplingParams(temperature=0.0))
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

    def _make_chain(self, sp: SamplingParams) -> tuple[Any, Any]:
        """The request's sampler chain, and its penalties sampler (None without penalties)."""
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        add = llama.llama_sampler_chain_add
        penalties = None
        if sp.logit_bias:
            biases: Any = (llama.llama_logit_bias * len(sp.logit_bias))(
                *(llama.llama_logit_bias(token, bias) for token, bias in sp.logit_bias))
            add(chain, llama.llama_sampler_init_logit_bias(self.n_vocab, len(sp.logit_bias), biases))
        if sp.penalized:
            penalties = llama.llama_sampler_init_penalties(
                self.n_vocab, sp.penalty_last_n, sp.repeat_penalty,
                sp.frequency_penalty, sp.presence_penalty)
            add(chain, penalties)  # the chain owns it now
        if sp.greedy:
            add(chain, llama.llama_sampler_init_greedy())
            return chain, penalties
        # Same order as llama-server: top_k, top_p, min_p, then temperature, then draw.
        if sp.top_k > 0:
            add(chain, llama.llama_sampler_init_top_k(sp.top_k))
        if sp.top_p < 1.0:
            add(chain, llama.llama_sampler_init_top_p(sp.top_p, 1))
        if sp.min_p > 0.0:
            add(chain, llama.llama_sampler_init_min_p(sp.min_p, 1))
        add(chain, llama.llama_sampler_init_temp(sp.temperature))
        seed = _DEFAULT_SEED if sp.seed is None else sp.seed & 0xFFFFFFFF
        add(chain, llama.llama_sampler_init_dist(seed))
        return chain, penalties

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
        sp = gen.request.sampling
        grammar = None
        if sp.grammar is not None:
            grammar = llama.llama_sampler_init_grammar(self._vocab, sp.grammar.encode(), b"root")
            if not grammar:  # the API layer compiles grammars it makes; this is a safety net
                gen.push_threadsafe([Finished("error", len(prompt), 0, error="the grammar does not parse")])
                self.finished["error"] += 1
                return
        slot = _Slot(gen, *self._make_chain(sp), grammar=grammar)
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
            token = llama.llama_sampler_sample(slot.chain, self._ctx, slot.batch_index)
            if slot.grammar is not None:
                token = self._constrain(slot, token)
                if token < 0:
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

    def _constrain(self, slot: _Slot, token: int) -> int:
        """Keep `token` if the grammar allows it, else resample with the grammar applied; -1
        when no token of the vocabulary continues the grammar.

        As llama-server does: checking one token is cheap, applying a grammar to every
        candidate of a 262k vocabulary is not, and most picks are already valid.
        """
        check = slot.check
        check[0].id, check[0].logit, check[0].p = token, 0.0, 0.0
        array = llama.llama_token_data_array(check, 1, -1, False)
        llama.llama_sampler_apply(slot.grammar, ctypes.byref(array))
        if math.isinf(check[0].logit):
            token = self._resample_best(slot)
            if token < 0:
                # Nothing likely fits: the grammar filters the whole vocabulary.
                pointer = llama.llama_get_logits_ith(self._ctx, slot.batch_index)
                logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
                token = self._draw_valid(slot, self._all_tokens, logits)
                if token < 0:
                    # No token of this vocabulary continues the grammar. Accepting one the
                    # grammar refuses aborts the process inside llama.cpp: the caller ends
                    # the reply instead.
                    return -1
            if slot.penalties:
                # The chain accepted its rejected pick; its penalties must count this token.
                llama.llama_sampler_reset(slot.penalties)
                for past in slot.history or ():
                    llama.llama_sampler_accept(slot.penalties, past)
                llama.llama_sampler_accept(slot.penalties, token)
        if slot.history is not None:
            slot.history.append(token)
        llama.llama_sampler_accept(slot.grammar, token)
        return token

    def _resample_best(self, slot: _Slot) -> int:
        """Sample among the likeliest candidates the grammar allows; -1 when none of them fits.

        The request's chain keeps top_k (40) tokens anyway, and any valid token outside a
        tier ranks below every valid one inside it, so drawing from the valid tokens among
        the likeliest few thousand follows the same sampler as the whole vocabulary would
        (greedy exactly). Walking the whole vocabulary with the grammar costs tens of
        milliseconds on a 262k vocabulary; a tier of 4,096 costs about a millisecond.
        """
        pointer = llama.llama_get_logits_ith(self._ctx, slot.batch_index)
        logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        # Ranked as the chain will see them: with the request's logit_bias added (the chain
        # adds it itself, so the candidates carry the model's own logits).
        scores = logits
        bias = slot.gen.request.sampling.logit_bias
        if bias:
            scores = logits.copy()
            ids, values = zip(*bias, strict=True)
            scores[list(ids)] += np.asarray(values, dtype=scores.dtype)
        tiers = [min(k, self.n_vocab) for k in _RESAMPLE_TIERS]
        pool = np.argpartition(scores, -tiers[-1])[-tiers[-1]:]
        tried = 0
        for k in tiers:
            if k <= tried:
                continue
            # The k likeliest of the pool (all of it for the last tier).
            candidates = pool[np.argpartition(scores[pool], -k)[-k:]] if k < len(pool) else pool
            token = self._draw_valid(slot, candidates, logits)
            if token >= 0:
                return token
            tried = k
        return -1

    def _draw_valid(self, slot: _Slot, tokens: Any, logits: Any) -> int:
        """Apply the grammar, then the request's chain, to `tokens`; -1 when none is valid."""
        n = len(tokens)
        view = self._candidate_view
        view["id"][:n] = tokens
        view["logit"][:n] = logits[tokens]
        view["p"][:n] = 0.0
        array = llama.llama_token_data_array(self._candidates, n, -1, False)
        llama.llama_sampler_apply(slot.grammar, ctypes.byref(array))
        if np.isneginf(view["logit"][:n]).all():
            return -1
        # The request's own samplers (penalties, top-k/p, temperature, draw) pick among them.
        llama.llama_sampler_apply(slot.chain, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            return -1
        chosen = array.data[array.selected]
        return -1 if math.isinf(chosen.logit) else int(chosen.id)

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
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece.decode("utf-8", "replace"), tuple(piece), value

    def _advance(self, i: int, slot: _Slot, token: int, logprob: TokenLogprob | None = None) -> list[Event]:
        """Account for one sampled token; returns the events it produces."""
        req = slot.gen.request
        if not req.ignore_eos and llama.llama_vocab_is_eog(self._vocab, token):
            return self._finish(i, "stop")
        slot.completion += 1
        self.tokens_generated += 1
        slot.last = token
        piece = self._pieces.get(token)
        if piece is None:  # the vocabulary never changes: convert each token once
            piece = self._pieces[token] = self._piece(token)
        text, hit = slot.stops.feed(slot.utf8.feed(piece))
        delta = TextDelta(text, slot.completion, (logprob,) if logprob is not None else ())
        if hit:
            return [delta, *self._finish(i, "stop", flushed=True)]
        if slot.completion >= req.max_tokens or slot.n_past + 1 >= self.config.context_size:
            return [delta, *self._finish(i, "length")]
        return [delta]

    def _finish(self, i: int, reason: FinishReason, *, error: str | None = None,
                flushed: bool = False, deliver: bool = False) -> list[Event]:
        slot = self._slots[i]
        assert slot is not None  # noqa: S101 - scheduler invariant
        self.finished[reason] += 1  # counted before the slot shows free: readers see both
        self._slots[i] = None
        if reason == "error":  # the cache may not hold what _kv says: forget it
            llama.llama_memory_seq_rm(self._memory, i, -1, -1)
            self._kv[i].clear()
        llama.llama_sampler_free(slot.chain)
        if slot.grammar:
            llama.llama_sampler_free(slot.grammar)
        tail = ""
        if not flushed and reason in ("stop", "length"):
            tail, _ = slot.stops.feed(slot.utf8.flush())
            tail += slot.stops.flush()
        event = Finished(reason, len(slot.prompt), slot.completion, text=tail, error=error)
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


def _push_all(loop: asyncio.AbstractEventLoop, items: list[tuple[Generation, list[Event]]],
              done: threading.Event) -> None:
    for gen, events in items:
        gen.push(events)
    # Runs after the consumers woken above have taken their turn (the ready queue is FIFO).
    loop.call_soon(_after_consumers, loop, done)


def _after_consumers(loop: asyncio.AbstractEventLoop, done: threading.Event) -> None:
    # One more turn: a consumer's write may have scheduled follow-up work of its own.
    loop.call_soon(done.set)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """GBNF for a JSON schema (llama.cpp's own converter; the caller checks the schema first)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: PLC0415 - pure Python, rarely used

    text: str = json_schema_to_gbnf(json.dumps(schema))
    # Allow a newline and indentation where the converter allows one optional space (as
    # llama.cpp's current converter does): models pretty-print JSON, and every token the
    # grammar rejects costs a resample over the whole vocabulary. Still bounded.
    return text.replace('space ::= " "?', 'space ::= | " " | "\\n" [ \\t]{0,20}')


def default_threads() -> int:
    """Threads llama.cpp should use when the config does not say: the CPUs we may run on."""
    return max(1, len(os.sched_getaffinity(0)))


# ---- embeddings -----------------------------------------------------------------------------

# Inputs per llama_decode. Packing several (each its own sequence) changes their vectors: the
# pooling is a matmul over all the batch's tokens, so an input's tokens land at other offsets
# of the sum, and the CPU flash-attention kernel takes another path for another batch shape.
# Measured on Gemma 3 270M, per component of the unit vector: up to 5e-8 apart without flash
# attention, 1e-2 with it. Identical inputs must give identical vectors, so each input gets a
# decode of its own. The price, same model, 2 cores, 64 short inputs: 14 inputs/s against 25
# packed 8 a decode. Raising this packs up to `slots` inputs a decode again.
_INPUTS_PER_DECODE: Final = 1

# What a GGUF's `<arch>.pooling_type` may declare (enum llama_pooling_type), by name for logs.
_POOLING_NAMES: Final = {
    llama.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama.LLAMA_POOLING_TYPE_CLS: "cls",
    llama.LLAMA_POOLING_TYPE_LAST: "last",
}


class _EmbedJob:
    """One embed() call: its token lists and the future its caller waits on."""

    __slots__ = ("future", "inputs")

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.future: Future[list[list[float]]] = Future()


class EmbeddingEngine(_NativeThread):
    """One embedding model: a llama_context created with embeddings on, run on its own thread."""

    def __init__(self, config: EngineConfig, *, name: str = "model") -> None:
        """Load the model, warm it up and start its thread (blocking: call it off the event loop).

        Every native call happens on this engine's own thread, for the reason the Engine
        docstring gives (one OpenMP team per calling thread); embed() only queues a job.
        """
        _init_backend()
        self.config = config
        self.name: Final = name
        if not config.path.is_file():
            raise ModelLoadError(f"model file not found: {config.path}")
        self._cond = threading.Condition()
        self._jobs: deque[_EmbedJob] = deque()
        self._current: _EmbedJob | None = None  # the job being embedded (engine thread writes)
        self._stopping = False
        self._tokenizing = 0  # tokenize() calls in progress: the vocabulary is freed after them
        # Liveness for the systemd watchdog: when the thread last finished a batch or idled.
        self.heartbeat = time.monotonic()
        self._start_thread(f"embed:{name}")

    def _load(self) -> None:
        config = self.config
        self._load_model()
        model = self._model
        # The pooled vector's size: n_embd_out, which equals n_embd except for models whose
        # output width differs from their hidden width (deepstack ones such as Qwen3-VL);
        # llama.cpp sizes llama_get_embeddings_seq's result with it.
        self.n_embd = llama.llama_model_n_embd_out(model)
        self.info = _read_model_info(model, self._vocab, config.path)
        pooling = self._pooling()
        self.pooling: str = _POOLING_NAMES[pooling]

        cparams = llama.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = pooling
        self._per_decode = min(config.slots, _INPUTS_PER_DECODE)
        cparams.n_ctx = config.context_size * self._per_decode
        cparams.n_seq_max = self._per_decode
        # A pooled vector is computed per ubatch: a sequence split over two ubatches would
        # come back as the pool of its second part only (and non-causal models refuse to
        # split at all). So one ubatch holds a whole batch, and a batch at least one input.
        cparams.n_batch = cparams.n_ubatch = max(config.batch_size, config.context_size)
        # The cache is emptied before every decode, so per-sequence regions (which the Engine
        # keeps for prefix reuse) buy nothing here: one pool of cells serves any batch.
        cparams.kv_unified = True
        cparams.n_threads = config.threads
        cparams.n_threads_batch = config.threads_batch
        cparams.no_perf = True
        ctx = llama.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {config.path}")
        self._ctx = ctx
        if llama.llama_pooling_type(ctx) != pooling:
            raise ModelLoadError(f"llama.cpp did not accept {self.pooling} pooling for {config.path}")
        # llama.cpp lowers n_batch to n_ctx for causal models; pack batches by what it kept.
        self._n_batch = min(llama.llama_n_batch(ctx), llama.llama_n_ubatch(ctx))
        if self._n_batch < config.context_size:
            raise ModelLoadError(f"llama.cpp allows only {self._n_batch} tokens per batch for "
                                 f"{config.path}, fewer than context_size {config.context_size}")
        self._memory = llama.llama_get_memory(ctx)  # NULL for encoder-only models (BERT)
        self._batch = llama.llama_batch_init(self._n_batch, 0, 1)

    def _pooling(self) -> int:
        """The pooling this model declares, or MEAN for one that declares none."""
        declared = _model_meta(self._model, f"{self.info.architecture}.pooling_type")
        value = int(declared) if declared and declared.isdigit() else llama.LLAMA_POOLING_TYPE_NONE
        if value == llama.LLAMA_POOLING_TYPE_RANK:
            raise ModelLoadError(f"{self.config.path} is a reranking model (rank pooling), "
                                 "not an embedding model")
        # A plain decoder (llama, gemma, ...) declares none, and llama.cpp then pools NONE:
        # one vector per token and no llama_get_embeddings_seq. The mean over the tokens is
        # what OpenAI-style clients expect from such a model; llama-server refuses it instead.
        return value if value in _POOLING_NAMES else llama.LLAMA_POOLING_TYPE_MEAN

    def _warm_up(self) -> None:
        """Embed one token so compute buffers exist (and pooling works) before the first request."""
        bos = llama.llama_vocab_bos(self._vocab)
        try:
            self._decode([[bos if bos >= 0 else 0]])
        except EngineError as exc:
            raise ModelLoadError(f"warm-up embedding failed for {self.config.path}: {exc}") from exc
        log.info("embedding model %s: %d dimensions, %s pooling", self.name, self.n_embd, self.pooling)

    # ---- interface (any thread) -----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (thread-safe: the vocabulary is read-only until close)."""
        with self._cond:
            if self._stopping:  # the vocabulary is freed with the model
                raise EngineError("engine is shutting down")
            self._tokenizing += 1
        try:
            return _tokenize(self._vocab, text, add_special=add_special, parse_special=parse_special)
        finally:
            with self._cond:
                self._tokenizing -= 1
                self._cond.notify_all()

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One unit-length vector per token list, in input order (blocking; thread-safe)."""
        if not inputs:
            raise EngineError("no inputs to embed")
        limit = self.config.context_size
        checked: list[list[int]] = []
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise EngineError(f"input {i} is empty")
            if len(tokens) > limit:
                raise EngineError(f"input {i} has {len(tokens)} tokens, more than the limit of {limit}")
            if not all(0 <= t < self.n_vocab for t in tokens):
                raise EngineError(f"input {i} holds a token id outside the vocabulary "
                                  f"(0 to {self.n_vocab - 1})")
            checked.append(list(tokens))  # a copy: the caller may reuse its lists
        job = _EmbedJob(checked)
        with self._cond:
            if self._stopping:
                raise EngineError("engine is shutting down")
            self._jobs.append(job)
            self._cond.notify()
        return job.future.result()

    @property
    def busy_slots(self) -> int:
        """Inputs being embedded now (at most `slots`)."""
        job = self._current
        return min(len(job.inputs), self.config.slots) if job is not None else 0

    @property
    def queue_depth(self) -> int:
        """embed() calls waiting for the current one to finish."""
        return len(self._jobs)

    def occupancy(self) -> tuple[int, int]:
        """Inputs being embedded and calls waiting, read together."""
        with self._cond:
            return self.busy_slots, len(self._jobs)

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        return not self._jobs and self._current is None

    def close(self) -> None:
        """Stop the thread, fail waiting calls, free native memory (blocking; idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._jobs:
                    self.heartbeat = time.monotonic()
                    self._cond.wait(_IDLE_WAIT_S)
                if self._stopping:
                    return
                # Current before it leaves the queue: `idle` (read without the lock) never
                # sees neither while a job moves from one to the other.
                job = self._current = self._jobs[0]
                self._jobs.popleft()
            try:
                job.future.set_result(self._embed_all(job.inputs))
            except EngineError as exc:
                job.future.set_exception(exc)
            except Exception:  # a bug here must fail the call, not kill the thread
                log.exception("embedding thread of model %s failed", self.name)
                job.future.set_exception(EngineError("internal engine error"))
            finally:
                self._current = None
                self.heartbeat = time.monotonic()

    def _embed_all(self, inputs: list[list[int]]) -> list[list[float]]:
        """Embed in batches of up to `_per_decode` inputs and n_batch tokens."""
        out: list[list[float]] = []
        start = 0
        while start < len(inputs):
            if self._stopping:  # close() during a long job: do not finish it first
                raise EngineError("the model was unloaded")
            end, used = start, 0
            while (end < len(inputs) and end - start < self._per_decode
                   and used + len(inputs[end]) <= self._n_batch):
                used += len(inputs[end])
                end += 1
            out.extend(self._decode(inputs[start:end]))
            self.heartbeat = time.monotonic()
            start = end
        return out

    def _decode(self, group: Sequence[Sequence[int]]) -> list[list[float]]:
        """One llama_decode over `group`, each input its own sequence; returns unit vectors."""
        batch = self._batch
        token, pos, n_seq, seq, logits = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        j = 0
        for s, tokens in enumerate(group):
            for p, tok in enumerate(tokens):
                token[j] = tok
                pos[j] = p
                n_seq[j] = 1
                seq[j][0] = s
                logits[j] = True  # pooling reads every token's output; llama.cpp warns otherwise
                j += 1
        batch.n_tokens = j
        if self._memory:  # each batch starts from an empty cache: sequence ids are reused
            llama.llama_memory_clear(self._memory, True)
        rc = llama.llama_decode(self._ctx, batch)
        if rc != 0:
            log.error("llama_decode failed with status %d on embedding model %s", rc, self.name)
            raise EngineError(f"decode failed (status {rc})")
        vectors: list[list[float]] = []
        for s in range(len(group)):
            ptr = llama.llama_get_embeddings_seq(self._ctx, s)
            if not ptr:
                raise EngineError("llama.cpp returned no pooled embedding")
            vectors.append(_unit(ptr[: self.n_embd]))
        return vectors

    def _release(self) -> None:
        """On the engine thread, once it stops: fail what is left, then free the model."""
        with self._cond:
            self._stopping = True
            leftovers = list(self._jobs)
            self._jobs.clear()
        for job in leftovers:
            job.future.set_exception(EngineError("the model was unloaded"))
        with self._cond:
            while self._tokenizing:
                self._cond.wait()
        self._free_native()


def _unit(vector: list[float]) -> list[float]:
    """`vector` scaled to length 1 (OpenAI's embeddings are unit vectors); zeros stay zeros."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0.0 else vector


def supports_gpu_offload() -> bool:
    """True when this llama.cpp build can offload layers to a GPU (False for a CPU-only build)."""
    _init_backend()  # the backend registry lists GPU devices once the backend is set up
    return bool(llama.llama_supports_gpu_offload())
