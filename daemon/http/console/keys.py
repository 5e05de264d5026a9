"""The console's API keys: list (never secrets), create (the token shown once), disable, enable, revoke.

The keys file is written by `edgellmd.keys`' helpers, the ones `edgellmctl keys` uses, off the
event loop and one change at a time; the daemon then reads it back at once, so a disabled or
revoked key stops working before the answer goes out, and its running requests and console
sessions end. Under the hardened systemd unit the keys file is read-only for the daemon
(`ProtectSystem=strict`): then every change is refused with 403 `keys_file_read_only`, and
the list says so (the README's Console section says what to allow).
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from edgellmd.api.context import CALLER
from edgellmd.api.jsontext import read_json_object
from edgellmd.engine.generation import KEY_REVOKED
from edgellmd.errors import InvalidRequest, NotFound, PermissionDenied, shown
from edgellmd.http import appkeys
from edgellmd.http.console.routes import Route
from edgellmd.http.console.sessions import SESSIONS
from edgellmd.keys import (
    MAX_LIMIT,
    MAX_NAME,
    SCOPES,
    KeysFileError,
    KeysFileNotWritable,
    NoSuchKey,
    append_key,
    load_keys_document,
    parse_keys,
    remove_key,
    set_key_disabled,
)

audit = logging.getLogger("edgellmd.audit")

LIMITS: Final = ("rpm", "tpm", "concurrent", "max_tokens")
MAX_EXPIRES_DAYS: Final = 3650
_CREATE_FIELDS: Final = frozenset({"name", "scopes", "expires_days", "limits"})
_WRITES: Final = web.AppKey("console_key_writes", asyncio.Lock)  # one change of the keys file at a time


def _keys_file(request: web.Request) -> Path:
    return request.app[appkeys.KEY_STORE].path


def writable(path: Path) -> bool:
    """Whether the daemon may replace the keys file (a new file in its directory, then a rename)."""
    try:  # ProtectSystem=strict mounts it read-only: access(2) alone may not say so to root
        read_only = bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        return False
    return not read_only and os.access(path.parent, os.W_OK | os.X_OK)


def _summaries(path: Path) -> list[dict[str, Any]]:
    data = load_keys_document(path)
    keys = parse_keys(data)
    created = {e["id"]: e.get("created") for e in data["keys"]}
    now = datetime.now(UTC)
    return [
        {
            "id": key.id,
            "name": key.name,
            "scopes": sorted(key.scopes),
            "state": key.usable(now) or "active",
            "expires": key.expires.strftime("%Y-%m-%dT%H:%M:%SZ") if key.expires else None,
            "created": created.get(key.id),
            "limits": {k: getattr(key.limits, k) for k in LIMITS if getattr(key.limits, k) is not None},
        }
        for key in keys.values()
    ]


def _refusal(exc: KeysFileError) -> Exception:
    if isinstance(exc, KeysFileNotWritable):
        return PermissionDenied(
            f"{exc}: the daemon may not write its keys file (see the README's Console section)",
            code="keys_file_read_only",
        )
    if isinstance(exc, NoSuchKey):
        return NotFound("no key with this id", code="key_not_found")
    return InvalidRequest(f"the keys file cannot be changed: {exc}", code="keys_file_invalid")


async def list_keys(request: web.Request) -> web.StreamResponse:
    """GET /ui/api/keys: every key without its hash; whether the daemon may change the file."""
    path = _keys_file(request)
    try:
        keys = await asyncio.to_thread(_summaries, path)
    except KeysFileError as exc:
        raise _refusal(exc) from None
    return web.json_response(
        {"keys": keys, "file": str(path), "writable": await asyncio.to_thread(writable, path)}
    )


def _create_fields(body: dict[str, Any]) -> tuple[str, list[str], dict[str, int], datetime | None]:
    unknown = sorted(set(body) - _CREATE_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field {shown(unknown[0], quote=True)}", param=shown(unknown[0]))
    name, scopes = body.get("name"), body.get("scopes")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME or not name.isprintable():
        raise InvalidRequest(f"'name' must be 1 to {MAX_NAME} printable characters", param="name")
    if not isinstance(scopes, list) or not scopes or not all(s in SCOPES for s in scopes):
        raise InvalidRequest(f"'scopes' must be a non-empty list of {', '.join(SCOPES)}", param="scopes")
    limits_in = body.get("limits") or {}
    if not isinstance(limits_in, dict) or set(limits_in) - set(LIMITS):
        raise InvalidRequest(f"'limits' may hold {', '.join(LIMITS)}", param="limits")
    limits: dict[str, int] = {}
    for name_, value in limits_in.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
            raise InvalidRequest(f"'limits.{name_}' must be a positive integer", param=f"limits.{name_}")
        limits[name_] = value
    days = body.get("expires_days")
    if days is not None and (
        isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_EXPIRES_DAYS
    ):
        raise InvalidRequest(
            f"'expires_days' must be null or from 1 to {MAX_EXPIRES_DAYS}", param="expires_days"
        )
    expires = datetime.now(UTC).replace(microsecond=0) + timedelta(days=days) if days else None
    return name, scopes, limits, expires


def _actor(request: web.Request) -> str | None:
    caller = request.get(CALLER)
    return caller.key_id if caller is not None else None


async def _write(request: web.Request, change: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one change of the keys file off the loop, then put the file in force at once."""
    async with request.app[_WRITES]:
        try:
            result = await asyncio.to_thread(change, _keys_file(request), *args, **kwargs)
        except KeysFileError as exc:
            audit.warning(
                "console key change refused: %s",
                type(exc).__name__,
                extra={"peer": request.remote, "key_id": _actor(request)},
            )
            raise _refusal(exc) from None
        await request.app[appkeys.KEY_STORE].reload()
    return result


