"""Group-relative advantages (GRPO, Dr. GRPO) and DAPO's zero-variance group filter.

Owns turning each group's rewards into one advantage per sample. Must never look at tokens or
logprobs: an advantage here is a function of the group's rewards only.
"""
from __future__ import annotations

import math

import torch

from cuttle.rl.types import Group


def group_advantages(rewards: list[float], scale_by_std: bool, eps: float = 1e-6, where: str = "rewards") -> list[float]:
    """A_i = R_i - mean(R), divided by std(R) + eps when `scale_by_std` (GRPO; Dr. GRPO skips it).

    std is the unbiased sample std, as in DeepSeekMath / TRL; a one-sample group has A = 0.
    A non-finite reward is refused; `where` names the rewards in that error.
    """
    _check_finite(rewards, where)
    r = torch.tensor(rewards, dtype=torch.float64)
    if r.numel() < 2:
        return [0.0] * r.numel()
    a = r - r.mean()
    if scale_by_std:
        a = a / (r.std(unbiased=True) + eps)
    return a.tolist()


def _check_finite(rewards: list[float], where: str = "rewards") -> None:
    """A NaN or infinite reward would make every advantage of its group NaN, then the loss, then
    every trained weight (and the engine's after a sync): refused, naming the sample."""
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"{where}[{i}] is {r}: rewards must be finite numbers")


def compute_advantages(groups: list[Group], scale_by_std: bool) -> list[list[float]]:
    return [group_advantages(g.rewards, scale_by_std, where=f"group {gi} rewards") for gi, g in enumerate(groups)]


def has_signal(group: Group) -> bool:
    """False when every sample got the same reward: the group's advantages are all zero."""
    rs = group.rewards
    _check_finite(rs)
    return bool(rs) and max(rs) > min(rs)


def drop_zero_variance(groups: list[Group]) -> list[Group]:
    """DAPO dynamic sampling's filter: keep only groups whose rewards differ."""
    return [g for g in groups if has_signal(g)]
