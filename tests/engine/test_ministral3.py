"""Ministral 3 (Ministral3ForCausalLM; Devstral Small 2's text model): Mistral's decoder with YaRN
rope and Llama 4's attention temperature, queries at position p scaled by
1 + beta log(1 + floor(p / original_max_position_embeddings)) after RoPE. Checked token-exact
against transformers well past those positions (greedy, float32, chunked prefill, every logprob),
and the training path."""
from __future__ import annotations

import pytest

from cuttle.engine.config import ModelConfig
from helpers import assert_generates_as_transformers, assert_packed_forward_is_transformers, parity_prompts, save_checkpoint
from moe_families import randomize_

ORIGINAL = 96


@pytest.fixture(scope="module")
def ministral3(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("ministral3"))
    rope = {"type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
            "max_position_embeddings": 4 * ORIGINAL, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
            "llama_4_scaling_beta": 0.1}
    cfg = transformers.Ministral3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * ORIGINAL, rope_parameters=rope,
                                        eos_token_id=1, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    model = randomize_(transformers.Ministral3ForCausalLM(cfg).float().eval(), 0.15, seed=3)
    return save_checkpoint(path, model)


def test_ministral3_token_exact_past_its_original_positions(ministral3):
    path, model = ministral3
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.query_scaling, cfg.rope_scaling["rope_type"]) == ((0.1, ORIGINAL), "yarn")
    long = [(p * 4)[:n] for p, n in zip(parity_prompts()[4:], (100, 200, 260))]  # past 96 and 192 (scalings 1.07, 1.11)
    assert_generates_as_transformers(path, model, long + parity_prompts()[1:3], max_tokens=24)


def test_ministral3_training_path_matches_transformers(ministral3):
    path, model = ministral3
    assert_packed_forward_is_transformers(path, model, [(parity_prompts()[7] * 3)[:210], parity_prompts()[4]])
