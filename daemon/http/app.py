"""The application factory: routes, middlewares in order, and one cleanup context per resource."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from edgellmd import __version__
from edgellmd.api.admin import setup_admin
from edgellmd.api.anthropic.routes import setup_anthropic
from edgellmd.api.context import (
    API_CONTEXT,
    ARRIVED,
    DRAINING,
    ERROR_SHAPES,
    LEDGER,
    LIMITS,
    QUEUE_WAITS,
    TRACE,
    USAGE_ID,
    USER_TAG,
    ApiContext,
    ErrorShapes,
)
from edgellmd.api.health import setup_health
from edgellmd.api.openai.routes import setup_openai
from edgellmd.api.pool import FairPool, started
from edgellmd.api.rerank import setup_rerank
from edgellmd.api.responses.routes import setup_responses
from edgellmd.api.session import in_flight
from edgellmd.engine.build import supports_gpu_offload
from edgellmd.engine.generation import Running
from edgellmd.host.cpu import Pinning
from edgellmd.host.metrics import Metrics
from edgellmd.host.nvml import GpuMonitor
from edgellmd.host.systemd import Notifier, Supervisor
from edgellmd.host.traces import RequestTrace, Tracer, TraceSettings
from edgellmd.host.verdicts import largest_gpu_layers
from edgellmd.http import appkeys, logs
from edgellmd.http.auth import is_inference, setup_admin_networks, setup_auth, unusable
from edgellmd.http.console.door import setup_console
from edgellmd.http.cors import setup_cors
from edgellmd.http.errors import Handler, error_middleware
from edgellmd.http.ledger import setup_ledger
from edgellmd.http.site import DoorLimits, GuardedSite, refuse_unmet_expectations
from edgellmd.models.gguf import GgufError, read_gguf_facts
from edgellmd.models.handle import EngineFactory, default_engine_factory
from edgellmd.models.lockfile import LockError, load_lock
from edgellmd.models.registry import Registry
from edgellmd.models.watch import ModelWatcher, watch_targets
from edgellmd.redaction import holds_key
from edgellmd.settings import ServerSettings, Settings

log = logging.getLogger(__name__)
access_log = logging.getLogger("edgellmd.access")

PROMPT_THREADS: Final = 2  # parsing (the daemon's pool), templates, tokens (each model's): off the loop
# HTTP parser limits: an API request has a short request line and a handful of headers.
MAX_LINE_BYTES: Final = 8190  # request line (aiohttp's default, stated here on purpose)
MAX_FIELD_BYTES: Final = 8190  # one header
MAX_HEADERS: Final = 64
# The server's own wait for handlers when it stops (`runner.cleanup()`), after the daemon's drain
# gave every running request `server.shutdown_timeout_s` and its last answer (`__main__.drain`):
# what is left then (a connection lingering over a body it never read) is cut after this long.
# It was `server.shutdown_timeout_s` again: a stop could take twice the deadline.
HANDLERS_AFTER_DRAIN_S: Final = 2.0
_CLIENT_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give each request an id (the client's X-Request-Id when sane) and log one access line."""
    given = request.headers.get("X-Request-Id", "")
    # A client's id is echoed in X-Request-Id and every log line: never one holding a key.
    made = uuid.uuid4().hex
    rid = given if _CLIENT_REQUEST_ID.fullmatch(given) and not holds_key(given) else made
    request[appkeys.REQUEST_ID] = rid
    request[USAGE_ID] = made  # the ledger's id is always the server's: unique whatever the client sends
    token = logs.request_id.set(rid)
    started = request[ARRIVED] = time.monotonic()
    status = 499  # nginx's "client closed request", kept if the handler is cancelled
    trace = _start_trace(request, rid)
    try:
        response = await handler(request)
        status = response.status
    except web.HTTPException as exc:  # routing answers (404/405) raised below the error middleware
        status = exc.status
        raise
    else:
        return response
    finally:
        if trace is not None:
            request.app[appkeys.TRACER].finish(
                trace, {"http.response.status_code": status}, error=status >= 500
            )
        _count(request, status, time.monotonic() - started)
        access_log.info(
            "%s %s %d %.3fs",
            request.method,
            request.path,
            status,
            time.monotonic() - started,
            extra={"peer": request.remote, "status": status, "user": request.get(USER_TAG)},
        )
        logs.request_id.reset(token)


@web.middleware
async def track_in_flight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """API requests in their prompt stage are running requests too (`api.session.in_flight`)."""
    if not is_inference(request.path):
        return await handler(request)
    return await in_flight(request, handler)


