"""Memory cgroups for engine processes (host/memgroups.py).

Finding the daemon's memory cgroup and the v2 protocol (a leaf for the daemon, `+memory` below,
each engine's limits) are checked on file trees shaped like the kernel's; what a limit does, on
the machine's own cgroups where this process may make them (skipped, with the reason, where it
may not).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgellmd.host import memgroups
from edgellmd.host.memgroups import EngineGroup, Layout, MemoryGroups, find_layout

MIB = 1024 * 1024


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def _v2_tree(tmp_path: Path, rel: str, controllers: str) -> Path:
    group = tmp_path / "cg" / rel
    group.mkdir(parents=True)
    (group / "cgroup.controllers").write_text(controllers + "\n")
    (group / "cgroup.subtree_control").write_text("")
    return group


V2_MOUNT = "30 24 0:26 / {point} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "35 25 0:31 {root} {point} rw,nosuid - cgroup cgroup rw,memory\n"


def test_a_v2_cgroup_with_the_memory_controller_is_found(tmp_path: Path) -> None:
    group = _v2_tree(tmp_path, "system.slice/edgellm.service", "cpu io memory pids")
    proc = _proc(tmp_path, "0::/system.slice/edgellm.service\n", V2_MOUNT.format(point=tmp_path / "cg"))
    assert find_layout(proc) == Layout(2, group)
    top = tmp_path / "in-container"
    top.mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("memory\n")
    assert find_layout(_proc(top, "0::/\n", V2_MOUNT.format(point=tmp_path / "cg"))) == Layout(
        2, tmp_path / "cg", top=True
    )


def test_v2_without_memory_falls_to_v1s_memory_hierarchy(tmp_path: Path) -> None:
    """A hybrid host: cgroup2 carries other controllers, memory is bound to v1."""
    _v2_tree(tmp_path, "", "hugetlb")
    v1 = tmp_path / "memory" / "process_api" / "abc"
    v1.mkdir(parents=True)
    proc = _proc(
        tmp_path,
        "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
        V2_MOUNT.format(point=tmp_path / "cg") + V1_MOUNT.format(root="/", point=tmp_path / "memory"),
    )
    assert find_layout(proc) == Layout(1, v1)


def test_a_mount_of_part_of_the_hierarchy_is_resolved_below_its_root(tmp_path: Path) -> None:
    """A container's mount shows /docker/abc as its root: the cgroup path is taken below it."""
    v1 = tmp_path / "memory" / "inner"
    v1.mkdir(parents=True)
    mounts = V1_MOUNT.format(root="/docker/abc", point=tmp_path / "memory")
    assert find_layout(_proc(tmp_path, "4:memory:/docker/abc/inner\n", mounts)) == Layout(1, v1)
    # A cgroup outside what the mount shows is not guessed at.
    other = tmp_path / "other"
    other.mkdir()
    outside = _proc(other, "4:memory:/elsewhere\n", mounts)
    assert isinstance(find_layout(outside), str)


@pytest.mark.parametrize(
    ("cgroup", "mounts", "words"),
    [
        ("0::/\n", "", "no cgroup memory controller"),
        ("garbage\n", "nonsense line\n", "no cgroup memory controller"),
    ],
)
def test_no_memory_controller_is_a_reason_not_an_error(
    tmp_path: Path, cgroup: str, mounts: str, words: str
) -> None:
    found = find_layout(_proc(tmp_path, cgroup, mounts))
    assert isinstance(found, str)
    assert words in found
    assert isinstance(find_layout(tmp_path / "no-such-proc"), str)


@pytest.fixture
def delegated() -> Iterator[None]:
    """The fake cgroup counts as delegated (systemd's mark is an extended attribute)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memgroups, "_delegated", lambda path: True)
        yield


def test_v2_leaves_a_cgroup_that_was_not_handed_over_alone(tmp_path: Path) -> None:
    """A login session's cgroup (the shell beside the daemon): nothing moved, nothing enabled."""
    base = _v2_tree(tmp_path, "user.slice/session-3.scope", "memory pids")
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")
    with pytest.raises(memgroups.GroupError, match="not delegated to this process"):
        MemoryGroups(Layout(2, base)).prepare()
    assert not (base / memgroups.LEAF).exists()
    assert (base / "cgroup.subtree_control").read_text() == ""
    # The root of a container's own namespace is the daemon's, when it holds the daemon alone.
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n")
    MemoryGroups(Layout(2, base, top=True)).prepare()
    assert (base / "cgroup.subtree_control").read_text() == "+memory"


@pytest.mark.usefixtures("delegated")
def test_v2_moves_the_daemon_into_a_leaf_before_enabling_memory_below(tmp_path: Path) -> None:
    base = _v2_tree(tmp_path, "edgellm.service", "memory pids")
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n")
    groups = MemoryGroups(Layout(2, base))
    groups.prepare()
    assert (base / memgroups.LEAF / "cgroup.procs").read_text() == str(os.getpid())
    assert (base / "cgroup.subtree_control").read_text() == "+memory"
    # An engine's group beside the leaf: its limit, no swap, killed as a whole.
    (base / "edgellm.service").mkdir(exist_ok=True)
    group = groups.place(4242, "chat/model v2", 300 * MIB)
    assert group.path.parent == base
    assert group.path.name == f"{memgroups.PREFIX}{os.getpid()}-chat_model_v2-1"
    assert (group.path / "memory.max").read_text() == str(300 * MIB)
    assert (group.path / "memory.oom.group").read_text() == "1"
    assert (group.path / "cgroup.procs").read_text() == "4242"
    second = groups.place(4243, "chat/model v2", 300 * MIB)
    assert second.path != group.path


