"""What a request returns: vLLM's `RequestOutput` / `CompletionOutput` shape.

Plain data; built by the engine from a request's sequences, never referenced back by it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cuttle.engine.sampler import Logprob

if TYPE_CHECKING:
    from cuttle.engine.lora import LoRARequest


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless SamplingParams.logprobs was set (as in vLLM)
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token (sampled token always in it)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens not computed: prefix-cache hits + num_cached_document_tokens
    num_cached_document_tokens: int = 0  # squid prefix and document tokens served from the document cache
    # prompt tokens (in full blocks) this request computed and put in the prefix cache, for later requests to hit
    num_cache_written_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when processing this request failed inside the engine (e.g. its detokenizer raised): the
    # request ended there (finish_reason "abort", its KV freed) while the rest of the batch went on.
    error: str | None = None
    # vLLM's: the LoRA adapter the request ran under (engine/lora.py), None for the base model
    lora_request: LoRARequest | None = None
