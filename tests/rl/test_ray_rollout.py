"""Agent rollouts on Ray under one controller (issue 17, acceptance 3 and 4), on a local 2-CPU
cluster started and stopped by this module: over-sampling finishes a step without its stragglers
and releases their environments, a worker killed mid-step loses no group, weight updates reach
every worker with one version, and a group's prompt is prefilled once, on the worker that runs it."""
from __future__ import annotations

import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

import agent_scripts  # noqa: E402
from agent_scripts import FakeEnvironment, ScriptedSampler, call  # noqa: E402

from cuttle.engine import LLM, SamplingParams  # noqa: E402
from cuttle.engine.default_model import default_model_path  # noqa: E402
from cuttle.engine.tokenizer import Tokenizer  # noqa: E402
from cuttle.rl.agent import AgentConfig  # noqa: E402
from cuttle.rl.ray_rollout import RayRollout  # noqa: E402

PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # the scripted policies live in test files the workers cannot import: ship them by value
    ray.cloudpickle.register_pickle_by_value(agent_scripts)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def scripted():
    tok = Tokenizer(default_model_path())
    sampler = ScriptedSampler(tok, {"Task fake/": [call("look"), "done"]})
    return sampler, tok, sampler.eos_token_ids


def slow_env(spec):
    return FakeEnvironment(spec, delay=spec.get("delay", 0.0))


def test_oversampling_finishes_without_stragglers_and_releases_them(cluster):
    rollout = RayRollout(2, scripted, slow_env, num_cpus=0.5)
    try:
        specs = [{"seed": i, "delay": 60.0 if i in (1, 4) else 0.05} for i in range(6)]
        res = rollout.run_step(specs, 2, PARAMS, groups_needed=4, timeout_s=45)
        assert res.seconds < 30, "the step must not wait for a 60 s tool call"
        assert sorted(res.group_ids) == [0, 2, 3, 5] and res.aborted == [1, 4] and res.retried == []
        for g in res.groups:
            assert [(e.finish, e.reward, len(e.turns)) for e in g.episodes] == [("answered", 1.0, 2)] * 2
        t0 = time.monotonic()
        rollout.drain(timeout_s=20)
        assert time.monotonic() - t0 < 15, "aborted groups stop while waiting on their tool call"
        assert [(s["open_envs"], s["running_groups"]) for s in rollout.stats()] == [(0, 0), (0, 0)]
    finally:
        rollout.shutdown()


def test_partial_rollouts_carry_stragglers_into_the_next_step_with_their_versions(cluster):
    import torch

    rollout = RayRollout(2, scripted, slow_env, num_cpus=0.5)
    try:
        specs = [{"seed": i, "delay": 4.0 if i == 1 else 0.05} for i in range(4)]
        res = rollout.run_step(specs, 2, PARAMS, groups_needed=3, partial=True, timeout_s=30)
        assert res.seconds < 3.5, "the step must not wait for a 4 s tool call"
        assert sorted(res.group_ids) == [0, 2, 3] and res.aborted == [] and res.carried == rollout.carried == 1
        assert sum(s["running_groups"] for s in rollout.stats()) == 1  # still running on its worker
        with pytest.raises(ValueError, match="drop_carried"):  # its turns in flight finish; "abort" would promise otherwise
            rollout.update_weights([("w", torch.ones(3))], in_flight="abort")
        assert rollout.update_weights([("w", torch.ones(3))]) == 1  # while the straggler waits on its tool
        res2 = rollout.run_step([{"seed": 4, "delay": 0.05}], 2, PARAMS, groups_needed=2, partial=True, timeout_s=30)
        assert sorted(zip(res2.started_in, res2.group_ids)) == [(1, 1), (2, 0)] and res2.carried == 0
        carried = res2.groups[res2.started_in.index(1)]
        for e in carried.episodes:
            assert (e.finish, e.reward, len(e.turns)) == ("answered", 1.0, 2)
            versions = [v for v, m in zip(e.trajectory.weight_versions, e.trajectory.loss_mask) if m]
            assert versions[0] == 0 and versions[-1] == 1 and sorted(set(versions)) == [0, 1]
        rollout.drain(timeout_s=10)
        assert [(s["open_envs"], s["running_groups"]) for s in rollout.stats()] == [(0, 0), (0, 0)]
        # a straggler carried and then dropped is aborted and its environment closed
        res3 = rollout.run_step([{"seed": 5, "delay": 60.0}, {"seed": 6}], 1, PARAMS, groups_needed=1, partial=True,
                                timeout_s=30)
        with pytest.raises(ValueError, match="carried"):  # its KV is in use: no sleep for the workers now
            rollout.sleep()
        assert res3.group_ids == [1] and rollout.drop_carried() == 1
        rollout.drain(timeout_s=10)
        assert [(s["open_envs"], s["running_groups"]) for s in rollout.stats()] == [(0, 0), (0, 0)]
    finally:
        rollout.shutdown()


