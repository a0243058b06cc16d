"""Turns logits rows into tokens and logprobs, one row per sample being extended this step.

Randomness is counter-based: sample `index` of a request with seed `s` draws its t-th token from
the uniform u = splitmix64(s, index, t), then inverts the CDF of its processed distribution. So a
seeded request produces the same tokens whatever else shares the batch, across preemption and
recompute, and without a Python generator object per request on the hot path.

Logprobs (`logprobs_mode`):
- "processed" (default): log-softmax of the logits the token was sampled from, i.e. after
  penalties, temperature, and top-k / top-p / min-p truncation (renormalized). For greedy rows,
  penalties only. This is the sampling policy's own logprob, the one importance ratios need.
- "raw": log-softmax of the model's logits before any processing.

The token mask (structured output, allowed_token_ids, bad_words, logit_bias; built by
engine/structured_output.py while the model ran) is the first processing stage: "processed"
logprobs are those of the masked distribution, "raw" ones are not. A batch without any of these
controls passes `mask=None` and pays nothing for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cuttle.attention.native.argmax import argmax
from cuttle.attention.native.token_mask import apply_bitmask
from cuttle.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cuttle.engine.structured_output import TokenMask

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLD
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def counter_uniform(seeds: list[int], indices: list[int], steps: list[int]) -> torch.Tensor:
    """Uniforms in [0, 1), one per (seed, sample index, output position), as float64."""
    with np.errstate(over="ignore"):
        s = np.array([x & 0xFFFFFFFFFFFFFFFF for x in seeds], dtype=np.uint64)
        h = _splitmix64(s)
        h = _splitmix64(h ^ np.array(indices, dtype=np.uint64))
        h = _splitmix64(h ^ np.array(steps, dtype=np.uint64))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None

    def __float__(self) -> float:
        return self.logprob


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    seed: int
    index: int  # sample index within its request
    step: int  # number of tokens this sample has generated so far
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: list[int]  # suppressed while below min_tokens (EOS unless ignore_eos, stop_token_ids)


@dataclass(slots=True)
class SampleResult:
    token: int
    logprob: float
    top: dict[int, Logprob] | None
    failed: str | None = None  # why nothing could be sampled (token is then -1): the engine fails the request


def apply_penalties(logits: torch.Tensor, rows: list[SampleRequest]) -> None:
    """In place: repetition penalty over prompt+output tokens, presence/frequency over output."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.long)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


# bit t of a bitmask word, as int32 (bit 31 is the sign bit)
_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """In place: add the logit_bias entries, then set every token whose bit is clear to -inf."""
    if mask.bias_rows is not None and mask.bias_rows.numel():
        logits.index_put_((mask.bias_rows, mask.bias_ids), mask.bias_vals.to(logits.dtype), accumulate=True)
    if not mask.rows or apply_bitmask(logits, mask.rows, mask.bitmask):
        return
    banned = banned_tokens(mask.bitmask, logits.shape[1])
    if len(mask.rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        for r, b in zip(mask.rows, banned):
            logits[r].masked_fill_(b, float("-inf"))


def banned_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: True where a token's bit is clear in the int32 bitmask [rows, words] (bit
    t of word w is token 32 w + t, xgrammar's layout)."""
    return ((bitmask.unsqueeze(-1) & _BITS) == 0).view(bitmask.shape[0], -1)[:, :vocab]


def sample(logits: torch.Tensor, rows: list[SampleRequest], logprobs_mode: str = "processed",
           mask: TokenMask | None = None, greedy: torch.Tensor | None = None) -> list[SampleResult]:
    """logits [N, V] float32 (modified in place). Rows whose params ask for no logprobs get 0.0.
    `greedy`: argmax(logits) already computed (a decode graph's, [N] int64), used when the batch
    is plain greedy."""
    if mask is None and logprobs_mode == "processed" and all(map(_plain_greedy, rows)):
        # the common greedy batch: the argmax is the whole answer (what the general path below
        # returns for these rows too), without its per-step tensors
        tokens = greedy if greedy is not None else argmax(logits)
        return [SampleResult(t, 0.0, None) for t in tokens.tolist()]
    n = len(rows)
    raw_lp = torch.log_softmax(logits, dim=-1) if logprobs_mode == "raw" else None
    if mask is not None:
        apply_token_mask(logits, mask)
    if any(r.params.has_penalties for r in rows):
        apply_penalties(logits, rows)
    min_masked = False
    for i, r in enumerate(rows):
        if r.params.min_tokens and r.step < r.params.min_tokens and r.stop_ids:
            logits[i, torch.tensor(r.stop_ids, dtype=torch.long)] = float("-inf")
            min_masked = True
    dead: list[int] = []
    if mask is not None or min_masked:
        # a row the controls left without any token (a grammar's allowed tokens all bad words, say;
        # what admission can see is refused there): it would sample token 0 or NaN logprobs
        dead = torch.isneginf(logits.amax(dim=-1)).nonzero().flatten().tolist()
        if dead:
            logits[dead] = 0.0  # keeps the batch's math finite; these rows' picks are replaced below

    temps = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows], dtype=logits.dtype)
    x = logits.div_(temps[:, None]) if any(t != 1.0 for t in temps.tolist()) else logits
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    _truncate(x, rows, random_rows)
    want_lp = bool(random_rows) or any(r.params.logprobs is not None for r in rows)
    # greedy rows that asked for no logprobs skip the vocab-wide log-softmax entirely
    lp = torch.log_softmax(x, dim=-1) if want_lp else None

    tokens = argmax(x)
    if random_rows:
        assert lp is not None
        idx = torch.tensor(random_rows, dtype=torch.long)
        probs = lp[idx].exp()
        cdf = probs.cumsum(dim=-1)
        u = counter_uniform([rows[i].seed for i in random_rows], [rows[i].index for i in random_rows], [rows[i].step for i in random_rows])
        target = (u * cdf[:, -1].double()).to(cdf.dtype)[:, None]
        picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        # A float32 cdf can end a hair below its total; never land on a token of probability 0.
        bad = probs.gather(1, picked[:, None]).squeeze(1) == 0
        if bad.any():
            picked[bad] = probs[bad].argmax(dim=-1)
        tokens[idx] = picked

    out_lp = raw_lp if raw_lp is not None else lp
    tok_list = tokens.tolist()
    if out_lp is None:
        results = [SampleResult(t, 0.0, None) for t in tok_list]
    else:
        chosen = out_lp.gather(1, tokens[:, None]).squeeze(1).tolist()
        results = []
        for i in range(n):
            k = rows[i].params.logprobs
            top = None
            if k is not None:
                top = _top_logprobs(out_lp[i], tok_list[i], chosen[i], k)
            results.append(SampleResult(tok_list[i], chosen[i], top))
    for i in dead:
        results[i] = SampleResult(-1, 0.0, None, failed="no token may be sampled: the request's controls (allowed_token_ids, "
                                  "bad_words, logit_bias, structured output, min_tokens) exclude every token at this step")
    return results


