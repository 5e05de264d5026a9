"""The device check's readings judged and reported: comparisons, the diagnosis, report.md.

Plain functions of what tests/gpu/device_check.py read on the GPU machine (results.json),
so that tests/test_gpu_device_check.py runs them on recorded readings on any machine.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

MIB: Final = 1024**2

# The monitor against nvidia-smi: (label, monitor field, how to compare). NVML's v1 memory
# figure, which the monitor reads, counts the driver's reserved memory; nvidia-smi's "used"
# does not (an idle H200: 615 MiB by NVML, 0 used + 616 reserved by nvidia-smi).
READ_AT_ONCE_S: Final = 2.0

MEMORY_TOLERANCE_MIB: Final = 64  # the daemon idles between the two readings: little moves

TEMPERATURE_TOLERANCE_C: Final = 3

POWER_TOLERANCE: Final = 0.25  # of the larger reading, and at least 25 W (power moves fast)

POWER_FLOOR_W: Final = 25.0

UTILIZATION_TOLERANCE: Final = 20  # percentage points: both sample a moving average

CLOCK_TOLERANCE: Final = 0.25

# Switches that tell causes apart when a shape fails: Hopper's programmatic dependent launch,
# and ggml-cuda's fused kernels.
PROBE_VARIANTS: Final = ({"GGML_CUDA_PDL": "0"}, {"GGML_CUDA_DISABLE_FUSION": "1"})

_ERROR_LINE: Final = re.compile(
    r"CUDA error|no device code|illegal (?:instruction|memory)|\w+ failed$|GGML_ASSERT|GGML_ABORT"
    r"|Segmentation fault|core dumped|Aborted"
)

_OFFLOADED: Final = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")

_BUFFER: Final = re.compile(r"(\S+) (model|KV|compute) buffer size = +([\d.]+) MiB")

_AUTO: Final = re.compile(r"gpu_layers auto -> (\S+): (.*)")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One shape, one flash-attention setting, one environment: did it run, and if not, what it said."""

    shape: str
    head_dim: int
    weight_type: str
    flash_attention: str
    env: dict[str, str]
    ok: bool
    returncode: int
    errors: list[str]  # the lines of llama.cpp's and CUDA's output that say what failed
    real: bool


def error_lines(output: str, limit: int = 8) -> list[str]:
    """The lines of a child's output that name a failure (CUDA errors, the failing op, aborts)."""
    found = [line.strip() for line in output.splitlines() if _ERROR_LINE.search(line)]
    return found[-limit:]


def diagnose(results: Sequence[ProbeResult]) -> list[str]:
    """What the probes say about the illegal instruction, in sentences for the report."""
    base = [r for r in results if not r.env]
    failed = [r for r in base if not r.ok]
    if not base:
        return ["No shape was probed."]
    if not failed:
        return [
            "Every candidate shape ran on this GPU and build, the tests' default (head size 16, F32 "
            "matrices) included: the illegal instruction does not reproduce here."
        ]
    out = [
        f"{len(failed)} of {len(base)} probes failed: "
        + ", ".join(f"{r.shape} (fa {r.flash_attention})" for r in failed)
        + "."
    ]
    passed = [r for r in base if r.ok]

    def only(what: str, test: Any) -> None:
        if all(test(r) for r in failed) and not any(test(r) for r in passed):
            out.append(f"Every failure and only those have {what}.")
        elif all(test(r) for r in failed):
            out.append(f"Every failure has {what} (some such probes passed).")

    only("head size 16", lambda r: r.head_dim == 16)
    only("F32 weight matrices", lambda r: r.weight_type == "F32")
    only("flash attention on", lambda r: r.flash_attention == "on")
    for variant in PROBE_VARIANTS:
        ((name, value),) = variant.items()
        tried = [r for r in results if r.env == variant]
        cured = [r for r in tried if r.ok]
        if tried and len(cured) == len(tried):
            out.append(f"With {name}={value} every failing probe passes: that feature is the cause.")
        elif cured:
            out.append(f"With {name}={value} {len(cured)} of {len(tried)} failing probes pass.")
    said = sorted(
        {line for r in failed for line in r.errors if "no device code" in line or line.endswith("failed")}
    )
    if said:
        out.append("llama.cpp named: " + " / ".join(said[:4]))
    if any(r.real for r in failed):
        out.append(
            "A shape real models have failed: a defect of the build on this GPU, not of the test model."
        )
    else:
        out.append(
            "Only shapes that no real model has failed: the tests' tiny model is what the GPU "
            "cannot take (tests/ggufmodels.py: use GPU_SHAPED or Q8_0 weights for GPU runs)."
        )
    return out


