"""Agent environments for rollouts: a coding task in its own sandboxed workspace.

Owns the contract the agent loop talks to (`AgentEnvironment`: the task's prompt, `call` a tool,
`reward`, `close`) and its in-process implementation over `cuttle.sandbox` (`SandboxEnvironment`):
the task's files written into a fresh directory, the product's tools run against it through
`Sandbox.call_tool`, and the reward from `cuttle.sandbox.tasks.grade`, which runs the hidden tests
in a fresh copy of the final workspace (the agent's own workspace is never graded and never sees
the hidden files). Must never let an exception other than a tool error reach the model, and never
leave a workspace behind after `close`.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any, Protocol

from cuttle.sandbox import Limits, Sandbox, ToolError
from cuttle.sandbox.tasks import Task, grade, make_task
from cuttle.sandbox.workspace import bound_workspace, remove_tree, write_files


class AgentEnvironment(Protocol):
    task_id: str
    prompt: str  # the task as the agent is told it

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        """(ok, text): the tool's output, or the error message meant for the agent."""
        ...

    def reward(self) -> tuple[float, dict[str, Any]]: ...

    def close(self) -> None: ...


# a task spec (`{"kind": "synthetic", "seed": 3}`, `{"kind": "humaneval", "task_id": ...}`) -> environment
EnvFactory = Callable[[dict[str, Any]], AgentEnvironment]


class SandboxEnvironment:
    def __init__(self, spec: dict[str, Any] | Task, limits: Limits | None = None, allow_unisolated: bool = False):
        self.task = spec if isinstance(spec, Task) else make_task(spec)
        self.task_id, self.prompt = self.task.task_id, self.task.prompt
        self._lock = threading.Lock()
        self.root = tempfile.mkdtemp(prefix="cuttle-agent-")
        try:
            os.chmod(self.root, 0o755)
            workspace = os.path.join(self.root, "workspace")
            os.mkdir(workspace)
            limits = limits or Limits(timeout=self.task.timeout)
            if limits.workspace_mb is not None:
                bound_workspace(workspace, limits.workspace_mb)
            write_files(workspace, self.task.files)
            self.sandbox = Sandbox(workspace, limits=limits, allow_unisolated=allow_unisolated)
        except BaseException:
            remove_tree(self.root)
            raise

    # One call at a time per environment (the agent loop runs a turn's tool calls concurrently):
    # the host-side file tools, grading and the final rmtree run as root on paths in the
    # workspace, so a sandboxed `run` changing the workspace at the same moment (swapping a
    # directory for a symlink) made them read, create or delete outside it. A `run`'s processes
    # are all dead when it returns, so under the lock nothing inside changes the workspace.
    # close() waits for a running command (bounded by its timeout).

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        with self._lock:
            try:
                return True, self.sandbox.call_tool(name, **arguments)
            except ToolError as err:
                return False, str(err)

    def reward(self) -> tuple[float, dict[str, Any]]:
        with self._lock:
            # the hidden tests run the agent's code too: under this sandbox's limits, the task's time limit
            r = grade(self.task, self.sandbox.workspace, dataclasses.replace(self.sandbox.limits, timeout=self.task.timeout))
        return r.reward, r.to_dict()

    def close(self) -> None:
        with self._lock:
            remove_tree(self.root)


def sandbox_factory(limits: Limits | None = None, allow_unisolated: bool = False) -> EnvFactory:
    return lambda spec: SandboxEnvironment(spec, limits, allow_unisolated)
