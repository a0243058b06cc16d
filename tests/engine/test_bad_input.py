"""Bad input gets a clear error naming the field and the limit; the engine keeps serving."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from cuttle.engine import LLM, SamplingParams

INVALID = [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("min_tokens", -1), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("prompt_logprobs", -1), ("temperature", float("nan")),
    ("n", 1.5), ("stop", [""]), ("stop_token_ids", [-1]), ("stop", ["x"] * 1025),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("[")[0]):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_bad_requests_leave_others_running(qwen3_path):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    engine = llm.engine
    good = [engine.add_request(f"g{i}", [5 + i, 6, 7, 8], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for i in range(3)]
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(3, 200)), SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("long2", [5] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty2", "", SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        engine.add_request("oov", [5, 100000], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("g0", [5], SamplingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == ["g0", "g1", "g2"]
    assert all(len(o.outputs[0].token_ids) == 20 for o in done.values())
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    assert all(g.request_id in done for g in good)


def test_min_tokens_with_only_stop_tokens_allowed_is_refused(qwen3_path):
    """allowed_token_ids holding only stop / EOS ids beside min_tokens leaves nothing to sample
    below min_tokens (every logit -inf: it sampled garbage, or a 500 with logprobs)."""
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    eos = sorted(llm.engine.eos_token_ids)[0]
    with pytest.raises(ValueError, match=r"allowed_token_ids .* are all stop or EOS tokens, which min_tokens \(3\)"):
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=5), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2, max_tokens=5), use_tqdm=False)
    out = llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[7, eos], min_tokens=2, max_tokens=3, temperature=0),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out[:2] == [7, 7]


def test_generate_with_one_bad_prompt_adds_nothing(qwen3_path):
    llm = LLM(qwen3_path, dtype="float32", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], list(range(3, 100))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(qwen3_path, tmp_path):
    d = _copy(qwen3_path, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["MambaForCausalLM"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported architecture.*MambaForCausalLM"):
        LLM(d)


def test_missing_files(qwen3_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))
    d = _copy(qwen3_path, str(tmp_path / "m"))
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(d)


def test_shape_mismatch(qwen3_path, tmp_path):
    d = _copy(qwen3_path, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="shape mismatch for 'model.layers.0.mlp"):
        LLM(d, dtype="float32")


def test_bad_engine_options(qwen3_path):
    with pytest.raises(ValueError, match="block_size"):
        LLM(qwen3_path, block_size=12)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(qwen3_path, attention_backend="xformers")
    with pytest.raises(ValueError, match="dtype"):
        LLM(qwen3_path, dtype="int4")
    # these started engines that could serve nothing (every step failed, or max_model_len 16)
    with pytest.raises(ValueError, match="attention_backend='triton' on CPU needs the Triton interpreter"):
        LLM(qwen3_path, attention_backend="triton")
    for gb in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_cache_memory_gb must be a finite number"):
            LLM(qwen3_path, kv_cache_memory_gb=gb)
    with pytest.raises(ValueError, match=r"max_model_len \(128\) needs 8 KV blocks of 16 tokens, and the pool has 4"):
        LLM(qwen3_path, max_model_len=128, num_kv_blocks=4)
    with pytest.raises(ValueError, match="num_kv_blocks asks for"):
        LLM(qwen3_path, num_kv_blocks=10**10)
    with pytest.raises(ValueError, match="num_host_kv_blocks asks for"):
        LLM(qwen3_path, num_kv_blocks=16, num_host_kv_blocks=10**10)
    # a pool that fits the free memory only without the weights loaded beside it (a stand-in free
    # figure: the weights' bytes plus half a pool)
    from cuttle.engine import llm_engine, memory_budget

    weights = memory_budget.checkpoint_weight_bytes(qwen3_path, torch.float32)
    per_block = LLM(qwen3_path, dtype="float32", num_kv_blocks=16).engine.runner.kv.block_bytes
    real = llm_engine.free_memory_bytes
    try:
        llm_engine.free_memory_bytes = lambda device: weights + 8 * per_block
        with pytest.raises(ValueError, match=r"num_kv_blocks asks for .* less the model's .* GiB of weights"):
            LLM(qwen3_path, dtype="float32", num_kv_blocks=16)
        assert LLM(qwen3_path, dtype="float32", num_kv_blocks=8, max_model_len=64).engine.block_manager.num_blocks == 8
    finally:
        llm_engine.free_memory_bytes = real
