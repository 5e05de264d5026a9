"""The console's front door on a real daemon, no browser: cookies, CSRF, CSP, sessions, networks, secrets.

Plain HTTP over real sockets (http.client): the session cookie is carried by hand, so that
every flag the daemon sets is seen as it is sent.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import pytest

from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.keys import create_key
from edgellmctl.quickstart import write_self_signed
from edgellmd import __version__
from edgellmd.http.console.routes import CSP
from edgellmd.keys import hash_secret, load_keys_document, new_token, save_keys_document
from edgellmd.settings import ConsoleSettings, Settings
from tests.bare import audit_lines, everything_logged
from tests.ggufmodels import write_tiny_audio_projector, write_tiny_projector
from tests.serving import RunningDaemon, running, settings_for, wait_for

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

MODEL: Final = "tiny"


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        code: str | None = self.json()["error"]["code"]
        return code


@dataclass
class Browser:
    """What a browser would send: the session cookie once it has one, the CSRF token the page holds."""

    port: int
    context: ssl.SSLContext | None = None
    cookie: str | None = None
    csrf: str | None = None
    seen: list[bytes] = field(default_factory=list)  # every body answered, to scan for secrets

    def connection(self) -> http.client.HTTPConnection:
        if self.context is not None:
            return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10, context=self.context)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        csrf: bool = True,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        sent = {"Content-Type": "application/json", **(headers or {})}
        if self.cookie:
            sent["Cookie"] = f"edgellm_console={self.cookie}"
        if csrf and self.csrf and method != "GET":
            sent["X-CSRF-Token"] = self.csrf
        conn = self.connection()
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=sent)
            response = conn.getresponse()
            answer = Answer(response.status, response.headers, response.read())
        finally:
            conn.close()
        self.seen.append(answer.body)
        return answer

    def sign_in(self, token: str) -> Answer:
        answer = self.request("POST", "/ui/api/session", {"key": token})
        if answer.status == 200:
            cookie = answer.headers["Set-Cookie"]
            self.cookie = cookie.split(";", 1)[0].split("=", 1)[1]
            self.csrf = answer.json()["csrf"]
        return answer


@dataclass
class Box:
    daemon: RunningDaemon
    keys: Path
    tokens: dict[str, str]  # label -> token

    def browser(self) -> Browser:
        return Browser(self.daemon.port)


def _settings(models_dir: Path, keys: Path, **console: Any) -> Settings:
    settings = settings_for(
        [
            {
                "name": MODEL,
                "file": str(models_dir / "tiny.gguf"),
                "slots": 2,
                "context_size": 128,
                "threads": 1,
            }
        ],
        auth={"keys_file": str(keys)},
    )
    # The suite signs in often with one key: its own tests of those two bounds set them low.
    console = {"signins_per_key_per_minute": 1000, "max_sessions_per_key": 64, **console}
    return replace(settings, console=ConsoleSettings(enabled=True, stream_interval_s=0.2, **console))


def _keys(root: Path, *labels: tuple[str, list[str]]) -> tuple[Path, dict[str, str]]:
    path = root / "keys.yaml"
    tokens = {label: create_key(path, label, scopes, limits={})[1] for label, scopes in labels}
    return path, tokens


@pytest.fixture(scope="module")
def box(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    keys, tokens = _keys(
        tmp_path_factory.mktemp("console"),
        ("operator", ["admin", "inference"]),
        ("app", ["inference"]),
        ("scraper", ["metrics"]),
    )
    with running(_settings(models_dir, keys, signin_failures_per_minute=3)) as daemon:
        yield Box(daemon, keys, tokens)


def test_the_session_cookie_is_httponly_samesite_strict_and_for_the_console_only(box: Box) -> None:
    answer = box.browser().sign_in(box.tokens["operator"])
    assert answer.status == 200
    cookie = answer.headers["Set-Cookie"]
    flags = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "samesite", "path", "max-age"} <= flags
    assert "samesite=strict" in cookie.lower()
    assert "path=/ui" in cookie.lower()
    assert "secure" not in flags  # plain HTTP: a Secure cookie would never come back
    assert box.tokens["operator"] not in cookie
    assert answer.json()["scopes"] == ["admin", "inference"]


def test_the_cookie_is_secure_under_tls(models_dir: Path, tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path / "tls", "127.0.0.1")
    keys, tokens = _keys(tmp_path, ("operator", ["admin"]))
    settings = _settings(models_dir, keys)
    settings = replace(settings, server=replace(settings.server, tls_cert=cert, tls_key=key))
    with running(settings, wait_ready=False) as daemon:
        browser = Browser(daemon.port, context=ssl.create_default_context(cafile=str(cert)))
        answer = wait_for(lambda: _try_sign_in(browser, tokens["operator"]), what="the TLS daemon")
        assert answer.status == 200
        assert "secure" in {p.strip().lower() for p in answer.headers["Set-Cookie"].split(";")}
        assert "samesite=strict" in answer.headers["Set-Cookie"].lower()


def _try_sign_in(browser: Browser, token: str) -> Answer | None:
    try:
        return browser.sign_in(token)
    except OSError:
        return None


@pytest.mark.parametrize(
    ("headers", "csrf", "code"),
    [
        ({}, False, "csrf_token_invalid"),  # no token
        ({"X-CSRF-Token": "not-the-token"}, False, "csrf_token_invalid"),
        ({"Sec-Fetch-Site": "cross-site"}, True, "cross_site_request"),  # even with the token
        ({"Origin": "http://evil.example"}, True, "cross_site_request"),
        ({"Origin": "http://["}, True, "cross_site_request"),  # no URL at all: refused, not a 500
        ({"Origin": "http://[::1"}, True, "cross_site_request"),
        ({"X-CSRF-Token": "\u00e9"}, False, "csrf_token_invalid"),  # the byte 0xE9, no UTF-8
    ],
)
def test_a_change_without_the_sessions_csrf_token_or_from_another_site_is_refused(
    box: Box, headers: dict[str, str], csrf: bool, code: str
) -> None:
    browser = box.browser()
    browser.sign_in(box.tokens["operator"])
    for path, body in (
        ("/ui/api/reload", {}),
        (f"/ui/api/models/{MODEL}/unload", {}),
        ("/ui/api/keys", {"name": "x", "scopes": ["inference"]}),
        ("/ui/api/session/end", {}),
    ):
        answer = browser.request("POST", path, body, csrf=csrf, headers=headers)
        assert (answer.status, answer.code) == (403, code), path
    assert browser.request("GET", "/ui/api/session").json()["signed_in"] is True  # still signed in
    assert browser.request("POST", "/ui/api/reload", {}).status == 200  # with its own token


def test_a_sign_in_from_an_origin_that_is_no_url_is_refused(box: Box) -> None:
    browser = box.browser()
    for path in ("/ui/api/session", "/ui/api/session/end"):
        answer = browser.request(
            "POST", path, {"key": box.tokens["operator"]}, csrf=False, headers={"Origin": "http://["}
        )
        assert (answer.status, answer.code) == (403, "cross_site_request"), path


def test_another_sessions_csrf_token_does_not_do(box: Box) -> None:
    first, second = box.browser(), box.browser()
    first.sign_in(box.tokens["operator"])
    second.sign_in(box.tokens["operator"])
    first.csrf = second.csrf
    assert first.request("POST", "/ui/api/reload", {}).code == "csrf_token_invalid"


def test_routes_need_a_session_and_their_scope(box: Box) -> None:
    nobody = box.browser()
    assert nobody.request("GET", "/ui/").status == 200  # the page itself is public: it shows the sign-in
    assert nobody.request("GET", "/ui/api/session").json() == {"signed_in": False}
    for method, path in (
        ("GET", "/ui/api/events"),
        ("GET", "/ui/api/keys"),
        ("POST", "/ui/api/chat"),
        ("POST", "/ui/api/complete"),
    ):
        answer = nobody.request(method, path, {})
        assert (answer.status, answer.code) == (401, "session_required"), path
    app = box.browser()
    app.sign_in(box.tokens["app"])
    listed = app.request("GET", "/ui/api/models").json()
    assert (listed["models"], listed["reads"]) == ([MODEL], {MODEL: ["text"]})
    for method, path in (("GET", "/ui/api/events"), ("GET", "/ui/api/keys"), ("POST", "/ui/api/reload")):
        answer = app.request(method, path, {})
        assert (answer.status, answer.code) == (403, "insufficient_scope"), path
    answer = box.browser().sign_in(box.tokens["scraper"])  # metrics only: nothing in the console for it
    assert (answer.status, answer.code) == (403, "insufficient_scope")
    assert "Set-Cookie" not in answer.headers


def test_the_playground_is_told_what_each_model_reads_and_the_bounds_on_its_files(
    models_dir: Path, tmp_path: Path
) -> None:
    keys, tokens = _keys(tmp_path, ("app", ["inference"]))
    text = str(models_dir / "tiny.gguf")
    settings = settings_for(
        [
            {"name": "plain", "file": text, "context_size": 128, "threads": 1},
            {
                "name": "vision",
                "file": text,
                "mmproj_file": str(write_tiny_projector(tmp_path / "vision.gguf")),
                "context_size": 128,
                "threads": 1,
            },
            {
                "name": "hears",
                "file": text,
                "mmproj_file": str(write_tiny_audio_projector(tmp_path / "audio.gguf")),
                "context_size": 1024,
                "threads": 1,
            },
        ],
        server={"max_body_bytes": 524_288},
        auth={"keys_file": str(keys)},
        lifecycle={"preload_dir": str(tmp_path / "shm"), "watch": False},
        media={"max_images": 3, "max_image_bytes": 200_000, "max_clips": 2, "max_audio_bytes": 300_000},
    )
    settings = replace(settings, console=ConsoleSettings(enabled=True))
    with running(settings) as daemon:
        app = Browser(daemon.port)
        app.sign_in(tokens["app"])
        listed = app.request("GET", "/ui/api/models").json()
    assert listed["models"] == ["plain", "vision", "hears"]  # names, as before: configuration order
    assert listed["reads"] == {"plain": ["text"], "vision": ["text", "image"], "hears": ["text", "audio"]}
    assert listed["media"] == {
        "max_images": 3,
        "max_image_bytes": 200_000,
        "max_clips": 2,
        "max_audio_bytes": 300_000,
        "max_body_bytes": 524_288,
        "image_formats": ["png", "jpeg", "webp", "gif"],
        "audio_formats": ["wav", "mp3", "flac", "ogg"],
    }


def test_the_playground_runs_the_chat_handler_under_the_sessions_key(box: Box) -> None:
    app = box.browser()
    app.sign_in(box.tokens["app"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    answer = app.request("POST", "/ui/api/chat", {**body, "ignore_eos": True})
    assert answer.status == 200
    assert answer.json()["usage"]["completion_tokens"] == 3
    streamed = app.request("POST", "/ui/api/chat", {**body, "stream": True, "ignore_eos": True})
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    assert streamed.body.rstrip().endswith(b"data: [DONE]")
    refused = app.request("POST", "/ui/api/chat", {**body, "max_tokens": 10**6})
    assert (refused.status, refused.json()["error"]["param"]) == (400, "max_tokens")
    # Completion mode, for base models: the completions handler, with the same checks.
    text = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "ignore_eos": True}
    completed = app.request("POST", "/ui/api/complete", text)
    assert completed.status == 200
    assert completed.json()["object"] == "text_completion"
    assert completed.json()["usage"]["completion_tokens"] == 3
    assert app.request("POST", "/ui/api/complete", text, csrf=False).status == 403  # no CSRF token: refused
    bad = app.request("POST", "/ui/api/complete", {**text, "prompt": 7})
    assert (bad.status, bad.json()["error"]["param"]) == (400, "prompt")


def test_wrong_keys_are_rate_limited_and_audited(
    models_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys, tokens = _keys(tmp_path, ("operator", ["admin"]))
    caplog.set_level(logging.INFO, logger="edgellmd.audit")
    with running(_settings(models_dir, keys, signin_failures_per_minute=3)) as daemon:
        browser = Browser(daemon.port)
        wrong = tokens["operator"][:-4] + "AAAA"
        for _ in range(3):
            answer = browser.sign_in(wrong)
            assert (answer.status, answer.code) == (401, "invalid_api_key")
        limited = browser.sign_in(wrong)
        assert (limited.status, limited.code) == (429, "rate_limit_exceeded")
        assert int(limited.headers["Retry-After"]) >= 1
        assert browser.sign_in(wrong).status == 429
        # The right key is never refused for the wrong ones before it (its secret cannot be guessed).
        assert browser.sign_in(tokens["operator"]).status == 200
        assert browser.sign_in(wrong).status == 429  # and the wrong ones still wait
    messages = [(line.message, line.peer) for line in audit_lines(caplog)]
    assert messages.count(("auth failed: wrong or unknown key", "127.0.0.1")) == 6
    assert ("console sign-in refused: too many wrong keys", "127.0.0.1") in messages
    assert wrong not in everything_logged(caplog)


def test_an_inference_key_signing_in_in_a_loop_neither_signs_the_admin_out_nor_goes_unlimited(
    models_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys, tokens = _keys(tmp_path, ("operator", ["admin"]), ("app", ["inference"]))
    caplog.set_level(logging.INFO, logger="edgellmd.audit")
    settings = _settings(
        models_dir, keys, signins_per_key_per_minute=5, max_sessions_per_key=2, max_sessions=4
    )
    with running(settings) as daemon:
        admin = Browser(daemon.port)
        assert admin.sign_in(tokens["operator"]).status == 200
        answers = [Browser(daemon.port).sign_in(tokens["app"]) for _ in range(8)]
        assert [a.status for a in answers] == [200] * 5 + [429] * 3
        assert all(int(a.headers["Retry-After"]) >= 1 for a in answers[5:])
        assert answers[-1].code == "rate_limit_exceeded"
        assert admin.request("GET", "/ui/api/keys").status == 200  # still signed in
        assert Browser(daemon.port).sign_in(tokens["operator"]).status == 200  # another key: its own budget
    messages = [(line.message, line.key_id) for line in audit_lines(caplog)]
    assert (
        messages.count(
            ("console sign-in refused: too many sign-ins with this key", answers[0].json()["key_id"])
        )
        == 3
    )


@contextmanager
def _events(browser: Browser) -> Iterator[http.client.HTTPResponse]:
    conn = browser.connection()
    try:
        conn.request("GET", "/ui/api/events", headers={"Cookie": f"edgellm_console={browser.cookie}"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["Content-Security-Policy"] == CSP
        yield response
    finally:
        conn.close()


def _in_force(box: Box, token: str) -> None:
    """Wait until the daemon has read a key just added to its file (asked of the API: the
    console's sign-in counts wrong keys)."""

    def works() -> bool:
        answer = box.browser().request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"})
        return answer.status != 401  # 403: known, without the inference scope

    wait_for(works, what="the new key in force")


def _read_until(response: http.client.HTTPResponse, name: str, timeout: float = 10.0) -> dict[str, Any]:
    """The data of the next event called `name` (skipping others)."""
    deadline = time.monotonic() + timeout
    current = None
    while time.monotonic() < deadline:
        line = response.readline().decode()
        if not line:
            raise AssertionError(f"the stream ended before an {name!r} event")
        if line.startswith("event: "):
            current = line[7:].strip()
        elif line.startswith("data: ") and current == name:
            found: dict[str, Any] = json.loads(line[6:])
            return found
    raise AssertionError(f"no {name!r} event within {timeout} s")


def test_the_event_stream_shows_the_admin_figures_and_ends_with_its_session(box: Box) -> None:
    browser = box.browser()
    browser.sign_in(box.tokens["operator"])
    with _events(browser) as stream:
        assert "samples" in _read_until(stream, "history")
        overview = _read_until(stream, "overview")
        status = box.daemon.get("/readyz")[1]
        assert overview["ready"] == status
        assert [m["name"] for m in overview["status"]["models"]] == [MODEL]
        assert overview["lockfile"] == {"unsigned": True}
        assert {"cpu_count", "load1", "pinning", "shm"} <= set(overview["host"])
        daemon = overview["daemon"]
        assert daemon["version"] == __version__
        assert daemon["address"] == f"127.0.0.1:{box.daemon.port}"
        assert daemon["uptime_s"] >= 0
        assert abs(daemon["started_at"] + daemon["uptime_s"] - time.time()) < 60
        with _events(browser) as again:  # the same session opens a second stream: the first one ends
            assert _read_until(stream, "end")["reason"].startswith("replaced")
            _read_until(again, "overview")
            assert browser.request("POST", "/ui/api/session/end", {}).status == 200
            assert _read_until(again, "end") == {"reason": "signed out"}
            assert again.read().strip() == b""  # and the stream closes
    assert browser.request("GET", "/ui/api/events").code == "session_required"


def _signed_in_new_key(box: Box, name: str, scopes: list[str]) -> tuple[str, Browser]:
    """A key just added to the keys file, in force, and a browser signed in with it."""
    _, token = create_key(box.keys, name, scopes, limits={})
    _in_force(box, token)
    browser = box.browser()
    assert browser.sign_in(token).status == 200
    return token.split("_")[1], browser


def test_revoking_the_key_ends_its_sessions_and_their_streams(box: Box) -> None:
    key_id, browser = _signed_in_new_key(box, "short-lived", ["admin"])
    with _events(browser) as stream:
        _read_until(stream, "overview")
        assert (
            edgellmctl(["keys", "revoke", key_id, "--file", str(box.keys)]) == 0
        )  # the CLI, not the console
        assert "no longer valid" in _read_until(stream, "end")["reason"]
    assert browser.request("GET", "/ui/api/session").json() == {"signed_in": False}
    assert browser.request("POST", "/ui/api/reload", {}).code == "session_required"


def test_replacing_a_keys_secret_ends_the_sessions_its_old_token_opened(box: Box) -> None:
    """The keys file's entry given a new hash (the same id: the secret rotated after a leak):
    the old token got 401 from the API, yet the console session it opened went on (its event
    stream, its key actions) for up to session_max_s. It ends as a revoked key's does."""
    key_id, browser = _signed_in_new_key(box, "rotated", ["admin"])
    with _events(browser) as stream:
        _read_until(stream, "overview")
        data = load_keys_document(box.keys)
        entry = next(e for e in data["keys"] if e["id"] == key_id)
        prefix, _, secret = new_token()[1].split("_", 2)
        entry["hash"] = hash_secret(secret)
        save_keys_document(box.keys, data)
        assert "no longer valid" in _read_until(stream, "end")["reason"]
    assert browser.request("GET", "/ui/api/session").json() == {"signed_in": False}
    again = box.browser()
    assert again.sign_in(f"{prefix}_{key_id}_{secret}").status == 200  # the new secret signs in


def test_a_page_of_another_origin_of_the_same_site_cannot_take_the_stream(box: Box) -> None:
    """http://127.0.0.1:OTHER is the same site: the SameSite=Strict cookie goes with an <img>
    there pointing at the event stream. The browser says Sec-Fetch-Site: same-site, and the
    console's API answers its own pages only: the operator's stream is not replaced."""
    browser = box.browser()
    browser.sign_in(box.tokens["operator"])
    with _events(browser) as stream:
        _read_until(stream, "overview")
        for site in ("same-site", "cross-site"):
            for path in ("/ui/api/events", "/ui/api/session", "/ui/api/keys"):
                answer = browser.request(
                    "GET", path, headers={"Sec-Fetch-Site": site, "Sec-Fetch-Dest": "image"}
                )
                assert (answer.status, answer.code) == (403, "cross_site_request"), (site, path)
        _read_until(stream, "overview")  # the operator's stream goes on
        assert (
            browser.request("GET", "/ui/api/session", headers={"Sec-Fetch-Site": "same-origin"}).status == 200
        )
        assert (
            browser.request("GET", "/ui/", headers={"Sec-Fetch-Site": "same-site"}).status == 200
        )  # the page
        with _events(browser) as again:  # its own page's new stream (no header: curl) still replaces it
            assert _read_until(stream, "end")["reason"].startswith("replaced")
            _read_until(again, "overview")


def test_a_key_that_loses_the_admin_scope_loses_its_open_event_stream(box: Box) -> None:
    """The stream checks the session's key as it is now at every tick: a keys file that takes
    the admin scope away (the key still working for inference) ends the admin figures too."""
    key_id, browser = _signed_in_new_key(box, "demoted", ["admin", "inference"])
    with _events(browser) as stream:
        _read_until(stream, "overview")
        document = load_keys_document(box.keys)
        for entry in document["keys"]:
            if entry["id"] == key_id:
                entry["scopes"] = ["inference"]
        save_keys_document(box.keys, document)
        assert "no longer has the 'admin' scope" in _read_until(stream, "end")["reason"]
    assert browser.request("GET", "/ui/api/session").json()["scopes"] == ["inference"]
    assert browser.request("GET", "/ui/api/events").code == "insufficient_scope"


def test_revoking_a_key_in_the_console_ends_its_sessions_at_once(box: Box) -> None:
    _, token = create_key(box.keys, "victim", ["inference"], limits={})
    key_id = token.split("_")[1]
    victim, operator = box.browser(), box.browser()
    _in_force(box, token)
    assert victim.sign_in(token).status == 200
    operator.sign_in(box.tokens["operator"])
    assert operator.request("POST", f"/ui/api/keys/{key_id}/disable", {}).json() == {
        "ok": True,
        "id": key_id,
        "action": "disable",
    }
    assert victim.request("GET", "/ui/api/models").code == "session_required"
    assert operator.request("POST", f"/ui/api/keys/{key_id}/enable", {}).status == 200
    assert victim.sign_in(token).status == 200
    assert operator.request("POST", f"/ui/api/keys/{key_id}/revoke", {}).status == 200
    assert victim.request("GET", "/ui/api/models").code == "session_required"
    assert key_id not in [k["id"] for k in operator.request("GET", "/ui/api/keys").json()["keys"]]
    assert operator.request("POST", f"/ui/api/keys/{key_id}/revoke", {}).code == "key_not_found"


def test_the_console_is_refused_outside_admin_cidrs(models_dir: Path, tmp_path: Path) -> None:
    keys, tokens = _keys(tmp_path, ("operator", ["admin", "inference"]))
    settings = _settings(models_dir, keys)
    settings = replace(settings, auth=replace(settings.auth, admin_cidrs=("10.0.0.0/8",)))
    with running(settings) as daemon:  # the tests connect from 127.0.0.1
        browser = Browser(daemon.port)
        for method, path in (
            ("GET", "/ui"),
            ("GET", "/ui/"),
            ("GET", "/ui/static/app.js"),
            ("GET", "/ui/api/session"),
        ):
            answer = browser.request(method, path)
            assert (answer.status, answer.code) == (403, "address_not_allowed"), path
        answer = browser.sign_in(tokens["operator"])
        assert (answer.status, answer.code) == (403, "address_not_allowed")
        assert daemon.get("/readyz")[0] == 200  # the rest of the daemon is not the console


CONSOLE_ANSWERS: Final = [
    ("GET", "/ui"),
    ("GET", "/ui/"),
    ("GET", "/ui/static/app.js"),
    ("GET", "/ui/static/app.css"),
    ("GET", "/ui/static/icon.svg"),
    ("GET", "/ui/static/nothing.js"),
    ("GET", "/ui/static/..%2Fconsole.py"),
    ("GET", "/ui/api/session"),
    ("GET", "/ui/api/keys"),
    ("POST", "/ui/api/reload"),
    ("GET", "/ui/api/nothing"),
    ("DELETE", "/ui/api/session"),
]


@pytest.mark.parametrize(("method", "path"), CONSOLE_ANSWERS)
def test_every_console_answer_carries_the_consoles_csp(box: Box, method: str, path: str) -> None:
    answer = box.browser().request(method, path, {} if method == "POST" else None)
    csp = answer.headers["Content-Security-Policy"]
    assert csp == CSP
    assert "default-src 'self'" in csp
    assert "'unsafe-inline'" not in csp
    assert "'unsafe-eval'" not in csp
    assert "frame-ancestors 'none'" in csp
    assert answer.headers["X-Frame-Options"] == "DENY"
    assert answer.headers["X-Content-Type-Options"] == "nosniff"


def test_the_page_has_no_inline_script_or_style_and_loads_nothing_from_elsewhere(box: Box) -> None:
    page = box.browser().request("GET", "/ui/").body.decode()
    assert "<script>" not in page
    assert " style=" not in page
    assert "<style" not in page
    assert not re.search(r"\son[a-z]+\s*=", page)  # no onclick= and the like
    assert "http://" not in page
    assert "https://" not in page
    script = box.browser().request("GET", "/ui/static/app.js").body.decode()
    assert "innerHTML" not in script.replace("innerHTML would throw", "")
    assert "localStorage" not in script
    assert "document.cookie" not in script


def test_the_rest_of_the_daemon_keeps_the_apis_csp(box: Box) -> None:
    answer = box.browser().request("GET", "/readyz")
    assert answer.headers["Content-Security-Policy"] == "default-src 'none'; frame-ancestors 'none'"


def test_no_secret_reaches_a_page_an_answer_or_a_log(box: Box, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = box.tokens["operator"]
    browser = box.browser()
    browser.sign_in(token)
    secrets = [token, token.split("_", 2)[2], browser.cookie or "", browser.csrf or ""]
    stored = box.keys.read_text()  # the hashes
    hashes = [line.split("hash: ")[1].strip() for line in stored.splitlines() if "hash: " in line]
    created = browser.request("POST", "/ui/api/keys", {"name": "scan", "scopes": ["inference"]}).json()
    new_token = created["token"]
    for method, path in (
        ("GET", "/ui/"),
        ("GET", "/ui/static/app.js"),
        ("GET", "/ui/api/keys"),
        ("GET", "/ui/api/session"),
        ("GET", "/ui/api/models"),
        ("POST", "/ui/api/reload"),
    ):
        browser.request(method, path, {} if method == "POST" else None)
    with _events(browser) as stream:
        overview = json.dumps(_read_until(stream, "overview"))
    browser.request("POST", f"/ui/api/keys/{created['key']['id']}/revoke", {})
    browser.request("POST", "/ui/api/session/end", {})
    answers = b"\n".join(browser.seen[1:]).decode() + overview  # the sign-in answer holds the CSRF token
    answers = answers.replace(json.dumps(created), "")  # the one answer that shows a token, once
    logged = everything_logged(caplog)
    for secret in [*secrets[:3], new_token, new_token.split("_", 2)[2], *hashes]:
        assert secret not in answers
        assert secret not in logged
    assert secrets[3] not in logged  # the CSRF token
    assert "console sign-in" in [line.message for line in audit_lines(caplog)]


def test_an_open_event_stream_ends_when_the_daemon_stops(models_dir: Path, tmp_path: Path) -> None:
    keys, tokens = _keys(tmp_path, ("operator", ["admin"]))
    daemon = RunningDaemon(_settings(models_dir, keys)).start()
    stopping = threading.Thread(target=daemon.stop)
    try:
        browser = Browser(daemon.port)
        browser.sign_in(tokens["operator"])
        with _events(browser) as stream:
            _read_until(stream, "overview")
            started = time.monotonic()
            stopping.start()
            assert _read_until(stream, "end") == {"reason": "the daemon is shutting down"}
        stopping.join(30)
        assert time.monotonic() - started < 5  # not held until the shutdown timeout
    finally:
        if not stopping.is_alive():
            daemon.stop()


def test_a_watched_overview_keeps_its_session_until_its_absolute_end(
    models_dir: Path, tmp_path: Path
) -> None:
    keys, tokens = _keys(tmp_path, ("wall", ["admin"]))
    settings = _settings(models_dir, keys, session_idle_s=1.0, session_max_s=4.0)
    with running(settings) as daemon:
        idle = Browser(daemon.port)
        idle.sign_in(tokens["wall"])
        wall = Browser(daemon.port)
        wall.sign_in(tokens["wall"])
        with _events(wall) as stream:
            started = time.monotonic()
            while time.monotonic() - started < 2.5:  # past the idle time, reading the overview
                _read_until(stream, "overview")
            # The wall display is still signed in; the session nobody used is not.
            assert wall.request("GET", "/ui/api/session").json()["signed_in"] is True
            assert idle.request("GET", "/ui/api/session").json()["signed_in"] is False
            # Watching never carries a session past session_max_s.
            assert _read_until(stream, "end", timeout=10)["reason"] == "session expired"
        assert time.monotonic() - started < 8
