"""The web console's pages and endpoints under /ui: static assets, session, actions, playground.

The console is an adapter like the others: its actions call the admin handlers (the same
checks, answers and audit lines as /admin/*), its playground calls the OpenAI chat handler
(the same validation, limits and streaming as /v1/chat/completions), its overview the
handlers of /readyz, /admin/status and /admin/stats (`live`). Who a request is comes
from the front door, which turns the session cookie into a `Caller` and checks, for every
route, the scope this module declares for it (`ROUTES`) and the CSRF token of every change.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Final

from aiohttp import web

from edgellmd.api import admin, ledger
from edgellmd.api.context import context
from edgellmd.api.openai import routes as openai
from edgellmd.engine.media import AUDIO_FORMATS, IMAGE_FORMATS
from edgellmd.errors import NotFound
from edgellmd.http.console.live import FEED, events, setup_live
from edgellmd.http.console.sessions import CONSOLE_SESSION, SESSIONS, SIGNED_OUT, set_cookie
from edgellmd.settings import Settings

audit = logging.getLogger("edgellmd.audit")

PREFIX: Final = "/ui"
SIGNED_IN: Final = "session"  # a route that any signed-in session may use, whatever its scopes
# The console's own policy (every other answer keeps the API's `default-src 'none'`): its
# pages load scripts, styles and images from the daemon only, connect only back to it, run
# no inline script or style, and cannot be framed. Trusted Types: no string becomes HTML.
CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'; require-trusted-types-for 'script'; trusted-types 'none'"
)
_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str, Handler, str | None]  # method, path, handler, scope (None: public)


def is_console_path(path: str) -> bool:
    """Whether a request path belongs to the console."""
    return path == PREFIX or path.startswith(PREFIX + "/")


class Assets:
    """The console's static files, read once from the package (no build step, nothing from off the box)."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[bytes, str, str]] = {}
        root = resources.files("edgellmd.http.console") / "static"
        for item in root.iterdir():
            suffix = "." + item.name.rsplit(".", 1)[-1]
            if item.is_file() and suffix in _TYPES:
                data = item.read_bytes()
                etag = '"' + hashlib.sha256(data).hexdigest()[:20] + '"'
                self._files[item.name] = (data, _TYPES[suffix], etag)

    def answer(self, request: web.Request, name: str) -> web.Response:
        """The file `name` (an exact name from the package, never a path), or 404."""
        found = self._files.get(name)
        if found is None:
            raise NotFound("no such console file")
        data, content_type, etag = found
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        return web.Response(body=data, headers={**headers, "Content-Type": content_type})


async def redirect(_request: web.Request) -> web.StreamResponse:
    """GET /ui: to the page."""
    raise web.HTTPPermanentRedirect(PREFIX + "/")


async def page(request: web.Request) -> web.StreamResponse:
    """GET /ui/: the console's one page (it shows the sign-in form until a session exists)."""
    return request.app[ASSETS].answer(request, "index.html")


async def asset(request: web.Request) -> web.StreamResponse:
    """GET /ui/static/{name}: a script, a style sheet, an image."""
    return request.app[ASSETS].answer(request, request.match_info["name"])


async def session_info(request: web.Request) -> web.StreamResponse:
    """GET /ui/api/session: who the page is signed in as, and its CSRF token (200 either way)."""
    session = request.get(CONSOLE_SESSION)
    if session is None:
        return web.json_response({"signed_in": False})
    store = request.app[SESSIONS]
    return web.json_response(
        {
            "signed_in": True,
            "key_id": session.key_id,
            "name": session.name,
            "scopes": sorted(session.scopes),
            "csrf": session.csrf,
            "expires_in_s": round(store.expires_in(session), 1),
            "idle_s": store.idle_s,
        }
    )


