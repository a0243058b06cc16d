"""KV tiers (engine/kv/tiers.py): a host tier and a disk tier under the device pool.

Exactness: with a device pool small enough to force offload, reload and swap-preemption, greedy
tokens and logprobs equal a run with a large pool bit for bit (fp32 and bf16). The engine's
kernels are not batch-invariant (a prefix computed in another batch differs in the last bits), so
each scenario keeps the schedule of the compared runs the same where the tier is not involved:
sequential sessions for offload/reload, concurrent decodes for swap. Then only the tier's copies
differ, and a copy that moved the wrong bytes (or raced a write) shows. Recompute, for contrast,
is not bit-identical in fp32 (asserted, so the swap comparison is known to be able to fail).
No leaks: random interleavings end with every block free in every tier; a copy slowed down on
purpose is never overtaken by a write. The disk tier survives a restart; another weight version,
another checkpoint, and corrupt or truncated files are misses.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig
from helpers import make_checkpoint
from kv_tiers_helpers import GREEDY, _all_free, _concurrent, _favor_copy, _result, _run_sessions, _sessions, _small


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiers-qwen3"))
    make_checkpoint(path, "qwen3")
    return path


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiers-qwen3-other"))
    make_checkpoint(path, "qwen3", seed=1)
    return path


# ---- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resumed_sessions_reload_from_host_bit_identical(model_path, dtype):
    sessions = _sessions(4, 3)
    ref_llm = _small(model_path, dtype, num_kv_blocks=256, max_num_seqs=1)
    ref = _run_sessions(ref_llm, sessions)
    # copy-in (read in place has its own tests: test_kv_tiers_in_place.py)
    tiered = _small(model_path, dtype, num_kv_blocks=24, num_host_kv_blocks=128, max_num_seqs=1, kv_read_in_place="never")
    got = _run_sessions(tiered, sessions)
    assert got == ref
    st_ = tiered.stats()
    assert st_["kv_offloaded_blocks"] > 0 and st_["kv_host_hit_blocks"] > 0
    # every resumed history came back by copy: nothing more computed than with the large pool
    assert st_["prefill_tokens_computed"] == ref_llm.stats()["prefill_tokens_computed"]
    assert st_["kv_bytes_host_to_device"] == st_["kv_host_hit_blocks"] * tiered.engine.tiers.bytes_per_block
    _all_free(tiered)
    # without the tier the small pool recomputes what it evicted
    plain = _small(model_path, dtype, num_kv_blocks=24, max_num_seqs=1)
    _run_sessions(plain, sessions)
    assert plain.stats()["prefill_tokens_computed"] > st_["prefill_tokens_computed"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swap_preemption_bit_identical_and_recomputes_nothing(model_path, dtype):
    ref_llm = _small(model_path, dtype, num_kv_blocks=64, max_num_seqs=3)
    ref = _concurrent(ref_llm)
    assert ref_llm.stats()["preemptions"] == 0
    swap = _favor_copy(_small(model_path, dtype, num_kv_blocks=20, num_host_kv_blocks=64, max_num_seqs=3))
    got = _concurrent(swap)
    st_ = swap.stats()
    assert st_["preemptions"] > 0 and st_["kv_swap_outs"] > 0 and st_["kv_swap_ins"] > 0
    assert got == ref
    assert st_["prefill_tokens_computed"] == 22 + 25 + 19  # the preempted came back by copy alone
    _all_free(swap)
    if dtype == "float32":  # recompute runs the prefix in another batch: not the same bits
        recompute = _small(model_path, dtype, num_kv_blocks=20, max_num_seqs=3)
        again = _concurrent(recompute)
        assert recompute.stats()["preemptions"] > 0
        assert [t for t, _ in again] == [t for t, _ in ref] and again != ref


def test_cost_model_keeps_recompute_when_copying_is_dearer(model_path):
    llm = _small(model_path, num_kv_blocks=20, num_host_kv_blocks=64, max_num_seqs=3)
    cost = llm.engine.tiers.cost
    assert cost.copy_bytes_per_s > 0 and cost.flops_per_s > 0
    # it is a comparison, not a constant (extreme sizes: the start-up rates are noisy on a loaded machine)
    assert cost.swap_pays(10**6, 1) and not cost.swap_pays(1, 10**9)
    cost.copy_bytes_per_s = 1.0  # a link slower than any recompute
    got = _concurrent(llm)
    st_ = llm.stats()
    assert st_["preemptions"] > 0 and st_["kv_swap_outs"] == 0 and st_["kv_preempt_recompute"] > 0
    ref = _concurrent(_small(model_path, num_kv_blocks=64, max_num_seqs=3))
    assert [t for t, _ in got] == [t for t, _ in ref]
    _all_free(llm)


def test_no_device_block_is_written_while_its_copy_is_in_flight(model_path):
    """Every copy sleeps first; the forward must still see each offload finished, and the
    outputs stay exact (a write racing a copy would corrupt the reloaded KV)."""
    sessions = _sessions(4, 3, seed=5)
    ref = _run_sessions(_small(model_path, num_kv_blocks=256, max_num_seqs=1), sessions)
    llm = _small(model_path, num_kv_blocks=24, num_host_kv_blocks=128, max_num_seqs=1)
    engine = llm.engine
    engine.tiers.transfer.slowdown_s = 0.01
    run = engine.runner.run
    checked = []

    def guarded(inputs):
        assert engine.tiers.unfenced_offloads() == 0, "the forward would write blocks still being copied out"
        loading = {b for blocks in engine.tiers.device_pins() for b in blocks}
        running = {b for s in engine.scheduler.running for b in s.block_table}
        assert not loading & running, "a running sequence holds a block a load is writing"
        checked.append(1)
        return run(inputs)

    engine.runner.run = guarded
    assert _run_sessions(llm, sessions) == ref
    assert checked and llm.stats()["kv_host_hit_blocks"] > 0
    _all_free(llm)


# ---- no leaks ----------------------------------------------------------------------------------
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 10), st.integers(1, 2)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("update_weights"), st.integers(0, 9)),
        st.tuples(st.just("docs"), st.integers(0, 10**6)),
    ),
    min_size=1, max_size=40,
)


@pytest.fixture(scope="module")
def property_llm(model_path, tmp_path_factory) -> LLM:
    # one engine for every example (a fresh one each would dominate the run time); every tier is
    # empty between examples, which the test asserts
    llm = LLM(model_path, dtype="float32", block_size=4, num_kv_blocks=16, num_host_kv_blocks=12, max_num_batched_tokens=16,
              max_num_seqs=4, max_model_len=60, kv_cache_dir=str(tmp_path_factory.mktemp("property-kv")))
    _favor_copy(llm)
    return llm


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS, slow=st.booleans(), in_place=st.sampled_from(["never", "always"]))
def test_random_interleavings_leave_every_tier_empty(property_llm, ops, slow, in_place):
    """add (shared histories, n up to 2) / squid requests over 5 documents / step / abort /
    weight updates over a device pool of 16 blocks, a host tier of 12 and a disk tier: offload of
    prefix blocks and whole documents, host eviction, reload from host and disk (document load
    jobs too), loads aborted in flight, swap slots, preemption, host hits copied in or read in
    place (tables that name host blocks: forked, preempted, aborted). After every op each block's
    count equals its holders in both pools; at the end every block of every tier is free."""
    llm = property_llm
    engine = llm.engine
    engine.tiers.transfer.slowdown_s = 0.002 if slow else 0.0
    engine.tiers.read_in_place = in_place
    bm = engine.block_manager
    stems = [[3 + (7 * s + i) % 200 for i in range(40)] for s in range(2)]
    docs = [[5 + (11 * d + 3 * i) % 190 for i in range(3 + 3 * d)] for d in range(5)]
    live: list[str] = []
    sched = engine.scheduler

    def check():
        # document jobs are sequences of no user request: the scheduler's queues hold them
        seqs = {id(s): s for s in [*sched.running, *sched.loading, *sched.waiting]}
        seqs.update((id(s), s) for r in engine.requests.values() for s in r.seqs if not s.is_finished)
        bm.check_invariants(list(seqs.values()), pins=engine.squid.held_pins())
        assert all(b.ref_count >= 0 for b in engine.tiers.host_pool.blocks)

    for k, op in enumerate(ops):
        if op[0] == "add":
            _, stem, extra, n = op
            toks = stems[stem % 2][: 8 + 3 * extra]
            rid = f"p{k}-{len(engine.requests)}"
            engine.add_request(rid, toks, SamplingParams(n=n, temperature=0 if n == 1 else 1.0, max_tokens=2 + extra, ignore_eos=True))
            live.append(rid)
        elif op[0] == "docs":
            r = op[1]
            pick = [docs[(r >> (3 * k)) % 5] for k in range(1 + r % 2)]
            rid = f"d{k}-{len(engine.requests)}"
            engine.add_request(rid, {"prefix": [3] * (r % 3), "documents": pick, "prompt": [90, 91 + r % 5]},
                               SamplingParams(max_tokens=1 + r % 4, n=1 + (r >> 20) % 2, seed=r))
            live.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        elif op[0] == "abort":
            if live:
                engine.abort_request(live.pop(op[1] % len(live)))
        elif op[1] == 0:
            engine.update_weights([], in_flight="finish")
            live.clear()
        check()
    while engine.has_unfinished_requests():
        engine.step()
        check()
    engine.tiers.drain()
    check()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    host = engine.tiers.host_pool
    assert host.num_free == len(host) and all(b.ref_count == 0 for b in host.blocks)
    assert not engine.tiers.swapped and not engine.tiers.loads
    assert not engine.squid.jobs and not engine.squid.pins


# ---- the disk tier -----------------------------------------------------------------------------
def _disk_llm(path: str, cache_dir: str, **kw) -> LLM:
    return _small(path, num_kv_blocks=kw.pop("num_kv_blocks", 24), num_host_kv_blocks=kw.pop("num_host_kv_blocks", 16),
                  max_num_seqs=1, kv_cache_dir=cache_dir, **kw)


def _fill_disk(path: str, cache_dir: str, **kw):
    """One engine's life: sessions that push their KV through the host tier to disk. Session 0's
    history up to its third turn ends up there whole (the later turns of the others evict it)."""
    sessions = _sessions(4, 3, seed=9)
    llm = _disk_llm(path, cache_dir, **kw)
    results = _run_sessions(llm, sessions)
    llm.engine.tiers.drain()
    assert llm.stats()["kv_disk_entries"] > 0 and llm.stats()["kv_bytes_host_to_disk"] > 0
    return sessions, results


def _resume_prompt(sessions, results) -> list[int]:
    """Session 0's second-turn prompt: a prefix of the history the last engine wrote to disk."""
    return sessions[0][0] + results[0][0] + sessions[0][1]


