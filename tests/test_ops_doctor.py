"""`edgellmctl doctor`: each check on good and bad hosts, boxes and units, with its fix."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import namedtuple
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgellmctl import doctor
from edgellmctl.__main__ import main as edgellmctl
from edgellmctl.cpubuild import Verdict
from edgellmctl.doctor import Host, check_build, check_cpu_build, check_cpu_flags, check_shm, run_checks
from edgellmctl.keys import create_key
from edgellmd.engine import BackendDevice, BuildInfo
from edgellmd.engine.native import build_info
from edgellmd.host.nvml import read_gpus
from edgellmd.models.lockfile import format_time, sign
from edgellmd.settings import load_settings
from tests import fakenvml
from tests.ggufmodels import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parent.parent
# What the CUDA backend of a default `EDGELLM_CUDA=1` build on CUDA 12.x lists (6.1 to 9.0).
CUDA12_ARCHS = (61, 70, 75, 80, 86, 89, 90)


def cpu_build() -> BuildInfo:
    """A CPU-only llama.cpp, as this machine's answers (the real one, read from llama.cpp)."""
    return build_info()


def cuda_build(archs: tuple[int, ...] | None = CUDA12_ARCHS, gpu: str = "NVIDIA H200") -> BuildInfo:
    """A CUDA build's answers: faked, since no CUDA build exists here; shaped on llama.cpp's text."""
    listed = f"ARCHS = {','.join(str(a * 10) for a in archs)} | " if archs is not None else ""
    text = f"CUDA : {listed}USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : AVX2 = 1 | "
    features = {"CUDA": {"USE_GRAPHS": "1"}, "CPU": {"AVX2": "1"}}
    return BuildInfo(
        backends=("CUDA", "CPU"),
        devices=(
            BackendDevice("CUDA0", gpu, "gpu", 140 * 2**30, 143 * 2**30),
            BackendDevice("CPU", "AMD EPYC", "cpu", 2**37, 2**37),
        ),
        cuda_archs=archs,
        gpu_offload=True,
        system_info=text,
        features=features,
    )


def cpuinfo(tmp_path: Path, flags: str) -> Host:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n")
    return Host(cpuinfo=path)


@pytest.mark.parametrize(
    ("flags", "level", "detail"),
    [
        ("fpu sse2 avx avx2 fma", "ok", "AVX2"),
        ("fpu sse2 avx avx2 avx512f avx512_vnni", "ok", "AVX2, avx512f, avx512_vnni"),
        ("fpu sse2 avx", "warn", "no AVX2"),
    ],
)
def test_cpu_flags(tmp_path: Path, flags: str, level: str, detail: str) -> None:
    check = check_cpu_flags(cpuinfo(tmp_path, flags))
    assert check.level == level
    assert check.detail == detail if level == "ok" else detail in check.detail
    assert (check.fix is not None) == (level != "ok")


AMX_CPU = "fpu avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16"


def amx_build(amx: bool) -> BuildInfo:
    """A CPU build's answers, with or without AMX kernels, shaped on this machine's own."""
    real = build_info()
    cpu = {k: v for k, v in real.features.get("CPU", {}).items() if k != "AMX_INT8"}
    if amx:
        cpu["AMX_INT8"] = "1"
    return BuildInfo(
        real.backends, real.devices, real.cuda_archs, real.gpu_offload, real.system_info, {"CPU": cpu}
    )


@pytest.mark.parametrize(
    ("flags", "amx", "verdict", "cxx", "level", "said"),
    [
        (AMX_CPU, False, None, "/usr/bin/c++", "ok", "llama.cpp has no AMX kernels"),
        ("fpu avx2 avx512f", True, None, "/usr/bin/c++", "ok", "this CPU has no AMX to run them"),
        (
            AMX_CPU,
            True,
            Verdict(False, "c++ builds working AMX code"),
            "/usr/bin/c++",
            "ok",
            "working AMX code",
        ),
        (
            AMX_CPU,
            True,
            Verdict(True, "c++ -march=native builds AMX code that dies here (SIGSEGV ...)"),
            "/usr/bin/c++",
            "fail",
            "dies here (SIGSEGV ...): every prompt of more than one token crashes the daemon",
        ),
        (
            AMX_CPU,
            True,
            Verdict(False, "no C++ compiler"),
            None,
            "warn",
            "no C++ compiler to probe them with",
        ),
    ],
)
def test_the_cpu_build_check_probes_amx_kernels_where_they_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: str,
    amx: bool,
    verdict: Verdict | None,
    cxx: str | None,
    level: str,
    said: str,
) -> None:
    asked: list[tuple[frozenset[str], str | None]] = []

    def fake_probe(cpu: frozenset[str], compiler: str | None) -> Verdict:
        asked.append((cpu, compiler))
        assert verdict is not None, "probed where nothing needs it"
        return verdict

    monkeypatch.setattr(doctor, "compiler", lambda: cxx)
    host = cpuinfo(tmp_path, flags)
    check = check_cpu_build(amx_build(amx), Host(cpuinfo=host.cpuinfo, amx_probe=fake_probe))
    assert (check.name, check.level) == ("cpu build", level)
    assert said in check.detail
    assert (check.fix is not None) == (level != "ok")
    if level != "ok":
        assert "edgellmctl.cpubuild cmake-args" in (check.fix or "")
    assert [c for c, _ in asked] == ([frozenset(flags.split())] if verdict is not None else [])


