"""`edgellmctl keys create|list|revoke|quota`: API keys in the daemon's keys file (hashed, mode 0600)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from edgellmctl.cli import CommandError, Subcommands, guarded, int_between, positive_int
from edgellmctl.lock import parse_duration
from edgellmd.errors import escaped
from edgellmd.keys import (
    MAX_LIMIT,
    MAX_NAME,
    MAX_WEIGHT,
    OVER_LIMIT_POLICIES,
    PRIORITIES,
    QUOTA_KEYS,
    SCOPES,
    KeysFileError,
    NoSuchKey,
    append_key,
    load_keys_document,
    read_keys_file,
    save_keys_document,
    set_key_disabled,
)

DEFAULT_KEYS: Final = Path("keys.yaml")


def create_key(
    path: Path,
    name: str,
    scopes: list[str],
    *,
    limits: dict[str, int],
    expires_in: str | None = None,
    cache_group: str | None = None,
    weight: int | None = None,
    priority: str | None = None,
    quota: dict[str, int] | None = None,
    max_tokens_over_limit: str | None = None,
) -> tuple[str, str]:
    """Append a new key to the keys file; returns (key id, token). The token is not stored."""
    expires = datetime.now(UTC).replace(microsecond=0) + parse_duration(expires_in) if expires_in else None
    return append_key(
        path,
        name,
        scopes,
        limits=limits,
        expires=expires,
        cache_group=cache_group,
        weight=weight,
        priority=priority,
        quota=quota,
        max_tokens_over_limit=max_tokens_over_limit,
    )


def _budget(value: str) -> tuple[str, int | None]:
    """BUDGET=N for --quota and `keys quota` (N: a whole number, or none to remove the budget)."""
    name, _, amount = value.partition("=")
    if name not in QUOTA_KEYS or not amount:
        raise argparse.ArgumentTypeError(f"write BUDGET=N with BUDGET one of {', '.join(QUOTA_KEYS)}")
    if amount.lower() == "none":
        return name, None
    return name, positive_int(amount)


def cmd_quota(args: argparse.Namespace) -> int:
    """Set or remove a key's day and month budgets; the daemon applies them at its next poll."""
    data = load_keys_document(args.file)
    for entry in data["keys"]:
        if entry.get("id") == args.id:
            quota = dict(entry.get("quota") or {})
            for name, amount in args.budget:
                if amount is None:
                    quota.pop(name, None)
                else:
                    quota[name] = amount
            if quota:
                entry["quota"] = quota
            else:
                entry.pop("quota", None)
            save_keys_document(args.file, data)
            shown = " ".join(f"{k}={v}" for k, v in sorted(quota.items())) or "none"
            print(f"key {args.id} ({escaped(str(entry.get('name')))}): quota {shown}")
            return 0
    raise CommandError(f"no key with id {args.id!r} in {args.file}")


def add_scopes(path: Path, key_id: str, scopes: list[str]) -> bool:
    """Give key `key_id` the `scopes` it lacks; True when the keys file changed."""
    data = load_keys_document(path)
    for entry in data["keys"]:
        if entry.get("id") == key_id:
            missing = sorted(set(scopes) - set(entry["scopes"]))
            if not missing:
                return False
            entry["scopes"] = sorted({*entry["scopes"], *missing})
            save_keys_document(path, data)
            return True
    raise CommandError(f"no key with id {key_id!r} in {path}")


def cmd_create(args: argparse.Namespace) -> int:
    """Print the new token once (stdout only), append its hash to the keys file."""
    limits = {
        k: v
        for k, v in (
            ("rpm", args.rpm),
            ("tpm", args.tpm),
            ("concurrent", args.concurrent),
            ("max_tokens", args.max_tokens),
        )
        if v is not None
    }
    key_id, token = create_key(
        args.file,
        args.name,
        args.scope,
        limits=limits,
        expires_in=args.expires,
        cache_group=args.cache_group,
        weight=args.weight,
        priority=args.priority,
        quota={name: amount for name, amount in args.quota or [] if amount is not None} or None,
        max_tokens_over_limit=args.max_tokens_over_limit,
    )
    print(token)
    print(
        f"key {key_id} ({args.name}, scopes {', '.join(sorted(set(args.scope)))}) added to "
        f"{args.file}; the token above is shown once and stored nowhere",
        file=sys.stderr,
    )
    return 0


limit_int = int_between(1, MAX_LIMIT)


