"""A reward that runs the sample's code against hidden tests in the sandbox (`cuttle.sandbox`).

Owns mapping a completion onto a task's workspace: the group's metadata holds a task spec
(`{"kind": "humaneval", "task_id": ...}`), the sample's text completes the task's single solution
file, and `cuttle.sandbox.tasks.grade` grades a fresh copy with the hidden tests. Must never run
model output outside a `Sandbox`, and never let a sample see the hidden tests.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from cuttle.rl.types import Group, Sample
from cuttle.sandbox import Limits, Sandbox
from cuttle.sandbox.tasks import Task, grade, make_task
from cuttle.sandbox.workspace import remove_tree, write_files


class SandboxCodeReward:
    """`RewardFn`: 1.0 when the completed solution file passes every hidden test, else 0.0.

    The prompt is expected to be the solution file's starting text (a HumanEval prompt), so the
    file graded is that text followed by the sample's completion.
    """

    def __init__(self, allow_unisolated: bool = False, limits: Limits | None = None):
        """`limits`: the grading sandbox's (memory bounds, workspace size...), each task's own time
        limit applied; default: `Limits()` with it."""
        self.allow_unisolated = allow_unisolated
        self.limits = limits
        self._tasks: dict[str, Task] = {}

    def task(self, spec: dict[str, Any]) -> Task:
        key = repr(sorted(spec.items()))
        if key not in self._tasks:
            self._tasks[key] = make_task(spec)
        return self._tasks[key]

    def __call__(self, group: Group, sample: Sample) -> float:
        task = self.task(group.metadata["task"])
        if len(task.files) != 1:
            raise ValueError(f"task {task.task_id} has {len(task.files)} files; completion rewards need exactly one")
        (name, start), = task.files.items()
        root = tempfile.mkdtemp(prefix="cuttle-rl-")
        try:
            os.chmod(root, 0o755)
            workspace = os.path.join(root, "workspace")
            os.mkdir(workspace)
            write_files(workspace, {name: start + sample.text})
            limits = dataclasses.replace(self.limits or Limits(), timeout=task.timeout)
            # this workspace only carries the completion into grade's fresh copy (bounded there
            # where workspace_mb is set), and nothing runs in it
            sandbox = Sandbox(workspace, limits=dataclasses.replace(limits, workspace_mb=None),
                              allow_unisolated=self.allow_unisolated)
            return grade(task, sandbox.workspace, limits).reward
        finally:
            remove_tree(root)
