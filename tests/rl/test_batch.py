"""TrainBatch layout: masks, alignment of logprobs, padded vs packed forms."""
from __future__ import annotations

import pytest
import torch

from cuttle.rl import Group, Sample, TrainBatch, Trajectory


def groups() -> list[Group]:
    g0 = Group([10, 11, 12], [Sample([20, 21], [-0.5, -0.25], "stop", 3, reward=1.0),
                              Sample([22], [-1.0], "length", 3, reward=0.0)])
    g1 = Group([13], [Sample([23, 24, 25], [-0.1, -0.2, -0.3], "length", 4, reward=0.5)])
    return [g0, g1]


def test_padded_layout():
    b = TrainBatch.from_groups(groups(), [[0.5, -0.5], [0.0]], pad_id=0)
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21], [10, 11, 12, 22, 0], [13, 23, 24, 25, 0]]
    assert b.attention_mask.tolist() == [[True] * 5, [True] * 4 + [False], [True] * 4 + [False]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 3, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0]]
    assert b.rollout_logprobs.tolist() == [[0, 0, 0, -0.5, -0.25], [0, 0, 0, -1.0, 0], pytest.approx([0, -0.1, -0.2, -0.3, 0])]
    assert b.advantages.tolist() == [0.5, -0.5, 0.0]
    assert b.rewards.tolist() == [1.0, 0.0, 0.5]
    assert b.group_ids.tolist() == [0, 0, 1]
    assert b.weight_version.tolist() == [3, 3, 4]


def test_packed_matches_padded():
    b = TrainBatch.from_groups(groups(), [[0.5, -0.5], [0.0]])
    p = b.packed()
    assert p.cu_seqlens.tolist() == [0, 5, 9, 13] and p.cu_seqlens.dtype == torch.int32
    assert p.seq_lens == [5, 4, 4] and p.num_seqs == 3 and p.num_trained_tokens == 6
    assert p.input_ids.tolist() == [10, 11, 12, 20, 21, 10, 11, 12, 22, 13, 23, 24, 25]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3]
    assert torch.equal(p.loss_mask, b.loss_mask[b.attention_mask])
    assert torch.equal(p.rollout_logprobs[p.loss_mask > 0], b.rollout_logprobs[b.loss_mask > 0])


def test_multi_turn_trajectory_masks_tool_tokens():
    t = Trajectory.start([1, 2])
    t.append_sample(Sample([3, 4], [-0.1, -0.2], "stop", 0))
    t.append_context([5, 6, 7])
    t.append_sample(Sample([8], [-0.3], "stop", 1))
    t.reward = 2.0
    b = TrainBatch.from_trajectories([t], [1.0], [0])
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 1]]
    assert b.rollout_logprobs.tolist() == [pytest.approx([0, 0, -0.1, -0.2, 0, 0, 0, -0.3])]
    assert b.weight_version.tolist() == [0]  # the oldest version among its sampled tokens
    assert b.rewards.tolist() == [2.0]


def test_bad_batches():
    with pytest.raises(ValueError, match="first token"):
        t = Trajectory([1, 2], [1, 1], [0.0, 0.0], [0, 0])
        TrainBatch.from_trajectories([t], [0.0], [0])
    with pytest.raises(ValueError, match="one advantage"):
        TrainBatch.from_trajectories([Trajectory.start([1])], [], [])
    with pytest.raises(ValueError, match="one logprob per token"):
        Trajectory.start([1]).append_sample(Sample([2, 3], [], "stop", 0))


def test_trajectory_fields_are_checked():
    """Per-token fields of another length (a raw torch error later) and a mask other than 0/1 (a
    token weighed twice) are refused when the trajectory is made."""
    with pytest.raises(ValueError, match=r"Trajectory.logprobs has 1 entries for 2 tokens"):
        Trajectory([5, 6], [0, 1], [0.0], [-1, 0])
    with pytest.raises(ValueError, match="loss_mask entries must be 0 or 1"):
        Trajectory([5, 6], [0, 2], [0.0, -0.1], [-1, 0])
