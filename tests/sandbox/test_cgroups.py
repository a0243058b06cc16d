"""`Limits.total_memory_mb`: one memory cgroup per command bounds all of its processes together
(each under RLIMIT_AS alone), its tmpfs pages included; the host reports what it hit, leaves no
cgroup or process behind, and refuses the sandbox where the bound cannot be made. The v2 layout
rules are checked on a simulated tree (this project's machines mount the memory controller in v1)."""
import os
from pathlib import Path

import pytest

from cuttle.sandbox import Limits, Sandbox, SandboxError, SandboxUnavailable, cgroups
from .conftest import processes_matching, require_namespaces

# four processes of 40 MiB each (touched, so resident): under RLIMIT_AS (memory_mb=256) one by one
FOUR_OF_40 = ("for i in 1 2 3 4; do python3 -c 'import time; b = bytearray(40 << 20); b[::4096] = b\"x\" * len(b[::4096]); "
              "time.sleep(0.5); print(\"done\")' & done; wait")


def _require_cgroups() -> None:
    why = cgroups.support_error()
    if why is not None:
        pytest.skip(f"this process cannot make memory cgroups here: {why}")


def _ours() -> set[str]:
    parent = cgroups._find().parent
    return {n for n in os.listdir(parent) if n.startswith(cgroups.PREFIX)}


@pytest.fixture
def bounded(ws: Path) -> Sandbox:
    require_namespaces()
    _require_cgroups()
    return Sandbox(ws, limits=Limits(timeout=20, memory_mb=256, nproc=64, total_memory_mb=96))


def test_processes_together_are_bounded_not_each(bounded: Sandbox, ws: Path) -> None:
    before = _ours()
    r = bounded.run(FOUR_OF_40)
    assert r.memory_limit_exceeded and "memory limit exceeded" in r.format()
    assert r.stdout.count("done") < 4  # the kernel killed at least one of them
    assert r.peak_memory_mb is not None and 80 <= r.peak_memory_mb <= 96.5
    # the same command without the bound: every process completes (the control)
    free = Sandbox(ws, limits=Limits(timeout=20, memory_mb=256, nproc=64)).run(FOUR_OF_40)
    assert free.stdout.count("done") == 4 and not free.memory_limit_exceeded and free.peak_memory_mb is None
    # under the bound, a command that fits runs as usual and says how much it used
    small = bounded.run("python3 -c 'b = bytearray(20 << 20); print(len(b))'")
    assert small.exit_code == 0 and small.stdout.strip() == str(20 << 20) and not small.memory_limit_exceeded
    assert 20 <= small.peak_memory_mb < 96
    assert _ours() == before  # every command's cgroup removed


def test_tmpfs_pages_count_against_the_bound(ws: Path) -> None:
    require_namespaces()
    _require_cgroups()
    limits = Limits(timeout=20, tmp_mb=256, fsize_mb=256, total_memory_mb=64)
    r = Sandbox(ws, limits=limits).run("head -c 150M /dev/zero > /dev/shm/fill; echo wrote $?")
    assert r.memory_limit_exceeded and "wrote 0" not in r.stdout
    free = Sandbox(ws, limits=Limits(timeout=20, tmp_mb=256, fsize_mb=256)).run("head -c 150M /dev/zero > /dev/shm/fill; echo wrote $?")
    assert free.stdout.strip() == "wrote 0"  # control: the tmpfs alone would allow it


