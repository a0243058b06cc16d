"""Explicit pins on KV blocks.

Whoever keeps KV alive beyond one sequence's own table holds a `KVHandle`: a request using a
cached document, an agent session between turns, a transfer in flight. While a handle is held,
none of its blocks is freed or evicted; `release` gives the references back exactly once.
`NULL_BLOCK` entries (given back behind a sliding window) are kept in `blocks`, so a pinned table
keeps its shape, and hold nothing.
"""
from __future__ import annotations

from cuttle.attention.metadata import NULL_BLOCK
from cuttle.engine.kv.pool import BlockPool


class KVHandle:
    __slots__ = ("pool", "blocks", "released")

    def __init__(self, pool: BlockPool, blocks: list[int]):
        self.pool = pool
        self.blocks = list(blocks)
        self.released = False
        for bid in self.blocks:
            if bid != NULL_BLOCK:
                pool.ref(bid)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for bid in reversed(self.blocks):  # tail first, so the LRU evicts a chain from its end
            if bid != NULL_BLOCK:
                self.pool.unref(bid)

    def __enter__(self) -> "KVHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
