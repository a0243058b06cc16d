"""Per-command memory cgroups: one bound on all of a sandboxed command's processes together.

`RLIMIT_AS` bounds each process; a command may start up to `RLIMIT_NPROC` of them and fill its
tmpfs mounts as well. `Limits.total_memory_mb` bounds their sum: every `run` gets a memory cgroup
of its own, the launcher joins it before it forks anything (jail.py), so every process of the
command and every tmpfs page it writes (`/tmp`, `/dev/shm`) is charged to it, and past the limit
the kernel's OOM killer picks a process of that cgroup only. Swap counts too where the kernel
accounts it (v1 `memory.memsw.*`, v2 `memory.swap.max = 0`).

Owns finding where this process may create such cgroups, creating one per command with its limit,
reading what it hit (OOM kills, peak usage), killing what is left in it and removing it. Where:
  * cgroup v2: the directory named by `CUTTLE_SANDBOX_CGROUP`, else this process's own cgroup;
    either must have `memory` in its `cgroup.subtree_control` (a v2 cgroup that holds processes
    cannot enable it for children, so a service that is not in the root cgroup needs a delegated
    subtree, e.g. systemd's `Delegate=yes`, named in that variable);
  * cgroup v1: a child of this process's cgroup in the `memory` hierarchy.
Must never run a command without the bound once one was asked for: the host refuses such a
sandbox at construction (`support_error`), and a launcher that cannot join exits as a setup
failure. Never imported by jail.py (the launcher gets the file paths to write its pid to).
"""
from __future__ import annotations

import errno
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass

ENV_PARENT = "CUTTLE_SANDBOX_CGROUP"
PREFIX = "cuttle-sandbox-"
REMOVE_WAIT_S = 2.0  # a killed process leaves its cgroup when it is reaped; rmdir waits for that


@dataclass(frozen=True, slots=True)
class _Hierarchy:
    version: int  # 1 or 2
    parent: str  # the directory whose children the commands' cgroups are


@dataclass(slots=True)
class CgroupReport:
    oom_kills: int  # processes the kernel killed for the cgroup's limit
    peak_bytes: int | None  # highest usage seen (None where the kernel does not report it)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root within its hierarchy, mount point, fstype, super options) of cgroup mounts."""
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4].replace("\\040", " "), tail[0], tail[2]))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: "" for v2, a controller name for v1."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        num, controllers, path = line.split(":", 2)
        if num == "0" and controllers == "":
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _join(mount_root: str, mount_point: str, path: str) -> str | None:
    """The directory of cgroup `path` under a mount of its hierarchy rooted at `mount_root`."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        return None  # the mount shows another part of the hierarchy
    rel = path[len(mount_root):] if mount_root != "/" else path
    return os.path.join(mount_point, rel.lstrip("/")).rstrip("/") or "/"


def _find() -> _Hierarchy:
    """Where this process may create a command's memory cgroup; raises OSError saying why not."""
    mounts, own = _mounts(), _own_paths()
    named = os.environ.get(ENV_PARENT)
    v2 = [(root, point) for root, point, fstype, _ in mounts if fstype == "cgroup2"]
    if named:
        parent = os.path.realpath(named)
        if not any(parent == p or parent.startswith(p.rstrip("/") + "/") for _, p in v2):
            raise OSError(errno.EINVAL, f"{ENV_PARENT}={named} is not a directory of a mounted cgroup v2 hierarchy")
        return _check_v2(parent)
    v1 = [(root, point) for root, point, fstype, opts in mounts if fstype == "cgroup" and "memory" in opts.split(",")]
    if v1 and "memory" in own:  # the memory controller lives in a v1 hierarchy here
        for root, point in v1:
            parent = _join(root, point, own["memory"])
            if parent is not None and os.path.isdir(parent):
                return _Hierarchy(1, parent)
        raise OSError(errno.ENOENT, f"this process's memory cgroup {own['memory']} is not visible under {v1[0][1]}")
    if v2 and "" in own:
        for root, point in v2:
            parent = _join(root, point, own[""])
            if parent is not None and os.path.isdir(parent):
                return _check_v2(parent)
    raise OSError(errno.ENOENT, "no cgroup hierarchy with the memory controller is mounted")


def _check_v2(parent: str) -> _Hierarchy:
    try:
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    except OSError as err:
        raise OSError(err.errno, f"{parent}: {err.strerror}") from None
    if "memory" not in enabled:
        raise OSError(errno.EPERM, f"cgroup v2: memory is not enabled in {parent}/cgroup.subtree_control (a cgroup "
                      f"that holds processes cannot enable it for children; delegate a subtree and name it in {ENV_PARENT})")
    return _Hierarchy(2, parent)


class CommandCgroup:
    """One command's memory cgroup: created with its limit, joined by the launcher (`procs_file`),
    closed after the command (`close`: leftovers killed, report read, directory removed)."""

    def __init__(self, where: _Hierarchy, limit_bytes: int) -> None:
        self.version = where.version
        self.path = os.path.join(where.parent, PREFIX + uuid.uuid4().hex[:16])
        os.mkdir(self.path, 0o755)
        try:
            if self.version == 2:
                _write(self._file("memory.max"), str(limit_bytes))
                if os.path.exists(self._file("memory.swap.max")):
                    _write(self._file("memory.swap.max"), "0")
            else:
                _write(self._file("memory.limit_in_bytes"), str(limit_bytes))
                if os.path.exists(self._file("memory.memsw.limit_in_bytes")):  # swap accounting on
                    _write(self._file("memory.memsw.limit_in_bytes"), str(limit_bytes))
        except OSError:
            os.rmdir(self.path)
            raise

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def procs_file(self) -> str:
        """The file the launcher writes its pid to (its children then start inside)."""
        return self._file("cgroup.procs")

    def _counter(self, name: str, key: str) -> int:
        for line in _read(self._file(name)).splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    def report(self) -> CgroupReport:
        if self.version == 2:
            peak = self._file("memory.peak")
            return CgroupReport(self._counter("memory.events", "oom_kill"),
                                int(_read(peak)) if os.path.exists(peak) else None)
        return CgroupReport(self._counter("memory.oom_control", "oom_kill"), int(_read(self._file("memory.max_usage_in_bytes"))))

    def kill_all(self) -> None:
        """SIGKILL whatever is still in the cgroup (a command whose processes left its group)."""
        if self.version == 2 and os.path.exists(self._file("cgroup.kill")):
            _write(self._file("cgroup.kill"), "1")
            return
        for _ in range(10):  # a process forking while we read gets a second pass
            pids = [int(p) for p in _read(self._file("cgroup.procs")).split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> CgroupReport:
        """Kill what is left, read the report, remove the cgroup (waiting for the killed to be reaped)."""
        self.kill_all()
        report = self.report()
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                os.rmdir(self.path)
                return report
            except OSError as err:
                if err.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
                self.kill_all()


def create(limit_bytes: int) -> CommandCgroup:
    """A fresh memory cgroup bounded at `limit_bytes` (raises OSError where none can be made)."""
    return CommandCgroup(_find(), limit_bytes)


@functools.cache
def support_error() -> str | None:
    """None when this process can make per-command memory cgroups; otherwise why not (probed
    once: a cgroup is created with a limit, joined by nothing, and removed)."""
    try:
        create(64 << 20).close()
    except OSError as err:
        return str(err)
    return None
