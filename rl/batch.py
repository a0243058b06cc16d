"""`TrainBatch`: the hand-off from rollouts to any PyTorch trainer, padded or packed.

Owns the layout of sequences (prompt + every turn, token ids as sampled) and the per-token and
per-sequence fields a policy-gradient loss needs. Must never compute advantages or run a model:
it arranges what it is given.

Token convention: position t of a sequence holds token t; `loss_mask[t] = 1` when token t was
sampled by the model and is trained on (its logprob comes from the logits at position t - 1), and
`rollout_logprobs[t]` is the engine's logprob of token t (0.0 where the mask is 0). Prompt, tool
output and padding are all mask 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuttle.rl.types import Group, Trajectory


@dataclass(slots=True)
class PackedBatch:
    """Every sequence concatenated into one stream of T tokens; N sequences.

    input_ids        [T] int64   tokens of all sequences back to back
    position_ids     [T] int64   position within its own sequence (restarts at 0 per sequence)
    cu_seqlens       [N+1] int32 sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    loss_mask        [T] float32 1 on trained (model-sampled) tokens
    rollout_logprobs [T] float32 the engine's logprob of each token (0 where loss_mask is 0)
    advantages       [N] float32 one per sequence (broadcast over its trained tokens)
    rewards          [N] float32 the reward each sequence got
    group_ids        [N] int64   which group (prompt) a sequence belongs to
    weight_version   [N] int64   the oldest weight version that sampled any of its tokens
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    weight_version: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


@dataclass(slots=True)
class TrainBatch:
    """N sequences right-padded to the longest, S columns.

    input_ids        [N, S] int64   prompt + completion (+ later turns) tokens; padding is `pad_id`
    attention_mask   [N, S] bool    True on real tokens
    position_ids     [N, S] int64   0 .. len-1 on real tokens, 0 on padding
    loss_mask        [N, S] float32 1 on trained (model-sampled) tokens; 0 on prompt, tool, padding
    rollout_logprobs [N, S] float32 the engine's logprob of each token (0 where loss_mask is 0)
    advantages       [N] float32    one per sequence (broadcast over its trained tokens)
    rewards          [N] float32    the reward each sequence got
    group_ids        [N] int64      which group (prompt) a sequence belongs to
    weight_version   [N] int64      the oldest weight version that sampled any of its tokens
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    weight_version: torch.Tensor

    @classmethod
    def from_trajectories(
        cls, trajectories: list[Trajectory], advantages: list[float], group_ids: list[int], pad_id: int = 0
    ) -> TrainBatch:
        if not (len(trajectories) == len(advantages) == len(group_ids)):
            raise ValueError("need one advantage and one group id per trajectory")
        if not trajectories:
            raise ValueError("a TrainBatch needs at least one sequence")
        n, s = len(trajectories), max(len(t.token_ids) for t in trajectories)
        input_ids = torch.full((n, s), pad_id, dtype=torch.long)
        attention = torch.zeros(n, s, dtype=torch.bool)
        positions = torch.zeros(n, s, dtype=torch.long)
        loss_mask = torch.zeros(n, s)
        rollout = torch.zeros(n, s)
        versions = []
        for i, t in enumerate(trajectories):
            k = len(t.token_ids)
            if k and t.loss_mask[0]:
                raise ValueError("a sequence's first token cannot be trained on (nothing precedes it)")
            input_ids[i, :k] = torch.tensor(t.token_ids)
            attention[i, :k] = True
            positions[i, :k] = torch.arange(k)
            loss_mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.float32)
            rollout[i, :k] = torch.tensor(t.logprobs, dtype=torch.float32)
            sampled = [v for v, m in zip(t.weight_versions, t.loss_mask) if m]
            versions.append(min(sampled) if sampled else -1)
        return cls(
            input_ids, attention, positions, loss_mask, rollout * loss_mask,
            torch.tensor(advantages, dtype=torch.float32),
            torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            torch.tensor(group_ids, dtype=torch.long),
            torch.tensor(versions, dtype=torch.long),
        )

    @classmethod
    def from_groups(cls, groups: list[Group], advantages: list[list[float]], pad_id: int = 0) -> TrainBatch:
        """One sequence per sample: the group's prompt (mask 0) then the sample (mask 1)."""
        trajs: list[Trajectory] = []
        flat_adv: list[float] = []
        gids: list[int] = []
        for gi, (g, adv) in enumerate(zip(groups, advantages, strict=True)):
            for s, a in zip(g.samples, adv, strict=True):
                t = Trajectory.start(g.prompt_token_ids)
                t.append_sample(s)
                t.reward = s.reward
                trajs.append(t)
                flat_adv.append(a)
                gids.append(gi)
        return cls.from_trajectories(trajs, flat_adv, gids, pad_id)

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    def packed(self) -> PackedBatch:
        lens = self.attention_mask.sum(dim=1)
        cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        keep = self.attention_mask
        return PackedBatch(
            self.input_ids[keep], self.position_ids[keep], cu, self.loss_mask[keep], self.rollout_logprobs[keep],
            self.advantages, self.rewards, self.group_ids, self.weight_version,
        )
