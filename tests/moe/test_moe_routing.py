"""Routers and the torch expert path against transformers' own MoE blocks (transformers is the
oracle): the same random weights, float32, selected expert ids identical, outputs within 1e-5."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cuttle.moe import FusedMoE, RoutingConfig, SharedExpert, is_moe_layer, route
from cuttle.moe.routing import router_logits

transformers = pytest.importorskip("transformers")

H, I = 64, 32
TOKENS = 37


def _randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.15)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def _layer_from(block: nn.Module, config: Any) -> FusedMoE:
    layer = FusedMoE(H, I, RoutingConfig.from_hf(config.to_dict()), torch.float32)
    layer.gate_weight.data.copy_(block.gate.weight)
    layer.w13.data.copy_(block.experts.gate_up_proj)
    layer.w2.data.copy_(block.experts.down_proj)
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.data.copy_(block.gate.e_score_correction_bias)
    return layer


def _shared_from(mlp: nn.Module, gate: nn.Linear | None) -> SharedExpert:
    inter = mlp.gate_proj.weight.shape[0]
    shared = SharedExpert(H, inter, torch.float32, gated=gate is not None)
    shared.w13.data.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    shared.w2.data.copy_(mlp.down_proj.weight)
    if gate is not None:
        shared.gate_weight.data.copy_(gate.weight)
    return shared


def _check_router(block: nn.Module, layer: FusedMoE, x: torch.Tensor) -> None:
    _, ref_weights, ref_ids = block.gate(x)
    weights, ids = route(router_logits(x, layer.gate_weight, layer.routing), layer.routing,
                         layer.e_score_correction_bias)
    ref_ids, order_ref = ref_ids.sort(dim=-1)
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids), "selected experts differ from transformers"
    torch.testing.assert_close(weights.gather(1, order), ref_weights.float().gather(1, order_ref), rtol=1e-6, atol=1e-7)


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(1, TOKENS, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_transformers(norm_topk_prob: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=16, num_experts_per_tok=4,
                            norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(config)
    _randomize(block, 0)
    layer = _layer_from(block, config)
    assert layer.routing.norm_topk_prob is norm_topk_prob
    x = _inputs(1)
    _check_router(block, layer, x[0])
    torch.testing.assert_close(layer(x[0]), block(x)[0], rtol=1e-5, atol=1e-5)


def test_qwen2_moe_with_gated_shared_expert_matches_transformers() -> None:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=12, num_experts_per_tok=4,
                            shared_expert_intermediate_size=48)
    block = Qwen2MoeSparseMoeBlock(config)
    _randomize(block, 2)
    layer = _layer_from(block, config)
    assert layer.routing.norm_topk_prob is False  # the Qwen2-MoE default
    shared = _shared_from(block.shared_expert, block.shared_expert_gate)
    x = _inputs(3)
    _check_router(block, layer, x[0])
    torch.testing.assert_close(layer(x[0]) + shared(x[0]), block(x)[0], rtol=1e-5, atol=1e-5)


def test_deepseek_v3_grouped_biased_routing_matches_transformers() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=32, n_group=8, topk_group=3,
                              num_experts_per_tok=6, routed_scaling_factor=2.5, n_shared_experts=1)
    block = DeepseekV3MoE(config)
    _randomize(block, 4)
    layer = _layer_from(block, config)
    r = layer.routing
    assert (r.scoring_func, r.n_group, r.topk_group, r.routed_scaling_factor) == ("sigmoid", 8, 3, 2.5)
    shared = _shared_from(block.shared_experts, None)
    x = _inputs(5)
    _check_router(block, layer, x[0])
    torch.testing.assert_close(layer(x[0]) + shared(x[0]), block(x)[0], rtol=1e-5, atol=1e-5)


def test_deepseek_bias_picks_experts_but_does_not_weight_them() -> None:
    cfg = RoutingConfig(num_experts=8, top_k=2, scoring_func="sigmoid", n_group=1, topk_group=1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    bias = torch.zeros(8)
    bias[7] = 10.0  # the worst-scoring expert is chosen through the bias alone
    weights, ids = route(logits, cfg, bias)
    assert sorted(ids[0].tolist()) == [0, 7]
    s = torch.sigmoid(logits[0])
    expected = torch.stack([s[i] for i in ids[0].tolist()])
    torch.testing.assert_close(weights[0], expected / expected.sum())


def test_mixtral_matches_transformers() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    # norm_topk_prob False in the dict must not matter: Mixtral always renormalizes
    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=8, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(config).eval()
    _randomize(block, 6)
    hf = dict(config.to_dict(), norm_topk_prob=False)
    layer = FusedMoE(H, I, RoutingConfig.from_hf(hf), torch.float32)
    layer.load_state_dict({"gate_weight": block.gate.weight, "w13": block.experts.gate_up_proj,
                           "w2": block.experts.down_proj})
    x = _inputs(7)
    _check_router(block, layer, x[0])
    torch.testing.assert_close(layer(x[0]), block(x)[0], rtol=1e-5, atol=1e-5)


def test_from_hf_field_names_and_defaults() -> None:
    hub_qwen3 = {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True}
    assert RoutingConfig.from_hf(hub_qwen3) == RoutingConfig(128, 8, True)
    assert RoutingConfig.from_hf({"model_type": "qwen3_moe", "num_local_experts": 4, "num_experts_per_tok": 2}) \
        == RoutingConfig(4, 2, False)
    assert RoutingConfig.from_hf({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                                  "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}) \
        == RoutingConfig(256, 8, True, "sigmoid", 8, 4, 2.5)
    with pytest.raises(ValueError):
        RoutingConfig.from_hf({"num_experts_per_tok": 2})


def test_is_moe_layer() -> None:
    ds = {"model_type": "deepseek_v3", "first_k_dense_replace": 3}
    assert [is_moe_layer(ds, i) for i in range(5)] == [False, False, False, True, True]
    qwen = {"model_type": "qwen3_moe", "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [is_moe_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
