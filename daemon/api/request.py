"""The request model every API family decodes into, and the checks they share.

The OpenAI, Responses and Anthropic decoders turn their wire formats into a `ChatRequest`
(a conversation, sampling, output constraints, tools) under the server's `Limits`; the
token limit a request asks for is checked and defaulted here once (`within_ceiling`,
`token_limit`), whatever the family calls the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from edgellmd.api.fields import Fields, number_text
from edgellmd.api.media import MediaRules
from edgellmd.api.structured import ToolPlan
from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.generation import SamplingParams
from edgellmd.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-wide bounds that validation enforces (from settings)."""

    max_tokens_limit: int
    default_max_tokens: int | None
    clamp: bool = False  # a max_tokens past the ceiling is cut to it (server/key max_tokens_over_limit)
    clamped: list[int] = field(default_factory=list)  # what was asked past it, when it was cut
    media: MediaRules = field(default_factory=MediaRules)  # images and clips (settings media.*)


@dataclass(frozen=True, slots=True)
class CommonRequest:
    """What chat and completion requests share."""

    model: str
    max_tokens: int | None  # None: until the slot's context is full
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    n: int = 1  # choices, each its own sequence in the batch
    logprobs: int | None = None  # None: none; k: each token's logprob and k alternatives
    user: str | None = None  # the client's end-user tag, logged
    priority: int | None = None  # the class it asks for (keys.PRIORITIES); None: its key's


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated `POST /v1/chat/completions` body."""

    common: CommonRequest
    messages: tuple[ChatMessage, ...]
    tools: ToolPlan | None = None


# OpenAI's `service_tier` (chat, completions, Responses) as a class of keys.PRIORITIES: "flex"
# asks for the batch class, "priority" for interactive, the others for the key's own. A key's
# class is the ceiling: asking above it gets the key's (session.request_share).
SERVICE_TIERS: Final = {"auto": None, "default": None, "scale": None, "flex": -1, "priority": 1}


def service_tier(f: Fields) -> int | None:
    """The class a request's `service_tier` asks for (400 for a tier OpenAI does not have)."""
    tier = f.choice("service_tier", tuple(SERVICE_TIERS))
    return None if tier is None else SERVICE_TIERS[tier]


def within_ceiling(limits: Limits, name: str, asked: int) -> int:
    """`asked` (the field `name`, already a positive integer): 400 past the server's or the key's
    ceiling, or the ceiling itself when the policy clamps (noted in `limits.clamped`)."""
    if asked > limits.max_tokens_limit and limits.clamp:
        limits.clamped.append(asked)
        return limits.max_tokens_limit
    if asked > limits.max_tokens_limit:
        raise InvalidRequest(
            f"'{name}' must be at most {limits.max_tokens_limit} on this server, got {number_text(asked)}",
            param=name,
        )
    return asked


def token_limit(limits: Limits, asked: int | None, default: int | None = None) -> int:
    """A generation's token limit: what was asked, else the server's default, else the family's
    own; a default never goes past the ceiling, and no limit at all is the ceiling."""
    if asked is not None:
        return asked
    fallback = limits.default_max_tokens or default
    return min(fallback, limits.max_tokens_limit) if fallback else limits.max_tokens_limit
