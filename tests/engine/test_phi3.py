"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's decoder with q/k/v and gate/up fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, read straight into the decoder's fused weights), Phi-4-mini's partial
rotary (3/4 of each head) and Phi-3-mini's sliding window. Checked token-exact against
transformers (greedy, float32, chunked prefill, logprobs of every step and of the prompt, past the
window), its training path, and its HF names both ways (the fused names, never the split ones);
longrope scaling (Phi-3's 128k variants) is refused by name."""
from __future__ import annotations

import json
import os

import pytest

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


def test_phi3_longrope_is_refused(phi3):
    path, _, _ = phi3
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf.pop("rope_parameters", None)
    long = {**hf, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
            "original_max_position_embeddings": 256}
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf(long)
