"""Sampling one sequence: its C sampler chain and, for structured output, its grammar.

The chain picks first and the grammar checks that one token (resampling among the likeliest
allowed on a miss), and where nothing before top-k changes the ranking only the `top_k`
likeliest tokens go to the chain, with the same distribution. Why, with the figures:
docs/internals.md, "Sampling".
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections import deque
from typing import Any, Final

import llama_cpp as llama
import numpy as np

from edgellmd.engine.config import EngineError, GrammarError
from edgellmd.engine.generation import SamplingParams

RESAMPLE_TIERS: Final = (64, 4096)  # candidates of a grammar miss's resample, tier by tier
THRESHOLD_SAMPLE: Final = 4096  # scores _best samples to set its threshold
# The largest top_k whose candidates are found before the chain runs (see the module's docs);
# beyond it the threshold's pass stops paying, and the chain gets the whole vocabulary.
FAST_TOP_K: Final = 4096
_GREEDY: Final = -1  # SlotSampler._fast: argmax; 0: the whole vocabulary; k > 0: top k first
_DEFAULT_SEED: Final = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a fresh random seed per chain
_SEED_BYTES: Final = 16  # every seed the APIs take (-2^63 to 2^64-1, plus n's offsets) fits, signed


def seed32(seed: int) -> int:
    """The 32-bit llama.cpp seed of an API seed: a hash of the whole integer, never the sentinel.

    llama.cpp takes 32 bits and reads 0xFFFFFFFF as "draw a random seed". Reducing the API's
    64-bit seeds mod 2^32 made 0, 2^32 and -2^63 one seed and sent -1, 2^32-1 and 2^64-1 to
    that sentinel (identical requests, different answers). A hash spreads every integer over
    the 2^32 - 1 other values: the same seed, the same stream; different seeds collide only
    as two random 32-bit numbers do.
    """
    data = seed.to_bytes(_SEED_BYTES, "little", signed=True)
    value = int.from_bytes(hashlib.blake2b(data, digest_size=4, person=b"edgellm-seed").digest(), "little")
    return value if value != _DEFAULT_SEED else 0


class CompiledGrammar:
    """A parsed grammar sampler waiting for its sequence; whoever holds it frees it or hands it on.

    Grammar samplers keep their own copy of the rules: freeing one never touches the
    vocabulary, so the safety net in __del__ is harmless even after the model is gone.
    """

    __slots__ = ("_sampler",)

    def __init__(self, sampler: Any) -> None:
        self._sampler: Any = sampler

    def take(self) -> Any:
        """The native sampler, now owned by the caller (once)."""
        sampler, self._sampler = self._sampler, None
        if sampler is None:
            raise EngineError("this compiled grammar was used already")
        return sampler

    def free(self) -> None:
        """Free the native sampler unless it was taken (idempotent)."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            llama.llama_sampler_free(sampler)

    def __del__(self) -> None:
        self.free()


def compile_grammar(vocab: Any, grammar: str, copies: int = 1) -> list[CompiledGrammar]:
    """Parse `grammar` (GBNF, rule `root`) into `copies` independent grammar samplers."""
    first = llama.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not first:
        raise GrammarError("llama.cpp refused the grammar")
    out = [CompiledGrammar(first)]
    for _ in range(copies - 1):
        clone = llama.llama_sampler_clone(first)
        if not clone:
            for compiled in out:
                compiled.free()
            raise GrammarError("llama.cpp could not copy the grammar")
        out.append(CompiledGrammar(clone))
    return out


def make_chain(sp: SamplingParams, n_vocab: int) -> tuple[Any, Any]:
    """The request's sampler chain, and its penalties sampler (None without penalties)."""
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    add = llama.llama_sampler_chain_add
    penalties = None
    if sp.logit_bias:
        merged = merged_bias(sp.logit_bias)
        biases: Any = (llama.llama_logit_bias * len(merged))(
            *(llama.llama_logit_bias(token, bias) for token, bias in merged)
        )
        add(chain, llama.llama_sampler_init_logit_bias(n_vocab, len(merged), biases))
    if sp.penalized:
        penalties = llama.llama_sampler_init_penalties(
            n_vocab, sp.penalty_last_n, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty
        )
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
    seed = _DEFAULT_SEED if sp.seed is None else seed32(sp.seed)
    add(chain, llama.llama_sampler_init_dist(seed))
    return chain, penalties


