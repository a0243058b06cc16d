"""The offline API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams)`.

A thin driver over `LLMEngine`: submits every prompt, steps until all finish (with a tqdm bar),
and returns outputs in input order. Owns no scheduling logic of its own.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from cuttle.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from cuttle.engine.config import ENGINE_DEFAULTS, EngineConfig
from cuttle.engine.generation_config import default_sampling_params
from cuttle.engine.llm_engine import LLMEngine
from cuttle.engine.lora import LoRARegistry, LoRARequest
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import validate_messages

# text, token ids, vLLM's {"prompt": text} / {"prompt_token_ids": ids}, or a squid prompt
# {"prefix"?, "documents", "prompt"} (each text or token ids; engine/squid.py)
Prompt = str | list[int] | dict


def _vllm_prompt(p: Prompt, i: int) -> Prompt:
    """vLLM's TextPrompt / TokensPrompt dicts as the engine's text / token ids; a dict with
    documents (or a prefix) is a squid prompt and passes through to the engine's own checks."""
    if not isinstance(p, dict) or "documents" in p or "prefix" in p:
        return p
    extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
    if extra:
        raise ValueError(f"prompts[{i}] has fields cuttle does not support: {extra} (a prompt dict is {{'prompt': text}} "
                         "or {'prompt_token_ids': [...]}, or a squid prompt with 'documents')")
    if len(p) != 1:
        raise ValueError(f"prompts[{i}] must have exactly one of 'prompt' (text) or 'prompt_token_ids'")
    if "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompts[{i}].prompt_token_ids must be a list of token ids")
        return list(ids)
    if not isinstance(p["prompt"], str):
        raise ValueError(f"prompts[{i}].prompt must be text (token ids go in 'prompt_token_ids')")
    return p["prompt"]


