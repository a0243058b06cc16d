"""Speculative decoding with the checkpoint's own multi-token-prediction layer (vLLM's
`speculative_config={"method": "mtp"}`, also `deepseek_mtp` / `glm4_moe_mtp`): DeepSeek-V3 and
GLM-4.5 ship a layer trained to predict the token after next from the model's final hidden state
(engine/models/mtp.py). Each step it proposes one draft per decoding sequence, which the target
verifies as it verifies any draft (engine/spec_decode.py: kept iff it equals the token sampled at
its place, so outputs are those of decoding without drafts, greedy or random).

Where its state lives:
- The MTP layer's K/V is one more layer of the engine's paged pool (`ModelRunner`: layer
  `num_layers`), at the sequence's own slots: MTP entry i (from h_i and t_{i+1}) at position i's
  slot, as vLLM lays it out. So prefix caching, forks, copy-on-write, swaps and the KV tiers carry
  it with the target's K/V, at 1 / num_layers more memory.
- The target's final hidden states of a sequence's computed rows (`ModelRunner.hidden`, kept by
  `record` after every step) wait on the sequence (`MTPState`) until its entries are written.

Each step, before the schedule (`prepare`), every decoding sequence's entries are brought up to
its last computed position n (usually the one or two rows its last step computed; a prompt's rows
at its first decode), all sequences in one forward of the MTP layer; the row at n reads
(h_n, t_{n+1}) and its logits propose t_{n+2}, the token after the one the step computes. A
greedy request takes their argmax; a sampled one samples them, processed as the target's, with the
uniform the target draws at that place (its seed, sample and output position), so the closer the
two distributions the likelier the draft is kept (engine/draft_model.py does the same).

Entries that cannot be exact, so drafts there are worse (the outputs never change):
- positions served from the prefix cache hold the entries their first owner wrote, and the last
  position before a block boundary holds the one written for that owner's next token (vLLM's
  layout shares this);
- the n samples of one prompt share its blocks, so the entry of the prompt's last position (whose
  next token is each sample's first) is the one the last of them wrote while that block is shared;
- tokens loaded from a KV tier or a session keep the entries stored with them, and entries are
  written into device blocks only (a position in a host-tier block read in place keeps its
  stored entry); a sequence whose last computed row's hidden state is not held (such a load)
  proposes nothing until it computes one.
Squid queries and document jobs are not drafted (their attention is segmented; the MTP layer
attends the sequence's own blocks).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cuttle.attention.metadata import HOST_BLOCK
from cuttle.engine.sampler import SampleRequest, sample
from cuttle.engine.spec_decode import Proposer, SpecConfig


class MTPState:
    """One sequence's target hidden states not yet turned into MTP entries: disjoint runs of rows
    (first position, [n, hidden]) in position order, and `done`, the entries written below it
    (None: none recorded yet)."""

    __slots__ = ("done", "runs")

    def __init__(self) -> None:
        self.done: int | None = None
        self.runs: list[tuple[int, torch.Tensor]] = []

    def copy(self) -> MTPState:
        """A fork's (the rows are never written in place, so they are shared)."""
        other = MTPState()
        other.done, other.runs = self.done, list(self.runs)
        return other

    def put(self, start: int, rows: torch.Tensor) -> None:
        """The rows of positions start.. just computed: they replace any held from `start` on (a
        draft's rows that were not kept, a recomputation), and entries from `start` on are redone."""
        self.runs = [(s, r[: start - s]) for s, r in self.runs if s < start]
        self.runs = [(s, r) for s, r in self.runs if r.shape[0]]
        self.runs.append((start, rows))
        self.done = start if self.done is None else min(self.done, start)

    def take(self, last: int) -> tuple[int, torch.Tensor] | None:
        """The rows of the contiguous positions that end at `last`, from `done` on (or from the
        earliest held), as (first position, [n, hidden]); None when `last`'s row is not held."""
        lo = self.done if self.done is not None else 0
        parts: list[torch.Tensor] = []
        need = last  # the highest position still wanted, walking down
        for s, r in reversed(self.runs):
            if s > need:  # rows past `last` (drafts not kept)
                continue
            if s + r.shape[0] - 1 < need:  # a gap: the positions below it have no rows
                break
            begin = max(s, lo)
            if begin > need:
                break
            parts.append(r[begin - s: need - s + 1])
            need = begin - 1
            if begin == lo:
                break
        if not parts:
            return None
        return need + 1, torch.cat(parts[::-1]) if len(parts) > 1 else parts[0]

    def finish(self, upto: int) -> None:
        """Entries below `upto` are written: their rows are dropped."""
        self.done = upto
        self.runs = [(max(s, upto), r[max(0, upto - s):]) for s, r in self.runs if s + r.shape[0] > upto]


