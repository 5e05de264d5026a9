"""`./dev`'s llama.cpp build paths: what it asks pip for with EDGELLM_CUDA=1, against fake nvcc
releases, and where ops/cpubuild.py finds the compiler breaks the AMX kernels."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parent.parent
NVCC_DATA: Final = REPO / "tests" / "data" / "nvcc"
BASE_PYTHON: Final = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
FUNCTIONS: Final = ("install_python", "build_llama", "install_cuda_llama")
NO_AMX: Final = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_ARGS: Final = f'-DCMAKE_C_FLAGS="{NO_AMX}" -DCMAKE_CXX_FLAGS="{NO_AMX}"'


def _function(name: str) -> str:
    found = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", (REPO / "dev").read_text(), re.MULTILINE | re.DOTALL)
    assert found, f"dev has no {name}"
    return found.group(0)


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_install(
    tmp_path: Path,
    *,
    release: str | None,
    env: dict[str, str],
    installed: bool = False,
    built: bool = False,
    amx: str = "absent",
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """dev's install_python with a stand-in venv python that logs what it is asked (pip never runs).

    The stand-in runs ops/cudabuild.py for real, on the bare interpreter, as dev does;
    `installed`: pip show finds llama-cpp-python; `built`: cudabuild check passes from the start
    (else it fails until pip has installed something, as on a fresh venv). `amx`: "absent" (the
    probe finds nothing to leave out), "broken" (it does; a build made with its flags is safe) or
    "cached" (broken, and pip's wheel cache hands back a build with the AMX kernels for edgellm's
    own install, so that only a rebuild of llama-cpp-python itself is safe).
    """
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if release is not None:
        _executable(
            bin_dir / "nvcc",
            f'#!/bin/sh\ncase "$1" in --version) cat "{NVCC_DATA}/cuda-{release}.version.txt" ;;\n'
            f'--list-gpu-arch) cat "{NVCC_DATA}/cuda-{release}.list-gpu-arch.txt" ;; esac\n',
        )
    fake_python = _executable(
        tmp_path / "python",
        f"""#!/bin/sh
if [ "$1" = ops/cudabuild.py ]; then exec "{BASE_PYTHON}" "$@"; fi
echo "CMAKE_ARGS=${{CMAKE_ARGS:-}} FORCE_CMAKE=${{FORCE_CMAKE:-}} $*" >> "{log}"
case "$1 $2" in
  "ops/cpubuild.py cmake-args") [ "{amx}" = absent ] || echo '{NO_AMX_ARGS}'; exit 0 ;;
  "ops/cpubuild.py check")
    [ "{amx}" = absent ] && exit 0
    pattern=" -m pip install .*llama"
    [ "{amx}" = cached ] || pattern=" -m pip install "
    grep -- "-mno-amx-int8" "{log}" | grep -q -- "$pattern"; exit $? ;;
esac
case "$1 $2 $3" in
  "-m pip show") exit {0 if installed else 1} ;;
  "-m edgellmctl.cudabuild check")
    [ -n "{"1" if built else ""}" ] || grep -q " -m pip install .*llama" "{log}" ;;
