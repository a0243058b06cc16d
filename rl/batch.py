"""`TrainBatch`: the hand-off from rollouts to any PyTorch trainer, padded or packed.

Owns the layout of sequences (prompt + every turn, token ids as sampled) and the per-token and
per-sequence fields a policy-gradient loss needs. Must never compute advantages or run a model:
it arranges what it is given.

Token convention: position t of a sequence holds token t; `loss_mask[t] = 1` when token t was
sampled by the model and is trained on (its logprob comes from the logits at position t - 1), and
`rollout_logprobs[t]` is the engine's logprob of token t (0.0 where the mask is 0). Prompt, tool
output and padding are all mask 0.

Squid documents: a sequence sampled with documents is laid out as the dense row of its layout
(`SquidLayout.dense_context()`: prefix, documents, then the query and the turns), with the
positions the sampler used, and keeps its layout in `layouts`; its attention is not causal, so a
trainer must use `dense_masks()` (padded) or `row_mask(a, b)` (packed), which rebuild it with
`SquidLayout.dense_mask_and_positions`, the engine's one definition of that attention. Plain
sequences get the causal mask from the same methods, so a trainer can use them for every batch.
NSA models also need each token's segment and its shift (`dense_segments()`, `row_segments(a, b)`:
NSA's rules are per segment).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuttle.engine.squid import SquidLayout
from cuttle.rl.types import Group, Trajectory


def sequence_segments(layout: SquidLayout | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[length] int64 twice: each token's piece of its sequence (one for a plain sequence; the
    layout's prefix, documents, copies and tail for a squid one) and that piece's shift
    (`SquidLayout.dense_segments`): what NSA and top-k (`sparse_attention`) layers attend by."""
    if layout is None:
        return torch.zeros(length, dtype=torch.long), torch.zeros(length, dtype=torch.long)
    return layout.dense_segments(length - len(layout.dense_context()))


