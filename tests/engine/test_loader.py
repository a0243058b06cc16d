"""Checkpoint layouts: sharded safetensors with an index, tied embeddings, a missing shard."""
from __future__ import annotations

import json
import os

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from helpers import hf_greedy, make_checkpoint


def test_sharded_checkpoint_with_tied_embeddings(tmp_path):
    path = str(tmp_path / "m")
    model = make_checkpoint(path, "qwen3", seed=3, tie_word_embeddings=True)
    model.save_pretrained(path, max_shard_size="60KB")  # re-save sharded over the single file
    os.remove(os.path.join(path, "model.safetensors")) if os.path.exists(os.path.join(path, "model.safetensors")) else None
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]
    prompts = [[5, 9, 13, 200, 17], [40, 41, 42]]
    ref, _, _ = hf_greedy(model, prompts, 16)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.lm_head is llm.engine.runner.model.embed
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(FileNotFoundError, match="missing shards"):
        LLM(path, dtype="float32")


def test_bfloat16_engine_runs_and_tracks_float32(tmp_path):
    path = str(tmp_path / "m")
    make_checkpoint(path, "qwen3_moe", seed=4)
    p = [[5, 6, 7, 8, 9, 10, 11]]
    lp32 = LLM(path, dtype="float32", num_kv_blocks=32).generate(p, SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)
    lp16 = LLM(path, dtype="bfloat16", num_kv_blocks=32).generate(p, SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)
    a, b = lp32[0].outputs[0], lp16[0].outputs[0]
    assert b.logprobs[0][b.token_ids[0]].logprob == pytest.approx(a.logprobs[0][b.token_ids[0]].logprob, abs=0.15)
    assert torch.isfinite(torch.tensor(b.cumulative_logprob))
