"""Training rows in which a group's samples read their shared prompt once (rl/shared_rows.py).

- The layout: every token sees exactly the keys (renumbered) its own sequence gave it, never
  another member's; the prompt of each group of G appears once.
- The trainer's logprobs with shared rows equal those of the packed rows (fp32, 1e-5) and the
  engine's, for plain groups and groups over squid documents in both conventions; one GRPO step
  from the same weights has the same loss and gradients (the prefix's gradient is the members' sum).
- Sequences of different groups, or whose prompts differ, share nothing.
"""
from __future__ import annotations

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.squid import SquidLayout
from cuttle.rl import TrainBatch, compute_advantages, mismatch, sample_groups
from cuttle.rl.batch import sequence_mask
from cuttle.rl.shared_rows import SharedRow
from cuttle.rl.trainer import Trainer, TrainerConfig

SP = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
DOCS = [[30 + i for i in range(n)] for n in (12, 7, 9)]


@pytest.fixture(scope="module")
def llm(moe_path):
    return LLM(moe_path, dtype="float32", num_kv_blocks=512)


def _batch(llm: LLM, prompts, G: int = 4) -> TrainBatch:
    groups = sample_groups(llm, prompts, G, SP)
    for g in groups:
        for i, s in enumerate(g.samples):
            s.reward = float(i % 2)
    return TrainBatch.from_groups(groups, compute_advantages(groups, True))


def _check_layout(packed, row: SharedRow, a: int, b: int) -> None:
    """Each token's keys in the shared row are its own sequence's keys, renumbered."""
    cu = packed.cu_seqlens.tolist()
    layouts = packed.layouts or [None] * packed.num_seqs
    for m in range(a, b):
        s, e = cu[m] - cu[a], cu[m + 1] - cu[a]
        own = sequence_mask(layouts[m], e - s)
        idx = row.index[s:e]
        assert torch.equal(row.input_ids[idx], packed.input_ids[cu[m]:cu[m + 1]])
        assert torch.equal(row.position_ids[idx], packed.position_ids[cu[m]:cu[m + 1]])
        for r in range(e - s):
            want = set(idx[own[r]].tolist())
            assert set(row.mask[idx[r]].nonzero().squeeze(1).tolist()) == want, (m, r)


def test_a_group_reads_its_prompt_once(llm, random_prompts):
    prompts = random_prompts(3, 24, seed=4)
    batch = _batch(llm, prompts)
    packed = batch.packed()
    row = SharedRow.build(packed, 0, packed.num_seqs)
    assert row.shared == 3 * 3 * 24  # each group of 4 computes its 24-token prompt once
    _check_layout(packed, row, 0, packed.num_seqs)
    # two groups of the same prompt stay apart (group ids differ), and a row's part of a group shares within it
    twice = _batch(llm, [prompts[0], prompts[0]])
    p2 = twice.packed()
    assert SharedRow.build(p2, 0, p2.num_seqs).shared == 2 * 3 * 24
    part = SharedRow.build(p2, 1, 3)  # samples 1 and 2 of group 0, a row's part of the group
    assert part.shared == 24
    _check_layout(p2, part, 1, 3)


def test_samples_whose_prompts_differ_share_what_they_have_in_common(llm):
    batch = _batch(llm, [[5, 6, 7, 8, 9]], G=2)
    packed = batch.packed()
    packed.input_ids[packed.cu_seqlens[1] + 3] = 77  # the second sample's prompt differs from its 4th token
    row = SharedRow.build(packed, 0, 2)
    assert row.shared == 3
    _check_layout(packed, row, 0, 2)
    packed.group_ids[1] = 9  # another group: nothing shared
    assert SharedRow.build(packed, 0, 2).shared == 0


