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


def test_truncated_prompts_are_recorded_as_sampled_and_the_trainer_agrees(moe_path, random_prompts):
    """truncate_prompt_tokens: the engine sampled from the last k prompt ids while the group
    recorded all of them, so the trainer scored the completion under context the engine never saw
    (|delta logprob| up to 4). The group now records the kept ids; the trainer's logprobs equal the
    engine's."""
    from cuttle.rl import TrainBatch, mismatch
    from cuttle.rl.trainer import Trainer

    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    prompts = random_prompts(2, 20, seed=1)
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=4)
    groups = sample_groups(llm, prompts, 3, sp)
    assert [g.prompt_token_ids for g in groups] == [p[-4:] for p in prompts]
    batch = TrainBatch.from_groups(groups, [[0.0] * 3] * 2)
    packed = batch.packed()
    gap = mismatch(Trainer(moe_path).score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert gap.max_abs < 1e-4, gap
    for bad in (-1,):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            sample_groups(llm, prompts, 2, SamplingParams(max_tokens=2, truncate_prompt_tokens=bad))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        extend_trajectories(llm, [Trajectory.start(prompts[0])], SamplingParams(max_tokens=2, truncate_prompt_tokens=4))


def test_seeded_trajectories_each_get_their_own_draws(moe_path, random_prompts):
    """With one seed, every trajectory of extend_trajectories drew the same uniforms: copies of one
    prompt came out identical. Each has its own seed now, the same on a rerun."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    [p] = random_prompts(1, 12, seed=3)
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    first = [t.token_ids for t in extend_trajectories(llm, [Trajectory.start(p) for _ in range(6)], sp)]
    again = [t.token_ids for t in extend_trajectories(llm, [Trajectory.start(p) for _ in range(6)], sp)]
    assert first == again and len({tuple(t) for t in first}) == 6


def test_groups_aborted_by_a_weight_update_are_sampled_again():
    """A weight update with in_flight="abort" while a served engine samples (a trainer pushing
    during rollouts) ended requests with finish_reason "abort", and sample_groups returned those
    half-sampled groups to be rewarded and trained. They are sampled again, whole, under the new
    weights; a group aborted every time is an error."""
    from cuttle.rl.types import Sample

    class Sampler:  # the first call aborts prompt 1's group half way (weights 0 -> 1 meanwhile)
        def __init__(self, aborts: int):
            self.calls, self.aborts = [], aborts

        def generate_tokens(self, prompts, params):
            self.calls.append([list(p) for p in prompts])
            out = []
            for p in prompts:
                cut = p == [7, 8] and len(self.calls) <= self.aborts
                out.append([Sample([1] if cut else [1, 2], [-0.1] if cut else [-0.1, -0.2], "abort" if cut else "length",
                                   0 if cut else 1) for _ in range(params.n)])
            return out

    s = Sampler(aborts=1)
    groups = sample_groups(s, [[5, 6], [7, 8]], 3, SamplingParams(max_tokens=2))
    assert s.calls == [[[5, 6], [7, 8]], [[7, 8]]]
    assert all(x.finish_reason == "length" and x.token_ids == [1, 2] for g in groups for x in g.samples)
    with pytest.raises(RuntimeError, match="aborted"):
        sample_groups(Sampler(aborts=10), [[7, 8]], 2, SamplingParams(max_tokens=2))
