"""`edgellmctl bench --workload`: a serving benchmark as serving engineers run one.

Open-loop arrivals (each request leaves at its scheduled time, however slow the server is),
prompt and output lengths drawn from a ShareGPT-like distribution, a warm-up that is not
counted, and per-request time to first token (TTFT), inter-token latency (ITL), time per
output token (TPOT), end-to-end latency and queue time at p50/p90/p99, with **goodput**: the
requests per second that met the service level objective (SLO) given on the command line.

The lengths: ShareGPT conversations as the serving benchmarks use them (vLLM's `benchmark_serving`
and its paper: mean prompt 161 tokens, mean output 338 tokens, both long-tailed) modelled as
log-normal distributions with those means and a spread (sigma) of 1.0, clipped to
`--max-prompt-tokens` and `--max-output-tokens`; `--length-scale` shrinks both means for a box
that serves small models on a CPU. Nothing is downloaded: the distribution is this module's.
Prompts are words from a fixed list (most are one token in any BPE vocabulary), different for
every request, so that no prompt cache turns one request's prefill into another's reuse; the
server's `usage.prompt_tokens` says what each really was. Outputs are exactly their drawn length
(`max_tokens` with `ignore_eos`, which edgellmd, llama-server and llama_cpp.server honour).

A run is a list of stages, one per offered rate (a sweep), each measured on every target in
turn (the order alternating from stage to stage, so that neither target always goes first);
lengths are the same at every stage and on every target, and the arrival gaps are the same
unit draws scaled to each rate: like is compared with like.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, TextIO

import aiohttp

from edgellmctl.streams import (
    BAD_STREAM,
    CONNECT_TIMEOUT_S,
    CONNECTION,
    ENDPOINT_PATHS,
    READ_TIMEOUT_S,
    TRUNCATED,
    BenchError,
    StreamTally,
    api_base,
    error_label,
    first_model,
    headers,
    percentile,
    read_stream,
)
from edgellmctl.svgchart import Panel, Series, line_chart
from edgellmd.host.metrics import ChoiceFigures
from edgellmd.host.metrics import Slo as DaemonSlo

ARRIVALS: Final = ("poisson", "constant", "burst")
# ShareGPT's published means (tokens) and the log-normal spread this module gives them.
SHAREGPT_PROMPT_MEAN: Final = 161.0
SHAREGPT_OUTPUT_MEAN: Final = 338.0
SHAREGPT_SIGMA: Final = 1.0
MIN_PROMPT_TOKENS: Final = 4
MAX_REQUESTS: Final = 100_000  # per stage: a plan is held in memory
MAX_TOKENS_LIMIT: Final = 131_072  # the longest prompt or output a plan may ask for
WORDS: Final = (  # noqa: SIM905 - a word list reads best as words
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education foot boy age policy "
    "music market sense nation plan college interest death experience effect class control care "
    "field development role effort rate heart drug show leader light voice wife police mind price "
    "report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official "
    "matter center couple site project activity star table need court oil situation cost industry"
).split()


@dataclass(frozen=True, slots=True)
class Slo:
    """A service level: each request's TTFT at most `ttft_s` and its decode at least
    `tokens_per_s` (tokens after the first over the time after the first); it holds at a rate
    when at least `attainment` of the requests (failures included) met it."""

    ttft_s: float = 2.0
    tokens_per_s: float = 5.0
    attainment: float = 0.9


@dataclass(frozen=True, slots=True)
class Lengths:
    """Where request lengths come from: `sharegpt` draws, or `fixed` at the maxima."""

    kind: str = "sharegpt"
    scale: float = 1.0
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of a stage: when it leaves (seconds after the stage starts) and its lengths."""

    index: int
    at_s: float
    prompt_tokens: int
    output_tokens: int


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # A log-normal's mean is exp(mu + sigma^2 / 2): choose mu so that the mean is `mean`.
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def draw_lengths(lengths: Lengths, count: int, seed: int) -> list[tuple[int, int]]:
    """`count` (prompt tokens, output tokens) pairs, the same for the same seed."""
    if lengths.kind == "fixed":
        return [(lengths.max_prompt_tokens, lengths.max_output_tokens)] * count
    rng = random.Random(f"lengths:{seed}")  # noqa: S311 - repeatable draws, not secrets
    out = []
    for _ in range(count):
        prompt = _lognormal(rng, SHAREGPT_PROMPT_MEAN * lengths.scale, SHAREGPT_SIGMA)
        output = _lognormal(rng, SHAREGPT_OUTPUT_MEAN * lengths.scale, SHAREGPT_SIGMA)
        out.append(
            (
                min(lengths.max_prompt_tokens, max(MIN_PROMPT_TOKENS, round(prompt))),
                min(lengths.max_output_tokens, max(1, round(output))),
            )
        )
    return out


