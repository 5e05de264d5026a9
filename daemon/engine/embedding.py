"""Embeddings: one model in a llama_context created with embeddings on and a pooling layer;
its thread takes embed() jobs in order and returns one unit vector per input."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Collection, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Final

import llama_cpp as llama

from edgellmd.engine.config import EngineConfig, EngineError, ModelLoadError
from edgellmd.engine.native import NativeThread, model_meta, read_model_info, tokenize_text

log = logging.getLogger(__name__)

_IDLE_WAIT_S: Final = 0.5  # the idle thread still wakes up to report liveness
ABANDONED: Final = "the caller left; what was not embedded yet was dropped"  # an abandoned call's error

# Inputs per llama_decode: `EngineConfig.inputs_per_decode` (models[].inputs_per_decode), at
# most `slots`. Packing several (each its own sequence) changes their vectors: the pooling is a
# matmul over all the batch's tokens, so an input's tokens land at other offsets of the sum, and
# the CPU flash-attention kernel takes another path for another batch shape. Measured on Gemma 3
# 270M, per component of the unit vector: up to 5e-8 apart without flash attention, 1e-2 with
# it. So by default each input gets a decode of its own (identical inputs, identical vectors);
# the price, same model, 2 cores, 64 short inputs: 14 inputs/s against 25 packed 8 a decode.

# What a GGUF's `<arch>.pooling_type` may declare (enum llama_pooling_type), by name for logs.
_POOLING_NAMES: Final = {
    llama.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama.LLAMA_POOLING_TYPE_CLS: "cls",
    llama.LLAMA_POOLING_TYPE_LAST: "last",
    llama.LLAMA_POOLING_TYPE_RANK: "rank",
}


class _EmbedJob:
    """One embed() call: its token lists, the vectors done so far and the future its caller waits on."""

    __slots__ = ("abandoned", "done", "future", "inputs")

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.done: list[list[float]] = []  # the first len(done) inputs' vectors
        self.future: Future[list[list[float]]] = Future()
        self.abandoned = False  # its caller left while it was being embedded (`abandon`)


class EmbeddingEngine(NativeThread):
    """One embedding model: a llama_context created with embeddings on, run on its own thread.

    A reranking model (`EngineConfig.rank`: rank pooling, a classifier head) runs the same way;
    its "vector" for an input is one relevance score in [0, 1] (`_score`).
    """

    def __init__(self, config: EngineConfig, *, name: str = "model") -> None:
        """Load the model, warm it up and start its thread (blocking: call it off the event loop).

        Every native call happens on this engine's own thread, for the reason the Engine
        docstring gives (one OpenMP team per calling thread); embed() only queues a job.
        """
        super().__init__(config, name)
        self.kind = "rerank" if config.rank else "embedding"  # as RemoteEngine.kind: what the model serves
        self._jobs: deque[_EmbedJob] = deque()
        self._current: list[_EmbedJob] = []  # the jobs in the decode running now (engine thread writes)
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
        self.info = read_model_info(model, self._vocab, config.path)
        pooling = self._pooling()
        self.pooling: str = _POOLING_NAMES[pooling]
        self._labels = llama.llama_model_n_cls_out(model) if config.rank else 0
        if config.rank and self._labels not in (1, 2):
            raise ModelLoadError(
                f"{config.path} has a classifier head of {self._labels} labels; a reranking model "
                "has one (a relevance logit) or two (Qwen3's yes and no)"
            )

        cparams = llama.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = pooling
        self._per_decode = max(1, min(config.slots, config.inputs_per_decode))
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
            raise ModelLoadError(
                f"llama.cpp allows only {self._n_batch} tokens per batch for "
                f"{config.path}, fewer than context_size {config.context_size}"
            )
        self._memory = llama.llama_get_memory(ctx)  # NULL for encoder-only models (BERT)
        self._batch = llama.llama_batch_init(self._n_batch, 0, 1)

    def _pooling(self) -> int:
        """The pooling this model declares, or MEAN for one that declares none."""
        declared = model_meta(self._model, f"{self.info.architecture}.pooling_type")
        value = int(declared) if declared and declared.isdigit() else llama.LLAMA_POOLING_TYPE_NONE
        if self.config.rank:
            if value != llama.LLAMA_POOLING_TYPE_RANK:
                raise ModelLoadError(
                    f"{self.config.path} is not a reranking model: its GGUF declares no rank pooling "
                    "(a classifier head over the query and document)"
                )
            return value
        if value == llama.LLAMA_POOLING_TYPE_RANK:
            raise ModelLoadError(
                f"{self.config.path} is a reranking model (rank pooling), not an embedding model"
            )
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
        if self.config.rank:
            log.info("reranking model %s: %d label(s), rank pooling", self.name, self._labels)
        else:
            log.info("embedding model %s: %d dimensions, %s pooling", self.name, self.n_embd, self.pooling)

    # ---- interface (any thread) -----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (thread-safe: the vocabulary is read-only until close)."""
        with self.native_use():
            return tokenize_text(self._vocab, text, add_special=add_special, parse_special=parse_special)

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One unit-length vector per token list, in input order (blocking; thread-safe)."""
        return self.submit_embed(inputs).result()

    def submit_embed(self, inputs: Sequence[Sequence[int]]) -> Future[list[list[float]]]:
        """Queue an embed job; its future holds one unit vector per input (never blocks).

        The event loop awaits the future itself (asyncio.wrap_future): no pool thread is
        held waiting while the model works.
        """
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
                raise EngineError(
                    f"input {i} holds a token id outside the vocabulary (0 to {self.n_vocab - 1})"
                )
            checked.append(list(tokens))  # a copy: the caller may reuse its lists
        job = _EmbedJob(checked)
        with self._cond:
            if self._stopping:
                raise EngineError("engine is shutting down")
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    def abandon(self, future: Future[list[list[float]]]) -> None:
        """Withdraw a call whose caller left (thread-safe): a waiting one leaves the queue, the one
        being embedded stops after its current decode; its future fails with ABANDONED."""
        if future.cancel():  # not begun: the thread skips it
            return
        with self._cond:
            for job in self._jobs:
                if job.future is future:
                    self._jobs.remove(job)
                    break
            else:
                for current in self._current:
                    if current.future is future:
                        current.abandoned = True  # the thread drops it once its decode is done
                return
        with contextlib.suppress(InvalidStateError):
            future.set_exception(EngineError(ABANDONED))

    def forget_scopes(self, scopes: Collection[str]) -> None:
        """Nothing: an embedding model keeps no KV state between requests."""

    @property
    def busy_slots(self) -> int:
        """Slots the calls being embedded now take: their inputs, at most `slots` in all."""
        return min(sum(len(job.inputs) for job in self._current), self.config.slots)

    @property
    def queue_depth(self) -> int:
        """embed() calls waiting for the current one to finish."""
        return len(self._jobs)

    def occupancy(self) -> tuple[int, int]:
        """Inputs being embedded and calls waiting, read together."""
        with self._cond:
            return self.busy_slots, len(self._jobs)

    def held_by_tenant(self) -> Counter[str]:
        """By key: none here (an embed call carries no key; the model's handle counts its own)."""
        return Counter()

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        return not self._jobs and not self._current

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        """Take the jobs in turns, one decode at a time: a call of a thousand inputs (a rerank of a
        thousand documents) holds a call of one back by one decode, not by the whole call. With
        `inputs_per_decode` above 1 a decode takes the waiting calls' next inputs round robin."""
        while True:
            with self._cond:
                while not self._stopping and not self._jobs:
                    self.heartbeat = time.monotonic()
                    self._cond.wait(_IDLE_WAIT_S)
                if self._stopping:
                    return
                # Current before they leave the queue: `idle` (read without the lock) never sees
                # neither while jobs move from one to the other.
                taken = self._take()
                self._current = [job for job, _ in taken]
                for job, _ in taken:
                    self._jobs.remove(job)
            live = [
                (job, group)
                for job, group in taken
                if job.done or job.future.set_running_or_notify_cancel()  # else its caller gave up
            ]
            try:
                vectors = self._embed(live)
            except EngineError as exc:
                for job, _ in live:
                    job.future.set_exception(exc)
                vectors = None
            except Exception:  # a bug here must fail the calls, not kill the thread
                log.exception("embedding thread of model %s failed", self.name)
                for job, _ in live:
                    job.future.set_exception(EngineError("internal engine error"))
                vectors = None
            for job, _ in live:
                if vectors is not None:
                    job.done.extend(vectors.pop(0))
                if job.abandoned and not job.future.done():
                    job.future.set_exception(EngineError(ABANDONED))
                elif len(job.done) == len(job.inputs) and not job.future.done():
                    job.future.set_result(job.done)
                elif not job.future.done():
                    with self._cond:  # behind the others waiting: its next decode comes after theirs
                        self._jobs.append(job)
            self._current = []
            self.heartbeat = time.monotonic()

    def _take(self) -> list[tuple[_EmbedJob, list[list[int]]]]:
        """Under the lock: the next decode's inputs, the waiting jobs' next ones in turn (queue
        order, one each a round) up to `_per_decode` inputs and `_n_batch` tokens. The first
        job's next input always fits (no input is longer than the context, the batch's floor)."""
        jobs = list(self._jobs)
        groups: list[list[list[int]]] = [[] for _ in jobs]
        inputs = tokens = 0
        progress = True
        while progress and inputs < self._per_decode:
            progress = False
            for k, job in enumerate(jobs):
                at = len(job.done) + len(groups[k])
                if inputs == self._per_decode or at >= len(job.inputs):
                    continue
                size = len(job.inputs[at])
                if inputs and tokens + size > self._n_batch:
                    continue
                groups[k].append(job.inputs[at])
                inputs, tokens, progress = inputs + 1, tokens + size, True
        return [(job, group) for job, group in zip(jobs, groups, strict=True) if group]

    def _embed(self, taken: list[tuple[_EmbedJob, list[list[int]]]]) -> list[list[list[float]]]:
        """One decode of every taken input; each job's vectors, in the order taken."""
        if self._stopping:  # close() during a long job: do not finish it first
            raise EngineError("the model was unloaded")
        if not taken:
            return []
        vectors = self._decode([tokens for _, group in taken for tokens in group])
        out = []
        for _, group in taken:
            out.append(vectors[: len(group)])
            vectors = vectors[len(group) :]
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
            if self.config.rank:
                score = _score(ptr[: self._labels])
                if not math.isfinite(score):
                    raise EngineError("the model's rank head gave a score that is not a number")
                vectors.append([score])
            else:
                vectors.append(_unit(ptr[: self.n_embd]))
        return vectors

    def _release(self, error: str) -> None:
        """On the engine thread, once it stops: fail what is left with `error`, then free the model."""
        with self._cond:
            self._stopping = True
            leftovers = list(self._jobs)
            self._jobs.clear()
        current, self._current = self._current, []
        for job in current:  # the jobs the crash cut
            if not job.future.done():
                job.future.set_exception(EngineError(error))
        for job in leftovers:  # a job begun already is running: it cannot be cancelled
            if job.done or job.future.set_running_or_notify_cancel():
                job.future.set_exception(EngineError(error))
        self._free_native()  # once every tokenize() in progress is out


def _score(head: list[float]) -> float:
    """A rank head's output as a relevance score in [0, 1]: the sigmoid of a single logit (BERT
    and XLM-RoBERTa rerankers, as sentence-transformers' CrossEncoder scores them), or the first
    label's probability, which llama.cpp's softmax over two labels gives already (Qwen3's yes)."""
    if len(head) == 1:
        x = head[0]
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return head[0]


def _unit(vector: list[float]) -> list[float]:
    """`vector` scaled to length 1 (OpenAI's embeddings are unit vectors); zeros stay zeros."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0.0 else vector
