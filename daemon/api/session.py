"""One request's generations, the same for every API family: lease, prompt, grammar, submit, read, free.

The adapters (OpenAI chat and completions, OpenAI Responses, Anthropic Messages) decode their
wire format into a `ChatRequest` (a conversation, sampling, output constraints, tools) and
encode what comes back; everything between lives here once: the model's lease, the capacity
check before any tokenizing, the chat prompt (with tools rendered for templates that cannot
show them), grammars compiled on the prompt pool, the revocation check, one generation per
choice, the bookkeeping the front door reads (tokens used, user tag), and the guarantee that
every slot is free the moment the request ends, however it ends.

`read_choices` turns the generations' events into reply parts (`api.reply`), so that tool
calls and reasoning are read the same way whatever the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

from aiohttp import web

from edgellmd.api.context import (
    ARRIVED,
    CALLER,
    DRAINING,
    MORE_SEQUENCES,
    QUEUE_WAITS,
    RESERVE_PROMPT,
    TRACE,
    USER_TAG,
    context,
    tenant,
)
from edgellmd.api.ledger import account
from edgellmd.api.media import MediaRules, fetch_media
from edgellmd.api.reply import Part, ReasoningSplitter, ReplyReader
from edgellmd.api.request import ChatRequest, CommonRequest
from edgellmd.engine.config import EngineError, MediaLimits
from edgellmd.engine.fairness import Share
from edgellmd.engine.generation import (
    ENGINE_STOPPED,
    KEY_REVOKED,
    QUEUE_TIMEOUT,
    SHUTTING_DOWN,
    Event,
    Finished,
    Generation,
    GenerationRequest,
    Grammar,
    MediaSpan,
    NoProgress,
    TextDelta,
    TokenLogprob,
)
from edgellmd.errors import (
    ApiError,
    EngineFailed,
    InvalidRequest,
    KeyRevoked,
    ServerOverloaded,
    ServerShuttingDown,
    shown,
)
from edgellmd.host.metrics import ChoiceFigures, Slo, TokenTiming
from edgellmd.host.traces import RequestTrace, now_ns
from edgellmd.models.handle import (
    REASONING_TAGS,
    RETRY_AFTER_BUSY_S,
    RETRY_AFTER_LOADING_S,
    ModelHandle,
    Prompt,
)

# A request whose client left is settled once its cancelled choices' engines said whether each
# had a slot (a waiting one's answer comes at once), or after this long: then it is charged.
SETTLE_WAIT_S: Final = 1.0
_SETTLING: set[asyncio.Future[None]] = set()  # counts under way, held until done (asyncio keeps tasks weakly)

# The API family a generation request came by, for the per-request histograms' `api` label.
API_FAMILIES: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/audio/transcriptions": "transcriptions",
}


T = TypeVar("T")


def api_family(request: web.Request) -> str:
    """`chat`, `completions`, `responses` or `messages`; `other` for any other path (the console's)."""
    return API_FAMILIES.get(request.path, "other")


def user_tag(value: str | None) -> str | None:
    """A client's `user` field as the access log may show it: short and printable."""
    if value is None:
        return None
    return shown(value[:64])


def check_key_still_valid(request: web.Request) -> None:
    """401 when the request's key was revoked, disabled or expired since it was authenticated."""
    caller = request.get(CALLER)
    if caller is not None and not context(request).key_valid(caller.key_id):
        raise KeyRevoked(KEY_REVOKED)


@dataclass(slots=True)
class Session:
    """A request's running generations (one per choice) on a leased model."""

    handle: ModelHandle
    gens: list[Generation]
    timings: list[TokenTiming]
    prompt_tokens: int
    idle_timeout: float
    write_timeout: float
    tools: tuple[str, ...] | None = None  # function names, when the reply is tool-call JSON
    reasoning_open: bool = False  # the prompt left the model inside its thinking tags
    # Choice i's generation again on the restarted engine, for one its engine's stop ended
    # before any token (it was still queued); when none is: the error that ends the choice.
    replay: Callable[[int], Awaitable[Generation | str]] | None = None
    queue_waits: list[float] = field(default_factory=list)  # each finished choice's wait for a slot
    # Records the request's usage in the ledger and waits for the commit (api.ledger.account):
    # `events` calls it when the last choice ends, before that end reaches any encoder.
    settle: Callable[[], Awaitable[None]] | None = None
    trace: RequestTrace | None = None  # the request's, when it is traced
    # The request's stop strings when its reply is tool-call JSON around the answer: matched by
    # each choice's reader in the answer text (not by the engine, in the JSON's syntax); a
    # choice whose reader found one is ended there (`stop_at`) and finishes as `stop`.
    visible_stops: tuple[str, ...] = ()
    stopped: dict[int, str] = field(default_factory=dict)
    # Each choice's wait for its first slot, from its first token's event: its Finished's
    # `queue_s` counts the pauses after it too (fair share), which are decode time, not queue.
    first_waits: dict[int, float] = field(default_factory=dict)

    def stop_at(self, i: int, stop: str) -> None:
        """Choice `i`'s reader found `stop` in the answer text: its generation ends now."""
        if i not in self.stopped:
            self.stopped[i] = stop
            self.gens[i].cancel()
            self.handle.generator.wake()

    async def events(self, i: int) -> AsyncIterator[Event]:
        """Choice `i`'s events (NoProgress past the idle timeout). One that its engine's stop
        ended before it generated a token (it was still queued, or prefilling) is generated
        again on the restarted engine when the model is back in time, the client none the wiser.
        Once only: a request whose prefill is what kills the engine costs two stops, not a
        crash loop."""
        produced = False  # a token of this choice was generated (the client may have seen it)
        replayed = False
        while True:
            async for raw in self.gens[i].events(self.idle_timeout):
                event = raw
                if (
                    isinstance(event, Finished)
                    and event.error == ENGINE_STOPPED
                    and not (produced or replayed)
                ):
                    stopped = event
                    break
                if not produced and isinstance(event, TextDelta):  # its first token: its first wait
                    self.first_waits[i] = event.queue_s
                produced = produced or bool(event.completion_tokens or event.text)
                if self.trace is not None:
                    self.trace.output(i, event.text)
                if isinstance(event, Finished) and i in self.stopped and event.reason == "cancelled":
                    # Ended at a stop string its reader found: a stop, as the engine's own is.
                    event = self.gens[i].final = replace(event, reason="stop", stop_sequence=self.stopped[i])
                if isinstance(event, Finished):
                    self.queue_waits.append(event.queue_s)
                    # The last choice to end: its usage is on disk before any family tells it.
                    if self.settle is not None and all(g.final is not None for g in self.gens):
                        await self.settle()
                yield event
                if isinstance(event, Finished):
                    return
            else:
                return  # not reached: a generation's events end with Finished
            again = await self.replay(i) if self.replay is not None else ENGINE_STOPPED
            if not isinstance(again, Generation):  # no restart in time, or the daemon stops
                yield replace(stopped, error=again)
                return
            replayed = True

    async def queue_wait(self, limit: float) -> float | None:
        """Seconds the longest-waiting choice waited for its slot, once every choice has its first
        event (a token's carries the wait, `TextDelta.queue_s`), or None past `limit` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        waits = []
        for gen in self.gens:
            first = await gen.started(max(0.0, deadline - loop.time()))
            if first is None:
                return None
            waits.append(first.queue_s)
        return max(waits, default=None)

    def refused(self) -> ApiError | None:
        """The error to answer instead of a stream when a choice was refused before it started
        (QUEUE_TIMEOUT): its first event, seen already (`queue_wait`), is its end."""
        for gen in self.gens:
            first = gen.peek()
            if isinstance(first, Finished) and first.error == QUEUE_TIMEOUT and not first.completion_tokens:
                return aborted(first.error)
        return None

    def reader(self) -> ReplyReader:
        """A reader for one choice's text: tool calls and reasoning as this request has them."""
        tags = REASONING_TAGS.get(self.handle.settings.reasoning)
        splitter = ReasoningSplitter(*tags, opened=self.reasoning_open) if tags else None
        return ReplyReader(tools=self.tools, reasoning=splitter, stops=self.visible_stops)


def cache_scope(request: web.Request) -> str:
    """Whose cached KV state a request may reuse: its API key's own, or its key's cache group
    (no key: the one open scope)."""
    caller = request.get(CALLER)
    return (caller.cache_scope or f"key:{caller.key_id}") if caller is not None else ""


def request_share(request: web.Request, common: CommonRequest) -> Share:
    """A request's place in fair share: its key, the key's weight, and the class it asks for
    (`service_tier`) when that is below its key's, else its key's (no key: one open tenant)."""
    caller = request.get(CALLER)
    share = caller.share if caller is not None else Share()
    if common.priority is not None and common.priority < share.priority:
        share = replace(share, priority=common.priority)
    return share


def _generation_request(
    handle: ModelHandle,
    common: CommonRequest,
    tokens: list[int],
    choice: int,
    *,
    scope: str,
    share: Share,
    media: tuple[MediaSpan, ...] = (),
) -> GenerationRequest:
    sampling = common.sampling
    if choice and sampling.seed is not None:  # seeded choices differ from each other, reproducibly
        sampling = replace(sampling, seed=sampling.seed + choice)
    return GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=handle.generation_limit(len(tokens), common.max_tokens),
        sampling=sampling,
        stop=common.stop,
        ignore_eos=common.ignore_eos,
        logprobs=common.logprobs,
        cache_scope=scope,
        share=share,
        media=media,
    )


