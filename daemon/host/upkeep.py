"""The daemon's background loops (the keys file's watch, the ledger's upkeep, the console's
sessions, systemd's STATUS=) outlive a pass that raises: what they keep going (revocations,
seals and retries, the status line) must not end unsaid with one exception."""

from __future__ import annotations

import logging


class PassFailures:
    """A loop's failed passes, logged once for a run of the same error (again after a pass that
    worked, or for another error): a loop that fails every few seconds writes one traceback."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._last = ""

    def failed(self, exc: BaseException, message: str, *args: object) -> None:
        """Called in the `except` block of a pass that raised `exc`: logged with its traceback
        unless the pass before failed the same way."""
        if repr(exc) != self._last:
            self._log.error(message, *args, exc_info=exc)
        self._last = repr(exc)

    def passed(self) -> None:
        """A pass worked: the next failure is said again."""
        self._last = ""
