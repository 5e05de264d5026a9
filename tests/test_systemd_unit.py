"""systemd/: the unit, sysusers.d and tmpfiles.d files, checked by systemd's own tools and a table.

systemd-analyze, systemd-sysusers and systemd-tmpfiles come with Debian's `systemd` package
(CI: Debian 12, systemd 252), strace with `strace`. Nothing here needs systemd to be running,
nor root: verify and security read the unit offline, sysusers and tmpfiles write into a
temporary root, and the daemon runs under strace against the unit's filters.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from edgellmd.__main__ import FINAL_WRITE_S, build_parser
from edgellmd.settings import DEFAULT_PRELOAD_DIR, DEFAULT_SHUTDOWN_TIMEOUT_S
from tests.serving import free_port

SYSTEMD_DIR: Final = Path(__file__).resolve().parent.parent / "systemd"
UNIT: Final = SYSTEMD_DIR / "edgellm.service"
SYSUSERS: Final = SYSTEMD_DIR / "edgellm.sysusers"
TMPFILES: Final = SYSTEMD_DIR / "edgellm.tmpfiles"
README: Final = SYSTEMD_DIR / "README.md"

SHIPPED_DAEMON: Final = "/opt/edgellm/venv/bin/edgellmd"
SHIPPED_CONFIG: Final = "/etc/edgellm/edgellm.yaml"
STATE_DIR: Final = "/var/lib/edgellm"
MODELS_DIR: Final = "/var/lib/edgellm/models"
# `systemd-analyze security --offline=` and `--threshold=` arrived in systemd 250.
MIN_SYSTEMD: Final = 250
MAX_EXPOSURE: Final = 2.0  # "OK" ends at 2.0 on systemd-analyze's scale
SYS_UID_MAX: Final = 999  # Debian's system range (login.defs SYS_UID_MAX)

# What `systemd-analyze verify` may print about the copy whose commands point at this venv:
# nothing. systemd 252 does not check that User=/Group= exist (a missing user shows only
# when the unit starts), and references to units this host lacks (nvidia-persistenced, the
# modprobe@ instances) are ordering only, which verify does not report. A new line here
# needs a reason beside it.
ACCEPTED_VERIFY_LINES: Final[tuple[str, ...]] = ()
# ... and about the shipped file, where /opt/edgellm does not exist (every CI machine): only
# that the daemon is not installed there, once per command that runs it.
NOT_INSTALLED: Final = (
    f"edgellm.service: Command {SHIPPED_DAEMON} is not executable: No such file or directory"
)


def tool(name: str, package: str = "systemd") -> str:
    """The path of a command these tests need; fails (not skips) without it: CI must have it."""
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/bin") / name, Path("/bin") / name) if p.exists()), None
    )
    if found is None:
        pytest.fail(f"{name} not found: install Debian's {package} package (apt-get install {package})")
    return found


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command; its output is the test's evidence, so keep both streams."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def output_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Every non-empty line a command printed, stdout and stderr together."""
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def systemd_version() -> int:
    """The major version of the systemd tools on this machine ("systemd 252 (252.38-1~deb12u1)")."""
    first = run(tool("systemd-analyze"), "--version").stdout.splitlines()[0]
    match = re.match(r"systemd (\d+)", first)
    assert match, f"unexpected systemd-analyze --version output: {first!r}"
    return int(match.group(1))


def installed_daemon() -> str:
    """The edgellmd of the environment running the tests (the venv's console script)."""
    beside = Path(sys.executable).parent / "edgellmd"
    found = str(beside) if beside.exists() else shutil.which("edgellmd")
    if found is None:
        pytest.fail("no edgellmd command beside the test interpreter nor on PATH: pip install -e .")
    return found


# --- A unit file reader --------------------------------------------------------------------


Unit = dict[str, dict[str, list[str]]]


def logical_lines(text: str) -> Iterator[str]:
    """Lines as systemd reads them: comments dropped, backslash continuations joined."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):  # systemd replaces the backslash with a space
            pending += line[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def parse_unit(text: str) -> Unit:
    """{section: {key: [every assignment, in order]}}; systemd allows a key more than once."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for line in logical_lines(text):
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if section is None or not sep:
            raise ValueError(f"not a unit file line: {line!r}")
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def test_parse_unit_keeps_repeats_and_joins_continuations() -> None:
    unit = parse_unit("# c\n[A]\nK=1\n; c\nK=2\nL=a\\\n  b\n[B]\nE=\n")
    assert unit == {"A": {"K": ["1", "2"], "L": ["a b"]}, "B": {"E": [""]}}
    with pytest.raises(ValueError, match="not a unit file line"):
        parse_unit("K=1\n")


