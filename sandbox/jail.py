"""The sandbox launcher: a standalone script that turns one JSON spec into one isolated command.

Owns: process creation inside new user/PID/net/mount/IPC/UTS namespaces, the read-only root it
builds with bind mounts, dropping privileges and capabilities, rlimits and the scrubbed environment;
joining the command's memory cgroup (`cgroup_procs`, made by cgroups.py) before any fork.
Run as `python -I -S jail.py SPEC` (SPEC: marshal-encoded dict in hex, from the same
interpreter); only cheap standard-library imports (no json, socket or signal: they pull in re
and enum, tripling start-up).
Must never import cuttle, never run the command with capabilities or as host root, and never
let a setup failure fall through to running the command with weaker isolation (it exits 125).

Process tree (namespaces mode), host pid namespace on the left:

    L (this script, init userns) -> C (new userns + mount/net/ipc/uts ns; builds the root)
                                       -> I (pid 1 of the new pid ns; mounts /proc, pivots, reaps)
                                              -> X (drops to uid 1000, rlimits, exec /bin/sh -c ...)

L writes C's uid/gid maps from the parent namespace (only a parent may map more than its own
uid), C and I die with their parent (PDEATHSIG), and when I exits the kernel kills everything left
in the pid namespace, so killing L's process group from the host tears down the whole sandbox.

Mode "probe-host" runs the same tree with only the kernel's primitives (the namespaces, a tmpfs
root, one read-only bind, /proc, pivot_root) and no command: it tells "this host refuses
namespaces" apart from "our root layout failed" (isolation.host_namespace_error).
"""
import ctypes
import errno
import fcntl
import marshal
import os
import resource
import stat
import struct
import sys

SETUP_FAILED = 125
SANDBOX_UID = 1000  # the uid the command sees inside the user namespace
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
SYS_MOUNT_SETATTR = 442  # same number on every architecture (added after the syscall table unification)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SIGKILL, AF_INET, SOCK_DGRAM = 9, 2, 2
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return ret


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(_b(src), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)), f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _make_readonly(target: str, writable: bool, devices: bool = False) -> None:
    """Apply ro/nosuid/nodev to a bind mount and every mount below it (a plain remount only
    reaches the top one, and a writable submount would be a hole in the read-only view)."""
    flags = MOUNT_ATTR_NOSUID | (0 if devices else MOUNT_ATTR_NODEV) | (0 if writable else MOUNT_ATTR_RDONLY)
    attr = _MountAttr(flags, 0, 0, 0)
    ret = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, _b(target), AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr))
    if ret == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        _check(ret, f"mount_setattr {target}")
    # Kernels before 5.12: remount the top mount, keeping flags the kernel locked on it.
    locked = os.statvfs(target).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | locked | (0 if devices else MS_NODEV) | (0 if writable else MS_RDONLY)
    _mount(None, target, None, flags)


