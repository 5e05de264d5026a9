"""The web console in a real Chromium: sign-in, overview against /admin/status, reload, keys, playground.

The playground's files (images, audio clips) run on a daemon of their own, whose tiny models
have tiny projectors (tests.ggufmodels), with low media.* and server.max_body_bytes bounds.

Debian's `chromium` driven by Playwright for Python (`executable_path`: nothing downloads a
browser; `./dev test` installs the package). One browser for the module, one signed-in page
for the tests that share it; every test fails if the page logged a console error, threw, or
met a Content Security Policy violation. With EDGELLM_SCREENSHOTS=DIR the tests also write
the README's screenshots (console-overview.png, console-playground.png) into DIR.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal
from zoneinfo import ZoneInfo

import numpy as np
import openai
import pytest
from PIL import Image

from edgellmctl.keys import create_key
from edgellmd import __version__
from edgellmd.__main__ import drain
from edgellmd.http.console.sessions import SESSIONS
from edgellmd.settings import ConsoleSettings
from tests import fakenvml
from tests.ggufmodels import TinyModelSpec, write_tiny_audio_projector, write_tiny_model, write_tiny_projector
from tests.serving import RunningDaemon, SignedLock, running, settings_for, wait_for

CHROMIUM: Final = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,  # a real browser: left out of ./dev test --quick
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="Debian's chromium is not installed (./dev test installs it with apt-get)",
    ),
]
# Chromium as root needs --no-sandbox; the background services would call out of a closed network.
CHROMIUM_ARGS: Final = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS: Final = 15_000
CSP_LISTENER: Final = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(e.violatedDirective + " " + e.blockedURI);
});
"""
MODEL: Final = SignedLock.model

if CHROMIUM.exists():  # the module is skipped without it; playwright is a test dependency
    from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright


@dataclass
class Box:
    daemon: RunningDaemon
    lock: SignedLock
    keys: Path
    token: str  # the operator's key: admin and inference

    def admin_get(self, path: str) -> Any:
        request = urllib.request.Request(  # noqa: S310 - loopback URL
            self.daemon.url + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return json.loads(response.read())


@dataclass
class Watched:
    """A page and what it reported: console errors, uncaught errors, CSP violations."""

    page: Page
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        violations = self.page.evaluate("window.__cspViolations || []")
        return [*self.errors, *(f"CSP violation: {v}" for v in violations)]


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    root = tmp_path_factory.mktemp("console")
    lock = SignedLock(root / "box")
    lock.publish(lock.model_bytes(TinyModelSpec(seed=1)))
    keys = root / "keys.yaml"
    _, token = create_key(keys, "operator", ["admin", "inference"], limits={})
    settings = settings_for(
        [{"name": MODEL, "threads": 1, "context_size": 256, "slots": 2}],
        lock=lock.lock_settings(),
        auth={"keys_file": str(keys)},
        lifecycle={"preload_dir": str(lock.shm), "watch": False},
    )
    console = ConsoleSettings(
        enabled=True, stream_interval_s=0.5, signins_per_key_per_minute=1000, max_sessions_per_key=64
    )
    settings = replace(settings, console=console)
    # No NVIDIA driver here: the GPU monitor reads an H200 as one answered, hot and at its power cap.
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "pynvml", fakenvml.hot())
        with running(settings) as daemon:
            yield Box(daemon, lock, keys, token)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        # launch() gives every browser a fresh temporary profile of its own.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _watched(browser: Browser) -> Watched:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    context.add_init_script(CSP_LISTENER)
    page = context.new_page()
    watched = Watched(page)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            watched.errors.append(f"console error: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: watched.errors.append(f"page error: {exc}"))
    return watched


def _sign_in(watched: Watched, box: Box, token: str | None = None) -> None:
    page = watched.page
    page.goto(box.daemon.url + "/ui/")
    page.get_by_label("API key", exact=True).fill(token or box.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#who-name")).to_contain_text("operator")


@pytest.fixture(scope="module")
def signed_in(browser: Browser, box: Box) -> Iterator[Watched]:
    watched = _watched(browser)
    _sign_in(watched, box)
    yield watched
    watched.page.context.close()


@pytest.fixture
def console(signed_in: Watched) -> Iterator[Page]:
    """The shared signed-in page; the test fails on anything the page reported during it."""
    signed_in.errors.clear()
    signed_in.page.evaluate("window.__cspViolations = []")
    yield signed_in.page
    assert signed_in.problems() == []


def _screenshot(page: Page, name: str, *, full_page: bool = True) -> None:
    folder = os.environ.get("EDGELLM_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        # The lockfile's path is the test's temporary folder: blanked (in the card's colour),
        # not shown as if a box kept its lockfile there.
        card = page.evaluate("getComputedStyle(document.documentElement).getPropertyValue('--card').trim()")
        page.screenshot(
            path=str(Path(folder) / name),
            full_page=full_page,
            mask=[page.locator('#lockfile [data-field="file"]')],
            mask_color=card or "#ffffff",
        )


def _shown_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def test_sign_in_keeps_no_key_in_the_browser(browser: Browser, box: Box) -> None:
    watched = _watched(browser)
    page = watched.page
    try:
        page.goto(box.daemon.url + "/ui/")
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        page.keyboard.press("Tab")  # the skip link, then the form: usable by keyboard alone
        page.get_by_label("API key", exact=True).focus()
        page.keyboard.type(box.token)
        page.keyboard.press("Enter")
        expect(page.locator("#who-name")).to_contain_text("operator")
        expect(page.get_by_role("heading", name="Overview")).to_be_visible()
        assert page.get_by_label("API key", exact=True).input_value() == ""
        stored = page.evaluate(
            "JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage), document.cookie])"
        )
        assert box.token not in stored
        assert "edgellm_console" not in stored  # HttpOnly: no script reads the session cookie
        cookies = page.context.cookies()
        assert [c["name"] for c in cookies] == ["edgellm_console"]
        assert cookies[0]["httpOnly"] is True
        assert cookies[0]["sameSite"] == "Strict"
        assert box.token not in json.dumps(cookies)
        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        assert watched.problems() == []
    finally:
        page.context.close()


def test_the_overview_shows_what_admin_status_says(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#overview")
    row = console.locator(f'#models-table tr[data-model="{MODEL}"]')
    expect(row.locator('[data-field="state"]')).to_have_text("ready")
    expect(console.locator("#readiness")).to_have_attribute("data-status", "ready")
    expect(console.locator("#daemon-info")).to_contain_text(
        f"edgellmd {__version__} on 127.0.0.1:{box.daemon.port}, up"
    )
    status = box.admin_get("/admin/status")
    model = next(m for m in status["models"] if m["name"] == MODEL)
    expected = {
        "state": model["state"],
        "version": str(model["version"]),
        "sha256": model["sha256"][:12],
        "slots": f"{model['slots_busy']} / {model['slots_total']}",
        "queue": f"{model['queue_depth']} / {model['queue_size']}",
        "loaded_at": _shown_time(model["loaded_at"]),
    }
    for name, text in expected.items():
        expect(row.locator(f'[data-field="{name}"]')).to_have_text(text)
    expect(row.locator('[data-field="last_reload"]')).to_contain_text(model["last_reload"]["result"])
    engine = model["engine_process"]
    expect(row.locator('[data-field="engine"]')).to_contain_text(f"process {engine['pid']}, ")
    if engine["memory_group"] is not None:  # where this machine lets the daemon make one
        limit, unit = float(engine["memory_group"]["limit_bytes"]), 0
        while limit >= 1024 and unit < 4:
            limit, unit = limit / 1024, unit + 1
        shown = f"{limit:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"
        expect(row.locator('[data-field="engine"]')).to_contain_text(
            re.compile(rf"its memory group [\d.]+ [KMG]?i?B of {re.escape(shown)}")
        )
    fairness = model["performance"]["fairness"]
    expect(row.locator('[data-field="waits"]')).to_have_text(re.compile(r"^\d+ / \d+ ms$"))
    expect(row.locator('[data-field="tenants"]')).to_have_text("\u2013" if not fairness["tenants"] else "")
    lock = console.locator("#lockfile")
    expect(lock.locator('[data-field="version"]')).to_have_text(str(status["lock"]["version"]))
    expect(lock.locator('[data-field="signers"]')).to_contain_text("verified")
    expect(lock.locator('[data-field="expires"]')).to_contain_text("h left")
    expect(lock.locator('[data-field="expires"]')).to_contain_text("sign a new lockfile soon")  # a day left
    stats = box.admin_get("/admin/stats")
    expect(console.locator('#host [data-field="cpu"]')).to_contain_text(f"{stats['host']['cpu_count']} CPUs")
    expect(console.locator('#host [data-field="pinning"]')).to_contain_text(stats["host"]["pinning"]["cpus"])
    gpu = stats["gpu"]["devices"][0]
    card = console.locator('#gpus [data-gpu="0"]')
    expect(card.get_by_role("heading")).to_have_text(f"GPU 0: {gpu['name']}")
    expect(card.locator('[data-field="cc"]')).to_have_text(".".join(map(str, gpu["compute_capability"])))
    expect(card.locator('[data-field="util"]')).to_have_text(f"{gpu['utilization_gpu']} %")
    expect(card.locator('[data-field="temperature"]')).to_have_text(f"{gpu['temperature_c']} °C")
    expect(card.locator('[data-field="throttle"]')).to_have_text(", ".join(gpu["throttle_reasons"]))
    build = console.locator("#gpus [data-build]")
    expect(build.locator('[data-field="backends"]')).to_have_text(", ".join(stats["build"]["backends"]))
    expect(build.locator('[data-field="cuda-archs"]')).to_have_text("none (no CUDA backend)")  # the CPU build
    expect(build.locator('[data-field="offload"]')).to_contain_text("not supported")
    verdicts = console.locator('#gpus [data-field="verdicts"] li')
    expect(verdicts).to_have_count(len(stats["gpu"]["verdicts"]))
    expect(console.locator('[data-chart="gpu0-temp"] .now')).to_have_text(f"{gpu['temperature_c']} °C")
    # A line once two ticks came.
    expect(console.locator('[data-chart="tokens"] svg polyline')).to_have_count(1)


def test_a_reload_from_the_button_shows_its_outcome_and_in_the_history(console: Page, box: Box) -> None:
    version = box.lock.publish(box.lock.model_bytes(TinyModelSpec(seed=2)))  # a new file, newly signed
    console.goto(box.daemon.url + "/ui/#actions")
    console.get_by_role("button", name="Reload changed models").click()
    outcome = console.locator(f'#action-outcome li[data-model="{MODEL}"]')
    expect(outcome).to_have_attribute("data-result", "loaded", timeout=30_000)
    expect(outcome).to_contain_text(f"lock version {version}")
    console.get_by_role("link", name="Overview").click()
    history = console.locator(f'#reload-history tr[data-model="{MODEL}"][data-trigger="admin"]').first
    expect(history).to_contain_text("loaded")
    expect(history).to_contain_text(str(version))
    expect(console.locator(f'#models-table tr[data-model="{MODEL}"] [data-field="version"]')).to_have_text(
        str(version)
    )


def test_a_key_made_in_the_console_works_until_it_is_revoked_there(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#keys")
    console.get_by_label("Name", exact=True).fill("ci-client")
    console.get_by_role("button", name="Create key").click()
    token_box = console.get_by_label("Token", exact=True)
    expect(console.locator("#new-key")).to_be_visible()
    expect(console.locator("#keys-outcome")).to_contain_text("created")
    token = token_box.input_value()
    assert token.startswith("elk_")
    key_id = token.split("_")[1]
    row = console.locator(f'#keys-table tr[data-key="{key_id}"]')
    expect(row.locator('[data-field="state"]')).to_have_text("active")
    assert token not in console.locator("#keys-table").inner_text()  # the list never shows secrets

    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=token, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert reply.choices[0].message is not None

    row.get_by_role("button", name="Revoke").click()
    dialog = console.get_by_role("dialog")
    expect(dialog).to_contain_text(f"Revoke key {key_id}")
    dialog.get_by_role("button", name="Revoke").click()
    expect(row).to_have_count(0)
    expect(console.locator("#keys-outcome")).to_contain_text("revoked")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
    console.get_by_role("button", name="Done, hide it").click()
    expect(token_box).to_be_hidden()


def test_the_playground_streams_a_reply_with_its_figures(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#playground")
    expect(console.get_by_label("Model", exact=True)).to_have_value(MODEL)
    console.get_by_label("Temperature", exact=True).fill("0")
    console.get_by_label("Max tokens", exact=True).fill("12")
    console.get_by_label("JSON schema of the reply (optional)", exact=True).fill(
        '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
    )
    console.get_by_label("Message", exact=True).fill("Answer in JSON, please.")
    console.get_by_role("button", name="Send").click()
    figures = console.locator("#chat-figures")
    expect(figures).to_contain_text("tokens/s")
    expect(figures).to_have_attribute("data-tokens", "12")
    reply = console.locator('#transcript [data-role="assistant"] .text').last
    assert reply.inner_text().startswith("{")  # the schema's grammar held from the first token
    ttft = float(figures.get_attribute("data-ttft") or "nan")
    assert 0 < ttft < 30
    expect(console.locator("#transcript")).to_have_attribute("aria-busy", "false")
    console.emulate_media(color_scheme="dark")  # the README shows the dark scheme here
    _screenshot(console, "console-playground.png")
    console.emulate_media(color_scheme="light")


def test_the_overview_charts_what_was_served(console: Page, box: Box) -> None:
    # After the tests before it: a reload in the history, tokens generated in the charts.
    console.goto(box.daemon.url + "/ui/#overview")
    expect(console.locator('#reload-history tr[data-trigger="admin"]').first).to_be_visible()
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.token, max_retries=0)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="tick", max_tokens=24, extra_body={"ignore_eos": True})
        console.wait_for_timeout(600)  # a tick in between: the chart shows each burst
    expect(console.locator('[data-chart="tokens"] .now')).not_to_have_text(
        "\u2013"
    )  # the dash of "no figure"
    expect(console.locator('[data-chart="ttft"] svg polyline')).to_have_count(1)
    label = console.locator('[data-chart="tokens"] svg').get_attribute("aria-label") or ""
    assert "highest" in label
    assert "highest 0.0" not in label
    _screenshot(console, "console-overview.png")


def test_the_queue_says_when_the_waiting_requests_may_expect_a_slot(browser: Browser, tmp_path: Path) -> None:
    """Both slots held by long generations and two requests waiting: the models table says how
    many wait, when the next and the last may expect a slot, and lists them on hover. A wider
    tiny model, slow enough (a few hundred tokens/s) that the queue stays for seconds."""
    slow = write_tiny_model(
        tmp_path / "slow.gguf", TinyModelSpec(seed=7, n_embd=512, n_head=8, n_head_kv=4, n_layer=2, n_ff=2048)
    )
    keys = tmp_path / "keys.yaml"
    _, token = create_key(keys, "operator", ["admin", "inference"], limits={})
    settings = settings_for(
        [{"name": "slow", "file": str(slow), "threads": 1, "context_size": 4096, "slots": 2}],
        auth={"keys_file": str(keys)},
        lifecycle={"watch": False},
    )
    settings = replace(settings, console=ConsoleSettings(enabled=True, stream_interval_s=0.5))
    with running(settings) as daemon:
        box = Box(daemon, SignedLock(tmp_path / "unused"), keys, token)
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=token, max_retries=0)
        client.completions.create(model="slow", prompt="warm", max_tokens=8)  # a hold time to estimate from
        watched = _watched(browser)
        try:
            _sign_in(watched, box)
            page = watched.page
            page.goto(daemon.url + "/ui/#overview")

            def long(n: int) -> object:
                return client.completions.create(
                    model="slow", prompt="tick", max_tokens=n, extra_body={"ignore_eos": True}, timeout=120
                )

            with ThreadPoolExecutor(4) as pool:
                held = [pool.submit(long, 1500) for _ in range(2)]
                wait_for(lambda: _model_status(box, "slow")["slots_busy"] == 2, what="both slots busy")
                waiting = [pool.submit(long, 4) for _ in range(2)]
                wait_for(lambda: _model_status(box, "slow")["queue_depth"] == 2, what="two waiting")
                cell = page.locator('#models-table tr[data-model="slow"] [data-field="queue"]')
                expect(cell).to_have_text(re.compile(r"^2 / \d+ \(next in ≈\d+\.\d s, last ≈\d+\.\d s\)$"))
                title = cell.get_attribute("title") or ""
                assert title.startswith("1. ")
                assert "\n2. " in title
                assert "waited" in title
                for future in held + waiting:
                    future.result(120)
            expect(cell).to_have_text(re.compile(r"^0 / \d+$"))
            assert watched.problems() == []
        finally:
            watched.page.context.close()


def _model_status(box: Box, name: str = MODEL) -> dict[str, Any]:
    model: dict[str, Any] = next(m for m in box.admin_get("/admin/status")["models"] if m["name"] == name)
    return model


def test_the_usage_page_charts_tokens_per_key_and_day_as_the_ledger_has_them(console: Page, box: Box) -> None:
    other_id, other = create_key(box.keys, "tenant-b", ["inference"], limits={})
    hello: Any = [{"role": "user", "content": "hello"}]
    operator = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.token, max_retries=0)
    operator.chat.completions.create(model=MODEL, messages=hello, max_tokens=4)
    tenant = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=other, max_retries=0)
    for _ in range(5):  # the keys file is re-read within a second: until then, 401
        try:
            tenant.chat.completions.create(model=MODEL, messages=hello, max_tokens=8)
            break
        except openai.AuthenticationError:
            console.wait_for_timeout(400)
    usage = box.admin_get("/admin/usage?group=day")
    per_key: dict[str, int] = {}
    for row in usage["data"]:
        per_key[row["key_id"]] = per_key.get(row["key_id"], 0) + row["total_tokens"]
    assert per_key.get(other_id, 0) > 0

    console.goto(box.daemon.url + "/ui/#usage")
    console.get_by_label("Days", exact=True).select_option("7")
    console.get_by_role("button", name="Show").click()
    legend = console.locator(f'#usage-legend li[data-key="{other_id}"]')
    # The name isolated (FSI ... PDI): a right-to-left name cannot reorder the id after it.
    expect(legend).to_contain_text(f"\u2068tenant-b\u2069 ({other_id}): {per_key[other_id]}")
    bars = console.locator(f'#usage-svg rect[data-key="{other_id}"]')
    expect(bars).to_have_count(1)  # one day so far
    assert int(bars.get_attribute("data-total") or "0") == per_key[other_id]
    row = console.locator(f'#usage-table tr[data-key="{other_id}"]')
    expect(row.locator("td").last).to_have_text(str(per_key[other_id]))
    expect(console.locator("#usage-caption")).to_contain_text(f"{usage['totals']['total_tokens']} in all")
    _screenshot(console, "console-usage.png")


def test_sign_out_forgets_what_was_shown_and_views_follow_the_new_keys_scopes(
    browser: Browser, box: Box
) -> None:
    _, inference_only = create_key(box.keys, "app-only", ["inference"], limits={})
    watched = _watched(browser)
    page = watched.page
    try:
        _sign_in(watched, box)
        page.goto(box.daemon.url + "/ui/#keys")
        expect(page.locator("#keys-table tbody tr").first).to_be_visible()
        page.goto(box.daemon.url + "/ui/#overview")
        expect(page.locator("#models-table tbody tr").first).to_be_visible()
        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        # Nothing of the admin's is left in the page, shown or hidden.
        for table in ("keys-table", "models-table", "actions-table", "reload-history"):
            expect(page.locator(f"#{table} tbody tr")).to_have_count(0)
        assert page.locator("#who-name").text_content() == ""
        # An inference key, in the same tab: no admin view, whatever the address asks for.
        page.get_by_label("API key", exact=True).fill(inference_only)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#who-name")).to_contain_text("app-only")
        expect(page.get_by_role("heading", name="Playground")).to_be_visible()
        expect(page.locator("#ready-badge")).not_to_have_text("signed out")
        page.goto(box.daemon.url + "/ui/#keys")
        expect(page.get_by_role("heading", name="Playground")).to_be_visible()
        assert page.locator("#view-keys").is_hidden()
        assert page.locator("#key-form").is_hidden()
        expect(page.locator("#nav a[data-view='keys']")).to_be_hidden()
        expect(page.locator("#keys-table tbody tr")).to_have_count(0)
        assert watched.problems() == []
    finally:
        page.context.close()


def test_a_chart_says_when_its_last_figure_is_old(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#overview")
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.token, max_retries=0)
    client.completions.create(model=MODEL, prompt="tick", max_tokens=4)
    # Samples every 0.5 s: within a few, the latest has no first token in it.
    expect(console.locator('[data-chart="ttft"] .now')).to_contain_text("s ago")


def test_action_buttons_wait_for_the_action_that_runs_and_name_their_model(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#actions")
    reload_row = console.get_by_role("button", name=f"Reload {MODEL}", exact=True)
    expect(reload_row).to_be_enabled()
    held: list[Any] = []

    def hold(route: Any) -> None:  # the answer waits until the test lets it go
        held.append(route)

    console.route("**/ui/api/reload", hold)
    try:
        console.get_by_role("button", name="Reload changed models").click()
        expect(console.get_by_role("button", name="Reload changed models")).to_be_disabled()
        expect(reload_row).to_be_disabled()
        expect(console.get_by_role("button", name=f"Force reload {MODEL}", exact=True)).to_be_disabled()
        assert len(held) == 1
        held[0].continue_()
    finally:
        console.unroute("**/ui/api/reload", hold)
    expect(console.locator("#action-outcome")).not_to_contain_text("running")
    expect(console.get_by_role("button", name="Reload changed models")).to_be_enabled()
    expect(reload_row).to_be_enabled()


def test_the_live_refresh_leaves_focus_and_unchanged_cells_alone(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#actions")
    button = console.get_by_role("button", name=f"Reload {MODEL}", exact=True)
    button.focus()
    # Mark the very elements: a rebuilt row would bring new ones without the mark.
    console.evaluate(
        """() => {
        document.activeElement.__kept = true;
        document.querySelector('#models-table td[data-field="sha256"]').__kept = true;
    }"""
    )
    console.wait_for_timeout(2000)  # four refreshes at 0.5 s
    assert console.evaluate("() => document.activeElement.__kept === true")
    assert console.evaluate(
        """() => document.querySelector('#models-table td[data-field="sha256"]').__kept === true"""
    )
    button.click()  # still the live button: the reload runs
    expect(console.locator("#action-outcome")).to_contain_text(MODEL)


def test_a_lost_connection_is_shown_over_the_figures_and_a_restart_asks_for_sign_in(
    browser: Browser, box: Box
) -> None:
    watched = _watched(browser)
    page = watched.page

    def cut(route: Any) -> None:  # a stream that ends at once: the daemon went away
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=": gone\n\n")

    try:
        _sign_in(watched, box)
        expect(page.locator("#readiness")).to_have_attribute("data-status", "ready")
        page.route("**/ui/api/events", cut)
        page.reload()
        expect(page.locator("#notice")).to_contain_text("Lost the connection to the daemon")
        expect(page.locator("#overview-body")).to_have_class("stale")
        expect(page.locator("#readiness")).to_contain_text("the figures below are from then")
        page.unroute("**/ui/api/events", cut)  # back: the stream resumes, the warning goes
        expect(page.locator("#notice")).to_be_hidden(timeout=20_000)
        expect(page.locator("#overview-body")).not_to_have_class("stale")
        expect(page.locator("#readiness")).to_have_attribute("data-status", "ready")
        # A restarted daemon knows no session: its stream refuses, and the page asks for a sign-in.
        asked: list[int] = []

        def restarted(route: Any) -> None:  # the page's first look is before the "restart"
            asked.append(1)
            if len(asked) == 1:
                route.continue_()
            else:
                route.fulfill(status=200, content_type="application/json", body='{"signed_in": false}')

        page.route("**/ui/api/session", restarted)
        page.route("**/ui/api/events", lambda route: route.fulfill(status=401, body="{}"))
        page.reload()
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible(timeout=20_000)
        expect(page.locator("#signin-error")).to_contain_text("sign in again")
    finally:
        page.context.close()


class StallingProxy:
    """A TCP relay to the daemon that can stop relaying without closing anything: a daemon
    stopped (SIGSTOP) or a network that drops packets without a reset, as the page sees it."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.stalled = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65_536):
                while self.stalled.is_set():  # held, not dropped: the connection stays open
                    time.sleep(0.05)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.stalled.clear()
        for sock in self.sockets:
            sock.close()


def test_a_stream_that_stalls_without_breaking_is_shown_as_lost_not_as_ready(
    browser: Browser, box: Box
) -> None:
    """A stopped daemon or a silent network ends no stream (neither "error" nor "end" comes):
    the page showed "ready" and the same figures for ever. No overview for three intervals is
    a lost connection, said over the figures; the next overview takes it back."""
    proxy = StallingProxy(box.daemon.port)
    watched = _watched(browser)
    page = watched.page
    try:
        page.goto(f"http://127.0.0.1:{proxy.port}/ui/")
        page.get_by_label("API key", exact=True).fill(box.token)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#readiness")).to_have_attribute("data-status", "ready")
        proxy.stalled.set()
        expect(page.locator("#notice")).to_contain_text("Lost the connection to the daemon", timeout=10_000)
        expect(page.locator("#overview-body")).to_have_class("stale")
        expect(page.locator("#ready-badge")).to_have_text("no figures")
        proxy.stalled.clear()  # the held figures arrive: live again
        expect(page.locator("#notice")).to_be_hidden(timeout=10_000)
        expect(page.locator("#overview-body")).not_to_have_class("stale")
        assert watched.problems() == []
    finally:
        page.context.close()
        proxy.close()


def test_a_second_page_of_the_session_takes_the_figures_and_the_first_says_so(
    browser: Browser, box: Box
) -> None:
    """A session has one live stream. The page whose stream another page took shows its figures
    as stale and says where they went (never a frozen "ready"); looked at again, it takes them back."""
    first = _watched(browser)
    try:
        _sign_in(first, box)
        expect(first.page.locator("#readiness")).to_have_attribute("data-status", "ready")
        second = first.page.context.new_page()  # the same cookie: the same session
        second.goto(box.daemon.url + "/ui/")
        expect(second.locator("#readiness")).to_have_attribute("data-status", "ready")
        expect(first.page.locator("#readiness")).to_contain_text("went to another tab or window")
        expect(first.page.locator("#overview-body")).to_have_class("stale")
        expect(first.page.locator("#ready-badge")).to_have_text("paused")
        first.page.evaluate("window.dispatchEvent(new Event('focus'))")  # the operator is back on it
        expect(first.page.locator("#overview-body")).not_to_have_class("stale")
        expect(first.page.locator("#readiness")).not_to_contain_text("went to another tab")
        expect(second.locator("#readiness")).to_contain_text("went to another tab or window")
        assert first.problems() == []
    finally:
        first.page.context.close()


def test_the_banner_shows_the_worst_problem_not_readiness_alone(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#overview")
    readiness = console.locator("#readiness")
    expect(readiness).to_have_attribute("data-status", "ready")
    signed = box.lock.lock.read_bytes()
    try:
        box.lock.lock.write_bytes(signed.replace(b"version", b"versoin", 1))  # tampered on disk
        expect(readiness).to_have_attribute("data-worst", "bad")
        expect(readiness).to_contain_text("lockfile")
        expect(console.locator("#ready-badge")).to_contain_text("problem")
        expect(console.locator("#ready-badge")).to_have_class("badge bad")
    finally:
        box.lock.lock.write_bytes(signed)
    expect(readiness).not_to_have_attribute("data-worst", "bad")


def test_the_playground_sends_on_enter_with_a_system_prompt_and_keeps_a_failed_message(
    browser: Browser, box: Box
) -> None:
    watched = _watched(browser)
    console = watched.page
    _sign_in(watched, box)
    console.goto(box.daemon.url + "/ui/#playground")
    console.get_by_role("button", name="New conversation").click()
    expect(console.get_by_label("Model", exact=True)).to_have_value(MODEL)
    console.get_by_label("Max tokens", exact=True).fill("4")
    console.get_by_label("System prompt (optional)", exact=True).fill("You are terse.")
    message = console.get_by_label("Message", exact=True)
    sent: list[Any] = []

    def watch(route: Any) -> None:
        sent.append(route.request.post_data_json)
        route.continue_()

    console.route("**/ui/api/chat", watch)
    try:
        message.fill("first line")
        message.press("Shift+Enter")  # a new line, not a send
        message.type("second line")
        assert sent == []
        message.press("Enter")
        expect(console.locator('#transcript [data-role="assistant"]')).to_have_count(1)
        expect(console.locator("#transcript")).to_have_attribute("aria-busy", "false")
    finally:
        console.unroute("**/ui/api/chat", watch)
    assert sent[0]["messages"][0] == {"role": "system", "content": "You are terse."}
    assert sent[0]["messages"][-1] == {"role": "user", "content": "first line\nsecond line"}

    def refuse(route: Any) -> None:
        route.fulfill(
            status=503,
            content_type="application/json",
            body=json.dumps({"error": {"message": "the model is loading", "type": "x", "code": "y"}}),
        )

    console.route("**/ui/api/chat", refuse)
    try:
        message.fill("try again later")
        message.press("Enter")
        expect(console.locator("#chat-figures")).to_contain_text("the model is loading")
    finally:
        console.unroute("**/ui/api/chat", refuse)
    expect(console.locator('#transcript [data-role="assistant"]')).to_have_count(1)  # no empty bubble
    expect(message).to_have_value("try again later")  # the message is still there to send
    refused = [p for p in watched.problems() if "503" in p]
    assert len(refused) == 1  # the browser's own note of the refused request
    assert [p for p in watched.problems() if p not in refused] == []
    console.context.close()


def test_completion_mode_lets_a_base_model_continue_a_text(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#playground")
    console.get_by_role("button", name="New conversation").click()
    expect(console.get_by_label("Model", exact=True)).to_have_value(MODEL)
    console.get_by_label("Mode", exact=True).select_option("completion")
    console.get_by_label("Max tokens", exact=True).fill("5")
    console.get_by_label("JSON schema of the reply (optional)", exact=True).fill("")
    with console.expect_request("**/ui/api/complete") as asked:
        console.get_by_label("Message", exact=True).fill("The capital of France is")
        console.get_by_label("Message", exact=True).press("Enter")
    assert (asked.value.post_data_json or {}).get("prompt") == "The capital of France is"
    expect(console.locator("#chat-figures")).to_have_attribute("data-tokens", "5")
    expect(console.locator('#transcript [data-role="assistant"] .text').last).not_to_have_text("")
    console.get_by_label("Mode", exact=True).select_option("chat")


def _completion_tokens(url: str, token: str) -> float:
    """edgellm_completion_tokens_total over every model, as /metrics has it."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback URL
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgellm_completion_tokens_total{")
    )


def _window_tokens(page: Page) -> int:
    text = page.locator('[data-chart="tokens"] .readout').inner_text()
    found = re.fullmatch(r"([\d,]+) tokens in the last .+", text)
    assert found, text
    return int(found.group(1).replace(",", ""))


def test_charts_have_axes_a_hover_readout_and_add_up_to_what_metrics_counts(console: Page, box: Box) -> None:
    _, scraper = create_key(box.keys, "scraper", ["metrics"], limits={})
    metrics_url = box.daemon.url
    deadline = datetime.now(UTC).timestamp() + 10
    while True:  # the keys file is read again within a check
        try:
            before = _completion_tokens(metrics_url, scraper)
            break
        except urllib.error.HTTPError:
            assert datetime.now(UTC).timestamp() < deadline
            console.wait_for_timeout(200)
    console.goto(box.daemon.url + "/ui/#overview")
    chart = console.locator('[data-chart="tokens"]')
    expect(chart.locator(".readout")).to_contain_text("tokens in the last")
    console.wait_for_timeout(1200)  # two ticks: the window holds every token counted before
    shown_before = _window_tokens(console)
    client = openai.OpenAI(base_url=box.daemon.url + "/v1", api_key=box.token, max_retries=0)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="tick", max_tokens=24, extra_body={"ignore_eos": True})
    counted = _completion_tokens(metrics_url, scraper) - before
    assert counted == 72
    # Within a refresh or two the chart's window adds up to the same count (rates times their ticks).
    for _ in range(20):
        if abs(_window_tokens(console) - shown_before - counted) <= 1:
            break
        console.wait_for_timeout(250)
    assert abs(_window_tokens(console) - shown_before - counted) <= 1, (_window_tokens(console), shown_before)

    top = chart.locator(".y-top").inner_text()
    found = re.fullmatch(r"(\d+(?:\.\d+)?) tokens/s", top)
    assert found, top
    label = chart.locator("svg").get_attribute("aria-label") or ""
    highest = float(re.search(r"highest ([\d.]+)", label).group(1))  # type: ignore[union-attr]
    assert highest <= float(found.group(1)) <= 10 * max(highest, 0.1)  # a round top above the highest
    expect(chart.locator(".y-zero")).to_have_text("0")
    expect(chart.locator(".x-start")).to_have_text(re.compile(r"^\d\d:\d\d$"))
    expect(chart.locator(".x-end")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d UTC$"))

    plot = chart.locator("svg").bounding_box()
    assert plot is not None
    console.mouse.move(plot["x"] + plot["width"] * 0.995, plot["y"] + plot["height"] / 2)
    expect(chart.locator(".readout")).to_have_text(
        re.compile(r"^\d\d:\d\d:\d\d: (\d+\.\d tokens/s|no figure)$")
    )
    expect(chart.locator("svg line.guide")).to_have_count(1)
    console.wait_for_timeout(700)  # a refresh redraws the chart: the readout and its guide stay
    expect(chart.locator("svg line.guide")).to_have_count(1)
    console.mouse.move(0, 0)
    expect(chart.locator(".readout")).to_contain_text("tokens in the last")
    expect(chart.locator("svg line.guide")).to_have_count(0)


def test_times_are_shown_in_the_browsers_zone_in_one_format(browser: Browser, box: Box) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 860}, timezone_id="America/New_York")
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    try:
        watched = Watched(page)
        _sign_in(watched, box)
        status = box.admin_get("/admin/status")
        model = next(m for m in status["models"] if m["name"] == MODEL)
        local = datetime.fromtimestamp(model["loaded_at"], UTC).astimezone(ZoneInfo("America/New_York"))
        row = page.locator(f'#models-table tr[data-model="{MODEL}"]')
        expect(row.locator('[data-field="loaded_at"]')).to_have_text(
            local.strftime("%Y-%m-%d %H:%M:%S UTC-05:00")
        )
        expect(page.locator("#daemon-info")).to_contain_text("UTC-05:00)")
        expect(page.locator('[data-chart="tokens"] .x-end')).to_have_text(
            re.compile(r"^\d\d:\d\d:\d\d UTC-05:00$")
        )
        stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC-05:00"
        expect(page.locator("#reload-history tbody tr td").first).to_have_text(re.compile(f"^{stamp}$"))
        expect(page.locator('#lockfile [data-field="expires"]')).to_have_text(re.compile(f"^{stamp} \\("))
        page.locator('nav a[data-view="keys"]').click()
        expect(page.locator("#keys-table tbody tr td").nth(3)).to_have_text(
            re.compile(f"^{stamp}$")
        )  # created
    finally:
        context.close()


