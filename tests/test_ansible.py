"""The Ansible roles: lint, a real converge into a sandbox that then serves, HAProxy failover."""

from __future__ import annotations

import difflib
import grp
import http.server
import importlib.metadata
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import openai
import pytest
import yaml

from edgellmctl.keys import create_key
from tests.ggufmodels import TinyModelSpec, write_tiny_model
from tests.serving import SignedLock, free_port, running, settings_for, wait_for

REPO: Final = Path(__file__).resolve().parent.parent
ANSIBLE: Final = REPO / "ansible"
ROLE: Final = ANSIBLE / "roles" / "edgellm"
EXAMPLE_INVENTORY: Final = ANSIBLE / "inventory" / "example" / "hosts.yml"
VENV_BIN: Final = Path(sys.executable).parent
# The interpreter this venv was made from (the role's venv must take the same wheels).
BASE_PYTHON: Final = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
# Where each tool comes from; CI installs all of them, so a missing one fails the test.
ANSIBLE_PACKAGE: Final = "ansible-core (pip; edgellm[test] pins it)"
LINT_PACKAGE: Final = "ansible-lint (pip; edgellm[test] pins it)"
HAPROXY_PACKAGE: Final = "haproxy (Debian package: apt-get install haproxy)"
RECAP: Final = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
MODEL: Final = "tiny"
UNPINNED: Final = frozenset({"edgellm", "pip", "setuptools", "wheel"})
# Health checks every 2 s, down after 2 failures (the role's defaults): a stopped box is out
# of the pool within about 4 s.
FAILOVER_WINDOW_S: Final = 6.0


