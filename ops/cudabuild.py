"""CUDA builds of llama-cpp-python: the CMake flags for a toolkit, and whether the installed build has them.

`./dev` runs this file with the bare interpreter before edgellm is installed (`python3
ops/cudabuild.py cmake-args`), so it imports nothing beyond the standard library at module
level; `check` alone needs edgellm (it asks the installed llama.cpp what it was built for).

    python -m edgellmctl.cudabuild cmake-args [--archs "61;90" | native] [--nvcc PATH] [--portable]
    python -m edgellmctl.cudabuild check [--archs ... | --cmake-args "..."]
    python -m edgellmctl.cudabuild requirement

Architectures are CMake's numbers for compute capabilities (61 is 6.1, a Tesla P40; 90 is
9.0, an H100 or H200). A refusal is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final

# Pascal (P40, GeForce 10) to Hopper (H100, H200): what edgellm builds for when not told.
DEFAULT_ARCHS: Final = (61, 70, 75, 80, 86, 89, 90)
NATIVE: Final = "native"
REFUSED: Final = 2  # exit status of a refusal
NOT_BUILT: Final = 1  # `check`: the installed build lacks what was asked
_NAMES: Final = {
    50: "Maxwell",
    52: "Maxwell",
    53: "Maxwell",
    60: "Pascal",
    61: "Pascal",
    62: "Pascal",
    70: "Volta",
    72: "Volta",
    75: "Turing",
    80: "Ampere",
    86: "Ampere",
    87: "Ampere",
    88: "Ampere",
    89: "Ada Lovelace",
    90: "Hopper",
    100: "Blackwell",
    101: "Blackwell",
    103: "Blackwell",
    110: "Blackwell",
    120: "Blackwell",
    121: "Blackwell",
}
# When each virtual architecture (compute_XX) came to nvcc and, for some, left it, from
# NVIDIA's CUDA release notes. Used only when `nvcc --list-gpu-arch` gives no answer.
_ADDED: Final = {
    86: (11, 1),
    87: (11, 4),
    89: (11, 8),
    90: (11, 8),
    100: (12, 8),
    101: (12, 8),
    120: (12, 8),
    103: (12, 9),
    121: (12, 9),
    88: (13, 0),
    110: (13, 0),
}
_REMOVED: Final = {35: (12, 0), 37: (12, 0), 101: (13, 0)}  # 101 became 110 in CUDA 13
_CUDA13_FLOOR: Final = 75  # CUDA 13 dropped Maxwell, Pascal and Volta
_BASE: Final = (35, 37, 50, 52, 53, 60, 61, 62, 70, 72, 75, 80)  # CUDA 11.0
_RELEASE: Final = re.compile(r"release (\d+)\.(\d+)")
_ARCH: Final = re.compile(r"^(\d+)([af]?)(-real|-virtual)?$")
_REQUIREMENT: Final = re.compile(r"^llama[-_]cpp[-_]python\b", re.IGNORECASE)
_PYPROJECT: Final = Path(__file__).resolve().parent.parent / "pyproject.toml"


class Refused(Exception):
    """A request this toolkit or machine cannot build; the message is the one line to print."""


@dataclass(frozen=True, slots=True)
class Toolkit:
    """An nvcc: its release and the virtual architectures it compiles for."""

    version: tuple[int, int]
    archs: frozenset[int]

    @property
    def name(self) -> str:
        return f"CUDA {self.version[0]}.{self.version[1]}"


def cc_name(arch: int) -> str:
    """61 -> "6.1", 120 -> "12.0"."""
    return f"{arch // 10}.{arch % 10}"


def family(arch: int) -> str:
    """61 -> "Pascal"; "" when unknown."""
    return _NAMES.get(arch, "")


def parse_nvcc_version(text: str) -> tuple[int, int]:
    """`nvcc --version` -> (12, 4), from its "Cuda compilation tools, release 12.4, V12.4.131" line."""
    match = _RELEASE.search(text)
    if match is None:
        raise Refused("cannot read the CUDA release from `nvcc --version`")
    return int(match.group(1)), int(match.group(2))


def parse_gpu_arch_list(text: str) -> frozenset[int]:
    """`nvcc --list-gpu-arch` (compute_75, compute_90, compute_90a, ...) -> {75, 90}."""
    return frozenset(int(m) for m in re.findall(r"^compute_(\d+)[af]?\s*$", text, re.M))


def known_archs(version: tuple[int, int]) -> frozenset[int]:
    """The virtual architectures a CUDA release compiles for, by the release notes."""
    archs = set(_BASE)
    for arch, since in _ADDED.items():
        if version >= since:
            archs.add(arch)
    for arch, until in _REMOVED.items():
        if version >= until:
            archs.discard(arch)
    if version >= (13, 0):
        archs = {a for a in archs if a >= _CUDA13_FLOOR}
    return frozenset(archs)


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str] | None"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a tool and capture its output; None when it cannot be started."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired):
        return None


def find_nvcc(given: str | None = None) -> str | None:
    """The nvcc to ask: `given`, else $CUDACXX (either must be one), else PATH's, else /usr/local/cuda's."""
    named = given or os.environ.get("CUDACXX")
    if named:
        if not os.access(named, os.X_OK):
            raise Refused(f"{named} (--nvcc or CUDACXX) is not an executable nvcc")
        return named
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def read_toolkit(nvcc: str | None, run: Runner = _run) -> Toolkit:
    """Ask nvcc for its release and, where it can say (CUDA 11 on), the architectures it takes."""
    if nvcc is None:
        raise Refused(
            "no nvcc: install the NVIDIA CUDA toolkit (12.x for Pascal/Volta, 12.x or 13.x for "
            "Turing and newer) or set CUDACXX"
        )
    result = run([nvcc, "--version"])
    if result is None or result.returncode != 0:
        raise Refused(f"{nvcc} --version failed: is the CUDA toolkit installed?")
    version = parse_nvcc_version(result.stdout)
    listed = run([nvcc, "--list-gpu-arch"])
    archs = (
        parse_gpu_arch_list(listed.stdout) if listed is not None and listed.returncode == 0 else frozenset()
    )
    return Toolkit(version, archs or known_archs(version))


def local_archs(run: Runner = _run, nvidia_smi: str = "nvidia-smi") -> tuple[int, ...]:
    """This machine's GPUs' compute capabilities (nvidia-smi), as architectures: (61,) for a P40."""
    result = run([nvidia_smi, "--query-gpu=compute_cap", "--format=csv,noheader"])
    if result is None or result.returncode != 0:
        raise Refused(
            "EDGELLM_CUDA_ARCHS=native needs this machine's GPUs, but nvidia-smi does not answer: "
            "name the architectures instead (e.g. EDGELLM_CUDA_ARCHS=90)"
        )
    found = {int(m.group(1)) * 10 + int(m.group(2)) for m in re.finditer(r"(\d+)\.(\d)", result.stdout)}
    if not found:
        raise Refused("EDGELLM_CUDA_ARCHS=native: nvidia-smi lists no GPU on this machine")
    return tuple(sorted(found))


def parse_archs(spec: str) -> tuple[int, ...]:
    """ "61;70,90-real 90a" -> (61, 70, 90): CMake's list, suffixes dropped (edgellm adds its own)."""
    out: set[int] = set()
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        match = _ARCH.match(item)
        if match is None:
            raise Refused(
                f"not a CUDA architecture: {item[:20]!r} (expected numbers such as 61;75;90, or native)"
            )
        out.add(int(match.group(1)))
    if not out:
        raise Refused("no CUDA architecture given (expected numbers such as 61;75;90, or native)")
    return tuple(sorted(out))