def test_the_cpu_build_check_passes_for_the_build_here() -> None:
    """The real build and probe: what ./dev built must not be one the probe finds broken."""
    check = check_cpu_build(build_info(), Host())
    assert check.level == "ok", check.detail


def write_box(
    root: Path, *, keys_mode: int = 0o600, private_as_trusted: bool = False, drop_model: bool = False
) -> Path:
    """A provisioned box: signed lock, tiny model, keys file, config; returns the config path."""
    models = root / "models"
    models.mkdir(parents=True)
    data = write_tiny_model(models / "tiny.gguf", TinyModelSpec(seed=1)).read_bytes()
    key = Ed25519PrivateKey.generate()
    pub = root / "signer.pub"
    if private_as_trusted:
        pub.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    else:
        pub.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    now = datetime.now(UTC)
    doc: dict[str, Any] = {
        "schema": 1,
        "version": 1,
        "issued": format_time(now),
        "expires": format_time(now + timedelta(days=1)),
        "models": {
            "tiny": {"file": "tiny.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        },
    }
    doc["signatures"] = [sign(doc, key)]
    (root / "models.lock").write_text(json.dumps(doc))
    create_key(root / "keys.yaml", "app", ["inference"], limits={})
    (root / "keys.yaml").chmod(keys_mode)
    if drop_model:
        (models / "tiny.gguf").unlink()
    config = root / "edgellm.yaml"
    config.write_text(
        json.dumps(
            {
                "models": [{"name": "tiny", "context_size": 128}],
                "lock": {
                    "file": "models.lock",
                    "trusted_keys": ["signer.pub"],
                    "models_dir": "models",
                    "state_dir": "state",
                },
                "auth": {"keys_file": "keys.yaml"},
            }
        )
    )
    return config


def levels(checks: list[doctor.Check]) -> dict[str, str]:
    return {c.name: c.level for c in checks}


def test_a_good_box_passes_every_file_check(tmp_path: Path) -> None:
    config = write_box(tmp_path)
    checks = run_checks(config, None, Host(nvml=fakenvml.no_driver()), cpu_build)
    got = levels(checks)
    assert got["config"] == "ok"
    assert got["permissions"] == "ok"
    assert got["memory"] == "ok"
    assert got["shm"] == "ok"
    assert got["systemd unit"] == "warn"  # not installed here


@pytest.mark.parametrize(
    ("box", "name", "fragment"),
    [
        ({"keys_mode": 0o644}, "permissions", "readable or writable by others"),
        ({"private_as_trusted": True}, "permissions", "is a private key"),
        ({"drop_model": True}, "config", "tiny.gguf is missing"),
    ],
)
def test_a_bad_box_fails_with_the_reason_and_a_fix(
    tmp_path: Path, box: dict[str, Any], name: str, fragment: str
) -> None:
    config = write_box(tmp_path, **box)
    checks = {c.name: c for c in run_checks(config, None, Host(nvml=fakenvml.no_driver()), cpu_build)}
    assert checks[name].level == "fail"
    assert fragment in checks[name].detail
    assert checks[name].fix


def test_an_invalid_config_is_reported_with_its_first_problem(tmp_path: Path) -> None:
    config = tmp_path / "edgellm.yaml"
    config.write_text("models: []\nlock: {allow_unsigned: true}\nserver: {port: 0}\n")
    checks = {c.name: c for c in run_checks(config, None, Host(nvml=fakenvml.no_driver()), cpu_build)}
    assert checks["config"].level == "fail"
    assert "and 1 more" in checks["config"].detail
    assert checks["config"].detail.startswith(("models:", "server.port:"))


def test_shm_too_small_for_a_swap_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(write_box(tmp_path))
    usage = namedtuple("usage", "total used free")
    model_size = (tmp_path / "models" / "tiny.gguf").stat().st_size
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * model_size, 9 * model_size, model_size))
    check = check_shm(settings, Host())
    assert check.level == "warn"
    assert "two copies" in check.detail
    assert check.fix is not None
    assert "remount" in check.fix


