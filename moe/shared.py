"""Shared experts: the dense SwiGLU MLP every token passes through beside the routed experts.

Owns the helper models use for Qwen2-MoE's `shared_expert` (scaled by sigmoid(shared_expert_gate(x)))
and DeepSeek-V3's `shared_experts` (ungated, width moe_intermediate_size * n_shared_experts).
The model decides whether a layer has one and adds it to the routed output; this module never
routes and never imports from `cuttle.engine`. Its projections take the CPU kernel library's
`linear` / `silu_mul` (the dense MLP's kernels; torch where those do not apply, autograd included).

Parameters: w13 [2*I, H] (gate_proj rows, then up_proj rows), w2 [H, I], gate_weight [1, H] if gated.
"""
from __future__ import annotations

import torch
from torch import nn

from cuttle.attention.native.fused import scale, sigmoid, silu_mul
from cuttle.attention.native.gemm import linear


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, gated: bool) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(hidden_size, intermediate_size, dtype=dtype), requires_grad=False)
        self.gate_weight: nn.Parameter | None = None
        if gated:
            self.gate_weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(silu_mul(linear(x, self.w13)), self.w2)
        if self.gate_weight is not None:
            # fused: one formula per element (batch-invariant), the product one native call (kernel graphs)
            y = scale(y, sigmoid(linear(x, self.gate_weight)))
        return y
