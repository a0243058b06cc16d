"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, over one `AsyncEngine`.

Owns HTTP concerns only: auth, JSON errors in OpenAI's shape, streaming (SSE), client
disconnects (the request is aborted and its KV freed within one engine step), admission limits
(503 + Retry-After), and latency metrics measured as the client sees them. Everything about
sampling lives in the engine; everything about the wire format in `openai_protocol`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cuttle.engine.async_engine import AsyncEngine, QueueFullError
from cuttle.engine.metrics import ServerMetrics
from cuttle.engine.openai_protocol import (
    OpenAIError, Usage, chat_logprobs, check_response_format, completion_logprobs, sampling_params,
)
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.tool_parsers import PARSERS, StreamingToolParser, parse_tool_calls, parser_for_template
from cuttle.engine.tokenizer import validate_messages

log = logging.getLogger("cuttle.server")


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                err = OpenAIError("invalid or missing API key", 401, "authentication_error", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

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

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise OpenAIError(f"model {model!r} does not exist; this server serves {model_name!r}", param="model", code="model_not_found")
        return body

    def stream_of(rid: str, prompt: str | list[int], params, salt: str | None) -> AsyncIterator[RequestOutput]:
        return engine.generate(rid, prompt, params, cache_salt=salt)

    async def first_output(agen: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Start a request and surface admission errors (400 / 503) before any byte is sent."""
        try:
            return await agen.__anext__()
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        except QueueFullError as e:
            raise OpenAIError(f"server is at capacity: {e}", 503, "server_busy") from None

    async def until_disconnect(request: Request, coro) -> Any:
        """Run a non-streaming handler body, cancelling it (and so aborting its requests) if the client leaves."""
        task = asyncio.ensure_future(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise OpenAIError("client disconnected", 499)

    def observe(out: RequestOutput, t0: float, state: dict[str, float]) -> None:
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

    # ---- /v1/completions -------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        if "prompt" not in body:
            raise OpenAIError("prompt is required", param="prompt")
        prompts = _prompts(body["prompt"])
        echo = bool(body.get("echo", False))
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20):
            raise OpenAIError("logprobs must be an integer in [0, 20]", param="logprobs")
        params = sampling_params(body, logprobs=lp, prompt_logprobs=lp if echo and lp is not None else None)
        want_ids = bool(body.get("return_token_ids", False))
        salt = body.get("cache_salt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        t0 = time.monotonic()
        streams = [stream_of(f"{rid}-{i}", p, params, salt) for i, p in enumerate(prompts)]
        firsts = []
        try:
            for s in streams:
                firsts.append(await first_output(s))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise

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

        if not body.get("stream"):
            async def collect() -> list[RequestOutput]:
                finals = []
                for s, first in zip(streams, firsts):
                    out, state = first, {}
                    observe(out, t0, state)
                    async for out in s:
                        observe(out, t0, state)
                    finals.append(out)
                return finals

            finals = await until_disconnect(request, collect())
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

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stop_hold = max((len(s) for s in params.stop), default=1) - 1

        async def sse() -> AsyncIterator[str]:
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, s: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
                try:
                    await merged.put((i, first))
                    async for out in s:
                        await merged.put((i, out))
                except Exception as e:  # noqa: BLE001
                    await merged.put((i, e))

            tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
            sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, sample) -> (chars, tokens) sent
            usage, done, states = Usage(), 0, [dict() for _ in streams]
            try:
                while done < len(streams):
                    i, out = await merged.get()
                    if isinstance(out, Exception):
                        yield _sse({"error": OpenAIError(str(out), 500, "server_error").body()["error"]})
                        return
                    observe(out, t0, states[i])
                    for c in out.outputs:
                        key = (i, c.index)
                        chars, ntok = sent.get(key, (0, 0))
                        text = choice_text(out, c) if echo else c.text
                        if echo and key not in sent:
                            chars = 0
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
                        done += 1
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                                "choices": [], "usage": usage.to_openai()})
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:  # cancelling a pump closes its generator, which aborts the request
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for s in streams:
                    await s.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    # ---- /v1/chat/completions --------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        if "messages" not in body:
            raise OpenAIError("messages is required", param="messages")
        messages = _flatten_messages(body["messages"])
        check_response_format(body)
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str) for t in tools)):
            raise OpenAIError("tools must be a list of {type: function, function: {name, parameters}}", param="tools")
        choice = body.get("tool_choice", "auto" if tools else "none")
        forced_name = None
        if isinstance(choice, dict):
            forced_name = (choice.get("function") or {}).get("name")
            if not tools or forced_name not in {t["function"]["name"] for t in tools}:
                raise OpenAIError(f"tool_choice names function {forced_name!r}, which is not in tools", param="tool_choice")
            choice = "named"
        elif choice not in ("auto", "none", "required"):
            raise OpenAIError("tool_choice must be 'auto', 'none', 'required' or {type: function, function: {name}}", param="tool_choice")
        elif choice == "required" and not tools:
            raise OpenAIError("tool_choice 'required' needs tools", param="tool_choice")
        use_tools = tools is not None and choice != "none"
        want_lp = bool(body.get("logprobs", False))
        top_n = _get_int(body, "top_logprobs", 0, 20, 0)
        if top_n and not want_lp:
            raise OpenAIError("top_logprobs requires logprobs: true", param="top_logprobs")
        params = sampling_params(body, "max_completion_tokens", default_max_tokens=None, logprobs=top_n if want_lp else None)
        try:
            prompt_ids = tok.encode_chat(messages, tools=tools if use_tools else None, add_generation_prompt=True)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        # required / named tool_choice: the call's opening is written for the model (prefix forcing)
        forced = _forced_prefix(parser, choice, forced_name)
        if forced:
            prompt_ids = prompt_ids + tok.encode(forced, add_special_tokens=False)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        t0 = time.monotonic()
        stream = stream_of(rid, prompt_ids, params, body.get("cache_salt"))
        first = await first_output(stream)

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

        if not body.get("stream"):
            async def collect() -> RequestOutput:
                out, state = first, {}
                observe(out, t0, state)
                async for out in stream:
                    observe(out, t0, state)
                return out

            out = await until_disconnect(request, collect())
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

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stop_hold = max((len(s) for s in params.stop), default=1) - 1

        async def sse() -> AsyncIterator[str]:
            def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
                return _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                             "choices": choices, **extra})

            n = params.n
            parsers = [StreamingToolParser(parser, tools) if use_tools else None for _ in range(n)]
            sent_chars, sent_toks, ncalls = [0] * n, [0] * n, [0] * n
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(n)])
            state: dict[str, float] = {}
            out = first
            try:
                while True:
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
                                yield _sse({"error": OpenAIError("tool_choice requested but the model's output is not a valid tool call",
                                                                 500, "server_error").body()["error"]})
                                return
                            finish = "tool_calls" if ncalls[i] else c.finish_reason
                        if not delta and finish is None:
                            continue
                        ch = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
                        if want_lp and len(c.token_ids) > sent_toks[i]:
                            ch["logprobs"] = {"content": chat_logprobs(tok, c.token_ids[sent_toks[i]:], (c.logprobs or [])[sent_toks[i]:], top_n)}
                        sent_toks[i] = len(c.token_ids)
                        yield chunk([ch])
                    if out.finished:
                        break
                    out = await stream.__anext__()
                if include_usage:
                    usage = Usage()
                    usage.add(out)
                    yield chunk([], usage=usage.to_openai())
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    add_rl_routes(app, engine)
    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _get_int(body: dict[str, Any], name: str, lo: int, hi: int, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise OpenAIError(f"{name} must be an integer in [{lo}, {hi}]", param=name)
    return v


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
    """Text parts joined into one string per message (the templates expect strings)."""
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


def add_rl_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """Routes for RL trainers (`cuttle.rl.RolloutClient` speaks them); under /v1, so behind auth.

    POST /v1/rl/generate        {"prompts": [[ids], ...], "sampling_params": {...}} -> one entry per
                                prompt: {"weight_version", "samples": [{"token_ids", "logprobs",
                                "finish_reason", "text"}]}. Token ids in and out; `n` samples per
                                prompt fork from one prefill; logprobs are the engine's (processed).
    POST /v1/rl/update_weights  body: a safetensors file (HF or engine parameter names);
                                ?in_flight=abort|finish -> {"weight_version"}
    GET  /v1/rl/weight_version  -> {"weight_version"}
    """
    from safetensors.torch import load as load_safetensors

    llm = engine.engine

    @app.post("/v1/rl/generate")
    async def rl_generate(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(f"request body is not valid JSON: {e}") from None
        prompts = body.get("prompts") if isinstance(body, dict) else None
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
            raise OpenAIError("prompts must be a non-empty list of non-empty token-id lists", param="prompts")
        raw = body.get("sampling_params") or {}
        if not isinstance(raw, dict):
            raise OpenAIError("sampling_params must be an object", param="sampling_params")
        params = sampling_params(raw, default_max_tokens=None, logprobs=0)
        base = uuid.uuid4().hex

        async def one(i: int, prompt: list[int]) -> RequestOutput:
            last: RequestOutput | None = None
            try:
                async for out in engine.generate(f"rl-{base}-{i}", prompt, params):
                    last = out
            except ValueError as e:
                raise OpenAIError(f"prompts[{i}]: {e}") from None
            except QueueFullError as e:
                raise OpenAIError(f"server is at capacity: {e}", 503, "server_busy") from None
            assert last is not None
            return last

        async def run() -> list[RequestOutput]:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        task = asyncio.ensure_future(run())
        while True:  # a trainer that goes away must not leave its rollouts running
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                raise OpenAIError("client disconnected", 499)
        results = []
        for out in task.result():
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
