"""What a GPU reading is: plain records of NVML's answers, read by `host.nvml` and judged by
`host.verdicts` (neither imports the other for them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment; None where the GPU or its driver cannot say (see `unavailable`)."""

    index: int
    name: str | None
    uuid: str | None
    compute_capability: tuple[int, int] | None
    memory_total: int | None  # bytes
    memory_used: int | None  # bytes; NVML's v1 figure, which counts the driver's reserved memory
    memory_free: int | None  # bytes
    utilization_gpu: int | None  # percent
    utilization_memory: int | None  # percent
    temperature_c: int | None
    fan_percent: int | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    throttle_reasons: tuple[str, ...]  # names from CLOCK_EVENT_REASONS
    ecc_volatile_corrected: int | None
    ecc_volatile_uncorrected: int | None
    process_memory: int | None  # bytes used here by the `pid` given to read_gpus
    unavailable: Mapping[str, str]  # field -> why it is None
    lost: bool = False  # fell off the bus (GpuIsLost) or stopped answering


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """Every GPU at one moment, or why NVML could not be asked."""

    available: bool  # NVML initialised
    reason: str | None  # why not
    driver_version: str | None
    cuda_driver_version: int | None  # e.g. 13000 for CUDA 13.0: the newest CUDA the driver runs
    devices: tuple[GpuReading, ...]
    taken_at: float  # time.time()
