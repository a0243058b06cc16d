"""A sequence's KV as a list of segments.

A segment is a run of KV in one pool: its blocks, how many tokens are valid (it may end
mid-block), the position its first token takes in this sequence, the position its keys were
rotated at when computed (they differ when a cached document is placed elsewhere: the attention
backend then rotates the query instead of the keys), and its visibility: `causal` for the
sequence's own tokens (the last segment, where new KV is written), full otherwise (a query row
sees every token of a shared prefix or a document). Today every sequence is one causal segment
starting at position 0; squid's documents and the KV tiers add segments, nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Segment:
    blocks: list[int]
    length: int
    pos_base: int = 0  # position of its first token in this sequence
    rope_base: int = 0  # position its first key was rotated at when computed
    causal: bool = False
    pool: int = 0

    @property
    def rope_delta(self) -> int:
        return self.pos_base - self.rope_base
