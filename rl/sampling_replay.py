"""The engine sampler's processing of a token's logits, replayed on the trainer's logits, so the
trainer scores each sampled token under the distribution the engine drew it from.

Owns, in the order of engine/sampler.py `sample`: the penalties (repetition over the sample's
context, presence / frequency over its own engine request's output so far), the temperature, and
the top-k / top-p / min-p truncation (the engine's own `truncation_mask`, renormalised). Out of
place, so gradients flow through every stage that is a function of the logits; what truncation
excludes is chosen without gradient. The values come from the rollout's sampling fields as the
trainer's config holds them (`TrainerConfig`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cuttle.engine.sampler import truncates, truncation_mask
from cuttle.rl.batch import PackedBatch

if TYPE_CHECKING:
    from cuttle.rl.trainer import TrainerConfig


class SamplingReplay:
    """Turns the trainer's logits of a row's trained tokens into the processed logits the engine
    sampled them from (`__call__`); log-softmax of its answer is the "processed" logprob."""

    TRUNCATION_CHUNK = 256  # positions whose [chunk, vocab] sort is held at once (top-p)

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, a: int, b: int, ids: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
        """logits [L, V] at the row's trained tokens `targets` (indices into the row of sequences
        [a, b) of `batch`, whose token ids are `ids`) -> the processed logits [L, V]."""
        logits = self._penalized(logits, batch, a, b, ids, targets)
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        return self._truncated(logits, ids[targets])

    def _penalized(self, logits: torch.Tensor, batch: PackedBatch, a: int, b: int, ids: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
        """logits [L, V] (of the row's trained tokens `targets`) after the rollout's penalties, as
        the engine's `apply_penalties` computes them for the same token: repetition divides a
        positive logit (multiplies a negative one) of every token in the sample's context so far
        (its request's prompt, here everything before it in its sequence, and its output so far),
        then presence / frequency subtract from each token its request's output has produced so
        far. Out of place (gather, then scatter), so gradients flow through the penalised logits."""
        c = self.config
        rep, counting = c.repetition_penalty != 1.0, bool(c.presence_penalty or c.frequency_penalty)
        if not (rep or counting):
            return logits
        cu = batch.cu_seqlens.tolist()
        seq_start = torch.repeat_interleave(torch.tensor([s - cu[a] for s in cu[a:b]]), torch.tensor(batch.seq_lens[a:b]))
        row = ids.cpu()
        t_list, s_list = targets.cpu().tolist(), seq_start[targets.cpu()].tolist()
        if rep:
            seen = [torch.unique(row[s:t]) for t, s in zip(t_list, s_list)]
            idx = _padded(seen, logits.device)
            vals = logits.gather(1, idx)
            logits = logits.scatter(1, idx, torch.where(vals > 0, vals / c.repetition_penalty, vals * c.repetition_penalty))
        if counting:
            if batch.output_starts is None:
                raise ValueError("presence_penalty / frequency_penalty need the batch's output_starts (where each sample "
                                 "began); build it with TrainBatch.from_trajectories / from_groups")
            starts = batch.output_starts[cu[a]:cu[b]][targets.cpu()]
            if bool((starts < 0).any()):
                raise ValueError("presence_penalty / frequency_penalty need to know where each sample began: a trajectory "
                                 "built without append_sample records no sample starts")
            uniq = [torch.unique(row[s + o:t], return_counts=True) for t, s, o in zip(t_list, s_list, starts.tolist())]
            idx = _padded([u for u, _ in uniq], logits.device)
            counts = _padded([n for _, n in uniq], logits.device).to(logits.dtype)  # (padded as idx: 0 where empty)
            vals = logits.gather(1, idx)
            logits = logits.scatter(1, idx, vals - (c.frequency_penalty * counts + c.presence_penalty * (counts > 0).to(logits.dtype)))
        return logits


    def _truncated(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """logits with what the rollout's top-k / top-p / min-p excluded at -inf (the engine's
        `truncation_mask`, chosen without gradient), the sampled token always kept: the engine
        kept it, and a near-tie at the cut that rounds the other way here must not make its
        logprob -inf."""
        c = self.config
        if not truncates(c.top_k, c.top_p, c.min_p, logits.shape[-1]):
            return logits
        with torch.no_grad():
            drop = torch.cat([truncation_mask(part.float(), c.top_k, c.top_p, c.min_p)
                              for part in logits.detach().split(self.TRUNCATION_CHUNK)])
            drop[torch.arange(len(tokens), device=drop.device), tokens] = False
        return logits.masked_fill(drop, float("-inf"))


def _padded(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[L, max len] of 1-D int tensors, each row padded with copies of its first entry (so a scatter
    writes that entry's own value again), an empty row all 0 (index 0 with a count of 0: a no-op)."""
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = r
            out[i, len(r):] = r[0]
    return out.to(device)
