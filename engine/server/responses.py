"""POST /v1/responses (OpenAI's Responses API, as coding agents such as Codex CLI and the Agents
SDK speak it), with GET / DELETE /v1/responses/{id} for stored responses and POST
/v1/responses/{id}/cancel for background ones; a response may continue a conversation of the
Conversations API (`conversation`, engine/server/conversations.py) and then extends it.

Owns the Responses wire format: input items -> chat messages, Responses tools / tool_choice /
`text.format` / `reasoning` -> their chat equivalents, the assistant message a sample becomes ->
output items (`reasoning`, `message`, `function_call`), the streamed event sequence
(`response.created` ... `response.completed`), and the in-memory store behind `store` and
`previous_response_id`. Everything between is chat's: the request is checked and rendered by
chat.prepare_chat (template, tools and their grammar, reasoning split, tool-call replay), so a
Responses request and the equivalent chat request give the same prompt and the same text.

Items map to messages as the chat templates expect them: `message` items by role (text parts
only), a `function_call` item joins the assistant turn before it (or opens one) as a tool call
whose id is its `call_id`, a `function_call_output` item is a `tool` message answering a call
made earlier in the conversation, and a `reasoning` item's text becomes the
`reasoning_content` of the assistant turn that follows it.

The store keeps the last `max_responses` responses (and at most `max_bytes` of their JSON) in
memory, with the conversation each one ended; it is lost when the server stops. A request with
`previous_response_id` continues that conversation (its `instructions` are not carried over, as
in OpenAI's API); the replay of the model's exact text (chat_prompt.ToolCallReplay) keeps the
continuation a prefix-cache hit.

`background: true` answers at once with the response `in_progress` (the request admitted, so its
errors are still this request's): the generation runs as a task on the event loop, and its final
state (completed / incomplete, `failed` with the error, or `cancelled`) replaces the pending one
in the store, where GET reads it. Cancel (or DELETE) stops the task, which aborts the engine
request. Not with `stream` (refused), and only with `store`.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from cuttle.engine.openai_protocol import CHAT_FIELDS, RESPONSES_FIELDS, OpenAIError, Usage, chat_logprobs, get_bool, get_int, get_str, show
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.reasoning_parsers import split_reasoning
from cuttle.engine.server.body import read_body
from cuttle.engine.server.chat import ChatCall, flatten_messages, prepare_chat, renamed_errors
from cuttle.engine.server.chat_prompt import ChatOptions, ToolCallReplay, effort_kwargs, read_chat_template
from cuttle.engine.async_engine import RequestStream
from cuttle.engine.server.conversations import Conversation, ConversationStore, add_conversation_routes, check_metadata, page
from cuttle.engine.server.streaming import Delta, Fields, Serving, admit, as_openai_error, final_output
from cuttle.engine.tokenizer import Tokenizer

# Responses field -> the chat field prepare_chat reads (its errors are renamed back)
_CHAT_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text", "logprobs": "include", "chat_template_kwargs": "reasoning"}
_LOGPROBS = "message.output_text.logprobs"  # the `include` values cuttle produces
_SEALED = "reasoning.encrypted_content"
# the key reasoning items are sealed with (`encrypted_content`): CUTTLE_REASONING_KEY keeps sealed
# items valid across restarts and replicas; else one per server process
_SEAL_KEY = os.environ.get("CUTTLE_REASONING_KEY", "").encode() or secrets.token_bytes(32)
_SEAL_TAG = "cuttle-rs1"
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}  # item ids
MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 2**20


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, this response's output included, instructions excluded
    size: int
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as items with ids


class ResponseStore:
    """The responses a server keeps for `previous_response_id` and GET /v1/responses/{id}:
    bounded (the oldest go first), in memory, changed on the event loop only."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], new_bytes: int,
            input_items: list[dict[str, Any]] | None = None) -> None:
        """`new_bytes`: what this response adds (the response object with its output, echoed
        fields and metadata, and its input items); earlier turns of the
        conversation are shared with the responses that hold them."""
        old = self._items.pop(response["id"], None)  # a background response's final state replaces its pending one
        if old is not None:
            self._bytes -= old.size
        self._items[response["id"]] = _Stored(response, conversation, new_bytes, input_items or [])
        self._bytes += new_bytes
        while self._items and (len(self._items) > self.max_responses or self._bytes > self.max_bytes):
            _, old = self._items.popitem(last=False)
            self._bytes -= old.size

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        got = self._items.get(response_id)
        if got is None:
            raise OpenAIError(f"Response with id {show(response_id)} not found (this server keeps the last {self.max_responses} "
                              "stored responses, in memory)", 404, param=param, code="response_not_found")
        return got

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._bytes -= self._items.pop(response_id).size


