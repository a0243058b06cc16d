"""Speculative decoding by n-gram prompt lookup (vLLM's `speculative_config={"method": "ngram"}`),
and the proposer interface a draft model (engine/draft_model.py) and the checkpoint's own
multi-token-prediction layer (engine/mtp_proposer.py) also implement.

A coding model's output often repeats spans of its context (code it edits, names it defined, a
test it quotes). The proposer finds the latest earlier occurrence of a sequence's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`) and proposes the up to
`num_speculative_tokens` tokens that followed it. The step then computes the last token and the k
drafts in one pass (k + 1 rows, one weight read: at batch 1 a memory-bound step costs about the
same for 1 row or 5) and samples every row; drafts are kept while each equals the token sampled
at its place, and the first token that differs (or the bonus token after the last draft) ends the
step's output.

Exactness: row i's token is drawn from the target distribution given the tokens before it, with
the sampler's counter-based uniform for (seed, sample, output position): the same draw a
non-speculative step makes at that position. So the tokens are those of decoding without drafts,
for greedy and random sampling alike, and the logprobs are the rows' own (no draft model's
distribution enters: a proposal is a point mass, and "keep it iff the sample equals it" is the
rejection rule for one). Where the kernels give each row the same bits whatever the step's shape
(`batch_invariant=True`) outputs are bit-identical with and without speculation; otherwise the
k + 1-row step rounds differently from a one-row step, as any batching does.

Owns the config (`SpecConfig.parse`), the per-sequence suffix search (`NgramIndex`: the tokens in
an int32 buffer, one vectorised pass a step), and the `Proposer` (`prepare` for the step's decoding
sequences, then `propose` per sequence; the scheduler reserves the drafts' KV slots and budget). The engine step (llm_engine.py) samples the rows and applies the
rule. Requests with token controls (structured output, allowed ids, bad words, logit_bias) are
never drafted: their masks follow a grammar state per position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SPEC_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's per-family names for the checkpoint's own multi-token-prediction layer
_MTP_ALIASES = {"deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp"}
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN = 4, 2  # the matched suffix: 4 tokens down to 2 (1 proposes too often)
# no drafts in a step with more running sequences than this (vLLM's disable_by_batch_size, whose
# default is never): on CPU a draft row costs compute once a step is no longer bound by reading
# the weights; measured on the MoE preset, docs/benchmarks.md ("Speculative decoding")
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class SpecConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: the draft checkpoint's directory

    @classmethod
    def parse(cls, spec: dict[str, Any] | None) -> SpecConfig | None:
        """`EngineConfig.speculative_config` (vLLM's keys) validated; None stays None."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict (vLLM's keys), got {type(spec).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size", "model"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)} (supported: {', '.join(sorted(known))})")
        # vLLM's rule: a `model` without a method is a draft model
        method = spec.get("method", "draft_model" if spec.get("model") is not None else "ngram")
        method = _MTP_ALIASES.get(method, method)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method {method!r} is not supported (supported: {', '.join(SPEC_METHODS)}: "
                             "prompt lookup, a draft model, or the checkpoint's multi-token-prediction layer; EAGLE heads are not)")
        model = spec.get("model")
        if method == "mtp":
            stray = sorted({"prompt_lookup_max", "prompt_lookup_min", "model"} & set(spec))
            if stray:
                raise ValueError(f"speculative_config.{stray[0]} is not a key of method 'mtp' (the model's own MTP layer drafts)")
            if spec.get("num_speculative_tokens", 1) != 1:
                raise ValueError(f"speculative_config.num_speculative_tokens must be 1 with method 'mtp', got "
                                 f"{spec.get('num_speculative_tokens')!r}: the MTP layer proposes the token after next, and "
                                 "chaining it on its own outputs for more is not supported")
        elif method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config.model (the draft checkpoint's directory) is required with method 'draft_model'")
            stray = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(spec))
            if stray:
                raise ValueError(f"speculative_config.{stray[0]} is a prompt-lookup (ngram) key; a draft model takes none")
        elif model is not None:
            raise ValueError(f"speculative_config.model is a draft model's; method {method!r} takes none")
        if "num_speculative_tokens" not in spec and method != "mtp":  # (mtp: one, as vLLM defaults it to the layers)
            raise ValueError("speculative_config.num_speculative_tokens is required (drafts per step)")
        k = spec.get("num_speculative_tokens", 1)
        hi = spec.get("prompt_lookup_max", DEFAULT_LOOKUP_MAX)
        lo = spec.get("prompt_lookup_min", min(DEFAULT_LOOKUP_MIN, hi) if isinstance(hi, int) else DEFAULT_LOOKUP_MIN)
        for name, value, least, most in (("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS),
                                         ("prompt_lookup_max", hi, 1, 32), ("prompt_lookup_min", lo, 1, 32)):
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise ValueError(f"speculative_config.{name} must be an integer in [{least}, {most}], got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        off = spec.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be None (never) or an integer >= 1, got {off!r}")
        return cls(method, k, hi, lo, off, model)


class NgramIndex:
    """One sequence's tokens in a growing int32 buffer (4 bytes a token, appended as they come)
    and the suffix search over it: for the last n tokens (n from `hi` down to `lo`), the latest
    earlier occurrence with `k` tokens after it (in a loop whose period is shorter than k the
    latest occurrence has only a few followers; an earlier one proposes all k), else the latest.
    One vectorised pass over the tokens per step (`hi` comparisons a token), no per-n-gram table:
    a 128k-token context costs 512 KiB and well under a millisecond a lookup."""

    __slots__ = ("lo", "hi", "k", "buf", "size")

    def __init__(self, lo: int, hi: int, k: int = 1) -> None:
        self.lo, self.hi, self.k = lo, hi, k
        self.buf = np.empty(256, dtype=np.int32)
        self.size = 0

    def _sync(self, tokens: list[int]) -> np.ndarray:
        L = len(tokens)
        if L > self.buf.shape[0]:
            grown = np.empty(max(L, 2 * self.buf.shape[0]), dtype=np.int32)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if L > self.size:
            self.buf[self.size : L] = tokens[self.size : L]
        self.size = L
        return self.buf[:L]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest matching suffix (its
        last `hi` tokens first, then shorter down to `lo`): the latest occurrence with `self.k`
        followers if there is one, else the latest; [] without a match."""
        a = self._sync(tokens)
        L = a.shape[0]
        top = min(self.hi, L - 1)
        if top < self.lo:
            return []
        # ends[i]: the n-gram ending at i (i <= L - 2, so a token follows) equals the last n
        # tokens; grown one n at a time, kept for each n from lo up
        ends = a[: L - 1] == a[L - 1]
        masks: list[np.ndarray] = []
        for n in range(1, top + 1):
            if n > 1:
                ends = ends.copy()
                ends[: n - 1] = False
                ends[n - 1 :] &= a[: L - n] == a[L - n]
            if n >= self.lo:
                masks.append(ends)
        for n in range(top, self.lo - 1, -1):
            last_ends = np.flatnonzero(masks[n - self.lo])
            if last_ends.size:
                full = last_ends[last_ends + self.k < L]  # end i has L - 1 - i followers
                i = int(full[-1] if full.size else last_ends[-1])
                return tokens[i + 1 : i + 1 + k]
        return []


class Proposer:
    """The scheduler's side: which running sequence gets how many drafts this step."""

    def __init__(self, config: SpecConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def room(self, seq: Any, limit: int) -> int:
        """How many drafts `seq` may take this step: its adapted draft length (`update`, at most k)
        and `limit`, none past its max_tokens or max_model_len; none for document jobs, requests
        with token controls, or an n > 1 prompt not forked yet."""
        req = seq.request
        # not forked yet: the prompt's last token, computed alone (a one-token last chunk, a
        # prefix loaded from a KV tier) of an n > 1 request, whose samples fork from its row
        if req.job is not None or req.sampling_params.has_controls or not req.forked:
            return 0
        return min(seq.draft_len or self.config.num_speculative_tokens, limit, req.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - len(seq.token_ids))

    def update(self, seq: Any, drafted: int, kept: int) -> None:
        """Adapt the sequence's draft length to what it keeps (Hugging Face's assisted-generation
        schedule): two more after a step that kept every draft, one fewer (at least one) after one
        that did not, within num_speculative_tokens. A sequence whose drafts keep failing then
        computes one extra row a step, not k."""
        k = seq.draft_len or self.config.num_speculative_tokens
        seq.draft_len = min(self.config.num_speculative_tokens, k + 2) if kept == drafted else max(1, k - 1)

    prepares = False  # whether `prepare` does anything (the scheduler skips building its list otherwise)

    def prepare(self, seqs: list[Any], drafting: bool = True) -> None:
        """Before the step's schedule: `seqs` are the running sequences that decode a token (a
        draft model proposes for all of them at once here); prompt lookup needs nothing.
        `drafting` False: no drafts this step (more running sequences than disable_by_batch_size),
        only what must keep up every step (the MTP layer's entries)."""

    def propose(self, seq: Any, limit: int) -> list[int]:
        """Drafts for `seq`, which decodes its last token this step (as many as `room` allows)."""
        k = self.room(seq, limit)
        return self.draft(seq, k) if k > 0 else []

    def draft(self, seq: Any, k: int) -> list[int]:
        """Up to k drafts for `seq` (prompt lookup: what followed the latest match of its suffix)."""
        if seq.ngram is None:
            seq.ngram = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max, self.config.num_speculative_tokens)
        return seq.ngram.propose(seq.token_ids, k)
