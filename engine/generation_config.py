"""Sampling defaults from a checkpoint's generation_config.json, vLLM's `--generation-config auto`:
the model's recommended temperature / top_p / top_k / min_p / repetition_penalty, and
`max_new_tokens` as the default `max_tokens`, apply to every request that does not set them.

Owns reading that file (or the directory `generation_config` names; "vllm" ignores it) and the two
ways a default meets a request: offline, `LLM.generate` without sampling params uses
`default_sampling_params` (vLLM's `get_default_sampling_params`); on the server, a body field that
is absent or null takes the default (`with_defaults`). Its `do_sample` is not read, as vLLM does
not: a greedy model says so with temperature 0. The file's eos_token_id joins the model's EOS set
(`model_eos_token_ids`, the ids that end a sample: the engine's, and the RL trainer's min_tokens).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cuttle.engine.tokenizer import Tokenizer

# generation_config.json key -> SamplingParams field (and request body field)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(config: EngineConfig) -> dict[str, Any]:
    """The sampling defaults `config.generation_config` selects, as SamplingParams fields; checked
    by building a SamplingParams from them (an out-of-range value names its field and the file)."""
    if config.generation_config == "vllm":
        return {}
    folder = config.model if config.generation_config == "auto" else config.generation_config
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if config.generation_config != "auto":
            raise ValueError(f"generation_config {config.generation_config!r} has no generation_config.json")
        return {}
    with open(path) as f:
        raw = json.load(f)
    out = {field: raw[key] for key, field in FIELDS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**defaults)


def with_defaults(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A request body with each default filled in where the body leaves the field out or null. A
    chat body's `max_completion_tokens` counts as setting `max_tokens`."""
    if not defaults:
        return body
    given = {k for k, v in body.items() if v is not None}
    if "max_completion_tokens" in given:
        given.add("max_tokens")
    return {**body, **{k: v for k, v in defaults.items() if k not in given}}


def model_eos_token_ids(model_path: str, mc: ModelConfig, tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end a sample: the model config's eos_token_id, generation_config.json's (one id
    or a list) and the tokenizer's eos token."""
    ids = set(mc.eos_token_ids)
    f = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(f):
        with open(f) as fh:
            eos = json.load(fh).get("eos_token_id")
        if eos is not None:
            ids |= {eos} if isinstance(eos, int) else set(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
