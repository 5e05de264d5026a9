"""`edgellmctl bench --workload`: seeded lengths and arrivals, open loop, the SLO, reports, the chart."""

from __future__ import annotations

import itertools
import json
import statistics
import xml.etree.ElementTree as ET  # parses only the SVG this project writes
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

from edgellmctl import workload
from edgellmctl.svgchart import Panel, Series, line_chart, nice_ticks
from edgellmctl.workload import (
    Lengths,
    Served,
    Slo,
    Stage,
    Target,
    WorkloadConfig,
    WorkloadReport,
    comparison,
    draw_lengths,
    headline,
    met,
    plan,
    prompt_text,
    run_workload,
    summarize_stage,
)
from tests.serving import RunningDaemon
from tests.test_ops_bench import KEY, FakeOpenAI, cli, closed_port, serving, started

SVG: Final = "{http://www.w3.org/2000/svg}"
BIG: Final = Lengths("sharegpt", 1.0, workload.MAX_TOKENS_LIMIT, workload.MAX_TOKENS_LIMIT)


def parse_svg(text: str) -> ET.Element:
    return ET.fromstring(text)  # noqa: S314 - our own chart, not a stranger's document


def config(urls: list[str], **kwargs: Any) -> WorkloadConfig:
    defaults: dict[str, Any] = {
        "targets": tuple(Target(f"t{i}", url) for i, url in enumerate(urls)),
        "arrivals": "poisson",
        "rates": (50.0,),
        "requests": 6,
        "lengths": Lengths("fixed", 1.0, 8, 4),
        "slo": Slo(2.0, 5.0, 0.9),
        "warmup": 0,
    }
    return WorkloadConfig(**{**defaults, **kwargs})


def served(ttft: float | None = 0.5, e2e: float = 2.5, tokens: int = 11, **kwargs: Any) -> Served:
    return Served(
        index=kwargs.pop("index", 0),
        scheduled_s=0.0,
        late_s=kwargs.pop("late_s", 0.0),
        prompt_tokens=8,
        output_tokens=tokens,
        ttft_s=ttft,
        e2e_s=e2e,
        **kwargs,
    )


# --- lengths and arrivals ------------------------------------------------------------------------


def test_sharegpt_lengths_have_the_published_means_and_are_seeded() -> None:
    drawn = draw_lengths(BIG, 40_000, seed=3)
    prompts, outputs = [p for p, _ in drawn], [o for _, o in drawn]
    assert statistics.mean(prompts) == pytest.approx(workload.SHAREGPT_PROMPT_MEAN, rel=0.05)
    assert statistics.mean(outputs) == pytest.approx(workload.SHAREGPT_OUTPUT_MEAN, rel=0.05)
    # Long-tailed: the median well below the mean, some requests many times it.
    assert statistics.median(outputs) < 0.75 * workload.SHAREGPT_OUTPUT_MEAN
    assert max(outputs) > 5 * workload.SHAREGPT_OUTPUT_MEAN
    assert draw_lengths(BIG, 100, seed=3) == drawn[:100]
    assert draw_lengths(BIG, 100, seed=4) != drawn[:100]


def test_lengths_are_clipped_and_scaled() -> None:
    small = draw_lengths(Lengths("sharegpt", 0.25, 64, 32), 5000, seed=0)
    assert all(workload.MIN_PROMPT_TOKENS <= p <= 64 and 1 <= o <= 32 for p, o in small)
    assert max(p for p, _ in small) == 64
    assert max(o for _, o in small) == 32
    scaled = draw_lengths(Lengths("sharegpt", 0.25, 100_000, 100_000), 20_000, seed=0)
    assert statistics.mean(o for _, o in scaled) == pytest.approx(workload.SHAREGPT_OUTPUT_MEAN / 4, rel=0.06)
    assert draw_lengths(Lengths("fixed", 1.0, 40, 7), 3, seed=0) == [(40, 7)] * 3