def unit_gaps(count: int, seed: int) -> list[float]:
    """Exponential gaps of mean 1 (a Poisson process at rate 1), the same for the same seed."""
    rng = random.Random(f"arrivals:{seed}")  # noqa: S311 - repeatable draws, not secrets
    return [rng.expovariate(1.0) for _ in range(count)]


def plan(arrivals: str, rate: float | None, lengths: Lengths, count: int, seed: int) -> list[Planned]:
    """A stage's requests. `poisson`: exponential gaps at `rate` per second, the first at 0;
    `constant`: one every 1/rate seconds; `burst`: all at once (`rate` unused)."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
    if arrivals != "burst" and (rate is None or not rate > 0 or math.isinf(rate)):
        raise ValueError(f"{arrivals} arrivals need a finite rate above 0, got {rate!r}")
    drawn = draw_lengths(lengths, count, seed)
    if rate is None or arrivals == "burst":
        times = [0.0] * count
    elif arrivals == "constant":
        times = [i / rate for i in range(count)]
    else:
        times = list(itertools.accumulate((gap / rate for gap in unit_gaps(count, seed)[1:]), initial=0.0))
    return [Planned(i, t, p, o) for i, (t, (p, o)) in enumerate(zip(times, drawn, strict=True))]


def prompt_text(index: int, tokens: int, seed: int) -> str:
    """About `tokens` tokens of words, different for every request index and seed."""
    rng = random.Random(f"prompt:{seed}:{index}")  # noqa: S311 - repeatable draws, not secrets
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


@dataclass(frozen=True, slots=True)
class Served:
    """What one request of a stage measured; `error` is None when it succeeded."""

    index: int
    scheduled_s: float  # when it was due, after the stage's start
    late_s: float  # how long after that it left (open loop: near 0 however slow the server)
    prompt_tokens: int  # as planned
    output_tokens: int  # as counted: the server's usage, else text chunks
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...] = ()  # gaps between text chunks
    queue_s: float | None = None  # the server's own `x-queue-ms`, when it sends one
    usage_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, or None with fewer than two."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def met(r: Served, slo: Slo) -> bool:
    """Whether `r` met the SLO: succeeded, its first token in time, and decoded fast enough (the
    daemon's own arithmetic for `edgellm_request_slo_total`, on the client's clock)."""
    if r.error is not None:
        return False
    # No error: it ended whole (its own `[DONE]`, no error event), as `stop` or `length` does.
    seen = ChoiceFigures(
        queue_s=0.0, completion_tokens=r.output_tokens, finish_reason="stop", first_at=r.ttft_s
    )
    return DaemonSlo(slo.ttft_s, slo.tokens_per_s).met(0.0, r.e2e_s, seen)


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


@dataclass(frozen=True, slots=True)
class Stage:
    """One target at one offered rate: the figures of its measured requests."""

    target: str
    offered_rate: float | None  # requests/s; None for a burst
    requests: int
    ok: int
    failed: int
    duration_s: float  # from the stage's start to its last answer
    request_throughput: float  # successful requests/s
    output_tokens_per_s: float
    met: int
    goodput: float  # requests/s that met the SLO
    attainment: float  # share of the requests that met it
    slo_held: bool
    ttft_s: dict[str, float | None]
    itl_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    queue_s: dict[str, float | None]  # all None when the server does not say
    # Of the successful requests, those whose wait the server said (`x-queue-ms` comes with a
    # stream's headers, which wait at most 10 s for the first token: past that, no figure, and
    # the percentiles leave those out, the longest waits).
    queue_figures: int
    mean_prompt_tokens: float | None  # the server's usage figures, when given
    mean_output_tokens: float | None
    max_late_s: float
    errors: dict[str, int] = field(default_factory=dict)


def summarize_stage(
    target: str, offered_rate: float | None, results: Sequence[Served], duration_s: float, slo: Slo
) -> Stage:
    """The figures of one stage; percentiles over successful requests, goodput over all."""
    ok = [r for r in results if r.error is None]
    good = sum(1 for r in results if met(r, slo))
    tokens = sum(r.output_tokens for r in ok)
    prompts = [r.usage_prompt_tokens for r in ok if r.usage_prompt_tokens is not None]
    attainment = good / len(results) if results else 0.0
    return Stage(
        target=target,
        offered_rate=offered_rate,
        requests=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        met=good,
        goodput=good / duration_s if duration_s > 0 else 0.0,
        attainment=attainment,
        slo_held=bool(results) and attainment >= slo.attainment,
        ttft_s=_quantiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_s=_quantiles([gap for r in ok for gap in r.itl_s]),
        tpot_s=_quantiles([t for r in ok if (t := r.tpot_s) is not None]),
        e2e_s=_quantiles([r.e2e_s for r in ok]),
        queue_s=_quantiles([r.queue_s for r in ok if r.queue_s is not None]),
        queue_figures=sum(1 for r in ok if r.queue_s is not None),
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        mean_output_tokens=tokens / len(ok) if ok else None,
        max_late_s=max((r.late_s for r in results), default=0.0),
        errors=dict(Counter(r.error for r in results if r.error is not None)),
    )


@dataclass(frozen=True, slots=True)
class Target:
    """A server to measure: its label in reports, its base URL, and the model to ask for."""

    label: str
    url: str
    model: str | None = None


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """A serving benchmark run, validated by the argument parser."""

    targets: tuple[Target, ...]
    arrivals: str
    rates: tuple[float, ...]  # one stage per rate; a burst has the one stage, rate unused
    requests: int  # per stage
    lengths: Lengths
    slo: Slo
    seed: int = 0
    endpoint: str = "completions"
    key: str | None = field(default=None, repr=False)  # never in a repr or a log
    warmup: int = 2
    temperature: float = 0.8
    until_saturated: bool = False  # stop a target's sweep at its first stage that misses the SLO


def _body(config: WorkloadConfig, model: str, p: Planned, stage: int) -> dict[str, Any]:
    text = prompt_text(p.index, p.prompt_tokens, config.seed * 1000 + stage)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": p.output_tokens,
        "temperature": config.temperature,
        "seed": p.index,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _queue_header(response: aiohttp.ClientResponse) -> float | None:
    raw = response.headers.get("x-queue-ms", "")
    return int(raw) / 1000 if raw.isascii() and raw.isdigit() and len(raw) <= 9 else None


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    *,
    key: str | None,
    body: dict[str, Any],
    planned: Planned,
    scheduled: float,
) -> Served:
    """Send one streamed request now and measure it; failures become an `error` label, never raise."""
    started = time.perf_counter()
    late = max(0.0, started - scheduled)
    tally = StreamTally(started)
    queue: float | None = None
    error: str | None = None
    try:
        async with session.post(url, json=body, headers=headers(key)) as response:
            if not 200 <= response.status < 300:
                error = await error_label(response)
            else:
                queue = _queue_header(response)
                # Cut once streaming: counted below as a stream without [DONE].
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
                    await read_stream(response, tally)
                if tally.error is not None:  # an error event, then [DONE]: no success
                    error = tally.error
                elif not tally.done:
                    error = TRUNCATED
    except (TimeoutError, aiohttp.ClientError, OSError):
        error = CONNECTION
    except ValueError:
        error = BAD_STREAM
    end = time.perf_counter()
    times = tally.chunk_times
    return Served(
        index=planned.index,
        scheduled_s=planned.at_s,
        late_s=late,
        prompt_tokens=planned.prompt_tokens,
        output_tokens=tally.tokens,
        ttft_s=tally.ttft_s,
        e2e_s=end - started,
        itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
        queue_s=queue,
        usage_prompt_tokens=tally.prompt_tokens,
        error=error,
    )


@dataclass(frozen=True, slots=True)
class Tick:
    """Where a stage stands, after each answer."""

    target: str
    rate: float | None
    total: int  # requests of the stage
    sent: int
    answered: int
    failed: int


Progress = Callable[[Tick], None]


async def run_stage(
    session: aiohttp.ClientSession,
    config: WorkloadConfig,
    target: Target,
    *,
    model: str,
    planned: Sequence[Planned],
    rate: float | None,
    stage: int,
    progress: Progress | None = None,
) -> Stage:
    """Send `planned` open loop (each at its time, whatever is still running) and summarize."""
    url = api_base(target.url) + ENDPOINT_PATHS[config.endpoint]
    results: list[Served] = []
    sent = failed = 0
    t0 = time.perf_counter()

    async def one(p: Planned) -> None:
        nonlocal failed
        served = await send_one(
            session,
            url,
            key=config.key,
            body=_body(config, model, p, stage),
            planned=p,
            scheduled=t0 + p.at_s,
        )
        results.append(served)
        failed += served.error is not None
        if progress is not None:
            progress(Tick(target.label, rate, len(planned), sent, len(results), failed))

    tasks = []
    for p in planned:
        delay = t0 + p.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(p)))
        sent += 1
    await asyncio.gather(*tasks)
    results.sort(key=lambda r: r.index)
    return summarize_stage(target.label, rate, results, time.perf_counter() - t0, config.slo)


@dataclass(frozen=True, slots=True)
class WorkloadReport:
    """A whole run: its settings and every stage of every target, in the order they ran."""

    config: dict[str, Any]
    stages: tuple[Stage, ...]

    def of(self, label: str) -> list[Stage]:
        """One target's stages by rising offered rate."""
        mine = [s for s in self.stages if s.target == label]
        return sorted(mine, key=lambda s: s.offered_rate or 0.0)