def parse_smi_csv(text: str) -> list[dict[str, str]]:
    """nvidia-smi CSV to one dict per GPU, keyed by field name without units ("memory.used")."""
    rows = list(csv.reader(io.StringIO(text.strip()), skipinitialspace=True))
    if not rows:
        return []
    header = [re.sub(r"\s*\[.*\]$", "", h.strip()) for h in rows[0]]
    return [dict(zip(header, (v.strip() for v in row), strict=False)) for row in rows[1:] if row]


def _number(value: str | None) -> float | None:
    """nvidia-smi's "143771 MiB", "120.60 W", "33", or "[N/A]" as a number (None when it has none)."""
    if value is None:
        return None
    match = re.match(r"^\s*(-?\d+(?:\.\d+)?)", value)
    return float(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class Comparison:
    """One field read by the daemon's monitor and by nvidia-smi."""

    field: str
    monitor: str
    smi: str
    ok: bool
    note: str = ""


def compare_gpu(monitor: Mapping[str, Any], smi: Mapping[str, str]) -> list[Comparison]:
    """The daemon's NVML reading of one GPU (as /admin/stats shows it) against nvidia-smi's row."""
    out: list[Comparison] = []

    def exact(name: str, mine: Any, theirs: str | None) -> None:
        if theirs is None:
            return
        out.append(Comparison(name, str(mine), theirs, str(mine) == theirs))

    def near(
        name: str, mine: float | None, theirs: float | None, tolerance: float, unit: str, note: str = ""
    ) -> None:
        if theirs is None or mine is None:
            out.append(Comparison(name, _shown(mine, unit), _shown(theirs, unit), True, "not read by both"))
            return
        out.append(
            Comparison(name, _shown(mine, unit), _shown(theirs, unit), abs(mine - theirs) <= tolerance, note)
        )

    exact("name", monitor.get("name"), smi.get("name"))
    exact("uuid", monitor.get("uuid"), smi.get("uuid"))
    cc = monitor.get("compute_capability")
    exact("compute capability", f"{cc[0]}.{cc[1]}" if cc else None, smi.get("compute_cap"))
    total = monitor.get("memory_total")
    near(
        "memory total", total / MIB if total is not None else None, _number(smi.get("memory.total")), 1, "MiB"
    )
    used = monitor.get("memory_used")
    smi_used = _number(smi.get("memory.used"))
    reserved = _number(smi.get("memory.reserved"))
    if smi_used is not None and reserved is not None:
        near(
            "memory used (NVML v1 = nvidia-smi used + reserved)",
            used / MIB if used is not None else None,
            smi_used + reserved,
            MEMORY_TOLERANCE_MIB,
            "MiB",
        )
    else:  # an nvidia-smi without memory.reserved: the reserved part is unknown, up to about 1 GiB
        near(
            "memory used (NVML v1, nvidia-smi without reserved)",
            used / MIB if used is not None else None,
            smi_used,
            1024,
            "MiB",
        )
    near(
        "temperature",
        monitor.get("temperature_c"),
        _number(smi.get("temperature.gpu")),
        TEMPERATURE_TOLERANCE_C,
        "°C",
    )
    power, smi_power = monitor.get("power_w"), _number(smi.get("power.draw"))
    bound = max(POWER_FLOOR_W, POWER_TOLERANCE * max(power or 0.0, smi_power or 0.0))
    near("power", power, smi_power, bound, "W")
    near(
        "utilization",
        monitor.get("utilization_gpu"),
        _number(smi.get("utilization.gpu")),
        UTILIZATION_TOLERANCE,
        "%",
    )
    for name, key, smi_key in (
        ("SM clock", "sm_clock_mhz", "clocks.sm"),
        ("memory clock", "memory_clock_mhz", "clocks.mem"),
    ):
        mine, theirs = monitor.get(key), _number(smi.get(smi_key))
        near(name, mine, theirs, CLOCK_TOLERANCE * max(mine or 0, theirs or 0), "MHz")
    return out


def _shown(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} {unit}" if abs(value) >= 10 else f"{value:.1f} {unit}"


def read_offload(log: str) -> dict[str, Any]:
    """From the daemon's debug log: layers offloaded, buffers by device, the auto plan, FA, errors."""
    offloaded = None
    buffers: dict[str, float] = {}
    auto = None
    flash = []
    for line in log.splitlines():
        if (m := _OFFLOADED.search(line)) is not None:
            offloaded = [int(m.group(1)), int(m.group(2))]
        elif (m := _BUFFER.search(line)) is not None:
            key = f"{m.group(1)} {m.group(2)}"
            buffers[key] = buffers.get(key, 0.0) + float(m.group(3))
        elif (m := _AUTO.search(line)) is not None:
            auto = {"layers": m.group(1), "why": m.group(2).strip()}
        if "Flash Attention" in line or "flash_attn" in line:
            flash.append(line.split("llama.cpp: ", 1)[-1].strip())
    devices = sorted({k.split()[0] for k in buffers})
    return {
        "offloaded": offloaded,
        "buffers_mib": buffers,
        "devices": devices,
        "auto": auto,
        "flash_attention": flash[-3:],
        "errors": error_lines(log),
    }


def _bench(run: Mapping[str, Any], streams: int) -> Mapping[str, Any] | None:
    found: Mapping[str, Any] | None = run.get("bench", {}).get(str(streams))
    return found


def mismatches(results: Mapping[str, Any]) -> list[str]:
    """Everything the readings disagree on, or that falls short of what the GPU should do."""
    out: list[str] = []
    build = results.get("build") or {}
    arch = results.get("machine", {}).get("arch")
    if "CUDA" not in build.get("backends", []):
        out.append(f"the daemon's llama.cpp build has no CUDA backend (backends: {build.get('backends')})")
    elif arch is not None and arch not in (build.get("cuda_archs") or []):
        out.append(f"the build's CUDA architectures {build.get('cuda_archs')} lack this GPU's {arch}")
    if build and not build.get("gpu_offload"):
        out.append("llama_supports_gpu_offload() is false")
    runs: Mapping[str, Any] = results.get("runs", {})
    for label in ("gpu", "auto"):
        run = runs.get(label)
        if run is None:
            out.append(f"no {label} run")
            continue
        if run.get("error"):
            out.append(f"{label} run: {run['error']}")
            continue
        offload = run.get("offload", {})
        done = offload.get("offloaded")
        if not done or done[0] != done[1]:
            shown = f"{done[0]}/{done[1]}" if done else "?"
            out.append(f"{label} run: llama.cpp offloaded {shown} layers, not all")
        if not any(d.startswith("CUDA") for d in offload.get("devices", [])):
            out.append(f"{label} run: no CUDA buffer in llama.cpp's log (devices: {offload.get('devices')})")
        if label == "auto" and (offload.get("auto") or {}).get("layers") != "all":
            out.append(f"auto run: gpu_layers auto planned {offload.get('auto')}, not all layers")
        vram = run.get("vram", {})
        used, planned, headroom = (
            vram.get("process_bytes"),
            vram.get("planned_bytes"),
            vram.get("headroom_bytes"),
        )
        if used is None:
            out.append(f"{label} run: NVML shows no GPU memory for the daemon's process")
        elif planned is not None and headroom is not None and used > planned + headroom:
            out.append(
                f"{label} run: the daemon uses {used / MIB:.0f} MiB of VRAM, more than auto's plan "
                f"({planned / MIB:.0f} MiB) plus the headroom ({headroom / MIB:.0f} MiB)"
            )
    for label, run in runs.items():
        out.extend(
            f"{label} run, {streams} streams: {figures['failed']} requests failed {figures.get('errors')}"
            for streams, figures in run.get("bench", {}).items()
            if figures.get("failed")
        )
        out.extend(
            f"{label} run: {c['field']}: monitor {c['monitor']}, nvidia-smi {c['smi']}"
            for c in run.get("nvml_vs_smi", [])
            if not c["ok"]
        )
    gpu, cpu = runs.get("gpu", {}), runs.get("cpu", {})
    for streams in (1, 8):
        fast, slow = _bench(gpu, streams), _bench(cpu, streams)
        if fast and slow and fast["tokens_per_s"] <= slow["tokens_per_s"]:
            out.append(
                f"{streams} stream(s): the GPU makes {fast['tokens_per_s']:.1f} tokens/s, the CPU "
                f"{slow['tokens_per_s']:.1f}: no faster"
            )
    one, eight = _bench(gpu, 1), _bench(gpu, 8)
    if one and eight and eight["tokens_per_s"] <= one["tokens_per_s"]:
        out.append(
            f"GPU: 8 streams make {eight['tokens_per_s']:.1f} tokens/s together, 1 stream "
            f"{one['tokens_per_s']:.1f}: batching gains nothing"
        )
    out.extend(
        f"shape {p['shape']} (fa {p['flash_attention']}) failed on the GPU: {p['errors'][-1:]}"
        for p in results.get("probes", [])
        if p["real"] and not p["env"] and not p["ok"]
    )
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _devices(build: Mapping[str, Any]) -> str:
    shown = [f"{d.get('name')} ({d.get('description')})" for d in build.get("devices", [])]
    return ", ".join(shown) or "-"


def render_report(results: Mapping[str, Any], found: Sequence[str]) -> str:
    """results.json as Markdown: the figures the README quotes, every comparison, the verdict."""
    machine = results.get("machine", {})
    build = results.get("build") or {}
    lines = [
        "# edgellm device check",
        "",
        f"{results.get('date', '?')}: {machine.get('gpu', '?')} (compute capability "
        f"{machine.get('compute_cap', '?')}), driver {machine.get('driver', '?')}, "
        f"{machine.get('nvcc', 'no nvcc')}; model {results.get('model', {}).get('name', '?')} "
        f"({_fmt((results.get('model', {}).get('bytes') or 0) / MIB, 0)} MiB).",
        "",
        f"**{'PASS' if not found else 'FAIL'}**: {len(found)} mismatch(es).",
        "",
    ]
    if found:
        lines += [f"- {m}" for m in found] + [""]
    lines += [
        "## Build",
        "",
        f"- backends: {', '.join(build.get('backends', [])) or '-'}; CUDA architectures: "
        f"{', '.join(str(a) for a in build.get('cuda_archs') or []) or '-'}; "
        f"gpu_offload: {build.get('gpu_offload')}",
        f"- devices: {_devices(build)}",
        f"- system info: `{build.get('system_info', '-')}`",
        f"- CMAKE_ARGS: `{results.get('cmake_args', '-')}`",
        "",
        "## Offload",
        "",
    ]
    runs: Mapping[str, Any] = results.get("runs", {})
    rows: list[Sequence[Any]] = []
    for label, run in runs.items():
        offload = run.get("offload", {})
        done = offload.get("offloaded")
        auto = offload.get("auto")
        rows.append(
            (
                label,
                run.get("gpu_layers"),
                f"{done[0]}/{done[1]}" if done else "-",
                ", ".join(f"{k} {v:.0f} MiB" for k, v in sorted(offload.get("buffers_mib", {}).items()))
                or "-",
                f"{auto['layers']}: {auto['why']}" if auto else "-",
                "; ".join(offload.get("flash_attention", [])) or "-",
            )
        )
    lines += _table(
        ("run", "gpu_layers", "layers on GPU", "llama.cpp buffers", "auto's plan", "flash attention"), rows
    )
    lines += ["", "## Speed (edgellmctl bench, --ignore-eos, 64 tokens per request)", ""]
    rows = []
    for label, run in runs.items():
        for streams, f in sorted(run.get("bench", {}).items(), key=lambda kv: int(kv[0])):
            rows.append(
                (
                    label,
                    streams,
                    _fmt(f.get("tokens_per_s")),
                    _fmt(f.get("stream_tokens_per_s")),
                    _fmt((f.get("ttft_p50_s") or 0) * 1000, 0),
                    _fmt((f.get("ttft_p95_s") or 0) * 1000, 0),
                    f"{f.get('ok')}/{f.get('requests')}",
                )
            )
    lines += _table(("run", "streams", "tokens/s", "per stream", "TTFT p50 ms", "TTFT p95 ms", "ok"), rows)
    lines += ["", "## VRAM: the daemon's process against auto's plan", ""]
    rows = []
    for label, run in runs.items():
        vram = run.get("vram")
        if not vram:
            continue
        rows.append(
            (
                label,
                _fmt((vram.get("process_bytes") or 0) / MIB, 0),
                _fmt((vram.get("planned_bytes") or 0) / MIB, 0),
                _fmt((vram.get("headroom_bytes") or 0) / MIB, 0),
                _fmt((vram.get("free_before_bytes") or 0) / MIB, 0),
            )
        )
    lines += _table(
        ("run", "process MiB (NVML)", "planned MiB (layers + other + KV)", "headroom MiB", "free before MiB"),
        rows,
    )
    lines += ["", "## NVML monitor against nvidia-smi", ""]
    rows = []
    for label, run in runs.items():
        for c in run.get("nvml_vs_smi", []):
            rows.append(
                (
                    label,
                    c["field"],
                    c["monitor"],
                    c["smi"],
                    "ok" if c["ok"] else "MISMATCH",
                    c.get("note", ""),
                )
            )
    lines += _table(("run", "field", "monitor", "nvidia-smi", "", "note"), rows)
    lines += ["", "## The illegal instruction: candidate shapes on this GPU", ""]
    rows = [
        (
            p["shape"],
            p["head_dim"],
            p["weight_type"],
            p["flash_attention"],
            " ".join(f"{k}={v}" for k, v in p["env"].items()) or "-",
            "ok" if p["ok"] else f"FAILED ({p['returncode']})",
            "; ".join(p["errors"][-2:]) or "-",
        )
        for p in results.get("probes", [])
    ]
    lines += _table(
        ("shape", "head size", "weights", "flash attention", "env", "result", "what it said"), rows
    )
    lines += [""] + [f"- {s}" for s in results.get("diagnosis", [])] + [""]
    return "\n".join(lines)


def write_report(results: Mapping[str, Any], out: Path) -> list[str]:
    """Write the Markdown report beside results.json; the mismatches."""
    found = mismatches(results)
    out.write_text(render_report(results, found))
    return found
