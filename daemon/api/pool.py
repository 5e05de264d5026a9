"""The prompt pools shared fairly between keys: one key's parsing, rendering and tokenizing queue
behind each other, not in front of everyone.

Schemas, grammars, chat templates and tokenization run on small thread pools off the event
loop: request bodies are parsed on the daemon's one, and each model has its own for what its
engine does (templates, tokens, grammars: `http.app._prompt_pool`), so that a model whose
engine stopped holds only its own threads while the hang is found. Without care a key that
sends four expensive requests at once (hundreds of tools with pattern properties) holds every
thread for seconds and another key's one-token chat waits behind them. `FairPool` is a pool's
front: each job belongs to the key whose request submitted it (`POOL_TENANT`, set by the front
door for the request's task), a key runs at most `per_key` jobs at a time, and a free thread
takes the next job round robin among the keys that have one waiting. A key alone on the box
still has `per_key` threads; with the default two threads and `per_key` 1, another key always
finds one free or next.
"""

from __future__ import annotations

import contextvars
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Final, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# The key a request's pool work is done for; "" (one shared tenant) outside authenticated requests.
POOL_TENANT: Final[contextvars.ContextVar[str]] = contextvars.ContextVar("pool_tenant", default="")


def started(pool: ThreadPoolExecutor, workers: int) -> ThreadPoolExecutor:
    """`pool` with all its `workers` threads running now: a ThreadPoolExecutor starts one only
    when a job finds none idle, so a second thread could appear hours in, at the first two jobs
    that overlap (a soak sees the daemon's threads grow)."""
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait) for _ in range(workers)]:
        future.result()
    return pool


class FairPool(Executor):
    """A thread pool whose jobs run at most `per_key` at a time per tenant, tenants round robin."""

    def __init__(self, workers: int, *, per_key: int | None = None, name: str = "prompt") -> None:
        self.workers = workers
        self.per_key = max(1, workers - 1) if per_key is None else per_key
        self._inner = started(ThreadPoolExecutor(workers, thread_name_prefix=name), workers)
        self._lock = threading.Condition()
        # Tenants with waiting jobs, in the order they get their next turn.
        self._waiting: OrderedDict[str, deque[tuple[Future[Any], Callable[[], Any]]]] = OrderedDict()
        self._running: dict[str, int] = {}
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue `fn` for the current tenant (`POOL_TENANT`); it runs when a thread and its share allow."""
        tenant = POOL_TENANT.get()
        future: Future[T] = Future()
        context = contextvars.copy_context()
        job: Callable[[], T] = lambda: context.run(fn, *args, **kwargs)  # noqa: E731
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.setdefault(tenant, deque()).append((future, job))
            self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Under the lock: start waiting jobs while threads are free, each tenant within its share."""
        while sum(self._running.values()) < self.workers:
            tenant = next((t for t in self._waiting if self._running.get(t, 0) < self.per_key), None)
            if tenant is None:
                return
            jobs = self._waiting.pop(tenant)
            future, job = jobs.popleft()
            if jobs:  # its next job waits behind every other tenant's
                self._waiting[tenant] = jobs
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited (its client left)
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._inner.submit(self._run, tenant, future, job)

    def _run(self, tenant: str, future: Future[Any], job: Callable[[], Any]) -> None:
        try:
            result = job()
        except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            with self._lock:
                left = self._running[tenant] - 1
                if left:
                    self._running[tenant] = left
                else:
                    del self._running[tenant]
                self._dispatch()  # after shutdown too: jobs already queued still run unless cancelled
                self._lock.notify_all()

    def waiting(self) -> dict[str, int]:
        """Jobs waiting per tenant (for diagnostics and tests)."""
        with self._lock:
            return {tenant: len(jobs) for tenant, jobs in self._waiting.items()}

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking jobs; waiting ones are cancelled when `cancel_futures`, else they still run."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                for jobs in self._waiting.values():
                    for future, _ in jobs:
                        future.cancel()
                self._waiting.clear()
            elif wait:
                self._lock.wait_for(lambda: not self._waiting)
        self._inner.shutdown(wait=wait)
