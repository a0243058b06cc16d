"""Routes for RL trainers (`cuttle.rl.RolloutClient` speaks them); under /v1, so behind auth.

POST /v1/rl/generate        {"prompts": [[ids] | {"prefix"?: [ids], "documents": [[ids], ...],
                            "prompt": [ids]}, ...], "sampling_params": {...}} -> one entry per
                            prompt: {"weight_version", "samples": [{"token_ids", "logprobs",
                            "finish_reason", "text"}]}. Token ids in and out (a squid prompt's
                            fields too: never text); `n` samples per prompt fork from one prefill;
                            logprobs are the engine's (processed). A trainer that disconnects
                            aborts all of its rollouts.
                            "lora_name" (optional): the LoRA adapter the samples are drawn under
                            (a server with --enable-lora; see update_lora).
POST /v1/rl/update_weights  body: a safetensors file (HF or engine parameter names; not
                            subject to the JSON body limit); ?in_flight=abort|finish ->
                            {"weight_version"}
POST /v1/rl/update_lora     ?lora_name=NAME&in_flight=finish|abort; body: a safetensors file of the
                            adapter under PEFT's names, its adapter_config as JSON in the file's
                            metadata ("adapter_config") -> {"weight_version"}: LoRA training's
                            weight sync (engine/lora.py; needs --enable-lora)
GET  /v1/rl/weight_version  -> {"weight_version"}
GET  /v1/rl/info            -> {"weight_version", "squid_positions", "max_documents",
                            "max_model_len"}: what a trainer needs to lay out squid prompts the
                            way this engine does (rl.batch rebuilds the same attention).

Owns these routes' wire format only; admission and disconnects are `streaming.Serving`'s.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from cuttle.engine.async_engine import AsyncEngine, RequestOptions
from cuttle.engine.openai_protocol import RL_FIELDS, RL_SAMPLING_FIELDS, OpenAIError, check_fields, sampling_params
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind
from cuttle.engine.server.body import MAX_BODY_BYTES, json_body
from cuttle.engine.server.streaming import Fields, Serving
from cuttle.engine.sleep_mode import EngineAsleepError


def add_rl_routes(app: FastAPI, engine: AsyncEngine, max_body_bytes: int = MAX_BODY_BYTES,
                  on_disconnect: Callable[[], None] = lambda: None) -> None:
    from safetensors.torch import load as load_safetensors

    llm = engine.engine
    # no latency metrics: rollouts are not the serving traffic the histograms describe
    serving = Serving(engine, "", None, max_body_bytes, on_disconnect)

    @app.post("/v1/rl/generate")
    async def rl_generate(request: Request) -> dict[str, Any]:
        t0 = time.monotonic()
        body = await json_body(request, max_body_bytes)
        check_fields(body, RL_FIELDS)
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise OpenAIError("prompts must be a non-empty list of token-id lists or squid prompt objects", param="prompts")
        for i, p in enumerate(prompts):
            _check_rl_prompt(p, f"prompts[{i}]")
        raw = body.get("sampling_params") or {}
        if not isinstance(raw, dict):
            raise OpenAIError("sampling_params must be an object", param="sampling_params")
        try:
            check_fields(raw, RL_SAMPLING_FIELDS, raw.get("n", 1))
            params = sampling_params(raw, default_max_tokens=None, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        except OpenAIError as e:
            e.param = f"sampling_params.{e.param}" if e.param else "sampling_params"
            raise
        lora = body.get("lora_name")
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise OpenAIError("lora_name must be a non-empty string", param="lora_name")
        base = uuid.uuid4().hex

        def respond(finals: list[RequestOutput]) -> dict[str, Any]:
            results = []
            for out in finals:
                samples = [
                    {"token_ids": c.token_ids, "logprobs": [d[t].logprob for d, t in zip(c.logprobs or [], c.token_ids)],
                     "finish_reason": c.finish_reason, "text": c.text}
                    for c in out.outputs
                ]
                results.append({"weight_version": int(out.metrics["weight_version"]), "samples": samples})
            return {"results": results}

        items = [(f"rl-{base}-{i}", p) for i, p in enumerate(prompts)]
        fields = Fields("prompts", "sampling_params.max_tokens", "sampling_params.n", sampling="sampling_params.")
        return await serving.complete(request, items, params, RequestOptions(lora_request=lora), fields, respond, t0, observe=False)

    @app.post("/v1/rl/update_weights")
    async def rl_update_weights(request: Request, in_flight: str = "abort") -> dict[str, Any]:
        if in_flight not in ("abort", "finish"):
            raise OpenAIError("in_flight must be 'abort' or 'finish'", param="in_flight")
        try:
            tensors = load_safetensors(await request.body())
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            raise OpenAIError(f"body is not a safetensors file: {e}") from None
        try:
            version = await engine.update_weights(tensors.items(), in_flight)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        except EngineAsleepError as e:
            raise OpenAIError(str(e), 503, "server_asleep") from None
        return {"weight_version": version}

    @app.post("/v1/rl/update_lora")
    async def rl_update_lora(request: Request, lora_name: str = "", in_flight: str = "finish") -> dict[str, Any]:
        if not lora_name:
            raise OpenAIError("lora_name is required", param="lora_name")
        if in_flight not in ("abort", "finish"):
            raise OpenAIError("in_flight must be 'abort' or 'finish'", param="in_flight")
        if llm.loras is None:
            raise OpenAIError("this server was started without --enable-lora", param="lora_name")
        blob = await request.body()
        try:
            tensors = load_safetensors(blob)
            config = json.loads(safe_metadata(blob).get("adapter_config", "null"))
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            raise OpenAIError(f"body is not a safetensors file with an adapter_config in its metadata: {e}") from None
        if not isinstance(config, dict):
            raise OpenAIError("the safetensors metadata must hold adapter_config, a JSON object")
        try:
            version = await engine.update_lora(lora_name, tensors.items(), config, in_flight)
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        return {"weight_version": version}

    @app.get("/v1/rl/weight_version")
    async def rl_weight_version() -> dict[str, Any]:
        return {"weight_version": llm.weight_version}

    @app.get("/v1/rl/info")
    async def rl_info() -> dict[str, Any]:
        return {"weight_version": llm.weight_version, "squid_positions": llm.squid_positions,
                "max_documents": llm.config.max_documents, "max_model_len": llm.max_model_len,
                # what ends a sampled turn: an agent loop fronting this server needs them
                "eos_token_ids": sorted(llm.eos_token_ids),
                # whether a sample's logprobs are independent of the traffic it was drawn beside
                "batch_invariant": llm.config.batch_invariant,
                # what a trainer must mirror to score the samples as drawn (TrainerConfig.for_sampler)
                **llm.forward_options()}


_SQUID_KEYS = frozenset({"prefix", "documents", "prompt"})


def _ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def safe_metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of a safetensors blob (its JSON header's `__metadata__`)."""
    n = int.from_bytes(blob[:8], "little")
    if not 0 < n <= len(blob) - 8:
        raise ValueError("truncated header")
    meta = json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not an object")
    return meta


