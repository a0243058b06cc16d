"""Seed-OSS (SeedOssForCausalLM, ByteDance's Seed-OSS-36B): Llama's decoder with q/k/v biases and
an explicit head_dim (Qwen2's switches here), checked token-exact against transformers (greedy,
float32, chunked prefill, logprobs of every step and of the prompt) on a tiny random checkpoint,
and its training path; the o_proj / MLP biases its config can switch on are refused by name.
Its `<seed:tool_call>` calls and `<seed:think>` reasoning: tests/engine/test_tool_parsers.py and
test_reasoning_parsers.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from cuttle.engine.config import ModelConfig
from helpers import (assert_generates_as_transformers, assert_packed_forward_is_transformers,
                     parity_prompts, save_checkpoint)
from moe_families import randomize_


@pytest.fixture(scope="module")
def seed_oss(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("seed_oss"))
    cfg = transformers.SeedOssConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6,
                                     rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=0)
    model = randomize_(transformers.SeedOssForCausalLM(cfg).float().eval(), 0.15, seed=5)
    with torch.no_grad():  # biases large enough that dropping one changes the tokens
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    assert model.model.layers[0].self_attn.q_proj.bias is not None and model.model.layers[0].self_attn.o_proj.bias is None
    return save_checkpoint(path, model)


def test_seed_oss_token_exact_vs_transformers(seed_oss):
    path, model = seed_oss
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.head_dim, cfg.attention_bias, cfg.proj_bias) == ("SeedOssForCausalLM", 24, True, False)
    assert_generates_as_transformers(path, model, parity_prompts()[1:])


def test_seed_oss_training_path_matches_transformers(seed_oss):
    path, model = seed_oss
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[3], parity_prompts()[6]])


@pytest.mark.parametrize("field", ["attention_out_bias", "mlp_bias"])
def test_seed_oss_biases_it_does_not_have_are_refused(seed_oss, field):
    path, _ = seed_oss
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=f"{field}: true .* is not supported for SeedOssForCausalLM"):
        ModelConfig.from_hf({**hf, field: True})
