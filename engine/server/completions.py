"""POST /v1/completions: text or token-id prompts (one or a list), `n`, `echo`, `logprobs`,
`return_token_ids`, streaming, structured output (`response_format`, `guided_*`,
`structured_outputs`), squid documents (`documents`, `prefix`) and fill in the middle (`suffix`,
in the checkpoint's infilling format: engine/fim.py); docs/server.md. `use_beam_search` goes to
beam_completions.py.

Owns the completions wire format of a request and of its choices only; admission, waiting,
streaming, disconnects and usage are `streaming.Serving`'s.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request

from cuttle.engine.openai_protocol import (
    COMPLETION_FIELDS, OpenAIError, Usage, completion_logprobs, get_bool, get_documents, get_int, get_priority, get_prompt_logprobs, get_str,
    get_stream_options, is_token_ids, prompt_logprobs_wire, sampling_params, structured_outputs_of, top_k_of,
)
from cuttle.engine.async_engine import RequestOptions
from cuttle.engine.generation_config import with_defaults
from cuttle.engine.fim import FORMATS, MISTRAL, FimFormat
from cuttle.engine.outputs import CompletionOutput, RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind
from cuttle.engine.server.beam_completions import beam_search_completion
from cuttle.engine.server.body import read_body
from cuttle.engine.server.streaming import Delta, Fields, Prompt, Serving
from cuttle.engine.tokenizer import Tokenizer


def add_completion_routes(app: FastAPI, serving: Serving, tok: Tokenizer) -> None:
    fim = FimFormat.of(tok)

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.monotonic()
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), COMPLETION_FIELDS)
        if body.get("prompt") is None:
            raise OpenAIError("prompt is required", param="prompt")
        prompts = _prompts(body["prompt"])
        if get_bool(body, "use_beam_search"):
            return await beam_search_completion(request, body, prompts, serving, tok, t0)
        if body.get("length_penalty") is not None:
            raise OpenAIError("length_penalty applies to beam search only (use_beam_search: true)", param="length_penalty")
        echo = get_bool(body, "echo")
        lp = get_int(body, "logprobs", 0, 20)
        stream = get_bool(body, "stream")
        include_usage, continuous_usage = get_stream_options(body)
        want_ids = get_bool(body, "return_token_ids")
        as_ids = serving.tokens_as_ids(body)
        admission = RequestOptions(get_str(body, "cache_salt"), get_priority(body, serving.engine.engine.config.scheduling_policy),
                                   serving.lora_of(body))
        documents = get_documents(body)
        prefix = body.get("prefix")
        if prefix is not None and not (isinstance(prefix, str) or is_token_ids(prefix)):
            raise OpenAIError("prefix must be a string or a list of token ids", param="prefix")
        squid = bool(documents) or prefix is not None
        want_plp = get_prompt_logprobs(body, stream, squid)
        # the engine computes one top k per prompt position, for both fields that read them
        echo_plp = lp if echo and lp is not None else None
        plp = max((k for k in (want_plp, echo_plp) if k is not None), default=None)
        suffix = get_str(body, "suffix")
        if suffix:  # "" is no suffix: a plain completion, as OpenAI's null
            # encoded off the event loop (a text prompt is encoded on the engine thread; a long
            # one here would stall every other client's stream)
            prompts, prefixes = await asyncio.get_running_loop().run_in_executor(
                None, _fim_prompts, fim, tok, prompts, suffix, echo, squid, prefix)
        else:
            prefixes = [prefix] * len(prompts)
        if squid and echo and lp is not None:
            raise OpenAIError("echo with logprobs needs the prompt's logprobs, which are not computed for prompts with documents",
                              param="documents")
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        structured, structured_field = structured_outputs_of(body, tok)
        defaults = serving.engine.engine.generation_defaults  # the model's generation_config.json
        # vLLM's scoring idiom: echo with max_tokens 0 answers the prompt (and its logprobs) alone;
        # the engine samples one token, which is dropped (usage counts it, as vLLM's does)
        no_tokens = type(body.get("max_tokens")) is int and body["max_tokens"] == 0
        score_only = echo and no_tokens
        if no_tokens and not echo:
            raise OpenAIError("max_tokens 0 scores the prompt without generating: it needs echo: true (and logprobs for the "
                              "scores)", param="max_tokens")
        sampled_body = {**body, "max_tokens": 1} if score_only else body
        given = body.get("stop_token_ids")
        if suffix and fim is not None and (given is None or isinstance(given, list)):  # (anything else is refused below)
            # an infill also ends at its format's control tokens (engine/fim.py)
            given = given or []
            sampled_body = {**sampled_body, "stop_token_ids": [*given, *(t for t in fim.stop_ids if t not in given)]}
        params = sampling_params(with_defaults(sampled_body, defaults), logprobs=lp,
                                 prompt_logprobs=plp, output_kind=kind, structured_outputs=structured)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # every prompt of the request is a query over the same prefix and documents (computed once)
        items: list[tuple[str, Prompt]] = [
            (f"{rid}-{i}", _squid_prompt(p, prefixes[i], documents) if squid else p) for i, p in enumerate(prompts)]
        fields = Fields("prompt", structured=structured_field or "structured_outputs")
        # echo repeats the `prompt` field as sent (with documents: the query, not the documents)
        echoed = [(p if isinstance(p, str) else tok.decode(p, False)) if echo else "" for p in prompts]

        def echo_of(i: int, out: RequestOutput) -> str:
            # a truncated prompt (truncate_prompt_tokens) echoes what was kept, as its tokens say
            if echo and params.truncate_prompt_tokens is not None:
                return tok.decode(out.prompt_token_ids, False)
            return echoed[i]

        def with_prompt(out: RequestOutput, ids: list[int], lps: list) -> tuple[list[int], list]:
            """echo + logprobs: the prompt's tokens and logprobs (its top `logprobs`) ahead of the sample's"""
            prompt = list(out.prompt_token_ids)
            plps = [None if d is None else top_k_of(d, lp, t) for t, d in zip(prompt, out.prompt_logprobs or [None] * len(prompt))]
            return prompt + ids, plps + lps

        def frame(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": admission.lora_request or serving.model_name,
                    "choices": choices, **extra}

        if not stream:
            def choice_logprobs(out: RequestOutput, c: CompletionOutput) -> dict[str, Any] | None:
                if lp is None:
                    return None
                ids, lps = ([], []) if score_only else (list(c.token_ids), list(c.logprobs or []))
                if echo:
                    ids, lps = with_prompt(out, ids, lps)
                return completion_logprobs(tok, ids, lps, as_ids=as_ids)

            def respond(finals: list[RequestOutput]) -> dict[str, Any]:
                usage = Usage()
                choices = []
                for i, out in enumerate(finals):
                    usage.add_prompt(out)
                    usage.add_completion(out)
                    for c in out.outputs:
                        ch = {"index": i * params.n + c.index, "text": echo_of(i, out) + ("" if score_only else c.text),
                              "logprobs": choice_logprobs(out, c), "finish_reason": "length" if score_only else c.finish_reason,
                              "stop_reason": None if score_only else c.stop_reason}
                        if want_ids:
                            ch["prompt_token_ids"], ch["token_ids"] = out.prompt_token_ids, [] if score_only else c.token_ids
                        if want_plp is not None:  # vLLM's field, beside each choice of the prompt
                            ch["prompt_logprobs"] = prompt_logprobs_wire(out.prompt_token_ids, out.prompt_logprobs or [], want_plp)
                        choices.append(ch)
                return frame(choices, usage=usage.to_openai())

            return await serving.complete(request, items, params, admission, fields, respond, t0)

        streams = await serving.open(request, items, params, admission, fields)

        def choice(d: Delta) -> dict[str, Any] | None:
            c, first = d.sample, d.first
            if score_only:  # the echo and the end, at the sample's end, without the one token sampled
                if c.finish_reason is None:
                    return None
                c, first = CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None, "length"), True
            text = echo_of(d.prompt, d.out) + c.text if first else c.text
            if not text and c.finish_reason is None and not c.token_ids:
                return None
            ch = {"index": d.prompt * params.n + c.index, "text": text, "logprobs": None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if lp is not None:
                ids, lps = list(c.token_ids), list(c.logprobs or [])
                if echo and first:  # the prompt's logprobs go with its echo, in the first chunk
                    ids, lps = with_prompt(d.out, ids, lps)
                ch["logprobs"] = completion_logprobs(tok, ids, lps, as_ids=as_ids)
            if want_ids:
                ch["token_ids"] = c.token_ids
                if d.first:  # vLLM's: the prompt's ids once, with the first chunk of each choice
                    ch["prompt_token_ids"] = d.out.prompt_token_ids
            return ch

        return serving.stream(streams, choice, frame, include_usage, t0, continuous_usage=continuous_usage)


def _fim_prompts(fim: FimFormat | None, tok: Tokenizer, prompts: list[str | list[int]], suffix: str, echo: bool,
                 squid: bool, prefix: Any) -> tuple[list[str | list[int]], list[Any]]:
    """Each prompt as the prefix of an infilling prompt ending in `suffix`, or a 400 naming the
    field where the model has no infilling tokens or another field excludes it; and each one's
    squid prefix. With documents (repository-level infilling: the other files, each cached on
    its own) the infilling prompt is the query after them, and the BOS a text prompt starts with
    (DeepSeek-Coder's) starts the layout instead: it becomes the squid prefix where none is sent,
    as a text query's BOS does (engine/squid.py `parse_prompt`)."""
    if fim is None:
        known = "; ".join([*(f"{name}: {' '.join(t)}" for name, t in FORMATS.items()), f"mistral: {' '.join(MISTRAL[:2])}"])
        raise OpenAIError("suffix (fill in the middle) needs a model trained on infilling, whose tokenizer has one of the "
                          f"infilling token sets ({known}); this model's tokenizer has none", param="suffix")
    if echo:
        raise OpenAIError("suffix cannot be combined with echo (the prompt sent is the prefix, not the infilling prompt)",
                          param="suffix")
    if not squid:
        return [fim.prompt_ids(tok, p, suffix) for p in prompts], [None] * len(prompts)
    queries = [fim.prompt_ids(tok, p, suffix, head=False) for p in prompts]
    heads = [list(fim.head_ids) if prefix is None and isinstance(p, str) and fim.head_ids else prefix for p in prompts]
    return queries, heads


def _squid_prompt(query: str | list[int], prefix: Any, documents: list[str | list[int]] | None) -> dict[str, Any]:
    """The engine's prompt dict (engine/squid.py): prefix, then each document encoded alone after
    it, then the query. Texts are tokenized by the engine, as a plain text prompt is."""
    p: dict[str, Any] = {"documents": documents or [], "prompt": query}
    if prefix is not None:
        p["prefix"] = prefix
    return p


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if is_token_ids(prompt) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (is_token_ids(p) and p) for p in prompt):
        return list(prompt)
    raise OpenAIError("prompt must be a string, a list of strings, a list of token ids, or a list of those (non-empty)", param="prompt")
