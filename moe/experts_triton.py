"""Triton expert path: align -> grouped GEMM (gate+up) -> SiLU-and-mul -> grouped GEMM (down, x weight) -> sum.

Owns the orchestration of the Triton kernels for one MoE layer and the choice of block sizes; the
math is `cuttle.moe.experts_torch.fused_experts_torch`, which is its reference. Runs on CUDA, or in
the Triton interpreter on CPU. Never imports `cuttle.engine`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cuttle.moe.align import AlignedTokens, align_tokens
from cuttle.moe.align_triton import align_tokens_triton
from cuttle.moe.experts_torch import ExpertWeight
from cuttle.moe.grouped_gemm_triton import GemmConfig, moe_gemm
from cuttle.moe.mxfp8 import MXTensor, ScaleMode
from cuttle.moe.mxfp8_triton import quantize_mxfp8_triton


def default_config(num_assignments: int, num_experts: int) -> GemmConfig:
    """Small M blocks when each expert sees few tokens (decode), so padding does not dominate."""
    per_expert = num_assignments / num_experts
    if per_expert <= 16:
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return GemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


ALIGNS = ("torch", "triton")


def align_for(ids: torch.Tensor, num_experts: int, block_size: int, align: str = "torch") -> AlignedTokens:
    """The alignment the expert path uses; both give the same tensors. "torch" (the default: the
    torch ops, measured on an H200) or "triton" (`align_tokens_triton`, one launch: tested in the
    Triton interpreter, not yet compiled or timed on a GPU, so opt-in until a GPU run
    (tests/gpu/run_checks.sh moe) checks it and times it beside the torch version)."""
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    if align == "triton":
        return align_tokens_triton(ids, num_experts, block_size)
    return align_tokens(ids, num_experts, block_size)


def _activation(x: torch.Tensor, act_quant: ScaleMode | None) -> torch.Tensor | MXTensor:
    if act_quant is None:
        return x
    return MXTensor(*quantize_mxfp8_triton(x, 32, act_quant))


def fused_experts_triton(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_quant: ScaleMode | None = None,
    config: GemmConfig | None = None,
    dot_scaled: bool | None = None,
    align: str = "torch",
) -> torch.Tensor:
    """Same contract as `fused_experts_torch`: x [T, H] -> [T, H] in x's dtype. `align` picks the
    token-to-expert alignment (`align_for`); both give the same tensors."""
    T, H = x.shape
    k = ids.shape[1]
    num_experts = w13.shape[0]
    cfg = config or default_config(T * k, num_experts)
    aligned = align_for(ids, num_experts, cfg.block_m, align)
    gate_up = moe_gemm(_activation(x, act_quant), w13, aligned, k, x.dtype, config=cfg, dot_scaled=dot_scaled)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    flat_weights = weights.reshape(-1).float().contiguous()
    y = moe_gemm(_activation(h, act_quant), w2, aligned, 1, torch.float32, weights=flat_weights, config=cfg,
                 dot_scaled=dot_scaled)
    return y.view(T, k, H).sum(dim=1).to(x.dtype)
