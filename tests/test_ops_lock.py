"""`edgellmctl keygen` and `lock add|remove|sign|verify|show` on real keys, files and tiny GGUF models."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgellmctl.__main__ import main
from edgellmd.models.lockfile import load_lock, load_private_key, load_public_key, sign, verify_lock
from tests.ggufmodels import TinyModelSpec, write_tiny_model

_RFC3339_Z = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")


# ---- helpers --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    """Exit status and captured output of one `edgellmctl` run."""

    status: int
    out: str
    err: str


@dataclass(frozen=True, slots=True)
class KeyPair:
    """Files written by `edgellmctl keygen` and the key id it printed."""

    pem: Path
    pub: Path
    key_id: str


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> Result:
    """Run edgellmctl with `argv` and return its status and what it printed."""
    capsys.readouterr()  # drop output of earlier steps
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return Result(status, captured.out, captured.err)


def raw_key_id(pub: Path) -> str:
    """Hex sha256 of the raw public key in a PEM file, computed independently of edgellmd."""
    key = serialization.load_pem_public_key(pub.read_bytes())
    assert isinstance(key, Ed25519PublicKey)
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def keygen(capsys: pytest.CaptureFixture[str], out: Path, name: str = "signing") -> KeyPair:
    """Make a key pair through the CLI."""
    result = run(capsys, "keygen", "--out", out, "--name", name)
    assert result.status == 0, result.err
    match = re.search(r"^key id\s+([0-9a-f]{64})$", result.out, re.MULTILINE)
    assert match, result.out
    return KeyPair(out / f"{name}.pem", out / f"{name}.pub", match.group(1))


def read_json(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


def parse_time(text: str) -> datetime:
    assert _RFC3339_Z.fullmatch(text), text
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def lines_of(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Bytes of two distinct tiny GGUF models, written once per module."""
    root = tmp_path_factory.mktemp("pristine")
    return {
        name: write_tiny_model(root / name, TinyModelSpec(seed=seed)).read_bytes()
        for name, seed in (("tiny.gguf", 1), ("tiny-b.gguf", 2))
    }


@pytest.fixture
def models(tmp_path: Path, pristine: dict[str, bytes]) -> Path:
    """A models directory of this test's own (tests flip and truncate its files)."""
    root = tmp_path / "models"
    root.mkdir()
    for name, data in pristine.items():
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> KeyPair:
    return keygen(capsys, tmp_path / "keys")


@pytest.fixture
def key2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> KeyPair:
    return keygen(capsys, tmp_path / "keys", "second")


@pytest.fixture
def lock(models: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """An unsigned lock of `tiny` and `tiny-b` beside the models."""
    path = models / "models.lock"
    for name, file in (("tiny", "tiny.gguf"), ("tiny-b", "tiny-b.gguf")):
        assert run(capsys, "lock", "add", name, models / file, "--lock", path).status == 0
    return path


@pytest.fixture
def signed(lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]) -> Path:
    """`lock`, signed by `key` (version 1)."""
    result = run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem)
    assert result.status == 0, result.err
    return lock


# ---- keygen ---------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_0600_and_prints_the_key_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "keys"
    result = run(capsys, "keygen", "--out", out)
    assert result.status == 0
    pem, pub = out / "signing.pem", out / "signing.pub"
    assert pem.stat().st_mode & 0o777 == 0o600
    assert pem.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert f"key id       {raw_key_id(pub)}\n" in result.out
    assert str(pem) in result.out
    # The public key is the private key's.
    private = serialization.load_pem_private_key(pem.read_bytes(), password=None)
    assert isinstance(private, Ed25519PrivateKey)
    assert (
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        == pub.read_bytes()
    )


def test_keygen_never_overwrites_a_signing_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = keygen(capsys, tmp_path)
    pem_before, pub_before = first.pem.read_bytes(), first.pub.read_bytes()
    result = run(capsys, "keygen", "--out", tmp_path)
    assert result.status == 1
    assert "signing.pem exists; refusing to overwrite" in result.err
    assert "Traceback" not in result.err
    assert result.out == ""
    assert first.pem.read_bytes() == pem_before
    assert first.pub.read_bytes() == pub_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["signing.pem", "signing.pub"]


def test_keygen_name_makes_a_second_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = keygen(capsys, tmp_path)
    other = keygen(capsys, tmp_path, "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.pem",
        "other.pub",
        "signing.pem",
        "signing.pub",
    ]
    assert other.pem.stat().st_mode & 0o777 == 0o600
    assert other.key_id == raw_key_id(other.pub)
    assert first.key_id == raw_key_id(first.pub)
    assert other.key_id != first.key_id