def _per_prompt_lora(lora_request: LoRARequest | Seq[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Seq):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {n} prompts but {len(loras)} lora_requests")
    return loras


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = ENGINE_DEFAULTS["dtype"],
        block_size: int = ENGINE_DEFAULTS["block_size"],
        num_kv_blocks: int | None = ENGINE_DEFAULTS["num_kv_blocks"],
        max_num_batched_tokens: int = ENGINE_DEFAULTS["max_num_batched_tokens"],
        max_num_seqs: int = ENGINE_DEFAULTS["max_num_seqs"],
        max_model_len: int | None = ENGINE_DEFAULTS["max_model_len"],
        enable_prefix_caching: bool = ENGINE_DEFAULTS["enable_prefix_caching"],
        attention_backend: str = ENGINE_DEFAULTS["attention_backend"],
        seed: int = ENGINE_DEFAULTS["seed"],
        **kwargs: Any,
    ):
        """Every argument is an `EngineConfig` field (the rest by keyword), defaulting as there."""
        if model is None:
            from cuttle.engine.default_model import default_model_path

            model = default_model_path()
        config = EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            seed=seed,
            **kwargs,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling params: the model's generation_config.json
        defaults (engine/generation_config.py; none with generation_config="vllm")."""
        return default_sampling_params(self.engine.generation_defaults)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: str = "abort") -> int:
        """Load new weights in place (HF names or the engine's own parameter names); returns the
        new `weight_version`. Between `generate` calls nothing is in flight, so `in_flight` only
        matters to callers stepping `self.engine` themselves (see `LLMEngine.update_weights`)."""
        self.engine.update_weights(named_tensors, in_flight)
        return self.engine.weight_version

    def update_draft_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace the draft model's weights (speculative decoding with a draft model); returns the
        draft's new weight version. See `LLMEngine.update_draft_weights`."""
        return self.engine.update_draft_weights(named_tensors)

    def reload_weights(self, path: str | None = None) -> int:
        """Read every weight again from the model's checkpoint directory, or from `path` (another
        checkpoint of the same model); returns the new `weight_version`. vLLM spells it
        `collective_rpc("reload_weights")`; after `sleep(level=2)` and `wake_up(["weights"])` it
        brings the discarded weights back (see `LLMEngine.reload_weights`)."""
        self.engine.reload_weights(path)
        return self.engine.weight_version

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's `LLM.collective_rpc` for the worker methods cuttle has: "reload_weights" (vLLM's
        sleep-mode RL recipe: `sleep(level=2)`, `wake_up(["weights"])`,
        `collective_rpc("reload_weights")`, `wake_up(["kv_cache"])`). cuttle runs one in-process
        worker, so the list holds one result. Any other method (or a callable) is refused: cuttle
        has no vLLM worker to run it on."""
        def reload_weights(path: str | None = None) -> None:
            self.engine.reload_weights(path)

        supported = {"reload_weights": reload_weights}
        if not isinstance(method, str) or method not in supported:
            raise ValueError(f"collective_rpc: method {method!r} is not supported (cuttle runs one in-process worker; "
                             f"supported: {', '.join(supported)})")
        if timeout is not None:  # nothing could stop the call part way
            raise ValueError("collective_rpc: timeout is not supported (the call runs in this process, to its end)")
        return [supported[method](*args, **(kwargs or {}))]

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): per prompt, the best `params.beam_width`
        beams, each with its tokens (prompt and generated), cumulative logprob and text (the
        tokens decoded, prompt included, as vLLM's). Every beam is an engine session, so a step
        computes one token a beam (a kept candidate forks its parent's KV); prompts are searched
        together, as many at once as the session limit allows (2 x width sessions each).
        `lora_request` (vLLM's, with enable_lora): the adapter every beam runs under."""
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.engine
        ids = []
        for i, p in enumerate(prompts):
            p = _vllm_prompt(p, i)
            if isinstance(p, dict):
                raise ValueError(f"prompts[{i}]: beam search takes a text or token-id prompt, not documents")
            ids.append(engine.encode(p) if isinstance(p, str) else list(p))
            if len(ids[-1]) + params.max_tokens > engine.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(ids[-1])} prompt tokens + max_tokens ({params.max_tokens}) exceed "
                                 f"max_model_len ({engine.max_model_len})")
        searches = [BeamSearch(p, params, engine.eos_token_ids) for p in ids]
        at_once = engine.config.max_sessions // (2 * params.beam_width)
        if at_once < 1:
            raise ValueError(f"beam search keeps up to 2 x beam_width ({2 * params.beam_width}) engine sessions a prompt; "
                             f"max_sessions is {engine.config.max_sessions}")
        bar = tqdm(total=len(searches) * params.max_tokens, desc="Beam search", disable=not use_tqdm)
        for k in range(0, len(searches), at_once):
            self._beam_search_sessions(searches[k:k + at_once], params, bar, lora_request)
        bar.close()
        tok = self.get_tokenizer()
        outputs = []
        for s in searches:
            best = s.result()
            for b in best:
                b.text = tok.decode(b.tokens, params.skip_special_tokens) if tok is not None else None
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _beam_search_sessions(self, searches: list[BeamSearch], params: BeamSearchParams, bar,
                              lora_request: LoRARequest | None = None) -> None:
        """Run `searches` to the end, each live beam an engine session whose stream is the beam."""
        engine = self.engine
        step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
        live: list[list[str]] = []
        try:
            engine.open_beams([s.beams[0].tokens for s in searches], live, lora_request)
            while True:
                work = [(s, sids) for s, sids in zip(searches, live) if not s.done]
                if not work:
                    return
                flat = [sid for _, sids in work for sid in sids]
                outs = self.generate_session(flat, step)  # each turn: its candidates; it appends its argmax
                at = 0
                for s, sids in work:
                    s.advance([out.outputs[0].logprobs[0] for out in outs[at:at + len(sids)]])
                    at += len(sids)
                    if s.done:  # a finished search needs no more KV
                        engine.close_beams([sids])
                    else:  # (if a fork fails, the parents stay in `sids`, closed below)
                        engine.fork_beams(sids, s.origins)
                    bar.update(1)
        finally:
            engine.close_beams(live)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: give back the KV cache's memory (and on an accelerator the weights',
        kept in host memory) while a colocated trainer runs; `wake_up` restores it. Level 2
        discards the weights too: `update_weights` must then send every one before the engine
        serves again (engine/sleep_mode.py)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` gave back: all, or `tags` among "weights" and "kv_cache"."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and document, in every tier (the next request starts cold)."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority` (vLLM's): one per prompt, under scheduling_policy "priority" (lower first).
        `lora_request` (vLLM's, with enable_lora): the adapter of every prompt, or one per prompt
        (None: the base model); any mix runs batched."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text, token ids, or a dict with documents)
        prompts = [_vllm_prompt(p, i) for i, p in enumerate(prompts)]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        loras = _per_prompt_lora(lora_request, len(prompts))
        return self._run(prompts, params, use_tqdm, priorities, loras)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs the tokenizer's chat template, and this LLM runs with skip_tokenizer_init")
        texts = []
        for conv in conversations:
            validate_messages(conv)  # type: ignore[arg-type]
            texts.append(tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs))
        # templates spell out BOS and the role markers: no special tokens added again
        prompts: list[Prompt] = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
        for out, text in zip(outs, texts):
            out.prompt = text  # the rendered conversation, as vLLM's LLM.chat reports it
        return outs

    # ---- agent sessions (engine/session.py) --------------------------------------------------
    def open_session(self, prompt: str | list[int], lora_request: LoRARequest | None = None) -> str:
        """A session over `prompt`: its KV stays pinned between turns until `close_session`.
        `lora_request` (with enable_lora): the adapter its turns and its forks' run under."""
        return self.engine.open_session(prompt, lora_request)

    def fork_session(self, session_id: str, n: int) -> list[str]:
        """`n` sessions with the same stream (sharing its pinned KV); forks that have not diverged
        run their next turn as one request, so a group's prompt is prefilled once."""
        return self.engine.fork_session(session_id, n)

    def append_to_session(self, session_id: str, token_ids: list[int]) -> None:
        self.engine.append_to_session(session_id, token_ids)

    def session_token_ids(self, session_id: str) -> list[int]:
        return self.engine.session_token_ids(session_id)

    def close_session(self, session_id: str) -> None:
        self.engine.close_session(session_id)

    def generate_session(self, session_ids: str | Seq[str], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                         use_tqdm: bool = False) -> list[RequestOutput]:
        """One turn of each session (its whole stream is the prompt; only what is not in its
        pinned KV is computed); the sampled ids join the session. One `RequestOutput` per session,
        in order, each with one output. Sessions forked together and not diverged since share one
        request (n = their number), under the parameters of the first of them. `sampling_params`:
        one for all, or one per session (per-episode seeds)."""
        sids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            per = {sid: sampling_params or SamplingParams() for sid in sids}
        else:
            if len(sampling_params) != len(sids):
                raise ValueError(f"got {len(sids)} sessions but {len(sampling_params)} sampling_params")
            per = dict(zip(sids, sampling_params))
        engine = self.engine
        groups: dict[int, list[str]] = {}  # siblings by origin, in first-seen order
        for sid in sids:
            groups.setdefault(engine.sessions.get(sid).origin, []).append(sid)
        turns = [(f"offline-{next(self._ids)}", members) for members in groups.values()]
        outs = self._drive([(rid, lambda rid=rid, m=members: engine.add_session_turn(rid, m, per[m[0]])) for rid, members in turns],
                           use_tqdm)
        by_session: dict[str, RequestOutput] = {}
        for (_, members), out in zip(turns, outs):
            for i, sid in enumerate(members):
                by_session[sid] = dataclasses.replace(out, outputs=[out.outputs[i]])
        return [by_session[sid] for sid in sids]

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
             priorities: list[int] | None = None, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        prios = priorities or [0] * len(prompts)
        loras = loras or [None] * len(prompts)
        return self._drive([(rid, lambda rid=rid, pr=pr, p=p, q=q, a=a: engine.add_request(rid, pr, p, priority=q, lora_request=a))
                            for rid, pr, p, q, a in zip(ids, prompts, params, prios, loras)], use_tqdm)

    # ---- LoRA adapters (engine/lora.py) --------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Register a PEFT adapter directory under `lora_name` (its config checked now); requests
        may then name it alone (`LoRARequest(lora_name)`)."""
        self._loras().register(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Forget an adapter (requests running under it finish with it)."""
        self._loras().unregister(lora_name)

    def list_loras(self) -> list[str]:
        return self._loras().names()

    def update_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> int:
        """LoRA training's weight sync: an adapter from tensors in memory (PEFT names, as
        `peft.get_peft_model_state_dict` gives them) and its adapter_config as a dict; returns the
        new `weight_version` (see `LLMEngine.update_lora`). New requests naming `lora_name` run
        under it; its KV is keyed by these weights, so nothing computed under the old adapter is
        reused."""
        self.engine.update_lora(lora_name, named_tensors, config, in_flight)
        return self.engine.weight_version

    def _loras(self) -> LoRARegistry:
        if self.engine.loras is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self.engine.loras

    def _drive(self, adds: list[tuple[str, Any]], use_tqdm: bool) -> list[RequestOutput]:
        """Add every request (all or nothing), step until all finish; outputs in the order given."""
        engine = self.engine
        ids = [rid for rid, _ in adds]
        added: list[str] = []
        try:
            for rid, add in adds:
                add()
                added.append(rid)
        except BaseException:
            # all-or-nothing: a bad prompt (or any error, or Ctrl-C, while adding) leaves the engine
            # as it was; a TypeError here used to leave the earlier prompts queued to run unseen
            for rid in added:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        stuck = 0
        try:
            while len(results) < len(ids):
                steps = engine.counters["steps"]
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
                if not engine.has_unfinished_requests() and len(results) < len(ids):
                    raise RuntimeError("engine went idle with requests unfinished")
                stuck = stuck + 1 if engine.stalled(steps) else 0
                if stuck > 1:  # twice no step with nothing running: no block will come free
                    for rid in ids:
                        engine.abort_request(rid)
                    raise RuntimeError(engine.stall_message())
        except BaseException:
            # a failed step or an interrupt (Ctrl-C) leaves none of this call's requests behind to
            # run, or fail again, inside the next call: their blocks are freed here
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        failed = [out for out in results.values() if out.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed in the engine; first: {failed[0].error}")
        return [results[rid] for rid in ids]