def test_poisson_arrivals_are_seeded_at_the_rate_and_scale_with_it() -> None:
    at4 = plan("poisson", 4.0, BIG, 8000, seed=1)
    times = [p.at_s for p in at4]
    assert times[0] == 0.0
    assert times == sorted(times)
    assert len(times) / times[-1] == pytest.approx(4.0, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential: the standard deviation of the gaps equals their mean.
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.06)
    at8 = plan("poisson", 8.0, BIG, 8000, seed=1)
    assert [p.at_s * 2 for p in at8] == pytest.approx(times)  # the same draws, twice as fast
    assert [(p.prompt_tokens, p.output_tokens) for p in at8] == [
        (p.prompt_tokens, p.output_tokens) for p in at4
    ]
    assert [p.at_s for p in plan("poisson", 4.0, BIG, 50, seed=2)] != times[:50]


def test_constant_and_burst_arrivals() -> None:
    assert [p.at_s for p in plan("constant", 2.0, BIG, 4, seed=0)] == [0.0, 0.5, 1.0, 1.5]
    assert [p.at_s for p in plan("burst", None, BIG, 3, seed=0)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("arrivals", "rate"),
    [
        ("poisson", None),
        ("poisson", 0.0),
        ("constant", -1.0),
        ("poisson", float("inf")),
        ("poisson", float("nan")),
        ("gamma", 1.0),
    ],
)
def test_a_plan_refuses_what_is_not_a_rate(arrivals: str, rate: float | None) -> None:
    with pytest.raises(ValueError, match="arrivals"):
        plan(arrivals, rate, BIG, 3, seed=0)


def test_prompts_differ_per_request_and_have_their_length() -> None:
    a, b = prompt_text(0, 50, seed=0), prompt_text(1, 50, seed=0)
    assert len(a.split()) == 50
    assert len(b.split()) == 50
    assert a != b
    assert a[:40] != b[:40]
    assert prompt_text(0, 50, seed=0) == a


# --- the SLO's arithmetic ----------------------------------------------------------------------------


def test_slo_is_met_by_a_fast_first_token_and_enough_tokens_per_second() -> None:
    slo = Slo(ttft_s=1.0, tokens_per_s=5.0)
    assert met(served(ttft=1.0, e2e=3.0, tokens=11), slo)  # 10 tokens in 2 s after the first: 5/s
    assert not met(served(ttft=1.0, e2e=3.01, tokens=11), slo)  # just under 5/s
    assert not met(served(ttft=1.01, e2e=1.5, tokens=11), slo)  # first token late
    assert met(served(ttft=0.5, e2e=60.0, tokens=1), slo)  # one token: its TTFT decides
    assert not met(served(ttft=None, e2e=0.1, tokens=0), slo)
    assert not met(served(error="429 rate_limit_error"), slo)


def test_a_stage_counts_goodput_over_every_request_and_percentiles_over_the_good() -> None:
    slo = Slo(ttft_s=1.0, tokens_per_s=5.0, attainment=0.75)
    results = [
        served(ttft=0.2, e2e=1.2, tokens=11, index=0, queue_s=0.1, usage_prompt_tokens=10),
        served(ttft=0.4, e2e=1.4, tokens=11, index=1, queue_s=0.3, usage_prompt_tokens=20),
        served(ttft=3.0, e2e=4.0, tokens=11, index=2, queue_s=2.0, usage_prompt_tokens=30),  # late
        served(ttft=None, e2e=0.01, tokens=0, index=3, error="503"),
    ]
    stage = summarize_stage("x", 2.0, results, duration_s=4.0, slo=slo)
    assert (stage.requests, stage.ok, stage.failed, stage.met) == (4, 3, 1, 2)
    assert stage.goodput == pytest.approx(0.5)
    assert stage.request_throughput == pytest.approx(0.75)
    assert stage.attainment == pytest.approx(0.5)
    assert not stage.slo_held
    assert stage.ttft_s["p50"] == pytest.approx(0.4)
    assert stage.queue_s["p99"] == pytest.approx(0.3 + (2.0 - 0.3) * 0.98)
    assert stage.output_tokens_per_s == pytest.approx(33 / 4.0)
    assert stage.mean_prompt_tokens == pytest.approx(20.0)
    assert stage.errors == {"503": 1}
    assert stage.itl_s["p50"] is None  # no chunk gaps given
    assert summarize_stage("x", 2.0, results[:2], 4.0, slo).slo_held
    assert stage.queue_figures == 3
    none = summarize_stage("x", 1.0, [served(queue_s=None)], 1.0, slo)
    assert none.queue_s == {"p50": None, "p90": None, "p99": None}
    assert none.queue_figures == 0  # the table says how many of the successful had a figure


