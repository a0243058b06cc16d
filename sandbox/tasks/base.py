"""A coding task and its reward: the workspace it starts from, the hidden tests that grade it.

Owns `Task` and `grade`: grading builds a *fresh* directory from the task's pristine files, carries
over only the agent's solution files (by glob), writes the hidden tests last, and runs them in a
new sandbox with a nonce the result line must echo. So an agent that edits, deletes or adds tests,
conftest files or pytest config in its workspace cannot change its reward, and one whose code ends
the process early (os._exit(0)) gets no result line, hence no reward. Code under test still runs
in the grading process: a solution that inspects its caller's memory is out of scope here.
Must never read the agent's workspace except through `Workspace` (no symlinks out), and never
grade inside the agent's own workspace.
"""
import fnmatch
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..errors import ToolError
from ..limits import Limits
from ..paths import Workspace
from ..sandbox import Sandbox
from ..testing import TestReport, parse_report
from ..workspace import bound_workspace, remove_tree, write_files

MAX_SOLUTION_FILE_BYTES = 1 << 20
MAX_SOLUTION_FILES = 1000  # files carried into grading, at most
MAX_SOLUTION_TOTAL_BYTES = 16 << 20  # and bytes in all


@dataclass(slots=True)
class Task:
    task_id: str
    prompt: str  # what the agent is told
    files: dict[str, str]  # the workspace at the start (relative path -> text)
    hidden_files: dict[str, str]  # grading-only files; never placed in a workspace
    solution_globs: tuple[str, ...]  # workspace files carried into grading; nothing else is
    grade_command: str  # run in the grading copy; stdin holds the nonce; prints the result line
    timeout: float = 30.0
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Reward:
    reward: float
    report: TestReport

    def to_dict(self) -> dict[str, Any]:
        r = self.report
        return {"reward": self.reward, "complete": r.complete, "timed_out": r.timed_out, "exit_code": r.exit_code,
                "passed": r.count("passed"), "failed": r.count("failed"), "errors": r.count("error"),
                "outcomes": r.outcomes}


def glob_matches(rel: str, glob: str) -> bool:
    """`glob` against a workspace path segment by segment: `*` never crosses a `/` (fnmatch's
    does, so `pkg/*.py` took `pkg/junk/x.py` and `pkg/mod.py/x.py` too: grading read any number
    of such files, and one under a task file's name turned into a directory crashed it)."""
    parts, pats = rel.split("/"), glob.split("/")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, pats))


def solution_files(task: Task, workspace: Workspace) -> dict[str, str]:
    """The agent's versions of the files the task lets it change (in path order, at most
    MAX_SOLUTION_FILES of them and MAX_SOLUTION_TOTAL_BYTES in all: grading holds them in memory)."""
    out: dict[str, str] = {}
    total = 0
    # no glob reaches below this many levels: the walk stops there (os.walk recurses per level on
    # 3.11, and a 1,500-level tree made grading fail)
    levels = max((len(g.split("/")) for g in task.solution_globs), default=0)
    for dirpath, dirnames, filenames in os.walk(workspace.root):  # never follows symlinked dirs
        depth = 0 if dirpath == workspace.root else os.path.relpath(dirpath, workspace.root).count(os.sep) + 1
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__")) if depth + 1 < levels else []
        for name in sorted(filenames):
            rel = workspace.relative(os.path.join(dirpath, name))
            if not any(glob_matches(rel, g) for g in task.solution_globs):
                continue
            if len(out) >= MAX_SOLUTION_FILES or total >= MAX_SOLUTION_TOTAL_BYTES:
                return out
            try:
                fd = workspace.open_read(rel)
            except ToolError:  # symlink out, special file, hard link: not a solution file
                continue
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_SOLUTION_FILE_BYTES + 1)
            if len(data) <= MAX_SOLUTION_FILE_BYTES:
                out[rel] = data.decode(errors="replace")
                total += len(data)
    return out


def grade(task: Task, workspace: Workspace, limits: Limits | None = None, scratch_dir: str | None = None) -> Reward:
    """Reward 1.0 when every hidden test passes in a fresh copy, else 0.0. The copy lives under
    `scratch_dir` (default: the system temp dir) and is removed afterwards."""
    fresh = tempfile.mkdtemp(prefix="cuttle-grade-", dir=scratch_dir)
    limits = limits or Limits(timeout=task.timeout)
    try:
        os.chmod(fresh, 0o755)
        if limits.workspace_mb is not None:  # the hidden tests run the agent's code: the same bound
            bound_workspace(fresh, limits.workspace_mb)
        write_files(fresh, task.files)
        write_files(fresh, solution_files(task, workspace))
        write_files(fresh, task.hidden_files)  # last: nothing the agent wrote survives under their names
        sb = Sandbox(fresh, limits=limits)
        nonce = secrets.token_hex(16)
        result = sb.run(task.grade_command, stdin=(nonce + "\n").encode(), keep_bytes=1 << 20)
        report = parse_report(result, nonce)
        return Reward(1.0 if report.all_passed else 0.0, report)
    finally:
        remove_tree(fresh)
