"""The trainer's replay of the engine sampler's processing (rl/sampling_replay.py): rollouts drawn
under token controls (logit_bias, allowed_token_ids, bad_words, structured output) and min_tokens,
single-turn groups and multi-turn trajectories, score as the engine drew them (fp32, <= 1e-5) when
the trainer mirrors the rollout's SamplingParams, and visibly differ when it does not."""
from __future__ import annotations

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.default_model import default_model_path
from cuttle.engine.sampling_params import StructuredOutputsParams
from cuttle.rl import TrainBatch, Trajectory, compute_advantages, extend_trajectories, mismatch, sample_groups
from cuttle.rl.sampling_replay import SamplingReplay
from cuttle.rl.trainer import SAMPLING_FIELDS, Trainer, TrainerConfig
from cuttle.rl.types import Sample
from helpers import make_checkpoint


def _agreement(path: str, llm: LLM, batches: list[tuple[TrainBatch, int]], sp: SamplingParams) -> None:
    """Each batch: <= 1e-5 under the config mirrored from `sp`, > 1e-2 under its temperature alone."""
    for batch, n in batches:
        packed = batch.packed()
        behaviour = packed.rollout_logprobs[packed.loss_mask > 0]
        same = mismatch(Trainer(path, TrainerConfig.for_sampler(llm, sp)).score(batch), behaviour)
        assert same.num_tokens == n and same.max_abs <= 1e-5, same
        plain = mismatch(Trainer(path, TrainerConfig(temperature=sp.temperature)).score(batch), behaviour)
        assert plain.max_abs > 1e-2, plain


def _two_turns(llm: LLM, prompts: list, sp: SamplingParams, context: list[int]) -> list[Trajectory]:
    trajs = [Trajectory.start(p) for p in prompts]
    extend_trajectories(llm, trajs, sp)
    for t in trajs:
        t.append_context(context)
    extend_trajectories(llm, trajs, sp)
    return trajs


CONTROLS = [{"logit_bias": {5: 3.0, 17: -2.5, 40: 5.0, "41": 4.0}},
            {"allowed_token_ids": list(range(3, 60))},
            {"min_tokens": 10, "stop_token_ids": [7, 8, 9, 10, 11]},
            {"logit_bias": {20: 2.0}, "allowed_token_ids": list(range(3, 120)), "min_tokens": 6, "stop_token_ids": [21, 22],
             "repetition_penalty": 1.2, "presence_penalty": 0.3, "top_k": 30}]


@pytest.mark.parametrize("controls", CONTROLS)
def test_controlled_rollouts_agree_when_the_trainer_mirrors_their_params(moe_path, random_prompts, controls):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=256)
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=12, **controls)
    groups = sample_groups(llm, random_prompts(2, 16, seed=31), 3, sp)
    trajs = _two_turns(llm, random_prompts(2, 14, seed=37), sp, [40, 41, 42])
    n_groups = sum(len(s.token_ids) for g in groups for s in g.samples)
    n_trajs = sum(sum(t.loss_mask) for t in trajs)
    _agreement(moe_path, llm, [(TrainBatch.from_groups(groups, compute_advantages(groups, True)), n_groups),
                               (TrainBatch.from_trajectories(trajs, [1.0, -1.0], [0, 1]), n_trajs)], sp)


@pytest.fixture(scope="module")
def coder() -> tuple[str, LLM]:
    """The embedded model: a byte-level BPE tokenizer, which bad_words' tokenization and a grammar need."""
    path = default_model_path()
    return path, LLM(path, dtype="float32", num_kv_blocks=256)


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}, "name": {"type": "string"}}, "required": ["x", "name"]}


@pytest.mark.parametrize("controls", [{"bad_words": ["return", " self", "(a"]},
                                      {"structured_outputs": StructuredOutputsParams(json=SCHEMA)},
                                      {"structured_outputs": StructuredOutputsParams(regex=r"[a-z_]+\(\d+, \d+\)")}],
                         ids=["bad_words", "json", "regex"])
def test_tokenizer_controls_agree_over_groups_and_turns(coder, controls):
    """bad_words and grammars on the embedded model; in two-turn trajectories each turn is its own
    engine request, whose grammar matcher starts at that turn's output."""
    path, llm = coder
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=16, **controls)
    groups = sample_groups(llm, ["def add(a, b):\n", "# sort a list\n"], 3, sp)
    tok = llm.get_tokenizer()
    trajs = _two_turns(llm, [tok.encode("x = ", add_special_tokens=False)], sp, tok.encode("\n# again\n", add_special_tokens=False))
    assert len(trajs[0].sample_starts) == 2
    _agreement(path, llm, [(TrainBatch.from_groups(groups, compute_advantages(groups, True)),
                            sum(len(s.token_ids) for g in groups for s in g.samples)),
                           (TrainBatch.from_trajectories(trajs, [1.0], [0]), sum(trajs[0].loss_mask))], sp)