def _check_choices(handle: ModelHandle, n: int) -> None:
    """400 for more choices than the model's slots and queue hold together: such a request
    never fits, whoever else is there (a 429 would be retried forever)."""
    room = handle.settings.slots + handle.settings.queue_size
    if n > room:
        raise InvalidRequest(
            f"'n' may be at most {room} for model {handle.name!r} (its slots and queue together)", param="n"
        )


def _submit_all(
    handle: ModelHandle,
    common: CommonRequest,
    tokens: list[int],
    grammars: list[Grammar] | None,
    *,
    scope: str,
    share: Share,
    media: tuple[MediaSpan, ...] = (),
) -> list[Generation]:
    """One generation per choice; all or none (a 429 on the third cancels the first two)."""
    gens: list[Generation] = []
    pending = list(grammars or [])
    try:
        _check_choices(handle, common.n)
        # Admitted as a whole (nothing awaited until every choice is in): n choices of a key
        # let in past the bound for its fair share all go in, and count as one admission.
        past_bound = handle.check_capacity(share.tenant, common.n)
        for choice in range(common.n):
            grammar = pending.pop(0) if pending else None
            gens.append(
                handle.submit(
                    _generation_request(
                        handle, common, tokens, choice, scope=scope, share=share, media=media
                    ),
                    grammar,
                    admitted=True,
                )
            )
        if past_bound:
            handle.counters["fair_admissions"] += 1
    except BaseException:
        for gen in gens:
            gen.cancel()
        for grammar in pending:
            grammar.free()
        raise
    return gens


