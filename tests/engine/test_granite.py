"""Granite (GraniteForCausalLM, IBM's Granite 3.x): Llama's decoder with four scalings, embeddings x
embedding_multiplier, each output x residual_multiplier before its residual add, attention scores
x attention_multiplier (not 1/sqrt(head_dim)) and logits / logits_scaling. Checked token-exact
against transformers (greedy, float32, chunked prefill, logprobs of every step and of the prompt),
its training path and HF names; a multiplier that is not a positive number is refused by name."""
from __future__ import annotations

import json
import os

import pytest

from cuttle.engine.config import ModelConfig
from helpers import (assert_generates_as_transformers, assert_hf_names_round_trip, assert_packed_forward_is_transformers,
                     parity_prompts, save_checkpoint)
from moe_families import randomize_


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("granite"))
    # multipliers far from 1 (Granite 3.x's: 12, 0.22, 0.0078, 8), each of which changes the tokens
    cfg = transformers.GraniteConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                     embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05, logits_scaling=2.5,
                                     eos_token_id=1, bos_token_id=None, pad_token_id=0)
    model = randomize_(transformers.GraniteForCausalLM(cfg).float().eval(), 0.15, seed=6)
    return save_checkpoint(path, model)


def test_granite_token_exact_vs_transformers(granite):
    path, model = granite
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (3.0, 0.4, 0.05, 2.5)
    assert_generates_as_transformers(path, model, parity_prompts()[1:])


def test_granite_training_path_and_names(granite):
    path, model = granite
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])
    assert_hf_names_round_trip(path, model)


@pytest.mark.parametrize("bad", [0, -1.0, "8", True])
def test_granite_bad_multipliers_are_refused(granite, bad):
    path, _ = granite
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match="logits_scaling must be a positive number"):
        ModelConfig.from_hf({**hf, "logits_scaling": bad})