def _why_not(archs: Sequence[int], toolkit: Toolkit) -> str:
    """Why `toolkit` cannot build `archs` (all refused for the same reason), and which toolkit can."""
    ccs = ", ".join(cc_name(a) + (f" ({family(a)})" if family(a) else "") for a in archs)
    what = f"{toolkit.name} cannot build for compute capability {ccs}"
    listed = ";".join(str(a) for a in archs)
    if toolkit.version >= (13, 0) and max(archs) < _CUDA13_FLOOR:
        return (
            f"{what}: CUDA 13 dropped Maxwell, Pascal and Volta (below 7.5); build with CUDA 12.x "
            f"(every 12.x release still does) and EDGELLM_CUDA_ARCHS={listed}"
        )
    since = max((_ADDED.get(a, (0, 0)) for a in archs), default=(0, 0))
    if toolkit.version < since:
        return f"{what}: that needs CUDA {since[0]}.{since[1]} or newer"
    return f"{what} (nvcc --list-gpu-arch does not list compute_{archs[0]})"


@dataclass(frozen=True, slots=True)
class Plan:
    """The architectures to build and why some were left out."""

    archs: tuple[int, ...]
    left_out: tuple[int, ...]  # defaults the toolkit cannot build

    def cmake_architectures(self) -> str:
        """61-real;...;89-real;90: machine code for each, PTX only for the newest (newer GPUs JIT it)."""
        *older, newest = self.archs
        return ";".join([f"{a}-real" for a in older] + [str(newest)])