def _start_trace(request: web.Request, rid: str) -> RequestTrace | None:
    """The request's span, for API calls while tracing is on (probes and scrapes go untraced)."""
    tracer = request.app.get(appkeys.TRACER)
    if tracer is None or not tracer.enabled or not is_inference(request.path):
        return None
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    attributes = {"http.request.method": request.method, "http.route": route, "edgellm.request_id": rid}
    trace = tracer.start(f"{request.method} {route}", request.headers, attributes)
    if trace is not None:
        request[TRACE] = trace
    return trace


def _count(request: web.Request, status: int, seconds: float) -> None:
    # Label by route pattern, never by raw path: a scanner must not mint a series per URL.
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    key = request.get(appkeys.API_KEY)
    metrics = request.app[appkeys.METRICS]
    metrics.requests.labels(endpoint, str(status), key.id if key else "").inc()
    metrics.request_duration.labels(endpoint).observe(seconds)


def create_app(
    settings: Settings,
    *,
    engine_factory: EngineFactory = default_engine_factory,
    notifier: Notifier | None = None,
    pinning: Pinning | None = None,
) -> web.Application:
    """Build the daemon's application; nothing is loaded until the app starts."""
    # Order matters: the request context wraps everything so even error answers carry a
    # request id and an access line; the error middleware turns every failure below it
    # into OpenAI's envelope; then CORS (preflights carry no credentials), the admin network
    # check and authentication with its rate limits, so that a refusal is logged and
    # answered like any other error before any handler runs.
    app = web.Application(
        middlewares=[request_context, error_middleware, refuse_unmet_expectations],
        client_max_size=settings.server.max_body_bytes,
    )
    app[appkeys.SETTINGS] = settings
    app[ERROR_SHAPES] = ErrorShapes()  # API families with an error envelope of their own add theirs
    app[appkeys.NOTIFIER] = notifier or Notifier()
    app[appkeys.GENERATIONS] = Running()
    app[DRAINING] = asyncio.Event()
    app[appkeys.METRICS] = Metrics()
    app[appkeys.PINNING] = pinning or Pinning(frozenset(os.sched_getaffinity(0)), None, pinned=False)
    app.on_response_prepare.append(_stamp_headers)
    setup_ledger(app, settings)  # first to open, last to close: everything below may audit
    setup_cors(app, settings.server.cors_origins)
    setup_admin_networks(app, settings.auth.admin_cidrs, settings.auth.proxy_cidrs)
    setup_auth(
        app,
        settings.auth.keys_file,
        metrics_public=settings.auth.metrics_public,
        origins=settings.server.cors_origins,
    )
    # Inside authentication: every API request is among the running requests from here until
    # its generations or pooled call take its place, for the drain and key revocation.
    app.middlewares.append(track_in_flight)
    setup_health(app)
    setup_openai(app)
    setup_rerank(app)
    setup_responses(app)
    setup_anthropic(app)
    setup_admin(app)
    # The web console last: its middleware runs after auth (it reads the keys file auth loads,
    # and the rate limiter), and its CSP stamp after _stamp_headers, which it overrides on /ui.
    setup_console(app, settings)
    app.cleanup_ctx.append(_tracer_ctx)
    app.cleanup_ctx.append(_executor_ctx)
    app.cleanup_ctx.append(_gpu_ctx)  # before the registry: gpu_layers: auto reads its snapshot
    app.cleanup_ctx.append(_registry_ctx(engine_factory))
    app.cleanup_ctx.append(_api_ctx)
    app.cleanup_ctx.append(_watcher_ctx)
    app.cleanup_ctx.append(_systemd_ctx)
    return app


# On every answer: an API has nothing to render, frame, sniff or cache, and says no more
# about its software than its name.
SECURITY_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "Server": "edgellm",
}


async def _stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    # Runs for streamed answers too, right before their headers go out.
    rid = request.get(appkeys.REQUEST_ID)
    if rid:
        response.headers["X-Request-Id"] = rid
    response.headers.update(SECURITY_HEADERS)
    response.headers.setdefault("Cache-Control", "no-store")  # streams keep their no-cache
    if request.app[DRAINING].is_set():  # stopping: no request more on this connection, and
        response.force_close()  # the client told so (aiohttp wrote its Connection header already)
        response.headers["Connection"] = "close"
    waits = request.get(QUEUE_WAITS)
    if waits:  # a generation's answer, not streamed: how long it waited for a slot (engine.fairness)
        response.headers["x-queue-ms"] = str(round(max(waits) * 1000))
    limits = request.get(LIMITS)
    if limits is not None and limits.clamped:  # max_tokens_over_limit: clamp cut what was asked
        response.headers["x-max-tokens-clamped"] = str(limits.max_tokens_limit)


