"""Block manager invariants: unit cases plus property tests over random interleavings of
add / step / abort / finish / preempt on a live engine."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.block_manager import BlockManager
from cuttle.engine.sequence import Request
from helpers import interleaving_ops, run_interleaving


def make_seq(tokens: list[int], extra: bytes = b""):
    return Request("r", tokens, SamplingParams(), extra_key=extra).seqs[0]


def test_prefix_hit_requires_computed_full_blocks_and_matching_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(10)))
    bm.allocate(a)
    assert bm.match_prefix(make_seq(list(range(10)))) == []  # nothing computed yet: no hits
    a.num_computed_tokens = 10
    bm.hash_computed_blocks(a)
    b = make_seq(list(range(10)))
    assert bm.match_prefix(b) == a.block_table[:2]
    # a hash collision (simulated by rewriting the stored tokens) is caught by the re-check
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)
    assert bm.match_prefix(b) == []
    # the extra key (weight version, salt) partitions the cache
    assert bm.match_prefix(make_seq(list(range(10)), extra=b"v1")) == []


def test_full_hit_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.hash_computed_blocks(a)
    b = make_seq(list(range(8)))
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed so its logits exist


def test_lru_eviction_order_and_reuse():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    head, second = a.block_table[0], a.block_table[1]
    a.num_computed_tokens = 5
    bm.hash_computed_blocks(a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    probe = make_seq([1, 2, 3, 4, 5])
    assert bm.match_prefix(probe) == [head, second]  # freed blocks still serve as cache
    bm.allocate(make_seq([9, 9, 9]))  # takes the never-hashed blocks first
    assert bm.match_prefix(probe) == [head, second]
    bm.allocate(make_seq([8, 8]))  # must evict: the tail of the chain goes before its head
    assert bm.match_prefix(probe) == [head]
    hit = make_seq([1, 2, 3, 4, 5])
    assert bm.can_allocate(hit) is False  # one hit revived, but two fresh blocks needed, none free


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    child = make_seq([1, 2, 3, 4, 5, 6])
    bm.fork(parent, child)
    shared_last = parent.block_table[1]
    assert bm.blocks[shared_last].ref_count == 2
    parent.token_ids.append(7)
    bm.append_slot(parent)
    assert parent.block_table[1] != shared_last
    assert bm.pending_copies == [(shared_last, parent.block_table[1])]
    assert bm.blocks[shared_last].ref_count == 1
    child.token_ids.append(8)
    bm.append_slot(child)  # now the sole owner: writes in place
    assert child.block_table[1] == shared_last
    assert parent.block_table[0] == child.block_table[0] and bm.blocks[parent.block_table[0]].ref_count == 2
    bm.check_invariants([parent, child])
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8


ops = interleaving_ops(max_prompt=40, max_tokens=12, max_steps=3, max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(6, 24), shared=st.booleans())
def test_random_interleavings_never_leak(qwen3_path, ops, num_blocks, shared):
    run_interleaving(_engine(qwen3_path, num_blocks).engine, ops, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
                     shared)


_ENGINES: dict[tuple[str, int], LLM] = {}


def _engine(path: str, num_blocks: int) -> LLM:
    # a fresh engine per example would dominate the run time; the pool is empty between examples
    key = (path, num_blocks)
    if key not in _ENGINES:
        _ENGINES[key] = LLM(path, dtype="float32", num_kv_blocks=num_blocks, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=64)
    llm = _ENGINES[key]
    assert llm.stats()["kv_blocks_free"] == num_blocks
    return llm
