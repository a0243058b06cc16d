"""Environments: a task, its workspace directory and its sandbox, kept in a bounded pool.

Owns environment lifetimes (create, call a tool, reward, reset, delete, reap when idle), the
capacity limit, one lock per environment (its calls run one at a time), and the log line with
timing for every call. Transport-free: server.py puts HTTP in front of it. Must never leave an
environment's directory behind after delete/reap/close, and never grade inside a workspace.
"""
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import ToolError
from .limits import Limits
from .sandbox import Sandbox
from .tasks import Reward, Task, grade, make_task
from .workspace import bound_workspace, chown_tree, clear_dir, remove_tree, write_files

log = logging.getLogger("cuttle.sandbox.envs")


class PoolFull(Exception):
    pass


@dataclass(slots=True)
class Environment:
    env_id: str
    task: Task
    root: str  # holds workspace/; deleted with the environment
    sandbox: Sandbox
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0


@dataclass(slots=True)
class CallResult:
    ok: bool
    output: str  # the tool's text, or the ToolError message when not ok
    elapsed_ms: float


class EnvPool:
    def __init__(self, max_envs: int = 64, idle_timeout_s: float = 600.0, limits: Limits | None = None,
                 allow_unisolated: bool = False, base_dir: str | None = None) -> None:
        self.max_envs = max_envs
        self.idle_timeout_s = idle_timeout_s
        self.limits = limits or Limits()
        self.allow_unisolated = allow_unisolated
        self.base_dir = base_dir
        self._envs: dict[str, Environment] = {}
        self._lock = threading.Lock()
        self._reserved = 0  # creations in flight count against the limit too

    def __len__(self) -> int:
        return len(self._envs)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._envs)

    def create(self, spec: dict[str, Any]) -> Environment:
        task = make_task(spec)  # ValueError/KeyError on a bad spec, before taking a slot
        with self._lock:
            if len(self._envs) + self._reserved >= self.max_envs:
                raise PoolFull(f"too many environments (max {self.max_envs}); delete some or wait for idle reaping")
            self._reserved += 1
        start = time.perf_counter()
        root = tempfile.mkdtemp(prefix="cuttle-env-", dir=self.base_dir)
        try:
            os.chmod(root, 0o755)
            workspace = os.path.join(root, "workspace")
            os.mkdir(workspace)
            if self.limits.workspace_mb is not None:
                bound_workspace(workspace, self.limits.workspace_mb)
            write_files(workspace, task.files)
            sandbox = Sandbox(workspace, limits=self.limits, allow_unisolated=self.allow_unisolated)
            env = Environment(uuid.uuid4().hex[:16], task, root, sandbox, time.monotonic())
        except BaseException:
            remove_tree(root)
            with self._lock:
                self._reserved -= 1
            raise
        with self._lock:
            self._reserved -= 1
            self._envs[env.env_id] = env
        log.info("env=%s create task=%s ms=%.1f", env.env_id, task.task_id, (time.perf_counter() - start) * 1e3)
        return env

    def get(self, env_id: str) -> Environment:
        with self._lock:
            env = self._envs.get(env_id)
        if env is None:
            raise KeyError(f"no environment {env_id!r}")
        return env

    def call(self, env_id: str, name: str, arguments: dict[str, Any]) -> CallResult:
        env = self.get(env_id)
        with env.lock:
            self._check_alive(env)
            start = time.perf_counter()
            try:
                result = CallResult(True, env.sandbox.call_tool(name, **arguments), 0.0)
            except ToolError as err:
                result = CallResult(False, str(err), 0.0)
            result.elapsed_ms = (time.perf_counter() - start) * 1e3
            env.calls += 1
            env.last_used = time.monotonic()
        log.info("env=%s tool=%s ok=%s ms=%.1f", env_id, name, result.ok, result.elapsed_ms)
        return result

    def reward(self, env_id: str) -> tuple[Reward, float]:
        env = self.get(env_id)
        with env.lock:
            self._check_alive(env)
            start = time.perf_counter()
            # graded under the pool's own directory, so its cleanup covers the copies too
            # the hidden tests run the agent's code too: under the environment's limits (its
            # memory bounds included), with the task's own time limit
            limits = replace(env.sandbox.limits, timeout=env.task.timeout)
            reward = grade(env.task, env.sandbox.workspace, limits, scratch_dir=self.base_dir)
            elapsed = (time.perf_counter() - start) * 1e3
            env.last_used = time.monotonic()
        log.info("env=%s reward=%.1f ms=%.1f", env_id, reward.reward, elapsed)
        return reward, elapsed

    def reset(self, env_id: str) -> Environment:
        env = self.get(env_id)
        with env.lock:
            self._check_alive(env)
            start = time.perf_counter()
            ws = env.sandbox.workspace
            clear_dir(ws.root)  # keep the directory itself: its inode is what sandboxes bind
            write_files(ws.root, env.task.files)
            chown_tree(ws.root, ws.uid, ws.gid)
            env.last_used = time.monotonic()
        log.info("env=%s reset ms=%.1f", env_id, (time.perf_counter() - start) * 1e3)
        return env

    def delete(self, env_id: str) -> None:
        with self._lock:
            env = self._envs.pop(env_id, None)
        if env is None:
            raise KeyError(f"no environment {env_id!r}")
        with env.lock:  # waits for a call in progress; later callers see it gone
            remove_tree(env.root)
        log.info("env=%s delete calls=%d", env_id, env.calls)

    def reap_idle(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            idle = [e.env_id for e in self._envs.values()
                    if now - e.last_used > self.idle_timeout_s and not e.lock.locked()]
        reaped = []
        for env_id in idle:
            try:
                self.delete(env_id)
                reaped.append(env_id)
            except KeyError:  # deleted meanwhile
                pass
        if reaped:
            log.info("reaped %d idle environment(s): %s", len(reaped), ", ".join(reaped))
        return reaped

    def close(self) -> None:
        for env_id in self.ids():
            try:
                self.delete(env_id)
            except KeyError:
                pass

    def _check_alive(self, env: Environment) -> None:
        with self._lock:
            if self._envs.get(env.env_id) is not env:
                raise KeyError(f"no environment {env.env_id!r}")
