"""`EngineSampler`: one in-process engine shared by many caller threads, batched continuously.

Owns the bridge between threads that each want tokens (a Ray rollout worker runs one thread per
group) and one `LLMEngine` stepped on its own thread by the engine's `AsyncEngine`: a request
joins the engine's running batch at its next step, whoever submitted it, so a worker's groups
share engine batches instead of taking turns (a lock around `LLM.generate` made a worker's engine
run one group's turn at a time, the others waiting for its longest sample). Weight updates run on
the engine thread between steps; by default the requests in flight finish under the weights they
started with, so each turn (one request) is sampled with one version and says which.
Must never be called from its own event-loop thread, and never re-tokenizes anything.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from cuttle.engine.async_engine import AsyncEngine
from cuttle.engine.llm import LLM
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.rl.rollout import samples_of
from cuttle.rl.types import Sample


class EngineSampler:
    """A thread-safe `TokenSampler` over `llm`'s engine (which from now on only this steps)."""

    thread_safe = True  # callers may share it without a lock (RolloutWorker reads this)
    accepts_param_lists = True  # generate_tokens takes one SamplingParams per prompt

    def __init__(self, llm: LLM, max_pending: int = 4096):
        self.llm, self.engine = llm, llm.engine
        self.eos_token_ids = llm.engine.eos_token_ids
        self._async = AsyncEngine(llm.engine, max_pending=max_pending)
        self._async.start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cuttle-sampler-loop", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        # the LoRA adapter every request runs under: the last one `update_lora` sent (the policy
        # a LoRA trainer trains); None: the base model
        self.lora_name: str | None = None

    def get_tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer
        return self.llm.get_tokenizer()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: Sequence[list[int] | dict[str, Any]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """`LLM.generate`'s contract (one final output per prompt, in order; `params` one or one per
        prompt), callable from any thread at the same time as other callers."""
        prompts = list(prompts)
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(per)} sampling_params")
        return self._run(self._generate(prompts, per))

    async def _generate(self, prompts: list[Any], params: list[SamplingParams]) -> list[RequestOutput]:
        # admitted one by one, so a bad prompt is refused before the others are admitted
        streams = []
        try:
            for prompt, p in zip(prompts, params):
                p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                streams.append(await self._async.add(f"sampler-{next(self._ids)}", prompt, p, lora_request=self.lora_name))
        except BaseException:
            for s in streams:
                s.close()  # aborts: nothing stays in the engine
            raise

        async def final(stream: Any) -> RequestOutput:
            last = None
            async for out in stream:
                last = out
            return last

        outs = await asyncio.gather(*(final(s) for s in streams))
        failed = [o for o in outs if o is None or o.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outs)} requests failed in the engine; first: "
                               f"{failed[0].error if failed[0] is not None else 'no output'}")
        return list(outs)

    def generate_tokens(self, prompts: list[list[int] | dict[str, Any]], params: SamplingParams) -> list[list[Sample]]:
        return [samples_of(o) for o in self.generate(prompts, params)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: str = "finish") -> int:
        """New weights between two engine steps; returns the new version. "finish": requests in
        flight complete under the old weights first (a turn never spans two versions); "abort":
        they end now with finish_reason "abort"."""
        return self._run(self._async.update_weights(list(named_tensors), in_flight))

    def update_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> int:
        """A LoRA trainer's weight sync (PEFT names and adapter_config; the engine needs
        enable_lora): from now on every request runs under this adapter. Returns the new weight
        version; requests in flight finish under the adapter they started with ("finish") or end
        now ("abort")."""
        version = self._run(self._async.update_lora(lora_name, named_tensors, config, in_flight))
        self.lora_name = lora_name
        return version

    def reload_weights(self, path: str | None = None) -> int:
        """Every weight read again from a checkpoint directory (`LLM.reload_weights`), between two
        engine steps, the requests in flight finished first (and streamed to their callers);
        returns the new weight version."""
        return self._run(self._async.reload_weights(path, "finish"))

    def sleep(self, level: int = 1) -> None:
        """The engine's sleep mode (`LLM.sleep`), between two of its steps: the KV cache's memory
        (level 2: the weights' too) given back while a colocated trainer runs; refused while a
        request is in flight."""
        self._run(self._async.call(lambda: self.engine.sleep(level)))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._run(self._async.call(lambda: self.engine.wake_up(tags)))

    def is_sleeping(self) -> bool:
        return self._run(self._async.call(self.engine.is_sleeping))

    def stats(self) -> dict[str, Any]:
        return self._run(self._async.call(self.engine.stats))

    def close(self) -> None:
        self._async.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
