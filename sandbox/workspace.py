"""Workspace directories on the host: materialise, copy, hand over to the sandbox uid, remove.

Owns creating a task's files in a directory, copying trees (copy-on-write clones where the
filesystem supports them, never hardlinks: a sandboxed `echo >> file` would write through a
hardlink into the pristine source) and removing trees the sandbox made unfriendly (chmod 000).
Must never follow a symlink while copying or removing, and never touch a path outside the tree.
"""
import fcntl
import os
import shutil
import stat
import subprocess
import sys

FICLONE = 0x40049409  # ioctl: share extents copy-on-write (btrfs, xfs, bcachefs)


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
    """rmtree that also handles directories the sandbox made unreadable or unwritable."""

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
