"""Bearer-key authentication with scopes on /v1/* and /admin/*, with an audit line per failure."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from aiohttp import web

from edgellmd.api.context import CALLER, KEYS_GONE, RESERVE_PROMPT, TRACE, Caller
from edgellmd.api.pool import POOL_TENANT
from edgellmd.engine.generation import KEY_REVOKED, Running
from edgellmd.errors import AddressNotAllowed, AuthenticationFailed, PermissionDenied, RateLimited
from edgellmd.host.traces import now_ns
from edgellmd.host.upkeep import PassFailures
from edgellmd.http import appkeys
from edgellmd.http.console.routes import is_console_path
from edgellmd.http.errors import Handler
from edgellmd.http.ledger import check_quota, release_quota, reserve_quota, unreserve_quota
from edgellmd.http.ratelimit import RateLimiter
from edgellmd.keys import RELOAD_INTERVAL_S, ApiKey, KeyStore, hash_secret, parse_token

log = logging.getLogger(__name__)
audit = logging.getLogger("edgellmd.audit")


# Inference paths outside /v1/: clients' spellings of reranking (api.rerank.PATHS).
INFERENCE_ELSEWHERE: Final = frozenset({"/rerank", "/v2/rerank"})


def is_inference(path: str) -> bool:
    """An API path (/v1/... and its spellings elsewhere): rate-limited, metered and traced."""
    return path.startswith("/v1/") or path in INFERENCE_ELSEWHERE


def scope_for(path: str, *, metrics_public: bool = False) -> str | None:
    """The scope a path needs, or None for public paths."""
    if path == "/metrics":
        return None if metrics_public else "metrics"
    if path.startswith("/v1/") or path == "/v1" or path in INFERENCE_ELSEWHERE:
        return "inference"
    if path.startswith("/admin/") or path == "/admin":
        return "admin"
    return None


def _unauthorized(message: str) -> AuthenticationFailed:
    return AuthenticationFailed(message, headers={"WWW-Authenticate": "Bearer"})


def authenticate(
    store: KeyStore, header: str | None, scope: str, peer: str | None, now: datetime | None = None
) -> ApiKey:
    """The key a request's Authorization header carries, checked for the scope; audit-logs failures."""
    moment = now or datetime.now(UTC)
    if not header:
        audit.warning("auth failed: no bearer token", extra={"peer": peer, "key_id": None})
        raise _unauthorized("missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)")
    scheme, _, token = header.partition(" ")
    parsed = parse_token(token.strip()) if scheme.lower() == "bearer" else None
    if parsed is None:
        audit.warning("auth failed: malformed bearer token", extra={"peer": peer, "key_id": None})
        raise _unauthorized("malformed API key")
    key_id, secret = parsed
    key = store.get(key_id)
    # Compare against a dummy hash for unknown ids too, so timing says nothing about ids.
    expected = key.hash if key is not None else "sha256:" + "0" * 64
    if not hmac.compare_digest(hash_secret(secret).encode(), expected.encode()) or key is None:
        audit.warning("auth failed: wrong or unknown key", extra={"peer": peer, "key_id": key_id})
        raise _unauthorized("invalid API key")
    problem = key.usable(moment)
    if problem is not None:
        audit.warning("auth failed: key %s", problem, extra={"peer": peer, "key_id": key_id})
        raise _unauthorized(f"API key {problem}")
    if scope not in key.scopes:
        audit.warning("auth failed: key lacks scope %s", scope, extra={"peer": peer, "key_id": key_id})
        raise PermissionDenied(f"this API key does not have the '{scope}' scope")
    return key


def admin_network_path(path: str) -> bool:
    """Whether `auth.admin_cidrs` applies to a path: /admin/* and the web console (/ui)."""
    return scope_for(path) == "admin" or is_console_path(path)


def setup_admin_networks(app: web.Application, networks: Sequence[str], proxies: Sequence[str] = ()) -> None:
    """Refuse /admin/* and the console from peers outside `networks` (CIDRs), and from
    `proxies` (load balancers: whoever sent the request through one is unknown), before any
    key is looked at."""
    if not networks and not proxies:
        return
    allowed = [ipaddress.ip_network(n, strict=False) for n in networks]
    balancers = [ipaddress.ip_network(n, strict=False) for n in proxies]

    @web.middleware
    async def admin_networks(request: web.Request, handler: Handler) -> web.StreamResponse:
        if admin_network_path(request.path):
            peer = request.remote or ""
            try:
                address = ipaddress.ip_address(peer)
            except ValueError:
                address = None
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped  # a dual-stack listener's IPv4 client
            if address is not None and any(address in net for net in balancers):
                audit.warning(
                    "admin refused: address in auth.proxy_cidrs", extra={"peer": peer, "key_id": None}
                )
                raise AddressNotAllowed("admin endpoints are not reachable through a load balancer")
            if allowed and (address is None or not any(address in net for net in allowed)):
                audit.warning(
                    "admin refused: address not in auth.admin_cidrs", extra={"peer": peer, "key_id": None}
                )
                raise AddressNotAllowed("admin endpoints are not reachable from this address")
        return await handler(request)

    app.middlewares.append(admin_networks)


