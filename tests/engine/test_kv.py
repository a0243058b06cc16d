"""The KV subsystem by role: pool (ref counts, LRU, eviction hook), prefix and document indexes,
handles, segments and storage. Property tests drive random interleavings and check that every
block has exactly its holders and that indexes never point at reused blocks."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuttle.engine.block_manager import BlockManager
from cuttle.engine.kv.document_index import DocumentIndex, document_key
from cuttle.engine.kv.handles import KVHandle
from cuttle.engine.kv.pool import BlockPool
from cuttle.engine.kv.prefix_index import PrefixIndex
from cuttle.engine.kv.storage import KVStorage
from cuttle.engine.sampling_params import SamplingParams
from cuttle.engine.sequence import Request


def _seq(tokens: list[int], extra: bytes = b""):
    return Request("r", tokens, SamplingParams(), extra_key=extra).seqs[0]


def test_pool_evicts_through_the_hook_only_when_a_cached_block_is_reused():
    pool = BlockPool(3)
    seen: list[tuple[int, int]] = []
    pool.on_evict(lambda b: seen.append((b.block_id, b.hash)))
    index = PrefixIndex(pool, block_size=2)
    a = pool.take()
    index.register(pool.blocks[a], -1, (1, 2), b"")
    pool.unref(a)
    b, c = pool.take(), pool.take()  # the two never-cached blocks go first
    assert seen == [] and a in pool.free
    assert index.match([1, 2], 1, b"") == [a]
    d = pool.take()  # only the cached one is left: evicting it calls the hook with its hash intact
    assert d == a and len(seen) == 1 and seen[0][0] == a and seen[0][1] != -1
    assert index.match([1, 2], 1, b"") == [] and not pool.blocks[a].cached
    for x in (b, c, d):
        pool.unref(x)
    assert pool.num_free == 3 and pool.num_evictions == 1


def test_document_ending_mid_block_is_found_pinned_and_evicted_whole():
    bs = 4
    pool = BlockPool(8)
    docs = DocumentIndex(pool, bs)
    tokens = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens in a third
    key = document_key(tokens, b"ctx-v0")
    blocks = [pool.take() for _ in range(3)]
    doc = docs.insert(key, tokens, blocks, pos_base=7)
    assert doc.length == 10 and doc.pos_base == 7
    for b in blocks:  # the computing sequence lets go; the document stays cached
        pool.unref(b)
    assert docs.lookup(key, tokens) is doc
    assert docs.lookup(key, tokens[:-1] + [0]) is None  # same key, other tokens: a miss
    assert docs.lookup(document_key(tokens, b"ctx-v1"), tokens) is None  # other context: other key
    h1, h2 = docs.acquire(doc), docs.acquire(doc)
    assert all(pool.blocks[b].ref_count == 2 for b in blocks) and docs.hits == 2
    h1.release()
    h1.release()  # releasing twice gives back once
    assert all(pool.blocks[b].ref_count == 1 for b in blocks)
    h2.release()
    docs.check()
    taken = [pool.take() for _ in range(6)]  # uses up the 5 uncached blocks, then evicts one of the document
    assert docs.lookup(key, tokens) is None
    assert not any(pool.blocks[b].cached for b in blocks)
    docs.check()
    for b in taken:
        pool.unref(b)
    assert pool.num_free == 8


def test_document_insert_checks_its_block_count():
    pool = BlockPool(4)
    docs = DocumentIndex(pool, 4)
    try:
        docs.insert(1, list(range(5)), [pool.take()], 0)
    except ValueError as e:
        assert "needs 2 blocks" in str(e)
    else:
        raise AssertionError("a 5-token document in one 4-token block was accepted")


def test_reset_forgets_documents_and_prefixes_but_keeps_pinned_blocks():
    bm = BlockManager(8, 4)
    seq = _seq(list(range(9)))
    bm.allocate(seq)
    seq.num_computed_tokens = 9
    bm.hash_computed_blocks(seq)
    doc_blocks = [bm.pool.take(), bm.pool.take()]
    doc = bm.document_index.insert(5, list(range(6)), doc_blocks, 0)
    pin = bm.document_index.acquire(doc)
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {} and bm.document_index.entries == {}
    assert not any(b.cached for b in bm.blocks)
    assert all(bm.blocks[b].ref_count == 2 for b in doc_blocks)
    bm.check_invariants([seq], pins=[pin, KVHandle(bm.pool, [])] + [_Held(doc_blocks)])
    pin.release()
    for b in doc_blocks:
        bm.pool.unref(b)
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8


class _Held:
    """Blocks held by a test directly (what the computing sequence would hold)."""

    def __init__(self, blocks):
        self.blocks = blocks


def test_sequence_segments_put_shared_kv_before_its_own_causal_tokens():
    bm = BlockManager(8, 4)
    doc_blocks = [bm.pool.take()]
    doc = bm.document_index.insert(9, [1, 2, 3], doc_blocks, pos_base=0)
    bm.pool.unref(doc_blocks[0])
    seq = _seq([5, 6, 7, 8, 9])
    from cuttle.engine.kv.segments import Segment

    seq.handles.append(bm.document_index.acquire(doc))
    seq.shared.append(Segment(doc.blocks, doc.length, pos_base=4, rope_base=doc.pos_base))
    seq.pos_base = 7
    bm.allocate(seq)
    seq.num_computed_tokens = 2
    segs = seq.segments()
    assert [s.causal for s in segs] == [False, True]
    assert segs[0].length == 3 and segs[0].rope_delta == 4
    assert segs[1].blocks == seq.block_table and segs[1].length == 2 and segs[1].pos_base == 7
    child = _seq([5, 6, 7, 8, 9])
    bm.fork(seq, child)  # a forked sample pins the shared KV on its own
    assert bm.blocks[doc_blocks[0]].ref_count == 2
    bm.check_invariants([seq, child])
    bm.deallocate(seq)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8 and seq.handles == [] and seq.shared == []
    assert bm.document_index.lookup(9, [1, 2, 3]) is doc  # unpinned, still cached


def test_storage_moves_blocks_for_every_layer_at_once():
    kv = KVStorage(3, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.tensor.copy_(torch.randn_like(kv.tensor))
    data = kv.read_blocks([4, 1])
    assert data.shape == (3, 2, 2, 4, 2, 8)
    kv.write_blocks([0, 5], data)
    assert torch.equal(kv.tensor[:, :, 0], kv.tensor[:, :, 4]) and torch.equal(kv.tensor[:, :, 5], kv.tensor[:, :, 1])
    kv.copy_blocks([(2, 3)])
    assert torch.equal(kv.tensor[:, :, 3], kv.tensor[:, :, 2])
    assert kv.layers[1][0].data_ptr() == kv.tensor[1, 0].data_ptr()  # per-layer views alias the pool


def test_companions_move_with_their_block():
    """Per-block data beside the KV (an NSA model's compressed entries, top-k summaries) is copied
    with its block, counted in its bytes and named in the layout."""
    kv = KVStorage(3, 6, 4, 2, 8, torch.float32, torch.device("cpu"), companions=[("side", (3, 2), (1, 2, 8))])
    side = kv.companions["side"]
    assert side.shape == (3, 2, 6, 1, 2, 8) and kv.tensors == [kv.tensor, side]
    side.copy_(torch.randn_like(side))
    kv.copy_blocks([(2, 3)])
    assert torch.equal(side[:, :, 3], side[:, :, 2])
    assert kv.block_bytes == (3 * 2 * 4 * 2 * 8 + 3 * 2 * 2 * 8) * 4
    assert kv.layout_tag() == "side:(3, 2):(1, 2, 8)" and KVStorage(1, 2, 4, 1, 8, torch.float32, torch.device("cpu")).layout_tag() == ""


OPS = st.lists(
    st.tuples(st.sampled_from(["seq", "free_seq", "doc", "use_doc", "drop_pin", "reset"]), st.integers(0, 10**6)),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_interleavings_keep_every_block_accounted_for(ops):
    """Sequences with prefix hits, documents (mid-block lengths) inserted, pinned, released and
    evicted under pressure, resets: every block's count equals its holders, indexes point only at
    blocks that still hold what they cached, and everything is free at the end."""
    bs = 4
    bm = BlockManager(12, bs)
    seqs, pins, computing = [], [], []
    for op, r in ops:
        if op == "seq":
            seq = _seq([r % 3] * (1 + r % 11))
            if bm.can_allocate(seq):
                bm.allocate(seq)
                seq.num_computed_tokens = len(seq.token_ids)
                bm.hash_computed_blocks(seq)
                seqs.append(seq)
        elif op == "free_seq" and seqs:
            bm.deallocate(seqs.pop(r % len(seqs)))
        elif op == "doc":
            n = 1 + r % 9
            tokens = [r % 5] * n
            need = bm.blocks_needed(n)
            if need <= bm.num_free_blocks:
                blocks = [bm.pool.take() for _ in range(need)]
                bm.document_index.insert(document_key(tokens, b"ctx"), tokens, blocks, 0)
                computing.append(blocks)
        elif op == "use_doc" and bm.document_index.entries:
            docs = list(bm.document_index.entries.values())
            pins.append(bm.document_index.acquire(docs[r % len(docs)]))
        elif op == "drop_pin":
            if computing and r % 2:
                for b in computing.pop():
                    bm.pool.unref(b)
            elif pins:
                pins.pop(r % len(pins)).release()
        elif op == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants(seqs, pins=pins + [_Held(b) for b in computing])
        for doc in bm.document_index.entries.values():
            assert all(bm.blocks[b].document == doc.key for b in doc.blocks)
    for seq in seqs:
        bm.deallocate(seq)
    for p in pins:
        p.release()
    for blocks in computing:
        for b in blocks:
            bm.pool.unref(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_a_document_job_never_takes_a_plain_prompts_prefix_blocks(qwen3_path):
    """A document whose tokens start an earlier plain prompt is computed into blocks of its own
    (encoded after its prefix, it is other KV; and a block lives in one index)."""
    import random

    from cuttle.engine import LLM, SamplingParams

    rng = random.Random(3)
    doc = [rng.randrange(3, 256) for _ in range(40)]
    squid = {"prefix": [rng.randrange(3, 256) for _ in range(10)], "documents": [doc], "prompt": [rng.randrange(3, 256) for _ in range(6)]}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    fresh = LLM(qwen3_path, dtype="float32", block_size=4).generate([squid], sp, use_tqdm=False)[0].outputs[0]
    llm = LLM(qwen3_path, dtype="float32", block_size=4)
    llm.generate([doc + [5]], SamplingParams(max_tokens=1), use_tqdm=False)
    after = llm.generate([squid], sp, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == fresh.token_ids and after.logprobs == fresh.logprobs
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
