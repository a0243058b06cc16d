"""Sandbox benchmark: sandboxed command start-up vs a bare process, environment churn, tool call
rates. A thin entry point; the measurements live in `cuttle.sandbox.bench`.

    python benchmarks/sandbox.py
"""
from cuttle.sandbox.bench import main

if __name__ == "__main__":
    main()
