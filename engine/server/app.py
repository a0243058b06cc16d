"""The server application: `create_app` wires auth, error handlers, the plain routes (/health,
/metrics, /v1/models) and the route modules over one `AsyncEngine`, and checks the server-wide
chat settings (tool-call parser, reasoning parser, `--chat-template`) once, at startup. Errors
take the shape of the API a route speaks: OpenAI's, or Anthropic's under /v1/messages.

Owns nothing about a request's content. Auth is a plain ASGI middleware, not Starlette's
`@app.middleware("http")` (BaseHTTPMiddleware): under that, an endpoint never sees the client's
`http.disconnect`, and abandoned requests ran to the end (streaming.py races every handler's
engine work against it).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.metrics import ServerMetrics
from cuttle.engine.openai_protocol import OpenAIError
from cuttle.engine.server.lora_routes import add_lora_routes, register_lora_modules
from cuttle.engine.server.body import MAX_BODY_BYTES
from cuttle.engine.reasoning_parsers import HARMONY_PARSER, REASONING_PARSERS
from cuttle.engine.server.admin_routes import ADMIN_PATHS, add_admin_routes
from cuttle.engine.server.chat import add_chat_routes
from cuttle.engine.server.chat_prompt import ChatOptions
from cuttle.engine.server.completions import add_completion_routes
from cuttle.engine.server.messages import add_message_routes, anthropic_error
from cuttle.engine.server.responses import add_response_routes
from cuttle.engine.server.rl_routes import add_rl_routes
from cuttle.engine.server.streaming import Serving
from cuttle.engine.server.tokens import add_token_routes
from cuttle.engine.tool_parsers import PARSERS, foreign_tool_format, is_harmony_template, parser_for_template

log = logging.getLogger("cuttle.server")
MESSAGES_PATH = "/v1/messages"  # Anthropic's API (messages.py): its own error shape and `x-api-key` header


def _error_body(request: Request, e: OpenAIError) -> dict[str, Any]:
    """An error in the shape of the API the route speaks: Anthropic's under /v1/messages, else OpenAI's."""
    if request.url.path.startswith(MESSAGES_PATH):
        return anthropic_error(e.status, e.message if e.param is None else f"{e.param}: {e.message}")
    return e.body()


class _Auth:
    """Bearer-token check for /v1 routes and the engine-state routes (admin_routes.py), as a plain
    ASGI middleware (see the module docstring)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is not None and scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in ADMIN_PATHS):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            anthropic = scope["path"].startswith(MESSAGES_PATH)
            if anthropic and auth != self.expected:  # Anthropic's clients send the key as x-api-key
                key = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
                auth = b"Bearer " + key if key else auth
            if auth != self.expected:
                err = OpenAIError("invalid or missing API key", 401, "authentication_error", code="invalid_api_key")
                body = anthropic_error(401, err.message) if anthropic else err.body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, tool_call_parser: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, reasoning_parser: str | None = None, chat_template: str | None = None,
               trust_request_chat_template: bool = False, enable_auto_tool_choice: bool = True,
               return_tokens_as_token_ids: bool = False, lora_modules: dict[str, str] | None = None,
               allow_runtime_lora_updating: bool = False) -> FastAPI:
    """`chat_template`: the template's text (`chat_prompt.load_chat_template` reads the CLI's
    path-or-inline argument), used instead of the checkpoint's. `lora_modules`: adapter name ->
    PEFT directory, each served under its name (engine/server/lora_routes.py)."""
    llm = engine.engine
    tok = llm.tokenizer
    template = chat_template or tok.chat_template
    parser = tool_call_parser or parser_for_template(template)
    # a template teaching a format no parser reads: requests with tools are refused (chat.py)
    foreign = None if tool_call_parser else foreign_tool_format(template)
    if parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
    if is_harmony_template(template):  # gpt-oss: its output is harmony messages, read by one parser only
        if reasoning_parser not in (None, HARMONY_PARSER):
            raise ValueError(f"--reasoning-parser {reasoning_parser!r} cannot read this model's output: its chat template "
                             f"writes gpt-oss's harmony messages (use {HARMONY_PARSER!r}, the default for it)")
        reasoning_parser = HARMONY_PARSER
    if chat_template is not None:
        tok.compile_template(chat_template)  # a template that does not compile fails the start, not every request
    chat_opts = ChatOptions(parser, reasoning_parser, chat_template, trust_request_chat_template, enable_auto_tool_choice,
                            foreign_tool_format=foreign)
    metrics = ServerMetrics(model_name)
    serving = Serving(engine, model_name, metrics, max_body_bytes, return_tokens_as_token_ids=return_tokens_as_token_ids)
    register_lora_modules(engine, serving, lora_modules or {})
    app = FastAPI(title="cuttle", version="0.1.0")
    app.state.engine = engine

    @app.on_event("startup")
    async def _start() -> None:
        engine.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        engine.shutdown()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(_error_body(request, e), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # unknown routes (404) and wrong methods (405) in the OpenAI error shape, as OpenAI's API
        # answers them, instead of FastAPI's {"detail": ...}; the Allow header is kept
        msg = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else \
            f"{e.detail}: {request.method} {request.url.path}" if e.status_code == 405 else str(e.detail)
        return JSONResponse(_error_body(request, OpenAIError(msg, e.status_code, "invalid_request_error")),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(_error_body(request, OpenAIError(f"internal error: {e}", 500, "server_error")), status_code=500)

    app.add_middleware(_Auth, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine._thread is not None else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(engine.stats_snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        base = {"id": model_name, "object": "model", "created": now, "owned_by": "cuttle", "root": model_name, "parent": None,
                "max_model_len": llm.max_model_len}
        # each LoRA adapter as vLLM lists it: its directory as root, the base model as parent
        return {"object": "list", "data": [base] + [{**base, "id": name, "root": path or name, "parent": model_name}
                                                    for name, path in serving.adapters.items()]}

    add_completion_routes(app, serving, tok)
    add_chat_routes(app, serving, tok, chat_opts)
    add_response_routes(app, serving, tok, chat_opts)
    add_message_routes(app, serving, tok, chat_opts)
    add_token_routes(app, serving, tok, chat_opts, llm.max_model_len)
    add_rl_routes(app, engine, max_body_bytes, serving.disconnected)
    add_admin_routes(app, engine)
    add_lora_routes(app, engine, serving, allow_runtime_lora_updating)
    return app
