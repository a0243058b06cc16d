"""POST /v1/chat/completions: the chat template (the checkpoint's, `--chat-template` or the
request's, with `chat_template_kwargs`, `add_generation_prompt` / `continue_final_message`), tools
(Hermes / Qwen3-Coder formats), `tool_choice` (by prefix forcing), thinking split out as
`reasoning_content` (`--reasoning-parser`), `echo`, `logprobs`, streaming, and squid documents
(docs/server.md).

Owns how a chat request becomes the engine's prompt and how samples become chat choices: the
messages' checks, the rendering (chat_prompt.py), where documents go, the reasoning split and
the tool-call parsing of the output (the tool parser reads the content only, never thinking
text). Admission, waiting, streaming, disconnects and usage are `streaming.Serving`'s.

Documents (the `documents` field, and `{"type": "document", "name", "text"}` content parts, in
that order) are placed after the system prompt: the prefix of the squid layout is the template's
rendering of the leading system / developer messages (with the tools, where the template puts
them there), each document is encoded alone after it, and the query is the rest of the rendering
(the conversation and the generation prompt). A document part is shown to the model as a `# name`
line followed by its text, ending in a newline, so its cache key includes its name.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from cuttle.engine.openai_protocol import (
    CHAT_FIELDS, OpenAIError, Usage, chat_logprobs, check_tools, get_bool, get_documents, get_int, get_priority, get_prompt_logprobs,
    get_str, get_stream_options, prompt_logprobs_wire, sampling_params, show, structured_outputs_of,
)
from cuttle.engine.async_engine import RequestOptions
from cuttle.engine.generation_config import with_defaults
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.reasoning_parsers import (CONTENT, HARMONY, HARMONY_PARSER, TAGS, ReasoningParser, Start, opens_thinking,
                                             split_reasoning, start_state)
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.server.beam_completions import CHAT_BEAM_FIELDS, beam_params, beam_search_chat
from cuttle.engine.server.body import read_body
from cuttle.engine.server.chat_prompt import ChatOptions, ChatTemplate, ToolCallReplay, check_continuable, read_chat_template
from cuttle.engine.server.streaming import Delta, Fields, Prompt, Serving
from cuttle.engine.grammar_support import UNENFORCED_WHAT, unenforced_keywords
from cuttle.engine.structured_output import tool_call_structure
from cuttle.engine.tokenizer import Tokenizer, validate_messages
from cuttle.engine.tool_parsers import PARSERS, CallDelta, StreamingToolParser, mistral_call_id, parse_tool_calls


def add_chat_routes(app: FastAPI, serving: Serving, tok: Tokenizer, opts: ChatOptions) -> None:
    # assistant turns sent back with tool calls this server produced render as the model's exact text
    replay = ToolCallReplay()
    app.state.tool_call_replay = replay

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.monotonic()
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), CHAT_FIELDS)
        if body.get("messages") is None:
            raise OpenAIError("messages is required", param="messages")
        messages, part_docs = flatten_messages(body["messages"])
        tmpl = read_chat_template(body, tok, opts)
        check_continuable(messages, tmpl)
        messages = replay.restore(messages, keep_last=tmpl.continue_final_message)
        if get_bool(body, "use_beam_search"):
            return await _beam_search(request, body, messages, bool(part_docs), tmpl, serving, tok, opts, t0)
        if body.get("length_penalty") is not None:
            raise OpenAIError("length_penalty applies to beam search only (use_beam_search: true)", param="length_penalty")
        call = prepare_chat(body, messages, part_docs, tmpl, serving, tok, opts, replay)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = call.params.output_kind == RequestOutputKind.DELTA

        def frame(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk" if stream else "chat.completion", "created": int(time.time()),
                    "model": call.admission.lora_request or serving.model_name, "choices": choices, **extra}

        if not stream:
            def respond(finals: list[RequestOutput]) -> dict[str, Any]:
                [out] = finals
                usage = Usage()
                usage.add_prompt(out)
                usage.add_completion(out)
                choices = []
                for c in out.outputs:
                    msg, called = call.message_of(c.text, c.finish_reason == "length")
                    ch = {"index": c.index, "message": msg, "logprobs": None,
                          "finish_reason": "tool_calls" if called else c.finish_reason}
                    if call.want_lp:
                        ch["logprobs"] = {"content": chat_logprobs(tok, c.token_ids, c.logprobs or [], call.top_n, as_ids=call.as_ids)}
                    if call.want_ids:
                        ch["token_ids"] = c.token_ids
                    choices.append(ch)
                extra = {}
                if call.want_ids:  # vLLM's: the prompt's ids, beside the choices (a forced tool-call opening included)
                    extra["prompt_token_ids"] = out.prompt_token_ids
                if call.want_plp is not None:  # vLLM's field, beside the choices (one prompt)
                    extra["prompt_logprobs"] = prompt_logprobs_wire(out.prompt_token_ids, out.prompt_logprobs or [], call.want_plp)
                return frame(choices, usage=usage.to_openai(), **extra)

            return await serving.complete(request, [(rid, call.prompt)], call.params, call.admission, call.fields, respond, t0)

        streams = await serving.open(request, [(rid, call.prompt)], call.params, call.admission, call.fields)
        include_usage, continuous_usage = get_stream_options(body)
        opening = [{"index": i, "delta": {"role": call.role, "content": call.echoed}, "logprobs": None, "finish_reason": None}
                   for i in range(call.params.n)]
        # with return_token_ids the opening (role) chunk waits for the first output, whose prompt ids it carries
        prompt_ids = (lambda out: {"prompt_token_ids": out.prompt_token_ids}) if call.want_ids else None
        return serving.stream(streams, call.delta_reader(), frame, include_usage, t0, opening, continuous_usage=continuous_usage,
                              opening_extra=prompt_ids)


@dataclass(eq=False)
class ChatCall:
    """One chat request, checked and rendered: what the engine is asked for, and how each sample's
    text becomes an assistant message (whole, or delta by delta). /v1/chat/completions and
    /v1/responses (responses.py) frame the same messages their own way."""

    prompt: Prompt
    params: SamplingParams
    admission: RequestOptions
    fields: Fields
    tok: Tokenizer
    replay: ToolCallReplay
    role: str  # the reply's role: a new assistant turn, or the role of the message being continued
    echoed: str  # echo: the final message's text, which comes first when the reply continues it
    forced: str  # the opening of a tool call written for the model (required / named tool_choice)
    choice: str  # auto | none | required | named
    parser: str
    tools: list[dict[str, Any]] | None  # the tools the output is parsed for (None: tool calls are not parsed)
    rstate: Start | None  # where the reasoning parser starts, and its tags (None: no reasoning split)
    include_reasoning: bool
    want_lp: bool
    top_n: int
    as_ids: bool
    want_plp: int | None
    want_ids: bool = False  # return_token_ids: each choice's sampled ids (streamed: each chunk's), and the prompt's
    # the tool calls run under their grammar, so they parse: streamed as they are written (tool_parsers)
    incremental_calls: bool = False

    def message_of(self, text: str, cut: bool = False) -> tuple[dict[str, Any], bool]:
        """A whole sample's message, and whether it holds tool calls. `cut`: it ended at max_tokens."""
        text = self.forced + text
        msg: dict[str, Any] = {"role": self.role, "content": text}
        if self.rstate is not None:
            reasoning, text = split_reasoning(text, self.rstate)
            text = text or ""
            msg["content"] = text or None
            msg["reasoning_content"] = reasoning if self.include_reasoning else None
        called = False
        if self.tools is not None:
            if self.incremental_calls:  # as streamed: a call cut off is a call with its arguments so far
                parser = StreamingToolParser(self.parser, self.tools, incremental=True)
                content, _ = parser.feed_deltas(text, final=True)
                calls = parser.calls
                content = content.strip() if calls else content
            else:
                content, calls = parse_tool_calls(text, self.parser, self.tools)
            if self.forced and not calls and not cut:  # a call cut by max_tokens is reported as cut
                raise OpenAIError(f"tool_choice {self.choice!r} was requested but the model's output is not a valid tool call: {text[:200]!r}",
                                  500, "server_error", param="tool_choice")
            msg["content"] = content or None
            if calls:
                msg["tool_calls"] = [c.to_openai() for c in calls]
            called = bool(calls) and all(c.complete for c in calls)  # (a cut call keeps the sample's own finish reason)
        if self.echoed:
            msg["content"] = self.echoed + (msg["content"] or "")
        elif called and self.rstate is None:
            self.replay.record(text, msg["content"], msg["tool_calls"])
        return msg, called

    def delta_reader(self) -> Callable[[Delta], dict[str, Any] | None]:
        """For a streamed request: each sample's delta -> its chat choice delta (None: nothing to
        send yet), the reasoning split and tool calls parsed as the text grows."""
        n, tok = self.params.n, self.tok
        reasoners = [ReasoningParser(self.rstate) if self.rstate is not None else None for _ in range(n)]
        parsers = [StreamingToolParser(self.parser, self.tools, self.incremental_calls) if self.tools is not None else None
                   for _ in range(n)]
        output_so_far = [""] * n  # what a reasoning parser has been fed (it reads the growing text)
        content_so_far = [""] * n  # what a tool parser has been fed (the content only)
        # logprobs of tokens whose text is not sent yet (held for a stop string, a tag or a tool call)
        held_ids: list[list[int]] = [[] for _ in range(n)]
        held_lps: list[list] = [[] for _ in range(n)]
        # for the replay: the model's text and the content sent, per choice
        sent_text, sent_content = [""] * n, [""] * n

        def choice_of(d: Delta) -> dict[str, Any] | None:
            c, i = d.sample, d.sample.index
            text = self.forced + c.text if d.first else c.text
            sent_text[i] += text
            final = c.finish_reason is not None
            held_ids[i] += c.token_ids
            held_lps[i] += c.logprobs or []
            delta: dict[str, Any] = {}
            if reasoners[i] is not None:
                output_so_far[i] += text
                reasoning, text = reasoners[i].feed(output_so_far[i], final=final)
                if reasoning and self.include_reasoning:
                    delta["reasoning_content"] = reasoning
            calls = parsers[i].calls if parsers[i] is not None else []
            if parsers[i] is not None:
                content_so_far[i] += text
                content, pieces = parsers[i].feed_deltas(content_so_far[i], final=final)
                if content:
                    delta["content"] = content
                if pieces:
                    delta["tool_calls"] = _call_deltas(pieces)
                sent_content[i] += content or ""
            elif text:
                delta["content"] = text
            finish = None
            if final:
                if self.forced and not calls and c.finish_reason != "length":
                    raise OpenAIError("tool_choice requested but the model's output is not a valid tool call",
                                      500, "server_error", param="tool_choice")
                called = bool(calls) and all(tc.complete for tc in calls)  # (a cut call keeps the sample's finish reason)
                finish = "tool_calls" if called else c.finish_reason
                if called and self.rstate is None and not self.echoed:
                    self.replay.record(sent_text[i], sent_content[i], [tc.to_openai() for tc in calls])
            if not delta and finish is None:
                return None
            ch = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            if self.want_lp and held_ids[i]:
                ch["logprobs"] = {"content": chat_logprobs(tok, held_ids[i], held_lps[i], self.top_n, as_ids=self.as_ids)}
            if self.want_ids:  # the ids of the text this chunk sends (held ones with it), so the chunks' ids add up
                ch["token_ids"] = held_ids[i]
            held_ids[i], held_lps[i] = [], []
            return ch

        return choice_of