async def _tracer_ctx(app: web.Application) -> AsyncIterator[None]:
    telemetry = app[appkeys.SETTINGS].telemetry
    tracer = Tracer(
        TraceSettings(
            telemetry.traces_endpoint,
            telemetry.traces_sample_ratio,
            telemetry.traces_include_text,
            telemetry.service_name,
            __version__,
        )
    )
    app[appkeys.TRACER] = tracer
    app[appkeys.METRICS].trace_exports = lambda: tracer.exports
    if tracer.enabled:
        log.info("tracing requests to %s", telemetry.traces_endpoint)
    yield
    # Off the loop: the last export may take up to its timeout.
    await asyncio.get_running_loop().run_in_executor(None, tracer.shutdown)


def _media_pool(model: str) -> FairPool:
    """A model's media pool: its requests' images and clips wait here, one at a time, keys in
    turn, for its engine to prepare them (seconds for a long clip; the engine prepares one at a
    time). On the prompt pool, two clips held up every model's text; on one pool of all models',
    one model's clips held up every other model's images."""
    return FairPool(1, name=f"media-{model}")


def _prompt_pool(model: str) -> FairPool:
    """A model's prompt pool: its requests' templates, tokens and grammars, keys in turn. On
    one pool of every model's, a model whose engine stopped held the pool's threads in calls to
    it until the hang was found (`hang_timeout_s`), and every other model's requests waited."""
    return FairPool(PROMPT_THREADS, name=f"prompt-{model}")


async def _executor_ctx(app: web.Application) -> AsyncIterator[None]:
    executor = FairPool(PROMPT_THREADS, name="prompt")  # one key's work queues behind its own (api.pool)
    app[appkeys.EXECUTOR] = executor
    # The loop's own pool (asyncio.to_thread: scrapes, file checks, loads) with its threads
    # running from the start, as asyncio would start them one by one when calls first overlap:
    # a box's thread count is what it is after start-up, not a figure that creeps up for hours.
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's own default size
    default = started(ThreadPoolExecutor(workers, thread_name_prefix="edgellmd-io"), workers)
    asyncio.get_running_loop().set_default_executor(default)
    yield
    executor.shutdown(wait=True, cancel_futures=True)


def _registry_ctx(factory: EngineFactory) -> Callable[[web.Application], AsyncIterator[None]]:
    async def registry_ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[appkeys.SETTINGS]
        monitor = app[appkeys.GPU_MONITOR]
        registry = Registry(
            settings.models,
            app[appkeys.EXECUTOR],
            factory,
            settings.lock,
            settings.lifecycle,
            gpu=lambda: monitor.latest,
            gpu_headroom_bytes=settings.host.gpu_headroom_mb * 1024 * 1024,
            huge_pages=settings.host.huge_pages,
            media_pool=_media_pool,
            prompt_pool=_prompt_pool,
        )
        app[appkeys.REGISTRY] = registry
        app[appkeys.METRICS].add_state(
            registry,
            refusals=lambda: _limiter_refusals(app),
            gpu=lambda: monitor.latest,
            shm=_existing(settings.lifecycle.preload_dir),
            models_dir=settings.lock.models_dir,
        )
        # Load in the background: the server listens at once, /readyz says 503 until done.
        app[appkeys.LOAD_TASK] = asyncio.create_task(registry.start(), name="load-models")
        yield
        task = app[appkeys.LOAD_TASK]
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await registry.close()

    return registry_ctx


def _limiter_refusals(app: web.Application) -> Counter[str]:
    limiter = app.get(appkeys.RATE_LIMITER)
    return limiter.refusals if limiter is not None else Counter()


def _existing(path: Path | None) -> Path | None:
    """The path, or its closest existing parent (a preload dir not created yet: its tmpfs)."""
    while path is not None and not path.exists():
        path = path.parent if path.parent != path else None
    return path


def _model_file_types(settings: Settings) -> Callable[[], list[str]]:
    """For the GPU verdicts: the models' GGUF file types as they are now (blocking; off the loop).

    Signed: what the lockfile records for each configured model (the loader refuses a file whose
    header disagrees). Unsigned: each model file's own header. What cannot be read is left out;
    a file is read again only when its stat changes, so that a reload shows at the next reading.
    """
    seen: dict[Path, tuple[tuple[int, int, int, int], list[str]]] = {}

    def read(path: Path, types_in: Callable[[Path], list[object]]) -> list[str]:
        try:
            st = path.stat()
        except OSError:
            return []
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if path not in seen or seen[path][0] != key:
            seen[path] = (key, [t for t in types_in(path) if isinstance(t, str) and t])
        return seen[path][1]

    def in_lock(path: Path) -> list[object]:
        try:
            lock = load_lock(path)
        except LockError:
            return []
        entries = (lock.models.get(model.name) for model in settings.models)
        return [entry.gguf.get("file_type") for entry in entries if entry is not None]

    def in_header(path: Path) -> list[object]:
        try:
            return [read_gguf_facts(path).get("file_type")]
        except GgufError:
            return []

    def now() -> list[str]:
        if not settings.lock.allow_unsigned and settings.lock.file is not None:
            return read(settings.lock.file, in_lock)
        return [t for model in settings.models if model.file is not None for t in read(model.file, in_header)]

    return now


