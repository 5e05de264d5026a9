"""The front door's typed keys of the application and request state (the adapters' are in api/context.py)."""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import web

from edgellmd.api.pool import FairPool
from edgellmd.engine.generation import Running
from edgellmd.host.cpu import Pinning
from edgellmd.host.metrics import Metrics
from edgellmd.host.nvml import GpuMonitor
from edgellmd.host.systemd import Notifier
from edgellmd.host.traces import Tracer
from edgellmd.http.ratelimit import RateLimiter
from edgellmd.keys import ApiKey, KeyStore
from edgellmd.models.registry import Registry
from edgellmd.settings import Settings

SETTINGS: Final = web.AppKey("settings", Settings)
REGISTRY: Final = web.AppKey("registry", Registry)
EXECUTOR: Final = web.AppKey("executor", FairPool)
KEY_STORE: Final = web.AppKey("key_store", KeyStore)
GENERATIONS: Final = web.AppKey("generations", Running)  # running, for the shutdown drain
METRICS: Final = web.AppKey("metrics", Metrics)
GPU_MONITOR: Final = web.AppKey("gpu_monitor", GpuMonitor)
PINNING: Final = web.AppKey("pinning", Pinning)  # the CPUs the process was pinned to
NOTIFIER: Final = web.AppKey("notifier", Notifier)
LOAD_TASK: Final = web.AppKey("load_task", asyncio.Task[None])  # the first load of every model
RATE_LIMITER: Final = web.AppKey("rate_limiter", RateLimiter)
TRACER: Final = web.AppKey("tracer", Tracer)  # request spans over OTLP (host.traces); off by default

# Per-request state (request[...]).
REQUEST_ID: Final = web.RequestKey("request_id", str)
API_KEY: Final = web.RequestKey("api_key", ApiKey)  # the key that authenticated the request
CORS_ORIGIN: Final = web.RequestKey("cors_origin", str)  # an allowed Origin the request came from
