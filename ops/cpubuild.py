"""CPU builds of llama-cpp-python: keep out the AMX kernels where this machine's compiler breaks them.

llama.cpp compiles for the build machine's CPU (`-march=native`). On a CPU with AMX (Intel
Xeon from Sapphire Rapids on) that brings in ggml's AMX matrix kernels, which load their
tile configuration from a local struct with `_tile_loadconfig`. GCC 12 (Debian 12's
compiler) declares that intrinsic as reading 8 bytes of the struct, so with optimization it
drops the stores that set the tiles' rows and columns, and `ldtilecfg` loads whatever the
stack held. Every batch of more than one row then dies: SIGSEGV (`ldtilecfg` refuses the
garbage) or SIGILL (a tile instruction on tiles never configured). A one-token decode uses
other kernels, so a model loads and warms up, and the first prompt crashes the daemon.

This module compiles and runs a probe with the compiler CMake will use, built the way ggml
builds its kernels, and where the probe fails it gives the CMake flags that leave AMX out
(`-mno-amx-*`, which win over `-march=native` wherever they stand on the command line). The
build is otherwise as native as before; llama.cpp falls back to its AVX-512 kernels.

`./dev` runs this file with the bare interpreter before edgellm is installed, so it imports
nothing beyond the standard library at module level; `check` alone imports edgellm (to ask the
installed llama.cpp what it was built with).

    python3 ops/cpubuild.py cmake-args    # extra CMAKE_ARGS (often none); why, on stderr
    python3 ops/cpubuild.py probe         # what the probe found, one line
    python3 ops/cpubuild.py check         # exit 1: the installed build has AMX kernels that break here
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

NOT_SAFE: Final = 1  # `check`: the installed build holds the kernels the probe found broken
# What ggml needs to compile its AMX kernels (ggml-cpu/amx: __AMX_INT8__ and __AVX512VNNI__).
AMX_FLAGS: Final = frozenset({"amx_tile", "amx_int8", "avx512_vnni"})
NO_AMX: Final = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PROBE_TIMEOUT_S: Final = 60.0  # compiling and running a 40-line file

# ggml's pattern (amx/mmq.cpp, ggml_tile_config_init): a zero-initialised config on the stack,
# rows and column bytes set, loaded once. The check reads the loaded config back in another
# function, so nothing keeps the first one's stores alive but the load itself.
PROBE_SOURCE: Final = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <sys/syscall.h>
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#include <immintrin.h>
struct tile_config_t {
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};
__attribute__((noinline)) static void load(int rows) {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        tc.rows[t] = (uint8_t)(t < 2 ? rows / 2 : rows);
        tc.colsb[t] = (uint16_t)(t == 2 || t == 3 ? 32 : 64);
    }
    _tile_loadconfig(&tc);
}
__attribute__((noinline)) static int loaded_right(int rows) {
    alignas(64) unsigned char back[64];
    memset(back, 0xAA, sizeof back);
    _tile_storeconfig(back);
    __asm__ __volatile__("" ::: "memory");
    if (back[0] != 1) return 0;
    for (int t = 0; t < 8; t++) {
        unsigned colsb = back[16 + 2 * t] | (back[17 + 2 * t] << 8);
        if (back[48 + t] != (t < 2 ? rows / 2 : rows) || colsb != (t == 2 || t == 3 ? 32u : 64u)) return 0;
    }
    return 1;
}
int main(int argc, char **argv) {
    (void)argv;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        puts("refused");
        return 0;
    }
    int rows = 15 + argc;  // 16, unknown to the compiler
    load(rows);
    _tile_zero(4);
    puts(loaded_right(rows) ? "works" : "wrong");
    _tile_release();
    return 0;
}
#else
int main() { puts("absent"); return 0; }
#endif
"""


@dataclass(frozen=True)
class Verdict:
    """What the probe found: `broken` means leave AMX out of the build."""

    broken: bool
    line: str


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags in /proc/cpuinfo's text (x86 `flags`, arm `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return parse_flags(cpuinfo.read_text(errors="replace"))
    except OSError:
        return frozenset()


