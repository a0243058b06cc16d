"""The reference trainer: engine/trainer logprob agreement (acceptance 3), the loss's direction,
and weight push back into the engine."""
from __future__ import annotations

import math

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.sampler import truncates
from cuttle.rl import TrainBatch, Trajectory, compute_advantages, extend_trajectories, mismatch, sample_groups
from cuttle.rl.trainer import Trainer, TrainerConfig
from cuttle.rl.types import Sample


@pytest.fixture(scope="module")
def rollout(moe_path, random_prompts):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=512)
    groups = sample_groups(llm, random_prompts(8, 32, seed=11), 8, SamplingParams(temperature=1.0, seed=3, max_tokens=24))
    for g in groups:
        for i, s in enumerate(g.samples):
            s.reward = float(i % 3 == 0)
    return llm, groups


def test_mismatch_float32_8x8(moe_path, rollout):
    _, groups = rollout
    batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
    trainer = Trainer(moe_path, TrainerConfig(max_tokens_per_row=512))
    packed = batch.packed()
    m = mismatch(trainer.score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert m.num_tokens == packed.num_trained_tokens >= 8 * 8
    assert m.max_abs <= 1e-5, m
    assert m.mean_abs <= 2e-6 and 0.0 <= m.k3_kl <= 1e-10


def test_mismatch_catches_a_wrong_temperature(moe_path, rollout):
    _, groups = rollout
    batch = TrainBatch.from_groups(groups[:2], compute_advantages(groups[:2], True))
    trainer = Trainer(moe_path, TrainerConfig(temperature=0.7))
    packed = batch.packed()
    m = mismatch(trainer.score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert m.max_abs > 1e-2 and m.k3_kl > 1e-5


@pytest.mark.parametrize("trunc", [{"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.9, "min_p": 0.02}])
def test_truncated_rollouts_agree_when_the_trainer_truncates_alike(moe_path, random_prompts, trunc):
    """Rollouts sampled with top-k / top-p / min-p (and a temperature): the trainer configured with
    the same truncation scores them as the engine did (the engine's truncation_mask, renormalised);
    without it the mismatch shows."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256)
    groups = sample_groups(llm, random_prompts(3, 16, seed=21), 4,
                           SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True, **trunc))
    batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
    packed = batch.packed()
    behaviour = packed.rollout_logprobs[packed.loss_mask > 0]
    same = mismatch(Trainer(moe_path, TrainerConfig(temperature=0.8, **trunc)).score(batch), behaviour)
    assert same.num_tokens == 3 * 4 * 12 and same.max_abs <= 1e-5, same
    plain = mismatch(Trainer(moe_path, TrainerConfig(temperature=0.8)).score(batch), behaviour)
    assert plain.max_abs > 1e-2, plain


PENALTIES = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.8}, {"frequency_penalty": 0.5},
             {"repetition_penalty": 0.8, "presence_penalty": -0.4, "frequency_penalty": 0.6, "top_k": 20}]


@pytest.mark.parametrize("pen", PENALTIES)
def test_penalised_rollouts_agree_when_the_trainer_penalises_alike(moe_path, random_prompts, pen):
    """Rollouts sampled with the repetition / presence / frequency penalties, single-turn groups
    and multi-turn trajectories (each turn its own engine request, whose output the counts
    restart from): the trainer configured alike scores them as the engine did; without the
    penalties the mismatch shows."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256)
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, **pen)
    groups = sample_groups(llm, random_prompts(2, 16, seed=23), 3, sp)
    trajs = [Trajectory.start(p) for p in random_prompts(2, 14, seed=29)]
    extend_trajectories(llm, trajs, sp)
    for t in trajs:
        t.append_context([40, 41, 42])
    extend_trajectories(llm, trajs, sp)
    assert [t.sample_starts for t in trajs] == [[14, 29], [14, 29]]
    cfg = {"temperature": 0.9, **pen}
    for batch, n in [(TrainBatch.from_groups(groups, compute_advantages(groups, True)), 2 * 3 * 12),
                     (TrainBatch.from_trajectories(trajs, [1.0, -1.0], [0, 1]), 2 * 24)]:
        packed = batch.packed()
        behaviour = packed.rollout_logprobs[packed.loss_mask > 0]
        same = mismatch(Trainer(moe_path, TrainerConfig(**cfg)).score(batch), behaviour)
        assert same.num_tokens == n and same.max_abs <= 1e-5, (pen, same)
        plain = {k: v for k, v in cfg.items() if "penalty" not in k}
        assert mismatch(Trainer(moe_path, TrainerConfig(**plain)).score(batch), behaviour).max_abs > 1e-2


def test_penalties_carry_gradients_and_need_sample_starts(moe_path):
    trainer = Trainer(moe_path, TrainerConfig(repetition_penalty=1.2, frequency_penalty=0.3, lr=1e-3, grad_clip=None))
    t = Trajectory.start([5, 6, 7, 5])
    t.append_sample(Sample([6, 5, 6, 9], [-1.0] * 4, "length", 0))
    batch = TrainBatch.from_trajectories([t], [1.0], [0])
    assert batch.output_starts[0].tolist() == [-1] * 4 + [4] * 4
    before = trainer.score(batch)
    trainer.step(batch)
    assert (trainer.score(batch) - before).sum() > 0  # a positive advantage raised the sample's logprobs
    bare = Trajectory([5, 6, 7, 5, 6, 5], [0, 0, 0, 0, 1, 1], [0.0] * 6, [-1] * 4 + [0, 0])  # no append_sample: no starts
    with pytest.raises(ValueError, match="where each sample began"):
        trainer.score(TrainBatch.from_trajectories([bare], [1.0], [0]))
    rep_only = Trainer(moe_path, TrainerConfig(repetition_penalty=1.2))
    assert rep_only.score(TrainBatch.from_trajectories([bare], [1.0], [0])).numel() == 2  # needs no starts


def test_truncation_config_is_checked():
    off = TrainerConfig(top_k=0)  # 0 is off, as in SamplingParams (a rollout's params copy over as they are)
    assert not truncates(off.top_k, off.top_p, off.min_p, 1000)
    for bad, says in [({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
                      ({"frequency_penalty": -3}, "frequency_penalty"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
                      ({"top_p": 0.0}, "top_p"), ({"min_p": 1.5}, "min_p"), ({"temperature": 0.0}, "temperature")]:
        with pytest.raises(ValueError, match=says):
            TrainerConfig(**bad)


def test_multi_turn_logprobs_agree(moe_path, random_prompts):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    trajs = [Trajectory.start(p) for p in random_prompts(2, 20, seed=5)]
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True)
    extend_trajectories(llm, trajs, sp)
    for t in trajs:
        t.append_context([40, 41, 42])
    extend_trajectories(llm, trajs, sp)
    batch = TrainBatch.from_trajectories(trajs, [1.0, -1.0], [0, 0])
    packed = batch.packed()
    m = mismatch(Trainer(moe_path).score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert m.num_tokens == 32 and m.max_abs <= 1e-5


def test_step_moves_logprobs_with_the_advantage_and_push_syncs_the_engine(moe_path, rollout):
    _, groups = rollout
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=512)  # a private engine: this test updates it
    g = groups[0]
    batch = TrainBatch.from_groups([g], [[1.0] + [0.0] * 6 + [-1.0]])
    trainer = Trainer(moe_path, TrainerConfig(lr=1e-3, grad_clip=None))
    before = trainer.score(batch)
    stats = trainer.step(batch)
    after = trainer.score(batch)
    lens = batch.packed().loss_mask.view(-1).nonzero().numel()
    assert stats["mismatch_max_abs"] <= 1e-5 and stats["num_trained_tokens"] == lens
    first = slice(0, len(g.samples[0].token_ids))
    last = slice(lens - len(g.samples[-1].token_ids), lens)
    assert (after[first] - before[first]).sum() > 0, "positive advantage must raise the sample's logprob"
    assert (after[last] - before[last]).sum() < 0, "negative advantage must lower it"
    assert trainer.push_weights(llm) == 1
    # the engine now scores the same tokens as the trainer does
    again = sample_groups(llm, [g.prompt_token_ids], 8, SamplingParams(temperature=1.0, seed=3, max_tokens=24))
    assert again[0].samples[0].weight_version == 1
    b2 = TrainBatch.from_groups(again, [[0.0] * 8])
    p2 = b2.packed()
    assert mismatch(trainer.score(b2), p2.rollout_logprobs[p2.loss_mask > 0]).max_abs <= 1e-5


def test_mismatch_metric_values():
    m = mismatch(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]))
    assert m.max_abs == pytest.approx(0.5) and m.mean_abs == pytest.approx(0.25)
    assert m.k3_kl == pytest.approx((torch.tensor(0.5).exp().item() - 1 - 0.5) / 2)
    assert mismatch(torch.zeros(0), torch.zeros(0)).num_tokens == 0


def _skewed(batch: TrainBatch, trainer: Trainer, shift: float) -> TrainBatch:
    """`batch` with behaviour logprobs = the trainer's own minus `shift` (ratio exp(shift) on every token)."""
    packed = batch.packed()
    rollout = packed.rollout_logprobs.clone()
    rollout[packed.loss_mask > 0] = trainer.score(batch) - shift
    packed.rollout_logprobs = rollout
    return packed


def _params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.params])


def test_behaviour_logprobs_are_the_old_policy_so_the_clip_binds(moe_path, rollout):
    _, groups = rollout
    g = groups[1]
    trainer = Trainer(moe_path, TrainerConfig(lr=1e-3, grad_clip=None))
    # the policy has moved to ratio 1.5 > 1 + 0.2 since sampling: with A > 0 every token is clipped
    up = _skewed(TrainBatch.from_groups([g], [[1.0] * 8]), trainer, math.log(1.5))
    before = _params(trainer)
    stats = trainer.step(up)
    assert stats["clip_frac"] == 1.0 and stats["grad_norm"] == 0.0
    assert torch.equal(_params(trainer), before), "a fully clipped batch must not move the weights"
    # A < 0: min() keeps the unclipped term, the gradient flows (ratio 1.5 times the on-policy one)
    down = _skewed(TrainBatch.from_groups([g], [[-1.0] * 8]), trainer, math.log(1.5))
    stats = trainer.step(down)
    assert stats["clip_frac"] == 0.0 and stats["grad_norm"] > 0
    assert not torch.equal(_params(trainer), before)


def test_start_of_step_old_policy_ignores_the_behaviour_gap(moe_path, rollout):
    _, groups = rollout
    trainer = Trainer(moe_path, TrainerConfig(lr=1e-3, grad_clip=None, old_policy="start"))
    up = _skewed(TrainBatch.from_groups([groups[1]], [[1.0] * 8]), trainer, math.log(1.5))
    before = _params(trainer)
    stats = trainer.step(up)
    # ratio 1 against the start-of-step policy: nothing clipped, the weights move
    assert stats["clip_frac"] == 0.0 and stats["grad_norm"] > 0
    assert not torch.equal(_params(trainer), before)
    assert stats["mismatch_max_abs"] == pytest.approx(math.log(1.5), abs=1e-5)


def test_minibatches_take_one_optimizer_step_each(moe_path, rollout):
    _, groups = rollout
    batch = TrainBatch.from_groups(groups[:2], compute_advantages(groups[:2], True))
    trainer = Trainer(moe_path, TrainerConfig(lr=1e-3, minibatches=2))
    stats = trainer.step(batch)
    assert trainer.optimizer.state[trainer.params[0]]["step"].item() == 2
    assert stats["mismatch_max_abs"] <= 1e-5 and stats["mismatch_num_tokens"] == batch.packed().num_trained_tokens
    with pytest.raises(ValueError, match="old_policy"):
        TrainerConfig(old_policy="current")


def test_a_non_finite_batch_trains_nothing(moe_path, rollout):
    """NaN advantages (a batch built around the reward check) are refused before any step: the
    weights stay as they were (they all became NaN, and a push then made the engine sample garbage)."""
    _, groups = rollout
    batch = TrainBatch.from_groups(groups[:2], [[float("nan")] * len(g.samples) for g in groups[:2]])
    trainer = Trainer(moe_path)
    before = [p.detach().clone() for p in trainer.params]
    with pytest.raises(ValueError, match="advantages hold a non-finite value"):
        trainer.step(batch)
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))