def test_a_session_that_ends_keeps_the_conversation_for_the_same_key_only(browser: Browser, box: Box) -> None:
    talker_id, talker = create_key(box.keys, "talker", ["admin", "inference"], limits={})
    _, stranger = create_key(box.keys, "stranger", ["admin", "inference"], limits={})
    wait_for_key(box, stranger)
    watched = _watched(browser)
    page = watched.page
    turns = page.locator("#transcript .turn")

    def sign_in(token: str, name: str) -> None:  # on the page as it is: no reload
        page.get_by_label("API key", exact=True).fill(token)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#who-name")).to_contain_text(name)
        page.locator('nav a[data-view="playground"]').click()

    def ask(text: str) -> None:
        page.get_by_label("Max tokens", exact=True).fill("4")
        page.get_by_label("Message", exact=True).fill(text)
        page.get_by_role("button", name="Send").click()
        expect(page.locator("#chat-figures")).to_contain_text("tokens/s")

    def end_session() -> None:  # as an expiry or a restart would: not the user's sign-out
        sessions = box.daemon.app[SESSIONS] if box.daemon.app is not None else None
        assert sessions is not None
        box.daemon.loop.call_soon_threadsafe(sessions.end_keys, {talker_id}, "it expired")
        expect(page.locator("#signin-error")).to_contain_text(
            "comes back when you sign in again with the same key"
        )

    try:
        page.goto(box.daemon.url + "/ui/")
        sign_in(talker, "talker")
        ask("first question")
        end_session()
        expect(turns).to_have_count(0)  # nothing of it shows to whoever is at the screen now
        sign_in(talker, "talker")
        expect(page.locator('#transcript [data-role="user"] .text')).to_have_text("first question")
        expect(turns).to_have_count(2)
        ask("second question")  # the conversation goes on where it was
        expect(turns).to_have_count(4)

        end_session()
        sign_in(stranger, "stranger")  # another key: it never sees the conversation
        expect(turns).to_have_count(0)
        page.get_by_role("button", name="Sign out").click()
        sign_in(talker, "talker")  # and it was dropped, not only hidden
        expect(turns).to_have_count(0)

        ask("third question")
        page.get_by_role("button", name="Sign out").click()  # signing out drops it at once
        sign_in(talker, "talker")
        expect(turns).to_have_count(0)
        assert watched.problems() == []
    finally:
        page.context.close()


