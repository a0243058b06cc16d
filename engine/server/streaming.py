"""The one path from admitted requests to what a client receives, shared by every route.

Owns: admitting a route's prompts (all in one engine round trip, or none; an engine refusal
becomes a 400 naming the field), racing the engine work against the client's `http.disconnect`
(a client that leaves aborts its requests: the engine frees their KV before its next step), the
final outputs of a non-streamed request, the SSE events of a streamed one, usage counts, latency
metrics as the client sees them, and turning one request's failure into that client's error.

Streamed requests ask the engine for DELTA outputs: each output carries only the tokens, text
and logprobs that are new since the previous one (text that a stop string could still cut off is
held back by the engine), so a stream costs O(L) in all. Non-streamed requests ask for FINAL_ONLY
(one cumulative output at the end). A route supplies only how one delta of one sample becomes a
choice of its wire format; it never sees a RequestStream.

Disconnects: the handler's engine work runs in a task raced against the ASGI `receive` channel,
which delivers `http.disconnect` the moment the connection drops; the task is then cancelled,
which closes its RequestStreams, which queue the aborts. For a streamed response Starlette
cancels the event generator itself, whose `finally` closes the streams.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from cuttle.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError, RequestOptions, RequestStream
from cuttle.engine.sleep_mode import EngineAsleepError
from cuttle.engine.metrics import ServerMetrics
from cuttle.engine.openai_protocol import OpenAIError, Usage, get_bool
from cuttle.engine.outputs import CompletionOutput, RequestOutput
from cuttle.engine.sampling_params import SamplingParams

log = logging.getLogger("cuttle.server")

Prompt = str | list[int] | dict[str, Any]  # what AsyncEngine.add takes (a dict: squid documents)


@dataclass(slots=True)
class Fields:
    """The request fields an engine refusal at admission can be about (the 400's `param`)."""

    prompt: str
    max_tokens: str = "max_tokens"
    n: str = "n"
    documents: str = "documents"
    prefix: str = "prefix"
    structured: str = "structured_outputs"  # the field the grammar came from (guided_json, response_format, tools, ...)
    sampling: str = ""  # the sampling fields' prefix (/v1/rl/generate: "sampling_params.")

    def of(self, msg: str) -> str:
        """The field a `ValueError` from `LLMEngine.add_request` names (its messages start with it)."""
        if msg.startswith("n ("):
            return self.n
        if "max_tokens" in msg:  # prompt (+ documents) + max_tokens over max_model_len
            return self.max_tokens
        if msg.startswith(("documents", "prefix + documents")) or "with documents" in msg:
            return self.documents
        if msg.startswith("prefix"):
            return self.prefix
        if msg.startswith("priority"):
            return "priority"
        if msg.startswith("structured_outputs"):  # its grammar failed to compile (on the worker thread)
            return self.structured
        # token ids past the vocabulary; a thinking budget on a model without thinking tags
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids", "thinking_token_budget"):
            if msg.startswith(name):
                return self.sampling + name
        return self.prompt


@dataclass(slots=True)
class Delta:
    """What is new for one sample of one prompt in one output of a streamed request."""

    prompt: int  # which of the request's prompts
    out: RequestOutput
    sample: CompletionOutput  # the new text / token ids / logprobs only (a DELTA output)
    first: bool  # this sample's first delta


class Serving:
    """The engine, the model name and the metrics, with the request lifecycle every route uses."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None, max_body_bytes: int,
                 on_disconnect: Callable[[], None] | None = None, return_tokens_as_token_ids: bool = False):
        self.engine, self.model_name, self.metrics, self.max_body_bytes = engine, model_name, metrics, max_body_bytes
        self._on_disconnect = on_disconnect
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # the server's default for the request field
        # the LoRA adapters a request's `model` may name (name -> PEFT directory, "" for one sent
        # in memory), changed on the event loop only (engine/server/lora_routes.py)
        self.adapters: dict[str, str] = {}

    def served_models(self) -> tuple[str, ...]:
        """What a request's `model` may be: the base model's name, then each adapter's."""
        return (self.model_name, *self.adapters)

    def lora_of(self, body: dict[str, Any]) -> str | None:
        """The adapter a request runs under: its `model` when that names one, else None (the base)."""
        model = body.get("model")
        return model if model is not None and model != self.model_name and model in self.adapters else None

    def tokens_as_ids(self, body: dict[str, Any]) -> bool:
        """Whether this request's logprobs name tokens `token_id:N` (its field, else the server's default)."""
        return get_bool(body, "return_tokens_as_token_ids", self.return_tokens_as_token_ids)

    def disconnected(self) -> None:
        if self.metrics is not None:
            self.metrics.disconnects.labels(self.model_name).inc()
        if self._on_disconnect is not None:
            self._on_disconnect()

    # ---- admission ----------------------------------------------------------------------------
    async def open(self, request: Request, items: list[tuple[str, Prompt]], params: SamplingParams, opts: RequestOptions,
                   fields: Fields) -> list[RequestStream]:
        """Admit the prompts, raced against the client leaving (for a streamed response: its
        errors come back before any byte is sent)."""
        return await until_disconnect(request, admit(self.engine, items, params, opts, fields), self.disconnected)

    async def complete(self, request: Request, items: list[tuple[str, Prompt]], params: SamplingParams, opts: RequestOptions,
                       fields: Fields, respond: Callable[[list[RequestOutput]], Any], t0: float, observe: bool = True) -> Any:
        """A non-streamed request: admit, wait for every final output (FINAL_ONLY), build the
        response with `respond`; all of it abandoned, and the requests aborted, if the client leaves.
        `t0`: when the request arrived (latency is measured from there)."""
        async def run() -> Any:
            streams = await admit(self.engine, items, params, opts, fields)
            try:
                finals = [await final_output(s) for s in streams]
            finally:
                for s in streams:
                    s.close()
            if observe and self.metrics is not None:
                for out in finals:
                    self._observe_end(out, time.monotonic() - t0)
            return respond(finals)

        return await until_disconnect(request, run(), self.disconnected)

    # ---- streaming --------------------------------------------------------------------------
    def stream(self, streams: list[RequestStream], choice: Callable[[Delta], dict[str, Any] | None],
               frame: Callable[..., dict[str, Any]], include_usage: bool, t0: float,
               opening: list[dict[str, Any]] | None = None, continuous_usage: bool = False,
               opening_extra: Callable[[RequestOutput], dict[str, Any]] | None = None) -> StreamingResponse:
        """The SSE response of a streamed request: each of `frames`' objects as one event, then
        `[DONE]`; a failure after the response started is sent as one error event, without `[DONE]`."""

        async def events() -> AsyncIterator[str]:
            async with aclosing(self.frames(streams, choice, frame, include_usage, t0, opening, continuous_usage, opening_extra)) as frames:
                async for obj in frames:
                    yield sse(obj)
                    if "error" in obj:
                        return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def frames(self, streams: list[RequestStream], choice: Callable[[Delta], dict[str, Any] | None],
                     frame: Callable[..., dict[str, Any]], include_usage: bool, t0: float,
                     opening: list[dict[str, Any]] | None = None, continuous_usage: bool = False,
                     opening_extra: Callable[[RequestOutput], dict[str, Any]] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The objects of a streamed request, in order: `opening` choices first (one frame; with
        `opening_extra`, sent with the first output and carrying its fields, as vLLM sends chat's
        `prompt_token_ids`), then
        `choice(delta)` for every delta of every sample until it finishes (None: nothing to send
        yet), each in its own `frame(choices)`; the usage frame (`frame([], usage=...)`) if asked
        for. `continuous_usage` (vLLM's stream_options.continuous_usage_stats): each choice's frame
        also carries its prompt's tokens and its sample's tokens so far. A failure ends the frames
        with `{"error": ...}`. Closing the generator (the client left) aborts the requests."""
        usage, states = Usage(), [dict() for _ in streams]
        seen: set[tuple[int, int]] = set()
        sampled: dict[tuple[int, int], int] = {}  # tokens of each sample so far (continuous usage)
        ended: set[tuple[int, int]] = set()  # samples whose finish_reason was sent
        try:
            if opening and opening_extra is None:
                yield frame(opening)
            async for i, out in _merged(streams):
                if opening and opening_extra is not None:
                    yield frame(opening, **opening_extra(out))
                    opening = None
                self._observe_step(out, t0, states[i])
                usage.add_completion(out)
                for c in out.outputs:
                    key = (i, c.index)
                    if key in ended:  # an n > 1 request reports a finished sample until all end
                        continue
                    ch = choice(Delta(i, out, c, key not in seen))
                    seen.add(key)
                    if c.finish_reason is not None:
                        ended.add(key)
                    extra = {}
                    if continuous_usage:
                        sampled[key] = sampled.get(key, 0) + len(c.token_ids)
                        p = len(out.prompt_token_ids)
                        extra["usage"] = {"prompt_tokens": p, "completion_tokens": sampled[key], "total_tokens": p + sampled[key]}
                    if ch is not None:
                        yield frame([ch], **extra)
                if out.finished:
                    usage.add_prompt(out)
            if include_usage:
                yield frame([], usage=usage.to_openai())
        except asyncio.CancelledError:  # the client left (Starlette cancels the response)
            self.disconnected()
            raise
        except Exception as e:  # noqa: BLE001 - this client's failure goes to this client only
            yield {"error": as_openai_error(e).body()["error"]}
        finally:
            for s in streams:
                s.close()

    # ---- metrics ----------------------------------------------------------------------------
    def _observe_end(self, out: RequestOutput, latency: float) -> None:
        m, name = self.metrics, self.model_name
        assert m is not None
        m.e2e.labels(name).observe(latency)
        for c in out.outputs:
            m.requests.labels(name, c.finish_reason or "abort").inc()

    def _observe_step(self, out: RequestOutput, t0: float, state: dict[str, float]) -> None:
        """Latency of a streamed request, as its client sees it (a non-streamed client sees only the end)."""
        m, name = self.metrics, self.model_name
        if m is None:
            return
        now = time.monotonic()
        if any(c.token_ids for c in out.outputs):
            if "first" not in state:
                state["first"] = now
                m.ttft.labels(name).observe(now - t0)
            elif "last" in state:
                m.itl.labels(name).observe(now - state["last"])
            state["last"] = now
        if out.finished:
            self._observe_end(out, now - t0)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def admit(engine: AsyncEngine, prompts: list[tuple[str, Prompt]], params: SamplingParams, opts: RequestOptions,
                fields: Fields) -> list[RequestStream]:
    """Admit every prompt (one engine round trip for all), or none: errors (400 / 503) come
    back before any byte is sent, and the requests already admitted are aborted."""
    if len(prompts) > engine.max_pending:  # each prompt is a request in flight: a 503 could never pass, retried or not
        raise OpenAIError(f"{fields.prompt} holds {len(prompts)} prompts, more than the {engine.max_pending} requests this server "
                          "takes in flight at once (--max-pending): send them in smaller batches", param=fields.prompt)
    got = await asyncio.gather(*(engine.add(rid, p, params, opts.cache_salt, opts.priority, opts.lora_request) for rid, p in prompts),
                               return_exceptions=True)
    err = next((e for e in got if isinstance(e, BaseException)), None)
    if err is None:
        return got
    for x in got:
        if isinstance(x, RequestStream):
            x.close()
    if isinstance(err, ValueError):  # the engine refused the request: say which field
        msg = str(err)
        if len(prompts) > 1 or fields.prompt == "prompts":
            msg = f"{fields.prompt}[{got.index(err)}]: {msg}"
        raise OpenAIError(msg, param=fields.of(str(err))) from None
    if isinstance(err, QueueFullError):
        raise OpenAIError(f"server is at capacity: {err}", 503, "server_busy") from None
    if isinstance(err, EngineAsleepError):
        raise OpenAIError(str(err), 503, "server_asleep") from None
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


async def until_disconnect(request: Request, work: Awaitable[Any], on_disconnect: Callable[[], None]) -> Any:
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


async def final_output(stream: RequestStream) -> RequestOutput:
    """A non-streamed (FINAL_ONLY) request's one output, once it has finished."""
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
