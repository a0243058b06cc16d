"""The engine loop: admit requests, step (schedule -> run -> sample -> postprocess), report.

Owns the request table and the wiring between scheduler, block manager, model runner, sampler
and postprocessor (which owns every sampled token from append to free). Bad input is refused in `add_request` before anything is enqueued, so a refused
request never disturbs the others. Every finished, aborted or preempted sequence returns its
blocks to the pool at once.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import random
import time
from collections.abc import Iterable
from typing import Any

import torch

from cuttle.attention import native
from cuttle.attention.backend import WINDOWED_BACKENDS, resolve_backend_name
from cuttle.attention.native.gemm import drop_packed
from cuttle.attention.topk import parse_sparse_attention
from cuttle.engine.block_manager import BlockManager
from cuttle.engine.config import DTYPES, EngineConfig, ModelConfig
from cuttle.engine.kv.cost_model import CostModel
from cuttle.engine.kv.disk_tier import DiskTier, checkpoint_fingerprint, namespace_key
from cuttle.engine.kv.tiers import KVTiers
from cuttle.engine.kv.transfer import TransferEngine
from cuttle.engine.generation_config import generation_defaults, model_eos_token_ids
from cuttle.engine.lora import LoadedAdapter, LoRARegistry, LoRARequest
from cuttle.engine.memory_budget import checkpoint_weight_bytes, free_memory_bytes, kv_pool_bytes
from cuttle.engine.model_runner import ModelRunner
from cuttle.engine.models import load_weights
from cuttle.engine.hf_cache import resolve_model
from cuttle.engine.models.fp8_checkpoint import dequantized_tensors
from cuttle.engine.models.loader import WeightCoverage, iter_tensors
from cuttle.engine.models.moe_quant import unpack_experts
from cuttle.engine.models.nsa_config import nsa_config
from cuttle.engine.outputs import RequestOutput
from cuttle.engine.postprocess import Postprocessor
from cuttle.engine.sampler import Logprob, SampleRequest, sample
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.scheduler import Scheduler
from cuttle.engine.sequence import Request, Sequence
from cuttle.engine.session import Sessions
from cuttle.engine.sleep_mode import (SLEEP_LEVELS, WAKE_TAGS, EngineAsleepError, Slept, discard_weights, free_storage, offload_weights,
                                      regrow_weights, restore_storage, restore_weights)
from cuttle.engine.draft_model import DraftModelProposer
from cuttle.engine.mtp_proposer import MTPProposer
from cuttle.engine.spec_decode import Proposer, SpecConfig
from cuttle.engine.squid import Squid, parse_prompt
from cuttle.engine.structured_output import StructuredOutput
from cuttle.engine.tokenizer import Tokenizer

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_large_allocations_in_heap()
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(mc, self.device)
        # skip_tokenizer_init: token ids in and out, no tokenizer file needed (text prompts are refused)
        self.tokenizer: Tokenizer | None = None if config.skip_tokenizer_init else Tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = model_eos_token_ids(config.model, mc, self.tokenizer)
        self.generation_defaults = generation_defaults(config)  # engine/generation_config.py

        max_len = config.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings and mc.rope_scaling and mc.rope_scaling["rope_type"] == "longrope":
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's original_max_position_embeddings "
                             f"({mc.max_position_embeddings}): past it longrope switches a whole sequence to its long "
                             "factors (transformers' rule), which keys cached under the short ones cannot follow, so "
                             "cuttle serves this model within that length")
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's max_position_embeddings ({mc.max_position_embeddings})")
        if mc.sliding_window_layers and max_len > mc.sliding_window and not self._windows_served(config):
            # this backend attends every position, which equals the model's window only while a sequence fits in it
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len ({max_len}) exceeds the model's sliding_window ({mc.sliding_window}): the "
                                 f"{config.attention_backend} attention backend{' with sparse_attention' if config.sparse_attention else ''} "
                                 f"attends every position, the same as the window only within it; give max_model_len <= "
                                 f"{mc.sliding_window}, or use attention_backend='torch'")
            max_len = mc.sliding_window
        bs = config.block_size
        spec = SpecConfig.parse(config.speculative_config)
        mtp = spec is not None and spec.method == "mtp"  # the MTP layer's K/V: one more layer in the pool
        per_block = ModelRunner.kv_bytes_per_block(mc, bs, self.dtype, config.sparse_attention, extra_layers=int(mtp))
        # every layer reads only the last W positions (the MTP layer, which drafts, would read them
        # all): the block manager gives back what lies before a sequence's window as it moves, and
        # without KV tiers a sequence grows chunk by chunk, so it holds about W / block_size blocks
        # however long it is (engine/block_manager.py)
        window = (mc.sliding_window if mc.sliding_window_layers and len(mc.sliding_window_layers) == mc.num_layers
                  and self._windows_served(config) and not mtp and nsa_config(mc.hf_config) is None else None)
        per_seq = -(-max_len // bs)
        # what one such sequence holds at most, besides a chunk's growth: its window's blocks (a
        # window may straddle one more) and the block the hash chain keeps
        window_blocks = -(-window // bs) + 2 if window is not None else 0
        if window is not None and not config.has_host_tier:
            per_seq = min(per_seq, window_blocks + -(-config.max_num_batched_tokens // bs))
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            wanted = config.max_num_seqs * per_seq
            pool_bytes = (int(config.kv_cache_memory_gb * 2**30) if config.gpu_memory_utilization is None
                          else kv_pool_bytes(config.gpu_memory_utilization, self.device, config.model, self.dtype))
            num_blocks = max(1, min(wanted, pool_bytes // per_block))
        _check_fits("num_kv_blocks" if config.num_kv_blocks is not None else "kv_cache_memory_gb", num_blocks * per_block, self.device,
                    checkpoint_weight_bytes(config.model, self.dtype))
        # a sequence that grows lazily runs past the pool's size once the pool holds its window
        unbounded = window is not None and not config.has_host_tier and num_blocks >= window_blocks
        if config.max_model_len is not None and num_blocks * bs < max_len and not unbounded:
            # an explicit length the pool cannot hold was cut down silently (vLLM refuses it)
            raise ValueError(f"max_model_len ({max_len}) needs {-(-max_len // bs)} KV blocks of {bs} tokens, and the pool has "
                             f"{num_blocks} (num_kv_blocks / kv_cache_memory_gb): give it more, or a smaller max_model_len")
        self.max_model_len = max_len if unbounded else min(max_len, num_blocks * bs)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.block_manager.window = window
        self.squid = Squid(self.block_manager, str(self.dtype))
        self.squid_positions = config.squid_positions or mc.hf_config.get("squid_positions") or "concat"
        if spec is not None and (nsa_config(mc.hf_config) is not None or config.sparse_attention is not None):
            # their per-block entries (NSA's compressed K/V, top-k's summaries) are computed as a
            # block fills, from every token in it: a draft not kept would stay in them
            raise ValueError("speculative_config is not supported with sparse attention (an NSA model or sparse_attention): "
                             "rejected drafts would enter the blocks' compressed entries")
        self.runner = ModelRunner(config, mc, self.device, self.dtype, num_blocks)
        proposer = None
        if mtp:
            proposer = MTPProposer(spec, self.max_model_len, self.runner, self._sample_request, config.logprobs_mode)
        elif spec is not None and spec.method == "draft_model":
            if config.enable_sleep_mode:  # the draft engine's pool and weights would stay awake
                raise ValueError("speculative_config with a draft model cannot be combined with enable_sleep_mode")
            proposer = DraftModelProposer(spec, min(max_len, num_blocks * bs), mc, config, self.dtype, self.device, num_blocks)
        elif spec is not None:
            proposer = Proposer(spec, self.max_model_len)
        self.proposer = proposer
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, self.squid, proposer,
                                   config.scheduling_policy)
        # LoRA adapters (engine/lora.py): names, and the adapters loaded, that requests run under
        self.loras: LoRARegistry | None = None
        if config.enable_lora:
            self.loras = LoRARegistry(mc, config.max_loras, config.max_lora_rank, self.device)
            self.runner.enable_lora()
        self.requests: dict[str, Request] = {}
        self._slept = Slept()  # what sleep() gave back (nothing: awake)
        self._reload: WeightCoverage | None = None  # after sleep(level=2) and waking: what update_weights has written again
        self._rng = random.Random(config.seed)
        self.weight_version = 0
        self._weights_tag = b""  # the disk tier's name for the weights (the checkpoint's until an update)
        self.tiers: KVTiers | None = self._build_tiers(self.runner.kv.block_bytes) if config.has_host_tier else None
        self.counters = {"prompt_tokens": 0, "prefill_tokens_computed": 0, "generated_tokens": 0, "steps": 0,
                         "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.post = Postprocessor(self.scheduler, self.tokenizer, self.eos_token_ids, self.max_model_len, self.counters)
        # structured output, logit_bias, allowed_token_ids, bad_words (engine/structured_output.py)
        self.controls = StructuredOutput(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        session_blocks = config.max_session_kv_blocks if config.max_session_kv_blocks is not None else num_blocks // 2
        if session_blocks >= num_blocks:
            raise ValueError(f"max_session_kv_blocks ({session_blocks}) must leave blocks for other requests: the pool has {num_blocks}")
        self.sessions = Sessions(self.block_manager, config.max_sessions, session_blocks)
        self.scheduler.sessions = self.sessions

    def _build_tiers(self, per_block: int) -> KVTiers:
        """The host tier (and the disk tier under it) below the device pool (engine/kv/tiers.py)."""
        config = self.config
        if config.num_host_kv_blocks is not None:
            host_blocks = config.num_host_kv_blocks
        else:
            host_blocks = int(config.kv_offloading_size * 2**30) // per_block
            if host_blocks < 1:
                raise ValueError(f"kv_offloading_size ({config.kv_offloading_size} GiB) holds not even one KV block ({per_block} bytes)")
        _check_fits("num_host_kv_blocks" if config.num_host_kv_blocks is not None else "kv_offloading_size", host_blocks * per_block,
                    torch.device("cpu"))
        transfer = TransferEngine(self.device)
        disk = None
        if config.kv_cache_dir is not None:
            disk = DiskTier(config.kv_cache_dir, int(config.kv_cache_dir_gb * 2**30), per_block, config.block_size)
            self._weights_tag = checkpoint_fingerprint(config.model)
            disk.set_namespace(self._disk_namespace())
        tiers = KVTiers(self.block_manager.pool, self.runner.kv, config.block_size, host_blocks, transfer, per_block, disk,
                        pin_memory=self.device.type == "cuda")
        tiers.cost = CostModel.measure(transfer, self.runner.kv, tiers.host_kv, self.model_config, per_block)
        # read in place needs kernels that address the host tier: the CPU ones, dense and sparse
        # (a GPU would need the host tensors mapped into its address space, which cuttle does not
        # do yet; the Triton NSA / top-k kernels read the device pool only): otherwise copy-in
        why = self.runner.reads_host_in_place
        if why is not None and config.kv_read_in_place == "always":
            raise ValueError(f"kv_read_in_place='always': {why}; use 'auto' or 'never' (host blocks are then copied in)")
        tiers.read_in_place = config.kv_read_in_place if why is None else "never"
        self.runner.attach_host_tier(tiers.host_kv)
        self.block_manager.attach_tiers(tiers)
        return tiers

    def forward_options(self) -> dict:
        """What of this engine's forward a trainer must mirror to score its samples as drawn (served
        in /v1/rl/info; `cuttle.rl.trainer.TrainerConfig.for_sampler`): sparse_attention (its spec,
        or None), moe_quant, quantization, quantize_lm_head, and the model dtype's name."""
        sparse = parse_sparse_attention(self.config.sparse_attention)
        return {"sparse_attention": None if sparse is None else sparse.spec(), "moe_quant": self.config.moe_quant,
                "quantization": self.config.quantization, "quantize_lm_head": self.config.quantize_lm_head,
                "dtype": next(n for n, d in DTYPES.items() if d == self.dtype)}

    def _disk_namespace(self) -> int:
        """What a disk entry's bytes depend on beyond its tokens and the chain's extra key: the
        weights, dtype and block geometry, and every engine option that changes the forward before
        the lm_head (weight quantization, top-k sparse attention, the batch-invariant kernels;
        `quantize_lm_head` changes only logits, so entries stay shared across it)."""
        mc, config = self.model_config, self.config
        geometry = f"{len(self.runner.kv.layers)}x{config.block_size}x{mc.num_kv_heads}x{mc.head_dim}{self.runner.kv.layout_tag()}"
        if mc.mla is not None:  # MLA's cached K holds the rotary dims first since 2026-11-27
            geometry += ";mla=rope-first"
        forward = f"quantization={config.quantization};moe_quant={config.moe_quant};" \
                  f"sparse_attention={parse_sparse_attention(config.sparse_attention)!r}"
        if config.batch_invariant:
            # its entries hold these invariant kernels' bits, which another kernel build or CPU
            # (another instruction set, another kernel) would not reproduce: the library's name
            # is a digest of the sources, the flags and the CPU's features
            lib = native.kernels().lib
            forward += f";batch_invariant={os.path.basename(getattr(lib, '_name', '') or '')}"
        return namespace_key(self._weights_tag, str(self.dtype).encode(), geometry.encode(), forward.encode())

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | str | None = None,
    ) -> Request:
        """`priority`: under scheduling_policy "priority", lower values are scheduled first (and
        preempted last); any other value than 0 is refused under "fcfs". `lora_request`: the LoRA
        adapter the request runs under (a `LoRARequest`, or the name of one registered), with
        enable_lora."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._check_awake("a request")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be an integer in [-2**63, 2**63 - 1], got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy (scheduling_policy='priority', "
                             "--scheduling-policy priority); this engine schedules first come, first served")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs}): the samples of one request run together")
        # the sampler indexes the logits with them (under min_tokens): one past the vocabulary
        # failed the whole step, every request in it
        self._check_ids(params.stop_token_ids, "stop_token_ids")
        layout = None
        if isinstance(prompt, dict):
            layout, ids, text = self._squid_prompt(prompt, params)
        elif isinstance(prompt, str):
            text = prompt
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text = None
            ids = list(prompt)
            self._check_ids(ids, "prompt")
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if params.truncate_prompt_tokens is not None:  # vLLM's: keep the last k tokens
            if layout is not None:
                raise ValueError("truncate_prompt_tokens is not supported for prompts with documents")
            keep = self.max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init): use stop_token_ids")
        # a squid query's positions start after the prefix and the documents
        start = layout.query_start() if layout is not None else 0
        used = start + len(ids)
        what = "prefix + documents + prompt" if layout is not None else "prompt"
        if used >= self.max_model_len:
            raise ValueError(f"{what} is {used} positions; the maximum is {self.max_model_len - 1} (max_model_len {self.max_model_len})")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - used
        elif used + max_tokens > self.max_model_len:
            raise ValueError(
                f"{what} ({used} positions) + max_tokens ({max_tokens}) = {used + max_tokens} exceeds max_model_len ({self.max_model_len})"
            )
        if layout is not None:
            # the prefix and every document sit in blocks of their own, all held while the query
            # runs: block rounding can ask more of the pool than max_model_len suggests, and such a
            # request would wait for blocks forever, holding up the queue behind it
            bs, pool = self.config.block_size, self.block_manager.num_blocks
            shared = -(-layout.prefix_len // bs) + sum(-(-len(d) // bs) for d in layout.documents)
            if params.max_tokens is None:  # the default: as many as max_model_len and the pool allow
                max_tokens = max(1, min(max_tokens, (pool - shared) * bs - len(ids)))
            need = shared + -(-(len(ids) + max_tokens) // bs)
            if need > pool:
                raise ValueError(
                    f"prefix + documents + prompt + max_tokens need {need} KV blocks of {bs} tokens (the prefix and each "
                    f"document take blocks of their own), more than the pool's {pool} (num_kv_blocks): send fewer or "
                    "shorter documents, or a smaller max_tokens"
                )
        adapter = self.lora_adapter(lora_request)
        # compiles its grammar; a bad spec, or controls that leave no token to sample, refused here
        controls = self.controls.prepare(params, stop_ids=self._stop_ids(params) if params.min_tokens else ())
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        extra = self.weight_version.to_bytes(8, "little") + (cache_salt or "").encode()
        if adapter is not None:  # KV computed under an adapter is that adapter's alone
            extra += b"|lora|" + adapter.key
        req = Request(request_id, ids, params, prompt=text, extra_key=extra, seed=seed, max_tokens=max_tokens,
                      stream=stream, weight_version=self.weight_version, layout=layout, priority=priority, lora=adapter,
                      lora_request=_named(lora_request, adapter))
        if layout is not None:
            req.prefix_cache_key = extra + self.squid.query_key(req)
            req.full_prompt_token_ids = layout.flat_tokens(ids)
            self.counters["prompt_tokens"] += len(req.full_prompt_token_ids) - len(ids)
        self.post.attach_detokenizer(req.seqs[0])
        self.controls.attach(req, controls)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        self.counters["prompt_tokens"] += len(ids)
        return req

    def lora_adapter(self, lora_request: LoRARequest | str | None) -> LoadedAdapter | None:
        """The loaded adapter a request names (engine/lora.py), or None for the base model."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError("lora_request needs LoRA enabled (enable_lora=True; --enable-lora)")
        return self.loras.resolve(lora_request)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer, and this engine runs with skip_tokenizer_init: pass token ids")
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text holds a lone UTF-16 surrogate at {e.start}: not valid text") from None
        return self.tokenizer.encode(text, add_special_tokens)

    def _check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field} token ids must be integers in [0, {vocab - 1}], got {bad!r}")

    def _windows_served(self, config: EngineConfig) -> bool:
        """Whether this engine attends sliding windows as the model defines them past W: the torch
        and Triton backends (`set_windows`), without top-k sparse attention."""
        return resolve_backend_name(config.attention_backend, self.device) in WINDOWED_BACKENDS and config.sparse_attention is None

    def _squid_prompt(self, prompt: dict, params: SamplingParams):
        """A prompt with documents (engine/squid.py): validated here, before anything is queued."""
        # documents make segmented steps; a backend without them would fail the step, and with it
        # every request in flight: refused here instead
        if not self.runner.backend.takes_segments:
            raise ValueError(f"documents need an attention backend that takes segmented steps; the "
                             f"{self.runner.backend.name} backend does not yet (use attention_backend='triton' or 'torch')")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported for prompts with documents")
        # (sliding windows: the backends that take segments window them by position; where windows
        # are not served, max_model_len is capped at W and documents fit in it)
        layout, ids, text = parse_prompt(prompt, self.encode, self._check_ids, self.squid_positions,
                                         self.config.max_documents)
        for i, d in enumerate(layout.documents):
            if layout.prefix_len + len(d) >= self.max_model_len:
                raise ValueError(f"documents[{i}] is {len(d)} tokens; after the prefix ({layout.prefix_len}) it exceeds max_model_len ({self.max_model_len})")
        return layout, ids, text

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.post.abort(req)
        return self.post.output(req)

    # ---- agent sessions (engine/session.py) --------------------------------------------------
    def open_session(self, prompt: str | list[int], lora_request: LoRARequest | str | None = None) -> str:
        """A session over `prompt` (text is encoded once, here); returns its id. `lora_request`:
        the adapter its turns (and its forks') run under, checked now (engine/session.py)."""
        self._check_awake("a session")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_ids(ids, "prompt")
        return self.sessions.open(ids, _named(lora_request, self.lora_adapter(lora_request))).session_id

    def fork_session(self, session_id: str, n: int) -> list[str]:
        return [s.session_id for s in self.sessions.fork(session_id, n)]

    def append_to_session(self, session_id: str, token_ids: list[int]) -> None:
        ids = list(token_ids)
        self._check_ids(ids, "token_ids")
        self.sessions.append(session_id, ids)

    def replace_last_session_token(self, session_id: str, token_id: int) -> None:
        """The session's last token, not yet in KV (a turn's sampled one), replaced (beam search)."""
        self._check_ids([token_id], "token_id")
        self.sessions.replace_last(session_id, token_id)

    # ---- beam search's sessions (engine/beam_search.py): each call changes the caller's lists in
    # place, so a caller that stopped waiting (an async one, cancelled) still finds every session
    # id the engine holds for it and can close them
    def open_beams(self, prompts: list[list[int]], live: list[list[str]], lora_request: LoRARequest | str | None = None) -> None:
        """A session on each prompt (under `lora_request`), appended to `live` as a one-beam list."""
        for p in prompts:
            live.append([self.open_session(p, lora_request)])

    def fork_beams(self, session_ids: list[str], origins: list[tuple[int, int]]) -> None:
        """A beam search step between turns: for each kept candidate (parent index into
        `session_ids`, token), a fork of that parent whose last token, the turn's argmax, is
        replaced by the candidate's; the parents closed, and `session_ids` then holds the forks, in
        `origins`' order. If a fork fails (a session limit), the forks made are closed, the parents
        kept, and the error raised."""
        children: list[str] = []
        try:
            for parent, token in origins:
                child = self.fork_session(session_ids[parent], 1)[0]
                children.append(child)
                self.replace_last_session_token(child, token)
        except BaseException:
            for sid in children:
                self.close_session(sid)
            raise
        for sid in session_ids:
            self.close_session(sid)
        session_ids[:] = children

    def close_beams(self, live: list[list[str]]) -> None:
        """Close every session in `live`'s lists (a turn in flight is aborted) and empty them."""
        for sids in live:
            for sid in sids:
                self.close_session(sid)
            sids.clear()

    def session_token_ids(self, session_id: str) -> list[int]:
        return list(self.sessions.get(session_id).token_ids)

    def add_session_turn(self, request_id: str, session_ids: list[str], params: SamplingParams, stream: bool = False,
                         priority: int = 0) -> Request:
        """One turn of each session, sampled from its whole stream, as one request: sample `i` is
        session `session_ids[i]`'s (siblings forked from one session and not diverged run together,
        n = their number). `params.n` must be 1 or that number. `priority` as `add_request`'s."""
        sessions = self.sessions.turn_sessions(list(session_ids))
        if params.n not in (1, len(sessions)):
            raise ValueError(f"n ({params.n}) must be 1 or the number of sessions ({len(sessions)}): a turn samples once per session")
        if len(sessions) > self.config.max_num_seqs:
            raise ValueError(f"a turn of {len(sessions)} sessions (forked siblings run together) exceeds max_num_seqs "
                             f"({self.config.max_num_seqs})")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported for session turns (the history's KV is reused, not recomputed)")
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported for session turns (a turn's prompt is the session's "
                             "whole stream, whose KV the session keeps; close it and open one on the tokens to keep)")
        params = dataclasses.replace(params, n=len(sessions))
        req = self.add_request(request_id, list(sessions[0].token_ids), params, stream, priority=priority,
                               lora_request=sessions[0].lora_request)  # forks share their parent's adapter
        try:
            self.sessions.begin_turn(sessions, req)
        except ValueError:
            self.abort_request(request_id)
            raise
        return req

    def close_session(self, session_id: str) -> RequestOutput | None:
        """Release everything the session holds; a turn in flight is aborted (its output returned)."""
        req = self.sessions.close(session_id)
        return self.abort_request(req.request_id) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- sleep mode (engine/sleep_mode.py) ----------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give back the KV pool's memory until `wake_up`; the prefix cache is emptied. Level 1
        keeps the weights (on an accelerator in host memory), level 2 discards them: after waking,
        `update_weights` must write every weight (in any number of calls) before the engine serves
        again. Only when idle: no request unfinished and no session open (their KV would be lost)."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep needs enable_sleep_mode=True (--enable-sleep-mode), as in vLLM")
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 (free the KV cache, keep the weights) or 2 (also discard the weights, "
                             f"to be sent again by update_weights), got {level!r}")
        if self._slept.asleep:
            raise ValueError("the engine is already asleep: wake_up() first")
        if self.requests:
            raise ValueError(f"{len(self.requests)} request(s) are unfinished: let them finish or abort them before sleep")
        if self.sessions.table:
            raise ValueError(f"{len(self.sessions.table)} session(s) are open and hold KV: close them before sleep")
        if self.tiers is not None:
            self.tiers.drain()  # no copy may still be reading the pool
        self.block_manager.reset_prefix_cache()  # the blocks' content is about to go
        if self.runner.graphs is not None:
            self.runner.graphs.clear()  # they hold the pool's (and the weights') addresses
        slept = Slept(kv=free_storage(self.runner.kv.tensors))
        model = self.runner.model
        if level == 2:
            unpack_experts(model)  # held in the plain form the loader writes
            drop_packed(model)
            slept.discarded = discard_weights(model)
            self._reload = None  # (set on waking: nothing can be written while discarded)
        elif self.device.type != "cpu":
            slept.weights = offload_weights(model)
        self._slept = slept

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what `sleep` gave back: `tags` None for all, or a subset of "weights" and
        "kv_cache" (vLLM's: wake the weights, update them, then the KV cache)."""
        if isinstance(tags, str):
            raise ValueError(f"wake_up tags must be a list among {list(WAKE_TAGS)}, got the string {tags!r}")
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad:
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {bad!r}")
        slept = self._slept
        if "weights" in tags and slept.weights:
            restore_weights(slept.weights)
            slept.weights = []
        if "weights" in tags and slept.discarded:
            regrow_weights(slept.discarded, self.device)
            slept.discarded = []
            self._reload = WeightCoverage(self.runner.model)
        if "kv_cache" in tags and slept.kv:
            restore_storage(slept.kv)
            slept.kv = []
        if self.runner.graphs is not None:
            self.runner.graphs.clear()

    def is_sleeping(self) -> bool:
        return self._slept.asleep

    def _check_awake(self, what: str) -> None:
        if self._slept.asleep:
            slept = self._slept
            asleep = " and ".join(n for n, gone in (("weights", slept.weights or slept.discarded), ("KV cache", slept.kv)) if gone)
            raise EngineAsleepError(f"the engine is asleep (its {asleep} given back by sleep()): wake_up() before {what}")
        if self._reload is not None:
            missing = self._reload.missing()
            raise EngineAsleepError(f"the weights discarded by sleep(level=2) are not all loaded again: update_weights has "
                                    f"not written {len(missing)} of {len(self._reload.targets)} tensors (e.g. {missing[:4]}); "
                                    f"send them all before {what}")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and document, in every tier (vLLM's, e.g. for benchmarks that
        must start cold); blocks in use stay valid for their holders. Returns True."""
        self.block_manager.reset_prefix_cache()
        return True

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        # inputs first: with KV tiers the copies of this schedule's evicted blocks run meanwhile
        inputs = self.runner.prepare(sched.scheduled)
        # the token masks of this step's samples are filled on a worker thread during the forward
        mask_job = self.controls.start(inputs.sample_seqs)
        if self.tiers is not None:
            self.tiers.before_write()
        self.runner.copy_blocks(self.block_manager.pending_copies)
        self.block_manager.pending_copies.clear()
        logits = self.runner.run(inputs)
        self.counters["steps"] += 1
        if isinstance(self.proposer, MTPProposer):  # the rows' hidden states, for the MTP layer's entries
            self.proposer.record(sched.scheduled, self.runner.hidden)

        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens
            if seq.draft:  # the drafts' KV counts once they are kept (in _accept_drafts)
                n -= len(seq.draft)
                self.counters["spec_draft_tokens"] += len(seq.draft)
            if not (n == 1 and start == len(seq.token_ids) - 1 and start >= seq.num_prompt_tokens):
                self.counters["prefill_tokens_computed"] += n
            seq.num_computed_tokens = start + n
            if seq.request.job is None:
                self.block_manager.computed(seq)
            elif seq.num_computed_tokens == len(seq.token_ids):  # a document is computed: cache it
                self.scheduler.complete_job(seq)

        row = 0
        for seq, first, count in inputs.prompt_rows:
            self._record_prompt_logprobs(seq, first, logits[row : row + count])
            row += count

        touched: dict[str, Request] = {}
        rows: list[int] = []
        targets: list[Sequence] = []
        src: list[int] = []  # the sample_seqs entry each target's row comes from
        offsets: list[int] = []  # a row's place after the sequence's last token (> 0: a draft's row)
        forked = False  # a prompt's row repeated for its n samples: rows are no longer the logits' rows
        for j, seq in enumerate(inputs.sample_seqs):
            req = seq.request
            if seq.draft:  # its last token's row, then one row per draft (speculative decoding)
                for i in range(len(seq.draft) + 1):
                    rows.append(row + i)
                    targets.append(seq)
                    src.append(j)
                    offsets.append(i)
                row += len(seq.draft) + 1
                continue
            group = [seq]
            if not req.forked:  # the prompt is done: the other n-1 samples fork from it now
                self._fork(req, seq)
                group = req.seqs
                forked = True
            for s in group:
                rows.append(row)
                targets.append(s)
                src.append(j)
                offsets.append(0)
            row += 1
        mask = None
        if mask_job is not None:
            mask = mask_job.result()
            if len(targets) != len(inputs.sample_seqs):
                mask = mask.take(src)
            for k, why in mask.failed.items():
                req = targets[k].request
                self.post.fail(req, ValueError(why))
                touched[req.request_id] = req  # its output (with the error) must still reach the caller
        if targets:
            reqs = [self._sample_request(s, i) for s, i in zip(targets, offsets)]
            # rows are consecutive unless an n > 1 prompt just forked (its row repeats): a slice
            # then saves copying [rows, vocab] fp32 logits every step
            if rows == list(range(rows[0], rows[0] + len(rows))):
                picked = logits[rows[0] : rows[0] + len(rows)]
            else:
                picked = logits[torch.tensor(rows)]
            # a replayed plain-greedy step picked its argmax already (for its rows as they are: not
            # after a fork repeated one)
            greedy = inputs.greedy if not forked else None
            with torch.inference_mode():  # the logits are inference tensors, updated in place
                results = sample(picked, reqs, self.config.logprobs_mode, mask, greedy)
            now = time.monotonic()
            post = self.post
            k = 0
            while k < len(targets):
                s, res = targets[k], results[k]
                req = s.request
                if s.draft:  # this row and the drafts' rows after it
                    count = len(s.draft) + 1
                    self._accept_drafts(s, results[k : k + count])
                    k += count
                else:
                    k += 1
                    if req.error is not None:
                        continue  # an earlier sample of this request already failed it this step
                    try:
                        if res.failed is not None:
                            raise ValueError(res.failed)
                        post.append(s, res.token, res.logprob, res.top)
                    except Exception as e:  # noqa: BLE001 - one request's fault must not end the batch
                        post.fail(req, e)
                if req.first_token_time is None:
                    req.first_token_time = now
                touched[req.request_id] = req

        outputs: list[RequestOutput] = []
        for req in touched.values():
            if not (req.is_finished or req.error is not None or (req.stream and req.sampling_params.output_kind != FINAL_ONLY)):
                continue
            try:
                out = self.post.output(req)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer that cannot decode its ids
                self.post.fail(req, e)
                out = self.post.output(req)
            if out.finished:
                self.requests.pop(req.request_id, None)
            outputs.append(out)
        return outputs

    # ---- helpers ---------------------------------------------------------------------------
    def _fork(self, req: Request, parent: Sequence) -> None:
        children = []
        for i in range(1, req.sampling_params.n):
            child = Sequence(req, i, list(parent.token_ids), parent.num_prompt_tokens)
            child.num_cached_tokens = parent.num_cached_tokens
            child.mtp = None if parent.mtp is None else parent.mtp.copy()
            self.block_manager.fork(parent, child)
            self.post.attach_detokenizer(child)
            children.append(child)
        req.seqs.extend(children)
        req.forked = True
        self.scheduler.insert_running_after(parent, children)

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        """The ids min_tokens masks: stop_token_ids, and EOS unless ignore_eos."""
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def _sample_request(self, seq: Sequence, offset: int = 0) -> SampleRequest:
        """Row `offset` of `seq`: 0 its next token's; i > 0 the token after its first i drafts
        (speculative decoding), sampled as if they had been appended: its output position, and
        the drafts among the tokens penalties count."""
        req = seq.request
        p = req.sampling_params
        output = seq.output_token_ids + seq.draft[:offset] if offset and p.has_penalties else seq.output_token_ids
        index, first = req.draws_at or (seq.index, 0)
        if first and p.has_penalties:  # a draft's request: its prompt ends with the target's outputs, which count as output
            output = req.prompt_token_ids[len(req.prompt_token_ids) - first:] + output
        return SampleRequest(
            params=p,
            seed=req.seed,
            index=index,
            step=first + seq.num_output_tokens + offset,
            # the whole prompt a squid query reads (prefix + documents + query), as vLLM's prompt
            prompt_ids=(req.full_prompt_token_ids or req.prompt_token_ids) if p.repetition_penalty != 1.0 else [],
            output_ids=output if p.has_penalties else [],
            stop_ids=self._stop_ids(p),
        )

    def _accept_drafts(self, seq: Sequence, results: list) -> None:
        """Speculative decoding's rule (engine/spec_decode.py): append the sampled tokens in order
        while each equals the draft at its place (that draft's KV, computed this step, then
        counts), up to and including the first that differs or the one after the last draft;
        stops where the sequence finishes. Blocks reserved for drafts not kept go back."""
        draft, post = seq.draft, self.post
        seq.draft = []
        if seq.request.error is not None:
            return  # an earlier sample of this request failed it this step
        kept = 0
        try:
            for i, res in enumerate(results):
                if res.failed is not None:
                    raise ValueError(res.failed)
                post.append(seq, res.token, res.logprob, res.top)
                if seq.is_finished or i == len(draft) or res.token != draft[i]:
                    break
                seq.num_computed_tokens += 1  # the draft is the token now: its KV is this step's
                self.counters["spec_accepted_tokens"] += 1
                kept += 1
                if seq.num_computed_tokens % self.block_manager.block_size == 0:
                    # a block just filled: cached now, before a later token may end the sequence
                    self.block_manager.hash_computed_blocks(seq)
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the batch
            post.fail(seq.request, e)
        self.scheduler.spec.update(seq, len(draft), kept)
        if not seq.is_finished:
            self.block_manager.computed(seq)
            self.block_manager.trim(seq)

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        req = seq.request
        k = req.sampling_params.prompt_logprobs or 0
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + logits.shape[0]])
        chosen = lp.gather(1, targets[:, None]).squeeze(1)
        ranks = (lp > chosen[:, None]).sum(dim=1) + 1
        top_v, top_i = torch.topk(lp, k, dim=-1) if k > 0 else (None, None)
        assert req.prompt_logprobs is not None
        for j, (tok, c, r) in enumerate(zip(targets.tolist(), chosen.tolist(), ranks.tolist())):
            d: dict[int, Logprob] = {}
            if top_v is not None:
                for rank, (v, t) in enumerate(zip(top_v[j].tolist(), top_i[j].tolist()), start=1):
                    d[t] = Logprob(v, rank)
            d.setdefault(tok, Logprob(c, r))
            req.prompt_logprobs.append(d)

    # ---- weight sync (RL) ------------------------------------------------------------------
    def stalled(self, steps_before: int) -> bool:
        """Whether the step(s) since `counters["steps"]` was `steps_before` ran nothing while
        requests wait and nothing runs or loads: then no block will come free by stepping (what
        remains is held by session pins), so a caller stepping until done would spin forever."""
        sched = self.scheduler
        return self.counters["steps"] == steps_before and not sched.running and not sched.loading and bool(sched.waiting)

    def stall_message(self) -> str:
        pinned, total = self.sessions.pinned_block_count(), self.block_manager.num_blocks
        if pinned:
            return (f"a request cannot get KV blocks: sessions pin {pinned} of {total} "
                    f"(max_session_kv_blocks {self.sessions.max_session_kv_blocks}); close sessions first")
        return (f"a request cannot get KV blocks: no session pins any, {self.block_manager.num_free_blocks} of {total} "
                "are free, and the waiting request needs more than that at once")

    def update_draft_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace the draft model's weights (speculative decoding with a draft model: an RL loop
        that trains the draft beside the policy, or distills it from the policy); returns the
        draft's new weight version. Nothing of the draft is in flight between steps (each step's
        proposals are made and finished in it), and its KV computed under the old weights is never
        hit again (the draft engine's own `update_weights`). The target's outputs do not depend on
        the draft: only how many drafts are kept does."""
        if not isinstance(self.proposer, DraftModelProposer):
            raise ValueError("update_draft_weights needs speculative_config with a draft model (\"model\": <checkpoint>)")
        draft = self.proposer.engine
        draft.update_weights(named_tensors, "abort")
        return draft.weight_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: str = "abort") -> list[RequestOutput]:
        """Replace weights in place and bump `weight_version`; returns the outputs of the requests
        that ended during the call.

        `in_flight`: "abort" stops every unfinished request first (finish_reason "abort");
        "finish" steps them to completion under the old weights first. Either way no request ever
        spans two versions. Tensors are named either as in an HF checkpoint (mapped by the loader)
        or as this engine's own parameters (`CausalLM.named_parameters()`, what a trainer built on
        the same model code holds). Afterwards the prefix cache is emptied, and since the cache
        key carries the version, nothing computed under the old weights can be hit again.
        """
        if in_flight not in ("abort", "finish"):
            raise ValueError(f"in_flight must be 'abort' or 'finish', got {in_flight!r}")
        if self._slept.weights or self._slept.discarded:  # (the KV cache may sleep on: vLLM's wake weights, update, wake KV)
            raise EngineAsleepError("the engine's weights are asleep: wake_up(tags=['weights']) before update_weights")
        ended: list[RequestOutput] = []
        if in_flight == "finish":
            stalls = 0
            while self.has_unfinished_requests():
                steps = self.counters["steps"]
                ended.extend(out for out in self.step() if out.finished)
                stalls = stalls + 1 if self.stalled(steps) else 0
                if stalls > 1:
                    raise RuntimeError(f"{self.stall_message()}; the weights were not updated")
        else:
            ended = self._abort_all()
        written: list[torch.Tensor] | None = []
        try:
            self._load_weights(named_tensors, written)
            if self._reload is not None and not self._reload.missing():
                self._reload = None  # every discarded weight written again: serving resumes
        except BaseException:
            written = None
            raise
        finally:  # stale packed copies go: those of what was written (of everything, if the update failed part way)
            drop_packed(self.runner.model if written is None else written)
            if self._reload is None:  # (while weights are still missing, packing them would be wasted work)
                self.runner.prepack()  # packs what is not packed: the written tensors, the expert layers they unpacked
        self._next_weight_version()
        return ended

    def reload_weights(self, path: str | None = None, in_flight: str = "abort") -> list[RequestOutput]:
        """Every weight read again from a checkpoint directory (vLLM's
        `collective_rpc("reload_weights")`): the engine's own by default, or another of the same
        model (a trainer's saved step; a local HF cache repo id too), through `update_weights`, so
        after `sleep(level=2)` it makes the engine whole again. The checkpoint must cover every
        weight and hold nothing foreign, checked before anything is written (as at load)."""
        if self._slept.weights or self._slept.discarded:
            raise EngineAsleepError("the engine's weights are asleep: wake_up(tags=['weights']) before reload_weights")
        path = self.config.model if path is None else resolve_model(path)
        model = self.runner.model

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:  # memory-mapped, read twice (checked, then written)
            ts = iter_tensors(path)
            return dequantized_tensors(ts, model.cfg.fp8_quant, path) if model.cfg.fp8_quant is not None else ts

        load_weights(model, tensors(), strict=True, source=path, check_only=True)
        return self.update_weights(tensors(), in_flight)

    def update_lora(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                    in_flight: str = "finish") -> list[RequestOutput]:
        """LoRA training's weight sync: the adapter `name` from tensors in memory (PEFT names) and
        its adapter_config dict (engine/lora.py), and `weight_version` bumped as by `update_weights`
        (the policy changed). Returns the outputs of the requests that ended during the call.

        `in_flight`: "finish" lets the requests in flight go on under the adapter they started with
        (each holds its own; the base weights do not change), "abort" stops them. Either way no
        request spans two versions."""
        if in_flight not in ("abort", "finish"):
            raise ValueError(f"in_flight must be 'abort' or 'finish', got {in_flight!r}")
        if self.loras is None:
            raise ValueError("update_lora needs LoRA enabled (enable_lora=True; --enable-lora)")
        self.loras.load_tensors(name, named_tensors, config)  # checked whole before anything changes
        ended = self._abort_all() if in_flight == "abort" else []
        self._next_weight_version()
        return ended

    def _abort_all(self) -> list[RequestOutput]:
        """Abort every request (a weight update's in_flight="abort"); their final outputs."""
        outs = (self.abort_request(rid) for rid in list(self.requests))
        return [out for out in outs if out is not None]

    def _next_weight_version(self) -> None:
        """A new policy: bump the version that keys every cache, so nothing computed before is reused."""
        self.weight_version += 1
        self.sessions.invalidate(self.weight_version)  # no session's KV under the old weights is reused
        namespace = None
        if self.tiers is not None and self.tiers.disk is not None:
            # a fresh tag: another process's weights after its own update are never these
            self._weights_tag = os.urandom(16)
            namespace = self._disk_namespace()
        self.block_manager.reset_prefix_cache(namespace)

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], written: list[torch.Tensor]) -> None:
        """All or nothing: every name and shape is checked before any tensor is written, so a bad
        update (a foreign name, a wrong shape) leaves the old weights whole (the iterable is held
        in full for that: references to the caller's tensors)."""
        model = self.runner.model
        params = dict(model.named_parameters(remove_duplicate=False))
        native: list[tuple[torch.Tensor, torch.Tensor]] = []
        named_ids: list[tuple[str, torch.Tensor]] = []  # the engine-named ones, by name
        hf: list[tuple[str, torch.Tensor]] = []
        for name, t in named_tensors:
            p = params.get(name)
            if p is None:
                hf.append((name, t))
                continue
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(t.shape)}, the engine has {tuple(p.shape)}")
            native.append((p, t))
            named_ids.append((name, t))
        for name, t in [*named_ids, *hf]:  # a NaN weight would make every later output NaN
            if t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) and not bool(torch.isfinite(t).all()):
                raise ValueError(f"update_weights: {name!r} holds a NaN or infinite value; nothing was written")
        unknown = load_weights(model, hf, strict=False, source="update_weights", check_only=True)
        if unknown:
            raise ValueError(f"update_weights: tensors with no place in this model: {unknown[:8]}; nothing was written")
        with torch.no_grad():
            for p, t in native:
                p.copy_(t)
                written.append(p)
                if self._reload is not None:
                    self._reload.record_whole(p)
        load_weights(model, hf, strict=False, source="update_weights", coverage=self._reload, written=written)

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            **self.counters,
            "cached_tokens": bm.num_cached_tokens_hit,
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_window_released_blocks": bm.num_window_released_blocks,  # given back behind a sliding window
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "weight_version": self.weight_version,
            # decode steps replayed from kernel graphs (engine/step_graphs.py; 0 with them off)
            **(self.runner.graphs.counters if self.runner.graphs is not None else {"graph_steps": 0, "graph_captures": 0, "graph_evictions": 0}),
            **self.squid.counters,
            **self.sessions.stats(),
            # LoRA (engine/lora.py): adapters held loaded, and running sequences under one
            **({"lora_adapters_loaded": len(self.loras.loaded),
                "lora_requests_running": sum(1 for s in self.scheduler.running if s.request.lora is not None)}
               if self.loras is not None else {}),
            **(self.tiers.stats() if self.tiers is not None else {}),
        }