def _trace_choices(trace: RequestTrace, admitted: float, choices: Sequence[ChoiceFigures]) -> None:
    """Each choice's queue, prefill and decode, from its timings (monotonic) to the trace's clock."""
    end = trace.epoch_ns(time.monotonic())
    for i, c in enumerate(choices):
        attributes = {"edgellm.choice": i} if len(choices) > 1 else {}
        slot = trace.epoch_ns(admitted + c.queue_s)
        trace.phase("queue", trace.epoch_ns(admitted), slot, **attributes)
        if c.first_at is None:
            continue
        first = trace.epoch_ns(c.first_at)
        trace.phase("prefill", slot, first, **attributes)
        trace.phase("decode", first, end, **attributes, **{"gen_ai.usage.output_tokens": c.completion_tokens})


def _finish_label(final: Finished | None) -> str:
    """A choice's finish for `edgellm_request_success`: its reason, `error` when one ended it,
    `abort` when it never finished (the client left, the request failed elsewhere)."""
    if final is None:
        return "abort"
    if final.error == QUEUE_TIMEOUT:
        return "shed"
    return "error" if final.error is not None else str(final.reason)


async def _finals(gens: Sequence[Generation], limit: float) -> None:
    """Wait at most `limit` seconds in all for every generation's Finished."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    for gen in gens:
        await gen.ended(deadline - loop.time())


@contextlib.asynccontextmanager
async def chat_session(request: web.Request, body: ChatRequest) -> AsyncIterator[Session]:
    """Run a chat request's generations for the `async with` block, then free them."""
    async with context(request).registry.lease(body.common.model) as handle:
        handle.generator  # noqa: B018 - refuses embedding models before tokenizing
        handle.check_capacity(tenant(request))  # a request that will be refused costs no tokenizing
        tools = body.tools.tools if body.tools else None
        began = now_ns()
        settings = context(request).settings
        messages = await fetch_media(body.messages, settings.media)
        limits = MediaRules.of(settings.media).limits
        prompt = await handle.chat_prompt(
            messages,
            tools,
            instructions=body.tools.instructions if body.tools else "",
            media_limits=limits,
            scope=cache_scope(request),
        )
        trace = request.get(TRACE)
        if trace is not None:
            trace.phase("prompt", began, **{"gen_ai.usage.input_tokens": len(prompt.tokens)})
            trace.text("gen_ai.prompt", "\n".join(f"{m.role}: {m.content}" for m in body.messages))
        param = "tools" if body.tools is not None and body.tools.grammar is not None else "response_format"
        names = body.tools.names if body.tools is not None and body.tools.grammar is not None else None
        # With the reply's text tool-call JSON, its stop strings are the readers' (the answer text).
        common = body.common if names is None else replace(body.common, stop=())
        try:
            async with generation_session(
                request, handle, common, prompt.tokens, param=param, prompt=prompt, media_limits=limits
            ) as session:
                session.tools = names
                session.visible_stops = body.common.stop if names is not None else ()
                session.reasoning_open = prompt.reasoning_open
                yield session
        finally:
            if prompt.held is not None:  # the engine may drop the chunks once nothing decodes them
                prompt.held.release()


