"""The sandbox's root layout: read-only binds below /tmp (a venv in /tmp, as CI often has) are
stacked on the private /tmp and show nothing else of the host's /tmp; binds that would collide with
the sandbox's own mounts are refused before the command runs."""
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuttle.sandbox import Sandbox, SandboxError, isolation

from .conftest import needs_namespaces

pytestmark = needs_namespaces

# Runs under the venv's interpreter: builds a sandbox there, so every bind comes from that venv.
_CHILD = r"""
import json, sys
from cuttle.sandbox import Limits, Sandbox, isolation
sb = Sandbox(sys.argv[1], limits=Limits(timeout=20, memory_mb=1024, nproc=64))
r = sb.run(sys.argv[2])
print(json.dumps({"prefix": sys.prefix, "binds": isolation.python_prefixes(), "isolation": sb.isolation, "run_isolation": r.isolation,
                  "exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}))
"""


@pytest.fixture
def tmp_dir() -> Iterator[Path]:
    """A directory directly in the host's /tmp (not $TMPDIR: /tmp is what collides)."""
    path = Path(tempfile.mkdtemp(prefix="cuttle-tmpvenv-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def _tops_in_tmp(paths: list[str]) -> list[str]:
    """What `ls -A /tmp` shows inside: the first component of each bound path below /tmp (the
    interpreter running the suite may live in /tmp too)."""
    return sorted({Path(p).relative_to("/tmp").parts[0] for p in paths if p.startswith("/tmp/")})


def _venv_in(parent: Path) -> Path:
    """A real venv (its own pyvenv.cfg, bin/python symlink, sys.prefix) with no pip: fast. A .pth
    puts this interpreter's site-packages (cuttle, editable or not) on its path, which is cheaper
    than installing cuttle into it; inside the sandbox those directories are absent and skipped."""
    venv = parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site_dir,) = venv.glob("lib/python3*/site-packages")
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    (site_dir / "cuttle_parent_env.pth").write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")
    return venv


def test_interpreter_from_a_venv_under_tmp_runs_isolated(ws: Path, tmp_dir: Path) -> None:
    venv = _venv_in(tmp_dir)
    (tmp_dir / "host-secret.txt").write_text("host secret\n")  # beside the venv, in the host's /tmp
    loose = Path(tempfile.mkstemp(prefix="cuttle-host-secret-", dir="/tmp")[1])
    own = f"/tmp/cuttle-inside-{os.getpid()}.txt"
    try:
        loose.write_text("host secret\n")
        command = (f"python -c 'import sys; print(sys.prefix)'; ls -A /tmp; ls -A {tmp_dir}; "
                   f"cat {tmp_dir}/host-secret.txt {loose}; touch {venv}/pwned; "
                   f"echo private > {own} && cat {own}")
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", _CHILD, str(ws), command],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.splitlines()[-1])
    finally:
        loose.unlink()
    assert out["prefix"] == str(venv)  # the sandbox was built by the venv's interpreter
    assert out["isolation"] == out["run_isolation"] == "namespaces", out
    assert str(venv) in out["binds"]
    lines = out["stdout"].splitlines()
    assert lines[0] == str(venv), out  # `python` inside is the venv's, and it runs
    tops = _tops_in_tmp(out["binds"])
    assert tmp_dir.name in tops
    assert lines[1:-1] == [*tops, "venv"], out  # all of /tmp that shows: the paths to the binds
    assert "host secret" not in out["stdout"]
    assert out["stderr"].count("No such file or directory") == 2, out["stderr"]
    assert "Read-only file system" in out["stderr"] and not (venv / "pwned").exists()
    assert lines[-1] == "private" and not os.path.exists(own)  # /tmp inside is private and writable
    assert out["exit_code"] == 0


def test_read_only_path_under_tmp_is_visible_alone_and_read_only(ws: Path, tmp_dir: Path) -> None:
    shown = tmp_dir / "shown"
    shown.mkdir()
    (shown / "data.txt").write_text("data\n")
    (tmp_dir / "hidden.txt").write_text("host secret\n")
    sb = Sandbox(ws, timeout=10, extra_read_only=(str(shown),))
    r = sb.run(f"cat {shown}/data.txt; ls -A /tmp {tmp_dir}; cat {tmp_dir}/hidden.txt; "
               f"touch {shown}/new; touch /tmp/mine && echo tmp-writable")
    assert r.isolation == "namespaces"
    tops = _tops_in_tmp([str(shown), *isolation.python_prefixes()])
    assert r.stdout.splitlines() == ["data", "/tmp:", *tops, "", f"{tmp_dir}:", "shown", "tmp-writable"]
    assert "No such file or directory" in r.stderr and "Read-only file system" in r.stderr
    assert not (shown / "new").exists()


@pytest.mark.parametrize("path,message", [
    ("/tmp", "would expose the host's whole /tmp"),
    ("/", "would expose the host's whole /tmp"),
    ("/dev/shm", "collides with the sandbox's own /dev"),
    ("/proc/self", "collides with the sandbox's own /proc"),
    ("/workspace", "collides with the sandbox's own /workspace"),
    ("WS_PARENT", "overlaps the workspace"),
])
def test_read_only_paths_colliding_with_the_sandbox_are_refused(ws: Path, path: str, message: str) -> None:
    sb = Sandbox(ws, timeout=10, extra_read_only=(str(ws.parent) if path == "WS_PARENT" else path,))
    with pytest.raises(SandboxError, match=message):
        sb.run("touch /workspace/ran")
    assert not (ws / "ran").exists()  # refused before the command ran
