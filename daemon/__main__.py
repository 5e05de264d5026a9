"""Command-line entry point of `edgellmd`: validate a config, or serve it.

The first thing `main` does is hold SIGTERM, SIGINT and SIGHUP (block them); it lets them
through once its own handlers are in place, so a signal in the first moments of start-up
(systemd stopping a unit that is still starting, an operator's reload) is noted and
honoured, never the default action that kills the process with status 143 or 129. Nothing
slow is imported before that: this module's imports are the standard library's lightest,
and the package's own `__init__` reads its version only when asked. What is left is the
interpreter's own start; a launcher that starts the daemon with these signals blocked (the
mask survives exec) closes that too, and they are honoured once the handlers are in.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import argparse
    import asyncio
    import logging
    from types import FrameType

    from aiohttp import web

    from edgellmd.host.cpu import Pinning
    from edgellmd.settings import Settings

SWITCH_INTERVAL_S: Final = 0.0005
FINAL_WRITE_S: Final = 2.0  # after the drain deadline, for cut streams to send their error event
EARLY_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class EarlySignals:
    """Notes stop and reload signals from the start of `main` until the daemon's own take over."""

    def __init__(self) -> None:
        self.stop = False
        self.reloads = 0

    def install(self) -> None:
        """Catch SIGTERM, SIGINT and SIGHUP from now on."""
        for signum in EARLY_SIGNALS:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if signum == signal.SIGHUP:
            self.reloads += 1  # nothing is loaded yet: the first load reads the newest files
        else:
            self.stop = True


def _log() -> logging.Logger:
    import logging  # noqa: PLC0415 - see the module docstring

    return logging.getLogger("edgellmd")


def build_parser() -> argparse.ArgumentParser:
    """Return the daemon's argument parser."""
    import argparse  # noqa: PLC0415 - see the module docstring

    from edgellmd import __version__  # noqa: PLC0415 - importlib.metadata: slow

    parser = argparse.ArgumentParser(
        prog="edgellmd", description="Serve GGUF models over an OpenAI-compatible API."
    )
    parser.add_argument("--version", action="version", version=f"edgellmd {__version__}")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", metavar="FILE", help="serve with this YAML configuration")
    what.add_argument(
        "--check-config",
        metavar="FILE",
        help="validate this configuration, print every problem, exit 0 if valid",
    )
    return parser


