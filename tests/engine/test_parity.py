"""Token-exact parity with transformers (greedy, float32), under plain batching, chunked prefill,
preemption, and prefix-cache hits."""
from __future__ import annotations

import pytest

from cuttle.engine import LLM, SamplingParams

from helpers import ARCHS, NEW_TOKENS

TOL = 1e-4

MODES = {
    "batched": dict(num_kv_blocks=256, max_num_batched_tokens=4096),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=24),
    "preempt": dict(num_kv_blocks=14, max_num_batched_tokens=64),
}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def check(outs, ref, with_prompt_logprobs: bool) -> None:
    for o, toks, lps, plps in zip(outs, ref["tokens"], ref["logprobs"], ref["prompt_logprobs"]):
        c = o.outputs[0]
        assert c.token_ids == toks
        assert c.finish_reason == "length"
        for step, (tok, want) in enumerate(zip(c.token_ids, lps)):
            assert abs(c.logprobs[step][tok].logprob - want) <= TOL
        assert abs(c.cumulative_logprob - sum(lps)) <= TOL * len(lps)
        if with_prompt_logprobs:
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
            for pos, want in enumerate(plps, start=1):
                tok = o.prompt_token_ids[pos]
                assert abs(o.prompt_logprobs[pos][tok].logprob - want) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_parity(checkpoints, arch, mode):
    ref = checkpoints[arch]
    llm = LLM(ref["path"], dtype="float32", attention_backend="torch", **MODES[mode])
    outs = llm.generate(ref["prompts"], greedy(logprobs=1, prompt_logprobs=2), use_tqdm=False)
    check(outs, ref, with_prompt_logprobs=True)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if mode == "preempt":
        assert stats["preemptions"] > 0
    if mode == "chunked":
        assert stats["steps"] > NEW_TOKENS + 10  # prompts really were split over steps


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_keep_outputs(checkpoints, arch):
    ref = checkpoints[arch]
    llm = LLM(ref["path"], dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64)
    first = llm.generate(ref["prompts"], greedy(logprobs=0), use_tqdm=False)
    computed = llm.stats()["prefill_tokens_computed"]
    second = llm.generate(ref["prompts"], greedy(logprobs=0), use_tqdm=False)
    check(first, ref, with_prompt_logprobs=False)
    check(second, ref, with_prompt_logprobs=False)
    for o in second:
        n = len(o.prompt_token_ids)
        assert o.num_cached_tokens == (n - 1) // 16 * 16
    assert sum(o.num_cached_tokens for o in second) > 0
    stats = llm.stats()
    assert stats["cached_tokens"] == sum(o.num_cached_tokens for o in second)
    assert stats["prefill_tokens_computed"] - computed == sum(len(p) for p in ref["prompts"]) - stats["cached_tokens"]
