"""A Ray rollout worker fronting a running cuttle server (issue 17): the worker owns no engine, its
groups' turns go to the server's `/v1/rl/generate` as token ids and come back with the server's
logprobs, equal to an in-process engine's samples of the same prompt and seed; weight updates
from the controller reach the server and the next turns carry the new version. The server (the
embedded model, float32) runs in this process on loopback; the Ray cluster is local, 2 CPUs."""
from __future__ import annotations

import os
import sys

import pytest

ray = pytest.importorskip("ray")

import agent_scripts  # noqa: E402
from agent_scripts import FakeEnvironment  # noqa: E402
from server_fixture import LiveServer  # noqa: E402

from cuttle.engine import LLM, SamplingParams  # noqa: E402
from cuttle.engine.default_model import default_model_path  # noqa: E402
from cuttle.rl.agent import AgentConfig, turn_seed  # noqa: E402
from cuttle.rl.ray_rollout import RayRollout, ServedSampler  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(agent_scripts)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def fake_env(spec):
    return FakeEnvironment(spec)


def test_a_worker_fronting_cuttle_serve_samples_through_its_rl_routes(cluster):
    model, tokens = default_model_path(), 8
    params = SamplingParams(temperature=1.0, seed=5)
    with LiveServer(model, dtype="float32", num_kv_blocks=256, max_model_len=2048) as srv:
        rollout = RayRollout(1, ServedSampler(srv.url, model), fake_env,
                             AgentConfig(max_turns=1, max_tokens_per_turn=tokens), num_cpus=0.5)
        try:
            res = rollout.run_step([{"seed": 0, "prompt": "fix a"}, {"seed": 1, "prompt": "fix b"}], 2, params)
            local = LLM(model, dtype="float32", num_kv_blocks=256, max_model_len=2048)
            for g in res.groups:
                prompt = g.episodes[0].trajectory.token_ids[:g.episodes[0].trajectory.prompt_length]
                # each worker runs its group as group 0 of its call; the seed is the group's first turn's
                seed = turn_seed(5, 0, g.spec, 0, 0)
                [want] = local.generate([prompt], SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=tokens,
                                                                 logprobs=0), use_tqdm=False)
                for e, c in zip(g.episodes, want.outputs):
                    t = e.trajectory
                    sampled = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
                    assert sampled == list(c.token_ids)
                    lps = [lp for lp, m in zip(t.logprobs, t.loss_mask) if m]
                    assert lps == pytest.approx([d[i].logprob for d, i in zip(c.logprobs, c.token_ids)], abs=1e-5)
                    assert {v for v, m in zip(t.weight_versions, t.loss_mask) if m} == {0}
            # one request per group on the server (its members fork there), each prompt computed once
            # (the second group's shares the system prompt with the first: prefix-cache hits)
            stats = srv.stats()
            assert stats["prompt_tokens"] == sum(g.episodes[0].trajectory.prompt_length for g in res.groups)
            assert stats["prefill_tokens_computed"] + stats["cached_tokens"] == stats["prompt_tokens"]
            assert stats["num_requests_running"] == 0
            # the worker runs at the driver's priority, not at Ray's background niceness (15)
            assert rollout.stats() == [{"open_envs": 0, "running_groups": 0, "niceness": os.getpriority(os.PRIO_PROCESS, 0), "env_close_errors": 0}]

            weights = [(n, p.detach() * 1.01) for n, p in local.engine.runner.model.named_parameters()]
            assert rollout.update_weights(weights) == 1 and srv.llm.weight_version == 1
            res2 = rollout.run_step([{"seed": 2, "prompt": "fix c"}], 2, params)
            assert {v for e in res2.groups[0].episodes for v, m in zip(e.trajectory.weight_versions,
                                                                        e.trajectory.loss_mask) if m} == {1}
        finally:
            rollout.shutdown()
