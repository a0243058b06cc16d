"""`hf_state_dict` (engine/models/loader.py): the engine's parameters under HF names, derived from
the loader's own name map, which the default model's recipe saves with. Per family, a checkpoint
transformers saved comes back under exactly its names with equal tensors, and an engine model
saved with it loads back into identical parameters; the shipped default model is reproduced
bit for bit by the recipe's `to_hf_state_dict`."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuttle.engine.config import ModelConfig
from cuttle.engine.default_model import DEFAULT_MODEL_DIR
from cuttle.engine.models import load_model
from cuttle.engine.models.loader import hf_state_dict, iter_tensors
from cuttle.engine.train_default_model import to_hf_state_dict
from helpers import make_checkpoint, write_tokenizer

_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, tie_word_embeddings=False)


def _moe_family(family: str, path: str) -> None:
    """Tiny transformers checkpoints of the MoE families beyond helpers.make_checkpoint's."""
    import transformers

    if family == "qwen2_moe":  # shared expert + its gate, qkv bias, one dense layer
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[1], **_COMMON))
    elif family == "mixtral":  # block_sparse_moe, experts w1/w3/w2
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, **_COMMON))
    elif family == "glm4_moe":  # GLM-4.5: qkv bias, q/k norms, shared_experts, a dense first layer
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
            num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, **_COMMON))
    elif family == "minimax_m2":  # block_sparse_moe with w1/w3/w2 and the routing bias beside the gate, whole-row q/k norms
        model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(
            num_key_value_heads=2, head_dim=8, rotary_dim=4, num_local_experts=4, num_experts_per_tok=2, **_COMMON))
    else:  # DeepSeek-V3: MLA with q through the LoRA bottleneck or full-rank, shared experts, a dense first layer
        full_q = family == "deepseek_v3_full_q"
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None if full_q else 12,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, attention_bias=full_q, **_COMMON))
    model.save_pretrained(path)
    write_tokenizer(path, 128)


FAMILIES = ["qwen3", "qwen3_tied", "qwen3_moe", "llama", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v3_full_q", "glm4_moe", "minimax_m2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(family))
        if family in ("qwen3", "qwen3_moe", "llama"):
            make_checkpoint(path, family)
        elif family == "qwen3_tied":
            make_checkpoint(path, "qwen3", tie_word_embeddings=True)
        else:
            _moe_family(family, path)
        out[family] = path
    return out


def _load(path: str, dtype: torch.dtype = torch.float32, **kw):
    return load_model(path, ModelConfig.from_pretrained(path), dtype, torch.device("cpu"), **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_comes_back_under_its_own_names(checkpoints, family: str) -> None:
    path = checkpoints[family]
    saved = dict(iter_tensors(path))
    ours = hf_state_dict(_load(path))
    assert sorted(ours) == sorted(saved)
    for name, t in ours.items():
        assert torch.equal(t, saved[name]), name
    if family == "qwen3_tied":
        assert "lm_head.weight" not in ours


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_gives_identical_parameters(checkpoints, family: str, tmp_path) -> None:
    """Fresh random values in every parameter (so nothing comes from the original file), saved
    under `hf_state_dict`'s names, load back into the same parameters exactly."""
    model = _load(checkpoints[family])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    out = str(tmp_path / "saved")
    os.makedirs(out)
    shutil.copy(os.path.join(checkpoints[family], "config.json"), out)
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, os.path.join(out, "model.safetensors"))
    again = dict(_load(out).named_parameters(remove_duplicate=False))
    mine = dict(model.named_parameters(remove_duplicate=False))
    assert sorted(again) == sorted(mine)
    for name, p in mine.items():
        assert torch.equal(again[name], p), name


def test_recipe_reproduces_the_shipped_default_model() -> None:
    """The recipe's save names and bf16 values: the shipped file, exactly (names from the loader's map)."""
    with open(os.path.join(DEFAULT_MODEL_DIR, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]
    shipped = load_file(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"))
    ours = to_hf_state_dict(_load(DEFAULT_MODEL_DIR, torch.bfloat16))
    assert sorted(ours) == sorted(shipped)
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, shipped[name]), name


def test_mxfp8_experts_are_refused(checkpoints) -> None:
    with pytest.raises(ValueError, match="MXFP8"):
        hf_state_dict(_load(checkpoints["qwen3_moe"], moe_quant="mxfp8"))
