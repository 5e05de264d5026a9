"""Usage, quotas and the audit log on the daemon: what clients were told is what the ledger holds,
a spent budget refuses the next request with its reset time, and the audit chain shows edits.
The kill -9 test runs the daemon as a process of its own and kills it under traffic."""

from __future__ import annotations

import contextlib
import csv
import http.client
import io
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from edgellmctl.__main__ import main as ctl
from edgellmctl.admin import format_status
from edgellmctl.keys import create_key
from edgellmd.api.context import LEDGER
from edgellmd.host import systemd as systemd_module
from edgellmd.http import ledger as http_ledger
from edgellmd.http import logs
from edgellmd.ledger import audit
from edgellmd.ledger import usage as usage_module
from edgellmd.ledger.audit import AuditEntry
from edgellmd.ledger.store import AuditHandler, Ledger, utc_text
from edgellmd.settings import ConsoleSettings
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import RunningDaemon, at_once, free_port, running, settings_for, wait_for
from tests.test_host_systemd import NotifySocket

HI: Any = [{"role": "user", "content": "hi"}]
# Slow enough (a few hundred tokens a second on one thread) that a stream holds its slot for seconds.
SLOW = TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)


def _call(url: str, token: str, method: str = "GET", body: Any = None) -> tuple[int, Any, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - loopback URL
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            raw = response.read()
            kind = response.headers.get("Content-Type", "")
            return (
                response.status,
                json.loads(raw) if "json" in kind else raw.decode(),
                dict(response.headers),
            )
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


class Box:
    def __init__(
        self, daemon: RunningDaemon, tokens: dict[str, str], ids: dict[str, str], database: Path
    ) -> None:
        self.daemon, self.tokens, self.ids, self.database = daemon, tokens, ids, database

    def admin(self, path: str) -> tuple[int, Any, dict[str, str]]:
        return _call(self.daemon.url + path, self.tokens["admin"])


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    root = tmp_path_factory.mktemp("usage")
    model = write_tiny_model(root / "m.gguf", TinyModelSpec(seed=61))
    keys = root / "keys.yaml"
    tokens, ids = {}, {}
    for name, scopes, quota in (
        ("admin", ["admin"], None),
        ("alice", ["inference"], None),
        ("bob", ["inference"], None),
        ("capped", ["inference"], {"tokens_per_month": 60}),
        ("counted", ["inference"], {"requests_per_day": 2}),
        ("leaver", ["inference"], None),
        ("embedder", ["inference"], None),
        ("crashed", ["inference"], None),
        ("player", ["inference"], {"requests_per_day": 2}),
        ("holder", ["inference"], None),
        ("queuer", ["inference"], None),
        ("shed", ["inference"], None),
    ):
        ids[name], tokens[name] = create_key(keys, name, scopes, limits={}, quota=quota)
    database = root / "ledger.sqlite3"
    slow = write_tiny_model(root / "slow.gguf", SLOW)
    settings = settings_for(
        [
            {"name": "m", "file": str(model), "threads": 1, "slots": 2, "context_size": 512},
            {"name": "slow", "file": str(slow), "threads": 1, "slots": 1, "context_size": 2048},
            {
                "name": "shed",
                "file": str(slow),
                "threads": 1,
                "slots": 1,
                "context_size": 2048,
                "queue_timeout_s": 0.5,
            },
            {"name": "k", "file": str(model), "threads": 1, "slots": 2, "context_size": 512},
            {
                "name": "e",
                "file": str(model),
                "threads": 1,
                "slots": 1,
                "context_size": 512,
                "embedding": True,
            },
        ],
        auth={"keys_file": str(keys)},
        ledger={"database": str(database), "time_zone": "Europe/Berlin"},
    )
    settings = replace(settings, console=ConsoleSettings(enabled=True))  # the playground's budgets
    with running(settings) as daemon:
        yield Box(daemon, tokens, ids, database)


def test_a_monthly_quota_runs_out_mid_stream_the_stream_finishes_the_next_request_is_refused(
    box: Box,
) -> None:
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.tokens["capped"], max_retries=0)
    stream = client.chat.completions.create(
        model="m",
        messages=HI,
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.total_tokens > 60  # past the budget, and still answered whole
    assert chunks[-2].choices[0].finish_reason == "length"
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="m", messages=HI, max_tokens=1)
    error = refused.value
    assert error.code == "quota_exceeded"
    reset = datetime.fromisoformat(error.response.headers["x-quota-reset"])
    now = datetime.now(reset.tzinfo)
    assert (reset.day, reset.hour, reset.minute) == (1, 0, 0)  # the first of next month, Berlin time
    assert reset > now
    assert str(reset.utcoffset()) in ("1:00:00", "2:00:00")
    assert int(error.response.headers["Retry-After"]) == pytest.approx((reset - now).total_seconds(), abs=5)
    assert "resets at" in str(error.message)
    # Anthropic's clients are refused alike, in their shape.
    messages = anthropic.Anthropic(base_url=box.daemon.url, api_key=box.tokens["capped"], max_retries=0)
    with pytest.raises(anthropic.RateLimitError):
        messages.messages.create(model="m", max_tokens=1, messages=HI)
    # Another key is not touched by this one's budget.
    other = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.tokens["bob"], max_retries=0)
    assert other.chat.completions.create(model="m", messages=HI, max_tokens=1).usage is not None
    wanted = f"quota exceeded: tokens_per_month ({usage.total_tokens} of 60)"

    def audited() -> int:
        status, records, _ = box.admin(f"/admin/audit?key={box.ids['capped']}&action=quota")
        assert status == 200
        return [r["action"] for r in records["data"]].count(wanted)

    # The audit line reaches the database on the ledger's writer thread, a moment later.
    wait_for(lambda: audited() >= 1, timeout=10, what="the quota breach in the audit log")
    assert audited() == 1  # once per budget and period, however many refusals


