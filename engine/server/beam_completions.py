"""`use_beam_search: true` (vLLM's) on /v1/completions and /v1/chat/completions: `n` is the beam
width, and the response has the best `n` beams of each prompt (of the rendered conversation), best
first, as its choices (engine/beam_search.py).

Owns that request's fields and its response only. Beam search is deterministic and ranks whole
beams, so the fields that sample, stop early, stream or score are refused with it, each by name
(vLLM takes some and ignores them): what it takes is `n` (1..10), `max_tokens`, `length_penalty`,
`ignore_eos`, `temperature` (0 only), `include_stop_str_in_output`, `skip_special_tokens`,
`priority` and the ignored ones (`user`, ...); completions also `prompt`, `return_token_ids` and
`logprobs`, chat `messages`, `max_completion_tokens`, the template's fields, `include_reasoning`,
`logprobs` and `top_logprobs` (no tools, documents or structured output: their grammars and
parsers are per sample). A beam's logprobs are its tokens' under the steps that chose them, each
with the top k of that step's 2 x width candidates (as vLLM's: no more than those).

Each live beam is an engine session, as offline (`LLM.beam_search`): a step is one one-token turn
a beam, which computes only the beam's new token, then one engine command forks the kept
candidates' parents (`AsyncEngine.fork_beams`). Turns are admitted as any request is (the
in-flight limit, `priority`); a client leaving aborts them and closes every session. Where the
sessions' limits (`max_sessions`, `max_session_kv_blocks`) leave no room, at the start or at any
step, the search goes on from where it stands with one-token requests over each beam's whole
stream through `Serving.complete` (vLLM's driver; the prefix cache serves the full blocks), with
the same result.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request

from cuttle.engine.async_engine import AsyncEngine, QueueFullError, RequestOptions, RequestStream
from cuttle.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, run_beam_search_async
from cuttle.engine.openai_protocol import (IGNORED_FIELDS, TEMPLATE_FIELDS, OpenAIError, Usage, chat_logprobs, completion_logprobs,
                                           get_bool, get_float, get_int, get_priority, show, top_k_of)
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.server.streaming import Fields, Serving, final_output, until_disconnect
from cuttle.engine.session import SessionLimitError
from cuttle.engine.sleep_mode import EngineAsleepError
from cuttle.engine.tokenizer import Tokenizer

_COMMON = frozenset({"model", "n", "max_tokens", "use_beam_search", "length_penalty", "ignore_eos", "temperature",
                     "include_stop_str_in_output", "skip_special_tokens", "priority"}) | set(IGNORED_FIELDS)
BEAM_FIELDS = _COMMON | {"prompt", "return_token_ids", "logprobs"}
# chat: the template's fields, and the reasoning split of each beam's message
CHAT_BEAM_FIELDS = _COMMON | TEMPLATE_FIELDS | {"messages", "max_completion_tokens", "include_reasoning", "logprobs", "top_logprobs",
                                                 "return_token_ids"}


def beam_params(body: dict[str, Any], fields: frozenset[str] = BEAM_FIELDS) -> BeamSearchParams:
    """The request's BeamSearchParams, or a 400 naming the field (`fields`: what its route takes)."""
    for name, v in body.items():
        if v is not None and name not in fields:
            raise OpenAIError(f"{name} is not supported with use_beam_search (beam search is deterministic and returns "
                              f"whole beams; it takes {', '.join(sorted(fields - set(IGNORED_FIELDS)))})", param=name)
    temperature = get_float(body, "temperature", 0.0)
    if temperature != 0.0:
        raise OpenAIError(f"temperature must be 0 (or absent) with use_beam_search, got {show(body['temperature'])}",
                          param="temperature")
    width = get_int(body, "n", 1, MAX_BEAM_WIDTH, default=1)
    try:
        max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return BeamSearchParams(beam_width=width, max_tokens=get_int(body, max_field, 1, 2**31 - 1, default=16),
                                ignore_eos=get_bool(body, "ignore_eos"), length_penalty=get_float(body, "length_penalty", 1.0),
                                include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
                                skip_special_tokens=get_bool(body, "skip_special_tokens", True))
    except ValueError as e:  # (the getters checked every field; this is a guard)
        raise OpenAIError(str(e)) from None


