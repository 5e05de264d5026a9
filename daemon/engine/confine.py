"""What an engine process may do: confined before it parses a model file or a client's data.

llama.cpp parses GGUF files (an untrusted binary format, even when signed) and client-shaped
data in C++. Its process gets, in this order (`confine`):

- never outliving the daemon (`PR_SET_PDEATHSIG`), no core dumps, no new privileges, no
  capabilities (the bounding set emptied and every set cleared);
- no network: a seccomp filter (libseccomp, through `pyseccomp`) refuses `socket()` for
  every address family but `AF_UNIX` with EACCES;
- the file system through Landlock (ABI read at run time): read access beneath the
  interpreter's and the libraries' directories and to the model's own files, write access
  nowhere; a kernel without Landlock leaves this step out, said once in the log;
- the OOM killer's first choice: its `oom_score_adj` raised to `OOM_SCORE_ADJ`, so that a
  runaway engine is the process the kernel kills when memory runs out, not the daemon (which
  keeps the other models, the admin API and the watchdog) nor a neighbour;
- an address-space limit (`RLIMIT_AS`), when the caller gives one.

Each step reports what it did (`Confinement`); a step the kernel or the machine cannot do is
a warning, never a refusal to serve.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import signal
import socket
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG: Final = 1
_PR_CAPBSET_DROP: Final = 24
_PR_SET_NO_NEW_PRIVS: Final = 38
_CAP_LAST_CAP_FILE: Final = "/proc/sys/kernel/cap_last_cap"
# Landlock's system calls (the same numbers on every architecture: the generic table).
_SYS_LANDLOCK_CREATE_RULESET: Final = 444
_SYS_LANDLOCK_ADD_RULE: Final = 445
_SYS_LANDLOCK_RESTRICT_SELF: Final = 446
_LANDLOCK_CREATE_RULESET_VERSION: Final = 1
_LANDLOCK_RULE_PATH_BENEATH: Final = 1
# Landlock file-system rights (linux/landlock.h), and the ABI that brought the last ones.
_FS_EXECUTE: Final = 1 << 0
_FS_WRITE_FILE: Final = 1 << 1
_FS_READ_FILE: Final = 1 << 2
_FS_READ_DIR: Final = 1 << 3
_FS_ALL_V1: Final = (1 << 13) - 1  # execute .. make_sym
_FS_REFER: Final = 1 << 13  # ABI 2
_FS_TRUNCATE: Final = 1 << 14  # ABI 3
_FS_IOCTL_DEV: Final = 1 << 15  # ABI 5
_READ_ONLY: Final = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_FILE_RIGHTS: Final = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
# Where a CPU engine reads besides the model: the interpreter, the libraries, the C runtime's
# configuration, and the kernel's views of CPUs and memory that ggml and psutil read.
# Raised from the daemon's own (0 unless the unit sets one); raising needs no privilege.
OOM_SCORE_ADJ: Final = 500
SYSTEM_READ_PATHS: Final = ("/usr", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev/null", "/dev/urandom")


class _RulesetAttr(ctypes.Structure):
    _fields_ = (("handled_access_fs", ctypes.c_uint64),)


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


@dataclass(slots=True)
class Confinement:
    """What `confine` did, step by step, and what it could not."""

    done: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "landlock: ..." and the like


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(libc: ctypes.CDLL, option: int, arg: int) -> None:
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _holds_capabilities() -> bool:
    """Whether this process holds any capability (effective, permitted or inheritable)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return True
    fields = ("CapInh:", "CapPrm:", "CapEff:")
    return any(int(line.split()[1], 16) for line in status.splitlines() if line.startswith(fields))


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Empty the bounding set, then clear the effective, permitted and inheritable sets."""
    try:
        last = int(Path(_CAP_LAST_CAP_FILE).read_text())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            err = ctypes.get_errno()
            if err != errno.EPERM:  # without CAP_SETPCAP the set is already what it may be
                raise OSError(err, os.strerror(err))
    if not _holds_capabilities():  # started without any (the unit's empty bounding set): done
        return
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two structs of (effective, permitted, inheritable): all zero
    if libc.capset(header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _no_network() -> None:
    import pyseccomp  # type: ignore[import-untyped]  # noqa: PLC0415 - ctypes over libseccomp, engine processes only

    rules = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    rules.add_rule(pyseccomp.ERRNO(errno.EACCES), "socket", pyseccomp.Arg(0, pyseccomp.NE, socket.AF_UNIX))
    rules.load()


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock, -1 when a filter refuses the call."""
    libc = _libc()
    version = libc.syscall(
        _SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), _LANDLOCK_CREATE_RULESET_VERSION
    )
    if version < 0:
        return -1 if ctypes.get_errno() == errno.EPERM else 0
    return int(version)