async def create_key(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/keys {"name", "scopes", "expires_days"?, "limits"?}: a new key; its token shown once."""
    name, scopes, limits, expires = _create_fields(await read_json_object(request))
    key_id, token = await _write(request, append_key, name, scopes, limits=limits, expires=expires)
    audit.info("console key %s created", key_id, extra={"peer": request.remote, "key_id": _actor(request)})
    summary = next(
        (k for k in await asyncio.to_thread(_summaries, _keys_file(request)) if k["id"] == key_id), None
    )
    return web.json_response({"key": summary, "token": token})


def _end_key(request: web.Request, key_id: str) -> None:
    """The key stopped working: end its running requests and its console sessions now."""
    request.app[appkeys.GENERATIONS].abort_keys({key_id}, KEY_REVOKED)
    request.app[SESSIONS].end_keys({key_id})


async def _change(request: web.Request, verb: str) -> web.StreamResponse:
    key_id = request.match_info["key_id"]
    if verb == "revoke":
        await _write(request, remove_key, key_id)
    else:
        await _write(request, set_key_disabled, key_id, verb == "disable")
    if verb != "enable":
        _end_key(request, key_id)
    audit.info("console key %s: %s", key_id, verb, extra={"peer": request.remote, "key_id": _actor(request)})
    return web.json_response({"ok": True, "id": key_id, "action": verb})


async def disable_key(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/keys/{key_id}/disable: the key stops working, and stays in the file."""
    return await _change(request, "disable")


async def enable_key(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/keys/{key_id}/enable: a disabled key works again."""
    return await _change(request, "enable")


async def revoke_key(request: web.Request) -> web.StreamResponse:
    """POST /ui/api/keys/{key_id}/revoke: the key leaves the file for good."""
    return await _change(request, "revoke")


_ID: Final = "{key_id:[0-9a-f]{12}}"
KEY_ROUTES: Final[tuple[Route, ...]] = (
    ("GET", "/ui/api/keys", list_keys, "admin"),
    ("POST", "/ui/api/keys", create_key, "admin"),
    ("POST", f"/ui/api/keys/{_ID}/disable", disable_key, "admin"),
    ("POST", f"/ui/api/keys/{_ID}/enable", enable_key, "admin"),
    ("POST", f"/ui/api/keys/{_ID}/revoke", revoke_key, "admin"),
)


def setup_key_writes(app: web.Application) -> None:
    """The lock that serialises the console's changes to the keys file."""
    app[_WRITES] = asyncio.Lock()
