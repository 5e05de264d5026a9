"""An engine process: one model's llama.cpp context and scheduler, served to the daemon over a socket.

`python -m edgellmd.engine.worker FD` is started by `engine.remote.RemoteEngine` with one end
of a socket pair as FD. It reads its configuration (the first frame), confines itself
(`engine.confine`), loads the model with the same `Engine` (or `EmbeddingEngine`) a thread
would run, says `ready` with the model's facts, then serves the daemon's calls until the
channel closes or it is told to close: tokenizing and grammar compiling on a small pool of its
own, submissions and cancellations, and every generation's events, one frame per scheduler
step. A status frame every `STATUS_EVERY_S` carries the scheduler's heartbeat, occupancy and
figures. If the daemon goes, so does this process (`PR_SET_PDEATHSIG`).

`python -m edgellmd.engine.worker --build-info` prints what the llama.cpp build can do, as
JSON, and exits (`engine.build`'s probe, for a daemon that loads no llama.cpp of its own).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from edgellmd.engine import build, wire
from edgellmd.engine.config import (
    EngineConfig,
    EngineError,
    GrammarError,
    MediaError,
    MediaInput,
    MediaLimits,
)
from edgellmd.engine.confine import confine
from edgellmd.engine.embedding import ABANDONED, EmbeddingEngine
from edgellmd.engine.generation import Event, Finished, Generation, GenerationRequest
from edgellmd.engine.native import build_info, builtin_chat_templates
from edgellmd.engine.sampling import CompiledGrammar
from edgellmd.engine.scheduler import Engine
from edgellmd.host.hugepages import collapse_resident

log = logging.getLogger(__name__)

STATUS_EVERY_S: Final = 0.25
# Longest an events frame waits for the daemon to say it sent them on (`ack`): the scheduler's
# lockstep with the event loop that writes its tokens, across the process boundary, as
# scheduler._deliver keeps it with a loop in its own process (a daemon formatting a step's
# chunks during the next decode takes a core from llama.cpp's threads). Bounded: a busy or
# stuck daemon never stalls the engine for longer.
ACK_WAIT_S: Final = 0.02
PROMPT_THREADS: Final = 2  # as the daemon's own prompt pool: tokenizing and grammars, off the scheduler
# The calls answered on the pool (each frame with an id, answered by one with the same id);
# `media` is such a call too, answered on a thread of its own (`_dispatch`).
_CALLS: Final = frozenset(
    ("tokenize", "tokenize_segments", "grammar", "probe", "template", "build_info", "huge_pages")
)
_LIMIT_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(MediaLimits))
TEST_HOOKS_ENV: Final = "EDGELLM_ENGINE_TEST_HOOKS"  # "1": answer `probe` calls (tests of the confinement)


class Forwarded(Generation):
    """A generation whose events go to the daemon instead of a consumer here."""

    __slots__ = ("remote_id", "worker")

    def __init__(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, remote_id: int, worker: Worker
    ) -> None:
        super().__init__(request, loop)
        self.remote_id = remote_id
        self.worker = worker

    def push_threadsafe(self, events: list[Event]) -> None:
        """From the scheduler thread: stamped now, the start of the token's hand-off."""
        with contextlib.suppress(RuntimeError):  # loop closed: the process is ending
            self._loop.call_soon_threadsafe(self.worker.forward, self, events, time.monotonic())

    def push(self, events: list[Event]) -> None:
        """On this process's loop: hand the events to the next frame."""
        self.worker.forward(self, events)