def _landlock(readable: Iterable[Path], abi: int) -> None:
    """Read access beneath `readable` (directories) or to them (files), write access nowhere."""
    libc = _libc()
    handled = _FS_ALL_V1
    if abi >= 2:
        handled |= _FS_REFER
    if abi >= 3:
        handled |= _FS_TRUNCATE
    if abi >= 5:
        handled |= _FS_IOCTL_DEV
    attr = _RulesetAttr(handled)
    ruleset = libc.syscall(
        _SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0
    )
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    try:
        for path in readable:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine (/lib64 on arm): nothing to allow
            try:
                rights = _READ_ONLY if path.is_dir() else _READ_ONLY & _FILE_RIGHTS
                beneath = _PathBeneath(rights & handled, fd)
                if (
                    libc.syscall(
                        _SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(beneath), 0
                    )
                    != 0
                ):
                    err = ctypes.get_errno()
                    raise OSError(err, f"landlock rule for {path}: {os.strerror(err)}")
            finally:
                os.close(fd)
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(ruleset)


def interpreter_paths() -> list[Path]:
    """The directories this interpreter imports from (its prefixes, the standard library, site-packages)."""
    found = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix)}
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(name)
        if path:
            found.add(Path(path))
    found.update(Path(p) for p in sys.path if p)
    return sorted(p for p in found if p.is_absolute())


def confine(
    model_files: Iterable[Path], *, address_space: int | None = None, landlock: bool = True
) -> Confinement:
    """Confine this process (an engine process, before it loads its model); see the module docs."""
    done = Confinement()
    libc = _libc()
    parent = os.getppid()
    _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:  # the daemon died before the request took hold
        os._exit(1)
    done.done.append("dies with the daemon")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    done.done.append("no core dumps")
    try:
        adj = Path("/proc/self/oom_score_adj")
        if int(adj.read_text()) < OOM_SCORE_ADJ:
            adj.write_text(str(OOM_SCORE_ADJ))
        done.done.append(f"the OOM killer's first choice (oom_score_adj {OOM_SCORE_ADJ})")
    except (OSError, ValueError) as exc:
        done.missing.append(f"oom_score_adj: {exc}")
    _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)
    done.done.append("no new privileges")
    try:
        _drop_capabilities(libc)
        done.done.append("no capabilities")
    except OSError as exc:
        done.missing.append(f"capabilities: {exc.strerror}")
    try:
        _no_network()
        done.done.append("no network (seccomp: socket() for AF_UNIX only)")
    except (ImportError, OSError, RuntimeError) as exc:
        done.missing.append(f"seccomp: {exc}")
    abi = landlock_abi() if landlock else 0
    if abi > 0:
        readable = [Path(p) for p in SYSTEM_READ_PATHS] + interpreter_paths() + [Path(p) for p in model_files]
        try:
            _landlock(readable, abi)
            done.done.append(f"file system read-only to its libraries and model (Landlock ABI {abi})")
        except OSError as exc:
            done.missing.append(f"landlock: {exc.strerror}")
    elif not landlock:
        done.missing.append("landlock: turned off")
    else:
        why = "a system-call filter refuses it" if abi < 0 else "this kernel has no Landlock"
        done.missing.append(f"landlock: {why}")
    if address_space:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        done.done.append(f"address space at most {address_space // (1024 * 1024)} MiB")
    return done
