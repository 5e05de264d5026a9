"""GPU monitor and compatibility verdicts: NVML (nvidia-ml-py) from Pascal P40 (6.1) to H200 (9.0).

NVML answers differ by GPU, driver and permissions: passive cards have no fan reading, old
drivers lack newer calls, containers hide other processes, a GPU can fall off the bus. Each
of those becomes a `None` field with its reason in `GpuReading.unavailable` (or `lost`), never
an exception, so one odd GPU never hides the others. Verdicts turn a snapshot into sentences
an operator can act on; `auto_gpu_layers` and `gguf_layer_bytes` size a partial offload.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from edgellmd.files import open_regular
from edgellmd.models.lockfile import _GGUF_MAGIC, _MAX_KV, LockError, _Header

log = logging.getLogger(__name__)

# Clock-event ("throttle") reason bits of nvmlDeviceGetCurrentClocksEventReasons (and of its
# predecessor ...ThrottleReasons, same bits): NVML's C ABI, checked against pynvml by the tests.
CLOCK_EVENT_REASONS: Final = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)
_THERMAL: Final = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"})
_POWER: Final = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})
# GGUF file types (general.file_type names, with or without MOSTLY_/ALL_) that are not quantized.
_UNQUANTIZED: Final = frozenset({"F16", "BF16", "F32"})
# NVML errors after which a device is treated as gone: reading its other fields would only
# fail the same way (or block for the driver's timeout each time).
_LOST_ERRORS: Final = ("NVMLError_GpuIsLost", "NVMLError_Unknown", "NVMLError_ResetRequired")
_INIT_REASONS: Final = {
    "NVMLError_LibraryNotFound": "the NVIDIA driver library libnvidia-ml.so.1 was not found "
                                 "(no NVIDIA driver installed, or not visible to this service)",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded (or /dev/nvidia* is hidden "
                                 "from this service, e.g. by PrivateDevices=yes)",
    "NVMLError_NoPermission": "no permission to open /dev/nvidiactl and /dev/nvidia* "
                              "(check DeviceAllow= and the service user's groups)",
    "NVMLError_LibRmVersionMismatch": "the NVIDIA driver library and kernel module versions differ "
                                      "(reboot after the driver upgrade)",
}
_FIELD_REASONS: Final = {
    "NVMLError_NotSupported": "not supported",
    "NVMLError_FunctionNotFound": "function not found on this driver",
    "NVMLLibraryMismatchError": "function not found on this driver",
    "NVMLError_NoPermission": "no permission",
}
_GIB: Final = 1024**3


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
class Verdict:
    """One finding about the host's GPUs, for the log and `edgellmctl doctor`."""

    level: str  # "error" | "warning" | "info"
    gpu: int | None  # index, or None for host-wide verdicts
    code: str  # stable id
    message: str  # one sentence an operator can act on


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """Every GPU at one moment, or why NVML could not be asked."""

    available: bool  # NVML initialised
    reason: str | None  # why not
    driver_version: str | None
    cuda_driver_version: int | None  # e.g. 13000 for CUDA 13.0: the newest CUDA the driver runs
    devices: tuple[GpuReading, ...]
    taken_at: float  # time.time()


# ---- reading NVML ---------------------------------------------------------------------------


class _Lost(Exception):
    """Raised inside a device read once the device answers GpuIsLost or Unknown."""


def _error_name(nvml: Any, exc: BaseException) -> str:
    """The pynvml class name for `exc` (its nearest named NVMLError_* class)."""
    for cls in type(exc).__mro__:
        if getattr(nvml, cls.__name__, None) is cls:
            return str(cls.__name__)
    return type(exc).__name__


