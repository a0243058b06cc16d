"""Tiny random transformers models of the MoE families cuttle loads (Qwen2-MoE with its shared
expert, Mixtral, DeepSeek-V3 with MLA in two variants, GLM-4.5 with and without q/k norms, MiniMax-M2),
for the engine tests."""
from __future__ import annotations

import torch

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1,
               bos_token_id=None)


def randomize_(model, scale: float, seed: int):
    """Random weights (matrices N(0, scale), biases N(0, 0.1)); DeepSeek's expert-choice bias too."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, scale)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)  # large enough to change which experts are picked
    return model


def family_model(family: str):
    """A tiny random transformers model of `family`, weights scaled so greedy outputs vary."""
    import transformers

    if family == "qwen2_moe":  # shared expert behind a sigmoid gate, qkv bias, one dense layer
        cfg = transformers.Qwen2MoeConfig(num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                          num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], **_COMMON)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, **_COMMON)
        cls = transformers.MixtralForCausalLM
    elif family == "deepseek_v3":  # q through the LoRA bottleneck, interleaved rope, V narrower than K
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, **_COMMON)
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "deepseek_v3_full_q":  # full-rank q_proj, plain rope, biases, V wider than K, no renorm
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=False,
            kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=32,
            rope_interleave=False, attention_bias=True, **_COMMON)
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "glm4_moe":  # GLM-4.5: half the head rotated, qkv bias, q/k norms, DeepSeek routing over groups
        cfg = transformers.Glm4MoeConfig(
            num_key_value_heads=2, head_dim=24, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            attention_bias=True, use_qk_norm=True, rope_theta=10000.0, **_COMMON)
        cls = transformers.Glm4MoeForCausalLM
    elif family == "glm4_moe_air":  # GLM-4.5-Air's switches: no q/k norm, one group, a quarter rotated, 2 shared
        cfg = transformers.Glm4MoeConfig(
            num_key_value_heads=4, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
            num_experts_per_tok=3, first_k_dense_replace=2, routed_scaling_factor=1.0, attention_bias=True,
            use_qk_norm=False, partial_rotary_factor=0.25, **_COMMON)
        cls = transformers.Glm4MoeForCausalLM
    elif family == "minimax_m2":  # q/k RMSNormed over all heads at once, a quarter rotated, sigmoid routing with a bias
        cfg = transformers.MiniMaxM2Config(num_key_value_heads=2, head_dim=16, rotary_dim=4, num_local_experts=8,
                                           num_experts_per_tok=2, **{**_COMMON, "intermediate_size": 32})
        cls = transformers.MiniMaxM2ForCausalLM
    else:
        raise ValueError(family)
    return randomize_(cls(cfg).float().eval(), 0.15, seed=11)
