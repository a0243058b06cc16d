"""Reading a request body: the JSON object of a POST, within the server's limits.

Owns the byte limit (413), the nesting limit and the refusal of values Python's json accepts
but JSON does not (NaN, Infinity, numbers that overflow a float, integers past Python's digit
limit), each a 400 naming the field; and the checks every OpenAI route makes before reading a
field: the model name and the known-field list (`openai_protocol.check_fields`). It never
interprets a field's meaning; that is `openai_protocol`'s job.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from typing import Any

from fastapi import Request

from cuttle.engine.openai_protocol import OpenAIError, check_fields, show

# The largest JSON request body (413 above it). 32 MiB holds a batch of ~4M prompt token ids as
# JSON; the weight upload (/v1/rl/update_weights, behind the API key) is not limited.
MAX_BODY_BYTES = 32 * 2**20
# The deepest nesting of a JSON body (the top-level object is depth 1). OpenAI bodies need ~10
# (a tool's JSON schema a few more); the limit keeps recursive code (the json decoder, template
# rendering) far from Python's recursion limit.
MAX_JSON_DEPTH = 64

_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


async def read_body(request: Request, limit: int, models: Collection[str], allowed: frozenset[str]) -> dict[str, Any]:
    """The body of an OpenAI route: JSON within the limits, naming one of the models this server
    serves (the base model first, then its LoRA adapters) or none, with no field outside `allowed`
    that is not harmless to ignore."""
    body = await json_body(request, limit)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(f"model must be a string, got {show(model)}", param="model")
    if model is not None and model not in models:
        served = ", ".join(repr(m) for m in models)
        raise OpenAIError(f"model {show(model)} does not exist; this server serves {served}", 404, param="model",
                          code="model_not_found")
    check_fields(body, allowed, body.get("n", 1))
    return body


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object: at most `limit` bytes (413), nested at most
    MAX_JSON_DEPTH deep, no NaN / Infinity / overflowing numbers (400 naming the field)."""
    size = request.headers.get("content-length")
    too_large = OpenAIError(f"request body is larger than {limit} bytes", 413, "invalid_request_error", code="request_too_large")
    if size is not None and size.isascii() and size.isdigit() and int(size) > limit:
        raise too_large
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    odd: list[str] = []  # NaN / Infinity literals and numbers that overflow a float

    def constant(text: str) -> float:
        odd.append(text)
        return float(text)

    def number(text: str) -> float:
        v = float(text)
        if math.isinf(v):
            odd.append(text)
        return v

    try:
        try:
            body = json.loads(raw, parse_constant=constant, parse_float=number)
        except ValueError as e:
            if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
                raise
            # an integer past Python's digit limit: parse again to find where it is
            body = json.loads(raw, parse_constant=constant, parse_float=number,
                              parse_int=lambda t: int(t) if len(t) <= 4000 else (odd.append(t), math.inf)[1])
    except RecursionError:
        raise OpenAIError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", param=_deep_field(raw)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    # rare: walk the values (a \uD800-\uDFFF escape may leave a lone surrogate, which no tokenizer takes)
    if odd or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Refuse a value nested too deep or a non-finite number, naming the field it is in (the
    top-level key, or `key.subkey` inside a top-level object such as sampling_params)."""
    todo: list[tuple[str, Any, int]] = []
    for name, v in body.items():
        if isinstance(v, dict):
            todo.extend((f"{name}.{k}", x, 3) for k, x in v.items())
        else:
            todo.append((name, v, 2))
    while todo:
        name, v, depth = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise OpenAIError(f"{name} holds a non-finite number ({v}); NaN and Infinity are not JSON", param=name)
        if isinstance(v, str) and not _is_utf8(v):
            raise OpenAIError(f"{name} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape): not text",
                              param=name)
        if isinstance(v, dict) and not all(_is_utf8(k) for k in v):
            raise OpenAIError(f"{name} has a key with a lone UTF-16 surrogate: not text", param=name)
        if isinstance(v, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise OpenAIError(f"{name} is nested deeper than the limit of {MAX_JSON_DEPTH} levels", param=name)
            todo.extend((name, x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _deep_field(raw: bytes) -> str | None:
    """The top-level field of a body too deep for the JSON decoder (a scan of its brackets)."""
    depth, last_key = 0, None
    for m in _JSON_TOKEN.finditer(raw):
        t = m.group()
        if t[0] == 0x22:  # a string: at depth 1, the latest one before a container is its key
            if depth == 1:
                last_key = t
        elif t in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                try:
                    return json.loads(last_key) if last_key is not None else None
                except ValueError:
                    return None
        else:
            depth -= 1
    return None
