"""`edgellmctl doctor`: check a host before and after provisioning, one line per check with its fix."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import psutil

from edgellmctl.cli import Subcommands
from edgellmctl.cpubuild import AMX_FLAGS, Verdict, compiler, cpu_flags, parse_flags, probe
from edgellmctl.cudabuild import cc_name, coverage, rebuild_hint
from edgellmd.files import kind_of, read_regular
from edgellmd.host.cpu import AUTO, CpuListError, format_cpu_list, one_per_core, parse_cpu_list
from edgellmd.host.nvml import read_gpus
from edgellmd.host.verdicts import largest_gpu_layers, verdicts
from edgellmd.models.lockfile import MAX_KEY_BYTES, LockError, load_lock, resolve_model_file
from edgellmd.settings import ConfigError, Settings, load_settings

if TYPE_CHECKING:
    from edgellmd.engine import BuildInfo
    from edgellmd.host.gpu import GpuSnapshot

DEFAULT_CONFIG: Final = Path("/etc/edgellm/edgellm.yaml")
UNIT_PATHS: Final = (
    Path("/etc/systemd/system/edgellm.service"),
    Path("/lib/systemd/system/edgellm.service"),
    Path("/usr/lib/systemd/system/edgellm.service"),
)
SHM: Final = Path("/dev/shm")  # noqa: S108 - the tmpfs models are preloaded into
MAX_EXPOSURE: Final = 2.0  # systemd-analyze security: "OK" and better
GIB: Final = 1024**3
_EXPOSURE: Final = re.compile(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class Check:
    """One finding: `level` is ok, warn or fail; `fix` says what to do when it is not ok."""

    name: str
    level: str
    detail: str
    fix: str | None = None


@dataclass(frozen=True, slots=True)
class Host:
    """Where the checks read the machine (tests point these at fixtures)."""

    cpuinfo: Path = Path("/proc/cpuinfo")
    shm: Path = SHM
    systemd_analyze: str | None = shutil.which("systemd-analyze")
    nvml: Any = None  # pynvml, or a stand-in
    # The AMX probe of ops/cpubuild.py: (CPU flags, C++ compiler) -> verdict.
    amx_probe: Callable[[frozenset[str], str | None], Verdict] = probe


def _ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def check_cpu_flags(host: Host) -> Check:
    """AVX2 makes llama.cpp's CPU kernels several times faster; AVX-512 helps further."""
    try:
        text = host.cpuinfo.read_text()
    except OSError as exc:
        return Check("cpu flags", "warn", f"cannot read {host.cpuinfo}: {exc.strerror}")
    flags = parse_flags(text)
    if "avx2" not in flags and "asimd" not in flags:
        return Check(
            "cpu flags",
            "warn",
            "no AVX2: llama.cpp's CPU kernels will be several times slower",
            "use a CPU with AVX2 (x86-64-v3) for CPU inference, or offload to a GPU",
        )
    extras = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return _ok(
        "cpu flags",
        "AVX2" + (f", {', '.join(extras)}" if extras else "") if "avx2" in flags else "ARM NEON (asimd)",
    )


_AMX_FIX: Final = (
    "rebuild llama-cpp-python without them: ./dev demo does it, or "
    'CMAKE_ARGS="$(python3 -m edgellmctl.cpubuild cmake-args)" pip install --force-reinstall --no-deps '
    "--no-cache-dir --no-binary llama-cpp-python llama-cpp-python==<the installed version>"
)


def check_cpu_build(build: BuildInfo, host: Host) -> Check:
    """llama.cpp's AMX kernels, where the CPU runs them: does this machine's compiler build them
    right (ops/cpubuild.py)? GCC 12's do not, and every prompt of more than one token crashes."""
    if build.features.get("CPU", {}).get("AMX_INT8") != "1":
        return _ok("cpu build", "llama.cpp has no AMX kernels")
    flags = cpu_flags(host.cpuinfo)
    if not flags >= AMX_FLAGS:
        return _ok("cpu build", "llama.cpp has AMX kernels; this CPU has no AMX to run them")
    cxx = compiler()
    verdict = host.amx_probe(flags, cxx)
    if verdict.broken:
        return Check(
            "cpu build",
            "fail",
            f"llama.cpp has AMX kernels, and {verdict.line}: every prompt of more than one token "
            "crashes the daemon",
            _AMX_FIX,
        )
    if cxx is None:
        return Check(
            "cpu build",
            "warn",
            "llama.cpp has AMX kernels, and there is no C++ compiler to probe them with: built by "
            "GCC 12 they crash on the first prompt of more than one token",
            "run `python3 -m edgellmctl.cpubuild probe` with the compiler that built it, on a CPU like "
            "this one; if it finds AMX broken, " + _AMX_FIX,
        )
    return _ok("cpu build", f"llama.cpp has AMX kernels; {verdict.line}")


