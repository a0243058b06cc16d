"""The OpenAI wire format: request bodies -> SamplingParams (with errors that name the field),
and RequestOutputs -> completion / chat-completion JSON.

Owns no I/O; the server calls these. Every top-level field of a request body is either
implemented, or listed in `IGNORED_FIELDS` with the reason ignoring it changes nothing, or
refused with a 400 whose `param` names it: a field cuttle cannot honour (a custom JSON whitespace
pattern, a grammar backend other than xgrammar, ...) is refused, never silently dropped.
Structured output arrives in four spellings (`response_format`, vLLM's `guided_*` fields and its
`structured_outputs` object, or a forced tool call); `structured_outputs_of` turns the first three
into one `StructuredOutputsParams`, checked (grammar syntax, tokenizer) with the field named. A few fields are accepted
only at the value that means "off" (`OFF_VALUES`). A JSON `null` is the same as an absent field.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampler import Logprob
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- which fields exist ----------------------------------------------------------------------
SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
    "thinking_token_budget",
})
# structured output, vLLM's spellings (OpenAI's `response_format` too; chat also by tool_choice)
STRUCTURED_FIELDS = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                               "structured_outputs", "response_format"})
COMPLETION_FIELDS = SAMPLING_FIELDS | STRUCTURED_FIELDS | {"model", "prompt", "stream", "stream_options", "echo", "logprobs", "return_token_ids",
                                       "cache_salt", "documents", "prefix", "suffix",
                                       "prompt_logprobs", "return_tokens_as_token_ids", "priority", "use_beam_search", "length_penalty"}
# The chat template's fields (chat_prompt.py), shared by chat and the messages form of /tokenize.
TEMPLATE_FIELDS = frozenset({"chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"})
CHAT_FIELDS = SAMPLING_FIELDS | STRUCTURED_FIELDS | TEMPLATE_FIELDS | {
    "model", "messages", "max_completion_tokens", "stream", "stream_options", "tools", "tool_choice", "response_format",
    "logprobs", "top_logprobs", "cache_salt", "documents", "echo", "include_reasoning", "prompt_logprobs",
    "return_tokens_as_token_ids", "priority", "use_beam_search", "length_penalty", "parallel_tool_calls", "return_token_ids",
    "reasoning_effort"}
# /tokenize (a prompt, or messages rendered as chat renders them) and /detokenize, vLLM's shapes.
TOKENIZE_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_FIELDS = TEMPLATE_FIELDS | {"model", "messages", "tools", "add_special_tokens", "return_token_strs"}
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
RL_FIELDS = frozenset({"prompts", "sampling_params", "lora_name"})
# /v1/responses (engine/server/responses.py): OpenAI's fields, and the sampling fields vLLM accepts there
RESPONSES_FIELDS = (SAMPLING_FIELDS - {"n", "max_tokens", "truncate_prompt_tokens"}) | {
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "stream", "text", "reasoning", "include",
    "top_logprobs", "store", "previous_response_id", "truncation", "background", "service_tier", "metadata", "cache_salt",
    "priority", "return_tokens_as_token_ids", "parallel_tool_calls", "conversation"}
RL_SAMPLING_FIELDS = SAMPLING_FIELDS

# Accepted and ignored, because ignoring them cannot change what the client gets back.
IGNORED_FIELDS: dict[str, tuple[type, str]] = {
    "user": (str, "an end-user id for the provider's abuse monitoring; it does not affect the output"),
    "safety_identifier": (str, "OpenAI's newer name for `user`; it does not affect the output"),
    "metadata": (dict, "tags for stored completions; cuttle stores nothing (`store` must be false)"),
    "prompt_cache_key": (str, "a cache-routing hint; cuttle's prefix cache finds shared prefixes by their tokens"),
}

# Not implemented, but accepted at the value that means "off" (best_of also equal to n).
OFF_VALUES: dict[str, tuple[Any, str]] = {
    "best_of": (1, "best_of is not supported (use n)"),
    "suffix": ("", "suffix (fill in the middle) is a /v1/completions field"),
    "store": (False, "store: true is not supported: cuttle stores no completions"),
}

# Why some well-known fields are refused (any other unknown field gets a generic message).
_REFUSED_WHY = {
    "guided_whitespace_pattern": "cuttle's JSON has no free whitespace (separators ', ' and ': ', docs/server.md)",
    "prefix": ("prefix is a /v1/completions field; in chat the system messages are the documents' prefix "
               "(docs/server.md)"),
    "functions": "the deprecated functions API is not supported (use tools)",
    "function_call": "the deprecated functions API is not supported (use tool_choice)",
}


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function name


def check_fields(body: dict[str, Any], allowed: frozenset[str] | set[str], n: Any = 1) -> None:
    """Refuse (400, param = the field) every field that is neither implemented nor harmless to ignore."""
    for name, v in body.items():
        if v is None:
            continue
        if name in allowed:
            continue
        if name in OFF_VALUES:
            off, why = OFF_VALUES[name]
            if not (type(v) is type(off) and (v == off or (name == "best_of" and v == n))):
                raise OpenAIError(f"{why}; got {name}={show(v)}", param=name)
        elif name in IGNORED_FIELDS:
            _typed(body, name, IGNORED_FIELDS[name][0], f"of type {IGNORED_FIELDS[name][0].__name__}")
        else:
            why = _REFUSED_WHY.get(name, "this server does not implement it")
            raise OpenAIError(f"{name} is not supported: {why}. cuttle refuses fields it cannot honour rather than "
                              "ignoring them", param=name)


# ---- typed getters ---------------------------------------------------------------------------
def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """The field's value if present (None if absent or null), refused unless an instance of
    `kind` (never a bool where a number is meant): the one shape check every getter shares."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise OpenAIError(f"{name} must be {what}, got {type(v).__name__}", param=name)
    return v


