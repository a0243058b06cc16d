"""Group sampling on shared prompt KV (acceptance 1) and turn-by-turn trajectories."""
from __future__ import annotations

import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.rl import Trajectory, extend_trajectories, sample_groups


def test_groups_prefill_each_prompt_once_and_samples_differ(moe_path, random_prompts):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=512)
    prompts = random_prompts(8, 256, seed=1)
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    before = llm.stats()["prefill_tokens_computed"]
    groups = sample_groups(llm, prompts, 8, sp, metadata=[{"i": i} for i in range(8)])
    computed = llm.stats()["prefill_tokens_computed"] - before
    block = llm.engine.block_manager.block_size
    assert 8 * 256 <= computed <= 8 * (256 + block)
    assert [g.metadata["i"] for g in groups] == list(range(8))
    for g, p in zip(groups, prompts):
        assert g.prompt_token_ids == p
        assert len(g.samples) == 8
        assert len({tuple(s.token_ids) for s in g.samples}) == 8, "a group's samples must differ"
        for s in g.samples:
            assert len(s.token_ids) == len(s.logprobs) == 8
            assert s.weight_version == 0 and s.finish_reason == "length"
            assert all(lp <= 0.0 for lp in s.logprobs)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_independent_requests_prefill_every_sample(moe_path, random_prompts):
    """The control for the test above: without n, the prompt is computed once per sample."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    p = random_prompts(1, 256, seed=2)[0]
    llm.generate([p] * 4, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["prefill_tokens_computed"] == 4 * 256


def test_trajectory_extends_turn_by_turn_without_retokenizing(moe_path, random_prompts):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256)
    prompt = random_prompts(1, 40, seed=3)[0]
    tool_output = [7, 8, 9, 10, 11]
    sp = SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    traj = Trajectory.start(prompt)
    first = extend_trajectories(llm, [traj], sp)[0]
    traj.append_context(tool_output)
    cached_before = llm.stats()["cached_tokens"]
    second = extend_trajectories(llm, [traj], sp)[0]
    # the second turn's prompt is the first turn's stream: its full blocks come from the prefix cache
    assert llm.stats()["cached_tokens"] - cached_before >= 32
    assert traj.token_ids == prompt + first.token_ids + tool_output + second.token_ids
    assert traj.loss_mask == [0] * 40 + [1] * 6 + [0] * 5 + [1] * 6
    assert traj.logprobs == [0.0] * 40 + first.logprobs + [0.0] * 5 + second.logprobs
    assert traj.weight_versions == [-1] * 40 + [0] * 6 + [-1] * 5 + [0] * 6
    assert traj.num_turns == 2 and traj.prompt_length == 40


def test_metadata_must_match_prompts(moe_path, random_prompts):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="metadata"):
        sample_groups(llm, random_prompts(2, 8), 2, SamplingParams(max_tokens=2), metadata=[{}])
