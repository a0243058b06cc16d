"""LoRA adapters on the server (engine/lora.py), in vLLM's shapes:

- `--lora-modules name=path ...` serves each PEFT adapter under its name: a request whose `model`
  is that name runs under it, and `/v1/models` lists it with the base model as its parent;
- with runtime updating allowed (`--allow-runtime-lora-updating`, or vLLM's environment variable
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), behind the API key:
  POST /v1/load_lora_adapter   {"lora_name": ..., "lora_path": ...}
  POST /v1/unload_lora_adapter {"lora_name": ...}
  Without it those routes answer 404 and the server reads no adapter a client names: they would
  let any client make the server read a directory of its choosing.

Owns these routes' wire format and the server's list of adapter names (`Serving.adapters`,
changed here on the event loop); loading runs on the engine thread (`AsyncEngine.call`).
"""
from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.openai_protocol import OpenAIError, get_str
from cuttle.engine.server.body import json_body
from cuttle.engine.server.streaming import Serving

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def register_lora_modules(engine: AsyncEngine, serving: Serving, modules: dict[str, str]) -> None:
    """The `--lora-modules` adapters, checked before the server starts (a bad one fails the start)."""
    if not modules:
        return
    loras = engine.engine.loras
    if loras is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in modules.items():
        if name == serving.model_name:
            raise ValueError(f"--lora-modules: the adapter name {name!r} is the base model's (--served-model-name)")
        loras.register(name, path)
        serving.adapters[name] = path


def add_lora_routes(app: FastAPI, engine: AsyncEngine, serving: Serving, allow_runtime_updating: bool) -> None:
    if not allow_runtime_updating:
        return
    loras = engine.engine.loras
    if loras is None:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await json_body(request, serving.max_body_bytes)
        name, path = get_str(body, "lora_name"), get_str(body, "lora_path")
        if not name or not path:
            raise OpenAIError("lora_name and lora_path are both required", param="lora_name" if not name else "lora_path")
        if name == serving.model_name or name in serving.adapters:
            raise OpenAIError(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
        try:
            await engine.call(lambda: loras.register(name, path))
        except ValueError as e:
            raise OpenAIError(str(e), param="lora_path") from None
        serving.adapters[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await json_body(request, serving.max_body_bytes)
        name = get_str(body, "lora_name")
        if not name:
            raise OpenAIError("lora_name is required", param="lora_name")
        if name not in serving.adapters:
            raise OpenAIError(f"the LoRA adapter {name!r} cannot be found", 404, param="lora_name", code="lora_not_found")
        del serving.adapters[name]  # new requests are refused from now; running ones finish under it
        await engine.call(lambda: loras.unregister(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
