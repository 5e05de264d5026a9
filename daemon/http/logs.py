"""Logging: one JSON object per line (or plain text) with its request id; no parser error or key secret."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Final

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from edgellmd.errors import escaped
from edgellmd.redaction import redact

request_id: Final = contextvars.ContextVar[str]("request_id", default="-")

_RESERVED: Final = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
# aiohttp's own loggers (aiohttp/log.py). They propagate to the root handler like ours do.
AIOHTTP_LOGGERS: Final = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)
_CAUSES_LOOKED_AT: Final = 16  # a chain of causes can be a cycle
SCRUBBED_MESSAGE: Final = "malformed HTTP request: %s (request bytes not logged)"
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"  # logging.format: text


def _protocol_error(exc: BaseException | None) -> BaseException | None:
    """The HTTP parser error in `exc` or its causes: its message quotes the request's bytes."""
    seen = 0
    while exc is not None and seen < _CAUSES_LOOKED_AT:
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class ProtocolErrorFilter(logging.Filter):
    """Strips HTTP parser errors (their text and traceback hold raw header bytes) from records.

    The record keeps its logger; its message becomes a generic line naming only the kind of
    error, and its traceback and arguments go. It is a client's malformed request, already
    answered (a 400, or a closed connection), not the daemon's fault: logged at INFO at most
    (aiohttp logs a body that does not decode, met again while it drains the rest of the
    request, as an unhandled exception at ERROR), and dropped where INFO is not logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Scrub the record in place; False when it is left below the logger's level."""
        found = _protocol_error(record.exc_info[1] if record.exc_info else None)
        if found is None and isinstance(record.args, tuple):
            found = next(
                (a for a in record.args if isinstance(a, BaseException) and _protocol_error(a) is not None),
                None,
            )
        if found is not None:
            record.msg = SCRUBBED_MESSAGE
            record.args = (type(found).__name__,)
            record.exc_info = None
            record.exc_text = None
            record.stack_info = None
            if record.levelno > logging.INFO:
                record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
                return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


_SCRUB: Final = ProtocolErrorFilter()


def guard_library_loggers() -> None:
    """Put the scrubbing filter on aiohttp's loggers, whatever handler ends up writing them."""
    for name in AIOHTTP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ProtocolErrorFilter) for f in logger.filters):
            logger.addFilter(_SCRUB)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message, request id, extras."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record."""
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
            "request_id": redact(request_id.get()),  # a client's own X-Request-Id may be anything sane
        }
        entry.update(
            {
                k: redact(v) if isinstance(v, str) else v
                for k, v in vars(record).items()
                if k not in _RESERVED and not k.startswith("_")
            }
        )
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        # ASCII: json escapes only C0 controls itself, and a line's readers (journalctl, tail, a
        # log viewer) would meet C1 controls (U+009B is a CSI), bidi overrides and U+2028 raw.
        return json.dumps(entry, default=str, ensure_ascii=True)


class TextFormatter(logging.Formatter):
    """The plain-text line, with API key secrets redacted like the JSON one, and a message's
    line breaks and other controls escaped (`\\x0a`): one record, one line, whatever a client
    sent. A traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """The line before any traceback."""
        # Line breaks (a client's request path could start a forged line), other controls
        # (terminal escapes) and bidirectional overrides are written as their escapes.
        record.message = escaped(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        """Render the record."""
        return redact(super().format(record))


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = redact(request_id.get())
        return True


def configure(level: str, fmt: str) -> None:
    """Send every log line to stdout (journald picks it up) at `level`, as JSON or text."""
    handler = logging.StreamHandler(sys.stdout)
    # On the handler too: any logger's record that carries a parser error (a handler that
    # logged a RequestPayloadError, asyncio) is scrubbed before it is written.
    handler.addFilter(_SCRUB)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_RequestIdFilter())
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    guard_library_loggers()
    # aiohttp's access log would duplicate ours (and print query strings); ours is in app.py.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("watchdog.observers.inotify").addFilter(_WatchdogStopRace())


class _WatchdogStopRace(logging.Filter):
    """watchdog logs an error when its inotify thread reads one more event while the observer
    stops (a race inside watchdog, harmless: the event is dropped with the observer). It is
    not an error of this daemon's, and operators' alerts on error lines must not fire on it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()