def merged_bias(logit_bias: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """One entry per token, biases of a token named twice ("1" and "01") added up.

    llama.cpp's logit-bias sampler adds every entry when it gets the whole vocabulary but only
    a token's first entry when it gets a few candidates: merged, both ways agree.
    """
    sums: dict[int, float] = {}
    for token, bias in logit_bias:
        sums[token] = sums.get(token, 0.0) + bias
    return tuple(sums.items())


def fast_mode(sp: SamplingParams) -> int:
    """How SlotSampler.sample feeds the chain: _GREEDY, top k first (k > 0), or 0 (everything)."""
    if sp.penalized:  # penalties change logits by the history, before top-k ranks them
        return 0
    if sp.greedy:
        return _GREEDY
    return sp.top_k if 0 < sp.top_k <= FAST_TOP_K else 0


def _best(scores: Any, k: int) -> Any:
    """The `k` best-scoring tokens, in no order.

    Ranking a 262k vocabulary (argpartition) costs about half a millisecond, and so does a
    miss's resample that does it. A strided sample of the scores gives a threshold that
    about 2k tokens reach; one comparison per token finds them, and ranking those is cheap.
    The same set either way: every token at or above the threshold, then the k best of
    them; when fewer than k reach it (a sample that misjudged), the whole vocabulary is
    ranked after all.
    """
    n = len(scores)
    if k >= n:
        return np.arange(n)
    sample = scores[:: max(1, n // THRESHOLD_SAMPLE)]
    m = len(sample)
    rank = min(m, 2 * k * m // n + 4)  # about 2k + 4 strides of the vocabulary reach it
    threshold = np.partition(sample, m - rank)[m - rank]
    near = np.flatnonzero(scores >= threshold)
    if len(near) >= k:
        return near if len(near) == k else near[np.argpartition(scores[near], -k)[-k:]]
    return np.argpartition(scores, -k)[-k:]


class Candidates:
    """Scratch room for resampling (one per engine, scheduler thread only): a llama_token_data
    array the size of the vocabulary, written through a numpy view."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.buffer: Any = (llama.llama_token_data * n_vocab)()
        self.view: Any = np.ctypeslib.as_array(self.buffer)
        self.all_tokens = np.arange(n_vocab, dtype=np.int32)


class SlotSampler:
    """One sequence's sampling state: its chain and, with a grammar, the grammar's own sampler."""

    __slots__ = (
        "_bias",
        "_candidates",
        "_check",
        "_fast",
        "chain",
        "grammar",
        "history",
        "penalties",
    )

    def __init__(
        self, sp: SamplingParams, vocab: Any, candidates: Candidates, grammar: CompiledGrammar | None = None
    ) -> None:
        """Build the chain around the request's grammar, compiled beforehand (see Engine.submit)."""
        self._candidates = candidates
        self._bias: Any = None  # token ids and biases, for ranking as the chain will
        if sp.logit_bias:
            ids, values = zip(*merged_bias(sp.logit_bias), strict=True)
            self._bias = (np.asarray(ids, dtype=np.intp), np.asarray(values, dtype=np.float32))
        self._fast = fast_mode(sp)
        self.grammar: Any = None
        if grammar is not None:
            self.grammar = grammar.take()
        elif sp.grammar is not None:  # pragma: no cover - Engine.submit compiles every grammar
            self.grammar = compile_grammar(vocab, sp.grammar)[0].take()
        self.chain, penalties = make_chain(sp, candidates.n_vocab)
        self._check: Any = None
        # On a grammar miss the chain has already accepted the rejected pick into its
        # penalties; they are rebuilt from `history`, the last penalty_last_n tokens really
        # generated (only kept when both a grammar and penalties are in play).
        self.penalties: Any = None
        self.history: deque[int] | None = None
        if self.grammar:
            self._check = (llama.llama_token_data * 1)()
            if penalties:
                self.penalties = penalties
                self.history = deque(maxlen=max(0, sp.penalty_last_n))

    def free(self) -> None:
        """Free the native samplers (the chain owns its members; the grammar is separate)."""
        llama.llama_sampler_free(self.chain)
        if self.grammar:
            llama.llama_sampler_free(self.grammar)
            self.grammar = None

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits at `index` of the last batch; -1 when no token of
        the vocabulary can continue the grammar (the caller ends the reply)."""
        if self._fast:
            token = self._sample_fast(ctx, index)
        else:
            token = int(llama.llama_sampler_sample(self.chain, ctx, index))  # accepts it too
        if not self.grammar:
            return token
        check = self._check
        check[0].id, check[0].logit, check[0].p = token, 0.0, 0.0
        array = llama.llama_token_data_array(check, 1, -1, False)
        llama.llama_sampler_apply(self.grammar, ctypes.byref(array))
        if math.isinf(check[0].logit):
            logits = np.ctypeslib.as_array(
                llama.llama_get_logits_ith(ctx, index), shape=(self._candidates.n_vocab,)
            )
            token = self._resample_best(logits)
            if token < 0:
                # Nothing likely fits: the grammar filters the whole vocabulary.
                token = self._draw_valid(self._candidates.all_tokens, logits)
                if token < 0:
                    # Accepting a token the grammar refuses aborts the process inside
                    # llama.cpp: the reply ends instead.
                    return -1
            if self.penalties:
                # The chain accepted its rejected pick; its penalties must count this token.
                llama.llama_sampler_reset(self.penalties)
                for past in self.history or ():
                    llama.llama_sampler_accept(self.penalties, past)
                llama.llama_sampler_accept(self.penalties, token)
        if self.history is not None:
            self.history.append(token)
        llama.llama_sampler_accept(self.grammar, token)
        return token

    def _scores(self, logits: Any) -> Any:
        """The logits as the chain ranks them: with the request's logit_bias added."""
        if self._bias is None:
            return logits
        scores = logits.copy()
        scores[self._bias[0]] += self._bias[1]  # one entry per token (merged_bias)
        return scores

    def _sample_fast(self, ctx: Any, index: int) -> int:
        """What llama_sampler_sample picks, with the chain given the top_k likeliest tokens only
        (see the module's docs); accepted into the chain as it would be."""
        n_vocab = self._candidates.n_vocab
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
        scores = self._scores(logits)
        if self._fast == _GREEDY:
            token = int(np.argmax(scores))  # the first largest, as llama.cpp's greedy sampler
        else:
            tokens = _best(scores, self._fast)
            n = len(tokens)
            view = self._candidates.view
            view["id"][:n] = tokens
            view["logit"][:n] = logits[tokens]  # the chain adds the bias itself
            view["p"][:n] = 0.0
            array = llama.llama_token_data_array(self._candidates.buffer, n, -1, False)
            llama.llama_sampler_apply(self.chain, ctypes.byref(array))
            if 0 <= array.selected < array.size:
                token = int(array.data[array.selected].id)
            else:  # pragma: no cover - a chain that draws nothing (llama_sampler_sample aborts)
                token = int(tokens[np.argmax(scores[tokens])])
        llama.llama_sampler_accept(self.chain, token)
        return token

    def _resample_best(self, logits: Any) -> int:
        """Sample among the likeliest candidates the grammar allows; -1 when none of them fits.

        The request's chain keeps top_k (40) tokens anyway, and any valid token outside a
        tier ranks below every valid one inside it, so drawing from the valid tokens among
        the likeliest few thousand follows the same sampler as the whole vocabulary would
        (greedy exactly). Walking the whole vocabulary with the grammar costs tens of
        milliseconds on a 262k vocabulary; a tier of 4,096 costs about a millisecond.
        """
        n_vocab = self._candidates.n_vocab
        # Ranked as the chain will see them: with the request's logit_bias added (the chain
        # adds it itself, so the candidates carry the model's own logits).
        scores = self._scores(logits)
        tried = 0
        for k in (min(k, n_vocab) for k in RESAMPLE_TIERS):
            if k <= tried:
                continue
            token = self._draw_valid(_best(scores, k), logits)
            if token >= 0:
                return token
            tried = k
        return -1

    def _draw_valid(self, tokens: Any, logits: Any) -> int:
        """Apply the grammar, then the request's chain, to `tokens`; -1 when none is valid."""
        n = len(tokens)
        view = self._candidates.view
        view["id"][:n] = tokens
        view["logit"][:n] = logits[tokens]
        view["p"][:n] = 0.0
        array = llama.llama_token_data_array(self._candidates.buffer, n, -1, False)
        llama.llama_sampler_apply(self.grammar, ctypes.byref(array))
        if np.isneginf(view["logit"][:n]).all():
            return -1
        # The request's own samplers (penalties, top-k/p, temperature, draw) pick among them.
        llama.llama_sampler_apply(self.chain, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            return -1
        chosen = array.data[array.selected]
        return -1 if math.isinf(chosen.logit) else int(chosen.id)
