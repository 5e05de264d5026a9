"""Goodput under an SLO on open-loop load: edgellmd against llama-server, interleaved, on the demo model.

Run: `.venv/bin/python -m tests.bench_goodput [--llama-server PATH] [--rates 0.5,1,1.5,2]
[--requests 40] [--out docs/goodput]`. Both servers run at once with the same slots and threads
(edgellmd: `slots` slots of `context_size`; llama-server `-np slots -c slots*context_size`); the
workload (`edgellmctl bench --workload poisson`, ShareGPT-like lengths scaled to the box) runs
each rate on one and then the other, alternating which goes first. Prints the table and the
goal figures, and writes OUT.json (the whole report) and OUT.svg (goodput and TTFT p90 against
the offered rate). `PATH` is a `llama-server` built from the llama.cpp that llama-cpp-python
vendors (its sdist's `vendor/llama.cpp`, CMake target `llama-server`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
from pathlib import Path

from edgellmctl import workload
from edgellmctl.bench import rate_list
from tests.bench_speed import MODEL, Server, serve
from tests.bench_structured import demo_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", type=Path, help="a llama-server binary to compare with")
    p.add_argument("--rates", type=rate_list, default=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0))
    p.add_argument("--requests", type=int, default=48, help="per rate and server (default 48)")
    p.add_argument("--length-scale", type=float, default=0.25, help="of ShareGPT's means (default 0.25)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tokens-per-s", type=float, default=5.0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--context-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--prefill-chunk", type=int, help="edgellmd's models[].prefill_chunk (default: its own)")
    p.add_argument(
        "--shed",
        type=float,
        help="also measure edgellmd with models[].queue_timeout_s at this many seconds (shedding)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.svg")
    args = p.parse_args()
    edge = {
        "name": MODEL,
        "slots": args.slots,
        "context_size": args.context_size,
        "threads": args.threads,
        "chat_template": "gemma",
    }
    if args.prefill_chunk is not None:
        edge["prefill_chunk"] = args.prefill_chunk
    servers = [Server("edgellmd", [edge])]  # the last one is the baseline the others are compared to
    if args.shed is not None:
        servers.append(
            Server(f"edgellmd, shedding at {args.shed:g} s", [{**edge, "queue_timeout_s": args.shed}])
        )
    if args.llama_server is not None:
        threads = ["-t", str(args.threads), "-tb", str(args.threads)]
        llama = ["-np", str(args.slots), "-c", str(args.slots * args.context_size), *threads]
        servers.append(Server("llama-server", llama_server=llama))
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp, contextlib.ExitStack() as stack:
        model = demo_model(Path(tmp))
        running = {
            s.label: stack.enter_context(serve(s, model, Path(tmp), args.llama_server)) for s in servers
        }
        config = workload.WorkloadConfig(
            targets=tuple(workload.Target(label, r.url, MODEL) for label, r in running.items()),
            arrivals="poisson",
            rates=args.rates,
            requests=args.requests,
            lengths=workload.Lengths(
                "sharegpt", args.length_scale, args.max_prompt_tokens, args.max_output_tokens
            ),
            slo=workload.Slo(args.slo_ttft, args.slo_tokens_per_s, 0.9),
            seed=args.seed,
            warmup=2,
        )
        report = asyncio.run(workload.run_workload(config, workload.live_progress()))
    print(workload.format_table(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        document = workload.as_json(report)
        document["config"]["servers"] = {
            "slots": args.slots,
            "context_size": args.context_size,
            "threads": args.threads,
            "prefill_chunk": args.prefill_chunk,
            "queue_timeout_s": args.shed,
        }
        args.out.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n")
        args.out.with_suffix(".svg").write_text(workload.chart(report))
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.svg')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
