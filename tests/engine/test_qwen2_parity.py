"""Qwen2 / Qwen2.5(-Coder) dense: q/k/v biases, no q/k norm, tied or untied embeddings, checked
token-exact against transformers (greedy, float32, chunked prefill over the paged cache) on tiny
random checkpoints; sliding-window configs window the layers their config names."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from helpers import assert_scored_by_transformers, write_tokenizer

TOL = 1e-4


def _qwen2(path: str, tied: bool):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, tie_word_embeddings=tied, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(13)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)  # large enough that dropping a bias changes the tokens
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_token_exact_vs_transformers(tmp_path, tied):
    model = _qwen2(str(tmp_path), tied)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and not cfg.qk_norm
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 40, 70)]
    llm = LLM(str(tmp_path), dtype="float32", attention_backend="torch", num_kv_blocks=64, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        assert_scored_by_transformers(model, prompt, o, TOL)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 5  # varied continuations, not one token


def test_qwen2_sliding_window_layers_follow_the_config(tmp_path):
    """use_sliding_window: the window applies to the layers transformers' config names
    (`layer_types` where given, else those from max_window_layers on), attended past W (no cap;
    tests/engine/test_mistral.py checks the outputs); without the switch the window field is
    inert, as in transformers."""
    _qwen2(str(tmp_path), tied=False)
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 32

    def config(**over):
        with open(os.path.join(tmp_path, "config.json"), "w") as f:
            json.dump({k: v for k, v in {**cfg, **over}.items() if v is not None}, f)
        return ModelConfig.from_pretrained(str(tmp_path))

    assert config().sliding_window is None
    n = cfg["num_hidden_layers"]
    got = config(use_sliding_window=True, layer_types=None, max_window_layers=1)
    assert (got.sliding_window, got.sliding_window_layers) == (32, tuple(range(1, n)))
    got = config(use_sliding_window=True, layer_types=["full_attention"] * n)  # as saved by a config made without the switch
    assert got.sliding_window_layers == ()
    config(use_sliding_window=True, layer_types=None, max_window_layers=0)
    assert LLM(str(tmp_path), dtype="float32", num_kv_blocks=64).engine.max_model_len == cfg["max_position_embeddings"] > 32
