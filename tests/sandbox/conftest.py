"""Shared fixtures: a fresh workspace and a sandbox on it; helpers to look for leftovers."""
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cuttle.sandbox import Limits, Sandbox, isolation
from cuttle.sandbox.workspace import remove_tree


def require_namespaces() -> None:
    """Skip only when this host cannot make namespaces (the kernel, a sysctl or seccomp refuses a
    primitive); when our sandbox setup fails for any other reason, that is a bug: fail, never skip."""
    error = isolation.namespace_error()
    if error is None:
        return
    host_error = isolation.host_namespace_error()
    if host_error is not None:
        pytest.skip(f"no user namespaces on this host: {host_error}")
    pytest.fail("sandbox setup failed, and not because this host refuses namespaces (a bug or a broken "
                f"environment, never a reason to skip): {error}", pytrace=False)


@pytest.fixture
def namespaces() -> None:
    require_namespaces()


needs_namespaces = pytest.mark.usefixtures("namespaces")


@pytest.fixture
def ws() -> Iterator[Path]:
    # Not pytest's tmp_path: its 0700 parents would hide the workspace from the sandbox uid in
    # rlimits-only mode, which runs on host paths.
    root = tempfile.mkdtemp(prefix="cuttle-test-")
    os.chmod(root, 0o755)
    path = Path(root) / "ws"
    path.mkdir()
    yield path
    remove_tree(root)


@pytest.fixture
def sb(ws: Path) -> Sandbox:
    require_namespaces()
    return Sandbox(ws, limits=Limits(timeout=10, memory_mb=1024, nproc=64))


def _live(pid: str) -> bool:
    """False for zombies: killed processes whose parent has not reaped them yet are not leaks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _scan(match: Callable[[str], bool]) -> list[int]:
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()
            and match(pid) and _live(pid)]


def _settled(match: Callable[[str], bool], wait_s: float) -> list[int]:
    # SIGKILL is asynchronous: give killed processes a moment to finish dying before we call
    # them leaked (a real leak is still there after the wait).
    deadline = time.monotonic() + wait_s
    while (found := _scan(match)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def processes_matching(needle: str, wait_s: float = 2.0) -> list[int]:
    """Live host pids whose command line contains `needle` (a marker our commands carry)."""

    def match(pid: str) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return needle in f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False

    return _settled(match, wait_s)


def processes_of_uid(uid: int, wait_s: float = 2.0) -> list[int]:
    def match(pid: str) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        return int(line.split()[1]) == uid
        except OSError:
            pass
        return False

    return _settled(match, wait_s)
