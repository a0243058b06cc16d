"""Sandbox.run: results, isolation facts, timeouts, output caps, the rlimits-only opt-in."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cuttle.sandbox import Limits, Sandbox, SandboxError, SandboxUnavailable, isolation
from cuttle.sandbox.runner import _Capture

from .conftest import needs_namespaces, processes_matching, processes_of_uid, require_namespaces


@needs_namespaces
def test_result_fields_and_streams(sb: Sandbox) -> None:
    r = sb.run("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (7, "out\n", "err\n", False)
    assert r.isolation == "namespaces"
    assert not (r.stdout_truncated or r.stderr_truncated or r.output_limit_exceeded)


@needs_namespaces
def test_runs_unprivileged_without_capabilities_in_own_namespaces(sb: Sandbox) -> None:
    r = sb.run("id -u; hostname; grep -E '^Cap(Prm|Eff|Bnd|Amb)' /proc/self/status; "
               "ls /proc | grep -c '^[0-9]'; readlink /proc/self/ns/net")
    lines = r.stdout.split()
    assert r.exit_code == 0, r.stderr
    assert lines[0] == "1000"
    assert lines[1] == "sandbox"
    caps = r.stdout.splitlines()[2:6]
    assert all(line.split()[1] == "0000000000000000" for line in caps), caps
    assert int(r.stdout.splitlines()[6]) <= 5  # pid 1, the shell, ls, grep: no host processes
    assert r.stdout.splitlines()[7] != os.readlink("/proc/self/ns/net")


@needs_namespaces
def test_workspace_is_writable_and_owned_by_the_sandbox_uid(sb: Sandbox, ws: Path) -> None:
    r = sb.run("pwd; echo data > made.txt; mkdir d && touch d/x")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "/workspace"
    st = os.stat(ws / "made.txt")
    assert (ws / "made.txt").read_text() == "data\n"
    assert st.st_uid == sb.workspace.uid
    if os.geteuid() == 0:
        assert st.st_uid != 0  # root on the host never runs the command


@needs_namespaces
def test_environment_is_scrubbed(sb: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTTLE_TEST_SECRET", "hunter2")
    r = sb.run("env")
    assert "hunter2" not in r.stdout and "CUTTLE_TEST_SECRET" not in r.stdout
    names = {line.split("=", 1)[0] for line in r.stdout.splitlines()}
    assert {"PATH", "HOME", "LANG"} <= names and len(names) <= 10


@needs_namespaces
def test_stdin_is_empty_unless_given(sb: Sandbox) -> None:
    assert sb.run("cat", timeout=5).stdout == ""
    assert sb.run("cat", stdin=b"fed\n").stdout == "fed\n"


@needs_namespaces
def test_timeout_kills_command_and_everything_it_started(sb: Sandbox) -> None:
    t = time.monotonic()
    r = sb.run("sleep 981 & setsid sleep 982 & echo started; sleep 983", timeout=1)
    elapsed = time.monotonic() - t
    assert r.timed_out and r.exit_code == 137
    assert r.stdout == "started\n"
    assert elapsed < 3.5
    assert "timed out" in r.format()
    assert processes_matching("sleep 98") == []


@needs_namespaces
def test_background_processes_die_when_the_command_ends(sb: Sandbox) -> None:
    t = time.monotonic()
    r = sb.run("sleep 971 & setsid sleep 972 & sleep 0.3; echo bye")
    assert r.exit_code == 0 and not r.timed_out and r.stdout == "bye\n"
    assert time.monotonic() - t < 2
    assert processes_matching("sleep 97") == []


@needs_namespaces
def test_timeout_argument_is_capped_by_the_sandbox_limit(ws: Path) -> None:
    sb = Sandbox(ws, timeout=1)
    r = sb.run("sleep 30", timeout=100)
    assert r.timed_out and r.duration_s < 3


@needs_namespaces
def test_large_output_keeps_head_and_tail_and_says_so(ws: Path) -> None:
    sb = Sandbox(ws, limits=Limits(timeout=10, output_bytes=1000))
    r = sb.run("echo HEAD; seq 1 100000; echo TAIL")
    assert r.exit_code == 0 and r.stdout_truncated and not r.stderr_truncated
    assert r.stdout.startswith("HEAD\n1\n2\n") and r.stdout.endswith("100000\nTAIL\n")
    assert "bytes truncated" in r.stdout and len(r.stdout) < 1200
    assert "truncated" in r.format()


def test_capture_is_exact_below_the_limit_and_counts_what_it_drops() -> None:
    cap = _Capture(10)
    for chunk in (b"abc", b"defgh", b"ij"):
        cap.add(chunk)
    assert cap.text() == ("abcdefghij", False)
    cap.add(b"KLMNOPQRSTUVWXYZ")
    text, cut = cap.text()
    assert cut and text == "abcde\n[... 16 bytes truncated ...]\nVWXYZ"


@needs_namespaces
def test_setup_failure_is_an_error_not_a_weaker_run(sb: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "staging_dir", lambda: "/nonexistent/cuttle-staging")
    with pytest.raises(SandboxError, match="setup failed"):
        sb.run("echo should-not-run")


def _host_without_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "namespace_error", lambda: "user namespaces disabled (test)")
    monkeypatch.setattr(isolation, "host_namespace_error", lambda: "user namespaces disabled (test)")


def test_without_namespaces_sandbox_is_refused_by_default(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _host_without_namespaces(monkeypatch)
    with pytest.raises(SandboxUnavailable, match="allow_unisolated=True") as err:
        Sandbox(ws)
    assert "user namespaces disabled (test)" in str(err.value)


def test_rlimits_only_mode_is_opt_in_and_reported_on_every_result(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _host_without_namespaces(monkeypatch)
    sb = Sandbox(ws, limits=Limits(timeout=2, nproc=64), allow_unisolated=True)
    assert sb.isolation == "rlimits-only"
    r = sb.run("echo hi > f.txt; cat f.txt; grep 'Max processes' /proc/self/limits")
    assert r.exit_code == 0, r.stderr
    assert r.isolation == "rlimits-only" and "rlimits-only" in r.format()
    assert r.stdout.split()[:5] == ["hi", "Max", "processes", "64", "64"]
    assert (ws / "f.txt").read_text() == "hi\n"
    t = time.monotonic()
    r = sb.run("sleep 961 & sleep 962", timeout=1)
    assert r.timed_out and r.isolation == "rlimits-only" and time.monotonic() - t < 3.5
    assert processes_matching("sleep 96") == []
    if os.geteuid() == 0:  # escaping the process group is caught by the sandbox's own uid
        sb.run("setsid sleep 963 > /dev/null 2>&1 < /dev/null & sleep 0.3; echo gone")  # let it escape first
        assert processes_of_uid(sb.workspace.uid) == []
        assert processes_matching("sleep 963") == []


# -- telling "this host cannot" from "our setup failed" -----------------------------------------

@needs_namespaces
def test_host_probe_passes_where_the_sandbox_works() -> None:
    assert isolation.host_namespace_error() is None


@needs_namespaces
def test_setup_failure_on_a_capable_host_is_an_error_even_with_allow_unisolated(
        ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The /tmp collision looked like this: the host could make namespaces, our root layout failed,
    # and callers that allowed rlimits-only silently got it. The host probe here is the real one.
    monkeypatch.setattr(isolation, "namespace_error", lambda: "File exists: '/x/tmp' (test)")
    for allow in (False, True):
        with pytest.raises(SandboxError, match="not because this host refuses namespaces") as err:
            Sandbox(ws, allow_unisolated=allow)
        assert not isinstance(err.value, SandboxUnavailable) and "File exists: '/x/tmp' (test)" in str(err.value)
    with pytest.raises(pytest.fail.Exception, match="never a reason to skip"):
        require_namespaces()  # the suite fails on it instead of skipping


# Run in a user namespace whose user.max_user_namespaces is 0: a host that refuses namespaces.
_REFUSING_HOST = r"""
import json, tempfile, pytest
from cuttle.sandbox import Sandbox, SandboxUnavailable, isolation
from tests.sandbox.conftest import require_namespaces
out = {"host_error": isolation.host_namespace_error()}
try:
    Sandbox(tempfile.mkdtemp(prefix="cuttle-test-"))
