"""Coding tasks: HumanEval problems and seeded synthetic repositories, behind one `make_task`.

Owns the task spec format the environment server accepts:
  {"kind": "humaneval", "task_id": "HumanEval/0"} or {"kind": "synthetic", "seed": 7}.
Must never hand out a task whose hidden files are reachable from its workspace.
"""
from typing import Any

from .base import Reward, Task, grade
from .humaneval import humaneval_task
from .synthetic import synthetic_task


def make_task(spec: dict[str, Any]) -> Task:
    kind = spec.get("kind")
    if kind == "humaneval":
        return humaneval_task(str(spec.get("task_id", "HumanEval/0")))
    if kind == "synthetic":
        seed = spec.get("seed", 0)
        if not isinstance(seed, int):
            raise ValueError("synthetic task: seed must be an integer")
        return synthetic_task(seed)
    raise ValueError(f"unknown task kind {kind!r}; expected 'humaneval' or 'synthetic'")


__all__ = ["Reward", "Task", "grade", "humaneval_task", "make_task", "synthetic_task"]