def test_a_worker_killed_mid_step_loses_no_group(cluster):
    rollout = RayRollout(2, scripted, slow_env, num_cpus=0.5)
    try:
        specs = [{"seed": i, "delay": 2.0} for i in range(4)]
        victim = rollout.workers[0]
        threading.Timer(1.0, lambda: ray.kill(victim)).start()
        res = rollout.run_step(specs, 2, PARAMS, timeout_s=45)
        assert sorted(res.group_ids) == [0, 1, 2, 3] and rollout.dead == {0}
        assert sorted(res.retried) == [0, 2]  # worker 0 had groups 0 and 2
        assert all(e.finish == "answered" and e.reward == 1.0 for g in res.groups for e in g.episodes)
        assert [(s["open_envs"], s["running_groups"]) for s in rollout.stats()] == [(0, 0)]
    finally:
        rollout.shutdown()


def test_weight_updates_reach_every_worker_with_one_version(cluster):
    import torch

    rollout = RayRollout(2, scripted, slow_env, num_cpus=0.5)
    try:
        assert rollout.update_weights([("w", torch.ones(3))]) == 1
        assert rollout.update_weights([("w", torch.zeros(3))]) == 2
        res = rollout.run_step([{"seed": 0}, {"seed": 1}], 2, PARAMS)
        versions = {v for g in res.groups for e in g.episodes for v, m in zip(e.trajectory.weight_versions,
                                                                             e.trajectory.loss_mask) if m}
        assert versions == {2}
    finally:
        rollout.shutdown()


def embedded_llm():
    return LLM(dtype="float32", max_model_len=2048, num_kv_blocks=256)


@pytest.mark.slow
def test_a_group_is_prefilled_once_on_the_worker_that_runs_it(cluster):
    rollout = RayRollout(2, embedded_llm, slow_env, AgentConfig(max_turns=1, max_tokens_per_turn=8), num_cpus=0.5)
    try:
        res = rollout.run_step([{"seed": 0, "prompt": "fix a"}, {"seed": 1, "prompt": "fix b"}], 4,
                               SamplingParams(temperature=1.0, seed=1))
        prompt_lens = {gi: g.episodes[0].trajectory.prompt_length for gi, g in zip(res.group_ids, res.groups)}
        stats = rollout.stats()
        # one group per worker (fewest outstanding), each computed its own prompt once for 4 members
        assert sorted(s["prefill_tokens_computed"] for s in stats) == sorted(prompt_lens.values())
        assert all(s["generated_tokens"] >= 4 for s in stats)
        assert all(s["num_requests_running"] == 0 and s["open_envs"] == 0 for s in stats)
    finally:
        rollout.shutdown()


def embedded_lora_llm():
    return LLM(dtype="float32", max_model_len=2048, num_kv_blocks=256, enable_lora=True)


