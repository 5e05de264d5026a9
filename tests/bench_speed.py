"""Benchmark: edgellmd's speed features side by side, on the demo model, against llama.cpp's server.

Run: `.venv/bin/python -m tests.bench_speed [--only SCENARIO,...] [--rounds 3] [--llama-server
PATH]` (scenarios below; all by default). Every scenario starts each server it compares (edgellmd
as a process of its own, llama-server when a binary built from the same llama.cpp is given),
measures it with `edgellmctl bench`'s client and stops it, round after round, so that the
configurations alternate on the same machine; it prints each round and the medians, then one
JSON line. Not a test: the figures depend on the machine.

- plain: 64-token streams (`ignore_eos`), 1 and 8 at once: edgellmd against llama-server.
- single: plain's single stream alone, in turns of two requests: tokens/s, the decode rate after
  the first token and the time to it, so that the per-turn ratios of many short turns
  (`--rounds 24`) resolve about 1% where plain's few long rounds resolve about 10%.
- partial: 3, 5 and 7 streams on 8 slots: edgellmd with and without `batch_padding`, and
  llama-server.
- speculation: rewrite a passage with one word changed (chat, temperature 0), 1 stream and 8:
  no speculation against prompt lookup (and llama-server's `ngram-simple`).
- drafts-2: the same rewrite with prompt lookup, 2 streams: drafts of different lengths
  evened into one ubatch (`batch_padding`) or not, and llama-server's `ngram-simple`.
- draft: the same rewrite with a draft model (the demo model cut to its first 4 of 18 layers,
  the only model of its vocabulary to be had offline), against llama-server's `-md`.
- prompt-cache: a shared system prompt of about 2,000 tokens, 8 users holding conversations
  (a long question per turn) round-robin over 4 slots: time to first token with the prompt
  cache off and on.
- shared-prompt: the same system prompt, 16 users with short questions over 4 slots: TTFT p50
  against a full prefill of the same request (a system prompt of its own).
- kv: f16 against q8_0 keys and values: KV bytes per token (what the memory budget counts and
  the daemon's resident memory), tokens/s at 1 and 8 streams.
- two-models: one model with 4 streams, against two models in one daemon, one or both with 4.
- isolation: plain's streams with the engine in a process of its own (`isolation: process`)
  against on the daemon's own threads (`thread`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from edgellmctl.bench import BenchConfig, BenchSummary, run_bench
from edgellmd.models.budget import kv_cache_bytes
from edgellmd.settings import parse_settings
from tests.bench_structured import demo_model
from tests.serving import free_port

MODEL = "gemma3-270m"
READY_TIMEOUT_S = 120.0
# About 300 tokens of plain prose: the reply should copy it, one word changed.
PASSAGE = (
    "The harbour town wakes before the sun. Fishing boats leave the quay in a slow line, their "
    "lamps still lit, and the gulls follow them out past the breakwater. In the square the baker "
    "opens his shutters and the smell of bread drifts down to the water. By seven the market "
    "stalls are up: crates of silver fish on ice, baskets of lemons, ropes and nets and tins of "
    "paint for the hulls. Old men sit on the bench by the church and argue about the weather, "
    "as they have every morning for forty years. The ferry from the island arrives at eight, "
    "bringing children to the school on the hill and workers to the boatyard, where the sound "
    "of hammers starts at half past. At noon the town grows quiet. The shops close for lunch, "
    "the cats sleep in the shade of the fish market, and only the tide keeps moving, lifting "
    "the small boats at their moorings and setting them down again. In the afternoon the boats "
    "come home, low in the water, and the whole town gathers at the quay to see what the sea "
    "has given. Then the lamps are lit again, one by one, along the harbour wall."
)
REWRITE = (
    "Copy the following passage exactly, word for word, changing only the word 'harbour' to "
    "'port' wherever it appears. Write nothing else.\n\n" + PASSAGE
)
# About 2,000 tokens of instructions every user's conversation starts with.
SYSTEM_RULES = [
    "Answer in plain English, in short sentences.",
    "Never invent facts; say when you do not know.",
    "Quote the user's own words when you refer to them.",
    "Give numbers with their units.",
    "Prefer lists when there are more than three items.",
    "Keep every answer under one hundred words unless asked for more.",
    "Do not repeat the question back to the user.",
    "When a request is unclear, ask one question to make it clear.",
]


def system_prompt(paragraphs: int = 14) -> str:
    """A long shared system prompt (14 paragraphs: about 2,000 tokens of the demo vocabulary)."""
    lines = ["You are the help desk assistant of the harbour office."]
    for n in range(paragraphs):
        rules = " ".join(f"Rule {n}.{i}: {rule}" for i, rule in enumerate(SYSTEM_RULES))
        lines.append(f"Part {n} of the house rules. {rules}")
    return "\n".join(lines)


# ---- servers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """One server configuration to measure: edgellmd with these model settings, or llama-server."""

    label: str
    models: Sequence[dict[str, Any]] = ()  # edgellmd: each model's settings (file filled in)
    llama_server: Sequence[str] | None = None  # llama-server: its arguments after -m FILE


@dataclass
class Running:
    url: str
    pid: int


@contextlib.contextmanager
def serve(server: Server, model: Path, workdir: Path, binary: Path | None) -> Iterator[Running]:
    """Start `server` on a free loopback port, wait until it is ready, stop it afterwards."""
    port = free_port()
    if server.llama_server is not None:
        assert binary is not None
        argv = [str(binary), "-m", str(model), "--port", str(port), "-a", MODEL, *server.llama_server]
        ready = "/health"
    else:
        config = {
            "server": {"host": "127.0.0.1", "port": port, "max_tokens_limit": 4096},
            "models": [{"file": str(model), **m} for m in server.models],
            "lock": {"allow_unsigned": True},
            "lifecycle": {"watch": False, "preload_dir": None},
            "logging": {"level": "warning"},
        }
        path = workdir / f"{server.label.replace(' ', '_')}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "edgellmd", "--config", str(path)]
        ready = "/readyz"
    log = (workdir / "server.log").open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.label} exited during start-up; see {workdir / 'server.log'}")
            if _ready(url + ready):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.label} did not become ready")
            time.sleep(0.2)
        yield Running(url, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 - loopback
            return bool(answer.status == 200)
    except OSError:
        return False


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of a process so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench(url: str, **options: Any) -> BenchSummary:
    config = BenchConfig(base_url=url, model=options.pop("model", MODEL), **options)
    return asyncio.run(run_bench(config))


# ---- scenarios ------------------------------------------------------------------------------------

Measure = Callable[[Running], dict[str, float]]


def rounds(
    servers: Sequence[tuple[Server, Measure]],
    args: argparse.Namespace,
    model: Path,
    workdir: Path,
    *,
    together: bool = False,
) -> dict[str, dict[str, float]]:
    """Measure every server once per round, alternating; the median of each figure.

    By default each server starts afresh for its turn (what it measures may depend on what the
    server saw before). With `together`, every server runs for the whole scenario and the
    order flips every round (A B, B A, ...), so that the first server's figures and the
    second's are taken seconds apart, drift of the machine and all; the first figures of the
    other servers are then also given as per-round ratios to the first server's, and their
    median (`ratio ...`), which is steadier than a ratio of medians.
    """
    seen: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        running: dict[str, Running] = {}
        if together:
            for server, _ in servers:
                running[server.label] = stack.enter_context(serve(server, model, workdir, args.llama_server))
        for n in range(args.rounds):
            order = list(servers) if not together or n % 2 == 0 else list(servers)[::-1]
            this_round: dict[str, dict[str, float]] = {}
            for server, measure in order:
                if together:
                    figures = measure(running[server.label])
                else:
                    with serve(server, model, workdir, args.llama_server) as one:
                        figures = measure(one)
                this_round[server.label] = figures
                print(
                    f"  round {n + 1} {server.label}: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                )
            first = servers[0][0].label
            for label, figures in this_round.items():
                for key, value in figures.items():
                    seen.setdefault(label, {}).setdefault(key, []).append(value)
                    if together and label != first and this_round[first].get(key):
                        ratio = this_round[first][key] / value
                        seen.setdefault(f"ratio {first} / {label}", {}).setdefault(key, []).append(ratio)
    return {label: {k: statistics.median(v) for k, v in fig.items()} for label, fig in seen.items()}


def streams(c1: dict[str, Any], c8: dict[str, Any]) -> Measure:
    """Aggregate tokens/s at one stream and at eight."""

    def measure(running: Running) -> dict[str, float]:
        one = bench(running.url, **c1)
        eight = bench(running.url, **c8)
        figures = {"tok_s_1": one.tokens_per_s, "tok_s_8": eight.tokens_per_s}
        for label, summary in (("1", one), ("8", eight)):
            if summary.drafted_tokens:
                figures[f"accepted_{label}"] = (summary.accepted_tokens or 0) / summary.drafted_tokens
        return figures

    return measure


def streams_of(n: int, ask: dict[str, Any]) -> Measure:
    """Aggregate tokens/s of `n` streams, and the share of drafts kept."""

    def measure(running: Running) -> dict[str, float]:
        summary = bench(running.url, concurrency=n, **ask)
        figures = {f"tok_s_{n}": summary.tokens_per_s}
        if summary.drafted_tokens:
            figures[f"accepted_{n}"] = (summary.accepted_tokens or 0) / summary.drafted_tokens
        return figures

    return measure


PLAIN_1 = {"concurrency": 1, "requests": 6, "max_tokens": 64, "ignore_eos": True, "warmup": 2}
PLAIN_8 = {"concurrency": 8, "requests": 48, "max_tokens": 64, "ignore_eos": True, "warmup": 2}
EDGE_8 = {"name": MODEL, "slots": 8, "context_size": 2048, "chat_template": "gemma"}
EDGE_4 = {"name": MODEL, "slots": 4, "context_size": 4096, "chat_template": "gemma"}  # the long prompts


def llama_threads(args: argparse.Namespace) -> list[str]:
    """llama-server's thread arguments, as many as edgellmd gets."""
    return ["-t", str(args.threads), "-tb", str(args.threads)]


