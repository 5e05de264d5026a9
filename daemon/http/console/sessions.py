"""The console's sessions: in memory, bounded, ended by sign-out, idle or absolute expiry, or their key.

A browser holds only an opaque session id (an HttpOnly cookie), never the API key it signed
in with. The store keeps sessions by a hash of that id, so that a look-up compares digests,
not secrets, and a heap dump holds no usable cookie. Every request checks the session's key
again (the front door does, against the keys file as it is now): a revoked or disabled key
ends its sessions at their next request, and the front door's watch ends them within a
second anyway.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from aiohttp import web

from edgellmd.keys import ApiKey, KeyStore

COOKIE: Final = "edgellm_console"
COOKIE_PATH: Final = "/ui"  # the browser sends the session id to the console only
SESSION_ID: Final = re.compile(r"[A-Za-z0-9_-]{43}")  # token_urlsafe(32)
# Why a session ended, as the page is told (its event stream's last event, the sign-in screen).
SIGNED_OUT: Final = "signed out"
EXPIRED: Final = "session expired"
KEY_NO_LONGER_VALID: Final = "the API key of this session is no longer valid"
REPLACED: Final = "too many console sessions: this one was the least recently used"
REPLACED_OWN: Final = "too many console sessions of this API key: this one was its least recently used"
SHUTTING_DOWN: Final = "the daemon is shutting down"


@dataclass(slots=True, eq=False)
class ConsoleSession:
    """One signed-in browser: the key it proved, its CSRF token, its clocks and its event stream."""

    key_id: str
    csrf: str
    started: float  # the store's clock
    seen: float
    name: str = ""  # the key's name and scopes as the keys file says now (the front door keeps them)
    scopes: frozenset[str] = frozenset()
    # The hash of the secret it proved: a key whose secret was replaced in the keys file (the
    # same id, a new token) ends its sessions as a revoked one does. "": not checked.
    key_hash: str = ""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end_reason: str | None = None
    stream: asyncio.Event | None = None  # the stop signal of its event stream, when one runs

    def claim_stream(self) -> asyncio.Event:
        """A stop signal for a new event stream; the session's previous stream (a reloaded page's) stops."""
        if self.stream is not None:
            self.stream.set()
        self.stream = asyncio.Event()
        return self.stream

    def finish(self, reason: str) -> None:
        """End the session: its stream stops, its cookie no longer works."""
        if self.end_reason is None:
            self.end_reason = reason
        self.ended.set()
        if self.stream is not None:
            self.stream.set()


def set_cookie(response: web.StreamResponse, value: str, *, max_age: int, secure: bool) -> None:
    """The session cookie: HttpOnly (no script reads it), SameSite=Strict, Secure under TLS."""
    response.set_cookie(
        COOKIE, value, path=COOKIE_PATH, max_age=max_age, httponly=True, samesite="Strict", secure=secure
    )


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("ascii")).digest()


class SessionStore:
    """At most `capacity` sessions and `per_key` of one key's; one unused for `idle_s`, or older
    than `max_s`, is gone.

    A sign-in past a bound ends a session of the key holding the most (its least recently
    used): a key signing in over and over replaces its own sessions, never another key's.
    """

    def __init__(
        self,
        *,
        idle_s: float,
        max_s: float,
        capacity: int,
        per_key: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.max_s = max_s
        self.capacity = capacity
        self.per_key = capacity if per_key is None else per_key
        self._clock = clock
        self._sessions: dict[bytes, ConsoleSession] = {}  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, key_id: str) -> tuple[str, ConsoleSession]:
        """A new session for `key_id`: (the id for the cookie, the session)."""
        self.prune()
        while (own := [s for s in self._sessions.values() if s.key_id == key_id]) and len(
            own
        ) >= self.per_key:
            self.end(own[0], REPLACED_OWN)
        while len(self._sessions) >= self.capacity:
            held: dict[str, list[ConsoleSession]] = {}
            for session in self._sessions.values():  # least recently used first
                held.setdefault(session.key_id, []).append(session)
            most = max(held.values(), key=len)
            self.end(most[0], REPLACED_OWN if most[0].key_id == key_id else REPLACED)
        session_id = secrets.token_urlsafe(32)
        now = self._clock()
        session = ConsoleSession(key_id=key_id, csrf=secrets.token_urlsafe(32), started=now, seen=now)
        self._sessions[_digest(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session with this id, now marked used; None for an unknown, ended or expired one."""
        if session_id is None or not SESSION_ID.fullmatch(session_id):
            return None
        digest = _digest(session_id)
        session = self._sessions.get(digest)
        if session is None:
            return None
        if self._expired(session, self._clock()):
            self.end(session, EXPIRED)
            return None
        session.seen = self._clock()
        self._sessions[digest] = self._sessions.pop(digest)  # most recently used last
        return session

    def watched(self, session: ConsoleSession) -> None:
        """A page is reading the session's live overview: it counts as use (a wall display stays
        signed in while it shows the overview, never past `max_s`)."""
        if not self._expired(session, self._clock()):
            session.seen = self._clock()

    def expires_in(self, session: ConsoleSession) -> float:
        """Seconds until the session ends unless it is used: the nearer of its idle and absolute ends."""
        now = self._clock()
        return max(0.0, min(session.seen + self.idle_s, session.started + self.max_s) - now)

    def _expired(self, session: ConsoleSession, now: float) -> bool:
        return now - session.seen >= self.idle_s or now - session.started >= self.max_s

    def end(self, session: ConsoleSession, reason: str) -> None:
        """End one session (sign-out, expiry, its key, eviction)."""
        session.finish(reason)
        for digest, held in list(self._sessions.items()):
            if held is session:
                del self._sessions[digest]

    def end_keys(self, key_ids: set[str], reason: str = KEY_NO_LONGER_VALID) -> int:
        """End every session of these keys; how many ended."""
        gone = [s for s in self._sessions.values() if s.key_id in key_ids]
        for session in gone:
            self.end(session, reason)
        return len(gone)

    def prune(self) -> int:
        """End the expired sessions; how many ended."""
        now = self._clock()
        gone = [s for s in self._sessions.values() if self._expired(s, now)]
        for session in gone:
            self.end(session, EXPIRED)
        return len(gone)

    def key_ids(self) -> set[str]:
        """The keys that have sessions now."""
        return {s.key_id for s in self._sessions.values()}

    def close(self, reason: str = SHUTTING_DOWN) -> None:
        """End every session (shutdown): their event streams end so the server can stop."""
        for session in list(self._sessions.values()):
            self.end(session, reason)


SESSIONS: Final = web.AppKey("console_sessions", SessionStore)
CONSOLE_SESSION: Final = web.RequestKey("console_session", ConsoleSession)  # set by the front door


def current_key(keys: KeyStore, session: ConsoleSession) -> ApiKey | None:
    """The session's key as the keys file has it now; None once it stopped working (revoked,
    disabled, expired or gone with a reload) or its secret was replaced (the token the session
    proved works no more)."""
    key = keys.get(session.key_id)
    if key is None or key.usable(datetime.now(UTC)) is not None:
        return None
    return None if session.key_hash and not hmac.compare_digest(key.hash, session.key_hash) else key