def _resume(llm: LLM, sessions, results) -> tuple:
    return _result(llm.generate([_resume_prompt(sessions, results)], GREEDY, use_tqdm=False)[0])


def _close(a: tuple, b: tuple, tol: float = 1e-4) -> bool:
    """Same tokens, logprobs within `tol` (for runs whose prefix hit ends at another block than the
    reference's, so the rest is computed in other chunks: last-bit differences, never garbage)."""
    return a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) < tol


def test_disk_tier_survives_a_restart(model_path, tmp_path):
    cache = str(tmp_path / "kv")
    sessions, results = _fill_disk(model_path, cache)
    ref_llm = _small(model_path, num_kv_blocks=256, max_num_seqs=1)  # the same life, all on device
    assert _run_sessions(ref_llm, sessions) == results
    ref = _resume(ref_llm, sessions, results)
    restarted = _disk_llm(model_path, cache)
    assert _resume(restarted, sessions, results) == ref
    st_ = restarted.stats()
    full_blocks = (len(_resume_prompt(sessions, results)) - 1) // 4
    assert st_["kv_disk_hit_blocks"] == full_blocks and st_["kv_bytes_disk_to_host"] > 0 and st_["kv_disk_bad_entries"] == 0
    assert st_["prefill_tokens_computed"] == len(_resume_prompt(sessions, results)) - 4 * full_blocks
    _all_free(restarted)


