"""Ray rollout workers with the embedded model (issue 17, acceptance 4): a group's members and all
their later turns run on the worker that holds its prefix KV (counted with the engine's prefill
counter), and one worker samples several groups' turns in one engine batch (counted in engine
steps). A local 2-CPU cluster, started and stopped by this module."""
from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

import agent_scripts  # noqa: E402
from agent_scripts import FakeEnvironment, call  # noqa: E402

from cuttle.engine import LLM, SamplingParams  # noqa: E402
from cuttle.rl.agent import AgentConfig  # noqa: E402
from cuttle.rl.engine_sampler import EngineSampler  # noqa: E402
from cuttle.rl.ray_rollout import RayRollout  # noqa: E402
from cuttle.rl.rollout import generate_tokens  # noqa: E402
from cuttle.rl.types import Sample  # noqa: E402

pytestmark = pytest.mark.slow
ASSISTANT = "<|im_start|>assistant"
SCRIPT = [call("look", at="a"), call("look", at="b"), "done"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(agent_scripts)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def embedded_llm() -> LLM:
    return LLM(dtype="float32", max_model_len=2048, num_kv_blocks=256)


class ScriptOverEngine:
    """Turn i is SCRIPT[i] (tool calls in the model's format, so episodes have several turns), and
    the engine really runs every turn on the trajectory's ids (prefill, then one decoded token), so
    the engine's counters see exactly the prompts a policy's turns would send."""

    thread_safe = True

    def __init__(self, sampler: EngineSampler):
        self.sampler, self.tok = sampler, sampler.get_tokenizer()
        self.end_of_turn = self.tok.encode("<|im_end|>", add_special_tokens=False)[0]
        self.eos_token_ids = sampler.eos_token_ids

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        generate_tokens(self.sampler, prompts, SamplingParams(n=params.n, temperature=1.0, max_tokens=1, ignore_eos=True))
        out = []
        for ids in prompts:
            turn = self.tok.decode(ids, skip_special_tokens=False).count(ASSISTANT) - 1
            tokens = self.tok.encode(SCRIPT[min(turn, len(SCRIPT) - 1)], add_special_tokens=False) + [self.end_of_turn]
            out.append([Sample(list(tokens), [-0.5] * len(tokens), "stop", self.sampler.weight_version)
                        for _ in range(params.n)])
        return out

    def stats(self) -> dict:
        return self.sampler.stats()


def scripted_engine():
    s = ScriptOverEngine(EngineSampler(embedded_llm()))
    return s, s.tok, s.eos_token_ids


def fake_env(spec):
    return FakeEnvironment(spec)


def test_later_turns_run_where_the_group_prefix_is_cached(cluster):
    members, block = 3, 16
    rollout = RayRollout(2, scripted_engine, fake_env, AgentConfig(max_turns=4), num_cpus=0.5)
    try:
        res = rollout.run_step([{"seed": 0, "prompt": "fix a"}, {"seed": 1, "prompt": "fix b " * 40}], members,
                               SamplingParams(temperature=1.0))
        stats = rollout.stats()
        assert all(s["num_requests_running"] == 0 and s["open_envs"] == 0 for s in stats)
        for gi, g in zip(res.group_ids, res.groups):
            eps = g.episodes
            assert [(e.finish, len(e.turns)) for e in eps] == [("answered", 3)] * members
            prompt = eps[0].trajectory.prompt_length
            ids = eps[0].trajectory.token_ids
            # the prompt of turn t is the stream up to the end of the delta after turn t-1
            turn_starts = [i + 1 for i in range(len(ids) - 1) if eps[0].trajectory.loss_mask[i + 1]
                           and not eps[0].trajectory.loss_mask[i]]
            sent = sum(members * start for start in turn_starts[1:]) + prompt  # tokens the turns sent
            new = sum(members * (b - a + block) for a, b in zip([prompt] + turn_starts[1:], turn_starts[1:]))
            # one group per worker (fewest outstanding first); which worker is decided by its counters
            [s] = [s for s in stats if s["prompt_tokens"] == sent]
            # the group's prompt once for all members and turns; later turns compute only what was
            # appended since the last turn (its tail block at most again), never the history
            assert prompt <= s["prefill_tokens_computed"] <= prompt + new, (gi, s, prompt, new)
            assert s["cached_tokens"] >= members * (len(turn_starts) - 1) * (prompt // block) * block
    finally:
        rollout.shutdown()


class LockedEngine:
    """The embedded engine as a sampler that is not thread-safe: the worker locks it, so its engine
    samples one group's turn at a time (the control)."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def generate_tokens(self, prompts, params):  # noqa: ANN001 - TokenSampler's signature
        return generate_tokens(self.llm, prompts, params)

    def stats(self) -> dict:
        return self.llm.stats()


def locked_engine():
    llm = embedded_llm()
    return LockedEngine(llm), llm.get_tokenizer(), llm.engine.eos_token_ids


@pytest.mark.parametrize("factory,batched", [(embedded_llm, True), (locked_engine, False)])
def test_a_worker_batches_several_groups_turns_in_one_engine_batch(cluster, factory, batched):
    groups, members, tokens = 3, 2, 24
    rollout = RayRollout(1, factory, fake_env, AgentConfig(max_turns=1, max_tokens_per_turn=tokens), num_cpus=0.5)
    try:
        res = rollout.run_step([{"seed": i, "prompt": f"task {i}"} for i in range(groups)], members,
                               SamplingParams(temperature=1.0, ignore_eos=True, seed=3))
        assert all(len(e.trajectory.token_ids) - e.trajectory.prompt_length == tokens
                   for g in res.groups for e in g.episodes)
        [s] = rollout.stats()
        assert s["generated_tokens"] == groups * members * tokens
        if batched:  # the three groups' turns decode together: about one group's steps, not three
            assert s["steps"] < 2 * (tokens + 2), s["steps"]
        else:
            assert s["steps"] >= groups * tokens, s["steps"]
    finally:
        rollout.shutdown()