def check_affinity(settings: Settings | None) -> Check:
    """The CPUs the daemon may use, and whether host.cpus fits inside them."""
    allowed = frozenset(os.sched_getaffinity(0))
    shown = f"{len(allowed)} CPUs allowed ({format_cpu_list(allowed)})"
    wanted = settings.host.cpus if settings else None
    if wanted is None:
        return _ok("cpu affinity", shown + "; host.cpus not set")
    target = one_per_core(allowed) if wanted == AUTO else parse_cpu_list(wanted)
    outside = target - allowed
    if outside:
        return Check(
            "cpu affinity",
            "warn",
            f"host.cpus {wanted} includes CPUs {format_cpu_list(outside)} this process may not use; {shown}",
            "change host.cpus, or the cgroup/cpuset (systemd: AllowedCPUs=) that limits the service",
        )
    return _ok("cpu affinity", f"host.cpus {wanted} -> {format_cpu_list(target)}; {shown}")


def _model_sizes(settings: Settings) -> dict[str, int]:
    sizes: dict[str, int] = {}
    if settings.lock.allow_unsigned:
        for m in settings.models:
            if m.file is not None and m.file.exists():
                sizes[m.name] = m.file.stat().st_size
        return sizes
    if settings.lock.file is None:
        return sizes
    lock = load_lock(settings.lock.file)
    for name, entry in lock.models.items():
        sizes[name] = entry.size
    return sizes


def check_memory(settings: Settings | None) -> Iterator[Check]:
    """RAM against the models' sizes, and /dev/shm against a swap (two copies of the largest)."""
    if settings is None:
        return
    try:
        sizes = _model_sizes(settings)
    except (LockError, OSError) as exc:
        yield Check("memory", "warn", f"cannot size the models: {exc}")
        return
    if not sizes:
        yield Check("memory", "warn", "no model files found to size")
        return
    total = sum(sizes.values())
    memory = psutil.virtual_memory()
    detail = (
        f"models {total / GIB:.1f} GiB, RAM {memory.total / GIB:.1f} GiB ({memory.available / GIB:.1f} free)"
    )
    if total * 1.2 > memory.total:
        yield Check(
            "memory", "fail", detail, "add RAM, use smaller quantizations (Q4_K_M), or serve fewer models"
        )
    else:
        yield _ok("memory", detail)


def check_shm(settings: Settings | None, host: Host) -> Check:
    """The preload tmpfs must hold two copies of the largest model for a hot swap."""
    if settings is not None and settings.lifecycle.preload_dir is None:
        return _ok("shm", "preloading is off (lifecycle.preload_dir: null)")
    try:
        usage = shutil.disk_usage(host.shm)
    except OSError as exc:
        return Check(
            "shm",
            "warn",
            f"cannot read {host.shm}: {exc.strerror}",
            "mount a tmpfs on /dev/shm, or set lifecycle.preload_dir: null",
        )
    largest = 0
    if settings is not None:
        try:
            largest = max(_model_sizes(settings).values(), default=0)
        except (LockError, OSError):
            largest = 0
    detail = f"{usage.free / GIB:.1f} GiB free of {usage.total / GIB:.1f} GiB"
    if largest and usage.free < 2 * largest:
        return Check(
            "shm",
            "warn",
            f"{detail}; a swap of the largest model ({largest / GIB:.1f} GiB) "
            "needs room for two copies, so models will load from the models directory",
            f"grow it: mount -o remount,size={max(1, int(2.2 * largest / GIB))}G /dev/shm "
            "(the Ansible role sets edgellm_shm_size)",
        )
    return _ok("shm", detail)


