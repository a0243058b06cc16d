"""cuttle.engine: config, requests, block manager, scheduler, model runner, sampler, tokenizer,
models, the offline `LLM` API, and (with the `serve` extra) the server and CLI.

Must import without ray, fastapi or flashinfer installed.
"""
from cuttle.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from cuttle.engine.config import EngineConfig, ModelConfig
from cuttle.engine.llm import LLM
from cuttle.engine.llm_engine import LLMEngine
from cuttle.engine.lora import LoRARequest
from cuttle.engine.outputs import CompletionOutput, RequestOutput
from cuttle.engine.sampler import Logprob
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest"]
