"""One training row in which the samples of a group read their shared prompt once.

A GRPO group's G sequences start with the same untrained tokens (the prompt; with squid documents,
the dense context and the query), and a packed row (`PackedBatch.row_mask`) computes them G times.
`SharedRow` lays a row of sequences [a, b) out with each such prefix once: the prefix's tokens,
then every member's own suffix, each suffix attending the one prefix where its sequence attended
its own copy (its sequence's mask, rows and columns renumbered), never another member. Every token
then sees exactly the keys, at the positions, it saw alone, so its hidden state is the same (up to
the summation order of a shorter row) and the loss and its gradient are those of the packed row:
the prefix's gradient is the sum of its members' (tests/rl/test_shared_rows.py).

Members share a prefix when they are consecutive in the row, have the same group id, and their
first P tokens agree in ids, positions and attention, with none of those P tokens trained and no
prefix token attending a later one; P is the longest such. Owns that layout only: the trainer
(rl/trainer.py) runs it and maps each trained token to the row that predicts it (`index`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuttle.rl.batch import PackedBatch, sequence_mask


@dataclass(slots=True)
class SharedRow:
    """input_ids / position_ids [R]: the row; mask [R, R] bool; index [T] int64: the row each of
    the T tokens of sequences [a, b) (in stream order) is computed in; shared: tokens saved (T - R)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    index: torch.Tensor
    shared: int

    @classmethod
    def build(cls, batch: PackedBatch, a: int, b: int) -> SharedRow:
        cu = batch.cu_seqlens.tolist()
        lens = batch.seq_lens
        layouts = batch.layouts or [None] * batch.num_seqs
        # squid sequences' own masks; a causal one's is written as blocks (no [n, n] mask per sequence)
        masks = [None if layouts[m] is None else sequence_mask(layouts[m], lens[m]) for m in range(a, b)]
        gids = batch.group_ids.tolist()
        ids, pos, trained = batch.input_ids, batch.position_ids, batch.loss_mask
        index = torch.empty(cu[b] - cu[a], dtype=torch.long)
        pieces: list[tuple[int, int]] = []  # stream spans laid into the row, in order
        spans: list[tuple[int, int, int]] = []  # per sequence: (its prefix's first row, P, its own first row)
        row_at = 0
        i = a
        while i < b:
            j = i + 1
            while j < b and gids[j] == gids[i]:
                j += 1
            P = _shared_prefix(cu, masks, a, i, j, ids, pos, trained) if j - i > 1 else 0
            prefix_at = row_at
            if P:
                pieces.append((cu[i], cu[i] + P))
                row_at += P
            for m in range(i, j):
                s, e = cu[m], cu[m + 1]
                local = torch.arange(e - s)
                index[s - cu[a]: e - cu[a]] = torch.where(local < P, prefix_at + local, row_at + local - P)
                spans.append((prefix_at, P, row_at))
                pieces.append((s + P, e))
                row_at += e - s - P
            i = j
        stream = torch.cat([torch.arange(s, e) for s, e in pieces])
        R = stream.numel()
        mask = torch.zeros(R, R, dtype=torch.bool)
        for k, m in enumerate(range(a, b)):
            if masks[k] is None:  # causal: its prefix (shared or not) causal, its own rows see the prefix and themselves causally
                p0, P, o0 = spans[k]
                n = lens[m] - P
                mask[p0:p0 + P, p0:p0 + P] = torch.ones(P, P, dtype=torch.bool).tril()
                mask[o0:o0 + n, p0:p0 + P] = True
                mask[o0:o0 + n, o0:o0 + n] = torch.ones(n, n, dtype=torch.bool).tril()
                continue
            rows = index[cu[m] - cu[a]: cu[m + 1] - cu[a]]
            block = mask[rows[:, None], rows[None, :]]
            mask[rows[:, None], rows[None, :]] = block | masks[k]
        return cls(ids[stream], pos[stream], mask, index, cu[b] - cu[a] - R)


def _shared_prefix(cu: list[int], masks: list[torch.Tensor | None], a: int, i: int, j: int, ids: torch.Tensor,
                   pos: torch.Tensor, trained: torch.Tensor) -> int:
    """The longest P the sequences [i, j) can share (see the module docstring), 0 for none;
    `masks[m - a]`: sequence m's attention, None for a plain causal one."""
    firsts = []
    for m in range(i, j):
        t = trained[cu[m]: cu[m + 1]].nonzero()
        firsts.append(int(t[0]) if t.numel() else cu[m + 1] - cu[m])
    P = min(firsts)
    s0 = cu[i]
    for m in range(i + 1, j):
        s = cu[m]
        same = (ids[s: s + P] == ids[s0: s0 + P]) & (pos[s: s + P] == pos[s0: s0 + P])
        if not bool(same.all()):
            P = int((~same).nonzero()[0])
    if P == 0:
        return 0
    m0 = masks[i - a]
    if all(masks[m - a] is None for m in range(i, j)):
        return P  # causal: a prefix row attends only the prefix, the same for every member
    for m in range(i, j):
        mk = masks[m - a]
        if mk is None or m0 is None or bool(mk[:P, P:].any()) or not torch.equal(mk[:P, :P], m0[:P, :P]):
            return 0  # (a prefix token that attends past P, or members attending it differently: no sharing)
    return P


def shared_with_previous(batch: PackedBatch, first: int = 0, end: int | None = None) -> list[int]:
    """Per sequence of [first, end), the prefix it would share with the sequence before it in a
    row (0 for the range's first, another group's, or none): what it adds to a shared row is its
    length minus that (the trainer packs rows by it). A family's prefix is the least of its members' (common prefixes and
    equal masks compose), barring a squid context whose rows attend past the shorter one, where
    `SharedRow.build` shares nothing and the row is that much longer."""
    cu = batch.cu_seqlens.tolist()
    lens = batch.seq_lens
    layouts = batch.layouts or [None] * batch.num_seqs
    gids = batch.group_ids.tolist()
    end = batch.num_seqs if end is None else end
    out = [0] * (end - first)
    prev = None
    for i in range(first, end):
        mask = None if layouts[i] is None else sequence_mask(layouts[i], lens[i])  # (causal: no mask needed)
        if i > first and gids[i] == gids[i - 1]:  # (the first of the range starts a row)
            out[i - first] = _shared_prefix(cu, [prev, mask], i - 1, i - 1, i + 1, batch.input_ids, batch.position_ids,
                                            batch.loss_mask)
        prev = mask
    return out