@pytest.mark.parametrize(
    ("nvml", "layers", "offload", "expected"),
    [
        (fakenvml.h200, -1, True, {"gpu": "ok"}),
        (fakenvml.h200, -1, False, {"gpu no_offload_build": "warn"}),
        (fakenvml.p40, -1, True, {"gpu pascal_fp16_slow": "warn"}),
        (fakenvml.maxwell, -1, True, {"gpu compute_capability_unsupported": "fail"}),
        (fakenvml.no_driver, -1, True, {"gpu": "warn"}),
        (fakenvml.no_driver, 0, False, {"gpu": "ok"}),
    ],
)
def test_gpu_checks_follow_the_verdicts(
    tmp_path: Path, nvml: Any, layers: int, offload: bool, expected: dict[str, str]
) -> None:
    config = write_box(tmp_path)
    data = json.loads(config.read_text())
    data["models"][0]["gpu_layers"] = layers
    config.write_text(json.dumps(data))
    build = cuda_build() if offload else cpu_build()
    got = levels(run_checks(config, None, Host(nvml=nvml()), lambda: build))
    for name, level in expected.items():
        assert got.get(name) == level, got


@pytest.mark.parametrize(("layers", "shown"), [("auto", "auto"), (-1, "-1"), (12, "12")])
def test_the_gpu_check_names_gpu_layers_as_configured(tmp_path: Path, layers: Any, shown: str) -> None:
    # The daemon's monitor judges the same value (verdicts.largest_gpu_layers); never a sentinel.
    config = write_box(tmp_path)
    data = json.loads(config.read_text())
    data["models"][0]["gpu_layers"] = layers
    config.write_text(json.dumps(data))
    checks = {c.name: c for c in run_checks(config, None, Host(nvml=fakenvml.h200()), cpu_build)}
    assert checks["gpu no_offload_build"].detail.startswith(f"gpu_layers is {shown} but"), checks


# profile, the build's CUDA architectures ("cpu": a CPU-only build) -> level, detail part, fix part
BUILD_CASES = [
    pytest.param(
        fakenvml.h200, CUDA12_ARCHS, "ok", "GPU 0 (NVIDIA H200, 9.0): the build has sm_90", None, id="h200"
    ),
    pytest.param(
        fakenvml.h200,
        (61, 70, 75, 80, 86, 89),
        "fail",
        "the build has no sm_90 code (CUDA 6.1, 7.0, 7.5, 8.0, 8.6, 8.9); its sm_89 code",
        "EDGELLM_CUDA_ARCHS=90",
        id="h200-without-90",
    ),
    pytest.param(
        fakenvml.p40, CUDA12_ARCHS, "ok", "GPU 0 (Tesla P40, 6.1): the build has sm_61", None, id="p40"
    ),
    pytest.param(
        fakenvml.p40,
        (75, 80, 86, 89, 90),  # what a default build with CUDA 13 has
        "fail",
        "GPU 0 (Tesla P40, 6.1): the build has no sm_61 code nor any older",
        "with CUDA 12.x (CUDA 13 dropped Pascal) and EDGELLM_CUDA_ARCHS=61",
        id="p40-cuda13",
    ),
    pytest.param(
        fakenvml.p40, (60, 75), "warn", "runs the build's sm_60 code", "EDGELLM_CUDA_ARCHS=61", id="p40-sm60"
    ),
    pytest.param(
        fakenvml.not_supported_fields,
        (80, 90),
        "warn",
        "GPU 0 (NVIDIA GeForce RTX 3090, 8.6) runs the build's sm_80 code",
        "EDGELLM_CUDA_ARCHS=86",
        id="rtx3090-sm80",
    ),
    pytest.param(
        fakenvml.h200, None, "warn", "does not list the architectures", "current CUDA", id="unlisted"
    ),
    pytest.param(
        fakenvml.h200,
        "cpu",
        "warn",
        "1 NVIDIA GPU(s) present, but this llama.cpp build: CPU only",
        "EDGELLM_CUDA=1",
        id="h200-cpu-build",
    ),
    pytest.param(fakenvml.no_driver, "cpu", "ok", "llama.cpp build: CPU only", None, id="no-gpu-cpu-build"),
    pytest.param(
        fakenvml.no_driver,
        CUDA12_ARCHS,
        "ok",
        "llama.cpp build: CUDA (6.1, 7.0, 7.5",
        None,
        id="no-gpu-cuda-build",
    ),
]