def keep_large_allocations_in_heap() -> None:
    """Stop glibc from mmap-ing (and unmapping) every large buffer.

    Each step allocates activation and KV-gather buffers of tens of MB; by default glibc serves
    those with fresh mmaps, so every step pays page faults on zeroed pages (measured: a 33 MB
    gather took 4-5x longer than the copy itself). Raising the mmap and trim thresholds keeps the
    memory in the heap for reuse, as tcmalloc/jemalloc would. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _check_fits(field: str, nbytes: int, device: torch.device, weights: int = 0) -> None:
    """Refuse a KV pool larger than the memory free on its device, less the `weights` about to be
    loaded there, before anything is built (1e10 blocks spent minutes building per-block
    bookkeeping on the way to running out of memory; a pool that fits only without the weights
    failed later, while they loaded)."""
    free = free_memory_bytes(device)
    if nbytes > free - weights:
        less = (f" less the model's {weights / 2**30:.2f} GiB of weights (every checkpoint tensor at the engine dtype: an "
                f"upper bound under quantization)") if weights else ""
        raise ValueError(f"{field} asks for {nbytes / 2**30:.2f} GiB of KV cache, more than the {free / 2**30:.2f} GiB free on "
                         f"{device.type}{less}")


def _named(lora_request: LoRARequest | str | None, adapter: LoadedAdapter | None) -> LoRARequest | None:
    """How a caller named the adapter it resolved to (a name alone becomes a LoRARequest)."""
    if adapter is None:
        return None
    return lora_request if isinstance(lora_request, LoRARequest) else LoRARequest(adapter.name)