LLAMA_8 = ["-np", "8", "-c", "16384"]


def plain(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    threads = llama_threads(args)
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd", [{**EDGE_8, "threads": args.threads}]), streams(PLAIN_1, PLAIN_8))
    ]
    if args.llama_server:
        servers.append((Server("llama-server", llama_server=[*LLAMA_8, *threads]), streams(PLAIN_1, PLAIN_8)))
    return rounds(servers, args, model, workdir, together=True)


SINGLE = {"concurrency": 1, "requests": 2, "max_tokens": 64, "ignore_eos": True, "warmup": 0}


def split_stream(running: Running) -> dict[str, float]:
    """One stream in two requests: tokens/s, the decode rate after the first token (per-stream
    mean) and the time to the first token (p50, ms)."""
    summary = bench(running.url, **SINGLE)
    return {
        "tok_s_1": summary.tokens_per_s,
        "decode_tok_s": summary.stream_tokens_per_s,
        "ttft_ms": 1000 * summary.ttft_p50_s,
    }


def single(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    """The single stream apart, in short turns both servers take in alternation."""
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd", [{**EDGE_8, "threads": args.threads}]), split_stream)
    ]
    if args.llama_server:
        servers.append((Server("llama-server", llama_server=[*LLAMA_8, *llama_threads(args)]), split_stream))
    return rounds(servers, args, model, workdir, together=True)


