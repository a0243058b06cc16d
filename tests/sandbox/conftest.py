"""Shared fixtures: a fresh workspace and a sandbox on it; helpers to look for leftovers."""
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuttle.sandbox import Limits, Sandbox, namespace_error
from cuttle.sandbox.workspace import remove_tree

NS_ERROR = namespace_error()
needs_namespaces = pytest.mark.skipif(NS_ERROR is not None, reason=f"no namespaces here: {NS_ERROR}")


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
    if NS_ERROR is not None:
        pytest.skip(f"no namespaces here: {NS_ERROR}")
    return Sandbox(ws, limits=Limits(timeout=10, memory_mb=1024, nproc=64))


def processes_matching(needle: str) -> list[int]:
    """Host pids whose command line contains `needle` (a marker our commands carry)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def processes_of_uid(uid: int) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(pid))
                        break
        except OSError:
            continue
    return pids
