"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, over one `AsyncEngine`.

Owns HTTP concerns only: auth, body limits (size, nesting), JSON errors in OpenAI's shape,
streaming (SSE), client disconnects (the request is aborted and its KV freed within one engine
step), admission limits (503 + Retry-After), one client's failure kept to that client, and
latency metrics measured as the client sees them. Everything about sampling lives in the
engine; everything about the wire format in `openai_protocol`. The guarantees are listed in
docs/server.md.

Disconnects: every handler's engine work runs in a task raced against the ASGI `receive`
channel, which delivers `http.disconnect` the moment the connection drops; the task is then
cancelled, which closes its `AsyncEngine.generate` iterators, which queue the aborts. That is
why there is no Starlette `@app.middleware("http")` here (BaseHTTPMiddleware): under it an
endpoint never sees the disconnect, and abandoned requests ran to the end. Auth is a plain
ASGI middleware instead.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cuttle.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from cuttle.engine.metrics import ServerMetrics
from cuttle.engine.openai_protocol import (
    CHAT_FIELDS, COMPLETION_FIELDS, RL_FIELDS, RL_SAMPLING_FIELDS, OpenAIError, Usage, chat_logprobs, check_fields,
    check_response_format, check_tools, completion_logprobs, get_bool, get_int, get_str, get_stream_options,
    sampling_params, show,
)
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.tool_parsers import PARSERS, StreamingToolParser, parse_tool_calls, parser_for_template
from cuttle.engine.tokenizer import validate_messages

log = logging.getLogger("cuttle.server")

# The largest JSON request body (413 above it). 32 MiB holds a batch of ~4M prompt token ids as
# JSON; the weight upload (/v1/rl/update_weights, behind the API key) is not limited.
MAX_BODY_BYTES = 32 * 2**20
# The deepest nesting of a JSON body (the top-level object is depth 1). OpenAI bodies need ~10
# (a tool's JSON schema a few more); the limit keeps recursive code (the json decoder, template
# rendering) far from Python's recursion limit.
MAX_JSON_DEPTH = 64


