"""Torch expert path: grouped SwiGLU experts over expert-sorted tokens, the reference and the CPU path.

Owns the expert computation for plain (bf16/fp32) and MXFP8 expert weights:
  gate_up = x @ w13[e].T; h = silu(gate) * up; y = h @ w2[e].T; out[t] = sum_j weight[t, j] * y[t, j]
and gpt-oss's variant (`ClampedSwiGLU`, per-expert biases b13 [E, 2I] after the first GEMM and
b2 [E, H] after the second).
Speed on CPU comes from sorting once (one host sync for the expert offsets), gathering the token
rows once, and doing only two matmuls per *active* expert on contiguous slices; MXFP8 weights are
dequantized one active expert at a time, so the bf16 copy never exists for the whole layer.
Must never import Triton or `cuttle.engine`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cuttle.moe.align import align_tokens
from cuttle.moe.mxfp8 import MXTensor, ScaleMode, quantize_mxfp8, dequantize_mxfp8

ExpertWeight = torch.Tensor | MXTensor


def expert_matrix(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's [N, K] weight in `dtype` (dequantized when MXFP8)."""
    if isinstance(w, MXTensor):
        return w[e].dequantize(dtype)
    return w[e]


def fake_quantize(x: torch.Tensor, scale_mode: ScaleMode) -> torch.Tensor:
    """MXFP8 round trip along the last dim: what a kernel with MXFP8 activations computes on."""
    data, scales = quantize_mxfp8(x, 32, scale_mode)
    return dequantize_mxfp8(data, scales, 32, x.dtype)


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' GptOssExperts): the gate clamped from above and
    the up projection on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def fused_experts_torch(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_quant: ScaleMode | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H] in x's dtype.

    `act_quant` set: activations entering each GEMM are MXFP8-rounded with that scale rule first.
    `b13` [E, 2I] / `b2` [E, H]: per-expert biases; `activation`: gpt-oss's instead of silu(gate) * up.
    """
    T, H = x.shape
    k = ids.shape[1]
    num_experts = w13.shape[0]
    aligned = align_tokens(ids, num_experts, block_size=1)
    offsets = aligned.expert_offsets.tolist()
    order = aligned.sorted_ids[: T * k].long()  # block_size 1: no padding
    if act_quant is not None:
        x = fake_quantize(x, act_quant)
    xs = x[order // k]
    # Under autograd (training, RL scoring) outputs are concatenated instead of written in place.
    grad = torch.is_grad_enabled() and (x.requires_grad or any(isinstance(w, torch.Tensor) and w.requires_grad for w in (w13, w2)))
    ys = None if grad else torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    parts: list[torch.Tensor] = []
    for e in range(num_experts):
        start, end = offsets[e], offsets[e + 1]
        if start == end:
            continue
        gate_up = xs[start:end] @ expert_matrix(w13, e, x.dtype).t()
        if b13 is not None:
            gate_up = gate_up + b13[e]
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up if activation is None else activation(gate, up)
        if act_quant is not None:
            h = fake_quantize(h, act_quant)
        if grad or b2 is not None:
            y_e = h @ expert_matrix(w2, e, x.dtype).t()
            y_e = y_e if b2 is None else y_e + b2[e]
            if grad:
                parts.append(y_e)
            else:
                ys[start:end] = y_e
        else:
            torch.matmul(h, expert_matrix(w2, e, x.dtype).t(), out=ys[start:end])
    if grad:
        ys = torch.cat(parts) if parts else x.new_zeros(0, H)
    y = torch.empty_like(ys) if not grad else torch.zeros_like(ys).index_copy(0, order, ys)
    if not grad:
        y[order] = ys
    out = (y.view(T, k, H).float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype)