async def run_workload(config: WorkloadConfig, progress: Progress | None = None) -> WorkloadReport:
    """Warm every target up, then run each stage on every target in turn."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    # A fresh connection per request, as the closed-loop benchmark does; no limit on how many
    # are open at once: an open-loop client must never queue requests itself.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    rates: Sequence[float | None] = (None,) if config.arrivals == "burst" else config.rates
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        models: dict[str, str] = {}
        for target in config.targets:
            models[target.label] = target.model or await first_model(session, target.url, config.key)
            url = api_base(target.url) + ENDPOINT_PATHS[config.endpoint]
            warm_plan = plan("burst", None, config.lengths, config.warmup, config.seed + 1)
            for p in warm_plan:  # one at a time, other lengths than the measured ones
                warm = await send_one(
                    session,
                    url,
                    key=config.key,
                    body=_body(config, models[target.label], p, -1),
                    planned=p,
                    scheduled=time.perf_counter(),
                )
                if warm.error == CONNECTION:
                    raise BenchError(f"cannot reach {api_base(target.url)} (warm-up request failed)")
        stages: list[Stage] = []
        stopped: set[str] = set()
        for i, rate in enumerate(rates):
            planned = plan(config.arrivals, rate, config.lengths, config.requests, config.seed)
            order = config.targets if i % 2 == 0 else tuple(reversed(config.targets))
            for target in order:
                if target.label in stopped:
                    continue
                stage = await run_stage(
                    session,
                    config,
                    target,
                    model=models[target.label],
                    planned=planned,
                    rate=rate,
                    stage=i,
                    progress=progress,
                )
                stages.append(stage)
                if config.until_saturated and not stage.slo_held:
                    stopped.add(target.label)
    settings = asdict(config)
    settings.pop("key")
    settings["targets"] = [
        {"label": t.label, "url": api_base(t.url), "model": models[t.label]} for t in config.targets
    ]
    return WorkloadReport(settings, tuple(stages))


# ---- what a run shows ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Headline:
    """A target's figures for the comparison: where its SLO stops holding, and its goodput there."""

    label: str
    knee_rate: float | None  # the highest offered rate at which the SLO held
    knee_goodput: float | None  # goodput at that rate
    best_goodput: float  # the most goodput at any rate


