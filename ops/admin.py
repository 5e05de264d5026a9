"""`edgellmctl status|stats|reload|load|unload`: the daemon's admin API, as readable tables."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from edgellmctl.cli import Command, CommandError, Subcommands, add_key_options, guarded, http_url, read_key
from edgellmd.errors import escaped
from edgellmd.files import UnsuitableFile, read_regular

URL_ENV: Final = "EDGELLM_URL"
KEY_ENV: Final = "EDGELLM_ADMIN_KEY"
KEY_FILE_ENV: Final = "EDGELLM_ADMIN_KEY_FILE"
DEFAULT_URL: Final = "http://127.0.0.1:8080"
# A reload verifies, copies and loads models: minutes for large files on slow disks.
TIMEOUT_S: Final = 900.0
MAX_REASON: Final = 200
MAX_CACERT_BYTES: Final = 1024 * 1024
MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024  # an answer past it is no daemon's (usage: 100,000 rows)
# What a daemon's answer of the wrong shape raises in the code that prints it.
ANSWER_ERRORS: Final = (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: the key must never go to a host the daemon's answer names."""

    def redirect_request(self, *_: Any, **__: Any) -> None:
        return None


def answer_guarded(func: Command) -> Command:
    """`guarded`, and an answer of a shape the command cannot print is one line, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ANSWER_ERRORS as exc:
            raise CommandError(
                f"the daemon's answer is not what edgellmctl expects ({type(exc).__name__}: {exc})"
            ) from None

    return guarded(run)


class AdminClient:
    """A small JSON client for /admin/* that never prints the key."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.base = args.url.rstrip("/").removesuffix("/v1")
        self._key = _key(args)
        self._context: ssl.SSLContext | None = None
        if args.cacert is not None:
            self._context = _trusting(args.cacert)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)  # noqa: S310 - http(s) only (http_url)
        request.add_unredirected_header("Authorization", f"Bearer {self._key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=self._context), _NoRedirect)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            with opener.open(request, timeout=TIMEOUT_S) as response:
                return response.status, _json(response, deadline)
        except urllib.error.HTTPError as exc:
            try:
                payload = _json(exc, deadline)
            except (ValueError, RecursionError, CommandError, http.client.HTTPException):
                payload = None
            if exc.code == 409 and isinstance(payload, dict):  # an operation that failed: a result
                return exc.code, payload
            raise CommandError(f"{self.base}{path}: HTTP {exc.code}: {_error_text(payload)}") from None
        except urllib.error.URLError as exc:
            raise CommandError(f"cannot reach {self.base}: {exc.reason}") from None
        except http.client.HTTPException as exc:  # no HTTP answer: too many headers, a bad status line, cut
            why = f"{type(exc).__name__}: {exc}"
            raise CommandError(f"{self.base}{path}: not an HTTP answer: {why}") from None
        except (TimeoutError, ValueError, RecursionError) as exc:
            raise CommandError(f"{self.base}{path}: {str(exc) or 'timed out'}") from None


def _json(response: Any, deadline: float) -> Any:
    """A JSON answer read whole by `deadline` (one slow byte at a time never lasts forever), at
    most MAX_ANSWER_BYTES."""
    body = bytearray()
    read = getattr(response, "read1", response.read)  # an HTTPError's body has no read1
    while chunk := read(65536):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise CommandError(f"the daemon's answer is larger than {MAX_ANSWER_BYTES} bytes")
        if time.monotonic() > deadline:
            raise CommandError(f"the daemon's answer took longer than {TIMEOUT_S:.0f} s")
    return json.loads(body)


def _trusting(cacert: Path) -> ssl.SSLContext:
    """A TLS context that trusts the PEM certificates in `cacert` (read without ever blocking)."""
    try:
        pem = read_regular(cacert, MAX_CACERT_BYTES).decode("ascii")
    except UnsuitableFile as exc:
        raise CommandError(f"--cacert: {exc}") from None
    except OSError as exc:
        raise CommandError(f"cannot read --cacert {cacert}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CommandError(f"--cacert {cacert} is not a PEM certificate") from None
    try:
        return ssl.create_default_context(cadata=pem)
    except ssl.SSLError:
        raise CommandError(f"--cacert {cacert} holds no usable PEM certificate") from None


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        message = str(payload["error"].get("message", "error"))  # escaped where printed (cli.guarded)
        return message[:MAX_REASON]
    return "unexpected answer"


def _terminal(text: str) -> str:
    """A listing made of the daemon's answer, each line escaped for the terminal: model names,
    reasons (a stop's reason holds an engine's last lines, native output a model file may
    write into), GPU names: nothing in them may move the cursor, recolour or reorder a line."""
    return "\n".join(escaped(line) for line in text.split("\n"))


def _key(args: argparse.Namespace) -> str:
    key = read_key(args.key_file, what="admin key", file_env=KEY_FILE_ENV, env=KEY_ENV)
    if key is None:
        raise CommandError(
            f"no admin key: pass --key-file (e.g. admin.key from quickstart) or set "
            f"${KEY_FILE_ENV} or ${KEY_ENV}"
        )
    return key


def _when(stamp: object) -> str:
    if not isinstance(stamp, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _short(value: object, n: int = 12) -> str:
    return "-" if value is None else str(value)[:n]


def format_status(status: dict[str, Any]) -> str:
    """The /admin/status answer as a table and notes, for people."""
    lock = status.get("lock", {})
    if lock.get("unsigned"):
        head = "lockfile: none (UNSIGNED development mode)"
    else:
        head = f"lockfile: {lock.get('file')} (version {_short(lock.get('version'))})"
    lines = [head]
    preload = status.get("preload", {})
    if preload.get("dir"):
        lines.append(f"preload:  {preload['dir']} ({preload.get('used_bytes', 0) / 2**20:.1f} MiB)")
    rows = [["MODEL", "STATE", "VERSION", "SHA256", "SLOTS", "QUEUE", "LOADED", "LAST RELOAD"]]
    notes = []
    for m in status.get("models", []):
        last = m.get("last_reload") or {}
        last_text = (
            f"{last.get('result', '-')} ({last.get('trigger', '-')}, {_when(last.get('at'))})"
            if last
            else "-"
        )
        state = m.get("state", "?") + ("+reloading" if m.get("reloading") else "")
        slots = f"{m['slots_busy']}/{m['slots_total']}" if "slots_busy" in m else f"-/{m.get('slots_total')}"
        rows.append(
            [
                str(m.get("name")),
                state,
                _short(m.get("version")),
                _short(m.get("sha256")),
                slots,
                _short(m.get("queue_depth")),
                _when(m.get("loaded_at")),
                last_text,
            ]
        )
        for label, reason in (("not serving", m.get("reason")), ("last reload", last.get("reason"))):
            if reason:
                notes.append(f"  {m.get('name')}: {label}: {str(reason)[:MAX_REASON]}")
    lines.append(_table(rows))
    ledger = status.get("ledger") or {}
    if ledger.get("error"):  # /readyz refuses for it: the box is out of its balancer
        notes.append(
            f"  ledger: FAILING, usage and the audit trail are not being written (/readyz: "
            f"ledger_failing): {str(ledger['error'])[:MAX_REASON]}"
        )
    seals = ledger.get("usage_seals") or {}
    if seals.get("problems"):
        notes.append(
            f"  ledger: usage edited ({seals['problems']} problems): {str(seals.get('problem'))[:MAX_REASON]}"
        )
    if notes:
        lines.append("notes:")
        lines.extend(notes)
    return "\n".join(lines)


def format_results(answer: dict[str, Any]) -> str:
    """The outcome list of reload/load/unload, one line per model."""
    lines = []
    for r in answer.get("results", []):
        version = f" (version {r['version']})" if r.get("version") is not None else ""
        reason = f": {str(r['reason'])[:MAX_REASON]}" if r.get("reason") else ""
        lines.append(f"{r.get('model')}: {r.get('result')}{version}{reason}")
    return "\n".join(lines) or "no models"


def _samples(metrics: dict[str, Any], name: str) -> list[dict[str, Any]]:
    family = metrics.get(name.removesuffix("_total"), {})
    return [s for s in family.get("samples", []) if s.get("name") == name]


def _by(metrics: dict[str, Any], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in _samples(metrics, name):
        key = str(s["labels"].get(label, ""))
        out[key] = out.get(key, 0.0) + float(s["value"])
    return out


def _mean(metrics: dict[str, Any], name: str, model: str) -> str:
    total = _by(metrics, f"{name}_sum", "model").get(model, 0.0)
    count = _by(metrics, f"{name}_count", "model").get(model, 0.0)
    return f"{total / count * 1000:.0f} ms" if count else "-"


def _gib(n: object) -> str:
    return f"{float(n) / 2**30:.1f}" if isinstance(n, (int, float)) else "-"


def format_stats(stats: dict[str, Any]) -> str:
    """The /admin/stats answer as a few readable blocks."""
    metrics = stats.get("metrics", {})
    by_status = _by(metrics, "edgellm_requests_total", "status")
    lines = [
        f"requests: {sum(by_status.values()):.0f} ("
        + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(by_status.items()))
        + ")"
        if by_status
        else "requests: 0"
    ]
    rows = [["MODEL", "STATE", "SLOTS", "QUEUE", "PROMPT TOK", "COMPLETION TOK", "TTFT AVG", "ITL AVG"]]
    prompt = _by(metrics, "edgellm_prompt_tokens_total", "model")
    completion = _by(metrics, "edgellm_completion_tokens_total", "model")
    for m in stats.get("models", {}).get("models", []):
        name = str(m.get("name"))
        rows.append(
            [
                name,
                str(m.get("state")),
                f"{m.get('slots_busy', '-')}/{m.get('slots_total')}",
                f"{m.get('queue_depth', '-')}/{m.get('queue_size')}",
                f"{prompt.get(name, 0):.0f}",
                f"{completion.get(name, 0):.0f}",
                _mean(metrics, "edgellm_time_to_first_token_seconds", name),
                _mean(metrics, "edgellm_inter_token_latency_seconds", name),
            ]
        )
    lines.append(_table(rows))
    limited = _by(metrics, "edgellm_rate_limited_total", "reason")
    rejected = _by(metrics, "edgellm_queue_rejections_total", "model")
    lines.append(
        "rate limited: "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(limited.items()))
        + "; queue rejections: "
        + (", ".join(f"{k} {v:.0f}" for k, v in sorted(rejected.items())) or "0")
    )
    host = stats.get("host", {})
    proc = host.get("process", {})
    shm = host.get("shm") or {}
    pinning = host.get("pinning", {})
    cpu = 100 * float(host.get("cpu_usage_ratio", 0))
    lines.append(
        f"host: cpu {cpu:.0f}%, load {host.get('load1', 0):.2f}, "
        f"memory {_gib(host.get('memory_used_bytes'))}/{_gib(host.get('memory_total_bytes'))} GiB, "
        f"cpus {pinning.get('cpus', host.get('affinity', '-'))}"
        + (" (pinned)" if pinning.get("pinned") else "")
    )
    lines.append(
        f"daemon: rss {_gib(proc.get('rss_bytes'))} GiB, threads {proc.get('threads', '-')}, "
        f"open files {proc.get('open_fds', '-')}, /dev/shm {_gib(shm.get('used_bytes'))}/"
        f"{_gib(shm.get('total_bytes'))} GiB"
    )
    gpu = stats.get("gpu", {})
    if not gpu.get("available"):
        lines.append(f"gpu: none ({gpu.get('reason') or 'NVML unavailable'})")
    for d in gpu.get("devices", []):
        cc = d.get("compute_capability")
        head = f"gpu {d.get('index')}: {d.get('name')}" + (f" (cc {cc[0]}.{cc[1]})" if cc else "")
        if d.get("lost"):
            lines.append(f"{head}: LOST")
            continue
        lines.append(
            f"{head}: memory {_gib(d.get('memory_used'))}/{_gib(d.get('memory_total'))} GiB, "
            f"util {d.get('utilization_gpu', '-')}%, {d.get('temperature_c', '-')} C, "
            f"{d.get('power_w', '-')}/{d.get('power_limit_w', '-')} W"
            + (f", throttled: {', '.join(d['throttle_reasons'])}" if d.get("throttle_reasons") else "")
        )
    lines.extend(f"  {v.get('level')}: {str(v.get('message'))[:MAX_REASON]}" for v in gpu.get("verdicts", []))
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    """Print the daemon's figures."""
    _, answer = AdminClient(args).call("GET", "/admin/stats")
    print(json.dumps(answer, indent=2) if args.json else _terminal(format_stats(answer)))
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Print the daemon's model status."""
    _, answer = AdminClient(args).call("GET", "/admin/status")
    print(json.dumps(answer, indent=2) if args.json else _terminal(format_status(answer)))
    return 0


def run_reload(args: argparse.Namespace) -> int:
    """Reload one or every model and print the outcomes; 1 when any failed."""
    body: dict[str, Any] = {"force": args.force}
    if args.name:
        body["model"] = args.name
    code, answer = AdminClient(args).call("POST", "/admin/reload", body)
    print(json.dumps(answer, indent=2) if args.json else _terminal(format_results(answer)))
    return 0 if code == 200 else 1


def _model_action(action: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        code, answer = AdminClient(args).call("POST", f"/admin/models/{quote(args.name, safe='')}/{action}")
        print(json.dumps(answer, indent=2) if args.json else _terminal(format_results(answer)))
        return 0 if code == 200 else 1

    return run


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        type=http_url,
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"daemon base URL (default: ${URL_ENV} or {DEFAULT_URL})",
    )
    add_key_options(p, what="admin-scope key", file_env=KEY_FILE_ENV, env=KEY_ENV)
    p.add_argument("--cacert", type=Path, help="CA or self-signed certificate to trust for https")
    p.add_argument("--json", action="store_true", help="print the daemon's JSON answer")


def add_parsers(sub: Subcommands) -> None:
    """Register `status`, `stats`, `reload`, `load` and `unload`."""
    p = sub.add_parser("status", help="show each model's state, version and last reload")
    add_daemon_options(p)
    p.set_defaults(func=answer_guarded(run_status))
    p = sub.add_parser("stats", help="show request, model, host and GPU figures")
    add_daemon_options(p)
    p.set_defaults(func=answer_guarded(run_stats))
    p = sub.add_parser(
        "reload",
        help="re-verify the lockfile and swap in changed models",
        description="Re-read and verify the lockfile, then verify, preload, load and "
        "warm up every model whose approved file changed, and swap it in while "
        "requests keep flowing. Exit status 1 when any model failed (it keeps serving "
        "its previous version).",
    )
    p.add_argument("name", nargs="?", help="only this model (default: all)")
    p.add_argument("--force", action="store_true", help="reload even models that look unchanged")
    add_daemon_options(p)
    p.set_defaults(func=answer_guarded(run_reload))
    for action, text in (("load", "load an unloaded model"), ("unload", "stop serving a model")):
        p = sub.add_parser(action, help=text)
        p.add_argument("name", help="model name")
        add_daemon_options(p)
        p.set_defaults(func=answer_guarded(_model_action(action)))