def at_streams(*counts: int) -> Measure:
    """Aggregate tokens/s of 64-token streams at each of `counts` streams at once."""

    def measure(running: Running) -> dict[str, float]:
        return {
            f"tok_s_{n}": bench(running.url, **{**PLAIN_8, "concurrency": n, "requests": 4 * n}).tokens_per_s
            for n in counts
        }

    return measure


def partial(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    """A partly busy box: the step sizes a CPU's kernels compute slowly, padded or not."""
    edge = {**EDGE_8, "threads": args.threads}
    measure = at_streams(3, 5, 7)
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd", [edge]), measure),
        (Server("edgellmd unpadded", [{**edge, "batch_padding": False}]), measure),
    ]
    if args.llama_server:
        servers.append((Server("llama-server", llama_server=[*LLAMA_8, *llama_threads(args)]), measure))
    return rounds(servers, args, model, workdir, together=True)


def drafts_2(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    """Two sequences drafting at once: their drafts differ in length, evened rows or not."""
    ask = {"endpoint": "chat", "prompt": REWRITE, "temperature": 0.0, "max_tokens": 400, "warmup": 1}
    measure = streams_of(2, {**ask, "requests": 6})
    base = {**EDGE_8, "threads": args.threads, "speculative": {"mode": "ngram", "max_draft": 24}}
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd ngram", [base]), measure),
        (Server("edgellmd ngram unpadded", [{**base, "batch_padding": False}]), measure),
    ]
    if args.llama_server:
        threads = llama_threads(args)
        ngram = [*LLAMA_8, *threads, "--spec-type", "ngram-simple"]
        servers.append((Server("llama-server ngram-simple", llama_server=ngram), measure))
    return rounds(servers, args, model, workdir, together=True)


