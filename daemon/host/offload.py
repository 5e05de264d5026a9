"""Sizing a partial GPU offload for `gpu_layers: auto` from free VRAM and the model's layer sizes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgellmd.host.gpu import GpuSnapshot


def auto_gpu_layers(
    *, free_bytes: int, headroom_bytes: int, layer_bytes: Sequence[int], other_bytes: int, n_layers: int
) -> int:
    """How many layers `gpu_layers: auto` offloads: -1 (all plus output), or 0..n_layers-1.

    Rule: budget = free_bytes - headroom_bytes. Layer i weighs layer_bytes[i] (only the first
    n_layers entries count; missing ones weigh as much as the largest given). If every layer
    plus other_bytes fits the budget, -1. Otherwise llama.cpp offloads the *last* k layers, so
    k is the largest count whose last k layers plus other_bytes still fit; other_bytes (output
    and embedding tensors, compute buffers, the KV cache share: the caller decides) is charged
    in full for any k > 0, which is conservative. The result is 0 when not even one layer fits.
    """
    if min(free_bytes, headroom_bytes, other_bytes, n_layers) < 0 or any(b < 0 for b in layer_bytes):
        raise ValueError("sizes and n_layers must be >= 0")
    if n_layers > 0 and not layer_bytes:
        raise ValueError("layer_bytes is empty but n_layers is not 0")
    sizes = list(layer_bytes[:n_layers])
    sizes += [max(layer_bytes, default=0)] * (n_layers - len(sizes))
    budget = free_bytes - headroom_bytes
    if sum(sizes) + other_bytes <= budget:
        return -1
    used, k = other_bytes, 0
    for size in reversed(sizes):
        if used + size > budget:
            break
        used += size
        k += 1
    return k


def plan_gpu_layers(
    sizes: Callable[[], tuple[list[int], int]],
    *,
    snapshot: GpuSnapshot | None,
    offload_supported: bool,
    headroom_bytes: int,
    kv_bytes: int,
) -> tuple[int, str]:
    """`gpu_layers: auto` for one model: the layer count and a sentence saying why.

    `sizes` gives the bytes of each layer and of all other tensors (models.gguf reads them
    from the file's header; ValueError or OSError when it cannot). Free memory is summed over
    the GPUs that answer (llama.cpp splits layers across them); each layer also carries its
    share of the KV cache (`kv_bytes` for the whole model).
    """
    if not offload_supported:
        return 0, "this llama.cpp build cannot offload (CPU-only build)"
    devices = [d for d in snapshot.devices if not d.lost] if snapshot and snapshot.available else []
    if not devices:
        reason = snapshot.reason if snapshot and snapshot.reason else "no GPU answers NVML"
        return 0, f"no usable GPU ({reason})"
    free = sum(d.memory_free or 0 for d in devices)
    try:
        layers, other = sizes()
    except (OSError, ValueError) as exc:
        return 0, f"cannot size the model's layers: {exc}"
    n = len(layers)
    share = kv_bytes // n if n else 0
    count = auto_gpu_layers(
        free_bytes=free,
        headroom_bytes=headroom_bytes,
        layer_bytes=[b + share for b in layers],
        other_bytes=other,
        n_layers=n,
    )
    shown = "all" if count == -1 else f"{count} of {n}"
    return count, (
        f"{shown} layers fit in {free / 2**30:.1f} GiB free VRAM less "
        f"{headroom_bytes / 2**30:.1f} GiB headroom"
    )


# ggml types: (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES (checked by a test).