async def sign_out(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/session/end: end the session; its event stream ends, its cookie is cleared."""
    session = request[CONSOLE_SESSION]
    request.app[SESSIONS].end(session, SIGNED_OUT)
    audit.info("console sign-out", extra={"peer": request.remote, "key_id": session.key_id})
    response = web.json_response({"signed_in": False})
    set_cookie(response, "", max_age=0, secure=context(request).settings.server.tls_cert is not None)
    return response


def _after_action(handler: Handler) -> Handler:
    async def action(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        finally:
            request.app[FEED].sample_now()  # the outcome shows in every page's history at once

    action.__doc__ = f"The admin handler {handler.__name__}, then a fresh sample for the pages."
    return action


async def models(request: web.Request) -> web.StreamResponse:
    """GET /ui/api/models: the models the playground can chat with now, what each reads, and the
    bounds on images and clips that the page checks before it sends (the chat handler checks
    them again: the page's check only spares a request that would be refused)."""
    ctx = context(request)
    handles = [h for h in ctx.registry.ready_handles() if not h.settings.pooled]
    media = ctx.settings.media
    return web.json_response(
        {
            "models": [h.name for h in handles],  # names only, as the page has always read them
            "reads": {h.name: list(h.reads) for h in handles},  # "text", and "image", "audio"
            "media": {
                "max_images": media.max_images,
                "max_image_bytes": media.max_image_bytes,  # one image, decoded (as media.py counts)
                "max_clips": media.max_clips,
                "max_audio_bytes": media.max_audio_bytes,
                "max_body_bytes": ctx.settings.server.max_body_bytes,  # the whole request, as sent
                "image_formats": list(IMAGE_FORMATS),
                "audio_formats": list(AUDIO_FORMATS),
            },
        }
    )


async def chat(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/chat: a chat completion body, served by the OpenAI chat handler itself."""
    return await openai.chat_completions(request)


async def complete(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/complete: a text completion body (a base model continues the prompt), served
    by the OpenAI completions handler itself."""
    return await openai.completions(request)


ROUTES: Final[tuple[Route, ...]] = (
    ("GET", PREFIX, redirect, None),
    ("GET", PREFIX + "/", page, None),
    ("GET", PREFIX + "/static/{name}", asset, None),
    ("GET", PREFIX + "/api/session", session_info, None),  # says who, or that nobody is signed in
    ("POST", PREFIX + "/api/session/end", sign_out, SIGNED_IN),
    ("GET", PREFIX + "/api/events", events, "admin"),
    ("POST", PREFIX + "/api/reload", _after_action(admin.reload), "admin"),
    ("POST", PREFIX + "/api/models/{name}/load", _after_action(admin.load), "admin"),
    ("POST", PREFIX + "/api/models/{name}/unload", _after_action(admin.unload), "admin"),
    ("GET", PREFIX + "/api/usage", ledger.admin_usage, "admin"),  # the Usage page, as /admin/usage
    ("GET", PREFIX + "/api/models", models, "inference"),
    ("POST", PREFIX + "/api/chat", chat, "inference"),
    ("POST", PREFIX + "/api/complete", complete, "inference"),
)


class RouteScopes:
    """The scope each console route needs, by the route aiohttp matched (HEAD is never added)."""

    def __init__(self) -> None:
        self._scopes: dict[web.AbstractRoute, str | None] = {}

    def add(self, app: web.Application, routes: Sequence[Route]) -> None:
        """Install `routes`, noting each one's scope."""
        for method, path, handler, scope in routes:
            self._scopes[app.router.add_route(method, path, handler)] = scope

    def of(self, request: web.Request) -> tuple[bool, str | None]:
        """(known, scope): known is False for what no console route matched (404, 405)."""
        route = request.match_info.route
        if route in self._scopes:
            return True, self._scopes[route]
        return False, None


def add_console_routes(app: web.Application, settings: Settings) -> RouteScopes:
    """Install the console's pages, endpoints and live feed; returns the route scopes for the front door."""
    app[ASSETS] = Assets()
    setup_live(app, settings)
    scopes = RouteScopes()
    scopes.add(app, ROUTES)
    return scopes


ASSETS: Final = web.AppKey("console_assets", Assets)