def wait_for_key(box: Box, token: str) -> None:
    """Until the daemon has read a key just written to the keys file (within a check)."""
    request = urllib.request.Request(  # noqa: S310 - loopback URL
        box.daemon.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}
    )
    for _ in range(50):
        try:
            with urllib.request.urlopen(request, timeout=10):  # noqa: S310 - loopback URL
                return
        except urllib.error.HTTPError:
            time.sleep(0.1)
    raise AssertionError("the daemon never read the new key")


HOSTILE_REPLY: Final = (
    "# Result\n\nThis is **bold**, *slanted* and `inline <i>code</i>`.\n\n"
    '<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>\n\n'
    "- one\n- two <b>three</b>\n\n1. first\n2. second\n\n> quoted\n\n"
    '```html\n<a href="http://evil.example">click</a>\n```\n\n'
    "[a link](http://evil.example/login)"
)


def _sse_reply(text: str, model: str = MODEL) -> str:
    """A chat stream as the daemon sends it, its reply in a few deltas."""
    chunks = [text[i : i + 40] for i in range(0, len(text), 40)]
    events = [
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": {"content": c}}],
        }
        for c in chunks
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    usage = {"prompt_tokens": 3, "completion_tokens": len(chunks), "total_tokens": 3 + len(chunks)}
    done = {"id": "x", "object": "chat.completion.chunk", "model": model, "choices": [], "usage": usage}
    return body + f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n"