def headline(report: WorkloadReport, label: str) -> Headline:
    """`label`'s knee: the highest rate at which its SLO held (None: it held at none)."""
    stages = report.of(label)
    held = [s for s in stages if s.slo_held and s.offered_rate is not None]
    knee = held[-1] if held else None
    return Headline(
        label,
        None if knee is None else knee.offered_rate,
        None if knee is None else knee.goodput,
        max((s.goodput for s in stages), default=0.0),
    )


def comparison(report: WorkloadReport, first: str, second: str) -> dict[str, float | None]:
    """`first` against `second`: goodput at each one's knee, and TTFT p99 at the highest rate
    at which both met the SLO (ratios None when a side has no figure)."""
    a, b = headline(report, first), headline(report, second)
    both = sorted(
        {s.offered_rate for s in report.of(first) if s.slo_held and s.offered_rate is not None}
        & {s.offered_rate for s in report.of(second) if s.slo_held and s.offered_rate is not None}
    )
    out: dict[str, float | None] = {
        "goodput_at_knee": a.knee_goodput,
        "other_goodput_at_knee": b.knee_goodput,
        "goodput_ratio": a.knee_goodput / b.knee_goodput if a.knee_goodput and b.knee_goodput else None,
        "common_rate": both[-1] if both else None,
        "ttft_p99_s": None,
        "other_ttft_p99_s": None,
        "ttft_p99_ratio": None,
    }
    if both:
        ours = next(s for s in report.of(first) if s.offered_rate == both[-1])
        theirs = next(s for s in report.of(second) if s.offered_rate == both[-1])
        p99, other = ours.ttft_s["p99"], theirs.ttft_s["p99"]
        out.update(ttft_p99_s=p99, other_ttft_p99_s=other)
        out["ttft_p99_ratio"] = p99 / other if p99 is not None and other else None
    return out


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _row(s: Stage) -> tuple[str, ...]:
    return (
        s.target,
        "burst" if s.offered_rate is None else f"{s.offered_rate:g}",
        f"{s.ok}/{s.requests}",
        f"{s.request_throughput:.2f}",
        f"{s.goodput:.2f}",
        f"{s.attainment:.0%}" + ("" if s.slo_held else " (missed)"),
        "/".join(_s(s.ttft_s[q]) for q in ("p50", "p90", "p99")),
        "/".join(_s(s.itl_s[q]) for q in ("p50", "p90", "p99")),
        _s(s.e2e_s["p90"]),
        _s(s.queue_s["p90"]) + (f" ({s.queue_figures} of {s.ok})" if s.queue_figures < s.ok else ""),
        ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) or "-",
    )


