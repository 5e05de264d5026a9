"""What a generation asks for and yields: requests, events, and the scheduler's text helpers."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from edgellmd.engine.fairness import Share

FinishReason = Literal["stop", "length", "cancelled", "error"]

# llama-server's default; OpenAI has no top_k, so a request that wants the whole vocabulary
# sends top_k: 0. Sorting 262k logits per token for every stream costs real throughput.
DEFAULT_TOP_K: Final = 40
DEFAULT_PENALTY_LAST_N: Final = 64

_ids = itertools.count(1)
SHUTTING_DOWN: Final = "the server is shutting down"  # Finished.error of generations cut by a shutdown
KEY_REVOKED: Final = "the API key was revoked or disabled"  # Finished.error when a key stops being usable
# Finished.error of what a model's engine held when it stopped by itself (its scheduler
# crashed): the model restarts, so the client is told to retry (503).
ENGINE_STOPPED: Final = "the model's engine stopped; it is restarting"
# Finished.error of a generation that waited longer than the model's queue_timeout_s for a slot.
QUEUE_TIMEOUT: Final = "every slot stayed busy past the model's queue timeout; retry shortly or elsewhere"
UNLOADED: Final = "the model was unloaded"  # Finished.error of what is left when an engine closes


class Grammar(Protocol):
    """A request's compiled grammar, in this process or an engine process: freed by its holder."""

    def free(self) -> None:
        """Free it (idempotent)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampler settings; each request gets its own C sampler chain built from these."""

    temperature: float = 1.0
    top_k: int = DEFAULT_TOP_K
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: str | None = None  # GBNF the output must match (structured output, tool calls)

    @property
    def greedy(self) -> bool:
        """True when the request asks for deterministic argmax decoding."""
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """True when any repetition penalty is active."""
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Prompt positions `start` to `start + length` hold an encoded image or audio chunk (the
    engine's media store has it under `key`); the prompt carries `placeholders(key, length)` there."""

    start: int
    length: int
    key: str


def placeholders(key: str, length: int) -> list[int]:
    """The ids a prompt carries for a media chunk's positions: negative (no token has one), the
    same for the same chunk and different for another at every offset, so that prefix reuse and
    the prompt cache match a chunk exactly when its bytes are the same."""
    base = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=6).digest(), "big")
    return [-(base + j + 1) for j in range(length)]


def check_media(prompt: Sequence[int], spans: Sequence[MediaSpan]) -> str | None:
    """Why a prompt's media spans do not hold together (None when they do): in order, inside
    the prompt, never its last position (that one's logits start the reply), its placeholders
    where they say, and no negative id outside them."""
    at = 0
    for span in spans:
        if span.length < 1 or span.start < at or span.start + span.length >= len(prompt):
            return "a media span is out of order or out of the prompt"
        if list(prompt[span.start : span.start + span.length]) != placeholders(span.key, span.length):
            return "a media span's positions do not hold its placeholders"
        if any(t < 0 for t in prompt[at : span.start]):
            return "a negative token id outside a media span"
        at = span.start + span.length
    if any(t < 0 for t in prompt[at:]):
        return "a negative token id outside a media span"
    return None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A tokenized prompt and how to continue it."""

    prompt_tokens: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's logprob and its k best alternatives
    # KV state (a slot's cached prefix, the prompt cache) is reused only between requests of
    # one scope: the API key's own by default, so that no key learns another's prompt from
    # `cached_tokens` or a fast first token. "": the requests the daemon makes itself.
    cache_scope: str = ""
    # Whose it is for fair share and its class (engine.fairness): the key, its weight, priority.
    share: Share = field(default_factory=Share)
    # Images and clips in the prompt, in order (their chunks prepared in the engine's store).
    media: tuple[MediaSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the model, with the most likely alternatives."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()  # (token, bytes, logprob), best first


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text produced by a generation (may be empty when a token ended mid-character)."""

    text: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # of the token(s) this delta accounts for
    # On a generation's first delta, what a stream tells before its first token: how long it
    # waited for a slot (`x-queue-ms`), and its prompt tokens not prefilled (Finished's
    # cached_tokens, for Anthropic's message_start). Measurements, not part of the reply.
    queue_s: float = field(default=0.0, compare=False)
    cached_tokens: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a generation."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # any text released by the finish (held back for a stop-string check)
    error: str | None = None
    stop_sequence: str | None = None  # the request's stop string that ended it, if one did
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int = 0  # prompt tokens not prefilled: their KV was kept or restored
    draft_tokens: int = 0  # speculative draft tokens checked for this generation
    accepted_draft_tokens: int = 0  # of which the sampler picked the same
    # How long it waited for a slot (paused time included): a measurement, not part of the
    # reply, so two runs that answered alike compare equal.
    queue_s: float = field(default=0.0, compare=False)
    # False: it never had a slot (refused or cancelled while it waited, its engine closed
    # first): its prompt was never computed, and it is charged to no one.
    admitted: bool = True