def _call_deltas(pieces: list[CallDelta]) -> list[dict[str, Any]]:
    """OpenAI's streamed tool_calls entries for one chunk's call pieces: a call's first entry
    carries its id, type and name, later ones only arguments text (vLLM's shape); pieces of one
    call in the same chunk are joined."""
    out: dict[int, dict[str, Any]] = {}
    for p in pieces:
        entry = out.get(p.index)
        if entry is None:
            entry = out[p.index] = ({"index": p.index, "id": p.call.id, "type": "function",
                                     "function": {"name": p.call.name, "arguments": ""}} if p.first
                                    else {"index": p.index, "function": {"arguments": ""}})
        entry["function"]["arguments"] += p.arguments
    return list(out.values())


def prepare_chat(body: dict[str, Any], messages: list[dict[str, Any]], part_docs: list[tuple[str | None, str]], tmpl: ChatTemplate,
                 serving: Serving, tok: Tokenizer, opts: ChatOptions, replay: ToolCallReplay) -> ChatCall:
    """Check a chat body's generation fields (tools, tool_choice, logprobs, sampling, structured
    output, documents) and render its prompt; every refusal is a 400 naming the chat field."""
    parser = opts.tool_parser
    field_docs = get_documents(body) or []
    structured, structured_field = structured_outputs_of(body, tok)
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
    if choice == "auto" and tools and not opts.enable_auto_tool_choice:
        raise OpenAIError('tool_choice "auto" needs a server started with --enable-auto-tool-choice (this one has '
                          '--no-enable-auto-tool-choice); use "none", "required" or a named function', param="tool_choice")
    use_tools = tools is not None and choice != "none"
    if use_tools and opts.foreign_tool_format is not None and body.get("chat_template") is None:
        raise OpenAIError(f"this model's chat template writes tool calls in {opts.foreign_tool_format} format, which cuttle "
                          f"does not parse ({', '.join(PARSERS)} it does): its calls would come back as text; start "
                          "the server with --tool-call-parser to choose one, or send tool_choice 'none'", param="tools")
    parallel = get_bool(body, "parallel_tool_calls", True)
    if not parallel and tools is None:
        raise OpenAIError("parallel_tool_calls applies only when tools are given", param="parallel_tool_calls")
    want_lp = get_bool(body, "logprobs")
    top_n = get_int(body, "top_logprobs", 0, 20, 0)
    if top_n and not want_lp:
        raise OpenAIError("top_logprobs requires logprobs: true", param="top_logprobs")
    echo = get_bool(body, "echo")
    as_ids = serving.tokens_as_ids(body)
    include_reasoning = get_bool(body, "include_reasoning", True)
    stream = get_bool(body, "stream")
    get_stream_options(body)  # checked here, before anything is admitted
    admission = RequestOptions(get_str(body, "cache_salt"), get_priority(body, serving.engine.engine.config.scheduling_policy),
                               serving.lora_of(body))
    want_plp = get_prompt_logprobs(body, stream, bool(field_docs or part_docs))
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    # tool calls under their tools' JSON schemas (a forced call always parses; with auto, from <tool_call> on)
    tool_structure = (tool_call_structure(parser, choice, forced_name, tools, tok, parallel, tmpl.source or tok.chat_template)
                      if use_tools else None)
    if use_tools and tool_structure is None and not parallel:
        raise OpenAIError("parallel_tool_calls: false needs the tool calls generated under a grammar that ends the output after "
                          f"the first call, which this server cannot do ({_no_grammar(parser, choice)})", param="parallel_tool_calls")
    if use_tools and tool_structure is None:
        strict = next((i for i, t in enumerate(tools) if t["function"].get("strict")), None)
        if strict is not None:  # a promise the server can only keep under a grammar
            raise OpenAIError(f"tools[{strict}].function.strict: true needs the tool calls generated under their schemas, which "
                              f"this server cannot do ({_no_grammar(parser, choice)})", param="tools")
    for i, t in enumerate(tools or ()) if tool_structure is not None else ():
        # strict promises schema adherence (OpenAI's meaning); keywords the grammar compiles
        # without enforcing would break it, so such a strict tool is refused, as OpenAI's strict
        # mode refuses keywords it does not support (a tool without strict is best effort)
        bad = unenforced_keywords(t["function"].get("parameters")) if t["function"].get("strict") else []
        if bad:
            raise OpenAIError(f"tools[{i}].function.parameters uses {', '.join(bad[:4])}: a keyword the tool-call grammar "
                              f"does not enforce ({UNENFORCED_WHAT}), so strict: true cannot be kept; drop the keyword "
                              "or strict", param="tools")
    if tool_structure is not None:
        if structured is not None:
            raise OpenAIError(f"{structured_field} cannot be combined with tools under tool_choice {choice!r}: the tool "
                              "calls' grammar already constrains the output", param=structured_field)
        structured = tool_structure
    defaults = serving.engine.engine.generation_defaults  # the model's generation_config.json
    params = sampling_params(with_defaults(body, defaults), "max_completion_tokens", default_max_tokens=None, logprobs=top_n if want_lp else None,
                             prompt_logprobs=want_plp, output_kind=kind, structured_outputs=structured)
    if use_tools and body.get("skip_special_tokens") is None:
        # a checkpoint may mark its call markers special (GLM-4.5's <tool_call> / <arg_key>): skipped,
        # its calls could not be parsed (vLLM's tool parsers turn skipping off likewise); the stop
        # token's text stays out either way
        params.skip_special_tokens = False
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # required / named tool_choice: the call's opening is written for the model (prefix forcing)
    forced = _forced_prefix(parser, choice, forced_name, tmpl.source or tok.chat_template, _calls_before(messages))
    forced_ids = tok.encode(forced, add_special_tokens=False) if forced else []
    render_tools = tools if use_tools else None
    text = tmpl.render(tok, messages, render_tools)
    rstate = _reasoning_start(tok, opts, tmpl, messages, render_tools, text, forced)
    if rstate is not None and rstate.state == HARMONY:
        params.skip_special_tokens = _keep_harmony_markers(body)
    if field_docs or part_docs:
        prefix_ids, query_ids = _split_after_system(tok, tmpl, messages, render_tools, text)
        docs = [tok.encode(d, add_special_tokens=False) if isinstance(d, str) else d for d in field_docs]
        docs += [tok.encode(_document_text(name, text), add_special_tokens=False) for name, text in part_docs]
        prompt: Prompt = {"prefix": prefix_ids, "documents": docs, "prompt": query_ids + forced_ids}
    else:
        # templates already spell out BOS and role markers, so no special tokens are added again
        prompt = tok.encode(text, add_special_tokens=False) + forced_ids
    fields = Fields("messages", max_field, documents="documents" if field_docs else "messages", prefix="messages",
                    structured="tools" if tool_structure is not None else structured_field or "structured_outputs")
    role = "assistant" if tmpl.add_generation_prompt else messages[-1]["role"]
    echoed = messages[-1]["content"] if echo and messages[-1]["role"] == role and isinstance(messages[-1]["content"], str) else ""
    return ChatCall(prompt, params, admission, fields, tok, replay, role, echoed, forced, choice, parser, tools if use_tools else None,
                    rstate, include_reasoning, want_lp, top_n, as_ids, want_plp, get_bool(body, "return_token_ids"),
                    incremental_calls=tool_structure is not None)


