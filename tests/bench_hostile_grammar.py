"""Benchmark: other streams' inter-token latency while the costliest schemas the limits allow are served.

Run: `.venv/bin/python -m tests.bench_hostile_grammar [--streams 4] [--seconds 8] [--rounds 2]`.
On the demo model, `--streams` bystanders decode plain text back to back; one more client
sends, request after request, a reply constrained by one of the hostile schemas below (its
grammar compiled on another thread first, as the daemon's prompt pool does). Rounds alternate
without and with the hostile client, for each schema. It prints the bystanders' inter-token
gaps (p50, p99) with and without, and their ratio: the goal is a p99 within 3x. Not a test:
figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from edgellmd.engine import EngineConfig, default_threads
from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams, TextDelta
from edgellmd.engine.native import apply_builtin_template
from edgellmd.engine.scheduler import Engine
from edgellmd.grammar.convert import schema_to_grammar
from tests.bench_structured import demo_model
from tests.reliability.harness import percentile

PROMPT = "Write a short story about a lighthouse keeper."
HOSTILE_PROMPT = "Answer with one of the allowed values."
# The costliest shapes within the limits, by what they cost per token (see daemon/grammar/rules.py).
HOSTILE: dict[str, dict[str, Any]] = {
    "enum of 1,000 values": {"enum": [f"value-{i:04d}" for i in range(1000)]},
    "ambiguous pattern at the state limit": {"type": "string", "pattern": "^((a|aa){0,10}){0,33}$"},
    "characters the model never ranks high (CJK)": {"type": "string", "pattern": "^[\u4e00-\u9fff]{40}$"},
    "ambiguous pattern of characters never ranked high": {
        "type": "string",
        "pattern": "^(([\u4e00-\u9fff]|[\u4e00-\u9fff]{2}){5,10}){20,33}$",
    },
    "braille the model never writes, ambiguous": {
        "type": "string",
        "pattern": "^(([\u2800-\u28ff]|[\u2800-\u28ff]{2}){5,10}){20,33}$",
    },
    "5,000 required properties": {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
        "required": [f"p{i}" for i in range(5000)],
    },
}


async def bystanders(
    engine: Engine, tokens: list[int], streams: int, seconds: float, hostile: tuple[list[int], str] | None
) -> tuple[list[float], int]:
    """Inter-token gaps (s) of the bystanders over `seconds`; and how many hostile replies ran."""
    loop = asyncio.get_running_loop()
    deadline = time.perf_counter() + seconds
    gaps: list[float] = []
    hostile_done = [0]

    async def bystander(seed: int) -> None:
        while time.perf_counter() < deadline:
            gen = engine.submit(
                GenerationRequest(tokens, 64, SamplingParams(temperature=0.8, seed=seed), ignore_eos=True),
                loop,
            )
            seed += streams
            last: float | None = None
            try:
                async for event in gen.events():
                    now = time.perf_counter()
                    if now >= deadline:
                        break
                    if isinstance(event, TextDelta):
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                    elif isinstance(event, Finished):
                        break
            finally:
                gen.cancel()
                engine.wake()

    async def attacker(prompt: list[int], grammar: str) -> None:
        seed = 0
        while time.perf_counter() < deadline:
            compiled = await loop.run_in_executor(None, engine.compile_grammar, grammar, 1)
            gen = engine.submit(
                GenerationRequest(prompt, 256, SamplingParams(temperature=0.8, seed=seed, grammar=grammar)),
                loop,
                compiled[0],
            )
            seed += 1
            try:
                async for event in gen.events():
                    if time.perf_counter() >= deadline or isinstance(event, Finished):
                        break
            finally:
                gen.cancel()
                engine.wake()
            hostile_done[0] += 1

    tasks = [bystander(i) for i in range(streams)]
    if hostile is not None:
        tasks.append(attacker(*hostile))
    await asyncio.gather(*tasks)
    for _ in range(1000):
        if engine.idle:
            break
        await asyncio.sleep(0.01)
    return gaps, hostile_done[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=list(HOSTILE), help="one hostile schema only")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = demo_model(Path(tmp))
        threads = default_threads()
        engine = Engine(
            EngineConfig(
                path=path,
                slots=args.streams + 1,
                context_size=2048,
                batch_size=512,
                threads=threads,
                threads_batch=threads,
            )
        )
        try:
            tokens = engine.tokenize(apply_builtin_template("gemma", [("user", PROMPT)]), parse_special=True)
            hostile_tokens = engine.tokenize(
                apply_builtin_template("gemma", [("user", HOSTILE_PROMPT)]), parse_special=True
            )
            for name, schema in HOSTILE.items():
                if args.only and name != args.only:
                    continue
                grammar = schema_to_grammar(schema)
                calm: list[float] = []
                stressed: list[float] = []
                replies = 0
                for _ in range(args.rounds):
                    gaps, _ = asyncio.run(bystanders(engine, tokens, args.streams, args.seconds, None))
                    calm += gaps
                    gaps, done = asyncio.run(
                        bystanders(engine, tokens, args.streams, args.seconds, (hostile_tokens, grammar))
                    )
                    stressed += gaps
                    replies += done
                figures = {
                    "calm_p50_ms": round(1000 * statistics.median(calm), 2),
                    "calm_p99_ms": round(1000 * percentile(calm, 99), 2),
                    "hostile_p50_ms": round(1000 * statistics.median(stressed), 2),
                    "hostile_p99_ms": round(1000 * percentile(stressed, 99), 2),
                    "hostile_replies": replies,
                }
                figures["p99_ratio"] = round(figures["hostile_p99_ms"] / figures["calm_p99_ms"], 2)
                results[name] = figures
                print(f"{name}: {figures}", flush=True)
        finally:
            engine.close()
    print(
        json.dumps(
            {"streams": args.streams, "seconds": args.seconds, "rounds": args.rounds, "results": results}
        )
    )


if __name__ == "__main__":
    main()