@pytest.mark.parametrize(("nvml", "archs", "level", "detail", "fix"), BUILD_CASES)
def test_the_build_is_checked_against_each_gpus_compute_capability(
    nvml: Any, archs: Any, level: str, detail: str, fix: str | None
) -> None:
    build = cpu_build() if archs == "cpu" else cuda_build(archs)
    checks = list(check_build(build, read_gpus(nvml())))
    assert [c.name for c in checks] == ["gpu build"]
    (check,) = checks
    assert check.level == level, check
    assert detail in check.detail, check.detail
    if fix is None:
        assert level == "ok"
    else:
        assert check.fix is not None
        assert fix in check.fix, check.fix


def test_each_gpu_gets_its_own_build_line() -> None:
    checks = list(check_build(cuda_build((61, 75)), read_gpus(fakenvml.h200(count=2))))
    assert [(c.name, c.level) for c in checks] == [("gpu build", "fail"), ("gpu build", "fail")]
    assert [c.detail.split(":")[0] for c in checks] == [
        "GPU 0 (NVIDIA H200, 9.0)",
        "GPU 1 (NVIDIA H200, 9.0)",
    ]


def test_a_p40_with_a_cuda13_build_fails_the_whole_doctor_run(tmp_path: Path) -> None:
    config = write_box(tmp_path)
    checks = run_checks(config, None, Host(nvml=fakenvml.p40()), lambda: cuda_build((75, 80, 86, 89, 90)))
    failed = [c for c in checks if c.level == "fail"]
    assert [c.name for c in failed] == ["gpu build"], failed
    assert "fix: rebuild llama-cpp-python with CUDA 12.x" in doctor.format_checks(checks)


def test_the_unit_rating(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: install the systemd package")
    weak = tmp_path / "weak.service"
    weak.write_text("[Service]\nExecStart=/bin/true\n")
    host = Host()
    check = doctor.check_unit(weak, host)
    assert check.level == "fail"
    assert "exposure" in check.detail
    shipped = REPO / "systemd" / "edgellm.service"
    if shipped.exists():
        assert doctor.check_unit(shipped, host).level == "ok"


@pytest.mark.parametrize(
    ("service", "level", "fragments"),
    [
        # The shipped unit's choices, and the equivalents systemd accepts.
        ("Delegate=memory\nProtectControlGroups=no\nOOMPolicy=continue\n", "ok", ["costs its model only"]),
        ("Delegate=yes\n", "ok", []),  # every controller delegated; OOMPolicy then defaults to continue
        ("Delegate=cpu memory\nProtectControlGroups=private\n", "ok", []),
        # What an older or hand-made unit says.
        ("", "warn", ["OOMPolicy=stop: an engine", "no memory cgroups", "continue, Delegate=memory"]),
        ("Delegate=memory\nProtectControlGroups=yes\n", "warn", ["no memory cgroups"]),
        ("Delegate=cpu\n", "warn", ["no memory cgroups"]),
        ("Delegate=memory\nOOMPolicy=kill\n", "warn", ["OOMPolicy=kill"]),
        # The last assignment counts; comments do not.
        ("OOMPolicy=stop\n# OOMPolicy=continue\nOOMPolicy=continue\nDelegate=memory\n", "ok", []),
    ],
)
def test_the_unit_lets_an_engines_fault_stay_its_models(
    tmp_path: Path, service: str, level: str, fragments: list[str]
) -> None:
    unit = tmp_path / "edgellm.service"
    head = "[Unit]\nDescription=x\nOOMPolicy=ignored here\n[Service]\nExecStart=/bin/true\n"
    unit.write_text(head + service)
    check = doctor.check_unit_faults(unit)
    assert check is not None
    assert check.level == level, check
    shown = doctor.format_checks([check])
    for fragment in fragments:
        assert fragment in shown
    shipped = REPO / "systemd" / "edgellm.service"
    faults = doctor.check_unit_faults(shipped)
    assert faults is not None
    assert faults.level == "ok"
    assert doctor.check_unit_faults(None) is None
    missing = doctor.check_unit_faults(tmp_path / "gone.service")
    assert missing is not None
    assert missing.level == "warn"


def test_the_command_prints_one_line_per_check_and_fails_on_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(doctor, "read_gpus", lambda _nvml: fakenvml_snapshot())
    config = write_box(tmp_path, keys_mode=0o644)
    assert edgellmctl(["doctor", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  permissions:" in out
    assert "      fix: chmod 0600 the keys file" in out
    assert edgellmctl(["doctor", "--config", str(config), "--json"]) == 1
    parsed = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in parsed} >= {
        "cpu flags",
        "cpu affinity",
        "memory",
        "shm",
        "permissions",
        "config",
        "systemd unit",
    }
    (tmp_path / "keys.yaml").chmod(0o600)
    assert edgellmctl(["doctor", "--config", str(config)]) == 0


def fakenvml_snapshot() -> Any:
    from edgellmd.host.nvml import read_gpus  # noqa: PLC0415

    return read_gpus(fakenvml.no_driver())