def _key_name(value: str) -> str:
    """argparse type: a key's name as the console takes it (no line break or terminal escape
    to print into `keys list` or a log)."""
    if not 1 <= len(value) <= MAX_NAME or not value.isprintable():
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_NAME} printable characters")
    return value


def cmd_list(args: argparse.Namespace) -> int:
    """One line per key; never secrets or hashes."""
    keys = read_keys_file(args.file)
    now = datetime.now(UTC)
    print(f"{'ID':<12}  {'NAME':<20}  {'SCOPES':<26}  {'STATE':<8}  {'EXPIRES':<20}  LIMITS")
    for key in keys.values():
        state = key.usable(now) or "active"
        expires = key.expires.strftime("%Y-%m-%dT%H:%M:%SZ") if key.expires else "-"
        limits = (
            " ".join(
                f"{k}={getattr(key.limits, k)}"
                for k in ("rpm", "tpm", "concurrent", "max_tokens")
                if getattr(key.limits, k) is not None
            )
            or "-"
        )
        print(
            f"{key.id:<12}  {escaped(key.name)[:20]:<20}  {','.join(sorted(key.scopes)):<26}  {state:<8}  "
            f"{expires:<20}  {limits}"
        )
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    """Disable a key (kept for the audit trail); the daemon stops accepting it on its next poll."""
    try:
        entry = set_key_disabled(args.file, args.id, disabled=True)
    except NoSuchKey as exc:
        raise CommandError(str(exc)) from None
    print(f"key {args.id} ({escaped(str(entry.get('name')))}) revoked")
    return 0


def _weight(value: str) -> int:
    weight = positive_int(value)
    if weight > MAX_WEIGHT:
        raise argparse.ArgumentTypeError(f"at most {MAX_WEIGHT}")
    return weight


def add_parser(sub: Subcommands) -> None:
    """Register `keys`."""
    keys = sub.add_parser("keys", help="manage API keys")
    verbs = keys.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help_: str) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help_)
        p.add_argument("--file", type=Path, default=DEFAULT_KEYS, help="keys file (default: keys.yaml)")
        return p

    create = verb("create", "make a key; prints its token once")
    create.add_argument("--name", required=True, type=_key_name, help="who the key is for")
    create.add_argument(
        "--scope",
        action="append",
        choices=SCOPES,
        required=True,
        help="inference, admin or metrics (repeatable)",
    )
    create.add_argument("--rpm", type=limit_int, help="requests per minute")
    create.add_argument("--tpm", type=limit_int, help="tokens (prompt + completion) per minute")
    create.add_argument("--concurrent", type=limit_int, help="requests in flight at once")
    create.add_argument("--max-tokens", type=limit_int, help="ceiling on max_tokens")
    create.add_argument(
        "--max-tokens-over-limit",
        choices=list(OVER_LIMIT_POLICIES),
        help="a max_tokens past the ceiling: refuse (400) or clamp it (default: the server's policy)",
    )
    create.add_argument("--expires", help="validity from now: 90d, 12h, 2w (default: never)")
    create.add_argument(
        "--cache-group",
        help="share cached prompt state with the other keys of this group (default: the key's own)",
    )
    create.add_argument(
        "--weight",
        type=_weight,
        help=f"its share of slots and prefill against other keys' (1 to {MAX_WEIGHT}; default 1)",
    )
    create.add_argument(
        "--priority",
        choices=list(PRIORITIES),
        help="its requests' highest class (default normal); interactive goes before batch",
    )
    create.add_argument(
        "--quota",
        action="append",
        type=_budget,
        metavar="BUDGET=N",
        help=f"a day or month budget, repeatable: {', '.join(QUOTA_KEYS)} (calendar, ledger.time_zone)",
    )
    create.set_defaults(func=guarded(cmd_create, KeysFileError))
    verb("list", "list keys (never secrets)").set_defaults(func=guarded(cmd_list, KeysFileError))
    revoke = verb("revoke", "disable a key")
    revoke.add_argument("id", help="the key id (the 12 hex digits after elk_)")
    revoke.set_defaults(func=guarded(cmd_revoke, KeysFileError))
    quota = verb("quota", "set or remove a key's day and month budgets")
    quota.add_argument("id", help="the key id")
    quota.add_argument(
        "budget", nargs="+", type=_budget, metavar="BUDGET=N", help="N, or none to remove that budget"
    )
    quota.set_defaults(func=guarded(cmd_quota, KeysFileError))


__all__ = ["add_parser", "add_scopes", "create_key"]
