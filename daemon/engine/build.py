"""What the llama.cpp build can do, as the daemon learns it without loading llama.cpp itself.

The daemon process never imports `llama_cpp` while its models run in engine processes
(`isolation: process`): native code that parses model files and client-shaped data runs
there, confined. What the build can do (its backends, devices, CUDA architectures, whether
it offloads to a GPU) is then asked of:

- a running engine process (`RemoteEngine.build_info`): it has llama.cpp loaded already;
- in this process, when llama.cpp is loaded here anyway (a model with `isolation: thread`);
- else a short-lived process of its own (`python -m edgellmd.engine.worker --build-info`),
  which loads llama.cpp, prints the answer as JSON and exits. Its answer is kept for
  PROBE_TTL_S (device memory changes; the build does not), its failure is an EngineError.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Final

from edgellmd.engine.config import BackendDevice, BuildInfo, EngineError

PROBE_TIMEOUT_S: Final = 120.0  # loading llama.cpp and its CUDA backend: seconds, not minutes
PROBE_TTL_S: Final = 60.0
_OUTPUT_LIMIT: Final = 1 << 20  # bytes of the probe's answer read at most

_lock = threading.Lock()
_probed: tuple[float, BuildInfo] | None = None


def encode(info: BuildInfo) -> dict[str, Any]:
    """A BuildInfo as JSON-ready data (an engine process's answer)."""
    return asdict(info)


def decode(data: Any) -> BuildInfo:
    """The other way; EngineError for anything that is not a BuildInfo's shape."""
    try:
        archs = data["cuda_archs"]
        return BuildInfo(
            backends=tuple(str(b) for b in data["backends"]),
            devices=tuple(
                BackendDevice(
                    name=str(d["name"]),
                    description=str(d["description"]),
                    type=str(d["type"]),
                    memory_free=int(d["memory_free"]),
                    memory_total=int(d["memory_total"]),
                )
                for d in data["devices"]
            ),
            cuda_archs=None if archs is None else tuple(int(a) for a in archs),
            gpu_offload=bool(data["gpu_offload"]),
            system_info=str(data["system_info"]),
            features={
                str(k): {str(f): str(v) for f, v in dict(fs).items()} for k, fs in data["features"].items()
            },
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"an answer about the llama.cpp build that is not one ({exc!r})") from None


def native_loaded() -> bool:
    """True when llama.cpp is loaded in this process already (an in-process engine, a test)."""
    return "llama_cpp" in sys.modules


def build_info() -> BuildInfo:
    """What the build can do: here if llama.cpp is loaded here, else from a probe process (blocking)."""
    global _probed  # noqa: PLW0603 - one cached answer per daemon
    if native_loaded():
        from edgellmd.engine import native  # noqa: PLC0415 - loaded already: costs nothing

        return native.build_info()
    with _lock:
        if _probed is not None and time.monotonic() - _probed[0] < PROBE_TTL_S:
            return _probed[1]
        info = _probe()
        _probed = (time.monotonic(), info)
        return info


def supports_gpu_offload() -> bool:
    """True when the build can offload layers to a GPU (blocking, as `build_info`)."""
    return build_info().gpu_offload


def _probe() -> BuildInfo:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "edgellmd.engine.worker", "--build-info"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"the llama.cpp build could not be probed: {exc}") from None
    if done.returncode != 0:
        last = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        code = done.returncode
        how = f"exited with {code}" if code > 0 else f"died of signal {-code}"
        raise EngineError(f"the llama.cpp build probe {how}: {last[0][:300]}")
    try:
        data = json.loads(done.stdout[:_OUTPUT_LIMIT])
    except ValueError:
        raise EngineError("the llama.cpp build probe answered something that is not JSON") from None
    return decode(data)