# ---- lock add -------------------------------------------------------------------------------


def test_add_creates_the_lock_and_records_the_file(
    models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    lock = models / "models.lock"
    result = run(capsys, "lock", "add", "tiny", models / "tiny.gguf", "--lock", lock, "--models-dir", models)
    assert result.status == 0, result.err
    data = pristine["tiny.gguf"]
    digest = hashlib.sha256(data).hexdigest()
    assert read_json(lock) == {
        "schema": 1,
        "version": 0,
        "signatures": [],
        "models": {
            "tiny": {
                "file": "tiny.gguf",
                "size": len(data),
                "sha256": digest,
                "gguf": {"architecture": "llama", "file_type": "ALL_F32"},
            }
        },
    }
    assert result.out == f"tiny: tiny.gguf {len(data)} bytes sha256 {digest} (llama, ALL_F32)\n"
    assert result.err == ""
    # What the CLI wrote, the daemon's parser reads.
    assert load_lock(lock).models["tiny"].sha256 == digest


def test_add_a_second_model_keeps_the_first(lock: Path, pristine: dict[str, bytes]) -> None:
    entries = read_json(lock)["models"]
    assert sorted(entries) == ["tiny", "tiny-b"]
    assert entries["tiny-b"]["sha256"] == hashlib.sha256(pristine["tiny-b.gguf"]).hexdigest()
    assert entries["tiny"]["sha256"] == hashlib.sha256(pristine["tiny.gguf"]).hexdigest()
    assert entries["tiny"]["sha256"] != entries["tiny-b"]["sha256"]


def test_add_records_a_subdirectory_file_as_a_posix_path(
    tmp_path: Path, models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    sub = models / "sub"
    sub.mkdir()
    (sub / "x.gguf").write_bytes(pristine["tiny.gguf"])
    lock = tmp_path / "elsewhere" / "models.lock"  # lock outside D: paths are relative to D anyway
    result = run(capsys, "lock", "add", "x", sub / "x.gguf", "--lock", lock, "--models-dir", models)
    assert result.status == 0, result.err
    assert read_json(lock)["models"]["x"]["file"] == "sub/x.gguf"
    result = run(capsys, "lock", "verify", "--lock", lock, "--models-dir", models)
    assert result.status == 1, result.out  # unsigned, and no trusted key: only the files are checked
    assert lines_of(result.out, "x ")[0].startswith("x         ok: sub/x.gguf ")


def test_add_refuses_a_file_outside_the_models_dir(
    tmp_path: Path, models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(pristine["tiny.gguf"])
    lock = models / "models.lock"
    result = run(capsys, "lock", "add", "tiny", outside, "--lock", lock, "--models-dir", models)
    assert result.status == 1
    assert "is not inside the models directory" in result.err
    assert "Traceback" not in result.err
    assert not lock.exists()


@pytest.mark.parametrize(
    "content",
    [
        random.Random(7).randbytes(4096),
        b"hello, this is a text file and not a model\n" * 20,
        b"GG",
    ],
    ids=["random-bytes", "text", "two-bytes"],
)
def test_add_refuses_a_file_that_is_not_gguf(
    models: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    bogus = models / "bogus.gguf"
    bogus.write_bytes(content)
    lock = models / "models.lock"
    result = run(capsys, "lock", "add", "bogus", bogus, "--lock", lock)
    assert result.status == 1
    assert "not a GGUF" in result.err
    assert "Traceback" not in result.err
    assert not lock.exists()


def test_add_a_non_gguf_file_leaves_an_existing_lock_alone(
    lock: Path, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = lock.read_bytes()
    bogus = models / "notes.txt"
    bogus.write_text("not a model\n")
    result = run(capsys, "lock", "add", "tiny", bogus, "--lock", lock)
    assert result.status == 1
    assert "not a GGUF" in result.err
    assert lock.read_bytes() == before


def test_add_to_a_signed_lock_drops_the_signatures_and_says_so(
    signed: Path, models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    assert len(read_json(signed)["signatures"]) == 1
    (models / "c.gguf").write_bytes(pristine["tiny.gguf"])
    result = run(capsys, "lock", "add", "c", models / "c.gguf", "--lock", signed)
    assert result.status == 0
    assert "removed 1 signature(s): the lock changed; sign it again" in result.err
    document = read_json(signed)
    assert document["signatures"] == []
    assert sorted(document["models"]) == ["c", "tiny", "tiny-b"]
    assert document["version"] == 1  # add does not bump; sign does


def test_add_replaces_an_entry_of_the_same_name(
    lock: Path, models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "lock", "add", "tiny", models / "tiny-b.gguf", "--lock", lock)
    assert result.status == 0
    entry = read_json(lock)["models"]["tiny"]
    assert entry["file"] == "tiny-b.gguf"
    assert entry["sha256"] == hashlib.sha256(pristine["tiny-b.gguf"]).hexdigest()


@pytest.mark.parametrize(
    "name", ["bad name", "../escape", ".hidden", "x" * 65], ids=["space", "dotdot", "leading-dot", "65-chars"]
)
def test_add_refuses_a_model_name_the_lockfile_cannot_hold(
    lock: Path, models: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    # The daemon's parser refuses such names ("models.NAME: model names are 1-64 of ..."), so a
    # lock holding one is unreadable by every later command: add must refuse it up front.
    before = lock.read_bytes()
    result = run(capsys, "lock", "add", name, models / "tiny.gguf", "--lock", lock)
    assert result.status == 1
    assert "model names are" in result.err
    assert lock.read_bytes() == before
    assert run(capsys, "lock", "show", "--lock", lock).status == 0


# ---- lock remove ----------------------------------------------------------------------------


def test_remove_drops_the_model_and_the_signatures(signed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, "lock", "remove", "tiny", "--lock", signed)
    assert result.status == 0
    assert "removed tiny" in result.out
    document = read_json(signed)
    assert sorted(document["models"]) == ["tiny-b"]
    assert document["signatures"] == []


def test_remove_an_unknown_name_fails(lock: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = lock.read_bytes()
    result = run(capsys, "lock", "remove", "nope", "--lock", lock)
    assert result.status == 1
    assert "'nope' is not in" in result.err
    assert lock.read_bytes() == before


# ---- lock sign ------------------------------------------------------------------------------


def test_sign_bumps_the_version_and_sets_issued_and_expires(
    lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    assert read_json(lock)["version"] == 0
    result = run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem)
    assert result.status == 0, result.err
    document = read_json(lock)
    assert document["version"] == 1
    issued, expires = parse_time(document["issued"]), parse_time(document["expires"])
    assert abs(datetime.now(UTC) - issued) < timedelta(minutes=1)
    assert expires - issued == timedelta(days=365)  # the default validity
    assert len(document["signatures"]) == 1
    signature = document["signatures"][0]
    assert signature["key_id"] == key.key_id == raw_key_id(key.pub)
    assert signature["alg"] == "ed25519"
    assert f"version 1 (expires {document['expires']})" in result.out
    assert verify_lock(load_lock(lock), [load_public_key(key.pub)]) == key.key_id


def test_sign_again_bumps_again(signed: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "lock", "sign", "--lock", signed, "--key", key.pem).status == 0
    document = read_json(signed)
    assert document["version"] == 2
    assert len(document["signatures"]) == 1


def test_sign_expires_in_two_weeks(lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem, "--expires", "2w").status == 0
    document = read_json(lock)
    assert parse_time(document["expires"]) - parse_time(document["issued"]) == timedelta(days=14)


def test_sign_sets_an_explicit_version(lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem, "--version", "7").status == 0
    assert read_json(lock)["version"] == 7
    assert run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem).status == 0
    assert read_json(lock)["version"] == 8


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--expires", "5x"], "--expires must look like 365d, 12h or 2w, got '5x'"),
        (["--expires", "0d"], "--expires must look like"),
        (["--version", "-1"], "--version must be >= 0"),
        # Past year 9999 (datetime's limit) and past timedelta's limit: the CLI must say what is
        # wrong with --expires, not die with an OverflowError traceback.
        (["--expires", "3000000d"], "--expires"),
        (["--expires", "1000000000d"], "--expires"),
    ],
    ids=["5x", "0d", "version-negative", "past-year-9999", "past-timedelta-max"],
)
def test_sign_refuses_bad_options(
    lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str], option: list[str], message: str
) -> None:
    before = lock.read_bytes()
    result = run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem, *option)
    assert result.status == 1
    assert message in result.err
    assert lock.read_bytes() == before


def test_cosign_adds_a_second_signature_and_changes_nothing_else(
    signed: Path, key: KeyPair, key2: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    before = read_json(signed)
    result = run(capsys, "lock", "sign", "--lock", signed, "--key", key2.pem, "--cosign")
    assert result.status == 0, result.err
    after = read_json(signed)
    for member in ("version", "issued", "expires", "models", "schema"):
        assert after[member] == before[member], member
    assert after["signatures"][0] == before["signatures"][0]
    assert [s["key_id"] for s in after["signatures"]] == [key.key_id, key2.key_id]
    parsed = load_lock(signed)
    assert verify_lock(parsed, [load_public_key(key2.pub)]) == key2.key_id
    assert verify_lock(parsed, [load_public_key(key.pub)]) == key.key_id


def test_cosign_with_the_same_key_replaces_its_signature(
    signed: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "lock", "sign", "--lock", signed, "--key", key.pem, "--cosign").status == 0
    assert [s["key_id"] for s in read_json(signed)["signatures"]] == [key.key_id]


def test_cosign_needs_a_signed_lock(lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    before = lock.read_bytes()
    result = run(capsys, "lock", "sign", "--lock", lock, "--key", key.pem, "--cosign")
    assert result.status == 1
    assert "--cosign needs a lock that is already signed" in result.err
    assert lock.read_bytes() == before


def test_cosign_refuses_version_and_expires(
    signed: Path, key2: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    before = signed.read_bytes()
    result = run(capsys, "lock", "sign", "--lock", signed, "--key", key2.pem, "--cosign", "--expires", "2w")
    assert result.status == 1
    assert "no --version or --expires" in result.err
    assert signed.read_bytes() == before


@pytest.mark.parametrize("kind", ["public-key", "garbage", "missing"])
def test_sign_with_something_that_is_not_a_signing_key(
    tmp_path: Path, lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    bad = {"public-key": key.pub, "garbage": tmp_path / "garbage.pem", "missing": tmp_path / "missing.pem"}[
        kind
    ]
    if kind == "garbage":
        bad.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64 at all!\n-----END PRIVATE KEY-----\n")
    before = lock.read_bytes()
    result = run(capsys, "lock", "sign", "--lock", lock, "--key", bad)
    assert result.status == 1
    assert result.err.startswith("edgellmctl lock: ")
    assert str(bad) in result.err
    expected = "cannot read signing key" if kind == "missing" else "is not an unencrypted PEM private key"
    assert expected in result.err
    assert "Traceback" not in result.err
    assert lock.read_bytes() == before


# ---- lock verify ----------------------------------------------------------------------------


def test_verify_a_good_lock(
    signed: Path, models: Path, key: KeyPair, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "lock", "verify", "--lock", signed, "--models-dir", models, "--trusted", key.pub)
    assert result.status == 0, result.out
    lines = result.out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"lock      version 1: signature by {key.key_id[:16]}… verifies; expires ")
    size, size_b = len(pristine["tiny.gguf"]), len(pristine["tiny-b.gguf"])
    assert lines[1].startswith(f"tiny      ok: tiny.gguf {size} bytes sha256 ")
    assert lines[2].startswith(f"tiny-b    ok: tiny-b.gguf {size_b} bytes sha256 ")
    assert "FAILED" not in result.out


def test_verify_trusts_any_of_several_keys(
    signed: Path, key: KeyPair, key2: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key2.pub, key.pub)
    assert result.status == 0, result.out
    assert f"signature by {key.key_id[:16]}… verifies" in result.out


def test_verify_a_flipped_byte(
    signed: Path, models: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    model = models / "tiny.gguf"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01  # a weight, not the header: only the hash can notice
    model.write_bytes(bytes(data))
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
    assert result.status == 1
    assert lines_of(result.out, "tiny ")[0].startswith("tiny      FAILED: tiny.gguf has sha256 ")
    assert lines_of(result.out, "tiny-b ")[0].startswith("tiny-b    ok: ")
    assert "verifies" in lines_of(result.out, "lock ")[0]


def test_verify_a_truncated_file(
    signed: Path, models: Path, key: KeyPair, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    size = len(pristine["tiny-b.gguf"])
    with (models / "tiny-b.gguf").open("r+b") as fh:
        fh.truncate(size - 100)
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
    assert result.status == 1
    assert (
        f"tiny-b    FAILED: tiny-b.gguf is {size - 100} bytes; the lockfile says {size}"
        in result.out.splitlines()
    )
    assert lines_of(result.out, "tiny ")[0].startswith("tiny      ok: ")


def test_verify_a_missing_file(
    signed: Path, models: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    (models / "tiny.gguf").unlink()
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
    assert result.status == 1
    assert "tiny      FAILED: cannot open tiny.gguf: No such file or directory" in result.out.splitlines()


def test_verify_a_lock_edited_after_signing(
    signed: Path, key: KeyPair, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    document = read_json(signed)
    size = document["models"]["tiny"]["size"]
    document["models"]["tiny"]["size"] = size + 1
    signed.write_text(json.dumps(document, indent=2))
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
    assert result.status == 1
    lines = result.out.splitlines()
    assert "lock      FAILED: the lockfile's signature does not verify: it was changed after signing" in lines
    assert f"tiny      FAILED: tiny.gguf is {size} bytes; the lockfile says {size + 1}" in lines


def test_verify_a_version_edited_after_signing(
    signed: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    # An edit that leaves every file matching: only the signature can catch it.
    document = read_json(signed)
    document["version"] = 99
    signed.write_text(json.dumps(document))
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
    assert result.status == 1
    assert lines_of(result.out, "lock ")[0].startswith("lock      FAILED: the lockfile's signature does not")
    assert len(lines_of(result.out, "tiny")) == 2
    assert all(" ok: " in line for line in lines_of(result.out, "tiny"))


def test_verify_with_an_untrusted_key(
    signed: Path, key: KeyPair, key2: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key2.pub)
    assert result.status == 1
    assert (
        f"lock      FAILED: the lockfile is signed only by untrusted keys ({key.key_id[:16]})"
        in result.out.splitlines()
    )


def test_verify_an_unsigned_lock_with_a_trusted_key(
    lock: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "lock", "verify", "--lock", lock, "--trusted", key.pub)
    assert result.status == 1
    assert "lock      FAILED: the lockfile is not signed" in result.out.splitlines()


def test_verify_an_expired_lock(signed: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    # Sign a lock whose expiry is already past, using the library's own signer.
    from edgellmd.models.lockfile import load_private_key, sign  # noqa: PLC0415 - only this test signs by hand

    document = read_json(signed)
    document["expires"] = "2020-01-01T00:00:00Z"
    document["signatures"] = [sign(document, load_private_key(key.pem))]
    signed.write_text(json.dumps(document))
    result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
    assert result.status == 1
    assert "lock      FAILED: the lockfile expired at 2020-01-01T00:00:00Z" in result.out.splitlines()


NO_SIGNATURE = (
    "lock      version 1: FAILED: no signature verified: no trusted key given "
    "(--trusted PUBKEY, or --config FILE for the daemon's own)"
)


def test_verify_without_trusted_keys_says_no_signature_verified_and_still_checks_files(
    signed: Path, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(capsys, "lock", "verify", "--lock", signed)
    assert result.status == 1  # every file matches, but nothing vouches for the lock itself
    lines = result.out.splitlines()
    assert lines[0] == NO_SIGNATURE
    assert len(lines_of(result.out, "tiny")) == 2
    assert all(" ok: " in line for line in lines_of(result.out, "tiny"))
    model = models / "tiny.gguf"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    result = run(capsys, "lock", "verify", "--lock", signed)
    assert result.status == 1
    assert result.out.splitlines()[0] == NO_SIGNATURE
    assert lines_of(result.out, "tiny ")[0].startswith("tiny      FAILED: tiny.gguf has sha256 ")


def test_verify_with_models_elsewhere(
    tmp_path: Path, signed: Path, models: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "moved.lock"
    shutil.copy(signed, moved)
    result = run(capsys, "lock", "verify", "--lock", moved, "--trusted", key.pub)
    assert result.status == 1  # the lock's folder holds no models
    assert "tiny      FAILED: cannot open tiny.gguf" in result.out
    result = run(capsys, "lock", "verify", "--lock", moved, "--trusted", key.pub, "--models-dir", models)
    assert result.status == 0, result.out


# ---- lock verify --config -------------------------------------------------------------------


def _config(tmp_path: Path, lock: Path, models: Path, trusted: list[Path], **extra: Any) -> Path:
    """A daemon config serving `tiny` and `tiny-b` from `lock`, trusting `trusted`."""
    document: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 8080},
        "lock": {
            "file": str(lock),
            "trusted_keys": [str(p) for p in trusted],
            "models_dir": str(models),
            "state_dir": str(tmp_path / "state"),
        },
        "models": [{"name": "tiny"}, {"name": "tiny-b"}],
        **extra,
    }
    path = tmp_path / "edgellm.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def test_verify_with_the_config_takes_the_lock_keys_and_models_dir_from_it(
    tmp_path: Path,
    signed: Path,
    models: Path,
    key: KeyPair,
    key2: KeyPair,
    capsys: pytest.CaptureFixture[str],
) -> None:
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    moved = elsewhere / "models.lock"  # not beside the models: only the config says where they are
    shutil.copy(signed, moved)
    config = _config(elsewhere, moved, models, [key2.pub, key.pub])
    result = run(capsys, "lock", "verify", "--config", config)
    assert result.status == 0, result.out + result.err
    lines = result.out.splitlines()
    assert lines[0].startswith(f"lock      version 1: signature by {key.key_id[:16]}… verifies; expires ")
    assert [line.split()[:2] for line in lines[1:]] == [["tiny", "ok:"], ["tiny-b", "ok:"]]
    # Trusting only the other key, the same lock fails as the daemon would refuse it.
    result = run(capsys, "lock", "verify", "--config", _config(elsewhere, moved, models, [key2.pub]))
    assert result.status == 1
    assert lines_of(result.out, "lock ")[0].startswith("lock      FAILED: the lockfile is signed only by ")


def test_verify_with_the_config_refuses_a_rolled_back_version(
    tmp_path: Path, signed: Path, models: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, signed, models, [key.pub])
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "lock-state.json").write_text(json.dumps({"highest_version": 3}))
    result = run(capsys, "lock", "verify", "--config", config)
    assert result.status == 1
    assert (
        "lock      FAILED: lockfile version 1 is lower than version 3 accepted before (rollback refused)"
        in result.out.splitlines()
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("server: [\n", "YAML syntax error"),
        ("server: {}\nmodels: []\nlock: {allow_unsigned: true}\n", "models"),
        (
            "server: {}\nmodels: [{name: m, file: /m.gguf}]\nlock: {allow_unsigned: true}\n",
            "lock.allow_unsigned: it names no lockfile to verify",
        ),
    ],
)
def test_verify_with_an_unusable_config_is_one_line(
    content: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "edgellm.yaml"
    config.write_text(content, encoding="utf-8")
    result = run(capsys, "lock", "verify", "--config", config)
    assert result.status == 1
    assert result.out == ""
    assert result.err.startswith(f"edgellmctl lock: {config}")
    assert problem in result.err
    assert result.err.count("\n") == 1, result.err


def test_verify_refuses_a_config_that_is_a_fifo_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "edgellm.yaml"
    os.mkfifo(config)
    result = run(capsys, "lock", "verify", "--config", config)
    assert result.status == 1
    assert result.err == f"edgellmctl lock: --config: {config} is a FIFO, not a regular file\n"


@pytest.mark.parametrize("extra", [["--lock", "models.lock"], ["--trusted", "k.pub"], ["--models-dir", "m"]])
def test_verify_config_names_the_lock_keys_and_models_dir_alone(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["lock", "verify", "--config", "edgellm.yaml", *extra])
    assert excinfo.value.code == 2
    assert "not with --lock, --trusted or --models-dir" in capsys.readouterr().err


# ---- lock show ------------------------------------------------------------------------------


def test_show_prints_version_signers_and_a_row_per_model(
    signed: Path, key: KeyPair, key2: KeyPair, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "lock", "sign", "--lock", signed, "--key", key2.pem, "--cosign").status == 0
    document = read_json(signed)
    result = run(capsys, "lock", "show", "--lock", signed)
    assert result.status == 0
    lines = result.out.splitlines()
    assert lines[0] == (
        f"version 1  issued {document['issued']}  expires {document['expires']}  signatures 2"
    )
    assert lines[1] == f"  signed by {key.key_id}"
    assert lines[2] == f"  signed by {key2.key_id}"
    assert lines[3].split() == ["NAME", "FILE", "SIZE", "SHA256", "GGUF"]
    rows = [line.split() for line in lines[4:]]
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in pristine.items()}
    assert rows == [
        [
            "tiny",
            "tiny.gguf",
            str(len(pristine["tiny.gguf"])),
            sha["tiny.gguf"][:16] + "…",
            "architecture=llama",
            "file_type=ALL_F32",
        ],
        [
            "tiny-b",
            "tiny-b.gguf",
            str(len(pristine["tiny-b.gguf"])),
            sha["tiny-b.gguf"][:16] + "…",
            "architecture=llama",
            "file_type=ALL_F32",
        ],
    ]


def test_show_an_unsigned_lock(lock: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, "lock", "show", "--lock", lock)
    assert result.status == 0
    assert result.out.splitlines()[0] == "version 0  issued -  expires -  signatures 0"
    assert "signed by" not in result.out


_GOOD_ENTRY: dict[str, Any] = {"file": "tiny.gguf", "size": 10, "sha256": "ab" * 32}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "the lockfile must be a JSON object"),
        (json.dumps({"schema": 1, "version": "x", "models": {}}), "version: must be an integer >= 0"),
        (json.dumps({"schema": 1, "version": -1, "models": {}}), "version: must be an integer >= 0"),
        (json.dumps({"schema": 1, "version": 0}), "models: required"),
        (json.dumps({"schema": 1, "version": 0, "models": []}), "models: must be an object"),
        (json.dumps({"schema": 2, "version": 0, "models": {}}), "schema: must be 1"),
        (
            json.dumps({"schema": 1, "version": 0, "models": {"tiny": {"file": "tiny.gguf", "size": 10}}}),
            "models.tiny.sha256: required",
        ),
        (
            json.dumps({"schema": 1, "version": 0, "models": {"tiny": {**_GOOD_ENTRY, "sha256": "AB" * 32}}}),
            "models.tiny.sha256: must be 64 lowercase hex digits",
        ),
        (
            json.dumps({"schema": 1, "version": 0, "models": {"tiny": {**_GOOD_ENTRY, "size": 0}}}),
            "models.tiny.size: must be an integer >= 1",
        ),
        (
            json.dumps({"schema": 1, "version": 0, "models": {"tiny": {**_GOOD_ENTRY, "url": "x"}}}),
            "models.tiny.url: unknown member",
        ),
        (json.dumps({"schema": 1, "version": 0, "models": {}, "comment": "hi"}), "comment: unknown member"),
        (
            json.dumps({"schema": 1, "version": 0, "models": {}, "expires": "tomorrow"}),
            "expires: must be a UTC",
        ),
        (
            json.dumps({"schema": 1, "version": 0, "models": {}, "signatures": [{"alg": "rsa"}]}),
            "signatures[0].alg: must be 'ed25519'",
        ),
    ],
    ids=[
        "bad-json",
        "not-an-object",
        "version-string",
        "version-negative",
        "models-missing",
        "models-list",
        "schema-2",
        "sha256-missing",
        "sha256-uppercase",
        "size-zero",
        "entry-unknown",
        "top-unknown",
        "expires-bad",
        "signature-alg",
    ],
)
def test_show_refuses_a_malformed_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "models.lock"
    path.write_text(text)
    result = run(capsys, "lock", "show", "--lock", path)
    assert result.status == 1
    assert result.err.startswith("edgellmctl lock: ")
    assert message in result.err
    assert "Traceback" not in result.err
    assert result.out == ""


def test_show_a_missing_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, "lock", "show", "--lock", tmp_path / "nope.lock")
    assert result.status == 1
    assert "nope.lock: No such file or directory" in result.err


def test_add_refuses_to_extend_a_malformed_lock(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = models / "models.lock"
    path.write_text(json.dumps({"schema": 1, "version": 0, "models": {}, "extra": 1}))
    before = path.read_bytes()
    result = run(capsys, "lock", "add", "tiny", models / "tiny.gguf", "--lock", path)
    assert result.status == 1
    assert "extra: unknown member" in result.err
    assert path.read_bytes() == before


# ---- entries the daemon would refuse, and files that are not regular files --------------------


def _write_entry(lock: Path, key: KeyPair | None, **change: Any) -> bytes:
    """Rewrite the `tiny` entry of `lock` by hand (as a tool other than edgellmctl might), signed by `key`."""
    document = read_json(lock)
    document["models"]["tiny"].update(change)
    document["signatures"] = []
    if key is not None:
        document["signatures"] = [sign(document, load_private_key(key.pem))]
    data = json.dumps(document).encode()
    lock.write_bytes(data)
    return data


BAD_FILES = [
    ("nul", "tiny.gguf\x00.txt", "must not contain control characters"),
    ("dotdot", "../tiny.gguf", "contains '..'"),
    ("absolute", "/etc/passwd", "is an absolute path"),
    ("c1-control", "tiny\x9b.gguf", "must not contain control characters"),
    ("bidi", "safe\u202egguf.exe", "must be printable"),  # reads as safeexe.fggu
]


def test_lock_add_refuses_a_file_whose_name_reads_as_another(
    lock: Path, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hidden = models / "safe\u202egguf.exe"
    hidden.write_bytes((models / "tiny-b.gguf").read_bytes())
    before = lock.read_bytes() if lock.exists() else None
    result = run(capsys, "lock", "add", "other", hidden, "--lock", lock)
    assert result.status == 1
    assert "must be printable" in result.err
    assert "\u202e" not in result.err
    assert (lock.read_bytes() if lock.exists() else None) == before


@pytest.mark.parametrize(("file", "reason"), [pytest.param(f, r, id=i) for i, f, r in BAD_FILES])
@pytest.mark.parametrize("verb", ["verify", "sign", "show", "add"])
def test_a_bad_entry_is_refused_in_one_line_and_nothing_is_signed_or_written(
    verb: str,
    file: str,
    reason: str,
    lock: Path,
    models: Path,
    key: KeyPair,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = _write_entry(lock, key if verb == "verify" else None, file=file)
    commands: dict[str, list[str | Path]] = {
        "verify": ["lock", "verify", "--lock", lock, "--trusted", key.pub],
        "sign": ["lock", "sign", "--lock", lock, "--key", key.pem],
        "show": ["lock", "show", "--lock", lock],
        "add": ["lock", "add", "other", models / "tiny-b.gguf", "--lock", lock],
    }
    result = run(capsys, *commands[verb])
    assert result.status == 1
    assert result.err.startswith("edgellmctl lock: models.tiny.file: ")
    assert reason in result.err
    assert result.err.endswith("\n")
    assert result.err[:-1].isprintable()  # one line: no NUL, newline or escape reaches the terminal
    assert "Traceback" not in result.err
    assert lock.read_bytes() == before  # sign refused to sign it at all; add did not extend it


def test_add_refuses_a_file_name_the_lockfile_cannot_hold(
    models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("new\nline.gguf", "back\\slash.gguf"):
        (models / name).write_bytes(pristine["tiny.gguf"])
        lock = models / "models.lock"
        result = run(capsys, "lock", "add", "tiny", models / name, "--lock", lock)
        assert result.status == 1
        assert "the lockfile cannot name it" in result.err
        assert result.err.endswith("\n")
        assert result.err[:-1].isprintable()  # the name's newline is not printed raw
        assert "Traceback" not in result.err
        assert not lock.exists()


def test_add_refuses_a_gguf_header_whose_strings_the_lockfile_cannot_hold(
    models: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    # general.architecture is the header's first string value: "llama", 5 bytes after its length.
    data = pristine["tiny.gguf"]
    value = (5).to_bytes(8, "little") + b"llama"
    assert value in data
    (models / "odd.gguf").write_bytes(data.replace(value, (5).to_bytes(8, "little") + b"ll\x1bma", 1))
    lock = models / "models.lock"
    result = run(capsys, "lock", "add", "odd", models / "odd.gguf", "--lock", lock)
    assert result.status == 1
    assert "models.odd.gguf.architecture: must not contain control characters" in result.err
    assert not lock.exists()


@contextlib.contextmanager
def _not_regular(kind: str, path: Path) -> Iterator[Path]:
    """A FIFO, directory or socket in place of `path`, removed afterwards (the old file is not kept)."""
    path.unlink(missing_ok=True)
    sock = None
    if kind == "fifo":
        os.mkfifo(path)  # a plain open() would wait here for a writer, for ever
    elif kind == "directory":
        path.mkdir()
    else:  # a socket, bound by a short relative name (AF_UNIX paths are limited to 108 bytes)
        sock = socket.socket(socket.AF_UNIX)
        cwd = Path.cwd()
        os.chdir(path.parent)
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
    try:
        yield path
    finally:
        if sock is not None:
            sock.close()
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink()


WHAT = {"fifo": "a FIFO", "directory": "a directory", "socket": "a socket"}


@pytest.mark.parametrize("kind", list(WHAT))
def test_model_lock_and_key_files_that_are_not_regular_files_are_refused_at_once(
    kind: str, tmp_path: Path, signed: Path, models: Path, key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    noun = WHAT[kind]
    with _not_regular(kind, models / "tiny.gguf"):
        result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", key.pub)
        assert result.status == 1
        assert f"tiny      FAILED: tiny.gguf is {noun}, not a regular file" in result.out.splitlines()
        assert lines_of(result.out, "tiny-b ")[0].startswith("tiny-b    ok: ")
        result = run(capsys, "lock", "add", "again", models / "tiny.gguf", "--lock", signed)
        assert result.status == 1
        assert result.err == f"edgellmctl lock: {models / 'tiny.gguf'} is {noun}, not a regular file\n"
    with _not_regular(kind, tmp_path / "trusted.pub") as trusted:
        result = run(capsys, "lock", "verify", "--lock", signed, "--trusted", trusted)
        assert f"lock      FAILED: public key {trusted} is {noun}, not a regular file" in result.out
    with _not_regular(kind, tmp_path / "signing.pem") as pem:
        result = run(capsys, "lock", "sign", "--lock", signed, "--key", pem)
        assert result.status == 1
        assert result.err == f"edgellmctl lock: signing key {pem} is {noun}, not a regular file\n"
    good = signed.read_bytes()
    with _not_regular(kind, signed):
        for verb in (["show"], ["verify"], ["sign", "--key", str(key.pem)]):
            result = run(capsys, "lock", *verb, "--lock", signed)
            assert result.status == 1
            assert result.err == f"edgellmctl lock: {signed} is {noun}, not a regular file\n"
    signed.write_bytes(good)


# ---- argument errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["lock"],
        ["lock", "sign"],  # --key is required
        ["keygen"],  # --out is required
        ["lock", "frobnicate"],
        ["lock", "sign", "--ke", "signing.pem"],  # options by their full names only
        ["lock", "verify", "--trust", "signing.pub"],
    ],
)
def test_argument_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert "usage: edgellmctl" in capsys.readouterr().err