except SandboxUnavailable as err:
    out["unavailable"] = str(err)
try:
    require_namespaces()
except pytest.skip.Exception as skip:
    out["skip"] = skip.msg
print(json.dumps(out))
"""


@needs_namespaces
def test_a_host_refusing_namespaces_is_unavailable_and_skips_with_the_reason() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) (util-linux) is not installed")
    repo = Path(__file__).resolve().parents[2]
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, sys.executable, _REFUSING_HOST],
                          cwd=repo, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    refusal = "unshare: No space left on device"  # the kernel's answer past user.max_user_namespaces
    assert out["host_error"].startswith(refusal)
    assert refusal in out["unavailable"] and "allow_unisolated=True" in out["unavailable"]
    assert out["skip"] == f"no user namespaces on this host: {out['host_error']}"


@pytest.mark.parametrize("probe,refused", [
    ("unshare: Operation not permitted (errno 1)", True),  # seccomp, or an unprivileged container
    ("unshare: No space left on device (errno 28)", True),  # user.max_user_namespaces = 0
    ("writing uid/gid maps: [Errno 1] Operation not permitted", True),
    ("[Errno 17] File exists: '/tmp/cuttle-sandbox-root-0/tmp'", False),  # ours: the /tmp collision
    ("KeyError: 'staging'", False),
])
def test_only_the_kernel_refusing_a_primitive_counts_as_no_namespaces(
        monkeypatch: pytest.MonkeyPatch, probe: str, refused: bool) -> None:
    monkeypatch.setattr(isolation, "_probe", lambda spec: probe)
    assert isolation.host_namespace_error.__wrapped__() == (probe if refused else None)