Event = TextDelta | Finished


class NoProgress(TimeoutError):
    """A generation produced no event within its idle timeout."""


class Generation:
    """The event-loop side of one request: an async stream of events and a way to cancel it.

    The scheduler thread pushes events with `loop.call_soon_threadsafe`; the handler awaits
    them. `cancel()` may be called from the loop at any time and frees the slot at the next
    step boundary.

    The events wait in a plain deque with one future for the (single) consumer to await, and
    the idle timeout is one timer per generation, re-armed only when it fires early: a token
    costs no timer and no asyncio.Queue bookkeeping, which one stream pays on every token.
    """

    __slots__ = (
        "_cancelled",
        "_consuming",
        "_ended",
        "_loop",
        "_on_cancel",
        "_pending",
        "_progress",
        "_timer",
        "_waiter",
        "final",
        "grammar",
        "id",
        "queue_s",
        "request",
    )

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.id: Final = next(_ids)
        self.request: Final = request
        self._loop = loop
        self._pending: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None  # what the consumer awaits, when it waits
        self._progress = loop.time()  # when the last event arrived (or the generation began)
        self._timer: asyncio.TimerHandle | None = None  # the idle deadline, while one is armed
        self._consuming = False  # an events() iterator is running
        self._cancelled = threading.Event()
        self._on_cancel: Callable[[Generation], None] | None = None  # an engine process is told
        self.final: Finished | None = None  # the Finished event, once it arrived
        self._ended: asyncio.Future[None] | None = None  # set at `final`, made when one waits (ended)
        # The request's compiled grammar, owned by the engine until the sequence starts.
        self.grammar: object | None = None
        self.queue_s = 0.0  # seconds waited for a slot so far (the scheduler's thread writes it)

    @property
    def cancelled(self) -> bool:
        """True once the consumer has given up on this generation."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to drop this generation and free its slot."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    def on_cancel(self, callback: Callable[[Generation], None]) -> None:
        """Call `callback(self)` when it is cancelled (an engine in another process must be told)."""
        self._on_cancel = callback

    def abort(self, reason: str) -> None:
        """End it now from the loop's side (shutdown): the consumer sees an error as its last event."""
        done = self.final.completion_tokens if self.final else 0
        self.push([Finished("error", len(self.request.prompt_tokens), done, error=reason)])
        self.cancel()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop that consumes this generation's events."""
        return self._loop

    def push_threadsafe(self, events: list[Event]) -> None:
        """Deliver events from the scheduler thread (a closed loop drops them)."""
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self.push, events)

    def push(self, events: list[Event]) -> None:
        """Deliver events on the loop's own thread."""
        for event in events:
            if isinstance(event, Finished):
                self.final = event
                if self._ended is not None and not self._ended.done():
                    self._ended.set_result(None)
            self._pending.append(event)
        self._progress = self._loop.time()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def peek(self) -> Event | None:
        """The next event the consumer will get, when one has arrived (it stays pending)."""
        return self._pending[0] if self._pending else None

    async def started(self, limit: float) -> Event | None:
        """Wait at most `limit` seconds for the first event, before anyone consumes; `peek()`."""
        if not self._pending and not self._consuming:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit):
                    await self._next(None)
        return self.peek()

    async def ended(self, limit: float) -> Finished | None:
        """Wait at most `limit` seconds for the Finished event, whether or not anyone consumes
        the events (a request whose client left: its choices were cancelled, and their engines
        say whether each had a slot); `final`."""
        if self.final is None and limit > 0:
            if self._ended is None:
                self._ended = self._loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._ended), limit)
        return self.final

    async def events(self, idle_timeout: float | None = None) -> AsyncIterator[Event]:
        """Yield events until (and including) the `Finished` event.

        With `idle_timeout`, a gap longer than that between two events (or before the first:
        the time spent waiting for a slot) raises NoProgress. One consumer at a time.
        """
        if self._consuming:
            raise RuntimeError("a generation's events have one consumer at a time")
        self._consuming = True
        pending = self._pending
        try:
            while True:
                if not pending:  # under load the next event is often there already
                    await self._next(idle_timeout)
                event = pending.popleft()
                yield event
                if isinstance(event, Finished):
                    return
        finally:  # _next has let go of its waiter already
            self._consuming = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    async def _next(self, idle_timeout: float | None) -> None:
        """Wait until an event is pending; NoProgress when none came within `idle_timeout`."""
        waiter = self._waiter = self._loop.create_future()
        if idle_timeout is not None and self._timer is None:
            self._timer = self._loop.call_at(self._progress + idle_timeout, self._idle, idle_timeout)
        try:
            await waiter
        finally:
            self._waiter = None

    def _idle(self, idle_timeout: float) -> None:
        """The idle timer fired: fail the waiting consumer, or re-arm for the latest event."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # the consumer is busy elsewhere; its next wait re-arms the timer
        deadline = self._progress + idle_timeout
        if self._loop.time() >= deadline:
            waiter.set_exception(NoProgress())
        else:
            self._timer = self._loop.call_at(deadline, self._idle, idle_timeout)


class Utf8Stream:
    """Turns token byte pieces into text without ever splitting a multi-byte character."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        """Return the text completed by `piece` (partial characters are held back)."""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """Return whatever is held back; an incomplete character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


