"""/v1/completions with `use_beam_search: true` (vLLM's): `n` is the beam width, and the response
has the best `n` beams of each prompt, best first, as its choices (engine/beam_search.py).

Owns that request's fields and its response only. Beam search is deterministic and ranks whole
beams, so the fields that sample, stop early, stream or score are refused with it, each by name
(vLLM takes some and ignores them): what it takes is `prompt`, `n` (1..10), `max_tokens`,
`length_penalty`, `ignore_eos`, `temperature` (0 only), `include_stop_str_in_output`,
`skip_special_tokens`, `return_token_ids`, `priority` and the ignored ones (`user`, ...). Each
step is one round of one-token requests through `Serving.complete`, so admission limits,
priorities and a client leaving (every beam's request aborted) work as for any request.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request

from cuttle.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, run_beam_search_async
from cuttle.engine.openai_protocol import IGNORED_FIELDS, OpenAIError, Usage, get_bool, get_float, get_int, get_priority, show
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.server.streaming import Fields, Serving
from cuttle.engine.tokenizer import Tokenizer

BEAM_FIELDS = frozenset({"model", "prompt", "n", "max_tokens", "use_beam_search", "length_penalty", "ignore_eos", "temperature",
                         "include_stop_str_in_output", "skip_special_tokens", "return_token_ids", "priority"}) | set(IGNORED_FIELDS)


def beam_params(body: dict[str, Any]) -> BeamSearchParams:
    """The request's BeamSearchParams, or a 400 naming the field."""
    for name, v in body.items():
        if v is not None and name not in BEAM_FIELDS:
            raise OpenAIError(f"{name} is not supported with use_beam_search (beam search is deterministic and returns "
                              f"whole beams; it takes {', '.join(sorted(BEAM_FIELDS - set(IGNORED_FIELDS)))})", param=name)
    temperature = get_float(body, "temperature", 0.0)
    if temperature != 0.0:
        raise OpenAIError(f"temperature must be 0 (or absent) with use_beam_search, got {show(body['temperature'])}",
                          param="temperature")
    width = get_int(body, "n", 1, MAX_BEAM_WIDTH, default=1)
    try:
        return BeamSearchParams(beam_width=width, max_tokens=get_int(body, "max_tokens", 1, 2**31 - 1, default=16),
                                ignore_eos=get_bool(body, "ignore_eos"), length_penalty=get_float(body, "length_penalty", 1.0),
                                include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
                                skip_special_tokens=get_bool(body, "skip_special_tokens", True))
    except ValueError as e:  # (the getters checked every field; this is a guard)
        raise OpenAIError(str(e)) from None


async def beam_search_completion(request: Request, body: dict[str, Any], prompts: list[str | list[int]], serving: Serving,
                                 tok: Tokenizer, t0: float) -> dict[str, Any]:
    params = beam_params(body)
    engine = serving.engine.engine
    priority = get_priority(body, engine.config.scheduling_policy)
    want_ids = get_bool(body, "return_token_ids")
    loop = asyncio.get_running_loop()
    ids = [await loop.run_in_executor(None, engine.encode, p) if isinstance(p, str) else list(p) for p in prompts]
    for i, p in enumerate(ids):
        if len(p) + params.max_tokens > engine.max_model_len:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise OpenAIError(f"{where}: {len(p)} prompt tokens + max_tokens ({params.max_tokens}) exceed max_model_len "
                              f"({engine.max_model_len})", param="max_tokens")
    searches = [BeamSearch(p, params, engine.eos_token_ids) for p in ids]
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)
    rid = f"cmpl-{uuid.uuid4().hex}"
    fields = Fields("prompt")
    firsts: list[RequestOutput] = []

    async def score(token_lists: list[list[int]]) -> list[dict]:
        items = [(f"{rid}-beam-{uuid.uuid4().hex[:12]}", t) for t in token_lists]
        finals = await serving.complete(request, items, step, None, fields, lambda outs: outs, t0, observe=False, priority=priority)
        if not firsts:
            firsts.extend(finals)  # the first step's outputs: the prompts' own admission (cached tokens)
        return [out.outputs[0].logprobs[0] for out in finals]

    await run_beam_search_async(searches, score)
    usage = Usage()
    choices = []
    for i, (s, first) in enumerate(zip(searches, firsts)):
        usage.add_prompt(first)
        for j, beam in enumerate(s.result()):
            gen = s.generated(beam)
            usage.completion_tokens += len(gen)
            ch = {"index": i * params.beam_width + j, "text": tok.decode(gen, params.skip_special_tokens), "logprobs": None,
                  "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason}
            if want_ids:
                ch["prompt_token_ids"], ch["token_ids"] = ids[i], gen
            choices.append(ch)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": serving.model_name,
            "choices": choices, "usage": usage.to_openai()}
