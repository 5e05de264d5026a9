"""The signed lockfile: every tampering is refused with its own reason, and nothing else changes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgellmd.models.lockfile import (
    MAX_SIGNATURES,
    LockError,
    VersionState,
    canonical_bytes,
    format_time,
    key_id,
    load_lock,
    parse_lock,
    resolve_model_file,
    sign,
    verify_lock,
)
from edgellmd.models.verify import read_gguf_facts
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import running, settings_for

MODEL = "tiny"


@dataclass
class Box:
    """A provisioned box: models dir, state dir, two trusted keys and one untrusted key."""

    root: Path
    models: Path
    state: Path
    keys: dict[str, Ed25519PrivateKey]
    lock: Path

    def pub(self, name: str) -> Path:
        path = self.root / f"{name}.pub"
        path.write_bytes(
            self.keys[name]
            .public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return path

    def entry(self, file: str = "tiny.gguf") -> dict[str, Any]:
        data = (self.models / file).read_bytes()
        return {
            "file": file,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "gguf": {"architecture": "llama", "file_type": "ALL_F32"},
        }

    def document(
        self,
        *,
        version: int = 1,
        expires_in: timedelta = timedelta(days=30),
        models: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {
            "schema": 1,
            "version": version,
            "issued": format_time(now),
            "expires": format_time(now + expires_in),
            "models": models if models is not None else {MODEL: self.entry()},
        }

    def write(self, document: dict[str, Any], *signers: str) -> None:
        document = dict(document)
        document["signatures"] = [sign(document, self.keys[s]) for s in signers]
        self.lock.write_text(json.dumps(document))

    def settings(self, trusted: list[Path] | None = None) -> Any:
        keys = trusted if trusted is not None else [self.pub("a"), self.pub("b")]
        return settings_for(
            [{"name": MODEL, "threads": 1, "context_size": 128, "slots": 1}],
            lock={
                "file": str(self.lock),
                "models_dir": str(self.models),
                "state_dir": str(self.state),
                "trusted_keys": [str(k) for k in keys],
            },
        )

    def serve(self, trusted: list[Path] | None = None) -> tuple[int, dict[str, Any], list[str]]:
        """Start a daemon on this box: /readyz status and body, and the models it lists."""
        with running(self.settings(trusted), wait_ready=False) as daemon:
            status, body = _settled_readyz(daemon)
            _, models = daemon.get("/v1/models")
        return status, body, [m["id"] for m in models["data"]]


def _settled_readyz(daemon: Any) -> tuple[int, dict[str, Any]]:
    import time  # noqa: PLC0415

    deadline = time.monotonic() + 30
    while True:
        status, body = daemon.get("/readyz")
        states = {m["state"] for m in body["models"].values()}
        if "loading" not in states or time.monotonic() > deadline:
            return status, body
        time.sleep(0.02)


@pytest.fixture
def box(tmp_path: Path) -> Box:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_model(models / "tiny.gguf", TinyModelSpec(seed=1))
    write_tiny_model(models / "other.gguf", TinyModelSpec(seed=2))  # same size, other weights
    return Box(
        root=tmp_path,
        models=models,
        state=tmp_path / "state",
        keys={n: Ed25519PrivateKey.generate() for n in ("a", "b", "untrusted")},
        lock=tmp_path / "models.lock",
    )


def _reason(body: dict[str, Any]) -> str:
    reason: str = body["models"][MODEL]["reason"]
    return reason


# ---- the good path --------------------------------------------------------------------------


@pytest.mark.parametrize("signer", ["a", "b"])
def test_a_lock_signed_by_either_trusted_key_loads(box: Box, signer: str) -> None:
    box.write(box.document(version=3), signer)
    status, body, listed = box.serve()
    assert status == 200, body
    assert listed == [MODEL]
    assert VersionState(box.state).highest() == 3


# ---- refusals: the model is not served, /readyz says why, nothing else changes -------------


def _flip_byte(box: Box) -> None:
    path = box.models / "tiny.gguf"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(box: Box) -> None:
    path = box.models / "tiny.gguf"
    path.write_bytes(path.read_bytes()[:-100])


def _replace_with_other_gguf(box: Box) -> None:
    (box.models / "other.gguf").replace(box.models / "tiny.gguf")


Tamper = Callable[[Box], None]
FILE_TAMPERING: list[tuple[str, Tamper, str]] = [
    ("flipped-byte", _flip_byte, "has sha256"),
    ("truncated", _truncate, "bytes; the lockfile says"),
    ("replaced-by-another-gguf", _replace_with_other_gguf, "has sha256"),
]


@pytest.mark.parametrize(("tamper", "reason"), [pytest.param(t, r, id=i) for i, t, r in FILE_TAMPERING])
def test_a_tampered_model_file_is_refused(box: Box, tamper: Tamper, reason: str) -> None:
    box.write(box.document(), "a")
    tamper(box)
    status, body, listed = box.serve()
    assert status == 503
    assert body["status"] == "failed"
    assert reason in _reason(body)
    assert "tiny.gguf" in _reason(body)
    assert listed == []


def _edit_field(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        target = document
        *parents, last = field.split(".")
        for part in parents:
            target = target[part]
        target[last] = value

    return edit


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", 99),
        ("expires", "2099-01-01T00:00:00Z"),
        ("issued", "2020-01-01T00:00:00Z"),
        ("models.tiny.size", 1),
        ("models.tiny.sha256", "0" * 64),
        ("models.tiny.file", "other.gguf"),
        ("models.tiny.gguf", {"architecture": "llama"}),
    ],
)
def test_a_lock_edited_after_signing_is_refused(box: Box, field: str, value: Any) -> None:
    box.write(box.document(version=2), "a")
    document = json.loads(box.lock.read_text())
    _edit_field(field, value)(document)
    box.lock.write_text(json.dumps(document))
    status, body, listed = box.serve()
    assert status == 503
    assert "changed after signing" in _reason(body)
    assert listed == []
    assert VersionState(box.state).highest() == 0  # nothing accepted


def test_a_lock_with_a_lone_surrogate_escape_is_refused_with_its_reason(box: Box) -> None:
    """Still valid JSON (`\\ud800`), but no UTF-8 can be signed or checked for it: once a crash
    of the check (a 500 on reload, a model left `loading` without a reason at start)."""
    box.write(box.document(version=2), "a")
    text = box.lock.read_text()
    assert '"llama"' in text
    box.lock.write_text(text.replace('"llama"', '"\\ud800"', 1))
    with pytest.raises(LockError, match="lone surrogate"):
        parse_lock(box.lock.read_bytes())
    status, body, listed = box.serve()
    assert status == 503
    assert "lone surrogate" in _reason(body)
    assert listed == []


def test_an_untrusted_signature_is_refused(box: Box) -> None:
    box.write(box.document(), "untrusted")
    status, body, _ = box.serve()
    assert status == 503
    assert "untrusted" in _reason(body)


def test_an_unsigned_lock_is_refused(box: Box) -> None:
    box.write(box.document())
    status, body, _ = box.serve()
    assert status == 503
    assert "not signed" in _reason(body)


def test_an_expired_lock_is_refused(box: Box) -> None:
    box.write(box.document(expires_in=timedelta(seconds=-1)), "a")
    status, body, _ = box.serve()
    assert status == 503
    assert "expired at" in _reason(body)


def test_a_lock_issued_ahead_of_this_clock_is_served_and_said(
    box: Box, caplog: pytest.LogCaptureFixture
) -> None:
    """`issued` was read and never looked at: a lock signed "in the future" says one clock is
    wrong, and the expiry is judged by this one. Served (a box without a good clock still
    serves), with a warning naming both times."""
    document = box.document()
    document["issued"] = format_time(datetime.now(UTC) + timedelta(days=3))
    box.write(document, "a")
    with caplog.at_level("WARNING", logger="edgellmd.models.registry"):
        status, _, models = box.serve()
    assert (status, models) == (200, [MODEL])
    said = [r.getMessage() for r in caplog.records if "after this box's clock" in r.getMessage()]
    assert len(said) == 1
    assert "check both clocks" in said[0]
    caplog.clear()
    box.write(box.document(), "a")  # issued now: nothing said
    with caplog.at_level("WARNING", logger="edgellmd.models.registry"):
        box.serve()
    assert not [r for r in caplog.records if "after this box's clock" in r.getMessage()]


def test_rollback_is_refused_also_across_a_restart(box: Box) -> None:
    box.write(box.document(version=5), "a")
    status, _, _ = box.serve()
    assert status == 200
    # A new daemon (a restart) still remembers version 5.
    box.write(box.document(version=4), "a")
    status, body, listed = box.serve()
    assert status == 503
    assert "version 4 is lower than version 5" in _reason(body)
    assert listed == []
    assert VersionState(box.state).highest() == 5
    box.write(box.document(version=5), "b")  # the same version again is fine
    assert box.serve()[0] == 200


@pytest.mark.parametrize(
    ("file", "reason"),
    [
        ("../tiny.gguf", "contains '..'"),
        ("sub/../../tiny.gguf", "contains '..'"),
        ("/etc/passwd", "absolute path"),
    ],
)
def test_paths_outside_the_models_directory_are_refused(box: Box, file: str, reason: str) -> None:
    entry = box.entry()
    entry["file"] = file
    box.write(box.document(models={MODEL: entry}), "a")
    status, body, _ = box.serve()
    assert status == 503
    assert reason in _reason(body)


# A signed entry that the daemon could only trip over later (a NUL byte made /admin/reload
# answer 500 and left start-up "loading" with no reason): the whole lock is refused at once,
# naming the entry and why, and the value only when it is short and printable.
HIDDEN = "(a value too long or unprintable to show)"
BAD_ENTRIES: list[tuple[str, dict[str, Any], str]] = [
    ("nul", {"file": "tiny.gguf\x00.txt"}, "models.tiny.file: must not contain control characters"),
    ("newline", {"file": "tiny\n.gguf"}, "models.tiny.file: must not contain control characters"),
    ("escape", {"file": "tiny\x1b[2J.gguf"}, "models.tiny.file: must not contain control characters"),
    ("del", {"file": "tiny\x7f.gguf"}, "models.tiny.file: must not contain control characters"),
    ("c1", {"file": "tiny\x85.gguf"}, "models.tiny.file: must not contain control characters"),
    # A name that reads as another on the operator's terminal: safe<U+202E>gguf.exe shows as safeexe.fggu.
    ("bidi", {"file": "safe\u202egguf.exe"}, "models.tiny.file: must be printable"),
    ("zero-width", {"file": "ti\u200bny.gguf"}, "models.tiny.file: must be printable"),
    (
        "dotdot",
        {"file": "../tiny.gguf"},
        "models.tiny.file: '../tiny.gguf' contains '..'; lockfile paths stay inside the models directory",
    ),
    (
        "dotdot-inside",
        {"file": "sub/../../tiny.gguf"},
        "models.tiny.file: 'sub/../../tiny.gguf' contains '..'",
    ),
    ("dotdot-alone", {"file": ".."}, "models.tiny.file: '..' contains '..'"),
    ("absolute", {"file": "/etc/passwd"}, "models.tiny.file: '/etc/passwd' is an absolute path"),
    ("backslash", {"file": "..\\tiny.gguf"}, "models.tiny.file: '..\\\\tiny.gguf' contains a backslash"),
    ("too-long", {"file": "a/" * 600 + "tiny.gguf"}, "models.tiny.file: must be at most 1024 characters"),
    ("empty", {"file": ""}, "models.tiny.file: must be a non-empty string"),
    ("not-a-string", {"file": ["tiny.gguf"]}, "models.tiny.file: must be a non-empty string"),
    (
        "gguf-control",
        {"gguf": {"architecture": "llama\r\nforged: line"}},
        "models.tiny.gguf.architecture: must not contain control characters",
    ),
    (
        "gguf-long",
        {"gguf": {"architecture": "l" * 300}},
        "models.tiny.gguf.architecture: must be at most 256",
    ),
    (
        "gguf-bool",
        {"gguf": {"context_length": True}},
        "models.tiny.gguf.context_length: must be a string or an integer",
    ),
    (
        "gguf-member-control",
        {"gguf": {"arch\x00": "llama"}},
        "models.tiny.gguf: member names must not contain control characters",
    ),
]


@pytest.mark.parametrize(("change", "reason"), [pytest.param(c, r, id=i) for i, c, r in BAD_ENTRIES])
def test_a_bad_entry_is_refused_by_the_parser_naming_it(
    box: Box, change: dict[str, Any], reason: str
) -> None:
    entry = {**box.entry(), **change}
    with pytest.raises(LockError) as caught:
        parse_lock(json.dumps(box.document(models={MODEL: entry})))
    message = str(caught.value)
    assert message.startswith(reason)
    assert message.isprintable()  # one line, no control characters: it goes to logs and terminals


@pytest.mark.parametrize("name", ["bad\x00name", "x" * 5000, "\u202egnp.exe"], ids=["nul", "huge", "bidi"])
def test_a_bad_model_name_is_refused_without_showing_it(box: Box, name: str) -> None:
    with pytest.raises(LockError) as caught:
        parse_lock(json.dumps(box.document(models={name: box.entry()})))
    assert str(caught.value) == (
        f"models.{HIDDEN}: model names are 1-64 of A-Za-z0-9._:- starting with a letter or digit"
    )


def test_an_unknown_member_with_an_unprintable_name_is_named_without_it(box: Box) -> None:
    document = {**box.document(), "evil\n\x00": 1}
    with pytest.raises(LockError) as caught:
        parse_lock(json.dumps(document))
    assert str(caught.value) == f"{HIDDEN}: unknown member"


@pytest.mark.parametrize("case", ["nul", "dotdot", "gguf-control"])
def test_a_signed_lock_with_a_bad_entry_ends_start_up_failed_with_the_reason(box: Box, case: str) -> None:
    change, reason = next((c, r) for i, c, r in BAD_ENTRIES if i == case)
    box.write(box.document(models={MODEL: {**box.entry(), **change}}), "a")
    status, body, listed = box.serve()
    assert status == 503
    assert body["status"] == "failed"
    assert body["models"][MODEL]["state"] == "failed"  # not "loading" for ever
    assert _reason(body).startswith(f"lockfile refused: {reason}")
    assert listed == []
    assert VersionState(box.state).highest() == 0  # a refused lock is never accepted


@pytest.mark.parametrize("what", ["lockfile", "trusted key"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lockfile_or_trusted_key_that_is_not_a_regular_file_fails_start_up_at_once(
    box: Box, what: str, kind: str
) -> None:
    box.write(box.document(), "a")
    target = box.lock if what == "lockfile" else box.root / "trusted.pub"
    target.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(target)  # an open() without O_NONBLOCK waits here for a writer, for ever
    else:
        target.mkdir()
    noun = "a FIFO" if kind == "fifo" else "a directory"
    status, body, _ = box.serve([box.pub("a"), target] if what == "trusted key" else None)
    assert status == 503
    prefix = "" if what == "lockfile" else "public key "
    # /readyz names the file, never its folder
    assert _reason(body) == f"lockfile refused: {prefix}{target.name} is {noun}, not a regular file"


def test_a_symlink_out_of_the_models_directory_is_refused(box: Box) -> None:
    outside = box.root / "outside.gguf"
    write_tiny_model(outside, TinyModelSpec(seed=1))
    (box.models / "link.gguf").symlink_to(outside)
    entry = box.entry("tiny.gguf")
    entry["file"] = "link.gguf"
    box.write(box.document(models={MODEL: entry}), "a")
    status, body, _ = box.serve()
    assert status == 503
    assert "outside the models directory" in _reason(body)


def test_a_gguf_header_that_disagrees_with_the_lock_is_refused(box: Box) -> None:
    entry = box.entry()
    entry["gguf"] = {"architecture": "gemma3", "file_type": "ALL_F32"}
    box.write(box.document(models={MODEL: entry}), "a")
    status, body, _ = box.serve()
    assert status == 503
    assert "GGUF architecture is 'llama'; the lockfile says 'gemma3'" in _reason(body)


def test_a_model_missing_from_the_lock_is_refused(box: Box) -> None:
    box.write(box.document(models={"someone-else": box.entry()}), "a")
    status, body, _ = box.serve()
    assert status == 503
    assert "not in the lockfile" in _reason(body)


@pytest.mark.parametrize(
    ("text", "member"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"schema": 1, "version": "7", "models": {}}', "version: must be an integer"),
        ('{"schema": 1, "models": {}}', "version: required"),
        ('{"schema": 1, "version": 1}', "models: required"),
        ('{"schema": 2, "version": 1, "models": {}}', "schema: must be 1"),
        (
            '{"schema": 1, "version": 1, "models": {"tiny": {"file": "tiny.gguf", "size": 5}}}',
            "models.tiny.sha256: required",
        ),
        (
            '{"schema": 1, "version": 1, "models": {"tiny": {"file": "t", "size": -1, "sha256": "'
            + "a" * 64
            + '"}}}',
            "models.tiny.size: must be an integer >= 1",
        ),
        ('{"schema": 1, "version": 1, "models": {}, "extra": true}', "extra: unknown member"),
        ('{"schema": 1, "version": 1, "models": {}, "signatures": [{"alg": "rsa"}]}', "signatures[0].alg"),
        ('{"schema": 1, "version": 1, "models": {}, "expires": "tomorrow"}', "expires: must be a UTC time"),
    ],
)
def test_a_malformed_lock_names_the_member(box: Box, text: str, member: str) -> None:
    with pytest.raises(LockError) as caught:
        parse_lock(text)
    assert member in str(caught.value)
    box.lock.write_text(text)
    status, body, _ = box.serve()
    assert status == 503
    assert member in _reason(body)


def test_a_missing_lockfile_is_refused(box: Box) -> None:
    status, body, _ = box.serve()
    assert status == 503
    assert "cannot read" in _reason(body)


# ---- library details ------------------------------------------------------------------------


def test_canonical_form_ignores_signatures_and_key_order() -> None:
    a = {"version": 1, "schema": 1, "models": {}, "signatures": [{"x": 1}]}
    b = {"models": {}, "schema": 1, "version": 1}
    assert canonical_bytes(a) == canonical_bytes(b) == b'{"models":{},"schema":1,"version":1}'


def test_key_id_is_the_sha256_of_the_raw_public_key() -> None:
    key = Ed25519PrivateKey.generate().public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert key_id(key) == hashlib.sha256(raw).hexdigest()


def test_verify_lock_returns_the_signer(box: Box) -> None:
    box.write(box.document(), "b", "untrusted")
    signer = verify_lock(load_lock(box.lock), [box.keys["b"].public_key()])
    assert signer == key_id(box.keys["b"].public_key())


def test_version_state_is_written_atomically_and_survives(tmp_path: Path) -> None:
    state = VersionState(tmp_path / "state")
    assert state.highest() == 0
    state.accept(3)
    state.accept(2)  # never goes down
    assert VersionState(tmp_path / "state").highest() == 3
    assert sorted(os.listdir(tmp_path / "state")) == ["lock-state.json"]  # no temp files left
    with pytest.raises(LockError, match="rollback refused"):
        state.check(2)
    (tmp_path / "state" / "lock-state.json").write_text("garbage")
    with pytest.raises(LockError, match="cannot read rollback state"):
        state.highest()


def test_resolve_model_file_stays_inside(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert resolve_model_file(tmp_path / "m", "a/b.gguf") == (tmp_path / "m" / "a" / "b.gguf").resolve()


def test_gguf_facts_from_the_header(box: Box) -> None:
    facts = read_gguf_facts(box.models / "tiny.gguf")
    assert facts == {"architecture": "llama", "file_type": "ALL_F32", "context_length": 4096}
    junk = box.root / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(LockError, match="GGUF"):
        read_gguf_facts(junk)


def test_a_lockfile_padded_with_signatures_is_refused_before_any_is_checked(box: Box) -> None:
    """Signatures are not signed: thousands of forged ones beside the good one cost seconds of
    verification at every reload. At most MAX_SIGNATURES, one per key."""
    box.write(box.document(), "a")
    document = json.loads(box.lock.read_bytes())
    good = document["signatures"][0]
    forged = {**good, "sig": base64.b64encode(b"\1" * 64).decode()}
    padded = {**document, "signatures": [forged] * (MAX_SIGNATURES + 1) + [good]}
    with pytest.raises(LockError, match=f"at most {MAX_SIGNATURES}"):
        parse_lock(json.dumps(padded))
    twice = {**document, "signatures": [forged, good]}
    with pytest.raises(LockError, match=r"signatures\[1\]\.key_id: a second signature by the same key"):
        parse_lock(json.dumps(twice))
    assert parse_lock(json.dumps(document)).signatures  # the one good signature still reads