def unusable(store: KeyStore, key_ids: set[str], now: datetime | None = None) -> set[str]:
    """The ids among `key_ids` that no longer authenticate: removed, disabled or expired."""
    moment = now or datetime.now(UTC)
    return {k for k in key_ids if (key := store.get(k)) is None or key.usable(moment) is not None}


async def watch_keys(app: web.Application, store: KeyStore) -> None:
    """Reload the keys file when it changes; end the running requests of keys that stopped working
    and drop what is kept for them.

    Revocation bites within one check interval: a revoked, disabled or expired key's
    streams end with an `invalid_api_key` error event, its waiting requests leave the queue,
    the KV state cached for its scope (unless another key in force shares its `cache_group`)
    is cleared in every engine, and its stored responses go.
    """
    running = app[appkeys.GENERATIONS]
    in_force = store.in_force(datetime.now(UTC))
    failures = PassFailures(log)
    while True:
        await asyncio.sleep(RELOAD_INTERVAL_S)
        try:
            in_force = await _check_keys(app, store, running, in_force)
        except Exception as exc:  # noqa: BLE001 - logged; the watch outlives a check: revocations ride on it
            failures.failed(
                exc, "the keys file's check failed; it is tried again every %.1f s", RELOAD_INTERVAL_S
            )
        else:
            failures.passed()


async def _check_keys(
    app: web.Application, store: KeyStore, running: Running, in_force: tuple[set[str], set[str]]
) -> tuple[set[str], set[str]]:
    """One look at the keys file (see watch_keys); the ids and scopes in force now."""
    ids, scopes = in_force
    before = store.ids()
    if await store.reload():
        after = store.ids()
        audit.info(
            "keys file changed: %d key(s), %d added, %d removed",
            len(after),
            len(after - before),
            len(before - after),
            extra={"peer": None, "key_id": None},
        )
    gone = unusable(store, running.key_ids())
    if gone:
        ended = running.abort_keys(gone, KEY_REVOKED)
        for key_id in sorted(gone):
            audit.warning(
                "key no longer valid: its running requests were ended",
                extra={"peer": None, "key_id": key_id},
            )
        log.info("ended %d request(s) of %d key(s) that are no longer valid", ended, len(gone))
    now_ids, now_scopes = store.in_force(datetime.now(UTC))
    forget_ids, forget_scopes = ids - now_ids, scopes - now_scopes
    if forget_scopes:
        registry = app.get(appkeys.REGISTRY)
        for handle in registry.ready_handles() if registry is not None else ():
            handle.engine.forget_scopes(forget_scopes)
    for key_id in sorted(forget_ids):
        audit.info(
            "key no longer in force: revoked, disabled, expired or removed",
            extra={"peer": None, "key_id": key_id},
        )
    for key_id in sorted(now_ids - ids):
        audit.info("key in force", extra={"peer": None, "key_id": key_id})
    if forget_ids:
        for drop in app.get(KEYS_GONE, []):
            drop(forget_ids)
        log.info("dropped the cached state of %d key(s) no longer in force", len(forget_ids))
    return now_ids, now_scopes


def _credentials(request: web.Request) -> str | None:
    """The request's Authorization header; Anthropic's clients send the key as `x-api-key` instead.

    A request naming more than one key (two Authorization headers, two x-api-key, or each
    header a different key) is refused: which one a proxy in front checked is not known.
    """
    given = request.headers.getall("Authorization", [])
    keys = request.headers.getall("x-api-key", [])
    if (
        len(given) > 1
        or len(keys) > 1
        or (given and keys and given[0].partition(" ")[2].strip() != keys[0].strip())
    ):
        audit.warning(
            "auth failed: more than one API key sent", extra={"peer": request.remote, "key_id": None}
        )
        raise _unauthorized("more than one API key sent: send one Authorization or x-api-key header")
    if given:
        return given[0]
    return f"Bearer {keys[0]}" if keys else None


_IPV4_NUMBER: Final = re.compile(r"0[xX][0-9a-fA-F]*|0[0-7]*|[1-9][0-9]*")


