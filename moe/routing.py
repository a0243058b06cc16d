"""Routers: token scores -> (expert ids, combine weights), configured from HF config fields.

Owns the routing math of each supported family and the HF field names and per-family defaults
(the defaults of the transformers config classes, so a config.json that omits a field routes the
way transformers would). Must never touch expert weights or import from `cuttle.engine`.

  qwen3_moe, qwen2_moe, olmoe   softmax(fp32) -> top-k -> renormalize if norm_topk_prob (default False)
  mixtral                       softmax(fp32) -> top-k -> always renormalize
  minimax_m2                    sigmoid(fp32 logits), the bias only picks experts, top-k, renormalized
                                (DeepSeek-V3's rule with one group and no scaling); every layer
  deepseek_v2                   softmax(fp32 logits) -> top-k ("greedy"), or within the topk_group groups
                                of highest max score ("group_limited_greedy"); no renormalization,
                                x routed_scaling_factor; layers from first_k_dense_replace (default 0) on
  deepseek_v3, glm4_moe         sigmoid(fp32 logits); e_score_correction_bias only picks experts;
                                keep topk_group of n_group groups scored by their top-2 sum; weights
                                are the unbiased scores, renormalized (+1e-20), x routed_scaling_factor;
                                layers from first_k_dense_replace on (default 3 for DeepSeek-V3
                                configs, 1 for GLM-4.5's, as the config classes say)
  gpt_oss                       logits with the router's bias -> softmax over the top-k logits, which is
                                softmax(fp32) -> top-k -> renormalize (Mixtral's rule); every layer
  anything else                 softmax -> top-k -> renormalize unless norm_topk_prob is false
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from cuttle.attention.native.fused import sigmoid
from cuttle.attention.native.gemm import linear
from cuttle.attention.native.rows import to_float

ScoringFunc = Literal["softmax", "sigmoid"]
# model types routed as DeepSeek-V3 -> their config class's default first_k_dense_replace
_DEEPSEEK_ROUTED = {"deepseek_v3": 3, "glm4_moe": 1}
# model types whose dense layers come first, up to first_k_dense_replace -> its config class's default
_FIRST_DENSE = {**_DEEPSEEK_ROUTED, "deepseek_v2": 0}


@dataclass(slots=True)
class RoutingConfig:
    """How token scores pick experts; built from the HF config fields by `from_hf`."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    scoring_func: ScoringFunc = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    fp32_logits: bool = False  # a softmax router whose logits are fp32 whatever the activations (DeepSeek-V2)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "RoutingConfig":
        num_experts = config.get("num_experts", config.get("n_routed_experts", config.get("num_local_experts")))
        if num_experts is None:
            raise ValueError("MoE config has no num_experts / n_routed_experts / num_local_experts")
        model_type = config.get("model_type")
        top_k = int(config["num_experts_per_tok"])
        if model_type in _DEEPSEEK_ROUTED:  # GLM-4.5's router is transformers' DeepseekV3TopkRouter
            return cls(
                num_experts=int(num_experts),
                top_k=top_k,
                norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                scoring_func="sigmoid",  # transformers hardcodes noaux_tc sigmoid routing
                n_group=int(config.get("n_group") or 1),
                topk_group=int(config.get("topk_group") or 1),
                routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            )
        if model_type == "deepseek_v2":  # transformers' DeepseekV2TopkRouter
            method = config.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"topk_method {method!r} is not supported for deepseek_v2 (supported: greedy, group_limited_greedy)")
            grouped = method == "group_limited_greedy"
            return cls(num_experts=int(num_experts), top_k=top_k, norm_topk_prob=False, fp32_logits=True,
                       n_group=int(config.get("n_group") or 1) if grouped else 1,
                       topk_group=int(config.get("topk_group") or 1) if grouped else 1,
                       routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
        if model_type in ("mixtral", "gpt_oss"):
            return cls(num_experts=int(num_experts), top_k=top_k, norm_topk_prob=True)
        if model_type == "minimax_m2":  # transformers' MiniMaxM2TopKRouter: sigmoid, the bias picks, renormalized
            return cls(num_experts=int(num_experts), top_k=top_k, norm_topk_prob=True, scoring_func="sigmoid")
        # transformers' Qwen2-MoE / Qwen3-MoE / OLMoE config classes default norm_topk_prob to False
        default_norm = model_type not in ("qwen3_moe", "qwen2_moe", "olmoe")
        return cls(
            num_experts=int(num_experts),
            top_k=top_k,
            norm_topk_prob=bool(config.get("norm_topk_prob", default_norm)),
        )


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ gate_weight.T (+ bias: gpt-oss's router); sigmoid routers take it in fp32 (as DeepSeek-V3 does), softmax ones in x's dtype.
    Through the native linear kernels where they apply (a bf16 gate at decode is otherwise torch's
    bf16 GEMM, ~5% of a Qwen3-MoE decode step on an AVX2 CPU); fp32 sums either way."""
    if cfg.scoring_func == "sigmoid" or cfg.fp32_logits:
        # a bf16 gate widens exactly to fp32: the native bf16-weight GEMM on fp32 x is the fp32 product
        return linear(to_float(x), gate_weight if gate_weight.dtype == torch.bfloat16 else gate_weight.float(),
                      None if bias is None else bias.float())
    return linear(x, gate_weight, bias)


def route(
    logits: torch.Tensor, cfg: RoutingConfig, e_score_correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights float32 [T, k], expert ids int64 [T, k])."""
    if cfg.scoring_func == "sigmoid":
        return _grouped_sigmoid_topk(logits.float(), cfg, e_score_correction_bias)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if cfg.n_group > 1:  # DeepSeek-V2's group_limited_greedy: experts of the topk_group groups with the highest max
        T, E = probs.shape
        group_scores = probs.view(T, cfg.n_group, E // cfg.n_group).max(dim=-1).values
        keep = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        probs = probs.masked_fill(~group_mask.repeat_interleave(E // cfg.n_group, dim=1), 0.0)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights if cfg.routed_scaling_factor == 1.0 else weights * cfg.routed_scaling_factor, ids


def _grouped_sigmoid_topk(
    logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # one scalar formula per element (torch's sigmoid takes its vector exp for most elements and the
    # scalar one for the tail, so a row's scores followed how many rows were routed with it)
    scores = sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    if cfg.n_group > 1:
        T, E = choice.shape
        group_scores = choice.view(T, cfg.n_group, E // cfg.n_group).topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(E // cfg.n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def is_moe_layer(config: dict[str, Any], layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has routed experts (else it has a dense MLP), per HF fields."""
    model_type = config.get("model_type")
    if model_type in _FIRST_DENSE:
        return layer_idx >= int(config.get("first_k_dense_replace", _FIRST_DENSE[model_type]))
    if layer_idx in (config.get("mlp_only_layers") or []):
        return False
    return (layer_idx + 1) % int(config.get("decoder_sparse_step", 1)) == 0