def add_response_routes(app: FastAPI, serving: Serving, tok: Tokenizer, opts: ChatOptions, store: ResponseStore | None = None,
                        conversations: ConversationStore | None = None) -> None:
    replay: ToolCallReplay = app.state.tool_call_replay  # shared with chat: a call made there replays here too
    store = store if store is not None else ResponseStore()
    app.state.response_store = store
    conversations = conversations if conversations is not None else ConversationStore()
    app.state.conversations = conversations
    add_conversation_routes(app, conversations, serving.max_body_bytes, checked_conversation_items)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str) -> dict[str, Any]:
        """OpenAI's list of a stored response's input items (its own request's, with ids), paged
        by `limit` (1..100, default 20), `order` (desc, the default, or asc) and `after` (an id)."""
        return page(store.get(response_id).input_items, request, "response's input items")

    running: dict[str, asyncio.Task] = {}  # background responses still being generated, by id
    app.state.background_responses = running

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        store.get(response_id)
        await _stop(running, response_id)  # a background response being generated is cancelled first
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        """OpenAI's cancel of a background response: one being generated stops (its requests are
        aborted, status `cancelled`); a finished one is returned as it is."""
        stored = store.get(response_id)
        if not stored.response.get("background"):
            raise OpenAIError(f"response {show(response_id)} was not created with background: true; only background responses "
                              "can be cancelled", param="response_id")
        await _stop(running, response_id)
        return store.get(response_id).response

    @app.post("/v1/responses")
    async def create(request: Request):
        t0 = time.monotonic()
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), RESPONSES_FIELDS)
        req = _read_request(body, store, conversations)
        try:
            template_reads = set(tok.template_variables(opts.chat_template))
        except ValueError as e:
            raise OpenAIError(str(e), param="input") from None
        chat_body = _chat_body(body, req, template_reads)
        tmpl = _renamed(lambda: read_chat_template(chat_body, tok, opts))
        messages = _renamed(lambda: flatten_messages(req.system + req.history + req.new)[0])
        messages = replay.restore(messages)
        call = _renamed(lambda: prepare_chat(chat_body, messages, [], tmpl, serving, tok, opts, replay))
        if req.logprobs and (call.rstate is not None or call.tools is not None):
            raise OpenAIError(f"include {_LOGPROBS!r} cannot be combined with tools or a reasoning parser: the sampled tokens "
                              "cannot be split exactly between reasoning, text and tool-call items", param="include")
        call.fields = Fields("input", "max_output_tokens", documents="input", prefix="input",
                             structured="tools" if call.tools is not None and call.params.structured_outputs is not None else "text")
        rid = f"resp_{uuid.uuid4().hex}"
        out = _Output(rid, call, req, serving.model_name if call.admission.lora_request is None else call.admission.lora_request)

        if req.background:  # admitted now (its errors are this request's), generated while the client is away
            streams = await admit(serving.engine, [(rid, call.prompt)], call.params, call.admission, call.fields)
            pending = out.response(None, 0, status="in_progress")
            store.put(pending, [], len(json.dumps(pending)), input_items(req.raw_input))
            running[rid] = asyncio.ensure_future(_background(serving, store, req, out, call, tok, streams[0], running, t0))
            return pending

        if not req.stream:
            def respond(finals: list[RequestOutput]) -> dict[str, Any]:
                [final] = finals
                return _finished(final, out, call, tok, store, req)

            return await serving.complete(request, [(rid, call.prompt)], call.params, call.admission, call.fields, respond, t0)

        streams = await serving.open(request, [(rid, call.prompt)], call.params, call.admission, call.fields)
        reader, token_ids, texts = call.delta_reader(), [], []

        def choice(d: Delta) -> dict[str, Any] | None:
            token_ids.extend(d.sample.token_ids)
            texts.append(d.sample.text)
            return reader(d)

        frames = serving.frames(streams, choice, lambda choices, **extra: {"choices": choices, **extra}, True, t0)
        return StreamingResponse(_events(frames, out, store, req, tok, call, token_ids, texts), media_type="text/event-stream")


