"""Acceptance 1: every escape attempt is blocked with a clear error and the host is unaffected.

Bombs are bounded (small rlimits, short timeouts) so a regression cannot hurt the shared machine.
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cuttle.sandbox import Limits, Sandbox, ToolError

from .conftest import needs_namespaces, processes_matching, processes_of_uid

pytestmark = needs_namespaces


@pytest.fixture
def outside(ws: Path) -> Path:
    """A host file next to the workspace, which nothing in the sandbox may read or change."""
    secret = ws.parent / "secret.txt"
    secret.write_text("host secret\n")
    return secret


def _host_unaffected(sb: Sandbox, outside: Path) -> None:
    assert outside.read_text() == "host secret\n"
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    if os.geteuid() == 0:
        assert processes_of_uid(sb.workspace.uid) == []


# -- reading or writing outside the workspace: the tools ------------------------------------------

@pytest.mark.parametrize("tool,args", [
    ("read_file", {}), ("list_dir", {}), ("search", {"pattern": "secret"}),
    ("edit_file", {"old_str": "host", "new_str": "pwned"}), ("write_file", {"content": "pwned"}),
])
def test_dotdot_is_refused_by_every_path_tool(sb: Sandbox, outside: Path, tool: str, args: dict) -> None:
    with pytest.raises(ToolError, match=r"'\.\.' is not allowed"):
        sb.call_tool(tool, path="../secret.txt", **args)
    with pytest.raises(ToolError, match=r"'\.\.' is not allowed"):
        sb.call_tool(tool, path="sub/../../secret.txt", **args)
    _host_unaffected(sb, outside)


@pytest.mark.parametrize("tool,args", [
    ("read_file", {}), ("edit_file", {"old_str": "host", "new_str": "pwned"}), ("write_file", {"content": "pwned"}),
])
def test_absolute_path_outside_is_refused(sb: Sandbox, outside: Path, tool: str, args: dict) -> None:
    for path in (str(outside), "/etc/passwd", "/etc/cuttle-pwned"):
        with pytest.raises(ToolError, match="absolute path outside the workspace"):
            sb.call_tool(tool, path=path, **args)
    assert not os.path.exists("/etc/cuttle-pwned")
    _host_unaffected(sb, outside)


def test_absolute_paths_inside_are_accepted(sb: Sandbox, ws: Path) -> None:
    (ws / "a.txt").write_text("inside\n")
    assert "inside" in sb.call_tool("read_file", path="/workspace/a.txt")
    assert "inside" in sb.call_tool("read_file", path=str(ws / "a.txt"))


def test_symlinks_pointing_outside_are_refused(sb: Sandbox, ws: Path, outside: Path) -> None:
    os.symlink(outside, ws / "file_link")
    os.symlink(ws.parent, ws / "dir_link")
    os.symlink("/etc", ws / "etc_link")
    cases = [("read_file", {"path": "file_link"}), ("read_file", {"path": "dir_link/secret.txt"}),
             ("write_file", {"path": "file_link", "content": "pwned"}),
             ("write_file", {"path": "dir_link/new.txt", "content": "pwned"}),
             ("edit_file", {"path": "file_link", "old_str": "host", "new_str": "pwned"}),
             ("list_dir", {"path": "etc_link"}), ("search", {"pattern": "root", "path": "etc_link"})]
    for tool, args in cases:
        with pytest.raises(ToolError, match="symlink on this path points outside the workspace"):
            sb.call_tool(tool, **args)
    assert not (ws.parent / "new.txt").exists()
    # Walking tools never follow them either.
    assert "dir_link -> " in sb.call_tool("list_dir", depth=3)
    assert sb.call_tool("search", pattern="host secret") == "no matches"
    _host_unaffected(sb, outside)


def test_symlinks_inside_the_workspace_still_work(sb: Sandbox, ws: Path) -> None:
    (ws / "real.txt").write_text("target\n")
    os.symlink("real.txt", ws / "alias.txt")
    assert "target" in sb.call_tool("read_file", path="alias.txt")


def test_hard_links_and_fifos_are_refused(sb: Sandbox, ws: Path) -> None:
    (ws / "a.txt").write_text("x\n")
    os.link(ws / "a.txt", ws / "b.txt")
    with pytest.raises(ToolError, match="hard links"):
        sb.call_tool("write_file", path="b.txt", content="y")
    os.mkfifo(ws / "pipe")
    with pytest.raises(ToolError, match="not a regular file"):
        sb.call_tool("read_file", path="pipe")  # must not block the host
    with pytest.raises(ToolError, match="not a regular file"):
        sb.call_tool("write_file", path="pipe", content="x")
    assert sb.call_tool("search", pattern="zzz") == "no matches"  # the walk skips it, does not block


# -- reading or writing outside the workspace: commands -------------------------------------------

def test_commands_cannot_see_host_files_outside_the_workspace(sb: Sandbox, outside: Path) -> None:
    r = sb.run(f"cat {outside}; cat ../secret.txt; ls {outside.parent}; cat /root/.bash_history")
    assert "host secret" not in r.stdout
    assert r.stderr.count("No such file or directory") >= 3
    _host_unaffected(sb, outside)


def test_writing_to_a_system_path_fails_read_only(sb: Sandbox, outside: Path) -> None:
    r = sb.run("touch /etc/cuttle-pwned; echo x > /usr/cuttle-pwned; "
               f"echo x > {sys.prefix}/cuttle-pwned; mkdir /cuttle-pwned; echo done")
    assert r.stdout == "done\n"
    assert r.stderr.count("Read-only file system") == 4, r.stderr
    for path in ("/etc/cuttle-pwned", "/usr/cuttle-pwned", f"{sys.prefix}/cuttle-pwned", "/cuttle-pwned"):
        assert not os.path.exists(path)
    _host_unaffected(sb, outside)


def test_remount_and_mount_need_privileges_the_command_lacks(sb: Sandbox) -> None:
    r = sb.run("mount -o remount,rw /usr; mount -t tmpfs none /tmp; touch /usr/cuttle-pwned")
    assert r.exit_code != 0
    assert "permission denied" in r.stderr.lower() or "must be superuser" in r.stderr.lower()
    assert not os.path.exists("/usr/cuttle-pwned")
    # Root of a nested user namespace cannot unlock them either: the kernel locks the flags of
    # mounts inherited from a more privileged namespace.
    r = sb.run("unshare -rm sh -c 'id -u; mount -o remount,rw,bind /usr; touch /usr/cuttle-pwned'")
    assert r.stdout == "0\n" and "Read-only file system" in r.stderr
    assert not os.path.exists("/usr/cuttle-pwned")


# -- network ----------------------------------------------------------------------------------

def test_loopback_port_on_the_host_is_unreachable(sb: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        r = sb.run(f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"")
        assert r.exit_code != 0
        assert "ConnectionRefusedError" in r.stderr  # the sandbox's own loopback: nobody listens
        with pytest.raises(BlockingIOError):
            server.accept()  # and nothing ever reached the host's
    finally:
        server.close()


def test_no_route_to_any_outside_network(sb: Sandbox) -> None:
    r = sb.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"")
    assert r.exit_code != 0 and "Network is unreachable" in r.stderr
    r = sb.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    assert r.stdout.split() == ["lo"]


# -- processes ---------------------------------------------------------------------------------

def test_fork_bomb_is_stopped_by_the_process_limit(ws: Path) -> None:
    sb = Sandbox(ws, limits=Limits(timeout=3, nproc=16))
    # Bounded probe first: how many children can be alive at once?
    r = sb.run("python -c \"import os, time\nn = 0\ntry:\n    for _ in range(100):\n"
               "        if os.fork() == 0:\n            time.sleep(5); os._exit(0)\n        n += 1\n"
               "except BlockingIOError as e:\n    print(n, e.strerror)\"")
    count, *msg = r.stdout.split(maxsplit=1)
    assert int(count) < 16 and "Resource temporarily unavailable" in msg[0]
    t = time.monotonic()
    r = sb.run("bomb(){ bomb|bomb& }; bomb; sleep 1")
    assert "Cannot fork" in r.stderr
    r = sb.run("bash -c ':(){ :|:& };:'")  # bash retries failed forks: this one needs the timeout
    assert time.monotonic() - t < 8
    assert subprocess.run(["true"], check=False).returncode == 0
    assert processes_matching(":|:") == [] and processes_matching("bomb|bomb") == []
    if os.geteuid() == 0:
        assert processes_of_uid(sb.workspace.uid) == []


def test_memory_bomb_hits_the_address_space_limit(ws: Path) -> None:
    sb = Sandbox(ws, limits=Limits(timeout=10, memory_mb=256))
    r = sb.run("python -c \"x = bytearray(1 << 30)\"")
    assert r.exit_code == 1 and "MemoryError" in r.stderr
    r = sb.run("python -c \"x = []\nwhile True:\n    x.append(bytearray(1 << 20))\"")
    assert r.exit_code == 1 and "MemoryError" in r.stderr and not r.timed_out


def test_tmpfs_and_file_size_are_bounded(ws: Path) -> None:
    sb = Sandbox(ws, limits=Limits(timeout=10, tmp_mb=8, fsize_mb=64))
    r = sb.run("head -c 20000000 /dev/zero > /tmp/big; echo $?; ls -l /tmp/big | cut -d' ' -f5")
    assert "No space left on device" in r.stderr and int(r.stdout.split()[1]) <= 8 << 20
    sb = Sandbox(ws, limits=Limits(timeout=10, fsize_mb=1))
    r = sb.run("head -c 5000000 /dev/zero > big.bin")
    assert "File too large" in r.stderr and (ws / "big.bin").stat().st_size <= 1 << 20


def test_infinite_loop_is_killed_at_the_wall_clock_timeout(ws: Path) -> None:
    sb = Sandbox(ws, timeout=1)
    t = time.monotonic()
    r = sb.run("python -c 'while True: pass'")
    assert r.timed_out and r.exit_code == 137 and time.monotonic() - t < 3
    assert processes_matching("while True: pass") == []


def test_cpu_limit_kills_a_busy_loop_even_before_the_wall_clock(ws: Path) -> None:
    sb = Sandbox(ws, limits=Limits(timeout=10, cpu_s=1))
    r = sb.run("python -c 'while True: pass'")
    assert not r.timed_out and r.exit_code == 128 + 24  # SIGXCPU
    assert r.duration_s < 5


def test_one_gigabyte_of_output_is_cut_off(ws: Path) -> None:
    sb = Sandbox(ws, limits=Limits(timeout=20, max_output_bytes=8 << 20))
    t = time.monotonic()
    r = sb.run("head -c 1000000000 /dev/zero | tr '\\0' a; echo never")
    assert r.output_limit_exceeded and r.stdout_truncated and "never" not in r.stdout
    assert "output limit exceeded" in r.format()
    assert len(r.stdout) < 20000
    assert time.monotonic() - t < 10
    assert processes_matching("head -c 1000000000") == []


def test_signalling_a_host_process_is_impossible(sb: Sandbox) -> None:
    victim = subprocess.Popen(["sleep", "30"])
    try:
        r = sb.run(f"kill -9 {victim.pid}; kill -9 -1; echo after")
        assert "No such process" in r.stderr
        time.sleep(0.2)
        assert victim.poll() is None  # still running
        r = sb.run("ps -eo pid,comm --no-headers")
        assert str(victim.pid) not in r.stdout.split()
        assert len(r.stdout.splitlines()) <= 3  # pid 1, sh, ps
    finally:
        victim.kill()
        victim.wait()


def test_pid_one_cannot_be_inspected_or_killed(sb: Sandbox) -> None:
    r = sb.run("kill -9 1; cat /proc/1/environ; echo survived")
    assert r.stdout.endswith("survived\n")  # pid 1 ignores it (or refuses it, when it runs as root)
    assert "Permission denied" in r.stderr
