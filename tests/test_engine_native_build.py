"""What the loaded llama.cpp build can do: the real CPU build here, and CUDA builds' system info parsed."""

from __future__ import annotations

import pytest

from edgellmd.engine.config import cuda_archs_of, parse_system_info
from edgellmd.engine.native import build_info

# llama_print_system_info() of CUDA builds, as ggml-cuda's get_features writes it (ARCHS is
# nvcc's __CUDA_ARCH_LIST__): a default EDGELLM_CUDA=1 build on CUDA 12.x, one for the local
# H200 only, a Blackwell build, and one from an nvcc too old to define the list.
CUDA12_DEFAULT = (
    "CUDA : ARCHS = 610,700,750,800,860,890,900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
    "OPENMP = 1 | REPACK = 1 | "
)
H200_ONLY = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : AVX2 = 1 | "
BLACKWELL = "CUDA : ARCHS = 750,800,860,890,900,1200 | BLACKWELL_NATIVE_FP4 = 1 | CPU : AVX2 = 1 | "
NO_LIST = "CUDA : USE_GRAPHS = 1 | CPU : AVX2 = 1 | "


def test_the_cpu_build_here_reports_the_cpu_backend_only() -> None:
    build = build_info()
    assert build.backends == ("CPU",)
    assert build.cuda_archs == ()
    assert build.gpu_offload is False
    assert [d.type for d in build.devices] == ["cpu"]
    assert build.devices[0].name == "CPU"
    assert 0 < build.devices[0].memory_free <= build.devices[0].memory_total
    assert build.system_info.startswith("CPU : ")
    assert build.features["CPU"], build.system_info  # the CPU's SIMD flags as llama.cpp sees them


@pytest.mark.parametrize(
    ("text", "archs"),
    [
        (CUDA12_DEFAULT, (61, 70, 75, 80, 86, 89, 90)),
        (H200_ONLY, (90,)),
        (BLACKWELL, (75, 80, 86, 89, 90, 120)),
        (NO_LIST, None),
        ("CPU : AVX2 = 1 | ", ()),
        ("", ()),
    ],
)
def test_cuda_architectures_come_from_the_system_info(text: str, archs: tuple[int, ...] | None) -> None:
    assert cuda_archs_of(parse_system_info(text)) == archs


def test_the_system_info_parses_into_backends_and_features() -> None:
    assert parse_system_info(CUDA12_DEFAULT)["CUDA"] == {
        "ARCHS": "610,700,750,800,860,890,900",
        "USE_GRAPHS": "1",
        "PEER_MAX_BATCH_SIZE": "128",
    }
    assert parse_system_info(CUDA12_DEFAULT)["CPU"]["REPACK"] == "1"
    # A backend that lists no feature runs straight into the next one.
    assert parse_system_info("BLAS : CPU : AVX2 = 1 | ") == {"BLAS": {}, "CPU": {"AVX2": "1"}}
