"""The environment server: HTTP JSON (FastAPI) over an `EnvPool`, run as `cuttle-env-server`.

`main` is that console script (its own, so the engine's `cuttle` command never imports the sandbox).
Owns routes, status codes, the limit on concurrent blocking calls, the idle reaper task and the
per-request log line with timing. All work runs in worker threads (sandboxes block); the event
loop only routes. Must never run a tool on the event loop, and never swallow a host-side error
as a tool error (those are 500s; a ToolError is a normal answer with ok=false).

Routes:
  GET    /health                    -> {"status", "envs", "isolation"}
  GET    /tools                     -> {"tools": [OpenAI tool schemas]}
  POST   /envs          {"task": {"kind": "humaneval", "task_id": ...} | {"kind": "synthetic", "seed": ...}}
                                    -> {"env_id", "task_id", "prompt", "tools", "isolation"}
  GET    /envs                      -> {"envs": [ids]}
  POST   /envs/{id}/call {"name", "arguments"} -> {"ok", "output" | "error", "elapsed_ms"}
  POST   /envs/{id}/reward          -> {"reward", "passed", "failed", "errors", "outcomes", ...}
  POST   /envs/{id}/reset           -> {"env_id", "prompt"}
  DELETE /envs/{id}                 -> {"deleted": true}
"""
import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from . import cgroups
from .envs import EnvPool, PoolFull
from .isolation import NAMESPACES, RLIMITS_ONLY, namespace_error
from .limits import Limits
from .tools import tool_schemas

log = logging.getLogger("cuttle.sandbox.server")


class CreateEnv(BaseModel):
    task: dict[str, Any]


class ToolCall(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


def create_app(pool: EnvPool, max_concurrent_calls: int = 8, reap_interval_s: float = 10.0) -> FastAPI:
    slots = asyncio.Semaphore(max_concurrent_calls)  # bounds threads busy with sandboxes

    async def blocking(fn: Callable[..., Any], *args: Any) -> Any:
        async with slots:
            return await run_in_threadpool(fn, *args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def reaper() -> None:
            while True:
                await asyncio.sleep(reap_interval_s)
                await run_in_threadpool(pool.reap_idle)

        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()
            await run_in_threadpool(pool.close)  # no environment outlives the server

    app = FastAPI(title="cuttle-env-server", lifespan=lifespan)

    @app.middleware("http")
    async def log_timing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        log.info("%s %s %d ms=%.1f", request.method, request.url.path, response.status_code,
                 (time.perf_counter() - start) * 1e3)
        return response

    def not_found(err: KeyError) -> HTTPException:
        return HTTPException(status_code=404, detail=str(err.args[0]) if err.args else "not found")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "envs": len(pool),
                "isolation": NAMESPACES if namespace_error() is None else RLIMITS_ONLY}

    @app.get("/tools")
    async def tools() -> dict[str, Any]:
        return {"tools": tool_schemas()}

    @app.post("/envs")
    async def create(body: CreateEnv) -> dict[str, Any]:
        try:
            env = await blocking(pool.create, body.task)
        except PoolFull as err:
            raise HTTPException(status_code=429, detail=str(err)) from None
        except (ValueError, KeyError) as err:
            raise HTTPException(status_code=400, detail=str(err.args[0]) if err.args else str(err)) from None
        return {"env_id": env.env_id, "task_id": env.task.task_id, "prompt": env.task.prompt,
                "tools": tool_schemas(), "isolation": env.sandbox.isolation}

    @app.get("/envs")
    async def list_envs() -> dict[str, Any]:
        return {"envs": pool.ids()}

    @app.post("/envs/{env_id}/call")
    async def call(env_id: str, body: ToolCall) -> dict[str, Any]:
        try:
            result = await blocking(pool.call, env_id, body.name, body.arguments)
        except KeyError as err:
            raise not_found(err) from None
        key = "output" if result.ok else "error"
        return {"ok": result.ok, key: result.output, "elapsed_ms": round(result.elapsed_ms, 1)}

    @app.post("/envs/{env_id}/reward")
    async def reward(env_id: str) -> dict[str, Any]:
        try:
            result, elapsed = await blocking(pool.reward, env_id)
        except KeyError as err:
            raise not_found(err) from None
        return {**result.to_dict(), "elapsed_ms": round(elapsed, 1)}

    @app.post("/envs/{env_id}/reset")
    async def reset(env_id: str) -> dict[str, Any]:
        try:
            env = await blocking(pool.reset, env_id)
        except KeyError as err:
            raise not_found(err) from None
        return {"env_id": env.env_id, "prompt": env.task.prompt}

    @app.delete("/envs/{env_id}")
    async def delete(env_id: str) -> dict[str, Any]:
        try:
            await blocking(pool.delete, env_id)
        except KeyError as err:
            raise not_found(err) from None
        return {"deleted": True}

    return app


def main(argv: list[str] | None = None) -> None:
    """`cuttle-env-server [--port N] ...`: serve coding environments over HTTP."""
    p = argparse.ArgumentParser(prog="cuttle-env-server", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8600)
    p.add_argument("--max-envs", type=int, default=64, help="environments alive at once (429 beyond)")
    p.add_argument("--max-concurrent-calls", type=int, default=2 * (os.cpu_count() or 1),
                   help="tool calls / rewards running at once; more wait")
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an unused env is deleted")
    p.add_argument("--timeout", type=float, default=30.0, help="wall-clock limit per command, seconds")
    p.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per process of a command")
    p.add_argument("--total-memory-mb", type=int, default=None,
                   help="memory of all of a command's processes together, tmpfs included (a memory cgroup per "
                        "command; refused at start where this process cannot make one)")
    p.add_argument("--workspace-mb", type=int, default=None,
                   help="each environment's workspace on a tmpfs of this size (bytes and files bounded; RAM-backed; "
                        "needs root)")
    p.add_argument("--allow-unisolated", action="store_true",
                   help="run with rlimits only where namespaces are unavailable (reported on every result)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    import uvicorn  # only the server needs it

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    error = namespace_error()
    log.info("isolation: %s", "namespaces (user, pid, net, mount, ipc, uts via unshare(2))" if error is None
             else f"unavailable ({error})")
    try:
        limits = Limits(timeout=args.timeout, memory_mb=args.memory_mb, total_memory_mb=args.total_memory_mb,
                        workspace_mb=args.workspace_mb)
    except ValueError as err:
        raise SystemExit(f"cuttle-env-server: {err}") from None
    pool = EnvPool(max_envs=args.max_envs, idle_timeout_s=args.idle_timeout, limits=limits,
                   allow_unisolated=args.allow_unisolated)
    if error is not None and not args.allow_unisolated:
        raise SystemExit(f"cuttle-env-server: namespace isolation unavailable ({error}); "
                         "pass --allow-unisolated to serve rlimits-only sandboxes")
    if args.total_memory_mb is not None and (why := cgroups.support_error()) is not None:
        raise SystemExit(f"cuttle-env-server: --total-memory-mb needs a memory cgroup per command, and this process "
                         f"cannot make one: {why}")
    if args.workspace_mb is not None and os.geteuid() != 0:
        raise SystemExit("cuttle-env-server: --workspace-mb mounts each workspace's own filesystem, which needs root")
    app = create_app(pool, args.max_concurrent_calls, reap_interval_s=min(10.0, args.idle_timeout / 2))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