class Worker:
    """Serves one engine over the channel."""

    def __init__(
        self, sock: socket.socket, engine: Engine | EmbeddingEngine, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.sock = sock
        self.engine = engine
        self.loop = loop
        self._send_lock = threading.Lock()
        self._grammars: dict[int, CompiledGrammar] = {}
        # Embed calls queued on the engine, by the daemon's call id (the reader thread adds,
        # the engine thread's answer removes: single dict operations).
        self._embeds: dict[int, Future[list[list[float]]]] = {}
        self._next_grammar = 0
        self._gens: dict[int, Forwarded] = {}
        self._outbox: list[list[Any]] = []
        self._made = 0.0  # when the outbox's oldest events left the scheduler (monotonic)
        self._step = 0  # the last events frame sent, and the daemon's acknowledgement of it
        self._acked = threading.Event()
        self._ended = False  # a generation finished in the outbox
        self._pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="engine-prompt")
        # Both threads running from the start (as api.pool.started does for the daemon's pools):
        # a ThreadPoolExecutor starts the second only when two calls first overlap, hours in.
        gate = threading.Barrier(PROMPT_THREADS)
        for ready in [self._pool.submit(gate.wait) for _ in range(PROMPT_THREADS)]:
            ready.result()
        # Images and clips are decoded and encoded on a thread of their own, one at a time: a
        # clip of minutes takes seconds, and on the prompt threads two of them held up every
        # other request's tokenizing for as long.
        self._media = ThreadPoolExecutor(1, thread_name_prefix="engine-media")
        self._media.submit(lambda: None).result()
        self._done = asyncio.Event()

    def send(self, message: dict[str, Any]) -> None:
        """One frame to the daemon (any thread)."""
        with self._send_lock:
            wire.send(self.sock, message)

    def forward(self, gen: Forwarded, events: list[Event], made: float | None = None) -> None:
        """Queue a generation's events for the frame that ends this loop turn (`made`: when the
        scheduler handed them over; the frame carries its oldest, for the hand-off's latency)."""
        if not self._outbox:
            self.loop.call_soon(self._flush)
            self._made = time.monotonic() if made is None else made
        self._outbox.append([gen.remote_id, [wire.encode_event(e) for e in events]])
        if any(isinstance(e, Finished) for e in events):
            self._gens.pop(gen.remote_id, None)
            self._ended = True

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if self._ended:  # figures first: a reply the daemon sends is never ahead of its status
            self._ended = False
            self._safe_send(self._status_frame())
        if items:
            self._step += 1
            self._acked.clear()
            self._safe_send({"op": "events", "items": items, "made": self._made, "ack": self._step})
            # On this loop's thread: the scheduler's wait for this loop (scheduler._deliver)
            # now lasts until the daemon has sent these tokens on, or ACK_WAIT_S.
            self._acked.wait(ACK_WAIT_S)

    def acknowledged(self, step: int) -> None:
        """From the reader thread: the daemon sent events frame `step` on to its clients."""
        if step == self._step:
            self._acked.set()

    def _safe_send(self, message: dict[str, Any]) -> None:
        try:
            self.send(message)
        except OSError:  # the daemon is gone; PR_SET_PDEATHSIG ends this process
            self._done.set()

    # ---- the daemon's calls ---------------------------------------------------------------

    def read_forever(self) -> None:
        """On a thread of its own: read frames and hand each to where it runs."""
        try:
            while True:
                message = wire.recv(self.sock)
                op = message.get("op")
                if op == "close":
                    break
                try:
                    self._dispatch(op, message)
                except (KeyError, ValueError, TypeError, EngineError):
                    # A frame the daemon should never send; the reader keeps reading.
                    log.exception("engine channel: a %r frame could not be handled", op)
        except (wire.ChannelClosed, OSError):
            pass
        finally:
            self.loop.call_soon_threadsafe(self._done.set)

    def _dispatch(self, op: object, message: dict[str, Any]) -> None:
        if op == "media":
            self._media.submit(self._call, message)
        elif op in _CALLS:
            self._pool.submit(self._call, message)
        elif op == "embed":  # queued on the engine's thread: no pool thread waits for it
            self._embed(message)
        elif op == "abandon":
            self._abandon(int(message["id"]))
        # Submits and what must stay in order with them are handled here, not on the loop:
        # the loop waits up to ACK_WAIT_S at every step (_flush), and a request queued only
        # after that wait would stop the next step, not the one in progress (_preempt_for).
        elif op == "submit":
            self._submit(message)
        elif op == "cancel":
            self._cancel(int(message["gen"]))
        elif op == "forget" and isinstance(self.engine, Engine):
            self.engine.forget_scopes([str(scope) for scope in message["scopes"]])
        elif op == "ack":
            self.acknowledged(int(message.get("step", 0)))
        elif op == "release_media" and isinstance(self.engine, Engine):  # in order with submits
            self.engine.release_media([str(k) for k in message.get("keys", [])])
        elif op == "free_grammar":
            self._free_grammar(int(message["grammar"]))

    def _embed(self, message: dict[str, Any]) -> None:
        """Queue an embed call; its answer goes back when the engine has every vector."""
        call_id = int(message["id"])
        engine = self.engine
        try:
            if not isinstance(engine, EmbeddingEngine):
                raise EngineError("a generation model has no embeddings")  # noqa: TRY301 - answered below
            future = engine.submit_embed([[int(t) for t in item] for item in message["inputs"]])
        except EngineError as exc:
            self._safe_send({"id": call_id, "error": {"kind": "engine", "message": str(exc)}})
            return
        self._embeds[call_id] = future

        def done(finished: Future[list[list[float]]]) -> None:
            self._embeds.pop(call_id, None)
            if finished.cancelled():
                self._safe_send({"id": call_id, "error": {"kind": "engine", "message": ABANDONED}})
            elif (error := finished.exception()) is not None:
                self._safe_send({"id": call_id, "error": {"kind": "engine", "message": str(error)}})
            else:
                self._safe_send({"id": call_id, "result": finished.result()})

        future.add_done_callback(done)

    def _abandon(self, call_id: int) -> None:
        """The daemon's caller left: the engine drops the call's inputs not yet embedded."""
        future = self._embeds.get(call_id)
        if future is not None and isinstance(self.engine, EmbeddingEngine):
            self.engine.abandon(future)

    def _call(self, message: dict[str, Any]) -> None:
        call_id = message.get("id")
        try:
            result = self._answer(message)
        except GrammarError as exc:
            self._safe_send({"id": call_id, "error": {"kind": "grammar", "message": str(exc)}})
        except MediaError as exc:
            error = {"kind": "media", "message": str(exc), "limit": exc.limit}
            self._safe_send({"id": call_id, "error": error})
        except EngineError as exc:
            self._safe_send({"id": call_id, "error": {"kind": "engine", "message": str(exc)}})
        except Exception:  # a bug: the call fails, the process serves on
            log.exception("engine call %s failed", message.get("op"))
            self._safe_send({"id": call_id, "error": {"kind": "engine", "message": "internal engine error"}})
        else:
            self._safe_send({"id": call_id, "result": result})

    def _answer(self, message: dict[str, Any]) -> Any:
        op = message["op"]
        engine = self.engine
        if op == "tokenize":
            return engine.tokenize(
                str(message["text"]),
                add_special=bool(message["add_special"]),
                parse_special=bool(message["parse_special"]),
            )
        if op == "tokenize_segments":
            if not isinstance(engine, Engine):
                raise EngineError("an embedding model has no chat prompts")
            segments = [(str(text), bool(trusted)) for text, trusted in message["segments"]]
            return engine.tokenize_segments(segments, add_special=bool(message["add_special"]))
        if op == "grammar":
            if not isinstance(engine, Engine):
                raise EngineError("an embedding model has no grammars")
            compiled = engine.compile_grammar(str(message["grammar"]), int(message["copies"]))
            ids = []
            for grammar in compiled:
                self._next_grammar += 1
                self._grammars[self._next_grammar] = grammar
                ids.append(self._next_grammar)
            return ids
        if op == "media":
            if not isinstance(engine, Engine):
                raise EngineError("an embedding model reads no media")
            limits = MediaLimits(**{k: v for k, v in dict(message["limits"]).items() if k in _LIMIT_FIELDS})
            item = MediaInput(
                str(message["kind"]),
                base64.b64decode(str(message["data"]), validate=True),
                None if message.get("format") is None else str(message["format"]),
                scope=str(message.get("scope", "")),
            )
            return wire.encode_media(engine.prepare_media(item, limits))
        if op == "template":
            from edgellmd.engine.native import apply_builtin_template  # noqa: PLC0415 - rare

            pairs = [(str(role), str(content)) for role, content in message["messages"]]
            return apply_builtin_template(str(message["name"]), pairs)
        if op == "build_info":
            return build.encode(build_info())
        if op == "huge_pages":  # after the load: this process holds the weights, not the daemon
            return dataclasses.asdict(collapse_resident())
        if op == "probe" and os.environ.get(TEST_HOOKS_ENV) == "1":
            if message["what"] == "garbage":  # a subverted process: events the daemon cannot read
                self.send({"op": "events", "items": [[0, [["f", "not a reason"]]]]})
                return "sent"
            return probe(str(message["what"]), str(message.get("path", "")))
        raise EngineError(f"unknown call {op!r}")

    def _submit(self, message: dict[str, Any]) -> None:
        """On the reader thread (the engine's submit is thread-safe); answers go by the loop."""
        remote_id = int(message["gen"])
        engine = self.engine
        gid = message.get("grammar")
        grammar = self._grammars.pop(int(gid), None) if gid is not None else None
        request = wire.decode_request(message["request"])
        gen = Forwarded(request, self.loop, remote_id, self)
        if not isinstance(engine, Engine):
            gen.push_threadsafe(
                [
                    Finished(
                        "error", len(request.prompt_tokens), 0, error="not a generation model", admitted=False
                    )
                ]
            )
            return
        self._gens[remote_id] = gen
        try:
            engine.submit(request, self.loop, grammar, generation=gen)
        except EngineError as exc:
            gen.push_threadsafe(
                [Finished("error", len(request.prompt_tokens), 0, error=str(exc), admitted=False)]
            )

    def _cancel(self, remote_id: int) -> None:
        gen = self._gens.get(remote_id)
        if gen is not None:
            gen.cancel()
            if isinstance(self.engine, Engine):
                self.engine.wake()

    def _free_grammar(self, grammar_id: int) -> None:
        grammar = self._grammars.pop(grammar_id, None)
        if grammar is not None:
            grammar.free()

    def _status_frame(self) -> dict[str, Any]:
        engine = self.engine
        busy, waiting = engine.occupancy()
        message: dict[str, Any] = {
            "op": "status",
            "heartbeat": engine.heartbeat,
            "busy": busy,
            "waiting": waiting,
        }
        if isinstance(engine, Engine):
            message["performance"] = engine.performance()
            message["tokens_generated"] = engine.tokens_generated
        return message

    async def _status(self) -> None:
        """Every STATUS_EVERY_S, and before the events that end a generation (`_flush`)."""
        while not self._done.is_set():
            self._safe_send(self._status_frame())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), STATUS_EVERY_S)

    async def serve(self) -> None:
        """Until the channel closes or the daemon says close."""
        reader = threading.Thread(target=self.read_forever, name="engine-channel", daemon=True)
        reader.start()
        status = asyncio.create_task(self._status())
        await self._done.wait()
        status.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._media.shutdown(wait=False, cancel_futures=True)