def earlier_chars(text: str, piece: bytes) -> int:
    """How many of the characters a piece completed (`text`) were made of bytes before it alone:
    an incomplete character those left, which `piece` showed invalid (U+FFFD)."""
    return max(0, len(text) - len(piece.decode("utf-8", "replace")))


class StopMatcher:
    """Finds stop strings across token boundaries and holds back text that could start one."""

    __slots__ = ("_held", "_stops", "hit")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            hit, self.hit = min(found, key=lambda f: f[0])
            self._held = ""
            return buf[:hit], True
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of a generation that did not hit a stop."""
        held, self._held = self._held, ""
        return held


class HeldLogprobs:
    """Each token's logprob, held with the text a StopMatcher holds back: it goes out once text
    from the token's start has gone out, and never for a token that starts in a stop string
    (the text stops before it; its logprob would show the stop string and what follows)."""

    __slots__ = ("_fed", "_held", "_sent")

    def __init__(self) -> None:
        self._fed = 0  # characters of the reply so far, held back or not
        self._sent = 0  # characters of it that went out
        self._held: deque[tuple[int, TokenLogprob]] = deque()  # (start, logprob)

    def feed(
        self, piece: int, logprob: TokenLogprob | None, released: int, earlier: int = 0
    ) -> tuple[TokenLogprob, ...]:
        """A token of `piece` characters (the first `earlier` of them an earlier token's: see
        `earlier_chars`) and its logprob fed, `released` characters sent: the logprobs that go
        out with them."""
        if logprob is not None:
            self._held.append((self._fed + earlier, logprob))
        self._fed += piece
        self._sent += released
        out = []
        while self._held and self._held[0][0] < self._sent:
            out.append(self._held.popleft()[1])
        return tuple(out)

    def rest(self, *, keep: bool) -> tuple[TokenLogprob, ...]:
        """At the end: the logprobs still held (`keep`: its held text was sent), else none."""
        held, self._held = self._held, deque()
        return tuple(lp for _, lp in held) if keep else ()


class Abortable(Protocol):
    """What a running request is ended through: a generation, or an embedding or rerank call."""

    def abort(self, reason: str) -> None: ...


class Running:
    """The generations requests are consuming now (and their embedding and rerank calls), with
    the API key each runs for, so that a shutdown can wait for them or end them, and a revoked
    key's can be ended at once."""

    def __init__(self) -> None:
        self._items: dict[Abortable, str | None] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, gen: Abortable, key_id: str | None = None) -> None:
        """A request (authenticated by `key_id`, if any) started consuming `gen`."""
        self._items[gen] = key_id
        self._empty.clear()

    def discard(self, gen: Abortable) -> None:
        """The request is done with `gen`."""
        self._items.pop(gen, None)
        if not self._items:
            self._empty.set()

    def key_ids(self) -> set[str]:
        """The keys that running generations were authenticated by."""
        return {key for key in self._items.values() if key is not None}

    def abort_keys(self, key_ids: set[str], reason: str) -> int:
        """End the generations of these keys with an error event (waiting ones leave the queue)."""
        items = [gen for gen, key in self._items.items() if key in key_ids]
        for gen in items:
            gen.abort(reason)
        return len(items)

    def abort_all(self, reason: str) -> int:
        """End every running generation with an error event; returns how many."""
        items = list(self._items)
        for gen in items:
            gen.abort(reason)
        return len(items)

    async def wait_empty(self, deadline_s: float) -> bool:
        """Wait up to `deadline_s` for every request to finish; True when they did."""
        try:
            async with asyncio.timeout(deadline_s):
                await self._empty.wait()
        except TimeoutError:
            return False
        return True
