"""Policy-gradient losses over sampled tokens: GRPO, Dr. GRPO, DAPO, GSPO, with optional TIS.

Owns the per-token loss and how it is aggregated. Everything is expressed on a flat vector of
target tokens (one entry per trained token, `seq_idx` naming its sequence) with normalisers taken
from the *whole* batch, so splitting a batch into micro-batches (gradient accumulation) gives the
same gradient as one pass. Must never run the model; it receives logprobs.

Variants (`LOSSES`):
- grpo:    A = (R - mean) / std; token ratio clipped to [1-0.2, 1+0.2]; mean over each sequence's
           tokens, then over sequences (DeepSeekMath).
- dr_grpo: A = R - mean; sum over tokens / (L_max * num_sequences), L_max a constant (Dr. GRPO).
- dapo:    A = (R - mean) / std; clip-higher [1-0.2, 1+0.28]; one mean over all tokens of the
           batch (token-level); groups with zero reward variance dropped before batching.
- gspo:    sequence ratio s_i = exp(mean_t log r_it), clipped to [1-3e-4, 1+4e-4], written as
           GSPO-token (log s_it = sg(log s_i) + logp_t - sg(logp_t)) with sequence-mean
           aggregation, which has the sequence-level gradient.
TIS (`tis_cap`): each token's loss is multiplied by min(pi_old / pi_rollout, cap), detached; for
GSPO the weight is per sequence with the geometric mean ratio. It corrects for the engine's
distribution differing from the trainer's (mismatch, stale weights).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean")


@dataclass(slots=True, frozen=True)
class LossConfig:
    name: str
    scale_adv_by_std: bool  # GRPO's std division of advantages
    clip_low: float  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float
    aggregation: str  # one of AGGREGATIONS
    sequence_ratio: bool = False  # GSPO
    drop_zero_variance: bool = False  # DAPO dynamic sampling filter (applied when batching groups)
    tis_cap: float | None = None  # truncated importance sampling against the engine's logprobs
    max_len: int | None = None  # Dr. GRPO's constant L_max; None: the longest completion in the batch

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip ranges must be >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be > 0")


LOSSES: dict[str, LossConfig] = {
    "grpo": LossConfig("grpo", True, 0.2, 0.2, "seq-mean-token-mean"),
    "dr_grpo": LossConfig("dr_grpo", False, 0.2, 0.2, "seq-mean-token-sum-norm"),
    "dapo": LossConfig("dapo", True, 0.2, 0.28, "token-mean", drop_zero_variance=True),
    "gspo": LossConfig("gspo", True, 3e-4, 4e-4, "seq-mean-token-mean", sequence_ratio=True),
}


def loss_config(name: str, **overrides: object) -> LossConfig:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; one of {sorted(LOSSES)}")
    return dataclasses.replace(LOSSES[name], **overrides)


@dataclass(slots=True)
class Normalizer:
    """Batch-wide counts the aggregation divides by (fixed before any micro-batch runs)."""

    num_seqs: int
    num_tokens: int  # trained tokens in the batch
    max_len: int  # L_max for seq-mean-token-sum-norm


def _per_seq_sum(x: torch.Tensor, seq_idx: torch.Tensor, num: int) -> torch.Tensor:
    return torch.zeros(num, dtype=x.dtype, device=x.device).index_add_(0, seq_idx, x)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    seq_idx: torch.Tensor,
    num_seqs: int,
    cfg: LossConfig,
    norm: Normalizer,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch's trained tokens (already scaled for the whole batch).

    logprobs [T] (with grad), old_logprobs / rollout_logprobs [T], seq_idx [T] in [0, num_seqs)
    (local to this micro-batch), advantages [num_seqs]. Summing the returned losses of all
    micro-batches gives the batch loss.
    """
    old = old_logprobs.detach()
    counts = _per_seq_sum(torch.ones_like(logprobs), seq_idx, num_seqs).clamp_min(1)
    if cfg.sequence_ratio:
        seq_log_ratio = _per_seq_sum((logprobs - old).detach(), seq_idx, num_seqs) / counts
        log_ratio = seq_log_ratio[seq_idx] + logprobs - logprobs.detach()
    else:
        log_ratio = logprobs - old
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # clamp: a wild ratio must not overflow to inf
    adv = advantages[seq_idx]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if cfg.tis_cap is not None:
        gap = (old - rollout_logprobs).detach()
        if cfg.sequence_ratio:
            gap = (_per_seq_sum(gap, seq_idx, num_seqs) / counts)[seq_idx]
        per_token = per_token * torch.exp(gap).clamp(max=cfg.tis_cap)

    if cfg.aggregation == "token-mean":
        weights = torch.full_like(per_token, 1.0 / max(norm.num_tokens, 1))
    elif cfg.aggregation == "seq-mean-token-mean":
        weights = 1.0 / (counts[seq_idx] * max(norm.num_seqs, 1))
    else:
        weights = torch.full_like(per_token, 1.0 / (max(norm.max_len, 1) * max(norm.num_seqs, 1)))
    loss = (per_token * weights).sum()
    with torch.no_grad():  # the fraction of tokens whose gradient the clip removed
        clip_frac = (clipped < unclipped).float().mean().item() if per_token.numel() else 0.0
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio.detach().mean().item() if ratio.numel() else 1.0}
