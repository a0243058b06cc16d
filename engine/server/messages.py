"""POST /v1/messages (Anthropic's Messages API, as Claude Code and the Anthropic SDKs speak it) and
POST /v1/messages/count_tokens.

Owns the Messages wire format: `system` and content blocks -> chat messages, `tools` (name,
description, input_schema) / `tool_choice` (auto, any, tool, none) / `thinking` /
`stop_sequences` -> their chat equivalents, the assistant message a sample becomes -> content
blocks (`thinking`, `text`, `tool_use`) with a `stop_reason`, the streamed event sequence
(`message_start` ... `message_stop`) and Anthropic's error shape. Everything between is chat's:
the request is checked and rendered by chat.prepare_chat (template, tools and their grammar,
reasoning split, tool-call replay), so a Messages request and the equivalent chat request give the
same prompt and the same text.

Blocks map to messages as the chat templates expect them: a user turn's `tool_result` blocks
become `tool` messages (in order, before the turn's text), an assistant turn's `tool_use` blocks
its tool calls (the id is the call's, so the replay of the model's exact text applies), its
`thinking` blocks its `reasoning_content`. A thinking block's `signature` is cuttle's seal of its
text (responses.seal_reasoning): a block sent back with a signature that does not seal its text is
refused. `cache_control` on blocks is accepted: the prefix cache finds shared prefixes by their
tokens, with or without the hint. `thinking.type` "enabled" / "disabled" turns the template's
thinking on or off (`enable_thinking`, or gpt-oss's `reasoning_effort`: budgets below 4,096 tokens
as "low", below 16,384 "medium", else "high"); a template with neither switch refuses it. On an
`enable_thinking` template `budget_tokens` is the request's `thinking_token_budget`: once the
model has thought that many tokens its closing tag is forced (engine/structured_output.py). cuttle's sampling extensions (seed, min_p, penalties, ignore_eos, ...) are taken
as on the other routes. Images, documents, server tools and the other beta fields are refused,
naming the field.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from cuttle.engine.openai_protocol import SAMPLING_FIELDS, OpenAIError, Usage, show
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.server.body import read_body
from cuttle.engine.server.chat import ChatCall, flatten_messages, prepare_chat, renamed_errors
from cuttle.engine.server.chat_prompt import ChatOptions, ToolCallReplay, read_chat_template
from cuttle.engine.server.responses import seal_reasoning, unseal_reasoning
from cuttle.engine.server.streaming import Delta, Fields, Serving
from cuttle.engine.tokenizer import Tokenizer

# Anthropic's fields, and cuttle's sampling extensions as on the other routes (seed, min_p, penalties,
# ignore_eos, ...: vLLM's names)
_EXTENSIONS = SAMPLING_FIELDS - {"n", "max_tokens", "stop", "truncate_prompt_tokens"}
MESSAGES_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                             "top_k", "tools", "tool_choice", "thinking", "metadata"}) | _EXTENSIONS
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
# chat field -> the Messages field a refusal from prepare_chat is about
_NAMES = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
          "chat_template_kwargs": "thinking", "thinking_token_budget": "thinking", "response_format": "tools",
          "messages": "messages"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
# Anthropic's error types by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for a failed request (what /v1/messages answers instead of OpenAI's)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def add_message_routes(app: FastAPI, serving: Serving, tok: Tokenizer, opts: ChatOptions) -> None:
    replay: ToolCallReplay = app.state.tool_call_replay  # shared with chat: a call made there replays here too

    def prepared(body: dict[str, Any], count_only: bool = False) -> ChatCall:
        try:
            template_reads = set(tok.template_variables(opts.chat_template))
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        chat_body, messages = to_chat(body, template_reads, count_only)
        tmpl = _renamed(lambda: read_chat_template(chat_body, tok, opts))
        messages = replay.restore(_renamed(lambda: flatten_messages(messages)[0]))
        call = _renamed(lambda: prepare_chat(chat_body, messages, [], tmpl, serving, tok, opts, replay))
        call.fields = Fields("messages", "max_tokens", structured="tools")
        return call

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), COUNT_FIELDS)
        return {"input_tokens": _prompt_tokens(prepared(body, count_only=True), tok)}

    @app.post("/v1/messages")
    async def create(request: Request):
        t0 = time.monotonic()
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), MESSAGES_FIELDS)
        call = prepared(body)
        mid = f"msg_{uuid.uuid4().hex}"
        model = body.get("model") or serving.model_name
        if not body.get("stream"):
            def respond(finals: list[RequestOutput]) -> dict[str, Any]:
                [final] = finals
                [c] = final.outputs
                msg, _ = call.message_of(c.text, c.finish_reason == "length")
                usage = Usage()
                usage.add_prompt(final)
                usage.add_completion(final)
                return _message(mid, model, _blocks(msg), c.finish_reason, c.stop_reason, usage.to_openai())

            return await serving.complete(request, [(mid, call.prompt)], call.params, call.admission, call.fields, respond, t0)

        streams = await serving.open(request, [(mid, call.prompt)], call.params, call.admission, call.fields)
        reader = call.delta_reader()
        ended: dict[str, Any] = {}

        def choice(d: Delta) -> dict[str, Any] | None:
            if d.sample.finish_reason is not None:
                ended["stop_reason"] = d.sample.stop_reason
            return reader(d)

        frames = serving.frames(streams, choice, lambda choices, **extra: {"choices": choices, **extra}, True, t0)
        return StreamingResponse(_events(frames, mid, model, _prompt_tokens(call, tok), ended), media_type="text/event-stream")


# ---- the request ------------------------------------------------------------------------------
def to_chat(body: dict[str, Any], template_reads: set[str], count_only: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat body and messages equivalent to a Messages body (prepare_chat reads them)."""
    chat: dict[str, Any] = {}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise OpenAIError(f"max_tokens is required: an integer >= 1, got {show(max_tokens)}", param="max_tokens")
        chat["max_tokens"] = max_tokens
        for name in _EXTENSIONS:  # (temperature, top_p and top_k among them)
            if body.get(name) is not None:
                chat[name] = body[name]
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise OpenAIError("stop_sequences must be a list of non-empty strings", param="stop_sequences")
            chat["stop"] = stops
        meta = body.get("metadata")
        if meta is not None and (not isinstance(meta, dict) or set(meta) - {"user_id"}):
            raise OpenAIError("metadata must be {user_id} (an id for abuse tracking; it does not change the output)",
                              param="metadata")
        chat["stream"] = bool(body.get("stream"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise OpenAIError("tools must be a list", param="tools")
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(tools)] or None
    choice, parallel = _chat_tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    kwargs = _thinking_kwargs(body.get("thinking"), template_reads, chat.get("max_tokens"))
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
        if kwargs.get("enable_thinking"):  # the budget is enforced: its closing tag is forced once it is spent
            chat["thinking_token_budget"] = body["thinking"]["budget_tokens"]
    return chat, _messages(body.get("system"), body.get("messages"))


def _chat_tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise OpenAIError(f"tools[{i}] must be an object", param="tools")
    kind = t.get("type")
    if kind not in (None, "custom"):
        raise OpenAIError(f"tools[{i}].type {show(kind)} is not supported: cuttle serves client tools ({{name, description, "
                          "input_schema}}, run by the client); Anthropic's server tools (web search, code execution, bash, "
                          "text editor, ...) are not built in", param="tools")
    unknown = set(t) - {"type", "name", "description", "input_schema", "cache_control"}
    if unknown:
        raise OpenAIError(f"tools[{i}]: unknown field(s) {sorted(unknown)}", param="tools")
    if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
        raise OpenAIError(f"tools[{i}] needs a string name and an input_schema object", param="tools")
    fn = {"name": t["name"], "parameters": t["input_schema"]}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise OpenAIError("tool_choice must be {type: auto | any | tool | none} (tool: with its name)", param="tool_choice")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if unknown:
        raise OpenAIError(f"tool_choice: unknown field(s) {sorted(unknown)}", param="tool_choice")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise OpenAIError("tool_choice {type: tool} needs the tool's name", param="tool_choice")
        chat = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat = {"auto": "auto", "any": "required", "none": "none"}[kind]
    single = choice.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise OpenAIError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    return chat, (False if single else None)


def _thinking_kwargs(thinking: Any, template_reads: set[str], max_tokens: int | None) -> dict[str, Any] | None:
    """Anthropic's `thinking` as the chat template reads it (see the module docstring)."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled") \
            or set(thinking) - {"type", "budget_tokens"}:
        raise OpenAIError("thinking must be {type: enabled, budget_tokens} or {type: disabled}", param="thinking")
    on = thinking["type"] == "enabled"
    budget = thinking.get("budget_tokens")
    if on:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise OpenAIError(f"thinking.budget_tokens must be an integer >= 1024, got {show(budget)}", param="thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise OpenAIError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})", param="thinking")
    if "reasoning_effort" in template_reads:  # gpt-oss: its effort levels (it always reasons)
        if not on:
            raise OpenAIError("thinking {type: disabled} is not supported by this model: it always reasons (its template reads "
                              "reasoning_effort, whose lowest level is 'low')", param="thinking")
        return {"reasoning_effort": "low" if budget < 4096 else "medium" if budget < 16384 else "high"}
    if "enable_thinking" in template_reads:
        return {"enable_thinking": on}
    raise OpenAIError("thinking is not supported by this model's chat template: it reads neither enable_thinking nor "
                      "reasoning_effort, so the request would change nothing", param="thinking")


def _text(blocks: Any, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """A content field's text: a string, or text blocks (`cache_control` accepted)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise OpenAIError(f"{where} must be a string or a list of content blocks", param="messages")
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allowed or not isinstance(b.get("text"), str):
            raise OpenAIError(f"{where}[{j}]: only text blocks are supported here, got type {show(kind)}", param="messages")
        if set(b) - {"type", "text", "cache_control", "citations"} or b.get("citations"):
            raise OpenAIError(f"{where}[{j}]: unknown field(s) {sorted(set(b) - {'type', 'text', 'cache_control'})}",
                              param="messages")
        out.append(b["text"])
    return "".join(out)


def _messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of {role, content}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
            raise OpenAIError(f"messages[{i}] must be {{role: user | assistant, content}}", param="messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise OpenAIError(f"messages[{i}].content must be a string or a list of content blocks", param="messages")
        if m["role"] == "user":
            out.extend(_user_turn(content, i))
        else:
            out.append(_assistant_turn(content, i))
    return out


def _user_turn(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """A user turn's blocks: each tool_result a `tool` message, then its text as one user message."""
    tools, texts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str) or set(b) - {"type", "tool_use_id", "content", "is_error", "cache_control"}:
                raise OpenAIError(f"{where}: a tool_result needs a tool_use_id (and may have content, is_error)", param="messages")
            text = _text(b.get("content") if b.get("content") is not None else "", f"{where}.content")
            if b.get("is_error"):
                text = f"Error: {text}"  # (chat has no error flag: the templates see the text)
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind == "text":
            texts.append(_text([b], f"messages[{i}].content"))
        else:
            raise OpenAIError(f"{where}: block type {show(kind)} is not supported in a user turn (text and tool_result are; "
                              "images and documents are not)", param="messages")
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def _assistant_turn(blocks: list[Any], i: int) -> dict[str, Any]:
    """An assistant turn's blocks: text as content, tool_use as tool calls, thinking as reasoning."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    calls, reasoning = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            msg["content"] += _text([b], f"messages[{i}].content")
        elif kind == "tool_use":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)) \
                    or set(b) - {"type", "id", "name", "input", "cache_control"}:
                raise OpenAIError(f"{where}: a tool_use needs an id, a name and an input object", param="messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str) or set(b) - {"type", "thinking", "signature"}:
                raise OpenAIError(f"{where}: a thinking block needs its thinking text (and its signature)", param="messages")
            if b.get("signature") is not None:
                try:
                    sealed = unseal_reasoning(b["signature"], where)
                except OpenAIError:
                    sealed = None
                if sealed != b["thinking"]:
                    raise OpenAIError(f"{where}: the signature was not made for this thinking text by this server (or "
                                      "was altered); run the servers with one CUTTLE_REASONING_KEY", param="messages")
            reasoning.append(b["thinking"])
        else:
            raise OpenAIError(f"{where}: block type {show(kind)} is not supported in an assistant turn (text, tool_use and "
                              "thinking are)", param="messages")
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return msg


def _renamed(build: Callable[[], Any]) -> Any:
    """Run a chat step, its refusals naming the Messages field instead of the chat one (in
    `param` only: `stop` -> `stop_sequences` would mangle words of the message)."""
    return renamed_errors(build, _NAMES, in_text=False)


# ---- the response -----------------------------------------------------------------------------
def _blocks(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole sample's chat message (ChatCall.message_of) as content blocks."""
    out: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": seal_reasoning(msg["reasoning_content"])})
    if msg.get("content") or not msg.get("tool_calls"):
        out.append({"type": "text", "text": msg.get("content") or ""})
    for c in msg.get("tool_calls") or []:
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c["function"]["arguments"])})
    return out


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use input object ({} for a call cut off before they closed)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a sample's finish: a stop string that matched is a
    `stop_sequence`; an end token `end_turn`."""
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP.get(finish or "stop", "end_turn"), None


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage -> Anthropic's, whose input_tokens are the prompt tokens neither read from the
    prefix cache (cache_read_input_tokens) nor written to it (cache_creation_input_tokens)."""
    details = usage.get("prompt_tokens_details") or {}
    read, written = details.get("cached_tokens") or 0, details.get("cache_write_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"] - read - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read, "output_tokens": usage["completion_tokens"]}


