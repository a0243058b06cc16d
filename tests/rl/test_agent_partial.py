"""Partial rollouts and over-sampling in the in-process agent loop (issue 17, stragglers): a step
returns once enough groups are complete without waiting for a straggler; with `partial` the
straggler is carried (its environment open, its tool call still running) and the next step
resumes it, its tokens carrying the weight version of each turn; without, it is aborted and its
environment closed. The trainer sees the per-token versions and reports stale tokens apart."""
from __future__ import annotations

import time

import pytest
import torch
from agent_scripts import FakeEnvironment, ScriptedSampler, call

from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.agent import AgentConfig, AgentRollout, agent_batch

PARAMS = SamplingParams(temperature=1.0)
SCRIPT = {"Task fake/": [call("look"), "done"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


class Envs:
    """Fake environments whose `slow` seeds take `delay` seconds per tool call; keeps them all."""

    def __init__(self, slow: set[int], delay: float):
        self.slow, self.delay, self.made = slow, delay, []

    def __call__(self, spec):
        env = FakeEnvironment(spec, delay=self.delay if spec["seed"] in self.slow else 0.0)
        self.made.append(env)
        return env


def sampled_versions(e) -> list[int]:
    return [v for v, m in zip(e.trajectory.weight_versions, e.trajectory.loss_mask) if m]


def make(tok, envs, wait_s=0.05):
    sampler = ScriptedSampler(tok, SCRIPT)
    runner = AgentRollout(sampler, envs, AgentConfig(turn_wait_s=wait_s), tokenizer=tok, eos_token_ids=sampler.eos_token_ids)
    return sampler, runner


def test_partial_step_returns_without_the_straggler_and_the_next_step_resumes_it(tok):
    envs = Envs(slow={1}, delay=2.0)
    sampler, runner = make(tok, envs)
    try:
        t0 = time.monotonic()
        step1 = runner.step([{"seed": i} for i in range(4)], 2, PARAMS, groups_needed=3, partial=True)
        assert time.monotonic() - t0 < 1.5, "the step must not wait for a 2 s tool call"
        assert sorted(g.spec["seed"] for g in step1.groups) == [0, 2, 3] and step1.carried == 1 and not step1.aborted
        assert all(e.finish == "answered" and e.reward == 1.0 and sampled_versions(e) == [0] * len(sampled_versions(e))
                   for g in step1.groups for e in g.episodes)
        [carried] = runner.carried
        assert all(e.pending is not None and e.env is not None and len(e.turns) == 1 for e in carried.episodes)
        straggler_envs = [env for env in envs.made if env.spec["seed"] == 1]
        assert [env.closed for env in envs.made if env.spec["seed"] != 1] == [True] * 6
        assert [env.closed for env in straggler_envs] == [False, False]
        sampler.update_weights([("w", torch.ones(1))])  # the trainer's step between the two rollout steps
        step2 = runner.step([{"seed": 4}], 2, PARAMS, groups_needed=2, partial=True)
        assert [g.spec["seed"] for g in step2.groups] == [1, 4] and step2.carried == 0  # the carried group first
        resumed = step2.groups[0]
        for e in resumed.episodes:
            assert (e.finish, e.reward, len(e.turns)) == ("answered", 1.0, 2)
            assert e.turns[0].results[0].content.startswith("look ok")  # its tool call was not lost
            versions = sampled_versions(e)
            first_turn = len(tok.encode(call("look"), add_special_tokens=False)) + 1
            assert versions == [0] * first_turn + [1] * (len(versions) - first_turn)  # each turn its own version
        assert all(env.closed for env in envs.made)
        # the trainer's view: per-token versions in the batch, the stale ones counted
        batch, counts = agent_batch(step2.groups, scale_by_std=False)
        assert counts["kept"] == 4
        tv = batch.token_versions[batch.loss_mask > 0]
        assert set(tv.tolist()) == {0, 1} and (batch.token_versions[batch.loss_mask == 0] == -1).all()
        assert batch.weight_version.tolist() == [0, 0, 1, 1]
        packed = batch.packed()
        assert torch.equal(packed.token_versions[packed.loss_mask > 0], tv)
    finally:
        runner.close()


def test_over_sampling_aborts_the_straggler_and_closes_its_environment(tok):
    envs = Envs(slow={2}, delay=8.0)
    _, runner = make(tok, envs)
    try:
        t0 = time.monotonic()
        step = runner.step([{"seed": i} for i in range(3)], 2, PARAMS, groups_needed=2)
        assert time.monotonic() - t0 < 5
        assert sorted(g.spec["seed"] for g in step.groups) == [0, 1] and step.carried == 0 and not runner.carried
        [cut] = step.aborted
        assert [(e.finish, e.pending, e.env) for e in cut.episodes] == [("aborted", None, None)] * 2
        batch, counts = agent_batch(step.groups + step.aborted, scale_by_std=False)
        assert counts == {"kept": 4, "filtered": 0, "failed": 2}
        assert all(env.closed for env in envs.made)
    finally:
        runner.close()


def test_carried_groups_are_closed_when_dropped(tok):
    envs = Envs(slow={0}, delay=8.0)
    _, runner = make(tok, envs)
    step = runner.step([{"seed": 0}, {"seed": 1}], 1, PARAMS, groups_needed=1, partial=True)
    assert [g.spec["seed"] for g in step.groups] == [1] and step.carried == 1
    assert [env.closed for env in envs.made] == [False, True]
    t0 = time.monotonic()
    runner.close()  # drops the carried group: its call is abandoned, its environment closed
    assert time.monotonic() - t0 < 2 and all(env.closed for env in envs.made)


def test_lockstep_without_turn_wait_waits_for_every_call(tok):
    envs = Envs(slow={1}, delay=0.6)
    sampler, runner = make(tok, envs, wait_s=None)
    try:
        step = runner.step([{"seed": 0}, {"seed": 1}], 1, PARAMS, groups_needed=1)
        # lockstep: the fast episode's second turn waited for the slow call, so both were complete
        assert sorted(g.spec["seed"] for g in step.groups) == [0, 1] and not step.aborted
        assert sampler.calls == [(2, 1), (2, 1)]
    finally:
        runner.close()


def test_step_refuses_an_impossible_groups_needed(tok):
    _, runner = make(tok, Envs(set(), 0.0))
    try:
        with pytest.raises(ValueError, match="groups_needed must be in 1..2"):
            runner.step([{"seed": 0}, {"seed": 1}], 1, PARAMS, groups_needed=3)
    finally:
        runner.close()
