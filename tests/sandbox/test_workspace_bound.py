"""`Limits.workspace_mb`: a workspace on a filesystem of its own (a tmpfs of that size), so a
command fills it, not the host's disk: bytes and files stop at "No space left on device". The
environments (EnvPool, the agent loop's SandboxEnvironment, grading's fresh copy) make such
workspaces and remove them, mounts included; a Sandbox given the limit checks its workspace is one."""
import ctypes
import errno
import os
from pathlib import Path

import pytest

from cuttle.sandbox import Limits, Sandbox, SandboxError, SandboxUnavailable, workspace
from cuttle.sandbox.workspace import bound_workspace, remove_tree

from .conftest import require_namespaces

FILL = "head -c 100M /dev/zero > big; echo bytes $?"


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("bounded workspaces are tmpfs mounts on the host: they need root")
    require_namespaces()


def _bounded_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if " cuttle-workspace " in line]


@pytest.mark.usefixtures("root_only")
def test_bytes_and_files_stop_at_the_bound(ws: Path) -> None:
    bound_workspace(str(ws), 32)
    sb = Sandbox(ws, limits=Limits(timeout=20, fsize_mb=256, workspace_mb=32))
    r = sb.run(FILL + "; df -k /workspace | tail -1")
    assert "bytes 1" in r.stdout and "No space left on device" in r.stderr
    assert r.stdout.split()[-5] == str(32 * 1024)  # the filesystem's size, seen from inside
    r = sb.run("rm big; python3 -c 'import itertools\nfor i in itertools.count():\n    try:\n        open(f\"f{i}\", \"w\").close()\n"
               "    except OSError as e:\n        print(\"files\", i, e.strerror); break'")
    # the file count stops at the inode bound (the root directory takes one)
    assert r.stdout.strip() == f"files {32 * workspace.INODES_PER_MIB - 1} No space left on device", r
    # control: the same command in a workspace of the host's disk writes all of it
    plain = ws.parent / "plain"
    plain.mkdir()
    assert "bytes 0" in Sandbox(plain, limits=Limits(timeout=20, fsize_mb=256)).run(FILL).stdout
    remove_tree(str(ws))
    assert not ws.exists() and not any(p.startswith(str(ws)) for p in _bounded_mounts())


@pytest.mark.usefixtures("root_only")
def test_a_sandbox_checks_its_workspace_is_bounded(ws: Path) -> None:
    with pytest.raises(SandboxError, match="workspace_mb=16: .* is not a filesystem of its own"):
        Sandbox(ws, limits=Limits(workspace_mb=16))
    bound_workspace(str(ws), 64)
    with pytest.raises(SandboxError, match="filesystem holds 64 MiB, more than 16"):
        Sandbox(ws, limits=Limits(workspace_mb=16))
    Sandbox(ws, limits=Limits(workspace_mb=64))
    (ws / "x").write_text("1")
    other = ws.parent / "other"
    other.mkdir()
    (other / "x").write_text("1")
    with pytest.raises(ValueError, match="is not empty"):
        bound_workspace(str(other), 8)


@pytest.mark.usefixtures("root_only")
def test_environments_make_bound_and_remove_their_workspaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuttle.rl.environment import SandboxEnvironment
    from cuttle.sandbox import envs
    from cuttle.sandbox.tasks import base

    graded: list[bool] = []

    class Recording(Sandbox):
        def __init__(self, root, **kw):  # noqa: ANN001, ANN003
            graded.append(os.path.ismount(root))
            super().__init__(root, **kw)

    monkeypatch.setattr(base, "Sandbox", Recording)
    limits = Limits(timeout=60, fsize_mb=256, workspace_mb=48)
    pool = envs.EnvPool(limits=limits, base_dir=str(tmp_path))
    env = pool.create({"kind": "synthetic", "seed": 2})
    agent = SandboxEnvironment({"kind": "synthetic", "seed": 2}, limits)
    for root in (env.sandbox.workspace.root, agent.sandbox.workspace.root):
        assert os.path.ismount(root)
    assert "No space left on device" in pool.call(env.env_id, "run", {"command": FILL}).output
    ok, text = agent.call("run", {"command": FILL})
    assert "No space left on device" in text
    pool.reset(env.env_id)  # emptied and refilled, still bounded
    assert os.path.ismount(env.sandbox.workspace.root) and "big" not in os.listdir(env.sandbox.workspace.root)
    pool.reward(env.env_id)
    agent.reward()
    assert graded == [True, True]  # the hidden tests ran in bounded fresh copies too
    pool.delete(env.env_id)
    agent.close()
    assert not os.path.exists(env.root) and not os.path.exists(agent.root)
    assert not any(p.startswith((env.root, agent.root, str(tmp_path))) for p in _bounded_mounts())


def test_a_host_that_cannot_mount_refuses(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMounts:
        def mount(self, *args: object) -> int:
            ctypes.set_errno(errno.EPERM)
            return -1

    monkeypatch.setattr(workspace, "_libc", NoMounts())
    with pytest.raises(SandboxUnavailable, match="workspace_mb=8: mounting .* failed: Operation not permitted.*needs root"):
        bound_workspace(str(ws), 8)


@pytest.mark.parametrize("value", [0, -5, 2.5, False])
def test_bad_workspace_size_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="workspace_mb must be None or an integer >= 1"):
        Limits(workspace_mb=value)  # type: ignore[arg-type]
