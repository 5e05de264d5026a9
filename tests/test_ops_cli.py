"""edgellmctl's shared parts: options by full names only; keys never on the command line or in a message."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Final

import pytest

from edgellmctl import admin, bench
from edgellmctl.__main__ import build_parser, main
from edgellmctl.cli import Parser, redact

TOKEN: Final = "elk_0123456789ab_" + "Zm9vYmFyYmF6cXV4" * 3  # the shape of an edgellm API token
SECRET_PARTS: Final = (TOKEN, "Zm9vYmFy", "0123456789ab")
# Every command that talks to a daemon, with what it needs besides a key.
TALKERS: Final = {
    "status": ["status"],
    "stats": ["stats"],
    "reload": ["reload"],
    "load": ["load", "m"],
    "unload": ["unload", "m"],
    "bench": ["bench", "--url", "http://127.0.0.1:9"],
}


@pytest.fixture(autouse=True)
def _no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (admin.KEY_ENV, admin.KEY_FILE_ENV, bench.KEY_ENV, bench.KEY_FILE_ENV, admin.URL_ENV):
        monkeypatch.delenv(name, raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run edgellmctl, expect the argument parser's exit status 2; what it printed."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:  # argparse offers no public walk of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_parser_takes_options_by_their_full_names_only() -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) > 15  # the top, every command and every verb
    for parser in parsers:
        assert isinstance(parser, Parser), parser.prog
        assert parser.allow_abbrev is False, parser.prog


@pytest.mark.parametrize("command", list(TALKERS))
@pytest.mark.parametrize("form", ["--key", "--key=", "--api-key", "--token", "positional"])
def test_a_key_on_the_command_line_is_refused_and_never_printed(
    command: str, form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--key K` used to be taken for `--key-file K` by prefix matching; the error message
    # then printed K. The key on a command line shows in `ps` and shell history anyway.
    extra = {
        "--key": ["--key", TOKEN],
        "--key=": [f"--key={TOKEN}"],
        "--api-key": ["--api-key", TOKEN],
        "--token": ["--token", TOKEN],
        "positional": [TOKEN, TOKEN],
    }[form]
    err = refused([*TALKERS[command], *extra], capsys)
    assert "unrecognized arguments: " in err
    for part in SECRET_PARTS:
        assert part not in err
    if form != "positional":
        assert f"unrecognized arguments: {extra[0].split('=')[0]}" in err


@pytest.mark.parametrize("command", list(TALKERS))
@pytest.mark.parametrize("abbreviation", ["--key-fi", "--key", "--ur"])
def test_abbreviations_are_refused(
    command: str, abbreviation: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([*TALKERS[command], abbreviation, str(tmp_path / "admin.key")], capsys)
    # (reload takes the file for its optional model name; the option is refused all the same)
    assert f"unrecognized arguments: {abbreviation}" in err


@pytest.mark.parametrize("command", list(TALKERS))
def test_a_key_given_where_its_file_belongs_is_not_printed(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(
        [*TALKERS[command], "--url", f"http://127.0.0.1:{_closed_port()}", "--key-file", TOKEN]
        if command != "bench"
        else [*TALKERS[command], "--key-file", TOKEN]
    ) in (1, 2)
    err = capsys.readouterr().err
    assert "No such file or directory" in err
    assert "elk_(hidden)" in err
    for part in SECRET_PARTS:
        assert part not in err


@pytest.mark.parametrize("command", ["status", "reload", "bench"])
@pytest.mark.parametrize("via", ["--key-file", "environment"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_key_file_that_is_not_a_regular_file_is_refused_at_once_in_one_line(
    command: str,
    via: str,
    kind: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "admin.key"
    if kind == "fifo":
        os.mkfifo(path)  # without O_NONBLOCK, opening it waits for a writer, for ever
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")  # never ends
    argv = [*TALKERS[command], "--url", f"http://127.0.0.1:{_closed_port()}"]
    if command == "bench":
        argv = argv[:1] + argv[3:]
    if via == "--key-file":
        argv += ["--key-file", str(path)]
    else:
        monkeypatch.setenv(bench.KEY_FILE_ENV if command == "bench" else admin.KEY_FILE_ENV, str(path))
    status = main(argv)
    err = capsys.readouterr().err
    assert status == (2 if command == "bench" else 1)
    noun = {"fifo": "a FIFO", "directory": "a directory", "device": "a character device"}[kind]
    assert err.endswith(f"key file {path} is {noun}, not a regular file\n")
    assert err.count("\n") == 1


def test_the_admin_key_comes_from_the_file_env_before_the_key_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.key").write_text("\n")
    monkeypatch.setenv(admin.KEY_FILE_ENV, str(tmp_path / "empty.key"))
    monkeypatch.setenv(admin.KEY_ENV, TOKEN)
    assert main(["status", "--url", f"http://127.0.0.1:{_closed_port()}"]) == 1
    err = capsys.readouterr().err
    assert err == f"edgellmctl status: the admin key file {tmp_path / 'empty.key'} is empty\n"


def test_a_url_with_credentials_from_the_environment_is_refused_without_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(admin.URL_ENV, f"http://ops:{TOKEN}@127.0.0.1:8080")
    err = refused(["status"], capsys)
    assert "must not carry credentials; pass the key with --key-file" in err
    for part in SECRET_PARTS:
        assert part not in err


@pytest.mark.parametrize("kind", ["fifo", "garbage"])
def test_a_cacert_that_is_not_a_certificate_file_is_refused_at_once(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(admin.KEY_ENV, TOKEN)
    cacert = tmp_path / "ca.pem"
    if kind == "fifo":
        os.mkfifo(cacert)
    else:
        cacert.write_text("not a certificate\n")
    assert main(["status", "--url", "https://127.0.0.1:9", "--cacert", str(cacert)]) == 1
    expected = {
        "fifo": f"--cacert: {cacert} is a FIFO, not a regular file",
        "garbage": f"--cacert {cacert} holds no usable PEM certificate",
    }[kind]
    assert capsys.readouterr().err == f"edgellmctl status: {expected}\n"


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        (
            "unrecognized arguments: --key elk_0123456789ab_c2VjcmV0",
            "unrecognized arguments: --key ... (values are not shown)",
        ),
        (
            "unrecognized arguments: --key=hunter2 --json",
            "unrecognized arguments: --key --json (values are not shown)",
        ),
        ("unrecognized arguments: --bogus", "unrecognized arguments: --bogus"),
        ("unrecognized arguments: hunter2", "unrecognized arguments: ... (values are not shown)"),
        (
            "argument COMMAND: invalid choice: 'elk_0123456789ab_c2VjcmV0'",
            "argument COMMAND: invalid choice: 'elk_(hidden)'",
        ),
        (
            "cannot read the admin key file elk_0123456789ab_c2Vj: No such file or directory",
            "cannot read the admin key file elk_(hidden): No such file or directory",
        ),
        ("argument --url: not a valid URL", "argument --url: not a valid URL"),
    ],
)
def test_redact(message: str, shown: str) -> None:
    assert redact(message) == shown


@pytest.mark.parametrize(
    "verb", [["list"], ["revoke", "0123456789ab"], ["create", "--name", "x", "--scope", "inference"]]
)
def test_keys_commands_refuse_a_keys_file_that_is_not_a_regular_file(
    verb: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.yaml"
    os.mkfifo(keys, 0o600)
    assert main(["keys", *verb, "--file", str(keys)]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"edgellmctl keys: {keys} is a FIFO, not a regular file\n"
    assert captured.out == ""


def test_a_keys_file_with_a_yaml_error_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # PyYAML's messages span lines (the context, then the problem, each with its mark).
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: [\n  - {id: x\n")
    keys.chmod(0o600)
    assert main(["keys", "list", "--file", str(keys)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"edgellmctl keys: {keys}: YAML syntax error: ")
    assert captured.err.count("\n") == 1, captured.err


HOSTILE_REASON: Final = (
    "killed: llama_model_loader: kv 3: \x1b[2J\x1b[41;97mALL OK\x1b[0m\x1b]52;c;aGk=\x07 \u202efdp.exe"
)


class _Daemon(http.server.BaseHTTPRequestHandler):
    """What a daemon answers with a model stopped by an engine that printed a model file's text."""

    def do_GET(self) -> None:
        body = {
            "models": [{"name": "m", "state": "failed", "reason": HOSTILE_REASON, "last_reload": None}],
            "gpu": {"devices": [{"index": 0, "name": "\x1b]8;;http://x\x07H200\x1b]8;;\x07"}]},
        }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body: dict[str, Any]
        if self.path.endswith("/load"):  # an error: its message
            code, body = 500, {"error": {"message": HOSTILE_REASON}}
        else:  # a failed reload: its result
            code, body = 409, {"results": [{"model": "m", "result": "failed", "reason": HOSTILE_REASON}]}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize("command", [["status"], ["reload", "m"], ["load", "m"]])
