"""Prompt-lookup drafts and the host-RAM prompt cache: the scheduler's two ways to skip work.

`NgramDrafter` proposes the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (in its prompt or its reply so far): text that copies from its
input (rewriting, extraction, code edits, quotes, JSON that repeats keys) is drafted, the
drafts are checked in the next `llama_decode` beside everyone else's tokens, and every token
the request's own sampler would have picked anyway is kept.

`ModelDrafter` holds what a draft model (engine.draft_model) needs of one sequence: its
tokens, and the draft the model proposed for the sequence's next step.

`PromptCache` keeps the KV state of finished sequences in host RAM, keyed by their tokens,
least recently used first out: a prompt that starts the way an earlier one did, in another
slot or in a slot since reused, restores that prefix instead of prefilling it. Each engine
has its own: a reload (a new engine) starts with an empty cache, so a state computed by one
model version is never used with another.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

MIN_CACHED_TOKENS: Final = 128  # shorter prefixes prefill faster than a state restores


@dataclass(frozen=True, slots=True)
class Speculation:
    """How a model drafts (from its `speculative` settings)."""

    mode: str = "none"  # "none", "ngram" or "draft"
    max_draft: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    max_sequences: int = 2  # draft only while at most this many sequences decode
    # Mode "draft": the draft model's file as it is loaded (a verified copy or descriptor),
    # what status pages call it, the confidence under which it stops a draft, and whether
    # its file may be memory-mapped (a private preload copy only, as for the model's own).
    draft_path: Path | None = None
    draft_name: str = ""
    draft_p_min: float = 0.75
    draft_mmap: bool = False

    @property
    def enabled(self) -> bool:
        """True when the model drafts at all."""
        return self.mode != "none"


PAUSE_AFTER: Final = 4  # drafts rejected outright in a row before a sequence stops drafting for a while
FIRST_PAUSE: Final = 8  # steps of the first pause; each further one doubles, up to MAX_PAUSE
MAX_PAUSE: Final = 256


class DraftLength:
    """A sequence's adaptive draft length: longer while every draft is kept, cut where one is not.

    A draft that is rejected outright costs its checked positions and, with a draft model,
    the draft model's own decodes, and gains nothing. After PAUSE_AFTER such drafts in a row
    the sequence stops drafting for FIRST_PAUSE steps, then for twice as long after each
    further run of them (up to MAX_PAUSE); a draft kept even in part ends the back-off. A
    draft that is never right so costs a few percent instead of half the throughput.
    """

    __slots__ = ("_backoff", "_pause", "_rejected", "draft_len", "max_draft")

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self.draft_len = max_draft
        self._rejected = 0  # drafts rejected outright in a row
        self._pause = 0  # steps left without drafting
        self._backoff = FIRST_PAUSE  # the next pause's length

    def accepted(self, drafted: int, kept: int) -> None:
        """Adapt the draft length to how many of `drafted` tokens the sampler kept."""
        if drafted == 0:
            return
        if kept == 0:
            self._rejected += 1
            if self._rejected >= PAUSE_AFTER:
                self._rejected = 0
                self._pause = self._backoff
                self._backoff = min(MAX_PAUSE, 2 * self._backoff)
        else:
            self._rejected = 0
            self._backoff = FIRST_PAUSE
        if kept == drafted:
            self.draft_len = min(self.max_draft, self.draft_len + 2)
        else:
            self.draft_len = max(1, kept + 1)

    def resting(self) -> bool:
        """True while a pause lasts; each call is one step of it (call once per step)."""
        if self._pause > 0:
            self._pause -= 1
            return True
        return False


class NgramDrafter(DraftLength):
    """One sequence's n-gram index over its tokens so far, and its adaptive draft length."""

    __slots__ = ("_index", "_max", "_min", "tokens")

    def __init__(self, spec: Speculation, tokens: Sequence[int]) -> None:
        super().__init__(spec.max_draft)
        self._min = max(1, min(spec.ngram_min, spec.ngram_max))
        self._max = max(spec.ngram_min, spec.ngram_max)
        self.tokens: list[int] = []
        # n -> the n-gram -> the position just after its latest occurrence (before the tail).
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self._min, self._max + 1)}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Note the sequence's next token (prompt or generated)."""
        tokens = self.tokens
        # Index the n-grams that end at the current tail before the tail moves on: a lookup
        # of the tail then finds only earlier occurrences.
        end = len(tokens)
        for n, index in self._index.items():
            if end >= n:
                index[tuple(tokens[end - n : end])] = end
        tokens.append(token)

    def draft(self) -> list[int]:
        """Up to `draft_len` tokens that followed the longest earlier match of the tail."""
        tokens = self.tokens
        for n in range(self._max, self._min - 1, -1):
            if len(tokens) < n:
                continue
            at = self._index[n].get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at : at + self.draft_len]
        return []