def stage(target: str, rate: float, goodput: float, held: bool, p99: float) -> Stage:
    return Stage(
        target, rate, 10, 10, 0, 10.0, 1.0, 5.0, 9 if held else 2, goodput, 0.9 if held else 0.2, held,
        {"p50": p99 / 2, "p90": p99 * 0.9, "p99": p99}, {"p50": 0.01, "p90": 0.02, "p99": 0.03},
        {"p50": 0.01, "p90": 0.02, "p99": 0.03}, {"p50": 1.0, "p90": 2.0, "p99": 3.0},
        {"p50": None, "p90": None, "p99": None}, 0, 20.0, 10.0, 0.001,
    )  # fmt: skip


def test_knee_and_comparison() -> None:
    report = WorkloadReport(
        {"slo": {"ttft_s": 2.0, "tokens_per_s": 5.0, "attainment": 0.9}, "arrivals": "poisson"},
        (
            stage("a", 1.0, 0.9, True, 0.5),
            stage("b", 1.0, 0.9, True, 1.0),
            stage("b", 2.0, 1.5, True, 1.6),
            stage("a", 2.0, 1.8, True, 0.8),
            stage("a", 4.0, 3.0, True, 1.2),
            stage("b", 4.0, 0.5, False, 9.0),
        ),
    )
    assert headline(report, "a") == workload.Headline("a", 4.0, 3.0, 3.0)
    assert headline(report, "b") == workload.Headline("b", 2.0, 1.5, 1.5)
    c = comparison(report, "a", "b")
    assert c["goodput_ratio"] == pytest.approx(2.0)
    assert c["common_rate"] == 2.0  # the highest rate where both held
    assert c["ttft_p99_ratio"] == pytest.approx(0.5)
    table = workload.format_table(report)
    assert "a: knee 4/s, goodput 3.00/s there" in table
    assert "a against b: goodput at the knee 2.00x, TTFT p99 at 2.00/s 0.50x" in table
    assert "(missed)" in table
    failing = WorkloadReport(
        report.config, (stage("a", 1.0, 0.1, False, 9.0), stage("b", 1.0, 0.1, False, 9.0))
    )
    assert headline(failing, "a").knee_rate is None
    assert comparison(failing, "a", "b")["goodput_ratio"] is None
    assert "the SLO held at no rate" in workload.format_table(failing)
    svg = parse_svg(workload.chart(report))
    lines = svg.findall(f".//{SVG}polyline")
    assert [line.get("data-series") for line in lines] == ["a", "b", "a", "b"]  # goodput, then TTFT p90
    assert len(svg.findall(f".//{SVG}line[@class='threshold']")) == 1  # the SLO's TTFT


# --- the chart ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("high", "ticks"),
    [(1.0, [0, 0.2, 0.4, 0.6, 0.8, 1.0]), (7.3, [0, 2, 4, 6, 8]), (0.0, [0, 1]), (float("nan"), [0, 1]),
     (120, [0, 50, 100, 150])],
)  # fmt: skip
def test_nice_ticks(high: float, ticks: list[float]) -> None:
    assert nice_ticks(high) == pytest.approx(ticks)


def test_chart_escapes_labels_and_places_points_on_the_axes() -> None:
    hostile = '<script>alert("x")</script> & co'
    doc = line_chart(
        [Panel("p & q", "x", "y", [Series(hostile, [(0.0, 0.0), (2.0, 10.0), (1.0, None)])])], title="t<"
    )
    svg = parse_svg(doc)  # well-formed: the label did not break out
    assert svg.find(f".//{SVG}script") is None
    (line,) = svg.findall(f".//{SVG}polyline")
    assert line.get("data-series") == hostile
    points = [tuple(map(float, p.split(","))) for p in (line.get("points") or "").split()]
    assert len(points) == 2  # the missing point is left out
    (x0, y0), (x1, y1) = points
    assert x1 > x0
    assert y1 < y0
    assert len(svg.findall(f".//{SVG}circle")) == 2


