"""Memory cgroups for engine processes: each engine in a group of its own, limited to its model's share.

An engine process's memory (its KV cache, compute buffers, prompt cache, and the weights when
they are not preloaded) is charged to its own cgroup, whose limit is what the memory budget
counts for the model plus a headroom (`models[].memory_group_headroom_mb`). Past the limit the
kernel reclaims and then kills inside that group only: a runaway engine dies at its own limit
whatever the box has free, and the daemon, the other models and the neighbours never feel the
pressure. The supervisor reads the group's OOM kill count when the engine dies and names the
cause (`oom`).

Where a group can be made (`shared`: found and prepared once per process):

- cgroup v2 whose memory controller reaches the daemon's cgroup, and that cgroup handed to the
  daemon: marked delegated by systemd (`Delegate=`, the `user.delegate`/`trusted.delegate`
  attribute), or the root of a container's own cgroup namespace holding no process but the
  daemon. cgroup v2 has one writer per cgroup, so a cgroup that is not handed over (a login
  session's, a unit's without `Delegate=`) is left alone. No process may sit in a cgroup whose
  children have controllers, so the daemon first moves the processes of its cgroup into a leaf
  `daemon`, then enables `+memory` below and makes each engine's group beside that leaf:
  `memory.max` the limit, `memory.swap.max` 0 (a limit that swaps is no limit) and
  `memory.oom.group` 1.
- cgroup v1's memory hierarchy (hybrid hosts): a child of the daemon's memory cgroup, with
  `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` where swap is accounted).
- neither: one warning; engines run without a group (their `oom_score_adj` still makes them the
  OOM killer's first choice, `confine`).

Groups are named `edgellm-<daemon pid>-<model>-<n>`: daemons sharing a cgroup never collide, and
the groups a killed daemon left behind (their pid gone, the group empty) are removed when the
next daemon opens the same cgroup. Pages a process touched before it was moved stay charged where
they were (cgroup v2 never moves charges), so the daemon moves an engine before it sends the
model to load.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

PREFIX: Final = "edgellm-"
LEAF: Final = "daemon"  # cgroup v2: where the daemon's own processes go
HOST_WIDE: Final = "memory cgroups: "  # how an engine names a reason that holds for every engine
_NAME_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]")
_REMOVE_TRIES: Final = 50  # x 20 ms: a killed engine's group empties once the kernel reaped it


class GroupError(Exception):
    """A group could not be made or an engine moved into it; the message says which file and why."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where this process's memory cgroup is, in which cgroup version."""

    version: int  # 1 or 2
    path: Path  # the daemon's own memory cgroup directory
    top: bool = False  # the root of what this process sees (a container's own cgroup namespace)


def _read(path: Path) -> str:
    return path.read_text(encoding="ascii", errors="replace")


def _write(path: Path, value: str) -> None:
    try:
        with path.open("w", encoding="ascii") as out:
            out.write(value)
    except OSError as exc:
        raise GroupError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def find_layout(proc: Path = Path("/proc/self")) -> Layout | str:
    """This process's memory cgroup from `proc`'s cgroup and mountinfo, or why there is none."""
    try:
        lines = _read(proc / "cgroup").splitlines()
        mounts = _read(proc / "mountinfo").splitlines()
    except OSError as exc:
        return f"cannot read {proc}/cgroup or mountinfo: {exc.strerror or exc}"
    v2_path: str | None = None
    v1_path: str | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    for line in mounts:
        # id parent major:minor root mount-point options... - fstype source super-options
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup2" and v2_path is not None:
            found = _under(Path(point), root, v2_path)
            if found is not None and "memory" in _controllers(found):
                return Layout(2, found, top=v2_path == "/")
        if fstype == "cgroup" and "memory" in options and v1_path is not None:
            found = _under(Path(point), root, v1_path)
            if found is not None:
                return Layout(1, found)
    return "no cgroup memory controller reaches this process"


def _under(point: Path, root: str, path: str) -> Path | None:
    """`path` (as /proc/self/cgroup gives it) below a mount of the hierarchy's `root`."""
    if root not in ("/", path) and not path.startswith(root.rstrip("/") + "/"):
        return None  # this process's cgroup is outside what that mount shows
    rel = path[len(root) :] if root != "/" else path
    found = point / rel.lstrip("/")
    return found if found.is_dir() else None


def _controllers(path: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return _read(path / "cgroup.controllers").split()
    return []


def _delegated(path: Path) -> bool:
    """Whether systemd marked the cgroup as delegated (`Delegate=`; systemd 251 and later)."""
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name) == b"1":
                return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


