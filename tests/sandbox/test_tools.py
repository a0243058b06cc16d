"""The agent's tools: schemas, argument checking, and each tool's behaviour and errors."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cuttle.sandbox import TOOLS, Sandbox, ToolError, tool_schemas
from cuttle.sandbox.file_tools import ripgrep, search

from .conftest import needs_namespaces

NAMES = ["read_file", "list_dir", "search", "edit_file", "write_file", "lint", "run", "run_tests"]


def test_schemas_are_openai_tools_format() -> None:
    schemas = tool_schemas()
    assert [s["function"]["name"] for s in schemas] == NAMES
    json.dumps(schemas)  # serialisable as a request body
    for s in schemas:
        assert s["type"] == "function"
        fn = s["function"]
        assert fn["description"] and fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])
        assert fn["parameters"]["additionalProperties"] is False
    assert TOOLS["edit_file"].parameters["required"] == ["path", "old_str", "new_str"]


@pytest.fixture
def repo(sb: Sandbox, ws: Path) -> Sandbox:
    (ws / "pkg").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "core.py").write_text("def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    (ws / "tests").mkdir()
    (ws / "tests" / "test_core.py").write_text(
        "from pkg.core import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul():\n    assert mul(2, 3) == 6\n")
    (ws / "notes.md").write_text("\n".join(f"line {i}" for i in range(1, 3001)) + "\n")
    return sb


def test_arguments_are_checked_against_the_schema(repo: Sandbox) -> None:
    with pytest.raises(ToolError, match="unknown tool 'rm'"):
        repo.call_tool("rm", path="x")
    with pytest.raises(ToolError, match="missing required argument.*path"):
        repo.call_tool("read_file")
    with pytest.raises(ToolError, match="unknown argument.*fiel"):
        repo.call_tool("read_file", path="notes.md", fiel=1)
    with pytest.raises(ToolError, match="start_line must be of type integer"):
        repo.call_tool("read_file", path="notes.md", start_line="3")
    with pytest.raises(ToolError, match="depth must be >= 1"):
        repo.call_tool("list_dir", depth=0)
    assert repo.call_tool("read_file", path="notes.md", start_line=2, end_line=None).startswith("     2\tline 2")
    # what a model can write that used to raise inside the host call (a 500 on the env server):
    # NaN (Python's JSON reads it), huge integers, lone UTF-16 surrogates, an unbalanced quote
    bad = [("run", {"command": "true", "timeout": float("nan")}, "finite"), ("run", {"command": "true", "timeout": 10**400}, "out of range"),
           ("read_file", {"path": "notes.md", "start_line": 10**400}, "out of range"),
           ("write_file", {"path": "a\udcff.py", "content": "x"}, "surrogate"), ("write_file", {"path": "ok.py", "content": "\ud800"}, "surrogate"),
           ("search", {"pattern": "a", "glob": "\ud800"}, "surrogate"), ("run", {"command": "echo \ud800"}, "surrogate"),
           ("run_tests", {"selection": "tests/test_a.py 'unbalanced"}, "does not parse")]
    for name, args, says in bad:
        with pytest.raises(ToolError, match=says):
            repo.call_tool(name, **args)


def test_read_file_numbers_lines_and_pages(repo: Sandbox) -> None:
    out = repo.call_tool("read_file", path="pkg/core.py", start_line=2, end_line=2)
    assert out == "     2\t    return a - b"
    out = repo.call_tool("read_file", path="notes.md")
    assert out.splitlines()[0] == "     1\tline 1" and "showing lines 1-2000 of 3000" in out
    assert "  2001\tline 2001" in repo.call_tool("read_file", path="notes.md", start_line=2001)
    with pytest.raises(ToolError, match="no such file"):
        repo.call_tool("read_file", path="missing.py")
    with pytest.raises(ToolError, match="is a directory"):
        repo.call_tool("read_file", path="pkg")
    with pytest.raises(ToolError, match="past the end"):
        repo.call_tool("read_file", path="pkg/core.py", start_line=50)


def test_read_file_refuses_binary(repo: Sandbox, ws: Path) -> None:
    (ws / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ToolError, match="binary file"):
        repo.call_tool("read_file", path="blob.bin")


def test_list_dir_depth_and_skips(repo: Sandbox, ws: Path) -> None:
    (ws / ".git" / "objects").mkdir(parents=True)
    assert repo.call_tool("list_dir", depth=1).splitlines() == [".git/", "notes.md", "pkg/", "tests/"]
    out = repo.call_tool("list_dir").splitlines()
    assert "pkg/core.py" in out and "tests/test_core.py" in out and ".git/objects/" not in out
    assert repo.call_tool("list_dir", path="pkg").splitlines() == ["__init__.py", "core.py"]
    with pytest.raises(ToolError, match="not a directory"):
        repo.call_tool("list_dir", path="notes.md")


@pytest.mark.parametrize("backend", ["python", "ripgrep"])
def test_search_regex_glob_and_errors(repo: Sandbox, backend: str) -> None:
    if backend == "ripgrep" and ripgrep() is None:
        pytest.skip("ripgrep not installed (neither on PATH nor beside the interpreter)")
    ws = repo.workspace
    assert search(ws, r"def \w+\(a, b\)", backend=backend).splitlines() == [
        "pkg/core.py:1:def add(a, b):", "pkg/core.py:5:def mul(a, b):"]
    assert search(ws, "add", glob="test_*.py", backend=backend).splitlines() == [
        "tests/test_core.py:1:from pkg.core import add, mul", "tests/test_core.py:4:def test_add():",
        "tests/test_core.py:5:    assert add(2, 3) == 5"]
    assert search(ws, "return", path="pkg/core.py", backend=backend).count("\n") == 1
    assert search(ws, "nothing-like-this", backend=backend) == "no matches"
    assert "more than 200 matches" in search(ws, "line", backend=backend)
    with pytest.raises(ToolError):
        search(ws, "(unclosed", backend=backend)


def test_search_tool_uses_the_installed_backend(repo: Sandbox) -> None:
    assert repo.call_tool("search", pattern="a \\* b") == "pkg/core.py:6:    return a * b"


def test_edit_file_exact_unique_match(repo: Sandbox, ws: Path) -> None:
    out = repo.call_tool("edit_file", path="pkg/core.py", old_str="return a - b", new_str="return a + b")
    assert out.startswith("edited pkg/core.py") and "return a + b" in out
    assert (ws / "pkg/core.py").read_text().startswith("def add(a, b):\n    return a + b\n")
    with pytest.raises(ToolError, match="old_str not found"):
        repo.call_tool("edit_file", path="pkg/core.py", old_str="return a - b", new_str="x")
    with pytest.raises(ToolError, match=r"occurs 2 times \(lines 1, 5\)"):
        repo.call_tool("edit_file", path="pkg/core.py", old_str="(a, b):", new_str="(a, b, c):")
    with pytest.raises(ToolError, match="must not be empty"):
        repo.call_tool("edit_file", path="pkg/core.py", old_str="", new_str="x")


def test_write_file_creates_parents_owned_by_the_sandbox(repo: Sandbox, ws: Path) -> None:
    assert repo.call_tool("write_file", path="new/dir/mod.py", content="X = 1\n") == "wrote 6 bytes to new/dir/mod.py"
    assert (ws / "new/dir/mod.py").read_text() == "X = 1\n"
    for p in ("new", "new/dir", "new/dir/mod.py"):
        assert os.stat(ws / p).st_uid == repo.workspace.uid
    r = repo.run("echo more >> new/dir/mod.py && cat new/dir/mod.py")  # the sandbox may change it
    assert r.stdout == "X = 1\nmore\n"
    with pytest.raises(ToolError, match="is a directory"):
        repo.call_tool("write_file", path="pkg", content="x")


@needs_namespaces
def test_lint_reports_ruff_diagnostics(repo: Sandbox, ws: Path) -> None:
    if shutil.which("ruff", path=f"{os.path.dirname(os.sys.executable)}:{os.environ.get('PATH', '')}") is None:
        pytest.skip("ruff not installed")
    (ws / "bad.py").write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    out = repo.call_tool("lint", path="bad.py")
    assert "bad.py:1:8: F401" in out and "bad.py:5:12: F821" in out
    assert repo.call_tool("lint", path="pkg/core.py") == "no lint errors"


def test_run_tool_formats_the_result(repo: Sandbox) -> None:
    out = repo.call_tool("run", command="echo hi; echo oops >&2; exit 3")
    assert out == "exit code: 3\nstdout:\nhi\nstderr:\noops"
    out = repo.call_tool("run", command="sleep 5", timeout=0.5)
    assert out.startswith("exit code: 137\nnote: timed out after")
    with pytest.raises(ToolError, match="timeout must be positive"):
        repo.call_tool("run", command="true", timeout=0)


def test_run_tests_reports_each_test(repo: Sandbox, ws: Path) -> None:
    out = repo.call_tool("run_tests")
    assert out.startswith("pytest exit code 1: 1 passed, 1 failed, 0 errors, 0 skipped")
    assert "FAILED tests/test_core.py::test_add" in out and "PASSED tests/test_core.py::test_mul" in out
    assert "assert -1 == 5" in out  # the failure's detail is shown
    report = repo.run_tests("tests/test_core.py::test_mul")
    assert report.outcomes == {"tests/test_core.py::test_mul": "passed"} and report.all_passed
    (ws / "tests" / "test_broken.py").write_text("import nonexistent_module\n")
    report = repo.run_tests()
    assert report.outcomes["tests/test_broken.py"] == "error" and not report.all_passed


def test_run_tests_selection_is_paths_only(repo: Sandbox) -> None:
    with pytest.raises(ToolError, match="looks like an option"):
        repo.call_tool("run_tests", selection="--rootdir=/ tests")
    with pytest.raises(ToolError, match=r"'\.\.' is not allowed"):
        repo.call_tool("run_tests", selection="../elsewhere/test_x.py")


def test_search_reads_ripgrep_output_only_up_to_the_cap(tmp_path: Path) -> None:
    """ripgrep's whole output was buffered in the host before the 200-match cap: 40 files of 1 MB
    of one-character lines added 2.4 GB of peak RSS. Now it is read line by line and stopped at the cap (peak RSS
    of a fresh interpreter doing one such search, 8 MB of matching lines). ripgrep is found beside
    the interpreter when it is not on PATH (a console script run without the venv activated fell
    back to Python's re, which has no time limit)."""
    import subprocess
    import sys

    assert ripgrep() is not None
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text("a\n" * 500_000)
    code = (
        "import os, resource, sys\n"
        "from cuttle.sandbox.paths import Workspace\n"
        "from cuttle.sandbox.file_tools import search\n"
        f"ws = Workspace({str(tmp_path)!r}, os.getuid(), os.getgid())\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "out = search(ws, 'a', backend='ripgrep')\n"
        "assert 'more than 200 matches' in out, out[-200:]\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) < 100, f"search grew the host by {r.stdout.strip()} MiB"


def test_a_tree_deeper_than_the_recursion_limit_is_listed_graded_and_removed(tmp_path: Path) -> None:
    """1,500 nested directories (what a sandboxed `mkdir -p` makes in a moment): list_dir(depth=5000)
    was a RecursionError instead of a tool error, grading's walk and remove_tree raised one too
    (the env server then forgot the environment and left its directory on disk)."""
    from cuttle.sandbox.paths import Workspace
    from cuttle.sandbox.file_tools import list_dir
    from cuttle.sandbox.tasks import synthetic_task
    from cuttle.sandbox.tasks.base import solution_files
    from cuttle.sandbox.workspace import remove_tree, write_files

    root = tmp_path / "ws"
    root.mkdir()
    task = synthetic_task(4)
    write_files(str(root), task.files)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    try:
        ws = Workspace(str(root), os.getuid(), os.getgid())
        with pytest.raises(ToolError, match="depth must be <= 64"):
            list_dir(ws, depth=5000)
        assert "d/" in list_dir(ws, depth=64)
        assert set(solution_files(task, ws)) == {p for p in task.files if any(p.startswith(g.split("*")[0]) for g in task.solution_globs)}
        remove_tree(str(root))
        assert not root.exists()
    finally:  # pytest's own cleanup of old temp dirs recurses per level too: never leave the tree behind
        subprocess.run(["rm", "-rf", "--", str(root)], check=False)


def test_python_search_of_a_catastrophic_pattern_times_out(repo: Sandbox, monkeypatch) -> None:
    """Without ripgrep the search ran Python's re in the host with no time limit: `(a+)+$` on 26
    a's took 4.4 s and froze every other thread of the process (the env server's event loop);
    each more a doubles it. It now runs in a child process killed at the time limit."""
    import time

    from cuttle.sandbox import file_tools

    monkeypatch.setattr(file_tools, "PYTHON_SEARCH_TIMEOUT_S", 1.0)
    repo.call_tool("write_file", path="slow.txt", content="a" * 27 + "!\n")
    t = time.monotonic()
    with pytest.raises(ToolError, match="timed out"):
        search(repo.workspace, "(a+)+$", path="slow.txt", backend="python")
    assert time.monotonic() - t < 5
    assert search(repo.workspace, "a+!", path="slow.txt", backend="python") == "slow.txt:1:" + "a" * 27 + "!"