def _check_rl_prompt(p: Any, where: str) -> None:
    """The wire shape of one RL prompt: non-empty token ids, or a squid object whose every field is
    token ids (text would be tokenized here, not by the trainer: token-in/token-out). Values (ids
    in the vocabulary, lengths, the document limit) are the engine's to check; its errors name
    the field too."""
    if isinstance(p, list):
        if not p or not _ids(p):
            raise OpenAIError(f"{where} must be a non-empty list of token ids", param=where)
        return
    if not isinstance(p, dict):
        raise OpenAIError(f"{where} must be a token-id list or an object with prefix/documents/prompt", param=where)
    unknown = sorted(set(p) - _SQUID_KEYS)
    if unknown:
        raise OpenAIError(f"{where}.{unknown[0]} is not a field of a squid prompt (prefix, documents, prompt)",
                          param=f"{where}.{unknown[0]}")
    if "prefix" in p and not _ids(p["prefix"]):
        raise OpenAIError(f"{where}.prefix must be a list of token ids", param=f"{where}.prefix")
    docs = p.get("documents")
    if not isinstance(docs, list) or not docs:
        raise OpenAIError(f"{where}.documents must be a non-empty list of token-id lists", param=f"{where}.documents")
    for j, d in enumerate(docs):
        if not d or not _ids(d):
            raise OpenAIError(f"{where}.documents[{j}] must be a non-empty list of token ids",
                              param=f"{where}.documents[{j}]")
    if not p.get("prompt") or not _ids(p["prompt"]):
        raise OpenAIError(f"{where}.prompt must be a non-empty list of token ids", param=f"{where}.prompt")
