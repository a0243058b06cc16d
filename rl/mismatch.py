"""The training-inference mismatch metric: how far the trainer's logprobs of the sampled tokens
are from the engine's.

Owns the three numbers reported per batch. Must never feed back into the loss (TIS, if wanted,
is the loss's business).

With x sampled from the engine's distribution q and the trainer's p, per token
delta = log p(x) - log q(x), and
- max_abs  = max |delta|, mean_abs = mean |delta|;
- k3_kl    = mean(exp(delta) - 1 - delta), Schulman's unbiased, non-negative estimator of KL(q || p).
Expected magnitudes (docs/rl.md): float32 on the same model code ~1e-6 (acceptance bound 1e-5);
bfloat16 ~1e-2 mean, dominated by the rounding of activations and logits.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(slots=True)
class Mismatch:
    max_abs: float
    mean_abs: float
    k3_kl: float
    num_tokens: int

    def to_dict(self, prefix: str = "mismatch_") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}


def mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> Mismatch:
    """Both [T] over the same sampled tokens (trained tokens only)."""
    if trainer_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(trainer_logprobs.shape)} vs {tuple(rollout_logprobs.shape)}")
    if trainer_logprobs.numel() == 0:
        return Mismatch(0.0, 0.0, 0.0, 0)
    delta = trainer_logprobs.detach().double() - rollout_logprobs.detach().double()
    k3 = torch.expm1(delta) - delta  # expm1: exact for the tiny deltas float32 produces
    return Mismatch(delta.abs().max().item(), delta.abs().mean().item(), k3.mean().item(), delta.numel())
