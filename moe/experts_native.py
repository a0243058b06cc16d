"""Native routed-expert path on CPU: router logits, then one native call for routing and one for
grouping + expert GEMMs + combine (`cuttle.attention.native.moe`), no per-expert Python loop.

Owns the decision of when a layer's forward may take it (`supports`, `supports_mxfp8` for MXFP8
experts, whose bytes the native panels read as stored, `supports_packed` for a layer that holds
only its packed panels) and the mapping from `RoutingConfig` to the native router's arguments. The torch path (`experts_torch.py`) stays the reference and the
fallback: activation quantization, autograd, non-CPU tensors and a process without the kernel
library all go there. Must never import `cuttle.engine`.
"""
from __future__ import annotations

import torch

from cuttle.attention.native import moe as native_moe
from cuttle.moe.mxfp8 import MXTensor
from cuttle.moe.routing import RoutingConfig, route, router_logits


def supports(x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the native path takes this call: CPU fp32/bf16 activations with dense rows, plain
    (not MXFP8) expert weights of the same dtype, nothing that autograd must see, library loaded."""
    return (
        x.device.type == "cpu" and x.dim() == 2 and x.dtype in native_moe.WEIGHT_FORMAT and x.stride(-1) == 1
        and isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        and w13.dtype == x.dtype and w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()
        and w13.device.type == "cpu" and w2.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad or gate_weight.requires_grad))
        and native_moe.available()
    )


def supports_mxfp8(x: torch.Tensor, gate_weight: torch.Tensor, w13: object, w2: object) -> bool:
    """Whether the native path takes MXFP8 experts (`MXTensor` pairs from `FusedMoE.quantize_`):
    CPU fp32/bf16 activations with dense rows, CPU weights, no autograd on x, library loaded."""
    return (
        x.device.type == "cpu" and x.dim() == 2 and x.dtype in native_moe.WEIGHT_FORMAT and x.stride(-1) == 1
        and isinstance(w13, MXTensor) and isinstance(w2, MXTensor)
        and w13.data.device.type == "cpu" and w2.data.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad))
        and native_moe.available()
    )


def supports_packed(x: torch.Tensor, gate_weight: torch.Tensor, packed: native_moe.PackedExperts) -> bool:
    """Whether the native path takes a layer whose experts are held packed (`FusedMoE.pack_`): CPU
    activations with dense rows (in the weights' dtype unless MXFP8), no autograd on x, library loaded."""
    return (
        x.device.type == "cpu" and x.dim() == 2 and x.dtype in native_moe.WEIGHT_FORMAT and x.stride(-1) == 1
        and native_moe.runs_on(packed.fmt, x.dtype)
        and not (torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad))
        and native_moe.available()
    )


def route_native(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.route` in one native call: (weights fp32 [T, k], ids int64 [T, k]). Rows where a
    selection is a (near-)tie are routed by `routing.route` itself, so the experts chosen are
    always the torch router's (bf16 logits tie often: 8 mantissa bits over many experts)."""
    sigmoid = cfg.scoring_func == "sigmoid"

    def settle(weights: torch.Tensor, ids: torch.Tensor, tied: torch.Tensor) -> None:
        weights[tied], ids[tied] = route(logits[tied], cfg, bias)

    weights, ids, tied = native_moe.route(
        logits, cfg.top_k, sigmoid, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
        bias.float().contiguous() if (sigmoid and bias is not None) else None, settle=settle,
    )
    if tied is not None:
        settle(weights, ids, tied)
    return weights, ids


def fused_moe_native(
    x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor | MXTensor | native_moe.PackedExperts,
    w2: torch.Tensor | MXTensor | None, cfg: RoutingConfig, bias: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None, epilogue: native_moe.Epilogue | None = None,
) -> torch.Tensor:
    """The whole routed-expert forward of one layer: x [T, H] -> [T, H] in x's dtype. Expert
    weights are x's dtype, or MXFP8 (`MXTensor`, read as stored by the MXFP8 panels), or both
    already packed (`PackedExperts` as w13, w2 None). gpt-oss: `gate_bias` (the router's) and
    `epilogue` (the experts' biases and clamped SwiGLU; packed weights in a widening layout)."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    # the logits stay torch's matmul, so the native path routes on the very logits the torch path does
    weights, ids = route_native(router_logits(x, gate_weight, cfg, gate_bias), cfg, bias)
    if isinstance(w13, native_moe.PackedExperts):
        return native_moe.experts_packed(x, w13, weights, ids, epilogue)
    if epilogue is not None:
        raise ValueError("expert epilogues run on packed experts only (FusedMoE.pack_)")
    if isinstance(w13, MXTensor) and isinstance(w2, MXTensor):
        return native_moe.experts_mxfp8(x, (w13.data, w13.scale), (w2.data, w2.scale), weights, ids)
    return native_moe.experts(x, w13, w2, weights, ids)
