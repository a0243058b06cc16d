"""The engine-state routes, in vLLM's shapes (outside /v1, as vLLM serves them, but behind the
API key: they change the server for every client):

POST /sleep?level=1|2          the idle engine gives its KV cache's memory back (engine/sleep_mode.py),
                               at level 2 its weights too (sent again by /v1/rl/update_weights);
                               needs --enable-sleep-mode; refused while requests run or sessions are open
POST /wake_up[?tags=weights&tags=kv_cache]   restore all, or the tags named
GET  /is_sleeping              -> {"is_sleeping": bool}
POST /reset_prefix_cache       forget every cached prefix and document, in every tier

While asleep, generation requests get a 503 (`server_asleep`) and the server stays up. Owns these
routes' wire format only: each runs on the engine thread between steps (`AsyncEngine.call`).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import Response

from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.openai_protocol import OpenAIError

ADMIN_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")


def add_admin_routes(app: FastAPI, engine: AsyncEngine) -> None:
    llm = engine.engine

    async def run(fn, param: str | None) -> None:
        def then_stats() -> None:  # on the engine thread, as every other stats snapshot
            fn()
            engine.stats_snapshot = llm.stats()

        try:
            await engine.call(then_stats)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None

    @app.post("/sleep")
    async def sleep(level: str = "1") -> Response:
        if not llm.config.enable_sleep_mode:
            raise OpenAIError("this server was started without --enable-sleep-mode, so it cannot be put to sleep")
        if not level.isdigit():
            raise OpenAIError(f"level must be an integer (1), got {level!r}", param="level")
        await run(lambda: llm.sleep(int(level)), "level")
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> Response:
        await run(lambda: llm.wake_up(tags), "tags")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": llm.is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await run(llm.reset_prefix_cache, None)
        return Response(status_code=200)