@contextlib.asynccontextmanager
async def generation_session(
    request: web.Request,
    handle: ModelHandle,
    common: CommonRequest,
    tokens: list[int],
    *,
    param: str,
    prompt: Prompt | None = None,
    media_limits: MediaLimits | None = None,
) -> AsyncIterator[Session]:
    """Submit one generation per choice on `handle`; free every slot when the block ends.

    `prompt`: the chat prompt `tokens` came from, when it holds images or clips (their
    positions, and what a restarted engine must prepare again)."""
    spans = prompt.media if prompt is not None else ()
    ctx = context(request)
    more = request.get(MORE_SEQUENCES)
    if common.n > 1 and more is not None:  # every choice is a sequence: n counts toward concurrency
        more(common.n - 1)
    tag = user_tag(common.user)
    if tag is not None:
        request[USER_TAG] = tag
    n_vocab = handle.engine.n_vocab
    if any(token >= n_vocab for token, _ in common.sampling.logit_bias):
        raise InvalidRequest(f"'logit_bias' token ids must be below {n_vocab}", param="logit_bias")
    trace = request.get(TRACE)
    began = now_ns()
    grammars = await handle.grammars(common.sampling.grammar, common.n, param)
    if trace is not None and grammars:
        trace.phase("grammar", began, **{"edgellm.grammars": len(grammars)})
    try:
        check_key_still_valid(request)  # tokenizing and compiling took a while: revoked since?
        reserve = request.get(RESERVE_PROMPT)
        if reserve is not None:  # its key's token budgets count the prompt from now (429 if spent)
            reserve(len(tokens))
        handed_over(request)  # the generations below take its place among the running requests
    except BaseException:
        for grammar in grammars or []:
            grammar.free()
        raise
    gens = _submit_all(
        handle,
        common,
        tokens,
        grammars,
        scope=cache_scope(request),
        share=request_share(request, common),
        media=spans,
    )
    admitted = time.monotonic()
    arrived = request.get(ARRIVED, admitted)
    timings = [ctx.metrics.timing(handle.name, arrived) for _ in gens]
    caller = request.get(CALLER)
    key_id = caller.key_id if caller is not None else None
    for gen in gens:
        ctx.generations.add(gen, key_id)
    server = ctx.settings.server
    handles = [handle]  # the one leased by the caller, then any restarted engine's
    settled = False
    first_waits: dict[int, float] = {}  # the Session's, read when it settles

    async def settle() -> None:
        """Count the request's tokens (rate limit, metrics, the ledger) once, from what finished:
        to the end even when the handler is cancelled meanwhile (a client gone), shielded."""
        nonlocal settled
        if settled:
            return
        settled = True
        counting = asyncio.ensure_future(count())
        _SETTLING.add(counting)
        counting.add_done_callback(_SETTLING.discard)
        await asyncio.shield(counting)

    async def count() -> None:
        # A client gone: its choices were cancelled just now, and whether each had a slot is in
        # the Finished its engine sends back (at once for one still waiting).
        await _finals(gens, SETTLE_WAIT_S)
        finals = [gen.final for gen in gens if gen.final is not None]
        # A choice cut before its end (a client gone, an error) counts what it produced so far,
        # as its events showed it: tokens computed and sent are charged (ledger, tpm, quotas),
        # never free for a client that disconnects before the last event. An engine that died
        # mid-stream ends its generations with a Finished of no tokens: what streamed counts.
        produced = [
            max(gen.final.completion_tokens, timing.seen) if gen.final is not None else timing.seen
            for gen, timing in zip(gens, timings, strict=True)
        ]
        completion = sum(produced)
        # The prompt is charged once some choice had a slot (its prefill ran, or began): one
        # refused or cancelled while it waited computed nothing (a final not there in time counts).
        computed = any(gen.final is None or gen.final.admitted for gen in gens)
        charged = len(tokens) if computed else 0
        if finals and computed:
            ctx.metrics.prompt_tokens.labels(handle.name, handle.name).inc(finals[0].prompt_tokens)
        for timing, count in zip(timings, produced, strict=True):  # tokens were counted as they streamed
            timing.settle(count)
        telemetry = ctx.settings.telemetry
        choices = [
            ChoiceFigures(
                queue_s=first_waits.get(i, gen.final.queue_s if gen.final is not None else 0.0),
                completion_tokens=count,
                finish_reason=_finish_label(gen.final),
                first_at=timing.first_at,
            )
            for i, (gen, timing, count) in enumerate(zip(gens, timings, produced, strict=True))
        ]
        met = ctx.metrics.request_done(
            handle.name,
            api_family(request),
            arrived=arrived,
            admitted=admitted,
            prompt_tokens=len(tokens),
            choices=choices,
            slo=Slo(telemetry.slo_ttft_s, telemetry.slo_tokens_per_s),
        )
        if trace is not None:
            _trace_choices(trace, admitted, choices)
            trace.attributes.update(
                {
                    "gen_ai.operation.name": api_family(request),
                    "gen_ai.request.model": handle.name,
                    "gen_ai.usage.input_tokens": len(tokens),
                    "gen_ai.usage.output_tokens": completion,
                    "edgellm.slo_met": met,
                }
            )
        await account(request, handle.name, charged, completion)

    async with contextlib.AsyncExitStack() as leases:

        async def replay(i: int) -> Generation | str:
            stopped = gens[i]
            ctx.generations.discard(stopped)
            fresh = await ctx.registry.replacement(handles[-1], server.progress_timeout_s)
            if fresh is None:  # nothing restarts during the daemon's stop: say that, not "restarting"
                return SHUTTING_DOWN if ctx.registry.stopping else ENGINE_STOPPED
            try:
                if fresh is not handles[-1]:
                    await leases.enter_async_context(ctx.registry.lease(fresh.name))
                    handles.append(fresh)
                    if spans and prompt is not None:  # its chunks again, under the same ids
                        held = await fresh.hold_media(prompt.media_items, media_limits or MediaLimits())
                        leases.callback(held.release)
                grammar = await fresh.grammars(common.sampling.grammar, 1, param)
                gen = fresh.submit(stopped.request, grammar[0] if grammar else None)
            except (ApiError, EngineError):  # stopped again, or full: the first stop's error ends the choice
                return ENGINE_STOPPED
            gens[i] = gen
            ctx.generations.add(gen, key_id)
            return gen

        try:
            yield Session(
                handle,
                gens,
                timings,
                len(tokens),
                server.progress_timeout_s,
                server.stream_write_timeout_s,
                replay=replay,
                first_waits=first_waits,
                queue_waits=request.setdefault(QUEUE_WAITS, []),
                settle=settle,
                trace=trace,
            )
        finally:
            # Normal end, client gone (write error or handler cancelled): either way the slots
            # must be free now, not when the generations would have ended.
            for gen in gens:
                ctx.generations.discard(gen)
                gen.cancel()
            for leased in handles:
                leased.generator.wake()
            await settle()  # when the answer did not (an error, a client gone): counted all the same


