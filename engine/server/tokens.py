"""POST /tokenize, POST /detokenize and GET /version, in vLLM's shapes (outside /v1, as vLLM
serves them, so outside the API key).

Owns those routes' wire format only. /tokenize takes a `prompt` (encoded as /v1/completions
encodes a text prompt) or `messages` (rendered exactly as /v1/chat/completions renders them:
the same template, tools, `chat_template_kwargs`, `add_generation_prompt` /
`continue_final_message`, and the chat route's replay of the model's exact tool-call turns), and answers `{count, max_model_len, tokens, token_strs}`.
/detokenize answers `{prompt}` for `tokens`, special tokens kept.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request

from cuttle.engine.openai_protocol import (
    DETOKENIZE_FIELDS, TOKENIZE_CHAT_FIELDS, TOKENIZE_PROMPT_FIELDS, OpenAIError, check_tools, get_bool, is_token_ids,
)
from cuttle.engine.server.body import read_body
from cuttle.engine.server.chat import flatten_messages
from cuttle.engine.server.chat_prompt import ChatOptions, check_continuable, read_chat_template
from cuttle.engine.server.streaming import Serving
from cuttle.engine.tokenizer import Tokenizer


def add_token_routes(app: FastAPI, serving: Serving, tok: Tokenizer, opts: ChatOptions, max_model_len: int) -> None:
    try:
        version = importlib.metadata.version("cuttle")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = "unknown"

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), TOKENIZE_PROMPT_FIELDS | TOKENIZE_CHAT_FIELDS)
        chat = body.get("messages") is not None
        if chat == (body.get("prompt") is not None):
            raise OpenAIError("give either prompt (a text) or messages (a chat), not both", param="messages" if chat else "prompt")
        extra = set(k for k, v in body.items() if v is not None) - (TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_PROMPT_FIELDS)
        if extra:  # a chat field on a prompt request (or the reverse) would be ignored
            name = sorted(extra)[0]
            raise OpenAIError(f"{name} is not a field of /tokenize with {'messages' if chat else 'prompt'}", param=name)
        want_strs = get_bool(body, "return_token_strs")
        if chat:
            messages, docs = flatten_messages(body["messages"])
            if docs:
                raise OpenAIError("document parts are encoded on their own (squid) and have no place in one token list; "
                                  "/tokenize takes text parts only", param="messages")
            tmpl = read_chat_template(body, tok, opts)
            check_continuable(messages, tmpl)
            messages = request.app.state.tool_call_replay.restore(messages, keep_last=tmpl.continue_final_message)
            text = tmpl.render(tok, messages, check_tools(body.get("tools")))
            ids = tok.encode(text, add_special_tokens=get_bool(body, "add_special_tokens", False))
        else:
            if not isinstance(body["prompt"], str):
                raise OpenAIError("prompt must be a string", param="prompt")
            ids = tok.encode(body["prompt"], add_special_tokens=get_bool(body, "add_special_tokens", True))
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": [tok.tok.id_to_token(i) for i in ids] if want_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request, serving.max_body_bytes, serving.served_models(), DETOKENIZE_FIELDS)
        ids = body.get("tokens")
        if not is_token_ids(ids):
            raise OpenAIError("tokens must be a list of token ids", param="tokens")
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"token id {bad} is outside the vocabulary [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}
