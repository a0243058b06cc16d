"""Workspace directories on the host: materialise, bound, copy, hand over to the sandbox uid, remove.

Owns creating a task's files in a directory, giving a workspace a filesystem of its own
(`Limits.workspace_mb`: a tmpfs of that size, so a command writing there stops at "No space left
on device" instead of filling the host's disk; root only), copying trees (copy-on-write clones
where the filesystem supports them, never hardlinks: a sandboxed `echo >> file` would write
through a hardlink into the pristine source) and removing trees the sandbox made unfriendly
(chmod 000), their bounded filesystems unmounted first.
Must never follow a symlink while copying or removing, and never touch a path outside the tree.
"""
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import subprocess
import sys

from .errors import SandboxUnavailable

FICLONE = 0x40049409  # ioctl: share extents copy-on-write (btrfs, xfs, bcachefs)
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
INODES_PER_MIB = 256  # a bounded workspace's file count: 256 per MiB (64 Ki files in 256 MiB), at least 4096
_libc = ctypes.CDLL(None, use_errno=True)


def bound_workspace(path: str, limit_mb: int) -> None:
    """Mount a tmpfs of `limit_mb` MiB (and `INODES_PER_MIB` inodes a MiB) on the empty directory
    `path`: the workspace then has a filesystem of its own, whose bytes and files are bounded
    (RAM-backed: its pages are memory, swappable where the host swaps). Needs root (a mount in
    the host's namespace, where the host-side tools read the workspace); refused otherwise."""
    if any(os.scandir(path)):
        raise ValueError(f"bound_workspace: {path} is not empty (a mount would hide its files)")
    opts = f"size={limit_mb}m,nr_inodes={max(4096, limit_mb * INODES_PER_MIB)},mode=0755"
    if _libc.mount(b"cuttle-workspace", os.fsencode(path), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), opts.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxUnavailable(f"workspace_mb={limit_mb}: mounting the workspace's own {limit_mb} MiB filesystem on {path} "
                                 f"failed: {os.strerror(err)} (errno {err}); it needs root")


def workspace_bound_error(root: str, limit_mb: int) -> str | None:
    """Why `root` is not a workspace bounded at `limit_mb` MiB (None when it is): it must be the
    root of a filesystem of its own (`bound_workspace`, or any mount the caller made) no larger."""
    if not os.path.ismount(root):
        return f"{root} is not a filesystem of its own (cuttle.sandbox.workspace.bound_workspace mounts one)"
    st = os.statvfs(root)
    size_mb = st.f_blocks * st.f_frsize / (1 << 20)
    if size_mb > limit_mb:
        return f"{root}'s filesystem holds {size_mb:.0f} MiB, more than {limit_mb}"
    return None


def _mounts_at_or_below(root: str) -> list[str]:
    # the parents resolved as the kernel lists them; `root` itself never followed if a symlink
    root = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(root))), os.path.basename(os.path.abspath(root)))
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        fields = line.split(" ", 5)
        if len(fields) > 4:
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            if point == root or point.startswith(root.rstrip("/") + "/"):
                points.append(point)
    return sorted(set(points), key=len, reverse=True)  # the deepest first


def _unmount_below(root: str) -> None:
    """Detach every mount at or below `root` (a bounded workspace) so the tree can be removed."""
    for point in _mounts_at_or_below(root):
        if _libc.umount2(os.fsencode(point), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):  # already gone
                raise OSError(err, f"unmounting {point}: {os.strerror(err)}")


def _clone_or_copy(src: str, dst: str) -> None:
    with open(src, "rb") as fsrc, open(dst, "wb") as fdst:
        try:
            fcntl.ioctl(fdst.fileno(), FICLONE, fsrc.fileno())
        except OSError:  # not supported here (ext4, tmpfs): a real copy, in-kernel
            shutil.copyfileobj(fsrc, fdst, 1 << 20)
    shutil.copymode(src, dst)


def copy_tree(src: str, dst: str) -> None:
    """Copy `src` to the new directory `dst`, symlinks kept as symlinks, specials skipped."""
    os.makedirs(dst, exist_ok=True)
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir(follow_symlinks=False):
            copy_tree(entry.path, target)
        elif entry.is_file(follow_symlinks=False):
            _clone_or_copy(entry.path, target)


def write_files(root: str, files: dict[str, str]) -> None:
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)


def chown_tree(root: str, uid: int, gid: int) -> None:
    """Give the tree to the sandbox uid (only meaningful when we are root)."""
    if os.geteuid() != 0:
        return
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def remove_tree(root: str) -> None:
    """rmtree that also handles directories the sandbox made unreadable or unwritable; bounded
    workspaces (mounts) at or below `root` are detached first."""

    def fix(func, path, _exc) -> None:  # shutil's callback: (function, path, error)
        parent = os.path.dirname(path)
        for p in (parent, path):
            try:
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode):
                    os.chmod(p, 0o700)
            except OSError:
                pass
        func(path)

    if not os.path.lexists(root):
        return
    _unmount_below(root)
    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(root, onexc=fix)
        else:  # 3.10/3.11 only know onerror (deprecated from 3.12 on)
            shutil.rmtree(root, onerror=fix)
    except RecursionError:
        # a tree deeper than Python's recursion limit (a sandboxed `mkdir -p` of 1,500 levels):
        # shutil.rmtree recurses per level on 3.11; coreutils' rm walks it iteratively and never
        # follows a symlink
        subprocess.run(["rm", "-rf", "--one-file-system", "--", root], check=False, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        if os.path.lexists(root):
            raise OSError(f"could not remove {root!r} (a tree deeper than Python's recursion limit)") from None


def clear_dir(root: str) -> None:
    """Empty `root` but keep the directory itself (its inode is bind-mounted by running sandboxes)."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            remove_tree(entry.path)
        else:
            os.unlink(entry.path)
