"""`edgellmctl.cudabuild`: CMake flags from what nvcc 11.8, 12.4, 12.8 and 13.0 answer; refusals; checks."""

from __future__ import annotations

import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Final

import pytest

from edgellmctl import cudabuild
from edgellmctl.cudabuild import (
    DEFAULT_ARCHS,
    architectures_in,
    coverage,
    known_archs,
    parse_archs,
    parse_gpu_arch_list,
    parse_nvcc_version,
)

REPO: Final = Path(__file__).resolve().parent.parent
NVCC_DATA: Final = REPO / "tests" / "data" / "nvcc"
RELEASES: Final = ("11.8", "12.4", "12.8", "13.0")
# The interpreter the venv was made from: edgellm is not importable there, as before ./dev installs it.
BASE_PYTHON: Final = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
ALL_ARCHS: Final = "-DCMAKE_CUDA_ARCHITECTURES=61-real;70-real;75-real;80-real;86-real;89-real;90"


def fake_tool(tmp_path: Path, name: str, script: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_nvcc(tmp_path: Path, release: str, *, list_gpu_arch: bool = True) -> Path:
    """An nvcc that answers --version and --list-gpu-arch as the recorded release did."""
    version = NVCC_DATA / f"cuda-{release}.version.txt"
    archs = NVCC_DATA / f"cuda-{release}.list-gpu-arch.txt"
    listing = (
        f'cat "{archs}"'
        if list_gpu_arch
        else "echo \"nvcc fatal : Unknown option '--list-gpu-arch'\" >&2; exit 1"
    )
    return fake_tool(
        tmp_path,
        "nvcc",
        f'case "$1" in\n  --version) cat "{version}" ;;\n  --list-gpu-arch) {listing} ;;\n'
        '  *) echo "unexpected: $*" >&2; exit 2 ;;\nesac\n',
    )


def fake_nvidia_smi(tmp_path: Path, *caps: str) -> Path:
    lines = "\\n".join(caps)
    return fake_tool(tmp_path, "nvidia-smi", f'printf "{lines}\\n"\n')


def cmake_args(
    tmp_path: Path, release: str, *args: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    status = cudabuild.main(["cmake-args", "--nvcc", str(fake_nvcc(tmp_path, release)), *args])
    out, err = capsys.readouterr()
    return status, out.strip(), err.strip()


@pytest.mark.parametrize("release", RELEASES)
def test_the_recorded_answers_parse(release: str) -> None:
    version = parse_nvcc_version((NVCC_DATA / f"cuda-{release}.version.txt").read_text())
    assert f"{version[0]}.{version[1]}" == release
    listed = parse_gpu_arch_list((NVCC_DATA / f"cuda-{release}.list-gpu-arch.txt").read_text())
    # The table used when nvcc cannot list its architectures says the same as nvcc does.
    assert known_archs(version) == listed


@pytest.mark.parametrize(
    ("release", "args", "note"),
    [
        ("11.8", f"-DGGML_CUDA=on {ALL_ARCHS} -DLLAVA_BUILD=off", ""),
        ("12.4", f"-DGGML_CUDA=on {ALL_ARCHS} -DLLAVA_BUILD=off", ""),
        ("12.8", f"-DGGML_CUDA=on {ALL_ARCHS} -DLLAVA_BUILD=off", ""),
        (
            "13.0",
            "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75-real;80-real;86-real;89-real;90 -DLLAVA_BUILD=off",
            "note: left out of the defaults: CUDA 13.0 cannot build for compute capability 6.1 (Pascal), "
            "7.0 (Volta): CUDA 13 dropped Maxwell, Pascal and Volta (below 7.5); build with CUDA 12.x",
        ),
    ],
)
def test_the_default_build_is_pascal_to_hopper_as_far_as_the_toolkit_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], release: str, args: str, note: str
) -> None:
    status, out, err = cmake_args(tmp_path, release, capsys=capsys)
    assert status == 0
    assert out == args
    assert err.startswith(note) if note else err == ""


# release, --archs -> CMAKE_CUDA_ARCHITECTURES, or the refusal's words
REQUESTS: Final = [
    ("12.4", "61", "61", None),
    ("11.8", "61;90", "61-real;90", None),
    ("12.8", "120", "120", None),
    ("12.8", "90a-real,61", "61-real;90", None),
    ("13.0", "90", "90", None),
    ("13.0", "61", None, "CUDA 13.0 cannot build for compute capability 6.1 (Pascal): CUDA 13 dropped"),
    ("13.0", "70;90", None, "CUDA 13.0 cannot build for compute capability 7.0 (Volta)"),
    (
        "12.4",
        "120",
        None,
        "CUDA 12.4 cannot build for compute capability 12.0 (Blackwell): that needs CUDA 12.8",
    ),
    ("11.8", "100", None, "that needs CUDA 12.8 or newer"),
    ("12.4", "sm_90", None, "not a CUDA architecture: 'sm_90'"),
    ("12.4", " ; ", None, "no CUDA architecture given"),
]


