"""A fake `pynvml` (nvidia-ml-py) answering from tables shaped on what a real H200 answered.

Each device is a table of call -> answer in the format of `tests/data/nvml/h200.nvml.json`
(recorded call by call on an H200): `{"value": ...}` or `{"error": "NVMLError_NotSupported"}`.
Keys are pynvml function names, plus `temperature_gpu`, `clock_NVML_CLOCK_SM`/`_MEM` and
`ecc_{corrected,uncorrected}_volatile` for the calls that take a selector. Exceptions and
constants are the installed pynvml's own, so the fake cannot drift from the real binding.
"""

# The methods carry pynvml's camelCase names and parameters: that is the point of the fake.
# ruff: noqa: N802, N803

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information

H200_JSON: Final = Path(__file__).parent / "data" / "nvml" / "h200.nvml.json"

Answers = dict[str, dict[str, Any]]

_CLOCKS: Final = {
    pynvml.NVML_CLOCK_SM: "NVML_CLOCK_SM",
    pynvml.NVML_CLOCK_MEM: "NVML_CLOCK_MEM",
    pynvml.NVML_CLOCK_GRAPHICS: "NVML_CLOCK_GRAPHICS",
}
_ECC: Final = {
    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
}


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    """Module-like stand-in for pynvml: the calls `read_gpus` makes, with pynvml's signatures."""

    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC

    def __init__(
        self,
        system: Answers,
        devices: list[Answers],
        *,
        init_error: str | None = None,
        lost_after: Mapping[int, int] | None = None,
    ) -> None:
        self.system = system
        self.devices = devices
        self.init_error = init_error
        self.lost_after = dict(lost_after or {})  # device -> healthy polls before GpuIsLost
        self.polls = 0  # nvmlInit calls
        self.initialised = False

    def __getattr__(self, name: str) -> Any:
        # Every NVMLError_* class and constant of the real module (nvmlClocksEventReason..., ...).
        if name.startswith(("NVMLError_", "NVML_", "nvmlClocks")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # ---- answering ----------------------------------------------------------------------

    def _answer(self, answer: Mapping[str, Any]) -> Any:
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized
        if "error" in answer:
            error = getattr(pynvml, answer["error"])
            raise error("fake") if answer["error"] == "NVMLLibraryMismatchError" else error
        return copy.deepcopy(answer["value"])

    def _device(self, handle: _Handle, key: str) -> Any:
        if self.polls > self.lost_after.get(handle.index, self.polls):
            raise pynvml.NVMLError_GpuIsLost
        return self._answer(self.devices[handle.index][key])

    # ---- the pynvml functions read_gpus uses ----------------------------------------------

    def nvmlInit(self) -> None:
        self.polls += 1
        if self.init_error is not None:
            raise getattr(pynvml, self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._answer(self.system["nvmlSystemGetDriverVersion"]))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self._answer(self.system["nvmlSystemGetCudaDriverVersion"]))

    def nvmlDeviceGetCount(self) -> int:
        return int(self._answer(self.system["nvmlDeviceGetCount"]))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not self.initialised:
            raise pynvml.NVMLError_Uninitialized
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError_InvalidArgument
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return str(self._device(handle, "nvmlDeviceGetName"))

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return str(self._device(handle, "nvmlDeviceGetUUID"))

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        major, minor = self._device(handle, "nvmlDeviceGetCudaComputeCapability")
        return (major, minor)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> SimpleNamespace:
        assert version is None, "the H200 recording holds the v1 answer only"
        return SimpleNamespace(**self._device(handle, "nvmlDeviceGetMemoryInfo"))

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        return SimpleNamespace(**self._device(handle, "nvmlDeviceGetUtilizationRates"))

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._device(handle, "temperature_gpu"))

    def nvmlDeviceGetFanSpeed(self, handle: _Handle) -> int:
        return int(self._device(handle, "nvmlDeviceGetFanSpeed"))

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return int(self._device(handle, "nvmlDeviceGetPowerUsage"))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return int(self._device(handle, "nvmlDeviceGetEnforcedPowerLimit"))

    def nvmlDeviceGetClockInfo(self, handle: _Handle, type: int) -> int:  # noqa: A002 - pynvml's name
        return int(self._device(handle, f"clock_{_CLOCKS[type]}"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return int(self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        return int(self._device(handle, "nvmlDeviceGetCurrentClocksThrottleReasons"))

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, errorType: int, counterType: int) -> int:
        assert counterType == pynvml.NVML_VOLATILE_ECC
        return int(self._device(handle, f"ecc_{_ECC[errorType]}_volatile"))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[SimpleNamespace]:
        return [SimpleNamespace(**p) for p in self._device(handle, "nvmlDeviceGetComputeRunningProcesses")]


# ---- profiles -----------------------------------------------------------------------------


def _answers(**calls: Any) -> Answers:
    """Call -> answer; an NVMLError class (or NVMLLibraryMismatchError) stands for that error."""
    return {
        key: {"error": value.__name__} if isinstance(value, type) else {"value": value}
        for key, value in calls.items()
    }


def _recording() -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(H200_JSON.read_text())
    return recorded


def h200(device: Mapping[str, Any] | None = None, *, count: int = 1, **kw: Any) -> FakeNvml:
    """The recorded H200 (driver 580.159.04, CUDA 13.0), `count` copies, `device` calls replaced."""
    recorded = _recording()
    devices = []
    for i in range(count):
        answers: Answers = copy.deepcopy(recorded["devices"][0])
        answers["nvmlDeviceGetUUID"] = {"value": f"GPU-00000000-0000-0000-0000-00000000000{i}"}
        answers |= _answers(**(device or {}))
        devices.append(answers)
    system: Answers = recorded["system"] | _answers(nvmlDeviceGetCount=count)
    return FakeNvml(system, devices, **kw)


def p40() -> FakeNvml:
    """A Tesla P40 (6.1, 24 GB, ECC off) on driver 580, the last branch for Pascal: passive, no fan."""
    fake = h200(
        {
            "nvmlDeviceGetName": "Tesla P40",
            "nvmlDeviceGetCudaComputeCapability": [6, 1],
            "nvmlDeviceGetMemoryInfo": {
                "total": 24451 * 1024**2,
                "free": 24290 * 1024**2,
                "used": 161 * 1024**2,
            },
            "nvmlDeviceGetUtilizationRates": {"gpu": 0, "memory": 0},
            "nvmlDeviceGetPowerUsage": 9870,
            "nvmlDeviceGetEnforcedPowerLimit": 250000,
            "nvmlDeviceGetFanSpeed": pynvml.NVMLError_NotSupported,
            "nvmlDeviceGetCurrentClocksEventReasons": 0,
            "temperature_gpu": 27,
            "clock_NVML_CLOCK_SM": 544,
            "clock_NVML_CLOCK_MEM": 405,
            "ecc_corrected_volatile": pynvml.NVMLError_NotSupported,
            "ecc_uncorrected_volatile": pynvml.NVMLError_NotSupported,
        }
    )
    fake.system |= _answers(nvmlSystemGetDriverVersion="580.95.05", nvmlSystemGetCudaDriverVersion=13000)
    return fake


def old_driver() -> FakeNvml:
    """The P40 on driver 470 (CUDA 11.4): no ...ClocksEventReasons, no v3 process list."""
    fake = p40()
    fake.devices[0] |= _answers(
        nvmlDeviceGetCurrentClocksEventReasons=pynvml.NVMLError_FunctionNotFound,
        nvmlDeviceGetCurrentClocksThrottleReasons=0x1,
        # pynvml turns the missing _v3 function into this error
        nvmlDeviceGetComputeRunningProcesses=pynvml.NVMLLibraryMismatchError,
    )
    fake.system |= _answers(nvmlSystemGetDriverVersion="470.256.02", nvmlSystemGetCudaDriverVersion=11040)
    return fake


def maxwell() -> FakeNvml:
    """A Tesla M40 (compute capability 5.2), below what edgellm supports."""
    return h200({"nvmlDeviceGetName": "Tesla M40 24GB", "nvmlDeviceGetCudaComputeCapability": [5, 2]})


def not_supported_fields() -> FakeNvml:
    """A consumer card seen from a container: several fields refused, one way or another."""
    return h200(
        {
            "nvmlDeviceGetName": "NVIDIA GeForce RTX 3090",
            "nvmlDeviceGetCudaComputeCapability": [8, 6],
            "nvmlDeviceGetUtilizationRates": pynvml.NVMLError_NotSupported,
            "nvmlDeviceGetPowerUsage": pynvml.NVMLError_NotSupported,
            "nvmlDeviceGetEnforcedPowerLimit": pynvml.NVMLError_NoPermission,
            "nvmlDeviceGetFanSpeed": 41,
            "ecc_corrected_volatile": pynvml.NVMLError_NotSupported,
            "ecc_uncorrected_volatile": pynvml.NVMLError_NotSupported,
            "nvmlDeviceGetComputeRunningProcesses": [{"pid": 4242, "usedGpuMemory": None}],
        }
    )


def no_driver() -> FakeNvml:
    """No NVIDIA driver: nvmlInit cannot load libnvidia-ml.so.1."""
    return h200(init_error="NVMLError_LibraryNotFound")


def gpu_lost_after(n: int) -> FakeNvml:
    """Two H200s; GPU 0 answers GpuIsLost from poll n + 1 on, GPU 1 stays healthy."""
    return h200(count=2, lost_after={0: n})


def hot() -> FakeNvml:
    """The H200 slowing down for heat and at its power cap."""
    return h200({"nvmlDeviceGetCurrentClocksEventReasons": 0x20 | 0x40 | 0x08 | 0x04, "temperature_gpu": 91})


def ecc_errors() -> FakeNvml:
    """The H200 with uncorrected ECC errors since the driver loaded."""
    return h200({"ecc_corrected_volatile": 17, "ecc_uncorrected_volatile": 2})