class _Auth:
    """Bearer-token check for /v1 routes, as a plain ASGI middleware (see the module docstring)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is not None and scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if auth != self.expected:
                err = OpenAIError("invalid or missing API key", 401, "authentication_error", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, tool_call_parser: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    llm = engine.engine
    tok = llm.tokenizer
    parser = tool_call_parser or parser_for_template(tok.chat_template)
    if parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    metrics = ServerMetrics(model_name)
    app = FastAPI(title="cuttle", version="0.1.0")
    app.state.engine = engine

    @app.on_event("startup")
    async def _start() -> None:
        engine.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        engine.shutdown()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(OpenAIError(f"internal error: {e}", 500, "server_error").body(), status_code=500)

    app.add_middleware(_Auth, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine._thread is not None else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(engine.stats_snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "cuttle", "max_model_len": llm.max_model_len}]}

    async def body_of(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
        body = await json_body(request, max_body_bytes)
        model = body.get("model")
        if model is not None and model != model_name:
            raise OpenAIError(f"model {show(model)} does not exist; this server serves {model_name!r}", param="model", code="model_not_found")
        check_fields(body, allowed, body.get("n", 1))
        return body

    async def final_of(stream: RequestStream, t0: float) -> RequestOutput:
        out = await _final(stream)
        metrics.e2e.labels(model_name).observe(time.monotonic() - t0)
        for c in out.outputs:
            metrics.requests.labels(model_name, c.finish_reason or "abort").inc()
        return out

    def observe(out: RequestOutput, t0: float, state: dict[str, float]) -> None:
        """Latency of a streamed request, as its client sees it (a non-streamed client sees only the end)."""
        now = time.monotonic()
        if any(c.token_ids for c in out.outputs):
            if "first" not in state:
                state["first"] = now
                metrics.ttft.labels(model_name).observe(now - t0)
            elif "last" in state:
                metrics.itl.labels(model_name).observe(now - state["last"])
            state["last"] = now
        if out.finished:
            metrics.e2e.labels(model_name).observe(now - t0)
            for c in out.outputs:
                metrics.requests.labels(model_name, c.finish_reason or "abort").inc()

    def handle_disconnect() -> None:
        metrics.disconnects.labels(model_name).inc()

    def error_event(e: BaseException) -> str:
        return _sse({"error": as_openai_error(e).body()["error"]})

    # ---- /v1/completions -------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request, COMPLETION_FIELDS)
        if body.get("prompt") is None:
            raise OpenAIError("prompt is required", param="prompt")
        prompts = _prompts(body["prompt"])
        echo = get_bool(body, "echo")
        lp = get_int(body, "logprobs", 0, 20)
        stream = get_bool(body, "stream")
        include_usage = get_stream_options(body)
        want_ids = get_bool(body, "return_token_ids")
        salt = get_str(body, "cache_salt")
        kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
        params = sampling_params(body, logprobs=lp, prompt_logprobs=lp if echo and lp is not None else None, output_kind=kind)
        rid = f"cmpl-{uuid.uuid4().hex}"
        t0 = time.monotonic()
        items = [(f"{rid}-{i}", p) for i, p in enumerate(prompts)]

        def choice_text(out: RequestOutput, c) -> str:
            prefix = (out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids, False)) if echo else ""
            return prefix + c.text

        def choice_logprobs(out: RequestOutput, c) -> dict[str, Any] | None:
            if lp is None:
                return None
            ids, lps = list(c.token_ids), list(c.logprobs or [])
            if echo:
                ids = out.prompt_token_ids + ids
                lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
            return completion_logprobs(tok, ids, lps)

        if not stream:
            async def run() -> dict[str, Any]:
                streams = await admit(engine, items, params, salt, "prompt", "max_tokens")
                try:
                    finals = [await final_of(s, t0) for s in streams]
                finally:
                    for s in streams:
                        s.close()
                usage = Usage()
                choices = []
                for i, out in enumerate(finals):
                    usage.add(out)
                    for c in out.outputs:
                        ch = {"index": i * params.n + c.index, "text": choice_text(out, c), "logprobs": choice_logprobs(out, c),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        if want_ids:
                            ch["prompt_token_ids"], ch["token_ids"] = out.prompt_token_ids, c.token_ids
                        choices.append(ch)
                return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                        "choices": choices, "usage": usage.to_openai()}

            return await until_disconnect(request, run(), handle_disconnect)

        streams = await until_disconnect(request, admit(engine, items, params, salt, "prompt", "max_tokens"), handle_disconnect)
        stop_hold = max((len(s) for s in params.stop), default=1) - 1

        async def sse() -> AsyncIterator[str]:
            sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, sample) -> (chars, tokens) sent
            usage, states = Usage(), [dict() for _ in streams]
            try:
                async for i, out in _merged(streams):
                    observe(out, t0, states[i])
                    for c in out.outputs:
                        key = (i, c.index)
                        chars, ntok = sent.get(key, (0, 0))
                        text = choice_text(out, c) if echo else c.text
                        upto = len(text) if c.finish_reason else max(chars, len(text) - stop_hold)
                        delta = text[chars:upto]
                        if not delta and not c.finish_reason and len(c.token_ids) == ntok:
                            continue
                        ch = {"index": i * params.n + c.index, "text": delta, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        if lp is not None:
                            ch["logprobs"] = completion_logprobs(tok, c.token_ids[ntok:], (c.logprobs or [])[ntok:])
                        if want_ids:
                            ch["token_ids"] = c.token_ids[ntok:]
                        sent[key] = (upto, len(c.token_ids))
                        yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name, "choices": [ch]})
                    if out.finished:
                        usage.add(out)
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                                "choices": [], "usage": usage.to_openai()})
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:  # the client left (Starlette cancels the response)
                handle_disconnect()
                raise
            except Exception as e:  # noqa: BLE001 - this client's failure goes to this client only
                yield error_event(e)
            finally:
                for s in streams:
                    s.close()

        return StreamingResponse(sse(), media_type="text/event-stream")

    # ---- /v1/chat/completions --------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request, CHAT_FIELDS)
        if body.get("messages") is None:
            raise OpenAIError("messages is required", param="messages")
        messages = _flatten_messages(body["messages"])
        check_response_format(body)
        tools = check_tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice is None:
            choice = "auto" if tools else "none"
        forced_name = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            forced_name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(forced_name, str):
                raise OpenAIError("tool_choice must be 'auto', 'none', 'required' or {type: function, function: {name}}", param="tool_choice")
            if not tools or forced_name not in {t["function"]["name"] for t in tools}:
                raise OpenAIError(f"tool_choice names function {show(forced_name)}, which is not in tools", param="tool_choice")
            choice = "named"
        elif choice not in ("auto", "none", "required"):
            raise OpenAIError("tool_choice must be 'auto', 'none', 'required' or {type: function, function: {name}}", param="tool_choice")
        elif choice == "required" and not tools:
            raise OpenAIError("tool_choice 'required' needs tools", param="tool_choice")
        use_tools = tools is not None and choice != "none"
        want_lp = get_bool(body, "logprobs")
        top_n = get_int(body, "top_logprobs", 0, 20, 0)
        if top_n and not want_lp:
            raise OpenAIError("top_logprobs requires logprobs: true", param="top_logprobs")
        stream = get_bool(body, "stream")
        include_usage = get_stream_options(body)
        salt = get_str(body, "cache_salt")
        kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
        params = sampling_params(body, "max_completion_tokens", default_max_tokens=None, logprobs=top_n if want_lp else None,
                                 output_kind=kind)
        max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        try:
            prompt_ids = tok.encode_chat(messages, tools=tools if use_tools else None, add_generation_prompt=True)
        except (ValueError, TypeError) as e:  # the template could not render these messages
            raise OpenAIError(str(e), param="messages") from None
        # required / named tool_choice: the call's opening is written for the model (prefix forcing)
        forced = _forced_prefix(parser, choice, forced_name)
        if forced:
            prompt_ids = prompt_ids + tok.encode(forced, add_special_tokens=False)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        t0 = time.monotonic()

        def message_of(text: str) -> tuple[dict[str, Any], bool]:
            text = forced + text
            if not use_tools:
                return {"role": "assistant", "content": text}, False
            content, calls = parse_tool_calls(text, parser, tools)
            if forced and not calls:
                raise OpenAIError(f"tool_choice {choice!r} was requested but the model's output is not a valid tool call: {text[:200]!r}",
                                  500, "server_error", param="tool_choice")
            msg: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [c.to_openai() for c in calls]
            return msg, bool(calls)

        if not stream:
            async def run() -> dict[str, Any]:
                [s] = await admit(engine, [(rid, prompt_ids)], params, salt, "messages", max_field)
                try:
                    out = await final_of(s, t0)
                finally:
                    s.close()
                usage = Usage()
                usage.add(out)
                choices = []
                for c in out.outputs:
                    msg, called = message_of(c.text)
                    ch = {"index": c.index, "message": msg, "logprobs": None,
                          "finish_reason": "tool_calls" if called else c.finish_reason}
                    if want_lp:
                        ch["logprobs"] = {"content": chat_logprobs(tok, c.token_ids, c.logprobs or [], top_n)}
                    choices.append(ch)
                return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                        "choices": choices, "usage": usage.to_openai()}

            return await until_disconnect(request, run(), handle_disconnect)

        [s] = await until_disconnect(request, admit(engine, [(rid, prompt_ids)], params, salt, "messages", max_field), handle_disconnect)
        stop_hold = max((len(x) for x in params.stop), default=1) - 1

        async def sse() -> AsyncIterator[str]:
            def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
                return _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                             "choices": choices, **extra})

            n = params.n
            state: dict[str, float] = {}
            try:
                parsers = [StreamingToolParser(parser, tools) if use_tools else None for _ in range(n)]
                sent_chars, sent_toks, ncalls = [0] * n, [0] * n, [0] * n
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(n)])
                out = None
                async for out in s:
                    observe(out, t0, state)
                    for c in out.outputs:
                        i = c.index
                        text = forced + c.text
                        final = c.finish_reason is not None
                        upto = len(text) if final else max(sent_chars[i], len(text) - stop_hold)
                        delta: dict[str, Any] = {}
                        if parsers[i] is not None:
                            content, calls = parsers[i].feed(text[:upto], final=final)
                            if calls:
                                delta["tool_calls"] = [tc.to_openai(ncalls[i] + k) for k, tc in enumerate(calls)]
                                ncalls[i] += len(calls)
                        else:
                            content = text[sent_chars[i]:upto]
                        sent_chars[i] = upto
                        if content:
                            delta["content"] = content
                        finish = None
                        if final:
                            if forced and ncalls[i] == 0:
                                raise OpenAIError("tool_choice requested but the model's output is not a valid tool call",
                                                  500, "server_error", param="tool_choice")
                            finish = "tool_calls" if ncalls[i] else c.finish_reason
                        if not delta and finish is None:
                            continue
                        ch = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
                        if want_lp and len(c.token_ids) > sent_toks[i]:
                            ch["logprobs"] = {"content": chat_logprobs(tok, c.token_ids[sent_toks[i]:], (c.logprobs or [])[sent_toks[i]:], top_n)}
                        sent_toks[i] = len(c.token_ids)
                        yield chunk([ch])
                if include_usage and out is not None:
                    usage = Usage()
                    usage.add(out)
                    yield chunk([], usage=usage.to_openai())
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:  # the client left (Starlette cancels the response)
                handle_disconnect()
                raise
            except Exception as e:  # noqa: BLE001 - this client's failure goes to this client only
                yield error_event(e)
            finally:
                s.close()

        return StreamingResponse(sse(), media_type="text/event-stream")

    add_rl_routes(app, engine, max_body_bytes, handle_disconnect)
    return app


# ---- helpers -------------------------------------------------------------------------------
async def admit(engine: AsyncEngine, prompts: list[tuple[str, str | list[int]]], params: SamplingParams, salt: str | None,
                prompt_field: str, max_field: str, n_field: str = "n") -> list[RequestStream]:
    """Admit every prompt (one engine round trip for all), or none: errors (400 / 503) come
    back before any byte is sent, and the requests already admitted are aborted."""
    got = await asyncio.gather(*(engine.add(rid, p, params, salt) for rid, p in prompts), return_exceptions=True)
    err = next((e for e in got if isinstance(e, BaseException)), None)
    if err is None:
        return got
    for x in got:
        if isinstance(x, RequestStream):
            x.close()
    if isinstance(err, ValueError):  # the engine refused the request: say which field
        msg = str(err)
        param = n_field if msg.startswith("n (") else max_field if "max_tokens" in msg else prompt_field
        if len(prompts) > 1 or prompt_field == "prompts":
            msg = f"{prompt_field}[{got.index(err)}]: {msg}"
        raise OpenAIError(msg, param=param) from None
    if isinstance(err, QueueFullError):
        raise OpenAIError(f"server is at capacity: {err}", 503, "server_busy") from None
    raise err


def as_openai_error(e: BaseException) -> OpenAIError:
    """What a client is told about a failure of its own request."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, RequestFailedError):
        return OpenAIError(f"the engine failed this request: {e}", 500, "server_error")
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"the engine is not running: {e}", 503, "server_unavailable")
    log.error("request failed", exc_info=e)
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", 500, "server_error")


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up. Called only after the body is read, so `receive` has
    nothing else to deliver: uvicorn answers it with `http.disconnect` as the connection drops."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[Any], on_disconnect) -> Any:
    """Await a handler's engine work, cancelling it (which aborts its requests: the engine frees
    their KV before its next step) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))  # let its cleanup (the aborts) run now
        on_disconnect()
        raise OpenAIError("client disconnected", 499, "client_disconnected")
    if task.cancelled():
        raise OpenAIError("request cancelled", 499, "client_disconnected")
    e = task.exception()
    if e is not None:
        raise as_openai_error(e) from None
    return task.result()


async def _final(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    assert out is not None and out.finished
    return out


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several request streams as they come; one stream is read directly."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                merged.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            merged.put_nowait((i, e))
        merged.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out = await merged.get()
            if out is None:
                live -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield i, out
    finally:
        for t in tasks:  # a cancelled pump's stream aborts its request
            t.cancel()


_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object: at most `limit` bytes (413), nested at most
    MAX_JSON_DEPTH deep, no NaN / Infinity / overflowing numbers (400 naming the field)."""
    size = request.headers.get("content-length")
    too_large = OpenAIError(f"request body is larger than {limit} bytes", 413, "invalid_request_error", code="request_too_large")
    if size is not None and size.isdigit() and int(size) > limit:
        raise too_large
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    odd: list[str] = []  # NaN / Infinity literals and numbers that overflow a float

    def constant(text: str) -> float:
        odd.append(text)
        return float(text)

    def number(text: str) -> float:
        v = float(text)
        if math.isinf(v):
            odd.append(text)
        return v

    try:
        try:
            body = json.loads(raw, parse_constant=constant, parse_float=number)
        except ValueError as e:
            if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
                raise
            # an integer past Python's digit limit: parse again to find where it is
            body = json.loads(raw, parse_constant=constant, parse_float=number,
                              parse_int=lambda t: int(t) if len(t) <= 4000 else (odd.append(t), math.inf)[1])
    except RecursionError:
        raise OpenAIError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", param=_deep_field(raw)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    if odd or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # rare: walk the values
        _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Refuse a value nested too deep or a non-finite number, naming the field it is in (the
    top-level key, or `key.subkey` inside a top-level object such as sampling_params)."""
    todo: list[tuple[str, Any, int]] = []
    for name, v in body.items():
        if isinstance(v, dict):
            todo.extend((f"{name}.{k}", x, 3) for k, x in v.items())
        else:
            todo.append((name, v, 2))
    while todo:
        name, v, depth = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise OpenAIError(f"{name} holds a non-finite number ({v}); NaN and Infinity are not JSON", param=name)
        if isinstance(v, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise OpenAIError(f"{name} is nested deeper than the limit of {MAX_JSON_DEPTH} levels", param=name)
            todo.extend((name, x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def _deep_field(raw: bytes) -> str | None:
    """The top-level field of a body too deep for the JSON decoder (a scan of its brackets)."""
    depth, last_key = 0, None
    for m in _JSON_TOKEN.finditer(raw):
        t = m.group()
        if t[0] == 0x22:  # a string: at depth 1, the latest one before a container is its key
            if depth == 1:
                last_key = t
        elif t in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                try:
                    return json.loads(last_key) if last_key is not None else None
                except ValueError:
                    return None
        else:
            depth -= 1
    return None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if is_ids(prompt) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (is_ids(p) and p) for p in prompt):
        return list(prompt)
    raise OpenAIError("prompt must be a string, a list of strings, a list of token ids, or a list of those (non-empty)", param="prompt")


def _flatten_messages(messages: Any) -> list[dict[str, Any]]:
    """Text parts joined into one string per message (the templates expect strings); the fields
    a template reads are checked here, so a malformed one is a 400, not an error mid-render."""
    if not isinstance(messages, list):
        raise OpenAIError("messages must be a list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param="messages")
        m = dict(m)
        if isinstance(m.get("content"), list):
            parts = []
            for p in m["content"]:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise OpenAIError(f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(p["text"])
            m["content"] = "".join(parts)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise OpenAIError(f"messages[{i}].{key} must be a string", param="messages")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)):
            raise OpenAIError(f"messages[{i}].tool_calls must be a list of {{type: function, function: {{name, arguments}}}}",
                              param="messages")
        out.append(m)
    try:
        validate_messages(out)
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None
    return out


def _forced_prefix(parser: str, choice: str, name: str | None) -> str:
    """The opening of a tool call written for the model. It stops before a space or quote: BPE
    merges those with what follows, and a prefix cut inside such a merge reads as text the model
    never saw in training."""
    if choice == "named":
        return f'<tool_call>\n{{"name": "{name}", "arguments":' if parser == "hermes" else f"<tool_call>\n<function={name}>\n"
    if choice == "required":
        return '<tool_call>\n{"name":' if parser == "hermes" else "<tool_call>\n<function="
    return ""


def add_rl_routes(app: FastAPI, engine: AsyncEngine, max_body_bytes: int = MAX_BODY_BYTES, on_disconnect=lambda: None) -> None:
    """Routes for RL trainers (`cuttle.rl.RolloutClient` speaks them); under /v1, so behind auth.

    POST /v1/rl/generate        {"prompts": [[ids], ...], "sampling_params": {...}} -> one entry per
                                prompt: {"weight_version", "samples": [{"token_ids", "logprobs",
                                "finish_reason", "text"}]}. Token ids in and out; `n` samples per
                                prompt fork from one prefill; logprobs are the engine's (processed).
                                A trainer that disconnects aborts all of its rollouts.
    POST /v1/rl/update_weights  body: a safetensors file (HF or engine parameter names; not
                                subject to the JSON body limit); ?in_flight=abort|finish ->
                                {"weight_version"}
    GET  /v1/rl/weight_version  -> {"weight_version"}
    """
    from safetensors.torch import load as load_safetensors

    llm = engine.engine

    @app.post("/v1/rl/generate")
    async def rl_generate(request: Request) -> dict[str, Any]:
        body = await json_body(request, max_body_bytes)
        check_fields(body, RL_FIELDS)
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
            raise OpenAIError("prompts must be a non-empty list of non-empty token-id lists", param="prompts")
        raw = body.get("sampling_params") or {}
        if not isinstance(raw, dict):
            raise OpenAIError("sampling_params must be an object", param="sampling_params")
        try:
            check_fields(raw, RL_SAMPLING_FIELDS, raw.get("n", 1))
            params = sampling_params(raw, default_max_tokens=None, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        except OpenAIError as e:
            e.param = f"sampling_params.{e.param}" if e.param else "sampling_params"
            raise
        base = uuid.uuid4().hex

        async def run() -> list[RequestOutput]:
            streams = await admit(engine, [(f"rl-{base}-{i}", p) for i, p in enumerate(prompts)], params, None, "prompts",
                                   "sampling_params.max_tokens", "sampling_params.n")
            try:
                return [await _final(s) for s in streams]
            finally:
                for s in streams:
                    s.close()

        finals = await until_disconnect(request, run(), on_disconnect)
        results = []
        for out in finals:
            samples = [
                {"token_ids": c.token_ids, "logprobs": [d[t].logprob for d, t in zip(c.logprobs or [], c.token_ids)],
                 "finish_reason": c.finish_reason, "text": c.text}
                for c in out.outputs
            ]
            results.append({"weight_version": int(out.metrics["weight_version"]), "samples": samples})
        return {"results": results}

    @app.post("/v1/rl/update_weights")
    async def rl_update_weights(request: Request, in_flight: str = "abort") -> dict[str, Any]:
        if in_flight not in ("abort", "finish"):
            raise OpenAIError("in_flight must be 'abort' or 'finish'", param="in_flight")
        try:
            tensors = load_safetensors(await request.body())
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            raise OpenAIError(f"body is not a safetensors file: {e}") from None
        try:
            version = await engine.update_weights(tensors.items(), in_flight)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        return {"weight_version": version}

    @app.get("/v1/rl/weight_version")
    async def rl_weight_version() -> dict[str, Any]:
        return {"weight_version": llm.weight_version}