@dataclass(frozen=True, slots=True)
class ChoicePart:
    """A part of choice `index`'s reply."""

    index: int
    part: Part


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """Choice `index` finished; `reader` holds everything it said."""

    index: int
    final: Finished
    reader: ReplyReader
    logprobs: tuple[TokenLogprob, ...] = ()  # of every token of the choice, when asked for


async def read_choices(session: Session) -> AsyncIterator[ChoicePart | ChoiceEnd]:
    """Every choice's reply parts as they are generated, then its end (NoProgress past the idle timeout)."""
    gens = session.gens
    readers = [session.reader() for _ in gens]
    if len(gens) == 1:
        async for item in _read_one(session, 0, readers[0]):
            yield item
        return
    queue: asyncio.Queue[ChoicePart | ChoiceEnd | NoProgress] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for item in _read_one(session, i, readers[i]):
                queue.put_nowait(item)
        except NoProgress as exc:
            queue.put_nowait(exc)

    pumps = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    try:
        remaining = len(gens)
        while remaining:
            got = await queue.get()
            if isinstance(got, NoProgress):
                raise got
            if isinstance(got, ChoiceEnd):
                remaining -= 1
            yield got
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _read_one(session: Session, i: int, reader: ReplyReader) -> AsyncIterator[ChoicePart | ChoiceEnd]:
    timing = session.timings[i]
    logprobs: list[TokenLogprob] = []
    async for event in session.events(i):
        timing.tokens(event.completion_tokens)
        logprobs.extend(event.logprobs)
        if event.text:
            for part in reader.feed(event.text):
                yield ChoicePart(i, part)
            if reader.stopped is not None:
                session.stop_at(i, reader.stopped)
        if isinstance(event, Finished):
            for part in reader.finish():
                yield ChoicePart(i, part)
            yield ChoiceEnd(i, event, reader, tuple(logprobs))
            return


