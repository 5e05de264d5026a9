"""GPU compatibility verdicts: what an operator should know about these GPUs for this build and config."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from edgellmd.host.gpu import GpuReading, GpuSnapshot

# A model's `gpu_layers`: a layer count (-1: every layer) or "auto", as many as fit in free
# VRAM, decided at load time (`host.offload`). Declared here, below settings, which reads it.
GPU_LAYERS_AUTO: Final[Literal["auto"]] = "auto"
GpuLayers: TypeAlias = int | Literal["auto"]

_THERMAL: Final = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"})
_POWER: Final = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})
_UNQUANTIZED: Final = frozenset({"F16", "BF16", "F32"})


@dataclass(frozen=True, slots=True)
class Verdict:
    """One finding about the host's GPUs, for the log and `edgellmctl doctor`."""

    level: str  # "error" | "warning" | "info"
    gpu: int | None  # index, or None for host-wide verdicts
    code: str  # stable id
    message: str  # one sentence an operator can act on


def _file_type(name: str) -> str:
    """`MOSTLY_F16`, `ALL_F32`, `f16` -> `F16`, `F32`, `F16`."""
    upper = name.strip().upper()
    return upper.removeprefix("MOSTLY_").removeprefix("ALL_")


def _describe(gpu: GpuReading) -> str:
    return f"GPU {gpu.index} ({gpu.name})" if gpu.name else f"GPU {gpu.index}"


def _device_verdicts(
    gpu: GpuReading, snapshot: GpuSnapshot, model_file_types: Sequence[str]
) -> list[Verdict]:
    def v(level: str, code: str, message: str) -> Verdict:
        return Verdict(level, gpu.index, code, message)

    who = _describe(gpu)
    if gpu.lost:
        uuid = f" {gpu.uuid}" if gpu.uuid else ""
        return [
            v(
                "error",
                "gpu_lost",
                f"GPU {gpu.index}{uuid} fell off the bus or stopped answering: "
                "inference on it fails until it is reset or the host rebooted (check dmesg for Xid "
                "errors)",
            )
        ]
    out: list[Verdict] = []
    cc = gpu.compute_capability
    if cc is not None and cc < (6, 0):
        why = (
            "no CUDA toolkit llama.cpp builds with targets it"
            if cc < (5, 0)
            else "CUDA 13 builds of llama.cpp carry no code for it and CUDA 12 builds only generic PTX"
        )
        out.append(
            v(
                "error",
                "compute_capability_unsupported",
                f"{who} has compute capability {cc[0]}.{cc[1]}, below Pascal (6.0), the oldest GPU "
                f"edgellm supports ({why}): serve on the CPU (gpu_layers: 0) or use a newer GPU",
            )
        )
    elif cc is not None and cc[0] == 6:
        if cc >= (6, 1):  # P100 (6.0) has fast FP16; P40/P4/GeForce 10 run it at 1/64 rate
            out.append(_pascal_fp16(gpu, who, model_file_types))
        cuda13 = snapshot.cuda_driver_version is not None and snapshot.cuda_driver_version >= 13000
        out.append(
            v(
                "warning" if cuda13 else "info",
                "pascal_cuda13",
                f"{who} is Pascal ({cc[0]}.{cc[1]}), which CUDA 13 builds of llama.cpp no longer "
                f"target: use a CUDA 12 build with CMAKE_CUDA_ARCHITECTURES={cc[0]}{cc[1]} "
                "(NVIDIA's 580 driver branch is the last to support Pascal)",
            )
        )
    elif cc is not None and cc[0] == 7 and cc < (7, 5):
        out.append(
            v(
                "info",
                "volta_cuda13",
                f"{who} is Volta ({cc[0]}.{cc[1]}), which CUDA 13 builds of llama.cpp no longer "
                f"target: use a CUDA 12 build with CMAKE_CUDA_ARCHITECTURES={cc[0]}{cc[1]}",
            )
        )
    reasons = set(gpu.throttle_reasons)
    temp = f" at {gpu.temperature_c} °C" if gpu.temperature_c is not None else ""
    if reasons & _THERMAL:
        out.append(
            v(
                "warning",
                "thermal_throttling",
                f"{who} is slowing its clocks for heat{temp} ({', '.join(sorted(reasons & _THERMAL))}): "
                "check its cooling and airflow",
            )
        )
    if reasons & _POWER:
        limit = f" (limit {gpu.power_limit_w:.0f} W)" if gpu.power_limit_w is not None else ""
        out.append(
            v(
                "warning",
                "power_throttling",
                f"{who} is slowing its clocks at its power limit{limit} "
                f"({', '.join(sorted(reasons & _POWER))}): check the power supply and power limit",
            )
        )
    if gpu.ecc_volatile_uncorrected:
        out.append(
            v(
                "error",
                "ecc_errors",
                f"{who} reports {gpu.ecc_volatile_uncorrected} uncorrected ECC errors since the driver "
                "loaded: its results may be corrupt; drain it and reset it (nvidia-smi -r), "
                "and replace it if they recur",
            )
        )
    return out


