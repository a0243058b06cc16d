"""CWM (CwmForCausalLM, Meta's Code World Model: a coding model trained with agentic RL): Llama's
decoder with llama3 rope scaling and a sliding window on three layers of four (`layer_types`).
Checked token-exact against transformers past the window (greedy, float32, chunked prefill,
logprobs of every step and of the prompt) and its training path."""
from __future__ import annotations

import pytest

from cuttle.engine.config import ModelConfig
from helpers import (assert_generates_as_transformers, assert_packed_forward_is_transformers,
                     parity_prompts, save_checkpoint)
from moe_families import randomize_


@pytest.fixture(scope="module")
def cwm(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("cwm"))
    cfg = transformers.CwmConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=20,
                                 eos_token_id=1, bos_token_id=2, pad_token_id=0)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    model = randomize_(transformers.CwmForCausalLM(cfg).float().eval(), 0.15, seed=8)
    return save_checkpoint(path, model)


def test_cwm_token_exact_vs_transformers_past_the_window(cwm):
    path, model = cwm
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.sliding_window, cfg.sliding_window_layers, cfg.rope_scaling["rope_type"]) == (20, (1, 2, 3), "llama3")
    assert_generates_as_transformers(path, model, parity_prompts()[1:])


def test_cwm_training_path_matches_transformers(cwm):
    path, model = cwm
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])