def finish_reason(final: Finished, reader: ReplyReader) -> str:
    """OpenAI's finish reason: `tool_calls` when the reply made complete calls and was not cut."""
    if final.reason == "length":
        return "length"
    return "tool_calls" if reader.calls else "stop"


def tool_names(body: ChatRequest) -> Sequence[str] | None:
    """The function names a reply may call, when its text is tool-call JSON."""
    return body.tools.names if body.tools is not None and body.tools.grammar is not None else None


def aborted(reason: str | None) -> ApiError | None:
    """The client's error for a generation the server ended on purpose (shutdown, revoked key)
    or cut because its model's engine stopped (that model restarts: retry)."""
    if reason == SHUTTING_DOWN:
        return ServerShuttingDown(SHUTTING_DOWN)
    if reason == KEY_REVOKED:
        return KeyRevoked(KEY_REVOKED)
    if reason == ENGINE_STOPPED:
        return EngineFailed(ENGINE_STOPPED, headers={"Retry-After": RETRY_AFTER_LOADING_S})
    if reason == QUEUE_TIMEOUT:
        return ServerOverloaded(QUEUE_TIMEOUT, headers={"Retry-After": RETRY_AFTER_BUSY_S})
    return None


class Preparing:
    """An API request not yet running a generation or a pooled call: its body read and checked,
    its prompt rendered and tokenized, its media fetched and prepared, its grammar compiled (a
    clip makes that seconds). It is among the running requests (`Running`) until one of those
    takes its place (`handed_over`), so that the drain waits for it and ends it past its deadline
    with a 503, and a revoked key's ends with a 401: `abort` cancels the handler's task, and
    `in_flight` (the middleware that made it) answers with the reason's error. Before, only
    running generations counted: a request still in its prompt stage when the daemon stopped
    lost its connection with no answer."""

    __slots__ = ("over", "reason", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.reason: str | None = None  # why it was ended from outside (KEY_REVOKED, SHUTTING_DOWN)
        self.over = False  # a generation or a pooled call took its place

    def abort(self, reason: str) -> None:
        if self.reason is None and not self.over and not self.task.done():
            self.reason = reason
            self.task.cancel()


PREPARING: Final = web.RequestKey("preparing", Preparing)


async def in_flight(request: web.Request, handler: Callable[[web.Request], Awaitable[T]]) -> T:
    """Run an API request's `handler` among the running requests until its work is handed over
    (`handed_over`); ended from outside meanwhile, it raises that reason's error."""
    draining = request.app.get(DRAINING)
    if draining is not None and draining.is_set():
        # Sent on a connection kept alive past the stop's start (or its cut's answer, retried):
        # nothing would end it, and the server's own wait for it would double the stop's.
        raise ServerShuttingDown(SHUTTING_DOWN)
    task = asyncio.current_task()
    if task is None:
        return await handler(request)
    ctx = context(request)
    entry = request[PREPARING] = Preparing(task)
    caller = request.get(CALLER)
    ctx.generations.add(entry, caller.key_id if caller is not None else None)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        # Ours alone (the client still there, the server not cancelling it too): answer why.
        if entry.reason is None or task.uncancel() > 0:
            raise
        raise aborted(entry.reason) or ServerShuttingDown(SHUTTING_DOWN) from None
    finally:
        entry.over = True
        ctx.generations.discard(entry)


def handed_over(request: web.Request) -> None:
    """The request's generations or pooled call are among the running requests now: its own
    entry leaves (an abort from here on ends those, with their own error events)."""
    entry = request.get(PREPARING)
    if entry is None or entry.over:
        return
    entry.over = True
    context(request).generations.discard(entry)
    if entry.reason is not None:  # ended from outside, and the cancel did not reach the handler
        raise aborted(entry.reason) or ServerShuttingDown(SHUTTING_DOWN)


class PooledCall:
    """An embedding or rerank call in flight, among the running requests (`Running`): a revoked
    key's call and the drain's past its deadline end as a generation's do."""

    def __init__(self, work: asyncio.Task[Any]) -> None:
        self.work = work
        self.reason: str | None = None  # why it was ended from outside (KEY_REVOKED, SHUTTING_DOWN)

    def abort(self, reason: str) -> None:
        if self.reason is None and not self.work.done():
            self.reason = reason
            self.work.cancel()


async def pooled_call(
    request: web.Request, handle: ModelHandle, n_tokens: int, work: Callable[[ModelHandle], Awaitable[T]]
) -> T:
    """Run an embedding or rerank call of `n_tokens` on `handle` (once more on the restarted
    engine if its engine stopped), as one of the running requests: a key revoked meanwhile ends
    it with 401, the drain past its deadline with 503. Charged (ledger, tpm, metrics) whatever
    came of it, an error or a client gone half-way, as tpm counted it already; except a call
    refused before it started (429: the model saturated), which computed nothing."""
    ctx = context(request)
    check_key_still_valid(request)  # revoked while its inputs were tokenized
    caller = request.get(CALLER)

    async def run() -> T:
        try:
            return await work(handle)
        except EngineFailed:  # its engine stopped: once, on the restarted engine, if it comes in time
            return await on_restarted(request, handle, work)

    reserve = request.get(RESERVE_PROMPT)
    if reserve is not None:  # its key's token budgets count the inputs from now (429 if spent)
        reserve(n_tokens)
    handed_over(request)
    task = asyncio.ensure_future(run())
    call = PooledCall(task)
    ctx.generations.add(call, caller.key_id if caller is not None else None)
    charged = n_tokens
    try:
        return await task
    except ServerOverloaded:
        charged = 0
        raise
    except asyncio.CancelledError:
        current = asyncio.current_task()
        cut = aborted(call.reason) if call.reason is not None else None
        if cut is not None and (current is None or not current.cancelling()):
            raise cut from None
        raise
    finally:
        ctx.generations.discard(call)
        ctx.metrics.prompt_tokens.labels(handle.name, handle.name).inc(charged)
        await account(request, handle.name, charged, 0)


async def on_restarted(
    request: web.Request, stopped: ModelHandle, work: Callable[[ModelHandle], Awaitable[T]]
) -> T:
    """A pooled request (embeddings, reranking) whose engine stopped under it, asked again of
    the restarted engine: it shows nothing until it is whole, so asking again is safe. Once
    only, so an input that kills the engine costs two stops; the first stop's error when no
    restart comes within the request's progress deadline."""
    ctx = context(request)
    fresh = await ctx.registry.replacement(stopped, ctx.settings.server.progress_timeout_s)
    if fresh is None and ctx.registry.stopping:  # nothing restarts during the daemon's stop
        raise ServerShuttingDown(SHUTTING_DOWN)
    if fresh is None:
        raise EngineFailed(ENGINE_STOPPED, headers={"Retry-After": RETRY_AFTER_LOADING_S})
    async with ctx.registry.lease(fresh.name) as handle:
        return await work(handle)
