"""StarCoder2 (Starcoder2ForCausalLM): LayerNorm with biases, q/k/v/o biases, an ungated
c_fc -> gelu(tanh) -> c_proj MLP with biases, a tied lm_head, and a sliding window, attended past
it (tests/engine/test_mistral.py). Checked token-exact against transformers (greedy, float32,
chunked prefill, logprobs of every step and of the prompt, sequences past the window), its training path
(`forward_packed`), its HF names both ways, and MXFP8 linears (`quantization="mxfp8"`, the MLP's
projections among them) against the torch reference.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from cuttle.engine import LLM, SamplingParams
from cuttle.engine.config import ModelConfig
from cuttle.engine.models import load_model
from cuttle.engine.models.loader import hf_state_dict, iter_tensors
from cuttle.engine.models.transformer import GeluMLP
from helpers import assert_packed_forward_is_transformers, assert_scored_by_transformers, parity_prompts, write_tokenizer
from moe_families import randomize_

WINDOW = 24


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("starcoder2"))
    cfg = transformers.Starcoder2Config(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        sliding_window=WINDOW, norm_epsilon=1e-5, rope_theta=10000.0, eos_token_id=1,
                                        bos_token_id=None)
    model = randomize_(transformers.Starcoder2ForCausalLM(cfg).float().eval(), 0.15, seed=3)
    with torch.no_grad():  # LayerNorm weights away from 1 and biases away from 0, so each is seen
        for name, p in model.named_parameters():
            if "layernorm" in name or name.startswith("model.norm"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    write_tokenizer(path, 256)
    return path, model


def _prompts() -> list[list[int]]:
    return parity_prompts()[1:]  # 9 .. 70 tokens: most past the window


def test_starcoder2_token_exact_vs_transformers(starcoder2):
    path, model = starcoder2
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.layer_norm, cfg.gelu_mlp, cfg.proj_bias, cfg.attention_bias, cfg.tie_word_embeddings, cfg.sliding_window) == (
        True, True, True, True, True, WINDOW)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    assert llm.engine.max_model_len == 512  # max_position_embeddings: the window is attended, no cap
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0),
                        use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        assert_scored_by_transformers(model, prompt, o, 1e-4)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 12  # varied continuations, not one token repeated


def test_starcoder2_training_path_matches_transformers(starcoder2):
    path, model = starcoder2
    assert_packed_forward_is_transformers(path, model, [_prompts()[1], _prompts()[4]])  # the second past the window


def test_starcoder2_hf_names_both_ways(starcoder2, tmp_path):
    path, _ = starcoder2
    ours = load_model(path, ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    saved = dict(iter_tensors(path))
    names = hf_state_dict(ours)
    assert sorted(names) == sorted(saved) and "model.norm.bias" in names and "model.layers.0.mlp.c_fc.bias" in names
    for name, t in names.items():
        assert torch.equal(t, saved[name]), name
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    out = tmp_path / "again"
    out.mkdir()
    shutil.copy(os.path.join(path, "config.json"), out)
    save_file({k: v.contiguous() for k, v in hf_state_dict(ours).items()}, str(out / "model.safetensors"))
    again = dict(load_model(str(out), ModelConfig.from_pretrained(str(out)), torch.float32, torch.device("cpu")).named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(again[name], p), name


def test_starcoder2_mxfp8_linears_cover_its_mlp(starcoder2):
    """quantization='mxfp8' covers the ungated MLP's projections too (with their biases), and the
    engine's logprobs equal the model run through the torch MXFP8 reference."""
    from cuttle.engine.models.linear_quant import MXLinearWeight

    path, _ = starcoder2
    llm = LLM(path, dtype="float32", num_kv_blocks=64, quantization="mxfp8")
    model = llm.engine.runner.model
    mlps = [layer.mlp for layer in model.layers]
    assert all(isinstance(m, GeluMLP) and isinstance(m.fc_weight, MXLinearWeight) and isinstance(m.proj_weight, MXLinearWeight)
               for m in mlps)
    prompt = _prompts()[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    c = out.outputs[0]
    seq = prompt + list(c.token_ids)
    with torch.no_grad():
        ref = model.compute_logits(model.forward_packed(torch.tensor([seq]), torch.arange(len(seq))[None],
                                                        torch.zeros(1, len(seq), dtype=torch.long)))[0].log_softmax(-1)
    n = len(prompt)
    assert ref[n - 1:-1].argmax(-1).tolist() == list(c.token_ids)
    for step, tok in enumerate(c.token_ids):
        assert abs(c.logprobs[step][tok].logprob - ref[n - 1 + step, tok].item()) <= 1e-4


def test_starcoder2_lora_on_attention_and_refused_on_its_mlp(starcoder2, tmp_path):
    """An attention adapter (o_proj has a bias here: the delta adds to W x + b) serves as peft
    scores it; one on the MLP is refused by name, not dropped (there is no gate/up/down there)."""
    peft = pytest.importorskip("peft")
    from cuttle.engine.lora import LoRARequest

    path, model = starcoder2
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False))
    ad = str(tmp_path / "attn")
    lora.save_pretrained(ad)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    prompt = _prompts()[2]
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False,
                     lora_request=LoRARequest("attn", 1, ad))[0].outputs[0]
    with torch.no_grad():
        want = lora(torch.tensor([prompt + list(c.token_ids)])).logits[0].float().log_softmax(-1)
    n = len(prompt)
    assert want[n - 1:-1].argmax(-1).tolist() == list(c.token_ids)
    for step, tok in enumerate(c.token_ids):
        assert abs(c.logprobs[step][tok].logprob - want[n - 1 + step, tok].item()) <= 1e-4
    lora.unload()
    import transformers

    base = transformers.Starcoder2ForCausalLM.from_pretrained(path).float()
    mlp = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_fc"], init_lora_weights=False))
    md = str(tmp_path / "mlp")
    mlp.save_pretrained(md)
    with pytest.raises(ValueError, match="c_fc"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=LoRARequest("mlp", 2, md))

