"""Logging: one JSON object per line (or plain text), each carrying the request id it belongs to."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Final

request_id: Final = contextvars.ContextVar[str]("request_id", default="-")

_RESERVED: Final = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message, request id, extras."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record."""
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": request_id.get(),
        }
        entry.update({k: v for k, v in vars(record).items()
                      if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def configure(level: str, fmt: str) -> None:
    """Send every log line to stdout (journald picks it up) at `level`, as JSON or text."""
    handler = logging.StreamHandler(sys.stdout)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_RequestIdFilter())
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log would duplicate ours (and print query strings); ours is in app.py.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
