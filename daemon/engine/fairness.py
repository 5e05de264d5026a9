"""Fair share between tenants: who gets the next free slot, who prefills first, whom to pause.

Plain Python, used under the scheduler's lock; it never touches llama.cpp.

Every tenant (an API key: `GenerationRequest.tenant`) has a virtual time, the tokens the
engine has computed for it (prompt and generated alike) divided by its weight. The tenant
with the least virtual time goes first: its waiting request takes the next free slot, and
its prompt chunk takes the step's prefill budget before the others'. This is the virtual
token counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). A
tenant that had nothing waiting or running starts again at the least virtual time of those
that do, so idleness banks no credit and a newcomer is not punished for the others' past;
or at its own, where that is more (the paper's lift): a tenant that sends its requests one
after another is idle between each, and starting again at the least each time, every
request of its counted as a newcomer's, which the scheduler lets stop a step in progress
and go alone ahead of the decodes: a key sending one-token requests back to back cut
another key's stream to 0.15x its rate. What it is ahead by is kept up to `IDLE_LEAD`
tokens (a short prompt's worth: enough that a drizzle of short requests does not come back
level) and for `IDLE_KEEP_S` seconds: a key whose lead was earned on spare capacity (long
prompts while the box was quiet), kept whole, waited 20 s for a one-line request behind
every key that came since. It is forgotten once nothing at all waits or runs (no one is
left to be ahead of), and when `IDLE_KEPT` tenants are kept.

Priorities come first: a request of a higher class is taken before any of a lower one, and
fairness orders tenants within a class. A key's class is its ceiling; a request may ask for
less (OpenAI's `service_tier: flex`), never more.

When every slot is busy and a tenant holding fewer slots than its share waits behind one
holding more, or a request of a higher class waits behind a lower one, a running sequence is
paused (`victim`): its KV state goes to host memory, its slot to the waiting request, and it
resumes in a later free slot where it left off, its client seeing only a pause. A sequence
runs at least `QUANTUM_S` between pauses, so two tenants cannot take a slot back and forth
at every step.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from edgellmd.keys import MAX_WEIGHT, PRIORITIES

# Request classes (keys.PRIORITIES: the keys file names them), by number; higher goes first.
PRIORITY_NAMES: Final = {v: k for k, v in PRIORITIES.items()}
QUANTUM_S: Final = 0.25  # a sequence runs at least this long between pauses
# Idle tenants whose virtual time is kept (above the least active one's); past this, those
# least ahead are forgotten first.
IDLE_KEPT: Final = 1024
IDLE_LEAD: Final = 64.0  # the most an idle tenant is kept ahead of the least active, in tokens
IDLE_KEEP_S: Final = 2.0  # how long an idle tenant's lead is kept

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Share:
    """Whose a request is, for fairness: its tenant, weight and class."""

    tenant: str = ""
    weight: int = 1
    priority: int = 0


class FairQueue(Generic[T]):
    """Waiting entries, taken in priority then weighted fair order; FIFO within a tenant.

    `share_of` tells an entry's `Share`. An entry keeps its arrival number until it is
    done: a paused sequence put back is ahead of its tenant's later arrivals. The scheduler
    tells the queue which entries hold slots (`started`, `stopped`), since fairness between
    the waiting depends on who runs.
    """

    def __init__(self, share_of: Callable[[T], Share], clock: Callable[[], float] = time.monotonic) -> None:
        self._share_of = share_of
        self._clock = clock
        self._waiting: dict[str, list[tuple[int, int, T]]] = {}  # tenant -> (-priority, arrival, entry)
        self._arrival: dict[int, int] = {}  # id(entry) -> arrival number, while it waits or runs
        self._numbers = itertools.count()
        self.vtime: dict[str, float] = {}  # tenants waiting or running only
        # The virtual time idle tenants left at, capped (see _activate), and when they left.
        self._idle: dict[str, tuple[float, float]] = {}
        self.running: Counter[str] = Counter()  # slots held, by tenant
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        """The waiting entries in arrival order."""
        every = [item for items in self._waiting.values() for item in items]
        return iter([entry for _, _, entry in sorted(every, key=lambda item: item[1])])

    def _activate(self, tenant: str) -> None:
        """`tenant` has work again: at the least virtual time of those with work, or at its own
        where that is more (module docstring)."""
        if tenant in self.vtime:
            return
        active = [v for t, v in self.vtime.items() if self.running[t] or self._waiting.get(t)]
        if not active:  # nothing waits or runs: nobody to be ahead of
            self._idle.clear()
            self.vtime[tenant] = 0.0
            return
        least = min(active)
        kept, left_at = self._idle.pop(tenant, (least, 0.0))
        fresh = self._clock() - left_at <= IDLE_KEEP_S
        self.vtime[tenant] = max(least, kept) if fresh else least

    def _retire(self, tenant: str) -> None:
        if not self.running[tenant] and not self._waiting.get(tenant):
            left = self.vtime.pop(tenant, None)
            self.running.pop(tenant, None)
            self._waiting.pop(tenant, None)
            if left is not None:
                self._keep_idle(tenant, left)

    def _keep_idle(self, tenant: str, vtime: float) -> None:
        if not self.vtime:
            self._idle.clear()
            return
        least = min(self.vtime.values())
        if vtime > least:
            self._idle[tenant] = (min(vtime, least + IDLE_LEAD), self._clock())
        if len(self._idle) > IDLE_KEPT:  # those at or below the least start there anyway
            kept = sorted(self._idle.items(), key=lambda item: item[1][0], reverse=True)[: IDLE_KEPT // 2]
            self._idle = {t: v for t, v in kept if v[0] > least}

    def ahead(self, share: Share, others: Iterable[Share]) -> bool:
        """Whether `share`'s tenant has been computed for more than another tenant of `others`
        of its class or a higher one (by virtual time): it has had more than its turn."""
        mine = self.vtime.get(share.tenant)
        if mine is None:
            return False
        return any(
            other.tenant != share.tenant
            and other.priority >= share.priority
            and self.vtime.get(other.tenant, mine) < mine
            for other in others
        )

    def append(self, entry: T) -> None:
        """Queue `entry` (a paused one keeps its place among its tenant's)."""
        share = self._share_of(entry)
        self._activate(share.tenant)
        number = self._arrival.setdefault(id(entry), next(self._numbers))
        bisect.insort(
            self._waiting.setdefault(share.tenant, []), (-share.priority, number, entry), key=_order
        )
        self._size += 1

    def _head(self, tenant: str) -> tuple[int, int, T]:
        return self._waiting[tenant][0]

    def _rank(self, tenant: str) -> tuple[int, float, int, int]:
        priority, number, _ = self._head(tenant)
        return (priority, self.vtime[tenant], self.running[tenant], number)

    def peek(self) -> T | None:
        """The entry that would be taken next, or None."""
        tenants = [t for t, items in self._waiting.items() if items]
        if not tenants:
            return None
        return self._head(min(tenants, key=self._rank))[2]

    def pop(self) -> T:
        """Take the next entry (IndexError when none waits)."""
        entry = self.peek()
        if entry is None:
            raise IndexError("no entry waits")
        self.remove(entry)
        return entry

    def remove(self, entry: T) -> None:
        """Take `entry` out of the queue (ValueError when it does not wait)."""
        tenant = self._share_of(entry).tenant
        items = self._waiting.get(tenant, [])
        for k, (_, _, other) in enumerate(items):
            if other is entry:
                del items[k]
                self._size -= 1
                return
        raise ValueError("entry does not wait")

    def started(self, entry: T) -> None:
        """`entry` holds a slot now (taken from the queue, or put in a slot directly)."""
        tenant = self._share_of(entry).tenant
        self._activate(tenant)
        self._arrival.setdefault(id(entry), next(self._numbers))
        self.running[tenant] += 1

    def stopped(self, entry: T, *, done: bool) -> None:
        """`entry` left its slot: `done`, or paused (to be appended again)."""
        tenant = self._share_of(entry).tenant
        self.running[tenant] -= 1
        if done:
            self._arrival.pop(id(entry), None)
        self._retire(tenant)

    def dropped(self, entry: T) -> None:
        """`entry` left the queue for good (cancelled, or the engine stops)."""
        self._arrival.pop(id(entry), None)
        self._retire(self._share_of(entry).tenant)

    def charge(self, share: Share, tokens: int) -> None:
        """The engine computed `tokens` for `share`'s tenant."""
        if share.tenant in self.vtime:
            self.vtime[share.tenant] += tokens / share.weight

    def arrival(self, entry: T) -> int:
        """`entry`'s arrival number (earlier arrivals have smaller ones)."""
        return self._arrival.get(id(entry), -1)

    def order(self, limit: int) -> list[T]:
        """The first `limit` waiting entries in the order they would be taken if nothing changed
        meanwhile (each take counts as a slot held by its tenant; no token is charged)."""
        heads = {t: 0 for t, items in self._waiting.items() if items}
        running = Counter(self.running)
        out: list[T] = []
        while heads and len(out) < limit:

            def rank(tenant: str) -> tuple[int, float, int, int]:
                priority, number, _ = self._waiting[tenant][heads[tenant]]
                return (priority, self.vtime.get(tenant, 0.0), running[tenant], number)

            tenant = min(heads, key=rank)
            out.append(self._waiting[tenant][heads[tenant]][2])
            running[tenant] += 1
            heads[tenant] += 1
            if heads[tenant] == len(self._waiting[tenant]):
                del heads[tenant]
        return out

    def held(self) -> Counter[str]:
        """Entries each tenant has in slots or waiting (admission's per-key room)."""
        held = Counter({t: n for t, n in self.running.items() if n > 0})
        for tenant, items in self._waiting.items():
            if items:
                held[tenant] += len(items)
        return held

    def tenants(self) -> dict[str, dict[str, float | int]]:
        """Each active tenant's slots held, entries waiting and virtual time (for /admin/status)."""
        return {
            t: {
                "running": self.running[t],
                "waiting": len(self._waiting.get(t, [])),
                "vtime": round(v, 1),
            }
            for t, v in sorted(self.vtime.items())
        }


def _order(item: tuple[int, int, object]) -> tuple[int, int]:
    return item[0], item[1]


@dataclass(frozen=True, slots=True)
class Running:
    """A busy slot, as `victim` weighs it."""

    index: int
    share: Share
    held_s: float  # since it took (or last resumed in) its slot
    cells: int  # KV cells it holds: what pausing it copies


def victim(
    waiting: Share, running: Sequence[Running], held: Counter[str], tenants: int, n_slots: int
) -> int | None:
    """The slot to pause for `waiting`, or None when every slot should keep running.

    A slot of a lower class; else, when the waiting tenant holds fewer slots than its share
    (the slots divided by the tenants waiting or running), a slot of a tenant holding more
    than its share. Only slots that ran `QUANTUM_S`; among those the lowest class, the
    tenant holding most, then the one whose KV state is cheapest to copy.
    """
    fair = max(1, n_slots // max(1, tenants))
    below = held[waiting.tenant] < fair

    def eligible(r: Running) -> bool:
        if r.held_s < QUANTUM_S or r.share.tenant == waiting.tenant:
            return False
        if r.share.priority < waiting.priority:
            return True
        return r.share.priority == waiting.priority and below and held[r.share.tenant] > fair

    candidates = [r for r in running if eligible(r)]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.share.priority, -held[r.share.tenant], r.cells, r.index)).index


__all__ = [
    "IDLE_KEEP_S",
    "IDLE_KEPT",
    "IDLE_LEAD",
    "MAX_WEIGHT",
    "PRIORITIES",
    "PRIORITY_NAMES",
    "QUANTUM_S",
    "FairQueue",
    "Running",
    "Share",
    "victim",
]