def speculation(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    ask = {"endpoint": "chat", "prompt": REWRITE, "temperature": 0.0, "max_tokens": 400, "warmup": 1}
    c1 = {**ask, "concurrency": 1, "requests": 2}
    c8 = {**ask, "concurrency": 8, "requests": 8}
    base = {**EDGE_8, "threads": args.threads}
    # Drafts up to 24 tokens (llama-server's ngram-simple drafts up to 48 by default): on a
    # CPU each checked position costs a row of the output layer, so long drafts pay only on
    # text that copies its input, as here.
    spec = {"mode": "ngram", "max_draft": 24}
    threads = llama_threads(args)
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd plain", [base]), streams(c1, c8)),
        (Server("edgellmd ngram", [{**base, "speculative": spec}]), streams(c1, c8)),
        # Drafting at every batch size, to see what it costs a full batch (the default stops at 2).
        (
            Server("edgellmd ngram all", [{**base, "speculative": {**spec, "max_sequences": 8}}]),
            streams(c1, c8),
        ),
    ]
    if args.llama_server:
        servers += [
            (Server("llama-server plain", llama_server=[*LLAMA_8, *threads]), streams(c1, c8)),
            (
                Server(
                    "llama-server ngram-simple",
                    llama_server=[*LLAMA_8, *threads, "--spec-type", "ngram-simple"],  # its defaults
                ),
                streams(c1, c8),
            ),
        ]
    return rounds(servers, args, model, workdir)


def truncated_model(model: Path, out: Path, layers: int) -> Path:
    """A copy of `model` with only its first `layers` blocks: a draft model of the same vocabulary.

    No smaller model of the demo model's vocabulary can be had offline; the model cut short
    is one (its predictions are the full model's early layers read out by the same head).
    """
    import gguf  # noqa: PLC0415 - the benchmark's own dependency (a test extra)

    reader = gguf.GGUFReader(model)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for tensor in kept:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return out


DRAFT_LAYERS = 4
LLAMA_DRAFT = ["--spec-type", "draft-simple", "--spec-draft-n-max", "16"]


