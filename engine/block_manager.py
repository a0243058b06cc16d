"""Per-sequence KV allocation over the KV subsystem (`engine/kv/`): the API the scheduler uses.

Composes one `BlockPool` (ref counts, free LRU, eviction hook), the `PrefixIndex` (prefix cache)
and the `DocumentIndex` (cached documents) of the device pool. Invariants (checked by
`check_invariants`, exercised by property tests):
- a block is free iff its ref count is 0; free blocks sit in LRU order, least recent first;
- a block is hashed only when it is full and its KV has been computed; a hit re-checks the tokens;
- a free block keeps its index entry until it is handed out again (that is the cache), and is
  dropped from its index at that moment, through the pool's eviction hook;
- no block with ref count > 1 is ever written: appending into a shared partial block first copies
  it (copy-on-write; the copy is recorded in `pending_copies` for the runner to execute).
A sequence's own blocks are its `block_table`; KV it shares read-only (a cached document) it holds
through handles, released with the sequence. Owns no KV memory.

With KV tiers attached (`attach_tiers`, engine/kv/tiers.py) allocation continues a prefix lookup
that stops in the device pool into the host and disk tiers and queues a load; such a sequence is
*loading* until `poll_tiers` reports it done; a squid document job whose document is found below
is filled the same way instead of being computed. Without tiers none of that code runs.
A host hit read in place stays in the host tier: the table entry is the host block's id flagged
`HOST_BLOCK` (always a full, hashed block before the sequence's first written one), and the
sequence's reference is on the host pool (`_pool_of` routes every ref/unref).

Under a sliding window that every layer applies (`window`, set by the engine where the backend
attends windows), a block wholly before every window the sequence's queries will still use is
given back after each step (`release_behind_window`): its table entry becomes `NULL_BLOCK` and
its reference goes, so a sequence holds about W / block_size blocks however long it runs. A
given-back block keeps its hash in the free list, so it stays a prefix-cache entry until it is
reused. Only a sequence's own causal table is cut: a document job's blocks (a document is cached
whole) and a sequence reading shared segments keep theirs. Without KV tiers such a sequence also
*grows lazily* (`grows_lazily`): admission backs only its prefix hits and the first chunk the step
has budget for, and each later prefill chunk gets its blocks when it is scheduled (`grow`), so a
prompt longer than the pool runs through a window's worth of blocks; its prefix hit needs only the
blocks its window keeps (`_match_window`), the oldest of a chain being the first evicted. (With tiers a sequence's
blocks are all taken at admission: loads from below land in them.)
"""
from __future__ import annotations

from cuttle.attention.metadata import HOST_BLOCK, NULL_BLOCK
from cuttle.engine.kv.document_index import DocumentIndex
from cuttle.engine.kv.handles import KVHandle
from cuttle.engine.kv.pool import NO_HASH, Block, BlockPool
from cuttle.engine.kv.prefix_index import PrefixIndex, hash_block
from cuttle.engine.kv.tiers import KVTiers
from cuttle.engine.sequence import Sequence