async def beam_search_completion(request: Request, body: dict[str, Any], prompts: list[str | list[int]], serving: Serving,
                                 tok: Tokenizer, t0: float) -> dict[str, Any]:
    params = beam_params(body)
    want_ids = get_bool(body, "return_token_ids")
    top = get_int(body, "logprobs", 0, 20, default=None)  # each token's step candidates, the top k of them
    loop = asyncio.get_running_loop()
    engine = serving.engine.engine
    ids = [await loop.run_in_executor(None, engine.encode, p) if isinstance(p, str) else list(p) for p in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    searches, usage = await run_beam_search(request, body, serving, ids, params, rid, t0, Fields("prompt"))
    choices = []
    for i, s in enumerate(searches):
        for j, beam in enumerate(s.result()):
            gen = s.generated(beam)
            ch = {"index": i * params.beam_width + j, "text": tok.decode(gen, params.skip_special_tokens), "logprobs": None,
                  "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason}
            if top is not None:
                ch["logprobs"] = completion_logprobs(tok, gen, [top_k_of(d, top, t) for t, d in zip(gen, beam.logprobs)])
            if want_ids:
                ch["prompt_token_ids"], ch["token_ids"] = ids[i], gen
            choices.append(ch)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": serving.lora_of(body) or serving.model_name,
            "choices": choices, "usage": usage.to_openai()}


async def beam_search_chat(request: Request, body: dict[str, Any], params: BeamSearchParams, prompt: list[int], serving: Serving,
                           tok: Tokenizer, t0: float, message_of: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """Chat's `use_beam_search` (`params`: `beam_params(body, CHAT_BEAM_FIELDS)`): the rendered
    conversation's best `n` beams, best first, each a message (`message_of(text)`: the role, and
    the reasoning split where the server has a reasoning parser)."""
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    want_lp = get_bool(body, "logprobs")
    top_n = get_int(body, "top_logprobs", 0, 20, 0)
    if top_n and not want_lp:
        raise OpenAIError("top_logprobs requires logprobs: true", param="top_logprobs")
    want_ids = get_bool(body, "return_token_ids")
    searches, usage = await run_beam_search(request, body, serving, [prompt], params, rid, t0, Fields("messages", max_field))
    choices = []
    for j, beam in enumerate(searches[0].result()):
        gen = searches[0].generated(beam)
        choices.append({"index": j, "message": message_of(tok.decode(gen, params.skip_special_tokens)),
                        "logprobs": {"content": chat_logprobs(tok, gen, beam.logprobs, top_n)} if want_lp else None,
                        "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason, **({"token_ids": gen} if want_ids else {})})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": serving.lora_of(body) or serving.model_name,
            "choices": choices, "usage": usage.to_openai(), **({"prompt_token_ids": prompt} if want_ids else {})}


async def run_beam_search(request: Request, body: dict[str, Any], serving: Serving, ids: list[list[int]],
                          params: BeamSearchParams, rid: str, t0: float, fields: Fields) -> tuple[list[BeamSearch], Usage]:
    """Search each token-id prompt to the end (sessions, else one-token requests; module
    docstring); the searches, and the usage of their best beams."""
    engine = serving.engine.engine
    lora = serving.lora_of(body)  # every beam runs under the request's adapter (its sessions, or its steps)
    priority = get_priority(body, engine.config.scheduling_policy)
    for i, p in enumerate(ids):
        if len(p) + params.max_tokens > engine.max_model_len:
            where = fields.prompt if len(ids) == 1 else f"{fields.prompt}[{i}]"
            raise OpenAIError(f"{where}: {len(p)} prompt tokens + {fields.max_tokens} ({params.max_tokens}) exceed max_model_len "
                              f"({engine.max_model_len})", param=fields.max_tokens)
    searches = [BeamSearch(p, params, engine.eos_token_ids) for p in ids]
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)
    firsts: list[RequestOutput] = []
    version: list[int] = []  # the weights the search runs under (its first step's)

    async def score(token_lists: list[list[int]]) -> list[dict]:
        items = [(f"{rid}-beam-{uuid.uuid4().hex[:12]}", t) for t in token_lists]
        finals = await serving.complete(request, items, step, RequestOptions(priority=priority, lora_request=lora), fields, lambda outs: outs, t0,
                                        observe=False)
        if not firsts:
            firsts.extend(finals)  # the first step's outputs: the prompts' own admission (cached tokens)
        return [_candidates(out, version) for out in finals]

    async def with_sessions() -> bool:
        return await _search_in_sessions(serving.engine, searches, step, rid, priority, firsts, version, lora)

    if not await until_disconnect(request, with_sessions(), serving.disconnected):
        await run_beam_search_async(searches, score)
    usage = Usage()
    for s, first in zip(searches, firsts):
        usage.add_prompt(first)
        usage.completion_tokens += sum(len(s.generated(beam)) for beam in s.result())
    return searches, usage


def _candidates(out: RequestOutput, version: list[int]) -> dict:
    """A one-token step's candidates (token id -> Logprob). A step the engine aborted (a weight
    update with in_flight="abort", say) ends the search with a 503, and so does a step under other
    weights than the search's first (an update landed between two steps): no search spans two
    weight versions, as no request does. `version`: the search's, set by its first step."""
    c = out.outputs[0]
    if c.finish_reason == "abort" or not c.logprobs:
        raise OpenAIError("a beam search step was aborted by the engine (a weight update or a shutdown?); retry the request",
                          503, "server_busy")
    v = int(out.metrics["weight_version"])
    if not version:
        version.append(v)
    elif version[0] != v:
        raise OpenAIError(f"the weights changed during this beam search (version {version[0]} -> {v}); retry the request",
                          503, "server_busy")
    return c.logprobs[0]


async def _search_in_sessions(engine: AsyncEngine, searches: list[BeamSearch], step: SamplingParams, rid: str, priority: int,
                              firsts: list[RequestOutput], version: list[int], lora: str | None = None) -> bool:
    """Run `searches` with each live beam an engine session; True when they end. False, with every
    session closed and the searches where they stand, when a session limit refuses a session or a
    turn (`SessionLimitError`): the caller goes on another way."""
    live: list[list[str]] = []
    try:
        await engine.open_beams([s.beams[0].tokens for s in searches], live, lora)
        while True:
            work = [(s, sids) for s, sids in zip(searches, live) if not s.done]
            if not work:
                return True
            flat = [sid for _, sids in work for sid in sids]
            finals = await _turns(engine, flat, step, rid, priority)  # each appends its argmax to its session
            if not firsts:
                firsts.extend(finals)  # the first step's outputs: the prompts' own admission (cached tokens)
            at = 0
            for s, sids in work:
                s.advance([_candidates(out, version) for out in finals[at:at + len(sids)]])
                at += len(sids)
            for s, sids in work:
                if s.done:  # a finished search needs no more KV
                    await engine.close_beams([sids])
                else:  # (if a fork fails, the parents stay in `sids`, closed below)
                    await engine.fork_beams(sids, s.origins)
    except SessionLimitError:
        return False
    finally:
        # one command, after any the caller stopped waiting for: it sees every session they made
        await engine.close_beams(live)


async def _turns(engine: AsyncEngine, sids: list[str], step: SamplingParams, rid: str, priority: int) -> list[RequestOutput]:
    """One turn of each session (each its own request: beams have diverged), admitted together;
    their final outputs, in order. If any is refused, the others are aborted."""
    got = await asyncio.gather(*(engine.session_turn(f"{rid}-beam-{uuid.uuid4().hex[:12]}", sid, step, priority) for sid in sids),
                               return_exceptions=True)
    streams = [g for g in got if isinstance(g, RequestStream)]
    try:
        err = next((g for g in got if isinstance(g, BaseException)), None)
        if isinstance(err, QueueFullError):
            raise OpenAIError(f"server is at capacity: {err}", 503, "server_busy") from None
        if isinstance(err, EngineAsleepError):
            raise OpenAIError(str(err), 503, "server_asleep") from None
        if err is not None:
            raise err
        return [await final_output(st) for st in streams]
    finally:
        for st in streams:
            st.close()