async def _beam_search(request: Request, body: dict[str, Any], messages: list[dict[str, Any]], has_docs: bool, tmpl: ChatTemplate,
                       serving: Serving, tok: Tokenizer, opts: ChatOptions, t0: float) -> dict[str, Any]:
    """`use_beam_search` on chat (engine/server/beam_completions.py): the conversation rendered as
    for any chat request, each beam a message of the reply's role, reasoning split as any reply's."""
    params = beam_params(body, CHAT_BEAM_FIELDS)  # first: a field beam search cannot take is named
    if has_docs:
        raise OpenAIError("messages: document parts cannot be combined with use_beam_search", param="messages")
    text = tmpl.render(tok, messages, None)
    rstate = _reasoning_start(tok, opts, tmpl, messages, None, text, "")
    if rstate is not None and rstate.state == HARMONY:
        params = dataclasses.replace(params, skip_special_tokens=_keep_harmony_markers(body))
    role = "assistant" if tmpl.add_generation_prompt else messages[-1]["role"]
    include_reasoning = get_bool(body, "include_reasoning", True)

    def message_of(out: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": role, "content": out}
        if rstate is not None:
            reasoning, msg["content"] = split_reasoning(out, rstate)
            msg["reasoning_content"] = reasoning if include_reasoning else None
        return msg

    prompt = tok.encode(text, add_special_tokens=False)  # the template spells out its special tokens
    return await beam_search_chat(request, body, params, prompt, serving, tok, t0, message_of)


def _reasoning_start(tok: Tokenizer, opts: ChatOptions, tmpl: ChatTemplate, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, text: str, forced: str) -> Start | None:
    """Where the reasoning parser starts reading this request's output (None: no parser). A
    forced tool call opens the answer itself, so the output starts as content; forcing one while
    the template has a thinking block open would put the call inside the thinking: refused."""
    if opts.reasoning_parser is None:
        return None
    if opts.reasoning_parser == HARMONY_PARSER:  # harmony messages: a forced call is read as the first one
        return start_state(HARMONY_PARSER, "")
    tail = tmpl.tail(tok, messages, tools, text)
    if forced:
        if opens_thinking(opts.reasoning_parser, tail):
            raise OpenAIError("a required or named tool_choice cannot be forced while the chat template opens a thinking "
                              "block (the call would be written inside it); use tool_choice 'auto', or turn thinking off "
                              "(e.g. chat_template_kwargs: {enable_thinking: false})", param="tool_choice")
        return Start(CONTENT, *TAGS[opts.reasoning_parser])
    return start_state(opts.reasoning_parser, tail, tmpl.kwargs.get("enable_thinking"))


def _keep_harmony_markers(body: dict[str, Any]) -> bool:
    """gpt-oss's output is parsed by its harmony markers, which are special tokens: they stay in
    the text (a request asking to skip them would get its reasoning, answer and calls mixed up).
    Returns the request's skip_special_tokens: False."""
    if body.get("skip_special_tokens") is True:
        raise OpenAIError("skip_special_tokens: true would drop the harmony markers (<|channel|>, <|message|>, ...) this "
                          "model's output is split by (reasoning, content, tool calls); leave it unset or false",
                          param="skip_special_tokens")
    return False


def _split_after_system(tok: Tokenizer, tmpl: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        full: str) -> tuple[list[int], list[int]]:
    """(prefix ids, query ids) of the rendered prompt `full`: the rendering of the leading system /
    developer messages (with the tools, and whatever else the template puts first), and the rest.
    When the template does not render that head as a prefix of the whole, the prefix is empty and
    the documents come first."""
    k = 0
    while k < len(messages) and messages[k]["role"] in ("system", "developer"):
        k += 1
    try:
        head = tmpl.render(tok, messages[:k], tools, add_generation_prompt=False, continue_final_message=False)
    except OpenAIError:  # e.g. a template that reads messages[0] of an empty list
        head = ""
    if not full.startswith(head):
        head = ""
    prefix = tok.encode(head, add_special_tokens=False) if head else []
    return prefix, tok.encode(full[len(head):], add_special_tokens=False)


def _document_text(name: str | None, text: str) -> str:
    """How a document part reads to the model: a `# name` line, the text, a final newline."""
    body = text if text.endswith("\n") else text + "\n"
    return f"# {name}\n{body}" if name else body


def renamed_errors(build: Callable[[], Any], names: dict[str, str], in_text: bool = True) -> Any:
    """Run a chat step for a route that speaks another wire format (Responses, Messages): its
    refusals name the route's fields instead of chat's (`names`: chat field -> the route's), in
    `param` and, with `in_text`, in the message too."""
    try:
        return build()
    except OpenAIError as e:
        msg = e.message
        if in_text:
            for chat, ours in names.items():
                msg = msg.replace(chat, ours)
        raise OpenAIError(msg, e.status, e.type, names.get(e.param or "", e.param), e.code) from None


def flatten_messages(messages: Any) -> tuple[list[dict[str, Any]], list[tuple[str | None, str]]]:
    """Text parts joined into one string per message (the templates expect strings), and the
    document parts taken out, in order, as (name, text); the fields a template reads are checked
    here, so a malformed one is a 400, not an error mid-render."""
    if not isinstance(messages, list):
        raise OpenAIError("messages must be a list", param="messages")
    out, docs = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param="messages")
        m = dict(m)
        if isinstance(m.get("content"), list):
            parts = []
            for j, p in enumerate(m["content"]):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text" and isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif kind == "document":
                    docs.append(_document_part(p, i, j, m.get("role")))
                else:
                    raise OpenAIError(f"messages[{i}].content: only text and document parts are supported", param="messages")
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
    return out, docs


