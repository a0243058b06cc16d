"""The reference trainer: scores `TrainBatch`es with the engine's own model code, steps AdamW on
the chosen policy loss, and pushes the new weights back into a running engine.

Owns a training copy of the model (float32 master weights by default), its optimizer, and the
recomputation of the sampled tokens' logprobs (`CausalLM.forward_masked` over rows of whole
sequences, each under the attention it was sampled with: causal, or its squid layout's mask and
positions from `SquidLayout.dense_mask_and_positions`; the same parameters and math as the
engine, so the mismatch metric measures numerics, not model drift).
Must never sample and never hold engine state: weights reach the engine only through
`update_weights` on an `LLM`, an `AsyncEngine` caller or a `RolloutClient`.

One `step` is one optimizer step over the whole batch (micro-batched by tokens, gradients
accumulated); the old policy is the trainer's own weights at the start of the step, as in
on-policy GRPO with a single update per batch. The engine's logprobs enter only through TIS and
the mismatch metric.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cuttle.engine.config import DTYPES, ModelConfig
from cuttle.engine.models import CausalLM, load_model
from cuttle.rl.batch import PackedBatch, TrainBatch
from cuttle.rl.losses import LossConfig, Normalizer, loss_config, policy_loss
from cuttle.rl.mismatch import mismatch


class WeightTarget(Protocol):
    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], in_flight: str = "abort") -> int: ...


@dataclass(slots=True)
class TrainerConfig:
    loss: LossConfig = field(default_factory=lambda: loss_config("grpo"))
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # max global grad norm; None disables
    temperature: float = 1.0  # must equal the rollout's, so the trainer scores the sampling distribution
    max_tokens_per_row: int = 2048  # micro-batch size: whole sequences packed into one row
    dtype: str = "float32"


class Trainer:
    def __init__(self, model_path: str, config: TrainerConfig | None = None, device: str = "cpu",
                 freeze: tuple[str, ...] = ()):
        """`freeze`: parameter-name prefixes left untrained (e.g. ("embed",))."""
        self.config = config or TrainerConfig()
        self.device = torch.device(device)
        mc = ModelConfig.from_pretrained(model_path)
        self.model: CausalLM = load_model(model_path, mc, DTYPES[self.config.dtype], self.device)
        self.params = [p for n, p in self.model.named_parameters() if not n.startswith(freeze)]
        for p in self.params:
            p.requires_grad_(True)
        c = self.config
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)
        self.num_steps = 0

    # ---- scoring ---------------------------------------------------------------------------
    def _rows(self, batch: PackedBatch) -> Iterator[tuple[int, int]]:
        """Consecutive sequence ranges [a, b) whose tokens fit one row (a longer one goes alone)."""
        lens = batch.seq_lens
        a, total = 0, 0
        for i, n in enumerate(lens):
            if i > a and total + n > self.config.max_tokens_per_row:
                yield a, i
                a, total = i, 0
            total += n
        if a < len(lens):
            yield a, len(lens)

    def _row_logprobs(self, batch: PackedBatch, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """Logprobs of the trained tokens of sequences [a, b) (autograd follows the caller's mode),
        each token's sequence index local to the row, and the row's slice of the token stream."""
        cu = batch.cu_seqlens.tolist()
        span = slice(cu[a], cu[b])
        ids = batch.input_ids[span].to(self.device)
        pos = batch.position_ids[span].to(self.device)
        lens = torch.tensor(batch.seq_lens[a:b], device=self.device)
        doc = torch.repeat_interleave(torch.arange(b - a, device=self.device), lens)
        # block-diagonal: each sequence causal or under its squid layout, never seeing another
        mask = batch.row_mask(a, b).to(self.device)
        hidden = self.model.forward_masked(ids[None], pos[None], mask[None])[0]
        targets = batch.loss_mask[span].to(self.device).nonzero().squeeze(1)
        # token t is predicted by the logits at t - 1 (never across a sequence: position 0 is untrained)
        logits = self.model.compute_logits(hidden[targets - 1])
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[targets][:, None]).squeeze(1)
        return lp, doc[targets], span

    @torch.no_grad()
    def score(self, batch: TrainBatch | PackedBatch) -> torch.Tensor:
        """The trainer's logprobs of every trained token, in stream order: aligned with
        `packed.rollout_logprobs[packed.loss_mask > 0]`."""
        packed = batch.packed() if isinstance(batch, TrainBatch) else batch
        return torch.cat([self._row_logprobs(packed, a, b)[0] for a, b in self._rows(packed)]).cpu()

    # ---- training --------------------------------------------------------------------------
    def step(self, batch: TrainBatch | PackedBatch) -> dict[str, float]:
        """One AdamW step on the configured loss; returns loss, grad norm, mismatch and reward stats."""
        t0 = time.perf_counter()
        packed = batch.packed() if isinstance(batch, TrainBatch) else batch
        cfg = self.config.loss
        trained_per_seq = [int(packed.loss_mask[s:e].sum().item()) for s, e in zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist())]
        norm = Normalizer(packed.num_seqs, sum(trained_per_seq), cfg.max_len or max(trained_per_seq, default=1))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, clip_fracs, scored = 0.0, [], []
        for a, b in self._rows(packed):
            lp, seq_idx, span = self._row_logprobs(packed, a, b)
            mask = packed.loss_mask[span] > 0
            rollout = packed.rollout_logprobs[span][mask].to(lp.device)
            loss, stats = policy_loss(lp, lp.detach(), rollout, packed.advantages[a:b].to(lp.device), seq_idx, b - a, cfg, norm)
            loss.backward()
            total_loss += loss.item()
            clip_fracs.append(stats["clip_frac"])
            scored.append(lp.detach().cpu())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip or float("inf")).item()
        self.optimizer.step()
        self.num_steps += 1
        rollout_all = packed.rollout_logprobs[packed.loss_mask > 0]
        return {
            "loss": total_loss,
            "grad_norm": grad_norm,
            "clip_frac": sum(clip_fracs) / max(len(clip_fracs), 1),
            "reward_mean": packed.rewards.mean().item(),
            "num_seqs": float(packed.num_seqs),
            "num_trained_tokens": float(norm.num_tokens),
            "train_seconds": time.perf_counter() - t0,
            **mismatch(torch.cat(scored), rollout_all).to_dict(),
        }

    # ---- weight sync -----------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under the engine's own parameter names (no HF name round trip)."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def push_weights(self, target: WeightTarget, in_flight: str = "abort") -> int:
        """Load the current weights into a running engine; returns its new weight version."""
        return target.update_weights(self.named_weights(), in_flight)