@pytest.mark.parametrize("convention", [None, "shared", "concat"])
def test_shared_rows_score_and_train_as_packed_rows(moe_path, random_prompts, convention):
    if convention is None:
        llm = LLM(moe_path, dtype="float32", num_kv_blocks=512)
        prompts = random_prompts(3, 20, seed=8)
    else:
        llm = LLM(moe_path, dtype="float32", num_kv_blocks=512, squid_positions=convention)
        prompts = [{"prefix": [3, 4], "documents": [DOCS[0], DOCS[2]], "prompt": [60, 61, 62]},
                   {"prefix": [3, 4], "documents": [DOCS[1], DOCS[0], DOCS[2]], "prompt": [63, 64]}]
    batch = _batch(llm, prompts)
    packed = batch.packed()
    if convention is not None:
        assert isinstance(packed.layouts[0], SquidLayout)
    shared_row = SharedRow.build(packed, 0, packed.num_seqs)
    assert shared_row.shared > 0
    _check_layout(packed, shared_row, 0, packed.num_seqs)
    cfg = dict(lr=1e-3, grad_clip=None, max_tokens_per_row=4096)
    on, off = Trainer(moe_path, TrainerConfig(**cfg)), Trainer(moe_path, TrainerConfig(share_prefixes=False, **cfg))
    behaviour = packed.rollout_logprobs[packed.loss_mask > 0]
    a, b = on.score(batch), off.score(batch)
    assert (a - b).abs().max() <= 1e-5
    assert mismatch(a, behaviour).max_abs <= 1e-5
    s_on, s_off = on.step(batch), off.step(batch)
    assert abs(s_on["loss"] - s_off["loss"]) <= 1e-6
    assert abs(s_on["grad_norm"] - s_off["grad_norm"]) <= 1e-5 * max(1.0, s_off["grad_norm"])
    # the gradients the step applied (still held: AdamW's own update amplifies rounding-level
    # gradients of untouched weights to +-lr, so the weights are not what to compare)
    for (name, p), q in zip(on.model.named_parameters(), off.model.parameters()):
        if p.grad is not None or q.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_rows_are_packed_by_what_each_sample_adds(moe_path, llm, random_prompts):
    """A group of 4 whose 24-token prompt is shared takes 24 + 4 x 10 rows, not 4 x 34: under a
    row budget of 80 it is one row with shared prompts, two without; the scores agree."""
    batch = _batch(llm, random_prompts(2, 24, seed=6))
    on = Trainer(moe_path, TrainerConfig(max_tokens_per_row=80))
    off = Trainer(moe_path, TrainerConfig(max_tokens_per_row=80, share_prefixes=False))
    packed = batch.packed()
    assert list(on._rows(packed)) == [(0, 4), (4, 8)]
    assert list(off._rows(packed)) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert (on.score(batch) - off.score(batch)).abs().max() <= 1e-5


def test_multi_turn_trajectories_share_their_first_prompt(moe_path):
    """Agent trajectories of one group (first prompt, a sample, a tool result, another sample)
    share the first prompt only: their first samples differ, so what follows is each one's own;
    trajectories of another group share nothing with them. Scores equal the packed rows'."""
    from cuttle.rl import Trajectory
    from cuttle.rl.types import Sample

    prompt = [5 + i for i in range(20)]
    trajs, gids = [], []
    for g, first in enumerate((prompt, prompt[:12] + [90] * 8)):
        for k in range(3):
            t = Trajectory.start(first)
            t.append_sample(Sample([30 + k, 31, 32], [-1.0] * 3, "stop", 0))
            t.append_context([60, 61, 62, 63 + k])  # a tool result (not trained)
            t.append_sample(Sample([40 + k, 41], [-1.0] * 2, "stop", 0))
            trajs.append(t)
            gids.append(g)
    batch = TrainBatch.from_trajectories(trajs, [1.0, -1.0, 0.5] * 2, gids)
    packed = batch.packed()
    row = SharedRow.build(packed, 0, packed.num_seqs)
    assert row.shared == 2 * (2 * 20)  # each group of 3 computes its 20-token first prompt once
    _check_layout(packed, row, 0, packed.num_seqs)
    on, off = Trainer(moe_path, TrainerConfig()), Trainer(moe_path, TrainerConfig(share_prefixes=False))
    assert (on.score(batch) - off.score(batch)).abs().max() <= 1e-5