@pytest.mark.parametrize(("release", "spec", "archs", "refusal"), REQUESTS)
def test_a_request_is_built_or_refused_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    release: str,
    spec: str,
    archs: str | None,
    refusal: str | None,
) -> None:
    status, out, err = cmake_args(tmp_path, release, "--archs", spec, capsys=capsys)
    if archs is not None:
        assert (status, err) == (0, "")
        assert f"-DCMAKE_CUDA_ARCHITECTURES={archs} " in out
        return
    assert refusal is not None
    assert status == cudabuild.REFUSED
    assert out == ""
    assert "\n" not in err
    assert err.startswith("edgellm CUDA build: ")
    assert refusal in err


def test_the_refusal_for_pascal_on_cuda13_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, err = cmake_args(tmp_path, "13.0", "--archs", "61", capsys=capsys)
    assert "build with CUDA 12.x" in err
    assert err.endswith("EDGELLM_CUDA_ARCHS=61")


@pytest.mark.parametrize(
    ("release", "caps", "archs", "refusal"),
    [
        ("13.0", ("9.0",), "90", None),
        ("12.4", ("6.1", "6.1"), "61", None),
        ("12.8", ("6.1", "9.0"), "61-real;90", None),
        ("13.0", ("6.1",), None, "CUDA 13.0 cannot build for compute capability 6.1"),
        ("13.0", (), None, "nvidia-smi lists no GPU"),
    ],
)
def test_native_means_the_gpus_nvidia_smi_lists(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    release: str,
    caps: tuple[str, ...],
    archs: str | None,
    refusal: str | None,
) -> None:
    smi = fake_nvidia_smi(tmp_path, *caps)
    status, out, err = cmake_args(
        tmp_path, release, "--archs", "native", "--nvidia-smi", str(smi), capsys=capsys
    )
    if archs is None:
        assert status == cudabuild.REFUSED
        assert refusal is not None
        assert refusal in err
    else:
        assert f"-DCMAKE_CUDA_ARCHITECTURES={archs} " in out


def test_native_without_nvidia_smi_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-nvidia-smi")
    status, _, err = cmake_args(tmp_path, "12.4", "--archs", "native", "--nvidia-smi", missing, capsys=capsys)
    assert status == cudabuild.REFUSED
    assert "nvidia-smi does not answer" in err


def test_an_nvcc_that_cannot_list_its_architectures_uses_the_release_notes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nvcc = fake_nvcc(tmp_path, "13.0", list_gpu_arch=False)
    assert cudabuild.main(["cmake-args", "--nvcc", str(nvcc), "--archs", "61"]) == cudabuild.REFUSED
    assert "CUDA 13 dropped" in capsys.readouterr().err
    assert cudabuild.main(["cmake-args", "--nvcc", str(nvcc), "--archs", "88"]) == 0


def test_no_nvcc_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudabuild, "find_nvcc", lambda _given=None: None)
    assert cudabuild.main(["cmake-args"]) == cudabuild.REFUSED
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "no nvcc: install the NVIDIA CUDA toolkit" in err


def test_a_portable_build_turns_off_native_cpu_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = cmake_args(tmp_path, "12.4", "--portable", capsys=capsys)
    assert out.endswith(" -DGGML_NATIVE=off")


def test_dev_runs_it_before_edgellm_is_installed(tmp_path: Path) -> None:
    """`python3 ops/cudabuild.py` on the bare interpreter: the standard library is all it needs."""
    result = subprocess.run(
        [
            str(BASE_PYTHON),
            "-I",
            str(REPO / "ops" / "cudabuild.py"),
            "cmake-args",
            "--nvcc",
            str(fake_nvcc(tmp_path, "12.8")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"-DGGML_CUDA=on {ALL_ARCHS} -DLLAVA_BUILD=off"


def test_check_says_the_installed_build_here_is_cpu_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cudabuild.main(["check", "--archs", "90"]) == cudabuild.NOT_BUILT
    assert "is a CPU-only build (backends: CPU)" in capsys.readouterr().err
    assert cudabuild.main(["check", "--cmake-args", f"-DGGML_CUDA=on {ALL_ARCHS}"]) == cudabuild.NOT_BUILT


def test_requirement_pins_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cudabuild.main(["requirement"]) == 0
    assert capsys.readouterr().out.strip() == f"llama-cpp-python=={metadata.version('llama-cpp-python')}"


@pytest.mark.parametrize(
    ("arch", "compiled", "expected"),
    [
        (90, DEFAULT_ARCHS, ("exact", 90)),
        (61, DEFAULT_ARCHS, ("exact", 61)),
        (86, (80, 90), ("same_major", 80)),
        (90, (61, 70, 75, 80, 86, 89), ("other_major", 89)),
        (61, (75, 80, 86, 89, 90), ("none", None)),
        (120, DEFAULT_ARCHS, ("other_major", 90)),
    ],
)
def test_coverage(arch: int, compiled: tuple[int, ...], expected: tuple[str, int | None]) -> None:
    assert coverage(arch, compiled) == expected


def test_architectures_round_trip_through_cmake_args() -> None:
    assert architectures_in(f"-DGGML_CUDA=on {ALL_ARCHS} -DLLAVA_BUILD=off") == DEFAULT_ARCHS
    assert architectures_in("-DGGML_CUDA=on") == ()
    assert parse_archs("61-virtual 90a") == (61, 90)
