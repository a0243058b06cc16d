"""Squid documents through the KV tiers (engine/kv/tiers.py, engine/squid.py).

A document evicted from a small device pool goes down whole to the host tier (and through it to
disk); a later request that needs it runs a *load job* instead of a prefill, and its outputs are
bit-identical (fp32) to a run whose large pool never evicted anything, with no document token
computed twice. A disk block that is corrupt makes that whole document a miss (computed again,
still exact); a restart reuses the disk; a weight update leaves nothing below to hit.
The leak property over interleavings with documents is in test_kv_tiers.py.
"""
from __future__ import annotations

import os
import random

import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.kv.tiers import document_block_key
from helpers import make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PREFIX = [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiers-docs-qwen3"))
    make_checkpoint(path, "qwen3")
    return path


def _docs() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 250) for _ in range(n)] for n in (13, 9, 17, 11, 14, 10)]


# which documents each request takes, in order; the later ones come back after being pushed out
PLAN = [(0, 1), (2, 3), (4, 5), (1, 0), (2, 4), (3, 5)]


def _prompt(docs, k: int, query: int = 200) -> dict:
    return {"prefix": PREFIX, "documents": [docs[i] for i in PLAN[k]], "prompt": [query + k, 201, 202, 203, 204, 205]}


def _run(llm: LLM, ks=range(len(PLAN)), query: int = 200) -> list:
    docs, out = _docs(), []
    for k in ks:  # one request at a time: the compared runs step through the same batches
        c = llm.generate(_prompt(docs, k, query), GREEDY, use_tqdm=False)[0].outputs[0]
        out.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
    return out


def _llm(path: str, num_kv_blocks: int, **kw) -> LLM:
    return LLM(path, dtype="float32", block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=min(96, 4 * num_kv_blocks), max_num_seqs=1,
               squid_positions="shared", **kw)


def _all_free(llm: LLM) -> None:
    engine = llm.engine
    engine.tiers.drain()
    engine.block_manager.check_invariants([])
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["kv_host_blocks_free"] == s["kv_host_blocks_total"]
    assert not engine.squid.jobs and not engine.squid.pins


@pytest.fixture(scope="module")
def reference(model_path):
    llm = _llm(model_path, 256)
    out = _run(llm)
    assert llm.engine.block_manager.pool.num_evictions == 0
    return out, llm.stats()


def test_documents_reload_from_host_bit_identical(model_path, reference):
    ref, ref_stats = reference
    llm = _llm(model_path, 18, num_host_kv_blocks=128)
    assert _run(llm) == ref
    s = llm.stats()
    # each document (and the prefix) computed once, as with the large pool: the rest came back by copy
    assert s["document_tokens_computed"] == ref_stats["document_tokens_computed"] == len(PREFIX) + sum(map(len, _docs()))
    assert s["kv_offloaded_documents"] > 0 and s["kv_host_document_hits"] >= 2 and s["kv_disk_document_hits"] == 0
    assert s["documents_hit"] == ref_stats["documents_hit"] and s["document_tokens_reused"] == ref_stats["document_tokens_reused"]
    assert s["kv_bytes_host_to_device"] >= s["kv_host_document_hits"] * llm.engine.tiers.bytes_per_block
    _all_free(llm)
    # without the tier the same small pool computes the evicted documents again
    plain = _llm(model_path, 18)
    assert [t for t, _ in _run(plain)] == [t for t, _ in ref]
    assert plain.stats()["document_tokens_computed"] > s["document_tokens_computed"]


