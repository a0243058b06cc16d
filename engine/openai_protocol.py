"""The OpenAI wire format: request bodies -> SamplingParams (with errors that name the field),
and RequestOutputs -> completion / chat-completion JSON.

Owns no I/O; the server calls these. Unknown fields are ignored (as OpenAI does); a field it
cannot honour (response_format json) is refused, never silently dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampler import Logprob
from cuttle.engine.sampling_params import SamplingParams


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise OpenAIError(f"{name} must be of type {'/'.join(k.__name__ for k in kinds)}", param=name)
    if not isinstance(v, kinds):
        raise OpenAIError(f"{name} must be of type {'/'.join(k.__name__ for k in kinds)}, got {type(v).__name__}", param=name)
    return v


def sampling_params(body: dict[str, Any], max_tokens_field: str = "max_tokens", default_max_tokens: int | None = 16,
                    logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise OpenAIError("stop must be a string or a list of strings", param="stop")
    max_tokens = _get(body, max_tokens_field, (int,), None)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _get(body, "max_tokens", (int,), None)
    fields = dict(
        n=_get(body, "n", (int,), 1),
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        top_k=_get(body, "top_k", (int,), -1),
        min_p=float(_get(body, "min_p", (int, float), 0.0)),
        seed=_get(body, "seed", (int,), None),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=_get(body, "min_tokens", (int,), 0),
        stop=[stop] if isinstance(stop, str) else (stop or []),
        stop_token_ids=_get(body, "stop_token_ids", (list,), []),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
        presence_penalty=float(_get(body, "presence_penalty", (int, float), 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", (int, float), 0.0)),
        repetition_penalty=float(_get(body, "repetition_penalty", (int, float), 1.0)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=_get(body, "skip_special_tokens", (bool,), True),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", (bool,), False),
    )
    if body.get("logit_bias"):
        raise OpenAIError("logit_bias is not supported", param="logit_bias")
    if body.get("best_of") not in (None, 1, fields["n"]):
        raise OpenAIError("best_of is not supported (use n)", param="best_of")
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        field = str(e).split(" ", 1)[0].split("[")[0]
        raise OpenAIError(str(e), param=field if field in fields else None) from None


def check_response_format(body: dict[str, Any]) -> None:
    rf = body.get("response_format")
    if rf is None:
        return
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind != "text":
        raise OpenAIError(
            f"response_format {kind!r} is not supported: cuttle has no constrained decoding yet, and an unenforced "
            "format would be silently wrong; only {'type': 'text'} is accepted", param="response_format")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.cached_tokens += out.num_cached_tokens

    def to_openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], text_offset0: int = 0) -> dict[str, Any]:
    """Legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset0
    for tok, lps in zip(token_ids, logprobs):
        piece = tokenizer.decode([tok], skip_special_tokens=False)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        if lps is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(lps[tok].logprob if tok in lps else None)
        tops.append({tokenizer.decode([t], skip_special_tokens=False): lp.logprob for t, lp in lps.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> list[dict[str, Any]]:
    out = []
    for tok, lps in zip(token_ids, logprobs):
        piece = tokenizer.decode([tok], skip_special_tokens=False)
        ranked = sorted(lps.items(), key=lambda kv: kv[1].rank)[:top_n]
        out.append({
            "token": piece, "logprob": lps[tok].logprob, "bytes": list(piece.encode()),
            "top_logprobs": [{"token": (p := tokenizer.decode([t], skip_special_tokens=False)), "logprob": lp.logprob,
                              "bytes": list(p.encode())} for t, lp in ranked],
        })
    return out