class ModelDrafter(DraftLength):
    """One sequence's tokens so far, and the draft a draft model proposed for its next step.

    The draft model drafts for every drafting sequence of a step at once (one llama_decode
    per draft position for all of them), before the step's batch is built: `proposed` holds
    this sequence's share until the scheduler takes it with `draft()`.
    """

    __slots__ = ("proposed", "tokens")

    def __init__(self, spec: Speculation, tokens: Sequence[int]) -> None:
        super().__init__(spec.max_draft)
        self.tokens: list[int] = list(tokens)
        self.proposed: list[int] = []

    def append(self, token: int) -> None:
        """Note the sequence's next token (generated)."""
        self.tokens.append(token)

    def draft(self) -> list[int]:
        """The draft proposed for this step (once: a later step gets a fresh one or none)."""
        out, self.proposed = self.proposed, []
        return out


Drafter = NgramDrafter | ModelDrafter


def make_drafter(spec: Speculation, tokens: Sequence[int]) -> Drafter | None:
    """The drafter a new sequence of a model with these settings gets; None when it drafts not."""
    if spec.mode == "draft":
        return ModelDrafter(spec, tokens)
    if spec.enabled:
        return NgramDrafter(spec, tokens)
    return None


_PREFIX_BLOCK: Final = 256  # tokens compared at once by common_prefix


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common start of two token sequences (lists, tuples or both).

    Blocks compared whole first (a slice comparison runs in C), then the first block that
    differs token by token: 32k-token prompts took 2-6 ms a pair token by token, and the n
    choices of a request compare n x (n - 1) pairs in one step of the scheduler."""
    n = min(len(a), len(b))
    same = type(a) is type(b)  # a tuple's slice never equals a list's: compared as tuples then
    start = 0
    while start < n:
        end = min(start + _PREFIX_BLOCK, n)
        x, y = a[start:end], b[start:end]
        if (x != y) if same else (tuple(x) != tuple(y)):
            break
        start = end
    for k in range(start, n):
        if a[k] != b[k]:
            return k
    return n


@dataclass(slots=True)
class CacheStats:
    """What the prompt cache has done, for /metrics and /admin/stats."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    restored_tokens: int = 0
    restore_seconds: float = 0.0


@dataclass(slots=True)
class PromptCache:
    """KV states of earlier sequences by their cache scope and tokens, within `max_bytes`.

    A state is found again only by a prompt of the scope that stored it (`GenerationRequest.
    cache_scope`): across scopes every lookup is a miss. Past the bound the scope holding the
    most gives up its least recently used entry, so one scope cannot take another below an
    equal share.
    """

    max_bytes: int
    entries: OrderedDict[tuple[str, tuple[int, ...]], bytes] = field(default_factory=OrderedDict)
    used_bytes: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    held: dict[str, int] = field(default_factory=dict)  # bytes of each scope's entries

    def _add(self, key: tuple[str, tuple[int, ...]], data: bytes) -> None:
        self.entries[key] = data
        self.used_bytes += len(data)
        self.held[key[0]] = self.held.get(key[0], 0) + len(data)

    def _pop(self, key: tuple[str, tuple[int, ...]]) -> None:
        size = len(self.entries.pop(key))
        self.used_bytes -= size
        left = self.held[key[0]] - size
        if left:
            self.held[key[0]] = left
        else:
            del self.held[key[0]]

    def best(self, prompt: Sequence[int], scope: str = "") -> tuple[tuple[int, ...], bytes, int] | None:
        """The entry of `scope` sharing the longest start with `prompt` (at least MIN_CACHED_TOKENS)
        and its length."""
        found: tuple[tuple[int, ...], bytes, int] | None = None
        for (owner, tokens), data in self.entries.items():
            if owner != scope:
                continue
            shared = common_prefix(tokens, prompt)
            if shared >= MIN_CACHED_TOKENS and (found is None or shared > found[2]):
                found = (tokens, data, shared)
        if found is not None:
            self.entries.move_to_end((scope, found[0]))
        return found

    def covers(self, tokens: Sequence[int], scope: str = "") -> bool:
        """True when an entry of `scope` already holds `tokens` or more of the same sequence."""
        return any(
            owner == scope and len(t) >= len(tokens) and common_prefix(t, tokens) == len(tokens)
            for owner, t in self.entries
        )

    def drop_scopes(self, scopes: Collection[str]) -> int:
        """Forget every entry of these scopes (their keys are gone); how many went."""
        gone = [k for k in self.entries if k[0] in scopes]
        for key in gone:
            self._pop(key)
        return len(gone)

    def put(self, tokens: Sequence[int], data: bytes, scope: str = "") -> None:
        """Keep a sequence's state; entries of its scope it extends go, the oldest go while over the limit."""
        if len(data) > self.max_bytes:
            return
        key = tuple(tokens)
        for old in [k for k in self.entries if k[0] == scope and common_prefix(k[1], key) == len(k[1])]:
            self._pop(old)
        self._add((scope, key), data)
        self.stats.stored += 1
        while self.used_bytes > self.max_bytes and self.entries:
            # Room comes from the scope holding the most (of two that hold as much, the one with
            # the least recently used entry), its least recently used first: one key's flood of
            # long prompts evicts its own entries once it holds the most, and no key is taken
            # below an equal share. A key that filled the cache alone loses an entry to another
            # key's first store, and its next hit tells it some key was active (docs/security.md).
            most = max(self.held.values())
            victim = next(k for k in self.entries if self.held[k[0]] == most)
            self._pop(victim)
            self.stats.evicted += 1