def test_a_reply_is_markdown_no_markup_of_the_models_ever_runs_and_copy_and_regenerate_work(
    console: Page, box: Box
) -> None:
    console.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=box.daemon.url)
    console.goto(box.daemon.url + "/ui/#playground")
    console.get_by_role("button", name="New conversation").click()
    sent: list[Any] = []

    def reply(route: Any) -> None:
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, content_type="text/event-stream", body=_sse_reply(HOSTILE_REPLY))

    console.route("**/ui/api/chat", reply)
    try:
        console.get_by_label("Message", exact=True).fill("render this")
        console.get_by_label("Message", exact=True).press("Enter")
        answer = console.locator('#transcript [data-role="assistant"] .text')
        expect(answer.locator("strong")).to_have_text("bold")
        expect(answer.locator("em")).to_have_text("slanted")
        expect(answer.locator("p > code")).to_have_text("inline <i>code</i>")
        expect(answer.locator(".md-h1")).to_have_text("Result")
        expect(answer.locator("ul > li")).to_have_text(["one", "two <b>three</b>"])
        expect(answer.locator("ol > li")).to_have_text(["first", "second"])
        expect(answer.locator("blockquote")).to_have_text("quoted")
        expect(answer.locator("pre > code")).to_have_text('<a href="http://evil.example">click</a>')
        expect(answer).to_contain_text("a link (http://evil.example/login)")
        expect(answer).to_contain_text('<img src=x onerror="window.__pwned = 1">')  # shown as text
        for tag in ("img", "script", "a", "i", "b"):
            expect(answer.locator(tag)).to_have_count(0)
        assert console.evaluate("window.__pwned === undefined")

        console.get_by_role("button", name="Copy this reply").click()
        expect(console.get_by_role("button", name="Copy this reply")).to_have_text("Copied")
        assert console.evaluate("navigator.clipboard.readText()") == HOSTILE_REPLY  # the text as written

        console.get_by_role("button", name="Regenerate this reply").click()
        expect(console.locator("#chat-figures")).to_contain_text("tokens/s")
        expect(console.locator("#transcript .turn")).to_have_count(2)  # the answer replaced, not added
        assert len(sent) == 2
        assert sent[1]["messages"] == sent[0]["messages"]  # the same question, without the old answer
        expect(console.get_by_role("button", name="Regenerate this reply")).to_have_count(1)
    finally:
        console.unroute("**/ui/api/chat", reply)