def describe_build(build: BuildInfo) -> str:
    """ "llama.cpp build: CUDA (6.1, 9.0), CPU" or "llama.cpp build: CPU only"."""
    if "CUDA" not in build.backends and not build.gpu_offload:
        return f"llama.cpp build: {', '.join(build.backends) or '?'} only"
    archs = build.cuda_archs
    cuda = f"CUDA ({', '.join(cc_name(a) for a in archs)})" if archs else "CUDA (architectures not listed)"
    return "llama.cpp build: " + ", ".join(cuda if name == "CUDA" else name for name in build.backends)


_CPU_ONLY_FIX: Final = (
    "build llama-cpp-python with CUDA: EDGELLM_CUDA=1 ./dev demo (CUDA 12.x for a Pascal or Volta GPU), "
    "or edgellm_cuda in the Ansible role (README: GPU boxes)"
)


def check_build(build: BuildInfo, snapshot: GpuSnapshot) -> Iterator[Check]:
    """The llama.cpp build against each GPU's compute capability: does it have code for it?"""
    gpus = [g for g in snapshot.devices if not g.lost] if snapshot.available else []
    shown = describe_build(build)
    if not gpus:
        yield _ok("gpu build", shown)
        return
    if "CUDA" not in build.backends:
        yield Check(
            "gpu build",
            "warn",
            f"{len(gpus)} NVIDIA GPU(s) present, but this {shown}: every layer runs on the CPU",
            _CPU_ONLY_FIX,
        )
        return
    if build.cuda_archs is None:
        yield Check(
            "gpu build",
            "warn",
            f"{shown}: its CUDA backend does not list the architectures it was compiled for "
            "(nvcc before 11.5?), so they cannot be checked against the GPUs",
            "rebuild llama-cpp-python with a current CUDA toolkit: EDGELLM_CUDA=1 ./dev demo",
        )
        return
    compiled = build.cuda_archs
    listed = ", ".join(cc_name(a) for a in compiled)
    for gpu in gpus:
        cc = gpu.compute_capability
        if cc is None:
            continue
        arch = cc[0] * 10 + cc[1]
        who = f"GPU {gpu.index} ({gpu.name or '?'}, {cc_name(arch)})"
        how, used = coverage(arch, compiled)
        if how == "exact":
            yield _ok("gpu build", f"{who}: the build has sm_{arch} code (CUDA {listed})")
        elif how == "same_major":
            yield Check(
                "gpu build",
                "warn",
                f"{who} runs the build's sm_{used} code, not kernels of its own (CUDA {listed})",
                rebuild_hint(arch),
            )
        elif how == "other_major":
            yield Check(
                "gpu build",
                "fail",
                f"{who}: the build has no sm_{arch} code (CUDA {listed}); its sm_{used} code runs there "
                "only JIT-compiled from PTX, if the build carries PTX for it at all",
                rebuild_hint(arch),
            )
        else:
            yield Check(
                "gpu build",
                "fail",
                f"{who}: the build has no sm_{arch} code nor any older (CUDA {listed}): llama.cpp has "
                "no kernels to run on it",
                rebuild_hint(arch),
            )


def check_gpu(settings: Settings | None, host: Host, build_info: Callable[[], BuildInfo]) -> Iterator[Check]:
    """GPUs, their compute capability against this llama.cpp build, and the monitor's verdicts."""
    # As the daemon's GPU monitor judges them: the model that offloads most.
    layers = largest_gpu_layers(m.gpu_layers for m in settings.models) if settings else 0
    snapshot = read_gpus(host.nvml)
    info = build_info()
    supported = info.gpu_offload
    build = "this llama.cpp build can offload" if supported else "this llama.cpp build is CPU-only"
    if not snapshot.available:
        level = "warn" if layers != 0 else "ok"
        yield Check(
            "gpu",
            level,
            f"no NVIDIA GPU monitoring ({snapshot.reason}); {build}",
            "install the NVIDIA driver, or set gpu_layers: 0" if level == "warn" else None,
        )
        return
    for gpu in snapshot.devices:
        cc = gpu.compute_capability
        yield _ok(
            "gpu",
            f"GPU {gpu.index}: {gpu.name}, compute capability {f'{cc[0]}.{cc[1]}' if cc else '?'}; {build}",
        )
    yield from check_build(info, snapshot)
    for verdict in verdicts(snapshot, offload_supported=supported, gpu_layers=layers):
        if verdict.level == "info":
            continue
        yield Check(f"gpu {verdict.code}", "fail" if verdict.level == "error" else "warn", verdict.message)