def _message(mid: str, model: str, blocks: list[dict[str, Any]], finish: str | None, stop_reason: Any,
             usage: dict[str, Any]) -> dict[str, Any]:
    reason, sequence = _stop(finish, stop_reason)
    if reason == "end_turn" and any(b["type"] == "tool_use" for b in blocks):
        reason = "tool_use"
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(usage)}


def _prompt_tokens(call: ChatCall, tok: Tokenizer) -> int:
    """The length of the prompt a request renders (ids; squid parts counted whole)."""
    p = call.prompt
    if isinstance(p, dict):
        return len(p.get("prefix") or []) + sum(len(d) for d in p.get("documents") or []) + len(p["prompt"])
    return len(p) if isinstance(p, list) else len(tok.encode(p, add_special_tokens=False))


async def _events(frames: AsyncIterator[dict[str, Any]], mid: str, model: str, prompt_tokens: int,
                  ended: dict[str, Any]) -> AsyncIterator[str]:
    """The Messages event stream of one streamed message, from chat's frames: each content block
    opened (`content_block_start`), its deltas, closed (`content_block_stop`), and the message's
    own events around them."""
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    index = -1
    open_kind: str | None = None
    thinking = ""
    finish: str | None = None
    called = False

    def close() -> list[str]:
        nonlocal open_kind, thinking
        evs = []
        if open_kind == "thinking":  # its signature seals the whole text, sent last
            evs.append(event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": seal_reasoning(thinking)}))
        if open_kind is not None:
            evs.append(event("content_block_stop", index=index))
        open_kind, thinking = None, ""
        return evs

    def opened(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal open_kind, index
        if open_kind == kind and kind != "tool_use":
            return []
        evs = close()
        index += 1
        open_kind = kind
        evs.append(event("content_block_start", index=index, content_block=block))
        return evs

    start = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
             "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield event("message_start", message=start)
    async with aclosing(frames) as frames_:
        async for frame in frames_:
            if "error" in frame:
                yield event("error", error={"type": "api_error", "message": frame["error"]["message"]})
                return
            if "usage" in frame and not frame["choices"]:
                if index < 0:  # nothing was sampled: an empty text block, as a whole message would hold
                    for ev in opened("text", {"type": "text", "text": ""}):
                        yield ev
                for ev in close():
                    yield ev
                reason, sequence = _stop(finish, ended.get("stop_reason"))
                if reason == "end_turn" and called:
                    reason = "tool_use"
                yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=_usage(frame["usage"]))
                yield event("message_stop")
                return
            [ch] = frame["choices"]
            delta = ch["delta"]
            if ch.get("finish_reason") is not None:
                finish = ch["finish_reason"]
            if delta.get("reasoning_content"):
                for ev in opened("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                    yield ev
                thinking += delta["reasoning_content"]
                yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                for ev in opened("text", {"type": "text", "text": ""}):
                    yield ev
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta["content"]})
            for tc in delta.get("tool_calls") or ():
                fn = tc["function"]
                if "id" in tc:  # a call's first piece: its block opens
                    called = True
                    for ev in opened("tool_use", {"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": {}}):
                        yield ev
                if fn.get("arguments"):
                    yield event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": fn["arguments"]})
