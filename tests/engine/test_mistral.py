"""Mistral (MistralForCausalLM: Codestral, Devstral, Mistral-7B) and sliding windows.

The decoder is Llama's with an explicit head_dim; checked token-exact against transformers
(greedy, float32, chunked prefill, logprobs of every step and of the prompt) on a tiny random
checkpoint whose head_dim is not hidden / heads. A `sliding_window` W (Mistral-7B-v0.1's 4096,
Mixtral configs') is served within the window: cuttle attends every position, which equals the
window while a sequence fits in it, so max_model_len defaults to W and a longer one is refused,
naming both; transformers' own sliding-window mask is the oracle for the prompts that fill it.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from helpers import assert_scored_by_transformers, parity_prompts, write_tokenizer
from moe_families import randomize_

WINDOW = 80


def _mistral(path: str, window: int | None) -> torch.nn.Module:
    import transformers

    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24, max_position_embeddings=1024, rms_norm_eps=1e-6,
                                     rope_theta=10000.0, sliding_window=window, tie_word_embeddings=False, eos_token_id=1,
                                     bos_token_id=None)
    model = randomize_(transformers.MistralForCausalLM(cfg).float().eval(), 0.15, seed=7)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral"))
    return path, _mistral(path, WINDOW)


def test_mistral_token_exact_vs_transformers(mistral):
    path, model = mistral
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.sliding_window) == ("MistralForCausalLM", 24, 2, WINDOW)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    assert llm.engine.max_model_len == WINDOW  # served within the window by default
    prompts = [p[:WINDOW - 12] for p in parity_prompts()[2:]]  # up to 68 tokens: the sequences fill the window
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0),
                        use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        assert_scored_by_transformers(model, prompt, o, 1e-4)
    assert max(len(p) + 12 for p in prompts) == WINDOW
    # the window is real in the oracle: past it, transformers' outputs leave full attention's
    import transformers

    full = transformers.MistralForCausalLM(transformers.MistralConfig(**{**model.config.to_dict(), "sliding_window": None})).float().eval()
    full.load_state_dict(model.state_dict())
    ids = torch.tensor([(parity_prompts()[7] * 2)[:WINDOW + 8]])
    with torch.no_grad():
        a, b = model(ids).logits[0], full(ids).logits[0]
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-5) and not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-3)


def test_past_the_window_is_refused_by_name(mistral):
    path, _ = mistral
    with pytest.raises(ValueError, match=rf"max_model_len \(128\) exceeds the model's sliding_window \({WINDOW}\)"):
        LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=48)
    assert llm.engine.max_model_len == 48
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * (WINDOW - 4)], SamplingParams(max_tokens=8), use_tqdm=False)


def test_no_window_and_bad_windows(tmp_path):
    path = str(tmp_path / "full")
    _mistral(path, None)
    assert ModelConfig.from_pretrained(path).sliding_window is None
    assert LLM(path, dtype="float32", num_kv_blocks=128, block_size=16).engine.max_model_len == 1024
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    for bad in (1, "4096", 4096.5, True):
        with pytest.raises(ValueError, match="sliding_window must be null or an integer >= 2"):
            ModelConfig.from_hf({**hf, "sliding_window": bad})
