"""Blocks given back behind a sliding window (`BlockManager.release_behind_window`).

A model whose every layer has a window W (Mistral-7B-v0.1, StarCoder2) never reads a key W or more
positions behind its query again, so the engine gives those blocks back as a sequence moves on
and a sequence holds about W / block_size blocks however long it runs. Checked on a tiny windowed
Mistral: outputs are bit-identical to keeping every block (greedy and seeded sampling with n = 2,
chunked prefill, preemption, prefix-cache hits, sessions, n-gram drafts), and the KV of every free
block is overwritten with NaN after each step, so a read of a given-back block fails the run;
sequences hold at most the window's blocks, so long generations that preempt one another with
every block kept run side by side without a preemption.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuttle.attention.metadata import NULL_BLOCK
from cuttle.engine import LLM, SamplingParams
from helpers import assert_scored_by_transformers, interleaving_ops, run_interleaving, save_checkpoint, tiny_mistral

BS = 4
_ids = itertools.count()
WINDOW = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(str(tmp_path_factory.mktemp("mistral-window-blocks")), tiny_mistral(WINDOW))


@pytest.fixture(scope="module")
def mistral(checkpoint):
    return checkpoint[0]


def _prompts() -> list[list[int]]:
    return [[3 + (7 * i + 11 * j) % 250 for i in range(n)] for j, n in enumerate((5, 23, 47, 64))]


def _run(llm: LLM, requests, poison: bool = False, check=None) -> list:
    """Each (prompt, params) through `llm`'s engine step by step; after every step the block
    invariants hold and (`poison`) every free block's KV is NaN."""
    eng = llm.engine
    ids = [eng.add_request(f"r{next(_ids)}", prompt, params).request_id for prompt, params in requests]
    done: dict[str, object] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        bm = eng.block_manager
        live = [s for s in (*eng.scheduler.running, *eng.scheduler.waiting) if s.block_table or s.handles]
        bm.check_invariants(live, eng.sessions.pins())
        if check is not None:
            check(eng)
        if poison and bm.free:
            free = torch.tensor(list(bm.free))
            eng.runner.kv.tensor[:, :, free] = float("nan")
    return [done[i] for i in ids]


def _tokens(outs) -> list:
    return [[(c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]) for c in o.outputs] for o in outs]


