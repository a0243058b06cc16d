"""The paged KV pool's bookkeeping: which block holds which tokens, who references it, which
full blocks can be reused by a later request.

Invariants (checked by `check_invariants`, exercised by property tests):
- a block is free iff its ref count is 0; free blocks sit in LRU order, least recent first;
- a block is hashed only when it is full and its KV has been computed; the hash chains
  (parent hash, token ids, extra key) with xxh3-64, and a hit re-checks the tokens;
- a free block keeps its hash until it is handed out again (that is the prefix cache), and is
  dropped from the hash table at that moment (LRU eviction);
- no block with ref count > 1 is ever written: appending into a shared partial block first copies
  it (copy-on-write; the copy itself is recorded in `pending_copies` for the runner to execute).
Owns no KV memory; the model runner owns the tensors these ids index.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from cuttle.engine.sequence import Sequence

NO_HASH = -1
_ROOT = b"cuttle-prefix-root"


def hash_block(parent: int, token_ids: list[int] | tuple[int, ...], extra_key: bytes) -> int:
    h = xxhash.xxh3_64(_ROOT if parent == NO_HASH else parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_key)
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.num_cached_tokens_hit = 0  # tokens served from the prefix cache at admission, ever

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- admission -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, use_cache: bool = True) -> list[int]:
        """Cached full blocks that start `seq`, leaving at least one token to compute (its logits)."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        extra = seq.request.extra_key
        hits: list[int] = []
        parent = NO_HASH
        for i in range(max_blocks):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, tokens, extra)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence, use_cache: bool = True) -> bool:
        hits = self.match_prefix(seq, use_cache)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(seq.token_ids)) - len(hits)
        return needed <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        assert not seq.block_table, "sequence already holds blocks"
        hits = self.match_prefix(seq, use_cache)
        for bid in hits:
            self._ref(bid)
        table = list(hits)
        for _ in range(self.blocks_needed(len(seq.token_ids)) - len(hits)):
            table.append(self._take_free())
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.num_cached_tokens_hit += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go back first so they are evicted before the shared head of the chain.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} ref count went negative"
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ---- growth ----------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        return self._append_cost(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of token `len(seq) - 1` (the one about to be computed)."""
        pos = len(seq.token_ids) - 1
        idx = pos // self.block_size
        if idx == len(seq.block_table):
            seq.block_table.append(self._take_free())
            return
        last = self.blocks[seq.block_table[idx]]
        if last.ref_count > 1:  # shared partial block: copy before writing
            new = self._take_free()
            self.pending_copies.append((last.block_id, new))
            last.ref_count -= 1
            seq.block_table[idx] = new

    def _append_cost(self, seq: Sequence) -> int:
        pos = len(seq.token_ids) - 1
        idx = pos // self.block_size
        if idx == len(seq.block_table):
            return 1
        return 1 if self.blocks[seq.block_table[idx]].ref_count > 1 else 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent (the partial last one copy-on-write)."""
        for bid in parent.block_table:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    # ---- prefix cache ----------------------------------------------------------------------
    def hash_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block whose KV is now computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        extra = seq.request.extra_key
        table = seq.block_table
        for i in range(seq.num_computed_tokens // bs):
            block = self.blocks[table[i]]
            if block.hash != NO_HASH:
                continue
            parent = self.blocks[table[i - 1]].hash if i > 0 else NO_HASH
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.hash = hash_block(parent, tokens, extra)
            block.token_ids = tokens
            self.hash_to_block.setdefault(block.hash, block.block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after a weight update); referenced blocks stay valid."""
        for block in self.blocks:
            block.hash = NO_HASH
            block.token_ids = ()
        self.hash_to_block.clear()

    # ---- internals -------------------------------------------------------------------------
    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]
        block.ref_count += 1

    def _take_free(self) -> int:
        if not self.free:
            raise RuntimeError("KV pool exhausted: the scheduler must check can_allocate/can_append first")
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash != NO_HASH:
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
            block.hash = NO_HASH
            block.token_ids = ()
        block.ref_count = 1
        return bid

    def check_invariants(self, live: list[Sequence]) -> None:
        refs = [0] * len(self.blocks)
        for seq in live:
            for bid in seq.block_table:
                refs[bid] += 1
        for block, r in zip(self.blocks, refs):
            assert block.ref_count == r, f"block {block.block_id}: ref_count {block.ref_count} but {r} holders"
            assert (block.block_id in self.free) == (r == 0), f"block {block.block_id}: free-list membership wrong"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"hash table points block {bid} at a stale hash"