def _nvml_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """The exceptions an NVML call may raise for reasons of the GPU or driver."""
    names = ("NVMLError", "NVMLLibraryMismatchError")
    return tuple(cls for cls in (getattr(nvml, n, None) for n in names) if isinstance(cls, type))


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _DeviceReader:
    """Reads one device field by field, recording why a field is missing."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.errors = _nvml_errors(nvml)
        self.unavailable: dict[str, str] = {}

    def call(self, fields: Sequence[str], function: str, *args: Any) -> Any:
        """`nvml.function(handle, *args)`, or None with a reason for each of `fields`."""
        fn = getattr(self.nvml, function, None)
        if fn is None:
            self.unavailable.update(dict.fromkeys(fields, "not in this nvidia-ml-py version"))
            return None
        try:
            return fn(self.handle, *args)
        except self.errors as exc:
            name = _error_name(self.nvml, exc)
            if name in _LOST_ERRORS:
                raise _Lost from exc
            self.unavailable.update(dict.fromkeys(fields, _FIELD_REASONS.get(name, str(exc).lower())))
            return None


def _reasons(mask: int) -> tuple[str, ...]:
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    names += [f"unknown_0x{1 << b:x}" for b in range(64) if mask & ~known & (1 << b)]
    return tuple(names)


def _milli(value: int | None) -> float | None:
    return None if value is None else value / 1000.0


def _read_device(nvml: Any, index: int, pid: int | None) -> GpuReading:
    """Everything NVML says about device `index`; `lost` once it stops answering."""
    values: dict[str, Any] = {}
    reader = _DeviceReader(nvml, index)  # the "handle" of the first call is the index itself
    try:
        reader.handle = reader.call(("handle",), "nvmlDeviceGetHandleByIndex")
        if reader.handle is None:  # e.g. no permission on this one GPU
            return _reading(index, values, reader.unavailable)
        r = reader.call
        name, uuid = r(("name",), "nvmlDeviceGetName"), r(("uuid",), "nvmlDeviceGetUUID")
        values["name"] = None if name is None else _text(name)
        values["uuid"] = None if uuid is None else _text(uuid)
        cc = r(("compute_capability",), "nvmlDeviceGetCudaComputeCapability")
        values["compute_capability"] = None if cc is None else (int(cc[0]), int(cc[1]))
        memory = r(("memory_total", "memory_used", "memory_free"), "nvmlDeviceGetMemoryInfo")
        if memory is not None:
            values |= {"memory_total": memory.total, "memory_used": memory.used, "memory_free": memory.free}
        util = r(("utilization_gpu", "utilization_memory"), "nvmlDeviceGetUtilizationRates")
        if util is not None:
            values |= {"utilization_gpu": util.gpu, "utilization_memory": util.memory}
        values["temperature_c"] = r(("temperature_c",), "nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
        values["fan_percent"] = r(("fan_percent",), "nvmlDeviceGetFanSpeed")
        values["power_w"] = _milli(r(("power_w",), "nvmlDeviceGetPowerUsage"))  # NVML: milliwatts
        values["power_limit_w"] = _milli(r(("power_limit_w",), "nvmlDeviceGetEnforcedPowerLimit"))
        values["sm_clock_mhz"] = r(("sm_clock_mhz",), "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM)
        values["memory_clock_mhz"] = r(("memory_clock_mhz",), "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM)
        values["throttle_reasons"] = _read_reasons(reader)
        for kind, error_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                 ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            key = f"ecc_volatile_{kind}"  # NotSupported while ECC is off (GeForce, P40 by choice)
            values[key] = r((key,), "nvmlDeviceGetTotalEccErrors", error_type, nvml.NVML_VOLATILE_ECC)
        if pid is not None:
            values["process_memory"] = _process_memory(reader, pid)
    except _Lost:
        return _reading(index, values, reader.unavailable, lost=True)
    return _reading(index, values, reader.unavailable)


def _read_reasons(reader: _DeviceReader) -> tuple[str, ...]:
    # ...EventReasons replaced ...ThrottleReasons in driver 535 (same bits); older drivers,
    # the last ones for Pascal among them, only have the old name.
    mask = reader.call(("throttle_reasons",), "nvmlDeviceGetCurrentClocksEventReasons")
    if mask is None and reader.unavailable.get("throttle_reasons") in (
            "function not found on this driver", "not in this nvidia-ml-py version"):
        del reader.unavailable["throttle_reasons"]
        mask = reader.call(("throttle_reasons",), "nvmlDeviceGetCurrentClocksThrottleReasons")
    return () if mask is None else _reasons(int(mask))


def _process_memory(reader: _DeviceReader, pid: int) -> int | None:
    # NVML reports host PIDs: in a container with its own PID namespace no entry matches and
    # this reads 0. A process without an entry holds no memory on this GPU.
    processes = reader.call(("process_memory",), "nvmlDeviceGetComputeRunningProcesses")
    if processes is None:
        return None
    mine: list[int | None] = [p.usedGpuMemory for p in processes if p.pid == pid]
    if any(used is None for used in mine):  # NVML_VALUE_NOT_AVAILABLE (WDDM, some vGPUs)
        reader.unavailable["process_memory"] = "not reported by the driver"
        return None
    return sum(used or 0 for used in mine)


def _reading(index: int, values: Mapping[str, Any], unavailable: Mapping[str, str], *,
             lost: bool = False) -> GpuReading:
    get = values.get
    return GpuReading(
        index=index, name=get("name"), uuid=get("uuid"), compute_capability=get("compute_capability"),
        memory_total=get("memory_total"), memory_used=get("memory_used"), memory_free=get("memory_free"),
        utilization_gpu=get("utilization_gpu"), utilization_memory=get("utilization_memory"),
        temperature_c=get("temperature_c"), fan_percent=get("fan_percent"), power_w=get("power_w"),
        power_limit_w=get("power_limit_w"), sm_clock_mhz=get("sm_clock_mhz"),
        memory_clock_mhz=get("memory_clock_mhz"), throttle_reasons=get("throttle_reasons", ()),
        ecc_volatile_corrected=get("ecc_volatile_corrected"),
        ecc_volatile_uncorrected=get("ecc_volatile_uncorrected"), process_memory=get("process_memory"),
        unavailable=MappingProxyType(dict(unavailable)), lost=lost,
    )


def _unavailable(reason: str, taken_at: float) -> GpuSnapshot:
    return GpuSnapshot(False, reason, None, None, (), taken_at)


def _system_value(nvml: Any, function: str) -> Any:
    with contextlib.suppress(*_nvml_errors(nvml), AttributeError):
        return getattr(nvml, function)()
    return None


def read_gpus(nvml: Any = None, *, pid: int | None = None) -> GpuSnapshot:
    """Init NVML, read every GPU, shut down (blocking); every failure is reported, never raised."""
    taken_at = time.time()
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return _unavailable("nvidia-ml-py is not installed", taken_at)
    errors = _nvml_errors(nvml)
    try:
        nvml.nvmlInit()
    except errors as exc:
        name = _error_name(nvml, exc)
        return _unavailable(_INIT_REASONS.get(name, f"NVML failed to start: {exc}"), taken_at)
    try:
        driver = _system_value(nvml, "nvmlSystemGetDriverVersion")
        cuda = _system_value(nvml, "nvmlSystemGetCudaDriverVersion")
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except errors as exc:
            return _unavailable(f"NVML cannot count the GPUs: {exc}", taken_at)
        devices = tuple(_read_device(nvml, i, pid) for i in range(count))
    finally:
        with contextlib.suppress(*errors):
            nvml.nvmlShutdown()
    return GpuSnapshot(True, None, None if driver is None else _text(driver),
                       None if cuda is None else int(cuda), devices, taken_at)


# ---- verdicts -------------------------------------------------------------------------------


def _file_type(name: str) -> str:
    """`MOSTLY_F16`, `ALL_F32`, `f16` -> `F16`, `F32`, `F16`."""
    upper = name.strip().upper()
    return upper.removeprefix("MOSTLY_").removeprefix("ALL_")


def _describe(gpu: GpuReading) -> str:
    return f"GPU {gpu.index} ({gpu.name})" if gpu.name else f"GPU {gpu.index}"


def _device_verdicts(gpu: GpuReading, snapshot: GpuSnapshot,
                     model_file_types: Sequence[str]) -> list[Verdict]:
    def v(level: str, code: str, message: str) -> Verdict:
        return Verdict(level, gpu.index, code, message)

    who = _describe(gpu)
    if gpu.lost:
        uuid = f" {gpu.uuid}" if gpu.uuid else ""
        return [v("error", "gpu_lost", f"GPU {gpu.index}{uuid} fell off the bus or stopped answering: "
                  "inference on it fails until it is reset or the host rebooted (check dmesg for Xid "
                  "errors)")]
    out: list[Verdict] = []
    cc = gpu.compute_capability
    if cc is not None and cc < (6, 0):
        why = ("no CUDA toolkit llama.cpp builds with targets it" if cc < (5, 0) else
               "CUDA 13 builds of llama.cpp carry no code for it and CUDA 12 builds only generic PTX")
        out.append(v("error", "compute_capability_unsupported",
                     f"{who} has compute capability {cc[0]}.{cc[1]}, below Pascal (6.0), the oldest GPU "
                     f"edgellm supports ({why}): serve on the CPU (gpu_layers: 0) or use a newer GPU"))
    elif cc is not None and cc[0] == 6:
        if cc >= (6, 1):  # P100 (6.0) has fast FP16; P40/P4/GeForce 10 run it at 1/64 rate
            out.append(_pascal_fp16(gpu, who, model_file_types))
        cuda13 = snapshot.cuda_driver_version is not None and snapshot.cuda_driver_version >= 13000
        out.append(v("warning" if cuda13 else "info", "pascal_cuda13",
                     f"{who} is Pascal ({cc[0]}.{cc[1]}), which CUDA 13 builds of llama.cpp no longer "
                     f"target: use a CUDA 12 build with CMAKE_CUDA_ARCHITECTURES={cc[0]}{cc[1]} "
                     "(NVIDIA's 580 driver branch is the last to support Pascal)"))
    elif cc is not None and cc[0] == 7 and cc < (7, 5):
        out.append(v("info", "volta_cuda13",
                     f"{who} is Volta ({cc[0]}.{cc[1]}), which CUDA 13 builds of llama.cpp no longer "
                     f"target: use a CUDA 12 build with CMAKE_CUDA_ARCHITECTURES={cc[0]}{cc[1]}"))
    reasons = set(gpu.throttle_reasons)
    temp = f" at {gpu.temperature_c} °C" if gpu.temperature_c is not None else ""
    if reasons & _THERMAL:
        out.append(v("warning", "thermal_throttling",
                     f"{who} is slowing its clocks for heat{temp} ({', '.join(sorted(reasons & _THERMAL))}): "
                     "check its cooling and airflow"))
    if reasons & _POWER:
        limit = f" (limit {gpu.power_limit_w:.0f} W)" if gpu.power_limit_w is not None else ""
        out.append(v("warning", "power_throttling",
                     f"{who} is slowing its clocks at its power limit{limit} "
                     f"({', '.join(sorted(reasons & _POWER))}): check the power supply and power limit"))
    if gpu.ecc_volatile_uncorrected:
        out.append(v("error", "ecc_errors",
                     f"{who} reports {gpu.ecc_volatile_uncorrected} uncorrected ECC errors since the driver "
                     "loaded: its results may be corrupt; drain it and reset it (nvidia-smi -r), "
                     "and replace it if they recur"))
    return out


def _pascal_fp16(gpu: GpuReading, who: str, model_file_types: Sequence[str]) -> Verdict:
    types = {_file_type(t) for t in model_file_types}
    slow = sorted(types & _UNQUANTIZED)
    if slow:
        return Verdict("warning", gpu.index, "pascal_fp16_slow",
                       f"{who} is Pascal and a configured model file is {'/'.join(slow)}, which runs very "
                       "slowly there (FP16 at 1/64 rate, no BF16, no tensor cores): convert it to a "
                       "quantized file such as Q4_K_M or Q8_0")
    if types:  # every configured file is quantized: nothing to change, worth knowing
        return Verdict("info", gpu.index, "pascal_fp16_slow",
                       f"{who} is Pascal: keep to quantized model files (Q4_K_M, Q8_0) as now; "
                       "F16/BF16/F32 files would be very slow on it")
    return Verdict("warning", gpu.index, "pascal_fp16_slow",
                   f"{who} is Pascal (no fast FP16, no tensor cores): F16/BF16/F32 model files are very "
                   "slow on it; use quantized files such as Q4_K_M or Q8_0")


def verdicts(snapshot: GpuSnapshot, *, offload_supported: bool, gpu_layers: int,
             model_file_types: Sequence[str] = ()) -> list[Verdict]:
    """What an operator should know about these GPUs for this build and configuration."""
    out: list[Verdict] = []
    if not snapshot.available:
        if gpu_layers != 0:
            out.append(Verdict("warning", None, "nvml_unavailable",
                               f"gpu_layers is {gpu_layers} but NVML is unavailable ({snapshot.reason}): "
                               "GPU health and memory cannot be watched"))
        return out
    if not snapshot.devices:
        if gpu_layers != 0:
            out.append(Verdict("warning", None, "no_gpus",
                               f"gpu_layers is {gpu_layers} but NVML sees no GPU: every layer runs on "
                               "the CPU"))
        return out
    if gpu_layers != 0 and not offload_supported:
        out.append(Verdict("warning", None, "no_offload_build",
                           f"gpu_layers is {gpu_layers} but this llama.cpp build cannot offload (CPU-only "
                           "build): reinstall llama-cpp-python built with CMAKE_ARGS=-DGGML_CUDA=on"))
    elif gpu_layers == 0:
        out.append(Verdict("info", None, "gpu_unused",
                           f"{len(snapshot.devices)} GPU(s) present but gpu_layers is 0: models run on "
                           "the CPU"))
    for gpu in snapshot.devices:
        out.extend(_device_verdicts(gpu, snapshot, model_file_types))
    return out


# ---- sizing a partial offload ---------------------------------------------------------------


def auto_gpu_layers(*, free_bytes: int, headroom_bytes: int, layer_bytes: Sequence[int], other_bytes: int,
                    n_layers: int) -> int:
    """How many layers `gpu_layers: auto` offloads: -1 (all plus output), or 0..n_layers-1.

    Rule: budget = free_bytes - headroom_bytes. Layer i weighs layer_bytes[i] (only the first
    n_layers entries count; missing ones weigh as much as the largest given). If every layer
    plus other_bytes fits the budget, -1. Otherwise llama.cpp offloads the *last* k layers, so
    k is the largest count whose last k layers plus other_bytes still fit; other_bytes (output
    and embedding tensors, compute buffers, the KV cache share: the caller decides) is charged
    in full for any k > 0, which is conservative. The result is 0 when not even one layer fits.
    """
    if min(free_bytes, headroom_bytes, other_bytes, n_layers) < 0 or any(b < 0 for b in layer_bytes):
        raise ValueError("sizes and n_layers must be >= 0")
    if n_layers > 0 and not layer_bytes:
        raise ValueError("layer_bytes is empty but n_layers is not 0")
    sizes = list(layer_bytes[:n_layers])
    sizes += [max(layer_bytes, default=0)] * (n_layers - len(sizes))
    budget = free_bytes - headroom_bytes
    if sum(sizes) + other_bytes <= budget:
        return -1
    used, k = other_bytes, 0
    for size in reversed(sizes):
        if used + size > budget:
            break
        used += size
        k += 1
    return k


def plan_gpu_layers(path: Path, *, snapshot: GpuSnapshot | None, offload_supported: bool,
                    headroom_bytes: int, kv_bytes: int) -> tuple[int, str]:
    """`gpu_layers: auto` for one model file: the layer count and a sentence saying why.

    Free memory is summed over the GPUs that answer (llama.cpp splits layers across them);
    each layer also carries its share of the KV cache (`kv_bytes` for the whole model).
    """
    if not offload_supported:
        return 0, "this llama.cpp build cannot offload (CPU-only build)"
    devices = [d for d in snapshot.devices if not d.lost] if snapshot and snapshot.available else []
    if not devices:
        reason = snapshot.reason if snapshot and snapshot.reason else "no GPU answers NVML"
        return 0, f"no usable GPU ({reason})"
    free = sum(d.memory_free or 0 for d in devices)
    try:
        layers, other = gguf_layer_bytes(path)
    except (OSError, ValueError) as exc:
        return 0, f"cannot size the model's layers: {exc}"
    n = len(layers)
    share = kv_bytes // n if n else 0
    count = auto_gpu_layers(free_bytes=free, headroom_bytes=headroom_bytes,
                            layer_bytes=[b + share for b in layers], other_bytes=other, n_layers=n)
    shown = "all" if count == -1 else f"{count} of {n}"
    return count, (f"{shown} layers fit in {free / 2**30:.1f} GiB free VRAM less "
                   f"{headroom_bytes / 2**30:.1f} GiB headroom")


# ggml types: (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES (checked by a test).
GGML_BLOCKS: Final[Mapping[int, tuple[int, int]]] = MappingProxyType({
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
})  # F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 Q2_K..Q8_K IQ2_XXS.. I8..F64 IQ1_M BF16 TQ1_0 TQ2_0 MXFP4
_MAX_TENSORS: Final = 1 << 20  # sanity bounds against hostile headers
_MAX_DIMS: Final = 4  # GGML_MAX_DIMS
_MAX_NAME: Final = 256  # ggml allows 63 bytes; leave room, refuse absurd ones
_GGUF_UINT32: Final = 4
_BLOCK: Final = re.compile(rb"blk\.(\d{1,9})\.")


@dataclass(slots=True)
class _TensorInfo:
    name: bytes
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    size: int | None = None


def _tensor_infos(path: Path) -> tuple[list[_TensorInfo], int]:
    """The tensor-info section of a GGUF file and the size of its data section."""
    with os.fdopen(open_regular(path), "rb") as fh:  # never blocks on a FIFO swapped in
        header = _Header(fh)
        if header.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        if header.scalar("<I") < 2:
            raise ValueError(f"{path}: GGUF version 1 is not supported")
        n_tensors, n_kv = header.scalar("<Q"), header.scalar("<Q")
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise ValueError(f"{path}: absurd tensor or metadata count")
        alignment = 32  # GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key, vtype = header.string(), header.scalar("<I")
            if key == b"general.alignment" and vtype == _GGUF_UINT32:  # llama.cpp takes no other type
                alignment = header.scalar("<I")
            else:
                header.skip_value(vtype)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        infos: list[_TensorInfo] = []
        for _ in range(n_tensors):
            name = header.string()
            n_dims = header.scalar("<I")
            if len(name) > _MAX_NAME or not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"{path}: absurd tensor name or dimension count")
            dims = tuple(header.scalar("<Q") for _ in range(n_dims))
            infos.append(_TensorInfo(name, dims, header.scalar("<I"), header.scalar("<Q")))
        data_start = -(-fh.tell() // alignment) * alignment
        data_size = os.fstat(fh.fileno()).st_size - data_start
    if data_size < 0:
        raise ValueError(f"{path}: truncated before the tensor data")
    return infos, data_size


def gguf_layer_bytes(path: Path) -> tuple[list[int], int]:
    """Bytes of each repeating block (`blk.N.*`) and of all other tensors, from the GGUF header.

    Sizes come from each tensor's ggml type and shape; tensors of a type not in GGML_BLOCKS
    share what is left of the data section in proportion to their element counts. Raises
    ValueError for a malformed file, OSError when it cannot be read.
    """
    try:
        infos, data_size = _tensor_infos(path)
    except LockError as exc:  # the shared header reader speaks the lockfile's language
        raise ValueError(f"{path}: {exc}") from None
    unknown: list[tuple[_TensorInfo, int]] = []
    known = 0
    for info in infos:
        elements = 1
        for d in info.dims:
            elements *= d
        block = GGML_BLOCKS.get(info.ggml_type)
        if block is None:
            unknown.append((info, elements))
            continue
        if info.dims[0] % block[0]:
            raise ValueError(f"{path}: tensor {info.name!r} rows do not fill whole ggml blocks")
        info.size = elements // block[0] * block[1]
        if info.offset + info.size > data_size:
            raise ValueError(f"{path}: tensor {info.name!r} extends past the end of the file")
        known += info.size
    if unknown:
        left, weight = max(0, data_size - known), sum(e for _, e in unknown) or 1
        for info, elements in unknown:
            info.size = left * elements // weight
    layers: dict[int, int] = {}
    other = 0
    for info in infos:
        match = _BLOCK.match(info.name)
        if match is None:
            other += info.size or 0
        else:
            layers[int(match[1])] = layers.get(int(match[1]), 0) + (info.size or 0)
    if layers and max(layers) >= len(infos):
        raise ValueError(f"{path}: block numbers run past the tensor count")
    return [layers.get(i, 0) for i in range(max(layers, default=-1) + 1)], other


# ---- the monitor ----------------------------------------------------------------------------

_LOG_LEVELS: Final = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def _describe_reading(gpu: GpuReading) -> str:
    cc = "?" if gpu.compute_capability is None else "{}.{}".format(*gpu.compute_capability)
    total = "?" if gpu.memory_total is None else f"{gpu.memory_total / _GIB:.1f}"
    free = "?" if gpu.memory_free is None else f"{gpu.memory_free / _GIB:.1f}"
    return f"GPU {gpu.index}: {gpu.name or 'unknown'}, compute capability {cc}, {total} GiB ({free} GiB free)"


class GpuMonitor:
    """Polls NVML off the event loop every `interval_s`; `latest` is the last snapshot."""

    def __init__(self, interval_s: float, *, nvml: Any = None, pid: int | None = None,
                 offload_supported: bool = False, gpu_layers: int = 0,
                 model_file_types: Sequence[str] = ()) -> None:
        """`offload_supported`, `gpu_layers` and `model_file_types` feed `verdicts`."""
        self.interval_s = interval_s
        self.latest: GpuSnapshot | None = None
        self.latest_verdicts: tuple[Verdict, ...] = ()  # those of `latest`
        self._read: Callable[[], GpuSnapshot] = lambda: read_gpus(nvml, pid=pid)
        self._judge: Callable[[GpuSnapshot], list[Verdict]] = lambda snapshot: verdicts(
            snapshot, offload_supported=offload_supported, gpu_layers=gpu_layers,
            model_file_types=tuple(model_file_types))
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def start(self) -> None:
        """Take and log the first snapshot, then poll in a background task."""
        snapshot = await asyncio.to_thread(self._read)
        if not snapshot.available:
            log.info("no NVIDIA GPU monitoring: %s", snapshot.reason)
        for gpu in snapshot.devices:
            log.info("%s", _describe_reading(gpu))
        self._update(snapshot)
        self._task = asyncio.create_task(self._run(), name="gpu-monitor")

    async def stop(self) -> None:
        """Cancel the polling task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                snapshot = await asyncio.to_thread(self._read)
            except Exception:  # a bug here must not end monitoring; log it once
                if not self._failing:
                    log.exception("reading the GPUs failed")
                self._failing = True
                continue
            self._failing = False
            self._update(snapshot)

    def _update(self, snapshot: GpuSnapshot) -> None:
        """Store the snapshot; log verdicts that appeared (at their level) and that cleared."""
        snapshot = self._remember_identity(snapshot)
        found = self._judge(snapshot)
        before = {(v.gpu, v.code): v for v in self.latest_verdicts}
        after = {(v.gpu, v.code): v for v in found}
        for key, verdict in after.items():
            old = before.get(key)
            if old is None or old.level != verdict.level:
                level = _LOG_LEVELS.get(verdict.level, logging.WARNING)
                log.log(level, "%s [%s]", verdict.message, verdict.code)
        for key, verdict in before.items():
            if key not in after:
                where = "" if verdict.gpu is None else f"GPU {verdict.gpu}: "
                log.info("%s%s cleared", where, verdict.code)
        self.latest = snapshot
        self.latest_verdicts = tuple(found)

    def _remember_identity(self, snapshot: GpuSnapshot) -> GpuSnapshot:
        """A lost GPU keeps the name and UUID it had, so the operator learns which one it was."""
        known = {d.index: d for d in self.latest.devices} if self.latest is not None else {}
        devices = tuple(
            replace(d, name=d.name or known[d.index].name, uuid=d.uuid or known[d.index].uuid)
            if d.lost and d.index in known else d
            for d in snapshot.devices)
        return replace(snapshot, devices=devices)
