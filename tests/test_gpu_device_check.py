"""The device check's logic on a machine without a GPU: recorded H200 readings, its report, its plumbing.

tests/gpu/ runs on a GPU machine once (README there). Here: the comparisons and report of
tests/gpu/report.py on the recorded H200 (tests/data/nvml/, nvidia-smi's CSV of the same
card) and on faults made from it; the trimmed sdist; and device_check.py's own parts that
need no GPU, for real: a candidate shape probed in a child process, the daemon served,
read and benched.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pytest

from edgellmd.host.gpu import GpuReading
from edgellmd.host.nvml import read_gpus
from tests import fakenvml
from tests.gpu import device_check, report, trim_sdist
from tests.gpu.report import ProbeResult, compare_gpu, diagnose, mismatches, parse_smi_csv, read_offload

REPO: Final = Path(__file__).resolve().parent.parent
MIB: Final = 1024**2
# What nvidia-smi printed on the H200 whose NVML answers tests/data/nvml/h200.nvml.json holds
# (shared/data/nvml/h200.query.csv), and its `nvidia-smi -q` "Reserved" line (616 MiB).
H200_CSV: Final = (
    "name, compute_cap, driver_version, memory.total [MiB], memory.used [MiB], utilization.gpu [%], "
    "temperature.gpu, power.draw [W], clocks_event_reasons.active\n"
    "NVIDIA H200, 9.0, 580.159.04, 143771 MiB, 0 MiB, 0 %, 33, 120.60 W, 0x0000000000000001\n"
)
H200_RESERVED_MIB: Final = "616"
# The daemon's text log of a model loaded onto an H200, as llama.cpp reports it (at debug).
_NATIVE: Final = "2026-12-01 12:00:00,000 DEBUG edgellmd.engine.native [-] llama.cpp: "
GPU_LOG: Final = "".join(
    _NATIVE + line + "\n"
    for line in (
        "load_tensors: offloading 18 repeating layers to GPU",
        "load_tensors: offloading output layer to GPU",
        "load_tensors: offloaded 19/19 layers to GPU",
        "load_tensors:        CUDA0 model buffer size =   241.43 MiB",
        "load_tensors:   CPU_Mapped model buffer size =   170.00 MiB",
        "llama_kv_cache:      CUDA0 KV buffer size =    36.00 MiB",
        "llama_context: flash_attn            = auto",
        "resolve_fused_ops: Flash Attention enabled",
        "sched_reserve:      CUDA0 compute buffer size =   514.25 MiB",
    )
)
AUTO_LINE: Final = (
    "2026-12-01 12:00:00,000 INFO edgellmd.models.loader [-] model m: gpu_layers auto -> all: "
    "all layers fit in 139.8 GiB free VRAM less 1.0 GiB headroom\n"
)


def h200_reading() -> dict[str, Any]:
    """The recorded H200 as /admin/stats shows it (a GpuReading as JSON)."""
    (device,) = read_gpus(fakenvml.h200()).devices
    fields = {f.name: getattr(device, f.name) for f in dataclasses.fields(GpuReading)}
    loaded: dict[str, Any] = json.loads(json.dumps(fields, default=dict))
    return loaded


def h200_smi(reserved: str | None = H200_RESERVED_MIB) -> dict[str, str]:
    (row,) = parse_smi_csv(H200_CSV)
    if reserved is not None:
        row["memory.reserved"] = reserved
    return row


def bench_figures(tokens_per_s: float, ttft_s: float = 0.05, requests: int = 8) -> dict[str, Any]:
    return {
        "requests": requests,
        "ok": requests,
        "failed": 0,
        "tokens_per_s": tokens_per_s,
        "stream_tokens_per_s": tokens_per_s,
        "ttft_p50_s": ttft_s,
        "ttft_p95_s": ttft_s * 2,
        "errors": {},
    }


def good_results() -> dict[str, Any]:
    """What a passing run on the recorded H200 would have written to results.json."""
    comparisons = [dataclasses.asdict(c) for c in compare_gpu(h200_reading(), h200_smi())]
    vram = {"process_bytes": 1400 * MIB, "planned_bytes": 600 * MIB, "headroom_bytes": 1024 * MIB}
    shape = device_check.SHAPES[4]
    return {
        "date": "2026-12-01 12:00 UTC",
        "machine": {
            "gpu": "NVIDIA H200",
            "compute_cap": "9.0",
            "driver": "580.159.04",
            "nvcc": "nvcc 13.0",
            "arch": 90,
        },
        "cmake_args": "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off",
        "model": {"name": "demo model (Gemma 3 270M Q4_K_M)", "bytes": 253 * MIB},
        "build": {
            "backends": ["CUDA", "CPU"],
            "cuda_archs": [90],
            "gpu_offload": True,
            "devices": [
                {"name": "CUDA0", "description": "NVIDIA H200"},
                {"name": "CPU", "description": "AMD EPYC"},
            ],
            "system_info": "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | CPU : AVX2 = 1 |",
        },
        "runs": {
            "gpu": {
                "gpu_layers": -1,
                "offload": read_offload(GPU_LOG),
                "vram": vram,
                "nvml_vs_smi": comparisons,
                "bench": {"1": bench_figures(310.0), "8": bench_figures(1900.0, requests=16)},
            },
            "auto": {
                "gpu_layers": "auto",
                "offload": read_offload(AUTO_LINE + GPU_LOG),
                "vram": vram,
                "nvml_vs_smi": comparisons,
                "bench": {"1": bench_figures(305.0)},
            },
            "cpu": {
                "gpu_layers": 0,
                "offload": read_offload(""),
                "bench": {"1": bench_figures(45.0, 0.2), "8": bench_figures(160.0, 0.4, 16)},
            },
        },
        "probes": [
            dataclasses.asdict(
                ProbeResult(shape.name, shape.head_dim, shape.weight_type, "on", {}, True, 0, [], True)
            )
        ],
        "diagnosis": ["Every candidate shape ran on this GPU and build."],
    }


def test_the_recorded_h200_matches_what_nvidia_smi_said_of_it() -> None:
    checked = {c.field: c for c in compare_gpu(h200_reading(), h200_smi())}
    assert all(c.ok for c in checked.values()), checked
    # NVML's v1 "used" (615 MiB, the driver's reservation) is nvidia-smi's used + reserved.
    used = checked["memory used (NVML v1 = nvidia-smi used + reserved)"]
    assert (used.monitor, used.smi) == ("615 MiB", "616 MiB")
    assert (checked["memory total"].monitor, checked["memory total"].smi) == ("143771 MiB", "143771 MiB")
    assert checked["compute capability"].monitor == "9.0"
    assert checked["power"].ok
    assert checked["temperature"].monitor == "33 °C"


def test_an_nvidia_smi_without_the_reserved_field_is_compared_loosely() -> None:
    checked = {c.field: c for c in compare_gpu(h200_reading(), h200_smi(reserved=None))}
    assert checked["memory used (NVML v1, nvidia-smi without reserved)"].ok


@pytest.mark.parametrize(
    ("field", "key", "value"),
    [
        ("temperature", "temperature.gpu", "45"),
        ("memory used (NVML v1 = nvidia-smi used + reserved)", "memory.used", "2048 MiB"),
        ("memory total", "memory.total", "81559 MiB"),
        ("name", "name", "NVIDIA H100 80GB HBM3"),
        ("compute capability", "compute_cap", "8.0"),
        ("power", "power.draw", "450.00 W"),
    ],
)
def test_a_monitor_reading_nvidia_smi_contradicts_is_a_mismatch(field: str, key: str, value: str) -> None:
    smi = h200_smi() | {key: value}
    checked = {c.field: c for c in compare_gpu(h200_reading(), smi)}
    assert not checked[field].ok
    results = good_results()
    results["runs"]["gpu"]["nvml_vs_smi"] = [dataclasses.asdict(c) for c in checked.values()]
    assert any(m.startswith(f"gpu run: {field}: monitor") for m in mismatches(results)), mismatches(results)


def test_a_good_run_passes_and_its_report_shows_the_figures(tmp_path: Path) -> None:
    results = good_results()
    assert mismatches(results) == []
    text = report.render_report(results, [])
    assert "**PASS**: 0 mismatch(es)." in text
    for heading in (
        "## Build",
        "## Offload",
        "## Speed",
        "## VRAM",
        "## NVML monitor against nvidia-smi",
        "## The illegal",
    ):
        assert heading in text
    assert "| gpu | 1 | 310.0 | 310.0 | 50 | 100 | 8/8 |" in text
    assert (
        "| gpu | -1 | 19/19 | CPU_Mapped model 170 MiB, CUDA0 KV 36 MiB, CUDA0 compute 514 MiB, "
        "CUDA0 model 241 MiB |" in text
    )
    assert "all: all layers fit in 139.8 GiB free VRAM less 1.0 GiB headroom" in text
    # The report command writes it beside results.json and exits 0.
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert device_check.main(["report", str(path)]) == 0
    assert (tmp_path / "report.md").read_text().startswith("# edgellm device check")


Fault = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Fault:
    def fault(results: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = results
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return fault


FAULTS: Final = [
    pytest.param(_set("build.backends", ["CPU"]), "has no CUDA backend", id="cpu-build"),
    pytest.param(_set("build.cuda_archs", [61, 80]), "lack this GPU's 90", id="arch-missing"),
    pytest.param(_set("build.gpu_offload", False), "llama_supports_gpu_offload() is false", id="no-offload"),
    pytest.param(
        _set("runs.gpu.offload.offloaded", [10, 19]),
        "gpu run: llama.cpp offloaded 10/19 layers",
        id="partial",
    ),
    pytest.param(_set("runs.gpu.offload.devices", ["CPU"]), "gpu run: no CUDA buffer", id="no-cuda-buffer"),
    pytest.param(
        _set("runs.auto.offload.auto", {"layers": "7", "why": "7 of 18"}),
        "auto run: gpu_layers auto planned",
        id="auto-partial",
    ),
    pytest.param(
        _set("runs.gpu.vram.process_bytes", 2000 * MIB),
        "more than auto's plan (600 MiB) plus the headroom",
        id="vram",
    ),
    pytest.param(
        _set("runs.gpu.vram.process_bytes", None), "NVML shows no GPU memory", id="no-process-memory"
    ),
    pytest.param(
        _set("runs.gpu.bench.1.tokens_per_s", 30.0), "1 stream(s): the GPU makes 30.0 tokens/s", id="gpu-slow"
    ),
    pytest.param(_set("runs.gpu.bench.8.tokens_per_s", 300.0), "batching gains nothing", id="no-batching"),
    pytest.param(_set("runs.cpu.bench.8.failed", 3), "cpu run, 8 streams: 3 requests failed", id="failures"),
    pytest.param(
        _set("runs.auto.error", "edgellmd exited with 1 before it was ready"),
        "auto run: edgellmd exited",
        id="no-start",
    ),
    pytest.param(_set("probes.0.ok", False), "shape hd64-f16 (fa on) failed on the GPU", id="real-shape"),
]


@pytest.mark.parametrize(("fault", "fragment"), FAULTS)
def test_each_fault_is_a_mismatch_and_fails_the_report(fault: Fault, fragment: str, tmp_path: Path) -> None:
    results = copy.deepcopy(good_results())
    fault(results)
    found = mismatches(results)
    assert any(fragment in m for m in found), found
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert device_check.main(["report", str(path)]) == 1
    assert "**FAIL**" in (tmp_path / "report.md").read_text()


def test_read_offload_takes_llama_cpps_lines_from_the_daemons_log() -> None:
    found = read_offload(AUTO_LINE + GPU_LOG)
    assert found["offloaded"] == [19, 19]
    assert found["devices"] == ["CPU_Mapped", "CUDA0"]
    assert found["buffers_mib"]["CUDA0 model"] == pytest.approx(241.43)
    assert found["auto"] == {
        "layers": "all",
        "why": "all layers fit in 139.8 GiB free VRAM less 1.0 GiB headroom",
    }
    assert found["flash_attention"] == [
        "llama_context: flash_attn            = auto",
        "resolve_fused_ops: Flash Attention enabled",
    ]
    assert found["errors"] == []
    crash = "ggml_cuda_compute_forward: MUL_MAT failed\nCUDA error: an illegal instruction was encountered\n"
    assert read_offload(crash)["errors"] == [
        "ggml_cuda_compute_forward: MUL_MAT failed",
        "CUDA error: an illegal instruction was encountered",
    ]


def _probe(
    shape: str, fa: str, ok: bool, env: dict[str, str] | None = None, errors: list[str] | None = None
) -> ProbeResult:
    spec = next(s for s in device_check.SHAPES if s.name == shape)
    return ProbeResult(
        shape, spec.head_dim, spec.weight_type, fa, env or {}, ok, 0 if ok else 134, errors or [], spec.real
    )


ILLEGAL: Final = [
    "ggml_cuda_compute_forward: MUL_MAT failed",
    "CUDA error: an illegal instruction was encountered",
]


def test_the_diagnosis_names_what_every_failure_shares() -> None:
    results = [
        _probe("tests-default", "auto", False, errors=ILLEGAL),
        _probe("tests-default", "auto", True, {"GGML_CUDA_PDL": "0"}),
        _probe("tests-default", "auto", False, {"GGML_CUDA_DISABLE_FUSION": "1"}, ILLEGAL),
        _probe("hd16-f16", "auto", True),
        _probe("hd64-f32", "auto", False, errors=ILLEGAL),
        _probe("hd64-f32", "auto", True, {"GGML_CUDA_PDL": "0"}),
        _probe("hd64-f32", "auto", False, {"GGML_CUDA_DISABLE_FUSION": "1"}, ILLEGAL),
        _probe("hd64-f16", "auto", True),
    ]
    said = diagnose(results)
    assert said[0] == "2 of 4 probes failed: tests-default (fa auto), hd64-f32 (fa auto)."
    assert "Every failure and only those have F32 weight matrices." in said
    assert "Every failure has head size 16" not in " ".join(said)
    assert "With GGML_CUDA_PDL=0 every failing probe passes: that feature is the cause." in said
    assert "llama.cpp named: ggml_cuda_compute_forward: MUL_MAT failed" in said
    assert said[-1].startswith("Only shapes that no real model has failed")


def test_the_diagnosis_when_nothing_fails_or_a_real_shape_does() -> None:
    assert "does not reproduce here" in diagnose([_probe("tests-default", "on", True)])[0]
    said = diagnose([_probe("hd64-f16", "on", False, errors=ILLEGAL), _probe("hd64-f16", "auto", True)])
    assert "Every failure and only those have flash attention on." in said
    assert said[-1].startswith("A shape real models have failed")


def test_the_candidate_shapes_are_the_tests_default_and_real_ones() -> None:
    default = device_check.SHAPES[0]
    assert (default.n_embd, default.n_head, default.n_head_kv, default.weight_type) == (64, 4, 2, "F32")
    assert {s.head_dim for s in device_check.SHAPES} == {16, 64, 128}
    assert {s.weight_type for s in device_check.SHAPES if s.real} == {"F16", "Q8_0"}


@pytest.mark.slow
def test_a_probe_runs_in_a_child_and_says_ok(tmp_path: Path) -> None:
    # On this CPU build the shapes run on the CPU: what is tested is the probe itself (a
    # child loading the model with the daemon's engine, its prefill and 8 streams).
    for shape in (device_check.SHAPES[0], device_check.SHAPES[6]):
        path = device_check.write_shape(shape, tmp_path)
        result = device_check.run_probe(shape, path, "on", {})
        assert result.ok, result
        assert result.errors == []


@pytest.mark.slow
def test_measure_serves_reads_and_benches_a_real_daemon(tmp_path: Path, tiny_model: Path) -> None:
    run = device_check.measure("cpu", tiny_model, 0, tmp_path, streams=((1, 1), (2, 2)), max_tokens=4)
    assert run["exit_status"] == 0, (tmp_path / "cpu.log").read_text()[-3000:]
    assert [run["bench"][s]["ok"] for s in ("1", "2")] == [1, 2]
    assert run["build"]["backends"] == ["CPU"]
    assert run["offload"]["devices"] == ["CPU"]
    assert run["offload"]["errors"] == []
    assert run["gpu"] == []  # no NVIDIA driver here
    assert run["nvml_vs_smi"] == []


def test_planned_vram_counts_layers_other_tensors_and_the_kv_cache(tiny_model: Path) -> None:
    planned = device_check.planned_vram(device_check.daemon_config(tiny_model, "auto", 8080), tiny_model)
    assert planned["planned_bytes"] == planned["layers_bytes"] + planned["other_bytes"] + planned["kv_bytes"]
    assert planned["kv_bytes"] > 0
    assert planned["headroom_bytes"] == 1024 * MIB
    assert planned["planned_bytes"] > tiny_model.stat().st_size


def _member(tar: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_the_trimmed_sdist_keeps_what_the_build_compiles(tmp_path: Path) -> None:
    top = "llama_cpp_python-0.3.36"
    kept = [
        "pyproject.toml",
        "CMakeLists.txt",
        "llama_cpp/__init__.py",
        "vendor/llama.cpp/CMakeLists.txt",
        "vendor/llama.cpp/LICENSE",
        "vendor/llama.cpp/src/llama.cpp",
        "vendor/llama.cpp/ggml/src/ggml-cuda/fattn.cu",
        "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c",
        "vendor/llama.cpp/tools/mtmd/mtmd.cpp",
        "vendor/llama.cpp/vendor/nlohmann/json.hpp",
    ]
    dropped = [
        ".git/modules/vendor/llama.cpp/objects/pack/big.pack",
        "docs/index.md",
        "vendor/llama.cpp/.git",
        "vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf",
        "vendor/llama.cpp/docs/build.md",
        "vendor/llama.cpp/tests/test-backend-ops.cpp",
        "vendor/llama.cpp/examples/simple/simple.cpp",
        "vendor/llama.cpp/media/llama0-logo.png",
        "vendor/llama.cpp/gguf-py/tests/test_quants.py",
        "vendor/llama.cpp/tools/ui/dist/index.html",
        "vendor/llama.cpp/tools/server/server.cpp",
        "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        "vendor/llama.cpp/convert_hf_to_gguf.py",
    ]
    source = tmp_path / "in" / f"{top}.tar.gz"
    source.parent.mkdir()
    with tarfile.open(source, "w:gz") as tar:
        for name in kept + dropped:
            _member(tar, f"{top}/{name}")
    target = trim_sdist.trim(source, tmp_path / "out")
    assert target.name == source.name
    with tarfile.open(target) as tar:
        names = {m.name.removeprefix(f"{top}/") for m in tar}
    assert names == set(kept)


@pytest.mark.parametrize("script", ["device_check.sh", "prepare_carry.sh"])
def test_the_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(REPO / "tests" / "gpu" / script)], check=True, timeout=30)


def test_device_check_sh_refuses_a_machine_without_nvidia_smi(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "tests" / "gpu" / "device_check.sh"), "build"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "EDGELLM_CHECK_WORK": str(tmp_path)},
        check=False,
    )
    assert result.returncode == 2
    assert "no nvidia-smi" in result.stderr
