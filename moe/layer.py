"""The MoE layer the engine's models call: router + routed experts, tokens in, tokens out.

Owns the routed-expert weights (stacked per expert) and the router weight. Shared experts and
dense MLPs belong to the model, not here. Must never import from `cuttle.engine`.

Parameter layout (the engine's loader fills these from HF per-expert tensors):
  gate_weight [E, H]          router logits = x @ gate_weight.T
  w13         [E, 2*I, H]     gate_proj rows first, then up_proj rows
  w2          [E, H, I]       down_proj
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class RoutingConfig:
    """How token scores pick experts; built from the HF config fields."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool = True

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "RoutingConfig":
        num_experts = config.get("num_experts", config.get("n_routed_experts", config.get("num_local_experts")))
        if num_experts is None:
            raise ValueError("MoE config has no num_experts / n_routed_experts / num_local_experts")
        return cls(
            num_experts=int(num_experts),
            top_k=int(config["num_experts_per_tok"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        )


def route(router_logits: torch.Tensor, cfg: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: softmax in fp32 -> top-k -> renormalize. Returns (weights [T,k], ids [T,k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_forward_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Plain torch expert path: per active expert, gather its tokens, run SwiGLU, scatter-add."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        gate_up = x[tok] @ w13[e].t()
        gate, up = gate_up.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, routing: RoutingConfig, dtype: torch.dtype):
        super().__init__()
        E = routing.num_experts
        self.routing = routing
        self.gate_weight = nn.Parameter(torch.empty(E, hidden_size, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = x @ self.gate_weight.t()
        weights, ids = route(router_logits, self.routing)
        return experts_forward_torch(x, self.w13, self.w2, weights.to(x.dtype), ids)