def _plain_greedy(r: SampleRequest) -> bool:
    """A greedy row with nothing to apply before the argmax and no logprobs to report."""
    p = r.params
    return (p.temperature == 0.0 and p.logprobs is None and not p.has_penalties
            and not (p.min_tokens and r.step < p.min_tokens and r.stop_ids))


def plain_greedy(p: SamplingParams, step: int) -> bool:
    """Whether a row with these params at output position `step` is answered by the argmax of its
    logits alone, token mask aside (what `sample` decides per row, taking an active min_tokens as
    not plain whatever the stop ids): a decode graph asks this before its replay."""
    return (p.temperature == 0.0 and p.logprobs is None and not p.has_penalties and not p.has_controls
            and not (p.min_tokens and step < p.min_tokens))


def _top_logprobs(row: torch.Tensor, token: int, token_lp: float, k: int) -> dict[int, Logprob]:
    top: dict[int, Logprob] = {}
    if k > 0:
        vals, ids = torch.topk(row, k)
        for rank, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            top[t] = Logprob(v, rank)
    if token not in top:
        top[token] = Logprob(token_lp, int((row > token_lp).sum().item()) + 1)
    return top


def truncates(top_k: int, top_p: float, min_p: float, vocab: int) -> bool:
    """Whether these parameters exclude anything from a vocabulary of `vocab` logits."""
    return 0 < top_k < vocab or top_p < 1.0 or min_p > 0.0


def truncation_mask(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """True where top-k, then top-p, then min-p exclude a logit of the rows x [N, V] (processed:
    after penalties and temperature), each stage on what the previous kept: the sampler's
    truncation, shared with the RL trainer, which scores samples under the same distribution."""
    drop = torch.zeros_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        drop |= x < torch.topk(x, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        sorted_vals, order = torch.sort(x.masked_fill(drop, float("-inf")), dim=-1, descending=True)
        probs = torch.softmax(sorted_vals, dim=-1)
        # keep the smallest prefix whose mass reaches top_p
        drop |= torch.zeros_like(drop).scatter_(-1, order, probs.cumsum(dim=-1) - probs >= top_p)
    if min_p > 0.0:
        probs = torch.softmax(x.masked_fill(drop, float("-inf")), dim=-1)
        drop |= probs < min_p * probs.max(dim=-1, keepdim=True).values
    return drop


def _truncate(x: torch.Tensor, rows: list[SampleRequest], random_rows: list[int]) -> None:
    """Mask (to -inf) what top-k, top-p and min-p exclude, for the rows that ask for it."""
    for i in random_rows:
        p = rows[i].params
        if truncates(p.top_k, p.top_p, p.min_p, x.shape[-1]):
            x[i].masked_fill_(truncation_mask(x[i][None], p.top_k, p.top_p, p.min_p)[0], float("-inf"))
