"""Ministral 3 (Ministral3ForCausalLM; Devstral Small 2's text model): Mistral's decoder with YaRN
rope and Llama 4's attention temperature, which scales the queries past
`original_max_position_embeddings` and which cuttle does not compute: the engine serves it within
those positions (max_model_len defaults to them, a longer one is refused naming the field), where
the scaling is exactly 1. Checked token-exact against transformers there (greedy, float32,
chunked prefill, every logprob)."""
from __future__ import annotations

import pytest

from cuttle.engine import LLM
from cuttle.engine.config import ModelConfig
from helpers import assert_generates_as_transformers, parity_prompts, write_tokenizer
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
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    return path, model


def test_ministral3_token_exact_within_its_unscaled_positions(ministral3):
    path, model = ministral3
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.unscaled_positions, cfg.rope_scaling["rope_type"]) == (ORIGINAL, "yarn")
    assert LLM(path, dtype="float32", num_kv_blocks=64).engine.max_model_len == ORIGINAL
    assert_generates_as_transformers(path, model, [p[:ORIGINAL - 16] for p in parity_prompts()[1:]])


def test_past_them_is_refused_by_name(ministral3):
    path, _ = ministral3
    with pytest.raises(ValueError, match=rf"max_model_len \(200\) exceeds {ORIGINAL}.*llama_4_scaling_beta"):
        LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=200)