def tool(name: str, package: str) -> str:
    """Path of a command (the venv's first); fails, naming the package, when it is missing."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail(f"{name} not found: install {package}")
    return found


def ansible_env(tmp: Path) -> dict[str, str]:
    """A clean environment for ansible-playbook: this repo's ansible.cfg, temp dirs in `tmp`.

    Every PIP_* setting and pip config file is left out, so the role's offline install
    (--no-index --find-links wheelhouse) cannot quietly fall back to an index or a site
    find-links: the wheelhouse alone must hold everything.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "ANSIBLE_"))}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(ANSIBLE / "roles"),
        ANSIBLE_HOME=str(tmp / ".ansible"),
        ANSIBLE_LOCAL_TEMP=str(tmp / ".ansible" / "tmp"),
        ANSIBLE_REMOTE_TEMP=str(tmp / ".ansible" / "remote"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def playbook(tmp: Path, play: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a playbook (text) with ansible-playbook; fails the test with its output unless it succeeds."""
    path = tmp / f"play-{time.monotonic_ns()}.yml"
    path.write_text(play)
    result = subprocess.run(
        [tool("ansible-playbook", ANSIBLE_PACKAGE), str(path), *args],
        capture_output=True,
        text=True,
        env=ansible_env(tmp),
        cwd=tmp,
        timeout=900,
        check=False,
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"ansible-playbook failed ({result.returncode}):\n{result.stdout[-8000:]}\n"
            f"{result.stderr[-4000:]}"
        )
    return result


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counts by host: {"localhost": {"ok": 30, "changed": 0, ...}}."""
    text = output[output.rindex("PLAY RECAP") :]
    return {
        m.group(1): {
            "ok": int(m.group(2)),
            "changed": int(m.group(3)),
            "unreachable": int(m.group(4)),
            "failed": int(m.group(5)),
        }
        for m in RECAP.finditer(text)
    }


def current_user() -> dict[str, str]:
    """Owner variables for a sandbox: everything owned by whoever runs the tests."""
    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    return {
        "edgellm_user": user,
        "edgellm_group": group,
        "edgellm_admin_user": user,
        "edgellm_admin_group": group,
    }


def directives(text: str) -> list[list[str]]:
    """The lines that mean something (no comments, no blank lines), split into fields."""
    return [
        line.split()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("#", ";"))
    ]


class DaemonProcess:
    """A real `edgellmd --config` process, stopped as systemd stops it (SIGTERM: drain, exit 0)."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        with log.open("w") as out:  # a file, not a pipe: thousands of access-log lines
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until /readyz answers 200; fails with the daemon's log if it exits or never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as resp:  # noqa: S310 - loopback
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        self.terminate()
        pytest.fail(f"edgellmd never became ready:\n{self.log.read_text()[-4000:]}")

    def terminate(self) -> int:
        """SIGTERM and wait; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


# --- 1. lint and syntax ------------------------------------------------------------------


@pytest.mark.slow
def test_ansible_lint_production_profile_passes(tmp_path: Path) -> None:
    lint = tool("ansible-lint", LINT_PACKAGE)
    tool("ansible-playbook", ANSIBLE_PACKAGE)
    result = subprocess.run(
        [lint, "--offline", "--profile", "production", "--nocolor", "."],
        capture_output=True,
        text=True,
        cwd=ANSIBLE,
        env=ansible_env(tmp_path),
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr


def test_site_playbook_passes_syntax_check(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            tool("ansible-playbook", ANSIBLE_PACKAGE),
            "--syntax-check",
            str(ANSIBLE / "site.yml"),
            "-i",
            str(EXAMPLE_INVENTORY),
        ],
        capture_output=True,
        text=True,
        env=ansible_env(tmp_path),
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("role", ["edgellm", "edgellm_lb"])
def test_role_readme_documents_every_default(role: str) -> None:
    """geerlingguy's shape: every variable in defaults/main.yml has a row in the README."""
    defaults = yaml.safe_load((ANSIBLE / "roles" / role / "defaults" / "main.yml").read_text())
    readme = (ANSIBLE / "roles" / role / "README.md").read_text()
    assert all(name.startswith(f"{role}_") for name in defaults)
    missing = [name for name in defaults if f"| `{name}` |" not in readme]
    assert not missing, f"roles/{role}/README.md does not document {missing}"


# --- the role's unit files are the project's ---------------------------------------------


def test_role_defaults_render_the_shipped_systemd_files(tmp_path: Path) -> None:
    """The role's templates, rendered with its defaults, say what systemd/ says (comments aside)."""
    shipped = ("edgellm.service", "edgellm.sysusers", "edgellm.tmpfiles")
    out = tmp_path / "rendered"
    out.mkdir()
    play = f"""\
- name: Render the unit files with the role's defaults
  hosts: localhost
  connection: local
  gather_facts: false
  vars_files:
    - {ROLE / "defaults" / "main.yml"}
    - {ROLE / "vars" / "main.yml"}
  tasks:
    - name: Render each file
      ansible.builtin.template:
        src: "{ROLE / "templates"}/{{{{ item }}}}.j2"
        dest: "{out}/{{{{ item }}}}"
        mode: "0644"
      loop: {json.dumps(shipped)}
"""
    playbook(tmp_path, play, "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}")
    for name in shipped:
        want = [" ".join(fields) for fields in directives((REPO / "systemd" / name).read_text())]
        got = [" ".join(fields) for fields in directives((out / name).read_text())]
        diff = "\n".join(
            difflib.unified_diff(want, got, f"systemd/{name}", f"templates/{name}.j2", lineterm="")
        )
        assert got == want, f"ansible/roles/edgellm/templates/{name}.j2 differs from systemd/{name}:\n{diff}"


# --- 2. converge the edgellm role into a sandbox, twice, then serve from it ---------------


@dataclass
class Sandbox:
    """Inputs on the "controller" (signed lock, model, keys) and the host tree under `root`."""

    base: Path
    port: int = field(default_factory=free_port)
    token: str = ""

    def __post_init__(self) -> None:
        self.signing = SignedLock(self.base / "controller")  # models, lock and key to ship

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def models_src(self) -> Path:
        return self.signing.models

    @property
    def lockfile(self) -> Path:
        return self.signing.lock

    def prepare(self, wheelhouse: Path) -> Path:
        """Write the model, the signed lock, an API key and the role's variables; return the vars file."""
        data = write_tiny_model(self.models_src / "tiny.gguf", TinyModelSpec(seed=11)).read_bytes()
        self.signing.sign_lock({MODEL: SignedLock.entry("tiny.gguf", data)}, version=3)
        # A real key, minted as an operator would; the role gets its keys.yaml entries.
        keys_file = self.base / "minted-keys.yaml"
        _, self.token = create_key(keys_file, "ansible-test", ["inference"], limits={"rpm": 600})
        entries = yaml.safe_load(keys_file.read_text())["keys"]
        pem = self.signing.pub.read_text()
        variables: dict[str, Any] = {
            "edgellm_root": str(self.root),
            "edgellm_manage_packages": False,
            "edgellm_manage_user": False,
            "edgellm_manage_system": False,
            "edgellm_manage_systemd": False,
            **current_user(),
            # The interpreter the test venv was made from: the wheelhouse's wheels fit it.
            "edgellm_python": str(BASE_PYTHON),
            "edgellm_wheelhouse": str(wheelhouse),
            "edgellm_lockfile": str(self.lockfile),
            "edgellm_models_src": str(self.models_src),
            "edgellm_trusted_keys": [pem],
            "edgellm_api_keys": entries,
            "edgellm_port": self.port,
            "edgellm_models": [{"name": MODEL, "context_size": 128, "slots": 2, "threads": 1}],
            "edgellm_log_format": "text",
            "ansible_python_interpreter": sys.executable,
        }
        path = self.base / "vars.yml"
        path.write_text(yaml.safe_dump(variables, sort_keys=False))
        return path


CONVERGE_PLAY: Final = """\
- name: Converge the edgellm role into a sandbox
  hosts: localhost
  connection: local
  gather_facts: false
  roles:
    - role: edgellm
"""


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """edgellm's wheel and every dependency, built with `pip wheel` from a copy of the sources.

    llama-cpp-python has only an sdist on PyPI: pip takes the wheel it built when the venv
    was installed (`./dev test`) from its wheel cache instead of compiling llama.cpp again.
    The copy keeps setuptools' build/ and egg-info out of the working tree.
    """
    base = tmp_path_factory.mktemp("wheelhouse")
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("daemon", "ops"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    # The versions this venv runs, so that the sandbox gets what the other tests tested (and
    # llama-cpp-python's cached build). Not the build tools: edgellm's isolated build brings its own.
    pins = sorted(
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"] and dist.metadata["Name"].lower() not in UNPINNED
    )
    constraints = base / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    out = base / "wheels"
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--disable-pip-version-check",
            "--constraint",
            str(constraints),
            "--wheel-dir",
            str(out),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"wheelhouse: {len(list(out.glob('*.whl')))} wheels in {time.monotonic() - started:.1f} s")
    return out


@pytest.fixture(scope="module")
def converged(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> tuple[Sandbox, Path]:
    """A sandbox the role has converged twice; yields it with its vars file."""
    sandbox = Sandbox(tmp_path_factory.mktemp("converge"))
    variables = sandbox.prepare(wheelhouse)
    args = ("-i", "localhost,", "-e", f"@{variables}")
    started = time.monotonic()
    first = playbook(sandbox.base, CONVERGE_PLAY, *args)
    assert recap(first.stdout)["localhost"]["changed"] > 0
    between = time.monotonic()
    second = playbook(sandbox.base, CONVERGE_PLAY, *args)
    print(f"converge: first run {between - started:.1f} s, second {time.monotonic() - between:.1f} s")
    counts = recap(second.stdout)["localhost"]
    changed = [line for line in second.stdout.splitlines() if line.startswith("changed:")]
    assert counts["changed"] == 0, f"second run changed things: {changed}\n{second.stdout[-6000:]}"
    assert counts["failed"] == 0
    return sandbox, variables


@pytest.mark.slow
def test_converge_installs_files_with_their_owners_and_modes(converged: tuple[Sandbox, Path]) -> None:
    sandbox, _ = converged
    root = sandbox.root
    modes = {
        "etc/edgellm": 0o750,
        "etc/edgellm/edgellm.yaml": 0o640,
        "etc/edgellm/keys.yaml": 0o600,  # the daemon refuses anything looser
        "etc/edgellm/models.lock": 0o640,
        "etc/edgellm/keys/trusted-0.pub": 0o640,
        "var/lib/edgellm": 0o750,
        "var/lib/edgellm/models": 0o750,
        "var/lib/edgellm/models/tiny.gguf": 0o640,
        "dev/shm/edgellm": 0o700,
        "etc/systemd/system/edgellm.service": 0o644,
        "etc/sysctl.d/60-edgellm.conf": 0o644,
    }
    for relative, mode in modes.items():
        info = (root / relative).stat()
        assert info.st_mode & 0o7777 == mode, f"{relative}: {info.st_mode & 0o7777:o}, want {mode:o}"
        assert info.st_uid == os.getuid(), relative
    assert (root / "opt/edgellm/venv/bin/edgellmd").is_file()
    assert "tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=50% 0 0" in (root / "etc/fstab").read_text()
    assert "vm.swappiness = 10" in (root / "etc/sysctl.d/60-edgellm.conf").read_text()
    unit = (root / "etc/systemd/system/edgellm.service").read_text()
    assert f"ExecStart={root}/opt/edgellm/venv/bin/edgellmd --config ${{EDGELLM_CONFIG}}" in unit
    config = yaml.safe_load((root / "etc/edgellm/edgellm.yaml").read_text())
    assert config["lock"]["trusted_keys"] == [f"{root}/etc/edgellm/keys/trusted-0.pub"]
    assert config["lifecycle"]["preload_dir"] == f"{root}/dev/shm/edgellm"


@pytest.mark.slow
def test_converged_sandbox_serves_with_the_real_key(converged: tuple[Sandbox, Path]) -> None:
    sandbox, _ = converged
    root = sandbox.root
    daemon = DaemonProcess(
        [str(root / "opt/edgellm/venv/bin/edgellmd"), "--config", str(root / "etc/edgellm/edgellm.yaml")],
        sandbox.port,
        sandbox.base / "daemon.log",
    )
    url = daemon.url
    try:
        daemon.wait_ready()
        client = openai.OpenAI(base_url=url + "/v1", api_key=sandbox.token, max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        assert reply.choices[0].finish_reason in {"length", "stop"}
        assert reply.system_fingerprint is not None
        assert reply.system_fingerprint.startswith("edgellm-v3-")  # the lock the role installed
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="elk_000000000000_" + "x" * 43, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(
                model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hello"}]
            )
    finally:
        status = daemon.terminate()
    assert status == 0, daemon.log.read_text()[-4000:]


@pytest.mark.slow
def test_a_model_that_does_not_match_the_lock_is_never_copied(converged: tuple[Sandbox, Path]) -> None:
    sandbox, variables = converged
    installed = sandbox.root / "var/lib/edgellm/models/tiny.gguf"
    before = installed.read_bytes()
    tampered = sandbox.base / "tampered"
    tampered.mkdir()
    data = bytearray(before)
    data[-1] ^= 0xFF  # same size, other bytes
    (tampered / "tiny.gguf").write_bytes(bytes(data))
    result = playbook(
        sandbox.base,
        CONVERGE_PLAY,
        "-i",
        "localhost,",
        "-e",
        f"@{variables}",
        "-e",
        f"edgellm_models_src={tampered}",
        "--tags",
        "edgellm_models",
        check=False,
    )
    assert result.returncode != 0
    assert "does not match" in result.stdout
    assert recap(result.stdout)["localhost"]["failed"] == 1
    assert installed.read_bytes() == before


@pytest.mark.slow
def test_a_preload_area_the_unit_keeps_read_only_is_refused(converged: tuple[Sandbox, Path]) -> None:
    """Outside /dev the unit (ProtectSystem=strict) keeps a preload area read-only: every load
    would fail to copy. The role says so before it changes anything."""
    sandbox, variables = converged
    result = playbook(
        sandbox.base,
        CONVERGE_PLAY,
        *("-i", "localhost,", "-e", f"@{variables}"),
        *("-e", "edgellm_preload_dir=/var/cache/edgellm", "--tags", "edgellm_assert"),
        check=False,
    )
    assert result.returncode != 0
    assert "edgellm_preload_dir must be under /dev/shm" in result.stdout
    assert recap(result.stdout)["localhost"]["failed"] == 1


# --- 3 and 4. HAProxy in front of two daemons ------------------------------------------


LB_PLAY: Final = """\
- name: Render the load balancer into a sandbox
  hosts: edgellm_lb
  connection: local
  gather_facts: false
  roles:
    - role: edgellm_lb
"""


def lb_sandbox_vars(root: Path) -> dict[str, Any]:
    user = current_user()
    return {
        "edgellm_lb_root": str(root),
        "edgellm_lb_manage_packages": False,
        "edgellm_lb_manage_systemd": False,
        "edgellm_lb_config_owner": user["edgellm_admin_user"],
        "edgellm_lb_config_group": user["edgellm_admin_group"],
        "ansible_python_interpreter": sys.executable,
    }


def test_example_site_renders_a_valid_haproxy_config(tmp_path: Path) -> None:
    """The example inventory's twenty boxes, the role's defaults: `haproxy -c` accepts the result."""
    haproxy = tool("haproxy", HAPROXY_PACKAGE)
    # HAProxy's stats socket path must fit a Unix socket address (97 bytes): a short root, not
    # pytest's tmp_path, which grows under a parallel runner (./dev test --quick).
    root = Path(tempfile.mkdtemp(prefix="edgellm-lb-"))
    try:
        variables = tmp_path / "vars.yml"
        variables.write_text(yaml.safe_dump(lb_sandbox_vars(root)))
        playbook(
            tmp_path, LB_PLAY, "-i", str(EXAMPLE_INVENTORY), "--limit", "edgellm-lb-1", "-e", f"@{variables}"
        )
        config = root / "etc/haproxy/haproxy.cfg"
        text = config.read_text()
        assert len(re.findall(r"^\s+server edgellm-\d\d 10\.20\.\d\.\d+:8080 check$", text, re.M)) == 20
        for line in (
            "balance leastconn",
            "option httpchk GET /readyz",
            "http-check expect status 200",
            "option redispatch 1",
            "option forwardfor",
            "timeout server 10m",
            "timeout tunnel 10m",
            "default-server inter 2s fall 2 rise 2",
        ):
            assert line in text, line
        check = subprocess.run(
            [haproxy, "-c", "-f", str(config)], capture_output=True, text=True, timeout=60, check=False
        )
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Outcome:
    """One request through the load balancer."""

    started: float
    ended: float
    status: int
    backend: str
    stream: bool
    error: str = ""


class Haproxy:
    """haproxy -db in the foreground; every line it prints, with the time it came."""

    def __init__(self, config: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            [tool("haproxy", HAPROXY_PACKAGE), "-f", str(config), "-db"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, pattern: str) -> float | None:
        """When a line matching `pattern` was printed first."""
        return next((at for at, line in list(self.lines) if re.search(pattern, line)), None)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


def ask(url: str, *, stream: bool) -> Outcome:
    """One chat completion through the balancer; streamed ones are read to their [DONE]."""
    body = json.dumps(
        {"model": MODEL, "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "Hi"}]}
    ).encode()
    request = urllib.request.Request(  # noqa: S310
        url + "/v1/chat/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310 - loopback URL
            payload = resp.read().decode()
            backend = resp.headers.get("X-Edgellm-Backend", "")
            complete = "data: [DONE]" in payload if stream else "choices" in json.loads(payload)
            return Outcome(
                started,
                time.monotonic(),
                resp.status if complete else 0,
                backend,
                stream,
                "" if complete else "incomplete body",
            )
    except urllib.error.HTTPError as exc:
        return Outcome(
            started,
            time.monotonic(),
            exc.code,
            exc.headers.get("X-Edgellm-Backend", ""),
            stream,
            exc.read().decode(errors="replace")[:200],
        )
    except (urllib.error.URLError, OSError) as exc:
        return Outcome(started, time.monotonic(), 0, "", stream, repr(exc))


@pytest.mark.slow
def test_haproxy_keeps_serving_when_a_daemon_stops(tmp_path: Path, tiny_model: Path) -> None:
    """Two daemons behind the rendered config; one is stopped under load; the other takes over.

    box-b runs in this process (tests.serving). box-a is a real `edgellmd` process stopped
    with SIGTERM, as `systemctl stop` does: it stops accepting, finishes what it holds and
    exits. (RunningDaemon.stop() halts its event loop instead, without the daemon's drain; a
    request it had just accepted then waited for aiohttp's shutdown timeout, 60 s.)
    """
    tool("haproxy", HAPROXY_PACKAGE)
    model = {"name": MODEL, "file": str(tiny_model), "slots": 2, "context_size": 128, "threads": 1}
    lifecycle = {"preload_dir": None, "watch": False}
    port_a = free_port()
    config_a = tmp_path / "box-a.yaml"
    config_a.write_text(
        yaml.safe_dump(
            {
                "server": {"host": "127.0.0.1", "port": port_a},
                "lock": {"allow_unsigned": True},
                "lifecycle": lifecycle,
                "logging": {"level": "info", "format": "text"},
                "models": [model],
            }
        )
    )
    box_a = DaemonProcess(
        [sys.executable, "-m", "edgellmd", "--config", str(config_a)], port_a, tmp_path / "box-a.log"
    )
    try:
        box_a.wait_ready()
        with running(settings_for([model], lifecycle=lifecycle)) as box_b:
            config = render_lb(tmp_path, {"box-a": port_a, "box-b": box_b.port})
            outcomes, stopped_at, haproxy = drive_through_failover(config, box_a)
    finally:
        status = box_a.terminate()
    assert status == 0, box_a.log.read_text()[-4000:]
    report_failover(outcomes, stopped_at, haproxy)


def render_lb(tmp_path: Path, boxes: dict[str, int]) -> Path:
    """Run the edgellm_lb role for an inventory of loopback boxes; check and return the config."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "edgellm": {
                            "hosts": {
                                name: {"ansible_host": "127.0.0.1", "edgellm_port": port}
                                for name, port in boxes.items()
                            }
                        },
                        "edgellm_lb": {"hosts": {"lb": {}}},
                    }
                }
            }
        )
    )
    variables = tmp_path / "vars.yml"
    # A foreground HAProxy run by the test user: no chroot, no user switch, no admin socket,
    # logs on stdout. Balancing, checks, retries and timeouts are the role's defaults.
    variables.write_text(
        yaml.safe_dump(
            {
                **lb_sandbox_vars(tmp_path / "root"),
                "edgellm_lb_bind_address": "127.0.0.1",
                "edgellm_lb_bind_port": free_port(),
                "edgellm_lb_chroot": "",
                "edgellm_lb_user": "",
                "edgellm_lb_stats_socket": "",
                "edgellm_lb_log_target": "stdout",
                "edgellm_lb_maxconn": 256,
                "edgellm_lb_expose_backend": True,
            }
        )
    )
    playbook(tmp_path, LB_PLAY, "-i", str(inventory), "-e", f"@{variables}")
    config = tmp_path / "root/etc/haproxy/haproxy.cfg"
    text = config.read_text()
    for name, port in boxes.items():
        assert f"server {name} 127.0.0.1:{port} check" in text
    check = subprocess.run(
        [tool("haproxy", HAPROXY_PACKAGE), "-c", "-f", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    return config


def lb_url(config: Path) -> str:
    bind = re.search(r"^\s+bind (\S+)$", config.read_text(), re.M)
    assert bind is not None
    return f"http://{bind.group(1)}"


def drive_through_failover(config: Path, box_a: DaemonProcess) -> tuple[list[Outcome], float, Haproxy]:
    """Four clients (half of them streaming) through HAProxy; box-a stops once both have served."""
    url = lb_url(config)
    haproxy = Haproxy(config)
    outcomes: list[Outcome] = []
    done = threading.Event()
    try:
        deadline = time.monotonic() + 30
        served: set[str] = set()
        while served != {"box-a", "box-b"} and time.monotonic() < deadline:
            outcome = ask(url, stream=False)
            if outcome.status == 200:
                served.add(outcome.backend)
            else:
                time.sleep(0.1)
        assert served == {"box-a", "box-b"}, f"HAProxy did not balance over both: {haproxy.lines[-10:]}"

        def client(stream: bool) -> None:
            while not done.is_set():
                outcomes.append(ask(url, stream=stream))

        clients = [threading.Thread(target=client, args=(i % 2 == 1,), daemon=True) for i in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(2)
        stopped_at = time.monotonic()
        box_a.process.send_signal(signal.SIGTERM)  # stops accepting; finishes what it holds
        time.sleep(FAILOVER_WINDOW_S + 4)
        done.set()
        for thread in clients:
            thread.join(60)
    finally:
        done.set()
        haproxy.stop()
    return outcomes, stopped_at, haproxy


def report_failover(outcomes: list[Outcome], stopped_at: float, haproxy: Haproxy) -> None:
    marked_down = haproxy.first(r"Server edgellm/box-a is DOWN")
    failed = [o for o in outcomes if o.status != 200]
    after_stop = [o for o in outcomes if o.started >= stopped_at]
    print(
        f"failover: {len(outcomes)} requests, {len(after_stop)} after box-a stopped, "
        f"{len(failed)} failed; marked down "
        f"{'never' if marked_down is None else f'{marked_down - stopped_at:.1f} s'} after the stop"
    )
    for outcome in failed:
        print(f"  failed at {outcome.started - stopped_at:+.2f} s: {outcome.status} {outcome.error}")
    for at, line in haproxy.lines:
        if abs(at - stopped_at) < 2:
            print(f"  haproxy {at - stopped_at:+.2f} s: {line}")
    assert marked_down is not None, "HAProxy never marked box-a down:\n" + "\n".join(
        line for _, line in haproxy.lines[-20:]
    )
    assert marked_down - stopped_at < FAILOVER_WINDOW_S
    assert len(after_stop) > 10, "too few requests after the stop to say anything"
    # After the backend is marked down, and after the failover window, everything succeeds.
    late = [o for o in outcomes if o.started >= marked_down or o.started >= stopped_at + FAILOVER_WINDOW_S]
    assert late, "no request after HAProxy marked box-a down"
    assert all(o.status == 200 for o in late), [(o.status, o.error) for o in late if o.status != 200]
    assert {o.backend for o in late} == {"box-b"}
    assert not [o for o in outcomes if o.started >= marked_down and 500 <= o.status < 600]
    # Retries with redispatch cover the window itself: a refused or dropped connection to
    # the stopped box is sent to the other one (observed: no failure at all).
    assert not failed, [(round(o.started - stopped_at, 2), o.status, o.error) for o in failed]


def test_the_balancer_refuses_the_operators_paths_however_they_are_spelled(tmp_path: Path) -> None:
    """Through the balancer every client has its address, which the boxes' auth.admin_cidrs
    may hold: /admin/* and the console are refused there (403), after the path is normalized
    as the daemon routes it. Everything else reaches the box (a stub that names the path)."""
    tool("haproxy", HAPROXY_PACKAGE)

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = self.path.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    haproxy: Haproxy | None = None
    try:
        config = render_lb(tmp_path, {"box": stub.server_address[1]})
        haproxy, url = Haproxy(config), lb_url(config)

        def status(path: str) -> tuple[int, str]:
            where = urllib.parse.urlsplit(url)
            assert where.hostname is not None
            assert where.port is not None
            with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
                conn.sendall(f"GET {path} HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n".encode())
                answer = b""
                while chunk := conn.recv(65536):
                    answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            return int(head.split()[1]), body.decode(errors="replace")

        def up() -> bool:
            try:
                return status("/v1/models")[0] == 200
            except OSError:  # HAProxy not listening yet
                return False

        wait_for(up, timeout=20, what="the box up behind HAProxy")
        for path in (
            "/admin",
            "/admin/status",
            "//admin/status",
            "/%61dmin/status",
            "/v1/../admin/reload",
            "/ui",
            "/ui/",
            "/ui/api/session",
            "/%75i/",
            "/admin/./status",
        ):
            assert status(path)[0] == 403, path
        for path in ("/v1/models", "/administrator", "/uix", "/readyz", "/metrics"):
            assert status(path) == (200, path), path
    finally:
        if haproxy is not None:
            haproxy.stop()
        stub.shutdown()
        stub.server_close()
