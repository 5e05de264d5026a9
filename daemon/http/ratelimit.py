"""Per-key rate limits: token buckets for requests and tokens per minute, a concurrency cap, 429s."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from edgellmd.api.context import MORE_SEQUENCES, TOKENS_USED
from edgellmd.errors import InvalidRequest, RateLimited
from edgellmd.keys import ApiKey

MINUTE_S: Final = 60.0


@dataclass(slots=True)
class TokenBucket:
    """`capacity` units refilled evenly over a minute; a charge may drive the level below zero."""

    capacity: float
    level: float = math.nan
    updated: float | None = None  # clock reading of the last refill

    def __post_init__(self) -> None:
        if math.isnan(self.level):
            self.level = self.capacity

    def refill(self, now: float) -> None:
        """Add what the elapsed time earned, up to the capacity."""
        if self.updated is not None:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / MINUTE_S)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` units are available (0 when they are now)."""
        self.refill(now)
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * MINUTE_S / self.capacity

    def take(self, amount: float, now: float) -> None:
        """Spend `amount` (the caller checked `wait_for` first, or accepts a debt)."""
        self.refill(now)
        self.level -= amount

    def reset_after(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return max(0.0, (self.capacity - self.level) * MINUTE_S / self.capacity)


@dataclass(slots=True)
class KeyState:
    """The live counters of one key."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0
    limits_seen: tuple[int | None, int | None] = field(default=(None, None))


def _duration(seconds: float) -> str:
    # OpenAI's x-ratelimit-reset-* format: "1s", "6m0s", "250ms".
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class RateLimiter:
    """Counters per key id; limits come from the key as it is now (keys reload without a restart)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, KeyState] = {}
        self.refusals: Counter[str] = Counter()  # by reason: rpm, tpm, concurrency (for metrics)

    def _state(self, key: ApiKey) -> KeyState:
        limits = (key.limits.rpm, key.limits.tpm)
        state = self._states.get(key.id)
        if state is None or state.limits_seen != limits:
            # New key, or its limits changed in the keys file: start from full buckets.
            in_flight = state.in_flight if state else 0
            state = KeyState(
                requests=TokenBucket(float(key.limits.rpm)) if key.limits.rpm else None,
                tokens=TokenBucket(float(key.limits.tpm)) if key.limits.tpm else None,
                in_flight=in_flight,
                limits_seen=limits,
            )
            self._states[key.id] = state
        return state

    def admit(self, key: ApiKey) -> None:
        """Count a new request against the key, or raise RateLimited with Retry-After."""
        state = self._state(key)
        now = self._clock()
        if key.limits.concurrent is not None and state.in_flight >= key.limits.concurrent:
            self.refusals["concurrency"] += 1
            raise RateLimited(
                f"this key allows {key.limits.concurrent} concurrent request(s)", headers={"Retry-After": "1"}
            )
        waits = []
        if state.requests is not None:
            waits.append(("rpm", state.requests.wait_for(1, now)))
        if state.tokens is not None:
            # Tokens are charged when a request ends; a key in debt waits until it is paid.
            waits.append(("tpm", state.tokens.wait_for(0, now)))
        for reason, wait in waits:
            if wait > 0:
                self.refusals[reason] += 1
                what = "requests per minute" if reason == "rpm" else "tokens per minute"
                raise RateLimited(
                    f"rate limit reached for {what}; retry in {math.ceil(wait)} s",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        if state.requests is not None:
            state.requests.take(1, now)
        state.in_flight += 1

    def more(self, key: ApiKey, extra: int) -> None:
        """An admitted request runs `extra` sequences besides its own (`n`): each counts against
        the key's concurrency, or RateLimited and nothing taken."""
        state = self._state(key)
        cap = key.limits.concurrent
        if cap is not None and extra + 1 > cap:  # never allowed: waiting would not help
            raise InvalidRequest(
                f"'n' must be at most {cap} with this key: it allows {cap} concurrent sequence(s)",
                param="n",
            )
        if cap is not None and state.in_flight + extra > cap:
            self.refusals["concurrency"] += 1
            raise RateLimited(
                f"this key allows {cap} concurrent sequence(s): 'n' of {extra + 1} with "
                f"{state.in_flight - 1} other request(s) in flight is too many",
                param="n",
                headers={"Retry-After": "1"},
            )
        state.in_flight += extra

    def reserve(self, key: ApiKey, tokens: int) -> bool:
        """Take a prompt about to be computed from the key's tokens per minute now, not when its
        request ends, so that requests admitted together see each other's prompts: RateLimited
        while the bucket holds less than the prompt (a prompt larger than a whole minute's
        allowance waits for a full bucket). True when something was taken."""
        state = self._state(key)
        if state.tokens is None or tokens <= 0:
            return False
        now = self._clock()
        wait = state.tokens.wait_for(min(float(tokens), state.tokens.capacity), now)
        if wait > 0:
            self.refusals["tpm"] += 1
            raise RateLimited(
                f"rate limit reached for tokens per minute (this prompt is {tokens} tokens); "
                f"retry in {math.ceil(wait)} s",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        state.tokens.take(tokens, now)
        return True

    @contextlib.contextmanager
    def admitted(self, key: ApiKey, request: web.Request) -> Iterator[Callable[[int], None]]:
        """Around an admitted request's handling: its `n` may take more places (MORE_SEQUENCES),
        its prompts are taken from its tokens per minute as they are submitted (the callable it
        yields: `reserve`); at the end it gives its places back and is charged the rest of the
        tokens it used (what it took for prompts it did not compute is given back)."""
        held = [1]
        taken = [0]

        def more(extra: int) -> None:
            self.more(key, extra)
            held[0] += extra

        def reserve(tokens: int) -> None:
            if self.reserve(key, tokens):
                taken[0] += tokens

        request[MORE_SEQUENCES] = more
        try:
            yield reserve
        finally:
            self.release(key, request.get(TOKENS_USED, 0), held[0], taken=taken[0])

    def release(self, key: ApiKey, tokens_used: int, held: int = 1, *, taken: int = 0) -> None:
        """A request of this key ended, having used `tokens_used` tokens (prompt + completion),
        `taken` of them from its tokens per minute already (`reserve`), and held `held` places of
        its concurrency (`more`)."""
        state = self._state(key)
        state.in_flight = max(0, state.in_flight - held)
        if state.tokens is not None and tokens_used != taken:
            state.tokens.take(tokens_used - taken, self._clock())
            state.tokens.level = min(state.tokens.level, state.tokens.capacity)

    def headers(self, key: ApiKey) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the key's limited dimensions."""
        state = self._state(key)
        now = self._clock()
        out: dict[str, str] = {}
        for name, bucket in (("requests", state.requests), ("tokens", state.tokens)):
            if bucket is None:
                continue
            bucket.refill(now)
            out[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(bucket.level)))
            out[f"x-ratelimit-reset-{name}"] = _duration(bucket.reset_after(now))
        return out