def test_requests_arriving_together_cannot_pass_a_request_budget_together(box: Box) -> None:
    """requests_per_day 2 and six requests at once: two are served, four refused, and the day
    holds two; the requests in flight counted as spent from their admission."""
    body = {"model": "m", "max_tokens": 40, "ignore_eos": True, "messages": HI}

    def ask() -> int:
        return _call(box.daemon.url + "/v1/chat/completions", box.tokens["counted"], "POST", body)[0]

    assert sorted(at_once(ask, 6)) == [200, 200, 429, 429, 429, 429]
    # The next is refused too (the day's two are spent), and a refused one freed nothing.
    status, error, headers = _call(
        box.daemon.url + "/v1/chat/completions", box.tokens["counted"], "POST", body
    )
    assert status == 429
    assert error["error"]["code"] == "quota_exceeded"
    assert "x-quota-reset" in headers


def test_the_consoles_playground_cannot_pass_a_request_budget_together_either(box: Box) -> None:
    """The console's playground counts against the key's budgets as /v1 does: once, six
    completions sent together from a signed-in session all passed requests_per_day 2."""
    status, signed, headers = _call(
        box.daemon.url + "/ui/api/session", "", "POST", {"key": box.tokens["player"]}
    )
    assert status == 200, signed
    cookie = headers["Set-Cookie"].split(";", 1)[0]
    sent = {"Cookie": cookie, "X-CSRF-Token": signed["csrf"], "Content-Type": "application/json"}
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 40, "ignore_eos": True})

    def ask() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", box.daemon.port, timeout=60)
        try:
            conn.request("POST", "/ui/api/complete", body=body, headers=sent)
            answer = conn.getresponse()
            answer.read()
            return answer.status
        finally:
            conn.close()

    assert sorted(at_once(ask, 6)) == [200, 200, 429, 429, 429, 429]
    assert _totals_once_recorded(box, "player", 2)["requests"] == 2