def test_documents_reload_from_disk_and_survive_a_restart(model_path, reference, tmp_path):
    ref, ref_stats = reference
    cache = str(tmp_path / "kv")
    # a host tier of 8 blocks holds about two documents: the rest live on disk only
    llm = _llm(model_path, 18, num_host_kv_blocks=8, kv_cache_dir=cache)
    assert _run(llm) == ref
    s = llm.stats()
    assert s["kv_disk_document_hits"] > 0 and s["kv_bytes_disk_to_host"] > 0 and s["kv_disk_bad_entries"] == 0
    assert s["document_tokens_computed"] == ref_stats["document_tokens_computed"]
    _all_free(llm)
    disk = llm.engine.tiers.disk
    docs = _docs()
    keys = llm.engine.squid.keys(_request(llm, _prompt(docs, 0)))[1]  # documents 0 and 1, in that order
    assert all(document_block_key(k, i) in disk for k, d in zip(keys, [docs[0], docs[1]]) for i in range((len(d) + 3) // 4))

    # damage the second block of document 1 on disk; a restarted engine loads document 0 from disk
    # and computes document 1 (and the prefix) again; outputs still bit-identical. A new query: the
    # old one's blocks are on disk too, and a prefix hit would compute its rest in other chunks
    victim = disk.path(document_block_key(keys[1], 1))
    with open(victim, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    restarted = _llm(model_path, 18, num_host_kv_blocks=8, kv_cache_dir=cache)
    assert _run(restarted, [0], query=230) == _run(_llm(model_path, 256), [0], query=230)
    r = restarted.stats()
    assert r["kv_disk_document_hits"] == 1 and r["kv_disk_bad_entries"] == 1 and not os.path.exists(victim)
    assert r["document_tokens_computed"] == len(PREFIX) + len(docs[1])
    _all_free(restarted)


def _request(llm: LLM, prompt: dict):
    """A request object for `prompt` (only its keys are used), never queued."""
    from cuttle.engine.sequence import Request

    layout, ids, _ = llm.engine._squid_prompt(prompt, GREEDY)
    return Request("keys", ids, GREEDY, extra_key=(0).to_bytes(8, "little"), layout=layout)


def test_weight_update_leaves_no_document_below_to_hit(model_path, tmp_path):
    llm = _llm(model_path, 18, num_host_kv_blocks=128, kv_cache_dir=str(tmp_path / "kv"))
    _run(llm, range(3))  # documents 0..3 pushed down to host and disk
    tiers = llm.engine.tiers
    assert tiers.host_docs.entries and tiers.disk.entries
    before = llm.stats()
    llm.update_weights([])
    assert not tiers.host_docs.entries and not tiers.disk.entries
    _run(llm, [3])  # documents 1 and 0: were below, must be computed under the new version
    s = llm.stats()
    assert s["kv_host_document_hits"] == before["kv_host_document_hits"]
    assert s["kv_disk_document_hits"] == before["kv_disk_document_hits"]
    docs = _docs()
    assert s["document_tokens_computed"] - before["document_tokens_computed"] == len(PREFIX) + len(docs[0]) + len(docs[1])
    _all_free(llm)


@pytest.fixture(scope="module")
def nsa_path(tmp_path_factory) -> str:
    from sparse_helpers import make_nsa_checkpoint

    path = str(tmp_path_factory.mktemp("tiers-docs-nsa"))
    make_nsa_checkpoint(path, seed=6, max_position_embeddings=128)
    return path


@pytest.mark.parametrize("read_in_place", ["never", "auto"])
def test_nsa_documents_reload_from_host_bit_identical(nsa_path, read_in_place):
    """An NSA model's documents (each attended by NSA's rules on its own keys, docs/nsa.md): their
    compressed entries go down to the host tier and come back with their blocks (a document is
    loaded by a load job), so the outputs are the large pool's bits with no document token
    computed twice."""
    ref_llm = _llm(nsa_path, 256)
    ref = _run(ref_llm)
    llm = _llm(nsa_path, 18, num_host_kv_blocks=128, kv_read_in_place=read_in_place)
    assert _run(llm) == ref
    s = llm.stats()
    assert s["document_tokens_computed"] == ref_llm.stats()["document_tokens_computed"]
    assert s["kv_offloaded_documents"] > 0 and s["kv_host_document_hits"] >= 2
    _all_free(llm)
    # control: without the tier the evicted documents are computed again
    plain = _llm(nsa_path, 18)
    _run(plain)
    assert plain.stats()["document_tokens_computed"] > s["document_tokens_computed"]