def test_disk_tier_is_not_reused_across_weights_or_checkpoints(model_path, other_model_path, tmp_path):
    cache = str(tmp_path / "kv")
    sessions, results = _fill_disk(model_path, cache)
    updated = _disk_llm(model_path, cache)
    updated.update_weights([])  # same values, new version: nothing old may be hit
    fresh = _resume(_small(model_path, num_kv_blocks=256, max_num_seqs=1), sessions, results)  # computed whole
    assert _resume(updated, sessions, results) == fresh
    assert updated.stats()["kv_disk_hit_blocks"] == 0
    other = _disk_llm(other_model_path, cache)  # same tokens, same chain hashes: only the namespace differs
    _resume(other, sessions, results)
    assert other.stats()["kv_disk_hit_blocks"] == 0
    again = _disk_llm(model_path, cache)  # the original weights' entries are still there
    _resume(again, sessions, results)
    assert again.stats()["kv_disk_hit_blocks"] > 0


def test_disk_tier_is_not_reused_across_forward_options(model_path, tmp_path):
    """Options that change the forward before the lm_head (weight quantization, top-k sparse
    attention and its fields) change every KV value: an engine with another of them never reads
    the entries (they used to be read, silently giving another engine's KV); `quantize_lm_head`
    changes only the logits and shares them."""
    cache = str(tmp_path / "kv")
    topk = "topk:budget=16,block=4,dense_layers=0"
    sessions, results = _fill_disk(model_path, cache)
    for kw in (dict(quantization="mxfp8"), dict(sparse_attention=topk), dict(sparse_attention=topk.replace("16", "32"))):
        other = _disk_llm(model_path, cache, **kw)
        fresh = _resume(_small(model_path, num_kv_blocks=256, max_num_seqs=1, **kw), sessions, results)
        assert _resume(other, sessions, results) == fresh, kw
        assert other.stats()["kv_disk_hit_blocks"] == 0, kw
    plain = _disk_llm(model_path, cache)
    _resume(plain, sessions, results)
    assert plain.stats()["kv_disk_hit_blocks"] > 0
    mx_cache = str(tmp_path / "kv-mxfp8")
    sessions, results = _fill_disk(model_path, mx_cache, quantization="mxfp8")
    lm_head_too = _disk_llm(model_path, mx_cache, quantization="mxfp8", quantize_lm_head=True)
    _resume(lm_head_too, sessions, results)
    assert lm_head_too.stats()["kv_disk_hit_blocks"] > 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_or_truncated_disk_entry_is_a_miss(model_path, tmp_path, damage):
    cache = str(tmp_path / "kv")
    sessions, results = _fill_disk(model_path, cache)
    fresh = _resume(_small(model_path, num_kv_blocks=256, max_num_seqs=1), sessions, results)
    clean = _disk_llm(model_path, cache)  # which entries a resume reads: damage the second one
    engine = clean.engine
    prompt = _resume_prompt(sessions, results)
    bs, extra = 4, b"\0" * 8
    from cuttle.engine.kv.prefix_index import hash_block

    keys, parent = [], -1
    for i in range((len(prompt) - 1) // bs):
        parent = hash_block(parent, prompt[i * bs : (i + 1) * bs], extra)
        keys.append(parent)
    run = next((i for i, k in enumerate(keys) if k not in engine.tiers.disk), len(keys))
    assert run >= 2, "the resumed history should start with entries on disk"
    victim = engine.tiers.disk.path(keys[1])
    with open(victim, "r+b") as f:
        if damage == "flip":
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x40]))
        else:
            f.truncate(os.path.getsize(victim) - 7)
    assert _close(_resume(clean, sessions, results), fresh)
    st_ = clean.stats()
    assert st_["kv_disk_bad_entries"] == 1
    assert st_["kv_disk_hit_blocks"] == 1  # the entry before it only
    assert not os.path.exists(victim)
    _all_free(clean)


