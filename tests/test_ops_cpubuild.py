"""ops/cpubuild.py: the AMX probe's verdicts, the flags it gives, and the compiler and build here."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from edgellmctl import cpubuild
from edgellmctl.cpubuild import AMX_FLAGS, NO_AMX, Verdict, cmake_args, cpu_flags, probe

AMX_CPU = frozenset({"avx2", "avx512f", *AMX_FLAGS})
CXX = shutil.which("c++")


class FakeRunner:
    """Answers the compile with `built` and the probe run with `ran`, and records the calls."""

    def __init__(self, ran: subprocess.CompletedProcess[str] | Exception, built: int = 0) -> None:
        self.ran, self.built = ran, built
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        if len(self.calls) == 1:
            # Built as ggml builds its kernels.
            assert "-march=native" in argv
            assert "-O3" in argv
            Path(argv[argv.index("-o") + 1]).write_text("")
            return subprocess.CompletedProcess(
                argv, self.built, "", "probe.cpp:1: error: no AMX" if self.built else ""
            )
        if isinstance(self.ran, Exception):
            raise self.ran
        return self.ran


def answer(stdout: str, returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], returncode, stdout, "")


def test_a_cpu_without_amx_is_not_probed() -> None:
    run = FakeRunner(answer("works"))
    verdict = probe(frozenset({"avx2", "avx512f", "amx_tile"}), "/usr/bin/c++", run)
    assert not verdict.broken
    assert "amx_int8, avx512_vnni missing" in verdict.line
    assert run.calls == []


@pytest.mark.parametrize(
    ("ran", "broken", "said"),
    [
        (answer("works\n"), False, "builds working AMX code"),
        (answer("absent\n"), False, "builds no AMX code here"),
        (answer("", -11), True, "dies here (SIGSEGV loading a tile configuration)"),
        (answer("", -4), True, "dies here (SIGILL"),
        (answer("wrong\n"), True, "loads a wrong AMX tile configuration"),
        (answer("refused\n"), True, "the kernel refuses AMX"),
        (answer("garbage", 3), True, "the AMX probe failed (status 3, garbage)"),
        (subprocess.TimeoutExpired(["probe"], 60), True, "did not finish"),
    ],
)
def test_the_probe_verdicts(
    ran: subprocess.CompletedProcess[str] | Exception, broken: bool, said: str
) -> None:
    run = FakeRunner(ran)
    verdict = probe(AMX_CPU, "/usr/bin/c++", run)
    assert verdict.broken is broken
    assert said in verdict.line
    assert len(run.calls) == 2


def test_a_compiler_that_cannot_build_the_probe_leaves_the_build_alone() -> None:
    run = FakeRunner(answer("works"), built=1)
    verdict = probe(AMX_CPU, "/usr/bin/c++", run)
    assert not verdict.broken
    assert "cannot compile the AMX probe (probe.cpp:1: error: no AMX)" in verdict.line
    assert len(run.calls) == 1
    assert not probe(AMX_CPU, None, run).broken


def test_the_flags_leave_every_amx_extension_out_and_survive_cmake_args_splitting() -> None:
    assert cmake_args(Verdict(False, "")) == ""
    words = shlex.split(cmake_args(Verdict(True, "")))  # as scikit-build-core splits CMAKE_ARGS
    assert words == [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def test_cpu_flags_are_the_first_processors(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "amx_tile"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("order", ["flags first", "flags last"])
def test_the_flags_take_amx_out_of_a_build_for_an_amx_cpu(order: str) -> None:
    """CMake puts -march=native after CMAKE_CXX_FLAGS: the -mno-amx-* must win from either side.
    Sapphire Rapids stands for an AMX CPU, so that this holds on any x86 machine."""
    assert CXX is not None
    march = ["-march=sapphirerapids"]
    flags = NO_AMX.split()
    argv = [CXX, *(flags + march if order == "flags first" else march + flags), "-dM", "-E", "-x", "c++", "-"]
    with_amx = subprocess.run(
        [CXX, *march, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True, check=False
    )
    if with_amx.returncode != 0:
        pytest.skip(f"{CXX} does not know Sapphire Rapids")
    assert "__AMX_INT8__" in with_amx.stdout
    macros = subprocess.run(argv, input="", capture_output=True, text=True, check=True).stdout
    assert [m for m in ("__AMX_INT8__", "__AMX_TILE__", "__AMX_BF16__") if m in macros] == []
    assert "__AVX512VNNI__" in macros  # the rest of the CPU's features stay


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_the_probe_source_compiles_for_an_amx_cpu(tmp_path: Path) -> None:
    assert CXX is not None
    source = tmp_path / "probe.cpp"
    source.write_text(cpubuild.PROBE_SOURCE)
    built = subprocess.run(
        [CXX, "-O3", "-march=sapphirerapids", "-c", "-o", str(tmp_path / "probe.o"), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if "sapphirerapids" in built.stderr:
        pytest.skip(f"{CXX} does not know Sapphire Rapids")
    assert built.returncode == 0, built.stderr
    assert (
        "ldtilecfg"
        in subprocess.run(
            ["objdump", "-d", str(tmp_path / "probe.o")], capture_output=True, text=True, check=True
        ).stdout
    )


@pytest.mark.skipif(not cpu_flags() >= AMX_FLAGS or CXX is None, reason="this CPU has no AMX")
def test_on_an_amx_cpu_the_probe_itself_is_right(tmp_path: Path) -> None:
    """Unoptimised, the compiler keeps every store: the probe must then find AMX working, so
    that a `broken` verdict here speaks of the compiler's optimised code, not of the probe."""
    assert CXX is not None
    source, binary = tmp_path / "probe.cpp", tmp_path / "probe"
    source.write_text(cpubuild.PROBE_SOURCE)
    subprocess.run([CXX, "-O0", "-march=native", "-o", str(binary), str(source)], check=True)
    assert subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.strip() == "works"
    print(probe(cpu_flags(), CXX).line)


def test_the_installed_llama_cpp_is_safe_on_this_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The build ./dev made: where the probe finds AMX broken here, it has no AMX kernels."""
    assert cpubuild.main(["check"]) == 0, capsys.readouterr().err
    assert "the installed llama.cpp is safe on this CPU" in capsys.readouterr().out
