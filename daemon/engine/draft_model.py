"""Speculative decoding with a draft model: a smaller model of the same vocabulary drafts for the served one.

The draft model has a context of its own with one sequence per slot of the engine it drafts
for, and runs on that engine's thread (every native call of a model happens on its one
thread: see `Engine`). Each step, for the sequences that draft, it brings each sequence's KV
cache up to date with the sequence's tokens (the common prefix kept, the rest removed, the
missing tokens decoded for all sequences together), then drafts greedily: one llama_decode
per draft position with every drafting sequence in the same batch, until a sequence's draft
is as long as it may be or the draft model's best token is less likely than `draft_p_min`
(llama.cpp's `--draft-p-min`). The engine checks the drafts with each request's own sampler
in its next batch, so the reply is exactly plain decoding's whatever the draft proposes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

import llama_cpp as llama
import numpy as np

from edgellmd.engine.config import EngineConfig, EngineError, ModelLoadError
from edgellmd.engine.drafts import ModelDrafter, Speculation, common_prefix
from edgellmd.engine.native import Item, NativeThread, context_params, decode_bos, fill_batch, keep_prefix

log = logging.getLogger(__name__)

# Token texts compared between the two vocabularies: all of them up to this many, else this
# many spread evenly over the ids. llama.cpp compares every one (common_speculative_are_compatible);
# a sample finds a different tokenizer as surely, without a million calls for a big vocabulary.
_TEXT_SAMPLE: Final = 4096
_FIRST_TEXT_CHECKED: Final = 5  # as llama.cpp: the first ids are special tokens, compared by role below


def _sample_ids(n_vocab: int) -> range | list[int]:
    if n_vocab - _FIRST_TEXT_CHECKED <= _TEXT_SAMPLE:
        return range(_FIRST_TEXT_CHECKED, n_vocab)
    step = (n_vocab - _FIRST_TEXT_CHECKED) / _TEXT_SAMPLE
    return sorted({_FIRST_TEXT_CHECKED + int(k * step) for k in range(_TEXT_SAMPLE)} | {n_vocab - 1})


def incompatibility(target: Any, draft: Any) -> str | None:
    """Why a draft vocabulary cannot draft for the target's (llama.cpp's own checks), or None.

    The sizes must be equal, not merely close as llama.cpp allows: a draft token id the
    target does not have would reach its batch.
    """
    n_target, n_draft = llama.llama_vocab_n_tokens(target), llama.llama_vocab_n_tokens(draft)
    if n_target != n_draft:
        return f"its vocabulary has {n_draft} tokens and the model's {n_target}: a draft must share it"
    kinds = llama.llama_vocab_type(target), llama.llama_vocab_type(draft)
    if kinds[0] != kinds[1]:
        return f"its tokenizer is of type {kinds[1]} and the model's of type {kinds[0]}"
    for role, token, adds in (
        ("BOS", llama.llama_vocab_bos, llama.llama_vocab_get_add_bos),
        ("EOS", llama.llama_vocab_eos, llama.llama_vocab_get_add_eos),
    ):
        ours = token(draft), bool(adds(draft))
        theirs = token(target), bool(adds(target))
        if ours != theirs:
            return (
                f"its {role} token is {ours[0]} (added to prompts: {ours[1]}) and the model's "
                f"{theirs[0]} (added: {theirs[1]})"
            )
    for token_id in _sample_ids(n_target):
        if llama.llama_vocab_get_text(target, token_id) != llama.llama_vocab_get_text(draft, token_id):
            return f"the text of token {token_id} differs from the model's: not the same vocabulary"
    return None


class DraftModel(NativeThread):
    """A draft model and its context, run by the thread of the engine it drafts for.

    A NativeThread that starts no thread of its own: the base's file checks, model loading
    and freeing are the same, and the owning engine's thread calls `open`, `warm_up`,
    `propose` and `free`.
    """

    def __init__(self, config: EngineConfig, target: Any, name: str) -> None:
        spec = config.speculative
        if spec.draft_path is None:
            raise ModelLoadError(f"model {name}: speculative mode draft needs a draft model file")
        self.spec: Final = spec
        self.label: Final = f"draft model {spec.draft_name or spec.draft_path.name}"
        # Offloaded whole where the model itself is: a model that does not fit the GPU whole
        # leaves no room there for a draft, which then runs on the CPU.
        n_layer = llama.llama_model_n_layer(target)
        on_gpu = config.gpu_layers < 0 or config.gpu_layers > n_layer
        own = replace(
            config,
            path=spec.draft_path,
            mmap=spec.draft_mmap,
            gpu_layers=-1 if on_gpu else 0,
            # llama.cpp's defaults for a draft's KV cache (llama-server's --cache-type-k-draft).
            cache_type_k="f16",
            cache_type_v="f16",
            flash_attention="auto",
            prompt_cache_bytes=0,
            speculative=Speculation(),
        )
        try:
            super().__init__(own, f"{name}:draft")
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.label}: {exc}") from None
        self._target = target
        self._slots = config.slots
        # The catch-up of a sequence's prompt goes in chunks of the engine's batch; a draft
        # position holds one token per drafting sequence.
        self._batch_size = max(config.batch_size, config.slots)
        # The tokens each sequence holds in the draft model's KV cache, position by position.
        self._kv: list[list[int]] = [[] for _ in range(config.slots)]
        self._n_swa = 0
        self._memory: Any = None

    @classmethod
    def open(cls, config: EngineConfig, target: Any, name: str) -> DraftModel:
        """Load the draft model and its context for `target` (on the engine's thread); ModelLoadError."""
        draft = cls(config, target, name)
        try:
            draft._load()
        except EngineError as exc:
            draft._free_native()
            raise ModelLoadError(f"{draft.label}: {exc}") from None
        except BaseException:
            draft._free_native()
            raise
        return draft

    def _load(self) -> None:
        config = self.config
        self._load_model()
        model = self._model
        if llama.llama_model_has_encoder(model) and not llama.llama_model_has_decoder(model):
            raise ModelLoadError("an encoder-only model generates no text to draft")
        problem = incompatibility(llama.llama_model_get_vocab(self._target), self._vocab)
        if problem is not None:
            raise ModelLoadError(f"cannot draft for this model: {problem}")
        if llama.llama_model_n_params(model) >= llama.llama_model_n_params(self._target):
            log.warning(
                "%s is not smaller than the model it drafts for: each draft token costs as much as "
                "the model's own, and drafting only slows generation down",
                self.label,
            )
        self._n_swa = max(0, llama.llama_model_n_swa(model))
        # Its config says f16 keys and values and flash attention auto (see __init__).
        cparams = context_params(config, self._batch_size)
        ctx = llama.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError("llama.cpp could not create a context for it")
        self._ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        self._batch = llama.llama_batch_init(self._batch_size, 0, config.slots)

    def warm_up(self) -> None:
        """One decode, so that compute buffers exist before the first draft."""
        self._warm_up()

    def _warm_up(self) -> None:
        if not decode_bos(self._ctx, self._batch, self._vocab):
            raise ModelLoadError(f"{self.label}: warm-up decode failed")
        llama.llama_memory_clear(self._memory, True)

    def _run(self) -> None:  # pragma: no cover - never started: the engine's thread runs it
        raise EngineError("a draft model has no thread of its own")

    def _release(self, error: str) -> None:  # pragma: no cover - see _run
        del error
        self._free_native()

    def free(self) -> None:
        """Free the context and the model (on the engine's thread; idempotent)."""
        self._free_native()

    # ---- drafting ---------------------------------------------------------------------------

    def propose(self, jobs: Sequence[tuple[int, ModelDrafter, int]]) -> None:
        """Draft for each (sequence, drafter, most tokens) at once, into each drafter's `proposed`."""
        wanted: dict[int, tuple[ModelDrafter, int]] = {}
        items: list[Item] = []  # (token, position, sequence, logits)
        for seq, drafter, limit in jobs:
            drafter.proposed = []
            tokens = drafter.tokens
            n = min(limit, drafter.draft_len)
            if n <= 0 or not tokens:
                continue
            # The last token is decoded in any case: its logits give the first draft token.
            keep = self._reuse(seq, tokens)
            last = len(tokens) - 1
            items.extend((tokens[p], p, seq, p == last) for p in range(keep, len(tokens)))
            wanted[seq] = (drafter, n)
        heads: dict[int, int] = {}  # sequence -> its newest draft token, decoded next
        for start in range(0, len(items), self._batch_size):
            chunk = items[start : start + self._batch_size]
            if not self._decode(chunk):
                return
            for j, (_, _, seq, out) in enumerate(chunk):
                if out:
                    self._take(seq, j, wanted, heads)
        while heads:  # one position of every sequence still drafting per decode
            chunk = [(token, len(self._kv[seq]), seq, True) for seq, token in heads.items()]
            heads = {}
            if not self._decode(chunk):
                return
            for j, (_, _, seq, _) in enumerate(chunk):
                self._take(seq, j, wanted, heads)

    def forget(self, seq: int) -> None:
        """Drop what the draft context holds of sequence `seq` (its slot now serves another scope)."""
        llama.llama_memory_seq_rm(self._memory, seq, -1, -1)
        self._kv[seq].clear()

    def _reuse(self, seq: int, tokens: Sequence[int]) -> int:
        """Keep the sequence's cached prefix of `tokens` (all but the last), drop the rest; its length."""
        kv = self._kv[seq]
        keep = min(common_prefix(kv, tokens), len(tokens) - 1)
        if keep < len(kv):  # as the engine's own slots (_assign)
            keep = keep_prefix(self._memory, seq, keep, self._n_swa)
            del kv[keep:]
        return keep

    def _decode(self, items: Sequence[Item]) -> bool:
        """Decode `items` into the draft context; False (and those sequences forgotten) if it fails."""
        fill_batch(self._batch, items)
        rc = llama.llama_decode(self._ctx, self._batch)
        if rc != 0:
            log.warning("%s: llama_decode failed with status %d; no drafts this step", self.label, rc)
            for seq in {it[2] for it in items}:
                llama.llama_memory_seq_rm(self._memory, seq, -1, -1)
                self._kv[seq].clear()
            return False
        for token, _, seq, _ in items:  # in position order within each sequence
            self._kv[seq].append(token)
        return True

    def _take(
        self, seq: int, index: int, wanted: dict[int, tuple[ModelDrafter, int]], heads: dict[int, int]
    ) -> None:
        """The draft model's best next token for `seq` at batch `index`: drafted, unless unsure."""
        drafter, n = wanted[seq]
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))
        best = int(np.argmax(logits))
        p = 1.0 / float(np.exp(logits - logits[best]).sum())  # its softmax probability
        if not p >= self.spec.draft_p_min:  # unsure (or NaN): this sequence's draft ends here
            return
        drafter.proposed.append(best)
        if len(drafter.proposed) < n:
            heads[seq] = best
