"""One model's engine in a process of its own (`models[].isolation: process`), as the daemon sees it.

`RemoteEngine` answers what `Engine` and `EmbeddingEngine` answer (tokens, grammars,
submissions, embeddings, occupancy, figures) by calls over a socket pair to an engine
process (`engine.worker`), confined before it loads anything (`engine.confine`). A reader
thread takes its frames: each generation's events go to their event loop as the in-process
engine's do, each call's answer to the thread that waits for it.

A fault in native code then costs that model's requests, not the daemon. When the process
ends without being asked to (a signal: SIGSEGV, SIGABRT from a `GGML_ASSERT`, SIGKILL from
the OOM killer; or any exit), or shows no step progress for `hang_s` while work is pending
(the supervisor kills it; idle, no heartbeat for that long, and at least IDLE_HANG_MIN_S:
a stopped process sends none, and was reported ready until a request came and waited for
it), every generation it held ends with ENGINE_STOPPED (503
`engine_failed` before the first byte, the API family's error event after), every waiting
call fails, `fault` says what happened with the process's last log lines, and the `on_exit`
callbacks hear of it: the registry restarts the model (models.registry).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from edgellmd.engine import (
    BuildInfo,
    EngineConfig,
    EngineError,
    GrammarError,
    ModelInfo,
    ModelLoadError,
    build,
    wire,
)
from edgellmd.engine.config import MediaError, MediaInput, MediaLimits, PreparedMedia
from edgellmd.engine.generation import (
    ENGINE_STOPPED,
    UNLOADED,
    Event,
    Finished,
    Generation,
    GenerationRequest,
)
from edgellmd.errors import escaped
from edgellmd.host import memgroups
from edgellmd.host.hugepages import Collapse

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S: Final = 600.0  # a model that takes longer to load than this is broken
CALL_TIMEOUT_S: Final = 120.0  # tokenizing or compiling a bounded prompt or grammar
CLOSE_TIMEOUT_S: Final = 10.0  # for the process to exit once told to, before it is killed
SUPERVISE_EVERY_S: Final = 0.1
# An idle engine's scheduler beats every half second, in a status frame every quarter: none for
# this long (or hang_s, if longer) is a hang too. Never less: a small hang_s is for steps.
IDLE_HANG_MIN_S: Final = 10.0
# The supervisor itself not run for this long (the daemon stopped, the VM paused): the engines'
# silence meanwhile is not theirs, and their clocks start again.
SUPERVISOR_AWAY_S: Final = 2.0
LOAD_POLL_S: Final = 0.5  # how often a loading process's progress is looked at
LOG_TAIL_LINES: Final = 20  # of the engine process's own output, kept for a fault's report
MAX_REASON_CHARS: Final = 300  # of a reason the engine process gives (why no huge pages)
HANDOFF_SAMPLES: Final = 4096  # events frames whose hand-off latency /admin/status summarises
_FD_PATH: Final = re.compile(r"/proc/self/fd/(\d+)")
_LOG_LINE: Final = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+ .*)")  # worker.main's format


class RemoteGrammar:
    """A grammar compiled in the engine process, by id; whoever holds it frees it or hands it on."""

    __slots__ = ("_engine", "id")

    def __init__(self, engine: RemoteEngine, grammar_id: int) -> None:
        self._engine = engine
        self.id = grammar_id

    def free(self) -> None:
        """Free it in the engine process (once; nothing when the process is gone)."""
        if self.id:
            self._engine.send_quietly({"op": "free_grammar", "grammar": self.id})
            self.id = 0


class _Controls:
    """The model's control-token texts, for `contains_control_text` without a call."""

    def __init__(self, texts: Sequence[str]) -> None:
        ordered = sorted((t for t in texts if t), key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None

    def contains(self, text: str) -> bool:
        return self._pattern is not None and self._pattern.search(text) is not None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _keys_of(value: Any) -> list[str]:
    """The chunk ids in a media answer, whatever else it holds (to let go of them)."""
    pieces = value.get("pieces") if isinstance(value, dict) else None
    if not isinstance(pieces, list):
        return []
    return [p["key"] for p in pieces if isinstance(p, dict) and isinstance(p.get("key"), str)][:1024]


# Lines an engine's native code writes to stderr that reach the log, per window (the rest counted).
NATIVE_LINES: Final = 20
NATIVE_WINDOW_S: Final = 10.0


class NativeLines:
    """How many of an engine's native stderr lines reach the log: native libraries may write a
    line per defect of a client's file (libmpg123 on a corrupt MP3), so at most NATIVE_LINES a
    window of NATIVE_WINDOW_S; the rest are counted, and every line stays in the tail a crash
    report shows."""

    def __init__(self) -> None:
        self.window = -NATIVE_WINDOW_S
        self.shown = 0
        self.held = 0

    def admit(self, now: float) -> tuple[bool, int]:
        """Whether a line at `now` is logged, and how many were held back in the window it closes."""
        closed = 0
        if now - self.window >= NATIVE_WINDOW_S:
            closed, self.window, self.shown, self.held = self.held, now, 0, 0
        if self.shown >= NATIVE_LINES:
            self.held += 1
            return False, closed
        self.shown += 1
        return True, closed


class RemoteEngine:
    """A model served by an engine process; the same surface as the in-process engines."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        name: str,
        kind: str = "generation",
        hang_s: float = 30.0,
        landlock: bool = True,
        address_space: int | None = None,
        memory_max: int | None = None,
    ) -> None:
        """Start the process and wait for its load (blocking: call it off the event loop).

        `memory_max`: the limit of the process's own memory cgroup (host.memgroups), made and
        the process moved into it before it loads anything; where no group can be made the
        process runs without one and says so among its `unconfined`.
        """
        self.config = config
        self.name: Final = name
        self.kind = kind
        self._address_space = address_space  # the process's RLIMIT_AS, when one is set
        self.hang_s = hang_s
        self.fault: str | None = None
        self.fault_kind = "exit"  # or "hang", or the signal's name: edgellm_engine_restarts_total's reason
        self.heartbeat = time.monotonic()  # the supervisor's: it is what the daemon's watchdog judges
        self._progress = time.monotonic()  # the engine's own: its scheduler's last step or idle
        self._busy_since = 0.0  # when work last became pending after none (the hang clock starts there)
        # Set by the loader around its warm-up: the first steps after a load are the slowest (on
        # a busy box, longer than hang_s), so CPU time counts as progress then, as in a load.
        # The warm-up's own timeout bounds an engine that spins.
        self.warming = False
        self._lock = threading.Lock()  # _gens, _calls, _exited, _on_exit, _closing
        self._send_lock = threading.Lock()
        self._gens: dict[int, Generation] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        # Embed calls in flight by call id: the caller's future and its number of inputs.
        self._embeds: dict[int, tuple[concurrent.futures.Future[list[list[float]]], int]] = {}
        self._next = 0
        self._closing = False
        self._exited = False
        self._on_exit: list[Callable[[str | None], None]] = []
        self._status: dict[str, Any] = {}
        self._finished: collections.Counter[str] = collections.Counter()  # by reason, as they arrive
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        # Seconds from an events frame's oldest events leaving the engine's scheduler to the
        # frame read here: the token hand-off that the process boundary adds.
        self._handoff: collections.deque[float] = collections.deque(maxlen=HANDOFF_SAMPLES)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = parent
        keep = [child.fileno()]
        for path in (config.path, config.speculative.draft_path, config.mmproj):
            found = _FD_PATH.fullmatch(str(path)) if path is not None else None
            if found:  # a verified descriptor: the process opens the same file through it
                keep.append(int(found.group(1)))
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - this interpreter, this package's own module
                [sys.executable, "-m", "edgellmd.engine.worker", str(child.fileno())],
                pass_fds=keep,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env={
                    **os.environ,
                    "PYTHONDONTWRITEBYTECODE": "1",
                    # ggml runs gdb on itself for a backtrace when it aborts: not in a confined
                    # process whose death is handled here (the log keeps the assertion's text).
                    "GGML_NO_BACKTRACE": "1",
                    # The process logs what the daemon would show: at the daemon's own level.
                    "EDGELLM_ENGINE_LOG_LEVEL": logging.getLevelName(log.getEffectiveLevel()),
                },
            )
        finally:
            child.close()
        self.pid = self._proc.pid
        threading.Thread(target=self._read_stderr, name=f"engine-log:{name}", daemon=True).start()
        self.memory_group, grouped = self._group(memory_max) if memory_max else (None, None)
        try:
            wire.send(
                parent,
                {
                    "code": wire.CODE,
                    "config": wire.encode_config(config),
                    "name": name,
                    "kind": kind,
                    "landlock": landlock,
                    "address_space": address_space,
                },
            )
            with _loading(self):
                ready = self._await_ready(parent)
        except (OSError, wire.ChannelClosed) as exc:
            self._kill()  # hung, or past LOAD_TIMEOUT_S: it must not go on (gone already otherwise)
            why = self._load_failure(str(exc))
            self._abandon()
            raise ModelLoadError(why) from None
        if ready.get("op") != "ready":
            why = str(ready.get("message") or self._load_failure("no ready"))
            self._abandon()
            raise ModelLoadError(why)
        info = dict(ready["info"])
        info["path"] = Path(info["path"])
        info["pair_tokens"] = tuple(
            tuple(int(t) for t in part) for part in info.get("pair_tokens", ((), (), ()))
        )
        self.info = ModelInfo(**info)
        self.n_vocab = int(ready["n_vocab"])
        self.n_embd = int(ready.get("n_embd", 0))
        self.confined: list[str] = list(ready.get("confined", []))
        self.unconfined: list[str] = list(ready.get("unconfined", []))
        group = self.memory_group
        if group is not None:
            self.confined.append(f"memory at most {group.limit_mib} MiB (its own cgroup v{group.version})")
        elif grouped is not None:
            self.unconfined.append(grouped)
        self.builtin_templates: list[str] = list(ready.get("builtin_templates", []))
        self._controls = _Controls(ready.get("controls", []))
        self.media_kinds = tuple(k for k in ("image", "audio") if k in ready.get("media", []))
        self._status["performance"] = ready.get("performance", {})
        for missing in self.unconfined:
            if not (missing == grouped and missing.startswith(memgroups.HOST_WIDE)):  # said once already
                log.warning("model %s: its engine process runs without %s", name, missing)
        threading.Thread(target=self._read, name=f"engine-channel:{name}", daemon=True).start()
        threading.Thread(target=self._supervise, name=f"engine-supervisor:{name}", daemon=True).start()

    def _await_ready(self, sock: socket.socket) -> dict[str, Any]:
        """The process's first frame (its load's outcome), waited for while it makes progress.

        A load has no steps to count, so progress is the process's CPU time and reads: a process
        stopped or deadlocked while it loads (neither moves for hang_s) is a hang, as one that
        serves is, rather than holding the registry (every load, unload and reload behind it)
        and the daemon's stop for LOAD_TIMEOUT_S. TimeoutError for a hang or a load past that.
        """
        started = last = time.monotonic()
        seen = _work_done(self.pid)
        while not select.select([sock], [], [], LOAD_POLL_S)[0]:
            now, done = time.monotonic(), _work_done(self.pid)
            if done != seen:
                seen, last = done, now
            elif now - last > self.hang_s:
                self.fault_kind = "hang"
                raise TimeoutError(f"it made no progress for {self.hang_s:g} s and was killed")
            if now - started > LOAD_TIMEOUT_S:
                raise TimeoutError(f"it took longer than {LOAD_TIMEOUT_S:g} s and was killed")
        sock.settimeout(LOAD_TIMEOUT_S)  # the frame is under way: read it whole
        try:
            return wire.recv(sock)
        finally:
            sock.settimeout(None)

    def _group(self, limit: int) -> tuple[memgroups.EngineGroup | None, str | None]:
        """Move the process into a memory cgroup of its own: the group, or what is missing in words."""
        groups = memgroups.shared()
        if isinstance(groups, str):
            return None, f"{memgroups.HOST_WIDE}{groups}"
        try:
            return groups.place(self.pid, self.name, limit), None
        except memgroups.GroupError as exc:
            return None, f"a memory cgroup: {exc}"

    def _release_group(self) -> None:
        """Remove the memory group once the process is gone (a second call does nothing)."""
        group, self.memory_group = self.memory_group, None
        if group is not None:
            group.remove()

    # ---- the process's output and frames ----------------------------------------------------

    def _read_stderr(self) -> None:
        stream = self._proc.stderr
        assert stream is not None  # noqa: S101 - started with a pipe
        native = NativeLines()
        with stream:
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip()[:500]
                if not line:
                    continue
                # Kept escaped: the tail becomes a stop's reason, shown on /admin/status, by
                # edgellmctl, in the console, the audit chain and STATUS=, and native code prints
                # a model file's own strings (llama.cpp's metadata dump at debug level).
                self._tail.append(escaped(line))
                # The worker's own records ("LEVEL logger message") at their level; anything
                # else is native code writing to stderr (a GGML_ASSERT's message): a warning.
                found = _LOG_LINE.match(line)
                if found is None:
                    show, held = native.admit(time.monotonic())
                    if held:
                        log.warning("engine %s: %d more lines of native output not shown", self.name, held)
                    if not show:
                        continue
                level = logging.getLevelName(found.group(1)) if found else logging.WARNING
                log.log(
                    level if isinstance(level, int) else logging.WARNING,
                    "engine %s: %s",
                    self.name,
                    found.group(2) if found else line,
                )

    def _load_failure(self, why: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(2)
        code = self._proc.poll()
        how = (
            f"exited with {code}"
            if code is not None and code >= 0
            else f"was killed by {_signal_name(code or 0)}"
        )
        last = "; ".join(list(self._tail)[-3:])
        limit = (
            f" (its address space is limited to {self._address_space // (1024 * 1024)} MiB: too low?)"
            if self._address_space
            else ""
        )
        if self.memory_group is not None and self.memory_group.oom_kills() > 0:
            limit += (
                f" (killed at its memory cgroup's limit of {self.memory_group.limit_mib} MiB: "
                "raise memory_group_headroom_mb?)"
            )
        return f"the engine process {how} while loading ({why})" + (f": {last}" if last else "") + limit

    def _read(self) -> None:
        try:
            while True:
                message = wire.recv(self._sock)
                op = message.get("op")
                if op == "events":
                    step = message.get("ack")
                    self._deliver(message.get("items", []), step if type(step) is int else None)
                    made = message.get("made")
                    if isinstance(made, float):  # the same clock: CLOCK_MONOTONIC is the machine's
                        self._handoff.append(max(0.0, time.monotonic() - made))
                elif op == "status":
                    self._status = message
                    if isinstance(message.get("heartbeat"), int | float):  # never back: frames
                        self._progress = max(self._progress, float(message["heartbeat"]))  # race
                elif "id" in message:
                    self._answer(message)
        except (wire.ChannelClosed, OSError):
            pass
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            # Not what a worker sends: the process is not to be trusted any more.
            with self._lock:
                if self.fault is None:
                    self.fault = "its engine process sent a malformed frame and was killed"
                    self.fault_kind = "protocol"
            log.error("model %s: %s", self.name, self.fault)  # noqa: TRY400 - the frame is the story, not a traceback
            self._kill()
        self._ended()

    def _deliver(self, items: list[Any], step: int | None) -> None:
        """Hand a frame's events to their generations, one wake-up of each event loop per frame
        (scheduler._deliver's), and tell the engine its frame `step` went on once the loop has
        run the consumers it woke (their next turns: a stream's write)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, list[Event]]]] = {}
        for remote_id, events in items:
            decoded = [wire.decode_event(e) for e in events]  # read whole, whoever it is for
            with self._lock:
                gen = self._gens.get(int(remote_id))
            if gen is None:
                continue
            ends = [e for e in decoded if isinstance(e, Finished)]
            if ends:
                with self._lock:  # counted before the slot shows free: readers see both
                    self._finished[ends[0].reason] += 1
                    self._gens.pop(int(remote_id), None)
            by_loop.setdefault(gen.loop, []).append((gen, decoded))
        ack = None if step is None else {"op": "ack", "step": step}
        last = list(by_loop)[-1] if by_loop else None  # the daemon's one loop, in practice
        for loop, pushes in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._push_all, loop, pushes, ack if loop is last else None)
            except RuntimeError:  # the loop closed: nobody listens any more
                if loop is last and ack is not None:
                    self.send_quietly(ack)
        if last is None and ack is not None:
            self.send_quietly(ack)

    def _push_all(
        self,
        loop: asyncio.AbstractEventLoop,
        pushes: list[tuple[Generation, list[Event]]],
        ack: dict[str, Any] | None,
    ) -> None:
        for gen, events in pushes:
            gen.push(events)
        if ack is not None:  # after the consumers woken above have taken their turn
            loop.call_soon(loop.call_soon, self.send_quietly, ack)

    def _answer(self, message: dict[str, Any]) -> None:
        with self._lock:
            future = self._calls.pop(int(message["id"]), None)
        if future is None:
            return
        error = message.get("error")
        if isinstance(error, dict):
            kind, text = error.get("kind"), str(error.get("message", "engine error"))
            if kind == "media":
                limit = error.get("limit")
                future.set_exception(MediaError(text, limit=limit if isinstance(limit, str) else None))
            else:
                future.set_exception(GrammarError(text) if kind == "grammar" else EngineError(text))
        else:
            future.set_result(message.get("result"))

    def _ended(self) -> None:
        """The channel is gone: the process exited, was killed, or was told to close."""
        try:
            code = self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
            code = self._proc.wait()
        with self._lock:
            closing = self._closing
            if self.fault is None and not closing:
                how = f"exited with status {code}" if code >= 0 else f"was killed by {_signal_name(code)}"
                self.fault_kind = "exit" if code >= 0 else _signal_name(code).lower()
                group = self.memory_group
                if group is not None and group.oom_kills() > 0:
                    how = f"was killed at its memory limit ({group.limit_mib} MiB, its own cgroup)"
                    self.fault_kind = "oom"
                last = "; ".join(list(self._tail)[-3:])
                self.fault = f"its engine process {how}" + (f" (last output: {last})" if last else "")
            gens, self._gens = list(self._gens.values()), {}
            self._finished["error"] += len(gens)
            calls, self._calls = list(self._calls.values()), {}
            self._exited = True
            callbacks, self._on_exit = self._on_exit, []
        error = ENGINE_STOPPED if self.fault is not None else UNLOADED
        for gen in gens:
            done = gen.final.completion_tokens if gen.final is not None else 0
            gen.push_threadsafe([Finished("error", len(gen.request.prompt_tokens), done, error=error)])
        for call in calls:
            if not call.done():
                call.set_exception(EngineError(error))
        with contextlib.suppress(OSError):
            self._sock.close()
        self._release_group()
        for callback in callbacks:
            try:
                callback(self.fault)
            except Exception:
                log.exception("an exit callback of model %s failed", self.name)

    def _supervise(self) -> None:
        """Kill a process that shows no step progress for hang_s while work is pending, or no
        heartbeat for max(hang_s, IDLE_HANG_MIN_S) while idle."""
        seen: tuple[int, ...] = ()
        moved = 0.0  # while warming: when the process last did work (CPU time, faults, reads)
        # The clocks start here: the load may have taken longer than hang_s.
        back = last = time.monotonic()  # when the supervisor last came back from away; last ran
        idle_s = max(self.hang_s, IDLE_HANG_MIN_S)
        while True:
            with self._lock:
                if self._exited:
                    return
                pending = bool(self._gens) or bool(self._calls)
            now = time.monotonic()
            self.heartbeat = now
            if now - last > SUPERVISOR_AWAY_S:
                back = now
            last = now
            if self.warming and pending and (done := _work_done(self.pid)) != seen:
                seen, moved = done, now
            since = now - max(self._progress, moved, back, self._busy_since if pending else 0.0)
            if since > (self.hang_s if pending else idle_s):
                with self._lock:
                    if self.fault is None:
                        self.fault = (
                            f"its engine process showed no progress for {self.hang_s:g} s and was killed"
                            if pending
                            else f"its idle engine process sent no heartbeat for {idle_s:g} s and was killed"
                        )
                        self.fault_kind = "hang"
                log.error("model %s: %s", self.name, self.fault)
                self._kill()
                return
            time.sleep(SUPERVISE_EVERY_S)

    def _abandon(self) -> None:
        """After a failed load: the process gone, its channel closed."""
        self._kill()
        self._proc.wait()
        self._sock.close()
        self._release_group()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()

    # ---- calls -----------------------------------------------------------------------------

    def send_quietly(self, message: dict[str, Any]) -> None:
        """Send a frame that needs no answer; nothing when the process is gone."""
        with contextlib.suppress(OSError), self._send_lock:
            wire.send(self._sock, message)

    def _start_call(self, message: dict[str, Any]) -> tuple[int, concurrent.futures.Future[Any]]:
        """Send a call; its id and the future its answer resolves (EngineError when it cannot go)."""
        with self._lock:
            if self._exited or self._closing:
                raise EngineError(self._why_gone())
            self._next += 1
            call_id = self._next
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._note_pending()  # first: a call that finds the engine idle starts the hang clock
            self._calls[call_id] = future
        try:
            with self._send_lock:
                wire.send(self._sock, {**message, "id": call_id})
        except OSError:  # the process is gone: it died (the reader may not have seen it yet), or closes
            with self._lock:
                self._calls.pop(call_id, None)
            raise EngineError(self._why_gone(died=True)) from None
        return call_id, future

    def _call(self, message: dict[str, Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        call_id, future = self._start_call(message)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise EngineError("the engine did not answer in time") from None

    def _why_gone(self, *, died: bool = False) -> str:
        """Why a call finds no process: ENGINE_STOPPED when it stopped by itself (a restart comes,
        so the caller may ask again: `api.session.on_restarted`), else it is being closed."""
        if self._closing:
            return "engine is shutting down"
        return ENGINE_STOPPED if died or self.fault is not None else "engine is shutting down"

    def _note_pending(self) -> None:
        """Under the lock, before new work is recorded: the hang clock starts with the first."""
        if not self._gens and not self._calls:
            self._busy_since = time.monotonic()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids, by the engine process (any thread; blocks for the answer)."""
        result = self._call(
            {"op": "tokenize", "text": text, "add_special": add_special, "parse_special": parse_special}
        )
        return [int(t) for t in result]

    def tokenize_segments(
        self, segments: Sequence[tuple[str, bool]], *, add_special: bool = True
    ) -> list[int]:
        """(text, trusted) segments to token ids (control tokens parsed in trusted text only)."""
        result = self._call(
            {"op": "tokenize_segments", "segments": [list(s) for s in segments], "add_special": add_special}
        )
        return [int(t) for t in result]

    def contains_control_text(self, text: str) -> bool:
        """True when `text` holds the text of one of the vocabulary's control tokens."""
        return self._controls.contains(text)

    def compile_grammar(self, grammar: str, copies: int = 1) -> list[RemoteGrammar]:
        """Compile a grammar in the engine process into `copies` ids (GrammarError if refused)."""
        ids = self._call({"op": "grammar", "grammar": grammar, "copies": copies})
        return [RemoteGrammar(self, int(i)) for i in ids]

    def prepare_media(self, item: MediaInput, limits: MediaLimits) -> PreparedMedia:
        """Decode and encode an image or clip in the engine process (MediaError for the client's
        input); its chunks stay held there until `release_media`."""
        result = self._call(
            {
                "op": "media",
                "kind": item.kind,
                "data": base64.b64encode(item.data).decode("ascii"),
                "format": item.format,
                "scope": item.scope,
                "limits": dataclasses.asdict(limits),
            }
        )
        try:
            # A bound for what a worker may answer, not the context: a clip longer than the
            # context is the client's (a 400 from the prompt's check), not a lying process.
            return wire.decode_media(result, self.n_vocab, wire.MAX_MEDIA_POSITIONS)
        except ValueError as exc:  # a process that answers what no worker answers is not trusted
            self.send_quietly({"op": "release_media", "keys": _keys_of(result)})
            raise EngineError(
                f"the engine process answered a media call with what no worker sends ({exc})"
            ) from None

    def release_media(self, keys: Sequence[str]) -> None:
        """Let go of chunks `prepare_media` held in the engine process."""
        if keys:
            self.send_quietly({"op": "release_media", "keys": list(keys)})

    def apply_builtin_template(self, name: str, messages: Sequence[tuple[str, str]]) -> str:
        """Render with a llama.cpp built-in chat template, in the engine process."""
        return str(self._call({"op": "template", "name": name, "messages": [list(m) for m in messages]}))

    def build_info(self) -> BuildInfo:
        """What the llama.cpp build can do, as this engine process's llama.cpp says (blocking)."""
        return build.decode(self._call({"op": "build_info"}))

    def collapse_huge_pages(self) -> Collapse:
        """Back the engine process's resident weights, KV cache and compute buffers with huge
        pages (host.hugepages), in the process that holds them (blocking; a load's bound)."""
        answer = self._call({"op": "huge_pages"}, LOAD_TIMEOUT_S)
        try:
            unsupported = answer["unsupported"]
            return Collapse(
                spans=int(answer["spans"]),
                bytes=int(answer["bytes"]),
                seconds=float(answer["seconds"]),
                unsupported=None if unsupported is None else str(unsupported)[:MAX_REASON_CHARS],
                failed=int(answer["failed"]),
                failed_bytes=int(answer["failed_bytes"]),
            )
        except (TypeError, KeyError, ValueError) as exc:  # not what a worker sends
            raise EngineError("the engine process answered the huge-page pass with nonsense") from exc

    def probe(self, what: str, path: str = "") -> str:
        """Tests only (answered with EDGELLM_ENGINE_TEST_HOOKS=1): try what the confinement refuses."""
        return str(self._call({"op": "probe", "what": what, "path": path}))

    def submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, grammar: Any | None = None
    ) -> Generation:
        """Queue a generation in the engine process; its events arrive on `loop`."""
        if len(request.prompt_tokens) == 0:
            raise EngineError("empty prompt")
        if request.sampling.grammar is not None and grammar is None:
            grammar = self.compile_grammar(request.sampling.grammar)[0]
        gen = Generation(request, loop)
        with self._lock:
            if self._exited or self._closing:
                if isinstance(grammar, RemoteGrammar):
                    grammar.free()
                raise EngineError("engine is shutting down")
            self._note_pending()
            self._gens[gen.id] = gen
        gid = None
        if isinstance(grammar, RemoteGrammar):
            gid, grammar.id = grammar.id, 0  # the engine process owns it from here
        gen.on_cancel(lambda g: self.send_quietly({"op": "cancel", "gen": g.id}))
        try:
            with self._send_lock:
                wire.send(
                    self._sock,
                    {"op": "submit", "gen": gen.id, "request": wire.encode_request(request), "grammar": gid},
                )
        except OSError:
            pass  # the reader ends it with ENGINE_STOPPED
        return gen

    def wake(self) -> None:
        """Cancellations reach the engine process as they happen (`Generation.on_cancel`)."""

    def forget_scopes(self, scopes: Collection[str]) -> None:
        """Drop the cached KV state of these cache scopes in the engine process (`Engine.forget_scopes`)."""
        if self.kind == "generation":
            self.send_quietly({"op": "forget", "scopes": sorted(scopes)})

    def submit_embed(self, inputs: Sequence[Sequence[int]]) -> concurrent.futures.Future[list[list[float]]]:
        """Embed tokenized inputs in the engine process; resolves with unit vectors (or scores).

        No deadline of its own: a call of a thousand inputs takes as long as it takes, and an
        engine that stops making progress is killed by the supervisor (`hang_s`), which fails
        the call with ENGINE_STOPPED. `abandon` withdraws it.
        """
        out: concurrent.futures.Future[list[list[float]]] = concurrent.futures.Future()
        call_id, answer = self._start_call({"op": "embed", "inputs": [list(i) for i in inputs]})
        with self._lock:
            self._embeds[call_id] = (out, len(inputs))

        def done(answer: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._embeds.pop(call_id, None)
            if out.cancelled():  # withdrawn by its caller: nobody waits for it
                return
            error = answer.exception()
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
                if error is not None:
                    out.set_exception(error)
                else:
                    out.set_result([[float(x) for x in v] for v in answer.result()])

        answer.add_done_callback(done)
        return out

    def abandon(self, future: concurrent.futures.Future[list[list[float]]]) -> None:
        """Withdraw an embed call whose caller left: the engine process drops what it has not done."""
        future.cancel()
        with self._lock:
            call_id = next((i for i, (out, _) in self._embeds.items() if out is future), None)
        if call_id is not None:
            self.send_quietly({"op": "abandon", "id": call_id})

    # ---- state -----------------------------------------------------------------------------

    def occupancy(self) -> tuple[int, int]:
        """Slots busy and generations waiting: what the daemon holds there, split by slot count.
        An embedding or reranking model's, as its engine counts them: the first call's inputs
        (up to `slots`) busy, the calls after it waiting."""
        with self._lock:
            held = len(self._gens)
            embeds = [n for _, n in self._embeds.values()]
        if embeds:
            return min(embeds[0], self.config.slots), len(embeds) - 1
        busy = min(held, self.config.slots)
        return busy, held - busy

    def held_by_tenant(self) -> collections.Counter[str]:
        """Generations the daemon holds there (running or waiting), by their key."""
        with self._lock:
            return collections.Counter(gen.request.share.tenant for gen in self._gens.values())

    @property
    def busy_slots(self) -> int:
        """Slots generating (by the daemon's count)."""
        return self.occupancy()[0]

    @property
    def queue_depth(self) -> int:
        """Generations waiting for a slot (by the daemon's count)."""
        return self.occupancy()[1]

    @property
    def finished(self) -> collections.Counter[str]:
        """Generations ended, by finish reason (their last events, counted as they arrive)."""
        with self._lock:
            return collections.Counter(self._finished)

    @property
    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        with self._lock:
            return not self._gens and not self._calls

    @property
    def tokens_generated(self) -> int:
        """Tokens generated since the load (from the last status frame)."""
        return int(self._status.get("tokens_generated", 0))

    def performance(self) -> dict[str, Any]:
        """The engine's figures for /admin/status (from the last status frame)."""
        figures = self._status.get("performance")
        return dict(figures) if isinstance(figures, dict) else {}

    def process(self) -> dict[str, Any]:
        """The engine process for /admin/status: pid, confinement, resident memory."""
        rss = 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            rss = int(Path(f"/proc/{self.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        group = self.memory_group
        return {
            "pid": self.pid,
            "rss_bytes": rss,
            "memory_group": None
            if group is None
            else {"path": str(group.path), "limit_bytes": group.limit, "usage_bytes": group.usage()},
            "confined": self.confined,
            "unconfined": self.unconfined,
            "handoff": self.handoff(),
        }

    def handoff(self) -> dict[str, Any]:
        """The token hand-off's latency over the last HANDOFF_SAMPLES frames: p50 and p99 in ms."""
        samples = sorted(self._handoff.copy())  # one C call: safe beside the reader's appends
        if not samples:
            return {"frames": 0, "p50_ms": None, "p99_ms": None}

        def at(q: float) -> float:
            return round(samples[min(len(samples) - 1, int(q * len(samples)))] * 1000, 3)

        return {"frames": len(samples), "p50_ms": at(0.5), "p99_ms": at(0.99)}

    def on_exit(self, callback: Callable[[str | None], None]) -> None:
        """Call `callback(fault)` once the process is gone (`fault` None after `close`)."""
        with self._lock:
            if not self._exited:
                self._on_exit.append(callback)
                return
        callback(self.fault)

    def close(self) -> None:
        """Tell the process to finish (its requests end with "unloaded"), wait, kill if it will not."""
        with self._lock:
            if self._exited:
                return
            self._closing = True
        self.send_quietly({"op": "close"})
        try:
            self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
            self._proc.wait()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while not self.exited and time.monotonic() < deadline:
            time.sleep(0.01)
        self._release_group()  # gone when close returns (the reader's _ended may not be there yet)

    @property
    def exited(self) -> bool:
        """True once the process is gone and everything it held was ended."""
        with self._lock:
            return self._exited


_LOADING: set[RemoteEngine] = set()  # engine processes loading now (abort_loads)
_LOADING_LOCK: Final = threading.Lock()


@contextlib.contextmanager
def _loading(engine: RemoteEngine) -> Iterator[None]:
    with _LOADING_LOCK:
        _LOADING.add(engine)
    try:
        yield
    finally:
        with _LOADING_LOCK:
            _LOADING.discard(engine)


def abort_loads(names: Collection[str]) -> int:
    """The daemon stops: kill the engine processes of these models that are still loading
    (their loads fail at once, rather than holding the stop until they end: minutes for a
    large model); how many were."""
    with _LOADING_LOCK:
        loading = [engine for engine in _LOADING if engine.name in names]
    for engine in loading:
        engine._kill()
    return len(loading)


def _work_done(pid: int) -> tuple[int, ...]:
    """What a process has done so far: its CPU ticks (every thread's), page faults (a mapped
    model file read in) and bytes read; () once it is gone (its channel closes then)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ()
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command's name, which may hold spaces
    # minflt, majflt, utime, stime
    done = [int(fields[7]), int(fields[9]), int(fields[11]) + int(fields[12])]
    try:
        io = Path(f"/proc/{pid}/io").read_text().split()
        done += [int(io[io.index("rchar:") + 1]), int(io[io.index("read_bytes:") + 1])]
    except (OSError, ValueError, IndexError):  # no task I/O accounting in this kernel
        pass
    return tuple(done)
