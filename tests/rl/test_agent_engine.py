"""The agent loop on the real engine with the embedded model, in the sandbox, end to end (issue 17,
acceptance 1 and 2): whatever the model writes, the episode runs to a finish and a reward, the
stream's text is the template's rendering of the conversation, the loss mask covers exactly the
sampled ids, and the engine's behaviour logprobs equal the trainer's recompute (float32, <= 1e-5)."""
from __future__ import annotations

import pytest
import torch

from agent_scripts import ASSISTANT, ScriptedSampler, call

from cuttle.engine import LLM, SamplingParams
from cuttle.rl import mismatch
from cuttle.rl.rollout import generate_tokens
from cuttle.rl.agent import AgentConfig, AgentRollout, agent_batch, episode_stats
from cuttle.rl.environment import sandbox_factory
from cuttle.rl.trainer import Trainer
from cuttle.sandbox.tools import agent_tool_schemas


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=4096, num_kv_blocks=512)


@pytest.mark.slow
def test_embedded_model_runs_episodes_end_to_end(llm, namespaces):
    tok = llm.get_tokenizer()
    cfg = AgentConfig(max_turns=3, max_tokens_per_turn=40, max_total_tokens=2400)
    runner = AgentRollout(llm, sandbox_factory(), cfg)
    specs = [{"kind": "synthetic", "seed": 5}, {"kind": "synthetic", "seed": 6}]
    try:
        groups = runner.run(specs, 2, SamplingParams(temperature=1.0, seed=7))
    finally:
        runner.close()
    episodes = [e for g in groups for e in g.episodes]
    assert all(e.finish is not None and not e.failed and e.reward in (0.0, 1.0) for e in episodes)
    stats = episode_stats(groups)
    assert stats["episodes"] == 4 and stats["sampled_tokens"] > 0
    for e in episodes:
        traj, ids = e.trajectory, e.trajectory.token_ids
        # text identity: the stream decodes to the template's rendering (the model's own ids are kept
        # even where they are not the canonical encoding of their text)
        assert tok.decode(ids, skip_special_tokens=False) == e.chat.text
        rendered = tok.apply_chat_template(e.chat.messages, tools=agent_tool_schemas(), add_generation_prompt=False)
        assert rendered.startswith(e.chat.text)
        # every turn's sampled ids are exactly the mask-1 spans, with the engine's logprobs and version
        spans = [(a, b) for a, b in zip(*_runs(traj.loss_mask))]
        assert len(spans) == len(e.turns) == traj.num_turns
        assert all(v == 0 for v, m in zip(traj.weight_versions, traj.loss_mask) if m)
        assert all(lp == 0.0 and v == -1 for lp, v, m in zip(traj.logprobs, traj.weight_versions, traj.loss_mask) if not m)
        for (a, b), t in zip(spans, e.turns):
            assert tok.decode(ids[a:b], skip_special_tokens=False).startswith(t.text)
    # each group's prompt is computed once, and later turns extend the earlier ids exactly, so the
    # prefix cache serves the history: what is computed is the prompts, the appended tool results
    # and at most the last partial block of each request, never a past turn again
    s = llm.stats()
    prompt_len = episodes[0].trajectory.prompt_length
    appended = sum(len(e.trajectory.token_ids) - e.trajectory.prompt_length - sum(e.trajectory.loss_mask) for e in episodes)
    requests = len(groups) + sum(len(e.turns) - 1 for e in episodes)
    block = llm.engine.config.block_size
    print("prefill computed", s["prefill_tokens_computed"], "prompt tokens", s["prompt_tokens"], "bound parts",
          prompt_len, appended, requests)
    assert s["prefill_tokens_computed"] <= len(groups) * prompt_len + appended + requests * block
    assert s["prompt_tokens"] > 2 * s["prefill_tokens_computed"] or requests == len(groups)
    batch, counts = agent_batch(groups, scale_by_std=False, filter_truncated=False)
    assert counts["kept"] == 4
    trainer = Trainer(llm.engine.config.model)
    packed = batch.packed()
    m = mismatch(trainer.score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert m.num_tokens == packed.num_trained_tokens == stats["sampled_tokens"]
    assert m.max_abs <= 1e-5, m


@pytest.mark.slow
def test_episodes_with_tool_calls_under_their_schemas(llm, namespaces):
    """`AgentRollout.tool_call_params`: with the model pushed to open calls (a logit_bias on
    `<tool_call>`), every call that closes parses under its tool's schema; a block left malformed is
    only a call the turn's max_tokens cut, at its end (without the grammar every such block of
    these episodes is malformed). The trainer given the same params scores the episodes as drawn
    (<= 2e-5: the two forwards' fp32 rounding, as unmasked)."""
    from cuttle.rl.trainer import TrainerConfig

    runner = AgentRollout(llm, sandbox_factory(), AgentConfig(max_turns=3, max_tokens_per_turn=60, max_total_tokens=2400))
    opening = llm.get_tokenizer().tok.token_to_id("<tool_call>")
    try:
        params = runner.tool_call_params(SamplingParams(temperature=1.0, seed=11, logit_bias={opening: 8.0}))
        assert params.structured_outputs is not None
        with pytest.raises(ValueError, match="already carry structured_outputs"):
            runner.tool_call_params(params)
        groups = runner.run([{"kind": "synthetic", "seed": 5}, {"kind": "synthetic", "seed": 6}], 3, params)
    finally:
        runner.close()
    turns = [t for g in groups for e in g.episodes for t in e.turns]
    assert sum(len(t.calls) for t in turns) >= 3
    for t in turns:
        assert len(t.malformed) <= 1 and all(t.text.rstrip().endswith(m.rstrip()) for m in t.malformed), t.text
    batch, _ = agent_batch(groups, scale_by_std=False, filter_truncated=False)
    packed = batch.packed()
    trainer = Trainer(llm.engine.config.model, TrainerConfig.for_sampler(llm, params))
    m = mismatch(trainer.score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert m.max_abs <= 2e-5 and m.num_tokens == packed.num_trained_tokens, m


def _runs(mask: list[int]) -> tuple[list[int], list[int]]:
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    ends = [i + 1 for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
    return starts, ends


class AfterAToolCall:
    """Turn 1 is a scripted read_file call; every later turn is sampled by the engine, from the
    stream with that call's result appended through the template."""

    def __init__(self, llm: LLM):
        self.llm, self.tok = llm, llm.get_tokenizer()
        self.script = ScriptedSampler(self.tok, {"": [call("read_file", path="README.md")]})

    def generate_tokens(self, prompts, params):
        first = self.tok.decode(prompts[0], skip_special_tokens=False).count(ASSISTANT) == 1
        return self.script.generate_tokens(prompts, params) if first else generate_tokens(self.llm, prompts, params)


@pytest.mark.slow
def test_engine_turn_after_a_tool_result_matches_the_trainer(llm, namespaces):
    tok = llm.get_tokenizer()
    sampler = AfterAToolCall(llm)
    runner = AgentRollout(sampler, sandbox_factory(), AgentConfig(max_turns=2, max_tokens_per_turn=48),
                          tokenizer=tok, eos_token_ids=llm.engine.eos_token_ids)
    try:
        groups = runner.run([{"kind": "synthetic", "seed": 8}], 2, SamplingParams(temperature=1.0, seed=3))
    finally:
        runner.close()
    for e in groups[0].episodes:
        assert len(e.turns) == 2 and e.turns[0].results[0].ok and "# " in e.turns[0].results[0].content
        assert tok.decode(e.trajectory.token_ids, skip_special_tokens=False) == e.chat.text
        assert "<tool_response>" in e.chat.text and e.finish is not None and not e.failed
    batch, _ = agent_batch(groups, scale_by_std=False, filter_truncated=False)
    packed = batch.packed()
    trainer_lp = Trainer(llm.engine.config.model).score(batch)
    rollout_lp = packed.rollout_logprobs[packed.loss_mask > 0]
    # the engine's turn comes after the scripted one in each sequence: compare those tokens only
    engine_tokens = torch.zeros_like(rollout_lp, dtype=torch.bool)
    flat = 0
    for e in groups[0].episodes:
        first, total = len(tok.encode(call("read_file", path="README.md"), add_special_tokens=False)) + 1, sum(e.trajectory.loss_mask)
        engine_tokens[flat + first: flat + total] = True
        flat += total
    assert engine_tokens.sum() > 0
    m = mismatch(trainer_lp[engine_tokens], rollout_lp[engine_tokens])
    assert m.max_abs <= 1e-5, m


@pytest.mark.parametrize("use_sessions", [True, False])
def test_seeded_episodes_draw_their_own_turns(llm, use_sessions, monkeypatch):
    """After the first turn each episode's turn is its own request (n = 1); with one seed per turn
    every episode of the call drew the same uniforms, so members in the same state wrote the same
    turn. Every turn-2 request now has its own seed (turn 1 forced to the same tool call in all 8
    episodes, then a free turn): 8 distinct seeds, and the members' turns differ."""
    import cuttle.engine.llm_engine as llm_engine
    from agent_scripts import FakeEnvironment
    from cuttle.engine.sampler import Logprob, SampleResult

    tok = llm.get_tokenizer()
    cfg = AgentConfig(max_turns=2, max_tokens_per_turn=48, max_total_tokens=3000, use_sessions=use_sessions)
    runner = AgentRollout(llm, lambda spec: FakeEnvironment(spec), cfg)
    script = tok.encode(call("ls"), add_special_tokens=False) + [runner.chat.end_of_turn_id]
    real, turn, seeds = llm_engine.sample, [0], set()
    count = runner._sample

    def counted(*a, **k):
        turn[0] += 1
        return count(*a, **k)

    def sample(logits, rows, *rest):
        out = real(logits, rows, *rest)
        for i, r in enumerate(rows):
            if turn[0] == 1:
                t = script[min(r.step, len(script) - 1)]
                out[i] = SampleResult(t, -0.5, {t: Logprob(-0.5, 1)})
            else:
                seeds.add(r.seed)
        return out

    monkeypatch.setattr(runner, "_sample", counted)
    monkeypatch.setattr(llm_engine, "sample", sample)
    try:
        groups = runner.run([{"seed": 1, "prompt": "fix it"}, {"seed": 2, "prompt": "fix it"}], 4, SamplingParams(temperature=1.0, seed=7))
    finally:
        runner.close()
    assert len(seeds) == 8
    for g in groups:
        assert len({e.turns[0].text for e in g.episodes}) == 1
        assert len({e.turns[1].text for e in g.episodes}) > 1