esac
""",
    )
    script = "set -euo pipefail\n" + "".join(_function(f) for f in FUNCTIONS) + "install_python demo\n"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("EDGELLM_", "CUDACXX"))}
    environ |= {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "PY": str(fake_python), "VENV": str(tmp_path)}
    environ |= env
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls


def pip_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if " -m pip install " in c]


def test_without_edgellm_cuda_the_build_stays_the_cpu_one(tmp_path: Path) -> None:
    result, calls = run_install(tmp_path, release="12.4", env={})
    assert result.returncode == 0, result.stderr
    assert pip_installs(calls) == [
        "CMAKE_ARGS= FORCE_CMAKE= -m pip install -q --upgrade pip",
        "CMAKE_ARGS= FORCE_CMAKE= -m pip install -q -e .[demo]",
    ]
    assert not [c for c in calls if "cudabuild" in c]


@pytest.mark.parametrize(
    ("release", "archs"),
    [
        ("11.8", "61-real;70-real;75-real;80-real;86-real;89-real;90"),
        ("12.4", "61-real;70-real;75-real;80-real;86-real;89-real;90"),
        ("12.8", "61-real;70-real;75-real;80-real;86-real;89-real;90"),
        ("13.0", "75-real;80-real;86-real;89-real;90"),
    ],
)
def test_edgellm_cuda_builds_llama_cpp_python_with_cuda_first(
    tmp_path: Path, release: str, archs: str
) -> None:
    result, calls = run_install(tmp_path, release=release, env={"EDGELLM_CUDA": "1"})
    assert result.returncode == 0, result.stderr
    flags = f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={archs} -DLLAVA_BUILD=off"
    assert pip_installs(calls)[1:] == [
        f"CMAKE_ARGS={flags} FORCE_CMAKE=1 -m pip install -q --no-cache-dir --no-binary llama-cpp-python "
        "llama-cpp-python>=0.3.36,<0.4",
        "CMAKE_ARGS= FORCE_CMAKE= -m pip install -q -e .[demo]",
    ]
    # ...and checks the result once edgellm is there to ask llama.cpp.
    assert calls[-1].endswith(f"-m edgellmctl.cudabuild check --cmake-args {flags}")
    if release == "13.0":
        assert (
            "note: left out of the defaults: CUDA 13.0 cannot build for compute capability 6.1"
            in result.stderr
        )


def test_a_cpu_build_is_replaced_in_place(tmp_path: Path) -> None:
    env = {"EDGELLM_CUDA": "1", "EDGELLM_CUDA_ARCHS": "90", "EDGELLM_LLAMA_SDIST": "/carry/llama.tar.gz"}
    result, calls = run_install(tmp_path, release="13.0", env=env, installed=True)
    assert result.returncode == 0, result.stderr
    assert pip_installs(calls)[1] == (
        "CMAKE_ARGS=-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off FORCE_CMAKE=1 "
        "-m pip install -q --no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python "
        "/carry/llama.tar.gz"
    )


def test_a_build_that_has_cuda_already_is_kept(tmp_path: Path) -> None:
    result, calls = run_install(
        tmp_path, release="12.4", env={"EDGELLM_CUDA": "1"}, installed=True, built=True
    )
    assert result.returncode == 0, result.stderr
    assert [c for c in pip_installs(calls) if "llama" in c] == []


@pytest.mark.parametrize(
    ("release", "archs", "refusal"),
    [
        ("13.0", "61", "CUDA 13.0 cannot build for compute capability 6.1 (Pascal)"),
        ("12.4", "120", "that needs CUDA 12.8 or newer"),
        (None, "", "no-such-nvcc (--nvcc or CUDACXX) is not an executable nvcc"),
    ],
)
def test_a_request_the_toolkit_cannot_build_stops_with_one_line(
    tmp_path: Path, release: str | None, archs: str, refusal: str
) -> None:
    env = {"EDGELLM_CUDA": "1", "EDGELLM_CUDA_ARCHS": archs} if archs else {"EDGELLM_CUDA": "1"}
    if release is None:
        env["CUDACXX"] = str(tmp_path / "no-such-nvcc")
    result, calls = run_install(tmp_path, release=release, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert refusal in result.stderr
    assert pip_installs(calls) == ["CMAKE_ARGS= FORCE_CMAKE= -m pip install -q --upgrade pip"]


def test_dev_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "dev")], check=True, timeout=30)


def test_where_amx_breaks_the_cpu_build_leaves_it_out(tmp_path: Path) -> None:
    result, calls = run_install(tmp_path, release=None, env={}, amx="broken")
    assert result.returncode == 0, result.stderr
    assert pip_installs(calls)[1:] == [f"CMAKE_ARGS={NO_AMX_ARGS} FORCE_CMAKE= -m pip install -q -e .[demo]"]
    assert calls[-1].endswith("ops/cpubuild.py check")  # asked once, and it was safe


def test_a_build_with_the_broken_amx_kernels_is_rebuilt_without_them(tmp_path: Path) -> None:
    result, calls = run_install(tmp_path, release=None, env={}, amx="cached", installed=True)
    assert result.returncode == 0, result.stderr
    assert pip_installs(calls)[2:] == [
        f"CMAKE_ARGS={NO_AMX_ARGS} FORCE_CMAKE=1 -m pip install -q --no-cache-dir --force-reinstall "
        "--no-deps --no-binary llama-cpp-python llama-cpp-python>=0.3.36,<0.4"
    ]
    assert "rebuilding llama-cpp-python without its AMX kernels" in result.stdout


def test_a_cuda_build_leaves_amx_out_too(tmp_path: Path) -> None:
    result, calls = run_install(
        tmp_path, release="12.4", env={"EDGELLM_CUDA": "1", "EDGELLM_CUDA_ARCHS": "90"}, amx="cached"
    )
    assert result.returncode == 0, result.stderr
    flags = f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off {NO_AMX_ARGS}"
    assert pip_installs(calls)[1] == (
        f"CMAKE_ARGS={flags} FORCE_CMAKE=1 -m pip install -q --no-cache-dir --no-binary llama-cpp-python "
        "llama-cpp-python>=0.3.36,<0.4"
    )
    # The CUDA build was made without AMX: no second build.
    assert [c for c in pip_installs(calls) if "llama-cpp-python" in c] == [pip_installs(calls)[1]]