def _prctl(option: int, arg: int) -> int:
    return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def _die_with_parent(expected_parent: int | None) -> None:
    _check(_prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl(PDEATHSIG)")
    # pid 1 sees its parent as 0 (outside the namespace), so it cannot run this check; C only
    # dies before I's prctl if it is killed, and then L's group kill reaches I as well.
    if expected_parent is not None and os.getppid() != expected_parent:  # parent died before the prctl took effect
        raise SetupError("parent exited during setup")


def _bind(src: str, root: str, dst: str, writable: bool, devices: bool = False) -> None:
    target = root + dst
    st = os.stat(src)
    if stat.S_ISDIR(st.st_mode):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(src, target, None, MS_BIND | MS_REC)
    _make_readonly(target, writable, devices)


def _loopback_up() -> None:
    """Bring `lo` up in the new (empty) network namespace: commands can talk to themselves,
    but the namespace has no other interface, so nothing outside is reachable."""
    fd = _check(libc.socket(AF_INET, SOCK_DGRAM, 0), "socket")
    try:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(fd, 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(fd, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))  # SIOCSIFFLAGS |= IFF_UP
    finally:
        os.close(fd)


def _overlaps(a: str, b: str) -> bool:
    """The same path, or one lies below the other ("/" overlaps everything)."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _check_binds(spec: dict) -> None:
    """Refuse read-only binds that would collide with the sandbox's own mounts or show more of the
    host than they name. Below /tmp is allowed (see _build_root); /tmp itself or a parent of it
    is not: that would show the whole host /tmp (a Python prefix directly at /tmp or / is not
    supported). /dev, /proc and the workspace are the sandbox's own, and a bind inside the
    workspace would have to create its mount point in the host's workspace directory."""
    own = ("/dev", "/proc", "/.oldroot", spec["workspace_dst"])
    for src, dst in spec["ro_binds"]:
        if _overlaps(dst, "/tmp") and not dst.startswith("/tmp/"):
            raise SetupError(f"read-only path {dst} would expose the host's whole /tmp; "
                             "only directories below /tmp can be bound")
        for path in own:
            if _overlaps(dst, path):
                raise SetupError(f"read-only path {dst} collides with the sandbox's own {path}")
        if _overlaps(src, spec["staging"]):
            raise SetupError(f"read-only path {src} overlaps the sandbox's staging root {spec['staging']}")
        if _overlaps(src, spec["workspace"]):  # a parent would show the workspace's neighbours
            raise SetupError(f"read-only path {src} overlaps the workspace {spec['workspace']}")


def _private_root(root: str) -> None:
    """A fresh tmpfs at `root` in our own mount namespace, whose mounts never reach the host."""
    os.umask(0o022)  # mount points we create are 0755 whatever the caller's umask
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount may propagate to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")


def _probe_root(root: str) -> str:
    """probe-host: the primitives _build_root relies on, none of its layout."""
    _private_root(root)
    _bind(os.path.dirname(os.path.abspath(__file__)), root, "/probe", writable=False)
    os.mkdir(root + "/proc")
    os.mkdir(root + "/.oldroot")
    return root


def _build_root(spec: dict) -> str:
    """In C (fresh mount ns, full caps there): a tmpfs root holding only what the spec binds.

    The sandbox's own mounts (/tmp, /dev, /workspace) come first and the read-only binds last.
    A bind below /tmp (a venv in /tmp, as CI often has) then gets its mount point made inside the
    private /tmp tmpfs and is stacked on it: visible at its own path (shebangs and pyvenv.cfg hold
    absolute paths), read-only, and the only thing of the host's /tmp that shows. Its parent
    directories are fresh, empty ones of the private tmpfs. Binding first would create <root>/tmp
    as a plain directory (then the tmpfs mount failed), and mounting the tmpfs over it would hide
    the bind. _check_binds refuses what cannot be stacked this way."""
    root = spec["staging"]
    _check_binds(spec)
    _private_root(root)
    tmp_opts = f"mode=1777,size={spec['tmp_mb']}m,nr_inodes=65536"
    os.mkdir(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
    os.mkdir(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for node in DEV_NODES:
        if os.path.exists("/dev/" + node):
            _bind("/dev/" + node, root, "/dev/" + node, writable=True, devices=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
    _mount(None, root + "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)  # nodes stay usable
    _bind(spec["workspace"], root, spec["workspace_dst"], writable=True)
    os.mkdir(root + "/proc")
    os.mkdir(root + "/.oldroot")
    for src, dst in spec["ro_binds"]:
        if os.path.islink(src):  # merged-/usr systems: /bin -> usr/bin stays a symlink
            if not os.path.lexists(root + dst):
                os.symlink(os.readlink(src), root + dst)
        elif os.path.exists(src):
            _bind(src, root, dst, writable=False)
    return root


def _enter_root(root: str) -> None:
    """In I (pid 1): mount a /proc that shows only this pid namespace, then pivot into the new
    root and detach the old one so no path leads back to the host tree."""
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(libc.syscall(nr, b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
    os.rmdir("/.oldroot")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _set_rlimits(limits: dict) -> None:
    table = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC,
             "fsize": resource.RLIMIT_FSIZE, "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE}
    for name, value in limits.items():
        # CPU: a soft limit one second below the hard one so SIGXCPU arrives before SIGKILL.
        hard = value + 1 if name == "cpu" else value
        resource.setrlimit(table[name], (value, hard))


def _exec_command(spec: dict, inner: bool) -> None:
    """In X: lose every privilege, then become the command. Never returns."""
    if inner:
        os.setsid()  # own session; the pid namespace, not the group, bounds its lifetime
        _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(NO_NEW_PRIVS)")
        cap = 0
        while _prctl(PR_CAPBSET_DROP, cap) == 0:  # ends with EINVAL past the kernel's last cap
            cap += 1
        if spec["setgroups"]:
            os.setgroups([])
        os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)  # uid 0 -> 1000 clears all caps
    else:
        _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(NO_NEW_PRIVS)")
        if spec["host_uid"] is not None:
            os.setgroups([])
            os.setresgid(spec["host_gid"], spec["host_gid"], spec["host_gid"])
            os.setresuid(spec["host_uid"], spec["host_uid"], spec["host_uid"])
    _set_rlimits(spec["rlimits"])
    os.umask(0o022)
    os.chdir(spec["cwd"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def _wait_exit_code(pid: int, reap_all: bool) -> int:
    """Wait for `pid`; as pid 1, also reap orphans reparented to us meanwhile."""
    while True:
        got, status = os.wait() if reap_all else os.waitpid(pid, 0)
        if got == pid:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


def _fail(err: BaseException) -> None:
    os.write(2, f"cuttle-sandbox: setup failed: {err}\n".encode())
    os._exit(SETUP_FAILED)


def _run_init(spec: dict, root: str) -> None:
    """Body of I, pid 1 of the new pid namespace."""
    try:
        _die_with_parent(None)
        _prctl(PR_SET_DUMPABLE, 0)  # the command may not ptrace or read the memory of pid 1
        _enter_root(root)
        if spec["mode"] == "probe-host":
            os._exit(0)
        pid = os.fork()
    except BaseException as err:  # noqa: BLE001 - any failure must stop before the command runs
        _fail(err)
    if pid == 0:
        try:
            _exec_command(spec, inner=True)
        except BaseException as err:  # noqa: BLE001
            _fail(err)
    # Exiting makes the kernel SIGKILL every process left in the namespace: no leftovers.
    os._exit(_wait_exit_code(pid, reap_all=True))


def _run_creator(spec: dict, ready_w: int, go_r: int, parent: int) -> None:
    """Body of C: unshare, wait for L to write our id maps, build the root, start pid 1."""
    try:
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        _check(libc.unshare(flags), "unshare")
        _die_with_parent(parent)  # after unshare: the credential change there clears PDEATHSIG
        os.write(ready_w, b"1")
        if os.read(go_r, 1) != b"1":
            raise SetupError("uid/gid maps were not written")
        _prctl(PR_SET_DUMPABLE, 0)
        _check(libc.sethostname(b"sandbox", 7), "sethostname")
        _loopback_up()
        root = _probe_root(spec["staging"]) if spec["mode"] == "probe-host" else _build_root(spec)
        pid = os.fork()
    except BaseException as err:  # noqa: BLE001
        _fail(err)
    if pid == 0:
        _run_init(spec, root)
    os._exit(_wait_exit_code(pid, reap_all=False))


def _write_maps(pid: int, spec: dict) -> None:
    host_uid, host_gid = spec["host_uid"], spec["host_gid"]
    if os.geteuid() == 0:
        # Host root maps itself as the namespace's root (C needs it to reach root-only paths such as
        # a Python under /root while building the tree) and the unprivileged sandbox uid as 1000.
        uid_map, gid_map = f"0 0 1\n{SANDBOX_UID} {host_uid} 1\n", f"0 0 1\n{SANDBOX_UID} {host_gid} 1\n"
    else:
        with open(f"/proc/{pid}/setgroups", "w") as f:  # required before an unprivileged gid_map
            f.write("deny")
        uid_map, gid_map = f"{SANDBOX_UID} {os.geteuid()} 1\n", f"{SANDBOX_UID} {os.getegid()} 1\n"
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)


def _run_namespaces(spec: dict) -> int:
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        _run_creator(spec, ready_w, go_r, me)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) != b"1":  # C failed before unshare completed; its stderr says why
            return _wait_exit_code(pid, reap_all=False)
        _write_maps(pid, spec)
        os.write(go_w, b"1")
    except OSError as err:
        os.kill(pid, SIGKILL)
        _wait_exit_code(pid, reap_all=False)
        _fail(SetupError(f"writing uid/gid maps: {err}"))
    os.close(go_w)
    return _wait_exit_code(pid, reap_all=False)


def _kill_uid(uid: int) -> None:
    """rlimits-only cleanup: as `uid`, SIGKILL every process that uid owns (kill(-1) as a
    non-root user reaches exactly its own processes), catching anything that left the group."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.kill(-1, SIGKILL)


def _join_cgroups(spec: dict) -> None:
    """Enter the command's memory cgroup (cgroups.py made it) before forking anything, so every
    process of the command starts inside it; failing to is a setup failure, never a run without."""
    for path in spec.get("cgroup_procs", ()):
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        except OSError as err:
            raise SetupError(f"joining the command's cgroup {path}: {err}") from None


def main() -> None:
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    mode = spec["mode"]
    try:
        if mode in ("namespaces", "rlimits"):
            _join_cgroups(spec)
        if mode in ("namespaces", "probe-host"):
            os._exit(_run_namespaces(spec))
        if mode == "rlimits":
            _exec_command(spec, inner=False)
        if mode == "kill-uid":
            try:
                _kill_uid(spec["host_uid"])
            except ProcessLookupError:
                pass
            os._exit(0)
        raise SetupError(f"unknown mode {mode!r}")
    except BaseException as err:  # noqa: BLE001
        _fail(err)


if __name__ == "__main__":
    main()
