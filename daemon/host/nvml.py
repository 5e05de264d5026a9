"""Reading NVIDIA GPUs through NVML (nvidia-ml-py), from Pascal P40 (6.1) to H200 (9.0), and the monitor.

NVML answers differ by GPU, driver and permissions: passive cards have no fan reading, old
drivers lack newer calls, containers hide other processes, a GPU can fall off the bus. Each
of those becomes a `None` field with its reason in `GpuReading.unavailable` (or `lost`), never
an exception, so one odd GPU never hides the others. `host.verdicts` turns a snapshot into
sentences an operator can act on; `host.offload` sizes a partial offload.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final

from edgellmd.host.gpu import GpuReading, GpuSnapshot
from edgellmd.host.verdicts import GpuLayers, Verdict, verdicts

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
# GGUF file types (general.file_type names, with or without MOSTLY_/ALL_) that are not quantized.
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
        for kind, error_type in (
            ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
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
        "function not found on this driver",
        "not in this nvidia-ml-py version",
    ):
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


def _reading(
    index: int, values: Mapping[str, Any], unavailable: Mapping[str, str], *, lost: bool = False
) -> GpuReading:
    get = values.get
    return GpuReading(
        index=index,
        name=get("name"),
        uuid=get("uuid"),
        compute_capability=get("compute_capability"),
        memory_total=get("memory_total"),
        memory_used=get("memory_used"),
        memory_free=get("memory_free"),
        utilization_gpu=get("utilization_gpu"),
        utilization_memory=get("utilization_memory"),
        temperature_c=get("temperature_c"),
        fan_percent=get("fan_percent"),
        power_w=get("power_w"),
        power_limit_w=get("power_limit_w"),
        sm_clock_mhz=get("sm_clock_mhz"),
        memory_clock_mhz=get("memory_clock_mhz"),
        throttle_reasons=get("throttle_reasons", ()),
        ecc_volatile_corrected=get("ecc_volatile_corrected"),
        ecc_volatile_uncorrected=get("ecc_volatile_uncorrected"),
        process_memory=get("process_memory"),
        unavailable=MappingProxyType(dict(unavailable)),
        lost=lost,
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
    return GpuSnapshot(
        True,
        None,
        None if driver is None else _text(driver),
        None if cuda is None else int(cuda),
        devices,
        taken_at,
    )


# ---- the monitor ----------------------------------------------------------------------------

_LOG_LEVELS: Final = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def _describe_reading(gpu: GpuReading) -> str:
    cc = "?" if gpu.compute_capability is None else "{}.{}".format(*gpu.compute_capability)
    total = "?" if gpu.memory_total is None else f"{gpu.memory_total / _GIB:.1f}"
    free = "?" if gpu.memory_free is None else f"{gpu.memory_free / _GIB:.1f}"
    return f"GPU {gpu.index}: {gpu.name or 'unknown'}, compute capability {cc}, {total} GiB ({free} GiB free)"


class GpuMonitor:
    """Polls NVML off the event loop every `interval_s`; `latest` is the last snapshot."""

    def __init__(
        self,
        interval_s: float,
        *,
        nvml: Any = None,
        pid: int | None = None,
        offload_supported: bool = False,
        gpu_layers: GpuLayers = 0,
        model_file_types: Sequence[str] | Callable[[], Iterable[str]] = (),
    ) -> None:
        """`offload_supported`, `gpu_layers` and `model_file_types` feed `verdicts`.

        `gpu_layers`: what the models ask for, as `largest_gpu_layers` reduces them to one value.
        `model_file_types`: the models' GGUF file types, or a callable that says what they are
        now (so that a reload shows); it is called with each reading, off the event loop, and
        may read files.
        """
        self.interval_s = interval_s
        self.latest: GpuSnapshot | None = None
        self.latest_verdicts: tuple[Verdict, ...] = ()  # those of `latest`
        fixed = tuple(model_file_types) if isinstance(model_file_types, Sequence) else ()
        file_types = (lambda: fixed) if isinstance(model_file_types, Sequence) else model_file_types
        self._file_types: tuple[str, ...] = fixed  # as of the latest reading
        self._types_failing = False

        def read() -> GpuSnapshot:
            # In the polling thread: set before the reading is judged on the loop.
            try:
                self._file_types = tuple(file_types())
            except Exception:  # a bug here must not end monitoring; log it once, keep the last types
                if not self._types_failing:
                    log.exception("finding the models' file types failed")
                self._types_failing = True
            else:
                self._types_failing = False
            return read_gpus(nvml, pid=pid)

        self._read: Callable[[], GpuSnapshot] = read
        self._judge: Callable[[GpuSnapshot], list[Verdict]] = lambda snapshot: verdicts(
            snapshot,
            offload_supported=offload_supported,
            gpu_layers=gpu_layers,
            model_file_types=self._file_types,
        )
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
            if d.lost and d.index in known
            else d
            for d in snapshot.devices
        )
        return replace(snapshot, devices=devices)
