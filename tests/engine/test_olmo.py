"""OLMo 2 / OLMo 3 (Olmo2ForCausalLM / Olmo3ForCausalLM, AI2's fully open models, common in RL
research): post-norm layers (x + norm(attn(x)), then x + norm(mlp(x)); no norm before either), q and
k RMSNormed over all their heads at once, and OLMo 3's sliding windows on three layers of four.
Checked token-exact against transformers (greedy, float32, chunked prefill, logprobs of every step
and of the prompt, past the window), the training path, and HF names both ways; OLMo 3 rope
parameters that differ between layer types are refused by name."""
from __future__ import annotations

import pytest
import torch

from cuttle.engine.config import ModelConfig
from helpers import (assert_generates_as_transformers, assert_hf_names_round_trip, assert_packed_forward_is_transformers,
                     parity_prompts, save_checkpoint)
from moe_families import randomize_


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def olmo(request, tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp(request.param))
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=1, bos_token_id=None, pad_token_id=0)
    if request.param == "olmo2":
        cfg, cls = transformers.Olmo2Config(**common), transformers.Olmo2ForCausalLM
    else:
        cfg, cls = transformers.Olmo3Config(sliding_window=24, **common), transformers.Olmo3ForCausalLM
    model = randomize_(cls(cfg).float().eval(), 0.15, seed=4)
    with torch.no_grad():  # norm weights away from 1, so a norm applied in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return (*save_checkpoint(path, model), request.param)


def test_olmo_token_exact_vs_transformers(olmo):
    path, model, name = olmo
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.post_norm and cfg.qk_norm and cfg.qk_norm_whole
    if name == "olmo3":
        assert (cfg.sliding_window, cfg.sliding_window_layers) == (24, (0, 1, 2))
    assert_generates_as_transformers(path, model, parity_prompts()[1:])  # up to 70 tokens: past OLMo 3's window


def test_olmo_training_path_matches_transformers(olmo):
    path, model, _ = olmo
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])


def test_olmo_hf_names_both_ways(olmo):
    path, model, _ = olmo
    assert_hf_names_round_trip(path, model)


def test_olmo3_rope_differing_between_layer_types_is_refused():
    import transformers

    hf = transformers.Olmo3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                  max_position_embeddings=512).to_dict()
    hf["architectures"] = ["Olmo3ForCausalLM"]
    rope = hf["rope_parameters"]
    assert set(rope) == {"sliding_attention", "full_attention"}
    assert ModelConfig.from_hf(hf).rope_theta == rope["full_attention"]["rope_theta"]
    bad = {**hf, "rope_parameters": {**rope, "full_attention": {**rope["full_attention"], "rope_theta": 12345.0}}}
    with pytest.raises(ValueError, match="differ between layer types"):
        ModelConfig.from_hf(bad)
