"""Workspace path confinement: every path an agent names goes through `Workspace`.

Owns resolving agent paths (relative, or under /workspace) to host paths inside the workspace,
and opening them so that what we read or write is provably inside it: each opened fd is checked
again through /proc/self/fd, which defeats a symlink swapped in after the check. Tools run as the
host user (root here), so this module must never open a path it has not resolved and verified,
never follow a symlink out of the workspace, and never write through a file with other hard links.
"""
import errno
import os
import stat
from pathlib import PurePosixPath

from .errors import ToolError
from .isolation import WORKSPACE_MOUNT


class Workspace:
    def __init__(self, root: str, uid: int, gid: int) -> None:
        self.root = os.path.realpath(root)
        self.uid, self.gid = uid, gid  # owner of everything the agent may change

    def resolve(self, path: str) -> str:
        """Host path of `path`, refusing anything that would leave the workspace."""
        if not isinstance(path, str) or "\x00" in path:
            raise ToolError("path must be a string without NUL bytes")
        rel = path or "."
        if rel.startswith("/"):
            if rel == WORKSPACE_MOUNT or rel.startswith(WORKSPACE_MOUNT + "/"):
                rel = rel[len(WORKSPACE_MOUNT) :].lstrip("/") or "."
            elif rel == self.root or rel.startswith(self.root + "/"):
                rel = rel[len(self.root) :].lstrip("/") or "."
            else:
                raise ToolError(
                    f"{path}: absolute path outside the workspace is not allowed; "
                    "use a path relative to the workspace root"
                )
        if ".." in PurePosixPath(rel).parts:
            raise ToolError(f"{path}: '..' is not allowed; paths must stay inside the workspace")
        real = os.path.realpath(os.path.join(self.root, rel))
        if not self.contains(real):
            raise ToolError(f"{path}: a symlink on this path points outside the workspace; refused")
        return real

    def contains(self, host_path: str) -> bool:
        return host_path == self.root or host_path.startswith(self.root + "/")

    def relative(self, host_path: str) -> str:
        return os.path.relpath(host_path, self.root)

    # The checks below raise with the fd still open; callers close it (closing here and again in a
    # caller would close a number another thread may have reused meanwhile).
    def _verify_fd(self, fd: int, path: str) -> None:
        if not self.contains(os.readlink(f"/proc/self/fd/{fd}")):
            raise ToolError(f"{path}: resolves outside the workspace; refused")

    def _check_regular(self, fd: int, path: str) -> os.stat_result:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{path}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{path}: not a regular file")
        if st.st_nlink > 1:
            raise ToolError(f"{path}: has {st.st_nlink} hard links and may alias a file outside; refused")
        return st

    def open_dir(self, path: str) -> int:
        real = self.resolve(path)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ToolError(f"{path}: no such directory") from None
        except NotADirectoryError:
            raise ToolError(f"{path}: not a directory") from None
        except OSError as err:
            raise ToolError(f"{path}: {err.strerror}") from None
        try:
            self._verify_fd(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_read(self, path: str) -> int:
        """An fd for reading a regular file inside the workspace."""
        real = self.resolve(path)
        try:
            # O_NONBLOCK: a FIFO planted by the agent must not hang the host process.
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ToolError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise ToolError(f"{path}: is a directory") from None
        except OSError as err:
            raise ToolError(f"{path}: {err.strerror}") from None
        try:
            self._verify_fd(fd, path)
            self._check_regular(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_write(self, path: str, create_dirs: bool = False) -> int:
        """An fd for writing (truncated) a regular file inside the workspace, owned by its owner."""
        real = self.resolve(path)
        if real == self.root:
            raise ToolError(f"{path}: is the workspace directory, not a file")
        parent, name = os.path.split(real)
        if create_dirs:
            self._makedirs(parent, path)
        try:
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ToolError(f"{path}: parent directory does not exist") from None
        except OSError as err:
            raise ToolError(f"{path}: {err.strerror}") from None
        try:
            self._verify_fd(dfd, path)
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=dfd)
        except IsADirectoryError:
            raise ToolError(f"{path}: is a directory") from None
        except OSError as err:
            if err.errno == errno.ENXIO:  # a FIFO without a reader (O_NONBLOCK kept us from waiting)
                raise ToolError(f"{path}: not a regular file") from None
            raise ToolError(f"{path}: {err.strerror}") from None
        finally:
            os.close(dfd)
        try:
            st = self._check_regular(fd, path)
            os.ftruncate(fd, 0)  # only after the checks: never truncate through a hard link
            if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (self.uid, self.gid):
                os.fchown(fd, self.uid, self.gid)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _makedirs(self, host_dir: str, path: str) -> None:
        missing = []
        d = host_dir
        while not os.path.lexists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            if not self.contains(d):
                raise ToolError(f"{path}: outside the workspace; refused")
            os.mkdir(d, 0o755)
            if os.geteuid() == 0:
                os.lchown(d, self.uid, self.gid)
        if not os.path.isdir(host_dir):
            raise ToolError(f"{path}: a parent is not a directory")
