"""n samples fork from one prefilled prompt; seeds are per request and batch-invariant."""
from __future__ import annotations

import random

from cuttle.engine import LLM, SamplingParams


def prompt(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def test_n8_prefills_prompt_once_and_repeats_with_seed(qwen3_path):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=256)
    p = prompt(200)
    sp = SamplingParams(n=8, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, logprobs=0)
    before = llm.stats()["prefill_tokens_computed"]
    out = llm.generate([p], sp, use_tqdm=False)[0]
    grew = llm.stats()["prefill_tokens_computed"] - before
    assert grew <= 200 + 16
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert [c.index for c in out.outputs] == list(range(8))
    assert len(set(seqs)) == 8, "samples of one request must differ"
    assert all(len(s) == 24 for s in seqs)
    # every sample's logprob is the log-probability of its own token under its own distribution
    for c in out.outputs:
        assert all(c.token_ids[i] in c.logprobs[i] for i in range(24))
        assert abs(c.cumulative_logprob - sum(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids))) < 1e-4
    again = llm.generate([p], sp, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_seeded_output_is_independent_of_batch(qwen3_path):
    p = prompt(40, seed=3)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=5, max_tokens=20, ignore_eos=True)
    alone = LLM(qwen3_path, dtype="float32", num_kv_blocks=128).generate([p], sp, use_tqdm=False)[0]
    crowd = LLM(qwen3_path, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32)
    others = [prompt(30 + i, seed=100 + i) for i in range(5)]
    mixed = crowd.generate(others[:3] + [p] + others[3:], [SamplingParams(temperature=1.0, max_tokens=15)] * 3 + [sp] + [SamplingParams(temperature=1.0, max_tokens=15)] * 2, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone.outputs[0].token_ids


def test_unseeded_requests_differ(qwen3_path):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=128)
    p = prompt(20)
    outs = llm.generate([p, p], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_cache_writes_are_the_prompt_blocks_a_request_adds_to_the_prefix_cache(qwen3_path):
    """RequestOutput.num_cache_written_tokens (the Responses API's cache_write_tokens): the prompt
    tokens, in full blocks, that a request computed and put in the prefix cache. A fresh prompt
    writes its full blocks; the same prompt again hits them and writes nothing (its last block,
    recomputed for the last token, is already cached); a longer one writes only its new blocks;
    n samples write the shared prompt once."""
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=256, block_size=16)
    p = prompt(100, seed=9)  # 6 full blocks and 4 tokens
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # its outputs fill blocks too: not prompt
    first = llm.generate([p], sp, use_tqdm=False)[0]
    assert (first.num_cached_tokens, first.num_cache_written_tokens) == (0, 96)
    again = llm.generate([p], sp, use_tqdm=False)[0]
    assert (again.num_cached_tokens, again.num_cache_written_tokens) == (96, 0)
    longer = llm.generate([p + prompt(60, seed=10)], sp, use_tqdm=False)[0]  # 160 tokens: 10 full blocks
    assert (longer.num_cached_tokens, longer.num_cache_written_tokens) == (96, 64)
    group = llm.generate([prompt(64, seed=11)], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)[0]
    assert (group.num_cached_tokens, group.num_cache_written_tokens) == (0, 64)
    off = LLM(qwen3_path, dtype="float32", num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    assert off.generate([p], sp, use_tqdm=False)[0].num_cache_written_tokens == 0
