"""The console's front door: an API key exchanged for a session cookie, the session and CSRF checks, the CSP.

For every request under /ui the middleware here finds the session its cookie names (none:
the public routes only), checks its key against the keys file as it is now (revoked,
disabled, expired or removed: the session ends), the scope the route needs, and, for every
change (any method but GET), that the request comes from the console's own pages (the
browser's `Sec-Fetch-Site` and `Origin`) and carries the session's CSRF token. Sign-in
checks the key exactly as the API does (`auth.authenticate`, with its audit lines) and
counts wrong keys per client address in a token bucket like the API's limits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Final
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from edgellmd.api.context import CALLER, Caller
from edgellmd.api.jsontext import read_json_object
from edgellmd.api.pool import POOL_TENANT
from edgellmd.errors import AuthenticationFailed, InvalidRequest, PermissionDenied, RateLimited
from edgellmd.host.upkeep import PassFailures
from edgellmd.http import appkeys
from edgellmd.http.auth import authenticate, unusable, within_limits
from edgellmd.http.console.keys import KEY_ROUTES, setup_key_writes
from edgellmd.http.console.routes import (
    CSP,
    PREFIX,
    SIGNED_IN,
    RouteScopes,
    add_console_routes,
    is_console_path,
)
from edgellmd.http.console.sessions import (
    CONSOLE_SESSION,
    COOKIE,
    KEY_NO_LONGER_VALID,
    SESSIONS,
    SIGNED_OUT,
    ConsoleSession,
    SessionStore,
    current_key,
    set_cookie,
)
from edgellmd.http.errors import Handler
from edgellmd.http.ratelimit import TokenBucket
from edgellmd.keys import RELOAD_INTERVAL_S, ApiKey, KeyStore, parse_token
from edgellmd.settings import Settings

audit = logging.getLogger("edgellmd.audit")
log = logging.getLogger(__name__)

CSRF_HEADER: Final = "X-CSRF-Token"
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
SAME_SITE: Final = frozenset({"same-origin", "none"})  # Sec-Fetch-Site of the console's own requests
MAX_TRACKED_PEERS: Final = 4096  # addresses whose wrong keys are counted; the oldest forgotten first
WATCH_INTERVAL_S: Final = 2 * RELOAD_INTERVAL_S  # how often sessions are checked against the keys file
CONSOLE_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class SignInLimiter:
    """Sign-ins limited twice: wrong keys per client address (`per_minute` of them, refilled
    evenly, then 429 for the wrong ones; a right key still signs in) and successful sign-ins per
    key (`per_key_per_minute`), so that a valid key signing in in a loop can neither churn the
    session store nor hide in many addresses."""

    def __init__(
        self, per_minute: int, per_key_per_minute: int = 10, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._per_minute = per_minute
        self._per_key = per_key_per_minute
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._keys: dict[str, TokenBucket] = {}

    @staticmethod
    def _bucket(buckets: dict[str, TokenBucket], name: str, capacity: int) -> TokenBucket:
        bucket = buckets.pop(name, None)
        if bucket is None:
            bucket = TokenBucket(float(capacity))
            while len(buckets) >= MAX_TRACKED_PEERS:
                del buckets[next(iter(buckets))]
        buckets[name] = bucket  # most recent last
        return bucket

    def check(self, peer: str) -> None:
        """Raise RateLimited (with Retry-After) when this address used up its wrong keys."""
        wait = self._bucket(self._buckets, peer, self._per_minute).wait_for(1, self._clock())
        if wait > 0:
            audit.warning(
                "console sign-in refused: too many wrong keys", extra={"peer": peer, "key_id": None}
            )
            raise _limited("too many wrong API keys from this address", wait)

    def failed(self, peer: str) -> None:
        """Count one wrong key from this address."""
        self._bucket(self._buckets, peer, self._per_minute).take(1, self._clock())

    def signed_in(self, key_id: str, peer: str) -> None:
        """Count one sign-in of this key; raise RateLimited when it signed in too often."""
        bucket = self._bucket(self._keys, key_id, self._per_key)
        now = self._clock()
        wait = bucket.wait_for(1, now)
        if wait > 0:
            audit.warning(
                "console sign-in refused: too many sign-ins with this key",
                extra={"peer": peer, "key_id": key_id},
            )
            raise _limited("too many console sign-ins with this API key", wait)
        bucket.take(1, now)


def _limited(why: str, wait: float) -> RateLimited:
    seconds = max(1, round(wait + 0.5))
    return RateLimited(f"{why}; retry in {seconds} s", headers={"Retry-After": str(seconds)})


def _same_origin(request: web.Request) -> None:
    """Refuse a change that a page of another site asked the browser to make."""
    site = request.headers.get("Sec-Fetch-Site")
    origin = request.headers.get("Origin")
    if (site is not None and site not in SAME_SITE) or (
        origin is not None and _host_of(origin) != request.host
    ):
        audit.warning("console refused: a cross-site request", extra={"peer": request.remote, "key_id": None})
        raise PermissionDenied("the console takes changes from its own pages only", code="cross_site_request")


def _read_from_own_page(request: web.Request) -> None:
    """Refuse a read of the console's API that a page of another origin made the browser send.

    The cookie is SameSite=Strict, which keeps it from other sites, not from another port or
    name of the same site (http://127.0.0.1:9000 is the same site as the console's port): an
    `<img>` there pointing at the event stream would take the session's one stream away from
    the operator's page, and any read keeps an idle session alive. The browser says where a
    request comes from in Sec-Fetch-Site; a client without it (curl, edgellmctl) is let be.
    """
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in SAME_SITE:
        audit.warning(
            "console refused: a read from another origin", extra={"peer": request.remote, "key_id": None}
        )
        raise PermissionDenied("the console answers its own pages only", code="cross_site_request")


def _host_of(origin: str) -> str | None:
    """An Origin header's host and port; None for one that is no URL (`http://[`)."""
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return None


def _check_csrf(request: web.Request, session: ConsoleSession) -> None:
    given = request.headers.get(CSRF_HEADER, "")
    # aiohttp decodes a header leniently: a byte that is no UTF-8 becomes a lone surrogate,
    # which no token holds (and plain encode() refuses).
    if not hmac.compare_digest(given.encode("utf-8", "surrogatepass"), session.csrf.encode()):
        audit.warning(
            "console refused: missing or wrong CSRF token",
            extra={"peer": request.remote, "key_id": session.key_id},
        )
        raise PermissionDenied(f"missing or wrong {CSRF_HEADER} header", code="csrf_token_invalid")


def _session_key(
    store: SessionStore, keys: KeyStore, request: web.Request
) -> tuple[ConsoleSession, ApiKey] | None:
    """The request's live session and its key as it is now; a session whose key stopped working ends."""
    session = store.get(request.cookies.get(COOKIE))
    if session is None:
        return None
    key = current_key(keys, session)
    if key is None:
        store.end(session, KEY_NO_LONGER_VALID)
        audit.warning(
            "console session ended: its key is no longer valid",
            extra={"peer": request.remote, "key_id": session.key_id},
        )
        return None
    session.name, session.scopes = key.name, key.scopes
    return session, key


def _middleware(store: SessionStore, scopes: RouteScopes) -> Middleware:
    @web.middleware
    async def console_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_console_path(request.path):
            return await handler(request)
        known, scope = scopes.of(request)
        changes = request.method not in SAFE_METHODS
        if changes:
            _same_origin(request)
        elif request.path.startswith(PREFIX + "/api/"):
            _read_from_own_page(request)
        found = _session_key(store, request.app[appkeys.KEY_STORE], request)
        if found is not None:
            request[CONSOLE_SESSION] = found[0]
        if not known or scope is None:
            return await handler(request)
        if found is None:
            raise AuthenticationFailed("sign in to the console first", code="session_required")
        session, key = found
        if scope != SIGNED_IN and scope not in key.scopes:
            raise PermissionDenied(f"this API key does not have the '{scope}' scope")
        if changes:
            _check_csrf(request, session)
        request[appkeys.API_KEY] = key
        request[CALLER] = Caller.of(key)
        tenant = POOL_TENANT.set(key.id)  # as the front door's: the pool work is the key's
        try:
            if scope != "inference":
                return await handler(request)
            # The playground's requests count against the key's limits as its /v1 requests do.
            return await within_limits(request, key, handler)
        finally:
            POOL_TENANT.reset(tenant)

    return console_middleware


def _sign_in(store: SessionStore, limiter: SignInLimiter, settings: Settings) -> Handler:
    secure = settings.server.tls_cert is not None
    max_age = int(settings.console.session_max_s)

    async def sign_in(request: web.Request) -> web.StreamResponse:
        """POST /ui/api/session {"key": token}: a session for a valid admin or inference key."""
        peer = request.remote or ""
        body = await read_json_object(request)
        token = body.get("key")
        if not isinstance(token, str) or set(body) != {"key"}:
            raise InvalidRequest('send {"key": "<API key>"}', param="key")
        keys = request.app[appkeys.KEY_STORE]
        parsed = parse_token(token.strip())
        candidate = keys.get(parsed[0]) if parsed is not None else None
        # A key with either scope may sign in; the scope asked of authenticate is one it has.
        scope = "admin" if candidate is not None and "admin" in candidate.scopes else "inference"
        try:
            key = authenticate(keys, f"Bearer {token.strip()}", scope, peer)
        except AuthenticationFailed:
            # The address's wrong keys are limited, never its right one: a key's secret is 256
            # random bits, which no rate of guessing finds, so the limit is against the noise of
            # wrong tries, and an operator who mistyped nine times still gets in with the tenth.
            limiter.check(peer)
            limiter.failed(peer)
            raise
        limiter.signed_in(key.id, peer)
        earlier = store.get(request.cookies.get(COOKIE))
        if earlier is not None:  # a fresh id at every sign-in: no session fixation
            store.end(earlier, SIGNED_OUT)
        session_id, session = store.create(key.id)
        session.name, session.scopes, session.key_hash = key.name, key.scopes, key.hash
        audit.info("console sign-in", extra={"peer": peer, "key_id": key.id})
        response = web.json_response(
            {
                "signed_in": True,
                "key_id": key.id,
                "name": key.name,
                "scopes": sorted(key.scopes),
                "csrf": session.csrf,
                "expires_in_s": round(store.expires_in(session), 1),
                "idle_s": store.idle_s,
            }
        )
        set_cookie(response, session_id, max_age=max_age, secure=secure)
        return response

    return sign_in


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    # Runs after app._stamp_headers (installed before this): the console's pages get their own CSP.
    if is_console_path(request.path):
        response.headers.update(CONSOLE_HEADERS)


def _sessions_ctx(store: SessionStore) -> Callable[[web.Application], AsyncIterator[None]]:
    async def watch(app: web.Application) -> None:
        # Sessions of keys revoked ride on this task: a pass that raises is logged (once, until
        # another error or a pass that works) and the next goes on.
        failures = PassFailures(log)
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                store.prune()
                gone = unusable(app[appkeys.KEY_STORE], store.key_ids())
                if gone:
                    store.end_keys(gone)
                    for key_id in sorted(gone):
                        audit.warning(
                            "console sessions ended: their key is no longer valid",
                            extra={"peer": None, "key_id": key_id},
                        )
            except Exception as exc:  # noqa: BLE001 - logged (PassFailures)
                failures.failed(
                    exc, "the console sessions' check failed; it goes on in %.1f s", WATCH_INTERVAL_S
                )
            else:
                failures.passed()

    async def sessions_ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(watch(app), name="console-sessions")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return sessions_ctx


async def _end_sessions(app: web.Application) -> None:
    # on_shutdown runs before the server waits for its handlers: the event streams end now.
    app[SESSIONS].close()


def setup_console(app: web.Application, settings: Settings) -> None:
    """Serve the console at /ui when `console.enabled` (after auth: it needs the keys file and limiter)."""
    console = settings.console
    if not console.enabled:
        return
    store = SessionStore(
        idle_s=console.session_idle_s,
        max_s=console.session_max_s,
        capacity=console.max_sessions,
        per_key=console.max_sessions_per_key,
    )
    app[SESSIONS] = store
    setup_key_writes(app)
    scopes = add_console_routes(app, settings)
    limiter = SignInLimiter(console.signin_failures_per_minute, console.signins_per_key_per_minute)
    scopes.add(app, [("POST", "/ui/api/session", _sign_in(store, limiter, settings), None), *KEY_ROUTES])
    app.middlewares.append(_middleware(store, scopes))
    app.on_response_prepare.append(_stamp)
    app.on_shutdown.append(_end_sessions)
    app.cleanup_ctx.append(_sessions_ctx(store))