@pytest.mark.usefixtures("delegated")
def test_v2_already_enabled_leaves_the_processes_where_they_are(tmp_path: Path) -> None:
    base = _v2_tree(tmp_path, "svc", "memory")
    (base / "cgroup.subtree_control").write_text("memory\n")
    (base / "cgroup.procs").write_text("")
    MemoryGroups(Layout(2, base)).prepare()
    assert not (base / memgroups.LEAF).exists()


def test_v1_sets_the_limit_and_the_swap_limit_where_swap_is_accounted(tmp_path: Path) -> None:
    base = tmp_path / "memory" / "svc"
    base.mkdir(parents=True)
    groups = MemoryGroups(Layout(1, base))
    groups.prepare()
    real_mkdir = Path.mkdir

    def mkdir_with_knobs(self: Path, *args: object, **kwargs: object) -> None:
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]
        (self / "memory.memsw.limit_in_bytes").write_text("9223372036854771712\n")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "mkdir", mkdir_with_knobs)
        group = groups.place(77, "m", 64 * MIB)
    assert (group.path / "memory.limit_in_bytes").read_text() == str(64 * MIB)
    assert (group.path / "memory.memsw.limit_in_bytes").read_text() == str(64 * MIB)
    assert (group.path / "cgroup.procs").read_text() == "77"


def test_a_failed_move_removes_the_half_made_group(tmp_path: Path) -> None:
    base = tmp_path / "memory" / "svc"
    base.mkdir(parents=True)
    groups = MemoryGroups(Layout(1, base))

    def refuse(path: Path, value: str) -> None:
        raise memgroups.GroupError(f"cannot write {value!r} to {path}: Permission denied")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memgroups, "_write", refuse)
        patch.setattr(memgroups, "_REMOVE_TRIES", 1)
        with pytest.raises(memgroups.GroupError, match="Permission denied"):
            groups.place(77, "m", 64 * MIB)
    assert list(base.iterdir()) == []


def test_groups_of_daemons_that_are_gone_are_swept(tmp_path: Path) -> None:
    base = tmp_path / "memory" / "svc"
    base.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = base / f"{memgroups.PREFIX}{gone.pid}-m-1"
    own = base / f"{memgroups.PREFIX}{os.getpid()}-m-1"
    alive = base / f"{memgroups.PREFIX}1-m-1"  # pid 1 lives
    unrelated = base / "somebody-else"
    for path in (stale, own, alive, unrelated):
        path.mkdir()
    MemoryGroups(Layout(1, base)).prepare()
    assert not stale.exists()
    assert own.exists()
    assert alive.exists()
    assert unrelated.exists()


@pytest.mark.parametrize(
    ("version", "name", "text", "kills"),
    [
        (2, "memory.events", "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 1\n", 1),
        (2, "memory.events", "low 0\nmax 0\noom 0\noom_kill 0\n", 0),
        (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", 3),
        (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\n", 0),  # an old kernel: not said
    ],
)
def test_oom_kills_are_read_from_the_versions_file(
    tmp_path: Path, version: int, name: str, text: str, kills: int
) -> None:
    (tmp_path / name).write_text(text)
    assert EngineGroup(tmp_path, version, MIB).oom_kills() == kills
    assert EngineGroup(tmp_path / "gone", version, MIB).oom_kills() == 0
    assert EngineGroup(tmp_path / "gone", version, MIB).usage() is None


# ---- on this machine's own cgroups ---------------------------------------------------------


@pytest.fixture(scope="module")
def groups() -> MemoryGroups:
    found = memgroups.shared()
    if isinstance(found, str):
        pytest.skip(f"this process may make no memory cgroups here: {found}")
    return found


def test_a_process_past_its_groups_limit_is_killed_alone(groups: MemoryGroups) -> None:
    """A child moved into a 64 MiB group and told to touch 256 MiB is killed by the kernel; the
    count says it was the limit; this process (the daemon's place) is untouched; the group goes."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nsys.stdin.readline()\nb = bytearray(256 << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\nprint('survived')",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    group = groups.place(child.pid, "runaway", 64 * MIB)
    try:
        assert str(child.pid) in (group.path / "cgroup.procs").read_text().split()
        usage = group.usage()
        assert usage is not None
        assert usage < 64 * MIB
        out, _ = child.communicate("go\n", timeout=60)
        assert child.returncode == -9, out
        assert "survived" not in out
        assert group.oom_kills() >= 1
    finally:
        child.kill()
        child.wait()
        group.remove()
    assert not group.path.exists()


def test_a_process_within_its_limit_runs_and_its_group_is_removed_after(groups: MemoryGroups) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nsys.stdin.readline()\nb = bytearray(16 << 20)\nprint('fine')"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    group = groups.place(child.pid, "modest", 256 * MIB)
    out, _ = child.communicate("go\n", timeout=60)
    assert (child.returncode, out.strip()) == (0, "fine")
    assert group.oom_kills() == 0
    started = time.monotonic()
    group.remove()
    assert not group.path.exists()
    assert time.monotonic() - started < 2
