"""The native side shared by both engines: llama.cpp's backend and log, model loading and
metadata, tokens, and the one-thread-per-model base class."""

from __future__ import annotations

import abc
import contextlib
import ctypes
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import llama_cpp as llama

from edgellmd.engine.config import (
    DEVICE_TYPES,
    BackendDevice,
    BuildInfo,
    EngineConfig,
    EngineError,
    ModelInfo,
    ModelLoadError,
    cuda_archs_of,
    parse_system_info,
)
from edgellmd.engine.generation import ENGINE_STOPPED, UNLOADED

log = logging.getLogger(__name__)

_PIECE_BUF: Final = 256  # bytes; longer pieces are retried with the size llama.cpp asks for
# enum ggml_log_level (NONE, DEBUG, INFO, WARN, ERROR, CONT); llama_cpp does not export it.
_GGML_LOG_LEVEL_WARN: Final = 3
_GGML_LOG_LEVEL_ERROR: Final = 4
_GGML_LOG_LEVEL_CONT: Final = 5  # continues the previous message, at that message's level
# llama.cpp's INFO is its load report (every tensor, every parameter): debug here, as its
# DEBUG; its warnings and errors are the daemon's.
_PY_LEVELS: Final = {_GGML_LOG_LEVEL_ERROR: logging.ERROR, _GGML_LOG_LEVEL_WARN: logging.WARNING}


# llama.cpp keeps one process-wide log callback and one backend; both are set up once.
_backend_lock = threading.Lock()
_backend_ready = False
_log_callback: Any = None  # keeps the ctypes thunk alive for as long as llama.cpp may call it
# The level of the message a CONT continues: per thread, as every engine thread logs its own.
_log_state = threading.local()


# What llama.cpp reports of a step stopped on purpose (StepAbort): debug, not errors, while the
# stop was asked for on this thread.
_ABORT_NOISE: Final = re.compile(
    r"compute status: 1$|failed with error 1$|failed to decode, ret = 2$|removing memory module entries"
)


def on_llama_log(level: int, text: bytes | None, _user: object) -> None:
    """llama.cpp's log callback (any thread): its warnings and errors as ours, the rest at debug."""
    if level == _GGML_LOG_LEVEL_CONT:
        py_level: int = getattr(_log_state, "level", logging.DEBUG)
    else:
        py_level = _PY_LEVELS.get(level, logging.DEBUG)
        _log_state.level = py_level
    message = text.decode("utf-8", "replace").strip() if text else ""
    if not message:
        return
    stop: StepAbort | None = getattr(_log_state, "abort", None)
    if stop is not None and stop.asked and _ABORT_NOISE.search(message):
        py_level = logging.DEBUG
    log.log(py_level, "llama.cpp: %s", message)


class StepAbort:
    """A flag that stops the `llama_decode` in progress on a context between two graph nodes.

    The abort callback (`llama_set_abort_callback`) is libc's `strlen` over a two-byte buffer
    holding the flag and a NUL: 0 while the flag is clear, 1 once it is set. The CPU backend
    calls it after every graph node (hundreds per step), so it must cost nothing: a ctypes
    callback would take the GIL at each. `strlen` takes one pointer and returns exactly 0 or 1
    here, which every C calling convention hands back where a `bool` is read.

    llama.cpp then returns 2 from `llama_decode`, with the ubatches it finished still in the
    KV cache: the caller removes the step's positions (`Engine._undo`). Any thread may `ask`;
    the decoding thread clears the flag after each armed step. `make` returns None where libc
    has no `strlen` to call (the scheduler then never stops a step).
    """

    def __init__(self, ctx: Any, strlen: int) -> None:
        self._buffer = (ctypes.c_ubyte * 2)()
        # Kept for the context's life: llama.cpp holds the pointers, not the Python objects.
        self._callback = llama.ggml_abort_callback(strlen)
        llama.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self._buffer, ctypes.c_void_p))
        _log_state.abort = self  # on the thread that decodes: its abort reports are not errors

    @classmethod
    def make(cls, ctx: Any) -> StepAbort | None:
        try:
            strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        except (OSError, AttributeError):
            return None
        return cls(ctx, strlen) if strlen else None

    @property
    def asked(self) -> bool:
        return self._buffer[0] != 0

    def ask(self) -> None:
        """Stop the step in progress at its next graph node (a step starting later runs whole
        unless `clear` comes first)."""
        self._buffer[0] = 1

    def clear(self) -> None:
        self._buffer[0] = 0


