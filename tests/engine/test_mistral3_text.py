"""Mistral Small 3.1 / 3.2 (and Magistral / Devstral checkpoints) published as
`Mistral3ForConditionalGeneration`: cuttle serves the text model alone. Its config's `text_config`
becomes the causal LM's, its decoder's tensors are read under both namings (transformers 5's
`model.language_model.*`, and the older `language_model.model.*` the HF repos hold), the vision
encoder's and projector's are dropped, and the processor's `chat_template.json` is the chat
template. Checked token-exact against transformers' own Mistral3ForConditionalGeneration on text
input (greedy, float32, chunked prefill, every logprob)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuttle.engine import LLM
from cuttle.engine.config import ModelConfig
from cuttle.engine.tokenizer import Tokenizer
from helpers import assert_generates_as_transformers, parity_prompts, write_tokenizer
from moe_families import randomize_


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("mistral3"))
    text = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, eos_token_id=1, bos_token_id=None)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                              image_size=32, patch_size=8, head_dim=16)
    cfg = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=10)
    model = randomize_(transformers.Mistral3ForConditionalGeneration(cfg).float().eval(), 0.15, seed=2)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    with open(os.path.join(path, "tokenizer_config.json")) as f:  # the template in the processor's file only
        tc = json.load(f)
    tc.pop("chat_template", None)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    with open(os.path.join(path, "chat_template.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"}, f)
    return path, model


def test_text_model_token_exact_vs_transformers(mistral3):
    path, model = mistral3
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.hidden_size, cfg.head_dim) == ("MistralForCausalLM", 64, 16)
    assert_generates_as_transformers(path, model, parity_prompts()[1:])
    assert Tokenizer(path).chat_template.startswith("{% for m in messages %}[INST]")


def test_the_older_naming_loads_too(mistral3, tmp_path):
    """`language_model.model.*` / `language_model.lm_head.*` / `vision_tower.*` (the HF repos' own
    naming): the same text model."""
    path, model = mistral3
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(path, name), tmp_path / name)
    old = {}
    for f in (n for n in os.listdir(path) if n.endswith(".safetensors")):
        for k, t in load_file(os.path.join(path, f)).items():
            k = k.replace("model.language_model.", "language_model.model.").replace("model.vision_tower.", "vision_tower.")
            old[k.replace("lm_head.", "language_model.lm_head.") if k.startswith("lm_head.") else k] = t
    assert any(k.startswith("language_model.model.layers.") for k in old) and any(k.startswith("vision_tower.") for k in old)
    save_file(old, str(tmp_path / "model.safetensors"))
    ours = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16).engine.runner.model
    assert torch.equal(ours.layers[1].mlp.down_weight, model.model.language_model.layers[1].mlp.down_proj.weight)
    assert torch.equal(ours.embed, model.model.language_model.embed_tokens.weight)


def test_a_text_model_cuttle_does_not_serve_is_named(mistral3):
    path, _ = mistral3
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["text_config"]["model_type"] = "gemma3_text"
    with pytest.raises(ValueError, match="its text model is 'gemma3_text'"):
        ModelConfig.from_hf(hf)