def _document_part(p: dict[str, Any], i: int, j: int, role: Any) -> tuple[str | None, str]:
    where = f"messages[{i}].content[{j}]"
    if role == "assistant":  # the model's own tokens stay where it wrote them
        raise OpenAIError(f"{where}: document parts are not allowed in assistant messages", param="messages")
    unknown = set(p) - {"type", "name", "text"}
    if unknown:
        raise OpenAIError(f"{where}: unknown document part field(s) {sorted(unknown)} (expected name, text)", param="messages")
    name, text = p.get("name"), p.get("text")
    if name is not None and (not isinstance(name, str) or not name or "\n" in name):
        raise OpenAIError(f"{where}.name must be a non-empty one-line string", param="messages")
    if not isinstance(text, str) or not text:
        raise OpenAIError(f"{where}.text must be a non-empty string (an empty document is refused)", param="messages")
    return name, text


def _calls_before(messages: list[dict[str, Any]]) -> int:
    """The tool calls of the conversation so far (Kimi-K2 numbers its calls across it): the calls
    its assistant messages carry, or the tool results, where more (a turn this server answered is
    replayed as its text, without `tool_calls`: ToolCallReplay)."""
    dicts = [m for m in messages if isinstance(m, dict)]
    calls = sum(len(m.get("tool_calls") or ()) for m in dicts if m.get("role") == "assistant")
    return max(calls, sum(m.get("role") == "tool" for m in dicts))


