"""The blocks of one KV pool: reference counts, the free list in LRU order, and eviction.

Owns block bookkeeping for one tier (today the device pool; a host tier is a second `BlockPool`).
A block is free iff its ref count is 0; free blocks sit in LRU order, least recent first, and
`take` hands out the head. A free block may still be *cached* (an index points at it: the prefix
cache, a cached document); handing it out evicts it, and every eviction goes through the hooks
registered with `on_evict` — the indexes drop their entries there, and a lower tier will copy the
block out there. Never touches KV memory.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

NO_HASH = -1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "document")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH  # the prefix index's chained hash, while it may find this block
        self.token_ids: tuple[int, ...] = ()
        self.document: int | None = None  # the document index's key, while a document holds it

    @property
    def cached(self) -> bool:
        """An index can still find this block, so handing it out evicts something."""
        return self.hash != NO_HASH or self.document is not None


EvictHook = Callable[[Block], None]


class BlockPool:
    def __init__(self, num_blocks: int, pool_id: int = 0):
        self.pool_id = pool_id
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._evict_hooks: list[EvictHook] = []
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def on_evict(self, hook: EvictHook, first: bool = False) -> None:
        """`hook(block)` runs when a cached free block is about to be handed out for reuse, while
        it still holds its hash and tokens. `first`: before the hooks already registered (a lower
        tier copies a document out before the document index forgets it)."""
        if first:
            self._evict_hooks.insert(0, hook)
        else:
            self._evict_hooks.append(hook)

    def take(self) -> int:
        """A free block with ref count 1, evicting whatever it cached."""
        if not self.free:
            raise RuntimeError("KV pool exhausted: the scheduler must check can_allocate/can_append first")
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.cached:
            self.evict(block)
        block.ref_count = 1
        return bid

    def take_uncached(self) -> int | None:
        """`take`, but only if the least recently used free block caches nothing (None otherwise):
        for speculative work that must not cost the cache anything."""
        if not self.free:
            return None
        bid = next(iter(self.free))
        if self.blocks[bid].cached:
            return None
        return self.take()

    def unref_first(self, bid: int) -> None:
        """`unref`; a block that caches nothing and comes free goes to the head of the LRU list,
        the first one `take` hands out again (instead of a cached one)."""
        self.unref(bid)
        block = self.blocks[bid]
        if block.ref_count == 0 and not block.cached:
            self.free.move_to_end(bid, last=False)

    def evict(self, block: Block) -> None:
        for hook in self._evict_hooks:
            hook(block)
        block.hash = NO_HASH
        block.token_ids = ()
        block.document = None
        self.num_evictions += 1

    def ref(self, bid: int) -> None:
        """One more holder; revives a free (cached) block."""
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]
        block.ref_count += 1

    def unref(self, bid: int) -> None:
        """One holder fewer; at zero the block joins the tail of the LRU list, still cached."""
        block = self.blocks[bid]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {bid} ref count went negative"
        if block.ref_count == 0:
            self.free[bid] = None