def _mode_problem(path: Path, *, secret: bool) -> str | None:
    try:
        st = path.stat()
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    kind = kind_of(st.st_mode)
    if kind is not None:  # the daemon refuses it (a FIFO would have hung it): say so here too
        return f"{path} is {kind}, not a regular file"
    if secret and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        # The daemon itself refuses a keys file with any group or other bit.
        return f"{path} is mode {stat.S_IMODE(st.st_mode):04o}: readable or writable by others"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is world-writable"
    return None


def check_permissions(settings: Settings | None, config: Path | None) -> Iterator[Check]:
    """Keys file private, lockfile and trusted keys not writable by others, no signing key on the box."""
    if settings is None:
        return
    items: list[tuple[Path, bool]] = []
    if config is not None:
        items.append((config, False))
    if settings.auth.keys_file is not None:
        items.append((settings.auth.keys_file, True))
    if settings.lock.file is not None:
        items.append((settings.lock.file, False))
    items.extend((key, False) for key in settings.lock.trusted_keys)
    problems = [p for path, secret in items if (p := _mode_problem(path, secret=secret))]
    for key in settings.lock.trusted_keys:
        try:
            if b"PRIVATE KEY" in read_regular(key, MAX_KEY_BYTES)[:200]:
                problems.append(f"{key} is a private key: only public keys belong on a serving box")
        except OSError:
            continue  # _mode_problem named it
    if problems:
        yield Check(
            "permissions",
            "fail",
            "; ".join(problems),
            "chmod 0600 the keys file, chmod o-w the others, keep signing keys off the box",
        )
    else:
        yield _ok("permissions", f"{len(items)} files: keys private, none writable by others")


def check_config(config: Path | None) -> tuple[Check, Settings | None]:
    """The daemon's own validation of the config file."""
    if config is None:
        return Check(
            "config",
            "warn",
            "no config file given or found at /etc/edgellm/edgellm.yaml",
            "pass --config FILE",
        ), None
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        first = exc.problems[0] if exc.problems else "invalid"
        more = f" (and {len(exc.problems) - 1} more)" if len(exc.problems) > 1 else ""
        return Check(
            "config", "fail", f"{first}{more}", f"run edgellmd --check-config {config} and fix every line"
        ), None
    problems = []
    if not settings.lock.allow_unsigned and settings.lock.file is not None and settings.lock.models_dir:
        try:
            lock = load_lock(settings.lock.file)
            for entry in lock.models.values():
                path = resolve_model_file(settings.lock.models_dir, entry.file)
                try:
                    kind = kind_of(path.stat().st_mode)
                except FileNotFoundError:
                    problems.append(f"{entry.file} is missing")
                except OSError as exc:
                    problems.append(f"{entry.file}: {exc.strerror}")
                else:
                    if kind is not None:
                        problems.append(f"{entry.file} is {kind}, not a regular file")
        except LockError as exc:
            problems.append(f"lockfile: {exc}")
    if settings.lock.allow_unsigned:
        return Check(
            "config",
            "warn",
            f"{config}: valid, but lock.allow_unsigned is set",
            "sign a lockfile (edgellmctl lock sign) and configure lock.*",
        ), settings
    if problems:
        return Check(
            "config",
            "fail",
            f"{config}: " + "; ".join(problems),
            "copy the files the lock names into lock.models_dir",
        ), settings
    return _ok("config", f"{config}: valid"), settings