def _contrast(page: Page, selector: str) -> float:
    """WCAG contrast of an element's text colour against the page's background."""
    return float(
        page.evaluate(
            """(sel) => {
              const rgb = (c) => c.match(/\\d+(\\.\\d+)?/g).slice(0, 3).map(Number);
              const lum = ([r, g, b]) => {
                const f = (v) => {
                  v /= 255;
                  return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
                };
                return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
              };
              const fg = lum(rgb(getComputedStyle(document.querySelector(sel)).color));
              const bg = lum(rgb(getComputedStyle(document.body).backgroundColor));
              return (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
            }""",
            selector,
        )
    )


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_a_phone_gets_a_short_header_and_tables_that_fit_in_both_schemes(
    browser: Browser, box: Box, scheme: Literal["light", "dark"]
) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme=scheme, has_touch=True)
    context.set_default_timeout(TIMEOUT_MS)
    context.add_init_script(CSP_LISTENER)
    watched = Watched(context.new_page())
    page = watched.page
    try:
        _sign_in(watched, box)
        header = page.locator("header").bounding_box()
        assert header is not None
        assert header["height"] <= 80, header  # two short rows (172 px once), not a fifth of the screen
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert (background == "rgb(13, 17, 23)") == (scheme == "dark"), background
        assert _contrast(page, "#who-name") >= 4.5
        for view, table in (
            ("overview", "#models-table"),
            ("keys", "#keys-table"),
            ("actions", "#actions-table"),
        ):
            page.locator(f'nav a[data-view="{view}"]').click()
            expect(page.locator(f"{table} tbody tr").first).to_be_visible()
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), view
            cell = page.locator(f"{table} tbody td[data-label]").first
            assert page.evaluate(
                "(el) => getComputedStyle(el, '::before').content", cell.element_handle()
            ).startswith('"')
        page.locator('nav a[data-view="overview"]').click()
        assert _contrast(page, "#models-table td[data-label]") >= 4.5
        if scheme == "dark":
            page.locator('nav a[data-view="keys"]').click()
            _screenshot(page, "console-phone.png", full_page=False)  # the README's phone
        assert watched.problems() == []
    finally:
        context.close()


def test_a_load_survives_the_tab_reloaded_right_after_its_click(console: Page, box: Box) -> None:
    """The browser goes away while Load runs (the request ends 499): the load still finishes."""

    def state() -> str:
        return str(next(m for m in box.admin_get("/admin/status")["models"] if m["name"] == MODEL)["state"])

    console.goto(box.daemon.url + "/ui/#actions")
    console.locator(f'#actions-table tr[data-model="{MODEL}"] [data-action="unload"]').click()
    console.locator("#confirm-ok").click()
    load = console.locator(f'#actions-table tr[data-model="{MODEL}"] [data-action="load"]')
    expect(load).to_be_visible()
    assert state() == "unloaded"
    load.click()
    console.reload()  # at once: the page that asked is gone before the load is done
    deadline = time.monotonic() + 30
    while state() != "ready":
        assert time.monotonic() < deadline, state()
        time.sleep(0.1)
    expect(console.locator(f'#actions-table tr[data-model="{MODEL}"] [data-action="unload"]')).to_be_visible()


# ---- files in the playground: a daemon of its own, with tiny models that read images or audio


