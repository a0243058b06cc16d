"""Shared by the KV-tier tests (tests/engine/test_kv_tiers*.py): multi-turn sessions and
concurrent decodes over small engines, and the checks that every tier ends empty."""
from __future__ import annotations

import random

from cuttle.engine import LLM, SamplingParams


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _result(out):
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


def _sessions(n_sessions: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """New user tokens per turn per session (the prompt of a turn is the whole history)."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, 256) for _ in range(rng.randrange(6, 14))] for _ in range(turns)] for _ in range(n_sessions)]


def _run_sessions(llm: LLM, sessions, params=GREEDY) -> list:
    """Round-robin over the sessions, one request at a time: each turn resumes a history whose
    KV the other sessions pushed out of a small device pool."""
    history = [[] for _ in sessions]
    results = []
    for t in range(len(sessions[0])):
        for s, turns in enumerate(sessions):
            prompt = history[s] + turns[t]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            toks, lps = _result(out)
            results.append((toks, lps))
            history[s] = prompt + toks
    return results


def _small(path: str, dtype: str = "float32", **kw) -> LLM:
    blocks = kw.pop("num_kv_blocks", 24)
    # 96 positions, or what a smaller pool holds (an explicit max_model_len the pool cannot hold is refused)
    return LLM(path, dtype=dtype, block_size=4, num_kv_blocks=blocks, max_model_len=kw.pop("max_model_len", min(96, 4 * blocks)), **kw)


def _all_free(llm: LLM) -> None:
    engine = llm.engine
    engine.tiers.drain()
    engine.block_manager.check_invariants([])
    st_ = llm.stats()
    assert st_["kv_blocks_free"] == st_["kv_blocks_total"]
    assert st_["kv_host_blocks_free"] == st_["kv_host_blocks_total"]


def _favor_copy(llm: LLM) -> LLM:
    """The tiny test model sits near the cost model's break-even (a few kFLOP per token against a
    thread hand-off per copy), where the measured rates decide by noise: pin them."""
    cost = llm.engine.tiers.cost
    cost.copy_latency_s, cost.copy_bytes_per_s = 0.0, 1e12
    return llm


def _concurrent(llm: LLM, params=None):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (22, 25, 19)]
    params = params or SamplingParams(temperature=0, max_tokens=36, ignore_eos=True, logprobs=0)
    return [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_all_read_in_place(llm: LLM, ref_llm: LLM) -> None:
    """Every host hit of `llm` was read in place (nothing copied in), and it computed no more
    prefill than `ref_llm` (the large pool); every block of both tiers is free afterwards."""
    st_ = llm.stats()
    assert st_["kv_offloaded_blocks"] > 0 and st_["kv_read_in_place_blocks"] > 0
    assert st_["kv_read_in_place_blocks"] == st_["kv_host_hit_blocks"] and st_["kv_copy_in_runs"] == 0
    assert st_["kv_bytes_host_to_device"] == 0  # nothing was copied in
    assert st_["prefill_tokens_computed"] == ref_llm.stats()["prefill_tokens_computed"]
    _all_free(llm)
