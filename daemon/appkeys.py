"""Every typed key of the aiohttp application and request state, in one place."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Final

from aiohttp import web

if TYPE_CHECKING:
    from edgellmd.registry import Registry
    from edgellmd.settings import Settings

SETTINGS: Final = web.AppKey["Settings"]("settings")
REGISTRY: Final = web.AppKey["Registry"]("registry")
EXECUTOR: Final = web.AppKey[ThreadPoolExecutor]("executor")

# Per-request state (request[...]): aiohttp has no typed request keys, so the names live here.
REQUEST_ID: Final = "edgellm.request_id"