def ipv4_numbers(name: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a host name of one to four numbers spells, as browsers and libc read it
    (WHATWG URL's IPv4 parser: each part decimal, 0x hexadecimal or 0 octal, the last filling
    the bytes left: `127.1` is 127.0.0.1), or None. Parsed here: libc's `inet_aton` takes
    whatever follows a space as well."""
    parts = name.split(".")
    if not 1 <= len(parts) <= 4 or not all(_IPV4_NUMBER.fullmatch(part) for part in parts):
        return None
    values = [
        int(part[2:] or "0", 16) if part[:2] in ("0x", "0X") else int(part, 8 if part[0] == "0" else 10)
        for part in parts
    ]
    *head, last = values
    if any(value > 255 for value in head) or last >= 256 ** (5 - len(values)):
        return None
    return ipaddress.IPv4Address(sum(value << (8 * (3 - i)) for i, value in enumerate(head)) + last)


def loopback_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    try:
        name = (urlsplit("//" + host).hostname or "").rstrip(".")
    except ValueError:  # a bracket left open
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        shorthand = ipv4_numbers(name)  # 127.1, 0x7f.1, 2130706433: curl sends them as typed
        if shorthand is None:
            return False
        address = shorthand
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # [::ffff:127.0.0.1]
    return address.is_loopback


def setup_keyless_guard(app: web.Application, origins: Sequence[str]) -> None:
    """Without API keys (loopback only), whoever reaches the port is trusted, and a browser on
    this machine reaches it for any web page: a page's form or `fetch` (no preflight for a
    text/plain POST) could unload models, and a name of the page's own that resolves to
    127.0.0.1 (DNS rebinding) could read answers. So such a daemon answers requests for a
    loopback host name only, and no request a page of another origin made the browser send
    (`Sec-Fetch-Site`, `Origin`) unless `server.cors_origins` lists it."""
    allowed = frozenset(origins)

    @web.middleware
    async def keyless_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")  # a browser always sends one; HTTP/1.0 tools may not
        if host is not None and not loopback_host(host):
            raise PermissionDenied(
                "without API keys this daemon answers requests for a loopback host name only "
                "(localhost, 127.0.0.1, [::1])",
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        site = request.headers.get("Sec-Fetch-Site", "")
        foreign = site in ("cross-site", "same-site") or (
            origin is not None and origin != f"{request.scheme}://{request.host}"
        )
        if foreign and origin not in allowed:
            raise PermissionDenied(
                "without API keys this daemon answers no request a page of another origin sent "
                "(list the page's origin in server.cors_origins)",
                code="cross_site_request",
            )
        return await handler(request)

    app.middlewares.append(keyless_guard)


def setup_auth(
    app: web.Application, keys_file: Path | None, *, metrics_public: bool = False, origins: Sequence[str] = ()
) -> None:
    """Install bearer-key checks on /v1/* and /admin/* when a keys file is configured; without
    one, the guard against browsers (`setup_keyless_guard`)."""
    if keys_file is None:
        setup_keyless_guard(app, origins)
        return
    store_holder: list[KeyStore] = []

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        scope = scope_for(request.path, metrics_public=metrics_public)
        if scope is not None:
            started = now_ns()
            trace = request.get(TRACE)
            try:
                key = request[appkeys.API_KEY] = authenticate(
                    store_holder[0], _credentials(request), scope, request.remote
                )
            finally:
                if trace is not None:
                    trace.phase("auth", started)
            if trace is not None:
                trace.attributes["edgellm.key_id"] = key.id  # the id, never the key
            request[CALLER] = Caller.of(key)
            tenant = POOL_TENANT.set(key.id)  # this request's prompt-pool work is the key's (api.pool)
            try:
                return await handler(request)
            finally:
                POOL_TENANT.reset(tenant)
        return await handler(request)

    async def keys_ctx(app: web.Application) -> AsyncIterator[None]:
        store = KeyStore(keys_file)
        store_holder.append(store)
        app[appkeys.KEY_STORE] = store
        log.info("API keys: %d key(s) from %s", len(store), keys_file)
        task = asyncio.create_task(watch_keys(app, store), name="keys-watch")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.middlewares.append(auth_middleware)
    app.cleanup_ctx.append(keys_ctx)
    # Limits count only requests that proved who they are.
    setup_ratelimit(app)


async def within_limits(request: web.Request, key: ApiKey, handler: Handler) -> web.StreamResponse:
    """Run an inference request under its key's limits (the /v1 routes and the console's
    playground alike): a spent day or month budget refuses it before a minute's is taken, and
    it counts in flight against the key's request budgets and its `concurrent` cap until it ends."""
    limiter = request.app[appkeys.RATE_LIMITER]
    held = check_quota(request, key, hold=True)
    try:
        try:
            limiter.admit(key)
        except RateLimited as exc:
            exc.headers.update(limiter.headers(key))
            raise
        with limiter.admitted(key, request) as take_minute:

            def reserve(tokens: int) -> None:
                reserve_quota(request, key, tokens)
                try:
                    take_minute(tokens)
                except RateLimited as exc:
                    unreserve_quota(request, key, tokens)
                    exc.headers.update(limiter.headers(key))
                    raise

            request[RESERVE_PROMPT] = reserve
            return await handler(request)
    finally:
        release_quota(request, key, held=held)


def setup_ratelimit(app: web.Application) -> None:
    """Install per-key limits on every authenticated request (after auth has set the key)."""

    @web.middleware
    async def ratelimit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = request.get(appkeys.API_KEY)
        if key is None or not is_inference(request.path):
            return await handler(request)
        return await within_limits(request, key, handler)

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        key = request.get(appkeys.API_KEY)
        if key is not None and is_inference(request.path):
            response.headers.update(request.app[appkeys.RATE_LIMITER].headers(key))

    async def limiter_ctx(app: web.Application) -> AsyncIterator[None]:
        app[appkeys.RATE_LIMITER] = RateLimiter()
        yield

    app.middlewares.append(ratelimit_middleware)
    app.on_response_prepare.append(stamp)
    app.cleanup_ctx.append(limiter_ctx)