@pytest.mark.slow
def test_lora_training_syncs_one_adapter_to_every_worker(cluster):
    """`trainer.push_weights(rollout)` with a LoRA trainer: every worker's engine gets the adapter
    (one version), the next step's turns are sampled under it (the trainer with the adapter
    scores them within 1e-5, the base model does not)."""
    import torch

    from cuttle.rl import mismatch
    from cuttle.rl.agent import agent_batch
    from cuttle.rl.trainer import Trainer, TrainerConfig

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    trainer = Trainer(default_model_path(), TrainerConfig(lora=lora, lora_name="pi"))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for b in trainer.lora.b.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    rollout = RayRollout(2, embedded_lora_llm, slow_env, AgentConfig(max_turns=1, max_tokens_per_turn=8), num_cpus=0.5)
    try:
        assert trainer.push_weights(rollout) == 1 and rollout.lora_name == "pi"  # nothing carried: "abort" is "finish"
        res = rollout.run_step([{"seed": 0, "prompt": "fix a"}, {"seed": 1, "prompt": "fix b"}], 2,
                               SamplingParams(temperature=1.0, seed=2))
        batch, _ = agent_batch(res.groups, scale_by_std=False, filter_truncated=False)
        packed = batch.packed()
        rollout_lps = packed.rollout_logprobs[packed.loss_mask > 0]
        assert {v for g in res.groups for e in g.episodes
                for v, m in zip(e.trajectory.weight_versions, e.trajectory.loss_mask) if m} == {1}
        assert mismatch(trainer.score(batch), rollout_lps).max_abs <= 1e-5
        assert mismatch(Trainer(default_model_path()).score(batch), rollout_lps).max_abs > 1e-3
    finally:
        rollout.shutdown()


def embedded_sleepy_llm():
    return LLM(dtype="float32", max_model_len=2048, num_kv_blocks=256, enable_sleep_mode=True)


@pytest.mark.slow
def test_a_colocated_trainer_puts_the_workers_to_sleep_between_steps(cluster):
    """RayRollout.sleep / wake_up / is_sleeping on every worker's engine: level 2 between steps,
    the weights sent back by update_weights (vLLM's order: weights, update, KV cache), and the next
    step samples what the first did (greedy) under the new version; a worker whose sampler has no
    sleep mode refuses, naming it."""
    from cuttle.engine.models.loader import iter_tensors

    config = AgentConfig(max_turns=1, max_tokens_per_turn=8)
    greedy = SamplingParams(temperature=0.0)
    specs = [{"seed": 0, "prompt": "fix a"}, {"seed": 1, "prompt": "fix b"}]
    rollout = RayRollout(2, embedded_sleepy_llm, slow_env, config, num_cpus=0.5)
    try:
        first = rollout.run_step(specs, 1, greedy)
        rollout.sleep(2)
        assert rollout.is_sleeping()
        rollout.wake_up(["weights"])
        version = rollout.update_weights(list(iter_tensors(default_model_path())))
        rollout.wake_up(["kv_cache"])
        assert not rollout.is_sleeping() and version == 1
        second = rollout.run_step(specs, 1, greedy)

        def tokens(res):
            return {gi: [e.trajectory.token_ids for e in g.episodes] for gi, g in zip(res.group_ids, res.groups)}

        assert tokens(second) == tokens(first)
        assert {v for g in second.groups for e in g.episodes for v, m in zip(e.trajectory.weight_versions,
                                                                             e.trajectory.loss_mask) if m} == {1}
        # or from a checkpoint on disk, read by every worker itself (nothing through the object store)
        rollout.sleep(2)
        rollout.wake_up()
        assert rollout.reload_weights() == 2
        third = rollout.run_step(specs, 1, greedy)
        assert tokens(third) == tokens(first)
    finally:
        rollout.shutdown()
    scripted_rollout = RayRollout(1, scripted, slow_env, num_cpus=0.5)
    try:
        with pytest.raises(Exception, match="no sleep mode"):
            scripted_rollout.sleep()
        with pytest.raises(Exception, match="cannot reload weights"):
            scripted_rollout.reload_weights()
    finally:
        scripted_rollout.shutdown()
