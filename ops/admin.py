"""`edgellmctl status|reload|load|unload`: the daemon's admin API, as readable tables."""

from __future__ import annotations

import argparse
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

from edgellmctl.cli import CommandError, guarded, http_url

URL_ENV: Final = "EDGELLM_URL"
KEY_ENV: Final = "EDGELLM_ADMIN_KEY"
KEY_FILE_ENV: Final = "EDGELLM_ADMIN_KEY_FILE"
DEFAULT_URL: Final = "http://127.0.0.1:8080"
# A reload verifies, copies and loads models: minutes for large files on slow disks.
TIMEOUT_S: Final = 900.0
MAX_REASON: Final = 200


class _Client:
    """A small JSON client for /admin/* that never prints the key."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.base = args.url.rstrip("/").removesuffix("/v1")
        self._key = _key(args)
        self._context: ssl.SSLContext | None = None
        if args.cacert is not None:
            self._context = ssl.create_default_context(cafile=str(args.cacert))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)  # noqa: S310 - http(s) only (http_url)
        request.add_header("Authorization", f"Bearer {self._key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self._context) as response:  # noqa: S310
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            try:
                payload = json.load(exc)
            except ValueError:
                payload = None
            if exc.code == 409 and isinstance(payload, dict):  # an operation that failed: a result
                return exc.code, payload
            raise CommandError(f"{self.base}{path}: HTTP {exc.code}: {_error_text(payload)}") from None
        except urllib.error.URLError as exc:
            raise CommandError(f"cannot reach {self.base}: {exc.reason}") from None
        except (TimeoutError, ValueError) as exc:
            raise CommandError(f"{self.base}{path}: {str(exc) or 'timed out'}") from None


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", "error"))[:MAX_REASON]
    return "unexpected answer"


def _key(args: argparse.Namespace) -> str:
    path = args.key_file or os.environ.get(KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CommandError(f"cannot read the admin key file {path}: {exc.strerror}") from None
    else:
        key = os.environ.get(KEY_ENV, "").strip()
    if not key:
        raise CommandError(f"no admin key: pass --key-file (e.g. admin.key from quickstart) or set "
                           f"${KEY_ENV}")
    if not (key.isascii() and key.isprintable()):
        raise CommandError("the admin key holds characters an HTTP header cannot carry")
    return key


def _when(stamp: object) -> str:
    if not isinstance(stamp, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


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
        last_text = f"{last.get('result', '-')} ({last.get('trigger', '-')}, {_when(last.get('at'))})" \
            if last else "-"
        state = m.get("state", "?") + ("+reloading" if m.get("reloading") else "")
        slots = f"{m['slots_busy']}/{m['slots_total']}" if "slots_busy" in m else f"-/{m.get('slots_total')}"
        rows.append([str(m.get("name")), state, _short(m.get("version")), _short(m.get("sha256")), slots,
                     _short(m.get("queue_depth")), _when(m.get("loaded_at")), last_text])
        for label, reason in (("not serving", m.get("reason")), ("last reload", last.get("reason"))):
            if reason:
                notes.append(f"  {m.get('name')}: {label}: {str(reason)[:MAX_REASON]}")
    lines.append(_table(rows))
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


def run_status(args: argparse.Namespace) -> int:
    """Print the daemon's model status."""
    _, answer = _Client(args).call("GET", "/admin/status")
    print(json.dumps(answer, indent=2) if args.json else format_status(answer))
    return 0


def run_reload(args: argparse.Namespace) -> int:
    """Reload one or every model and print the outcomes; 1 when any failed."""
    body: dict[str, Any] = {"force": args.force}
    if args.name:
        body["model"] = args.name
    code, answer = _Client(args).call("POST", "/admin/reload", body)
    print(json.dumps(answer, indent=2) if args.json else format_results(answer))
    return 0 if code == 200 else 1


def _model_action(action: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        code, answer = _Client(args).call("POST", f"/admin/models/{quote(args.name, safe='')}/{action}")
        print(json.dumps(answer, indent=2) if args.json else format_results(answer))
        return 0 if code == 200 else 1
    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=http_url, default=os.environ.get(URL_ENV, DEFAULT_URL),
                   help=f"daemon base URL (default: ${URL_ENV} or {DEFAULT_URL})")
    p.add_argument("--key-file", type=Path,
                   help=f"file holding an admin-scope key (default: ${KEY_FILE_ENV}, else ${KEY_ENV})")
    p.add_argument("--cacert", type=Path, help="CA or self-signed certificate to trust for https")
    p.add_argument("--json", action="store_true", help="print the daemon's JSON answer")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `status`, `reload`, `load` and `unload`."""
    p = sub.add_parser("status", help="show each model's state, version and last reload")
    _common(p)
    p.set_defaults(func=guarded(run_status))
    p = sub.add_parser("reload", help="re-verify the lockfile and swap in changed models",
                       description="Re-read and verify the lockfile, then verify, preload, load and "
                       "warm up every model whose approved file changed, and swap it in while "
                       "requests keep flowing. Exit status 1 when any model failed (it keeps serving "
                       "its previous version).")
    p.add_argument("name", nargs="?", help="only this model (default: all)")
    p.add_argument("--force", action="store_true", help="reload even models that look unchanged")
    _common(p)
    p.set_defaults(func=guarded(run_reload))
    for action, text in (("load", "load an unloaded model"), ("unload", "stop serving a model")):
        p = sub.add_parser(action, help=text)
        p.add_argument("name", help="model name")
        _common(p)
        p.set_defaults(func=guarded(_model_action(action)))