def plan(spec: str | None, toolkit: Toolkit, local: Callable[[], tuple[int, ...]]) -> Plan:
    """Which architectures to build: the request (or edgellm's defaults) against the toolkit."""
    if spec is None or not spec.strip():
        defaults: tuple[int, ...] = tuple(a for a in DEFAULT_ARCHS if a in toolkit.archs)
        if not defaults:
            raise Refused(
                f"{toolkit.name} builds none of edgellm's architectures ({_listing(DEFAULT_ARCHS)})"
            )
        return Plan(defaults, tuple(a for a in DEFAULT_ARCHS if a not in toolkit.archs))
    archs = local() if spec.strip() == NATIVE else parse_archs(spec)
    for arch in archs:
        if arch not in toolkit.archs:
            raise Refused(_why_not([arch], toolkit))
    return Plan(archs, ())


def cmake_args(plan_: Plan, *, portable: bool = False) -> str:
    """CMAKE_ARGS for llama-cpp-python's build (scikit-build-core splits it like a shell)."""
    args = ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={plan_.cmake_architectures()}"]
    # edgellm serves text only: llama-cpp-python's multimodal library (mtmd) is not built.
    args.append("-DLLAVA_BUILD=off")
    if portable:  # a wheel for other machines: AVX2 and friends, not this CPU's every extension
        args.append("-DGGML_NATIVE=off")
    return " ".join(args)


def _listing(archs: Iterable[int]) -> str:
    return ", ".join(cc_name(a) for a in archs)


# ---- how a build's architectures run on a GPU (also `edgellmctl doctor`'s) -----------------


