"""Process signals: SIGTERM and SIGINT stop the daemon, SIGHUP reloads; once stopping, all three are ignored.

asyncio's `loop.add_signal_handler` puts the default disposition back when the loop closes,
and the interpreter does the same for every Python-level handler when it finalizes. Either
leaves a window between the loop's end and the process's exit (the interpreter frees the
models, joins threads) in which a second SIGTERM, from an impatient operator or a supervisor
that repeats itself, kills the daemon by the signal instead of letting it exit 0. So these are
plain `signal.signal` handlers while the loop runs, and `SIG_IGN` (which finalization keeps)
from the moment it stops serving; SIGKILL still ends a daemon that will not exit. A socket
pair given to `signal.set_wakeup_fd` wakes the loop when a signal lands on a thread other than
the main one, as asyncio's own does.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Final

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL: Final = signal.SIGHUP


class Signals:
    """Route stop and reload signals into an event loop; ignore them once it has ended."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, on_stop: Callable[[], None], on_reload: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._on_stop = on_stop
        self._on_reload = on_reload
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._attached = False

    def attach(self) -> None:
        """Install the handlers (call on the main thread, inside the running loop)."""
        reader, writer = socket.socketpair()
        for sock in (reader, writer):
            sock.setblocking(False)
        self._wake = (reader, writer)
        self._loop.add_reader(reader.fileno(), self._drain)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._attached = True
        for signum in (*STOP_SIGNALS, RELOAD_SIGNAL):
            signal.signal(signum, self._handle)

    def detach(self) -> None:
        """Stop routing into the loop and ignore these signals from now until the process exits."""
        self._attached = False
        for signum in (*STOP_SIGNALS, RELOAD_SIGNAL):
            signal.signal(signum, signal.SIG_IGN)
        if self._wake is None:
            return
        signal.set_wakeup_fd(-1)
        reader, writer = self._wake
        self._loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
        self._wake = None

    def _drain(self) -> None:
        # The bytes only wake the loop; the Python-level handler does the work.
        if self._wake is None:
            return
        try:
            while self._wake[0].recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            return

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if not self._attached or self._loop.is_closed():
            return  # a signal that was pending while detach() ran: already stopping
        callback = self._on_reload if signum == RELOAD_SIGNAL else self._on_stop
        # A Python handler runs between two bytecodes of the main thread, possibly in the
        # middle of a loop callback: hand the work to the loop rather than doing it here.
        self._loop.call_soon_threadsafe(callback)
