"""The engine sampler's processing of a token's logits, replayed on the trainer's logits, so the
trainer scores each sampled token under the distribution the engine drew it from.

Owns, in the order of engine/sampler.py `sample`: the token controls (`logit_bias` added, then
what `allowed_token_ids`, `bad_words`, a structured output's grammar and a spent thinking budget
(only the closing tag) exclude set to -inf: the
engine's own `StructuredOutput.prepare` and `fill_row`, so the same tokenizer rules and grammar
matcher), the penalties (repetition over the sample's context, presence / frequency over its own
engine request's output so far), `min_tokens`' stop ids, the temperature, and the top-k / top-p /
min-p truncation (the engine's own `truncation_mask`, renormalised). Out of place, so gradients
flow through every stage that is a function of the logits; what a mask excludes is chosen without
gradient. The values come from the rollout's sampling fields as the trainer's config holds them
(`TrainerConfig`, `TrainerConfig.for_sampler(sampler, sampling_params)`).

A token the replayed processing gives probability 0 could not have been sampled under it: the
config is not the rollout's, and scoring says so instead of returning -inf.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cuttle.engine.config import ModelConfig
from cuttle.engine.generation_config import model_eos_token_ids
from cuttle.engine.sampler import banned_tokens, truncates, truncation_mask
from cuttle.engine.structured_output import Controls, StructuredOutput
from cuttle.engine.tokenizer import Tokenizer
from cuttle.rl.batch import PackedBatch

if TYPE_CHECKING:
    from cuttle.rl.trainer import TrainerConfig


@dataclass(slots=True)
class _Row:
    """Where a row's trained tokens stand: `targets` [L] their indices in the row (whose ids are
    `ids`), `seq_start` [L] where each one's sequence begins in the row, and `output_start` [L]
    where its engine request's output begins (None: the batch records no sample starts)."""

    ids: list[int]
    targets: list[int]
    seq_start: list[int]
    output_start: list[int] | None

    def starts(self, why: str) -> list[int]:
        """Each trained token's request output start in the row; refused, saying `why` it is needed,
        where the batch does not know it."""
        if self.output_start is None:
            raise ValueError(f"{why} need the batch's output_starts (where each sample began); build it with "
                             "TrainBatch.from_trajectories / from_groups")
        if any(o < 0 for o in self.output_start):
            raise ValueError(f"{why} need to know where each sample began: a trajectory built without append_sample "
                             "records no sample starts")
        return self.output_start