def check_unit(unit: Path | None, host: Host) -> Check:
    """The installed unit's hardening, as systemd-analyze security rates it."""
    if unit is None:
        return Check(
            "systemd unit",
            "warn",
            "edgellm.service is not installed",
            "install systemd/edgellm.service (the Ansible role does)",
        )
    if host.systemd_analyze is None:
        return Check("systemd unit", "warn", "systemd-analyze is not available to rate the unit")
    result = subprocess.run(  # noqa: S603
        [host.systemd_analyze, "security", "--offline=true", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = _EXPOSURE.search(result.stdout + result.stderr)
    if match is None:
        return Check("systemd unit", "warn", f"systemd-analyze security could not rate {unit}")
    exposure = float(match.group(1))
    if exposure > MAX_EXPOSURE:
        return Check(
            "systemd unit",
            "fail",
            f"{unit}: exposure {exposure} (more than {MAX_EXPOSURE})",
            "restore the hardening of the shipped systemd/edgellm.service",
        )
    return _ok("systemd unit", f"{unit}: exposure {exposure} (OK)")


_TRUE: Final = ("yes", "true", "on", "1")
_FALSE: Final = ("", "no", "false", "off", "0")


def _service_settings(text: str) -> dict[str, str]:
    """A unit file's [Service] section: each key's last assignment (continuations not joined)."""
    out: dict[str, str] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def check_unit_faults(unit: Path | None) -> Check | None:
    """Whether, under the unit, one engine's fault stays its model's: an OOM kill of an engine
    does not stop the unit, and the daemon may give engines memory cgroups of their own."""
    if unit is None:
        return None
    try:
        service = _service_settings(unit.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        return Check("unit faults", "warn", f"cannot read {unit}: {exc.strerror or exc}")
    delegate = service.get("Delegate", "no").lower()
    delegated = delegate not in _FALSE
    problems, fixes = [], []
    # systemd's default is DefaultOOMPolicy= (stop), but continue for a unit with Delegate=.
    policy = service.get("OOMPolicy", "continue" if delegated else "stop").lower()
    if policy != "continue":
        problems.append(f"OOMPolicy={policy}: an engine the kernel's OOM killer ends stops the whole unit")
        fixes.append("OOMPolicy=continue")
    memory = delegate in _TRUE or "memory" in delegate.split()
    protected = service.get("ProtectControlGroups", "no").lower() in (*_TRUE, "strict")
    if not memory or protected:
        problems.append("engine processes get no memory cgroups of their own (models[].memory_group)")
        fixes.append("Delegate=memory and ProtectControlGroups=no")
    if problems:
        return Check(
            "unit faults",
            "warn",
            f"{unit}: " + "; ".join(problems),
            "set " + ", ".join(fixes) + " as the shipped systemd/edgellm.service does (drop-ins not read)",
        )
    return _ok("unit faults", f"{unit}: an engine's OOM kill or runaway costs its model only")


def run_checks(
    config: Path | None, unit: Path | None, host: Host, build_info: Callable[[], BuildInfo]
) -> list[Check]:
    """Every check, in the order an operator reads them."""
    checks = [check_cpu_flags(host)]
    config_check, settings = check_config(config)
    try:
        checks.append(check_affinity(settings))
    except CpuListError as exc:
        checks.append(Check("cpu affinity", "fail", str(exc)))
    checks.extend(check_memory(settings))
    checks.append(check_shm(settings, host))
    info = build_info()  # loads llama.cpp: asked once
    checks.append(check_cpu_build(info, host))
    checks.extend(check_gpu(settings, host, lambda: info))
    checks.extend(check_permissions(settings, config))
    checks.append(config_check)
    checks.append(check_unit(unit, host))
    faults = check_unit_faults(unit)
    if faults is not None:
        checks.append(faults)
    return checks


def format_checks(checks: list[Check]) -> str:
    """One line per check, the fix indented below a failing one."""
    lines = []
    for c in checks:
        lines.append(f"{c.level.upper():4}  {c.name}: {c.detail}")
        if c.fix and c.level != "ok":
            lines.append(f"      fix: {c.fix}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print every check; exit 1 when any failed."""
    from edgellmd.engine.native import build_info  # noqa: PLC0415 - loads llama.cpp

    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    unit = args.unit or next((p for p in UNIT_PATHS if p.exists()), None)
    checks = run_checks(config, unit, Host(), build_info)
    print(json.dumps([asdict(c) for c in checks], indent=2) if args.json else format_checks(checks))
    return 1 if any(c.level == "fail" for c in checks) else 0


def add_parser(sub: Subcommands) -> None:
    """Register `doctor`."""
    p = sub.add_parser(
        "doctor",
        help="check this host: CPU, memory, shm, GPU, permissions, config, unit",
        description="Check a host before and after provisioning: CPU flags, affinity, memory "
        "against the models, /dev/shm size, GPU compute capability against this llama.cpp "
        "build, permissions of keys and lock, config validity and the unit's hardening. "
        "One line per check, with the fix when it fails; exit status 1 if any failed.",
    )
    p.add_argument("--config", type=Path, help=f"daemon config (default: {DEFAULT_CONFIG} if present)")
    p.add_argument("--unit", type=Path, help="systemd unit to rate (default: the installed edgellm.service)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run)
