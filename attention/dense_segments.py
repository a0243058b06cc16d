"""The training path's reading of a row made of segments (squid's dense row: a prefix, documents,
prefix copies, the query; packed documents), for the attention rules defined per segment: NSA
(`nsa.py` `nsa_attend_segments`) and training-free top-k (`topk.py` `topk_attend_segments`).

Owns `segment_parts`: per segment of one row, which rows read it and at which key index (its own
tokens causally, every other row that sees it whole at its last key), with its keys and those
rows' queries in the frame the segment was encoded in (rotated by -shift, as the engine attends a
cached document moved by a rope delta), after checking that the mask is one such layout. Plain
torch, differentiable; imports nothing from the engine.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch


class SegmentPart(NamedTuple):
    segment: int
    rows: torch.Tensor  # [M] int64 the rows of the row that read the segment
    pos: torch.Tensor  # [M] int64 each one's key index within the segment
    q: torch.Tensor  # [M, H, D] their queries, in the segment's frame
    k: torch.Tensor  # [n, Hkv, D] the segment's keys, in its frame
    v: torch.Tensor  # [n, Hkv, D]


def segment_parts(
    q: torch.Tensor,  # [S, H, D] one row's queries, RoPE applied
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [S, S] bool: True where token i attends to token j
    segment_ids: torch.Tensor,  # [S] int64: the segment of each token
    shifts: torch.Tensor | None = None,  # [S] int64: how far each token's segment sits from where it was encoded
    unshift: Callable[[torch.Tensor, int], torch.Tensor] | None = None,  # (x [n, H, D], shift) -> x rotated by -shift
) -> Iterator[SegmentPart]:
    """The row's segments as parts. The mask must show each token, of each segment, nothing, all
    of it, or (its own segment) exactly its keys up to itself; a segment's tokens must share one
    shift. Anything else is refused with a ValueError naming the segment."""
    mask = mask.bool()
    for u in torch.unique(segment_ids).tolist():
        own = segment_ids == u
        keys = own.nonzero().squeeze(1)
        n = keys.numel()
        vis = mask[:, keys]  # [S, n]
        full = vis.all(1) & ~own
        if not torch.equal(vis[keys], torch.ones(n, n, dtype=torch.bool, device=q.device).tril()):
            raise ValueError(f"segment {u}: each token must see exactly its own segment's keys up to itself")
        if bool((vis.any(1) & ~own & ~full).any()):
            raise ValueError(f"segment {u}: every other token must see all of the segment or none of it")
        rows = (own | full).nonzero().squeeze(1)
        local = torch.cumsum(own.long(), 0) - 1
        pos = torch.where(own[rows], local[rows], n - 1)
        qs, ks = q[rows], k[keys]
        shift = int(shifts[keys[0]]) if shifts is not None else 0
        if shifts is not None and not bool((shifts[keys] == shift).all()):
            raise ValueError(f"segment {u}: its tokens have different shifts ({sorted(set(shifts[keys].tolist()))}); "
                             "a segment moves as a whole")
        if shift:
            if unshift is None:
                raise ValueError(f"segment {u} is shifted by {shift} positions but no rotation was given")
            qs, ks = unshift(qs, shift), unshift(ks, shift)
        yield SegmentPart(u, rows, pos, qs, ks, v[keys])
