"""Test runs inside a sandbox: the pytest command, and the per-test report parsed from it.

Owns `TestReport` (passed / failed / errors per test) and how a run's output becomes one.
Must never trust a result line without the nonce it asked for, and never run pytest on the host.
"""
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .runner import RunResult

MARK = "@@cuttle-tests@@"
RUNNER_SOURCE = Path(__file__).with_name("pytest_runner.py").read_text()
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "--color=no", "--tb=short", "-o", "console_output_style=classic"]
SHOWN_OUTPUT = 8000  # characters of pytest's own output shown to the agent


@dataclass(slots=True)
class TestReport:
    exit_code: int
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> passed/failed/error/skipped
    output: str = ""
    complete: bool = True  # False: no result line (killed, timed out, or faked) - nothing passed
    timed_out: bool = False

    __test__ = False  # not a pytest test class, despite the name

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)

    @property
    def all_passed(self) -> bool:
        return self.complete and self.exit_code == 0 and self.count("passed") > 0 and all(
            o in ("passed", "skipped") for o in self.outcomes.values())

    def format(self) -> str:
        head = (f"pytest exit code {self.exit_code}: {self.count('passed')} passed, {self.count('failed')} failed, "
                f"{self.count('error')} errors, {self.count('skipped')} skipped")
        lines = [head]
        if self.timed_out:
            lines.append("note: timed out; the sandbox was killed")
        elif not self.complete:
            lines.append("note: pytest did not finish; no per-test results")
        order = {"failed": 0, "error": 1, "passed": 2, "skipped": 3}
        for nodeid, outcome in sorted(self.outcomes.items(), key=lambda kv: (order.get(kv[1], 4), kv[0])):
            lines.append(f"{outcome.upper()} {nodeid}")
        output = self.output.strip()
        if output:
            if len(output) > SHOWN_OUTPUT:
                output = "[... output truncated ...]\n" + output[-SHOWN_OUTPUT:]
            lines.append("--- pytest output ---\n" + output)
        return "\n".join(lines)


def pytest_command(args: list[str], with_nonce: bool) -> str:
    nonce = ["--nonce-from-stdin"] if with_nonce else []
    # No plugin autoload: a run takes ~0.3 s instead of ~1 s and does not depend on what is installed.
    return shlex.join(["env", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", "python", "-c", RUNNER_SOURCE, *nonce,
                       *PYTEST_ARGS, *args])


def parse_report(result: RunResult, nonce: str = "-") -> TestReport:
    """Find the result line with our nonce; without it, the run counts as not complete."""
    report = TestReport(exit_code=result.exit_code, output=result.stdout, complete=False,
                        timed_out=result.timed_out)
    for line in reversed(result.stderr.splitlines()):
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == MARK:
            if parts[1] != nonce:
                break
            try:
                data = json.loads(parts[2])
            except ValueError:
                break
            report.outcomes = {str(k): str(v) for k, v in data["outcomes"].items()}
            report.complete = result.exit_code == data["exit"]
            break
    stderr = "\n".join(ln for ln in result.stderr.splitlines() if not ln.startswith(MARK)).strip()
    if stderr:
        report.output = (report.output.rstrip() + "\n--- stderr ---\n" + stderr).strip()
    return report