def probe(what: str, path: str) -> str:
    """Try one thing the confinement must refuse (tests only): what happened, in words."""
    try:
        if what == "inet":
            socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        elif what == "read":
            Path(path).read_bytes()
        elif what == "write":
            Path(path).write_bytes(b"x")
        elif what == "allocate":  # a runaway engine: `path` MiB, every page touched
            block = bytearray(int(path) * 1024 * 1024)
            for page in range(0, len(block), 4096):
                block[page] = 1
            return f"allocated {len(block) // (1024 * 1024)} MiB"
        else:
            return "unknown probe"
    except OSError as exc:
        return f"refused: {exc.strerror or exc}"
    return "allowed"


def _model_files(config: EngineConfig) -> list[Path]:
    """The files the model loads from (their real paths behind /proc/self/fd/N too)."""
    out: list[Path] = []
    for path in (config.path, config.speculative.draft_path, config.mmproj):
        if path is None:
            continue
        out.append(path)
        if str(path).startswith("/proc/self/fd/"):
            out.append(Path(os.readlink(path)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one engine on the socket whose descriptor is the first argument."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--build-info"]:  # engine.build's probe: what the build can do, as JSON
        sys.stdout.write(json.dumps(build.encode(build_info())) + "\n")
        return 0
    logging.basicConfig(
        stream=sys.stderr,
        level=os.environ.get("EDGELLM_ENGINE_LOG_LEVEL", "WARNING"),
        format="%(levelname)s %(name)s %(message)s",
    )
    with socket.socket(fileno=int(args[0])) as sock:
        return _serve(sock)


def _serve(sock: socket.socket) -> int:
    """Load the engine the daemon's hello describes and serve it until the daemon goes."""
    hello = wire.recv(sock)
    if hello.get("code") != wire.CODE:  # before anything else of the hello is read
        wire.send(sock, {"op": "load_error", "message": wire.CODE_CHANGED})
        return 1
    config = wire.decode_config(hello["config"], EngineConfig)
    confined = confine(
        _model_files(config),
        address_space=hello.get("address_space"),
        landlock=bool(hello.get("landlock", True)),
    )
    try:
        engine: Engine | EmbeddingEngine = (
            EmbeddingEngine(config, name=hello["name"])
            if hello["kind"] in ("embedding", "rerank")
            else Engine(config, name=hello["name"])
        )
    except EngineError as exc:
        wire.send(sock, {"op": "load_error", "message": str(exc)})
        return 1
    info = asdict(engine.info)
    info["path"] = str(info["path"])
    ready: dict[str, Any] = {
        "op": "ready",
        "pid": os.getpid(),
        "info": info,
        "n_vocab": engine.n_vocab,
        "confined": confined.done,
        "unconfined": confined.missing,
        "builtin_templates": builtin_chat_templates(),
    }
    if isinstance(engine, Engine):
        ready["controls"] = sorted(engine.controls.by_text)
        ready["media"] = list(engine.media_kinds)
        ready["performance"] = engine.performance()
    else:
        ready["n_embd"] = engine.n_embd
    wire.send(sock, ready)
    loop = asyncio.new_event_loop()
    worker = Worker(sock, engine, loop)
    try:
        loop.run_until_complete(worker.serve())
    finally:
        engine.close()
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