def test_a_thinking_budget_replays_its_forced_closing_tag(tmp_path):
    """Rollouts whose thinking block (opened by the prompt) hits its budget: the engine forces the
    closing tag (processed logprob 0); the trainer mirroring thinking_token_budget scores every
    token as drawn, groups and two-turn trajectories (each turn its own budget)."""
    from thinking_checkpoint import make_thinking_checkpoint

    path = make_thinking_checkpoint(str(tmp_path))
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    opening, closing = tok.tok.token_to_id("<think>"), tok.tok.token_to_id("</think>")
    sp = SamplingParams(temperature=0.9, seed=13, max_tokens=10, ignore_eos=True, thinking_token_budget=4)
    groups = sample_groups(llm, [[5, 6, opening, 7], [9, opening]], 3, sp)
    assert all(s.token_ids[4] == closing for g in groups for s in g.samples)
    trajs = _two_turns(llm, [[11, opening]], sp, [12, opening])
    _agreement(path, llm, [(TrainBatch.from_groups(groups, compute_advantages(groups, True)),
                            sum(len(s.token_ids) for g in groups for s in g.samples)),
                           (TrainBatch.from_trajectories(trajs, [1.0], [0]), sum(trajs[0].loss_mask))], sp)


def test_a_tool_call_program_replays(tmp_path):
    """Rollouts under a token program (engine/token_calls.py: gpt-oss's required call, special
    tokens between grammar segments, two tools): the trainer mirroring the structured output
    scores every token as drawn, groups and two-turn trajectories."""
    from harmony_checkpoint import HARMONY_TEMPLATE, make_harmony_checkpoint

    from cuttle.engine.structured_output import tool_call_structure

    path = make_harmony_checkpoint(str(tmp_path))
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"k": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["k"]}}} for n in ("fore", "forecast")]
    so = tool_call_structure("openai", "required", None, tools, llm.get_tokenizer(), True, HARMONY_TEMPLATE)
    assert so is not None and so.kind == "tool_calls"
    sp = SamplingParams(temperature=0.9, seed=17, max_tokens=40, structured_outputs=so)
    groups = sample_groups(llm, [[5, 6, 7], [9, 10]], 3, sp)
    assert all(s.token_ids[-1] == llm.get_tokenizer().tok.token_to_id("<|call|>") or len(s.token_ids) == 40
               for g in groups for s in g.samples)
    trajs = _two_turns(llm, [[11, 12]], sp, [13, 14])
    _agreement(path, llm, [(TrainBatch.from_groups(groups, compute_advantages(groups, True)),
                            sum(len(s.token_ids) for g in groups for s in g.samples)),
                           (TrainBatch.from_trajectories(trajs, [1.0], [0]), sum(trajs[0].loss_mask))], sp)


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix(coder):
    """vLLM's rule, replayed: the word's last token is excluded exactly where the tokens before it
    end the request's output so far (not where they sit in the prompt)."""
    path, llm = coder
    tok = llm.get_tokenizer()
    word = tok.encode("foo_bar_baz", add_special_tokens=False)
    assert len(word) >= 2
    prefix, last = word[:-1], word[-1]
    prompt = tok.encode("x = ", add_special_tokens=False) + prefix  # the prefix in the prompt does not count
    t = Trajectory.start(prompt)
    out = [3, 4] + prefix + [5] + prefix + [6]
    t.append_sample(Sample(out, [-1.0] * len(out), "length", 0))
    batch = TrainBatch.from_trajectories([t], [1.0], [0]).packed()
    trainer = Trainer(path, TrainerConfig(bad_words=["foo_bar_baz"]))
    ids = batch.input_ids
    targets = batch.loss_mask.nonzero().squeeze(1)
    with torch.no_grad():
        logits = torch.zeros(len(targets), trainer.model.cfg.vocab_size)
        processed = trainer.replay(logits, batch, 0, 1, ids, targets)
    banned_at = [k for k in range(len(targets)) if torch.isneginf(processed[k, last])]
    # positions (in the output) right after each generated prefix: 2 + len(prefix) and 3 + 2 len(prefix)
    assert banned_at == [2 + len(prefix), 3 + 2 * len(prefix)]
    assert int(torch.isneginf(processed).sum()) == 2  # nothing else