def _pascal_fp16(gpu: GpuReading, who: str, model_file_types: Sequence[str]) -> Verdict:
    types = {_file_type(t) for t in model_file_types}
    slow = sorted(types & _UNQUANTIZED)
    if slow:
        return Verdict(
            "warning",
            gpu.index,
            "pascal_fp16_slow",
            f"{who} is Pascal and a configured model file is {'/'.join(slow)}, which runs very "
            "slowly there (FP16 at 1/64 rate, no BF16, no tensor cores): convert it to a "
            "quantized file such as Q4_K_M or Q8_0",
        )
    if types:  # every configured file is quantized: nothing to change, worth knowing
        return Verdict(
            "info",
            gpu.index,
            "pascal_fp16_slow",
            f"{who} is Pascal: keep to quantized model files (Q4_K_M, Q8_0) as now; "
            "F16/BF16/F32 files would be very slow on it",
        )
    return Verdict(
        "warning",
        gpu.index,
        "pascal_fp16_slow",
        f"{who} is Pascal (no fast FP16, no tensor cores): F16/BF16/F32 model files are very "
        "slow on it; use quantized files such as Q4_K_M or Q8_0",
    )


def largest_gpu_layers(values: Iterable[GpuLayers]) -> GpuLayers:
    """The one `gpu_layers` that verdicts judge for several models: the one that offloads most.

    -1 (every layer) first, then auto (as many as fit), then the largest count; 0 when no model
    offloads. The daemon's GPU monitor and `edgellmctl doctor` both judge this value.
    """

    def rank(value: GpuLayers) -> tuple[int, int]:
        if value == GPU_LAYERS_AUTO:
            return (2, 0)
        return (3, 0) if value == -1 else (1, int(value))

    return max(values, key=rank, default=0)


def verdicts(
    snapshot: GpuSnapshot,
    *,
    offload_supported: bool,
    gpu_layers: GpuLayers,
    model_file_types: Sequence[str] = (),
) -> list[Verdict]:
    """What an operator should know about these GPUs for this build and configuration.

    `gpu_layers`: what the models ask for (see `largest_gpu_layers`); `model_file_types`: their
    GGUF file types (`MOSTLY_Q4_K_M`, `F16`...), empty when unknown.
    """
    out: list[Verdict] = []
    if not snapshot.available:
        if gpu_layers != 0:
            out.append(
                Verdict(
                    "warning",
                    None,
                    "nvml_unavailable",
                    f"gpu_layers is {gpu_layers} but NVML is unavailable ({snapshot.reason}): "
                    "GPU health and memory cannot be watched",
                )
            )
        return out
    if not snapshot.devices:
        if gpu_layers != 0:
            out.append(
                Verdict(
                    "warning",
                    None,
                    "no_gpus",
                    f"gpu_layers is {gpu_layers} but NVML sees no GPU: every layer runs on the CPU",
                )
            )
        return out
    if gpu_layers != 0 and not offload_supported:
        out.append(
            Verdict(
                "warning",
                None,
                "no_offload_build",
                f"gpu_layers is {gpu_layers} but this llama.cpp build cannot offload (CPU-only "
                "build): reinstall llama-cpp-python built with CMAKE_ARGS=-DGGML_CUDA=on",
            )
        )
    elif gpu_layers == 0:
        out.append(
            Verdict(
                "info",
                None,
                "gpu_unused",
                f"{len(snapshot.devices)} GPU(s) present but gpu_layers is 0: models run on the CPU",
            )
        )
    for gpu in snapshot.devices:
        out.extend(_device_verdicts(gpu, snapshot, model_file_types))
    return out