def format_table(report: WorkloadReport) -> str:
    """One row per target and rate, aligned."""
    header = (
        "target",
        "rate/s",
        "ok/n",
        "req/s",
        "goodput",
        "SLO met",
        "TTFT p50/p90/p99 s",
        "ITL p50/p90/p99 s",
        "e2e p90 s",
        "queue p90 s",
        "errors",
    )
    rows: list[tuple[str, ...]] = [header]
    for label in dict.fromkeys(s.target for s in report.stages):
        rows.extend(_row(s) for s in report.of(label))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    slo = report.config["slo"]
    lines.append(
        f"SLO: TTFT <= {slo['ttft_s']:g} s and >= {slo['tokens_per_s']:g} tokens/s after the first, "
        f"for {slo['attainment']:.0%} of requests"
    )
    labels = list(dict.fromkeys(s.target for s in report.stages))
    for label in labels:
        h = headline(report, label)
        knee = (
            "the SLO held at no rate"
            if h.knee_rate is None
            else f"knee {h.knee_rate:g}/s, goodput {h.knee_goodput:.2f}/s there"
        )
        lines.append(f"{label}: {knee}")
    for label in labels[:-1]:  # each against the last: the baseline
        c = comparison(report, label, labels[-1])
        lines.append(
            f"{label} against {labels[-1]}: goodput at the knee {_ratio(c['goodput_ratio'])}, "
            f"TTFT p99 at {_s(c['common_rate'], 2)}/s {_ratio(c['ttft_p99_ratio'])}"
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def as_json(report: WorkloadReport) -> dict[str, Any]:
    """The whole run as one JSON-ready object, with each target compared to the last (none with one)."""
    labels = list(dict.fromkeys(s.target for s in report.stages))
    out: dict[str, Any] = {
        "config": report.config,
        "stages": [asdict(s) for s in report.stages],
        "headlines": [asdict(headline(report, label)) for label in labels],
    }
    out["comparisons"] = [
        {"first": label, "second": labels[-1], **comparison(report, label, labels[-1])}
        for label in labels[:-1]
    ]
    return out


def live_progress(stream: TextIO = sys.stderr) -> Progress:
    """Progress on `stream`: a line rewritten in place on a terminal, else one line per stage's end."""
    tty = stream.isatty()

    def show(t: Tick) -> None:
        where = "burst" if t.rate is None else f"{t.rate:g} req/s"
        line = f"{t.target} at {where}: {t.answered} answered, {t.sent} sent of {t.total}, {t.failed} failed"
        if tty:
            stream.write("\r" + line + "\x1b[K" + ("\n" if t.answered == t.total else ""))
        elif t.answered == t.total:
            stream.write(line + "\n")
        stream.flush()

    return show


def chart(report: WorkloadReport) -> str:
    """Goodput and TTFT p90 against offered rate, one line per target, as an SVG document."""
    slo = report.config["slo"]
    labels = list(dict.fromkeys(s.target for s in report.stages))
    rated = {label: [s for s in report.of(label) if s.offered_rate is not None] for label in labels}
    goodput = [Series(label, [(s.offered_rate or 0.0, s.goodput) for s in rated[label]]) for label in labels]
    ttft = [
        Series(label, [(s.offered_rate or 0.0, s.ttft_s["p90"]) for s in rated[label]]) for label in labels
    ]
    return line_chart(
        [
            Panel("Goodput", "offered rate (requests/s)", "requests/s within the SLO", goodput),
            Panel(
                "Time to first token, p90",
                "offered rate (requests/s)",
                "seconds",
                ttft,
                threshold=float(slo["ttft_s"]),
                threshold_label=f"SLO {slo['ttft_s']:g} s",
            ),
        ],
        title=f"{report.config['arrivals']} arrivals, SLO: TTFT <= {slo['ttft_s']:g} s, "
        f">= {slo['tokens_per_s']:g} tokens/s, {slo['attainment']:.0%} of requests",
    )
