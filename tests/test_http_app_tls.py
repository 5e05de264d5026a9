"""Optional TLS: quickstart's self-signed pair, HTTPS with the real openai client, no plaintext."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from edgellmctl.quickstart import write_self_signed
from edgellmd.settings import parse_settings
from tests.serving import RunningDaemon, small_tiny


@pytest.fixture(scope="module")
def tls_daemon(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningDaemon, Path]]:
    root = tmp_path_factory.mktemp("tls")
    cert, key = write_self_signed(root / "tls", "127.0.0.1")
    settings = parse_settings(
        {
            "server": {"tls_cert": str(cert), "tls_key": str(key)},
            "models": [small_tiny(models_dir)],
            "lock": {"allow_unsigned": True},
        },
        base_dir=root,
    )
    daemon = RunningDaemon(settings).start(wait_ready=False)
    context = ssl.create_default_context(cafile=str(cert))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{daemon.port}/readyz", context=context, timeout=5
            ) as resp:
                if resp.status == 200:
                    break
        except OSError:
            time.sleep(0.05)
    try:
        yield daemon, cert
    finally:
        daemon.stop()


def test_self_signed_pair(tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path, "edge-box.lan")
    assert key.stat().st_mode & 0o777 == 0o600
    assert b"BEGIN CERTIFICATE" in cert.read_bytes()
    from cryptography import x509  # noqa: PLC0415

    names = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert "edge-box.lan" in names.get_values_for_type(x509.DNSName)
    assert "localhost" in names.get_values_for_type(x509.DNSName)


def test_the_openai_client_over_https(tls_daemon: tuple[RunningDaemon, Path]) -> None:
    daemon, cert = tls_daemon
    # The openai client's own HTTP client, told to trust the self-signed certificate.
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))) as http:
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{daemon.port}/v1", api_key="unused", http_client=http, max_retries=0
        )
        reply = client.completions.create(
            model="tiny", prompt="secure", max_tokens=3, extra_body={"ignore_eos": True}
        )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3


def test_an_unverified_certificate_is_refused_by_a_careful_client(
    tls_daemon: tuple[RunningDaemon, Path],
) -> None:
    daemon, _ = tls_daemon
    with (
        socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ssl.create_default_context().wrap_socket(raw, server_hostname="127.0.0.1")


def test_plaintext_http_gets_no_answer(tls_daemon: tuple[RunningDaemon, Path]) -> None:
    daemon, _ = tls_daemon
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert b"200 OK" not in answer