# --- against servers, on real sockets --------------------------------------------------------------


async def test_arrivals_are_open_loop_a_slow_server_does_not_slow_them(aiohttp_server: AiohttpServer) -> None:
    fake = FakeOpenAI(chunks=3, request_delay=1.0)
    url = await started(fake, aiohttp_server)
    report = await run_workload(config([url], arrivals="constant", rates=(20.0,), requests=10))
    (s,) = report.stages
    assert s.ok == 10
    assert fake.max_active == 10
    assert s.max_late_s < 0.25
    assert s.duration_s < 3.0  # 0.45 s of arrivals + 1 s each, not 10 s one after another


async def test_queue_time_comes_from_the_servers_header(aiohttp_server: AiohttpServer) -> None:
    async def complete(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-queue-ms": "250"})
        await response.prepare(request)
        for chunk in ({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                      {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}):  # fmt: skip
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    report = await run_workload(config([url], targets=(Target("q", url, "m"),), arrivals="burst", requests=3))
    (s,) = report.stages
    assert s.queue_s["p50"] == pytest.approx(0.25)
    assert s.mean_prompt_tokens == 9
    assert s.mean_output_tokens == 2
    assert s.itl_s["p50"] is not None


async def test_stages_alternate_their_order_and_a_saturated_sweep_stops(
    aiohttp_server: AiohttpServer,
) -> None:
    fast, slow = FakeOpenAI(chunks=3), FakeOpenAI(chunks=3, first_delay=0.3)
    a, b = await started(fast, aiohttp_server), await started(slow, aiohttp_server)
    cfg = config([a, b], rates=(20.0, 40.0, 80.0), requests=3, slo=Slo(ttft_s=0.2, tokens_per_s=1.0))
    report = await run_workload(cfg)
    assert [(s.target, s.offered_rate) for s in report.stages] == [
        ("t0", 20.0), ("t1", 20.0), ("t1", 40.0), ("t0", 40.0), ("t0", 80.0), ("t1", 80.0),
    ]  # fmt: skip
    report = await run_workload(
        config([a, b], rates=cfg.rates, requests=3, slo=cfg.slo, until_saturated=True)
    )
    assert [(s.target, s.offered_rate) for s in report.stages] == [
        ("t0", 20.0), ("t1", 20.0), ("t0", 40.0), ("t0", 80.0),
    ]  # fmt: skip
    # Every stage sends the same lengths, on both servers.
    assert len({json.dumps(seen.body["max_tokens"]) for seen in fast.seen + slow.seen}) == 1


def test_the_command_prints_a_table_and_writes_json_and_svg(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeOpenAI(chunks=4, key=KEY)
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    svg, saved = tmp_path / "chart.svg", tmp_path / "run.json"
    with serving(fake) as url:
        argv = ["--url", url, "--key-file", str(key_file), "--workload", "poisson", "--rate", "20,40",
                "-n", "5", "--lengths", "sharegpt", "--length-scale", "0.05", "--svg", str(svg),
                "--save", str(saved), "--label", "fake <one>", "--warmup", "1"]  # fmt: skip
        assert cli(argv) == 0
        out, err = capsys.readouterr()
        assert cli([*argv, "--json"]) == 0
        as_json, _ = capsys.readouterr()
    assert "fake <one>  20" in out
    assert "SLO: TTFT <= 2 s and >= 5 tokens/s after the first, for 90%" in out
    assert "fake <one> at 20 req/s: 5 answered, 5 sent of 5, 0 failed" in err  # progress, not a tty
    assert KEY not in out + err + as_json + saved.read_text() + svg.read_text()
    document = json.loads(as_json)
    assert document == json.loads(saved.read_text())
    assert [s["offered_rate"] for s in document["stages"]] == [20.0, 40.0]
    assert document["config"]["targets"] == [{"label": "fake <one>", "url": url, "model": "fake-model"}]
    assert document["config"]["slo"] == {"ttft_s": 2.0, "tokens_per_s": 5.0, "attainment": 0.9}
    assert document["comparisons"] == []  # one server: nothing to compare
    assert parse_svg(svg.read_text()).findall(f".//{SVG}polyline")
    bodies = [seen.body for seen in fake.seen]
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in bodies)
    assert len(bodies) == 2 * (1 + 5 + 5)  # two runs: a warm-up and two stages of five each
    assert {seen.authorization for seen in fake.seen} == {f"Bearer {KEY}"}


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        (["--workload", "poisson"], "needs --rate"),
        (["--workload", "burst", "--rate", "1"], "--rate is for poisson and constant"),
        (["--workload", "poisson", "--rate", "0"], "must be rates above 0"),
        (["--workload", "poisson", "--rate", "-1"], "must be a number from"),
        (["--workload", "poisson", "--rate", "nan"], "must be a number from"),
        (["--workload", "poisson", "--rate", "2,1"], "must rise without repeats"),
        (["--workload", "poisson", "--rate", "1,1"], "must rise without repeats"),
        (["--workload", "poisson", "--rate", ","], "must be rates above 0"),
        (["--workload", "poisson", "--rate", "1", "--label", "a", "--label", "b"], "2 --label for 1 --url"),
        (["--workload", "poisson", "--rate", "1", "-c", "4"], "-c/--concurrency"),
        (["--workload", "poisson", "--rate", "1", "--users", "2"], "--users"),
        (["--workload", "poisson", "--rate", "1", "-m", "9"], "-m/--max-tokens"),
        (["--workload", "poisson", "--rate", "1", "--prompt", "hi"], "--prompt"),
        (["--workload", "poisson", "--rate", "1", "--length-scale", "0"], "must be a number from"),
        (["--workload", "poisson", "--rate", "1", "--max-output-tokens", "0"], "--max-output-tokens"),
        (["--workload", "poisson", "--rate", "1", "--label", "\x1b[2J"], "printable"),
        (["--workload", "poisson", "--rate", "1", "-n", "100001"], "--requests"),
        (["--rate", "1"], "--rate needs --workload"),
        (["--svg", "x.svg"], "--svg needs --workload"),
        (["--url", "http://127.0.0.1:1"], "one --url, unless --workload"),
    ],
)
def test_bad_workload_options_exit_2(
    extra: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = cli(["--url", f"http://127.0.0.1:{closed_port()}", *extra])
    except SystemExit as exc:  # argparse's own refusals
        status = int(exc.code or 0)
    assert status == 2
    assert complaint in capsys.readouterr().err


def test_duplicate_labels_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    argv = ["--url", url, "--url", url, "--workload", "burst", "--label", "a", "--label", "a"]
    assert cli(argv) == 2
    assert "each --label must differ" in capsys.readouterr().err


def test_an_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", f"http://127.0.0.1:{closed_port()}", "--model", "m", "--workload", "burst", "-n", "2"]
    assert cli(argv) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_an_unwritable_chart_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serving(FakeOpenAI(chunks=2)) as url:
        argv = ["--url", url, "--workload", "burst", "-n", "2", "--svg", str(tmp_path / "no" / "c.svg")]
        assert cli(argv) == 1
    assert "cannot write" in capsys.readouterr().err


def test_against_edgellmd(daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", daemon.url, "--model", "tiny", "--workload", "constant", "--rate", "4", "-n", "4",
            "--lengths", "fixed", "--max-prompt-tokens", "12", "--max-output-tokens", "6",
            "--json"]  # fmt: skip
    assert cli(argv) == 0
    (s,) = json.loads(capsys.readouterr().out)["stages"]
    assert (s["ok"], s["failed"]) == (4, 0)
    assert s["mean_output_tokens"] == 6  # ignore_eos: every output its drawn length
    assert s["mean_prompt_tokens"] >= 12  # the daemon's own count of the prompt
    assert s["queue_s"]["p50"] is not None  # edgellmd says how long each waited for a slot
    assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