def _numbered(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences' (ids, shifts) laid back to back, each sequence's ids made distinct from the others'."""
    ids, shifts, at = [], [], 0
    for i, sh in pieces:
        ids.append(i + at)
        shifts.append(sh)
        at += int(i.max()) + 1 if i.numel() else 0
    return torch.cat(ids), torch.cat(shifts)


def sequence_mask(layout: SquidLayout | None, length: int) -> torch.Tensor:
    """[length, length] bool attention of one sequence: causal, or its squid layout's."""
    if layout is None:
        return torch.ones(length, length, dtype=torch.bool).tril()
    tail = length - len(layout.dense_context())
    if tail <= 0:
        raise ValueError(f"a squid sequence of {length} tokens has no tokens after its documents")
    return layout.dense_mask_and_positions(tail)[0]


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
    layouts          N entries   each sequence's squid layout, or None (plain causal); None: all plain
    token_versions   [T] int64   the weight version that sampled each token (-1 where loss_mask is 0)
    output_starts    [T] int64   where a trained token's sample (one engine request's output) begins,
                                 as an index in its sequence (-1 where loss_mask is 0; UNKNOWN_START
                                 where the trajectory did not record it)
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
    layouts: list[SquidLayout | None] | None = None
    token_versions: torch.Tensor | None = None
    output_starts: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def row_mask(self, a: int, b: int) -> torch.Tensor:
        """[T, T] bool attention over sequences [a, b) laid back to back (tokens cu_seqlens[a]:
        cu_seqlens[b]): block-diagonal, each block its sequence's own (causal or squid), so the
        sequences of a row never see each other and each is computed exactly as if alone."""
        layouts = self.layouts or [None] * self.num_seqs
        return torch.block_diag(*(sequence_mask(layouts[i], n) for i, n in zip(range(a, b), self.seq_lens[a:b])))

    def row_segments(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] int64 twice, for the same row as `row_mask(a, b)`: each token's segment (distinct
        across the row's sequences) and its shift; `CausalLM.forward_masked(segments=,
        segment_shifts=)` needs them for NSA and top-k (`sparse_attention`) layers."""
        layouts = self.layouts or [None] * self.num_seqs
        return _numbered([sequence_segments(layouts[i], n) for i, n in zip(range(a, b), self.seq_lens[a:b])])


@dataclass(slots=True)
class TrainBatch:
    """N sequences right-padded to the longest, S columns.

    input_ids        [N, S] int64   prompt + completion (+ later turns) tokens; padding is `pad_id`
    attention_mask   [N, S] bool    True on real tokens
    position_ids     [N, S] int64   0 .. len-1 on real tokens (a squid row: its layout's), 0 on padding
    loss_mask        [N, S] float32 1 on trained (model-sampled) tokens; 0 on prompt, tool, padding
    rollout_logprobs [N, S] float32 the engine's logprob of each token (0 where loss_mask is 0)
    advantages       [N] float32    one per sequence (broadcast over its trained tokens)
    rewards          [N] float32    the reward each sequence got
    group_ids        [N] int64      which group (prompt) a sequence belongs to
    weight_version   [N] int64      the oldest weight version that sampled any of its tokens
    layouts          N entries      each sequence's squid layout, or None (plain causal); None: all plain
    token_versions   [N, S] int64   the weight version that sampled each token (-1 where loss_mask is
                                    0); a partial rollout carried across an update has several
    output_starts    [N, S] int64   where a trained token's sample begins in its row (PackedBatch's)

    `attention_mask` only marks real tokens; the attention itself is `dense_masks()`.
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
    layouts: list[SquidLayout | None] | None = None
    token_versions: torch.Tensor | None = None
    output_starts: torch.Tensor | None = None

    @classmethod
    def from_trajectories(
        cls, trajectories: list[Trajectory], advantages: list[float], group_ids: list[int], pad_id: int = 0
    ) -> TrainBatch:
        if not (len(trajectories) == len(advantages) == len(group_ids)):
            raise ValueError("need one advantage and one group id per trajectory")
        if not trajectories:
            raise ValueError("a TrainBatch needs at least one sequence")
        rows = []  # (tokens, positions, context length) per sequence
        for t in trajectories:
            if t.layout is None:
                rows.append((t.token_ids, list(range(len(t.token_ids))), 0))
            else:
                ctx = t.layout.dense_context()
                _, pos = t.layout.dense_mask_and_positions(len(t.token_ids))
                rows.append((ctx + t.token_ids, pos.tolist(), len(ctx)))
        n, s = len(trajectories), max(len(r[0]) for r in rows)
        input_ids = torch.full((n, s), pad_id, dtype=torch.long)
        attention = torch.zeros(n, s, dtype=torch.bool)
        positions = torch.zeros(n, s, dtype=torch.long)
        loss_mask = torch.zeros(n, s)
        rollout = torch.zeros(n, s)
        token_versions = torch.full((n, s), -1, dtype=torch.long)
        output_starts = torch.full((n, s), -1, dtype=torch.long)
        versions = []
        for i, (t, (ids, pos, c)) in enumerate(zip(trajectories, rows)):
            k = len(ids)
            if t.token_ids and t.loss_mask[0]:
                what = "the first token after the documents" if t.layout is not None else "a sequence's first token"
                raise ValueError(f"{what} cannot be trained on (it is not predicted from its own stream)")
            input_ids[i, :k] = torch.tensor(ids)
            attention[i, :k] = True
            positions[i, :k] = torch.tensor(pos)
            loss_mask[i, c:k] = torch.tensor(t.loss_mask, dtype=torch.float32)
            rollout[i, c:k] = torch.tensor(t.logprobs, dtype=torch.float32)
            token_versions[i, c:k] = torch.tensor([v if m else -1 for v, m in zip(t.weight_versions, t.loss_mask)],
                                                  dtype=torch.long)
            output_starts[i, c:k] = torch.tensor(_output_starts(t), dtype=torch.long) + torch.tensor(t.loss_mask) * c
            sampled = [v for v, m in zip(t.weight_versions, t.loss_mask) if m]
            versions.append(min(sampled) if sampled else -1)
        layouts = [t.layout for t in trajectories]
        return cls(
            input_ids, attention, positions, loss_mask, rollout * loss_mask,
            torch.tensor(advantages, dtype=torch.float32),
            torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            torch.tensor(group_ids, dtype=torch.long),
            torch.tensor(versions, dtype=torch.long),
            layouts if any(lay is not None for lay in layouts) else None,
            token_versions,
            output_starts,
        )

    @classmethod
    def from_groups(cls, groups: list[Group], advantages: list[list[float]], pad_id: int = 0) -> TrainBatch:
        """One sequence per sample: the group's prompt (mask 0) then the sample (mask 1); a group
        with documents keeps its layout in front."""
        trajs: list[Trajectory] = []
        flat_adv: list[float] = []
        gids: list[int] = []
        for gi, (g, adv) in enumerate(zip(groups, advantages, strict=True)):
            for s, a in zip(g.samples, adv, strict=True):
                t = Trajectory.start(g.prompt_token_ids, g.layout)
                t.append_sample(s)
                t.reward = s.reward
                trajs.append(t)
                flat_adv.append(a)
                gids.append(gi)
        return cls.from_trajectories(trajs, flat_adv, gids, pad_id)

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    def dense_masks(self) -> torch.Tensor:
        """[N, S, S] bool attention per row (causal, or the row's squid layout's). The padding
        after a sequence is causal among itself, never seen by a real token: every row of the mask
        has a key (what `forward_masked` needs), and the padding is one segment for NSA layers."""
        n, s = self.input_ids.shape
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        out = torch.zeros(n, s, s, dtype=torch.bool)
        lens = self.attention_mask.sum(dim=1).tolist()
        layouts = self.layouts or [None] * n
        for i, k in enumerate(lens):
            out[i, :k, :k] = sequence_mask(layouts[i], k)
            out[i, k:, k:] = causal[k:, k:]
        return out

    def dense_segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, S] int64 twice, for the rows of `dense_masks()`: each token's segment (a row's
        padding one more) and its shift, for `forward_masked(segments=, segment_shifts=)`."""
        n, s = self.input_ids.shape
        ids = torch.full((n, s), s, dtype=torch.long)  # the padding: one segment past any real one
        shifts = torch.zeros(n, s, dtype=torch.long)
        layouts = self.layouts or [None] * n
        for i, k in enumerate(self.attention_mask.sum(dim=1).tolist()):
            ids[i, :k], shifts[i, :k] = sequence_segments(layouts[i], k)
        return ids, shifts

    def packed(self) -> PackedBatch:
        lens = self.attention_mask.sum(dim=1)
        cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        keep = self.attention_mask
        return PackedBatch(
            self.input_ids[keep], self.position_ids[keep], cu, self.loss_mask[keep], self.rollout_logprobs[keep],
            self.advantages, self.rewards, self.group_ids, self.weight_version, self.layouts,
            None if self.token_versions is None else self.token_versions[keep],
            None if self.output_starts is None else self.output_starts[keep],
        )


UNKNOWN_START = -(2**62)  # a trained token whose trajectory did not record where its sample began


def _output_starts(t: Trajectory) -> list[int]:
    """Per token of `t`: where its sample begins in `t.token_ids` for a trained token (the last
    recorded sample start at or before it), -1 for the others, UNKNOWN_START for trained tokens of
    a trajectory built without `append_sample` (no starts recorded)."""
    out, starts, j = [], t.sample_starts, -1
    for i, m in enumerate(t.loss_mask):
        while j + 1 < len(starts) and starts[j + 1] <= i:
            j += 1
        out.append(-1 if not m else starts[j] if j >= 0 else UNKNOWN_START)
    return out
