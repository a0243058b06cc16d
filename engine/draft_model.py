"""Speculative decoding with a draft model (vLLM's `speculative_config={"model": <small checkpoint>,
"num_speculative_tokens": k}`): a smaller model of the same vocabulary proposes each decoding
sequence's next tokens and the target verifies them in one pass as it verifies n-gram proposals
(engine/spec_decode.py: a draft is kept iff it equals the token the target samples at its place,
so the output is that of decoding without drafts, greedy or random).

A greedy request is drafted greedily. A sampled one is drafted by sampling the draft's own
distribution, processed as the target's (temperature, top-k / top-p / min-p, penalties, the
target's outputs counted as outputs), with the very uniforms the target sample will draw at those positions (its seed, sample index and
output positions; both invert their CDF in vocabulary order). The two draws are coupled: where
the draft's distribution is the target's the draft is the target's sample, and the closer they
are the likelier a match, so a sampled request keeps about as many drafts as the distributions
allow rather than only those that happen to be the target's argmax (measured: the model as its
own draft at temperature 1 keeps nearly every draft, where greedy drafts were kept about as often
as the sample was the argmax). What the target samples never depends on the drafts.

Owns the draft model's engine and the step's proposals. The draft runs as an `LLMEngine` of its
own (its own weights, KV pool and prefix cache, no tokenizer), beside the target's, never sharing
blocks with it: each step, before the target's schedule, every decoding sequence that may take
drafts becomes one draft request over its whole token stream with `max_tokens` its draft
length, and the draft engine runs them batched until all have proposed. The stream's full blocks
are prefix-cache hits from the previous step's request, so a step computes the stream's partial
last block, the target's tokens since, and the k drafts. A query over squid documents is drafted
over its prompt laid out flat (prefix, documents in order, query), so the draft reads what the
target attends (the documents' placement aside, which only changes how good its guesses are).
Requests the n-gram proposer skips (`Proposer.room`) are skipped here too.
"""
from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from cuttle.engine.config import DTYPES, EngineConfig, ModelConfig
from cuttle.engine.hf_cache import resolve_model
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.spec_decode import Proposer, SpecConfig

DRAFT_BLOCK_SIZE = 4
# the draft's requests: the draft's own EOS not ending them (the target decides that)
_DRAFTING = dict(ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY, skip_special_tokens=False)


def _draft_params(p: SamplingParams, k: int, seed: int) -> SamplingParams:
    """The draft request for a target sample under `p`: its penalties, and greedy for a greedy
    one; else its temperature and truncation under the target's seed (`Request.draws_at` makes the
    draws and the penalties' output counts the target's). min_tokens and stop ids stay the
    target's business: they change a draft's quality, never the output."""
    same = dict(max_tokens=k, repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, **_DRAFTING)
    if p.greedy:
        return SamplingParams(temperature=0.0, **same)
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seed, **same)


class DraftModelProposer(Proposer):
    """`Proposer` whose drafts come from a draft model, computed for the whole step in `prepare`."""

    prepares = True

    def __init__(self, config: SpecConfig, max_model_len: int, target: ModelConfig, target_config: EngineConfig,
                 dtype: torch.dtype, device: torch.device, num_blocks: int) -> None:
        super().__init__(config, max_model_len)
        from cuttle.engine.llm_engine import LLMEngine  # (the engine builds this proposer)

        assert config.model is not None
        try:  # a directory, or a Hugging Face repo id in the local cache, as the target's `model`
            path = resolve_model(config.model)
        except FileNotFoundError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"speculative_config.model {config.model!r} is not a checkpoint directory (no config.json)")
        draft_mc = ModelConfig.from_pretrained(path)
        if draft_mc.vocab_size > target.vocab_size:
            raise ValueError(f"speculative_config.model's vocabulary ({draft_mc.vocab_size} tokens) is larger than the target's "
                             f"({target.vocab_size}): its proposals could be ids the target does not have")
        dtype_name = next(name for name, d in DTYPES.items() if d == dtype)  # the target's
        # as many tokens of KV as the target's pool, so every running stream fits (the draft's
        # blocks are smaller: fewer layers and heads). Small blocks: each round recomputes the
        # stream's partial last block (its full blocks are prefix-cache hits), and on a CPU a
        # multi-token step is compute-bound (measured, the 0.6B preset as its own draft: a
        # round's first draft step 93-253 ms at 16-token blocks, a decode step 48 ms)
        bs = min(DRAFT_BLOCK_SIZE, target_config.block_size)
        self.engine = LLMEngine(EngineConfig(
            model=path, dtype=dtype_name, device=str(device), block_size=bs,
            num_kv_blocks=num_blocks * target_config.block_size // bs, max_model_len=min(max_model_len, draft_mc.max_position_embeddings),
            max_num_seqs=target_config.max_num_seqs,
            max_num_batched_tokens=target_config.max_num_batched_tokens, enable_prefix_caching=True,
            skip_tokenizer_init=True, generation_config="vllm", seed=target_config.seed))
        self._drafts: dict[int, list[int]] = {}
        self._ids = itertools.count()

    def prepare(self, seqs: list[Any], drafting: bool = True) -> None:
        """Propose for every sequence in `seqs` (those decoding this step) that may take drafts:
        one batched run of the draft engine."""
        self._drafts.clear()
        if not drafting:
            return
        engine = self.engine
        asked: dict[str, int] = {}
        for seq in seqs:
            k = self.room(seq, self.config.num_speculative_tokens)
            full = seq.request.full_prompt_token_ids
            # a query over squid documents: the draft reads them laid out flat before it (prefix,
            # documents in order, query), so it sees what the target attends
            stream = list(seq.token_ids) if full is None else full + seq.output_token_ids
            k = min(k, engine.max_model_len - len(stream))  # (a draft with a shorter context)
            if k <= 0:
                continue
            rid = f"draft-{next(self._ids)}"
            req = engine.add_request(rid, stream, _draft_params(seq.request.sampling_params, k, seq.request.seed))
            req.draws_at = (seq.index, seq.num_output_tokens)  # the uniforms the target sample draws next
            asked[rid] = id(seq)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    self._drafts[asked[out.request_id]] = list(out.outputs[0].token_ids)

    def draft(self, seq: Any, k: int) -> list[int]:
        return self._drafts.pop(id(seq), [])[:k]