async def _gpu_ctx(app: web.Application) -> AsyncIterator[None]:
    # NVML polled off the loop; absent driver or GPUs are reported once, never fatal. Verdicts
    # judge the model that offloads most (as `edgellmctl doctor` does) and the file types of
    # the models as they are at each reading.
    settings = app[appkeys.SETTINGS]
    monitor = GpuMonitor(
        settings.host.gpu_poll_s,
        pid=os.getpid(),
        offload_supported=await asyncio.to_thread(supports_gpu_offload),  # may start a probe process
        gpu_layers=largest_gpu_layers(m.gpu_layers for m in settings.models),
        model_file_types=_model_file_types(settings),
    )
    app[appkeys.GPU_MONITOR] = monitor
    await monitor.start()
    yield
    await monitor.stop()


async def _watcher_ctx(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: watch while the app runs, when lifecycle.watch is on."""
    settings = app[appkeys.SETTINGS]
    watcher = None
    if settings.lifecycle.watch:
        open_dirs, files = watch_targets(settings)
        watcher = ModelWatcher(
            app[appkeys.REGISTRY],
            open_dirs=open_dirs,
            files=files,
            settle_s=settings.lifecycle.watch_settle_s,
        )
        await watcher.start()
    yield
    if watcher is not None:
        await watcher.stop()


async def _api_ctx(app: web.Application) -> AsyncIterator[None]:
    # Once the models exist: what the API adapters see of the application.
    store = app.get(appkeys.KEY_STORE)
    app[API_CONTEXT] = ApiContext(
        settings=app[appkeys.SETTINGS],
        registry=app[appkeys.REGISTRY],
        metrics=app[appkeys.METRICS],
        executor=app[appkeys.EXECUTOR],
        generations=app[appkeys.GENERATIONS],
        pinning=app[appkeys.PINNING],
        gpu=app.get(appkeys.GPU_MONITOR),
        key_valid=(lambda key_id: not unusable(store, {key_id})) if store is not None else lambda _: True,
    )
    yield


async def _systemd_ctx(app: web.Application) -> AsyncIterator[None]:
    # After the registry's context: READY=1 waits for its first load, pings watch its engines.
    ledger = app.get(LEDGER)

    def problems() -> list[str]:  # as /readyz refuses for them
        if ledger is None or (failing := ledger.failing_summary) is None:
            return []
        # A failed commit's error is short; a file's path and remedy are on status.
        cause = ledger.error if ledger.file_problem is None else "see /admin/status"
        return [f"NOT READY: {failing} ({cause})"]

    supervisor = Supervisor(app[appkeys.NOTIFIER], app[appkeys.REGISTRY], problems)
    supervisor.start(app[appkeys.LOAD_TASK])
    yield
    await supervisor.stop()


def _tls_context(server: ServerSettings) -> ssl.SSLContext | None:
    if server.tls_cert is None or server.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(server.tls_cert, server.tls_key)
    return context


async def start_server(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start serving `app` on host:port (port 0 picks a free one); returns the runner to clean up."""
    server = app[appkeys.SETTINGS].server
    # aiohttp's loggers quote request bytes (header values, keys) in parser errors: scrubbed
    # here too, for an app started without logs.configure (tests, embedding).
    logs.guard_library_loggers()
    # What each connection's protocol is built with (by the guarded site). No aiohttp access
    # log: ours is in request_context.
    handler_args: dict[str, Any] = {
        "keepalive_timeout": server.keepalive_timeout_s,
        "max_line_size": MAX_LINE_BYTES,
        "max_field_size": MAX_FIELD_BYTES,
        "max_headers": MAX_HEADERS,
        "access_log": None,
    }
    # handler_cancellation: a client that disconnects cancels its handler, which frees its
    # slot at once instead of when its generation would have ended.
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=HANDLERS_AFTER_DRAIN_S, **handler_args
    )
    await runner.setup()
    limits = DoorLimits(
        header_timeout_s=server.header_timeout_s,
        body_timeout_s=server.body_timeout_s,
        max_connections=server.max_connections,
        max_connections_per_client=server.max_connections_per_client,
    )
    # Parser refusals never reach the app's middlewares: the site stamps the same headers.
    site = GuardedSite(
        runner,
        host,
        port,
        limits=limits,
        headers=SECURITY_HEADERS,
        handler_args=handler_args,
        ssl_context=_tls_context(server),
    )
    await site.start()
    return runner
