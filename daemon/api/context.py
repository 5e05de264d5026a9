"""What the API adapters need from the application, and the request state they share with the front door.

The adapters sit below the front door (`http/` imports `api/`, never the other way): the
app factory builds one `ApiContext` once the models exist, and the authentication middleware
tells a request who it is with a `Caller`. The adapters read both and nothing else of `http/`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from edgellmd.api.media import MediaRules
from edgellmd.api.request import Limits
from edgellmd.engine.fairness import Share
from edgellmd.engine.generation import Running
from edgellmd.errors import ApiError
from edgellmd.host.cpu import Pinning
from edgellmd.host.metrics import Metrics
from edgellmd.host.nvml import GpuMonitor
from edgellmd.host.traces import RequestTrace
from edgellmd.keys import PRIORITIES, ApiKey
from edgellmd.ledger.store import Ledger
from edgellmd.models.registry import Registry
from edgellmd.settings import Settings


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is: the API key that authenticated it."""

    key_id: str
    max_tokens: int | None = None  # the key's own ceiling on max_tokens, when it has one
    max_tokens_over_limit: str | None = None  # refuse or clamp past the ceiling; None: the server's
    cache_scope: str = ""  # whose cached KV state its requests may reuse (ApiKey.cache_scope)
    share: Share = field(default_factory=Share)  # its key, weight and class for fair share

    @classmethod
    def of(cls, key: ApiKey) -> Caller:
        """The caller a key authenticates as."""
        share = Share(key.id, key.weight, PRIORITIES[key.priority])
        return cls(key.id, key.limits.max_tokens, key.max_tokens_over_limit, key.cache_scope, share)


# Called with the ids of keys that stopped working (revoked, disabled, expired), so that state
# kept for them (stored responses) goes; the front door's keys watch calls each one.
KEYS_GONE: Final = web.AppKey("keys_gone", list[Callable[[set[str]], object]])


@dataclass(frozen=True, slots=True)
class ApiContext:
    """The application's parts that the adapters use."""

    settings: Settings
    registry: Registry
    metrics: Metrics
    executor: Executor  # the prompt pool: rendering, tokenizing, schemas, grammars
    generations: Running  # generations being consumed, for the drain and for revocation
    pinning: Pinning
    gpu: GpuMonitor | None = None
    # False once a key no longer authenticates (revoked, disabled, expired, removed).
    key_valid: Callable[[str], bool] = lambda _key_id: True


class ErrorShapes:
    """How errors look under a path prefix, for API families with an envelope of their own
    (Anthropic's `{"type": "error", "error": {...}}` on /v1/messages); OpenAI's elsewhere."""

    def __init__(self) -> None:
        self._shapes: list[tuple[str, Callable[[ApiError], web.Response]]] = []

    def add(self, prefix: str, render: Callable[[ApiError], web.Response]) -> None:
        """Render errors of requests under `prefix` with `render`."""
        self._shapes.append((prefix, render))

    def renderer(self, path: str) -> Callable[[ApiError], web.Response] | None:
        """The renderer for a request path, if a family claimed it."""
        for prefix, render in self._shapes:
            if path == prefix or path.startswith(prefix + "/"):
                return render
        return None


API_CONTEXT: Final = web.AppKey("api_context", ApiContext)
ERROR_SHAPES: Final = web.AppKey("error_shapes", ErrorShapes)
CALLER: Final = web.RequestKey("caller", Caller)  # set by authentication; absent without keys
USER_TAG: Final = web.RequestKey("user_tag", str)  # the request's `user` field, logged as a tag
TOKENS_USED: Final = web.RequestKey("tokens_used", int)  # prompt + completion, for tokens/minute
# Set when the shutdown drain begins: /readyz says "draining" from then on (and the console).
DRAINING: Final = web.AppKey("draining", asyncio.Event)
LEDGER: Final = web.AppKey("ledger", Ledger)  # usage, quotas and the audit chain (edgellmd.ledger)
# The id a request's usage is recorded under: its X-Request-Id when the server made it, a fresh
# one when the client chose it (a client must not get two requests counted as one).
USAGE_ID: Final = web.RequestKey("usage_id", str)
# Set by the rate limiter: count this many more sequences (a request's `n` past the first)
# against the key's concurrency, or raise (RateLimited, or InvalidRequest past the key's cap).
# Seconds each finished choice of the request waited for a slot (Finished.queue_s): the answer's
# `x-queue-ms` header says the longest (a stream's headers take it from the first tokens: api.sse).
QUEUE_WAITS: Final = web.RequestKey("queue_waits", list[float])
# time.monotonic() when the request's handling began (the front door's middleware): time to
# first token and end-to-end latency count from here.
ARRIVED: Final = web.RequestKey("arrived", float)
# The request's trace, when it is traced (host.traces): each layer notes its phases on it.
TRACE: Final = web.RequestKey("trace", RequestTrace)
MORE_SEQUENCES: Final = web.RequestKey[Callable[[int], None]]("more_sequences")
# Set by the front door's limits: count a prompt about to be computed against its key's token
# budgets now (tokens per minute, the day's and month's), or raise (RateLimited, QuotaExceeded):
# requests that arrive together see each other's prompts, not only those of finished requests.
RESERVE_PROMPT: Final = web.RequestKey[Callable[[int], None]]("reserve_prompt")
# The prompt tokens a request holds against its key's day and month budgets (RESERVE_PROMPT),
# until its usage is recorded (api.ledger.account) or it ends (http.ledger.release_quota).
PROMPT_HELD: Final = web.RequestKey("prompt_held", int)
# The request's max_tokens bounds (token_limits): a max_tokens the policy cut to the ceiling
# shows in the answer's `x-max-tokens-clamped` header (the ceiling it got).
LIMITS: Final = web.RequestKey("limits", Limits)


def context(request: web.Request) -> ApiContext:
    """The adapters' view of the application serving `request`."""
    return request.app[API_CONTEXT]


def tenant(request: web.Request) -> str:
    """Whose the request is for admission and fair share: its key's id ("" without keys)."""
    caller = request.get(CALLER)
    return caller.share.tenant if caller is not None else ""


def token_limits(request: web.Request) -> Limits:
    """The max_tokens ceiling of this request: the server's, or the key's own when lower.

    The one rule for every API family (chat, completions, Responses, Messages).
    """
    server = context(request).settings.server
    ceiling = server.max_tokens_limit
    caller = request.get(CALLER)
    if caller is not None and caller.max_tokens is not None:
        ceiling = min(ceiling, caller.max_tokens)
    default = server.default_max_tokens
    policy = caller.max_tokens_over_limit if caller is not None else None
    limits = request[LIMITS] = Limits(
        max_tokens_limit=ceiling,
        default_max_tokens=min(default, ceiling) if default is not None else None,
        clamp=(policy or server.max_tokens_over_limit) == "clamp",
        media=MediaRules.of(context(request).settings.media),
    )
    return limits