async def serve(
    settings: Settings, pinning: Pinning | None = None, early: EarlySignals | None = None
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (bounded by shutdown_timeout_s).

    SIGHUP reloads: the lockfile is verified again and changed models are swapped in.
    """
    import asyncio  # noqa: PLC0415 - see the module docstring

    from edgellmd.host.signals import Signals  # noqa: PLC0415
    from edgellmd.http import appkeys  # noqa: PLC0415
    from edgellmd.http.app import create_app, start_server  # noqa: PLC0415

    app = create_app(settings, pinning=pinning)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[object]] = set()

    def reload_on_signal() -> None:
        # SIGHUP (systemctl reload): re-verify the lockfile and swap changed models.
        if stop.is_set():
            _log().info("SIGHUP ignored: shutting down")
            return
        _log().info("SIGHUP: reloading models")
        task: asyncio.Task[object] = loop.create_task(app[appkeys.REGISTRY].reload(trigger="signal"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)
        task.add_done_callback(_report_reload)

    # Before the server starts: a SIGTERM while it starts is a stop, never a kill that
    # leaves preload copies behind.
    signals = Signals(loop, on_stop=stop.set, on_reload=reload_on_signal)
    signals.attach()
    if early is not None and early.stop:  # asked to stop while it was starting
        _log().info("stop requested during start-up: exiting before serving")
        signals.detach()
        return
    try:
        runner = await start_server(app, settings.server.host, settings.server.port)
        _log().info("listening on %s:%d", settings.server.host, settings.server.port)
        try:
            await stop.wait()
            app[appkeys.NOTIFIER].stopping()
            _log().info(
                "shutting down: no new connections, in-flight requests get %.0f s",
                settings.server.shutdown_timeout_s,
            )
            await drain(app, runner, settings.server.shutdown_timeout_s)
        finally:
            # Stops accepting, lets handlers finish up to the timeout, then runs every cleanup
            # context (schedulers stopped, models freed).
            await runner.cleanup()
            app[appkeys.NOTIFIER].close()
    finally:
        signals.detach()


def _report_reload(task: asyncio.Task[object]) -> None:
    """Log a SIGHUP reload that raised (its outcomes are logged by the registry otherwise)."""
    if not task.cancelled() and task.exception() is not None:
        _log().error("SIGHUP reload failed", exc_info=task.exception())


async def drain(app: web.Application, runner: web.AppRunner, deadline_s: float) -> None:
    """Stop accepting; let running generations finish until the deadline, then end them with an error."""
    from edgellmd.api.context import DRAINING  # noqa: PLC0415 - see the module docstring
    from edgellmd.engine.generation import SHUTTING_DOWN  # noqa: PLC0415
    from edgellmd.http import appkeys  # noqa: PLC0415

    app[DRAINING].set()  # readiness says so: a balancer's next probe sends no more here
    registry = app.get(appkeys.REGISTRY)
    if registry is not None:  # an engine that stops now is not restarted into the stop
        registry.stop_restarts()
    for site in runner.sites:
        server = site._server  # aiohttp keeps the asyncio server private; closing it stops accepting
        if server is not None:
            server.close()
    running = app[appkeys.GENERATIONS]
    if await running.wait_empty(deadline_s):
        return
    _log().warning("shutdown deadline passed: ending %d running request(s) with an error", len(running))
    running.abort_all(SHUTTING_DOWN)
    await running.wait_empty(FINAL_WRITE_S)  # time for the handlers to write their last event


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon and return its exit status."""
    # First of all: from here until a handler is in place, stop and reload signals wait.
    signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_SIGNALS)
    try:
        args = build_parser().parse_args(argv)
        if args.check_config:
            return _check_main(args.check_config)
        early = EarlySignals()
        early.install()
    finally:
        # Held signals arrive now (those a launcher held too): at EarlySignals' handlers when
        # serving, otherwise (a config check, a usage error) by their default action.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, EARLY_SIGNALS)
    return _serve_main(args.config, early)


def _check_main(config: str) -> int:
    from edgellmd.settings import check_config  # noqa: PLC0415 - see the module docstring

    problems = check_config(config)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{config}: configuration is valid")
    return 1 if problems else 0


def _serve_main(config: str, early: EarlySignals) -> int:
    import asyncio  # noqa: PLC0415 - imported once the early signal handlers are in place

    from edgellmd import __version__  # noqa: PLC0415
    from edgellmd.host.cpu import pin_cpus  # noqa: PLC0415
    from edgellmd.http import logs  # noqa: PLC0415
    from edgellmd.settings import ConfigError, load_settings  # noqa: PLC0415

    try:
        settings = load_settings(config)
    except ConfigError as exc:
        print(f"edgellmd: invalid configuration {config}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    logs.configure(settings.logging.level, settings.logging.format)
    # The scheduler threads come back from every llama_decode needing the GIL for a few
    # hundred microseconds of Python; with the default 5 ms switch interval a busy event
    # loop can hold them off for a whole token's time (measured: 10-20% of throughput).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Before any thread exists: threads inherit the affinity of the thread that starts them.
    pinning = pin_cpus(settings.host.cpus)
    _log().info(
        "edgellmd %s starting on %s:%d with %d model(s)",
        __version__,
        settings.server.host,
        settings.server.port,
        len(settings.models),
    )
    if early.stop:
        _log().info("stop requested during start-up: exiting before serving")
        return 0
    from edgellmd.keys import KeysFileError  # noqa: PLC0415
    from edgellmd.ledger.store import LedgerError  # noqa: PLC0415

    try:
        asyncio.run(serve(settings, pinning, early))
    except KeysFileError as exc:
        _log().error("cannot start: keys file refused: %s", exc)
        return 1
    except LedgerError as exc:
        _log().error("cannot start: %s", exc)
        return 1
    except OSError as exc:
        _log().error("cannot serve on %s:%d: %s", settings.server.host, settings.server.port, exc)
        return 1
    _log().info("edgellmd stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
