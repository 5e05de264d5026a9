"""The memory budget: which idle, evictable models to unload so that another one fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from edgellmd.engine.config import KV_BYTES_PER_VALUE, MEDIA_STORE_BYTES
from edgellmd.models.gguf import GgufError, read_gguf_values, tensor_infos
from edgellmd.settings import ModelSettings

MIB: Final = 1024 * 1024
TOKEN_EMBEDDINGS: Final = b"token_embd.weight"  # llama.cpp's name for the vocabulary's table


@dataclass(frozen=True, slots=True)
class Resident:
    """A loaded model as the budget sees it."""

    name: str
    memory_bytes: int  # estimated: weights plus KV cache
    evictable: bool  # configured evictable, and idle now: no lease, nothing running or waiting
    last_used: float  # monotonic


class OverBudget(Exception):
    """Nothing evictable can make room; the message is the reason operators see."""


def evictions(budget_mb: int, model: str, need: int, resident: Sequence[Resident]) -> list[str]:
    """The models to unload (least recently used first) so that `model` (`need` bytes) fits.

    `resident` are the other loaded models; the one being replaced is not counted (its old
    copy is freed once its requests end). Raises OverBudget when even evicting every idle
    evictable model is not enough.
    """
    budget = budget_mb * MIB
    used = sum(r.memory_bytes for r in resident)
    out: list[str] = []
    for candidate in sorted((r for r in resident if r.evictable), key=lambda r: r.last_used):
        if used + need <= budget:
            break
        used -= candidate.memory_bytes
        out.append(candidate.name)
    if used + need > budget:
        raise OverBudget(
            f"memory budget exceeded: {model} needs about {need // MIB} MiB, "
            f"{(budget - used) // MIB} MiB of the {budget_mb} MiB budget is free and no idle "
            "evictable model can make room"
        )
    return out


def estimate_bytes(
    path: Path, settings: ModelSettings, draft: Path | None = None, mmproj: Path | None = None
) -> int:
    """Memory a model will take once loaded: its file, its KV cache, its prompt cache, its draft
    model's file and KV cache, its projector's file and store of encoded media."""
    need = path.stat().st_size + kv_cache_bytes(path, settings) + settings.prompt_cache_mb * MIB
    if settings.pooled:
        need += output_buffer_bytes(path, settings)
    if draft is not None:  # its file and its KV cache (f16, a sequence per slot as the model's)
        need += draft.stat().st_size + kv_cache_bytes(draft, settings, kinds=("f16", "f16"))
    if mmproj is not None:  # its weights, and the encoded images and clips its engine keeps
        need += mmproj.stat().st_size + MEDIA_STORE_BYTES
    return need


def output_buffer_bytes(path: Path, settings: ModelSettings) -> int:
    """An embedding or reranking model's output buffer at its largest: llama.cpp keeps a row of
    logits (a float per vocabulary entry) and an embedding for every token a decode outputs,
    and a pooled model outputs every token, up to its batch (the engine's n_batch: the larger
    of batch_size and context_size). For a chat model's vocabulary served as an embedder
    (262,144 entries) that is 1 GiB at 1,024 tokens: one long input took the engine past a
    memory group sized without it (0 when the file does not say)."""
    try:
        infos, _ = tensor_infos(path)
    except (GgufError, OSError):
        return 0  # the load itself will say what is wrong with the file
    table = next((t for t in infos if t.name == TOKEN_EMBEDDINGS and len(t.dims) == 2), None)
    if table is None:
        return 0
    n_embd, n_vocab = table.dims  # ggml dimensions: (n_embd, n_vocab)
    return max(settings.batch_size, settings.context_size) * (n_vocab + n_embd) * 4


def kv_cache_bytes(path: Path, settings: ModelSettings, *, kinds: tuple[str, str] | None = None) -> int:
    """The KV cache of every slot, in the configured cache types or `kinds` (0 when the file does not say)."""
    try:
        values = read_gguf_values(path)
    except GgufError:
        return 0  # the load itself will say what is wrong with the file
    arch = values.get("general.architecture")
    layers = values.get(f"{arch}.block_count")
    embd = values.get(f"{arch}.embedding_length")
    heads = values.get(f"{arch}.attention.head_count")
    heads_kv = values.get(f"{arch}.attention.head_count_kv", heads)
    if not (
        isinstance(layers, int)
        and isinstance(embd, int)
        and isinstance(heads, int)
        and isinstance(heads_kv, int)
        and min(layers, embd, heads, heads_kv) > 0
    ):
        return 0
    values_per_side = layers * settings.context_size * settings.slots * (embd // heads) * heads_kv
    type_k, type_v = kinds or (settings.cache_type_k, settings.cache_type_v)
    per_value = KV_BYTES_PER_VALUE[type_k] + KV_BYTES_PER_VALUE[type_v]
    return int(values_per_side * per_value)
