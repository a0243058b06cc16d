"""Mistral (MistralForCausalLM: Codestral, Devstral, Mistral-7B) and sliding windows.

The decoder is Llama's with an explicit head_dim; checked token-exact against transformers
(greedy, float32, chunked prefill, logprobs of every step and of the prompt) on a tiny random
checkpoint whose head_dim is not hidden / heads. A `sliding_window` W (Mistral-7B-v0.1's 4096,
Mixtral's, StarCoder2's, Qwen2's with use_sliding_window) is attended as the model defines it, a
query at p seeing p - W + 1 .. p, on the torch attention backend (the CPU default): the sequences
here run well past W, through chunked prefill, prefix-cache hits, decode steps (kernel graphs,
within W and past it) and the training forward, with transformers' own sliding
mask as the oracle. Qwen2's window covers the layers from max_window_layers on (or transformers'
`layer_types`). Where windows are not served (another backend, top-k sparse attention),
max_model_len is capped at W and a longer one refused naming both; documents (squid) past W are
windowed by position (tests/engine/test_squid_windows.py).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from helpers import assert_packed_forward_is_transformers, assert_scored_by_transformers, parity_prompts, tiny_mistral, write_tokenizer
from moe_families import randomize_

WINDOW = 20


def _mistral(path: str, window: int | None) -> torch.nn.Module:
    model = tiny_mistral(window)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral"))
    return path, _mistral(path, WINDOW)


def _long_prompts() -> list[list[int]]:
    """Prompts of 3 .. 110 tokens (most past the window, one not a multiple of anything)."""
    p = parity_prompts()
    return [p[1], p[5], p[6] + p[2], p[7] + p[4], (p[7] + p[6])[:110]]


def test_mistral_token_exact_vs_transformers_past_the_window(mistral):
    path, model = mistral
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.sliding_window, cfg.sliding_window_layers) == (
        "MistralForCausalLM", 24, 2, WINDOW, (0, 1, 2))
    llm = LLM(path, dtype="float32", num_kv_blocks=96, block_size=8, max_num_batched_tokens=24)
    # the window is attended: no cap at W, nor at the pool's 768 tokens (a sequence holds its window's blocks)
    assert llm.engine.max_model_len == 1024
    prompts = _long_prompts()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for _ in range(2):  # the second pass hits the prefix cache: chunks start on cached blocks
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, o in zip(prompts, outs):
            assert_scored_by_transformers(model, prompt, o, 1e-4)
    # short prompts decoding past W: their steps replay kernel graphs within W and past it (the
    # graphs keep their rows cut to the window), a batch of 2 crossing W at different steps too
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    for batch in ([parity_prompts()[0]], [parity_prompts()[0], parity_prompts()[2]]):
        before = graphs.counters["graph_steps"]
        outs = llm.generate(batch, params, use_tqdm=False)
        for prompt, o in zip(batch, outs):
            assert_scored_by_transformers(model, prompt, o, 1e-4)
        assert graphs.counters["graph_steps"] - before >= 27  # of 29 decode steps (a capture and its check run eagerly)
    # the window is real in the oracle: past it, transformers' outputs leave full attention's
    import transformers

    full = transformers.MistralForCausalLM(transformers.MistralConfig(**{**model.config.to_dict(), "sliding_window": None})).float().eval()
    full.load_state_dict(model.state_dict())
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        a, b = model(ids).logits[0], full(ids).logits[0]
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-5) and not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-3)


def test_mistral_training_path_windows_as_transformers(mistral):
    """`forward_packed` (the trainer's forward): documents packed in one row, each past the window."""
    path, model = mistral
    assert_packed_forward_is_transformers(path, model, [_long_prompts()[3], _long_prompts()[2]])


def test_where_windows_are_not_served_the_window_caps_max_model_len(mistral):
    """Top-k sparse attention takes its own backend, which attends every position: the engine
    serves the model within its window there, and a longer max_model_len is refused naming both."""
    path, _ = mistral
    sparse = "topk:budget=64,block=8,dense_layers=1"
    with pytest.raises(ValueError, match=rf"max_model_len \(128\) exceeds the model's sliding_window \({WINDOW}\)"):
        LLM(path, dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128, sparse_attention=sparse)
    assert LLM(path, dtype="float32", num_kv_blocks=64, block_size=8, sparse_attention=sparse).engine.max_model_len == WINDOW


def test_documents_past_the_window_are_served(mistral):
    """Documents are windowed by position on the torch backend (checked against one dense forward
    in tests/engine/test_squid_windows.py); here only that they are taken past W."""
    path, _ = mistral
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8)
    docs = [[7 + i % 200 for i in range(30)], [9 + i % 190 for i in range(25)]]
    out = llm.generate([{"prefix": [5, 6], "documents": docs, "prompt": [10, 11]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_qwen2_windows_from_max_window_layers_on(tmp_path):
    """Qwen2 with use_sliding_window: the layers from max_window_layers on window, the first ones
    attend every position (transformers' layer_types), token-exact past the window."""
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   use_sliding_window=True, sliding_window=16, max_window_layers=1, tie_word_embeddings=False,
                                   eos_token_id=1, bos_token_id=None)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    model = randomize_(transformers.Qwen2ForCausalLM(cfg).float().eval(), 0.15, seed=3)
    path = str(tmp_path)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    mc = ModelConfig.from_pretrained(path)
    assert (mc.sliding_window, mc.sliding_window_layers) == (16, (1, 2))
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=24)
    prompts = _long_prompts()[2:]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0),
                        use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        assert_scored_by_transformers(model, prompt, o, 1e-4)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    bad = {**hf, "layer_types": ["sliding_attention"]}
    with pytest.raises(ValueError, match="layer_types must list"):
        ModelConfig.from_hf(bad)


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
