"""The prefix cache: full, computed blocks found again by the chained hash of their tokens.

The hash chains `(parent hash, token ids, extra key)` with xxh3-64; the extra key carries the
weight version and any cache salt, so nothing computed under other weights or for another tenant
is ever hit. A lookup re-checks the stored tokens, so a hash collision is a miss. Owns the
hash -> block table of one pool; the pool tells it (through its eviction hook) when a block is
reused, and the entry goes at that moment.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from cuttle.engine.kv.pool import NO_HASH, Block, BlockPool

_ROOT = b"cuttle-prefix-root"


def hash_block(parent: int, token_ids: Sequence[int], extra_key: bytes) -> int:
    h = xxhash.xxh3_64(_ROOT if parent == NO_HASH else parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_key)
    return h.intdigest()


class PrefixIndex:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.hash_to_block: dict[int, int] = {}
        pool.on_evict(self._forget)

    def match(self, token_ids: Sequence[int], max_blocks: int, extra_key: bytes, parent: int = NO_HASH) -> list[int]:
        """The cached blocks that hold the first full blocks of `token_ids` (at most `max_blocks`),
        chained from `parent`."""
        bs = self.block_size
        blocks = self.pool.blocks
        hits: list[int] = []
        for i in range(max_blocks):
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, tokens, extra_key)
            bid = self.hash_to_block.get(h)
            if bid is None or blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
            parent = h
        return hits

    def register(self, block: Block, parent: int, tokens: tuple[int, ...], extra_key: bytes) -> bool:
        """Record a full block whose KV is computed; True when it is now the one found for its
        hash. The first block with a given hash stays the one found (a duplicate computed
        meanwhile keeps its hash only for the chain)."""
        block.hash = hash_block(parent, tokens, extra_key)
        block.token_ids = tokens
        return self.hash_to_block.setdefault(block.hash, block.block_id) == block.block_id

    def insert(self, block: Block, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Record a block whose hash is already known (a copy arriving from another tier)."""
        block.hash = block_hash
        block.token_ids = tokens
        self.hash_to_block.setdefault(block_hash, block.block_id)

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        bid = self.hash_to_block.get(block_hash)
        if bid is None or self.pool.blocks[bid].token_ids != tokens:
            return None
        return bid

    def reset(self) -> None:
        """Forget every entry (after a weight update); blocks in use stay valid, just uncached."""
        for block in self.pool.blocks:
            block.hash = NO_HASH
            block.token_ids = ()
        self.hash_to_block.clear()

    def _forget(self, block: Block) -> None:
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]

    def check(self) -> None:
        for h, bid in self.hash_to_block.items():
            assert self.pool.blocks[bid].hash == h, f"prefix index points block {bid} at a stale hash"