def test_disk_tier_stays_within_its_size(model_path, tmp_path):
    cache = str(tmp_path / "kv")
    per_file = None
    llm = _disk_llm(model_path, cache, kv_cache_dir_gb=6 * 2500 / 2**30)  # room for a handful of blocks
    disk = llm.engine.tiers.disk
    per_file = disk.file_bytes
    _run_sessions(llm, _sessions(4, 2, seed=3))
    llm.engine.tiers.drain()
    files = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert sum(os.path.getsize(f) for f in files) <= disk.capacity_bytes
    assert len(files) == len(disk.entries) == disk.capacity_bytes // per_file


# ---- options and observability -----------------------------------------------------------------
def test_tier_options_are_off_by_default_and_checked(model_path, tmp_path):
    cfg = EngineConfig(model=model_path)
    assert cfg.kv_offloading_size == 0 and cfg.num_host_kv_blocks is None and cfg.kv_cache_dir is None
    llm = _small(model_path)
    assert llm.engine.tiers is None and llm.engine.block_manager.tiers is None
    assert not any(k.startswith("kv_host") for k in llm.stats())
    for kw, msg in [
        (dict(kv_offloading_size=-1.0), "kv_offloading_size"),
        (dict(num_host_kv_blocks=0), "num_host_kv_blocks"),
        (dict(kv_cache_dir=str(tmp_path)), "kv_cache_dir needs the host tier"),
        (dict(num_host_kv_blocks=4, kv_cache_dir=str(tmp_path), kv_cache_dir_gb=0.0), "kv_cache_dir_gb"),
    ]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model=model_path, **kw)
    with pytest.raises(ValueError, match="holds not even one KV block"):
        _small(model_path, kv_offloading_size=1e-9)
    with pytest.raises(ValueError, match="holds not even one block"):
        _small(model_path, num_host_kv_blocks=4, kv_cache_dir=str(tmp_path / "d"), kv_cache_dir_gb=1e-9)