# ---- the request ------------------------------------------------------------------------------
@dataclass(slots=True)
class _ResponsesRequest:
    """A Responses body, checked, with its conversation as chat messages."""

    system: list[dict[str, Any]]  # the instructions, as a system message
    history: list[dict[str, Any]]  # the previous response's conversation
    new: list[dict[str, Any]]  # this request's input items
    raw_input: Any  # the input field as sent
    tools: list[dict[str, Any]]  # as sent (Responses shape)
    stream: bool
    store: bool
    logprobs: bool
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    background: bool = False  # answered at once (in_progress); the result is fetched from the store
    sealed: bool = False  # reasoning items carry `encrypted_content` (include reasoning.encrypted_content)
    conversation: Conversation | None = None  # the conversation it continues and extends (`conversation`)


def _read_request(body: dict[str, Any], store: ResponseStore, conversations: ConversationStore) -> _ResponsesRequest:
    if body.get("input") is None:
        raise OpenAIError("input is required", param="input")
    background = get_bool(body, "background")
    if background and get_bool(body, "stream"):
        raise OpenAIError("background: true with stream: true is not supported (a background response is fetched with GET "
                          "/v1/responses/{id} once it completes)", param="background")
    if background and not get_bool(body, "store", True):
        raise OpenAIError("background: true needs store: true (the response is fetched from the store)", param="background")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise OpenAIError(f"truncation {show(truncation)} is not supported: cuttle never drops input items (use 'disabled'; a "
                          "conversation longer than the context is refused)", param="truncation")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise OpenAIError(f"service_tier {show(tier)} is not supported (auto or default)", param="service_tier")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise OpenAIError("include must be a list of strings", param="include")
    for x in include:
        if x not in (_LOGPROBS, _SEALED):
            raise OpenAIError(f"include {show(x)} is not supported (it names output that cuttle does not produce); cuttle can "
                              f"include {_LOGPROBS!r} and {_SEALED!r}", param="include")
    logprobs = _LOGPROBS in include
    top = get_int(body, "top_logprobs", 0, 20, 0)
    if top and not logprobs:
        raise OpenAIError(f"top_logprobs needs include: [{_LOGPROBS!r}]", param="top_logprobs")
    get_int(body, "max_output_tokens", 1, 2**31 - 1)
    instructions = get_str(body, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    history: list[dict[str, Any]] = []
    prev = get_str(body, "previous_response_id")
    conv_field = body.get("conversation")
    conversation = None
    if conv_field is not None:
        if prev is not None:
            raise OpenAIError("conversation and previous_response_id cannot both be given: a response continues one or the "
                              "other", param="conversation")
        conv_id = conv_field.get("id") if isinstance(conv_field, dict) else conv_field
        if not isinstance(conv_id, str) or (isinstance(conv_field, dict) and set(conv_field) - {"id"}):
            raise OpenAIError("conversation must be a conversation id or {id}", param="conversation")
        conversation = conversations.get(conv_id, param="conversation")
        history = _input_messages(conversation.items, set()) if conversation.items else []
    if prev is not None:
        earlier = store.get(prev, param="previous_response_id")
        if earlier.response["status"] not in ("completed", "incomplete"):
            raise OpenAIError(f"previous_response_id {show(prev)} is {earlier.response['status']}: only a completed or incomplete "
                              "response continues a conversation", param="previous_response_id")
        history = earlier.conversation
    new = _input_messages(body["input"], _call_ids(history))
    metadata = check_metadata(body.get("metadata"))  # OpenAI's limits; the server keeps metadata with a stored response
    tools = body.get("tools") or []
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    echo = {"instructions": instructions, "tool_choice": body.get("tool_choice"),
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity") or "medium"},
            "reasoning": {"effort": reasoning.get("effort"), "summary": None}, "metadata": metadata or {}, "previous_response_id": prev,
            "max_output_tokens": body.get("max_output_tokens"), "top_logprobs": top if logprobs else None,
            "user": body.get("user"), "truncation": "disabled", "service_tier": tier or "auto", "background": background,
            "parallel_tool_calls": get_bool(body, "parallel_tool_calls", True),
            "conversation": {"id": conversation.id} if conversation is not None else None}
    return _ResponsesRequest(system, history, new, body["input"], tools, get_bool(body, "stream"),
                             get_bool(body, "store", True), logprobs, echo, background, _SEALED in include, conversation)


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {c.get("id") for m in messages for c in m.get("tool_calls") or ()}


def _input_messages(items: Any, known_calls: set[str]) -> list[dict[str, Any]]:
    """The input (a string, or a list of items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise OpenAIError("input must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    calls = set(known_calls)
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it

    def assistant_turn() -> dict[str, Any]:
        """The assistant message a function call joins: the last message if it is an assistant
        turn not yet answered by a tool, else a new one."""
        nonlocal reasoning
        if reasoning is None and out and out[-1]["role"] == "assistant":
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            out[-1]["reasoning_content"], reasoning = reasoning, None
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}.role must be user, system, developer or assistant, got {show(role)}", param="input")
            msg = {"role": role, "content": _text_of(item.get("content"), role, where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(args, str)):
                raise OpenAIError(f"{where}: a function_call item needs call_id, name and arguments (strings)", param="input")
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or call_id not in calls:
                raise OpenAIError(f"{where}: no function call with call_id {show(call_id)} precedes this output", param="input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, "tool", where + ".output")})
        elif kind == "reasoning":
            if item.get("summary"):  # another provider's summary of hidden reasoning: not text this model wrote
                raise OpenAIError(f"{where}.summary is not supported: cuttle renders a reasoning item's content (the "
                                  "model's own reasoning text); send the summary empty", param="input")
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
                                                     for p in parts):
                raise OpenAIError(f"{where}.content must be a list of {{type: reasoning_text, text}}", param="input")
            said = "".join(p["text"] for p in parts)
            if item.get("encrypted_content") is not None:  # a stateless client's round trip: the sealed text is the turn's
                sealed = unseal_reasoning(item["encrypted_content"], f"{where}.encrypted_content")
                if parts and said != sealed:
                    raise OpenAIError(f"{where}: content differs from the text its encrypted_content seals; send them as "
                                      "returned, or one of them", param="input")
                said = sealed
            reasoning = (reasoning or "") + said
        else:
            raise OpenAIError(f"{where}.type {show(kind)} is not supported (message, function_call, function_call_output, "
                              "reasoning)", param="input")
    if reasoning is not None:
        raise OpenAIError("input: a reasoning item must be followed by the assistant turn it belongs to", param="input")
    return out


def input_items(raw: Any) -> list[dict[str, Any]]:
    """A request's input (already checked by `_input_messages`) as OpenAI lists it back: items
    with ids (the client's, or new ones), a string as one user message, message content as parts."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    out = []
    for item in raw:
        kind = item.get("type", "message")
        it = {**item, "type": kind}
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            parts = [{"type": part, "text": item["content"]}] if isinstance(item["content"], str) else item["content"]
            # an assistant's text parts as an output message holds them (with their annotations)
            it["content"] = [{"annotations": [], **p} if p.get("type") == "output_text" else p for p in parts]
            it.setdefault("status", "completed")
        elif kind in ("function_call", "function_call_output"):
            it.setdefault("status", "completed")
        it["id"] = item.get("id") if isinstance(item.get("id"), str) else f"{_ITEM_PREFIX[kind]}_{uuid.uuid4().hex}"
        out.append(it)
    return out


def _text_of(content: Any, role: str, where: str) -> str:
    """A message's content: a string, or text parts (input_text; output_text for the assistant)."""
    if isinstance(content, str):
        return content
    kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds:
            raise OpenAIError(f"{where}.content[{j}]: only {' / '.join(kinds)} parts are supported here, got {show(kind)}",
                              param="input")
        text = p.get("text") if kind != "refusal" else p.get("refusal")
        if not isinstance(text, str):
            raise OpenAIError(f"{where}.content[{j}] needs its text as a string", param="input")
        texts.append(text)
    return "".join(texts)


def _chat_body(body: dict[str, Any], req: _ResponsesRequest, template_reads: set[str]) -> dict[str, Any]:
    """The chat fields equivalent to this Responses body (prepare_chat reads them)."""
    chat = {k: v for k, v in body.items() if k in _SHARED_FIELDS}
    chat["max_completion_tokens"] = body.get("max_output_tokens")
    chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)] or None
    chat["tool_choice"] = _chat_tool_choice(body.get("tool_choice"))
    chat["response_format"] = _response_format(body.get("text"))
    chat["chat_template_kwargs"] = _reasoning_kwargs(body.get("reasoning"), template_reads)
    chat["logprobs"] = req.logprobs
    chat["stream"] = req.stream
    return chat