# parser -> (the opening of a named call, NAME standing for its name; the opening of a required one):
# up to the arguments, where the grammar (where one applies) goes on
_OPENINGS = {
    "hermes": ('<tool_call>\n{"name": "NAME", "arguments":', '<tool_call>\n{"name":'),
    "qwen3_coder": ("<tool_call>\n<function=NAME>\n", "<tool_call>\n<function="),
    "seed_oss": ("<seed:tool_call>\n<function=NAME>\n", "<seed:tool_call>\n<function="),  # (qwen3_coder's XML)
    "glm45": ("<tool_call>NAME", "<tool_call>"),  # GLM's template writes the name right after the tag
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="NAME">\n', '<minimax:tool_call>\n<invoke name="'),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"),
    "llama3_json": ('{"name": "NAME", "parameters":', '{"name":'),  # the reply is the call
    "granite": ('<|tool_call|>[{"name": "NAME", "arguments":', '<|tool_call|>[{"name":'),  # a list of calls
    # gpt-oss: the first harmony message's header (the prompt ends in `<|start|>assistant`)
    "openai": ("<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>", "<|channel|>commentary to=functions."),
}


def _no_grammar(parser: str, choice: str) -> str:
    """Why a request's tool calls cannot run under a grammar (`tool_call_structure` gave none)."""
    return ("the xgrammar package is not installed, its tokenizer is one xgrammar cannot serve, marks the call markers "
            f"special or lacks them as single tokens, or the {parser} format has no grammar for tool_choice {choice}")


