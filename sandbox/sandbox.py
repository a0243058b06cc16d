"""`Sandbox`: one workspace directory plus the means to run commands and tools against it.

Owns the isolation decision for a workspace (namespaces, or rlimits-only on explicit opt-in),
handing the workspace to its unprivileged uid, and the `run` / `run_tests` / `call_tool` entry
points. Must never run a command without the isolation it reports, and never accept a path or a
test selection that escapes the workspace.
"""
import logging
import os
import shlex
import subprocess
from typing import Any

from . import cgroups, isolation
from .errors import SandboxError, SandboxUnavailable, ToolError
from .isolation import NAMESPACES, RLIMITS_ONLY
from .limits import Limits
from .paths import Workspace
from .runner import RunResult, execute
from .testing import TestReport, parse_report, pytest_command
from .tools import call_tool
from .workspace import chown_tree, workspace_bound_error

log = logging.getLogger(__name__)
MAX_COMMAND_BYTES = 100_000  # one argv string on Linux may be 128 KiB; keep clear of it


class Sandbox:
    def __init__(
        self,
        workspace_dir: str | os.PathLike[str],
        timeout: float = 30.0,
        memory_mb: int = 1024,
        allow_unisolated: bool = False,
        *,
        limits: Limits | None = None,
        extra_read_only: tuple[str, ...] = (),
    ) -> None:
        root = os.path.realpath(workspace_dir)
        if not os.path.isdir(root):
            raise SandboxError(f"workspace {workspace_dir} is not a directory")
        self.limits = limits if limits is not None else Limits(timeout=timeout, memory_mb=memory_mb)
        self.extra_read_only = extra_read_only
        error = isolation.namespace_error()
        if error is None:
            self.isolation = NAMESPACES
        elif (host_error := isolation.host_namespace_error()) is None:
            # The host does not refuse namespaces, so the failure is ours (a bug, or a layout we
            # refuse such as a Python prefix at /tmp): falling back to rlimits-only would hide it.
            raise SandboxError(f"sandbox setup failed, and not because this host refuses namespaces: {error}")
        elif allow_unisolated:
            self.isolation = RLIMITS_ONLY
            log.warning("namespaces unavailable (%s): running %s in rlimits-only mode", host_error, root)
        else:
            raise SandboxUnavailable(
                f"namespace isolation is unavailable on this machine: {host_error}. Refusing to run commands "
                "without it; pass allow_unisolated=True to accept an rlimits-only sandbox "
                "(no filesystem, network or process isolation)."
            )
        if self.limits.total_memory_mb is not None and (why := cgroups.support_error()) is not None:
            raise SandboxUnavailable(f"total_memory_mb={self.limits.total_memory_mb} needs a memory cgroup per command, and "
                                     f"this process cannot make one: {why}. Refusing to run commands without the bound.")
        if self.limits.workspace_mb is not None and (why := workspace_bound_error(root, self.limits.workspace_mb)):
            raise SandboxError(f"workspace_mb={self.limits.workspace_mb}: {why}")
        uid, gid = isolation.sandbox_ids(root)
        self.workspace = Workspace(root, uid, gid)
        chown_tree(root, uid, gid)
        os.chmod(root, 0o755)

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None,
            keep_bytes: int | None = None) -> RunResult:
        """Run `command` with /bin/sh in the workspace; the whole sandbox dies at the timeout."""
        if len(command.encode()) > MAX_COMMAND_BYTES:
            raise ToolError(f"command too long ({len(command.encode())} bytes; limit {MAX_COMMAND_BYTES})")
        limit = self.limits.timeout if timeout is None else min(float(timeout), self.limits.timeout)
        mode = "namespaces" if self.isolation == NAMESPACES else "rlimits"
        spec = isolation.build_spec(mode, ["/bin/sh", "-c", command], self.workspace.root, self.limits,
                                    limit, self.extra_read_only)
        cgroup = None
        if self.limits.total_memory_mb is not None:
            try:
                cgroup = cgroups.create(self.limits.total_memory_mb << 20)
            except OSError as err:
                raise SandboxError(f"could not make the command's memory cgroup: {err}") from None
            spec["cgroup_procs"] = [cgroup.procs_file]
        try:
            result = execute(
                isolation.launcher_argv(spec), isolation.launcher_env(), limit, self.isolation,
                keep_bytes if keep_bytes is not None else self.limits.output_bytes, self.limits.max_output_bytes,
                stdin=stdin, after_exit=self._kill_escapees if self.isolation == RLIMITS_ONLY else None,
            )
        finally:
            report = self._close_cgroup(cgroup) if cgroup is not None else None
        if report is not None:
            result.memory_limit_exceeded = report.oom_kills > 0
            result.peak_memory_mb = None if report.peak_bytes is None else report.peak_bytes / (1 << 20)
        if result.exit_code == isolation.SETUP_FAILED and isolation.SETUP_MARKER in result.stderr:
            raise SandboxError(result.stderr.strip())
        return result

    @staticmethod
    def _close_cgroup(cgroup: cgroups.CommandCgroup) -> cgroups.CgroupReport | None:
        try:
            return cgroup.close()
        except OSError as err:  # its processes were killed; a directory left behind is logged, not fatal
            log.error("could not remove the command's memory cgroup %s: %s", cgroup.path, err)
            return None

    def _kill_escapees(self) -> None:
        """rlimits-only: processes that left the process group (setsid) are found by uid instead.
        Only possible as root, where the sandbox has a uid of its own; otherwise documented."""
        if os.geteuid() != 0:
            return
        spec = {"mode": "kill-uid", "host_uid": self.workspace.uid}
        subprocess.run(isolation.launcher_argv(spec), env=isolation.launcher_env(), timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    def run_tests(self, selection: str | None = None, timeout: float | None = None,
                  nonce: str | None = None) -> TestReport:
        """pytest on the workspace (or on `selection`: paths / node ids, never options)."""
        try:
            args = shlex.split(selection or "")
        except ValueError as e:  # an unbalanced quote: the model's mistake, a tool error (was a host exception)
            raise ToolError(f"run_tests: selection does not parse as shell words: {e}") from None
        for arg in args:
            if arg.startswith("-"):
                raise ToolError(f"run_tests: {arg!r} looks like an option; selection holds test paths or node ids")
            self.workspace.resolve(arg.split("::", 1)[0])
        command = pytest_command(args, with_nonce=nonce is not None)
        stdin = (nonce + "\n").encode() if nonce is not None else None
        result = self.run(command, timeout=timeout, stdin=stdin, keep_bytes=1 << 20)
        return parse_report(result, nonce if nonce is not None else "-")

    def call_tool(self, name: str, **arguments: Any) -> str:
        """Run one tool; its text result, or ToolError with a message meant for the agent."""
        return call_tool(self, name, arguments)