# the fields that mean the same on both routes (sampling, vLLM's extensions, admission); tools,
# tool_choice and stream are converted by `_chat_body`
_SHARED_FIELDS = (RESPONSES_FIELDS & CHAT_FIELDS) - {"tools", "tool_choice", "stream"}


def _chat_tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise OpenAIError(f"tools[{i}].type {show(kind)} is not supported: cuttle serves function tools (the client runs "
                          "them); hosted tools (web search, file search, code interpreter, MCP, ...) are not built in",
                          param="tools")
    unknown = set(t) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise OpenAIError(f"tools[{i}]: unknown field(s) {sorted(unknown)}", param="tools")
    fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
    if t.get("strict") is not None:
        fn["strict"] = t["strict"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise OpenAIError("tool_choice must be 'auto', 'none', 'required' or {type: function, name}", param="tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise OpenAIError("text must be {format: {...}}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise OpenAIError(f"text.verbosity {show(text['verbosity'])} is not supported: the model's length is set by its "
                          "prompt and max_output_tokens (medium, the default, is accepted)", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("text.format must be an object", param="text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise OpenAIError("text.format json_schema needs name (a string) and schema (an object)", param="text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise OpenAIError(f"text.format.type {show(kind)} is not supported (text, json_object or json_schema)", param="text")


def _reasoning_kwargs(reasoning: Any, template_reads: set[str]) -> dict[str, Any] | None:
    """`reasoning.effort` as the chat template reads it: its own `reasoning_effort` variable
    where it has one (gpt-oss style), or "none" as `enable_thinking: false` (Qwen3 style); any
    other effort on a template without the variable is refused, since it would change nothing."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise OpenAIError("reasoning must be {effort, summary}", param="reasoning")
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise OpenAIError("reasoning.summary is not supported: cuttle returns the reasoning text itself (reasoning items' "
                          "content), not a summary", param="reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    return effort_kwargs(effort, template_reads, "reasoning", "reasoning.effort")


def _renamed(build: Callable[[], Any]) -> Any:
    """Run a chat check, its errors naming the Responses fields."""
    return renamed_errors(build, _CHAT_NAMES)


# ---- the output -------------------------------------------------------------------------------
class _Output:
    """The output items of one response as they are built (whole, or event by event), and the
    response object around them."""

    def __init__(self, rid: str, call: ChatCall, req: _ResponsesRequest, model: str):
        self.rid, self.call, self.req, self.model = rid, call, req, model
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.message: dict[str, Any] = {"role": "assistant", "content": ""}  # the turn, for the conversation

    def new_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        item = {"id": f"{_ITEM_PREFIX[kind]}_{uuid.uuid4().hex}", "type": kind, **fields}
        self.items.append(item)
        return item

    def take_message(self, msg: dict[str, Any], finish: str | None, logprobs: list[dict[str, Any]] | None,
                     cut_call: bool = False) -> None:
        """A whole sample's chat message (ChatCall.message_of) as output items; `cut_call`: its
        last tool call was cut off (its item is incomplete, its arguments those written)."""
        self.finish = finish
        status = "incomplete" if finish == "length" else "completed"
        if msg.get("reasoning_content"):
            self.new_item("reasoning", summary=[], content=[{"type": "reasoning_text", "text": msg["reasoning_content"]}], status=status,
                          **({"encrypted_content": seal_reasoning(msg["reasoning_content"])} if self.req.sealed else {}))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            part = {"type": "output_text", "text": msg.get("content") or "", "annotations": []}
            if self.req.logprobs:
                part["logprobs"] = logprobs or []
            self.new_item("message", role="assistant", status=status, content=[part])
        for k, c in enumerate(calls):
            self.new_item("function_call", call_id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"],
                          status="incomplete" if cut_call and k == len(calls) - 1 else "completed")
        self.message = {k: v for k, v in msg.items() if k in ("role", "content", "reasoning_content", "tool_calls") and v is not None}
        self.message["content"] = self.message.get("content") or ""

    def response(self, usage: dict[str, Any] | None, reasoning_tokens: int, status: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        if status is None:
            status = "incomplete" if self.finish == "length" else "completed"
        p = self.call.params
        out = {"id": self.rid, "object": "response", "created_at": self.created, "status": status, "error": error,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "model": self.model, "output": self.items, "temperature": p.temperature, "top_p": p.top_p,
               "tools": self.req.tools, "store": self.req.store, **self.req.echo}
        if not isinstance(out["tool_choice"], dict):
            out["tool_choice"] = self.call.choice if self.call.choice != "named" else out["tool_choice"]
        if status != "in_progress":
            out["completed_at"] = int(time.time()) if status == "completed" else None
        if usage is not None:
            details = usage["prompt_tokens_details"]
            out["usage"] = {"input_tokens": usage["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": details["cached_tokens"],
                                                     "cache_write_tokens": details["cache_write_tokens"]},
                            "output_tokens": usage["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
        else:
            out["usage"] = None
        return out


def _reasoning_tokens(tok: Tokenizer, token_ids: list[int], call: ChatCall, text: str) -> int:
    """How many of the sampled tokens are reasoning: those up to the end of the `</think>` that
    closes it (found by decoding prefixes: the smallest count whose text holds it), or all of
    them when the block never closed."""
    if call.rstate is None or not token_ids:
        return 0
    reasoning, _ = split_reasoning(call.forced + text, call.rstate)
    if not reasoning:
        return 0
    lo, hi = 1, len(token_ids)
    close = call.rstate.close
    if close not in tok.decode(token_ids):
        return len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if close in tok.decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _finished(final: RequestOutput, out: _Output, call: ChatCall, tok: Tokenizer, store: ResponseStore, req: _ResponsesRequest) -> dict[str, Any]:
    """The response a finished (non-streamed) sample makes, kept in the store when asked."""
    [c] = final.outputs
    msg, called = call.message_of(c.text, c.finish_reason == "length")
    out.take_message(msg, c.finish_reason, c.logprobs and chat_logprobs(tok, c.token_ids, c.logprobs, call.top_n, as_ids=call.as_ids),
                     cut_call=bool(msg.get("tool_calls")) and not called)
    usage = Usage()
    usage.add_prompt(final)
    usage.add_completion(final)
    response = out.response(usage.to_openai(), _reasoning_tokens(tok, c.token_ids, call, c.text))
    _keep(store, req, out, response)
    return response


async def _background(serving: Serving, store: ResponseStore, req: _ResponsesRequest, out: _Output, call: ChatCall, tok: Tokenizer,
                      stream: RequestStream, running: dict[str, asyncio.Task], t0: float) -> None:
    """A background response's generation: its final state replaces the pending one in the store
    (completed / incomplete, failed with the error, or cancelled with what was kept: nothing)."""
    try:
        final = await final_output(stream)
        if serving.metrics is not None:
            serving._observe_end(final, time.monotonic() - t0)
        _finished(final, out, call, tok, store, req)
    except asyncio.CancelledError:
        _replace(store, out.response(None, 0, status="cancelled"))
    except Exception as e:  # noqa: BLE001 - the client reads it from the response
        err = as_openai_error(e)
        _replace(store, out.response(None, 0, status="failed", error={"code": err.code or "server_error", "message": str(err)}))
    finally:
        stream.close()  # aborts the request if it is still running (cancelled)
        running.pop(out.rid, None)


def _replace(store: ResponseStore, response: dict[str, Any]) -> None:
    """A background response's final state without output, where its pending one still is."""
    try:
        stored = store.get(response["id"])
    except OpenAIError:
        return  # deleted meanwhile
    store.put(response, stored.conversation, len(json.dumps(response)), stored.input_items)


async def _stop(running: dict[str, asyncio.Task], response_id: str) -> None:
    task = running.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.wait((task,))


def seal_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content`: its text, signed with the server's key so that it
    comes back unaltered (signed, not encrypted: cuttle returns the text in `content` anyway)."""
    body = base64.urlsafe_b64encode(text.encode()).decode()
    mac = hmac.new(_SEAL_KEY, f"{_SEAL_TAG}:{body}".encode(), hashlib.sha256).digest()
    return f"{_SEAL_TAG}:{body}:{base64.urlsafe_b64encode(mac).decode()}"


def unseal_reasoning(sealed: Any, where: str) -> str:
    """The text `seal_reasoning` sealed, or a 400 naming `where` (another server's or an altered blob)."""
    parts = sealed.split(":") if isinstance(sealed, str) else []
    ok = len(parts) == 3 and parts[0] == _SEAL_TAG
    if ok:
        want = hmac.new(_SEAL_KEY, f"{_SEAL_TAG}:{parts[1]}".encode(), hashlib.sha256).digest()
        try:
            ok = hmac.compare_digest(base64.urlsafe_b64decode(parts[2]), want)
            text = base64.urlsafe_b64decode(parts[1]).decode()
        except (ValueError, UnicodeDecodeError):
            ok = False
    if not ok:
        raise OpenAIError(f"{where} was not sealed by this server (or was altered): send the reasoning item's content instead, or "
                          "run the servers with one CUTTLE_REASONING_KEY", param="input")
    return text


def checked_conversation_items(existing: list[dict[str, Any]], new: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """`new` as items with ids, once `existing + new` reads as a response's input would (a 400
    naming `param` otherwise): the Conversations API's check (conversations.py)."""
    try:
        if existing or new:
            _input_messages(existing + new, set())
    except OpenAIError as e:
        raise OpenAIError(e.message.replace("input", param, 1) if e.message.startswith("input") else e.message, param=param) from None
    return input_items(new) if new else []


def _keep(store: ResponseStore, req: _ResponsesRequest, out: _Output, response: dict[str, Any]) -> None:
    if req.conversation is not None and response["status"] in ("completed", "incomplete"):
        # the conversation goes on with this request's input and this response's output
        req.conversation.items += input_items(req.raw_input) + [dict(i) for i in out.items]
    if req.store and response["status"] in ("completed", "incomplete"):
        items = input_items(req.raw_input)
        store.put(response, req.history + req.new + [out.message], len(json.dumps(items)) + len(json.dumps(response)), items)


# ---- streaming --------------------------------------------------------------------------------
async def _events(frames: AsyncIterator[dict[str, Any]], out: _Output, store: ResponseStore, req: _ResponsesRequest, tok: Tokenizer,
                  call: ChatCall, token_ids: list[int], texts: list[str]) -> AsyncIterator[str]:
    """The Responses event stream of one streamed response, from chat's frames: each item opened
    (`output_item.added`, `content_part.added`), its text as deltas, closed (`*.done`), and the
    response's own events around them."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        obj = {"type": kind, **fields, "sequence_number": seq}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj)}\n\n"

    open_item: dict[str, Any] | None = None
    text, lps = "", []
    reasoning_all, calls_all = "", []

    def close() -> list[str]:
        nonlocal open_item, text
        item, evs = open_item, []
        if item is None:
            return evs
        idx, status = out.items.index(item), "incomplete" if out.finish == "length" else "completed"
        if item["type"] == "function_call":  # its arguments came as deltas; a call cut off is incomplete
            evs.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                             arguments=item["arguments"], name=item["name"]))
            item["status"] = "incomplete" if out.finish not in ("tool_calls", None) and item is out.items[-1] else "completed"
            evs.append(event("response.output_item.done", output_index=idx, item=item))
            open_item = None
            return evs
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            evs.append(event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text))
        else:
            part = {"type": "output_text", "text": text, "annotations": [], **({"logprobs": list(lps)} if req.logprobs else {})}
            evs.append(event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text,
                             logprobs=list(lps)))
        evs.append(event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part))
        item.update(content=[part], status=status)
        if item["type"] == "reasoning" and req.sealed:
            item["encrypted_content"] = seal_reasoning(text)
        evs.append(event("response.output_item.done", output_index=idx, item=item))
        open_item, text = None, ""
        lps.clear()  # the part above holds its own copy
        return evs

    def opened(kind: str) -> list[str]:
        nonlocal open_item
        if open_item is not None and open_item["type"] == kind:
            return []
        evs = close()
        if kind == "reasoning":
            open_item = out.new_item("reasoning", summary=[], content=[], status="in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            open_item = out.new_item("message", role="assistant", status="in_progress", content=[])
            part = {"type": "output_text", "text": "", "annotations": [], **({"logprobs": []} if req.logprobs else {})}
        idx = len(out.items) - 1
        evs.append(event("response.output_item.added", output_index=idx, item=dict(open_item)))
        evs.append(event("response.content_part.added", item_id=open_item["id"], output_index=idx, content_index=0, part=part))
        return evs

    yield event("response.created", response=out.response(None, 0, "in_progress"))
    yield event("response.in_progress", response=out.response(None, 0, "in_progress"))
    async with aclosing(frames) as frames_:
        async for frame in frames_:
            if "error" in frame:
                e = frame["error"]
                yield event("response.failed", response=out.response(None, 0, "failed", {"code": "server_error", "message": e["message"]}))
                return
            if "usage" in frame and not frame["choices"]:
                for ev in close():
                    yield ev
                if not out.items:  # nothing was sampled: an empty message, as a whole response would hold
                    for ev in opened("message") + close():
                        yield ev
                response = out.response(frame["usage"], _reasoning_tokens(tok, token_ids, call, "".join(texts)))
                out.message = {"role": "assistant", "content": "".join(i["content"][0]["text"] for i in out.items
                                                                     if i["type"] == "message")}
                if reasoning_all:
                    out.message["reasoning_content"] = reasoning_all
                if calls_all:
                    out.message["tool_calls"] = calls_all
                _keep(store, req, out, response)
                yield event("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
                return
            [ch] = frame["choices"]
            delta = ch["delta"]
            if ch.get("finish_reason") is not None:
                out.finish = ch["finish_reason"]
            if delta.get("reasoning_content"):
                for ev in opened("reasoning"):
                    yield ev
                text += delta["reasoning_content"]
                reasoning_all += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=open_item["id"], output_index=len(out.items) - 1, content_index=0,
                            delta=delta["reasoning_content"])
            if delta.get("content"):
                for ev in opened("message"):
                    yield ev
                new_lps = (ch.get("logprobs") or {}).get("content") or []
                text += delta["content"]
                lps.extend(new_lps)
                yield event("response.output_text.delta", item_id=open_item["id"], output_index=len(out.items) - 1, content_index=0,
                            delta=delta["content"], logprobs=new_lps)
            elif ch.get("logprobs") and open_item is not None and open_item["type"] == "message":
                lps.extend(ch["logprobs"]["content"])  # tokens whose text was held and then cut (a stop string)
            for tc in delta.get("tool_calls") or ():
                fn = tc["function"]
                if "id" in tc:  # a call's first piece: its item opens
                    for ev in close():
                        yield ev
                    open_item = out.new_item("function_call", call_id=tc["id"], name=fn["name"], arguments="", status="in_progress")
                    yield event("response.output_item.added", output_index=len(out.items) - 1, item=dict(open_item))
                    calls_all.append({"id": tc["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}})
                if fn["arguments"]:
                    open_item["arguments"] += fn["arguments"]
                    calls_all[-1]["function"]["arguments"] += fn["arguments"]
                    yield event("response.function_call_arguments.delta", item_id=open_item["id"], output_index=len(out.items) - 1,
                                delta=fn["arguments"])