@dataclass
class MediaBox:
    daemon: RunningDaemon
    token: str  # admin and inference

    def encoded(self, model: str) -> int:
        """Images or clips the model's projector has encoded so far (/admin/status)."""
        request = urllib.request.Request(  # noqa: S310 - loopback URL
            self.daemon.url + "/admin/status", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            status = json.loads(response.read())
        model_status = next(m for m in status["models"] if m["name"] == model)
        return int(model_status["performance"]["media"]["chunks_encoded"])

    def answer_to(self, model: str, content: list[Any]) -> dict[str, Any]:
        """What /v1/chat/completions answers one user turn of `content` parts."""
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        request = urllib.request.Request(  # noqa: S310 - loopback URL
            self.daemon.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                answer: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as refused:
            answer = json.loads(refused.read())
        return answer


MEDIA_MAX_IMAGES: Final = 2
MEDIA_MAX_IMAGE_BYTES: Final = 200_000
MEDIA_MAX_BODY: Final = 262_144  # an image near MEDIA_MAX_IMAGE_BYTES fits once decoded, not as base64


def _png(seed: int, width: int = 40, height: int = 30) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.4 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def _file(name: str, data: bytes, mime: str) -> Any:
    return {"name": name, "mimeType": mime, "buffer": data}


@pytest.fixture(scope="module")
def media_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MediaBox]:
    root = tmp_path_factory.mktemp("console-media")
    keys = root / "keys.yaml"
    _, token = create_key(keys, "operator", ["admin", "inference"], limits={})
    text = str(write_tiny_model(root / "text.gguf", TinyModelSpec(seed=9)))
    models = [
        {"name": "plain", "file": text, "context_size": 256, "threads": 1},
        {
            "name": "vision",
            "file": text,
            "mmproj_file": str(write_tiny_projector(root / "vision.gguf")),
            "context_size": 256,
            "threads": 1,
        },
        {
            "name": "hears",
            "file": text,
            "mmproj_file": str(write_tiny_audio_projector(root / "audio.gguf")),
            "context_size": 1024,  # a clip is 375 tokens
            "threads": 1,
        },
    ]
    settings = settings_for(
        models,
        server={"max_body_bytes": MEDIA_MAX_BODY},
        auth={"keys_file": str(keys)},
        lifecycle={"preload_dir": str(root / "shm"), "watch": False},
        media={"max_images": MEDIA_MAX_IMAGES, "max_image_bytes": MEDIA_MAX_IMAGE_BYTES},
    )
    settings = replace(settings, console=ConsoleSettings(enabled=True, signins_per_key_per_minute=1000))
    with running(settings) as daemon:
        yield MediaBox(daemon, token)


@pytest.fixture(scope="module")
def media_page(browser: Browser, media_box: MediaBox) -> Iterator[Watched]:
    watched = _watched(browser)
    watched.page.goto(media_box.daemon.url + "/ui/")
    watched.page.get_by_label("API key", exact=True).fill(media_box.token)
    watched.page.get_by_role("button", name="Sign in").click()
    expect(watched.page.locator("#who-name")).to_contain_text("operator")
    yield watched
    watched.page.context.close()


@pytest.fixture
def playground(media_page: Watched, media_box: MediaBox) -> Iterator[Page]:
    """The playground of the media daemon, a new conversation; fails on anything the page reported
    but the browser's own note of a request the server refused (400)."""
    page = media_page.page
    media_page.errors.clear()
    page.evaluate("window.__cspViolations = []")
    page.goto(media_box.daemon.url + "/ui/#playground")
    page.get_by_role("button", name="New conversation").click()
    page.get_by_label("Max tokens", exact=True).fill("2")
    yield page
    assert [p for p in media_page.problems() if "status of 400" not in p] == []


def _chat_requests(page: Page) -> list[Any]:
    """Every chat request the page sends from now on (each still goes to the server)."""
    sent: list[Any] = []

    def watch(route: Any) -> None:
        sent.append(route.request.post_data_json)
        route.continue_()

    page.route("**/ui/api/chat", watch)
    return sent


def _send(page: Page, text: str) -> None:
    figures = page.locator("#chat-figures")
    page.evaluate("document.getElementById('chat-figures').textContent = ''")
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")
    expect(figures).to_contain_text(re.compile("tokens/s|ended"))
    expect(page.locator("#transcript")).to_have_attribute("aria-busy", "false")


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_a_text_model_offers_no_attachment_and_says_why(playground: Page) -> None:
    attach = playground.get_by_label("Attach files", exact=True)
    playground.get_by_label("Model", exact=True).select_option("plain")
    expect(attach).to_be_hidden()
    expect(playground.locator("#chat-attach-help")).to_contain_text("reads text only")
    playground.get_by_label("Model", exact=True).select_option("vision")
    expect(attach).to_be_visible()
    expect(attach).to_have_attribute("accept", re.compile(r"^\.png,.*image/gif$"))
    expect(playground.locator("#chat-attach-help")).to_contain_text("Images (PNG, JPEG, WebP, GIF)")
    playground.get_by_label("Mode", exact=True).select_option("completion")  # a completion is text only
    expect(attach).to_be_hidden()
    playground.get_by_label("Mode", exact=True).select_option("chat")
    expect(attach).to_be_visible()


def test_an_attached_picture_reaches_the_model_and_shows_in_the_turn(
    playground: Page, media_box: MediaBox
) -> None:
    picture = _png(1)
    playground.get_by_label("Model", exact=True).select_option("vision")
    playground.get_by_label("Attach files", exact=True).set_input_files(
        _file("dots.png", picture, "image/png")
    )
    pending = playground.locator("#chat-attachments .attachment")
    expect(pending).to_have_count(1)
    expect(pending).to_contain_text(f"dots.png (PNG image, {len(picture) / 1024:.1f} KiB)")
    expect(pending.locator("img")).to_have_attribute("alt", "dots.png")
    encoded = media_box.encoded("vision")
    sent = _chat_requests(playground)
    try:
        _send(playground, "What is this?")
        expect(playground.locator("#chat-figures")).to_contain_text("tokens/s")
        playground.get_by_role("button", name="Regenerate this reply").click()  # asks with the picture again
        expect(playground.locator("#transcript .turn")).to_have_count(2)
        expect(playground.locator("#transcript")).to_have_attribute("aria-busy", "false")
        _send(playground, "And its colours?")  # the picture goes again with the history
    finally:
        playground.unroute("**/ui/api/chat")
    picture_part = {"type": "image_url", "image_url": {"url": _data_url(picture)}}
    assert sent[0]["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, picture_part]}
    ]
    assert sent[1]["messages"] == sent[0]["messages"]
    assert sent[2]["messages"][0] == sent[0]["messages"][0]
    assert sent[2]["messages"][-1] == {"role": "user", "content": "And its colours?"}
    assert media_box.encoded("vision") == encoded + 1  # it reached the projector (once: then reused)
    expect(pending).to_have_count(0)  # sent: no longer waiting to go
    shown = playground.locator('#transcript [data-role="user"]').first
    expect(shown.locator(".text")).to_have_text("What is this?")
    thumb = shown.locator(".attachment img")
    expect(thumb).to_have_attribute("alt", "dots.png")
    assert thumb.evaluate(
        "(img) => img.complete && img.naturalWidth > 0 && img.src.startsWith('data:image/png')"
    )
    assert int(playground.locator("#chat-figures").get_attribute("data-prompt-tokens") or 0) > 0


def test_an_empty_reply_is_a_turn_and_its_picture_goes_again(playground: Page) -> None:
    """A model may stop at once: the reply is empty, not failed, and the message and picture
    stay in the history the next request sends (as the transcript shows them)."""
    playground.get_by_label("Model", exact=True).select_option("vision")
    picture = _png(5)
    sent: list[Any] = []

    def answer(route: Any) -> None:
        sent.append(route.request.post_data_json)
        if len(sent) == 1:  # the model's first reply: nothing at all
            route.fulfill(status=200, content_type="text/event-stream", body=_sse_reply("", "vision"))
        else:
            route.continue_()

    playground.route("**/ui/api/chat", answer)
    try:
        playground.get_by_label("Attach files", exact=True).set_input_files(
            _file("dots.png", picture, "image/png")
        )
        _send(playground, "What is this?")
        expect(playground.locator('#transcript [data-role="assistant"]').last).to_contain_text(
            "The model stopped without a word."
        )
        _send(playground, "And now?")
        expect(playground.locator("#chat-figures")).to_contain_text("tokens/s")  # the daemon took it
    finally:
        playground.unroute("**/ui/api/chat")
    picture_part = {"type": "image_url", "image_url": {"url": _data_url(picture)}}
    assert sent[1]["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, picture_part]},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "And now?"},
    ]


def test_the_oldest_pictures_stop_going_with_the_history_at_the_bound(playground: Page) -> None:
    playground.get_by_label("Model", exact=True).select_option("vision")
    attach = playground.get_by_label("Attach files", exact=True)
    sent = _chat_requests(playground)
    try:
        for number in range(MEDIA_MAX_IMAGES + 1):
            attach.set_input_files(_file(f"p{number}.png", _png(10 + number), "image/png"))
            _send(playground, f"picture {number}")
            expect(playground.locator("#chat-figures")).to_contain_text("tokens/s")
    finally:
        playground.unroute("**/ui/api/chat")

    def pictures(body: Any) -> list[str]:
        return [
            p["image_url"]["url"]
            for m in body["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image_url"
        ]

    assert [len(pictures(body)) for body in sent] == [1, 2, MEDIA_MAX_IMAGES]
    assert pictures(sent[2]) == [_data_url(_png(11)), _data_url(_png(12))]  # the oldest went
    assert sent[2]["messages"][0]["content"][1] == {
        "type": "text",
        "text": "[an image, p0.png, was attached here]",
    }
    first = playground.locator('#transcript [data-role="user"] .attachment').first
    expect(first).to_have_class(re.compile(r"\bdropped\b"))
    expect(first).to_contain_text("no longer sent")
    expect(playground.locator("#chat-attach-error")).to_contain_text('"p0.png"')


def test_a_file_past_the_bounds_or_of_another_kind_is_refused_before_anything_is_sent(
    playground: Page,
) -> None:
    playground.get_by_label("Model", exact=True).select_option("vision")
    attach = playground.get_by_label("Attach files", exact=True)
    error = playground.locator("#chat-attach-error")
    magic = b"\x89PNG\r\n\x1a\n"
    sent = _chat_requests(playground)
    try:
        attach.set_input_files(
            _file("huge.png", magic + bytes(MEDIA_MAX_IMAGE_BYTES + 1 - len(magic)), "image/png")
        )
        expect(error).to_contain_text(
            '"huge.png" is 195.3 KiB (200,001 bytes): '
            "an image may be at most 200,000 bytes (media.max_image_bytes)"
        )
        # Within media.max_image_bytes, but not within the body once in base64.
        attach.set_input_files(_file("wide.png", magic + bytes(199_000 - len(magic)), "image/png"))
        expect(error).to_contain_text("(server.max_body_bytes)")
        attach.set_input_files(_file("notes.txt", b"hello", "text/plain"))
        expect(error).to_contain_text('"notes.txt" is not a file this model reads: it takes images')
        attach.set_input_files(_file("clip.wav", _wav(0.2), "audio/wav"))  # this model hears nothing
        expect(error).to_contain_text('"clip.wav" is not a file this model reads')
        expect(playground.locator("#chat-attachments .attachment")).to_have_count(0)
        # Too many at once: past media.max_images, the rest is refused.
        attach.set_input_files(
            [_file(f"m{i}.png", _png(30 + i), "image/png") for i in range(MEDIA_MAX_IMAGES + 1)]
        )
        expect(playground.locator("#chat-attachments .attachment")).to_have_count(MEDIA_MAX_IMAGES)
        expect(error).to_contain_text(
            f"a message may hold at most {MEDIA_MAX_IMAGES} images (media.max_images)"
        )
        playground.get_by_role("button", name="Remove m0.png").click()
        expect(playground.locator("#chat-attachments .attachment")).to_have_count(MEDIA_MAX_IMAGES - 1)
        playground.get_by_role("button", name=f"Remove m{MEDIA_MAX_IMAGES - 1}.png").click()
        expect(playground.locator("#chat-attachments .attachment")).to_have_count(MEDIA_MAX_IMAGES - 2)
    finally:
        playground.unroute("**/ui/api/chat")
    assert sent == []


def test_the_servers_refusal_of_a_picture_is_shown_and_the_message_and_file_stay(
    playground: Page, media_box: MediaBox
) -> None:
    broken = _png(2)[:-60]  # a PNG cut short: it starts like one, the server cannot decode it
    playground.get_by_label("Model", exact=True).select_option("vision")
    playground.get_by_label("Attach files", exact=True).set_input_files(
        _file("broken.png", broken, "image/png")
    )
    expect(playground.locator("#chat-attachments .attachment")).to_have_count(1)
    _send(playground, "Look at this")
    told = media_box.answer_to(
        "vision",
        [
            {"type": "text", "text": "Look at this"},
            {"type": "image_url", "image_url": {"url": _data_url(broken)}},
        ],
    )
    assert told["error"]["code"] == "invalid_image"
    figures = playground.locator("#chat-figures")
    expect(figures).to_contain_text(f"ended: {told['error']['message']}")
    expect(figures).to_have_class(re.compile(r"\bbad\b"))
    expect(playground.locator("#transcript .turn")).to_have_count(0)  # no bubbles for what was refused
    expect(playground.get_by_label("Message", exact=True)).to_have_value("Look at this")
    expect(playground.locator("#chat-attachments .attachment")).to_contain_text("broken.png")
    # A model that reads no images: the file is dropped, and the page says so.
    playground.get_by_label("Model", exact=True).select_option("hears")
    expect(playground.locator("#chat-attachments .attachment")).to_have_count(0)
    expect(playground.locator("#chat-attach-error")).to_contain_text(
        'Removed "broken.png": the model hears reads no images'
    )


def test_an_audio_clip_reaches_a_model_that_hears(playground: Page, media_box: MediaBox) -> None:
    clip = _wav(1.0)
    playground.get_by_label("Model", exact=True).select_option("hears")
    attach = playground.get_by_label("Attach files", exact=True)
    expect(attach).to_have_attribute("accept", re.compile(r"^\.wav,"))
    attach.set_input_files(_file("tone.wav", clip, "audio/wav"))
    pending = playground.locator("#chat-attachments .attachment")
    expect(pending).to_contain_text(f"tone.wav (WAV audio, {len(clip) / 1024:.1f} KiB)")
    expect(pending.locator("img")).to_have_count(0)
    encoded = media_box.encoded("hears")
    sent = _chat_requests(playground)
    try:
        _send(playground, "What is this sound?")
    finally:
        playground.unroute("**/ui/api/chat")
    expect(playground.locator("#chat-figures")).to_contain_text("tokens/s")
    assert sent[0]["messages"][-1]["content"] == [
        {"type": "text", "text": "What is this sound?"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
    ]
    assert media_box.encoded("hears") > encoded
    expect(playground.locator('#transcript [data-role="user"] .attachment')).to_contain_text("tone.wav")


# Keep this test last in the module: after the drain the box accepts no new connections.
def test_a_drain_is_shown_at_once_over_the_figures(console: Page, box: Box) -> None:
    console.goto(box.daemon.url + "/ui/#overview")
    expect(console.locator("#readiness")).not_to_have_attribute("data-status", "draining")
    daemon = box.daemon
    assert daemon.app is not None
    assert daemon._runner is not None
    asyncio.run_coroutine_threadsafe(drain(daemon.app, daemon._runner, 5), daemon.loop).result(10)
    readiness = console.locator("#readiness")
    expect(readiness).to_have_attribute("data-status", "draining")
    expect(readiness).to_contain_text("Draining: the daemon is stopping")
    expect(readiness).to_have_attribute("data-worst", "bad")
