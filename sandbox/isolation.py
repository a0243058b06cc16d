"""Host side of isolation: what this machine can do, and the launcher spec for one command.

Owns detection (can we create user/pid/net/mount/ipc namespaces here?), the choice of the
unprivileged host uid a sandbox runs as, the read-only view of the system, the scrubbed
environment and the launcher command line. Must never weaken isolation silently: rlimits-only
is chosen by the caller (Sandbox) only on explicit opt-in, and is named on every result.
"""
import errno
import functools
import marshal
import os
import re
import stat
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from .limits import Limits

NAMESPACES = "namespaces"
RLIMITS_ONLY = "rlimits-only"
WORKSPACE_MOUNT = "/workspace"  # where the workspace appears inside the sandbox
JAIL = str(Path(__file__).with_name("jail.py"))
SETUP_FAILED = 125  # jail.py's exit code when isolation could not be set up
SETUP_MARKER = "cuttle-sandbox: setup failed:"
# Host uids for sandboxes when we run as root: far above any real account, one per workspace, so
# two sandboxes never share files or a process-count limit. Collisions only share a uid, harmlessly.
UID_BASE, UID_SPAN = 1_500_000_000, 1_000_000
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def sandbox_ids(workspace: str) -> tuple[int, int]:
    """The host uid/gid whose files the workspace holds and as which its commands run."""
    if os.geteuid() != 0:
        return os.geteuid(), os.getegid()  # unprivileged: user namespaces map us; nothing to drop to
    uid = UID_BASE + zlib.crc32(workspace.encode()) % UID_SPAN
    return uid, uid


def python_prefixes() -> list[str]:
    """Directories that must be visible for this interpreter (and its venv) to run inside."""
    out: list[str] = []
    for prefix in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        real = os.path.realpath(prefix)
        if real not in out and not any(real == d or real.startswith(d + "/") for d in SYSTEM_DIRS):
            out.append(real)
    return out


def read_only_binds(extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    binds = [(d, d) for d in SYSTEM_DIRS if os.path.lexists(d)]
    binds += [(p, p) for p in python_prefixes()]
    binds += [(os.path.realpath(p), os.path.realpath(p)) for p in extra]
    return binds


def sandbox_path() -> str:
    """PATH inside: this venv's scripts first, so `python`, `pytest` and `ruff` are ours."""
    return f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin"


def scrubbed_env(isolation: str, workspace: str) -> dict[str, str]:
    # Nothing from the host environment leaks in: tokens and keys often live there.
    home = "/tmp" if isolation == NAMESPACES else workspace
    return {
        "PATH": sandbox_path(),
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "USER": "sandbox",
        "PYTHONDONTWRITEBYTECODE": "1",  # keeps __pycache__ out of the agent's diff
    }


def staging_dir() -> str:
    """An empty directory to mount each sandbox's private root on. Mounts happen only inside the
    sandbox's own mount namespace, so one directory serves every sandbox at once."""
    path = os.path.join(tempfile.gettempdir(), f"cuttle-sandbox-root-{os.geteuid()}")
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{path} is not a directory owned by us; refusing to mount on it")
    return path


def build_spec(
    mode: str,
    argv: list[str],
    workspace: str,
    limits: Limits,
    timeout: float,
    extra_ro: tuple[str, ...] = (),
) -> dict:
    uid, gid = sandbox_ids(workspace)
    inside = mode == NAMESPACES
    return {
        "mode": mode,
        "host_uid": uid if os.geteuid() == 0 else None,
        "host_gid": gid if os.geteuid() == 0 else None,
        "setgroups": os.geteuid() == 0,
        "staging": staging_dir() if inside else "",
        "ro_binds": read_only_binds(extra_ro),
        "workspace": workspace,
        "workspace_dst": WORKSPACE_MOUNT,
        "tmp_mb": limits.tmp_mb,
        "rlimits": limits.rlimits(timeout),
        "env": scrubbed_env(mode, workspace),
        "argv": argv,
        "cwd": WORKSPACE_MOUNT if inside else workspace,
    }


def launcher_argv(spec: dict) -> list[str]:
    # -I -S: no site-packages, no user env vars: the launcher is stdlib only and starts fast.
    # marshal, not json: decoding needs no import in the launcher (json pulls in re).
    return [sys.executable, "-I", "-S", "-B", JAIL, marshal.dumps(spec).hex()]


def launcher_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin"}


def _probe(spec: dict) -> str | None:
    proc = subprocess.run(launcher_argv(spec), env=launcher_env(), capture_output=True, timeout=30, check=False,
                          stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        return None
    msg = proc.stderr.decode(errors="replace").strip() or f"exit code {proc.returncode}"
    return msg.removeprefix(SETUP_MARKER).strip()


@functools.cache
def namespace_error() -> str | None:
    """None when a namespace sandbox can be set up here; otherwise why not (probed once)."""
    probe = tempfile.mkdtemp(prefix="cuttle-probe-")
    try:
        os.chmod(probe, 0o755)
        uid, gid = sandbox_ids(probe)
        if os.geteuid() == 0:
            os.chown(probe, uid, gid)
        spec = build_spec(NAMESPACES, ["/bin/sh", "-c", "test -w /workspace && ! test -w /usr"], probe,
                          Limits(), timeout=10.0)
        return _probe(spec)
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        return f"probe failed: {err}"
    finally:
        os.rmdir(probe)


# How a kernel, a sysctl or seccomp refuses a namespace primitive (unshare, the id maps, mount,
# pivot_root). Any other failure of the host probe is not the host refusing namespaces.
HOST_REFUSALS = {errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOSPC, errno.EUSERS, errno.ENOSYS}
_ERRNO = re.compile(r"\(errno (\d+)\)|\[Errno (\d+)\]")  # jail's SetupError / an OSError


@functools.cache
def host_namespace_error() -> str | None:
    """Why this host refuses the primitives the sandbox is built from (user, pid, net, mount, ipc
    and uts namespaces, tmpfs, a read-only bind, /proc, pivot_root), probed with none of our
    layout; None when it does not refuse them. A probe that fails otherwise (the launcher cannot
    start, an unexpected error) is not a refusal either: then, as whenever namespace_error() is
    set and this is None, the failure is ours, and never a reason to fall back to rlimits-only."""
    try:
        uid, gid = sandbox_ids(JAIL)
        error = _probe({"mode": "probe-host", "host_uid": uid, "host_gid": gid, "staging": staging_dir()})
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return None
    match = _ERRNO.search(error or "")
    if match is None or int(match.group(1) or match.group(2)) not in HOST_REFUSALS:
        return None
    return error