def init_backend() -> None:
    global _backend_ready, _log_callback  # noqa: PLW0603 - one native backend per process
    with _backend_lock:
        if _backend_ready:
            return
        _log_callback = llama.llama_log_callback(on_llama_log)
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
        raise ModelLoadError(
            "this llama.cpp build's model parameters have neither load_mode nor "
            "use_mmap: cannot choose between mapping and reading the model file"
        )


# ---- model metadata and tokens, shared by Engine and EmbeddingEngine ----------------------


def model_meta(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def read_model_info(model: Any, vocab: Any, path: Path) -> ModelInfo:
    desc = ctypes.create_string_buffer(256)
    llama.llama_model_desc(model, desc, len(desc))
    template = llama.llama_model_chat_template(model, None)
    rerank = llama.llama_model_chat_template(model, b"rerank")
    return ModelInfo(
        path=path,
        architecture=model_meta(model, "general.architecture") or "unknown",
        description=desc.value.decode("utf-8", "replace"),
        n_ctx_train=llama.llama_model_n_ctx_train(model),
        n_vocab=llama.llama_vocab_n_tokens(vocab),
        n_params=llama.llama_model_n_params(model),
        size_bytes=llama.llama_model_size(model),
        chat_template=template.decode("utf-8", "replace") if template else None,
        bos_text=token_text(vocab, llama.llama_vocab_bos(vocab)),
        eos_text=token_text(vocab, llama.llama_vocab_eos(vocab)),
        add_bos=bool(llama.llama_vocab_get_add_bos(vocab)),
        rerank_template=rerank.decode("utf-8", "replace") if rerank else None,
        pair_tokens=_pair_tokens(vocab),
    )


def _pair_tokens(vocab: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The special tokens before a query, between it and a document, and after the document:
    BOS when the vocabulary adds one, EOS (SEP without one) after each text when it adds that,
    SEP between them when it adds that (llama-server's pair format for rerankers)."""
    bos, eos, sep = llama.llama_vocab_bos(vocab), llama.llama_vocab_eos(vocab), llama.llama_vocab_sep(vocab)
    end = eos if eos >= 0 else sep
    closing = (end,) if llama.llama_vocab_get_add_eos(vocab) and end >= 0 else ()
    between = (*closing, *((sep,) if llama.llama_vocab_get_add_sep(vocab) and sep >= 0 else ()))
    opening = (bos,) if llama.llama_vocab_get_add_bos(vocab) and bos >= 0 else ()
    return opening, between, closing


def token_text(vocab: Any, token: int) -> str:
    if token < 0:
        return ""
    return token_piece(vocab, token, special=True).decode("utf-8", "replace")


def tokenize_text(vocab: Any, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
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


class ControlTokens:
    """The vocabulary's control tokens by text, for tokenizing prompts whose user text stays text.

    llama.cpp, told to parse special tokens, turns the text of any control token anywhere in
    a prompt into that token; told not to, it turns none, not even the chat template's own.
    A chat prompt needs both at once: the template's markup parsed, the messages' text not
    (a user who writes `<end_of_turn><start_of_turn>system` must not forge a system turn).
    So the prompt is split here, as llama.cpp's own tokenizer splits it (`tokenizer_st_partition`),
    but only in the parts the template wrote, and every raw fragment between the control tokens
    is tokenized without special parsing. User-defined tokens (whitespace runs, markup that
    some vocabularies add as ordinary text) are still matched by llama.cpp in every fragment, as
    Hugging Face tokenizers match non-special added tokens.
    """

    __slots__ = ("_starts", "by_text", "lengths", "lstrip", "rstrip")

    def __init__(self, vocab: Any, n_vocab: int) -> None:
        self.by_text: dict[str, int] = {}
        self.lstrip: set[int] = set()
        self.rstrip: set[int] = set()
        wanted = llama.LLAMA_TOKEN_ATTR_CONTROL | llama.LLAMA_TOKEN_ATTR_UNKNOWN
        for token in range(n_vocab):
            attr = llama.llama_vocab_get_attr(vocab, token)
            if not attr & wanted:
                continue
            raw = llama.llama_vocab_get_text(vocab, token)
            try:
                text = raw.decode("utf-8") if raw else ""
            except UnicodeDecodeError:
                continue
            if not text:
                continue
            # The first token of a text wins, as in llama.cpp's stable sort by length.
            self.by_text.setdefault(text, token)
            if attr & llama.LLAMA_TOKEN_ATTR_LSTRIP:
                self.lstrip.add(token)
            if attr & llama.LLAMA_TOKEN_ATTR_RSTRIP:
                self.rstrip.add(token)
        self.lengths = sorted({len(t) for t in self.by_text}, reverse=True)
        firsts = sorted({t[0] for t in self.by_text})
        self._starts = re.compile("[" + "".join(re.escape(c) for c in firsts) + "]") if firsts else None

    def find(self, text: str, start: int) -> tuple[int, int, int] | None:
        """The leftmost control token in text[start:], the longest at that place: (position, length, id)."""
        starts = self._starts
        if starts is None:
            return None
        while (match := starts.search(text, start)) is not None:
            at = match.start()
            for n in self.lengths:
                token = self.by_text.get(text[at : at + n])
                if token is not None:
                    return at, n, token
            start = at + 1
        return None

    def contains(self, text: str) -> bool:
        """True when `text` holds the text of a control token."""
        return self.find(text, 0) is not None


def tokenize_segments(
    vocab: Any, controls: ControlTokens, segments: Sequence[tuple[str, bool]], *, add_special: bool
) -> list[int]:
    """Tokenize (text, trusted) segments: control tokens are parsed in trusted text only.

    The fragments between control tokens are tokenized one by one without special parsing,
    exactly as llama.cpp tokenizes the fragments its own split leaves, so a prompt whose
    untrusted text holds no control-token text gets the same tokens as llama.cpp's
    `parse_special` tokenization of the whole text.
    """
    parts: list[str | int] = []  # raw fragments and control token ids, in order
    raw: list[str] = []
    strip_next = False  # the previous control token strips the whitespace after it

    def add_raw(text: str) -> None:
        nonlocal strip_next
        if strip_next:
            text = text.lstrip()
            strip_next = not text
        if text:
            raw.append(text)

    def add_control(token: int) -> None:
        nonlocal strip_next
        joined = "".join(raw)
        raw.clear()
        if token in controls.lstrip:
            joined = joined.rstrip()
        if joined:
            parts.append(joined)
        parts.append(token)
        strip_next = token in controls.rstrip

    for text, trusted in segments:
        if not trusted or not controls.by_text:
            add_raw(text)
            continue
        at = 0
        while (found := controls.find(text, at)) is not None:
            pos, length, token = found
            add_raw(text[at:pos])
            add_control(token)
            at = pos + length
        add_raw(text[at:])
    if raw:
        parts.append("".join(raw))

    out: list[int] = []
    if add_special and llama.llama_vocab_get_add_bos(vocab):
        bos = llama.llama_vocab_bos(vocab)
        if bos >= 0:
            out.append(bos)
    for part in parts:
        if isinstance(part, int):
            out.append(part)
        else:
            out.extend(tokenize_text(vocab, part, add_special=False, parse_special=False))
    if add_special and llama.llama_vocab_get_add_eos(vocab):
        eos = llama.llama_vocab_eos(vocab)
        if eos >= 0:
            out.append(eos)
    return out


def token_piece(vocab: Any, token: int, *, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(_PIECE_BUF)
    n = llama.llama_token_to_piece(vocab, token, buf, _PIECE_BUF, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[: max(n, 0)]


Item = tuple[int, int, int, bool]  # a batch entry: token, position, sequence, logits wanted


def fill_batch(batch: Any, items: Sequence[Item]) -> None:
    """Write (token, position, sequence, logits wanted) entries into a llama_batch."""
    token, pos, n_seq, seq, logits = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
    for j, (tok, p, s, out) in enumerate(items):
        token[j] = tok
        pos[j] = p
        n_seq[j] = 1
        seq[j][0] = s
        logits[j] = out
    batch.n_tokens = len(items)


def decode_bos(ctx: Any, batch: Any, vocab: Any) -> bool:
    """Decode the BOS token (or token 0) alone as sequence 0: a warm-up that makes the compute buffers."""
    bos = llama.llama_vocab_bos(vocab)
    fill_batch(batch, [(bos if bos >= 0 else 0, 0, 0, True)])
    return bool(llama.llama_decode(ctx, batch) == 0)


KV_TYPES: Final = {"f16": llama.GGML_TYPE_F16, "q8_0": llama.GGML_TYPE_Q8_0, "q4_0": llama.GGML_TYPE_Q4_0}


def flash_attention_type(config: EngineConfig) -> int:
    """llama.cpp's flash-attention choice: quantized values need it, so `auto` turns it on for them."""
    if config.flash_attention == "on" or (config.flash_attention == "auto" and config.cache_type_v != "f16"):
        return int(llama.LLAMA_FLASH_ATTN_TYPE_ENABLED)
    if config.flash_attention == "off":
        if config.cache_type_v != "f16":
            raise ModelLoadError(
                "cache_type_v q8_0/q4_0 needs flash attention: set flash_attention to auto or on"
            )
        return int(llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    return int(llama.LLAMA_FLASH_ATTN_TYPE_AUTO)


def context_params(config: EngineConfig, batch_size: int) -> Any:
    """llama.cpp context parameters for a model's slots: one sequence per slot, its KV types."""
    cparams = llama.llama_context_default_params()
    cparams.n_ctx = config.context_size * config.slots
    cparams.n_batch = batch_size
    cparams.n_ubatch = batch_size
    cparams.n_seq_max = config.slots
    cparams.n_threads = config.threads
    cparams.n_threads_batch = config.threads_batch
    # One KV region of context_size cells per slot, as llama-server uses by default. A
    # unified pool (kv_unified) makes every sequence's attention span the cells of all
    # of them: measured 20% slower per token on the demo model with 8 slots on 2 cores.
    cparams.kv_unified = False
    cparams.type_k = KV_TYPES[config.cache_type_k]
    cparams.type_v = KV_TYPES[config.cache_type_v]
    cparams.flash_attn_type = flash_attention_type(config)
    cparams.no_perf = True
    return cparams


def keep_prefix(memory: Any, seq: int, keep: int, n_swa: int) -> int:
    """Drop a sequence's KV cache from position `keep` on; the length of the prefix kept.

    0 (the whole sequence dropped) when llama.cpp cannot cut there, or when sliding-window
    layers (window `n_swa`) no longer hold the window the tokens after `keep` need: the token
    at `keep` sees the positions after `keep - n_swa` (llama.cpp masks p0 where p1 - p0 >=
    n_swa; a chunked window starts later still), so the window cache must reach back to
    `keep - n_swa + 1`. A sequence state saved and set again holds exactly that much.
    """
    if keep > 0 and n_swa > 0:
        pos_min = llama.llama_memory_seq_pos_min(memory, seq)
        if pos_min < 0 or pos_min > max(0, keep - n_swa + 1):
            keep = 0
    if keep <= 0 or not llama.llama_memory_seq_rm(memory, seq, keep, -1):
        llama.llama_memory_seq_rm(memory, seq, -1, -1)
        keep = 0
    return keep


class NativeThread(abc.ABC):
    """One model on one thread: it loads, warms up and then serves until stopped.

    Everything native happens on that thread (see Engine); subclasses provide _load,
    _warm_up, _run, _release and _free_native. A thread that stops serving while nobody
    asked it to (its loop raised, or returned) is a fault: `fault` says why, what it held
    ends with `ENGINE_STOPPED`, and the callbacks given to `on_exit` hear of it, so that the
    registry takes the model out of service at once and restarts it.
    """

    _model: Any
    _vocab: Any
    _ctx: Any
    _batch: Any
    n_vocab: int

    def __init__(self, config: EngineConfig, name: str) -> None:
        """What every engine checks first: a model file that exists, and llama.cpp set up."""
        init_backend()
        self.config = config
        self.name: Final = name
        try:
            mode = os.stat(config.path).st_mode
        except OSError:
            raise ModelLoadError(f"model file not found: {config.path}") from None
        if not stat.S_ISREG(mode):  # a FIFO would block llama.cpp's open for good
            raise ModelLoadError(f"model file {config.path} is not a regular file")
        self._cond = threading.Condition()  # guards the subclass's queue, _stopping and _users
        self._stopping = False
        self._users = 0  # calls into the model from other threads (tokens, grammars) in progress
        self.fault: str | None = None  # why the thread stopped by itself; None while it serves
        self.fault_kind = "crash"  # the reason label of edgellm_engine_restarts_total
        self._exited = False  # the thread is done (guarded by _cond, with _on_exit)
        self._on_exit: list[Callable[[str | None], None]] = []

    @contextlib.contextmanager
    def native_use(self) -> Iterator[None]:
        """Hold the model for a native call from another thread; EngineError once it is closing.

        The prompt pool tokenizes and builds grammars while requests hold a lease, but a
        request whose client went away lets go of its lease while a pool thread may still
        be inside llama.cpp for it: the model is freed only once every such call is out.
        """
        with self._cond:
            if self._stopping:  # the vocabulary is freed with the model
                raise EngineError("engine is shutting down")
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if not self._users:
                    self._cond.notify_all()

    def on_exit(self, callback: Callable[[str | None], None]) -> None:
        """Call `callback(fault)` once the thread is done (`fault` None after `close`).

        From the engine thread, or at once from this one when it is done already. It must
        not block: it hands the news to an event loop.
        """
        with self._cond:
            if not self._exited:
                self._on_exit.append(callback)
                return
        callback(self.fault)

    def close(self) -> None:
        """Stop the thread; it fails what is left, then frees native memory (blocking; idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

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
        except Exception as exc:  # a bug here must not leave clients hanging or the model "ready"
            log.exception("scheduler of model %s crashed", self.name)
            self.fault = f"its scheduler crashed ({type(exc).__name__})"
        if self.fault is None and not self._stopping:
            self.fault = "its scheduler stopped by itself"
        try:
            self._release(ENGINE_STOPPED if self.fault is not None else UNLOADED)
        finally:
            with self._cond:
                self._exited = True
                callbacks, self._on_exit = self._on_exit, []
            for callback in callbacks:
                try:
                    callback(self.fault)
                except Exception:
                    log.exception("an exit callback of model %s failed", self.name)

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
    def _release(self, error: str) -> None:
        """Provided by each engine (runs on the engine thread): end what is left with `error`."""

    def _free_native(self) -> None:
        # Nobody may start a native call any more; the ones in progress finish first.
        with self._cond:
            self._stopping = True
            while self._users:
                self._cond.wait()
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


# ---- what this llama.cpp build can do -----------------------------------------------------


def _ggml(name: str, restype: Any, *argtypes: Any) -> Any:
    """A ggml function from the library llama_cpp loaded, with its own prototype (shares no state)."""
    lib = llama.llama_cpp._lib  # llama_cpp's own handle on libllama, which links libggml
    return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))


def build_info() -> BuildInfo:
    """What the loaded llama.cpp build can do, from its own backend registry and system info."""
    init_backend()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    reg_count = _ggml("ggml_backend_reg_count", sz)
    reg_get = _ggml("ggml_backend_reg_get", vp, sz)
    reg_name = _ggml("ggml_backend_reg_name", ctypes.c_char_p, vp)
    dev_count = _ggml("ggml_backend_dev_count", sz)
    dev_get = _ggml("ggml_backend_dev_get", vp, sz)
    dev_name = _ggml("ggml_backend_dev_name", ctypes.c_char_p, vp)
    dev_description = _ggml("ggml_backend_dev_description", ctypes.c_char_p, vp)
    dev_type = _ggml("ggml_backend_dev_type", ctypes.c_int, vp)
    dev_memory = _ggml("ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz))

    def text(value: bytes | None) -> str:
        return value.decode("utf-8", "replace") if value else ""

    backends = tuple(text(reg_name(reg_get(i))) for i in range(reg_count()))
    devices = []
    for i in range(dev_count()):
        dev = dev_get(i)
        free, total = sz(0), sz(0)
        dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = dev_type(dev)
        devices.append(
            BackendDevice(
                name=text(dev_name(dev)),
                description=text(dev_description(dev)),
                type=DEVICE_TYPES[kind] if 0 <= kind < len(DEVICE_TYPES) else "unknown",
                memory_free=free.value,
                memory_total=total.value,
            )
        )
    system_info = text(llama.llama_print_system_info()).strip()
    features = parse_system_info(system_info)
    archs = cuda_archs_of(features)
    if archs == () and "CUDA" in backends:  # registered, yet listing no features at all
        archs = None
    return BuildInfo(
        backends=backends,
        devices=tuple(devices),
        cuda_archs=archs,
        gpu_offload=bool(llama.llama_supports_gpu_offload()),
        system_info=system_info,
        features=features,
    )