def test_usage_answers_what_clients_were_told_as_json_csv_and_in_edgellmctl(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.tokens["alice"], max_retries=0)
    told = [client.chat.completions.create(model="m", messages=HI, max_tokens=3 + i).usage for i in range(3)]
    stream = client.chat.completions.create(
        model="m",
        messages=HI,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    told.append(list(stream)[-1].usage)
    messages = anthropic.Anthropic(base_url=box.daemon.url, api_key=box.tokens["alice"], max_retries=0)
    reply = messages.messages.create(model="m", max_tokens=2, messages=HI)
    # Anthropic's input_tokens leaves out what was read from the cache: the prompt is both.
    read = reply.usage.cache_read_input_tokens or 0
    prompt = sum(u.prompt_tokens for u in told if u) + reply.usage.input_tokens + read
    completion = sum(u.completion_tokens for u in told if u) + reply.usage.output_tokens

    status, answer, _ = box.admin(f"/admin/usage?key={box.ids['alice']}&group=month")
    assert status == 200
    rows = {row["endpoint"]: row for row in answer["data"]}
    assert rows["/v1/chat/completions"]["requests"] == 4
    assert rows["/v1/messages"]["requests"] == 1
    assert answer["totals"]["prompt_tokens"] == prompt
    assert answer["totals"]["completion_tokens"] == completion
    assert answer["time_zone"] == "Europe/Berlin"
    assert {row["period"] for row in answer["data"]} == {datetime.now().astimezone().strftime("%Y-%m")}

    status, text, headers = box.admin(f"/admin/usage?key={box.ids['alice']}&format=csv")
    assert headers["Content-Type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert sum(int(r["total_tokens"]) for r in parsed) == prompt + completion

    monkeypatch.setenv("EDGELLM_ADMIN_KEY", box.tokens["admin"])  # never on the command line
    common = ["--url", box.daemon.url]
    assert ctl(["usage", "--key-id", box.ids["alice"], "--group", "month", *common]) == 0
    table = capsys.readouterr().out
    assert "/v1/messages" in table
    assert f"{prompt + completion}" in table.splitlines()[-2]  # the total line
    assert ctl(["usage", "--key-id", box.ids["alice"], "--csv", *common]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("period,key_id,model,endpoint")
    assert ctl(["usage", "--key-id", box.ids["alice"], "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["total_tokens"] == prompt + completion


def _totals_once_recorded(box: Box, key: str, requests: int) -> dict[str, int]:
    """A key's usage totals for the month, once the ledger holds `requests` of its requests."""

    def totals() -> dict[str, int] | None:
        status, answer, _ = box.admin(f"/admin/usage?key={box.ids[key]}&group=month")
        assert status == 200, answer
        found: dict[str, int] = answer["totals"]
        return found if found["requests"] == requests else None

    counted: dict[str, int] = wait_for(totals, what=f"{requests} request(s) of {key} in the ledger")
    return counted


def test_a_stream_the_client_leaves_is_charged_for_what_it_produced(box: Box) -> None:
    """Tokens computed and sent are counted (ledger, tpm, quotas) when the client goes before
    the end: once, a cut stream was charged its prompt alone, whatever it had received."""
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.tokens["leaver"], max_retries=0)
    received = 0
    for _ in range(2):
        stream = client.chat.completions.create(
            model="m", messages=HI, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        pieces = 0
        for chunk in stream:
            pieces += sum(1 for c in chunk.choices if c.delta.content)
            if pieces == 25:
                break
        stream.close()  # the client goes, mid-stream
        received += pieces

    counted = _totals_once_recorded(box, "leaver", 2)
    assert received == 50
    assert 50 <= counted["completion_tokens"] < 2 * 300  # what was sent, and no more than was asked


def test_a_stream_whose_engine_dies_is_charged_for_what_it_sent(box: Box) -> None:
    """The engine's death ends its generations with a Finished of no tokens: once, every token
    already streamed went uncharged (ledger, tpm, quotas)."""
    status = box.admin("/admin/status")[1]
    pid = next(m for m in status["models"] if m["name"] == "k")["engine_process"]["pid"]
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.tokens["crashed"], max_retries=0)
    stream = client.chat.completions.create(
        model="k", messages=HI, max_tokens=400, stream=True, n=2, extra_body={"ignore_eos": True}
    )
    pieces = 0

    def read() -> None:
        nonlocal pieces
        for chunk in stream:
            pieces += sum(1 for c in chunk.choices if c.delta.content)
            if pieces == 30:
                os.kill(pid, signal.SIGKILL)

    with pytest.raises(openai.APIError):  # the stream's error event: the engine is gone
        read()
    assert pieces >= 30
    counted = _totals_once_recorded(box, "crashed", 1)
    assert pieces <= counted["completion_tokens"] <= 2 * 400
    wait_for(lambda: box.admin("/readyz")[0] == 200, what="model k back")


def _hold_the_slot(box: Box, model: str) -> http.client.HTTPConnection:
    """A stream of 1,500 tokens in the model's one slot, its first token read."""
    conn = http.client.HTTPConnection("127.0.0.1", box.daemon.port, timeout=60)
    body = {"model": model, "prompt": "hog", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {box.tokens['holder']}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    answer = conn.getresponse()
    assert answer.status == 200
    assert answer.readline().startswith(b"data: ")
    return conn


def _queue_depth(box: Box, model: str) -> int:
    status = box.admin("/admin/status")[1]
    return int(next(m for m in status["models"] if m["name"] == model)["queue_depth"])


def test_a_request_refused_or_left_before_it_had_a_slot_is_charged_nothing(box: Box) -> None:
    """Its prompt was never computed, yet it was charged in full (ledger, tpm, quotas): a 429
    `server_overloaded` past the queue timeout (which SDKs retry, each retry billed again) and
    a request whose client left while it waited."""
    prompt = "tell me a story " * 40
    holder = _hold_the_slot(box, "shed")
    try:
        status, answer, _ = _call(
            box.daemon.url + "/v1/completions",
            box.tokens["shed"],
            "POST",
            {"model": "shed", "prompt": prompt, "max_tokens": 4},
        )
        assert status == 429, answer
        assert answer["error"]["code"] == "server_overloaded"
    finally:
        holder.close()
    counted = _totals_once_recorded(box, "shed", 1)
    assert (counted["prompt_tokens"], counted["completion_tokens"]) == (0, 0)

    holder = _hold_the_slot(box, "slow")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", box.daemon.port, timeout=60)
        body = {"model": "slow", "prompt": prompt, "max_tokens": 4, "stream": True}
        headers = {"Authorization": f"Bearer {box.tokens['queuer']}", "Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        wait_for(lambda: _queue_depth(box, "slow") == 1, what="the request waiting")
        conn.close()  # the client goes while it waits
        wait_for(lambda: _queue_depth(box, "slow") == 0, what="the request gone from the queue")
    finally:
        holder.close()
    counted = _totals_once_recorded(box, "queuer", 1)
    assert (counted["prompt_tokens"], counted["completion_tokens"]) == (0, 0)
    # One that had its slot is charged its prompt, as before.
    status, answer, _ = _call(
        box.daemon.url + "/v1/completions",
        box.tokens["queuer"],
        "POST",
        {"model": "slow", "prompt": prompt, "max_tokens": 4},
    )
    assert status == 200, answer
    counted = _totals_once_recorded(box, "queuer", 2)
    assert counted["prompt_tokens"] == answer["usage"]["prompt_tokens"] > 100


def test_an_embedding_request_the_client_leaves_is_in_the_ledger_as_in_its_rate_limit(box: Box) -> None:
    text = " ".join(f"word{i}" for i in range(50))
    body = json.dumps({"model": "e", "input": [f"{text} {j}" for j in range(256)]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", box.daemon.port, timeout=10)
    conn.request(
        "POST",
        "/v1/embeddings",
        body,
        {"Authorization": f"Bearer {box.tokens['embedder']}", "Content-Type": "application/json"},
    )

    def embedding() -> bool:  # tokenized and charged, being embedded (a fixed wait was short on a busy box)
        model = next(m for m in box.admin("/admin/status")[1]["models"] if m["name"] == "e")
        done = box.admin(f"/admin/usage?key={box.ids['embedder']}&group=month")[1]["totals"]["requests"]
        return bool(model["slots_busy"] or model["queue_depth"] or done)  # done: it was quicker

    wait_for(embedding, timeout=30, interval=0.02, what="the embedding under way")
    conn.close()  # the client goes

    counted = _totals_once_recorded(box, "embedder", 1)
    assert counted["prompt_tokens"] > 256 * 50
    assert counted["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("since=2026-13-01", "since"),
        ("since=12/01/2026", "since"),
        ("since=2026-12-05&until=2026-12-01", "until"),
        ("until=9999-12-31", "until"),  # its next day is past what a date can hold
        ("since=0001-01-01&until=2026-12-01", "since"),
        ("since=1969-12-31", "since"),
        ("since=2026-W49-1", "since"),  # a week date: fromisoformat reads it, the API says a calendar date
        ("until=2026-12-0%D9%A1", "until"),  # an Arabic-Indic digit
        ("group=week", "group"),
        ("format=xml", "format"),
        ("key=ELK", "key"),
        ("model=" + "x" * 200, "model"),
        ("model=%00", "model"),
        ("colour=blue", "colour"),
        ("group=day&group=hour", "group"),
    ],
)
def test_bad_usage_queries_are_400s_that_name_the_parameter(box: Box, query: str, param: str) -> None:
    status, answer, _ = box.admin(f"/admin/usage?{query}")
    assert status == 400, answer
    assert answer["error"]["param"] == param


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=%C2%B2",
        "limit=99999999",
        "action=",
        "since=yesterday",
        "until=9999-12-31",
        "since=2026-W49-1",
        "since=2026-12-07&until=2026-12-06",  # reversed: was an empty 200 here, a 400 on /admin/usage
    ],
)
def test_bad_audit_queries_are_400s(box: Box, query: str) -> None:
    assert box.admin(f"/admin/audit?{query}")[0] == 400


def test_usage_and_audit_need_the_admin_scope(box: Box) -> None:
    assert _call(box.daemon.url + "/admin/usage", box.tokens["alice"])[0] == 403
    assert _call(box.daemon.url + "/admin/audit", box.tokens["alice"])[0] == 403


def test_admin_actions_are_chained_and_a_hand_edit_is_found(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, _ = _call(box.daemon.url + "/admin/reload", box.tokens["admin"], "POST", {})
    assert status == 200
    wait_for(
        lambda: any("admin reload" in r["action"] for r in box.admin("/admin/audit")[1]["data"]),
        what="the reload's audit record",
    )
    status, answer, _ = box.admin("/admin/audit?action=reload")
    record = answer["data"][-1]
    assert record["key_id"] == box.ids["admin"]
    assert answer["chain"]["ok"] is True
    assert answer["chain"]["usage"]["ok"] is True  # the usage against its seals (test_ledger_seals)
    assert box.admin("/admin/status")[1]["ledger"]["usage_seals"]["problems"] == 0
    assert ctl(["audit", "verify", "--database", str(box.database)]) == 0
    assert "intact" in capsys.readouterr().out
    assert ctl(["audit", "show", "--database", str(box.database), "--action", "admin reload", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown[-1]["hash"] == record["hash"]

    copy = tmp_path / "edited.sqlite3"
    source = sqlite3.connect(box.database)
    target = sqlite3.connect(copy)
    source.backup(target)
    source.close()
    target.execute("UPDATE audit SET action = 'admin reload: nothing' WHERE seq = ?", (record["seq"],))
    target.commit()
    target.close()
    assert ctl(["audit", "verify", "--database", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"record {record['seq']} was edited" in out
    assert ctl(["audit", "verify", "--database", str(tmp_path / "none.sqlite3")]) == 1
    assert "no ledger" in capsys.readouterr().err


def test_a_rewrite_with_every_hash_recomputed_is_found_against_the_daemons_log(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """What the chain alone cannot show: a writer of the database who edits a record and
    recomputes every hash after it. The daemon's log (the journal) holds each record's hash as
    it was written: `audit verify --against` finds the rewrite there."""
    caplog.set_level(logging.INFO, logger="edgellmd.ledger")
    # Another daemon's ledger in this process, ahead of ours (the session's shared daemon may be
    # one): its mirror lines of the same audit records are in the log too, and are not ours.
    other = Ledger(None)
    other.audit(AuditEntry(utc_text(time.time()), "INFO", "another daemon's record")).result(5)
    beside = AuditHandler(other)
    logging.getLogger("edgellmd.audit").addHandler(beside)
    try:
        for _ in range(3):
            assert _call(box.daemon.url + "/admin/reload", box.tokens["admin"], "POST", {})[0] == 200
    finally:
        logging.getLogger("edgellmd.audit").removeHandler(beside)
    wait_for(lambda: other.status()["audit_head"] >= 4, what="the other ledger's records")
    other.close()

    def journal() -> str:
        """This daemon's mirror lines, as its log writes them (JSON and text lines in turn): in
        one test process, every daemon's ledger (the session's shared daemon too) takes the
        records of the one audit logger."""
        ours = [r for r in caplog.records if getattr(r, "database", None) == str(box.database)]
        formats = (logs.JsonFormatter(), logs.TextFormatter(logs.TEXT_FORMAT))
        return "".join(
            f"{formats[i % 2].format(logging.makeLogRecord({**vars(r), 'request_id': '-'}))}\n"
            for i, r in enumerate(ours)
        )

    wait_for(lambda: journal().count("audit record") >= 3, what="the records' mirror lines")
    log_file = tmp_path / "journal.txt"
    log_file.write_text(journal())
    assert ctl(["audit", "verify", "--database", str(box.database), "--against", str(log_file)]) == 0
    assert "the log's copy agrees" in capsys.readouterr().out

    copy = tmp_path / "rewritten.sqlite3"
    source, target = sqlite3.connect(box.database), sqlite3.connect(copy)
    source.backup(target)
    source.close()
    mirrored = [found[0] for found in map(audit.mirrored_record, log_file.read_text().splitlines()) if found]
    rows = target.execute(
        "SELECT seq, at, level, action, key_id, peer, detail, prev FROM audit WHERE seq >= ? ORDER BY seq",
        (mirrored[0],),
    ).fetchall()
    prev = rows[0][7]
    for seq, at, level, written, key_id, peer, detail, _ in rows:  # the forger's rewrite, hashes and all
        action = "nothing happened here" if seq == mirrored[0] else written
        digest = audit.record_hash(prev, (seq, at, level, action, key_id, peer, detail))
        target.execute(
            "UPDATE audit SET action = ?, prev = ?, hash = ? WHERE seq = ?", (action, prev, digest, seq)
        )
        prev = digest
    target.commit()
    target.close()
    assert ctl(["audit", "verify", "--database", str(copy)]) == 0  # the chain alone: whole
    assert "intact" in capsys.readouterr().out
    assert ctl(["audit", "verify", "--database", str(copy), "--against", str(log_file)]) == 1
    assert f"record {mirrored[0]} is not what the log says was written: rewritten" in capsys.readouterr().out
    with log_file.open() as lines, sqlite3.connect(copy) as conn:  # and a removal
        conn.execute("DELETE FROM audit WHERE seq = ?", (mirrored[-1],))
        _, problem = audit.compare(conn, lines)
    assert problem is not None
    assert "rewritten" in problem or "removed" in problem


@pytest.mark.parametrize(
    "args",
    [["--limit", "9" * 23], ["--since", "garbage"], ["--since", "12/01/2030"], ["--until", "9999-12-31"]],
)
def test_audit_show_refuses_a_bad_argument_in_one_line(
    box: Box, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        ctl(["audit", "show", "--database", str(box.database), *args])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # never records filtered by a date it could not read
    assert err.strip().splitlines()[-1].startswith(f"edgellmctl audit show: error: argument {args[0]}")


def test_audit_show_reads_a_time_with_its_zone(box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    def shown(*args: str) -> list[dict[str, Any]]:
        assert ctl(["audit", "show", "--database", str(box.database), "--json", *args]) == 0
        records: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
        return records

    for _ in range(2):
        assert _call(box.daemon.url + "/admin/reload", box.tokens["admin"], "POST", {})[0] == 200
        time.sleep(0.02)
    wait_for(lambda: len(shown()) >= 2, what="two audit records")
    second = shown()[-1]
    at = datetime.fromisoformat(second["at"].replace("Z", "+00:00"))
    east = at.astimezone(timezone(timedelta(hours=2))).isoformat()  # the same instant, written at +02:00
    since, until = shown("--since", east), shown("--until", east)
    assert second["seq"] in [r["seq"] for r in since]
    assert all(r["at"] >= second["at"] for r in since)
    assert until
    assert all(r["at"] < second["at"] for r in until)


def test_a_log_without_the_ledgers_lines_is_no_pass(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wrong file (or one from before the records the database holds) compares nothing."""
    log_file = tmp_path / "other.log"
    log_file.write_text(f"GET /audit%20record%201%20{'0' * 64} 404\n")
    assert ctl(["audit", "verify", "--database", str(box.database), "--against", str(log_file)]) == 1
    assert "nothing was compared" in capsys.readouterr().out


# ---- kill -9 under traffic -------------------------------------------------------------------------


def test_after_kill_9_under_traffic_the_ledger_holds_what_every_client_was_told(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=62))
    keys = tmp_path / "keys.yaml"
    tokens = [create_key(keys, f"app{i}", ["inference"], limits={})[1] for i in range(3)]
    database = tmp_path / "ledger.sqlite3"
    port = free_port()
    config = {
        "server": {"port": port},
        "models": [{"name": "m", "file": str(model), "threads": 1, "slots": 4, "context_size": 512}],
        "lock": {"allow_unsigned": True},
        "lifecycle": {"watch": False, "preload_dir": None},
        "auth": {"keys_file": str(keys)},
        "ledger": {"database": str(database)},
    }
    config_path = tmp_path / "edgellm.yaml"
    config_path.write_text(json.dumps(config))
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgellmd", "--config", str(config_path)], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    told: dict[str, tuple[int, int]] = {}  # request id -> (prompt, completion), as the client read them
    sent = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def client(token: str, stream: bool) -> None:
        while not stop.is_set():
            body: dict[str, Any] = {"model": "m", "messages": HI, "max_tokens": 8}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            request = urllib.request.Request(  # noqa: S310 - loopback URL
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            with lock:
                sent[0] += 1
            try:
                with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                    rid = response.headers["X-Request-Id"]
                    raw = response.read()
            except (OSError, ValueError, http.client.HTTPException):
                return  # the kill: this request was never told
            if stream:
                events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
                usage = json.loads(events[-1])["usage"] if events else None
            else:
                usage = json.loads(raw)["usage"]
            if usage is None:
                return  # cut before its usage arrived
            with lock:
                told[rid] = (usage["prompt_tokens"], usage["completion_tokens"])

    try:
        wait_for(lambda: _ready(url), timeout=60, what="the daemon")
        threads = [threading.Thread(target=client, args=(t, i % 2 == 1)) for i, t in enumerate(tokens * 2)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(told) >= 40, timeout=120, what="40 answered requests")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    conn = sqlite3.connect(database)
    try:
        rows = {
            rid: (prompt, completion)
            for rid, prompt, completion in conn.execute(
                "SELECT request_id, prompt_tokens, completion_tokens FROM usage_requests"
            )
        }
        hours = conn.execute(
            "SELECT SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) FROM usage_hours"
        ).fetchone()
        periods = conn.execute(
            "SELECT SUM(tokens), SUM(requests) FROM usage_periods WHERE period LIKE 'month:%'"
        ).fetchone()
    finally:
        conn.close()
    for rid, usage in told.items():
        assert rows.get(rid) == usage, rid  # every answer's usage, to the token
    cut = set(rows) - set(told)
    assert len(cut) <= len(tokens) * 2  # beyond those: only requests in flight at the kill
    # The totals are the requests' own sums: nothing counted twice, nothing half written.
    assert hours == (len(rows), sum(p for p, _ in rows.values()), sum(c for _, c in rows.values()))
    assert periods == (sum(p + c for p, c in rows.values()), len(rows))


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:  # noqa: S310 - loopback URL
            return bool(response.status == 200)
    except OSError:
        return False


def test_a_ledger_file_removed_while_the_daemon_runs_is_said_and_nothing_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usage database and its WAL removed under a running daemon: /admin/status said all was
    well, /readyz ready, /admin/usage answered 500 with a traceback in the log, and after the
    restart every request was gone. Now /readyz says `ledger_failing`, status names the file, a
    read that fails is a 503, and the stop writes the whole database back."""
    monkeypatch.setattr(http_ledger, "RETRY_INTERVAL_S", 0.2)
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    database = tmp_path / "usage.sqlite3"
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "context_size": 256}],
        ledger={"database": str(database)},
    )
    ask = {"model": "m", "prompt": "x", "max_tokens": 2}
    with running(settings) as daemon:
        assert daemon.post("/v1/completions", ask)[0] == 200
        for suffix in ("", "-wal", "-shm"):
            database.with_name(database.name + suffix).unlink(missing_ok=True)
        for _ in range(3):
            assert daemon.post("/v1/completions", ask)[0] == 200
        wait_for(lambda: daemon.get("/readyz")[1]["status"] == "ledger_failing", what="/readyz to say so")
        # What is wrong in a few words, neither the path nor "cannot commit" (it commits, into the gone file)
        assert daemon.get("/readyz")[1]["reason"] == "the usage ledger's database file is gone from its path"
        shown = daemon.get("/admin/status")[1]["ledger"]["error"]
        assert f"the database file {database} was removed while the daemon ran" in shown
        status, body = daemon.get("/admin/usage")
        assert status in (200, 503), body  # read from the open file, or refused: never a 500
        if status == 503:
            assert body["error"]["code"] == "ledger_failing"
    conn = sqlite3.connect(str(database))
    try:
        assert conn.execute("SELECT COUNT(*) FROM usage_requests").fetchone()[0] == 4
    finally:
        conn.close()


def test_an_admin_read_the_database_refuses_is_a_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/admin/usage and /admin/audit whose read fails in SQLite: 503 `ledger_failing` naming
    the error, not a 500 with a traceback."""

    def broken(self: Ledger, fn: Any) -> Any:
        failed: Any = Future()
        failed.set_exception(sqlite3.OperationalError("disk I/O error"))
        return failed

    monkeypatch.setattr(Ledger, "read", broken)
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "context_size": 256}],
        ledger={"database": str(tmp_path / "usage.sqlite3")},
    )
    with running(settings) as daemon:
        for path in ("/admin/usage", "/admin/audit"):
            status, body = daemon.get(path)
            assert status == 503, body
            assert body["error"]["code"] == "ledger_failing"
            assert (
                body["error"]["message"]
                == "the usage ledger cannot be read: OperationalError: disk I/O error"
            )


def test_a_ledger_that_cannot_commit_makes_the_box_unready_until_it_can_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the usage database: the answers still go out, the records are kept,
    /readyz says `ledger_failing` (a balancer sends the traffic elsewhere), and once the disk
    has room the kept records are written with no new request needed to trigger it. systemd's
    STATUS= and `edgellmctl status` say so too (they said "1/1 models ready" while the
    balancer had taken the box out)."""
    notify = NotifySocket(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
    monkeypatch.setattr(systemd_module, "STATUS_EVERY_S", 0.2)
    full = threading.Event()
    real = usage_module.write

    def write(conn: Any, record: Any, zone: Any, *, detail: bool) -> bool:
        if full.is_set():
            raise sqlite3.OperationalError("database or disk is full")
        return bool(real(conn, record, zone, detail=detail))

    monkeypatch.setattr(usage_module, "write", write)
    monkeypatch.setattr(http_ledger, "RETRY_INTERVAL_S", 0.2)
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=3))
    settings = settings_for(
        [{"name": "m", "file": str(model), "threads": 1, "context_size": 256}],
        ledger={"database": str(tmp_path / "usage.sqlite3")},
    )

    def told(since: float) -> list[str]:
        return [m for t, m in notify.messages if t > since and m.startswith("STATUS=")]

    failing = "STATUS=NOT READY: the usage ledger cannot commit (OperationalError: database or disk is full)"
    with contextlib.closing(notify), running(settings) as daemon:
        notify.wait_for("READY=1")
        full.set()
        status, body = daemon.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 3})
        assert status == 200, body  # the client's answer does not wait for the disk
        status, ready = daemon.get("/readyz")
        assert (status, ready["status"]) == (503, "ledger_failing"), ready
        assert "disk" not in json.dumps(ready)  # the cause is for the admin API, not the public probe
        assert ready["reason"] == "the usage ledger cannot commit"
        assert daemon.app is not None
        ledger = daemon.app[LEDGER]
        assert "disk is full" in (ledger.status()["error"] or "")
        assert ledger.status()["waiting"] == 1
        wait_for(lambda: any(m.startswith(failing) for m in told(0)), what="STATUS= to say so")
        shown = format_status(daemon.get("/admin/status")[1])
        assert "ledger: FAILING, usage and the audit trail are not being written" in shown, shown
        assert "database or disk is full" in shown
        full.clear()  # room again: the next retry writes what was kept
        wait_for(lambda: daemon.get("/readyz")[0] == 200, what="the ledger to commit again")
        assert ledger.status()["waiting"] == 0
        assert ledger.records == 1
        mark = time.monotonic()
        wait_for(lambda: told(mark), what="STATUS= again")
        assert all(m.startswith("STATUS=1/1 models ready") for m in told(mark)), told(mark)
        assert "FAILING" not in format_status(daemon.get("/admin/status")[1])
