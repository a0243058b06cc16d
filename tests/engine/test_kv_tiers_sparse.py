"""KV tiers under natively sparse (NSA) models and training-free top-k attention: what hangs on a
block id beside its K/V (the compressed entries, the block summaries: KVStorage companions)
travels with the block through the host tier, swap preemption and the disk tier.

Exactness as in test_kv_tiers.py: a small device pool that offloads and reloads (copy-in) gives
the tokens and logprobs of a run with a large pool bit for bit, and recomputes nothing; swap
preemption recomputes nothing either. Host blocks read in place (their tables name HOST_BLOCK
ids; the CPU kernels and the torch paths read K/V and companions from the host tier) give the
same bits with nothing copied in, on the native kernels and on the torch paths; a Triton sparse
kernel (device pool only) refuses kv_read_in_place='always' naming why. A disk entry carries the
companions and is not read back by an engine whose blocks have none (another layout).
"""
from __future__ import annotations

import pytest

from cuttle.engine import SamplingParams
from helpers import make_checkpoint
from kv_tiers_helpers import _all_free, _check_all_read_in_place, _concurrent, _favor_copy, _result, _run_sessions, _sessions, _small
from sparse_helpers import make_nsa_checkpoint

# budget 16 keys: the sessions' histories (up to ~90 tokens) are attended sparsely
TOPK = "topk:budget=16,block=4,dense_layers=0,summary=quest,init_blocks=1,local_blocks=1"


@pytest.fixture(scope="module")
def nsa_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiers-nsa"))
    make_nsa_checkpoint(path, seed=5, max_position_embeddings=128)
    return path


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiers-topk"))
    make_checkpoint(path, "qwen3")
    return path


@pytest.fixture(params=["nsa", "topk"])
def sparse_model(request, nsa_path, dense_path) -> tuple[str, dict]:
    return (nsa_path, {}) if request.param == "nsa" else (dense_path, {"sparse_attention": TOPK})


def test_resumed_sessions_reload_from_host_bit_identical(sparse_model):
    path, kw = sparse_model
    sessions = _sessions(4, 3, seed=3)
    ref_llm = _small(path, num_kv_blocks=256, max_num_seqs=1, **kw)
    ref = _run_sessions(ref_llm, sessions)
    # "auto" (the default) would read host blocks in place on CPU: copy-in asked for here
    tiered = _small(path, num_kv_blocks=24, num_host_kv_blocks=128, max_num_seqs=1, kv_read_in_place="never", **kw)
    assert _run_sessions(tiered, sessions) == ref
    st_ = tiered.stats()
    assert st_["kv_offloaded_blocks"] > 0 and st_["kv_host_hit_blocks"] > 0 and st_["kv_read_in_place_blocks"] == 0
    assert st_["prefill_tokens_computed"] == ref_llm.stats()["prefill_tokens_computed"]  # nothing recomputed
    # a block's bytes on the move include its companions
    kv = tiered.engine.runner.kv
    assert kv.block_bytes > kv.tensor[:, :, 0].numel() * kv.tensor.element_size()
    assert st_["kv_bytes_host_to_device"] == st_["kv_host_hit_blocks"] * kv.block_bytes
    _all_free(tiered)