def draft(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    draft_file = truncated_model(model, workdir / "draft.gguf", DRAFT_LAYERS)
    # One stream (drafting stops above max_sequences anyway), 160 tokens: a draft that is
    # never right slows llama-server to a few tokens a second.
    c1 = {
        "endpoint": "chat",
        "prompt": REWRITE,
        "temperature": 0.0,
        "max_tokens": 160,
        "warmup": 1,
        "requests": 2,
    }
    base = {**EDGE_8, "threads": args.threads}
    spec = {"mode": "draft", "draft_file": str(draft_file), "max_draft": 16}
    threads = llama_threads(args)
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd plain", [base]), streams_of(1, c1)),
        (Server("edgellmd draft", [{**base, "speculative": spec}]), streams_of(1, c1)),
    ]
    if args.llama_server:
        servers += [
            (Server("llama-server plain", llama_server=[*LLAMA_8, *threads]), streams_of(1, c1)),
            (
                Server(
                    "llama-server draft",
                    llama_server=[*LLAMA_8, *threads, "-md", str(draft_file), *LLAMA_DRAFT],
                ),
                streams_of(1, c1),
            ),
        ]
    return rounds(servers, args, model, workdir, together=True)


def prompt_cache(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    system = system_prompt()
    # Each user's conversation grows by a long question and its reply per turn: after other
    # users took its slot, a returning one finds only the shared system prompt there (which
    # slot reuse already skips); the rest of its history is what the prompt cache restores.
    talk = {
        "endpoint": "chat",
        "system": system,
        "prompt": f"Here is my note for the harbour office: {PASSAGE[:700]} What should I bring?",
        "users": 8,
        "concurrency": 4,
        "requests": 32,
        "max_tokens": 48,
        "warmup": 0,
    }

    def measure(running: Running) -> dict[str, float]:
        s = bench(running.url, **talk)
        return {"ttft_p50": s.ttft_p50_s, "ttft_p95": s.ttft_p95_s, "tok_s": s.tokens_per_s, "ok": s.ok}

    base = {**EDGE_4, "threads": args.threads}
    threads = llama_threads(args)
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd cache off", [base]), measure),
        (Server("edgellmd cache on", [{**base, "prompt_cache_mb": 2048}]), measure),
    ]
    if args.llama_server:
        common = ["-np", "4", "-c", "16384", *threads]
        servers += [
            (Server("llama-server cache-ram 0", llama_server=[*common, "--cache-ram", "0"]), measure),
            (Server("llama-server cache-ram 2048", llama_server=[*common, "--cache-ram", "2048"]), measure),
        ]
    return rounds(servers, args, model, workdir)


