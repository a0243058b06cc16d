"""Cached documents: a document's KV, computed once, found again by what it was computed from.

An entry is keyed by an xxh3 hash of everything its KV depends on: the document's tokens and a
context (the prefix it was encoded after, the weight version, the dtype, the position convention
and start position) that the caller serialises. A lookup re-checks the tokens, so a collision is
a miss. A document may end mid-block: the entry holds its blocks and its exact length. Users pin
an entry through a `KVHandle`; an unpinned entry's blocks sit in the pool's free LRU list still
cached, and evicting any of them drops the whole entry (a document is used whole or not at all).
Owns the key -> entry table; never allocates or computes KV.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from cuttle.engine.kv.handles import KVHandle
from cuttle.engine.kv.pool import Block, BlockPool

_ROOT = b"cuttle-document-root"


def document_key(token_ids: Sequence[int], context: bytes) -> int:
    h = xxhash.xxh3_64(_ROOT)
    h.update(len(context).to_bytes(4, "little") + context)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass(slots=True, eq=False)
class Document:
    key: int
    token_ids: tuple[int, ...]
    blocks: list[int]
    length: int
    pos_base: int  # the position of its first token when its keys were rotated


class DocumentIndex:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.entries: dict[int, Document] = {}
        self.hits = 0
        self.inserts = 0
        pool.on_evict(self._forget)

    def lookup(self, key: int, token_ids: Sequence[int]) -> Document | None:
        doc = self.entries.get(key)
        if doc is None or doc.token_ids != tuple(token_ids):
            return None
        return doc

    def acquire(self, doc: Document) -> KVHandle:
        """Pin a cached document for one user."""
        self.hits += 1
        return KVHandle(self.pool, doc.blocks)

    def insert(self, key: int, token_ids: Sequence[int], blocks: list[int], pos_base: int) -> Document:
        """Record a document whose KV is computed in `blocks` (the caller keeps its own pins).
        An existing entry under the key wins; the caller's copy then stays a private one."""
        if key in self.entries:
            return self.entries[key]
        need = (len(token_ids) + self.block_size - 1) // self.block_size
        if len(blocks) != need:
            raise ValueError(f"a document of {len(token_ids)} tokens needs {need} blocks, got {len(blocks)}")
        for bid in blocks:
            if self.pool.blocks[bid].cached:
                raise ValueError(f"block {bid} is already cached by an index")
        doc = Document(key, tuple(token_ids), list(blocks), len(token_ids), pos_base)
        for bid in blocks:
            self.pool.blocks[bid].document = key
        self.entries[key] = doc
        self.inserts += 1
        return doc

    def reset(self) -> None:
        """Forget every entry (after a weight update); pinned blocks stay valid for their users."""
        for doc in self.entries.values():
            for bid in doc.blocks:
                self.pool.blocks[bid].document = None
        self.entries.clear()

    def _forget(self, block: Block) -> None:
        if block.document is None:
            return
        doc = self.entries.pop(block.document, None)
        if doc is None:
            return
        for bid in doc.blocks:  # the rest of the document is now ordinary free (or pinned) blocks
            self.pool.blocks[bid].document = None

    def check(self, whole_pins: bool = True) -> None:
        for key, doc in self.entries.items():
            for bid in doc.blocks:
                assert self.pool.blocks[bid].document == key, f"document {key:x}: block {bid} lost its mark"
            if not whole_pins:
                continue
            refs = {self.pool.blocks[b].ref_count > 0 for b in doc.blocks}
            assert len(refs) == 1, f"document {key:x} is partly pinned"
