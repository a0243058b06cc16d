"""DeepSeek-V2 (DeepseekV2ForCausalLM: DeepSeek-Coder-V2, V2-Lite, V2.5): DeepSeek-V3's layout
(multi-head latent attention, shared experts, dense layers first) with softmax routing on fp32
logits, no renormalization, x routed_scaling_factor, "greedy" or "group_limited_greedy" (the
topk_group groups of highest max score). Checked token-exact against transformers in both
routings (greedy, float32, chunked prefill, logprobs of every step and of the prompt) and the
training path (the native router takes the grouped / scaled softmax itself:
tests/moe/test_moe_native.py), and an unknown topk_method is refused by name."""
from __future__ import annotations

import pytest
import torch

from cuttle.engine.config import ModelConfig
from cuttle.moe.routing import RoutingConfig, route
from helpers import assert_generates_as_transformers, assert_packed_forward_is_transformers, parity_prompts, save_checkpoint
from moe_families import randomize_

VARIANTS = {
    # V2-Lite / Coder-V2-Lite: no q compression, greedy top-k, scale 1
    "lite_greedy": dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0, n_group=1, topk_group=1),
    # V2 / V2.5: q compression, group_limited_greedy over 4 groups keeping 2, scaled weights
    "grouped_scaled": dict(q_lora_rank=24, topk_method="group_limited_greedy", routed_scaling_factor=2.5, n_group=4, topk_group=2),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def deepseek_v2(request, tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp(request.param))
    cfg = transformers.DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=0, **VARIANTS[request.param])
    model = randomize_(transformers.DeepseekV2ForCausalLM(cfg).float().eval(), 0.15, seed=11)
    return save_checkpoint(path, model)


def test_deepseek_v2_token_exact_vs_transformers(deepseek_v2):
    path, model = deepseek_v2
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.mla is not None and cfg.moe_layers == [1, 2] and cfg.shared_expert_intermediate_size == 32
    assert_generates_as_transformers(path, model, parity_prompts()[1:])


def test_deepseek_v2_training_path_matches_transformers(deepseek_v2):
    path, model = deepseek_v2
    assert_packed_forward_is_transformers(path, model, [parity_prompts()[4], parity_prompts()[7]])


def test_deepseek_v2_routing_rules():
    """The grouped rule against a direct reading of transformers' router, on random logits; an
    unknown topk_method is refused."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g)
    cfg = RoutingConfig.from_hf({"model_type": "deepseek_v2", "n_routed_experts": 8, "num_experts_per_tok": 3,
                                 "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5})
    weights, ids = route(logits, cfg)
    scores = logits.softmax(-1)
    groups = scores.view(64, 4, 2).max(-1).values.topk(2, dim=-1).indices
    allowed = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(2, dim=1)
    want_w, want_ids = scores.masked_fill(~allowed, 0.0).topk(3, dim=-1)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w * 2.5)
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported for deepseek_v2"):
        RoutingConfig.from_hf({"model_type": "deepseek_v2", "n_routed_experts": 8, "num_experts_per_tok": 3, "topk_method": "noaux_tc"})