def coverage(arch: int, compiled: Iterable[int]) -> tuple[str, int | None]:
    """How a build compiled for `compiled` runs on a GPU of architecture `arch` (61, 90, ...).

    ("exact", arch): its own machine code. ("same_major", a): machine code of an older GPU of
    its family, which it runs (8.0 code on an 8.6 card), without the newer kernels.
    ("other_major", a): only older code of another family, which a GPU runs only JIT-compiled
    from PTX, if the build embedded PTX for it, and never tuned for it. ("none", None): no code
    at or below it; llama.cpp picks the newest compiled architecture at or below the GPU's, so
    it has nothing to run there.
    """
    below = [a for a in compiled if a <= arch]
    if arch in below:
        return "exact", arch
    if not below:
        return "none", None
    best = max(below)
    return ("same_major" if best // 10 == arch // 10 else "other_major"), best


def rebuild_hint(arch: int) -> str:
    """The fix for a build that lacks `arch`."""
    if arch < _CUDA13_FLOOR:
        return (
            f"rebuild llama-cpp-python with CUDA 12.x (CUDA 13 dropped {family(arch) or 'it'}) and "
            f"EDGELLM_CUDA_ARCHS={arch}: EDGELLM_CUDA=1 EDGELLM_CUDA_ARCHS={arch} ./dev demo "
            "(Ansible: edgellm_cuda_archs)"
        )
    return (
        f"rebuild llama-cpp-python with EDGELLM_CUDA_ARCHS={arch} (or the defaults, which include it): "
        f"EDGELLM_CUDA=1 ./dev demo (Ansible: edgellm_cuda_archs)"
    )


# ---- the installed build ---------------------------------------------------------------------


def architectures_in(cmake: str) -> tuple[int, ...]:
    """The -DCMAKE_CUDA_ARCHITECTURES=... of CMAKE_ARGS as architectures; () when absent."""
    match = re.search(r"-DCMAKE_CUDA_ARCHITECTURES=(\S+)", cmake)
    return parse_archs(match.group(1)) if match else ()


def check_installed(wanted: Sequence[int]) -> tuple[bool, str]:
    """Whether the installed llama-cpp-python is a CUDA build with machine code for every `wanted`."""
    from edgellmd.engine.native import build_info  # noqa: PLC0415 - loads llama.cpp; this file runs without it

    build = build_info()
    if "CUDA" not in build.backends:
        return (
            False,
            f"the installed llama-cpp-python is a CPU-only build (backends: {', '.join(build.backends)})",
        )
    if build.cuda_archs is None:
        return False, "the installed CUDA build does not list its architectures (nvcc before 11.5?)"
    shown = _listing(build.cuda_archs)
    missing = [a for a in wanted if coverage(a, build.cuda_archs)[0] != "exact"]
    if missing:
        return False, f"the installed CUDA build has {shown}, not {_listing(missing)}"
    return True, f"the installed llama-cpp-python is a CUDA build for {shown}"


def requirement(pyproject: Path = _PYPROJECT) -> str:
    """What to pip install: the installed llama-cpp-python's exact version, else edgellm's range."""
    try:
        return f"llama-cpp-python=={metadata.version('llama-cpp-python')}"
    except metadata.PackageNotFoundError:
        pass
    try:
        deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    except OSError as exc:
        raise Refused(
            f"llama-cpp-python is not installed and {pyproject} cannot be read: {exc.strerror}"
        ) from None
    return str(next(d for d in deps if _REQUIREMENT.match(d)))


# ---- the command -------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, run: Runner = _run) -> int:
    """The command line; see the module's docstring."""
    parser = argparse.ArgumentParser(prog="edgellmctl.cudabuild", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    args_p = sub.add_parser("cmake-args", help="print CMAKE_ARGS for a CUDA build of llama-cpp-python")
    args_p.add_argument(
        "--archs", help='architectures: "61;70;90", "native" (this machine\'s GPUs); default: 61..90'
    )
    args_p.add_argument("--nvcc", help="nvcc to ask (default: $CUDACXX, PATH, /usr/local/cuda/bin/nvcc)")
    args_p.add_argument("--nvidia-smi", default="nvidia-smi", help="for --archs native")
    args_p.add_argument(
        "--portable", action="store_true", help="a wheel for other machines (-DGGML_NATIVE=off)"
    )
    check_p = sub.add_parser("check", help="exit 0 if the installed build is CUDA with these architectures")
    check_p.add_argument("--archs", help='architectures that must be compiled in ("61;90", native)')
    check_p.add_argument("--cmake-args", help="take the architectures from CMAKE_ARGS")
    check_p.add_argument("--nvidia-smi", default="nvidia-smi", help="for --archs native")
    sub.add_parser("requirement", help="print the llama-cpp-python requirement to build")
    args = parser.parse_args(argv)
    try:
        if args.command == "requirement":
            print(requirement())
            return 0

        def local() -> tuple[int, ...]:  # asked only for native
            return local_archs(run, args.nvidia_smi)

        if args.command == "check":
            wanted: tuple[int, ...] = ()
            if args.cmake_args:
                wanted = architectures_in(args.cmake_args)
            elif args.archs:
                wanted = local() if args.archs.strip() == NATIVE else parse_archs(args.archs)
            ok, line = check_installed(wanted)
            print(line, file=sys.stdout if ok else sys.stderr)
            return 0 if ok else NOT_BUILT
        toolkit = read_toolkit(find_nvcc(args.nvcc), run)
        chosen = plan(args.archs, toolkit, local)
        if chosen.left_out:
            print(f"note: left out of the defaults: {_why_not(chosen.left_out, toolkit)}", file=sys.stderr)
        print(cmake_args(chosen, portable=args.portable))
    except Refused as exc:
        print(f"edgellm CUDA build: {exc}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
