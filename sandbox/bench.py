"""Sandbox benchmark: sandboxed start-up, environments per second, tool calls per second.

Owns measuring and printing (a markdown table); `benchmarks/sandbox.py` calls `main`. Start-up is
reported against peers measured in the same run (a bare fork+exec of /bin/true, and util-linux
`unshare` with the same namespaces and nothing else), because these machines are noisy.
Must never be imported by the sandbox itself.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

from .envs import EnvPool
from .sandbox import Sandbox
from .workspace import remove_tree


def _median_ms(fn: Callable[[], object], n: int) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def _rate(fn: Callable[[], object], seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return count / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks/sandbox.py", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=50, help="start-up samples per row")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each rate measurement")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="cuttle-bench-")
    try:
        os.chmod(root, 0o755)
        ws = os.path.join(root, "ws")
        os.mkdir(ws)
        sb = Sandbox(ws)
        bare = _median_ms(lambda: subprocess.run(["/bin/true"], check=True), args.runs)
        rows = [("bare fork+exec /bin/true", bare, 1.0)]
        unshare = shutil.which("unshare")
        if unshare:
            cmd = [unshare, "--user", "--map-root-user", "--net", "--pid", "--ipc", "--mount", "--uts", "--fork",
                   "/bin/true"]
            if subprocess.run(cmd, check=False, capture_output=True).returncode == 0:
                ms = _median_ms(lambda: subprocess.run(cmd, check=True), args.runs)
                rows.append(("unshare(1), same namespaces, no mounts/rlimits", ms, ms / bare))
        ms = _median_ms(lambda: sb.run("true"), args.runs)
        rows.append((f"Sandbox.run('true') [{sb.isolation}]", ms, ms / bare))
        print("| sandboxed command start-up | median ms | × bare |\n|---|---:|---:|")
        for name, value, ratio in rows:
            print(f"| {name} | {value:.1f} | {ratio:.1f} |")

        pool = EnvPool(max_envs=4, base_dir=root)
        envs = _rate(lambda: pool.delete(pool.create({"kind": "synthetic", "seed": 1}).env_id), args.seconds)
        env = pool.create({"kind": "synthetic", "seed": 1})
        calls = [
            ("read_file", {"path": "README.md"}),
            ("search", {"pattern": "def "}),
            ("run", {"command": "true"}),
            ("run", {"command": "python -c pass"}),
        ]
        print(f"\n| operation | per second |\n|---|---:|\n| create + delete environment (synthetic) | {envs:.1f} |")
        for name, arguments in calls:
            rate = _rate(lambda n=name, a=arguments: pool.call(env.env_id, n, a), args.seconds)
            print(f"| tool call {name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())}) | {rate:.1f} |")
        pool.close()
    finally:
        remove_tree(root)


if __name__ == "__main__":
    main()