def _requests():
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, n=2, seed=5, max_tokens=33, ignore_eos=True, logprobs=0)
    return [(p, greedy if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]


def _llm(path: str, keep: bool = False, **kw) -> LLM:
    kw = {"dtype": "float32", "block_size": BS, "num_kv_blocks": 160, "max_num_batched_tokens": 16, "batch_invariant": True, **kw}
    llm = LLM(path, **kw)
    assert llm.engine.block_manager.window == WINDOW  # every layer windowed, on the torch backend
    if keep:
        llm.engine.block_manager.window = None
    return llm


def _max_held(eng) -> int:
    return max((sum(b != NULL_BLOCK for b in s.block_table) for s in eng.scheduler.running), default=0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_given_back_blocks_change_no_output_and_are_never_read(mistral, prefix_caching):
    """Chunked prefill (16-token budget), decode far past W, greedy and seeded n = 2: outputs are
    bit-identical to keeping every block; with the prefix cache off every free block is NaN after
    each step (with it on a free block may be found again by a hit, so it keeps its KV)."""
    want = _tokens(_run(_llm(mistral, keep=True, enable_prefix_caching=prefix_caching), _requests()))
    llm = _llm(mistral, enable_prefix_caching=prefix_caching)
    held: list[int] = []
    got = _tokens(_run(llm, _requests(), poison=not prefix_caching, check=lambda e: held.append(_max_held(e))))
    assert got == want
    bm = llm.engine.block_manager
    assert bm.num_window_released_blocks > 0
    # a sequence holds the blocks of its window (W - 1 keys behind the next query, that query's
    # block, and with the prefix cache the block before, kept for the hash chain) and its drafts
    assert max(held) <= -(-(WINDOW - 1) // BS) + 2 + int(prefix_caching)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_long_generations_fit_side_by_side(mistral):
    """4 sequences of 120 tokens in a pool of 60 blocks of 4: keeping every block they need 120
    and preempt one another; giving back what the window left they run without a preemption,
    with the same outputs."""
    reqs = [([5 + i, 9, 13 + i], SamplingParams(temperature=0, max_tokens=117, ignore_eos=True, logprobs=0)) for i in range(4)]
    kept = _llm(mistral, keep=True, num_kv_blocks=60)
    want = _tokens(_run(kept, reqs))
    assert kept.stats()["preemptions"] > 0
    llm = _llm(mistral, num_kv_blocks=60)
    assert _tokens(_run(llm, reqs, poison=True)) == want
    assert llm.stats()["preemptions"] == 0
    assert llm.stats()["kv_window_released_blocks"] == llm.engine.block_manager.num_window_released_blocks > 4 * 20


def test_preempted_sequences_come_back_exactly(mistral):
    """A pool too small for the group even with windows (8 short prompts admitted at once, each
    growing to a window's blocks): sequences are preempted and recomputed (their given-back blocks
    included), outputs unchanged."""
    reqs = [([5 + i, 9, 13 + i], SamplingParams(temperature=0.8, seed=i, max_tokens=60, ignore_eos=True, logprobs=0))
            for i in range(8)]
    want = _tokens(_run(_llm(mistral, keep=True, num_kv_blocks=30, enable_prefix_caching=False), reqs))
    llm = _llm(mistral, num_kv_blocks=30, enable_prefix_caching=False)
    assert _tokens(_run(llm, reqs, poison=True)) == want
    assert llm.stats()["preemptions"] > 0


def test_priority_scheduling_with_windows(mistral):
    """Under the priority policy a prefill chunk that cannot get its blocks preempts by priority
    as a decode does (victims scheduled earlier in the step give their budget back): outputs equal
    keeping every block, preemptions on both sides."""
    reqs = [([5 + i, 9, 13 + i] * (1 + i * 3), SamplingParams(temperature=0.7, seed=i, max_tokens=50, ignore_eos=True))
            for i in range(8)]

    def run(keep: bool):
        llm = _llm(mistral, keep=keep, num_kv_blocks=40, scheduling_policy="priority", enable_prefix_caching=False)
        eng = llm.engine
        ids = [eng.add_request(f"p{next(_ids)}", p, sp, priority=i % 3).request_id for i, (p, sp) in enumerate(reqs)]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            eng.block_manager.check_invariants([s for r in eng.requests.values() for s in r.seqs if not s.is_finished])
        return [done[i] for i in ids], llm.stats()["preemptions"]

    (want, kept_preemptions), (got, preemptions) = run(True), run(False)
    assert got == want and kept_preemptions > 0 and preemptions > 0


def test_given_back_blocks_stay_in_the_prefix_cache(mistral):
    """A long prompt's blocks behind the window go back to the free list hashed: the same prompt
    later hits every full block of it, and its outputs are unchanged. Once other requests have
    evicted the oldest of them (they went back first), it still hits all of them: a hit needs only
    the blocks its window keeps (vLLM's rule), the rest of its table NULL."""
    prompt = _prompts()[3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    llm = _llm(mistral, num_kv_blocks=24)
    [first] = _run(llm, [(prompt, params)])
    bm = llm.engine.block_manager
    assert bm.num_window_released_blocks > 0
    [again] = _run(llm, [(prompt, params)])
    assert again.num_cached_tokens == (len(prompt) - 1) // BS * BS
    assert _tokens([again]) == _tokens([first])
    _run(llm, [([200 + i % 50 for i in range(48)], SamplingParams(max_tokens=1))])  # evicts the oldest free blocks
    assert bm.prefix_index.match(prompt, 1, b"") == []  # the chain's first block is gone
    seen: list[list[int]] = []
    [third] = _run(llm, [(prompt, params)], check=lambda e: seen.append(list(e.scheduler.running[0].block_table))
                   if e.scheduler.running else None)
    assert third.num_cached_tokens == (len(prompt) - 1) // BS * BS and seen[0][0] == NULL_BLOCK
    assert _tokens([third]) == _tokens([first])


def test_sessions_and_drafts_over_given_back_blocks(mistral):
    """A multi-turn session runs past W turn after turn (its pins hold only the window's blocks),
    and n-gram drafts run past W: both as with every block kept."""
    def session_run(llm: LLM) -> list:
        sid = llm.open_session(_prompts()[2])
        outs = []
        for k in range(3):
            outs.append(llm.generate_session(sid, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=0))[0])
            llm.append_to_session(sid, [7 + k, 8, 9])
        pins = llm.engine.sessions.table[sid].handle.blocks
        llm.close_session(sid)
        return [*_tokens(outs), pins]

    *want, all_pins = session_run(_llm(mistral, keep=True))
    *got, pins = session_run(llm := _llm(mistral))
    assert got == want
    assert NULL_BLOCK not in all_pins and sum(b != NULL_BLOCK for b in pins) <= -(-WINDOW // BS) + 2 < len(pins)
    llm.engine.block_manager.check_invariants([])
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    rep = [4, 5, 6, 7, 8] * 10
    reqs = [(rep, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=0))]
    want = _tokens(_run(_llm(mistral, keep=True, speculative_config=spec), reqs))
    llm = _llm(mistral, speculative_config=spec)
    assert _tokens(_run(llm, reqs)) == want
    assert llm.stats()["spec_accepted_tokens"] > 0 and llm.engine.block_manager.num_window_released_blocks > 0


def test_a_prompt_longer_than_the_pool_runs_through_a_window_of_blocks(checkpoint):
    """12 blocks of 4 (48 tokens) serve a 150-token prompt and 40 more tokens, chunked (16 a step):
    max_model_len is the model's, each chunk gets its blocks when scheduled, and outputs and
    prompt logprobs equal transformers' windowed forward (1e-4, float32). Two such requests at
    once take turns (preemption), also exactly."""
    path, model = checkpoint
    llm = _llm(path, num_kv_blocks=12)
    assert llm.engine.max_model_len == 1024  # the model's max_position_embeddings, past the pool's 48 tokens
    prompts = [[3 + (5 * i + j * 7) % 250 for i in range(150)] for j in range(2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    held: list[int] = []
    [out] = _run(llm, [(prompts[0], params)], poison=True, check=lambda e: held.append(_max_held(e)))
    assert_scored_by_transformers(model, prompts[0], out, 1e-4)
    assert max(held) <= 12 and llm.engine.block_manager.num_window_released_blocks >= (190 - WINDOW) // BS - 2
    outs = _run(llm, [(p, params) for p in prompts], poison=True)
    for p, o in zip(prompts, outs):
        assert_scored_by_transformers(model, p, o, 1e-4)
    assert llm.stats()["kv_blocks_free"] == 12


def test_pool_limits_under_windows(mistral):
    """max_model_len past the pool is taken once the pool holds a window's blocks (and a chunk
    shrinks to what is free); below that, or with KV tiers (whose loads land in blocks taken at
    admission), the pool bounds it as for any model, refused naming both."""
    assert _llm(mistral, num_kv_blocks=7, max_model_len=1000).engine.max_model_len == 1000
    with pytest.raises(ValueError, match=r"max_model_len \(1000\) needs 250 KV blocks of 4 tokens, and the pool has 6"):
        LLM(mistral, dtype="float32", block_size=BS, num_kv_blocks=6, max_model_len=1000)
    assert LLM(mistral, dtype="float32", block_size=BS, num_kv_blocks=6).engine.max_model_len == 24
    tiered = _llm(mistral, num_kv_blocks=40, num_host_kv_blocks=40)
    assert tiered.engine.max_model_len == 160
    # with tiers the blocks behind the window are still given back (and offloaded as they are evicted)
    reqs = [(list(range(3, 80)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0))]
    want = _tokens(_run(_llm(mistral, keep=True), reqs))
    assert _tokens(_run(tiered, reqs)) == want
    assert tiered.engine.block_manager.num_window_released_blocks > 0


_OPS = interleaving_ops(max_prompt=70, max_tokens=50, max_steps=4, max_size=25)
_POOLS: dict[tuple[int, bool], LLM] = {}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=_OPS, num_blocks=st.integers(7, 24), prefix_caching=st.booleans(), shared=st.booleans())
def test_random_interleavings_never_leak(mistral, ops, num_blocks, prefix_caching, shared):
    """add (prompts up to 70 tokens in pools of 28 .. 96, shared prefixes or not, n up to 3) /
    step / abort in any order: every block's references are its holders' after each operation,
    and every block is free at the end."""
    key = (num_blocks, prefix_caching)
    if key not in _POOLS:  # (one engine per pool: the pool is empty between examples)
        _POOLS[key] = _llm(mistral, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching, max_num_seqs=6)
    run_interleaving(_POOLS[key].engine, ops, list(range(5, 40)), shared)


def test_only_models_windowed_in_every_layer_give_blocks_back(tmp_path):
    """Qwen2 with its first layer unwindowed reads every key there: nothing is given back."""
    import transformers

    from helpers import write_tokenizer

    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=1, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    write_tokenizer(str(tmp_path), 256)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=BS)
    assert llm.engine.block_manager.window is None
    llm.generate([list(range(3, 40))], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.engine.block_manager.num_window_released_blocks == 0
