"""Run one launcher process to completion: wall-clock timeout, group kill, capped output.

Owns the host side of a command's lifetime and the `RunResult` it produces. Must never buffer
unbounded output (only a head and a tail are kept, the rest is counted and dropped), never wait
on a sandbox past its deadline, and never leave its process group alive when it returns.
"""
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

CHUNK = 1 << 16
DRAIN_GRACE_S = 2.0  # after a kill, how long pipes may take to close before we stop reading


@dataclass(slots=True)
class RunResult:
    exit_code: int  # shell convention: 128 + N when killed by signal N
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str  # "namespaces" or "rlimits-only"
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    output_limit_exceeded: bool = False  # the command flooded output and was killed
    duration_s: float = 0.0
    # with Limits.total_memory_mb: the kernel killed a process for the command's total memory,
    # and the highest total it reached (None where not bounded or not reported)
    memory_limit_exceeded: bool = False
    peak_memory_mb: float | None = None

    def format(self) -> str:
        """The text an agent sees for a `run` tool call."""
        notes = []
        if self.timed_out:
            notes.append(f"timed out after {self.duration_s:.1f} s; the sandbox and all its processes were killed")
        if self.output_limit_exceeded:
            notes.append("output limit exceeded; the command was killed")
        if self.memory_limit_exceeded:
            notes.append("memory limit exceeded: the command's processes together used more than the sandbox allows, "
                         "and the kernel killed one of them")
        if self.stdout_truncated or self.stderr_truncated:
            notes.append("output truncated: only the head and tail are shown")
        if self.isolation != "namespaces":
            notes.append(f"isolation: {self.isolation} (no namespaces)")
        parts = [f"exit code: {self.exit_code}"] + [f"note: {n}" for n in notes]
        if self.stdout:
            parts.append("stdout:\n" + self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        return "\n".join(parts)


class _Capture:
    """Keeps the first and last `keep // 2` bytes of a stream and counts the rest."""

    def __init__(self, keep: int) -> None:
        self.half = max(keep // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 4 * self.half:  # trim rarely: amortised O(1) per byte
                del self.tail[: -self.half]

    def text(self) -> tuple[str, bool]:
        tail = self.tail[-self.half :]
        dropped = self.total - len(self.head) - len(tail)
        if dropped <= 0:
            return (self.head + self.tail).decode(errors="replace"), False
        marker = f"\n[... {dropped} bytes truncated ...]\n"
        return self.head.decode(errors="replace") + marker + tail.decode(errors="replace"), True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def execute(
    argv: list[str],
    env: dict[str, str],
    timeout: float,
    isolation: str,
    keep_bytes: int,
    max_output_bytes: int,
    stdin: bytes | None = None,
    after_exit: Callable[[], None] | None = None,
) -> RunResult:
    """Run `argv` (the launcher) in its own process group and collect a RunResult.

    `after_exit` runs once the launcher is gone or killed (rlimits-only mode uses it to kill
    processes that escaped the group). Leftover processes are killed in every case: a command's
    lifetime ends when its main process ends, as with a pid namespace.
    """
    if stdin is not None and len(stdin) > 65536:
        raise ValueError("stdin for a sandboxed command is limited to one pipe buffer (64 KiB)")
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
    )
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)  # fits in the pipe buffer: never blocks
        proc.stdin.close()
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    captures = {out_fd: _Capture(keep_bytes), err_fd: _Capture(keep_bytes)}
    # A pidfd turns "launcher exited" into one more readable fd, without reaping it: the zombie
    # keeps the process-group id reserved until our kill below has landed.
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    open_pipes = {out_fd, err_fd}
    deadline = start + timeout
    exited = timed_out = flooded = False
    total = 0
    try:
        while not (exited and not open_pipes):
            now = time.monotonic()
            if now >= deadline:
                if exited or timed_out or flooded:
                    break  # the grace period is over and something still holds a pipe: stop reading
                timed_out = True
                _kill_group(proc.pid)
                deadline = now + DRAIN_GRACE_S
                continue
            for key, _ in sel.select(timeout=deadline - now):
                if key.fd == pidfd:
                    exited = True
                    sel.unregister(pidfd)
                    _kill_group(proc.pid)
                    if after_exit is not None:
                        after_exit()
                        after_exit = None
                    deadline = min(deadline, time.monotonic() + DRAIN_GRACE_S)
                    continue
                data = os.read(key.fd, CHUNK)
                if not data:
                    sel.unregister(key.fd)
                    open_pipes.discard(key.fd)
                    continue
                captures[key.fd].add(data)
                total += len(data)
                if total > max_output_bytes and not flooded:
                    flooded = True
                    _kill_group(proc.pid)
                    deadline = min(deadline, time.monotonic() + DRAIN_GRACE_S)
    finally:
        sel.close()
        _kill_group(proc.pid)
        exit_code = proc.wait()
        os.close(pidfd)
        if after_exit is not None:
            after_exit()
        proc.stdout.close()
        proc.stderr.close()
    stdout, out_cut = captures[out_fd].text()
    stderr, err_cut = captures[err_fd].text()
    return RunResult(
        exit_code=128 - exit_code if exit_code < 0 else exit_code,  # Popen: -N for signal N
        stdout=stdout, stderr=stderr, timed_out=timed_out, isolation=isolation,
        stdout_truncated=out_cut, stderr_truncated=err_cut, output_limit_exceeded=flooded,
        duration_s=time.monotonic() - start,
    )