def timespan_s(value: str) -> float:
    """A systemd time span in seconds: "45s", "2min", "1min 30s", or bare seconds."""
    units = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts, value
    assert "".join(n + u for n, u in parts) == value.replace(" ", ""), value
    return sum(float(number) * units[unit or "s"] for number, unit in parts)


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text(encoding="utf-8"))


def last(unit: Unit, section: str, key: str) -> str | None:
    """The value in effect for a single-valued key (the last assignment wins)."""
    values = unit.get(section, {}).get(key)
    return values[-1] if values else None


# --- The requirements, one row each ----------------------------------------------------------

REQUIRED: Final = [
    # Lifecycle: sd_notify from the main process, watchdog, restarts and their limit, timeouts.
    ("Service", "Type", "notify"),
    ("Service", "NotifyAccess", "main"),
    ("Service", "WatchdogSec", "30s"),
    ("Service", "Restart", "on-failure"),
    ("Service", "RestartSec", "5s"),
    ("Unit", "StartLimitIntervalSec", "600"),
    ("Unit", "StartLimitBurst", "5"),
    ("Service", "TimeoutStartSec", "120s"),
    ("Service", "TimeoutStopSec", "45s"),
    ("Service", "KillSignal", "SIGTERM"),
    ("Service", "KillMode", "mixed"),
    ("Service", "ExecReload", "/bin/kill -HUP $MAINPID"),
    # Identity and directories.
    ("Service", "User", "edgellm"),
    ("Service", "Group", "edgellm"),
    ("Service", "StateDirectory", "edgellm"),
    ("Service", "StateDirectoryMode", "0750"),
    ("Service", "ConfigurationDirectory", "edgellm"),
    ("Service", "ConfigurationDirectoryMode", "0750"),
    ("Service", "ReadOnlyPaths", f"-{MODELS_DIR}"),
    ("Service", "UMask", "0077"),
    # Limits.
    ("Service", "LimitNOFILE", "65536"),
    ("Service", "LimitCORE", "0"),
    # Sandbox.
    ("Service", "NoNewPrivileges", "yes"),
    ("Service", "CapabilityBoundingSet", ""),
    ("Service", "AmbientCapabilities", ""),
    ("Service", "ProtectSystem", "strict"),
    ("Service", "ProtectHome", "yes"),
    ("Service", "PrivateTmp", "yes"),
    ("Service", "PrivateMounts", "yes"),
    ("Service", "PrivateUsers", "yes"),
    ("Service", "DevicePolicy", "closed"),
    ("Service", "ProtectKernelTunables", "yes"),
    ("Service", "ProtectKernelModules", "yes"),
    ("Service", "ProtectKernelLogs", "yes"),
    # The unit's cgroup is the daemon's, memory only: each engine process's memory cgroup below it.
    ("Service", "Delegate", "memory"),
    ("Service", "ProtectControlGroups", "no"),
    # An engine the OOM killer ends costs its model's requests, not the unit (default: stop).
    ("Service", "OOMPolicy", "continue"),
    ("Service", "ProtectClock", "yes"),
    ("Service", "ProtectHostname", "yes"),
    ("Service", "ProtectProc", "invisible"),
    ("Service", "ProcSubset", "all"),  # psutil's /proc/meminfo, /proc/stat; NVML's /proc/driver
    ("Service", "LockPersonality", "yes"),
    ("Service", "RestrictNamespaces", "yes"),
    ("Service", "RestrictRealtime", "yes"),
    ("Service", "RestrictSUIDSGID", "yes"),
    ("Service", "KeyringMode", "private"),
    ("Service", "RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
    ("Service", "SystemCallArchitectures", "native"),
    ("Service", "SystemCallErrorNumber", "EPERM"),
    ("Service", "RemoveIPC", "no"),  # keeps /dev/shm/edgellm (see the unit)
    ("Install", "WantedBy", "multi-user.target"),
]


@pytest.mark.parametrize(("section", "key", "value"), REQUIRED, ids=[f"{k}={v}" for _, k, v in REQUIRED])
def test_unit_sets(unit: Unit, section: str, key: str, value: str) -> None:
    assert last(unit, section, key) == value


# Settings that break the appliance, or that this unit decided against (reasons in the unit).
FORBIDDEN: Final = [
    ("PrivateDevices", "hides /dev/nvidia*"),
    ("DynamicUser", "implies RemoveIPC=yes, and a UID the files cannot be owned by"),
    ("MemoryDenyWriteExecute", "CUDA has not been run under it"),
    ("IPAddressDeny", "LAN clients must reach the API"),
    ("IPAddressAllow", "LAN clients must reach the API"),
    ("ReadWritePaths", "nothing outside StateDirectory= is written but /dev/shm, which stays writable"),
    ("SupplementaryGroups", "none needed"),
    (
        "LimitMEMLOCK",
        "nothing locks memory (llama.cpp's use_mlock is off): the default 8 MiB bounds a compromised daemon",
    ),
    ("RuntimeDirectory", "nothing writes /run/edgellm"),
]


@pytest.mark.parametrize(("key", "reason"), FORBIDDEN, ids=[k for k, _ in FORBIDDEN])
def test_unit_leaves_out(unit: Unit, key: str, reason: str) -> None:
    assert last(unit, "Service", key) in (None, "no"), reason


def test_commands_run_the_daemon_with_one_config_path(unit: Unit) -> None:
    assert unit["Service"]["Environment"] == [f"EDGELLM_CONFIG={SHIPPED_CONFIG}"]
    assert unit["Service"]["ExecStartPre"] == [f"{SHIPPED_DAEMON} --check-config ${{EDGELLM_CONFIG}}"]
    assert unit["Service"]["ExecStart"] == [f"{SHIPPED_DAEMON} --config ${{EDGELLM_CONFIG}}"]
    # The daemon's own parser accepts both command lines.
    for command in (unit["Service"]["ExecStartPre"][0], unit["Service"]["ExecStart"][0]):
        argv = shlex.split(command.replace("${EDGELLM_CONFIG}", SHIPPED_CONFIG))[1:]
        build_parser().parse_args(argv)


def test_device_allow_lists_the_nvidia_groups_only(unit: Unit) -> None:
    assert sorted(unit["Service"]["DeviceAllow"]) == sorted(
        [
            "char-nvidia-frontend rw",  # major 195 before driver 550
            "char-nvidia rw",  # major 195 from 550 on ...
            "char-nvidiactl rw",  # ... and its control device
            "char-nvidia-uvm rw",  # /dev/nvidia-uvm, /dev/nvidia-uvm-tools
            "char-nvidia-caps r",  # MIG capabilities
        ]
    )
    assert unit["Unit"]["Wants"] == [
        "network-online.target",
        "modprobe@nvidia.service modprobe@nvidia_uvm.service",
    ]


def test_syscall_filter_keeps_pinning_memfd_and_mlock(unit: Unit) -> None:
    filters = unit["Service"]["SystemCallFilter"]
    assert filters == [
        "@system-service",
        "~@privileged",
        "seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self",  # engine processes
    ]
    assert not any(f.startswith("~") and "@resources" in f for f in filters), "blocks sched_setaffinity"
    # Expand the groups the way systemd does: an allow list, then a deny list taken from it.
    allowed = syscalls("@system-service") - syscalls("@privileged")
    needed = {"sched_setaffinity", "sched_getaffinity", "memfd_create", "mlock", "mbind", "mmap", "ioctl"}
    assert needed <= allowed, f"the filter blocks {sorted(needed - allowed)}"


def syscalls(group: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The system calls in a `systemd-analyze syscall-filter` group, nested groups expanded."""
    result = run(tool("systemd-analyze"), "syscall-filter", group)
    assert result.returncode == 0, result.stderr
    names: set[str] = set()
    for line in result.stdout.splitlines()[1:]:
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        if entry.startswith("@"):
            if entry not in seen:
                names |= syscalls(entry, seen | {group})
        else:
            names.add(entry)
    return names


def test_stop_timeout_outlasts_the_drain(unit: Unit) -> None:
    stop = timespan_s(last(unit, "Service", "TimeoutStopSec") or "")
    # SIGTERM -> shutdown_timeout_s for running requests -> FINAL_WRITE_S for cut streams'
    # last event -> models and /dev/shm copies freed (seconds for big models).
    assert stop >= DEFAULT_SHUTDOWN_TIMEOUT_S + FINAL_WRITE_S + 10


def test_paths_agree_across_the_files(unit: Unit) -> None:
    tmpfiles = {fields[1]: fields for fields in tmpfiles_lines()}
    assert str(DEFAULT_PRELOAD_DIR) in tmpfiles  # the daemon's default preload area
    assert tmpfiles[str(DEFAULT_PRELOAD_DIR)][2:5] == ["0700", "edgellm", "edgellm"]
    assert tmpfiles[STATE_DIR][2:5] == [last(unit, "Service", "StateDirectoryMode"), "edgellm", "edgellm"]
    assert tmpfiles[MODELS_DIR][2:5] == ["0750", "root", "edgellm"]
    assert f"/var/lib/{last(unit, 'Service', 'StateDirectory')}" == STATE_DIR


def tmpfiles_lines() -> list[list[str]]:
    return [line.split() for line in logical_lines(TMPFILES.read_text(encoding="utf-8"))]


# --- systemd's own tools ----------------------------------------------------------------------


def unit_copy(directory: Path, daemon: str | None) -> Path:
    """The unit under its own name in `directory`, with its commands pointing at `daemon`."""
    text = UNIT.read_text(encoding="utf-8")
    if daemon is not None:
        text = text.replace(SHIPPED_DAEMON, daemon)
    copy = directory / UNIT.name
    copy.write_text(text, encoding="utf-8")
    copy.chmod(0o644)  # verify warns about executable or world-writable unit files
    return copy


def verify(path: Path) -> subprocess.CompletedProcess[str]:
    # --recursive-errors=no: judge this unit, not the host's network-online.target & co.
    return run(tool("systemd-analyze"), "verify", "--man=no", "--recursive-errors=no", str(path))


def test_verify_accepts_the_unit(tmp_path: Path) -> None:
    # verify checks that every command exists, and /opt/edgellm does not exist here: point
    # the commands at this environment's edgellmd. Everything else is the shipped text.
    result = verify(unit_copy(tmp_path, installed_daemon()))
    unexpected = [line for line in output_lines(result) if line not in ACCEPTED_VERIFY_LINES]
    assert result.returncode == 0, output_lines(result)
    assert unexpected == []


def test_verify_of_the_shipped_file_misses_only_the_daemon(tmp_path: Path) -> None:
    result = verify(unit_copy(tmp_path, None))
    if Path(SHIPPED_DAEMON).exists():  # an installed box
        assert (result.returncode, output_lines(result)) == (0, [])
    else:
        assert result.returncode != 0
        assert set(output_lines(result)) == {NOT_INSTALLED}


def test_verify_is_not_blind(tmp_path: Path) -> None:
    # The same check on a copy with a misspelt key must complain, or the test above proves nothing.
    copy = unit_copy(tmp_path, installed_daemon())
    text = copy.read_text(encoding="utf-8")
    copy.write_text(text.replace("KillMode=mixed", "KillMode=mixed\nKilMode=mixed"), encoding="utf-8")
    result = verify(copy)
    assert result.returncode != 0
    assert any("Unknown key 'KilMode'" in line for line in output_lines(result))


def security(*options: str) -> subprocess.CompletedProcess[str]:
    version = systemd_version()
    if version < MIN_SYSTEMD:
        pytest.fail(
            f"systemd-analyze {version} cannot rate a unit offline (--offline= needs systemd "
            f"{MIN_SYSTEMD}+; CI runs Debian 12's 252)"
        )
    return run(tool("systemd-analyze"), "security", "--offline=true", *options, str(UNIT))


def exposure(result: subprocess.CompletedProcess[str]) -> tuple[float, str]:
    match = re.search(r"Overall exposure level for edgellm\.service: (\d+(?:\.\d+)?) (\S+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1)), match.group(2)


def test_security_rates_the_unit_ok() -> None:
    result = security()
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    level, rating = exposure(result)
    assert level <= MAX_EXPOSURE
    assert rating == "OK"


def test_security_threshold_holds() -> None:
    # --threshold is on the exposure x 10 scale: 20 means 2.0, the end of "OK".
    result = security(f"--threshold={int(MAX_EXPOSURE * 10)}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def test_readme_states_the_measured_score() -> None:
    stated = re.search(r"rates the unit \*\*(\d+\.\d) (\w+)\*\*", README.read_text(encoding="utf-8"))
    assert stated, "systemd/README.md should say: rates the unit **N.N OK**"
    assert (float(stated.group(1)), stated.group(2)) == exposure(security())


def test_sysusers_makes_a_system_user_without_login(tmp_path: Path) -> None:
    root = sysusers_root(tmp_path)
    user = passwd_entry(root, "edgellm")
    name, _, uid, gid, _, home, shell = user
    assert (name, home, shell) == ("edgellm", STATE_DIR, "/usr/sbin/nologin")
    assert int(uid) <= SYS_UID_MAX
    groups = [line.split(":") for line in (root / "etc/group").read_text(encoding="utf-8").splitlines()]
    assert ["edgellm", "x", gid, ""] in groups


def sysusers_root(tmp_path: Path) -> Path:
    """A temporary root with the edgellm user and group in its /etc/passwd and /etc/group."""
    root = (tmp_path / "root").resolve()  # the tools print resolved paths
    (root / "etc").mkdir(parents=True)
    # An absolute path: a bare name would be looked up in the root's sysusers.d directories.
    result = run(tool("systemd-sysusers"), f"--root={root}", str(SYSUSERS))
    assert result.returncode == 0, result.stderr
    return root


def passwd_entry(root: Path, name: str) -> list[str]:
    for line in (root / "etc/passwd").read_text(encoding="utf-8").splitlines():
        if line.split(":")[0] == name:
            return line.split(":")
    raise AssertionError(f"{name} is not in {root}/etc/passwd")


def test_tmpfiles_makes_the_private_directories(tmp_path: Path) -> None:
    # sysusers first: tmpfiles resolves edgellm through the root's own /etc/passwd.
    root = sysusers_root(tmp_path)
    uid, gid = (int(n) for n in passwd_entry(root, "edgellm")[2:4])
    result = run(tool("systemd-tmpfiles"), f"--root={root}", "--create", str(TMPFILES))
    expected = {  # path: (mode, owner uid, group gid)
        str(DEFAULT_PRELOAD_DIR): (0o700, uid, gid),
        STATE_DIR: (0o750, uid, gid),
        MODELS_DIR: (0o750, 0, gid),
    }
    if os.geteuid() == 0:
        assert (result.returncode, output_lines(result)) == (0, [])
    else:
        # Only root may chown: tmpfiles makes each directory with its mode, fails to hand it
        # over (exit 73, EX_CANTCREAT) and says so once per directory, and nothing else.
        assert result.returncode == 73, result.stderr
        refused = re.compile(r"fchownat\(\) of (\S+) failed: Operation not permitted")
        assert sorted(
            m.group(1) for line in output_lines(result) if (m := refused.fullmatch(line))
        ) == sorted(f"{root}{path}" for path in expected)
        assert len(output_lines(result)) == len(expected)
    for path, (mode, owner, group) in expected.items():
        st = (root / path.lstrip("/")).stat()
        assert st.st_mode & 0o7777 == mode, path
        if os.geteuid() == 0:
            assert (st.st_uid, st.st_gid) == (owner, group), path


def test_exec_start_pre_fails_fast_on_a_bad_config(tmp_path: Path, tiny_model: Path, unit: Unit) -> None:
    # The unit's own check command, as systemd runs it (the venv's daemon, EDGELLM_CONFIG
    # expanded): a valid file passes, a broken one stops the start with the reason.
    command = unit["Service"]["ExecStartPre"][0].replace(SHIPPED_DAEMON, installed_daemon())
    good = tmp_path / "good.yaml"
    good.write_text(f"models:\n  - name: tiny\n    file: {tiny_model}\nlock:\n  allow_unsigned: true\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  port: http\nmodels:\n  - name: x\n")
    passed = run(*shlex.split(command.replace("${EDGELLM_CONFIG}", str(good))))
    assert passed.returncode == 0, passed.stderr
    assert "configuration is valid" in passed.stdout
    failed = run(*shlex.split(command.replace("${EDGELLM_CONFIG}", str(bad))))
    assert failed.returncode == 1
    assert "server.port:" in failed.stderr
    assert "Traceback" not in failed.stderr


# --- The daemon inside the unit's system call filter -------------------------------------------

# Allowed whatever the filter says (systemd.exec(5), SystemCallFilter=).
ALWAYS_ALLOWED: Final = frozenset({"execve", "exit", "exit_group", "getrlimit", "rt_sigreturn", "sigreturn"})
SYSCALL: Final = re.compile(r"^\d+\s+([a-z0-9_]+)\(", re.MULTILINE)
SOCKET_FAMILY: Final = re.compile(r"\bsocket\((AF_[A-Z0-9]+)")


def unit_filter(unit: Unit) -> tuple[set[str], set[str]]:
    """(system calls, socket families) the unit's filters allow, as systemd expands them."""
    allowed: set[str] = set()
    for entry in unit["Service"]["SystemCallFilter"]:
        deny = entry.startswith("~")
        names: set[str] = set()
        for item in entry.removeprefix("~").split():
            names |= syscalls(item) if item.startswith("@") else {item}
        allowed = allowed - names if deny else allowed | names
    families = set((last(unit, "Service", "RestrictAddressFamilies") or "").split())
    return allowed | ALWAYS_ALLOWED, families


def http(url: str, body: dict[str, object] | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - http on loopback
        url,
        data=data,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - loopback
        return bytes(response.read())


def wait_for_message(sock: socket.socket, field: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if field in sock.recv(4096).decode().split("\n"):
                return
        except TimeoutError:
            continue
    raise AssertionError(f"no {field} from the daemon within {timeout} s")


@pytest.mark.slow
def test_daemon_stays_inside_the_unit_filters(tmp_path: Path, tiny_model: Path, unit: Unit) -> None:
    # The closest this suite gets to running the daemon under the unit without systemd as
    # PID 1: strace the real daemon through what a unit's life asks of it (start with
    # pinning, preload into a tmpfs-like area, file watching and sd_notify; answers, a
    # stream, host stats; SIGHUP reload; SIGTERM drain) and check that every system call and
    # socket family it used is one the unit's filters allow. CPU only: CUDA is not exercised.
    allowed, families = unit_filter(unit)
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(0.2)
    port = free_port()
    config = {
        "server": {"port": port},
        "host": {"cpus": str(min(os.sched_getaffinity(0)))},
        "models": [
            {"name": "m", "file": str(tiny_model), "threads": 1, "slots": 2, "context_size": 256},
            # An engine process too: strace -f follows it, confinement and all.
            {
                "name": "p",
                "file": str(tiny_model),
                "threads": 1,
                "slots": 1,
                "context_size": 256,
                "isolation": "process",
            },
        ],
        "lock": {"allow_unsigned": True},
        "lifecycle": {"preload_dir": str(tmp_path / "shm"), "watch": True},
        "logging": {"format": "json", "level": "info"},
    }
    (tmp_path / "edgellm.yaml").write_text(json.dumps(config), encoding="utf-8")
    trace = tmp_path / "trace"
    command = [
        tool("strace", package="strace"),
        "-f",
        "-qq",
        "-e",
        "signal=none",
        "-o",
        str(trace),
        sys.executable,
        "-m",
        "edgellmd",
        "--config",
        str(tmp_path / "edgellm.yaml"),
    ]
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "2000000"}
    with (tmp_path / "daemon.log").open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_message(notify, "READY=1")
        daemon_pid = int(trace.read_text(encoding="utf-8").split(maxsplit=1)[0])  # the first traced
        url = f"http://127.0.0.1:{port}"
        chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert json.loads(http(f"{url}/v1/chat/completions", chat))["choices"]
        assert b"data: [DONE]" in http(f"{url}/v1/chat/completions", {**chat, "stream": True})
        assert json.loads(http(f"{url}/v1/chat/completions", {**chat, "model": "p"}))["choices"]
        assert "host" in json.loads(http(f"{url}/admin/stats"))
        os.kill(daemon_pid, signal.SIGHUP)
        wait_for_message(notify, "READY=1")
        os.kill(daemon_pid, signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "daemon.log").read_text(encoding="utf-8")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()
    text = trace.read_text(encoding="utf-8")
    used = set(SYSCALL.findall(text))
    # The engine process drops the capabilities it holds with capset(): this test runs as
    # root, with some; under the unit (an empty bounding set, a user of its own) it holds none
    # and never calls it (engine/confine.py).
    used.discard("capset")
    assert {"sched_setaffinity", "inotify_add_watch", "flock", "accept4"} <= used  # it did the work
    assert sorted(used - allowed) == [], "the unit's SystemCallFilter= would refuse these"
    assert set(SOCKET_FAMILY.findall(text)) <= families, "RestrictAddressFamilies= would refuse these"