def test_what_the_daemon_answers_reaches_the_terminal_escaped(
    command: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop's reason carries an engine's last lines, where native code prints a model file's
    own strings: a screen clear, a fake banner, an OSC 52 clipboard write reached the terminal."""
    monkeypatch.setenv("EDGELLM_ADMIN_KEY", "elk_0123456789ab_secret")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Daemon)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        main([*command, "--url", f"http://127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
        server.server_close()
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "ALL OK" in shown  # the text is there, inert
    assert "\x1b" not in shown
    assert "\x07" not in shown
    assert "\u202e" not in shown
    assert "\\x1b[2J" in shown


class _Odd(http.server.BaseHTTPRequestHandler):
    """A daemon that answers oddly, by path: a redirect elsewhere, shapes no daemon sends, a
    body that trickles or never ends, usage rows carrying escapes."""

    elsewhere: str = ""  # where /admin/status redirects
    seen: list[str | None] = []  # noqa: RUF012 - the Authorization headers the other host got

    def do_GET(self) -> None:
        if self.path.startswith("/admin/status") and self.elsewhere:
            self.send_response(302)
            self.send_header("Location", self.elsewhere + "/admin/status")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/admin/stats"):  # trickles: a byte at a time
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            return
        if self.path.startswith("/admin/usage"):
            counts = {"requests": 1, "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
            words = {
                "period": "\x1b]0;PWNED\x07",
                "key_id": "\u202eab",
                "model": "\x1b[31mm",
                "endpoint": "chat",
            }
            rows = [{**words, **counts}]  # and no totals
            body = {"data": rows, "time_zone": "\x1b[2J"} if "group=month" in self.path else {"data": [1]}
            data = json.dumps(body).encode()
        else:
            data = json.dumps({"models": [1]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


class _Elsewhere(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        _Odd.seen.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_: object) -> None:
        pass


def test_an_odd_daemon_gets_one_line_never_the_key_a_traceback_or_forever(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redirect took the admin key to the host it named; answers of shapes no daemon sends
    were tracebacks; a body a byte a second never ended; usage printed escapes raw."""
    monkeypatch.setenv("EDGELLM_ADMIN_KEY", "elk_0123456789ab_secret")
    monkeypatch.setattr(admin, "TIMEOUT_S", 2.0)
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (_Odd, _Elsewhere)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{servers[0].server_address[1]}"
    monkeypatch.setattr(_Odd, "elsewhere", f"http://127.0.0.2:{servers[1].server_address[1]}")
    monkeypatch.setattr(_Odd, "seen", [])
    try:
        assert main(["status", "--url", url]) == 1
        assert _Odd.seen == []  # the key stayed home
        assert "HTTP 302" in capsys.readouterr().err
        monkeypatch.setattr(_Odd, "elsewhere", "")
        for command in (["status"], ["usage"]):
            assert main([*command, "--url", url]) == 1
            err = capsys.readouterr().err
            assert "the daemon's answer is not what edgellmctl expects" in err, err
            assert err.count("\n") == 1
        started = time.monotonic()
        assert main(["stats", "--url", url]) == 1
        assert time.monotonic() - started < 6  # the answer's whole time, not each read's
        assert "took longer than 2 s" in capsys.readouterr().err
        for flags in ([], ["--csv"]):
            assert main(["usage", "--group", "month", "--url", url, *flags]) == 0
            shown = capsys.readouterr().out
            assert "\\x1b]0;PWNED" in shown
            assert "\x1b" not in shown
            assert "\u202e" not in shown
        monkeypatch.setattr(admin, "MAX_ANSWER_BYTES", 10)
        assert main(["usage", "--group", "month", "--url", url]) == 1
        assert "larger than 10 bytes" in capsys.readouterr().err
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


CHUNKED: Final = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
BROKEN_ANSWERS: Final = {
    "a status line with escapes": b"HTTP/1.1 2\x1b]0;PWNED\x07\x1b[2J00 OK\r\n\r\n",
    "too many headers": b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n{}",
    "a header line past the limit": b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * 70_000 + b"\r\n\r\n{}",
    "a chunked body cut short": CHUNKED + b'10\r\n{"models"',
    "a chunk size that is no number": CHUNKED + b"zz\r\n{}\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("answer", BROKEN_ANSWERS.values(), ids=BROKEN_ANSWERS.keys())
def test_an_answer_that_is_no_http_is_one_escaped_line(
    answer: bytes, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """http.client's own errors (too many headers, a bad status line, a cut body) were
    tracebacks, the status line's escape sequences raw on the terminal."""
    monkeypatch.setenv("EDGELLM_ADMIN_KEY", "elk_0123456789ab_secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        for command in (["status"], ["reload"], ["usage"]):
            assert main([*command, "--url", f"http://127.0.0.1:{listener.getsockname()[1]}"]) == 1
            captured = capsys.readouterr()
            assert "Traceback" not in captured.err
            assert captured.err.count("\n") == 1, captured.err
            assert "\x1b" not in captured.err + captured.out
    finally:
        listener.close()