def test_scoring_refuses_a_token_the_trainer_controls_exclude(moe_path, random_prompts):
    """Controls that are not the rollout's: a sampled token of probability 0 under them is an error
    naming the fields, never a -inf logprob in the loss."""
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=128)
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=list(range(3, 60)))
    groups = sample_groups(llm, random_prompts(1, 12, seed=3), 2, sp)
    batch = TrainBatch.from_groups(groups, compute_advantages(groups, True))
    sampled = sorted({t for g in groups for s in g.samples for t in s.token_ids})
    narrower = TrainerConfig(allowed_token_ids=[t for t in range(3, 60) if t != sampled[0]])
    with pytest.raises(ValueError, match="probability 0 under the trainer's logit_bias / allowed_token_ids"):
        Trainer(moe_path, narrower).score(batch)
    with pytest.raises(ValueError, match="probability 0"):  # min_tokens the rollout did not have, over its stop ids
        Trainer(moe_path, TrainerConfig(min_tokens=8, stop_token_ids=sampled[:1])).score(batch)


def test_controls_carry_gradients(moe_path):
    trainer = Trainer(moe_path, TrainerConfig(logit_bias={6: 2.0}, allowed_token_ids=list(range(3, 40)), min_tokens=2,
                                              stop_token_ids=[9], lr=1e-3, grad_clip=None))
    t = Trajectory.start([5, 6, 7, 5])
    t.append_sample(Sample([6, 5, 9, 8], [-1.0] * 4, "length", 0))
    batch = TrainBatch.from_trajectories([t], [1.0], [0])
    before = trainer.score(batch)
    assert bool(torch.isfinite(before).all())
    trainer.step(batch)
    assert (trainer.score(batch) - before).sum() > 0  # a positive advantage raised the sample's logprobs


def test_for_sampler_mirrors_the_rollout_params_and_fields_are_checked(moe_path):
    llm = LLM(moe_path, dtype="float32", num_kv_blocks=64)
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
                        frequency_penalty=0.1, logit_bias={"7": 1.5}, allowed_token_ids=[3, 4, 7], min_tokens=2,
                        stop_token_ids=[4], ignore_eos=True)
    cfg = TrainerConfig.for_sampler(llm, sp, lr=3e-4)
    assert all(getattr(cfg, f) == getattr(sp, f) for f in SAMPLING_FIELDS) and cfg.lr == 3e-4
    assert cfg.logit_bias == {7: 1.5} and cfg.eos_token_ids == sorted(llm.engine.eos_token_ids)
    assert TrainerConfig.for_sampler(llm, sp, temperature=1.0).temperature == 1.0  # fields given win
    with pytest.raises(ValueError, match="greedy"):
        TrainerConfig.for_sampler(llm, SamplingParams(temperature=0.0))
    for bad, says in [({"logit_bias": {5: 101.0}}, r"logit_bias\[5\]"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                      ({"bad_words": [" "]}, "bad_words"), ({"min_tokens": -1}, "min_tokens"),
                      ({"stop_token_ids": [-3]}, "stop_token_ids"),
                      ({"min_tokens": 2, "structured_outputs": StructuredOutputsParams(regex="a+")}, "min_tokens")]:
        with pytest.raises(ValueError, match=says):
            TrainerConfig(**bad)
    # what only the model can check, refused when the trainer is built, as the engine refuses the request
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        Trainer(moe_path, TrainerConfig(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids must be in"):
        Trainer(moe_path, TrainerConfig(allowed_token_ids=[10**6]))
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        Trainer(moe_path, TrainerConfig(min_tokens=2, stop_token_ids=[10**6]))


def test_penalty_chunks_give_the_unchunked_answer(moe_path, monkeypatch):
    """The penalties' (position, context token) pairs split over several chunks: the same logits."""
    trainer = Trainer(moe_path, TrainerConfig(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2))
    t = Trajectory.start([5, 6, 7, 5, 9])
    t.append_sample(Sample([6, 5, 6, 9, 9, 11, 5], [-1.0] * 7, "length", 0))
    t.append_context([12, 13])
    t.append_sample(Sample([5, 12, 5], [-1.0] * 3, "length", 0))
    batch = TrainBatch.from_trajectories([t, t], [1.0, 1.0], [0, 0]).packed()
    whole = trainer.score(batch)
    monkeypatch.setattr(SamplingReplay, "PAIRS_PER_CHUNK", 7)
    assert torch.equal(trainer.score(batch), whole)


def test_a_checkpoint_without_a_tokenizer_trains_and_replays_min_tokens(tmp_path):
    """The tokenizer is read only where a replayed rule needs one (bad_words, a grammar): a
    token-id-only checkpoint builds a trainer, and min_tokens masks the config's EOS id."""
    path = str(tmp_path / "ids_only")
    make_checkpoint(path, "qwen3", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ids_only" / name).unlink(missing_ok=True)
    Trainer(path)
    assert Trainer(path, TrainerConfig(min_tokens=3, stop_token_ids=[7])).replay.stop_ids == [1, 7]  # (EOS 1: the config's)
