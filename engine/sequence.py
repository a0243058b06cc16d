"""Requests and their sequences: the unit the scheduler moves and the block manager backs.

A `Request` is what a user submitted (prompt, SamplingParams); it owns `n` `Sequence`s. Until its
prompt is prefilled a request has one sequence; the other n-1 fork from it when the prompt
completes, sharing its KV blocks. A sequence owns its token list, its block table and its output
state; it never touches KV memory itself.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from cuttle.engine.kv.handles import KVHandle
from cuttle.engine.kv.segments import Segment
from cuttle.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cuttle.engine.lora import LoadedAdapter, LoRARequest
    from cuttle.engine.mtp_proposer import MTPState
    from cuttle.engine.sampler import Logprob
    from cuttle.engine.spec_decode import NgramIndex
    from cuttle.engine.squid import DocumentJob, SquidLayout
    from cuttle.engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    __slots__ = (
        "seq_id", "request", "index", "token_ids", "num_prompt_tokens", "block_table",
        "num_computed_tokens", "num_cached_tokens", "status", "logprobs", "cumulative_logprob",
        "finish_reason", "output_text", "detok", "stop_reason", "shared", "handles", "pos_base",
        "sent_tokens", "sent_chars", "num_reused_tokens", "stop_token_hidden", "draft", "ngram", "draft_len",
        "mtp",
    )

    def __init__(self, request: "Request", index: int, token_ids: list[int], num_prompt_tokens: int):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.status = SequenceStatus.WAITING
        # KV this sequence reads but does not own (a shared prefix, cached documents), each
        # segment pinned by the handle at the same index; its own tokens are the causal segment
        # after them, in `block_table`, starting at position `pos_base`.
        self.shared: list[Segment] = []
        self.handles: list[KVHandle] = []
        self.pos_base = 0
        self.num_reused_tokens = 0  # prefix + document tokens served from the document cache
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stop_token_hidden = False  # ended by a stop token / EOS whose text the output leaves out
        self.output_text = ""
        self.detok: IncrementalDetokenizer | None = None  # set by the engine when text is needed per step
        self.sent_tokens = 0  # output tokens and text already handed out (delta outputs)
        self.sent_chars = 0
        # speculative decoding (engine/spec_decode.py): this step's draft tokens, computed after
        # the last token and checked against the samples; the n-gram index they are looked up in
        self.draft: list[int] = []
        self.ngram: NgramIndex | None = None
        self.draft_len = 0  # drafts to propose next (adapted to what was kept); 0: not yet set
        self.mtp: MTPState | None = None  # the MTP drafter's hidden states for this sequence (engine/mtp_proposer.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def segments(self) -> list[Segment]:
        """All of this sequence's KV, in attention order: the shared segments, then its own
        (causal) tokens as computed so far."""
        own = Segment(self.block_table, self.num_computed_tokens, self.pos_base, self.pos_base, causal=True)
        return [*self.shared, own] if self.shared else [own]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # under EngineConfig.scheduling_policy "priority": lower runs first (vLLM's order)
    extra_key: bytes = b""  # mixed into every prefix-cache hash (weight version, cache salt)
    seed: int = 0  # effective seed; the engine draws one when SamplingParams.seed is None
    max_tokens: int = 0  # effective limit (SamplingParams.max_tokens, or what the model length leaves)
    stream: bool = False  # report progress every step, not only at the end
    weight_version: int = 0  # the weights this request is computed with
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_time: float | None = None
    aborted: bool = False
    layout: SquidLayout | None = None  # prefix + documents before the prompt (engine/squid.py)
    prefix_cache_key: bytes = b""  # what its own blocks' hashes chain under: extra_key (+ the squid layout)
    full_prompt_token_ids: list[int] | None = None  # prefix + documents + prompt, as outputs report it
    job: DocumentJob | None = None  # set on the internal request that computes one document
    error: str | None = None  # why the engine ended this request on its own (see LLMEngine._fail)
    lora: LoadedAdapter | None = None  # the LoRA adapter its rows run under (engine/lora.py)
    lora_request: LoRARequest | None = None  # how the caller named it (its outputs report that)
    # (sample index, output position) its draws start at, in its seed's uniforms: a draft model's
    # request draws the ones its target sample will draw (engine/draft_model.py), and the last
    # `output position` tokens of its prompt (the target's outputs) count as output for penalties
    draws_at: tuple[int, int] | None = None
    cache_written_tokens: int = 0  # prompt tokens in full blocks this request put in the prefix cache

    def __post_init__(self) -> None:
        if not self.prefix_cache_key:
            self.prefix_cache_key = self.extra_key
        self.seqs = [Sequence(self, 0, list(self.prompt_token_ids), len(self.prompt_token_ids))]
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.forked = self.sampling_params.n == 1

    @property
    def is_finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.seqs)
