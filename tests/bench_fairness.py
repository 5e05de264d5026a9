"""Benchmark: fair share between keys, on the demo model: one key floods, another asks once.

Run: `.venv/bin/python -m tests.bench_fairness [--rounds 3] [--flood 64] [--slots 8]
[--batch-size 512] [--compare-stops]`. One
edgellmd (a process of its own, API keys on) serves the demo model with `--slots` slots. Each
round measures, side by side on the same daemon:

- idle: key B's short streamed request on an idle box (time to its first token);
- one tenant: key A floods `--flood` long requests (a ~300-token passage, 128 tokens each,
  `ignore_eos`) and B's probes go out under A's key, so they queue behind the flood in arrival
  order: what every request met before fair share (one tenant is first come, first served);
- fair share: the same flood from A, B's probes under B's own key.

B sends one probe at a time, a second apart, while the flood lasts, each a new question (no
probe finds the one before it cached); the figures are B's time to first token, p50 and p95 over
every probe of every round, and p95 as a multiple of idle. With `--compare-stops` the daemon also
loads the model as `gemma3-270m-unstopped` with `preempt_steps: false`, and each round measures
fair share on it too, side by side.
Then `weights`: A (weight 1) and C (weight 3) flood together; when half of all their requests
have finished, each key's share of the tokens finished so far (from `/admin/usage`). Prints
each round, then one JSON line. Not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from edgellmctl.keys import create_key
from tests.bench_speed import MODEL, PASSAGE, READY_TIMEOUT_S
from tests.bench_structured import demo_model
from tests.serving import free_port

LONG_TOKENS = 128
UNSTOPPED = MODEL + "-unstopped"  # the same model with `preempt_steps: false` (--compare-stops)
PROBE_GAP_S = 1.0
UNSTOPPED_LABEL = "fair share, no step stopped"


@contextmanager
def daemon(
    model: Path,
    workdir: Path,
    keys: Path,
    slots: int,
    batch_size: int,
    prefill_chunk: int | None,
    *,
    compare_stops: bool = False,
) -> Iterator[str]:
    port = free_port()
    entry = {
        "name": MODEL,
        "file": str(model),
        "slots": slots,
        "queue_size": 256,
        "context_size": 2048,
        "batch_size": batch_size,
        "prefill_chunk": prefill_chunk,
        "chat_template": "gemma",
    }
    more = [{**entry, "name": UNSTOPPED, "preempt_steps": False}] if compare_stops else []
    config = {
        "server": {"host": "127.0.0.1", "port": port, "max_tokens_limit": 4096},
        "models": [entry, *more],
        "lock": {"allow_unsigned": True},
        "lifecycle": {"watch": False, "preload_dir": None},
        "logging": {"level": "warning"},
        "auth": {"keys_file": str(keys)},
    }
    path = workdir / "fairness.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / "server.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "edgellmd", "--config", str(path)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"edgellmd did not start; see {workdir / 'server.log'}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as answer:  # noqa: S310 - loopback
            return bool(answer.status == 200)
    except OSError:
        return False


def _post(url: str, token: str, body: dict[str, Any], *, first_token: bool = False) -> float:
    """Send one chat request; seconds to its first streamed token (or to its end)."""
    request = urllib.request.Request(  # noqa: S310 - loopback
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    started = time.perf_counter()
    try:
        answer = urllib.request.urlopen(request, timeout=600)  # noqa: S310 - loopback
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None
    with answer:
        if not first_token:
            answer.read()
            return time.perf_counter() - started
        for line in answer:  # the first chunk carries the role only: the first token's text is the mark
            if line.startswith(b"data: {") and _text_of(line[6:]):
                took = time.perf_counter() - started
                answer.read()
                return took
    return time.perf_counter() - started


def _text_of(data: bytes) -> str:
    choices = json.loads(data).get("choices") or [{}]
    return str((choices[0].get("delta") or {}).get("content") or "")


def _long(n: int, model: str = MODEL) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Request {n}. Summarise this passage:\n\n{PASSAGE}"}],
        "max_tokens": LONG_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }


PROBE: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 4,
    "stream": True,
    "temperature": 0,
}
_probes = itertools.count()


def probe(model: str = MODEL) -> dict[str, Any]:
    """B's short question, a new one each time: no probe finds the one before it in B's cache,
    on the idle box or under the flood (A's requests take B's slots, and its cached prefix)."""
    content = f"Question {next(_probes)}: what is the capital of France?"
    return {**PROBE, "model": model, "messages": [{"role": "user", "content": content}]}


def flood(url: str, token: str, count: int, offset: int = 0, model: str = MODEL) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_post, args=(url, token, _long(offset + i, model)), daemon=True)
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads


def probes_during(
    url: str, token: str, threads: list[threading.Thread], model: str = MODEL
) -> tuple[list[float], float]:
    """B's probes while the flood lasts, and how long the flood took from here."""
    started = time.perf_counter()
    time.sleep(1.0)  # the flood is queued and running
    out = []
    while any(t.is_alive() for t in threads):
        out.append(_post(url, token, probe(model), first_token=True))
        time.sleep(PROBE_GAP_S)
    for thread in threads:
        thread.join()
    return out, time.perf_counter() - started


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _usage(url: str, admin: str, key_id: str) -> tuple[int, int]:
    """(requests, tokens) the ledger holds for a key so far."""
    request = urllib.request.Request(  # noqa: S310 - loopback
        url + f"/admin/usage?group=month&key={key_id}", headers={"Authorization": f"Bearer {admin}"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310 - loopback
        totals = json.loads(answer.read())["totals"]
    return int(totals["requests"]), int(totals["total_tokens"])


def _computed(url: str, admin: str) -> dict[str, float]:
    """Tokens the scheduler computed per key with work now: virtual time times weight."""
    request = urllib.request.Request(  # noqa: S310 - loopback
        url + "/admin/status", headers={"Authorization": f"Bearer {admin}"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310 - loopback
        model = json.loads(answer.read())["models"][0]
    tenants = model["performance"]["fairness"]["tenants"]
    return {key: float(t["vtime"]) for key, t in tenants.items()}


def shares(
    url: str, admin: str, ids: dict[str, str], token_of: dict[str, str], count: int
) -> dict[str, float]:
    """Keys a (weight 1) and c (weight 3) flood `count` requests each at once: each one's share of
    the tokens the scheduler computed (prefill and generation) while both had work, read half-way
    through, and each one's share of the tokens of the requests finished by then (the ledger)."""
    before = {k: _usage(url, admin, ids[k]) for k in ("a", "c")}
    threads = flood(url, token_of["a"], count) + flood(url, token_of["c"], count, offset=1000)
    weight = {"a": 1, "c": 3}
    computed = {"a": 0.0, "c": 0.0}
    finished = {"a": 0, "c": 0}
    while any(t.is_alive() for t in threads):
        vtimes = _computed(url, admin)
        if ids["a"] in vtimes and ids["c"] in vtimes:  # both still have work
            computed = {k: vtimes[ids[k]] * weight[k] for k in weight}
        now = {k: _usage(url, admin, ids[k]) for k in ("a", "c")}
        finished = {k: now[k][1] - before[k][1] for k in now}
        if sum(now[k][0] - before[k][0] for k in now) >= count:
            break
        time.sleep(0.5)
    for thread in threads:
        thread.join()
    out: dict[str, float] = {}
    for name, figures in (("computed", computed), ("finished", finished)):
        total = sum(figures.values()) or 1
        out |= {f"{name}_share_{k}": figures[k] / total for k in figures}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument(
        "--batch-size", type=int, default=512, help="models[].batch_size: the prefill a step may take"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="models[].prefill_chunk: the prefill a step takes while others generate (default: the daemon's)",
    )
    parser.add_argument(
        "--compare-stops",
        action="store_true",
        help="also measure fair share on the same model loaded with preempt_steps: false, each round",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgellm-bench-fairness-") as tmp:
        workdir = Path(tmp)
        model = demo_model(workdir)
        keys = workdir / "keys.yaml"
        ids, tokens = {}, {}
        for name, scopes, weight in (
            ("admin", ["admin"], None),
            ("a", ["inference"], 1),
            ("b", ["inference"], 1),
            ("c", ["inference"], 3),
        ):
            ids[name], tokens[name] = create_key(keys, name, scopes, limits={}, weight=weight)
        figures: dict[str, list[float]] = {"idle": [], "one tenant": [], "fair share": []}
        floods: dict[str, list[float]] = {"one tenant": [], "fair share": []}
        if args.compare_stops:
            figures[UNSTOPPED_LABEL] = []
            floods[UNSTOPPED_LABEL] = []
        compare = args.compare_stops
        with daemon(
            model, workdir, keys, args.slots, args.batch_size, args.prefill_chunk, compare_stops=compare
        ) as url:
            _post(url, tokens["b"], PROBE, first_token=True)  # warm
            for n in range(args.rounds):
                idle = [_post(url, tokens["b"], probe(), first_token=True) for _ in range(5)]
                before, took_before = probes_during(url, tokens["a"], flood(url, tokens["a"], args.flood))
                after, took_after = probes_during(url, tokens["b"], flood(url, tokens["a"], args.flood))
                floods["one tenant"].append(took_before)
                floods["fair share"].append(took_after)
                measured = [("idle", idle), ("one tenant", before), ("fair share", after)]
                if args.compare_stops:
                    unstopped, took = probes_during(
                        url, tokens["b"], flood(url, tokens["a"], args.flood, model=UNSTOPPED), UNSTOPPED
                    )
                    floods[UNSTOPPED_LABEL].append(took)
                    measured.append((UNSTOPPED_LABEL, unstopped))
                for label, values in measured:
                    figures[label] += values
                    print(
                        f"  round {n + 1} {label}: TTFT p50 {_p(values, 0.5):.3f} s, "
                        f"p95 {_p(values, 0.95):.3f} s ({len(values)} probes)"
                    )
                print(
                    f"  round {n + 1} A's flood took {took_before:.1f} s, {took_after:.1f} s under fair share"
                    + (f", {floods[UNSTOPPED_LABEL][-1]:.1f} s with no step stopped" if compare else "")
                )
            weights = shares(url, tokens["admin"], ids, tokens, args.flood // 2)
            print(
                f"  weights 3:1: c computed {weights['computed_share_c']:.2f} of the tokens "
                f"(finished {weights['finished_share_c']:.2f}), a {weights['computed_share_a']:.2f} "
                f"({weights['finished_share_a']:.2f})"
            )
    idle95 = _p(figures["idle"], 0.95)
    result: dict[str, Any] = {
        "slots": args.slots,
        "flood": args.flood,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "prefill_chunk": args.prefill_chunk,
        "flood_s": {label: round(statistics.median(v), 1) for label, v in floods.items()},
    }
    for label, values in figures.items():
        result[label] = {
            "ttft_p50_s": round(_p(values, 0.5), 3),
            "ttft_p95_s": round(_p(values, 0.95), 3),
            "p95_over_idle": round(_p(values, 0.95) / idle95, 2),
            "probes": len(values),
            "median_s": round(statistics.median(values), 3) if values else None,
        }
    result["weights_3_to_1"] = {k: round(v, 3) for k, v in weights.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
