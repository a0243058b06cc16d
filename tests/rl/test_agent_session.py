"""The agent loop on engine sessions (issue 17): with the in-process engine every episode keeps its
KV pinned across its tool calls, the members of a group fork from one prefill of the shared
prompt, and a later turn computes only what was appended since its last turn (tool results,
template glue) plus that turn's last sampled token. The embedded model does not write tool calls,
so the engine's sampler is replaced by one that emits a fixed call in the model's format (the
forward passes, the KV and the counters are the real engine's); its logprobs are the model's
log-softmax of the forced tokens, so they are checked against the trainer's recompute too."""
from __future__ import annotations

import pytest
import torch
from agent_scripts import FakeEnvironment, call

import cuttle.engine.llm_engine as llm_engine
from cuttle.engine import LLM, SamplingParams
from cuttle.engine.sampler import Logprob, SampleResult
from cuttle.rl import mismatch
from cuttle.rl.agent import AgentConfig, AgentRollout, agent_batch
from cuttle.rl.trainer import Trainer, TrainerConfig


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=4096, num_kv_blocks=512)


def forced_sampler(script: list[int]):
    """The engine's `sample` replaced: token `step` of `script`, with the model's logprob of it."""
    def sample(logits, rows, *_):  # noqa: ANN001 - the engine passes logprobs_mode and more
        lp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for i, r in enumerate(rows):
            tok = script[min(r.step, len(script) - 1)]
            v = lp[i, tok].item()
            out.append(SampleResult(tok, v, {tok: Logprob(v, 1)}))
        return out
    return sample


def sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_later_turns_prefill_only_the_appended_tokens_and_logprobs_match_the_trainer(llm, monkeypatch):
    tok = llm.get_tokenizer()
    cfg = AgentConfig(max_turns=3, max_tokens_per_turn=64, max_total_tokens=3000)
    runner = AgentRollout(llm, lambda spec: FakeEnvironment(spec), cfg)
    script = tok.encode(call("ls"), add_special_tokens=False) + [runner.chat.end_of_turn_id]
    monkeypatch.setattr(llm_engine, "sample", forced_sampler(script))
    before = llm.stats()["prefill_tokens_computed"]
    try:
        groups = runner.run([{"seed": 1, "prompt": "fix it"}], 2, SamplingParams(temperature=1.0))
    finally:
        runner.close()
    stats = llm.stats()
    episodes = groups[0].episodes
    spans = [sampled_spans(e.trajectory.loss_mask) for e in episodes]
    assert all(e.finish == "max_turns" and len(s) == 3 for e, s in zip(episodes, spans))
    expected = spans[0][0][0]  # the group's prompt, computed once for both members
    for e, s in zip(episodes, spans):
        later = [s[k][0] - s[k - 1][1] + 1 for k in range(1, len(s))]
        # each later turn: what was appended after the previous turn (the tool result, the template's
        # glue) and the previous turn's last sampled token, never the history again
        assert all(0 < n < 200 for n in later), later
        expected += sum(later)
    assert stats["prefill_tokens_computed"] - before == expected
    assert stats["sessions_open"] == 0 and stats["session_pinned_blocks"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every session closed, nothing pinned
    assert all(e.session is None for e in episodes)
    # the forced tokens' logprobs are the model's, computed over the session's pinned KV: the
    # trainer's full recompute of every stream agrees
    batch, counts = agent_batch(groups, scale_by_std=True, filter_truncated=False)
    assert counts["kept"] == 2
    packed = batch.packed()
    m = mismatch(Trainer(llm.engine.config.model).score(batch), packed.rollout_logprobs[packed.loss_mask > 0])
    assert m.num_tokens == packed.num_trained_tokens == 3 * 2 * len(script)
    assert m.max_abs <= 1e-5, m


def test_lora_trainer_pushes_through_the_rollout_and_sessions_run_under_the_adapter(monkeypatch):
    """LoRA agentic RL in process: `trainer.push_weights(rollout)` loads the adapter into the
    rollout's LLM, every later turn (on engine sessions, pins reused between turns) runs under it,
    and the trainer with that adapter scores the turns within 1e-5 while the base model does not."""
    llm = LLM(dtype="float32", max_model_len=4096, num_kv_blocks=512, enable_lora=True)
    tok = llm.get_tokenizer()
    runner = AgentRollout(llm, lambda spec: FakeEnvironment(spec), AgentConfig(max_turns=2, max_tokens_per_turn=64))
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    trainer = Trainer(llm.engine.config.model, TrainerConfig(lora=lora, lora_name="pi"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in trainer.lora.b.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    assert trainer.push_weights(runner) == 1 and runner.lora_name == "pi"
    script = tok.encode(call("ls"), add_special_tokens=False) + [runner.chat.end_of_turn_id]
    monkeypatch.setattr(llm_engine, "sample", forced_sampler(script))
    try:
        groups = runner.run([{"seed": 1, "prompt": "fix it"}], 2, SamplingParams(temperature=1.0))
    finally:
        runner.close()
    assert llm.stats()["session_tokens_reused"] > 0  # the second turns ran on the sessions' pinned KV
    batch, _ = agent_batch(groups, scale_by_std=True, filter_truncated=False)
    packed = batch.packed()
    rollout = packed.rollout_logprobs[packed.loss_mask > 0]
    assert packed.num_trained_tokens == 2 * 2 * len(script)
    assert mismatch(trainer.score(batch), rollout).max_abs <= 1e-5
    assert mismatch(Trainer(llm.engine.config.model).score(batch), rollout).max_abs > 1e-3