def shared_prompt(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    """The issue's case: a 2,000-token system prompt, 16 users round-robin over 4 slots, short
    questions. TTFT p50 of that, against the TTFT of the same request with nothing to reuse
    (each with a system prompt of its own: a full prefill)."""
    system = system_prompt()
    talk = {
        "endpoint": "chat",
        "system": system,
        "prompt": "What should I bring to the harbour office?",
        "users": 16,
        "concurrency": 4,
        "requests": 64,
        "max_tokens": 32,
        "warmup": 0,
    }

    def measure(running: Running) -> dict[str, float]:
        cold = [
            bench(running.url, **{**talk, "system": f"Visitor {n}.\n{system}", "users": 0, "requests": 1})
            for n in range(3)
        ]
        shared = bench(running.url, **talk)
        full = statistics.median(c.ttft_p50_s for c in cold)
        return {"ttft_full_prefill": full, "ttft_p50": shared.ttft_p50_s, "ratio": full / shared.ttft_p50_s}

    base = {**EDGE_4, "threads": args.threads}
    threads = llama_threads(args)
    servers: list[tuple[Server, Measure]] = [
        (Server("edgellmd", [{**base, "prompt_cache_mb": 2048}]), measure),
    ]
    if args.llama_server:
        servers.append((Server("llama-server", llama_server=["-np", "4", "-c", "16384", *threads]), measure))
    return rounds(servers, args, model, workdir)


def kv(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    servers: list[tuple[Server, Measure]] = []
    for kind in ("f16", "q8_0"):
        settings = {**EDGE_8, "threads": args.threads, "cache_type_k": kind, "cache_type_v": kind}
        parsed = parse_settings(
            {"models": [{"file": str(model), **settings}], "lock": {"allow_unsigned": True}}, base_dir=workdir
        )
        cells = settings["slots"] * settings["context_size"]
        out[f"budget {kind}"] = {"kv_bytes_per_token": kv_cache_bytes(model, parsed.models[0]) / cells}
        measure = streams(PLAIN_1, PLAIN_8)

        def with_memory(running: Running, measure: Measure = measure) -> dict[str, float]:
            return {"rss_mb": resident_mb(running.pid), **measure(running)}

        servers.append((Server(f"edgellmd {kind}", [settings]), with_memory))
    out.update(rounds(servers, args, model, workdir))
    return out


def two_models(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    half = {"slots": 4, "context_size": 2048, "chat_template": "gemma", "threads": args.threads}
    run: dict[str, Any] = {"requests": 24, "max_tokens": 64, "ignore_eos": True, "warmup": 1}

    def busy(*names: str) -> Measure:
        """Aggregate tokens/s with 4 streams on each of `names` at once, and context switches."""

        def measure(running: Running) -> dict[str, float]:
            before = context_switches(running.pid)

            async def together() -> list[BenchSummary]:
                configs = [BenchConfig(base_url=running.url, model=n, concurrency=4, **run) for n in names]
                return list(await asyncio.gather(*(run_bench(c) for c in configs)))

            summaries = asyncio.run(together())
            tokens = sum(s.tokens for s in summaries)
            wall = max(s.wall_s for s in summaries)
            switches = context_switches(running.pid) - before
            return {"tok_s": tokens / wall, "switches_per_token": switches / max(1, tokens)}

        return measure

    servers: list[tuple[Server, Measure]] = [
        (Server("one model", [{"name": "a", **half}]), busy("a")),
        (Server("two models, one busy", [{"name": "a", **half}, {"name": "b", **half}]), busy("a")),
        (Server("two models, both busy", [{"name": "a", **half}, {"name": "b", **half}]), busy("a", "b")),
    ]
    return rounds(servers, args, model, workdir)


def with_handoff(measure: Measure) -> Measure:
    """`measure`, then the token hand-off's latency across the process boundary (p50, p99 in ms
    over the engine's last frames), as `/admin/status` reports it."""

    def inner(running: Running) -> dict[str, float]:
        figures = measure(running)
        with urllib.request.urlopen(running.url + "/admin/status", timeout=10) as answer:  # noqa: S310 - loopback
            status = json.load(answer)
        handoff = status["models"][0].get("engine_process", {}).get("handoff") or {}
        if handoff.get("frames"):
            figures["handoff_p50_ms"] = float(handoff["p50_ms"])
            figures["handoff_p99_ms"] = float(handoff["p99_ms"])
        return figures

    return inner


def isolation(args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    """The plain streams with the engine in a process of its own against on the daemon's threads."""
    edge = {**EDGE_8, "threads": args.threads}
    servers: list[tuple[Server, Measure]] = [
        (
            Server("edgellmd process", [{**edge, "isolation": "process"}]),
            with_handoff(streams(PLAIN_1, PLAIN_8)),
        ),
        (Server("edgellmd thread", [{**edge, "isolation": "thread"}]), streams(PLAIN_1, PLAIN_8)),
    ]
    return rounds(servers, args, model, workdir, together=True)


SCENARIOS: dict[str, Callable[[argparse.Namespace, Path, Path], dict[str, Any]]] = {
    "plain": plain,
    "single": single,
    "isolation": isolation,
    "partial": partial,
    "speculation": speculation,
    "drafts-2": drafts_2,
    "draft": draft,
    "prompt-cache": prompt_cache,
    "shared-prompt": shared_prompt,
    "kv": kv,
    "two-models": two_models,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", type=Path, help="a llama-server built from the same llama.cpp")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = demo_model(workdir)
        for name in args.only.split(","):
            print(f"{name}:")
            results[name] = SCENARIOS[name](args, model, workdir)
            for label, figures in results[name].items():
                print(f"  median {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