def test_tier_counters_reach_stats_and_metrics(model_path):
    from cuttle.engine.metrics import ServerMetrics

    llm = _small(model_path, num_kv_blocks=24, num_host_kv_blocks=128, max_num_seqs=1)
    _run_sessions(llm, _sessions(4, 2))
    st_ = llm.stats()
    assert st_["kv_host_hit_blocks"] > 0 and st_["kv_bytes_device_to_host"] > 0 and st_["kv_transfer_blocked_s"] >= 0
    text = ServerMetrics("m").render(st_).decode()
    assert 'cuttle_kv_tier_hit_blocks_total{model_name="m",tier="host"}' in text
    assert f'cuttle_kv_tier_bytes_total{{direction="device_to_host",model_name="m"}} {float(st_["kv_bytes_device_to_host"])}' in text
    assert "cuttle_kv_transfer_blocked_seconds_total" in text
    assert f'cuttle_kv_tier_documents_total{{event="offloaded",model_name="m"}} {float(st_["kv_offloaded_documents"])}' in text
    plain = ServerMetrics("m").render(_small(model_path).stats()).decode()
    assert "cuttle_kv_tier_hit_blocks_total{" not in plain


def test_kv_bytes_move_as_whole_blocks_for_every_layer(model_path):
    llm = _small(model_path, num_kv_blocks=24, num_host_kv_blocks=32, max_num_seqs=1)
    tiers = llm.engine.tiers
    dev = llm.engine.runner.kv
    dev.tensor.copy_(torch.randn_like(dev.tensor))
    tiers.transfer.submit(lambda: tiers.transfer.device_to_host(dev, [3, 4, 9], tiers.host_kv, [7, 8, 0])).wait()
    assert torch.equal(tiers.host_kv.tensor[:, :, [7, 8, 0]], dev.tensor[:, :, [3, 4, 9]])
    tiers.transfer.submit(lambda: tiers.transfer.host_to_device(tiers.host_kv, [0, 7], dev, [1, 2])).wait()
    assert torch.equal(dev.tensor[:, :, [1, 2]], dev.tensor[:, :, [9, 3]])


def test_cli_flags_reach_the_engine(model_path, tmp_path, monkeypatch):
    from cuttle.engine import cli

    built = []
    monkeypatch.setattr(cli, "_stream", lambda llm, prompt, params: built.append(llm) or "")
    cli.main(["generate", "hi", "--model", model_path, "--dtype", "float32", "--num-kv-blocks", "32", "--num-host-kv-blocks", "20",
              "--kv-cache-dir", str(tmp_path / "kv"), "--kv-cache-dir-gb", "0.5"])
    tiers = built[0].engine.tiers
    assert len(tiers.host_pool) == 20 and tiers.disk.capacity_bytes == 2**29 and tiers.disk.root == str(tmp_path / "kv")
    cli.main(["generate", "hi", "--model", model_path, "--dtype", "float32", "--kv-offloading-size", "0.001"])
    assert len(built[1].engine.tiers.host_pool) == int(0.001 * 2**30) // built[1].engine.runner.kv.block_bytes
    cli.main(["generate", "hi", "--model", model_path, "--dtype", "float32"])
    assert built[2].engine.tiers is None