@dataclass(slots=True)
class EngineGroup:
    """One engine process's memory cgroup."""

    path: Path
    version: int
    limit: int  # bytes

    @property
    def limit_mib(self) -> int:
        """The limit in MiB, as messages show it."""
        return self.limit // (1024 * 1024)

    def _events(self) -> str:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            return _read(self.path / name)
        except OSError:
            return ""

    def oom_kills(self) -> int:
        """Processes the kernel killed in this group for its limit (0 when the kernel does not say)."""
        for line in self._events().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def usage(self) -> int | None:
        """Bytes charged to the group now (None once it is gone)."""
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            return int(_read(self.path / name).strip())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Remove the group once its process is gone (waits up to a second for the kernel)."""
        for _ in range(_REMOVE_TRIES):
            try:
                self.path.rmdir()
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove the memory cgroup %s: %s", self.path, exc.strerror)
                    return
                time.sleep(0.02)
            else:
                return
        log.warning("the memory cgroup %s still holds a process: left in place", self.path)


class MemoryGroups:
    """Makes engine processes' memory cgroups below the daemon's own (see the module docs)."""

    def __init__(self, layout: Layout) -> None:
        """Take `layout` as found; `prepare` makes it usable (cgroup v2 needs the leaf)."""
        self.layout = layout
        self._lock = threading.Lock()
        self._made = 0

    @property
    def version(self) -> int:
        """1 or 2."""
        return self.layout.version

    @property
    def parent(self) -> Path:
        """The directory engine groups are made in."""
        return self.layout.path

    def prepare(self) -> None:
        """Move this cgroup's processes into the leaf and enable memory below it (v2); GroupError."""
        base = self.layout.path
        if not os.access(base, os.W_OK):
            raise GroupError(f"{base} is not writable by this process (delegate it: systemd's Delegate=)")
        if self.version == 2:
            enabled = _read(base / "cgroup.subtree_control").split()
            procs = _read(base / "cgroup.procs").split()
            others = set(procs) - {str(os.getpid())}
            if not _delegated(base) and not (self.layout.top and not others):
                # cgroup v2 has one writer per cgroup: one not handed to this process is left alone.
                raise GroupError(f"{base} is not delegated to this process (systemd: Delegate=)")
            if "memory" not in enabled:
                leaf = base / LEAF
                try:
                    leaf.mkdir(exist_ok=True)
                except OSError as exc:
                    raise GroupError(f"cannot make {leaf}: {exc.strerror or exc}") from None
                for pid in procs:
                    try:
                        _write(leaf / "cgroup.procs", pid)
                    except GroupError:
                        if _alive(int(pid)):
                            raise
                _write(base / "cgroup.subtree_control", "+memory")
        self._sweep()

    def _sweep(self) -> None:
        """Remove the empty groups of daemons that are gone."""
        with contextlib.suppress(OSError):
            for entry in self.parent.iterdir():
                owner = entry.name[len(PREFIX) :].split("-", 1)[0] if entry.name.startswith(PREFIX) else ""
                if owner.isdigit() and int(owner) != os.getpid() and not _alive(int(owner)):
                    with contextlib.suppress(OSError):
                        entry.rmdir()
                        log.info("removed the memory cgroup %s of a daemon that is gone", entry)

    def place(self, pid: int, model: str, limit: int) -> EngineGroup:
        """A new group limited to `limit` bytes, with `pid` moved into it; GroupError."""
        with self._lock:
            self._made += 1
            n = self._made
        safe = _NAME_UNSAFE.sub("_", model)[:64]
        path = self.parent / f"{PREFIX}{os.getpid()}-{safe}-{n}"
        try:
            path.mkdir()
        except OSError as exc:
            raise GroupError(f"cannot make {path}: {exc.strerror or exc}") from None
        group = EngineGroup(path, self.version, limit)
        try:
            if self.version == 2:
                _write(path / "memory.max", str(limit))
                if (path / "memory.swap.max").exists():
                    _write(path / "memory.swap.max", "0")
                _write(path / "memory.oom.group", "1")
            else:
                _write(path / "memory.limit_in_bytes", str(limit))
                if (path / "memory.memsw.limit_in_bytes").exists():
                    _write(path / "memory.memsw.limit_in_bytes", str(limit))
            _write(path / "cgroup.procs", str(pid))
        except GroupError:
            group.remove()
            raise
        return group


_shared: MemoryGroups | str | None = None
_shared_lock = threading.Lock()


def shared() -> MemoryGroups | str:
    """This process's MemoryGroups, opened and prepared once, or why there are none (said once)."""
    global _shared  # noqa: PLW0603 - one per process: the daemon's own cgroup is per process
    with _shared_lock:
        if _shared is None:
            found = find_layout()
            if isinstance(found, Layout):
                groups = MemoryGroups(found)
                try:
                    groups.prepare()
                    _shared = groups
                    log.info("engine processes get memory cgroups of their own below %s", found.path)
                except (GroupError, OSError) as exc:
                    _shared = str(exc)
            else:
                _shared = found
            if isinstance(_shared, str):
                log.warning("engine processes run without memory cgroups of their own: %s", _shared)
        return _shared