def compiler() -> str | None:
    """The C++ compiler CMake will pick: $CXX, else c++ on the PATH."""
    named = os.environ.get("CXX", "").strip()
    if named:
        return shutil.which(named.split()[0]) and named.split()[0]
    return shutil.which("c++")


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    # Our own compiler and probe binary, never input from elsewhere.
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)  # noqa: S603


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def probe(flags: frozenset[str], cxx: str | None, run: Runner = _run) -> Verdict:
    """Compile and run the AMX probe where the CPU has AMX; the verdict in one line."""
    missing = AMX_FLAGS - flags
    if missing:
        return Verdict(
            False, f"no AMX on this CPU ({', '.join(sorted(missing))} missing): nothing to leave out"
        )
    if cxx is None:
        return Verdict(False, "no C++ compiler to probe AMX with (the llama.cpp build needs one too)")
    with tempfile.TemporaryDirectory(prefix="edgellm-amx-") as tmp:
        source, binary = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        source.write_text(PROBE_SOURCE)
        try:
            built = run([cxx, "-O3", "-march=native", "-o", str(binary), str(source)])
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Verdict(False, f"the AMX probe could not be compiled ({exc}): the build is left as it is")
        if built.returncode != 0:
            first = (built.stderr.strip().splitlines() or ["no message"])[0]
            return Verdict(False, f"{cxx} cannot compile the AMX probe ({first}): the build is left as it is")
        try:
            ran = run([str(binary)])
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Verdict(True, f"the AMX probe did not finish ({exc}): AMX is left out")
    answer = ran.stdout.strip()
    if ran.returncode < 0:
        return Verdict(
            True,
            f"{cxx} -march=native builds AMX code that dies here ({_signal_name(ran.returncode)} loading a "
            "tile configuration): AMX is left out of llama.cpp",
        )
    if ran.returncode != 0 or answer not in ("works", "wrong", "refused", "absent"):
        return Verdict(
            True, f"the AMX probe failed (status {ran.returncode}, {answer or 'no output'}): AMX is left out"
        )
    if answer == "wrong":
        return Verdict(
            True, f"{cxx} -march=native loads a wrong AMX tile configuration: AMX is left out of llama.cpp"
        )
    if answer == "refused":
        return Verdict(
            True, "the kernel refuses AMX to this process (arch_prctl): AMX is left out of llama.cpp"
        )
    if answer == "absent":
        return Verdict(False, f"{cxx} -march=native builds no AMX code here: nothing to leave out")
    return Verdict(False, f"{cxx} builds working AMX code: llama.cpp keeps its AMX kernels")


def cmake_args(verdict: Verdict) -> str:
    """The extra CMAKE_ARGS for the verdict (empty when nothing is to be left out)."""
    if not verdict.broken:
        return ""
    return f'-DCMAKE_C_FLAGS="{NO_AMX}" -DCMAKE_CXX_FLAGS="{NO_AMX}"'


def installed_has_amx() -> bool:
    """Whether the installed llama.cpp was compiled with AMX kernels (its own system report)."""
    from edgellmd.engine.native import build_info  # noqa: PLC0415 - ./dev runs this file before edgellm is installed

    return build_info().features.get("CPU", {}).get("AMX_INT8") == "1"


def main(argv: Sequence[str] | None = None, run: Runner = _run) -> int:
    """The command line; see the module's docstring."""
    parser = argparse.ArgumentParser(prog="edgellmctl.cpubuild", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cmake-args", help="print the extra CMAKE_ARGS for this machine (often none)")
    sub.add_parser("probe", help="say what the AMX probe finds")
    sub.add_parser("check", help="exit 1 if the installed build has AMX kernels that break here")
    args = parser.parse_args(argv)
    verdict = probe(cpu_flags(), compiler(), run)
    if args.command == "probe":
        print(verdict.line)
        return 0
    if args.command == "cmake-args":
        if verdict.broken:
            print(f"note: {verdict.line}", file=sys.stderr)
        print(cmake_args(verdict))
        return 0
    if verdict.broken and installed_has_amx():
        print(f"the installed llama.cpp has AMX kernels, and {verdict.line}", file=sys.stderr)
        return NOT_SAFE
    print("the installed llama.cpp is safe on this CPU" + ("" if verdict.broken else f" ({verdict.line})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