def test_swap_preemption_recomputes_nothing(sparse_model):
    """Preempted sequences come back by copy alone (their partial last block and its companions
    through a host swap slot). Top-k gives the unpreempted run's bits; an NSA model's forward is
    not batch-invariant in the last bits (a sequence alone vs beside others differs by ~1e-6 on
    either attention path, measured), and swapping changes the batches, so there tokens are equal
    and logprobs within 1e-5."""
    path, kw = sparse_model
    ref_llm = _small(path, num_kv_blocks=64, max_num_seqs=3, **kw)
    ref = _concurrent(ref_llm)
    assert ref_llm.stats()["preemptions"] == 0
    swap = _favor_copy(_small(path, num_kv_blocks=20, num_host_kv_blocks=64, max_num_seqs=3, **kw))
    got = _concurrent(swap)
    st_ = swap.stats()
    assert st_["preemptions"] > 0 and st_["kv_swap_outs"] > 0 and st_["kv_swap_ins"] > 0
    assert st_["prefill_tokens_computed"] == 22 + 25 + 19  # the preempted came back by copy alone
    assert [t for t, _ in got] == [t for t, _ in ref]
    if "sparse_attention" in kw:
        assert got == ref
    else:
        assert max(abs(a - b) for (_, la), (_, lb) in zip(got, ref) for a, b in zip(la, lb)) <= 1e-5
    _all_free(swap)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_sessions_read_host_tier_in_place_bit_identical(sparse_model, kernels):
    """Every host hit read where it lies (the sequence's table names the host blocks): the large
    pool's bits, nothing copied in, nothing recomputed, every block free afterwards. `torch`: the
    backends' torch paths (native kernels off in both engines), which gather from both pools."""
    path, kw = sparse_model
    sessions = _sessions(4, 3, seed=4)

    def engine(**over):
        llm = _small(path, max_num_seqs=1, **kw, **over)
        if kernels == "torch":
            llm.engine.runner.backend.native = False
        return llm

    ref_llm = engine(num_kv_blocks=256)
    ref = _run_sessions(ref_llm, sessions)
    llm = engine(num_kv_blocks=24, num_host_kv_blocks=128, kv_read_in_place="always")
    assert _run_sessions(llm, sessions) == ref
    _check_all_read_in_place(llm, ref_llm)


def test_read_in_place_always_is_refused_by_the_triton_sparse_kernels(sparse_model, monkeypatch):
    path, kw = sparse_model
    # as under the interpreter (fp32): the backend is built, then the host tier meets the kernel
    monkeypatch.setattr("cuttle.attention.triton_backend.INTERPRETED", True)
    with pytest.raises(ValueError, match=r"kv_read_in_place='always': the (nsa|topk)-triton kernel reads the device pool only"):
        _small(path, num_host_kv_blocks=16, kv_read_in_place="always", attention_backend="triton", **kw)


def test_disk_tier_round_trip_and_layouts_do_not_mix(dense_path, tmp_path):
    """Top-k sessions pushed through the host tier to disk come back after a restart equal to a
    run that kept everything on the device; the same checkpoint without top-k (blocks without
    summaries) finds none of those entries."""
    cache = str(tmp_path / "kv")
    kw = {"sparse_attention": TOPK}
    sessions = _sessions(4, 3, seed=9)
    first = _small(dense_path, num_kv_blocks=24, num_host_kv_blocks=16, max_num_seqs=1, kv_cache_dir=cache, **kw)
    results = _run_sessions(first, sessions)
    first.engine.tiers.drain()
    assert first.stats()["kv_disk_entries"] > 0
    prompt = sessions[0][0] + results[0][0] + sessions[0][1]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    ref = _result(_small(dense_path, num_kv_blocks=256, max_num_seqs=1, **kw).generate([prompt], greedy, use_tqdm=False)[0])
    restarted = _small(dense_path, num_kv_blocks=24, num_host_kv_blocks=16, max_num_seqs=1, kv_cache_dir=cache, **kw)
    got = _result(restarted.generate([prompt], greedy, use_tqdm=False)[0])
    st_ = restarted.stats()
    assert st_["kv_disk_hit_blocks"] > 0 and st_["kv_disk_bad_entries"] == 0
    assert got[0] == ref[0] and max(abs(a - b) for a, b in zip(got[1], ref[1])) < 1e-4
    _all_free(restarted)
    dense = _small(dense_path, num_kv_blocks=24, num_host_kv_blocks=16, max_num_seqs=1, kv_cache_dir=cache)
    dense.generate([prompt], greedy, use_tqdm=False)
    assert dense.stats()["kv_disk_hit_blocks"] == 0