def get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = _typed(body, name, bool, "a boolean")
    return default if v is None else v


def get_int(body: dict[str, Any], name: str, lo: int, hi: int, default: int | None = None, param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise OpenAIError(f"{name} must be an integer in [{lo}, {hi}], got {show(v)}", param=param or name)
    return v


def get_float(body: dict[str, Any], name: str, default: float) -> float:
    """A finite number (NaN / Infinity, which Python's json accepts, are refused here)."""
    v = _typed(body, name, (int, float), "a number")
    if v is None:
        return default
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise OpenAIError(f"{name} must be a finite number, got {show(v)}", param=name)
    return f


def get_str(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    v = _typed(body, name, str, "a string")
    return default if v is None else v


def is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def get_documents(body: dict[str, Any]) -> list[str | list[int]] | None:
    """The `documents` extension (squid, docs/server.md): a list of texts or token-id lists. Their
    contents (empty, token range, count, length) are the engine's to check; it names the field."""
    docs = _typed(body, "documents", list, "a list of strings or token-id lists")
    if docs is None:
        return None
    for i, d in enumerate(docs):
        if not (isinstance(d, str) or is_token_ids(d)):
            raise OpenAIError(f"documents[{i}] must be a string or a list of token ids, got {show(d)}", param="documents")
    return docs


def get_stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """stream_options -> (include_usage, continuous_usage_stats)."""
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not isinstance(so, dict):
        raise OpenAIError("stream_options must be an object", param="stream_options")
    if body.get("stream") is not True:  # vLLM's and OpenAI's rule: it would be silently dropped
        raise OpenAIError("stream_options can only be given with stream: true", param="stream_options")
    for k, v in so.items():
        if k == "include_usage" and (v is None or isinstance(v, bool)):
            continue
        if k == "continuous_usage_stats" and (v is None or isinstance(v, bool)):
            continue
        raise OpenAIError(f"stream_options.{k}={show(v)} is not supported (include_usage and continuous_usage_stats, "
                          "booleans)", param="stream_options")
    include, continuous = bool(so.get("include_usage")), bool(so.get("continuous_usage_stats"))
    if continuous and not include:  # vLLM drops it silently then
        raise OpenAIError("stream_options.continuous_usage_stats needs include_usage: true", param="stream_options")
    return include, continuous


def show(v: Any) -> str:
    """A value for an error message, cut short (a client's value can be megabytes)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def sampling_params(body: dict[str, Any], max_tokens_field: str = "max_tokens", default_max_tokens: int | None = 16,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise OpenAIError("stop must be a string or a list of strings", param="stop")
    max_field = max_tokens_field if body.get(max_tokens_field) is not None else "max_tokens"
    max_tokens = get_int(body, max_field, 1, 2**31 - 1)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not is_token_ids(stop_ids):
        raise OpenAIError("stop_token_ids must be a list of integers", param="stop_token_ids")
    allowed = body.get("allowed_token_ids")
    if allowed is not None and not (is_token_ids(allowed) and allowed):
        raise OpenAIError("allowed_token_ids must be a non-empty list of token ids", param="allowed_token_ids")
    bad_words = body.get("bad_words")
    if bad_words is not None and not (isinstance(bad_words, list) and all(isinstance(w, str) for w in bad_words)):
        raise OpenAIError("bad_words must be a list of strings", param="bad_words")
    fields = dict(
        n=get_int(body, "n", 1, 1024, 1),
        temperature=get_float(body, "temperature", 1.0),
        top_p=get_float(body, "top_p", 1.0),
        top_k=get_int(body, "top_k", -1, 2**31 - 1, -1),
        min_p=get_float(body, "min_p", 0.0),
        seed=get_int(body, "seed", -(2**63), 2**63 - 1),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=get_int(body, "min_tokens", 0, 2**31 - 1, 0),
        stop=[stop] if isinstance(stop, str) else (stop or []),
        stop_token_ids=stop_ids or [],
        ignore_eos=get_bool(body, "ignore_eos"),
        presence_penalty=get_float(body, "presence_penalty", 0.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0),
        repetition_penalty=get_float(body, "repetition_penalty", 1.0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
        output_kind=output_kind,
        logit_bias=get_logit_bias(body),
        allowed_token_ids=allowed,
        bad_words=bad_words or None,
        structured_outputs=structured_outputs,
        truncate_prompt_tokens=get_int(body, "truncate_prompt_tokens", -(2**31), 2**31 - 1),
        thinking_token_budget=get_int(body, "thinking_token_budget", 0, 2**31 - 1),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        field = str(e).split(" ", 1)[0].split("[")[0]
        if field == "max_tokens":
            field = max_field
        raise OpenAIError(str(e), param=field if field in fields or field == max_field else None) from None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace"}


def structured_outputs_of(body: dict[str, Any], tokenizer: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured output (None for none) and the field it came from. Its grammar is
    parsed and the tokenizer checked here, so every refusal names the field the client sent."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("auto", "xgrammar"):
        raise OpenAIError(f"guided_decoding_backend {show(backend)} is not supported: cuttle's backend is xgrammar "
                          "('auto' or 'xgrammar')", param="guided_decoding_backend")
    given = [k for k in (*_GUIDED, "structured_outputs") if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise OpenAIError(f"response_format.type {show(kind)} is not supported (text, json_object or json_schema)",
                              param="response_format")
        if kind != "text":
            given.append("response_format")
    if not given:
        return None, None
    if len(given) > 1:
        raise OpenAIError(f"{given[1]} cannot be combined with {given[0]}: a request has one structured output", param=given[1])
    field = given[0]
    spec: dict[str, Any]
    if field in _GUIDED:
        v = body[field]
        if field == "guided_json" and isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise OpenAIError("guided_json must be a JSON schema (an object, or its JSON text)", param=field) from None
        spec = {_GUIDED[field]: v}
    elif field == "structured_outputs":
        so = body[field]
        if not isinstance(so, dict):
            raise OpenAIError("structured_outputs must be an object (json, regex, choice, grammar or json_object)", param=field)
        unknown = sorted(set(so) - _STRUCTURED_KEYS)
        if unknown:
            raise OpenAIError(f"structured_outputs.{unknown[0]} is not supported (only {sorted(_STRUCTURED_KEYS)})", param=field)
        spec = {k: v for k, v in so.items() if v is not None}
    elif rf["type"] == "json_object":
        spec = {"json_object": True}
    else:
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise OpenAIError("response_format json_schema needs json_schema: {name, schema: {...}, strict}", param=field)
        if js.get("strict") not in (None, True, False):
            raise OpenAIError("response_format.json_schema.strict must be a boolean", param=field)
        spec = {"json": js["schema"]}  # strict or not, the schema is enforced
    try:
        params = StructuredOutputsParams(**spec)
        check_structured(params, tokenizer)
    except (ValueError, TypeError) as e:
        raise OpenAIError(f"{field}: {e}", param=field) from None
    return params, field


def check_structured(params: StructuredOutputsParams, tokenizer: Any) -> None:
    """Parse the grammar and check the tokenizer (ValueError otherwise); the engine compiles it."""
    from cuttle.engine.structured_output import build_grammar, check_tokenizer

    check_tokenizer(tokenizer)
    build_grammar(params)


def get_logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """OpenAI's logit_bias: token id (a JSON key, so a string) -> bias in [-100, 100]."""
    lb = _typed(body, "logit_bias", dict, "an object mapping token ids to biases")
    if not lb:
        return None
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):  # "²".isdigit() is True, int("²") fails
            raise OpenAIError(f"logit_bias keys must be token ids (decimal strings), got {show(k)}", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise OpenAIError(f"logit_bias[{k}] must be a number in [-100, 100], got {show(v)}", param="logit_bias")
        out[int(k)] = float(v)
    return out


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` as OpenAI defines them; the tool parsers and templates read these fields."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list", param="tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise OpenAIError(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}", param="tools")
        if not isinstance(f.get("name"), str) or not _TOOL_NAME.fullmatch(f["name"]):
            # OpenAI's rule; it also keeps a name from breaking out of the JSON or tag a forced tool call opens with
            raise OpenAIError(f"tools[{i}].function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {show(f.get('name'))}",
                              param="tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise OpenAIError(f"tools[{i}].function.description must be a string", param="tools")
        params = f.get("parameters")
        if params is not None:
            props = params.get("properties") if isinstance(params, dict) else None
            if not isinstance(params, dict) or not (props is None or (isinstance(props, dict) and all(isinstance(p, dict) for p in props.values()))):
                raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema object (properties: name -> schema)", param="tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise OpenAIError(f"tools[{i}].function.strict must be a boolean", param="tools")
    return tools


@dataclass(slots=True)
class Usage:
    """Token counts of a response. A final output's prompt counts once (`add_prompt`); generated
    tokens are counted from every output that carries them (`add_completion`: the one final
    output of a non-streamed request, or each delta of a streamed one)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_document_tokens: int = 0
    cache_write_tokens: int = 0

    def add_prompt(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.cached_tokens += out.num_cached_tokens
        self.cached_document_tokens += out.num_cached_document_tokens
        self.cache_write_tokens += out.num_cache_written_tokens

    def add_completion(self, out: RequestOutput) -> None:
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def to_openai(self) -> dict[str, Any]:
        # cached_tokens: prefix-cache hits plus squid prefix / document tokens served from the
        # document cache; cached_document_tokens: those of them from the document cache;
        # cache_write_tokens (the Responses API's name): prompt tokens this request put in the prefix cache
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens,
                                          "cached_document_tokens": self.cached_document_tokens,
                                          "cache_write_tokens": self.cache_write_tokens}}


# JSON has no infinity: a logprob of -inf (a token the processed distribution excludes: top_k,
# top_p, min_p, allowed_token_ids, a grammar) goes on the wire as vLLM sends it
WIRE_MIN_LOGPROB = -9999.0


def wire_logprob(x: float) -> float:
    return WIRE_MIN_LOGPROB if x < WIRE_MIN_LOGPROB else x


def get_priority(body: dict[str, Any], policy: str) -> int:
    """vLLM's `priority` (lower is scheduled first), refused unless the server schedules by it."""
    p = get_int(body, "priority", -(2**63), 2**63 - 1, 0)
    if p != 0 and policy != "priority":
        raise OpenAIError(f"priority {p} needs a server started with --scheduling-policy priority (this one schedules first "
                          "come, first served)", param="priority")
    return p


def get_prompt_logprobs(body: dict[str, Any], stream: bool, documents: bool) -> int | None:
    """vLLM's `prompt_logprobs`: each prompt position's logprob and top k (0..20), in the final
    response only (vLLM's rule: not with streaming), never for squid documents (their KV is
    reused, not recomputed)."""
    k = get_int(body, "prompt_logprobs", 0, 20)
    if k is not None and stream:
        raise OpenAIError("prompt_logprobs is not available with stream: true (they come in the final response)",
                          param="prompt_logprobs")
    if k is not None and documents:
        raise OpenAIError("prompt_logprobs are not computed for prompts with documents (their KV is reused, not "
                          "recomputed)", param="prompt_logprobs")
    return k


def top_k_of(lps: dict[int, Logprob], k: int, token: int) -> dict[int, Logprob]:
    """A position's logprobs cut to its top k and its own token (the engine computed the larger
    k of two fields that share them: echo's logprobs and prompt_logprobs)."""
    return {t: lp for t, lp in lps.items() if lp.rank <= k or t == token}


def prompt_logprobs_wire(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` on the wire: per prompt token (None for the first), token id ->
    {logprob, rank, decoded_token} for the token itself and the top k."""
    return [None if lps is None else {
        str(t): {"logprob": wire_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in top_k_of(lps, k, tok).items()} for tok, lps in zip(token_ids, logprobs)]


def token_label(tokenizer, token_id: int, as_ids: bool) -> str:
    """How a token is named in a logprobs object: its text, or vLLM's `token_id:N` under
    `return_tokens_as_token_ids` (a client then reads ids without re-tokenizing, and two ids with
    the same text stay two entries)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.token_text(token_id)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], text_offset0: int = 0,
                        as_ids: bool = False) -> dict[str, Any]:
    """Legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset
    (offsets count the tokens' text, also when they are named by id)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset0
    for tok, lps in zip(token_ids, logprobs):
        piece = tokenizer.token_text(tok)
        tokens.append(token_label(tokenizer, tok, as_ids))
        offsets.append(offset)
        offset += len(piece)
        if lps is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(wire_logprob(lps[tok].logprob) if tok in lps else None)
        tops.append({token_label(tokenizer, t, as_ids): wire_logprob(lp.logprob) for t, lp in lps.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int,
                  as_ids: bool = False) -> list[dict[str, Any]]:
    """Chat `logprobs.content`; `bytes` are the token's text's UTF-8 bytes, also when `token`
    names it by id."""
    out = []
    for tok, lps in zip(token_ids, logprobs):
        ranked = sorted(lps.items(), key=lambda kv: kv[1].rank)[:top_n]
        out.append({
            "token": token_label(tokenizer, tok, as_ids), "logprob": wire_logprob(lps[tok].logprob),
            "bytes": list(tokenizer.token_text(tok).encode()),
            "top_logprobs": [{"token": token_label(tokenizer, t, as_ids), "logprob": wire_logprob(lp.logprob),
                              "bytes": list(tokenizer.token_text(t).encode())} for t, lp in ranked],
        })
    return out
