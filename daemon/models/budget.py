"""The memory budget: which idle, evictable models to unload so that another one fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

MIB: Final = 1024 * 1024


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