def _forced_prefix(parser: str, choice: str, name: str | None, template: str | None = None, calls_before: int = 0) -> str:
    """The opening of a tool call written for the model (`_OPENINGS`). It stops before a space or
    quote: BPE merges those with what follows, and a prefix cut inside such a merge reads as text
    the model never saw in training. Two formats depend on more: Mistral's on the template
    (`template`: its two layouts, and v11's call ids), Kimi-K2's on the conversation (its calls are
    numbered across it: `calls_before`)."""
    if choice not in ("named", "required"):
        return ""
    if parser == "kimi_k2":  # (required: the model writes `functions.NAME:IDX`, under the tool-call grammar where it applies)
        head = "<|tool_calls_section_begin|><|tool_call_begin|>"
        return f"{head}functions.{name}:{calls_before}<|tool_call_argument_begin|>" if choice == "named" else head
    if parser == "mistral":
        if template is not None and "[ARGS]" not in template:  # v3 / v7: a JSON list of calls, spaced as the template writes it
            head = "[TOOL_CALLS] [" if "[TOOL_CALLS] " in template else "[TOOL_CALLS]["
            return f'{head}{{"name": "{name}", "arguments":' if choice == "named" else head + '{"name":'
        # v11 writes a call id before the arguments (the parser takes it as the call's), v13 none
        cid = f"[CALL_ID]{mistral_call_id()}" if template is not None and "[CALL_ID]" in template else ""
        return f"[TOOL_CALLS]{name}{cid}[ARGS]" if choice == "named" else "[TOOL_CALLS]"
    named, required = _OPENINGS[parser]
    return named.replace("NAME", str(name)) if choice == "named" else required
