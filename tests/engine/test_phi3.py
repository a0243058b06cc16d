"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's decoder with q/k/v and gate/up fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, read straight into the decoder's fused weights), Phi-4-mini's partial
rotary (3/4 of each head) and Phi-3-mini's sliding window. Checked token-exact against
transformers (greedy, float32, chunked prefill, logprobs of every step and of the prompt, past the
window), its training path, and its HF names both ways (the fused names, never the split ones);
longrope scaling (Phi-3's 128k variants, Phi-4-mini) token-exact within its original length,
where transformers uses the short factors, a longer max_model_len refused."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from cuttle.engine import LLM
from cuttle.engine.config import ModelConfig
from helpers import (assert_generates_as_transformers, assert_hf_names_round_trip, assert_packed_forward_is_transformers,
                     parity_prompts, save_checkpoint)
from moe_families import randomize_

VARIANTS = {"phi4": dict(), "phi4_mini_partial_window": dict(partial_rotary_factor=0.75, sliding_window=24)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request, tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp(request.param))
    cfg = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                                  tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=0,
                                  **VARIANTS[request.param])
    model = randomize_(transformers.Phi3ForCausalLM(cfg).float().eval(), 0.15, seed=9)
    return (*save_checkpoint(path, model), request.param)


def test_phi3_token_exact_vs_transformers(phi3):
    path, model, name = phi3
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.architecture == "Phi3ForCausalLM"
    if name == "phi4_mini_partial_window":
        assert (cfg.rotary_dim, cfg.sliding_window) == (12, 24)
    assert_generates_as_transformers(path, model, parity_prompts()[1:])  # up to 70 tokens: past the window


def test_phi3_training_path_matches_transformers(phi3):
    path, model, _ = phi3
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])


def test_phi3_hf_names_both_ways(phi3):
    path, model, _ = phi3
    assert_hf_names_round_trip(path, model)  # the fused names, never the split ones


def _longrope(tmp_path_factory, partial: float):
    import transformers

    dim = int(16 * partial)  # head_dim 16: one factor per rotated pair
    g = torch.Generator().manual_seed(4)
    scaling = {"rope_type": "longrope", "short_factor": (1 + torch.rand(dim // 2, generator=g) * 3).tolist(),
               "long_factor": (4 + torch.rand(dim // 2, generator=g) * 8).tolist(), "rope_theta": 10000.0,
               "partial_rotary_factor": partial}
    cfg = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=128,
                                  rms_norm_eps=1e-5, rope_parameters=scaling, partial_rotary_factor=partial,
                                  tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=0)
    model = randomize_(transformers.Phi3ForCausalLM(cfg).float().eval(), 0.15, seed=9)
    return save_checkpoint(str(tmp_path_factory.mktemp(f"longrope{partial}")), model)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_phi3_longrope_within_the_original_length(tmp_path_factory, partial):
    """LongRoPE (Phi-3's 128k variants, Phi-4-mini): the short factors and the attention factor
    sqrt(1 + ln(factor) / ln(original)) on cos / sin, token-exact against transformers (which uses
    the short factors while a sequence stays within original_max_position_embeddings); served
    within that length, a longer max_model_len refused naming why."""
    path, model = _longrope(tmp_path_factory, partial)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.max_position_embeddings == 128
    assert abs(cfg.rope_scaling["attention_factor"] - math.sqrt(1 + math.log(8) / math.log(128))) < 1e-12
    assert_generates_as_transformers(path, model, parity_prompts()[1:])  # up to 70 prompt tokens, + new ones: within 128
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])
    with pytest.raises(ValueError, match=r"max_model_len \(256\) exceeds the model's original_max_position_embeddings \(128\)"):
        LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    # the short factors are what makes it exact: transformers past the original length differs
    ids = torch.tensor([parity_prompts()[7] * 3])[:, :140]
    with torch.no_grad():
        short = model(ids[:, :128]).logits[0]
        whole = model(ids).logits[0, :128]  # the same positions, the sequence past 128: long factors
    assert not torch.allclose(short, whole, atol=1e-3)


def test_phi3_longrope_fields_are_checked(phi3):
    path, _, _ = phi3
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf.pop("rope_parameters", None)
    hf.pop("original_max_position_embeddings", None)
    rot = hf["hidden_size"] // hf["num_attention_heads"] // 2
    good = {"type": "longrope", "short_factor": [1.0] * rot, "long_factor": [2.0] * rot}
    assert ModelConfig.from_hf({**hf, "rope_scaling": good, "original_max_position_embeddings": 256}).max_position_embeddings == 256
    su = {**good, "type": "su"}  # Phi-3's first name for it
    assert ModelConfig.from_hf({**hf, "rope_scaling": su, "original_max_position_embeddings": 256}).rope_scaling["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelConfig.from_hf({**hf, "rope_scaling": good})
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_hf({**hf, "rope_scaling": {**good, "short_factor": [1.0, -2.0]}, "original_max_position_embeddings": 256})
    from cuttle.attention.rope import rope_inv_freq

    cfg = ModelConfig.from_hf({**hf, "rope_scaling": {**good, "long_factor": [2.0] * (rot + 1)}, "original_max_position_embeddings": 256})
    with pytest.raises(ValueError, match="long_factor has"):
        rope_inv_freq(2 * rot, 10000.0, cfg.rope_scaling)
