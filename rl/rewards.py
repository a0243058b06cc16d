"""Pluggable rewards: a reward function scores one sample of a group; `assign_rewards` runs it.

Owns the `RewardFn` contract and the verifiable, sandbox-free rewards (pure functions of the
sample's text and the group's metadata). Code that must be *executed* is graded by
`cuttle.rl.code_reward` in the sandbox, never here: nothing in this module runs model output.
"""
from __future__ import annotations

import ast
from typing import Protocol

from cuttle.rl.types import Group, Sample


class RewardFn(Protocol):
    def __call__(self, group: Group, sample: Sample) -> float: ...


def assign_rewards(groups: list[Group], reward_fn: RewardFn) -> None:
    for g in groups:
        for s in g.samples:
            s.reward = float(reward_fn(g, s))


def function_body(completion: str, finished: bool, starts_line: bool = False) -> str:
    """The part of a completion that belongs to the function body being written: up to the first
    line that starts at column 0 (the next top-level statement). `starts_line`: the prompt ended
    with a newline, so the completion's first line is a line of its own. When the sample was cut
    by the length limit and never reached such a line, its last (unfinished) line is dropped."""
    lines = completion.split("\n")
    for i, line in enumerate(lines):
        if (i > 0 or starts_line) and line and not line[0].isspace():
            return "\n".join(lines[:i])
    return completion if finished else "\n".join(lines[:-1])


def _longest_parsable(prefix: str, body: str) -> ast.Module | None:
    """prefix + the most lines of `body` that parse (the body up to its first syntax error)."""
    lines = body.split("\n")
    for k in range(len(lines), 0, -1):
        try:
            return ast.parse(prefix + "\n".join(lines[:k]))
        except SyntaxError:
            continue
    return None


def python_function_reward(group: Group, sample: Sample) -> float:
    """Verifiable reward for "complete this function" prompts: the prompt must end inside a
    function header or body (`group.metadata["prefix"]` holds its text).

    The body is the completion cut at the next top-level line, then at its first line that does
    not parse (so a small model's trailing noise does not hide a good start). 0.5 when that body
    gives the function a statement of its own, plus 0.5 when the function returns a value
    (`return <expr>` at any depth).
    """
    prefix = group.metadata["prefix"]
    body = function_body(sample.text, sample.finish_reason == "stop", prefix.endswith("\n"))
    tree = _longest_parsable(prefix, body)
    if tree is None:
        return 0.0
    funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not funcs:
        return 0.0
    fn = funcs[-1]  # the prompt ends inside the function it opened: the last top-level one
    stmts = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not stmts:
        return 0.0
    returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))
    return 0.5 + (0.5 if returns else 0.0)