class SamplingReplay:
    """Turns the trainer's logits of a row's trained tokens into the processed logits the engine
    sampled them from (`__call__`); log-softmax of its answer is the "processed" logprob."""

    TRUNCATION_CHUNK = 256  # positions whose [chunk, vocab] sort is held at once (top-p)

    def __init__(self, config: TrainerConfig, model_path: str, mc: ModelConfig, tokenizer: str | None = None) -> None:
        self.config = config
        self.vocab_size = mc.vocab_size
        params = config.rollout_params()
        folder = tokenizer or model_path
        # read only where a replayed rule needs it: a checkpoint without one trains as before
        needs_tokenizer = (params.bad_words is not None or params.structured_outputs is not None
                           or params.thinking_token_budget is not None)
        tok = Tokenizer(folder) if needs_tokenizer else None
        eos: set[int] = set()  # what min_tokens masks and a grammar ends with (the engine's EOS set)
        if (params.min_tokens and not params.ignore_eos) or params.structured_outputs is not None:
            if config.eos_token_ids is not None:
                eos = set(config.eos_token_ids)
            else:
                if tok is None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
                    tok = Tokenizer(folder)
                eos = model_eos_token_ids(model_path, mc, tok)
        eos = {t for t in eos if t < mc.vocab_size}  # (as the engine's mask stage keeps them)
        bad = next((t for t in params.stop_token_ids if t >= mc.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be in [0, {mc.vocab_size - 1}], got {bad}")
        # what min_tokens masks, as the engine's `_stop_ids`
        self.stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else eos)) if params.min_tokens else []
        self.mask_stage = StructuredOutput(tok if needs_tokenizer else None, mc.vocab_size, eos)
        # refused here as the engine refuses the request: ids past the vocabulary, a spec that does
        # not compile, allowed ids all banned, each naming its field
        self.controls: Controls | None = self.mask_stage.prepare(params, self.stop_ids)
        self.bias: torch.Tensor | None = None
        if self.controls is not None and self.controls.bias_ids is not None:
            self.bias = torch.zeros(mc.vocab_size).index_put_((self.controls.bias_ids,), self.controls.bias_vals)

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, a: int, b: int, ids: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
        """logits [L, V] at the row's trained tokens `targets` (indices into the row of sequences
        [a, b) of `batch`, whose token ids are `ids`) -> the processed logits [L, V]."""
        tokens = ids[targets]
        c = self.config
        if self.controls is not None or self.stop_ids or c.repetition_penalty != 1.0 or c.presence_penalty or c.frequency_penalty:
            cu = batch.cu_seqlens.tolist()
            t_cpu = targets.cpu()
            seq_start = torch.repeat_interleave(torch.tensor([s - cu[a] for s in cu[a:b]]), torch.tensor(batch.seq_lens[a:b]))
            starts = None if batch.output_starts is None else batch.output_starts[cu[a]:cu[b]][t_cpu].tolist()
            row = _Row(ids.cpu().tolist(), t_cpu.tolist(), seq_start[t_cpu].tolist(), starts)
            logits = self._controlled(logits, row)
            logits = self._penalized(logits, row)
            logits = self._min_tokens(logits, row)
        if c.temperature != 1.0:
            logits = logits / c.temperature
        logits = self._truncated(logits, tokens)
        if self.controls is not None or self.stop_ids:
            self._check_possible(logits, tokens, row)
        return logits

    def _controlled(self, logits: torch.Tensor, row: _Row) -> torch.Tensor:
        """logit_bias added, then every token the rollout's controls excluded at each position set
        to -inf: the bitmask row the engine's mask stage fills for the same output."""
        ctl = self.controls
        if ctl is None:
            return logits
        if self.bias is not None:
            logits = logits + self.bias.to(logits.device, logits.dtype)
        if not ctl.masks:
            return logits
        dynamic = ctl.grammar is not None or bool(ctl.bad_seqs) or ctl.think is not None or ctl.calls is not None
        if dynamic:
            starts = row.starts("bad_words / structured_outputs / thinking_token_budget")
        bitmask = torch.full((len(row.targets), self.mask_stage.width), -1, dtype=torch.int32)
        bits = bitmask.numpy().view("uint32")
        try:
            for k, t in enumerate(row.targets):
                # one matcher per engine request (its output's start in the row), fed in order
                start = row.seq_start[k] + starts[k] if dynamic else t
                err = self.mask_stage.fill_row(ctl, start, row.ids, start, t, bitmask, bits, k)
                if err is not None:
                    raise ValueError(f"structured_outputs: the sample's {err}; the trainer's spec must be the rollout's")
        finally:
            ctl.matchers.clear()
            ctl.thinking.clear()
            ctl.call_states.clear()
        return logits.masked_fill(banned_tokens(bitmask, self.vocab_size).to(logits.device), float("-inf"))

    PAIRS_PER_CHUNK = 1 << 22  # (position, context token) pairs a penalty chunk holds at once

    def _penalized(self, logits: torch.Tensor, row: _Row) -> torch.Tensor:
        """logits [L, V] after the rollout's penalties, as the engine's `apply_penalties` computes
        them for the same token: repetition divides a positive logit (multiplies a negative one)
        of every token in the sample's context so far (its request's prompt, here everything
        before it in its sequence, and its output so far), then presence / frequency subtract from
        each token its request's output has produced so far. Vectorised over (position, context
        token) pairs, in chunks of positions: only the entries a penalty changes are gathered and
        scattered back (the engine's dense subtraction of 0 from the others changes nothing). Out
        of place, so gradients flow through the penalised logits."""
        c = self.config
        rep, counting = c.repetition_penalty != 1.0, bool(c.presence_penalty or c.frequency_penalty)
        if not (rep or counting):
            return logits
        out_start = row.starts("presence_penalty / frequency_penalty") if counting else None
        ids = torch.tensor(row.ids, dtype=torch.long)
        t, s = torch.tensor(row.targets, dtype=torch.long), torch.tensor(row.seq_start, dtype=torch.long)
        o = s + torch.tensor(out_start, dtype=torch.long) if counting else s
        lens = t - s
        parts, first, acc = [], 0, 0
        for k, n in enumerate(lens.tolist()):
            if k > first and acc + n > self.PAIRS_PER_CHUNK:
                parts.append((first, k))
                first, acc = k, 0
            acc += n
        parts.append((first, len(lens)))
        out = []
        for k0, k1 in parts:
            x = logits[k0:k1]
            n = lens[k0:k1]
            which = torch.repeat_interleave(torch.arange(k1 - k0), n)  # each pair's position in the chunk
            pos = s[k0:k1][which] + torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)
            # a (position, token) pair as one index into the chunk's flattened logits
            key = which * self.vocab_size + ids[pos]
            if rep:
                seen = torch.unique(key).to(x.device)
                vals = x.flatten()[seen]
                vals = torch.where(vals > 0, vals / c.repetition_penalty, vals * c.repetition_penalty)
                x = x.flatten().scatter(0, seen, vals).view_as(x)
            if counting:
                own = pos >= o[k0:k1][which]  # the pairs of the token's own request's output
                hit, counts = torch.unique(key[own], return_counts=True)
                hit, counts = hit.to(x.device), counts.to(x.device, x.dtype)
                vals = x.flatten()[hit] - (c.frequency_penalty * counts + c.presence_penalty)
                x = x.flatten().scatter(0, hit, vals).view_as(x)
            out.append(x)
        return torch.cat(out) if len(out) > 1 else out[0]

    def _min_tokens(self, logits: torch.Tensor, row: _Row) -> torch.Tensor:
        """The stop ids at -inf where the token's request output was shorter than min_tokens."""
        if not self.stop_ids:
            return logits
        starts = row.starts("min_tokens")
        step = torch.tensor(row.targets) - torch.tensor(row.seq_start) - torch.tensor(starts)
        early = (step < self.config.min_tokens).nonzero().squeeze(1)
        if not early.numel():
            return logits
        masked = torch.zeros(logits.shape, dtype=torch.bool)
        masked[early[:, None], torch.tensor(self.stop_ids)[None, :]] = True
        return logits.masked_fill(masked.to(logits.device), float("-inf"))

    def _check_possible(self, logits: torch.Tensor, tokens: torch.Tensor, row: _Row) -> None:
        """Refuse to score a token the replayed processing excludes: the engine could not have
        sampled it so, and its logprob would be -inf."""
        if self.controls is None and not self.stop_ids:
            return
        bad = torch.isneginf(logits.detach().gather(1, tokens[:, None]).squeeze(1)).nonzero().flatten().tolist()
        if bad:
            k = bad[0]
            raise ValueError(f"token {row.ids[row.targets[k]]} at position {row.targets[k] - row.seq_start[k]} of its "
                             f"sequence has probability 0 under the trainer's logit_bias / allowed_token_ids / bad_words / "
                             f"structured_outputs / min_tokens ({len(bad)} such tokens): they must be the rollout's "
                             "(TrainerConfig.for_sampler(sampler, sampling_params))")

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

