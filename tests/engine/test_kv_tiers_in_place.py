"""Read in place (engine/kv/tiers.py, docs/kv_tiers.md): host-tier hits that stay in the host tier,
their blocks named in the sequence's table (HOST_BLOCK ids) and read there by the attention kernel.

Exactness as in test_kv_tiers.py (same scenarios, so the compared runs batch alike): sequential
sessions through a 24-block device pool against a 256-block one, fp32 and bf16, bit-identical
greedy tokens and logprobs, (a) every host hit read in place (nothing copied in, nothing more
computed), (b) the cost model choosing per run, pinned so that short turns read in place and
long ones copy in, both in one run; (c) concurrent decodes whose preempted members come back by
a swap slot plus host blocks read in place. A table reading the host tier holds its host blocks:
nothing leaks, and the host blocks stay pinned while read. Decode steps reading host blocks replay
kernel graphs, equal to the eager engine. The engine option is checked.
"""
from __future__ import annotations

import pytest

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import EngineConfig
from kv_tiers_helpers import _all_free, _check_all_read_in_place, _concurrent, _favor_copy, _result, _run_sessions, _sessions, _small


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from helpers import make_checkpoint

    path = str(tmp_path_factory.mktemp("in-place-qwen3"))
    make_checkpoint(path, "qwen3")
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sessions_read_host_tier_in_place_bit_identical(model_path, dtype):
    sessions = _sessions(4, 3)
    ref_llm = _small(model_path, dtype, num_kv_blocks=256, max_num_seqs=1)
    ref = _run_sessions(ref_llm, sessions)
    llm = _small(model_path, dtype, num_kv_blocks=24, num_host_kv_blocks=128, max_num_seqs=1, kv_read_in_place="always")
    assert _run_sessions(llm, sessions) == ref
    _check_all_read_in_place(llm, ref_llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_reading_host_blocks_replay_graphs(model_path, dtype):
    """Decode steps whose tables name host blocks read in place replay kernel graphs (every graph
    holds the host tier once it is attached): tokens and logprobs equal the eager engine's."""
    from cuttle.attention.metadata import HOST_BLOCK

    sessions = _sessions(4, 3, seed=5)
    kw = dict(num_kv_blocks=24, num_host_kv_blocks=128, max_num_seqs=1, kv_read_in_place="always")
    eager = _run_sessions(_small(model_path, dtype, enforce_eager=True, **kw), sessions)
    llm = _small(model_path, dtype, **kw)
    graphs = llm.engine.runner.graphs
    replayed_host = []
    run = graphs.run

    def counting(inputs):
        logits = run(inputs)
        if logits is not None and inputs.graph is not None:
            replayed_host.append(bool((inputs.meta.block_tables >= HOST_BLOCK).any()))
        return logits

    graphs.run = counting
    assert _run_sessions(llm, sessions) == eager
    assert sum(replayed_host) > 10, (sum(replayed_host), len(replayed_host))  # replays with host blocks in the table
    assert llm.stats()["kv_read_in_place_blocks"] > 0
    _all_free(llm)


def _mixed_turns(llm: LLM, sessions) -> list:
    """Like _run_sessions, with turns alternating 4 and 12 new tokens."""
    history = [[] for _ in sessions]
    results = []
    for t in range(len(sessions[0])):
        params = SamplingParams(temperature=0, max_tokens=4 if t % 2 else 12, ignore_eos=True, logprobs=0)
        for s, turns in enumerate(sessions):
            prompt = history[s] + turns[t]
            toks, lps = _result(llm.generate([prompt], params, use_tqdm=False)[0])
            results.append((toks, lps))
            history[s] = prompt + toks
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cost_model_chooses_copy_in_or_read_in_place_per_run(model_path, dtype):
    sessions = _sessions(4, 4, seed=3)
    ref = _mixed_turns(_small(model_path, dtype, num_kv_blocks=256, max_num_seqs=1, max_model_len=128), sessions)
    llm = _small(model_path, dtype, num_kv_blocks=32, num_host_kv_blocks=128, max_num_seqs=1, max_model_len=128)
    cost = _favor_copy(llm).engine.tiers.cost
    assert llm.engine.tiers.read_in_place == "auto"  # the default on CPU
    # a host read 1/8 as fast as a copy: a run read by at most 8 steps reads in place
    cost.host_read_penalty_s_per_byte = 1 / (8 * cost.copy_bytes_per_s)
    assert cost.read_in_place_pays(10, 4) and not cost.read_in_place_pays(10, 12)
    assert _mixed_turns(llm, sessions) == ref
    st = llm.stats()
    assert st["kv_read_in_place_runs"] > 0 and st["kv_copy_in_runs"] > 0  # both choices, one run
    assert 0 < st["kv_read_in_place_blocks"] < st["kv_host_hit_blocks"]
    copied = st["kv_host_hit_blocks"] - st["kv_read_in_place_blocks"]
    assert st["kv_bytes_host_to_device"] == copied * llm.engine.tiers.bytes_per_block
    _all_free(llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swap_preemption_with_read_in_place_bit_identical(model_path, dtype):
    ref_llm = _small(model_path, dtype, num_kv_blocks=64, max_num_seqs=3)
    ref = _concurrent(ref_llm)
    llm = _favor_copy(_small(model_path, dtype, num_kv_blocks=20, num_host_kv_blocks=64, max_num_seqs=3,
                             kv_read_in_place="always"))
    assert _concurrent(llm) == ref
    st = llm.stats()
    assert st["preemptions"] > 0 and st["kv_swap_ins"] > 0 and st["kv_read_in_place_blocks"] > 0
    assert st["kv_bytes_host_to_device"] == st["kv_swap_ins"] * llm.engine.tiers.bytes_per_block  # the swap slots only
    assert st["prefill_tokens_computed"] == 22 + 25 + 19
    _all_free(llm)


def test_host_blocks_read_in_place_stay_pinned_while_read(model_path):
    """While a sequence reads host blocks in place, they are held (not free, not reusable by an
    offload); when it finishes they are free again and still cached."""
    llm = _small(model_path, num_kv_blocks=24, num_host_kv_blocks=64, max_num_seqs=1, kv_read_in_place="always")
    engine = llm.engine
    prompt = list(range(3, 43))  # 10 blocks
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.generate([list(range(100, 180))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine.add_request("r", prompt + [7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    seq = engine.requests["r"].seqs[0]
    from cuttle.attention.metadata import HOST_BLOCK

    cold = [b - HOST_BLOCK for b in seq.block_table if b >= HOST_BLOCK]
    assert cold, "the first prompt's blocks were expected in the host tier"
    host = engine.tiers.host_pool
    assert all(host.blocks[h].ref_count == 1 and h not in host.free for h in cold)
    engine.block_manager.check_invariants([seq])
    while engine.has_unfinished_requests():
        engine.step()
    assert all(host.blocks[h].ref_count == 0 and host.blocks[h].cached for h in cold)
    _all_free(llm)


def test_read_in_place_option_is_checked():
    with pytest.raises(ValueError, match="kv_read_in_place"):
        EngineConfig(model="x", kv_read_in_place="sometimes")