class MTPProposer(Proposer):
    """`Proposer` whose draft is the MTP layer's, computed for the whole step in `prepare`."""

    prepares = True

    def __init__(self, config: SpecConfig, max_model_len: int, runner: Any,
                 sample_request: Callable[[Any], SampleRequest], logprobs_mode: str) -> None:
        super().__init__(config, max_model_len)
        self.runner = runner
        self.sample_request = sample_request  # the target's draw for a sequence's next token (LLMEngine._sample_request)
        self.logprobs_mode = logprobs_mode
        self._drafts: dict[int, int] = {}

    @staticmethod
    def follows(seq: Any) -> bool:
        """Whether the MTP layer keeps entries for `seq` (not a squid query or a document job)."""
        req = seq.request
        return req.job is None and req.layout is None and not seq.shared

    def record(self, scheduled: list[tuple[Any, int]], hidden: torch.Tensor | None) -> None:
        """After a step's forward, before its bookkeeping: keep each followed sequence's rows of
        `hidden` (the runner's, one per input row, in the step's order) for its entries."""
        if hidden is None:
            return
        row = 0
        for seq, n in scheduled:
            if self.follows(seq):
                if seq.mtp is None:
                    seq.mtp = MTPState()
                seq.mtp.put(seq.num_computed_tokens, hidden[row: row + n].clone())
            row += n

    def prepare(self, seqs: list[Any], drafting: bool = True) -> None:
        """Bring every decoding sequence's MTP entries up to its last computed position and draft
        the token after its next (unless not `drafting` this step), in one forward of the MTP layer."""
        self._drafts.clear()
        runner, bs = self.runner, self.runner.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        hidden: list[torch.Tensor] = []
        query_start, seq_lens, query_lens, tables = [0], [], [], []
        drafted: list[tuple[Any, int]] = []  # (seq, its last row)
        for seq in seqs:
            st = seq.mtp
            if st is None or not self.follows(seq):
                continue
            last = seq.num_computed_tokens - 1  # its next token t_{last+1} is the one this step computes
            run = st.take(last) if last >= 0 else None
            if run is None:  # that row's hidden state is not held (a load from a KV tier): nothing to write
                st.finish(last + 1)
                continue
            lo, rows = run
            table = seq.block_table
            # entries are written into device blocks only: positions in a block the table names on
            # the host tier (read in place) keep the entries stored with it
            host = next((p for p in range(last, lo - 1, -1) if table[p // bs] >= HOST_BLOCK), None)
            if host is not None:
                rows, lo = rows[host + 1 - lo:], host + 1
                if lo > last:
                    st.finish(last + 1)
                    continue
            ids.extend(seq.token_ids[lo + 1: last + 2])
            positions.extend(range(lo, last + 1))
            slots.extend(table[p // bs] * bs + p % bs for p in range(lo, last + 1))
            hidden.append(rows)
            query_start.append(query_start[-1] + last + 1 - lo)
            seq_lens.append(last + 1)
            query_lens.append(last + 1 - lo)
            tables.append(table)
            if drafting and self.room(seq, 1) > 0:
                drafted.append((seq, query_start[-1] - 1))
            st.finish(last + 1)
        if not tables:
            return
        meta = runner.causal_metadata(tables, query_start, seq_lens, query_lens, slots)
        model = runner.model
        dev = runner.device
        with torch.inference_mode():
            runner.backend.begin_step(meta)
            _, normed = model.forward_mtp(torch.tensor(ids, dtype=torch.long, device=dev),
                                          torch.tensor(positions, dtype=torch.long, device=dev),
                                          torch.cat(hidden) if len(hidden) > 1 else hidden[0],
                                          runner.kv.layers[model.cfg.num_layers], meta, runner.backend)
            if not drafted:
                return
            logits = model.mtp.compute_logits(normed[torch.tensor([r for _, r in drafted], device=dev)]).cpu()
            results = sample(logits, [self.sample_request(seq) for seq, _ in drafted], self.logprobs_mode)
        for (seq, _), res in zip(drafted, results):
            if res.failed is None:
                self._drafts[id(seq)] = res.token

    def draft(self, seq: Any, k: int) -> list[int]:
        token = self._drafts.pop(id(seq), None)
        return [] if token is None or k < 1 else [token]
