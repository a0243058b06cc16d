"""Advantages and the policy losses: exact gradients at ratio 1, clipping, TIS, micro-batching."""
from __future__ import annotations

import math

import pytest
import torch

from cuttle.rl import Group, Sample, compute_advantages, drop_zero_variance, group_advantages, loss_config, policy_loss
from cuttle.rl.losses import Normalizer


def test_group_advantages():
    a = group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=True)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert a == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert group_advantages([3.0, 1.0], scale_by_std=False) == [1.0, -1.0]
    assert group_advantages([2.0, 2.0, 2.0], scale_by_std=True) == [0.0, 0.0, 0.0]
    assert group_advantages([5.0], scale_by_std=True) == [0.0]


def group(rewards: list[float]) -> Group:
    return Group([1, 2], [Sample([3], [-0.1], "stop", 0, reward=r) for r in rewards])


def test_drop_zero_variance_and_compute():
    gs = [group([1, 1]), group([0, 1]), group([0, 0])]
    kept = drop_zero_variance(gs)
    assert kept == [gs[1]]
    assert compute_advantages(kept, scale_by_std=False) == [[-0.5, 0.5]]


def test_non_finite_rewards_are_refused_naming_the_sample():
    """A NaN reward used to make its group's advantages NaN, then the loss and every trained weight
    (and DAPO's filter kept [1, nan, 2] but dropped [nan, 1], by element order)."""
    with pytest.raises(ValueError, match=r"rewards\[1\] is nan"):
        group_advantages([1.0, float("nan"), 2.0], scale_by_std=True)
    with pytest.raises(ValueError, match=r"group 1 rewards\[0\] is inf"):
        compute_advantages([group([0, 1]), group([float("inf"), 1])], scale_by_std=False)
    for rs in ([1.0, float("nan"), 2.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match="finite"):
            drop_zero_variance([group(rs)])
    assert drop_zero_variance([group([])]) == []  # an empty group has no signal (it raised)


def grads(name: str, lp_values: list[float], old: list[float], seq: list[int], adv: list[float], **over) -> tuple[torch.Tensor, float]:
    cfg = loss_config(name, **over)
    lp = torch.tensor(lp_values, requires_grad=True)
    seq_idx = torch.tensor(seq)
    counts = torch.bincount(seq_idx).tolist()
    norm = Normalizer(len(adv), len(seq), max(counts) if cfg.max_len is None else cfg.max_len)
    loss, _ = policy_loss(lp, torch.tensor(old), torch.tensor(old), torch.tensor(adv), seq_idx, len(adv), cfg, norm)
    loss.backward()
    return lp.grad, loss.item()


SEQ = [0, 0, 0, 1]  # sequence 0 has 3 trained tokens, sequence 1 has 1
ADV = [1.0, -2.0]
LP = [-1.0, -2.0, -0.5, -1.5]


@pytest.mark.parametrize("name,expected", [
    ("grpo", [-1 / (3 * 2)] * 3 + [2 / (1 * 2)]),  # mean over each sequence, then over sequences
    ("gspo", [-1 / (3 * 2)] * 3 + [2 / (1 * 2)]),  # sequence ratio: same gradient at ratio 1
    ("dapo", [-1 / 4] * 3 + [2 / 4]),  # one mean over all tokens
    ("dr_grpo", [-1 / (3 * 2)] * 3 + [2 / (3 * 2)]),  # sum / (L_max * num_seqs), L_max = 3
])
def test_on_policy_gradients(name, expected):
    g, _ = grads(name, LP, LP, SEQ, ADV)
    assert g.tolist() == pytest.approx(expected, rel=1e-6)


def test_dr_grpo_constant_normaliser():
    g, _ = grads("dr_grpo", LP, LP, SEQ, ADV, max_len=10)
    assert g.tolist() == pytest.approx([-1 / 20] * 3 + [2 / 20], rel=1e-6)


def test_clip_removes_gradient_beyond_the_trust_region():
    old = [v - math.log(1.25) for v in LP]  # ratio 1.25 on every token
    g_grpo, _ = grads("grpo", LP, old, SEQ, ADV)  # clip_high 0.2: positive-advantage tokens clipped
    assert g_grpo[:3].tolist() == [0.0, 0.0, 0.0]
    assert g_grpo[3].item() == pytest.approx(2 * 1.25 / 2, rel=1e-6)  # A < 0: min keeps the unclipped term
    g_dapo, _ = grads("dapo", LP, old, SEQ, ADV)  # clip-higher 0.28: 1.25 is inside
    assert g_dapo[:3].tolist() == pytest.approx([-1.25 / 4] * 3, rel=1e-6)


def test_gspo_clips_whole_sequences():
    old = list(LP)
    old[0] -= 0.003  # one token moved: the sequence's geometric-mean ratio exp(0.001) > 1 + 4e-4
    g, _ = grads("gspo", LP, old, SEQ, ADV)
    assert g[:3].tolist() == [0.0, 0.0, 0.0]
    assert g[3].item() != 0.0


def test_tis_weights_tokens_by_truncated_ratio():
    rollout = [v - math.log(4.0) for v in LP]  # engine was 4x less likely: weight min(4, cap)
    cfg = loss_config("grpo", tis_cap=2.0)
    lp = torch.tensor(LP, requires_grad=True)
    norm = Normalizer(2, 4, 3)
    loss, _ = policy_loss(lp, torch.tensor(LP), torch.tensor(rollout), torch.tensor(ADV), torch.tensor(SEQ), 2, cfg, norm)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([2 * -1 / 6] * 3 + [2 * 2 / 2], rel=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_micro_batches_sum_to_the_full_batch(name):
    cfg = loss_config(name)
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(10, generator=gen) - 2
    old = lp + 0.1 * torch.randn(10, generator=gen)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    norm = Normalizer(4, 10, 4)
    full, _ = policy_loss(lp, old, old, adv, seq, 4, cfg, norm)
    first, _ = policy_loss(lp[:5], old[:5], old[:5], adv[:2], seq[:5], 2, cfg, norm)
    second, _ = policy_loss(lp[5:], old[5:], old[5:], adv[2:], seq[5:] - 2, 2, cfg, norm)
    assert (first + second).item() == pytest.approx(full.item(), rel=1e-6)


def test_unknown_loss_and_bad_config():
    with pytest.raises(ValueError, match="unknown loss"):
        loss_config("ppo2")
    with pytest.raises(ValueError, match="aggregation"):
        loss_config("grpo", aggregation="sum")