__all__ = ["NO_HASH", "Block", "BlockManager", "hash_block"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_index = PrefixIndex(self.pool, block_size)
        self.document_index = DocumentIndex(self.pool, block_size)
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.num_cached_tokens_hit = 0  # tokens served from the prefix cache at admission, ever
        self.tiers: KVTiers | None = None
        # a sliding window W every layer applies: blocks before every query's window are given
        # back (None: every block is kept)
        self.window: int | None = None
        self.num_window_released_blocks = 0  # blocks given back behind a window, ever

    def attach_tiers(self, tiers: KVTiers) -> None:
        self.tiers = tiers
        tiers.device_docs = self.document_index
        tiers.device_index = self.prefix_index

    def _pool_of(self, bid: int) -> tuple[BlockPool, int]:
        """The pool a table entry lives in and its id there (HOST_BLOCK: read in place)."""
        if bid >= HOST_BLOCK:
            assert self.tiers is not None
            return self.tiers.host_pool, bid - HOST_BLOCK
        return self.pool, bid

    def _ref(self, bid: int) -> None:
        pool, i = self._pool_of(bid)
        pool.ref(i)

    def _unref(self, bid: int) -> None:
        pool, i = self._pool_of(bid)
        pool.unref(i)

    def _block(self, bid: int) -> Block:
        pool, i = self._pool_of(bid)
        return pool.blocks[i]

    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def free(self):
        return self.pool.free

    @property
    def hash_to_block(self) -> dict[int, int]:
        return self.prefix_index.hash_to_block

    @property
    def num_blocks(self) -> int:
        return len(self.pool)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- admission -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, use_cache: bool = True) -> list[int]:
        """Cached full blocks that start `seq`, leaving at least one token to compute (its logits).
        A lazily growing sequence under a window needs only the blocks its window keeps: its hit
        may start with NULL_BLOCK entries (`_match_window`)."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        if self.grows_lazily(seq):
            return self._match_window(seq, max_blocks)
        return self.prefix_index.match(seq.token_ids, max_blocks, seq.request.prefix_cache_key)

    def _match_window(self, seq: Sequence, max_blocks: int) -> list[int]:
        """The longest hit of j blocks whose kept blocks (those from `_released_end(j * bs)` on)
        are all cached: vLLM's sliding-window rule. The chain's hashes come from the tokens alone,
        so blocks behind the window may have been evicted (the oldest go first)."""
        bs, tokens, extra = self.block_size, seq.token_ids, seq.request.prefix_cache_key
        found: list[int | None] = []
        run: list[int] = []  # cached blocks in a row ending at each block
        parent = NO_HASH
        for i in range(max_blocks):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            parent = hash_block(parent, block, extra)
            found.append(self.prefix_index.find(parent, block))
            run.append(0 if found[i] is None else (run[i - 1] if i else 0) + 1)
        for j in range(max_blocks, 0, -1):
            first = self._released_end(j * bs)
            if run[j - 1] >= j - first:
                return [NULL_BLOCK] * first + found[first:j]  # type: ignore[list-item]
        return []

    def grows_lazily(self, seq: Sequence) -> bool:
        """Whether `seq` gets its blocks chunk by chunk (see the module docstring)."""
        return self.window is not None and self.tiers is None and not seq.shared and seq.request.job is None

    def backed_tokens(self, seq: Sequence, computed: int, budget: int | None) -> int:
        """How many of `seq`'s tokens its table backs once `computed` are in KV: all of them, or
        under lazy growth with a step `budget`, what that step may compute."""
        n = len(seq.token_ids)
        return n if budget is None or not self.grows_lazily(seq) else min(n, computed + budget)

    def can_allocate(self, seq: Sequence, use_cache: bool = True, budget: int | None = None) -> bool:
        hits = self.match_prefix(seq, use_cache)
        computed = len(hits) * self.block_size
        # hits behind the window are given back at once (or were NULL_BLOCK already): they cost nothing
        kept = hits[self._released_end(computed) :] if self.grows_lazily(seq) else hits
        revived = sum(1 for b in kept if b != NULL_BLOCK and self.pool.blocks[b].ref_count == 0)
        needed = self.blocks_needed(self.backed_tokens(seq, computed, budget)) - len(hits)
        return needed <= self.pool.num_free - revived

    def allocate(self, seq: Sequence, use_cache: bool = True, read_in_place: bool = True, budget: int | None = None) -> None:
        """Give `seq` its blocks: device prefix hits, then (with tiers) host hits read in place
        unless `read_in_place` is False (a holder that pins the table in the device pool), then
        new blocks (under lazy growth, for the first `budget` tokens to compute only); a load from
        below may follow."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self.match_prefix(seq, use_cache)
        for bid in hits:
            if bid != NULL_BLOCK:
                self.pool.ref(bid)
        if self.grows_lazily(seq):
            seq.block_table = list(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
            self.num_cached_tokens_hit += seq.num_cached_tokens
            self.release_behind_window(seq)  # before new blocks are taken: hits behind the window go back
            self.grow(seq, self.backed_tokens(seq, seq.num_computed_tokens, budget) - seq.num_computed_tokens)
            return
        table = list(hits)
        tiers = self.tiers
        chained = tiers is not None and seq.request.job is None and self.enable_prefix_caching and use_cache
        parent = self.pool.blocks[hits[-1]].hash if hits else NO_HASH
        if chained and read_in_place:  # host hits read in place (and device hits after them) take no new device block
            attached, parent = tiers.attach_in_place(seq, len(hits), parent, seq.request.prefix_cache_key)
            table += attached
        found = len(table)
        for _ in range(self.blocks_needed(len(seq.token_ids)) - found):
            table.append(self.pool.take())
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.num_cached_tokens_hit += seq.num_cached_tokens
        if tiers is None:
            return
        job = seq.request.job
        if job is not None:  # a document job: its document may be below, whole
            tiers.plan_document_load(seq, job.key, tuple(job.tokens))
        elif chained:
            seq.num_computed_tokens = found * self.block_size
            if not tiers.plan_load(seq, found, parent, seq.request.prefix_cache_key) and found > len(hits):
                self._loaded(seq)  # read in place: nothing to wait for
        else:
            tiers.drop_swap(seq)

    # ---- tiers -----------------------------------------------------------------------------
    def is_loading(self, seq: Sequence) -> bool:
        return self.tiers is not None and seq in self.tiers.loads

    def poll_tiers(self) -> list[Sequence]:
        """Sequences whose loads finished: their loaded blocks join the device prefix index."""
        assert self.tiers is not None
        done = self.tiers.poll()
        for seq in done:
            self._loaded(seq)
        return done

    def wait_load(self, seq: Sequence) -> None:
        assert self.tiers is not None
        self.tiers.wait(seq)

    def _loaded(self, seq: Sequence) -> None:
        if seq.request.job is not None:  # a document: its blocks go into the document index
            seq.num_cached_tokens = seq.num_computed_tokens
            return
        gained = seq.num_computed_tokens - seq.num_cached_tokens
        seq.num_cached_tokens = seq.num_computed_tokens
        self.num_cached_tokens_hit += gained
        self.hash_computed_blocks(seq)

    def swap_out(self, seq: Sequence) -> None:
        """Before preempting `seq`: its partial block may go to a host swap slot (the full ones
        are hashed and stay cached). Needs the prefix cache: the chain is how it comes back."""
        # a document job's blocks are never in the prefix chain, so a swap slot could not come back
        if (self.tiers is not None and self.enable_prefix_caching and seq.request.prompt_logprobs is None
                and seq.request.job is None):
            self.tiers.swap_out(seq)

    def release(self, seq: Sequence) -> None:
        """`seq` ends for good: a load in flight is waited for, a swap slot given back."""
        if self.tiers is not None:
            self.tiers.cancel(seq)

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go back first so they are evicted before the shared head of the chain.
        for bid in reversed(seq.block_table):
            if bid != NULL_BLOCK:
                self._unref(bid)
        for handle in reversed(seq.handles):
            handle.release()
        seq.block_table = []
        seq.shared = []
        seq.handles = []
        seq.num_computed_tokens = 0

    # ---- growth ----------------------------------------------------------------------------
    def grow_cost(self, seq: Sequence, n: int) -> int:
        """New blocks `grow(seq, n)` takes."""
        return max(0, self.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table))

    def room(self, seq: Sequence) -> int:
        """How many tokens past its computed ones `seq`'s table could back with the free blocks."""
        return (len(seq.block_table) + self.pool.num_free) * self.block_size - seq.num_computed_tokens

    def grow(self, seq: Sequence, n: int) -> None:
        """Back the next `n` tokens of a lazily growing `seq` (its next chunk) with new blocks."""
        for _ in range(self.grow_cost(seq, n)):
            seq.block_table.append(self.pool.take())

    def can_append(self, seq: Sequence) -> bool:
        return self._append_cost(seq) <= self.pool.num_free

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of token `len(seq) - 1` (the one about to be computed)."""
        pos = len(seq.token_ids) - 1
        idx = pos // self.block_size
        if idx == len(seq.block_table):
            seq.block_table.append(self.pool.take())
            return
        last = self.pool.blocks[seq.block_table[idx]]
        if last.ref_count > 1:  # shared partial block: copy before writing
            new = self.pool.take()
            self.pending_copies.append((last.block_id, new))
            self.pool.unref(last.block_id)
            seq.block_table[idx] = new

    def reserve_draft_slots(self, seq: Sequence, k: int, keep_free: int = 0) -> int:
        """After `append_slot`: blocks for up to `k` draft tokens after the last one (speculative
        decoding), from free blocks beyond `keep_free` only (a draft never preempts a decode:
        the caller keeps one block for each sequence still to schedule) and only blocks that
        cache nothing (a draft never evicts the prefix cache); returns how many fit."""
        bs, table = self.block_size, seq.block_table
        last = len(seq.token_ids) - 1 + k  # the last draft's position
        while len(table) <= last // bs and self.pool.num_free > keep_free:
            bid = self.pool.take_uncached()
            if bid is None:
                break
            table.append(bid)
        return max(0, min(k, len(table) * bs - len(seq.token_ids)))

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past what the sequence's tokens need (reserved for drafts that were
        not kept), so it holds what decoding without drafts would have; they cache nothing, so
        they go to the head of the free list, the next ones handed out."""
        keep = self.blocks_needed(len(seq.token_ids))
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            pool, i = self._pool_of(bid)
            pool.unref_first(i)

    def _append_cost(self, seq: Sequence) -> int:
        pos = len(seq.token_ids) - 1
        idx = pos // self.block_size
        if idx == len(seq.block_table):
            return 1
        return 1 if self.pool.blocks[seq.block_table[idx]].ref_count > 1 else 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent (the partial last one copy-on-write)."""
        for bid in parent.block_table:
            if bid != NULL_BLOCK:
                self._ref(bid)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.handles = [KVHandle(self.pool, h.blocks) for h in parent.handles]
        child.shared = list(parent.shared)
        child.pos_base = parent.pos_base

    # ---- after a step ----------------------------------------------------------------------
    def computed(self, seq: Sequence) -> None:
        """After a step computed KV for `seq`: register its full blocks, then give back what its
        window has left behind."""
        self.hash_computed_blocks(seq)
        self.release_behind_window(seq)

    # ---- sliding window --------------------------------------------------------------------
    def release_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks of `seq` that lie wholly before the window of its next query
        (position `num_computed_tokens`; every later query's window starts later still). With the
        prefix cache on, a block goes only once the block after it is full and hashed, so the
        chain of hashes never needs a block that is gone."""
        if self.window is None or seq.shared or seq.request.job is not None:
            return
        end = self._released_end(seq.num_computed_tokens)
        table = seq.block_table
        i = end - 1
        while i >= 0 and table[i] != NULL_BLOCK:  # back to where the last release stopped
            i -= 1
        for j in range(i + 1, end):  # oldest first: the LRU list hands them out in that order
            self._unref(table[j])
            table[j] = NULL_BLOCK
            self.num_window_released_blocks += 1

    def _released_end(self, computed: int) -> int:
        """Under the window, once `computed` tokens are in KV: the blocks before this index are
        given back."""
        assert self.window is not None
        bs = self.block_size
        end = (computed - self.window + 1) // bs  # blocks before this one hold only keys before the window
        if self.enable_prefix_caching:
            end = min(end, computed // bs - 1)
        return max(0, end)

    # ---- prefix cache ----------------------------------------------------------------------
    def hash_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block whose KV is now computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        extra = seq.request.prefix_cache_key
        table = seq.block_table
        parent = NO_HASH
        chained = True  # the hashes before block i are known (not given back unhashed)
        for i in range(seq.num_computed_tokens // bs):
            if table[i] == NULL_BLOCK:
                chained = False
                continue
            block = self._block(table[i])
            if block.hash != NO_HASH:
                parent, chained = block.hash, True
                continue
            if not chained:  # (the cache was reset after its parent was given back: it cannot chain)
                break
            if self.prefix_index.register(block, parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]), extra) and \
                    (i + 1) * bs <= seq.num_prompt_tokens:
                seq.request.cache_written_tokens += bs  # prompt KV this request put in the cache
            parent = block.hash

    def reset_prefix_cache(self, disk_namespace: int | None = None) -> None:
        """Forget every cached block and document (e.g. after a weight update), in every tier;
        referenced blocks stay valid for their holders."""
        self.prefix_index.reset()
        self.document_index.reset()
        if self.tiers is not None:
            self.tiers.reset(disk_namespace)

    def check_invariants(self, live: list[Sequence], pins: list[KVHandle] = ()) -> None:
        """Every block's ref count equals its holders: live sequences' tables and handles, plus
        `pins` held outside any sequence."""
        refs = [0] * len(self.pool.blocks)
        host_refs = [0] * (len(self.tiers.host_pool) if self.tiers is not None else 0)
        for seq in live:
            for bid in seq.block_table:
                if bid == NULL_BLOCK:
                    continue
                if bid >= HOST_BLOCK:
                    host_refs[bid - HOST_BLOCK] += 1
                else:
                    refs[bid] += 1
            for handle in seq.handles:
                for bid in handle.blocks:
                    refs[bid] += 1
        for handle in pins:
            for bid in handle.blocks:
                if bid != NULL_BLOCK:
                    refs[bid] += 1
        if self.tiers is not None:
            for blocks in self.tiers.device_pins():
                for bid in blocks:
                    refs[bid] += 1
            self.tiers.check(host_refs)
        for block, r in zip(self.pool.blocks, refs):
            assert block.ref_count == r, f"block {block.block_id}: ref_count {block.ref_count} but {r} holders"
            assert (block.block_id in self.pool.free) == (r == 0), f"block {block.block_id}: free-list membership wrong"
        self.prefix_index.check()
        self.document_index.check()
