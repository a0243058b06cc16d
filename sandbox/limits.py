"""Resource limits of one sandbox: the numbers, in one place, with their defaults.

Owns the `Limits` dataclass only; applying them is jail.py's job and must never happen here.
"""
import math
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(slots=True)
class Limits:
    timeout: float = 30.0  # wall clock per command, seconds; the whole sandbox is killed after it
    memory_mb: int = 1024  # RLIMIT_AS of the command and each child
    cpu_s: int | None = None  # RLIMIT_CPU; None: derived from the timeout of each call
    nproc: int = 128  # RLIMIT_NPROC, counted per user namespace, so per command
    nofile: int = 256  # RLIMIT_NOFILE
    fsize_mb: int = 64  # RLIMIT_FSIZE: largest file a command may write
    tmp_mb: int = 64  # size of the private /tmp and /dev/shm tmpfs (RAM, so kept small)
    output_bytes: int = 16384  # kept per stream: half from the head, half from the tail
    max_output_bytes: int = 64 * MiB  # read in total before the command is killed as a flood
    # all of a command's processes together, its tmpfs pages included: a memory cgroup per command
    # (cgroups.py); None: not bounded beyond memory_mb per process. A host that cannot make one
    # refuses the sandbox (never a run without the bound)
    total_memory_mb: int | None = None
    # the workspace's own filesystem, bytes and files bounded (workspace.bound_workspace: a tmpfs
    # of this size, made by the environments; a Sandbox given it checks its workspace is one);
    # None: the workspace is a directory of the host's disk
    workspace_mb: int | None = None

    def __post_init__(self) -> None:
        for name, least in (("total_memory_mb", 8), ("workspace_mb", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be None or an integer >= {least} (MiB); got {value!r}")

    def rlimits(self, timeout: float) -> dict[str, int]:
        cpu = self.cpu_s if self.cpu_s is not None else math.ceil(timeout) + 1
        return {
            "cpu": cpu,
            "as": self.memory_mb * MiB,
            "nproc": self.nproc,
            "fsize": self.fsize_mb * MiB,
            "nofile": self.nofile,
            "core": 0,
        }
