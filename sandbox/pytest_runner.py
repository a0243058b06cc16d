"""Runs inside the sandbox as `python -c SOURCE [--nonce-from-stdin] PYTEST_ARGS...`.

Owns the machine-readable result of a test run: after pytest finishes it writes one line,
`@@cuttle-tests@@ NONCE JSON`, to stderr, JSON being {"exit": code, "outcomes": {nodeid: outcome}}.
With --nonce-from-stdin the nonce is read before any code under test is imported, so code that
ends the process early (os._exit(0), sys.exit in a module body) cannot produce a result line.
Never imported by cuttle; depends on the standard library and pytest only.
"""
import json
import os
import sys

MARK = "@@cuttle-tests@@"


def main() -> None:
    args = sys.argv[1:]
    nonce = "-"
    if args[:1] == ["--nonce-from-stdin"]:
        nonce = sys.stdin.readline().strip()
        args = args[1:]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the nonce is gone from stdin before tests run
    os.close(devnull)
    sys.path.insert(0, os.getcwd())
    import pytest

    outcomes: dict[str, str] = {}

    class Recorder:
        def pytest_runtest_logreport(self, report) -> None:
            if report.when == "call":
                outcomes[report.nodeid] = "skipped" if report.skipped else report.outcome
            elif report.failed:  # setup or teardown broke: the test did not really run
                outcomes[report.nodeid] = "error"
            elif report.skipped and report.when == "setup":
                outcomes[report.nodeid] = "skipped"

        def pytest_collectreport(self, report) -> None:
            if report.failed:
                outcomes[report.nodeid or "<collection>"] = "error"

    code = pytest.main(args, plugins=[Recorder()])
    sys.stderr.write(f"\n{MARK} {nonce} {json.dumps({'exit': int(code), 'outcomes': outcomes})}\n")
    sys.stderr.flush()
    sys.exit(int(code))


if __name__ == "__main__":
    main()