def test_rlimits_only_mode_is_bounded_and_its_escapees_killed(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without namespaces the cgroup is the only thing holding a command's processes together: a
    process that leaves the process group is still in the cgroup, and killed with it."""
    _require_cgroups()
    from cuttle.sandbox import isolation

    monkeypatch.setattr(isolation, "namespace_error", lambda: "user namespaces disabled (test)")
    monkeypatch.setattr(isolation, "host_namespace_error", lambda: "user namespaces disabled (test)")
    sb = Sandbox(ws, limits=Limits(timeout=20, memory_mb=256, nproc=64, total_memory_mb=96), allow_unisolated=True)
    assert sb.isolation == "rlimits-only"
    r = sb.run(FOUR_OF_40)
    assert r.memory_limit_exceeded and r.stdout.count("done") < 4
    # the kill by uid off: what is left to end a process that left the group is the cgroup
    monkeypatch.setattr(Sandbox, "_kill_escapees", lambda self: None)
    # (the pause lets it leave the group before the command ends: without the cgroup it survives)
    r = sb.run("setsid sleep 7341 > /dev/null 2>&1 < /dev/null & sleep 0.3; echo started")
    assert r.stdout.strip() == "started"
    assert processes_matching("sleep 7341") == []


def test_refused_where_no_cgroup_can_be_made(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "support_error", lambda: "no cgroup hierarchy with the memory controller is mounted (test)")
    with pytest.raises(SandboxUnavailable, match="total_memory_mb=128 needs a memory cgroup per command.*mounted \\(test\\)"):
        Sandbox(ws, limits=Limits(total_memory_mb=128))
    Sandbox(ws, limits=Limits())  # without the bound nothing is asked of the host


def test_a_launcher_that_cannot_join_fails_setup(bounded: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    class Unjoinable(cgroups.CommandCgroup):
        procs_file = "/nonexistent/cgroup.procs"

    monkeypatch.setattr(cgroups, "create", lambda limit_bytes: Unjoinable(cgroups._find(), limit_bytes))
    before = _ours()
    with pytest.raises(SandboxError, match="joining the command's cgroup /nonexistent/cgroup.procs"):
        bounded.run("echo should-not-run")
    assert _ours() == before


@pytest.mark.parametrize("value", [0, 7, -1, 1.5, True, "64"])
def test_bad_total_memory_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="total_memory_mb must be None or an integer >= 8"):
        Limits(total_memory_mb=value)  # type: ignore[arg-type]


# ---- where the cgroups go: the layout rules, on simulated /proc and /sys files -----------------

def _fake_host(monkeypatch: pytest.MonkeyPatch, root: Path, mountinfo: str, cgroup: str) -> None:
    files = {"/proc/self/mountinfo": mountinfo, "/proc/self/cgroup": cgroup}
    real = cgroups._read
    monkeypatch.setattr(cgroups, "_read", lambda path: files[path] if path in files else real(path))
    monkeypatch.delenv(cgroups.ENV_PARENT, raising=False)


def test_v2_layout_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "cg2"
    svc = mnt / "system.slice" / "svc"
    svc.mkdir(parents=True)
    info = f"41 31 0:38 / {mnt} rw,relatime - cgroup2 cgroup2 rw\n"
    _fake_host(monkeypatch, tmp_path, info, "0::/system.slice/svc\n")
    (svc / "cgroup.subtree_control").write_text("cpu pids\n")
    with pytest.raises(OSError, match="memory is not enabled in .*svc/cgroup.subtree_control.*CUTTLE_SANDBOX_CGROUP"):
        cgroups._find()
    (svc / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert cgroups._find() == cgroups._Hierarchy(2, str(svc))
    # a delegated subtree named by the operator wins; one outside any cgroup2 mount is refused
    deleg = mnt / "delegated"
    deleg.mkdir()
    (deleg / "cgroup.subtree_control").write_text("memory\n")
    monkeypatch.setenv(cgroups.ENV_PARENT, str(deleg))
    assert cgroups._find() == cgroups._Hierarchy(2, str(deleg))
    monkeypatch.setenv(cgroups.ENV_PARENT, str(tmp_path))
    with pytest.raises(OSError, match="is not a directory of a mounted cgroup v2 hierarchy"):
        cgroups._find()
    # a command's cgroup: the limit, no swap, its report, removed on close
    monkeypatch.setenv(cgroups.ENV_PARENT, str(deleg))
    made: list[Path] = []
    real_mkdir = os.mkdir

    def mkdir(path: str, mode: int = 0o777) -> None:
        real_mkdir(path, mode)
        made.append(Path(path))
        (Path(path) / "memory.swap.max").write_text("max\n")
        (Path(path) / "cgroup.procs").write_text("")
        (Path(path) / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        (Path(path) / "memory.peak").write_text(str(90 << 20))

    monkeypatch.setattr(cgroups.os, "mkdir", mkdir)
    cg = cgroups.create(96 << 20)
    assert (made[0] / "memory.max").read_text() == str(96 << 20) and (made[0] / "memory.swap.max").read_text() == "0"
    assert cg.procs_file == str(made[0] / "cgroup.procs")
    real_rmdir = os.rmdir

    def rmdir(path: str) -> None:  # the kernel's files go with a cgroup; a plain directory needs emptying
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        real_rmdir(path)

    monkeypatch.setattr(cgroups.os, "rmdir", rmdir)
    assert cg.close() == cgroups.CgroupReport(oom_kills=1, peak_bytes=90 << 20)
    assert not made[0].exists()


def test_v1_layout_follows_the_mount_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's v1 mount may show only its own part of the hierarchy (mount root != /)."""
    mem = tmp_path / "memory"
    (mem / "job").mkdir(parents=True)
    info = (f"35 31 0:32 /ctr {mem} rw,relatime - cgroup cgroup rw,memory\n"
            f"39 31 0:36 / {tmp_path / 'pids'} rw,relatime - cgroup cgroup rw,pids\n")
    _fake_host(monkeypatch, tmp_path, info, "4:memory:/ctr/job\n8:pids:/\n0::/\n")
    assert cgroups._find() == cgroups._Hierarchy(1, str(mem / "job"))
    _fake_host(monkeypatch, tmp_path, info, "4:memory:/elsewhere\n0::/\n")
    with pytest.raises(OSError, match="memory cgroup /elsewhere is not visible"):
        cgroups._find()
    _fake_host(monkeypatch, tmp_path, "", "0::/\n")
    with pytest.raises(OSError, match="no cgroup hierarchy with the memory controller is mounted"):
        cgroups._find()


def test_grading_keeps_the_environment_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hidden tests run the agent's code too: the pool's (and the agent loop's) grading takes
    the environment's limits, the total-memory bound included, with the task's time limit."""
    require_namespaces()
    _require_cgroups()
    from cuttle.rl import environment
    from cuttle.sandbox import envs

    seen: list[Limits] = []

    def grade(task, workspace, limits, scratch_dir=None):  # noqa: ANN001, ANN202
        seen.append(limits)
        raise RuntimeError("captured")

    monkeypatch.setattr(envs, "grade", grade)
    monkeypatch.setattr(environment, "grade", grade)
    limits = Limits(timeout=50, memory_mb=300, nproc=40, total_memory_mb=200)
    pool = envs.EnvPool(limits=limits, base_dir=str(tmp_path))
    env = pool.create({"kind": "synthetic", "seed": 1})
    agent_env = environment.SandboxEnvironment({"kind": "synthetic", "seed": 1}, limits)
    try:
        for call in (lambda: pool.reward(env.env_id), agent_env.reward):
            with pytest.raises(RuntimeError, match="captured"):
                call()
    finally:
        pool.delete(env.env_id)
        agent_env.close()
    for got in seen:
        assert (got.total_memory_mb, got.memory_mb, got.nproc, got.timeout) == (200, 300, 40, env.task.timeout)
    assert len(seen) == 2
